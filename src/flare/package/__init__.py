"""Signed, content-addressed runtime packages: export into the model cache, verify, trust, open.

The seams other components use:
    export_entry(spec, cache, identity, ...) -> Path       publish a signed entry (flare.package.export)
    open_package(target, TrustOptions, cache_root) -> Package
        .manifest, .iter_weights() (checkpoint tensor names), .frontend_dir(), .frontend_assets
    lease_entry(path)                                      hold an entry while serving it
    add_trust_arguments(parser) / trust_options_from_args(args)   the trust flags of `flare run`
"""

from flare.package.export import ExportSpec, export_entry
from flare.package.reader import Package, open_package, open_unverified, resolve_target
from flare.package.store import ModelCache, lease_entry
from flare.package.trust import TrustOptions, add_trust_arguments, trust_options_from_args

__all__ = ["ExportSpec", "ModelCache", "Package", "TrustOptions", "add_trust_arguments", "export_entry",
           "lease_entry", "open_package", "open_unverified", "resolve_target", "trust_options_from_args"]
