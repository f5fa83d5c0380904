"""Hostile and careless requests against a real `flare run` (stories260k on the CPU): the server refuses
them with a 400 in the API's shape and keeps serving everyone else; prefix-cache hits show in every API's
usage; context overflows read as OpenAI's, which clients match.

The HTTP layer's refusals one by one are in test_request_checks.py; the fuzz run over the OpenAPI
document is test_openapi_fuzz.py.
"""

from __future__ import annotations

import json
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import FlareProcess, export_package

KEY = "sk-flare-hardening"
ALIAS = "tiny-stories"
HEADERS = {"Authorization": f"Bearer {KEY}", "content-type": "application/json"}
# A prompt of 163 tokens: ten full pages of 16 for the prefix cache to keep.
LONG_PROMPT = " ".join(["The little dog ran to the park and played with a red ball all day long."] * 6)


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories260k):
    home = tmp_path_factory.mktemp("flare-home")
    export_package(stories260k, home, "--max-concurrency", "8")
    key_file = home / "api-key"
    key_file.write_text(KEY + "\n")
    process = FlareProcess(home, "stories260k", "--served-model-name", ALIAS, "--api-key-file", str(key_file))
    process.start()
    yield process
    process.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def healthy(server) -> bool:
    return httpx.get(server.url + "/health", timeout=10).status_code == 200


def test_a_seed_outside_64_bits_is_400_and_the_server_keeps_serving(server, oai):
    """Such a seed used to reach the sampler and take the engine core down with every stream in flight."""
    received: list[str] = []
    usage: list[int] = []

    def stream_one():
        for chunk in oai.completions.create(model=ALIAS, prompt="Once upon a time", max_tokens=120, stream=True,
                                            temperature=1.0, seed=5, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}):
            received.extend(choice.text for choice in chunk.choices)
            if chunk.usage is not None:
                usage.append(chunk.usage.completion_tokens)

    reader = threading.Thread(target=stream_one)
    reader.start()
    deadline = time.monotonic() + 30
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)
    for seed in (2 ** 64, -(2 ** 64), 18446744073709551616):
        with pytest.raises(openai.BadRequestError) as caught:
            oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        temperature=1.0, seed=seed)
        assert caught.value.param == "seed" and "seed" in caught.value.message
    reader.join(timeout=120)
    assert not reader.is_alive() and usage == [120]          # the stream in flight was not cut
    reply = oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=4,
                                        temperature=1.0, seed=2 ** 63 - 1, n=2)
    assert [choice.index for choice in reply.choices] == [0, 1]
    assert healthy(server)


def test_malformed_text_and_nesting_are_400s_and_serving_goes_on(server, oai):
    for path, body in (
            ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "a\\ud800"}]}' % ALIAS),
            ("/v1/completions", '{"model": "%s", "prompt": "\\udfff", "max_tokens": 2}' % ALIAS),
            ("/v1/messages", '{"model": "%s", "max_tokens": 2, "messages": [{"role": "user", "content": "\\ud800"}]}'
             % ALIAS),
            ("/v1/completions", '{"model": "%s", "prompt": "hi", "x": %s}' % (ALIAS, "[" * 5000 + "]" * 5000)),
            ("/v1/completions", '{"model": "%s", "prompt": "hi", "logit_bias": {"5": NaN}}' % ALIAS),
            ("/v1/chat/completions", json.dumps({"model": ALIAS, "messages": [{"role": "user", "content": "hi"}],
                                                 "chat_template_kwargs": {"add_generation_prompt": []}}))):
        reply = httpx.post(server.url + path, content=body, headers=HEADERS, timeout=30)
        assert reply.status_code == 400, (path, reply.text)
        error = reply.json()["error"]
        assert error["message"] and "Traceback" not in reply.text
        if path.startswith("/v1/messages"):
            assert reply.json()["type"] == "error"
    assert oai.completions.create(model=ALIAS, prompt="Once", max_tokens=3).usage.completion_tokens == 3
    assert healthy(server)


