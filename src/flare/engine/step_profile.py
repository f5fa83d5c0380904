"""Diagnostics of the engine core's process: a cProfile of its start, and traces of a window of serving
steps (`flare run --profile-startup DIR`, `--profile-steps DIR`).

The step window is recorded twice, one way after the other, because the host's tracing slows the host:
  * steps first .. first + count - 1: a torch.profiler trace of host operators and every CUDA kernel and
    copy, each step marked (`flare.step`), written as a Chrome trace `engine-steps-<pid>.json.gz`
    (chrome://tracing, Perfetto); `engine-steps-<pid>.txt` says per step how long it took, how long the
    device was busy meanwhile and its longest idle stretch (`summarize`);
  * the next `count` steps: a cProfile of the core's Python, `engine-steps-<pid>.prof` (pstats), the
    host's time by function.
Serving steps are counted from the first after the warm-up. Recorded steps run slower than others: their
times locate gaps and host costs, they are not speeds to report.
"""

from __future__ import annotations

import gzip
import json
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

DEFAULT_FIRST_STEP = 200
DEFAULT_STEP_COUNT = 20


@dataclass(frozen=True)
class Diagnostics:
    """What the engine core's process records about itself; every field off by default."""

    startup_profile_dir: str | None = None   # a cProfile of building the core lands here
    step_trace_dir: str | None = None        # a trace of steps first .. first + count - 1 lands here
    step_trace_first: int = DEFAULT_FIRST_STEP
    step_trace_count: int = DEFAULT_STEP_COUNT

    def __post_init__(self) -> None:
        if self.step_trace_first < 1 or self.step_trace_count < 1:
            raise ValueError(f"a step trace starts at step 1 or later and holds at least one step; got first "
                             f"{self.step_trace_first}, count {self.step_trace_count}")


def parse_window(text: str) -> tuple[int, int]:
    """`--profile-steps-window FIRST,COUNT` -> (first, count); ValueError says what is wrong."""
    parts = text.split(",")
    try:
        first, count = (int(part) for part in parts)
    except ValueError:
        raise ValueError(f"--profile-steps-window takes FIRST,COUNT (two whole numbers, e.g. 200,20); "
                         f"got {text!r}") from None
    if first < 1 or count < 1:
        raise ValueError(f"--profile-steps-window: FIRST and COUNT are 1 or more; got {text!r}")
    return first, count


class StepTracer:
    """Wraps each step call of the serving loop: records the configured windows once, then stays out of
    the way (a counter and two comparisons per step)."""

    def __init__(self, diagnostics: Diagnostics) -> None:
        self.directory = Path(diagnostics.step_trace_dir)
        self.first, self.count = diagnostics.step_trace_first, diagnostics.step_trace_count
        self.calls = 0
        self._torch_profile: Any = None
        self._python_profile: Any = None

    def __call__(self, step: Callable[[], list]) -> list:
        self.calls += 1
        if self.calls == self.first:
            self._torch_profile = _torch_profiler()
            self._torch_profile.__enter__()
        elif self.calls == self.first + self.count:
            import cProfile

            self._python_profile = cProfile.Profile()
        if self._torch_profile is not None:
            from torch.profiler import record_function

            with record_function("flare.step"):
                produced = step()
        elif self._python_profile is not None:
            produced = self._python_profile.runcall(step)
        else:
            return step()
        if self.calls == self.first + self.count - 1:
            self._write_trace()
        elif self.calls == self.first + 2 * self.count - 1:
            self._write_python_profile()
        return produced

    def _write_trace(self) -> None:
        import torch

        if torch.cuda.is_available():
            torch.cuda.synchronize()
        profiler, self._torch_profile = self._torch_profile, None
        profiler.__exit__(None, None, None)
        self.directory.mkdir(parents=True, exist_ok=True)
        trace = self.directory / f"engine-steps-{os.getpid()}.json.gz"
        profiler.export_chrome_trace(str(trace))
        (self.directory / f"engine-steps-{os.getpid()}.txt").write_text(summarize(load_trace(trace)))

    def _write_python_profile(self) -> None:
        profiler, self._python_profile = self._python_profile, None
        self.directory.mkdir(parents=True, exist_ok=True)
        profiler.dump_stats(str(self.directory / f"engine-steps-{os.getpid()}.prof"))


def _torch_profiler():
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities)


def load_trace(path: Path) -> list[dict]:
    opener = gzip.open if path.suffix == ".gz" else open
    with opener(path, "rt") as handle:
        return json.load(handle)["traceEvents"]


def summarize(events: list[dict]) -> str:
    """Per recorded step: its wall time, the device's busy time within it (kernels and copies, overlaps
    merged) and the device's longest idle stretch within it; then the same over all of them."""
    steps = sorted((e for e in events if e.get("ph") == "X" and e.get("name") == "flare.step"
                    and e.get("cat") != "gpu_user_annotation"), key=lambda e: e["ts"])
    device = sorted(((e["ts"], e["ts"] + e["dur"]) for e in events
                     if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")))
    lines = [f"{'step':>4} {'wall ms':>8} {'device busy ms':>15} {'longest gap ms':>15}"]
    for index, step in enumerate(steps):
        busy, gap = _busy_and_gap(device, step["ts"], step["ts"] + step["dur"])
        lines.append(f"{index:>4} {step['dur'] / 1e3:>8.3f} {busy / 1e3:>15.3f} {gap / 1e3:>15.3f}")
    if steps:
        start, end = steps[0]["ts"], steps[-1]["ts"] + steps[-1]["dur"]
        busy, gap = _busy_and_gap(device, start, end)
        lines.append(f"{'all':>4} {(end - start) / 1e3:>8.3f} {busy / 1e3:>15.3f} {gap / 1e3:>15.3f}"
                     f"   (device busy {100 * busy / max(end - start, 1e-9):.1f}% of the window)")
    return "\n".join(lines) + "\n"


def _busy_and_gap(device: list[tuple[float, float]], start: float, end: float) -> tuple[float, float]:
    """Busy microseconds of the device within [start, end] and its longest idle stretch there."""
    busy, gap, cursor = 0.0, 0.0, start
    for begin, finish in device:
        if finish <= start or begin >= end:
            continue
        begin, finish = max(begin, start), min(finish, end)
        if begin > cursor:
            gap = max(gap, begin - cursor)
        if finish > cursor:
            busy += finish - max(begin, cursor)
            cursor = finish
    return busy, max(gap, end - cursor)
