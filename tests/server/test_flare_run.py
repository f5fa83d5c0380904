"""`flare run` on an exported stories260k package, driven by the official OpenAI and Anthropic clients.

One server for the module (the real engine, on the CPU); the last test stops it with SIGTERM.
"""

from __future__ import annotations

import asyncio
import json
import random
import re
import signal
import threading
import time

import anthropic
import httpx
import openai
import pytest

from tests.server.conftest import FlareProcess, export_package

KEY = "sk-flare-test"
ALIAS = "tiny-stories"
PROMPT = "Once upon a time, there was a little girl"


@pytest.fixture(scope="module")
def home(tmp_path_factory):
    return tmp_path_factory.mktemp("flare-home")


@pytest.fixture(scope="module")
def server(home, stories260k):
    export_package(stories260k, home, "--max-concurrency", "32")
    key_file = home / "api-key"
    key_file.write_text(KEY + "\n")
    process = FlareProcess(home, "stories260k", "--served-model-name", ALIAS, "--api-key-file", str(key_file),
                           "--verify-weights")
    process.start()
    yield process
    process.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=60)


@pytest.fixture
def claude(server):
    return anthropic.Anthropic(base_url=server.url, api_key=KEY, max_retries=0, timeout=60)


def engine_stats(server) -> dict:
    return httpx.get(server.url + "/v1/engine/stats", headers={"x-api-key": KEY}).json()


def wait_idle(server, timeout: float = 10) -> dict:
    deadline = time.monotonic() + timeout
    while True:
        stats = engine_stats(server)
        idle = (stats["num_running"], stats["num_waiting"]) == (0, 0)
        # The page check follows the outputs of the step that went idle, in the engine's next message.
        if (idle and stats["page_integrity"] != "unchecked") or time.monotonic() > deadline:
            return stats


def greedy(oai, prompt: str, max_tokens: int) -> openai.types.Completion:
    return oai.completions.create(model=ALIAS, prompt=prompt, max_tokens=max_tokens, temperature=0, logprobs=0,
                                  extra_body={"ignore_eos": True})


def test_startup_shows_stages_and_the_kv_report(server):
    log = server.log
    for stage in ("Verify package", "Publisher acceptance", "Verify stored data", "Load weights",
                  "Prepare kernels and graphs", "Allocate caches", "Load frontend", "Start HTTP"):
        assert f"{stage}: OK" in log
    assert "all weights" in log                        # --verify-weights hashed them
    # Where loading went: starting the engine process, then reading the weights.
    assert re.search(r"Load weights: OK .* in the engine process \(process start \d+\.\d s, weights \d+\.\d s\)", log)
    assert "\x1b[" not in log                          # redirected output: plain lines only
    assert "KV cache:" in log and "tokens allocated" in log
    assert re.search(r"limited by (memory|context|concurrency)\b", log)   # which limit bound the pool
    assert "scheduler balanced" in log and "footprint:" in log


def test_models_and_the_served_name(oai):
    cards = oai.models.list().data
    assert [card.id for card in cards] == [ALIAS]
    assert cards[0].root == "stories260k"
    reply = oai.chat.completions.create(model="stories260k", messages=[{"role": "user", "content": "Hi"}],
                                        max_tokens=4)                  # the canonical id is still accepted
    assert reply.model == "stories260k"


def test_chat_streamed_and_not_agree(oai):
    messages = [{"role": "system", "content": "You tell stories."}, {"role": "user", "content": "A story, please."}]
    whole = oai.chat.completions.create(model=ALIAS, messages=messages, max_tokens=24, temperature=0)
    stream = oai.chat.completions.create(model=ALIAS, messages=messages, max_tokens=24, extra_body={"temperature": 0},
                                         stream=True, stream_options={"include_usage": True})
    chunks = list(stream)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content and text.strip()
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert chunks[-1].usage.prompt_tokens == whole.usage.prompt_tokens
    assert chunks[-2].choices[0].finish_reason == whole.choices[0].finish_reason


