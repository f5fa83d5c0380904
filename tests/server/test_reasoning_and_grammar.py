"""Reading replies: reasoning split off before tool calls (streamed in any pieces as when finished),
and the request-side checks of schemas and formats."""

from __future__ import annotations

import pytest

from flare.frontend.grammar import GrammarError, json_schema_grammar, reply_grammar
from flare.frontend.reasoning import PARSERS
from flare.frontend.reply import ReplyReader
from flare.frontend.tool_grammar import forced_calls_format
from flare.frontend.tool_parsers import ToolRequest, function_tool, get_parser

QWEN3 = PARSERS["qwen3"]
TOOLS = ToolRequest((function_tool("get_weather", None, {"type": "object", "properties": {"city": {"type": "string"}}}),),
                    "required")
REPLY = '<think>\nThe user wants <tool_call> weather.\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>'


def _streamed(reader: ReplyReader, text: str, size: int):
    stream = reader.stream()
    reasoning, shown = "", ""
    for start in range(0, len(text), size):
        r, t = stream.feed(text[start:start + size])
        reasoning, shown = reasoning + r, shown + t
    rest = stream.finish()
    return reasoning + rest.reasoning, shown + rest.text, rest.tool_calls


@pytest.mark.parametrize("size", [1, 3, 7, 1000])
def test_reasoning_and_calls_do_not_leak_into_each_other(size):
    reader = ReplyReader(TOOLS, get_parser("hermes"), QWEN3, False)
    reasoning, text, calls = _streamed(reader, REPLY, size)
    assert reasoning == "The user wants <tool_call> weather.\n" and text == ""
    assert [(c.name, c.input) for c in calls] == [("get_weather", {"city": "Oslo"})]
    assert reader.read(REPLY) == reader.read(REPLY) and reader.read(REPLY).reasoning == reasoning


@pytest.mark.parametrize("size", [1, 2, 5, 1000])
def test_qwen3_splits_reasoning_from_the_answer(size):
    reader = ReplyReader(reasoning=QWEN3)
    assert _streamed(reader, "<think>\nAdd them.\n</think>\n\nIt is 4.", size)[:2] == ("Add them.\n", "It is 4.")
    assert _streamed(reader, "It is 4, no <think> needed.", size)[:2] == ("", "It is 4, no <think> needed.")
    inside = ReplyReader(reasoning=QWEN3, starts_in_reasoning=True)     # the prompt opened the block
    assert _streamed(inside, "Add.</think>4", size)[:2] == ("Add.", "4")
    assert QWEN3.starts_inside("<|im_start|>assistant\n<think>\n") and not QWEN3.starts_inside("x\n</think>\n\n")


def test_deepseek_r1_reasons_until_the_end_tag():
    reader = ReplyReader(reasoning=PARSERS["deepseek_r1"], starts_in_reasoning=True)
    assert reader.read("Hmm.\n</think>\nYes.").reasoning == "Hmm.\n"
    assert reader.read("Still thinking").reasoning == "Still thinking"


def test_forced_call_grammar_with_reasoning_compiles_to_one_structural_tag():
    reader = ReplyReader(TOOLS, get_parser("hermes"), QWEN3, False)
    spec = reply_grammar(None, forced_calls_format(reader.tool_parser, TOOLS), QWEN3.reasoning_format(False))
    assert spec.kind == "structural_tag" and "</think>" in spec.source and "get_weather" in spec.source


@pytest.mark.parametrize("schema, part", [
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "#/properties/a: `not`"),
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "#: `uniqueItems`"),
    ({"allOf": [{"type": "string"}, {"maxLength": 3}]}, "`allOf` with several"),
    ({"$ref": "#/$defs/X", "properties": {}}, "beside `$ref`, `properties` would be ignored"),
    ({"type": "number", "multipleOf": 0.5}, "`multipleOf` is enforced on integers only"),
    ({"type": "integer", "minimum": 5, "maximum": 2}, "Invalid range"),
    ({"type": "strnig"}, 'Unsupported type "strnig"'),
])
def test_schemas_a_grammar_cannot_enforce_are_refused_by_part(schema, part):
    with pytest.raises(GrammarError, match=part.replace("$", "\\$").replace("(", "\\(")) as caught:
        json_schema_grammar(schema, True, "response_format.json_schema")
    assert caught.value.param.startswith("response_format.json_schema")


def test_mistral_calls_open_with_the_marker_token_when_the_tokenizer_has_one():
    parser = get_parser("mistral")
    tools = ToolRequest(TOOLS.tools, "function", "get_weather", parallel=False)
    as_token = reply_grammar(None, forced_calls_format(parser, tools, marker_token=7))
    assert '"token":7' in as_token.source.replace(" ", "") and '"value":"["' in as_token.source.replace(" ", "")
    spelled = reply_grammar(None, forced_calls_format(parser, tools))
    assert "[TOOL_CALLS][" in spelled.source
