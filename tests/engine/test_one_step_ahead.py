"""One step ahead: the core launches step N+1 before it reads step N's ids, and the tokens are the same,
token for token, as one step at a time: with batching, chunked prefill, prefix-cache hits, preemption,
stop tokens and aborts; on the fake runner and on real models (stories260k, a tiny Llama)."""

from __future__ import annotations

import pytest
import torch
from fake_runner import FakeRunner, fake_continuation
from test_scheduler import add, prompt
from tiny_checkpoints import write_tiny_checkpoint

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import SamplingParams


class Ordered:
    """Wraps a runner: records the order of launches and result reads ("launch", n) / ("result", n)."""

    def __init__(self, runner) -> None:
        self.runner, self.events = runner, []
        self.vocab_size = runner.vocab_size

    def __getattr__(self, name):
        return getattr(self.runner, name)

    def launch(self, plan):
        number = sum(1 for kind, _ in self.events if kind == "launch")
        self.events.append(("launch", number))
        pending = self.runner.launch(plan)
        events = self.events

        class Recorded:
            def result(self):
                events.append(("result", number))
                return pending.result()
        return Recorded()

    def ran_ahead(self) -> int:
        """Steps launched while the one before was unread."""
        unread, count = set(), 0
        for kind, number in self.events:
            if kind == "launch":
                count += bool(unread)
                unread.add(number)
            else:
                unread.discard(number)
        return count


def drive(core: EngineCore, arrivals: dict[int, list[tuple]], aborts: dict[int, list[str]]) -> dict[str, list[int]]:
    """Run to the end; `arrivals[k]` are (id, prompt, max_tokens, params) added before call k, `aborts[k]`
    ids aborted then. Returns each request's tokens and checks the books after every call."""
    tokens: dict[str, list[int]] = {}
    call = 0
    while core.has_unfinished() or any(k >= call for k in arrivals):
        for request_id, ids, max_tokens, params in arrivals.get(call, ()):
            add(core, request_id, ids, max_tokens=max_tokens, **params)
        core.abort(aborts.get(call, ()))
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        core.check_integrity()
        call += 1
        assert call < 5000, "the engine did not finish"
    return tokens


def fake_workload(one_step_ahead: bool, **settings):
    config = EngineConfig(**{"max_concurrency": 4, "page_size": 4, "num_pages": 24, "max_model_len": 64,
                             "prefill_chunk": 8, "max_num_batched_tokens": 16, **settings},
                          one_step_ahead=one_step_ahead)
    runner = Ordered(FakeRunner(config.page_size))
    core = EngineCore(config, runner)
    shared = prompt(13, 5)
    stop_at = fake_continuation(prompt(9, 2), 6)[3]
    arrivals = {0: [("long", prompt(30), 20, {}), ("short", prompt(5, 1), 6, {})],
                3: [("stops", prompt(9, 2), 30, {"stop_token_ids": (stop_at,)}), ("cached-a", shared, 8, {})],
                6: [("cached-b", shared + prompt(3, 7), 8, {}), ("aborted", prompt(12, 3), 40, {})],
                9: [(f"late{i}", prompt(6 + i, 20 + i), 10 + i, {}) for i in range(4)]}
    tokens = drive(core, arrivals, aborts={14: ["aborted"]})
    return tokens, core, runner


def test_the_fake_workload_gives_the_same_tokens_either_way():
    expected, _, sync_runner = fake_workload(one_step_ahead=False)
    tokens, core, runner = fake_workload(one_step_ahead=True)
    for got in (tokens, expected):                      # an abort lands wherever the request has got to
        aborted = got.pop("aborted")
        assert aborted == fake_continuation(prompt(12, 3), len(aborted)) and 0 < len(aborted) < 40
    assert tokens == expected
    assert core.stats().num_preemptions > 0 and core.stats().prefix_cache_hit_tokens > 0, "the workload needs both"
    assert sync_runner.ran_ahead() == 0 and runner.ran_ahead() > len(runner.events) // 4
    for request_id in ("long", "short", "cached-a", "late3"):
        assert len(tokens[request_id]) == {"long": 20, "short": 6, "cached-a": 8, "late3": 13}[request_id]
    # The stop token is the last token; the row computed after it, one step ahead, was discarded.
    assert tokens["stops"] == fake_continuation(prompt(9, 2), 4)
    stop_steps = [i for i, s in enumerate(runner.runner.steps) if any(r.request_id == "stops" for r in s.rows)]
    sync_stop_steps = [s for s in sync_runner.runner.steps if any(r.request_id == "stops" for r in s.rows)]
    assert len(stop_steps) == len(sync_stop_steps) + 1


