"""Our models give transformers' logits and greedy tokens, whole, in chunks through the paged cache, and batched."""

from __future__ import annotations

import pytest
import torch

from flare.engine.factory import attention_backend_for
from flare.models import load_checkpoint
from flare.models.loader import read_model_config
from models.paged_runner import PagedRunner
from tiny_checkpoints import write_tiny_checkpoint

LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0, "original_max_position_embeddings": 64}
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32}
VARIANTS = {
    "llama": ("llama", {}),
    "llama-tied": ("llama", {"tie_word_embeddings": True}),
    "llama-attention-bias": ("llama", {"attention_bias": True}),
    "qwen2": ("qwen2", {}),
    "qwen3": ("qwen3", {}),
    "qwen3-attention-bias": ("qwen3", {"attention_bias": True}),
    "mistral": ("mistral", {}),
    "rope-llama3": ("llama", {"rope_parameters": LLAMA3}),
    "rope-linear": ("llama", {"rope_parameters": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0}}),
    "rope-yarn": ("llama", {"rope_parameters": YARN, "max_position_embeddings": 128}),
    # the prompt and the decoded tokens run past the 48 trained positions, where dynamic scaling starts
    "rope-dynamic": ("llama", {"rope_parameters": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
                               "max_position_embeddings": 48}),
    # DeepSeek: MLA over the latent cache, DeepSeekMoE; YaRN with mscale != mscale_all_dim scales cos/sin
    # and the softmax both
    "deepseek-v2": ("deepseek_v2", {}),
    "deepseek-v2-group-limited": ("deepseek_v2", {"topk_method": "group_limited_greedy", "n_group": 4,
                                                  "topk_group": 2, "routed_scaling_factor": 1.5}),
    "deepseek-v3-yarn": ("deepseek_v3", {"rope_parameters": {**YARN, "factor": 8.0, "mscale": 1.0,
                                                             "mscale_all_dim": 0.707}}),
    "deepseek-v3-rotate-half": ("deepseek_v3", {"rope_interleave": False, "norm_topk_prob": False}),
}
TOKENS = torch.randint(3, 512, (56,), generator=torch.Generator().manual_seed(7)).tolist()
PROMPT_CHUNKS = [7, 5, 11, 17]  # 40 prompt tokens, then 16 decoded one at a time


@pytest.fixture(scope="module", params=list(VARIANTS))
def pair(request, tmp_path_factory):
    """(ModelConfig, our model, transformers' model) for one variant's tiny checkpoint."""
    from transformers import AutoModelForCausalLM

    family, overrides = VARIANTS[request.param]
    directory = write_tiny_checkpoint(family, tmp_path_factory.mktemp(request.param), **overrides)
    backend = attention_backend_for(read_model_config(directory), "cpu")    # the torch reference of its attention
    cfg, ours = load_checkpoint(directory, torch.float32, "cpu", backend)
    theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32, attn_implementation="eager")
    return cfg, ours, theirs.eval()


def assert_logits_match(ours: torch.Tensor, theirs: torch.Tensor) -> None:
    torch.testing.assert_close(ours, theirs, rtol=1e-4, atol=1e-4 * theirs.abs().max().item())


def transformers_logits(model, tokens: list[int], chunks: list[int]) -> torch.Tensor:
    """transformers' logits for `tokens`, fed in `chunks` with its own KV cache."""
    from transformers import DynamicCache

    cache, start, rows = DynamicCache(config=model.config), 0, []
    with torch.no_grad():
        for size in chunks:
            ids = torch.tensor([tokens[start : start + size]])
            rows.append(model(input_ids=ids, cache=cache, use_cache=True).logits[0])
            start += size
    return torch.cat(rows)


def test_whole_prompt_logits_match_transformers(pair):
    cfg, ours, theirs = pair
    logits = PagedRunner(cfg, ours).step({"a": TOKENS})["a"]
    assert_logits_match(logits, transformers_logits(theirs, TOKENS, [len(TOKENS)]))


def test_chunked_prefill_then_decode_through_the_paged_cache_matches_transformers(pair):
    cfg, ours, theirs = pair
    chunks = PROMPT_CHUNKS + [1] * (len(TOKENS) - sum(PROMPT_CHUNKS))
    runner, start, rows = PagedRunner(cfg, ours), 0, []
    for size in chunks:
        rows.append(runner.step({"a": TOKENS[start : start + size]})["a"])
        start += size
    assert_logits_match(torch.cat(rows), transformers_logits(theirs, TOKENS, chunks))


def test_sequences_batched_together_give_the_same_logits_as_alone(pair):
    cfg, ours, _ = pair
    short, long = TOKENS[:13], TOKENS[5:34]
    batched = PagedRunner(cfg, ours)
    together = [batched.step({"short": short, "long": long}), batched.step({"long": [41], "short": [97]})]
    alone = PagedRunner(cfg, ours, seed=1)
    alone_short = [alone.step({"s": short})["s"], alone.step({"s": [97]})["s"]]
    alone_long = [alone.step({"l": long})["l"], alone.step({"l": [41]})["l"]]
    for step in range(2):
        assert_logits_match(together[step]["short"], alone_short[step])
        assert_logits_match(together[step]["long"], alone_long[step])


def test_greedy_64_tokens_equal_transformers_generate(pair):
    cfg, ours, theirs = pair
    prompt = TOKENS[:9]
    with torch.no_grad():
        output = theirs.generate(torch.tensor([prompt]), do_sample=False, max_new_tokens=64, pad_token_id=0)
    expected = output[0, len(prompt) :].tolist()
    generated = PagedRunner(cfg, ours).greedy("a", prompt, 64, chunks=[4, 5], stop_ids=cfg.eos_token_ids)
    assert generated == expected
