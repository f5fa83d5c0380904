"""The prefix cache end to end: repeated prompts, multi-turn conversations, eviction under pressure, counters."""

from __future__ import annotations

import pytest
from fake_runner import fake_continuation
from test_scheduler import add, prompt, run_to_end

from flare.engine.config import EngineConfig
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import SamplingParams

CHAT_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
                 "{% if add_generation_prompt %}assistant:{% endif %}")
GREEDY = SamplingParams(temperature=0, max_tokens=20)


@pytest.fixture
def stories_engine(stories260k, checked):
    def make(**settings) -> LLMEngine:
        config = EngineConfig(**{"page_size": 4, "num_pages": 128, "max_model_len": 512, **settings})
        return checked(LLMEngine.from_checkpoint(stories260k, config))
    return make


def test_a_second_identical_prompt_skips_recomputation(stories_engine):
    llm = stories_engine()
    ids = llm.tokenizer.encode("Once upon a time there was a little girl named Lily. She liked to play outside")
    [first] = llm.generate([ids], GREEDY)
    after_first = llm.core.stats()
    [second] = llm.generate([ids], GREEDY)
    after_second = llm.core.stats()
    cached = (len(ids) - 1) // 4 * 4                # whole pages, and the last token is always computed
    assert first.num_cached_tokens == 0 and second.num_cached_tokens == cached > 0
    assert second.new_token_ids == first.new_token_ids
    first_computed = after_first.num_computed_tokens
    assert after_second.num_computed_tokens - first_computed == first_computed - cached
    assert after_second.prefix_cache_hit_tokens == cached
    assert after_second.prefix_cache_miss_tokens == 2 * len(ids) - cached


def test_a_fully_cached_prompt_still_computes_its_last_page(stories_engine):
    llm = stories_engine()
    ids = llm.tokenizer.encode("Tom had a big dog. The dog was happy and")[:12]      # exactly three pages
    [first] = llm.generate([ids], GREEDY)
    [second] = llm.generate([ids], GREEDY)
    assert second.num_cached_tokens == 8            # the page holding the last token is recomputed for its logits
    assert second.new_token_ids == first.new_token_ids


def test_a_conversation_reuses_the_previous_turns_prompt_and_answer(stories_engine):
    llm = stories_engine()
    llm.tokenizer.hf.chat_template = CHAT_TEMPLATE
    messages = [{"role": "user", "content": "Once upon a time there was a little girl named Lily. She liked to play."}]

    def render() -> list[int]:
        return llm.tokenizer.encode(llm.tokenizer.apply_chat_template(messages), add_special_tokens=False)

    turn1 = render()
    [answer] = llm.generate([turn1], SamplingParams(temperature=0, max_tokens=24))
    messages += [{"role": "assistant", "content": answer.new_text}, {"role": "user", "content": "Tom had a big dog."}]
    turn2 = render()
    exchange = turn1 + list(answer.new_token_ids)
    assert turn2[:len(exchange)] == exchange, "the template repeats the first exchange token for token"
    [reply] = llm.generate([turn2], GREEDY)
    # Every full page of the exchange the model computed (all but the last answer token) is reused.
    assert reply.num_cached_tokens == (len(exchange) - 1) // 4 * 4
    assert reply.num_cached_tokens > len(turn1) + len(answer.new_token_ids) // 2
    [uncached] = stories_engine(enable_prefix_caching=False).generate([turn2], GREEDY)
    assert reply.new_token_ids == uncached.new_token_ids


def test_finished_requests_stay_resident_until_their_pages_are_needed(make_fake_core):
    core = make_fake_core(page_size=4, num_pages=16, max_model_len=32, max_concurrency=2)
    add(core, "a", prompt(17), max_tokens=4)       # 20 computed tokens: 5 full pages
    run_to_end(core)
    stats = core.stats()
    assert stats.kv_pages_used == 0 and stats.prefix_cache_resident_pages == 5
    assert stats.prefix_cache_evicted_pages == 0
    # Unrelated work that fits in the free pages leaves the cached ones alone.
    add(core, "b", prompt(20, 5), max_tokens=4)
    run_to_end(core)
    assert core.stats().prefix_cache_evicted_pages == 0
    # Work that needs every page evicts the least recently used cached pages first ("a" is older than "b").
    add(core, "c", prompt(28, 9), max_tokens=4)
    run_to_end(core)
    evicted = core.stats().prefix_cache_evicted_pages
    assert evicted > 0
    add(core, "b-again", prompt(20, 5), max_tokens=1)
    add(core, "a-again", prompt(17), max_tokens=1)
    reports = {}
    while core.has_unfinished():
        reports.update({o.request_id: o for o in core.step()})
    assert reports["b-again"].num_cached_tokens > reports["a-again"].num_cached_tokens


