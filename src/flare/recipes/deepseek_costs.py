"""The memory cost model of DeepSeek-V2/V3-shaped configs (MLA and DeepSeekMoE), as plain functions of
config.json; `recipes.base`'s functions hand such configs here, so every caller counts them one way.

Importable without torch. Shapes follow transformers' DeepseekV2/V3 modules (flare.models.deepseek):
a cached token is one latent row per layer (`kv_lora_rank + qk_rope_head_dim` values, whatever the head
count or tensor-parallel size: every rank holds the whole row); parameters count MLA's projections and
norms, dense MLPs below `first_k_dense_replace`, routed and shared experts and the router above it.
"""

from __future__ import annotations

from typing import Any, Mapping

LATENT_SCALE_BYTES = 8          # an FP8 latent row's two float32 scales (flare.engine.mla_attention)


def is_mla(hf_config: Mapping[str, Any]) -> bool:
    return hf_config.get("kv_lora_rank") is not None


def latent_dim(hf_config: Mapping[str, Any]) -> int:
    return int(hf_config["kv_lora_rank"]) + int(hf_config.get("qk_rope_head_dim", 64))


def latent_bytes_per_token(hf_config: Mapping[str, Any], dtype_bytes: int, kv_cache_dtype: str = "auto") -> int:
    """Bytes one cached token occupies on each rank: its latent row in every layer."""
    row = latent_dim(hf_config) + LATENT_SCALE_BYTES if kv_cache_dtype == "fp8" else latent_dim(hf_config) * dtype_bytes
    return hf_config["num_hidden_layers"] * row


def _dims(hf: Mapping[str, Any]) -> tuple[int, int, int, int, int, int | None]:
    heads = hf["num_attention_heads"]
    nope, rope = hf.get("qk_nope_head_dim", 128), hf.get("qk_rope_head_dim", 64)
    return heads, nope, rope, hf.get("v_head_dim") or 128, int(hf["kv_lora_rank"]), hf.get("q_lora_rank")


def attention_projections(hf: Mapping[str, Any]) -> dict[str, tuple[int, int]]:
    """[out, in] of one layer's MLA projections, under their checkpoint names."""
    hidden = hf["hidden_size"]
    heads, nope, rope, v, rank, q_rank = _dims(hf)
    shapes = ({"self_attn.q_proj": (heads * (nope + rope), hidden)} if q_rank is None else
              {"self_attn.q_a_proj": (q_rank, hidden), "self_attn.q_b_proj": (heads * (nope + rope), q_rank)})
    shapes.update({"self_attn.kv_a_proj_with_mqa": (rank + rope, hidden),
                   "self_attn.kv_b_proj": (heads * (nope + v), rank),
                   "self_attn.o_proj": (hidden, heads * v)})
    return shapes


def layer_projections(hf: Mapping[str, Any], index: int, active: bool = False) -> list[tuple[str, int, int, int]]:
    """(checkpoint name under the layer, out, in, how many) of layer `index`'s matrices that a block-FP8
    checkpoint stores in FP8: MLA's and the MLPs' (one entry for all of the routed experts)."""
    hidden = hf["hidden_size"]
    found = [(name, rows, columns, 1) for name, (rows, columns) in attention_projections(hf).items()]
    if index < (hf.get("first_k_dense_replace") or 0):
        sizes = [("mlp", hf["intermediate_size"], 1)]
    else:
        experts = hf["num_experts_per_tok"] if active else hf["n_routed_experts"]
        sizes = [("mlp.experts.0", hf["moe_intermediate_size"], experts)]
        if hf.get("n_shared_experts"):
            sizes.append(("mlp.shared_experts", hf["moe_intermediate_size"] * hf["n_shared_experts"], 1))
    for module, intermediate, count in sizes:
        found += [(f"{module}.gate_proj", intermediate, hidden, count), (f"{module}.up_proj", intermediate, hidden, count),
                  (f"{module}.down_proj", hidden, intermediate, count)]
    return found


def _mlp(hidden: int, intermediate: int) -> int:
    return 3 * hidden * intermediate


def layer_parameters(hf: Mapping[str, Any], index: int, active: bool = False) -> int:
    """Parameters of decoder layer `index` (`active`: only the experts one token runs, for decode bytes)."""
    hidden = hf["hidden_size"]
    _, _, _, _, rank, q_rank = _dims(hf)
    params = sum(rows * columns for rows, columns in attention_projections(hf).values())
    params += rank + (q_rank or 0) + 2 * hidden                       # latent norms, two layer norms
    if hf.get("attention_bias"):
        params += sum(rows for name, (rows, _) in attention_projections(hf).items()
                      if name.rsplit(".", 1)[-1] in ("q_a_proj", "kv_a_proj_with_mqa", "o_proj"))
    if index < (hf.get("first_k_dense_replace") or 0):
        return params + _mlp(hidden, hf["intermediate_size"])
    experts, expert = hf["n_routed_experts"], _mlp(hidden, hf["moe_intermediate_size"])
    routed = hf["num_experts_per_tok"] if active else experts
    params += routed * expert + (hf.get("n_shared_experts") or 0) * expert + experts * hidden   # + router
    if hf.get("model_type") == "deepseek_v3" or "DeepseekV3ForCausalLM" in (hf.get("architectures") or ()):
        params += experts                                              # e_score_correction_bias
    return params


def parameter_count(hf: Mapping[str, Any], lm_head_stored: bool, active: bool = False) -> int:
    """Parameters of the decoder (MTP layers not included: they are the draft's)."""
    embedding = hf["vocab_size"] * hf["hidden_size"]
    layers = sum(layer_parameters(hf, index, active) for index in range(hf["num_hidden_layers"]))
    return embedding + layers + hf["hidden_size"] + (embedding if lm_head_stored else 0)


def activation_bytes_per_token(hf: Mapping[str, Any], dtype_bytes: int, tensor_parallel: int = 1) -> int:
    """Peak activation bytes one token needs inside a layer: residual, queries (their latent form too),
    the cache row, the attention's latent output, the widest MLP (a dense one, or the chosen experts)."""
    hidden = hf["hidden_size"]
    heads, nope, rope, v, rank, _ = _dims(hf)
    per_rank = max(1, heads // tensor_parallel)
    queries = per_rank * ((nope + rope) + (rank + rope))
    attention_out = per_rank * (rank + v)
    experts = (hf["num_experts_per_tok"] + (hf.get("n_shared_experts") or 0)) * hf["moe_intermediate_size"]
    mlp = 2 * max(hf["intermediate_size"], experts) // tensor_parallel
    return (3 * hidden + queries + latent_dim(hf) + attention_out + mlp) * dtype_bytes
