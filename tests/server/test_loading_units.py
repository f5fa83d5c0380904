"""Pieces of `flare run` loading: stage display, listener addresses, memory limits, settings precedence."""

from __future__ import annotations

import io
import socket

from pathlib import Path

import pytest

from flare.errors import UsageError
from flare.server.kv_sizing import serving_kv_pool
from flare.server.launch import ListenerOptions, api_key, listener_address, serving_concurrency, served_names
from flare.server.listener import reserve
from flare.server.served_model import ServedModel
from flare.ui.banner import show_banner
from flare.ui.stages import StageReporter, bar


class Terminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_redirected_stages_are_plain_start_and_finish_lines():
    out = io.StringIO()
    stages = StageReporter(out)
    with stages.stage("Load weights", total=100) as stage:
        stage.advance(100)
        stage.note("1 MiB")
    with pytest.raises(RuntimeError):
        with stages.stage("Allocate caches"):
            raise RuntimeError("out of pages")
    lines = out.getvalue().splitlines()
    assert lines[0] == "Load weights ..."
    assert lines[1].startswith("Load weights: OK (") and lines[1].endswith(") 1 MiB")
    assert lines[3].startswith("Allocate caches: FAILED (")
    assert "\x1b" not in out.getvalue()
    assert not show_banner(out)


def test_terminal_stages_show_a_ten_cell_bar_and_status(monkeypatch):
    monkeypatch.delenv("TERM", raising=False)
    out = Terminal()
    stages = StageReporter(out)
    with stages.stage("Verify package"):
        pass
    final = out.getvalue().rsplit("\r\x1b[2K", 1)[-1]
    assert "Verify package" in final and "OK" in final and final.endswith("s\n")
    assert bar(0.55, styled=False) == "[█████▌░░░░]"
    assert bar(1.0, styled=False) == "[██████████]"
    assert show_banner(out)


def test_listener_accepts_numeric_ipv4_and_ipv6_only():
    listener = reserve("127.0.0.1", 0)
    listener.close()
    if socket.has_ipv6:
        try:
            listener = reserve("::1", 0)
        except UsageError:
            pass                                     # no IPv6 loopback on this host
        else:
            assert listener.socket.family == socket.AF_INET6
            assert listener.url == "http://[::1]:0"
            listener.close()
    with pytest.raises(UsageError, match="numeric IPv4 or IPv6"):
        reserve("localhost", 0)


def test_port_in_use_is_a_clear_error():
    taken = reserve("127.0.0.1", 0)
    taken.listen()
    try:
        with pytest.raises(UsageError, match="choose another --port"):
            reserve("127.0.0.1", taken.socket.getsockname()[1])
    finally:
        taken.close()


def test_a_port_outside_the_range_is_refused_by_the_setting_it_came_from(tmp_path):
    from flare.config import load_config

    assert listener_address(ListenerOptions(port=8001), None) == ("127.0.0.1", 8001)
    for port in (0, 70000, -1):
        with pytest.raises(UsageError, match=f"--port must be a port number from 1 through 65535, not {port}"):
            listener_address(ListenerOptions(port=port), None)
    path = tmp_path / "config.toml"
    path.write_text("[server]\nhost = \"::1\"\nport = 8002\n")
    assert listener_address(ListenerOptions(), load_config(path)) == ("::1", 8002)
    assert listener_address(ListenerOptions(port=8003), load_config(path)) == ("::1", 8003)      # the flag wins
    path.write_text("[server]\nport = 65536\n")
    with pytest.raises(UsageError, match="server.port must be a port number from 1 through 65535, not 65536"):
        load_config(path)


def _model(**changes) -> ServedModel:
    values = dict(canonical_id="Tiny-1", served_names=("tiny",), hf_config={}, frontend_dir=None, dtype="float32",
                  page_size=16, prefill_chunk=64, prepared_concurrency=8, max_model_len=512, weight_bytes=1,
                  iter_weights=lambda: iter(()))
    values.update(changes)
    return ServedModel(**values)


def Config(configured=None, key=None):
    """A configuration file that sets [defaults] max_concurrency and [server] api_key (None: unset)."""
    from flare.config import Config as FileConfig, DefaultsConfig, ServerConfig

    return FileConfig(path=Path("config.toml"), defaults=DefaultsConfig(max_concurrency=configured),
                      server=ServerConfig(api_key=key))


