"""Tool calling: parsing each format, rendering tools through a chat template, and the three APIs end to end
with the official `openai` and `anthropic` clients over a stand-in engine that writes a scripted reply."""

from __future__ import annotations

import asyncio
import json

import anthropic
import openai
import pytest

from flare.engine.stats import EngineStats
from flare.engine.outputs import RequestOutput
from flare.frontend.chat_template import ChatTemplate, ChatTemplateError
from flare.frontend.tool_parsers import ToolCallStream, get_parser, parser_name_for_directory
from flare.server.app import build_app
from flare.server.frontend import ServingFrontend
from flare.server.settings import ServerSettings
from tests.server.conftest import ThreadServer

# A small template in the hermes style of Qwen-family models: tool signatures in the system turn,
# calls as <tool_call> JSON in the assistant turn, results as <tool_response> in a user turn.
HERMES_TEMPLATE = """
{%- if tools %}<|im_start|>system
{% if messages[0].role == 'system' %}{{ messages[0].content }}

{% endif %}Functions you may call:
<tools>
{% for tool in tools %}{{ tool | tojson }}
{% endfor %}</tools>
To call one, answer <tool_call>{"name": NAME, "arguments": ARGS}</tool_call>.<|im_end|>
{% elif messages[0].role == 'system' %}<|im_start|>system
{{ messages[0].content }}<|im_end|>
{% endif %}
{%- for message in messages %}
{%- if message.role == 'tool' %}<|im_start|>user
<tool_response>
{{ message.content }}
</tool_response><|im_end|>
{% elif message.role == 'assistant' %}<|im_start|>assistant
{%- if message.content %}{{ '\n' + message.content }}{% endif %}
{%- for call in message.tool_calls or [] %}
{{- '\n<tool_call>\n{"name": "' + call.function.name + '", "arguments": ' }}
{{- call.function.arguments | tojson }}}
</tool_call>
{%- endfor %}<|im_end|>
{% elif message.role != 'system' %}<|im_start|>{{ message.role }}
{{ message.content }}<|im_end|>
{% endif %}
{%- endfor %}
{%- if add_generation_prompt %}<|im_start|>assistant
{% endif %}"""

NO_TOOLS_TEMPLATE = ("{% for message in messages %}<|im_start|>{{ message.role }}\n{{ message.content }}<|im_end|>\n"
                     "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")

WEATHER_CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "C"}}\n</tool_call>'
WEATHER_TOOL = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}, "unit": {"type": "string"}},
                   "required": ["city"]}}}


# ---- parsers ------------------------------------------------------------------------------------

