"""Tiny EAGLE-3 draft heads in the layout public heads use (flare.models.eagle3), written by our script.

`write_tiny_eagle3(directory, target_hidden=64, vocab=512, draft_vocab=128, ...)` writes config.json
(`architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`, `eagle_config` when aux layers are
given) and model.safetensors with the tensor names vLLM's and SGLang's loaders read: `midlayer.*`,
`fc.weight`, `norm.weight`, `lm_head.weight`, `d2t` (int64 offsets: draft token i is target token
i + d2t[i]) and `t2d` (bool over the target vocabulary), optionally `embed_tokens.weight`. Random
weights from a fixed seed: for loading and shape tests only, never for acceptance numbers.
"""

from __future__ import annotations

import json
from pathlib import Path


def write_tiny_eagle3(directory: Path, target_hidden: int = 64, vocab: int = 512, draft_vocab: int = 128,
                      hidden: int = 64, heads: int = 4, kv_heads: int = 2, intermediate: int = 96,
                      embedding: bool = False, aux_layers: list[int] | None = None, seed: int = 0) -> Path:
    import torch
    from safetensors.torch import save_file

    generator = torch.Generator().manual_seed(seed)

    def weight(*shape, scale=0.08):
        return torch.randn(*shape, generator=generator) * scale

    head_dim = hidden // heads
    # A reduced vocabulary: an increasing choice of target tokens, as the published heads' d2t maps.
    chosen = torch.sort(torch.randperm(vocab, generator=generator)[:draft_vocab]).values
    tensors = {
        "midlayer.input_layernorm.weight": 1 + weight(hidden, scale=0.1),
        "midlayer.hidden_norm.weight": 1 + weight(hidden, scale=0.1),
        "midlayer.post_attention_layernorm.weight": 1 + weight(hidden, scale=0.1),
        "midlayer.self_attn.q_proj.weight": weight(heads * head_dim, 2 * hidden),
        "midlayer.self_attn.k_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.v_proj.weight": weight(kv_heads * head_dim, 2 * hidden),
        "midlayer.self_attn.o_proj.weight": weight(hidden, heads * head_dim),
        "midlayer.mlp.gate_proj.weight": weight(intermediate, hidden),
        "midlayer.mlp.up_proj.weight": weight(intermediate, hidden),
        "midlayer.mlp.down_proj.weight": weight(hidden, intermediate),
        "fc.weight": weight(hidden, 3 * target_hidden),
        "norm.weight": 1 + weight(hidden, scale=0.1),
        "lm_head.weight": weight(draft_vocab, hidden, scale=0.5),
        "d2t": (chosen - torch.arange(draft_vocab)).to(torch.int64),
        "t2d": torch.zeros(vocab, dtype=torch.bool).index_fill_(0, chosen, True),
    }
    if embedding:
        tensors["embed_tokens.weight"] = weight(vocab, hidden, scale=0.5)
    config = {"architectures": ["LlamaForCausalLMEagle3"], "model_type": "llama", "hidden_size": hidden,
              "intermediate_size": intermediate, "num_attention_heads": heads, "num_key_value_heads": kv_heads,
              "num_hidden_layers": 1, "vocab_size": vocab, "draft_vocab_size": draft_vocab,
              "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
              "tie_word_embeddings": False, "torch_dtype": "float32", "hidden_act": "silu"}
    if target_hidden != hidden:
        config["target_hidden_size"] = target_hidden
    if aux_layers is not None:
        config["eagle_config"] = {"eagle_aux_hidden_state_layer_ids": aux_layers, "use_aux_hidden_state": True}
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(directory / "model.safetensors"))
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    return directory
