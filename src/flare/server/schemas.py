"""Request bodies of the four APIs, as pydantic models.

Unknown fields are ignored (clients send vendor extras); fields of the wrong type fail validation,
which the app answers with a 400 in the caller's own error shape.
"""

from __future__ import annotations

from typing import Any, Literal, Union

from pydantic import BaseModel, ConfigDict, Field, model_validator


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

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
    stop: Union[str, list[str], None] = None
    stop_token_ids: list[int] | None = None
    ignore_eos: bool = False
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    logit_bias: dict[str, float] | None = None
    n: int = 1
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


class ChatCompletionRequest(SamplingFields):
    model: str
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    echo: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    tools: list[ChatTool] | None = None
    tool_choice: Union[Literal["none", "auto", "required"], ChatNamedToolChoice, None] = None
    parallel_tool_calls: bool = True


# ---- OpenAI Completions ------------------------------------------------------------------------

class CompletionRequest(SamplingFields):
    model: str
    prompt: Union[str, list[str], list[int], list[list[int]]]
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    suffix: str | None = None
    best_of: int | None = None


# ---- OpenAI Responses --------------------------------------------------------------------------

class ResponsesRequest(_Body):
    model: str
    input: Union[str, list[dict[str, Any]]]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_logprobs: int | None = None
    include: list[str] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    store: bool | None = None
    metadata: dict[str, Any] | None = None
    user: str | None = None
    tools: list[dict[str, Any]] | None = None           # function tools: {"type": "function", "name", ...}
    tool_choice: Union[Literal["none", "auto", "required"], dict[str, Any], None] = None
    parallel_tool_calls: bool = True
    # vLLM's extensions, for clients that tune them
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    seed: int | None = None
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


class AnthropicCountTokensRequest(_Body):
    model: str
    messages: list[AnthropicMessage] = Field(min_length=1)
    system: Union[str, list[AnthropicBlock], None] = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None


class AnthropicMessagesRequest(AnthropicCountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


# ---- vLLM's tokenizer endpoints ------------------------------------------------------------------

class TokenizeRequest(_Body):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True


class DetokenizeRequest(_Body):
    model: str | None = None
    tokens: list[int]
