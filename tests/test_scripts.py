"""The README's scripts: serve-demo.sh reuses the demo package it exported while nothing changed, and
set-up says what it is doing. Run for real in a copy of the repository layout, with stand-in tools."""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]

FAKE_IGNITION = """#!/usr/bin/env bash
# Stands in for `ignition export demo`: counts its calls and publishes an entry each time.
set -euo pipefail
count=$(( $(cat "$FAKE_CALLS" 2>/dev/null || echo 0) + 1 ))
echo "$count" > "$FAKE_CALLS"
entry="$FAKE_CACHE/models/flare-demo/version-$count"
mkdir -p "$entry" && touch "$entry/model.safetensors"
echo "$entry"
"""


def _layout(tmp_path: Path) -> tuple[Path, dict]:
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "demo-package.sh", root / "scripts")
    shutil.copy(REPO / "pyproject.toml", root)
    (root / "src" / "flare").mkdir(parents=True)
    (root / "src" / "flare" / "engine.py").write_text("STEP = 1\n")
    ignition = root / ".venv" / "bin" / "ignition"
    ignition.parent.mkdir(parents=True)
    ignition.write_text(FAKE_IGNITION)
    ignition.chmod(0o755)
    env = dict(os.environ, HOME=str(tmp_path / "home"), FAKE_CALLS=str(tmp_path / "calls"),
               FAKE_CACHE=str(tmp_path / "cache"))
    return root, env


def _demo_package(root: Path, env: dict) -> tuple[str, str]:
    done = subprocess.run(["bash", str(root / "scripts" / "demo-package.sh")], env=env, capture_output=True,
                          text=True, check=True)
    return done.stdout.strip(), done.stderr


def test_the_demo_package_is_exported_once_while_nothing_changes(tmp_path):
    root, env = _layout(tmp_path)
    first, said = _demo_package(root, env)
    assert first.endswith("version-1") and "preparing the demo package" in said
    again, said = _demo_package(root, env)
    assert again == first and "reusing" in said
    assert (tmp_path / "calls").read_text().strip() == "1"


def test_changed_sources_a_changed_configuration_or_a_removed_entry_export_again(tmp_path):
    root, env = _layout(tmp_path)
    _demo_package(root, env)
    (root / "src" / "flare" / "engine.py").write_text("STEP = 2\n")
    assert _demo_package(root, env)[0].endswith("version-2")
    config = tmp_path / "home" / ".config" / "flare" / "config.toml"
    config.parent.mkdir(parents=True)
    config.write_text("[defaults]\nmax_concurrency = 2\n")
    assert _demo_package(root, env)[0].endswith("version-3")
    shutil.rmtree(tmp_path / "cache" / "models" / "flare-demo" / "version-3")     # flare models remove
    assert _demo_package(root, env)[0].endswith("version-4")
    assert _demo_package(root, env)[0].endswith("version-4")


def test_serve_demo_takes_its_package_from_demo_package():
    text = (REPO / "scripts" / "serve-demo.sh").read_text()
    assert 'entry="$(bash scripts/demo-package.sh)"' in text and "ignition export" not in text


def test_setup_says_each_step(tmp_path):
    """setup-env.sh with stand-in python3 and pip: every step prints a line, in order, before it runs."""
    root = tmp_path / "repo"
    (root / "scripts").mkdir(parents=True)
    shutil.copy(REPO / "scripts" / "setup-env.sh", root / "scripts")
    tools = tmp_path / "bin"
    tools.mkdir()
    # python3 -m venv DIR creates DIR/bin/python, a stand-in whose `-c 'import torch'` fails (no torch yet)
    # until pip "installs" it, and whose `-m pip` records what was installed.
    fake_python = f"""#!/usr/bin/env bash
if [ "$1" = "-m" ] && [ "$2" = "venv" ]; then
  target="${{@: -1}}"; mkdir -p "$target/bin"; cp "$0" "$target/bin/python"; exit 0
fi
if [ "$1" = "-m" ] && [ "$2" = "pip" ]; then
  echo "$*" >> {tmp_path}/pip.log; case "$*" in *torch==*) touch {tmp_path}/torch;; esac; exit 0
fi
if [ "$1" = "-c" ]; then
  [ -f {tmp_path}/torch ] || exit 1
  case "$2" in *version*) echo 2.13.0;; esac
  exit 0
fi
exit 1
"""
    (tools / "python3").write_text(fake_python)
    (tools / "python3").chmod(0o755)
    env = dict(os.environ, PATH=f"{tools}:{os.environ['PATH']}")
    done = subprocess.run(["bash", str(root / "scripts" / "setup-env.sh"), "test"], env=env, capture_output=True,
                          text=True, check=True)
    lines = [line for line in done.stderr.splitlines() if line.startswith("setup: ")]
    assert [line.split(":", 1)[1].split()[0] for line in lines] == ["creating", "updating", "installing",
                                                                    "installing", "ready"]
    assert "PyTorch 2.13.0, CPU build" in lines[2] and '".[test]"' in lines[3]
    assert (tmp_path / "pip.log").read_text().count("pip install") == 3
