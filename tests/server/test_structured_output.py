"""Constrained replies through a real served package (`flare run` on stories260k with the demo's tool
template), with unmodified clients: the model's own sampling, masked by xgrammar in the engine core."""

from __future__ import annotations

import json
import shutil
from enum import Enum

import anthropic
import openai
import pytest
from pydantic import BaseModel, Field

from flare.demo.tokenizer import chat_template
from tests.server.conftest import FlareProcess, export_package

pytestmark = pytest.mark.slow


class Color(str, Enum):
    red = "red"
    blue = "blue"


class Pet(BaseModel):
    name: str = Field(max_length=12)
    legs: int = Field(ge=0, le=8)
    color: Color


WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                            "unit": {"enum": ["C", "F"]}},
           "required": ["city", "unit"], "additionalProperties": False}
WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "Weather",
                                                 "parameters": WEATHER}}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class Weather(BaseModel):
    model_config = {"extra": "forbid"}
    city: str = Field(max_length=10)
    unit: str = Field(pattern="^(C|F)$")


@pytest.fixture(scope="module")
def server(tmp_path_factory, stories260k):
    checkpoint = tmp_path_factory.mktemp("tools-model") / "stories-tools"
    shutil.copytree(stories260k, checkpoint, ignore=shutil.ignore_patterns("reference"))
    (checkpoint / "chat_template.jinja").write_text(chat_template())
    # Room for the tools' system turn and a forced call spelled in this small vocabulary's short tokens
    # (the grammar keeps the replies valid past the context the model was trained on).
    config = json.loads((checkpoint / "config.json").read_text())
    (checkpoint / "config.json").write_text(json.dumps(dict(config, max_position_embeddings=2048)))
    home = tmp_path_factory.mktemp("structured-home")
    export_package(checkpoint, home)
    process = FlareProcess(home, "stories-tools")
    process.start(timeout=300)
    yield process
    process.stop()


@pytest.fixture
def oai(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)


def test_chat_parse_gives_the_pydantic_model(oai):
    messages = [{"role": "user", "content": "Describe a pet."}]
    reply = oai.chat.completions.parse(model="stories-tools", messages=messages, response_format=Pet,
                                       max_tokens=120, temperature=0)
    assert isinstance(reply.choices[0].message.parsed, Pet)
    with oai.chat.completions.stream(model="stories-tools", messages=messages, response_format=Pet,
                                     max_tokens=120, temperature=0.8, seed=1) as stream:
        final = stream.get_final_completion()
    assert isinstance(final.choices[0].message.parsed, Pet)


def test_json_object_is_a_json_object(oai):
    reply = oai.chat.completions.create(model="stories-tools", messages=[{"role": "user", "content": "Hi"}],
                                        response_format={"type": "json_object"}, max_tokens=80, temperature=0)
    content = reply.choices[0].message.content
    assert content.startswith("{")                   # the story model left alone writes prose
    if reply.choices[0].finish_reason == "stop":
        assert isinstance(json.loads(content), dict)


def test_responses_parse_streamed_and_not(oai):
    response = oai.responses.parse(model="stories-tools", input="Describe a pet.", text_format=Pet,
                                   max_output_tokens=120, temperature=0)
    assert isinstance(response.output_parsed, Pet)
    assert response.text.format.type == "json_schema"
    with oai.responses.stream(model="stories-tools", input="Describe a pet.", text_format=Pet,
                              max_output_tokens=120, temperature=0.7) as stream:
        final = stream.get_final_response()
    assert isinstance(final.output_parsed, Pet)


def test_schemas_no_grammar_enforces_are_a_400_naming_the_part(oai):
    schema = {"type": "object", "properties": {"when": {"type": "string", "format": "fortnight"}}}
    with pytest.raises(openai.BadRequestError, match="#/properties/when: string format 'fortnight'"):
        oai.chat.completions.create(model="stories-tools", messages=QUESTION, response_format={
            "type": "json_schema", "json_schema": {"name": "x", "schema": schema}})
    with pytest.raises(openai.BadRequestError, match=r"text\.format\.schema: .*\$defs"):
        oai.responses.create(model="stories-tools", input="x", text={"format": {
            "type": "json_schema", "name": "x", "schema": {"$ref": "#/$defs/missing"}}})


