"""`flare run` on the demo model (a reduced build: same tokenizer pipeline and ChatML template), through
the official clients. The demo's template has multi-token special markers, unlike stories260k's none."""

from __future__ import annotations

import dataclasses

import anthropic
import openai
import pytest

from flare.demo.build import ensure_demo_checkpoint
from flare.demo.spec import DemoSpec
from flare.frontend.chat_template import ChatTemplate
from flare.frontend.tokenizer import load_tokenizer
from tests.server.conftest import FlareProcess, export_package

pytestmark = pytest.mark.slow
MESSAGES = [{"role": "system", "content": "You answer questions about Python."},
            {"role": "user", "content": "What is a list?"}]


@pytest.fixture(scope="module")
def demo_checkpoint(tmp_path_factory):
    # a few training steps suffice: these tests are about serving, not about the answers' quality
    # 512 positions: room for a tool list and a forced call beside the prompt
    spec = dataclasses.replace(DemoSpec.reduced(steps=20), max_position_embeddings=512)
    return ensure_demo_checkpoint(tmp_path_factory.mktemp("demo") / "checkpoint", spec, log=lambda line: None)


@pytest.fixture(scope="module")
def server(tmp_path_factory, demo_checkpoint):
    home = tmp_path_factory.mktemp("demo-home")
    export_package(demo_checkpoint, home)
    process = FlareProcess(home, "checkpoint")
    process.start(timeout=300)          # a busy two-core machine can take minutes to spawn the engine
    yield process
    process.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=60)


def test_chat_goes_through_the_packaged_chat_template(oai, demo_checkpoint):
    tokenizer = load_tokenizer(demo_checkpoint)
    rendered = ChatTemplate.from_dir(demo_checkpoint).render(MESSAGES)
    assert rendered.endswith("<|im_start|>assistant\n")
    whole = oai.chat.completions.create(model="checkpoint", messages=MESSAGES, max_tokens=12, temperature=0)
    assert whole.usage.prompt_tokens == len(tokenizer.encode(rendered, add_special_tokens=False))
    chunks = list(oai.chat.completions.create(model="checkpoint", messages=MESSAGES, max_tokens=12,
                                              temperature=0, stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == whole.choices[0].message.content
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens
    assert "<|im_end|>" not in whole.choices[0].message.content       # the end marker stops, unprinted


def test_anthropic_and_responses_on_the_demo(server, oai):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=60)
    message = claude.messages.create(model="checkpoint", max_tokens=12, system=MESSAGES[0]["content"],
                                     messages=[MESSAGES[1]], extra_body={"temperature": 0})
    counted = claude.messages.count_tokens(model="checkpoint", system=MESSAGES[0]["content"], messages=[MESSAGES[1]])
    # the previous test's chat had this prompt: Anthropic's input_tokens leave out what was read from the cache
    assert counted.input_tokens == message.usage.input_tokens + message.usage.cache_read_input_tokens
    chat = oai.chat.completions.create(model="checkpoint", messages=MESSAGES, max_tokens=12, temperature=0)
    assert message.content[0].text == chat.choices[0].message.content    # one conversation, one prompt
    response = oai.responses.create(model="checkpoint", instructions=MESSAGES[0]["content"],
                                    input=MESSAGES[1]["content"], max_output_tokens=12, temperature=0)
    assert response.output_text == chat.choices[0].message.content


def test_n_and_logprobs_on_the_demo(oai):
    reply = oai.chat.completions.create(model="checkpoint", messages=MESSAGES, max_tokens=6, n=2, seed=5,
                                        logprobs=True, top_logprobs=2, extra_body={"ignore_eos": True})
    assert len(reply.choices) == 2 and reply.usage.completion_tokens == 12
    for choice in reply.choices:
        assert len(choice.logprobs.content) == 6
        assert "".join(entry.token for entry in choice.logprobs.content) == choice.message.content


def test_a_forced_tool_call_on_the_demo_matches_the_schema(oai):
    import json

    schema = {"type": "object", "properties": {"q": {"type": "string", "maxLength": 8}}, "required": ["q"]}
    tool = {"type": "function", "function": {"name": "find", "parameters": schema}}
    reply = oai.chat.completions.create(model="checkpoint", messages=[{"role": "user", "content": "A list?"}],
                                        tools=[tool], tool_choice="required", parallel_tool_calls=False,
                                        temperature=0)
    call = reply.choices[0].message.tool_calls[0]
    assert reply.choices[0].finish_reason == "tool_calls" and call.function.name == "find"
    arguments = json.loads(call.function.arguments)
    assert set(arguments) == {"q"} and len(arguments["q"]) <= 8
