"""The remote client: the embedded client's surface over the control plane's HTTP API.

`connect(api_key)` (or COLLIMATE_API_KEY, with COLLIMATE_BASE_URL) returns a `RemoteClient`.
It has the methods `Sandbox`, `ForkGroup`, `Env`, `rollout_once`, `grade` and `grade_batch` call
on a client, so all of them work over HTTP unchanged, and error responses come back as the same
exception classes the embedded engine raises.

Liveness: the server destroys sandboxes nobody touched for its idle time. While this process
holds sandboxes, a daemon thread tells the server they are in use; when the process dies, they
are reaped, unless another process re-adopts one first with `Sandbox.attach(client, id)`.
"""

from __future__ import annotations

import base64
import socket
import threading
from urllib.parse import quote
import weakref
from dataclasses import dataclass
from typing import Any

from collimate_core._embedded import Usage
from collimate_core._errors import (
    AuthenticationError,
    CapacityError,
    CollimateError,
    EngineError,
    InvalidArgument,
    NotFoundError,
    SandboxDied,
    SandboxTimeout,
)
from collimate_core._results import ExecResult

DEFAULT_BASE_URL = "http://127.0.0.1:8477"

# The error `type` of a response -> the exception the embedded engine raises for the same failure.
_ERRORS: dict[str, type[CollimateError]] = {
    "invalid_argument": InvalidArgument,
    "conflict": InvalidArgument,
    "forbidden_path": InvalidArgument,
    "payload_too_large": InvalidArgument,
    "authentication": AuthenticationError,
    "not_found": NotFoundError,
    "capacity": CapacityError,
    "spend_limit": CapacityError,
    "timeout": SandboxTimeout,
    "sandbox_died": SandboxDied,
    "engine_error": EngineError,
}
_BY_STATUS: dict[int, type[CollimateError]] = {
    400: InvalidArgument, 401: AuthenticationError, 402: CapacityError, 403: InvalidArgument, 404: NotFoundError, 409: CapacityError,
    410: SandboxDied, 413: InvalidArgument, 429: CapacityError, 503: CapacityError, 504: SandboxTimeout,
}


@dataclass
class RemoteSandbox:
    """A sandbox on the server, as `create`, `get` and `fork` return it (the embedded client's box)."""

    id: str
    template: str
    warm_hit: bool
    parent: str | None = None
    created: float = 0.0


