"""Phases print their result and elapsed time: plain lines when redirected, an activity bar on a terminal."""

import io

import pytest

from flare.ui.progress import PhaseProgress


@pytest.mark.parametrize("styled", [False, True])
def test_phase_results_and_detail_lines(styled):
    stream = io.StringIO()
    progress = PhaseProgress(stream=stream, verbose=True, styled=styled)
    with progress.phase("Load weights") as phase:
        phase.note("read layer 0")
        phase.done("5 layers")
    with progress.phase("Capture graphs") as phase:
        phase.skip("CUDA graphs need a GPU")
    with pytest.raises(RuntimeError):
        with progress.phase("Export package"):
            raise RuntimeError("disk full")
    text = stream.getvalue()
    assert "Load weights. [ OK ] 5 layers (" in text and "    read layer 0" in text
    assert "Capture graphs. [SKIP] CUDA graphs need a GPU (" in text
    assert "Export package. [FAILED]" in text
    assert ("\x1b[" in text) == styled
    assert [r["status"] for r in progress.summary()] == ["ok", "skipped", "failed"]
