"""`flare run` and `ignition debug-serve` as library calls: load in stages, then serve until a signal.

    run_package(RunOptions(...))          verify, accept, load and serve a package
    debug_serve(DebugOptions(...))        load a checkpoint directory and serve it, writing no package

Both describe what they serve as a `ServedModel`, then share the rest: engine, frontend, listener,
startup report, and a drain of active requests on SIGINT/SIGTERM. The port is reserved first, so a
busy or out-of-range one is reported before anything loads.
"""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, TextIO

from flare.errors import UsageError
from flare.server.cadence import serving_cadence, step_costs_of
from flare.server.engine_start import gib, serving_device, start_engine_process, start_in_process
from flare.server.kv_sizing import (KV_CACHE_LIMITS, KVPool, serving_engine_config, serving_kv_pool,
                                 serving_window_pool)
from flare.server.listener import Listener, reserve, run_http
from flare.server.retention_settings import retention_lines
from flare.server.served_model import ServedModel
from flare.server.settings import SamplingPolicy, ServerSettings
from flare.ui.banner import show_banner
from flare.ui.dashboard import Dashboard
from flare.ui.stages import StageReporter


@dataclass(frozen=True)
class ListenerOptions:
    host: str | None = None                 # None: [server] host, else 127.0.0.1
    port: int | None = None                 # None: [server] port, else 8000
    served_model_name: str | None = None
    api_key_file: Path | None = None
    max_concurrency: int | None = None
    kv_cache_limit: str = "memory"
    memory_limit: str | None = None
    scheduler_policy: Any = None            # flare.engine.policy.SchedulerPolicy; None: balanced, defaults
    max_step_ms: float | None = None        # --scheduler-max-step-ms; None: [scheduler] max_step_ms, else the default
    gpus: tuple[int, ...] | None = None     # --gpus; None: the first visible GPU (or the CPU)
    profile_startup: Path | None = None     # --profile-startup DIR: a cProfile of the engine core's start
    profile_steps: Path | None = None       # --profile-steps DIR: traces of a window of serving steps
    profile_steps_window: tuple[int, int] | None = None   # --profile-steps-window FIRST,COUNT; None: defaults
    speculation: Any = None                 # flare.speculation_plan.ServingFlags; None: the package's defaults
    prefix_cache_pool: str | None = None    # --prefix-cache-pool ADDRESS: share retained states (packages)
    prefix_cache_pool_ca: Path | None = None    # --prefix-cache-pool-ca FILE


# ---- settings from flags, configuration and the package ------------------------------------------------

def serving_concurrency(flag: int | None, config: Any, model: ServedModel) -> int:
    from flare.config import MAX_CONCURRENCY, resolve

    concurrency = resolve(MAX_CONCURRENCY, flag, config, model.prepared_concurrency,
                          fallback_origin="the package's prepared concurrency",
                          names=(model.canonical_id, *model.served_names))
    if concurrency.value > model.prepared_concurrency:
        raise UsageError(f"{concurrency.origin} exceeds the package's prepared concurrency "
                         f"{model.prepared_concurrency} (the package was prepared for at most "
                         f"{model.prepared_concurrency}); choose --max-concurrency {model.prepared_concurrency} "
                         f"or less, or export the package again with --max-concurrency {concurrency.value}")
    return concurrency.value


def api_key(listener: ListenerOptions, config: Any) -> str | None:
    from flare.config import API_KEY, resolve
    from flare.server.auth import read_api_key_file

    from_file = read_api_key_file(listener.api_key_file) if listener.api_key_file is not None else None
    return resolve(API_KEY, from_file, config).value or None        # an empty key file disables auth


def listener_address(listener: ListenerOptions, config: Any) -> tuple[str, int]:
    """Host and port: the flags, then [server] in the configuration, then 127.0.0.1 port 8000. A port is
    checked by the PORT setting (1-65535), the flag's here, the file's when the file was loaded."""
    from flare.config import HOST, PORT, resolve

    return (resolve(HOST, listener.host, config, "127.0.0.1", fallback_origin="the default").value,
            resolve(PORT, listener.port, config, 8000, fallback_origin="the default").value)


def select_gpus(listener: ListenerOptions, ranks: int = 1) -> ListenerOptions:
    """Narrow CUDA visibility to --gpus (one GPU per local rank; flare run serves single-rank packages),
    before this process or the engine core starts CUDA; returns the options with the selection applied."""
    from dataclasses import replace

    from flare.memory import select_serving_gpus

    if listener.gpus is None:
        return listener
    select_serving_gpus(listener.gpus, ranks)
    return replace(listener, gpus=None)


