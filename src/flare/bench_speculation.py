"""Complete speculative rounds as a `DecodeStepTarget` for the bench harness (`ignition bench --verify-width N`).

A round, for each of the batch's requests: its pending token and W - 1 drafts are fed to the target at
positions context .. context + W - 1 (one verification block of W target rows, B x W in all), the target's
logits at those rows are sampled with the device sampler (each request's own counter-based draws), the
drafts are accepted while they match (`acceptance.accept_matching`), and the state commits: each
request's last token and its accepted count land in the round's output buffers, where the next round's
input would be read. The proposal is the drafts themselves: point masses, as history drafts are
(random tokens from the case's seed; with random weights acceptance means nothing, the cost is what is
measured). With a `draft` model the proposal is that model's: it absorbs the pending token and drafts
W - 1 tokens one position at a time, all inside the timed round.

Without a draft model the round is one captured CUDA graph per case, as serving's graphs are; with one,
the round runs eagerly (its proposal loop is host-driven). `restore` puts the pending tokens back and
the round rewrites the same cache slots from the same tokens, so each timed round starts from the
prefilled state. Sampling is greedy: the bench's requests ignore EOS, and the widths stay fixed.
"""

from __future__ import annotations

import torch

from flare.bench_model import ModelDecodeTarget


class SpeculativeRoundTarget(ModelDecodeTarget):
    def __init__(self, model, model_config, *, width: int, max_batch: int, max_context: int, page_size: int = 16,
                 device: str | torch.device = "cuda", dtype: torch.dtype = torch.bfloat16, graph: bool = True,
                 draft=None):
        if width < 2:
            raise ValueError("a speculative round verifies at least one draft (width 2 or more)")
        super().__init__(model, model_config, max_batch=max_batch, max_context=max_context + width,
                         page_size=page_size, device=device, dtype=dtype, graph=graph and draft is None)
        from flare.engine.sampler import DeviceSampler

        self.width = width
        self.sampler = DeviceSampler(max_batch, model_config.vocab_size, self.device, seed=0,
                                     max_rows=max_batch * width)
        self.draft = draft                          # (model, ModelConfig) of a draft model, or None
        self.proposer = None

    @torch.inference_mode()
    def prepare(self, batch: int, context: int, seed: int) -> None:
        from flare.engine.attention import AttentionMetadata
        from flare.engine.sampling_params import SamplingParams

        self.graph = None
        width = self.width
        generator = torch.Generator().manual_seed(seed)
        tokens = torch.randint(0, self.cfg.vocab_size, (batch, context + width), generator=generator)
        tables = [list(range(b * self.pages_per_sequence, (b + 1) * self.pages_per_sequence)) for b in range(batch)]
        self._prefill(tokens, context, tables)
        for slot in range(batch):
            self.sampler.add(slot, SamplingParams(temperature=0.0, ignore_eos=True), ())
        self.pending = tokens[:, context].to(self.device)
        self.drafts = tokens[:, context + 1:].to(self.device)
        self.block = torch.cat([self.pending[:, None], self.drafts], dim=1)
        self.input_ids = self.block.reshape(-1).clone()
        self.meta = AttentionMetadata.build([width] * batch, [context + width] * batch, tables, self.page_size,
                                            self.device)
        self.positions = self.meta.positions()
        self.slots = torch.arange(batch, device=self.device).repeat_interleave(width)
        self.num_drafts = torch.full((batch,), width - 1, dtype=torch.int64, device=self.device)
        self.sampled = torch.empty(batch, dtype=torch.int64, device=self.device)
        self.accepted = torch.empty(batch, dtype=torch.int64, device=self.device)
        if self.draft is not None:
            self._prepare_proposer(tokens, context, tables, batch)
        if self.use_graph:
            self._capture()

    def _prefill(self, tokens: torch.Tensor, context: int, tables: list[list[int]]) -> None:
        from flare.bench_model import PREFILL_CHUNK
        from flare.engine.attention import AttentionMetadata

        for b in range(tokens.shape[0]):
            for start in range(0, context, PREFILL_CHUNK):
                end = min(start + PREFILL_CHUNK, context)
                meta = AttentionMetadata.build([end - start], [end], [tables[b]], self.page_size, self.device)
                self.model(tokens[b, start:end].to(self.device), meta.positions(), self.kv_caches, meta)

    def _forward(self) -> None:
        from flare.engine.speculation.acceptance import accept_matching

        if self.proposer is not None:
            self._propose()
        hidden = self.model(self.input_ids, self.positions, self.kv_caches, self.meta)
        logits = self.model.compute_logits(hidden)
        sampled = self.sampler.sample(logits, self.slots, self.positions + 1).view(-1, self.width)
        verdict = accept_matching(sampled, self.input_ids.view(-1, self.width)[:, 1:], self.num_drafts)
        self.sampled.copy_(verdict.last_tokens)                     # the commit: next input, accepted count
        self.accepted.copy_(verdict.counts - 1)

    @torch.inference_mode()
    def restore(self) -> None:
        self.input_ids.copy_(self.block.reshape(-1))

    # ---- a draft model's proposal (eager) -------------------------------------------------------------

    def _prepare_proposer(self, tokens: torch.Tensor, context: int, tables: list[list[int]], batch: int) -> None:
        """The draft model's cache prefilled with the same context, and a one-request-per-slot plan."""
        from flare.engine.attention import AttentionMetadata
        from flare.engine.batch_slots import BatchSlots
        from flare.engine.speculation.draft_model import DraftModelProposer
        from flare.engine.step import NewRequest, ScheduledRow, StepPlan

        model, config = self.draft
        num_pages = batch * self.pages_per_sequence
        self.proposer = DraftModelProposer(model, config, num_pages, self.page_size, batch, self.kv_caches[0].dtype,
                                           self.device)
        for b in range(batch):
            meta = AttentionMetadata.build([context], [context], [tables[b]], self.page_size, self.device)
            model(tokens[b, :context].to(self.device), meta.positions(), self.proposer.kv_caches, meta)
        self.proposer.previous[:batch] = tokens[:, context - 1].to(self.device)
        self.batch_slots = BatchSlots(batch, self.pages_per_sequence, num_pages, self.device)
        new = tuple(NewRequest(f"r{b}", b, tuple(tokens[b, :context + 1].tolist()), (), None) for b in range(batch))
        self.batch_slots.apply(StepPlan((), new))
        for b in range(batch):
            self.batch_slots.page_tables[b, :len(tables[b])] = torch.tensor(tables[b], dtype=torch.int32)
        self.round = StepPlan(tuple(ScheduledRow(f"r{b}", b, context, self.width, (), True, (),
                                                 num_proposed=self.width - 1) for b in range(batch)))

    def _propose(self) -> None:
        proposal = self.proposer.run(self.round, self.batch_slots, self.sampler)
        self.input_ids.view(-1, self.width)[:, 1:].copy_(proposal.tokens)
