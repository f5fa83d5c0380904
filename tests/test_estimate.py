"""The capacity estimate before weights load and its section-6 error (spec §6)."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from flare.errors import CapacityError
from flare.estimate import (MemoryEstimate, capacity_error_from_oom, check_estimate, choose_gpus,
                            oom_as_capacity_error)
from flare.memory import GiB, DeviceMemory, memory_budget, parse_gpus, parse_memory_limit, parse_size


def gib(amount: float) -> int:
    return int(amount * GiB)


# The specification's example: 68.3 + 7.0 + 5.2 + 0.9 + 0.8 (4 x 8,192 tokens) = 82.2 GiB needed.
SPEC_EXAMPLE = MemoryEstimate(weights_bytes=gib(68.3), graphs_bytes=gib(7.0),
                              live_state_bytes_per_request=gib(1.3), prefix_cache_bytes_per_request=gib(0.225),
                              kv_bytes_per_token=26214, max_concurrency=4, max_context=131072, page_size=16)


def gpu(free: float, total: float = 139.8, index: int = 0) -> DeviceMemory:
    return DeviceMemory(index=index, name="test gpu", free=gib(free), total=gib(total))


def test_the_specification_example_word_for_word():
    budget = memory_budget(gpu(95.6), headroom=GiB, reserve=gib(21.0))
    with pytest.raises(CapacityError) as caught:
        check_estimate(SPEC_EXAMPLE, [budget])
    assert f"error: {caught.value}" == (
        "error: needs 68.3 GiB weights + 7.0 GiB graphs + 5.2 GiB live state + 0.9 GiB prefix cache\n"
        "       + 0.8 GiB minimum pages (4 × 8,192 tokens) = 82.2 GiB;\n"
        "       has 95.6 GiB free − 1.0 GiB headroom − 21.0 GiB reserve = 73.6 GiB.\n"
        '       Options: [memory] reserve = "12G".')


def test_a_fitting_estimate_returns_the_requirement():
    requirement = check_estimate(SPEC_EXAMPLE, [memory_budget(gpu(95.6), headroom=GiB)])
    assert requirement.total == SPEC_EXAMPLE.requirement().total
    assert requirement.minimum_pages == 4 * 8192 * 26214


def options_of(error: CapacityError) -> list[str]:
    listed = re.search(r"Options: (.*)\.$", str(error))[1]
    return listed.split("; ")


def fits_after(option: str, estimate: MemoryEstimate, devices, selected, reserve: int, limit=None) -> bool:
    """Apply one option to the settings and run the estimate again."""
    if option.startswith("[memory] reserve"):
        reserve = parse_size(re.search(r'"(.*)"', option)[1], "[memory] reserve")
    elif option.startswith("--memory-limit"):
        limit = parse_memory_limit(option.split()[1])
    elif option.startswith("--max-concurrency"):
        estimate = replace(estimate, max_concurrency=int(option.split()[1]))
    elif option.startswith("--gpus"):
        selected = parse_gpus(option.split()[1])
        estimate = replace(estimate, tensor_parallel=len(selected))
    else:
        raise AssertionError(f"unexpected option {option}")
    budgets = [memory_budget(devices[index], GiB, limit, reserve) for index in selected]
    try:
        check_estimate(estimate, budgets)
    except CapacityError:
        return False
    return True


SCENARIOS = {
    # another process took memory, a reserve is configured, and more GPUs are idle
    "reserve, concurrency and GPUs": (
        MemoryEstimate(weights_bytes=gib(40), graphs_bytes=gib(4), live_state_bytes_per_request=gib(0.05),
                       prefix_cache_bytes_per_request=gib(0.1), kv_bytes_per_token=128 * 1024,
                       max_concurrency=16, max_context=131072, page_size=16),
        [gpu(70, index=0), gpu(139, index=1), gpu(139, index=2)], (0,), gib(20), None, (1, 2, 4)),
    # a --memory-limit reserve, not the configured one, is what to change
    "memory-limit reserve": (
        replace(SPEC_EXAMPLE, max_concurrency=8), [gpu(95.6)], (0,), 0, parse_memory_limit("-21G"), (1,)),
    # an occupied cap below free memory: raise the cap
    "occupied cap": (SPEC_EXAMPLE, [gpu(120)], (0,), 0, parse_memory_limit("60G"), (1, 2)),
    "fraction cap": (SPEC_EXAMPLE, [gpu(120, total=140)], (0,), 0, parse_memory_limit("0.5"), (1,)),
}


@pytest.mark.parametrize("scenario", SCENARIOS)
def test_every_listed_option_makes_it_fit_on_its_own(scenario):
    estimate, devices, selected, reserve, limit, tp_sizes = SCENARIOS[scenario]
    budgets = [memory_budget(devices[index], GiB, limit, reserve) for index in selected]
    with pytest.raises(CapacityError) as caught:
        check_estimate(estimate, budgets, all_budgets=[memory_budget(d, GiB, limit, reserve) for d in devices],
                       tensor_parallel_sizes=tp_sizes)
    options = options_of(caught.value)
    assert options and options[0] != "none on these GPUs"
    for option in options:
        assert fits_after(option, estimate, devices, selected, reserve, limit), option


def test_options_name_the_setting_the_user_gave():
    estimate, devices, selected, reserve, limit, tp_sizes = SCENARIOS["reserve, concurrency and GPUs"]
    budgets = [memory_budget(d, GiB, limit, reserve) for d in devices]
    with pytest.raises(CapacityError) as caught:
        check_estimate(estimate, budgets[:1], all_budgets=budgets, tensor_parallel_sizes=tp_sizes)
    options = options_of(caught.value)
    assert options[0].startswith("[memory] reserve = ")
    assert options[1].startswith("--max-concurrency ")
    assert options[2] == "--gpus 0-1"                     # TP 2 halves weights and pages per GPU
    _, devices, _, _, limit, _ = SCENARIOS["memory-limit reserve"]
    with pytest.raises(CapacityError) as caught:
        check_estimate(replace(SPEC_EXAMPLE, max_concurrency=8), [memory_budget(devices[0], GiB, limit)])
    assert options_of(caught.value)[0].startswith("--memory-limit -")
    with pytest.raises(CapacityError) as caught:
        check_estimate(SPEC_EXAMPLE, [memory_budget(gpu(120), GiB, parse_memory_limit("60G"))])
    assert "has 60.0 GiB memory limit − 1.0 GiB headroom = 59.0 GiB." in str(caught.value)
    assert options_of(caught.value) == ["--memory-limit 84G"]


def test_a_model_too_large_for_any_setting_says_so():
    huge = replace(SPEC_EXAMPLE, weights_bytes=gib(500))
    with pytest.raises(CapacityError, match="Options: none on these GPUs"):
        check_estimate(huge, [memory_budget(gpu(139), GiB)])


def test_gpus_are_chosen_at_the_smallest_tensor_parallel_size_that_fits():
    estimate = replace(SPEC_EXAMPLE, weights_bytes=gib(150))
    budgets = [memory_budget(gpu(free), GiB) for free in (139, 20, 139, 139)]
    assert choose_gpus(estimate, budgets, (1, 2, 4)) == (0, 2)
    assert choose_gpus(SPEC_EXAMPLE, budgets, (1, 2, 4)) == (0,)
    with pytest.raises(CapacityError, match="needs"):
        choose_gpus(replace(SPEC_EXAMPLE, weights_bytes=gib(900)), budgets, (1, 2, 4))


class OutOfMemoryError(RuntimeError):
    """Stands in for torch.OutOfMemoryError, matched by name."""


OOM_TEXT = ("CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a total capacity of 139.81 GiB of "
            "which 1.20 GiB is free. Including non-PyTorch memory, this process has 138.5 GiB memory in use.")


def test_an_allocation_failure_during_preparation_is_a_capacity_error():
    budgets = [memory_budget(gpu(95.6), GiB, reserve=gib(10))]
    with pytest.raises(CapacityError) as caught:
        with oom_as_capacity_error(SPEC_EXAMPLE, budgets):
            raise OutOfMemoryError(OOM_TEXT)
    message = str(caught.value)
    assert message.startswith("ran out of GPU memory during preparation: Tried to allocate 2.00 GiB. GPU 0 "
                              "has a total capacity of 139.81 GiB of which 1.20 GiB is free")
    assert "it needs 68.3 GiB weights" in message
    assert "has 95.6 GiB free − 1.0 GiB headroom − 10.0 GiB reserve = 84.6 GiB." in message
    # 2.0 GiB more room than the failed run's 84.6 GiB: a reserve of 8 GiB
    assert options_of(caught.value)[0] == '[memory] reserve = "8G"'
    assert isinstance(caught.value.__cause__, OutOfMemoryError)


def test_other_errors_pass_through_the_oom_guard():
    with pytest.raises(ValueError):
        with oom_as_capacity_error(SPEC_EXAMPLE, [memory_budget(gpu(95.6), GiB)]):
            raise ValueError("not memory")


def test_oom_options_leave_room_for_the_failed_allocation():
    budgets = [memory_budget(gpu(95.6), GiB, reserve=gib(8))]
    error = capacity_error_from_oom(OutOfMemoryError(OOM_TEXT), SPEC_EXAMPLE, budgets)
    reserve = parse_size(re.search(r'reserve = "(.*?)"', str(error))[1], "[memory] reserve")
    room = memory_budget(gpu(95.6), GiB, reserve=reserve).available - SPEC_EXAMPLE.requirement().total
    before = budgets[0].available - SPEC_EXAMPLE.requirement().total
    assert reserve < gib(8) and room >= before + 2 * GiB


@pytest.mark.parametrize("alias", ["deepseek-v2-lite-chat", "deepseek-v4-flash", "qwen3-8b"])
def test_a_cache_every_rank_holds_whole_is_not_divided_between_ranks(alias):
    """One latent row (MLA) or one KV head (DeepSeek V4) read by every query head: each tensor-parallel rank
    keeps the whole cache, so its minimum pages do not shrink with the TP size, while the weights do; K/V
    heads split between ranks (Qwen3-8B) divide the pages too."""
    from flare.package.manifest import Plan
    from flare.prepare import plan_estimate
    from flare.recipes import registry
    from flare.recipes.base import kv_replicated

    recipe, checkpoint = registry.find_alias(alias)
    config = {"architectures": [checkpoint.architecture], **checkpoint.config}
    plan = Plan(dtype="bfloat16", page_size=recipe.page_size, prefill_chunk=recipe.prefill_chunk, compile=True,
                max_concurrency=4, decode_capacities=recipe.decode_capacities_for(4),
                max_model_len=checkpoint.context_length, memory_reserve_bytes=0, tensor_parallel=1)
    one = plan_estimate(config, plan, checkpoint.stored_bytes or GiB)
    whole, split = one.requirement(), replace(one, tensor_parallel=2).requirement()
    assert split.weights == -(-whole.weights // 2)
    replicated = alias != "qwen3-8b"
    assert kv_replicated(config) == replicated
    assert split.minimum_pages == (whole.minimum_pages if replicated else -(-whole.minimum_pages // 2))
