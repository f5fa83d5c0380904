"""The scheduler and core on fake model outputs: chunking, budgets, preemption, fairness, aborts."""

from __future__ import annotations

import pytest
from fake_runner import fake_continuation

from flare.engine.core import EngineCore
from flare.engine.request import EngineRequest
from flare.engine.sampling_params import SamplingParams


def add(core: EngineCore, request_id: str, prompt: list[int], max_tokens: int = 8, **params) -> None:
    core.add_request(EngineRequest(request_id, tuple(prompt), SamplingParams(max_tokens=max_tokens, **params)))


def run_to_end(core: EngineCore, max_steps: int = 10_000) -> dict[str, list[int]]:
    tokens: dict[str, list[int]] = {}
    for _ in range(max_steps):
        if not core.has_unfinished():
            return tokens
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        core.check_integrity()
    raise AssertionError("the engine did not finish")


def prompt(length: int, start: int = 0) -> list[int]:
    return [(start + 7 * i) % 97 for i in range(length)]


def test_a_prompt_is_split_into_chunks_and_sampled_only_at_its_end(make_fake_core):
    # One step at a time, so each step's outputs come back from the call that ran it.
    core = make_fake_core(prefill_chunk=4, page_size=4, num_pages=16, max_model_len=64, enable_prefix_caching=False,
                          one_step_ahead=False)
    add(core, "a", prompt(10), max_tokens=3)
    sizes, sampled_at = [], []
    while core.has_unfinished():
        outputs = core.step()
        step = core.runner.steps[-1]
        sizes.append(step.rows[0].num_new_tokens)
        sampled_at.append(bool(outputs))
    assert sizes == [4, 4, 2, 1, 1]
    assert sampled_at == [False, False, True, True, True]


def test_decode_and_prefill_share_a_step_within_the_token_budget(make_fake_core):
    core = make_fake_core(prefill_chunk=8, max_num_batched_tokens=6, max_concurrency=4, page_size=4,
                          num_pages=32, max_model_len=64)
    add(core, "a", prompt(3), max_tokens=20)
    core.step()                                     # a's prompt
    add(core, "b", prompt(20, 1), max_tokens=2)
    core.step()
    step = core.runner.steps[-1]
    assert [(r.request_id, r.num_new_tokens) for r in step.rows] == [("a", 1), ("b", 5)]
    run_to_end(core)
    assert all(s.num_batched_tokens <= 6 for s in core.runner.steps)


def test_concurrency_is_capped_and_every_request_gets_its_own_continuation(make_fake_core):
    core = make_fake_core(max_concurrency=3, page_size=4, num_pages=64, max_model_len=64)
    prompts = {f"r{i}": prompt(3 + 2 * i, i) for i in range(7)}
    for i, (request_id, ids) in enumerate(prompts.items()):
        add(core, request_id, ids, max_tokens=5 + i)
    tokens = run_to_end(core)
    assert all(len({r.request_id for r in s.rows}) <= 3 for s in core.runner.steps)
    for i, (request_id, ids) in enumerate(prompts.items()):
        assert tokens[request_id] == fake_continuation(ids, 5 + i)


def test_running_out_of_pages_preempts_the_newest_and_loses_no_tokens(make_fake_core):
    core = make_fake_core(max_concurrency=4, page_size=2, num_pages=12, max_model_len=24,
                          prefill_chunk=4, max_num_batched_tokens=8)
    prompts = {f"r{i}": prompt(5, 10 * i) for i in range(4)}
    for request_id, ids in prompts.items():
        add(core, request_id, ids, max_tokens=12)
    tokens = run_to_end(core)
    preempted = [rid for s in core.runner.steps for rid in s.preempted_request_ids]
    assert preempted, "the test needs the cache to run out"
    assert "r0" not in preempted                    # the oldest request is never the victim
    for request_id, ids in prompts.items():
        assert tokens[request_id] == fake_continuation(ids, 12)


