"""The runner's side of a speculative round: the verifying rows of a step, checked against the target.

A verifying row is a sampling row that carries drafts (`ScheduledRow.draft_token_ids`): it fed one
token, then k drafts, and the target's hidden states at those 1 + k positions give the distributions the
drafts are checked against (`acceptance.accept_drafts`). The rest of the step (prefill chunks, plain
decodes) is sampled as before; this module only handles the verifying rows, and hands the runner their
tokens: on the device (each row's last token becomes the slot's `last_sampled`) and on their way to the
host (`VerifiedRows`, read by the step's result).

Requests with repetition, presence or frequency penalties are never drafted for
(`settings.speculates`); a row that carries drafts anyway is refused.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flare.engine.batch_slots import to_device
from flare.engine.logprobs import SelectedLogprobs, select_logprobs
from flare.engine.sampling_params import SamplingParams
from flare.engine.speculation.acceptance import Verdict, accept_drafts, accept_matching
from flare.engine.speculation.settings import speculates
from flare.engine.step import ScheduledRow
from flare.kernels.sampling_reference import RowParams


@dataclass(frozen=True)
class VerifyingRows:
    """The verifying rows of a step, as index arrays on the device (built on the host once)."""

    rows: list[int]                 # their indices in the plan
    width: int                      # 1 + the most drafts among them
    hidden_rows: torch.Tensor       # [R * width] int64: the flat hidden row of each verified position
    drafts: torch.Tensor            # [R, width - 1] int64, zero past a row's drafts
    num_drafts: torch.Tensor        # [R] int64
    slots: torch.Tensor             # [R] int64
    first_positions: torch.Tensor   # [R] int64: the token index of each row's first new token

    @staticmethod
    def of(plan_rows: tuple[ScheduledRow, ...], query_start: list[int], device: torch.device) -> VerifyingRows:
        rows = [i for i, row in enumerate(plan_rows) if row.samples and row.num_drafts]
        width = 1 + max(plan_rows[i].num_drafts for i in rows)
        hidden = np.zeros((len(rows), width), dtype=np.int64)
        drafts = np.zeros((len(rows), width - 1), dtype=np.int64)
        other = np.zeros((3, len(rows)), dtype=np.int64)
        for r, i in enumerate(rows):
            row = plan_rows[i]
            k = row.num_drafts
            last_fed = query_start[i] + row.num_fed_tokens - 1
            hidden[r] = last_fed + np.minimum(np.arange(width), k)
            drafts[r, :len(row.draft_token_ids)] = row.draft_token_ids      # proposed ones: `with_proposal`
            other[:, r] = (k, row.slot, row.num_computed_tokens + row.num_fed_tokens)
        parts = [hidden.ravel(), drafts.ravel(), other.ravel()]
        flat = to_device(np.concatenate(parts), device)
        hidden_d, drafts_d, other_d = torch.split(flat, [len(part) for part in parts])
        num_drafts, slots, first = other_d.view(3, len(rows))
        return VerifyingRows(rows, width, hidden_d, drafts_d.view(len(rows), width - 1), num_drafts, slots, first)


def with_proposal(batch: VerifyingRows, plan_rows: tuple[ScheduledRow, ...], proposal,
                  vocab_size: int) -> tuple[VerifyingRows, torch.Tensor]:
    """The batch with the draft model's tokens after each row's core drafts, and every draft's q: the
    draft model's distribution where it proposed, a point mass at the core's drafts."""
    from dataclasses import replace

    device = batch.drafts.device
    depth = batch.width - 1
    targets, sources = [], []
    position = {plan_index: r for r, plan_index in enumerate(batch.rows)}
    for p, (plan_index, count) in enumerate(zip(proposal.rows, proposal.counts)):
        first = len(plan_rows[plan_index].draft_token_ids)
        targets += [position[plan_index] * depth + first + j for j in range(count)]
        sources += [p * proposal.tokens.shape[1] + j for j in range(count)]
    index = to_device(np.array([targets, sources], dtype=np.int64).reshape(2, -1), device)
    drafts = batch.drafts.reshape(-1).clone()
    drafts.index_copy_(0, index[0], proposal.tokens.reshape(-1).index_select(0, index[1]))
    drafts = drafts.view(batch.drafts.shape)
    probs = torch.nn.functional.one_hot(drafts, vocab_size).float().reshape(-1, vocab_size)
    probs.index_copy_(0, index[0], proposal.probs.reshape(-1, vocab_size).index_select(0, index[1]))
    return replace(batch, drafts=drafts), probs.view(len(batch.rows), depth, vocab_size)


@dataclass
class VerifiedRows:
    """The verifying rows' answer on its way to the host."""

    rows: list[int]
    tokens: torch.Tensor                                    # [R, width], host memory once copied
    counts: torch.Tensor                                    # [R]
    logprobs: tuple[list[int], int, SelectedLogprobs] | None = None    # (rows that asked, width, selected)

    def fill(self, token_ids: list, logprobs: list, num_top: list[int | None]) -> None:
        """Write each verifying row's ids (and logprobs where asked) into the step's per-row lists;
        `num_top[i]` is row i's requested number of alternatives."""
        tokens, counts = self.tokens.tolist(), self.counts.tolist()
        for r, i in enumerate(self.rows):
            token_ids[i] = tuple(tokens[r][:counts[r]])
        if self.logprobs is None:
            return
        asked, width, selected = self.logprobs
        tops = [num_top[self.rows[r]] for r in asked for _ in range(width)]
        entries = selected.entries(tops)
        for n, r in enumerate(asked):
            logprobs[self.rows[r]] = tuple(entries[n * width:n * width + counts[r]])


