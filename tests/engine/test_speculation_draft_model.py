"""Speculation with a draft model (a checkpoint's draft/ folder) on stories260k: greedy output is the output
without drafts, across batching, chunked prefill, preemption and one step ahead on and off, alone and
beside history drafts; pages stay whole; zero draft tokens run no draft; a foreign vocabulary is refused."""

from __future__ import annotations

import json

import pytest
from draft_checkpoints import STORIES_DRAFT, with_draft, with_truncated_draft

from flare.engine.config import EngineConfig
from flare.engine.sampling_params import SamplingParams
from flare.engine.speculation.settings import SpeculationSettings
from flare.engine_client.llm_engine import LLMEngine
from flare.errors import UsageError

PROMPTS = ["Once upon a time", "Tom had a red ball. Tom had a red ball. Tom had a", "The sun was hot.",
           "Lily and Ben went to the park. Lily and Ben"]
DRAFT = SpeculationSettings(draft_tokens=3, draft_model=True)


@pytest.fixture(scope="module")
def drafted_checkpoint(stories260k, tmp_path_factory):
    """stories260k with its distilled draft in draft/ (right about two times in three: acceptances and
    rejections both)."""
    return with_draft(stories260k, STORIES_DRAFT, tmp_path_factory.mktemp("drafted") / "stories260k")


@pytest.fixture(scope="module")
def plain(stories260k):
    llm = LLMEngine.from_checkpoint(stories260k, EngineConfig(page_size=16, num_pages=64, max_model_len=512))
    params = SamplingParams(temperature=0, max_tokens=60)
    return [list(llm.generate([prompt], params)[0].new_token_ids) for prompt in PROMPTS]


def generate(directory, checked, speculation, params=SamplingParams(temperature=0, max_tokens=60), **settings):
    config = EngineConfig(**{"page_size": 16, "num_pages": 64, "max_model_len": 512, "speculation": speculation,
                             **settings})
    llm = checked(LLMEngine.from_checkpoint(directory, config, seed=0))
    return [list(o.new_token_ids) for o in llm.generate(PROMPTS, params)], llm


@pytest.mark.parametrize("one_step_ahead", [True, False])
def test_greedy_output_with_a_draft_model_is_the_output_without(drafted_checkpoint, checked, plain, one_step_ahead):
    tokens, llm = generate(drafted_checkpoint, checked, DRAFT, one_step_ahead=one_step_ahead)
    assert tokens == plain
    stats = llm.core.stats()
    assert stats.speculative_rounds > 0 and stats.draft_tokens_accepted > 0
    assert stats.draft_tokens_accepted < stats.draft_tokens_proposed          # rejections happened too
    assert llm.core.runner.proposer is not None


def test_draft_model_and_history_drafts_together(drafted_checkpoint, checked, plain):
    both = SpeculationSettings(draft_tokens=4, draft_model=True, history=True)
    tokens, llm = generate(drafted_checkpoint, checked, both)
    assert tokens == plain and llm.core.stats().draft_tokens_accepted > 0


def test_greedy_output_with_a_draft_model_survives_chunked_prefill_and_preemption(drafted_checkpoint, checked, plain):
    tokens, llm = generate(drafted_checkpoint, checked, DRAFT, num_pages=12, max_model_len=160, prefill_chunk=8,
                           max_num_batched_tokens=24)
    assert llm.core.stats().num_preemptions > 0, "the test needs the pool to force a preemption"
    assert tokens == plain


def test_fixed_width_verifies_every_draft_and_rejected_drafts_leave_pages_whole(drafted_checkpoint, checked, plain):
    fixed = SpeculationSettings(draft_tokens=3, draft_model=True, adaptive=False)
    tokens, llm = generate(drafted_checkpoint, checked, fixed, page_size=4, num_pages=160)
    assert tokens == plain
    stats = llm.core.stats()
    by_position = stats.draft_tokens_proposed_by_position
    # Every round verifies three drafts but near a request's length limit, where fewer fit.
    assert by_position[0] == stats.speculative_rounds and by_position[2] >= 0.9 * stats.speculative_rounds
    assert stats.draft_tokens_proposed - stats.draft_tokens_accepted > 20


def test_zero_draft_tokens_run_no_draft(drafted_checkpoint, checked, plain):
    tokens, llm = generate(drafted_checkpoint, checked, SpeculationSettings(draft_tokens=0, draft_model=True))
    assert tokens == plain
    assert llm.core.runner.proposer is None and llm.core.stats().speculative_rounds == 0


def test_a_draft_of_another_vocabulary_is_refused(drafted_checkpoint, tmp_path, stories260k):
    foreign = with_truncated_draft(stories260k, 2, tmp_path / "foreign")
    config_path = foreign / "draft" / "config.json"
    config_path.write_text(json.dumps({**json.loads(config_path.read_text()), "vocab_size": 256}))
    with pytest.raises(UsageError, match="must share the target's tokenizer"):
        LLMEngine.from_checkpoint(foreign, EngineConfig(page_size=16, num_pages=64, max_model_len=512,
                                                        speculation=DRAFT))
