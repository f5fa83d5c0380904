#!/usr/bin/env python3
"""The peer server's wheels for the GPU machine, in parts that one device call each can carry.

The GPU machine reaches no package index, and one call carries at most 64 MiB of the working tree, while
vLLM's wheel alone is ~300 MB. This resolves a package's dependencies for CPython 3.12 on x86-64 Linux
from its wheels' metadata (breadth first, markers evaluated for that platform), skipping the packages the
GPU machine already holds (`--present-file`: the names `python3 -m pip list` prints there), downloads
the rest, and cuts them into `OUT/part1 ... partN`, each under `--part-mib`: large wheels are split into
pieces (`NAME.whl.000`, `.001`, ...) that `benchmarks/peer_stage.sh` joins again on the device.

    python3 benchmarks/peer_wheels.py vllm==0.26.0 --present-file present.txt --out .peer --part-mib 56 \
        --skip pynvvideocodec torchcodec tilelang tokenspeed-mla --pin apache-tvm-ffi==0.1.15.post2 --add pycountry

(vLLM 0.26.0 on 2026-12-03: 88 wheels, 658 MiB; with that --skip list 83 wheels, 454 MiB, 9 parts of
56 MiB. What is skipped must never be imported by the benchmark's server: video decoders, and kernels
for models other than Llama's. A part and the repository's own files (~7 MiB) travel together under the
64 MiB limit of one call. The pin: vLLM 0.26.0 pins apache-tvm-ffi==0.1.10 while the xgrammar it then
gets (0.2.9) needs >=0.1.11 and fails to import with 0.1.10; with 0.1.15.post2 vLLM started and served on
the H200 on 2026-12-03. Extras are not followed; vLLM's server imports one that mistral_common asks for,
pydantic-extra-types[pycountry], hence --add pycountry.)

`.peer` is a folder git ignores (`echo /.peer/ >> .git/info/exclude`). Then one GPU-machine call per part,
while the machine stays warm (files outside the repo survive between calls only on the same machine):
`bash benchmarks/peer_stage.sh .peer/partK` with `.peer/partK` carried along, and after the last part
`bash benchmarks/peer_stage.sh --install` (wheels into /tmp/peer-site).
Versions the device already holds are trusted; `python3 -m pip check` after the install says where not.
"""

from __future__ import annotations

import argparse
import re
import subprocess
import sys
import zipfile
from pathlib import Path

PLATFORMS = ["manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux_2_24_x86_64", "manylinux_2_27_x86_64",
             "manylinux_2_28_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64", "manylinux_2_35_x86_64",
             "manylinux1_x86_64", "any"]
MARKER_ENVIRONMENT = {"python_version": "3.12", "python_full_version": "3.12.0", "sys_platform": "linux",
                      "platform_system": "Linux", "platform_machine": "x86_64", "os_name": "posix",
                      "implementation_name": "cpython", "platform_python_implementation": "CPython",
                      "extra": ""}


def canonical(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def requirement_name(requirement: str) -> str:
    """The canonical project name of a requirement string ("nvidia-cutlass-dsl[cu13]==4.6.0" and the like)."""
    from packaging.requirements import Requirement

    return canonical(Requirement(requirement).name)


def download(requirement: str, folder: Path) -> Path:
    """One wheel (no dependencies) for the GPU machine's Python and platform; its path."""
    before = set(folder.glob("*.whl"))
    platforms = [arg for platform in PLATFORMS for arg in ("--platform", platform)]
    command = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *platforms, "-d", str(folder), requirement]
    subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
    added = set(folder.glob("*.whl")) - before
    if added:
        return added.pop()
    name = requirement_name(requirement)
    for wheel in folder.glob("*.whl"):           # downloaded before, for another requirement
        if canonical(wheel.name.split("-")[0]) == name:
            return wheel
    raise SystemExit(f"pip downloaded nothing for {requirement}")


