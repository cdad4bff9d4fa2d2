"""Prepared templates for grading: the template, the spec's setup and the grader, checkpointed once.

Grading a candidate in a child freshly forked from a prepared parent costs a host fork and a new
KVM VM, and the child's first exec pays a trip to the host for every page it touches first (about
2 + 4 ms on a kvm_pvm host, more than the grading itself). A clone of a template that already holds
the setup and the grader needs neither: the embedded engine hands out a recycled sandbox (reset to
the template: its VM and most of its page mappings stay warm) or a pre-forked spare.

So, on a client that can host templates (the embedded engine), `prepared(client, ...)` prepares a
sandbox once (setup, grader), snapshots it into `<cache>/grading/<key>/` (a kvm snapshot, or on
systrap a systrap one: `sdk/live.py`'s `LiveTemplate.restored`) and registers it as the template
`__grading__-<key>`; later grades with the same template, setup and preloaded modules
clone it directly. The key covers all that the snapshot depends on (the base template's directory
among it), so the entry is shared: by every client and process (one prepares it, under its lock;
the others wait and use it) and by later runs. A process that uses an entry holds a shared flock
on its `.hold` until it exits; beyond the KEEP most recently used, entries no process holds are
removed. A client that cannot host templates (the remote client) gets None, and grading forks
children of a prepared parent instead.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

from collimate_core.templates import cache as _cache
from collimate_core.sdk.errors import CollimateError, InvalidArgument

_lock = threading.Lock()
_prepared: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()
_failed: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()
_key_locks: dict[tuple[int, str], threading.Lock] = {}
_holds: dict[str, Any] = {}  # entry path -> this process's shared flock on its .hold (kept to exit)
# Prepared templates kept in the cache beyond those in use; the least recently used go first.
KEEP = 32
HOLD = _cache.HOLD


def _grading_dir(client: Any) -> Path:
    from collimate_core.templates.catalog import cache_dir

    return Path(getattr(client, "cache", None) or cache_dir()) / "grading"


def _prune_legacy(root: Path) -> None:
    """Remove the per-process directories (`<pid>-<n>-<key>`) of older versions whose process is gone."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for d in entries:
        m = re.fullmatch(r"(\d+)-\d+-[0-9a-f]{16}", d.name)
        if m and int(m.group(1)) != os.getpid() and not _cache._alive(int(m.group(1))):
            shutil.rmtree(d, ignore_errors=True)


def _hold(entry: Path, state_file: str = "vm.state") -> Any | None:
    """A shared flock on `entry`/.hold, the mark that a process uses it (see _prune); None if the
    entry went (a prune removed it) before the hold was taken."""
    return _cache.hold(entry, state_file)


def _prune(root: Path, keep: int = KEEP) -> None:
    """Keep at most `keep` prepared templates that no process uses: remove the least recently used
    others (an exclusive flock on .hold fails while any process holds it shared)."""
    try:
        entries = [d for d in root.iterdir() if re.fullmatch(r"[0-9a-f]{16}", d.name) and d.is_dir()]
    except OSError:
        return
    entries.sort(key=lambda d: d.stat().st_mtime if d.exists() else 0.0, reverse=True)
    for d in entries[keep:]:
        _cache.remove_unheld(d)


def supported(client: Any) -> bool:
    return hasattr(client, "register_template") and hasattr(client, "_template")


def _state_file(platform: str) -> str:
    """The file that marks a finished snapshot of `platform` (docs/systrap.md: a systrap snapshot
    is its own format)."""
    return "systrap.state" if platform == "systrap" else "vm.state"


def prepared(
    client: Any,
    template: str,
    setup: str | None,
    preload: Sequence[str],
    harness_key: str,
    prepare: Callable[[Any], None],
) -> str | None:
    """The name of a template holding `template` + `setup` + the grader (preloading `preload`),
    made on first use by running `prepare(sandbox)` and checkpointing the result; None when the
    client cannot host templates or the checkpoint failed (then grading forks a prepared parent
    per group; a failure of `prepare` itself raises)."""
    if not supported(client):
        return None
    platform = getattr(client, "platform", "kvm")
    t = client._template(template)
    base = t.baked
    parts: tuple = (str(base.path), template, setup, sorted(preload), harness_key)
    if platform == "systrap":
        # The base's state (a live template's path is its root filesystem) and the platform: a
        # systrap snapshot cannot be restored on kvm, nor the reverse.
        parts += ("systrap", t.state)
    key = hashlib.sha256(repr(parts).encode()).hexdigest()[:16]
    state_file = _state_file(platform)

    def known() -> bool:
        if key in failed:
            return True
        name = names.get(key)
        # A closed client forgets its templates; prepare again then.
        return name is not None and name in getattr(client, "_templates", {})

    with _lock:
        names = _prepared.setdefault(client, {})
        failed = _failed.setdefault(client, set())
        if known():
            return names.get(key)
        klock = _key_locks.setdefault((id(client), key), threading.Lock())
    with klock:
        with _lock:
            if known():
                return names.get(key)
        from collimate_core.sdk.session import Sandbox

        def build(tmp: Path) -> None:
            with Sandbox(template, client=client) as sb:
                prepare(sb)  # its failures (a bad setup) raise as they are
                box = sb._live()
                vm = getattr(box, "vm", None)
                if vm is None or not hasattr(vm, "snapshot"):
                    raise OSError("this client's sandboxes cannot be checkpointed")
                with box.lock:
                    vm.snapshot(str(tmp))
            (tmp / HOLD).touch()

        try:
            root = _grading_dir(client)
            _prune_legacy(root)
            # One entry per key in the cache, shared by every client and process: the first to
            # need it prepares it (under its lock), the others wait and use it.
            entry = root / key
            hold = None
            while hold is None:
                if _cache.build_once(entry, lambda p: (p / state_file).is_file(), build, kind="grading", key=key,
                                     cache=root.parent):
                    _prune(root)
                hold = _hold(entry, state_file)
            with _lock:
                old = _holds.pop(str(entry), None)
                _holds[str(entry)] = hold
            if old is not None:
                old.close()
            name = f"__grading__-{key}"
            if platform == "systrap":
                from collimate_core.sdk.live import LiveTemplate

                client.register_template(name, LiveTemplate.restored(name, base.root, entry, t.disk_quota, t.shared_memory,
                                                                     seed_ack=base.seed_ack, state=f"{t.state}/{key}"))
            else:
                client.register_template(name, dataclasses.replace(base, name=name, path=entry))
        except (OSError, CollimateError) as e:
            if isinstance(e, InvalidArgument):
                raise
            # No checkpoint (a read-only cache, an engine that cannot snapshot this template):
            # grade in forked children of a prepared parent instead, for the life of the client.
            warnings.warn(f"collimate: grading without a prepared template for {template!r} ({e}); "
                          "each group forks a prepared parent instead", RuntimeWarning, stacklevel=3)
            name = None
        with _lock:
            names[key] = name
            if name is None:
                failed.add(key)
        return name
