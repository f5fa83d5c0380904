"""Speculation's flags and keys as the spec states them (§3.1 preparation, §3.2 serving, §3.3 the file):
the plan a preparation records, the settings serving derives from it, and every refusal by name."""

from __future__ import annotations

import pytest

from flare.config import load_config
from flare.errors import UsageError
from flare.recipes.base import HISTORY_SPECULATION, Speculation
from flare.speculation_plan import (PreparationFlags, ServingFlags, catalog_programs, plan_speculation,
                                    serving_speculation, speculation_summary)

CAPACITIES = (1, 2, 4, 8, 16, 24, 32)


def plan(flags=PreparationFlags(), config=None, declared=HISTORY_SPECULATION, names=("qwen3-8b",)):
    return plan_speculation(declared, flags, config, names, CAPACITIES, "qwen3-8b")


def config_file(tmp_path, text):
    path = tmp_path / "config.toml"
    path.write_text(text)
    return load_config(path)


def test_the_recipe_declaration_is_the_default_plan():
    recorded = plan()
    assert recorded.draft_tokens == HISTORY_SPECULATION.default_draft_tokens and recorded.adaptive
    assert recorded.token_capacity == 128 and recorded.history
    # Rectangular: every capacity with every draft count whose rows fit 128.
    assert {(p.batch, p.drafts) for p in recorded.programs} == {
        (b, d) for b in CAPACITIES for d in range(1, 5) if b * (d + 1) <= 128}
    assert all(p.width == p.drafts + 1 and p.rows == p.batch * p.width for p in recorded.programs)


def test_the_token_capacity_comes_from_the_flag_then_the_model_section_then_defaults(tmp_path):
    config = config_file(tmp_path, '[defaults]\nspeculative_token_capacity = 64\n'
                                   '[models."qwen3-8b"]\nspeculative_token_capacity = 24\n')
    assert plan(config=config).token_capacity == 24
    assert plan(config=config, names=("other",)).token_capacity == 64
    assert plan(PreparationFlags(token_capacity=40), config).token_capacity == 40
    assert max(p.rows for p in plan(config=config).programs) <= 24


def test_no_mtp_prepares_no_speculation_and_excludes_the_other_flags():
    assert plan(PreparationFlags(no_mtp=True)) is None
    for flags in (PreparationFlags(no_mtp=True, draft_tokens=3), PreparationFlags(no_mtp=True, token_capacity=8),
                  PreparationFlags(no_mtp=True, fixed_verification=True)):
        with pytest.raises(UsageError, match="--no-mtp excludes"):
            plan(flags)


def test_draft_counts_outside_the_recipe_limit_are_refused():
    with pytest.raises(UsageError, match=r"--mtp-draft-tokens 9 is outside qwen3-8b's range 0 through 8"):
        plan(PreparationFlags(draft_tokens=9))
    zero = plan(PreparationFlags(draft_tokens=0))
    assert zero.draft_tokens == 0 and zero.programs == ()


def test_a_capacity_that_holds_no_round_is_refused():
    with pytest.raises(UsageError, match="holds no verification round"):
        plan(PreparationFlags(token_capacity=1))


def test_the_graph_budget_is_refused_where_it_would_apply_and_ignored_in_defaults(tmp_path):
    with pytest.raises(UsageError, match="--speculative-graph-budget 64: .* packed"):
        plan(PreparationFlags(graph_budget=64))
    with pytest.raises(UsageError, match='models.qwen3-8b.speculative_graph_budget = 16'):
        plan(config=config_file(tmp_path, '[models."qwen3-8b"]\nspeculative_graph_budget = 16\n'))
    assert plan(config=config_file(tmp_path, "[defaults]\nspeculative_graph_budget = 64\n")) == plan()


def test_a_recipe_without_speculation_refuses_its_flags():
    none = Speculation(available=False, default_draft_tokens=0, max_draft_tokens=0, note="no drafts here")
    assert plan(declared=none) is None
    with pytest.raises(UsageError, match="no drafts here"):
        plan(PreparationFlags(draft_tokens=2), declared=none)


def test_serving_reduces_what_was_prepared_and_never_extends_it():
    recorded = plan()
    settings = serving_speculation(recorded, ServingFlags(history=True, draft_tokens=2))
    assert settings.draft_tokens == 2 and settings.history and settings.adaptive and settings.enabled
    assert settings.max_verification_tokens == 128
    with pytest.raises(UsageError, match="outside the package's prepared 0 through 4"):
        serving_speculation(recorded, ServingFlags(draft_tokens=5))
    assert not serving_speculation(recorded, ServingFlags()).history        # packages record no history preference
    assert serving_speculation(recorded, ServingFlags(draft_tokens=0)).draft_tokens == 0


def test_serving_flags_that_need_speculation_fail_on_a_package_without_it():
    assert serving_speculation(None, ServingFlags(history=False, draft_tokens=0)).draft_tokens == 0
    for flags in (ServingFlags(history=True), ServingFlags(draft_tokens=2), ServingFlags(alpha=0.5)):
        with pytest.raises(UsageError, match="prepared without it"):
            serving_speculation(None, flags)
    with pytest.raises(UsageError, match="--mtp-draft-tokens 0 selects ordinary decoding"):
        serving_speculation(plan(), ServingFlags(history=True, draft_tokens=0))


def test_adaptive_only_flags_are_refused_with_fixed_width():
    fixed = plan(PreparationFlags(fixed_verification=True))
    assert not serving_speculation(fixed, ServingFlags()).adaptive
    for flags in (ServingFlags(alpha=0.5), ServingFlags(max_budget=16), ServingFlags(exact_budget=16),
                  ServingFlags(adaptive=False, alpha=2.0)):
        with pytest.raises(UsageError, match="applies to adaptive verification"):
            serving_speculation(fixed if flags.adaptive is None else plan(), flags)
    adaptive = serving_speculation(fixed, ServingFlags(adaptive=True, alpha=0.5, max_budget=16))
    assert adaptive.adaptive and adaptive.alpha == 0.5 and adaptive.max_verification_tokens == 16
    exact = serving_speculation(plan(), ServingFlags(exact_budget=16))
    assert exact.exact_verification_tokens == 16
    with pytest.raises(UsageError, match="exclude each other"):
        serving_speculation(plan(), ServingFlags(exact_budget=16, max_budget=16))


def test_the_summary_states_the_settings_in_effect():
    assert speculation_summary(None) == "speculation off"
    assert speculation_summary(4, adaptive=True) == "up to 4 draft tokens while verification adapts"
    assert speculation_summary(3, adaptive=False, history=True) == "exactly 3 draft tokens; history drafts on"
    assert catalog_programs((1, 2), 2, 4) == tuple(p for p in catalog_programs((1, 2), 2, 128) if p.rows <= 4)

