"""Reasoning models: the <think> block split off as Chat Completions `reasoning_content`, Anthropic
`thinking` blocks and Responses `reasoning` items, streamed and not, with unmodified clients.

Two ways in: a real served package (`flare run` on a tiny random Qwen3 checkpoint with a Qwen3-style
template), whose reasoning block the Anthropic thinking budget bounds by grammar; and a stand-in engine
that writes a scripted reply through the same routes, reader and streaming code."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest

from flare.engine.outputs import RequestOutput
from flare.frontend.chat_template import ChatTemplate
from flare.server.app import build_app
from flare.server.frontend import ServingFrontend
from flare.server.settings import ServerSettings
from tests.server.conftest import FlareProcess, ThreadServer, export_package
from tests.tiny_checkpoints import write_tiny_checkpoint

# In the style of Qwen3's thinking templates: tools in the system turn (hermes calls), and the reply
# opens its reasoning block in the prompt unless `enable_thinking` is false, when the block is empty.
QWEN3_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}Call one as <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>
{% endif %}
{%- for message in messages %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% if enable_thinking is defined and enable_thinking is false %}<think>

</think>

{% else %}<think>
{% endif %}{% endif %}"""

QUESTION = [{"role": "user", "content": "What is 2 + 2?"}]


# ---- a served package ---------------------------------------------------------------------------

@pytest.fixture(scope="module")
def qwen3_server(tmp_path_factory):
    checkpoint = write_tiny_checkpoint("qwen3", tmp_path_factory.mktemp("qwen3") / "tiny-qwen3",
                                       max_position_embeddings=512)
    config = json.loads((checkpoint / "config.json").read_text())
    assert config["architectures"] == ["Qwen3ForCausalLM"]
    (checkpoint / "chat_template.jinja").write_text(QWEN3_TEMPLATE)
    home = tmp_path_factory.mktemp("qwen3-home")
    export_package(checkpoint, home)
    process = FlareProcess(home, "tiny-qwen3")
    process.start(timeout=300)
    yield process
    process.stop()


@pytest.mark.slow
def test_anthropic_thinking_budget_bounds_the_block_and_streams_the_same(qwen3_server):
    claude = anthropic.Anthropic(base_url=qwen3_server.url, api_key="unused", max_retries=0, timeout=120)
    kwargs = dict(model="tiny-qwen3", max_tokens=60, messages=QUESTION, extra_body={"temperature": 0},
                  thinking={"type": "enabled", "budget_tokens": 6})
    message = claude.messages.create(**kwargs)
    assert message.content[0].type == "thinking" and message.content[0].thinking
    assert "</think>" not in message.content[0].thinking
    assert all(block.type == "text" and "<think>" not in block.text for block in message.content[1:])
    with claude.messages.stream(**kwargs) as stream:
        kinds = [event.type for event in stream]
        streamed = stream.get_final_message()
    assert [block.model_dump() for block in streamed.content] == [block.model_dump() for block in message.content]
    assert "thinking" in kinds and "signature" in kinds
    disabled = claude.messages.create(**dict(kwargs, thinking={"type": "disabled"}))
    assert all(block.type == "text" for block in disabled.content)
    counted = [claude.messages.count_tokens(model="tiny-qwen3", messages=QUESTION, thinking=thinking).input_tokens
               for thinking in ({"type": "enabled", "budget_tokens": 6}, {"type": "disabled"})]
    assert counted[1] > counted[0]          # the template wrote the empty block of enable_thinking=false


@pytest.mark.slow
def test_a_model_that_does_not_reason_refuses_thinking_by_name(qwen3_server, stories260k):
    client = openai.OpenAI(base_url=qwen3_server.url + "/v1", api_key="unused", max_retries=0, timeout=60)
    with pytest.raises(openai.BadRequestError, match="does not read reasoning_effort"):
        client.chat.completions.create(model="tiny-qwen3", messages=QUESTION, reasoning_effort="low", max_tokens=4)


# ---- a stand-in engine writing a scripted reply ---------------------------------------------------

class ScriptedEngine:
    def __init__(self) -> None:
        self.script: list[str] = []

    async def generate(self, request_id, prompt_token_ids, params):
        for step, piece in enumerate(self.script):
            await asyncio.sleep(0)
            last = step + 1 == len(self.script)
            yield RequestOutput(request_id, (1,), piece, (), finished=last, finish_reason="stop" if last else None,
                                num_prompt_tokens=len(prompt_token_ids), num_output_tokens=step + 1)

    def abort(self, request_id):
        pass

    def stats(self):
        return {"num_running": 0, "num_waiting": 0, "kv_cache_usage": 0.0}


