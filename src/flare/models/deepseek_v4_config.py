"""DeepSeek V4's config.json, read as transformers' `DeepseekV4Config` reads it, into a frozen layout.

What V4 adds to a decoder (the paper's section 2; transformers' `models/deepseek_v4`):
* each layer's attention type (`layer_types`, or the older `compress_ratios` of 0 / 4 / 128): sliding-window
  attention only; compressed sparse attention (CSA: every `m` = 4 tokens pooled into one entry, a lightning
  indexer choosing the top-k entries per query); heavily compressed attention (HCA: every 128 tokens pooled,
  all entries read). Every type also reads the last `sliding_window` tokens;
* one KV head of `head_dim` (512) read as both key and value, rotary on its last `rope_head_dim` (64)
  channels, query LoRA (`q_lora_rank`), a grouped low-rank output projection (`o_groups` x `o_lora_rank`)
  and a learned attention sink per head;
* `hc_mult` residual streams mixed by manifold-constrained hyper-connections (Sinkhorn iterations);
* mixture-of-experts feed-forward layers routed by a token-id table (`hash_moe`, the first `num_hash_layers`)
  or by top-k over `scoring_func` scores (`moe`), both with one shared expert and a SwiGLU clip;
* two rotary embeddings: "main" (plain, `rope_theta`) for sliding layers, "compress" (`compress_rope_theta`,
  YaRN when `rope_scaling` says so, cos/sin unscaled) for compressed layers and their compressors.

Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping

from flare.models.errors import UnsupportedModel

SLIDING = "sliding_attention"
CSA = "compressed_sparse_attention"
HCA = "heavily_compressed_attention"
LAYER_TYPES = (SLIDING, CSA, HCA)
HASH_MOE, TOPK_MOE = "hash_moe", "moe"
_LAYER_TYPE_OF_RATIO = {0: SLIDING, 4: CSA, 128: HCA}
DEFAULT_RATES = {CSA: 4, HCA: 128}
DEFAULT_HASH_LAYERS = 3
SCORING_FUNCTIONS = ("sqrtsoftplus", "sigmoid")
ROPE_KINDS = ("default", "yarn")


@dataclass(frozen=True)
class V4Rope:
    """One of V4's two rotary embeddings, on the last `dim` channels of a head, pairs interleaved."""

    theta: float
    dim: int
    kind: str = "default"                   # "default" or "yarn"
    factor: float = 1.0
    original_max_positions: int | None = None
    beta_fast: float | None = None
    beta_slow: float | None = None
    attention_factor: float = 1.0           # scales cos and sin; V4's compress rope keeps 1.0
    truncate: bool = True


@dataclass(frozen=True)
class DeepseekV4Layout:
    layer_types: tuple[str, ...]
    mlp_layer_types: tuple[str, ...]
    compress_rates: tuple[tuple[str, int], ...]     # (layer type, tokens pooled per entry) for CSA and HCA
    q_lora_rank: int
    o_groups: int
    o_lora_rank: int
    sliding_window: int
    index_heads: int
    index_head_dim: int
    index_topk: int
    hc_mult: int
    hc_sinkhorn_iters: int
    hc_eps: float
    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    scoring_func: str
    routed_scaling_factor: float
    swiglu_limit: float
    main_rope: V4Rope
    compress_rope: V4Rope
    num_mtp_layers: int = 0
    expert_dtype: str = "auto"                      # "fp4" / "fp8": the checkpoint's routed experts

    @property
    def rope_dim(self) -> int:
        return self.main_rope.dim

    def rate(self, layer_type: str) -> int:
        """Tokens one compressed entry pools for `layer_type`; 0 for sliding-window attention."""
        return dict(self.compress_rates).get(layer_type, 0)

    def layer_rate(self, layer: int) -> int:
        return self.rate(self.layer_types[layer])

    def rope_for(self, layer_type: str) -> V4Rope:
        return self.main_rope if layer_type == SLIDING else self.compress_rope


