"""OpenAI-shaped errors: {"error": {"message", "type", "param", "code"}} with the right status."""

from __future__ import annotations

from starlette.responses import JSONResponse

from engine.async_engine import EngineDeadError, EngineShutdownError
from engine.core.sampling_params import ParamError

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    413: "invalid_request_error",
    429: "rate_limit_error",
    500: "server_error",
    503: "service_unavailable",
    504: "timeout_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param, self.code = status, message, param, code
        self.headers = headers or {}

    def body(self) -> dict:
        return error_body(self.status, self.message, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(
    status: int, message: str, param: str | None = None, code: str | None = None
) -> dict:
    return {
        "error": {
            "message": message,
            "type": _TYPES.get(status, "invalid_request_error"),
            "param": param,
            "code": code,
        }
    }


class RequestFailed(RuntimeError):
    """One request failed inside the engine; the others carry on."""


class RequestRefused(RequestFailed):
    """One request ended inside the engine by its own inputs' fault (its constraints left no
    token to pick): the client's error, a 400."""


class RequestTimeout(RuntimeError):
    """The request ran past `request_timeout_s`; it has been aborted."""


def to_api_error(exc: BaseException) -> APIError | None:
    """The one map from what routes raise to what clients get; None for a bug (a 500 with a
    reference, logged by the caller)."""
    if isinstance(exc, APIError):
        return exc
    if isinstance(exc, ParamError):
        return APIError(400, str(exc), param=exc.param, code="invalid_value")
    if isinstance(exc, EngineDeadError):
        return APIError(503, str(exc), code="engine_dead")
    if isinstance(exc, EngineShutdownError):
        return APIError(503, str(exc), code="shutting_down")
    if isinstance(exc, RequestTimeout):
        return APIError(504, str(exc), code="timeout")
    if isinstance(exc, RequestRefused):
        return APIError(400, str(exc), code="no_token_allowed")
    if isinstance(exc, RequestFailed):
        return APIError(500, str(exc), code="request_failed")
    return None


# what routes may raise on purpose (each handled where raised, not logged as a crash)
CLIENT_ERRORS: tuple[type[Exception], ...] = (
    APIError,
    ParamError,
    EngineDeadError,
    EngineShutdownError,
    RequestTimeout,
    RequestFailed,
)
