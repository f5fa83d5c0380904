"""The HTTP layer on its own, over a stand-in engine: error shapes, auth, limits, clamping, disconnects.

Generation itself (real tokens, stop strings, logprobs, concurrency) is tested against the real engine
through `flare run` in test_flare_run.py.
"""

from __future__ import annotations

import json
import time

import anthropic
import httpx
import openai
import pytest

from flare.server.app import build_app
from flare.server.frontend import ServingFrontend
from flare.server.settings import SamplingPolicy, ServerSettings
from tests.server.conftest import ThreadServer
from tests.server.standin_engine import StandinEngine

KEY = "test-key-123"


@pytest.fixture(scope="module")
def served(stories260k):
    frontend = ServingFrontend.from_dir(stories260k)
    engine = StandinEngine(frontend, delay=0.002)
    settings = ServerSettings(served_names=("tiny", "tiny-alias"), canonical_id="org/Tiny-260K",
                              max_model_len=512, max_concurrency=8, kv_tokens=4096, api_key=KEY,
                              sampling=SamplingPolicy(defaults={"temperature": 0.7, "top_k": 40},
                                                      ranges={"temperature": (0.0, 1.5)}))
    with ThreadServer(build_app(engine, frontend, settings)) as server:
        server.engine = engine
        yield server


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key=KEY, max_retries=0)


@pytest.fixture
def claude(served):
    return anthropic.Anthropic(base_url=served.url, api_key=KEY, max_retries=0)


def test_models_lists_aliases_with_the_canonical_root(oai, served):
    cards = oai.models.list().data
    assert [card.id for card in cards] == ["tiny", "tiny-alias"]
    assert {card.root for card in cards} == {"org/Tiny-260K"}
    assert oai.models.retrieve("org/Tiny-260K").id == "org/Tiny-260K"


def test_canonical_id_is_accepted_for_requests(oai):
    reply = oai.chat.completions.create(model="org/Tiny-260K", messages=[{"role": "user", "content": "hi"}],
                                        max_tokens=3)
    assert reply.usage.completion_tokens == 3


def test_missing_key_is_401_in_each_shape(served):
    bad_oai = openai.OpenAI(base_url=served.url + "/v1", api_key="wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError) as caught:
        bad_oai.models.list()
    assert caught.value.body["code"] == "invalid_api_key"
    bad_claude = anthropic.Anthropic(base_url=served.url, api_key="wrong", max_retries=0)
    with pytest.raises(anthropic.AuthenticationError) as caught:
        bad_claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["error"]["type"] == "authentication_error"
    assert httpx.get(served.url + "/v1/models").status_code == 401
    assert httpx.get(served.url + "/health").status_code == 200      # probes need no key


def test_both_key_headers_are_accepted(served):
    for headers in ({"Authorization": f"Bearer {KEY}"}, {"x-api-key": KEY}):
        assert httpx.get(served.url + "/v1/models", headers=headers).status_code == 200


def test_malformed_json_is_400_in_the_api_shape(served):
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    reply = httpx.post(served.url + "/v1/chat/completions", content=b"{not json", headers=headers)
    assert reply.status_code == 400
    assert reply.json()["error"]["type"] == "invalid_request_error"
    reply = httpx.post(served.url + "/v1/messages", content=b"{not json", headers=headers)
    assert reply.status_code == 400
    assert reply.json() == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": reply.json()["error"]["message"]}}


def test_wrong_types_are_400_naming_the_field(oai, claude):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                    max_tokens="many")
    assert "max_tokens" in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "wizard", "content": "hi"}])
    assert "role" in caught.value.message


def test_unknown_model_is_404(oai, claude):
    with pytest.raises(openai.NotFoundError) as caught:
        oai.completions.create(model="gpt-9", prompt="hi", max_tokens=2)
    assert "tiny" in caught.value.message
    with pytest.raises(anthropic.NotFoundError):
        claude.messages.create(model="claude-9", max_tokens=4, messages=[{"role": "user", "content": "hi"}])


def test_prompt_longer_than_the_context_names_the_capacity(oai, claude):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model="tiny", prompt="once upon a time " * 200, max_tokens=2)
    message = caught.value.message
    assert "maximum context length is 512 tokens" in message and "Options:" in message
    assert caught.value.code == "context_length_exceeded"
    with pytest.raises(openai.BadRequestError) as caught:
        oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=600)
    assert "max_tokens = " in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model="tiny", max_tokens=4,
                               messages=[{"role": "user", "content": "the cat sat " * 300}])
    assert "512" in caught.value.message


def test_body_over_the_limit_is_413(served):
    body = json.dumps({"model": "tiny", "prompt": "x" * (9 << 20)}).encode()
    reply = httpx.post(served.url + "/v1/completions", content=body,
                       headers={"x-api-key": KEY, "content-type": "application/json"})
    assert reply.status_code == 413
    assert "limit" in reply.json()["error"]["message"]


