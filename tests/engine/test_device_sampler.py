"""DeviceSampler on the CPU (its torch reference path): each control's semantics, the exact output
distribution, seeds, penalty counts kept on the device, and that sample() never reads the device back."""

from __future__ import annotations

import math

import pytest
import torch

from flare.engine.sampler import DeviceSampler, raw_logprobs
from flare.engine.sampling_params import InvalidSamplingParams, SamplingParams

SIGNIFICANCE = 0.001


def one_row(logits, params, prompt=(0,), output=(), position=0, mask=None, sampler=None):
    logits = torch.tensor([logits], dtype=torch.float32)
    sampler = sampler or DeviceSampler(4, logits.shape[1], "cpu", seed=0)
    sampler.add(1, params, prompt, output)
    return int(sampler.sample(logits, torch.tensor([1]), torch.tensor([position]), mask)[0])


def test_greedy_takes_the_first_largest_logit():
    assert one_row([0.1, 3.0, 2.0, 3.0], SamplingParams(temperature=0)) == 1
    assert one_row([0.1, 3.0, 2.0, 3.5], SamplingParams(temperature=1e-6)) == 3      # below 1e-5: greedy
    assert one_row([0.1, 3.0, 2.0, 3.5], SamplingParams(top_k=1)) == 3


def test_repetition_penalty_covers_prompt_and_output_tokens():
    # token 1 (prompt) 3.0 -> 1.5, token 2 (output) 2.9 -> 1.45; token 0 untouched wins
    assert one_row([2.0, 3.0, 2.9], SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(1,), output=(2,)) == 0
    # negative logits are multiplied: -1 * 2 = -2 falls below token 2's -1.5
    assert one_row([-3.0, -1.0, -1.5], SamplingParams(temperature=0, repetition_penalty=2.0), prompt=(1,)) == 2


def test_presence_and_frequency_penalties_count_output_tokens_only():
    logits = [1.0, 1.5, 1.2]
    assert one_row(logits, SamplingParams(temperature=0, presence_penalty=1.0), prompt=(1, 1, 1)) == 1
    assert one_row(logits, SamplingParams(temperature=0, presence_penalty=0.4), output=(1,)) == 2
    assert one_row(logits, SamplingParams(temperature=0, frequency_penalty=0.2), output=(1, 1)) == 2
    assert one_row(logits, SamplingParams(temperature=0, presence_penalty=0.2), output=(1, 1)) == 1


def test_logit_bias_moves_tokens_and_out_of_vocabulary_entries_are_ignored():
    assert one_row([1.0, 2.0, 0.0], SamplingParams(temperature=0, logit_bias=((2, 5.0), (7, 50.0)))) == 2
    assert one_row([1.0, 2.0, 0.0], SamplingParams(temperature=0, logit_bias=((1, -100.0),))) == 0


def test_logit_bias_is_bounded_and_finite():
    with pytest.raises(InvalidSamplingParams, match="at most 1024"):
        SamplingParams(logit_bias=tuple((i, 1.0) for i in range(1025)))
    with pytest.raises(InvalidSamplingParams, match="finite"):
        SamplingParams(logit_bias=((5, math.nan),))


def test_the_mask_allows_only_its_tokens():
    from flare.kernels.sampling_reference import pack_bits

    mask = pack_bits([0, 2], 40)[None]
    logits = [0.0] * 40
    logits[5] = 10.0
    for seed in range(20):
        assert one_row(logits, SamplingParams(seed=seed), mask=mask) in (0, 2)
    assert one_row(logits, SamplingParams(temperature=0), mask=mask) == 0


def exact_distribution(logits: list[float], params: SamplingParams) -> torch.Tensor:
    """The definition, in float64 from scratch: temperature, min-p, top-k, top-p (ties kept), renormalised."""
    values = torch.tensor(logits, dtype=torch.float64)
    probs = torch.softmax(values / params.temperature, dim=0)
    kept = probs >= params.min_p * probs.max()
    if params.top_k > 0:
        kept &= values >= values.sort(descending=True).values[params.top_k - 1]
    probs = torch.where(kept, probs, 0.0)
    probs /= probs.sum()
    if params.top_p < 1:
        order = values.masked_fill(~kept, -math.inf).sort(descending=True).indices
        reaching = int((probs[order].cumsum(0) < params.top_p).sum())
        kept &= values >= values[order[reaching]]
        probs = torch.where(kept, probs, 0.0)
    return probs / probs.sum()


def chi_square_p_value(tokens: torch.Tensor, expected: torch.Tensor) -> float:
    observed = torch.bincount(tokens, minlength=len(expected)).double()
    assert observed[expected == 0].sum() == 0, "a token outside the kept set was drawn"
    support = expected > 0
    counts = expected[support] * len(tokens)
    statistic = ((observed[support] - counts) ** 2 / counts).sum()
    freedom = int(support.sum()) - 1
    return float(torch.special.gammaincc(torch.tensor(freedom / 2.0), statistic / 2))


