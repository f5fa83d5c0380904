"""Zeroed int32 counters for kernels that finish a split-K reduction in their own last program.

Each program of a split tile adds one to its tile's counter after storing its partial; the program that
sees the count reach the split count sums the partials (in split order, so the result does not depend
on which program came last) and sets the counter back to zero. The counters are therefore zero between
launches and one buffer per device serves every product, because a device runs its products one at a
time on one stream. A captured CUDA graph keeps the buffer's address: it is allocated on first use
(the warm-up before capture), never freed, and a first use inside a capture is refused.
"""

from __future__ import annotations

import torch

MIN_COUNTERS = 1 << 16          # tiles of the widest product at the smallest tile, with room

_counters: dict[torch.device, torch.Tensor] = {}
_retired: list[torch.Tensor] = []           # outgrown buffers, alive for graphs captured on them


def tile_counters(device: torch.device, tiles: int) -> torch.Tensor:
    """At least `tiles` zeroed int32 counters on `device`."""
    buffer = _counters.get(device)
    if buffer is not None and buffer.numel() >= tiles:
        return buffer
    if device.type == "cuda" and torch.cuda.is_current_stream_capturing():
        raise RuntimeError(f"split-K tile counters for {tiles} tiles were first needed inside a CUDA graph "
                           "capture; run the product once before capturing it")
    if buffer is not None:
        _retired.append(buffer)
    buffer = torch.zeros(max(tiles, MIN_COUNTERS), dtype=torch.int32, device=device)
    _counters[device] = buffer
    return buffer
