"""The engine core in its own process gives the same results as in-process, streams, aborts and stops."""

from __future__ import annotations

import asyncio

import time

import pytest

from flare.engine_client.async_engine import AsyncEngine
from flare.engine.config import EngineConfig
from flare.engine.request import InvalidRequest
from flare.engine.factory import ModelFactory, load_checkpoint_model
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import GrammarSpec, SamplingParams
from flare.frontend.tokenizer import load_tokenizer

CONFIG = EngineConfig(page_size=8, num_pages=64, max_model_len=256, prefill_chunk=8, max_num_batched_tokens=32)
PROMPTS = ["Once upon a time", "Tom had a big dog", "The sun was hot and", "Lily"]
PARAMS = [SamplingParams(temperature=0, max_tokens=30), SamplingParams(temperature=0.8, max_tokens=25, seed=5),
          SamplingParams(temperature=0, max_tokens=40, stop=(".",)), SamplingParams(temperature=1.0, max_tokens=20, seed=9)]


@pytest.fixture(scope="module")
def tokenizer(stories260k):
    return load_tokenizer(stories260k)


@pytest.fixture(scope="module")
def async_engine(stories260k, tokenizer):
    engine = AsyncEngine.from_checkpoint(stories260k, CONFIG, seed=0)
    yield engine
    engine.shutdown()


async def collect(engine: AsyncEngine, request_id: str, prompt_ids, params):
    return [output async for output in engine.generate(request_id, prompt_ids, params)]


def test_results_equal_the_in_process_engine(async_engine, tokenizer, stories260k):
    prompt_ids = [tokenizer.encode(p) for p in PROMPTS]

    async def run_all():
        return await asyncio.gather(*(collect(async_engine, f"r{i}", ids, params)
                                      for i, (ids, params) in enumerate(zip(prompt_ids, PARAMS))))

    streamed = asyncio.run(run_all())
    local = LLMEngine.from_checkpoint(stories260k, CONFIG, seed=0).generate(prompt_ids, PARAMS)
    for pieces, expected in zip(streamed, local):
        assert [t for p in pieces for t in p.new_token_ids] == list(expected.new_token_ids)
        assert "".join(p.new_text for p in pieces) == expected.new_text
        assert pieces[-1].finished and pieces[-1].finish_reason == expected.finish_reason
        assert sum(1 for p in pieces if p.finished) == 1
    assert streamed[2][-1].stop_reason == "."


def test_leaving_a_stream_early_aborts_the_request(async_engine, tokenizer):
    async def leave_early():
        seen = 0
        async for _ in async_engine.generate("early", tokenizer.encode("Once"), SamplingParams(max_tokens=200)):
            seen += 1
            if seen == 3:
                break
        await asyncio.sleep(0)

    asyncio.run(leave_early())
    assert wait_for(lambda: async_engine.stats().num_running == 0 and async_engine.stats().kv_pages_used == 0)
    assert async_engine.stats().kv_pages_total == CONFIG.num_pages


def test_abort_ends_the_stream(async_engine, tokenizer):
    async def abort_midway():
        outputs = []
        async for output in async_engine.generate("aborted", tokenizer.encode("Once"), SamplingParams(max_tokens=200)):
            outputs.append(output)
            if len(outputs) == 2:
                async_engine.abort("aborted")
        return outputs

    outputs = asyncio.run(abort_midway())
    assert outputs[-1].finished and outputs[-1].finish_reason == "abort"


def test_invalid_prompts_are_refused_before_reaching_the_core(async_engine):
    async def too_long():
        return await collect(async_engine, "long", [5] * 300, SamplingParams())

    with pytest.raises(InvalidRequest, match="shorten the prompt"):
        asyncio.run(too_long())


