"""How a model's projections and KV cache are stored in FP8: read from config.json, or chosen at export.

Importing this module does not import torch: recipes, the estimate and `ignition --help` read it.

FP8 checkpoints ship in two layouts, both float8 e4m3 weights whose scale multiplies back:
  * `quant_method: "fp8"` (DeepSeek-V3, Qwen3-*-FP8, and the older AutoFP8 layout): with
    `weight_block_size: [128, 128]` each projection has `weight_scale_inv` [ceil(N/128), ceil(K/128)]
    (float32 or bfloat16), one per block; without it one `weight_scale` per projection. The skip list
    is `modules_to_not_convert` or `ignored_layers`; the LM head is never converted (transformers and
    vLLM keep it out).
  * `quant_method: "compressed-tensors"`, format `float-quantized` or `naive-quantized` (RedHatAI's FP8
    checkpoints, llm-compressor): `weight_scale` per tensor (`strategy: tensor`, shape [1] or []), per
    output channel (`channel`, [N, 1]) or per block (`block`, `block_structure`); `config_groups` name
    the targets (a class name such as `Linear`, a module name, or `re:` regex) and `ignore` the
    exceptions, matched as compressed-tensors matches them.
Static activation scales (`input_scale`) are accepted and not used: activations stay in the serving
dtype (weight-only FP8), which is closer to the unquantized model than the calibrated static scale.

The online FP8 of a BF16 checkpoint (`ignition export --online-mxfp8`) stores the decoder's projections
in the first layout: e4m3, one float32 `weight_scale_inv` per 128x128 block.

The FP8 KV cache stores every cached token's key and value of each KV head as e4m3 with one float32
scale (its absolute maximum / 448), chosen when the token is written: no calibration, no overflow.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Any, Mapping

from flare.models.errors import UnsupportedModel

E4M3_MAX = 448.0
BLOCK = (128, 128)                      # the block of block-scaled checkpoints and of online FP8
KV_CACHE_DTYPES = ("auto", "fp8")
KV_SCALE_BYTES = 4                      # one float32 scale per token, KV head and K or V
DECODER_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
ONLINE_FP8_HELP = ("store the recipe's eligible BF16 projections (the decoder's q/k/v/o and gate/up/down) as "
                   "FP8 e4m3 with one float32 scale per 128x128 block, the layout of block-FP8 checkpoints "
                   "such as Qwen3-8B-FP8, while exporting; the kernels read them back to BF16 "
                   "(weight-only: activations stay BF16). Embeddings, norms and the LM head keep the serving "
                   "dtype. This trades checkpoint precision for decode bandwidth; Hopper has no MXFP8 (1x32 "
                   "blocks, E8M0 scales) instructions, so this is its form of it")
KV_CACHE_HELP = ("auto: the serving dtype; fp8: each cached key and value vector as e4m3 with one float32 "
                 "scale per token and KV head (its absolute maximum / 448), head_dim + 4 bytes instead of "
                 "2 x head_dim, so the pool holds about twice the tokens")


@dataclass(frozen=True)
class Fp8Weights:
    """Where a model's FP8 projections are and how their scales are laid out."""

    method: str                           # "fp8", "compressed-tensors" or "online"
    granularity: str                      # "block", "channel" or "tensor"
    block: tuple[int, int] | None         # (rows, columns) of one scale's block, for "block"
    scale_suffix: str                     # the checkpoint tensor beside `.weight`: weight_scale_inv or weight_scale
    targets: tuple[str, ...] = ("Linear",)  # compressed-tensors targets; every projection for "fp8"
    ignore: tuple[str, ...] = ()          # modules left in the checkpoint's own precision
    static_input_scales: bool = False     # the checkpoint ships input_scale tensors (read, not used)

    def quantizes(self, module: str) -> bool:
        """Whether the checkpoint stores projection `module` (e.g. model.layers.0.mlp.up_proj) in FP8."""
        if self.method == "online":                  # targets: the decoder projections converted at export
            return module.startswith("model.layers.") and module.rsplit(".", 1)[-1] in self.targets
        if self.method == "compressed-tensors":
            targeted = any(target == "Linear" or _matches_name(module, target) for target in self.targets)
            return targeted and not any(_matches_name(module, pattern) for pattern in self.ignore)
        if module == "lm_head":
            return False
        return not any(_matches_module(module, pattern) for pattern in self.ignore)

    def describe(self) -> str:
        """One line for reports: what is stored, e.g. `FP8 e4m3, float scale per 128x128 block`."""
        scale = {"block": f"a scale per {self.block[0]}x{self.block[1]} block" if self.block else "",
                 "channel": "a scale per output channel", "tensor": "one scale per projection"}[self.granularity]
        origin = "online from BF16 at export" if self.method == "online" else f"checkpoint ({self.method})"
        return f"FP8 e4m3 projections with {scale}, {origin}"


