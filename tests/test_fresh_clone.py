"""The README's test command on a fresh clone: the tests read nothing from outside the repository (no
../shared beside it), so a user's clone has every fixture they use. Tested on a clone of the commit checked
out here, with no ../shared beside it."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def clone(tmp_path_factory) -> Path:
    if shutil.which("git") is None or subprocess.run(["git", "-C", str(REPO), "rev-parse", "HEAD"],
                                                     capture_output=True).returncode != 0:
        pytest.skip("not a git checkout")
    target = tmp_path_factory.mktemp("fresh") / "flare"
    subprocess.run(["git", "clone", "--quiet", "--depth", "1", f"file://{REPO}", str(target)], check=True,
                   capture_output=True)
    assert not (target.parent / "shared").exists()
    return target


def test_the_fixtures_the_tests_use_are_in_the_clone(clone):
    for name in ("config.json", "model.safetensors", "tokenizer.json", "reference/greedy.json"):
        assert (clone / "tests" / "fixtures" / "stories260k" / name).is_file(), name


def test_a_test_that_reads_stories260k_passes_in_the_clone(clone):
    env = dict(os.environ, PYTHONPATH=str(clone / "src"))
    done = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
                           "tests/models/test_stories260k.py::test_greedy_continuation_of_once_upon_a_time_equals_the_recorded_one"],
                          cwd=clone, env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert "1 passed" in done.stdout
