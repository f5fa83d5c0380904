"""FP8 checkpoints in the layouts real ones ship load into FP8 layers and compute what their weights stand for.

Each checkpoint is written by tests/fp8_checkpoints.py; transformers (with compressed-tensors) reads the
same files for the reference where its dequantization is exact, and a dense checkpoint of the
dequantized weights is the reference elsewhere (blocks cut by the matrix edge, as stories260k's)."""

from __future__ import annotations

import pytest
import torch

from flare.engine.attention import TorchReferenceBackend
from flare.models import UnsupportedModel, WeightError, load_checkpoint
from flare.models.fp8 import Fp8Linear
from flare.models.layers import Linear
from fp8_checkpoints import write_block_fp8, write_compressed_tensors_fp8, write_dequantized
from models.paged_runner import PagedRunner
from tiny_checkpoints import write_tiny_checkpoint

TOKENS = torch.randint(3, 512, (24,), generator=torch.Generator().manual_seed(5)).tolist()
# 128-aligned shapes: several 128x128 blocks per matrix, every fused shard on a block boundary.
ALIGNED = {"hidden_size": 256, "intermediate_size": 384, "num_attention_heads": 8, "num_key_value_heads": 4,
           "head_dim": 32}


@pytest.fixture(scope="module")
def dense(tmp_path_factory):
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("dense"))


def our_logits(directory, tokens=TOKENS, chunks=(17, 7)):
    cfg, model = load_checkpoint(directory, torch.float32, "cpu", TorchReferenceBackend())
    runner, start, rows = PagedRunner(cfg, model), 0, []
    for size in chunks:
        rows.append(runner.step({"s": tokens[start:start + size]})["s"])
        start += size
    return torch.cat(rows), model


def transformers_logits(directory, tokens=TOKENS):
    """transformers' logits for the FP8 checkpoint, weight-only (compressed-tensors would otherwise also
    quantize the activations)."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).eval()
    for module in model.modules():
        scheme = getattr(module, "quantization_scheme", None)
        if scheme is not None:
            scheme.input_activations = None
    with torch.no_grad():
        return model(torch.tensor([tokens])).logits[0]


def assert_close(ours, theirs):
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())


@pytest.mark.parametrize("family", ["llama", "qwen3"])
def test_block_fp8_gives_transformers_logits(family, tmp_path):
    source = write_tiny_checkpoint(family, tmp_path / "dense", **ALIGNED)
    fp8 = write_block_fp8(source, tmp_path / "fp8", scale_dtype="float32")
    ours, model = our_logits(fp8)
    assert_close(ours, transformers_logits(fp8))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(qkv, Fp8Linear) and qkv.weight.dtype == torch.float8_e4m3fn
    assert (qkv.layout.row_block, qkv.layout.col_block) == (128, 128) and qkv.weight_scale.shape == (4, 2)


@pytest.mark.parametrize("strategy", ["channel", "tensor"])
def test_compressed_tensors_fp8_gives_transformers_logits(dense, strategy, tmp_path):
    fp8 = write_compressed_tensors_fp8(dense, tmp_path, strategy)
    ours, model = our_logits(fp8)
    assert_close(ours, transformers_logits(fp8))
    assert isinstance(model.model.layers[1].mlp.down_proj, Fp8Linear)
    assert model.lm_head.weight.dtype == torch.float32                   # ignored: lm_head stays dense


def test_blocks_cut_by_the_matrix_edge_on_stories260k(stories260k, tmp_path):
    """hidden 64, MLP 172: partial 128x128 blocks, two block rows for gate and up, fused shards off the
    block boundary. The FP8 model computes what its dequantized weights compute, chunked and decoding."""
    fp8 = write_block_fp8(stories260k, tmp_path / "fp8")
    reference = write_dequantized(fp8, tmp_path / "reference")
    tokens = [1, 403, 407, 261, 378, 9, 77, 301, 12, 5, 88, 240]
    chunks = (5, 4, 1, 1, 1)
    ours, model = our_logits(fp8, tokens, chunks)
    theirs, _ = our_logits(reference, tokens, chunks)
    assert_close(ours, theirs)
    gate_up = model.model.layers[0].mlp.gate_up_proj
    assert gate_up.layout.row_block == 1 and gate_up.weight_scale.shape == (344, 1)


def test_fp8_logits_stay_close_to_the_unquantized_model(stories260k, tmp_path):
    """The quantization error itself is small: the FP8 model mostly picks the dense model's next token."""
    tokens = [1, 403, 407, 261, 378, 9, 77, 301, 12, 5, 88, 240, 17, 99, 140, 33]
    ours, _ = our_logits(write_block_fp8(stories260k, tmp_path / "fp8"), tokens, (16,))
    dense_logits, _ = our_logits(stories260k, tokens, (16,))
    agreement = (ours.argmax(-1) == dense_logits.argmax(-1)).float().mean().item()
    assert agreement >= 0.8
    assert not torch.equal(ours, dense_logits)


