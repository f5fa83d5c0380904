"""One precedence rule for every setting (flag > configuration file > recipe or package) and one --gpus
grammar for every command, through the real command lines."""

from __future__ import annotations

import io
from contextlib import redirect_stdout
from pathlib import Path

import pytest

from flare.cli.flare import main as flare_main
from flare.cli.ignition import main as ignition_main
from flare.config import MAX_CONCURRENCY, PORT, load_config, resolve
from flare.errors import UsageError
from flare.memory import parse_gpus

GRAMMAR_ERROR = "write GPU indices as"


def _run(main, capsys, *argv) -> tuple[int, str, str]:
    out = io.StringIO()
    with redirect_stdout(out):
        code = main([str(arg) for arg in argv])
    return code, out.getvalue(), capsys.readouterr().err


def _write(path: Path, text: str) -> Path:
    path.write_text(text)
    return path


@pytest.fixture
def exported(stories260k, capsys) -> Path:
    code, out, _ = _run(ignition_main, capsys, "export", stories260k, "--max-concurrency", 4)
    assert code == 0
    return Path(out.strip().splitlines()[-1])


def _approval() -> list[str]:
    from flare.package.signing import config_dir_for, development_identity

    fingerprint = development_identity(config_dir_for(None)).public_key.fingerprint
    return ["--dangerously-approve-key", fingerprint, "--dangerously-accept-publisher", "local-development",
            "--offline"]


# -- an explicit zero is a value, refused alike by every command ---------------------------------------------


def test_export_refuses_max_concurrency_zero_before_resolving_the_model(capsys):
    # The repository does not exist: the flag is refused before any lookup would find that out.
    code, _, err = _run(ignition_main, capsys, "export", "Nobody/Nothing", "--max-concurrency", 0)
    assert code == 2
    assert "--max-concurrency must be a positive integer, not 0" in err


def test_run_refuses_max_concurrency_zero_with_the_same_message(capsys, tmp_path):
    code, _, err = _run(flare_main, capsys, "run", tmp_path / "no-such-package", "--max-concurrency", 0)
    assert code == 2
    assert "--max-concurrency must be a positive integer, not 0" in err


@pytest.mark.parametrize("argv", [
    ["ignition", "debug-serve", "Nobody/Nothing", "--max-concurrency", "0"],
    ["ignition", "bench", "Nobody/Nothing", "--max-concurrency", "0"],
])
def test_other_commands_refuse_max_concurrency_zero(capsys, argv):
    code, _, err = _run(ignition_main, capsys, *argv[1:])
    assert code == 2 and "--max-concurrency must be a positive integer, not 0" in err


def test_export_refuses_a_zero_prefill_chunk_instead_of_taking_the_recipes(capsys):
    code, _, err = _run(ignition_main, capsys, "export", "Nobody/Nothing", "--prefill-chunk-size", 0)
    assert code == 2 and "--prefill-chunk-size must be a positive multiple of 64, not 0" in err


def test_run_refuses_an_out_of_range_port_before_loading(capsys, tmp_path):
    code, _, err = _run(flare_main, capsys, "run", tmp_path / "no-such-package", "--port", 70000)
    assert code == 2 and "--port must be a port number from 1 through 65535, not 70000" in err


# -- flag > file > recipe, for export and serving alike --------------------------------------------------------


def test_export_concurrency_comes_from_the_flag_then_the_file_then_the_recipe(stories260k, capsys, tmp_path):
    from flare.package.reader import open_unverified

    def exported_concurrency(*argv) -> int:
        code, out, err = _run(ignition_main, capsys, "export", stories260k, *argv)
        assert code == 0, err
        return open_unverified(Path(out.strip().splitlines()[-1])).plan.max_concurrency

    config = _write(tmp_path / "config.toml", "[defaults]\nmax_concurrency = 6\n")
    model_config = _write(tmp_path / "model.toml", '[defaults]\nmax_concurrency = 6\n[models."stories260k"]\n'
                                                   "max_concurrency = 3\n")
    assert exported_concurrency("--config", config, "--max-concurrency", 2) == 2
    assert exported_concurrency("--config", config) == 6
    assert exported_concurrency("--config", model_config) == 3
    assert exported_concurrency() == 32                     # the llama recipe's default


def test_a_configured_value_out_of_range_is_named_where_it_was_written(stories260k, capsys, tmp_path):
    config = _write(tmp_path / "config.toml", "[defaults]\nmax_concurrency = 1000\n")
    code, _, err = _run(ignition_main, capsys, "export", stories260k, "--config", config)
    assert code == 2
    assert f"defaults.max_concurrency = 1000 in {config} is outside llama's range 1 through 256" in err


