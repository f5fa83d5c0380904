"""The engine core in its own process, behind two ZMQ sockets carrying pickled tuples.

Frontend -> core (PUSH/PULL): ("add", EngineRequest), ("abort", [ids]), ("shutdown",).
Core -> frontend (PUSH/PULL): ("ready", ReadyInfo), ("outputs", [CoreOutput], EngineStats),
("error", request_id, text), ("fatal", text). The core builds its model from a picklable ModelFactory after it starts, then loops:
take every waiting command, run one step if any request is unfinished, send what the step produced.
Only local, trusted peers speak on these sockets (ipc paths in a private temporary directory).
"""

from __future__ import annotations

import os
import pickle
import signal
import traceback
from dataclasses import dataclass

from flare.engine.config import EngineConfig
from flare.engine.core import EngineStats

IDLE_POLL_MS = 1000     # an idle core wakes this often to check that its parent is still alive
IDLE_CHECK_DELAY_MS = 100   # quiet time after going idle before the page integrity check runs


@dataclass(frozen=True)
class ReadyInfo:
    engine_config: EngineConfig
    vocab_size: int
    eos_token_ids: tuple[int, ...]
    stats: EngineStats


def run_engine_core(factory, seed: int | None, command_address: str, output_address: str) -> None:
    """Entry point of the engine-core process (multiprocessing, spawn)."""
    import zmq

    signal.signal(signal.SIGINT, signal.SIG_IGN)     # the frontend decides when to stop
    parent = os.getppid()
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(command_address)
    outputs = context.socket(zmq.PUSH)
    outputs.setsockopt(zmq.LINGER, 5000)
    outputs.connect(output_address)
    try:
        core = _build(factory, seed)
        outputs.send(pickle.dumps(("ready", ReadyInfo(core.config, core.runner.vocab_size,
                                                      tuple(sorted(core.eos_token_ids)), core.stats()))))
        _serve(core, commands, outputs, parent)
    except Exception:
        outputs.send(pickle.dumps(("fatal", traceback.format_exc())))
    finally:
        commands.close(linger=0)
        outputs.close()
        context.term()


def _build(factory, seed):
    """The core; with FLARE_PROFILE_STARTUP=DIR set, a cProfile of building it lands in DIR (a
    diagnostic for slow starts: loading, compiling and capturing all happen here)."""
    from flare.engine.factory import build_core

    profile_dir = os.environ.get("FLARE_PROFILE_STARTUP")
    if not profile_dir:
        return build_core(factory(), seed)
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(lambda: build_core(factory(), seed))
    finally:
        os.makedirs(profile_dir, exist_ok=True)
        profiler.dump_stats(os.path.join(profile_dir, f"engine-start-{os.getpid()}.prof"))


def _serve(core, commands, outputs, parent: int) -> None:
    check_due = False                                # went idle since the last page check
    while os.getppid() == parent:                    # else the frontend died without saying goodbye
        timeout = 0 if core.has_unfinished() else IDLE_CHECK_DELAY_MS if check_due else IDLE_POLL_MS
        changed = False
        while commands.poll(timeout):
            message = pickle.loads(commands.recv())
            if message[0] == "shutdown":
                return
            error = _handle(core, message)
            if error is not None:
                outputs.send(pickle.dumps(error))
            changed, timeout = True, 0
        if check_due and not changed and not core.has_unfinished():
            # Idle and quiet is a consistent moment to check the pages: every finished request has given
            # its pages back, so a leak shows in the stats the frontend reads. The check walks every page
            # (11 ms on a development CPU for the 62K pages an 8B model gets on an H200), so it waits for
            # quiet: neither a request's last token nor the next request's first should wait for it.
            outputs.send(pickle.dumps(("outputs", [], core.stats(check_integrity=True))))
            check_due = False
            continue
        produced = core.step() if core.has_unfinished() else []
        if produced or changed:
            outputs.send(pickle.dumps(("outputs", produced, core.stats())))
            check_due = check_due or not core.has_unfinished()


def _handle(core, message: tuple) -> tuple | None:
    """Apply one command; a request the core refuses comes back as ("error", request_id, message)."""
    from flare.engine.core import InvalidRequest

    kind, payload = message
    if kind == "add":
        try:
            core.add_validated_request(payload)     # AsyncEngine.generate validated the prompt
        except InvalidRequest as error:
            return ("error", payload.request_id, str(error))
    elif kind == "abort":
        core.abort(payload)
    else:
        raise ValueError(f"unknown engine-core command {kind!r}")
    return None
