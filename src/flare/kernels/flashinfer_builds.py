"""Where FlashInfer's JIT builds live, and how a package carries them.

FlashInfer compiles each kernel variant with nvcc on first use and keeps the build (ninja file, objects,
the loaded `.so`) under `$FLASHINFER_WORKSPACE_BASE/.cache/flashinfer/<version>/<arch>/cached_ops`, its
generated sources beside it in `generated`. Spec section 7 keeps these under `[paths] kernel_cache`, in a
directory of their own for each resolved FlashInfer installation (`installation_name`: its version and
a hash of where it is installed), so editable checkouts of one version do not share builds.
`flare.environment` points FlashInfer there before anything imports it.

Export builds FlashInfer's prefill kernel (flare.engine.prompt_kernel) and packs every build of this
installation (`pack_builds`: a gzip tar of the built ops and their generated sources, with a small
record of the FlashInfer version); serving unpacks them into the local build directories
(`unpack_builds`) before FlashInfer loads them. FlashInfer still runs ninja on each load, which finds
the build up to date when the unpacked files are newer than FlashInfer's installed headers and the
build commands are the same: the same installation path and the same kernel cache path, as on a machine
made from the same image. Elsewhere ninja rebuilds (about 90 s) and serving says so.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import io
import json
import os
import tarfile
import tempfile
from pathlib import Path

RECORD = "flare-flashinfer.json"        # the archive's record: FlashInfer's version, the ops it holds


def installation_name() -> str | None:
    """`<version>-<12 hex of the install path>` of the FlashInfer this interpreter would import (without
    importing it); None when none is installed."""
    spec = importlib.util.find_spec("flashinfer")
    if spec is None or not spec.submodule_search_locations:
        return None
    location = os.path.realpath(next(iter(spec.submodule_search_locations)))
    return f"{flashinfer_version()}-{hashlib.sha256(location.encode()).hexdigest()[:12]}"


def flashinfer_version() -> str:
    """The installed FlashInfer's version ("unknown" when its distribution metadata is missing)."""
    try:
        return importlib.metadata.version("flashinfer-python")
    except importlib.metadata.PackageNotFoundError:
        return "unknown"


def workspace_base(kernel_cache: Path) -> Path | None:
    """FLASHINFER_WORKSPACE_BASE for a kernel cache: `<kernel_cache>/flashinfer/<installation>`."""
    name = installation_name()
    return None if name is None else Path(kernel_cache) / "flashinfer" / name


def build_dirs() -> tuple[Path, Path]:
    """(built ops, generated sources) of the imported FlashInfer."""
    from flashinfer.jit import env

    return Path(env.FLASHINFER_JIT_DIR), Path(env.FLASHINFER_GEN_SRC_DIR)


def pack_builds(ops_dir: Path, sources_dir: Path, version: str) -> bytes:
    """A gzip tar of every op built under `ops_dir` (a folder holding its `.so`) and its generated sources
    under `sources_dir`, with a record naming the FlashInfer `version`; empty when nothing was built."""
    ops = sorted(op.name for op in Path(ops_dir).iterdir() if op.is_dir() and (op / f"{op.name}.so").is_file()) \
        if Path(ops_dir).is_dir() else []
    if not ops:
        return b""
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        record = json.dumps({"flashinfer": version, "ops": ops}).encode()
        info = tarfile.TarInfo(RECORD)
        info.size = len(record)
        archive.addfile(info, io.BytesIO(record))
        for op in ops:
            archive.add(Path(ops_dir) / op, arcname=f"ops/{op}")
            if (Path(sources_dir) / op).is_dir():
                archive.add(Path(sources_dir) / op, arcname=f"generated/{op}")
    return buffer.getvalue()


def unpack_builds(data: bytes, ops_dir: Path, sources_dir: Path, version: str) -> str:
    """Add the packed ops (and their sources) that the local directories lack; returns what it did, in a
    sentence. Nothing is unpacked for another FlashInfer version. Each op arrives whole: unpacked beside
    the directory and renamed into it (file times kept: ninja compares them)."""
    if not data:
        return "the package carries no FlashInfer builds"
    Path(ops_dir).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=Path(ops_dir).parent, prefix=".flare-unpack-") as staging:
        with tarfile.open(fileobj=io.BytesIO(data), mode="r:gz") as archive:
            archive.extractall(staging, filter="data")        # refuses absolute paths, links out, devices
        record = json.loads((Path(staging) / RECORD).read_text())
        if record["flashinfer"] != version:
            return (f"the package's FlashInfer builds are of FlashInfer {record['flashinfer']}, this is {version}: "
                    "FlashInfer builds its kernel on first use")
        added = sum(_move_in(Path(staging) / part / op, target / op)
                    for op in record["ops"] for part, target in (("ops", Path(ops_dir)), ("generated", Path(sources_dir))))
    return f"{added} FlashInfer build folders added from the package" if added else "FlashInfer's builds were here"


def _move_in(source: Path, target: Path) -> bool:
    """Rename `source` to `target` unless it exists already (or another process just made it)."""
    if not source.is_dir() or target.exists():
        return False
    target.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.rename(source, target)
    except OSError:                     # another process added it meanwhile
        return False
    return True
