"""Preparation phases on stderr: an activity bar on a terminal, plain start and completion lines otherwise.

    progress = PhaseProgress()
    with progress.phase("Load weights") as phase:
        ...
        phase.done("5 layers, 1.0 MiB")        # or phase.skip("CPU: no kernels to tune")

Each finished phase prints its result and elapsed time; `--verbose` adds detail lines.
"""

from __future__ import annotations

import contextlib
import sys
import time
from dataclasses import dataclass, field
from typing import Iterator, TextIO


@dataclass
class PhaseRecord:
    name: str
    status: str = "running"                       # running, ok, skipped, failed
    detail: str = ""
    elapsed_s: float = 0.0
    details: list[str] = field(default_factory=list)


class Phase:
    def __init__(self, progress: "PhaseProgress", record: PhaseRecord):
        self._progress = progress
        self.record = record

    def done(self, detail: str = "") -> None:
        self.record.status, self.record.detail = "ok", detail

    def skip(self, reason: str) -> None:
        self.record.status, self.record.detail = "skipped", reason

    def note(self, line: str) -> None:
        """A detail line, shown with --verbose."""
        self.record.details.append(line)
        self._progress.detail(line)

    def update(self, text: str) -> None:
        """Live activity text on a terminal (ignored when redirected)."""
        self._progress.activity(text)


class PhaseProgress:
    def __init__(self, stream: TextIO | None = None, verbose: bool = False, styled: bool | None = None):
        self.stream = stream or sys.stderr
        self.verbose = verbose
        self.styled = _is_terminal(self.stream) if styled is None else styled
        self.records: list[PhaseRecord] = []
        self._status = None

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[Phase]:
        record = PhaseRecord(name)
        self.records.append(record)
        started = time.monotonic()
        self._start(name)
        phase = Phase(self, record)
        try:
            yield phase
        except BaseException:
            record.status = "failed"
            raise
        finally:
            record.elapsed_s = time.monotonic() - started
            if record.status == "running":
                record.status = "ok"
            self._finish(record)

    def summary(self) -> list[dict]:
        return [{"phase": r.name, "status": r.status, "detail": r.detail, "elapsed_s": round(r.elapsed_s, 3)}
                for r in self.records]

    def line(self, text: str) -> None:
        print(text, file=self.stream, flush=True)

    def detail(self, text: str) -> None:
        if self.verbose:
            self.line(f"    {text}")

    def activity(self, text: str) -> None:
        if self._status is not None:
            self._status.update(text)

    def _start(self, name: str) -> None:
        if self.styled:
            from rich.console import Console
            console = Console(file=self.stream, stderr=self.stream is sys.stderr)
            self._status = console.status(f"{name}.", spinner="line")
            self._status.start()
        else:
            self.line(f"{name}. ...")

    def _finish(self, record: PhaseRecord) -> None:
        if self._status is not None:
            self._status.stop()
            self._status = None
        mark = {"ok": "[ OK ]", "skipped": "[SKIP]", "failed": "[FAILED]"}[record.status]
        text = f"{record.name}. {mark} {record.detail}".rstrip() + f" ({record.elapsed_s:.2f}s)"
        if self.styled:
            from rich.console import Console
            from rich.text import Text
            colour = {"ok": "cyan", "skipped": "grey50", "failed": "red"}[record.status]
            Console(file=self.stream, highlight=False).print(Text(text, style=colour))
        else:
            self.line(text)


def _is_terminal(stream: TextIO) -> bool:
    import os
    return bool(getattr(stream, "isatty", lambda: False)()) and os.environ.get("TERM") != "dumb"


def format_bytes(count: int | None) -> str:
    if count is None:
        return "-"
    value = float(count)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if value < 1024 or unit == "TiB":
            return f"{int(value)} {unit}" if unit == "B" else f"{value:.1f} {unit}"
        value /= 1024
    return f"{count} B"
