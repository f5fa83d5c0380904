"""Memory mode's per-request floor (issue 14's width rule): the specification's 8,192 tokens per active
request while the pool backs them, narrowing to fit down to 1,024 with one whole context still in the
pool, and the section-6 error only below that."""

from __future__ import annotations

import re
from dataclasses import replace

import pytest

from flare.errors import CapacityError
from flare.estimate import MemoryEstimate, check_estimate
from flare.estimate import size_kv_pool
from flare.memory import GiB, Budget, DeviceMemory, FixedCosts, KVGeometry, memory_budget
from flare.recipes.base import kv_bytes_per_token

PAGE = 16
PER_TOKEN = 128 * 1024                      # llama-8b: 32 layers x 8 KV heads x 128 x K,V x bf16
NOTHING_FIXED = FixedCosts(weights=0, graphs=0, live_state=0, prefix_cache_floor=0)


def pool_for(tokens: int, concurrency: int, context: int = 32768):
    """The memory-mode pool when exactly `tokens` of KV fit beside the fixed costs."""
    budget = Budget(free=tokens * PER_TOKEN, total=tokens * PER_TOKEN, headroom=0)
    return size_kv_pool(budget, NOTHING_FIXED, KVGeometry(PAGE, PER_TOKEN, context, concurrency))


def test_the_specification_floor_holds_while_the_pool_backs_it():
    pool = pool_for(40_000, concurrency=4)
    assert pool.floor.tokens == 8192 and not pool.floor.narrowed
    assert pool.floor.describe() == "8,192 tokens per active request (the specification's floor)"


def test_above_that_concurrency_the_floor_narrows_to_the_pools_share():
    pool = pool_for(1_000_000, concurrency=256)
    assert pool.tokens == 1_000_000
    assert pool.floor.tokens == 1_000_000 // PAGE // 256 * PAGE == 3904
    assert pool.floor.narrowed
    assert pool.floor.describe() == (
        "3,904 tokens per active request, narrowed from 8,192: 256 × 8,192 = 2,097,152 tokens exceed the "
        "pool's 1,000,000; a full pool makes admission wait and preempts by recomputation")


def test_the_narrowest_floor_is_1024_tokens_and_below_it_startup_fails_in_section_6_form():
    assert pool_for(256 * 1024, concurrency=256).floor.tokens == 1024
    with pytest.raises(CapacityError) as caught:
        pool_for(256 * 1024 - PAGE, concurrency=256)
    message = str(caught.value)
    assert "32.0 GiB minimum pages (256 × 1,024 tokens)" in message
    assert "Options: --max-concurrency 255; --kv-cache-limit concurrency." in message
    assert pool_for(256 * 1024 - PAGE, concurrency=255).floor.tokens == 1024     # the option fits on its own


