"""Step plans are plain data: each plan pickles (as it would to another tensor-parallel rank's process)
and a runner given the copies answers exactly as the runner given the originals did."""

from __future__ import annotations

import pickle

import pytest
from fake_runner import FakeRunner
from test_scheduler import add, prompt
from test_step_contract import EvenTokens, OracleDrafter, run_checked

from flare.engine.config import EngineConfig
from flare.engine.speculation.settings import SpeculationSettings
from flare.engine.core import EngineCore


class RecordingRunner(FakeRunner):
    def __init__(self, page_size: int) -> None:
        super().__init__(page_size)
        self.answers = []

    def launch(self, plan):
        pending = super().launch(plan)
        self.answers.append(pending.result())
        return pending


@pytest.mark.parametrize("hooks", ["drafts", "masks"])
def test_pickled_plans_give_another_runner_the_same_answers(hooks):
    # Few pages for many requests: preemptions, resumed requests, freed and reused slots.
    config = EngineConfig(max_concurrency=4, page_size=4, num_pages=14, max_model_len=40, prefill_chunk=8,
                          max_num_batched_tokens=24,
                          speculation=SpeculationSettings(draft_tokens=3 if hooks == "drafts" else 0))
    runner = RecordingRunner(config.page_size)
    extra = ({"drafter": OracleDrafter(length=3, wrong_every=2)} if hooks == "drafts" else
             {"token_masker": EvenTokens(FakeRunner.vocab_size)})
    core = EngineCore(config, runner, **extra)
    add(core, "constrained", prompt(7), max_tokens=12)
    for index in range(5):
        add(core, f"r{index}", prompt(5 + 3 * index, index), max_tokens=14)
    run_checked(core)
    assert core.stats().num_preemptions > 0
    copies = [pickle.loads(pickle.dumps(plan)) for plan in runner.steps]
    replay = FakeRunner(config.page_size)
    assert [replay.launch(plan).result() for plan in copies] == runner.answers
    crossed = [row for plan in copies for row in plan.rows]
    if hooks == "drafts":
        assert any(row.draft_token_ids for row in crossed)
    else:
        assert any(row.token_mask is not None for row in crossed)
