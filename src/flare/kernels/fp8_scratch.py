"""The one buffer FP8 projections dequantize their weight into before cuBLAS multiplies it (from
DEQUANTIZE_MIN_ROWS rows, flare.kernels.fp8_linear).

One buffer per device and serving dtype, shared by every projection and sized for the largest, so a
prompt step holds one dequantized weight at a time instead of a bf16 copy of the model. Sharing is safe
because a device runs one step at a time on one stream: a projection dequantizes and multiplies before
the next one writes. A captured CUDA graph keeps the buffer's address, so a buffer is never freed or
moved: `Fp8Linear` reserves its size when it is built, which makes the first allocation the largest,
and a larger request than any reserved gets a new buffer while the old one stays alive.

The memory estimate counts the buffer (flare.recipes.base.fp8_scratch_bytes). No Triton here: the
layers import this module on any install.
"""

from __future__ import annotations

import torch

_reserved: dict[torch.device, int] = {}
_buffers: dict[tuple[torch.device, torch.dtype], torch.Tensor] = {}
_retired: list[torch.Tensor] = []           # outgrown buffers, alive for graphs captured on them


def reserve(device: torch.device, rows: int, columns: int) -> None:
    """Make the buffer of `device` hold at least a [rows, columns] weight when it is first allocated."""
    _reserved[device] = max(_reserved.get(device, 0), rows * columns)


def scratch(device: torch.device, dtype: torch.dtype, rows: int, columns: int) -> torch.Tensor:
    """A [rows, columns] view of the shared buffer of `device` and `dtype` (its contents are undefined)."""
    numel = rows * columns
    key = (device, dtype)
    buffer = _buffers.get(key)
    if buffer is None or buffer.numel() < numel:
        if buffer is not None:
            _retired.append(buffer)
        buffer = torch.empty(max(numel, _reserved.get(device, 0)), dtype=dtype, device=device)
        _buffers[key] = buffer
    return buffer[:numel].view(rows, columns)
