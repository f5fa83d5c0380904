"""Help for every package command is fast: it imports neither torch nor cryptography."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
CHECK = ("import sys\n"
         "from flare.cli.{prog} import main\n"
         "code = main(sys.argv[1:])\n"
         "heavy = [m for m in ('torch', 'cryptography', 'safetensors') if m in sys.modules]\n"
         "sys.exit(10 if heavy else code)\n")


@pytest.mark.parametrize("prog, argv", [
    ("ignition", ["export", "--help"]), ("ignition", ["convert", "--help"]), ("ignition", ["keygen", "--help"]),
    ("ignition", ["key-password", "--help"]), ("ignition", ["sign", "--help"]),
    ("flare", ["inspect", "--help"]), ("flare", ["models", "list", "--help"]),
    ("flare", ["models", "inspect", "--help"]), ("flare", ["trust", "revoke", "--help"]),
])
def test_help_imports_nothing_heavy(prog, argv):
    result = subprocess.run([sys.executable, "-c", CHECK.format(prog=prog), *argv], capture_output=True, text=True,
                            env={"PYTHONPATH": str(REPO / "src"), "HOME": "/nonexistent"})
    assert result.returncode == 0, result.stderr
    assert "usage:" in result.stdout