def verify(model, sampler, hidden: torch.Tensor, batch: VerifyingRows, params: list[SamplingParams],
           draft_probs: torch.Tensor | None = None) -> tuple[Verdict, VerifiedRows]:
    """Check the verifying rows' drafts against the target; `params[r]` are row r's sampling params.
    Returns the verdict on the device and its copy on the way to the host."""
    if not all(speculates(p) for p in params):
        raise RuntimeError("a row with drafts samples with penalties; such requests must not be drafted for")
    logits = model.compute_logits(hidden.index_select(0, batch.hidden_rows))
    width, vocab_size = batch.width, logits.shape[1]
    slots = batch.slots.repeat_interleave(width)
    if draft_probs is None:                 # point masses: the sampler's own draws decide (acceptance module)
        positions = (batch.first_positions[:, None] + torch.arange(width, device=logits.device)).ravel()
        sampled = sampler.sample(logits, slots, positions).view(-1, width)
        verdict = accept_matching(sampled, batch.drafts, batch.num_drafts)
    else:
        probs = sampler.target_probs(logits, slots)
        seeds = RowParams.gather(sampler.tables, batch.slots)
        verdict = accept_drafts(probs.view(-1, width, vocab_size), batch.drafts, batch.num_drafts,
                                seeds.seed_lo[:, 0], seeds.seed_hi[:, 0], batch.first_positions, draft_probs)
    verified = VerifiedRows(batch.rows, verdict.tokens.to("cpu", non_blocking=True),
                            verdict.counts.to("cpu", non_blocking=True))
    asked = [r for r, p in enumerate(params) if p.logprobs is not None]
    if asked:
        asked_d = to_device(np.array(asked, dtype=np.int64), logits.device)
        index = (asked_d[:, None] * width + torch.arange(width, device=logits.device)).ravel()
        raw = torch.log_softmax(logits.index_select(0, index), dim=-1)
        chosen = verdict.tokens.index_select(0, asked_d).ravel()
        most = max(params[r].logprobs for r in asked)
        verified.logprobs = (asked, width, select_logprobs(raw, chosen, most).to_host())
    return verdict, verified
