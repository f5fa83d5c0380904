"""FP8 packages served by a real `flare run` over HTTP, one server per package: an FP8 checkpoint of each
layout real ones ship (block-scaled, compressed-tensors), and `ignition export --online-mxfp8
--kv-cache-dtype fp8` of the stories260k fixture. Each answer is the greedy text of an engine built
another way from the same numbers: the checkpoint's weights multiplied back to float32, or the BF16
checkpoint converted to FP8 while loading. `flare inspect` shows each payload's storage format."""

from __future__ import annotations

import json
import subprocess

import httpx
import pytest
import torch

from fp8_checkpoints import write_block_fp8, write_compressed_tensors_fp8, write_dequantized
from tests.server.conftest import FlareProcess, cli_command, cli_env, export_package

PROMPT = "Once upon a time, there was a little girl"
MAX_TOKENS = 24
ONLINE = ("--online-mxfp8", "--kv-cache-dtype", "fp8")


@pytest.fixture(scope="module", params=["block", "compressed-tensors", "online"])
def served(request, tmp_path_factory, stories260k):
    """(layout, flare home, package entry, running server), the checkpoint named stories260k throughout."""
    home = tmp_path_factory.mktemp(f"flare-home-{request.param}")
    checkpoints = tmp_path_factory.mktemp(f"checkpoint-{request.param}")
    if request.param == "block":
        checkpoint = write_block_fp8(stories260k, checkpoints / "stories260k")
    elif request.param == "compressed-tensors":
        checkpoint = write_compressed_tensors_fp8(stories260k, checkpoints / "stories260k", "channel")
    else:
        checkpoint = stories260k
    flags = ONLINE if request.param == "online" else ()
    entry = export_package(checkpoint, home, *flags, "--max-concurrency", "4")
    process = FlareProcess(home, "stories260k")
    process.start()
    yield request.param, home, entry, checkpoint, process
    process.stop()


def reference_text(layout: str, checkpoint, tmp_path) -> str:
    """The greedy continuation of PROMPT from an in-process engine that never saw the package."""
    from flare.engine.attention import TorchReferenceBackend
    from flare.engine.config import EngineConfig
    from flare.engine.sampling_params import SamplingParams
    from flare.engine_client.llm_engine import LLMEngine
    from flare.frontend.tokenizer import load_tokenizer
    from flare.models import load_checkpoint
    from flare.models.quantization import DECODER_PROJECTIONS

    config = EngineConfig(page_size=16, num_pages=64, max_model_len=512)
    if layout == "online":
        cfg, model = load_checkpoint(checkpoint, torch.float32, "cpu", TorchReferenceBackend(),
                                     online_fp8=DECODER_PROJECTIONS, kv_cache_dtype="fp8")
        engine = LLMEngine.from_model(model, cfg, load_tokenizer(checkpoint), config)
    else:
        engine = LLMEngine.from_checkpoint(write_dequantized(checkpoint, tmp_path / "dequantized"), config)
    [output] = engine.generate([PROMPT], SamplingParams(temperature=0, max_tokens=MAX_TOKENS, ignore_eos=True))
    return output.new_text


def test_the_served_answer_is_the_greedy_text_of_the_same_numbers(served, tmp_path):
    layout, _, _, checkpoint, server = served
    reply = httpx.post(server.url + "/v1/completions", timeout=60, json={
        "model": "stories260k", "prompt": PROMPT, "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True})
    assert reply.status_code == 200, reply.text
    assert reply.json()["choices"][0]["text"] == reference_text(layout, checkpoint, tmp_path)


def test_the_startup_report_names_the_kv_cache_format(served):
    layout, *_, server = served
    assert ("FP8 e4m3 with per-token scales" in server.log) == (layout == "online")


def test_inspect_shows_each_payloads_storage(served):
    layout, home, entry, _, _ = served
    done = subprocess.run(cli_command("flare", "inspect", entry, "--json", "--memory-map", "--unverified"),
                          env=cli_env(home), capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    report = json.loads(done.stdout)
    weights = report["capacities"]["weights"]
    assert "FP8 e4m3" in weights
    assert ("online from BF16 at export" in weights) == (layout == "online")
    assert ("compressed-tensors" in weights) == (layout == "compressed-tensors")
    assert report["capacities"]["kv_cache_dtype"] == ("fp8" if layout == "online" else "auto")
    layers = [p for p in report["memory_map"][0]["payloads"] if p["name"].startswith("weights/layer-")]
    assert layers and all(set(p["storage"]) == {"F8_E4M3", "F32"} for p in layers)
    text = subprocess.run(cli_command("flare", "inspect", entry, "--plain", "--unverified"), env=cli_env(home),
                          capture_output=True, text=True, timeout=120).stdout
    assert "F8_E4M3" in text and "KV cache dtype" in text
