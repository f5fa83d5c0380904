"""The configuration file (spec section 3.3): `~/.config/flare/config.toml` or `--config PATH`.

Every key is optional. An absent default file supplies nothing; an explicitly named missing file, a
file that is not TOML, an unknown key or an invalid value is a usage error naming the key. A key the
specification defines for a feature Flare does not implement yet (images, kernel and
collective tuning, export staging) is refused by name, except at the value that
leaves the feature off. Each section becomes a frozen dataclass; unset optional values are None so callers can tell "not
configured" from a configured value equal to a default.

Precedence is flags > this file > the recipe (or the package, or a built-in default), and nothing
else: every setting that more than one of them can give is declared once as a `Setting` and chosen
by `resolve`, which checks a flag's value with the same parser as the file's and says where the
chosen value came from. Flare reads no environment variable for any of these settings;
`flare.environment` sets the ones libraries read.
"""

from __future__ import annotations

import math
import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Iterable, Mapping

from flare.errors import UsageError
from flare.memory import parse_size

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"


def default_config_path() -> Path:
    return Path.home() / ".config" / "flare" / "config.toml"


# ---------------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class ServerConfig:
    host: str | None = None                  # None: the listener's default, 127.0.0.1
    port: int | None = None                  # None: 8000
    api_key: str | None = None               # None (or "" in the file): no authentication


@dataclass(frozen=True)
class DefaultsConfig:
    model: str | None = None
    max_concurrency: int | None = None
    speculative_token_capacity: int | None = None    # preparation: most target rows of a verification step
    speculative_graph_budget: int | None = None      # preparation: packed catalogs only (none here: ignored)


@dataclass(frozen=True)
class ModelOverrides:
    """[models."name"]: per-model overrides of [defaults], matched against canonical ID and aliases."""

    max_concurrency: int | None = None
    speculative_token_capacity: int | None = None
    speculative_graph_budget: int | None = None      # refused at export: no recipe here has a packed catalog


@dataclass(frozen=True)
class PreparationConfig:
    compile_workers: int | None = None       # None: automatic, memory-bounded sizing


@dataclass(frozen=True)
class MemoryConfig:
    reserve: int | None = None               # bytes; None: keep the package's recorded reserve


@dataclass(frozen=True)
class SchedulerConfig:
    """[scheduler] (our extension of the specification): the balanced policy's cadence bound."""

    max_step_ms: float | None = None         # None: twice a full decode batch's measured step


@dataclass(frozen=True)
class PrefixCacheConfig:
    """[prefix_cache]: prefix states kept below the GPU (flare run; flare.server.retention_settings)."""

    memory: int | None = None                # bytes of host memory; None (or "" in the file): no host tier
    drain_on_shutdown: float | None = None   # seconds a clean stop may spend writing the host tier to disk
    disk_limit: int | None = None            # bytes; None: 10% of the free space where [paths] prefix_cache is
    disk_transport: str | None = None        # "staged" or "direct"; None: staged


@dataclass(frozen=True)
class PathsConfig:
    # Unlike the other sections, paths hold the default when the file sets none (`default_paths`).
    hub_cache: Path
    kernel_cache: Path
    package_cache: Path
    cuda: Path | None = None                 # None: libraries discover the system toolkit
    prefix_cache: Path | None = None         # the disk tier of the prefix cache; None: no disk tier


@dataclass(frozen=True)
class PublishingConfig:
    """The published signing identity; configured completely or not at all."""

    signing_key: Path
    namespace: str
    official_source: str


@dataclass(frozen=True)
class HubConfig:
    """Hub access (our extension of the specification, so tests can use a loopback hub)."""

    endpoint: str = DEFAULT_HUB_ENDPOINT
    token_file: Path | None = None


def default_paths() -> PathsConfig:
    home = Path.home()
    return PathsConfig(hub_cache=home / ".cache" / "huggingface" / "hub",
                       kernel_cache=home / ".cache" / "flare" / "kernels",
                       package_cache=home / ".cache" / "flare" / "packages")


