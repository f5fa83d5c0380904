"""The decode-step latency benchmark behind `ignition bench` (spec "GPU graph latency benchmark").

The harness is independent of what it measures: a `DecodeStepTarget` prefills real contexts for a case,
restores its state before every round (outside the timed interval), and runs one complete decode step;
a timer measures that step (CUDA events on a GPU). The harness runs the case matrix for every seed, prints
progress after each seed and rewrites the JSON output then, so a failed run keeps its partial samples
with status "incomplete".
"""

from __future__ import annotations

import json
import statistics
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Protocol, Sequence

from flare.errors import UsageError

DEFAULT_BATCHES = (1, 2, 4)
DEFAULT_CONTEXTS = (512, 2048, 8192, 16384)
DEFAULT_SEEDS = (0, 1, 2)
CONTEXT_MULTIPLE = 128


class DecodeStepTarget(Protocol):
    def prepare(self, batch: int, context: int, seed: int) -> None:
        """Prefill `batch` requests of `context` consumed tokens from `seed` and snapshot their state."""

    def restore(self) -> None:
        """Put cache and request state back to the snapshot (never timed)."""

    def step(self) -> None:
        """One complete decode step: forward, logits, sampling and state commit (timed)."""


Timer = Callable[[Callable[[], None]], float]       # runs the callable once, returns milliseconds


@dataclass(frozen=True)
class BenchConfig:
    batches: tuple[int, ...] = DEFAULT_BATCHES
    contexts: tuple[int, ...] = DEFAULT_CONTEXTS
    warmup: int = 5
    repetitions: int = 20
    seeds: tuple[int, ...] = DEFAULT_SEEDS

    @property
    def cases(self) -> list[tuple[int, int]]:
        return [(batch, context) for batch in self.batches for context in self.contexts]


def parse_int_list(text: str, flag: str, *, multiple_of: int = 1, allow_zero: bool = False) -> tuple[int, ...]:
    """A distinct comma-separated list of integers, each positive (or zero where allowed)."""
    values = []
    for part in text.split(","):
        part = part.strip()
        if not part.isdigit():
            raise UsageError(f"{flag} {text}: write distinct comma-separated whole numbers, e.g. 1,2,4")
        value = int(part)
        if value == 0 and not allow_zero or value % multiple_of:
            need = f"positive multiples of {multiple_of}" if multiple_of > 1 else "positive"
            raise UsageError(f"{flag} {text}: {value} is not allowed; values must be {need}")
        values.append(value)
    if len(set(values)) != len(values):
        raise UsageError(f"{flag} {text}: a value is repeated")
    return tuple(values)


def positive_int(text: str, flag: str) -> int:
    if not text.strip().isdigit() or int(text) == 0:
        raise UsageError(f"{flag} {text}: must be a positive whole number")
    return int(text)


# ----------------------------------------------------------------------------------------------------
# Results
# ----------------------------------------------------------------------------------------------------

@dataclass
class CaseResult:
    batch: int
    context: int
    samples_ms: dict[int, list[float]] = field(default_factory=dict)     # by seed
    seeds_complete: list[int] = field(default_factory=list)

    def all_samples(self) -> list[float]:
        return [sample for samples in self.samples_ms.values() for sample in samples]

    def summary(self, seeds: Sequence[int]) -> dict:
        samples = self.all_samples()
        complete = all(seed in self.seeds_complete for seed in seeds)
        result = {"batch": self.batch, "context": self.context, "complete": complete,
                  "samples": len(samples)}
        if samples:
            median, iqr = median_and_iqr(samples)
            result.update(median_ms=median, iqr_ms=iqr, min_ms=min(samples), max_ms=max(samples),
                          tokens_per_second=self.batch * 1000.0 / median)
        result["samples_ms"] = {str(seed): samples for seed, samples in self.samples_ms.items()}
        return result


def median_and_iqr(samples: Sequence[float]) -> tuple[float, float]:
    if len(samples) == 1:
        return samples[0], 0.0
    lower, _, upper = statistics.quantiles(samples, n=4, method="inclusive")
    return statistics.median(samples), upper - lower