def deepseek_v4_fields(hf: Mapping[str, Any]) -> dict:
    """The ModelConfig fields of a DeepseekV4ForCausalLM config.json (`v4` holds the layout)."""
    layers = _positive(hf, "num_hidden_layers", None)
    heads = _positive(hf, "num_attention_heads", 64)
    head_dim = _positive(hf, "head_dim", 512)
    kv_heads = hf.get("num_key_value_heads", 1)
    if kv_heads != 1:
        # transformers reads one KV head whatever this says (its kv_proj projects to head_dim); a config
        # saying otherwise is read the same way, and the cache holds one head.
        kv_heads = 1
    for key, expected in (("attention_bias", False), ("mlp_bias", False), ("tie_word_embeddings", False)):
        if bool(hf.get(key, expected)) != expected:
            raise UnsupportedModel(f"this DeepSeek V4 checkpoint sets {key} {hf.get(key)}; V4 has none")
    if hf.get("n_shared_experts", 1) != 1:
        raise UnsupportedModel(f"n_shared_experts {hf.get('n_shared_experts')}: DeepSeek V4 runs one shared expert "
                               "of moe_intermediate_size (as transformers builds it)")
    if not hf.get("norm_topk_prob", True):
        raise UnsupportedModel("norm_topk_prob false is not supported: DeepSeek V4 normalises its routed weights")
    scoring = hf.get("scoring_func", "sqrtsoftplus")
    if scoring not in SCORING_FUNCTIONS:
        raise UnsupportedModel(f"scoring_func {scoring!r} is not supported; DeepSeek V4 routes with "
                               f"{' or '.join(SCORING_FUNCTIONS)}")
    partial = hf.get("partial_rotary_factor")
    if partial is None:
        partial = hf["qk_rope_head_dim"] / head_dim if hf.get("qk_rope_head_dim") else 64 / 512
    rope_dim = int(head_dim * partial)
    if rope_dim % 2 or not 0 < rope_dim <= head_dim:
        raise UnsupportedModel(f"a rotary part of {rope_dim} channels of head_dim {head_dim} is not supported")
    rates = _compress_rates(hf)
    layout = DeepseekV4Layout(
        layer_types=_layer_types(hf, layers),
        mlp_layer_types=_mlp_layer_types(hf, layers),
        compress_rates=tuple(sorted(rates.items())),
        q_lora_rank=_positive(hf, "q_lora_rank", 1024),
        o_groups=_positive(hf, "o_groups", 8),
        o_lora_rank=_positive(hf, "o_lora_rank", 1024),
        sliding_window=_positive(hf, "sliding_window", 128),
        index_heads=_positive(hf, "index_n_heads", 64),
        index_head_dim=_positive(hf, "index_head_dim", 128),
        index_topk=_positive(hf, "index_topk", 512),
        hc_mult=_positive(hf, "hc_mult", 4),
        hc_sinkhorn_iters=_positive(hf, "hc_sinkhorn_iters", 20),
        hc_eps=float(hf.get("hc_eps", 1e-6)),
        num_experts=_positive(hf, "n_routed_experts", 256),
        experts_per_token=_positive(hf, "num_experts_per_tok", 6),
        moe_intermediate_size=_positive(hf, "moe_intermediate_size", 2048),
        scoring_func=scoring,
        routed_scaling_factor=float(hf.get("routed_scaling_factor", 1.5)),
        swiglu_limit=float(hf.get("swiglu_limit", 10.0)),
        main_rope=_main_rope(hf, rope_dim),
        compress_rope=_compress_rope(hf, rope_dim),
        num_mtp_layers=int(hf.get("num_nextn_predict_layers", 0) or 0),
        expert_dtype=_expert_dtype(hf),
    )
    _check_widths(layout, heads, head_dim)
    return {"num_key_value_heads": kv_heads, "head_dim": head_dim, "intermediate_size": layout.moe_intermediate_size,
            "v4": layout}


def _positive(hf: Mapping[str, Any], key: str, default: int | None) -> int:
    value = hf.get(key, default)
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UnsupportedModel(f"config.json's {key} {value!r} is not a positive integer")
    return value


def _compress_rates(hf: Mapping[str, Any]) -> dict[str, int]:
    rates = dict(DEFAULT_RATES)
    rates.update(hf.get("compress_rates") or {})
    for key, layer_type in (("compress_rate_csa", CSA), ("compress_rate_hca", HCA)):
        if hf.get(key) is not None:
            rates[layer_type] = hf[key]
    for layer_type, rate in rates.items():
        if layer_type not in (CSA, HCA) or not isinstance(rate, int) or rate < 1:
            raise UnsupportedModel(f"compress_rates {dict(rates)}: each of {CSA} and {HCA} pools a positive "
                                   "number of tokens")
    return rates


