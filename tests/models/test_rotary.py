"""Rotary frequencies equal transformers' for every scaling kind we accept."""

from __future__ import annotations

import pytest
import torch

from flare.models.config import ModelConfig
from flare.models.rotary import RotaryEmbedding, inverse_frequencies
from tiny_checkpoints import BASE_CONFIG

SCALINGS = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 500000.0, "factor": 4.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
               "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    "yarn": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64},
    "yarn-mscale": {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "original_max_position_embeddings": 64,
                    "mscale": 1.0, "mscale_all_dim": 0.707, "beta_fast": 16, "truncate": False},
    "yarn-attention-factor": {"rope_type": "yarn", "rope_theta": 1e6, "factor": 2.0, "attention_factor": 0.9,
                              "original_max_position_embeddings": 64},
}


def both(scaling: dict, **overrides):
    """Our ModelConfig and transformers' LlamaConfig for the same config.json fields."""
    from transformers import LlamaConfig

    fields = {**BASE_CONFIG, "rope_parameters": dict(scaling), **overrides}
    return ModelConfig.from_hf_config({"architectures": ["LlamaForCausalLM"], **fields}), LlamaConfig(**fields)


@pytest.mark.parametrize("name", list(SCALINGS))
def test_inverse_frequencies_and_attention_factor_equal_transformers(name):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    ours, theirs = both(SCALINGS[name], max_position_embeddings=256)
    kind = theirs.rope_parameters["rope_type"]
    init = LlamaRotaryEmbedding.compute_default_rope_parameters if kind == "default" else ROPE_INIT_FUNCTIONS[kind]
    expected_freq, expected_factor = init(theirs, device="cpu")
    inv_freq, factor = inverse_frequencies(ours.rope, ours.head_dim, ours.max_position_embeddings)
    torch.testing.assert_close(inv_freq, expected_freq, rtol=1e-6, atol=0)
    assert factor == pytest.approx(expected_factor, rel=1e-12)


@pytest.mark.parametrize("seq_len", [9, 48, 49, 70, 300])
def test_dynamic_frequencies_follow_the_sequence_length_as_in_transformers(seq_len):
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    scaling = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 3.0}
    ours, theirs = both(scaling, max_position_embeddings=48)
    expected, _ = ROPE_INIT_FUNCTIONS["dynamic"](theirs, "cpu", seq_len=torch.tensor(seq_len))
    rotary = RotaryEmbedding(ours.head_dim, ours.rope, ours.max_position_embeddings)
    per_token = rotary._dynamic_inverse_frequencies(torch.tensor([seq_len, 5], dtype=torch.int32))
    torch.testing.assert_close(per_token[0], expected, rtol=1e-6, atol=0)
    torch.testing.assert_close(per_token[1], rotary.inv_freq, rtol=1e-6, atol=0)  # within the trained context
