"""`flare download REPOSITORY` (and `flare models download`): a published package into the model cache.

Prints only the cached entry's path on stdout; resolution and download progress go to stderr. The
package's signature is checked, but nothing is loaded or executed and no publisher trust is granted.
`flare run` shares the download flags through `add_download_arguments` and `download_options_from_args`.
"""

from __future__ import annotations

import argparse
from pathlib import Path


def configure(parser):
    parser.add_argument("repository", metavar="REPOSITORY",
                        help="hub repository ORG/NAME[@REVISION] holding prepared Flare packages")
    add_download_arguments(parser)
    parser.add_argument("--gpus", metavar="LIST",
                        help="GPU indices the package will serve on, such as 0, 0,1 or 0-3; their count must match "
                             "a tensor-parallel deployment of the package (revision detection by GPU family "
                             "does not apply: without a revision the default branch main is used)")
    if "--config" not in parser._option_string_actions:
        # SUPPRESS keeps `flare models --config PATH download ...` from being reset by this subcommand.
        parser.add_argument("--config", type=Path, default=argparse.SUPPRESS, metavar="PATH",
                            help="configuration file (default: ~/.config/flare/config.toml)")


def add_download_arguments(parser, serving: bool = False) -> None:
    """The download flags of `flare download`; `flare run` (serving=True) has its own --offline and --model-cache."""
    parser.add_argument("--revision", metavar="REVISION",
                        help="hub branch, tag or commit; overrides @REVISION (default: the recorded origin of a "
                             "downloaded model, otherwise the default branch main)")
    parser.add_argument("--filename", metavar="FILE",
                        help="repository-relative prepared package file (default: the sole package file)")
    parser.add_argument("--cache-dir", type=Path, metavar="PATH",
                        help="parent of the temporary transport cache (default: the Flare model cache)")
    parser.add_argument("--token-file", type=Path, metavar="PATH",
                        help="file holding a hub token for gated or private repositories "
                             "(default: [hub] token_file, otherwise no authentication)")
    if serving:
        return
    parser.add_argument("--offline", action="store_true",
                        help="resolve only from downloads recorded in the Flare model cache; make no network "
                             "requests")
    parser.add_argument("--model-cache", type=Path, metavar="PATH",
                        help="Flare prepared-model cache (default: paths.package_cache, otherwise "
                             "~/.cache/flare/packages)")


def download_options_from_args(args):
    """DownloadOptions from parsed flags (of `flare download`, `flare models download` or `flare run`)."""
    from flare.memory import parse_gpus
    from flare.package.download import DownloadOptions

    model_cache = getattr(args, "model_cache", None) or getattr(args, "global_model_cache", None)
    gpus = getattr(args, "gpus", None)
    return DownloadOptions(config=getattr(args, "configuration", None), revision=getattr(args, "revision", None),
                           filename=getattr(args, "filename", None), cache_dir=getattr(args, "cache_dir", None),
                           token_file=getattr(args, "token_file", None), offline=bool(getattr(args, "offline", False)),
                           model_cache=model_cache, gpus=parse_gpus(gpus) if gpus else None)


def run(args) -> int:
    from flare.package.download import download

    print(download(args.repository, download_options_from_args(args)))
    return 0
