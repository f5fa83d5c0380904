"""Byte-exact safetensors reading and writing, without torch.

Payload identity is the SHA-256 of a payload file's exact bytes, so the writer must be deterministic:
tensors are laid out in the order given, the header is compact JSON padded with spaces to 8 bytes,
and nothing else (no timestamps) enters the file. The reader accepts a file that starts at any offset
inside a larger file, which is how the packed form stores its payloads.
"""

from __future__ import annotations

import hashlib
import json
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO, Iterable

from flare.errors import PreparationError

HEADER_ALIGNMENT = 8
MAX_HEADER_BYTES = 100 * 1024 * 1024     # the safetensors limit; a larger length is a corrupt file

DTYPE_SIZES = {"BOOL": 1, "U8": 1, "I8": 1, "F8_E4M3": 1, "F8_E5M2": 1, "I16": 2, "U16": 2, "F16": 2,
               "BF16": 2, "I32": 4, "U32": 4, "F32": 4, "I64": 8, "U64": 8, "F64": 8}


@dataclass(frozen=True)
class TensorBytes:
    """One tensor to write: its name, safetensors dtype string, shape and raw little-endian bytes (or a
    flat byte view of them)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    data: bytes | memoryview


@dataclass(frozen=True)
class TensorEntry:
    """Where one tensor lives inside a safetensors file (offsets relative to the file's start)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    start: int
    end: int


@dataclass(frozen=True)
class Header:
    metadata: dict[str, str]
    tensors: tuple[TensorEntry, ...]
    data_start: int                       # bytes from the file's start to its data section
    total_size: int                       # header plus data: the whole file


def encode(tensors: Iterable[TensorBytes], metadata: dict[str, str] | None = None) -> tuple[bytes, list[bytes]]:
    """The header bytes (length prefix included) and the data chunks, in file order."""
    header: dict[str, object] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    chunks: list[bytes] = []
    offset = 0
    for tensor in tensors:
        expected = DTYPE_SIZES[tensor.dtype] * _count(tensor.shape)
        if len(tensor.data) != expected:
            raise ValueError(f"tensor {tensor.name}: {len(tensor.data)} bytes for shape {tensor.shape}")
        header[tensor.name] = {"dtype": tensor.dtype, "shape": list(tensor.shape),
                               "data_offsets": [offset, offset + len(tensor.data)]}
        chunks.append(tensor.data)
        offset += len(tensor.data)
    text = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode()
    text += b" " * (-(8 + len(text)) % HEADER_ALIGNMENT)
    return struct.pack("<Q", len(text)) + text, chunks


def write(path: Path, tensors: Iterable[TensorBytes], metadata: dict[str, str] | None = None) -> tuple[str, int]:
    """Write a safetensors file; return the SHA-256 of its bytes and its size."""
    header, chunks = encode(tensors, metadata)
    digest = hashlib.sha256()
    size = 0
    with open(path, "wb") as handle:
        for chunk in [header, *chunks]:
            handle.write(chunk)
            digest.update(chunk)
            size += len(chunk)
    return digest.hexdigest(), size


def read_header(handle: BinaryIO, offset: int = 0, limit: int | None = None, what: str = "file") -> Header:
    """Parse the header of the safetensors file starting at `offset`; `limit` bounds its total size."""
    handle.seek(offset)
    prefix = handle.read(8)
    if len(prefix) != 8:
        raise PreparationError(f"{what} is truncated: no safetensors header")
    (length,) = struct.unpack("<Q", prefix)
    if length > MAX_HEADER_BYTES or (limit is not None and 8 + length > limit):
        raise PreparationError(f"{what} is corrupt: its header length {length} is impossible")
    raw = handle.read(length)
    if len(raw) != length:
        raise PreparationError(f"{what} is truncated inside its header")
    try:
        fields = json.loads(raw)
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise PreparationError(f"{what} is corrupt: its header is not JSON ({error})") from None
    if not isinstance(fields, dict):
        raise PreparationError(f"{what} is corrupt: its header is not a JSON object")
    metadata = fields.pop("__metadata__", None) or {}
    if not isinstance(metadata, dict) or not all(isinstance(v, str) for v in metadata.values()):
        raise PreparationError(f"{what} is corrupt: its header's __metadata__ is not a map of strings")
    data_start = 8 + length
    entries = [_entry(name, info, data_start, what) for name, info in fields.items()]
    data_end = max((entry.end for entry in entries), default=data_start)
    return Header(metadata, tuple(entries), data_start, data_end)


def _entry(name: str, info: object, data_start: int, what: str) -> TensorEntry:
    """One tensor's header entry, checked: a known dtype, a shape of non-negative integers, and offsets
    whose span is exactly the shape's bytes."""
    def corrupt(problem: str) -> PreparationError:
        return PreparationError(f"{what} is corrupt: the header entry of tensor {name!r} {problem}")

    if not isinstance(info, dict):
        raise corrupt("is not an object")
    dtype, shape, offsets = info.get("dtype"), info.get("shape"), info.get("data_offsets")
    if dtype not in DTYPE_SIZES:
        raise PreparationError(f"{what}: tensor {name!r} has dtype {dtype!r}, which Flare does not read "
                               f"(it reads {', '.join(DTYPE_SIZES)})")
    if not isinstance(shape, list) or not all(type(dim) is int and dim >= 0 for dim in shape):
        raise corrupt(f"has no valid shape ({shape!r})")
    if (not isinstance(offsets, list) or len(offsets) != 2 or not all(type(o) is int for o in offsets)
            or not 0 <= offsets[0] <= offsets[1]):
        raise corrupt(f"has no valid data_offsets ({offsets!r})")
    if offsets[1] - offsets[0] != DTYPE_SIZES[dtype] * _count(tuple(shape)):
        raise corrupt(f"spans {offsets[1] - offsets[0]} bytes, but {dtype} {tuple(shape)} needs "
                      f"{DTYPE_SIZES[dtype] * _count(tuple(shape))}")
    return TensorEntry(name, dtype, tuple(shape), data_start + offsets[0], data_start + offsets[1])


def _count(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count
