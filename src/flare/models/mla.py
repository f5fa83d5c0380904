"""Multi-head latent attention (DeepSeek-V2/V3) with the up-projections absorbed, over a latent cache.

transformers' DeepseekV2Attention computes, per token: queries `q_proj(x)` (or `q_b_proj(norm(q_a_proj(x)))`
with a query LoRA) split per head into a part without position (`qk_nope_head_dim`) and a rotary part
(`qk_rope_head_dim`); one compressed latent `c = norm(kv_a_proj(x)[:kv_lora_rank])` and one rotary key
`k_pe` shared by all heads; then each head's key `[W_UK c, k_pe]` and value `W_UV c`, both from
`kv_b_proj` ([heads x (nope + v), kv_lora_rank]).

Here nothing is expanded. The cache holds `[c, k_pe]` per token (flare.engine.mla_attention), and since
`q_nope . W_UK c = (W_UK^T q_nope) . c`, each head's query is taken into latent space once (`W_UK^T q_nope`)
and attends over the cached rows as one shared KV head; its output, a mix of latents, goes through W_UV
afterwards. Decode then reads `kv_lora_rank + qk_rope_head_dim` values per cached token and layer, for
every head at once. An FP8 checkpoint's kv_b_proj is dequantized to the serving dtype as it loads (the
absorbed products are small batched matmuls; `--online-mxfp8` never quantizes it).

The pieces V4-class models reuse: `MlaAttention` (projections, rotary, absorption, the backend call) and
the cache layout of flare.engine.mla_attention.
"""

from __future__ import annotations

import torch
from torch import nn

from flare.models.config import ModelConfig
from flare.models.layers import Linear, RMSNorm, plain_linear
from flare.models.rotary import apply_rotary_pairs

# transformers builds q_a_layernorm and kv_a_layernorm with DeepseekV2RMSNorm's default eps, not rms_norm_eps.
LATENT_NORM_EPS = 1e-6


class MlaAttention(nn.Module):
    """One layer's latent attention: `forward(hidden [T, hidden], cos, sin [T, rope] float32, kv_cache,
    meta) -> [T, hidden]`, projections named as the checkpoint names them under `prefix`."""

    def __init__(self, cfg: ModelConfig, backend, prefix: str) -> None:
        super().__init__()
        mla = cfg.mla
        self.cfg, self.mla, self.backend = cfg, mla, backend
        heads = cfg.num_attention_heads
        self.num_heads = heads
        if mla.q_lora_rank is None:
            self.q_proj = plain_linear(cfg.hidden_size, heads * mla.qk_head_dim,
                                       fp8=cfg.fp8_projection(prefix, ("q_proj",)))
        else:
            self.q_a_proj = plain_linear(cfg.hidden_size, mla.q_lora_rank, bias=cfg.qkv_bias,
                                         fp8=cfg.fp8_projection(prefix, ("q_a_proj",)))
            self.q_a_layernorm = RMSNorm(mla.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = plain_linear(mla.q_lora_rank, heads * mla.qk_head_dim,
                                         fp8=cfg.fp8_projection(prefix, ("q_b_proj",)))
        self.kv_a_proj_with_mqa = plain_linear(cfg.hidden_size, mla.latent_dim, bias=cfg.qkv_bias,
                                               fp8=cfg.fp8_projection(prefix, ("kv_a_proj_with_mqa",)))
        self.kv_a_layernorm = RMSNorm(mla.kv_lora_rank, LATENT_NORM_EPS)
        # Read as W_UK and W_UV in the serving dtype: FP8 only until `finish_loading` dequantizes it.
        self.kv_b_proj = plain_linear(mla.kv_lora_rank, heads * (mla.qk_nope_head_dim + mla.v_head_dim),
                                      fp8=cfg.fp8_projection(prefix, ("kv_b_proj",)))
        self.o_proj = plain_linear(heads * mla.v_head_dim, cfg.hidden_size, bias=cfg.o_bias,
                                   fp8=cfg.fp8_projection(prefix, ("o_proj",)))

    def finish_loading(self) -> None:
        """After the checkpoint is loaded: an FP8 kv_b_proj becomes its dequantized serving-dtype matrix."""
        if isinstance(self.kv_b_proj, Linear):
            return
        from flare.kernels.fp8_reference import dequantize

        fp8, layout = self.kv_b_proj, self.kv_b_proj.layout
        dense = dequantize(fp8.weight, fp8.weight_scale, layout.row_block, layout.col_block)
        dtype = self.kv_a_layernorm.weight.dtype
        linear = Linear(dense.shape[1], {None: dense.shape[0]})
        linear.weight.data = dense.to(device=fp8.weight.device, dtype=dtype)
        self.kv_b_proj = linear

    def queries(self, hidden: torch.Tensor) -> torch.Tensor:
        """[T, heads, qk_head_dim]: each head's query without position, then its rotary part (unrotated)."""
        if self.mla.q_lora_rank is None:
            q = self.q_proj(hidden)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(hidden)))
        return q.view(hidden.shape[0], self.num_heads, self.mla.qk_head_dim)

    def cache_rows(self, hidden: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        """[T, latent_dim]: what each token caches, its normed latent and its rotated key."""
        mla = self.mla
        latent, k_pe = self.kv_a_proj_with_mqa(hidden).split([mla.kv_lora_rank, mla.qk_rope_head_dim], dim=-1)
        k_pe = apply_rotary_pairs(k_pe[:, None, :], cos, sin, mla.rope_layout)[:, 0]
        return torch.cat([self.kv_a_layernorm(latent), k_pe], dim=-1)

    def forward(self, hidden, cos, sin, kv_cache, meta) -> torch.Tensor:
        mla, tokens = self.mla, hidden.shape[0]
        q_nope, q_pe = self.queries(hidden).split([mla.qk_nope_head_dim, mla.qk_rope_head_dim], dim=-1)
        q_pe = apply_rotary_pairs(q_pe, cos, sin, mla.rope_layout)
        up = self.kv_b_proj.weight.view(self.num_heads, mla.qk_nope_head_dim + mla.v_head_dim, mla.kv_lora_rank)
        w_uk, w_uv = up[:, :mla.qk_nope_head_dim], up[:, mla.qk_nope_head_dim:]
        q_latent = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)              # [T, heads, rank]
        query = torch.cat([q_latent, q_pe], dim=-1)
        key = self.cache_rows(hidden, cos, sin)[:, None, :]
        latent_out = self.backend.forward(query, key, key[..., :mla.kv_lora_rank], kv_cache, meta,
                                          mla.softmax_scale)                             # [T, heads, rank]
        out = torch.bmm(latent_out.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)  # [T, heads, v]
        return self.o_proj(out.reshape(tokens, self.num_heads * mla.v_head_dim))
