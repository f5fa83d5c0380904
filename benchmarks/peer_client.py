#!/usr/bin/env python3
"""Serving cases through vLLM's own benchmark client (`vllm bench serve`), against any OpenAI-style server.

The same client, the same prompts and the same sampling for Flare and for vLLM: the side by side every open
issue's targets ask for. All cases run in one process, so vLLM's import is paid once. vLLM must be
importable (on the GPU machine: `PYTHONPATH=/tmp/peer-site`, after `benchmarks/peer_stage.sh --install`).

    python3 benchmarks/peer_client.py --base-url http://127.0.0.1:8011 --model llama-8b --tokenizer CKPT \
        --out DIR c1:greedy c1:top-p c16:top-p c64 u256:top-p r16:top-p p8000

A case is SHAPE[:SAMPLING].
  cN   4N prompts of 1000 tokens in / 256 out (--input-len, --output-len) at concurrency N
  uN   N prompts of 1000 in / 1000 out at concurrency N (the 256-user row)
  rR   Poisson arrivals at R requests/s for --arrival-seconds, no concurrency limit; goodput for --goodput
  pL   L-token prompts, 128 tokens out (--long-output-len), at concurrency 1: time to first token, then time
       per output token at that context (8 prompts; 4 from 16,000 tokens)
SAMPLING: `default` (no sampling fields: the server's own defaults, what most clients get), `greedy`
(temperature 0) or `top-p` (temperature 0.6, top-p 0.9: Flare's Llama recipe defaults, sent explicitly).

Every request ignores EOS. A case's prompts come from a seed of its name, so two servers get the same
prompts while two cases do not share a prefix. The client's own first-request check is off: the runner has
already had an answer, and that check would send a case's first prompt early and so prefix-cache it.
Writes DIR/CASE.json (vLLM's result, per-request lists dropped) and DIR/summary.json, and prints a table.
"""

from __future__ import annotations

import argparse
import json
import re
import zlib
from dataclasses import dataclass
from pathlib import Path

SAMPLING = {"default": [], "greedy": ["--temperature", "0"], "top-p": ["--temperature", "0.6", "--top-p", "0.9"]}
CASE_PATTERN = re.compile(r"(?P<kind>[curp])(?P<size>\d+(?:\.\d+)?)(?::(?P<sampling>[a-z-]+))?")
LONG_PROMPT_TOKENS = 16000


@dataclass(frozen=True)
class Workload:
    input_len: int = 1000
    output_len: int = 256
    arrival_seconds: float = 20.0
    long_output_len: int = 128
    goodput: tuple[str, ...] = ("ttft:1000", "tpot:50")


@dataclass(frozen=True)
class Case:
    kind: str
    size: float
    sampling: str

    @property
    def name(self) -> str:
        size = f"{self.size:g}"
        return f"{self.kind}{size}-{self.sampling}"

    @property
    def seed(self) -> int:
        return zlib.crc32(self.name.encode()) % 1_000_000

    def client_args(self, workload: Workload) -> list[str]:
        """The `vllm bench serve` arguments of this case (dataset, lengths, load, sampling)."""
        n = int(self.size)
        if self.kind == "c":
            load = ["--num-prompts", str(4 * n), "--max-concurrency", str(n)]
            lengths = (workload.input_len, workload.output_len)
        elif self.kind == "u":
            load = ["--num-prompts", str(n), "--max-concurrency", str(n)]
            lengths = (workload.input_len, 1000)
        elif self.kind == "r":
            prompts = max(1, round(self.size * workload.arrival_seconds))
            load = ["--num-prompts", str(prompts), "--request-rate", f"{self.size:g}", "--goodput",
                    *workload.goodput]
            lengths = (workload.input_len, workload.output_len)
        else:
            load = ["--num-prompts", "4" if n >= LONG_PROMPT_TOKENS else "8", "--max-concurrency", "1"]
            lengths = (n, workload.long_output_len)
        return ["--dataset-name", "random", "--random-input-len", str(lengths[0]),
                "--random-output-len", str(lengths[1]), "--ignore-eos", "--seed", str(self.seed), *load,
                *SAMPLING[self.sampling]]


