"""Habits the code keeps, checked over src/flare: short functions, each name defined once."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "flare"


def parsed_modules():
    for path in sorted(SOURCE.rglob("*.py")):
        yield path.relative_to(SOURCE), ast.parse(path.read_text())


def twice_defined(body: list[ast.stmt], where: str) -> list[str]:
    """Functions and classes defined a second time in the same body: the first is dead code."""
    seen, found = set(), []
    for node in body:
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            decorated = any(isinstance(d, ast.Attribute) for d in node.decorator_list)    # @x.setter
            if node.name in seen and not decorated:
                found.append(f"{where}:{node.lineno} {node.name}")
            seen.add(node.name)
            if isinstance(node, ast.ClassDef):
                found += twice_defined(node.body, f"{where} {node.name}")
    return found


def test_no_module_defines_a_function_or_class_twice():
    found = [entry for relative, tree in parsed_modules() for entry in twice_defined(tree.body, str(relative))]
    assert found == []


def test_a_second_definition_is_found():
    tree = ast.parse("def a(): pass\nclass B:\n    def c(self): pass\n    def c(self): pass\ndef a(): pass\n")
    assert twice_defined(tree.body, "m.py") == ["m.py B:4 c", "m.py:5 a"]
