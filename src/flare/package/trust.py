"""Publisher trust: which key signed a package, whether its identity is confirmed, and acceptance.

Every load verifies the manifest signature with a key from an embedded profile, `--publisher-keys`,
the default development profile (development packages only) or the trust store. Verifying a
signature never confers trust: running a package also needs acceptance of its exact key fingerprint
and publisher namespace — typed at a terminal after the disclosure, or given as the two dangerous
flags — and that acceptance is remembered in the trust store. The online check of the publisher's
`publisher.json` confirms identity, and a file that omits the key rejects the package outright.
"""

from __future__ import annotations

import datetime
import sys
import tomllib
from dataclasses import dataclass
from pathlib import Path
from typing import TextIO

from flare.errors import PreparationError, UsageError
from flare.package.manifest import Manifest
from flare.package.signing import DEVELOPMENT_NAMESPACE, DEVELOPMENT_PROFILE_FILE, Profile, PublicKey

DEFAULT_TRUST_STORE = Path("~/.config/flare/trust.toml")
DEFAULT_DEVELOPMENT_PROFILE = Path("~/.config/flare") / DEVELOPMENT_PROFILE_FILE
HUGGING_FACE = "https://huggingface.co"


class TrustError(UsageError):
    """The package is authentic but not accepted, or acceptance was refused."""


class SignatureError(PreparationError):
    """The manifest's signature does not verify, or no key to verify it was supplied."""


@dataclass(frozen=True)
class TrustOptions:
    publisher_keys: tuple[Path, ...] = ()
    approve_key: str | None = None                 # --dangerously-approve-key
    accept_publisher: str | None = None            # --dangerously-accept-publisher
    trust_store: Path | None = None
    offline: bool = False
    interactive: bool | None = None                # None: ask when stdin and stderr are terminals
    verify_weights: bool = False
    publisher_endpoint: str | None = None          # replaces https://huggingface.co in the online check
    require_acceptance: bool = True                # False for inspection: verify, never prompt

    def __post_init__(self):
        if (self.approve_key is None) != (self.accept_publisher is None):
            given, needed = (("--dangerously-approve-key", "--dangerously-accept-publisher")
                             if self.approve_key is not None else
                             ("--dangerously-accept-publisher", "--dangerously-approve-key"))
            raise UsageError(f"{given} requires {needed}: unattended approval names both the key "
                             "fingerprint and the publisher namespace")

    @property
    def store_path(self) -> Path:
        return Path(self.trust_store or DEFAULT_TRUST_STORE).expanduser()


@dataclass(frozen=True)
class TrustResult:
    fingerprint: str
    namespace: str
    key_source: str                                # where the verifying key came from
    identity: str                                  # "verified" or "unverified: <reason>"
    accepted: bool                                 # remembered or accepted now


def add_trust_arguments(parser, serving: bool = True) -> None:
    """The trust flags shared by `flare run` and `flare inspect`."""
    parser.add_argument("--publisher-keys", action="append", type=Path, default=[], metavar="PATH",
                        help="additional publisher.json verification profiles; importing a key does not "
                             "approve execution or verify identity")
    parser.add_argument("--trust-store", type=Path, metavar="PATH",
                        help="persistent key/namespace acceptance file (default ~/.config/flare/trust.toml)")
    if serving:
        parser.add_argument("--dangerously-approve-key", metavar="FINGERPRINT",
                            help="approve this full lowercase SHA-256 key fingerprint; requires "
                                 "--dangerously-accept-publisher")
        parser.add_argument("--dangerously-accept-publisher", metavar="NAMESPACE",
                            help="accept this exact publisher namespace; requires --dangerously-approve-key")
        parser.add_argument("--verify-weights", action="store_true",
                            help="hash every stored weight payload before loading")


def trust_options_from_args(args, **overrides) -> TrustOptions:
    """TrustOptions from parsed flags; the online check uses the configured hub endpoint, if any."""
    configuration = getattr(args, "configuration", None)
    endpoint = getattr(getattr(configuration, "hub", None), "endpoint", None)
    values = dict(publisher_endpoint=endpoint if endpoint and endpoint.rstrip("/") != HUGGING_FACE else None,
                  publisher_keys=tuple(getattr(args, "publisher_keys", None) or ()),
                  approve_key=getattr(args, "dangerously_approve_key", None),
                  accept_publisher=getattr(args, "dangerously_accept_publisher", None),
                  trust_store=getattr(args, "trust_store", None),
                  offline=bool(getattr(args, "offline", False)),
                  verify_weights=bool(getattr(args, "verify_weights", False)))
    values.update(overrides)
    return TrustOptions(**values)


# --- the trust store ---------------------------------------------------------------------------

