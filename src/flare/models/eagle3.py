"""EAGLE-3 draft heads (Li et al. 2025), in the layout their public checkpoints use.

A head drafts from the target's own hidden states: the residual stream entering three target layers
(low, middle, high; by default layers 2, L // 2 and L - 3 of L, as vLLM and SGLang take them, or the
config's `eagle_config.eagle_aux_hidden_state_layer_ids`) is concatenated and projected by `fc` to the
head's width. One decoder layer then reads, at each position, the embedding of the next token beside
that feature (its attention's q/k/v projections take both, 2 x hidden wide, each normalised first:
`input_layernorm` for the embedding, `hidden_norm` for the feature), and `lm_head` scores a reduced
draft vocabulary whose entry i is target token i + d2t[i]. Drafting further, the head feeds its own
output (before the final norm) back as the next position's feature.

Checkpoint tensors (config.json `architectures: ["LlamaForCausalLMEagle3"]`, `draft_vocab_size`,
optionally `target_hidden_size` and `norm_before_residual`): `midlayer.{input_layernorm, hidden_norm,
post_attention_layernorm}.weight`, `midlayer.self_attn.{q,k,v,o}_proj.weight`,
`midlayer.mlp.{gate,up,down}_proj.weight`, `fc.weight` [hidden, 3 x target hidden], `norm.weight`,
`lm_head.weight` [draft vocab, hidden], `d2t` [draft vocab] int64, `t2d` [target vocab] bool (not
needed: it is d2t's image), and `embed_tokens.weight` when the head does not share the target's.
This is the layout vLLM's and SGLang's loaders read (vllm/model_executor/models/llama_eagle3.py).
Flare reads safetensors only; a head published as a pickle (pytorch_model.bin) must be converted first.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from flare.models.causal_lm import CausalLM
from flare.models.config import ModelConfig
from flare.models.errors import UnsupportedModel, WeightError
from flare.models.layers import Embedding, GatedMLP, RMSNorm, _parameter, plain_linear, qkv_linear
from flare.models.llama import LlamaAttention
from flare.models.rotary import RotaryEmbedding

ARCHITECTURE = "LlamaForCausalLMEagle3"


@dataclass(frozen=True)
class Eagle3Config:
    """What an EAGLE-3 head's config.json says beyond a Llama layer's geometry."""

    layer: ModelConfig                  # the decoder layer's geometry (vocab_size: the target's)
    draft_vocab_size: int
    target_hidden_size: int
    norm_before_residual: bool
    aux_layer_ids: tuple[int, ...] | None   # None: the default for the target's depth

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any]) -> Eagle3Config:
        if ARCHITECTURE not in (hf.get("architectures") or []):
            raise UnsupportedModel(f"an EAGLE-3 head's config.json names {ARCHITECTURE}; this one names "
                                   f"{hf.get('architectures')}")
        if hf.get("num_hidden_layers", 1) != 1:
            raise UnsupportedModel(f"EAGLE-3 heads with {hf['num_hidden_layers']} decoder layers are not supported; "
                                   "the published heads have one")
        layer = ModelConfig.from_hf_config({**hf, "architectures": ["LlamaForCausalLM"], "model_type": "llama"})
        aux = (hf.get("eagle_config") or {}).get("eagle_aux_hidden_state_layer_ids")
        return cls(layer=layer, draft_vocab_size=int(hf.get("draft_vocab_size") or layer.vocab_size),
                   target_hidden_size=int(hf.get("target_hidden_size") or layer.hidden_size),
                   norm_before_residual=bool(hf.get("norm_before_residual", False)),
                   aux_layer_ids=tuple(aux) if aux else None)

    def aux_layers(self, target_layers: int) -> tuple[int, ...]:
        """The target layers whose input residual stream the head reads."""
        ids = self.aux_layer_ids or (2, target_layers // 2, target_layers - 3)
        if len(ids) != 3 or not all(0 <= i < target_layers for i in ids):
            raise UnsupportedModel(f"EAGLE-3 reads three target layers, 0 through {target_layers - 1}; "
                                   f"this head names {list(ids)}")
        return tuple(ids)


class Eagle3Layer(nn.Module):
    """The head's one decoder layer: attention over [norm(embedding), norm(feature)], then a SwiGLU MLP."""

    def __init__(self, cfg: Eagle3Config, backend) -> None:
        super().__init__()
        layer = cfg.layer
        self.norm_before_residual = cfg.norm_before_residual
        self.input_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.hidden_norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.self_attn = LlamaAttention(layer, backend, "midlayer.self_attn")
        self.self_attn.qkv_proj = qkv_linear(2 * layer.hidden_size, layer.q_size, layer.kv_size, bias=False)
        self.post_attention_layernorm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.mlp = GatedMLP(layer.hidden_size, layer.intermediate_size)

    def forward(self, embeds, features, cos, sin, kv_cache, meta) -> torch.Tensor:
        normed = self.hidden_norm(features)
        residual = normed if self.norm_before_residual else features
        hidden = torch.cat([self.input_layernorm(embeds), normed], dim=-1)
        hidden = residual + self.self_attn(hidden, cos, sin, kv_cache, meta)
        return hidden + self.mlp(self.post_attention_layernorm(hidden))


