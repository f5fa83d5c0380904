"""Online FP8 of a BF16 checkpoint is the block-FP8 layout, and the FP8 KV cache, on the stories260k model."""

from __future__ import annotations

import json

import torch

from flare.engine.attention import TorchReferenceBackend, allocate_kv_caches
from flare.models import load_checkpoint
from flare.models.fp8 import Fp8Linear
from flare.models.quantization import DECODER_PROJECTIONS
from flare.recipes.base import kv_bytes_per_token
from fp8_checkpoints import write_bf16, write_block_fp8
from models.paged_runner import PagedRunner

TOKENS = [1, 403, 407, 261, 378, 9, 77, 301, 12, 5, 88, 240, 17, 99, 140, 33, 260, 71, 8, 402]


def logits(cfg, model, chunks=(9, 6, 1, 1, 1, 1, 1)):
    runner, start, rows = PagedRunner(cfg, model), 0, []
    for size in chunks:
        rows.append(runner.step({"s": TOKENS[start:start + size]})["s"])
        start += size
    return torch.cat(rows)


def load(directory, **precision):
    return load_checkpoint(directory, torch.float32, "cpu", TorchReferenceBackend(), **precision)


def test_online_fp8_gives_what_a_block_fp8_checkpoint_of_the_same_weights_gives(stories260k, tmp_path):
    """Converting a BF16 checkpoint while loading and the test helper's own 128x128 quantizer (float32
    scales) agree."""
    bf16 = write_bf16(stories260k, tmp_path / "bf16")
    cfg, online = load(bf16, online_fp8=DECODER_PROJECTIONS)
    assert cfg.fp8.method == "online"
    assert sum(isinstance(module, Fp8Linear) for module in online.modules()) == 4 * cfg.num_hidden_layers
    checkpoint_cfg, stored = load(write_block_fp8(bf16, tmp_path / "fp8", scale_dtype="float32"))
    torch.testing.assert_close(logits(cfg, online), logits(checkpoint_cfg, stored), rtol=1e-5, atol=1e-5)


def test_online_fp8_of_some_projections_leaves_the_others_dense(stories260k):
    _, model = load(stories260k, online_fp8=("gate_proj", "up_proj", "down_proj"))
    layer = model.model.layers[0]
    assert isinstance(layer.mlp.gate_up_proj, Fp8Linear) and isinstance(layer.mlp.down_proj, Fp8Linear)
    assert not isinstance(layer.self_attn.qkv_proj, Fp8Linear)


def test_the_fp8_kv_cache_is_what_the_estimate_counts(stories260k):
    cfg, _ = load(stories260k, kv_cache_dtype="fp8")
    caches = allocate_kv_caches(cfg, num_pages=7, page_size=16, dtype=torch.float32, device="cpu")
    per_token = kv_bytes_per_token(json.loads((stories260k / "config.json").read_text()), kv_cache_dtype="fp8")
    assert caches[0].dtype == torch.uint8
    assert sum(cache.numel() for cache in caches) == 7 * 16 * per_token
    dense, _ = load(stories260k)
    float32_bytes = sum(c.numel() * c.element_size() for c in allocate_kv_caches(dense, 7, 16, torch.float32, "cpu"))
    assert float32_bytes == 7 * 16 * kv_bytes_per_token(json.loads((stories260k / "config.json").read_text()), 4)


def test_an_fp8_kv_cache_changes_the_logits_a_little(stories260k):
    cfg, model = load(stories260k)
    exact = logits(cfg, model)
    fp8_cfg, fp8_model = load(stories260k, kv_cache_dtype="fp8")
    approximate = logits(fp8_cfg, fp8_model)
    assert not torch.equal(approximate, exact)
    assert (approximate.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.9
    assert ((approximate - exact).norm() / exact.norm()) < 0.05
