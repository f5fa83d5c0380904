"""config.json's quantization_config, as FP8 checkpoints ship it, read into `Fp8Weights` (no torch)."""

from __future__ import annotations

import pytest

from flare.models import ModelConfig, UnsupportedModel
from flare.models.quantization import DECODER_PROJECTIONS, fp8_weights_of

# As Qwen/Qwen3-8B-FP8 and DeepSeek-V3 ship it.
BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
# As RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic ships it (llm-compressor's FP8_DYNAMIC scheme).
WEIGHTS = {"actorder": None, "block_structure": None, "dynamic": False, "group_size": None, "num_bits": 8,
           "observer": "minmax", "observer_kwargs": {}, "strategy": "channel", "symmetric": True, "type": "float"}
TOKENS = {**WEIGHTS, "dynamic": True, "observer": None, "strategy": "token"}
COMPRESSED = {"config_groups": {"group_0": {"input_activations": TOKENS, "output_activations": None,
                                            "targets": ["Linear"], "weights": WEIGHTS}},
              "format": "float-quantized", "ignore": ["lm_head"], "kv_cache_scheme": None,
              "quant_method": "compressed-tensors", "quantization_status": "compressed"}
LLAMA = {"architectures": ["LlamaForCausalLM"], "hidden_size": 64, "num_hidden_layers": 2, "num_attention_heads": 4,
         "max_position_embeddings": 64, "intermediate_size": 96, "vocab_size": 512}


def weights_of(quantization):
    return fp8_weights_of({"quantization_config": quantization})


def test_block_fp8():
    fp8 = weights_of(BLOCK)
    assert (fp8.method, fp8.granularity, fp8.block, fp8.scale_suffix) == ("fp8", "block", (128, 128), "weight_scale_inv")
    assert fp8.quantizes("model.layers.3.mlp.down_proj") and not fp8.quantizes("lm_head")


def test_per_tensor_fp8_with_static_activations():
    fp8 = weights_of({"quant_method": "fp8", "activation_scheme": "static"})
    assert (fp8.granularity, fp8.scale_suffix, fp8.static_input_scales) == ("tensor", "weight_scale", True)


@pytest.mark.parametrize("key", ["modules_to_not_convert", "ignored_layers"])
def test_fp8_skip_lists_name_modules_their_parents_or_their_tails(key):
    fp8 = weights_of({**BLOCK, key: ["model.layers.0", "mlp.down_proj"]})
    assert not fp8.quantizes("model.layers.0.self_attn.q_proj")
    assert fp8.quantizes("model.layers.10.self_attn.q_proj")
    assert not fp8.quantizes("model.layers.7.mlp.down_proj")
    assert fp8.quantizes("model.layers.7.mlp.up_proj")


def test_compressed_tensors_per_channel():
    fp8 = weights_of(COMPRESSED)
    assert (fp8.method, fp8.granularity, fp8.scale_suffix, fp8.static_input_scales) == (
        "compressed-tensors", "channel", "weight_scale", False)
    assert fp8.quantizes("model.layers.0.self_attn.o_proj") and not fp8.quantizes("lm_head")


def test_compressed_tensors_presets_and_regex_ignores():
    fp8 = weights_of({**COMPRESSED, "config_groups": {"FP8_BLOCK": ["Linear"]},
                      "ignore": ["lm_head", "re:.*layers\\.1\\..*"]})
    assert (fp8.granularity, fp8.block) == ("block", (128, 128))
    assert not fp8.quantizes("model.layers.1.mlp.up_proj") and fp8.quantizes("model.layers.11.mlp.up_proj")
    static = weights_of({**COMPRESSED, "config_groups": {"FP8": ["Linear"]}})
    assert (static.granularity, static.static_input_scales) == ("tensor", True)


@pytest.mark.parametrize("quantization, message", [
    ({"quant_method": "gptq", "bits": 4}, r"quantized checkpoints \(gptq\) are not supported"),
    ({**BLOCK, "fmt": "e5m2"}, "stores 'e5m2' values"),
    ({**BLOCK, "weight_block_size": [128]}, "weight_block_size"),
    ({**COMPRESSED, "format": "pack-quantized"}, "format 'pack-quantized'"),
    ({**COMPRESSED, "kv_cache_scheme": {"num_bits": 8, "type": "float", "strategy": "tensor"}}, "kv_cache_scheme"),
    ({**COMPRESSED, "config_groups": {"group_0": {"targets": ["Linear"], "weights": {**WEIGHTS, "num_bits": 4,
                                                                                    "type": "int"}}}},
     "weights are 4-bit int"),
    ({**COMPRESSED, "config_groups": {"W4A16": ["Linear"]}}, "scheme 'W4A16'"),
    ({**COMPRESSED, "config_groups": {"a": {"targets": ["re:.*mlp.*"], "weights": WEIGHTS},
                                      "b": {"targets": ["re:.*attn.*"], "weights": {**WEIGHTS, "strategy": "tensor"}}}},
     "different schemes"),
])
def test_other_quantizations_are_refused_naming_what_they_are(quantization, message):
    with pytest.raises(UnsupportedModel, match=message):
        weights_of(quantization)


def test_an_fp8_lm_head_is_refused():
    with pytest.raises(UnsupportedModel, match="stores lm_head in FP8"):
        ModelConfig.from_hf_config({**LLAMA, "quantization_config": {**COMPRESSED, "ignore": []}})


def test_online_fp8_is_block_fp8_of_the_named_decoder_projections_and_refuses_an_fp8_checkpoint():
    fp8 = ModelConfig.from_hf_config(LLAMA, online_fp8=("q_proj", "k_proj", "v_proj")).fp8
    assert (fp8.method, fp8.block, fp8.scale_suffix) == ("online", (128, 128), "weight_scale_inv")
    assert fp8.quantizes("model.layers.1.self_attn.k_proj") and not fp8.quantizes("model.layers.1.mlp.up_proj")
    assert not ModelConfig.from_hf_config(LLAMA, online_fp8=DECODER_PROJECTIONS).fp8.quantizes("lm_head")
    assert ModelConfig.from_hf_config(LLAMA).fp8 is None
    with pytest.raises(UnsupportedModel, match="already FP8"):
        ModelConfig.from_hf_config({**LLAMA, "quantization_config": BLOCK}, online_fp8=DECODER_PROJECTIONS)
    with pytest.raises(UnsupportedModel, match="online FP8 projections lm_head"):
        ModelConfig.from_hf_config(LLAMA, online_fp8=("lm_head",))


def test_kv_cache_dtype_is_checked():
    assert ModelConfig.from_hf_config(LLAMA, kv_cache_dtype="fp8").kv_cache_dtype == "fp8"
    with pytest.raises(UnsupportedModel, match="KV cache dtype 'int8'"):
        ModelConfig.from_hf_config(LLAMA, kv_cache_dtype="int8")
