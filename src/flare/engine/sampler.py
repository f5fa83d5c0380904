"""The sampler: one step's logits into tokens on the logits' device, the one sampling path.

`DeviceSampler` keeps each request's parameters in device tables indexed by its batch slot, written once
when the request takes the slot, and samples without a host sync or a full sort (Triton kernels on
CUDA, their torch reference on a CPU; flare.kernels.sampling and flare.kernels.sampling_reference,
checked against each other): capturable in a CUDA graph. Its semantics are the reference's: top-k keeps
every token equal to the k-th largest, top-p's head takes in the whole tie group at its edge,
temperatures below 1e-5 sample greedily (as vLLM), and random draws come from a counter-based generator
keyed by the request's seed and the token's position, so a request's tokens depend only on its own seed
and positions, whatever shares its batch. An unseeded request gets a seed from the engine's generator
when it takes its slot.

Order of the controls (as vLLM): repetition penalty (prompt and output tokens), presence and
frequency penalties (output tokens), logit bias, the allowed-token mask, then greedy argmax, or
temperature, min-p, top-k and top-p followed by a random draw (the exponential race, an exact draw
from the kept tokens' renormalised probabilities). Greedy rows see penalties, bias and mask too.

Penalty counts live in the tables too: a request's prompt tokens and output counts are written when it
takes a slot (again, from its output so far, after a preemption) and updated on the device from each
sampled id, so a step's penalty work does not grow with the sequence length.

Logprobs are those of the raw model distribution (log-softmax of the logits before any control),
as vLLM returns by default; `rank` is 1 for the most likely token.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from flare.engine.host_copy import upload
from flare.engine.logprobs import gather_logprobs
from flare.engine.outputs import TokenLogprob
from flare.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from flare.kernels import sampling_reference as reference
from flare.kernels.sampling_reference import SAMPLING_EPS, SamplingTables, SlotParams

_SEED_MASK = (1 << 64) - 1


class DeviceSampler:
    """Samples a batch's rows on the device from per-slot tables (docs/architecture.md, "Device sampler").

    Slots 0..max_slots-1 belong to requests; `padding_slot` is always greedy without penalties, for the
    padded rows of a captured batch. `max_rows` bounds the rows of one call (several rows may share a
    slot, e.g. a request's 1 + k speculative positions); it defaults to max_slots + 1.
    """

    def __init__(self, max_slots: int, vocab_size: int, device: torch.device | str, seed: int | None = None,
                 max_rows: int | None = None, use_triton: bool | None = None, kernel_config=None) -> None:
        self.device = torch.device(device)
        self.max_slots = max_slots
        self.vocab_size = vocab_size
        self.max_rows = max_rows if max_rows is not None else max_slots + 1
        self.tables = SamplingTables.allocate(max_slots + 1, vocab_size, self.device, MAX_LOGIT_BIAS)
        self.tables.params[self.padding_slot] = SlotParams(random=False).encode().to(self.device)
        self._generator = torch.Generator()
        if seed is None:
            self._generator.seed()
        else:
            self._generator.manual_seed(seed)
        self.use_triton = self.device.type == "cuda" if use_triton is None else use_triton
        self._workspace = None
        if self.use_triton:
            from flare.kernels.sampling import SamplingKernelConfig, SamplingWorkspace

            self._workspace = SamplingWorkspace.allocate(self.max_rows, vocab_size, self.device,
                                                         kernel_config or SamplingKernelConfig())

    @property
    def padding_slot(self) -> int:
        return self.max_slots

    def add(self, slot: int, params: SamplingParams, prompt_token_ids: Sequence[int],
            output_token_ids: Sequence[int] = ()) -> None:
        """A request takes `slot` (or resumes in it): its parameters, seed, bias and penalty counts are
        written to the device once. An unseeded request draws its seed from the sampler's generator."""
        if not 0 <= slot < self.max_slots:
            raise ValueError(f"sampler slot {slot} is outside 0..{self.max_slots - 1}")
        seed = params.seed if params.seed is not None else int(
            torch.randint(0, 2 ** 63 - 1, (1,), generator=self._generator))
        bias = _merged_bias(params.logit_bias, self.vocab_size)
        encoded = slot_params(params, self.vocab_size, seed, num_bias=len(bias))
        tables, device = self.tables, self.device
        # Every host-to-device copy here is queued without waiting: a request takes its slot while the
        # previous step may still run on the device (docs/architecture.md, "One step ahead").
        tables.params[slot] = upload(encoded.encode(), device)
        if bias:
            ids = torch.full((MAX_LOGIT_BIAS,), reference.UNUSED_BIAS_ID, dtype=torch.int32)
            values = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.float32)
            ids[:len(bias)] = torch.tensor([token_id for token_id, _ in bias], dtype=torch.int32)
            values[:len(bias)] = torch.tensor([value for _, value in bias], dtype=torch.float32)
            tables.bias_ids[slot], tables.bias_values[slot] = upload(ids, device), upload(values, device)
        if encoded.uses_penalties:
            tables.prompt_bits[slot] = upload(reference.pack_bits(list(prompt_token_ids), self.vocab_size), device)
            counts = torch.bincount(torch.as_tensor(list(output_token_ids), dtype=torch.int64),
                                    minlength=self.vocab_size)
            tables.output_counts[slot] = upload(counts.to(torch.int32), device)

    def remove(self, slot: int) -> None:
        """The request left the slot; the slot samples greedily until the next add."""
        self.tables.params[slot] = self.tables.params[self.padding_slot]

    def sample(self, logits: torch.Tensor, slots: torch.Tensor, positions: torch.Tensor,
               allowed_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """Token ids [N] int64 for logits [N, V]; row i samples for slots[i] as the token at positions[i]
        (the index it takes in its request's prompt + output). Penalty counts are updated on the device.
        On CUDA no host sync and no data-dependent shape: capturable in a CUDA graph."""
        if self.use_triton:
            from flare.kernels.sampling import sample

            return sample(logits, slots, positions, self.tables, self._workspace, allowed_bitmask)
        return reference.sample_reference(logits, slots, positions, self.tables, allowed_bitmask)

    def target_probs(self, logits: torch.Tensor, slots: torch.Tensor,
                     allowed_bitmask: torch.Tensor | None = None) -> torch.Tensor:
        """[N, V] float32: the distribution row i draws from after every control (one-hot at the argmax
        for greedy rows), for speculative rejection sampling. Counts are not updated."""
        if self.use_triton:
            from flare.kernels.sampling import target_probs

            return target_probs(logits, slots, self.tables, self._workspace, allowed_bitmask)
        return reference.target_probs_reference(logits, slots, self.tables, allowed_bitmask)


def slot_params(params: SamplingParams, vocab_size: int, seed: int, num_bias: int = 0) -> SlotParams:
    """A request's sampling parameters in the kernels' units (a top-k of the whole vocabulary is none)."""
    greedy = params.greedy or params.temperature < SAMPLING_EPS
    return SlotParams(
        random=not greedy,
        top_k=params.top_k if 0 < params.top_k < vocab_size else 0,
        top_p=params.top_p,
        inv_temperature=1.0 if greedy else 1.0 / params.temperature,
        log_min_p=math.log(params.min_p) if params.min_p > 0 else -math.inf,
        repetition_penalty=params.repetition_penalty,
        presence_penalty=params.presence_penalty,
        frequency_penalty=params.frequency_penalty,
        seed=seed & _SEED_MASK,
        num_bias=num_bias)


def _merged_bias(logit_bias: Sequence[tuple[int, float]], vocab_size: int) -> list[tuple[int, float]]:
    """Bias entries inside the vocabulary, one per token (repeats summed), by ascending token id."""
    merged: dict[int, float] = {}
    for token_id, value in logit_bias:
        if 0 <= token_id < vocab_size:
            merged[token_id] = merged.get(token_id, 0.0) + value
    return sorted(merged.items())           # at most MAX_LOGIT_BIAS: SamplingParams refuses more


def raw_logprobs(logits: torch.Tensor, token_ids: torch.Tensor, num_top: Sequence[int]) -> list[TokenLogprob]:
    """Logprobs of the raw model distribution (before any control) for rows that asked: logits [n, V] of
    those rows, their sampled token_ids [n]. Reads back to the host: call outside a captured graph."""
    return gather_logprobs(torch.log_softmax(logits.float(), dim=-1), token_ids, num_top)
