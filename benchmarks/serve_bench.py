#!/usr/bin/env python
"""Serving benchmark: drive a running server's OpenAI Completions API as users do, and measure.

Two kinds of load, each a list of levels:
* closed loop (`--concurrency 1,16,64`): per level, `--prompts-per-concurrency` × concurrency requests
  sent at once, at most `concurrency` in flight;
* open loop (`--request-rate 2,4,8`): per level, requests arrive as a Poisson process at that rate
  (`--burstiness` other than 1: gamma-distributed gaps, as `vllm bench serve` draws them; the arrival
  times are rescaled so the last one lands at N / rate), `--num-prompts` of them (default:
  `--arrival-seconds`' worth, 60), with at most `--max-concurrency` in flight (default: no limit).
Every request streams a fixed input and output length (`ignore_eos`, so each produces exactly
--output-len tokens). Reports time to first token (TTFT), time per output token after the first (TPOT),
inter-token latency between streamed chunks (ITL), each at p50/p99, output tokens/s and requests/s.
`--goodput ttft:MS tpot:MS` (also e2el:MS) adds SLO goodput as `vllm bench serve` defines it: requests
per second of the level's duration that finished and met every objective given (TTFT, TPOT and
end-to-end latency each at most its bound; a one-token answer's TPOT counts as 0). Prints a table and
writes JSON.

Sampling: without sampling flags the requests carry no sampling fields, so each server applies its own
defaults (a package's recipe defaults for Flare; as `vllm bench serve` does since it stopped sending
temperature 0); `--temperature 0.6 --top-p 0.9` (and --top-k, --min-p) send the same explicit values to
any server. The JSON records which.

    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --model llama-8b \
        --input-len 1000 --output-len 256 --concurrency 1,16,64,256 --output results/serve.json
    python benchmarks/serve_bench.py --model llama-8b --request-rate 4,8,12 --goodput ttft:1000 tpot:50 \
        --temperature 0.6 --top-p 0.9 --output results/poisson.json

Prompts are random token ids sent as a token array (the Completions API accepts one), so their length
is exact; with --tokenizer DIR they are sent as text decoded from those ids instead. --prompts-file FILE
(a JSON list of strings) sends those texts instead, in turn (e.g. prompts whose answers repeat them, for
history drafts); --input-len then does not apply.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import math
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


def file_prompts(path: Path, count: int, offset: int) -> list[str]:
    """`count` of the texts in the JSON list at `path`, in turn from `offset` (levels start elsewhere)."""
    texts = json.loads(Path(path).read_text())
    if not texts or not all(isinstance(text, str) and text for text in texts):
        raise SystemExit(f"--prompts-file {path}: a JSON list of non-empty prompt texts")
    return [texts[(offset + index) % len(texts)] for index in range(count)]


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


@dataclass(frozen=True)
class Level:
    """One level of load: `count` requests arriving at `request_rate` per second (inf: all at once), at
    most `concurrency` in flight (None: no limit)."""

    count: int
    concurrency: int | None
    request_rate: float = math.inf
    burstiness: float = 1.0


def arrival_offsets(level: Level, seed: int) -> list[float]:
    """Seconds after the start at which each request arrives: all at 0 for an infinite rate, else gaps
    drawn from a gamma distribution of shape `burstiness` and mean 1 / rate (exponential, a Poisson
    process, at burstiness 1), rescaled so that the last arrival lands at count / rate."""
    if math.isinf(level.request_rate):
        return [0.0] * level.count
    rng = random.Random(seed)
    scale = 1.0 / (level.request_rate * level.burstiness)
    offsets, at = [], 0.0
    for _ in range(level.count):
        at += rng.gammavariate(level.burstiness, scale)
        offsets.append(at)
    stretch = (level.count / level.request_rate) / offsets[-1] if offsets and offsets[-1] > 0 else 1.0
    return [offset * stretch for offset in offsets]


async def run_level(base_url: str, model: str, prompts: list, output_len: int, level: Level,
                    api_key: str | None, sampling: dict | None = None, seed: int = 0,
                    json_schema: bool = False
                    ) -> tuple[list[RequestResult], float]:
    import httpx

    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    connections = level.concurrency or len(prompts)
    limits = httpx.Limits(max_connections=connections, max_keepalive_connections=connections)
    url = base_url.rstrip("/") + "/v1/completions"
    gate = asyncio.Semaphore(level.concurrency or len(prompts))
    offsets = arrival_offsets(level, seed)

    async with httpx.AsyncClient(timeout=None, limits=limits, headers=headers) as client:
        started = time.perf_counter()

        async def arriving(prompt, offset: float):
            payload = {"model": model, "prompt": prompt, "max_tokens": output_len, **(sampling or {}),
                       "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            await asyncio.sleep(max(0.0, started + offset - time.perf_counter()))
            if json_schema:
                payload["response_format"] = {"type": "json_schema",
                                              "json_schema": {"name": "bench", "schema": BENCH_SCHEMA}}
            async with gate:
                return await one_request(client, url, payload)

        results = await asyncio.gather(*(arriving(prompt, offset) for prompt, offset in zip(prompts, offsets)))
        return list(results), time.perf_counter() - started


GOODPUT_METRICS = ("ttft", "tpot", "e2el")


def parse_goodput(pairs: list[str] | None) -> dict[str, float]:
    """`--goodput ttft:1000 tpot:50` as {"ttft": 1000.0, "tpot": 50.0} (milliseconds)."""
    objectives = {}
    for pair in pairs or ():
        name, _, value = pair.partition(":")
        try:
            bound = float(value)
        except ValueError:
            bound = math.nan
        if name not in GOODPUT_METRICS or not math.isfinite(bound) or bound < 0:
            raise argparse.ArgumentTypeError(
                f"--goodput {pair}: write METRIC:MILLISECONDS pairs, METRIC one of {', '.join(GOODPUT_METRICS)} "
                "and a non-negative number, e.g. --goodput ttft:1000 tpot:50")
        objectives[name] = bound
    return objectives


def is_good(result: RequestResult, objectives: dict[str, float]) -> bool:
    """The request finished and met every objective (ms); a one-token answer's TPOT counts as 0."""
    if not result.ok:
        return False
    measured = {"ttft": result.ttft, "tpot": result.tpot or 0.0, "e2el": result.latency}
    return all(measured[name] * 1000.0 <= bound for name, bound in objectives.items())


