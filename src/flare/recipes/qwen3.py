"""Qwen3 dense models (Qwen3ForCausalLM): GQA with per-head q/k RMSNorm, no attention bias."""

from __future__ import annotations

from functools import partial

from flare.models.quantization import DECODER_PROJECTIONS
from flare.recipes.base import (DECODE_CAPACITIES, HISTORY_SPECULATION, ConcurrencyRange, Recipe,
                                SamplingDefaults, draft_speculation, hub_checkpoint, sampling_ranges)

ARCHITECTURE = "Qwen3ForCausalLM"


def _config(hidden, layers, heads, intermediate, tied):
    """The geometry of a Qwen3 dense config.json (every size shares head_dim 128, 8 KV heads, 40,960 positions)."""
    return {"model_type": "qwen3", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": 128,
            "intermediate_size": intermediate, "vocab_size": 151936, "max_position_embeddings": 40960,
            "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}


_checkpoint = partial(hub_checkpoint, ARCHITECTURE, "Qwen")


# Revisions are commits quoted for these repositories in public code (snapshot paths and
# `revision=` pins). stored_bytes is the safetensors tensor data at that revision, as its index's
# total_size (or the single file's data) reports; the tests recompute each from the config's shapes.
# Qwen3-0.6B and 1.7B store a copy of the tied output projection; Qwen3-4B does not.
CHECKPOINTS = (
    _checkpoint("qwen3-0.6b", "Qwen3-0.6B", "c1899de289a04d12100db370d81485cdf75e47ca",
                1_503_264_768, _config(1024, 28, 16, 3072, tied=True)),
    _checkpoint("qwen3-1.7b", "Qwen3-1.7B", "70d244cc86ccca08cf5af4e1e306ecf908b1ad5e",
                4_063_479_808, _config(2048, 28, 16, 6144, tied=True)),
    _checkpoint("qwen3-4b", "Qwen3-4B", "1cfa9a7208912126459214e8b04321603b3df60c",
                8_044_936_192, _config(2560, 36, 32, 9728, tied=True)),
    _checkpoint("qwen3-8b", "Qwen3-8B", "b968826d9c46dd6066d109eabc6255188de91218",
                16_381_470_720, _config(4096, 36, 32, 12288, tied=False)),
    _checkpoint("qwen3-14b", "Qwen3-14B", "40c069824f4251a91eefaf281ebe4c544efd3e18",
                29_536_614_400, _config(5120, 40, 40, 17408, tied=False)),
    _checkpoint("qwen3-32b", "Qwen3-32B", "9216db5781bf21249d130ec9da846c4624c16137",
                65_524_246_528, _config(5120, 64, 64, 25600, tied=False)),
    # Block-scaled FP8 (config.json's quantization_config below, as Qwen publishes it). The revision is a
    # commit quoted for this repository in public code (hub snapshot paths). stored_bytes is computed from
    # the shapes, not read from its index: e4m3 projections with BFLOAT16 weight_scale_inv (the dtype
    # inference engines' fixes for Qwen3's dense FP8 checkpoints report), everything else bfloat16.
    _checkpoint("qwen3-8b-fp8", "Qwen3-8B-FP8", "220b46e3b2180893580a4454f21f22d3ebb187d3",
                9_436_551_168, _config(4096, 36, 32, 12288, tied=False) | {"quantization_config": {
                    "activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                    "weight_block_size": [128, 128]}}),
)

# The model card's thinking-mode settings, also the generation_config.json defaults: temperature 0.6,
# top-p 0.95, top-k 20, min-p 0, and "DO NOT use greedy decoding". The card lets presence_penalty
# range over 0 to 2; other ranges are the API's own.
SAMPLING = SamplingDefaults(temperature=0.6, top_p=0.95, top_k=20, min_p=0.0,
                            ranges=sampling_ranges(presence_penalty=(0.0, 2.0)),
                            source="Qwen3 model card (thinking mode) and generation_config.json")

# Qwen3-0.6B drafts for the larger dense checkpoints: every Qwen3 dense size declares the same 151,936-token
# vocabulary (above); export checks that the two config.json files agree before anything is written.
_BY_ALIAS = {checkpoint.alias: checkpoint for checkpoint in CHECKPOINTS}
SPECULATION_BY_ALIAS = {alias: draft_speculation(_BY_ALIAS["qwen3-0.6b"], "Qwen3-0.6B")
                        for alias in ("qwen3-8b", "qwen3-14b", "qwen3-32b", "qwen3-8b-fp8")}

RECIPE = Recipe(
    family="qwen3",
    title="Qwen3 dense",
    architectures=(ARCHITECTURE,),
    checkpoints=CHECKPOINTS,
    tensor_parallel_sizes=(1, 2, 4, 8),        # further limited per checkpoint by its 8 KV heads
    concurrency=ConcurrencyRange(minimum=1, default=32, maximum=256),
    page_size=16,
    # Spec section 4 fixes 4,096 tokens for Qwen: a long prompt reaches its first token in fewer steps,
    # and at these sizes one 4,096-token chunk still stalls concurrent decodes only briefly.
    prefill_chunk=4096,
    decode_capacities=DECODE_CAPACITIES,
    speculation=HISTORY_SPECULATION,
    speculation_by_alias=SPECULATION_BY_ALIAS,
    sampling=SAMPLING,
    online_fp8_projections=DECODER_PROJECTIONS,
    reasoning_parser="qwen3",                  # <think>...</think>, switched by the template's enable_thinking
)