def test_hermes_single_call_with_text_before():
    parsed = get_parser("hermes").parse("Let me look.\n" + WEATHER_CALL)
    assert parsed.text == "Let me look.\n"
    assert [(c.name, c.input) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris", "unit": "C"})]


def test_hermes_several_calls_and_an_unclosed_last_one():
    text = ('<tool_call>{"name": "a", "arguments": {"x": 1}}</tool_call>\n'
            '<tool_call>{"name": "b", "arguments": {}}</tool_call>\n<tool_call>{"name": "c", "arguments": {"y": [2]}}')
    parsed = get_parser("hermes").parse(text)
    assert parsed.text == ""
    assert [(c.name, c.input) for c in parsed.tool_calls] == [("a", {"x": 1}), ("b", {}), ("c", {"y": [2]})]


@pytest.mark.parametrize("text", ['<tool_call>{"name": "a", "arguments": {x}}</tool_call>',
                                  '<tool_call>{"arguments": {}}</tool_call>',
                                  '<tool_call>["a"]</tool_call>', 'use <tool_call> tags'])
def test_hermes_malformed_stays_text(text):
    parsed = get_parser("hermes").parse(text)
    assert parsed.text == text and parsed.tool_calls == ()


def test_llama3_json_calls():
    parser = get_parser("llama3_json")
    one = parser.parse('{"name": "get_weather", "parameters": {"city": "Paris"}}')
    assert [(c.name, c.input) for c in one.tool_calls] == [("get_weather", {"city": "Paris"})]
    two = parser.parse('<|python_tag|>{"name": "a", "parameters": {"x": 1}}; {"name": "b", "parameters": {}}')
    assert [(c.name, c.input) for c in two.tool_calls] == [("a", {"x": 1}), ("b", {})]
    before = parser.parse('Sure.\n{"name": "a", "arguments": {"x": 1}}')
    assert before.text == "Sure.\n" and before.tool_calls[0].name == "a"
    for text in ('{"name": "a", "parameters": {x: 1}}', '{"name": "a", "parameters": 3}', "plain {braces}"):
        assert parser.parse(text).text == text and not parser.parse(text).tool_calls


def test_mistral_calls():
    parser = get_parser("mistral")
    listed = parser.parse('[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}}, {"name": "b", "arguments": {}}]')
    assert [(c.name, c.input) for c in listed.tool_calls] == [("a", {"x": 1}), ("b", {})]
    newer = parser.parse('Checking.[TOOL_CALLS]a[ARGS]{"x": 1}[TOOL_CALLS]b[ARGS]{}')
    assert newer.text == "Checking." and [(c.name, c.input) for c in newer.tool_calls] == [("a", {"x": 1}), ("b", {})]
    broken = '[TOOL_CALLS][{"name": "a", "arguments": {"x": 1}'
    assert parser.parse(broken).text == broken and not parser.parse(broken).tool_calls


def test_arguments_are_a_json_object_text():
    call = get_parser("hermes").parse('<tool_call>{"name": "a", "arguments": "{\\"q\\": \\"é\\"}"}</tool_call>')
    assert json.loads(call.tool_calls[0].arguments) == {"q": "é"}


def test_stream_splitter_shows_text_and_holds_the_call():
    stream = ToolCallStream(get_parser("hermes"))
    shown = [stream.feed(piece) for piece in ["Let me ", "look.<tool", "_call>\n{\"name\": \"a\", ",
                                               "\"arguments\": {}}", "</tool_call>"]]
    assert "".join(shown) == "Let me look."
    assert shown[1] == "look."                     # "<tool" might begin a call: held back
    parsed = stream.finish()
    assert parsed.text == "" and [c.name for c in parsed.tool_calls] == ["a"]


def test_stream_splitter_releases_a_malformed_call_as_text():
    stream = ToolCallStream(get_parser("hermes"))
    shown = stream.feed("a <tool_call>{broken")
    assert shown == "a "
    assert stream.finish().text == "<tool_call>{broken"
    plain = ToolCallStream(get_parser("hermes"))
    assert plain.feed("x <tool") == "x " and plain.finish().text == "<tool"


def test_parser_follows_the_recipe_family(tmp_path, stories260k):
    assert parser_name_for_directory(stories260k) == "llama3_json"          # LlamaForCausalLM: the llama recipe
    for architecture, expected in [("Qwen2ForCausalLM", "hermes"), ("Qwen3ForCausalLM", "hermes"),
                                   ("MistralForCausalLM", "mistral"), ("SomethingElse", "hermes")]:
        (tmp_path / "config.json").write_text(json.dumps({"architectures": [architecture]}))
        assert parser_name_for_directory(tmp_path) == expected
    assert parser_name_for_directory(tmp_path / "missing") == "hermes"


# ---- rendering ----------------------------------------------------------------------------------

def test_tools_and_tool_history_render_in_the_hugging_face_shape():
    template = ChatTemplate(HERMES_TEMPLATE)
    assert template.supports_tools
    text = template.render([
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_1", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21}'}], tools=[WEATHER_TOOL])
    assert "Be brief.\n\nFunctions you may call:\n<tools>\n" + json.dumps(WEATHER_TOOL) in text
    assert '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>' in text
    assert text.endswith('<tool_response>\n{"temp": 21}\n</tool_response><|im_end|>\n<|im_start|>assistant\n')


def test_template_without_tools_refuses_them_and_reads_history_as_text():
    template = ChatTemplate(NO_TOOLS_TEMPLATE)
    assert not template.supports_tools
    with pytest.raises(ChatTemplateError, match="does not support tools"):
        template.render([{"role": "user", "content": "hi"}], tools=[WEATHER_TOOL])
    text = template.render([
        {"role": "user", "content": "Weather?"},
        {"role": "assistant", "content": "", "tool_calls": [{"id": "c", "type": "function", "function": {
            "name": "get_weather", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "tool_call_id": "c", "content": "21C"}, {"role": "user", "content": "Thanks"}])
    assert '[tool call get_weather: {"city": "Paris"}]' in text
    assert "<|im_start|>user\n[tool result]: 21C\n\nThanks<|im_end|>" in text


# ---- end to end ---------------------------------------------------------------------------------

class ScriptedEngine:
    """Replies with `script` (pieces of text, one output each) and remembers the last prompt."""

    def __init__(self) -> None:
        self.script: list[str] = []
        self.finish_reason = "stop"
        self.prompts: list[list[int]] = []
        self.params = []

    async def generate(self, request_id, prompt_token_ids, params):
        self.prompts.append(list(prompt_token_ids))
        self.params.append(params)
        for step, piece in enumerate(self.script):
            await asyncio.sleep(0)
            last = step + 1 == len(self.script)
            yield RequestOutput(request_id, (1,), piece, (), finished=last, finish_reason=self.finish_reason if last else None,
                                num_prompt_tokens=len(prompt_token_ids), num_output_tokens=step + 1)

    def abort(self, request_id):
        pass

    def stats(self):
        return EngineStats(num_running=0, num_waiting=0, kv_pages_used=0, kv_pages_total=64, num_preemptions=0)

    dead_reason = None

    def shutdown(self) -> None:
        pass


def _server(stories260k, tmp_path_factory, template: ChatTemplate):
    frontend = ServingFrontend.from_dir(stories260k)
    frontend.chat_template = template
    engine = ScriptedEngine()
    settings = ServerSettings(served_names=("tiny",), canonical_id="org/Tiny", max_model_len=4096,
                              max_concurrency=4, kv_tokens=65536)
    server = ThreadServer(build_app(engine, frontend, settings))
    server.engine, server.frontend = engine, frontend
    return server


@pytest.fixture(scope="module")
def served(stories260k, tmp_path_factory):
    with _server(stories260k, tmp_path_factory, ChatTemplate(HERMES_TEMPLATE, tool_parser="hermes")) as server:
        yield server


@pytest.fixture
def oai(served):
    return openai.OpenAI(base_url=served.url + "/v1", api_key="none", max_retries=0)


@pytest.fixture
def claude(served):
    return anthropic.Anthropic(base_url=served.url, api_key="none", max_retries=0)


def _script(served, text: str, size: int = 7, finish_reason: str = "stop") -> None:
    served.engine.script = [text[i:i + size] for i in range(0, len(text), size)]
    served.engine.finish_reason = finish_reason


def _last_prompt(served) -> str:
    return served.frontend.decode(served.engine.prompts[-1])


QUESTION = [{"role": "user", "content": "Weather in Paris?"}]


def test_openai_chat_returns_tool_calls(oai, served):
    _script(served, "Let me check.\n" + WEATHER_CALL)
    reply = oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL])
    choice = reply.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == "Let me check.\n"
    call = choice.message.tool_calls[0]
    assert call.id.startswith("call_") and call.type == "function"
    assert call.function.name == "get_weather"
    assert json.loads(call.function.arguments) == {"city": "Paris", "unit": "C"}
    assert "<tools>\n" + json.dumps(WEATHER_TOOL) in _last_prompt(served)


def test_openai_chat_streams_text_then_the_call(oai, served):
    _script(served, "Let me check.\n" + WEATHER_CALL + "\n" + WEATHER_CALL.replace("Paris", "Lyon"), size=5)
    chunks = list(oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL], stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Let me check.\n"
    first_call = next(i for i, c in enumerate(chunks) if c.choices[0].delta.tool_calls)
    assert all(not c.choices[0].delta.tool_calls for c in chunks[:first_call])
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    with oai.chat.completions.stream(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL]) as stream:
        final = stream.get_final_completion()
    calls = final.choices[0].message.tool_calls
    assert [json.loads(c.function.arguments)["city"] for c in calls] == ["Paris", "Lyon"]
    assert calls[0].id != calls[1].id and all(c.function.name == "get_weather" for c in calls)


def test_openai_chat_parallel_tool_calls_false_keeps_one(oai, served):
    _script(served, WEATHER_CALL + WEATHER_CALL.replace("Paris", "Lyon"))
    reply = oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL],
                                        parallel_tool_calls=False)
    assert len(reply.choices[0].message.tool_calls) == 1


def test_openai_chat_follow_up_renders_the_tool_result(oai, served):
    _script(served, "It is 21 degrees.")
    reply = oai.chat.completions.create(model="tiny", tools=[WEATHER_TOOL], messages=QUESTION + [
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": '{"temp": 21}'}])
    assert reply.choices[0].message.content == "It is 21 degrees."
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    prompt = _last_prompt(served)
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n'
            '</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>') in prompt


def test_openai_chat_malformed_call_is_text(oai, served):
    text = '<tool_call>{"name": "get_weather", "arguments": {city}}</tool_call>'
    _script(served, text)
    reply = oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL])
    assert reply.choices[0].message.content == text
    assert reply.choices[0].finish_reason == "stop" and not reply.choices[0].message.tool_calls
    chunks = list(oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL], stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == text