def summarize(level: Level, results: list[RequestResult], duration: float, output_len: int,
              objectives: dict[str, float] | None = None) -> dict:
    good = [result for result in results if result.ok]
    ms = 1000.0
    ttfts = [result.ttft * ms for result in good]
    tpots = [result.tpot * ms for result in good if result.tpot is not None]
    gaps = [gap * ms for result in good for gap in result.chunk_gaps]
    output_tokens = sum(result.output_tokens for result in good)
    summary = {
        "concurrency": level.concurrency,
        "request_rate": level.request_rate if math.isfinite(level.request_rate) else "inf",
        "requests": len(results), "failed": len(results) - len(good),
        "duration_s": duration, "output_tokens": output_tokens,
        "output_tokens_per_s": output_tokens / duration if duration else 0.0,
        "requests_per_s": len(good) / duration if duration else 0.0,
        "short_outputs": sum(1 for result in good if result.output_tokens != output_len),
    }
    if math.isfinite(level.request_rate):
        summary["burstiness"] = level.burstiness
    for name, values in (("ttft_ms", ttfts), ("tpot_ms", tpots), ("itl_ms", gaps)):
        summary[name] = {"mean": statistics.fmean(values) if values else float("nan"),
                         "p50": percentile(values, 50), "p99": percentile(values, 99)}
    if objectives:
        met = sum(1 for result in results if is_good(result, objectives))
        summary["goodput"] = {"slo_ms": dict(objectives), "good_requests": met,
                              "requests_per_s": met / duration if duration else 0.0}
    errors = sorted({result.error for result in results if not result.ok})
    if errors:
        summary["errors"] = errors[:5]
    return summary


def table(levels: list[dict]) -> str:
    header = (f"{'conc':>5} {'rate':>6} {'reqs':>5} {'fail':>4} {'out tok/s':>10} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'TPOT p50':>9} {'TPOT p99':>9} {'ITL p50':>8} {'ITL p99':>8} {'goodput':>8}   (ms; req/s)")
    rows = [header]
    for level in levels:
        concurrency = "-" if level["concurrency"] is None else str(level["concurrency"])
        rate = level["request_rate"] if isinstance(level["request_rate"], str) else f"{level['request_rate']:g}"
        goodput = f"{level['goodput']['requests_per_s']:.2f}" if "goodput" in level else "-"
        rows.append(f"{concurrency:>5} {rate:>6} {level['requests']:>5} {level['failed']:>4} "
                    f"{level['output_tokens_per_s']:>10.1f} {level['ttft_ms']['p50']:>9.1f} "
                    f"{level['ttft_ms']['p99']:>9.1f} {level['tpot_ms']['p50']:>9.2f} {level['tpot_ms']['p99']:>9.2f} "
                    f"{level['itl_ms']['p50']:>8.2f} {level['itl_ms']['p99']:>8.2f} {goodput:>8}")
    return "\n".join(rows)


def levels_of(args) -> list[Level]:
    """The closed-loop concurrency levels, or the open-loop request rates."""
    if args.request_rate is None:
        return [Level(max(args.min_prompts, args.prompts_per_concurrency * int(part)), int(part))
                for part in args.concurrency.split(",")]
    levels = []
    for part in args.request_rate.split(","):
        rate = float(part)
        if not rate > 0:
            raise SystemExit(f"--request-rate {part}: a rate is a positive number of requests per second (or inf)")
        default_count = (max(args.min_prompts, math.ceil(rate * args.arrival_seconds)) if math.isfinite(rate)
                         else args.min_prompts)
        count = args.num_prompts or default_count
        levels.append(Level(count, args.max_concurrency, rate, args.burstiness))
    return levels


