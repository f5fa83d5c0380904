"""The in-process engine on the real stories260k model: greedy text, logprobs, seeds, stops, aborts."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from flare.engine.config import EngineConfig
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import SamplingParams

PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def reference(stories260k):
    return json.loads((stories260k / "reference" / "greedy.json").read_text())


@pytest.fixture
def engine(stories260k, checked):
    def make(seed: int | None = None, **settings) -> LLMEngine:
        config = EngineConfig(**{"page_size": 16, "num_pages": 64, "max_model_len": 512, **settings})
        return checked(LLMEngine.from_checkpoint(stories260k, config, seed=seed))
    return make


def test_greedy_continuation_equals_the_recorded_one(engine, reference):
    [output] = engine().generate([PROMPT], SamplingParams(temperature=0, max_tokens=60))
    assert list(output.new_token_ids) == reference["greedy_ids"]
    assert output.new_text == reference["greedy_text"]
    assert output.finish_reason == "length" and output.num_prompt_tokens == 5 and output.num_output_tokens == 60


def test_logprobs_and_prompt_logprobs_follow_the_reference_logits(engine, reference, stories260k):
    logits = torch.from_numpy(np.load(stories260k / "reference" / "teacher_forced_logits.npy"))
    expected = torch.log_softmax(logits, dim=-1)
    ids = reference["prompt_ids"] + reference["greedy_ids"]
    params = SamplingParams(temperature=0, max_tokens=20, logprobs=3, prompt_logprobs=2)
    [output] = engine(prefill_chunk=2).generate([reference["prompt_ids"]], params)
    assert output.prompt_logprobs[0] is None
    for position, entry in enumerate(output.prompt_logprobs[1:], start=1):
        assert entry.token_id == ids[position]
        assert entry.logprob == pytest.approx(expected[position - 1, ids[position]].item(), abs=1e-4)
        assert len(entry.top) == 2
    for step, entry in enumerate(output.new_logprobs):
        row = expected[len(reference["prompt_ids"]) - 1 + step]
        assert entry.token_id == reference["greedy_ids"][step] and entry.rank == 1
        assert entry.logprob == pytest.approx(row.max().item(), abs=1e-4)
        assert [t for t, _ in entry.top] == row.topk(3).indices.tolist()


def sampled(engine, prompts, params):
    return [list(o.new_token_ids) for o in engine.generate(prompts, params)]


def test_seeded_sampling_is_reproducible_and_independent_of_the_batch(engine):
    seeded = SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, seed=1234)
    alone = sampled(engine(seed=1), [PROMPT], seeded)[0]
    again = sampled(engine(seed=2), [PROMPT], seeded)[0]
    crowd = ["Tom had a dog", PROMPT, "The sun", "Once upon a time there was"]
    params = [SamplingParams(temperature=1.0, max_tokens=30), seeded,
              SamplingParams(temperature=0.7, max_tokens=50, seed=7), SamplingParams(temperature=1.0, max_tokens=10)]
    crowded = sampled(engine(seed=3, prefill_chunk=4, max_num_batched_tokens=16), crowd, params)[1]
    assert alone == again == crowded
    other_seed = sampled(engine(seed=1), [PROMPT], SamplingParams(temperature=1.0, top_p=0.95, max_tokens=40, seed=99))[0]
    assert other_seed != alone


def test_a_stop_string_ends_the_request_and_frees_its_pages(engine, reference):
    llm = engine()
    [output] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=60, stop=("Lily",)))
    assert output.new_text == ", there was a little girl named "
    assert output.finish_reason == "stop" and output.stop_reason == "Lily"
    assert not llm.has_unfinished()


def test_stop_token_ids_and_eos(engine, reference):
    llm = engine()
    stop_at = reference["greedy_ids"][5]                      # " named"? any token of the path
    [output] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=60, stop_token_ids=(stop_at,)))
    assert list(output.new_token_ids) == reference["greedy_ids"][:6]
    assert output.finish_reason == "stop" and output.stop_reason == stop_at
    # EOS: make token 2 (</s>) irresistible; it ends the request unless ignore_eos is set.
    bias = ((2, 100.0),)
    [eos] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logit_bias=bias))
    assert list(eos.new_token_ids) == [2] and eos.finish_reason == "stop" and eos.stop_reason is None
    [ignored] = llm.generate([PROMPT], SamplingParams(temperature=0, max_tokens=5, logit_bias=bias, ignore_eos=True))
    assert list(ignored.new_token_ids) == [2] * 5 and ignored.finish_reason == "length"


def test_abort_frees_pages_and_the_others_continue(engine, reference):
    llm = engine()
    llm.add_request("keep", PROMPT, SamplingParams(temperature=0, max_tokens=60))
    llm.add_request("drop", "Tom had a big dog", SamplingParams(temperature=0, max_tokens=60))
    tokens = []
    for _ in range(5):
        tokens += [t for output in llm.step() if output.request_id == "keep" for t in output.new_token_ids]
    used = llm.core.allocator.num_used_pages
    llm.abort("drop")
    assert llm.core.allocator.num_used_pages < used
    llm.check_integrity()
    while llm.has_unfinished():
        for output in llm.step():
            assert output.request_id == "keep"
            tokens += output.new_token_ids
    assert len(tokens) == 60


def test_max_model_len_ends_a_request(engine):
    [output] = engine(max_model_len=12, num_pages=4, page_size=4).generate([PROMPT], SamplingParams(temperature=0, max_tokens=60))
    assert output.num_output_tokens == 7 and output.finish_reason == "length"


def test_a_too_long_prompt_is_refused(engine):
    from flare.engine.request import InvalidRequest

    with pytest.raises(InvalidRequest, match="shorten the prompt"):
        engine(max_model_len=8, num_pages=2, page_size=4).add_request("r", list(range(3, 20)))


def test_a_repeated_prompt_reuses_cached_pages_and_gives_the_same_text(engine, reference):
    llm = engine(page_size=4, num_pages=128)
    prompt = reference["prompt_ids"] + reference["greedy_ids"][:30]      # 35 tokens: 8 full pages
    params = SamplingParams(temperature=0, max_tokens=20)
    [first] = llm.generate([prompt], params)
    [second] = llm.generate([prompt], params)
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == 32
    assert second.new_token_ids == first.new_token_ids == tuple(reference["greedy_ids"][30:50])
    [uncached] = engine(page_size=4, num_pages=128, enable_prefix_caching=False).generate([prompt], params)
    assert uncached.new_token_ids == first.new_token_ids


def test_prompt_logprobs_survive_preemption(engine):
    prompts = ["Once upon a time there was a little girl named Lily", "Tom had a big dog. The dog was happy",
               "The sun was hot and the children played in the park"]
    params = SamplingParams(temperature=0, max_tokens=40, prompt_logprobs=1, logprobs=0)
    roomy = engine().generate(prompts, params)
    tight = engine(page_size=4, num_pages=24, max_model_len=96, prefill_chunk=4, max_num_batched_tokens=8)
    squeezed = tight.generate(prompts, params)
    assert tight.core.stats().num_preemptions > 0
    for a, b in zip(roomy, squeezed):
        assert a.new_token_ids == b.new_token_ids
        assert len(b.prompt_logprobs) == b.num_prompt_tokens
        assert [e.token_id for e in b.prompt_logprobs[1:]] == [e.token_id for e in a.prompt_logprobs[1:]]
        for x, y in zip(a.prompt_logprobs[1:], b.prompt_logprobs[1:]):
            assert y.logprob == pytest.approx(x.logprob, abs=1e-4)
