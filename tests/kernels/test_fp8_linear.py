"""The FP8 GEMV and GEMM kernels against the torch reference, for block, per-row and fused-shard scale grids."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flare.kernels import fp8_linear as fp8_linear_module
from flare.kernels import fp8_gemm as fp8_gemm_module
from flare.kernels.fp8_gemm import TARGET_PROGRAMS, Fp8GemmConfig, candidates, fp8_gemm
from flare.kernels.fp8_gemv import Fp8GemvConfig, default_config, fp8_gemv
from flare.kernels.fp8_reference import dequantize, fp8_linear_reference, quantize_blocks, scale_grid
from flare.kernels.routing import DEQUANTIZE_MIN_ROWS, MAX_ROWS

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}
# (n, k, row_block, col_block): 128x128 blocks with partial edge blocks (stories260k's 172-wide MLP),
# blocks whose rows were spread to one scale per row (fused shards off the block boundary), per-row scales.
LAYOUTS = [
    (172, 64, 128, 128),
    (130, 160, 128, 128),
    (96, 172, 1, 128),
    (48, 100, 1, 0),
]
GEMV_FMA = Fp8GemvConfig(block_n=16, block_k=32, use_dot=False)
GEMV_DOT = Fp8GemvConfig(block_n=16, block_k=32, use_dot=True)
GEMM_SMALL = Fp8GemmConfig(block_m=16, block_n=16, block_k=32, group_m=2)


def fp8_weight(n, k, row_block, col_block, device, seed=0):
    """A random e4m3 weight and a scale grid with a spread of magnitudes, as a checkpoint would have."""
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(n, k, generator=generator) * 100).clamp(-448, 448).to(torch.float8_e4m3fn)
    grid = scale_grid(n, k, row_block, col_block)
    scale = torch.rand(grid, generator=generator) * 0.01 + 1e-4
    return weight.to(device), scale.to(device)


def relative_error(out, ref) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(kernel, rows, layout, dtype, device, with_bias, config):
    n, k, row_block, col_block = layout
    weight, scale = fp8_weight(n, k, row_block, col_block, device)
    x = torch.randn(rows, k, device=device).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    out = kernel(x, weight, scale, row_block, col_block, bias, config)
    ref = fp8_linear_reference(x.double(), weight, scale, row_block, col_block,
                               bias.double() if with_bias else None)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert torch.isfinite(out).all()                      # every element written (no stale memory)
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "x".join(map(str, layout)))
@pytest.mark.parametrize("config", [GEMV_FMA, GEMV_DOT], ids=["fma", "dot"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_matches_reference(kernel_device, layout, config, split_k):
    for rows in (1, 5):
        check(fp8_gemv, rows, layout, torch.float16, kernel_device, with_bias=rows == 1,
              config=replace(config, split_k=split_k))


@pytest.mark.parametrize("config", [GEMV_FMA, GEMV_DOT], ids=["fma", "dot"])
@pytest.mark.parametrize("rows", [1, 5])
def test_gemv_split_k_finished_in_the_kernel_equals_the_reduce_kernel(kernel_device, config, rows):
    from flare.kernels.tile_counters import tile_counters

    n, k, row_block, col_block = 130, 160, 128, 128
    weight, scale = fp8_weight(n, k, row_block, col_block, kernel_device)
    x = torch.randn(rows, k, device=kernel_device).to(torch.float16)
    bias = torch.randn(n, device=kernel_device).to(torch.float16)
    split = replace(config, split_k=3)
    separate = fp8_gemv(x, weight, scale, row_block, col_block, bias, split)
    for _ in range(2):                              # the second launch finds its counters zero again
        fused = fp8_gemv(x, weight, scale, row_block, col_block, bias, replace(split, fused_reduce=True))
        assert torch.equal(fused, separate)         # the same partials summed in the same order
    assert not tile_counters(torch.device(kernel_device), 1).any()


@pytest.mark.parametrize("rows", [1, 2, 4])
def test_gemv_in_float32(kernel_device, rows):
    check(fp8_gemv, rows, (40, 256, 8, 0), torch.float32, kernel_device, with_bias=True,
          config=replace(GEMV_FMA, split_k=2))
    check(fp8_gemv, rows, (130, 160, 128, 128), torch.float32, kernel_device, with_bias=False, config=GEMV_FMA)


@pytest.mark.parametrize("rows", [1, 2, 3, 8, MAX_ROWS])
def test_gemv_default_config(kernel_device, rows):
    check(fp8_gemv, rows, (172, 64, 128, 128), torch.float16, kernel_device, with_bias=True, config=None)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "x".join(map(str, layout)))
def test_gemm_matches_reference(kernel_device, layout):
    check(fp8_gemm, 40, layout, torch.float16, kernel_device, with_bias=True, config=GEMM_SMALL)
    check(fp8_gemm, 17, layout, torch.float32, kernel_device, with_bias=False, config=GEMM_SMALL)


# Split-K configs: the partial tiles of each K range summed by the reduction kernel (which adds the bias).
SPLIT_CONFIGS = [replace(GEMM_SMALL, block_m=32, block_n=32, split_k=2), replace(GEMM_SMALL, split_k=3),
                 Fp8GemmConfig(block_m=32, block_n=64, block_k=128, split_k=2, group_m=8)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "x".join(map(str, layout)))
@pytest.mark.parametrize("config", SPLIT_CONFIGS, ids=["32x32-split2", "16x16-split3", "32x64x128-split2"])
def test_split_k_gemm_matches_reference(kernel_device, layout, config):
    """M not a multiple of BLOCK_M (17, 40), N with edge tiles, K not a multiple of BLOCK_K or of 128."""
    check(fp8_gemm, 17, layout, torch.float32, kernel_device, with_bias=True, config=config)
    check(fp8_gemm, 40, layout, torch.float16, kernel_device, with_bias=False, config=config)


def test_split_k_gives_the_same_result_every_run(kernel_device):
    """The splits are summed in a fixed order: a token's result does not depend on which program ran first."""
    weight, scale = fp8_weight(130, 640, 128, 128, kernel_device)
    x = torch.randn(20, 640, device=kernel_device, dtype=torch.float16)
    config = replace(GEMM_SMALL, block_k=32, split_k=4)
    first = fp8_gemm(x, weight, scale, 128, 128, None, config)
    assert all(torch.equal(first, fp8_gemm(x, weight, scale, 128, 128, None, config)) for _ in range(3))


