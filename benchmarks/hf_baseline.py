#!/usr/bin/env python
"""The in-run peer: Hugging Face `transformers` generate on the same checkpoint and GPU, batch 1.

Static KV cache, with which generate compiles its decoding forward (the fastest plain
`transformers` setting), greedy, exactly
--output-len new tokens. Reports end-to-end output tokens/s and the decode-only rate
(time of N tokens minus time of 1 token, over N - 1), prints a line and writes JSON.

    python benchmarks/hf_baseline.py /path/to/llama-8b --input-len 128 --output-len 512 \
        --output results/hf.json
    python benchmarks/hf_baseline.py --random llama-8b     # same shape, random weights, no checkpoint
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("checkpoint", nargs="?", help="Hugging Face checkpoint directory")
    parser.add_argument("--random", metavar="SHAPE", help="instead of a checkpoint: random weights in GPU "
                        "memory at a benchmark shape (llama-8b, qwen3-8b)")
    parser.add_argument("--input-len", type=int, default=128)
    parser.add_argument("--output-len", type=int, default=512)
    parser.add_argument("--repetitions", type=int, default=3)
    parser.add_argument("--no-compile", action="store_true", help="eager forward (for comparison)")
    parser.add_argument("--output", type=Path, default=None)
    args = parser.parse_args(argv)

    import torch
    import transformers
    from transformers import AutoModelForCausalLM

    if not torch.cuda.is_available():
        print("hf_baseline needs a CUDA GPU", file=sys.stderr)
        return 2
    if args.random:
        sys.path.insert(0, str(Path(__file__).resolve().parent))
        from shapes import SHAPES, randomize_
        from transformers import AutoConfig

        shape = dict(SHAPES[args.random])
        config = AutoConfig.for_model(shape.pop("model_type"), **shape)
        with torch.device("cuda"):
            model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
        randomize_(model)
    elif args.checkpoint:
        model = AutoModelForCausalLM.from_pretrained(args.checkpoint, dtype=torch.bfloat16, device_map="cuda")
    else:
        parser.error("give a checkpoint directory or --random SHAPE")
    model.eval()
    model.generation_config.cache_implementation = "static"
    model.generation_config.pad_token_id = model.generation_config.eos_token_id
    # With a static cache on a GPU, generate compiles the decoding forward itself (CUDA graphs included);
    # compiling model.forward on top would compile twice.
    model.generation_config.disable_compile = args.no_compile

    generator = torch.Generator().manual_seed(0)
    vocab = model.config.vocab_size
    input_ids = torch.randint(100, vocab, (1, args.input_len), generator=generator).cuda()

    def generate_seconds(new_tokens: int) -> float:
        torch.cuda.synchronize()
        started = time.perf_counter()
        with torch.inference_mode():
            out = model.generate(input_ids, attention_mask=torch.ones_like(input_ids), do_sample=False,
                                 max_new_tokens=new_tokens, min_new_tokens=new_tokens)
        torch.cuda.synchronize()
        assert out.shape[1] == args.input_len + new_tokens
        return time.perf_counter() - started

    warm_started = time.perf_counter()
    for new_tokens in (args.output_len, 1, args.output_len):        # compile and capture outside timing
        generate_seconds(new_tokens)
    warmup_s = time.perf_counter() - warm_started
    full = [generate_seconds(args.output_len) for _ in range(args.repetitions)]
    first = [generate_seconds(1) for _ in range(args.repetitions)]
    full_s, first_s = statistics.median(full), statistics.median(first)
    decode_ms = (full_s - first_s) / (args.output_len - 1) * 1000
    result = {
        "benchmark": "transformers generate", "checkpoint": args.checkpoint or f"random {args.random}",
        "transformers": transformers.__version__, "torch": torch.__version__,
        "device": torch.cuda.get_device_name(), "batch": 1, "cache": "static",
        "compiled": not args.no_compile, "input_len": args.input_len, "output_len": args.output_len,
        "warmup_s": warmup_s, "generate_s": full, "first_token_s": first,
        "output_tokens_per_s": args.output_len / full_s, "decode_ms_per_token": decode_ms,
        "decode_tokens_per_s": 1000 / decode_ms,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    print(f"transformers {transformers.__version__} {'compiled' if not args.no_compile else 'eager'} batch 1: "
          f"{result['output_tokens_per_s']:.1f} tok/s end to end, {decode_ms:.2f} ms/token decode "
          f"({result['decode_tokens_per_s']:.1f} tok/s)")
    if args.output:
        args.output.parent.mkdir(parents=True, exist_ok=True)
        args.output.write_text(json.dumps(result, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
