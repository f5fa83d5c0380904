"""`flare trust revoke FINGERPRINT`: forget an accepted publisher key."""

from __future__ import annotations

from pathlib import Path


def configure(parser):
    sub = parser.add_subparsers(dest="trust_command", metavar="COMMAND", required=True)
    revoke = sub.add_parser("revoke", help="remove acceptance of a key fingerprint",
                            description="remove acceptance of a key fingerprint")
    revoke.add_argument("fingerprint", metavar="FINGERPRINT", help="full lowercase SHA-256 key fingerprint")
    revoke.add_argument("--trust-store", type=Path, metavar="PATH",
                        help="trust store (default ~/.config/flare/trust.toml)")
    listing = sub.add_parser("list", help="show accepted keys", description="show accepted keys")
    listing.add_argument("--trust-store", type=Path, metavar="PATH",
                         help="trust store (default ~/.config/flare/trust.toml)")


def run(args) -> int:
    from flare.package.trust import DEFAULT_TRUST_STORE, TrustStore
    store = TrustStore(args.trust_store or DEFAULT_TRUST_STORE)
    if args.trust_command == "revoke":
        count = store.revoke(args.fingerprint)
        print(f"revoked {args.fingerprint} ({count} acceptance{'s' if count != 1 else ''}) in {store.path}")
        return 0
    for record in store.records():
        print(f"{record.get('fingerprint')}  {record.get('namespace')}  {record.get('identity')}")
    return 0
