"""DeepSeek V4 through the engine: greedy tokens equal transformers.generate for eight requests at once, in
small chunks, after preemptions, from the prefix cache, and through the decode graphs' static buffers (run
eagerly on a CPU), over tokens and window pages."""

from __future__ import annotations

import pytest
import torch
from deepseek_v4_checkpoints import write_tiny_v4_checkpoint

from flare.engine.config import EngineConfig
from flare.engine.sampling_params import SamplingParams
from flare.engine_client.llm_engine import LLMEngine

NEW_TOKENS = 40
PROMPT_LENGTHS = (3, 40, 9, 17, 1, 24, 31, 12)
GREEDY = SamplingParams(temperature=0, max_tokens=NEW_TOKENS, ignore_eos=True)
SETTINGS = {
    "roomy": dict(page_size=16, num_pages=64, max_model_len=128),
    "small chunks": dict(page_size=8, num_pages=256, max_model_len=128, prefill_chunk=5, max_num_batched_tokens=12),
    "few pages": dict(page_size=8, num_pages=24, max_model_len=128, prefill_chunk=16, max_num_batched_tokens=32),
}


def v4_config(directory, **settings) -> EngineConfig:
    """An engine configuration with the window pages the checkpoint's cache needs."""
    from flare.models.cache_spec import cache_spec
    from flare.models.loader import read_model_config

    base = EngineConfig(**settings)
    spec = cache_spec(read_model_config(directory), base.page_size, 4)
    window = spec.window_pool(base.max_num_batched_tokens)
    return EngineConfig(**settings, window_pages=window.pages(base.max_concurrency), window_retention=window.retention)


def prompts() -> list[list[int]]:
    generator = torch.Generator().manual_seed(0)
    return [[1] + torch.randint(3, 512, (length - 1,), generator=generator).tolist() for length in PROMPT_LENGTHS]


@pytest.fixture(scope="module")
def v4(tmp_path_factory):
    """(checkpoint directory, transformers' greedy tokens for each prompt)."""
    from transformers import AutoModelForCausalLM

    directory = write_tiny_v4_checkpoint(tmp_path_factory.mktemp("deepseek-v4"))
    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    expected = []
    for prompt in prompts():
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0)
        expected.append(out[0, len(prompt):].tolist())
    return directory, expected


@pytest.mark.parametrize("setting", SETTINGS)
def test_eight_concurrent_requests_match_transformers(v4, setting, checked):
    directory, expected = v4
    engine = checked(LLMEngine.from_checkpoint(directory, v4_config(directory, **SETTINGS[setting])))
    outputs = engine.generate(prompts(), GREEDY)
    assert [list(o.new_token_ids) for o in outputs] == expected
    config = engine.core.config
    assert config.window_pages > 0 and config.window_retention == 7      # an 8-token window and CSA's 2 x 4 - 1
    if setting == "few pages":
        assert engine.core.stats().num_preemptions > 0, "the setting must force preemptions"


def test_a_repeated_prompt_comes_from_the_prefix_cache_with_the_same_tokens(v4, checked):
    directory, expected = v4
    engine = checked(LLMEngine.from_checkpoint(directory, v4_config(directory, page_size=8, num_pages=64,
                                                                     max_model_len=128)))
    prompt = prompts()[1]                      # 40 tokens: 4 whole blocks can come from the cache
    [first] = engine.generate([prompt], GREEDY)
    [again] = engine.generate([prompt], GREEDY)
    assert list(first.new_token_ids) == list(again.new_token_ids) == expected[1]
    assert engine.core.stats().prefix_cache_hit_tokens == 32


def test_a_later_turn_matches_at_the_end_of_the_earlier_one(v4, checked):
    """The second turn repeats the first turn's prompt and answer: it matches where the first turn ended,
    whose window pages the finished request left cached."""
    directory, expected = v4
    engine = checked(LLMEngine.from_checkpoint(directory, v4_config(directory, page_size=8, num_pages=64,
                                                                     max_model_len=128)))
    prompt = prompts()[6]                      # 31 tokens, then 40 generated
    [first] = engine.generate([prompt], GREEDY)
    follow_up = prompt + list(first.new_token_ids) + [5, 6, 7]
    [second] = engine.generate([follow_up], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert engine.core.stats().prefix_cache_hit_tokens == 64       # 8 of the 9 blocks before the new tokens
    fresh = checked(LLMEngine.from_checkpoint(directory, v4_config(directory, page_size=8, num_pages=64,
                                                                    max_model_len=128)))
    [uncached] = fresh.generate([follow_up], SamplingParams(temperature=0, max_tokens=4, ignore_eos=True))
    assert list(second.new_token_ids) == list(uncached.new_token_ids)


def test_an_engine_configuration_without_window_pages_is_refused(v4):
    from flare.errors import UsageError

    directory, _ = v4
    with pytest.raises(UsageError, match="window pages"):
        LLMEngine.from_checkpoint(directory, EngineConfig(page_size=8, num_pages=64, max_model_len=128))


@pytest.mark.parametrize("count", [8, 3], ids=["full bucket", "padded bucket"])
def test_decode_steps_through_the_static_buffers_match_transformers(v4, count, checked):
    """Decode rows copied into the graphs' static buffers, their window page tables derived there from the
    slots, padded rows writing only the dummy window page: the same tokens as transformers."""
    from flare.engine.core import EngineCore
    from flare.engine.factory import load_checkpoint_model
    from flare.engine.runner import ModelRunner
    from flare.frontend.tokenizer import load_tokenizer

    directory, expected = v4
    config = v4_config(directory, page_size=8, num_pages=128, max_model_len=128)
    loaded = load_checkpoint_model(directory, config)
    runner = ModelRunner(loaded.model, loaded.model_config, config, seed=0, graphs=True, capture=False)
    engine = checked(LLMEngine(EngineCore(config, runner, ()), load_tokenizer(directory)))
    graphs = runner.graphs
    assert graphs is not None and graphs.window_page_tables is not None
    steps = []
    original = graphs.launch_forward

    def counted(rows):
        steps.append(rows.shape[1])
        return original(rows)

    graphs.launch_forward = counted
    outputs = engine.generate(prompts()[:count], GREEDY)
    assert [list(o.new_token_ids) for o in outputs] == expected[:count]
    assert steps.count(count) >= NEW_TOKENS - 2, "the decode steps must run through the static buffers"