def test_grammars_compile_in_the_core_process_and_a_failed_one_is_refused(async_engine, tokenizer):
    """The core compiles grammars off its loop: a bad one is refused (InvalidRequest, a 400 in the server)
    after the core took it in, a good one constrains its reply, and a free request beside them is served."""
    ids = tokenizer.encode("Lily")
    bad = SamplingParams(max_tokens=10, grammar=GrammarSpec("regex", "("))
    choice = SamplingParams(max_tokens=10, temperature=0, grammar=GrammarSpec("regex", "(yes|no)!"))

    async def together():
        return await asyncio.gather(collect(async_engine, "bad", ids, bad), collect(async_engine, "choice", ids, choice),
                                    collect(async_engine, "free", ids, PARAMS[0]), return_exceptions=True)

    refused, constrained, free = asyncio.run(together())
    assert isinstance(refused, InvalidRequest) and "regex grammar cannot be compiled" in str(refused)
    assert "".join(p.new_text for p in constrained) in ("yes!", "no!") and constrained[-1].finish_reason == "stop"
    assert free[-1].finished and len([t for p in free for t in p.new_token_ids]) == 30


def wait_for(condition, timeout_s: float = 10.0) -> bool:
    import time

    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if condition():
            return True
        time.sleep(0.02)
    return False


def test_a_core_that_cannot_load_its_model_says_why(tokenizer, tmp_path):
    from flare.engine_client.protocol import EngineDeadError

    with pytest.raises(EngineDeadError, match="config.json"):
        AsyncEngine.start(ModelFactory(load_checkpoint_model, (str(tmp_path / "missing"),)), tokenizer)


def test_stats_carry_the_page_check_from_when_the_core_went_idle(async_engine, tokenizer):
    asyncio.run(collect(async_engine, "idle-check", tokenizer.encode("Once upon a time"),
                        SamplingParams(temperature=0, max_tokens=5)))
    stats = async_engine.stats()          # taken with the final output, when nothing was left to run
    assert (stats.num_running, stats.num_waiting, stats.kv_pages_used) == (0, 0, 0)
    # The page check runs once that output is on its way (the last token does not wait for it), and
    # its result follows in the core's next message.
    deadline = time.monotonic() + 5
    while async_engine.stats().page_integrity == "unchecked" and time.monotonic() < deadline:
        time.sleep(0.01)
    assert async_engine.stats().page_integrity == "ok"


def test_a_core_that_dies_is_reported_as_dead(stories260k, tokenizer):
    import time

    from flare.engine_client.protocol import EngineDeadError

    engine = AsyncEngine.from_checkpoint(stories260k, CONFIG, seed=0)
    try:
        assert engine.dead_reason is None
        engine._connection.process.kill()
        deadline = time.monotonic() + 10
        while engine.dead_reason is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert "exited" in engine.dead_reason
        with pytest.raises(EngineDeadError):
            asyncio.run(collect(engine, "after-death", tokenizer.encode("Lily"), SamplingParams(max_tokens=2)))
    finally:
        engine.shutdown()


def test_the_tokenizer_may_finish_loading_while_the_core_starts(stories260k):
    import multiprocessing
    from concurrent.futures import ThreadPoolExecutor

    factory = ModelFactory(load_checkpoint_model, (str(stories260k),), {"engine_config": CONFIG})
    with ThreadPoolExecutor(max_workers=1) as loader:
        engine = AsyncEngine.start(factory, loader.submit(load_tokenizer, stories260k), seed=0)
    try:
        outputs = asyncio.run(collect(engine, "late-tokenizer", engine.tokenizer.encode("Lily"),
                                      SamplingParams(temperature=0, max_tokens=4)))
        assert outputs[-1].finished and outputs[-1].num_output_tokens == 4
        assert "".join(output.new_text for output in outputs)
    finally:
        engine.shutdown()

    running = set(multiprocessing.active_children())         # the module's engine may be among them
    broken = ThreadPoolExecutor(max_workers=1).submit(lambda: (_ for _ in ()).throw(ValueError("tokenizer.json is corrupt")))
    with pytest.raises(ValueError, match="corrupt"):
        AsyncEngine.start(factory, broken)
    assert not [child for child in set(multiprocessing.active_children()) - running
                if child.name == "flare-engine-core"]
