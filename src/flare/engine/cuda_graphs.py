"""Decode steps replayed as CUDA graphs, one per captured batch size (the graph catalog).

A decode step is hundreds of small kernels; launched one by one from Python, their launch gaps cost
more than the weights take to read. A captured graph launches them all at once. The sizes captured
are `EngineConfig.decode_graph_sizes`, which a package's plan records. Graphs replay on fixed
addresses, so the step's inputs live in static buffers sized for the largest batch: each step
copies its rows in, pads the rest up to the smallest captured size that holds the batch, and
replays. Padded rows read token 0 at position 0, write their K/V into a dummy slot that no request
owns, and have an empty context (their attention output is zero); their logits are never read.

The graph computes hidden states and float32 logits. Sampling stays outside it, on the logits of the
real rows, so the sampler (seeded generators, penalties, logprobs) is exactly the eager one.

On a CPU the same class runs the forward eagerly on the same static buffers (capture=False): the
padding and bookkeeping are then testable without a GPU.
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from dataclasses import dataclass

import torch


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
class DecodeBatch:
    """One decode step's rows: each sequence's new token, its position, K/V slot, context and pages."""

    input_ids: list[int]
    positions: list[int]
    slots: list[int]
    seq_lens: list[int]
    block_tables: list[list[int]]

    def __len__(self) -> int:
        return len(self.input_ids)


class DecodeGraphs:
    """Static input buffers and one captured decode graph per catalog size.

    `dummy_slot` is a KV slot no request owns (the runner allocates one page more than the allocator
    hands out); `max_seq_len` is the longest context a graph serves (it fixes the split-K count of
    decode attention inside the graph).
    """

    def __init__(self, model, kv_caches: list[torch.Tensor], sizes: Sequence[int], max_pages: int,
                 page_size: int, dummy_slot: int, max_seq_len: int, capture: bool = True) -> None:
        self.model, self.kv_caches = model, kv_caches
        self.sizes = tuple(sizes)
        self.page_size, self.dummy_slot, self.max_seq_len = page_size, dummy_slot, max_seq_len
        self.capture = capture
        device = kv_caches[0].device
        largest = self.sizes[-1]
        self.input_ids = torch.zeros(largest, dtype=torch.int64, device=device)
        self.positions = torch.zeros(largest, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((largest,), dummy_slot, dtype=torch.int64, device=device)
        self.seq_lens = torch.zeros(largest, dtype=torch.int32, device=device)
        self.block_tables = torch.full((largest, max_pages), dummy_slot // page_size, dtype=torch.int32,
                                       device=device)
        self.query_start_loc = torch.arange(largest + 1, dtype=torch.int32, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    @property
    def max_batch(self) -> int:
        return self.sizes[-1]

    def metadata(self, size: int):
        """The AttentionMetadata of a `size`-row step: views of the static buffers."""
        from flare.engine.attention import AttentionMetadata

        return AttentionMetadata(
            query_start_loc=self.query_start_loc[:size + 1], seq_lens=self.seq_lens[:size],
            block_tables=self.block_tables[:size], slot_mapping=self.slot_mapping[:size],
            max_query_len=1, max_seq_len=self.max_seq_len, page_size=self.page_size)

    def forward(self, size: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The step on the first `size` rows of the static buffers: (hidden [size, H], logits [size, V])."""
        hidden = self.model(self.input_ids[:size], self.positions[:size], self.kv_caches, self.metadata(size))
        return hidden, self.model.compute_logits(hidden)

    @torch.inference_mode()
    def capture_all(self) -> None:
        """Capture every size, largest first, sharing one memory pool (graphs run one at a time)."""
        if not self.capture:
            return
        pool = torch.cuda.graph_pool_handle()
        stream = torch.cuda.Stream()
        for size in reversed(self.sizes):
            stream.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(stream):           # compile kernels and settle allocations first
                for _ in range(2):
                    self.forward(size)
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[size] = self.forward(size)
            self.graphs[size] = graph
        torch.cuda.synchronize()

    def run(self, batch: DecodeBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """Copy the batch into the static buffers, pad, replay; (hidden, logits) of the real rows."""
        rows = len(batch)
        size = bucket_for(rows, self.sizes)
        if size is None:
            raise ValueError(f"a decode batch of {rows} exceeds the largest captured graph ({self.max_batch})")
        self._load(batch, size)
        if self.capture:
            self.graphs[size].replay()
            hidden, logits = self.outputs[size]
        else:
            hidden, logits = self.forward(size)
        return hidden[:rows], logits[:rows]

    def _load(self, batch: DecodeBatch, size: int) -> None:
        """Rows 0..len(batch) from the batch, rows up to `size` padding (token 0 at position 0, K/V into
        the dummy slot, no context). Padding rows keep stale page tables: with no context they read none."""
        rows, pad = len(batch), size - len(batch)
        columns = torch.tensor([batch.input_ids + [0] * pad, batch.positions + [0] * pad,
                                batch.slots + [self.dummy_slot] * pad, batch.seq_lens + [0] * pad],
                               dtype=torch.int64)
        width = max(len(table) for table in batch.block_tables)
        tables = torch.zeros(rows, width, dtype=torch.int32)
        rows_view = tables.numpy()              # row slices through numpy: ~3x faster than nested lists
        for row, table in enumerate(batch.block_tables):
            rows_view[row, :len(table)] = table
        self.input_ids[:size].copy_(columns[0], non_blocking=True)
        self.positions[:size].copy_(columns[1], non_blocking=True)
        self.slot_mapping[:size].copy_(columns[2], non_blocking=True)
        self.seq_lens[:size].copy_(columns[3], non_blocking=True)
        self.block_tables[:rows, :width].copy_(tables, non_blocking=True)
