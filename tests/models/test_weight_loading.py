"""Loading checkpoint tensors: fusing, and loud failures that name the tensor at fault."""

from __future__ import annotations

import json

import pytest
import torch

from flare.engine.attention import TorchReferenceBackend
from flare.errors import PreparationError
from flare.models import ModelConfig, WeightError, build_model, iter_safetensors, load_checkpoint, read_model_config
from models.paged_runner import PagedRunner
from tiny_checkpoints import write_tiny_checkpoint


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    return write_tiny_checkpoint("qwen2", tmp_path_factory.mktemp("qwen2"))


def fresh_model(directory):
    return build_model(read_model_config(directory), torch.float32, "cpu", TorchReferenceBackend())


def tensors(directory) -> dict[str, torch.Tensor]:
    return dict(iter_safetensors(directory))


def test_a_sharded_checkpoint_is_read_through_its_index(checkpoint):
    index = json.loads((checkpoint / "model.safetensors.index.json").read_text())
    assert len(set(index["weight_map"].values())) >= 2
    assert set(tensors(checkpoint)) == set(index["weight_map"])


def test_a_missing_tensor_is_named(checkpoint):
    weights = tensors(checkpoint)
    del weights["model.layers.1.self_attn.k_proj.bias"]
    with pytest.raises(WeightError, match=r"model\.layers\.1\.self_attn\.k_proj\.bias is missing"):
        fresh_model(checkpoint).load_hf_weights(weights.items())


def test_several_missing_tensors_name_the_first_and_count_the_rest(checkpoint):
    weights = {name: t for name, t in tensors(checkpoint).items() if ".layers.1." not in name}
    with pytest.raises(WeightError, match=r"tensors model\.layers\.1\.\S+ and \d+ more are missing"):
        fresh_model(checkpoint).load_hf_weights(weights.items())


def test_an_unexpected_tensor_is_named(checkpoint):
    weights = tensors(checkpoint)
    weights["model.layers.0.self_attn.extra_proj.weight"] = torch.zeros(4, 4)
    with pytest.raises(WeightError, match=r"model\.layers\.0\.self_attn\.extra_proj\.weight is not part of"):
        fresh_model(checkpoint).load_hf_weights(weights.items())


@pytest.mark.parametrize("name", ["model.layers.0.self_attn.v_proj.weight", "model.layers.1.post_attention_layernorm.weight"])
def test_a_misshaped_tensor_is_named_with_both_shapes(checkpoint, name):
    weights = tensors(checkpoint)
    expected = list(weights[name].shape)
    weights[name] = torch.zeros(expected[0] + 1, *expected[1:])
    message = rf"{name} has shape \[{expected[0] + 1}.*\] but the model expects \[{expected[0]}.*\]"
    with pytest.raises(WeightError, match=message):
        fresh_model(checkpoint).load_hf_weights(weights.items())


def test_weight_errors_are_preparation_errors():
    assert issubclass(WeightError, PreparationError)


def test_a_shard_named_by_the_index_but_absent_fails_naming_the_file(checkpoint, tmp_path):
    for file in checkpoint.iterdir():
        (tmp_path / file.name).write_bytes(file.read_bytes())
    (tmp_path / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(WeightError, match="model-00002-of-00002.safetensors is missing"):
        load_checkpoint(tmp_path, torch.float32, "cpu", TorchReferenceBackend())


def test_saved_rotary_frequencies_of_older_checkpoints_are_ignored(checkpoint):
    weights = tensors(checkpoint)
    weights["model.layers.0.self_attn.rotary_emb.inv_freq"] = torch.ones(8)
    model = fresh_model(checkpoint)
    computed = model.model.rotary_emb.inv_freq.clone()
    model.load_hf_weights(weights.items())
    torch.testing.assert_close(model.model.rotary_emb.inv_freq, computed)    # the config's, not the file's


@pytest.mark.parametrize("rope", [None, {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}])
def test_build_model_makes_parameters_of_the_requested_dtype_and_device_without_values(checkpoint, rope):
    hf = json.loads((checkpoint / "config.json").read_text())
    cfg = ModelConfig.from_hf_config({**hf, "rope_parameters": rope or hf["rope_parameters"]})
    model = build_model(cfg, torch.bfloat16, "meta", TorchReferenceBackend())
    assert {(p.dtype, p.device.type) for p in model.parameters()} == {(torch.bfloat16, "meta")}
    assert model.model.rotary_emb.inv_freq.dtype == torch.float32


@pytest.mark.parametrize("head", ["identical", "different"])
def test_tied_checkpoint_with_an_lm_head_behaves_as_in_transformers(tmp_path, head):
    # transformers keeps an identical lm_head tied and unties the embeddings when the lm_head differs.
    from safetensors.torch import save_file
    from transformers import AutoModelForCausalLM

    directory = write_tiny_checkpoint("llama", tmp_path, tie_word_embeddings=True)
    shard = directory / "model-00002-of-00002.safetensors"
    weights = dict(iter_safetensors(directory))
    embedding = weights["model.embed_tokens.weight"]
    extra = {"lm_head.weight": embedding.clone() if head == "identical" else torch.randn(embedding.shape) * 0.1}
    save_file({**{name: t for name, t in iter_shard(shard)}, **extra}, shard, metadata={"format": "pt"})
    index_path = directory / "model.safetensors.index.json"
    index = json.loads(index_path.read_text())
    index["weight_map"]["lm_head.weight"] = shard.name
    index_path.write_text(json.dumps(index))

    cfg, model = load_checkpoint(directory, torch.float32, "cpu", TorchReferenceBackend())
    assert (model.lm_head.matrix is model.model.embed_tokens.weight) == (head == "identical")
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    tokens = list(range(3, 20))
    with torch.no_grad():
        expected = theirs(torch.tensor([tokens])).logits[0]
    torch.testing.assert_close(PagedRunner(cfg, model).step({"a": tokens})["a"], expected, rtol=1e-4, atol=1e-4)


def iter_shard(path):
    from safetensors import safe_open

    with safe_open(path, framework="pt") as f:
        for name in f.keys():
            yield name, f.get_tensor(name)