def serving_memory(listener: ListenerOptions, config: Any, model: ServedModel) -> tuple[str | None, int]:
    """(--memory-limit, reserve): the flag replaces the configured [memory] reserve, which replaces the
    package's serving reserve; the two are never subtracted together."""
    from flare.config import SERVING_MEMORY, resolve

    memory = resolve(SERVING_MEMORY, listener.memory_limit, config, model.memory_reserve_bytes,
                     fallback_origin="the package's serving reserve")
    return (memory.value, 0) if memory.source == "flag" else (None, memory.value)


def served_names(listener: ListenerOptions, model: ServedModel) -> tuple[str, ...]:
    """--served-model-name replaces the package's aliases (spec §3.2); the canonical ID stays accepted."""
    from flare.config import SERVED_MODEL_NAME, resolve

    flag = (listener.served_model_name,) if listener.served_model_name is not None else None
    return resolve(SERVED_MODEL_NAME, flag, None, model.served_names or (model.canonical_id,)).value


# ---- serving ------------------------------------------------------------------------------------------

def serve(model: ServedModel, listener_options: ListenerOptions, config: Any, stages: StageReporter,
          stream: TextIO, listener: Listener, startup_lines: Callable[[], list[str]] = lambda: []) -> int:
    """Everything after the model is known: engine, frontend, HTTP on `listener` (reserved already, so a
    busy port failed before anything loaded); returns the exit status once the server has stopped."""
    from flare.server.frontend import ServingFrontend

    listener_options = select_gpus(listener_options)
    concurrency = serving_concurrency(listener_options.max_concurrency, config, model)
    names, key = served_names(listener_options, model), api_key(listener_options, config)   # fail before loading
    if listener_options.kv_cache_limit not in KV_CACHE_LIMITS:
        raise UsageError(f"--kv-cache-limit must be one of {', '.join(KV_CACHE_LIMITS)}")
    memory_limit, reserve = serving_memory(listener_options, config, model)
    host, port = listener_address(listener_options, config)
    speculation = serving_speculation_settings(listener_options, model)
    device = serving_device()
    cadence = serving_cadence(listener_options.scheduler_policy, model.step_costs, concurrency, model.prefill_chunk,
                              listener_options.max_step_ms, config, packaged=model.package_path is not None)
    retention = serving_retention_settings(listener_options, config, model)
    pool = serving_kv_pool(model, concurrency, listener_options.kv_cache_limit, memory_limit, reserve, speculation,
                           retention)
    engine_config = serving_engine_config(model, concurrency, pool, cadence.policy, speculation, retention)
    if model.package_path is not None:
        engine, tokenizer = start_engine_process(model, engine_config, device, stages,
                                                 engine_diagnostics(listener_options))
    else:
        engine, tokenizer = start_in_process(model, engine_config, device, stages)
    try:
        with stages.stage("Load frontend") as stage:
            frontend = ServingFrontend.from_dir(model.frontend_dir, tokenizer)
            stage.note("the model's chat template" if frontend.chat_template.from_model
                       else "no chat template: plain role-prefixed chat layout")
        settings = ServerSettings(served_names=names, canonical_id=model.canonical_id,
                                  max_model_len=engine_config.max_model_len, max_concurrency=concurrency,
                                  kv_tokens=pool.tokens, api_key=key, sampling=model.sampling)
        with stages.stage("Start HTTP") as stage:
            listener.listen()
            stage.note(listener.url)
        report = startup_lines() + startup_report(model, settings, pool, engine_config, listener.url, device,
                                                  cadence.note, engine.stats())
        for line in report:
            print(line, file=stream, flush=True)
        dashboard = Dashboard.for_stream(stream, names[0], listener.url)   # None when redirected
        import gc

        # What start-up built lives as long as the server: collections during serving need not scan it,
        # and neither does the one at exit (seconds on a busy CPU with torch and transformers loaded).
        gc.collect()
        gc.freeze()
        status = run_http(engine, frontend, settings, listener, stream, dashboard)
    finally:
        engine.shutdown()
    print("Stopped" + (f" (exit status {status})" if status else ""), file=stream, flush=True)
    return status


