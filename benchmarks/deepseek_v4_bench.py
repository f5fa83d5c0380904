#!/usr/bin/env python
"""DeepSeek V4 on one GPU: greedy parity of a tiny checkpoint, the V4 kernels' numerics and timings at
V4-Flash's shapes, and the engine's decode step on random weights in V4-Flash's widths cut to a few layers.
Each phase writes one JSON file under the output folder and prints a table.

* parity: the tiny random checkpoint of the CPU tests (tests/deepseek_v4_checkpoints.py: sliding, CSA and
  HCA layers, hash and top-k experts) served by the engine on the GPU's Triton kernels (float32 and
  bfloat16), beside transformers' greedy tokens on the same GPU in float32. float32 must match exactly;
  bfloat16 reports the first position each request leaves transformers' tokens.
* kernels: `flare.kernels.compressed_attention` against its torch reference
  (`compressed_attention_reference`, float32 inside) on the same bfloat16 inputs, 64 heads of 512 with
  V4-Flash's 128-token window and page: sliding only, CSA (512 indexer entries) and HCA (every entry the
  query sees), decode batches and a prompt chunk, at several contexts; the lightning indexer's scores
  (64 heads of 128) and top-512. Numerics (relative error; for the top-k, the share of the reference's
  entries the kernel chose) before any timing; bandwidth on the bytes of keys each query reads.
* engine: EngineCore.step() decoding greedily (the `decode_engine.run_case` method) on DeepseekV4ForCausalLM
  with V4-Flash's widths (hidden 4096, 64 heads of 512, 256 experts of 2048, hc_mult 4) and its first
  `--layers` layer kinds (4: sliding, sliding, CSA, HCA; three hash-routed MoE layers, then top-k), random
  bfloat16 weights. The step runs eagerly (V4's step is not yet captured in CUDA graphs: its closed-window
  and expert dispatch shapes depend on the batch's data). step_ms at batch 1 is the TPOT; batch 64 gives tok/s.

    python benchmarks/deepseek_v4_bench.py --phases parity,kernels,engine --output-dir $OUT/deepseek-v4
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

HEADS, HEAD_DIM, WINDOW, PAGE = 64, 512, 128, 128                  # V4-Flash's attention
INDEX_HEADS, INDEX_DIM, INDEX_TOPK, CSA_RATE, HCA_RATE = 64, 128, 512, 4, 128
# Where the kernels and the engine run: the GPU; a test of this script sets the CPU (Triton's interpreter,
# float32, small shapes).
DEVICE, DTYPE_NAME = "cuda", "bfloat16"


def _dtype():
    import torch

    return getattr(torch, DTYPE_NAME)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--phases", default="parity,kernels,engine")
    parser.add_argument("--output-dir", type=Path, required=True)
    parser.add_argument("--contexts", default="4096,65536,262144", help="kernel contexts (tokens)")
    parser.add_argument("--kernel-batches", default="1,64")
    parser.add_argument("--prefill-chunk", type=int, default=2048, help="tokens of the kernels' prompt case")
    parser.add_argument("--layers", type=int, default=4, help="V4-Flash's first N layers (engine phase)")
    parser.add_argument("--experts", type=int, default=256, help="routed experts per layer (engine phase)")
    parser.add_argument("--batches", default="1,64", help="engine decode batches")
    parser.add_argument("--engine-contexts", default="512")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--steps", type=int, default=12)
    args = parser.parse_args(argv)

    args.output_dir.mkdir(parents=True, exist_ok=True)
    failed = False
    for phase in args.phases.split(","):
        started = time.perf_counter()
        result = PHASES[phase](args)
        result.update(phase=phase, seconds=time.perf_counter() - started, command=" ".join(sys.argv),
                      measured_at=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), device=_device())
        (args.output_dir / f"deepseek_v4_{phase}.json").write_text(json.dumps(result, indent=2) + "\n")
        failed |= not result.get("passed", True)
    return 1 if failed else 0


def _device() -> dict:
    from flare.bench import device_identity

    return device_identity()


# ---- parity ---------------------------------------------------------------------------------------


PARITY_PROMPTS = (3, 40, 9, 17, 1, 24, 31, 12)
PARITY_TOKENS = 40


def parity(args) -> dict:
    import tempfile

    import torch
    from transformers import AutoModelForCausalLM

    from deepseek_v4_checkpoints import write_tiny_v4_checkpoint
    from flare.engine.sampling_params import SamplingParams
    from flare.engine_client.llm_engine import LLMEngine

    generator = torch.Generator().manual_seed(0)
    prompts = [[1] + torch.randint(3, 512, (n - 1,), generator=generator).tolist() for n in PARITY_PROMPTS]
    with tempfile.TemporaryDirectory() as folder:
        directory = write_tiny_v4_checkpoint(Path(folder))
        theirs = AutoModelForCausalLM.from_pretrained(directory, dtype=torch.float32).to(DEVICE).eval()
        theirs.generation_config.eos_token_id = None
        expected = []
        for prompt in prompts:
            ids = torch.tensor([prompt], device=DEVICE)
            out = theirs.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=PARITY_TOKENS,
                                  do_sample=False, pad_token_id=0)
            expected.append(out[0, len(prompt):].tolist())
        del theirs
        greedy = SamplingParams(temperature=0, max_tokens=PARITY_TOKENS, ignore_eos=True)
        runs = {}
        for dtype in ("float32", "bfloat16"):
            engine = LLMEngine.from_checkpoint(directory, _tiny_engine_config(directory), DEVICE, dtype, seed=0)
            kernels = engine.core.runner.model.ops.__name__
            got = [list(o.new_token_ids) for o in engine.generate(prompts, greedy)]
            first = [next((i for i, (a, b) in enumerate(zip(g, e)) if a != b), None) for g, e in zip(got, expected)]
            runs[dtype] = {"kernels": kernels, "exact": got == expected, "first_divergence": first}
            print(f"parity {dtype:9} {kernels}: exact {got == expected}, first divergence per request {first}",
                  flush=True)
    return {"benchmark": "DeepSeek V4 greedy parity on the GPU", "prompts": list(PARITY_PROMPTS),
            "new_tokens": PARITY_TOKENS, "runs": runs,
            "passed": runs["float32"]["exact"] and runs["float32"]["kernels"].endswith("compressed_attention")}


def _tiny_engine_config(directory):
    from flare.engine.config import EngineConfig
    from flare.models.cache_spec import cache_spec
    from flare.models.loader import read_model_config

    settings = dict(page_size=16, num_pages=64, max_model_len=128)
    base = EngineConfig(**settings)
    window = cache_spec(read_model_config(directory), base.page_size, 4).window_pool(base.max_num_batched_tokens)
    return EngineConfig(**settings, window_pages=window.pages(base.max_concurrency), window_retention=window.retention)


# ---- kernels --------------------------------------------------------------------------------------


def kernels(args) -> dict:
    import torch

    torch.manual_seed(0)
    cases, passed = [], True
    contexts = [int(c) for c in args.contexts.split(",")]
    for context in contexts:
        shapes = [("decode", batch, 1) for batch in map(int, args.kernel_batches.split(","))]
        shapes.append(("prompt", 1, min(args.prefill_chunk, context)))
        for kind in ("sliding", "csa", "hca"):
            for mode, batch, tokens in shapes:
                case = _attention_case(kind, mode, batch, tokens, context)
                passed &= case["ok"]
                cases.append(case)
                print(f"attention {kind:7} {mode:6} B{batch:<3} T{tokens:<5} C{context:<7} keys {case['keys']:<5} "
                      f"rel {case['relative_error']:.2e} {case['ms']:.4f} ms {case['gb_per_s']:7.1f} GB/s", flush=True)
        for mode, batch, tokens in shapes:
            case = _indexer_case(mode, batch, tokens, context)
            passed &= case["ok"]
            cases.append(case)
            print(f"indexer {mode:6} B{batch:<3} T{tokens:<5} C{context:<7} entries {case['entries']:<6} "
                  f"rel {case['relative_error']:.2e} top-k kept {case['topk_agreement']:.4f} scores "
                  f"{case['scores_ms']:.4f} ms top-k {case['topk_ms']:.4f} ms {case['gb_per_s']:7.1f} GB/s", flush=True)
    return {"benchmark": "DeepSeek V4 kernels against their torch references", "dtype": "bfloat16",
            "shape": {"heads": HEADS, "head_dim": HEAD_DIM, "window": WINDOW, "page_size": PAGE,
                      "index_heads": INDEX_HEADS, "index_head_dim": INDEX_DIM, "index_topk": INDEX_TOPK},
            "cases": cases, "passed": passed}


def _positions(batch: int, tokens: int, context: int):
    """(seq_index [T], positions [T]): `tokens` query tokens per sequence, the last at context - 1."""
    import torch

    seq = torch.arange(batch, device=DEVICE).repeat_interleave(tokens)
    positions = (context - tokens + torch.arange(tokens, device=DEVICE)).repeat(batch)
    return seq, positions


def _paged(batch: int, context: int, rows_per_page: int, width: int, pool: int | None = None):
    """(paged tensor [pages, rows, width] bf16, tables [batch, blocks] int32): each sequence's blocks on
    shuffled pages (`pool` pages shared by every block when given: only the window's are read)."""
    import torch

    blocks = -(-context // PAGE)
    pages = pool if pool is not None else batch * blocks
    data = (torch.randn(pages, rows_per_page, width, device=DEVICE) * 0.5).to(_dtype())
    if pool is not None:
        tables = torch.randint(0, pool, (batch, blocks), device=DEVICE, dtype=torch.int32)
    else:
        tables = torch.randperm(pages, device=DEVICE).int().view(batch, blocks)
    return data, tables


def _attention_case(kind: str, mode: str, batch: int, tokens: int, context: int) -> dict:
    import torch

    from flare.kernels import compressed_attention as triton_ops
    from flare.kernels import compressed_attention_reference as reference

    seq, positions = _positions(batch, tokens, context)
    query = torch.randn(batch * tokens, HEADS, HEAD_DIM, device=DEVICE).to(_dtype())
    window_kv, window_tables = _paged(batch, context, PAGE, HEAD_DIM, pool=4 * batch + 4)
    sinks = torch.randn(HEADS, device=DEVICE)
    extra, keys = {}, WINDOW
    if kind != "sliding":
        rate = CSA_RATE if kind == "csa" else HCA_RATE
        entries, page_tables = _paged(batch, context, PAGE // rate, HEAD_DIM)
        visible = (positions + 1) // rate
        extra = {"entries": entries, "page_tables": page_tables}
        if kind == "csa":
            scores = torch.rand(positions.shape[0], context // rate, device=DEVICE)
            extra["entry_ids"] = reference.top_entries(
                scores.masked_fill(torch.arange(context // rate, device=DEVICE)[None] >= visible[:, None], -1.0),
                visible, INDEX_TOPK)
            keys += extra["entry_ids"].shape[1]
        else:
            extra["entry_counts"] = visible
            keys += int(visible.max())
    scale = HEAD_DIM**-0.5
    inputs = (query, window_kv, window_tables, seq, positions, WINDOW, sinks, scale)
    ours = triton_ops.sparse_attention(*inputs, **extra)
    truth = reference.sparse_attention_reference(*inputs, **extra)
    error = _relative_error(ours, truth)
    ms = _bench_ms(lambda: triton_ops.sparse_attention(*inputs, **extra))
    # Bytes each query token's block of heads reads: its keys (bf16) once per head block, and its query.
    heads_blocks = -(-HEADS // triton_ops.BLOCK_H)
    read = positions.shape[0] * (heads_blocks * keys * HEAD_DIM * 2 + 2 * HEADS * HEAD_DIM * 2)
    return {"kernel": "sparse_attention", "kind": kind, "mode": mode, "batch": batch, "tokens": tokens,
            "context": context, "keys": keys, "relative_error": error, "ok": error < 2e-2, "ms": ms,
            "gb_per_s": read / ms / 1e6}


def _indexer_case(mode: str, batch: int, tokens: int, context: int) -> dict:
    import torch

    from flare.kernels import compressed_attention as triton_ops
    from flare.kernels import compressed_attention_reference as reference

    seq, positions = _positions(batch, tokens, context)
    count = positions.shape[0]
    query = torch.randn(count, INDEX_HEADS, INDEX_DIM, device=DEVICE).to(_dtype())
    weights = torch.randn(count, INDEX_HEADS, device=DEVICE) * INDEX_HEADS**-0.5
    keys, page_tables = _paged(batch, context, PAGE // CSA_RATE, INDEX_DIM)
    visible = (positions + 1) // CSA_RATE
    scale, width = INDEX_DIM**-0.5, int(visible.max())
    # The reference holds [T, heads, entries] float32: compare on at most 64 query tokens.
    sample = slice(0, min(count, 64))
    args = (query[sample], weights[sample], keys, page_tables, seq[sample], visible[sample], scale)
    ours = triton_ops.indexer_scores(*args, width)
    truth = reference.indexer_scores_reference(*args)
    finite = torch.isfinite(truth)
    error = _relative_error(ours[finite], truth[finite])
    chosen = triton_ops.indexer_topk(*args, INDEX_TOPK)
    expected = reference.top_entries(truth, visible[sample], INDEX_TOPK)
    agreement = _overlap(chosen, expected)
    full = (query, weights, keys, page_tables, seq, visible, scale)
    scores_ms = _bench_ms(lambda: triton_ops.indexer_scores(*full, width))
    topk_ms = _bench_ms(lambda: triton_ops.indexer_topk(*full, INDEX_TOPK))
    read = count * (width * INDEX_DIM * 2 + INDEX_HEADS * INDEX_DIM * 2)
    return {"kernel": "indexer", "mode": mode, "batch": batch, "tokens": tokens, "context": context,
            "entries": width, "relative_error": error, "topk_agreement": agreement,
            "ok": error < 2e-2 and agreement > 0.95, "scores_ms": scores_ms, "topk_ms": topk_ms,
            "gb_per_s": read / scores_ms / 1e6}


def _overlap(chosen, expected) -> float:
    """The share of the reference's chosen entries (not -1) the kernel chose too, over every token."""
    kept = total = 0
    for ours, theirs in zip(chosen.tolist(), expected.tolist()):
        theirs = {e for e in theirs if e >= 0}
        kept += len(theirs & set(ours))
        total += len(theirs)
    return kept / max(total, 1)


def _relative_error(out, ref) -> float:
    return float((out.double() - ref.double()).norm() / ref.double().norm().clamp(min=1e-30))


def _bench_ms(fn) -> float:
    if DEVICE != "cuda":                      # the CPU's interpreter: one call, for the script's test
        started = time.perf_counter()
        fn()
        return (time.perf_counter() - started) * 1000
    import triton.testing

    return triton.testing.do_bench(fn, warmup=25, rep=100, return_mode="median")


def _synchronize() -> None:
    import torch

    if DEVICE == "cuda":
        torch.cuda.synchronize()


# ---- engine ---------------------------------------------------------------------------------------


def flash_cut(layers: int, experts: int) -> dict:
    """V4-Flash's config.json cut to its first `layers` layers and `experts` routed experts, in bfloat16."""
    from flare.recipes.deepseek_v4 import FLASH_CONFIG

    config = {key: value for key, value in FLASH_CONFIG.items() if key not in ("quantization_config", "expert_dtype")}
    config.update(num_hidden_layers=layers, n_routed_experts=experts, torch_dtype="bfloat16",
                  compress_ratios=FLASH_CONFIG["compress_ratios"][:layers])
    return config


def randomize_v4_(model, std: float = 0.02) -> None:
    """Random weights in place: norms at one, hash routes random expert ids, everything else normal(0, std)."""
    import torch

    with torch.no_grad():
        for name, param in model.named_parameters():
            if name.endswith("norm.weight"):
                param.fill_(1.0)
            elif name.endswith("tid2eid"):
                experts = model.cfg.v4.num_experts
                param.copy_(torch.rand(param.shape[0], experts, device=param.device).argsort(-1)[:, :param.shape[1]])
            else:
                param.normal_(0.0, std)


def engine(args) -> dict:
    import torch

    from decode_engine import decode_budget, run_case
    from flare.engine.config import EngineConfig
    from flare.engine.factory import attention_backend_for
    from flare.engine.runner import ModelRunner
    from flare.models import ModelConfig, build_model
    from flare.models.cache_spec import cache_spec

    batches = [int(b) for b in args.batches.split(",")]
    contexts = [int(c) for c in args.engine_contexts.split(",")]
    hf = flash_cut(args.layers, args.experts)
    cfg = ModelConfig.from_hf_config(hf)
    started = time.perf_counter()
    model = build_model(cfg, _dtype(), DEVICE, attention_backend_for(cfg, DEVICE))
    randomize_v4_(model)
    _synchronize()
    weights_gib = sum(p.numel() * p.element_size() for p in model.parameters()) / 2**30
    build_s = time.perf_counter() - started
    longest = max(contexts) + decode_budget(max(batches), max(contexts), args.warmup, args.steps)
    pages_per_request = -(-longest // PAGE)
    chunk = 2048
    window = cache_spec(cfg, PAGE, 2).window_pool(chunk)
    config = EngineConfig(max_concurrency=max(batches), page_size=PAGE, num_pages=max(batches) * pages_per_request,
                          prefill_chunk=chunk, max_num_batched_tokens=max(chunk, max(batches)),
                          max_model_len=pages_per_request * PAGE, enable_prefix_caching=False,
                          window_pages=window.pages(max(batches)), window_retention=window.retention)
    runner = ModelRunner(model, cfg, config, DEVICE, _dtype(), seed=0, graphs=False)
    print(f"engine: V4-Flash widths, {args.layers} layers {list(cfg.v4.layer_types)}, {args.experts} experts, "
          f"{weights_gib:.1f} GiB of weights, built in {build_s:.1f} s", flush=True)
    cases = []
    for context in contexts:
        for batch in batches:
            case = run_case(runner, config, cfg.vocab_size, batch, context, args.warmup, args.steps)
            case.pop("step_ms_samples", None)
            cases.append(case)
            print(f"engine B{batch:<3} C{context:<6} step {case['step_ms']:.2f} ms (launch {case['launch_ms']:.2f}) "
                  f"{case['tokens_per_s']:.0f} tok/s", flush=True)
    return {"benchmark": "DeepSeek V4 engine decode step (eager), random weights in V4-Flash's widths",
            "layers": args.layers, "layer_types": list(cfg.v4.layer_types),
            "mlp_layer_types": list(cfg.v4.mlp_layer_types), "experts": args.experts, "weights_gib": weights_gib,
            "page_size": PAGE, "window_pages": config.window_pages, "build_s": build_s,
            "peak_memory_gib": torch.cuda.max_memory_allocated() / 2**30 if DEVICE == "cuda" else None, "cases": cases,
            "tpot_ms_c1": next((c["step_ms"] for c in cases if c["batch"] == 1), None),
            "tokens_per_s_c64": next((c["tokens_per_s"] for c in cases if c["batch"] == 64), None)}


PHASES = {"parity": parity, "kernels": kernels, "engine": engine}


if __name__ == "__main__":
    sys.exit(main())
