"""The benchmark architectures of shared/PERFORMANCE.md as config.json dicts (real shapes; weights random)."""

SHAPES = {
    "llama-8b": dict(architectures=["LlamaForCausalLM"], model_type="llama", hidden_size=4096,
                     intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=128256,
                     max_position_embeddings=131072, rms_norm_eps=1e-5, rope_theta=500000.0,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu",
                     torch_dtype="bfloat16",
                     rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "qwen3-8b": dict(architectures=["Qwen3ForCausalLM"], model_type="qwen3", hidden_size=4096,
                     intermediate_size=12288, num_hidden_layers=36, num_attention_heads=32,
                     num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     max_position_embeddings=40960, rms_norm_eps=1e-6, rope_theta=1000000.0,
                     tie_word_embeddings=False, bos_token_id=1, eos_token_id=2, hidden_act="silu",
                     torch_dtype="bfloat16"),
}


def randomize_(model, std: float = 0.02) -> None:
    """Random weights in place: norms at one, everything else normal(0, std). FP8 projections get e4m3
    values normal(0, 64) (clamped to 448) with every scale std / 64: the same weights in distribution."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif param.dtype == torch.float8_e4m3fn:
                param.copy_((torch.randn(param.shape, device=param.device) * 64).clamp(-448, 448))
            elif name.endswith("weight_scale"):
                param.fill_(std / 64)
            else:
                param.normal_(0.0, std)