def startup_report(model: ServedModel, settings: ServerSettings, pool: KVPool, engine_config: Any,
                   url: str, device: str, cadence: str | None = None, stats: Any = None) -> list[str]:
    """The lines `flare run` prints once it serves; `stats` (the engine's EngineStats at start) says what
    the prefix cache's tiers below the GPU hold."""
    names = ", ".join(settings.served_names)
    limit = engine_config.kv_pool_limited_by          # memory | context | concurrency
    if device != "cuda" and limit != "memory":
        limit += " (without a GPU the pool stops at one context per active request)"
    floor = [f"  KV floor: {pool.floor.describe()}"] if pool.floor is not None else []
    return [
        f"Serving {names} (model {model.canonical_id}) at {url}/v1",
        f"  footprint: {gib(model.weight_bytes)} weights + {gib(pool.bytes)} KV cache on {device}",
        f"  KV cache: {pool.tokens:,} tokens allocated ({pool.pages:,} pages of {pool.page_size}"
        + ("; FP8 e4m3 with per-token scales" if model.kv_cache_dtype == "fp8" else "") + f"); limited by {limit}",
        *floor,
        f"  concurrency {engine_config.max_concurrency}, context {engine_config.max_model_len:,} tokens, "
        f"authentication {'on' if settings.api_key else 'off'}",
        f"  scheduler {engine_config.scheduler_policy.name}: step budget {engine_config.max_num_batched_tokens:,} "
        f"tokens, prefill chunk {engine_config.prefill_chunk:,}",
        *([f"  cadence: {cadence}"] if cadence else []),
        f"  {speculation_line(engine_config.speculation)}",
        *retention_lines(engine_config.prefix_retention, stats),
    ]


def serving_retention_settings(listener: ListenerOptions, config: Any, model: ServedModel):
    """Prefix retention below the GPU: [prefix_cache], [paths] prefix_cache and the pool flags, which
    `flare run` applies to a package (debug-serve retains nothing below the GPU)."""
    from flare.engine.retention.settings import RetentionSettings
    from flare.server.retention_settings import PoolFlags, check_pool_flags, serving_retention

    pool = PoolFlags(listener.prefix_cache_pool, listener.prefix_cache_pool_ca)
    if model.identity is None:
        check_pool_flags(pool)
        if pool.address is not None:
            raise UsageError("--prefix-cache-pool shares the retained states of a package; debug-serve serves a "
                             "checkpoint: export it and use flare run")
        return RetentionSettings()
    retention = serving_retention(config, model.identity, pool)
    if retention.enabled and serving_window_pool(model, 1).page_bytes:
        where = f" in {config.path}" if config is not None else ""
        raise UsageError(f"[prefix_cache] memory{where} keeps prefix states of caches with one page kind; this "
                         "model's cache also has window pages (DeepSeek V4), which its prefix cache keeps on the "
                         "GPU only: remove [prefix_cache] memory (and [paths] prefix_cache, --prefix-cache-pool)")
    return retention


def engine_diagnostics(listener: ListenerOptions):
    """What the engine core's process records (--profile-startup, --profile-steps); None: nothing."""
    from flare.engine.step_profile import DEFAULT_FIRST_STEP, DEFAULT_STEP_COUNT, Diagnostics

    if listener.profile_startup is None and listener.profile_steps is None:
        return None
    first, count = listener.profile_steps_window or (DEFAULT_FIRST_STEP, DEFAULT_STEP_COUNT)
    return Diagnostics(str(listener.profile_startup) if listener.profile_startup else None,
                       str(listener.profile_steps) if listener.profile_steps else None, first, count)


def serving_speculation_settings(listener: ListenerOptions, model: ServedModel):
    """The engine's SpeculationSettings: the package's record reduced by the serving flags (spec §3.2)."""
    from flare.speculation_plan import ServingFlags, serving_speculation

    plan = model.speculation
    return serving_speculation(plan, listener.speculation or ServingFlags(),
                               draft_model=plan is not None and plan.draft is not None)


def speculation_line(settings) -> str:
    """The startup report's account of the engine's SpeculationSettings."""
    from flare.speculation_plan import speculation_summary

    if settings.draft_tokens == 0:
        return speculation_summary(None)
    if not settings.enabled:
        return (f"speculation: up to {settings.draft_tokens} draft tokens prepared, none proposed "
                "(no learned draft; --history-drafts copies them from decoded history)")
    return "speculation: " + speculation_summary(settings.draft_tokens, settings.adaptive, settings.history)


@dataclass(frozen=True)
class RunOptions:
    target: str
    trust: Any                                  # flare.package.TrustOptions
    listener: ListenerOptions = ListenerOptions()
    config: Any = None                          # flare.config.Config
    model_cache: Path | None = None
    download: Any = None                        # flare.package.download.DownloadOptions; None: from the above


