"""Fixtures of the multi-host tests: homes standing for hosts."""

from __future__ import annotations

import pytest


@pytest.fixture
def hosts(tmp_path):
    """hosts(k): the home directory of host k (rank zero's is hosts(0))."""
    return lambda index: tmp_path / f"host-{index}"
