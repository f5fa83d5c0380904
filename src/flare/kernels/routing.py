"""Which of the model's matrix products run on our kernels instead of cuBLAS or torch.

A switch the Linear and LMHead layers consult on every call, kept apart from the kernel so the layers
import no Triton: a CPU-only install has none. Off by default; `enable` imports the kernel.

FP8 projections (flare.models.fp8) have no cuBLAS product to fall back on: on CUDA they always run our
FP8 kernels (flare.kernels.fp8_linear); elsewhere the torch reference, unless `enable_fp8` routes
another device's products through Triton's interpreter (tests).
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


_fp8_routed_devices: frozenset[str] = frozenset({"cuda"})


def load_fp8_kernels() -> None:
    import flare.kernels.fp8_linear  # noqa: F401  (registers torch.ops.flare.fp8_linear)


def enable_fp8(devices: tuple[str, ...] = ("cuda",)) -> None:
    """Run FP8 products on `devices` through the kernels (cuda always; cpu only makes sense under the
    interpreter)."""
    global _fp8_routed_devices
    load_fp8_kernels()
    _fp8_routed_devices = frozenset(devices) | {"cuda"}


def routes_fp8_to_kernels(x: torch.Tensor) -> bool:
    return x.device.type in _fp8_routed_devices
