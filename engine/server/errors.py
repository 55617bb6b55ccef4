"""OpenAI-shaped API errors, and the one mapping from engine errors to HTTP status codes.

Every failure the server answers is an `ApiError`: a status, the OpenAI body
`{"error": {"message", "type", "param", "code"}}` and optional headers (Retry-After). Engine errors
(`engine.errors`) and pydantic validation errors become ApiErrors here and nowhere else, so a route never
decides a status code by itself.
"""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from engine.errors import (
    ConfigError,
    EngineDead,
    NoExpertCache,
    QueueFull,
    RequestRejected,
    StrataError,
    SwitchNeedsRestart,
    UnknownSwitch,
)


class ApiError(Exception):
    """An error answered to the client as `{"error": {...}}` with `status`."""

    def __init__(
        self,
        status: int,
        message: str,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers or {}

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def invalid_param(param: str, value: Any, reason: str) -> ApiError:
    """400 naming the parameter and the value it had."""
    return ApiError(400, f"{param}={_short(value)}: {reason}", param=param, code="invalid_parameter")


def unsupported_param(param: str, value: Any, reason: str) -> ApiError:
    return ApiError(400, f"{param}={_short(value)}: {reason}", param=param, code="unsupported_parameter")


def from_exception(exc: BaseException) -> ApiError:
    """Map an engine error to its HTTP answer; anything unexpected is a 500 that still names the error."""
    if isinstance(exc, ApiError):
        return exc
    if isinstance(exc, RequestRejected):
        return ApiError(400, exc.message, param=exc.param, code=exc.code)
    if isinstance(exc, QueueFull):
        retry_s = max(1, int(round(exc.retry_after_s)))
        return ApiError(503, str(exc), type="server_overloaded", code="queue_full",
                        headers={"Retry-After": str(retry_s)})
    if isinstance(exc, EngineDead):
        return ApiError(503, str(exc), type="engine_dead", code="engine_dead")
    if isinstance(exc, SwitchNeedsRestart):
        return ApiError(409, str(exc), param="name", code="switch_needs_restart")
    if isinstance(exc, NoExpertCache):
        return ApiError(409, str(exc), param="mib", code="no_expert_cache")
    if isinstance(exc, UnknownSwitch):
        return ApiError(404, str(exc), param="name", code="unknown_switch")
    if isinstance(exc, ConfigError):
        return ApiError(400, str(exc), param=exc.param, code="invalid_parameter")
    if isinstance(exc, StrataError):
        return ApiError(500, f"{type(exc).__name__}: {exc}", type="server_error")
    return ApiError(500, f"internal error: {type(exc).__name__}: {exc}", type="server_error")


def from_validation_error(exc: ValidationError, prefix: str = "") -> ApiError:
    """400 naming the first invalid field (dotted path, list indices in brackets) and the value it had."""
    err = min(exc.errors(include_url=False), key=_specificity)
    param = prefix + _loc_to_param(err.get("loc", ()))
    value = err.get("input")
    reason = err.get("msg", "invalid value")
    if err.get("type") == "missing":
        return ApiError(400, f"{param} is required", param=param, code="missing_parameter")
    if err.get("type") == "extra_forbidden":
        return ApiError(400, f"{param}: unknown field", param=param, code="unknown_parameter")
    return invalid_param(param, value, reason)


def malformed_json(detail: str) -> ApiError:
    return ApiError(400, f"malformed JSON body: {detail}", code="malformed_json")


def _loc_to_param(loc: tuple[Any, ...]) -> str:
    # pydantic puts union member names (e.g. "str", "list[int]") into the location; they name no field.
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
        elif isinstance(part, str) and ("[" in part or "-" in part or part in _UNION_TAGS):
            continue
        else:
            out += ("." if out else "") + str(part)
    return out or "body"


def _specificity(err: Any) -> tuple[int, int]:
    # With a union (prompt: str | list[int] | ...) pydantic reports one error per member; the member whose
    # shape matched failed on a bound (e.g. a negative token id) rather than on the type: report that one.
    kind = str(err.get("type", ""))
    mismatch = kind.endswith("_type") or kind.endswith("_parsing")
    return (1 if mismatch else 0, -len(err.get("loc", ())))


_UNION_TAGS = {"str", "int", "float", "bool", "list", "dict", "none", "literal"}


def _short(value: Any, limit: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
