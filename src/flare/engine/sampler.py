"""Sampler: turns one step's logits into tokens, batched on the logits' device.

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

import weakref
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import torch

from flare.engine.logprobs import gather_logprobs
from flare.engine.outputs import TokenLogprob
from flare.engine.request import Request


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
