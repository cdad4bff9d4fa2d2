"""The control plane behind the routes: tenants' live sandboxes on this host's embedded engine,
their templates and bakes, usage metering and spend limits, and the idle reaper."""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import math
import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, AsyncIterator, Callable, Iterator
import anyio

from fastapi import Request
from starlette.requests import ClientDisconnect

from collimate_core.templates import cache as _cache
from collimate_core.sdk import egress as _egress
from collimate_core.sdk import quota as _quota
from collimate_core.sdk.egress import Egress
from collimate_core.sdk.errors import CollimateError, EngineError, InvalidArgument, NotFoundError
from collimate_core.server.keys import KeyStore
from collimate_core.sdk.meter import Meter as _Meter
from collimate_core.templates.catalog import CATALOG, cache_dir
from collimate_core.server.admission import _Admission
from collimate_core.server.config import ServerConfig, TEMPLATE_NAME
from collimate_core.server.errors import (
    ApiError,
    _check_path,
    _error_of,
    _file_error,
    _image_too_large,
    _no_image,
    _over_quota,
    _too_large,
)
from collimate_core.server.images import (
    _check_image_reference,
    _image_info,
    _ImageStore,
    _namespace,
    _tenant_key,
    _verify_archive,
)
from collimate_core.server.log import _event, log

# How much of a file a download reads at a time (the memory one download holds).
DOWNLOAD_CHUNK = 1 << 20
from collimate_core.server.metrics import _Metrics
from collimate_core.server.models import (
    BakeRequest,
    DiskUsage,
    EgressEntry,
    EgressLog,
    EgressSpec,
    ExecRequest,
    ExecResponse,
    ImageDetail,
    ImageInfo,
    ImageList,
    KeepaliveResponse,
    SandboxInfo,
    SetEgressResponse,
    TemplateInfo,
    UploadResponse,
    UsageResponse,
)


