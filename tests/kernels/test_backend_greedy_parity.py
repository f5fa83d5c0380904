"""The numerics gate's CPU half: the Triton backend gives the pure-PyTorch reference backend's greedy tokens
through every kind of step a served model sees (a prompt, a decode beside a prompt chunk, an extend over
a cached prefix, verification-shaped steps of a few tokens per sequence, plain decodes), teacher-forced
and then free-running. Its GPU half, bf16 logits against transformers, is tests/models/test_numerics_gate.py."""

from __future__ import annotations

import pytest
import torch

from models.paged_runner import PagedRunner
from tiny_checkpoints import write_tiny_checkpoint

# Step by step, how many new tokens each sequence brings; "b" starts at the second step.
SCHEDULE = ([{"a": 21}, {"a": 1, "b": 13}, {"a": 9, "b": 7}]     # prompt, mixed step, extend over prefixes
            + [{"a": 4, "b": 4}] * 2 + [{"a": 2, "b": 2}]        # multi-query: a token and its drafts
            + [{"a": 1, "b": 1}] * 3)                             # decodes
FREE_TOKENS = 8


def run(directory, backend, device, tokens) -> dict[str, list[int]]:
    """Feed `tokens` by SCHEDULE, then decode FREE_TOKENS greedily; each sequence's greedy choice at every
    position it was fed and the tokens it then chose itself."""
    from flare.models import load_checkpoint

    cfg, model = load_checkpoint(directory, torch.float32, device, backend)
    runner = PagedRunner(cfg, model, page_size=16, num_pages=16, device=device)
    chosen: dict[str, list[int]] = {"a": [], "b": []}
    fed = {"a": 0, "b": 0}
    for step in SCHEDULE:
        logits = runner.step({name: tokens[name][fed[name]:fed[name] + count] for name, count in step.items()})
        for name, count in step.items():
            fed[name] += count
            chosen[name] += logits[name].argmax(dim=-1).tolist()
    for _ in range(FREE_TOKENS):
        logits = runner.step({name: chosen[name][-1:] for name in chosen})
        for name in chosen:
            chosen[name].append(int(logits[name][-1].argmax()))
    return chosen


def backends(family: str):
    """(the torch reference backend, the Triton backend) of a family's attention."""
    if family.startswith("deepseek"):
        from flare.engine.mla_attention import MlaReferenceBackend
        from flare.engine.mla_attention_triton import MlaTritonBackend

        return MlaReferenceBackend(), MlaTritonBackend()
    from flare.engine.attention import TorchReferenceBackend
    from flare.engine.attention_triton import TritonBackend

    return TorchReferenceBackend(), TritonBackend()


@pytest.mark.parametrize("family", ["llama", "qwen3", "deepseek_v2", "deepseek_v3"])
def test_triton_backend_greedy_tokens_equal_the_reference_backend(kernel_device, tmp_path, family):
    # 4 query heads over 2 KV heads, 16 wide; DeepSeek's 4 heads over a 32 + 16 latent row
    directory = write_tiny_checkpoint(family, tmp_path)
    generator = torch.Generator().manual_seed(11)
    lengths = {name: sum(step.get(name, 0) for step in SCHEDULE) for name in ("a", "b")}
    tokens = {name: torch.randint(3, 512, (length,), generator=generator).tolist() for name, length in lengths.items()}

    reference, triton = backends(family)
    expected = run(directory, reference, kernel_device, tokens)
    got = run(directory, triton, kernel_device, tokens)
    assert {name: len(ids) for name, ids in got.items()} == {n: lengths[n] + FREE_TOKENS for n in lengths}
    assert got == expected
