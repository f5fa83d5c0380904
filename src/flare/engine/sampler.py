"""Samplers: turn one step's logits into tokens on the logits' device.

`DeviceSampler` keeps each request's parameters in device tables indexed by its batch slot, written once
when the request takes the slot, and samples without a host sync or a full sort (Triton kernels on
CUDA, their torch reference elsewhere; flare.kernels.sampling): capturable in a CUDA graph. Its
semantics are flare.kernels.sampling_reference's: the order below, top-k keeps every token equal to the
k-th largest, top-p's head takes in the whole tie group at its edge, temperatures below 1e-5 sample
greedily (as vLLM), and random draws come from a counter-based generator keyed by the request's seed
and the token's position, so a request's tokens depend only on its own seed and positions.

`Sampler` is the per-step host-built path the runner uses until it switches to `DeviceSampler`.

Order of the controls (as vLLM): repetition penalty (prompt and output tokens), presence and
frequency penalties (output tokens), logit bias, then greedy argmax, or temperature, min-p, top-k
and top-p followed by a random draw. Greedy rows see penalties and bias too.

Random draws use the exponential race: the token is argmax(p / q) with q ~ Exp(1) drawn per
vocabulary entry, which samples exactly from p. A seeded request draws its q from its own
generator, so its tokens do not depend on what else shares the batch; unseeded requests draw
from the engine's generator.

Penalty counts are kept per request (PenaltyCounts) and brought up to date with the tokens sampled
since the last step, so a step's penalty work does not grow with the sequence length.

Logprobs are those of the raw model distribution (log-softmax of the logits before any control),
as vLLM returns by default; `rank` is 1 for the most likely token.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from flare.engine.logprobs import gather_logprobs
from flare.engine.outputs import TokenLogprob
from flare.engine.request import Request
from flare.engine.sampling_params import MAX_LOGIT_BIAS, SamplingParams
from flare.kernels import sampling_reference as reference
from flare.kernels.sampling_reference import SAMPLING_EPS, SamplingTables, SlotParams

_SEED_MASK = (1 << 64) - 1


@dataclass(frozen=True)
class SamplerOutput:
    token_ids: list[int]
    logprobs: list[TokenLogprob | None]     # one per row; None where the request asked for none


class Sampler:
    def __init__(self, device: torch.device | str = "cpu", seed: int | None = None) -> None:
        self.device = torch.device(device)
        self.generator = torch.Generator(device=self.device)
        if seed is None:
            self.generator.seed()
        else:
            self.generator.manual_seed(seed)
        self.penalty_counts = PenaltyCounts()

    def forget(self, request_ids: Iterable[str]) -> None:
        """Drop the penalty counts of these requests (preempted ones; they are rebuilt when they resume)."""
        self.penalty_counts.forget(request_ids)

    def __call__(self, logits: torch.Tensor, requests: Sequence[Request]) -> SamplerOutput:
        """logits: [N, V] float32, row i for requests[i]."""
        raw_logprobs = None
        if any(r.params.logprobs is not None for r in requests):
            raw_logprobs = torch.log_softmax(logits, dim=-1)
        token_ids = self.sample(logits, requests)
        logprobs: list[TokenLogprob | None] = [None] * len(requests)
        if raw_logprobs is not None:
            rows = [i for i, r in enumerate(requests) if r.params.logprobs is not None]
            found = gather_logprobs(raw_logprobs[rows], token_ids[rows],
                                    [requests[i].params.logprobs for i in rows])
            for row, entry in zip(rows, found):
                logprobs[row] = entry
        return SamplerOutput(token_ids.tolist(), logprobs)

    def sample(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        """The chosen ids [N] on the logits' device; no logprobs, nothing read back to the host."""
        return self._choose(apply_penalties_and_bias(logits, requests, self.penalty_counts), requests)

    def _choose(self, logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
        token_ids = logits.argmax(dim=-1)
        random_rows = [i for i, r in enumerate(requests) if not r.params.greedy]
        if not random_rows:
            return token_ids
        chosen = [requests[i] for i in random_rows]
        probs = _random_sampling_probs(logits[random_rows], chosen)
        noise = self._exponential_noise(chosen, probs.shape[-1])
        token_ids[random_rows] = (probs / noise).argmax(dim=-1)
        return token_ids

    def _exponential_noise(self, requests: Sequence[Request], vocab_size: int) -> torch.Tensor:
        noise = torch.empty(len(requests), vocab_size, device=self.device)
        unseeded = [i for i, r in enumerate(requests) if r.params.seed is None]
        if unseeded:
            noise[unseeded] = torch.empty(len(unseeded), vocab_size, device=self.device).exponential_(
                generator=self.generator)
        for i, request in enumerate(requests):
            if request.params.seed is not None:
                if request.generator is None:
                    request.generator = torch.Generator(device=self.device).manual_seed(request.params.seed)
                noise[i].exponential_(generator=request.generator)
        return noise


def apply_penalties_and_bias(logits: torch.Tensor, requests: Sequence[Request],
                             counts: PenaltyCounts | None = None) -> torch.Tensor:
    """Repetition, presence and frequency penalties and logit bias; returns `logits` itself if none apply.

    `counts` carries each request's token counts from step to step; without it they are counted afresh.
    """
    params = [r.params for r in requests]
    needs_repetition = any(p.repetition_penalty != 1.0 for p in params)
    needs_additive = any(p.presence_penalty or p.frequency_penalty for p in params)
    needs_bias = any(p.logit_bias for p in params)
    if not (needs_repetition or needs_additive or needs_bias):
        return logits
    logits = logits.clone()
    num_rows, vocab_size = logits.shape
    device = logits.device
    if needs_repetition or needs_additive:
        prompt_seen, output_counts = (counts if counts is not None else PenaltyCounts()).rows(requests, vocab_size, device)
    if needs_repetition:
        penalty = torch.tensor([p.repetition_penalty for p in params], device=device)[:, None]
        seen = prompt_seen | (output_counts > 0)
        penalized = torch.where(logits > 0, logits / penalty, logits * penalty)
        logits = torch.where(seen, penalized, logits)
    if needs_additive:
        frequency = torch.tensor([p.frequency_penalty for p in params], device=device)[:, None]
        presence = torch.tensor([p.presence_penalty for p in params], device=device)[:, None]
        logits -= frequency * output_counts + presence * (output_counts > 0)
    if needs_bias:
        rows, columns, values = [], [], []
        for row, p in enumerate(params):
            for token_id, bias in p.logit_bias:
                if 0 <= token_id < vocab_size:
                    rows.append(row), columns.append(token_id), values.append(bias)
        logits.index_put_((torch.tensor(rows, device=device), torch.tensor(columns, device=device)),
                          torch.tensor(values, device=device, dtype=logits.dtype), accumulate=True)
    return logits


def _uses_penalties(request: Request) -> bool:
    p = request.params
    return p.repetition_penalty != 1.0 or bool(p.presence_penalty or p.frequency_penalty)


@dataclass
class _TokenCounts:
    """One request's counts: which tokens its prompt holds, how often each occurs in its output."""

    prompt_seen: torch.Tensor       # [V] bool
    output_counts: torch.Tensor     # [V] float32
    num_counted: int                # output tokens already in output_counts


class PenaltyCounts:
    """Per-request token counts for the penalties, updated with the output tokens that arrived since
    the last step.

    A request's counts are made from its prompt (and any output it already has) the first time it is
    sampled with a penalty. Output tokens are only ever appended, also across a preemption, so counting
    the new ones keeps the counts exact. Counts are held by the request object weakly: a finished or
    aborted request takes them along when the core lets go of it; `forget` drops them sooner.
    """

    def __init__(self) -> None:
        self._counts: weakref.WeakKeyDictionary[Request, _TokenCounts] = weakref.WeakKeyDictionary()

    def __len__(self) -> int:
        """Requests whose counts are held."""
        return len(self._counts)

    def forget(self, request_ids: Iterable[str]) -> None:
        ids = set(request_ids)
        for request in [r for r in self._counts if r.request_id in ids]:
            del self._counts[request]

    def rows(self, requests: Sequence[Request], vocab_size: int,
             device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """[N, V] bool prompt tokens and [N, V] float32 output counts, row i for requests[i].

        Rows of requests without penalties stay empty: their penalties are neutral whatever the counts.
        """
        found = [self._current(r, vocab_size, device) if _uses_penalties(r) else None for r in requests]
        if any(c is None for c in found):
            empty = _TokenCounts(torch.zeros(vocab_size, dtype=torch.bool, device=device),
                                 torch.zeros(vocab_size, device=device), 0)
            found = [empty if c is None else c for c in found]
        return torch.stack([c.prompt_seen for c in found]), torch.stack([c.output_counts for c in found])

    def _current(self, request: Request, vocab_size: int, device: torch.device) -> _TokenCounts:
        counts = self._counts.get(request)
        if counts is None:
            prompt_seen = _count(request.prompt_token_ids, torch.zeros(vocab_size, device=device)) > 0
            counts = self._counts[request] = _TokenCounts(prompt_seen, torch.zeros(vocab_size, device=device), 0)
        new_ids = request.output_token_ids[counts.num_counted:]
        _count(new_ids, counts.output_counts)
        counts.num_counted += len(new_ids)
        return counts


def _count(ids: Sequence[int], counts: torch.Tensor) -> torch.Tensor:
    """Adds one to `counts` at each of `ids`, in place."""
    if ids:
        index = torch.tensor(ids, device=counts.device)
        counts.index_add_(0, index, torch.ones(len(ids), device=counts.device))
    return counts


def _random_sampling_probs(logits: torch.Tensor, requests: Sequence[Request]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (in vLLM's order); returns probabilities [n, V]."""
    device = logits.device
    params = [r.params for r in requests]
    temperature = torch.tensor([p.temperature for p in params], device=device)[:, None]
    logits = logits / temperature
    if any(p.min_p > 0 for p in params):
        min_p = torch.tensor([p.min_p for p in params], device=device)[:, None]
        probs = logits.softmax(dim=-1)
        logits = logits.masked_fill(probs < min_p * probs.max(dim=-1, keepdim=True).values, float("-inf"))
    if any(p.top_k > 0 or p.top_p < 1.0 for p in params):
        logits = _top_k_top_p(logits, params)
    return logits.softmax(dim=-1)


def _top_k_top_p(logits: torch.Tensor, params) -> torch.Tensor:
    vocab_size = logits.shape[-1]
    device = logits.device
    sorted_logits, order = logits.sort(dim=-1, descending=True)
    top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab_size for p in params], device=device)
    positions = torch.arange(vocab_size, device=device)[None, :]
    sorted_logits = sorted_logits.masked_fill(positions >= top_k[:, None], float("-inf"))
    top_p = torch.tensor([p.top_p for p in params], device=device)[:, None]
    probs = sorted_logits.softmax(dim=-1)
    # Keep the smallest head whose mass reaches top_p: drop a token once the mass before it does.
    beyond = (probs.cumsum(dim=-1) - probs) >= top_p
    beyond[:, 0] = False
    sorted_logits = sorted_logits.masked_fill(beyond, float("-inf"))
    return torch.empty_like(logits).scatter_(-1, order, sorted_logits)


# -- the device sampler ------------------------------------------------------------------------------------

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
        tables.params[slot] = encoded.encode().to(device)
        if bias:
            ids = torch.full((MAX_LOGIT_BIAS,), reference.UNUSED_BIAS_ID, dtype=torch.int32)
            values = torch.zeros(MAX_LOGIT_BIAS, dtype=torch.float32)
            ids[:len(bias)] = torch.tensor([token_id for token_id, _ in bias], dtype=torch.int32)
            values[:len(bias)] = torch.tensor([value for _, value in bias], dtype=torch.float32)
            tables.bias_ids[slot], tables.bias_values[slot] = ids.to(device), values.to(device)
        if encoded.uses_penalties:
            tables.prompt_bits[slot] = reference.pack_bits(list(prompt_token_ids), self.vocab_size).to(device)
            counts = torch.bincount(torch.as_tensor(list(output_token_ids), dtype=torch.int64),
                                    minlength=self.vocab_size)
            tables.output_counts[slot] = counts.to(torch.int32).to(device)

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