def test_a_request_finishing_by_length_takes_no_step_beyond_its_last_token():
    settings = dict(max_concurrency=2, page_size=4, num_pages=64, max_model_len=64)
    rows = {}
    for ahead in (False, True):
        config = EngineConfig(**settings, one_step_ahead=ahead)
        core = EngineCore(config, FakeRunner(config.page_size))
        tokens = drive(core, {0: [("a", prompt(5), 7, {}), ("b", prompt(8, 1), 3, {})],
                              2: [("c", prompt(4, 2), 5, {})]}, {})
        assert tokens == {"a": fake_continuation(prompt(5), 7), "b": fake_continuation(prompt(8, 1), 3),
                          "c": fake_continuation(prompt(4, 2), 5)}
        rows[ahead] = [[(r.request_id, r.num_computed_tokens, r.num_new_tokens) for r in s.rows]
                       for s in core.runner.steps]
    assert rows[True] == rows[False]            # the same steps: c takes b's slot as soon as b is done


# ---- real models ---------------------------------------------------------------------------------

PROMPTS = ["Once upon a time there was a little girl named Lily", "Tom had a big dog. The dog was happy",
           "The sun was hot and the children played in the park", "Once upon a time there was a little girl"]
STORIES_SETTINGS = {
    "roomy": dict(page_size=4, num_pages=128, max_model_len=256),
    "chunked": dict(page_size=4, num_pages=256, max_model_len=256, prefill_chunk=5, max_num_batched_tokens=12),
    "preempting": dict(page_size=4, num_pages=24, max_model_len=96, prefill_chunk=4, max_num_batched_tokens=8),
}


def stories_engine(directory, ahead: bool, graphs: bool = False, **settings) -> LLMEngine:
    """The engine on `directory`; `graphs`: decode steps through the static buffers graphs replay."""
    from flare.engine.factory import load_checkpoint_model
    from flare.engine.runner import ModelRunner
    from flare.frontend.tokenizer import load_tokenizer

    config = EngineConfig(**settings, one_step_ahead=ahead)
    loaded = load_checkpoint_model(directory, config)
    runner = ModelRunner(loaded.model, loaded.model_config, config, seed=0, graphs=graphs, capture=False)
    return LLMEngine(EngineCore(config, Ordered(runner), loaded.eos_token_ids), load_tokenizer(directory))


def generate_both(directory, params, prompts=PROMPTS, graphs=False, **settings):
    results = []
    for ahead in (False, True):
        engine = stories_engine(directory, ahead, graphs, **settings)
        first = engine.generate(prompts[:2], params[:2] if isinstance(params, list) else params)
        second = engine.generate(prompts, params)             # prefix-cache hits on the first two
        engine.check_integrity()
        results.append((engine, [o.new_token_ids for o in first + second], first + second))
    (sync, sync_tokens, sync_outputs), (ahead, tokens, outputs) = results
    assert sync.core.runner.ran_ahead() == 0
    return sync, sync_tokens, sync_outputs, ahead, tokens, outputs


@pytest.mark.parametrize("setting", STORIES_SETTINGS)
def test_stories_greedy_tokens_are_the_same_either_way(stories260k, setting):
    params = SamplingParams(temperature=0, max_tokens=40)
    sync, expected, _, ahead, tokens, _ = generate_both(stories260k, params, **STORIES_SETTINGS[setting])
    assert tokens == expected
    assert ahead.core.runner.ran_ahead() > 20
    assert ahead.core.stats().prefix_cache_hit_tokens == sync.core.stats().prefix_cache_hit_tokens > 0
    if setting == "preempting":
        assert ahead.core.stats().num_preemptions > 0


def test_stories_static_decode_buffers_one_step_ahead(stories260k):
    params = SamplingParams(temperature=0, max_tokens=30)
    _, expected, _, ahead, tokens, _ = generate_both(stories260k, params, graphs=True,
                                                     **STORIES_SETTINGS["roomy"])
    assert tokens == expected and ahead.core.runner.ran_ahead() > 20


