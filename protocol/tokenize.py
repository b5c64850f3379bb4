"""vLLM's `/tokenize` and `/detokenize` bodies, read alike by the router (which validates, then
forwards to a worker of the model) and the worker (which runs the model's tokenizer).

    POST /tokenize    {model?, prompt, add_special_tokens=true, return_token_strs=false}
                   or {model?, messages, add_generation_prompt=true, continue_final_message=false,
                       add_special_tokens=false, chat_template_kwargs?, chat_template?, tools?,
                       return_token_strs=false}
                   -> {count, max_model_len, tokens, token_strs}   (token_strs null unless asked)
    POST /detokenize  {model?, tokens} -> {prompt}

The chat form tokenizes exactly the prompt a chat completion of those messages would run (the
same template, tools rendered the same way), so `count` is what a client budgets against
`max_model_len`.
"""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field, field_validator

from pdserve.protocol import chat_templates
from pdserve.protocol.body import validate
from pdserve.protocol.errors import bad_request
from pdserve.protocol.requests import ChatCompletionRequest, ChatMessage
from pdserve.protocol.tools import Tool

PATH_TOKENIZE, PATH_DETOKENIZE = "/tokenize", "/detokenize"


class _Strict(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)

    model: str | None = None


class TokenizeCompletionRequest(_Strict):
    prompt: str
    add_special_tokens: bool = True
    return_token_strs: bool = False


class TokenizeChatRequest(_Strict):
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    # The chat template writes BOS and role markers itself (vLLM's default too).
    add_special_tokens: bool = False
    return_token_strs: bool = False
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # as a chat completion's (protocol/chat_templates.py)
    tools: list[Tool] | None = None

    @field_validator("chat_template_kwargs", "chat_template")
    @classmethod
    def _bounded(cls, value: Any, info) -> Any:
        return chat_templates.validated(value, info.field_name)

    def as_chat(self) -> ChatCompletionRequest:
        """The chat completion whose prompt this is."""
        return ChatCompletionRequest(messages=self.messages, add_generation_prompt=self.add_generation_prompt,
                                     continue_final_message=self.continue_final_message,
                                     chat_template_kwargs=self.chat_template_kwargs, chat_template=self.chat_template,
                                     tools=self.tools)


class DetokenizeRequest(_Strict):
    tokens: list[int]


def tokenize_request(body: dict) -> TokenizeCompletionRequest | TokenizeChatRequest:
    """Either form, by its fields (400 naming the field when malformed)."""
    if "messages" in body:
        req = validate(TokenizeChatRequest, body)
        if req.add_generation_prompt and req.continue_final_message and "add_generation_prompt" in body:
            raise bad_request("add_generation_prompt and continue_final_message cannot both be true",
                              "continue_final_message")
        return req
    if "prompt" not in body:
        raise bad_request("give 'prompt' (a string) or 'messages' (a chat)", "prompt")
    return validate(TokenizeCompletionRequest, body)


def detokenize_request(body: dict) -> DetokenizeRequest:
    return validate(DetokenizeRequest, body)
