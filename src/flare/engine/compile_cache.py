"""Compiled code carried in the package, so `flare run` does not compile what preparation compiled.

Preparation on a GPU (flare.prepare.gpu) compiles the decoder layers, captures the decode graph catalog,
runs warm-up requests through the engine, which compile the prefill shapes too, and times the engine's
steps for the plan. It then saves torch.compile's cache artifacts (Inductor's compiled graphs with their generated Triton kernels and autotuning results) into
the package. Serving loads them into the local compile caches before the layers are compiled, so
torch.compile finds every graph cached: it still traces the layer (a second or two) but generates and
builds no kernels. Graphs themselves hold device addresses and are
captured again at every start.

Our own Triton kernels (paged attention) are not torch.compile's: Triton caches them on disk
itself. Preparation packs their cache entries too, and serving unpacks them into the local Triton cache,
so a package served on a fresh machine of the same kind builds none of them either.

The artifacts fit only the software and GPU that made them; `environment_key` records those, and a
package served elsewhere compiles as before, with a note that says why.
"""

from __future__ import annotations

import importlib
import io
import os
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path

KERNEL_MODULES = ("flare.kernels.decode_attention", "flare.kernels.prefill_attention", "flare.kernels.flash_prefill",
                  "flare.kernels.sampling", "flare.kernels.fp8_gemv", "flare.kernels.fp8_gemm",
                  "flare.kernels.fp8_dequantize")


@dataclass(frozen=True)
class CompiledArtifacts:
    data: bytes                                  # torch.compiler.save_cache_artifacts() bytes
    key: dict                                    # environment_key() where they were made
    triton_kernels: bytes = b""                  # our kernels' Triton cache entries (pack_triton_kernels)
    flashinfer_kernels: bytes = b""              # FlashInfer's JIT builds (flare.kernels.flashinfer_builds)


def environment_key(device_index: int = 0) -> dict:
    """What compiled artifacts depend on: torch, Triton and CUDA versions and the GPU model."""
    import torch
    import triton

    properties = torch.cuda.get_device_properties(device_index)
    return {"torch": torch.__version__, "triton": triton.__version__, "cuda": torch.version.cuda,
            "gpu": properties.name, "capability": f"{properties.major}.{properties.minor}"}


def save_artifacts(flashinfer: bool = False) -> CompiledArtifacts | None:
    """Everything torch.compile compiled or loaded from cache in this process so far, our Triton
    kernels' cache entries and, with `flashinfer`, FlashInfer's builds; None if there is none of them."""
    import torch

    saved = torch.compiler.save_cache_artifacts()
    compiled = saved[0] if saved is not None and saved[0] else b""
    kernels = pack_triton_kernels(triton_cache_dir(), kernel_names())
    builds = b""
    if flashinfer:
        from flare.kernels.flashinfer_builds import build_dirs, flashinfer_version, pack_builds

        builds = pack_builds(*build_dirs(), flashinfer_version())
    if not compiled and not kernels and not builds:
        return None
    return CompiledArtifacts(compiled, environment_key(), kernels, builds)


def load_artifacts(artifacts: CompiledArtifacts | None) -> str:
    """Put the package's compiled artifacts into the local caches when they fit this machine; a note for
    the loading stage either way."""
    if artifacts is None:
        return "no compiled kernels in the package: compiling"
    here = environment_key()
    differences = [f"{name} {artifacts.key.get(name)} (here {value})" for name, value in here.items()
                   if artifacts.key.get(name) != value]
    if differences:
        return "compiled kernels were prepared with " + ", ".join(differences) + ": compiling"
    import torch

    if artifacts.data:
        torch.compiler.load_cache_artifacts(artifacts.data)
    added = unpack_triton_kernels(artifacts.triton_kernels, triton_cache_dir())
    size = (len(artifacts.data) + len(artifacts.triton_kernels) + len(artifacts.flashinfer_kernels)) / 2**20
    builds = f"; {_unpack_flashinfer(artifacts.flashinfer_kernels)}" if artifacts.flashinfer_kernels else ""
    return f"compiled kernels from the package ({size:.1f} MiB; {added} Triton kernels added to the local cache{builds})"


def _unpack_flashinfer(data: bytes) -> str:
    """FlashInfer's builds from the package into its local build directories, when it is installed here."""
    from flare.kernels.flashinfer_builds import build_dirs, flashinfer_version, installation_name, unpack_builds

    if installation_name() is None:
        return "FlashInfer is not installed here"
    try:
        return unpack_builds(data, *build_dirs(), flashinfer_version())
    except Exception as exc:                # a broken install: its kernel falls back when loaded (prompt_kernel)
        return f"FlashInfer's builds not unpacked ({type(exc).__name__}: {exc})"[:300]


def triton_cache_dir() -> Path:
    """Where Triton keeps compiled kernels in this process (Flare points TRITON_CACHE_DIR into its kernel cache)."""
    try:
        from triton import knobs

        return Path(knobs.cache.dir)
    except (ImportError, AttributeError):          # Triton before the knobs module
        return Path(os.environ.get("TRITON_CACHE_DIR") or Path.home() / ".triton" / "cache")


def kernel_names() -> set[str]:
    """The names of Flare's own Triton kernels."""
    from triton.runtime.jit import KernelInterface         # jitted kernels, interpreted ones too

    return {value.__name__ for module in KERNEL_MODULES for value in vars(importlib.import_module(module)).values()
            if isinstance(value, KernelInterface)}


def pack_triton_kernels(cache_dir: Path, names: set[str]) -> bytes:
    """A gzip tar of the Triton cache entries (one folder each, named by its hash) that hold a compiled
    kernel of `names`; empty when there are none. Entries that older sources of the same kernels left in
    this cache come along too: Triton never looks them up, and they cost a few hundred KiB each."""
    entries = [entry for entry in sorted(Path(cache_dir).iterdir()) if entry.is_dir()
               and any((entry / f"__grp__{name}.json").is_file() for name in names)] if Path(cache_dir).is_dir() else []
    if not entries:
        return b""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for entry in entries:
            archive.add(entry, arcname=entry.name)
    return buffer.getvalue()


def unpack_triton_kernels(data: bytes, cache_dir: Path) -> int:
    """Add the packed entries the local cache lacks; return how many were added. Entries arrive whole: each
    is unpacked beside the cache and renamed into it, so a Triton reading the cache never sees half a one."""
    if not data:
        return 0
    cache_dir = Path(cache_dir)
    cache_dir.mkdir(parents=True, exist_ok=True)
    added = 0
    with tempfile.TemporaryDirectory(dir=cache_dir, prefix=".flare-unpack-") as staging:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            archive.extractall(staging, filter="data")       # refuses absolute paths, links out, devices
        for entry in sorted(Path(staging).iterdir()):
            if (cache_dir / entry.name).exists():
                continue
            try:
                os.rename(entry, cache_dir / entry.name)
                added += 1
            except OSError:                                   # another process added it meanwhile
                pass
    return added
