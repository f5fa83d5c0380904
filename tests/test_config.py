"""The configuration file, the precedence rule, the first-export file, and the environment policy."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import tomlkit

from flare.config import (DRAIN_ON_S, Config, PrefixCacheConfig, PublishingConfig, load_config, parse_drain,
                          parse_size, resolve_setting_source, write_initial_config)
from flare.environment import apply_library_environment, library_environment
from flare.errors import UsageError

# The example file of spec section 3.3, values uncommented where Flare supports them.
SPEC_EXAMPLE = """
[server]
host = "127.0.0.1"
port = 8000
api_key = ""                      # Empty: no authentication.

[defaults]
model = "qwen3.8-flash"
max_concurrency = 4

[preparation]
compile_workers = 24
# autotune_effort = "default"     # commented in the specification, and not supported yet here
# collective_tuning = "static"

[memory]
reserve = "0"

[prefix_cache]
memory = ""
drain_on_shutdown = "off"
disk_limit = ""
disk_transport = ""

[models."qwen3.8-flash"]
max_concurrency = 2

[paths]
hub_cache = "~/.cache/huggingface/hub"
kernel_cache = "~/.cache/flare/kernels"
package_cache = "~/.cache/flare/packages"
prefix_cache = ""
export_staging = ""
cuda = "/opt/cuda"
"""


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def test_absent_default_file_supplies_nothing(isolated_home):
    config = load_config(None)
    assert config.path == isolated_home / ".config" / "flare" / "config.toml"
    assert config.config_dir == isolated_home / ".config" / "flare"
    assert config.server.host is None and config.server.port is None and config.server.api_key is None
    assert config.defaults.model is None and config.defaults.max_concurrency is None
    assert config.memory.reserve is None                 # absent: the package's reserve stays in force
    assert config.paths.hub_cache == isolated_home / ".cache" / "huggingface" / "hub"
    assert config.paths.kernel_cache == isolated_home / ".cache" / "flare" / "kernels"
    assert config.paths.package_cache == isolated_home / ".cache" / "flare" / "packages"
    assert config.publishing is None
    assert config.hub.endpoint == "https://huggingface.co" and config.hub.token_file is None


def test_default_file_is_read_from_the_home_directory(isolated_home):
    path = isolated_home / ".config" / "flare" / "config.toml"
    path.parent.mkdir(parents=True)
    path.write_text("[server]\nport = 9100\n")
    assert load_config(None).server.port == 9100


def test_explicitly_named_missing_file_is_a_usage_error(tmp_path):
    with pytest.raises(UsageError, match="does not exist") as caught:
        load_config(tmp_path / "missing.toml")
    assert caught.value.exit_code == 2
    assert "missing.toml" in str(caught.value)


def test_the_specification_example_loads(tmp_path, isolated_home):
    config = load_config(write(tmp_path, SPEC_EXAMPLE))
    assert config.server.api_key is None                  # empty: no authentication
    assert config.defaults.model == "qwen3.8-flash" and config.defaults.max_concurrency == 4
    assert config.preparation.compile_workers == 24
    assert config.memory.reserve == 0                     # configured zero is not "absent"
    # [prefix_cache] and [paths] prefix_cache at their defaults, export_staging at its "off" value
    assert config.prefix_cache == PrefixCacheConfig(drain_on_shutdown=0.0)
    assert config.paths.prefix_cache is None
    assert config.models["qwen3.8-flash"].max_concurrency == 2
    assert config.paths.hub_cache == isolated_home / ".cache" / "huggingface" / "hub"   # ~ expanded
    assert config.paths.cuda == Path("/opt/cuda")


def test_values_and_extensions_are_parsed(tmp_path, isolated_home):
    config = load_config(write(tmp_path, """
