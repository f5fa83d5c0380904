"""The live metrics dashboard `flare run` shows on a terminal once serving starts (spec 5.2).

    dashboard = Dashboard.for_stream(stream, "stories260k", "http://127.0.0.1:8000")   # None when redirected
    dashboard.attach(state)          # the app's ServingState: engine numbers, metrics, finished requests
    dashboard.start() ... dashboard.stop()

Everything shown comes from what the server already keeps: the engine's `stats()` (running, waiting, KV
pages, prefix cache counters, preemptions, page integrity), the app's Prometheus counters (finished HTTP
requests, prompt tokens) and, per sequence, the outputs the engine streams (generated tokens, time to first
token, how it ended). Redirected output never gets a dashboard: its plain lines stay as they are.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass
from typing import Any, TextIO

from flare.ui.stages import is_terminal

REFRESH_PER_SECOND = 2
RATE_WINDOW_S = 5.0         # tokens/s is taken over this many recent seconds
RECENT_REQUESTS = 5


@dataclass(frozen=True)
class FinishedSequence:
    status: str                 # the finish reason (stop, length, ...) or "aborted"
    prompt_tokens: int
    generated_tokens: int
    ttft_s: float | None        # None when no token came


@dataclass(frozen=True)
class Figures:
    """One moment's numbers, everything the dashboard draws."""

    uptime_s: float
    running: int
    waiting: int
    finished_requests: int      # engine requests (one per sequence, as running and waiting count them)
    aborted_requests: int       # of those, the ones that ended before finishing (a client went away)
    rejected_requests: int      # HTTP requests answered with an error
    prompt_tokens: int
    generated_tokens: int
    prompt_tokens_per_s: float
    generated_tokens_per_s: float
    kv_pages_used: int
    kv_pages_total: int
    prefix_hit_tokens: int
    prefix_miss_tokens: int
    preemptions: int
    page_integrity: str
    recent: tuple[FinishedSequence, ...]

    @property
    def kv_usage(self) -> float | None:
        return self.kv_pages_used / self.kv_pages_total if self.kv_pages_total else None

    @property
    def prefix_hit_rate(self) -> float | None:
        looked_up = self.prefix_hit_tokens + self.prefix_miss_tokens
        return self.prefix_hit_tokens / looked_up if looked_up else None


def stat(stats: Any, name: str, default: Any = 0) -> Any:
    """A field of EngineStats (`default` when there are no stats yet)."""
    value = getattr(stats, name, None)
    return default if value is None else value


class TokenRates:
    """Tokens per second over the last RATE_WINDOW_S seconds, from cumulative counts sampled over time."""

    def __init__(self, window_s: float = RATE_WINDOW_S) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int, int]] = deque()

    def add(self, now: float, prompt_tokens: int, generated_tokens: int) -> tuple[float, float]:
        self._samples.append((now, prompt_tokens, generated_tokens))
        while len(self._samples) > 2 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()
        then, prompt_then, generated_then = self._samples[0]
        span = now - then
        if span <= 0:
            return 0.0, 0.0
        return (prompt_tokens - prompt_then) / span, (generated_tokens - generated_then) / span


class SequenceRecorder:
    """Counts generated tokens as they stream and keeps the latest finished sequences.

    It observes `Generation` (the one place every API's sequences pass through; see its `observer`),
    so the dashboard sees tokens live rather than only when a request ends."""

    def __init__(self, keep: int = RECENT_REQUESTS) -> None:
        self.generated_tokens = 0
        self.finished = 0
        self.aborted = 0
        self.recent: deque[FinishedSequence] = deque(maxlen=keep)
        self._lock = threading.Lock()

    def tokens_streamed(self, count: int) -> None:
        with self._lock:
            self.generated_tokens += count

    def sequence_ended(self, status: str, prompt_tokens: int, generated_tokens: int, ttft_s: float | None) -> None:
        with self._lock:
            self.finished += 1
            self.aborted += status == "aborted"
            self.recent.append(FinishedSequence(status, prompt_tokens, generated_tokens, ttft_s))

    def snapshot(self) -> tuple[int, int, int, tuple[FinishedSequence, ...]]:
        """Generated tokens, finished and aborted sequences, and the latest finished ones."""
        with self._lock:
            return self.generated_tokens, self.finished, self.aborted, tuple(self.recent)


# ---- drawing --------------------------------------------------------------------------------------------

def percent(fraction: float | None) -> str:
    return "-" if fraction is None else f"{100 * fraction:.1f}%"


def duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m{rest % 60:02d}s" if hours else f"{rest // 60}m{rest % 60:02d}s"


def render(title: str, url: str, figures: Figures):
    """The dashboard as a rich renderable (a panel holding two small tables)."""
    from rich.console import Group
    from rich.panel import Panel
    from rich.table import Table

    grid = Table.grid(padding=(0, 2))
    grid.add_column(style="bold cyan", no_wrap=True)
    grid.add_column(no_wrap=True)
    kv = (f"{figures.kv_pages_used:,} / {figures.kv_pages_total:,} pages ({percent(figures.kv_usage)})")
    integrity = figures.page_integrity
    integrity_style = "green" if integrity == "ok" else "dim" if integrity == "unchecked" else "bold red"
    rows = (
        ("Uptime", duration(figures.uptime_s)),
        ("Requests", f"{figures.running} running, {figures.waiting} waiting, "
                     f"{figures.finished_requests:,} finished ({figures.aborted_requests:,} aborted), "
                     f"{figures.rejected_requests:,} rejected"),
        ("Prompt tokens", f"{figures.prompt_tokens:,} ({figures.prompt_tokens_per_s:,.1f} tok/s)"),
        ("Generated tokens", f"{figures.generated_tokens:,} ({figures.generated_tokens_per_s:,.1f} tok/s)"),
        ("KV cache", kv),
        ("Prefix cache hits", f"{percent(figures.prefix_hit_rate)} of "
                              f"{figures.prefix_hit_tokens + figures.prefix_miss_tokens:,} prompt tokens"),
        ("Preemptions", f"{figures.preemptions:,}"),
        ("Page integrity", f"[{integrity_style}]{integrity}[/]"),
    )
    for name, value in rows:
        grid.add_row(name, value)
    recent = Table(title="Recent requests", title_justify="left", expand=False, box=None, padding=(0, 2))
    for column in ("status", "prompt", "generated", "TTFT"):
        recent.add_column(column, justify="left" if column == "status" else "right")
    for sequence in reversed(figures.recent):
        ttft = "-" if sequence.ttft_s is None else f"{1000 * sequence.ttft_s:,.0f} ms"
        recent.add_row(sequence.status, f"{sequence.prompt_tokens:,}", f"{sequence.generated_tokens:,}", ttft)
    if not figures.recent:
        recent.add_row("[dim]none yet[/]", "", "", "")
    return Panel(Group(grid, "", recent), title=f"[bold]{title}[/] at {url}/v1",
                 subtitle="Ctrl-C drains and stops", title_align="left", expand=False)


# ---- the live display -----------------------------------------------------------------------------------

class Dashboard:
    def __init__(self, stream: TextIO, title: str, url: str) -> None:
        self.stream, self.title, self.url = stream, title, url
        self.started = time.monotonic()
        self.recorder = SequenceRecorder()
        self.rates = TokenRates()
        self._state: Any = None
        self._live: Any = None

    @classmethod
    def for_stream(cls, stream: TextIO, title: str, url: str) -> "Dashboard | None":
        """A dashboard when `stream` is a usable terminal (a tty, TERM not dumb); None otherwise."""
        return cls(stream, title, url) if is_terminal(stream) else None

    def attach(self, state: Any) -> None:
        """Read from the app's ServingState, and record the sequences its Generation streams."""
        self._state = state
        state.generation.observer = self.recorder

    def engine_stats(self) -> Any:
        """The engine's EngineStats as of its latest step."""
        return self._state.engine.stats()

    def figures(self, now: float | None = None) -> Figures:
        now = time.monotonic() if now is None else now
        stats = self.engine_stats() if self._state is not None else None
        registry = self._state.metrics.registry if self._state is not None else None
        rejected = prompt = 0
        if registry is not None:
            for metric in registry.collect():
                for sample in metric.samples:
                    # (its "ok" count grows when a streamed answer starts, so finished ones come from the recorder)
                    if sample.name == "flare_requests_total" and sample.labels.get("outcome") != "ok":
                        rejected += int(sample.value)
                    elif sample.name == "flare_prompt_tokens_total":
                        prompt = int(sample.value)
        generated, finished, aborted, recent = self.recorder.snapshot()
        prompt_rate, generated_rate = self.rates.add(now, prompt, generated)
        return Figures(
            uptime_s=now - self.started, running=int(stat(stats, "num_running")),
            waiting=int(stat(stats, "num_waiting")), finished_requests=finished, aborted_requests=aborted,
            rejected_requests=rejected,
            prompt_tokens=prompt, generated_tokens=generated, prompt_tokens_per_s=prompt_rate,
            generated_tokens_per_s=generated_rate, kv_pages_used=int(stat(stats, "kv_pages_used")),
            kv_pages_total=int(stat(stats, "kv_pages_total")),
            prefix_hit_tokens=int(stat(stats, "prefix_cache_hit_tokens")),
            prefix_miss_tokens=int(stat(stats, "prefix_cache_miss_tokens")),
            preemptions=int(stat(stats, "num_preemptions")),
            page_integrity=str(stat(stats, "page_integrity", "unchecked")), recent=recent)

    def __rich__(self):
        try:
            return render(self.title, self.url, self.figures())
        except Exception as error:               # a display glitch must never stop the server
            return f"dashboard unavailable: {error}"

    def start(self) -> None:
        from rich.console import Console
        from rich.live import Live

        console = Console(file=self.stream, force_terminal=True)
        self._live = Live(self, console=console, refresh_per_second=REFRESH_PER_SECOND, transient=False,
                          redirect_stdout=False, redirect_stderr=False)
        self._live.start()

    def stop(self) -> None:
        """Stop redrawing and hand the terminal back (the last frame stays on screen). Safe to repeat."""
        live, self._live = self._live, None
        if live is not None:
            live.stop()