def test_the_pool_must_still_hold_one_whole_prepared_context():
    # 32 requests of a 131,072-token context: 32 x 1,024 fits easily, one context does not
    pool = pool_for(9000 * PAGE, concurrency=32, context=131072)
    assert (pool.floor.tokens, pool.floor.narrowed) == (9000 // 32 * PAGE, True)
    with pytest.raises(CapacityError, match=re.escape("minimum pages (one 131,072-token context)")):
        pool_for(8000 * PAGE, concurrency=32, context=131072)
    # where 8,192 per request is less than one context, the specification's floor is the minimum
    assert pool_for(4 * 8192, concurrency=4, context=131072).floor.tokens == 8192


def test_capped_pools_have_no_memory_mode_floor():
    budget = Budget(free=64 * GiB, total=64 * GiB, headroom=0)
    pool = size_kv_pool(budget, NOTHING_FIXED, KVGeometry(PAGE, PER_TOKEN, 32768, 4), "context")
    assert pool.floor is None


QWEN3_8B = {"num_hidden_layers": 36, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
            "hidden_size": 4096, "max_position_embeddings": 40960}


def test_256_users_of_qwen3_8b_fit_one_h200_at_export():
    per_token = kv_bytes_per_token(QWEN3_8B, 2)
    estimate = MemoryEstimate(weights_bytes=int(15.3 * GiB), graphs_bytes=6 * GiB,
                              live_state_bytes_per_request=16 << 20, prefix_cache_bytes_per_request=0,
                              kv_bytes_per_token=per_token, max_concurrency=256, max_context=40960, page_size=16)
    h200 = memory_budget(DeviceMemory(index=0, name="H200", free=int(139.3 * GiB), total=int(139.8 * GiB)),
                         headroom=2 * GiB)
    assert 256 * 8192 * per_token > h200.available                    # the fixed floor refused it
    requirement = check_estimate(estimate, [h200])
    assert requirement.minimum_text == "256 × 1,024 tokens"
    assert round(requirement.minimum_pages / GiB) == 36


@pytest.mark.slow
def test_a_narrowed_floor_preempts_and_keeps_outputs_exact(tmp_path):
    """Four requests that outgrow a pool sized at the narrowest floor: admission waits, requests are
    preempted and recomputed, and every output equals a roomy engine's."""
    from tiny_checkpoints import write_tiny_checkpoint

    from flare.engine.config import engine_config_for_pool
    from flare.engine.sampling_params import SamplingParams
    from flare.engine_client.llm_engine import LLMEngine

    context, concurrency = 2048, 4
    checkpoint = write_tiny_checkpoint("llama", tmp_path / "tiny", max_position_embeddings=context)
    per_token = 2 * 2 * 16 * 2 * 4                  # 2 layers x 2 KV heads x 16 x K,V x float32
    budget = Budget(free=concurrency * 1024 * per_token, total=GiB, headroom=0)
    tight = size_kv_pool(budget, NOTHING_FIXED, KVGeometry(PAGE, per_token, context, concurrency))
    assert (tight.floor.tokens, tight.floor.narrowed) == (1024, True)
    roomy = size_kv_pool(replace(budget, free=concurrency * 8192 * per_token), NOTHING_FIXED,
                         KVGeometry(PAGE, per_token, context, concurrency))
    assert not roomy.floor.narrowed
    prompts = [[1, 5 + i, 9, 40 + 7 * i] * 3 for i in range(concurrency)]
    params = SamplingParams(temperature=0, max_tokens=1200, ignore_eos=True)     # 4 x 1,212 > 4,096 tokens
    outputs, preemptions = [], []
    for pool in (roomy, tight):
        config = engine_config_for_pool(pool, max_concurrency=concurrency, prepared_context=context,
                                        prefill_chunk=64)
        assert config.max_model_len == context                     # one whole context still fits
        engine = LLMEngine.from_checkpoint(checkpoint, config, seed=0)
        outputs.append([list(output.new_token_ids) for output in engine.generate(prompts, params)])
        preemptions.append(engine.core.stats().num_preemptions)
        engine.check_integrity()
    assert preemptions[0] == 0 < preemptions[1]
    assert outputs[1] == outputs[0]
    assert all(len(tokens) == 1200 for tokens in outputs[0])



def test_flare_runs_startup_report_says_which_floor_applied_and_why():
    from types import SimpleNamespace

    from flare.engine.config import engine_config_for_pool
    from flare.server.launch import startup_report

    model = SimpleNamespace(canonical_id="org/model", weight_bytes=16 * GiB, kv_cache_dtype="auto")
    settings = SimpleNamespace(served_names=("model",), api_key=None)
    for pool, expected in ((pool_for(40_000, concurrency=4), "  KV floor: 8,192 tokens per active request (the "
                                                             "specification's floor)"),
                           (pool_for(1_000_000, concurrency=256), "  KV floor: 3,904 tokens per active request, "
                                                                  "narrowed from 8,192: 256 × 8,192")):
        config = engine_config_for_pool(pool, max_concurrency=pool.floor.concurrency, prepared_context=32768,
                                        prefill_chunk=512)
        lines = startup_report(model, settings, pool, config, "http://127.0.0.1:8000", "cuda")
        assert [line for line in lines if line.startswith("  KV floor:")][0].startswith(expected)