def test_seeds_logprobs_and_prompt_logprobs_are_the_same_either_way(stories260k):
    params = [SamplingParams(temperature=0.8, top_p=0.9, seed=7, max_tokens=30, logprobs=2, prompt_logprobs=1),
              SamplingParams(temperature=0, max_tokens=30, logprobs=0)]
    *_, expected, ahead, tokens, outputs = generate_both(stories260k, params * 2, **STORIES_SETTINGS["chunked"])
    assert tokens == [o.new_token_ids for o in expected] and ahead.core.runner.ran_ahead() > 20
    for mine, theirs in zip(outputs, expected):
        assert [e.token_id for e in mine.new_logprobs] == list(mine.new_token_ids)
        assert [e.logprob for e in mine.new_logprobs] == pytest.approx([e.logprob for e in theirs.new_logprobs],
                                                                        abs=1e-5)
        assert (mine.prompt_logprobs is None) == (theirs.prompt_logprobs is None)
        if mine.prompt_logprobs is not None:
            assert [e.logprob for e in mine.prompt_logprobs[1:]] == pytest.approx(
                [e.logprob for e in theirs.prompt_logprobs[1:]], abs=1e-5)


def test_penalized_and_biased_requests_run_ahead_and_give_the_same_tokens(stories260k):
    """The device sampler counts penalties from the sampled ids on the device: nothing waits for the host."""
    params = [SamplingParams(temperature=0, max_tokens=30, repetition_penalty=1.3, logit_bias=((376, -5.0),)),
              SamplingParams(temperature=0.7, seed=3, max_tokens=30, frequency_penalty=0.5, presence_penalty=0.2)]
    _, expected, _, ahead, tokens, _ = generate_both(stories260k, params * 2, **STORIES_SETTINGS["preempting"])
    assert tokens == expected
    assert ahead.core.runner.ran_ahead() > 20 and ahead.core.stats().num_preemptions > 0


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))


TINY_SETTINGS = {
    "chunked": dict(page_size=4, num_pages=256, max_model_len=128, prefill_chunk=5, max_num_batched_tokens=12),
    "preempting": dict(page_size=4, num_pages=40, max_model_len=128, prefill_chunk=16, max_num_batched_tokens=32),
}


@pytest.mark.parametrize("setting", TINY_SETTINGS)
def test_tiny_llama_greedy_tokens_are_the_same_either_way(tiny_llama, setting):
    generator = torch.Generator().manual_seed(1)
    prompts = [[1] + torch.randint(3, 512, (n - 1,), generator=generator).tolist() for n in (3, 40, 9, 17, 1, 24)]
    params = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    _, expected, _, ahead, tokens, _ = generate_both(tiny_llama, params, prompts=prompts, **TINY_SETTINGS[setting])
    assert tokens == expected and ahead.core.runner.ran_ahead() > 20
    if setting == "preempting":
        assert ahead.core.stats().num_preemptions > 0


# ---- on a GPU: captured decode graphs, ids left on the device -----------------------------------

def gpu_engine(directory, ahead: bool, dtype: str, **settings) -> LLMEngine:
    """The engine as served on CUDA: Triton attention, decode steps replayed as captured graphs."""
    from flare.engine.factory import load_checkpoint_model
    from flare.engine.runner import ModelRunner
    from flare.frontend.tokenizer import load_tokenizer

    config = EngineConfig(**settings, one_step_ahead=ahead)
    loaded = load_checkpoint_model(directory, config, "cuda", dtype)
    runner = ModelRunner(loaded.model, loaded.model_config, config, "cuda", getattr(torch, dtype), seed=0)
    assert runner.graphs is not None and runner.graphs.graphs, "no graph was captured"
    return LLMEngine(EngineCore(config, Ordered(runner), loaded.eos_token_ids), load_tokenizer(directory))


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("setting", TINY_SETTINGS)
def test_captured_graphs_one_step_ahead_give_the_same_tokens_on_the_gpu(tiny_llama, dtype, setting):
    generator = torch.Generator().manual_seed(2)
    prompts = [[1] + torch.randint(3, 512, (n - 1,), generator=generator).tolist() for n in (3, 40, 9, 17, 1, 24)]
    greedy = SamplingParams(temperature=0, max_tokens=48, ignore_eos=True)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=11, max_tokens=48, ignore_eos=True, logprobs=1)
    params = [greedy, seeded] * 3
    results = {}
    for ahead in (False, True):
        engine = gpu_engine(tiny_llama, ahead, dtype, **TINY_SETTINGS[setting])
        outputs = engine.generate(prompts, params)
        engine.check_integrity()
        results[ahead] = (engine, outputs)
    (sync, expected), (ahead, outputs) = results[False], results[True]
    assert [o.new_token_ids for o in outputs] == [o.new_token_ids for o in expected]
    for mine, theirs in zip(outputs, expected):
        assert [e.logprob for e in mine.new_logprobs] == pytest.approx([e.logprob for e in theirs.new_logprobs],
                                                                        abs=1e-3)
    assert sync.core.runner.ran_ahead() == 0 and ahead.core.runner.ran_ahead() > 20
    if setting == "preempting":
        assert ahead.core.stats().num_preemptions > 0
