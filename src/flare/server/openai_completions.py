"""POST /v1/completions: OpenAI (legacy) Completions, text_completion objects, with `echo`."""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Any, AsyncIterator, Sequence

from flare.engine.outputs import TokenLogprob
from flare.server import sse
from flare.server.frontend import ServingFrontend
from flare.server.admission import RequestFields
from flare.server.constraints import openai_content_grammar
from flare.server.errors import bad_request
from flare.server.generation import Generation, check_token_ids, new_id
from flare.server.limits import MAX_CHOICES
from flare.server.openai_common import StreamChunks, _finite, requested_sampling, usage
from flare.server.schemas import CompletionRequest


def _prompt_list(prompt: Any) -> list:
    """The prompts of a request: text, a list of texts, token ids, or a list of token-id lists."""
    if isinstance(prompt, str):
        return [prompt]
    if prompt and all(isinstance(item, int) for item in prompt):
        return [prompt]
    return list(prompt)


def _check_choices(prompts: list, n: int) -> None:
    if not prompts:
        raise bad_request("prompt must not be empty", param="prompt")
    if len(prompts) * n > MAX_CHOICES:
        raise bad_request(f"{len(prompts)} prompts x n = {n} asks for {len(prompts) * n} choices; the limit is "
                          f"{MAX_CHOICES} choices per request. Options: fewer prompts, a lower n, or several "
                          f"requests.", param="n" if n > 1 else "prompt")


def _encode_prompts(gen: Generation, prompt: list) -> list[list[int]]:
    """One token list per prompt."""
    prompts = []
    for item in prompt:
        ids = gen.frontend.encode(item) if isinstance(item, str) else list(item)
        if not ids:
            raise bad_request("prompt must not be empty", param="prompt")
        check_token_ids(gen.frontend, ids, "prompt")
        prompts.append(ids)
    return prompts


class _LogprobBuilder:
    """The Completions `logprobs` object: parallel lists of tokens, logprobs, top alternatives, offsets."""

    def __init__(self, frontend: ServingFrontend, top_k: int, text_offset: int = 0) -> None:
        self.frontend = frontend
        self.top_k = top_k
        self.offset = text_offset

    def build(self, entries: Sequence[TokenLogprob | None], token_ids: Sequence[int]) -> dict:
        result = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
        for token_id, entry in zip(token_ids, entries):
            text = self.frontend.token_text(token_id)
            result["tokens"].append(text)
            result["text_offset"].append(self.offset)
            self.offset += len(text)
            if entry is None:                       # the first prompt token has no context to score it
                result["token_logprobs"].append(None)
                result["top_logprobs"].append(None)
                continue
            result["token_logprobs"].append(_finite(entry.logprob))
            top = {self.frontend.token_text(tid): _finite(lp) for tid, lp in entry.top[:self.top_k]}
            top.setdefault(text, _finite(entry.logprob))
            result["top_logprobs"].append(top)
        return result


def _merge(into: dict | None, more: dict) -> dict:
    if into is None:
        return more
    for key in into:
        into[key].extend(more[key])
    return into


async def create(gen: Generation, body: CompletionRequest) -> dict | AsyncIterator[str]:
    if body.suffix:
        raise bad_request("suffix is not supported", param="suffix")
    if body.best_of is not None and body.best_of != body.n:
        raise bad_request("best_of must equal n (each sample is returned)", param="best_of")
    prompts = _prompt_list(body.prompt)
    _check_choices(prompts, body.n)
    prompts = await gen.off_loop(_encode_prompts, gen, prompts)
    limits = [gen.admit(len(ids), body.max_tokens, RequestFields("prompt", "max_tokens")) for ids in prompts]
    logprobs = body.logprobs
    prompt_logprobs = logprobs if (body.echo and logprobs is not None) else None
    requested = replace(requested_sampling(body, body.max_tokens, logprobs, prompt_logprobs),
                        grammar=openai_content_grammar(body))
    # choice index = prompt index * n + sample index, as OpenAI numbers them
    jobs = [(ids, params) for ids, limit in zip(prompts, limits)
            for params in gen.sampling_params(requested, limit, body.n)]
    request_id = new_id("cmpl-")
    if body.stream:
        return _stream(gen, body, request_id, prompts, jobs)
    return await _complete(gen, body, request_id, prompts, jobs)


