"""The API's request and response models (pydantic): the schemas of docs/openapi.json."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from collimate_core.server.config import (
    MAX_EXEC_SECONDS,
    MAX_PATH,
    MAX_READY_SECONDS,
    MAX_WIDTH,
    TEMPLATE_NAME,
)


class ErrorDetail(BaseModel):
    type: str = Field(description="invalid_argument, authentication, spend_limit, not_found, sandbox_died, "
                      "capacity, conflict, payload_too_large, image_quota, timeout, platform_unavailable, engine_error, "
                      "internal")
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
    egress: EgressSpec | None = Field(None, description="the network policy of the bake and its Ready step only "
                                      "(the template's sandboxes start with none), within the server's ceiling")
    read_only_root: bool = Field(False, description="keep the sandboxes' root filesystem the image's, read-only "
                                 "(EROFS outside /tmp, /work, /dev/shm and HOME); by default writes land in a "
                                 "copy-up layer in the sandbox's disk quota")


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


class EgressSpec(BaseModel):
    """A sandbox's network policy (docs/egress.md). `{}` (or absent): no network."""

    model_config = ConfigDict(extra="forbid", strict=True)
    internet: bool = Field(False, description="public addresses on any port (never loopback, private, "
                           "link-local or metadata addresses: only an IP or CIDR rule admits those)")
    rules: list[str] = Field(
        default_factory=list, max_length=256,
        description='each a host name ("index.example.org"), a wildcard ("*.files.example.net"), either with an optional '
        '":port", or an IP address or CIDR block with an optional port ("203.0.113.0/24", "203.0.113.7:5432", '
        '"[2001:db8::1]:443")',
    )
    record: bool = Field(False, description="record each exec's flows with its seed; a replay of that exec (the same "
                         "sandbox state and seed) is served the recorded bytes instead of the network")


class CreateSandbox(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    template: str = Field("python", min_length=1, max_length=128)
    egress: EgressSpec | None = Field(None, description="the sandbox's network policy (default: none), within the "
                                      "server's --egress-ceiling")
    disk_quota: int | None = Field(
        None, ge=1 << 20, description="bytes for /tmp and /work together (default: the template's, "
        "else the server's --disk-quota, which is also the most a request may ask for)",
    )
    shared_memory: int | None = Field(
        None, description="bytes of shared memory (shared mappings, memfds and /dev/shm together; at least 1 MiB; "
        "default: the server's --shared-memory, which is also the most a request may ask for)",
    )


class DiskUsage(BaseModel):
    bytes: int = Field(description="what /tmp and /work hold together")
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
    egress: EgressSpec = Field(default_factory=EgressSpec, description="the sandbox's network policy")
    platform: str = Field("kvm", description="what the sandbox runs on: kvm (a KVM virtual machine) or systrap (a "
                          "confined host process under a trap-everything seccomp filter); the server's --platform")
    shared_memory: int | None = Field(None, description="the sandbox's shared-memory limit in bytes (shared "
                                      "mappings, memfds and /dev/shm together)")


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
    seed_ack: str = Field(description="verified, no-ack, off, mismatch or not-reproducible")
    duration: float
    timed_out: bool
    truncated: bool
    interpreter_died: bool = Field(
        False, description="this exec ended the sandbox's interpreter (guest pid 1): the next exec runs in a fresh one"
    )
    interpreter_restarted: bool = Field(
        False,
        description="this exec ran in a fresh interpreter: an earlier exec's interpreter died (the sandbox was restored "
        "from the template: Python state, processes and files in /tmp and /work are gone) or did not stop after a "
        "timeout (replaced over the same files; docs/sessions.md)",
    )
    note: str = Field("", description="what happened to the interpreter, in words ('' when nothing did)")
    limit: str = Field("", description="a limit of the sandbox that refused something during this exec: "
                       "'shared_memory' ('' when none did)")
    egress_replay: str = Field("", description="under an egress policy with record=true: recorded, replayed or "
                               "diverged (docs/egress.md); '' otherwise")
    egress_error: str = Field("", description="where a replay diverged from its recording, in words ('' when it did not)")
    platform: str = Field("kvm", description="what the exec ran on: kvm or systrap")


class UploadResponse(BaseModel):
    path: str
    bytes: int


class ForkGroupRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    width: int = Field(ge=1, le=MAX_WIDTH)
    egress: EgressSpec | None = Field(None, description="the children's network policy: the parent's (default) "
                                      "or a narrower one; a wider one is refused before anything is forked")


class ForkRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    egress: EgressSpec | None = Field(None, description="the child's network policy: the parent's (default) or a "
                                      "narrower one")


class EgressEntry(BaseModel):
    seq: int = Field(0, description="its place in the sandbox's log since the sandbox started (entries below the "
                     "first one returned were dropped)")
    time: float = Field(description="Unix time")
    pid: int = Field(description="the guest process")
    kind: str = Field(description="connect (TCP), udp or dns")
    name: str | None = Field(description="the name asked (dns), or whose answer gave the address (connect)")
    address: str | None
    port: int
    rule: str | None = Field(description="the rule that admitted it (null: denied)")
    verdict: str = Field(description="allowed, denied, nxdomain, reset (a policy change forbade it), failed, "
                         "capped (the sandbox's flow cap: the guest got EMFILE), "
                         "or, under record=true, replayed (served from a recording) or diverged (reset: it differed)")
    detail: str
    bytes_out: int = Field(description="bytes sent and acknowledged by the peer")
    bytes_in: int
    open: bool


class EgressLog(BaseModel):
    egress: EgressSpec
    entries: list[EgressEntry] = Field(description="the newest entries (at most 10,000), oldest first")
    dropped: int = Field(0, description="older entries the sandbox's log no longer holds")


class SetEgressResponse(BaseModel):
    egress: EgressSpec
    reset: int = Field(description="open connections the new policy forbade, now reset")


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
    egress_bytes_out: int = Field(0, description="bytes the sandboxes' connections sent (acknowledged by the peer)")
    egress_bytes_in: int = Field(0, description="bytes the sandboxes' connections received")
    spend_limit_seconds: float | None = Field(description="this tenant's limit in sandbox-seconds (null: none)")
    spent_seconds: float = Field(description="sandbox-seconds counted against the limit")
