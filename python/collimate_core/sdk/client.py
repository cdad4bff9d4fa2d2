"""`connect()`: the one entry point."""

from __future__ import annotations

import atexit
import os
import threading
from typing import TYPE_CHECKING

from collimate_core.sdk.embedded import EmbeddedClient
from collimate_core.sdk import platform as _platform
from collimate_core.sdk.errors import AuthenticationError, InvalidArgument

if TYPE_CHECKING:
    from collimate_core.ray.client import RayClient
    from collimate_core.sdk.remote import RemoteClient

_shared: dict[str, EmbeddedClient] = {}  # by the platform asked for (auto, kvm, systrap)
_remote: dict[tuple[str, str], "RemoteClient"] = {}
_rays: dict[tuple[str, str | None], "RayClient"] = {}
_lock = threading.Lock()


def connect(api_key: str | None = None, *, base_url: str | None = None, ray: str | None = None,
            platform: str | None = None):
    """A client. With no key (argument or COLLIMATE_API_KEY): the embedded engine on this host,
    shared by the whole process. With a key: the control plane over HTTP at `base_url`
    (COLLIMATE_BASE_URL, default http://127.0.0.1:8477), a `RemoteClient` with the same surface,
    also shared per key and server. With `ray` ("auto" or a cluster address; or
    COLLIMATE_RAY_ADDRESS, when no key is given): a `RayClient` over the cluster's collimate hosts
    (`pip install collimate-core[ray]`; see ray/), shared per address.

    `platform`: what the sandboxes run on, "auto", "kvm" or "systrap" (docs/platforms.md). The
    embedded engine takes it (default COLLIMATE_PLATFORM, else "auto"; one shared client per
    choice); on Ray it passes to the host actors; over HTTP the server chose at `collimate serve
    --platform`, and asking for another raises InvalidArgument. `client.platform` says which."""
    if platform is not None:
        _platform.check(platform)
    key = api_key or os.environ.get("COLLIMATE_API_KEY")
    address = ray or (None if api_key else os.environ.get("COLLIMATE_RAY_ADDRESS"))
    if address:
        from collimate_core.ray.client import RayClient

        with _lock:
            client = _rays.get((address, platform))
            if client is None:
                client = _rays[(address, platform)] = RayClient(address, platform=platform)
            return client
    if key:
        if not key.startswith("col_"):
            raise AuthenticationError("API keys start with 'col_'; check COLLIMATE_API_KEY")
        from collimate_core.sdk.remote import DEFAULT_BASE_URL, RemoteClient

        url = base_url or os.environ.get("COLLIMATE_BASE_URL") or DEFAULT_BASE_URL
        with _lock:  # one client (connection pool, keepalive thread) per key and server
            client = _remote.get((key, url))
            if client is None or client.closed:
                client = _remote[(key, url)] = RemoteClient(key, url)
        if platform not in (None, "auto") and client.platform != platform:
            raise InvalidArgument(
                f"the control plane at {url} runs its sandboxes on {client.platform!r}, not {platform!r} (it chose at "
                "`collimate serve --platform`); connect with platform='auto' or to a server started with "
                f"--platform {platform}"
            )
        return client
    asked = _platform.requested(platform)
    with _lock:
        shared = _shared.get(asked)
        if shared is None:
            shared = _shared[asked] = EmbeddedClient(platform=asked)
            atexit.register(shared.close)
        return shared
