#!/usr/bin/env python
"""The serving path without the GPU: how many tokens a second the host side delivers at a GPU's pace.

`flare run`'s own pieces, in their own processes: the engine-core process (real EngineCore, scheduler,
ModelRunner on its static decode buffers, messages over ZMQ), the frontend (AsyncEngine, output
processor and detokenizer, FastAPI under uvicorn, SSE) and HTTP clients (benchmarks/serve_bench.py's
streaming Completions). Only the device is missing: the model and the sampler are stand-ins that answer
at once (as benchmarks/step_host.py's), and a step's ids become readable when a device that runs the
steps one after another, each at its step-cost table's price (`StepCosts.step_ms` of its decodes and
prompt tokens), would have finished it; the core's host work overlaps that wait one step ahead, as on
the GPU. The core is built through `CoreConnection.spawn(core_builder=...)`, the seam for this.

The tokenizer is word-level over the whole 128,256-id vocabulary (like the benchmark checkpoints'), and
the stand-in sampler answers a different id per position, so detokenization does real work.

For each case it prints delivered output tokens/s, schedule_sim's prediction for the same load from the
table alone (the GPU side with no host cost), their ratio, each process's CPU utilisation and CPU time
per output token, and TPOT / ITL; JSON with everything goes to --output. `--py-spy FILE` records the
server's two processes with py-spy (raw collapsed stacks) when py-spy is installed.

    python benchmarks/host_pipeline.py --output host_pipeline.json
    python benchmarks/host_pipeline.py --cases 256x1000x1000 --requests 64 --output-len 200

A case is CONCURRENCYxINxOUT (requests: --requests, default 256).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from functools import partial
from pathlib import Path
from types import SimpleNamespace

BENCHMARKS = Path(__file__).resolve().parent
SOURCE = BENCHMARKS.parent / "src"      # the flare served (--baseline-src serves another checkout's too)
sys.path.insert(0, str(BENCHMARKS))     # serve_bench, schedule_sim (the driver's)

DEFAULT_COSTS = BENCHMARKS / "results/h200_2026-12-02/llama_bf16_defaults_and_greedy/step_costs.json"
VOCAB = 128_256
SPECIAL = ("<unk>", "<s>", "</s>")
EOS_ID = 2
SERVED = "host-pipeline"
PREPARED_CONCURRENCY = 256           # the package's, which sets the balanced policy's default bound
ENGINE = dict(page_size=16, num_pages=62_225, prefill_chunk=2048, max_model_len=131_072)   # the H200 run's pool


# ---- the engine-core process: the real core around a stand-in runner paced by the table --------------------

class StandInModel:
    """Answers at once: hidden [T, 1], logits [N, 1] (the stand-in sampler does not read them)."""

    def __call__(self, input_ids, positions, kv_caches, meta):
        import torch

        return torch.zeros(input_ids.shape[0], 1, device=input_ids.device)

    def compute_logits(self, hidden):
        return hidden

    def modules(self):
        return iter(())


def stand_in_ids(logits, slots, positions, allowed_bitmask=None):
    """A different ordinary word per request and position, at once (on a GPU sampling is device work)."""
    return (positions * 7919 + slots * 104_729) % (VOCAB - len(SPECIAL)) + len(SPECIAL)


def replayed_decode(graphs, size: int):
    """What replaying a captured decode forward graph leaves in its outputs, at once: on the GPU the graph's
    body (ids and page tables derived from the slots, forward) is device work, not the host's. The sampling
    half then runs the stand-in sampler."""
    import torch

    zeros = torch.zeros(size, 1)
    return zeros, zeros


def stand_in_model(engine_config, report=None):
    """The ModelFactory function: a LoadedModel with the stand-in and a one-layer, one-wide KV cache."""
    from flare.engine.factory import LoadedModel

    model_config = SimpleNamespace(vocab_size=VOCAB, num_key_value_heads=1, head_dim=1, num_hidden_layers=1,
                                   kv_cache_dtype="auto", mla=None, v4=None)
    return LoadedModel(model_config, StandInModel(), (EOS_ID,), engine_config)


class PacedStep:
    """A launched step whose ids are readable at `ready_at` (perf_counter seconds)."""

    def __init__(self, pending, ready_at: float) -> None:
        self.pending, self.ready_at = pending, ready_at

    def result(self):
        delay = self.ready_at - time.perf_counter()
        if delay > 0:
            time.sleep(delay)
        return self.pending.result()


class PacedRunner:
    """The StepRunner contract over a real ModelRunner, its steps priced by `costs` on one device queue:
    a step starts when it is launched or when the step before it ends, whichever is later."""

    def __init__(self, runner, costs) -> None:
        self.runner, self.costs = runner, costs
        self.vocab_size = runner.vocab_size
        self.device_free = 0.0

    def reset(self) -> None:
        self.runner.reset()

    def samples_ahead(self, params) -> bool:
        return self.runner.samples_ahead(params)

    def launch(self, plan) -> PacedStep:
        decodes = sum(1 for row in plan.rows if row.num_new_tokens == 1)
        prompt = sum(row.num_new_tokens for row in plan.rows if row.num_new_tokens > 1)
        pending = self.runner.launch(plan)
        start = max(time.perf_counter(), self.device_free)
        self.device_free = start + self.costs.step_ms(decodes, prompt) / 1000.0
        return PacedStep(pending, self.device_free)


def build_paced_core(costs, loaded, seed):
    """The core_builder: an EngineCore over a ModelRunner whose decode steps take the CUDA-graph path
    (static buffers; the replay is `replayed_decode`) and whose other steps run the stand-in model and
    sampler eagerly, paced by `costs`."""
    from flare.engine.core import EngineCore
    from flare.engine.runner import ModelRunner

    runner = ModelRunner(loaded.model, loaded.model_config, loaded.engine_config, "cpu", seed=seed, graphs=True,
                         capture=False)
    runner.sampler.sample = stand_in_ids
    runner.graphs.forward = partial(replayed_decode, runner.graphs)
    return EngineCore(loaded.engine_config, PacedRunner(runner, costs), loaded.eos_token_ids)


# ---- the frontend process ---------------------------------------------------------------------------------

def write_tokenizer(directory: Path, vocab_size: int = VOCAB) -> Path:
    """A word-level tokenizer over ids 0..vocab_size-1 (`w3`, `w4`, ...), decoded with spaces between words."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    vocab = {token: i for i, token in enumerate(SPECIAL)}
    vocab.update({f"w{i}": i for i in range(len(SPECIAL), vocab_size)})
    tokenizer = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer.decoder = decoders.WordPiece(prefix="##")
    directory.mkdir(parents=True, exist_ok=True)
    tokenizer.save(str(directory / "tokenizer.json"))
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<s>", "eos_token": "</s>",
              "unk_token": "<unk>", "model_max_length": ENGINE["max_model_len"]}
    (directory / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
    return directory


def load_costs(path: Path):
    """A step-cost table from its JSON (as schedule_sim reads it)."""
    from flare.engine.step_cost import step_costs_from_json

    return step_costs_from_json(Path(path).read_text())


def engine_config(costs, concurrency: int, options: dict = ENGINE):
    """The configuration schedule_sim gives the same load: the balanced policy with the table's bound."""
    from flare.engine.config import EngineConfig, step_token_budget
    from flare.engine.policy import SchedulerPolicy

    return EngineConfig(max_concurrency=concurrency, page_size=options["page_size"], num_pages=options["num_pages"],
                        prefill_chunk=options["prefill_chunk"], max_model_len=options["max_model_len"],
                        max_num_batched_tokens=step_token_budget(options["prefill_chunk"], concurrency),
                        scheduler_policy=SchedulerPolicy().with_step_costs(costs, PREPARED_CONCURRENCY))


def serve(args) -> int:
    """The server of one case: core process, AsyncEngine, FastAPI/uvicorn on --port; writes the two
    processes' ids to --pids once it listens; stops on SIGTERM (drains, as `flare run`)."""
    import gc

    sys.path.insert(0, str(args.src))           # before flare is first imported; the core process inherits it
    from flare.engine.factory import ModelFactory
    from flare.engine_client.async_engine import AsyncEngine
    from flare.engine_client.connection import CoreConnection
    from flare.frontend.tokenizer import load_tokenizer
    from flare.server.frontend import ServingFrontend
    from flare.server.listener import reserve, run_http
    from flare.server.settings import ServerSettings

    costs = load_costs(args.costs)
    config = engine_config(costs, args.concurrency)
    listener = reserve("127.0.0.1", args.port)
    tokenizer_dir = write_tokenizer(Path(args.workdir) / "tokenizer")
    connection = CoreConnection.spawn(ModelFactory(stand_in_model, (config,)), seed=0,
                                      core_builder=partial(build_paced_core, costs))
    for _ in connection.startup(timeout_s=300):
        pass
    engine = AsyncEngine(connection, load_tokenizer(tokenizer_dir))
    try:
        frontend = ServingFrontend.from_dir(tokenizer_dir, engine.tokenizer)
        settings = ServerSettings(served_names=(SERVED,), canonical_id=SERVED, max_model_len=config.max_model_len,
                                  max_concurrency=config.max_concurrency, kv_tokens=config.kv_capacity_tokens)
        listener.listen()
        Path(args.pids).write_text(json.dumps({"frontend": os.getpid(), "core": connection.process.pid}))
        gc.collect()
        gc.freeze()                                     # as flare run does after start-up
        return run_http(engine, frontend, settings, listener, sys.stderr)
    finally:
        engine.shutdown()
        listener.close()


# ---- the driver -------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class Case:
    concurrency: int
    input_len: int
    output_len: int
    requests: int

    @property
    def name(self) -> str:
        return f"{self.requests} x {self.input_len}/{self.output_len}, c={self.concurrency}"


def parse_cases(text: str, requests: int, output_len: int | None) -> list[Case]:
    cases = []
    for part in text.split(","):
        try:
            concurrency, input_len, out = (int(value) for value in part.split("x"))
        except ValueError:
            raise SystemExit(f"--cases {part}: write CONCURRENCYxINxOUT, e.g. 256x1000x1000") from None
        cases.append(Case(concurrency, input_len, output_len or out, requests))
    return cases


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process (all its threads) so far, from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def free_port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


class Server:
    """One case's server in its own process (under py-spy when asked), until stopped."""

    def __init__(self, case: Case, costs: Path, workdir: Path, src: Path, py_spy: Path | None) -> None:
        self.port, self.pids_file = free_port(), workdir / f"pids-{case.concurrency}.json"
        command = [sys.executable, str(Path(__file__).resolve()), "serve", "--costs", str(costs), "--port",
                   str(self.port), "--concurrency", str(case.concurrency), "--workdir", str(workdir),
                   "--pids", str(self.pids_file), "--src", str(src)]
        if py_spy is not None:
            py_spy.parent.mkdir(parents=True, exist_ok=True)
            command = ["py-spy", "record", "--subprocesses", "--format", "raw", "--rate", "200",
                       "-o", str(py_spy), "--", *command]
        self.pids: dict = {}
        self.process = subprocess.Popen(command)
        self.pids = self._wait_ready()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def _wait_ready(self, timeout_s: float = 300) -> dict:
        import httpx

        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise SystemExit(f"the server exited during start-up (status {self.process.returncode})")
            if self.pids_file.exists():
                try:
                    if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                        return json.loads(self.pids_file.read_text())
                except httpx.HTTPError:
                    pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"the server did not answer /health within {timeout_s:.0f} s")

    def cpu(self) -> dict:
        return {name: cpu_seconds(pid) for name, pid in self.pids.items()}

    def stop(self) -> None:
        if self.process.poll() is None:
            os.kill(self.pids.get("frontend", self.process.pid), signal.SIGTERM)   # it drains, then stops
            try:
                self.process.wait(120)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()


