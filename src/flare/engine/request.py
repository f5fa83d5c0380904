"""A request as the engine core sees it: token ids, progress, and the rules that finish it."""

from __future__ import annotations

import enum
from dataclasses import dataclass

from flare.engine.outputs import FinishReason, TokenLogprob
from flare.engine.sampling_params import SamplingParams


class InvalidRequest(ValueError):
    """A request the engine cannot take as given; the message says what to change."""


@dataclass(frozen=True)
class EngineRequest:
    """What crosses into the engine core once per request (plain data, so it pickles across processes)."""

    request_id: str
    prompt_token_ids: tuple[int, ...]
    params: SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"      # queued, or preempted and waiting to recompute
    RUNNING = "running"
    RETIRED = "retired"      # every token it may have is sampled; holds no pages or slot, awaits its last ids
    FINISHED = "finished"


class Request:
    """Mutable state of one request inside the core.

    The one rule of progress: `num_computed_tokens` (tokens whose K/V sit in the cache) catches up to
    `num_tokens` (prompt plus output). A chunk of prefill, a decode step and the recomputation after a
    preemption all advance the same counter; a token is sampled when the counter reaches the end.

    One step ahead, the core plans with tokens that are sampled but not yet on the host: they count in
    `num_tokens` and `num_output_tokens` (`num_pending_outputs` of them) but are not in the id lists
    until they arrive, in order. The counter advances when a step is launched.
    """

    def __init__(self, request: EngineRequest, arrival: int) -> None:
        self.request_id = request.request_id
        self.params = request.params
        self.prompt_token_ids = list(request.prompt_token_ids)
        self.output_token_ids: list[int] = []
        self.all_token_ids = list(request.prompt_token_ids)  # prompt + output, appended in step
        self.arrival = arrival
        self.status = RequestStatus.WAITING
        self.num_computed_tokens = 0
        self.num_cached_tokens = 0          # prompt tokens served from the prefix cache, first admission
        self.num_preemptions = 0
        self.terminal_since: float | None = None   # clock time the scheduler first saw it one token from the end
        self.finish_reason: FinishReason | None = None
        self.stop_token_id: int | None = None
        self.num_pending_outputs = 0        # sampled tokens whose ids have not reached the host yet
        self.slot: int | None = None        # batch slot while running
        self.seated = False                 # the runner holds the request in its slot
        self.num_pages_sent = 0             # pages of its table the runner was given
        self.window_blocks_sent = 0         # window blocks below this the runner was given (CachePages)
        self.draft_token_ids: tuple[int, ...] = ()   # proposed for the next step (speculation)
        self.num_proposed_drafts = 0                # drafts the runner's draft model is to propose after them
        self.samples_ahead: bool | None = None      # the runner's answer for its params, once asked
        self.read_retained = False          # its retained prefix was read from disk or the pool once
        self.prompt_logprobs: list[TokenLogprob | None] | None = (
            [None] if request.params.prompt_logprobs is not None else None)

    @property
    def num_tokens(self) -> int:
        """Prompt and output tokens, those still on their way to the host included."""
        return len(self.all_token_ids) + self.num_pending_outputs

    @property
    def num_known_tokens(self) -> int:
        """Prompt and output tokens whose ids the core holds."""
        return len(self.all_token_ids)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids) + self.num_pending_outputs

    @property
    def num_uncomputed_tokens(self) -> int:
        return self.num_tokens - self.num_computed_tokens

    @property
    def wants_prompt_logprobs(self) -> bool:
        """True while some prompt position still lacks its logprob (survives preemption: never recomputed)."""
        return self.prompt_logprobs is not None and len(self.prompt_logprobs) < self.num_prompt_tokens

    def tokens_left(self, max_model_len: int) -> int:
        """Most tokens it may still sample: under max_tokens and under the context limit."""
        pending = self.num_pending_outputs
        by_count = self.params.max_tokens - len(self.output_token_ids) - pending
        by_length = max_model_len - len(self.all_token_ids) - pending
        return by_count if by_count < by_length else by_length

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def __repr__(self) -> str:
        return (f"Request({self.request_id!r}, {self.status.value}, computed={self.num_computed_tokens}/"
                f"{self.num_tokens})")


def check_stop(request: Request, eos_token_ids: frozenset[int], max_model_len: int) -> bool:
    """Finish `request` if its newest received token ends it; return whether it did.

    Order as users of vLLM expect: a stop or EOS token wins over the length limit reached by the same
    token. Tokens still on their way to the host do not count: they come after this one.
    """
    last = request.output_token_ids[-1]
    params = request.params
    if (not params.ignore_eos and last in eos_token_ids) or last in params.stop_token_ids:
        request.finish_reason, request.stop_token_id = "stop", last
    elif len(request.output_token_ids) >= params.max_tokens or len(request.all_token_ids) >= max_model_len:
        request.finish_reason = "length"
    else:
        return False
    return True


def validate_prompt(prompt_token_ids, max_model_len: int, vocab_size: int) -> None:
    """Raise InvalidRequest for a prompt the engine cannot serve (empty, too long, unknown ids).

    Checked once per request, where it enters the engine: `EngineCore.add_request` for in-process
    callers, `AsyncEngine.generate` for the served engine (the core process then trusts it). The HTTP
    server's own admission checks come first and answer in the API's error form."""
    if not prompt_token_ids:
        raise InvalidRequest("the prompt is empty; send at least one token")
    if len(prompt_token_ids) >= max_model_len:
        raise InvalidRequest(
            f"the prompt has {len(prompt_token_ids)} tokens, but this model serves at most {max_model_len} "
            "tokens of prompt and output together; shorten the prompt")
    bad = [t for t in prompt_token_ids if not 0 <= t < vocab_size]
    if bad:
        raise InvalidRequest(f"prompt token ids {bad[:5]} are outside the vocabulary (0..{vocab_size - 1})")
