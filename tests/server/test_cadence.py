"""The cadence bound a served package keeps: flag over [scheduler] max_step_ms over the default, the step
costs used only on the GPU they were measured on, a bound refused where it could not be kept, and the
startup report, stats and metrics saying which."""

from __future__ import annotations

import dataclasses
from pathlib import Path
from types import SimpleNamespace

import msgspec
import pytest

from flare import memory
from flare.config import Config, SchedulerConfig, load_config
from flare.engine.policy import SchedulerPolicy
from flare.engine.step_cost import StepCosts
from flare.errors import UsageError
from flare.server import cadence
from flare.server.cadence import serving_cadence, step_costs_of

COSTS = StepCosts("NVIDIA H200", 1024, (1, 16), (0, 512, 1024), ((5.0, 10.0, 15.0), (8.0, 14.0, 20.0)))


@pytest.fixture
def on_gpu(monkeypatch):
    """Serve on a GPU of the given name (NVML's answer)."""
    def serve_on(name: str | None):
        device = (memory.DeviceMemory(0, name, free=1 << 34, total=1 << 34) if name is not None
                  else memory.DeviceMemory(0, "host memory", free=1 << 34, total=1 << 34, host=True))
        monkeypatch.setattr(cadence, "read_device_memory", lambda: [device])
    return serve_on


def configured(value: float | None) -> Config:
    return Config(path=Path("config.toml"), scheduler=SchedulerConfig(max_step_ms=value))


def test_the_flag_overrides_the_file_which_overrides_the_default(on_gpu):
    on_gpu("NVIDIA H200")
    chosen = serving_cadence(None, COSTS, 16, 2048, None, None)
    assert chosen.policy.max_step_ms == 16.0 and chosen.policy.step_costs == COSTS
    assert chosen.note == ("steps beside decoding requests kept within 16 ms (the default, 2 × the 16-request "
                           "decode step; step costs measured at export on NVIDIA H200)")
    from_file = serving_cadence(None, COSTS, 16, 2048, None, configured(12.5))
    assert from_file.policy.max_step_ms == 12.5
    assert "within 12.5 ms (scheduler.max_step_ms = 12.5 in config.toml;" in from_file.note
    from_flag = serving_cadence(SchedulerPolicy(terminal_value=3), COSTS, 16, 2048, 9.0, configured(12.5))
    assert from_flag.policy.max_step_ms == 9.0 and from_flag.policy.terminal_value == 3
    assert "(--scheduler-max-step-ms 9.0;" in from_flag.note


def test_without_usable_step_costs_balanced_carries_one_chunk_and_refuses_a_bound(on_gpu):
    for name, costs, why in (("NVIDIA H200", None, "the package records no step costs (it was exported without "
                                                   "a GPU)"),
                             ("NVIDIA H100 80GB HBM3", COSTS, "the step costs were measured on NVIDIA H200, and "
                                                             "this GPU is NVIDIA H100 80GB HBM3"),
                             (None, COSTS, "serving on the CPU, and the step costs were measured on NVIDIA H200")):
        on_gpu(name)
        chosen = serving_cadence(None, costs, 16, 2048, None, None)
        assert chosen.policy == SchedulerPolicy() and chosen.policy.max_step_ms is None
        assert chosen.note == f"one prefill chunk (2,048 tokens) beside decoding requests: {why}"
        with pytest.raises(UsageError, match=r"--scheduler-max-step-ms 20.0: a cadence bound needs the step costs "
                                             r"measured at export, and " + why.replace("(", r"\(").replace(")", r"\)")):
            serving_cadence(None, costs, 16, 2048, 20.0, None)
    on_gpu("NVIDIA H200")
    debug = serving_cadence(None, None, 16, 2048, None, None, packaged=False)
    assert debug.note.endswith("a checkpoint served without a package has no step costs (export measures them)")


def test_throughput_keeps_no_bound_and_refuses_one(on_gpu):
    on_gpu("NVIDIA H200")
    chosen = serving_cadence(SchedulerPolicy("throughput"), COSTS, 16, 2048, None, None)
    assert chosen.policy == SchedulerPolicy("throughput")
    assert chosen.note == "no cadence bound (prompt bursts fill the step)"
    with pytest.raises(UsageError, match=r"scheduler.max_step_ms = 20.0 in config.toml: a cadence bound applies "
                                         r"to --scheduler-policy balanced"):
        serving_cadence(SchedulerPolicy("throughput"), COSTS, 16, 2048, None, configured(20.0))


