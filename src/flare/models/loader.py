"""The one weight-loading path, and reading a Hugging Face checkpoint directory (config.json and
memory-mapped, possibly sharded, safetensors).

`load_model(cfg, weights, dtype, device, attention_backend, on_bytes)` is how every model gets its weights:
a checkpoint (`load_checkpoint`, for tests, tools and the GPU preparation), a package in the engine-core
process (`server.package_model`), debug-serve (`server.engine_start`), and export's check that a
checkpoint loads (`prepare`). A weight source is any iterable of (checkpoint tensor name, CPU tensor):
`iter_safetensors` here, `Package.iter_weights` (mapped or pinned payloads) for a package.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path

from flare.models.config import ModelConfig
from flare.models.errors import WeightError

INDEX_FILE = "model.safetensors.index.json"
SINGLE_FILE = "model.safetensors"


def read_model_config(directory: Path, online_fp8: tuple[str, ...] = (), kv_cache_dtype: str = "auto") -> ModelConfig:
    return ModelConfig.from_hf_config(json.loads((Path(directory) / "config.json").read_text()),
                                      online_fp8=online_fp8, kv_cache_dtype=kv_cache_dtype)


def safetensors_files(directory: Path) -> list[Path]:
    """The weight files, from the shard index when there is one."""
    directory = Path(directory)
    index = directory / INDEX_FILE
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = [directory / name for name in sorted(set(weight_map.values()))]
    else:
        files = [directory / SINGLE_FILE]
    for file in files:
        if not file.is_file():
            raise WeightError(f"checkpoint file {file} is missing; download the checkpoint again")
    return files


def iter_safetensors(directory: Path) -> Iterator[tuple[str, "torch.Tensor"]]:  # noqa: F821
    """Every `(name, tensor)` of the checkpoint, read one at a time from memory-mapped files."""
    from safetensors import safe_open

    for file in safetensors_files(directory):
        with safe_open(file, framework="pt") as weights:
            for name in weights.keys():
                yield name, weights.get_tensor(name)


def load_model(cfg: ModelConfig, weights: Iterable[tuple[str, "torch.Tensor"]], dtype, device,  # noqa: F821
               attention_backend, on_bytes: Callable[[int], None] | None = None):
    """A `CausalLM` built for `cfg` on `device` in `dtype` (a torch dtype), its weights loaded from `weights`.

    The contract: `weights` yields every checkpoint tensor once, under its checkpoint (Hugging Face) name,
    as a CPU tensor in the stored dtype; each is consumed (copied, cast, fused) before the next is asked
    for, so a source may reuse its memory (pinned buffers). A missing, unexpected, duplicated or
    mis-shaped tensor raises `WeightError` (exit 5) naming it; nothing is half-loaded silently.
    `on_bytes` hears each tensor's stored size as it is consumed (progress).
    """
    from flare.models.registry import build_model

    model = build_model(cfg, dtype, device, attention_backend)
    if on_bytes is not None:
        weights = _counted(weights, on_bytes)
    model.load_hf_weights(weights)
    return model


def _counted(weights: Iterable[tuple[str, "torch.Tensor"]], on_bytes: Callable[[int], None]):  # noqa: F821
    for name, tensor in weights:
        on_bytes(tensor.numel() * tensor.element_size())
        yield name, tensor


def load_checkpoint(directory: Path, dtype, device, attention_backend, *, online_fp8: tuple[str, ...] = (),
                    kv_cache_dtype: str = "auto"):
    """`(ModelConfig, CausalLM)` for a checkpoint directory, weights loaded onto `device` in `dtype`.

    `online_fp8` (decoder projection names) converts those BF16 projections to FP8 while loading, as
    `ignition export --online-mxfp8` stores them; `kv_cache_dtype` "fp8" gives the model an FP8 KV cache."""
    cfg = read_model_config(directory, online_fp8, kv_cache_dtype)
    weights = iter_safetensors(directory)
    if online_fp8:
        from flare.models.fp8 import online_fp8_tensors

        weights = online_fp8_tensors(weights, cfg.fp8)
    return cfg, load_model(cfg, weights, dtype, device, attention_backend)
