"""Grammar-constrained decoding in the engine: the core masks each constrained row, and the sampled
tokens follow the grammar whatever the model prefers (stories260k writes stories, not JSON)."""

from __future__ import annotations

import gc
import json
import re

import pytest

from flare.engine.core import InvalidRequest
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.request import EngineRequest
from flare.engine.sampling_params import GrammarSpec, SamplingParams

SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 6},
                                           "age": {"type": "integer", "minimum": 1, "maximum": 99}},
          "required": ["name", "age"], "additionalProperties": False}


@pytest.fixture(scope="module")
def engine(stories260k):
    return LLMEngine.from_checkpoint(stories260k)


def test_constrained_and_free_rows_share_a_batch(engine):
    params = [SamplingParams(max_tokens=80, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))),
              SamplingParams(max_tokens=20, temperature=1.0, seed=3, grammar=GrammarSpec("regex", "(yes|no)!")),
              SamplingParams(max_tokens=12, temperature=0)]
    constrained, choice, free = engine.generate(["Once upon a time", "Lily", "Once upon a time"], params)
    value = json.loads(constrained.new_text)
    assert set(value) == {"name", "age"} and len(value["name"]) <= 6 and 1 <= value["age"] <= 99
    assert constrained.finish_reason == "stop" and choice.finish_reason == "stop"
    assert re.fullmatch("(yes|no)!", choice.new_text)
    assert not free.new_text.lstrip().startswith("{")        # the unconstrained row is left alone
    gc.collect()
    assert len(engine.core.token_masker) == 0                  # finished requests drop their matchers


def test_a_core_without_vocabulary_refuses_grammars(engine):
    masker, engine.core.token_masker = engine.core.token_masker, None
    try:
        with pytest.raises(InvalidRequest, match="no vocabulary for constrained decoding"):
            engine.core.add_request(EngineRequest("g", (1, 2, 3), SamplingParams(grammar=GrammarSpec("json_object"))))
    finally:
        engine.core.token_masker = masker


def test_a_grammar_the_compiler_refuses_is_an_invalid_request(engine):
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        engine.core.add_request(EngineRequest("bad", (1, 2, 3), SamplingParams(grammar=GrammarSpec("regex", "("))))
    assert "bad" not in engine.core.requests
