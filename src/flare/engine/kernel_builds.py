"""Triton kernels built while serving, counted.

A kernel that Triton compiles (or loads from its disk cache) in the middle of serving stalls the step
that launched it, and every request waiting on that step: on the H200 the first burst after start-up
answered its slowest request 1-2 s late (docs/performance.md), while later bursts did not. The engine
core counts what Triton builds after start-up and how long each build took, from Triton's compile hooks
(`triton.knobs.runtime`, Triton 3.5 and later), and reports both in its stats, so a run shows whether
its first requests paid for kernels and how much. Builds from Inductor's own compile path are counted
where PyTorch calls the same hook.

Each build is also written to the engine's standard error, one line naming the kernel and its
specialization (Triton's `repr` of the launch: name, warps, stages, argument types and which integer
arguments were specialized), so a server log says which kernel a package lacked.
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass, field
from typing import TextIO

RECENT = 32                     # names of the latest builds kept for the stats


@dataclass
class KernelBuilds:
    """Builds seen since `watch` (count, seconds between Triton's pre- and post-compile hooks)."""

    count: int = 0
    seconds: float = 0.0
    watching: bool = False
    recent: list[str] = field(default_factory=list)       # the latest builds' kernel names, oldest first
    report_to: TextIO | None = field(default=sys.stderr, repr=False)
    _started: dict = field(default_factory=dict, repr=False)

    def watch(self) -> bool:
        """Chain our hooks in front of any already set; False (and nothing counted) without Triton's hooks."""
        try:
            from triton import knobs
        except ImportError:
            return False
        runtime = getattr(knobs, "runtime", None)
        if runtime is None or not hasattr(runtime, "jit_post_compile_hook") or not hasattr(runtime, "jit_cache_hook"):
            return False
        earlier_before, earlier_after = runtime.jit_cache_hook, runtime.jit_post_compile_hook

        def before(**kwargs):
            if earlier_before is not None and earlier_before(**kwargs):
                return True                              # an earlier hook skips this build: so do we
            self._started[_key(kwargs)] = time.perf_counter()
            return None                                  # a true value would skip the build

        def after(**kwargs):
            started = self._started.pop(_key(kwargs), None)
            seconds = time.perf_counter() - started if started is not None else 0.0
            self._record(_name(kwargs), seconds)
            return earlier_after(**kwargs) if earlier_after is not None else None

        runtime.jit_cache_hook, runtime.jit_post_compile_hook = before, after
        self.watching = True
        return True


    def _record(self, name: str, seconds: float) -> None:
        self.count += 1
        self.seconds += seconds
        self.recent = [*self.recent[-(RECENT - 1):], name]
        if self.report_to is not None:
            print(f"flare: Triton built a kernel while serving ({seconds:.2f} s; the step waited): {name}",
                  file=self.report_to, flush=True)


def _name(kwargs) -> str:
    """Triton's description of the launch (`repr`: name, options, argument types), else the kernel's name."""
    text = kwargs.get("repr")
    if not isinstance(text, str):
        fn = kwargs.get("fn")
        text = getattr(fn, "name", None) or str(kwargs.get("key", "?"))
    return text[:400]


def _key(kwargs) -> object:
    key = kwargs.get("key")
    try:
        hash(key)
    except TypeError:
        return repr(key)
    return key
