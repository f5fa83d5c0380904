"""`ModelConfig`: what the model code needs from a checkpoint's config.json, read once and frozen.

Each family's reading mirrors what `transformers` does with the same file, so that a checkpoint means
the same thing here as there. Anything we cannot run faithfully is refused with `UnsupportedModel`.
Importing this module does not import torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

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
        fields.setdefault("head_dim", hf.get("head_dim") or hf["hidden_size"] // heads)
        return cls(
            architecture=architecture,
            family=family,
            hidden_size=hf["hidden_size"],
            num_hidden_layers=hf["num_hidden_layers"],
            num_attention_heads=heads,
            num_key_value_heads=hf.get("num_key_value_heads") or heads,
            intermediate_size=_required(hf, "intermediate_size"),
            vocab_size=_required(hf, "vocab_size"),
            rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
            rope=rope_config(hf),
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


FAMILY_FIELDS = {"llama": _llama_fields, "mistral": _mistral_fields, "qwen2": _qwen2_fields, "qwen3": _qwen3_fields}
FAMILY_OF_ARCHITECTURE = {
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
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