def sampling_fields(args) -> dict:
    """The sampling fields every request carries: only those given (none: each server's defaults)."""
    given = {"temperature": args.temperature, "top_p": args.top_p, "top_k": args.top_k, "min_p": args.min_p}
    return {name: value for name, value in given.items() if value is not None}


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base-url", default="http://127.0.0.1:8000")
    parser.add_argument("--model", required=True, help="served model name")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--input-len", type=int, default=1000)
    parser.add_argument("--output-len", type=int, default=256)
    parser.add_argument("--concurrency", default="1,16,64,256", help="closed loop: comma-separated levels")
    parser.add_argument("--prompts-per-concurrency", type=int, default=4,
                        help="closed loop: requests per level = this × concurrency (at least --min-prompts)")
    parser.add_argument("--request-rate", default=None,
                        help="open loop instead: comma-separated arrival rates (requests/s; inf: all at once)")
    parser.add_argument("--burstiness", type=float, default=1.0,
                        help="open loop: gamma shape of the arrival gaps; 1 is a Poisson process")
    parser.add_argument("--num-prompts", type=int, default=None,
                        help="open loop: requests per rate (default: --arrival-seconds of arrivals)")
    parser.add_argument("--arrival-seconds", type=float, default=60.0,
                        help="open loop: seconds of arrivals per rate when --num-prompts is not given")
    parser.add_argument("--max-concurrency", type=int, default=None,
                        help="open loop: most requests in flight (default: no limit)")
    parser.add_argument("--goodput", nargs="+", metavar="METRIC:MS", default=None,
                        help="SLOs for goodput: ttft, tpot and/or e2el, in milliseconds")
    parser.add_argument("--min-prompts", type=int, default=8)
    sampling = parser.add_argument_group("sampling (default: none sent, each server's own defaults)")
    sampling.add_argument("--temperature", type=float, default=None)
    sampling.add_argument("--top-p", type=float, default=None)
    sampling.add_argument("--top-k", type=int, default=None)
    sampling.add_argument("--min-p", type=float, default=None)
    parser.add_argument("--vocab-size", type=int, default=32000, help="random prompt ids are drawn below this")
    parser.add_argument("--tokenizer", default=None, help="send text prompts decoded with DIR/tokenizer.json")
    parser.add_argument("--prompts-file", type=Path, default=None,
                        help="a JSON list of prompt texts, sent in turn instead of random prompts")
    parser.add_argument("--shared-prefix-len", type=int, default=0,
                        help="leading prompt tokens common to every request (exercises the prefix cache)")
    parser.add_argument("--warmup-requests", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json-schema", action="store_true",
                        help="constrain every reply to a JSON schema (grammar masks on every step)")
    parser.add_argument("--output", type=Path, default=None, help="JSON results")
    args = parser.parse_args(argv)
    try:
        args.objectives = parse_goodput(args.goodput)
    except argparse.ArgumentTypeError as error:
        parser.error(str(error))
    if not args.burstiness > 0:
        parser.error(f"--burstiness {args.burstiness}: a positive gamma shape (1 is a Poisson process)")
    return args


def main(argv=None) -> int:
    args = parse_args(argv)
    objectives, levels, fields = args.objectives, levels_of(args), sampling_fields(args)

    warm = make_prompts(args.warmup_requests, args.input_len, args.vocab_size, args.seed + 999, args.tokenizer)
    if warm:
        asyncio.run(run_level(args.base_url, args.model, warm, min(16, args.output_len),
                              Level(len(warm), len(warm)), args.api_key, fields,
                              json_schema=args.json_schema))
    summaries = []
    for index, level in enumerate(levels):
        # A new prompt seed per level, so that one level does not hit the prefix cache of another.
        key = level.concurrency if args.request_rate is None else 100_000 + index
        prompts = (file_prompts(args.prompts_file, level.count, key) if args.prompts_file else
                   make_prompts(level.count, args.input_len, args.vocab_size, args.seed + key,
                                args.tokenizer, args.shared_prefix_len, prefix_seed=args.seed))
        results, duration = asyncio.run(run_level(args.base_url, args.model, prompts, args.output_len, level,
                                                  args.api_key, fields, seed=args.seed + index,
                                                  json_schema=args.json_schema))
        summaries.append(summarize(level, results, duration, args.output_len, objectives))
        print(table(summaries[-1:]).splitlines()[-1], file=sys.stderr, flush=True)
    document = {"benchmark": "serve", "base_url": args.base_url, "model": args.model,
                "input_len": args.input_len, "output_len": args.output_len, "ignore_eos": True,
                "shared_prefix_len": args.shared_prefix_len, "json_schema": args.json_schema,
                "arrivals": "all at once, concurrency-limited" if args.request_rate is None else
                            ("Poisson" if args.burstiness == 1 else f"gamma, burstiness {args.burstiness:g}"),
                "sampling": fields or "server defaults", "goodput_slo_ms": objectives or None,
                "prompt_form": (f"texts of {args.prompts_file}" if args.prompts_file else
                                "text" if args.tokenizer else "token ids"),
                "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()), "levels": summaries}
    print(table(summaries))
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(document, indent=2) + "\n")
    return 1 if any(level["failed"] for level in summaries) else 0


if __name__ == "__main__":
    sys.exit(main())
