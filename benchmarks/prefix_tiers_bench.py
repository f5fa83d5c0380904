#!/usr/bin/env python
"""Time to first token of a long prefix repeated after it left the GPU, through a running server's HTTP API.

Three modes, each writing JSON:

* `evicted`: per repetition, a fresh random prefix (`--prefix-tokens`, 32,000 by default) plus a short
  suffix is sent (it misses every cache: the recomputing TTFT); the same prefix with another suffix at
  once (still in the GPU's pages: the GPU tier's TTFT); then unrelated prompts of `--evict-tokens` in all
  push it out of the GPU's KV pages; then the prefix with a third suffix (its TTFT is the tier's). The
  server's /v1/engine/stats before and after each say which tier served it.
* `prime`: the first half of `evicted` (the prefixes and their recomputing TTFTs go to `--state`), for a
  server that is restarted before `repeat`;
* `repeat`: the prefixes of `--state` again, with other suffixes (after a restart: from disk).

Every request is a Completions call with a token-id prompt, streamed, 2 tokens out, `ignore_eos`; TTFT is
the time to the first streamed token. The ratio reported is the tier's TTFT over the recomputing one.

    python benchmarks/prefix_tiers_bench.py evicted --base-url http://127.0.0.1:8011 --model llama-8b \
        --vocab-size 128256 --evict-tokens 160000 --output host.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path

import httpx

TIER_FIELDS = ("prefix_cache_hit_tokens", "prefix_cache_host_hit_tokens", "prefix_cache_disk_hit_tokens",
               "prefix_cache_pool_hit_tokens", "retained_bytes_host_to_gpu", "retained_bytes_disk_to_host")


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("mode", choices=("evicted", "prime", "repeat"))
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True)
    parser.add_argument("--vocab-size", type=int, default=32000, help="random prompt ids are drawn below this")
    parser.add_argument("--prefix-tokens", type=int, default=32000)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--evict-tokens", type=int, default=160000,
                        help="unrelated prompt tokens sent between the two requests of `evicted`")
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--state", type=Path, help="prime writes, repeat reads the prefixes here")
    parser.add_argument("--output", type=Path)
    args = parser.parse_args(argv)
    if args.mode != "evicted" and args.state is None:
        parser.error(f"{args.mode} needs --state")
    rng = random.Random(args.seed)
    client = httpx.Client(base_url=args.base_url, timeout=600)
    tokens = lambda count: [rng.randrange(100, args.vocab_size) for _ in range(count)]

    timed(client, args.model, tokens(args.suffix_tokens + 64), "warm-up")
    if args.mode == "repeat":
        state = json.loads(args.state.read_text())
        samples = [dict(sample, **timed(client, args.model, sample["prefix"] + tokens(args.suffix_tokens), "tier"))
                   for sample in state["samples"]]
    else:
        samples = []
        for repetition in range(args.repetitions):
            prefix = tokens(args.prefix_tokens)
            sample = {"prefix": prefix, **timed(client, args.model, prefix + tokens(args.suffix_tokens), "recompute")}
            if args.mode == "evicted":
                sample.update(timed(client, args.model, prefix + tokens(args.suffix_tokens), "gpu"))
                evict(client, args.model, tokens, args.evict_tokens, args.prefix_tokens)
                sample.update(timed(client, args.model, prefix + tokens(args.suffix_tokens), "tier"))
            samples.append(sample)
            print(f"repetition {repetition}: {brief(sample)}", file=sys.stderr, flush=True)
    if args.mode == "prime":
        args.state.write_text(json.dumps({"samples": samples}))
    result = summarize(args, samples)
    print(json.dumps({key: value for key, value in result.items() if key != "samples"}, indent=2))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def stats(client: httpx.Client) -> dict:
    return client.get("/v1/engine/stats").json()


def timed(client: httpx.Client, model: str, prompt: list[int], label: str) -> dict:
    """Send one streamed completion; its TTFT in ms and what each tier served, as `{label}_…` fields."""
    before = stats(client)
    started = time.perf_counter()
    first = None
    body = {"model": model, "prompt": prompt, "max_tokens": 2, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with client.stream("POST", "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]" and first is None:
                first = time.perf_counter()
    after = stats(client)
    found = {f"{label}_ttft_ms": round(((first or time.perf_counter()) - started) * 1000, 2)}
    found.update({f"{label}_{field}": after.get(field, 0) - before.get(field, 0) for field in TIER_FIELDS})
    return found


def evict(client: httpx.Client, model: str, tokens, evict_tokens: int, chunk: int) -> None:
    """Unrelated prompts, `evict_tokens` in all, one token out each: the GPU's pages fill with them."""
    sent = 0
    while sent < evict_tokens:
        count = min(chunk, evict_tokens - sent)
        client.post("/v1/completions", json={"model": model, "prompt": tokens(count), "max_tokens": 1,
                                              "temperature": 0}).raise_for_status()
        sent += count


def brief(sample: dict) -> str:
    text = f"recompute {sample['recompute_ttft_ms']:.0f} ms"
    if "gpu_ttft_ms" in sample:
        text += f", from the GPU {sample['gpu_ttft_ms']:.0f} ms"
    if "tier_ttft_ms" in sample:
        text += (f", repeated {sample['tier_ttft_ms']:.0f} ms (GPU hit "
                 f"{sample['tier_prefix_cache_hit_tokens'] - tier_hits(sample):,}, host "
                 f"{sample['tier_prefix_cache_host_hit_tokens']:,}, disk {sample['tier_prefix_cache_disk_hit_tokens']:,} tokens)")
    return text


def tier_hits(sample: dict) -> int:
    return sum(sample[f"tier_prefix_cache_{tier}_hit_tokens"] for tier in ("host", "disk", "pool"))


def summarize(args, samples: list[dict]) -> dict:
    result = {"mode": args.mode, "prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
              "evict_tokens": args.evict_tokens if args.mode == "evicted" else None,
              "recompute_ttft_ms": statistics.median(s["recompute_ttft_ms"] for s in samples)}
    if all("gpu_ttft_ms" in s for s in samples):
        gpu = statistics.median(s["gpu_ttft_ms"] for s in samples)
        result.update(gpu_ttft_ms=gpu, gpu_ratio=round(gpu / result["recompute_ttft_ms"], 3),
                      gpu_repeat_hit_tokens=[s["gpu_prefix_cache_hit_tokens"] for s in samples])
    if all("tier_ttft_ms" in s for s in samples):
        tier = statistics.median(s["tier_ttft_ms"] for s in samples)
        result.update(tier_ttft_ms=tier, ratio=round(tier / result["recompute_ttft_ms"], 3),
                      host_hit_tokens=[s["tier_prefix_cache_host_hit_tokens"] for s in samples],
                      disk_hit_tokens=[s["tier_prefix_cache_disk_hit_tokens"] for s in samples],
                      gpu_hit_tokens=[s["tier_prefix_cache_hit_tokens"] - tier_hits(s) for s in samples])
    result["samples"] = [{key: value for key, value in s.items() if key != "prefix"} for s in samples]
    return result


if __name__ == "__main__":
    sys.exit(main())
