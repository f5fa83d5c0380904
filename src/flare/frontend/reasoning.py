"""Reasoning in model output: the `<think>...</think>` block reasoning models write before their answer.

Two parsers, named as vLLM's `--reasoning-parser` names them, share the tags and differ in one rule:
    qwen3        the reply reasons only inside <think>...</think> (or from the start, when the prompt
                 itself ends with <think>, as the thinking-only templates write it)
    deepseek_r1  the reply reasons from its start until </think>, with or without the opening tag
The recipe declares its family's parser (`Recipe.reasoning_parser`); a chat template that writes the
tags names one too (`parser_name_for_template`). Streamed and finished replies split the same way: a
finished reply is one feed of the same stream.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from flare.frontend.output_processor import partial_stop_length


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    reasons_without_start: bool = False      # deepseek_r1: reasoning until `end` even without `start`

    def starts_inside(self, prompt_text: str) -> bool:
        """Whether a reply to this prompt begins inside the reasoning block (the prompt opened it)."""
        tail = prompt_text.rstrip()
        return self.reasons_without_start or (tail.endswith(self.start) and not tail.endswith(self.end))

    def reasoning_format(self, inside: bool, budget_tokens: int | None = None):
        """The reasoning block as an xgrammar structural-tag format, to put before a constrained answer:
        `inside` continues a block the prompt opened; otherwise the reply may open one. `budget_tokens`
        caps its length (the grammar then closes it)."""
        from xgrammar.structural_tag import AnyTextFormat, OptionalFormat, RegexFormat, SequenceFormat, TagFormat

        block = TagFormat(begin="" if inside else self.start, end=self.end,
                          content=AnyTextFormat(excludes=[self.end], max_tokens=budget_tokens))
        spacing = RegexFormat(pattern=r"[ \n]*")
        return SequenceFormat(elements=[block if inside else OptionalFormat(content=block), spacing])


PARSERS = {parser.name: parser for parser in (ReasoningParser("qwen3"),
                                              ReasoningParser("deepseek_r1", reasons_without_start=True))}


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; known: {', '.join(PARSERS)}")
    return PARSERS[name]


def parser_name_for_template(source: str | None) -> str | None:
    """A template that writes `</think>` teaches reasoning: deepseek_r1's rule reads it (as for R1's distills)."""
    return "deepseek_r1" if source and "</think>" in source else None


def reasoning_parser_for_directory(directory: Path) -> str | None:
    """The parser the recipe of the model in `directory` (by its config.json architecture) declares."""
    try:
        architectures = json.loads((Path(directory) / "config.json").read_text()).get("architectures") or []
    except (OSError, ValueError):
        return None
    from flare.recipes.registry import recipe_for_architecture

    for architecture in architectures:
        recipe = recipe_for_architecture(architecture)
        if recipe is not None:
            return recipe.reasoning_parser
    return None


class ReasoningStream:
    """Splits streamed text into reasoning and answer; tags are held back until they are known."""

    def __init__(self, parser: ReasoningParser, inside: bool) -> None:
        self.parser = parser
        self.state = "reasoning" if inside else "opening"   # opening: the reply may still start a block
        self.held = ""
        self.strip_next = inside                 # leading whitespace of a block or answer is dropped

    def feed(self, text: str) -> tuple[str, str]:
        """(reasoning, answer) that `text` completes."""
        self.held += text
        reasoning, answer = "", ""
        while True:
            if self.state == "opening":
                stripped = self.held.lstrip()
                if stripped.startswith(self.parser.start):
                    self.held, self.state, self.strip_next = stripped[len(self.parser.start):], "reasoning", True
                    continue
                if self.parser.start.startswith(stripped):
                    return reasoning, answer             # maybe a tag still coming
                self.state = "answer"
            if self.state == "reasoning":
                self._strip()
                end = self.held.find(self.parser.end)
                if end < 0:
                    cut = len(self.held) - partial_stop_length(self.held, (self.parser.end,))
                    reasoning, self.held = reasoning + self.held[:cut], self.held[cut:]
                    return reasoning, answer
                reasoning += self.held[:end]
                self.held, self.state, self.strip_next = self.held[end + len(self.parser.end):], "answer", True
            self._strip()
            answer, self.held = answer + self.held, ""
            return reasoning, answer

    def finish(self) -> tuple[str, str]:
        """What is still held at the end of the reply."""
        held, self.held = self.held, ""
        return (held, "") if self.state == "reasoning" else ("", held)

    def _strip(self) -> None:
        if self.strip_next and self.held:
            self.held = self.held.lstrip()
            self.strip_next = not self.held