def predicted(costs, case: Case) -> dict:
    """schedule_sim's level for the same load: the real scheduler on the table's clock, no host work."""
    import schedule_sim

    load = schedule_sim.Load(case.concurrency, case.requests, case.input_len, case.output_len)
    policy = schedule_sim.policy_for("balanced", costs, PREPARED_CONCURRENCY)
    return schedule_sim.simulate(costs, policy, load, SimpleNamespace(**ENGINE))


def drive(server: Server, case: Case, seed: int) -> tuple[dict, dict, float]:
    """One level of serve_bench's streaming Completions against the server: (summary, CPU seconds per
    process during it, wall seconds)."""
    import serve_bench

    warm = serve_bench.make_prompts(4, case.input_len, VOCAB, seed + 999, None)
    asyncio.run(serve_bench.run_level(server.url, SERVED, warm, 16, serve_bench.Level(4, 4), None))
    prompts = serve_bench.make_prompts(case.requests, case.input_len, VOCAB, seed, None)
    level = serve_bench.Level(case.requests, case.concurrency)
    before = server.cpu()
    results, duration = asyncio.run(serve_bench.run_level(server.url, SERVED, prompts, case.output_len, level, None))
    after = server.cpu()
    return (serve_bench.summarize(level, results, duration, case.output_len),
            {name: after[name] - before[name] for name in after}, duration)


