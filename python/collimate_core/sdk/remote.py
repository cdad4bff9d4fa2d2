"""The remote client: the embedded client's surface over the control plane's HTTP API.

`connect(api_key)` (or COLLIMATE_API_KEY, with COLLIMATE_BASE_URL) returns a `RemoteClient`.
It has the methods `Sandbox`, `ForkGroup`, `Env`, `rollout_once`, `grade` and `grade_batch` call
on a client, so all of them work over HTTP unchanged, and error responses come back as the same
exception classes the embedded engine raises.

Templates: `Template.bake(client, ...)`, `Template.list/get/delete(client, ...)` work on a
RemoteClient too (they hand over to `client._remote_templates`, a `RemoteTemplates`): an image
that is a local path (an OCI layout directory or archive, a `docker save` archive) is uploaded to
the tenant's image store first (POST /v1/images), then baked by reference (POST /v1/templates);
the handle polls GET /v1/templates/{name}. Template names live in the tenant's own namespace.

Images (control plane only; the embedded client has no image store of a tenant): `client.images()`
lists what this tenant uploaded, `client.delete_image(name, digest=None)` removes it (and frees its
image quota); templates baked from it keep working.

Liveness: the server destroys sandboxes nobody touched for its idle time. While this process
holds sandboxes, a daemon thread tells the server they are in use; when the process dies, they
are reaped, unless another process re-adopts one first with `Sandbox.attach(client, id)`.
"""

from __future__ import annotations

import base64
import os
import re
import socket
import tarfile
import tempfile
import threading
import time
from pathlib import Path
from urllib.parse import quote
import weakref
from dataclasses import dataclass, field
from typing import Any

from collimate_core.templates.bake import Ready, TemplateHandle, TemplateStatus, check_bake_args
from collimate_core.sdk import egress as _egress
from collimate_core.sdk.egress import Egress
from collimate_core.sdk.embedded import Usage
from collimate_core.sdk.errors import (
    AuthenticationError,
    CapacityError,
    CollimateError,
    EngineError,
    InvalidArgument,
    REFUSAL_ERRORS,
    WIRE_ERRORS,
    NotFoundError,
    SandboxDied,
    SandboxTimeout,
)
from collimate_core.sdk.results import ExecResult

DEFAULT_BASE_URL = "http://127.0.0.1:8477"

