"""Loading the model and starting its engine, as the Load weights / Prepare kernels and graphs / Allocate
caches stages show it.

`flare run` starts the engine core in its own process (AsyncEngine) from a picklable package factory;
the core's start-up messages (`flare.engine.messages`) drive the stages. debug-serve loads in this
process and steps the core on a thread (ThreadedEngine). Each returns the engine client the routes use
and the tokenizer it detokenizes with (the frontend shares it).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from flare.server.served_model import ServedModel
from flare.ui.stages import Stage, StageReporter

if TYPE_CHECKING:
    from flare.engine.messages import StartupProgress

STAGE_PREPARE = "Prepare kernels and graphs"
STAGE_ALLOCATE = "Allocate caches"


def serving_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model_weights(model: ServedModel, device: str, stages: StageReporter):
    """(ModelConfig, CausalLM) with the weights loaded, reporting bytes as they arrive."""
    import torch

    from flare.engine.factory import attention_backend_for
    from flare.models import ModelConfig, load_model

    with stages.stage("Load weights", total=model.weight_bytes or None) as stage:
        cfg = ModelConfig.from_hf_config(model.hf_config)
        network = load_model(cfg, model.iter_weights(), getattr(torch, model.dtype), device,
                             attention_backend_for(cfg, device), stage.advance)
        stage.note(f"{gib(model.weight_bytes)} {model.dtype} on {device}")
    return cfg, network


def _load_draft_weights(model: ServedModel, target_config, target, engine_config: Any, device: str,
                        stages: StageReporter):
    """debug-serve's learned draft (the checkpoint's draft/ folder) as (model, ModelConfig), or None."""
    import torch

    from flare.engine.factory import build_draft

    if not engine_config.speculation.draft_model or model.iter_draft_weights is None:
        return None
    with stages.stage("Load draft weights") as stage:
        draft = build_draft(model.speculation.draft.config, model.iter_draft_weights, target_config,
                            getattr(torch, model.dtype), device, target, stage.advance)
        stage.note(f"{model.speculation.draft.kind} draft, {model.dtype} on {device}")
    return draft


def start_in_process(model: ServedModel, engine_config: Any, device: str, stages: StageReporter):
    """debug-serve: load, prepare and allocate here; the core steps on a thread of this process.
    Returns (ThreadedEngine, Tokenizer)."""
    from flare.engine.factory import LoadedModel, build_core, merge_token_ids
    from flare.engine_client.llm_engine import LLMEngine
    from flare.engine_client.threaded import ThreadedEngine
    from flare.frontend.tokenizer import eos_token_ids_of, load_tokenizer

    cfg, network = load_model_weights(model, device, stages)
    draft = _load_draft_weights(model, cfg, network, engine_config, device, stages)
    with stages.stage(STAGE_PREPARE) as stage:
        stage.note("CPU: eager PyTorch, no graphs to prepare" if device != "cuda" else "eager decode")
    with stages.stage(STAGE_ALLOCATE) as stage:
        eos = merge_token_ids(cfg.eos_token_ids, eos_token_ids_of(model.frontend_dir, None))
        core = build_core(LoadedModel(cfg, network, eos, engine_config, device, model.dtype,
                                      tokenizer_dir=str(model.frontend_dir), draft=draft))
        tokenizer = load_tokenizer(model.frontend_dir)
        stage.note(_pool_note(engine_config))
    return ThreadedEngine(LLMEngine(core, tokenizer)), tokenizer


def start_engine_process(model: ServedModel, engine_config: Any, device: str, stages: StageReporter,
                         diagnostics=None):
    """flare run: the engine core loads the package in its own process; its start-up messages drive the
    stages while the tokenizer loads here. `diagnostics` (flare.engine.step_profile.Diagnostics:
    --profile-startup, --profile-steps) says what the core's process records. Returns (AsyncEngine, Tokenizer)."""
    from concurrent.futures import ThreadPoolExecutor

    from flare.engine.factory import ModelFactory
    from flare.engine_client.connection import CoreConnection, EngineStartError
    from flare.frontend.tokenizer import eos_token_ids_of, load_tokenizer
    from flare.server.package_model import load_package_model

    factory = ModelFactory(load_package_model, (str(model.package_path), engine_config, device, model.dtype,
                                                tuple(eos_token_ids_of(model.frontend_dir, None))),
                           {"tokenizer_dir": str(model.frontend_dir)})
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flare-tokenizer") as loader:
        tokenizer = loader.submit(load_tokenizer, model.frontend_dir)
        connection = CoreConnection.spawn(factory, diagnostics=diagnostics)
        try:
            engine = _follow_startup(connection, tokenizer, model, engine_config, device, stages)
        except BaseException as error:
            connection.kill()
            connection.close()
            if not isinstance(error, Exception):
                raise
            if isinstance(error, EngineStartError) and error.failure.kind == "internal":
                stages.line(error.failure.traceback.rstrip())        # a defect: the log keeps where it was
            raise _startup_error(error) from None
    return engine, engine.tokenizer