def test_previous_response_id_gets_a_clear_error(oai):
    with pytest.raises(openai.BadRequestError) as caught:
        oai.responses.create(model="tiny", input="hi", previous_response_id="resp_123")
    assert "stateless" in caught.value.message


def test_sampling_defaults_and_ranges_apply(oai, served):
    oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=2,
                                temperature=5.0, seed=11, extra_body={"top_k": 3})
    params = list(served.engine.seen_params.values())[-1]
    assert params.temperature == 1.5          # clamped to the model author's range
    assert params.top_k == 40                 # no range declared: fixed at the package default
    assert params.seed == 11                  # seed stays the request's
    oai.completions.create(model="tiny", prompt="hi", max_tokens=2)
    params = list(served.engine.seen_params.values())[-1]
    assert params.temperature == 0.7


def test_client_disconnect_aborts_the_request(served):
    before = len(served.engine.aborted)
    body = {"model": "tiny", "prompt": "once upon a time", "max_tokens": 400, "stream": True}
    with httpx.stream("POST", served.url + "/v1/completions", json=body, headers={"x-api-key": KEY}) as reply:
        for line in reply.iter_lines():
            if line.startswith("data:"):
                break
    deadline = time.monotonic() + 5
    while len(served.engine.aborted) == before and time.monotonic() < deadline:
        time.sleep(0.02)
    assert len(served.engine.aborted) == before + 1
    assert not served.engine.running


def test_metrics_use_flare_names(oai, served):
    oai.completions.create(model="tiny", prompt="hi", max_tokens=2)
    text = httpx.get(served.url + "/metrics").text
    for name in ("flare_requests_total", "flare_prompt_tokens_total", "flare_generation_tokens_total",
                 "flare_time_to_first_token_seconds_bucket", "flare_inter_token_latency_seconds_bucket",
                 "flare_kv_cache_usage_ratio", "flare_num_requests_waiting"):
        assert name in text


def test_every_endpoint_answers_in_its_own_shape(oai, claude):
    chat = oai.chat.completions.create(model="tiny", messages=[{"role": "developer", "content": "be brief"},
                                                               {"role": "user", "content": "hi"}],
                                       max_completion_tokens=4, n=2)
    assert [c.index for c in chat.choices] == [0, 1] and chat.usage.completion_tokens == 8
    chunks = list(oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                              max_tokens=4, stream=True, stream_options={"include_usage": True}))
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].usage.completion_tokens == 4 and chunks[-2].choices[0].finish_reason == "length"
    response = oai.responses.create(model="tiny", input="hi", instructions="be brief", max_output_tokens=4)
    assert response.status == "incomplete" and response.usage.output_tokens == 4
    events = [event.type for event in oai.responses.create(model="tiny", input="hi", max_output_tokens=3,
                                                            stream=True)]
    assert events[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                          "response.content_part.added"]
    assert events[-4:] == ["response.output_text.done", "response.content_part.done",
                           "response.output_item.done", "response.incomplete"]
    message = claude.messages.create(model="tiny", max_tokens=4, system="be brief",
                                     messages=[{"role": "system", "content": "really"},
                                               {"role": "user", "content": "hi"}])
    assert message.stop_reason == "max_tokens" and message.usage.output_tokens == 4
    with claude.messages.stream(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}]) as s:
        kinds = [event.type for event in s]
        final = s.get_final_message()
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    plain = claude.messages.create(model="tiny", max_tokens=4, messages=[{"role": "user", "content": "hi"}])
    assert final.content[0].text == plain.content[0].text and final.usage.output_tokens == 4
    count = claude.messages.count_tokens(model="tiny", messages=[{"role": "user", "content": "hi"}])
    assert count.input_tokens > 0


def test_health_is_503_until_an_engine_is_attached(stories260k):
    frontend = ServingFrontend.from_dir(stories260k)
    app = build_app(None, frontend, ServerSettings(("tiny",), "tiny", 512, 4))
    with ThreadServer(app) as server:
        assert httpx.get(server.url + "/health").status_code == 503
        reply = httpx.post(server.url + "/v1/completions", json={"model": "tiny", "prompt": "hi"})
        assert reply.status_code == 503 and "loading" in reply.json()["error"]["message"]
        app.state.serving.attach_engine(StandinEngine(frontend), frontend)
        assert httpx.get(server.url + "/health").status_code == 200


def test_unknown_routes_answer_in_the_api_shape(served):
    headers = {"x-api-key": KEY}
    reply = httpx.post(served.url + "/v1/embeddings", json={}, headers=headers)
    assert reply.status_code == 404 and "not served here" in reply.json()["error"]["message"]
    reply = httpx.get(served.url + "/v1/messages", headers=headers)
    assert reply.status_code == 405 and reply.json()["type"] == "error"


