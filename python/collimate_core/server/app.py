"""The control-plane worker: the SDK surface over HTTP, on the embedded engine of this host.

`collimate serve` runs it (FastAPI on uvicorn). Everything under /v1 needs `Authorization: Bearer
col_...` (keys: `collimate keys create --tenant T`, see keys.py); each key belongs to a tenant,
and a tenant sees only its own sandboxes: anything else is 404, exactly like an id that never
existed. /openapi.json (the document, also committed as docs/openapi.json), /metrics (Prometheus
text) and /healthz are open.

Capacity. At most `max_sandboxes` sandboxes are live. A create or fork that does not fit waits in
a FIFO queue of at most `queue` requests for up to `queue_timeout` seconds; past the bound, or past
the wait, it gets 429 naming the limit. A fork group wider than the whole server gets 409.
A tenant whose sandbox-seconds reach `spend_limit` gets 402 on new sandboxes, forks and execs
(deleting always works). Sandboxes nobody touched for `idle_reap` seconds are destroyed: the
remote client keeps its live sandboxes alive, so these are the sandboxes of clients that died.

Templates. The catalog templates (python) are shared by every tenant and read-only. A tenant
bakes its own from a container image it uploads (POST /v1/images: an OCI layout archive or a
`docker save` archive, verified and kept in that tenant's own image store) with POST
/v1/templates; the bake runs in the background, GET /v1/templates/{name} reports it (Building,
Live, or Failed with the build log). Each tenant's templates live in a namespace of their own: the
engine knows them as `tenant-<hash of the tenant>/<name>`, which never appears in a response;
another tenant's template is 404, exactly like one that never existed. Images are named by a
reference into the tenant's store, never by a path on this host. GET /v1/images lists a tenant's
uploads, DELETE /v1/images/{name} removes them (templates baked from them keep their own root
filesystem); the archives a tenant keeps count against its image quota (`image_quota` bytes; an
upload past it is 413).

Logs are JSON lines on stderr: one per request, plus lifecycle events (listening, reaped, ...).
"""

from __future__ import annotations

import asyncio
import base64
import functools
import hashlib
import io
import json
import logging
import math
import os
import re
import secrets
import socket
import sys
import threading
import time
from collections import deque
from contextlib import asynccontextmanager, contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import anyio
from fastapi import Body, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import JSONResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from pydantic import BaseModel, ConfigDict, Field
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

from collimate_core.templates import cache as _cache
from collimate_core.sdk.errors import (
    AuthenticationError,
    CapacityError,
    CollimateError,
    EngineError,
    InvalidArgument,
    NotFoundError,
    SandboxDied,
    SandboxTimeout,
    VmDestroyedError,
)
from collimate_core.server.keys import KeyStore
from collimate_core.sdk.meter import Meter as _Meter
from collimate_core.templates.catalog import CATALOG, cache_dir

API_VERSION = "1.0.0"
DEFAULT_PORT = 8477
MAX_JSON_BODY = 32 << 20  # an exec's code, a keepalive list: far below this
MAX_EXEC_SECONDS = 3600.0
MAX_WIDTH = 1024
MAX_PATH = 4096
MAX_READY_SECONDS = 3600.0
# A tenant's template names: no "/" (one path segment), nothing that reads as a version ("@").
TEMPLATE_NAME = r"^[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}$"
# The name an uploaded image is stored under: a repository name, so `name@sha256:...` resolves.
IMAGE_NAME = r"^[a-z0-9]+(?:[._-][a-z0-9]+){0,63}$"
DIGEST = r"^sha256:[0-9a-f]{64}$"

log = logging.getLogger("collimate.server")


# --- configuration and errors -----------------------------------------------------------------


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = DEFAULT_PORT
    max_sandboxes: int = 64
    queue: int = 256
    queue_timeout: float = 60.0
    idle_reap: float = 600.0
    spend_limit: float | None = None  # sandbox-seconds per tenant over the server's life
    max_upload: int = 64 << 20
    max_image_upload: int = 4 << 30  # bytes of one image archive (POST /v1/images)
    max_bakes: int = 2  # bakes running at once on this server; more get 429
    image_quota: int = 20 << 30  # bytes of image archives each tenant may keep (0: no quota)
    key_store: Path | None = None
    cache: Path | None = None
    preload: tuple[str, ...] = ("python",)
    # Each sandbox's writable mounts together (the default and the most a request may ask for), and
    # the host budget (guest memory + disk quota of every live sandbox; None: no budget). See _quota.
    disk_quota: int = 1 << 30
    memory_budget: int | None = None


class ApiError(StarletteHTTPException):
    """An error response: HTTP status, a stable `type`, and a message saying what to do."""

    def __init__(self, status: int, type: str, message: str, headers: dict[str, str] | None = None):
        super().__init__(status, message, headers)
        self.type = type
        self.message = message


def _error_of(exc: BaseException) -> ApiError:
    """The response for an SDK exception (see _remote.py for the way back)."""
    if isinstance(exc, ApiError):
        return exc
    msg = str(exc)
    if isinstance(exc, AuthenticationError):
        return ApiError(401, "authentication", msg, {"WWW-Authenticate": 'Bearer realm="collimate"'})
    if isinstance(exc, InvalidArgument):
        return ApiError(400, "invalid_argument", msg)
    if isinstance(exc, (NotFoundError, VmDestroyedError)):
        return ApiError(404, "not_found", msg)
    if isinstance(exc, CapacityError):
        return ApiError(503, "capacity", msg, {"Retry-After": "1"})
    if isinstance(exc, SandboxTimeout):
        return ApiError(504, "timeout", msg)
    if isinstance(exc, SandboxDied):
        return ApiError(410, "sandbox_died", msg)
    if isinstance(exc, EngineError):
        if "invalid argument" in msg:  # the engine refused the request in the sandbox's state
            return ApiError(409, "conflict", msg)
        return ApiError(500, "engine_error", msg)
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
        return ApiError(403, "forbidden_path", f"{what}: not writable here (only /tmp and /work are writable): {e}")
    if errno_ in (20, 21, 17, 39):  # ENOTDIR, EISDIR, EEXIST, ENOTEMPTY
        return ApiError(409, "conflict", f"{what}: {e}")
    return InvalidArgument(f"{what}: {e}")


# --- admission --------------------------------------------------------------------------------


class _Admission:
    """Slots for live sandboxes; requests that do not fit wait in a bounded FIFO queue.

    Runs on the event loop only (threads call `release` through `call_soon_threadsafe`).
    """

    def __init__(self, limit: int, bound: int, timeout: float, metrics: "_Metrics"):
        self.limit, self.bound, self.timeout, self.metrics = limit, bound, timeout, metrics
        self.used = 0
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()

    def _gauges(self) -> None:
        self.metrics.live.set(self.used)
        self.metrics.queue_depth.set(len(self.waiting))

    async def acquire(self, n: int) -> None:
        if n > self.limit:
            self.metrics.rejected.labels("too_wide").inc()
            raise ApiError(
                409, "capacity",
                f"{n} sandboxes can never fit: this server runs at most max_sandboxes={self.limit} live sandboxes",
            )
        if not self.waiting and self.used + n <= self.limit:
            self.used += n
            self._gauges()
            return
        if len(self.waiting) >= self.bound:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(
                429, "capacity",
                f"capacity queue full: {len(self.waiting)} requests already wait (queue bound {self.bound}) for "
                f"max_sandboxes={self.limit} live sandboxes; retry later or delete sandboxes",
                {"Retry-After": "1"},
            )
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self.waiting.append(entry)
        self.metrics.queued.inc()
        self._gauges()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except asyncio.TimeoutError:
            if fut.done():
                return  # granted as the wait ran out
            self.waiting.remove(entry)
            self.metrics.rejected.labels("queue_timeout").inc()
            raise ApiError(
                429, "capacity",
                f"waited {self.timeout:g} s (queue_timeout) for one of max_sandboxes={self.limit} live sandboxes; "
                "retry later or delete sandboxes",
                {"Retry-After": "1"},
            ) from None
        except asyncio.CancelledError:
            if fut.done():
                self.release(n)
            else:
                self.waiting.remove(entry)
            raise
        finally:
            self._gauges()

    def release(self, n: int) -> None:
        self.used -= n
        while self.waiting and self.used + self.waiting[0][0] <= self.limit:
            k, fut = self.waiting.popleft()
            self.used += k
            fut.set_result(None)
        self._gauges()


# --- metrics ----------------------------------------------------------------------------------

_LATENCY_BUCKETS = (0.00025, 0.0005, 0.001, 0.002, 0.004, 0.008, 0.016, 0.032, 0.064, 0.128, 0.256, 0.512, 1, 2, 4, 8)


class _Metrics:
    """Prometheus metrics of one server, in a registry of its own."""

    def __init__(self) -> None:
        r = self.registry = CollectorRegistry()
        self.fork_seconds = Histogram(
            "collimate_fork_seconds", "Engine time to clone a sandbox from a template (kind=clone) or to fork a "
            "live sandbox into a group (kind=fork)", ["kind"], buckets=_LATENCY_BUCKETS, registry=r)
        self.exec_seconds = Histogram("collimate_exec_seconds", "Wall time of execs", buckets=_LATENCY_BUCKETS, registry=r)
        self.request_seconds = Histogram(
            "collimate_request_seconds", "HTTP request latency by route", ["route"], buckets=_LATENCY_BUCKETS, registry=r)
        self.requests = Counter("collimate_requests", "HTTP requests", ["method", "route", "status"], registry=r)
        self.created = Counter("collimate_sandboxes_created", "Sandboxes created", ["kind"], registry=r)
        self.destroyed = Counter("collimate_sandboxes_destroyed", "Sandboxes destroyed", ["reason"], registry=r)
        self.execs = Counter("collimate_execs", "Execs run", registry=r)
        self.queued = Counter("collimate_capacity_queued", "Requests that waited in the capacity queue", registry=r)
        self.rejected = Counter(
            "collimate_capacity_rejections", "Requests refused for capacity or spend", ["reason"], registry=r)
        self.auth_failures = Counter("collimate_auth_failures", "Requests with a missing or wrong API key", registry=r)
        self.live = Gauge("collimate_live_sandboxes", "Live sandboxes (admission slots in use)", registry=r)
        self.queue_depth = Gauge("collimate_queue_depth", "Requests waiting for capacity", registry=r)
        self.max_sandboxes = Gauge("collimate_max_sandboxes", "The live sandbox limit", registry=r)


