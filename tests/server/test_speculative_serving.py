"""`flare run --history-drafts` on an exported stories260k package: the greedy answer is the model's own,
the counters of speculation reach /metrics, the startup report states the settings, and a draft count
beyond the package's is refused before anything loads. A real `flare run` subprocess."""

from __future__ import annotations

import subprocess

import httpx
import pytest

from tests.server.conftest import FlareProcess, cli_env, export_package


@pytest.fixture(scope="module")
def package(stories260k, tmp_path_factory):
    home = tmp_path_factory.mktemp("speculative-home")
    return home, export_package(stories260k, home, "--max-concurrency", "2", "--mtp-draft-tokens", "4")


def scrape(url: str) -> dict[str, float]:
    samples = {}
    for line in httpx.get(url + "/metrics").text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def greedy_text(stories260k, prompt: str, max_tokens: int) -> str:
    """The model's greedy continuation without speculation, in this process."""
    from flare.engine.sampling_params import SamplingParams
    from flare.engine_client.llm_engine import LLMEngine

    [output] = LLMEngine.from_checkpoint(stories260k).generate([prompt], SamplingParams(temperature=0,
                                                                                        max_tokens=max_tokens))
    return output.new_text


def test_history_drafts_serve_the_models_greedy_answer_and_count_their_rounds(package, stories260k):
    home, entry = package
    prompt = "Tom had a red ball. Tom had a red ball. Tom had a"      # its answer repeats it
    process = FlareProcess(home, entry, "--history-drafts").start()
    try:
        answer = httpx.post(process.url + "/v1/completions", timeout=60, json={
            "model": "stories260k", "prompt": prompt, "max_tokens": 60, "temperature": 0}).json()
        assert answer["choices"][0]["text"] == greedy_text(stories260k, prompt, 60)
        samples = scrape(process.url)
        log = process.log
    finally:
        process.stop()
    assert samples["flare_spec_decode_rounds_total"] > 0
    assert 0 < samples["flare_spec_decode_accepted_tokens_total"] <= samples["flare_spec_decode_draft_tokens_total"]
    assert samples['flare_spec_decode_draft_tokens_per_position_total{position="0"}'] > 0
    assert 1.0 < samples["flare_spec_decode_mean_accepted_length"] <= 5.0
    assert "speculation: up to 4 draft tokens while verification adapts; history drafts on" in log


def test_a_draft_count_beyond_the_package_is_refused_before_the_weights_load(package):
    home, entry = package
    args = FlareProcess(home, entry, "--mtp-draft-tokens", "5").args
    done = subprocess.run(args, env=cli_env(home), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    assert "--mtp-draft-tokens 5 is outside the package's prepared 0 through 4" in done.stderr
    assert "Load weights" not in done.stderr
