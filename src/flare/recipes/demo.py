"""The built-in demonstration model: a small Llama-architecture checkpoint that `flare.demo` builds
locally (tokenizer and weights trained on the CPU), so the first run needs no download."""

from __future__ import annotations

from flare.models.quantization import DECODER_PROJECTIONS
from flare.recipes.base import (DECODE_CAPACITIES, HISTORY_SPECULATION, Checkpoint, ConcurrencyRange, Recipe,
                                SamplingDefaults, sampling_ranges)

ARCHITECTURE = "LlamaForCausalLM"

# No repository or revision: `flare.demo` builds the checkpoint, and its size and config.json are
# read from the built directory, so nothing is declared here that the build decides.
CHECKPOINTS = (
    Checkpoint(alias="demo", architecture=ARCHITECTURE, served_name="flare-demo", source="builtin"),
)

# A small model trained for a few minutes: plain sampling with a modest truncation reads best.
SAMPLING = SamplingDefaults(temperature=0.8, top_p=0.95, top_k=40, min_p=0.0, ranges=sampling_ranges(),
                            source="chosen for the demonstration model")

RECIPE = Recipe(
    family="demo",
    title="Flare demo (built locally)",
    architectures=(ARCHITECTURE,),
    checkpoints=CHECKPOINTS,
    tensor_parallel_sizes=(1,),
    # It usually runs on a CPU, where a small batch keeps each reply streaming steadily.
    concurrency=ConcurrencyRange(minimum=1, default=8, maximum=64),
    page_size=16,
    prefill_chunk=512,
    decode_capacities=tuple(size for size in DECODE_CAPACITIES if size <= 64),
    speculation=HISTORY_SPECULATION,
    sampling=SAMPLING,
    online_fp8_projections=DECODER_PROJECTIONS,
)
