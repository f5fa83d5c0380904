"""benchmarks/host_pipeline.py: the serving path with a stand-in device runs end to end (every request
gets all its tokens through the real core process, IPC, frontend and HTTP) and its steps are paced
like one device running them back to back."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from benchmark_scripts import benchmark_module

REPO = Path(__file__).resolve().parents[1]
SCRIPT = REPO / "benchmarks" / "host_pipeline.py"

# 2 ms a decode step at any batch, 3 ms with prompt work: a small, known price.
COSTS = {"device": "test device", "decode_context": 1024, "decode_batches": [1, 64], "prompt_tokens": [0, 2048],
         "milliseconds": [[2.0, 3.0], [2.0, 3.0]]}


@pytest.fixture(scope="module")
def pipeline():
    with benchmark_module("host_pipeline") as module:
        yield module


class Row:
    def __init__(self, num_new_tokens: int) -> None:
        self.num_new_tokens = num_new_tokens


class Plan:
    def __init__(self, *tokens: int) -> None:
        self.rows = tuple(Row(count) for count in tokens)


class Launched:
    def __init__(self, plan) -> None:
        self.plan = plan

    def result(self):
        return self.plan


class InnerRunner:
    vocab_size = 7

    def launch(self, plan):
        return Launched(plan)


class PricedCosts:
    def __init__(self) -> None:
        self.asked = []

    def step_ms(self, decodes: int, prompt: int) -> float:
        self.asked.append((decodes, prompt))
        return 50.0


def test_a_step_waits_for_the_one_before_it_and_costs_its_decodes_and_prompt_tokens(pipeline):
    costs = PricedCosts()
    runner = pipeline.PacedRunner(InnerRunner(), costs)
    started = time.perf_counter()
    first = runner.launch(Plan(1, 1, 300))
    second = runner.launch(Plan(1, 1, 1))
    assert costs.asked == [(2, 300), (3, 0)]
    assert second.ready_at - first.ready_at == pytest.approx(0.050)     # queued behind the first
    assert first.ready_at - started == pytest.approx(0.050, abs=0.02)
    plan = second.pending.plan
    assert second.result() is plan and time.perf_counter() >= second.ready_at


@pytest.mark.slow
def test_the_stand_in_pipeline_serves_every_token_of_every_request_and_writes_the_table(tmp_path):
    costs = tmp_path / "costs.json"
    costs.write_text(json.dumps(COSTS))
    output = tmp_path / "result.json"
    done = subprocess.run([sys.executable, str(SCRIPT), "--costs", str(costs), "--cases", "4x24x12,2x16x5",
                           "--requests", "6", "--output", str(output)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    document = json.loads(output.read_text())
    assert document["costs_device"] == "test device" and document["commit"]
    cases = document["cases"]
    assert [(row["case"]["concurrency"], row["case"]["output_len"]) for row in cases] == [(4, 12), (2, 5)]
    for row in cases:
        served, length = row["served"], row["case"]["output_len"]
        assert served["requests"] == 6 and served["failed"] == 0 and served["short_outputs"] == 0
        assert served["output_tokens"] == 6 * length
        assert served["tpot_ms"]["p50"] > 0 and served["itl_ms"]["p99"] > 0
        assert row["predicted"]["output_tokens_per_s"] > 0 and row["predicted"]["steps"] >= length
        assert row["ratio"] == pytest.approx(served["output_tokens_per_s"] / row["predicted"]["output_tokens_per_s"])
        for process in ("frontend", "core"):
            assert row["cpu"][process]["seconds"] > 0 and row["cpu"][process]["utilisation"] > 0
            assert row["cpu"][process]["ms_per_output_token"] > 0
    assert "4 x 24/12" not in done.stdout or "ratio" in done.stdout