def _echo(gen: Generation, body: CompletionRequest, ids: list[int]) -> str:
    """The prompt as the caller wrote it when it was one text; else decoded from its tokens."""
    if isinstance(body.prompt, str):
        return body.prompt
    return gen.frontend.decode(ids)


async def _complete(gen, body, request_id, prompts, jobs) -> dict:
    completions = await gen.complete(request_id, [ids for ids, _ in jobs], [p for _, p in jobs])
    choices = []
    generated = 0
    for index, ((ids, _), completion) in enumerate(zip(jobs, completions)):
        text = completion.text
        logprobs = None
        builder = _LogprobBuilder(gen.frontend, body.logprobs or 0)
        if body.echo:
            prompt_text = _echo(gen, body, ids)
            if body.logprobs is not None:
                entries = completion.prompt_logprobs or (None,) * len(ids)
                logprobs = builder.build(entries, ids)
            text = prompt_text + text
        if body.logprobs is not None:
            logprobs = _merge(logprobs, builder.build(completion.logprobs, completion.token_ids))
        generated += len(completion.token_ids)
        choices.append({"index": index, "text": text, "logprobs": logprobs,
                        "finish_reason": completion.finish_reason, "stop_reason": completion.stop_reason})
    prompt_tokens = sum(len(ids) for ids in prompts)
    cached = _cached_tokens([completion.num_cached_tokens for completion in completions], body.n)
    return {"id": request_id, "object": "text_completion", "created": int(time.time()), "model": body.model,
            "choices": choices, "usage": usage(prompt_tokens, generated, cached), "system_fingerprint": None}


def _cached_tokens(per_choice: list[int], n: int) -> int:
    """Prompt tokens read from the prefix cache: each prompt counted once (its n samples share it)."""
    return sum(max(per_choice[start:start + n]) for start in range(0, len(per_choice), n))


async def _stream(gen, body, request_id, prompts, jobs) -> AsyncIterator[str]:
    chunk = StreamChunks(request_id, "text_completion", body)

    builders = [_LogprobBuilder(gen.frontend, body.logprobs or 0) for _ in jobs]
    echoed = [not body.echo for _ in jobs]
    cached = [0 for _ in jobs]
    generated = 0
    async for index, output in gen.stream(request_id, [ids for ids, _ in jobs], [p for _, p in jobs]):
        generated += len(output.new_token_ids)
        cached[index] = max(cached[index], output.num_cached_tokens)
        text = output.new_text
        logprobs = None
        if not echoed[index]:                      # the prompt goes first, in the first chunk of its choice
            ids = jobs[index][0]
            text = _echo(gen, body, ids) + text
            if body.logprobs is not None:
                logprobs = builders[index].build(output.prompt_logprobs or (None,) * len(ids), ids)
            echoed[index] = True
        if body.logprobs is not None:
            logprobs = _merge(logprobs, builders[index].build(output.new_logprobs, output.new_token_ids))
        if logprobs is None and not output.finished:
            if text or output.new_token_ids:
                yield chunk.text(index, text)
        elif text or output.new_token_ids or output.finished:
            yield chunk([{"index": index, "text": text, "logprobs": logprobs,
                          "finish_reason": output.finish_reason if output.finished else None,
                          "stop_reason": output.stop_reason if output.finished else None}])
    if chunk.include_usage:
        yield chunk([], usage(sum(len(ids) for ids in prompts), generated, _cached_tokens(cached, body.n)))
    yield sse.DONE
