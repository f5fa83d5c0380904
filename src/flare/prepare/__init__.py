"""The export pipeline: resolve, select device, load weights, tune, compile, allocate KV, capture, measure
steps, export.

`export_model(source, recipe, options)` is what `ignition export` runs once the model is resolved
and fetched (`RecipeFacts.from_resolved`); tests call it directly with a stand-in recipe. On a CPU
the tune, compile, capture and measure phases are recorded as skipped with the reason, and the package
serves the same way.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

import msgspec

from flare.config import (COMPILE_WORKERS, MAX_CONCURRENCY, MEMORY_RESERVE, PREFILL_CHUNK, PublishingConfig,
                          check_flag, load_config, package_cache, resolve)
from flare.errors import UsageError
from flare.memory import parse_gpus
from flare.package.export import ExportHooks, ExportSpec, export_entry
from flare.package.manifest import GraphCatalog, License, Plan, Preparation, Sampling, StepCostTable
from flare.package.signing import publishing_identity
from flare.package.store import ModelCache, model_key_for
from flare.recipes.base import DECODE_CAPACITIES, HISTORY_SPECULATION, Speculation, decode_capacities_for
from flare.speculation_plan import PreparationFlags, plan_speculation, speculation_summary
from flare.ui.progress import PhaseProgress, format_bytes


@dataclass(frozen=True)
class RecipeFacts:
    """What export takes from a recipe; `from_resolved` adapts the registry's Recipe and Checkpoint."""

    name: str
    model_id: str
    alias: str | None = None
    served_names: tuple[str, ...] = ()
    page_size: int = 16
    prefill_chunk: int = 512
    default_concurrency: int = 8
    max_concurrency: int = 64
    tensor_parallel_sizes: tuple[int, ...] = (1,)
    decode_capacities: tuple[int, ...] = DECODE_CAPACITIES
    dtype: str | None = None
    sampling_defaults: dict = field(default_factory=dict)
    sampling_ranges: dict = field(default_factory=dict)
    export_repository: str | None = None
    online_fp8_projections: tuple[str, ...] = ()    # what --online-mxfp8 converts; empty: it is refused
    speculation: Speculation = HISTORY_SPECULATION        # the recipe's declaration for the checkpoint

    @classmethod
    def from_resolved(cls, resolved) -> "RecipeFacts":
        """Adapt a `flare.resolve.ResolvedModel` (its Recipe and declared Checkpoint, if any)."""
        recipe, checkpoint = resolved.recipe, resolved.checkpoint
        if checkpoint is not None:
            model_id = checkpoint.served_name
        elif resolved.repo_id:
            model_id = resolved.repo_id
        else:
            model_id = Path(resolved.directory).name
        alias = checkpoint.alias if checkpoint is not None else None
        sampling = recipe.sampling_for(checkpoint)
        return cls(name=recipe.family, model_id=model_id, alias=alias,
                   served_names=tuple(dict.fromkeys(n for n in (model_id, alias) if n)),
                   page_size=recipe.page_size, prefill_chunk=recipe.prefill_chunk,
                   default_concurrency=recipe.concurrency.default, max_concurrency=recipe.concurrency.maximum,
                   tensor_parallel_sizes=tuple(recipe.tensor_parallel_sizes_for(resolved.hf_config)),
                   decode_capacities=tuple(recipe.decode_capacities),
                   sampling_defaults=sampling.defaults(),
                   sampling_ranges={name: list(bounds) for name, bounds in sampling.ranges.items()},
                   export_repository=checkpoint.export_repository if checkpoint is not None else None,
                   online_fp8_projections=recipe.online_fp8_projections,
                   speculation=recipe.speculation_for(checkpoint))


@dataclass(frozen=True)
class Settings:
    """The parts of the configuration file export reads ([publishing], [paths], [defaults], [memory])."""

    config_dir: Path
    config_path: Path
    publishing: PublishingConfig | None
    package_cache: Path
    memory_reserve_bytes: int
    exists: bool
    config: object                                 # the flare.config.Config they came from


