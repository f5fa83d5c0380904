"""Loading stages of `flare run` (spec 5.2): one row per stage on stderr.

On a terminal each running stage animates a ten-column bar (cyan done, dark gray to go, half-cell
boundaries; a cyan-to-gray wave when the total is unknown) and ends as `[ OK ]` or `[ FAILED ]` with the
elapsed time. Redirected output gets plain start and completion lines, never escape codes.

    stages = StageReporter()
    with stages.stage("Load weights", total=weight_bytes) as stage:
        stage.advance(len(chunk))
"""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import sys
import threading
import time
from typing import Iterator, TextIO

BAR_CELLS = 10
_CYAN = "\x1b[36m"
_GRAY = "\x1b[90m"
_GREEN = "\x1b[32m"
_RED = "\x1b[31m"
_RESET = "\x1b[0m"
_FULL, _HALF, _EMPTY = "█", "▌", "░"
_ESCAPE = re.compile(r"\x1b\[[0-9;]*m")
_WAVE = ("\x1b[38;5;51m", "\x1b[38;5;44m", "\x1b[38;5;37m", "\x1b[38;5;30m", "\x1b[38;5;240m")


def is_terminal(stream: TextIO) -> bool:
    return bool(getattr(stream, "isatty", lambda: False)()) and os.environ.get("TERM") != "dumb"


def bar(fraction: float | None, tick: int = 0, styled: bool = True) -> str:
    """The ten cells: filled by `fraction` in half cells, or a moving wave when it is None."""
    if fraction is None:
        cells = []
        for cell in range(BAR_CELLS):
            shade = _WAVE[min((cell - tick) % BAR_CELLS, len(_WAVE) - 1)]
            cells.append(f"{shade}{_FULL}" if styled else _FULL)
        return "[" + "".join(cells) + (_RESET if styled else "") + "]"
    halves = max(0, min(2 * BAR_CELLS, int(fraction * 2 * BAR_CELLS)))
    done = _FULL * (halves // 2) + (_HALF if halves % 2 else "")
    rest = _EMPTY * (BAR_CELLS - len(done))
    if not styled:
        return f"[{done}{rest}]"
    return f"[{_CYAN}{done}{_GRAY}{rest}{_RESET}]"


def format_elapsed(seconds: float) -> str:
    return f"{seconds:.2f}s" if seconds < 60 else f"{int(seconds // 60)}m{seconds % 60:04.1f}s"


class Stage:
    def __init__(self, name: str, total: float | None) -> None:
        self.name = name
        self.total = total
        self.completed = 0.0
        self.detail = ""
        self.started = time.monotonic()

    def advance(self, amount: float) -> None:
        self.completed += amount

    def set_total(self, total: float | None) -> None:
        self.total = total

    def note(self, detail: str) -> None:
        """Text shown after the status when the stage finishes (what it did)."""
        self.detail = detail

    @property
    def fraction(self) -> float | None:
        if not self.total:
            return None
        return min(1.0, self.completed / self.total)


class StageReporter:
    NAME_WIDTH = 28

    def __init__(self, stream: TextIO | None = None, styled: bool | None = None) -> None:
        self.stream = stream or sys.stderr
        self.styled = is_terminal(self.stream) if styled is None else styled
        self.finished: list[tuple[str, str, float, str]] = []     # name, status, elapsed, detail
        self._lock = threading.Lock()

    @contextlib.contextmanager
    def stage(self, name: str, total: float | None = None, animate: bool = True) -> Iterator[Stage]:
        """One stage. `animate=False` keeps the terminal still (for a stage that may ask a question)."""
        stage = Stage(name, total)
        stop = threading.Event()
        animator = None
        if self.styled and animate:
            animator = threading.Thread(target=self._animate, args=(stage, stop), daemon=True)
            animator.start()
        elif not self.styled:
            self._write(f"{name} ...\n")
        status = "OK"
        try:
            yield stage
        except BaseException:
            status = "FAILED"
            raise
        finally:
            stop.set()
            if animator is not None:
                animator.join()
            elapsed = time.monotonic() - stage.started
            self.finished.append((name, status, elapsed, stage.detail))
            self._finish(stage, status, elapsed)

    def line(self, text: str) -> None:
        self._write(text + "\n")

    def _row(self, stage: Stage, right: str, width: int) -> str:
        room = max(8, min(self.NAME_WIDTH, width - len(_ESCAPE.sub("", right)) - 4))
        name = stage.name if len(stage.name) <= room else stage.name[:room - 1] + "…"
        return f"  {name:<{room}} {right}"

    def _animate(self, stage: Stage, stop: threading.Event) -> None:
        tick = 0
        while not stop.is_set():
            elapsed = format_elapsed(time.monotonic() - stage.started)
            right = f"{bar(stage.fraction, tick)} {elapsed:>8}"
            self._write("\r\x1b[2K" + self._row(stage, right, self._width()))
            tick += 1
            stop.wait(0.1)

    def _finish(self, stage: Stage, status: str, elapsed: float) -> None:
        if not self.styled:
            detail = f" {stage.detail}" if stage.detail else ""
            self._write(f"{stage.name}: {status} ({format_elapsed(elapsed)}){detail}\n")
            return
        colour = _GREEN if status == "OK" else _RED
        mark = f"[ {colour}{status}{_RESET} ]"
        filled = bar(1.0 if status == "OK" else stage.fraction or 0.0)
        right = f"{filled} {mark} {format_elapsed(elapsed):>8}"
        row = self._row(stage, right, self._width())
        detail = f"  {_GRAY}{stage.detail}{_RESET}" if stage.detail else ""
        visible_room = self._width() - (len(stage.name) + 40)
        if stage.detail and len(stage.detail) > visible_room:     # a narrow console drops the detail text
            detail = ""
        self._write("\r\x1b[2K" + row + detail + "\n")

    def _width(self) -> int:
        return shutil.get_terminal_size((100, 24)).columns

    def _write(self, text: str) -> None:
        with self._lock:
            self.stream.write(text)
            self.stream.flush()
