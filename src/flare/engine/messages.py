"""The messages between a frontend and the engine-core process, and their one codec.

Each exchange is one msgspec Struct, tagged by its class name and encoded as a msgpack array; the
payload types are typed too (`EngineRequest` and `SamplingParams` as dataclasses, `CoreOutput` and
`TokenLogprob` as array Structs, `EngineStats`, `EngineConfig`), so a decoder rebuilds them exactly and
refuses a message of the wrong shape instead of handing on whatever arrived.

Frontend -> core (`Command`):
    AddRequest       a request to run (its prompt already validated by the frontend)
    AbortRequests    requests to drop now, their pages freed
    Shutdown         stop the loop and exit
Core -> frontend (`Event`), in this order:
    start-up:  WeightsTotal, WeightsRead..., WeightsLoaded, PrepareNote..., ModelBuilt, then Ready
    serving:   Outputs (every step that produced something, with the stats), RequestRefused
    any time:  CoreFailed (the core stops after sending it)
"""

from __future__ import annotations

import traceback
from typing import Literal

import msgspec

from flare.engine.config import EngineConfig
from flare.engine.stats import EngineStats
from flare.engine.outputs import CoreOutput
from flare.engine.request import EngineRequest


class _Message(msgspec.Struct, tag=True, frozen=True, array_like=True):
    pass


# ---- frontend -> core ----------------------------------------------------------------------------------

class AddRequest(_Message):
    request: EngineRequest


class AbortRequests(_Message):
    request_ids: tuple[str, ...]


class Shutdown(_Message):
    pass


Command = AddRequest | AbortRequests | Shutdown


# ---- core -> frontend: start-up progress, the stages of `flare run` --------------------------------------

class WeightsTotal(_Message):
    """The weight bytes the model factory is about to read."""

    size: int


class WeightsRead(_Message):
    """More weight bytes are loaded."""

    size: int


class WeightsLoaded(_Message):
    """Every weight is in place; preparing kernels and graphs begins."""

    seconds: float


class PrepareNote(_Message):
    """What preparing kernels and graphs found (e.g. whether the package's compiled kernels fit here)."""

    text: str


class ModelBuilt(_Message):
    """The factory returned its model; the core now compiles, captures and allocates the KV cache."""


class Ready(_Message):
    engine_config: EngineConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    stats: EngineStats


StartupProgress = WeightsTotal | WeightsRead | WeightsLoaded | PrepareNote | ModelBuilt


# ---- core -> frontend: serving ---------------------------------------------------------------------------

class Outputs(_Message):
    """What one step produced (may be empty: the stats alone, e.g. after the idle page check)."""

    outputs: list[CoreOutput]
    stats: EngineStats


class RequestRefused(_Message):
    """The core refused a request as given (`InvalidRequest` on the frontend)."""

    request_id: str
    message: str


# What stopped the core, by the error's type: a user-facing error keeps its kind (and so its exit code);
# running out of device memory is told apart, as the frontend answers it with what to change.
FailureKind = Literal["usage", "fetch", "capacity", "preparation", "out_of_memory", "internal"]


class CoreFailed(_Message):
    kind: FailureKind
    error_type: str         # the error's class name, for people reading the summary
    message: str            # the error's own text
    traceback: str          # the whole traceback, for the server's log only

    @property
    def summary(self) -> str:
        return f"{self.error_type}: {self.message}"


Event = StartupProgress | Ready | Outputs | RequestRefused | CoreFailed


# ---- the codec ---------------------------------------------------------------------------------------------

_encoder = msgspec.msgpack.Encoder()
_command_decoder = msgspec.msgpack.Decoder(Command)
_event_decoder = msgspec.msgpack.Decoder(Event)


def encode(message: _Message) -> bytes:
    return _encoder.encode(message)


def decode_command(data: bytes) -> Command:
    return _command_decoder.decode(data)


def decode_event(data: bytes) -> Event:
    return _event_decoder.decode(data)


def failure(error: BaseException) -> CoreFailed:
    """The message that reports `error`, classified by its type."""
    return CoreFailed(failure_kind(error), type(error).__name__, str(error),
                      "".join(traceback.format_exception(error)))


def failure_kind(error: BaseException) -> FailureKind:
    from flare.errors import CapacityError, FetchError, PreparationError, UsageError
    from flare.estimate import is_out_of_memory

    for kind, error_type in (("usage", UsageError), ("fetch", FetchError), ("capacity", CapacityError),
                             ("preparation", PreparationError)):
        if isinstance(error, error_type):
            return kind
    if isinstance(error, MemoryError) or is_out_of_memory(error):
        return "out_of_memory"
    return "internal"
