"""Llama: pre-norm decoder layers of grouped-query attention with rotary positions and a SwiGLU MLP.

Qwen2, Qwen3 and Mistral share this layout; what differs (biases, q/k norms, defaults) is read from
config.json into `ModelConfig` and switched on here.
"""

from __future__ import annotations

import torch
from torch import nn

from flare.models.causal_lm import CausalLM
from flare.models.config import ModelConfig
from flare.models.layers import LMHead, Embedding, GatedMLP, RMSNorm, plain_linear, qkv_linear
from flare.models.rotary import RotaryEmbedding, apply_rotary


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, prefix: str) -> None:
        super().__init__()
        self.cfg, self.backend = cfg, backend
        self.scale = cfg.head_dim**-0.5
        self.qkv_proj = qkv_linear(cfg.hidden_size, cfg.q_size, cfg.kv_size, bias=cfg.qkv_bias,
                                   fp8=cfg.fp8_projection(prefix, ("q_proj", "k_proj", "v_proj")))
        self.o_proj = plain_linear(cfg.q_size, cfg.hidden_size, bias=cfg.o_bias,
                                   fp8=cfg.fp8_projection(prefix, ("o_proj",)))
        if cfg.qk_norm:  # Qwen3: RMSNorm over each head of q and k, before the rotation
            self.q_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(cfg.head_dim, cfg.rms_norm_eps)

    def forward(self, hidden, cos, sin, kv_cache, meta) -> torch.Tensor:
        cfg, tokens = self.cfg, hidden.shape[0]
        q, k, v = self.qkv_proj(hidden).split([cfg.q_size, cfg.kv_size, cfg.kv_size], dim=-1)
        q = q.view(tokens, cfg.num_attention_heads, cfg.head_dim)
        k = k.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        v = v.view(tokens, cfg.num_key_value_heads, cfg.head_dim)
        if cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rotary(q, cos, sin), apply_rotary(k, cos, sin)
        out = self.backend.forward(q, k, v, kv_cache, meta, self.scale)
        return self.o_proj(out.reshape(tokens, cfg.q_size))


class LlamaDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, prefix: str) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = LlamaAttention(cfg, backend, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                            cfg.fp8_projection(f"{prefix}.mlp", ("gate_proj", "up_proj")),
                            cfg.fp8_projection(f"{prefix}.mlp", ("down_proj",)))

    def forward(self, hidden, cos, sin, kv_cache, meta) -> torch.Tensor:
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class LlamaModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        # Layers are named as in the checkpoint, so config.json's FP8 skip lists can name them.
        self.layers = nn.ModuleList(LlamaDecoderLayer(cfg, backend, f"model.layers.{index}")
                                    for index in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    # Layers whose input residual stream an EAGLE-3 head reads (flare.models.eagle3); empty: none. Each
    # forward then leaves them side by side in `aux_hidden` [T, 3 x hidden].
    aux_layers: tuple[int, ...] = ()
    aux_hidden: torch.Tensor | None = None

    def forward(self, input_ids, positions, kv_caches, meta) -> torch.Tensor:
        dynamic = self.rotary_emb.rope.kind == "dynamic"
        cos, sin = self.rotary_emb(positions, meta.token_seq_lens() if dynamic else None)
        hidden = self.embed_tokens(input_ids)
        cos, sin = cos.to(hidden.dtype), sin.to(hidden.dtype)  # once for all layers, as transformers rounds them
        aux = []
        for index, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            if index in self.aux_layers:
                aux.append(hidden)
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        if aux:
            self.aux_hidden = torch.cat(aux, dim=-1)
        return self.norm(hidden)


class LlamaForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = LlamaModel(cfg, backend)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)