@dataclass(frozen=True)
class Config:
    path: Path                               # the file named or defaulted, whether or not it exists
    server: ServerConfig = field(default_factory=ServerConfig)
    defaults: DefaultsConfig = field(default_factory=DefaultsConfig)
    preparation: PreparationConfig = field(default_factory=PreparationConfig)
    memory: MemoryConfig = field(default_factory=MemoryConfig)
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    prefix_cache: PrefixCacheConfig = field(default_factory=PrefixCacheConfig)
    paths: PathsConfig = field(default_factory=default_paths)
    publishing: PublishingConfig | None = None
    hub: HubConfig = field(default_factory=HubConfig)
    models: Mapping[str, ModelOverrides] = field(default_factory=dict)

    def __post_init__(self):
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    @property
    def config_dir(self) -> Path:
        """The file's directory: the development signing key and public profile live here."""
        return self.path.parent

    def _model_overrides(self, names) -> dict[str, tuple[Any, str]]:
        """{key: (value, section name)} of the [models."name"] sections matching `names`.

        Two matching sections that set one key to different values are a usage error; a flag that
        supplies the value makes the question moot, so callers ask only for what no flag gave.
        """
        wanted = {name.lower() for name in names if name}
        merged: dict[str, tuple[Any, str]] = {}
        for section_name, overrides in self.models.items():
            if section_name.lower() not in wanted:
                continue
            for key, value in vars(overrides).items():
                if value is None:
                    continue
                if key in merged and merged[key][0] != value:
                    raise UsageError(
                        f"{self.path}: models.{_quote(merged[key][1])}.{key} = {merged[key][0]} and "
                        f"models.{_quote(section_name)}.{key} = {value} both match this model; "
                        f"remove one or pass the value as a flag")
                merged.setdefault(key, (value, section_name))
        return merged

    def file_value(self, key: str, names: Iterable[str] = ()) -> tuple[Any, str] | None:
        """The file's value for `key` ("section.name") and the key it was written under, or None when
        the file does not set it. For a [defaults] key, a [models."name"] section matching one of
        `names` (the model's canonical ID and aliases) wins."""
        section, name = key.split(".", 1)
        if section == "defaults":
            overrides = self._model_overrides(names)
            if name in overrides:
                value, section_name = overrides[name]
                return value, f"models.{_quote(section_name)}.{name}"
        value = getattr(getattr(self, section), name)
        return (value, key) if value is not None else None     # None: not set (an empty value is unset)


# ---------------------------------------------------------------------------------------------------
# Precedence


def resolve_setting_source(flag: Any, configured: Any, recipe: Any) -> tuple[Any, str | None]:
    """Flags override the configuration file, which overrides the recipe. Nothing else exists.

    None means "not given"; any other value, including 0, False and "", counts as given. Returns the
    value and where it came from: "flag", "config", "recipe" or None. `resolve` is how settings use it.
    """
    for value, source in ((flag, "flag"), (configured, "config"), (recipe, "recipe")):
        if value is not None:
            return value, source
    return None, None


@dataclass(frozen=True)
class Setting:
    """One setting that a flag, the configuration file and a fallback (the recipe, the package or a
    built-in default) can each give. `parse(value, where)` checks a flag's value as the file's values
    are checked at load, with an error naming the flag."""

    flag: str | None                          # "--max-concurrency"; None: the file only
    key: str | None                           # "defaults.max_concurrency"; None: the command line only
    parse: Callable[[Any, str], Any]


@dataclass(frozen=True)
class Chosen:
    """A resolved setting: its value, where it came from ("flag", "config", "recipe" for any fallback, or
    None when nothing gave it) and a phrase naming that for messages ("--max-concurrency 0",
    "defaults.max_concurrency = 4 in /home/me/.config/flare/config.toml", "the recipe default 32")."""

    value: Any
    source: str | None
    origin: str


def resolve(setting: Setting, flag: Any, config: "Config | None", fallback: Any = None, *,
            fallback_origin: str = "the recipe default", names: Iterable[str] = ()) -> Chosen:
    """The one precedence rule: `flag` (None: not given) over the file's `setting.key` over `fallback`.

    `names` (the model's canonical ID and aliases) select a [models."name"] override of a [defaults] key;
    the file is not consulted when the flag gives the value, so conflicting model sections do not matter
    then. A flag's value is checked by `setting.parse` (an explicit 0 is a value, and is refused where 0
    is not allowed).
    """
    if flag is not None and setting.flag is None:
        raise ValueError(f"{setting.key} has no flag")
    found = None
    if flag is None and config is not None and setting.key is not None:
        found = config.file_value(setting.key, names)
    value, source = resolve_setting_source(flag, found[0] if found else None, fallback)
    if source == "flag":
        return Chosen(setting.parse(value, setting.flag), source, f"{setting.flag} {_shown(value)}")
    if source == "config":
        return Chosen(value, source, f"{found[1]} = {_shown(value)} in {config.path}")
    return Chosen(value, source, f"{fallback_origin} {_shown(value)}" if source else fallback_origin)


