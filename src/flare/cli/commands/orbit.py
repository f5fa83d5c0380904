"""`flare orbit ...`: pair hosts, then run, watch and stop groups of ranks on them through their agents."""

from __future__ import annotations

from pathlib import Path

SUBCOMMANDS = {
    "pair": "pair this controller with hosts' agents",
    "controllers": "authorize another controller on the nodes, or forget one",
    "status": "each node's agent, build, cache and running ranks",
    "run": "start a package's ranks on a cluster's nodes, one rank per node",
    "attach": "follow a group's rank zero output",
    "stop": "stop a group's ranks on every node",
    "rm": "remove a stopped group's saved definition and retained records",
    "forget": "remove a node from the orbit file",
    "push": "stage package data in nodes' caches without starting ranks",
    "packages": "what each node's cache holds",
    "ls": "groups on the cluster's nodes",
    "dashboard": "live metrics of the cluster's serving groups",
}


def configure(parser):
    from flare.cli.commands.agent import add_registry_arguments, add_subcommand_config
    from flare.cli.framework import add_config_argument

    add_config_argument(parser)
    sub = parser.add_subparsers(dest="orbit_command", metavar="COMMAND", required=True)
    children = {name: sub.add_parser(name, help=text, description=text) for name, text in SUBCOMMANDS.items()}
    for name, child in children.items():
        add_registry_arguments(child, spelled="orbit")
        add_subcommand_config(child)
        if name in ("status", "attach", "stop", "packages", "ls", "dashboard", "controllers"):
            child.add_argument("--cluster", metavar="NAME", help="the cluster's nodes (default: every paired node)")
    pair = children["pair"]
    pair.add_argument("hosts", nargs="+", metavar="HOST", help="each agent, HOST or HOST:PORT (default port 29700)")
    pair.add_argument("--code", metavar="CODE", help="the pairing code the agents offer")
    pair.add_argument("--cluster", metavar="NAME", help="also record the hosts, in this order, as cluster NAME")
    controllers = children["controllers"]
    controllers.add_argument("action", choices=("add", "remove"))
    controllers.add_argument("values", nargs="+", metavar="NAME KEY | KEY")
    for name in ("attach", "stop"):
        children[name].add_argument("group", nargs="?", metavar="GROUP", help="the group (default: the only one)")
    children["rm"].add_argument("group", metavar="GROUP")
    children["forget"].add_argument("node", metavar="NODE")
    push = children["push"]
    push.add_argument("package", metavar="PACKAGE", help="a controller-local package path or MODEL[@VERSION]")
    push.add_argument("--to", required=True, metavar="NODE,...", help="one node for the whole package, or one per rank")
    push.add_argument("--transfer-streams", type=int, metavar="N", help="sessions per node, 1-64 (default: 8)")
    _configure_run(children["run"])


def _configure_run(run_parser) -> None:
    from flare.cli.commands.run import add_serving_flags
    from flare.package.trust import add_trust_arguments

    run_parser.add_argument("package", nargs="?", metavar="PACKAGE",
                            help="a controller-local package, or NODE:/absolute/path on rank zero's node (default: "
                                 "the saved group's, with --name)")
    where = run_parser.add_mutually_exclusive_group()
    where.add_argument("--cluster", metavar="NAME", help="the cluster whose nodes serve the ranks, in order")
    where.add_argument("--nodes", metavar="NODE,...", help="the nodes that serve the ranks, in order")
    launch = run_parser.add_argument_group("launch")
    launch.add_argument("--name", metavar="GROUP", help="the group's name (default: the cluster's or first node's)")
    launch.add_argument("--persistent", action="store_true", help="with --name: save the launch for reuse")
    launch.add_argument("--executable", metavar="PATH", help="run ranks with another build (refused: see below)")
    launch.add_argument("--dry-run", action="store_true", help="print each node's command; start nothing")
    launch.add_argument("--detach", action="store_true", help="return once the ranks start, before HTTP is ready")
    launch.add_argument("--rendezvous", metavar="HOST:PORT",
                        help="where peers reach rank zero (default: rank zero's node address, port 29800)")
    launch.add_argument("--transfer-streams", type=int, metavar="N",
                        help="payload streams per peer, 1-64 (default: 8, or the saved group's)")
    add_serving_flags(run_parser)
    trust = run_parser.add_argument_group("package trust (checked on the controller)")
    add_trust_arguments(trust)
    trust.add_argument("--offline", action="store_true", help="skip the online publisher check")
    run_parser.add_argument("--stage-only", action="store_true",
                            help="distribute and verify the package on every rank, then end them")


def run(args) -> int:
    from flare.cli.commands import orbit_views as views
    from flare.cli.commands.agent import controller_from_args

    controller = controller_from_args(args)
    command = args.orbit_command
    if command == "pair":
        from flare.cli.commands.agent import pair_hosts
        return pair_hosts(controller, args.hosts, args.code, args.cluster)
    if command == "run":
        from flare.cli.commands.orbit_run import run_group
        return run_group(controller, args)
    handlers = {"controllers": views.controllers, "status": views.status, "attach": views.attach,
                "stop": views.stop, "rm": views.remove, "forget": views.forget, "push": views.push,
                "packages": views.packages, "ls": views.groups, "dashboard": views.dashboard}
    return handlers[command](controller, args)


def node_list(orbit, text: str) -> tuple:
    return tuple(orbit.node(name.strip()) for name in text.split(",") if name.strip())


def config_cache(args) -> Path:
    from flare.config import package_cache

    return package_cache(None, args.configuration)
