"""Rotary position embeddings with the scaling kinds of `transformers` (default, linear, llama3, yarn, dynamic).

Inverse frequencies and cos/sin are computed in float32 with the same formulas as transformers'
`ROPE_INIT_FUNCTIONS`, and applied in the "rotate half" layout (dimension j pairs with j + head_dim/2).
"""

from __future__ import annotations

import math

import torch
from torch import nn

from flare.models.config import RopeConfig


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, rope: RopeConfig, max_position_embeddings: int) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.rope = rope
        self.max_position_embeddings = max_position_embeddings
        inv_freq, self.attention_scaling = inverse_frequencies(rope, head_dim, max_position_embeddings)
        self.register_buffer("inv_freq", inv_freq.to(torch.get_default_device()), persistent=False)

    def forward(self, positions: torch.Tensor, token_seq_lens: torch.Tensor | None = None):
        """cos and sin `[T, head_dim]` (float32) for each token; dynamic scaling needs each token's sequence length."""
        inv_freq = self.inv_freq[None, :]
        if self.rope.kind == "dynamic":
            inv_freq = self._dynamic_inverse_frequencies(token_seq_lens)
        freqs = positions[:, None].float() * inv_freq
        angles = torch.cat((freqs, freqs), dim=-1)
        return angles.cos() * self.attention_scaling, angles.sin() * self.attention_scaling

    def _dynamic_inverse_frequencies(self, token_seq_lens: torch.Tensor) -> torch.Tensor:
        # transformers recomputes the base from the current length (max position + 1) once it exceeds the
        # trained context, in float32. Two differences, both in its batch-wide cached state: it uses the
        # longest sequence of the batch, and keeps the longest length seen until a call falls back under
        # the trained context. Here each token uses its own sequence's current length, which is the same
        # within one generation and does not depend on what else is in the batch.
        dim, factor, trained = self.head_dim, self.rope.factor, self.max_position_embeddings
        seq_len = torch.clamp(token_seq_lens.to(torch.int64), min=trained)
        base = self.rope.theta * ((factor * seq_len / trained) - (factor - 1)) ** (dim / (dim - 2))
        exponents = torch.arange(0, dim, 2, dtype=torch.int64, device=seq_len.device).float() / dim
        return 1.0 / (base[:, None] ** exponents[None, :])


def apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotate `x [T, heads, head_dim]` by `cos`/`sin [T, head_dim]`, in x's dtype as transformers does."""
    cos, sin = cos[:, None, :].to(x.dtype), sin[:, None, :].to(x.dtype)
    first, second = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-second, first), dim=-1) * sin


def inverse_frequencies(rope: RopeConfig, head_dim: int, max_position_embeddings: int) -> tuple[torch.Tensor, float]:
    """`(inv_freq [head_dim/2] float32, attention scaling of cos/sin)` at the trained context length."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64, device="cpu").float() / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.kind in ("default", "dynamic"):  # dynamic equals default up to the trained length
        return inv_freq, 1.0
    if rope.kind == "linear":
        return inv_freq / rope.factor, 1.0
    if rope.kind == "llama3":
        return _llama3(inv_freq, rope), 1.0
    if rope.kind == "yarn":
        return _yarn(rope, head_dim), _yarn_attention_factor(rope)
    raise ValueError(f"unknown rotary kind {rope.kind!r}")  # ModelConfig refuses these earlier


def _llama3(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    # Long wavelengths are divided by factor, short ones kept, the band between interpolated smoothly.
    context, low, high = rope.original_max_positions, rope.low_freq_factor, rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > context / low, inv_freq / rope.factor, inv_freq)
    smooth = (context / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < context / high) * ~(wavelen > context / low)
    return torch.where(is_medium, smoothed, scaled)


def _yarn(rope: RopeConfig, dim: int) -> torch.Tensor:
    # Blend interpolated (divided by factor) and original frequencies along a linear ramp over dimensions.
    base, context = rope.theta, rope.original_max_positions
    beta_fast, beta_slow = rope.beta_fast or 32, rope.beta_slow or 1

    def correction_dim(rotations: float) -> float:
        return (dim * math.log(context / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # avoids dividing by zero
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32, device="cpu") - low) / (high - low), 0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2, device="cpu").float() / dim)
    extrapolation = 1 - ramp
    return (1.0 / (rope.factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation


def _yarn_attention_factor(rope: RopeConfig) -> float:
    if rope.attention_factor is not None:
        return float(rope.attention_factor)

    def mscale(scale: float, m: float = 1) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if rope.mscale and rope.mscale_all_dim:
        return float(mscale(rope.factor, rope.mscale) / mscale(rope.factor, rope.mscale_all_dim))
    return mscale(rope.factor)


def apply_rotary_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, layout: str) -> torch.Tensor:
    """Rotate `x [T, heads, dim]` whose rotary dimensions pair up as (x0, x1), (x2, x3), ... (DeepSeek's
    layout) by `cos`/`sin [T, dim]` float32 (`RotaryEmbedding`'s, each frequency twice).

    "complex" rotates in float32 and keeps the pairs interleaved, as transformers' DeepSeek-V2 multiplies
    complex numbers; "interleaved" rotates in x's dtype and puts the first members' results before the
    second members', as its DeepSeek-V3 `rope_interleave`; "half" is the usual rotate-half (`apply_rotary`).
    A query and a key rotated alike keep their dot product, so the two layouts serve the same attention."""
    if layout == "half":
        return apply_rotary(x, cos, sin)
    half = cos.shape[-1] // 2
    cos, sin = cos[:, None, :half], sin[:, None, :half]
    if layout == "complex":
        first, second = x.float()[..., 0::2], x.float()[..., 1::2]
        return torch.stack((first * cos - second * sin, first * sin + second * cos), dim=-1).flatten(-2).to(x.dtype)
    if layout == "interleaved":
        cos, sin = cos.to(x.dtype), sin.to(x.dtype)
        first, second = x[..., 0::2], x[..., 1::2]
        return torch.cat((first * cos - second * sin, second * cos + first * sin), dim=-1)
    raise ValueError(f"unknown rotary layout {layout!r}")