def run_case(case: Case, args, costs, index: int, source: str, src: Path) -> dict:
    spy = None
    if args.py_spy:
        spy = args.py_spy.with_name(f"{args.py_spy.stem}-{source}-c{case.concurrency}{args.py_spy.suffix}")
    with tempfile.TemporaryDirectory(prefix="host-pipeline-") as workdir:
        server = Server(case, args.costs, Path(workdir), src, spy)
        try:
            summary, cpu, duration = drive(server, case, args.seed + 1000 * index)
        finally:
            server.stop()
    prediction = predicted(costs, case)
    tokens = summary["output_tokens"]
    return {"case": asdict(case), "name": case.name, "source": source, "src": str(src), "served": summary,
            "predicted": {key: prediction[key] for key in ("output_tokens_per_s", "steps", "duration_s",
                                                           "ttft_ms", "tpot_ms", "itl_ms")},
            "ratio": summary["output_tokens_per_s"] / prediction["output_tokens_per_s"],
            "cpu": {name: {"seconds": seconds, "utilisation": seconds / duration,
                           "ms_per_output_token": 1000.0 * seconds / tokens if tokens else float("nan")}
                    for name, seconds in cpu.items()},
            "py_spy": str(spy) if spy else None}


def commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=BENCHMARKS, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def print_row(row: dict) -> None:
    served, cpu = row["served"], row["cpu"]
    print(f"{row['source']:<9}{row['name']:<28}{served['output_tokens_per_s']:>10,.0f}{row['predicted']['output_tokens_per_s']:>10,.0f}"
          f"{row['ratio']:>7.3f}{cpu['frontend']['utilisation']:>8.2f}{cpu['core']['utilisation']:>8.2f}"
          f"{cpu['frontend']['ms_per_output_token']:>9.3f}{cpu['core']['ms_per_output_token']:>9.3f}"
          f"{served['tpot_ms']['p50']:>9.2f}{served['itl_ms']['p50']:>8.2f}{served['itl_ms']['p99']:>8.2f}"
          f"{served['failed']:>5}{served['short_outputs']:>6}", flush=True)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--costs", type=Path, default=DEFAULT_COSTS, help="a step-cost table (step_costs.json)")
    parser.add_argument("--cases", default="256x1000x1000,64x1000x256", help="CONCURRENCYxINxOUT, comma-separated")
    parser.add_argument("--requests", type=int, default=256, help="requests per case")
    parser.add_argument("--output-len", type=int, default=None, help="override every case's OUT (a smaller run)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--baseline-src", type=Path, default=None,
                        help="also serve each case from this src/ directory first (e.g. `git archive` of an "
                             "older commit), for a before/after in one run")
    parser.add_argument("--py-spy", type=Path, default=None, help="record the server with py-spy to FILE-cN.txt")
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    return parser.parse_args(argv)


