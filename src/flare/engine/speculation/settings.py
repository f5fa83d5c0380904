"""What a served engine speculates with: frozen, part of `flare.engine.config.EngineConfig`.

`draft_tokens` is the most drafts one request carries in a step (0: decode one token a step). Drafts come
from a draft model the runner holds (`draft_model`) and, with `history`, from each request's own prompt
and output (flare.engine.speculation.history). With `adaptive`, each step's verification width is chosen
from measured acceptance and measured step cost (flare.engine.speculation.adaptive); without it every
decoding request carries up to `draft_tokens`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from pathlib import Path

from flare.engine.sampling_params import SamplingParams
from flare.errors import UsageError


def speculates(params: SamplingParams) -> bool:
    """Whether a request with these params may carry drafts: not with repetition, presence or frequency
    penalties, whose distribution at a draft's position depends on the drafts before it being counted,
    which a one-pass verification does not do."""
    return params.repetition_penalty == 1.0 and not params.presence_penalty and not params.frequency_penalty


@dataclass(frozen=True)
class SpeculationSettings:
    draft_tokens: int = 0                   # most drafts per request and step; 0: no speculation
    history: bool = False                   # drafts copied from each request's history
    draft_model: bool = False               # the runner proposes drafts with its draft model
    adaptive: bool = True                   # width per step from measured acceptance and cost
    alpha: float = 1.0                      # exponent on prefix-survival scores (spec §3.2)
    # Most target rows (a batch capacity times 1 + drafts) a verification step may carry; None: no cap.
    max_verification_tokens: int | None = None
    # --mtp-verification-token-budget: each batch capacity verifies at this many rows or at width one.
    exact_verification_tokens: int | None = None

    def __post_init__(self) -> None:
        if isinstance(self.draft_tokens, bool) or not isinstance(self.draft_tokens, int) or self.draft_tokens < 0:
            raise UsageError(f"--mtp-draft-tokens must be a whole number of at least 0, not {self.draft_tokens!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise UsageError(f"--mtp-adaptive-verification-alpha must be a positive finite number, not {self.alpha!r}")
        for flag, value in (("--mtp-max-verification-token-budget", self.max_verification_tokens),
                            ("--mtp-verification-token-budget", self.exact_verification_tokens)):
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise UsageError(f"{flag} must be a positive whole number of target rows, not {value!r}")

    @property
    def enabled(self) -> bool:
        """Whether any step can carry drafts."""
        return self.draft_tokens > 0 and (self.history or self.draft_model)


DRAFT_FOLDER = "draft"          # a checkpoint supplies its draft model here (as Kimi's supplies dspark/, spec §8)


def supplied_draft(checkpoint_dir: Path) -> Path | None:
    """The draft model a checkpoint directory supplies in `draft/` (config.json and safetensors), or None."""
    folder = Path(checkpoint_dir) / DRAFT_FOLDER
    if (folder / "config.json").is_file() and any(folder.glob("*.safetensors")):
        return folder
    return None
