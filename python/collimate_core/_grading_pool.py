"""Prepared templates for grading: the template, the spec's setup and the grader, checkpointed once.

Grading a candidate in a child freshly forked from a prepared parent costs a host fork and a new
KVM VM, and the child's first exec pays a trip to the host for every page it touches first (about
2 + 4 ms on a kvm_pvm host, more than the grading itself). A clone of a template that already holds
the setup and the grader needs neither: the embedded engine hands out a recycled sandbox (reset to
the template: its VM and most of its page mappings stay warm) or a pre-forked spare.

So, on a client that can host templates (the embedded engine), `prepared(client, ...)` prepares a
sandbox once (setup, grader), snapshots it into `<cache>/grading/<pid>-<n>-<key>/` and registers it
as the template `__grading__-<key>`; later grades with the same template, setup and preloaded
modules clone it directly. It lives as long as the client (and the process: the directory is
removed at exit; directories of processes that are gone are pruned). A client that cannot (the
remote client) gets None, and grading forks children of a prepared parent instead.
"""

from __future__ import annotations

import atexit
import dataclasses
import hashlib
import itertools
import os
import shutil
import threading
import warnings
import weakref
from pathlib import Path
from typing import Any, Callable, Sequence

from collimate_core._errors import CollimateError, InvalidArgument

_lock = threading.Lock()
_prepared: "weakref.WeakKeyDictionary[Any, dict[str, str]]" = weakref.WeakKeyDictionary()
_failed: "weakref.WeakKeyDictionary[Any, set[str]]" = weakref.WeakKeyDictionary()
_key_locks: dict[tuple[int, str], threading.Lock] = {}
_dirs: list[Path] = []
_serial = itertools.count()


def _grading_dir() -> Path:
    from collimate_core._templates import cache_dir

    return cache_dir() / "grading"


def _prune(root: Path) -> None:
    """Remove what processes that are gone left behind."""
    try:
        entries = list(root.iterdir())
    except OSError:
        return
    for d in entries:
        pid = d.name.split("-", 1)[0]
        if not pid.isdigit() or int(pid) == os.getpid():
            continue
        try:
            os.kill(int(pid), 0)
            continue  # alive
        except ProcessLookupError:
            shutil.rmtree(d, ignore_errors=True)
        except OSError:
            continue


@atexit.register
def _remove_dirs() -> None:
    for d in _dirs:
        shutil.rmtree(d, ignore_errors=True)


def supported(client: Any) -> bool:
    return hasattr(client, "register_template") and hasattr(client, "_template")


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
    base = client._template(template).baked
    key = hashlib.sha256(
        repr((str(base.path), template, setup, sorted(preload), harness_key)).encode()
    ).hexdigest()[:16]

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
        from collimate_core._session import Sandbox

        path = None
        try:
            root = _grading_dir()
            root.mkdir(parents=True, exist_ok=True)
            _prune(root)
            # One directory per client and key: another client's template may be using its own.
            path = root / f"{os.getpid()}-{next(_serial)}-{key}"
            shutil.rmtree(path, ignore_errors=True)
            with Sandbox(template, client=client) as sb:
                prepare(sb)  # its failures (a bad setup) raise as they are
                box = sb._live()
                vm = getattr(box, "vm", None)
                if vm is None or not hasattr(vm, "snapshot"):
                    raise OSError("this client's sandboxes cannot be checkpointed")
                with box.lock:
                    vm.snapshot(str(path))
            _dirs.append(path)
            name = f"__grading__-{key}"
            client.register_template(name, dataclasses.replace(base, name=name, path=path))
        except (OSError, CollimateError) as e:
            if isinstance(e, InvalidArgument):
                raise
            # No checkpoint (a read-only cache, an engine that cannot snapshot this template):
            # grade in forked children of a prepared parent instead, for the life of the client.
            if path is not None:
                shutil.rmtree(path, ignore_errors=True)
            warnings.warn(f"collimate: grading without a prepared template for {template!r} ({e}); "
                          "each group forks a prepared parent instead", RuntimeWarning, stacklevel=3)
            name = None
        with _lock:
            names[key] = name
            if name is None:
                failed.add(key)
        return name
