"""A small stand-in engine client for tests of the HTTP layer alone (the real engine is tested through
`flare run` in test_flare_run.py). It cycles through the prompt's own tokens, so output is predictable."""

from __future__ import annotations

import asyncio
import math

from flare.engine.stats import EngineStats
from flare.engine.outputs import RequestOutput, TokenLogprob
from flare.engine_client.protocol import EngineDeadError


class StandinEngine:
    """An `EngineClient`."""

    def __init__(self, frontend, delay: float = 0.0) -> None:
        self.frontend = frontend
        self.delay = delay
        self.running: set[str] = set()
        self.aborted: list[str] = []
        self.seen_params: dict[str, object] = {}
        self.fail_after: int | None = None          # raise after this many tokens (a failing engine)
        self.dead_reason: str | None = None
        self.shut_down = False

    async def generate(self, request_id, prompt_token_ids, params):
        self.running.add(request_id)
        self.seen_params[request_id] = params
        try:
            text = ""
            for step in range(params.max_tokens):
                if self.fail_after is not None and step == self.fail_after:
                    raise RuntimeError("the device fell over")
                if self.shut_down:
                    raise EngineDeadError("the engine was shut down")
                if self.delay:
                    await asyncio.sleep(self.delay)
                else:
                    await asyncio.sleep(0)
                token = prompt_token_ids[(step + 1) % len(prompt_token_ids)]
                piece = self.frontend.decode([token])
                text += piece
                last = step + 1 == params.max_tokens
                stop = next((s for s in params.stop if s in text), None)
                logprobs = ()
                if params.logprobs is not None:
                    top = tuple((token + i, math.log(0.5 / (i + 1))) for i in range(params.logprobs))
                    logprobs = (TokenLogprob(token, math.log(0.5), 1, top),)
                finished = last or stop is not None
                yield RequestOutput(request_id, (token,), piece, logprobs, finished=finished,
                                    finish_reason=("stop" if stop else "length") if finished else None,
                                    stop_reason=stop, num_prompt_tokens=len(prompt_token_ids),
                                    num_output_tokens=step + 1)
                if finished:
                    return
        finally:
            self.running.discard(request_id)

    def abort(self, request_id):
        self.aborted.append(request_id)

    def stats(self) -> EngineStats:
        return EngineStats(num_running=len(self.running), num_waiting=0, kv_pages_used=0, kv_pages_total=64,
                           num_preemptions=0)

    def shutdown(self) -> None:
        """As the real clients: whatever still streams ends with EngineDeadError."""
        self.shut_down = True
