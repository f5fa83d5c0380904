"""benchmarks/peer_client.py turns a case name into the arguments of vLLM's benchmark client: the same
prompts for both servers, different prompts for different cases, and a failed case keeps the others."""

from __future__ import annotations

import argparse
import json
import sys
import types

import pytest

from benchmark_scripts import benchmark_module


def value(argv: list[str], flag: str) -> str:
    return argv[argv.index(flag) + 1]


def test_each_case_shape_sets_its_load_and_lengths():
    with benchmark_module("peer_client") as peer:
        workload = peer.Workload()
        c64 = peer.parse_case("c64:top-p").client_args(workload)
        u256 = peer.parse_case("u256").client_args(workload)
        rate = peer.parse_case("r12.5:greedy").client_args(workload)
        long = peer.parse_case("p32000").client_args(workload)
    assert (value(c64, "--num-prompts"), value(c64, "--max-concurrency")) == ("256", "64")
    assert (value(c64, "--random-input-len"), value(c64, "--random-output-len")) == ("1000", "256")
    assert (value(c64, "--temperature"), value(c64, "--top-p")) == ("0.6", "0.9")
    assert (value(u256, "--num-prompts"), value(u256, "--random-output-len")) == ("256", "1000")
    assert "--temperature" not in u256                      # default: the server's own sampling
    assert (value(rate, "--request-rate"), value(rate, "--num-prompts")) == ("12.5", "250")
    assert "--max-concurrency" not in rate and value(rate, "--temperature") == "0"
    assert rate[rate.index("--goodput") + 1:rate.index("--goodput") + 3] == ["ttft:1000", "tpot:50"]
    assert (value(long, "--random-input-len"), value(long, "--random-output-len")) == ("32000", "128")
    assert (value(long, "--num-prompts"), value(long, "--max-concurrency")) == ("4", "1")
    assert all("--ignore-eos" in argv for argv in (c64, u256, rate, long))


def test_seeds_are_stable_per_case_and_differ_between_cases():
    with benchmark_module("peer_client") as peer:
        seeds = {text: peer.parse_case(text).seed for text in ("c64", "c64:greedy", "c64:top-p", "c16")}
        again = peer.parse_case("c64:greedy").seed
    assert len(set(seeds.values())) == 4
    assert again == seeds["c64:greedy"]


@pytest.mark.parametrize("text, words", [("x64", "expected cN"), ("c64:hot", "sampling 'hot'"),
                                         ("c1.5", "fractional"), ("r0", "above zero"), ("c", "expected cN")])
def test_a_bad_case_says_what_is_wrong(text, words):
    with benchmark_module("peer_client") as peer:
        with pytest.raises(ValueError, match=words):
            peer.parse_case(text)


def test_a_failed_case_keeps_the_others_and_lists_are_dropped(monkeypatch, tmp_path):
    seen = []

    def fake_main(args):
        seen.append(args)
        if args.label.startswith("c16"):
            raise RuntimeError("connection refused")
        return {"output_throughput": 100.0, "ttfts": [0.1, 0.2], "completed": 4}

    def add_cli_args(parser):
        for flag in ("--label", "--base-url", "--model", "--tokenizer", "--result-dir", "--result-filename"):
            parser.add_argument(flag)
        parser.add_argument("--save-result", action="store_true")

    class Parser(argparse.ArgumentParser):   # vLLM's own parser knows every flag; this one skips the rest
        def parse_args(self, argv):
            return self.parse_known_args(argv)[0]

    serve = types.ModuleType("vllm.benchmarks.serve")
    serve.add_cli_args, serve.main = add_cli_args, fake_main
    argparse_utils = types.ModuleType("vllm.utils.argparse_utils")
    argparse_utils.FlexibleArgumentParser = Parser
    for name, module in {"vllm": types.ModuleType("vllm"), "vllm.benchmarks": types.ModuleType("vllm.benchmarks"),
                         "vllm.benchmarks.serve": serve, "vllm.utils": types.ModuleType("vllm.utils"),
                         "vllm.utils.argparse_utils": argparse_utils}.items():
        monkeypatch.setitem(sys.modules, name, module)
    with benchmark_module("peer_client") as peer:
        args = argparse.Namespace(base_url="http://127.0.0.1:1", model="m", tokenizer="t", out=tmp_path, label="x")
        cases = [peer.parse_case("c1:greedy"), peer.parse_case("c16"), peer.parse_case("u4")]
        results = peer.run(cases, peer.Workload(), args)
    assert list(results) == ["c1-greedy", "c16-default", "u4-default"]
    assert results["c16-default"] == {"error": "RuntimeError('connection refused')"}
    assert results["u4-default"] == {"output_throughput": 100.0, "completed": 4}
    assert [a.result_filename for a in seen] == ["c1-greedy.json", "c16-default.json", "u4-default.json"]
    assert list(json.loads((tmp_path / "summary.json").read_text())["cases"]) == list(results)
