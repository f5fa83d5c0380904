#!/usr/bin/env python
"""Sampling micro-benchmark on a GPU: the device sampler's Triton kernels against the sort-based torch path.

For each vocabulary (llama-3's 128,256 and qwen3's 151,936 entries), batch (1, 8, 64, 256) and case,
times, in milliseconds per call:
  kernel-graph   DeviceSampler.sample captured in a CUDA graph and replayed (as the decode graph runs it)
  kernel-eager   DeviceSampler.sample called from Python (21 kernel launches)
  radix-graph    (--radix) the same with the candidate list off: every random row through the 16 radix
                 passes, the algorithm before the candidate path
  sort-graph     the sort-based torch sampling (penalties from dense counts, temperature, full sort,
                 top-k, cumulative top-p, softmax, exponential race) on device tensors, in a CUDA graph
Cases: default (temperature 0.6, top-p 0.9), topk20-topp0.95 (temperature 0.6), greedy, penalties
(default + repetition 1.1, presence 0.5, frequency 0.3, over a 1,000-token prompt and 200 outputs).
CUDA events around each call or replay, the median of --reps after warm-up; logits are
N(0, --scale^2) fp32.

Each line also says how many random rows the candidate path took (the rest took the radix passes).
Before timing it checks the kernels against the torch reference on the GPU (fp32 and bf16 logits,
every case plus min-p, logit bias and an allowed-token mask, with the candidate list and without):
tokens must be equal, and where one differs it reports how close the reference's race was there (a
difference at a gap of a few ulps is exp/log rounding; anything else is a bug).

    python3 benchmarks/sampling_bench.py --output $OUT/sampling_bench.json
    python3 benchmarks/sampling_bench.py --vocabs 128256 --batches 1,64 --sweep    # tiles too
    python3 benchmarks/sampling_bench.py --radix --scale 1.3 --output $OUT/flat.json   # old vs new, flat logits
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from flare.engine.sampler import DeviceSampler  # noqa: E402
from flare.engine.sampling_params import SamplingParams  # noqa: E402

CASES = {
    "default": SamplingParams(temperature=0.6, top_p=0.9),
    "topk20-topp0.95": SamplingParams(temperature=0.6, top_k=20, top_p=0.95),
    "greedy": SamplingParams(temperature=0.0),
    "penalties": SamplingParams(temperature=0.6, top_p=0.9, repetition_penalty=1.1, presence_penalty=0.5,
                                frequency_penalty=0.3),
}
CHECK_EXTRA = [SamplingParams(temperature=1.0, min_p=0.05), SamplingParams(temperature=0.8, min_p=0.02, top_k=50),
               SamplingParams(temperature=0.7, top_p=0.8, logit_bias=((5, 8.0), (1000, 4.0), (70000, -3.0))),
               SamplingParams(temperature=1.0)]
PROMPT_TOKENS, OUTPUT_TOKENS = 1000, 200


def history(vocab: int, row: int) -> tuple[list[int], list[int]]:
    generator = torch.Generator().manual_seed(row)
    tokens = torch.randint(0, vocab, (PROMPT_TOKENS + OUTPUT_TOKENS,), generator=generator).tolist()
    return tokens[:PROMPT_TOKENS], tokens[PROMPT_TOKENS:]


def device_sampler(params: list[SamplingParams], vocab: int, kernel_config=None, use_triton=True) -> DeviceSampler:
    sampler = DeviceSampler(len(params), vocab, "cuda", seed=0, use_triton=use_triton, kernel_config=kernel_config)
    for slot, p in enumerate(params):
        sampler.add(slot, p, *history(vocab, slot))
    return sampler


def time_calls(fn, reps: int, warmup: int) -> list[float]:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end))
    return samples


def graphed(fn, warmup: int = 3):
    """fn captured in a CUDA graph (after eager warm-up on a side stream); returns graph.replay."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(warmup):
            fn()
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        fn()
    return graph.replay