def test_multi_turn_and_developer_role(oai):
    reply = oai.chat.completions.create(model=ALIAS, max_completion_tokens=8, messages=[
        {"role": "developer", "content": "Be kind."}, {"role": "user", "content": "Hello"},
        {"role": "assistant", "content": "Hi there."}, {"role": "user", "content": "Tell me more."}])
    assert reply.usage.completion_tokens <= 8 and reply.choices[0].message.role == "assistant"


def test_n_returns_distinct_choices_with_usage_over_all(oai):
    reply = oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Go"}], n=2,
                                        max_tokens=16, temperature=1.0, seed=7,
                                        extra_body={"ignore_eos": True})
    assert [c.index for c in reply.choices] == [0, 1]
    assert reply.usage.completion_tokens == 32
    assert reply.choices[0].message.content != reply.choices[1].message.content
    again = oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Go"}], n=2,
                                        max_tokens=16, temperature=1.0, seed=7,
                                        extra_body={"ignore_eos": True})
    assert [c.message.content for c in again.choices] == [c.message.content for c in reply.choices]


def test_stop_string_spanning_tokens(oai):
    reference = greedy(oai, PROMPT, 40).choices[0]
    offsets, tokens = reference.logprobs.text_offset, reference.logprobs.tokens
    text = reference.text
    base = offsets[0]
    # a stop string that starts inside one token and ends inside a later one
    index = next(i for i in range(4, len(tokens) - 3) if len(tokens[i]) >= 2 and len(tokens[i + 2]) >= 2)
    start = offsets[index] - base + 1
    end = offsets[index + 2] - base + 1
    stop = text[start:end]
    assert text.index(stop) == start, "the reference must not contain the stop string earlier"
    stopped = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=40, temperature=0, stop=[stop],
                                     extra_body={"ignore_eos": True}).choices[0]
    assert stopped.text == text[:start]
    assert stopped.finish_reason == "stop"
    streamed = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=40, temperature=0, stop=stop,
                                      stream=True, extra_body={"ignore_eos": True})
    assert "".join(chunk.choices[0].text for chunk in streamed if chunk.choices) == text[:start]


def test_chat_logprobs(oai):
    reply = oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "Story"}],
                                        max_tokens=12, temperature=0, logprobs=True, top_logprobs=3,
                                        extra_body={"ignore_eos": True})
    entries = reply.choices[0].logprobs.content
    assert len(entries) == reply.usage.completion_tokens == 12
    assert "".join(entry.token for entry in entries) == reply.choices[0].message.content
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        values = [top.logprob for top in entry.top_logprobs]
        assert values == sorted(values, reverse=True) and values[0] <= 0.0
        assert entry.top_logprobs[0].token == entry.token                  # greedy picks the best
        assert entry.bytes == list(entry.token.encode())


def test_completions_echo_with_logprobs(oai):
    reply = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=6, temperature=0, echo=True,
                                   logprobs=2, extra_body={"ignore_eos": True})
    choice = reply.choices[0]
    assert choice.text.startswith(PROMPT) and len(choice.text) > len(PROMPT)
    assert len(choice.logprobs.tokens) == reply.usage.prompt_tokens + reply.usage.completion_tokens
    assert choice.logprobs.token_logprobs[0] is None            # nothing scores the first prompt token
    assert all(value <= 0.0 for value in choice.logprobs.token_logprobs[1:])
    plain = greedy(oai, PROMPT, 6).choices[0]
    assert choice.text == PROMPT + plain.text


def test_responses_streamed_and_not(oai):
    whole = oai.responses.create(model=ALIAS, instructions="Tell a story.", max_output_tokens=16, extra_body={"temperature": 0},
                                 input=[{"role": "user", "content": [{"type": "input_text", "text": "Go on"}]}])
    assert whole.output_text.strip() and whole.usage.output_tokens <= 16
    events = list(oai.responses.create(model=ALIAS, instructions="Tell a story.", max_output_tokens=16,
                                       temperature=0, stream=True,
                                       input=[{"role": "user", "content": "Go on"}]))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert deltas == whole.output_text
    assert [e.sequence_number for e in events] == list(range(len(events)))
    assert events[-1].response.output_text == whole.output_text
    with pytest.raises(openai.BadRequestError, match="stateless"):
        oai.responses.create(model=ALIAS, input="more", previous_response_id=whole.id)


