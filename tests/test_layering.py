"""The folders of src/flare depend on each other in one direction: the engine core knows nothing of its clients."""

from __future__ import annotations

import ast
from pathlib import Path

SOURCE = Path(__file__).resolve().parents[1] / "src" / "flare"


def imported_flare_modules(folder: str) -> dict[str, set[str]]:
    """{module file: the flare modules it imports (at any depth of the file)}."""
    found = {}
    for path in sorted((SOURCE / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
            elif isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
        found[str(path.relative_to(SOURCE))] = {name for name in names if name.startswith("flare.")}
    return found


def test_the_engine_imports_none_of_its_clients_or_the_server():
    above = ("flare.frontend", "flare.engine_client", "flare.server", "flare.cli", "flare.ui")
    offending = {module: sorted(name for name in names if name.startswith(above))
                 for module, names in imported_flare_modules("engine").items()}
    assert {module: names for module, names in offending.items() if names} == {}


def test_the_frontend_imports_no_engine_client_or_server():
    above = ("flare.engine_client", "flare.server", "flare.cli")
    offending = {module: sorted(name for name in names if name.startswith(above))
                 for module, names in imported_flare_modules("frontend").items()}
    assert {module: names for module, names in offending.items() if names} == {}
