"""Drafts from an EAGLE-3 head (flare.models.eagle3) over the target's own hidden states.

The head's row at position p reads the token at p + 1 and a feature of position p: the target's residual
stream entering three of its layers at p, projected by the head's `fc` (or, while drafting ahead, the
head's own output at p - 1), and predicts the token at p + 2. Its KV cache has the target's pages, as a
draft model's has (one layer).

After each step's target forward and sampling (`absorb`), the head takes a row for every position the
target computed, with the token that follows it: the next fed token, or for a row's last kept position
the token the step chose (for a verifying row, each position's accepted draft or final token; rows past
the accepted ones are rewritten before the head attends to them, as rejected drafts' K/V are). It keeps
for each slot its output at the slot's last kept position (`carry`): that predicts the first draft of the
next step. At the next step's start (`run`) each proposing row feeds any core drafts, then its own drafts
one position at a time, each drawn from q (the request's controls on the head's logits over the target
vocabulary) with the uniforms u(seed, position, token, PURPOSE_DRAFT), as the draft model's are.

The target exposes the three layers' inputs when `LlamaModel.aux_layers` names them (flare.models.llama).
"""

from __future__ import annotations

import numpy as np
import torch

from flare.engine.attention import allocate_kv_caches
from flare.engine.batch_slots import BatchSlots, to_device
from flare.engine.speculation.draft_model import Proposal, StepOutcome, _flat, draw, proposing_rows
from flare.engine.step import StepPlan


class Eagle3Proposer:
    # The head reads the target's aux_hidden, which the target's forward sets in Python: a graph replay
    # would leave it at the capture's tensor, so the target's steps stay eager beside it.
    reads_target_hidden_states = True

    def __init__(self, head, target_model, slots: BatchSlots, num_pages: int, page_size: int, max_slots: int,
                 dtype: torch.dtype, device: torch.device) -> None:
        self.head = head
        self.slots = slots
        self.target = target_model
        target_layers = len(target_model.model.layers)
        target_model.model.aux_layers = head.cfg.aux_layers(target_layers)
        self.page_size = page_size
        self.cache_config = head.cfg.layer          # what kv_caches were allocated from (their format)
        self.kv_caches = allocate_kv_caches(head.cfg.layer, num_pages + 1, page_size, dtype, device)[:1]
        self.carry = torch.zeros(max_slots + 1, head.cfg.layer.hidden_size, dtype=dtype, device=device)

    @torch.inference_mode()
    def after_step(self, step: StepOutcome) -> None:
        """Rows for the step's computed positions, each with the token after it (see the module docstring)."""
        self.absorb(step.plan, self.slots, step.query_start, step.chosen)

    @torch.inference_mode()
    def absorb(self, plan: StepPlan, slots: BatchSlots, query_start: list[int], chosen: dict) -> None:
        """Rows for the step's computed positions. `chosen[i]` is plan row i's chosen tokens on the device:
        (a scalar token, None) for a plain sampling row, (tokens [1 + k], kept count) for a verifying
        row; absent for rows that do not sample."""
        aux = self.target.model.aux_hidden
        index, starts, lens, row_slots, host_ids, fills = [], [], [], [], [], []
        offset = 0
        for i, row in enumerate(plan.rows):
            state = slots.requests[row.slot]
            known = state.known_token_ids
            start, count = row.num_computed_tokens, row.num_new_tokens
            for j in range(count):
                next_is_fed = j + 1 < row.num_fed_tokens or not row.samples   # a chunk's next token is the prompt's
                if next_is_fed and start + j + 1 < len(known):
                    host_ids.append(int(known[start + j + 1]))
                else:
                    host_ids.append(0)
                    fills.append((offset + j, i, j - (row.num_fed_tokens - 1)))
            index += range(query_start[i], query_start[i] + count)
            starts.append(start)
            lens.append(count)
            row_slots.append(row.slot)
            offset += count
        ids, positions, meta = _flat(np.array(host_ids, dtype=np.int64), np.array(starts), np.array(lens),
                                     row_slots, slots, self.page_size)
        self._fill(ids, fills, chosen)
        features = self.head.combine(aux.index_select(0, to_device(np.array(index, dtype=np.int64), aux.device)))
        _, prenorm = self.head(ids, positions, features, self.kv_caches, meta)
        self._keep_carry(plan, chosen, lens, prenorm)

    def _fill(self, ids: torch.Tensor, fills: list[tuple[int, int, int]], chosen: dict) -> None:
        """Tokens the step chose, at the rows whose next token is one of them (past a row's kept ones: 0)."""
        for at, i, j in fills:
            if i not in chosen:
                continue                                   # a chunk that does not sample: the next is known
            tokens, _ = chosen[i]
            if tokens.dim() == 0 and j == 0:
                ids[at] = tokens
            elif tokens.dim() == 1 and j < tokens.shape[0]:
                ids[at] = tokens[j]

    def _keep_carry(self, plan: StepPlan, chosen: dict, lens: list[int], prenorm: torch.Tensor) -> None:
        ends = np.cumsum(lens)
        for i, row in enumerate(plan.rows):
            if i not in chosen:
                continue
            _, kept = chosen[i]
            last_fed = int(ends[i] - row.num_new_tokens + row.num_fed_tokens - 1)
            at = last_fed + (kept - 1 if kept is not None else 0)
            self.carry[row.slot] = prenorm.index_select(0, torch.as_tensor(at, device=prenorm.device).reshape(1))[0]

    @torch.inference_mode()
    def run(self, plan: StepPlan, slots: BatchSlots, sampler) -> Proposal | None:
        asked = proposing_rows(plan, self.carry.device)
        if asked is None:
            return None
        rows, counts, slot_ids, first = asked
        features = self.carry.index_select(0, slot_ids)
        # Core drafts first: the head reads them at positions m .. m + j - 1 (m: the fed token's).
        features = self._through_core_drafts(plan, rows, slots, features)
        tokens, probs = [], []
        for step in range(max(counts)):
            logits = self.head.compute_logits(self.head.norm(features))
            token, q = draw(logits, slot_ids, [first[r] + step for r in range(len(rows))], sampler)
            tokens.append(token)
            probs.append(q)
            if step + 1 < max(counts):
                positions = [first[r] + step - 1 for r in range(len(rows))]
                features = self._step(plan, rows, token, features, positions, slots)
        return Proposal(rows, counts, torch.stack(tokens, dim=1), torch.stack(probs, dim=1))

    def _through_core_drafts(self, plan, rows, slots, features):
        most = max(len(plan.rows[i].draft_token_ids) for i in rows)
        for step in range(most):
            tokens = [plan.rows[i].draft_token_ids[step] if step < len(plan.rows[i].draft_token_ids) else 0
                      for i in rows]
            positions = [plan.rows[i].num_computed_tokens + step for i in rows]
            token = to_device(np.array(tokens, dtype=np.int64), features.device)
            advanced = self._step(plan, rows, token, features, positions, slots)
            keep = to_device(np.array([step < len(plan.rows[i].draft_token_ids) for i in rows]), features.device)
            features = torch.where(keep[:, None], advanced, features)
        return features

    def _step(self, plan, rows, token, features, positions, slots):
        """One head row per proposing row: `token` at `positions` with `features`; returns the prenorm."""
        row_slots = [plan.rows[i].slot for i in rows]
        _, positions_d, meta = _flat(np.zeros(len(rows), dtype=np.int64), np.array(positions),
                                     np.ones(len(rows), dtype=np.int64), row_slots, slots, self.page_size)
        _, prenorm = self.head(token, positions_d, features, self.kv_caches, meta)
        return prenorm
