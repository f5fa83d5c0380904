"""The deepseek-v4-flash recipe: its published checkpoint's bytes, its cache per token at 1M tokens against
full-attention MLA, its help, and the section-6 refusal where the selected GPUs cannot hold it."""

from __future__ import annotations

import pytest

from flare.errors import CapacityError, UsageError
from flare.estimate import check_estimate
from flare.memory import GiB, DeviceMemory, memory_budget
from flare.models import ModelConfig
from flare.models.cache_spec import cache_spec, mla_bytes_per_token
from flare.package.manifest import Plan
from flare.prepare import plan_estimate
from flare.recipes import deepseek_v4, registry

MILLION = 1 << 20


def flash():
    return registry.find_alias("deepseek-v4-flash")


def test_the_checkpoint_bytes_are_the_published_files():
    _, checkpoint = flash()
    # A public listing of deepseek-ai/DeepSeek-V4-Flash's 46 files: 148.65 GiB of tensors.
    assert checkpoint.stored_bytes == 159_609_485_896
    assert round(checkpoint.stored_bytes / GiB, 2) == 148.65


def test_bytes_per_cached_token_at_a_million_tokens_against_full_attention_mla():
    """V4-Flash's cache: 21 CSA layers keep a 512-wide entry and a 128-wide indexer key per 4 tokens, 20 HCA
    layers a 512-wide entry per 128 tokens, in bfloat16: 6,880 bytes a token. Full-attention MLA (a 512 latent
    and a 64-wide rotary key per layer and token) at the same 43 layers: 49,536 bytes, 7.2 times as many.
    One 1,048,576-token sequence holds 6.7 GiB of compressed pages and two window pages (sliding keys and
    compressor inputs of its last 127 tokens, 23.5 MiB each) against 48.4 GiB."""
    _, checkpoint = flash()
    cfg = ModelConfig.from_hf_config(dict(checkpoint.config))
    spec = cache_spec(cfg, deepseek_v4.PAGE_SIZE, 2)
    assert spec.bytes_per_token == 21 * (512 + 128) * 2 / 4 + 20 * 512 * 2 / 128 == 6880
    assert mla_bytes_per_token(cfg, 2) == 43 * (512 + 64) * 2 == 49_536
    window_page = 128 * (43 * 512 + 21 * (4 * 512 + 4 * 128) + 20 * 2 * 512) * 2
    assert spec.window_page_bytes == window_page
    assert spec.sequence_bytes(MILLION) == MILLION * 6880 + 2 * window_page
    assert round(spec.sequence_bytes(MILLION) / GiB, 2) == 6.76
    assert mla_bytes_per_token(cfg, 2) * MILLION / spec.sequence_bytes(MILLION) > 7.1


def test_help_shows_the_tensor_parallel_sizes_and_memory():
    from flare.cli.recipe_help import describe

    text = describe(*flash())
    assert "tensor parallel    1, 2, 4, 8" in text
    assert "6,880 bytes per cached token" in text and "49,536 bytes" in text
    assert "TP4 37.2 GiB" in text and "window pages" in text


def test_the_unconfirmed_v41_alias_says_why_it_is_not_served():
    assert registry.find_alias("deepseek-v4.1-flash") is None
    error = registry.unknown_alias_error("deepseek-v4.1-flash")
    assert isinstance(error, UsageError)
    assert "could not be confirmed" in str(error) and "DeepseekV41ForCausalLM" in str(error)


def plan(concurrency: int = 32, tensor_parallel: int = 1) -> Plan:
    recipe, checkpoint = flash()
    return Plan(dtype="bfloat16", page_size=recipe.page_size, prefill_chunk=recipe.prefill_chunk, compile=True,
                max_concurrency=concurrency, decode_capacities=recipe.decode_capacities_for(concurrency),
                max_model_len=checkpoint.context_length, memory_reserve_bytes=0, tensor_parallel=tensor_parallel)


def h200(index: int):
    return memory_budget(DeviceMemory(index=index, name="NVIDIA H200", free=int(139.8 * GiB), total=int(139.8 * GiB)),
                         headroom=2 * GiB)


def test_one_h200_is_refused_in_the_section_6_form_with_the_size_that_fits():
    recipe, checkpoint = flash()
    estimate = plan_estimate(dict(checkpoint.config), plan(), checkpoint.stored_bytes)
    budgets = [h200(index) for index in range(8)]
    with pytest.raises(CapacityError) as refused:
        check_estimate(estimate, budgets[:1], all_budgets=budgets,
                       tensor_parallel_sizes=recipe.tensor_parallel_sizes_for(checkpoint.config))
    message = str(refused.value)
    assert message.startswith("needs 148.6 GiB weights") and "window pages" in message
    assert "--gpus 0-1" in message
    from dataclasses import replace

    fits = check_estimate(replace(estimate, tensor_parallel=4), budgets[:4])
    # every rank holds the whole cache: a 1M-token context's minimum pages are not divided by four
    assert fits.minimum_pages == estimate.requirement().minimum_pages