def online_fp8(projections: tuple[str, ...]) -> Fp8Weights:
    """The layout `--online-mxfp8` stores: these decoder projections (e.g. q_proj) in 128x128 blocks."""
    unknown = sorted(set(projections) - set(DECODER_PROJECTIONS))
    if unknown or not projections:
        raise UnsupportedModel(f"online FP8 projections {', '.join(unknown) or '(none)'}: choose from "
                               f"{', '.join(DECODER_PROJECTIONS)}")
    return Fp8Weights(method="online", granularity="block", block=BLOCK, scale_suffix="weight_scale_inv",
                      targets=tuple(projections))


def online_conversion(name: str, shape, fp8: Fp8Weights) -> tuple[str, tuple[int, int]] | None:
    """For a checkpoint tensor the online FP8 export converts (a 2-D `.weight` of a projection `fp8`
    names): the name and shape of the float32 scale tensor stored beside its e4m3 values. None otherwise."""
    module, _, suffix = name.rpartition(".")
    if fp8.method != "online" or suffix != "weight" or len(shape) != 2 or not fp8.quantizes(module):
        return None
    rows, columns = shape
    return f"{module}.{fp8.scale_suffix}", (-(-rows // fp8.block[0]), -(-columns // fp8.block[1]))


def fp8_weights_of(hf_config: Mapping[str, Any]) -> Fp8Weights | None:
    """The FP8 layout config.json declares, None for an unquantized checkpoint; `UnsupportedModel` for
    any other quantization, naming what was found."""
    quantization = hf_config.get("quantization_config")
    if not quantization:
        return None
    if not isinstance(quantization, Mapping):
        raise UnsupportedModel(f"quantized checkpoints ({quantization}) are not supported; only FP8 checkpoints "
                               "(quant_method fp8 or compressed-tensors) and unquantized ones run")
    method = quantization.get("quant_method", "unknown")
    if method == "fp8":
        return _fp8_method(quantization)
    if method == "compressed-tensors":
        return _compressed_tensors(quantization)
    raise UnsupportedModel(f"quantized checkpoints ({method}) are not supported; only FP8 checkpoints "
                           "(quant_method fp8 or compressed-tensors, e4m3) and unquantized ones run")


def check_kv_cache_dtype(value: str) -> str:
    if value not in KV_CACHE_DTYPES:
        raise UnsupportedModel(f"KV cache dtype {value!r} is not supported; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return value


# ---- quant_method "fp8" ----


def _fp8_method(config: Mapping[str, Any]) -> Fp8Weights:
    fmt = config.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise UnsupportedModel(f"this FP8 checkpoint stores {fmt!r} values; only e4m3 FP8 checkpoints run")
    scheme = config.get("activation_scheme", "dynamic")
    if scheme not in ("dynamic", "static"):
        raise UnsupportedModel(f"this FP8 checkpoint's activation_scheme {scheme!r} is not supported "
                               "(dynamic or static)")
    ignore = tuple(config.get("ignored_layers") or config.get("modules_to_not_convert") or ())
    block = config.get("weight_block_size")
    if block is None:
        return Fp8Weights(method="fp8", granularity="tensor", block=None, scale_suffix="weight_scale",
                          ignore=ignore, static_input_scales=scheme == "static")
    return Fp8Weights(method="fp8", granularity="block", block=_block(block, "weight_block_size"),
                      scale_suffix="weight_scale_inv", ignore=ignore, static_input_scales=scheme == "static")


# ---- quant_method "compressed-tensors" ----

# The FP8 presets of compressed-tensors' quant_scheme.py, which config_groups may name instead of
# spelling the scheme out (the weights' arguments are all that loading needs).
_PRESETS = {
    "FP8": ({"num_bits": 8, "type": "float", "strategy": "tensor", "symmetric": True, "dynamic": False},
            {"strategy": "tensor", "dynamic": False}),
    "FP8_DYNAMIC": ({"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True, "dynamic": False},
                    {"strategy": "token", "dynamic": True}),
    "FP8_BLOCK": ({"num_bits": 8, "type": "float", "strategy": "block", "symmetric": True, "dynamic": False,
                   "block_structure": [128, 128]}, {"strategy": "group", "dynamic": True}),
}
_STORED_FORMATS = ("float-quantized", "naive-quantized")


def _compressed_tensors(config: Mapping[str, Any]) -> Fp8Weights:
    fmt = config.get("format", "dense")
    if fmt not in _STORED_FORMATS:
        raise UnsupportedModel(f"this compressed-tensors checkpoint has format {fmt!r}; only FP8 weights stored "
                               f"as {' or '.join(_STORED_FORMATS)} run")
    if config.get("kv_cache_scheme"):
        raise UnsupportedModel("this checkpoint carries calibrated KV-cache scales (kv_cache_scheme), which are "
                               "not supported; Flare's FP8 KV cache scales each token as it is written "
                               "(ignition export --kv-cache-dtype fp8)")
    groups = [_group(name, group) for name, group in (config.get("config_groups") or {}).items()]
    if not groups:
        raise UnsupportedModel("this compressed-tensors checkpoint names no config_groups; nothing says which "
                               "projections are FP8")
    weights = {_freeze(weights) for _, weights, _ in groups}
    if len(weights) > 1:
        raise UnsupportedModel("this compressed-tensors checkpoint quantizes projections with different "
                               "schemes; only one FP8 weight scheme per checkpoint runs")
    args = groups[0][1]
    strategy = args.get("strategy") or ("channel" if args.get("group_size") == -1 else "tensor")
    if (args.get("num_bits"), args.get("type"), args.get("symmetric", True), bool(args.get("dynamic"))) \
            != (8, "float", True, False) or strategy not in ("tensor", "channel", "block"):
        raise UnsupportedModel(f"this compressed-tensors checkpoint's weights are {_describe_args(args)}; only "
                               "symmetric 8-bit float weights per tensor, channel or block run")
    block = _block(args.get("block_structure"), "block_structure") if strategy == "block" else None
    static = any(inputs is not None and not inputs.get("dynamic", False) for _, _, inputs in groups)
    return Fp8Weights(method="compressed-tensors", granularity=strategy, block=block, scale_suffix="weight_scale",
                      targets=tuple(target for targets, _, _ in groups for target in targets),
                      ignore=tuple(config.get("ignore") or ()), static_input_scales=static)


def _group(name: str, group: Any) -> tuple[list[str], dict, dict | None]:
    """(targets, weight arguments, input-activation arguments) of one config group."""
    if isinstance(group, list):                          # a preset name mapped to its targets
        if name not in _PRESETS:
            raise UnsupportedModel(f"this compressed-tensors checkpoint uses the scheme {name!r}; only the FP8 "
                                   f"schemes ({', '.join(_PRESETS)}) run")
        weights, inputs = _PRESETS[name]
        return list(group), dict(weights), dict(inputs)
    if not isinstance(group, Mapping) or not isinstance(group.get("weights"), Mapping):
        raise UnsupportedModel(f"compressed-tensors config group {name!r} has no weights scheme; only FP8 weight "
                               "quantization runs")
    if group.get("output_activations"):
        raise UnsupportedModel(f"compressed-tensors config group {name!r} quantizes output activations, which "
                               "is not supported")
    return list(group.get("targets") or ()), dict(group["weights"]), group.get("input_activations")


def _freeze(args: dict) -> tuple:
    return tuple(sorted((key, str(args.get(key))) for key in
                        ("num_bits", "type", "strategy", "symmetric", "dynamic", "block_structure", "group_size")))


def _describe_args(args: Mapping[str, Any]) -> str:
    return (f"{args.get('num_bits')}-bit {args.get('type')}, strategy {args.get('strategy')}"
            + (", asymmetric" if args.get("symmetric") is False else "")
            + (", dynamic" if args.get("dynamic") else ""))


def _block(value: Any, key: str) -> tuple[int, int]:
    if (not isinstance(value, (list, tuple)) or len(value) != 2
            or not all(isinstance(size, int) and size > 0 for size in value)):
        raise UnsupportedModel(f"this FP8 checkpoint's {key} {value!r} is not two positive integers")
    return int(value[0]), int(value[1])


# ---- module names ----


def _matches_name(module: str, pattern: str) -> bool:
    """compressed-tensors' rule: `re:` patterns match from the start, other names exactly."""
    if pattern.startswith("re:"):
        return re.match(pattern[3:], module) is not None
    return module == pattern


def _matches_module(module: str, pattern: str) -> bool:
    """A skip-list entry of quant_method fp8 names the module, a module above it, or its trailing names."""
    return module == pattern or module.startswith(pattern + ".") or module.endswith("." + pattern)
