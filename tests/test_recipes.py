"""Recipes: declarations are consistent, sizes follow from the checkpoints' shapes, look-ups behave."""

from __future__ import annotations

import json
import re
import struct
import subprocess
import sys

import pytest

from flare.engine.config import serving_scratch_bytes
from flare.errors import UsageError
from flare.recipes import registry
from flare.recipes.base import (decode_weight_bytes, graph_and_scratch_bytes, kv_bytes_per_token, kv_replicated,
                                live_state_bytes_per_request, parameter_count, weight_bytes)

HUB_CHECKPOINTS = [(recipe, checkpoint) for recipe, checkpoint in registry.all_checkpoints()
                   if checkpoint.source == "hub"]
HEAVY_MODULES = ("torch", "transformers", "huggingface_hub", "safetensors", "triton", "tokenizers", "numpy")


def _ids(pairs):
    return [checkpoint.alias for _, checkpoint in pairs]


@pytest.mark.parametrize("alias", ["qwen3-0.6b", "qwen3-8b", "llama-3.1-8b-instruct", "qwen2.5-7b-instruct",
                                   "mistral-7b-instruct-v0.3", "qwen3-8b-fp8"])
def test_the_main_real_checkpoints_are_declared_and_pinned(alias):
    recipe, checkpoint = registry.find_alias(alias)
    assert checkpoint.source == "hub"
    assert re.fullmatch(r"[0-9a-f]{40}", checkpoint.revision)
    assert checkpoint.architecture in recipe.architectures


@pytest.mark.parametrize("recipe,checkpoint", HUB_CHECKPOINTS, ids=_ids(HUB_CHECKPOINTS))
def test_hub_checkpoints_declare_repository_revision_and_sizes(recipe, checkpoint):
    assert re.fullmatch(r"[\w.-]+/[\w.-]+", checkpoint.repo_id)
    assert checkpoint.revision is None or re.fullmatch(r"[0-9a-f]{40}", checkpoint.revision)
    assert checkpoint.config["model_type"]
    assert checkpoint.context_length and checkpoint.context_length > 0
    assert recipe.tensor_parallel_sizes_for(checkpoint.config), "at least one tensor-parallel size must fit"


@pytest.mark.parametrize("recipe,checkpoint", HUB_CHECKPOINTS, ids=_ids(HUB_CHECKPOINTS))
def test_declared_stored_bytes_follow_from_the_config_shapes(recipe, checkpoint):
    """Each declared size is bfloat16 data for the declared shapes (FP8 projections one byte per weight with
    bfloat16 scales), with or without a stored output projection; only an unpinned checkpoint, or one whose
    recipe says why (`stored_bytes_note`), may leave its size undeclared."""
    candidates = {weight_bytes(checkpoint.config, stored, scale_bytes=2) for stored in (False, True)}
    undeclared = checkpoint.revision is None or checkpoint.stored_bytes_note
    assert checkpoint.stored_bytes in candidates or (checkpoint.stored_bytes is None and undeclared)
    assert checkpoint.decode_weight_bytes == decode_weight_bytes(checkpoint.config)
    assert checkpoint.decode_weight_bytes <= (checkpoint.stored_bytes or float("inf"))


@pytest.mark.parametrize("fp8, dense", [("qwen3-8b-fp8", "qwen3-8b"),
                                        ("llama-3.1-8b-instruct-fp8", "llama-3.1-8b-instruct")])
def test_fp8_checkpoints_read_about_half_the_bytes_of_their_bf16_originals(fp8, dense):
    """The decoder's projections are e4m3 (one byte) plus scales; embeddings, LM head and norms stay bfloat16."""
    quantized, original = registry.find_alias(fp8)[1], registry.find_alias(dense)[1]
    dense_projections = original.decode_weight_bytes - 2 * original.config["vocab_size"] * original.config["hidden_size"]
    saved = original.decode_weight_bytes - quantized.decode_weight_bytes
    assert 0.49 * dense_projections < saved <= 0.5 * dense_projections


