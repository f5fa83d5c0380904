"""Reading config.json: what each family means, old and new rope keys, and refusing what we cannot run."""

from __future__ import annotations

import dataclasses
import json

import pytest

from flare.errors import UsageError
from flare.models import ModelConfig, UnsupportedModel
from tiny_checkpoints import BASE_CONFIG, write_tiny_checkpoint

ARCHITECTURE = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM",
                "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}


def hf_config(family: str, **fields) -> dict:
    return {"architectures": [ARCHITECTURE[family]], "model_type": family, **BASE_CONFIG, **fields}


def transformers_config(family: str, config: dict):
    from transformers import AutoConfig

    return AutoConfig.for_model(family, **{k: v for k, v in config.items() if k not in ("architectures", "model_type")})


@pytest.mark.parametrize("family", list(ARCHITECTURE))
def test_projections_biases_and_norms_match_the_transformers_model(family, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM

    directory = write_tiny_checkpoint(family, tmp_path, attention_bias=True)
    cfg = ModelConfig.from_hf_config(json.loads((directory / "config.json").read_text()))
    attention = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).model.layers[0].self_attn
    assert cfg.family == family
    assert cfg.qkv_bias == (attention.q_proj.bias is not None)
    assert cfg.o_bias == (attention.o_proj.bias is not None)
    assert cfg.qk_norm == hasattr(attention, "q_norm")
    assert (cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim) == (4, 2, 16)
    assert (cfg.bos_token_id, cfg.eos_token_ids, cfg.torch_dtype) == (1, (2,), "float32")


@pytest.mark.parametrize("family", list(ARCHITECTURE))
def test_head_dim_defaults_as_in_transformers(family):
    fields = {k: v for k, v in hf_config(family).items() if k != "head_dim"}
    theirs = transformers_config(family, fields)
    expected = getattr(theirs, "head_dim", None) or theirs.hidden_size // theirs.num_attention_heads
    assert ModelConfig.from_hf_config(fields).head_dim == expected  # 128 for qwen3, hidden/heads for the others


def test_old_rope_scaling_and_rope_theta_keys_mean_the_same_as_rope_parameters():
    new = hf_config("llama", rope_parameters={"rope_type": "linear", "factor": 2.0, "rope_theta": 5e5})
    old = hf_config("llama", rope_theta=5e5, rope_scaling={"type": "linear", "factor": 2.0})
    assert ModelConfig.from_hf_config(old).rope == ModelConfig.from_hf_config(new).rope
    assert ModelConfig.from_hf_config(new).rope.theta == 5e5


def test_llama3_takes_the_original_context_from_the_top_level_when_present():
    scaling = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 8192}
    cfg = ModelConfig.from_hf_config(hf_config("llama", rope_parameters=scaling, original_max_position_embeddings=64))
    assert cfg.rope.original_max_positions == 64


def test_config_is_frozen():
    cfg = ModelConfig.from_hf_config(hf_config("llama"))
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hidden_size = 1


SLIDING_CASES = {
    "mistral-window-shorter-than-context": ("mistral", {"sliding_window": 64}),
    "mistral-window-by-default": ("mistral", {"max_position_embeddings": 32768}),
    "mistral-no-window": ("mistral", {"sliding_window": None}),
    "mistral-window-covers-context": ("mistral", {"sliding_window": 256}),
    "qwen2-window-not-enabled": ("qwen2", {"sliding_window": 64, "use_sliding_window": False}),
    "qwen2-window-enabled": ("qwen2", {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 1}),
    "qwen2-window-only-above-all-layers": ("qwen2", {"sliding_window": 64, "use_sliding_window": True}),
    "qwen2-explicit-layer-types": ("qwen2", {"sliding_window": 64, "use_sliding_window": True,
                                             "layer_types": ["full_attention", "sliding_attention"]}),
    "qwen3-window-enabled": ("qwen3", {"sliding_window": 64, "use_sliding_window": True, "max_window_layers": 0}),
    "qwen3-window-not-enabled": ("qwen3", {"sliding_window": 64, "max_window_layers": 0}),
}


@pytest.mark.parametrize("case", list(SLIDING_CASES))
def test_sliding_window_is_refused_exactly_when_transformers_would_hide_tokens(case):
    family, fields = SLIDING_CASES[case]
    config = hf_config(family, **fields)
    theirs = transformers_config(family, config)
    sliding_layers = getattr(theirs, "layer_types", None) or ["sliding_attention"] * theirs.num_hidden_layers
    hides_tokens = (
        theirs.sliding_window is not None
        and "sliding_attention" in sliding_layers
        and theirs.sliding_window < theirs.max_position_embeddings
    )
    if hides_tokens:
        with pytest.raises(UnsupportedModel, match="sliding-window attention"):
            ModelConfig.from_hf_config(config)
    else:
        ModelConfig.from_hf_config(config)


@pytest.mark.parametrize(
    "fields, message",
    [
        ({"architectures": ["GPT2LMHeadModel"]}, "architecture GPT2LMHeadModel is not supported"),
        ({"rope_parameters": {"rope_type": "longrope", "rope_theta": 1e4}}, "'longrope' is not supported"),
        ({"mlp_bias": True}, "mlp_bias"),
        ({"hidden_act": "gelu"}, "hidden_act 'gelu'"),
        ({"partial_rotary_factor": 0.5}, "partial rotary"),
        ({"vocab_size": None}, "no 'vocab_size'"),
        ({"quantization_config": {"quant_method": "awq"}}, r"quantized checkpoints \(awq\) are not supported"),
    ],
)
def test_what_we_cannot_run_is_a_usage_error_saying_what(fields, message):
    with pytest.raises(UnsupportedModel, match=message) as raised:
        ModelConfig.from_hf_config(hf_config("llama") | fields)
    assert isinstance(raised.value, UsageError)


def test_reading_configs_does_not_import_torch():
    import os
    import subprocess
    import sys
    from pathlib import Path

    import flare

    code = "import sys, flare.models; flare.models.ModelConfig; sys.exit('torch' in sys.modules)"
    env = {**os.environ, "PYTHONPATH": str(Path(flare.__file__).parents[1])}
    assert subprocess.run([sys.executable, "-c", code], env=env).returncode == 0