def _follow_startup(connection, tokenizer, model: ServedModel, engine_config: Any, device: str,
                    stages: StageReporter):
    """The stages, each advanced by the core's start-up messages until the one that ends it."""
    from flare.engine.messages import ModelBuilt, WeightsLoaded
    from flare.engine_client.async_engine import AsyncEngine

    progress = connection.startup()
    with stages.stage("Load weights", total=model.weight_bytes or None) as stage:
        started = time.perf_counter()
        loaded, _ = _follow(progress, stage, WeightsLoaded)
        stage.note(f"{gib(model.weight_bytes)} {model.dtype} on {device}, in the engine process"
                   + _weights_timing(loaded.seconds, time.perf_counter() - started))
    with stages.stage(STAGE_PREPARE) as stage:
        _, notes = _follow(progress, stage, ModelBuilt)
        stage.note("CPU: eager PyTorch, no graphs to prepare" if device != "cuda" else "; ".join(notes))
    with stages.stage(STAGE_ALLOCATE) as stage:
        _follow(progress, stage, None)
        engine = AsyncEngine(connection, tokenizer.result())
        stage.note(_pool_note(engine_config))
    return engine


def _follow(progress: Iterator[StartupProgress], stage: Stage, until: type | None
            ) -> tuple[StartupProgress | None, list[str]]:
    """Apply start-up messages to `stage` until one of type `until` (None: until the core is ready);
    returns that message and the notes that came on the way."""
    from flare.engine.messages import PrepareNote, WeightsRead, WeightsTotal
    from flare.engine_client.protocol import EngineDeadError

    notes = []
    for message in progress:
        if isinstance(message, WeightsTotal):
            stage.set_total(message.size or None)
        elif isinstance(message, WeightsRead):
            stage.advance(message.size)
        elif isinstance(message, PrepareNote):
            notes.append(message.text)
        if until is not None and isinstance(message, until):
            return message, notes
    if until is not None:
        raise EngineDeadError(f"the engine core was ready without reporting {until.__name__}")
    return None, notes


def _weights_timing(weights_s: float | None, stage_s: float) -> str:
    """Where the stage's time went: starting the engine process (spawn, imports, device) or the bytes."""
    if weights_s is None:
        return ""
    return f" (process start {max(0.0, stage_s - weights_s):.1f} s, weights {weights_s:.1f} s)"


def _pool_note(engine_config: Any) -> str:
    return (f"{engine_config.kv_capacity_tokens:,} KV tokens in {engine_config.num_pages:,} pages of "
            f"{engine_config.page_size}")


def _startup_error(error: BaseException) -> BaseException:
    """User-facing errors pass through, also those the engine core raised (by kind); running out of GPU
    memory is a capacity error (4) with what to change; any other engine that could not load becomes a
    preparation error (5)."""
    from flare.engine_client.connection import EngineStartError
    from flare.errors import CapacityError, FetchError, FlareError, PreparationError, UsageError
    from flare.estimate import failed_allocation, is_out_of_memory

    if isinstance(error, FlareError):
        return error
    kind = error.failure.kind if isinstance(error, EngineStartError) else None
    user_error = {"usage": UsageError, "fetch": FetchError, "capacity": CapacityError,
                  "preparation": PreparationError}.get(kind)
    if user_error is not None:
        return user_error(error.failure.message)
    text = error.failure.message if isinstance(error, EngineStartError) else str(error)
    if kind == "out_of_memory" or (kind is None and is_out_of_memory(error)):
        allocation = failed_allocation(text) if "Tried to allocate" in text else ""
        return CapacityError(
            "ran out of GPU memory while the engine started" + (f": {allocation}" if allocation else "")
            + "\n       The KV pages were sized from the memory free at startup; something else took more."
            + "\n       Options: keep more free with --memory-limit -4G; a lower --max-concurrency; "
              "--kv-cache-limit context.")
    return PreparationError(f"the engine could not load the model: {error}")


def gib(count: int) -> str:
    from flare.ui.progress import format_bytes

    return format_bytes(count)
