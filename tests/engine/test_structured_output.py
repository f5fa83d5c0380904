"""Grammar-constrained decoding in the engine: the core masks each constrained row, and the sampled
tokens follow the grammar whatever the model prefers (stories260k writes stories, not JSON)."""

from __future__ import annotations

import gc
import json
import re
import threading

import pytest
import torch

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.engine.request import InvalidRequest
from flare.engine.factory import build_core, load_checkpoint_model
from flare.engine.runner import ModelRunner
from flare.engine.structured_output import StructuredOutputs, compile_spec
from flare.engine_client.llm_engine import LLMEngine, merge_outputs
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
    assert len(engine.core.grammar.masker) == 0                  # finished requests drop their matchers


def test_a_core_without_vocabulary_refuses_grammars(engine):
    masker, engine.core.grammar.masker = engine.core.grammar.masker, None
    try:
        with pytest.raises(InvalidRequest, match="no vocabulary for constrained decoding"):
            engine.core.add_request(EngineRequest("g", (1, 2, 3), SamplingParams(grammar=GrammarSpec("json_object"))))
    finally:
        engine.core.grammar.masker = masker


def test_a_grammar_the_compiler_refuses_is_an_invalid_request(engine):
    with pytest.raises(InvalidRequest, match="cannot be compiled"):
        engine.core.add_request(EngineRequest("bad", (1, 2, 3), SamplingParams(grammar=GrammarSpec("regex", "("))))
    assert "bad" not in engine.core.requests


def _engine(directory, graphs: bool, device: str = "cpu", dtype: str = "float32",
            one_step_ahead: bool = True) -> LLMEngine:
    """A checkpoint with its vocabulary for grammars; `graphs`: decode steps through the decode graphs'
    static buffers (captured on a GPU, run eagerly on a CPU)."""
    config = EngineConfig(max_concurrency=4, page_size=16, num_pages=64, max_model_len=256, prefill_chunk=64,
                          max_num_batched_tokens=128, one_step_ahead=one_step_ahead)
    tokenizer = load_tokenizer(directory)
    loaded = load_checkpoint_model(directory, config, device, dtype, tokenizer.eos_token_ids)
    runner = ModelRunner(loaded.model, loaded.model_config, config, device, getattr(torch, dtype), seed=0,
                         graphs=graphs)
    masker = StructuredOutputs(lambda: tokenizer.hf, runner.vocab_size, loaded.eos_token_ids)
    return LLMEngine(EngineCore(config, runner, loaded.eos_token_ids, token_masker=masker), tokenizer)


def test_masks_ride_in_the_decode_graph_and_leave_free_rows_alone(stories260k):
    graphed, eager = _engine(stories260k, graphs=True), _engine(stories260k, graphs=False)
    graphs, masked_steps = graphed.core.runner.graphs, []
    sample = graphs.sample
    graphs.sample = lambda launch, bitmask=None: (masked_steps.append(bitmask is not None), sample(launch, bitmask))[1]
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


# ---- the decode step split at the sampler: the forward runs while the masks fill -------------------------

class MasksFirst:
    """A runner without `launch_before_masks`: the core puts the masks in the plan and launches the step
    whole, as it does for runners that cannot split a step (the unsplit path, for comparison)."""

    def __init__(self, runner) -> None:
        self.runner, self.vocab_size = runner, runner.vocab_size

    def reset(self) -> None:
        self.runner.reset()

    def samples_ahead(self, params) -> bool:
        return self.runner.samples_ahead(params)

    def launch(self, plan):
        return self.runner.launch(plan)


def _count_masked_samples(engine: LLMEngine) -> list[bool]:
    """Record, for each sampling half the engine's decode graphs run, whether it had masks."""
    graphs, masked = engine.core.runner.graphs, []
    sample = graphs.sample
    graphs.sample = lambda launch, bitmask=None: (masked.append(bitmask is not None), sample(launch, bitmask))[1]
    return masked


SPLIT_PARAMS = [SamplingParams(max_tokens=60, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))),
                SamplingParams(max_tokens=40, temperature=0.8, top_p=0.9, seed=7, logprobs=1,
                               grammar=GrammarSpec("json_schema", json.dumps(SCHEMA))),
                SamplingParams(max_tokens=30, temperature=0.9, seed=5, logprobs=1),
                SamplingParams(max_tokens=20, temperature=1.0, seed=3, grammar=GrammarSpec("regex", "(yes|no)!"))]
