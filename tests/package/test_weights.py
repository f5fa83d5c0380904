"""Checkpoint tensors group into one payload per semantic layer."""

from flare.package.weights import group_by_payload, payload_for


def test_decoder_layers_embed_and_head():
    assert payload_for("model.layers.7.self_attn.q_proj.weight") == "weights/layer-007.safetensors"
    assert payload_for("model.language_model.layers.12.mlp.up_proj.weight") == "weights/layer-012.safetensors"
    assert payload_for("model.embed_tokens.weight") == "weights/embed.safetensors"
    assert payload_for("model.norm.weight") == "weights/head.safetensors"
    assert payload_for("lm_head.weight") == "weights/head.safetensors"


def test_other_layer_stacks_do_not_mix_with_the_decoder():
    assert payload_for("model.vision_tower.encoder.layers.0.attn.qkv.weight") == \
        "weights/model-vision-tower-encoder-layer-000.safetensors"
    assert payload_for("mtp.layers.0.mlp.down_proj.weight") == "weights/mtp-layer-000.safetensors"


def test_payload_order_is_embed_layers_then_head():
    names = ["lm_head.weight", "model.layers.1.a", "model.embed_tokens.weight", "model.layers.0.a", "model.norm.weight"]
    assert list(group_by_payload(names)) == ["weights/embed.safetensors", "weights/layer-000.safetensors",
                                             "weights/layer-001.safetensors", "weights/head.safetensors"]