# The error `type` of a response -> the exception the embedded engine raises for the same failure.
_ERRORS: dict[str, type[CollimateError]] = {**REFUSAL_ERRORS}
for _cls, _status, _kind in reversed(WIRE_ERRORS):  # the first row of a type wins
    _ERRORS[_kind] = _cls
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
    egress: Egress = field(default_factory=Egress.none)
    platform: str = "kvm"  # what it runs on: kvm or systrap (the server's --platform)


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
        self._remote_templates = RemoteTemplates(self)

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

    @property
    def platform(self) -> str:
        """What the server's sandboxes run on, "kvm" or "systrap" (its `collimate serve
        --platform`), asked once."""
        if getattr(self, "_platform", None) is None:
            self._platform = str(self._json("GET", "/healthz").get("platform") or "kvm")
        return self._platform

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
        box.egress = _egress.coerce(d.get("egress"))
        box.platform = str(d.get("platform") or "kvm")
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

    def create(self, template: str, disk_quota: int | str | None = None, egress: Any = None,
               shared_memory: int | str | None = None) -> RemoteSandbox:
        if not isinstance(template, str) or not template:
            raise InvalidArgument(f"template must be a template name such as 'python', not {template!r}")
        body: dict[str, Any] = {"template": template}
        if egress is not None:
            body["egress"] = _egress.coerce(egress).to_json()
        if disk_quota is not None:
            from collimate_core.sdk.quota import disk_quota as _check_quota

            body["disk_quota"] = _check_quota(disk_quota)
        if shared_memory is not None:
            from collimate_core.sdk.quota import shared_memory as _check_shared

            body["shared_memory"] = _check_shared(shared_memory)
        # The server may queue the request until capacity frees up (its queue_timeout).
        return self._box(self._json("POST", "/v1/sandboxes", json=body, timeout=max(self._timeout, 330.0)))

    def disk_usage(self, box: RemoteSandbox) -> dict | None:
        """What the sandbox's writable mounts hold and their quota (from GET /v1/sandboxes/{id})."""
        return self._json("GET", f"/v1/sandboxes/{_q(box.id)}").get("disk")

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
        from collimate_core.sdk.embedded import check_exec_args

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
            interpreter_died=bool(d.get("interpreter_died", False)),
            interpreter_restarted=bool(d.get("interpreter_restarted", False)), note=str(d.get("note") or ""),
            limit=str(d.get("limit") or ""),
            egress_replay=str(d.get("egress_replay") or ""), egress_error=str(d.get("egress_error") or ""),
            platform=str(d.get("platform") or ""),
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

    def fork(self, box: RemoteSandbox, n: int, egress: Any = None) -> list[RemoteSandbox]:
        """`n` live children of `box`: all of them, or an error and none (strict width). `egress`:
        the children's policy, no wider than `box`'s (checked here and by the server)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"a fork group needs width >= 1, not {n!r}")
        body: dict[str, Any] = {"width": n}
        if egress is not None:
            policy = _egress.coerce(egress)
            policy.check_narrower(getattr(box, "egress", None) or Egress.none(), "fork_group(egress=...)")
            body["egress"] = policy.to_json()
        d = self._json("POST", f"/v1/sandboxes/{_q(box.id)}/fork_group", json=body, timeout=max(self._timeout, 330.0))
        return [self._box(c) for c in d["sandboxes"]]

    def set_egress(self, box: RemoteSandbox, egress: Any) -> int:
        """Replace the sandbox's network policy (PUT /v1/sandboxes/{id}/egress); returns how many
        open connections it reset."""
        policy = _egress.coerce(egress)
        d = self._json("PUT", f"/v1/sandboxes/{_q(box.id)}/egress", json=policy.to_json())
        box.egress = policy
        return int(d["reset"])

    def egress_log(self, box: RemoteSandbox) -> _egress.EgressLog:
        """The sandbox's connection attempts and DNS answers (GET /v1/sandboxes/{id}/egress), with
        how many older entries the server's log dropped."""
        d = self._json("GET", f"/v1/sandboxes/{_q(box.id)}/egress")
        return _egress.EgressLog(d["entries"], int(d.get("dropped", 0)))

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

    # --- control plane only: the tenant's image store ----------------------------------------

    def images(self) -> list[dict]:
        """This tenant's uploaded images (GET /v1/images): every upload kept, by name, newest first
        within a name; `latest` marks the one the bare name refers to, `reference` names each
        exactly. A control-plane feature: the embedded client has no such method."""
        return self._json("GET", "/v1/images")["images"]

    def delete_image(self, name: str, digest: str | None = None) -> None:
        """Remove image `name` from this tenant's store (DELETE /v1/images/{name}), or only its upload
        with `digest`; frees its image quota. Templates baked from it keep working. NotFoundError if
        there is no such image."""
        if not isinstance(name, str) or not name:
            raise NotFoundError(f"no image {name!r}")
        self._request("DELETE", f"/v1/images/{_q(name)}", params={"digest": digest} if digest else None)

    def session(self, handle: Any = "python", *, disk_quota: int | str | None = None, egress: Any = None,
                shared_memory: int | str | None = None):
        from collimate_core.sdk.embedded import _template_name
        from collimate_core.sdk.session import Session

        return Session(_template_name(handle), client=self, disk_quota=disk_quota, egress=egress,
                       shared_memory=shared_memory)

    def env(self, ref: Any, width: int = 1):
        from collimate_core.sdk.embedded import _template_name
        from collimate_core.sdk.session import Env

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


# --- templates over HTTP ------------------------------------------------------------------------

IMAGE_UPLOAD_TIMEOUT = 3600.0
_ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".oci", ".oci.tar", ".docker.tar")


def _status_of(d: dict) -> TemplateStatus:
    """A TemplateStatus from the server's TemplateInfo."""
    fields = TemplateStatus.__dataclass_fields__
    kw = {k: d[k] for k in fields if k in d and d[k] is not None}
    kw.setdefault("version", None)
    kw.setdefault("phase", "Live")
    kw["log"] = kw.get("log") or ""
    return TemplateStatus(**kw)


