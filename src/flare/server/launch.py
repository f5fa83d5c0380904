"""`flare run` and `ignition debug-serve` as library calls: load in stages, then serve until a signal.

    run_package(RunOptions(...))          verify, accept, load and serve a package
    debug_serve(DebugOptions(...))        load a checkpoint directory and serve it, writing no package

Both describe what they serve as a `ServedModel`, then share the rest: engine, frontend, listener,
startup report, and a drain of active requests on SIGINT/SIGTERM.
"""

from __future__ import annotations

import math
import socket
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

from flare.errors import CapacityError, UsageError
from flare.server.settings import SamplingPolicy, ServerSettings
from flare.ui.banner import show_banner
from flare.ui.stages import StageReporter

KV_CACHE_LIMITS = ("memory", "context", "concurrency")


@dataclass(frozen=True)
class ListenerOptions:
    host: str | None = None                 # None: [server] host, else 127.0.0.1
    port: int | None = None                 # None: [server] port, else 8000
    served_model_name: str | None = None
    api_key_file: Path | None = None
    max_concurrency: int | None = None
    kv_cache_limit: str = "memory"
    memory_limit: str | None = None


@dataclass(frozen=True)
class ServedModel:
    """What is being served, however it was loaded."""

    canonical_id: str
    served_names: tuple[str, ...]
    hf_config: dict
    frontend_dir: Path
    dtype: str
    page_size: int
    prefill_chunk: int
    prepared_concurrency: int              # the capacity the package was prepared for
    max_model_len: int
    weight_bytes: int
    iter_weights: Callable[[], Iterator[tuple[str, Any]]]
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    memory_reserve_bytes: int = 0
    package_path: Path | None = None       # set for packages: the engine runs in its own process


# ---- memory limit and KV pool -----------------------------------------------------------------------

@dataclass(frozen=True)
class MemoryLimit:
    kind: str          # "occupied" (at most N bytes), "reserve" (leave N bytes free), "fraction" (of total)
    value: float


def parse_memory_limit(text: str) -> MemoryLimit:
    """`30g` (occupied size), `-30g` (free-memory reserve, `-0g` allowed) or `0.8` (fraction of total)."""
    from flare.config import parse_size

    raw = text.strip()
    if raw.startswith("-"):
        return MemoryLimit("reserve", parse_size(raw[1:], "--memory-limit"))
    try:
        fraction = float(raw)
    except ValueError:
        size = parse_size(raw, "--memory-limit")
        if raw[-1].isdigit() or size <= 0:
            raise UsageError(f"--memory-limit {text}: an occupied size needs a unit suffix such as 30G") from None
        return MemoryLimit("occupied", size)
    if not (math.isfinite(fraction) and 0.0 < fraction <= 1.0):
        raise UsageError(f"--memory-limit {text}: a bare number is a fraction of total memory, "
                         "greater than 0 and at most 1")
    return MemoryLimit("fraction", fraction)


def kv_bytes_per_token(hf_config: dict, dtype: str) -> int:
    from flare.models import ModelConfig

    cfg = ModelConfig.from_hf_config(hf_config)
    element = {"float32": 4, "float16": 2, "bfloat16": 2}.get(dtype, 4)
    return 2 * cfg.num_hidden_layers * cfg.num_key_value_heads * cfg.head_dim * element


@dataclass(frozen=True)
class KVPool:
    pages: int
    page_size: int
    bytes_per_token: int
    limited_by: str

    @property
    def tokens(self) -> int:
        return self.pages * self.page_size

    @property
    def bytes(self) -> int:
        return self.tokens * self.bytes_per_token


