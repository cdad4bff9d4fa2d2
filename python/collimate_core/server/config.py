"""The server's configuration (`ServerConfig`, what `collimate serve` sets from its flags) and the
API's fixed limits (body sizes, exec and ready timeouts, widths, name patterns)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any


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
    max_download: int = 256 << 20  # bytes of one file a download may read (GET .../files)
    max_image_upload: int = 4 << 30  # bytes of one image archive (POST /v1/images)
    max_bakes: int = 2  # bakes running at once on this server; more get 429
    image_quota: int = 20 << 30  # bytes of image archives each tenant may keep (0: no quota)
    key_store: Path | None = None
    cache: Path | None = None
    preload: tuple[str, ...] = ("python",)
    # Each sandbox's writable mounts together (the default and the most a request may ask for), and
    # the host budget (guest memory + shared memory + disk quota of every live sandbox; None: no budget).
    # See sdk/quota.py.
    disk_quota: int = 1 << 30
    memory_budget: int | None = None
    # Each sandbox's shared-memory pool (shared mappings, memfds, /dev/shm; the default and the most
    # a request may ask for).
    shared_memory: int = 512 << 20
    # The widest network policy any request may ask for (an sdk.egress.Egress; None: no ceiling).
    egress_ceiling: Any = None
    # What sandboxes run on: "auto", "kvm" or "systrap" (None: COLLIMATE_PLATFORM, else auto).
    platform: str | None = None