SPLIT_PROMPTS = ["Once upon a time", "Tom had a", "Once upon a time", "Lily"]


def _split_matches_unsplit(directory, device: str, dtype: str, one_step_ahead: bool) -> None:
    split = _engine(directory, graphs=True, device=device, dtype=dtype, one_step_ahead=one_step_ahead)
    unsplit = _engine(directory, graphs=True, device=device, dtype=dtype, one_step_ahead=one_step_ahead)
    split_masked, unsplit_masked = _count_masked_samples(split), _count_masked_samples(unsplit)
    unsplit.core.runner = MasksFirst(unsplit.core.runner)
    outputs, expected = split.generate(SPLIT_PROMPTS, SPLIT_PARAMS), unsplit.generate(SPLIT_PROMPTS, SPLIT_PARAMS)
    assert sum(split_masked) >= 10 and sum(unsplit_masked) >= 10        # both sampled masked rows in the graphs
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in expected]
    for mine, theirs in zip(outputs, expected):
        assert [lp.logprob for lp in mine.new_logprobs] == pytest.approx(
            [lp.logprob for lp in theirs.new_logprobs], abs=1e-4)
    assert re.fullmatch("(yes|no)!", outputs[3].new_text)
    if outputs[0].finish_reason == "stop":
        assert set(json.loads(outputs[0].new_text)) == {"name", "age"}
    split.check_integrity()


def test_decode_steps_launch_the_forward_before_the_masks_are_filled(stories260k):
    """The constrained decode step's forward half is issued first, then the core reads the step in flight
    and fills the masks, then the sampling half takes them: masks filled before the forward was launched
    would leave the device idle while they fill."""
    engine, events = _engine(stories260k, graphs=True), []
    graphs, masker = engine.core.runner.graphs, engine.core.grammar.masker
    launch_forward, sample, next_token_masks = graphs.launch_forward, graphs.sample, masker.next_token_masks
    graphs.launch_forward = lambda rows: (events.append("forward"), launch_forward(rows))[1]
    graphs.sample = lambda launch, bitmask=None: (events.append("masked sample" if bitmask is not None
                                                                else "sample"), sample(launch, bitmask))[1]
    masker.next_token_masks = lambda requests, unread: (events.append("masks"), next_token_masks(requests, unread))[1]
    outputs = engine.generate(SPLIT_PROMPTS[:2], SPLIT_PARAMS[:1] + SPLIT_PARAMS[2:3])
    assert set(json.loads(outputs[0].new_text)) == {"name", "age"}
    masked = [i for i, event in enumerate(events) if event == "masked sample"]
    assert len(masked) >= 10
    assert all(events[i - 2:i] == ["forward", "masks"] for i in masked), events
    assert "sample" in events                       # the free row's last steps: both halves back to back


def test_the_next_forward_is_launched_before_a_constrained_step_returns(stories260k):
    """After a constrained decode step's sampling, the core launches the forward of the step after it
    before `step()` returns its outputs: the host's work between steps (outputs, stats, commands) overlaps
    a forward instead of leaving the device idle behind the short sampling graph. That step is scheduled
    before the sampling is launched, so only its launch comes between the two on the device."""
    engine, events = _engine(stories260k, graphs=True), []
    graphs, core = engine.core.runner.graphs, engine.core
    launch_forward, sample, step, schedule = graphs.launch_forward, graphs.sample, core.step, core.scheduler.schedule
    core.scheduler.schedule = lambda: (events.append("plan"), schedule())[1]
    graphs.launch_forward = lambda rows: (events.append("forward"), launch_forward(rows))[1]
    graphs.sample = lambda launch, bitmask=None: (events.append("masked sample" if bitmask is not None
                                                                else "sample"), sample(launch, bitmask))[1]
    core.step = lambda: (result := step(), events.append("return"))[0]
    outputs = engine.generate(SPLIT_PROMPTS[:1], SPLIT_PARAMS[:1])
    assert set(json.loads(outputs[0].new_text)) == {"name", "age"}
    masked = [i for i, event in enumerate(events) if event == "masked sample"]
    assert len(masked) >= 10
    followed = [events[i - 1:i + 3] == ["plan", "masked sample", "forward", "return"] for i in masked]
    assert sum(followed) >= len(masked) - 1, events     # all but the last: its request retired with it


