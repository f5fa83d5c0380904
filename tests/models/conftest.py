"""Model tests run tiny matrices, where several CPU threads cost more in synchronisation than they gain."""

from __future__ import annotations

import pytest


@pytest.fixture(autouse=True)
def single_cpu_thread():
    import torch

    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)