def requirements(wheel: Path) -> list[str]:
    """The Requires-Dist lines of a wheel that apply on the GPU machine (no extras: following them all takes
    vLLM 0.26.0 from 445 to 666 MiB, fastapi[standard] and a CUDA compiler among them; see --add)."""
    from packaging.requirements import Requirement

    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    wanted = []
    for line in lines:
        if not line.startswith("Requires-Dist:"):
            continue
        requirement = Requirement(line.split(":", 1)[1].strip())
        if requirement.marker is None or requirement.marker.evaluate(MARKER_ENVIRONMENT):
            wanted.append(str(requirement).split(";")[0].strip())
    return wanted


def resolve(roots: list[str], present: set[str], folder: Path, pins: dict[str, str] | None = None) -> list[Path]:
    """Every wheel the roots need beyond `present`, breadth first, one version per name: the first met, or
    the pin given for that name (where the peer's own pins contradict each other, see --pin)."""
    pins = pins or {}
    seen, queue, wheels = set(present), list(roots), []
    while queue:
        requirement = queue.pop(0)
        name = requirement_name(requirement)
        if name in seen:
            continue
        seen.add(name)
        wheel = download(pins.get(name, requirement), folder)
        wheels.append(wheel)
        print(f"  {wheel.name} ({wheel.stat().st_size / 2**20:.1f} MiB)", flush=True)
        queue.extend(requirements(wheel))
    return wheels


def pack(wheels: list[Path], out: Path, part_bytes: int) -> int:
    """The wheels in parts of at most part_bytes, large ones split into numbered pieces; the part count."""
    pieces = []
    for wheel in sorted(wheels, key=lambda w: -w.stat().st_size):
        data = wheel.read_bytes()
        if len(data) <= part_bytes:
            pieces.append((wheel.name, data))
        else:
            pieces += [(f"{wheel.name}.{i:03d}", data[start:start + part_bytes])
                       for i, start in enumerate(range(0, len(data), part_bytes))]
    parts: list[list[tuple[str, bytes]]] = []
    for name, data in pieces:                     # first fit: each piece into the first part it fits
        for part in parts:
            if sum(len(d) for _, d in part) + len(data) <= part_bytes:
                part.append((name, data))
                break
        else:
            parts.append([(name, data)])
    for number, part in enumerate(parts, 1):
        folder = out / f"part{number}"
        folder.mkdir(parents=True, exist_ok=True)
        for name, data in part:
            (folder / name).write_bytes(data)
    return len(parts)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("requirement", help="e.g. vllm==0.26.0")
    parser.add_argument("--present-file", type=Path, required=True,
                        help="names of the packages the GPU machine holds, separated by commas or newlines")
    parser.add_argument("--skip", nargs="*", default=[],
                        help="packages left out although required (e.g. video decoders a text benchmark never imports)")
    parser.add_argument("--add", nargs="*", default=[], metavar="REQUIREMENT",
                        help="more to take along (and what they need): what an extra brings that the peer imports")
    parser.add_argument("--pin", nargs="*", default=[], metavar="NAME==VERSION",
                        help="the version to take for a name, whatever the requirements met say")
    parser.add_argument("--out", type=Path, default=Path(".peer"))
    parser.add_argument("--part-mib", type=int, default=48)
    args = parser.parse_args(argv)
    present = {canonical(n) for n in re.split(r"[,\s]+", args.present_file.read_text()) if n}
    present |= {canonical(n) for n in args.skip}
    if args.out.exists() and any(args.out.iterdir()):
        raise SystemExit(f"{args.out} is not empty: remove it first")
    downloads = args.out / "downloads"
    downloads.mkdir(parents=True, exist_ok=True)
    pins = {requirement_name(pin): pin for pin in args.pin}
    wheels = resolve([args.requirement, *args.add], present, downloads, pins)
    parts = pack(wheels, args.out, args.part_mib << 20)
    total = sum(w.stat().st_size for w in wheels) / 2**20
    print(f"{len(wheels)} wheels, {total:.0f} MiB, in {parts} parts under {args.out} "
          f"(the downloads stay in {downloads}; carry only the parts)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
