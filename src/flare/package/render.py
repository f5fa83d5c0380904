"""Boxed sections for inspection output: light single-line boxes, cyan titles and muted labels on a
terminal; no styling when redirected, under --plain or with TERM=dumb; 80 columns when redirected,
otherwise the terminal's width clamped to 64..120."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass
from typing import TextIO

MIN_WIDTH, MAX_WIDTH, REDIRECTED_WIDTH = 64, 120, 80


@dataclass(frozen=True)
class Section:
    title: str
    rows: list[tuple[str, str]] | None = None                  # label/value pairs
    table: tuple[list[str], list[list[str]]] | None = None     # header, rows


def make_console(stream: TextIO | None = None, plain: bool = False):
    from rich.console import Console
    stream = stream or sys.stdout
    terminal = bool(getattr(stream, "isatty", lambda: False)())
    dumb = os.environ.get("TERM") == "dumb"
    width = REDIRECTED_WIDTH
    if terminal:
        try:
            width = max(MIN_WIDTH, min(MAX_WIDTH, os.get_terminal_size(stream.fileno()).columns))
        except (OSError, ValueError, AttributeError):
            pass                                        # a terminal whose size cannot be read
    styled = terminal and not plain and not dumb
    return Console(file=stream, width=width, no_color=not styled, color_system="auto" if styled else None,
                   force_terminal=styled, highlight=False, emoji=False, soft_wrap=False)


def render(sections: list[Section], stream: TextIO | None = None, plain: bool = False,
           banner_name: str | None = None) -> None:
    """Print the sections; on a styled terminal, `banner_name` first appears in gradient block letters."""
    from rich import box
    from rich.panel import Panel
    from rich.table import Table
    from rich.text import Text
    console = make_console(stream, plain)
    if banner_name and not console.no_color:
        from flare.package.name_banner import render_lines
        for line in render_lines(banner_name, console.width - 2):
            console.print(line)
    for section in sections:
        if section.table is not None:
            header, rows = section.table
            body = Table(box=box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="dim", padding=(0, 1), collapse_padding=True)
            for index, column in enumerate(header):
                body.add_column(column, overflow="fold", min_width=len(column), no_wrap=index == 0 and len(rows) > 0
                                and max(len(str(row[0])) for row in rows) <= 24)
            for row in rows:
                body.add_row(*[Text(str(cell)) for cell in row])
        else:
            body = Table.grid(padding=(0, 2))
            body.add_column(style="dim", no_wrap=True)
            body.add_column(overflow="fold")
            for label, value in section.rows or []:
                body.add_row(label, Text(value))
        console.print(Panel(body, title=Text(section.title, style="cyan"), title_align="left", box=box.SQUARE,
                            expand=True))
