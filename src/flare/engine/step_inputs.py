"""A step's model inputs from its plan and the runner's slots (hot path, keep it small).

Host work is per row, never per page of context: positions and ids through numpy, one copy of every
index array to the device, where the K/V slots and page tables are read out of the persistent tables
(`flare.engine.batch_slots`). A row whose token the runner sampled itself reads it there too, from
`BatchSlots.last_sampled`, so it need not have reached the host.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flare.engine.attention import AttentionMetadata, leading_decodes
from flare.engine.batch_slots import BatchSlots, SlotRequest, to_device
from flare.engine.step import ScheduledRow, StepPlan

FROM_LAST_SAMPLED = -1      # a decode row's host token id when its token is the slot's last sampled one


@dataclass(frozen=True)
class FlatInputs:
    """The flattened batch: every row's new tokens one after another."""

    input_ids: torch.Tensor         # [T] int64
    positions: torch.Tensor         # [T] int64
    meta: AttentionMetadata
    sample_rows: torch.Tensor       # [S] int64: the hidden rows whose logits are sampled (one per sampling row
                                    # without drafts; verifying rows are sampled by speculation.verification)
    sample_slots: torch.Tensor      # [S] int64: the batch slot each sampled row samples for
    sample_positions: torch.Tensor  # [S] int64: the index the sampled token takes in its request
    query_start: list[int]          # host copy of meta.query_start_loc


def row_token_ids(row: ScheduledRow, state: SlotRequest) -> np.ndarray | None:
    """The ids the row feeds before its drafts, from what the request crossed with; None when it feeds one
    token the runner sampled for the slot (it is read on the device)."""
    known = state.known_token_ids
    start, fed = row.num_computed_tokens, row.num_fed_tokens
    if start + fed <= len(known):
        return known[start:start + fed]
    if start >= len(known) and fed == 1:
        return None
    raise RuntimeError(f"the row of {row.request_id!r} feeds positions {start}..{start + fed}, but its slot knows "
                       f"{len(known)} ids, and after them only one it sampled")


def flat_inputs(plan: StepPlan, slots: BatchSlots, page_size: int) -> FlatInputs:
    rows = plan.rows
    lens = np.array([row.num_new_tokens for row in rows], dtype=np.int64)
    starts = np.array([row.num_computed_tokens for row in rows], dtype=np.int64)
    query_start = np.zeros(len(rows) + 1, dtype=np.int64)
    np.cumsum(lens, out=query_start[1:])
    positions = np.arange(query_start[-1], dtype=np.int64) + np.repeat(starts - query_start[:-1], lens)
    input_ids = np.zeros(query_start[-1], dtype=np.int64)
    from_sampled, sample_rows, sample_slots, sample_positions = [], [], [], []
    for i, row in enumerate(rows):
        offset, fed = query_start[i], row.num_fed_tokens
        ids = row_token_ids(row, slots.requests[row.slot])
        if ids is None:
            from_sampled.append((offset, row.slot))
        else:
            input_ids[offset:offset + fed] = ids
        # The core's drafts; the runner's draft model writes its own after them, on the device.
        input_ids[offset + fed:offset + fed + len(row.draft_token_ids)] = row.draft_token_ids
        if row.samples and not row.num_drafts:      # verifying rows: flare.engine.speculation.verification
            sample_rows.append(offset + fed - 1)
            sample_slots.append(row.slot)
            sample_positions.append(row.num_computed_tokens + fed)
    row_slots = np.array([row.slot for row in rows], dtype=np.int64)
    seq_lens = starts + lens
    fixes = np.array(from_sampled, dtype=np.int64).reshape(-1, 2).T
    sampled = np.array([sample_rows, sample_slots, sample_positions], dtype=np.int64).reshape(3, -1)
    parts = [input_ids, positions, np.repeat(row_slots, lens), query_start, seq_lens, row_slots, fixes[0], fixes[1],
             *sampled]
    device = slots.page_tables.device
    ids, positions_d, token_slots, starts_d, seq_lens_d, row_slots_d, fix_at, fix_slot, *sample_d = torch.split(
        to_device(np.concatenate(parts), device), [len(part) for part in parts])
    if len(from_sampled):
        ids[fix_at] = slots.last_sampled[fix_slot]
    meta = flat_metadata(slots, page_size, lens, seq_lens, starts_d, seq_lens_d, row_slots_d, token_slots, positions_d,
                         host_query_start=query_start)
    return FlatInputs(ids, positions_d, meta, *sample_d, query_start.tolist())


def flat_metadata(slots: BatchSlots, page_size: int, lens: np.ndarray, seq_lens: np.ndarray, query_start,
                  seq_lens_d, row_slots, token_slots, positions,
                  host_query_start: np.ndarray | None = None) -> AttentionMetadata:
    """The attention metadata of flattened rows (`lens` new tokens each, `seq_lens` long after them) over
    the slots' page tables; the device tensors are the rows' query starts, sequence lengths and slots, and
    each token's row slot and position; `host_query_start` is the host copy of the query starts."""
    width = int(-(-seq_lens.max() // page_size))
    window = slots.window_page_tables
    return AttentionMetadata(
        query_start_loc=query_start.to(torch.int32), seq_lens=seq_lens_d.to(torch.int32),
        page_tables=slots.page_tables[:, :width].index_select(0, row_slots),
        slot_mapping=slots.page_tables[token_slots, positions // page_size].to(torch.int64) * page_size
        + positions % page_size,
        max_query_len=int(lens.max()), max_seq_len=int(seq_lens.max()), page_size=page_size,
        num_decodes=leading_decodes(lens.tolist()), host_query_start=host_query_start, host_seq_lens=seq_lens,
        window_page_tables=None if window is None else window[:, :width].index_select(0, row_slots))


def decode_rows(plan: StepPlan, slots: BatchSlots) -> np.ndarray:
    """[3, B] int64 for a decode graph: each row's slot, position, and token id (FROM_LAST_SAMPLED when
    the runner sampled it)."""
    table = np.empty((3, len(plan.rows)), dtype=np.int64)
    for i, row in enumerate(plan.rows):
        ids = row_token_ids(row, slots.requests[row.slot])
        table[:, i] = (row.slot, row.num_computed_tokens, FROM_LAST_SAMPLED if ids is None else ids[0])
    return table
