"""The tiny checkpoint helper other tests build on: deterministic, sharded, with a working tokenizer."""

from __future__ import annotations

import json

from tiny_checkpoints import write_tiny_checkpoint


def test_same_arguments_write_the_same_weights(tmp_path):
    first = write_tiny_checkpoint("qwen3", tmp_path / "a")
    second = write_tiny_checkpoint("qwen3", tmp_path / "b")
    shards = sorted(path.name for path in first.glob("*.safetensors"))
    assert len(shards) >= 2
    assert all((first / name).read_bytes() == (second / name).read_bytes() for name in shards)
    assert (first / "model-00001-of-00002.safetensors").read_bytes() != (
        write_tiny_checkpoint("qwen3", tmp_path / "c", seed=1) / "model-00001-of-00002.safetensors"
    ).read_bytes()


def test_overrides_reach_config_json_and_the_tokenizer_fits_the_vocabulary(tmp_path):
    from transformers import AutoTokenizer

    directory = write_tiny_checkpoint("llama", tmp_path, num_hidden_layers=3, tie_word_embeddings=True)
    config = json.loads((directory / "config.json").read_text())
    assert (config["num_hidden_layers"], config["tie_word_embeddings"], config["vocab_size"]) == (3, True, 512)
    ids = AutoTokenizer.from_pretrained(directory)("Once upon a time")["input_ids"]
    assert ids == [1, 403, 407, 261, 378]
