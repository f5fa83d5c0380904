"""Constrained replies, frontend side: the `GrammarSpec` a request asks for, checked where it enters.

A reply can be constrained three ways, and they compose:
* its content: a JSON schema (`response_format` / `text.format` json_schema), any JSON object
  (json_object), or vLLM's `structured_outputs` extension (json, regex, choice, grammar);
* a forced tool call in the model's own syntax (`tool_grammar`);
* a reasoning block before either, for models that think first (`reasoning`).
One kind alone compiles directly (a JSON schema keeps xgrammar's compiler cache and strictness);
combinations become one xgrammar structural tag.

Checking needs no vocabulary: the schema checker (`json_schema_check`) refuses what a grammar would
not enforce, then xgrammar converts the spec (its own errors: a `$ref` that points nowhere, an
impossible range, a broken regex). Both answer 400 naming the part that failed; the engine core
compiles what passed (`flare.engine.structured_output`).

JSON replies allow a few whitespace characters between elements (`json_whitespace`, shared with the core).
"""

from __future__ import annotations

import json
import re
from functools import lru_cache
from typing import Any, Sequence

from flare.engine.sampling_params import GrammarSpec
from flare.engine.structured_output import json_whitespace
from flare.frontend.json_schema_check import UnsupportedSchema, check_schema

JSON_OBJECT = GrammarSpec("json_object")


class GrammarError(ValueError):
    """A constraint a request asked for that no grammar can enforce; `param` names the request field."""

    def __init__(self, message: str, param: str) -> None:
        super().__init__(message)
        self.param = param


def json_schema_grammar(schema: Any, strict: bool, param: str) -> GrammarSpec:
    """The spec for replies matching `schema` (a dict, or JSON text); GrammarError if it cannot be enforced."""
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except json.JSONDecodeError as error:
            raise GrammarError(f"{param} is not valid JSON: {error}", param) from None
    try:
        check_schema(schema)
    except UnsupportedSchema as error:
        raise GrammarError(f"{param}: {error}", param) from None
    return checked(GrammarSpec("json_schema", json.dumps(schema, sort_keys=True), strict), param)


def response_format_grammar(kind: str, schema: Any, strict: bool | None, param: str) -> GrammarSpec | None:
    """OpenAI's `response_format` / `text.format`: "text" (None: unconstrained), "json_object", or
    "json_schema" with its `schema` (`strict`: no properties beyond those the schema declares)."""
    if kind == "text":
        return None
    if kind == "json_object":
        return JSON_OBJECT
    if schema is None:
        raise GrammarError(f"{param}: a json_schema format needs its `schema`", param)
    return json_schema_grammar(schema, bool(strict), f"{param}.schema")


def extension_grammar(json_schema: Any = None, regex: str | None = None, choice: Sequence[str] | None = None,
                      grammar: str | None = None, json_object: bool | None = None,
                      param: str = "structured_outputs") -> GrammarSpec | None:
    """vLLM's `structured_outputs` (json, regex, choice, grammar as EBNF, json_object): at most one."""
    given = [name for name, value in (("json", json_schema), ("regex", regex), ("choice", choice),
                                      ("grammar", grammar), ("json_object", json_object)) if value]
    if len(given) > 1:
        raise GrammarError(f"{param} takes one constraint, got {', '.join(given)}", param)
    if json_schema:
        return json_schema_grammar(json_schema, True, f"{param}.json")
    if regex:
        return checked(GrammarSpec("regex", regex), f"{param}.regex")
    if choice:
        return choice_grammar(choice, f"{param}.choice")
    if grammar:
        return checked(GrammarSpec("ebnf", grammar), f"{param}.grammar")
    return JSON_OBJECT if json_object else None


def choice_grammar(choices: Sequence[str], param: str) -> GrammarSpec:
    """Replies that are exactly one of `choices`."""
    if not choices or not all(isinstance(choice, str) and choice for choice in choices):
        raise GrammarError(f"{param} must be a list of non-empty strings", param)
    return checked(GrammarSpec("ebnf", "root ::= " + " | ".join(json.dumps(c) for c in choices)), param)


def checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    """`spec` itself once xgrammar has converted it (cached per spec); GrammarError with xgrammar's reason."""
    problem = _conversion_problem(spec)
    if problem:
        raise GrammarError(f"{param}: the {spec.kind.replace('_', ' ')} cannot be turned into a grammar: "
                           f"{problem}", param)
    return spec


@lru_cache(maxsize=1024)
def _conversion_problem(spec: GrammarSpec) -> str:
    """Why xgrammar cannot convert `spec` ("" when it can)."""
    import xgrammar

    try:
        to_grammar(spec, xgrammar)
    except (RuntimeError, ValueError) as error:
        return _clean(str(error))
    return ""


def to_grammar(spec: GrammarSpec, xgrammar: Any) -> Any:
    """The xgrammar Grammar of a spec, converted the way the engine core compiles it."""
    if spec.kind == "json_schema":
        return xgrammar.Grammar.from_json_schema(spec.source, strict_mode=spec.strict, **json_whitespace())
    if spec.kind == "json_object":
        return xgrammar.Grammar.from_json_schema('{"type": "object"}', strict_mode=False, **json_whitespace())
    if spec.kind == "regex":
        return xgrammar.Grammar.from_regex(spec.source)
    if spec.kind == "ebnf":
        return xgrammar.Grammar.from_ebnf(spec.source)
    return xgrammar.Grammar.from_structural_tag(spec.source)


_LOG_PREFIX = re.compile(r"\[[0-9:]+\] \S+:\d+: ")


def _clean(message: str) -> str:
    """xgrammar's message without its log prefix (time, C++ file and line) and check boilerplate."""
    message = _LOG_PREFIX.sub("", message).replace("Check failed: (error.empty()) is false: ", "")
    return " ".join(message.split())


def reply_grammar(content: GrammarSpec | None, calls: Any = None, reasoning: Any = None,
                  param: str = "tools") -> GrammarSpec | None:
    """The one grammar of a reply: its `content` spec, or a forced tool call (`calls`, an xgrammar
    structural-tag format from `tool_grammar`), or either (auto tools beside a content format), after an
    optional `reasoning` block format (`ReasoningParser.reasoning_format`). None: the reply is free text."""
    if calls is None and reasoning is None:
        return content
    from xgrammar.structural_tag import AnyTextFormat, OrFormat, SequenceFormat, StructuralTag

    body = calls
    if content is not None:
        body = content_format(content) if body is None else OrFormat(elements=[content_format(content), body])
    if body is None:
        body = AnyTextFormat()            # reasoning (with a budget), then free text
    if reasoning is not None:
        body = SequenceFormat(elements=[reasoning, body])
    return checked(GrammarSpec("structural_tag", StructuralTag(format=body).model_dump_json()), param)


def content_format(spec: GrammarSpec) -> Any:
    """A content spec as a structural-tag format, to combine with tool calls or reasoning."""
    from xgrammar.structural_tag import GrammarFormat, RegexFormat

    if spec.kind == "json_schema":
        return json_format(json.loads(spec.source), spec.strict, "response_format")
    if spec.kind == "json_object":
        return json_format({"type": "object"}, False, "response_format")
    if spec.kind == "regex":
        return RegexFormat(pattern=spec.source)
    if spec.kind == "ebnf":
        return GrammarFormat(grammar=spec.source)
    raise ValueError(f"a {spec.kind} spec does not combine with other constraints")


def json_format(schema: Any, strict: bool, param: str) -> Any:
    """JSON matching `schema` as a structural-tag format, written as a JSON reply is (`json_whitespace`):
    the schema's grammar embedded, since the tags' own JSON format lets whitespace in everywhere."""
    import xgrammar
    from xgrammar.structural_tag import GrammarFormat

    try:
        grammar = xgrammar.Grammar.from_json_schema(json.dumps(schema), strict_mode=strict, **json_whitespace())
    except RuntimeError as error:
        raise GrammarError(f"{param}: the JSON schema cannot be turned into a grammar: {_clean(str(error))}",
                           param) from None
    return GrammarFormat(grammar=str(grammar))