def package_cache(flag: Path | None, config: "Config") -> Path:
    """The prepared-model cache: --model-cache, then [paths] package_cache, then ~/.cache/flare/packages."""
    return resolve(PACKAGE_CACHE, flag, config, default_paths().package_cache, fallback_origin="the default").value


def check_flag(setting: Setting, value: Any) -> Any:
    """A flag's value checked as `resolve` checks it (None: not given), for refusing it before work starts."""
    return None if value is None else setting.parse(value, setting.flag)


def _shown(value: Any) -> str:
    return str(value) if isinstance(value, (int, float, Path)) and not isinstance(value, bool) else repr(value)


# ---------------------------------------------------------------------------------------------------
# Values


def _string(value, key):
    if not isinstance(value, str):
        raise UsageError(f"{key} must be a string, not {value!r}")
    return value


def _optional_string(value, key):
    return _string(value, key) or None


def _positive_int(value, key):
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise UsageError(f"{key} must be a positive integer, not {value!r}")
    return value


def _port(value, key):
    if isinstance(value, bool) or not isinstance(value, int) or not 1 <= value <= 65535:
        raise UsageError(f"{key} must be a port number from 1 through 65535, not {value!r}")
    return value


def _size(value, key):
    return parse_size(value, key)


def _path(value, key):
    text = str(value) if isinstance(value, Path) else _string(value, key)     # a flag's is a Path already
    if not text:
        raise UsageError(f"{key} must name a directory, not an empty string")
    return Path(text).expanduser()


def _optional_path(value, key):
    text = _string(value, key)
    return Path(text).expanduser() if text else None


class _Unsupported:
    """The parser of a key the specification defines and Flare does not implement yet: it accepts only the
    value that leaves the feature off (or none at all) and refuses anything else, saying so."""

    def __init__(self, reason: str, off: Any = None) -> None:
        self.reason, self.off = reason, off

    def __call__(self, value, key):
        if self.off is not None and value == self.off:
            return None                           # the feature's "off" value: nothing to do
        accepted = f" or set it to {self.off!r}" if self.off is not None else ""
        raise UsageError(f"{key} = {value!r} is not supported yet: {self.reason}; remove the key{accepted}")


_NO_IMAGES = _Unsupported("no recipe here serves images")


DRAIN_ON_S = 30.0       # drain_on_shutdown = "on": the longest a clean stop writes the host tier
DRAIN_MAX_S = 45.0      # a longer drain would outlast the stop's watchdog (flare.server.stopping, 60 s)
_DURATION = re.compile(r"(?P<number>\d+(?:\.\d+)?)\s*(?P<unit>ms|s|m)")


def parse_drain(value, key) -> float:
    """drain_on_shutdown: "off" (0), "on" (DRAIN_ON_S) or a duration such as "10s", "1.5m", "500ms"."""
    text = _string(value, key).strip().lower()
    if text == "off":
        return 0.0
    if text == "on":
        return DRAIN_ON_S
    match = _DURATION.fullmatch(text)
    if not match:
        raise UsageError(f'{key} = {value!r}: write "on", "off" or a duration such as "10s", "2m" or "500ms"')
    seconds = float(match["number"]) * {"ms": 0.001, "s": 1.0, "m": 60.0}[match["unit"]]
    if seconds > DRAIN_MAX_S:
        raise UsageError(f"{key} = {value!r} is longer than a stop may take ({DRAIN_MAX_S:.0f} s: the server "
                         f"exits 60 s after a stop began); write at most \"{DRAIN_MAX_S:.0f}s\"")
    return seconds


def _optional_size(value, key):
    if isinstance(value, str) and not value.strip():
        return None
    return parse_size(value, key)


def _positive_optional_size(value, key):
    size = _optional_size(value, key)
    if size == 0:
        raise UsageError(f'{key} = {value!r} leaves no room; write a size such as "100G", or "" for the default')
    return size


def _disk_transport(value, key):
    text = _string(value, key).strip()
    if text not in ("", "staged", "direct"):
        raise UsageError(f'{key} = {value!r}: choose "staged" (through the OS page cache, the default) or '
                         '"direct" (O_DIRECT)')
    return text or None


def _endpoint(value, key):
    text = _string(value, key).rstrip("/")
    if not text.startswith(("http://", "https://")):
        raise UsageError(f"{key} must be an http:// or https:// URL, not {value!r}")
    return text


def _served_names(value, key):
    names = tuple(name.strip() for name in value)
    if not all(names):
        raise UsageError(f"{key} must not be blank")
    return names


