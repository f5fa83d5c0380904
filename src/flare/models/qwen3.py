"""Qwen3: the Llama layout with an RMSNorm over each query and key head before the rotation.

`attention_bias` puts biases on q, k, v and o; head_dim is 128 unless config.json says otherwise
(see `config._qwen3_fields`).
"""

from __future__ import annotations

from flare.models.llama import LlamaForCausalLM


class Qwen3ForCausalLM(LlamaForCausalLM):
    """Built from `ModelConfig` with `qk_norm=True`."""
