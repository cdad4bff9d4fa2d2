"""`connect()`: the one entry point."""

from __future__ import annotations

import atexit
import os
import threading

from collimate_core._embedded import EmbeddedClient
from collimate_core._errors import AuthenticationError

_shared: EmbeddedClient | None = None
_lock = threading.Lock()


def connect(api_key: str | None = None, *, base_url: str | None = None) -> EmbeddedClient:
    """A client. With no key (argument or COLLIMATE_API_KEY): the embedded engine on this host,
    shared by the whole process. With a key: the control plane over HTTP."""
    key = api_key or os.environ.get("COLLIMATE_API_KEY")
    if key:
        if not key.startswith("col_"):
            raise AuthenticationError("API keys start with 'col_'; check COLLIMATE_API_KEY")
        raise AuthenticationError(
            "this build has no HTTP control-plane client yet; unset COLLIMATE_API_KEY (and pass no "
            "api_key) to use the embedded engine on this host"
        )
    global _shared
    with _lock:
        if _shared is None:
            _shared = EmbeddedClient()
            atexit.register(_shared.close)
        return _shared