def test_openai_tool_choice_named_and_required_are_a_grammar(oai, served):
    _script(served, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    reply = oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL],
                                        tool_choice={"type": "function", "function": {"name": "get_weather"}})
    call = reply.choices[0].message.tool_calls[0]
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", {"city": "Oslo"})
    assert reply.choices[0].message.content is None and reply.choices[0].finish_reason == "tool_calls"
    assert _last_prompt(served).endswith("<|im_start|>assistant\n")       # nothing forced into the prompt
    grammar = served.engine.params[-1].grammar
    assert grammar.kind == "structural_tag" and '<tool_call>\\n{\\"name\\": \\"get_weather\\"' in grammar.source
    with pytest.raises(openai.BadRequestError, match="not among the tools"):
        oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL],
                                    tool_choice={"type": "function", "function": {"name": "nope"}})


def test_a_forced_call_cut_short_says_length_and_shows_no_text_streamed_or_not(oai, served):
    _script(served, '<tool_call>\n{"name": "get_weather", "arguments": {"ci', finish_reason="length")
    reply = oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required")
    assert reply.choices[0].message.content is None and not reply.choices[0].message.tool_calls
    assert reply.choices[0].finish_reason == "length"
    chunks = list(oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL],
                                              tool_choice="required", stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == ""
    assert not any(c.choices[0].delta.tool_calls for c in chunks if c.choices)
    assert chunks[-1].choices[0].finish_reason == "length"
    with pytest.raises(openai.BadRequestError, match="stop sequences could end a forced tool call"):
        oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="required",
                                    stop=["}"])