def test_an_abort_while_a_step_is_planned_ahead_loses_no_pages(stories260k):
    """A request aborted between steps while the core holds the next step planned ahead (its forward
    launched, its sampling waiting for masks): the others finish as they would alone, and every page is
    given back."""
    engine = _engine(stories260k, graphs=True)
    alone = _engine(stories260k, graphs=True).generate(["Tom had a"], SPLIT_PARAMS[:1])[0]
    engine.add_request("doomed", "Once upon a time", SPLIT_PARAMS[0])
    engine.add_request("kept", "Tom had a", SPLIT_PARAMS[0])
    outputs: dict = {}
    _step_until(engine, lambda: len(outputs.get("doomed", ())) >= 5, outputs)
    assert engine.core._planned is not None                 # the next step waits for its masks
    engine.abort("doomed")
    _step_until(engine, lambda: _finished(outputs, "kept"), outputs)
    assert merge_outputs(outputs["kept"]).new_token_ids == alone.new_token_ids
    assert engine.core.step() == []
    engine.check_integrity()
    assert engine.core.allocator.num_free_pages == engine.core.config.num_pages


@pytest.mark.parametrize("one_step_ahead", [True, False], ids=["one step ahead", "one step at a time"])
def test_split_decode_steps_give_the_unsplit_tokens(stories260k, one_step_ahead):
    """Greedy and seeded constrained rows beside a free one: the same tokens and logprobs whether the masks
    reach the graphs before the forward (unsplit) or after it (split), and the replies match their grammars."""
    _split_matches_unsplit(stories260k, "cpu", "float32", one_step_ahead)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_split_captured_graphs_give_the_unsplit_tokens_on_the_gpu(tmp_path, dtype):
    from tiny_checkpoints import write_tiny_checkpoint

    _split_matches_unsplit(write_tiny_checkpoint("llama", tmp_path / "llama"), "cuda", dtype, one_step_ahead=True)


# ---- grammars compile off the core's loop ----------------------------------------------------------------

class HeldCompile:
    """A compiler seam that holds every compile until released: a schema that takes its time."""

    def __init__(self) -> None:
        self.started, self.release = threading.Event(), threading.Event()

    def __call__(self, compiler, spec):
        self.started.set()
        assert self.release.wait(60), "the test never released the compile"
        return compile_spec(compiler, spec)


def _held_engine(directory, compile_grammar, load=None) -> LLMEngine:
    """stories260k with grammars compiled through `compile_grammar`, its vocabulary read by `load`."""
    config = EngineConfig(max_concurrency=4, page_size=16, num_pages=64, max_model_len=256, prefill_chunk=64,
                          max_num_batched_tokens=128)
    tokenizer = load_tokenizer(directory)
    loaded = load_checkpoint_model(directory, config, "cpu", "float32", tokenizer.eos_token_ids)
    runner = ModelRunner(loaded.model, loaded.model_config, config, "cpu", torch.float32, seed=0, graphs=False)
    masker = StructuredOutputs(load or (lambda: tokenizer.hf), runner.vocab_size, loaded.eos_token_ids,
                               compile_grammar=compile_grammar)
    return LLMEngine(EngineCore(config, runner, loaded.eos_token_ids, token_masker=masker), tokenizer)


def _step_until(engine: LLMEngine, done, outputs: dict, limit: int = 400) -> None:
    for _ in range(limit):
        if done():
            return
        for output in engine.step():
            outputs.setdefault(output.request_id, []).append(output)
    raise AssertionError(f"not done after {limit} steps: {outputs.keys()}")


def _finished(outputs: dict, request_id: str) -> bool:
    return bool(outputs.get(request_id)) and outputs[request_id][-1].finished


FREE = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)
JSON = SamplingParams(max_tokens=80, temperature=0, grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)))


