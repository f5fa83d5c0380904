"""Kernels Triton builds while serving are counted with their seconds (a build stalls the step that
launched it), through Triton's compile hooks, in front of any hook already set."""

from __future__ import annotations

import io

import pytest

from flare.engine.kernel_builds import KernelBuilds

knobs = pytest.importorskip("triton").knobs


@pytest.fixture
def hooks():
    runtime = knobs.runtime
    saved = runtime.jit_cache_hook, runtime.jit_post_compile_hook
    yield runtime
    runtime.jit_cache_hook, runtime.jit_post_compile_hook = saved


def test_a_build_is_counted_with_its_seconds_and_earlier_hooks_still_run(hooks, monkeypatch):
    seen = []
    hooks.jit_cache_hook = lambda **kwargs: seen.append(("before", kwargs["key"]))
    hooks.jit_post_compile_hook = lambda **kwargs: seen.append(("after", kwargs["key"]))
    clock = iter([10.0, 10.75])
    monkeypatch.setattr("flare.engine.kernel_builds.time.perf_counter", lambda: next(clock))
    log = io.StringIO()
    builds = KernelBuilds(report_to=log)
    assert builds.watch() and builds.watching
    assert not hooks.jit_cache_hook(key=("kernel", 1))          # the build goes ahead
    hooks.jit_post_compile_hook(key=("kernel", 1), repr="_decode_kernel[num_warps=4](seq_lens: *i32, n: i32)")
    assert (builds.count, builds.seconds) == (1, 0.75)
    assert builds.recent == ["_decode_kernel[num_warps=4](seq_lens: *i32, n: i32)"]
    assert "(0.75 s; the step waited): _decode_kernel[num_warps=4](seq_lens: *i32, n: i32)" in log.getvalue()
    assert seen == [("before", ("kernel", 1)), ("after", ("kernel", 1))]


def test_an_earlier_hook_that_skips_a_build_is_obeyed(hooks):
    hooks.jit_cache_hook = lambda **kwargs: True
    hooks.jit_post_compile_hook = None
    builds = KernelBuilds()
    builds.watch()
    assert hooks.jit_cache_hook(key=["unhashable"]) is True
    assert builds.count == 0


def test_the_engine_reports_its_builds(hooks):
    from flare.engine.config import EngineConfig
    from flare.engine.core import EngineCore
    from fake_runner import FakeRunner

    core = EngineCore(EngineConfig(max_concurrency=2, page_size=16, num_pages=8, max_model_len=64), FakeRunner(16))
    assert (core.stats().kernel_builds, core.stats().kernel_build_seconds) == (0, 0.0)
    core.kernel_builds.watch()
    hooks.jit_cache_hook(key="k")
    hooks.jit_post_compile_hook(key="k", repr="k[num_warps=8]()")
    assert core.stats().kernel_builds == 1
    assert core.stats().kernel_builds_recent == ("k[num_warps=8]()",)


def test_a_gpu_core_warms_its_eager_kernels_before_serving_and_forgets_the_warm_up():
    """The warm-up's requests run to the end, leave no page held, and move no counter a user reads; a core
    off the GPU skips it (its kernels are torch's, loaded already)."""
    import types

    from flare.engine.config import EngineConfig
    from flare.engine.core import EngineCore
    from flare.engine.warm_up import warm_up_kernels
    from fake_runner import FakeRunner

    config = EngineConfig(max_concurrency=2, page_size=16, num_pages=64, max_model_len=256, prefill_chunk=64)
    cpu_core = EngineCore(config, FakeRunner(16))
    assert not warm_up_kernels(cpu_core)
    runner = FakeRunner(16)
    runner.device = types.SimpleNamespace(type="cuda")
    core = EngineCore(config, runner)
    assert warm_up_kernels(core)
    stats = core.stats(check_integrity=True)
    assert not core.has_unfinished() and not core.requests
    assert (stats.num_running, stats.kv_pages_used, stats.num_computed_tokens) == (0, 0, 0)
    assert (stats.prefix_cache_hit_tokens, stats.prefix_cache_miss_tokens) == (0, 0)
    assert stats.page_integrity == "ok"
