"""Adaptive verification: the width follows measured acceptance and measured step cost; fixed selection,
the row ceiling and alpha do what the flags say."""

from __future__ import annotations

from flare.engine.speculation.adaptive import EXPLORE_EVERY, VerificationWidth


def measured(widths: VerificationWidth, batch: int, cost_of_width, accepted_of_drafts, steps: int = 200) -> list[int]:
    """Run `steps` steps: each costs cost_of_width(width) seconds and each request accepts
    accepted_of_drafts(drafts) of its drafts. Returns the drafts chosen per step."""
    chosen = []
    for _ in range(steps):
        drafts = widths.drafts_for(batch)
        chosen.append(drafts)
        for _ in range(batch):
            widths.observe_round(drafts, accepted_of_drafts(drafts))
        widths.observe_step(batch, drafts, cost_of_width(drafts + 1))
    return chosen


def settled(chosen: list[int]) -> int:
    """The width chosen most often over the last steps (exploration steps aside)."""
    tail = chosen[-3 * EXPLORE_EVERY:]
    return max(set(tail), key=tail.count)


def test_drafts_that_are_always_accepted_get_the_widest_verification():
    widths = VerificationWidth(max_drafts=6)
    assert settled(measured(widths, 2, lambda width: 1.0 + 0.02 * width, lambda drafts: drafts)) == 6


def test_drafts_that_are_never_accepted_are_not_verified():
    widths = VerificationWidth(max_drafts=6)
    assert settled(measured(widths, 2, lambda width: 1.0 + 0.02 * width, lambda drafts: 0)) == 0


def test_a_costly_wide_step_narrows_the_width():
    """Each draft survives with probability 0.7: wide rounds pay when rows are cheap, not when each row
    costs as much as the step itself."""
    import random

    def survivors(seed):
        draws = random.Random(seed)

        def accepted(drafts: int) -> int:
            count = 0
            while count < drafts and draws.random() < 0.7:
                count += 1
            return count
        return accepted

    cheap = settled(measured(VerificationWidth(max_drafts=6), 4, lambda width: 1.0 + 0.01 * width, survivors(0)))
    costly = settled(measured(VerificationWidth(max_drafts=6), 4, lambda width: 1.0 + 0.8 * (width - 1),
                              survivors(1)))
    assert cheap >= 4 and costly <= 1


def test_fixed_selection_verifies_every_draft_allowed():
    widths = VerificationWidth(max_drafts=5, adaptive=False)
    assert set(measured(widths, 3, lambda width: 1.0, lambda drafts: 0)) == {5}


def test_the_row_ceiling_caps_batch_capacity_times_width():
    widths = VerificationWidth(max_drafts=7, adaptive=False, max_rows=16, buckets=(1, 2, 4, 8, 16))
    assert widths.drafts_for(4) == 3 and widths.drafts_for(2) == 7 and widths.drafts_for(16) == 0
    assert widths.drafts_for(3) == 3                    # three requests run in the batch-four capacity


def test_an_exact_budget_keeps_one_width_per_batch_capacity():
    widths = VerificationWidth(max_drafts=7, max_rows=128, exact_rows=12, buckets=(1, 2, 4, 8, 16))
    assert widths._widths(1) == [1, 8] and widths._widths(4) == [1, 3] and widths._widths(8) == [1]


def test_alpha_below_one_favours_longer_prefixes():
    def scores(alpha):
        widths = VerificationWidth(max_drafts=4, alpha=alpha)
        for _ in range(50):
            widths.observe_round(4, 1)          # the first draft always survives, the second never
        return [widths._tokens(width) for width in range(1, 6)]
    assert scores(0.5) == scores(1.0) == scores(2.0)        # survival 1 then 0: alpha changes nothing
    widths = VerificationWidth(max_drafts=2, alpha=0.5)
    low = VerificationWidth(max_drafts=2, alpha=2.0)
    for w in (widths, low):
        for accepted in (0, 1) * 20:
            w.observe_round(2, accepted)
    assert widths._tokens(2) > low._tokens(2)


def served(widths: VerificationWidth, batch: int, round_cost, ahead_cost: float, accepted_of_drafts,
           steps: int = 600) -> list[tuple[int, bool]]:
    """Drive the width as the engine core does: a step that ran ahead leaves no request free to draft
    for, so the next step is plain too (it asks `runs_ahead` again); otherwise the step is offered drafts.
    Returns (drafts, ran ahead) per step."""
    chosen, ahead = [], False
    for _ in range(steps):
        drafts = 0 if ahead else widths.drafts_for(batch)
        ahead = drafts == 0 and widths.runs_ahead(batch)
        if ahead:
            widths.observe_ahead(batch, ahead_cost)
        else:
            widths.observe_step(batch, drafts, round_cost(drafts + 1))
        if drafts:
            widths.observe_coverage(batch, batch)
            for _ in range(batch):
                widths.observe_round(drafts, accepted_of_drafts(drafts))
        chosen.append((drafts, ahead))
    return chosen


def test_plain_decoding_run_ahead_beats_rounds_that_cost_more_than_they_bring():
    """Rounds read before the next plan cost 2.5x a plain step run ahead and bring 1.5 tokens: the width
    settles on plain steps run ahead, trying drafts again at doubling intervals."""
    widths = VerificationWidth(max_drafts=4)
    chosen = served(widths, 8, lambda width: 2.5, 1.0, lambda drafts: min(drafts, 1) if drafts else 0)
    tail = chosen[len(chosen) // 2:]
    assert sum(ahead for _, ahead in tail) > 0.95 * len(tail)
    assert any(drafts for drafts, _ in tail), "drafts are still tried now and then"
    assert widths.interval > 16


def test_rounds_that_pay_stop_plain_decoding_from_running_ahead():
    """Every draft accepted and a round costing 1.2x a plain step: the rounds win and keep winning."""
    widths = VerificationWidth(max_drafts=4)
    chosen = served(widths, 8, lambda width: 1.2, 1.0, lambda drafts: drafts)
    tail = chosen[len(chosen) // 2:]
    assert sum(drafts == 4 for drafts, _ in tail) > 0.9 * len(tail)


def test_requests_without_drafts_count_against_the_round():
    """History drafts found for one request in eight: a round's expected tokens are mostly the one
    token every request gets."""
    widths = VerificationWidth(max_drafts=4)
    for _ in range(100):
        widths.observe_round(4, 4)
        widths.observe_coverage(8, 1)
    assert abs(widths._tokens(5) - (1 + 4 / 8)) < 0.05


def test_fixed_selection_never_runs_plain_steps_ahead():
    widths = VerificationWidth(max_drafts=4, adaptive=False)
    assert not any(widths.runs_ahead(8) for _ in range(50))
    capped = VerificationWidth(max_drafts=4, adaptive=False, max_rows=8, buckets=(1, 8))
    assert capped.runs_ahead(8), "no drafts fit this batch: nothing to wait for"
