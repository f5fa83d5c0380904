#!/usr/bin/env python3
"""Write the random-weight benchmark checkpoint SHAPE (llama-8b, qwen3-8b; SHAPE:LAYERS cuts its layers)
into FOLDER with shared/bench's writer, copied to carry/bench: the one checkpoint Flare and the peer serve.

    python3 benchmarks/write_bench_checkpoint.py FOLDER SHAPE
"""

import sys

sys.path.insert(0, "carry/bench")
import make_random_checkpoint  # noqa: E402  (carry/bench is a copy of shared/bench, see the runners)


def main(folder: str, shape: str) -> None:
    name, _, layers = shape.partition(":")
    if layers:
        make_random_checkpoint.SHAPES[name]["num_hidden_layers"] = int(layers)
    make_random_checkpoint.main(folder, name)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2])
