"""DeepSeek-V2 and V3 packages served by a real `flare run` over HTTP: tiny random checkpoints written by
transformers (V2: softmax greedy routing, no query LoRA, a dense first layer; V3: a query LoRA, grouped
sigmoid routing with its correction bias, YaRN with an attention scale) answer transformers' greedy
tokens exactly, and their packages count a cached token as its latent rows."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import torch

from tests.server.conftest import FlareProcess, cli_command, cli_env, export_package
from tiny_checkpoints import write_tiny_checkpoint

NEW_TOKENS = 24
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0, "original_max_position_embeddings": 32,
        "mscale": 1.0, "mscale_all_dim": 0.707}
VARIANTS = {"deepseek_v2": {}, "deepseek_v3": {"rope_parameters": YARN}}
PROMPTS = [[1, 45, 300, 12, 99, 7, 250], [1] + list(range(60, 100))]


@pytest.fixture(scope="module", params=list(VARIANTS))
def served(request, tmp_path_factory):
    """(family, flare home, package entry, transformers' greedy tokens per prompt, running server)."""
    from transformers import AutoModelForCausalLM

    home = tmp_path_factory.mktemp(f"flare-home-{request.param}")
    checkpoint = write_tiny_checkpoint(request.param, tmp_path_factory.mktemp(request.param) / "tiny-deepseek",
                                       **VARIANTS[request.param])
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    expected = []
    for prompt in PROMPTS:
        ids = torch.tensor([prompt])
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=NEW_TOKENS, do_sample=False,
                             pad_token_id=0, eos_token_id=None)
        expected.append(out[0, len(prompt):].tolist())
    entry = export_package(checkpoint, home, "--max-concurrency", "4")
    process = FlareProcess(home, "tiny-deepseek")
    process.start()
    yield request.param, home, entry, expected, process
    process.stop()


def test_greedy_tokens_over_http_are_transformers_tokens(served):
    _, _, _, expected, server = served
    for prompt, tokens in zip(PROMPTS, expected):
        reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
            "model": "tiny-deepseek", "prompt": prompt, "max_tokens": NEW_TOKENS, "temperature": 0,
            "ignore_eos": True})
        assert reply.status_code == 200, reply.text
        choice = reply.json()["choices"][0]
        assert reply.json()["usage"]["completion_tokens"] == NEW_TOKENS
        assert choice["text"] == _text(prompt, tokens)


def _text(prompt, tokens) -> str:
    """The tokens' text as the server streams it, one token a step: random weights pick byte-fallback tokens
    whose characters the incremental detokenizer completes or holds back."""
    from flare.frontend.detokenizer import IncrementalDetokenizer
    from flare.frontend.tokenizer import load_tokenizer

    from tiny_checkpoints import STORIES260K
    detokenizer = IncrementalDetokenizer(load_tokenizer(STORIES260K), prompt)
    return "".join(detokenizer.add([token]) for token in tokens)


def test_the_package_counts_a_cached_token_as_its_latent_rows(served):
    """Two layers of one 48-value row (32-wide latent, 16-wide rotary key) in float32: 384 bytes, where K and V
    of 4 heads would take 2 x 2 x 4 x (16 + 16) x 4 = 2,048."""
    _, home, entry, _, _ = served
    done = subprocess.run(cli_command("flare", "inspect", entry, "--json", "--memory-map", "--unverified"),
                          env=cli_env(home), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["capacities"]["kv_bytes_per_token"] == 2 * (32 + 16) * 4
