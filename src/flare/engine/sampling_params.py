"""What a request asks of the sampler and of the stop rules. Frozen: built once per request."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

GrammarKind = Literal["json_schema", "json_object", "regex", "ebnf", "structural_tag"]

MAX_LOGIT_BIAS = 1024       # entries per request (the device sampler's table width; vLLM's limit too)


class InvalidSamplingParams(ValueError):
    """A sampling value a user can get wrong; the message names the field and the accepted range."""


@dataclass(frozen=True)
class GrammarSpec:
    """What the reply must match, as text a grammar compiler reads: plain data, so it crosses to the core.

    json_schema: `source` is the schema as JSON text (`strict`: no properties beyond those declared);
    json_object: any JSON object (no source); regex / ebnf: the pattern or the grammar;
    structural_tag: an xgrammar structural tag as JSON text (tool calls in a model's own syntax).
    The frontend builds and validates specs (`flare.frontend.grammar`); the engine core compiles them
    against the model's vocabulary (`flare.engine.structured_output`)."""

    kind: GrammarKind
    source: str = ""
    strict: bool = True


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0          # 0 selects greedy decoding
    top_p: float = 1.0
    top_k: int = 0                    # 0 or -1: no top-k cut
    min_p: float = 0.0
    repetition_penalty: float = 1.0   # multiplicative, applied to prompt and output tokens (as vLLM)
    presence_penalty: float = 0.0     # additive, output tokens only (OpenAI semantics)
    frequency_penalty: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()
    seed: int | None = None
    stop: tuple[str, ...] = ()
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    logprobs: int | None = None       # None: no logprobs; k >= 0: sampled token's logprob plus top-k,
                                      # of the raw model distribution (before penalties, bias, temperature)
    prompt_logprobs: int | None = None
    skip_special_tokens: bool = True
    grammar: GrammarSpec | None = None  # constrained decoding: every sampled token keeps the reply matching

    def __post_init__(self) -> None:
        if self.max_tokens < 1:
            raise InvalidSamplingParams(f"max_tokens must be at least 1, got {self.max_tokens}")
        if not self.temperature >= 0.0:
            raise InvalidSamplingParams(f"temperature must be >= 0, got {self.temperature}")
        if not 0.0 < self.top_p <= 1.0:
            raise InvalidSamplingParams(f"top_p must be in (0, 1], got {self.top_p}")
        if self.top_k < -1:
            raise InvalidSamplingParams(f"top_k must be -1, 0 or positive, got {self.top_k}")
        if not 0.0 <= self.min_p <= 1.0:
            raise InvalidSamplingParams(f"min_p must be in [0, 1], got {self.min_p}")
        if not self.repetition_penalty > 0.0:
            raise InvalidSamplingParams(f"repetition_penalty must be > 0, got {self.repetition_penalty}")
        for name in ("presence_penalty", "frequency_penalty"):
            value = getattr(self, name)
            if not -2.0 <= value <= 2.0:
                raise InvalidSamplingParams(f"{name} must be in [-2, 2], got {value}")
        if len(self.logit_bias) > MAX_LOGIT_BIAS:
            raise InvalidSamplingParams(f"logit_bias has {len(self.logit_bias)} entries; at most {MAX_LOGIT_BIAS} "
                                        "are accepted")
        if any(not math.isfinite(value) for _, value in self.logit_bias):
            raise InvalidSamplingParams("logit_bias values must be finite numbers")
        if any(not isinstance(stop, str) or not stop for stop in self.stop):
            raise InvalidSamplingParams(f"stop strings must be non-empty text, got {list(self.stop)}")
        if any(token_id < 0 for token_id in self.stop_token_ids):
            raise InvalidSamplingParams(f"stop_token_ids must be token ids (>= 0), got {list(self.stop_token_ids)}")
        for name in ("logprobs", "prompt_logprobs"):
            value = getattr(self, name)
            if value is not None and not 0 <= value <= 20:
                raise InvalidSamplingParams(f"{name} must be in [0, 20], got {value}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1
