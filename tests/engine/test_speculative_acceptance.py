"""Verification of drafts: greedy rows accept exactly the argmax chain; sampled rows come out distributed
exactly as the target's distributions, whatever the drafts were proposed from (a statistical test):
rejection sampling for drafts drawn from a draft distribution, the sampler's own draws for point masses."""

from __future__ import annotations

import math

import pytest
import torch

from flare.engine.sampler import DeviceSampler, slot_params
from flare.engine.sampling_params import SamplingParams
from flare.engine.speculation.acceptance import accept_drafts, accept_matching, uniforms
from flare.kernels.sampling_reference import FIELD_SEED_LO, PURPOSE_ACCEPT, counter_uniform

VOCAB, DEPTH, TRIALS = 6, 3, 60_000


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> float:
    expected = probs.double() * counts.sum()
    kept = expected > 0
    assert counts[~kept].sum() == 0, "a token the target never draws came out"
    return float(((counts.double()[kept] - expected[kept]) ** 2 / expected[kept]).sum())


def critical_value(degrees: int, z: float = 4.75) -> float:
    """The chi-square quantile at about 1 - 1e-6 (Wilson-Hilferty), so a correct sampler fails once in a million."""
    a = 2.0 / (9.0 * degrees)
    return degrees * (1.0 - a + z * math.sqrt(a)) ** 3


def distributions(generator: torch.Generator, rows: int) -> torch.Tensor:
    """[rows, VOCAB] distributions, one token of each impossible, so zero probabilities are exercised too."""
    logits = torch.randn(rows, VOCAB, generator=generator) * 1.5
    logits[:, 0] = -math.inf
    return logits.softmax(dim=1)


def trials(p: torch.Tensor, q: torch.Tensor | None, drafts: torch.Tensor):
    """TRIALS independent rows (seeds 0..TRIALS-1) verifying `drafts` against the same target."""
    seeds = torch.arange(TRIALS, dtype=torch.int64)
    target = p.expand(TRIALS, *p.shape)
    return accept_drafts(target, drafts, torch.full((TRIALS,), DEPTH), seeds, torch.zeros_like(seeds),
                         torch.full((TRIALS,), 17), None if q is None else q.expand(TRIALS, *q.shape))


def check_output_distribution(verdict, p: torch.Tensor) -> None:
    """Position 0 is distributed as p[0]; position j, among rows that reached it, as p[j]."""
    for position in range(DEPTH + 1):
        reached = verdict.counts > position
        assert reached.sum() > 1000, f"too few rows reached position {position} to test it"
        counts = torch.bincount(verdict.tokens[reached, position], minlength=VOCAB)
        assert chi_square(counts, p[position]) < critical_value(VOCAB - 2), f"position {position} is biased"


def test_uniforms_are_the_samplers_counter_uniforms():
    seed_lo, seed_hi = torch.tensor([[5], [-7]]), torch.tensor([[0], [123]])
    positions, indices = torch.tensor([[3], [2 ** 33 + 1]]), torch.arange(4)
    assert torch.equal(uniforms(seed_lo, seed_hi, positions, indices, PURPOSE_ACCEPT),
                       counter_uniform(seed_lo, seed_hi, positions, indices, PURPOSE_ACCEPT))


def test_drafts_from_a_draft_distribution_leave_the_target_distribution_exact():
    generator = torch.Generator().manual_seed(0)
    p, q = distributions(generator, DEPTH + 1), distributions(generator, DEPTH)
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=generator).T.contiguous()     # [TRIALS, DEPTH]
    verdict = trials(p, q, drafts)
    check_output_distribution(verdict, p)
    # Some drafts were accepted and some rejected: both branches were exercised.
    assert 0 < (verdict.counts == 1).float().mean() < 1 and (verdict.counts == DEPTH + 1).any()


def sampler_with_seeds(count: int, params) -> DeviceSampler:
    """A reference DeviceSampler whose slots 0..count-1 sample with `params` and seeds 0..count-1."""
    sampler = DeviceSampler(count, VOCAB, "cpu", use_triton=False)
    row = slot_params(params, VOCAB, seed=0).encode()
    sampler.tables.params[:count] = row
    sampler.tables.params[:count, FIELD_SEED_LO] = torch.arange(count, dtype=torch.int32)
    return sampler


def test_point_mass_drafts_leave_the_target_distribution_exact_and_equal_plain_sampling():
    """History drafts: the sampler's own draw at each position decides, so the tokens are distributed as the
    target's and are the very tokens plain sampling gives at those positions."""
    generator = torch.Generator().manual_seed(1)
    p = distributions(generator, DEPTH + 1)
    # Drafts drawn near p, so later positions are reached too; any draft independent of the draws works.
    drafts = torch.multinomial(p[:DEPTH], TRIALS, replacement=True, generator=generator).T.contiguous()
    sampler = sampler_with_seeds(TRIALS, SamplingParams(temperature=1.0))
    slots = torch.arange(TRIALS).repeat_interleave(DEPTH + 1)
    positions = (17 + torch.arange(DEPTH + 1)).repeat(TRIALS)
    logits = torch.log(p).repeat(TRIALS, 1)
    sampled = sampler.sample(logits, slots, positions).view(TRIALS, DEPTH + 1)
    verdict = accept_matching(sampled, drafts, torch.full((TRIALS,), DEPTH))
    check_output_distribution(verdict, p)
    plain = sampler.sample(logits[:DEPTH + 1], slots[:DEPTH + 1], positions[:DEPTH + 1])
    assert torch.equal(verdict.tokens[0], plain)
    accepted = verdict.counts - 1
    assert (accepted == 0).any() and (accepted == DEPTH).any()


def test_the_distribution_check_catches_a_verifier_that_keeps_its_drafts():
    """The check has power: accepting a draft model's tokens without the rejection test is caught."""
    generator = torch.Generator().manual_seed(0)
    p, q = distributions(generator, DEPTH + 1), distributions(generator, DEPTH)
    drafts = torch.multinomial(q, TRIALS, replacement=True, generator=generator).T.contiguous()
    counts = torch.bincount(drafts[:, 0], minlength=VOCAB)
    assert chi_square(counts, p[0]) > critical_value(VOCAB - 2)


def test_greedy_rows_accept_exactly_the_argmax_chain():
    chain = [4, 2, 5, 1]
    p = torch.nn.functional.one_hot(torch.tensor(chain), VOCAB).float()[None].repeat(3, 1, 1)
    drafts = torch.tensor([[4, 2, 5], [4, 3, 5], [1, 2, 5]])
    seeds = torch.tensor([1, 2, 3])
    verdict = accept_drafts(p, drafts, torch.tensor([3, 3, 2]), seeds, seeds, torch.tensor([9, 9, 9]))
    assert verdict.counts.tolist() == [4, 2, 1]
    assert verdict.tokens[0].tolist() == chain
    assert verdict.tokens[1, :2].tolist() == [4, 2] and verdict.tokens[2, :1].tolist() == [4]
    assert verdict.last_tokens.tolist() == [1, 2, 4]


@pytest.mark.parametrize("depth", [0, 1])
def test_rows_without_drafts_draw_one_token_from_the_target(depth):
    p = torch.tensor([[[0.0, 1.0, 0.0]] * (depth + 1)] * 2)
    verdict = accept_drafts(p, torch.zeros(2, depth, dtype=torch.int64), torch.zeros(2, dtype=torch.int64),
                            torch.tensor([1, 2]), torch.tensor([0, 0]), torch.tensor([4, 4]))
    assert verdict.counts.tolist() == [1, 1] and verdict.last_tokens.tolist() == [1, 1]
