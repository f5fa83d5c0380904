"""The configuration file (spec section 3.3): `~/.config/flare/config.toml` or `--config PATH`.

Every key is optional. An absent default file supplies nothing; an explicitly named missing file, a
file that is not TOML, an unknown key or an invalid value is a usage error naming the key. Each
section becomes a frozen dataclass; unset optional values are None so callers can tell "not
configured" from a configured value equal to a default.

Precedence is flags > this file > the recipe, and nothing else (`resolve_setting`). Flare reads no
environment variable for any of these settings; `flare.environment` sets the ones libraries read.
"""

from __future__ import annotations

import re
import tomllib
from dataclasses import dataclass, field
from pathlib import Path
from types import MappingProxyType
from typing import Any, Callable, Mapping

from flare.errors import UsageError
from flare.memory import parse_size

DEFAULT_HUB_ENDPOINT = "https://huggingface.co"
AUTOTUNE_EFFORTS = ("off", "default", "audit")
COLLECTIVE_TUNINGS = ("static", "runtime")
DISK_TRANSPORTS = ("staged", "direct")


def default_config_path() -> Path:
    return Path.home() / ".config" / "flare" / "config.toml"


# ---------------------------------------------------------------------------------------------------
# Sections


@dataclass(frozen=True)
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 8000
    api_key: str | None = None               # None (or "" in the file): no authentication


@dataclass(frozen=True)
class DefaultsConfig:
    model: str | None = None
    max_concurrency: int | None = None
    image_concurrency: int | None = None
    speculative_token_capacity: int | None = None
    speculative_graph_budget: int | None = None


@dataclass(frozen=True)
class ModelOverrides:
    """[models."name"]: per-model overrides of [defaults], matched against canonical ID and aliases."""

    max_concurrency: int | None = None
    image_concurrency: int | None = None
    speculative_token_capacity: int | None = None
    speculative_graph_budget: int | None = None


@dataclass(frozen=True)
class PreparationConfig:
    compile_workers: int | None = None       # None: automatic, memory-bounded sizing
    autotune_effort: str | None = None       # off | default | audit; None: "default"
    collective_tuning: str | None = None     # static | runtime; None: the recipe's declaration


@dataclass(frozen=True)
class MemoryConfig:
    reserve: int | None = None               # bytes; None: keep the package's recorded reserve


@dataclass(frozen=True)
class PrefixCacheConfig:
    memory: int | None = None                # host retention bytes; None: disabled
    drain_on_shutdown: str = "off"           # on, off, or a duration such as "30s"
    disk_limit: int | None = None            # None: 10% of free disk when disk retention is enabled
    disk_transport: str = "staged"           # staged | direct


@dataclass(frozen=True)
class PathsConfig:
    hub_cache: Path
    kernel_cache: Path
    package_cache: Path
    prefix_cache: Path | None = None         # None: disk retention disabled
    export_staging: Path | None = None       # None: beside the package
    cuda: Path | None = None                 # None: libraries discover the system toolkit


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

    def model_overrides(self, names) -> dict[str, Any]:
        """The [models."name"] values matching any of `names` (case-insensitive), merged.

        Two matching sections that set one key to different values are a usage error; a flag that
        supplies the value makes the question moot, so callers ask only for what no flag gave.
        """
        wanted = {name.lower() for name in names if name}
        merged: dict[str, Any] = {}
        origin: dict[str, str] = {}
        for section_name, overrides in self.models.items():
            if section_name.lower() not in wanted:
                continue
            for key, value in vars(overrides).items():
                if value is None:
                    continue
                if key in merged and merged[key] != value:
                    raise UsageError(
                        f"{self.path}: models.{_quote(origin[key])}.{key} = {merged[key]} and "
                        f"models.{_quote(section_name)}.{key} = {value} both match this model; "
                        f"remove one or pass the value as a flag")
                merged[key] = value
                origin[key] = section_name
        return merged

    def setting_for_model(self, key: str, names) -> Any:
        """A [models."name"] value for this model if one matches, else the [defaults] value (or None)."""
        overrides = self.model_overrides(names)
        if key in overrides:
            return overrides[key]
        return getattr(self.defaults, key)


# ---------------------------------------------------------------------------------------------------
# Precedence


def resolve_setting(flag: Any, configured: Any, recipe: Any) -> Any:
    """Flags override the configuration file, which overrides the recipe. Nothing else exists.

    None means "not given"; any other value, including 0, False and "", counts as given.
    """
    return resolve_setting_source(flag, configured, recipe)[0]


