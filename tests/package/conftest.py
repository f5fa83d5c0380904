"""Fixtures for package tests: a private cache and a stand-in recipe for the stories260k checkpoint."""

from __future__ import annotations

import io
from pathlib import Path

import pytest

from flare.package.signing import config_dir_for, development_identity
from flare.package.trust import TrustOptions
from flare.prepare import CheckpointSource, ExportOptions, RecipeFacts, export_model
from flare.ui.progress import PhaseProgress

STORIES_RECIPE = RecipeFacts(name="llama", model_id="stories260k", alias="stories", served_names=("stories260k",),
                             page_size=16, prefill_chunk=256, default_concurrency=4, max_concurrency=16,
                             sampling_defaults={"temperature": 0.8, "top_p": 0.95},
                             sampling_ranges={"temperature": [0.0, 2.0]})


@pytest.fixture
def cache_root(tmp_path) -> Path:
    return tmp_path / "cache"


@pytest.fixture
def export(stories260k, cache_root):
    """Export stories260k into the test's cache; keyword arguments go to ExportOptions."""
    def run(stream=None, **options) -> Path:
        options.setdefault("cache_root", cache_root)
        return export_model(CheckpointSource(stories260k), STORIES_RECIPE, ExportOptions(**options),
                            PhaseProgress(stream=stream or io.StringIO(), styled=False))
    return run


@pytest.fixture
def dev_fingerprint() -> str:
    return development_identity(config_dir_for(None)).public_key.fingerprint


@pytest.fixture
def approved(dev_fingerprint) -> TrustOptions:
    """Unattended approval of the development key, as a serve script passes it."""
    return TrustOptions(approve_key=dev_fingerprint, accept_publisher="local-development", offline=True)