@dataclass(frozen=True)
class ExportOptions:
    max_concurrency: int | None = None
    prefill_chunk: int | None = None
    gpus: str | None = None
    weight_mode: str = "normal"                    # normal, no-weights, reuse-weights
    repo_id: str | None = None
    official_source: str | None = None
    publisher_keys: tuple[Path, ...] = ()
    config_path: Path | None = None
    cache_root: Path | None = None                 # overrides [paths] package_cache
    dtype: str | None = None                       # overrides the device's serving dtype
    compile: bool = True                           # False: --no-compile (graphs of the eager layers)
    compile_workers: int | None = None             # --compile-workers, else [preparation] compile_workers
    online_fp8: bool = False                       # --online-mxfp8: the recipe's projections stored as FP8
    kv_cache_dtype: str | None = None              # --kv-cache-dtype, else "auto" (the serving dtype)
    speculation: PreparationFlags = PreparationFlags()     # --no-mtp, --mtp-draft-tokens, ...


@dataclass(frozen=True)
class CheckpointSource:
    directory: Path
    repo_id: str | None = None
    revision: str | None = None
    description: str | None = None                 # the resolver's one-line account, for the log
    # A learned draft's checkpoint (the target's draft/ folder, or the recipe's draft repository fetched);
    # None: none, or --no-mtp.
    draft_dir: Path | None = None
    draft_repo_id: str | None = None
    draft_revision: str | None = None


def load_settings(config_path: Path | None) -> Settings:
    """The configuration file's values export needs (flare.config does the reading and validation)."""
    config = load_config(config_path)
    return Settings(config_dir=config.config_dir, config_path=config.path, publishing=config.publishing,
                    package_cache=package_cache(None, config),
                    memory_reserve_bytes=resolve(MEMORY_RESERVE, None, config, 0).value,
                    exists=config.path.is_file(), config=config)


def check_flags(options: ExportOptions) -> None:
    """Refuse a bad flag value before anything is read or downloaded (the checks `resolve` applies)."""
    for setting, value in ((MAX_CONCURRENCY, options.max_concurrency), (PREFILL_CHUNK, options.prefill_chunk),
                           (COMPILE_WORKERS, options.compile_workers)):
        check_flag(setting, value)
    if options.gpus is not None:
        parse_gpus(options.gpus)


