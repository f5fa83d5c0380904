"""`ModelConfig`: what the model code needs from a checkpoint's config.json, read once and frozen.

Each family's reading mirrors what `transformers` does with the same file, so that a checkpoint means
the same thing here as there. Anything we cannot run faithfully is refused with `UnsupportedModel`.
Importing this module does not import torch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from flare.models.deepseek_v4_config import DeepseekV4Layout, deepseek_v4_fields
from flare.models.errors import UnsupportedModel
from flare.models.quantization import Fp8Weights, check_kv_cache_dtype, fp8_weights_of, online_fp8

ROPE_KINDS = ("default", "linear", "dynamic", "yarn", "llama3")
DEFAULT_ROPE_THETA = 10_000.0


@dataclass(frozen=True)
class RopeConfig:
    """Rotary embedding parameters after transformers' standardisation of `rope_scaling`/`rope_parameters`."""

    kind: str = "default"
    theta: float = DEFAULT_ROPE_THETA
    factor: float = 1.0
    original_max_positions: int | None = None  # llama3 and yarn: the pretraining context
    low_freq_factor: float | None = None  # llama3
    high_freq_factor: float | None = None  # llama3
    attention_factor: float | None = None  # yarn: scales cos and sin; None derives it from factor and mscale
    beta_fast: float | None = None  # yarn
    beta_slow: float | None = None  # yarn
    mscale: float | None = None  # yarn
    mscale_all_dim: float | None = None  # yarn
    truncate: bool = True  # yarn


@dataclass(frozen=True)
class MlaConfig:
    """Multi-head latent attention (DeepSeek-V2/V3), as transformers' DeepseekV2Attention computes it.

    Keys and values of every head come from one compressed latent per token (`kv_lora_rank` wide,
    RMS-normed) through `kv_b_proj`; a `qk_rope_head_dim` key part carries the rotary position and is
    shared by all heads. What a token leaves in the cache is that latent and that rotary key:
    `latent_dim` values per layer (flare.engine.mla_attention).
    """

    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    q_lora_rank: int | None         # None: queries through one q_proj (V2-Lite); else q_a_proj, norm, q_b_proj
    # How the rotary part is rotated: "complex" (V2: pairs (x0, x1), (x2, x3) rotated in float32, output
    # interleaved), "interleaved" (V3's rope_interleave: pairs rotated in the model dtype, output with the
    # even results first), "half" (V3 without rope_interleave: the usual rotate-half).
    rope_layout: str
    softmax_scale: float            # qk_head_dim^-0.5, times YaRN's mscale_all_dim correction squared

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def latent_dim(self) -> int:
        """Values one token caches per layer: the latent and the rotary key (576 for V3's shapes)."""
        return self.kv_lora_rank + self.qk_rope_head_dim


@dataclass(frozen=True)
class DeepseekMoe:
    """DeepSeekMoE routing and experts (transformers' DeepseekV2TopkRouter / DeepseekV3TopkRouter).

    Layers from `first_dense_layers` on replace the MLP with `num_experts` routed experts (each token
    takes `experts_per_token` of them) beside `num_shared_experts` experts every token takes, run as one
    MLP `num_shared_experts` x `moe_intermediate_size` wide.
    """

    num_experts: int
    experts_per_token: int
    moe_intermediate_size: int
    num_shared_experts: int
    first_dense_layers: int
    # "softmax_greedy" (V2 greedy: top-k of the softmax), "softmax_group_limited" (V2
    # group_limited_greedy: top-k within the `groups_per_token` groups of the highest expert score),
    # "sigmoid_grouped" (V3: sigmoid scores plus e_score_correction_bias choose, within the groups of the
    # highest two-expert sums; the weights are the sigmoid scores without the bias)
    method: str
    num_groups: int
    groups_per_token: int
    normalize: bool                 # norm_topk_prob: chosen weights divided by their sum (V3)
    scaling_factor: float           # routed_scaling_factor, multiplied into the chosen weights