def _layer_types(hf: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    """Explicit `layer_types`, else the older per-layer `compress_ratios`, else transformers' default
    (two HCA layers, then CSA and HCA alternating); cut to the layer count as transformers cuts them."""
    types = hf.get("layer_types")
    if types is None and hf.get("compress_ratios") is not None:
        ratios = list(hf["compress_ratios"])
        unknown = sorted({ratio for ratio in ratios if ratio not in _LAYER_TYPE_OF_RATIO})
        if unknown:
            raise UnsupportedModel(f"compress_ratios {unknown}: DeepSeek V4 layers pool 0, 4 or 128 tokens")
        types = [_LAYER_TYPE_OF_RATIO[ratio] for ratio in ratios]
    if types is None:
        types = [HCA] * min(layers, 2) + [CSA if i % 2 else HCA for i in range(max(layers - 2, 0))]
    types = tuple(types[:layers])
    if len(types) != layers or any(kind not in LAYER_TYPES for kind in types):
        raise UnsupportedModel(f"layer_types {list(types)}: one of {', '.join(LAYER_TYPES)} for each of the "
                               f"{layers} layers")
    return types


def _mlp_layer_types(hf: Mapping[str, Any], layers: int) -> tuple[str, ...]:
    types = hf.get("mlp_layer_types")
    if types is None:
        hashed = hf.get("num_hash_layers", DEFAULT_HASH_LAYERS)
        types = [HASH_MOE] * min(layers, hashed) + [TOPK_MOE] * max(0, layers - hashed)
    types = tuple(types[:layers])
    if len(types) != layers or any(kind not in (HASH_MOE, TOPK_MOE) for kind in types):
        raise UnsupportedModel(f"mlp_layer_types {list(types)}: {HASH_MOE} or {TOPK_MOE} for each of the "
                               f"{layers} layers")
    return types


def _main_rope(hf: Mapping[str, Any], dim: int) -> V4Rope:
    nested = _nested_rope(hf)
    params = nested[0] if nested else {"rope_type": "default", "rope_theta": hf.get("rope_theta", 10_000.0)}
    return _rope(params, dim, hf)


def _compress_rope(hf: Mapping[str, Any], dim: int) -> V4Rope:
    """The compress rope: the checkpoint's flat rope parameters (YaRN for V4-Flash) at compress_rope_theta,
    cos and sin unscaled unless the checkpoint says otherwise (transformers sets attention_factor 1.0)."""
    nested = _nested_rope(hf)
    if nested:
        return _rope(nested[1], dim, hf)
    flat = {key: value for key, value in dict(hf.get("rope_parameters") or hf.get("rope_scaling") or {}).items()
            if key not in ("main", "compress")}
    params = {**flat, "rope_theta": hf.get("compress_rope_theta", 160_000.0)}
    params["rope_type"] = params.get("rope_type", params.get("type", "default"))
    if params["rope_type"] == "yarn":
        params.setdefault("attention_factor", 1.0)
    return _rope(params, dim, hf)


def _nested_rope(hf: Mapping[str, Any]) -> tuple[Mapping, Mapping] | None:
    params = hf.get("rope_parameters") or {}
    if isinstance(params.get("main"), Mapping) and isinstance(params.get("compress"), Mapping):
        return params["main"], params["compress"]
    return None


def _rope(params: Mapping[str, Any], dim: int, hf: Mapping[str, Any]) -> V4Rope:
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise UnsupportedModel(f"DeepSeek V4 rotary type {kind!r} is not supported; supported: {', '.join(ROPE_KINDS)}")
    theta = float(params["rope_theta"])
    if kind == "default":
        return V4Rope(theta=theta, dim=dim)
    original = params.get("original_max_position_embeddings")
    if original is None:
        raise UnsupportedModel("this DeepSeek V4 YaRN rotary names no original_max_position_embeddings")
    factor = params.get("factor")
    if factor is None:
        factor = hf["max_position_embeddings"] / original
    attention = params.get("attention_factor")
    if attention is None:
        raise UnsupportedModel("a DeepSeek V4 YaRN rotary without attention_factor is not supported")
    return V4Rope(theta=theta, dim=dim, kind="yarn", factor=float(factor), original_max_positions=int(original),
                  beta_fast=params.get("beta_fast"), beta_slow=params.get("beta_slow"),
                  attention_factor=float(attention), truncate=bool(params.get("truncate", True)))


def _expert_dtype(hf: Mapping[str, Any]) -> str:
    quantization = hf.get("quantization_config") or {}
    value = hf.get("expert_dtype") or (quantization.get("expert_dtype") if isinstance(quantization, Mapping) else None)
    if value not in (None, "fp4", "fp8"):
        raise UnsupportedModel(f"expert_dtype {value!r}: DeepSeek V4 experts are fp4 or fp8")
    return value or "auto"


def _check_widths(layout: DeepseekV4Layout, heads: int, head_dim: int) -> None:
    if heads * head_dim % layout.o_groups:
        raise UnsupportedModel(f"o_groups {layout.o_groups} does not divide the {heads} x {head_dim} attention output")
    if layout.rope_dim > layout.index_head_dim and CSA in layout.layer_types:
        raise UnsupportedModel(f"the indexer's head ({layout.index_head_dim}) is narrower than the rotary part "
                               f"({layout.rope_dim})")
    if layout.experts_per_token > layout.num_experts:
        raise UnsupportedModel(f"num_experts_per_tok {layout.experts_per_token} exceeds n_routed_experts "
                               f"{layout.num_experts}")