REPLY = "Two and two.\nThat is 4.\n</think>\n\nThe answer is 4."
CALL_REPLY = ('I should call <tool_call> the tool.</think>\n\n<tool_call>\n{"name": "add", "arguments": '
              '{"a": 2, "b": 2}}\n</tool_call>')
ADD_TOOL = {"type": "function", "function": {"name": "add", "parameters": {
    "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "integer"}}}}}


@pytest.fixture(scope="module")
def scripted(stories260k):
    frontend = ServingFrontend.from_dir(stories260k)
    frontend.chat_template = ChatTemplate(QWEN3_TEMPLATE, tool_parser="hermes", reasoning_parser="qwen3")
    engine = ScriptedEngine()
    settings = ServerSettings(served_names=("tiny",), canonical_id="org/Tiny", max_model_len=4096,
                              max_concurrency=4, kv_tokens=65536)
    with ThreadServer(build_app(engine, frontend, settings)) as server:
        server.engine = engine
        yield server


def _script(server, text: str, size: int = 3) -> None:
    server.engine.script = [text[i:i + size] for i in range(0, len(text), size)]


def test_chat_reasoning_content_streamed_as_deltas_and_not(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="none", max_retries=0)
    _script(scripted, REPLY)
    message = client.chat.completions.create(model="tiny", messages=QUESTION).choices[0].message
    assert message.content == "The answer is 4."
    assert message.model_extra["reasoning_content"] == "Two and two.\nThat is 4.\n"
    chunks = list(client.chat.completions.create(model="tiny", messages=QUESTION, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    reasoning = "".join(d.model_extra.get("reasoning_content") or "" for d in deltas)
    assert reasoning == message.model_extra["reasoning_content"]
    assert sum(1 for d in deltas if d.model_extra.get("reasoning_content")) > 1      # deltas, not one block
    assert "".join(d.content or "" for d in deltas) == "The answer is 4."


def test_reasoning_and_a_tool_call_stay_apart(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="none", max_retries=0)
    for stream in (False, True):
        _script(scripted, CALL_REPLY)
        if stream:
            with client.chat.completions.stream(model="tiny", messages=QUESTION, tools=[ADD_TOOL]) as events:
                final = events.get_final_completion()
        else:
            final = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[ADD_TOOL])
        message = final.choices[0].message
        assert message.model_extra["reasoning_content"] == "I should call <tool_call> the tool."
        assert not message.content
        assert [(c.function.name, json.loads(c.function.arguments)) for c in message.tool_calls] == [
            ("add", {"a": 2, "b": 2})]


def test_anthropic_thinking_blocks(scripted):
    claude = anthropic.Anthropic(base_url=scripted.url, api_key="none", max_retries=0)
    _script(scripted, REPLY)
    message = claude.messages.create(model="tiny", max_tokens=50, messages=QUESTION)
    assert [block.type for block in message.content] == ["thinking", "text"]
    assert message.content[0].thinking == "Two and two.\nThat is 4.\n"
    assert message.content[1].text == "The answer is 4."
    with claude.messages.stream(model="tiny", max_tokens=50, messages=QUESTION) as stream:
        final = stream.get_final_message()
    assert [block.model_dump() for block in final.content] == [block.model_dump() for block in message.content]


def test_responses_reasoning_item(scripted):
    client = openai.OpenAI(base_url=scripted.url + "/v1", api_key="none", max_retries=0)
    _script(scripted, REPLY)
    response = client.responses.create(model="tiny", input="What is 2 + 2?")
    assert [item.type for item in response.output] == ["reasoning", "message"]
    assert response.output[0].content[0].text == "Two and two.\nThat is 4.\n"
    assert response.output_text == "The answer is 4."
    events = list(client.responses.create(model="tiny", input="What is 2 + 2?", stream=True))
    kinds = [event.type for event in events]
    assert kinds.index("response.reasoning_text.delta") < kinds.index("response.output_text.delta")
    final = events[-1].response
    assert [item.type for item in final.output] == ["reasoning", "message"]
    assert final.output[0].content[0].text == response.output[0].content[0].text
    assert final.output_text == "The answer is 4."
    indices = {e.output_index for e in events if e.type == "response.output_item.added"}
    assert indices == {0, 1}
