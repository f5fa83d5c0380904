"""The grammar of a forced tool call, written in the model's own syntax.

When `tool_choice` requires a call (OpenAI "required" or a named function, Anthropic "any" or "tool"),
the reply is constrained to one or more calls in the format the model's chat template taught it
(`ToolParser.call_opening` and friends: hermes `<tool_call>\n{"name": ..., "arguments": ...}\n</tool_call>`,
llama3_json, mistral), each call's arguments to that tool's parameter schema. The reply then always
parses, and every call's arguments match its schema. Calls stop after the first unless parallel calls
are allowed.
"""

from __future__ import annotations

from typing import Any

from flare.frontend.grammar import GrammarError, json_format
from flare.frontend.json_schema_check import UnsupportedSchema, check_schema
from flare.frontend.tool_parsers import ToolParser, ToolRequest


def forced_calls_format(parser: ToolParser, tools: ToolRequest, marker_token: int | None = None) -> Any:
    """The structural-tag format of the calls `tools` forces (an xgrammar pydantic Format).

    `marker_token`: the id of the parser's marker when the tokenizer has it as one special token (Mistral's
    `[TOOL_CALLS]`); the grammar then asks for that token, as the model was trained to write it."""
    from xgrammar.structural_tag import ConstStringFormat, SequenceFormat, TagFormat, TagsWithSeparatorFormat, TokenFormat

    names = [tools.function] if tools.choice == "function" else list(tools.names)
    tags = []
    for tool in tools.tools:
        function = tool["function"]
        if function["name"] not in names:
            continue
        schema = function.get("parameters")
        try:
            check_schema(schema, "#")
        except UnsupportedSchema as error:
            raise GrammarError(f"the parameters of tool {function['name']!r}: {error}", "tools") from None
        tags.append(TagFormat(begin=parser.call_begin(function["name"]), end=parser.call_closing,
                              content=json_format(schema, True, "tools")))
    calls = TagsWithSeparatorFormat(tags=tags, separator=parser.call_separator, at_least_one=True,
                                    stop_after_first=not tools.parallel)
    if not parser.calls_opening:
        return calls
    opening = [ConstStringFormat(value=parser.calls_opening)]
    marker = parser.markers[0]
    if marker_token is not None and parser.calls_opening.startswith(marker):
        opening = [TokenFormat(token=marker_token), ConstStringFormat(value=parser.calls_opening[len(marker):])]
    return SequenceFormat(elements=opening + [calls, ConstStringFormat(value=parser.calls_closing)])
