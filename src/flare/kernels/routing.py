"""Which of the model's matrix products run on our decode kernel (flare.kernels.gemv) instead of cuBLAS.

A switch the Linear and LMHead layers consult on every call, kept apart from the kernel so the layers
import no Triton: a CPU-only install has none. Off by default; `enable` imports the kernel.
"""

from __future__ import annotations

import torch

MAX_ROWS = 16                  # the kernel's limit: decode batches of up to 16 sequences

_routed_devices: frozenset[str] = frozenset()


def enable(on: bool = True, devices: tuple[str, ...] = ("cuda",)) -> None:
    """Route products with at most MAX_ROWS rows on `devices` through gemv (off: F.linear everywhere).

    Devices other than cuda only make sense under Triton's interpreter (tests)."""
    global _routed_devices
    if on:
        import flare.kernels.gemv  # noqa: F401  (registers torch.ops.flare.gemv)
    _routed_devices = frozenset(devices) if on else frozenset()


def enabled() -> bool:
    return bool(_routed_devices)


def routes_to_gemv(x: torch.Tensor) -> bool:
    """Whether a layer should call torch.ops.flare.gemv for input x: switched on, on a routed device,
    few rows."""
    return x.device.type in _routed_devices and x.numel() <= MAX_ROWS * x.shape[-1]
