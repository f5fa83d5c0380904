"""`flare agent [--listen IP:PORT]` and `flare agent install | pair | reset`: this host's rank agent."""

from __future__ import annotations

from pathlib import Path

DEFAULT_LISTEN = "0.0.0.0:29700"
UNIT_NAME = "flare-agent.service"


def configure(parser):
    from flare.cli.framework import add_config_argument

    add_config_argument(parser)
    parser.add_argument("--listen", metavar="IP:PORT",
                        help=f"where the agent takes control sessions (default: {DEFAULT_LISTEN})")
    sub = parser.add_subparsers(dest="agent_command", metavar="COMMAND")
    install = sub.add_parser("install", help="make this host's agent identity, its pairing, and a systemd user unit",
                             description="make this host's agent identity, its pairing, and a systemd user unit")
    pairing = install.add_mutually_exclusive_group()
    pairing.add_argument("--join-code", metavar="CODE", help="the code a controller must give to pair "
                                                             "(default: a fresh one, printed)")
    pairing.add_argument("--accept-first", action="store_true",
                         help="trust the first controller that pairs, without a code")
    install.add_argument("--listen", metavar="IP:PORT", dest="install_listen",
                         help=f"where the installed agent listens (default: {DEFAULT_LISTEN})")
    pair = sub.add_parser("pair", help="pair this host, as the head of `flare run --hosts`, with peer agents",
                          description="pair this host, as the head of `flare run --hosts`, with peer agents")
    pair.add_argument("hosts", nargs="+", metavar="HOST", help="each peer's agent, HOST or HOST:PORT")
    pair.add_argument("--code", metavar="CODE", help="the pairing code the agents offer")
    add_registry_arguments(pair, spelled="agents")
    reset = sub.add_parser("reset", help="forget authorized controllers and pairing codes",
                           description="forget authorized controllers and pairing codes")
    for child in (install, pair, reset):
        add_subcommand_config(child)


def add_subcommand_config(child) -> None:
    """--config after a subcommand too (set only when given there, so one before it is kept)."""
    import argparse

    child.add_argument("--config", type=Path, default=argparse.SUPPRESS, metavar="PATH",
                       help="configuration file (default: ~/.config/flare/config.toml)")


def add_registry_arguments(parser, spelled: str) -> None:
    """The registry and key: --orbit-file/--key-file (orbit), --agents-file/--controller-key (agent, run)."""
    names = ("--orbit-file", "--key-file") if spelled == "orbit" else ("--agents-file", "--controller-key")
    parser.add_argument(names[0], dest="orbit_file", type=Path, metavar="PATH",
                        help="paired nodes, clusters and saved groups (default: ~/.config/flare/orbit.toml)")
    parser.add_argument(names[1], dest="key_file", type=Path, metavar="PATH",
                        help="this controller's key (default: ~/.config/flare/orbit/controller.key)")


def controller_from_args(args):
    from flare.orbit.controller import Controller, default_paths

    orbit_default, key_default = default_paths(args.configuration.config_dir)
    return Controller(getattr(args, "orbit_file", None) or orbit_default, getattr(args, "key_file", None) or key_default)


def run(args) -> int:
    command = args.agent_command
    if command == "install":
        return _install(args)
    if command == "pair":
        return pair_hosts(controller_from_args(args), args.hosts, args.code, None)
    if command == "reset":
        return _reset(args)
    from flare.hosts.address import parse_address
    from flare.orbit.agent import Agent

    Agent(args.configuration, parse_address(args.listen or DEFAULT_LISTEN, "--listen", listening=True)).serve()
    return 0


def pair_hosts(controller, hosts, code, cluster) -> int:
    for host in hosts:
        node = controller.pair(host, code, cluster)
        print(f"paired {node.name} ({node.hostname}, agent key {node.agent_key.fingerprint}); recorded in "
              f"{controller.orbit_path}")
    return 0


def _install(args) -> int:
    import sys

    from flare.hosts.address import parse_address
    from flare.orbit import pairing
    from flare.orbit.agent_state import AgentState, Pairing

    listen = parse_address(args.install_listen or args.listen or DEFAULT_LISTEN, "--listen", listening=True)
    state = AgentState(args.configuration.config_dir)
    identity = state.identity()
    code = None if args.accept_first else (args.join_code or pairing.new_code())
    state.set_pairing(Pairing(code=code, accept_first=args.accept_first))
    unit = Path.home() / ".config" / "systemd" / "user" / UNIT_NAME
    unit.parent.mkdir(parents=True, exist_ok=True)
    config = f" --config {args.config}" if args.config else ""
    unit.write_text("[Unit]\nDescription=Flare rank agent\nAfter=network-online.target\n\n[Service]\n"
                    f"ExecStart={sys.executable} -m flare.cli.flare agent --listen {listen}{config}\n"
                    "Restart=on-failure\n\n[Install]\nWantedBy=default.target\n")
    how = f"pair with `flare orbit pair HOST --code {code}`" if code else "the first controller to pair is trusted"
    print(f"agent identity {identity.public.fingerprint}; {how}\n"
          f"wrote {unit}; start it with `systemctl --user daemon-reload && systemctl --user enable --now "
          f"{UNIT_NAME}`, or run `flare agent --listen {listen}` yourself")
    return 0


def _reset(args) -> int:
    from flare.orbit.agent_state import AgentState

    forgotten = AgentState(args.configuration.config_dir).reset()
    print(f"forgot {forgotten} controllers and any pairing code; a running agent offers a new code when restarted")
    return 0
