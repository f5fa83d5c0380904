"""Qwen2: the Llama layout with biases on the q, k and v projections (never on o_proj).

config.json's sliding window is honoured only with `use_sliding_window`; `ModelConfig` refuses it when
it would hide tokens (see `config._qwen2_fields`).
"""

from __future__ import annotations

from flare.models.llama import LlamaForCausalLM


class Qwen2ForCausalLM(LlamaForCausalLM):
    """Built from `ModelConfig` with `qkv_bias=True`."""
