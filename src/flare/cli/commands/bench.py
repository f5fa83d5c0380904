"""`ignition bench [MODEL]`: complete speculative rounds (or, at --verify-width 1, decode steps) of a
prepared model, timed with CUDA events.

Opens no listener and exports no package. Each case (batch × context) starts from real prefilled
contexts; state is restored outside the timed interval before every round. A round verifies W target
tokens per request (the pending one and W - 1 drafts: B x W rows), samples, accepts and commits; its
proposal is the checkpoint's draft model when it supplies one in draft/, else point-mass drafts (as
history drafts are) (flare.bench_speculation).
"""

from __future__ import annotations

import argparse

from flare.errors import UsageError

DEFAULT_MODEL_NOTE = "the explicit MODEL, else defaults.model"
DEFAULT_VERIFY_WIDTH = 8            # seven drafts and the pending token (spec: the bench's verification block)
MAX_VERIFY_WIDTH = 16


def configure(parser: argparse.ArgumentParser) -> None:
    from flare.bench import DEFAULT_BATCHES, DEFAULT_CONTEXTS, DEFAULT_SEEDS

    def listed(values):
        return ",".join(str(value) for value in values)

    parser.add_argument("model", nargs="?", metavar="MODEL",
                        help=f"alias, org/name[@revision] or checkpoint directory ({DEFAULT_MODEL_NOTE})")
    parser.add_argument("--gpus", metavar="LIST", help="one GPU index, relative to CUDA_VISIBLE_DEVICES (default 0)")
    parser.add_argument("--max-concurrency", metavar="N", type=int,
                        help="prepared request capacity (default: the largest selected batch)")
    parser.add_argument("--batches", metavar="LIST", default=listed(DEFAULT_BATCHES),
                        help=f"distinct comma-separated request batches (default {listed(DEFAULT_BATCHES)})")
    parser.add_argument("--contexts", metavar="LIST", default=listed(DEFAULT_CONTEXTS),
                        help="distinct consumed context lengths before each measured step, positive multiples "
                             f"of 128 (default {listed(DEFAULT_CONTEXTS)})")
    parser.add_argument("--warmup", metavar="N", default="5", help="untimed restored steps per case and seed (default 5)")
    parser.add_argument("--repetitions", metavar="N", default="20", help="timed restored steps per case and seed (default 20)")
    parser.add_argument("--seeds", metavar="LIST", default=listed(DEFAULT_SEEDS),
                        help=f"distinct input and sampling seeds (default {listed(DEFAULT_SEEDS)})")
    parser.add_argument("--verify-width", metavar="N", default=str(DEFAULT_VERIFY_WIDTH),
                        help="target tokens per request, including the pending token: N - 1 draft tokens; 1 "
                             f"measures plain decode steps (default {DEFAULT_VERIFY_WIDTH})")
    parser.add_argument("--output", metavar="PATH",
                        help="JSON with configuration, device identity, per-case statistics and raw samples "
                             "(default: none; the table still prints)")


def bench_config(args):
    from flare.bench import CONTEXT_MULTIPLE, BenchConfig, parse_int_list, positive_int

    return BenchConfig(
        batches=parse_int_list(args.batches, "--batches"),
        contexts=parse_int_list(args.contexts, "--contexts", multiple_of=CONTEXT_MULTIPLE),
        warmup=positive_int(args.warmup, "--warmup"),
        repetitions=positive_int(args.repetitions, "--repetitions"),
        seeds=parse_int_list(args.seeds, "--seeds", allow_zero=True),
    )


def run(args) -> int:
    from pathlib import Path

    from flare.bench import cuda_event_timer, device_identity, run_bench

    from flare.config import MAX_CONCURRENCY, resolve

    config = bench_config(args)
    width = verify_width(args.verify_width)
    chosen = resolve(MAX_CONCURRENCY, args.max_concurrency, args.configuration, max(config.batches),
                     fallback_origin="the largest batch", names=(args.model,) if args.model else ())
    concurrency = chosen.value
    if concurrency < max(config.batches):
        raise UsageError(f"{chosen.origin} is below the largest batch {max(config.batches)}")
    target, configuration = build_target(args, concurrency, max_context=max(config.contexts), width=width)
    output = Path(args.output) if args.output else None
    result = run_bench(target, config, cuda_event_timer(), device=device_identity(),
                       configuration={**configuration, "max_concurrency": concurrency,
                                      "requested_concurrency": concurrency if chosen.source in ("flag", "config") else None},
                       output=output)
    print(result.table())
    return 0


def verify_width(text: str) -> int:
    from flare.bench import positive_int

    width = positive_int(text, "--verify-width")
    if width > MAX_VERIFY_WIDTH:
        raise UsageError(f"--verify-width {width}: at most {MAX_VERIFY_WIDTH} target tokens per request "
                         f"({MAX_VERIFY_WIDTH - 1} drafts)")
    return width


def build_target(args, concurrency: int, max_context: int, width: int = 1):
    """The model's complete decode step (width 1) or speculative round on one GPU as served: Triton
    attention, decoder layers compiled, the step captured as a CUDA graph (a round with a draft model
    runs eagerly). Returns (target, configuration)."""
    import torch

    from flare.memory import parse_gpus

    gpus = parse_gpus(args.gpus) if args.gpus else (0,)
    if len(gpus) != 1:
        raise UsageError(f"--gpus {args.gpus} selects {len(gpus)} GPUs; ignition bench runs on one local GPU")
    if not torch.cuda.is_available():
        raise UsageError("ignition bench measures GPU decode steps with CUDA events and needs a CUDA GPU")
    torch.cuda.set_device(gpus[0])
    directory = checkpoint_directory(args.model, args.configuration)

    from flare.bench_model import ModelDecodeTarget
    from flare.engine.attention_triton import TritonBackend
    from flare.engine.compile import compile_model
    from flare.models import load_checkpoint

    cfg, model = load_checkpoint(directory, torch.bfloat16, "cuda", TritonBackend())
    compile_model(model)                       # the decoder layers as `flare run` executes them
    configuration = {"model": str(args.model), "checkpoint": str(directory), "architecture": cfg.architecture,
                     "dtype": "bfloat16", "attention": "triton", "page_size": 16, "compiled_layers": True,
                     "sampling": "greedy", "gpus": list(gpus), "verify_width": width, "draft_tokens": width - 1}
    if width == 1:
        return ModelDecodeTarget(model, cfg, max_batch=concurrency, max_context=max_context), {
            **configuration, "graphs": True, "proposal": None}
    from flare.bench_speculation import SpeculativeRoundTarget
    from flare.engine.factory import load_draft_model
    from flare.engine.speculation.settings import supplied_draft

    draft = load_draft_model(directory, cfg, torch.bfloat16, "cuda") if supplied_draft(directory) else None
    target = SpeculativeRoundTarget(model, cfg, width=width, max_batch=concurrency, max_context=max_context,
                                    draft=draft)
    # Each case's aggregate target rows are its batch times verify_width (P = B x W).
    return target, {**configuration, "graphs": draft is None,
                    "proposal": "draft model (draft/)" if draft else "point-mass drafts (as history drafts)"}


def checkpoint_directory(model, configuration):
    """A local checkpoint directory for MODEL: a directory as given, else through model resolution
    (`configuration` is the file the command line already loaded, for defaults.model and the hub)."""
    from pathlib import Path

    from flare.resolve import fetch, resolve_model

    if model and (Path(model) / "config.json").is_file():
        return Path(model)
    return fetch(resolve_model(model, configuration))
