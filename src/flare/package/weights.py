"""Checkpoint tensors grouped into per-layer weight payloads, and read back from payloads.

Weights keep their checkpoint (Hugging Face) names; the model's `load_hf_weights` fuses them at load.
Grouping follows the semantic layer in the name: `*.layers.<i>.*` goes to `weights/layer-<i>`, the
token embedding to `weights/embed`, everything else (final norm, lm_head) to `weights/head`.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict
from pathlib import Path
from typing import Iterator

from flare.errors import PreparationError
from flare.models.quantization import Fp8Weights, online_conversion, online_fp8
from flare.package import safetensors_io as st
from flare.package.manifest import TensorRecord

_LAYER = re.compile(r"^(.*?)(?:^|\.)(?:layers|h|blocks)\.(\d+)\.")
# Prefixes under which a checkpoint keeps its language model's decoder layers.
_DECODER_PREFIXES = ("", "model", "model.language_model", "language_model.model", "transformer", "model.decoder")
_TORCH_TO_CODE = {"float32": "F32", "bfloat16": "BF16", "float16": "F16", "float64": "F64", "int64": "I64",
                  "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                  "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_CODE_TO_TORCH = {code: name for name, code in _TORCH_TO_CODE.items()}


CAST_DTYPES = ("float16", "bfloat16", "float32", "float64")     # cast to the serving dtype at export
DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2, "float64": 8, "float8_e4m3fn": 1, "float8_e5m2": 1}
# FP8 scales (flare.models.quantization) are kept in float32 whatever the serving dtype: bfloat16 would
# round a float32 scale to 3 significant digits, and the layers hold them in float32 anyway.
SCALE_SUFFIXES = (".weight_scale_inv", ".weight_scale", ".input_scale")


def stored_dtype(name: str, dtype: str) -> str:
    """The dtype a floating-point checkpoint tensor is exported in."""
    return "float32" if name.endswith(SCALE_SUFFIXES) else dtype


def online_fp8_of(plan) -> Fp8Weights | None:
    """The online FP8 layout a plan (`flare.package.manifest.Plan`) stores, if any."""
    return online_fp8(plan.online_fp8) if plan.online_fp8 else None


def stored_tensors(name: str, code: str, shape, dtype: str,
                   online_fp8: Fp8Weights | None = None) -> list[tuple[str, str, tuple[int, ...]]]:
    """What export writes for one checkpoint tensor, as (name, safetensors dtype, shape): floats cast to
    the serving dtype (scales to float32), other tensors as stored, and a projection `online_fp8`
    converts as its e4m3 values and their float32 `weight_scale_inv` (flare.models.quantization)."""
    conversion = online_fp8 and online_conversion(name, shape, online_fp8)
    if conversion:
        return [(name, "F8_E4M3", tuple(shape)), (conversion[0], "F32", conversion[1])]
    if _CODE_TO_TORCH.get(code) in CAST_DTYPES:
        code = _TORCH_TO_CODE[stored_dtype(name, dtype)]
    return [(name, code, tuple(shape))]


def serving_bytes(files: dict[str, Path], dtype: str, online_fp8: Fp8Weights | None = None) -> int:
    """Bytes the checkpoint's tensors occupy as export stores them (`stored_tensors`; headers only)."""
    total = 0
    for path in sorted(set(files.values())):
        with open(path, "rb") as handle:
            for entry in st.read_header(handle, what=str(path)).tensors:
                if entry.name in files:
                    total += sum(st.DTYPE_SIZES[code] * math.prod(shape) for _, code, shape
                                 in stored_tensors(entry.name, entry.dtype, entry.shape, dtype, online_fp8))
    return total


def payload_for(tensor_name: str) -> str:
    """The payload holding a tensor: one per decoder layer; other stacks (a vision tower, MTP layers)
    get their own layer payloads named by their prefix, so they never mix with the decoder's."""
    match = _LAYER.match(tensor_name)
    if match:
        prefix, index = match.group(1), int(match.group(2))
        if prefix in _DECODER_PREFIXES:
            return f"weights/layer-{index:03d}.safetensors"
        return f"weights/{prefix.replace('.', '-').replace('_', '-')}-layer-{index:03d}.safetensors"
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


def planned_tensors(names: list[str], files: dict[str, Path], dtype: str,
                    online_fp8: Fp8Weights | None = None) -> tuple[TensorRecord, ...]:
    """The tensor list export writes for the payload of these checkpoint tensors (names, stored dtypes,
    shapes, offsets), from the checkpoint's headers alone: what `read_checkpoint_group` would lay out."""
    entries: dict[str, st.TensorEntry] = {}
    for path in sorted({files[name] for name in names}):
        with open(path, "rb") as handle:
            entries.update((entry.name, entry) for entry in st.read_header(handle, what=str(path)).tensors)
    records, offset = [], 0
    for name in names:
        entry = entries[name]
        for stored_name, code, shape in stored_tensors(name, entry.dtype, entry.shape, dtype, online_fp8):
            size = st.DTYPE_SIZES[code] * math.prod(shape)
            records.append(TensorRecord(stored_name, code, shape, (offset, offset + size)))
            offset += size
    return tuple(records)