def export_model(source: CheckpointSource, recipe: RecipeFacts, options: ExportOptions = ExportOptions(),
                 progress: PhaseProgress | None = None, hooks: ExportHooks | None = None) -> Path:
    """Prepare a checkpoint and publish it as the model's new default cache entry; return its path."""
    progress = progress or PhaseProgress()
    settings = load_settings(options.config_path)
    if options.weight_mode not in ("normal", "no-weights", "reuse-weights"):
        raise UsageError("--no-weights and --reuse-weights cannot be combined")
    check_flags(options)
    cache = ModelCache(options.cache_root or settings.package_cache)
    identity = publishing_identity(settings.publishing, settings.config_dir, options.official_source)

    with progress.phase("Resolve model") as phase:
        hf_config = json.loads((source.directory / "config.json").read_text())
        architecture = (hf_config.get("architectures") or ["unknown"])[0]
        phase.done(f"{recipe.model_id}: {architecture}, "
                   + (source.description or f"checkpoint directory {source.directory}"))
    with progress.phase("Select GPUs") as phase:
        device = _device(options.gpus)
        dtype = options.dtype or recipe.dtype or ("bfloat16" if device == "cuda" else "float32")
        plan = _plan(recipe, options, settings, hf_config, dtype, draft_record(source, hf_config))
        fit = _fit_memory(source.directory, hf_config, plan, recipe, options.gpus, device,
                          source.draft_dir if _has_draft(plan) else None)
        selected = fit.selected
        plan = msgspec.structs.replace(plan, tensor_parallel=max(1, len(selected)))
        phase.done(f"{_device_label(selected)}; {dtype}; "
                   f"concurrency {plan.max_concurrency}, prefill chunk {plan.prefill_chunk:,}; "
                   f"{_speculation_line(plan.speculation)}")
    _load_weights(progress, source.directory, plan, device)
    if _has_draft(plan):
        _load_draft_weights(progress, source.draft_dir, plan, device, hf_config)
    workers = resolve(COMPILE_WORKERS, options.compile_workers, settings.config).value    # None: automatic
    with fit.allocation_guard():
        prepared = _prepare_code(source.directory, plan, device, progress, workers)
    if prepared is not None:
        plan = msgspec.structs.replace(plan, prefill_attention=prepared.prompt_kernel)
    if prepared is not None and prepared.step_costs is not None:
        plan = msgspec.structs.replace(plan, step_costs=step_cost_table(prepared.step_costs))
    if prepared is not None and prepared.prompt_graphs is not None:
        plan = msgspec.structs.replace(plan, prompt_graph_sizes=prepared.prompt_graphs.sizes,
                                       prompt_graph_bytes=prepared.prompt_graphs.capture_bytes)
    reuse_from = _reuse_source(cache, recipe, options) if options.weight_mode == "reuse-weights" else None
    with progress.phase("Export package") as phase:
        counts = {"written": 0, "reused": 0, "bytes": 0}

        def on_payload(name: str, size: int, reused: bool) -> None:
            counts["reused" if reused else "written"] += 1
            counts["bytes"] += size
            phase.update(f"Export package. {name}")
            phase.note(f"{'reused' if reused else 'wrote'} {name} ({format_bytes(size)})")
            if hooks and hooks.on_payload:
                hooks.on_payload(name, size, reused)

        preparation = msgspec.convert({"device": device, "phases": progress.summary()}, Preparation)
        spec = _export_spec(source, recipe, options, hf_config, plan, preparation, prepared)
        entry = export_entry(spec, cache, identity, options.weight_mode, reuse_from, ExportHooks(on_payload))
        phase.done(f"{counts['written']} payloads written, {counts['reused']} reused, "
                   f"{format_bytes(counts['bytes'])}; signed by {identity.namespace}")
    _write_initial_config(settings, recipe, plan)
    return entry


def _load_weights(progress: PhaseProgress, checkpoint_dir: Path, plan: Plan, device: str) -> None:
    """The Load weights phase: the checkpoint's tensors grouped into payloads and, on a CPU, loaded
    through the model once (`_load_through_model`)."""
    from flare.package import weights as wt

    with progress.phase("Load weights") as phase:
        files = wt.checkpoint_tensor_files(checkpoint_dir)
        groups = wt.group_by_payload(files)
        if device == "cpu":
            _load_through_model(checkpoint_dir, plan)
        online = (f"; {', '.join(plan.online_fp8)} as FP8 e4m3 with a float32 scale per 128x128 block"
                  if plan.online_fp8 else "")
        phase.done(f"{len(files)} tensors in {len(groups)} layer payloads, "
                   f"{format_bytes(wt.serving_bytes(files, plan.dtype, wt.online_fp8_of(plan)))} as {plan.dtype}"
                   + online + ("; loaded into the model" if device == "cpu" else ""))


def _export_spec(source: CheckpointSource, recipe: RecipeFacts, options: ExportOptions, hf_config: dict,
                 plan: Plan, preparation: Preparation, prepared) -> ExportSpec:
    """What the manifest will record of this preparation."""
    return ExportSpec(
        model_id=recipe.model_id, served_names=recipe.served_names or (recipe.model_id,),
        checkpoint_dir=source.directory, hf_config=hf_config, plan=plan, recipe_name=recipe.name,
        recipe_alias=recipe.alias, checkpoint_repo=source.repo_id, checkpoint_revision=source.revision,
        repository=options.repo_id or recipe.export_repository,
        sampling=Sampling(_sampling_defaults(recipe, source.directory),
                          {name: tuple(bounds) for name, bounds in recipe.sampling_ranges.items()}),
        license=_license(source), preparation=preparation, graphs=_graph_catalog(plan, prepared),
        compiled=prepared.artifacts if prepared else None, draft_dir=source.draft_dir if _has_draft(plan) else None)