# --- logging ----------------------------------------------------------------------------------


class JsonLines(logging.Formatter):
    """One JSON object per line: ts, level, logger, event, and the record's `fields`."""

    def format(self, record: logging.LogRecord) -> str:
        d: dict[str, Any] = {
            "ts": round(record.created, 6),
            "level": record.levelname.lower(),
            "logger": record.name,
            "event": record.getMessage(),
        }
        d.update(getattr(record, "fields", {}))
        if record.exc_info:
            d["exc"] = self.formatException(record.exc_info)
        return json.dumps(d, default=str)


def configure_logging(level: int = logging.INFO) -> None:
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonLines())
    for name in ("collimate", "uvicorn", "uvicorn.error"):
        lg = logging.getLogger(name)
        lg.handlers[:] = [handler]
        lg.setLevel(level)
        lg.propagate = False
    logging.getLogger("uvicorn.access").disabled = True  # the request log below replaces it


def _event(event: str, level: int = logging.INFO, **fields: Any) -> None:
    log.log(level, event, extra={"fields": fields})


# --- API models -------------------------------------------------------------------------------


class ErrorDetail(BaseModel):
    type: str = Field(description="invalid_argument, authentication, spend_limit, not_found, sandbox_died, "
                      "capacity, conflict, payload_too_large, image_quota, timeout, engine_error, internal")
    message: str


class ErrorBody(BaseModel):
    error: ErrorDetail


class TemplateInfo(BaseModel):
    id: str = Field(description="the name to use in paths and in create_sandbox")
    name: str
    kind: str = Field(description="'catalog': shared by every tenant, read-only; 'image': baked by this tenant")
    live: bool = Field(description="whether its zygote runs on this server")
    expected_width: int = Field(description="the width this tenant declared with expect (0: none)")
    phase: str = Field("Live", description="Building, Live or Failed (of the latest bake; catalog: Live)")
    version: int | None = Field(None, description="the version of the latest bake (image templates)")
    error: str | None = Field(None, description="why the bake failed (one line)")
    log: str | None = Field(None, description="the build log, timestamped (get_template and bake_template)")
    image: str | None = Field(None, description="the image reference it was baked from")
    digest: str | None = Field(None, description="the image's manifest digest (docker save: its image id)")
    image_id: str | None = Field(None, description="the image's config digest")
    agent: str | None = Field(None, description="'python' (code and command execs) or 'exec' (command execs only)")
    seed_ack: str | None = Field(None, description="'verified' with the Python agent's handshake, else 'off'")
    width: int | None = Field(None, description="the width declared at the bake")
    user: dict[str, Any] | None = Field(None, description="the image's User, resolved")
    entrypoint: list[str] | None = None
    cmd: list[str] | None = None
    working_dir: str | None = None
    env: dict[str, str] | None = None
    created: float | None = Field(None, description="Unix time the bake started")
    seconds: float | None = Field(None, description="how long the bake took (so far)")


class TemplateList(BaseModel):
    templates: list[TemplateInfo]