[server]
api_key = "secret"
[memory]
reserve = "12G"
[hub]
endpoint = "http://127.0.0.1:9999/"
token_file = "~/hub-token"
[publishing]
signing_key = "~/keys/flare.pem"
namespace = "example-publisher"
official_source = "https://huggingface.co/example-publisher/MODEL"
"""))
    assert config.server.api_key == "secret"
    assert config.memory.reserve == 12 * 1024 ** 3
    assert config.hub.endpoint == "http://127.0.0.1:9999"
    assert config.hub.token_file == isolated_home / "hub-token"
    assert config.publishing == PublishingConfig(signing_key=isolated_home / "keys" / "flare.pem",
                                                 namespace="example-publisher",
                                                 official_source="https://huggingface.co/example-publisher/MODEL")


@pytest.mark.parametrize("text,named", [
    ("[server]\nport = -1\n", "server.port"),
    ("[server]\nport = 70000\n", "server.port"),
    ('[server]\nport = "8000"\n', "server.port"),
    ("[server]\nhost = 1\n", "server.host"),
    ("[server]\nprot = 8000\n", "server.prot"),
    ('[memory]\nreserve = "12X"\n', "memory.reserve"),
    ('[memory]\nreserve = "12"\n', "memory.reserve"),
    ('[memory]\nreserve = "-4G"\n', "memory.reserve"),
    ("[memory]\nreserve = -1\n", "memory.reserve"),
    ("[defaults]\nmax_concurrency = 0\n", "defaults.max_concurrency"),
    ("[defaults]\nspeculative_graph_budget = true\n", "defaults.speculative_graph_budget"),
    ("[defaults]\nspeculative_token_capacity = 0\n", "defaults.speculative_token_capacity"),
    ('[models."qwen3-8b"]\nspeculative_token_capacity = "24"\n', "models.qwen3-8b.speculative_token_capacity"),
    ('[preparation]\nautotune_effort = "max"\n', "preparation.autotune_effort"),
    ('[preparation]\ncollective_tuning = "dynamic"\n', "preparation.collective_tuning"),
    ("[preparation]\ncompile_workers = 0\n", "preparation.compile_workers"),
    ('[prefix_cache]\ndrain_on_shutdown = "sometimes"\n', "prefix_cache.drain_on_shutdown"),
    ('[prefix_cache]\ndisk_transport = "carrier-pigeon"\n', "prefix_cache.disk_transport"),
    ('[prefix_cache]\ndrain_on_shutdown = "2h"\n', "prefix_cache.drain_on_shutdown"),
    ('[prefix_cache]\ndrain_on_shutdown = "90s"\n', "prefix_cache.drain_on_shutdown"),
    ('[prefix_cache]\nmemory = "16"\n', "prefix_cache.memory"),
    ('[prefix_cache]\ndisk_limit = "0"\n', "prefix_cache.disk_limit"),
    ('[paths]\nkernel_cache = ""\n', "paths.kernel_cache"),
    ('[hub]\nendpoint = "ftp://example.org"\n', "hub.endpoint"),
    ('[models."qwen3-8b"]\nmax_concurrency = "2"\n', 'models.qwen3-8b.max_concurrency'),
    ('[models."qwen3.8-flash"]\nthreads = 2\n', 'models."qwen3.8-flash".threads'),
    ('[publishing]\nnamespace = "someone"\n', "publishing.signing_key"),
    ("[surprise]\nkey = 1\n", "surprise"),
    ("server = 1\n", "server"),
])
def test_an_invalid_setting_is_a_usage_error_naming_its_key(tmp_path, text, named):
    path = write(tmp_path, text)
    with pytest.raises(UsageError) as caught:
        load_config(path)
    assert named in str(caught.value)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("text,named", [
    ('[paths]\nexport_staging = "/data/staging"\n', "paths.export_staging"),
    ('[preparation]\nautotune_effort = "default"\n', "preparation.autotune_effort"),
    ('[preparation]\ncollective_tuning = "static"\n', "preparation.collective_tuning"),
    ("[defaults]\nimage_concurrency = 2\n", "defaults.image_concurrency"),
    ('[models."qwen3-8b"]\nimage_concurrency = 2\n', "models.qwen3-8b.image_concurrency"),
])
def test_a_setting_flare_does_not_implement_yet_is_refused_by_name(tmp_path, text, named):
    """A key that parses and does nothing is a defect: it is refused, saying it is not supported yet."""
    path = write(tmp_path, text)
    with pytest.raises(UsageError, match="is not supported yet") as caught:
        load_config(path)
    assert named in str(caught.value) and str(path) in str(caught.value)
    assert caught.value.exit_code == 2


def test_the_prefix_cache_tiers_are_configured(tmp_path, isolated_home):
    config = load_config(write(tmp_path, """
