"""The `ignition bench` harness on the CPU: statistics, JSON, progress and the incomplete status."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from flare.bench import BenchConfig, median_and_iqr, parse_int_list, run_bench
from flare.errors import UsageError

REPO = Path(__file__).resolve().parents[1]


class CountingTarget:
    """A cheap decode step whose 'time' is known: batch + context/1000 + repetition index/100 ms.
    It checks that every timed step starts from restored state."""

    def __init__(self, fail_at=None):
        self.fail_at = fail_at
        self.log = []
        self.case = None
        self.dirty = False

    def prepare(self, batch, context, seed):
        if (batch, context, seed) == self.fail_at:
            raise RuntimeError("out of pages")
        self.case = (batch, context, seed)
        self.count = 0
        self.dirty = False

    def restore(self):
        self.dirty = False

    def step(self):
        assert not self.dirty, "a step ran on state a previous step changed"
        self.dirty = True
        self.count += 1
        self.log.append(self.case)


def fake_timer(target):
    def timed(step):
        step()
        batch, context, _ = target.case
        return batch + context / 1000 + target.count / 100
    return timed


CONFIG = BenchConfig(batches=(1, 4), contexts=(128, 256), warmup=2, repetitions=3, seeds=(0, 7))


def test_a_complete_run_writes_statistics_and_raw_samples(tmp_path):
    target = CountingTarget()
    output = tmp_path / "out" / "bench.json"
    progress = []
    result = run_bench(target, CONFIG, fake_timer(target), device={"name": "cpu"},
                       configuration={"model": "m"}, output=output, progress=progress.append)
    document = json.loads(output.read_text())
    assert document["status"] == "complete" and "failure" not in document
    assert document["ignore_eos"] is True
    assert document["device"] == {"name": "cpu"}
    assert document["configuration"]["seeds"] == [0, 7] and document["configuration"]["model"] == "m"
    case = next(case for case in document["cases"] if (case["batch"], case["context"]) == (4, 256))
    # warm-up steps are 1-2, timed steps 3-5 for each seed: 4.256 + 0.03/0.04/0.05
    assert case["samples_ms"] == {"0": pytest.approx([4.286, 4.296, 4.306]),
                                  "7": pytest.approx([4.286, 4.296, 4.306])}
    assert case["median_ms"] == pytest.approx(4.296)
    assert case["complete"] is True
    medians = [case["median_ms"] for case in document["cases"]]
    assert document["aggregate_ms"] == pytest.approx(sum(medians) / 4)
    assert len(target.log) == 2 * 4 * (2 + 3)
    assert len(progress) == 2 and progress[0].startswith("seed 0:")
    assert "aggregate" in result.table()


def test_a_failed_run_keeps_partial_samples_as_incomplete(tmp_path):
    target = CountingTarget(fail_at=(4, 128, 7))
    output = tmp_path / "bench.json"
    with pytest.raises(RuntimeError, match="out of pages"):
        run_bench(target, CONFIG, fake_timer(target), device={}, configuration={}, output=output,
                  progress=lambda line: None)
    document = json.loads(output.read_text())
    assert document["status"] == "incomplete"
    assert document["failure"] == "RuntimeError: out of pages"
    assert "aggregate_ms" not in document
    complete = {(case["batch"], case["context"]): case["complete"] for case in document["cases"]}
    assert complete == {(1, 128): True, (1, 256): True, (4, 128): False, (4, 256): False}
    partial = next(case for case in document["cases"] if (case["batch"], case["context"]) == (4, 128))
    assert list(partial["samples_ms"]) == ["0"] and len(partial["samples_ms"]["0"]) == 3


def test_progress_is_written_after_each_seed(tmp_path):
    output = tmp_path / "bench.json"
    target = CountingTarget()
    seen = []

    def progress(line):
        seen.append(json.loads(output.read_text())["status"])

    run_bench(target, CONFIG, fake_timer(target), device={}, configuration={}, output=output, progress=progress)
    assert seen == ["incomplete", "incomplete"]
    assert json.loads(output.read_text())["status"] == "complete"


def test_median_and_interquartile_range():
    assert median_and_iqr([1.0, 2.0, 3.0, 4.0, 5.0]) == (3.0, 2.0)
    assert median_and_iqr([2.5]) == (2.5, 0.0)


@pytest.mark.parametrize("text,kwargs,message", [
    ("1,2,2", {}, "repeated"), ("1,x", {}, "whole numbers"), ("0,1", {}, "positive"),
    ("512,1000", {"multiple_of": 128}, "multiples of 128"), ("", {}, "whole numbers"),
])
def test_bad_lists_are_usage_errors(text, kwargs, message):
    with pytest.raises(UsageError, match=message):
        parse_int_list(text, "--flag", **kwargs)


def test_bench_help_lists_the_flags_without_importing_torch():
    import subprocess
    import sys

    code = ("import sys; from flare.cli.ignition import main; code = main(['bench', '--help']); "
            "assert 'torch' not in sys.modules, 'help imported torch'; sys.exit(code)")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0, done.stderr
    for flag in ("--batches", "--contexts", "--warmup", "--repetitions", "--seeds", "--output"):
        assert flag in done.stdout


def test_bench_rejects_bad_flags_with_exit_2(capsys):
    from flare.cli.ignition import main

    assert main(["bench", "--contexts", "500"]) == 2
    assert "multiples of 128" in capsys.readouterr().err


def test_model_decode_step_continues_its_prefilled_context(tmp_path):
    """The measured step decodes the pending token over the prefilled pages, and restore makes every
    step start from the same state: its greedy token is that of the whole sequence run at once."""
    import torch

    from flare.bench_model import ModelDecodeTarget
    from flare.engine.attention import AttentionMetadata, TorchReferenceBackend, allocate_kv_caches
    from flare.models import load_checkpoint
    from tiny_checkpoints import write_tiny_checkpoint

    cfg, model = load_checkpoint(write_tiny_checkpoint("llama", tmp_path), torch.float32, "cpu",
                                 TorchReferenceBackend())
    target = ModelDecodeTarget(model, cfg, max_batch=2, max_context=40, page_size=16, device="cpu",
                               dtype=torch.float32, graph=False)
    target.prepare(batch=2, context=20, seed=5)
    target.restore()
    target.step()
    first = target.sampled.clone()
    target.restore()
    target.step()
    assert torch.equal(target.sampled, first)

    tokens = torch.randint(0, cfg.vocab_size, (2, 21), generator=torch.Generator().manual_seed(5))
    caches = allocate_kv_caches(cfg, 4, 16, torch.float32, "cpu")
    meta = AttentionMetadata.build([21, 21], [21, 21], [[0, 1], [2, 3]], 16)
    with torch.inference_mode():
        hidden = model(tokens.flatten(), meta.positions(), caches, meta)
        expected = model.compute_logits(hidden[[20, 41]]).argmax(dim=-1)
    assert torch.equal(first, expected)


def test_bench_without_a_gpu_is_a_usage_error(capsys):
    import torch

    from flare.cli.ignition import main

    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU")
    assert main(["bench", "--batches", "1", "--contexts", "128"]) == 2
    assert "needs a CUDA GPU" in capsys.readouterr().err


def test_serving_benchmark_measures_a_streaming_server(tmp_path, monkeypatch):
    """benchmarks/serve_bench.py against a small OpenAI-style streaming server on loopback."""
    import asyncio
    import importlib.util
    import socket
    import sys
    import threading
    import time as time_module

    import uvicorn
    from starlette.applications import Starlette
    from starlette.responses import StreamingResponse
    from starlette.routing import Route

    seen = []

    async def completions(request):
        body = await request.json()
        seen.append(body)

        async def events():
            for _ in range(body["max_tokens"]):
                await asyncio.sleep(0.001)
                yield 'data: {"choices": [{"index": 0, "text": " a"}]}\n\n'
            yield f'data: {{"choices": [], "usage": {{"completion_tokens": {body["max_tokens"]}}}}}\n\n'
            yield "data: [DONE]\n\n"

        return StreamingResponse(events(), media_type="text/event-stream")

    app = Starlette(routes=[Route("/v1/completions", completions, methods=["POST"])])
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="error"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time_module.sleep(0.01)
    try:
        spec = importlib.util.spec_from_file_location("serve_bench", REPO / "benchmarks" / "serve_bench.py")
        serve_bench = importlib.util.module_from_spec(spec)
        monkeypatch.setitem(sys.modules, "serve_bench", serve_bench)     # dataclasses look their module up
        spec.loader.exec_module(serve_bench)
        output = tmp_path / "serve.json"
        code = serve_bench.main(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--input-len", "12",
                                 "--output-len", "5", "--concurrency", "1,3", "--min-prompts", "3",
                                 "--prompts-per-concurrency", "1", "--warmup-requests", "0",
                                 "--shared-prefix-len", "4", "--output", str(output)])
        closed_loop = list(seen)
        seen.clear()
        open_loop = tmp_path / "poisson.json"
        open_code = serve_bench.main(["--base-url", f"http://127.0.0.1:{port}", "--model", "m", "--input-len", "8",
                                      "--output-len", "3", "--request-rate", "40,80", "--num-prompts", "6",
                                      "--warmup-requests", "0", "--goodput", "ttft:60000", "tpot:60000",
                                      "--temperature", "0.6", "--top-p", "0.9", "--output", str(open_loop)])
        strict = serve_bench.summarize(serve_bench.Level(1, None, 5.0), [serve_bench.RequestResult(
            ok=True, started=0.0, ttft=0.2, latency=0.5, output_tokens=4)], 1.0, 4, {"ttft": 100.0})
    finally:
        server.should_exit = True
        thread.join(timeout=5)
    assert code == 0 and open_code == 0
    # No sampling flags: no sampling fields, each server's defaults; given ones reach every request.
    assert all("temperature" not in body and "top_p" not in body for body in closed_loop)
    assert all(body["temperature"] == 0.6 and body["top_p"] == 0.9 for body in seen) and len(seen) == 12
    poisson = json.loads(open_loop.read_text())
    assert poisson["arrivals"] == "Poisson" and poisson["sampling"] == {"temperature": 0.6, "top_p": 0.9}
    assert [level["request_rate"] for level in poisson["levels"]] == [40.0, 80.0]
    assert all(level["goodput"]["good_requests"] == 6 and level["goodput"]["requests_per_s"] > 0
               for level in poisson["levels"])
    assert strict["goodput"] == {"slo_ms": {"ttft": 100.0}, "good_requests": 0, "requests_per_s": 0.0}
    levels = json.loads(output.read_text())["levels"]
    assert [level["concurrency"] for level in levels] == [1, 3]
    assert all(level["failed"] == 0 and level["output_tokens"] == 5 * level["requests"] for level in levels)
    assert all(level["ttft_ms"]["p50"] > 0 and level["itl_ms"]["p99"] >= level["itl_ms"]["p50"] for level in levels)
    assert all(body["ignore_eos"] and body["stream"] and len(body["prompt"]) == 12 for body in closed_loop)
    assert len({tuple(body["prompt"][:4]) for body in closed_loop}) == 1          # the shared prefix


def test_serving_benchmark_arrivals_and_objectives():
    import importlib.util
    import math
    import statistics
    import sys

    spec = importlib.util.spec_from_file_location("serve_bench_units", REPO / "benchmarks" / "serve_bench.py")
    serve_bench = importlib.util.module_from_spec(spec)
    sys.modules["serve_bench_units"] = serve_bench
    try:
        spec.loader.exec_module(serve_bench)
        Level = serve_bench.Level
        assert serve_bench.arrival_offsets(Level(5, 5), seed=0) == [0.0] * 5
        offsets = serve_bench.arrival_offsets(Level(4000, None, 20.0), seed=1)
        gaps = [b - a for a, b in zip([0.0] + offsets, offsets)]
        assert offsets == sorted(offsets) and offsets[-1] == pytest.approx(4000 / 20.0)
        assert statistics.fmean(gaps) == pytest.approx(1 / 20.0, rel=1e-6)
        # exponential gaps: the standard deviation equals the mean; burstiness 4 spreads them half as much
        assert statistics.pstdev(gaps) == pytest.approx(1 / 20.0, rel=0.1)
        even = serve_bench.arrival_offsets(Level(4000, None, 20.0, burstiness=4.0), seed=1)
        even_gaps = [b - a for a, b in zip([0.0] + even, even)]
        assert statistics.pstdev(even_gaps) == pytest.approx(1 / 20.0 / 2, rel=0.1)
        assert serve_bench.parse_goodput(["ttft:1000", "tpot:50"]) == {"ttft": 1000.0, "tpot": 50.0}
        for bad in ("itl:5", "ttft", "ttft:-1", "ttft:soon", "tpot:nan"):
            with pytest.raises(Exception, match="--goodput"):
                serve_bench.parse_goodput([bad])
        one_token = serve_bench.RequestResult(ok=True, started=0.0, ttft=0.1, latency=0.1, output_tokens=1)
        assert serve_bench.is_good(one_token, {"tpot": 0.0, "ttft": 100.0})     # its TPOT counts as 0
        assert not serve_bench.is_good(serve_bench.RequestResult(ok=False, started=0.0), {})
        assert not math.isnan(serve_bench.Level(1, 1).request_rate) and math.isinf(serve_bench.Level(1, 1).request_rate)
    finally:
        sys.modules.pop("serve_bench_units", None)


def test_a_speculative_round_verifies_its_block_against_the_target(tmp_path):
    """A round feeds the pending token and W - 1 drafts over the prefilled pages: drafts that are the
    target's own greedy continuation are all accepted and the round ends on the token after them; random
    drafts are rejected at the first mismatch. Restore makes every round start from the same state."""
    import torch

    from flare.bench_speculation import SpeculativeRoundTarget
    from flare.engine.attention import AttentionMetadata, TorchReferenceBackend, allocate_kv_caches
    from flare.models import load_checkpoint
    from tiny_checkpoints import write_tiny_checkpoint

    cfg, model = load_checkpoint(write_tiny_checkpoint("llama", tmp_path), torch.float32, "cpu",
                                 TorchReferenceBackend())
    width, context = 4, 20
    target = SpeculativeRoundTarget(model, cfg, width=width, max_batch=2, max_context=40, page_size=16,
                                    device="cpu", dtype=torch.float32, graph=False)
    target.prepare(batch=2, context=context, seed=5)
    pending = target.pending.clone()
    prefix = torch.randint(0, cfg.vocab_size, (2, context + width), generator=torch.Generator().manual_seed(5))
    greedy = []                                           # the target's own continuation after the pending token
    sequence = torch.cat([prefix[:, :context], pending[:, None]], dim=1)
    for _ in range(width):
        caches = allocate_kv_caches(cfg, 8, 16, torch.float32, "cpu")
        length = sequence.shape[1]
        meta = AttentionMetadata.build([length] * 2, [length] * 2, [[0, 1, 2], [3, 4, 5]], 16)
        with torch.inference_mode():
            hidden = model(sequence.flatten(), meta.positions(), caches, meta)
            token = model.compute_logits(hidden[[length - 1, 2 * length - 1]]).argmax(dim=-1)
        greedy.append(token)
        sequence = torch.cat([sequence, token[:, None]], dim=1)
    greedy = torch.stack(greedy, dim=1)
    target.restore()
    target.step()
    rejected = target.accepted.clone()
    assert torch.equal(target.sampled[rejected == 0], greedy[rejected == 0, 0])
    with torch.inference_mode():                          # drafts that are the greedy continuation
        target.block[:, 1:] = greedy[:, :width - 1]
    for _ in range(2):
        target.restore()
        target.step()
        assert target.accepted.tolist() == [width - 1, width - 1]
        assert torch.equal(target.sampled, greedy[:, width - 1])
