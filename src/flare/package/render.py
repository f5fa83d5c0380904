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
    """Print the sections; on a styled terminal, `banner_name` first appears in gradient block letters.
    --plain (`plain`) prints each section as its title over aligned text, with no box drawing."""
    from rich import box
    from rich.panel import Panel
    from rich.text import Text
    console = make_console(stream, plain)
    if banner_name and not console.no_color:
        from flare.package.name_banner import render_lines
        for line in render_lines(banner_name, console.width - 2):
            console.print(line)
    for index, section in enumerate(sections):
        body = _body(section, plain)
        if plain:
            with console.capture() as captured:
                console.print(body)
            lines = [section.title, *(line.rstrip() for line in captured.get().splitlines())]
            console.file.write(("\n" if index else "") + "\n".join(lines) + "\n")
            continue
        console.print(Panel(body, title=Text(section.title, style="cyan"), title_align="left", box=box.SQUARE,
                            expand=True))


def _body(section: Section, plain: bool):
    """A section's label/value grid or its table. Headers and cells never wrap inside a word: values
    fold only where they cannot fit (a table's first column, an identifier, stays whole)."""
    from rich import box
    from rich.table import Table
    from rich.text import Text
    if section.table is None:
        body = Table.grid(padding=(0, 2))
        body.add_column(style="dim", no_wrap=True)
        body.add_column(overflow="fold")
        for label, value in section.rows or []:
            body.add_row(label, Text(value))
        return body
    header, rows = section.table
    body = Table(box=None if plain else box.SIMPLE_HEAD, show_edge=False, pad_edge=False, header_style="dim",
                 padding=(0, 1), collapse_padding=not plain)
    for index, column in enumerate(header):
        widest = max([len(column), *(len(str(row[index])) for row in rows)])
        body.add_column(Text(column, no_wrap=True), overflow="fold", min_width=widest if index == 0 else len(column),
                        no_wrap=index == 0 and widest <= 24)
    for row in rows:
        body.add_row(*[Text(str(cell)) for cell in row])
    return body