[prefix_cache]
memory = "16G"
drain_on_shutdown = "10s"
disk_limit = "100G"
disk_transport = "direct"
[paths]
prefix_cache = "~/prefixes"
"""))
    assert config.prefix_cache == PrefixCacheConfig(memory=16 << 30, drain_on_shutdown=10.0, disk_limit=100 << 30,
                                                    disk_transport="direct")
    assert config.paths.prefix_cache == isolated_home / "prefixes"


@pytest.mark.parametrize("text,seconds", [("off", 0.0), ("on", DRAIN_ON_S), ("500ms", 0.5), ("0.5m", 30.0),
                                          ("45s", 45.0)])
def test_drain_on_shutdown_is_off_on_or_a_duration(text, seconds):
    assert parse_drain(text, "prefix_cache.drain_on_shutdown") == seconds


def test_invalid_toml_is_a_usage_error_naming_the_file(tmp_path):
    path = write(tmp_path, "[server\nport = 8000\n")
    with pytest.raises(UsageError, match="not valid TOML") as caught:
        load_config(path)
    assert str(path) in str(caught.value)


@pytest.mark.parametrize("text,size", [("0", 0), ("12G", 12 << 30), ("512MiB", 512 << 20), ("4gb", 4 << 30),
                                       ("1.5G", 3 << 29), ("2 T", 2 << 40), (0, 0), (4096, 4096)])
def test_sizes_use_binary_units(text, size):
    assert parse_size(text, "memory.reserve") == size


@pytest.mark.parametrize("text", ["12X", "-1G", "G", "", "1e3G", "99999999999P", True])
def test_bad_sizes_are_usage_errors(text):
    with pytest.raises(UsageError, match="memory.reserve"):
        parse_size(text, "memory.reserve")


def test_model_section_overrides_defaults_for_matching_names(tmp_path):
    config = load_config(write(tmp_path, """
[defaults]
max_concurrency = 16
[models."Qwen3-8B"]
max_concurrency = 4
"""))
    assert config.file_value("defaults.max_concurrency", ["qwen3-8b", "Qwen3-8B"])[0] == 4
    assert config.file_value("defaults.max_concurrency", ["qwen3-8B"])[0] == 4     # names match ignoring case
    assert config.file_value("defaults.max_concurrency", ["llama-3.1-8b-instruct"])[0] == 16


def test_conflicting_model_sections_are_rejected(tmp_path):
    config = load_config(write(tmp_path, """
[models."qwen3-8b"]
max_concurrency = 4
[models."Qwen3-8B-Served"]
max_concurrency = 8
"""))
    with pytest.raises(UsageError, match="max_concurrency"):
        config.file_value("defaults.max_concurrency", ["qwen3-8b", "Qwen3-8B-Served"])
    assert config.file_value("defaults.max_concurrency", ["qwen3-8b"])[0] == 4


def test_config_is_frozen(tmp_path):
    config = load_config(None)
    with pytest.raises(AttributeError):
        config.server.port = 1
    with pytest.raises(TypeError):
        config.models["x"] = None


@pytest.mark.parametrize("flag,configured,recipe,value,source", [
    (8, 4, 32, 8, "flag"),
    (None, 4, 32, 4, "config"),
    (None, None, 32, 32, "recipe"),
    (0, 4, 32, 0, "flag"),                  # an explicit zero is a value, not "unset"
    (None, 0, 32, 0, "config"),
    (False, True, True, False, "flag"),
    ("", "x", "y", "", "flag"),
    (None, None, None, None, None),
])
def test_flags_override_the_file_which_overrides_the_recipe(flag, configured, recipe, value, source):
    assert resolve_setting_source(flag, configured, recipe) == (value, source)


RESOLVED = {
    "server": {"host": "127.0.0.1", "port": 8000, "api_key": None},
    "defaults": {"model": "qwen3-8b", "max_concurrency": 32},
    "memory": {"reserve": "0"},
    "paths": {"kernel_cache": Path("/data/flare-kernels")},
}


def test_first_export_writes_every_resolved_value_as_a_comment(tmp_path):
    path = tmp_path / "flare" / "config.toml"
    assert write_initial_config(path, RESOLVED) is True
    text = path.read_text()
    for line in ('# host = "127.0.0.1"', "# port = 8000", '# model = "qwen3-8b"', "# max_concurrency = 32",
                 '# reserve = "0"', '# kernel_cache = "/data/flare-kernels"', "# api_key is not set"):
        assert line in text
    config = load_config(path)                      # comments supply no overrides
    assert config.defaults.model is None and config.memory.reserve is None
    assert config.paths == load_config(None).paths


def test_first_export_never_rewrites_an_existing_file(tmp_path):
    path = tmp_path / "config.toml"
    path.write_text("[server]\nport = 9000\n")
    assert write_initial_config(path, RESOLVED) is False
    assert path.read_text() == "[server]\nport = 9000\n"


def test_comments_survive_when_a_setting_is_uncommented_programmatically(tmp_path):
    path = tmp_path / "config.toml"
    write_initial_config(path, RESOLVED)
    document = tomlkit.parse(path.read_text())
    document["server"]["port"] = 9001
    path.write_text(tomlkit.dumps(document))
    assert '# host = "127.0.0.1"' in path.read_text()
    assert load_config(path).server.port == 9001


# ---------------------------------------------------------------------------------------------------
# Environment policy


def test_library_environment_comes_from_the_configuration_only(tmp_path, restore_environment):
    config = load_config(write(tmp_path, """
