"""Tool calls: reading them out of a model's text, and what a request asks of them.

Models write tool calls as text in the format their chat template taught them. Three formats cover the
families Flare serves, named as vLLM's `--tool-call-parser` names them:

    hermes       <tool_call>{"name": ..., "arguments": {...}}</tool_call>      (Qwen 2.5 / Qwen 3)
    llama3_json  {"name": ..., "parameters": {...}}   (optionally after <|python_tag|>; Llama 3.x)
    mistral      [TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]           (Mistral)

A call that is not valid JSON of that shape is not a call: the whole text stays text.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from flare.frontend.output_processor import partial_stop_length

DEFAULT_PARSER = "hermes"
# Recipe family (the manifest's recipe name) -> the format its chat templates teach.
PARSER_OF_FAMILY = {"qwen2": "hermes", "qwen3": "hermes", "llama": "llama3_json", "mistral": "mistral"}

_decoder = json.JSONDecoder()


@dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: str                        # a JSON object, as text (what OpenAI clients receive)

    @property
    def input(self) -> dict:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class ParsedOutput:
    text: str                             # what the model said besides its calls
    tool_calls: tuple[ToolCall, ...] = ()


def new_call_id(prefix: str) -> str:
    return f"{prefix}{uuid.uuid4().hex[:24]}"


def _call_from(value: Any) -> ToolCall | None:
    """A ToolCall from one decoded JSON value, or None when it is not shaped like a call."""
    if not isinstance(value, dict) or not isinstance(value.get("name"), str) or not value["name"]:
        return None
    arguments = value.get("arguments", value.get("parameters", {}))
    if isinstance(arguments, str):            # some models write the arguments as an encoded string
        try:
            arguments = json.loads(arguments or "{}")
        except json.JSONDecodeError:
            return None
    if not isinstance(arguments, dict):
        return None
    return ToolCall(value["name"], json.dumps(arguments, ensure_ascii=False))


def _decode_all(text: str, separator: str = "") -> list[Any] | None:
    """Consecutive JSON values filling `text` (optionally separated by `separator`), or None."""
    values, position = [], 0
    while True:
        while position < len(text) and text[position].isspace():
            position += 1
        if position == len(text):
            return values or None
        if values and separator:
            if not text.startswith(separator, position):
                return None
            position += len(separator)
            while position < len(text) and text[position].isspace():
                position += 1
        try:
            value, position = _decoder.raw_decode(text, position)
        except json.JSONDecodeError:
            return None
        values.append(value)


class ToolParser:
    """One tool-call format. `markers` are the texts a call can begin with."""

    name: str = ""
    markers: tuple[str, ...] = ()
    keeps_special_tokens = False              # the markers are special tokens the detokenizer would drop

    def start(self, text: str, from_index: int = 0) -> int:
        """Where the first possible call begins in `text` (at or after from_index), or -1."""
        found = [i for i in (text.find(m, from_index) for m in self.markers) if i >= 0]
        return min(found, default=-1)

    def parse(self, text: str) -> ParsedOutput:
        start = self.start(text)
        if start < 0:
            return ParsedOutput(text)
        calls = self.parse_calls(text[start:])
        if not calls:
            return ParsedOutput(text)
        return ParsedOutput(text[:start] if text[:start].strip() else "", tuple(calls))

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        """The calls in `text`, which begins at a marker; None when any of it is malformed."""
        raise NotImplementedError

    # How a call is written, for the grammar that forces one (`flare.frontend.tool_grammar`): the text
    # before its arguments (with the function's name, JSON-escaped), after them, between two calls,
    # and around the whole list of calls.
    call_opening = ""
    call_closing = ""
    call_separator = ""
    calls_opening = ""
    calls_closing = ""

    def call_begin(self, name: str) -> str:
        return self.call_opening.replace("{name}", json.dumps(name, ensure_ascii=False)[1:-1])

    def history_call_id(self, call_id: str) -> str:
        """A call id from the conversation's history as the chat template accepts it."""
        return call_id


