"""The served name as five-line block letters with a gold-to-orange gradient (`flare inspect` on a terminal).

Letters are spaced one column apart; a name too wide for the console wraps at its separators
(- . _ /), splitting a word only when the word alone is too wide. A name with characters the font
lacks gets no banner (it still appears as text in the Model box).
"""

from __future__ import annotations

GOLD, ORANGE = (255, 215, 0), (255, 140, 0)
HEIGHT = 5
SEPARATORS = "-._/"

_FONT_ROWS = {
    "A": (".#.", "#.#", "###", "#.#", "#.#"), "B": ("##.", "#.#", "##.", "#.#", "##."),
    "C": (".##", "#..", "#..", "#..", ".##"), "D": ("##.", "#.#", "#.#", "#.#", "##."),
    "E": ("###", "#..", "##.", "#..", "###"), "F": ("###", "#..", "##.", "#..", "#.."),
    "G": (".##", "#..", "#.#", "#.#", ".##"), "H": ("#.#", "#.#", "###", "#.#", "#.#"),
    "I": ("###", ".#.", ".#.", ".#.", "###"), "J": ("..#", "..#", "..#", "#.#", ".#."),
    "K": ("#.#", "#.#", "##.", "#.#", "#.#"), "L": ("#..", "#..", "#..", "#..", "###"),
    "M": ("#...#", "##.##", "#.#.#", "#...#", "#...#"), "N": ("#..#", "##.#", "#.##", "#..#", "#..#"),
    "O": (".#.", "#.#", "#.#", "#.#", ".#."), "P": ("##.", "#.#", "##.", "#..", "#.."),
    "Q": (".#.", "#.#", "#.#", "#.#", ".##"), "R": ("##.", "#.#", "##.", "#.#", "#.#"),
    "S": (".##", "#..", ".#.", "..#", "##."), "T": ("###", ".#.", ".#.", ".#.", ".#."),
    "U": ("#.#", "#.#", "#.#", "#.#", "###"), "V": ("#.#", "#.#", "#.#", "#.#", ".#."),
    "W": ("#...#", "#...#", "#.#.#", "##.##", "#...#"), "X": ("#.#", "#.#", ".#.", "#.#", "#.#"),
    "Y": ("#.#", "#.#", ".#.", ".#.", ".#."), "Z": ("###", "..#", ".#.", "#..", "###"),
    "0": (".#.", "#.#", "#.#", "#.#", ".#."), "1": (".#", "##", ".#", ".#", ".#"),
    "2": ("##.", "..#", ".#.", "#..", "###"), "3": ("##.", "..#", ".#.", "..#", "##."),
    "4": ("#.#", "#.#", "###", "..#", "..#"), "5": ("###", "#..", "##.", "..#", "##."),
    "6": (".##", "#..", "###", "#.#", "###"), "7": ("###", "..#", ".#.", ".#.", ".#."),
    "8": ("###", "#.#", "###", "#.#", "###"), "9": ("###", "#.#", "###", "..#", "##."),
    "-": ("..", "..", "##", "..", ".."), ".": (".", ".", ".", ".", "#"),
    "_": ("...", "...", "...", "...", "###"), "/": ("..#", "..#", ".#.", "#..", "#.."),
}


def supported(name: str) -> bool:
    return bool(name) and all(char.upper() in _FONT_ROWS for char in name)


def _glyph_width(char: str) -> int:
    return len(_FONT_ROWS[char.upper()][0])


def _width(text: str) -> int:
    return sum(_glyph_width(char) + 1 for char in text) - 1 if text else 0


def wrap(name: str, width: int) -> list[str]:
    """Pieces of `name` that each fit `width` columns, broken after separators where possible."""
    pieces, current = [], ""
    for token in _tokens(name):
        if _width(current + token) <= width:
            current += token
            continue
        if current:
            pieces.append(current)
        current = ""
        for char in token:                           # a word wider than the line splits where it must
            if _width(current + char) > width and current:
                pieces.append(current)
                current = ""
            current += char
    if current:
        pieces.append(current)
    return pieces


def _tokens(name: str) -> list[str]:
    tokens, current = [], ""
    for char in name:
        current += char
        if char in SEPARATORS:
            tokens.append(current)
            current = ""
    return tokens + ([current] if current else [])


def render_lines(name: str, width: int):
    """rich Text lines of the banner, or [] when the name has characters the font lacks."""
    from rich.text import Text
    if not supported(name):
        return []
    lines = []
    for piece in wrap(name, width):
        total = max(1, _width(piece) - 1)
        for row in range(HEIGHT):
            text = Text()
            column = 0
            for index, char in enumerate(piece):
                for cell in _FONT_ROWS[char.upper()][row]:
                    text.append("█" if cell == "#" else " ", style=_gradient(column / total))
                    column += 1
                if index < len(piece) - 1:
                    text.append(" ")
                    column += 1
            lines.append(text)
    return lines


def _gradient(fraction: float) -> str:
    red, green, blue = (round(a + (b - a) * fraction) for a, b in zip(GOLD, ORANGE))
    return f"#{red:02x}{green:02x}{blue:02x}"