class Eagle3Draft(CausalLM):
    """`forward(input_ids, positions, features, kv_caches, meta) -> (normed, prenorm)`: features are `fc`
    of the target's three layers (`combine`) or the head's own previous prenorm output."""

    def __init__(self, cfg: Eagle3Config, backend, own_embedding: bool = True) -> None:
        super().__init__()
        layer = cfg.layer
        self.cfg = cfg
        self.embed_tokens = Embedding(layer.vocab_size, layer.hidden_size) if own_embedding else None
        self.shared_embedding: list[Embedding] = []         # the target's, when the head has none
        self.rotary_emb = RotaryEmbedding(layer.head_dim, layer.rope, layer.max_position_embeddings)
        self.fc = plain_linear(3 * cfg.target_hidden_size, layer.hidden_size)
        self.midlayer = Eagle3Layer(cfg, backend)
        self.norm = RMSNorm(layer.hidden_size, layer.rms_norm_eps)
        self.lm_head = plain_linear(layer.hidden_size, cfg.draft_vocab_size)
        self.d2t = _parameter(cfg.draft_vocab_size, dtype=torch.int64)

    def share_embedding(self, embedding: Embedding) -> None:
        """Use the target's token embedding (a head that ships none)."""
        if self.embed_tokens is not None:
            raise ValueError("this head has its own embedding")
        self.shared_embedding = [embedding]

    def combine(self, aux_hidden: torch.Tensor) -> torch.Tensor:
        """[T, 3 x target hidden] -> the features the layer reads."""
        return self.fc(aux_hidden)

    def forward(self, input_ids, positions, features, kv_caches, meta):
        embedding = self.embed_tokens if self.embed_tokens is not None else self.shared_embedding[0]
        embeds = embedding(input_ids)
        cos, sin = self.rotary_emb(positions, None)
        cos, sin = cos.to(embeds.dtype), sin.to(embeds.dtype)
        prenorm = self.midlayer(embeds, features.to(embeds.dtype), cos, sin, kv_caches[0], meta)
        return self.norm(prenorm), prenorm

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """float32 logits over the target's vocabulary: -inf for tokens outside the draft vocabulary."""
        draft = self.lm_head(hidden).float()
        full = draft.new_full((draft.shape[0], self.cfg.layer.vocab_size), float("-inf"))
        targets = torch.arange(self.cfg.draft_vocab_size, device=draft.device) + self.d2t
        return full.index_copy_(1, targets, draft)

    @torch.no_grad()
    def load_hf_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """The checkpoint's tensors (see the module docstring); d2t must map into the target vocabulary."""
        super().load_hf_weights((name, tensor) for name, tensor in weights if name != "t2d")
        targets = torch.arange(self.cfg.draft_vocab_size, device=self.d2t.device) + self.d2t
        if targets.min() < 0 or targets.max() >= self.cfg.layer.vocab_size or targets.unique().numel() != targets.numel():
            raise WeightError(f"the head's d2t maps its {self.cfg.draft_vocab_size} draft tokens outside the target's "
                              f"{self.cfg.layer.vocab_size}-token vocabulary or onto one token twice")


def build_eagle3(cfg: Eagle3Config, tensor_names: Iterable[str], dtype, device, backend) -> Eagle3Draft:
    """An unloaded head; it owns an embedding only when its checkpoint stores one."""
    own = "embed_tokens.weight" in set(tensor_names)
    with torch.device(device):
        previous = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            head = Eagle3Draft(cfg, backend, own_embedding=own)
        finally:
            torch.set_default_dtype(previous)
    head.d2t.data = torch.zeros(cfg.draft_vocab_size, dtype=torch.int64, device=device)
    return head.eval()
