"""Llama 3.x models (LlamaForCausalLM): GQA, no attention bias, llama3 RoPE scaling."""

from __future__ import annotations

from functools import partial

from flare.models.quantization import DECODER_PROJECTIONS
from flare.recipes.base import (DECODE_CAPACITIES, HISTORY_SPECULATION, Checkpoint, ConcurrencyRange, Recipe,
                                SamplingDefaults, decode_weight_bytes, draft_speculation, hub_checkpoint,
                                sampling_ranges)

ARCHITECTURE = "LlamaForCausalLM"


def _config(hidden, layers, heads, head_dim, intermediate, tied):
    """Llama 3.1/3.2 share 8 KV heads, a 128,256-token vocabulary and 131,072 positions."""
    return {"model_type": "llama", "hidden_size": hidden, "num_hidden_layers": layers,
            "num_attention_heads": heads, "num_key_value_heads": 8, "head_dim": head_dim,
            "intermediate_size": intermediate, "vocab_size": 128256, "max_position_embeddings": 131072,
            "tie_word_embeddings": tied, "attention_bias": False, "torch_dtype": "bfloat16"}


_checkpoint = partial(hub_checkpoint, ARCHITECTURE, "meta-llama")


# Revisions are commits quoted for these (gated) repositories in public code. stored_bytes:
# Llama-3.1-8B/70B-Instruct's and Llama-3.2-3B-Instruct's are their published tensor totals;
# Llama-3.2-1B-Instruct's is computed from the config's shapes in bfloat16 (tied, no stored output
# projection), matching its published 1.24B parameters. The tests recompute all three.
CHECKPOINTS = (
    _checkpoint("llama-3.2-1b-instruct", "Llama-3.2-1B-Instruct", "9213176726f574b556790deb65791e0c5aa438b6",
                2_471_628_800, _config(2048, 16, 32, 64, 8192, tied=True)),
    _checkpoint("llama-3.2-3b-instruct", "Llama-3.2-3B-Instruct", "0cb88a4f764b7a12671c53f0838cd831a0843b95",
                6_425_499_648, _config(3072, 28, 24, 128, 8192, tied=True)),
    _checkpoint("llama-3.1-8b-instruct", "Llama-3.1-8B-Instruct", "0e9e39f249a16976918f6564b8830bc894c89659",
                16_060_522_496, _config(4096, 32, 32, 128, 14336, tied=False)),
    _checkpoint("llama-3.1-70b-instruct", "Llama-3.1-70B-Instruct", "1605565b47bb9346c5515c34102e054115b4f98b",
                141_107_412_992, _config(8192, 80, 64, 128, 28672, tied=False)),
)

# RedHatAI's FP8 Llama (llm-compressor's FP8_DYNAMIC: e4m3 weights with a scale per output channel,
# lm_head ignored; compressed-tensors, named "naive-quantized" in its config as a public model list
# records). No commit of this repository could be confirmed, so it is unpinned: the hub's current
# commit is used and reported. Its stored size is not declared for the same reason.
_FP8_DYNAMIC = {"quant_method": "compressed-tensors", "format": "naive-quantized", "ignore": ["lm_head"],
                "config_groups": {"group_0": {
                    "targets": ["Linear"],
                    "weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": True,
                                "dynamic": False},
                    "input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "symmetric": True,
                                          "dynamic": True}}}}
_FP8_CONFIG = _config(4096, 32, 32, 128, 14336, tied=False) | {"quantization_config": _FP8_DYNAMIC}
FP8_CHECKPOINTS = (
    Checkpoint(alias="llama-3.1-8b-instruct-fp8", architecture=ARCHITECTURE,
               served_name="Meta-Llama-3.1-8B-Instruct-FP8-dynamic",
               repo_id="RedHatAI/Meta-Llama-3.1-8B-Instruct-FP8-dynamic", revision=None, stored_bytes=None,
               decode_weight_bytes=decode_weight_bytes(_FP8_CONFIG), config=_FP8_CONFIG),
)

# generation_config.json of the Llama 3.1/3.2 Instruct checkpoints: temperature 0.6, top-p 0.9
# (no top-k, no min-p). The cards give no ranges, so the API's own apply.
SAMPLING = SamplingDefaults(temperature=0.6, top_p=0.9, top_k=0, min_p=0.0, ranges=sampling_ranges(),
                            source="generation_config.json of Llama-3.1-8B-Instruct")

# Llama-3.2-1B-Instruct drafts for Llama 3.1 8B and 70B: the same 128,256-token vocabulary (above); export
# checks that the two config.json files agree before anything is written.
# An EAGLE-3 head exists for Llama-3.1-8B-Instruct: yuhuili/EAGLE3-LLaMA3.1-Instruct-8B (commit
# 61aa096484ad9752292507b0cc9973bb423abb35 is quoted as a snapshot of it in public code; others are too).
# Public download scripts fetch its config.json and pytorch_model.bin: a pickle, which Flare does not
# read, so it is not declared here. Converted to safetensors and put in a checkpoint's draft/ folder,
# it drafts (flare.models.eagle3, flare.engine.speculation.eagle3).
SPECULATION_BY_ALIAS = {alias: draft_speculation(CHECKPOINTS[0], "Llama-3.2-1B-Instruct")
                        for alias in ("llama-3.1-8b-instruct", "llama-3.1-70b-instruct", "llama-3.1-8b-instruct-fp8")}

RECIPE = Recipe(
    family="llama",
    title="Llama 3.x",
    architectures=(ARCHITECTURE,),
    checkpoints=CHECKPOINTS + FP8_CHECKPOINTS,
    tensor_parallel_sizes=(1, 2, 4, 8),        # limited per checkpoint by its 8 KV heads
    concurrency=ConcurrencyRange(minimum=1, default=32, maximum=256),
    page_size=16,
    # 2,048 rather than Qwen's 4,096: while a chunk runs, every active request waits for its next
    # token, and with a 128k context the long-prompt case is common; half the chunk halves that stall
    # at the cost of one more step per 4,096 prompt tokens.
    prefill_chunk=2048,
    decode_capacities=DECODE_CAPACITIES,
    speculation=HISTORY_SPECULATION,
    speculation_by_alias=SPECULATION_BY_ALIAS,
    sampling=SAMPLING,
    online_fp8_projections=DECODER_PROJECTIONS,
)
