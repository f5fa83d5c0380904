"""Loading the model and starting its engine, as the Load weights / Prepare kernels and graphs / Allocate
caches stages show it.

`flare run` starts the engine core in its own process (AsyncEngine) from a picklable package factory,
whose progress reports drive the stages; debug-serve loads in this process and steps the core on a thread.
Each returns a function that, given the frontend, gives the engine client the routes use.
"""

from __future__ import annotations

import time
from typing import Any

from flare.server.served_model import ServedModel
from flare.ui.stages import StageReporter


def serving_device() -> str:
    import torch

    return "cuda" if torch.cuda.is_available() else "cpu"


def load_model_weights(model: ServedModel, device: str, stages: StageReporter):
    """(ModelConfig, CausalLM) with the weights loaded, reporting bytes as they arrive."""
    import torch

    from flare.engine.factory import attention_backend
    from flare.models import ModelConfig, build_model

    with stages.stage("Load weights", total=model.weight_bytes or None) as stage:
        cfg = ModelConfig.from_hf_config(model.hf_config)
        network = build_model(cfg, getattr(torch, model.dtype), device, attention_backend(device, cfg.head_dim))

        def counted():
            for name, tensor in model.iter_weights():
                stage.advance(tensor.numel() * tensor.element_size())
                yield name, tensor

        network.load_hf_weights(counted())
        stage.note(f"{gib(model.weight_bytes)} {model.dtype} on {device}")
    return cfg, network


def start_in_process(model: ServedModel, engine_config: Any, device: str, stages: StageReporter):
    """debug-serve: load, prepare and allocate here; the core steps on a thread of this process."""
    from flare.engine.factory import LoadedModel, build_core, merge_token_ids
    from flare.frontend.tokenizer import eos_token_ids_of

    cfg, network = load_model_weights(model, device, stages)
    with stages.stage("Prepare kernels and graphs") as stage:
        stage.note("CPU: eager PyTorch, no graphs to prepare" if device != "cuda" else "eager decode")
    with stages.stage("Allocate caches") as stage:
        eos = merge_token_ids(cfg.eos_token_ids, eos_token_ids_of(model.frontend_dir, None))
        core = build_core(LoadedModel(cfg, network, eos, engine_config, device, model.dtype))
        stage.note(_pool_note(engine_config))

    def client(frontend: Any) -> Any:
        from flare.engine.llm_engine import LLMEngine
        from flare.server.local_engine import ThreadedEngine

        return ThreadedEngine(LLMEngine(core, frontend.tokenizer))
    return client


def start_engine_process(model: ServedModel, engine_config: Any, device: str, stages: StageReporter):
    """flare run: the engine core loads the package in its own process; its progress drives the stages."""
    import multiprocessing
    import queue
    import threading

    from flare.engine.factory import ModelFactory
    from flare.frontend.tokenizer import eos_token_ids_of, load_tokenizer
    from flare.server.package_model import STAGE_ALLOCATE, STAGE_PREPARE, load_package_model

    progress = multiprocessing.get_context("spawn").Queue()
    factory = ModelFactory(load_package_model, (str(model.package_path), engine_config,
                                                device, model.dtype, tuple(eos_token_ids_of(model.frontend_dir, None)),
                                                progress))
    outcome: dict[str, Any] = {}
    notes: list[str] = []                         # the engine's notes for the Prepare stage
    timings: dict[str, float] = {}

    def start() -> None:
        try:
            from concurrent.futures import ThreadPoolExecutor

            from flare.engine.async_engine import AsyncEngine

            with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flare-tokenizer") as loader:
                # The tokenizer loads while the engine process starts and reads the weights.
                outcome["engine"] = AsyncEngine(factory, loader.submit(load_tokenizer, model.frontend_dir))
            outcome["tokenizer"] = outcome["engine"].tokenizer
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
            elif message[0] == "note":
                notes.append(message[1])
            elif message[0] == "weights_seconds":
                timings["weights"] = message[1]
            elif message[0] == "stage" and message[1] == until:
                return
        if "error" in outcome:
            raise _startup_error(outcome["error"])

    with stages.stage("Load weights", total=model.weight_bytes or None) as stage:
        started = time.perf_counter()
        follow(stage, STAGE_PREPARE)
        stage.note(f"{gib(model.weight_bytes)} {model.dtype} on {device}, in the engine process"
                   + _weights_timing(timings.get("weights"), time.perf_counter() - started))
    with stages.stage(STAGE_PREPARE) as stage:
        follow(stage, STAGE_ALLOCATE)
        stage.note("CPU: eager PyTorch, no graphs to prepare" if device != "cuda" else "; ".join(notes))
    with stages.stage(STAGE_ALLOCATE) as stage:
        starter.join()
        if "error" in outcome:
            raise _startup_error(outcome["error"])
        stage.note(_pool_note(engine_config))
    progress.close()
    client = lambda frontend: outcome["engine"]
    client.tokenizer = outcome["tokenizer"]
    return client


def _weights_timing(weights_s: float | None, stage_s: float) -> str:
    """Where the stage's time went: starting the engine process (spawn, imports, device) or the bytes."""
    if weights_s is None:
        return ""
    return f" (process start {max(0.0, stage_s - weights_s):.1f} s, weights {weights_s:.1f} s)"


def _pool_note(engine_config: Any) -> str:
    return (f"{engine_config.kv_capacity_tokens:,} KV tokens in {engine_config.num_pages:,} pages of "
            f"{engine_config.page_size}")


def _startup_error(error: BaseException) -> BaseException:
    """User-facing errors pass through; running out of GPU memory is a capacity error (4) with what to
    change; any other engine that could not load becomes a preparation error (5)."""
    from flare.errors import CapacityError, FlareError, PreparationError
    from flare.estimate import failed_allocation, is_out_of_memory

    if isinstance(error, FlareError):
        return error
    text = str(error)
    if is_out_of_memory(error):
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
