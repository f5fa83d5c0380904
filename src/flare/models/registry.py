"""Architecture name -> model class, and `build_model`. Model modules (and torch) load only when building."""

from __future__ import annotations

import contextlib
import importlib

from flare.models.config import ModelConfig

MODEL_CLASSES = {
    "DeepseekV4ForCausalLM": "flare.models.deepseek_v4",
    "LlamaForCausalLM": "flare.models.llama",
    "MistralForCausalLM": "flare.models.mistral",
    "Qwen2ForCausalLM": "flare.models.qwen2",
    "Qwen3ForCausalLM": "flare.models.qwen3",
    "DeepseekV2ForCausalLM": "flare.models.deepseek",
    "DeepseekV3ForCausalLM": "flare.models.deepseek",
}


def build_model(cfg: ModelConfig, dtype, device, attention_backend):
    """An unloaded `CausalLM` on `device` in `dtype`; its parameters hold no values until `load_hf_weights`."""
    import torch

    model_class = getattr(importlib.import_module(MODEL_CLASSES[cfg.architecture]), cfg.architecture)
    with torch.device(device), _default_dtype(torch, dtype):
        model = model_class(cfg, attention_backend)
    return model.eval()


@contextlib.contextmanager
def _default_dtype(torch, dtype):
    # Parameters are created with torch.empty, so they take the default dtype without a conversion copy.
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        yield
    finally:
        torch.set_default_dtype(previous)
