"""The serving KV pool counts the bytes of the KV cache dtype the package was prepared with: on the same
free GPU memory an FP8 cache (e4m3 plus a float32 scale per token and KV head) holds about twice the
tokens of a bfloat16 one, and the pool's bytes are its tokens times the FP8 bytes per token."""

from __future__ import annotations

from flare import memory
from flare.recipes import registry
from flare.recipes.base import kv_bytes_per_token
from flare.server import kv_sizing
from flare.server.kv_sizing import serving_kv_pool
from flare.server.served_model import ServedModel

GiB = 1024 ** 3


def llama_8b(kv_cache_dtype: str) -> ServedModel:
    _, checkpoint = registry.find_alias("llama-3.1-8b-instruct")
    return ServedModel(canonical_id="Llama-3.1-8B-Instruct", served_names=("llama",), hf_config=checkpoint.config,
                       frontend_dir=None, dtype="bfloat16", page_size=16, prefill_chunk=2048, prepared_concurrency=64,
                       max_model_len=131072, weight_bytes=9 * GiB, iter_weights=lambda: iter(()),
                       kv_cache_dtype=kv_cache_dtype)


def test_an_fp8_kv_cache_holds_about_twice_the_tokens_in_the_same_memory(monkeypatch):
    gpu = [memory.DeviceMemory(0, "test GPU", free=80 * GiB, total=141 * GiB)]
    monkeypatch.setattr(kv_sizing, "read_device_memory", lambda: gpu)
    dense = serving_kv_pool(llama_8b("auto"), 64, "memory", None, 0)
    fp8 = serving_kv_pool(llama_8b("fp8"), 64, "memory", None, 0)
    config = llama_8b("fp8").hf_config
    assert dense.bytes == dense.tokens * kv_bytes_per_token(config, 2)
    assert fp8.bytes == fp8.tokens * kv_bytes_per_token(config, 2, kv_cache_dtype="fp8")
    assert kv_bytes_per_token(config, 2, kv_cache_dtype="fp8") == 2 * 32 * 8 * (128 + 4)   # K and V, 32 layers
    assert 1.9 < fp8.tokens / dense.tokens < 2.0            # 2 x 128 bytes per head against 128 + 4


def test_the_prompt_graphs_capture_export_measured_comes_out_of_the_kv_pool(monkeypatch):
    """Serving captures the prompt graphs after allocating the pages: what export measured their capture to
    take is set aside first (an H200 run ran out of memory capturing them into a pool sized without it)."""
    from dataclasses import replace

    gpu = [memory.DeviceMemory(0, "test GPU", free=80 * GiB, total=141 * GiB)]
    monkeypatch.setattr(kv_sizing, "read_device_memory", lambda: gpu)
    eager = llama_8b("auto")
    graphed = replace(eager, prompt_graph_sizes=(16, 256, 512), prompt_graph_bytes=3 * GiB)
    unused = replace(eager, prompt_graph_bytes=3 * GiB)           # no buckets: nothing is captured
    pools = [serving_kv_pool(model, 64, "memory", None, 0) for model in (eager, graphed, unused)]
    assert pools[0].bytes - pools[1].bytes >= 3 * GiB - pools[0].bytes // pools[0].tokens * 16
    assert pools[2].tokens == pools[0].tokens


def test_an_online_fp8_package_sets_aside_the_dequantize_buffer(monkeypatch):
    """Prompt steps of an online FP8 package dequantize into one bf16 buffer of the largest layer (fused
    gate/up); the pool is sized without those bytes."""
    from dataclasses import replace

    gpu = [memory.DeviceMemory(0, "test GPU", free=80 * GiB, total=141 * GiB)]
    monkeypatch.setattr(kv_sizing, "read_device_memory", lambda: gpu)
    dense = llama_8b("auto")
    online = replace(dense, online_fp8=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    pools = [serving_kv_pool(model, 64, "memory", None, 0) for model in (dense, online)]
    gate_up = 2 * 14336 * 4096 * 2
    assert gate_up - pools[0].bytes // pools[0].tokens * 16 <= pools[0].bytes - pools[1].bytes <= gate_up
