"""The `flare orbit` commands that ask nodes and print: status, ls, packages, attach, stop, rm, forget, push,
controllers, dashboard."""

from __future__ import annotations

import sys
import time


def _out(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def status(controller, args) -> int:
    from flare.errors import FlareError
    from flare.orbit.messages import Status

    failed = 0
    for node in controller.orbit().cluster(args.cluster):
        try:
            with controller.session(node) as agent:
                reply = agent.ask(Status())
        except FlareError as error:
            failed += 1
            print(f"{node.name}: not ready: {error}")
            continue
        devices = ", ".join(reply.devices) or "no GPU"
        print(f"{node.name}: ready ({reply.hostname}, {devices}); cache {reply.cache} with "
              f"{reply.cache_free_bytes / (1 << 30):.1f} GiB free; ranks running: {reply.running}; "
              f"controllers authorized: {reply.controllers}")
    return 1 if failed else 0


def _node_groups(controller, nodes):
    from flare.orbit.messages import Groups

    found = []
    for node in nodes:
        with controller.session(node) as agent:
            found += [(node, state) for state in agent.ask(Groups()).ranks]
    return found


def groups(controller, args) -> int:
    rows = _node_groups(controller, controller.orbit().cluster(args.cluster))
    if not rows:
        print("no groups on these nodes")
    for node, state in sorted(rows, key=lambda row: (row[1].group, row[1].rank)):
        ended = f", status {state.exit_code}" if state.exit_code is not None else ""
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(state.started))
        print(f"{state.group}  rank {state.rank}/{state.ranks}  {node.name}  {state.state}{ended}  pid {state.pid}  "
              f"since {started}" + (f"  {state.listener}" if state.listener else ""))
    return 0


def packages(controller, args) -> int:
    from flare.orbit.messages import Packages
    from flare.ui.progress import format_bytes

    for node in controller.orbit().cluster(args.cluster):
        with controller.session(node) as agent:
            reply = agent.ask(Packages())
        print(f"{node.name}: {reply.cache}")
        for package in reply.packages:
            what = f"ranks {', '.join(map(str, package.ranks))}" if package.ranks else "whole package"
            print(f"  {package.label}  {what}  {format_bytes(package.stored_bytes)}")
        if not reply.packages:
            print("  (empty)")
    return 0


def _group_nodes(controller, args, running_only: bool):
    """(group, its nodes in rank order) for GROUP, or the only group when none is named."""
    from flare.errors import UsageError

    rows = [row for row in _node_groups(controller, controller.orbit().cluster(args.cluster))
            if not running_only or row[1].state == "running"]
    names = sorted({state.group for _, state in rows})
    group = getattr(args, "group", None)
    if group is None:
        if len(names) != 1:
            raise UsageError(f"name the group: {'these run' if running_only else 'these are known'}: "
                             f"{', '.join(names)}" if names else "no group runs on these nodes")
        group = names[0]
    nodes = tuple(node for node, state in sorted(rows, key=lambda row: row[1].rank) if state.group == group)
    if not nodes:
        raise UsageError(f"no group {group} {'runs ' if running_only else ''}on these nodes")
    return group, nodes


def attach(controller, args) -> int:
    from flare.orbit.launch import attach as follow

    group, nodes = _group_nodes(controller, args, running_only=False)
    try:
        end = follow(controller, nodes[0], group, lambda text: print(text, end="", flush=True))
    except KeyboardInterrupt:
        return 130                           # detaching leaves the group running
    _out(f"group {group}: rank zero {end.state}")
    return end.exit_code or 0


def stop(controller, args) -> int:
    from flare.orbit.launch import stop_group

    group, nodes = _group_nodes(controller, args, running_only=True)
    stop_group(controller, nodes, group, _out)
    return 0


def remove(controller, args) -> int:
    from flare.errors import UsageError
    from flare.orbit.messages import Done, RemoveGroup
    from flare.orbit.orbit_file import save_orbit_file

    orbit = controller.orbit()
    removed = 0
    for node, _ in {(row[0].name, row[0]): row for row in _node_groups(controller, orbit.nodes.values())
                    if row[1].group == args.group}.values():
        with controller.session(node) as agent:
            agent.grant("remove", RemoveGroup(args.group))
            done = agent.receive()
        _out(f"node {node.name}: {done.text if isinstance(done, Done) else done}")
        removed += 1
    if args.group in orbit.groups:
        save_orbit_file(orbit.without_group(args.group))
        _out(f"removed the saved definition of {args.group} from {orbit.path}")
        removed += 1
    if not removed:
        raise UsageError(f"no group {args.group}: neither saved in {orbit.path} nor retained on a node")
    return 0


def forget(controller, args) -> int:
    from flare.orbit.orbit_file import save_orbit_file

    orbit = controller.orbit()
    save_orbit_file(orbit.without_node(args.node))
    _out(f"forgot node {args.node}; its agent still authorizes this controller until `flare agent reset` there")
    return 0


def push(controller, args) -> int:
    from flare.cli.commands.orbit import config_cache, node_list
    from flare.orbit.push import push_package
    from flare.package import format as fmt
    from flare.package.reader import resolve_target
    from flare.server.rank_launch import check_transfer_streams

    streams = check_transfer_streams(args.transfer_streams)
    files = fmt.read_package_files(resolve_target(args.package, config_cache(args)))
    push_package(controller, files, node_list(controller.orbit(), args.to), streams, _out)
    return 0


def controllers(controller, args) -> int:
    from flare.errors import UsageError
    from flare.orbit.messages import AddController, RemoveController
    from flare.package.signing import PublicKey

    if args.action == "add":
        if len(args.values) != 2:
            raise UsageError("flare orbit controllers add NAME KEY: the controller's name and its base64 public key")
        PublicKey.decode(args.values[1])
        request = AddController(*args.values)
    else:
        if len(args.values) != 1:
            raise UsageError("flare orbit controllers remove KEY: the key or its fingerprint")
        request = RemoveController(args.values[0])
    for node in controller.orbit().cluster(args.cluster):
        with controller.session(node) as agent:
            agent.grant(f"{args.action}-controller", request)
            _out(f"node {node.name}: {agent.receive().text}")
    return 0


def dashboard(controller, args) -> int:
    """Each running group's rank zero metrics, refreshed every two seconds on a terminal (once otherwise)."""
    from flare.cli.commands.orbit_dashboard import render

    orbit = controller.orbit()
    terminal = sys.stdout.isatty()
    try:
        while True:
            rows = [row for row in _node_groups(controller, orbit.cluster(args.cluster)) if row[1].state == "running"]
            text = render(controller, rows)
            print(("\x1b[2J\x1b[H" if terminal else "") + text, flush=True)
            if not terminal:
                return 0
            time.sleep(2.0)
    except KeyboardInterrupt:
        return 0