class _Owned:
    """A live sandbox of a tenant."""

    __slots__ = ("box", "tenant", "template", "parent", "created", "last_used", "busy", "logged")

    def __init__(self, box: Any, tenant: str, template: str, parent: str | None):
        self.box, self.tenant, self.template, self.parent = box, tenant, template, parent
        self.created = time.time()
        self.last_used = time.monotonic()
        self.busy = 0
        self.logged = 0  # the seq of the next egress log entry to write to the server's log


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
                                         disk_quota=self.config.disk_quota, memory_budget=self.config.memory_budget,
                                         shared_memory=self.config.shared_memory, platform=self.config.platform)
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
        _event("ready", max_sandboxes=self.config.max_sandboxes, platform=getattr(self.engine, "platform", None))

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
            # 501: what this server's platform does not run (its operator's choice), not a failure.
            level = logging.WARNING if err.status_code == 501 else logging.ERROR
            _event("engine_error", level, error=str(e), type=type(e).__name__, tenant=tenant)
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
        policy = self.egress_policy(req.egress)
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
                                     store=store, egress=policy, read_only_root=req.read_only_root)

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
            egress=EgressSpec(**_box_egress(rec.box).to_json()), platform=getattr(rec.box, "platform", "kvm"),
            shared_memory=getattr(rec.box, "shared_memory", None),
        )

    # network egress
    def egress_policy(self, spec: EgressSpec | None, parent: Egress | None = None) -> Egress:
        """The policy a request asks for, checked against the server's ceiling (403 if wider) and,
        for a fork, against its parent's (400 if wider)."""
        if spec is None:
            return parent if parent is not None else Egress.none()
        policy = _egress.coerce(spec.model_dump())
        ceiling = self.config.egress_ceiling
        if ceiling is not None and not policy.narrower_than(ceiling):
            raise ApiError(403, "invalid_argument",
                           f"egress {policy} is wider than this server's --egress-ceiling {ceiling}: ask for "
                           "rules within it")
        if parent is not None:
            policy.check_narrower(parent, "a fork's egress")
        return policy

    async def set_egress(self, tenant: str, sandbox_id: str, spec: EgressSpec) -> SetEgressResponse:
        policy = self.egress_policy(spec)
        with self.use(tenant, sandbox_id) as rec:
            n = await self.run(self.engine.set_egress, rec.box, policy)
            _event("egress_set", tenant=tenant, sandbox=sandbox_id, egress=policy.to_json(), reset=n)
            return SetEgressResponse(egress=EgressSpec(**policy.to_json()), reset=n)

    async def egress_log(self, tenant: str, sandbox_id: str) -> EgressLog:
        with self.use(tenant, sandbox_id) as rec:
            entries = await self.run(self.engine.egress_log, rec.box)
            return EgressLog(egress=EgressSpec(**_box_egress(rec.box).to_json()),
                             entries=[EgressEntry(**e) for e in entries], dropped=entries.dropped)

    def _log_flows(self, rec: _Owned, final: bool) -> None:
        """Write the sandbox's finished egress entries to the server log, one JSON line each (at
        the end of an exec, and all of them when the sandbox goes)."""
        try:
            entries = self.engine.egress_log(rec.box)
        except CollimateError:
            return
        # rec.logged: the seq of the next entry to write. The log keeps the newest entries: those
        # dropped before they were written are counted in a line of their own.
        if entries.dropped > rec.logged:
            _event("egress_dropped", tenant=rec.tenant, sandbox=rec.box.id, dropped=entries.dropped - rec.logged,
                   total_dropped=entries.dropped)
            rec.logged = entries.dropped
        i = rec.logged - entries.dropped
        while i < len(entries) and (final or not entries[i]["open"]):
            _event("egress", tenant=rec.tenant, sandbox=rec.box.id, dropped=entries.dropped, **entries[i])
            i += 1
        rec.logged = entries.dropped + i
        if final:
            # Network bytes: a flow served from a recording (verdict replayed/diverged) sent nothing.
            net = [e for e in entries if e["kind"] == "connect" and e["verdict"] not in ("replayed", "diverged")]
            out = sum(e["bytes_out"] for e in net)
            inn = sum(e["bytes_in"] for e in net)
            if out or inn:
                with self._lock:
                    m = self._meter(rec.tenant)
                    m.add("egress_bytes_out", out)
                    m.add("egress_bytes_in", inn)

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

    async def create(self, tenant: str, template: str, disk_quota: int | None = None,
                     egress: EgressSpec | None = None, shared_memory: int | None = None) -> SandboxInfo:
        policy = self.egress_policy(egress)
        internal = self.resolve_template(tenant, template)
        self.check_spend(tenant)
        if disk_quota is not None and disk_quota > self.config.disk_quota:
            raise InvalidArgument(
                f"disk_quota of {disk_quota} bytes is above this server's {self.config.disk_quota} (--disk-quota); ask for less"
            )
        if shared_memory is not None:
            shared_memory = _quota.shared_memory(shared_memory, self.config.memory_budget)
            if shared_memory > self.config.shared_memory:
                raise InvalidArgument(
                    f"shared_memory of {shared_memory} bytes is above this server's {self.config.shared_memory} "
                    "(--shared-memory); ask for less"
                )
        await self.admission.acquire(1)

        def work() -> _Owned:
            # Runs to the end even if the request is cancelled: the slot is released here on
            # failure, and a created sandbox is owned (and reaped if nobody claims it).
            t = time.perf_counter()
            try:
                box = self.engine.create(internal, disk_quota=disk_quota, egress=policy, shared_memory=shared_memory)
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

    async def fork(self, tenant: str, sandbox_id: str, width: int, egress: EgressSpec | None = None) -> list[SandboxInfo]:
        """`width` live children of the sandbox: all of them or an error, never part of a group."""
        with self.use(tenant, sandbox_id) as parent:
            # The children's policy: the parent's, or narrower (checked before anything is forked).
            policy = self.egress_policy(egress, _box_egress(parent.box))
            self.check_spend(tenant)
            await self.admission.acquire(width)

            def work() -> list[_Owned]:
                t = time.perf_counter()
                try:
                    boxes = self.engine.fork(parent.box, width, egress=policy)
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
            self._log_flows(rec, final=True)
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
            self._log_flows(rec, final=False)
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
            interpreter_died=r.interpreter_died, interpreter_restarted=r.interpreter_restarted, note=r.note, limit=r.limit,
            egress_replay=r.egress_replay, egress_error=r.egress_error, platform=r.platform or "kvm",
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

    async def download(self, tenant: str, sandbox_id: str, path: str) -> AsyncIterator[bytes]:
        """The file's bytes in chunks of DOWNLOAD_CHUNK, read as they are sent: a download holds
        one chunk of memory, whatever the file's size (at most max_download)."""
        _check_path(path)
        with self.use(tenant, sandbox_id) as rec:
            try:
                fd, size = await self.run(self.engine.open_download, rec.box, path, self.config.max_download)
            except (EngineError, InvalidArgument) as e:
                if "over the download limit" in str(e):
                    # The engine names the embedded client's knob; here the limit is the server's.
                    raise InvalidArgument(
                        str(e).replace("raise the limit (max_download)",
                                       "ask the server's operator to raise --max-download")
                    ) from None
                raise _file_error(e, f"download of {path}") from e
        with self._lock:
            self._meter(tenant).add("bytes_out", size)

        async def chunks() -> AsyncIterator[bytes]:
            try:
                left = size
                while left > 0:
                    b = await anyio.to_thread.run_sync(os.read, fd, min(left, DOWNLOAD_CHUNK))
                    if not b:
                        break
                    left -= len(b)
                    yield b
            finally:
                os.close(fd)

        return chunks()

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
        egress_out, egress_in = round(w["egress_bytes_out"]), round(w["egress_bytes_in"])
        if until is None:  # live sandboxes' connections, as of now
            for r in live:
                try:
                    o, i = r.box.vm.egress_bytes()
                except (CollimateError, AttributeError):
                    continue
                egress_out, egress_in = egress_out + o, egress_in + i
        return UsageResponse(
            tenant=tenant, since=since, until=now if until is None else until,
            sandbox_seconds=round(w["sandbox_seconds"] + live_seconds, 6),
            sandboxes=round(w["sandboxes"]), execs=round(w["execs"]), forks=round(w["forks"]),
            bytes_in=round(w["bytes_in"]), bytes_out=round(w["bytes_out"]), live_sandboxes=len(live),
            egress_bytes_out=egress_out, egress_bytes_in=egress_in,
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


def _box_egress(box: Any) -> Egress:
    """The policy the engine holds for `box` (none for a client that has no egress)."""
    return getattr(box, "egress", None) or Egress.none()
