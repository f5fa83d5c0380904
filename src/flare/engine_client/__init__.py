"""The engine's clients: what the HTTP routes (and tests and tools) run requests through.

A client takes token ids and `SamplingParams` in and gives `RequestOutput`s (detokenized, stop strings
applied) out; the engine core behind it speaks token ids only. Every serving client implements
`EngineClient` (`protocol.py`):

    async_engine.AsyncEngine     the engine core in its own process (`flare run`), over ZMQ
    threaded.ThreadedEngine      an in-process engine stepping on a thread (`ignition debug-serve`)
    llm_engine.LLMEngine         the synchronous in-process engine the threaded client steps (tests, tools)

This package sits above `flare.engine` and `flare.frontend` (the output processor): the engine never
imports it.
"""
