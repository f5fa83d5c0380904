"""`flare run PACKAGE`: verify, load and serve a prepared package over the OpenAI and Anthropic APIs."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    parser.add_argument("package", metavar="PACKAGE", nargs="?",
                        help="a package path, or MODEL[@VERSION] from the Flare model cache (a peer of a "
                             "multi-host launch needs none: it receives rank zero's)")
    add_serving_flags(parser)
    download = parser.add_argument_group("repository download (for ORG/NAME[@REVISION])")
    from flare.cli.commands.download import add_download_arguments

    add_download_arguments(download, serving=True)
    trust = parser.add_argument_group("package trust")
    from flare.package.trust import add_trust_arguments

    add_trust_arguments(trust)
    trust.add_argument("--offline", action="store_true",
                       help="skip the online publisher check and any repository lookup")
    trust.add_argument("--model-cache", type=Path, metavar="PATH",
                       help="Flare prepared-model cache; a peer stores its rank's payloads there (default: "
                            "--package-cache, then paths.package_cache, otherwise ~/.cache/flare/packages)")
    add_host_arguments(parser)


def add_serving_flags(parser) -> None:
    """The serving flags proper (listener, capacity, speculation, scheduling): `flare orbit run` takes the
    same and forwards them to its ranks."""
    listen = parser.add_argument_group("listener")
    listen.add_argument("--host", metavar="ADDR",
                        help="listener IP address, IPv4 or IPv6 (default: [server] host, otherwise 127.0.0.1)")
    listen.add_argument("--port", type=int, metavar="N", help="listener port (default: [server] port, otherwise 8000)")
    listen.add_argument("--served-model-name", metavar="ALIAS",
                        help="replace the package's serving aliases with this nonblank alias")
    listen.add_argument("--api-key-file", type=Path, metavar="PATH",
                        help="file containing the serving API key; an empty file disables authentication "
                             "(default: [server] api_key, otherwise no authentication)")
    capacity = parser.add_argument_group("capacity and memory")
    capacity.add_argument("--gpus", metavar="LIST",
                          help="GPUs in rank order, such as 0, 0,1 or 0-3, relative to CUDA_VISIBLE_DEVICES when "
                               "it is set; one per local rank of the package (default: the first visible GPU)")
    capacity.add_argument("--max-concurrency", type=int, metavar="N",
                          help="reduce concurrency within the package's prepared capacity "
                               "(default: model/default configuration, otherwise the package default)")
    capacity.add_argument("--kv-cache-limit", choices=("concurrency", "context", "memory"), default="memory",
                          help="bound shared KV history by context times concurrency, one context, or "
                               "available memory (default: memory)")
    capacity.add_argument("--memory-limit", metavar="LIMIT",
                          help="per-GPU occupied size (30G), free-memory reserve (-30G) or fraction of total "
                               "memory (0.8) (default: [memory] reserve, otherwise the package's reserve)")
    from flare.cli.speculation_flags import add_serving_arguments

    add_serving_arguments(parser)
    add_pool_arguments(parser)
    scheduling = parser.add_argument_group("scheduling")
    scheduling.add_argument("--scheduler-policy", metavar="POLICY", default="balanced",
                            help="balanced keeps output cadence; throughput fills each step with prompt work "
                                 "(default: balanced)")
    scheduling.add_argument("--scheduler-terminal-value", metavar="VALUE",
                            help="worth of retiring a request whose next token is its last, in prompt tokens; "
                                 "0 disables it (default: 256)")
    scheduling.add_argument("--scheduler-terminal-age-price", metavar="PRICE",
                            help="added worth per squared millisecond a terminal request waits; 0 disables it "
                                 "(default: 1)")
    scheduling.add_argument("--scheduler-max-step-ms", type=float, metavar="MS",
                            help="balanced: the longest step beside decoding requests, from the step costs the "
                                 "package measured at export (default: [scheduler] max_step_ms, otherwise twice "
                                 "a full decode batch's step)")
    add_profiling_arguments(scheduling)


def add_host_arguments(parser) -> None:
    """The flags of a multi-host launch (spec §2): ranks by hand, or peers through paired agents."""
    hosts = parser.add_argument_group("several hosts")
    hosts.add_argument("--rank", type=int, metavar="K",
                       help="serve rank K of a multi-host package: 0 with PACKAGE on the rendezvous host, 1..N-1 "
                            "on each peer, without a package")
    hosts.add_argument("--rendezvous", metavar="HOST:PORT",
                       help="rank zero's address: where it listens (rank 0; :PORT for every interface) and where "
                            "peers connect")
    hosts.add_argument("--transfer-streams", type=int, metavar="N",
                       help="rank zero: concurrent payload streams per peer, 1-64 (default: 8)")
    hosts.add_argument("--stage-only", action="store_true",
                       help="rank zero: distribute and verify the package on every rank, then end them all "
                            "without loading a model")
    hosts.add_argument("--package-cache", type=Path, metavar="PATH",
                       help="the receiving rank's cache when --model-cache is absent (the compatible spelling)")
    hosts.add_argument("--hosts", metavar="PEER1,PEER2,...",
                       help="serve rank zero here and start ranks 1.. on these paired agents, in order (names or "
                            "addresses from the agents file; pair them with `flare agent pair HOST`)")
    from flare.cli.commands.agent import add_registry_arguments

    add_registry_arguments(hosts, spelled="agents")


def add_pool_arguments(parser) -> None:
    """The shared pool of retained prefix states (the host and disk tiers are configured in the file)."""
    retention = parser.add_argument_group("prefix cache (host memory and disk: [prefix_cache] and [paths] "
                                          "prefix_cache in the configuration)")
    retention.add_argument("--prefix-cache-pool", metavar="ADDRESS",
                           help="share retained prefix states with the other servers of this package through a "
                                "`flare prefix-pool` manager: unix:PATH, HOST:PORT or tls:HOST:PORT, IPv6 hosts "
                                "in brackets; needs [prefix_cache] memory (default: no pool)")
    retention.add_argument("--prefix-cache-pool-ca", type=Path, metavar="FILE",
                           help="with a tls: pool: the CA its manager's certificate is checked against "
                                "(default: the host's trust store)")


def add_profiling_arguments(group) -> None:
    """The engine core's diagnostics: --profile-startup, --profile-steps and its window."""
    group.add_argument("--profile-startup", type=Path, metavar="DIR",
                       help="write a cProfile of the engine core's start (loading, compiling, capturing) "
                            "into DIR, a diagnostic for slow starts (default: off)")
    group.add_argument("--profile-steps", type=Path, metavar="DIR",
                       help="record a window of serving steps into DIR: a trace of host operators and "
                            "GPU kernels (Chrome trace, with each step's device busy time and longest "
                            "gap), then a cProfile of the next as many steps; recorded steps run slower "
                            "(default: off)")
    group.add_argument("--profile-steps-window", metavar="FIRST,COUNT",
                       help="with --profile-steps: the first serving step recorded and how many "
                            "(default: 200,20)")


