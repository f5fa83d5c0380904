"""The caps on what one request may ask for, in one place: the schemas enforce them (so the OpenAPI
document states them) and the routes check the ones that span fields.

Each cap keeps one client from stalling everyone else or from handing the engine a number it cannot hold.
Where a vendor documents a limit we use it; the rest are our own and say so.
"""

from __future__ import annotations

# OpenAI's API reference: `n` has minimum 1 and maximum 128 (Chat Completions). We apply it to Completions
# too, and to a Completions request's prompts x n together: every sequence is a slot in the engine.
MAX_CHOICES = 128

# Seeds are signed 64-bit integers, as OpenAI documents the field (minimum -2**63, maximum 2**63 - 1);
# torch's generators take any of them.
SEED_MIN = -(2 ** 63)
SEED_MAX = 2 ** 63 - 1

# Integers that become tensor values (top_k) stay within a signed 32-bit integer.
INT32_MAX = 2 ** 31 - 1

# Stop strings are matched against the text of every new token: their number and length bound that work.
# OpenAI documents "up to 4"; vLLM has no cap. Ours is generous for agent frameworks and still cheap.
MAX_STOP_STRINGS = 32
MAX_STOP_LENGTH = 512            # characters
MAX_STOP_TOKEN_IDS = 1024

# logit_bias entries are applied on every decoding step. OpenAI's documented range of a bias is -100..100;
# 300 entries is the count clients report OpenAI accepting (not in its reference; our cap regardless).
MAX_LOGIT_BIAS = 300
LOGIT_BIAS_RANGE = (-100.0, 100.0)

# Tools are rendered into every prompt. OpenAI's guide: "a max of 128 functions are supported".
MAX_TOOLS = 128

# Messages (or Responses input items) in one conversation; our own cap: each is rendered by the chat
# template, and far more than any context holds is only work.
MAX_MESSAGES = 4096

# Top alternatives per token (OpenAI's top_logprobs range is 0..20).
MAX_TOP_LOGPROBS = 20

# JSON nesting depth of a request body (tool parameter schemas nest; nothing legitimate nests this deep).
MAX_JSON_DEPTH = 64
