"""`flare prefix-pool`: the manager that several `flare run --prefix-cache-pool` servers of one package share
retained prefix states through (flare.server.prefix_pool)."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    parser.add_argument("--listen", action="append", required=True, metavar="ADDRESS",
                        help="where servers reach it: unix:PATH (its clients trust the socket's permissions), "
                             "HOST:PORT (plain TCP) or tls:HOST:PORT; one Unix socket and one TCP address at most")
    parser.add_argument("--name", required=True, help="the pool's name: it salts scopes and instance identities")
    parser.add_argument("--memory", required=True, metavar="SIZE",
                        help="the most page bytes the pool keeps, such as 64G; the least recently used go first")
    parser.add_argument("--certificate", type=Path, metavar="FILE", help="the TLS listener's certificate (PEM)")
    parser.add_argument("--key", type=Path, metavar="FILE", help="the TLS listener's private key (PEM)")


def run(args) -> int:
    from flare.memory import parse_size
    from flare.server.prefix_pool import PoolOptions, parse_listen, serve_pool
    from flare.ui.progress import format_bytes

    options = PoolOptions(args.name, parse_size(args.memory, "--memory"), parse_listen(args.listen),
                          args.certificate, args.key)
    where = ", ".join(args.listen)
    print(f"prefix pool {args.name!r}: up to {format_bytes(options.memory_bytes)} at {where}", flush=True)
    store = serve_pool(options)
    print(f"prefix pool {args.name!r} stopped holding {len(store):,} pages", flush=True)
    return 0
