"""A package's weights load into the model exactly as the checkpoint's do (the package/models seam)."""

from __future__ import annotations

import torch

from flare.engine.attention import TorchReferenceBackend
from flare.models import build_model, load_checkpoint
from flare.models.config import ModelConfig
from flare.package.reader import open_package


def test_package_weights_load_like_the_checkpoint(export, approved, stories260k):
    _, reference = load_checkpoint(stories260k, torch.float32, "cpu", TorchReferenceBackend())
    with open_package(export(), approved) as package:
        model = build_model(ModelConfig.from_hf_config(package.hf_config), torch.float32, "cpu",
                            TorchReferenceBackend())
        model.load_hf_weights(package.iter_weights())
    expected, loaded = reference.state_dict(), model.state_dict()
    assert expected.keys() == loaded.keys()
    for name, tensor in expected.items():
        assert torch.equal(loaded[name], tensor), name