def size_kv_pool(model: ServedModel, concurrency: int, kv_cache_limit: str, device: str,
                 memory_limit: MemoryLimit | None, reserve_bytes: int) -> KVPool:
    """Pages for the KV cache: a context per active request by default, bounded as --kv-cache-limit says.

    On a GPU the `memory` mode fills what the device has free after weights, headroom and the reserve
    (or --memory-limit); on the CPU there is no device memory to fill, so the pool is one prepared
    context per active request.
    """
    per_token = kv_bytes_per_token(model.hf_config, model.dtype)
    pages_per_context = -(-model.max_model_len // model.page_size)
    if kv_cache_limit == "context":
        return KVPool(pages_per_context, model.page_size, per_token, "--kv-cache-limit context (one context)")
    ceiling = pages_per_context * concurrency
    if kv_cache_limit == "concurrency":
        return KVPool(ceiling, model.page_size, per_token,
                      f"--kv-cache-limit concurrency ({concurrency} × {model.max_model_len:,}-token context)")
    if device != "cuda":
        return KVPool(ceiling, model.page_size, per_token,
                      f"CPU serving: one context per active request ({concurrency} × {model.max_model_len:,})")
    import torch

    free, total = torch.cuda.mem_get_info()
    headroom = 1 << 30
    if memory_limit is None:
        budget = free - reserve_bytes - headroom - model.weight_bytes
        source = "free GPU memory" + (f" less the {reserve_bytes / 2**30:.1f} GiB reserve" if reserve_bytes else "")
    elif memory_limit.kind == "reserve":
        budget = free - int(memory_limit.value) - headroom - model.weight_bytes
        source = f"--memory-limit -{memory_limit.value / 2**30:.1f}G"
    else:
        cap = memory_limit.value if memory_limit.kind == "occupied" else memory_limit.value * total
        budget = min(free - headroom, int(cap)) - model.weight_bytes
        source = f"--memory-limit ({int(cap) / 2**30:.1f} GiB)"
    pages = max(0, budget) // (per_token * model.page_size)
    if pages < pages_per_context:
        raise CapacityError(
            f"needs {model.weight_bytes / 2**30:.2f} GiB weights + {pages_per_context * model.page_size:,} "
            f"tokens of KV cache ({pages_per_context * model.page_size * per_token / 2**30:.2f} GiB); "
            f"has {max(0, budget + model.weight_bytes) / 2**30:.2f} GiB after {source} and 1.0 GiB headroom. "
            f"Options: a smaller [memory] reserve, or --memory-limit with a larger budget.")
    return KVPool(int(pages), model.page_size, per_token, source)


# ---- settings from flags, configuration and the package ------------------------------------------------

def serving_concurrency(flag: int | None, config: Any, model: ServedModel) -> int:
    configured = None
    if config is not None and flag is None:
        configured = config.setting_for_model("max_concurrency", (model.canonical_id, *model.served_names))
    concurrency = flag if flag is not None else configured if configured is not None else model.prepared_concurrency
    origin = "--max-concurrency" if flag is not None else "max_concurrency in the configuration"
    if concurrency < 1:
        raise UsageError(f"{origin} must be at least 1, got {concurrency}")
    if not 1 <= concurrency <= model.prepared_concurrency:
        raise CapacityError(f"needs concurrency {concurrency} ({origin}); the package was prepared for at most "
                            f"{model.prepared_concurrency}. Options: --max-concurrency "
                            f"{model.prepared_concurrency} or less, or export again with --max-concurrency "
                            f"{concurrency}.")
    return concurrency


def api_key(listener: ListenerOptions, config: Any) -> str | None:
    from flare.server.auth import read_api_key_file

    if listener.api_key_file is not None:
        return read_api_key_file(listener.api_key_file) or None     # an empty file disables auth
    configured = getattr(getattr(config, "server", None), "api_key", None)
    return configured or None


def served_names(listener: ListenerOptions, model: ServedModel) -> tuple[str, ...]:
    if listener.served_model_name is None:
        return model.served_names or (model.canonical_id,)
    name = listener.served_model_name.strip()
    if not name:
        raise UsageError("--served-model-name must not be blank")
    return (name,)


# ---- listening ----------------------------------------------------------------------------------------

def open_listener(host: str, port: int) -> socket.socket:
    """A bound, listening socket on a numeric IPv4 or IPv6 address."""
    try:
        family, kind, proto, _, address = socket.getaddrinfo(
            host, port, type=socket.SOCK_STREAM, flags=socket.AI_NUMERICHOST | socket.AI_PASSIVE)[0]
    except socket.gaierror:
        raise UsageError(f"--host {host} is not a numeric IPv4 or IPv6 address (for IPv6 write it unbracketed, "
                         "such as --host ::1)") from None
    listener = socket.socket(family, kind, proto)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    if family == socket.AF_INET6:
        listener.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
    try:
        listener.bind(address)
    except OSError as error:
        listener.close()
        raise UsageError(f"cannot listen on {host} port {port}: {error.strerror}; choose another --port "
                         "or stop the process using it") from None
    listener.listen(2048)
    listener.setblocking(False)
    return listener


def url_for(host: str, port: int) -> str:
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


# ---- loading the model ----------------------------------------------------------------------------------

def serving_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model_weights(model: ServedModel, device: str, stages: StageReporter):
    """(ModelConfig, CausalLM) with the weights loaded, reporting bytes as they arrive."""
    import torch

    from flare.engine.attention import TorchReferenceBackend
    from flare.models import ModelConfig, build_model

    with stages.stage("Load weights", total=model.weight_bytes or None) as stage:
        cfg = ModelConfig.from_hf_config(model.hf_config)
        network = build_model(cfg, getattr(torch, model.dtype), device, TorchReferenceBackend())

        def counted():
            for name, tensor in model.iter_weights():
                stage.advance(tensor.numel() * tensor.element_size())
                yield name, tensor

        network.load_hf_weights(counted())
        stage.note(f"{_gib(model.weight_bytes)} {model.dtype} on {device}")
    return cfg, network


def engine_config_for(model: ServedModel, concurrency: int, pool: KVPool):
    from flare.engine.config import EngineConfig

    return EngineConfig(max_concurrency=concurrency, page_size=pool.page_size, num_pages=pool.pages,
                        prefill_chunk=model.prefill_chunk, max_num_batched_tokens=max(model.prefill_chunk, concurrency),
                        max_model_len=model.max_model_len)


def start_in_process(model: ServedModel, concurrency: int, pool: KVPool, device: str, stages: StageReporter):
    """debug-serve: load, prepare and allocate here; the core steps on a thread of this process."""
    from flare.engine.factory import LoadedModel, build_core
    from flare.frontend.tokenizer import eos_token_ids_of

    cfg, network = load_model_weights(model, device, stages)
    with stages.stage("Prepare kernels and graphs") as stage:
        stage.note("CPU: eager PyTorch, no graphs to prepare" if device != "cuda" else "eager decode")
    with stages.stage("Allocate caches") as stage:
        eos = tuple(dict.fromkeys((*cfg.eos_token_ids, *eos_token_ids_of(model.frontend_dir, None))))
        core = build_core(LoadedModel(cfg, network, eos, engine_config_for(model, concurrency, pool), device,
                                      model.dtype))
        stage.note(f"{pool.tokens:,} KV tokens in {pool.pages:,} pages of {pool.page_size}")

    def client(frontend: Any) -> Any:
        from flare.engine.llm_engine import LLMEngine
        from flare.server.local_engine import ThreadedEngine

        return ThreadedEngine(LLMEngine(core, frontend.tokenizer))
    return client


def start_engine_process(model: ServedModel, concurrency: int, pool: KVPool, device: str,
                         stages: StageReporter):
    """flare run: the engine core loads the package in its own process; its progress drives the stages."""
    import multiprocessing
    import queue
    import threading

    from flare.engine.factory import ModelFactory
    from flare.frontend.tokenizer import eos_token_ids_of, load_tokenizer
    from flare.server.package_model import STAGE_ALLOCATE, STAGE_PREPARE, load_package_model

    progress = multiprocessing.get_context("spawn").Queue()
    factory = ModelFactory(load_package_model, (str(model.package_path), engine_config_for(model, concurrency, pool),
                                                device, model.dtype, tuple(eos_token_ids_of(model.frontend_dir, None)),
                                                progress))
    outcome: dict[str, Any] = {}

    def start() -> None:
        try:
            from flare.engine.async_engine import AsyncEngine

            outcome["tokenizer"] = load_tokenizer(model.frontend_dir)
            outcome["engine"] = AsyncEngine(factory, outcome["tokenizer"])
        except BaseException as error:            # reported by the stage that is showing
            outcome["error"] = error

    starter = threading.Thread(target=start, name="flare-engine-start", daemon=True)
    starter.start()

    def follow(stage, until: str | None) -> None:
        """Advance `stage` from the engine's reports until it announces `until` (or finishes starting)."""
        while True:
            try:
                message = progress.get(timeout=0.1)
            except queue.Empty:
                if not starter.is_alive():
                    break
                continue
            if message[0] == "total":
                stage.set_total(message[1] or None)
            elif message[0] == "advance":
                stage.advance(message[1])
            elif message[0] == "stage" and message[1] == until:
                return
        if "error" in outcome:
            raise _startup_error(outcome["error"])

    with stages.stage("Load weights", total=model.weight_bytes or None) as stage:
        follow(stage, STAGE_PREPARE)
        stage.note(f"{_gib(model.weight_bytes)} {model.dtype} on {device}, in the engine process")
    with stages.stage(STAGE_PREPARE) as stage:
        follow(stage, STAGE_ALLOCATE)
        stage.note("CPU: eager PyTorch, no graphs to prepare" if device != "cuda" else "eager decode")
    with stages.stage(STAGE_ALLOCATE) as stage:
        starter.join()
        if "error" in outcome:
            raise _startup_error(outcome["error"])
        stage.note(f"{pool.tokens:,} KV tokens in {pool.pages:,} pages of {pool.page_size}")
    progress.close()
    client = lambda frontend: outcome["engine"]
    client.tokenizer = outcome["tokenizer"]
    return client


def _startup_error(error: BaseException) -> BaseException:
    """User-facing errors pass through; an engine that could not load becomes a preparation error (5)."""
    from flare.errors import FlareError, PreparationError

    if isinstance(error, FlareError):
        return error
    return PreparationError(f"the engine could not load the model: {error}")


# ---- serving ------------------------------------------------------------------------------------------

def serve(model: ServedModel, listener_options: ListenerOptions, config: Any, stages: StageReporter,
          stream: TextIO, startup_lines: Callable[[], list[str]] = lambda: []) -> int:
    """Everything after the model is known: engine, frontend, HTTP; returns when the server has drained."""
    from flare.server.frontend import ServingFrontend

    concurrency = serving_concurrency(listener_options.max_concurrency, config, model)
    if listener_options.kv_cache_limit not in KV_CACHE_LIMITS:
        raise UsageError(f"--kv-cache-limit must be one of {', '.join(KV_CACHE_LIMITS)}")
    memory_limit = parse_memory_limit(listener_options.memory_limit) if listener_options.memory_limit else None
    configured_reserve = getattr(getattr(config, "memory", None), "reserve", None)
    reserve = configured_reserve if configured_reserve is not None else model.memory_reserve_bytes
    device = serving_device()
    pool = size_kv_pool(model, concurrency, listener_options.kv_cache_limit, device, memory_limit, reserve)
    start = start_engine_process if model.package_path is not None else start_in_process
    client = start(model, concurrency, pool, device, stages)
    with stages.stage("Load frontend") as stage:
        frontend = ServingFrontend.from_dir(model.frontend_dir, getattr(client, "tokenizer", None))
        stage.note("the model's chat template" if frontend.chat_template.from_model
                   else "no chat template: plain role-prefixed chat layout")
    engine = client(frontend)
    try:
        server_config = getattr(config, "server", None)
        host = listener_options.host or getattr(server_config, "host", None) or "127.0.0.1"
        port = listener_options.port if listener_options.port is not None else getattr(server_config, "port", 8000)
        settings = ServerSettings(served_names=served_names(listener_options, model),
                                  canonical_id=model.canonical_id, max_model_len=model.max_model_len,
                                  max_concurrency=concurrency, kv_tokens=pool.tokens,
                                  api_key=api_key(listener_options, config), sampling=model.sampling)
        with stages.stage("Start HTTP") as stage:
            listener = open_listener(host, port)
            stage.note(url_for(host, port))
        report = startup_lines() + startup_report(model, settings, pool, concurrency, url_for(host, port))
        for line in report:
            print(line, file=stream, flush=True)
        return run_http(engine, frontend, settings, listener)
    finally:
        engine.shutdown()


def startup_report(model: ServedModel, settings: ServerSettings, pool: KVPool, concurrency: int,
                   url: str) -> list[str]:
    names = ", ".join(settings.served_names)
    return [
        f"Serving {names} (model {model.canonical_id}) at {url}/v1",
        f"  footprint: {_gib(model.weight_bytes)} weights + {_gib(pool.bytes)} KV cache",
        f"  KV cache: {pool.tokens:,} tokens allocated ({pool.pages:,} pages of {pool.page_size}); "
        f"limited by {pool.limited_by}",
        f"  concurrency {concurrency}, context {model.max_model_len:,} tokens, "
        f"authentication {'on' if settings.api_key else 'off'}",
    ]


def run_http(engine: Any, frontend: Any, settings: ServerSettings, listener: socket.socket) -> int:
    import uvicorn

    from flare.server.app import build_app

    app = build_app(engine, frontend, settings)
    state = app.state.serving

    class DrainingServer(uvicorn.Server):
        """On SIGINT/SIGTERM: /health turns 503, no new connections, active requests finish, then exit."""

        def handle_exit(self, sig, frame) -> None:
            state.draining = True
            state.ready = False
            super().handle_exit(sig, frame)
            # uvicorn re-raises a handled signal after shutdown; the drain is the intended exit, status 0
            self._captured_signals.clear()

    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=None,
                            limit_concurrency=None, backlog=2048)
    server = DrainingServer(config)
    server.run(sockets=[listener])
    return 0