@dataclass(frozen=True)
class AttentionShape:
    """What one layer's attention call sees: `num_heads` queries of `qk_dim`, `num_kv_heads` keys of
    `qk_dim` and values of `v_dim`; the output has `num_heads` x `v_dim`. MLA in its absorbed form is one
    KV head whose key is the cached latent and rotary key, and whose value is the latent."""

    num_heads: int
    qk_dim: int
    num_kv_heads: int
    v_dim: int


@dataclass(frozen=True)
class ModelConfig:
    architecture: str
    family: str
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False
    bos_token_id: int | None = None
    eos_token_ids: tuple[int, ...] = ()
    torch_dtype: str | None = None
    fp8: Fp8Weights | None = None         # where projections are FP8 (checkpoint or online); None: none are
    kv_cache_dtype: str = "auto"          # "auto" (the serving dtype) or "fp8" (see flare.models.quantization)
    mla: MlaConfig | None = None          # DeepSeek's latent attention; None: grouped-query attention
    deepseek_moe: DeepseekMoe | None = None
    mtp_layers: int = 0                   # num_nextn_predict_layers: MTP modules after the decoder layers
    v4: DeepseekV4Layout | None = None    # DeepSeek V4's attention types, hyper-connections and experts

    @property
    def attention(self) -> AttentionShape:
        if self.mla is not None:
            return AttentionShape(self.num_attention_heads, self.mla.latent_dim, 1, self.mla.kv_lora_rank)
        return AttentionShape(self.num_attention_heads, self.head_dim, self.num_key_value_heads, self.head_dim)

    @property
    def q_size(self) -> int:
        return self.num_attention_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_key_value_heads * self.head_dim

    def fp8_projection(self, module: str, projections: tuple[str, ...]) -> Fp8Weights | None:
        """The FP8 layout of the projections `module.<name>` that one fused layer holds, or None when they
        are unquantized; refuses a checkpoint that quantizes some of them and not others."""
        if self.fp8 is None:
            return None
        quantized = {self.fp8.quantizes(f"{module}.{name}") for name in projections}
        if len(quantized) > 1:
            raise UnsupportedModel(f"this checkpoint quantizes some of {module}'s {', '.join(projections)} to FP8 "
                                   "and not the others; they run as one matrix product, so all or none must be")
        return self.fp8 if quantized.pop() else None

    @classmethod
    def from_hf_config(cls, hf: dict[str, Any], *, online_fp8: tuple[str, ...] = (),
                       kv_cache_dtype: str = "auto") -> ModelConfig:
        """Read a config.json dict; raise `UnsupportedModel` for what these models cannot run.

        `online_fp8` and `kv_cache_dtype` are the preparation's choices (recorded in the package plan):
        the decoder projections (q_proj, ...) stored as FP8 at export, and the KV cache's format."""
        architecture = _architecture(hf)
        family = FAMILY_OF_ARCHITECTURE[architecture]
        for key in ("hidden_size", "num_hidden_layers", "num_attention_heads", "max_position_embeddings"):
            _required(hf, key)
        _require_common_features(hf)
        heads = hf["num_attention_heads"]
        fields = FAMILY_FIELDS[family](hf)
        if fields.get("v4") is not None and kv_cache_dtype == "fp8":
            raise UnsupportedModel("--kv-cache-dtype fp8 is not supported for DeepSeek V4: its compressed cache stays "
                                   "in the serving dtype")
        fields.setdefault("head_dim", hf.get("head_dim") or hf["hidden_size"] // heads)
        return cls(
            architecture=architecture,
            family=family,
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=fields.pop("num_key_value_heads", None) or hf.get("num_key_value_heads") or heads,
            intermediate_size=fields.pop("intermediate_size", None) or _required(hf, "intermediate_size"),
            vocab_size=_required(hf, "vocab_size"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=fields.pop("rope", None) or rope_config(hf),
            max_position_embeddings=hf["max_position_embeddings"],
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            bos_token_id=hf.get("bos_token_id"),
            eos_token_ids=_token_ids(hf.get("eos_token_id")),
            torch_dtype=hf.get("dtype") or hf.get("torch_dtype"),
            fp8=_fp8_weights(hf, online_fp8),
            kv_cache_dtype=check_kv_cache_dtype(kv_cache_dtype),
            **fields,
        )


# ---- families: what each one's config.json means (as in transformers' modeling_<family>.py) ----


def _llama_fields(hf: dict) -> dict:
    # LlamaAttention gives q/k/v and o the same `attention_bias`; LlamaMLP's `mlp_bias` we do not implement.
    if hf.get("mlp_bias"):
        raise UnsupportedModel("this checkpoint sets mlp_bias, which is not supported; only bias-free MLPs run")
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias}


def _mistral_fields(hf: dict) -> dict:
    # MistralAttention has no biases and applies `sliding_window` whenever it is set.
    _refuse_sliding_window(hf, window=hf.get("sliding_window", 4096), sliding_layers=hf["num_hidden_layers"])
    return {}


def _qwen2_fields(hf: dict) -> dict:
    # Qwen2Attention always has q/k/v biases and no o_proj bias.
    _refuse_qwen_sliding_window(hf)
    return {"qkv_bias": True}


def _qwen3_fields(hf: dict) -> dict:
    # Qwen3Attention: RMSNorm over each query and key head; `attention_bias` on q/k/v and o; head_dim 128 by default.
    _refuse_qwen_sliding_window(hf)
    bias = bool(hf.get("attention_bias", False))
    return {"qkv_bias": bias, "o_bias": bias, "qk_norm": True, "head_dim": hf.get("head_dim") or 128}


def _deepseek_v2_fields(hf: dict) -> dict:
    # DeepseekV2Attention: rotary pairs rotated as complex numbers in float32; transformers' V2 router
    # takes the softmax's top-k (greedy, or within the best groups) and never normalizes the weights.
    if hf.get("norm_topk_prob"):
        raise UnsupportedModel("this DeepSeek-V2 checkpoint sets norm_topk_prob, which transformers' DeepSeek-V2 "
                               "router ignores and DeepSeek's own code applies; it is not supported")
    method = hf.get("topk_method") or "greedy"
    methods = {"greedy": "softmax_greedy", "group_limited_greedy": "softmax_group_limited"}
    if method not in methods:
        raise UnsupportedModel(f"DeepSeek-V2 topk_method {method!r} is not supported; supported: greedy, "
                               "group_limited_greedy")
    return _deepseek_fields(hf, "complex", methods[method])


def _deepseek_v3_fields(hf: dict) -> dict:
    # DeepseekV3TopkRouter: sigmoid scores, e_score_correction_bias, grouped top-k ("noaux_tc"); transformers
    # reads neither scoring_func nor topk_method, so a checkpoint naming others is refused, not misread.
    for key, expected in (("scoring_func", "sigmoid"), ("topk_method", "noaux_tc")):
        if hf.get(key, expected) != expected:
            raise UnsupportedModel(f"DeepSeek-V3 {key} {hf[key]!r} is not supported; only {expected!r} runs")
    layout = "interleaved" if hf.get("rope_interleave", True) else "half"
    return _deepseek_fields(hf, layout, "sigmoid_grouped", norm_default=True)


def _deepseek_fields(hf: dict, rope_layout: str, method: str, norm_default: bool = False) -> dict:
    """What DeepSeek-V2 and V3 share: MLA and DeepSeekMoE (the V2 defaults are transformers')."""
    if hf.get("mlp_bias"):
        raise UnsupportedModel("this checkpoint sets mlp_bias, which is not supported; only bias-free MLPs run")
    if hf.get("moe_layer_freq", 1) != 1:
        raise UnsupportedModel(f"moe_layer_freq {hf['moe_layer_freq']} is not supported: transformers puts "
                               "experts in every layer from first_k_dense_replace on")
    rope_dim = hf.get("qk_rope_head_dim", 64)
    nope_dim = hf.get("qk_nope_head_dim", 128)
    mla = MlaConfig(kv_lora_rank=_required(hf, "kv_lora_rank"), qk_nope_head_dim=nope_dim,
                    qk_rope_head_dim=rope_dim, v_head_dim=hf.get("v_head_dim") or 128,
                    q_lora_rank=hf.get("q_lora_rank"), rope_layout=rope_layout,
                    softmax_scale=mla_softmax_scale(hf, nope_dim + rope_dim))
    heads = hf["num_attention_heads"]
    experts = _required(hf, "n_routed_experts")
    groups = hf.get("n_group") or 1
    if experts % groups:
        raise UnsupportedModel(f"{experts} routed experts do not divide into n_group {groups} groups")
    moe = DeepseekMoe(num_experts=experts, experts_per_token=_required(hf, "num_experts_per_tok"),
                      moe_intermediate_size=_required(hf, "moe_intermediate_size"),
                      num_shared_experts=hf.get("n_shared_experts") or 0,
                      first_dense_layers=hf.get("first_k_dense_replace") or 0, method=method,
                      num_groups=groups, groups_per_token=hf.get("topk_group") or groups,
                      normalize=bool(hf.get("norm_topk_prob", norm_default)),
                      scaling_factor=float(hf.get("routed_scaling_factor", 1.0)))
    if moe.method != "softmax_greedy" and not 0 < moe.groups_per_token <= groups:
        raise UnsupportedModel(f"topk_group {moe.groups_per_token} must be 1 through n_group {groups}")
    if moe.method == "sigmoid_grouped" and experts // groups < 2:
        raise UnsupportedModel("DeepSeek-V3 routing scores each group by its best two experts; n_group "
                               f"{groups} leaves {experts // groups} expert per group")
    bias = bool(hf.get("attention_bias", False))
    return {"mla": mla, "deepseek_moe": moe, "head_dim": rope_dim, "num_key_value_heads": heads,
            "qkv_bias": bias, "o_bias": bias, "mtp_layers": int(hf.get("num_nextn_predict_layers") or 0)}


def mla_softmax_scale(hf: dict, qk_head_dim: int) -> float:
    """transformers' `yarn_apply_mscale`: with any scaled rotary embedding and an mscale_all_dim, the
    softmax scale is multiplied by YaRN's mscale(factor, mscale_all_dim) squared."""
    scale = qk_head_dim ** -0.5
    rope = rope_config(hf)
    if rope.kind != "default" and rope.mscale_all_dim:
        mscale = 1.0 if rope.factor <= 1 else 0.1 * rope.mscale_all_dim * math.log(rope.factor) + 1.0
        scale *= mscale * mscale
    return scale


def _deepseek_v4_fields(hf: dict) -> dict:
    # DeepseekV4ForCausalLM: the layout of flare.models.deepseek_v4_config; its two rotary embeddings live there
    # (`rope` names the main one's base, which the standard layers do not read).
    fields = deepseek_v4_fields(hf)
    return {**fields, "rope": RopeConfig(theta=fields["v4"].main_rope.theta)}


FAMILY_FIELDS = {"llama": _llama_fields, "mistral": _mistral_fields, "qwen2": _qwen2_fields, "qwen3": _qwen3_fields,
                 "deepseek_v2": _deepseek_v2_fields, "deepseek_v3": _deepseek_v3_fields, "deepseek_v4": _deepseek_v4_fields}
FAMILY_OF_ARCHITECTURE = {
    "DeepseekV4ForCausalLM": "deepseek_v4",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    "DeepseekV3ForCausalLM": "deepseek_v3",
}


def _refuse_qwen_sliding_window(hf: dict) -> None:
    """Qwen2/Qwen3 configs: the window exists only with `use_sliding_window`, on layers from `max_window_layers`."""
    window = hf.get("sliding_window", 4096) if hf.get("use_sliding_window", False) else None
    layer_types = hf.get("layer_types")
    if layer_types is None:
        first = hf.get("max_window_layers", 28)
        sliding = max(0, hf["num_hidden_layers"] - first) if window is not None else 0
    else:
        sliding = sum(kind == "sliding_attention" for kind in layer_types)
    _refuse_sliding_window(hf, window=window, sliding_layers=sliding)


def _refuse_sliding_window(hf: dict, window: int | None, sliding_layers: int) -> None:
    # A window at least as long as the model's context never hides a token, so it is plain causal attention.
    if window is None or sliding_layers == 0 or window >= hf["max_position_embeddings"]:
        return
    raise UnsupportedModel(
        f"this checkpoint uses sliding-window attention (a {window}-token window on {sliding_layers} of "
        f"{hf['num_hidden_layers']} layers, context {hf['max_position_embeddings']}), which is not supported; "
        "choose a checkpoint with full attention"
    )


# ---- rotary embeddings ----


def rope_config(hf: dict) -> RopeConfig:
    """Standardise the old `rope_scaling`/`rope_theta` keys and the newer `rope_parameters` as transformers does."""
    params = dict(hf.get("rope_scaling") or hf.get("rope_parameters") or {})
    if any(isinstance(value, dict) for value in params.values()):
        raise UnsupportedModel("this checkpoint gives a different rotary embedding per layer type; that is not supported")
    kind = params.get("rope_type", params.get("type", "default"))
    if kind not in ROPE_KINDS:
        raise UnsupportedModel(
            f"this checkpoint's rotary embedding type {kind!r} is not supported; supported: {', '.join(ROPE_KINDS)}"
        )
    partial = params.get("partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
    if partial != 1.0:
        raise UnsupportedModel(f"partial rotary embeddings (partial_rotary_factor {partial}) are not supported")
    theta = float(params.get("rope_theta", hf.get("rope_theta", DEFAULT_ROPE_THETA)))
    if kind == "default":
        return RopeConfig(theta=theta)
    original = None
    if kind in ("llama3", "yarn"):
        original = hf.get("original_max_position_embeddings") or params.get("original_max_position_embeddings")
        original = int(original or hf["max_position_embeddings"])
    factor = params.get("factor")
    if factor is None and kind == "yarn":
        factor = hf["max_position_embeddings"] / original
    if factor is None:
        raise UnsupportedModel(f"this checkpoint's {kind!r} rotary scaling has no 'factor'")
    return RopeConfig(
        kind=kind,
        theta=theta,
        factor=float(factor),
        original_max_positions=original,
        low_freq_factor=params.get("low_freq_factor"),
        high_freq_factor=params.get("high_freq_factor"),
        attention_factor=params.get("attention_factor"),
        beta_fast=params.get("beta_fast"),
        beta_slow=params.get("beta_slow"),
        mscale=params.get("mscale"),
        mscale_all_dim=params.get("mscale_all_dim"),
        truncate=params.get("truncate", True),
    )


# ---- small readers ----


def _architecture(hf: dict) -> str:
    names = hf.get("architectures") or []
    for name in names:
        if name in FAMILY_OF_ARCHITECTURE:
            return name
    supported = ", ".join(FAMILY_OF_ARCHITECTURE)
    raise UnsupportedModel(f"architecture {', '.join(names) or '(none named)'} is not supported; supported: {supported}")


def _require_common_features(hf: dict) -> None:
    activation = hf.get("hidden_act", "silu")
    if activation != "silu":
        raise UnsupportedModel(f"hidden_act {activation!r} is not supported; only 'silu' MLPs run")


def _fp8_weights(hf: dict, online_projections: tuple[str, ...]) -> Fp8Weights | None:
    stored = fp8_weights_of(hf)
    if stored is not None and online_projections:
        raise UnsupportedModel("--online-mxfp8 converts BF16 projections, but this checkpoint's are already FP8 "
                               f"({stored.describe()}); export it without --online-mxfp8")
    fp8 = online_fp8(tuple(online_projections)) if online_projections else stored
    if fp8 is not None and fp8.quantizes("lm_head"):
        raise UnsupportedModel("this checkpoint stores lm_head in FP8, which is not supported: the LM head runs in "
                               "the serving dtype; choose a checkpoint that ignores lm_head")
    return fp8


def _required(hf: dict, key: str) -> Any:
    if hf.get(key) is None:
        raise UnsupportedModel(f"config.json has no {key!r}, which the model needs")
    return hf[key]


def _token_ids(value: int | list[int] | None) -> tuple[int, ...]:
    if value is None:
        return ()
    return (value,) if isinstance(value, int) else tuple(value)
