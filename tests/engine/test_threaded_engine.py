"""The in-process engine client (debug-serve) behaves as the process client does: same outputs, one stats shape."""

from __future__ import annotations

import asyncio
import time

import pytest

from flare.engine.config import EngineConfig
from flare.engine.stats import EngineStats
from flare.engine.request import InvalidRequest
from flare.engine.sampling_params import GrammarSpec, SamplingParams
from flare.engine_client.llm_engine import LLMEngine
from flare.engine_client.protocol import EngineClient, EngineDeadError
from flare.engine_client.threaded import ThreadedEngine

CONFIG = EngineConfig(page_size=8, num_pages=64, max_model_len=256, prefill_chunk=8, max_num_batched_tokens=32)


@pytest.fixture
def threaded(stories260k):
    engine = ThreadedEngine(LLMEngine.from_checkpoint(stories260k, CONFIG, seed=0))
    yield engine
    engine.shutdown()


async def collect(engine, request_id, prompt_ids, params):
    return [output async for output in engine.generate(request_id, prompt_ids, params)]


def test_every_client_implements_the_protocol(threaded):
    from flare.engine_client.async_engine import AsyncEngine
    from tests.server.standin_engine import StandinEngine

    assert isinstance(threaded, EngineClient)
    assert isinstance(StandinEngine(None), EngineClient)
    for name in ("generate", "abort", "stats", "dead_reason", "shutdown"):
        assert hasattr(AsyncEngine, name)


def test_streams_equal_the_synchronous_engine_and_stats_are_engine_stats(threaded, stories260k):
    tokenizer = threaded.engine.tokenizer
    prompt_ids = tokenizer.encode("Once upon a time")
    params = SamplingParams(temperature=0, max_tokens=12)
    pieces = asyncio.run(collect(threaded, "r", prompt_ids, params))
    expected = LLMEngine.from_checkpoint(stories260k, CONFIG, seed=0).generate([prompt_ids], params)[0]
    assert [t for p in pieces for t in p.new_token_ids] == list(expected.new_token_ids)
    assert pieces[-1].finished and sum(p.finished for p in pieces) == 1
    stats = threaded.stats()                   # plain, not awaited: the same shape AsyncEngine gives
    assert isinstance(stats, EngineStats)
    deadline = time.monotonic() + 5            # the page check runs once the engine went idle and quiet
    while threaded.stats().page_integrity == "unchecked" and time.monotonic() < deadline:
        time.sleep(0.01)
    stats = threaded.stats()
    assert (stats.num_running, stats.kv_pages_used, stats.page_integrity) == (0, 0, "ok")


def test_a_grammar_that_fails_to_compile_is_refused_while_the_thread_steps_on(threaded):
    bad = SamplingParams(max_tokens=10, grammar=GrammarSpec("regex", "("))

    async def together():
        return await asyncio.gather(collect(threaded, "bad", [1, 2, 3], bad),
                                    collect(threaded, "free", [1, 2, 3], SamplingParams(max_tokens=8, ignore_eos=True)),
                                    return_exceptions=True)

    refused, free = asyncio.run(together())
    assert isinstance(refused, InvalidRequest) and "regex grammar cannot be compiled" in str(refused)
    assert free[-1].finish_reason == "length"


def test_refusals_and_shutdown_are_typed(threaded):
    with pytest.raises(InvalidRequest, match="shorten the prompt"):
        asyncio.run(collect(threaded, "long", [5] * 300, SamplingParams()))

    async def cut_by_shutdown():
        outputs = []
        async for output in threaded.generate("cut", [1, 2, 3], SamplingParams(max_tokens=200, ignore_eos=True)):
            outputs.append(output)
            if len(outputs) == 2:
                await asyncio.get_running_loop().run_in_executor(None, threaded.shutdown)
        return outputs

    with pytest.raises(EngineDeadError, match="shut down"):
        asyncio.run(cut_by_shutdown())
    with pytest.raises(EngineDeadError):
        asyncio.run(collect(threaded, "after", [1, 2], SamplingParams(max_tokens=2)))
