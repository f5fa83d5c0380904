"""The chat template, and how each API's conversation reaches it."""

from __future__ import annotations

import json

import pytest

from flare.frontend.chat_template import PLAIN_TEMPLATE, ChatTemplate, ChatTemplateError
from flare.server import anthropic_messages, openai_chat, openai_responses
from flare.server.errors import APIError
from flare.server.schemas import AnthropicMessagesRequest, ChatCompletionRequest, ResponsesRequest

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
          "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_template_from_tokenizer_config(tmp_path):
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": CHATML, "bos_token": "<s>"}))
    template = ChatTemplate.from_dir(tmp_path)
    assert template.from_model
    text = template.render([{"role": "system", "content": "S"}, {"role": "user", "content": "U"}])
    assert text == "<|im_start|>system\nS<|im_end|>\n<|im_start|>user\nU<|im_end|>\n<|im_start|>assistant\n"


def test_a_jinja_file_wins_and_a_missing_template_gets_the_plain_layout(tmp_path):
    assert not ChatTemplate.from_dir(tmp_path).from_model
    assert ChatTemplate.from_dir(tmp_path).source == PLAIN_TEMPLATE
    (tmp_path / "chat_template.jinja").write_text("{{ messages[0]['content'] }}!")
    assert ChatTemplate.from_dir(tmp_path).render([{"role": "user", "content": "hi"}]) == "hi!"


def test_continue_final_message_ends_at_the_assistant_text():
    template = ChatTemplate(CHATML)
    text = template.render([{"role": "user", "content": "U"}, {"role": "assistant", "content": "Once upon"}],
                           continue_final_message=True)
    assert text.endswith("<|im_start|>assistant\nOnce upon")


def test_template_errors_are_reported():
    template = ChatTemplate("{{ raise_exception('roles must alternate') }}")
    with pytest.raises(ChatTemplateError, match="roles must alternate"):
        template.render([{"role": "user", "content": "x"}])


def test_openai_developer_role_and_text_parts():
    body = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "hi"}]})
    assert openai_chat.template_messages(body.messages) == [{"role": "system", "content": "be brief"},
                                                            {"role": "user", "content": "hi"}]
    image = ChatCompletionRequest.model_validate({"model": "m", "messages": [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
    with pytest.raises(APIError, match="text only"):
        openai_chat.template_messages(image.messages)


def test_anthropic_system_in_every_form_becomes_one_leading_message():
    body = AnthropicMessagesRequest.model_validate({
        "model": "m", "max_tokens": 4, "system": [{"type": "text", "text": "first"}],
        "messages": [{"role": "system", "content": "second"}, {"role": "user", "content": "hi"},
                     {"role": "assistant", "content": [{"type": "text", "text": "hello"}]},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t", "content": "42"}]}]})
    assert anthropic_messages.template_messages(body) == [
        {"role": "system", "content": "first\n\nsecond"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "tool", "tool_call_id": "t", "content": "42"}]


def test_responses_input_items_and_instructions():
    body = ResponsesRequest.model_validate({"model": "m", "instructions": "be kind", "input": [
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "hi"}]},
        {"role": "assistant", "content": [{"type": "output_text", "text": "hello"}]},
        {"role": "developer", "content": "short answers"}]})
    assert openai_responses.template_messages(body) == [
        {"role": "system", "content": "be kind"}, {"role": "user", "content": "hi"},
        {"role": "assistant", "content": "hello"}, {"role": "system", "content": "short answers"}]
    tools = ResponsesRequest.model_validate({"model": "m", "input": [{"type": "web_search_call", "id": "w"}]})
    with pytest.raises(APIError, match="not supported"):
        openai_responses.template_messages(tools)
