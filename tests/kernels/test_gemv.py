"""The decode gemv kernel (measured by benchmarks/gemv_bench.py) against its torch reference."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from flare.kernels.gemv import MAX_ROWS, GemvConfig, default_config, gemv, gemv_reference

TOLERANCE = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1e-2}

# Small tiles keep the interpreter fast; the shapes are not multiples of them.
FMA = GemvConfig(block_n=16, block_k=32, use_dot=False)
DOT = GemvConfig(block_n=16, block_k=32, use_dot=True)
CASES = [  # (n, k): exact tiles, ragged n, ragged k, both ragged and several K steps
    (32, 64),
    (37, 64),
    (48, 100),
    (29, 161),
]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    return ((out.double() - ref.double()).norm() / ref.double().norm()).item()


def check(rows, n, k, dtype, device, config, with_bias):
    x = torch.randn(rows, k, device=device).to(dtype)
    weight = torch.randn(n, k, device=device).to(dtype)
    bias = torch.randn(n, device=device).to(dtype) if with_bias else None
    out = gemv(x, weight, bias, config)
    ref = x.double() @ weight.double().T + (bias.double() if with_bias else 0)
    assert out.shape == (rows, n) and out.dtype == dtype
    assert torch.isfinite(out).all()                       # every element written (no stale memory)
    assert relative_error(out, ref) < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("n,k", CASES)
@pytest.mark.parametrize("config", [FMA, DOT], ids=["fma", "dot"])
@pytest.mark.parametrize("split_k", [1, 3])
def test_gemv_matches_reference(kernel_device, dtype, n, k, config, split_k):
    for rows in (1, 3, 8):
        config_k = replace(config, split_k=split_k)
        check(rows, n, k, dtype, kernel_device, config_k, with_bias=rows != 3)


@pytest.mark.parametrize("rows", range(1, MAX_ROWS + 1))
def test_every_row_count_with_default_config(kernel_device, rows):
    check(rows, 40, 96, torch.float16, kernel_device, None, with_bias=True)


@pytest.mark.parametrize("config", [FMA, DOT], ids=["fma", "dot"])
@pytest.mark.parametrize("split_k", [1, 4])
def test_leading_dimensions_and_bias_split(kernel_device, config, split_k):
    """x [..., K] keeps its leading shape; the bias is added once, after the split-K partials are summed."""
    x = torch.randn(2, 3, 64, device=kernel_device, dtype=torch.float16)
    weight = torch.randn(24, 64, device=kernel_device, dtype=torch.float16)
    bias = torch.randn(24, device=kernel_device, dtype=torch.float16)
    out = gemv(x, weight, bias, replace(config, split_k=split_k))
    assert out.shape == (2, 3, 24)
    assert relative_error(out, gemv_reference(x.float(), weight.float(), bias.float())) < 2e-3


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is wrong in Triton's interpreter")
@pytest.mark.parametrize("rows", [1, 2, 4, 8, 16])
@pytest.mark.parametrize("n,k", [(4096, 4096), (1000, 14336), (6144, 4096)])
def test_bf16_on_gpu(rows, n, k):
    config = default_config(rows, n, k)
    check(rows, n, k, torch.bfloat16, "cuda", config, with_bias=False)
    check(rows, n, k, torch.bfloat16, "cuda", replace(config, use_dot=not config.use_dot),
          with_bias=True)


def test_too_many_rows_is_refused(kernel_device):
    weight = torch.randn(8, 32, device=kernel_device)
    with pytest.raises(ValueError, match="rows"):
        gemv(torch.randn(MAX_ROWS + 1, 32, device=kernel_device), weight)


def test_default_config_splits_k_only_when_the_grid_is_small():
    assert default_config(1, 4096, 14336).split_k > 1          # 128 tiles: split to fill the GPU
    assert default_config(1, 128256, 4096).split_k == 1        # thousands of tiles already
    assert default_config(1, 4096, 1024).split_k == 1          # K too short to split
    assert not default_config(1, 4096, 4096).use_dot and default_config(8, 4096, 4096).use_dot
