"""The environment policy (spec section 1): Flare reads no environment variable except
CUDA_VISIBLE_DEVICES (and HOME, through `Path.home()`).

Libraries do read variables, most of them once, when they are first imported: huggingface_hub fixes
its endpoint, cache and token at import, torch's Inductor and Triton choose their cache directories
when first used. So `apply_library_environment(config)` must run before huggingface_hub,
transformers, tokenizers, triton or torch is imported. The command line does this before it calls a
command's `run` (see `flare.cli.framework`); a program embedding Flare calls it first thing.

It sets every variable those libraries read from Flare's own configuration, and removes the Hugging
Face variables a user's shell might carry (HF_TOKEN, HF_ENDPOINT, HF_HOME, HF_HUB_OFFLINE, ...), so
that the shell cannot change what Flare does: the endpoint, cache and token are configured in
config.toml and passed explicitly.

Developer switches of torch and Triton (TORCH_LOGS, TRITON_INTERPRET, ...) are left alone: they
change diagnostics or select Triton's CPU interpreter for tests, not what Flare serves.
"""

from __future__ import annotations

import os
import sys

from flare.config import Config
from flare.kernels.flashinfer_builds import workspace_base

# Prefixes of variables that Hugging Face libraries read; all are removed before ours are set.
_CLEARED_PREFIXES = ("HF_", "HUGGINGFACE_", "HUGGING_FACE_")
_CLEARED_NAMES = ("TRANSFORMERS_CACHE", "TRANSFORMERS_OFFLINE", "PYTORCH_TRANSFORMERS_CACHE",
                  "PYTORCH_PRETRAINED_BERT_CACHE", "TORCHINDUCTOR_CACHE_DIR", "TRITON_CACHE_DIR",
                  "TOKENIZERS_PARALLELISM", "FLASHINFER_WORKSPACE_BASE")

# Libraries that read these variables at import; importing one first defeats the policy.
LIBRARIES_READING_AT_IMPORT = ("huggingface_hub", "transformers", "tokenizers", "torch", "triton", "flashinfer")


def library_environment(config: Config) -> dict[str, str]:
    """The variables Flare sets for the libraries it uses, derived only from the configuration."""
    kernel_cache = config.paths.kernel_cache
    variables = {
        "HF_HUB_CACHE": str(config.paths.hub_cache),
        "HF_ENDPOINT": config.hub.endpoint,
        "HF_HUB_DISABLE_TELEMETRY": "1",
        # Never send a token the user did not configure: the hub client gets [hub] token_file's
        # token explicitly, not ~/.cache/huggingface/token.
        "HF_HUB_DISABLE_IMPLICIT_TOKEN": "1",
        "HF_HUB_DISABLE_UPDATE_CHECK": "1",
        # Plain resumable HTTP downloads, as the specification's acquisition path uses, rather than
        # Xet chunk reconstruction through a second service.
        "HF_HUB_DISABLE_XET": "1",
        # Tokenizing happens in the frontend process, one request at a time; Rust threads there
        # would only compete with the event loop, and forking after they start deadlocks.
        "TOKENIZERS_PARALLELISM": "false",
        "TORCHINDUCTOR_CACHE_DIR": str(kernel_cache / "inductor"),
        "TRITON_CACHE_DIR": str(kernel_cache / "triton"),
    }
    flashinfer = workspace_base(kernel_cache)          # FlashInfer's JIT builds (spec section 7)
    if flashinfer is not None:
        variables["FLASHINFER_WORKSPACE_BASE"] = str(flashinfer)
    if config.paths.cuda is not None:
        variables["CUDA_HOME"] = str(config.paths.cuda)
        variables["CUDA_PATH"] = str(config.paths.cuda)
    return variables


def apply_library_environment(config: Config) -> tuple[str, ...]:
    """Clear the libraries' stray variables and set ours from `config`.

    Returns the names of libraries that were already imported (and so may have read the old values);
    an empty tuple means the policy took full effect.
    """
    for name in list(os.environ):
        if name.startswith(_CLEARED_PREFIXES) or name in _CLEARED_NAMES:
            del os.environ[name]
    os.environ.update(library_environment(config))
    return tuple(name for name in LIBRARIES_READING_AT_IMPORT if name in sys.modules)