class SortPath:
    """The sort-based sampling on device tensors only (capturable): what the engine's earlier per-step
    sampler computed, without its host work, with dense penalty counts like the device sampler's tables."""

    def __init__(self, params: list[SamplingParams], vocab: int) -> None:
        cuda = dict(device="cuda")
        self.temperature = torch.tensor([max(p.temperature, 1e-5) for p in params], **cuda)[:, None]
        self.greedy = torch.tensor([p.greedy for p in params], **cuda)
        self.top_k = torch.tensor([p.top_k if p.top_k > 0 else vocab for p in params], **cuda)[:, None]
        self.top_p = torch.tensor([p.top_p for p in params], **cuda)[:, None]
        self.repetition = torch.tensor([p.repetition_penalty for p in params], **cuda)[:, None]
        self.presence = torch.tensor([p.presence_penalty for p in params], **cuda)[:, None]
        self.frequency = torch.tensor([p.frequency_penalty for p in params], **cuda)[:, None]
        self.penalties = any(p.repetition_penalty != 1 or p.presence_penalty or p.frequency_penalty for p in params)
        self.seen = torch.zeros(len(params), vocab, dtype=torch.bool, **cuda)
        self.counts = torch.zeros(len(params), vocab, **cuda)
        for row in range(len(params)):
            prompt, output = history(vocab, row)
            self.seen[row, prompt] = True
            self.counts[row].index_add_(0, torch.tensor(output, **cuda), torch.ones(len(output), **cuda))
        self.positions = torch.arange(vocab, **cuda)[None, :]

    def __call__(self, logits: torch.Tensor) -> torch.Tensor:
        if self.penalties:
            seen = self.seen | (self.counts > 0)
            logits = torch.where(seen, torch.where(logits > 0, logits / self.repetition, logits * self.repetition),
                                 logits)
            logits = logits - (self.frequency * self.counts + self.presence * (self.counts > 0))
        greedy = logits.argmax(dim=-1)
        scaled = logits / self.temperature
        ordered, order = scaled.sort(dim=-1, descending=True)
        ordered = ordered.masked_fill(self.positions >= self.top_k, float("-inf"))
        probs = ordered.softmax(dim=-1)
        beyond = (probs.cumsum(dim=-1) - probs) >= self.top_p
        beyond[:, 0] = False
        ordered = ordered.masked_fill(beyond, float("-inf"))
        probs = torch.empty_like(scaled).scatter_(-1, order, ordered).softmax(dim=-1)
        drawn = (probs / torch.empty_like(probs).exponential_()).argmax(dim=-1)
        return torch.where(self.greedy, greedy, drawn)


def check(vocabs: list[int], scale: float) -> list[dict]:
    """Kernel against reference on the GPU: equal tokens, and where not, the reference race's gap."""
    from flare.kernels import sampling_reference as reference
    from flare.kernels.sampling import SamplingKernelConfig

    found = []
    params = (list(CASES.values()) + CHECK_EXTRA) * 4
    for vocab, dtype, candidates in ((v, d, c) for v in vocabs for d in (torch.float32, torch.bfloat16)
                                     for c in (SamplingKernelConfig().candidates, 0)):
        kernel = device_sampler(params, vocab, SamplingKernelConfig(candidates=candidates))
        torch_path = device_sampler(params, vocab, use_triton=False)
        rows = len(params)
        generator = torch.Generator().manual_seed(vocab)
        logits = (torch.randn(rows, vocab, generator=generator) * scale).to(dtype).cuda()
        allowed = torch.rand(rows, vocab, generator=generator) < 0.5
        allowed[:, 0] = True
        mask = torch.stack([reference.pack_bits(r.nonzero()[:, 0].tolist(), vocab) for r in allowed]).cuda()
        slots = torch.arange(rows, device="cuda")
        positions = torch.randint(0, 100_000, (rows,), generator=generator).cuda()
        for masked in (None, mask):
            got = kernel.sample(logits, slots, positions, masked)
            on_list = candidate_rows(kernel, rows)
            want = torch_path.sample(logits, slots, positions, masked)
            differ = (got != want).nonzero()[:, 0].tolist()
            gaps = [_race_gap(torch_path, logits, slots, positions, masked, row, int(got[row])) for row in differ]
            probs_error = float((kernel.target_probs(logits, slots, masked)
                                 - torch_path.target_probs(logits, slots, masked)).abs().max())
            found.append(dict(vocab=vocab, dtype=str(dtype).removeprefix("torch."), masked=masked is not None,
                              candidates=candidates, candidate_rows=on_list,
                              rows=rows, differing_rows=differ, reference_race_gaps=gaps,
                              target_probs_max_abs_error=probs_error))
            print(f"check V={vocab} {found[-1]['dtype']} mask={masked is not None} candidates={candidates}: "
                  f"{len(differ)}/{rows} rows differ {gaps}, {found[-1]['candidate_rows']} rows on the "
                  f"candidate path, target_probs max error {probs_error:.2e}", flush=True)
    return found


def candidate_rows(sampler: DeviceSampler, rows: int) -> int:
    """How many of the last call's rows the candidate path sampled."""
    from flare.kernels.sampling import MODE_CANDIDATES

    return int((sampler._workspace.row_mode[:rows] == MODE_CANDIDATES).sum())


def _race_gap(sampler, logits, slots, positions, mask, row, kernel_token) -> float:
    """How far the kernel's token trails the reference's winner in the reference's own race (x + g)."""
    from flare.kernels import sampling_reference as reference

    one = slice(row, row + 1)
    w = reference.processed_logits(logits[one], slots[one], sampler.tables, None if mask is None else mask[one])
    kept = reference.kept_tokens(w, slots[one], sampler.tables)
    fields = reference.RowParams.gather(sampler.tables, slots[one])
    x = (w - w.max()) * fields.inv_temperature
    g = reference.gumbel_noise(fields.seed_lo, fields.seed_hi, positions[one, None],
                               torch.arange(w.shape[1], device=w.device)[None, :])
    score = torch.where(kept, x + g, float("-inf"))[0]
    return float(score.max() - score[kernel_token]) if kept[0, kernel_token] else float("inf")