def run(args) -> int:
    if args.hosts is None and (args.orbit_file or args.key_file):
        from flare.errors import UsageError
        raise UsageError("--agents-file and --controller-key name the paired agents of --hosts; add --hosts or drop them")
    if args.hosts is not None:
        return run_hosts(args)
    if args.rank is not None or args.rendezvous is not None:
        return run_rank(args)
    from flare.errors import UsageError

    for flag, value in (("--stage-only", args.stage_only), ("--transfer-streams", args.transfer_streams)):
        if value not in (None, False):
            raise UsageError(f"{flag} applies to rank zero of a multi-host launch: add --rank 0 --rendezvous "
                             "HOST:PORT")
    if args.package is None:
        raise UsageError("flare run needs PACKAGE (a path or MODEL[@VERSION]); only a peer of a multi-host launch "
                         "(--rank K --rendezvous HOST:PORT) runs without one")
    return run_local(args)


def run_rank(args) -> int:
    """One rank of a multi-host launch started by hand."""
    from flare.errors import UsageError
    from flare.hosts.address import parse_address
    from flare.package.trust import trust_options_from_args
    from flare.server.rank_launch import (PeerLaunch, RankOptions, check_transfer_streams, run_peer,
                                          run_rank_zero)

    if args.rank is None or args.rendezvous is None:
        given, needed = ("--rank", "--rendezvous") if args.rank is not None else ("--rendezvous", "--rank")
        raise UsageError(f"{given} needs {needed}: a rank of a multi-host launch is started with both, "
                         "such as `--rank 1 --rendezvous 10.0.0.5:29800`")
    if args.rank < 0:
        raise UsageError(f"--rank {args.rank} is negative; rank zero serves the package, peers are 1..N-1")
    address = parse_address(args.rendezvous, "--rendezvous", listening=args.rank == 0)
    if args.rank == 0:
        if args.package is None:
            raise UsageError("rank zero needs PACKAGE: it verifies the package and hands every peer its payloads")
        streams = check_transfer_streams(args.transfer_streams)
        options = _run_options(args)
        return run_rank_zero(options, RankOptions(address, streams, args.stage_only))
    _refuse_rank_zero_flags(args)
    from flare.config import package_cache

    configuration = _configuration(args)
    cache = package_cache(args.model_cache or args.package_cache, configuration)
    return run_peer(PeerLaunch(args.rank, address, cache, trust_options_from_args(args),
                               Path(args.package) if args.package else None))