def test_a_slow_compile_does_not_hold_up_free_requests(stories260k):
    held = HeldCompile()
    engine = _held_engine(stories260k, held)
    alone = engine.generate(["Once upon a time"], FREE)[0]
    engine.add_request("constrained", "Once upon a time", JSON, wait_for_grammar=False)
    engine.add_request("free", "Once upon a time", FREE)
    assert held.started.wait(30)
    outputs: dict = {}
    try:
        _step_until(engine, lambda: _finished(outputs, "free"), outputs)
        assert "constrained" not in outputs and not held.release.is_set()   # the compile still holds
        assert engine.core.stats().num_waiting == 1 and engine.has_unfinished()
    finally:
        held.release.set()
    free = merge_outputs(outputs["free"])
    assert free.new_token_ids == alone.new_token_ids and free.finish_reason == "length"
    _step_until(engine, lambda: _finished(outputs, "constrained"), outputs)
    value = json.loads(merge_outputs(outputs["constrained"]).new_text)
    assert set(value) == {"name", "age"}
    engine.check_integrity()


def test_a_grammar_that_fails_off_the_loop_is_refused_and_the_rest_go_on(stories260k):
    engine = _held_engine(stories260k, compile_spec)
    bad = SamplingParams(max_tokens=10, grammar=GrammarSpec("regex", "("))
    engine.add_request("bad", "Lily", bad, wait_for_grammar=False)
    engine.add_request("free", "Lily", FREE)
    outputs: dict = {}
    _step_until(engine, lambda: not engine.has_unfinished(), outputs)      # waiting grammars count as unfinished
    refused = engine.take_refused()
    assert [r.request_id for r in refused] == ["bad"] and "regex grammar cannot be compiled" in refused[0].reason
    assert _finished(outputs, "free") and "bad" not in outputs and "bad" not in engine.core.requests
    engine.add_request("bad", "Lily", SamplingParams(max_tokens=5))     # its id is free again
    engine.check_integrity()


def test_a_request_cancelled_while_its_grammar_compiles_is_dropped(stories260k):
    held = HeldCompile()
    engine = _held_engine(stories260k, held)
    engine.add_request("constrained", "Once upon a time", JSON, wait_for_grammar=False)
    assert held.started.wait(30)
    engine.abort("constrained")
    assert not engine.has_unfinished() and engine.core.stats().num_waiting == 0
    held.release.set()
    engine.add_request("free", "Lily", FREE)
    outputs: dict = {}
    _step_until(engine, lambda: _finished(outputs, "free"), outputs)
    assert set(outputs) == {"free"} and engine.take_refused() == []
    gc.collect()
    assert len(engine.core.grammar.masker) == 0            # no matcher was made for the cancelled request
    engine.check_integrity()


def test_the_vocabulary_is_read_at_engine_start_without_holding_it(stories260k):
    """build_core starts reading the vocabulary and returns (the served core reports Ready) while it is
    still being read; free requests decode meanwhile and a constrained one waits for it, unscheduled."""
    tokenizer = load_tokenizer(stories260k)
    reading, release = threading.Event(), threading.Event()

    def slow_tokenizer():
        reading.set()
        assert release.wait(60), "the test never released the vocabulary"
        return tokenizer.hf

    config = EngineConfig(max_concurrency=4, page_size=16, num_pages=64, max_model_len=256, prefill_chunk=64,
                          max_num_batched_tokens=128)
    loaded = load_checkpoint_model(stories260k, config, "cpu", "float32", tokenizer.eos_token_ids)
    engine = LLMEngine(build_core(loaded, seed=0, load_tokenizer=slow_tokenizer), tokenizer)
    assert reading.wait(30)                  # started by build_core, before any request asked for it
    engine.add_request("constrained", "Lily", JSON, wait_for_grammar=False)
    engine.add_request("free", "Lily", FREE)
    outputs: dict = {}
    try:
        _step_until(engine, lambda: _finished(outputs, "free"), outputs)
        assert "constrained" not in outputs
    finally:
        release.set()
    _step_until(engine, lambda: _finished(outputs, "constrained"), outputs)
    assert set(json.loads(merge_outputs(outputs["constrained"]).new_text)) == {"name", "age"}
