"""Tiny random DeepSeek V4 checkpoints, written by `transformers` itself, for CPU tests.

`write_tiny_v4_checkpoint(tmp_path)` gives a float32 checkpoint (config.json, safetensors as
save_pretrained writes them, the stories260k tokenizer) whose layers mix all three attention types and
both kinds of experts, with windows, compression rates and an indexer top-k small enough that a few dozen
tokens exercise every path: sliding keys leaving the window, CSA entries overlapping, the indexer choosing
fewer entries than a query sees, HCA entries of 8 tokens. Same arguments, same bytes.
"""

from __future__ import annotations

import shutil
from pathlib import Path

from tiny_checkpoints import STORIES260K, TOKENIZER_FILES

TINY_V4 = {
    "vocab_size": 512,
    "hidden_size": 64,
    "moe_intermediate_size": 32,
    "num_hidden_layers": 4,
    "num_attention_heads": 4,
    "num_key_value_heads": 1,
    "head_dim": 32,
    "q_lora_rank": 24,
    "o_groups": 2,
    "o_lora_rank": 16,
    "partial_rotary_factor": 0.25,              # rotary on the last 8 of 32 channels
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "layer_types": ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
                    "compressed_sparse_attention"],
    "mlp_layer_types": ["hash_moe", "moe", "moe", "hash_moe"],
    "compress_rates": {"compressed_sparse_attention": 4, "heavily_compressed_attention": 8},
    "sliding_window": 8,
    "index_n_heads": 16,             # scores tie (every head negative) with odds 2^-16
    "index_head_dim": 16,
    "index_topk": 3,
    "max_position_embeddings": 256,
    "rope_parameters": {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64},
    "bos_token_id": 1,
    "eos_token_id": 2,
    "hc_sinkhorn_iters": 6,
}


def write_tiny_v4_checkpoint(directory: Path, seed: int = 0, **overrides) -> Path:
    """A random float32 DeepseekV4ForCausalLM checkpoint in `directory` (returned)."""
    import torch
    from transformers import DeepseekV4Config, DeepseekV4ForCausalLM

    directory = Path(directory)
    config = DeepseekV4Config(**{**TINY_V4, **overrides})
    torch.manual_seed(seed)
    model = DeepseekV4ForCausalLM(config).to(torch.float32)
    _randomise(model, seed, config.vocab_size, config.n_routed_experts)
    model.save_pretrained(directory)
    for name in TOKENIZER_FILES:
        shutil.copyfile(STORIES260K / name, directory / name)
    return directory


def _randomise(model, seed: int, vocab: int, experts: int) -> None:
    """Spread enough for clear winners: norms near one, sinks and biases small, hash routes random."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith(("sinks", "base", "position_bias", "e_score_correction_bias")):
                param.copy_(0.5 * noise)
            elif name.endswith("scale"):
                param.copy_(1.0 + 0.3 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("tid2eid"):
                # distinct experts per token, as a routing table holds them
                buffer.copy_(torch.rand(vocab, experts, generator=generator).argsort(dim=-1)[:, :buffer.shape[1]])
            elif name.endswith("e_score_correction_bias"):
                buffer.copy_(0.3 * torch.randn(buffer.shape, generator=generator))