def main(argv=None) -> int:
    if argv is None and sys.argv[1:2] == ["serve"]:
        return serve_main(sys.argv[2:])
    args = parse_args(argv)
    sys.path.insert(0, str(SOURCE))
    costs = load_costs(args.costs)
    document = {"benchmark": "host_pipeline", "command": " ".join(sys.argv), "commit": commit(),
                "device": {"host": os.uname().nodename, "cpus": os.cpu_count(), "load_average": os.getloadavg()},
                "costs": str(args.costs), "costs_device": costs.device,
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "cases": []}
    print(f"host pipeline paced by {costs.device}'s step costs; CPU ms are per delivered output token")
    print(f"{'source':<9}{'case':<28}{'tok/s':>10}{'table':>10}{'ratio':>7}{'fe CPU':>8}{'core':>8}{'fe ms':>9}{'core ms':>9}"
          f"{'TPOT p50':>9}{'ITL p50':>8}{'p99':>8}{'fail':>5}{'short':>6}")
    sources = ([("baseline", args.baseline_src.resolve())] if args.baseline_src else []) + [("this", SOURCE)]
    for index, case in enumerate(parse_cases(args.cases, args.requests, args.output_len)):
        for source, src in sources:              # the same prompts for each
            row = run_case(case, args, costs, index, source, src)
            document["cases"].append(row)
            print_row(row)
        if args.output:
            args.output.parent.mkdir(parents=True, exist_ok=True)
            args.output.write_text(json.dumps(document, indent=1) + "\n")
    failed = any(row["served"]["failed"] or row["served"]["short_outputs"] for row in document["cases"])
    return 1 if failed else 0


def serve_main(argv) -> int:
    parser = argparse.ArgumentParser(prog="host_pipeline.py serve")
    parser.add_argument("--costs", type=Path, required=True)
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--concurrency", type=int, required=True)
    parser.add_argument("--workdir", required=True)
    parser.add_argument("--pids", required=True)
    parser.add_argument("--src", type=Path, default=SOURCE)
    return serve(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