def _has_draft(plan: Plan) -> bool:
    return plan.speculation is not None and plan.speculation.draft is not None


def draft_record(source: CheckpointSource, hf_config: dict):
    """The plan's record of the learned draft the source brings (None without one); its vocabulary must be
    the target's, since it drafts in the target's tokens."""
    from flare.package.manifest import DraftModel

    if source.draft_dir is None:
        return None
    config = json.loads((Path(source.draft_dir) / "config.json").read_text())
    from flare.models.eagle3 import ARCHITECTURE as EAGLE3

    kind = "eagle3" if EAGLE3 in (config.get("architectures") or []) else "model"
    if config.get("vocab_size") != hf_config.get("vocab_size"):
        raise UsageError(f"the draft model in {source.draft_dir} has a {config.get('vocab_size')}-token vocabulary "
                         f"and the target a {hf_config.get('vocab_size')}-token one: a draft model must share the "
                         "target's tokenizer")
    return DraftModel(kind, source.draft_repo_id, source.draft_revision, config)


def _load_draft_weights(progress: PhaseProgress, draft_dir: Path, plan: Plan, device: str, hf_config: dict) -> None:
    """The Load draft weights phase: the learned draft's tensors, loaded through its model on a CPU."""
    from flare.package import weights as wt

    with progress.phase("Load draft weights") as phase:
        files = wt.checkpoint_tensor_files(draft_dir)
        if device == "cpu":
            import torch

            from flare.engine.factory import build_draft
            from flare.models import ModelConfig, iter_safetensors

            build_draft(plan.speculation.draft.config, lambda: iter_safetensors(draft_dir),
                        ModelConfig.from_hf_config(hf_config), getattr(torch, plan.dtype), "cpu")
        phase.done(f"{len(files)} tensors of the draft model, {format_bytes(wt.serving_bytes(files, plan.dtype))} "
                   f"as {plan.dtype}" + ("; loaded into the model" if device == "cpu" else ""))


def _load_through_model(checkpoint_dir: Path, plan: Plan) -> None:
    """Load the checkpoint into the model once, as serving will, so that a tensor the model cannot take
    fails the export (a WeightError, exit 5, naming it) rather than `flare run`. On a GPU the compile
    phase's warm-up loads it the same way."""
    import torch

    from flare.engine.factory import attention_backend_for
    from flare.models import load_checkpoint
    from flare.models.loader import read_model_config

    backend = attention_backend_for(read_model_config(checkpoint_dir, plan.online_fp8), "cpu")
    load_checkpoint(checkpoint_dir, getattr(torch, plan.dtype), "cpu", backend,
                    online_fp8=plan.online_fp8, kv_cache_dtype=plan.kv_cache_dtype)


def _choose_prompt_kernel(checkpoint_dir: Path, plan: Plan, device: str):
    """The prompt attention kernel for the checkpoint's heads on this GPU (flare.engine.prompt_kernel)."""
    import torch

    from flare.engine.prompt_kernel import TRITON, PromptKernelChoice, choose_prompt_kernel
    from flare.models.loader import read_model_config

    cfg = read_model_config(checkpoint_dir, plan.online_fp8)
    if cfg.mla is not None:
        return PromptKernelChoice(TRITON, "Triton latent attention (MLA: FlashInfer's paged prefill is not a candidate)")
    return choose_prompt_kernel(device, getattr(torch, plan.dtype), plan.kv_cache_dtype, cfg.num_attention_heads,
                                cfg.num_key_value_heads, cfg.head_dim)


