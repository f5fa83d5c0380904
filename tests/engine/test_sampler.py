"""The sampler on hand-made logits: each control's semantics, logprobs, and seeds."""

from __future__ import annotations

import math

import pytest
import torch

from flare.engine.request import EngineRequest, Request
from flare.engine.sampler import Sampler
from flare.engine.sampling_params import SamplingParams


def request(prompt=(0,), output=(), request_id="r", **params) -> Request:
    r = Request(EngineRequest(request_id, tuple(prompt), SamplingParams(**params)), arrival=0)
    for token in output:
        r.append_output_token(token)
    return r


def sample(logits, *requests, seed=0):
    return Sampler(seed=seed)(torch.tensor(logits, dtype=torch.float32), list(requests))


def test_greedy_takes_the_argmax():
    assert sample([[0.1, 3.0, 2.0], [5.0, 1.0, 0.0]], request(temperature=0), request(temperature=0)).token_ids == [1, 0]


def test_repetition_penalty_covers_prompt_and_output_tokens():
    # token 1 (in the prompt) 3.0 -> 1.5; token 2 (in the output) 2.9 -> 1.45; token 0 untouched wins.
    out = sample([[2.0, 3.0, 2.9]], request(prompt=(1,), output=(2,), temperature=0, repetition_penalty=2.0))
    assert out.token_ids == [0]
    # negative logits are multiplied: -1 * 2 = -2 is below token 2's -1.5
    out = sample([[-3.0, -1.0, -1.5]], request(prompt=(1,), temperature=0, repetition_penalty=2.0))
    assert out.token_ids == [2]


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = [[1.0, 1.5, 1.2]]
    assert sample(logits, request(prompt=(1, 1, 1), temperature=0, presence_penalty=1.0)).token_ids == [1]
    assert sample(logits, request(output=(1,), temperature=0, presence_penalty=0.4)).token_ids == [2]
    # frequency: two occurrences of token 1 cost 2 * 0.2 = 0.4, presence alone would cost 0.2
    assert sample(logits, request(output=(1, 1), temperature=0, frequency_penalty=0.2)).token_ids == [2]
    assert sample(logits, request(output=(1, 1), temperature=0, presence_penalty=0.2)).token_ids == [1]


def test_logit_bias_moves_a_token():
    assert sample([[1.0, 2.0, 0.0]], request(temperature=0, logit_bias=((2, 5.0),))).token_ids == [2]
    assert sample([[1.0, 2.0, 0.0]], request(temperature=0, logit_bias=((1, -100.0),))).token_ids == [0]


def many_draws(logits, n=3000, **params):
    requests = [request(request_id=str(i), **params) for i in range(n)]
    tokens = sample([logits] * n, *requests).token_ids
    return torch.bincount(torch.tensor(tokens), minlength=len(logits)).float() / n


def test_random_sampling_follows_the_distribution_at_the_temperature():
    logits = [0.0, 1.0, 2.0, -1.0]
    for temperature in (1.0, 0.5):
        expected = torch.softmax(torch.tensor(logits) / temperature, dim=-1)
        assert torch.allclose(many_draws(logits, temperature=temperature), expected, atol=0.03)


def test_top_k_top_p_and_min_p_cut_the_tail():
    logits = [math.log(p) for p in (0.5, 0.3, 0.15, 0.05)]
    assert torch.allclose(many_draws(logits, top_k=2), torch.tensor([0.625, 0.375, 0, 0]), atol=0.03)
    # top_p 0.7: 0.5 alone is short of 0.7, so 0.3 joins; the mass before 0.15 is 0.8, so it is out
    assert torch.allclose(many_draws(logits, top_p=0.7), torch.tensor([0.625, 0.375, 0, 0]), atol=0.03)
    # min_p 0.25: tokens under 0.25 * 0.5 = 0.125 go
    assert torch.allclose(many_draws(logits, min_p=0.25), torch.tensor([0.5, 0.3, 0.15, 0]) / 0.95, atol=0.03)
    assert many_draws(logits, top_p=0.01)[0] == 1.0


def test_a_seed_gives_the_same_tokens_whatever_shares_the_batch():
    vocab = torch.randn(6, 50, generator=torch.Generator().manual_seed(1))
    alone = Sampler(seed=1)
    seeded = request(seed=42, request_id="s")
    tokens_alone = [alone(vocab[i:i + 1], [seeded]).token_ids[0] for i in range(6)]

    crowded = Sampler(seed=2)
    seeded_again = request(seed=42, request_id="s")
    others = [request(request_id=f"o{i}") for i in range(3)]
    tokens_crowded = []
    for i in range(6):
        batch = others[: i % 4] + [seeded_again]
        logits = torch.cat([torch.randn(len(batch) - 1, 50), vocab[i:i + 1]])
        tokens_crowded.append(crowded(logits, batch).token_ids[-1])
    assert tokens_alone == tokens_crowded
    assert len(set(tokens_alone)) > 1               # it really sampled


def test_unseeded_requests_differ_between_engines_with_different_seeds():
    logits = torch.zeros(1, 1000)
    draws = {Sampler(seed=s)(logits, [request()]).token_ids[0] for s in range(5)}
    assert len(draws) > 1


def test_logprobs_are_the_raw_model_distribution_with_rank_and_top_alternatives():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    raw = torch.log_softmax(logits, dim=-1)[0]
    out = Sampler(seed=0)(logits, [request(temperature=0, logprobs=2, logit_bias=((3, 10.0),))])
    entry = out.logprobs[0]
    assert out.token_ids == [3] and entry.token_id == 3
    assert entry.logprob == pytest.approx(raw[3].item())     # before the bias
    assert entry.rank == 4
    assert [t for t, _ in entry.top] == [1, 2]
    assert entry.top[0][1] == pytest.approx(raw[1].item())
    assert Sampler(seed=0)(logits, [request(temperature=0)]).logprobs == [None]


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
                                          ("max_tokens", 0), ("stop", ("",)), ("logprobs", 21),
                                          ("presence_penalty", 2.5), ("repetition_penalty", 0.0)])
def test_out_of_range_sampling_values_are_refused_naming_the_field(field, value):
    from flare.engine.sampling_params import InvalidSamplingParams

    with pytest.raises(InvalidSamplingParams, match=field.split("_")[0]):
        SamplingParams(**{field: value})
