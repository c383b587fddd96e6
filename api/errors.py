"""The one exception type the HTTP layer turns into an OpenAI error body."""
from __future__ import annotations


class APIError(Exception):
    """A request the server refuses: ``status`` and a message meant for the client, naming
    the offending field in ``param`` (never internals)."""

    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param = status, message, type_, param
        self.headers = headers or {}


def bad_request(param: str | None, message: str) -> APIError:
    return APIError(400, message, param=param)


__all__ = ["APIError", "bad_request"]