def test_eviction_under_pressure_never_corrupts_a_running_request(make_fake_core):
    # Twelve requests share two system prompts in a pool that holds about three of them at once:
    # pages are pinned, cached, evicted and preempted all the time. The fake runner raises if a shared
    # page is overwritten or a page table loses context; run_to_end checks integrity after every step.
    core = make_fake_core(page_size=4, num_pages=14, max_model_len=56, max_concurrency=4,
                          prefill_chunk=8, max_num_batched_tokens=16)
    systems = [prompt(12, 1), prompt(16, 2)]
    prompts = {f"r{i}": systems[i % 2] + prompt(3 + i % 5, 40 + i) for i in range(12)}
    for i, (request_id, ids) in enumerate(prompts.items()):
        add(core, request_id, ids, max_tokens=6 + i % 7)
    tokens = run_to_end(core)
    for i, (request_id, ids) in enumerate(prompts.items()):
        assert tokens[request_id] == fake_continuation(ids, 6 + i % 7)
    stats = core.stats()
    assert stats.prefix_cache_hit_tokens > 0 and stats.prefix_cache_evicted_pages > 0
    assert stats.kv_pages_used == 0


def test_eviction_under_pressure_gives_the_no_cache_outputs_on_a_real_model(stories_engine):
    shared = "Once upon a time there was a little girl named Lily. She"
    prompts = [f"{shared} {end}" for end in ("liked to play", "had a red ball", "saw a big dog",
                                              "went to the park", "was very happy", "found a box")]
    params = SamplingParams(temperature=0, max_tokens=24)
    tight = stories_engine(num_pages=30, max_model_len=96, max_concurrency=3, prefill_chunk=8,
                           max_num_batched_tokens=16)
    squeezed = tight.generate(prompts, params) + tight.generate(prompts[::-1], params)
    reference = stories_engine(enable_prefix_caching=False).generate(prompts + prompts[::-1], params)
    assert [o.new_token_ids for o in squeezed] == [o.new_token_ids for o in reference]
    stats = tight.core.stats()
    assert stats.prefix_cache_hit_tokens > 0 and stats.prefix_cache_evicted_pages > 0


def test_counters_only_grow_across_batches(make_fake_core):
    core = make_fake_core(page_size=4, num_pages=32, max_model_len=64)
    seen = []
    for batch in range(3):
        for i in range(3):
            add(core, f"{batch}-{i}", prompt(13, i), max_tokens=3)
        run_to_end(core)
        seen.append(core.stats())
    hits = [s.prefix_cache_hit_tokens for s in seen]
    misses = [s.prefix_cache_miss_tokens for s in seen]
    assert hits[0] < hits[1] < hits[2] and misses[0] < misses[1] < misses[2]
    assert hits[-1] + misses[-1] == 9 * 13          # every prompt token is a hit or a miss, once



def test_a_request_waiting_at_the_head_of_the_queue_hashes_each_page_once(make_fake_core, monkeypatch):
    from flare.engine import kv_cache

    sha256 = kv_cache.hashlib.sha256
    num_hashes = 0

    def counting_sha256(data: bytes = b""):
        nonlocal num_hashes
        num_hashes += 1
        return sha256(data)

    monkeypatch.setattr(kv_cache.hashlib, "sha256", counting_sha256)
    core = make_fake_core(page_size=4, num_pages=8, max_model_len=32, prefill_chunk=64)
    first = prompt(24)
    add(core, "first", first, max_tokens=4)                         # 28 tokens: 7 pages, 1 left free
    core.step()
    add(core, "long", first[:16] + prompt(12, 3), max_tokens=4)    # 4 pages cached, 4 more needed
    waited = 0
    while "long" not in {row.request_id for row in core.runner.steps[-1].rows}:
        core.step()
        waited += 1
    run_to_end(core)
    assert waited >= 3                  # it matched its cached prefix again on each of these steps
    assert core.stats().prefix_cache_hit_tokens >= 16
    assert num_hashes <= 28 // 4 + 32 // 4                          # each request's full pages, once
