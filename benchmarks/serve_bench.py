#!/usr/bin/env python
"""Serving benchmark: drive a running server's OpenAI Completions API as users do, and measure.

For each concurrency level, send `--prompts-per-concurrency` × concurrency streaming requests with
fixed input and output lengths (`ignore_eos`, so every request produces exactly --output-len tokens),
at most `concurrency` in flight. Reports time to first token (TTFT), time per output token after the
first (TPOT), inter-token latency between streamed chunks (ITL), each at p50/p99, and output tokens/s.
Prints a table and writes JSON.

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --model llama-8b \
        --input-len 1000 --output-len 256 --concurrency 1,16,64,256 --output results/serve.json

Prompts are random token ids sent as a token array (the Completions API accepts one), so their length
is exact; with --tokenizer DIR they are sent as text decoded from those ids instead.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path


@dataclass
class RequestResult:
    ok: bool
    started: float
    ttft: float = 0.0                     # seconds to the first streamed token
    latency: float = 0.0                  # seconds to the last byte
    output_tokens: int = 0
    chunk_gaps: list[float] = field(default_factory=list)    # seconds between streamed chunks
    error: str = ""

    @property
    def tpot(self) -> float | None:
        if self.output_tokens < 2:
            return None
        return (self.latency - self.ttft) / (self.output_tokens - 1)


def percentile(values: list[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    position = (len(ordered) - 1) * q / 100
    low = int(position)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (position - low)


def make_prompts(count: int, input_len: int, vocab_size: int, seed: int, tokenizer_dir: str | None,
                 shared_prefix_len: int = 0, prefix_seed: int = 0):
    """Random prompts of input_len ids; the first shared_prefix_len ids (drawn from prefix_seed) are the
    same in every prompt of every level, like a system prompt, so a prefix cache can skip them."""
    prefix_rng = random.Random(prefix_seed)
    prefix = [prefix_rng.randrange(100, vocab_size) for _ in range(min(shared_prefix_len, input_len))]
    rng = random.Random(seed)
    prompts = [prefix + [rng.randrange(100, vocab_size) for _ in range(input_len - len(prefix))]
               for _ in range(count)]
    if tokenizer_dir is None:
        return prompts
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tokenizer_dir) / "tokenizer.json"))
    return [tokenizer.decode(ids) for ids in prompts]


async def one_request(client, url: str, payload: dict) -> RequestResult:
    result = RequestResult(ok=False, started=time.perf_counter())
    last = result.started
    try:
        async with client.stream("POST", url, json=payload) as response:
            if response.status_code != 200:
                body = (await response.aread()).decode(errors="replace")
                result.error = f"HTTP {response.status_code}: {body[:300]}"
                return result
            chunks = 0
            last_event = ""
            async for line in response.aiter_lines():
                if not line.startswith("data:"):
                    continue
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                last_event = data
                event = json.loads(data)
                usage = event.get("usage")
                if usage and usage.get("completion_tokens"):
                    result.output_tokens = usage["completion_tokens"]
                choices = event.get("choices") or []
                if not choices or not choices[0].get("text"):
                    continue
                now = time.perf_counter()
                if chunks == 0:
                    result.ttft = now - result.started
                else:
                    result.chunk_gaps.append(now - last)
                last = now
                chunks += 1
            result.latency = time.perf_counter() - result.started
            result.output_tokens = result.output_tokens or chunks
            result.ok = chunks > 0
            if not result.ok:
                result.error = f"no tokens streamed; last event: {last_event[:300]}"
    except Exception as error:                                  # a benchmark reports, never crashes
        result.error = f"{type(error).__name__}: {error}"
    return result


# --json-schema: every request's reply is constrained to this schema (a long array of records, so the
# grammar masks every step of a 256-token reply); the tokenizer must spell JSON (braces, quotes, digits).
BENCH_SCHEMA = {"type": "object", "properties": {"records": {"type": "array", "minItems": 64, "items": {
    "type": "object", "properties": {"id": {"type": "integer"}, "name": {"type": "string", "maxLength": 16},
                                     "ok": {"type": "boolean"}}, "required": ["id", "name", "ok"]}}},
    "required": ["records"]}


async def run_level(base_url: str, model: str, prompts: list, output_len: int, concurrency: int,
                    api_key: str | None, json_schema: bool = False) -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    url = base_url.rstrip("/") + "/v1/completions"
    gate = asyncio.Semaphore(concurrency)

    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        async def gated(prompt):
            payload = {"model": model, "prompt": prompt, "max_tokens": output_len, "temperature": 0.0,
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            if json_schema:
                payload["response_format"] = {"type": "json_schema",
                                              "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}
            async with gate:
                return await one_request(client, url, payload)

        started = time.perf_counter()
        results = await asyncio.gather(*(gated(prompt) for prompt in prompts))
        return list(results), time.perf_counter() - started


def summarize(concurrency: int, results: list[RequestResult], duration: float, output_len: int) -> dict:
    good = [result for result in results if result.ok]
    ms = 1000.0
    ttfts = [result.ttft * ms for result in good]
    tpots = [result.tpot * ms for result in good if result.tpot is not None]
    gaps = [gap * ms for result in good for gap in result.chunk_gaps]
    output_tokens = sum(result.output_tokens for result in good)
    summary = {
        "concurrency": concurrency, "requests": len(results), "failed": len(results) - len(good),
        "duration_s": duration, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration if duration else 0.0,
        "short_outputs": sum(1 for result in good if result.output_tokens != output_len),
    }
    for name, values in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("itl_ms", gaps)):
        summary[name] = {"mean": statistics.fmean(values) if values else float("nan"),
                         "p50": percentile(values, 50), "p99": percentile(values, 99)}
    errors = sorted({result.error for result in results if not result.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def table(levels: list[dict]) -> str:
    header = (f"{'conc':>5} {'reqs':>5} {'fail':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8}   (ms)")
    rows = [header]
    for level in levels:
        rows.append(f"{level['concurrency']:>5} {level['requests']:>5} {level['failed']:>4} "
                    f"{level['output_tokens_per_s']:>10.1f} {level['ttft_ms']['p50']:>9.1f} "
                    f"{level['ttft_ms']['p99']:>9.1f} {level['tpot_ms']['p50']:>9.2f} {level['tpot_ms']['p99']:>9.2f} "
                    f"{level['itl_ms']['p50']:>8.2f} {level['itl_ms']['p99']:>8.2f}")
    return "\n".join(rows)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", default="1,16,64,256", help="comma-separated levels")
    parser.add_argument("--prompts-per-concurrency", type=int, default=4,
                        help="requests per level = this × concurrency (at least --min-prompts)")
    parser.add_argument("--min-prompts", type=int, default=8)
    parser.add_argument("--vocab-size", type=int, default=32000, help="random prompt ids are drawn below this")
    parser.add_argument("--tokenizer", default=None, help="send text prompts decoded with DIR/tokenizer.json")
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="leading prompt tokens common to every request (exercises the prefix cache)")
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-schema", action="store_true",
                        help="constrain every reply to a JSON schema (grammar masks on every step)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)

    levels = [int(part) for part in args.concurrency.split(",")]
    warm = make_prompts(args.warmup_requests, args.input_len, args.vocab_size, args.seed + 999, args.tokenizer)
    if warm:
        asyncio.run(run_level(args.base_url, args.model, warm, min(16, args.output_len), len(warm), args.api_key,
                              args.json_schema))
    summaries = []
    for concurrency in levels:
        count = max(args.min_prompts, args.prompts_per_concurrency * concurrency)
        prompts = make_prompts(count, args.input_len, args.vocab_size, args.seed + concurrency, args.tokenizer,
                               args.shared_prefix_len, prefix_seed=args.seed)
        results, duration = asyncio.run(run_level(args.base_url, args.model, prompts, args.output_len,
                                                  concurrency, args.api_key, args.json_schema))
        summaries.append(summarize(concurrency, results, duration, args.output_len))
        print(table(summaries[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    document = {"benchmark": "serve", "base_url": args.base_url, "model": args.model,
                "input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True,
                "shared_prefix_len": args.shared_prefix_len, "json_schema": args.json_schema,
                "prompt_form": "text" if args.tokenizer else "token ids",
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "levels": summaries}
    print(table(summaries))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(document, indent=2) + "\n")
    return 1 if any(level["failed"] for level in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
