"""Model factories: picklable recipes for building the model inside the engine-core process.

A factory is a top-level function plus arguments that returns a `LoadedModel`. The engine-core
process calls it after it starts, so the weights are read there, not pickled across; the function gets
a `report` keyword through which it may tell the frontend its progress (`flare.engine.messages`'
start-up messages). A checkpoint directory loads through `load_checkpoint_model`; a package supplies
its own factory in the same shape.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from functools import partial
from pathlib import Path
from typing import TYPE_CHECKING, Any

from flare.engine.config import EngineConfig, local_engine_config
from flare.errors import UsageError

if TYPE_CHECKING:
    from flare.engine.messages import StartupProgress

Report = Callable[["StartupProgress"], None]    # the start-up messages, sent on the core's event socket


def ignore_progress(message: StartupProgress) -> None:
    """The report of a factory nobody watches."""


@dataclass(frozen=True)
class LoadedModel:
    model_config: Any                   # flare.models.ModelConfig
    model: Any                          # flare.models CausalLM, weights loaded
    eos_token_ids: tuple[int, ...]
    engine_config: EngineConfig
    device: str = "cpu"
    dtype: str = "float32"
    compile_layers: bool = True         # on CUDA, compile the decoder layers (False: --no-compile packages)
    tokenizer_dir: str | None = None    # the tokenizer's files: the vocabulary grammars compile against
    draft: tuple | None = None          # (draft model, its ModelConfig): a draft sharing the tokenizer


@dataclass(frozen=True)
class ModelFactory:
    """A top-level function and its (picklable) arguments; calling it builds a LoadedModel."""

    function: Callable[..., LoadedModel]
    args: tuple = ()
    kwargs: dict = field(default_factory=dict)

    def __call__(self, report: Report = ignore_progress) -> LoadedModel:
        return self.function(*self.args, report=report, **self.kwargs)


def load_checkpoint_model(directory: str | Path, engine_config: EngineConfig | None = None,
                          device: str = "cpu", dtype: str | None = None,
                          extra_eos_token_ids: tuple[int, ...] = (), report: Report = ignore_progress,
                          online_fp8: tuple[str, ...] = (), kv_cache_dtype: str = "auto") -> LoadedModel:
    """Load a Hugging Face checkpoint directory with the attention backend of its device.

    dtype defaults to float32 on a CPU and bfloat16 on CUDA. EOS ids: config.json's,
    generation_config.json's, then `extra_eos_token_ids` (the tokenizer's). Reports when the weights
    are loaded. `online_fp8` and `kv_cache_dtype` are a package plan's precision (models.load_checkpoint).
    """
    import time

    import torch

    from flare.engine.messages import WeightsLoaded
    from flare.models import load_checkpoint

    directory = Path(directory)
    dtype = dtype or default_dtype(device)
    from flare.models.loader import read_model_config

    backend = attention_backend_for(read_model_config(directory), device)
    started = time.perf_counter()
    model_config, model = load_checkpoint(directory, getattr(torch, dtype), device, backend, online_fp8=online_fp8,
                                          kv_cache_dtype=kv_cache_dtype)
    report(WeightsLoaded(time.perf_counter() - started))
    eos = merge_token_ids(model_config.eos_token_ids, generation_eos_token_ids(directory), extra_eos_token_ids)
    if engine_config is None:
        engine_config = local_engine_config(model_config.max_position_embeddings, model_config,
                                            torch.finfo(getattr(torch, dtype)).bits // 8)
    draft = None
    if engine_config.speculation.draft_model and engine_config.speculation.draft_tokens:
        draft = load_draft_model(directory, model_config, getattr(torch, dtype), device, target=model)
    return LoadedModel(model_config, model, eos, engine_config, device, dtype, tokenizer_dir=str(directory),
                       draft=draft)


def load_draft_model(directory: Path, target_config, dtype, device, target=None) -> tuple:
    """The learned draft a checkpoint supplies in its `draft/` folder
    (flare.engine.speculation.settings.supplied_draft): a draft model as (model, ModelConfig), or an
    EAGLE-3 head as (Eagle3Draft, Eagle3Config) over `target`; refused unless it shares the target's
    vocabulary."""
    from flare.engine.speculation.settings import supplied_draft
    from flare.models import iter_safetensors

    found = supplied_draft(directory)
    if found is None:
        raise UsageError(f"speculation with a draft model needs one: {directory} has no draft/ folder with a "
                         "config.json and safetensors weights")
    hf_config = json.loads((found / "config.json").read_text())
    return build_draft(hf_config, lambda: iter_safetensors(found), target_config, dtype, device, target)


def build_draft(hf_config: dict, weights, target_config, dtype, device, target=None, on_bytes=None) -> tuple:
    """A learned draft from its config.json and `weights()` (an iterable of checkpoint tensors, asked
    for once or twice): see `load_draft_model`."""
    from flare.models import ModelConfig, load_model
    from flare.models.eagle3 import ARCHITECTURE as EAGLE3, Eagle3Config, build_eagle3

    if EAGLE3 in (hf_config.get("architectures") or []):
        config = Eagle3Config.from_hf_config(hf_config)
        check_draft_vocabulary(config.layer, target_config)
        head = build_eagle3(config, [name for name, _ in weights()], dtype, device,
                            attention_backend(device, config.layer.head_dim))
        head.load_hf_weights(weights())
        if head.embed_tokens is None and target is not None:      # (None: a preparation's check alone)
            head.share_embedding(target.model.embed_tokens)
        return head, config
    config = ModelConfig.from_hf_config(hf_config)
    check_draft_vocabulary(config, target_config)
    model = load_model(config, weights(), dtype, device, attention_backend_for(config, device), on_bytes)
    return model, config


def check_window_pages(config: EngineConfig, model_config, dtype_bytes: int) -> None:
    """Refuse an engine configuration without the window pages the model's cache needs (DeepSeek V4)."""
    from flare.models.cache_spec import cache_spec

    spec = cache_spec(model_config, config.page_size, dtype_bytes)
    if spec.has_window and (not config.window_pages or config.window_retention < spec.window_retention):
        raise UsageError(f"this model's cache keeps window pages (a step reads {spec.window_retention} tokens back); "
                         "build its engine configuration with them: engine_config_for_pool(..., "
                         "window=spec.window_pool(...)) from flare.models.cache_spec")


