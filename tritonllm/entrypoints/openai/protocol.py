"""Request and response bodies of the OpenAI API endpoints tritonllm serves, following OpenAI's schema.

vLLM's extensions to the sampling fields (top_k, min_p, repetition_penalty, ignore_eos, min_tokens,
stop_token_ids, skip_special_tokens, include_stop_str_in_output) are accepted under the same names.
Unknown fields are ignored, as OpenAI clients send some this server has no use for (user, store, ...);
fields that would change the answer but are not supported are rejected by the handlers.
"""

from __future__ import annotations

import time
from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, Strict, field_validator

# Strict: a JSON "0.5" or true is not silently read as a number, nor 1 as a boolean.
Float = Annotated[float, Strict()]
Int = Annotated[int, Strict()]
Bool = Annotated[bool, Strict()]

PromptInput = str | list[str] | list[int] | list[list[int]]


def _is_int(x: Any) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


class OpenAIBaseModel(BaseModel):
    model_config = ConfigDict(extra="ignore")


class StreamOptions(OpenAIBaseModel):
    include_usage: Bool = False


class SamplingRequest(OpenAIBaseModel):
    """Fields shared by completions and chat completions."""

    model: str | None = None  # None: the (first) served model
    n: Int = 1
    temperature: Float | None = None  # None: 1.0
    top_p: Float | None = None
    top_k: Int | None = None
    min_p: Float | None = None
    presence_penalty: Float | None = None
    frequency_penalty: Float | None = None
    repetition_penalty: Float | None = None
    seed: Int | None = None
    stop: str | list[str] | None = None
    stop_token_ids: list[Int] | None = None
    ignore_eos: Bool = False
    min_tokens: Int = 0
    skip_special_tokens: Bool = True
    include_stop_str_in_output: Bool = False
    stream: Bool = False
    stream_options: StreamOptions | None = None
    logit_bias: dict[str, float] | None = None  # not supported: rejected unless empty
    best_of: Int | None = None  # not supported beyond best_of == n


class CompletionRequest(SamplingRequest):
    prompt: Any  # PromptInput, checked below for a clear message instead of four union errors
    max_tokens: Int | None = 16
    echo: Bool = False
    logprobs: Int | None = None
    suffix: str | None = None  # not supported: rejected unless empty

    @field_validator("prompt")
    @classmethod
    def _check_prompt(cls, value: Any) -> PromptInput:
        if isinstance(value, str):
            return value
        if isinstance(value, list) and value:
            if all(isinstance(p, str) for p in value):
                return value
            if all(_is_int(t) for t in value):
                return value
            if all(isinstance(p, list) and p and all(_is_int(t) for t in p) for p in value):
                return value
        raise ValueError(
            "must be a string, a non-empty list of strings, a non-empty list of token ids, "
            "or a non-empty list of non-empty token-id lists"
        )


class TextContentPart(OpenAIBaseModel):
    type: Literal["text"]
    text: str


class ChatMessage(OpenAIBaseModel):
    model_config = ConfigDict(extra="allow")  # name, tool_call_id, ... reach the chat template as sent

    role: str
    content: str | list[dict[str, Any]] | None = None


class ChatCompletionRequest(SamplingRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: Int | None = None  # None: up to the context length
    max_completion_tokens: Int | None = None  # OpenAI's newer name; wins over max_tokens
    logprobs: Bool = False
    top_logprobs: Int | None = None
    add_generation_prompt: Bool = True
    chat_template: str | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    # Not supported; a request that sets them is rejected rather than answered without them.
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    response_format: dict[str, Any] | None = None


# ---- responses ------------------------------------------------------------------------------------


class UsageInfo(OpenAIBaseModel):
    prompt_tokens: int = 0
    completion_tokens: int = 0
    total_tokens: int = 0

    @classmethod
    def of(cls, prompt_tokens: int, completion_tokens: int) -> UsageInfo:
        return cls(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
        )


class CompletionLogProbs(OpenAIBaseModel):
    """The legacy completions format: one entry per token (None where nothing predicts a prompt's first token)."""

    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(OpenAIBaseModel):
    index: int
    text: str
    logprobs: CompletionLogProbs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None  # vLLM's extension: the stop string or token id that ended it


class CompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(OpenAIBaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatLogprobEntry(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatLogprobs(OpenAIBaseModel):
    content: list[ChatLogprobEntry] | None = None


class ChatResponseMessage(OpenAIBaseModel):
    role: str = "assistant"
    content: str | None = None


class ChatChoice(OpenAIBaseModel):
    index: int
    message: ChatResponseMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaMessage(OpenAIBaseModel):
    role: str | None = None
    content: str | None = None


class ChatStreamChoice(OpenAIBaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(OpenAIBaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(OpenAIBaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "tritonllm"
    root: str | None = None
    max_model_len: int | None = None


class ModelList(OpenAIBaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]
