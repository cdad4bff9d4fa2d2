"""Error responses: `ApiError` (status, stable `type`, a message saying what to do), the mapping
from SDK exceptions to responses (the remote client maps them back), and the 413s and 404s of
uploads and images."""

from __future__ import annotations

import json
import re

from fastapi import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from collimate_core.sdk.errors import (
    CollimateError,
    InvalidArgument,
    NotFoundError,
    SandboxDied,
    VmDestroyedError,
    WIRE_ERRORS,
)
from collimate_core.sdk.quota import WRITABLE_RULE


class ApiError(StarletteHTTPException):
    """An error response: HTTP status, a stable `type`, and a message saying what to do."""

    def __init__(self, status: int, type: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.type = type
        self.message = message


def _error_of(exc: BaseException) -> ApiError:
    """The response for an SDK exception (see sdk/remote.py for the way back)."""
    if isinstance(exc, ApiError):
        return exc
    msg = str(exc)
    for cls, status, kind in WIRE_ERRORS:
        if isinstance(exc, cls):
            if kind == "authentication":
                return ApiError(status, kind, msg, {"WWW-Authenticate": 'Bearer realm="collimate"'})
            if kind == "capacity":
                return ApiError(status, kind, msg, {"Retry-After": "1"})
            if kind == "engine_error" and "invalid argument" in msg:
                return ApiError(409, "conflict", msg)  # the engine refused the request in the sandbox's state
            return ApiError(status, kind, msg)
    return ApiError(500, "internal", f"internal error ({type(exc).__name__}); the server log has the details")


def _error_body(status: int, type: str, message: str) -> bytes:
    # ensure_ascii: a message may quote user input that is not valid UTF-8 text (lone surrogates)
    return json.dumps({"error": {"type": type, "message": message}}, ensure_ascii=True).encode()


def _error_response(err: ApiError) -> Response:
    return Response(_error_body(err.status_code, err.type, err.message), err.status_code, err.headers, "application/json")


def _check_path(path: str) -> str:
    if not path.startswith("/"):
        raise InvalidArgument(f"path must be an absolute guest path such as /work/x, not {path!r}")
    try:
        path.encode()
    except UnicodeEncodeError:
        raise InvalidArgument(f"path must be valid UTF-8 text, not {path!r}") from None
    return path


_ERRNO = re.compile(r"\(os error (\d+)\)")


def _file_error(e: CollimateError, what: str) -> Exception:
    """A file operation that failed because of the path is the caller's to fix, not an engine
    failure: the status says which way (no such file, not writable, a directory, ...)."""
    if isinstance(e, (SandboxDied, VmDestroyedError)):
        return e
    m = _ERRNO.search(str(e))
    if m is None:
        return e
    errno_ = int(m.group(1))
    if errno_ == 2:  # ENOENT
        return ApiError(404, "not_found", f"{what}: no such file in the sandbox")
    if errno_ in (13, 30, 1):  # EACCES, EROFS, EPERM
        # The engine's message names the path and states the rule (once) where it applies.
        # (A writable root's engine message names the read-only mount instead: it is the truth there.)
        said = WRITABLE_RULE in str(e) or "read-only mount over the sandbox's writable root" in str(e)
        msg = str(e) if said else f"{what}: not writable ({WRITABLE_RULE}): {e}"
        return ApiError(403, "forbidden_path", msg)
    if errno_ in (20, 21, 17, 39):  # ENOTDIR, EISDIR, EEXIST, ENOTEMPTY
        return ApiError(409, "conflict", f"{what}: {e}")
    return InvalidArgument(f"{what}: {e}")



def _too_large(limit: int) -> ApiError:
    return ApiError(413, "payload_too_large", f"request body over the server's limit of {limit} bytes (max_upload); split it")


def _human(n: int) -> str:
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.1f} {unit}"
    return f"{n} B"


def _over_quota(used: int, quota: int, size: int, at_least: bool = False) -> ApiError:
    return ApiError(
        413, "image_quota",
        f"image quota exceeded: this tenant's images take {used} bytes ({_human(used)}) of its quota of {quota} "
        f"bytes ({_human(quota)}), and this upload of {'at least ' if at_least else ''}{size} bytes "
        f"({_human(size)}) does not fit; delete images you no longer need (GET /v1/images lists them, DELETE "
        "/v1/images/{name} removes one, ?digest=sha256:... one upload of it), or ask the operator to raise "
        "--image-quota",
    )


def _no_image(name: str) -> NotFoundError:
    # The same answer for another tenant's image and one that never existed.
    return NotFoundError(f"no image {name!r} in this tenant's image store: GET /v1/images lists its images; "
                         "upload one with POST /v1/images")


def _image_too_large(limit: int) -> ApiError:
    return ApiError(
        413, "payload_too_large",
        f"image archive over the server's limit of {limit} bytes (max_image_upload): make the image smaller (fewer or "
        "smaller layers; compressed layers count compressed), or ask the operator to raise --max-image-upload",
    )
