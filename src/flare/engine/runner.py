"""Model runner (hot path, keep it small): a StepPlan -> one forward pass -> sampled ids, on the device.

The runner implements `flare.engine.step.StepRunner`: it applies a plan's deltas to its batch slots
(`flare.engine.batch_slots`), builds the step's inputs from them (`flare.engine.step_inputs`), runs the
model, samples with the device sampler (`flare.engine.sampler.DeviceSampler`: per-slot tables written
when a request takes its slot), and writes each sampled id into its slot's `last_sampled` entry, where
the slot's next decode reads it. `launch` returns before anything is read back: the ids, logprobs and prompt logprobs
travel to host memory behind the step on the device's queue, and `PendingStep.result()` waits for them.
Nothing in `launch` waits for the device.

On CUDA, a step whose rows all feed one token and sample (decode) replays a captured graph of the
smallest catalog size that holds it (flare.engine.cuda_graphs), sampling inside the graph (a forward graph
and a sampling graph: `launch_before_masks` lets grammar masks arrive between the two); other steps
run the model directly (compiled when `compile_model` was applied), or replay the piecewise graphs of
the smallest token bucket that holds them when the config has prompt graph sizes
(flare.engine.prompt_graphs), and call the same sampler. Rows that carry draft tokens (speculation) run
that way too: their drafts are verified against the target's distributions at their 1 + k positions
(flare.engine.speculation.verification), and each answers its accepted drafts and one more token.
Beside a learned draft no step fits the decode graphs (the draft runs in every step); a draft model's
steps still replay the prompt graphs, an EAGLE-3 head's run eagerly.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from flare.engine.batch_slots import BatchSlots, SlotRequest, to_device
from flare.engine.config import EngineConfig
from flare.engine.cuda_graphs import ForwardLaunch
from flare.engine.logprobs import SelectedLogprobs, select_logprobs
from flare.engine.sampler import DeviceSampler
from flare.engine.sampling_params import SamplingParams
from flare.engine.speculation.verification import VerifiedRows, VerifyingRows, verify, with_proposal
from flare.engine.step import (DoneStep, PromptLogprobs, RetainedGeometry, ScheduledRow, StepPlan, StepResult,
                               TransferNews, with_token_masks)
from flare.engine.step_inputs import decode_rows, flat_inputs


class ModelRunner:
    """`graphs`: replay decode steps as CUDA graphs (default: on CUDA when every layer runs the Triton
    attention backend); `capture=False` runs the same static-buffer path eagerly, which is how the CPU
    tests exercise it."""

    def __init__(self, model, model_config, config: EngineConfig, device: torch.device | str = "cpu",
                 dtype: torch.dtype = torch.float32, seed: int | None = None, graphs: bool | None = None,
                 capture: bool | None = None, draft=None) -> None:
        """`draft`: (model, its config) of a learned draft sharing the target's tokenizer, or None: a draft
        model (flare.models CausalLM, ModelConfig) or an EAGLE-3 head (Eagle3Draft, Eagle3Config)."""
        from flare.engine.attention import allocate_caches

        self.model = model
        self.config = config
        self.vocab_size = model_config.vocab_size
        self.device = torch.device(device)
        on_cuda = self.device.type == "cuda"
        if graphs is None:
            from flare.engine.cuda_graphs import runs_triton_attention

            graphs = on_cuda and runs_triton_attention(model)
        # Most rows one sampler call takes: a decode graph's, or every request's 1 + k verified positions.
        rows = max(config.decode_graph_sizes[-1], config.max_concurrency * (1 + config.speculation.draft_tokens) + 1)
        self.sampler = DeviceSampler(config.max_concurrency, self.vocab_size, self.device, seed, max_rows=rows)
        # Padded rows (graphs) and the padding slot write into one extra page the allocator never hands out.
        self.kv_caches = allocate_caches(model_config, config.num_pages + 1, config.window_pages + 1,
                                         config.page_size, dtype, self.device)
        self.slots = BatchSlots(config.max_concurrency, config.max_pages_per_request, config.num_pages, self.device,
                                self.sampler, window_dummy_page=config.window_pages if config.window_pages else None)
        self.proposer = None
        if draft is not None and config.speculation.draft_tokens:
            self.proposer = self._proposer(draft, dtype)
        self.graphs = self.prompt_graphs = None
        if graphs:
            capture = on_cuda if capture is None else capture
            # A learned draft runs beside every step, so no step fits the decode graphs; the target's
            # forward still replays through the prompt graphs (a draft model's steps carry (1 + k) tokens a
            # row), but not beside an EAGLE-3 head, which reads the target's hidden states from Python.
            if self.proposer is None:
                self.graphs = self._build_graphs(capture)
            if self.proposer is None or not self.proposer.reads_target_hidden_states:
                self.prompt_graphs = self._build_prompt_graphs(capture)
        self.store = self._retention_store(model_config)

    def _retention_store(self, model_config):
        """The host (and disk, pool) tiers of the prefix cache, over every cache on the pages: the target's
        and a learned draft's (flare.engine.retention.page_store); None when the engine retains nothing."""
        if not self.config.prefix_retention.enabled:
            return None
        from flare.engine.attention import kv_page_views
        from flare.engine.retention.page_store import RetainedPages

        views = kv_page_views(model_config, self.kv_caches)
        if getattr(self.proposer, "kv_caches", None):
            views += kv_page_views(self.proposer.cache_config, self.proposer.kv_caches)
        return RetainedPages(views, self.config.num_pages + 1, self.config.prefix_retention)

    def retained_geometry(self) -> RetainedGeometry | None:
        """What the runner keeps below the GPU, with the disk's page files listed now
        (flare.engine.step.RetainingRunner); None: nothing."""
        store = self.store
        if store is None:
            return None
        disk = store.disk
        return RetainedGeometry(store.num_slots, store.slot_bytes, disk.file_bytes if disk is not None else 0,
                                store.disk_listing())

    def transfer_news(self, wait_s: float = 0.0) -> TransferNews:
        return self.store.news(wait_s) if self.store is not None else TransferNews()

    def close_retention(self, deadline_s: float) -> None:
        if self.store is not None:
            self.store.close(deadline_s)
            self.store = None

    def _proposer(self, draft, dtype: torch.dtype):
        from flare.models.eagle3 import Eagle3Draft

        config = self.config
        if isinstance(draft[0], Eagle3Draft):
            from flare.engine.speculation.eagle3 import Eagle3Proposer

            return Eagle3Proposer(draft[0], self.model, self.slots, config.num_pages, config.page_size,
                                  config.max_concurrency, dtype, self.device)
        from flare.engine.speculation.draft_model import DraftModelProposer

        return DraftModelProposer(*draft, config.num_pages, config.page_size, config.max_concurrency, dtype, self.device)

    def _build_graphs(self, capture: bool):
        from flare.engine.cuda_graphs import DecodeGraphs

        config = self.config
        graphs = DecodeGraphs(self.model, self.kv_caches, config.decode_graph_sizes, self.slots,
                              page_size=config.page_size, max_seq_len=config.max_model_len, capture=capture)
        graphs.capture_all()
        return graphs

    def _build_prompt_graphs(self, capture: bool):
        """The piecewise graphs of prompt-carrying steps, when the config has their sizes (None otherwise)."""
        if not self.config.prompt_graph_sizes:
            return None
        from flare.engine.prompt_graphs import PromptGraphs

        graphs = PromptGraphs(self.model, self.kv_caches, self.config.prompt_graph_sizes, capture=capture)
        graphs.capture_all()
        return graphs

    def use_prompt_graphs(self, graphs) -> None:
        """Replay prompt-carrying steps through `graphs` (flare.engine.prompt_graphs.PromptGraphs over this
        runner's model and caches, e.g. the ones export just checked); None: run them eagerly."""
        self.prompt_graphs = graphs

    def reset(self) -> None:
        self.slots.reset()

    def samples_ahead(self, params: SamplingParams) -> bool:
        """Always: the device sampler keeps every request's state (penalty counts too) on the device."""
        return True

    def execute(self, plan: StepPlan) -> StepResult:
        """Launch the step and wait for its result."""
        return self.launch(plan).result()

    @torch.inference_mode()
    def launch(self, plan: StepPlan) -> PendingResult | DoneStep:
        if not self._move_pages(plan):
            return DoneStep(StepResult(()))
        states, pending = self._begin(plan)
        if self._fits_graph(plan.rows):
            forward = self.graphs.launch_forward(decode_rows(plan, self.slots))
            return self._sample_graphed(pending, forward, self._host_bitmask(plan.rows))
        proposal = self.proposer.run(plan, self.slots, self.sampler) if self.proposer is not None else None
        inputs = flat_inputs(plan, self.slots, self.config.page_size)
        if proposal is not None:
            place_proposal(inputs, plan, proposal)
        hidden = self._forward(inputs)
        logits = token_ids = None
        if pending.sampling:
            logits = self.model.compute_logits(hidden.index_select(0, inputs.sample_rows))
            token_ids = self.sampler.sample(logits, inputs.sample_slots, inputs.sample_positions,
                                            self._token_bitmask([plan.rows[i] for i in pending.sampling]))
            self.slots.last_sampled.index_copy_(0, inputs.sample_slots, token_ids)
        batch = verdict = None
        if any(row.samples and row.num_drafts for row in plan.rows):
            pending.verified, batch, verdict = self._verify(plan, states, hidden, inputs, proposal)
        if self.proposer is not None:
            self.proposer.after_step(step_outcome(plan, inputs, pending.sampling, token_ids, batch, verdict))
        return self._send_back(pending, hidden, inputs.query_start, logits, token_ids)

    @torch.inference_mode()
    def launch_before_masks(self, plan: StepPlan) -> MaskedLaunch:
        """Start a step whose constrained rows' grammar masks are not known yet (`StepRunner` seam for
        grammars, flare.engine.step.SamplingLater): a decode step that fits the graphs launches its forward
        graph now, and `sample_with(rows, masks)` launches the sampling graph with the masks, so the device
        runs the forward while the host fills them. A step outside the decode graphs (prompt-carrying or
        mixed) keeps the order of `launch`: nothing runs before the masks, and `sample_with` launches it
        whole with them (its forward is a larger share of its time, and its rows rarely need a mask)."""
        if not self._fits_graph(plan.rows):
            return MaskedLaunch(self, plan)
        self._move_pages(plan)
        _, pending = self._begin(plan)
        return MaskedLaunch(self, plan, pending, self.graphs.launch_forward(decode_rows(plan, self.slots)))

    def _move_pages(self, plan: StepPlan) -> bool:
        """The plan's prefix-retention copies (before its rows), and the wait for a copy out of a page the
        rows are handed to write; False when the plan has no rows to compute."""
        if self.store is not None:
            if plan.transfers is not None:
                self.store.apply(plan.transfers)
            if self.device.type == "cuda":
                self.store.guard(row.new_page_ids for row in plan.rows)
        return bool(plan.rows)

    def _begin(self, plan: StepPlan) -> tuple[list[SlotRequest], PendingResult]:
        """Apply the plan's deltas; the rows' slot requests and the step's answer to fill."""
        self.slots.apply(plan)
        states = [self.slots.requests[row.slot] for row in plan.rows]
        sampling = [i for i, row in enumerate(plan.rows) if row.samples and not row.num_drafts]
        return states, PendingResult(plan, states, sampling)

    def _sample_graphed(self, pending: PendingResult, forward, bitmask: np.ndarray | None) -> PendingResult:
        """The sampling half of a decode step whose forward graph `forward` was launched."""
        hidden, logits, token_ids = self.graphs.sample(forward, bitmask)
        return self._send_back(pending, hidden, list(range(len(pending.plan.rows) + 1)), logits, token_ids)

    def _send_back(self, pending: PendingResult, hidden: torch.Tensor, query_start: list[int],
                   logits: torch.Tensor | None, token_ids: torch.Tensor | None) -> PendingResult:
        """Start the step's answers on their way to the host, behind the step on the device's queue."""
        pending.prompt = self._prompt_logprobs(pending.plan.rows, pending.states, hidden, query_start)
        if pending.sampling:
            pending.token_ids = token_ids.to("cpu", non_blocking=True)
            pending.logprobs = self._logprobs([pending.states[i] for i in pending.sampling], logits, token_ids)
        if self.device.type == "cuda":
            pending.copied = torch.cuda.Event()
            pending.copied.record()             # behind the step's copies to the host
        return pending

    def _forward(self, inputs) -> torch.Tensor:
        """A step outside the decode graphs: replayed by the prompt graphs when a bucket holds it."""
        if self.prompt_graphs is not None and self.prompt_graphs.holds(inputs.meta.num_tokens):
            return self.prompt_graphs.run(inputs.input_ids, inputs.positions, inputs.meta)
        return self.model(inputs.input_ids, inputs.positions, self.kv_caches, inputs.meta)

    def _verify(self, plan: StepPlan, states: list[SlotRequest], hidden: torch.Tensor, inputs, proposal):
        """The rows carrying drafts: accepted drafts and one token after them; each row's last token
        becomes its slot's next input (flare.engine.speculation.verification). Returns (their answer on the
        way to the host, the rows, the verdict on the device)."""
        batch = VerifyingRows.of(plan.rows, inputs.query_start, self.device)
        probs = None
        if proposal is not None:
            batch, probs = with_proposal(batch, plan.rows, proposal, self.vocab_size)
        verdict, verified = verify(self.model, self.sampler, hidden, batch, [states[i].params for i in batch.rows],
                                   probs)
        self.slots.last_sampled.index_copy_(0, batch.slots, verdict.last_tokens)
        return verified, batch, verdict

    def _fits_graph(self, rows: tuple[ScheduledRow, ...]) -> bool:
        """Decode rows only: one token each, sampled (grammar masks go into the graph's mask buffer)."""
        return (self.graphs is not None and len(rows) <= self.graphs.max_batch
                and all(row.num_new_tokens == 1 and row.samples for row in rows))

    def _host_bitmask(self, rows) -> np.ndarray | None:
        """The rows' grammar bitmasks, [rows, ceil(V / 32)] int32 (-1: every token allowed); None when no
        row has one."""
        masked = [i for i, row in enumerate(rows) if row.token_mask is not None]
        if not masked:
            return None
        return self._padded_bitmask(len(rows), masked, np.stack([rows[i].token_mask[0] for i in masked]))

    def _padded_bitmask(self, count: int, rows, masks: np.ndarray) -> np.ndarray:
        """[count, ceil(V / 32)] int32: `masks` at `rows`, every token allowed (-1) elsewhere."""
        bitmask = np.full((count, -(-self.vocab_size // 32)), -1, dtype=np.int32)
        bitmask[list(rows)] = masks
        return bitmask

    def _token_bitmask(self, rows: list[ScheduledRow]) -> torch.Tensor | None:
        """The sampling rows' grammar bitmasks on the device, for the sampler (None: no row has one)."""
        bitmask = self._host_bitmask(rows)
        return to_device(bitmask, self.device) if bitmask is not None else None

    def _logprobs(self, states: list[SlotRequest], logits: torch.Tensor, token_ids: torch.Tensor):
        """Logprobs of the raw model distribution for the sampling rows that asked, on their way to the host."""
        asked = [i for i, state in enumerate(states) if state.params.logprobs is not None]
        if not asked:
            return None
        index = to_device(np.array(asked, dtype=np.int64), self.device)
        raw = torch.log_softmax(logits.index_select(0, index), dim=-1)
        most = max(states[i].params.logprobs for i in asked)
        return asked, select_logprobs(raw, token_ids.index_select(0, index), most).to_host()

    def _prompt_logprobs(self, rows, states, hidden: torch.Tensor, query_start: list[int]) -> dict:
        """Logprobs of the prompt tokens each row predicts: the row at position p scores token p + 1."""
        found = {}
        for i, (row, state) in enumerate(zip(rows, states)):
            if state.params.prompt_logprobs is None:
                continue
            first, last = row.num_computed_tokens, min(row.num_computed_tokens + row.num_new_tokens,
                                                      len(state.prompt_token_ids) - 1)
            if first >= last:
                continue
            hidden_rows = hidden[query_start[i]:query_start[i] + last - first]
            logprobs = torch.log_softmax(self.model.compute_logits(hidden_rows), dim=-1)
            targets = to_device(np.array(state.prompt_token_ids[first + 1:last + 1], dtype=np.int64), self.device)
            found[i] = (first + 1, select_logprobs(logprobs, targets, state.params.prompt_logprobs).to_host())
        return found


def step_outcome(plan: StepPlan, inputs, sampling: list[int], token_ids, batch, verdict):
    """What the step fed and chose, for the learned draft (`DraftModelProposer.after_step`, `Eagle3Proposer`)."""
    from flare.engine.speculation.draft_model import StepOutcome

    chosen = {i: (token_ids[k], None) for k, i in enumerate(sampling)}
    kept_slots, kept_rows = inputs.sample_slots, inputs.sample_rows
    if batch is not None:
        kept = batch.hidden_rows.view(len(batch.rows), batch.width).gather(1, (verdict.counts - 1)[:, None])[:, 0]
        kept_slots, kept_rows = torch.cat([kept_slots, batch.slots]), torch.cat([kept_rows, kept])
        chosen.update({i: (verdict.tokens[r], verdict.counts[r]) for r, i in enumerate(batch.rows)})
    return StepOutcome(plan, inputs.input_ids, inputs.query_start, kept_slots, kept_rows, chosen)


def place_proposal(inputs, plan: StepPlan, proposal) -> None:
    """Write the draft model's tokens into the step's input ids, after each row's core drafts."""
    targets, sources = [], []
    width = proposal.tokens.shape[1]
    for p, (i, count) in enumerate(zip(proposal.rows, proposal.counts)):
        row = plan.rows[i]
        first = inputs.query_start[i] + row.num_fed_tokens + len(row.draft_token_ids)
        targets += range(first, first + count)
        sources += range(p * width, p * width + count)
    index = to_device(np.array([targets, sources], dtype=np.int64), inputs.input_ids.device)
    inputs.input_ids.index_copy_(0, index[0], proposal.tokens.reshape(-1).index_select(0, index[1]))


@dataclass
class MaskedLaunch:
    """A step launched before its grammar masks (flare.engine.step.SamplingLater): `forward` is the decode
    graphs' launched forward half, or None for a step that has not started (outside the decode graphs)."""

    runner: ModelRunner
    plan: StepPlan
    pending: PendingResult | None = None
    forward: ForwardLaunch | None = None

    @torch.inference_mode()
    def sample_with(self, rows: tuple[int, ...], masks: np.ndarray) -> PendingResult:
        """Finish the step with the masks of its rows `rows` (int32 [len(rows), ceil(V / 32)])."""
        if self.forward is None:
            return self.runner.launch(with_token_masks(self.plan, rows, masks))
        bitmask = self.runner._padded_bitmask(len(self.plan.rows), rows, masks)
        return self.runner._sample_graphed(self.pending, self.forward, bitmask)


@dataclass
class PendingResult:
    """A launched step's answer on its way to the host (flare.engine.step.PendingStep)."""

    plan: StepPlan
    states: list[SlotRequest]               # the slot requests the rows ran for, as they were at launch
    sampling: list[int]                     # rows that sampled
    token_ids: torch.Tensor | None = None   # [len(sampling)], host memory once `event` has passed
    logprobs: tuple[list[int], SelectedLogprobs] | None = None      # (positions in `sampling`, selected)
    prompt: dict | None = None              # row -> (first prompt token scored, selected)
    verified: VerifiedRows | None = None    # the rows that carried drafts (speculation)
    copied: torch.cuda.Event | None = None  # passed when the copies to the host are done (CUDA)

    def result(self) -> StepResult:
        if self.copied is not None:
            self.copied.synchronize()
        rows = self.plan.rows
        token_ids: list[tuple[int, ...]] = [()] * len(rows)
        logprobs: list[tuple] = [()] * len(rows)
        if self.token_ids is not None:
            for i, token_id in zip(self.sampling, self.token_ids.tolist()):
                token_ids[i] = (token_id,)
        if self.logprobs is not None:
            asked, selected = self.logprobs
            entries = selected.entries([self.states[self.sampling[j]].params.logprobs for j in asked])
            for j, entry in zip(asked, entries):
                logprobs[self.sampling[j]] = (entry,)
        if self.verified is not None:
            self.verified.fill(token_ids, logprobs, [state.params.logprobs for state in self.states])
        prompt: list[PromptLogprobs | None] = [None] * len(rows)
        for i, (first_token, selected) in (self.prompt or {}).items():
            prompt[i] = PromptLogprobs(first_token, tuple(selected.entries([self.states[i].params.prompt_logprobs]
                                                                           * selected.token_ids.shape[0])))
        any_logprobs = self.logprobs is not None or (self.verified is not None and self.verified.logprobs is not None)
        return StepResult(tuple(token_ids), tuple(logprobs) if any_logprobs else (),
                          tuple(prompt) if self.prompt else ())
