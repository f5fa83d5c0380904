"""Drafts from a small draft model that shares the target's tokenizer (Qwen3-0.6B for Qwen3-8B, ...).

The draft runs inside the runner's step, before the target, on the same batch slots and page tables:
its KV caches have one tensor per draft layer with the target's page count and page size, so a request's
pages hold its target K/V and its draft K/V at once (the pool's bytes per token are the two together).

Each step the draft absorbs what the target is given: every row's fed tokens (a prompt chunk, or a
decode's token) and host drafts (history drafts it then continues from). A decoding row also feeds the
token before its newest again (`previous`, kept per slot on the device): after a round that accepted
every draft the draft model never saw the last of them, and after any other round that position is
recomputed to the same values. So before each step the draft model's cache holds every position of
the request but the newest. Then each row that proposes draws its drafts one position at a time, each
from the draft's distribution q after the request's own sampling controls (`DeviceSampler.target_probs`
on the draft logits: its temperature, top-k, top-p, min-p and bias; one-hot for greedy requests), with
the counter-based uniforms u(seed, position, token, PURPOSE_DRAFT). The q rows go to verification.

Positions a rejected draft wrote into the draft cache lie past the request's accepted tokens: the next
steps overwrite them before the draft attends to them, as in the target's cache.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from flare.engine.attention import allocate_kv_caches
from flare.engine.batch_slots import BatchSlots, to_device
from flare.engine.speculation.acceptance import uniforms
from flare.engine.step import ScheduledRow, StepPlan
from flare.engine.step_inputs import flat_metadata, row_token_ids
from flare.kernels.sampling_reference import RowParams

PURPOSE_DRAFT = 3           # the draw of a draft token (the sampler's purposes are 0, 1 and 2)


@dataclass(frozen=True)
class Proposal:
    """Row r of `rows` (plan indices) proposed `counts[r]` drafts: tokens[r, :counts[r]] with their q rows."""

    rows: list[int]
    counts: list[int]
    tokens: torch.Tensor            # [R, P] int64
    probs: torch.Tensor             # [R, P, V] float32


class DraftModelProposer:
    reads_target_hidden_states = False      # only the target's sampled tokens: its forward may replay graphs

    def __init__(self, model, model_config, num_pages: int, page_size: int, max_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.model = model
        self.config = model_config
        self.page_size = page_size
        self.cache_config = model_config            # what kv_caches were allocated from (their format)
        self.kv_caches = allocate_kv_caches(model_config, num_pages + 1, page_size, dtype, device)
        self.previous = torch.zeros(max_slots + 1, dtype=torch.int64, device=device)

    @torch.inference_mode()
    def run(self, plan: StepPlan, slots: BatchSlots, sampler) -> Proposal | None:
        """Absorb the step's tokens; propose each row's `num_proposed` drafts (None when none asks)."""
        last_rows, ids_after = self._absorb(plan, slots)
        asked = proposing_rows(plan, self.previous.device)
        if asked is None:
            return None
        rows, counts, slot_ids, first = asked
        hidden_rows = to_device(np.array([last_rows[i] for i in rows], dtype=np.int64), self.previous.device)
        logits = self.model.compute_logits(ids_after.index_select(0, hidden_rows))
        tokens, probs = [], []
        for step in range(max(counts)):
            active = [r for r, count in enumerate(counts) if count > step]
            token, q = draw(logits, slot_ids, [first[r] + step for r in range(len(rows))], sampler)
            tokens.append(token)
            probs.append(q)
            if step + 1 < max(counts):
                logits = self._next_logits(plan, rows, active, token, [first[r] + step for r in active], slots)
        return Proposal(rows, counts, torch.stack(tokens, dim=1), torch.stack(probs, dim=1))

    def after_step(self, step: StepOutcome) -> None:
        """Each sampling row's token before its newest (the input at the row's last kept position)."""
        self.previous.index_copy_(0, step.kept_slots, step.input_ids.index_select(0, step.kept_rows))

    # ---- internals -------------------------------------------------------------------------------

    def _absorb(self, plan: StepPlan, slots: BatchSlots) -> tuple[dict[int, int], torch.Tensor]:
        """One forward over every row's inputs; returns the flat index of each row's last input and the
        hidden states."""
        starts, ids, fixes, last_rows, lens, rows_slots = [], [], [], {}, [], []
        offset = 0
        for i, row in enumerate(plan.rows):
            fed = row_token_ids(row, slots.requests[row.slot])
            back = 1 if row.samples and row.num_fed_tokens == 1 and row.num_computed_tokens >= 1 else 0
            tokens = [0] * back + (list(fed) if fed is not None else [0]) + list(row.draft_token_ids)
            if back:
                fixes.append((offset, row.slot, 1))
            if fed is None:
                fixes.append((offset + back, row.slot, 0))
            starts.append(row.num_computed_tokens - back)
            ids += tokens
            lens.append(len(tokens))
            rows_slots.append(row.slot)
            offset += len(tokens)
            last_rows[i] = offset - 1
        inputs = _flat(np.array(ids, dtype=np.int64), np.array(starts), np.array(lens), rows_slots, slots,
                       self.page_size)
        token_ids, positions, meta = inputs
        for at, slot, from_previous in fixes:
            source = self.previous if from_previous else slots.last_sampled
            token_ids[at] = source[slot]
        return last_rows, self.model(token_ids, positions, self.kv_caches, meta)

    def _next_logits(self, plan: StepPlan, rows: list[int], active: list[int], token: torch.Tensor,
                     positions: list[int], slots: BatchSlots) -> torch.Tensor:
        """Feed each active row's newest draft at its position; logits [R, V] (inactive rows: zeros)."""
        device = token.device
        index = to_device(np.array(active, dtype=np.int64), device)
        row_slots = [plan.rows[rows[r]].slot for r in active]
        _, positions_d, meta = _flat(np.zeros(len(active), dtype=np.int64), np.array(positions),
                                     np.ones(len(active), dtype=np.int64), row_slots, slots, self.page_size)
        hidden = self.model(token.index_select(0, index), positions_d, self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        full = logits.new_zeros(len(rows), logits.shape[1])
        return full.index_copy_(0, index, logits)



@dataclass(frozen=True)
class StepOutcome:
    """What a step fed and chose, for a proposer to keep its state in step (`after_step`)."""

    plan: StepPlan
    input_ids: torch.Tensor         # [T] the step's flat input ids (drafts included)
    query_start: list[int]
    kept_slots: torch.Tensor        # [S] the slot of each sampling row
    kept_rows: torch.Tensor         # [S] the flat index of each sampling row's last kept position
    chosen: dict                    # plan row -> (tokens [1 + k] or a scalar, kept count or None), device


def draw(logits: torch.Tensor, slot_ids: torch.Tensor, positions: list[int], sampler):
    """A draft token per row from q (the row's sampling controls on the draft's logits) drawn with the
    uniforms u(seed, position, token, PURPOSE_DRAFT); returns (tokens, q)."""
    q = sampler.target_probs(logits, slot_ids)
    seeds = RowParams.gather(sampler.tables, slot_ids)
    at = to_device(np.array(positions, dtype=np.int64), logits.device)[:, None]
    u = uniforms(seeds.seed_lo, seeds.seed_hi, at, torch.arange(q.shape[1], device=q.device), PURPOSE_DRAFT)
    return (q.double() / -torch.log(u)).argmax(dim=1), q


class ProposingRows(NamedTuple):
    """The rows of a plan that ask their runner for drafts: plan indices, drafts each, their slots on the
    device, and the token index of each one's first proposed draft."""

    rows: list[int]
    counts: list[int]
    slot_ids: torch.Tensor
    first: list[int]


def proposing_rows(plan: StepPlan, device: torch.device) -> ProposingRows | None:
    """The plan's rows with `num_proposed` drafts; None when no row asks."""
    rows = [i for i, row in enumerate(plan.rows) if row.num_proposed]
    if not rows:
        return None
    return ProposingRows(rows, [plan.rows[i].num_proposed for i in rows],
                         to_device(np.array([plan.rows[i].slot for i in rows], dtype=np.int64), device),
                         [_first_proposed(plan.rows[i]) for i in rows])


def _first_proposed(row: ScheduledRow) -> int:
    """The token index of the row's first proposed draft: after its fed tokens and host drafts."""
    return row.num_computed_tokens + row.num_fed_tokens + len(row.draft_token_ids)


def _flat(ids: np.ndarray, starts: np.ndarray, lens: np.ndarray, row_slots: list[int], slots: BatchSlots,
          page_size: int):
    """Token ids, positions and attention metadata for rows of `lens` tokens from positions `starts`,
    over the slots' page tables."""
    query_start = np.zeros(len(lens) + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    positions = np.arange(query_start[-1], dtype=np.int64) + np.repeat(starts - query_start[:-1], lens)
    seq_lens = starts + lens
    row_slots = np.array(row_slots, dtype=np.int64)
    parts = [ids, positions, np.repeat(row_slots, lens), query_start, seq_lens, row_slots]
    device = slots.page_tables.device
    ids_d, positions_d, token_slots, starts_d, seq_lens_d, row_slots_d = torch.split(
        to_device(np.concatenate(parts), device), [len(part) for part in parts])
    meta = flat_metadata(slots, page_size, lens, seq_lens, starts_d, seq_lens_d, row_slots_d, token_slots, positions_d,
                         host_query_start=query_start)
    return ids_d.clone(), positions_d, meta
