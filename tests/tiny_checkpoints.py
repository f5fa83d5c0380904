"""Tiny random checkpoints of each supported family, written by `transformers` itself, for CPU tests.

`write_tiny_checkpoint("qwen3", tmp_path)` gives a float32 checkpoint directory (config.json, two or
more safetensors shards with an index, and the stories260k tokenizer, vocab 512). Same arguments,
same bytes: the weights come from a fixed seed.
"""

from __future__ import annotations

import shutil
from pathlib import Path

STORIES260K = Path(__file__).resolve().parent / "fixtures" / "stories260k"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")
FAMILIES = ("llama", "qwen2", "qwen3", "mistral", "deepseek_v2", "deepseek_v3")

BASE_CONFIG = {
    "vocab_size": 512,
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "max_position_embeddings": 256,
    "rms_norm_eps": 1e-6,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "tie_word_embeddings": False,
}
# DeepSeek: MLA with a 32-wide latent and a 16-wide rotary key (v_head_dim differs from the key's, as a
# mix-up of the two would show), 8 routed experts (2 a token) and a shared one from the second layer on.
DEEPSEEK = {"num_key_value_heads": 4, "kv_lora_rank": 32, "qk_nope_head_dim": 16,
            "qk_rope_head_dim": 16, "v_head_dim": 24, "n_routed_experts": 8, "num_experts_per_tok": 2,
            "n_shared_experts": 1, "moe_intermediate_size": 32, "first_k_dense_replace": 1}
FAMILY_CONFIG = {"llama": {}, "qwen2": {}, "qwen3": {}, "mistral": {"sliding_window": None},
                 "deepseek_v2": {**DEEPSEEK, "q_lora_rank": None, "topk_method": "greedy"},
                 # V3: a query LoRA, 4 groups of 2 experts of which each token's choice may use 2
                 "deepseek_v3": {**DEEPSEEK, "q_lora_rank": 48, "n_group": 4, "topk_group": 2,
                                 "routed_scaling_factor": 2.5, "num_nextn_predict_layers": 0}}


def write_tiny_checkpoint(family: str, directory: Path, seed: int = 0, **config_overrides) -> Path:
    """Write a random float32 `family` checkpoint into `directory` and return it."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if not (STORIES260K / TOKENIZER_FILES[0]).is_file():
        raise FileNotFoundError(f"the tokenizer comes from the stories260k fixture, missing at {STORIES260K}")
    directory = Path(directory)
    config = AutoConfig.for_model(family, **{**BASE_CONFIG, **FAMILY_CONFIG[family], **config_overrides})
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    _randomise(model, seed)
    total_bytes = sum(p.numel() * p.element_size() for p in model.state_dict().values())
    model.save_pretrained(directory, max_shard_size=total_bytes * 6 // 10)
    for name in TOKENIZER_FILES:
        shutil.copyfile(STORIES260K / name, directory / name)
    return directory


def _randomise(model, seed: int) -> None:
    """Weights with enough spread that the logits have clear winners, and non-trivial norms and biases."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in model.named_parameters():
            noise = torch.randn(param.shape, generator=generator)
            if name.endswith("norm.weight"):
                param.copy_(1.0 + 0.2 * noise)
            elif name.endswith("bias"):
                param.copy_(0.2 * noise)
            else:
                param.copy_(noise / param.shape[-1] ** 0.5)
        for name, buffer in model.named_buffers():
            if name.endswith("e_score_correction_bias"):   # DeepSeek-V3's router bias (zeros as built)
                buffer.copy_(0.2 * torch.randn(buffer.shape, generator=generator))
