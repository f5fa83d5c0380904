"""Publication is one atomic step: an export killed at any point of it leaves either the complete new
entry, selected as the default, or no new entry and the old default. Each case kills a real export
process (SIGKILL, from inside it) at one step of the publication."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from flare.package.reader import open_package
from flare.package.store import ModelCache
from flare.package.trust import TrustOptions

REPO = Path(__file__).resolve().parents[2]
STEPS = ("publishing", "signed", "ref-pending", "renamed", "selected")

EXPORT_KILLED_AT = """
import os, signal, sys
from pathlib import Path
from flare.package.store import ModelCache
from flare.prepare import CheckpointSource, ExportOptions, RecipeFacts, export_model

def stop_at(cache, step):
    if step == sys.argv[3]:
        os.kill(os.getpid(), signal.SIGKILL)

ModelCache._publication_step = stop_at
export_model(CheckpointSource(Path(sys.argv[1])), RecipeFacts(name="llama", model_id="stories260k"),
             ExportOptions(cache_root=Path(sys.argv[2]), dtype="float32"))
"""


def _export_killed_at(step: str, stories260k, cache_root) -> None:
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    done = subprocess.run([sys.executable, "-c", EXPORT_KILLED_AT, str(stories260k), str(cache_root), step],
                          env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == -9, f"the export was not stopped at {step}:\n{done.stderr}"


def _check_complete_or_nothing(cache: ModelCache, before: list[str], approved) -> str:
    """The default is the old one with no new entry, or a new complete entry; returns which."""
    versions = [entry.version for entry in cache.entries()]
    default = cache.default_version("stories260k")
    if default in before:
        assert versions == before, "a killed export left an unselected entry behind"
        return "nothing"
    assert default is not None and versions == sorted(before + [default])
    full = TrustOptions(approve_key=approved.approve_key, accept_publisher=approved.accept_publisher,
                        offline=True, verify_weights=True)
    with open_package("stories260k", full, cache_root=cache.root) as package:     # resolves the default
        assert package.manifest.version == default and len(list(package.iter_weights())) == 47
    return "complete"


@pytest.mark.slow
def test_an_export_killed_at_any_publication_step_publishes_all_or_nothing(stories260k, cache_root, export,
                                                                          approved):
    cache = ModelCache(cache_root)
    export()
    outcomes = {}
    for step in STEPS:
        before = [entry.version for entry in cache.entries()]
        _export_killed_at(step, stories260k, cache_root)
        outcomes[step] = _check_complete_or_nothing(cache, before, approved)
    # Before the rename nothing is published; from the rename on, the entry is published and selected.
    assert outcomes == {"publishing": "nothing", "signed": "nothing", "ref-pending": "nothing",
                        "renamed": "complete", "selected": "complete"}
    assert cache.gc()["removed_staging"]                  # what the killed exports staged is reclaimed
    assert cache_root.joinpath("refs", "stories260k").read_text().count("\n") <= 2
    latest = export()                                     # and the next export publishes normally
    assert cache.default_version("stories260k") == latest.name
    assert cache_root.joinpath("refs", "stories260k").read_text() == latest.name + "\n"


@pytest.mark.slow
def test_a_first_export_killed_before_its_rename_leaves_no_default(stories260k, cache_root, approved):
    _export_killed_at("ref-pending", stories260k, cache_root)
    cache = ModelCache(cache_root)
    assert cache.entries() == [] and cache.default_version("stories260k") is None
    from flare.errors import UsageError
    with pytest.raises(UsageError, match="no selected version of 'stories260k'"):
        cache.resolve("stories260k")
