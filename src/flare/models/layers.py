"""The layers every family is built from. Each layer owns how its checkpoint tensors load into it.

Parameters are created with `torch.empty` (no random initialisation): every value comes from the
checkpoint. A parameter's `weight_loader(param, tensor, shard, name)` copies one checkpoint tensor
into it: one shard of a fused parameter (q/k/v, gate/up), or the whole of a plain one (shard `None`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from flare.models.errors import WeightError
from flare.models.quantization import Fp8Weights


def _parameter(*shape: int, shard_sizes: dict | None = None, dtype: torch.dtype | None = None) -> nn.Parameter:
    """An uninitialised parameter whose rows are filled by the named shards (one shard `None` when unfused)."""
    param = nn.Parameter(torch.empty(*shape, dtype=dtype), requires_grad=False)
    param.shards = _shard_offsets(shard_sizes or {None: shape[0]})
    param.weight_loader = load_rows
    return param


def _shard_offsets(shard_sizes: dict) -> dict:
    offsets, start = {}, 0
    for shard, size in shard_sizes.items():
        offsets[shard] = (start, size)
        start += size
    return offsets


def load_rows(param: nn.Parameter, tensor: torch.Tensor, shard, name: str) -> None:
    """Copy checkpoint tensor `name` into the rows `param.shards[shard]`, after checking its shape."""
    start, size = param.shards[shard]
    expected = (size, *param.shape[1:])
    if tuple(tensor.shape) != expected:
        raise WeightError(
            f"checkpoint tensor {name} has shape {list(tensor.shape)} but the model expects {list(expected)}; "
            "the checkpoint does not match its config.json"
        )
    if _is_fp8(tensor.dtype) != _is_fp8(param.dtype):
        stored, expected = (("FP8", "unquantized") if _is_fp8(tensor.dtype) else (str(tensor.dtype).removeprefix("torch."), "FP8"))
        raise WeightError(
            f"checkpoint tensor {name} is {stored}, but the model expects it {expected}: the checkpoint does not "
            "match the quantization_config of its config.json"
        )
    param.data[start : start + size].copy_(tensor)


def _is_fp8(dtype: torch.dtype) -> bool:
    return dtype in (torch.float8_e4m3fn, torch.float8_e5m2)


class RMSNorm(nn.Module):
    """Root-mean-square norm over the last dimension, in float32 as transformers computes it."""

    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = _parameter(size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        normed = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * normed.to(x.dtype)


class Linear(nn.Module):
    """`y = x W^T (+ b)`; a fused one names its shards after the checkpoint's separate projections."""

    def __init__(self, in_features: int, shard_sizes: dict, bias: bool = False) -> None:
        super().__init__()
        out_features = sum(shard_sizes.values())
        self.weight = _parameter(out_features, in_features, shard_sizes=shard_sizes)
        self.bias = _parameter(out_features, shard_sizes=shard_sizes) if bias else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def linear(in_features: int, shard_sizes: dict, bias: bool = False, fp8: Fp8Weights | None = None) -> nn.Module:
    """A projection in the checkpoint's storage: `Linear`, or `Fp8Linear` when `fp8` says it is FP8."""
    if fp8 is None:
        return Linear(in_features, shard_sizes, bias)
    from flare.models.fp8 import Fp8Linear

    return Fp8Linear(in_features, shard_sizes, bias, fp8)


def plain_linear(in_features: int, out_features: int, bias: bool = False, fp8: Fp8Weights | None = None):
    return linear(in_features, {None: out_features}, bias, fp8)


def qkv_linear(hidden: int, q_size: int, kv_size: int, bias: bool, fp8: Fp8Weights | None = None):
    """q, k and v projections as one matmul; loads from `q_proj`, `k_proj`, `v_proj`."""
    return linear(hidden, {"q": q_size, "k": kv_size, "v": kv_size}, bias, fp8)


def gate_up_linear(hidden: int, intermediate: int, fp8: Fp8Weights | None = None):
    """The MLP's gate and up projections as one matmul; loads from `gate_proj`, `up_proj`."""
    return linear(hidden, {"gate": intermediate, "up": intermediate}, False, fp8)


class GatedMLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), with gate and up fused. `fp8`: the storage of each projection
    (`ModelConfig.fp8_projection`), given by the model that names them."""

    def __init__(self, hidden: int, intermediate: int, gate_up_fp8: Fp8Weights | None = None,
                 down_fp8: Fp8Weights | None = None) -> None:
        super().__init__()
        self.gate_up_proj = gate_up_linear(hidden, intermediate, gate_up_fp8)
        self.down_proj = plain_linear(intermediate, hidden, False, down_fp8)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class Embedding(nn.Module):
    def __init__(self, vocab_size: int, hidden: int) -> None:
        super().__init__()
        self.weight = _parameter(vocab_size, hidden)

    def forward(self, token_ids: torch.Tensor) -> torch.Tensor:
        return F.embedding(token_ids, self.weight)


class LMHead(nn.Module):
    """Hidden states to float32 logits; with tied embeddings it reads the embedding matrix."""

    def __init__(self, vocab_size: int, hidden: int, tied_to: Embedding | None) -> None:
        super().__init__()
        self.tied_to = [tied_to] if tied_to is not None else []  # a list keeps it out of the module tree
        self.register_parameter("weight", None if tied_to is not None else _parameter(vocab_size, hidden))

    @property
    def matrix(self) -> torch.Tensor:
        return self.tied_to[0].weight if self.tied_to else self.weight

    def untie(self, tensor: torch.Tensor, name: str) -> None:
        """Give the head its own matrix, as transformers does when a tied checkpoint still ships a different one."""
        embedding = self.tied_to.pop().weight
        self.weight = _parameter(*embedding.shape)
        self.weight.data = torch.empty_like(embedding)
        load_rows(self.weight, tensor, None, name)

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden, self.matrix).float()