def _prepare_code(checkpoint_dir: Path, plan: Plan, device: str, progress: PhaseProgress,
                  compile_workers: int | None = None):
    """The tune, compile, allocate, capture and measure phases: on a GPU, a warm-up of the compiled model
    whose compiled kernels go into the package (flare.prepare.gpu, flare.engine.compile_cache), then its steps timed for the
    plan's step costs; on a CPU, nothing to prepare."""
    with progress.phase("Tune kernels") as phase:
        if device == "cpu":
            phase.skip("CPU device: nothing to tune")
        else:
            choice = _choose_prompt_kernel(checkpoint_dir, plan, device)
            plan = msgspec.structs.replace(plan, prefill_attention=choice.kernel)
            phase.done(choice.detail)
    if device == "cpu":
        for name, reason in (("Compile forward", "CPU device: forwards run eagerly"),
                             ("Allocate KV cache", "pages are sized from free device memory when the package is served"),
                             ("Capture graphs", "CUDA graphs need a GPU"),
                             ("Measure steps", "CPU device: no step costs recorded; balanced serving carries one "
                                               "prefill chunk beside decoding requests")):
            with progress.phase(name) as phase:
                phase.skip(reason)
        return None
    from flare.prepare.gpu import prepare_compiled
    with progress.phase("Compile forward") as phase:
        prepared = prepare_compiled(checkpoint_dir, plan, device, compile_workers)
        size = format_bytes(len(prepared.artifacts.data)) if prepared.artifacts else "nothing"
        if plan.compile:
            phase.done(f"decoder layers compiled and warmed up in {prepared.seconds:.1f} s; {size} of compiled "
                       "kernels kept for serving")
        else:
            phase.skip(f"--no-compile: eager layers, warmed up in {prepared.seconds:.1f} s")
    with progress.phase("Allocate KV cache") as phase:
        phase.skip("pages are sized from free device memory when the package is served")
    with progress.phase("Capture graphs") as phase:
        sizes, prompt = prepared.captured_sizes, prepared.prompt_graphs
        phase.done((f"{len(sizes)} decode batch sizes ({', '.join(map(str, sizes))}); "
                    "captured again when serving starts" if sizes else "no decode graphs on this backend")
                   + (f"; prompt steps: {_prompt_graphs_text(prompt.sizes, prompt.note, prompt.capture_bytes)}"
                      if prompt else ""))
    with progress.phase("Measure steps") as phase:
        costs = prepared.step_costs
        if costs is None:
            phase.skip("no step costs measured; balanced serving carries one prefill chunk beside decoding requests")
            return prepared
        phase.done(f"{len(costs.decode_batches) * len(costs.prompt_tokens)} step shapes timed in "
                   f"{prepared.step_cost_seconds:.1f} s on {costs.device}: decode batches "
                   f"{costs.decode_batches[0]}-{costs.decode_batches[-1]} beside 0-{costs.prompt_tokens[-1]:,} "
                   f"prompt tokens, {costs.milliseconds[0][0]:.1f}-{costs.milliseconds[-1][-1]:.1f} ms"
                   + (f"; decodes alone at {costs.long_context:,} tokens of context {costs.long_decode_ms[0]:.1f}-"
                      f"{costs.long_decode_ms[-1]:.1f} ms" if costs.long_context else ""))
    return prepared


def step_cost_table(costs) -> StepCostTable:
    """The plan's record of the step costs measured at export (`flare.engine.step_cost.StepCosts`)."""
    return StepCostTable(device=costs.device, decode_context=costs.decode_context,
                         decode_batches=costs.decode_batches, prompt_tokens=costs.prompt_tokens,
                         milliseconds=costs.milliseconds, long_context=costs.long_context,
                         long_decode_ms=costs.long_decode_ms)


