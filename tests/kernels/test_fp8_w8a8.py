"""W8A8 FP8 products: the activation quantization kernel against its torch reference (CPU, interpreter),
and on a GPU the whole product (quantization + torch._scaled_mm) against the float32 W8A8 reference, as
torch.ops.flare.fp8_linear routes it from W8A8_MIN_ROWS."""

from __future__ import annotations

import pytest
import torch

from flare.kernels import fp8_linear as fp8_linear_module
from flare.kernels.fp8_reference import (E4M3_MAX, fp8_linear_reference, quantize_activations_reference,
                                         w8a8_linear_reference)
from flare.kernels.fp8_w8a8 import GROUP, quantize_activations, w8a8_linear, w8a8_supported
from flare.kernels.routing import MAX_ROWS, W8A8_MIN_ROWS

from test_fp8_linear import fp8_weight, relative_error


def activations(rows: int, k: int, dtype) -> torch.Tensor:
    """Rows of very different magnitudes (each row and group gets a scale of its own); from three rows on,
    the middle one all zero."""
    generator = torch.Generator().manual_seed(rows * 7 + k)
    x = torch.randn(rows, k, generator=generator) * torch.logspace(-2, 2, rows)[:, None]
    x[:, :GROUP] *= 30.0                                         # one group far larger than the rest
    if rows >= 3:
        x[rows // 2] = 0.0
    return x.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("group,k", [(GROUP, 384), (GROUP, 1152), (0, 1000), (0, 3000)])
def test_quantization_matches_reference(kernel_device, dtype, group, k):
    x = activations(5, k, dtype)
    quantized, scale = quantize_activations(x.to(kernel_device), group)
    expected_q, expected_scale = quantize_activations_reference(x, group)
    assert quantized.dtype == torch.float8_e4m3fn and quantized.shape == x.shape
    assert scale.shape == expected_scale.shape == (5, k // group if group else 1)
    torch.testing.assert_close(scale.cpu(), expected_scale, rtol=1e-6, atol=0)
    assert torch.equal(quantized.cpu().float(), expected_q.float())
    assert scale[2].tolist() == [1.0] * scale.shape[1]           # the zero row: scale 1, values 0
    assert quantized[2].float().abs().max() == 0
    # every group's largest value maps to 448: nothing saturates
    top = quantized.cpu().float().abs().reshape(5, -1, group or k).amax(-1)
    assert ((top == E4M3_MAX) | (top == 0)).all()


def test_rounding_to_e4m3_is_to_nearest_even_everywhere(kernel_device):
    """Every e4m3 value, the midpoints between neighbours (ties: to even), and points just off them, in a
    row whose largest value is 448 (scale 1): each lands where torch's cast puts it, subnormals included."""
    values = torch.arange(0, 127, dtype=torch.uint8).view(torch.float8_e4m3fn).float()   # 0 ... 448
    mids = (values[1:] + values[:-1]) / 2
    row = torch.cat([values, mids, mids * (1 + 2 ** -20), mids * (1 - 2 ** -20)])
    row = torch.cat([row, -row])
    x = torch.nn.functional.pad(row, (0, -row.numel() % GROUP))[None, :]
    for group in (GROUP, 0):
        quantized, scale = quantize_activations(x.to(kernel_device), group)
        if group == 0:
            assert scale.item() == 1.0
        expected, _ = quantize_activations_reference(x, group)
        assert torch.equal(quantized.cpu().float(), expected.float())


def test_padded_rows_are_zero_with_scale_one(kernel_device):
    """cuBLAS's block-wise mode takes a multiple of 4 rows: the padding quantizes to 0 with scale 1 and
    leaves the real rows as they are without it."""
    x = activations(5, 256, torch.float32).to(kernel_device)
    quantized, scale = quantize_activations(x, GROUP)
    padded_q, padded_scale = quantize_activations(x, GROUP, rows=8)
    assert padded_q.shape == (8, 256) and padded_scale.shape == (8, 2) and padded_scale.stride() == (1, 8)
    assert torch.equal(padded_q[:5].float(), quantized.float()) and torch.equal(padded_scale[:5], scale)
    assert padded_q[5:].float().abs().max() == 0 and padded_scale[5:].tolist() == [[1.0, 1.0]] * 3


def test_block_scales_are_laid_out_as_cublas_reads_them(kernel_device):
    """Column-major [M, K/128]: cuBLAS's block-wise mode reads each group's scales for all rows together."""
    _, scale = quantize_activations(activations(3, 256, torch.float32).to(kernel_device), GROUP)
    assert scale.stride() == (1, 3)


def test_quantization_refuses_what_it_cannot_group(kernel_device):
    with pytest.raises(ValueError, match="groups of 128"):
        quantize_activations(torch.ones(2, 200, device=kernel_device), GROUP)
    with pytest.raises(ValueError, match="contiguous"):
        quantize_activations(torch.ones(256, 2, device=kernel_device).t(), 0)


def test_w8a8_reference_rounds_only_the_activations():
    """The reference is the weight-only product of x after its own e4m3 round trip."""
    weight, scale = fp8_weight(64, 256, 128, 128, "cpu")
    x = activations(4, 256, torch.float32)
    quantized, x_scale = quantize_activations_reference(x, GROUP)
    x_back = quantized.float() * x_scale.repeat_interleave(GROUP, dim=1)
    torch.testing.assert_close(w8a8_linear_reference(x, weight, scale, 128, 128),
                               fp8_linear_reference(x_back, weight, scale, 128, 128))
    assert relative_error(x_back, x) < 2 ** -4                   # e4m3's step, relative


def test_off_the_gpu_the_w8a8_rows_take_the_weight_only_route(kernel_device, monkeypatch):
    """_scaled_mm needs a CUDA device: elsewhere W8A8_MIN_ROWS rows run the weight-only kernels."""
    if kernel_device == "cuda":
        pytest.skip("on a GPU the W8A8 route runs (test_w8a8_on_gpu)")
    calls = []
    monkeypatch.setattr(fp8_linear_module, "weight_only",
                        lambda *args, _f=fp8_linear_module.weight_only: calls.append(args) or _f(*args))
    weight, scale = fp8_weight(48, 64, 1, 0, kernel_device)
    x = torch.randn(W8A8_MIN_ROWS, 64, device=kernel_device)
    out = torch.ops.flare.fp8_linear(x, weight, scale, None, 1, 0)
    assert len(calls) == 1
    assert relative_error(out, fp8_linear_reference(x.double(), weight, scale, 1, 0)) < 1e-5


needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="torch._scaled_mm needs a CUDA GPU")


@needs_gpu
@pytest.mark.gpu
@pytest.mark.parametrize("rows", [1, 3, W8A8_MIN_ROWS, 33, 64, 201, 2048])
@pytest.mark.parametrize("n,k", [(6144, 4096), (4096, 14336), (1024, 384)])
@pytest.mark.parametrize("layout", [(128, 128), (1, 0)], ids=["block128", "per-row"])
def test_w8a8_on_gpu(rows, n, k, layout):
    """W8A8 at any row count (block-wise pads to 4 rows) matches the float32 W8A8 reference to bf16's
    precision, and the routed operator takes it from W8A8_MIN_ROWS (the GPU quantizes exactly as the reference; what differs is bf16 output rounding and
    summation order)."""
    row_block, col_block = layout
    if not w8a8_supported(n, k, row_block, col_block, torch.bfloat16, 0):
        pytest.skip("this GPU or torch build has no _scaled_mm for the layout")
    weight, scale = fp8_weight(n, k, row_block, col_block, "cuda")
    x = activations(rows, k, torch.float32).to("cuda", torch.bfloat16)
    bias = torch.randn(n, device="cuda", dtype=torch.bfloat16) if rows == 33 else None
    expected = w8a8_linear_reference(x.double(), weight, scale, row_block, col_block,
                                     None if bias is None else bias.double())
    out = w8a8_linear(x, weight, scale, row_block, col_block, bias)
    assert out.dtype == torch.bfloat16 and out.shape == (rows, n)
    if rows >= W8A8_MIN_ROWS:                                    # what the operator routes here
        assert torch.equal(torch.ops.flare.fp8_linear(x, weight, scale, bias, row_block, col_block), out)
    assert relative_error(out, expected) < 1e-2
    q, s = quantize_activations(x, col_block and GROUP)
    q_ref, s_ref = quantize_activations_reference(x.cpu(), col_block and GROUP)
    torch.testing.assert_close(s.cpu(), s_ref, rtol=1e-6, atol=0)
    assert torch.equal(q.cpu().float(), q_ref.float())


@needs_gpu
@pytest.mark.gpu
def test_decode_rows_keep_unquantized_activations():
    """Below W8A8_MIN_ROWS (decode batches) the product is weight-only: closer to the unquantized-activation
    reference than W8A8 could be."""
    weight, scale = fp8_weight(1024, 384, 128, 128, "cuda")
    x = activations(MAX_ROWS, 384, torch.float32).to("cuda", torch.bfloat16)
    out = torch.ops.flare.fp8_linear(x, weight, scale, None, 128, 128)
    assert relative_error(out, fp8_linear_reference(x.double(), weight, scale, 128, 128)) < 1e-2 / 4
