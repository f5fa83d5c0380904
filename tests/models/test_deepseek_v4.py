"""DeepSeek V4 gives transformers' logits through Flare's paged cache: whole prompts, chunked prefill
then decode, batched sequences, with window pages given back (and overwritten) behind each window."""

from __future__ import annotations

import pytest
import torch

from deepseek_v4_checkpoints import TINY_V4, write_tiny_v4_checkpoint
from flare.engine.attention import TorchReferenceBackend
from flare.models import ModelConfig, UnsupportedModel, load_checkpoint
from flare.models.deepseek_v4_config import CSA, HCA, SLIDING
from models.v4_paged_runner import WindowPagedRunner

TOKENS = torch.randint(3, 512, (60,), generator=torch.Generator().manual_seed(7)).tolist()
PROMPT_CHUNKS = [7, 5, 11, 17]          # 40 prompt tokens, then 20 decoded one at a time


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_v4_checkpoint(tmp_path_factory.mktemp("deepseek-v4"))


@pytest.fixture(scope="module")
def pair(checkpoint):
    from transformers import AutoModelForCausalLM

    cfg, ours = load_checkpoint(checkpoint, torch.float32, "cpu", TorchReferenceBackend())
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    return cfg, ours, theirs.eval()


def transformers_logits(model, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    from transformers import DynamicCache

    cache, start, rows = DynamicCache(config=model.config), 0, []
    with torch.no_grad():
        for size in chunks:
            rows.append(model(input_ids=torch.tensor([tokens[start:start + size]]), cache=cache,
                              use_cache=True).logits[0])
            start += size
    return torch.cat(rows)


def assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())
    assert torch.equal(ours.argmax(-1), theirs.argmax(-1))


def test_config_reads_as_transformers_reads_it(checkpoint):
    from transformers import AutoConfig

    import json

    theirs = AutoConfig.from_pretrained(checkpoint)
    cfg = ModelConfig.from_hf_config(json.loads((checkpoint / "config.json").read_text()))
    layout = cfg.v4
    assert layout.layer_types == tuple(theirs.layer_types) == (SLIDING, CSA, HCA, CSA)
    assert layout.mlp_layer_types == tuple(theirs.mlp_layer_types)
    assert (layout.rate(CSA), layout.rate(HCA)) == (4, 8)
    assert layout.rope_dim == theirs.qk_rope_head_dim == 8
    assert layout.compress_rope.kind == "yarn" and layout.compress_rope.attention_factor == 1.0
    assert layout.compress_rope.theta == theirs.rope_parameters["compress"]["rope_theta"]
    assert layout.main_rope.kind == "default" and layout.main_rope.theta == theirs.rope_parameters["main"]["rope_theta"]
    assert (cfg.num_key_value_heads, cfg.intermediate_size) == (1, TINY_V4["moe_intermediate_size"])


def test_older_config_keys_read_as_transformers_folds_them():
    """DeepSeek's published config.json: per-layer compress_ratios, num_hash_layers, qk_rope_head_dim and a
    flat rope_scaling, which transformers folds into its own fields."""
    from transformers import DeepseekV4Config

    published = {"architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4", "hidden_size": 64,
                 "num_hidden_layers": 5, "num_attention_heads": 4, "head_dim": 32, "vocab_size": 512,
                 "max_position_embeddings": 1024, "compress_ratios": [0, 0, 4, 128, 4, 0], "num_hash_layers": 2,
                 "qk_rope_head_dim": 8, "rope_theta": 10000, "compress_rope_theta": 160000,
                 "rope_scaling": {"type": "yarn", "factor": 16, "beta_fast": 32, "beta_slow": 1,
                                  "original_max_position_embeddings": 64}}
    theirs = DeepseekV4Config.from_dict(published)
    layout = ModelConfig.from_hf_config(published).v4
    assert layout.layer_types == tuple(theirs.layer_types)
    assert layout.mlp_layer_types == tuple(theirs.mlp_layer_types)
    compress = theirs.rope_parameters["compress"]
    assert (layout.compress_rope.factor, layout.compress_rope.original_max_positions) == \
        (compress["factor"], compress["original_max_position_embeddings"])
    assert layout.rope_dim == 8


def test_what_v4_cannot_run_is_refused_by_name(checkpoint):
    import json

    config = json.loads((checkpoint / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match="scoring_func 'softmax'"):
        ModelConfig.from_hf_config({**config, "scoring_func": "softmax"})
    with pytest.raises(UnsupportedModel, match="n_shared_experts 2"):
        ModelConfig.from_hf_config({**config, "n_shared_experts": 2})
    with pytest.raises(UnsupportedModel, match="layer_types"):
        ModelConfig.from_hf_config({**config, "layer_types": ["full_attention"] * 4})


def test_whole_prompt_logits_match_transformers(pair):
    cfg, ours, theirs = pair
    logits = WindowPagedRunner(cfg, ours).step({"a": TOKENS})["a"]
    assert_logits_match(logits, transformers_logits(theirs, TOKENS, [len(TOKENS)]))


def test_chunked_prefill_then_decode_matches_transformers_with_window_pages_given_back(pair):
    cfg, ours, theirs = pair
    chunks = PROMPT_CHUNKS + [1] * (len(TOKENS) - sum(PROMPT_CHUNKS))
    runner, start, rows = WindowPagedRunner(cfg, ours, num_window_pages=12), 0, []
    for size in chunks:
        rows.append(runner.step({"a": TOKENS[start:start + size]})["a"])
        start += size
    # 60 tokens are 8 blocks; the runner held at most three window blocks at a time and overwrote the rest
    assert sum(page is not None for page in runner.window["a"]) <= 3
    assert_logits_match(torch.cat(rows), transformers_logits(theirs, TOKENS, [len(TOKENS)]))


def test_sequences_batched_together_give_the_same_logits_as_alone(pair):
    cfg, ours, _ = pair
    other = TOKENS[::-1][:37]
    alone = WindowPagedRunner(cfg, ours).step({"b": other})["b"]
    runner = WindowPagedRunner(cfg, ours, seed=3)
    runner.step({"a": TOKENS[:21]})
    batched = runner.step({"a": TOKENS[21:22], "b": other})
    torch.testing.assert_close(batched["b"], alone, rtol=1e-4, atol=1e-4)


def test_the_indexer_choice_and_the_compressed_entries_shape_the_logits(pair, monkeypatch):
    """The tiny config keeps 3 of up to 15 entries: letting every query see all of them changes the logits,
    so the parity above covers the indexer's choice."""
    cfg, ours, theirs = pair
    expected = transformers_logits(theirs, TOKENS, [len(TOKENS)])
    chosen = ours.ops.indexer_topk

    def every_entry(query, weights, keys, tables, seq, visible, scale, topk):
        return chosen(query, weights, keys, tables, seq, visible, scale, 10_000)

    monkeypatch.setattr(ours.ops, "indexer_topk", every_entry)
    changed = WindowPagedRunner(cfg, ours).step({"a": TOKENS})["a"]
    assert (changed - expected).abs().max() > 1e-2
