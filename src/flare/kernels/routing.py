"""Which of the model's matrix products run on our kernels instead of cuBLAS or torch, kept apart from
the kernels so the layers import no Triton: a CPU-only install has none.

Plain (bf16/fp16/fp32) products always take F.linear: our decode GEMV (flare.kernels.gemv) matched
cuBLAS on the H200 (docs/performance.md), so no switch routes them to it.

FP8 projections (flare.models.fp8) have no cuBLAS product to fall back on: on CUDA they always run our
FP8 kernels (flare.kernels.fp8_linear); elsewhere the torch reference, unless `enable_fp8` routes
another device's products through Triton's interpreter (tests).
"""

from __future__ import annotations

import torch

MAX_ROWS = 16                  # the GEMV kernels' limit: decode batches of up to 16 sequences

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