def read_checkpoint_group(names: list[str], files: dict[str, Path], dtype: str,
                          online_fp8: Fp8Weights | None = None) -> list[st.TensorBytes]:
    """Read one payload's tensors from the checkpoint as `stored_tensors` says: 16/32/64-bit floats cast to
    the serving dtype, projections `online_fp8` converts quantized to e4m3 blocks."""
    import torch
    from safetensors import safe_open
    by_file: dict[Path, list[str]] = defaultdict(list)
    for name in names:
        by_file[files[name]].append(name)
    tensors = {}
    for path, file_names in by_file.items():
        with safe_open(str(path), framework="pt") as handle:
            for name in file_names:
                tensors[name] = handle.get_tensor(name)
    stored = []
    for name in names:
        tensor = tensors.pop(name)
        conversion = online_fp8 and online_conversion(name, tuple(tensor.shape), online_fp8)
        if conversion:
            from flare.kernels.fp8_reference import quantize_blocks
            quantized, scale = quantize_blocks(tensor, online_fp8.block)
            stored += [tensor_bytes(name, quantized), tensor_bytes(conversion[0], scale)]
            continue
        target = getattr(torch, stored_dtype(name, dtype))
        if str(tensor.dtype).removeprefix("torch.") in CAST_DTYPES and tensor.dtype != target:
            tensor = tensor.to(target)      # quantized (float8) and integer tensors keep their bytes
        stored.append(tensor_bytes(name, tensor))
    return stored


def tensor_bytes(name: str, tensor) -> st.TensorBytes:
    import torch
    code = _TORCH_TO_CODE[str(tensor.dtype).removeprefix("torch.")]
    flat = tensor.detach().cpu().contiguous().reshape(-1)
    # A view of the tensor's memory, not a copy: export writes and hashes it straight from there.
    data = memoryview(flat.view(torch.uint8).numpy()) if flat.numel() else b""
    return st.TensorBytes(name, code, tuple(tensor.shape), data)


def iter_tensors(path: Path, offset: int, size: int, what: str) -> Iterator[tuple[str, object]]:
    """Tensors of the safetensors payload at `path`[offset:offset+size], memory-mapped copy-on-write."""
    import mmap
    import torch
    with open(path, "rb") as handle:
        header = _checked_header(handle, offset, size, what)
        mapped = mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_COPY)
    if offset + size > len(mapped):
        raise PreparationError(f"{what} is truncated: the file ends before the manifest's {size} bytes")
    yield from _tensor_views(torch.frombuffer(memoryview(mapped), dtype=torch.uint8)[offset:offset + size],
                             header, what)


def iter_tensors_pinned(payloads: list[tuple[Path, int, int, str]]) -> Iterator[tuple[str, object]]:
    """Tensors of several payloads ((path, offset, size, what) each), read whole into page-locked memory.

    For loading onto a GPU: large sequential reads instead of page faults on a mapping, and copies to the
    device at full speed. While one payload's tensors are consumed, a thread reads the next one into a
    second buffer; a consumer must be done with each tensor (e.g. copied it synchronously) before it asks
    for the next payload's.
    """
    import torch
    from concurrent.futures import ThreadPoolExecutor
    if not payloads:
        return
    largest = max(size for _, _, size, _ in payloads)
    pin = torch.cuda.is_available()              # (without CUDA the same reads, into ordinary memory)
    buffers = [torch.empty(largest, dtype=torch.uint8, pin_memory=pin) for _ in range(min(2, len(payloads)))]

    def read(index: int):
        path, offset, size, what = payloads[index]
        buffer = buffers[index % len(buffers)][:size]
        with open(path, "rb") as handle:
            header = _checked_header(handle, offset, size, what)
            handle.seek(offset)
            if handle.readinto(memoryview(buffer.numpy())) != size:
                raise PreparationError(f"{what} is truncated: the file ends before the manifest's {size} bytes")
        return buffer, header, what

    with ThreadPoolExecutor(max_workers=1, thread_name_prefix="flare-weights") as reader:
        pending = reader.submit(read, 0)
        for index in range(len(payloads)):
            buffer, header, what = pending.result()
            if index + 1 < len(payloads):
                pending = reader.submit(read, index + 1)     # its buffer's tensors were consumed already
            yield from _tensor_views(buffer, header, what)


def _checked_header(handle, offset: int, size: int, what: str):
    header = st.read_header(handle, offset, size, what=what)
    if header.total_size > size:
        raise PreparationError(f"{what} is truncated: its header describes {header.total_size} bytes, "
                               f"the manifest {size}")
    return header


def _tensor_views(payload, header, what: str) -> Iterator[tuple[str, object]]:
    """(name, tensor) for each tensor in `header`, viewing the payload's bytes (a uint8 tensor)."""
    import torch
    for entry in header.tensors:
        dtype = getattr(torch, _CODE_TO_TORCH[entry.dtype])
        if entry.end > payload.numel():
            raise PreparationError(f"{what} is truncated at tensor {entry.name}")
        if entry.start == entry.end:
            yield entry.name, torch.empty(entry.shape, dtype=dtype)
            continue
        yield entry.name, payload[entry.start:entry.end].view(dtype).reshape(entry.shape)