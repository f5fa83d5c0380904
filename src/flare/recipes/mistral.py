"""Mistral models (MistralForCausalLM): Llama-shaped GQA; v0.3 has no sliding window."""

from __future__ import annotations

from flare.models.quantization import DECODER_PROJECTIONS
from flare.recipes.base import (DECODE_CAPACITIES, HISTORY_SPECULATION, ConcurrencyRange, Recipe,
                                SamplingDefaults, hub_checkpoint, sampling_ranges)

ARCHITECTURE = "MistralForCausalLM"

MISTRAL_7B_V03_CONFIG = {
    "model_type": "mistral", "hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32,
    "num_key_value_heads": 8, "head_dim": 128, "intermediate_size": 14336, "vocab_size": 32768,
    "max_position_embeddings": 32768, "sliding_window": None, "tie_word_embeddings": False,
    "torch_dtype": "bfloat16",
}

# The revision is a commit (2025-12-03) quoted for this repository in public code; stored_bytes is
# its index's total_size (the tests recompute it from the config's shapes).
CHECKPOINTS = (
    hub_checkpoint(ARCHITECTURE, "mistralai", "mistral-7b-instruct-v0.3", "Mistral-7B-Instruct-v0.3",
                   "c170c708c41dac9275d15a8fff4eca08d52bab71", 14_496_047_104, MISTRAL_7B_V03_CONFIG),
)

# The model card recommends no sampling settings and its generation_config.json carries only token
# ids, so requests start from the API's neutral defaults (temperature 1, no truncation).
SAMPLING = SamplingDefaults(temperature=1.0, top_p=1.0, top_k=0, min_p=0.0, ranges=sampling_ranges(),
                            source="none published; the API's neutral defaults")

RECIPE = Recipe(
    family="mistral",
    title="Mistral",
    architectures=(ARCHITECTURE,),
    checkpoints=CHECKPOINTS,
    tensor_parallel_sizes=(1, 2, 4, 8),        # limited by its 8 KV heads
    concurrency=ConcurrencyRange(minimum=1, default=32, maximum=256),
    page_size=16,
    prefill_chunk=2048,                        # as Llama: bounds how long a chunk stalls active decodes
    decode_capacities=DECODE_CAPACITIES,
    speculation=HISTORY_SPECULATION,
    sampling=SAMPLING,
    online_fp8_projections=DECODER_PROJECTIONS,
)
