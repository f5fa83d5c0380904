"""Command-line conventions (spec sections 2 and 3.2) and recipe help.

The conventions are tested on a small command declared in this module (the real commands belong to
their own components); exit codes, stderr and the absence of torch are tested in real subprocesses.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from flare.cli.framework import Command, run_cli
from flare.config import Config
from flare.errors import CapacityError
from flare.recipes import registry

HEAVY_MODULES = ("torch", "transformers", "huggingface_hub", "safetensors", "triton", "tokenizers")
RUN_IGNITION = ("import sys\n"
                "from flare.cli.ignition import main\n"
                "code = main(sys.argv[1:])\n"
                f"heavy = sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r})\n"
                "print('HEAVY=' + ','.join(heavy), file=sys.stderr)\n"
                "sys.exit(code)\n")
RUN_FLARE = RUN_IGNITION.replace("flare.cli.ignition", "flare.cli.flare")


def ignition(*args):
    return subprocess.run([sys.executable, "-c", RUN_IGNITION, *args], capture_output=True, text=True)


def flare(*args):
    return subprocess.run([sys.executable, "-c", RUN_FLARE, *args], capture_output=True, text=True)


def run_test_program(*args):
    """This module's test command behind the real framework, in a fresh interpreter."""
    code = (f"import sys; sys.path.insert(0, {os.path.dirname(__file__)!r})\n"
            "from flare.cli.framework import run_cli\n"
            "from test_cli_conventions import COMMANDS\n"
            "sys.exit(run_cli('prog', 'a test program', COMMANDS, sys.argv[1:]))\n")
    return subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True)


def heavy_modules(result) -> str:
    return [line for line in result.stderr.splitlines() if line.startswith("HEAVY=")][-1][len("HEAVY="):]


# ---------------------------------------------------------------------------------------------------
# A command declared here, to exercise the framework in-process.

CALLS: list = []


def configure(parser):
    parser.add_argument("package")
    parser.add_argument("--port", type=int, default=8000)
    parser.add_argument("--memory-limit")
    parser.add_argument("--verbose", action="store_true")


def run(args):
    CALLS.append((args, dict(os.environ)))
    if args.package == "too-big":
        raise CapacityError("needs 2 GPUs with 95 GiB; 1 selected; use --gpus 0-1")
    return 0


def _configure_cache(parser):
    actions = parser.add_subparsers(dest="action", metavar="ACTION", required=True)
    remove = actions.add_parser("remove", help="remove a version", description="remove a version")
    remove.add_argument("version")
    remove.add_argument("--clear-default", action="store_true")


# A command with its own subcommands (as `flare models list`), registered as a module of its own.
NESTED = types.ModuleType("cli_conventions_nested_command")
NESTED.configure = _configure_cache
NESTED.run = lambda args: CALLS.append((args, {})) or 0
sys.modules[NESTED.__name__] = NESTED

COMMANDS = (Command("serve", "serve a package", __name__),
            Command("cache", "manage the cache", NESTED.__name__))


@pytest.fixture
def cli(monkeypatch):
    """Run the test command in-process; restores every environment variable it changes."""
    saved = dict(os.environ)
    CALLS.clear()

    def invoke(*argv):
        return run_cli("prog", "a test program", COMMANDS, list(argv))

    yield invoke
    os.environ.clear()
    os.environ.update(saved)


@pytest.mark.parametrize("argv", [
    ("serve", "pkg", "--port", "9000"),
    ("serve", "--port", "9000", "pkg"),
    ("serve", "--port=9000", "pkg"),
    ("serve", "pkg", "--port=9000"),
])
def test_options_go_before_or_after_positionals_in_either_spelling(cli, argv):
    assert cli(*argv) == 0
    args, _ = CALLS[-1]
    assert args.package == "pkg" and args.port == 9000


@pytest.mark.parametrize("argv", [
    ("serve", "pkg", "--memory-limit", "-30g"),
    ("serve", "pkg", "--memory-limit=-30g"),
    ("serve", "--memory-limit", "-30g", "pkg"),
])
def test_values_starting_with_a_dash_are_accepted(cli, argv):
    assert cli(*argv) == 0
    assert CALLS[-1][0].memory_limit == "-30g"


