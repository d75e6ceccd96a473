"""POST /v1/chat/completions: a conversation rendered by the model's chat template, n replies out."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator

import jinja2
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tritonllm.entrypoints.openai.errors import OpenAIError
from tritonllm.entrypoints.openai.protocol import (
    ChatChoice,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatLogprobEntry,
    ChatLogprobs,
    ChatResponseMessage,
    ChatStreamChoice,
    DeltaMessage,
    TopLogprob,
    UsageInfo,
)
from tritonllm.entrypoints.openai.serving import (
    SSE_DONE,
    ServingContext,
    add_all,
    cancel_on_disconnect,
    check_common,
    close_all,
    engine_failure,
    merge,
    random_id,
    resolve_max_tokens,
    sampling_params,
    sse,
    stream_failure,
    streaming_response,
)
from tritonllm.outputs import Logprob

_ROLES = ("system", "developer", "user", "assistant", "tool")


def _messages(req: ChatCompletionRequest) -> list[dict]:
    """Messages as the chat template sees them: text parts joined, anything else refused."""
    messages = []
    for i, m in enumerate(req.messages):
        if m.role not in _ROLES:
            raise OpenAIError(f"messages[{i}].role {m.role!r} is not one of {', '.join(_ROLES)}", param="messages")
        content = m.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise OpenAIError(
                        f"messages[{i}].content has a part of type {part.get('type')!r}; only text parts are supported",
                        param="messages",
                    )
                texts.append(part["text"])
            content = "\n".join(texts)
        messages.append({**(m.model_extra or {}), "role": m.role, "content": content})
    return messages


def _render(ctx: ServingContext, req: ChatCompletionRequest) -> list[int]:
    try:
        text = ctx.tokenizer.apply_chat_template(
            _messages(req),
            add_generation_prompt=req.add_generation_prompt,
            chat_template=req.chat_template,
            **(req.chat_template_kwargs or {}),
        )
    except (ValueError, jinja2.TemplateError) as e:
        raise OpenAIError(f"cannot apply the chat template: {e}", param="messages") from None
    return ctx.tokenizer.encode(text, add_special_tokens=False)


def chat_logprobs(token_ids: list[int], entries: list[dict[int, Logprob]], num_top: int) -> ChatLogprobs:
    content = []
    for token_id, entry in zip(token_ids, entries, strict=True):
        chosen = entry[token_id]
        ranked = sorted(
            ((t, lp) for t, lp in entry.items() if lp.rank is not None and lp.rank <= num_top),
            key=lambda kv: kv[1].rank,
        )
        top = [
            TopLogprob(token=lp.decoded_token, logprob=lp.logprob, bytes=_bytes(lp.decoded_token)) for _, lp in ranked
        ]
        content.append(
            ChatLogprobEntry(
                token=chosen.decoded_token,
                logprob=chosen.logprob,
                bytes=_bytes(chosen.decoded_token),
                top_logprobs=top[:num_top],
            )
        )
    return ChatLogprobs(content=content)


def _bytes(text: str | None) -> list[int] | None:
    return None if text is None else list(text.encode("utf-8"))


async def create_chat_completion(ctx: ServingContext, req: ChatCompletionRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    check_common(req)
    for name in ("tools", "tool_choice", "functions"):
        if getattr(req, name) not in (None, [], "none"):
            raise OpenAIError(f"{name} is not supported", param=name)
    if req.response_format is not None and req.response_format.get("type") != "text":
        raise OpenAIError("response_format other than text is not supported", param="response_format")
    if req.top_logprobs is not None and not req.logprobs:
        raise OpenAIError("top_logprobs needs logprobs set to true", param="top_logprobs")
    prompt_ids = _render(ctx, req)
    requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
    max_tokens = resolve_max_tokens(requested, len(prompt_ids), ctx.max_model_len, what="messages")
    num_top = (req.top_logprobs or 0) if req.logprobs else None
    params = sampling_params(req, max_tokens, num_top)
    request_id = random_id("chatcmpl")
    streams = await add_all(ctx.engine, request_id, [{"prompt_token_ids": prompt_ids}], [params])
    if req.stream:
        return streaming_response(_stream(req, model, request_id, len(prompt_ids), streams), streams)
    return await cancel_on_disconnect(raw, _full(req, model, request_id, len(prompt_ids), streams), streams)


async def _full(req: ChatCompletionRequest, model, request_id, num_prompt: int, streams) -> Response:
    final = None
    try:
        async for _, out in merge(streams):
            final = out
    except Exception as e:  # noqa: BLE001
        raise engine_failure(e) from None
    finally:
        close_all(streams)
    choices = []
    for c in final.outputs:
        logprobs = chat_logprobs(c.token_ids, c.logprobs or [], req.top_logprobs or 0) if req.logprobs else None
        choices.append(
            ChatChoice(
                index=c.index,
                message=ChatResponseMessage(content=c.text),
                logprobs=logprobs,
                finish_reason=c.finish_reason,
                stop_reason=c.stop_reason,
            )
        )
    generated = sum(len(c.token_ids) for c in final.outputs)
    usage = UsageInfo.of(num_prompt, generated)
    body = ChatCompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return JSONResponse(body.model_dump())


def _chunk_json(chunk: ChatCompletionChunk) -> str:
    # Deltas carry only what changed: a key absent from `delta` is not "null" content.
    body = chunk.model_dump()
    for choice in body["choices"]:
        choice["delta"] = {k: v for k, v in choice["delta"].items() if v is not None}
    return sse(body)


async def _stream(req: ChatCompletionRequest, model, request_id, num_prompt: int, streams) -> AsyncIterator[str]:
    created = int(time.time())
    sent_text = [0] * req.n
    sent_tokens = [0] * req.n
    done = [False] * req.n

    def chunk(choices: list[ChatStreamChoice], usage: UsageInfo | None = None) -> str:
        return _chunk_json(
            ChatCompletionChunk(id=request_id, created=created, model=model, choices=choices, usage=usage)
        )

    try:
        yield chunk([ChatStreamChoice(index=j, delta=DeltaMessage(role="assistant", content="")) for j in range(req.n)])
        async for _, out in merge(streams):
            for c in out.outputs:
                j = c.index
                if done[j]:
                    continue
                new_text = c.text[sent_text[j] :]
                num_tokens = len(c.token_ids)
                logprobs = None
                if req.logprobs and num_tokens > sent_tokens[j]:
                    ids = c.token_ids[sent_tokens[j] : num_tokens]
                    logprobs = chat_logprobs(
                        ids, (c.logprobs or [])[sent_tokens[j] : num_tokens], req.top_logprobs or 0
                    )
                if not new_text and logprobs is None and c.finish_reason is None:
                    continue
                sent_text[j], sent_tokens[j], done[j] = len(c.text), num_tokens, c.finish_reason is not None
                delta = DeltaMessage(content=new_text) if new_text else DeltaMessage()
                choice = ChatStreamChoice(
                    index=j, delta=delta, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason
                )
                yield chunk([choice])
        if req.stream_options is not None and req.stream_options.include_usage:
            generated = sum(sent_tokens)
            usage = UsageInfo.of(num_prompt, generated)
            yield chunk([], usage)
        yield SSE_DONE
    except Exception as e:  # noqa: BLE001  (headers are sent: the error goes into the stream)
        yield stream_failure(e)
    finally:
        close_all(streams)
