"""Checkpoint tensors grouped into per-layer weight payloads, and read back from payloads.

Weights keep their checkpoint (Hugging Face) names; the model's `load_hf_weights` fuses them at load.
Grouping follows the semantic layer in the name: `*.layers.<i>.*` goes to `weights/layer-<i>`, the
token embedding to `weights/embed`, everything else (final norm, lm_head) to `weights/head`.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict
from pathlib import Path
from typing import Iterator

from flare.errors import PreparationError
from flare.package import safetensors_io as st

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")
_TORCH_TO_CODE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
                  "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                  "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_CODE_TO_TORCH = {code: name for name, code in _TORCH_TO_CODE.items()}


def payload_for(tensor_name: str) -> str:
    match = _LAYER.search(tensor_name)
    if match:
        return f"weights/layer-{int(match.group(1)):03d}.safetensors"
    if "embed_tokens" in tensor_name or "wte" in tensor_name:
        return "weights/embed.safetensors"
    return "weights/head.safetensors"


def checkpoint_tensor_files(checkpoint_dir: Path) -> dict[str, Path]:
    """Every tensor name in the checkpoint and the safetensors file holding it."""
    checkpoint_dir = Path(checkpoint_dir)
    index = checkpoint_dir / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: checkpoint_dir / file for name, file in weight_map.items()}
    files = sorted(checkpoint_dir.glob("*.safetensors"))
    if not files:
        raise PreparationError(f"{checkpoint_dir} has no .safetensors weights; Flare reads safetensors "
                               "checkpoints only")
    found = {}
    for path in files:
        with open(path, "rb") as handle:
            for entry in st.read_header(handle, what=str(path)).tensors:
                found[entry.name] = path
    return found


def group_by_payload(names) -> dict[str, list[str]]:
    groups: dict[str, list[str]] = defaultdict(list)
    for name in sorted(names):
        groups[payload_for(name)].append(name)
    order = sorted(groups, key=lambda payload: (not payload.endswith("embed.safetensors"),
                                                payload.endswith("head.safetensors"), payload))
    return {payload: groups[payload] for payload in order}


def read_checkpoint_group(names: list[str], files: dict[str, Path], dtype: str) -> list[st.TensorBytes]:
    """Read one payload's tensors from the checkpoint, floating-point ones cast to the serving dtype."""
    import torch
    from safetensors import safe_open
    target = getattr(torch, dtype)
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in names:
        by_file[files[name]].append(name)
    tensors = {}
    for path, file_names in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            for name in file_names:
                tensor = handle.get_tensor(name)
                if tensor.is_floating_point() and tensor.dtype != target:
                    tensor = tensor.to(target)
                tensors[name] = tensor
    return [tensor_bytes(name, tensors[name]) for name in names]


def tensor_bytes(name: str, tensor) -> st.TensorBytes:
    import torch
    code = _TORCH_TO_CODE[str(tensor.dtype).removeprefix("torch.")]
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    data = flat.view(torch.uint8).numpy().tobytes() if flat.numel() else b""
    return st.TensorBytes(name, code, tuple(tensor.shape), data)


def iter_tensors(path: Path, offset: int, size: int, what: str) -> Iterator[tuple[str, object]]:
    """Tensors of the safetensors payload at `path`[offset:offset+size], memory-mapped copy-on-write."""
    import mmap
    import torch
    with open(path, "rb") as handle:
        header = st.read_header(handle, offset, size, what=what)
        if header.total_size > size:
            raise PreparationError(f"{what} is truncated: its header describes {header.total_size} bytes, "
                                   f"the manifest {size}")
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    view = memoryview(mapped)
    for entry in header.tensors:
        dtype = getattr(torch, _CODE_TO_TORCH[entry.dtype])
        start, end = offset + entry.start, offset + entry.end
        if end > len(view):
            raise PreparationError(f"{what} is truncated at tensor {entry.name}")
        if start == end:
            yield entry.name, torch.empty(entry.shape, dtype=dtype)
            continue
        flat = torch.frombuffer(view[start:end], dtype=torch.uint8)
        yield entry.name, flat.view(dtype).reshape(entry.shape)
