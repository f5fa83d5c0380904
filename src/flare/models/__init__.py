"""Model architectures built from shared layers. Importing this package does not import torch."""

from __future__ import annotations

from flare.models.config import ModelConfig, RopeConfig
from flare.models.errors import UnsupportedModel, WeightError
from flare.models.loader import iter_safetensors, load_checkpoint, load_model, read_model_config
from flare.models.registry import build_model

__all__ = [
    "ModelConfig",
    "RopeConfig",
    "UnsupportedModel",
    "WeightError",
    "build_model",
    "iter_safetensors",
    "load_checkpoint",
    "load_model",
    "read_model_config",
]