def bench(vocabs, batches, reps, warmup, scale, sweep, radix) -> list[dict]:
    from flare.kernels.sampling import SamplingKernelConfig

    configs = [SamplingKernelConfig()] + ([SamplingKernelConfig(candidates=0)] if radix else [])
    if sweep:
        configs += [SamplingKernelConfig(chunk=4096, block=512), SamplingKernelConfig(chunk=8192, block=1024, num_warps=8),
                    SamplingKernelConfig(chunk=2048, block=512), SamplingKernelConfig(chunk=4096, block=2048, num_warps=8)]
    results = []
    for vocab in vocabs:
        for batch in batches:
            logits = torch.randn(batch, vocab, device="cuda") * scale
            positions = torch.arange(batch, device="cuda") + 1000
            slots = torch.arange(batch, device="cuda")
            for case, case_params in CASES.items():
                params = [case_params] * batch
                timings = {}
                for config in configs:
                    sampler = device_sampler(params, vocab, config)
                    call = lambda: sampler.sample(logits, slots, positions)    # noqa: E731
                    if config.candidates == 0:
                        name = "radix-graph"
                    else:
                        name = "kernel-graph" + ("" if config == configs[0] else
                                                 f" {config.chunk}/{config.block}/{config.num_warps}w")
                    timings[name] = time_calls(graphed(call), reps, warmup)
                    if config == configs[0]:
                        timings["kernel-eager"] = time_calls(call, reps, warmup)
                        on_list = candidate_rows(sampler, batch)
                    del sampler
                sort_path = SortPath(params, vocab)
                timings["sort-graph"] = time_calls(graphed(lambda: sort_path(logits)), reps, warmup)
                del sort_path
                for method, samples in timings.items():
                    results.append(dict(vocab=vocab, batch=batch, case=case, method=method, candidate_rows=on_list,
                                        median_ms=statistics.median(samples), min_ms=min(samples),
                                        p90_ms=sorted(samples)[int(0.9 * (len(samples) - 1))], samples_ms=samples))
                line = "  ".join(f"{m} {statistics.median(s):.3f}" for m, s in timings.items())
                print(f"V={vocab} B={batch} {case}: {line}  (candidate path: {on_list}/{batch} rows)", flush=True)
                torch.cuda.empty_cache()
    return results


def print_table(results: list[dict]) -> None:
    methods = list(dict.fromkeys(r["method"] for r in results))
    print("\nmedian ms per call")
    print("| vocab | batch | case | " + " | ".join(methods) + " |")
    print("|---|---|---|" + "---|" * len(methods))
    keys = list(dict.fromkeys((r["vocab"], r["batch"], r["case"]) for r in results))
    for key in keys:
        row = {r["method"]: r["median_ms"] for r in results if (r["vocab"], r["batch"], r["case"]) == key}
        print(f"| {key[0]} | {key[1]} | {key[2]} | " + " | ".join(f"{row[m]:.3f}" if m in row else "-"
                                                                for m in methods) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--vocabs", default="128256,151936")
    parser.add_argument("--batches", default="1,8,64,256")
    parser.add_argument("--reps", type=int, default=100)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--scale", type=float, default=3.0, help="standard deviation of the random logits")
    parser.add_argument("--sweep", action="store_true", help="also time other kernel tilings (graph only)")
    parser.add_argument("--radix", action="store_true", help="also time the radix passes alone (candidate list off)")
    parser.add_argument("--skip-check", action="store_true")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        sys.exit("sampling_bench needs a CUDA GPU")
    import triton

    vocabs = [int(v) for v in args.vocabs.split(",")]
    batches = [int(b) for b in args.batches.split(",")]
    started = time.time()
    checks = [] if args.skip_check else check(vocabs, args.scale)
    results = bench(vocabs, batches, args.reps, args.warmup, args.scale, args.sweep, args.radix)
    print_table(results)
    report = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, triton=triton.__version__,
                  date=time.strftime("%Y-%m-%d"), commit=_commit(), command=" ".join(sys.argv),
                  seconds=round(time.time() - started, 1), checks=checks, results=results)
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(report, indent=1))
        print(f"wrote {args.output}")
    if any(c["differing_rows"] and max(c["reference_race_gaps"]) > 1e-3 for c in checks):
        sys.exit("the kernel and the reference disagree beyond rounding (see the check lines above)")


def _commit() -> str | None:
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True, check=True,
                              cwd=Path(__file__).parent).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


if __name__ == "__main__":
    main()
