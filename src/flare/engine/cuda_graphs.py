"""Decode steps replayed as CUDA graphs, two per captured batch size (the graph catalog).

A decode step is hundreds of small kernels; launched one by one from Python, their launch gaps cost
more than the weights take to read. A captured graph launches them all at once. The sizes captured
are `EngineConfig.decode_graph_sizes`, which a package's plan records. Graphs replay on fixed
addresses, so a step's rows live in one static buffer sized for the largest batch: each row's
batch slot, position and host token id, copied in with one transfer and padded up to the smallest
captured size that holds the batch. Everything else is derived inside the graph from the runner's
persistent slot state (`flare.engine.batch_slots`): the input id (the slot's last sampled id when the
host has none), the page table rows (and the window page table rows of a cache with window pages,
DeepSeek V4's), each row's K/V slot and context length. Padded rows use the
padding slot, whose table is the dummy page: they read token 0 at position 0, write their K/V into a
dummy slot that no request owns, and have an empty context; their logits are never read.

Each size has two graphs on the same static buffers and memory pool, split at the sampler:

* the forward graph derives the inputs, runs the model and computes float32 logits into its static
  output (the logits stay there for rows that asked for logprobs, read before the next replay);
* the sampling graph runs the device sampler (`flare.engine.sampler.DeviceSampler`, the slots'
  `sampler`) on those logits with per-slot tables and the grammar masks, and writes each row's id into
  its slot's `last_sampled`, the next decode's input. Padded rows sample for the sampler's padding slot
  (greedy, no penalties).

Why two: a grammar's mask for token N+1 needs token N on the host, and xgrammar fills it on the CPU. With
one graph the device waited for the read and the fill every constrained step; split, the caller launches
the forward (`launch_forward`: its input id is already on the device), fills the masks while it runs, and
then `sample`s, which copies the masks in and replays the sampling graph. A step without constraints
replays both back to back (`run`): one more graph launch (~10 us), no host sync.

Grammar masks are one more static buffer the sampling graph reads (`bitmask`, int32 [rows, ceil(V / 32)],
xgrammar's layout): a step with constrained rows copies their masks in before the sampling replay; every
other row's mask allows every token (all bits set), so a step without constraints samples exactly as it
would unmasked, and constrained decoding keeps the captured graphs.

On a CPU the same class runs both halves eagerly on the same static buffers (capture=False): the
padding, the split and the bookkeeping are then testable without a GPU. DeepSeek V4 is not captured on a
GPU (`runs_triton_attention` is false for it): the entries its step closes and its experts' dispatch take
their shapes from the batch's data.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from flare.engine.batch_slots import BatchSlots, to_device
from flare.engine.step_inputs import FROM_LAST_SAMPLED


def runs_triton_attention(model) -> bool:
    """Whether every attention layer uses the Triton backend: the reference backend reads its metadata on
    the host, which a graph cannot capture."""
    from flare.engine.attention_triton import TritonBackend

    backends = [module.backend for module in model.modules() if hasattr(module, "backend")]
    return bool(backends) and all(isinstance(backend, TritonBackend) for backend in backends)


def bucket_for(batch: int, sizes: Sequence[int]) -> int | None:
    """The smallest captured size that holds `batch` rows, or None when the batch is larger than all."""
    index = bisect.bisect_left(sizes, batch)
    return sizes[index] if index < len(sizes) else None


@dataclass(frozen=True)
class ForwardLaunch:
    """A decode step whose forward half is launched and whose sampling half is not yet: `DecodeGraphs.sample`
    takes it back (with the step's masks) to finish the step."""

    size: int                               # the captured size the rows were padded to
    count: int                              # the step's real rows


@dataclass
class CapturedStep:
    """The two graphs of one size and their static outputs (allocated in the shared pool, kept alive so no
    later capture reuses their memory)."""

    forward: torch.cuda.CUDAGraph
    sample: torch.cuda.CUDAGraph
    hidden: torch.Tensor                    # [size, H]
    logits: torch.Tensor                    # [size, V] float32, the sampling graph's input
    token_ids: torch.Tensor                 # [size] int64


class DecodeGraphs:
    """The static row buffer and the captured decode graphs (forward and sampling) per catalog size.

    `max_seq_len` is the longest context a graph serves (it fixes the split-K count of decode attention
    inside the graph)."""

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: Sequence[int], slots: BatchSlots,
                 page_size: int, max_seq_len: int, capture: bool = True) -> None:
        self.model, self.kv_caches, self.slots = model, kv_caches, slots
        self.sizes = tuple(sizes)
        self.page_size, self.max_seq_len = page_size, max_seq_len
        self.capture = capture
        device = slots.page_tables.device
        largest = self.sizes[-1]
        self.rows = torch.zeros(3, largest, dtype=torch.int64, device=device)      # slot, position, host id
        self.rows[0] = slots.padding_row
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.zeros(largest, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.page_tables = torch.zeros(largest, slots.max_pages, dtype=torch.int32, device=device)
        self.window_page_tables = (None if slots.window_page_tables is None else
                                   torch.zeros(largest, slots.max_pages, dtype=torch.int32, device=device))
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        words = -(-slots.sampler.vocab_size // 32) if slots.sampler is not None else 1
        self.bitmask = torch.full((largest, words), -1, dtype=torch.int32, device=device)
        self._masked_rows = 0                   # leading rows of `bitmask` that hold a grammar's mask
        # The masks reach `bitmask` through one page-locked buffer of ours: pinning a fresh host copy per
        # step (batch_slots.to_device) cost ~0.8 ms a call for these ~300 KB on the H200 host, inside the
        # time a constrained step's forward leaves the host (docs/performance.md). A copy waits for the
        # previous one to have left the buffer (`_mask_copied`), long done by then.
        self._mask_staging = (torch.empty((largest, words), dtype=torch.int32, pin_memory=True)
                              if device.type == "cuda" else None)
        self._mask_copied: torch.cuda.Event | None = None
        self.graphs: dict[int, CapturedStep] = {}
        # The step between its two halves: its launch, hidden states and logits (None: no step is).
        self._forwarded: tuple[ForwardLaunch, torch.Tensor, torch.Tensor] | None = None
        if slots.sampler is None or slots.sampler.padding_slot != slots.padding_row:
            raise ValueError("decode graphs sample inside the graph: give the slots a DeviceSampler of as many slots")

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def metadata(self, size: int):
        """The AttentionMetadata of a `size`-row step: views of the static buffers."""
        from flare.engine.attention import AttentionMetadata

        window = None if self.window_page_tables is None else self.window_page_tables[:size]
        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            page_tables=self.page_tables[:size], slot_mapping=self.slot_mapping[:size],
            max_query_len=1, max_seq_len=self.max_seq_len, page_size=self.page_size, window_page_tables=window)

    def _derive(self, size: int) -> None:
        """Input ids, page tables, K/V slots and context lengths of the rows, from the slots' state."""
        slots, positions, host_ids = self.rows[:, :size]
        sampled = self.slots.last_sampled.index_select(0, slots)
        self.input_ids[:size].copy_(torch.where(host_ids == FROM_LAST_SAMPLED, sampled, host_ids))
        tables = self.page_tables[:size]
        torch.index_select(self.slots.page_tables, 0, slots, out=tables)
        if self.window_page_tables is not None:
            torch.index_select(self.slots.window_page_tables, 0, slots, out=self.window_page_tables[:size])
        pages = tables.gather(1, (positions // self.page_size)[:, None])[:, 0]
        self.slot_mapping[:size].copy_(pages.to(torch.int64) * self.page_size + positions % self.page_size)
        self.seq_lens[:size].copy_(torch.where(slots == self.slots.padding_row, 0, positions + 1))

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The forward half on the first `size` rows of the static buffers: (hidden [size, H], float32
        logits [size, V])."""
        self._derive(size)
        hidden = self.model(self.input_ids[:size], self.rows[1, :size], self.kv_caches, self.metadata(size))
        return hidden, self.model.compute_logits(hidden)

    def sample_logits(self, size: int, logits: torch.Tensor) -> torch.Tensor:
        """The sampling half: ids [size] for `logits` under `bitmask`; each is also its slot's `last_sampled`."""
        slots, positions = self.rows[0, :size], self.rows[1, :size]
        token_ids = self.slots.sampler.sample(logits, slots, positions + 1,     # the id of the next position
                                              self.bitmask[:size])
        self.slots.last_sampled.index_copy_(0, slots, token_ids)
        return token_ids

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture both halves of every size, largest first, sharing one memory pool (graphs run one at a
        time, in stream order)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):           # compile kernels and settle allocations first
                for _ in range(2):
                    self.sample_logits(size, self.forward(size)[1])
            torch.cuda.current_stream().wait_stream(stream)
            forward, sample = torch.cuda.CUDAGraph(), torch.cuda.CUDAGraph()
            with torch.cuda.graph(forward, pool=pool):
                hidden, logits = self.forward(size)
            with torch.cuda.graph(sample, pool=pool):
                token_ids = self.sample_logits(size, logits)
            self.graphs[size] = CapturedStep(forward, sample, hidden, logits, token_ids)
        torch.cuda.synchronize()

    def run(self, rows: np.ndarray,
            bitmask: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Both halves back to back (masks known before the step): `launch_forward`, then `sample`."""
        return self.sample(self.launch_forward(rows), bitmask)

    def launch_forward(self, rows: np.ndarray) -> ForwardLaunch:
        """rows [3, B] int64 (slot, position, host id or FROM_LAST_SAMPLED per row): copy in, pad, replay
        the forward graph. Nothing waits for the device; `sample` must follow before the next launch."""
        if self._forwarded is not None:
            raise RuntimeError("a decode step's forward was launched twice without sampling in between")
        count = rows.shape[1]
        size = bucket_for(count, self.sizes)
        if size is None:
            raise ValueError(f"a decode batch of {count} exceeds the largest captured graph ({self.max_batch})")
        padded = np.zeros((3, size), dtype=np.int64)
        padded[0] = self.slots.padding_row
        padded[:, :count] = rows
        self.rows[:, :size].copy_(to_device(padded, self.rows.device))
        if self.capture:
            captured = self.graphs[size]
            captured.forward.replay()
            hidden, logits = captured.hidden, captured.logits
        else:
            hidden, logits = self.forward(size)
        launch = ForwardLaunch(size, count)
        self._forwarded = (launch, hidden, logits)
        return launch

    def sample(self, launch: ForwardLaunch,
               bitmask: np.ndarray | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Finish the step `launch_forward` started: copy in the rows' grammar masks [B, ceil(V / 32)] int32
        (None: no row is constrained) and replay the sampling graph; (hidden, logits, sampled ids) of the
        real rows."""
        if self._forwarded is None or self._forwarded[0] is not launch:
            raise RuntimeError("sample() finishes the step of the latest launch_forward(), once")
        _, hidden, logits = self._forwarded
        self._forwarded = None
        size, count = launch.size, launch.count
        self._copy_masks(bitmask)
        if self.capture:
            captured = self.graphs[size]
            captured.sample.replay()
            token_ids = captured.token_ids
        else:
            token_ids = self.sample_logits(size, logits)
        return hidden[:count], logits[:count], token_ids[:count]

    def _copy_masks(self, bitmask: np.ndarray | None) -> None:
        """Put this step's masks in the static buffer; rows a previous step masked allow every token again."""
        if self._masked_rows:
            self.bitmask[:self._masked_rows].fill_(-1)
            self._masked_rows = 0
        if bitmask is not None:
            if bitmask.shape[1] != self.bitmask.shape[1]:
                raise ValueError(f"a token mask of {bitmask.shape[1]} words, but this vocabulary needs "
                                 f"{self.bitmask.shape[1]}")
            rows = len(bitmask)
            if self._mask_staging is None:
                self.bitmask[:rows].copy_(to_device(bitmask, self.bitmask.device))
            else:
                if self._mask_copied is not None:
                    self._mask_copied.synchronize()
                staging = self._mask_staging[:rows]
                staging.numpy()[...] = bitmask
                self.bitmask[:rows].copy_(staging, non_blocking=True)
                self._mask_copied = torch.cuda.Event()
                self._mask_copied.record()
            self._masked_rows = rows
