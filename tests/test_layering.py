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
                names.update(f"{node.module}.{alias.name}" for alias in node.names)    # from flare.x import y
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


def unit_of(module: str) -> str | None:
    """The folder (`engine/`) or top-level module (`prepare`) of src/flare that a dotted name lives in."""
    parts = module.split(".")
    if parts[0] != "flare" or len(parts) < 2:
        return None
    if (SOURCE / parts[1]).is_dir():
        return parts[1] + "/"
    return parts[1] if (SOURCE / f"{parts[1]}.py").is_file() else None


def imports_between_units() -> dict[tuple[str, str], list[str]]:
    """{(importing unit, imported unit): the import sites}: every import, at any depth, under TYPE_CHECKING too."""
    found: dict[tuple[str, str], list[str]] = {}
    for path in sorted(SOURCE.rglob("*.py")):
        relative = path.relative_to(SOURCE)
        own = relative.parts[0] + "/" if len(relative.parts) > 1 else relative.stem
        package = ["flare", *relative.parts[:-1]]
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):
                base = package[:len(package) - node.level + 1] if node.level else []
                module = ".".join([*base, *([node.module] if node.module else [])])
                names = [module, *(f"{module}.{alias.name}" for alias in node.names)]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            else:
                continue
            for other in {unit_of(name) for name in names} - {None, own}:
                found.setdefault((own, other), []).append(f"{relative}:{node.lineno}")
    return found


def a_cycle(edges) -> list[str]:
    """Some cycle of the graph as [a, b, ..., a], or [] when it has none."""
    following: dict[str, set[str]] = {}
    for source, target in edges:
        following.setdefault(source, set()).add(target)
    done: set[str] = set()

    def search(node: str, path: list[str]) -> list[str]:
        if node in path:
            return path[path.index(node):] + [node]
        if node in done:
            return []
        for target in sorted(following.get(node, ())):
            if cycle := search(target, path + [node]):
                return cycle
        done.add(node)
        return []

    for start in sorted(following):
        if cycle := search(start, []):
            return cycle
    return []


def test_no_import_cycle_between_the_folders_and_top_level_modules():
    edges = imports_between_units()
    cycle = a_cycle(edges)
    sites = {f"{a} -> {b}": edges[a, b][:3] for a, b in zip(cycle, cycle[1:])}
    assert cycle == [], f"import cycle {' -> '.join(cycle)}: {sites}"


def test_the_cycle_finder_finds_a_cycle():
    assert a_cycle({("a", "b"), ("b", "c"), ("c", "a"), ("c", "d")}) == ["a", "b", "c", "a"]
    assert a_cycle({("a", "b"), ("b", "c"), ("a", "c")}) == []


def test_the_runner_side_of_the_step_contract_imports_no_allocator_scheduler_or_request():
    """The runner gets what it needs in the StepPlan (flare.engine.step): never the PageAllocator, the
    scheduler's state or a Request."""
    runner_side = ("engine/runner.py", "engine/step.py", "engine/batch_slots.py", "engine/step_inputs.py",
                   "engine/cuda_graphs.py")
    planner_side = ("flare.engine.kv_cache", "flare.engine.scheduler", "flare.engine.request", "flare.engine.core")
    imported = imported_flare_modules("engine")
    offending = {module: sorted(name for name in imported[module] if name.startswith(planner_side))
                 for module in runner_side}
    assert {module: names for module, names in offending.items() if names} == {}