def test_the_config_key_is_checked_when_the_file_is_read(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[scheduler]\nmax_step_ms = 25\n")
    assert load_config(path).scheduler.max_step_ms == 25.0
    for bad in ("0", "-3", '"fast"', "nan"):
        path.write_text(f"[scheduler]\nmax_step_ms = {bad}\n")
        with pytest.raises(UsageError, match="scheduler.max_step_ms"):
            load_config(path)
    path.write_text("[scheduler]\nmax_step = 25\n")
    with pytest.raises(UsageError, match=r"unknown key scheduler.max_step; \[scheduler\] accepts max_step_ms"):
        load_config(path)


def test_a_bad_flag_is_refused_before_anything_loads(tmp_path):
    import subprocess

    from tests.server.conftest import cli_command, cli_env

    for value in ("0", "nan", "soon"):
        done = subprocess.run(cli_command("flare", "run", str(tmp_path / "missing.safetensors"),
                                          "--scheduler-max-step-ms", value),
                              env=cli_env(tmp_path), capture_output=True, text=True, timeout=60)
        assert done.returncode == 2 and "--scheduler-max-step-ms" in done.stderr, done.stderr


def test_the_plan_records_the_table_and_a_package_without_it_reads_as_none():
    from flare.package.manifest import Manifest, StepCostTable
    from flare.prepare import step_cost_table

    fixture = Path(__file__).resolve().parents[1] / "fixtures" / "manifests" / "format2-development.json"
    old = Manifest.from_json(fixture.read_text())
    assert old.plan.step_costs is None and step_costs_of(old.plan) is None
    assert "step_costs" not in old.to_json()                       # absent, so old signatures still verify
    new = msgspec.structs.replace(old, plan=msgspec.structs.replace(old.plan, step_costs=step_cost_table(COSTS)))
    text = new.to_json()
    assert Manifest.from_json(text) == new and Manifest.from_json(text).to_json() == text
    assert step_costs_of(Manifest.from_json(text).plan) == COSTS
    with pytest.raises(ValueError, match="2 rows of 3 times"):
        StepCostTable(device="GPU", decode_context=1024, decode_batches=(1, 16), prompt_tokens=(0, 512, 1024),
                      milliseconds=((5.0, 10.0, 15.0),))
    broken = text.replace('"prompt_tokens":[0,512,1024]', '"prompt_tokens":[512,0,1024]')
    with pytest.raises(Exception, match="prompt_tokens"):
        Manifest.from_json(broken)
    assert "long_context" not in text                               # a table timed at one context: as before
    longer = dataclasses.replace(COSTS, long_context=4096, long_decode_ms=(5.4, 9.1))
    table = step_cost_table(longer)
    assert '"long_context":4096' in msgspec.json.encode(table).decode()
    plan = msgspec.structs.replace(old.plan, step_costs=table)
    assert step_costs_of(Manifest.from_json(msgspec.structs.replace(old, plan=plan).to_json()).plan) == longer
    with pytest.raises(ValueError, match="long_context"):
        StepCostTable(device="GPU", decode_context=1024, decode_batches=(1, 16), prompt_tokens=(0, 512, 1024),
                      milliseconds=((5.0, 10.0, 15.0), (8.0, 14.0, 20.0)), long_context=4096, long_decode_ms=(5.4,))


def test_the_startup_report_says_the_bound_and_the_metrics_show_it(on_gpu):
    from flare.engine.config import EngineConfig
    from flare.engine.stats import EngineStats
    from flare.server.launch import startup_report
    from flare.server.metrics import ServerMetrics

    on_gpu("NVIDIA H200")
    chosen = serving_cadence(None, COSTS, 16, 2048, 12.0, None)
    config = EngineConfig(max_concurrency=16, num_pages=4096, max_model_len=4096, prefill_chunk=2048,
                          max_num_batched_tokens=4112, scheduler_policy=chosen.policy)
    pool = SimpleNamespace(floor=None, bytes=1 << 30, tokens=65536, pages=4096, page_size=16)
    model = SimpleNamespace(canonical_id="org/model", weight_bytes=16 << 30, kv_cache_dtype="auto")
    settings = SimpleNamespace(served_names=("model",), api_key=None)
    lines = startup_report(model, settings, pool, config, "http://127.0.0.1:8000", "cuda", chosen.note)
    assert "  cadence: steps beside decoding requests kept within 12 ms (--scheduler-max-step-ms 12.0; step " \
           "costs measured at export on NVIDIA H200)" in lines
    stats = EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=1, num_preemptions=0,
                        max_step_ms=12.0)
    text = ServerMetrics(lambda: stats).render().decode()
    assert "flare_scheduler_max_step_ms 12.0" in text
