"""The FP8 weight format in plain torch: quantize, dequantize, and the product the FP8 kernels compute.

No Triton here: the CPU path of `flare.models.fp8.Fp8Linear` and the online FP8 export use these
functions, and the kernels' tests compare against them.

A weight is float8 e4m3 [N, K] with a float32 scale grid [ceil(N/row_block), ceil(K/col_block)]:
the scale at [i, j] multiplies the weights of rows i*row_block.. and columns j*col_block..;
`col_block` 0 means one column (a scale per row, or per group of `row_block` rows).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

E4M3_MAX = 448.0


def scale_grid(rows: int, columns: int, row_block: int, col_block: int) -> tuple[int, int]:
    """The scale grid's shape for a [rows, columns] weight."""
    return -(-rows // row_block), 1 if col_block == 0 else -(-columns // col_block)


def dequantize(weight: torch.Tensor, scale: torch.Tensor, row_block: int, col_block: int) -> torch.Tensor:
    """The float32 [N, K] weight that `weight` (e4m3) and its scale grid stand for."""
    rows, columns = weight.shape
    spread = scale.float().repeat_interleave(row_block, dim=0)[:rows]
    if col_block:
        spread = spread.repeat_interleave(col_block, dim=1)[:, :columns]
    return weight.float() * spread


def fp8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int,
                         col_block: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """`x @ dequantize(weight).T (+ bias)` in float32, cast to x's dtype."""
    out = x.float() @ dequantize(weight, scale, row_block, col_block).T
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


def quantize_blocks(weight: torch.Tensor, block: tuple[int, int]) -> tuple[torch.Tensor, torch.Tensor]:
    """`weight` [N, K] as e4m3 and float32 scales [ceil(N/bn), ceil(K/bk)]: each block's absolute maximum
    / 448, so no value saturates (partial blocks at the edges are blocks of their own; an all-zero
    block gets scale 1). `dequantize(q, scale, bn, bk)` gives the weight back to e4m3's precision."""
    rows, columns = weight.shape
    block_rows, block_columns = block
    grid_rows, grid_columns = scale_grid(rows, columns, block_rows, block_columns)
    padded = F.pad(weight.float(), (0, grid_columns * block_columns - columns, 0, grid_rows * block_rows - rows))
    tiles = padded.view(grid_rows, block_rows, grid_columns, block_columns)
    amax = tiles.abs().amax(dim=(1, 3))
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    quantized = (tiles / scale[:, None, :, None]).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn)
    return quantized.view(padded.shape)[:rows, :columns].contiguous(), scale


def quantize_activations_reference(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] as e4m3 and float32 scales [M, K // group] (group 0: [M, 1], one per row): each group's
    absolute maximum / 448 (an all-zero group: 1). What flare.kernels.fp8_w8a8 computes on the GPU."""
    m, k = x.shape
    groups = x.float().reshape(m, -1, group) if group else x.float().reshape(m, 1, k)
    amax = groups.abs().amax(dim=-1, keepdim=True)
    scale = torch.where(amax > 0, amax / E4M3_MAX, torch.ones_like(amax))
    quantized = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(torch.float8_e4m3fn).reshape(m, k)
    return quantized, scale.squeeze(-1)


def w8a8_linear_reference(x: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor, row_block: int,
                          col_block: int, bias: torch.Tensor | None = None) -> torch.Tensor:
    """The W8A8 product in float32: x rounded to e4m3 per 128 columns (block weights) or per row (per-row
    weights) as `quantize_activations_reference` does, times the dequantized weight (+ bias)."""
    group = col_block and 128
    quantized, x_scale = quantize_activations_reference(x.reshape(-1, x.shape[-1]), group)
    spread = x_scale.repeat_interleave(group, dim=1) if group else x_scale
    x_back = (quantized.float() * spread).reshape(x.shape)
    return fp8_linear_reference(x_back, weight, scale, row_block, col_block, bias).to(x.dtype)
