"""kvflow's one error tree, and the single mapping from it to OpenAI's error JSON.

    KvflowError                    500 InternalServerError
     ├── InvalidRequestError       400 BadRequestError       malformed JSON, bad or missing fields
     ├── AuthenticationError       401 AuthenticationError   missing or unknown API key
     ├── NotFoundError             404 NotFoundError         no such file or batch (the Batch API)
     │    └── ModelNotFoundError   404 NotFoundError         no pool serves the model
     ├── RequestTimeoutError       408 RequestTimeoutError   headers or body not received in time
     ├── PayloadTooLargeError      413 BadRequestError       body over the configured limit
     ├── UriTooLongError           414 BadRequestError       request line over the configured limit
     ├── HeadersTooLargeError      431 BadRequestError       too many or too large request headers
     ├── RateLimitError            429 RateLimitError        shed or over a key's rate (Retry-After)
     ├── UpstreamError             502 BadGatewayError       a model server failed
     └── NoCapacityError           503 ServiceUnavailableError  no endpoint can take the request

The body is the shape vLLM's and OpenAI's servers return::

    {"error": {"message": "...", "type": "BadRequestError", "param": null, "code": 400}}
"""

from __future__ import annotations

from typing import Any, ClassVar


class KvflowError(Exception):
    status: ClassVar[int] = 500
    type: ClassVar[str] = "InternalServerError"

    def __init__(self, message: str, *, param: str | None = None, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.param = param
        self.retry_after = retry_after

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.status, param=self.param)

    def headers(self) -> dict[str, str]:
        if self.retry_after is None:
            return {}
        return {"Retry-After": str(max(1, round(self.retry_after)))}


class InvalidRequestError(KvflowError):
    status = 400
    type = "BadRequestError"


class AuthenticationError(KvflowError):
    status = 401
    type = "AuthenticationError"


class NotFoundError(KvflowError):
    status = 404
    type = "NotFoundError"


class ModelNotFoundError(NotFoundError):
    def __init__(self, model: str) -> None:
        super().__init__(f"The model `{model}` does not exist.", param="model")


class RequestTimeoutError(KvflowError):
    status = 408
    type = "RequestTimeoutError"


class PayloadTooLargeError(KvflowError):
    status = 413
    type = "BadRequestError"


class UriTooLongError(KvflowError):
    status = 414
    type = "BadRequestError"


class HeadersTooLargeError(KvflowError):
    status = 431
    type = "BadRequestError"


class RateLimitError(KvflowError):
    status = 429
    type = "RateLimitError"


class UpstreamError(KvflowError):
    status = 502
    type = "BadGatewayError"


class NoCapacityError(KvflowError):
    status = 503
    type = "ServiceUnavailableError"


def error_body(message: str, type_: str, code: int, *, param: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type_, "param": param, "code": code}}


def from_exception(exc: BaseException) -> KvflowError:
    """Any exception as a KvflowError: ours pass through, others become a 500 with no traceback."""
    if isinstance(exc, KvflowError):
        return exc
    return KvflowError(f"internal error: {type(exc).__name__}")
