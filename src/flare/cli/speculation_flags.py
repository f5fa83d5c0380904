"""The speculative-decoding flags of the commands (spec §3.1 preparation, §3.2 serving), one definition.

`ignition export` and `debug-serve` take the preparation flags; `flare run` and `debug-serve` the
serving ones. The values go to `flare.speculation_plan`, which applies the spec's rules; nothing here
imports anything heavy (help runs without torch).
"""

from __future__ import annotations

import argparse
import math

from flare.errors import UsageError


def add_preparation_arguments(parser: argparse.ArgumentParser, with_fixed: bool = True) -> None:
    group = parser.add_argument_group("speculative decoding")
    group.add_argument("--no-mtp", action="store_true",
                       help="disable multi-token speculation: load no draft model, keep no verification rows, "
                            "decode one token per step (default: speculation on)")
    group.add_argument("--mtp-draft-tokens", type=int, metavar="N",
                       help="most draft tokens verified in one round; MODEL --help gives its limit; 0 keeps "
                            "draft state with width-one execution (default: the recipe's)")
    group.add_argument("--speculative-token-capacity", type=int, metavar="N",
                       help="most target-token rows of a verification step (default: [defaults] / "
                            "[models] speculative_token_capacity, else the recipe's 128)")
    group.add_argument("--speculative-graph-budget", type=int, metavar="N",
                       help="most packed round graphs; only recipes with packed catalogs take it, and none "
                            "here has one")
    if with_fixed:
        group.add_argument("--no-mtp-adaptive-verification", action="store_true",
                           help="default to fixed-width serving (default: adaptive)")


def preparation_flags(args):
    from flare.speculation_plan import PreparationFlags

    return PreparationFlags(no_mtp=args.no_mtp, draft_tokens=args.mtp_draft_tokens,
                            token_capacity=args.speculative_token_capacity, graph_budget=args.speculative_graph_budget,
                            fixed_verification=getattr(args, "no_mtp_adaptive_verification", False))


def add_serving_arguments(parser: argparse.ArgumentParser, draft_tokens: bool = True) -> None:
    group = parser.add_argument_group("speculative decoding")
    if draft_tokens:
        group.add_argument("--mtp-draft-tokens", type=int, metavar="N",
                           help="reduce the most draft tokens per round; 0 selects ordinary execution "
                                "(default: the package's)")
    adaptive = group.add_mutually_exclusive_group()
    adaptive.add_argument("--mtp-adaptive-verification", dest="adaptive_verification", action="store_true",
                          default=None, help="adaptive selection among the captured widths")
    adaptive.add_argument("--no-mtp-adaptive-verification", dest="adaptive_verification", action="store_false",
                          help="fixed width: every round verifies the most drafts allowed (default: the package's)")
    history = group.add_mutually_exclusive_group()
    history.add_argument("--history-drafts", dest="history_drafts", action="store_true", default=None,
                         help="augment drafts with continuations copied from each request's prompt and output")
    history.add_argument("--no-history-drafts", dest="history_drafts", action="store_false",
                         help="no history drafts (default)")
    group.add_argument("--mtp-adaptive-verification-alpha", metavar="ALPHA",
                       help="positive finite exponent on prefix-survival scores; below 1 favours longer "
                            "verification prefixes (default 1.0)")
    budgets = group.add_mutually_exclusive_group()
    budgets.add_argument("--mtp-verification-token-budget", type=int, metavar="N",
                         help="verify at exactly this many target rows per batch capacity, or at width one")
    budgets.add_argument("--mtp-max-verification-token-budget", type=int, metavar="N",
                         help="keep every captured verification capacity at or below N target rows "
                              "(default: all captured capacities)")


def serving_flags(args):
    from flare.speculation_plan import ServingFlags

    return ServingFlags(draft_tokens=getattr(args, "mtp_draft_tokens", None), adaptive=args.adaptive_verification,
                        history=args.history_drafts, alpha=_alpha(args.mtp_adaptive_verification_alpha),
                        exact_budget=_rows(args.mtp_verification_token_budget, "--mtp-verification-token-budget"),
                        max_budget=_rows(args.mtp_max_verification_token_budget,
                                         "--mtp-max-verification-token-budget"))


def _alpha(text: str | None) -> float | None:
    if text is None:
        return None
    try:
        value = float(text)
    except ValueError:
        value = math.nan
    if not (math.isfinite(value) and value > 0):
        raise UsageError(f"--mtp-adaptive-verification-alpha must be a positive finite number, not {text!r}")
    return value


def _rows(value: int | None, flag: str) -> int | None:
    if value is not None and value < 1:
        raise UsageError(f"{flag} must be a positive number of target rows, not {value}")
    return value
