"""Every family: 64 greedy tokens equal transformers.generate, alone, eight at once, in small chunks
and after forced preemptions (tiny random float32 checkpoints)."""

from __future__ import annotations

import pytest
import torch
from tiny_checkpoints import FAMILIES, write_tiny_checkpoint

from flare.engine.config import EngineConfig
from flare.engine_client.llm_engine import LLMEngine
from flare.engine.sampling_params import SamplingParams

NEW_TOKENS = 64
PROMPT_LENGTHS = (3, 40, 9, 17, 1, 24, 31, 12)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)

SETTINGS = {
    "roomy": dict(page_size=16, num_pages=64, max_model_len=128),
    "small chunks": dict(page_size=4, num_pages=256, max_model_len=128, prefill_chunk=5, max_num_batched_tokens=12),
    "few pages": dict(page_size=4, num_pages=40, max_model_len=128, prefill_chunk=16, max_num_batched_tokens=32),
}


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 512, (length - 1,), generator=generator).tolist() for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module", params=FAMILIES)
def family(request, tmp_path_factory):
    """(checkpoint directory, transformers' greedy tokens for each prompt)."""
    from transformers import AutoModelForCausalLM

    directory = write_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.generation_config.eos_token_id = None             # 64 tokens whatever comes
    expected = []
    for prompt in prompts():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS,
                             do_sample=False, pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    return directory, expected


def test_a_single_request_matches_transformers(family, checked):
    directory, expected = family
    engine = checked(LLMEngine.from_checkpoint(directory, EngineConfig(**SETTINGS["roomy"])))
    [output] = engine.generate([prompts()[1]], GREEDY)
    assert list(output.new_token_ids) == expected[1]


@pytest.mark.parametrize("setting", SETTINGS)
def test_eight_concurrent_requests_match_transformers(family, setting, checked):
    directory, expected = family
    engine = checked(LLMEngine.from_checkpoint(directory, EngineConfig(**SETTINGS[setting])))
    outputs = engine.generate(prompts(), GREEDY)
    assert [list(o.new_token_ids) for o in outputs] == expected
    if setting == "few pages":
        assert engine.core.stats().num_preemptions > 0, "the setting must force preemptions"
