"""DeepSeek V4 through the product path: `ignition export` of a tiny random V4 checkpoint (all three attention
types, both kinds of experts), `flare run`, and HTTP. The served greedy text is transformers' greedy text;
a repeated long prompt comes from the prefix cache with the same answer; `flare inspect --memory-map`
states the cache's bytes per token and per 1M-token sequence."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import torch

from deepseek_v4_checkpoints import write_tiny_v4_checkpoint
from tests.server.conftest import FlareProcess, cli_command, cli_env, export_package

SHORT = "Once upon a time, there was a little girl"
LONG = " ".join(["The cat sat on the mat and looked at the moon."] * 9)       # ~180 tokens: past a 128-token page
MAX_TOKENS = 24


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    home = tmp_path_factory.mktemp("flare-home-v4")
    checkpoint = write_tiny_v4_checkpoint(tmp_path_factory.mktemp("checkpoint") / "tiny-v4")
    entry = export_package(checkpoint, home, "--max-concurrency", "4")
    process = FlareProcess(home, "tiny-v4")
    process.start()
    yield home, entry, checkpoint, process
    process.stop()


def transformers_greedy(checkpoint, prompt: str) -> tuple[int, list[float]]:
    """(prompt tokens, the log-probability of each greedy token) as transformers generates them from the
    tokens the server sees. A random tiny model writes byte tokens whose text does not round-trip, so the
    answers are compared by their tokens' log-probabilities: equal only where the tokens are."""
    from transformers import AutoModelForCausalLM

    from flare.frontend.tokenizer import load_tokenizer

    tokenizer = load_tokenizer(checkpoint)
    ids = tokenizer.encode(prompt)
    model = AutoModelForCausalLM.from_pretrained(checkpoint, dtype=torch.float32)
    model.generation_config.eos_token_id = None
    prompt_ids = torch.tensor([ids])
    out = model.generate(prompt_ids, attention_mask=torch.ones_like(prompt_ids), max_new_tokens=MAX_TOKENS,
                         do_sample=False, pad_token_id=0, output_logits=True, return_dict_in_generate=True)
    chosen = out.sequences[0, len(ids):]
    logprobs = [torch.log_softmax(step[0].float(), -1)[token].item() for step, token in zip(out.logits, chosen)]
    return len(ids), logprobs


def complete(server, prompt: str) -> dict:
    reply = httpx.post(server.url + "/v1/completions", timeout=120, json={
        "model": "tiny-v4", "prompt": prompt, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
        "logprobs": 0})
    assert reply.status_code == 200, reply.text
    return reply.json()


@pytest.mark.parametrize("prompt", [SHORT, LONG], ids=["short", "long"])
def test_the_served_greedy_text_is_transformers(served, prompt):
    _, _, checkpoint, server = served
    prompt_tokens, expected = transformers_greedy(checkpoint, prompt)
    body = complete(server, prompt)
    assert body["usage"]["prompt_tokens"] == prompt_tokens
    assert body["usage"]["completion_tokens"] == MAX_TOKENS
    assert body["choices"][0]["logprobs"]["token_logprobs"] == pytest.approx(expected, abs=1e-4)


def test_a_repeated_long_prompt_comes_from_the_prefix_cache(served):
    *_, server = served
    first = complete(server, LONG)["choices"][0]["text"]
    stats = httpx.get(server.url + "/v1/engine/stats").json()
    again = complete(server, LONG)["choices"][0]["text"]
    after = httpx.get(server.url + "/v1/engine/stats").json()
    assert again == first
    assert after["prefix_cache_hit_tokens"] - stats["prefix_cache_hit_tokens"] >= 128


def test_inspect_states_the_cache_per_token_and_per_million_tokens(served):
    home, entry, _, _ = served
    done = subprocess.run(cli_command("flare", "inspect", entry, "--json", "--memory-map", "--unverified"),
                          env=cli_env(home), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    cache = json.loads(done.stdout)["memory_map"][0]["cache"]
    # Two CSA layers (a 32-wide entry and a 16-wide indexer key per 4 tokens) and one HCA layer (a 32-wide
    # entry per 8 tokens), float32: (2 x (32 + 16) / 4 + 32 / 8) x 4 bytes
    assert cache["bytes_per_token"] == (2 * (32 + 16) / 4 + 32 / 8) * 4 == 112
    assert set(cache["kinds"]) == {"tokens", "window"}
    assert cache["context_bytes"][str(1 << 20)] == (1 << 20) * 112 + 2 * cache["kinds"]["window"]["page_bytes"]
