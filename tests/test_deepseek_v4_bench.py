"""benchmarks/deepseek_v4_bench.py, the DeepSeek V4 GPU job, run on the CPU at small shapes (the kernels under
Triton's interpreter in float32, the engine on a tiny V4 config): every case checks its numerics and the
JSON says so, so the job cannot waste a GPU run on a broken script."""

from __future__ import annotations

import json

from benchmark_scripts import benchmark_module
from deepseek_v4_checkpoints import TINY_V4


def small(bench, monkeypatch) -> None:
    monkeypatch.setattr(bench, "DEVICE", "cpu")
    monkeypatch.setattr(bench, "DTYPE_NAME", "float32")
    for name, value in dict(HEADS=16, HEAD_DIM=32, WINDOW=8, PAGE=16, INDEX_HEADS=16, INDEX_DIM=16, INDEX_TOPK=3,
                            HCA_RATE=8).items():
        monkeypatch.setattr(bench, name, value)
    tiny = {**TINY_V4, "architectures": ["DeepseekV4ForCausalLM"], "model_type": "deepseek_v4"}
    monkeypatch.setattr(bench, "flash_cut", lambda layers, experts: {**tiny, "num_hidden_layers": layers,
                                                                      "n_routed_experts": experts})


def test_the_kernels_and_engine_phases_write_checked_cases(tmp_path, monkeypatch):
    with benchmark_module("deepseek_v4_bench") as bench:
        small(bench, monkeypatch)
        code = bench.main(["--phases", "kernels,engine", "--output-dir", str(tmp_path), "--contexts", "48",
                           "--kernel-batches", "2", "--prefill-chunk", "5", "--layers", "4", "--experts", "4",
                           "--batches", "1,3", "--engine-contexts", "20", "--warmup", "1", "--steps", "3"])
    assert code == 0
    kernels = json.loads((tmp_path / "deepseek_v4_kernels.json").read_text())
    assert kernels["passed"] and kernels["device"]
    attention = [c for c in kernels["cases"] if c["kernel"] == "sparse_attention"]
    assert sorted({(c["kind"], c["mode"]) for c in attention}) == [
        (kind, mode) for kind in ("csa", "hca", "sliding") for mode in ("decode", "prompt")]
    assert all(c["ok"] and c["relative_error"] < 1e-4 for c in attention)
    csa = next(c for c in attention if c["kind"] == "csa")
    assert csa["keys"] == 8 + 3                                   # the window and the indexer's top-3
    indexer = [c for c in kernels["cases"] if c["kernel"] == "indexer"]
    assert indexer and all(c["topk_agreement"] == 1.0 and c["entries"] == 12 for c in indexer)
    engine = json.loads((tmp_path / "deepseek_v4_engine.json").read_text())
    assert [c["batch"] for c in engine["cases"]] == [1, 3]
    assert engine["layer_types"] == TINY_V4["layer_types"] and engine["window_pages"] > 0
    assert engine["tpot_ms_c1"] == engine["cases"][0]["step_ms"] > 0
