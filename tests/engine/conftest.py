"""Engine test fixtures."""

from __future__ import annotations

import pytest
from fake_runner import FakeRunner

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread():
    """The models here are tiny: one thread is fastest, and spinning thread pools on a busy two-core
    machine cost ten times the CPU. OMP_NUM_THREADS reaches the engine-core processes tests spawn."""
    import torch

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        yield
    torch.set_num_threads(threads)


@pytest.fixture
def make_fake_core():
    """Build EngineCores over a FakeRunner; after the test each one's page integrity check must pass."""
    cores: list[EngineCore] = []

    def make(**settings) -> EngineCore:
        config = EngineConfig(**settings)
        core = EngineCore(config, FakeRunner(config.page_size), eos_token_ids=())
        cores.append(core)
        return core

    yield make
    for core in cores:
        core.check_integrity()


@pytest.fixture
def checked():
    """Register engines (LLMEngine or EngineCore); after the test every page must be back and the books clean."""
    engines = []

    def register(engine):
        engines.append(engine)
        return engine

    yield register
    for engine in engines:
        engine.check_integrity()
        core = getattr(engine, "core", engine)
        if not core.has_unfinished():
            assert core.allocator.num_used_pages == 0, "a finished engine still holds pages"