def _gib(count: int) -> str:
    from flare.ui.progress import format_bytes

    return format_bytes(count)


# ---- flare run: a package ---------------------------------------------------------------------------------

@dataclass(frozen=True)
class RunOptions:
    target: str
    trust: Any                                  # flare.package.TrustOptions
    listener: ListenerOptions = ListenerOptions()
    config: Any = None                          # flare.config.Config
    model_cache: Path | None = None


def run_package(options: RunOptions, stream: TextIO | None = None) -> int:
    import contextlib

    from flare.package.store import lease_entry

    stream = stream or sys.stderr
    show_banner(stream, "loading " + str(options.target))
    stages = StageReporter(stream)
    cache_root = options.model_cache or getattr(getattr(options.config, "paths", None), "package_cache", None)
    with contextlib.ExitStack() as held:
        package = _open_package(options, stages, cache_root, stream,
                                lambda path: held.enter_context(lease_entry(path, cache_root)))
        held.callback(package.close)
        weight_bytes = sum(r["size"] for r in package.weight_payloads())
        return serve(_package_model(package, weight_bytes), options.listener, options.config, stages, stream)


def _open_package(options: RunOptions, stages: StageReporter, cache_root: Path | None, stream: TextIO,
                  hold: Callable[[Path], Any]):
    """The first three loading stages: signature, publisher acceptance, stored data. Holds the entry's
    lease (so `flare models remove` refuses it) from the moment it is found."""
    from flare.package import format as fmt
    from flare.package import verify
    from flare.package.reader import Package, _read_small_payloads, resolve_target
    from flare.package.trust import authorize, verify_signature

    with stages.stage("Verify package") as stage:
        path = resolve_target(options.target, cache_root)
        hold(path)
        files = fmt.read_package_files(path)
        manifest = files.primary.manifest
        key, key_source = verify_signature(files.primary.manifest_body, files.primary.signature, manifest,
                                           files.primary.profile_json, options.trust, str(files.primary_path))
        stage.note(f"{manifest['model_id']} {manifest['version']}, signed by {manifest['publisher']['namespace']}")
    with stages.stage("Publisher acceptance", animate=False) as stage:      # it may prompt at a terminal
        trust = authorize(manifest, key, key_source, options.trust, stream)
        stage.note(f"{trust.namespace} ({trust.identity})")
    weights = [r for r in manifest["payloads"] if r["kind"] == "weights"]
    scanned = sum(r["size"] for r in weights) if options.trust.verify_weights else 0
    with stages.stage("Verify stored data", total=scanned or None) as stage:
        verify.check_layout(files, manifest["payloads"])
        frontend_assets, catalogs = _read_small_payloads(files, manifest)
        if options.trust.verify_weights:
            verify.verify_payloads(files, weights, stage.advance)
        stage.note("frontend and graph catalogs" + (", all weights" if scanned else ""))
    return Package(path, files, manifest, trust, frontend_assets, catalogs)