def test_an_engine_failure_mid_stream_ends_with_an_error_event(oai, claude, served, caplog):
    """The client hears that the request failed, in its API's terms; what failed, with the traceback and its
    file paths, is for the server's log only."""
    served.engine.fail_after = 2
    failures = []
    try:
        with pytest.raises(openai.APIError) as caught:
            for _ in oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}],
                                                 max_tokens=6, stream=True):
                pass
        failures.append(caught.value.message)
        with pytest.raises(anthropic.APIStatusError) as caught:
            with claude.messages.stream(model="tiny", max_tokens=6,
                                        messages=[{"role": "user", "content": "hi"}]) as stream:
                for _ in stream:
                    pass
        failures.append(caught.value.message)
        with pytest.raises(openai.InternalServerError) as caught:
            oai.completions.create(model="tiny", prompt="hi", max_tokens=6)
        failures.append(caught.value.message)
    finally:
        served.engine.fail_after = None
    for message in failures:
        assert "RuntimeError" in message and "server's log" in message
        assert "device fell over" not in message and ".py" not in message and "Traceback" not in message
    assert "the device fell over" in caplog.text and "standin_engine.py" in caplog.text


def test_tokenize_and_detokenize_as_vllm(served, oai):
    headers = {"x-api-key": KEY}
    tokens = httpx.post(served.url + "/tokenize", json={"model": "tiny", "prompt": "Once upon a time"},
                        headers=headers).json()
    assert tokens["count"] == len(tokens["tokens"]) and tokens["max_model_len"] == 512
    text = httpx.post(served.url + "/detokenize", json={"tokens": tokens["tokens"]}, headers=headers).json()
    assert text["prompt"] == "Once upon a time"
    chat = httpx.post(served.url + "/tokenize", json={"messages": [{"role": "user", "content": "hi"}]},
                      headers=headers).json()
    reply = oai.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=1)
    assert chat["count"] == reply.usage.prompt_tokens               # the same chat template
    refused = httpx.post(served.url + "/detokenize", json={"tokens": [99999]}, headers=headers)
    assert refused.status_code == 400 and "outside the vocabulary" in refused.json()["error"]["message"]
    assert httpx.post(served.url + "/tokenize", json={"prompt": "x"}).status_code == 401


def test_null_fields_mean_their_defaults(served):
    body = {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3, "n": None,
            "stream": None, "logprobs": None, "temperature": None, "stop": None, "stream_options": None}
    reply = httpx.post(served.url + "/v1/chat/completions", json=body, headers={"x-api-key": KEY})
    assert reply.status_code == 200 and len(reply.json()["choices"]) == 1


def test_health_is_503_with_the_reason_once_the_engine_died(stories260k):
    from fastapi.testclient import TestClient

    frontend = ServingFrontend.from_dir(stories260k)
    engine = StandinEngine(frontend)
    settings = ServerSettings(served_names=("tiny",), canonical_id="org/Tiny-260K", max_model_len=512,
                              max_concurrency=8)
    with TestClient(build_app(engine, frontend, settings)) as client:
        assert client.get("/health").status_code == 200
        engine.dead_reason = "the engine core exited (exit code -9)"
        reply = client.get("/health")
    assert reply.status_code == 503
    assert "exit code -9" in reply.json()["message"]


def test_n_samples_share_one_conversion_and_get_their_own_seeds(stories260k, monkeypatch):
    from flare.server import generation
    from flare.server.metrics import ServerMetrics

    frontend = ServingFrontend.from_dir(stories260k)
    gen = generation.Generation(None, frontend, ServerSettings(("tiny",), "tiny", 512, 4), ServerMetrics(lambda: None))
    checks = []
    check_token_ids = generation.check_token_ids
    monkeypatch.setattr(generation, "check_token_ids", lambda *args: checks.append(args) or check_token_ids(*args))
    requested = generation.RequestedSampling(seed=7, logit_bias={"300": 150.0, "5": -1})
    params = gen.sampling_params(requested, 10, 3)
    assert len(checks) == 1                                        # the bias is converted once, not per sample
    assert [p.seed for p in params] == [7, 8, 9]                   # samples must differ
    assert {p.logit_bias for p in params} == {((300, 100.0), (5, -1.0))}
    unseeded = gen.sampling_params(generation.RequestedSampling(), 10, 2)
    assert [p.seed for p in unseeded] == [None, None]
    with pytest.raises(generation.APIError, match="outside the vocabulary"):
        gen.sampling_params(generation.RequestedSampling(logit_bias={"99999": 1}), 10, 2)
