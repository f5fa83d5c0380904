"""What each API's request body asks the reply's content to match, as a GrammarSpec (or None).

The rules live in `flare.frontend.grammar`; this module only reads each API's fields and turns a
GrammarError into a 400 that names the field.
"""

from __future__ import annotations

from contextlib import contextmanager

from flare.engine.sampling_params import GrammarSpec
from flare.frontend.grammar import GrammarError, extension_grammar, response_format_grammar
from flare.server.errors import bad_request


@contextmanager
def refused_as_400():
    try:
        yield
    except GrammarError as error:
        raise bad_request(str(error), param=error.param) from None


def openai_content_grammar(body) -> GrammarSpec | None:
    """Chat Completions and Completions: `response_format`, or vLLM's `structured_outputs`."""
    with refused_as_400():
        extension = body.structured_outputs
        from_extension = extension_grammar(extension.json_, extension.regex, extension.choice, extension.grammar,
                                           extension.json_object) if extension is not None else None
        response_format = body.response_format
        from_format = None
        if response_format is not None:
            json_schema = response_format.json_schema
            from_format = response_format_grammar(
                response_format.type, json_schema.schema_ if json_schema else None,
                json_schema.strict if json_schema else None, "response_format.json_schema"
                if response_format.type == "json_schema" else "response_format")
        if from_format is not None and from_extension is not None:
            raise GrammarError("send either response_format or structured_outputs, not both", "structured_outputs")
        return from_format or from_extension


def responses_content_grammar(body) -> GrammarSpec | None:
    """Responses: `text.format`."""
    text_format = body.text.format if body.text is not None else None
    if text_format is None:
        return None
    with refused_as_400():
        return response_format_grammar(text_format.type, text_format.schema_, text_format.strict, "text.format")