class ReadySpec(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    cmd: str = Field(None, max_length=1 << 20, description="a command run before the checkpoint (must exit 0)")
    code: str = Field(None, max_length=1 << 20,
                      description="Python run in the template's interpreter: what it imports stays loaded in every clone")
    timeout_seconds: float = Field(600.0, gt=0, le=MAX_READY_SECONDS, description="for each of cmd and code")


class BakeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    name: str = Field(min_length=1, max_length=128, pattern=TEMPLATE_NAME,
                      description="the template's name in this tenant's namespace")
    image: str = Field(min_length=1, max_length=1024,
                       description="a reference into this tenant's image store, as POST /v1/images answers it "
                       "(name, name:tag, name@sha256:...); never a path")
    ready: ReadySpec = Field(default_factory=ReadySpec)
    width: int = Field(1, ge=1, le=MAX_WIDTH, description="how wide you expect to fork (keeps clones ready)")


class ImageInfo(BaseModel):
    name: str = Field(description="the name it is stored under in this tenant's image store")
    reference: str = Field(description="name@digest: bake from this (POST /v1/templates image=...); it names "
                           "exactly this upload, also after newer uploads under the same name")
    digest: str = Field(description="the image's manifest digest (docker save: its image id)")
    image_id: str = Field(description="the image's config digest")
    format: str = Field(description="oci-archive or docker-save")
    layers: int
    bytes: int = Field(description="the archive's size: what it takes of the tenant's image quota")
    uploaded: float = Field(description="Unix time of the upload")
    latest: bool = Field(True, description="whether the bare name refers to this upload: the newest under the name "
                         "(older ones stay, named by their reference, until deleted)")


class ImageDetail(ImageInfo):
    versions: list[ImageInfo] = Field(description="every upload kept under the name, newest (latest) first")


class ImageList(BaseModel):
    images: list[ImageInfo] = Field(description="every upload kept, by name, newest first within a name")
    used_bytes: int = Field(description="bytes of image archives this tenant keeps")
    quota_bytes: int | None = Field(description="this tenant's image quota in bytes (null: none)")


class ExpectRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    width: int = Field(ge=0, le=MAX_WIDTH, description="how many clones to keep ready (a hint; clamped to the pool limit)")


class CreateSandbox(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    template: str = Field("python", min_length=1, max_length=128)
    disk_quota: int | None = Field(
        None, ge=1 << 20, description="bytes for /tmp, /work and /dev/shm together (default: the template's, "
        "else the server's --disk-quota, which is also the most a request may ask for)",
    )


class DiskUsage(BaseModel):
    bytes: int = Field(description="what /tmp, /work and /dev/shm hold together")
    inodes: int
    quota_bytes: int = Field(description="past it the guest gets ENOSPC")
    quota_inodes: int


class SandboxInfo(BaseModel):
    id: str
    template: str
    warm_hit: bool = Field(description="served from the template's pool of ready clones")
    parent: str | None = Field(description="the sandbox this one was forked from")
    created: float = Field(description="Unix time")
    idle_seconds: float
    idle_timeout_seconds: float = Field(description="an untouched sandbox is destroyed after this long")
    disk: DiskUsage | None = Field(None, description="the writable mounts' usage and quota (null: no quotas on this host)")


class SandboxList(BaseModel):
    sandboxes: list[SandboxInfo]


class ExecRequest(BaseModel):
    model_config = ConfigDict(
        extra="forbid",
        strict=True,
        json_schema_extra={"oneOf": [{"required": ["code"]}, {"required": ["command"]}]},
    )
    code: str = Field(None, description="Python source, run in the sandbox's persistent interpreter")
    command: str = Field(None, description="a shell command (/bin/sh -c)")
    timeout_seconds: float = Field(60.0, gt=0, le=MAX_EXEC_SECONDS)
    seed: str = Field(None, pattern=r"^[0-9a-fA-F]{64}$", description="pin the guest CRNG (32 bytes as hex)")
    env: dict[str, str] = Field(None)
    cwd: str = Field(None, max_length=MAX_PATH)


class ExecResponse(BaseModel):
    exit_code: int
    ok: bool
    stdout: str = Field(description="decoded as UTF-8; invalid bytes replaced")
    stderr: str
    stdout_b64: str | None = Field(description="the exact bytes, base64, when stdout is not valid UTF-8")
    stderr_b64: str | None
    seed: str = Field(description="the seed the guest CRNG was pinned with: replay with it")
    seed_ack: str = Field(description="verified, no-ack, off or mismatch")
    duration: float
    timed_out: bool
    truncated: bool
    interpreter_died: bool = Field(
        False, description="this exec ended the sandbox's interpreter (guest pid 1): the next exec runs in a fresh one"
    )
    interpreter_restarted: bool = Field(
        False,
        description="this exec ran in a fresh interpreter restored from the template: an earlier exec's interpreter "
        "died or timed out, and its Python state, processes and files in /tmp and /work are gone",
    )
    note: str = Field("", description="what happened to the interpreter, in words ('' when nothing did)")


class UploadResponse(BaseModel):
    path: str
    bytes: int


class ForkGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    width: int = Field(ge=1, le=MAX_WIDTH)


class ForkGroupResponse(BaseModel):
    sandboxes: list[SandboxInfo]


class KeepaliveRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    ids: list[str] = Field(max_length=100_000)


class KeepaliveResponse(BaseModel):
    alive: list[str]
    gone: list[str]


class UsageResponse(BaseModel):
    tenant: str
    since: float | None
    until: float
    sandbox_seconds: float
    sandboxes: int
    execs: int
    forks: int
    bytes_in: int
    bytes_out: int
    live_sandboxes: int
    spend_limit_seconds: float | None = Field(description="this tenant's limit in sandbox-seconds (null: none)")
    spent_seconds: float = Field(description="sandbox-seconds counted against the limit")


# --- the control plane ------------------------------------------------------------------------


class _Owned:
    """A live sandbox of a tenant."""

    __slots__ = ("box", "tenant", "template", "parent", "created", "last_used", "busy")

    def __init__(self, box: Any, tenant: str, template: str, parent: str | None):
        self.box, self.tenant, self.template, self.parent = box, tenant, template, parent
        self.created = time.time()
        self.last_used = time.monotonic()
        self.busy = 0


class ControlPlane:
    """The server's state: the engine, tenants' sandboxes, admission, metering. The engine's
    blocking calls run in worker threads; admission runs on the event loop."""

    def __init__(self, config: ServerConfig, *, engine: Any = None, keys: KeyStore | None = None):
        self.config = config
        self.engine = engine
        self.keys = keys or KeyStore(config.key_store)
        self.metrics = _Metrics()
        self.metrics.max_sandboxes.set(config.max_sandboxes)
        self.admission = _Admission(config.max_sandboxes, config.queue, config.queue_timeout, self.metrics)
        self._lock = threading.Lock()
        self._owned: dict[str, _Owned] = {}
        self._meters: dict[str, _Meter] = {}
        self._expect: dict[str, dict[str, int]] = {}  # engine template name -> tenant -> width
        self._live_templates: set[str] = set()  # engine template names whose zygote runs
        self._bakes: dict[str, Any] = {}  # engine name of a tenant template -> its latest bake here (a TemplateHandle)
        self._starting: set[str] = set()  # bakes being admitted (between the checks and Template.bake)
        self._baked: set[str] = set()  # engine names of tenant templates known to have a live version
        self._stores: dict[str, _ImageStore] = {}  # tenant -> its image store
        self.cache: Path | None = None
        self.loop: asyncio.AbstractEventLoop | None = None
        self.limiter: anyio.CapacityLimiter | None = None
        self._reaper: asyncio.Task | None = None

    # lifecycle
    async def start(self) -> None:
        self.loop = asyncio.get_running_loop()
        self.limiter = anyio.CapacityLimiter(self.config.max_sandboxes + 32)
        if self.engine is None:
            from collimate_core.sdk.embedded import EmbeddedClient

            # The server admits sandboxes itself; the engine's own limit is a backstop.
            # An absolute path: responses show a tenant its bake logs with the cache's path taken out.
            self.engine = EmbeddedClient(cache=Path(self.config.cache or cache_dir()).absolute(),
                                         max_sandboxes=self.config.max_sandboxes, capacity_timeout=5.0,
                                         disk_quota=self.config.disk_quota, memory_budget=self.config.memory_budget)
        self.cache = Path(getattr(self.engine, "cache", None) or self.config.cache or cache_dir()).absolute()
        for name in self.config.preload:
            try:
                t = time.perf_counter()
                await self.run(self.engine.expect_width, name, 2)
                self._live_templates.add(name)
                _event("template_ready", template=name, seconds=round(time.perf_counter() - t, 3))
            except Exception as e:  # noqa: BLE001 - the server still serves; requests get the error
                _event("template_failed", logging.ERROR, template=name, error=str(e))
        self._reaper = asyncio.create_task(self._reap_loop())
        _event("ready", max_sandboxes=self.config.max_sandboxes)

    async def stop(self) -> None:
        if self._reaper is not None:
            self._reaper.cancel()
        if self.engine is not None:
            await anyio.to_thread.run_sync(self.engine.close)
        _event("stopped")

    async def run(self, fn: Callable, *args: Any, **kw: Any) -> Any:
        return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kw), limiter=self.limiter)

    def _release_soon(self, n: int) -> None:
        assert self.loop is not None
        self.loop.call_soon_threadsafe(self.admission.release, n)

    def _meter(self, tenant: str) -> _Meter:
        m = self._meters.get(tenant)
        if m is None:
            m = self._meters[tenant] = _Meter()
        return m

    # tenants
    def authenticate(self, authorization: str | None) -> str:
        key = None
        if authorization:
            scheme, _, cred = authorization.partition(" ")
            if scheme.lower() == "bearer":
                key = cred.strip()
        return self.keys.authenticate(key)

    def spent(self, tenant: str) -> float:
        now = time.time()
        with self._lock:
            live = sum(now - r.created for r in self._owned.values() if r.tenant == tenant)
            return self._meter(tenant).spent + live

    def check_spend(self, tenant: str) -> None:
        limit = self.config.spend_limit
        if limit is None:
            return
        spent = self.spent(tenant)
        if spent >= limit:
            self.metrics.rejected.labels("spend_limit").inc()
            raise ApiError(
                402, "spend_limit",
                f"spend limit reached: tenant {tenant!r} has used {spent:.1f} of its {limit:g} sandbox-seconds "
                "(spend_limit); delete idle sandboxes or raise the limit",
            )

    # templates
    def engine_name(self, tenant: str, name: str) -> str:
        """The engine's name of a tenant's template `name` (a catalog name is itself)."""
        if name in CATALOG:
            return name
        return f"{_namespace(tenant)}{name}"

    def image_store(self, tenant: str) -> Path:
        """The tenant's own image store: what it uploaded, and nothing else."""
        assert self.cache is not None
        return self.cache / "tenants" / _tenant_key(tenant) / "images"

    def images_of(self, tenant: str) -> "_ImageStore":
        with self._lock:
            st = self._stores.get(tenant)
            if st is None:
                st = self._stores[tenant] = _ImageStore(self.image_store(tenant))
            return st

    def _missing(self, name: str) -> NotFoundError:
        # The same answer for another tenant's template and one that never existed.
        return NotFoundError(f"no template {name!r}: the catalog has {', '.join(CATALOG)}; bake your own with "
                             "POST /v1/templates (Template.bake)")

    def scrub(self, tenant: str, text: str | None) -> str | None:
        """`text` without what a tenant must not see: engine names and paths on this host."""
        if not text:
            return text
        text = text.replace(str(self.image_store(tenant)), "<image store>")
        if self.cache is not None:
            text = text.replace(str(self.cache), "<server cache>")
        return text.replace(_namespace(tenant), "")

    def _scrubbed(self, tenant: str, e: BaseException) -> ApiError:
        err = _error_of(e)
        if err.status_code >= 500:
            _event("engine_error", logging.ERROR, error=str(e), type=type(e).__name__, tenant=tenant)
        return ApiError(err.status_code, err.type, self.scrub(tenant, err.message) or err.message, err.headers)

    def _building(self, internal: str) -> bool:
        h = self._bakes.get(internal)
        return internal in self._starting or (h is not None and not h._build.done.is_set())

    def _on_disk(self, internal: str) -> bool:
        """Whether a tenant template has a committed version (a cheap look at its index)."""
        from collimate_core.templates import bake as _bake

        assert self.cache is not None
        return _bake._current(_bake._tdir(self.cache, internal)) is not None

    def resolve_template(self, tenant: str, name: str) -> str:
        """The engine name of a template this tenant may start sandboxes of; 404 otherwise (409
        while its first version is still building)."""
        if name in CATALOG:
            return name
        if not isinstance(name, str) or not re.fullmatch(TEMPLATE_NAME, name):
            raise self._missing(name)
        internal = self.engine_name(tenant, name)
        with self._lock:
            if internal in self._baked:
                return internal
            building = self._building(internal)
        if self._on_disk(internal):
            with self._lock:
                self._baked.add(internal)
            return internal
        if building:
            raise ApiError(409, "conflict", f"template {name!r} is still building: wait until GET /v1/templates/{name} "
                                            "says Live (handle.wait()), then start sandboxes of it")
        raise self._missing(name)

    def _image_status(self, tenant: str, name: str) -> Any:
        """The status of the tenant's template `name`: its latest bake on this server, else its
        current version on disk; None if it has neither. Blocking (reads the template's files)."""
        from collimate_core.templates.bake import Template

        internal = self.engine_name(tenant, name)
        with self._lock:
            h = self._bakes.get(internal)
        if h is not None:
            return h.status()
        try:
            st = Template.get(self.engine, internal).status()
        except NotFoundError:
            return None
        return st if st.phase == "Live" else None

    def _image_info(self, tenant: str, name: str, st: Any, with_log: bool) -> TemplateInfo:
        internal = self.engine_name(tenant, name)
        if st.phase == "Live":
            with self._lock:
                self._baked.add(internal)
        with self._lock:
            width = self._expect.get(internal, {}).get(tenant, 0)
        return TemplateInfo(
            id=name, name=name, kind="image", live=internal in self._live_templates, expected_width=width,
            phase=st.phase, version=st.version, error=self.scrub(tenant, st.error),
            log=self.scrub(tenant, st.log) if with_log else None, image=self.scrub(tenant, st.image),
            digest=st.digest, image_id=st.image_id, agent=st.agent, seed_ack=st.seed_ack, width=st.width,
            user=dict(st.user or {}), entrypoint=list(st.entrypoint or []), cmd=list(st.cmd or []),
            working_dir=st.working_dir, env=dict(st.env or {}), created=st.created, seconds=st.seconds,
        )

    def _catalog_info(self, tenant: str, name: str) -> TemplateInfo:
        with self._lock:
            width = self._expect.get(name, {}).get(tenant, 0)
        return TemplateInfo(id=name, name=name, kind="catalog", live=name in self._live_templates, expected_width=width)

    async def template_info(self, tenant: str, name: str, with_log: bool = True) -> TemplateInfo:
        if name in CATALOG:
            return self._catalog_info(tenant, name)
        if not re.fullmatch(TEMPLATE_NAME, name):
            raise self._missing(name)
        st = await self.run(self._image_status, tenant, name)
        if st is None:
            raise self._missing(name)
        return self._image_info(tenant, name, st, with_log)

    async def list_templates(self, tenant: str) -> list[TemplateInfo]:
        """The catalog, then this tenant's own templates (no one else's)."""
        from collimate_core.templates.bake import Template

        prefix = _namespace(tenant)
        on_disk = await self.run(Template.list, self.engine)
        names = {st.name[len(prefix):] for st in on_disk if st.name.startswith(prefix)}
        with self._lock:
            names |= {k[len(prefix):] for k in self._bakes if k.startswith(prefix)}
        out = [self._catalog_info(tenant, n) for n in CATALOG]
        for n in sorted(names):
            st = await self.run(self._image_status, tenant, n)
            if st is not None:
                out.append(self._image_info(tenant, n, st, with_log=False))
        return out

    async def bake(self, tenant: str, req: BakeRequest) -> TemplateInfo:
        """Start baking `req.image` (a reference into the tenant's image store) into the tenant's
        template `req.name`; the bake runs in the background (Template.bake's thread)."""
        from collimate_core.templates import oci as _oci
        from collimate_core.templates.bake import Ready, Template

        name = req.name
        if name in CATALOG:
            raise ApiError(409, "conflict", f"{name!r} is a catalog template, shared by every tenant: bake your image "
                                            "under another name")
        ref = _check_image_reference(req.image)
        ready = Ready(cmd=req.ready.cmd, code=req.ready.code, timeout=req.ready.timeout_seconds)
        self.check_spend(tenant)
        internal = self.engine_name(tenant, name)
        with self._lock:
            if self._building(internal):
                raise ApiError(409, "conflict", f"template {name!r} is already building: wait until GET "
                                                f"/v1/templates/{name} says Live or Failed, then bake it again")
            running = len(self._starting) + sum(not h._build.done.is_set() for h in self._bakes.values())
            if running >= self.config.max_bakes:
                raise ApiError(429, "capacity", f"{running} bakes are running on this server (max_bakes="
                                                f"{self.config.max_bakes}); retry when one has finished",
                               {"Retry-After": "5"})
            self._starting.add(internal)
        try:
            images = self.images_of(tenant)
            store = images.path

            def start() -> Any:
                missing = NotFoundError(
                    f"image {ref!r} is not in this tenant's image store: upload it with POST /v1/images "
                    "(Template.bake from the remote client uploads a local image for you) and bake from the "
                    "reference it answers; GET /v1/images lists what is there")
                pinned = images.pin(ref)  # `name` -> the newest upload under it, `name@digest` -> that upload
                if pinned is False:
                    raise missing
                image = pinned or ref
                try:  # resolve it here first: a missing image is the request's error, not a failed bake
                    _oci.resolve(image, store).close()
                except _oci.ImageError as e:
                    if "is not in the local image store" in str(e):
                        raise missing from None
                    raise InvalidArgument(f"image {ref!r}: {e}") from None
                return Template.bake(self.engine, name=internal, image=image, ready=ready, width=req.width,
                                     store=store)

            try:
                handle = await self.run(start)
            except CollimateError as e:
                raise self._scrubbed(tenant, e) from None
            with self._lock:
                self._bakes[internal] = handle
                self._baked.discard(internal)
        finally:
            with self._lock:
                self._starting.discard(internal)
        _event("bake_started", tenant=tenant, template=name, version=handle.version)
        threading.Thread(target=self._watch_bake, args=(tenant, name, handle), daemon=True,
                         name=f"collimate-bake-watch-{name}").start()
        return self._image_info(tenant, name, handle.status(), with_log=True)

    def _watch_bake(self, tenant: str, name: str, handle: Any) -> None:
        st = handle.wait()
        internal = self.engine_name(tenant, name)
        if st.phase == "Live":
            with self._lock:
                self._baked.add(internal)
            self._live_templates.add(internal)  # registered with the engine at commit
        _event("bake_finished", logging.INFO if st.phase == "Live" else logging.WARNING, tenant=tenant,
               template=name, version=st.version, phase=st.phase, seconds=st.seconds,
               error=self.scrub(tenant, st.error))

    async def delete_template(self, tenant: str, name: str) -> None:
        """Delete the tenant's template: no new sandboxes; live ones keep running."""
        from collimate_core.templates.bake import Template

        if name in CATALOG:
            raise ApiError(409, "conflict", f"{name!r} is a catalog template, shared by every tenant: it cannot be "
                                            "deleted")
        if not re.fullmatch(TEMPLATE_NAME, name):
            raise self._missing(name)
        internal = self.engine_name(tenant, name)
        with self._lock:
            if self._building(internal):
                raise ApiError(409, "conflict", f"template {name!r} is still building: wait until GET "
                                                f"/v1/templates/{name} says Live or Failed, then delete it")
            recorded = internal in self._bakes
        try:
            await self.run(Template.delete, self.engine, internal)
        except NotFoundError:
            if not recorded:  # a bake that failed here is deleted by forgetting it
                raise self._missing(name) from None
        except CollimateError as e:
            raise self._scrubbed(tenant, e) from None
        with self._lock:
            self._bakes.pop(internal, None)
            self._baked.discard(internal)
            self._expect.pop(internal, None)
        self._live_templates.discard(internal)
        _event("template_deleted", tenant=tenant, template=name)

    async def expect(self, tenant: str, name: str, width: int | None) -> TemplateInfo:
        """Declare (width) or withdraw (None) this tenant's expected width; the template keeps the
        widest declaration of any tenant ready."""
        internal = self.resolve_template(tenant, name)
        with self._lock:
            widths = self._expect.setdefault(internal, {})
            if width is None:
                widths.pop(tenant, None)
            else:
                widths[tenant] = width
            want = max(widths.values(), default=None)
        try:
            if want is None:
                await self.run(self.engine.release_template, internal)
            else:
                await self.run(self.engine.expect_width, internal, want)
                self._live_templates.add(internal)
        except NotFoundError:
            raise self._missing(name) from None
        except CollimateError as e:
            if internal == name:
                raise
            raise self._scrubbed(tenant, e) from None
        return await self.template_info(tenant, name, with_log=False)

    # images
    async def upload_image(self, tenant: str, request: Request, name: str | None, digest: str | None,
                           tag: str | None) -> ImageInfo:
        """Store an image archive (the request body) in the tenant's image store, once it is read
        and every blob of the image is verified against its digest."""
        limit, quota = self.config.max_image_upload, self.config.image_quota
        images = self.images_of(tenant)
        store = images.path
        # What the upload may take: the quota less what is kept, plus what it would replace (the same
        # image uploaded again under the same name). Checked again, exactly, before it is kept.
        room, used = None, 0
        if quota:
            used, replaceable = await self.run(images.room, name)
            room = quota - used + replaceable
            length = request.headers.get("content-length", "")
            if length.isdigit() and int(length) > room:
                raise _over_quota(used, quota, int(length))
        await self.run(store.mkdir, parents=True, exist_ok=True)
        # a dot file: the store's lookups skip it until it is verified and renamed; flocked while
        # it arrives, so that a killed server's partial uploads are swept (see templates/cache.py)
        upload = _cache.Temp(store / "upload", file=True)
        tmp = upload.__enter__()
        size = 0
        try:
            with open(tmp, "wb") as f:
                buf: list[bytes] = []
                held = 0
                async for chunk in _stream(request):
                    size += len(chunk)
                    if size > limit:  # a chunked body without a Content-Length
                        raise _image_too_large(limit)
                    if room is not None and size > room:
                        raise _over_quota(used, quota, size, at_least=True)
                    buf.append(chunk)
                    held += len(chunk)
                    if held >= 4 << 20:
                        await self.run(f.write, b"".join(buf))
                        buf, held = [], 0
                if buf:
                    await self.run(f.write, b"".join(buf))
            if size == 0:
                raise InvalidArgument("the request body is empty: send the image archive (an OCI layout tar or a "
                                      "`docker save` tar) as the body")
            info = await self.run(_verify_archive, tmp, digest, tag, max(1 << 30, 8 * limit))
            stored = name or info.pop("default_name")
            info.pop("default_name", None)
            kept = await self.run(images.keep, tmp, stored, info, size, quota)
        finally:
            upload.__exit__(None, None, None)
        with self._lock:
            self._meter(tenant).add("bytes_in", size)
        _event("image_uploaded", tenant=tenant, image=stored, digest=info["digest"], bytes=size,
               versions=kept["versions"], used_bytes=kept["used"])
        return _image_info(stored, kept["record"], latest=True)

    async def list_images(self, tenant: str) -> ImageList:
        images = self.images_of(tenant)
        index, used = await self.run(images.listing)
        out = [_image_info(n, v, latest=i == 0) for n in sorted(index) for i, v in enumerate(reversed(index[n]))]
        return ImageList(images=out, used_bytes=used, quota_bytes=self.config.image_quota or None)

    async def get_image(self, tenant: str, name: str) -> ImageDetail:
        index, _ = await self.run(self.images_of(tenant).listing)
        versions = index.get(name)
        if not versions:
            raise _no_image(name)
        listed = [_image_info(name, v, latest=i == 0) for i, v in enumerate(reversed(versions))]
        return ImageDetail(**listed[0].model_dump(), versions=listed)

    async def delete_image(self, tenant: str, name: str, digest: str | None) -> None:
        """Remove the tenant's uploads under `name` (all, or the one with `digest`). Templates baked
        from them keep working: they have a root filesystem of their own."""
        gone = await self.run(self.images_of(tenant).delete, name, digest)
        _event("image_deleted", tenant=tenant, image=name, digests=[v["digest"] for v in gone],
               bytes=sum(v["bytes"] for v in gone))

    # sandboxes
    def info(self, rec: _Owned) -> SandboxInfo:
        try:
            disk = self.engine.disk_usage(rec.box)
        except CollimateError:
            disk = None  # the sandbox died meanwhile: its other fields still say which it was
        return SandboxInfo(
            id=rec.box.id, template=rec.template, warm_hit=bool(rec.box.warm_hit), parent=rec.parent,
            created=rec.created, idle_seconds=round(max(0.0, time.monotonic() - rec.last_used), 3),
            idle_timeout_seconds=self.config.idle_reap, disk=DiskUsage(**disk) if disk else None,
        )

    def _own(self, box: Any, tenant: str, template: str, parent: str | None) -> _Owned:
        rec = _Owned(box, tenant, template, parent)
        with self._lock:
            self._owned[box.id] = rec
        return rec

    @contextmanager
    def use(self, tenant: str, sandbox_id: str) -> Iterator[_Owned]:
        """The tenant's live sandbox, marked busy (never reaped) for the duration."""
        with self._lock:
            rec = self._owned.get(sandbox_id)
            if rec is None or rec.tenant != tenant:
                raise NotFoundError(f"no sandbox {sandbox_id!r} (deleted, reaped when idle, or never existed)")
            rec.busy += 1
            rec.last_used = time.monotonic()
        try:
            yield rec
        finally:
            with self._lock:
                rec.busy -= 1
                rec.last_used = time.monotonic()

    def list(self, tenant: str) -> list[SandboxInfo]:
        with self._lock:
            recs = [r for r in self._owned.values() if r.tenant == tenant]
        return [self.info(r) for r in sorted(recs, key=lambda r: r.created)]

    async def create(self, tenant: str, template: str, disk_quota: int | None = None) -> SandboxInfo:
        internal = self.resolve_template(tenant, template)
        self.check_spend(tenant)
        if disk_quota is not None and disk_quota > self.config.disk_quota:
            raise InvalidArgument(
                f"disk_quota of {disk_quota} bytes is above this server's {self.config.disk_quota} (--disk-quota); ask for less"
            )
        await self.admission.acquire(1)

        def work() -> _Owned:
            # Runs to the end even if the request is cancelled: the slot is released here on
            # failure, and a created sandbox is owned (and reaped if nobody claims it).
            t = time.perf_counter()
            try:
                box = self.engine.create(internal, disk_quota=disk_quota)
            except BaseException as e:
                self._release_soon(1)
                if internal == template or not isinstance(e, CollimateError):
                    raise
                if isinstance(e, NotFoundError):  # deleted meanwhile
                    raise self._missing(template) from None
                raise self._scrubbed(tenant, e) from None
            self.metrics.fork_seconds.labels("clone").observe(time.perf_counter() - t)
            self.metrics.created.labels("clone").inc()
            rec = self._own(box, tenant, template, None)
            with self._lock:
                self._meter(tenant).add("sandboxes", 1)
            self._live_templates.add(internal)
            return rec

        return self.info(await self.run(work))

    async def fork(self, tenant: str, sandbox_id: str, width: int) -> list[SandboxInfo]:
        """`width` live children of the sandbox: all of them or an error, never part of a group."""
        with self.use(tenant, sandbox_id) as parent:
            self.check_spend(tenant)
            await self.admission.acquire(width)

            def work() -> list[_Owned]:
                t = time.perf_counter()
                try:
                    boxes = self.engine.fork(parent.box, width)
                except BaseException:
                    self._release_soon(width)
                    raise
                self.metrics.fork_seconds.labels("fork").observe(time.perf_counter() - t)
                self.metrics.created.labels("fork").inc(len(boxes))
                with self._lock:
                    self._meter(tenant).add("forks", len(boxes))
                return [self._own(b, tenant, parent.template, sandbox_id) for b in boxes]

            children = await self.run(work)
        return [self.info(c) for c in children]

    def _teardown(self, rec: _Owned, reason: str) -> None:
        """Destroy an owned sandbox already removed from the table (in a worker thread)."""
        try:
            self.engine.destroy(rec.box)
        finally:
            with self._lock:
                self._meter(rec.tenant).close_span(rec.created, time.time())
            self.metrics.destroyed.labels(reason).inc()
            self._release_soon(1)

    async def delete(self, tenant: str, sandbox_id: str) -> None:
        with self._lock:
            rec = self._owned.get(sandbox_id)
            if rec is None or rec.tenant != tenant:
                raise NotFoundError(f"no sandbox {sandbox_id!r} (deleted, reaped when idle, or never existed)")
            del self._owned[sandbox_id]
        await self.run(self._teardown, rec, "deleted")

    def keepalive(self, tenant: str, ids: list[str]) -> KeepaliveResponse:
        alive, gone = [], []
        now = time.monotonic()
        with self._lock:
            for i in ids:
                rec = self._owned.get(i)
                if rec is not None and rec.tenant == tenant:
                    rec.last_used = now
                    alive.append(i)
                else:
                    gone.append(i)
        return KeepaliveResponse(alive=alive, gone=gone)

    async def exec(self, tenant: str, sandbox_id: str, req: ExecRequest) -> ExecResponse:
        with self.use(tenant, sandbox_id) as rec:
            self.check_spend(tenant)
            t = time.perf_counter()
            r = await self.run(
                self.engine.exec, rec.box, code=req.code, command=req.command, timeout=req.timeout_seconds,
                seed=req.seed, env=req.env, cwd=req.cwd,
            )
        self.metrics.exec_seconds.observe(time.perf_counter() - t)
        self.metrics.execs.inc()
        with self._lock:
            m = self._meter(tenant)
            m.add("execs", 1)
            m.add("bytes_out", len(r.stdout_bytes) + len(r.stderr_bytes))
        return ExecResponse(
            exit_code=r.exit_code, ok=r.ok, stdout=r.stdout, stderr=r.stderr,
            stdout_b64=None if r.stdout.encode() == r.stdout_bytes else base64.b64encode(r.stdout_bytes).decode(),
            stderr_b64=None if r.stderr.encode() == r.stderr_bytes else base64.b64encode(r.stderr_bytes).decode(),
            seed=r.seed, seed_ack=r.seed_ack, duration=r.duration, timed_out=r.timed_out, truncated=r.truncated,
            interpreter_died=r.interpreter_died, interpreter_restarted=r.interpreter_restarted, note=r.note,
        )

    async def upload(self, tenant: str, sandbox_id: str, path: str, request: Request) -> UploadResponse:
        _check_path(path)
        with self.use(tenant, sandbox_id) as rec:
            chunks, size = [], 0
            async for chunk in request.stream():
                size += len(chunk)
                if size > self.config.max_upload:  # a chunked body without a Content-Length
                    raise _too_large(self.config.max_upload)
                chunks.append(chunk)
            try:
                await self.run(self.engine.upload, rec.box, path, b"".join(chunks))
            except (EngineError, InvalidArgument) as e:
                raise _file_error(e, f"upload to {path}") from e
        with self._lock:
            self._meter(tenant).add("bytes_in", size)
        return UploadResponse(path=path, bytes=size)

    async def download(self, tenant: str, sandbox_id: str, path: str) -> bytes:
        _check_path(path)
        with self.use(tenant, sandbox_id) as rec:
            try:
                data = await self.run(self.engine.download, rec.box, path)
            except (EngineError, InvalidArgument) as e:
                raise _file_error(e, f"download of {path}") from e
        with self._lock:
            self._meter(tenant).add("bytes_out", len(data))
        return data

    async def reset(self, tenant: str, sandbox_id: str) -> SandboxInfo:
        with self.use(tenant, sandbox_id) as rec:
            await self.run(self.engine.reset, rec.box)
            return self.info(rec)

    def usage(self, tenant: str, since: float | None, until: float | None) -> UsageResponse:
        now = time.time()
        for name, v in (("since", since), ("until", until)):
            if v is not None and not math.isfinite(v):
                raise InvalidArgument(f"{name} must be a finite Unix time, not {v}")
        lo = -math.inf if since is None else since
        hi = math.inf if until is None else until
        if hi < lo:
            raise InvalidArgument(f"until ({until}) is before since ({since})")
        with self._lock:
            w = self._meter(tenant).window(lo, hi)
            live = [r for r in self._owned.values() if r.tenant == tenant]
            live_seconds = sum(max(0.0, min(now, hi) - max(r.created, lo)) for r in live)
        return UsageResponse(
            tenant=tenant, since=since, until=now if until is None else until,
            sandbox_seconds=round(w["sandbox_seconds"] + live_seconds, 6),
            sandboxes=round(w["sandboxes"]), execs=round(w["execs"]), forks=round(w["forks"]),
            bytes_in=round(w["bytes_in"]), bytes_out=round(w["bytes_out"]), live_sandboxes=len(live),
            spend_limit_seconds=self.config.spend_limit, spent_seconds=round(self.spent(tenant), 6),
        )

    async def _reap_loop(self) -> None:
        every = min(5.0, max(0.2, self.config.idle_reap / 4))
        while True:
            await asyncio.sleep(every)
            try:
                now = time.monotonic()
                with self._lock:
                    idle = [r for r in self._owned.values() if r.busy == 0 and now - r.last_used > self.config.idle_reap]
                    for r in idle:
                        del self._owned[r.box.id]
                    for m in self._meters.values():
                        m.compact(time.time())
                for r in idle:
                    await self.run(self._teardown, r, "reaped")
                    _event("reaped", sandbox=r.box.id, tenant=r.tenant, idle_seconds=round(now - r.last_used, 1))
            except Exception:  # noqa: BLE001 - the reaper must keep running
                log.exception("reaper failed", extra={"fields": {}})


