#!/usr/bin/env python
"""Cost of one step's message from the engine core to the frontend: encode there, decode here.

A step of B decoding requests sends one `Outputs` message with B `CoreOutput`s (one token each, with or
without logprobs) and the stats. This times the codec (`flare.engine.messages`, msgpack via msgspec)
against pickling the same objects, as the core process did before, on this machine's CPU.

    python benchmarks/message_codec.py --batch 1 64 256 --output codec.json
"""

from __future__ import annotations

import argparse
import json
import pickle
import sys
import time
from pathlib import Path


def step_message(batch: int, logprobs: int):
    from flare.engine.stats import EngineStats
    from flare.engine.messages import Outputs
    from flare.engine.outputs import CoreOutput, TokenLogprob

    top = tuple((token, -0.5 * token) for token in range(logprobs))
    outputs = [CoreOutput(f"cmpl-{index:032x}-0", (1000 + index,),
                          (TokenLogprob(1000 + index, -0.1, 1, top),) if logprobs else (), None, None, 600, 0)
               for index in range(batch)]
    return Outputs(outputs, EngineStats(batch, 0, batch * 40, 60000, 0))


def microseconds(function, repeat: int) -> float:
    started = time.perf_counter()
    for _ in range(repeat):
        function()
    return (time.perf_counter() - started) / repeat * 1e6


def measure(batch: int, logprobs: int, repeat: int) -> dict:
    from flare.engine import messages

    message = step_message(batch, logprobs)
    encoded = messages.encode(message)
    pickled = pickle.dumps((message.outputs, message.stats))
    return {"batch": batch, "logprobs": logprobs, "bytes": len(encoded), "pickle_bytes": len(pickled),
            "encode_us": microseconds(lambda: messages.encode(message), repeat),
            "decode_us": microseconds(lambda: messages.decode_event(encoded), repeat),
            "pickle_dumps_us": microseconds(lambda: pickle.dumps((message.outputs, message.stats)), repeat),
            "pickle_loads_us": microseconds(lambda: pickle.loads(pickled), repeat)}


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--batch", type=int, nargs="+", default=[1, 64, 256])
    parser.add_argument("--logprobs", type=int, nargs="+", default=[0, 5], help="top logprobs per token (0: none)")
    parser.add_argument("--repeat", type=int, default=2000)
    parser.add_argument("--output", type=Path, default=None, help="write the results as JSON here")
    args = parser.parse_args(argv)
    rows = [measure(batch, logprobs, args.repeat) for batch in args.batch for logprobs in args.logprobs]
    print(f"{'batch':>6} {'logprobs':>8} {'bytes':>8} {'encode us':>10} {'decode us':>10} "
          f"{'pickle bytes':>12} {'dumps us':>9} {'loads us':>9}")
    for row in rows:
        print(f"{row['batch']:>6} {row['logprobs']:>8} {row['bytes']:>8} {row['encode_us']:>10.1f} "
              f"{row['decode_us']:>10.1f} {row['pickle_bytes']:>12} {row['pickle_dumps_us']:>9.1f} "
              f"{row['pickle_loads_us']:>9.1f}")
    if args.output is not None:
        args.output.write_text(json.dumps({"python": sys.version.split()[0], "rows": rows}, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
