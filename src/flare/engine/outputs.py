"""What the engine hands back. The core speaks token ids; the output processor adds text.

`CoreOutput` and `TokenLogprob` cross from the engine-core process to the frontend every step, so they are
msgspec Structs encoded as arrays (`flare.engine.messages`); `RequestOutput` stays in the frontend.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import msgspec

FinishReason = Literal["stop", "length", "abort"]


class TokenLogprob(msgspec.Struct, frozen=True, array_like=True):
    """One position's logprob: the chosen token and the `top` alternatives, best first."""

    token_id: int
    logprob: float
    rank: int                                   # 1 = the most likely token
    top: tuple[tuple[int, float], ...] = ()     # (token_id, logprob), best first


class CoreOutput(msgspec.Struct, frozen=True, array_like=True):
    """One step's news for one request, from the engine core (scheduler + model)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_logprobs: tuple[TokenLogprob, ...] = ()
    finish_reason: FinishReason | None = None
    stop_token_id: int | None = None            # the EOS / stop token that finished it, if any
    num_prompt_tokens: int = 0
    num_cached_tokens: int = 0                  # prompt tokens served from the prefix cache
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None  # first position is None


@dataclass(frozen=True)
class RequestOutput:
    """One step's news for one request after detokenizing and stop strings (what the API layer sees)."""

    request_id: str
    new_token_ids: tuple[int, ...]
    new_text: str
    new_logprobs: tuple[TokenLogprob, ...] = ()
    finished: bool = False
    finish_reason: FinishReason | None = None
    stop_reason: str | int | None = None        # the stop string or stop token id that matched
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_cached_tokens: int = 0
    prompt_logprobs: tuple[TokenLogprob | None, ...] | None = None