def check_draft_vocabulary(draft_config, target_config) -> None:
    if draft_config.vocab_size != target_config.vocab_size:
        raise UsageError(f"the draft model's vocabulary has {draft_config.vocab_size:,} tokens and the target's "
                         f"{target_config.vocab_size:,}: a draft model must share the target's tokenizer")


def generation_eos_token_ids(directory: str | Path) -> tuple[int, ...]:
    """The EOS ids a checkpoint's generation_config.json declares (an int or a list), in order; () without one."""
    path = Path(directory) / "generation_config.json"
    if not path.is_file():
        return ()
    declared = json.loads(path.read_text()).get("eos_token_id")
    return merge_token_ids(t for t in (declared if isinstance(declared, list) else [declared]) if isinstance(t, int))


def merge_token_ids(*groups: Iterable[int]) -> tuple[int, ...]:
    """Every id of the groups once, in first-seen order (EOS ids from the config, generation config, tokenizer)."""
    return tuple(dict.fromkeys(token_id for group in groups for token_id in group))


def default_dtype(device: str) -> str:
    """bfloat16 on CUDA (half the bytes a decode step reads), float32 elsewhere."""
    return "bfloat16" if str(device).startswith("cuda") else "float32"


TRITON_MIN_HEAD_DIM = 16       # the kernels' tl.dot needs K >= 16


def attention_backend(device: str, head_dim: int = 128):
    """The paged Triton kernels on CUDA; the pure-PyTorch reference elsewhere, and for heads too
    narrow for the kernels (e.g. stories260k's 8)."""
    if str(device).startswith("cuda") and head_dim >= TRITON_MIN_HEAD_DIM:
        from flare.engine.attention_triton import TritonBackend

        return TritonBackend()
    from flare.engine.attention import TorchReferenceBackend

    return TorchReferenceBackend()


def attention_backend_for(cfg, device: str):
    """The attention backend of a model (`ModelConfig`): latent attention's for MLA (Triton on CUDA, the
    torch reference elsewhere), else `attention_backend` for its heads."""
    if cfg.mla is None:
        return attention_backend(device, cfg.head_dim)
    if str(device).startswith("cuda"):
        from flare.engine.mla_attention_triton import MlaTritonBackend

        return MlaTritonBackend()
    from flare.engine.mla_attention import MlaReferenceBackend

    return MlaReferenceBackend()


def build_core(loaded: LoadedModel, seed: int | None = None, load_tokenizer: Callable[[], Any] | None = None):
    """The EngineCore that runs `loaded`; on CUDA its layers are compiled and its decode steps captured.

    Constrained decoding compiles grammars against the tokenizer `load_tokenizer` returns (a Hugging Face
    tokenizer; default: the one in `loaded.tokenizer_dir`), read on a thread of its own from here on (neither
    the start nor the first constrained request waits for it)."""
    import torch

    from flare.engine.core import EngineCore
    from flare.engine.runner import ModelRunner
    from flare.engine.structured_output import StructuredOutputs

    from flare.engine.cuda_graphs import runs_triton_attention

    fast = str(loaded.device).startswith("cuda") and runs_triton_attention(loaded.model)
    if fast and loaded.compile_layers:
        from flare.engine.compile import compile_model

        compile_model(loaded.model)
    config = loaded.engine_config
    check_window_pages(config, loaded.model_config, torch.finfo(getattr(torch, loaded.dtype)).bits // 8)
    runner = ModelRunner(loaded.model, loaded.model_config, config, loaded.device,
                         getattr(torch, loaded.dtype), seed, graphs=fast, draft=loaded.draft)
    if load_tokenizer is None and loaded.tokenizer_dir is not None:
        load_tokenizer = partial(_hf_tokenizer, loaded.tokenizer_dir)
    structured = (StructuredOutputs(load_tokenizer, runner.vocab_size, loaded.eos_token_ids)
                  if load_tokenizer is not None else None)
    if structured is not None:
        structured.load_vocabulary()
    return EngineCore(config, runner, loaded.eos_token_ids, token_masker=structured)


def _hf_tokenizer(directory: str):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(directory)