def test_online_fp8_of_the_bf16_checkpoint_reads_what_the_block_fp8_checkpoint_reads():
    online = decode_weight_bytes(registry.find_alias("qwen3-8b")[1].config,
                                 online_fp8=("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
    assert online == registry.find_alias("qwen3-8b-fp8")[1].decode_weight_bytes


def test_an_fp8_kv_cache_holds_a_byte_per_element_and_a_float32_scale_per_head(stories260k):
    config = json.loads((stories260k / "config.json").read_text())
    per_head = config["head_dim"] + 4
    expected = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * per_head
    assert kv_bytes_per_token(config, kv_cache_dtype="fp8") == expected
    assert kv_bytes_per_token(config, kv_cache_dtype="fp8", tensor_parallel=2) == expected // 2


def _safetensors_header(path):
    with open(path, "rb") as file:
        length = struct.unpack("<Q", file.read(8))[0]
        header = json.loads(file.read(length))
    header.pop("__metadata__", None)
    return header


def test_parameter_count_matches_a_real_checkpoint_file(stories260k):
    config = json.loads((stories260k / "config.json").read_text())
    header = _safetensors_header(stories260k / "model.safetensors")
    stored = 0
    for tensor in header.values():
        elements = 1
        for dim in tensor["shape"]:
            elements *= dim
        stored += elements
    assert parameter_count(config, lm_head_stored="lm_head.weight" in header) == stored


def test_kv_bytes_per_token_is_two_times_layers_kv_heads_head_dim_dtype(stories260k):
    config = json.loads((stories260k / "config.json").read_text())
    expected = 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * config["head_dim"] * 4
    assert kv_bytes_per_token(config, dtype_bytes=4) == expected
    assert kv_bytes_per_token(config, dtype_bytes=4, tensor_parallel=2) == expected // 2


def test_head_dim_defaults_to_hidden_over_heads_when_config_omits_it():
    _, checkpoint = registry.find_alias("qwen2.5-7b-instruct")
    config = dict(checkpoint.config)
    assert "head_dim" not in config
    per_token = kv_bytes_per_token(config)
    assert per_token == 2 * config["num_hidden_layers"] * config["num_key_value_heads"] * \
        (config["hidden_size"] // config["num_attention_heads"]) * 2


def test_memory_model_grows_with_concurrency_and_chunk():
    _, checkpoint = registry.find_alias("qwen3-8b")
    config = checkpoint.config
    assert live_state_bytes_per_request(config, page_size=16) > config["vocab_size"] * 4
    small = graph_and_scratch_bytes(config, max_concurrency=1, prefill_chunk=2048)
    assert graph_and_scratch_bytes(config, max_concurrency=64, prefill_chunk=2048) > small
    assert graph_and_scratch_bytes(config, max_concurrency=1, prefill_chunk=4096) > small


@pytest.mark.parametrize("fp8, dense", [("qwen3-8b-fp8", "qwen3-8b"),
                                        ("llama-3.1-8b-instruct-fp8", "llama-3.1-8b-instruct")])
def test_the_fp8_estimate_counts_the_dequantize_buffer(fp8, dense):
    """Prompt steps dequantize each FP8 weight into one shared bf16 buffer, the largest layer's size
    (fused gate/up, 235 MB for llama-8b); an FP8 package must set it aside, a dense one need not."""
    quantized, original = registry.find_alias(fp8)[1].config, registry.find_alias(dense)[1].config
    gate_up = 2 * original["intermediate_size"] * original["hidden_size"] * 2
    assert (graph_and_scratch_bytes(quantized, 64, 2048) - graph_and_scratch_bytes(original, 64, 2048)) == gate_up
    online = graph_and_scratch_bytes(original, 64, 2048, online_fp8=("q_proj", "k_proj", "v_proj", "o_proj",
                                                                    "gate_proj", "up_proj", "down_proj"))
    assert online - graph_and_scratch_bytes(original, 64, 2048) == gate_up
    assert serving_scratch_bytes(original, 64, 2048, ("gate_proj", "up_proj")) - serving_scratch_bytes(
        original, 64, 2048) == gate_up
    attention_only = graph_and_scratch_bytes(original, 64, 2048, online_fp8=("q_proj", "k_proj", "v_proj"))
    q_width = original["num_attention_heads"] * (original.get("head_dim") or 128)
    kv_width = original["num_key_value_heads"] * (original.get("head_dim") or 128)
    assert attention_only - graph_and_scratch_bytes(original, 64, 2048) == \
        (q_width + 2 * kv_width) * original["hidden_size"] * 2


def test_recipe_cost_model_uses_its_own_page_size_and_chunk():
    recipe, checkpoint = registry.find_alias("llama-3.1-8b-instruct")
    config = checkpoint.config
    assert recipe.kv_bytes_per_token(config, tensor_parallel=2) == kv_bytes_per_token(config, tensor_parallel=2)
    assert recipe.live_state_bytes_per_request(config) == live_state_bytes_per_request(config, recipe.page_size)
    assert recipe.graph_and_scratch_bytes(config, 32) == graph_and_scratch_bytes(config, 32, recipe.prefill_chunk)
    assert recipe.snapshot_bytes(config) == 0          # snapshots borrow KV pages


def smallest_page(checkpoint) -> int:
    """The smallest page holding whole rows of every cache component (DeepSeek V4: its largest compression
    rate); 1 for a checkpoint whose config is not declared."""
    from flare.models import ModelConfig
    from flare.models.cache_spec import smallest_page_size

    if not checkpoint.config:
        return 1
    return smallest_page_size(ModelConfig.from_hf_config({"architectures": [checkpoint.architecture],
                                                          **checkpoint.config}))


@pytest.mark.parametrize("recipe", registry.all_recipes(), ids=lambda recipe: recipe.family)
def test_recipe_limits_are_consistent(recipe):
    concurrency = recipe.concurrency
    assert 1 == concurrency.minimum <= concurrency.default <= concurrency.maximum
    assert recipe.page_size == max([16] + [smallest_page(checkpoint) for checkpoint in recipe.checkpoints])
    assert recipe.prefill_chunk % 64 == 0
    assert list(recipe.decode_capacities) == sorted(set(recipe.decode_capacities))
    assert recipe.decode_capacities[0] == 1
    assert recipe.decode_capacities[-1] >= concurrency.maximum, "the largest batch needs a captured graph"
    assert 1 in recipe.tensor_parallel_sizes


@pytest.mark.parametrize("recipe,checkpoint", registry.all_checkpoints(), ids=_ids(registry.all_checkpoints()))
def test_every_checkpoint_declares_its_speculation(recipe, checkpoint):
    """Every dense family can verify drafts copied from decoded history; the counts are within limits."""
    speculation = recipe.speculation_for(checkpoint)
    assert speculation.available and speculation.history
    assert 1 <= speculation.default_draft_tokens <= speculation.max_draft_tokens <= 15
    assert speculation.token_capacity >= 2 * (speculation.max_draft_tokens + 1)
    assert speculation.note


@pytest.mark.parametrize("recipe,checkpoint", registry.all_checkpoints(),
                         ids=_ids(registry.all_checkpoints()))
def test_sampling_defaults_lie_within_their_ranges(recipe, checkpoint):
    sampling = recipe.sampling_for(checkpoint)
    for name, value in sampling.defaults().items():
        if name in sampling.ranges:
            low, high = sampling.ranges[name]
            assert low <= value <= high, name
    assert sampling.source


def test_a_checkpoint_with_its_own_card_gets_its_own_sampling():
    recipe, small = registry.find_alias("qwen2.5-0.5b-instruct")
    _, large = registry.find_alias("qwen2.5-7b-instruct")
    assert recipe.sampling_for(small) is not recipe.sampling_for(large)
    assert recipe.sampling_for(large) is recipe.sampling


def test_decode_capacities_round_concurrency_up_to_a_captured_batch():
    recipe, _ = registry.find_alias("qwen3-8b")
    assert recipe.decode_capacities_for(1) == (1,)
    assert recipe.decode_capacities_for(3)[-1] == 4          # concurrency three needs the batch-four bucket
    assert recipe.decode_capacities_for(32)[-1] == 32
    assert recipe.decode_capacities_for(33)[-1] > 32
    assert recipe.decode_capacities_for(recipe.concurrency.maximum)[-1] == recipe.concurrency.maximum


def test_tensor_parallel_sizes_are_limited_by_kv_heads():
    """KV heads divide between ranks, so they limit the sizes as the query heads do; a cache every rank holds
    whole (one KV head or latent row read by every query head) leaves only the query heads to limit them."""
    for recipe, checkpoint in HUB_CHECKPOINTS:
        config = checkpoint.config
        limits = [config["num_attention_heads"]] + ([] if kv_replicated(config) else [config["num_key_value_heads"]])
        sizes = recipe.tensor_parallel_sizes_for(config)
        assert all(limit % size == 0 for limit in limits for size in sizes)
        assert max(sizes) == max(size for size in recipe.tensor_parallel_sizes
                                 if all(limit % size == 0 for limit in limits))
    recipe, checkpoint = registry.find_alias("qwen2.5-0.5b-instruct")   # two KV heads
    assert recipe.tensor_parallel_sizes_for(checkpoint.config) == (1, 2)


def test_aliases_and_repositories_are_unique_ignoring_case():
    aliases = [checkpoint.alias.lower() for _, checkpoint in registry.all_checkpoints()]
    repos = [checkpoint.repo_id.lower() for _, checkpoint in HUB_CHECKPOINTS]
    assert len(aliases) == len(set(aliases))
    assert len(repos) == len(set(repos))
    assert registry.supported_aliases() == sorted(aliases)


def test_find_alias_ignores_case_and_returns_recipe_and_checkpoint():
    recipe, checkpoint = registry.find_alias("  QWEN3-8B ")
    assert checkpoint.alias == "qwen3-8b"
    assert recipe.family == "qwen3"
    assert registry.find_alias("Qwen/Qwen3-8B") is None      # repository ids go through find_repository
    assert registry.find_alias("no-such-model") is None


def test_find_repository_matches_declared_repository_ignoring_case():
    recipe, checkpoint = registry.find_repository("qwen/QWEN3-8b")
    assert checkpoint.alias == "qwen3-8b"
    assert registry.find_repository("someone/Qwen3-8B") is None


def test_recipe_for_architecture_prefers_the_family_over_the_demo():
    assert registry.recipe_for_architecture("LlamaForCausalLM").family == "llama"
    assert registry.recipe_for_architecture("Qwen3ForCausalLM").family == "qwen3"
    assert registry.recipe_for_architecture("Qwen2ForCausalLM").family == "qwen2"
    assert registry.recipe_for_architecture("MistralForCausalLM").family == "mistral"
    assert registry.recipe_for_architecture("GPT2LMHeadModel") is None


def test_demo_is_built_locally_and_served_as_flare_demo():
    recipe, checkpoint = registry.find_alias("demo")
    assert checkpoint.source == "builtin"
    assert checkpoint.repo_id is None and checkpoint.revision is None
    assert checkpoint.served_name == "flare-demo"
    assert checkpoint.architecture == "LlamaForCausalLM"
    assert recipe.decode_capacities[-1] >= recipe.concurrency.maximum


def test_suggest_alias_finds_a_close_match_only():
    assert registry.suggest_alias("Qwen-3-8B") == "qwen3-8b"
    assert registry.suggest_alias("lama-3.1-8b-instruct") == "llama-3.1-8b-instruct"
    assert registry.suggest_alias("completely-different") is None


def test_unknown_alias_error_is_a_usage_error_suggesting_and_listing_aliases():
    error = registry.unknown_alias_error("qwen3-9b")
    assert isinstance(error, UsageError) and error.exit_code == 2
    message = str(error)
    assert "'qwen3-9b'" in message
    assert "did you mean qwen3-8b?" in message
    for alias in registry.supported_aliases():
        assert alias in message
    assert "did you mean" not in str(registry.unknown_alias_error("zzzzzzzz"))


def test_recipes_import_without_torch_or_hub_libraries():
    code = ("import sys, flare.recipes; from flare.recipes import registry; registry.all_checkpoints(); "
            f"print(','.join(sorted(m for m in sys.modules if m.split('.')[0] in {HEAVY_MODULES!r})))")
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == ""


@pytest.mark.parametrize("recipe,checkpoint", [pair for pair in registry.all_checkpoints()
                                               if pair[0].speculation_for(pair[1]).draft is not None],
                         ids=lambda value: getattr(value, "alias", getattr(value, "family", "")))
def test_a_declared_draft_is_a_smaller_checkpoint_of_the_same_vocabulary(recipe, checkpoint):
    draft = recipe.speculation_for(checkpoint).draft
    assert draft.config["vocab_size"] == checkpoint.config["vocab_size"]
    assert draft.decode_weight_bytes < checkpoint.decode_weight_bytes / 3       # drafting is cheap beside it
    assert draft.revision and len(draft.revision) == 40
    assert draft in recipe.checkpoints, "a draft is one of the family's declared checkpoints"
