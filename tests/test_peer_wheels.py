"""benchmarks/peer_wheels.py packs wheels into parts one GPU-machine call can carry, and
benchmarks/peer_stage.sh joins the pieces of a split wheel back byte for byte."""

from __future__ import annotations

import subprocess
import zipfile
from pathlib import Path

from benchmark_scripts import BENCHMARKS, benchmark_module


def fake_wheel(folder: Path, name: str, size: int, requires: list[str] = ()) -> Path:
    wheel = folder / f"{name}-1.0-py3-none-any.whl"
    with zipfile.ZipFile(wheel, "w", compression=zipfile.ZIP_STORED) as archive:
        metadata = f"Metadata-Version: 2.1\nName: {name}\n" + "".join(f"Requires-Dist: {r}\n" for r in requires)
        archive.writestr(f"{name}-1.0.dist-info/METADATA", metadata)
        archive.writestr(f"{name}/data.bin", bytes(range(256)) * (size // 256))
    return wheel


def test_parts_stay_under_the_limit_and_join_back_to_the_wheels(tmp_path, monkeypatch):
    downloads = tmp_path / "downloads"
    downloads.mkdir()
    wheels = [fake_wheel(downloads, "big", 5000), fake_wheel(downloads, "mid", 1500),
              fake_wheel(downloads, "small", 300)]
    with benchmark_module("peer_wheels") as peer:
        parts = peer.pack(wheels, tmp_path / "out", 2048)
    folders = sorted((tmp_path / "out").glob("part*"))
    assert len(folders) == parts
    assert all(sum(f.stat().st_size for f in folder.iterdir()) <= 2048 for folder in folders)
    assert any(f.name.endswith(".whl.000") for folder in folders for f in folder.iterdir())   # big was split
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    stage = tmp_path / "stage"
    script = (BENCHMARKS / "peer_stage.sh").read_text().replace("STAGE=/tmp/peer-wheels", f"STAGE={stage}")
    script = script.replace("python3 -m pip install", "true")          # the join only: no install here
    (tmp_path / "stage.sh").write_text(script)
    for folder in folders:
        subprocess.run(["bash", str(tmp_path / "stage.sh"), str(folder)], check=True, capture_output=True)
    subprocess.run(["bash", str(tmp_path / "stage.sh"), "--install"], check=True, capture_output=True)
    assert sorted(p.name for p in stage.iterdir()) == sorted(w.name for w in wheels)
    for wheel in wheels:
        assert (stage / wheel.name).read_bytes() == wheel.read_bytes()


def test_requirements_keep_what_applies_on_the_gpu_machine(tmp_path):
    wheel = fake_wheel(tmp_path, "pkg", 256, ["numpy>=1.0", 'pywin32; sys_platform == "win32"',
                                              'uvloop; platform_system == "Linux"', 'rich; extra == "ui"'])
    with benchmark_module("peer_wheels") as peer:
        assert peer.requirements(wheel) == ["numpy>=1.0", "uvloop"]



def test_added_roots_come_along_and_a_pin_replaces_the_version_met(tmp_path, monkeypatch):
    folder = tmp_path / "downloads"
    folder.mkdir()
    metadata = {"root": ["ffi==1.0", "late", 'rich; extra == "ui"'], "late": ["ffi>=2"], "ffi": [],
                "country": ["late"]}
    asked = []

    def fake_download(requirement, into):
        asked.append(requirement)
        name = requirement.split("=")[0].split(">")[0]
        return fake_wheel(into, name, 256, metadata[name])

    with benchmark_module("peer_wheels") as peer:
        monkeypatch.setattr(peer, "download", fake_download)
        wheels = peer.resolve(["root", "country"], set(), folder, {"ffi": "ffi==2.5"})
    assert [w.name.split("-")[0] for w in wheels] == ["root", "country", "ffi", "late"]
    assert asked == ["root", "country", "ffi==2.5", "late"]            # each name once; no extra followed
