"""Grammar-constrained decoding in the engine: the core masks each constrained row, and the sampled
tokens follow the grammar whatever the model prefers (stories260k writes stories, not JSON)."""

from __future__ import annotations

import gc
import json
import re

import pytest
import torch

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore, InvalidRequest
from flare.engine.factory import load_checkpoint_model
from flare.engine.runner import ModelRunner
from flare.engine.structured_output import StructuredOutputs
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.request import EngineRequest
from flare.engine.sampling_params import GrammarSpec, SamplingParams
from flare.frontend.tokenizer import load_tokenizer

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
    assert engine.core.step() == []       # reads the step launched ahead for rows that had finished
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


def _engine(directory, graphs: bool, device: str = "cpu", dtype: str = "float32") -> LLMEngine:
    """A checkpoint with its vocabulary for grammars; `graphs`: decode steps through the decode graphs'
    static buffers (captured on a GPU, run eagerly on a CPU)."""
    config = EngineConfig(max_concurrency=4, page_size=16, num_pages=64, max_model_len=256, prefill_chunk=64,
                          max_num_batched_tokens=128)
    tokenizer = load_tokenizer(directory)
    loaded = load_checkpoint_model(directory, config, device, dtype, tokenizer.eos_token_ids)
    runner = ModelRunner(loaded.model, loaded.model_config, config, device, getattr(torch, dtype), seed=0,
                         graphs=graphs)
    masker = StructuredOutputs(lambda: tokenizer.hf, runner.vocab_size, loaded.eos_token_ids)
    return LLMEngine(EngineCore(config, runner, loaded.eos_token_ids, token_masker=masker), tokenizer)


def test_masks_ride_in_the_decode_graph_and_leave_free_rows_alone(stories260k):
    graphed, eager = _engine(stories260k, graphs=True), _engine(stories260k, graphs=False)
    graphs, masked_steps = graphed.core.runner.graphs, []
    run = graphs.run
    graphs.run = lambda rows, bitmask=None: (masked_steps.append(bitmask is not None), run(rows, bitmask))[1]
    params = [SamplingParams(max_tokens=80, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))),
              SamplingParams(max_tokens=30, temperature=0.9, seed=5, logprobs=1),
              SamplingParams(max_tokens=20, temperature=1.0, seed=3, grammar=GrammarSpec("regex", "(yes|no)!"))]
    prompts = ["Once upon a time", "Once upon a time", "Lily"]
    outputs = graphed.generate(prompts, params)
    assert sum(masked_steps) >= 10 and not all(masked_steps)    # masked decode steps, then free ones
    value = json.loads(outputs[0].new_text)
    assert set(value) == {"name", "age"} and re.fullmatch("(yes|no)!", outputs[2].new_text)
    expected = eager.generate(prompts, params)                    # the eager runner's sampler, same masks
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in expected]
    assert [lp.logprob for lp in outputs[1].new_logprobs] == pytest.approx(
        [lp.logprob for lp in expected[1].new_logprobs], abs=1e-4)
    assert bool((graphs.bitmask == -1).all())                    # the free row's last steps: no mask left


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_masked_rows_in_captured_graphs_give_the_eager_runner_s_tokens(tmp_path, dtype):
    """On the GPU the masks are copied into the captured graph's mask buffer and read by the sampling
    kernel; the eager runner hands the same masks to the same kernel."""
    from tiny_checkpoints import write_tiny_checkpoint

    directory = write_tiny_checkpoint("llama", tmp_path / "llama")
    graphed = _engine(directory, graphs=True, device="cuda", dtype=dtype)
    eager = _engine(directory, graphs=False, device="cuda", dtype=dtype)
    assert graphed.core.runner.graphs.graphs, "no graph was captured"
    params = [SamplingParams(max_tokens=60, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))),
              SamplingParams(max_tokens=30, temperature=0.8, top_p=0.9, seed=5),
              SamplingParams(max_tokens=20, temperature=1.0, seed=3, grammar=GrammarSpec("regex", "(yes|no)!"))]
    prompts = ["Once upon a time", "Once upon a time", "Lily"]
    outputs = graphed.generate(prompts, params)
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in eager.generate(prompts, params)]
    assert re.fullmatch("(yes|no)!", outputs[2].new_text)
    if outputs[0].finish_reason == "stop":
        assert set(json.loads(outputs[0].new_text)) == {"name", "age"}