class RemoteTemplateHandle(TemplateHandle):
    """A template being baked or baked on the server: the embedded TemplateHandle's interface;
    `status()` asks the server (GET /v1/templates/{name}), `wait()` polls it."""

    def __init__(self, client: "RemoteClient", status: TemplateStatus):
        self.client = client
        self._build = None
        self._status = status
        self.name = status.name
        self.version = status.version

    def status(self) -> TemplateStatus:
        st = self.client._remote_templates._status(self.name)
        self._status = st
        return st

    def wait(self, timeout: float | None = None) -> TemplateStatus:
        """Poll until the bake ends; its status ("Live", or "Failed" with `.log` and `.error`).
        Raises SandboxTimeout (a TimeoutError) if it is still building after `timeout` seconds."""
        deadline = None if timeout is None else time.monotonic() + timeout
        pause = 0.1
        while True:
            st = self.status()
            if st.phase != "Building" and (self.version is None or st.version is None or st.version >= self.version):
                return st
            if deadline is not None and time.monotonic() >= deadline:
                tail = "\n".join(st.log.splitlines()[-5:])
                raise SandboxTimeout(f"template {self.name!r} v{self.version} is still building after {timeout:g}s; "
                                     f"the log so far ends with:\n{tail}")
            left = None if deadline is None else max(0.0, deadline - time.monotonic())
            time.sleep(pause if left is None else min(pause, left))
            pause = min(1.0, pause * 1.5)

    def delete(self) -> None:
        self.client._remote_templates.delete(self.name)

    def __repr__(self) -> str:
        return f"RemoteTemplateHandle({self.name!r}, v{self.version}, {self._status.phase})"