class HermesParser(ToolParser):
    name = "hermes"
    markers = ("<tool_call>",)
    _block = re.compile(r"<tool_call>(.*?)(?:</tool_call>|$)", re.DOTALL)

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        calls, end = [], 0
        for match in self._block.finditer(text):
            if text[end:match.start()].strip():
                break                                # text after the calls ends them
            values = _decode_all(match.group(1))
            call = _call_from(values[0]) if values and len(values) == 1 else None
            if call is None:
                return None
            calls.append(call)
            end = match.end()
        return calls or None

    call_opening = '<tool_call>\n{"name": "{name}", "arguments": '
    call_closing = "}\n</tool_call>"
    call_separator = "\n"


class Llama3JsonParser(ToolParser):
    name = "llama3_json"
    markers = ("<|python_tag|>", '{"name"', '{ "name"')

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        text = text.removeprefix("<|python_tag|>")
        values = _decode_all(text, separator=";")
        calls = [_call_from(value) for value in values or []]
        return calls if calls and all(calls) else None

    call_opening = '{"name": "{name}", "parameters": '
    call_closing = "}"
    call_separator = "; "


class MistralParser(ToolParser):
    """`[TOOL_CALLS]` then a JSON list of calls; newer tokenizers write `[TOOL_CALLS]name[ARGS]{...}` per call."""

    name = "mistral"
    markers = ("[TOOL_CALLS]",)
    keeps_special_tokens = True

    def parse_calls(self, text: str) -> list[ToolCall] | None:
        body = text.removeprefix("[TOOL_CALLS]")
        if "[ARGS]" in body:
            return self._name_args_calls(text)
        values = _decode_all(body)
        if not values or len(values) != 1:
            return None
        listed = values[0] if isinstance(values[0], list) else [values[0]]
        calls = [_call_from(value) for value in listed]
        return calls if calls and all(calls) else None

    @staticmethod
    def _name_args_calls(text: str) -> list[ToolCall] | None:
        calls = []
        for piece in text.split("[TOOL_CALLS]")[1:]:
            name, _, arguments = piece.partition("[ARGS]")
            values = _decode_all(arguments)
            call = _call_from({"name": name.strip(), "arguments": values[0]}) if values and len(values) == 1 else None
            if call is None:
                return None
            calls.append(call)
        return calls or None

    def history_call_id(self, call_id: str) -> str:
        # Mistral's templates refuse any id that is not 9 letters or digits; clients echo ours (call_<hex>).
        return re.sub(r"[^A-Za-z0-9]", "", call_id)[-9:].rjust(9, "0")

    call_opening = '{"name": "{name}", "arguments": '
    call_closing = "}"
    call_separator = ", "
    calls_opening = "[TOOL_CALLS]["
    calls_closing = "]"


PARSERS: dict[str, type[ToolParser]] = {parser.name: parser for parser in
                                        (HermesParser, Llama3JsonParser, MistralParser)}


def with_history_ids(messages: list[dict], parser: ToolParser) -> list[dict]:
    """The conversation with its call ids (on tool_calls and on tool results) as the template accepts them."""
    converted = []
    for message in messages:
        entry = dict(message)
        if entry.get("tool_calls"):
            entry["tool_calls"] = [dict(call, id=parser.history_call_id(str(call.get("id") or "")))
                                   for call in entry["tool_calls"]]
        if entry.get("tool_call_id") is not None:
            entry["tool_call_id"] = parser.history_call_id(str(entry["tool_call_id"]))
        converted.append(entry)
    return converted


def get_parser(name: str) -> ToolParser:
    if name not in PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]()


def parser_name_for_family(family: str | None) -> str:
    return PARSER_OF_FAMILY.get(family or "", DEFAULT_PARSER)


def parser_name_for_template(source: str | None) -> str | None:
    """The format a chat template teaches, when its text writes one format's marker (a fine-tune may
    teach another format than its family's: the demo model is a Llama that speaks hermes)."""
    for name in ("mistral", "llama3_json", "hermes"):
        if source and PARSERS[name].markers[0] in source:
            return name
    return None