def test_modules_to_not_convert_stay_dense(dense, tmp_path):
    fp8 = write_block_fp8(dense, tmp_path / "fp8", ignore=("model.layers.1.mlp.down_proj",))
    ours, model = our_logits(fp8)
    assert isinstance(model.model.layers[1].mlp.down_proj, Linear)
    assert isinstance(model.model.layers[0].mlp.down_proj, Fp8Linear)
    assert_close(ours, transformers_logits(fp8))


def test_a_fused_layer_must_be_quantized_whole(dense, tmp_path):
    fp8 = write_block_fp8(dense, tmp_path / "fp8", ignore=("model.layers.0.self_attn.k_proj",))
    with pytest.raises(UnsupportedModel, match="quantizes some of model.layers.0.self_attn's q_proj, k_proj, v_proj"):
        load_checkpoint(fp8, torch.float32, "cpu", TorchReferenceBackend())


def rewrite(directory, change):
    """Apply `change(tensors)` to the checkpoint's single safetensors file."""
    from safetensors.torch import load_file, save_file

    path = directory / "model.safetensors"
    tensors = load_file(str(path))
    change(tensors)
    save_file(tensors, str(path))


LAYER = "model.layers.0.self_attn.q_proj"


@pytest.mark.parametrize("change, message", [
    (lambda t: t.update({f"{LAYER}.weight": t[f"{LAYER}.weight"].bfloat16()}),
     f"{LAYER}.weight is bfloat16, but the model expects it FP8"),
    (lambda t: t.pop(f"{LAYER}.weight_scale_inv"), f"{LAYER}.weight_scale_inv is missing"),
    (lambda t: t.update({f"{LAYER}.weight_scale_inv": torch.ones(2, 1)}),
     rf"{LAYER}.weight_scale_inv has shape \[2, 1\] but block scales of this projection are \[1, 1\]"),
    (lambda t: t.update({f"{LAYER}.weight_scale_inv": torch.full((1, 1), float("nan"))}),
     "negative or non-finite scales"),
    (lambda t: t.update({"lm_head.weight_scale_inv": torch.ones(4, 1)}), "FP8 scale of a projection the model keeps"),
])
def test_a_checkpoint_that_does_not_fit_its_quantization_config_is_named(dense, tmp_path, change, message):
    fp8 = write_block_fp8(dense, tmp_path / "fp8", scale_dtype="float32")
    rewrite(fp8, change)
    with pytest.raises(WeightError, match=message):
        load_checkpoint(fp8, torch.float32, "cpu", TorchReferenceBackend())


def test_static_input_scales_are_accepted(dense, tmp_path):
    from safetensors import safe_open

    fp8 = write_compressed_tensors_fp8(dense, tmp_path, "tensor")
    with safe_open(str(fp8 / "model.safetensors"), framework="pt") as handle:
        assert f"{LAYER}.input_scale" in handle.keys()
    load_checkpoint(fp8, torch.float32, "cpu", TorchReferenceBackend())


def test_the_fp8_model_holds_one_byte_per_projection_weight(dense, tmp_path):
    fp8 = write_block_fp8(dense, tmp_path / "fp8")
    _, model = load_checkpoint(fp8, torch.float32, "cpu", TorchReferenceBackend())
    projections = [module for module in model.modules() if isinstance(module, Fp8Linear)]
    assert len(projections) == 8                                        # qkv, o, gate_up, down of two layers
    assert all(module.weight.element_size() == 1 for module in projections)
