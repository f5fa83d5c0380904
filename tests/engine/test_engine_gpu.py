"""The same engine on a CUDA device: stories260k greedy text and seeded, batch-invariant sampling."""

from __future__ import annotations

import json

import pytest
import torch

from flare.engine.config import EngineConfig
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import SamplingParams

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

CONFIG = EngineConfig(page_size=16, num_pages=64, max_model_len=512, prefill_chunk=8, max_num_batched_tokens=32)


def test_greedy_and_seeded_sampling_on_the_gpu(stories260k, checked):
    reference = json.loads((stories260k / "reference" / "greedy.json").read_text())
    engine = checked(LLMEngine.from_checkpoint(stories260k, CONFIG, device="cuda", seed=0))
    [greedy] = engine.generate(["Once upon a time"], SamplingParams(temperature=0, max_tokens=60))
    assert list(greedy.new_token_ids) == reference["greedy_ids"]

    seeded = SamplingParams(temperature=1.0, max_tokens=40, seed=3)
    [alone] = engine.generate(["Once upon a time"], seeded)
    crowd = engine.generate(["Tom had", "Once upon a time", "The sun"],
                            [SamplingParams(max_tokens=50), seeded, SamplingParams(max_tokens=8, seed=1)])
    assert crowd[1].new_token_ids == alone.new_token_ids
