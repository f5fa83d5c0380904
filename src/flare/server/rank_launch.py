"""`flare run` for one rank of a multi-host launch (spec §2): rank zero with the package, peers without.

    run_rank_zero(RunOptions, RankOptions)   verify the package here, hand every peer its payloads
    run_peer(PeerLaunch)                     join rank zero, stage and verify this rank's payloads

`--stage-only` distributes and verifies the package on every rank, then ends them all. Serving a
multi-rank package joins the ranks into one tensor-parallel group; until a rank worker takes a TCP
rendezvous, that is refused by name before anything waits or moves.
"""

from __future__ import annotations

import contextlib
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TextIO

from flare.errors import UsageError
from flare.hosts.address import Address
from flare.ui.banner import show_banner
from flare.ui.stages import StageReporter

DEFAULT_TRANSFER_STREAMS = 8
MAX_TRANSFER_STREAMS = 64
NOT_SERVABLE = ("serving a package across hosts joins its ranks into one tensor-parallel group, which this "
                "build of Flare cannot do yet; `--stage-only` distributes and verifies the package on every "
                "rank without serving it")


@dataclass(frozen=True)
class RankOptions:
    rendezvous: Address
    transfer_streams: int = DEFAULT_TRANSFER_STREAMS
    stage_only: bool = False


def check_transfer_streams(value: int | None, flag: str = "--transfer-streams") -> int:
    if value is None:
        return DEFAULT_TRANSFER_STREAMS
    if not 1 <= value <= MAX_TRANSFER_STREAMS:
        raise UsageError(f"{flag} {value} is outside 1-{MAX_TRANSFER_STREAMS}")
    return value


def run_rank_zero(options: Any, ranks: RankOptions, stream: TextIO | None = None) -> int:
    """Rank zero: the package verified and accepted here, then offered to every peer at the rendezvous."""
    from flare.hosts.rendezvous import RankZero
    from flare.package.rank_copy import multi_rank_deployment
    from flare.package.store import lease_entry
    from flare.server.launch import download_options, open_package_in_stages

    stream = stream or sys.stderr
    if not ranks.stage_only:
        raise UsageError(NOT_SERVABLE)
    show_banner(stream, f"rank 0 of {options.target}")
    stages = StageReporter(stream)
    with contextlib.ExitStack() as held:
        package = open_package_in_stages(options, download_options(options), stages, stream,
                                         lambda path: held.enter_context(lease_entry(path)))
        held.callback(package.close)
        deployment = multi_rank_deployment(package.manifest)
        zero = RankZero(package.files, deployment, ranks.rendezvous, ranks.transfer_streams, stages.line)
        zero.open()
        held.callback(zero.close)
        with stages.stage("Distribute package") as stage:
            staged = zero.gather()
            moved = sum(event.received_bytes for event in staged.values())
            stage.note(f"ranks 1-{deployment.tensor_parallel - 1} staged and verified; {moved:,} bytes sent")
        zero.finish(f"rank zero staged {package.label} on every rank (--stage-only)")
    print(f"Staged {package.label} on all {deployment.tensor_parallel} ranks; --stage-only ends every rank",
          file=stream, flush=True)
    return 0


@dataclass(frozen=True)
class PeerLaunch:
    rank: int
    rendezvous: Address
    cache_root: Path
    trust: Any                         # flare.package.TrustOptions
    package: Path | None = None


def run_peer(launch: PeerLaunch, stream: TextIO | None = None) -> int:
    """A peer: joins rank zero, stages this rank's payloads, then does what rank zero says."""
    from flare.hosts.messages import Finish
    from flare.hosts.rendezvous import PeerOptions, join_rank_zero

    stream = stream or sys.stderr
    show_banner(stream, f"rank {launch.rank} from {launch.rendezvous}")
    stages = StageReporter(stream)
    session = join_rank_zero(PeerOptions(launch.rendezvous, launch.rank, launch.cache_root, launch.trust,
                                         launch.package), stages)
    try:
        word = session.wait()
    finally:
        session.close()
    if isinstance(word, Finish):
        print(f"Rank {launch.rank}: {word.message}", file=stream, flush=True)
        return 0
    raise UsageError(NOT_SERVABLE)