class TrustStore:
    """`[[accepted]]` records of fingerprint, namespace, verification key and how identity was known."""

    def __init__(self, path: Path):
        self.path = Path(path).expanduser()

    def records(self) -> list[dict]:
        try:
            return list(tomllib.loads(self.path.read_text()).get("accepted", []))
        except FileNotFoundError:
            return []
        except tomllib.TOMLDecodeError as error:
            raise UsageError(f"trust store {self.path} is not valid TOML ({error}); fix or remove it") from None

    def find(self, fingerprint: str, namespace: str | None = None) -> dict | None:
        for record in self.records():
            if record.get("fingerprint") == fingerprint and namespace in (None, record.get("namespace")):
                return record
        return None

    def remember(self, result_key: PublicKey, namespace: str, identity: str, license_text: str | None) -> None:
        record = {"fingerprint": result_key.fingerprint, "namespace": namespace,
                  "public_key": result_key.encoded, "identity": identity,
                  "license": license_text or "",
                  "accepted_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
        records = [r for r in self.records()
                   if not (r.get("fingerprint") == record["fingerprint"] and r.get("namespace") == namespace)]
        self._write(records + [record])

    def revoke(self, fingerprint: str) -> int:
        records = self.records()
        kept = [record for record in records if record.get("fingerprint") != fingerprint]
        if len(kept) == len(records):
            raise UsageError(f"no accepted key with fingerprint {fingerprint} in {self.path}")
        self._write(kept)
        return len(records) - len(kept)

    def _write(self, records: list[dict]) -> None:
        import tomlkit
        document = tomlkit.document()
        document.add(tomlkit.comment("Publisher keys accepted for running packages; see `flare trust revoke`."))
        array = tomlkit.aot()
        for record in records:
            table = tomlkit.table()
            table.update(record)
            array.append(table)
        document["accepted"] = array
        self.path.parent.mkdir(parents=True, exist_ok=True)
        temporary = self.path.with_name(self.path.name + ".tmp")
        temporary.write_text(tomlkit.dumps(document))
        temporary.replace(self.path)


# --- verification and acceptance ----------------------------------------------------------------

def candidate_keys(embedded_profile: str, namespace: str, options: TrustOptions) -> list[tuple[PublicKey, str]]:
    """Every verification key on offer, with where it came from."""
    found: list[tuple[PublicKey, str]] = []
    if embedded_profile:
        try:
            found += [(key, "embedded profile") for key in Profile.from_json(embedded_profile, "embedded").keys]
        except UsageError:
            pass                                   # a broken embedded profile just offers no key
    for path in options.publisher_keys:
        found += [(key, f"--publisher-keys {path}") for key in Profile.load(path).keys]
    if not options.publisher_keys and namespace == DEVELOPMENT_NAMESPACE:
        default = DEFAULT_DEVELOPMENT_PROFILE.expanduser()
        if default.exists():
            found += [(key, str(default)) for key in Profile.load(default).keys]
    for record in TrustStore(options.store_path).records():
        try:
            found.append((PublicKey.decode(record["public_key"]), "trust store"))
        except (KeyError, UsageError):
            continue
    return found


def verify_signature(manifest_body: str, signature: bytes, manifest: Manifest, embedded_profile: str,
                     options: TrustOptions, where: str) -> tuple[PublicKey, str]:
    fingerprint, namespace = manifest.publisher.key_fingerprint, manifest.publisher.namespace
    keys = [(key, source) for key, source in candidate_keys(embedded_profile, namespace, options)
            if key.fingerprint == fingerprint]
    if not keys:
        raise SignatureError(f"{where} is signed by key {fingerprint} ({namespace}) and no profile supplies it; "
                             "pass its publisher.json with --publisher-keys PATH")
    key, source = keys[0]
    if not key.verify(signature, manifest_body.encode()):
        raise SignatureError(f"{where}: the manifest signature does not verify with key {fingerprint}; "
                             "the package was modified after signing — export or download it again")
    return key, source


def check_online(manifest: Manifest, options: TrustOptions, timeout_s: float = 5.0) -> str:
    """Fetch publisher.json at the signed official source: "verified", or "unverified: <reason>"."""
    publisher = manifest.publisher
    source = publisher.official_source
    if publisher.namespace == DEVELOPMENT_NAMESPACE or not source.startswith(("https://", "http://")):
        return "unverified: a local development key has no official source to confirm it"
    if options.offline:
        return "unverified: --offline skips the publisher check"
    url = _profile_url(source, options.publisher_endpoint)
    import httpx
    try:
        response = httpx.get(url, timeout=timeout_s, follow_redirects=True)
    except httpx.HTTPError as error:
        return f"unverified: {url} is unreachable ({type(error).__name__})"
    if response.status_code == 404:
        return f"unverified: {url} does not exist"
    if response.status_code != 200:
        return f"unverified: {url} answered HTTP {response.status_code}"
    profile = Profile.from_json(response.text, url)
    listed = profile.namespace == publisher.namespace and any(
        key.fingerprint == publisher.key_fingerprint for key in profile.keys)
    if not listed:
        raise TrustError(f"{url} does not list key {publisher.key_fingerprint} for publisher "
                         f"{publisher.namespace!r}: the package was not signed by its claimed publisher, "
                         "or the key was revoked. It cannot be loaded.")
    return "verified"


def _profile_url(source: str, endpoint: str | None) -> str:
    source = source.rstrip("/")
    if endpoint and source.startswith(HUGGING_FACE):
        source = endpoint.rstrip("/") + source[len(HUGGING_FACE):]
    return f"{source}/resolve/main/publisher.json"


def authorize(manifest: Manifest, key: PublicKey, key_source: str, options: TrustOptions,
              stream: TextIO | None = None) -> TrustResult:
    """Decide whether this signed package may run: remembered, approved by flags, or typed at a terminal."""
    fingerprint, namespace = key.fingerprint, manifest.publisher.namespace
    store = TrustStore(options.store_path)
    remembered = store.find(fingerprint, namespace)
    if not options.require_acceptance:
        identity = remembered["identity"] if remembered else "unverified: not checked during inspection"
        return TrustResult(fingerprint, namespace, key_source, identity, remembered is not None)
    identity = check_online(manifest, options)
    if remembered is not None:
        if identity == "verified" and remembered.get("identity") != "verified":
            store.remember(key, namespace, identity, remembered.get("license"))
        elif identity != "verified" and remembered.get("identity") == "verified":
            identity = "verified on an earlier load"
        return TrustResult(fingerprint, namespace, key_source, identity, True)
    license_text = _license_line(manifest)
    if options.approve_key is not None:
        if options.approve_key != fingerprint:
            raise TrustError(f"--dangerously-approve-key {options.approve_key} does not match the package's "
                             f"signing key {fingerprint}")
        if options.accept_publisher != namespace:
            raise TrustError(f"--dangerously-accept-publisher {options.accept_publisher} does not match the "
                             f"package's publisher namespace {namespace!r}")
    else:
        _ask(manifest, fingerprint, identity, key_source, license_text, options, stream or sys.stderr)
    store.remember(key, namespace, identity, license_text)
    how = ("--dangerously-approve-key and --dangerously-accept-publisher" if options.approve_key is not None
           else "the namespace typed")
    print(f"Accepted key {fingerprint} of publisher {namespace!r} ({how}); remembered in {store.path}, so "
          f"later loads ask for neither. `flare trust revoke {fingerprint}` forgets it.",
          file=stream or sys.stderr, flush=True)
    return TrustResult(fingerprint, namespace, key_source, identity, True)


def _ask(manifest: Manifest, fingerprint, identity, key_source, license_text, options, stream) -> None:
    namespace = manifest.publisher.namespace
    interactive = options.interactive
    if interactive is None:
        interactive = sys.stdin.isatty() and stream.isatty()
    if not interactive:
        raise TrustError(f"publisher {namespace!r} (key {fingerprint}) is not accepted yet. Run once on a "
                         "terminal to review and accept it, or pass --dangerously-approve-key FINGERPRINT and "
                         "--dangerously-accept-publisher NAMESPACE with its exact values")
    print(disclosure(manifest, fingerprint, identity, key_source, license_text), file=stream)
    # The namespace must be typed in full; nothing is accepted by pressing Enter (so no "(default)" look).
    stream.write(f"To accept, type the publisher namespace {namespace} exactly; anything else refuses: ")
    stream.flush()
    typed = sys.stdin.readline().rstrip("\n")
    if typed != namespace:
        raise TrustError(f"typed {typed!r}, not the publisher namespace {namespace!r}; nothing was accepted")


def disclosure(manifest: Manifest, fingerprint: str, identity: str, key_source: str, license_text: str) -> str:
    publisher = manifest.publisher
    lines = ["This package is signed by a publisher key you have not accepted before.",
             f"  publisher:   {publisher.namespace}",
             f"  key:         {fingerprint}  (from {key_source})",
             f"  source:      {publisher.official_source or 'none'}",
             f"  identity:    {identity}",
             f"  license:     {license_text}",
             f"  model:       {manifest.model_id}  version {manifest.version}"]
    if publisher.namespace == DEVELOPMENT_NAMESPACE:
        lines.append("  A local development key makes no claim to be an official published checkpoint.")
    lines.append("Typing the namespace accepts the license terms above and trusts this key to run code.")
    return "\n".join(lines)


def _license_line(manifest: Manifest) -> str:
    if manifest.license is None:
        return "not recorded"
    name, link = manifest.license.name or "not recorded", manifest.license.link
    return f"{name} ({link})" if link else name
