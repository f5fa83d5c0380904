"""DeepSeek V4 on the Triton kernels (the interpreter on a CPU) gives transformers' logits through the paged
cache, as its torch references do (tests/models/test_deepseek_v4.py)."""

from __future__ import annotations

import torch

from deepseek_v4_checkpoints import write_tiny_v4_checkpoint
from flare.engine.attention_triton import TritonBackend
from flare.models import load_checkpoint
from models.test_deepseek_v4 import PROMPT_CHUNKS, TOKENS, assert_logits_match, transformers_logits
from models.v4_paged_runner import WindowPagedRunner


def test_chunked_prefill_then_decode_on_the_kernels_matches_transformers(tmp_path):
    from transformers import AutoModelForCausalLM

    checkpoint = write_tiny_v4_checkpoint(tmp_path / "v4")
    cfg, ours = load_checkpoint(checkpoint, torch.float32, "cpu", TritonBackend())
    assert ours.ops.__name__ == "flare.kernels.compressed_attention"
    theirs = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32).eval()
    tokens = TOKENS[:48]
    chunks = PROMPT_CHUNKS[:3] + [1] * (len(tokens) - sum(PROMPT_CHUNKS[:3]))
    runner, start, rows = WindowPagedRunner(cfg, ours, num_window_pages=12), 0, []
    for size in chunks:
        rows.append(runner.step({"a": tokens[start:start + size]})["a"])
        start += size
    assert_logits_match(torch.cat(rows), transformers_logits(theirs, tokens, [len(tokens)]))