@dataclass
class BenchRun:
    config: BenchConfig
    device: dict
    configuration: dict
    cases: dict[tuple[int, int], CaseResult]
    status: str = "incomplete"
    failure: str | None = None

    def to_json(self) -> dict:
        summaries = [case.summary(self.config.seeds) for case in self.cases.values()]
        document = {
            "status": self.status,
            "ignore_eos": True,
            "device": self.device,
            "configuration": {
                **self.configuration,
                "batches": list(self.config.batches), "contexts": list(self.config.contexts),
                "warmup": self.config.warmup, "repetitions": self.config.repetitions,
                "seeds": list(self.config.seeds),
            },
            "cases": summaries,
        }
        if self.status == "complete":
            # Equal-weight mean of case medians: describes matrix coverage, not production traffic.
            document["aggregate_ms"] = statistics.fmean(case["median_ms"] for case in summaries)
        else:
            document["failure"] = self.failure
        return document

    def table(self) -> str:
        lines = [f"{'batch':>5}  {'context':>7}  {'median ms':>9}  {'IQR ms':>7}  {'tok/s':>9}  samples"]
        for case in self.cases.values():
            samples = case.all_samples()
            if not samples:
                lines.append(f"{case.batch:>5}  {case.context:>7}  {'—':>9}  {'—':>7}  {'—':>9}  0")
                continue
            median, iqr = median_and_iqr(samples)
            lines.append(f"{case.batch:>5}  {case.context:>7}  {median:>9.3f}  {iqr:>7.3f}  "
                         f"{case.batch * 1000 / median:>9.1f}  {len(samples)}")
        if self.status == "complete":
            lines.append(f"aggregate (mean of case medians): {self.to_json()['aggregate_ms']:.3f} ms")
        else:
            lines.append(f"status: incomplete ({self.failure})")
        return "\n".join(lines)


# ----------------------------------------------------------------------------------------------------
# The run
# ----------------------------------------------------------------------------------------------------

def run_bench(target: DecodeStepTarget, config: BenchConfig, timer: Timer, *, device: dict,
              configuration: dict, output: Path | None = None,
              progress: Callable[[str], None] = print) -> BenchRun:
    """Measure every case for every seed. On failure the JSON keeps what was measured, with status
    "incomplete" and the failure, and the error propagates."""
    run = BenchRun(config, device, configuration,
                   {(batch, context): CaseResult(batch, context) for batch, context in config.cases})
    try:
        for seed in config.seeds:
            started = time.perf_counter()
            for batch, context in config.cases:
                _measure_case(target, run.cases[batch, context], seed, config, timer)
            _write(run, output)
            done = sum(len(case.samples_ms.get(seed, ())) for case in run.cases.values())
            progress(f"seed {seed}: {len(config.cases)} cases, {done} timed steps in "
                     f"{time.perf_counter() - started:.1f} s")
    except BaseException as error:
        run.failure = f"{type(error).__name__}: {error}"
        _write(run, output)
        raise
    run.status = "complete"
    _write(run, output)
    return run


def _measure_case(target: DecodeStepTarget, case: CaseResult, seed: int, config: BenchConfig,
                  timer: Timer) -> None:
    target.prepare(case.batch, case.context, seed)
    for _ in range(config.warmup):
        target.restore()
        target.step()
    samples = case.samples_ms.setdefault(seed, [])
    for _ in range(config.repetitions):
        target.restore()
        samples.append(float(timer(target.step)))
    case.seeds_complete.append(seed)


def _write(run: BenchRun, output: Path | None) -> None:
    if output is None:
        return
    output.parent.mkdir(parents=True, exist_ok=True)
    partial = output.with_name(output.name + ".partial")
    partial.write_text(json.dumps(run.to_json(), indent=2) + "\n")
    partial.replace(output)                     # readers never see a half-written file


def cuda_event_timer() -> Timer:
    """Time a callable with CUDA events on the current stream; work queued before it is not counted."""
    import torch

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)

    def timed(step: Callable[[], None]) -> float:
        start.record()
        step()
        end.record()
        end.synchronize()
        return start.elapsed_time(end)

    return timed


def device_identity() -> dict:
    """What the numbers were measured on: scores from different GPU classes stay separate."""
    import platform

    import torch

    identity = {"host": platform.node(), "torch": torch.__version__}
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(torch.cuda.current_device())
        identity.update(kind="cuda", name=props.name, capability=f"{props.major}.{props.minor}",
                        memory_bytes=props.total_memory, multiprocessors=props.multi_processor_count,
                        cuda=torch.version.cuda)
        try:
            import triton
            identity["triton"] = triton.__version__
        except ImportError:
            pass
    else:
        identity.update(kind="cpu", name=platform.processor() or platform.machine())
    return identity
