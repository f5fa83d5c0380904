"""The engine core in its own process, behind two ZMQ sockets carrying `flare.engine.messages`.

Commands arrive on one socket (PUSH/PULL), events leave on the other. The core builds its model from a
picklable ModelFactory after it starts, reporting start-up progress on the event socket, then loops:
take every waiting command, run one step if any request is unfinished, send what the step produced.
Only local, trusted peers speak on these sockets (ipc paths in a private temporary directory).

The core ignores SIGINT and SIGTERM: a terminal's Ctrl+C, `docker stop`, systemd and job control signal
the whole process group, and the frontend, which drains its requests first, decides when the core
stops (a Shutdown command, or the frontend's death, which the core notices within a second).
"""

from __future__ import annotations

import os
import signal

from flare.engine import messages
from flare.engine.messages import AbortRequests, AddRequest, Outputs, Ready, RequestRefused, Shutdown
from flare.engine.step_profile import Diagnostics, StepTracer
from flare.engine.warm_up import warm_up_kernels

IDLE_POLL_MS = 1000     # an idle core wakes this often to check that its parent is still alive
IDLE_CHECK_DELAY_MS = 100   # quiet time after going idle before the page integrity check runs


def run_engine_core(factory, seed: int | None, command_address: str, event_address: str,
                    diagnostics: Diagnostics | None = None, core_builder=None) -> None:
    """Entry point of the engine-core process (multiprocessing, spawn). `diagnostics`: what `flare run
    --profile-startup` and `--profile-steps` ask it to record (flare.engine.step_profile). `core_builder`: a picklable
    `(LoadedModel, seed) -> EngineCore` in place of `flare.engine.factory.build_core` (benchmarks and tests
    that run the serving path around a stand-in runner)."""
    import zmq

    for ignored in (signal.SIGINT, signal.SIGTERM):     # the frontend decides when to stop
        signal.signal(ignored, signal.SIG_IGN)
    parent = os.getppid()
    context = zmq.Context()
    commands = context.socket(zmq.PULL)
    commands.connect(command_address)
    events = context.socket(zmq.PUSH)
    events.setsockopt(zmq.LINGER, 5000)
    events.connect(event_address)
    send = lambda message: events.send(messages.encode(message))
    try:
        diagnostics = diagnostics or Diagnostics()
        core = _build(factory, seed, send, diagnostics.startup_profile_dir, core_builder)
        warm_up_kernels(core)                          # the eager steps' kernels, loaded before serving
        core.kernel_builds.watch()                     # from here on a build stalls serving: count them
        send(Ready(core.config, core.runner.vocab_size, tuple(sorted(core.eos_token_ids)), core.stats()))
        tracer = StepTracer(diagnostics) if diagnostics.step_trace_dir else None
        clean = _serve(core, commands, send, parent, tracer)
        core.close(drain=clean)                        # a clean stop may write the prefix cache's host tier down
    except Exception as error:
        send(messages.failure(error))
    finally:
        commands.close(linger=0)
        events.close()
        context.term()


def _build(factory, seed, send, profile_dir: str | None = None, core_builder=None):
    """The core; with a `profile_dir`, a cProfile of building it lands there (a diagnostic for slow
    starts: loading, compiling and capturing all happen here)."""
    from flare.engine.factory import build_core

    def build():
        loaded = factory(send)
        send(messages.ModelBuilt())
        return (core_builder or build_core)(loaded, seed)

    if not profile_dir:
        return build()
    import cProfile

    profiler = cProfile.Profile()
    try:
        return profiler.runcall(build)
    finally:
        os.makedirs(profile_dir, exist_ok=True)
        profiler.dump_stats(os.path.join(profile_dir, f"engine-start-{os.getpid()}.prof"))


def _serve(core, commands, send, parent: int, tracer: StepTracer | None = None) -> bool:
    """Serve until Shutdown (returns True) or the frontend's death (False)."""
    check_due = False                                # went idle since the last page check
    while os.getppid() == parent:                    # else the frontend died without saying goodbye
        timeout = 0 if core.has_unfinished() else IDLE_CHECK_DELAY_MS if check_due else IDLE_POLL_MS
        changed = False
        while commands.poll(timeout):
            command = messages.decode_command(commands.recv())
            if isinstance(command, Shutdown):
                return True
            refused = _apply(core, command)
            if refused is not None:
                send(refused)
            changed, timeout = True, 0
        if check_due and not changed and not core.has_unfinished():
            # Idle and quiet is a consistent moment to check the pages: every finished request has given
            # its pages back, so a leak shows in the stats the frontend reads. The check walks every page
            # (11 ms on a development CPU for the 62K pages an 8B model gets on an H200), so it waits for
            # quiet: neither a request's last token nor the next request's first should wait for it.
            send(Outputs([], core.stats(check_integrity=True)))
            check_due = False
            continue
        if not core.has_unfinished():
            produced = []
        else:
            produced = tracer(core.step) if tracer is not None else core.step()
        refused = core.take_refused()                # grammars that failed to compile during the step
        for request in refused:
            send(RequestRefused(request.request_id, request.reason))
        if produced or changed or refused:
            send(Outputs(produced, core.stats()))
            check_due = check_due or not core.has_unfinished()
    return False


def _apply(core, command: AddRequest | AbortRequests) -> RequestRefused | None:
    """Apply one command; a request the core refuses comes back as RequestRefused."""
    from flare.engine.request import InvalidRequest

    if isinstance(command, AddRequest):
        try:
            core.add_validated_request(command.request)     # the frontend validated the prompt
        except InvalidRequest as error:
            return RequestRefused(command.request.request_id, str(error))
    else:
        core.abort(command.request_ids)
    return None
