"""Habits the code keeps, checked over src/flare: functions of at most 60 lines outside kernels/, each name
defined once."""

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


MAX_FUNCTION_LINES = 60


def long_functions(tree: ast.Module, where: str) -> dict[str, int]:
    """{"where name": lines} for functions (methods and nested ones too) longer than MAX_FUNCTION_LINES,
    counted from `def` to their last line."""
    return {f"{where} {node.name}": node.end_lineno - node.lineno + 1 for node in ast.walk(tree)
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
            and node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES}


def test_no_function_outside_kernels_is_longer_than_60_lines():
    """Kernels may be long (a Triton kernel is one function); nothing else is."""
    found = {}
    for relative, tree in parsed_modules():
        if relative.parts[0] != "kernels":
            found.update(long_functions(tree, relative.as_posix()))
    assert found == {}


def test_a_long_function_is_found():
    body = "\n".join(f"    x{i} = {i}" for i in range(MAX_FUNCTION_LINES))
    tree = ast.parse(f"def short():\n    pass\n\n\ndef long():\n{body}\n")
    assert long_functions(tree, "m.py") == {"m.py long": MAX_FUNCTION_LINES + 1}
