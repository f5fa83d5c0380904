"""The host cost of grammar-constrained decoding per step: filling the next-token bitmask (xgrammar) for
a batch of constrained requests, at a tokenizer's full vocabulary.

It walks each request's matcher through a valid reply token by token (the tokens the model would have
sampled), timing every step's mask fill, then the accept of the token; also the one-time costs
(vocabulary info, grammar compile), and how long building the vocabulary info keeps other Python threads
from running (the engine core builds it on a thread beside its loop: a probe thread that sleeps 1 ms in
a loop records the time it was kept waiting). Prints a table, writes JSON.

    python benchmarks/grammar_mask_bench.py TOKENIZER_DIR [--batches 1,16] [--output mask.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import threading
import time

SCHEMA = {
    "type": "object",
    "properties": {
        "name": {"type": "string"}, "age": {"type": "integer", "minimum": 0},
        "email": {"type": "string", "format": "email"},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 8},
        "address": {"type": "object", "properties": {"city": {"type": "string"}, "zip": {"type": "string",
                                                                                          "pattern": "^[0-9]{5}$"}},
                    "required": ["city", "zip"]},
        "status": {"enum": ["active", "inactive", "pending"]},
    },
    "required": ["name", "age", "email", "tags", "address", "status"],
}
REPLY = {"name": "Ada Lovelace, Countess of Lovelace", "age": 36, "email": "ada@analytical.example.org",
         "tags": ["mathematics", "poetry of science", "engines", "notes on the analytical engine"],
         "address": {"city": "London", "zip": "12345"}, "status": "active"}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tokenizer_dir")
    parser.add_argument("--batches", default="1,16")
    parser.add_argument("--output", default=None)
    args = parser.parse_args()

    import torch
    import xgrammar
    from transformers import AutoTokenizer

    from flare.engine.structured_output import json_whitespace

    torch.set_num_threads(1)
    tokenizer = AutoTokenizer.from_pretrained(args.tokenizer_dir)
    probe = GilProbe()
    started = time.perf_counter()
    with probe:
        info = xgrammar.TokenizerInfo.from_huggingface(tokenizer, vocab_size=len(tokenizer))
    info_s = time.perf_counter() - started
    compiler = xgrammar.GrammarCompiler(info)
    started = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True, **json_whitespace())
    compile_s = time.perf_counter() - started
    started = time.perf_counter()
    compiler.compile_json_schema(json.dumps(SCHEMA), strict_mode=True, **json_whitespace())
    cached_s = time.perf_counter() - started
    tokens = tokenizer.encode(json.dumps(REPLY), add_special_tokens=False)
    results = {"vocab_size": len(tokenizer), "tokenizer": args.tokenizer_dir, "reply_tokens": len(tokens),
               "tokenizer_info_s": info_s, "tokenizer_info_other_threads_held_s": probe.held_s,
               "tokenizer_info_other_threads_longest_hold_s": probe.longest_s,
               "compile_s": compile_s, "compile_cached_s": cached_s, "batches": []}
    print(f"vocabulary {len(tokenizer):,} tokens; TokenizerInfo {info_s * 1e3:.0f} ms (other threads kept "
          f"waiting {probe.held_s * 1e3:.0f} ms, at most {probe.longest_s * 1e3:.0f} ms at once); schema compile "
          f"{compile_s * 1e3:.1f} ms (cached {cached_s * 1e6:.0f} us); reply {len(tokens)} tokens")
    print(f"{'batch':>6} {'fill median':>12} {'fill p90':>10} {'fill max':>10} {'accept/req':>11} {'per req':>9}")
    for batch in (int(b) for b in args.batches.split(",")):
        row = _walk(xgrammar, compiled, tokens, batch, len(tokenizer))
        results["batches"].append(row)
        print(f"{batch:>6} {row['fill_median_us']:>10.0f}us {row['fill_p90_us']:>8.0f}us "
              f"{row['fill_max_us']:>8.0f}us {row['accept_median_us']:>9.1f}us "
              f"{row['fill_median_us'] / batch:>7.0f}us")
    if args.output:
        with open(args.output, "w") as out:
            json.dump(results, out, indent=1)


class GilProbe:
    """While active, a thread sleeps 1 ms in a loop; the time beyond 5 ms a wake-up took is time the code
    under test kept other Python threads (the engine core's loop) from running."""

    def __init__(self) -> None:
        self.held_s = self.longest_s = 0.0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> GilProbe:
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        last = time.perf_counter()
        while not self._stop.is_set():
            time.sleep(0.001)
            now = time.perf_counter()
            if now - last > 0.005:
                self.held_s += now - last
                self.longest_s = max(self.longest_s, now - last)
            last = now


def _walk(xgrammar, compiled, tokens: list[int], batch: int, vocab_size: int) -> dict:
    matchers = [xgrammar.GrammarMatcher(compiled) for _ in range(batch)]
    batcher = xgrammar.BatchGrammarMatcher()
    masks = xgrammar.allocate_token_bitmask(batch, vocab_size)
    fills, accepts = [], []
    for token in tokens:
        started = time.perf_counter()
        if batch == 1:
            matchers[0].fill_next_token_bitmask(masks, 0)
        else:
            batcher.batch_fill_next_token_bitmask(matchers, masks)
        fills.append(time.perf_counter() - started)
        if not (masks[0, token // 32] >> (token % 32)) & 1:
            raise RuntimeError(f"token {token} of a valid reply was masked out")
        started = time.perf_counter()
        for matcher in matchers:
            if not matcher.accept_token(token):
                raise RuntimeError(f"token {token} of a valid reply was refused")
        accepts.append((time.perf_counter() - started) / batch)
    fills.sort()
    return {"batch": batch, "steps": len(fills), "fill_median_us": statistics.median(fills) * 1e6,
            "fill_p90_us": fills[int(len(fills) * 0.9)] * 1e6, "fill_max_us": fills[-1] * 1e6,
            "accept_median_us": statistics.median(accepts) * 1e6}


if __name__ == "__main__":
    main()