def test_concurrency_precedence_and_the_prepared_capacity():
    assert serving_concurrency(None, None, _model()) == 8
    assert serving_concurrency(None, Config(4), _model()) == 4
    assert serving_concurrency(2, Config(4), _model()) == 2
    with pytest.raises(UsageError, match="--max-concurrency 16 exceeds the package's prepared concurrency 8"):
        serving_concurrency(16, None, _model())


def test_served_names_and_api_key_precedence(tmp_path):
    assert served_names(ListenerOptions(), _model()) == ("tiny",)
    assert served_names(ListenerOptions(served_model_name="mine"), _model()) == ("mine",)
    with pytest.raises(UsageError):
        served_names(ListenerOptions(served_model_name="  "), _model())
    assert api_key(ListenerOptions(), Config(key="from-config")) == "from-config"
    empty = tmp_path / "empty"
    empty.write_text("\n")
    assert api_key(ListenerOptions(api_key_file=empty), Config(key="from-config")) is None
    keyed = tmp_path / "key"
    keyed.write_text("secret\n")
    assert api_key(ListenerOptions(api_key_file=keyed), Config(key="from-config")) == "secret"
    with pytest.raises(UsageError, match="cannot read"):
        api_key(ListenerOptions(api_key_file=tmp_path / "missing"), None)


def test_kv_pool_follows_the_kv_cache_limit(stories260k):
    import json

    hf_config = json.loads((stories260k / "config.json").read_text())
    model = _model(hf_config=hf_config)
    context = serving_kv_pool(model, 8, "context", None, 0)
    assert context.tokens == 512 and context.limited_by == "context ceiling"
    per_request = serving_kv_pool(model, 8, "concurrency", None, 0)
    assert per_request.tokens == 8 * 512
    assert per_request.bytes == 8 * 512 * 2 * 5 * 4 * 8 * 4       # K and V, 5 layers, 4 heads of 8, fp32
    with pytest.raises(UsageError):
        serving_kv_pool(model, 8, "memory", "lots", 0)


def test_serving_engine_config_carries_the_policy_the_concurrency_and_the_pool_limit(stories260k):
    import json

    from flare.engine.policy import SchedulerPolicy
    from flare.server.kv_sizing import serving_engine_config

    model = _model(hf_config=json.loads((stories260k / "config.json").read_text()))
    pool = serving_kv_pool(model, 4, "context", None, 0)
    policy = SchedulerPolicy("throughput", terminal_value=10, terminal_age_price=0)
    config = serving_engine_config(model, 4, pool, policy)
    assert config.scheduler_policy == policy and config.max_concurrency == 4
    assert config.prepared_concurrency == 8 and config.kv_pool_limited_by == "context"
    # Room above one chunk is what lets throughput carry more prompt work than balanced.
    assert config.max_num_batched_tokens > config.prefill_chunk
    budget, chunk = config.max_num_batched_tokens, config.prefill_chunk
    assert policy.prefill_cap(budget, chunk, num_decoding=1) > \
        SchedulerPolicy("balanced").prefill_cap(budget, chunk, num_decoding=1)
    assert serving_engine_config(model, 8, serving_kv_pool(model, 8, "concurrency", None, 0)).kv_pool_limited_by \
        == "concurrency"


@pytest.mark.parametrize("flag, value", [("--scheduler-policy", "fastest"), ("--scheduler-terminal-value", "-1"),
                                         ("--scheduler-terminal-age-price", "lots")])
def test_bad_scheduler_flags_are_usage_errors_naming_the_flag(tmp_path, flag, value):
    import subprocess

    from tests.server.conftest import cli_command, cli_env

    done = subprocess.run(cli_command("flare", "run", str(tmp_path / "missing.safetensors"), flag, value),
                          env=cli_env(tmp_path), capture_output=True, text=True, timeout=60)
    assert done.returncode == 2
    assert flag in done.stderr


def test_memory_mode_leaves_room_for_graphs_scratch_and_live_state(stories260k, monkeypatch):
    """On a GPU, pages get what is free after the weights, the step's activations and logits, every
    request's live state and the headroom: sizing pages from weights alone ran a GPU out of memory."""
    import json

    from flare import memory
    from flare.recipes.base import graph_and_scratch_bytes, live_state_bytes_per_request
    from flare.server import kv_sizing

    hf_config = json.loads((stories260k / "config.json").read_text())
    model = _model(hf_config=hf_config)
    free = 8 * 1024 ** 3
    monkeypatch.setattr(kv_sizing, "read_device_memory",
                        lambda: [memory.DeviceMemory(0, "test GPU", free=free, total=free)])
    pool = serving_kv_pool(model, 8, "memory", None, 0)
    step_tokens = kv_sizing.step_token_budget(model.prefill_chunk, 8)
    before_pages = (model.weight_bytes + graph_and_scratch_bytes(hf_config, 8, step_tokens - 8)
                    + 8 * live_state_bytes_per_request(hf_config, model.page_size, model.max_model_len)
                    + memory.engine_headroom("serving"))
    assert pool.limited_by == "memory"
    assert before_pages + pool.bytes <= free < before_pages + pool.bytes + 2 * pool.bytes // pool.tokens * 16