def _graph_catalog(plan: Plan, prepared) -> GraphCatalog:
    """The graph catalog of each rank: the plan's decode sizes, which serving captures exactly, and its
    prompt-step buckets with what export's check of them found."""
    check = prepared.prompt_graphs if prepared is not None else None
    return GraphCatalog(plan.decode_capacities,
                        "captured when serving starts on a GPU whose attention runs the Triton kernels; "
                        "otherwise decode runs eagerly", prompt_tokens=plan.prompt_graph_sizes,
                        prompt_note=check.note if check is not None else "")


def _prompt_graphs_text(sizes: tuple[int, ...], note: str, capture_bytes: int = 0) -> str:
    """The prompt-step buckets in a line: how many, from which to which size, the check's note, and the
    memory their capture took (set aside when serving)."""
    if not sizes:
        return note
    return (f"{len(sizes)} token buckets ({sizes[0]}-{sizes[-1]:,}), {note}; their capture took "
            f"{capture_bytes / 2**30:.2f} GiB, set aside before KV pages when serving")


def _device(gpus: str | None) -> str:
    import torch
    if torch.cuda.is_available():
        return "cuda"
    if gpus:
        raise UsageError(f"--gpus {gpus}: no CUDA GPU is visible; omit --gpus to prepare on the CPU")
    return "cpu"


def _fit_memory(checkpoint_dir: Path, hf_config: dict, plan: Plan, recipe: RecipeFacts, gpus: str | None,
                device: str, draft_dir: Path | None = None) -> "MemoryFit":
    """The GPUs to prepare on (none on the CPU), refusing before any weight loads a model whose
    estimate does not fit them: the section-6 capacity error. A learned draft adds its weights and its
    K/V per cached token (its pages are the target's)."""
    from dataclasses import replace
    from flare.estimate import check_estimate, choose_gpus
    from flare.memory import check_gpu_selection, engine_headroom, memory_budget, read_device_memory
    from flare.memory import read_host_memory
    from flare.package import weights as wt

    draft_weights = wt.serving_bytes(wt.checkpoint_tensor_files(draft_dir), plan.dtype) if draft_dir else 0
    weights = wt.serving_bytes(wt.checkpoint_tensor_files(checkpoint_dir), plan.dtype, wt.online_fp8_of(plan))
    estimate = plan_estimate(hf_config, plan, weights + draft_weights, with_draft=draft_dir is not None)
    devices = read_device_memory() if device == "cuda" else [read_host_memory()]
    headroom = max(engine_headroom("preparation", plan.prefill_chunk), engine_headroom("serving"))
    budgets = [memory_budget(d, headroom, reserve=plan.memory_reserve_bytes) for d in devices]
    sizes = tuple(recipe.tensor_parallel_sizes)
    if device == "cpu":
        check_estimate(estimate, budgets)
        return MemoryFit((), estimate, tuple(budgets), tuple(budgets), sizes)
    if gpus is None:
        selected = tuple(choose_gpus(estimate, budgets, sizes))
    else:
        selected = tuple(parse_gpus(gpus))
        check_gpu_selection(selected, len(devices))
        if len(selected) not in sizes:
            raise UsageError(f"--gpus {gpus} selects {len(selected)} GPUs; {recipe.name} supports tensor-parallel "
                             f"sizes {', '.join(map(str, sizes))} for this checkpoint")
        check_estimate(replace(estimate, tensor_parallel=len(selected)), [budgets[i] for i in selected],
                       all_budgets=budgets, tensor_parallel_sizes=sizes)
    return MemoryFit(selected, replace(estimate, tensor_parallel=len(selected)),
                     tuple(budgets[i] for i in selected), tuple(budgets), sizes)


