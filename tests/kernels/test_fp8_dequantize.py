"""The one-pass FP8 dequantize kernel and its shared buffer: what prompt steps from DEQUANTIZE_MIN_ROWS rows
hand to cuBLAS must be exactly the reference's dequantized weight."""

from __future__ import annotations

import pytest
import torch

from flare.kernels import fp8_scratch
from flare.kernels.fp8_dequantize import dequantize_linear, fp8_dequantize
from flare.kernels.fp8_reference import dequantize, fp8_linear_reference
from test_fp8_linear import LAYOUTS, fp8_weight, relative_error


@pytest.fixture
def fresh_scratch(monkeypatch):
    """The shared buffers as a process starts: none allocated, none reserved."""
    monkeypatch.setattr(fp8_scratch, "_reserved", {})
    monkeypatch.setattr(fp8_scratch, "_buffers", {})
    monkeypatch.setattr(fp8_scratch, "_retired", [])


@pytest.mark.parametrize("layout", LAYOUTS + [(40, 256, 8, 0), (64, 96, 1, 32)], ids=lambda l: "x".join(map(str, l)))
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_dequantize_is_the_reference_exactly(kernel_device, layout, dtype):
    n, k, row_block, col_block = layout
    weight, scale = fp8_weight(n, k, row_block, col_block, kernel_device, seed=n + k)
    out = fp8_dequantize(weight, scale, row_block, col_block, dtype)
    assert out.shape == (n, k) and out.dtype == dtype
    assert torch.equal(out, dequantize(weight, scale, row_block, col_block).to(dtype))


def test_dequantize_writes_into_the_buffer_it_is_given(kernel_device):
    weight, scale = fp8_weight(130, 160, 128, 128, kernel_device)
    out = torch.full((130, 160), float("nan"), device=kernel_device)
    assert fp8_dequantize(weight, scale, 128, 128, torch.float32, out) is out
    assert torch.equal(out, dequantize(weight, scale, 128, 128))
    with pytest.raises(ValueError, match=r"out must be contiguous torch.float16 \[130, 160\]"):
        fp8_dequantize(weight, scale, 128, 128, torch.float16, out)


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda layout: "x".join(map(str, layout)))
def test_dequantize_linear_matches_the_reference(kernel_device, fresh_scratch, layout):
    n, k, row_block, col_block = layout
    weight, scale = fp8_weight(n, k, row_block, col_block, kernel_device)
    for dtype, tolerance in ((torch.float32, 1e-5), (torch.float16, 2e-3)):
        x = torch.randn(2, 9, k, device=kernel_device).to(dtype)
        bias = torch.randn(n, device=kernel_device).to(dtype)
        out = dequantize_linear(x, weight, scale, row_block, col_block, bias)
        assert out.shape == (2, 9, n) and out.dtype == dtype
        ref = fp8_linear_reference(x.double(), weight, scale, row_block, col_block, bias.double())
        assert relative_error(out, ref) < tolerance


def test_projections_share_one_buffer_of_the_reserved_size(fresh_scratch):
    """The first allocation holds the largest reserved weight, so later projections never reallocate
    (a captured graph keeps the address); a request beyond it gets a new buffer."""
    device = torch.device("cpu")
    fp8_scratch.reserve(device, 64, 96)
    fp8_scratch.reserve(device, 32, 32)
    small = fp8_scratch.scratch(device, torch.float16, 8, 16)
    large = fp8_scratch.scratch(device, torch.float16, 64, 96)
    assert small.shape == (8, 16) and large.shape == (64, 96)
    assert small.data_ptr() == large.data_ptr()
    assert fp8_scratch.scratch(device, torch.float32, 8, 16).data_ptr() != small.data_ptr()   # per dtype
    grown = fp8_scratch.scratch(device, torch.float16, 100, 100)
    assert grown.data_ptr() != small.data_ptr()
    assert fp8_scratch.scratch(device, torch.float16, 64, 96).data_ptr() == grown.data_ptr()


def test_dequantize_linear_reuses_the_shared_buffer(kernel_device, fresh_scratch):
    device = torch.device(kernel_device)
    if device.type == "cuda":
        device = torch.device("cuda", torch.cuda.current_device())
    fp8_scratch.reserve(device, 172, 64)
    first = fp8_weight(172, 64, 128, 128, kernel_device)
    second = fp8_weight(48, 64, 1, 0, kernel_device, seed=1)
    x = torch.randn(5, 64, device=kernel_device)
    dequantize_linear(x, *first, 128, 128)
    buffer = fp8_scratch.scratch(device, torch.float32, 172, 64)
    assert torch.equal(buffer, dequantize(*first, 128, 128))           # the weight cuBLAS multiplied
    out = dequantize_linear(x, *second, 1, 0)
    assert torch.equal(fp8_scratch.scratch(device, torch.float32, 48, 64), dequantize(*second, 1, 0))
    assert relative_error(out, fp8_linear_reference(x.double(), *second, 1, 0)) < 1e-5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="bf16 tl.dot is wrong in Triton's interpreter")
@pytest.mark.gpu
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (300, 200)])
def test_bf16_on_gpu(n, k):
    for row_block, col_block in ((128, 128), (1, 0), (1, 128)):
        weight, scale = fp8_weight(n, k, row_block, col_block, "cuda")
        out = fp8_dequantize(weight, scale, row_block, col_block, torch.bfloat16)
        assert torch.equal(out, dequantize(weight, scale, row_block, col_block).to(torch.bfloat16))
        x = torch.randn(300, k, device="cuda").to(torch.bfloat16)
        bias = torch.randn(n, device="cuda").to(torch.bfloat16)
        ref = fp8_linear_reference(x.double(), weight, scale, row_block, col_block, bias.double())
        assert relative_error(dequantize_linear(x, weight, scale, row_block, col_block, bias), ref) < 1e-2