async def _stream(request: Request) -> Any:
    """The request's body; a client that goes away mid-body is the client's problem, not the server's."""
    try:
        async for chunk in request.stream():
            yield chunk
    except ClientDisconnect:
        raise ApiError(400, "invalid_argument", "the client went away before the whole body arrived") from None


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


# --- tenants' templates and images ------------------------------------------------------------


def _tenant_key(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:24]


def _namespace(tenant: str) -> str:
    """The prefix of the engine names of a tenant's templates (tenant template names have no "/")."""
    return f"tenant-{_tenant_key(tenant)}/"


class _ImageStore:
    """A tenant's image store: the archives it uploaded, and an index of them beside the store.

    `<name>.tar` is the newest upload under `name`, the one the bare name refers to; older uploads
    under the name stay as `<name>@<hex>.tar`, named by their reference `name@sha256:<hex>`, until
    deleted. The index (`images.json`, next to the store, never inside it) records each upload:
    digest, image id, format, layers, bytes, when. Uploading the same image under the same name
    again replaces that upload. Blocking (run in worker threads); one lock per tenant orders the
    changes, so the quota check and the rename that keeps an upload happen together; an flock on
    the index (`.images.json.lock`) orders them with other server processes on the same cache.
    """

    def __init__(self, path: Path):
        self.path = path
        self.index_path = path.parent / "images.json"
        self.lock = threading.Lock()

    @contextmanager
    def _changing(self):
        """Both locks, for a change (the thread lock first: one flock waiter per process)."""
        with self.lock, _cache.Lock(self.index_path):
            _cache.sweep(self.path)  # uploads a killed server left
            yield

    def _archives(self) -> dict[str, Path]:
        try:
            return {e.name: Path(e.path) for e in os.scandir(self.path)
                    if not e.name.startswith(".") and e.name.endswith(".tar") and e.is_file(follow_symlinks=False)}
        except FileNotFoundError:
            return {}

    def used(self) -> int:
        """Bytes the tenant keeps: every file of the store but uploads still arriving."""
        total = 0
        try:
            for e in os.scandir(self.path):
                if not e.name.startswith(".upload") and e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
        return total

    def _load(self) -> dict[str, list[dict]]:
        """name -> its uploads, oldest first (the last is the newest, `<name>.tar`). Files the index
        does not know (kept by an older server) are described from the archive itself; records of
        files that are gone are dropped."""
        try:
            raw = json.loads(self.index_path.read_text())["images"]
            index = {n: [v for v in vs if isinstance(v, dict) and _RECORD <= v.keys() and isinstance(v["file"], str)]
                     for n, vs in raw.items() if isinstance(vs, list)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            index = {}
        files = self._archives()
        known = set()
        for name in list(index):
            index[name] = [v for v in index[name] if v["file"] in files]
            known.update(v["file"] for v in index[name])
        for fname, path in files.items():
            name = fname.removesuffix(".tar").split("@", 1)[0]
            if fname in known or not re.fullmatch(IMAGE_NAME, name):
                continue
            rec = _describe_archive(path)
            if rec is not None:
                index.setdefault(name, []).append(rec)
        for name, vs in list(index.items()):
            if not vs:
                del index[name]
            else:
                vs.sort(key=lambda v: (v["file"] == f"{name}.tar", v.get("uploaded", 0.0)))
        return index

    def _save(self, index: dict[str, list[dict]]) -> None:
        _cache.write_atomic(self.index_path, json.dumps({"images": index}, indent=1, sort_keys=True))

    def listing(self) -> tuple[dict[str, list[dict]], int]:
        with self.lock:
            return self._load(), self.used()

    def room(self, name: str | None) -> tuple[int, int]:
        """(bytes kept, the most an upload under `name` could replace)."""
        with self.lock:
            index = self._load() if name else {}
            return self.used(), max((v["bytes"] for v in index.get(name or "", [])), default=0)

    def pin(self, ref: str) -> str | None | bool:
        """The exact upload a bake's reference names: for `name`, `name@<digest>` of the newest upload
        under it; `name@<digest>` itself if there is such an upload under the name; False if there
        is none; None for other references (tags, registries: looked up by the images' own names)."""
        from collimate_core.templates import oci as _oci

        try:
            r = _oci.parse_reference(ref)
        except _oci.ImageError:
            return None
        if r.registry or r.tag or not re.fullmatch(IMAGE_NAME, r.repository):
            return None
        with self.lock:
            versions = self._load().get(r.repository)
        if not versions:
            return False
        if r.digest is None:
            return f"{r.repository}@{versions[-1]['digest']}"
        return ref if any(r.digest in (v["digest"], v["image_id"]) for v in versions) else False

    def keep(self, tmp: Path, name: str, info: dict, size: int, quota: int) -> dict:
        """Keep the verified upload `tmp` as the newest under `name`; 413 (and nothing kept) if it
        would take the tenant over `quota` bytes."""
        with self._changing():
            index = self._load()
            versions = index.get(name, [])
            same = next((v for v in versions if v["digest"] == info["digest"]), None)
            used = self.used()
            replaced = (self.path / same["file"]).stat().st_size if same is not None else 0
            if quota and used - replaced + size > quota:
                raise _over_quota(used, quota, size)
            newest = f"{name}.tar"
            for v in versions:
                if v is not same and v["file"] == newest:  # the one before stays, under its digest
                    older = f"{name}@{v['digest'].split(':', 1)[1]}.tar"
                    # A second name first, then the new upload over the first: `<name>.tar` never
                    # goes missing for a bake reading the store meanwhile (no lock needed there).
                    try:
                        os.link(self.path / newest, self.path / older)
                    except FileExistsError:
                        os.replace(self.path / newest, self.path / older)
                    v["file"] = older
            if same is not None:
                versions.remove(same)
                if same["file"] != newest:
                    (self.path / same["file"]).unlink(missing_ok=True)
            os.replace(tmp, self.path / newest)
            rec = {"file": newest, "digest": info["digest"], "image_id": info["image_id"], "format": info["format"],
                   "layers": info["layers"], "bytes": size, "uploaded": time.time()}
            versions.append(rec)
            index[name] = versions
            self._save(index)
            return {"record": rec, "versions": len(versions), "used": used - replaced + size}

    def delete(self, name: str, digest: str | None) -> list[dict]:
        """Remove the uploads under `name` (or the one with `digest`); the newest left becomes what
        the name refers to. NotFoundError if there is none."""
        with self._changing():
            index = self._load()
            versions = index.get(name, [])
            if digest is None:
                # also archives under the name that hold no single image (not listed, but counted)
                files = [p for f, p in self._archives().items() if f.removesuffix(".tar").split("@", 1)[0] == name]
                if not files:
                    raise _no_image(name)
                for path in files:
                    path.unlink(missing_ok=True)
                index.pop(name, None)
                self._save(index)
                return versions
            if not versions:
                raise _no_image(name)
            gone = [v for v in versions if digest in (v["digest"], v["image_id"])]
            if not gone:
                raise NotFoundError(f"image {name!r} has no upload with digest {digest}: GET /v1/images/{name} "
                                    "lists its uploads")
            left = [v for v in versions if all(v is not g for g in gone)]
            for v in gone:
                (self.path / v["file"]).unlink(missing_ok=True)
            newest = f"{name}.tar"
            if left and left[-1]["file"] != newest:
                os.replace(self.path / left[-1]["file"], self.path / newest)
                left[-1]["file"] = newest
            if left:
                index[name] = left
            else:
                index.pop(name, None)
            self._save(index)
            return gone


_RECORD = {"file", "digest", "image_id", "format", "layers", "bytes", "uploaded"}  # an upload in the index


def _describe_archive(path: Path) -> dict | None:
    """An index record for an archive the index does not know; None if it holds no single image."""
    from collimate_core.templates import oci as _oci

    try:
        img = _oci.open_image(path)
    except Exception:  # noqa: BLE001 - not listed, still counted and deletable by name
        return None
    try:
        st = path.stat()
        return {"file": path.name, "digest": img.digest, "image_id": img.id, "format": img.format,
                "layers": len(img.layers), "bytes": st.st_size, "uploaded": st.st_mtime}
    finally:
        img.close()


def _image_info(name: str, rec: dict, latest: bool) -> ImageInfo:
    return ImageInfo(name=name, reference=f"{name}@{rec['digest']}", digest=rec["digest"], image_id=rec["image_id"],
                     format=rec["format"], layers=rec["layers"], bytes=rec["bytes"], uploaded=rec["uploaded"],
                     latest=latest)


_UPLOAD_HINT = ("upload the image with POST /v1/images (Template.bake from the remote client does it for you) and "
                "bake from the reference it answers")


def _check_image_reference(image: str) -> str:
    """`image` if it is an image reference; 400 if it looks like a path: a tenant never names a
    file on this host, only images in its own store."""
    from collimate_core.templates import oci as _oci

    text = image.strip()
    base = text.split("@", 1)[0]
    if (text.startswith(("/", ".", "~")) or "\\" in text or "//" in text or "/." in text or "./" in text
            or base.endswith(_oci.ARCHIVE_SUFFIXES)):
        raise InvalidArgument(f"image {image!r} looks like a path: a server never reads images from its own disk for "
                              f"you; {_UPLOAD_HINT}")
    try:
        _oci.parse_reference(text)
    except _oci.ImageError as e:
        raise InvalidArgument(f"image {image!r} is not an image reference (name, name:tag or name@sha256:<hex>): {e}; "
                              f"to bake a local image, {_UPLOAD_HINT}") from None
    return text


def _verify_archive(path: Path, digest: str | None, tag: str | None, unpacked_limit: int) -> dict:
    """Open the uploaded archive, select its image (by digest or tag, or the only one), and verify
    it: its manifest and config against their digests, every layer blob against its digest, and
    every layer's uncompressed content against the config's diff id. So the image id (the config
    digest) pins content the tenant really sent, and a root filesystem unpacked for one tenant's
    image may serve another's with the same id. InvalidArgument saying why when it is not a usable
    image."""
    from collimate_core.templates import oci as _oci

    def why(e: BaseException) -> str:
        msg = str(e) if isinstance(e, _oci.ImageError) else f"malformed ({type(e).__name__}: {e})"
        return msg.replace(str(path), "the uploaded archive")

    try:
        img = _oci.open_image(path, digest=digest, tag=tag)
    except Exception as e:  # noqa: BLE001 - whatever a hostile archive does to the reader is a 400
        raise InvalidArgument(f"not a usable image archive: {why(e)}") from None
    try:
        c = img.container
        assert c is not None
        total = 0
        for i, layer in enumerate(img.layers, 1):
            what = f"layer {i}/{len(img.layers)} ({layer.digest or layer.name})"
            with c.open(layer.name) as f:
                raw = _oci._HashingReader(f)
                inner = _oci._HashingReader(_oci._decompressed(io.BufferedReader(raw, 1 << 20), what))
                while chunk := inner.read(1 << 20):
                    total += len(chunk)
                    if total > unpacked_limit:
                        raise _oci.ImageError(f"the layers unpack to more than {unpacked_limit} bytes, this server's "
                                              "limit (8x max_image_upload)")
                _drain_raw(raw)
            if layer.digest and raw.digest() != layer.digest:
                raise _oci.ImageError(f"{what} does not match its digest: the blob hashes to {raw.digest()}")
            if inner.digest() != layer.diff_id:
                raise _oci.ImageError(f"{what}: its content hashes to {inner.digest()}, but the config's diff id is "
                                      f"{layer.diff_id}")
        default = "image"
        for n in img.names:
            try:
                repo = _oci.parse_reference(n).repository.rsplit("/", 1)[-1].lower()
            except _oci.ImageError:
                continue
            if re.fullmatch(IMAGE_NAME, repo):
                default = repo
                break
        return {"digest": img.digest, "image_id": img.id, "format": img.format, "layers": len(img.layers),
                "default_name": default}
    except Exception as e:  # noqa: BLE001
        raise InvalidArgument(f"the image archive is corrupt: {why(e)}") from None
    finally:
        img.close()


def _drain_raw(r: Any) -> None:
    """Read what is left of a layer blob after its compressed stream ended (trailing bytes count
    toward its digest)."""
    while r.read(1 << 20):
        pass


# --- the HTTP layer ---------------------------------------------------------------------------


class _Gate:
    """ASGI middleware: authenticates /v1, bounds request bodies, and records every request in
    the log and the metrics."""

    def __init__(self, app: Any, cp: ControlPlane):
        self.app, self.cp = app, cp

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        cp, t0 = self.cp, time.perf_counter()
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in scope["headers"]}
        rid = headers.get("x-request-id", "")
        if not re.fullmatch(r"[A-Za-z0-9._-]{1,64}", rid):
            rid = secrets.token_hex(8)
        status = 500

        async def send_(msg: dict) -> None:
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
                msg = {**msg, "headers": [*msg.get("headers", []), (b"x-request-id", rid.encode())]}
            await send(msg)

        async def refuse(err: ApiError) -> None:
            hdrs = [(b"content-type", b"application/json")] + [(k.lower().encode(), v.encode()) for k, v in (err.headers or {}).items()]
            await send_({"type": "http.response.start", "status": err.status_code, "headers": hdrs})
            await send_({"type": "http.response.body", "body": _error_body(err.status_code, err.type, err.message)})

        path = scope["path"]
        try:
            if path == "/v1" or path.startswith("/v1/"):
                try:
                    scope["collimate.tenant"] = cp.authenticate(headers.get("authorization"))
                except AuthenticationError as e:
                    cp.metrics.auth_failures.inc()
                    await refuse(_error_of(e))
                    return
                except InvalidArgument as e:  # the key store itself is unreadable: the operator's to fix
                    _event("key_store_unreadable", logging.ERROR, error=str(e))
                    await refuse(ApiError(500, "internal", "the server cannot read its key store; see its log"))
                    return
                too_large = _too_large
                if scope["method"] == "PUT" and path.endswith("/files"):
                    limit = cp.config.max_upload
                elif scope["method"] == "POST" and path.rstrip("/") == "/v1/images":
                    limit, too_large = cp.config.max_image_upload, _image_too_large
                else:
                    limit = MAX_JSON_BODY
                length = headers.get("content-length", "")
                if length.isdigit() and int(length) > limit:
                    await refuse(too_large(limit))
                    return
                receive = _bounded(receive, limit, too_large)
            await self.app(scope, receive, send_)
        finally:
            route = getattr(scope.get("route"), "path", None) or "unmatched"
            seconds = time.perf_counter() - t0
            cp.metrics.requests.labels(scope["method"], route, str(status)).inc()
            cp.metrics.request_seconds.labels(route).observe(seconds)
            _event("request", method=scope["method"], path=path, route=route, status=status,
                   ms=round(seconds * 1e3, 3), tenant=scope.get("collimate.tenant"), request_id=rid)


