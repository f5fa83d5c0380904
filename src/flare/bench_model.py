"""A model's complete decode step as a `DecodeStepTarget` for the bench harness (flare.bench).

For each case, `prepare` prefills `batch` sequences of `context` seeded random tokens through the model
into a paged KV cache, then captures one decode step as a CUDA graph: forward of one pending token per
sequence (its K/V written at position `context`), logits and greedy sampling. Every replay rewrites the
same cache slot from the same token, and `restore` puts the pending tokens back, so each timed step
starts from the prefilled state.
"""

from __future__ import annotations

import torch

PREFILL_CHUNK = 2048


class ModelDecodeTarget:
    def __init__(self, model, model_config, *, max_batch: int, max_context: int, page_size: int = 16,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, graph: bool = True):
        from flare.engine.attention import allocate_kv_caches

        self.model, self.cfg = model, model_config
        self.device, self.page_size, self.use_graph = torch.device(device), page_size, graph
        self.pages_per_sequence = -(-(max_context + 1) // page_size)
        self.kv_caches = allocate_kv_caches(model_config, max_batch * self.pages_per_sequence, page_size,
                                            dtype, self.device)
        self.graph = None

    @torch.inference_mode()
    def prepare(self, batch: int, context: int, seed: int) -> None:
        from flare.engine.attention import AttentionMetadata

        self.graph = None
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.cfg.vocab_size, (batch, context + 1), generator=generator)
        tables = [list(range(b * self.pages_per_sequence, (b + 1) * self.pages_per_sequence))
                  for b in range(batch)]
        for b in range(batch):                                     # real prefill, chunk by chunk
            for start in range(0, context, PREFILL_CHUNK):
                end = min(start + PREFILL_CHUNK, context)
                meta = AttentionMetadata.build([end - start], [end], [tables[b]], self.page_size, self.device)
                self.model(tokens[b, start:end].to(self.device), meta.positions(), self.kv_caches, meta)
        self.pending = tokens[:, context].to(self.device)
        self.input_ids = self.pending.clone()
        self.meta = AttentionMetadata.build([1] * batch, [context + 1] * batch, tables, self.page_size,
                                            self.device)
        self.positions = self.meta.positions()
        self.sampled = torch.empty(batch, dtype=torch.int64, device=self.device)
        if self.use_graph:
            self._capture()

    def _forward(self) -> None:
        hidden = self.model(self.input_ids, self.positions, self.kv_caches, self.meta)
        self.sampled.copy_(self.model.compute_logits(hidden).argmax(dim=-1))

    def _capture(self) -> None:
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):                            # compile kernels and settle allocations
            for _ in range(2):
                self._forward()
        torch.cuda.current_stream().wait_stream(stream)
        self.graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(self.graph):
            self._forward()
        torch.cuda.synchronize()

    @torch.inference_mode()
    def restore(self) -> None:
        self.input_ids.copy_(self.pending)

    @torch.inference_mode()
    def step(self) -> None:
        if self.graph is not None:
            self.graph.replay()
        else:
            self._forward()
