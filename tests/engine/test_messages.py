"""The frontend <-> engine-core messages: one codec, typed payloads, nothing else decodes."""

from __future__ import annotations

import msgspec
import pytest

from flare.engine import messages
from flare.engine.config import EngineConfig
from flare.engine.stats import EngineStats
from flare.engine.outputs import CoreOutput, TokenLogprob
from flare.engine.request import EngineRequest
from flare.engine.sampling_params import InvalidSamplingParams, SamplingParams

STATS = EngineStats(num_running=1, num_waiting=2, kv_pages_used=3, kv_pages_total=64, num_preemptions=0,
                    page_integrity="ok")


def test_every_message_comes_back_as_it_was_sent():
    params = SamplingParams(max_tokens=7, temperature=0.5, seed=3, stop=("\n",), logit_bias=((5, -1.5),),
                            logprobs=2)
    commands = [messages.AddRequest(EngineRequest("r", (1, 2, 3), params)), messages.AbortRequests(("r", "s")),
                messages.Shutdown()]
    for command in commands:
        assert messages.decode_command(messages.encode(command)) == command
    logprob = TokenLogprob(9, -0.25, 1, ((9, -0.25), (4, -2.0)))
    events = [messages.WeightsTotal(1 << 40), messages.WeightsRead(4096), messages.WeightsLoaded(1.5),
              messages.PrepareNote("compiled kernels loaded"), messages.ModelBuilt(),
              messages.Ready(EngineConfig(), 32000, (2, 7), STATS),
              messages.Outputs([CoreOutput("r", (9,), (logprob,), "stop", 9, 3, 1, (None, logprob))], STATS),
              messages.RequestRefused("r", "request id 'r' is already in use"),
              messages.failure(ValueError("bad weights"))]
    for event in events:
        decoded = messages.decode_event(messages.encode(event))
        assert decoded == event and type(decoded) is type(event)


def test_the_payloads_are_checked_where_they_are_decoded():
    sent = messages.encode(messages.AddRequest(EngineRequest("r", (1,), SamplingParams())))
    with pytest.raises(msgspec.ValidationError):          # a command is not an event
        messages.decode_event(sent)
    wrong_type = msgspec.msgpack.encode(["AbortRequests", [1, 2]])
    with pytest.raises(msgspec.ValidationError, match="Expected `str`"):
        messages.decode_command(wrong_type)
    bad_params = msgspec.msgpack.encode(["AddRequest", {"request_id": "r", "prompt_token_ids": [1],
                                                        "params": {"max_tokens": 0}}])
    with pytest.raises((msgspec.ValidationError, InvalidSamplingParams), match="max_tokens"):
        messages.decode_command(bad_params)               # SamplingParams validates itself on the way in


def test_failures_are_classified_by_type():
    from flare.errors import CapacityError, UsageError
    from flare.models.errors import UnsupportedModel, WeightError

    assert messages.failure(UsageError("x")).kind == "usage"
    assert messages.failure(UnsupportedModel("sliding window")).kind == "usage"
    assert messages.failure(WeightError("missing tensor")).kind == "preparation"
    assert messages.failure(CapacityError("too big")).kind == "capacity"
    assert messages.failure(MemoryError()).kind == "out_of_memory"
    assert messages.failure(KeyError("shape")).kind == "internal"
    try:
        raise RuntimeError("the device fell over")
    except RuntimeError as error:
        failed = messages.failure(error)
    assert failed.summary == "RuntimeError: the device fell over" and "Traceback" in failed.traceback
