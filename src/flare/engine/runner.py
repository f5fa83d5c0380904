"""Model runner (hot path, keep it small): scheduled chunks -> one forward pass -> sampled tokens.

Flattens the step's chunks into one token batch with its AttentionMetadata, runs the model, takes the
hidden row of each chunk's last token (and every prompt row when prompt logprobs are asked), computes
logits and samples on the device.

On CUDA, a step whose chunks all bring one token (decode) replays a captured graph of the smallest
catalog size that holds it (flare.engine.cuda_graphs); other steps run the model directly (compiled
when `compile_model` was applied). Sampling is the same code on both paths.
"""

from __future__ import annotations

import torch

from flare.engine.config import EngineConfig
from flare.engine.kv_cache import PageAllocator
from flare.engine.sampler import Sampler, gather_logprobs
from flare.engine.scheduler import RunnerOutput, ScheduledChunk, SchedulerOutput


class ModelRunner:
    """`graphs`: replay decode steps as CUDA graphs (default: on CUDA when every layer runs the Triton
    attention backend); `capture=False` runs the same static-buffer path eagerly, which is how the CPU
    tests exercise it."""

    def __init__(self, model, model_config, config: EngineConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int | None = None, graphs: bool | None = None,
                 capture: bool | None = None) -> None:
        from flare.engine.attention import allocate_kv_caches

        self.model = model
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.device = torch.device(device)
        self.sampler = Sampler(self.device, seed)
        on_cuda = self.device.type == "cuda"
        if graphs is None:
            from flare.engine.cuda_graphs import runs_triton_attention

            graphs = on_cuda and runs_triton_attention(model)
        # Graphs pad their batches; padded rows write into one extra page that the allocator never hands out.
        num_pages = config.num_pages + (1 if graphs else 0)
        self.kv_caches = allocate_kv_caches(model_config, num_pages, config.page_size, dtype, self.device)
        self.graphs = None
        if graphs:
            self.graphs = self._build_graphs(on_cuda if capture is None else capture)

    def _build_graphs(self, capture: bool):
        from flare.engine.cuda_graphs import DecodeGraphs

        config = self.config
        graphs = DecodeGraphs(self.model, self.kv_caches, config.decode_graph_sizes,
                              max_pages=config.max_pages_per_request, page_size=config.page_size,
                              dummy_slot=config.num_pages * config.page_size, max_seq_len=config.max_model_len,
                              capture=capture)
        graphs.capture_all()
        return graphs

    @torch.inference_mode()
    def execute(self, scheduled: SchedulerOutput, allocator: PageAllocator) -> RunnerOutput:
        chunks = scheduled.chunks
        self.sampler.forget(scheduled.preempted_ids)       # their counts are rebuilt when they resume
        sampling = [i for i, chunk in enumerate(chunks) if chunk.completes]
        if self._fits_graph(chunks):
            hidden, logits = self.graphs.run(self._decode_batch(chunks, allocator))
            query_start = list(range(len(chunks) + 1))
            logits = logits if len(sampling) == len(chunks) else logits[sampling]
        else:
            input_ids, positions, meta, query_start = self._prepare(chunks, allocator)
            hidden = self.model(input_ids, positions, self.kv_caches, meta)
            last_rows = [query_start[i + 1] - 1 for i in sampling]      # each chunk's last token
            logits = self.model.compute_logits(hidden[last_rows]) if sampling else None
        prompt_logprobs = self._prompt_logprobs(chunks, hidden, query_start)
        if not sampling:
            return RunnerOutput({}, {}, prompt_logprobs)
        requests = [chunks[i].request for i in sampling]
        result = self.sampler(logits, requests)
        ids = [r.request_id for r in requests]
        logprobs = {rid: lp for rid, lp in zip(ids, result.logprobs) if lp is not None}
        return RunnerOutput(dict(zip(ids, result.token_ids)), logprobs, prompt_logprobs)

    def _fits_graph(self, chunks: tuple[ScheduledChunk, ...]) -> bool:
        return (self.graphs is not None and len(chunks) <= self.graphs.max_batch
                and all(chunk.num_new_tokens == 1 for chunk in chunks))

    def _decode_batch(self, chunks: tuple[ScheduledChunk, ...], allocator: PageAllocator):
        """One token per chunk: the rows a decode graph reads."""
        from flare.engine.cuda_graphs import DecodeBatch

        page_size = self.config.page_size
        tables = [allocator.page_table(chunk.request.request_id) for chunk in chunks]
        positions = [chunk.start for chunk in chunks]
        return DecodeBatch(
            input_ids=[chunk.request.all_token_ids[chunk.start] for chunk in chunks],
            positions=positions,
            slots=[table[p // page_size] * page_size + p % page_size for table, p in zip(tables, positions)],
            seq_lens=[p + 1 for p in positions],
            block_tables=tables)

    def _prepare(self, chunks: tuple[ScheduledChunk, ...], allocator: PageAllocator):
        from flare.engine.attention import AttentionMetadata, leading_decodes

        page_size = self.config.page_size
        input_ids, positions, slots, query_start, seq_lens = [], [], [], [0], []
        tables = [allocator.page_table(chunk.request.request_id) for chunk in chunks]
        for chunk, table in zip(chunks, tables):
            end = chunk.start + chunk.num_new_tokens
            input_ids += chunk.request.all_token_ids[chunk.start:end]
            span = range(chunk.start, end)
            positions += span
            slots += [table[p // page_size] * page_size + p % page_size for p in span]
            query_start.append(query_start[-1] + chunk.num_new_tokens)
            seq_lens.append(end)
        width = max(len(table) for table in tables)
        query_lens = [chunk.num_new_tokens for chunk in chunks]
        block_tables = [table + [0] * (width - len(table)) for table in tables]
        device = self.device
        meta = AttentionMetadata(
            query_start_loc=torch.tensor(query_start, dtype=torch.int32, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int32, device=device),
            block_tables=torch.tensor(block_tables, dtype=torch.int32, device=device),
            slot_mapping=torch.tensor(slots, dtype=torch.int64, device=device),
            max_query_len=max(query_lens),
            max_seq_len=max(seq_lens),
            page_size=page_size,
            num_decodes=leading_decodes(query_lens),          # the scheduler puts decodes first
        )
        return (torch.tensor(input_ids, dtype=torch.int64, device=device),
                torch.tensor(positions, dtype=torch.int64, device=device), meta, query_start)

    def _prompt_logprobs(self, chunks, hidden: torch.Tensor, query_start: list[int]) -> dict[str, list]:
        """Logprobs of the prompt tokens each chunk predicts: the row at position p scores token p + 1."""
        found = {}
        for i, chunk in enumerate(chunks):
            request = chunk.request
            if not request.wants_prompt_logprobs:
                continue
            # Positions whose next token is a prompt token still lacking its logprob (a chunk replayed
            # after a preemption skips those already known).
            first = max(chunk.start, len(request.prompt_logprobs) - 1)
            last = min(chunk.start + chunk.num_new_tokens, request.num_prompt_tokens - 1)
            if first >= last:
                continue
            rows = hidden[query_start[i] + first - chunk.start: query_start[i] + last - chunk.start]
            logprobs = torch.log_softmax(self.model.compute_logits(rows), dim=-1)
            targets = torch.tensor(request.prompt_token_ids[first + 1:last + 1], device=self.device)
            found[request.request_id] = gather_logprobs(logprobs, targets, [request.params.prompt_logprobs] * len(rows))
        return found
