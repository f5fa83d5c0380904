"""Request bodies of the four APIs, as pydantic models.

Unknown fields are ignored (clients send vendor extras); fields of the wrong type fail validation,
which the app answers with a 400 in the caller's own error shape.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator

from flare.server.limits import (INT32_MAX, MAX_CHOICES, MAX_LOGIT_BIAS, MAX_MESSAGES, MAX_STOP_LENGTH,
                                 MAX_STOP_STRINGS, MAX_STOP_TOKEN_IDS, MAX_TOOLS, MAX_TOP_LOGPROBS, SEED_MAX,
                                 SEED_MIN)

# Field types that carry a range every API shares; the schemas (and so the OpenAPI document) state them.
Seed = Annotated[int, Field(ge=SEED_MIN, le=SEED_MAX, description="a signed 64-bit integer")]
TopK = Annotated[int, Field(ge=-1, le=INT32_MAX, description="0 or -1: no top-k cut")]
Temperature = Annotated[float, Field(ge=0.0, description="0 selects greedy decoding")]
TopP = Annotated[float, Field(gt=0.0, le=1.0)]
MinP = Annotated[float, Field(ge=0.0, le=1.0)]
Penalty = Annotated[float, Field(ge=-2.0, le=2.0)]
RepetitionPenalty = Annotated[float, Field(gt=0.0)]
OutputTokens = Annotated[int, Field(ge=1)]
TopLogprobs = Annotated[int, Field(ge=0, le=MAX_TOP_LOGPROBS)]
StopString = Annotated[str, Field(max_length=MAX_STOP_LENGTH)]
StopStrings = Annotated[list[StopString], Field(max_length=MAX_STOP_STRINGS)]
TokenId = Annotated[int, Field(ge=0, le=INT32_MAX)]


class _Body(BaseModel):
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def _null_means_default(cls, data: Any) -> Any:
        """Clients (LangChain, LiteLLM, ...) send `"n": null` for "not set"; the APIs read it as the default."""
        if isinstance(data, dict):
            return {key: value for key, value in data.items() if value is not None}
        return data


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False


class SamplingFields(_Body):
    """The sampling and stop fields OpenAI-style requests share (vLLM's extensions included)."""

    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    min_p: MinP | None = None
    presence_penalty: Penalty | None = None
    frequency_penalty: Penalty | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    stop: Union[StopString, StopStrings, None] = None
    stop_token_ids: Annotated[list[TokenId], Field(max_length=MAX_STOP_TOKEN_IDS)] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: Annotated[dict[str, float], Field(max_length=MAX_LOGIT_BIAS, description=(
        "token id -> bias, clamped to [-100, 100]"))] | None = None
    n: int = Field(1, ge=1, le=MAX_CHOICES)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None


# ---- OpenAI Chat Completions -------------------------------------------------------------------

class ContentPart(_Body):
    type: str
    text: str | None = None


class ToolCallFunction(_Body):
    name: str
    arguments: Union[str, dict[str, Any]] = "{}"     # a JSON object as text (some clients send the object)


class MessageToolCall(_Body):
    id: str = ""
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(_Body):
    role: Literal["system", "developer", "user", "assistant", "tool", "function"]
    content: Union[str, list[ContentPart], None] = None
    name: str | None = None
    tool_calls: list[MessageToolCall] | None = None
    tool_call_id: str | None = None


class FunctionDefinition(_Body):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ChatTool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class _ChoiceName(_Body):
    name: str


class ChatNamedToolChoice(_Body):
    type: Literal["function"]
    function: _ChoiceName


class JSONSchemaFormat(_Body):
    name: str = "response"
    description: str | None = None
    schema_: Union[dict[str, Any], bool, None] = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponseFormat(_Body):
    """Chat Completions `response_format`."""
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JSONSchemaFormat | None = None


class StructuredOutputsField(_Body):
    """vLLM's `structured_outputs` extension: exactly one constraint on the reply."""
    json_: Union[dict[str, Any], str, None] = Field(default=None, alias="json")
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None
    json_object: bool | None = None


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    max_tokens: OutputTokens | None = None
    max_completion_tokens: OutputTokens | None = None
    logprobs: bool = False
    top_logprobs: TopLogprobs | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: Annotated[list[ChatTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ChatNamedToolChoice, None] = None
    parallel_tool_calls: bool = True
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None
    reasoning_effort: str | None = None


# ---- OpenAI Completions ------------------------------------------------------------------------

class CompletionRequest(SamplingFields):
    model: str
    prompt: Union[str, Annotated[list[str], Field(max_length=MAX_CHOICES)], list[TokenId],
                  Annotated[list[list[TokenId]], Field(max_length=MAX_CHOICES)]]
    max_tokens: OutputTokens | None = 16
    echo: bool = False
    logprobs: TopLogprobs | None = None
    suffix: str | None = None
    best_of: int | None = Field(None, ge=1, le=MAX_CHOICES)
    response_format: ResponseFormat | None = None
    structured_outputs: StructuredOutputsField | None = None


# ---- OpenAI Responses --------------------------------------------------------------------------

class ResponsesTextFormat(_Body):
    """Responses `text.format`: {"type": "text" | "json_object"} or {"type": "json_schema", "name", "schema", "strict"}."""
    type: Literal["text", "json_object", "json_schema"] = "text"
    name: str = "response"
    description: str | None = None
    schema_: Union[dict[str, Any], bool, None] = Field(default=None, alias="schema")
    strict: bool | None = None


class ResponsesText(_Body):
    format: ResponsesTextFormat | None = None


class ResponsesRequest(_Body):
    model: str
    input: Union[str, Annotated[list[dict[str, Any]], Field(min_length=1, max_length=MAX_MESSAGES)]]
    instructions: str | None = None
    max_output_tokens: OutputTokens | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_logprobs: TopLogprobs | None = None
    include: list[str] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    # function tools: {"type": "function", "name", ...}
    tools: Annotated[list[dict[str, Any]], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    text: ResponsesText | None = None
    reasoning: dict[str, Any] | None = None           # {"effort": ...} for templates that read reasoning_effort
    # vLLM's extensions, for clients that tune them
    top_k: TopK | None = None
    min_p: MinP | None = None
    repetition_penalty: RepetitionPenalty | None = None
    seed: Seed | None = None
    ignore_eos: bool = False


# ---- Anthropic Messages ------------------------------------------------------------------------

class AnthropicBlock(BaseModel):
    model_config = ConfigDict(extra="allow")         # tool_use keeps its name and input
    type: str
    text: str | None = None
    content: Union[str, list[dict[str, Any]], None] = None   # tool_result blocks carry their text here


class AnthropicMessage(_Body):
    role: Literal["user", "assistant", "system"]
    content: Union[str, list[AnthropicBlock]]


class AnthropicTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(min_length=1)
    description: str | None = None
    input_schema: dict[str, Any] | None = None       # None: a server tool (web search, ...), not a function
    type: str | None = None


class AnthropicToolChoice(_Body):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool = False


class AnthropicThinking(_Body):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = Field(default=None, ge=1)


class AnthropicCountTokensRequest(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1, max_length=MAX_MESSAGES)
    system: Union[str, list[AnthropicBlock], None] = None
    tools: Annotated[list[AnthropicTool], Field(max_length=MAX_TOOLS)] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: AnthropicThinking | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: OutputTokens
    stop_sequences: StopStrings | None = None
    temperature: Temperature | None = None
    top_p: TopP | None = None
    top_k: TopK | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


# ---- vLLM's tokenizer endpoints ------------------------------------------------------------------

class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: Annotated[list[ChatMessage], Field(min_length=1, max_length=MAX_MESSAGES)] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[TokenId]
