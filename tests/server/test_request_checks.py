"""What a hostile or careless client sends, over a stand-in engine: every refusal is a 400 (413 for size) in
the caller's API shape that names the field and the limit, unexpected failures are 500s in that shape too,
and nothing a client sees carries a traceback or a local path.

The same checks through a real `flare run` (the seed that took the engine core down, cached tokens, the
fuzz run over the OpenAPI document) are in test_serving_hardening.py.
"""

from __future__ import annotations

import json
import threading

import httpx
import pytest

from flare.engine_client.protocol import EngineDeadError
from flare.server.app import build_app
from flare.server.frontend import ServingFrontend
from flare.server.limits import (MAX_CHOICES, MAX_JSON_DEPTH, MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_STOP_LENGTH,
                                 MAX_STOP_STRINGS, MAX_TOOLS)
from flare.server.settings import ServerSettings
from tests.server.conftest import ThreadServer
from tests.server.standin_engine import StandinEngine

KEY = "test-key-hardening"
HEADERS = {"x-api-key": KEY}
CHAT = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
COMPLETION = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 2}
RESPONSE = {"model": "tiny", "input": "hi", "max_output_tokens": 2}
MESSAGE = {"model": "tiny", "max_tokens": 2, "messages": [{"role": "user", "content": "hi"}]}
ROUTES = {"/v1/chat/completions": CHAT, "/v1/completions": COMPLETION, "/v1/responses": RESPONSE,
          "/v1/messages": MESSAGE}


@pytest.fixture(scope="module")
def served(stories260k):
    frontend = ServingFrontend.from_dir(stories260k)
    engine = StandinEngine(frontend)
    settings = ServerSettings(served_names=("tiny",), canonical_id="org/Tiny-260K", max_model_len=512,
                              max_concurrency=8, kv_tokens=4096, api_key=KEY)
    app = build_app(engine, frontend, settings)
    with ThreadServer(app) as server:
        server.engine = engine
        server.app = app
        yield server


def post(served, path: str, body, **headers) -> httpx.Response:
    content = body if isinstance(body, (bytes, str)) else json.dumps(body)
    return httpx.post(served.url + path, content=content, timeout=60,
                      headers={**HEADERS, "content-type": "application/json", **headers})


def error_of(reply: httpx.Response, path: str) -> dict:
    """The error object, checked to be in the route's own API shape."""
    body = reply.json()
    if path.startswith("/v1/messages"):
        assert body["type"] == "error" and set(body["error"]) == {"type", "message"}
        return body["error"]
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


def refused(served, path: str, body, *phrases: str, param: str | None = None) -> dict:
    reply = post(served, path, body)
    assert reply.status_code == 400, reply.text
    error = error_of(reply, path)
    for phrase in phrases:
        assert phrase in error["message"], error["message"]
    if param is not None and "param" in error:
        assert error["param"] == param, error
    return error


@pytest.mark.parametrize("seed", [2 ** 64, -(2 ** 64), 2 ** 63])
def test_a_seed_outside_64_bits_is_400(served, seed):
    refused(served, "/v1/chat/completions", {**CHAT, "seed": seed, "temperature": 1.0}, "seed", "922337203685477580",
            param="seed")
    refused(served, "/v1/responses", {**RESPONSE, "seed": seed}, "seed", param="seed")


def test_n_samples_of_the_largest_seed_wrap_around_within_64_bits(served):
    reply = post(served, "/v1/completions", {**COMPLETION, "seed": 2 ** 63 - 1, "n": 3})
    assert reply.status_code == 200
    seeds = sorted(params.seed for params in served.engine.seen_params.values()
                   if params.seed is not None and abs(params.seed) > 2 ** 62)
    assert seeds == [-(2 ** 63), -(2 ** 63) + 1, 2 ** 63 - 1]


