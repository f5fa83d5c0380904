"""The chat template: turns a conversation into the prompt text the model was trained on.

Templates are Jinja, as in Hugging Face checkpoints, rendered in a sandbox. The template comes from the
frontend assets (`chat_template.jinja`, or `chat_template` in `tokenizer_config.json`). A base model
without one (such as stories260k) gets a plain `role: text` layout so chat endpoints still work.
"""

from __future__ import annotations

import json
import re
from datetime import datetime
from pathlib import Path
from typing import Any, Mapping, Sequence

from flare.frontend.reasoning import parser_name_for_template as reasoning_parser_for_template
from flare.frontend.reasoning import reasoning_parser_for_directory
from flare.frontend.tool_parsers import DEFAULT_PARSER, parser_name_for_directory, parser_name_for_template

PLAIN_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}{{ message['role'] }}: {{ message['content'] }}\n\n{% endfor %}"
    "{% if add_generation_prompt %}assistant:{% endif %}"
)


_TOOLS_VARIABLE = re.compile(r"\btools\b")

# The names `ChatTemplate.render` gives the template itself (arguments and helper functions); extra
# template arguments (a request's chat_template_kwargs) must not reuse them.
RENDER_ARGUMENTS = frozenset({"messages", "tools", "add_generation_prompt", "continue_final_message", "bos_token",
                              "eos_token", "raise_exception", "strftime_now"})


class ChatTemplateError(ValueError):
    """The conversation cannot be rendered by this template (the message says why)."""


def _token_text(value: Any) -> str:
    if isinstance(value, Mapping):                 # {"content": "<s>", ...} in older tokenizer configs
        return str(value.get("content", ""))
    return "" if value is None else str(value)


def _raise(message: str):
    raise ChatTemplateError(message)


class ChatTemplate:
    def __init__(self, source: str, bos_token: str = "", eos_token: str = "", from_model: bool = True,
                 tool_parser: str = DEFAULT_PARSER, reasoning_parser: str | None = None) -> None:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                            extensions=["jinja2.ext.loopcontrols"])
        env.filters["tojson"] = lambda value, indent=None, **_: json.dumps(value, ensure_ascii=False,
                                                                              indent=indent)
        env.globals["raise_exception"] = _raise
        env.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
        self.source = source
        self.from_model = from_model             # False: the plain layout stands in for a missing template
        self.bos_token = bos_token
        self.eos_token = eos_token
        self.tool_parser = tool_parser           # the format this model writes tool calls in (tool_parsers)
        self.reasoning_parser = reasoning_parser # how its reasoning block is read (reasoning); None: it has none
        self._template = env.from_string(source)

    @classmethod
    def from_dir(cls, directory: Path) -> "ChatTemplate":
        """The template shipped with a tokenizer directory, or the plain layout when it has none."""
        config_path = directory / "tokenizer_config.json"
        config = json.loads(config_path.read_text()) if config_path.is_file() else {}
        source = None
        jinja_path = directory / "chat_template.jinja"
        if jinja_path.is_file():
            source = jinja_path.read_text()
        elif isinstance(config.get("chat_template"), str):
            source = config["chat_template"]
        elif isinstance(config.get("chat_template"), list):    # named templates: use "default"
            named = {t.get("name"): t.get("template") for t in config["chat_template"]}
            source = named.get("default") or next(iter(named.values()), None)
        return cls(source or PLAIN_TEMPLATE, _token_text(config.get("bos_token")),
                   _token_text(config.get("eos_token")), from_model=source is not None,
                   tool_parser=parser_name_for_template(source) or parser_name_for_directory(directory),
                   reasoning_parser=reasoning_parser_for_directory(directory) or reasoning_parser_for_template(source))

    def reads(self, variable: str) -> bool:
        """Whether the template reads this variable (a switch such as `enable_thinking`)."""
        return self.from_model and re.search(rf"\b{re.escape(variable)}\b", self.source) is not None

    @property
    def supports_tools(self) -> bool:
        """Whether the template reads the `tools` argument (as Hugging Face templates with tool support do)."""
        return self.from_model and _TOOLS_VARIABLE.search(self.source) is not None

    def render(self, messages: Sequence[Mapping[str, Any]], add_generation_prompt: bool = True,
               continue_final_message: bool = False, tools: Sequence[Mapping[str, Any]] | None = None,
               **kwargs: Any) -> str:
        """The prompt text for `messages` (each a dict with at least `role` and string `content`).

        Tool use follows Hugging Face's conventions: `tools` are {"type": "function", "function": {...}}
        definitions; an assistant message may carry `tool_calls` ({"id", "type": "function", "function":
        {"name", "arguments": dict}}); a tool's answer is a message of role `tool` with `tool_call_id`.
        A template without tool support reads that history as text instead."""
        if tools:
            if not self.supports_tools:
                raise ChatTemplateError(TOOLS_UNSUPPORTED)
            kwargs["tools"] = list(tools)
        if not self.supports_tools:
            messages = tool_history_as_text(messages)
        if continue_final_message and (not messages or messages[-1].get("role") != "assistant"):
            raise ChatTemplateError("continue_final_message needs the last message to be the assistant's")
        try:
            text = self._template.render(messages=list(messages), bos_token=self.bos_token,
                                         eos_token=self.eos_token,
                                         add_generation_prompt=add_generation_prompt and not continue_final_message,
                                         **kwargs)
        except ChatTemplateError:
            raise
        except Exception as error:                  # a template bug or an unexpected message layout
            raise ChatTemplateError(f"the chat template failed on this conversation: {error}") from error
        if continue_final_message:                   # end the prompt where the assistant's text ends
            final = str(messages[-1].get("content") or "")
            cut = text.rfind(final)
            if cut >= 0:
                text = text[:cut + len(final)]
        return text