def test_anthropic_messages_streamed_and_not(claude):
    messages = [{"role": "system", "content": "Only stories."}, {"role": "user", "content": "A story"}]
    whole = claude.messages.create(model=ALIAS, max_tokens=20, system="You are kind.", extra_body={"temperature": 0},
                                   messages=messages)
    assert whole.content[0].type == "text" and whole.content[0].text.strip()
    assert whole.stop_reason in ("end_turn", "max_tokens")
    with claude.messages.stream(model=ALIAS, max_tokens=20, system="You are kind.", extra_body={"temperature": 0},
                                messages=messages) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.content[0].text == whole.content[0].text
    assert final.usage.output_tokens == whole.usage.output_tokens
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop" and "content_block_stop" in kinds
    counted = claude.messages.count_tokens(model=ALIAS, system="You are kind.", messages=messages)
    # Anthropic's input_tokens leave out what was read from the cache
    assert counted.input_tokens == whole.usage.input_tokens + whole.usage.cache_read_input_tokens


def test_anthropic_stop_sequence(claude, oai):
    reference = claude.messages.create(model=ALIAS, max_tokens=30, extra_body={"temperature": 0},
                                       messages=[{"role": "user", "content": "Once"}]).content[0].text
    stop = reference.strip().split()[3]
    message = claude.messages.create(model=ALIAS, max_tokens=30, extra_body={"temperature": 0}, stop_sequences=[stop],
                                     messages=[{"role": "user", "content": "Once"}])
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop
    assert message.content[0].text == reference[:reference.index(stop)]


def test_auth_is_required_in_each_shape(server):
    with pytest.raises(openai.AuthenticationError):
        openai.OpenAI(base_url=server.url + "/v1", api_key="nope", max_retries=0).models.list()
    with pytest.raises(anthropic.AuthenticationError) as caught:
        anthropic.Anthropic(base_url=server.url, api_key="nope", max_retries=0).messages.create(
            model=ALIAS, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    assert caught.value.body["type"] == "error"
    bearer = httpx.get(server.url + "/v1/models", headers={"Authorization": f"Bearer {KEY}"})
    assert bearer.status_code == 200


def test_bad_input_is_refused_in_the_api_shape(server, oai, claude):
    headers = {"x-api-key": KEY, "content-type": "application/json"}
    broken = httpx.post(server.url + "/v1/chat/completions", content=b'{"model": ', headers=headers)
    assert broken.status_code == 400 and "not valid JSON" in broken.json()["error"]["message"]
    with pytest.raises(openai.BadRequestError, match="temperature"):
        oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": "hi"}],
                                    temperature="warm")
    with pytest.raises(openai.NotFoundError):
        oai.chat.completions.create(model="gpt-4o", messages=[{"role": "user", "content": "hi"}])
    with pytest.raises(openai.BadRequestError) as caught:
        oai.completions.create(model=ALIAS, prompt="the dog ran " * 400, max_tokens=4)
    assert "maximum context length is 512 tokens" in caught.value.message
    with pytest.raises(anthropic.BadRequestError) as caught:
        claude.messages.create(model=ALIAS, max_tokens=1000, messages=[{"role": "user", "content": "hi"}])
    assert "max_tokens" in caught.value.message and "512" in caught.value.message
    huge = json.dumps({"model": ALIAS, "prompt": "a" * (9 << 20)})
    assert httpx.post(server.url + "/v1/completions", content=huge, headers=headers).status_code == 413
    assert httpx.get(server.url + "/health").status_code == 200