def run_package(options: RunOptions, stream: TextIO | None = None) -> int:
    import contextlib

    from flare.package.store import lease_entry

    stream = stream or sys.stderr
    show_banner(stream, "loading " + str(options.target))
    stages = StageReporter(stream)
    download = download_options(options)
    listener = reserve(*listener_address(options.listener, options.config))   # a busy port fails first
    with contextlib.ExitStack() as held:
        held.callback(listener.close)
        package = open_package_in_stages(options, download, stages, stream,
                                lambda path: held.enter_context(lease_entry(path)))   # the cache it lies in
        held.callback(package.close)
        weight_bytes = sum(r.size for r in package.weight_payloads())
        return serve(_package_model(package, weight_bytes), options.listener, options.config, stages, stream,
                     listener)


def download_options(options: RunOptions):
    from flare.package.download import DownloadOptions

    if options.download is not None:
        return options.download
    return DownloadOptions(config=options.config, offline=bool(getattr(options.trust, "offline", False)),
                           model_cache=options.model_cache)


def open_package_in_stages(options: RunOptions, download: Any, stages: StageReporter, stream: TextIO,
                  hold: Callable[[Path], Any]):
    """The first three loading stages: signature, publisher acceptance, stored data. Holds the entry's
    lease (so `flare models remove` refuses it) from the moment it is found."""
    from flare.package import format as fmt
    from flare.package.download import resolve_package_target
    from flare.package.reader import Package, verify_stored_data
    from flare.package.trust import authorize, verify_signature

    path = resolve_package_target(options.target, download, stream=stream)   # may download, before the stages
    with stages.stage("Verify package") as stage:
        hold(path)
        files = fmt.read_package_files(path)
        manifest = files.primary.manifest
        key, key_source = verify_signature(files.primary.manifest_body, files.primary.signature, manifest,
                                           files.primary.profile_json, options.trust, str(files.primary_path))
        stage.note(f"{manifest.model_id} {manifest.version}, signed by {manifest.publisher.namespace}")
    warning = foreign_source_warning(path, manifest, download.cache_root)
    if warning:
        print(warning, file=stream, flush=True)
    with stages.stage("Publisher acceptance", animate=False) as stage:      # it may prompt at a terminal
        trust = authorize(manifest, key, key_source, options.trust, stream)
        stage.note(f"{trust.namespace} ({trust.identity})")
    scanned = sum(r.size for r in manifest.weight_payloads()) if options.trust.verify_weights else 0
    with stages.stage("Verify stored data", total=scanned or None) as stage:
        frontend_assets, catalogs, checked = verify_stored_data(files, options.trust.verify_weights, stage.advance)
        stage.note(stored_data_note(checked))
    return Package(path, files, manifest, trust, frontend_assets, catalogs, checked)


def stored_data_note(checked) -> str:
    """The Verify stored data stage's result: what was checked, and what was not."""
    from flare.ui.progress import format_bytes

    if checked.weights_hashed or checked.sampled_bytes == checked.weight_bytes:
        return f"every payload hashed: frontend, graphs and all weights ({format_bytes(checked.weight_bytes)})"
    sampled = (f"{format_bytes(checked.sampled_bytes)} of {format_bytes(checked.weight_bytes)} of weights "
               "hashed in sampled blocks" if checked.sampled else "no sampled weight hashes recorded")
    return (f"sizes, headers, frontend and graph payloads checked; {sampled}; "
            "the rest unhashed (--verify-weights hashes it)")


def foreign_source_warning(path: Path, manifest: Any, cache_root: Path) -> str | None:
    """A warning when the entry at `path` was downloaded from a repository other than its signed official
    source (spec: printed on every load); None for local packages and downloads from the official source."""
    from flare.package.sources import SourceRecords
    from flare.package.store import ModelCache

    origin = SourceRecords(ModelCache(Path(cache_root))).origin_of_path(path)
    if origin is None:
        return None
    source = manifest.publisher.official_source
    official = source_repository(source)
    if official is not None and official.casefold() == origin.repository.casefold():
        return None
    return (f"warning: {manifest.model_id} was downloaded from {origin.repository}, which is not its signed "
            f"official source {source or '(none: a development key)'}")


def source_repository(url: str) -> str | None:
    """ORG/NAME of an official source URL such as https://huggingface.co/Org/Name (None if it names none)."""
    from urllib.parse import urlparse

    parts = [part for part in urlparse(url).path.split("/") if part]
    return "/".join(parts[:2]) if url.startswith(("https://", "http://")) and len(parts) >= 2 else None