def test_run_receives_the_configuration_and_the_library_environment(cli, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text('[paths]\nkernel_cache = "/data/kernels"\n[hub]\nendpoint = "http://127.0.0.1:9"\n')
    os.environ["HF_TOKEN"] = "hf_stray"
    assert cli("serve", "pkg", "--config", str(config)) == 0
    args, environment = CALLS[-1]
    assert isinstance(args.configuration, Config) and args.configuration.path == config
    assert environment["HF_ENDPOINT"] == "http://127.0.0.1:9"
    assert environment["TRITON_CACHE_DIR"].startswith("/data/kernels")
    assert "HF_TOKEN" not in environment


@pytest.mark.parametrize("argv", [
    ("serve", "--help"), ("serve", "-h"), ("help", "serve"), ("serve", "pkg", "--port", "9", "--help"),
    ("serve", "--port", "not-a-number", "--help"), ("serve", "--config", "/missing.toml", "-h"),
])
def test_help_anywhere_prints_the_command_help_and_runs_nothing(cli, capsys, argv):
    assert cli(*argv) == 0
    assert CALLS == []
    assert "usage: prog serve" in capsys.readouterr().out


@pytest.mark.parametrize("argv", [("cache", "remove", "--help"), ("help", "cache", "remove"),
                                  ("cache", "remove", "model@1", "--clear-default", "-h")])
def test_help_of_a_nested_command_describes_that_command(cli, capsys, argv):
    assert cli(*argv) == 0
    out = capsys.readouterr().out
    assert "usage: prog cache remove" in out and "--clear-default" in out
    assert CALLS == []


def test_nested_commands_parse_and_run(cli):
    assert cli("cache", "remove", "--clear-default", "model@1") == 0
    args, _ = CALLS[-1]
    assert args.action == "remove" and args.version == "model@1" and args.clear_default


def test_help_of_the_program_lists_commands(cli, capsys):
    assert cli("help") == 0
    assert "serve a package" in capsys.readouterr().out
    assert cli() == 0
    assert "usage: prog" in capsys.readouterr().out


def test_usage_errors_exit_2_on_stderr_with_the_command_usage(cli, capsys):
    assert cli("serve", "pkg", "--bogus") == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert "usage: prog serve" in captured.err and "--bogus" in captured.err
    assert cli("serve", "pkg", "--port", "x") == 2
    assert "--port" in capsys.readouterr().err
    assert cli("serve") == 2                               # missing positional
    assert cli("srve", "pkg") == 2                         # one name per command: no abbreviation
    assert cli("serve", "pkg", "--po", "1") == 2           # no abbreviated options
    assert CALLS == []


def test_flare_errors_print_error_and_exit_with_their_code(cli, capsys):
    assert cli("serve", "too-big") == 4
    assert capsys.readouterr().err == "error: needs 2 GPUs with 95 GiB; 1 selected; use --gpus 0-1\n"


def test_a_broken_configuration_is_a_usage_error_before_the_command_runs(cli, capsys, tmp_path):
    config = tmp_path / "config.toml"
    config.write_text("[server]\nport = -1\n")
    assert cli("serve", "pkg", "--config", str(config)) == 2
    assert "server.port" in capsys.readouterr().err
    assert CALLS == []


# ---------------------------------------------------------------------------------------------------
# The real entry points, in subprocesses.


def test_ignition_help_lists_every_alias_with_tp_sizes_and_draft_counts_without_torch():
    result = ignition("--help")
    assert result.returncode == 0, result.stderr
    lines = result.stdout.splitlines()
    for recipe, checkpoint in registry.all_checkpoints():
        row = next(line for line in lines if line.split()[:1] == [checkpoint.alias])
        sizes = ",".join(map(str, recipe.tensor_parallel_sizes_for(checkpoint.config)))
        speculation = recipe.speculation_for(checkpoint)
        drafts = f"{speculation.default_draft_tokens}/{speculation.max_draft_tokens}"
        assert row.split()[1:3] == [sizes, drafts]
    assert heavy_modules(result) == ""


@pytest.mark.parametrize("command", ["export", "debug-serve", "bench"])
def test_preparation_command_help_lists_aliases_too(command):
    result = ignition(command, "--help")
    assert result.returncode == 0
    assert all(alias in result.stdout for alias in registry.supported_aliases())


@pytest.mark.parametrize("argv", [
    ("export", "qwen3-8b", "--help"),
    ("export", "--help", "QWEN3-8B"),
    ("debug-serve", "Qwen/Qwen3-8B", "-h"),
    ("bench", "qwen/qwen3-8b@b968826d9c46dd6066d109eabc6255188de91218", "--help"),
    ("help", "export", "qwen3-8b"),
])
def test_model_before_or_after_help_prints_the_recipe_defaults_and_limits(argv):
    recipe, checkpoint = registry.find_alias("qwen3-8b")
    result = ignition(*argv)
    assert result.returncode == 0, result.stderr
    out = result.stdout
    concurrency = recipe.concurrency
    assert f"{concurrency.minimum} through {concurrency.maximum}, default {concurrency.default}" in out
    assert checkpoint.revision in out
    assert f"{recipe.prefill_chunk:,} tokens" in out
    assert f"{recipe.page_size} tokens" in out
    assert f"{checkpoint.context_length:,} tokens" in out
    assert ", ".join(map(str, recipe.tensor_parallel_sizes_for(checkpoint.config))) in out
    assert ",".join(map(str, recipe.decode_capacities_for(concurrency.maximum))) in out
    assert f"temperature {recipe.sampling.temperature:g}" in out and "request ranges" in out
    speculation = recipe.speculation_for(checkpoint)
    assert (f"draft tokens default {speculation.default_draft_tokens}, maximum {speculation.max_draft_tokens}"
            in out and "--history-drafts" in out)
    assert heavy_modules(result) == ""


def test_recipe_help_shows_a_checkpoint_specific_card():
    result = ignition("export", "qwen2.5-0.5b-instruct", "--help")
    recipe, checkpoint = registry.find_alias("qwen2.5-0.5b-instruct")
    assert f"repetition_penalty {recipe.sampling_for(checkpoint).repetition_penalty:g}" in result.stdout
    assert "tensor parallel    1, 2 " in result.stdout


def test_unknown_alias_with_help_shows_ordinary_help_and_a_suggestion():
    result = ignition("export", "qwen3-9b", "--help")
    assert result.returncode == 0
    assert "model aliases:" in result.stdout
    assert "did you mean qwen3-8b?" in result.stderr


def test_help_reads_no_configuration_file(isolated_home):
    broken = isolated_home / ".config" / "flare" / "config.toml"
    broken.parent.mkdir(parents=True)
    broken.write_text("this is not toml [")
    assert ignition("export", "--help").returncode == 0
    assert ignition("export", "qwen3-8b", "--config", str(isolated_home / "missing.toml"), "--help").returncode == 0
    assert flare("run", "--help").returncode == 0
    result = run_test_program("serve", "pkg")            # without --help the broken file is an error
    assert result.returncode == 2
    assert "not valid TOML" in result.stderr and result.stdout == ""


def test_flare_help_run_equals_run_help():
    assert flare("help", "run").stdout == flare("run", "--help").stdout == flare("run", "-h").stdout
    result = flare("run", "pkg", "--help")
    assert result.returncode == 0 and "usage: flare run" in result.stdout
    assert heavy_modules(result) == ""


def test_flare_usage_errors_go_to_stderr_with_status_2():
    result = flare("frobnicate")
    assert result.returncode == 2
    assert result.stdout == "" and "invalid choice" in result.stderr
    result = run_test_program("serve", "pkg", "--config", "/definitely/missing.toml")
    assert result.returncode == 2
    assert "error: configuration file /definitely/missing.toml does not exist" in result.stderr
