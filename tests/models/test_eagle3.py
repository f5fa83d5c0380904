"""EAGLE-3 heads load from checkpoints in the public layout and compute what the layout means: checked
against a plain-torch reading of the same tensors (tiny random heads written by tests/eagle3_checkpoints.py)."""

from __future__ import annotations

import json
import math

import pytest
import torch
from eagle3_checkpoints import write_tiny_eagle3

from flare.engine.attention import AttentionMetadata, TorchReferenceBackend, allocate_kv_caches
from flare.models.eagle3 import Eagle3Config, build_eagle3
from flare.models.errors import UnsupportedModel, WeightError
from flare.models.layers import Embedding
from flare.models.loader import iter_safetensors


def load(directory, target_embedding=None):
    config = Eagle3Config.from_hf_config(json.loads((directory / "config.json").read_text()))
    names = [name for name, _ in iter_safetensors(directory)]
    head = build_eagle3(config, names, torch.float32, "cpu", TorchReferenceBackend())
    head.load_hf_weights(iter_safetensors(directory))
    if target_embedding is not None:
        head.share_embedding(target_embedding)
    return config, head


def rms(x, weight, eps=1e-6):
    return weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps))


def rotate(x, positions, theta=10000.0):
    """Llama's rotary embedding (rotate-half), x [T, heads, D]."""
    dim = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    angles = positions[:, None].float() * inv_freq[None]
    cos, sin = torch.cat([angles.cos()] * 2, -1)[:, None], torch.cat([angles.sin()] * 2, -1)[:, None]
    half = torch.cat([-x[..., dim // 2:], x[..., :dim // 2]], -1)
    return x * cos + half * sin


def reference(t, embeds, features, heads=4, kv_heads=2):
    """The head's forward over one sequence, read straight from the checkpoint tensors."""
    x = torch.cat([rms(embeds, t["midlayer.input_layernorm.weight"]), rms(features, t["midlayer.hidden_norm.weight"])], -1)
    length = x.shape[0]
    q = (x @ t["midlayer.self_attn.q_proj.weight"].T).view(length, heads, -1)
    k = (x @ t["midlayer.self_attn.k_proj.weight"].T).view(length, kv_heads, -1)
    v = (x @ t["midlayer.self_attn.v_proj.weight"].T).view(length, kv_heads, -1)
    positions = torch.arange(length)
    q, k = rotate(q, positions), rotate(k, positions)
    k, v = k.repeat_interleave(heads // kv_heads, 1), v.repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("qhd,khd->hqk", q, k) / math.sqrt(q.shape[-1])
    scores = scores.masked_fill(torch.ones(length, length).triu(1).bool(), -math.inf)
    attended = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v).reshape(length, -1)
    hidden = features + attended @ t["midlayer.self_attn.o_proj.weight"].T
    mlp_in = rms(hidden, t["midlayer.post_attention_layernorm.weight"])
    gate, up = mlp_in @ t["midlayer.mlp.gate_proj.weight"].T, mlp_in @ t["midlayer.mlp.up_proj.weight"].T
    hidden = hidden + (torch.nn.functional.silu(gate) * up) @ t["midlayer.mlp.down_proj.weight"].T
    return rms(hidden, t["norm.weight"]), hidden


@pytest.mark.parametrize("own_embedding", [False, True])
def test_a_head_computes_what_its_tensors_say(tmp_path, own_embedding):
    directory = write_tiny_eagle3(tmp_path, embedding=own_embedding, target_hidden=48)
    tensors = dict(iter_safetensors(directory))
    target_embedding = Embedding(512, 64)
    target_embedding.weight.data = torch.randn(512, 64, generator=torch.Generator().manual_seed(3)) * 0.5
    config, head = load(directory, None if own_embedding else target_embedding)
    ids = torch.randint(0, 512, (7,), generator=torch.Generator().manual_seed(4))
    aux = torch.randn(7, 3 * 48, generator=torch.Generator().manual_seed(5))
    caches = allocate_kv_caches(config.layer, 2, 16, torch.float32, "cpu")[:1]
    meta = AttentionMetadata.build([7], [7], [[0]], 16)
    with torch.inference_mode():
        features = head.combine(aux)
        normed, prenorm = head(ids, meta.positions(), features, caches, meta)
        logits = head.compute_logits(normed)
    embeds = (tensors["embed_tokens.weight"] if own_embedding else target_embedding.weight.data)[ids]
    expected_normed, expected_prenorm = reference(tensors, embeds, aux @ tensors["fc.weight"].T)
    torch.testing.assert_close(normed, expected_normed, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(prenorm, expected_prenorm, rtol=1e-4, atol=1e-5)
    # Logits over the target vocabulary: the draft vocabulary's scores at tokens i + d2t[i], -inf elsewhere.
    mapped = torch.arange(128) + tensors["d2t"]
    assert torch.equal(tensors["t2d"].nonzero()[:, 0], mapped)
    torch.testing.assert_close(logits[:, mapped], expected_normed @ tensors["lm_head.weight"].T, rtol=1e-4, atol=1e-5)
    assert torch.isinf(logits[:, ~tensors["t2d"]]).all()


def test_aux_layers_default_to_low_middle_and_high_and_follow_the_config(tmp_path):
    default = Eagle3Config.from_hf_config(json.loads((write_tiny_eagle3(tmp_path / "a") / "config.json").read_text()))
    assert default.aux_layers(32) == (2, 16, 29)
    named = write_tiny_eagle3(tmp_path / "b", aux_layers=[1, 3, 4])
    assert Eagle3Config.from_hf_config(json.loads((named / "config.json").read_text())).aux_layers(5) == (1, 3, 4)
    with pytest.raises(UnsupportedModel, match="three target layers"):
        Eagle3Config.from_hf_config(json.loads((named / "config.json").read_text())).aux_layers(4)


def test_a_d2t_outside_the_target_vocabulary_is_refused(tmp_path):
    from safetensors.torch import load_file, save_file

    directory = write_tiny_eagle3(tmp_path)
    tensors = load_file(str(directory / "model.safetensors"))
    tensors["d2t"] = tensors["d2t"] + 1000
    save_file(tensors, str(directory / "model.safetensors"))
    with pytest.raises(WeightError, match="outside the target's 512-token vocabulary"):
        load(directory)


def test_a_config_that_is_not_an_eagle3_head_is_refused(tmp_path):
    config = json.loads((write_tiny_eagle3(tmp_path) / "config.json").read_text())
    with pytest.raises(UnsupportedModel, match="LlamaForCausalLMEagle3"):
        Eagle3Config.from_hf_config({**config, "architectures": ["LlamaForCausalLM"]})
    with pytest.raises(UnsupportedModel, match="2 decoder layers"):
        Eagle3Config.from_hf_config({**config, "num_hidden_layers": 2})