LOGITS = [2.0, 1.5, 1.5, 1.0, 0.5, 0.0, -0.5, -3.0]
DISTRIBUTION_CASES = [
    SamplingParams(temperature=1.0),
    SamplingParams(temperature=0.6),
    SamplingParams(temperature=1.4, top_k=3),                       # ties at the k-th value: 4 tokens stay
    SamplingParams(temperature=1.0, top_p=0.5),                     # the head widens over the 1.5 tie
    SamplingParams(temperature=0.8, top_k=5, top_p=0.8),
    SamplingParams(temperature=1.2, min_p=0.1),
    SamplingParams(temperature=2.0, min_p=0.05, top_k=6, top_p=0.95),
]


@pytest.mark.parametrize("params", DISTRIBUTION_CASES, ids=lambda p: f"T{p.temperature}-k{p.top_k}-p{p.top_p}-m{p.min_p}")
@pytest.mark.parametrize("stream", ["seeds", "positions"])
def test_draws_follow_the_exact_distribution(params, stream):
    """6,000 draws: one per seed at one position, or one seed over 6,000 positions."""
    draws = 6000
    vocab = len(LOGITS)
    sampler = DeviceSampler(draws, vocab, "cpu", seed=0)
    if stream == "seeds":
        for slot in range(draws):
            sampler.add(slot, SamplingParams(**{**vars(params), "seed": slot}), [0])
        slots, positions = torch.arange(draws), torch.full((draws,), 11)
    else:
        sampler.add(0, SamplingParams(**{**vars(params), "seed": 2024}), [0])
        slots, positions = torch.zeros(draws, dtype=torch.int64), torch.arange(draws)
    tokens = sampler.sample(torch.tensor([LOGITS] * draws), slots, positions)
    assert chi_square_p_value(tokens, exact_distribution(LOGITS, params)) > SIGNIFICANCE


def test_ties_at_the_thresholds_are_kept():
    assert (exact_distribution(LOGITS, SamplingParams(top_k=2)) > 0).tolist() == [True, True, True] + [False] * 5
    sampler = DeviceSampler(4, len(LOGITS), "cpu", seed=0)
    sampler.add(0, SamplingParams(top_k=2, seed=1), [0])
    sampler.add(1, SamplingParams(top_p=0.35, seed=1), [0])      # 0.35 is reached inside the 1.5 tie
    probs = sampler.target_probs(torch.tensor([LOGITS] * 2), torch.tensor([0, 1]))
    assert (probs[0] > 0).tolist() == [True, True, True] + [False] * 5
    assert (probs[1] > 0).tolist() == [True, True, True] + [False] * 5
    assert torch.allclose(probs[0].double(), exact_distribution(LOGITS, SamplingParams(top_k=2)), atol=1e-6)


def test_a_request_draws_the_same_tokens_whatever_shares_its_batch():
    generator = torch.Generator().manual_seed(4)
    rows = torch.randn(10, 64, generator=generator)
    probe = SamplingParams(temperature=1.0, top_p=0.95, seed=42)
    alone = DeviceSampler(2, 64, "cpu", seed=1)
    alone.add(0, probe, [1, 2])
    expected = [int(alone.sample(rows[i:i + 1], torch.tensor([0]), torch.tensor([5 + i]))[0]) for i in range(10)]
    crowded = DeviceSampler(16, 64, "cpu", seed=2)
    crowded.add(7, probe, [1, 2])
    for slot in range(5):
        crowded.add(slot, SamplingParams(temperature=0.7, top_k=10), [3])
    found = []
    for i in range(10):
        others = i % 5
        logits = torch.cat([torch.randn(others, 64, generator=generator), rows[i:i + 1]])
        slots = torch.tensor(list(range(others)) + [7])
        positions = torch.cat([torch.randint(0, 9, (others,), generator=generator), torch.tensor([5 + i])])
        found.append(int(crowded.sample(logits, slots, positions)[-1]))
    assert found == expected
    assert len(set(expected)) > 1                                   # it really sampled


def test_seeded_requests_repeat_and_unseeded_ones_follow_the_engine_seed():
    logits = torch.zeros(1, 1000)

    def draw(engine_seed, params):
        sampler = DeviceSampler(1, 1000, "cpu", seed=engine_seed)
        sampler.add(0, params, [0])
        return int(sampler.sample(logits, torch.tensor([0]), torch.tensor([3]))[0])

    assert len({draw(engine_seed, SamplingParams(seed=7)) for engine_seed in range(5)}) == 1
    assert len({draw(engine_seed, SamplingParams()) for engine_seed in range(5)}) > 1
    assert draw(9, SamplingParams()) == draw(9, SamplingParams())
    assert len({draw(0, SamplingParams(seed=seed)) for seed in range(6)}) > 1


