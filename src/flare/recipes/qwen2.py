"""Qwen2 and Qwen2.5 models (Qwen2ForCausalLM): GQA with biases on q/k/v, no q/k norm."""

from __future__ import annotations

from functools import partial

from flare.models.quantization import DECODER_PROJECTIONS
from flare.recipes.base import (DECODE_CAPACITIES, HISTORY_SPECULATION, ConcurrencyRange, Recipe,
                                SamplingDefaults, hub_checkpoint, sampling_ranges)

ARCHITECTURE = "Qwen2ForCausalLM"


def _config(hidden, layers, heads, kv_heads, intermediate, vocab, tied):
    return {"model_type": "qwen2", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": kv_heads,
            "intermediate_size": intermediate, "vocab_size": vocab, "max_position_embeddings": 32768,
            "tie_word_embeddings": tied, "torch_dtype": "bfloat16"}


_checkpoint = partial(hub_checkpoint, ARCHITECTURE, "Qwen")


# Revisions are commits quoted for these repositories in public code. Qwen2.5-7B-Instruct's
# stored_bytes is its index's total_size; Qwen2.5-0.5B-Instruct's is computed from the config's
# shapes in bfloat16 (tied embeddings, no stored output projection), matching its published
# 0.49B parameters. The tests recompute both.
CHECKPOINTS = (
    _checkpoint("qwen2.5-0.5b-instruct", "Qwen2.5-0.5B-Instruct", "7ae557604adf67be50417f59c2c2f167def9a775",
                988_065_536, _config(896, 24, 14, 2, 4864, 151936, tied=True)),
    _checkpoint("qwen2.5-7b-instruct", "Qwen2.5-7B-Instruct", "a09a35458c702b33eeacc393d103063234e8bc28",
                15_231_233_024, _config(3584, 28, 28, 4, 18944, 152064, tied=False)),
)

# generation_config.json of Qwen2.5-7B-Instruct (also the Qwen documentation's "default decoding
# hyperparameters"): temperature 0.7, top-p 0.8, top-k 20, repetition penalty 1.05.
SAMPLING = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, repetition_penalty=1.05,
                            ranges=sampling_ranges(),
                            source="generation_config.json of Qwen2.5-7B-Instruct")

# Qwen2.5-0.5B-Instruct's generation_config.json raises the repetition penalty to 1.1.
SMALL_SAMPLING = SamplingDefaults(temperature=0.7, top_p=0.8, top_k=20, min_p=0.0, repetition_penalty=1.1,
                                  ranges=sampling_ranges(),
                                  source="generation_config.json of Qwen2.5-0.5B-Instruct")

RECIPE = Recipe(
    family="qwen2",
    title="Qwen2 / Qwen2.5",
    architectures=(ARCHITECTURE,),
    checkpoints=CHECKPOINTS,
    tensor_parallel_sizes=(1, 2, 4, 8),        # limited per checkpoint by its KV heads (2 or 4 here)
    concurrency=ConcurrencyRange(minimum=1, default=32, maximum=256),
    page_size=16,
    prefill_chunk=4096,                        # spec section 4: 4,096 tokens for Qwen
    decode_capacities=DECODE_CAPACITIES,
    speculation=HISTORY_SPECULATION,
    sampling=SAMPLING,
    online_fp8_projections=DECODER_PROJECTIONS,
    sampling_by_alias={"qwen2.5-0.5b-instruct": SMALL_SAMPLING},
)
