"""Penalty counts on the device through the engine: before every sample they equal counting the request's
tokens afresh, also across preemptions, and a resumed request's counts are rebuilt from its output once."""

from __future__ import annotations

import torch

from flare.engine import sampler as sampler_module
from flare.engine.config import EngineConfig
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import SamplingParams

VOCAB_OF_STORIES = 512


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
