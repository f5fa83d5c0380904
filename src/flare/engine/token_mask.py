"""Grammar bitmasks on logits: int32 words, bit t % 32 of word t // 32 set = token t allowed (xgrammar's
layout). The eager sampling path applies them here; the device sampler takes the same bitmask."""

from __future__ import annotations

import torch


def allowed_tokens(bitmask: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """[N, ceil(V / 32)] int32 -> [N, V] bool."""
    bits = torch.arange(32, dtype=torch.int32, device=bitmask.device)
    allowed = (bitmask[:, :, None] >> bits) & 1                  # arithmetic shift: bit 31 reads right too
    return allowed.reshape(bitmask.shape[0], -1)[:, :vocab_size].bool()


def apply_token_bitmask(logits: torch.Tensor, bitmask: torch.Tensor) -> torch.Tensor:
    """logits [N, V] with every token the bitmask [N, ceil(V / 32)] forbids at -inf (a new tensor)."""
    words = -(-logits.shape[1] // 32)
    if bitmask.shape != (logits.shape[0], words):
        raise ValueError(f"a token bitmask for {logits.shape[0]} rows of {logits.shape[1]} tokens is "
                         f"[{logits.shape[0]}, {words}] int32, got {list(bitmask.shape)}")
    return logits.masked_fill(~allowed_tokens(bitmask, logits.shape[1]), float("-inf"))