def run_hosts(args) -> int:
    """Rank zero here, its peers started through their paired agents (spec §2, `--hosts`)."""
    from flare.cli.commands.agent import controller_from_args
    from flare.cli.serving_forward import forwarded
    from flare.errors import UsageError
    from flare.hosts.address import parse_address
    from flare.orbit.launch import peer_arguments
    from flare.server.rank_launch import RankOptions, check_transfer_streams, run_rank_zero

    if args.rank is not None:
        raise UsageError("--hosts starts ranks 1.. through agents and serves rank zero here; drop --rank")
    if args.package is None:
        raise UsageError("--hosts serves rank zero here: give PACKAGE")
    hosts = tuple(host.strip() for host in args.hosts.split(",") if host.strip())
    if not hosts:
        raise UsageError("--hosts names no peer: give PEER1,PEER2,... (rank zero is this host)")
    address = parse_address(args.rendezvous, "--rendezvous", listening=True) if args.rendezvous else None
    args.configuration = _configuration(args)
    ranks = RankOptions(address, check_transfer_streams(args.transfer_streams), args.stage_only, hosts,
                        controller_from_args(args), peer_arguments(forwarded(args)))
    return run_rank_zero(_run_options(args), ranks)


def _refuse_rank_zero_flags(args) -> None:
    """Flags only rank zero acts on, named when a peer is given them."""
    from flare.errors import UsageError

    for flag, value in (("--stage-only", args.stage_only), ("--transfer-streams", args.transfer_streams),
                        ("--host", args.host), ("--port", args.port), ("--api-key-file", args.api_key_file),
                        ("--served-model-name", args.served_model_name)):
        if value not in (None, False):
            raise UsageError(f"{flag} is rank zero's setting; rank {args.rank} takes it from rank zero. Give it to "
                             "`flare run PACKAGE --rank 0`, not to a peer")


def run_local(args) -> int:
    from flare.server.launch import run_package

    return run_package(_run_options(args))


def _run_options(args):
    from flare.cli.commands.download import download_options_from_args
    from flare.cli.speculation_flags import serving_flags
    from flare.package.trust import trust_options_from_args
    from flare.server.launch import ListenerOptions, RunOptions

    from flare.config import MAX_CONCURRENCY, MAX_STEP_MS, PORT, SERVING_MEMORY, check_flag
    from flare.memory import parse_gpus

    policy = scheduler_policy_from_args(args)              # refuse a bad value before anything loads
    for setting, value in ((MAX_CONCURRENCY, args.max_concurrency), (PORT, args.port),
                           (SERVING_MEMORY, args.memory_limit), (MAX_STEP_MS, args.scheduler_max_step_ms)):
        check_flag(setting, value)
    window = profile_steps_window(args)
    from flare.server.retention_settings import PoolFlags, check_pool_flags

    pool = PoolFlags(args.prefix_cache_pool, args.prefix_cache_pool_ca)
    check_pool_flags(pool)                                   # before the package is opened
    args.configuration = _configuration(args)
    listener = ListenerOptions(host=args.host, port=args.port, served_model_name=args.served_model_name,
                               api_key_file=args.api_key_file, max_concurrency=args.max_concurrency,
                               kv_cache_limit=args.kv_cache_limit, memory_limit=args.memory_limit,
                               scheduler_policy=policy, max_step_ms=args.scheduler_max_step_ms,
                               gpus=parse_gpus(args.gpus) if args.gpus else None,
                               profile_startup=args.profile_startup, profile_steps=args.profile_steps,
                               profile_steps_window=window, speculation=serving_flags(args),
                               prefix_cache_pool=pool.address, prefix_cache_pool_ca=pool.ca_file)
    return RunOptions(target=args.package, trust=trust_options_from_args(args), listener=listener,
                      config=args.configuration, model_cache=args.model_cache or args.package_cache,
                      download=download_options_from_args(args))


def profile_steps_window(args) -> tuple[int, int] | None:
    """--profile-steps-window as (first, count); UsageError for a bad value or one without --profile-steps."""
    from flare.engine.step_profile import parse_window
    from flare.errors import UsageError

    if args.profile_steps_window is None:
        return None
    if args.profile_steps is None:
        raise UsageError("--profile-steps-window sets the window of --profile-steps: add --profile-steps DIR, "
                         "or drop the window")
    try:
        return parse_window(args.profile_steps_window)
    except ValueError as error:
        raise UsageError(str(error)) from None


def scheduler_policy_from_args(args):
    """The SchedulerPolicy the scheduling flags select (UsageError naming the flag for a bad value)."""
    from flare.engine.policy import (DEFAULT_TERMINAL_AGE_PRICE, DEFAULT_TERMINAL_VALUE, SchedulerPolicy,
                                     parse_scheduler_number)

    value, price = args.scheduler_terminal_value, args.scheduler_terminal_age_price
    return SchedulerPolicy(
        name=args.scheduler_policy,
        terminal_value=(parse_scheduler_number("--scheduler-terminal-value", value) if value is not None
                        else DEFAULT_TERMINAL_VALUE),
        terminal_age_price=(parse_scheduler_number("--scheduler-terminal-age-price", price) if price is not None
                            else DEFAULT_TERMINAL_AGE_PRICE))


def _configuration(args):
    configuration = getattr(args, "configuration", None)
    if configuration is None:
        from flare.config import load_config

        configuration = load_config(getattr(args, "config", None))
    return configuration