def plan_estimate(hf_config: dict, plan: Plan, weights_bytes: int, with_draft: bool = False):
    """The section-6 estimate (`flare.estimate.MemoryEstimate`) of serving `plan` with `weights_bytes` of
    weights: what serving sets aside beside the pages (scratch for the step budget, verification, live
    state, a cache's window pages), so that a package that prepares also serves here."""
    from flare.engine.config import serving_scratch_bytes, step_token_budget
    from flare.estimate import MemoryEstimate
    from flare.package import weights as wt
    from flare.recipes.base import (kv_bytes_per_token, kv_replicated, live_state_bytes_per_request, snapshot_bytes,
                                    window_pool)
    from flare.speculation_plan import speculation_memory

    dtype_bytes = wt.DTYPE_BYTES[plan.dtype]
    token_bytes = kv_bytes_per_token(hf_config, dtype_bytes, kv_cache_dtype=plan.kv_cache_dtype)
    if with_draft:
        token_bytes += kv_bytes_per_token(plan.speculation.draft.config, dtype_bytes)
    speculation = plan.speculation
    verify = speculation_memory(hf_config, plan.max_concurrency, speculation.draft_tokens if speculation else 0,
                                speculation.token_capacity if speculation else None, plan.page_size, token_bytes)
    return MemoryEstimate(
        weights_bytes=weights_bytes,
        graphs_bytes=serving_scratch_bytes(hf_config, plan.max_concurrency, plan.prefill_chunk, plan.online_fp8)
        + verify.scratch,
        live_state_bytes_per_request=live_state_bytes_per_request(hf_config, plan.page_size,
                                                                  plan.max_model_len) + verify.per_request,
        prefix_cache_bytes_per_request=snapshot_bytes(hf_config),
        kv_bytes_per_token=token_bytes,
        max_concurrency=plan.max_concurrency, max_context=plan.max_model_len or 0, page_size=plan.page_size,
        window=window_pool(hf_config, plan.page_size, step_token_budget(plan.prefill_chunk, plan.max_concurrency),
                           dtype_bytes),
        kv_replicated=kv_replicated(hf_config))


@dataclass(frozen=True)
class MemoryFit:
    """Where preparation runs and the estimate that admitted it, kept to report a failed allocation."""

    selected: tuple[int, ...]                  # GPU indices; empty on the CPU
    estimate: object                           # flare.estimate.MemoryEstimate
    budgets: tuple                             # the selected devices' budgets (the host's on a CPU)
    all_budgets: tuple
    tensor_parallel_sizes: tuple[int, ...]

    def allocation_guard(self):
        """A GPU out-of-memory error inside becomes the section-6 capacity error (exit 4)."""
        from flare.estimate import oom_as_capacity_error
        return oom_as_capacity_error(self.estimate, self.budgets, all_budgets=self.all_budgets,
                                     tensor_parallel_sizes=self.tensor_parallel_sizes)


def _speculation_line(speculation) -> str:
    if speculation is None:
        return speculation_summary(None)
    return speculation_summary(speculation.draft_tokens, speculation.adaptive)


def _device_label(selected: tuple[int, ...]) -> str:
    if not selected:
        return "CPU (no CUDA GPU visible)"
    from flare.memory import format_gpus, visible_devices
    visible = visible_devices()                 # CUDA_VISIBLE_DEVICES, the one variable Flare reads
    return (f"GPU{'s' if len(selected) > 1 else ''} {format_gpus(selected)}"
            + (f" of CUDA_VISIBLE_DEVICES={','.join(visible)}" if visible is not None else ""))


def _plan(recipe: RecipeFacts, options: ExportOptions, settings: Settings, hf_config: dict, dtype: str,
          draft=None) -> Plan:
    """The plan for one GPU (the caller sets `tensor_parallel` once the GPUs are chosen)."""
    concurrency = resolve(MAX_CONCURRENCY, options.max_concurrency, settings.config, recipe.default_concurrency,
                          names=(recipe.model_id, *recipe.served_names, recipe.alias))
    if not 1 <= concurrency.value <= recipe.max_concurrency:
        raise UsageError(f"{concurrency.origin} is outside {recipe.name}'s range 1 through {recipe.max_concurrency}")
    chunk = resolve(PREFILL_CHUNK, options.prefill_chunk, settings.config, recipe.prefill_chunk).value
    online_fp8, kv_cache_dtype = _precision(recipe, options, hf_config)
    capacities = tuple(decode_capacities_for(recipe.decode_capacities, concurrency.value))
    speculation = plan_speculation(recipe.speculation, options.speculation, settings.config,
                                   (recipe.model_id, *recipe.served_names, recipe.alias), capacities,
                                   recipe.alias or recipe.model_id, draft)
    return Plan(dtype=dtype, page_size=recipe.page_size, prefill_chunk=chunk, compile=options.compile,
                max_concurrency=concurrency.value, decode_capacities=capacities,
                max_model_len=hf_config.get("max_position_embeddings"),
                memory_reserve_bytes=settings.memory_reserve_bytes, tensor_parallel=1,
                online_fp8=online_fp8, kv_cache_dtype=kv_cache_dtype, speculation=speculation)