def test_the_concurrency_export_accepts_also_serves_on_that_gpu(stories260k, monkeypatch):
    """Export refuses what serving would refuse on the same free memory: both count the same graphs,
    scratch, live state, pages and headroom (a package prepared at 122 once could not start)."""
    import json

    from flare import memory, prepare
    from flare.errors import CapacityError
    from flare.package import weights as wt
    from flare.package.manifest import Plan
    from flare.server import kv_sizing

    hf_config = json.loads((stories260k / "config.json").read_text())
    gpu = [memory.DeviceMemory(0, "test GPU", free=2 * 1024 ** 3 + 700 * 1024 ** 2, total=4 * 1024 ** 3)]
    monkeypatch.setattr(memory, "read_device_memory", lambda: gpu)
    monkeypatch.setattr(kv_sizing, "read_device_memory", lambda: gpu)
    recipe = prepare.RecipeFacts(name="llama", model_id="stories260k", max_concurrency=256)
    weight_bytes = wt.serving_bytes(wt.checkpoint_tensor_files(stories260k), "float32")

    def exports(concurrency: int) -> bool:
        plan = Plan(dtype="float32", page_size=16, prefill_chunk=256, compile=True, max_concurrency=concurrency,
                    decode_capacities=(concurrency,), max_model_len=hf_config["max_position_embeddings"],
                    memory_reserve_bytes=0, tensor_parallel=1)
        try:
            prepare._fit_memory(stories260k, hf_config, plan, recipe, None, "cuda")
        except CapacityError:
            return False
        return True

    accepted = [concurrency for concurrency in range(1, 257) if exports(concurrency)]
    assert 1 < len(accepted) < 256 and accepted == list(range(1, len(accepted) + 1))
    served = _model(hf_config=hf_config, weight_bytes=weight_bytes, prefill_chunk=256, prepared_concurrency=256,
                    max_model_len=hf_config["max_position_embeddings"])
    assert serving_kv_pool(served, accepted[-1], "memory", None, 0).limited_by == "memory"


def test_an_engine_that_runs_out_of_gpu_memory_at_startup_says_what_to_change():
    import torch

    from flare.engine.messages import failure
    from flare.engine_client.connection import EngineStartError
    from flare.errors import CapacityError, PreparationError
    from flare.server.engine_start import _startup_error

    out_of_memory = torch.OutOfMemoryError(
        "CUDA out of memory. Tried to allocate 3.90 GiB. GPU 0 has a total capacity of 139.80 GiB of which "
        "3.33 GiB is free. Including non-PyTorch memory, this process has 136.47 GiB memory in use.")
    error = _startup_error(EngineStartError(failure(out_of_memory)))
    assert isinstance(error, CapacityError) and error.exit_code == 4
    assert "Tried to allocate 3.90 GiB. GPU 0 has a total capacity of 139.80 GiB of which 3.33 GiB is free." \
        in str(error)
    assert "--memory-limit -4G" in str(error) and "--max-concurrency" in str(error)
    other = _startup_error(EngineStartError(failure(ValueError("bad weights"))))
    assert isinstance(other, PreparationError) and "bad weights" in str(other)


def test_a_user_error_in_the_engine_core_keeps_its_kind_and_exit_code():
    """Errors cross from the core process classified by type: a usage error there is a usage error here."""
    from flare.engine.messages import decode_event, encode, failure
    from flare.engine_client.connection import EngineStartError
    from flare.errors import UsageError
    from flare.models.errors import WeightError
    from flare.server.engine_start import _startup_error

    sent = decode_event(encode(failure(UsageError("engine setting num_pages must be at least 1, got 0"))))
    error = _startup_error(EngineStartError(sent))
    assert type(error) is UsageError and error.exit_code == 2
    assert str(error) == "engine setting num_pages must be at least 1, got 0"
    damaged = _startup_error(EngineStartError(failure(WeightError("tensor model.norm.weight is missing"))))
    assert damaged.exit_code == 5 and "model.norm.weight is missing" in str(damaged)