@pytest.mark.parametrize("body, phrases, param", [
    ({**CHAT, "n": MAX_CHOICES + 1}, ("n", str(MAX_CHOICES)), "n"),
    ({**CHAT, "n": 2 ** 62}, ("n", str(MAX_CHOICES)), "n"),
    ({**CHAT, "stop": ["x"] * (MAX_STOP_STRINGS + 1)}, ("stop", f"at most {MAX_STOP_STRINGS} items"), "stop"),
    ({**CHAT, "stop": "x" * (MAX_STOP_LENGTH + 1)}, ("stop", f"at most {MAX_STOP_LENGTH} characters"), "stop"),
    ({**CHAT, "logit_bias": {str(i): 1 for i in range(MAX_LOGIT_BIAS + 1)}},
     ("logit_bias", f"at most {MAX_LOGIT_BIAS} items"), "logit_bias"),
    ({**CHAT, "tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(MAX_TOOLS + 1)]},
     ("tools", f"at most {MAX_TOOLS} items"), "tools"),
    ({**CHAT, "messages": [{"role": "user", "content": "hi"}] * (MAX_MESSAGES + 1)},
     ("messages", f"at most {MAX_MESSAGES} items"), "messages"),
    ({**CHAT, "top_logprobs": 21, "logprobs": True}, ("top_logprobs", "20"), "top_logprobs"),
    ({**CHAT, "top_k": 2 ** 40}, ("top_k", "2147483647"), "top_k"),
    ({**CHAT, "stop_token_ids": [99999]}, ("stop_token_ids", "outside the vocabulary"), "stop_token_ids"),
])
def test_chat_caps_are_400s_naming_the_field_and_the_limit(served, body, phrases, param):
    refused(served, "/v1/chat/completions", body, *phrases, param=param)


def test_prompts_times_n_is_capped(served):
    body = {**COMPLETION, "prompt": ["a", "b", "c"], "n": 50}
    refused(served, "/v1/completions", body, "3 prompts x n = 50", f"limit is {MAX_CHOICES} choices", param="n")
    assert post(served, "/v1/completions", {**body, "n": 40}).status_code == 200


def test_anthropic_caps(served):
    refused(served, "/v1/messages", {**MESSAGE, "stop_sequences": ["x"] * (MAX_STOP_STRINGS + 1)}, "stop_sequences",
            str(MAX_STOP_STRINGS))
    refused(served, "/v1/messages", {**MESSAGE, "top_k": -5}, "top_k")


@pytest.mark.parametrize("path", list(ROUTES))
@pytest.mark.parametrize("number", ["NaN", "Infinity", "-Infinity", "1e400"])
def test_non_finite_numbers_are_400_on_every_route(served, path, number):
    text = json.dumps(ROUTES[path])[:-1] + f', "temperature": {number}}}'
    reply = post(served, path, text)
    assert reply.status_code == 400 and number in error_of(reply, path)["message"]


def test_nan_logit_bias_and_minus_infinity_temperature_never_reach_the_sampler(served):
    before = len(served.engine.seen_params)
    refused(served, "/v1/chat/completions", '{"model": "tiny", "messages": [{"role": "user", "content": "hi"}], '
                                            '"logit_bias": {"5": NaN}}', "NaN")
    refused(served, "/v1/completions", '{"model": "tiny", "prompt": "hi", "temperature": -Infinity}', "Infinity")
    refused(served, "/v1/completions", {**COMPLETION, "temperature": -1.0}, "temperature", param="temperature")
    assert len(served.engine.seen_params) == before


@pytest.mark.parametrize("path", list(ROUTES))
def test_a_lone_surrogate_is_400_on_every_route(served, path):
    body = json.dumps(ROUTES[path]).replace('"hi"', '"h\\ud800i"').replace('"once upon a time"', '"\\udfff"')
    error = refused(served, path, body, "surrogate")
    assert "\\ud" in error["message"] or "surrogate" in error["message"]
    pair = json.dumps(ROUTES[path]).replace('"hi"', '"\\ud83d\\ude00"')         # a proper pair is an emoji
    assert post(served, path, pair).status_code == 200


def test_a_surrogate_in_a_key_or_nested_value_is_400(served):
    refused(served, "/v1/chat/completions", json.dumps(CHAT)[:-1] + ', "metadata": {"\\ud800": 1}}', "surrogate")
    refused(served, "/tokenize", '{"prompt": "a\\udc00b"}', "surrogate", param="prompt")


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH + 1, 1000, 100_000])
def test_json_nested_deeply_is_400(served, depth):
    nested = "[" * depth + "]" * depth
    for path in ROUTES:
        text = json.dumps(ROUTES[path])[:-1] + f', "extra": {nested}}}'
        assert post(served, path, text).status_code == 400
        assert "levels" in error_of(post(served, path, text), path)["message"]


