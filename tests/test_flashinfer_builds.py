"""FlashInfer's JIT builds: one directory per installation under the kernel cache, and packed builds that a
package carries to another machine. FlashInfer itself is not installed here: a stand-in package of that
name on sys.path is what `installation_name` finds, and build folders are made by hand."""

from __future__ import annotations

import io
import json
import os
import sys
import tarfile
from pathlib import Path

import pytest

from flare.config import load_config
from flare.environment import apply_library_environment, library_environment
from flare.kernels import flashinfer_builds
from flare.kernels.flashinfer_builds import installation_name, pack_builds, unpack_builds, workspace_base


@pytest.fixture
def installed(tmp_path, monkeypatch):
    """A package named flashinfer on sys.path (never imported), at a path of its own."""
    def install(where: str) -> None:
        package = tmp_path / where / "flashinfer"
        package.mkdir(parents=True)
        (package / "__init__.py").write_text("raise ImportError('never imported')\n")
        monkeypatch.syspath_prepend(str(tmp_path / where))
        sys.path_importer_cache.clear()
    return install


def test_each_installation_has_a_build_directory_of_its_own(installed, tmp_path, monkeypatch):
    installed("checkout-a")
    first = installation_name()
    monkeypatch.setattr(sys, "path", [p for p in sys.path if "checkout-a" not in p])
    installed("checkout-b")
    second = installation_name()
    assert first != second and first.split("-")[0] == second.split("-")[0]      # same version, other path
    assert workspace_base(tmp_path / "kernels") == tmp_path / "kernels" / "flashinfer" / second
    assert "flashinfer" not in sys.modules                                       # found, not imported


def test_the_environment_points_flashinfer_into_the_kernel_cache(installed, tmp_path, restore_environment):
    installed("site")
    config = load_config(_config_file(tmp_path, '[paths]\nkernel_cache = "/data/kernels"\n'))
    os.environ["FLASHINFER_WORKSPACE_BASE"] = "/stray"
    apply_library_environment(config)
    assert os.environ["FLASHINFER_WORKSPACE_BASE"] == f"/data/kernels/flashinfer/{installation_name()}"


def test_without_flashinfer_no_variable_is_set(monkeypatch, tmp_path, restore_environment):
    monkeypatch.setattr(flashinfer_builds, "installation_name", lambda: None)
    os.environ["FLASHINFER_WORKSPACE_BASE"] = "/stray"
    config = load_config(_config_file(tmp_path, ""))
    apply_library_environment(config)
    assert "FLASHINFER_WORKSPACE_BASE" not in os.environ and "FLASHINFER_WORKSPACE_BASE" not in library_environment(config)


def _config_file(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "config.toml"
    path.write_text(text)
    return path


def _built_op(ops: Path, sources: Path, name: str) -> None:
    (ops / name).mkdir(parents=True)
    (ops / name / f"{name}.so").write_bytes(b"\x7fELF built")
    (ops / name / "build.ninja").write_text("rule nvcc\n")
    (ops / name / ".ninja_log").write_text("# ninja log v5\n")
    os.utime(ops / name / f"{name}.so", (1_700_000_000, 1_700_000_000))
    (sources / name).mkdir(parents=True)
    (sources / name / "kernel.cu").write_text("// generated\n")


def test_builds_travel_whole_with_their_times(tmp_path):
    ops, sources = tmp_path / "a" / "cached_ops", tmp_path / "a" / "generated"
    _built_op(ops, sources, "batch_prefill_fa3")
    (ops / "half_built").mkdir()                        # no .so: a failed or interrupted build stays home
    data = pack_builds(ops, sources, "0.6.14")
    here_ops, here_sources = tmp_path / "b" / "cached_ops", tmp_path / "b" / "generated"
    assert unpack_builds(data, here_ops, here_sources, "0.6.14") == "2 FlashInfer build folders added from the package"
    built = here_ops / "batch_prefill_fa3" / "batch_prefill_fa3.so"
    assert built.read_bytes() == b"\x7fELF built" and int(built.stat().st_mtime) == 1_700_000_000
    assert (here_ops / "batch_prefill_fa3" / ".ninja_log").is_file()           # ninja's record of the build
    assert (here_sources / "batch_prefill_fa3" / "kernel.cu").is_file()
    assert not (here_ops / "half_built").exists()
    assert unpack_builds(data, here_ops, here_sources, "0.6.14") == "FlashInfer's builds were here"
    assert [p.name for p in here_ops.parent.iterdir() if p.name.startswith(".")] == []     # no staging left


def test_builds_of_another_flashinfer_version_are_not_unpacked(tmp_path):
    ops, sources = tmp_path / "cached_ops", tmp_path / "generated"
    _built_op(ops, sources, "op")
    note = unpack_builds(pack_builds(ops, sources, "0.6.14"), tmp_path / "x" / "ops", tmp_path / "x" / "src", "0.7.0")
    assert "FlashInfer 0.6.14, this is 0.7.0" in note and not (tmp_path / "x" / "ops").exists()


def test_nothing_built_packs_to_nothing(tmp_path):
    assert pack_builds(tmp_path / "absent", tmp_path / "absent-too", "0.6.14") == b""
    assert unpack_builds(b"", tmp_path, tmp_path, "0.6.14") == "the package carries no FlashInfer builds"


def test_an_archive_cannot_write_outside_the_build_directories(tmp_path):
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w:gz") as archive:
        for name, data in (("flare-flashinfer.json", json.dumps({"flashinfer": "1", "ops": ["x"]}).encode()),
                           ("../escape.so", b"bad")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    with pytest.raises(tarfile.TarError):
        unpack_builds(buffer.getvalue(), tmp_path / "ops", tmp_path / "src", "1")
    assert not (tmp_path / "escape.so").exists()