def parser_name_for_directory(directory: Path) -> str:
    """The format for the model whose frontend assets (with its config.json) are in `directory`.

    The recipe family is the one the package was prepared with: the recipe that serves the architecture
    config.json names (the manifest's recipe name is that recipe's family)."""
    config_path = Path(directory) / "config.json"
    try:
        architectures = json.loads(config_path.read_text()).get("architectures") or []
    except (OSError, ValueError):
        return DEFAULT_PARSER
    from flare.recipes.registry import recipe_for_architecture

    for architecture in architectures:
        recipe = recipe_for_architecture(architecture)
        if recipe is not None:
            return parser_name_for_family(recipe.family)
    return DEFAULT_PARSER


class ToolCallStream:
    """Splits streamed text into what can be shown now and a trailing tool-call section.

    Text streams until a marker appears; from the marker on, the text is held until the end and then
    parsed. A held section that turns out not to be a call is released as text, unless the call was
    `forced`: then the whole reply is the call, and a reply cut short (by max_tokens) shows no text,
    streamed or not (`parse_reply` reads it the same way)."""

    def __init__(self, parser: ToolParser, forced: bool = False) -> None:
        self.parser = parser
        self.forced = forced
        self.buffer = ""
        self.shown = 0                # characters of `buffer` already handed out as text
        self.in_call = forced

    def feed(self, text: str) -> str:
        """Add newly generated text; returns the part that is plain text for sure."""
        self.buffer += text
        if self.in_call:
            return ""
        start = self.parser.start(self.buffer, self.shown)
        if start >= 0:
            self.in_call = True
            return self._show(start)
        return self._show(len(self.buffer) - self._partial_marker_length())

    def finish(self) -> ParsedOutput:
        """The end of the reply: the held text still to show, and the calls it made."""
        held = self.buffer[self.shown:]
        if not self.in_call:
            return ParsedOutput(self._show(len(self.buffer)))
        start = self.parser.start(held)
        calls = self.parser.parse_calls(held[start:]) if start >= 0 and not held[:start].strip() else None
        if calls:
            return ParsedOutput("", tuple(calls))
        return ParsedOutput("") if self.forced else ParsedOutput(self._show(len(self.buffer)))

    def _show(self, end: int) -> str:
        text = self.buffer[self.shown:end]
        self.shown = max(self.shown, end)
        return text

    def _partial_marker_length(self) -> int:
        """How many trailing characters might be the beginning of a marker (held back until known)."""
        return partial_stop_length(self.buffer[self.shown:], self.parser.markers)


def tool_call_chunks(arguments: str, size: int = 64) -> Iterator[str]:
    """The arguments text in pieces, for APIs that stream them as deltas."""
    for start in range(0, len(arguments), size):
        yield arguments[start:start + size]


@dataclass(frozen=True)
class ToolRequest:
    """What a request asks of tools, the same for every API."""

    tools: tuple[dict, ...] = ()              # definitions in Hugging Face's shape: {"type": "function", "function": {...}}
    choice: str = "auto"                      # "auto", "none", "required", or "function" (then `function` names it)
    function: str | None = None
    parallel: bool = True                     # False: at most one call per reply

    @property
    def active(self) -> bool:
        return bool(self.tools) and self.choice != "none"

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(tool["function"]["name"] for tool in self.tools)

    def template_tools(self) -> list[dict] | None:
        return list(self.tools) if self.active else None

    @property
    def forced(self) -> bool:
        """The reply must call a tool (a grammar makes it: `tool_grammar`)."""
        return self.active and self.choice in ("required", "function")

    def keep(self, calls: tuple[ToolCall, ...]) -> tuple[ToolCall, ...]:
        return calls if self.parallel else calls[:1]


def function_tool(name: str, description: str | None, parameters: dict | None) -> dict:
    """One tool definition in the shape chat templates read."""
    function: dict[str, Any] = {"name": name}
    if description is not None:
        function["description"] = description
    function["parameters"] = parameters if parameters is not None else {"type": "object", "properties": {}}
    return {"type": "function", "function": function}


def call_arguments(arguments: str | dict | None) -> dict:
    """A call's arguments from a conversation's history, as the dict chat templates expect."""
    if isinstance(arguments, dict):
        return arguments
    if not arguments or not arguments.strip():
        return {}
    value = json.loads(arguments)            # JSONDecodeError (a ValueError) for the caller to report
    if not isinstance(value, dict):
        raise ValueError("tool call arguments must be a JSON object")
    return value