def test_an_integer_of_thousands_of_digits_is_400(served):
    refused(served, "/v1/completions", json.dumps(COMPLETION)[:-1] + ', "seed": ' + "9" * 5000 + "}", "out of range")


@pytest.mark.parametrize("key", ["add_generation_prompt", "messages", "tools", "bos_token", "raise_exception"])
def test_chat_template_kwargs_may_not_reuse_the_templates_own_arguments(served, key):
    refused(served, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {key: []}}, key,
            "chat_template_kwargs", param="chat_template_kwargs")


def test_chat_template_kwargs_of_its_own_still_work(served):
    assert post(served, "/v1/chat/completions", {**CHAT, "chat_template_kwargs": {"enable_thinking": False}}
                ).status_code == 200


@pytest.mark.parametrize("path, body", [
    ("/v1/chat/completions", {**CHAT, "tool_choice": "required"}),
    ("/v1/chat/completions", {**CHAT, "tool_choice": {"type": "function", "function": {"name": "f"}}}),
    ("/v1/responses", {**RESPONSE, "tool_choice": "required"}),
    ("/v1/messages", {**MESSAGE, "tool_choice": {"type": "any"}}),
])
def test_a_tool_call_demanded_with_no_tools_is_400(served, path, body):
    refused(served, path, body, "tool_choice", "no tools", param="tool_choice")


def test_responses_input_must_not_be_empty(served):
    refused(served, "/v1/responses", {**RESPONSE, "input": []}, "input", param="input")


@pytest.mark.parametrize("path, body, field, param", [
    ("/v1/chat/completions", {**CHAT, "messages": [{"role": "user", "content": "a b c " * 400}], "max_tokens": None},
     "messages", "messages"),
    ("/v1/chat/completions", {**CHAT, "max_tokens": 600}, "messages", "max_tokens"),
    ("/v1/chat/completions", {**CHAT, "max_completion_tokens": 600}, "messages", "max_completion_tokens"),
    ("/v1/completions", {**COMPLETION, "prompt": "a b c " * 400}, "prompt", "prompt"),
    ("/v1/completions", {**COMPLETION, "max_tokens": 600}, "prompt", "max_tokens"),
    ("/v1/responses", {**RESPONSE, "input": "a b c " * 400}, "input", "input"),
    ("/v1/responses", {**RESPONSE, "max_output_tokens": 600}, "input", "max_output_tokens"),
])
def test_context_overflow_speaks_openais_words_and_names_its_field(served, path, body, field, param):
    error = refused(served, path, body, param=param)
    message = error["message"]
    # OpenAI's sentence, which litellm matches (case-insensitively) to raise ContextWindowExceededError
    assert message.startswith("This model's maximum context length is 512 tokens. However, you requested ")
    assert f" in the {field}, " in message and "Options:" in message
    assert error["code"] == "context_length_exceeded" and error["type"] == "invalid_request_error"


def test_anthropic_context_overflow_keeps_anthropics_shape(served):
    error = refused(served, "/v1/messages", {**MESSAGE, "messages": [{"role": "user", "content": "a b c " * 400}]})
    assert error["message"].startswith("prompt is too long: ") and "512" in error["message"]
    assert error["type"] == "invalid_request_error"
    error = refused(served, "/v1/messages", {**MESSAGE, "max_tokens": 600})
    assert error["message"].startswith("max_tokens: 600 > ")


