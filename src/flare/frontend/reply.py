"""Reading a reply: its reasoning, its text and its tool calls, the same way streamed and finished.

The reasoning block comes first and is split off before tool calls are looked for, so neither leaks
into the other: a `<tool_call>` inside the reasoning is reasoning, and reasoning never reaches a call's
arguments. A finished reply is read as one feed of the stream, so both agree by construction.
"""

from __future__ import annotations

from dataclasses import dataclass

from flare.frontend.reasoning import ReasoningParser, ReasoningStream
from flare.frontend.tool_parsers import ToolCall, ToolCallStream, ToolParser, ToolRequest


@dataclass(frozen=True)
class Reply:
    reasoning: str
    text: str
    tool_calls: tuple[ToolCall, ...] = ()


@dataclass(frozen=True)
class ReplyReader:
    """How to read the replies to one request."""

    tools: ToolRequest = ToolRequest()
    tool_parser: ToolParser | None = None          # None: tools are not in play
    reasoning: ReasoningParser | None = None       # None: the model does not reason (or was told not to)
    starts_in_reasoning: bool = False

    def stream(self) -> ReplyStream:
        return ReplyStream(self)

    def read(self, text: str) -> Reply:
        stream = self.stream()
        reasoning, shown = stream.feed(text)
        rest = stream.finish()
        return Reply(reasoning + rest.reasoning, shown + rest.text, rest.tool_calls)


class ReplyStream:
    def __init__(self, reader: ReplyReader) -> None:
        self.reader = reader
        self.thinking = (ReasoningStream(reader.reasoning, reader.starts_in_reasoning)
                         if reader.reasoning is not None else None)
        self.calls = (ToolCallStream(reader.tool_parser, forced=reader.tools.forced)
                      if reader.tool_parser is not None else None)

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, text) that can be shown now; a possible tool call is held until the end."""
        reasoning, answer = self.thinking.feed(text) if self.thinking is not None else ("", text)
        return reasoning, self._answer(answer)

    def finish(self) -> Reply:
        """The rest at the end of the reply: held reasoning and text, and the calls it made."""
        reasoning, answer = self.thinking.finish() if self.thinking is not None else ("", "")
        text = self._answer(answer)
        if self.calls is None:
            return Reply(reasoning, text)
        parsed = self.calls.finish()
        return Reply(reasoning, text + parsed.text, self.reader.tools.keep(parsed.tool_calls))

    def _answer(self, text: str) -> str:
        return self.calls.feed(text) if self.calls is not None and text else text
