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

Modules, one concept each (they were one 2,000-line _server.py):
- app.py: the FastAPI app (`create_app`): authentication, the routes, error handlers, the request
  gate and its log line; the OpenAPI document (`openapi_json`); `serve`;
- control.py: `ControlPlane`, what the routes call: tenants' live sandboxes on the engine, their
  templates and bakes, usage metering and spend limits, the idle reaper;
- models.py: the request and response models (the schemas of docs/openapi.json);
- admission.py: live-sandbox slots and the bounded FIFO queue (429, 409);
- images.py: each tenant's image store (uploads verified against their digests, the image quota)
  and its template namespace;
- errors.py: `ApiError` and the mapping between SDK exceptions and responses;
- config.py: `ServerConfig` and the API's fixed limits; metrics.py: Prometheus; log.py: JSON lines;
- keys.py: API keys (`KeyStore`); cli.py: `collimate serve|keys|openapi`.
Imports run one way: config, errors, log, metrics < admission, models < images < control < app.
"""