def _bounded(receive: Callable, limit: int, too_large: Callable[[int], ApiError] = _too_large) -> Callable:
    seen = 0

    async def receive_() -> dict:
        nonlocal seen
        msg = await receive()
        if msg["type"] == "http.request":
            seen += len(msg.get("body", b""))
            if seen > limit:
                raise too_large(limit)
        return msg

    return receive_


_ERRORS = {
    400: "invalid argument: the message says what is expected",
    401: "missing, malformed, wrong or revoked API key",
    402: "the tenant's spend limit (sandbox-seconds) is reached",
    403: "the guest path is not writable (only /work and /tmp are)",
    404: "no such template, image or sandbox for this tenant (another tenant's look the same)",
    409: "conflict: wider than the server's capacity, the sandbox's state does not allow it, a catalog template "
         "(read-only), or a template that is still building",
    410: "the sandbox's VMM process died: the sandbox is lost, delete it",
    413: "request body over the server's limit (max_upload; image archives: max_image_upload), or an image "
         "upload that does not fit the tenant's image quota (type image_quota)",
    429: "capacity: the queue is full, the request waited its queue_timeout, or max_bakes bakes are running",
    500: "engine failure",
    503: "the engine refused for capacity",
    504: "an operation ran out of time",
}


def _errs(*codes: int) -> dict:
    return {c: {"model": ErrorBody, "description": _ERRORS[c]} for c in sorted({400, 401, 413, 500, *codes})}