def test_required_tool_loop_validates_against_the_schema(oai):
    for stream in (False, True):
        messages = list(QUESTION)
        # one call: left to itself this small model would go on calling until max_tokens
        kwargs = dict(model="stories-tools", tools=[WEATHER_TOOL], tool_choice="required", max_tokens=200,
                      parallel_tool_calls=False,
                      temperature=0.9, seed=7)
        if stream:
            with oai.chat.completions.stream(messages=messages, **kwargs) as events:
                reply = events.get_final_completion()
        else:
            reply = oai.chat.completions.create(messages=messages, **kwargs)
        choice = reply.choices[0]
        assert choice.finish_reason == "tool_calls" and not choice.message.content
        call = choice.message.tool_calls[0]
        assert call.function.name == "get_weather"
        Weather.model_validate_json(call.function.arguments)
        messages += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
                     {"role": "tool", "tool_call_id": call.id, "content": '{"temp": 21}'}]
        answer = oai.chat.completions.create(model="stories-tools", messages=messages, max_tokens=8, temperature=0)
        assert answer.choices[0].finish_reason in ("stop", "length", "tool_calls")


def test_anthropic_forced_tool_through_a_tool_result(server):
    claude = anthropic.Anthropic(base_url=server.url, api_key="unused", max_retries=0, timeout=120)
    tools = [{"name": "get_weather", "description": "Weather", "input_schema": WEATHER}]
    for stream in (False, True):
        kwargs = dict(model="stories-tools", max_tokens=200, tools=tools,
                      tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True},
                      messages=QUESTION)
        if stream:
            with claude.messages.stream(**kwargs) as events:
                message = events.get_final_message()
        else:
            message = claude.messages.create(**kwargs)
        assert message.stop_reason == "tool_use"
        assert [block.type for block in message.content] == ["tool_use"]
        use = message.content[0]
        Weather.model_validate(use.input)
        follow_up = claude.messages.create(model="stories-tools", max_tokens=8, messages=QUESTION + [
            {"role": "assistant", "content": [use.model_dump()]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "21 C"}]}])
        assert follow_up.content and follow_up.stop_reason in ("end_turn", "max_tokens", "tool_use")


def test_langchain_with_structured_output(server):
    from langchain_openai import ChatOpenAI

    model = ChatOpenAI(base_url=server.url + "/v1", api_key="unused", model="stories-tools", temperature=0,
                       max_tokens=200, max_retries=0)
    for method in ("json_schema", "function_calling"):
        structured = model.with_structured_output(Pet, method=method)
        pet = structured.invoke("Describe a pet.")
        assert isinstance(pet, Pet)
        streamed = list(structured.stream("Describe a pet."))     # partial objects, then the whole one
        assert streamed and streamed[-1] == pet


def test_vllm_structured_outputs_on_completions_and_chat(oai):
    for _ in range(2):
        done = oai.completions.create(model="stories-tools", prompt="Once upon a time", max_tokens=10,
                                      extra_body={"structured_outputs": {"choice": ["yes", "no way"]}})
        assert done.choices[0].text in ("yes", "no way") and done.choices[0].finish_reason == "stop"
    reply = oai.chat.completions.create(model="stories-tools", messages=[{"role": "user", "content": "Pick."}],
                                        max_tokens=20, extra_body={"structured_outputs": {"regex": "[0-9]{3}-[a-c]"}})
    assert __import__("re").fullmatch("[0-9]{3}-[a-c]", reply.choices[0].message.content)
    with pytest.raises(openai.BadRequestError, match="structured_outputs takes one constraint"):
        oai.chat.completions.create(model="stories-tools", messages=QUESTION, extra_body={
            "structured_outputs": {"regex": "a", "choice": ["b"]}})
