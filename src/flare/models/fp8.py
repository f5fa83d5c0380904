"""FP8 projections: the layer the models build when a projection is stored in FP8.

`Fp8Linear` keeps the weight as float8 e4m3 [N, K] and its scales as one float32 grid whatever the
checkpoint's layout (`ScaleLayout`): a 128x128 block's scale, an output channel's, or a projection's
(spread over its rows, so fused q/k/v with three per-tensor scales are one matrix). On CUDA the product
runs flare.kernels.fp8_linear: weight-only (dequantized in registers) for decode batches, and from
W8A8_MIN_ROWS rows with the activations quantized to e4m3 as well, for torch._scaled_mm (layouts it
cannot take dequantize into the device's one shared bf16 buffer for cuBLAS: flare.kernels.fp8_scratch,
which each layer reserves its size in). Elsewhere it runs in torch (flare.kernels.fp8_reference, which
the kernels are tested against; weight-only at every row count).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass

import torch
from torch import nn

from flare.kernels import fp8_scratch, routing
from flare.kernels.fp8_reference import fp8_linear_reference, quantize_blocks, scale_grid
from flare.models.errors import WeightError
from flare.models.quantization import Fp8Weights, online_conversion

FP8 = torch.float8_e4m3fn


@dataclass(frozen=True)
class ScaleLayout:
    """Which weights one scale covers: `row_block` rows by `col_block` columns (0: the whole row)."""

    row_block: int
    col_block: int


def scale_layout(fp8: Fp8Weights, shard_rows) -> ScaleLayout:
    """Block scales stay blocks when every fused shard starts on a block boundary; otherwise (small
    models) each row gets its own copy of its block's scale. Channel and tensor scales become one per row."""
    if fp8.granularity != "block":
        return ScaleLayout(1, 0)
    block_rows, block_columns = fp8.block
    aligned = all(rows % block_rows == 0 for rows in shard_rows)
    return ScaleLayout(block_rows if aligned else 1, block_columns)


def online_fp8_tensors(weights: Iterable[tuple[str, torch.Tensor]], fp8: Fp8Weights) -> Iterator[tuple[str, torch.Tensor]]:
    """A BF16 checkpoint's tensors as the online FP8 export stores them: each projection weight `fp8`
    converts becomes its e4m3 blocks and their float32 `weight_scale_inv` (flare.kernels.fp8_reference
    .quantize_blocks); every other tensor passes unchanged."""
    for name, tensor in weights:
        conversion = online_conversion(name, tuple(tensor.shape), fp8)
        if conversion is None:
            yield name, tensor
            continue
        quantized, scale = quantize_blocks(tensor, fp8.block)
        yield name, quantized
        yield conversion[0], scale


class Fp8Linear(nn.Module):
    """`y = x Wᵀ (+ b)` for W stored in FP8; a fused one names its shards after the checkpoint's projections.

    Parameters: `weight` (e4m3 [N, K]), `weight_scale` (float32 grid, loaded from the checkpoint's
    `fp8.scale_suffix` tensors), `bias` in the serving dtype. Checkpoint `input_scale` tensors (static
    activation scales) are accepted and not used: where activations are quantized (the W8A8 route) their
    scales are computed per token from the values themselves.
    """

    unused_tensors = ("input_scale",)

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool, fp8: Fp8Weights) -> None:
        from flare.models.layers import _parameter, _shard_offsets

        super().__init__()
        out_features = sum(shard_sizes.values())
        self.fp8, self.in_features = fp8, in_features
        self.layout = scale_layout(fp8, shard_sizes.values())
        self.weight = _parameter(out_features, in_features, shard_sizes=shard_sizes, dtype=FP8)
        grid = scale_grid(out_features, in_features, self.layout.row_block, self.layout.col_block)
        self.weight_scale = nn.Parameter(torch.empty(*grid, dtype=torch.float32), requires_grad=False)
        self.weight_scale.shards = _shard_offsets(shard_sizes)       # in weight rows, as the weight's
        self.weight_scale.weight_loader = self._load_scale
        self.weight_scale.checkpoint_suffix = fp8.scale_suffix
        self.bias = _parameter(out_features, shard_sizes=shard_sizes) if bias else None
        if self.weight.device.type == "cuda":
            routing.load_fp8_kernels()                               # registers torch.ops.flare.fp8_linear
            fp8_scratch.reserve(self.weight.device, out_features, in_features)   # dequantized from DEQUANTIZE_MIN_ROWS

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        layout = self.layout
        if routing.routes_fp8_to_kernels(x):
            return torch.ops.flare.fp8_linear(x, self.weight, self.weight_scale, self.bias, layout.row_block,
                                              layout.col_block)
        return fp8_linear_reference(x, self.weight, self.weight_scale, layout.row_block, layout.col_block, self.bias)

    def _load_scale(self, param: nn.Parameter, tensor: torch.Tensor, shard, name: str) -> None:
        """Copy one projection's scales into the grid rows of its shard, in this layer's layout."""
        start, rows = param.shards[shard]
        spread = self._checkpoint_scale_rows(tensor, rows, name)
        if not torch.isfinite(spread).all() or (spread < 0).any():
            raise WeightError(f"checkpoint tensor {name} holds negative or non-finite scales; the checkpoint "
                              "is corrupt")
        layout = self.layout
        first = start // layout.row_block
        param.data[first : first + spread.shape[0]].copy_(spread)

    def _checkpoint_scale_rows(self, tensor: torch.Tensor, rows: int, name: str) -> torch.Tensor:
        """A checkpoint scale tensor as grid rows of this layer's layout (its shard's part of the grid)."""
        fp8, layout = self.fp8, self.layout
        if fp8.granularity == "tensor":
            expected = "one value"
            if tensor.numel() == 1:
                return tensor.reshape(1, 1).float().expand(rows, 1)
        elif fp8.granularity == "channel":
            expected = f"[{rows}, 1]"
            if tensor.numel() == rows and tensor.dim() in (1, 2):
                return tensor.reshape(rows, 1).float()
        else:
            block_rows, block_columns = fp8.block
            shape = (-(-rows // block_rows), -(-self.in_features // block_columns))
            expected = str(list(shape))
            if tuple(tensor.shape) == shape:
                grid = tensor.float()
                return grid if layout.row_block == block_rows else grid.repeat_interleave(block_rows, 0)[:rows]
        raise WeightError(f"checkpoint tensor {name} has shape {list(tensor.shape)} but {fp8.granularity} scales "
                          f"of this projection are {expected}; the checkpoint does not match its config.json")