def _package_model(package: Any, weight_bytes: int) -> ServedModel:
    from flare.engine.retention.settings import package_identity

    manifest = package.manifest
    plan = manifest.plan
    max_model_len = plan.max_model_len or package.hf_config.get("max_position_embeddings")
    return ServedModel(
        canonical_id=manifest.model_id, served_names=manifest.served_names,
        hf_config=package.hf_config, frontend_dir=package.frontend_dir(), dtype=plan.dtype,
        page_size=plan.page_size, prefill_chunk=plan.prefill_chunk,
        prepared_concurrency=plan.max_concurrency, max_model_len=int(max_model_len),
        weight_bytes=weight_bytes, iter_weights=package.iter_weights,
        sampling=SamplingPolicy(manifest.sampling.defaults, manifest.sampling.ranges),
        memory_reserve_bytes=plan.memory_reserve_bytes, package_path=package.path,
        decode_capacities=plan.decode_capacities, kv_cache_dtype=plan.kv_cache_dtype, online_fp8=plan.online_fp8,
        step_costs=step_costs_of(plan), prompt_graph_sizes=plan.prompt_graph_sizes,
        prompt_graph_bytes=plan.prompt_graph_bytes, speculation=plan.speculation,
        identity=package_identity(package.files.primary.manifest_body))


# ---- ignition debug-serve: a checkpoint, no package --------------------------------------------------------

@dataclass(frozen=True)
class DebugOptions:
    checkpoint_dir: Path
    canonical_id: str
    served_names: tuple[str, ...]
    listener: ListenerOptions = ListenerOptions()
    config: Any = None
    recipe_concurrency: int = 8                # the recipe's default concurrency
    recipe_max_concurrency: int = 256          # and its limit
    page_size: int = 16
    prefill_chunk: int = 512
    sampling: SamplingPolicy = field(default_factory=SamplingPolicy)
    decode_capacities: tuple[int, ...] = ()    # the recipe's captured batch sizes; empty: the standard ones
    speculation: Any = None                    # the SpeculationPlan the preparation flags made; None: off
    draft_dir: Path | None = None              # the learned draft's checkpoint, when the plan has one


def _debug_concurrency(options: DebugOptions) -> int:
    """--max-concurrency, then the configuration, then the recipe default, within the recipe's range."""
    from flare.config import MAX_CONCURRENCY, resolve

    concurrency = resolve(MAX_CONCURRENCY, options.listener.max_concurrency, options.config,
                          options.recipe_concurrency, names=(options.canonical_id, *options.served_names))
    if concurrency.value > options.recipe_max_concurrency:
        raise UsageError(f"{concurrency.origin} is outside the recipe's range 1 through "
                         f"{options.recipe_max_concurrency}")
    return concurrency.value


def _draft_weights(options: DebugOptions):
    """debug-serve reads a learned draft from the directory its plan record came from."""
    from flare.models import iter_safetensors

    draft_dir = options.draft_dir
    return (lambda: iter_safetensors(draft_dir)) if draft_dir is not None else None


def debug_serve(options: DebugOptions, stream: TextIO | None = None) -> int:
    import json

    from flare.models import iter_safetensors
    from flare.models.loader import safetensors_files

    stream = stream or sys.stderr
    stages = StageReporter(stream)
    listener_options = select_gpus(options.listener)          # before the device is first asked for
    listener = reserve(*listener_address(listener_options, options.config))   # a busy port fails first
    directory = Path(options.checkpoint_dir)
    hf_config = json.loads((directory / "config.json").read_text())
    concurrency = _debug_concurrency(options)
    model = ServedModel(
        canonical_id=options.canonical_id, served_names=options.served_names, hf_config=hf_config,
        frontend_dir=directory, dtype="bfloat16" if serving_device() == "cuda" else "float32",
        page_size=options.page_size, prefill_chunk=options.prefill_chunk,
        prepared_concurrency=concurrency, decode_capacities=options.decode_capacities,
        max_model_len=int(hf_config["max_position_embeddings"]),
        weight_bytes=sum(path.stat().st_size for path in safetensors_files(directory)),
        iter_weights=lambda: iter_safetensors(directory), sampling=options.sampling,
        speculation=options.speculation, iter_draft_weights=_draft_weights(options))
    lines = lambda: ["  debug-serve: diagnostic serving of a checkpoint; export a package for real serving"]
    try:
        return serve(model, listener_options, options.config, stages, stream, listener, lines)
    finally:
        listener.close()