def test_disconnect_mid_stream_frees_the_request(server):
    body = {"model": ALIAS, "prompt": PROMPT, "max_tokens": 400, "stream": True, "ignore_eos": True}
    with httpx.stream("POST", server.url + "/v1/completions", json=body, headers={"x-api-key": KEY}) as reply:
        lines = [line for _, line in zip(range(6), reply.iter_lines())]
    assert any(line.startswith("data:") for line in lines)
    stats = wait_idle(server, timeout=5)
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
    assert stats["kv_pages_used"] == 0                 # every page is back (cached pages count as free)
    assert stats["page_integrity"] == "ok"             # the engine's own page check, run as it went idle


@pytest.mark.slow
def test_128_concurrent_streams_deliver_every_token(server):
    async def one(client, index: int, rng: random.Random):
        length = rng.randint(1, 24)
        prompt = " ".join(["the cat sat on the mat"] * rng.randint(1, 4)) + f" {index}"
        stream = await client.chat.completions.create(
            model=ALIAS, messages=[{"role": "user", "content": prompt}], max_tokens=length, logprobs=True,
            stream=True, stream_options={"include_usage": True}, extra_body={"ignore_eos": True})
        tokens, text, usage = 0, "", None
        async for chunk in stream:
            if chunk.usage is not None:
                usage = chunk.usage
            for choice in chunk.choices:
                text += choice.delta.content or ""
                tokens += len(choice.logprobs.content) if choice.logprobs else 0
        return length, tokens, usage.completion_tokens, text

    async def all_of_them():
        client = openai.AsyncOpenAI(base_url=server.url + "/v1", api_key=KEY, max_retries=0, timeout=300,
                                    http_client=openai.DefaultAsyncHttpxClient(
                                        limits=httpx.Limits(max_connections=200)))
        rng = random.Random(1234)
        return await asyncio.gather(*(one(client, i, rng) for i in range(128)))

    results = asyncio.run(all_of_them())
    for length, streamed_tokens, usage_tokens, text in results:
        assert streamed_tokens == usage_tokens == length
    stats = wait_idle(server)
    assert (stats["num_running"], stats["num_waiting"]) == (0, 0)
    assert stats["kv_pages_used"] == 0                 # every page is back (cached pages count as free)
    assert stats["page_integrity"] == "ok"             # the engine's own page check, run as it went idle
    metrics = httpx.get(server.url + "/metrics").text
    assert "flare_time_to_first_token_seconds_count" in metrics and "flare_kv_cache_usage_ratio" in metrics


def scrape(server) -> dict[str, float]:
    """/metrics as {sample name: value}, for samples without labels; each family's kind under "# TYPE name"
    (without the _total a counter's samples carry)."""
    samples = {}
    for line in httpx.get(server.url + "/metrics").text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split()
            samples["# TYPE " + name.removesuffix("_total")] = kind
        elif line and not line.startswith("#") and "{" not in line:
            name, value = line.rsplit(" ", 1)
            samples[name] = float(value)
    return samples


def test_engine_counters_are_prometheus_counters_that_grow(server, oai):
    wait_idle(server)
    before = scrape(server)
    prompt = " ".join(["The little dog ran to the park and played with a red ball."] * 6)
    for _ in range(2):                                 # the second request finds the first one's prompt pages
        oai.chat.completions.create(model=ALIAS, messages=[{"role": "user", "content": prompt}], max_tokens=4,
                                    temperature=0)
    wait_idle(server)
    after = scrape(server)
    for name in ("flare_prefix_cache_hit_tokens", "flare_prefix_cache_miss_tokens",
                 "flare_prefix_cache_evicted_pages", "flare_computed_tokens", "flare_num_preemptions"):
        assert after["# TYPE " + name] == "counter"
        assert after[name + "_total"] >= before[name + "_total"]
    for name in ("flare_prefix_cache_resident_pages", "flare_kv_cache_usage_ratio", "flare_num_requests_running",
                 "flare_num_requests_waiting"):
        assert after["# TYPE " + name] == "gauge"
    assert after["flare_prefix_cache_hit_tokens_total"] - before["flare_prefix_cache_hit_tokens_total"] >= 16
    assert after["flare_prefix_cache_miss_tokens_total"] > before["flare_prefix_cache_miss_tokens_total"]
    assert after["flare_computed_tokens_total"] > before["flare_computed_tokens_total"]
    assert after["flare_prefix_cache_resident_pages"] > 0
    assert after["flare_num_requests_running"] == after["flare_num_requests_waiting"] == 0