def test_output_counts_follow_the_sampled_tokens_and_are_rebuilt_on_resume():
    vocab = 30
    generator = torch.Generator().manual_seed(5)
    sampler = DeviceSampler(3, vocab, "cpu", seed=0)
    params = SamplingParams(temperature=1.0, frequency_penalty=0.5, seed=3)
    sampler.add(2, params, [4, 5])
    sampler.add(0, SamplingParams(temperature=1.0, seed=4), [1])          # no penalties: no counts kept
    outputs = []
    for step in range(12):
        tokens = sampler.sample(torch.randn(2, vocab, generator=generator), torch.tensor([2, 0]),
                                torch.tensor([2 + step, 1 + step]))
        outputs.append(int(tokens[0]))
    expected = torch.bincount(torch.tensor(outputs), minlength=vocab).int()
    assert torch.equal(sampler.tables.output_counts[2], expected)
    assert sampler.tables.output_counts[0].sum() == 0
    sampler.remove(2)
    sampler.add(2, params, [4, 5], outputs)                              # resumed after a preemption
    assert torch.equal(sampler.tables.output_counts[2], expected)
    assert max(expected) > 1


def test_a_removed_slot_samples_greedily_without_penalties():
    sampler = DeviceSampler(2, 5, "cpu", seed=0)
    sampler.add(0, SamplingParams(temperature=2.0, repetition_penalty=3.0, logit_bias=((0, 9.0),)), [3])
    sampler.remove(0)
    assert int(sampler.sample(torch.tensor([[0.0, 1.0, 0.0, 2.0, 0.5]]), torch.tensor([0]), torch.tensor([0]))) == 3


def test_raw_logprobs_ignore_every_control():
    logits = torch.tensor([[1.0, 3.0, 2.0, 0.0]])
    sampler = DeviceSampler(1, 4, "cpu", seed=0)
    sampler.add(0, SamplingParams(temperature=0, logit_bias=((3, 10.0),)), [0])
    token = sampler.sample(logits, torch.tensor([0]), torch.tensor([0]))
    entry = raw_logprobs(logits, token, [2])[0]
    raw = torch.log_softmax(logits, dim=-1)[0]
    assert entry.token_id == 3 and entry.rank == 4
    assert entry.logprob == pytest.approx(float(raw[3]))
    assert [t for t, _ in entry.top] == [1, 2]


def test_sample_reads_nothing_back_from_the_device(monkeypatch):
    """The Triton path's host code: no .item()/.tolist()/nonzero()/bool(tensor), and every launch's
    grid and tensor shapes depend only on the batch's shape, never on values (so a graph can capture it)."""
    import flare.kernels.sampling as kernels

    launches = []

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            def launch(*args, **kwargs):
                shapes = tuple(tuple(a.shape) for a in args if isinstance(a, torch.Tensor))
                launches.append((self.name, grid, shapes, tuple(sorted(kwargs.items()))))
            return launch

    for name in ("_prepare_kernel", "_pass_kernel", "_finish_kernel"):
        monkeypatch.setattr(kernels, name, Recorder(name))
    sampler = DeviceSampler(4, 300, "cpu", seed=0, use_triton=True)

    def forbidden(*args, **kwargs):
        raise AssertionError("sample() read a tensor back to the host")

    runs = []
    for values in (torch.zeros(3, 300), torch.randn(3, 300) * 100):
        sampler.add(0, SamplingParams(top_p=float(values.abs().max() % 0.5 + 0.4), seed=1), [1])
        with monkeypatch.context() as patch:
            for method in ("item", "tolist", "nonzero", "__bool__", "__int__", "__float__", "numpy", "cpu"):
                patch.setattr(torch.Tensor, method, forbidden)
            sampler.sample(values, torch.tensor([0, 1, 4]), torch.tensor([3, 4, 5]))
        runs.append(list(launches))
        launches.clear()
    assert runs[0] == runs[1]
    assert len(runs[0]) == 18


@pytest.mark.parametrize("field, value", [("temperature", -0.1), ("top_p", 0.0), ("top_k", -2), ("min_p", 1.5),
                                          ("max_tokens", 0), ("stop", ("",)), ("logprobs", 21),
                                          ("presence_penalty", 2.5), ("repetition_penalty", 0.0)])
def test_out_of_range_sampling_values_are_refused_naming_the_field(field, value):
    with pytest.raises(InvalidSamplingParams, match=field.split("_")[0]):
        SamplingParams(**{field: value})
