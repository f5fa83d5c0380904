"""The host tier's bytes and the copies between them and the GPU pages (runner side).

Generic over the caches: any list of page-major views, `[pages, *page shape]` of any dtype, whose first
dimension is the GPU page id (the target's `[2, pages, page_size, heads, head_dim]` seen through
`flare.engine.attention.kv_page_views`, an FP8 cache's uint8 rows, a draft model's caches on the same
pages, a latent cache of another shape). A host slot holds one page of every tensor; the host
memory is one flat buffer, laid out tensor by tensor (`[slots, *page shape]` each), so a run of
consecutive slots is one contiguous block per tensor and moves with one copy. On CUDA the buffer is
page-locked in place (`cudaHostRegister`: torch's pinned allocator rounds a request up to a power of two)
and every copy runs on a stream of its own, after the work already queued on the serving stream: a
gather of the pages into a staging buffer of STAGING_BYTES on the device, then one copy to the host
(loads: the reverse). On a CPU the same copies run at once.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from flare.engine.step import PageCopy

STAGING_BYTES = 64 << 20        # device memory one copy moves through (counted where memory is estimated)
BLOCK_ALIGN = 64                # bytes: where each cache tensor's block of the host buffer starts


def page_layout(pages: Sequence[torch.Tensor]) -> str:
    """A text naming the page format of these page-major views (dtype and page shape of each): retained
    pages are kept under it, so a cache of another format never reads them."""
    return ";".join(f"{str(view.dtype).removeprefix('torch.')}[{','.join(map(str, view.shape[1:]))}]"
                    for view in pages)


def page_bytes(pages: Sequence[torch.Tensor]) -> int:
    """Bytes of one page across every page-major view (one host slot)."""
    return sum(view[0].numel() * view.element_size() for view in pages)


def check_page_views(pages: Sequence[torch.Tensor], num_pages: int) -> None:
    """Every view must be indexed by the allocator's `num_pages` page ids on its first dimension (a view
    that is not, of a cache format whose page dimension is elsewhere, would copy the wrong bytes)."""
    if not pages:
        raise ValueError("the prefix cache's host tier needs at least one cache tensor")
    for index, view in enumerate(pages):
        if view.shape[0] != num_pages:
            raise ValueError(f"cache tensor {index} ({view.dtype}, {list(view.shape)}) is seen with "
                             f"{view.shape[0]} pages on its first dimension, the allocator has {num_pages}: "
                             "give page-major views of the cache (flare.engine.attention.kv_page_views)")


class HostPages:
    def __init__(self, pages: Sequence[torch.Tensor], num_slots: int) -> None:
        self.views = list(pages)                                            # [pages, *page shape] each
        self.device = self.views[0].device
        self.num_slots = num_slots
        self.slot_bytes = page_bytes(self.views)
        sizes = [num_slots * view[0].numel() * view.element_size() for view in self.views]
        starts = [0]
        for size in sizes[:-1]:                     # each tensor's block aligned for any element type
            starts.append(starts[-1] + -(-size // BLOCK_ALIGN) * BLOCK_ALIGN)
        self.buffer = torch.empty(starts[-1] + sizes[-1], dtype=torch.uint8)
        self.slots: list[torch.Tensor] = [                                  # [slots, *page shape] per tensor
            self.buffer[start:start + size].view(view.dtype).view(num_slots, *view.shape[1:])
            for view, start, size in zip(self.views, starts, sizes)]
        self.on_cuda = self.device.type == "cuda"
        self.stream = self.staging = None
        if self.on_cuda:
            _register(self.buffer)
            self.stream = torch.cuda.Stream(self.device)
            self.staging = torch.empty(STAGING_BYTES, dtype=torch.uint8, device=self.device)

    def slot_parts(self, slot: int) -> list[memoryview]:
        """The slot's bytes, one contiguous block per cache tensor (for files and the pool)."""
        return [memoryview(part[slot].flatten().view(torch.uint8).numpy()) for part in self.slots]

    def save(self, copies: Sequence[PageCopy]):
        """GPU pages -> host slots; returns the CUDA event they are done at (None on a CPU: done)."""
        return self._copy(copies, to_host=True)

    def load(self, copies: Sequence[PageCopy]):
        """Host slots -> GPU pages; returns the CUDA event they are done at (None on a CPU: done)."""
        return self._copy(copies, to_host=False)

    def close(self) -> None:
        if self.on_cuda and self.buffer is not None:
            torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr())
        self.buffer = None

    # ---- internals -------------------------------------------------------------------------------

    def _copy(self, copies: Sequence[PageCopy], to_host: bool):
        if not copies:
            return None
        runs = _slot_runs(copies)
        if not self.on_cuda:
            for first_slot, pages in runs:
                index = torch.tensor(pages, dtype=torch.int64)
                for view, slots in zip(self.views, self.slots):
                    if to_host:
                        torch.index_select(view, 0, index, out=slots[first_slot:first_slot + len(pages)])
                    else:
                        view.index_copy_(0, index, slots[first_slot:first_slot + len(pages)])
            return None
        serving = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(serving)                # after what the queued steps wrote or still read
        with torch.cuda.stream(self.stream):
            all_pages = [page for _, pages in runs for page in pages]
            index = torch.tensor(all_pages, dtype=torch.int64).pin_memory().to(self.device, non_blocking=True)
            start = 0
            for first_slot, pages in runs:
                for view, slots in zip(self.views, self.slots):
                    self._copy_run(view, slots, first_slot, index[start:start + len(pages)], to_host)
                start += len(pages)
            done = torch.cuda.Event()
            done.record(self.stream)
        return done

    def _copy_run(self, view: torch.Tensor, slots: torch.Tensor, first_slot: int, index: torch.Tensor,
                  to_host: bool) -> None:
        """One tensor's pages `index` <-> its host slots from `first_slot` on, through the staging buffer."""
        page_nbytes = view[0].numel() * view.element_size()
        chunk = max(1, STAGING_BYTES // page_nbytes)
        for start in range(0, index.shape[0], chunk):
            part = index[start:start + chunk]
            count = part.shape[0]
            stage = self.staging[:count * page_nbytes].view(view.dtype).view(count, *view.shape[1:])
            host = slots[first_slot + start:first_slot + start + count]
            if to_host:
                torch.index_select(view, 0, part, out=stage)
                host.copy_(stage, non_blocking=True)
            else:
                stage.copy_(host, non_blocking=True)
                view.index_copy_(0, part, stage)


def _slot_runs(copies: Sequence[PageCopy]) -> list[tuple[int, list[int]]]:
    """The copies as runs of consecutive host slots: (first slot, the GPU pages in slot order)."""
    runs: list[tuple[int, list[int]]] = []
    last = None
    for copy in sorted(copies, key=lambda c: c.slot):
        if last is not None and copy.slot == last + 1:
            runs[-1][1].append(copy.page)
        else:
            runs.append((copy.slot, [copy.page]))
        last = copy.slot
    return runs


def _register(buffer: torch.Tensor) -> None:
    """Page-lock `buffer` in place, so copies to and from it run asynchronously at full speed."""
    error = int(torch.cuda.cudart().cudaHostRegister(buffer.data_ptr(), buffer.numel(), 0))
    if error != 0:
        raise RuntimeError(f"could not page-lock {buffer.numel():,} bytes of host memory for the prefix cache's "
                           f"host tier (cudaHostRegister error {error}); lower [prefix_cache] memory")
