"""`flare orbit run`: a saved or new group's ranks started through the nodes' agents."""

from __future__ import annotations

import re
import sys


def run_group(controller, args) -> int:
    from flare.cli.serving_forward import forwarded
    from flare.errors import UsageError
    from flare.orbit.launch import LaunchRequest, describe_plan, plan_launch, saved_path, start_launch
    from flare.orbit.orbit_file import SavedGroup, save_orbit_file
    from flare.package.trust import trust_options_from_args
    from flare.server.rank_launch import check_transfer_streams

    if args.executable is not None:
        raise UsageError("--executable would upload another build, but a Python build is an environment, not one file: "
                         "ranks run each node's installed Flare, which the handshake checks is this controller's "
                         "build. Install the build you want on every node (and restart their agents) instead")
    if args.persistent and not args.name:
        raise UsageError("--persistent saves the launch under --name GROUP: add --name")
    orbit = controller.orbit()
    saved = orbit.groups.get(args.name) if args.name else None
    if args.package is None and saved is None:
        raise UsageError("flare orbit run needs PACKAGE, or --name GROUP of a launch saved with --persistent")
    nodes = _nodes(orbit, args, saved)
    arguments = (*(saved.arguments if saved and args.package is None else ()), *forwarded(args),
                 *(("--stage-only",) if args.stage_only else ()))
    streams = check_transfer_streams(args.transfer_streams if args.transfer_streams is not None
                                     else saved.transfer_streams if saved else None)
    group = args.name or _group_name(args.cluster or nodes[0].name)
    package = args.package or saved.package
    from flare.cli.commands.orbit import config_cache

    request = LaunchRequest(group, package, nodes, arguments, streams, rendezvous=args.rendezvous,
                            package_cache=config_cache(args))
    out = lambda text: print(text, file=sys.stderr, flush=True)
    plan = plan_launch(controller, request, trust_options_from_args(args), out, dry_run=args.dry_run)
    if args.dry_run:
        print("\n".join(describe_plan(plan)))
        return 0
    if args.persistent:
        save_orbit_file(controller.orbit().with_group(SavedGroup(group, saved_path(package), tuple(n.name for n in nodes),
                                                                 arguments, streams)))
        out(f"saved group {group} in {controller.orbit_path}; `flare orbit run --name {group}` starts it again")
    start_launch(controller, plan, out)
    if args.detach:
        out(f"group {group} started; `flare orbit attach {group}` follows it, `flare orbit stop {group}` stops it")
        return 0
    return _follow(controller, plan, out)


def _nodes(orbit, args, saved):
    from flare.cli.commands.orbit import node_list

    if args.nodes:
        return node_list(orbit, args.nodes)
    if args.cluster or saved is None:
        return orbit.cluster(args.cluster)
    return tuple(orbit.node(name) for name in saved.nodes)


def _group_name(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "-", text).strip("-.") or "group"


def _follow(controller, plan, out) -> int:
    """Rank zero's output until it ends; Ctrl-C stops the group on every node."""
    from flare.orbit.launch import attach, stop_group

    nodes = tuple(node for node, _ in plan.ranks)
    try:
        end = attach(controller, nodes[0], plan.request.group, lambda text: print(text, end="", flush=True))
    except KeyboardInterrupt:
        out(f"stopping group {plan.request.group}")
        stop_group(controller, nodes, plan.request.group, out)
        return 130
    out(f"group {plan.request.group}: rank zero {end.state}" + (f" with status {end.exit_code}"
                                                               if end.exit_code is not None else ""))
    return end.exit_code or 0
