"""On a CUDA GPU in bfloat16, our models stay as close to float32 as transformers' own bfloat16 models do."""

from __future__ import annotations

import pytest
import torch

from flare.engine.attention import AttentionMetadata, TorchReferenceBackend, allocate_kv_caches
from flare.models import load_checkpoint
from models.test_parity import TOKENS, VARIANTS
from tiny_checkpoints import write_tiny_checkpoint

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


def transformers_logits(directory, dtype) -> torch.Tensor:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=dtype, attn_implementation="eager").cuda()
    with torch.no_grad():
        return model(torch.tensor([TOKENS], device="cuda")).logits[0].float()


def our_logits(directory, dtype) -> torch.Tensor:
    cfg, model = load_checkpoint(directory, dtype, "cuda", TorchReferenceBackend())
    kv_caches = allocate_kv_caches(cfg, num_pages=8, page_size=16, dtype=dtype, device="cuda")
    meta = AttentionMetadata.build([len(TOKENS)], [len(TOKENS)], [[6, 1, 4, 3]], page_size=16, device="cuda")
    with torch.no_grad():
        return model.compute_logits(model(torch.tensor(TOKENS, device="cuda"), meta.positions(), kv_caches, meta))


@pytest.mark.parametrize("variant", list(VARIANTS))
def test_bfloat16_logits_are_as_close_to_float32_as_transformers(variant, tmp_path):
    family, overrides = VARIANTS[variant]
    directory = write_tiny_checkpoint(family, tmp_path, **overrides)
    exact = transformers_logits(directory, torch.float32)
    ours, theirs = our_logits(directory, torch.bfloat16), transformers_logits(directory, torch.bfloat16)
    scale = exact.abs().max()
    torch.testing.assert_close(our_logits(directory, torch.float32), exact, rtol=1e-4, atol=1e-4 * scale.item())
    assert (ours - exact).abs().max() <= 1.5 * (theirs - exact).abs().max() + 1e-3 * scale
