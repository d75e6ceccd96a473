"""The OpenAI-compatible HTTP server: a FastAPI app around one engine, and a uvicorn runner.

Routes: GET /v1/models, POST /v1/completions, POST /v1/chat/completions (OpenAI's API; /v1/* needs the
bearer token when an API key is set), GET /health (200, or 503 once the engine failed or lost a tensor-parallel
worker), GET /metrics
(Prometheus text). Every error is answered as {"error": {"message", "type", "param", "code"}}.
"""

from __future__ import annotations

import hmac
import logging
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from tritonllm.entrypoints.openai.async_engine import AsyncLLMEngine, EngineDeadError
from tritonllm.entrypoints.openai.errors import OpenAIError, server_error
from tritonllm.entrypoints.openai.metrics import CONTENT_TYPE, EngineMetrics
from tritonllm.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, ModelCard, ModelList
from tritonllm.entrypoints.openai.serving import ServingContext
from tritonllm.entrypoints.openai.serving_chat import create_chat_completion
from tritonllm.entrypoints.openai.serving_completions import create_completion

if TYPE_CHECKING:
    from tritonllm.runtime.engine import LLMEngine

logger = logging.getLogger(__name__)


class ApiKeyMiddleware:
    """401 for /v1/* requests without `Authorization: Bearer <key>` (plain ASGI, so streams pass untouched)."""

    def __init__(self, app, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http" and scope["path"].startswith("/v1") and scope["method"] != "OPTIONS":
            auth = dict(scope["headers"]).get(b"authorization", b"")
            if not hmac.compare_digest(auth, self.expected):
                error = OpenAIError(
                    "Incorrect or missing API key: send the header 'Authorization: Bearer <key>' with the key "
                    "the server was started with (--api-key)",
                    401,
                    code="invalid_api_key",
                )
                await error.response()(scope, receive, send)
                return
        await self.app(scope, receive, send)


def _validation_error(exc: RequestValidationError) -> OpenAIError:
    errors = exc.errors()
    first = errors[0] if errors else {"loc": (), "msg": "invalid request"}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    if first.get("type") == "json_invalid":
        return OpenAIError(f"the request body is not valid JSON: {first.get('msg')}", param=None, code="invalid_json")
    where = ".".join(loc) or "body"
    msg = first.get("msg", "invalid value").removeprefix("Value error, ")
    more = f" (and {len(errors) - 1} more problems)" if len(errors) > 1 else ""
    return OpenAIError(f"{where}: {msg}{more}", param=loc[0] if loc else None)


def create_app(
    engine: LLMEngine,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
) -> FastAPI:
    """An app serving `engine` under `served_model_names` (default: the engine's model argument).
    The engine thread starts and stops with the app's lifespan."""
    names = list(served_model_names or [engine.config.model])
    metrics = EngineMetrics(names[0])
    async_engine = AsyncLLMEngine(engine, metrics)
    ctx = ServingContext(
        engine=async_engine,
        served_model_names=names,
        model_path=engine.config.model,
        tokenizer=engine.tokenizer,
        max_model_len=engine.max_model_len,
        vocab_size=engine.model_config.vocab_size,
    )

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        metrics.update_engine_state(engine)  # before any request, so /metrics is complete from the start
        async_engine.start()
        try:
            yield
        finally:
            async_engine.shutdown()

    app = FastAPI(title="tritonllm", summary="OpenAI-compatible API of a tritonllm engine", lifespan=lifespan)
    app.state.serving = ctx
    app.state.metrics = metrics
    if api_key:
        app.add_middleware(ApiKeyMiddleware, api_key=api_key)

    @app.exception_handler(OpenAIError)
    async def _openai_error(_: Request, exc: OpenAIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _validation_error(exc).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if exc.status_code < 500 else "server_error"
        return OpenAIError(str(exc.detail), exc.status_code, type=error_type).response()

    @app.exception_handler(Exception)
    async def _unexpected(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error")
        return server_error(f"internal error: {type(exc).__name__}: {exc}").response()

    @app.get("/health")
    async def health() -> Response:
        try:
            async_engine.check_health()
        except EngineDeadError as e:
            return server_error(str(e), 503).response()
        return Response(status_code=200)

    @app.get("/metrics")
    async def get_metrics() -> Response:
        return Response(metrics.render(), media_type=CONTENT_TYPE)

    @app.get("/v1/models")
    async def list_models() -> ModelList:
        cards = [ModelCard(id=name, root=ctx.model_path, max_model_len=ctx.max_model_len) for name in names]
        return ModelList(data=cards)

    @app.post("/v1/completions")
    async def completions(body: CompletionRequest, request: Request) -> Response:
        return await create_completion(ctx, body, request)

    @app.post("/v1/chat/completions")
    async def chat_completions(body: ChatCompletionRequest, request: Request) -> Response:
        return await create_chat_completion(ctx, body, request)

    return app


def run_server(
    engine: LLMEngine,
    host: str = "127.0.0.1",
    port: int = 8000,
    served_model_names: list[str] | None = None,
    api_key: str | None = None,
    log_level: str = "info",
) -> None:
    """Serve until interrupted (Ctrl-C / SIGTERM)."""
    import uvicorn

    app = create_app(engine, served_model_names, api_key)
    names = ", ".join(app.state.serving.served_model_names)
    logger.info("serving %s on http://%s:%d/v1", names, host, port)
    try:
        uvicorn.run(app, host=host, port=port, log_level=log_level, timeout_graceful_shutdown=5)
    finally:
        engine.shutdown()  # tensor-parallel workers exit with the server
