#!/usr/bin/env python
"""What the default open's integrity checks cost on one large weight payload, beside the full hash.

Writes one safetensors payload of --gib GiB (one U8 tensor), then times, on that file: parsing its
header, the sampled SHA-256 every load checks (flare.package.verify, the block count and size export
records), and the full SHA-256 that `--verify-weights` adds. Each is timed warm (the file in the page
cache) and cold (its pages dropped from the cache with posix_fadvise first, for this file only).

    python benchmarks/open_integrity.py --gib 1 --output results/open_integrity.json
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path


def drop_from_page_cache(path: Path) -> None:
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
        os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(descriptor)


def write_payload(path: Path, size: int) -> None:
    """A safetensors file of one U8 tensor of `size` bytes (a multiple of 1 MiB), as export lays one out."""
    text = json.dumps({"weight": {"dtype": "U8", "shape": [size], "data_offsets": [0, size]}},
                      separators=(",", ":")).encode()
    text += b" " * (-(8 + len(text)) % 8)
    chunk = os.urandom(1 << 20)
    with open(path, "wb") as handle:
        handle.write(len(text).to_bytes(8, "little") + text)
        for _ in range(size >> 20):
            handle.write(chunk)


def timed(function, repeats: int, cold_path: Path | None) -> float:
    """The median seconds of `repeats` calls, the file dropped from the page cache before each when cold."""
    times = []
    for _ in range(repeats):
        if cold_path is not None:
            drop_from_page_cache(cold_path)
        started = time.perf_counter()
        function()
        times.append(time.perf_counter() - started)
    return sorted(times)[len(times) // 2]


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=1.0)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--directory", type=Path, default=None, help="where to write the payload (default: a temp dir)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    from flare.package import safetensors_io as st
    from flare.package import verify
    from flare.package.store import sha256_file

    with tempfile.TemporaryDirectory(dir=args.directory) as folder:
        path = Path(folder) / "payload.safetensors"
        write_payload(path, int(args.gib * (1 << 30)) >> 20 << 20)
        size = path.stat().st_size
        blocks, block_bytes = verify.SAMPLE_BLOCKS, verify.SAMPLE_BLOCK_BYTES
        checks = {
            "header": lambda: st.read_header(open(path, "rb"), 0, size, what="payload"),
            "sampled_sha256": lambda: verify.sampled_sha256(path, 0, size, block_bytes, blocks, "payload"),
            "full_sha256": lambda: sha256_file(path, 0, size),
        }
        sha256_file(path)                                     # warm the cache once
        rows = []
        for name, check in checks.items():
            for state in ("warm", "cold"):
                seconds = timed(check, args.repeats, path if state == "cold" else None)
                rows.append({"check": name, "cache": state, "seconds": seconds})
    sampled = sum(end - start for start, end in verify.sampled_ranges(size, block_bytes, blocks))
    print(f"payload {size / (1 << 30):.2f} GiB; sampled {blocks} blocks of {block_bytes // 1024} KiB "
          f"({sampled / (1 << 20):.1f} MiB)")
    print(f"{'check':<16} {'cache':<6} {'ms':>10}")
    for row in rows:
        print(f"{row['check']:<16} {row['cache']:<6} {row['seconds'] * 1000:>10.2f}")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps({"payload_bytes": size, "sample_blocks": blocks,
                                           "sample_block_bytes": block_bytes, "sampled_bytes": sampled,
                                           "machine": platform.node(), "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
