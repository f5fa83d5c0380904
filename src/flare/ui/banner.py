"""The Flare banner: block letters in a gold-to-orange gradient, shown first on a terminal only."""

from __future__ import annotations

import sys
from typing import TextIO

from flare.ui.stages import is_terminal

_LETTERS = [
    "█████ █      ███  ████  █████",
    "█     █     █   █ █   █ █    ",
    "████  █     █████ ████  ████ ",
    "█     █     █   █ █  █  █    ",
    "█     █████ █   █ █   █ █████",
]
# 256-colour codes from gold to deep orange, one per column band
_GRADIENT = (220, 214, 214, 208, 208, 202)


def banner_lines(styled: bool) -> list[str]:
    if not styled:
        return list(_LETTERS)
    lines = []
    width = len(_LETTERS[0])
    for row in _LETTERS:
        cells = []
        for column, char in enumerate(row):
            colour = _GRADIENT[column * len(_GRADIENT) // width]
            cells.append(f"\x1b[38;5;{colour}m{char}" if char != " " else " ")
        lines.append("".join(cells) + "\x1b[0m")
    return lines


def show_banner(stream: TextIO | None = None, subtitle: str = "") -> bool:
    """Print the banner when `stream` is a terminal; returns whether it did."""
    stream = stream or sys.stderr
    if not is_terminal(stream):
        return False
    stream.write("\n" + "\n".join("  " + line for line in banner_lines(styled=True)) + "\n")
    if subtitle:
        stream.write(f"  \x1b[90m{subtitle}\x1b[0m\n")
    stream.write("\n")
    stream.flush()
    return True
