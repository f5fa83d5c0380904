"""The engine on the Triton backend through mixed steps (requests decoding while a prompt is prefilled in
chunks): the runner marks the leading decodes, the backend splits the step between the decode and the
prefill kernels, and the greedy tokens equal those of the pure-PyTorch reference backend."""

from __future__ import annotations

import pytest
import torch

from flare.engine.config import EngineConfig
from flare.engine.core import EngineCore
from flare.engine.request import EngineRequest
from flare.engine.runner import ModelRunner
from flare.engine.sampling_params import SamplingParams
from tiny_checkpoints import write_tiny_checkpoint

CONFIG = EngineConfig(max_concurrency=4, page_size=16, num_pages=32, max_model_len=128, prefill_chunk=16,
                      max_num_batched_tokens=32, enable_prefix_caching=False)
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    return write_tiny_checkpoint("llama", tmp_path_factory.mktemp("llama"))       # 16-wide heads


def run_staggered(directory, backend, device):
    """Two short requests start; once they decode, a 40-token prompt arrives and is prefilled in chunks
    of 16 beside them. Returns (tokens per request, the num_decodes of every step that ran eagerly)."""
    from flare.engine.attention import AttentionMetadata
    from flare.models import load_checkpoint

    cfg, model = load_checkpoint(directory, torch.float32, device, backend)
    runner = ModelRunner(model, cfg, CONFIG, device, torch.float32, seed=0, graphs=False)
    seen = []
    real_forward = backend.forward

    def observed(query, key, value, kv_cache, meta: AttentionMetadata, scale):
        seen.append(meta.num_decodes)
        return real_forward(query, key, value, kv_cache, meta, scale)

    backend.forward = observed
    return staggered_tokens(EngineCore(CONFIG, runner), cfg.vocab_size), seen


def staggered_tokens(core: EngineCore, vocab_size: int) -> dict[str, list[int]]:
    """Requests of 5 and 9 prompt tokens; once the first has its first token, one of 40 arrives. Greedy
    tokens per request."""
    generator = torch.Generator().manual_seed(5)

    def add(request_id, length):
        prompt = tuple(torch.randint(3, vocab_size, (length,), generator=generator).tolist())
        core.add_request(EngineRequest(request_id, prompt, GREEDY))

    add("a", 5)
    add("b", 9)
    tokens: dict[str, list[int]] = {}
    while core.has_unfinished():
        for output in core.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
        if "long" not in core.requests and len(tokens.get("a", ())) == 1:
            add("long", 40)
    return tokens


def test_mixed_steps_on_the_triton_backend_give_the_reference_tokens(kernel_device, tiny_llama):
    from flare.engine.attention import TorchReferenceBackend
    from flare.engine.attention_triton import TritonBackend

    expected, _ = run_staggered(tiny_llama, TorchReferenceBackend(), kernel_device)
    tokens, num_decodes = run_staggered(tiny_llama, TritonBackend(), kernel_device)
    assert tokens == expected and sorted(tokens) == ["a", "b", "long"]
    assert 2 in num_decodes          # steps where a and b decoded beside a chunk of the long prompt
