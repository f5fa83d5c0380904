"""The model factory `flare run` hands the engine: runs in the engine-core process (spawned).

It reopens the package the frontend already verified, builds the model on the meta-free device path,
loads the weights from the memory-mapped payloads, puts the package's compiled kernels into the local
compile caches on a GPU, and reports its progress to the frontend's stage display through `report`
(start-up messages of `flare.engine.messages`, sent on the engine core's event socket).
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from flare.engine.factory import Report, ignore_progress
from flare.engine.messages import PrepareNote, WeightsLoaded, WeightsRead, WeightsTotal


def _load_compiled_artifacts(package) -> str:
    from flare.engine.compile_cache import CompiledArtifacts, load_artifacts

    stored = package.compiled_artifacts()
    return load_artifacts(CompiledArtifacts(*stored) if stored else None)


def load_package_model(package_path: str, engine_config: Any, device: str, dtype: str,
                       extra_eos_token_ids: tuple[int, ...] = (), report: Report = ignore_progress,
                       tokenizer_dir: str | None = None):
    """A `LoadedModel` for the package at `package_path` (already verified by the caller); `tokenizer_dir`
    holds the frontend's copy of the tokenizer files (the vocabulary grammars compile against)."""
    import torch

    from flare.engine.factory import LoadedModel, attention_backend_for, merge_token_ids
    from flare.models import ModelConfig, load_model
    from flare.package.reader import open_unverified

    package = open_unverified(Path(package_path))
    on_cuda = str(device).startswith("cuda")
    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flare-compiled") as background:
        # Putting the compiled kernels into the local caches imports the compiler (seconds): done meanwhile.
        compiled_note = background.submit(_load_compiled_artifacts, package) if on_cuda else None
        report(WeightsTotal(sum(r.size for r in package.weight_payloads())))
        cfg = ModelConfig.from_hf_config(package.hf_config, online_fp8=package.plan.online_fp8,
                                         kv_cache_dtype=package.plan.kv_cache_dtype)
        started = time.perf_counter()
        model = load_model(cfg, package.iter_weights(pinned=on_cuda), getattr(torch, dtype), device,
                           attention_backend_for(cfg, device), lambda count: report(WeightsRead(count)))
        draft = _load_draft(package, cfg, model, engine_config, dtype, device, report)
        report(WeightsLoaded(time.perf_counter() - started))
        if compiled_note is not None:
            report(PrepareNote(compiled_note.result()))
        if on_cuda:
            _use_prompt_kernel(model, package.plan.prefill_attention, device, getattr(torch, dtype), report)
    return LoadedModel(cfg, model, merge_token_ids(cfg.eos_token_ids, extra_eos_token_ids), engine_config,
                       device, dtype, compile_layers=package.plan.compile, tokenizer_dir=tokenizer_dir, draft=draft)


def _use_prompt_kernel(model, kernel: str, device: str, dtype, report: Report) -> None:
    """The plan's prompt attention kernel (after the package's builds reached the local caches)."""
    from flare.engine.prompt_kernel import use_prompt_kernel

    note = use_prompt_kernel(model, kernel, device, dtype).detail
    if note:
        report(PrepareNote(note))


def _load_draft(package, target_config, target, engine_config: Any, dtype: str, device: str, report: Report):
    """The package's learned draft as (model, ModelConfig), or None without one. Loaded also at
    --mtp-draft-tokens 0 (spec §5: reducing the draft count retains the draft's weights; the runner then
    keeps no draft state and runs it never)."""
    import torch

    from flare.engine.factory import build_draft

    speculation = package.plan.speculation
    if speculation is None or speculation.draft is None or not engine_config.speculation.draft_model:
        return None
    pinned = str(device).startswith("cuda")
    return build_draft(speculation.draft.config, lambda: package.iter_weights(pinned=pinned, draft=True),
                       target_config, getattr(torch, dtype), device, target,
                       lambda count: report(WeightsRead(count)))