def _precision(recipe: RecipeFacts, options: ExportOptions, hf_config: dict) -> tuple[tuple[str, ...], str]:
    """The projections --online-mxfp8 stores as FP8 (the recipe's) and the KV cache dtype, checked against
    the checkpoint as serving will build it (an FP8 checkpoint refuses online FP8)."""
    from flare.models import ModelConfig

    online_fp8 = ()
    if options.online_fp8:
        if not recipe.online_fp8_projections:
            raise UsageError(f"--online-mxfp8: the {recipe.name} recipe names no projections it may store as "
                             "FP8; export without --online-mxfp8")
        online_fp8 = tuple(recipe.online_fp8_projections)
    kv_cache_dtype = options.kv_cache_dtype or "auto"
    ModelConfig.from_hf_config(hf_config, online_fp8=online_fp8, kv_cache_dtype=kv_cache_dtype)
    return online_fp8, kv_cache_dtype


def _sampling_defaults(recipe: RecipeFacts, checkpoint_dir: Path) -> dict:
    if recipe.sampling_defaults:
        return dict(recipe.sampling_defaults)
    path = checkpoint_dir / "generation_config.json"
    config = json.loads(path.read_text()) if path.is_file() else {}
    return {key: config[key] for key in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")
            if key in config}


def _license(source: CheckpointSource) -> License | None:
    """The license the checkpoint's model card declares (its `license:` front-matter field)."""
    readme = source.directory / "README.md"
    if not readme.is_file():
        return None
    text = readme.read_text(errors="replace")
    if not text.startswith("---"):
        return None
    front = text.split("---", 2)[1]
    fields = {key: value.strip().strip("'\"") for key, value in
              re.findall(r"^(license|license_name|license_link):\s*(\S+)", front, re.MULTILINE)}
    if "license" not in fields:
        return None
    name = fields["license"]
    if name == "other":                         # the hub's convention for a license it has no id for
        name = fields.get("license_name", name)
    link = fields.get("license_link")
    if link is None and source.repo_id:
        link = f"https://huggingface.co/{source.repo_id}/blob/{source.revision or 'main'}/README.md"
    return License(name, link)


def _reuse_source(cache: ModelCache, recipe: RecipeFacts, options: ExportOptions):
    """The model's cached default version, verified, for --reuse-weights."""
    from flare.package.reader import open_package
    from flare.package.trust import TrustOptions
    key = model_key_for(recipe.model_id)
    version = cache.default_version(key)
    if version is None:
        return None
    trust = TrustOptions(publisher_keys=options.publisher_keys, require_acceptance=False)
    return open_package(cache.entry_path(cache.resolve(f"{key}@{version}")), trust)


def _write_initial_config(settings: Settings, recipe: RecipeFacts, plan: Plan) -> None:
    """The first export writes the configuration file with the resolved values as comments."""
    if settings.exists:
        return
    from flare.config import write_initial_config
    write_initial_config(settings.config_path, {
        "defaults": {"model": recipe.alias or recipe.model_id, "max_concurrency": plan.max_concurrency},
        "memory": {"reserve": str(plan.memory_reserve_bytes)},
        "paths": {"package_cache": str(settings.package_cache)}})
