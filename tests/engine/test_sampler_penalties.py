"""Penalty counts kept from step to step: always equal to counting every token afresh, and a step
counts only the tokens that arrived since the last one."""

from __future__ import annotations

import pytest
import torch

from flare.engine import sampler as sampler_module
from flare.engine.config import EngineConfig
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.request import EngineRequest, Request
from flare.engine.sampler import PenaltyCounts, Sampler
from flare.engine.sampling_params import SamplingParams

VOCAB = 40
VOCAB_OF_STORIES = 512


def from_scratch(requests, vocab_size):
    """The counts by definition: prompt tokens present, output tokens counted."""
    prompt_seen = torch.stack([torch.bincount(torch.tensor(r.prompt_token_ids, dtype=torch.int64),
                                              minlength=vocab_size) > 0 for r in requests])
    output = torch.stack([torch.bincount(torch.tensor(r.output_token_ids, dtype=torch.int64),
                                         minlength=vocab_size).float() for r in requests])
    return prompt_seen, output


def make_request(request_id, prompt, **params) -> Request:
    return Request(EngineRequest(request_id, tuple(prompt), SamplingParams(**params)), arrival=0)


def test_kept_counts_equal_fresh_counts_through_steps_preemptions_and_finishes():
    generator = torch.Generator().manual_seed(0)
    penalties = [dict(repetition_penalty=1.3), dict(presence_penalty=0.5, frequency_penalty=0.3),
                 dict(repetition_penalty=0.8, frequency_penalty=-0.4), dict(temperature=0.7)]
    requests = [make_request(f"r{i}", torch.randint(0, VOCAB, (3 + 5 * i,), generator=generator).tolist(),
                             seed=i, **penalties[i % len(penalties)]) for i in range(6)]
    sampler = Sampler(seed=0)
    checked_rows = 0
    for step in range(40):
        # A shifting batch: requests sit out (waiting), some are preempted and come back later.
        batch = [r for i, r in enumerate(requests) if (step + i) % 5 != 0]
        preempted = [r.request_id for i, r in enumerate(requests) if (step + i) % 7 == 0]
        sampler.forget(preempted)
        logits = torch.randn(len(batch), VOCAB, generator=generator)
        kept = sampler_module.apply_penalties_and_bias(logits, batch, sampler.penalty_counts)
        fresh = sampler_module.apply_penalties_and_bias(logits, batch)
        assert torch.equal(kept, fresh)
        prompt_seen, output = sampler.penalty_counts.rows(batch, VOCAB, torch.device("cpu"))
        expected_seen, expected_output = from_scratch(batch, VOCAB)
        for row, request in enumerate(batch):
            if request.params.repetition_penalty != 1.0 or request.params.frequency_penalty \
                    or request.params.presence_penalty:
                assert torch.equal(prompt_seen[row], expected_seen[row])
                assert torch.equal(output[row], expected_output[row])
                checked_rows += 1
        for request, token in zip(batch, sampler(logits, batch).token_ids):
            request.append_output_token(token)
    assert checked_rows > 100
    assert max(max(torch.bincount(torch.tensor(r.output_token_ids))) for r in requests) > 1   # real frequencies


def test_counts_go_with_a_finished_request_or_when_forgotten():
    counts = PenaltyCounts()
    kept, dropped = make_request("k", [1, 2], presence_penalty=1.0), make_request("d", [3], presence_penalty=1.0)
    counts.rows([kept, dropped], VOCAB, torch.device("cpu"))
    assert len(counts) == 2
    del dropped
    assert len(counts) == 1
    counts.forget(["k"])
    assert len(counts) == 0


