"""Host tensors to the device without waiting for it.

A copy from pageable host memory makes the host wait for the stream, so a step that writes a request's
tables while the previous step runs would wait for that step. Page-locked memory from torch's caching
host allocator avoids that: the allocator keeps the block until the copy has run, so no later write
overwrites it.
"""

from __future__ import annotations

import torch


def upload(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    """`tensor` (on the host) on `device`, the copy queued behind the device's work, the host not waiting."""
    if device.type == "cpu":
        return tensor
    return tensor.pin_memory().to(device, non_blocking=True)