def parse_case(text: str) -> Case:
    match = CASE_PATTERN.fullmatch(text)
    if match is None:
        raise ValueError(f"case {text!r}: expected cN, uN, rR or pL, then an optional :SAMPLING "
                         f"(e.g. c64:top-p, r12.5, p8000)")
    sampling = match["sampling"] or "default"
    if sampling not in SAMPLING:
        raise ValueError(f"case {text!r}: sampling {sampling!r} is none of {', '.join(SAMPLING)}")
    size = float(match["size"])
    if match["kind"] != "r" and not size.is_integer():
        raise ValueError(f"case {text!r}: only a Poisson rate (rR) may be fractional")
    if size <= 0:
        raise ValueError(f"case {text!r}: the size must be above zero")
    return Case(match["kind"], size, sampling)


def client_argv(case: Case, workload: Workload, base_url: str, model: str, tokenizer: str, out: Path) -> list[str]:
    return ["--backend", "openai", "--base-url", base_url, "--endpoint", "/v1/completions", "--model", model,
            "--tokenizer", tokenizer, "--label", case.name, *case.client_args(workload),
            "--percentile-metrics", "ttft,tpot,itl,e2el", "--metric-percentiles", "50,99",
            "--ready-check-timeout-sec", "0", "--disable-tqdm",
            "--save-result", "--result-dir", str(out), "--result-filename", f"{case.name}.json"]


ROW = ("completed", "failed", "output_throughput", "median_tpot_ms", "p99_tpot_ms", "p99_itl_ms",
       "median_ttft_ms", "p99_ttft_ms", "request_goodput")


def summary_row(name: str, result: dict) -> str:
    cells = [name] + [_cell(result.get(key)) for key in ROW]
    return " | ".join(cells)


def _cell(value: object) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:,.2f}" if value < 100 else f"{value:,.0f}"
    return str(value)


def run(cases: list[Case], workload: Workload, args: argparse.Namespace) -> dict[str, dict]:
    from vllm.benchmarks.serve import add_cli_args, main
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    results = {}
    for case in cases:
        parser = FlexibleArgumentParser()
        add_cli_args(parser)
        argv = client_argv(case, workload, args.base_url, args.model, args.tokenizer, args.out)
        print(f"== {case.name}: vllm bench serve {' '.join(argv)}", flush=True)
        try:
            result = main(parser.parse_args(argv))
        except Exception as error:   # one failed case must not lose the others' results
            print(f"== {case.name} failed: {error!r}", flush=True)
            result = {"error": repr(error)}
        results[case.name] = {key: value for key, value in result.items() if not isinstance(value, list)}
        summary = {"label": args.label, "cases": results}
        (args.out / "summary.json").write_text(json.dumps(summary, indent=1))   # after each case: a cut run keeps it
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("cases", nargs="+", help="cN, uN, rR or pL, each with an optional :SAMPLING")
    parser.add_argument("--base-url", required=True)
    parser.add_argument("--model", required=True, help="the served model name")
    parser.add_argument("--tokenizer", required=True, help="the checkpoint folder (its tokenizer)")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--label", default="", help="the server's name, for the summary")
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--arrival-seconds", type=float, default=20.0)
    parser.add_argument("--long-output-len", type=int, default=128)
    parser.add_argument("--goodput", nargs="+", default=["ttft:1000", "tpot:50"])
    args = parser.parse_args()
    try:
        cases = [parse_case(text) for text in args.cases]
    except ValueError as error:
        parser.error(str(error))
    workload = Workload(args.input_len, args.output_len, args.arrival_seconds, args.long_output_len,
                        tuple(args.goodput))
    args.out.mkdir(parents=True, exist_ok=True)
    results = run(cases, workload, args)
    print(f"\n{args.label}: case | " + " | ".join(ROW))
    for name, result in results.items():
        print(summary_row(name, result))


if __name__ == "__main__":
    main()