def test_penalties_under_preemption_match_a_roomy_engine_and_fresh_counts(stories260k, checked, monkeypatch):
    """Through the engine, whose runner samples with the DeviceSampler: before every sample, each penalty
    request's counts on the device equal counting its tokens afresh; a preempted request's counts are
    rebuilt from its output once, when it resumes."""
    from flare.kernels import sampling_reference

    original = sampling_reference.sample_reference
    compared, resumed, engines = [], [], []

    def compare(logits, slots, positions, tables, allowed_bitmask=None, update_counts=True):
        core = engines[-1].core
        for request in core.scheduler.running:
            penalized = request.params.repetition_penalty != 1.0 or request.params.frequency_penalty \
                or request.params.presence_penalty
            if request.seated and request.slot in slots.tolist() and penalized:
                fresh = torch.bincount(torch.tensor(request.output_token_ids, dtype=torch.int64),
                                       minlength=VOCAB_OF_STORIES)
                assert torch.equal(tables.output_counts[request.slot].long(), fresh)
                assert torch.equal(tables.prompt_bits[request.slot],
                                   sampling_reference.pack_bits(request.prompt_token_ids, VOCAB_OF_STORIES))
                compared.append(request.request_id)
        return original(logits, slots, positions, tables, allowed_bitmask, update_counts)

    monkeypatch.setattr(sampling_reference, "sample_reference", compare)
    add = sampler_module.DeviceSampler.add
    monkeypatch.setattr(sampler_module.DeviceSampler, "add", lambda self, slot, params, prompt, output=():
                        (resumed.append(slot) if output else None, add(self, slot, params, prompt, output)))
    prompts = ["Once upon a time there was a little girl named Lily", "Tom had a big dog. The dog was happy",
               "The sun was hot and the children played in the park"]
    params = [SamplingParams(temperature=0, max_tokens=40, repetition_penalty=1.3),
              SamplingParams(temperature=0.8, seed=7, max_tokens=40, frequency_penalty=0.5, presence_penalty=0.3),
              SamplingParams(temperature=0, max_tokens=40, presence_penalty=-0.5, repetition_penalty=0.9)]

    def run(**settings):
        # One step at a time, so that the host holds every id the device has counted when it compares.
        config = EngineConfig(**{"page_size": 16, "num_pages": 64, "max_model_len": 512, **settings},
                              one_step_ahead=False)
        engines.append(checked(LLMEngine.from_checkpoint(stories260k, config, seed=0)))
        return engines[-1], [o.new_token_ids for o in engines[-1].generate(prompts, params)]

    _, roomy = run()
    assert not resumed
    tight, squeezed = run(page_size=4, num_pages=24, max_model_len=96, prefill_chunk=4, max_num_batched_tokens=8)
    assert tight.core.stats().num_preemptions == len(resumed) > 0
    assert squeezed == roomy
    assert len(compared) > 80


def counting_scatters(monkeypatch) -> list[int]:
    """Record the number of elements each index_add_ adds (how penalty counts are accumulated)."""
    scattered = []
    original = torch.Tensor.index_add_

    def index_add_(self, dim, index, source, **kwargs):
        scattered.append(index.numel())
        return original(self, dim, index, source, **kwargs)

    monkeypatch.setattr(torch.Tensor, "index_add_", index_add_)
    return scattered


@pytest.mark.parametrize("prompt_length", [10, 1000])
def test_a_step_counts_only_the_new_tokens(monkeypatch, prompt_length):
    scattered = counting_scatters(monkeypatch)
    requests = [make_request(f"r{i}", [i % VOCAB] * prompt_length, temperature=0, repetition_penalty=1.2,
                             frequency_penalty=0.1) for i in range(3)]
    sampler = Sampler(seed=0)
    per_step = []
    for step in range(30):
        before = sum(scattered)
        tokens = sampler(torch.randn(len(requests), VOCAB), requests).token_ids
        per_step.append(sum(scattered) - before)
        for request, token in zip(requests, tokens):
            request.append_output_token(token)
    assert per_step[0] == 3 * prompt_length                 # the prompts, once
    assert per_step[1:] == [3] * 29                         # then one token per request, however long
