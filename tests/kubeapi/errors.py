"""Kubernetes `Status` errors: what the real API server answers when a request fails.

Clients branch on `code` and `reason` (kubectl prints `message`; kopf and the
kubernetes client raise typed exceptions from `code`), so these mirror the
real texts closely.
"""

from typing import Any

REASONS = {
    400: "BadRequest",
    401: "Unauthorized",
    403: "Forbidden",
    404: "NotFound",
    405: "MethodNotAllowed",
    406: "NotAcceptable",
    409: "Conflict",
    410: "Expired",
    415: "UnsupportedMediaType",
    422: "Invalid",
    429: "TooManyRequests",
    500: "InternalError",
    503: "ServiceUnavailable",
    504: "Timeout",
}


class ApiError(Exception):
    """A failure rendered as a `v1 Status` object with the given HTTP code."""

    def __init__(self, code: int, message: str, reason: str | None = None, details: dict[str, Any] | None = None):
        super().__init__(message)
        self.code = code
        self.message = message
        self.reason = reason or REASONS.get(code, "Unknown")
        self.details = details

    def status(self) -> dict[str, Any]:
        return status_object(self.code, self.reason, self.message, self.details)


def status_object(code: int, reason: str, message: str, details: dict[str, Any] | None = None) -> dict[str, Any]:
    body: dict[str, Any] = {
        "kind": "Status",
        "apiVersion": "v1",
        "metadata": {},
        "status": "Success" if code < 400 else "Failure",
        "message": message,
        "reason": reason,
        "code": code,
    }
    if details is not None:
        body["details"] = details
    return body


def _details(plural: str, group: str, name: str) -> dict[str, Any]:
    return {"name": name, "group": group, "kind": plural}


def not_found(plural: str, group: str, name: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    return ApiError(404, f'{qualified} "{name}" not found', "NotFound", _details(plural, group, name))


def already_exists(plural: str, group: str, name: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    return ApiError(409, f'{qualified} "{name}" already exists', "AlreadyExists", _details(plural, group, name))


def conflict(plural: str, group: str, name: str) -> ApiError:
    qualified = f"{plural}.{group}" if group else plural
    return ApiError(
        409,
        f'Operation cannot be fulfilled on {qualified} "{name}": the object has been modified; '
        "please apply your changes to the latest version and try again",
        "Conflict",
        _details(plural, group, name),
    )


def invalid(kind: str, group: str, name: str, causes: list[dict[str, str]]) -> ApiError:
    qualified = f"{kind}.{group}" if group else kind
    summary = ", ".join(f"{c['field']}: {c['message']}" for c in causes)
    details = {"name": name, "group": group, "kind": kind, "causes": causes}
    return ApiError(422, f'{qualified} "{name}" is invalid: {summary}', "Invalid", details)


def bad_request(message: str) -> ApiError:
    return ApiError(400, message, "BadRequest")
