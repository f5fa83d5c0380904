"""Schemathesis hooks for benchmarks/fuzz_openapi.py (which loads them through SCHEMATHESIS_HOOKS).

A valid (positive) generation request would otherwise ask for as much output as the context holds, times
up to 128 choices: on a CPU that is minutes per case and says nothing more about the HTTP contract. Its
output limit and choice count are capped here; invalid (negative) cases go out as generated, since the
server must refuse them before any generation starts.
"""

from __future__ import annotations

import schemathesis
from schemathesis import GenerationMode

MAX_OUTPUT_TOKENS = 8
MAX_CHOICES = 2
# each generation route's output-limit fields (the first one is set when the case has none)
OUTPUT_FIELDS = {"/v1/chat/completions": ("max_tokens", "max_completion_tokens"),
                 "/v1/completions": ("max_tokens",), "/v1/responses": ("max_output_tokens",),
                 "/v1/messages": ("max_tokens",)}


@schemathesis.hook
def map_case(context, case):
    fields = OUTPUT_FIELDS.get(case.path)
    meta = case.meta
    if fields is None or meta is None or meta.generation.mode != GenerationMode.POSITIVE \
            or not isinstance(case.body, dict):
        return case
    body = case.body
    if all(body.get(field) is None for field in fields):        # absent or null: as much as the context holds
        body[fields[0]] = MAX_OUTPUT_TOKENS
    for field in fields:
        if isinstance(body.get(field), int):
            body[field] = max(1, min(body[field], MAX_OUTPUT_TOKENS))
    if isinstance(body.get("n"), int):
        body["n"] = max(1, min(body["n"], MAX_CHOICES))
    return case
