"""DeepSeek-V2 and V3 (DeepseekV2ForCausalLM, DeepseekV3ForCausalLM): multi-head latent attention and
DeepSeekMoE; V3's checkpoints carry a multi-token-prediction layer that drafts (flare.models.deepseek_mtp).

The memory cost model is recipes.deepseek_costs' (through recipes.base's functions): a cached token is
one 576-value latent row per layer at these shapes, 30.4 KiB for V2-Lite and 68.6 KiB for V3 at bf16,
on every tensor-parallel rank.
"""

from __future__ import annotations

from flare.recipes.base import (DECODE_CAPACITIES, HISTORY_SPECULATION, Checkpoint, ConcurrencyRange, Recipe,
                                SamplingDefaults, Speculation, decode_weight_bytes, hub_checkpoint,
                                sampling_ranges, weight_bytes)

V2, V3 = "DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"

# config.json excerpts at the pinned revisions (the published configs; YaRN to 163,840 positions).
_YARN_V2 = {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
            "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}
_V2_LITE = {"model_type": "deepseek_v2", "architectures": [V2], "hidden_size": 2048, "num_hidden_layers": 27,
            "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
            "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 10944,
            "moe_intermediate_size": 1408, "n_routed_experts": 64, "num_experts_per_tok": 6, "n_shared_experts": 2,
            "first_k_dense_replace": 1, "moe_layer_freq": 1, "n_group": 1, "topk_group": 1, "topk_method": "greedy",
            "norm_topk_prob": False, "routed_scaling_factor": 1.0, "vocab_size": 102400,
            "max_position_embeddings": 163840, "rope_theta": 10000, "rope_scaling": _YARN_V2,
            "rms_norm_eps": 1e-6, "tie_word_embeddings": False, "bos_token_id": 100000, "eos_token_id": 100001,
            "torch_dtype": "bfloat16"}
_FP8_BLOCK = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8", "weight_block_size": [128, 128]}
_V3 = {"model_type": "deepseek_v3", "architectures": [V3], "hidden_size": 7168, "num_hidden_layers": 61,
       "num_attention_heads": 128, "num_key_value_heads": 128, "kv_lora_rank": 512, "q_lora_rank": 1536,
       "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "intermediate_size": 18432,
       "moe_intermediate_size": 2048, "n_routed_experts": 256, "num_experts_per_tok": 8, "n_shared_experts": 1,
       "first_k_dense_replace": 3, "moe_layer_freq": 1, "n_group": 8, "topk_group": 4, "topk_method": "noaux_tc",
       "scoring_func": "sigmoid", "norm_topk_prob": True, "routed_scaling_factor": 2.5, "vocab_size": 129280,
       "max_position_embeddings": 163840, "rope_theta": 10000,
       "rope_scaling": {**_YARN_V2, "mscale": 1.0, "mscale_all_dim": 1.0}, "rms_norm_eps": 1e-6,
       "num_nextn_predict_layers": 1, "tie_word_embeddings": False, "bos_token_id": 0, "eos_token_id": 1,
       "quantization_config": _FP8_BLOCK, "torch_dtype": "bfloat16"}

# Revisions are commits quoted as hub snapshots of these repositories in public code. DeepSeek-V2-Lite-Chat's
# stored_bytes is computed from the config's shapes in bfloat16 with a stored output projection: 15.7B
# parameters as its card says (four shards of 8.59, 8.59, 8.59 and 5.64 GB). V3's and R1's totals are not
# declared: their FP8 scales' stored dtype and the size of their MTP layer's tensors could not be confirmed.
_UNCONFIRMED = "FP8 scale dtype and MTP layer tensors not confirmed"
CHECKPOINTS = (
    hub_checkpoint(V2, "deepseek-ai", "deepseek-v2-lite-chat", "DeepSeek-V2-Lite-Chat",
                   "85864749cd611b4353ce1decdb286193298f64c7", weight_bytes(_V2_LITE, True), _V2_LITE),
    Checkpoint(alias="deepseek-v3", architecture=V3, served_name="DeepSeek-V3", repo_id="deepseek-ai/DeepSeek-V3",
               revision="e815299b0bcbac849fa540c768ef21845365c9eb", decode_weight_bytes=decode_weight_bytes(_V3),
               config=_V3, stored_bytes_note=_UNCONFIRMED),
    Checkpoint(alias="deepseek-r1", architecture=V3, served_name="DeepSeek-R1", repo_id="deepseek-ai/DeepSeek-R1",
               revision="56d4cbbb4d29f4355bab4b9a39ccb717a14ad5ad", decode_weight_bytes=decode_weight_bytes(_V3),
               config=_V3, stored_bytes_note=_UNCONFIRMED),
)

# generation_config.json of the V2 family (DeepSeek-V2-Lite, V2 and V2.5 at their published commits):
# temperature 0.3, top-p 0.95; the Chat's own file was not confirmed, and is taken to match. R1's
# generation_config.json: temperature 0.6, top-p 0.95. V3's could not be confirmed: the API's neutral values.
SAMPLING = SamplingDefaults(temperature=0.3, top_p=0.95, top_k=0, min_p=0.0, ranges=sampling_ranges(),
                            source="generation_config.json of the DeepSeek-V2 family")
SAMPLING_BY_ALIAS = {
    "deepseek-r1": SamplingDefaults(temperature=0.6, top_p=0.95, top_k=0, min_p=0.0, ranges=sampling_ranges(),
                                    source="generation_config.json of DeepSeek-R1"),
    "deepseek-v3": SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, ranges=sampling_ranges(),
                                    source="not confirmed for DeepSeek-V3: neutral values"),
}

# V3 and R1 ship one MTP layer, trained to predict one token ahead; run again on its own output it drafts
# further, less often right.
MTP_SPECULATION = Speculation(available=True, default_draft_tokens=1, max_draft_tokens=4, history=True, mtp=True,
                              note="the checkpoint's multi-token-prediction layer drafts (--no-mtp leaves it out); "
                                   "history drafts with flare run --history-drafts")

RECIPE = Recipe(
    family="deepseek",
    title="DeepSeek-V2/V3 (MLA, DeepSeekMoE)",
    architectures=(V2, V3),
    checkpoints=CHECKPOINTS,
    # MLA's latent is not split by tensor parallelism (every rank caches all of it); the heads, experts and
    # MLPs are. V3 and R1 need eight H200-class GPUs (the estimate refuses fewer); V2-Lite fits one.
    tensor_parallel_sizes=(1, 2, 4, 8),
    concurrency=ConcurrencyRange(minimum=1, default=32, maximum=256),
    page_size=16,
    prefill_chunk=4096,                        # spec section 4: 4,096 for DeepSeek
    decode_capacities=DECODE_CAPACITIES,
    speculation=HISTORY_SPECULATION,
    speculation_by_alias={"deepseek-v3": MTP_SPECULATION, "deepseek-r1": MTP_SPECULATION},
    sampling=SAMPLING,
    sampling_by_alias=SAMPLING_BY_ALIAS,
    reasoning_parser=None,
)
