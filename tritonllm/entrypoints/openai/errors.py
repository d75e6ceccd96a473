"""OpenAI-style errors: {"error": {"message", "type", "param", "code"}} with the matching HTTP status."""

from __future__ import annotations

import re

from fastapi.responses import JSONResponse

_PARAM_IN_MESSAGE = re.compile(r"^SamplingParams\.(\w+) ")


class OpenAIError(Exception):
    """An error a client caused or must be told about; the server answers it as OpenAI's API would."""

    def __init__(
        self,
        message: str,
        status_code: int = 400,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.type = type
        self.param = param
        self.code = code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status_code)


def invalid_request(error: ValueError | str, param: str | None = None) -> OpenAIError:
    """A 400 for a ValueError raised by SamplingParams or the engine; names the parameter when it can."""
    message = str(error)
    match = _PARAM_IN_MESSAGE.match(message)
    if match:
        param = param or match.group(1)
        message = message.removeprefix("SamplingParams.")
    return OpenAIError(message, 400, param=param)


def model_not_found(name: str, served: list[str]) -> OpenAIError:
    return OpenAIError(
        f"The model `{name}` does not exist; this server serves {', '.join(map(repr, served))}",
        404,
        param="model",
        code="model_not_found",
    )


def server_error(message: str, status_code: int = 500) -> OpenAIError:
    return OpenAIError(message, status_code, type="server_error")