def test_the_head_of_the_queue_is_not_overtaken(make_fake_core):
    # The long request cannot be admitted while the first one holds most pages; the short one behind
    # it would fit, but must wait its turn.
    core = make_fake_core(max_concurrency=4, page_size=4, num_pages=8, max_model_len=32,
                          enable_prefix_caching=False)
    add(core, "first", prompt(16), max_tokens=4)
    core.step()
    add(core, "long", prompt(20, 3), max_tokens=4)
    add(core, "short", prompt(2, 5), max_tokens=4)
    admitted = []
    while core.has_unfinished():
        core.step()
        for row in core.runner.steps[-1].rows:
            if row.request_id not in admitted:
                admitted.append(row.request_id)
    assert admitted == ["first", "long", "short"]


def test_abort_frees_the_pages_at_once(make_fake_core):
    core = make_fake_core(page_size=4, num_pages=16, max_model_len=64)
    add(core, "a", prompt(10), max_tokens=30)
    add(core, "b", prompt(6, 2), max_tokens=30)
    core.step()
    assert core.allocator.num_used_pages > 0
    core.abort(["a", "b", "unknown"])
    assert core.allocator.num_used_pages == 0
    assert not core.has_unfinished()
    core.check_integrity()


def test_stop_token_ids_and_max_model_len_finish_a_request(make_fake_core):
    core = make_fake_core(page_size=4, num_pages=16, max_model_len=12)
    ids = prompt(5)
    expected = fake_continuation(ids, 7)
    add(core, "stop", ids, max_tokens=30, stop_token_ids=(expected[2],))
    add(core, "length", prompt(5, 1), max_tokens=30)
    finished = {}
    while core.has_unfinished():
        for output in core.step():
            if output.finish_reason:
                finished[output.request_id] = output
    assert finished["stop"].finish_reason == "stop" and finished["stop"].stop_token_id == expected[2]
    assert finished["length"].finish_reason == "length"


def test_a_repeated_prompt_is_served_from_the_prefix_cache(make_fake_core):
    core = make_fake_core(page_size=4, num_pages=32, max_model_len=64)
    ids = prompt(13)
    add(core, "a", ids, max_tokens=3)
    first = run_to_end(core)
    add(core, "b", ids, max_tokens=3)
    reports = []
    while core.has_unfinished():
        reports += core.step()
    assert reports[0].num_cached_tokens == 12
    assert [t for r in reports for t in r.new_token_ids] == first["a"]
    assert core.runner.steps[-3].rows[0].num_new_tokens == 1     # only the last prompt token computed


def test_a_prompt_is_validated_once_where_it_enters_the_engine(make_fake_core, monkeypatch):
    from flare.engine import core as core_module
    from flare.engine.request import InvalidRequest
    from flare.engine.core_process import _apply
    from flare.engine.messages import AddRequest, RequestRefused

    checked = []
    validate_prompt = core_module.validate_prompt
    monkeypatch.setattr(core_module, "validate_prompt", lambda ids, *limits: checked.append(ids) or
                        validate_prompt(ids, *limits))
    core = make_fake_core(page_size=4, num_pages=16, max_model_len=32)
    add(core, "in-process", prompt(5))
    with pytest.raises(InvalidRequest, match="at most 32"):
        add(core, "too-long", prompt(40))
    assert len(checked) == 2                            # an in-process caller's prompt is checked by the core
    # The core process takes what AsyncEngine.generate already validated, and only refuses a reused id.
    assert _apply(core, AddRequest(EngineRequest("served", tuple(prompt(6)), SamplingParams(max_tokens=2)))) is None
    assert len(checked) == 2
    refused = _apply(core, AddRequest(EngineRequest("served", (1,), SamplingParams())))
    assert isinstance(refused, RequestRefused) and "already in use" in refused.message
    assert fake_continuation(prompt(6), 2) == run_to_end(core)["served"]