def test_prefix_cache_hits_show_in_every_apis_usage(oai, claude):
    """The second of two requests with one prompt reads its full pages from the prefix cache."""
    first = oai.completions.create(model=ALIAS, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    assert first.usage.prompt_tokens > 160
    again = oai.completions.create(model=ALIAS, prompt=LONG_PROMPT, max_tokens=2, temperature=0)
    cached = again.usage.prompt_tokens_details.cached_tokens
    assert first.usage.prompt_tokens - 16 <= cached < first.usage.prompt_tokens
    streamed = list(oai.completions.create(model=ALIAS, prompt=LONG_PROMPT, max_tokens=2, temperature=0,
                                           stream=True, stream_options={"include_usage": True}))
    assert streamed[-1].usage.prompt_tokens_details.cached_tokens == cached
    two = oai.completions.create(model=ALIAS, prompt=[LONG_PROMPT, LONG_PROMPT + " Then"], max_tokens=2, n=2)
    assert two.usage.prompt_tokens_details.cached_tokens >= 2 * cached      # each prompt counted once

    messages = [{"role": "user", "content": LONG_PROMPT}]
    oai.chat.completions.create(model=ALIAS, messages=messages, max_tokens=2)
    chat = oai.chat.completions.create(model=ALIAS, messages=messages, max_tokens=2)
    assert chat.usage.prompt_tokens_details.cached_tokens >= chat.usage.prompt_tokens - 16

    oai.responses.create(model=ALIAS, input=LONG_PROMPT, max_output_tokens=2)
    response = oai.responses.create(model=ALIAS, input=LONG_PROMPT, max_output_tokens=2)
    assert response.usage.input_tokens_details.cached_tokens >= response.usage.input_tokens - 16

    message = claude.messages.create(model=ALIAS, max_tokens=2, messages=messages)
    total = claude.messages.count_tokens(model=ALIAS, messages=messages).input_tokens
    # Anthropic's input_tokens are the uncached rest: the three input counts add up to the prompt
    assert message.usage.cache_read_input_tokens >= total - 16 and message.usage.cache_read_input_tokens > 0
    assert message.usage.input_tokens + message.usage.cache_read_input_tokens == total
    with claude.messages.stream(model=ALIAS, max_tokens=2, messages=messages) as stream:
        final = stream.get_final_message()
    assert final.usage.cache_read_input_tokens == message.usage.cache_read_input_tokens
    assert final.usage.input_tokens == message.usage.input_tokens


def test_context_overflow_reads_as_openais_so_clients_fall_back(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "the dog ran " * 300}])
    error = caught.value
    assert error.code == "context_length_exceeded" and error.param == "messages"
    # litellm's matcher: this text (lower-cased) makes it raise ContextWindowExceededError
    assert "this model's maximum context length is" in error.message.lower()
    assert "maximum context length is 512 tokens. However, you requested " in error.message
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=ALIAS, prompt="the dog ran", max_tokens=600)
    assert caught.value.code == "context_length_exceeded" and caught.value.param == "max_tokens"
    assert "in the prompt, 600 in the completion" in caught.value.message
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model=ALIAS, input="the dog ran " * 300)
    assert caught.value.param == "input" and "in the input" in caught.value.message


def test_top_logprobs_errors_name_top_logprobs(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Hi"}], max_tokens=2,
                                    logprobs=True, top_logprobs=50)
    assert caught.value.param == "top_logprobs" and "top_logprobs" in caught.value.message


def test_the_openapi_document_is_served_behind_the_key(server):
    assert httpx.get(server.url + "/openapi.json").status_code == 401
    document = httpx.get(server.url + "/openapi.json", headers=HEADERS).json()
    assert {"/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"} <= set(document["paths"])
    assert ALIAS in document["components"]["schemas"]["CompletionRequest"]["properties"]["model"]["enum"]
