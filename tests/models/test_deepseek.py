"""DeepSeek specifics beyond parity (tests/models/test_parity.py): what a token caches, the FP8 latent cache,
a block-FP8 checkpoint's MLA and experts, and configurations refused by name."""

from __future__ import annotations

import json

import pytest
import torch

from flare.engine.attention import allocate_kv_caches
from flare.engine.mla_attention import MlaReferenceBackend
from flare.models import ModelConfig, UnsupportedModel, load_checkpoint
from flare.recipes.base import kv_bytes_per_token
from fp8_checkpoints import write_block_fp8, write_dequantized
from models.paged_runner import PagedRunner
from tiny_checkpoints import write_tiny_checkpoint

TOKENS = [1, 403, 407, 261, 378, 9, 77, 301, 12, 5, 88, 240, 17, 99, 140, 33, 260, 71, 8, 402]


@pytest.fixture(scope="module")
def tiny_v3(tmp_path_factory):
    return write_tiny_checkpoint("deepseek_v3", tmp_path_factory.mktemp("v3"))


def load(directory, **precision):
    return load_checkpoint(directory, torch.float32, "cpu", MlaReferenceBackend(), **precision)


def logits(cfg, model, chunks=(9, 6, 1, 1, 1, 1, 1)):
    runner, start, rows = PagedRunner(cfg, model), 0, []
    for size in chunks:
        rows.append(runner.step({"s": TOKENS[start:start + size]})["s"])
        start += size
    return torch.cat(rows)


@pytest.mark.parametrize("kv_cache_dtype,row_bytes", [("auto", (32 + 16) * 4), ("fp8", 32 + 16 + 8)])
def test_a_cached_token_is_one_latent_row_per_layer_as_the_estimate_counts(tiny_v3, kv_cache_dtype, row_bytes):
    cfg, _ = load(tiny_v3, kv_cache_dtype=kv_cache_dtype)
    caches = allocate_kv_caches(cfg, num_pages=7, page_size=16, dtype=torch.float32, device="cpu")
    stored = sum(cache.numel() * cache.element_size() for cache in caches)
    assert stored == 7 * 16 * cfg.num_hidden_layers * row_bytes
    hf_config = json.loads((tiny_v3 / "config.json").read_text())
    assert kv_bytes_per_token(hf_config, 4, kv_cache_dtype=kv_cache_dtype) == cfg.num_hidden_layers * row_bytes
    assert kv_bytes_per_token(hf_config, 4, tensor_parallel=2, kv_cache_dtype=kv_cache_dtype) == \
        cfg.num_hidden_layers * row_bytes                  # every rank caches the whole latent


def test_the_v3_and_v2_lite_shapes_cache_576_values_a_layer():
    from flare.recipes import registry

    for alias, layers in (("deepseek-v2-lite-chat", 27), ("deepseek-v3", 61)):
        config = registry.find_alias(alias)[1].config
        assert ModelConfig.from_hf_config(dict(config)).mla.latent_dim == 576
        assert kv_bytes_per_token(config) == 576 * 2 * layers


def test_an_fp8_latent_cache_changes_the_logits_a_little(tiny_v3):
    """e4m3 keeps 3 mantissa bits of each latent; these random weights give sharp attention and routing that
    flips, so the logits move by ~7% (stories260k's trained dense cache: under 5%). A scale lost or misread
    moves them by order one."""
    exact = logits(*load(tiny_v3))
    approximate = logits(*load(tiny_v3, kv_cache_dtype="fp8"))
    assert not torch.equal(approximate, exact)
    assert (approximate.argmax(-1) == exact.argmax(-1)).float().mean() >= 0.75
    assert ((approximate - exact).norm() / exact.norm()) < 0.12


def test_a_block_fp8_checkpoint_computes_what_its_dequantized_weights_do(tiny_v3, tmp_path):
    """MLA's projections and the experts in e4m3 with float32 scales per 16x16 block, as DeepSeek-V3 ships
    them (128x128 there); kv_b_proj is multiplied back to the serving dtype as it loads."""
    fp8 = write_block_fp8(tiny_v3, tmp_path / "fp8", scale_dtype="float32", block=(16, 16))
    cfg, model = load(fp8)
    assert cfg.fp8 is not None and model.model.layers[1].self_attn.kv_b_proj.weight.dtype == torch.float32
    reference_cfg, reference = load(write_dequantized(fp8, tmp_path / "dequantized"))
    torch.testing.assert_close(logits(cfg, model), logits(reference_cfg, reference), rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("change,message", [
    ({"norm_topk_prob": True}, "norm_topk_prob"),
    ({"topk_method": "noaux_tc"}, "topk_method 'noaux_tc' is not supported"),
    ({"moe_layer_freq": 2}, "moe_layer_freq 2"),
    ({"n_group": 3}, "do not divide into n_group 3"),
])
def test_deepseek_v2_configurations_it_cannot_run_are_refused_by_name(tmp_path, change, message):
    config = json.loads((write_tiny_checkpoint("deepseek_v2", tmp_path) / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match=message):
        ModelConfig.from_hf_config({**config, **change})


def test_deepseek_v3_refuses_a_scoring_it_does_not_implement(tiny_v3):
    config = json.loads((tiny_v3 / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match="scoring_func 'softmax'"):
        ModelConfig.from_hf_config({**config, "scoring_func": "softmax"})
