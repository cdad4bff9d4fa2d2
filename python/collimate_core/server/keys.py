"""API keys of the control plane: `col_<tenant>_<key id>_<secret>`, stored hashed.

The store is one JSON file (default `<cache>/keys.json`, `COLLIMATE_KEY_STORE` or `--key-store`),
written atomically with mode 0600 under an flock so the CLI and a running server can share it.
It holds a random per-store salt and, per key, HMAC-SHA256(salt, key): never the key itself. Keys
carry 256 bits of randomness, so a keyed hash is enough (a slow password hash would only add
latency to every request). The key id inside the key makes a lookup one dictionary probe and a
constant-time comparison; it is also the handle `collimate keys revoke` takes.

A running server notices edits (a new or revoked key) by the file's mtime and size.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os
import re
import secrets
import threading
import time
from contextlib import contextmanager
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Iterator

from collimate_core.templates import cache as _cache
from collimate_core.sdk.errors import AuthenticationError, InvalidArgument

TENANT_RE = re.compile(r"^[a-z0-9][a-z0-9-]{0,31}$")
KEY_RE = re.compile(r"^col_([a-z0-9][a-z0-9-]{0,31})_([0-9a-f]{16})_([A-Za-z0-9]{32,128})$")
STORE_VERSION = 1


def default_store_path() -> Path:
    env = os.environ.get("COLLIMATE_KEY_STORE")
    if env:
        return Path(env)
    from collimate_core.templates.catalog import cache_dir

    return cache_dir() / "keys.json"


def check_tenant(tenant: str) -> str:
    if not isinstance(tenant, str) or not TENANT_RE.match(tenant):
        raise InvalidArgument(
            f"tenant must be 1-32 characters of lowercase letters, digits and '-' (it is part of the key), not {tenant!r}"
        )
    return tenant


def parse_key(key: str) -> tuple[str, str]:
    """(tenant, key id) of a well-formed key; AuthenticationError otherwise."""
    m = KEY_RE.match(key) if isinstance(key, str) else None
    if m is None:
        raise AuthenticationError("malformed API key: keys look like col_<tenant>_<16 hex>_<secret>")
    return m.group(1), m.group(2)


@dataclass
class KeyRecord:
    id: str
    tenant: str
    hash: str
    created: float
    revoked: float | None = None
    note: str = ""

    def public(self) -> dict:
        """What `keys list` shows: never the hash."""
        return {"id": self.id, "tenant": self.tenant, "created": self.created, "revoked": self.revoked, "note": self.note}


class KeyStore:
    """The hashed key store at `path`. Thread-safe; reloads when another process edits the file."""

    def __init__(self, path: str | Path | None = None):
        self.path = Path(path) if path else default_store_path()
        self._lock = threading.Lock()
        self._salt = b""
        self._keys: dict[str, KeyRecord] = {}
        self._stamp: tuple[int, int] | None = None
        self._checked = 0.0

    # --- file --------------------------------------------------------------------------------

    @contextmanager
    def _exclusive(self) -> Iterator[None]:
        # The cache's per-entry lock (`.keys.json.lock`, see templates/cache.py): other threads and
        # processes (the CLI, a server) wait; a killed writer's temporary is swept.
        with _cache.Lock(self.path):
            _cache.sweep(self.path.parent)
            yield

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = self.path.stat()
        except FileNotFoundError:
            return None
        return (st.st_mtime_ns, st.st_size)

    def _load(self) -> None:
        stamp = self._stat()
        if stamp is None:
            self._salt, self._keys, self._stamp = b"", {}, None
            return
        try:
            doc = json.loads(self.path.read_text())
            if doc.get("version") != STORE_VERSION:
                raise ValueError(f"version {doc.get('version')!r}, expected {STORE_VERSION}")
            salt = bytes.fromhex(doc["salt"])
            keys = {k["id"]: KeyRecord(**k) for k in doc["keys"]}
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise InvalidArgument(f"the key store {self.path} is damaged ({e}); move it aside and create new keys") from None
        self._salt, self._keys, self._stamp = salt, keys, stamp

    def _save(self) -> None:
        doc = {"version": STORE_VERSION, "salt": self._salt.hex(), "keys": [asdict(k) for k in self._keys.values()]}
        _cache.write_atomic(self.path, json.dumps(doc, indent=1), mode=0o600, fsync=True)
        self._stamp = self._stat()

    def _refresh(self) -> None:
        """Reload if the file changed since the last look (at most one stat per 100 ms)."""
        now = time.monotonic()
        if now - self._checked < 0.1 and self._stamp is not None:
            return
        self._checked = now
        if self._stat() != self._stamp:
            self._load()

    def _digest(self, key: str) -> str:
        return hmac.new(self._salt, key.encode(), hashlib.sha256).hexdigest()

    # --- management (the CLI) ------------------------------------------------------------------

    def create(self, tenant: str, note: str = "") -> tuple[str, KeyRecord]:
        """A new key for `tenant`: (the key, shown once; its record)."""
        check_tenant(tenant)
        with self._lock, self._exclusive():
            self._load()
            if not self._salt:
                self._salt = secrets.token_bytes(32)
            key_id = secrets.token_hex(8)
            while key_id in self._keys:
                key_id = secrets.token_hex(8)
            alphabet = "ABCDEFGHIJKLMNOPQRSTUVWXYZabcdefghijklmnopqrstuvwxyz0123456789"
            secret = "".join(secrets.choice(alphabet) for _ in range(43))  # ~256 bits
            key = f"col_{tenant}_{key_id}_{secret}"
            rec = KeyRecord(id=key_id, tenant=tenant, hash=self._digest(key), created=time.time(), note=note)
            self._keys[key_id] = rec
            self._save()
            return key, rec

    def revoke(self, key_id: str) -> KeyRecord:
        with self._lock, self._exclusive():
            self._load()
            rec = self._keys.get(key_id)
            if rec is None:
                raise InvalidArgument(f"no key with id {key_id!r} in {self.path}; `collimate keys list` shows the ids")
            if rec.revoked is None:
                rec.revoked = time.time()
                self._save()
            return rec

    def list(self) -> list[KeyRecord]:
        with self._lock:
            self._load()
            return sorted(self._keys.values(), key=lambda r: r.created)

    # --- authentication (the server) -----------------------------------------------------------

    def authenticate(self, key: str | None) -> str:
        """The tenant of a valid, unrevoked key; AuthenticationError (without saying which part
        was wrong) otherwise."""
        if not key:
            raise AuthenticationError("missing API key: send 'Authorization: Bearer col_...'")
        tenant, key_id = parse_key(key)
        with self._lock:
            self._refresh()
            if key_id not in self._keys:  # perhaps created a moment ago: look at the file now
                self._checked = 0.0
                self._refresh()
            rec = self._keys.get(key_id)
            digest = self._digest(key) if self._salt else ""
        if rec is None or rec.revoked is not None or rec.tenant != tenant or not hmac.compare_digest(digest, rec.hash):
            raise AuthenticationError("invalid or revoked API key")
        return tenant