class RemoteClient:
    """A client of the control plane at `base_url`, authenticated with `api_key`. Thread-safe."""

    def __init__(self, api_key: str, base_url: str = DEFAULT_BASE_URL, *, timeout: float = 30.0):
        try:
            import httpx
        except ImportError:  # pragma: no cover - httpx is a dependency
            raise CollimateError("the remote client needs httpx: pip install httpx") from None
        self._httpx = httpx
        self.base_url = base_url.rstrip("/")
        transport = httpx.HTTPTransport(
            limits=httpx.Limits(max_connections=128, max_keepalive_connections=64),
            # a request's body must not wait behind its headers for a delayed ACK
            socket_options=[(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)],
        )
        self._http = httpx.Client(
            base_url=self.base_url,
            headers={"Authorization": f"Bearer {api_key}", "User-Agent": "collimate-remote/1"},
            timeout=httpx.Timeout(timeout),
            transport=transport,
        )
        self._timeout = timeout
        self._held: dict[str, float] = {}  # id -> the server's idle timeout for it
        self._held_lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = False
        self._beat: threading.Thread | None = None

    # --- transport ---------------------------------------------------------------------------

    def _request(self, method: str, path: str, *, timeout: float | None = None, **kw: Any):
        httpx = self._httpx
        t = self._timeout if timeout is None else timeout
        try:
            r = self._http.request(method, path, timeout=httpx.Timeout(t, connect=min(t, 10.0)), **kw)
        except httpx.TimeoutException as e:
            raise SandboxTimeout(f"{method} {path}: no answer from {self.base_url} in {t:g} s ({e})") from None
        except httpx.HTTPError as e:
            raise EngineError(f"{method} {path}: cannot reach the control plane at {self.base_url}: {e}") from None
        if r.status_code >= 400:
            raise _error(r)
        return r

    def _json(self, method: str, path: str, **kw: Any) -> Any:
        return self._request(method, path, **kw).json()

    # --- liveness ----------------------------------------------------------------------------

    def _hold(self, box: RemoteSandbox, idle_timeout: float) -> RemoteSandbox:
        with self._held_lock:
            sooner = idle_timeout < min(self._held.values(), default=float("inf"))
            self._held[box.id] = idle_timeout
            if self._beat is None and not self._closed:
                self._beat = threading.Thread(target=_heartbeat, args=(weakref.ref(self),), daemon=True,
                                              name="collimate-keepalive")
                self._beat.start()
        if sooner:
            self._wake.set()  # the heartbeat recomputes its period
        return box

    def _drop(self, box_id: str) -> None:
        with self._held_lock:
            self._held.pop(box_id, None)

    def _box(self, d: dict) -> RemoteSandbox:
        box = RemoteSandbox(d["id"], d["template"], bool(d["warm_hit"]), d.get("parent"), float(d.get("created", 0.0)))
        return self._hold(box, float(d.get("idle_timeout_seconds", 600.0)))

    def _period(self) -> float:
        """Seconds between keepalives: a third of the shortest idle timeout of a held sandbox."""
        with self._held_lock:
            return max(0.2, min(self._held.values(), default=180.0) / 3)

    def _keepalive(self) -> None:
        """Touch every held sandbox; forget the ones the server no longer has."""
        with self._held_lock:
            held = list(self._held)
        if not held:
            return
        try:
            gone = self._json("POST", "/v1/keepalive", json={"ids": held})["gone"]
        except CollimateError:
            return  # the server is briefly away: the next round tries again, well before the reaper
        for i in gone:
            self._drop(i)

    # --- the client surface (as EmbeddedClient) ----------------------------------------------

    def create(self, template: str) -> RemoteSandbox:
        if not isinstance(template, str) or not template:
            raise InvalidArgument(f"template must be a template name such as 'python', not {template!r}")
        # The server may queue the request until capacity frees up (its queue_timeout).
        return self._box(self._json("POST", "/v1/sandboxes", json={"template": template}, timeout=max(self._timeout, 330.0)))

    def get(self, sandbox_id: str) -> RemoteSandbox:
        if not isinstance(sandbox_id, str) or not sandbox_id:
            raise NotFoundError(f"no sandbox {sandbox_id!r}")
        return self._box(self._json("GET", f"/v1/sandboxes/{_q(sandbox_id)}"))

    def destroy(self, box: RemoteSandbox) -> None:
        """Delete the sandbox (idempotent: one already gone is fine)."""
        self._drop(box.id)
        try:
            self._request("DELETE", f"/v1/sandboxes/{_q(box.id)}")
        except NotFoundError:
            pass

    def exec(
        self,
        box: RemoteSandbox,
        *,
        code: str | None = None,
        command: str | None = None,
        timeout: float = 60.0,
        seed: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        from collimate_core._embedded import check_exec_args

        seed_bytes = check_exec_args(code, command, timeout, seed)
        body: dict[str, Any] = {"timeout_seconds": float(timeout)}
        if code is not None:
            body["code"] = code
        else:
            body["command"] = command
        if seed_bytes is not None:
            body["seed"] = seed_bytes.hex()
        if env:
            body["env"] = {str(k): str(v) for k, v in env.items()}
        if cwd:
            body["cwd"] = cwd
        d = self._json("POST", f"/v1/sandboxes/{_q(box.id)}/exec", json=body, timeout=float(timeout) + 60.0)
        out = base64.b64decode(d["stdout_b64"]) if d.get("stdout_b64") else d["stdout"].encode()
        err = base64.b64decode(d["stderr_b64"]) if d.get("stderr_b64") else d["stderr"].encode()
        return ExecResult(
            exit_code=d["exit_code"], stdout=d["stdout"], stderr=d["stderr"], seed=d["seed"], seed_ack=d["seed_ack"],
            duration=d["duration"], timed_out=d["timed_out"], truncated=d["truncated"], stdout_bytes=out, stderr_bytes=err,
        )

    def upload(self, box: RemoteSandbox, path: str, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"upload_bytes takes bytes, not {type(data).__name__}")
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidArgument(f"upload path must be an absolute guest path such as /work/x, not {path!r}")
        self._request("PUT", f"/v1/sandboxes/{_q(box.id)}/files", params={"path": path}, content=bytes(data),
                      headers={"Content-Type": "application/octet-stream"}, timeout=max(self._timeout, 300.0))

    def download(self, box: RemoteSandbox, path: str) -> bytes:
        return self._request("GET", f"/v1/sandboxes/{_q(box.id)}/files", params={"path": path},
                             timeout=max(self._timeout, 300.0)).content

    def reset(self, box: RemoteSandbox) -> None:
        self._json("POST", f"/v1/sandboxes/{_q(box.id)}/reset")

    def fork(self, box: RemoteSandbox, n: int) -> list[RemoteSandbox]:
        """`n` live children of `box`: all of them, or an error and none (strict width)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"a fork group needs width >= 1, not {n!r}")
        d = self._json("POST", f"/v1/sandboxes/{_q(box.id)}/fork_group", json={"width": n}, timeout=max(self._timeout, 330.0))
        return [self._box(c) for c in d["sandboxes"]]

    def expect_width(self, template: str, width: int) -> None:
        """Ask the server to keep `width` clones of `template` ready before a burst."""
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise InvalidArgument(f"width must be an int >= 0, not {width!r}")
        self._json("POST", f"/v1/templates/{_q(template)}/expect", json={"width": width}, timeout=max(self._timeout, 330.0))

    def release_template(self, template: str) -> None:
        """Hand back the capacity `expect_width` declared. Never destructive."""
        self._json("POST", f"/v1/templates/{_q(template)}/release")

    def usage(self, since: float | None = None, until: float | None = None) -> Usage:
        """This tenant's metered totals between `since` and `until` (Unix times)."""
        params = {k: v for k, v in (("since", since), ("until", until)) if v is not None}
        d = self._json("GET", "/v1/usage", params=params)
        fields = Usage.__dataclass_fields__
        return Usage(**{k: v for k, v in d.items() if k in fields})

    def templates(self) -> list[dict]:
        """The templates this tenant can use."""
        return self._json("GET", "/v1/templates")["templates"]

    def sandboxes(self) -> list[dict]:
        """This tenant's live sandboxes."""
        return self._json("GET", "/v1/sandboxes")["sandboxes"]

    def session(self, handle: Any = "python"):
        from collimate_core._embedded import _template_name
        from collimate_core._session import Session

        return Session(_template_name(handle), client=self)

    def env(self, ref: Any, width: int = 1):
        from collimate_core._embedded import _template_name
        from collimate_core._session import Env

        return Env(self, _template_name(ref), width)

    @property
    def closed(self) -> bool:
        return self._closed

    def close(self) -> None:
        """Close the connection. Sandboxes still held are left to the server's idle reaper (or to
        `Sandbox.attach` from another process)."""
        self._closed = True
        self._wake.set()
        self._http.close()

    def __enter__(self) -> "RemoteClient":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self) -> str:
        return f"RemoteClient({self.base_url!r})"


def _heartbeat(ref: "weakref.ref[RemoteClient]") -> None:
    """Keep a client's sandboxes alive; ends with the client (closed or garbage-collected)."""
    while True:
        client = ref()
        if client is None or client._closed:
            return
        period, wake = client._period(), client._wake
        del client  # hold no strong reference while waiting
        woke = wake.wait(period)
        wake.clear()
        client = ref()
        if client is None or client._closed:
            return
        if not woke:
            client._keepalive()
        del client


def _q(segment: str) -> str:
    """One path segment, escaped: an id or a name never changes which endpoint is called."""
    return quote(segment, safe="")


def _error(r) -> CollimateError:
    try:
        e = r.json()["error"]
        kind, message = str(e["type"]), str(e["message"])
    except (ValueError, KeyError, TypeError):
        kind, message = "", f"HTTP {r.status_code}: {r.text[:500]}"
    cls = _ERRORS.get(kind) or _BY_STATUS.get(r.status_code) or (EngineError if r.status_code >= 500 else CollimateError)
    return cls(f"{message} (HTTP {r.status_code})")