class RemoteTemplates:
    """Template.bake/list/get/delete against the control plane (see the module docstring)."""

    def __init__(self, client: "RemoteClient"):
        self.client = client

    def _status(self, name: str) -> TemplateStatus:
        return _status_of(self.client._json("GET", f"/v1/templates/{_q(name)}"))

    def upload_image(self, path: str | os.PathLike, *, name: str | None = None, digest: str | None = None,
                     tag: str | None = None) -> dict:
        """Upload the image at a local `path` (an OCI layout directory, packed on the way, or an
        archive) to this tenant's image store; the server's answer (name, reference, digest, ...)."""
        p = Path(os.path.expanduser(str(path)))
        if not p.exists():
            raise InvalidArgument(f"no image at {path}: no such file or directory")
        params = {"name": name or _image_name(p)}
        if digest:
            params["digest"] = digest
        if tag:
            params["tag"] = tag
        packed = None
        try:
            if p.is_dir():
                fd, packed = tempfile.mkstemp(prefix="collimate-image-", suffix=".tar")
                os.close(fd)
                with tarfile.open(packed, "w", dereference=True) as tf:
                    for entry in sorted(os.listdir(p)):
                        tf.add(p / entry, arcname=entry)
                src = Path(packed)
            else:
                src = p
            size = src.stat().st_size

            def body():
                with open(src, "rb") as f:
                    while chunk := f.read(1 << 20):
                        yield chunk

            try:
                r = self.client._request(
                    "POST", "/v1/images", params=params, content=body(),
                    headers={"Content-Type": "application/x-tar", "Content-Length": str(size)},
                    timeout=max(self.client._timeout, IMAGE_UPLOAD_TIMEOUT),
                )
            except EngineError as e:
                if "cannot reach" not in str(e):
                    raise
                raise EngineError(f"{e}; the server may have refused the {size}-byte image archive while it was "
                                  "being sent (its max_image_upload limit, or this tenant's image quota: "
                                  "client.images() lists what is kept, client.delete_image(name) frees it?)") from None
            return r.json()
        finally:
            if packed:
                os.unlink(packed)

    def bake(self, name: str, image: Any, ready: Ready | None = None, width: int = 1, *,
             store: str | os.PathLike | None = None, cache: str | os.PathLike | None = None,
             egress: Any = None) -> RemoteTemplateHandle:
        if cache is not None:
            raise InvalidArgument("Template.bake(cache=...) is for the embedded engine; a remote server keeps its own")
        if not isinstance(name, str) or not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._:+-]{0,127}", name):
            raise InvalidArgument(f"template name must be 1-128 characters of letters, digits and ._:+- (starting "
                                  f"with a letter or digit), not {name!r}")
        ready = check_bake_args(image, ready, width)
        ref = self._image_reference(image, store)
        body: dict[str, Any] = {"name": name, "image": ref, "width": width,
                                "ready": {"timeout_seconds": float(ready.timeout)}}
        if ready.cmd is not None:
            body["ready"]["cmd"] = ready.cmd
        if ready.code is not None:
            body["ready"]["code"] = ready.code
        if egress is not None and not _egress.coerce(egress).is_none:
            body["egress"] = _egress.coerce(egress).to_json()
        d = self.client._json("POST", "/v1/templates", json=body, timeout=max(self.client._timeout, 120.0))
        return RemoteTemplateHandle(self.client, _status_of(d))

    def _image_reference(self, image: Any, store: str | os.PathLike | None) -> str:
        """The reference to bake from: a local image (a path, or a reference in a local `store`)
        is uploaded first; any other reference names an image in the tenant's store on the server."""
        if isinstance(image, os.PathLike):
            return self.upload_image(image)["reference"]
        text = image.strip()
        base, _, pin = text.partition("@sha256:")
        digest = f"sha256:{pin}" if pin else None
        looks_like_path = text.startswith(("/", "./", "../", "~")) or base.endswith(_ARCHIVE_SUFFIXES)
        for candidate, tag in ((base, None), tuple(base.rsplit(":", 1)) if ":" in base else (None, None)):
            # As the embedded engine reads it: a path if it looks like one, or exists and is no reference.
            if candidate and os.path.exists(os.path.expanduser(candidate)) and (looks_like_path or not _is_reference(text)):
                return self.upload_image(candidate, digest=digest, tag=tag)["reference"]
        if looks_like_path:
            raise InvalidArgument(f"no image at {base}: no such file or directory")
        if store is not None:  # a reference into a local image store: upload what it names
            from collimate_core.templates import oci as _oci

            try:
                img = _oci.resolve(text, Path(store))
            except _oci.ImageError as e:
                raise NotFoundError(str(e)) from None
            try:
                src, want = img.source, img.digest
            finally:
                img.close()
            return self.upload_image(src, name=_image_name(Path(src)), digest=want)["reference"]
        return text

    def list(self) -> list[TemplateStatus]:
        """This tenant's image templates (the catalog's are not image templates)."""
        out = [_status_of(d) for d in self.client._json("GET", "/v1/templates")["templates"] if d.get("kind") != "catalog"]
        return sorted(out, key=lambda st: st.name)

    def get(self, name: str) -> RemoteTemplateHandle:
        if not isinstance(name, str) or not name:
            raise NotFoundError(f"no image template named {name!r}")
        d = self.client._json("GET", f"/v1/templates/{_q(name)}")
        if d.get("kind") == "catalog":
            raise NotFoundError(f"{name!r} is a catalog template, not an image template")
        return RemoteTemplateHandle(self.client, _status_of(d))

    def delete(self, name: str) -> None:
        if not isinstance(name, str) or not name:
            raise NotFoundError(f"no image template named {name!r}")
        self.client._request("DELETE", f"/v1/templates/{_q(name)}")


def _is_reference(text: str) -> bool:
    from collimate_core.templates import oci as _oci

    try:
        _oci.parse_reference(text)
        return True
    except _oci.ImageError:
        return False


def _image_name(p: Path) -> str:
    """A store name for a local image: its file or directory name, as a repository name."""
    n = p.name
    for suf in sorted(_ARCHIVE_SUFFIXES, key=len, reverse=True):
        if n.endswith(suf):
            n = n[: -len(suf)]
            break
    n = re.sub(r"[^a-z0-9]+", "-", n.lower()).strip("-")
    n = re.sub(r"-{2,}", "-", n)[:100].strip("-")
    return n or "image"


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
