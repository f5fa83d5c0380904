"""The cache stays consistent when an export dies, and gc reclaims exactly what nothing references."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from flare.errors import UsageError
from flare.package.store import EntryId, ModelCache, lease_entry

REPO = Path(__file__).resolve().parents[2]

EXPORT_THAT_STALLS = """
import sys, time
from pathlib import Path
from flare.package.export import ExportHooks
from flare.prepare import CheckpointSource, ExportOptions, RecipeFacts, export_model
marker = Path(sys.argv[3])
def on_payload(name, size, reused):
    if name == "weights/layer-002.safetensors":
        marker.write_text("paused")
        time.sleep(120)
export_model(CheckpointSource(Path(sys.argv[1])), RecipeFacts(name="llama", model_id="stories260k"),
             ExportOptions(cache_root=Path(sys.argv[2])), hooks=ExportHooks(on_payload))
"""


def _run_and_kill(stories260k, cache_root, tmp_path):
    marker = tmp_path / "paused"
    env = dict(os.environ, PYTHONPATH=str(REPO / "src"))
    process = subprocess.Popen([sys.executable, "-c", EXPORT_THAT_STALLS, str(stories260k), str(cache_root),
                                str(marker)], env=env, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 60
        while not marker.exists():
            assert process.poll() is None, "the export ended before it reached the pause"
            assert time.monotonic() < deadline
            time.sleep(0.05)
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()


def test_killed_export_leaves_only_staging_and_gc_reclaims_it(stories260k, cache_root, tmp_path, export):
    published = export()
    before = {path.name for path in (cache_root / "blobs").iterdir()}
    _run_and_kill(stories260k, cache_root, tmp_path)
    cache = ModelCache(cache_root)
    assert [entry.version for entry in cache.entries()] == [published.name]
    assert cache.default_version("stories260k") == published.name
    assert len(list((cache_root / "staging").iterdir())) == 1
    result = cache.gc()
    assert len(result["removed_staging"]) == 1
    assert result["removed_blobs"] == []                         # every blob the dead export made already existed
    assert list((cache_root / "staging").iterdir()) == []
    assert {path.name for path in (cache_root / "blobs").iterdir()} == before
    assert export().is_dir()


def test_gc_removes_blobs_only_a_dead_export_made(stories260k, cache_root, tmp_path):
    _run_and_kill(stories260k, cache_root, tmp_path)
    cache = ModelCache(cache_root)
    assert cache.entries() == []
    assert len(list((cache_root / "blobs").iterdir())) == 4      # embed and layers 0-2, stored before the pause
    result = cache.gc()
    assert len(result["removed_blobs"]) == 4 and result["reclaimed_bytes"] > 0
    assert list((cache_root / "blobs").iterdir()) == []


def test_gc_keeps_a_live_export_and_published_entries(export, cache_root):
    entry = export()
    cache = ModelCache(cache_root)
    with cache.staging_tree() as live:
        (live / "partial").write_bytes(b"x")
        assert cache.gc() == {"removed_staging": [], "removed_blobs": [], "reclaimed_bytes": 0}
        assert live.is_dir()
    assert (entry / "model.safetensors").is_file()


def test_remove_refuses_the_selected_default_and_leased_entries(export, cache_root):
    first, second = export(), export()
    cache = ModelCache(cache_root)
    selected = cache.entry_for_path(second)
    with pytest.raises(UsageError, match="selected default"):
        cache.remove(selected)
    older = cache.entry_for_path(first)
    with lease_entry(first):
        assert cache.is_leased(older)
        with pytest.raises(UsageError, match="in use by a running process"):
            cache.remove(older)
    assert not cache.is_leased(older)
    cache.remove(older)
    assert not first.exists()
    cache.remove(selected, clear_default=True)
    assert cache.default_version("stories260k") is None
    assert len(cache.gc()["removed_blobs"]) == 9


def test_select_refuses_an_unpublished_version(export, cache_root):
    first, second = export(), export()
    cache = ModelCache(cache_root)
    cache.select(cache.entry_for_path(first))
    assert cache.default_version("stories260k") == first.name
    with pytest.raises(UsageError, match="not a published entry"):
        cache.select(EntryId("stories260k", "nonexistent"))