def _package_model(package: Any, weight_bytes: int) -> ServedModel:
    manifest = package.manifest
    plan = manifest["plan"]
    sampling = manifest.get("sampling") or {}
    max_model_len = plan.get("max_model_len") or package.hf_config.get("max_position_embeddings")
    return ServedModel(
        canonical_id=manifest["model_id"], served_names=tuple(manifest["served_names"]),
        hf_config=package.hf_config, frontend_dir=package.frontend_dir(), dtype=plan["dtype"],
        page_size=int(plan["page_size"]), prefill_chunk=int(plan["prefill_chunk"]),
        prepared_concurrency=int(plan["max_concurrency"]), max_model_len=int(max_model_len),
        weight_bytes=weight_bytes, iter_weights=package.iter_weights,
        sampling=SamplingPolicy(sampling.get("defaults") or {}, sampling.get("ranges") or {}),
        memory_reserve_bytes=int(plan.get("memory_reserve_bytes") or 0), package_path=package.path)


# ---- ignition debug-serve: a checkpoint, no package --------------------------------------------------------

@dataclass(frozen=True)
class DebugOptions:
    checkpoint_dir: Path
    canonical_id: str
    served_names: tuple[str, ...]
    listener: ListenerOptions = ListenerOptions()
    config: Any = None
    recipe_concurrency: int = 8
    page_size: int = 16
    prefill_chunk: int = 512
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)


def debug_serve(options: DebugOptions, stream: TextIO | None = None) -> int:
    import json

    from flare.models import iter_safetensors
    from flare.models.loader import safetensors_files

    stream = stream or sys.stderr
    stages = StageReporter(stream)
    directory = Path(options.checkpoint_dir)
    hf_config = json.loads((directory / "config.json").read_text())
    concurrency = options.listener.max_concurrency or options.recipe_concurrency
    model = ServedModel(
        canonical_id=options.canonical_id, served_names=options.served_names, hf_config=hf_config,
        frontend_dir=directory, dtype="bfloat16" if serving_device() == "cuda" else "float32",
        page_size=options.page_size, prefill_chunk=options.prefill_chunk,
        prepared_concurrency=max(concurrency, options.recipe_concurrency),
        max_model_len=int(hf_config["max_position_embeddings"]),
        weight_bytes=sum(path.stat().st_size for path in safetensors_files(directory)),
        iter_weights=lambda: iter_safetensors(directory), sampling=options.sampling)
    lines = lambda: ["  debug-serve: diagnostic serving of a checkpoint; export a package for real serving"]
    return serve(model, options.listener, options.config, stages, stream, lines)
