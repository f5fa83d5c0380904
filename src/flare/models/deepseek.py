"""DeepSeek-V2 and V3: pre-norm decoder layers of multi-head latent attention (flare.models.mla) and, from
`first_k_dense_replace` on, DeepSeekMoE (flare.models.deepseek_moe) in place of the SwiGLU MLP.

What the two versions differ in is read from config.json into `ModelConfig` (config._deepseek_*_fields):
V2's rotary pairs rotate as complex numbers in float32 and its router is a softmax top-k; V3 may add a
query LoRA, rotates pairs in the model dtype (`rope_interleave`) and routes by grouped sigmoid scores.
The checkpoint's multi-token-prediction layers (`model.layers.<num_hidden_layers>...`) are not part of
this model: they are the draft of flare.models.deepseek_mtp.
"""

from __future__ import annotations

import re

from torch import nn

from flare.models.causal_lm import CausalLM
from flare.models.config import ModelConfig
from flare.models.deepseek_moe import DeepseekMoeLayer
from flare.models.layers import Embedding, GatedMLP, LMHead, RMSNorm
from flare.models.mla import MlaAttention
from flare.models.rotary import RotaryEmbedding


_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def is_mtp_tensor(name: str, num_hidden_layers: int) -> bool:
    """A checkpoint tensor of a multi-token-prediction layer: `model.layers.<i>.*` past the decoder's layers."""
    match = _LAYER_INDEX.match(name)
    return match is not None and int(match.group(1)) >= num_hidden_layers


class DeepseekDecoderLayer(nn.Module):
    def __init__(self, cfg: ModelConfig, backend, index: int, prefix: str, moe: bool | None = None) -> None:
        """`moe`: whether the layer's MLP is DeepSeekMoE (default: from `first_k_dense_replace`)."""
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.self_attn = MlaAttention(cfg, backend, f"{prefix}.self_attn")
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        if moe is None:
            moe = index >= cfg.deepseek_moe.first_dense_layers
        if moe:
            self.mlp = DeepseekMoeLayer(cfg, f"{prefix}.mlp")
        else:
            self.mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size,
                                cfg.fp8_projection(f"{prefix}.mlp", ("gate_proj", "up_proj")),
                                cfg.fp8_projection(f"{prefix}.mlp", ("down_proj",)))

    def forward(self, hidden, cos, sin, kv_cache, meta):
        hidden = hidden + self.self_attn(self.input_layernorm(hidden), cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class DeepseekModel(nn.Module):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.embed_tokens = Embedding(cfg.vocab_size, cfg.hidden_size)
        # The rotary part is qk_rope_head_dim wide (ModelConfig.head_dim for MLA, as transformers sets it).
        self.rotary_emb = RotaryEmbedding(cfg.head_dim, cfg.rope, cfg.max_position_embeddings)
        self.layers = nn.ModuleList(DeepseekDecoderLayer(cfg, backend, index, f"model.layers.{index}")
                                    for index in range(cfg.num_hidden_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, input_ids, positions, kv_caches, meta):
        dynamic = self.rotary_emb.rope.kind == "dynamic"
        cos, sin = self.rotary_emb(positions, meta.token_seq_lens() if dynamic else None)   # float32
        hidden = self.embed_tokens(input_ids)
        for layer, kv_cache in zip(self.layers, kv_caches, strict=True):
            hidden = layer(hidden, cos, sin, kv_cache, meta)
        return self.norm(hidden)


class DeepseekV2ForCausalLM(CausalLM):
    def __init__(self, cfg: ModelConfig, backend) -> None:
        super().__init__()
        self.cfg = cfg
        self.model = DeepseekModel(cfg, backend)
        tied = self.model.embed_tokens if cfg.tie_word_embeddings else None
        self.lm_head = LMHead(cfg.vocab_size, cfg.hidden_size, tied_to=tied)

    def loads_elsewhere(self, name: str) -> bool:
        return is_mtp_tensor(name, self.cfg.num_hidden_layers)


class DeepseekV3ForCausalLM(DeepseekV2ForCausalLM):
    """Built from `ModelConfig` with V3's routing, rotary layout and optional query LoRA."""