_SANDBOX_LINKS = {
    op: {"operationId": op, "parameters": {"sandbox_id": "$response.body#/id"}}
    for op in ("get_sandbox", "delete_sandbox", "exec", "upload", "download", "reset_sandbox", "fork", "fork_group")
}


_TEMPLATE_LINKS = {
    op: {"operationId": op, "parameters": {"template_id": "$response.body#/id"}}
    for op in ("get_template", "delete_template")
}


_IMAGE_LINKS = {
    op: {"operationId": op, "parameters": {"name": "$response.body#/name"}}
    for op in ("get_image", "delete_image")
}


def create_app(config: ServerConfig | None = None, *, engine: Any = None, keys: KeyStore | None = None) -> FastAPI:
    """The ASGI app. The engine starts with the app's lifespan (uvicorn runs it)."""
    config = config or ServerConfig()
    cp = ControlPlane(config, engine=engine, keys=keys)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        await cp.start()
        try:
            yield
        finally:
            await cp.stop()

    app = FastAPI(
        title="collimate control plane",
        version=API_VERSION,
        description="Sandboxes forked from templates on a KVM host, for RL rollouts. Every /v1 request needs "
        "`Authorization: Bearer col_...`; errors are `{\"error\": {\"type\", \"message\"}}`.",
        lifespan=lifespan,
        docs_url=None,
        redoc_url=None,
    )
    app.state.cp = cp
    app.add_middleware(_Gate, cp=cp)

    bearer = HTTPBearer(auto_error=False, description="an API key from `collimate keys create --tenant T`")

    def tenant_of(request: Request, _: HTTPAuthorizationCredentials | None = Depends(bearer)) -> str:
        return request.scope["collimate.tenant"]  # set by _Gate, which refuses unauthenticated requests

    # errors
    @app.exception_handler(StarletteHTTPException)
    async def on_http(request: Request, exc: StarletteHTTPException) -> Response:
        if isinstance(exc, ApiError):
            return _error_response(exc)
        kind = {404: "not_found", 405: "method_not_allowed"}.get(exc.status_code, "http_error")
        detail = exc.detail if isinstance(exc.detail, str) else json.dumps(exc.detail)
        headers = dict(exc.headers or {})
        if exc.status_code == 404:
            detail = f"no route {request.url.path}"
        elif exc.status_code == 405:
            # Starlette names the methods of the first route that matched the path; list them all.
            allowed = sorted({m for r in app.routes if getattr(r, "path_regex", None) is not None
                              and r.path_regex.match(request.url.path) for m in (getattr(r, "methods", None) or ())})
            headers["Allow"] = ", ".join(allowed)
            detail = f"{request.method} is not allowed on {request.url.path}; allowed: {headers['Allow']}"
        return _error_response(ApiError(exc.status_code, kind, detail, headers))

    @app.exception_handler(RequestValidationError)
    async def on_invalid(request: Request, exc: RequestValidationError) -> Response:
        parts = []
        for e in exc.errors()[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            parts.append(f"{where}: {e.get('msg')}")
        return _error_response(ApiError(400, "invalid_argument", "; ".join(parts) or "invalid request"))

    @app.exception_handler(CollimateError)
    async def on_sdk(request: Request, exc: CollimateError) -> Response:
        err = _error_of(exc)
        if err.status_code >= 500:
            _event("engine_error", logging.ERROR, path=request.url.path, error=str(exc), type=type(exc).__name__)
        return _error_response(err)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc, extra={"fields": {"path": request.url.path}})
        return _error_response(_error_of(exc))

    # open endpoints
    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict:
        return {"ok": True, "live_sandboxes": cp.admission.used, "queue": len(cp.admission.waiting)}

    @app.get("/metrics", include_in_schema=False)
    async def metrics() -> Response:
        return Response(generate_latest(cp.metrics.registry), media_type=CONTENT_TYPE_LATEST)

    Tenant = Depends(tenant_of)

    # templates
    @app.get("/v1/templates", response_model=TemplateList, operation_id="list_templates", tags=["templates"],
             responses=_errs())
    async def list_templates(tenant: str = Tenant) -> TemplateList:
        """The catalog templates (shared by every tenant) and this tenant's own."""
        return TemplateList(templates=await cp.list_templates(tenant))

    @app.post("/v1/templates", operation_id="bake_template", tags=["templates"], status_code=202,
              response_model=TemplateInfo,
              responses={**_errs(402, 404, 409, 429), 202: {"description": "the bake started", "links": _TEMPLATE_LINKS}})
    async def bake_template(body: BakeRequest, tenant: str = Tenant) -> TemplateInfo:
        """Bake an image of this tenant's image store (POST /v1/images) into template `name`, in the
        background: the answer is its status (phase Building); poll GET /v1/templates/{name} until
        Live or Failed. Baking a name again makes its next version; sandboxes of older versions keep
        running."""
        return await cp.bake(tenant, body)

    @app.get("/v1/templates/{template_id}", response_model=TemplateInfo, operation_id="get_template",
             tags=["templates"], responses=_errs(404))
    async def get_template(template_id: str, tenant: str = Tenant) -> TemplateInfo:
        """A template's status: for this tenant's, its latest bake (Building, Live, or Failed with
        `error` and the build `log`)."""
        return await cp.template_info(tenant, template_id)

    @app.delete("/v1/templates/{template_id}", status_code=204, operation_id="delete_template", tags=["templates"],
                response_class=Response, responses=_errs(404, 409))
    async def delete_template(template_id: str, tenant: str = Tenant) -> Response:
        """Delete this tenant's template: no new sandboxes of it; live ones keep running. Catalog
        templates and templates still building answer 409."""
        await cp.delete_template(tenant, template_id)
        return Response(status_code=204)

    @app.post("/v1/templates/{template_id}/expect", response_model=TemplateInfo, operation_id="expect_width",
              tags=["templates"], responses=_errs(404, 409))
    async def expect_width(template_id: str, body: ExpectRequest, tenant: str = Tenant) -> TemplateInfo:
        return await cp.expect(tenant, template_id, body.width)

    @app.post("/v1/templates/{template_id}/release", response_model=TemplateInfo, operation_id="release_template",
              tags=["templates"], responses=_errs(404, 409))
    async def release_template(template_id: str, tenant: str = Tenant) -> TemplateInfo:
        return await cp.expect(tenant, template_id, None)

    # images
    @app.post(
        "/v1/images", status_code=201, response_model=ImageInfo, operation_id="upload_image", tags=["templates"],
        responses={**_errs(), 201: {"description": "the image as kept", "links": _IMAGE_LINKS}},
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}},
            "application/x-tar": {"schema": {"type": "string", "format": "binary"}}}}},
    )
    async def upload_image(
        request: Request,
        name: str = Query(None, min_length=1, max_length=128, pattern=IMAGE_NAME,
                          description="store it under this name (default: the image's own repository name, else "
                          "'image'); an upload under a name that has images becomes the one the name refers to, the "
                          "ones before stay (named by their reference) until deleted"),
        digest: str = Query(None, pattern=DIGEST, description="select this image of an archive holding several"),
        tag: str = Query(None, min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$",
                         description="select the image with this tag of an archive holding several"),
        tenant: str = Tenant,
    ) -> ImageInfo:
        """Upload an image archive (an OCI layout tar, `skopeo copy ... oci-archive:`, or a `docker
        save` tar) as the body, up to the server's max_image_upload bytes. Its manifest, config and
        every layer are verified against their digests before it is kept, in this tenant's own image
        store. Bake from the `reference` of the answer. 413 (type image_quota) if the tenant's images
        would take more than its image quota; nothing is kept then."""
        return await cp.upload_image(tenant, request, name, digest, tag)

    @app.get("/v1/images", response_model=ImageList, operation_id="list_images", tags=["templates"],
             responses=_errs())
    async def list_images(tenant: str = Tenant) -> ImageList:
        """This tenant's uploaded images: every upload kept, by name, newest first within a name
        (`latest`: the one the bare name refers to); the bytes they take and the tenant's quota."""
        return await cp.list_images(tenant)

    @app.get("/v1/images/{name}", response_model=ImageDetail, operation_id="get_image", tags=["templates"],
             responses=_errs(404))
    async def get_image(name: str, tenant: str = Tenant) -> ImageDetail:
        """The image `name` refers to (the newest upload under it), and every upload kept under it."""
        return await cp.get_image(tenant, name)

    @app.delete("/v1/images/{name}", status_code=204, operation_id="delete_image", tags=["templates"],
                response_class=Response, responses=_errs(404))
    async def delete_image(
        name: str,
        digest: str = Query(None, pattern=DIGEST, description="remove only this upload under the name (its digest "
                            "or image id); the newest left becomes the one the name refers to"),
        tenant: str = Tenant,
    ) -> Response:
        """Remove images from this tenant's store (and from its quota). Templates baked from them
        keep working: each has a root filesystem of its own. Baking from a removed image is 404."""
        await cp.delete_image(tenant, name, digest)
        return Response(status_code=204)

    # sandboxes
    @app.get("/v1/sandboxes", response_model=SandboxList, operation_id="list_sandboxes", tags=["sandboxes"],
             responses=_errs())
    async def list_sandboxes(tenant: str = Tenant) -> SandboxList:
        return SandboxList(sandboxes=cp.list(tenant))

    @app.post("/v1/sandboxes", status_code=201, response_model=SandboxInfo, operation_id="create_sandbox",
              tags=["sandboxes"],
              responses={**_errs(402, 404, 409, 429, 503), 201: {"description": "the new sandbox", "links": _SANDBOX_LINKS}})
    async def create_sandbox(body: CreateSandbox = Body(default_factory=CreateSandbox), tenant: str = Tenant) -> SandboxInfo:
        return await cp.create(tenant, body.template, body.disk_quota)

    @app.post("/v1/keepalive", response_model=KeepaliveResponse, operation_id="keepalive",
              tags=["sandboxes"], responses=_errs())
    async def keepalive(body: KeepaliveRequest, tenant: str = Tenant) -> KeepaliveResponse:
        """Mark sandboxes as in use, so the idle reaper leaves them; the remote client does this for
        the sandboxes it holds."""
        return cp.keepalive(tenant, body.ids)

    @app.get("/v1/sandboxes/{sandbox_id}", response_model=SandboxInfo, operation_id="get_sandbox",
             tags=["sandboxes"], responses=_errs(404))
    async def get_sandbox(sandbox_id: str, tenant: str = Tenant) -> SandboxInfo:
        with cp.use(tenant, sandbox_id) as rec:
            return cp.info(rec)

    @app.delete("/v1/sandboxes/{sandbox_id}", status_code=204, operation_id="delete_sandbox", tags=["sandboxes"],
                response_class=Response, responses=_errs(404))
    async def delete_sandbox(sandbox_id: str, tenant: str = Tenant) -> Response:
        await cp.delete(tenant, sandbox_id)
        return Response(status_code=204)

    @app.post("/v1/sandboxes/{sandbox_id}/exec", response_model=ExecResponse, operation_id="exec",
              tags=["sandboxes"], responses=_errs(402, 404, 409, 410, 504))
    async def exec_(sandbox_id: str, body: ExecRequest, tenant: str = Tenant) -> ExecResponse:
        return await cp.exec(tenant, sandbox_id, body)

    @app.put(
        "/v1/sandboxes/{sandbox_id}/files", response_model=UploadResponse, operation_id="upload", tags=["sandboxes"],
        responses=_errs(403, 404, 409, 410),
        openapi_extra={"requestBody": {"required": True, "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
    )
    async def upload(request: Request, sandbox_id: str,
                     path: str = Query(min_length=1, max_length=MAX_PATH, pattern="^/", description="absolute guest path; writable: /work, /tmp"),
                     tenant: str = Tenant) -> UploadResponse:
        return await cp.upload(tenant, sandbox_id, path, request)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files", operation_id="download", tags=["sandboxes"], response_class=Response,
        responses={**_errs(403, 404, 409, 410), 200: {"description": "the file's bytes", "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
    )
    async def download(sandbox_id: str, path: str = Query(min_length=1, max_length=MAX_PATH, pattern="^/", description="absolute guest path"), tenant: str = Tenant) -> Response:
        return Response(await cp.download(tenant, sandbox_id, path), media_type="application/octet-stream")

    @app.post("/v1/sandboxes/{sandbox_id}/reset", response_model=SandboxInfo, operation_id="reset_sandbox",
              tags=["sandboxes"], responses=_errs(404, 409, 410))
    async def reset(sandbox_id: str, tenant: str = Tenant) -> SandboxInfo:
        return await cp.reset(tenant, sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, response_model=SandboxInfo, operation_id="fork",
              tags=["sandboxes"],
              responses={**_errs(402, 404, 409, 410, 429, 503), 201: {"description": "the child", "links": _SANDBOX_LINKS}})
    async def fork(sandbox_id: str, tenant: str = Tenant) -> SandboxInfo:
        return (await cp.fork(tenant, sandbox_id, 1))[0]

    @app.post("/v1/sandboxes/{sandbox_id}/fork_group", status_code=201, response_model=ForkGroupResponse,
              operation_id="fork_group", tags=["sandboxes"], responses=_errs(402, 404, 409, 410, 429, 503))
    async def fork_group(sandbox_id: str, body: ForkGroupRequest, tenant: str = Tenant) -> ForkGroupResponse:
        """Strict width: `width` live children, or an error and none."""
        return ForkGroupResponse(sandboxes=await cp.fork(tenant, sandbox_id, body.width))

    # usage
    @app.get("/v1/usage", response_model=UsageResponse, operation_id="usage", tags=["usage"], responses=_errs())
    async def usage(since: float | None = Query(None, description="Unix time; default: the server's start"),
                    until: float | None = Query(None, description="Unix time; default: now"),
                    tenant: str = Tenant) -> UsageResponse:
        return cp.usage(tenant, since, until)

    def openapi() -> dict:
        if app.openapi_schema is None:
            doc = get_openapi(title=app.title, version=app.version, description=app.description, routes=app.routes)
            # Invalid input is 400 with the error body, never FastAPI's 422.
            for item in doc.get("paths", {}).values():
                for op in item.values():
                    op.get("responses", {}).pop("422", None)
            for name in ("HTTPValidationError", "ValidationError"):
                doc.get("components", {}).get("schemas", {}).pop(name, None)
            app.openapi_schema = doc
        return app.openapi_schema

    app.openapi = openapi  # type: ignore[method-assign]
    return app


def openapi_document() -> dict:
    """The OpenAPI document (docs/openapi.json), independent of any server's configuration."""
    return create_app(ServerConfig(preload=()), keys=KeyStore(os.devnull)).openapi()


def openapi_json() -> str:
    return json.dumps(openapi_document(), indent=2, sort_keys=True) + "\n"


# --- running it -------------------------------------------------------------------------------


def serve(config: ServerConfig) -> None:
    """Run the server until SIGINT/SIGTERM; on the way out every sandbox is destroyed."""
    import prometheus_client
    import uvicorn

    configure_logging()
    prometheus_client.disable_created_metrics()  # no `_created` series next to every counter
    # proto=IPPROTO_TCP: asyncio sets TCP_NODELAY only on sockets that say they are TCP; without it,
    # Nagle holds back a response's body behind its headers for the client's delayed ACK (~40 ms).
    sock = socket.socket(socket.AF_INET6 if ":" in config.host else socket.AF_INET, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((config.host, config.port))
    sock.listen(1024)
    host, port = sock.getsockname()[:2]
    keys = KeyStore(config.key_store)
    _event("listening", host=host, port=port, url=f"http://{host}:{port}", key_store=str(keys.path),
           max_sandboxes=config.max_sandboxes, queue=config.queue, idle_reap=config.idle_reap,
           spend_limit=config.spend_limit, max_upload=config.max_upload, max_image_upload=config.max_image_upload,
           max_bakes=config.max_bakes, image_quota=config.image_quota, pid=os.getpid())
    app = create_app(config, keys=keys)
    server = uvicorn.Server(uvicorn.Config(app, log_config=None, access_log=False, timeout_graceful_shutdown=10,
                                           backlog=1024))
    server.run(sockets=[sock])
