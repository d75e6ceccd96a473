"""POST /v1/completions: prompts (text or token ids, one or many) in, n completions each out.

Choice i * n + j is sample j of prompt i. Each prompt is one engine request; a streamed answer interleaves
their chunks as they come.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from dataclasses import dataclass

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from tritonllm.entrypoints.openai.errors import OpenAIError
from tritonllm.entrypoints.openai.protocol import (
    CompletionChoice,
    CompletionLogProbs,
    CompletionRequest,
    CompletionResponse,
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
from tritonllm.outputs import CompletionOutput, Logprob, RequestOutput


@dataclass(slots=True)
class _Prompt:
    text: str  # as echoed
    token_ids: list[int]


def _prompts(ctx: ServingContext, req: CompletionRequest) -> list[_Prompt]:
    prompt = req.prompt
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], str)):
        texts = [prompt] if isinstance(prompt, str) else prompt
        return [_Prompt(t, ctx.tokenizer.encode(t)) for t in texts]
    id_lists = [prompt] if isinstance(prompt[0], int) else prompt
    for ids in id_lists:
        ctx.check_token_ids(ids)
    return [_Prompt(ctx.tokenizer.decode(ids, skip_special_tokens=req.skip_special_tokens), ids) for ids in id_lists]


def completion_logprobs(
    token_ids: list[int],
    entries: list[dict[int, Logprob] | None],
    num_top: int,
    decode,
    first_offset: int,
) -> CompletionLogProbs:
    """The legacy format: per token its text, its logprob, the top `num_top` (plus the token itself), and
    the character offset where its text starts."""
    out = CompletionLogProbs()
    offset = first_offset
    for token_id, entry in zip(token_ids, entries, strict=True):
        text = entry[token_id].decoded_token if entry is not None else decode(token_id)
        out.tokens.append(text)
        out.text_offset.append(offset)
        offset += len(text)
        if entry is None:
            out.token_logprobs.append(None)
            out.top_logprobs.append(None)
            continue
        out.token_logprobs.append(entry[token_id].logprob)
        ranked = sorted(entry.items(), key=lambda kv: (kv[1].rank or 0, kv[0]))
        top = {
            lp.decoded_token: lp.logprob
            for tid, lp in ranked
            if tid == token_id or (lp.rank is not None and lp.rank <= num_top)
        }
        out.top_logprobs.append(top)
    return out


class _ChoiceState:
    """What one streamed choice has sent so far."""

    __slots__ = ("text_len", "num_tokens", "offset", "echoed", "done")

    def __init__(self) -> None:
        self.text_len = 0  # characters of the generated text sent
        self.num_tokens = 0  # generated tokens whose logprobs were sent
        self.offset = 0  # text_offset of the next token: characters sent, echoed prompt included
        self.echoed = False
        self.done = False


async def create_completion(ctx: ServingContext, req: CompletionRequest, raw: Request) -> Response:
    model = ctx.check_model(req.model)
    check_common(req)
    if req.suffix:
        raise OpenAIError("suffix is not supported", param="suffix")
    prompts = _prompts(ctx, req)
    params = []
    for p in prompts:
        max_tokens = resolve_max_tokens(req.max_tokens, len(p.token_ids), ctx.max_model_len)
        prompt_logprobs = req.logprobs if req.echo and req.logprobs is not None else None
        params.append(sampling_params(req, max_tokens, req.logprobs, prompt_logprobs))
    request_id = random_id("cmpl")
    engine_prompts = [{"prompt": p.text, "prompt_token_ids": p.token_ids} for p in prompts]
    streams = await add_all(ctx.engine, request_id, engine_prompts, params)
    if req.stream:
        body = _stream(ctx, req, model, request_id, prompts, streams)
        return streaming_response(body, streams)
    return await cancel_on_disconnect(raw, _full(ctx, req, model, request_id, prompts, streams), streams)


async def _full(ctx, req: CompletionRequest, model, request_id, prompts: list[_Prompt], streams) -> Response:
    finals: list[RequestOutput | None] = [None] * len(streams)
    try:
        async for i, out in merge(streams):
            finals[i] = out
    except Exception as e:  # noqa: BLE001
        raise engine_failure(e) from None
    finally:
        close_all(streams)
    choices = []
    num_generated = 0
    for i, (prompt, final) in enumerate(zip(prompts, finals, strict=True)):
        for c in final.outputs:
            num_generated += len(c.token_ids)
            choices.append(_choice(ctx, req, i * req.n + c.index, prompt, final, c))
    num_prompt = sum(len(p.token_ids) for p in prompts)
    usage = UsageInfo.of(num_prompt, num_generated)
    body = CompletionResponse(id=request_id, model=model, choices=choices, usage=usage)
    return JSONResponse(body.model_dump())


def _choice(ctx, req: CompletionRequest, index: int, prompt: _Prompt, final: RequestOutput, c: CompletionOutput):
    text = prompt.text + c.text if req.echo else c.text
    logprobs = None
    if req.logprobs is not None:
        ids, entries = list(c.token_ids), list(c.logprobs or [])
        if req.echo:
            ids = prompt.token_ids + ids
            entries = list(final.prompt_logprobs or [None] * len(prompt.token_ids)) + entries
        logprobs = completion_logprobs(ids, entries, req.logprobs, _decoder(ctx), 0)
    return CompletionChoice(
        index=index, text=text, logprobs=logprobs, finish_reason=c.finish_reason, stop_reason=c.stop_reason
    )


def _decoder(ctx: ServingContext):
    return lambda token_id: ctx.tokenizer.decode([token_id], skip_special_tokens=False)


async def _stream(
    ctx, req: CompletionRequest, model, request_id, prompts: list[_Prompt], streams
) -> AsyncIterator[str]:
    created = int(time.time())
    n = req.n
    states = {(i, j): _ChoiceState() for i in range(len(prompts)) for j in range(n)}
    num_generated = [[0] * n for _ in prompts]
    decode = _decoder(ctx)

    def chunk(index: int, text: str, logprobs=None, finish_reason=None, stop_reason=None) -> str:
        choice = CompletionChoice(
            index=index, text=text, logprobs=logprobs, finish_reason=finish_reason, stop_reason=stop_reason
        )
        body = CompletionResponse(id=request_id, created=created, model=model, choices=[choice])
        return sse(body.model_dump_json())

    try:
        async for i, out in merge(streams):
            for c in out.outputs:
                state = states[i, c.index]
                if state.done:
                    continue
                if req.echo and not state.echoed:
                    # With logprobs the prompt goes out once its logprobs are known (all at once, complete).
                    if req.logprobs is not None and out.prompt_logprobs is None:
                        continue
                    prompt_logprobs = None
                    if req.logprobs is not None:
                        entries = list(out.prompt_logprobs)
                        prompt_logprobs = completion_logprobs(prompts[i].token_ids, entries, req.logprobs, decode, 0)
                    yield chunk(i * n + c.index, prompts[i].text, prompt_logprobs)
                    state.offset, state.echoed = len(prompts[i].text), True
                logprobs = None
                new_text = c.text[state.text_len :]
                num_tokens = len(c.token_ids)
                if req.logprobs is not None and num_tokens > state.num_tokens:
                    entries = (c.logprobs or [])[state.num_tokens : num_tokens]
                    ids = c.token_ids[state.num_tokens : num_tokens]
                    logprobs = completion_logprobs(ids, entries, req.logprobs, decode, state.offset)
                    state.offset += sum(len(t) for t in logprobs.tokens)
                if not new_text and logprobs is None and c.finish_reason is None:
                    continue
                state.text_len, state.num_tokens = len(c.text), num_tokens
                state.done = c.finish_reason is not None
                num_generated[i][c.index] = num_tokens
                yield chunk(i * n + c.index, new_text, logprobs, c.finish_reason, c.stop_reason)
        if req.stream_options is not None and req.stream_options.include_usage:
            num_prompt = sum(len(p.token_ids) for p in prompts)
            completion = sum(map(sum, num_generated))
            usage = UsageInfo.of(num_prompt, completion)
            body = CompletionResponse(id=request_id, created=created, model=model, choices=[], usage=usage)
            yield sse(body.model_dump_json())
        yield SSE_DONE
    except Exception as e:  # noqa: BLE001  (headers are sent: the error goes into the stream)
        yield stream_failure(e)
    finally:
        close_all(streams)
