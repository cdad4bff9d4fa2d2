"""The HTTP layer: the FastAPI app (`create_app`: authentication, routes, error handlers, the
request gate and its log line), the OpenAPI document, and `serve`."""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import socket
import time
from contextlib import asynccontextmanager
from typing import Any, Callable

from fastapi import Body, Depends, FastAPI, Query, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.openapi.utils import get_openapi
from fastapi.responses import StreamingResponse
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from collimate_core.sdk.errors import AuthenticationError, CollimateError, InvalidArgument
from collimate_core.sdk.quota import WRITABLE_RULE
from collimate_core.server.keys import KeyStore
from collimate_core.server.config import (
    API_VERSION,
    DIGEST,
    IMAGE_NAME,
    MAX_JSON_BODY,
    MAX_PATH,
    ServerConfig,
)
from collimate_core.server.control import ControlPlane
from collimate_core.server.errors import (
    ApiError,
    _error_body,
    _error_of,
    _error_response,
    _image_too_large,
    _too_large,
)
from collimate_core.server.log import configure_logging, _event, log
from collimate_core.server.models import (
    BakeRequest,
    CreateSandbox,
    EgressLog,
    EgressSpec,
    ErrorBody,
    ExecRequest,
    ExecResponse,
    ExpectRequest,
    ForkGroupRequest,
    ForkGroupResponse,
    ForkRequest,
    ImageDetail,
    ImageInfo,
    ImageList,
    KeepaliveRequest,
    KeepaliveResponse,
    SandboxInfo,
    SandboxList,
    SetEgressResponse,
    TemplateInfo,
    TemplateList,
    UploadResponse,
    UsageResponse,
)


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
    403: f"the guest path is not writable ({WRITABLE_RULE})",
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
            # 501: what this server's platform does not run (its operator's choice), not a failure.
            level = logging.WARNING if err.status_code == 501 else logging.ERROR
            _event("engine_error", level, path=request.url.path, error=str(exc), type=type(exc).__name__)
        return _error_response(err)

    @app.exception_handler(Exception)
    async def on_bug(request: Request, exc: Exception) -> Response:
        log.error("unhandled error", exc_info=exc, extra={"fields": {"path": request.url.path}})
        return _error_response(_error_of(exc))

    # open endpoints
    @app.get("/healthz", include_in_schema=False)
    async def healthz() -> dict:
        return {"ok": True, "live_sandboxes": cp.admission.used, "queue": len(cp.admission.waiting),
                "platform": getattr(cp.engine, "platform", None)}

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
        return await cp.create(tenant, body.template, body.disk_quota, body.egress, body.shared_memory)

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
                     path: str = Query(min_length=1, max_length=MAX_PATH, pattern="^/", description=f"absolute guest path; {WRITABLE_RULE}"),
                     tenant: str = Tenant) -> UploadResponse:
        return await cp.upload(tenant, sandbox_id, path, request)

    @app.get(
        "/v1/sandboxes/{sandbox_id}/files", operation_id="download", tags=["sandboxes"], response_class=Response,
        responses={**_errs(403, 404, 409, 410), 200: {"description": "the file's bytes", "content": {
            "application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}},
    )
    async def download(sandbox_id: str, path: str = Query(min_length=1, max_length=MAX_PATH, pattern="^/", description="absolute guest path"), tenant: str = Tenant) -> Response:
        return StreamingResponse(await cp.download(tenant, sandbox_id, path), media_type="application/octet-stream")

    @app.post("/v1/sandboxes/{sandbox_id}/reset", response_model=SandboxInfo, operation_id="reset_sandbox",
              tags=["sandboxes"], responses=_errs(404, 409, 410))
    async def reset(sandbox_id: str, tenant: str = Tenant) -> SandboxInfo:
        return await cp.reset(tenant, sandbox_id)

    @app.post("/v1/sandboxes/{sandbox_id}/fork", status_code=201, response_model=SandboxInfo, operation_id="fork",
              tags=["sandboxes"],
              responses={**_errs(402, 404, 409, 410, 429, 503), 201: {"description": "the child", "links": _SANDBOX_LINKS}})
    async def fork(sandbox_id: str, body: ForkRequest = Body(default_factory=ForkRequest), tenant: str = Tenant) -> SandboxInfo:
        """One child; its egress policy is its parent's or, with `egress`, a narrower one."""
        return (await cp.fork(tenant, sandbox_id, 1, body.egress))[0]

    @app.post("/v1/sandboxes/{sandbox_id}/fork_group", status_code=201, response_model=ForkGroupResponse,
              operation_id="fork_group", tags=["sandboxes"], responses=_errs(402, 404, 409, 410, 429, 503))
    async def fork_group(sandbox_id: str, body: ForkGroupRequest, tenant: str = Tenant) -> ForkGroupResponse:
        """Strict width: `width` live children, or an error and none. They inherit the parent's
        egress policy; `egress` may only narrow it (a wider one: 400, before anything is forked)."""
        return ForkGroupResponse(sandboxes=await cp.fork(tenant, sandbox_id, body.width, body.egress))

    @app.put("/v1/sandboxes/{sandbox_id}/egress", response_model=SetEgressResponse, operation_id="set_egress",
             tags=["sandboxes"], responses=_errs(403, 404))
    async def set_egress(sandbox_id: str, body: EgressSpec, tenant: str = Tenant) -> SetEgressResponse:
        """Replace a live sandbox's network policy (within the server's --egress-ceiling: 403 if
        wider); its open connections the new policy forbids are reset."""
        return await cp.set_egress(tenant, sandbox_id, body)

    @app.get("/v1/sandboxes/{sandbox_id}/egress", response_model=EgressLog, operation_id="egress_log",
             tags=["sandboxes"], responses=_errs(404))
    async def egress_log(sandbox_id: str, tenant: str = Tenant) -> EgressLog:
        """The sandbox's network policy, and its connection attempts and DNS answers."""
        return await cp.egress_log(tenant, sandbox_id)

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