def resolve_setting_source(flag: Any, configured: Any, recipe: Any) -> tuple[Any, str | None]:
    """As `resolve_setting`, also naming where the value came from: "flag", "config", "recipe" or None."""
    for value, source in ((flag, "flag"), (configured, "config"), (recipe, "recipe")):
        if value is not None:
            return value, source
    return None, None


# ---------------------------------------------------------------------------------------------------
# Values


_DURATION = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)\s*$", re.IGNORECASE)


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


def _choice(*options: str) -> Callable:
    def parse(value, key):
        if value not in options:
            raise UsageError(f"{key} must be one of {', '.join(options)}, not {value!r}")
        return value
    return parse


def _size(value, key):
    return parse_size(value, key)


def _optional_size(value, key):
    if value == "":
        return None
    return parse_size(value, key)


def _path(value, key):
    text = _string(value, key)
    if not text:
        raise UsageError(f"{key} must name a directory, not an empty string")
    return Path(text).expanduser()


def _optional_path(value, key):
    text = _string(value, key)
    return Path(text).expanduser() if text else None


def _drain(value, key):
    text = _string(value, key).strip().lower()
    if text in ("on", "off") or _DURATION.match(text):
        return text
    raise UsageError(f"{key} must be on, off or a duration such as \"30s\", not {value!r}")


def _disk_transport(value, key):
    text = _string(value, key)
    if text == "":
        return "staged"
    return _choice(*DISK_TRANSPORTS)(text, key)


def _endpoint(value, key):
    text = _string(value, key).rstrip("/")
    if not text.startswith(("http://", "https://")):
        raise UsageError(f"{key} must be an http:// or https:// URL, not {value!r}")
    return text


_MODEL_KEYS = {"max_concurrency": _positive_int, "image_concurrency": _positive_int,
               "speculative_token_capacity": _positive_int, "speculative_graph_budget": _positive_int}

# section -> (dataclass, {key: parser})
_SECTIONS: dict[str, tuple[type, dict[str, Callable]]] = {
    "server": (ServerConfig, {"host": _string, "port": _port, "api_key": _optional_string}),
    "defaults": (DefaultsConfig, {"model": _optional_string, **_MODEL_KEYS}),
    "preparation": (PreparationConfig, {"compile_workers": _positive_int,
                                        "autotune_effort": _choice(*AUTOTUNE_EFFORTS),
                                        "collective_tuning": _choice(*COLLECTIVE_TUNINGS)}),
    "memory": (MemoryConfig, {"reserve": _size}),
    "prefix_cache": (PrefixCacheConfig, {"memory": _optional_size, "drain_on_shutdown": _drain,
                                         "disk_limit": _optional_size, "disk_transport": _disk_transport}),
    "paths": (PathsConfig, {"hub_cache": _path, "kernel_cache": _path, "package_cache": _path,
                            "prefix_cache": _optional_path, "export_staging": _optional_path,
                            "cuda": _optional_path}),
    "hub": (HubConfig, {"endpoint": _endpoint, "token_file": _optional_path}),
}
_PUBLISHING_KEYS = {"signing_key": _optional_path, "namespace": _optional_string,
                    "official_source": _optional_string}
_KNOWN_SECTIONS = (*_SECTIONS, "publishing", "models")


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
    sections = {name: _section(name, document.get(name, {}), parsers, cls)
                for name, (cls, parsers) in _SECTIONS.items() if name != "paths"}
    paths_values = _values("paths", document.get("paths", {}), _SECTIONS["paths"][1])
    paths = default_paths()
    paths = PathsConfig(**{**vars(paths), **paths_values})
    return Config(path=config_path, paths=paths, publishing=_publishing(document.get("publishing", {})),
                  models=_models(document.get("models", {})), **sections)


def _values(section: str, table: dict[str, Any], parsers: dict[str, Callable]) -> dict[str, Any]:
    values = {}
    for key, value in table.items():
        dotted = f"{section}.{key}"
        if key not in parsers:
            raise UsageError(f"unknown key {dotted}; [{section}] accepts {', '.join(parsers)}")
        values[key] = parsers[key](value, dotted)
    return values


def _section(section: str, table: dict[str, Any], parsers: dict[str, Callable], cls: type):
    return cls(**_values(section, table, parsers))


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
