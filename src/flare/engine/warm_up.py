"""Warm-up requests through an engine core: the kernels of every kind of step built and loaded before
anything is measured or served.

Export runs them once its GPU compiles the model (flare.preparation's compile stage), so the package
carries the kernels they built; the serving core runs them once on a GPU before it reports Ready
(`warm_up_kernels`): a kernel's first launch in a process loads it (from the package's Triton cache, or
builds it where a specialization is missing) while its step waits.
"""

from __future__ import annotations

import random

WARM_UP_SHORT_PROMPT = 40    # the second warm-up request: prefilled while the first one decodes
# The last warm-up request: a prompt of a few tokens, which attention serves with the multi-query kernel
# (steps of 2..16 tokens per sequence, flare.kernels.multi_query_attention.MAX_QUERY_TOKENS), as a short
# chat turn or a prefix-cache hit's remainder does; unwarmed, the first such request built it while serving.
WARM_UP_FEW_TOKENS = 9


def warm_up_prompt_tokens(prefill_chunk: int, max_model_len: int) -> int:
    """A full chunk, then a remainder of another size (within the context, leaving two output tokens)."""
    return max(1, min(prefill_chunk + prefill_chunk // 2 + 1, max_model_len - 2))


def warm_up(core, vocab_size: int, prompt_tokens: int) -> None:
    """Run greedy requests of random ids through `core`: one of `prompt_tokens` and two output tokens
    compiles the prefill shapes (full chunks and a remainder) and replays a decode graph; when the
    engine runs two requests at once, a short second one arrives as the first decodes, so a mixed step
    (decode and prefill kernels in one step) is compiled too. A prompt of a few tokens comes last
    (WARM_UP_FEW_TOKENS)."""
    from flare.engine.request import EngineRequest
    from flare.engine.sampling_params import SamplingParams

    ids = random.Random(0)                               # the same warm-up every time

    def request(name: str, length: int) -> EngineRequest:
        prompt = tuple(ids.randrange(3, max(4, vocab_size)) for _ in range(length))
        return EngineRequest(name, prompt, SamplingParams(temperature=0, max_tokens=2, ignore_eos=True))

    core.add_request(request("flare-warm-up", prompt_tokens))
    short_pending = core.config.max_concurrency > 1
    while core.has_unfinished():
        core.step()
        first = core.requests.get("flare-warm-up")
        if short_pending and first is not None and first.num_output_tokens == 1:
            core.add_request(request("flare-warm-up-mixed", WARM_UP_SHORT_PROMPT))
            short_pending = False
    core.add_request(request("flare-warm-up-few", WARM_UP_FEW_TOKENS))
    while core.has_unfinished():
        core.step()


def warm_up_kernels(core) -> bool:
    """On a GPU, before serving: export's warm-up requests once in this process, then the counters they
    moved are zeroed. On the H200 the first requests after start waited for 11 kernel loads (4.9 s) at
    c=1, outside the decode graphs that start-up captures. The warm-up's random prompt may stay in the
    prefix cache, evictable. Returns whether it ran (not off a GPU, nor beside requests)."""
    device = getattr(core.runner, "device", None)
    if getattr(device, "type", None) != "cuda" or core.has_unfinished():
        return False
    warm_up(core, core.runner.vocab_size, warm_up_prompt_tokens(core.config.prefill_chunk, core.config.max_model_len))
    core.reset_counters()
    return True