TOOLS_UNSUPPORTED = ("the model's chat template does not support tools (it never reads `tools`), so the model "
                     "was not taught to call them. Send the request without tools, or with tool_choice \"none\".")


def _call_text(call: Mapping[str, Any]) -> str:
    function = call.get("function") or {}
    arguments = function.get("arguments", {})
    if not isinstance(arguments, str):
        arguments = json.dumps(arguments, ensure_ascii=False)
    return f"[tool call {function.get('name', '')}: {arguments}]"


def tool_history_as_text(messages: Sequence[Mapping[str, Any]]) -> list[dict]:
    """Tool calls and results written into plain messages, for templates that know no tools: a call
    becomes text in the assistant's message, a result a user message (joined to a neighbouring one)."""
    converted: list[dict] = []
    after_tool = False                       # the last converted message holds a tool's result
    for message in messages:
        entry = dict(message)
        if entry.get("tool_calls"):
            calls = "\n".join(_call_text(call) for call in entry.pop("tool_calls"))
            entry["content"] = "\n".join(text for text in (entry.get("content") or "", calls) if text)
        is_tool = entry.get("role") == "tool"
        if is_tool:
            entry = {"role": "user", "content": f"[tool result]: {entry.get('content') or ''}"}
        merge = bool(converted) and (is_tool or after_tool) and entry["role"] == "user" == converted[-1]["role"]
        if merge:
            converted[-1]["content"] = f"{converted[-1]['content']}\n\n{entry.get('content') or ''}"
        else:
            converted.append(entry)
        after_tool = is_tool or (merge and after_tool)
    return converted


def reply_parsers(frontend_dir) -> dict:
    """How replies are read and constrained, for `flare inspect --frontend`: the tool-call and reasoning
    parsers the template and the recipe choose, and the grammar backend (as `flare run` picks them from
    the same assets)."""
    from importlib.metadata import PackageNotFoundError, version

    template = ChatTemplate.from_dir(frontend_dir)
    try:
        backend = f"xgrammar {version('xgrammar')}"
    except PackageNotFoundError:
        backend = None
    return {"tool_parser": template.tool_parser if template.supports_tools else None,
            "reasoning_parser": template.reasoning_parser, "grammar_backend": backend}