def test_openai_tool_choice_none_leaves_tools_out(oai, served):
    _script(served, WEATHER_CALL)
    reply = oai.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL], tool_choice="none")
    assert reply.choices[0].message.content == WEATHER_CALL and not reply.choices[0].message.tool_calls
    assert "<tools>" not in _last_prompt(served)


def test_anthropic_returns_tool_use(claude, served):
    _script(served, "Checking.\n" + WEATHER_CALL)
    message = claude.messages.create(model="tiny", max_tokens=200, messages=QUESTION, tools=[
        {"name": "get_weather", "description": "Current weather", "input_schema": WEATHER_TOOL["function"]["parameters"]}])
    assert message.stop_reason == "tool_use"
    assert [block.type for block in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Checking.\n"
    use = message.content[1]
    assert use.id.startswith("toolu_") and use.name == "get_weather" and use.input == {"city": "Paris", "unit": "C"}
    assert '"name": "get_weather", "description": "Current weather"' in _last_prompt(served)


def test_anthropic_streams_tool_use(claude, served):
    _script(served, "Checking.\n" + WEATHER_CALL, size=4)
    tools = [{"name": "get_weather", "input_schema": {"type": "object"}}]
    with claude.messages.stream(model="tiny", max_tokens=200, messages=QUESTION, tools=tools) as stream:
        events = [event.type for event in stream]
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    assert final.content[0].type == "text" and final.content[0].text == "Checking.\n"
    assert final.content[1].type == "tool_use" and final.content[1].input == {"city": "Paris", "unit": "C"}
    assert events.index("text") < events.index("input_json")
    _script(served, WEATHER_CALL)                # a reply that is only a call has no text block
    with claude.messages.stream(model="tiny", max_tokens=200, messages=QUESTION, tools=tools) as stream:
        final = stream.get_final_message()
    assert [block.type for block in final.content] == ["tool_use"]


def test_anthropic_follow_up_renders_tool_use_and_result(claude, served):
    _script(served, "21 degrees.")
    message = claude.messages.create(model="tiny", max_tokens=50, tools=[
        {"name": "get_weather", "input_schema": {"type": "object"}}], messages=QUESTION + [
        {"role": "assistant", "content": [{"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                           "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": '{"temp": 21}'}]}]}])
    assert message.stop_reason == "end_turn" and message.content[0].text == "21 degrees."
    prompt = _last_prompt(served)
    assert ('<|im_start|>assistant\nChecking.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}'
            '\n</tool_call><|im_end|>\n<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>') in prompt


def test_anthropic_tool_choice_tool(claude, served):
    _script(served, '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>')
    message = claude.messages.create(model="tiny", max_tokens=50, messages=QUESTION,
                                     tools=[{"name": "get_weather", "input_schema": {"type": "object"}}],
                                     tool_choice={"type": "tool", "name": "get_weather"})
    assert message.content[0].type == "tool_use" and message.content[0].input == {"city": "Oslo"}


def test_responses_function_calls(oai, served):
    tool = {"type": "function", "name": "get_weather", "description": "Current weather",
            "parameters": WEATHER_TOOL["function"]["parameters"]}
    _script(served, WEATHER_CALL)
    response = oai.responses.create(model="tiny", input="Weather in Paris?", tools=[tool])
    call = response.output[0]
    assert call.type == "function_call" and call.name == "get_weather" and call.call_id.startswith("call_")
    assert json.loads(call.arguments) == {"city": "Paris", "unit": "C"}
    _script(served, "Let me see.\n" + WEATHER_CALL, size=6)
    events = list(oai.responses.create(model="tiny", input="Weather in Paris?", tools=[tool], stream=True))
    kinds = [event.type for event in events]
    assert kinds.index("response.output_text.delta") < kinds.index("response.function_call_arguments.delta")
    done = next(e for e in events if e.type == "response.function_call_arguments.done")
    assert json.loads(done.arguments) == {"city": "Paris", "unit": "C"}
    final = events[-1].response
    assert [item.type for item in final.output] == ["message", "function_call"]
    assert final.output[0].content[0].text == "Let me see.\n"
    assert final.output[1].id == done.item_id


def test_responses_follow_up_renders_call_and_output(oai, served):
    _script(served, "21 degrees.")
    response = oai.responses.create(model="tiny", tools=[{"type": "function", "name": "get_weather",
                                                          "parameters": {"type": "object"}}], input=[
        {"role": "user", "content": "Weather in Paris?"},
        {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": '{"temp": 21}'}])
    assert response.output_text == "21 degrees."
    assert ('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call><|im_end|>\n'
            '<|im_start|>user\n<tool_response>\n{"temp": 21}\n</tool_response>') in _last_prompt(served)


def test_a_template_without_tools_is_a_clear_400(stories260k, tmp_path_factory):
    with _server(stories260k, tmp_path_factory, ChatTemplate(NO_TOOLS_TEMPLATE)) as server:
        client = openai.OpenAI(base_url=server.url + "/v1", api_key="none", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="chat template does not support tools"):
            client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL])
        claude = anthropic.Anthropic(base_url=server.url, api_key="none", max_retries=0)
        with pytest.raises(anthropic.BadRequestError, match="does not support tools"):
            claude.messages.create(model="tiny", max_tokens=5, messages=QUESTION,
                                   tools=[{"name": "f", "input_schema": {"type": "object"}}])
        server.engine.script = ["fine"]
        reply = client.chat.completions.create(model="tiny", messages=QUESTION, tools=[WEATHER_TOOL],
                                               tool_choice="none")
        assert reply.choices[0].message.content == "fine"


def test_mistral_history_ids_are_nine_letters_or_digits():
    from flare.frontend.tool_parsers import with_history_ids

    messages = with_history_ids([
        {"role": "assistant", "content": "", "tool_calls": [{"id": "call_0123456789abcdef", "type": "function",
                                                             "function": {"name": "a", "arguments": {}}}]},
        {"role": "tool", "tool_call_id": "call_0123456789abcdef", "content": "x"}], get_parser("mistral"))
    assert messages[0]["tool_calls"][0]["id"] == messages[1]["tool_call_id"] == "789abcdef"
    assert get_parser("mistral").history_call_id("ab") == "0000000ab"
    assert get_parser("hermes").history_call_id("call_1") == "call_1"


def test_stream_splitter_for_llama3_json_and_mistral():
    llama = ToolCallStream(get_parser("llama3_json"))
    assert [llama.feed(piece) for piece in ['{"na', 'me": "a", ', '"parameters": {"x": 1}}']] == ["", "", ""]
    assert [(c.name, c.input) for c in llama.finish().tool_calls] == [("a", {"x": 1})]
    prose = ToolCallStream(get_parser("llama3_json"))
    assert prose.feed("use {braces} here") == "use {braces} here"
    mistral = ToolCallStream(get_parser("mistral"))
    assert mistral.feed("Ok.[TOOL_") == "Ok." and mistral.feed('CALLS][{"name": "b", "arguments": {}}]') == ""
    assert [c.name for c in mistral.finish().tool_calls] == ["b"]


def test_anthropic_count_tokens_counts_the_tools(claude):
    tools = [{"name": "get_weather", "description": "Current weather", "input_schema": {"type": "object"}}]
    with_tools = claude.messages.count_tokens(model="tiny", messages=QUESTION, tools=tools).input_tokens
    without = claude.messages.count_tokens(model="tiny", messages=QUESTION).input_tokens
    assert with_tools > without + 10