@pytest.mark.parametrize("rows", sorted({r for r in (17, 24, 32, 64, 128) if r < DEQUANTIZE_MIN_ROWS} | {DEQUANTIZE_MIN_ROWS - 1}))
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (28672, 4096), (4096, 4096)])
def test_skinny_configs_fill_the_gpu(rows, n, k):
    """The GPU table: the smallest of 16/32/64 rows holding M, and enough programs for two per H200 SM."""
    config = fp8_gemm_module.default_config(rows, n, k, "cuda")
    assert config.block_m == next((b for b in (16, 32, 64) if b >= rows), 64)
    assert config.block_k == 128 and config.block_n in (64, 128)
    programs = -(-rows // config.block_m) * -(-n // config.block_n) * config.split_k
    assert programs >= TARGET_PROGRAMS
    assert k // config.split_k >= fp8_gemm_module.MIN_K_PER_SPLIT
    assert candidates(rows, n, k)[0] == config and len(set(candidates(rows, n, k))) == len(candidates(rows, n, k))


def test_routing_picks_the_kernel_by_rows(kernel_device, monkeypatch):
    """torch.ops.flare.fp8_linear's weight-only routes: the GEMV up to MAX_ROWS, the skinny GEMM below
    DEQUANTIZE_MIN_ROWS, dequantize + cuBLAS from there (float32 here, which W8A8 does not take: on a GPU
    bf16 activations from W8A8_MIN_ROWS go to _scaled_mm, tests/kernels/test_fp8_w8a8.py); each route
    gives the reference product."""
    calls = []
    for name in ("fp8_gemv", "fp8_gemm", "dequantize_linear"):
        kernel = getattr(fp8_linear_module, name)
        monkeypatch.setattr(fp8_linear_module, name,
                            lambda *args, _kernel=kernel, _name=name: calls.append(_name) or _kernel(*args))
    weight, scale = fp8_weight(48, 64, 1, 0, kernel_device)
    routes = {1: "fp8_gemv", MAX_ROWS: "fp8_gemv", MAX_ROWS + 1: "fp8_gemm", DEQUANTIZE_MIN_ROWS - 1: "fp8_gemm",
              DEQUANTIZE_MIN_ROWS: "dequantize_linear", DEQUANTIZE_MIN_ROWS + 40: "dequantize_linear"}
    for rows, expected in routes.items():
        x = torch.randn(rows, 64, device=kernel_device)
        out = torch.ops.flare.fp8_linear(x, weight, scale, None, 1, 0)
        assert calls.pop() == expected, f"{rows} rows"
        assert relative_error(out, fp8_linear_reference(x.double(), weight, scale, 1, 0)) < 1e-5


def test_gemm_default_config_and_leading_dimensions(kernel_device):
    weight, scale = fp8_weight(64, 96, 1, 0, kernel_device)
    x = torch.randn(3, 7, 96, device=kernel_device, dtype=torch.float16)
    out = fp8_gemm(x, weight, scale, 1, 0)
    assert out.shape == (3, 7, 64)
    assert relative_error(out, fp8_linear_reference(x.double(), weight, scale, 1, 0)) < 2e-3


def test_the_scale_grid_must_fit_the_weight(kernel_device):
    weight, scale = fp8_weight(172, 64, 128, 128, kernel_device)
    x = torch.randn(1, 64, device=kernel_device)
    with pytest.raises(ValueError, match=r"scale must be float32 \[2, 1\]"):
        fp8_gemv(x, weight, scale[:1], 128, 128)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        fp8_gemm(x, weight.float(), scale, 128, 128)


def test_quantize_blocks_round_trips_to_e4m3_precision():
    """Every block's largest value maps to 448 and back; values come back within e4m3's relative step."""
    weight = torch.randn(300, 172, generator=torch.Generator().manual_seed(3)) * torch.logspace(-3, 1, 172)
    q, scale = quantize_blocks(weight, (128, 128))
    assert q.dtype == torch.float8_e4m3fn and scale.shape == (3, 2)
    back = dequantize(q, scale, 128, 128)
    assert torch.allclose(back.abs().amax(), weight.abs().amax())
    tiny = scale.repeat_interleave(128, 0)[:300].repeat_interleave(128, 1)[:, :172] * 2 ** -9
    assert ((back - weight).abs() <= weight.abs() * 2 ** -4 + tiny).all()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is wrong in Triton's interpreter")
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 2, 8, 16, 33, 64, 200, 512])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1000, 1000)])
def test_bf16_on_gpu(rows, n, k):
    kernel = fp8_gemv if rows <= MAX_ROWS else fp8_gemm
    for layout in ((n, k, 128, 128), (n, k, 1, 0)):
        check(kernel, rows, layout, torch.bfloat16, "cuda", with_bias=rows in (2, 33), config=None)
        if kernel is fp8_gemm:
            for config in candidates(rows, n, k):
                check(kernel, rows, layout, torch.bfloat16, "cuda", with_bias=True, config=config)
        if kernel is fp8_gemv:
            config = default_config(rows, n, k)
            check(kernel, rows, layout, torch.bfloat16, "cuda", with_bias=True,
                  config=replace(config, use_dot=not config.use_dot))
