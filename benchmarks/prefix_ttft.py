#!/usr/bin/env python
"""Time to first token of a prompt whose long prefix is already in the prefix cache, against a cold one.

Each repetition sends two one-token requests through the in-process engine: a fresh random prefix
(`--prefix-tokens`, 4,096 by default) plus a short suffix, which misses the cache and computes every
token; then the same prefix with another suffix, which finds the prefix's full pages cached and
computes only the suffix. Time to first token is the wall time from adding the request to its first
token coming back (the token ids reach the host, so a CUDA device is synchronised). One warm-up pair
runs first and is not counted.

    python benchmarks/prefix_ttft.py CHECKPOINT_DIR --device cuda --dtype bfloat16 --output ttft.json
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", type=Path, help="a Hugging Face checkpoint directory")
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--dtype", default=None, help="float32 (default on cpu) or bfloat16 (default on cuda)")
    parser.add_argument("--attention", choices=("torch", "triton"), default=None,
                        help="attention backend (default: triton on cuda, torch on cpu)")
    parser.add_argument("--prefix-tokens", type=int, default=4096)
    parser.add_argument("--suffix-tokens", type=int, default=32)
    parser.add_argument("--repetitions", type=int, default=5)
    parser.add_argument("--page-size", type=int, default=16)
    parser.add_argument("--prefill-chunk", type=int, default=4096)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if min(args.prefix_tokens, args.suffix_tokens, args.repetitions) < 1:
        parser.error("--prefix-tokens, --suffix-tokens and --repetitions must be at least 1")

    engine, vocab_size = build_engine(args)
    rng = random.Random(args.seed)

    def tokens(count: int) -> list[int]:
        return [rng.randrange(3, vocab_size) for _ in range(count)]     # clear of BOS/EOS/UNK

    samples: dict[str, list[dict]] = {"uncached": [], "cached": []}
    for repetition in range(args.repetitions + 1):
        prefix = tokens(args.prefix_tokens)
        cold = time_to_first_token(engine, prefix + tokens(args.suffix_tokens))
        warm = time_to_first_token(engine, prefix + tokens(args.suffix_tokens))
        if repetition > 0:                                            # the first pair warms up
            samples["uncached"].append(cold)
            samples["cached"].append(warm)
        print(f"repetition {repetition}{' (warm-up)' if repetition == 0 else ''}: "
              f"uncached {cold['ttft_ms']:.1f} ms, cached {warm['ttft_ms']:.1f} ms "
              f"({warm['cached_tokens']} tokens cached)", file=sys.stderr, flush=True)

    result = summarize(args, samples)
    print(table(result))
    if args.output is not None:
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


def build_engine(args):
    import torch

    from flare.engine.attention import TorchReferenceBackend
    from flare.engine.config import EngineConfig
    from flare.engine_client.llm_engine import LLMEngine
    from flare.frontend.tokenizer import load_tokenizer
    from flare.models import load_checkpoint

    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    args.attention = args.attention or ("triton" if cuda else "torch")
    if args.attention == "triton":
        from flare.engine.attention_triton import TritonBackend
        backend = TritonBackend()
    else:
        backend = TorchReferenceBackend()
    model_config, model = load_checkpoint(args.checkpoint, getattr(torch, args.dtype), args.device, backend)
    max_model_len = args.prefix_tokens + args.suffix_tokens + args.page_size
    if max_model_len > model_config.max_position_embeddings:
        sys.exit(f"error: {args.prefix_tokens} + {args.suffix_tokens} tokens exceed the checkpoint's "
                 f"{model_config.max_position_embeddings}-token context; lower --prefix-tokens")
    pages_per_request = -(-max_model_len // args.page_size)
    config = EngineConfig(max_concurrency=1, page_size=args.page_size, num_pages=4 * pages_per_request,
                          prefill_chunk=args.prefill_chunk, max_num_batched_tokens=args.prefill_chunk,
                          max_model_len=max_model_len)
    tokenizer = load_tokenizer(args.checkpoint)
    engine = LLMEngine.from_model(model, model_config, tokenizer, config, args.device, args.dtype)
    return engine, model_config.vocab_size


def time_to_first_token(engine, prompt_ids: list[int]) -> dict:
    from flare.engine.sampling_params import SamplingParams

    before = engine.core.stats().num_computed_tokens
    start = time.perf_counter()
    [output] = engine.generate([prompt_ids], SamplingParams(temperature=0, max_tokens=1))
    elapsed = time.perf_counter() - start
    return {"ttft_ms": elapsed * 1000, "cached_tokens": output.num_cached_tokens,
            "computed_tokens": engine.core.stats().num_computed_tokens - before}


def summarize(args, samples: dict[str, list[dict]]) -> dict:
    from flare.bench import device_identity

    cases = {}
    for name, runs in samples.items():
        ttfts = [run["ttft_ms"] for run in runs]
        cases[name] = {"median_ms": statistics.median(ttfts), "min_ms": min(ttfts), "max_ms": max(ttfts),
                       "cached_tokens": runs[-1]["cached_tokens"], "computed_tokens": runs[-1]["computed_tokens"],
                       "samples_ms": ttfts}
    return {
        "benchmark": "prefix_ttft",
        "date": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "device": device_identity(),
        "configuration": {"checkpoint": str(args.checkpoint), "device": args.device, "dtype": args.dtype,
                          "attention": args.attention, "prefix_tokens": args.prefix_tokens,
                          "suffix_tokens": args.suffix_tokens, "page_size": args.page_size,
                          "prefill_chunk": args.prefill_chunk, "repetitions": args.repetitions},
        "cases": cases,
        "speedup": cases["uncached"]["median_ms"] / cases["cached"]["median_ms"],
    }


def table(result: dict) -> str:
    config = result["configuration"]
    lines = [f"time to first token, {config['prefix_tokens']:,}-token prefix + {config['suffix_tokens']}-token "
             f"suffix, {config['device']} {config['dtype']}",
             f"{'case':<10} {'cached':>8} {'computed':>9} {'median ms':>10} {'min ms':>9} {'max ms':>9}"]
    for name, case in result["cases"].items():
        lines.append(f"{name:<10} {case['cached_tokens']:>8,} {case['computed_tokens']:>9,} "
                     f"{case['median_ms']:>10.1f} {case['min_ms']:>9.1f} {case['max_ms']:>9.1f}")
    lines.append(f"speedup (median): {result['speedup']:.1f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    sys.exit(main())
