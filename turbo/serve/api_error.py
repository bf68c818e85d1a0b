"""OpenAI's error object as an exception: a leaf module (it imports nothing of turbo), so that
images.py, protocol.py and the app can all raise it without an import cycle (protocol imports the
scheduler, which imports images)."""

from __future__ import annotations


class ApiError(Exception):
    """An answer other than 200: OpenAI's error object."""

    def __init__(self, message: str, param: str | None = None, status: int = 400,
                 type: str = "invalid_request_error", code: str | None = None):
        super().__init__(message)
        self.message, self.param, self.status, self.type, self.code = message, param, status, type, code

    def body(self) -> dict:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}