def test_an_unexpected_failure_is_500_in_the_routes_shape_without_a_traceback(served, monkeypatch):
    from flare.server import openai_completions

    def broken(*_):
        raise KeyError("/home/someone/secret/path.py")
    monkeypatch.setattr(openai_completions, "_encode_prompts", broken)
    reply = post(served, "/v1/completions", COMPLETION)
    assert reply.status_code == 500
    error = error_of(reply, "/v1/completions")
    assert error["type"] == "server_error" and "KeyError" in error["message"]
    assert "/home" not in reply.text and "Traceback" not in reply.text


def test_an_unexpected_failure_on_the_anthropic_route_is_in_its_shape(served, monkeypatch):
    from flare.server import anthropic_messages

    def broken(*_):
        raise RuntimeError("boom at /srv/flare/x.py")
    monkeypatch.setattr(anthropic_messages, "prompt_ids", broken)
    reply = post(served, "/v1/messages", MESSAGE)
    assert reply.status_code == 500
    assert error_of(reply, "/v1/messages")["type"] == "api_error" and "/srv" not in reply.text


def test_prompts_are_tokenized_off_the_event_loop(served, monkeypatch):
    """A prompt of megabytes takes seconds to tokenize; the event loop must keep serving meanwhile."""
    frontend = served.engine.frontend
    threads = []
    encode = frontend.tokenizer.encode
    monkeypatch.setattr(frontend.tokenizer, "encode",
                        lambda *args, **kwargs: threads.append(threading.current_thread()) or encode(*args, **kwargs))
    for path, body in ROUTES.items():
        assert post(served, path, body).status_code == 200
    assert post(served, "/v1/messages/count_tokens", MESSAGE).status_code == 200
    assert post(served, "/tokenize", {"prompt": "hi"}).status_code == 200
    assert len(threads) >= 6
    assert served.thread not in threads             # the server's event loop runs in that thread


def test_health_and_503s_after_an_engine_failure_show_no_traceback(stories260k):
    from fastapi.testclient import TestClient

    frontend = ServingFrontend.from_dir(stories260k)
    settings = ServerSettings(served_names=("tiny",), canonical_id="tiny", max_model_len=512, max_concurrency=8)
    reason = ('the engine core failed:\nTraceback (most recent call last):\n  File "/opt/flare/engine/sampler.py", '
              'line 87, in sample\nRuntimeError: Overflow when unpacking long')

    class DeadEngine(StandinEngine):
        async def generate(self, request_id, prompt_token_ids, params):
            raise EngineDeadError(reason)
            yield

    engine = DeadEngine(frontend)
    engine.dead_reason = reason
    with TestClient(build_app(engine, frontend, settings)) as client:
        health = client.get("/health")
        reply = client.post("/v1/completions", json=COMPLETION)
        stream = client.post("/v1/messages", json={**MESSAGE, "stream": True})
    assert health.status_code == 503 and "the engine core failed" in health.json()["message"]
    assert reply.status_code == 503 and "the engine stopped: the engine core failed" in reply.text
    for text in (health.text, reply.text, stream.text):
        assert "Traceback" not in text and "/opt/flare" not in text and "sampler.py" not in text


def test_openapi_document_is_served_behind_the_key_and_describes_the_bodies(served):
    assert httpx.get(served.url + "/openapi.json").status_code == 401
    document = httpx.get(served.url + "/openapi.json", headers=HEADERS).json()
    assert document["openapi"].startswith("3.1")
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/messages"):
        body = document["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]
        assert body["$ref"].startswith("#/components/schemas/")
    schemas = document["components"]["schemas"]
    chat = schemas["ChatCompletionRequest"]
    assert set(chat["required"]) == {"model", "messages"}
    assert chat["properties"]["model"]["enum"] == ["org/Tiny-260K", "tiny"]
    assert {"maximum": MAX_CHOICES, "minimum": 1}.items() <= chat["properties"]["n"].items()
    assert chat["properties"]["seed"]["anyOf"][0]["maximum"] == 2 ** 63 - 1
    assert "max_tokens" in schemas["AnthropicMessagesRequest"]["required"]
    assert document["security"] and document["paths"]["/health"]["get"]["security"] == []
    for docs in ("/docs", "/redoc", "/docs/oauth2-redirect"):
        assert httpx.get(served.url + docs, headers=HEADERS).status_code == 404