def _prefill_chunk(value, key):
    if isinstance(value, bool) or not isinstance(value, int) or value < 64 or value % 64:
        raise UsageError(f"{key} must be a positive multiple of 64, not {value!r}")
    return value


def check_max_step_ms(value, where: str) -> float:
    """A cadence bound: a finite number of milliseconds above zero (`where` names the flag or key)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value) or value <= 0:
        raise UsageError(f"{where}: {value!r} is not a cadence bound; write a finite number of milliseconds "
                         "above 0, such as 25")
    return float(value)


def _milliseconds(value, key):
    return check_max_step_ms(value, key)


def _memory_limit(value, key):
    from flare.memory import parse_memory_limit

    parse_memory_limit(value)                       # its errors name --memory-limit
    return value


_MODEL_KEYS = {"max_concurrency": _positive_int, "image_concurrency": _NO_IMAGES,
               "speculative_token_capacity": _positive_int, "speculative_graph_budget": _positive_int}

# section -> (dataclass, {key: parser}); a section with no dataclass holds only keys not supported yet
_SECTIONS: dict[str, tuple[type, dict[str, Callable]]] = {
    "server": (ServerConfig, {"host": _string, "port": _port, "api_key": _optional_string}),
    "defaults": (DefaultsConfig, {"model": _optional_string, **_MODEL_KEYS}),
    "preparation": (PreparationConfig, {
        "compile_workers": _positive_int,
        "autotune_effort": _Unsupported("kernel tuning is not implemented: no kernel here has candidates "
                                        "to race, each uses its heuristic configuration"),
        "collective_tuning": _Unsupported("tensor parallelism, whose collectives it tunes, is not implemented")}),
    "memory": (MemoryConfig, {"reserve": _size}),
    "scheduler": (SchedulerConfig, {"max_step_ms": _milliseconds}),
    "prefix_cache": (PrefixCacheConfig, {"memory": _optional_size, "disk_limit": _positive_optional_size,
                                         "disk_transport": _disk_transport, "drain_on_shutdown": parse_drain}),
    "paths": (PathsConfig, {"hub_cache": _path, "kernel_cache": _path, "package_cache": _path,
                            "prefix_cache": _optional_path,
                            "export_staging": _Unsupported("exports stage in the cache's own staging/ folder, "
                                                           "on the cache's disk (multi-host exports, which "
                                                           "assemble rank files there, are not implemented)",
                                                           off=""),
                            "cuda": _optional_path}),
    "hub": (HubConfig, {"endpoint": _endpoint, "token_file": _optional_path}),
}
_PUBLISHING_KEYS = {"signing_key": _optional_path, "namespace": _optional_string,
                    "official_source": _optional_string}
_KNOWN_SECTIONS = (*_SECTIONS, "publishing", "models")


# ---------------------------------------------------------------------------------------------------
# The settings that more than one of a flag, the file and a fallback can give; each is chosen by `resolve`.

MODEL = Setting("MODEL", "defaults.model", _string)
MAX_CONCURRENCY = Setting("--max-concurrency", "defaults.max_concurrency", _positive_int)
SPECULATIVE_TOKEN_CAPACITY = Setting("--speculative-token-capacity", "defaults.speculative_token_capacity",
                                     _positive_int)
SPECULATIVE_GRAPH_BUDGET = Setting("--speculative-graph-budget", "defaults.speculative_graph_budget", _positive_int)
PREFILL_CHUNK = Setting("--prefill-chunk-size", None, _prefill_chunk)            # command line only
COMPILE_WORKERS = Setting("--compile-workers", "preparation.compile_workers", _positive_int)
HOST = Setting("--host", "server.host", _string)
PORT = Setting("--port", "server.port", _port)
API_KEY = Setting("--api-key-file", "server.api_key", _string)    # the flag gives the key its file holds
MEMORY_RESERVE = Setting(None, "memory.reserve", _size)           # what export records as the package's
SERVING_MEMORY = Setting("--memory-limit", "memory.reserve", _memory_limit)    # replaces the reserve
SERVED_MODEL_NAME = Setting("--served-model-name", None, _served_names)   # replaces the package's aliases
MAX_STEP_MS = Setting("--scheduler-max-step-ms", "scheduler.max_step_ms", _milliseconds)   # balanced's bound
PACKAGE_CACHE = Setting("--model-cache", "paths.package_cache", _path)
TOKEN_FILE = Setting("--token-file", "hub.token_file", _path)


# ---------------------------------------------------------------------------------------------------
# Loading


def load_config(path: Path | None) -> Config:
    """Read the configuration file; `path` None means the default file, which may be absent."""
    explicit = path is not None
    config_path = Path(path).expanduser() if explicit else default_config_path()
    if not config_path.is_file():
        if explicit:
            raise UsageError(f"configuration file {config_path} does not exist "
                             f"(--config names a file to read; omit it to use {default_config_path()})")
        return Config(path=config_path)
    try:
        document = tomllib.loads(config_path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as error:
        raise UsageError(f"{config_path} is not valid TOML: {error}") from None
    except (OSError, UnicodeDecodeError) as error:
        raise UsageError(f"cannot read configuration file {config_path}: {error}") from None
    try:
        return _build(config_path, document)
    except UsageError as error:
        raise UsageError(f"{config_path}: {error}") from None


def _build(config_path: Path, document: dict[str, Any]) -> Config:
    for name, value in document.items():
        if name not in _KNOWN_SECTIONS:
            raise UsageError(f"unknown section or key {name!r}; the sections are {', '.join(_KNOWN_SECTIONS)}")
        if not isinstance(value, dict):
            raise UsageError(f"{name} must be a table ([{name}]), not {value!r}")
    values = {name: _values(name, document.get(name, {}), parsers) for name, (_, parsers) in _SECTIONS.items()}
    sections = {name: cls(**values[name]) for name, (cls, _) in _SECTIONS.items()
                if cls is not None and name != "paths"}
    paths = PathsConfig(**{**vars(default_paths()), **values["paths"]})
    return Config(path=config_path, paths=paths, publishing=_publishing(document.get("publishing", {})),
                  models=_models(document.get("models", {})), **sections)


def _values(section: str, table: dict[str, Any], parsers: dict[str, Callable]) -> dict[str, Any]:
    values = {}
    for key, value in table.items():
        dotted = f"{section}.{key}"
        if key not in parsers:
            raise UsageError(f"unknown key {dotted}; [{section}] accepts {', '.join(parsers)}")
        parsed = parsers[key](value, dotted)
        if not isinstance(parsers[key], _Unsupported):          # an accepted "off" value leaves nothing
            values[key] = parsed
    return values


def _publishing(table: dict[str, Any]) -> PublishingConfig | None:
    values = {key: value for key, value in _values("publishing", table, _PUBLISHING_KEYS).items()
              if value is not None}
    if not values:
        return None
    missing = [f"publishing.{key}" for key in _PUBLISHING_KEYS if key not in values]
    if missing:
        raise UsageError(f"a publishing identity needs all three of signing_key, namespace and "
                         f"official_source; {', '.join(missing)} missing")
    return PublishingConfig(**values)


def _models(table: dict[str, Any]) -> dict[str, ModelOverrides]:
    models = {}
    for name, section in table.items():
        where = f"models.{_quote(name)}"
        if not isinstance(section, dict):
            raise UsageError(f"{where} must be a table ([{where}]), not {section!r}")
        models[name] = ModelOverrides(**_values(where, section, _MODEL_KEYS))
    return models


def _quote(name: str) -> str:
    return name if re.fullmatch(r"[A-Za-z0-9_-]+", name) else f'"{name}"'


# ---------------------------------------------------------------------------------------------------
# Writing the first file


def write_initial_config(path: Path, resolved: Mapping[str, Mapping[str, Any]]) -> bool:
    """Write the configuration file on first export, with every resolved value present as a comment.

    `resolved` maps section names to {key: value}; None values are noted as unset. Nothing is written
    when the file already exists (the user's file is never rewritten). The comments leave every
    setting to its default until the user uncomments one. Returns whether a file was written.
    """
    import tomlkit                                  # only export writes the file

    path = Path(path)
    if path.exists():
        return False
    document = tomlkit.document()
    document.add(tomlkit.comment("Flare configuration. Every key is optional; uncomment one to override"))
    document.add(tomlkit.comment("the recipe's value. Command-line flags override this file."))
    for section, values in resolved.items():
        table = tomlkit.table()
        for key, value in values.items():
            table.add(tomlkit.comment(_commented_setting(key, value)))
        document.add(tomlkit.nl())
        document.add(section, table)
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        with open(path, "x", encoding="utf-8") as file:     # "x": never replace a file written meanwhile
            file.write(tomlkit.dumps(document))
    except FileExistsError:
        return False
    return True


def _commented_setting(key: str, value: Any) -> str:
    import tomlkit

    if value is None:
        return f"{key} is not set"
    if isinstance(value, Path):
        value = str(value)
    return f"{key} = {tomlkit.item(value).as_string()}"