def test_resolve_names_where_each_value_came_from(tmp_path):
    config = load_config(_write(tmp_path / "config.toml", '[server]\nport = 9000\n[models."Tiny"]\n'
                                                          "max_concurrency = 2\n"))
    assert resolve(PORT, 8001, config, 8000).origin == "--port 8001"
    chosen = resolve(PORT, None, config, 8000, fallback_origin="the default")
    assert (chosen.value, chosen.source, chosen.origin) == (9000, "config", f"server.port = 9000 in {config.path}")
    assert resolve(PORT, None, load_config(None), 8000, fallback_origin="the default").origin == "the default 8000"
    chosen = resolve(MAX_CONCURRENCY, None, config, 8, names=("tiny",))
    assert (chosen.value, chosen.origin) == (2, f"models.Tiny.max_concurrency = 2 in {config.path}")
    with pytest.raises(UsageError, match="--max-concurrency must be a positive integer, not 0"):
        resolve(MAX_CONCURRENCY, 0, config, 8)


# -- one --gpus grammar --------------------------------------------------------------------------------------


def test_the_grammar_reads_lists_and_ranges():
    assert parse_gpus("0") == (0,) and parse_gpus("0,1") == (0, 1) and parse_gpus("0-3") == (0, 1, 2, 3)
    assert parse_gpus("0,2-3") == (0, 2, 3)
    with pytest.raises(UsageError, match=GRAMMAR_ERROR):
        parse_gpus("zero")


def test_gpus_0_1_is_accepted_by_export_and_debug_serve(stories260k, capsys):
    # No GPU here: the selection is read, then refused for what it names, never for how it is written.
    for command in ("export", "debug-serve"):
        code, _, err = _run(ignition_main, capsys, command, stories260k, "--gpus", "0-1")
        assert GRAMMAR_ERROR not in err and "unrecognized arguments" not in err, err
        assert code == 2 and "--gpus 0-1" in err


def test_gpus_0_1_is_accepted_by_bench(capsys):
    code, _, err = _run(ignition_main, capsys, "bench", "Nobody/Nothing", "--gpus", "0-1")
    assert code == 2 and "--gpus 0-1 selects 2 GPUs; ignition bench runs on one local GPU" in err


def test_gpus_0_1_is_accepted_by_flare_run_and_checked_against_the_package(exported, capsys):
    code, _, err = _run(flare_main, capsys, "run", exported, "--gpus", "0-1", *_approval())
    assert code == 2
    assert "--gpus 0-1 selects 2 GPUs; the model serves 1 local rank, one GPU each" in err


def test_gpus_0_is_refused_on_a_machine_without_a_gpu(exported, capsys, monkeypatch):
    from flare import memory

    monkeypatch.setattr(memory, "_read_nvml", lambda: [])
    code, _, err = _run(flare_main, capsys, "run", exported, "--gpus", "0", *_approval())
    assert code == 2 and "--gpus 0: no CUDA GPU is visible; omit --gpus to serve on the CPU" in err


def test_flare_run_narrows_cuda_visibility_to_the_selection(monkeypatch):
    import os

    from flare import memory

    monkeypatch.setattr(memory, "_read_nvml", lambda: [object()] * 4)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "4,5,6,7")
    memory.select_serving_gpus(parse_gpus("2"), ranks=1)
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "6"


@pytest.mark.parametrize("command", [["download"], ["models", "download"]])
def test_gpus_0_1_is_accepted_by_download(capsys, monkeypatch, command):
    from flare.package import download as download_module

    seen = {}

    def download(repository, options):
        seen["gpus"], seen["tensor_parallel"] = options.gpus, options.tensor_parallel
        return Path("/cache/entry")

    monkeypatch.setattr(download_module, "download", download)
    code, out, err = _run(flare_main, capsys, *command, "Org/Model", "--gpus", "0-1")
    assert code == 0, err
    assert seen == {"gpus": (0, 1), "tensor_parallel": 2} and out.strip() == "/cache/entry"


def test_export_refuses_a_publisher_key_it_would_not_use(capsys, tmp_path):
    code, _, err = _run(ignition_main, capsys, "export", "Nobody/Nothing", "--publisher-key", tmp_path / "p.json")
    assert code == 2 and "--publisher-key authenticates the cached version that --reuse-weights" in err
