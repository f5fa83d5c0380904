"""Shared test fixtures. No test needs a GPU or the network; every test gets its own home directory."""

from __future__ import annotations

import os
import threading
from pathlib import Path

import pytest

# Without a GPU, Triton kernels run in Triton's interpreter; that must be chosen before triton is
# first imported, by any test module.
if not os.path.exists("/dev/nvidiactl"):
    os.environ.setdefault("TRITON_INTERPRET", "1")

REPO_ROOT = Path(__file__).resolve().parents[1]
STORIES260K = REPO_ROOT / "tests" / "fixtures" / "stories260k"


def pytest_configure(config):
    """One PyTorch thread per test process: the suite runs one worker per core, and tiny models on many
    threads spend most of their time synchronising (about ten times the CPU on two busy cores)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption("--numerics-report", default=None, metavar="PATH",
                     help="where the numerics gate (tests/models/test_numerics_gate.py, GPU) writes its measured "
                          "deviations as JSON")


@pytest.fixture(autouse=True)
def isolated_home(tmp_path_factory, monkeypatch) -> Path:
    """Point the home directory at a fresh folder so no test reads or writes the user's config or caches."""
    home = tmp_path_factory.mktemp("home")
    monkeypatch.setenv("HOME", str(home))
    return home


@pytest.fixture(autouse=True)
def restore_environment():
    """Commands run in-process set library variables from the configuration; undo that after each test."""
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)


# Threads an engine starts to load a tokenizer (the grammar vocabulary, the server's tokenizer loader)
# import transformers modules. Left running past their test, they import beside the next test's own
# transformers imports, and two threads importing its modules at once can leave its lazy module half set up
# (seen here: "cannot import name 'AutoConfig' from 'transformers'" in the test after an engine's warm-up).
TOKENIZER_THREADS = ("flare-grammar-vocabulary", "flare-tokenizer")


@pytest.fixture(autouse=True)
def tokenizer_threads_end_with_their_test():
    yield
    for thread in threading.enumerate():
        if thread.name.startswith(TOKENIZER_THREADS):
            thread.join(timeout=120)


@pytest.fixture(scope="session")
def stories260k() -> Path:
    if not STORIES260K.is_dir():
        pytest.fail(f"the stories260k fixture is missing at {STORIES260K}; the repository ships it, restore it with git")
    return STORIES260K