[paths]
hub_cache = "/data/hub"
kernel_cache = "/data/kernels"
cuda = "/opt/cuda"
[hub]
endpoint = "http://127.0.0.1:9"
"""))
    for name, value in {"HF_TOKEN": "hf_stray", "HF_HOME": "/stray", "HF_ENDPOINT": "https://stray.example",
                        "HF_HUB_OFFLINE": "1", "HUGGING_FACE_HUB_TOKEN": "hf_old", "TRITON_CACHE_DIR": "/stray",
                        "CUDA_VISIBLE_DEVICES": "1"}.items():
        os.environ[name] = value
    apply_library_environment(config)
    for name in ("HF_TOKEN", "HF_HOME", "HF_HUB_OFFLINE", "HUGGING_FACE_HUB_TOKEN"):
        assert name not in os.environ
    assert os.environ["HF_ENDPOINT"] == "http://127.0.0.1:9"
    assert os.environ["HF_HUB_CACHE"] == "/data/hub"
    assert os.environ["HF_HUB_DISABLE_TELEMETRY"] == "1"
    assert os.environ["HF_HUB_DISABLE_IMPLICIT_TOKEN"] == "1"
    assert os.environ["TORCHINDUCTOR_CACHE_DIR"].startswith("/data/kernels/")
    assert os.environ["TRITON_CACHE_DIR"].startswith("/data/kernels/")
    assert os.environ["CUDA_HOME"] == "/opt/cuda"
    assert os.environ["CUDA_VISIBLE_DEVICES"] == "1"            # the one variable Flare honours
    assert library_environment(config) == {name: os.environ[name] for name in library_environment(config)}


def test_huggingface_hub_sees_the_configured_values_when_policy_runs_first(tmp_path, isolated_home):
    """Run in a fresh interpreter: huggingface_hub fixes its endpoint, cache and token at import."""
    token_home = isolated_home / "stray-hf-home"
    token_home.mkdir()
    (token_home / "token").write_text("hf_from_stray_home")
    config_path = write(tmp_path, f'[paths]\nhub_cache = "{tmp_path / "hub"}"\n'
                                  '[hub]\nendpoint = "http://127.0.0.1:9"\n')
    code = (
        "import json, sys\n"
        "from flare.config import load_config\n"
        "from flare.environment import apply_library_environment\n"
        f"late = apply_library_environment(load_config({str(config_path)!r}))\n"
        "import huggingface_hub\n"
        "from huggingface_hub import constants\n"
        "print(json.dumps({'late': list(late), 'endpoint': constants.ENDPOINT,\n"
        "                  'cache': str(constants.HF_HUB_CACHE), 'token': huggingface_hub.get_token(),\n"
        "                  'offline': constants.HF_HUB_OFFLINE}))\n")
    env = dict(os.environ, HF_TOKEN="hf_stray", HF_HOME=str(token_home), HF_ENDPOINT="https://stray.example",
               HF_HUB_OFFLINE="1", HF_HUB_CACHE="/stray/hub")
    result = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    seen = json.loads(result.stdout)
    assert seen == {"late": [], "endpoint": "http://127.0.0.1:9", "cache": str(tmp_path / "hub"),
                    "token": None, "offline": False}


def test_policy_reports_libraries_imported_too_early(tmp_path):
    code = ("import huggingface_hub\n"
            "from flare.config import load_config\n"
            "from flare.environment import apply_library_environment\n"
            "print(','.join(apply_library_environment(load_config(None))))\n")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert "huggingface_hub" in result.stdout.split(",")[0]


def test_config_is_a_plain_value_with_its_path(tmp_path):
    path = write(tmp_path, "")
    config = load_config(path)
    assert isinstance(config, Config)
    assert config.path == path and config.config_dir == tmp_path