def test_a_conversation_reuses_the_previous_turn_from_the_cache(oai, claude):
    system = "You tell short stories about animals who live in a small village by the sea."
    first = [{"role": "user", "content": "Tell me about a cat named Tom who finds a shiny stone on the beach."}]
    turn1 = oai.chat.completions.create(model=ALIAS, messages=[{"role": "system", "content": system}, *first],
                                        max_tokens=48, temperature=0, extra_body={"ignore_eos": True})
    answer = turn1.choices[0].message.content
    second = [*first, {"role": "assistant", "content": answer}, {"role": "user", "content": "What did he do next?"}]
    turn2 = oai.chat.completions.create(model=ALIAS, messages=[{"role": "system", "content": system}, *second],
                                        max_tokens=8, temperature=0)
    cached = turn2.usage.prompt_tokens_details.cached_tokens
    # Turn 2 finds turn 1's whole prompt and most of its answer cached: full pages of 16 tokens are shared,
    # so at most the last partial page and the re-rendered end of the answer are computed again.
    assert cached > turn1.usage.prompt_tokens
    assert cached >= turn1.usage.prompt_tokens + turn1.usage.completion_tokens - 2 * 16
    assert cached < turn2.usage.prompt_tokens

    # The same conversation through the Anthropic API renders the same prompt, and reads it from the cache.
    reply = claude.messages.create(model=ALIAS, system=system, messages=second, max_tokens=8)
    assert reply.usage.cache_read_input_tokens > turn1.usage.prompt_tokens
    assert reply.usage.cache_read_input_tokens + reply.usage.input_tokens >= turn2.usage.prompt_tokens - 16


def test_models_remove_refuses_the_entry_a_server_is_serving(server):
    import subprocess

    from tests.server.conftest import cli_command, cli_env

    entry = next((server.home / ".cache" / "flare" / "packages" / "models").glob("*/*"))
    done = subprocess.run(cli_command("flare", "models", "remove", f"{entry.parent.name}@{entry.name}",
                                      "--clear-default"), env=cli_env(server.home), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 2
    assert "in use by a running process" in done.stderr
    assert entry.is_dir()


def test_sampling_controls_reach_the_sampler(oai):
    reference = greedy(oai, PROMPT, 10).choices[0].text
    top_one = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=10, temperature=1.0, seed=3,
                                     extra_body={"top_k": 1, "ignore_eos": True}).choices[0].text
    assert top_one == reference                                  # top_k 1 leaves only the best token
    forced = oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=5, temperature=0, logprobs=0,
                                    logit_bias={"300": 100}, extra_body={"ignore_eos": True}).choices[0]
    assert len(set(forced.logprobs.tokens)) == 1                  # +100 on one token makes it certain
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=2, logit_bias={"99999": 5})
    with pytest.raises(openai.BadRequestError, match="outside the vocabulary"):
        oai.completions.create(model=ALIAS, prompt=[1, 99999], max_tokens=2)


def test_sigterm_drains_active_requests_then_exits(server, oai):
    """Last in the module: it stops the server. A stream in flight still gets every token."""
    received: list[str] = []
    usage: list[int] = []

    def stream_one():
        for chunk in oai.completions.create(model=ALIAS, prompt=PROMPT, max_tokens=300, stream=True,
                                            stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}):
            received.extend(choice.text for choice in chunk.choices)
            if chunk.usage is not None:
                usage.append(chunk.usage.completion_tokens)

    reader = threading.Thread(target=stream_one)
    reader.start()
    deadline = time.monotonic() + 20
    while not received and time.monotonic() < deadline:
        time.sleep(0.01)
    server.process.send_signal(signal.SIGTERM)
    reader.join(timeout=60)
    assert not reader.is_alive()
    assert usage == [300]
    assert server.process.wait(timeout=60) == 0
    with pytest.raises(httpx.ConnectError):
        httpx.get(server.url + "/health", timeout=2)

