"""Mistral: the Llama layout without biases.

Mistral applies `sliding_window` whenever config.json sets it; `ModelConfig` refuses a window shorter
than the context (see `config._mistral_fields`), so what runs here is full causal attention.
"""

from __future__ import annotations

from flare.models.llama import LlamaForCausalLM


class MistralForCausalLM(LlamaForCausalLM):
    """Built from `ModelConfig` with no biases."""
