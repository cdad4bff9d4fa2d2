"""Templates on systrap: a zygote from a systrap snapshot, or a live one.

On kvm a template is a snapshot and its zygote a VMM restored from it (sdk/embedded.py). On
systrap the catalog "python" template is one too: its agent (spawned with the argv, environment
and mounts every python template has, `templates.catalog.spawn_agent`) is run once to its ready
point and checkpointed into the cache (`systrap_snapshots`: `templates/systrap/<name>-<state>/`,
the engine's systrap snapshot, docs/systrap.md), and each client process's zygote is a VMM restored
from that snapshot (`LiveTemplate.restored_from`), never run: a second process on the host uses the
template without booting the agent again, and a seed replays across processes, virtual clocks
included, as on kvm. A damaged snapshot (or one from another engine) is made again.
Sandboxes are clones of the zygote (a fork of its stub plus a host fork of its VMM: guest memory
shared copy-on-write, writable mounts copied). A few clones are made ahead as spares, by a
background thread, as the kvm engine keeps its spare pool: a new sandbox takes one and the
thread makes the next. Each spare has taken its first exec's host page faults before it is
handed out (the engine learns them from the template's first clones: vmm/systrap/warm.rs), and
the catalog template's agent ran one exec of `pass` before its snapshot (`warm_up`), so a
sandbox's first exec is not CPython's first in its process. The spare thread stays a while once
the pool is full (`LINGER`), so that taking a spare does not wait for a thread to start.
A sandbox that ends is recycled by reset, as on kvm: the engine returns it to the snapshot the
zygote was restored from in place (vmm/systrap/reset.rs: its pages copied on write dropped back to
the snapshot's, mappings made since unmapped, registers and guest OS state restored, other guest
processes killed) and the template keeps it (at most `embedded.RECYCLE_MAX`) for the next sandbox,
which takes it before a spare: its stub's page tables and its VMM are warm. `Sandbox.reset()`
is the same reset. Only templates whose zygote was restored from a snapshot recycle (all of those
a client uses; a live-booted zygote's memory has nothing to drop back to), and
`COLLIMATE_SYSTRAP_RECYCLE=0` in the client's environment when a template is made turns recycling
off for it (every sandbox that ends is destroyed, `Sandbox.reset()` gets a new clone), to compare.

Image templates (Template.bake, `client.env(image)`) are booted live by templates/bake.py
(`LiveTemplate.image`: the image's unpacked root filesystem as the guest's root, its agent spawned
with the image's argv, Env, WorkingDir, User and seeded writable mounts, and the bake's Ready steps
run in the zygote once, with the writable root in a clone of the booted agent, as on kvm), then
checkpointed and committed to the template store; the client's zygote is restored from that
version (`LiveTemplate.from_image`), here and in any other process. A template baked into a kvm
snapshot cannot run here and is refused with `PlatformUnavailable` (`image_templates_unavailable`)
saying what to do.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import threading
import time
import weakref
from pathlib import Path
from typing import Any, Callable

from collimate_core._core import SYSTRAP_SNAPSHOT_FORMAT, Vm
from collimate_core._core import EngineError as _CoreEngineError
from collimate_core._core import SnapshotError as _SnapshotError
from collimate_core.sdk.errors import PlatformUnavailable
from collimate_core.templates import cache as _cachelib
from collimate_core.templates import catalog as _catalog
from collimate_core.templates.catalog import Baked

_log = logging.getLogger("collimate.systrap")

# What the engine says of a snapshot it cannot restore because of the file itself.
DAMAGED = ("is damaged:", "has format version")

# What runs on systrap today, for the errors that refuse the rest.
SYSTRAP_RUNS = (
    "on the systrap platform the embedded engine runs the catalog template 'python' and image templates "
    "baked live on the same client (sessions, execs, fork groups, grading, seeds)"
)
# How long after a spare is handed out the spare thread waits before cloning the next, while
# another spare is left: the clone (a stub fork, a VMM fork and the clone taking its first exec's
# faults, a few ms of CPU) would otherwise run beside the new sandbox's first exec on a small host
# (2 cores: that exec took 3-10 ms instead of 2 ms). With no spare left it clones at once.
REFILL_AFTER = 0.03
# How long the spare thread stays once the pool is full, for the next sandbox taken: starting a
# thread costs the taker 0.1-0.2 ms here (`Thread.start` waits for it to run), a tenth of a
# paced sandbox. At the interpreter's exit it goes at once (`_at_exit`).
LINGER = 1.0

# Templates whose spare thread may be lingering (told to go at the interpreter's exit).
_live_templates: "weakref.WeakSet[LiveTemplate]" = weakref.WeakSet()
_exiting = False


def _at_exit() -> None:
    global _exiting
    _exiting = True
    for t in list(_live_templates):
        t._wanted.set()


if hasattr(threading, "_register_atexit"):  # runs before the interpreter joins its threads
    threading._register_atexit(_at_exit)

# The catalog template's agent runs one exec of `pass` before its snapshot is taken (`warm_up`):
# CPython's first exec in a process does work a later one does not (its heap grown by brk, the
# exec path's objects and caches made: 899 pages touched against 566), which every sandbox's first
# exec paid again (1.9 ms against 0.5 ms for its second). The exec changes nothing a program sees:
# the user's namespace is the same, the PRNGs are reseeded at every exec, and a seeded exec starts
# the virtual clocks again. `COLLIMATE_SYSTRAP_WARMUP=0` in the client's environment takes (and
# names) a snapshot without it, to compare (benches).
WARM_UP_CODE = "pass"


def recycle_enabled() -> bool:
    """Whether sandboxes that end are reset and kept for reuse (`COLLIMATE_SYSTRAP_RECYCLE`)."""
    return os.environ.get("COLLIMATE_SYSTRAP_RECYCLE", "1") != "0"


def warm_up_enabled() -> bool:
    return os.environ.get("COLLIMATE_SYSTRAP_WARMUP", "1") != "0"


def patched_snapshot_enabled() -> bool:
    """Whether the VMMs of a template made now snapshot its agent with its syscall sites patched
    (platform/systrap/patch.rs; the default): not with `COLLIMATE_SYSTRAP_PATCH=0` (nothing is
    patched) or `COLLIMATE_SYSTRAP_PATCH_SNAPSHOT=0` (the sites put back first, as before). The
    two kinds of snapshot are cached apart, so a client with patching off restores one that has
    no patched site, and an A/B of the knobs compares what they say."""
    return all(os.environ.get(k, "1") != "0" for k in ("COLLIMATE_SYSTRAP_PATCH", "COLLIMATE_SYSTRAP_PATCH_SNAPSHOT"))


def warm_up(vm: Vm, what: str) -> None:
    """Run one exec of `WARM_UP_CODE` in an agent at its ready point, unseeded, and leave it at
    its ready point again; raise if it did not get back there."""
    r = vm.agent_call(_catalog.frame({"op": "exec", "code": WARM_UP_CODE}), 60.0)
    reply = _catalog.unframe(r.agent) if (r.kind, r.value) == ("yield", _catalog.AGENT_IDLE) else None
    if not reply or reply.get("exit_code") != 0:
        raise _CoreEngineError(
            f"{what}: the agent's warm-up exec did not end at its ready point ({r!r}, reply {reply!r}); "
            f"stderr: {r.stderr[-2000:].decode(errors='replace')}"
        )


SYSTRAP_HELP = "use platform='kvm' (connect(platform='kvm')) on a host where /dev/kvm opens and creates a VM"


def image_templates_unavailable(what: str) -> PlatformUnavailable:
    """The error for a template baked into a snapshot (on kvm) asked for on systrap."""
    return PlatformUnavailable(
        f"{what} is not supported on the systrap platform yet: a snapshot is a kvm checkpoint, which systrap "
        f"sandboxes cannot restore; {SYSTRAP_RUNS}. Bake the image on this client (Template.bake(client, ...) "
        f"with connect(platform='systrap')), or {SYSTRAP_HELP}"
    )


class LiveTemplate:
    """A template whose zygote is a live agent at its ready point (the surface of embedded's
    `_Template` that the client uses: `baked`, `zygote`, `state`, quotas, `clone`, and no pool)."""

    platform = "systrap"

    def __init__(self, name: str, root: Path, disk_quota: int, shared_memory: int, cpus: int = 1,
                 start: Callable[[], tuple[Vm, Path]] | None = None, seed_ack: bool = True,
                 state: str | None = None, on_close: Callable[[], None] | None = None,
                 snapshot_root: Path | None = None):
        # `start`: how an image template's zygote is made (spawned and run through the bake's
        # steps; see `image`); None for the catalog agent (`_start`).
        self._starter = start
        self._on_close = on_close
        self.baked = Baked(name, root, root, True, seed_ack=seed_ack)
        self.lock = threading.Lock()
        self.disk_quota = disk_quota
        self.shared_memory = shared_memory
        self.spares = 0
        self._pool: list[Vm] = []  # spare clones, oldest first (see `set_spares`)
        self.recycled: list[Vm] = []  # ended sandboxes, reset, for reuse (see `offer`)
        self._recycle = recycle_enabled()  # read once, when the template is made
        self._closed = False
        self._filling = False
        self._taken_at = 0.0  # when a spare was last handed out (time.monotonic)
        self._emptied = threading.Event()  # set when the last spare is handed out
        self._wanted = threading.Event()  # set by `_fill`: a lingering spare thread looks again
        _live_templates.add(self)
        self._cpus = cpus
        self._work: Path | None = None
        # The state its sandboxes start from, as egress recordings name it: what the zygote was
        # started from (a new root filesystem or agent is another state).
        self.state = state or hashlib.sha256(
            f"collimate/live-template/v1\0{name}\0{root}\0{_catalog._agent_hash()}\0{cpus}\0"
            f"{_catalog.TEMPLATE_VERSION}\0{SYSTRAP_SNAPSHOT_FORMAT}"
            f"{chr(0) + 'warm-up ' + WARM_UP_CODE if start is None and warm_up_enabled() else ''}"
            f"{chr(0) + 'syscall sites unpatched' if not patched_snapshot_enabled() else ''}".encode()
        ).hexdigest()
        # Where the catalog template's systrap snapshot lives (None: an image template, whose
        # `start` makes its zygote; or no cache given).
        self._snapshot = snapshot_root / f"{name}-{self.state[:16]}" if snapshot_root is not None and start is None else None
        # The snapshot the zygote was restored from (None: booted live).
        self.restored_from: Path | None = None
        self.zygote = self._start()

    @classmethod
    def image(cls, name: str, root: Path, start: Callable[[], tuple[Vm, Path]], state: str, *,
              disk_quota: int | None, shared_memory: int | None, seed_ack: bool,
              on_close: Callable[[], None] | None = None) -> LiveTemplate:
        """An image template's live zygote: `start()` spawns the image's agent on `root` in new
        writable mounts and runs it through the bake's steps to its ready point, returning the VM
        and the directory holding those mounts (called now, and again if the zygote dies).
        `state` names what it was baked from (image, Ready steps, agent, CPUs) for egress
        recordings. A quota left None is the client's (set when it registers the template)."""
        return cls(name, root, disk_quota, shared_memory, start=start, seed_ack=seed_ack, state=state,
                   on_close=on_close)

    @classmethod
    def restored(cls, name: str, root: Path, snapshot: Path, disk_quota: int | None, shared_memory: int | None, *,
                 seed_ack: bool, state: str) -> LiveTemplate:
        """A template whose zygote is restored from the systrap snapshot `snapshot` of a sandbox
        (grading's prepared templates: a sandbox after its setup, checkpointed once and shared
        by every process through the cache). `root` is the root filesystem it runs on."""

        def start() -> tuple[Vm, None]:
            return Vm.restore(snapshot), None

        t = cls(name, root, disk_quota, shared_memory, start=start, seed_ack=seed_ack, state=state)
        t.restored_from = snapshot
        return t

    @classmethod
    def from_image(cls, baked: Any) -> LiveTemplate:
        """The zygote of a committed image template version baked on systrap (`templates/bake.py`'s
        ImageBaked, its `path` a systrap snapshot): restored from it, with the writable root the
        bake asked for. Closing it releases the version's hold (its files stay while held)."""
        writable = bool(baked.meta.get("writable_root"))

        def start() -> tuple[Vm, None]:
            vm = Vm.restore(baked.path)
            if writable:
                try:
                    vm.set_writable_root(True)
                except BaseException:
                    vm.destroy()
                    raise
            return vm, None

        hold = baked.hold
        state = hashlib.sha256(f"collimate/systrap-image-template/v1\0{baked.path}\0{baked.meta.get('image_id')}".encode()
                               ).hexdigest()
        t = cls(baked.name, baked.root, baked.disk_quota, baked.shared_memory, start=start, seed_ack=baked.seed_ack,
                state=state, on_close=hold.close if hold is not None else None)
        t.restored_from = baked.path
        t.version = baked.version
        return t

    def resettable(self) -> bool:
        """Whether this template's sandboxes can be reset in place: its zygote was restored from a
        snapshot (what the engine resets to), and recycling is on."""
        return self.restored_from is not None and self._recycle

    def take_recycled(self) -> Vm | None:
        with self.lock:
            return self.recycled.pop() if self.recycled else None

    def has_room(self) -> bool:
        """Whether `offer` would keep a sandbox now (checked before paying for its reset)."""
        from collimate_core.sdk.embedded import RECYCLE_MAX

        with self.lock:
            return self.resettable() and not self._closed and len(self.recycled) < RECYCLE_MAX

    def offer(self, vm: Vm) -> bool:
        """Keep `vm` (already reset) for reuse; False if the pool is full or the template closed."""
        from collimate_core.sdk.embedded import RECYCLE_MAX

        with self.lock:
            if self._closed or len(self.recycled) >= RECYCLE_MAX:
                return False
            self.recycled.append(vm)
            return True

    def drain(self) -> None:
        with self.lock:
            vms, self.recycled = self.recycled, []
        for vm in vms:
            vm.destroy()

    def set_spares(self, n: int) -> None:
        """Keep `n` clones of the zygote ready (at most MAX_SPARES): made by a background thread,
        taken by `clone`. The engine keeps no spare pool on systrap, so the SDK does."""
        from collimate_core.sdk.embedded import MAX_SPARES

        n = max(0, min(n, MAX_SPARES))
        with self.lock:
            self.spares = n
            extra, self._pool = self._pool[n:], self._pool[:n]
        for vm in extra:
            vm.destroy()
        self._emptied.set()  # a waiting spare thread looks again
        self._fill()

    def _fill(self) -> None:
        """Start the thread that clones spares up to `spares`, unless it runs."""
        with self.lock:
            self._wanted.set()  # under the lock: a lingering thread that ends sees it first
            if self._filling or len(self._pool) >= self.spares or _exiting:
                return
            self._filling = True
        # Not a daemon: at the interpreter's exit it ends after its current clone (a daemon thread
        # frozen inside the engine's call aborts the process).
        threading.Thread(target=self._filler, name="collimate-systrap-spares").start()

    def _filler(self) -> None:
        ended = False
        try:
            while True:
                with self.lock:
                    if self.zygote is None or _exiting or self.spares == 0:
                        return
                    if len(self._pool) >= self.spares:
                        if not self._wanted.is_set():
                            ended = True  # `_fill` starts a new thread from now on
                            self._filling = False
                            return
                        self._wanted.clear()
                        full = True
                    else:
                        full = False
                if full:
                    # Stay a while for the next sandbox taken (see LINGER); a `_fill` meanwhile
                    # wakes this thread, else it ends at the check above.
                    self._wanted.wait(LINGER)
                    continue
                with self.lock:
                    wait = self._taken_at + REFILL_AFTER - time.monotonic() if self._pool else 0.0
                if wait > 0:  # not beside the first exec of the sandbox just handed out
                    self._emptied.wait(wait)
                    self._emptied.clear()
                    continue
                with self.lock:
                    if self.zygote is None or len(self._pool) >= self.spares:
                        return
                    try:
                        vm = self.zygote.clone()
                    except _CoreEngineError as e:
                        if "is gone" not in str(e):
                            return
                        # The zygote's VMM died: start a new one, once (as `clone` does).
                        try:
                            self._stop()
                            self.zygote = self._start()
                            vm = self.zygote.clone()
                        except Exception:  # noqa: BLE001 - the next `clone` raises it to its caller
                            return
                    self._pool.append(vm)
        finally:
            if not ended:
                with self.lock:
                    self._filling = False

    def _take_spare(self) -> Vm | None:
        with self.lock:
            if not self._pool:
                return None
            self._taken_at = time.monotonic()
            if len(self._pool) == 1:
                self._emptied.set()
            return self._pool.pop(0)

    def _start(self) -> Vm:
        """The zygote: restored from the template's systrap snapshot in the cache (`snapshot_dir`),
        made first if there is none (the agent spawned in new writable mounts, run to its ready
        point and checkpointed), so that every client process on this host starts its sandboxes
        from the same snapshot without booting the agent again."""
        if self._starter is not None:
            vm, self._work = self._starter()
            return vm
        snap = self._snapshot
        if snap is None:
            return self._boot()
        if not _hold_snapshot(snap):
            self._make_snapshot(snap)
            _hold_snapshot(snap)
        try:
            vm = Vm.restore(snap)
        except (_SnapshotError, _CoreEngineError) as e:
            if not any(w in str(e) for w in DAMAGED):
                raise
            # A cache entry, made again: damaged (a crash, a disk error) or from another engine.
            _log.warning("the systrap snapshot %s cannot be restored (%s); making it again", snap, e)
            shutil.rmtree(snap, ignore_errors=True)
            self._make_snapshot(snap)
            _hold_snapshot(snap)
            vm = Vm.restore(snap)
        self.restored_from = snap
        _prune_snapshots(snap)
        return vm

    def _make_snapshot(self, snap: Path) -> None:
        vm = self._boot()
        try:
            if warm_up_enabled():
                warm_up(vm, f"making the {self.baked.name!r} template's snapshot on systrap")
            save_snapshot(vm, snap)
        finally:
            self._stop_vm(vm)

    def _stop_vm(self, vm: Vm) -> None:
        vm.destroy()
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def _boot(self) -> Vm:
        """Spawn the agent in new writable mounts and run it to its ready point."""
        work = _catalog.agent_dirs(prefix="collimate-zygote-")
        try:
            vm = _catalog.spawn_agent(self.baked.root, work, self._cpus, platform=self.platform)
            try:
                _catalog.run_to_idle(vm, f"starting the {self.baked.name!r} template on systrap")
            except BaseException:
                vm.destroy()
                raise
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        self._work = work
        return vm

    def clone(self) -> tuple[Vm, bool]:
        vm = self._take_spare()
        if vm is not None:
            self._fill()
            return vm, True
        self._fill()
        with self.lock:
            try:
                return self.zygote.clone(), False
            except _CoreEngineError as e:
                if "is gone" not in str(e):
                    raise
            # The zygote's VMM died (it is a live process here, not a file): start a new one, once.
            self._stop()
            self.zygote = self._start()
            return self.zygote.clone(), False

    def _stop(self) -> None:
        self.zygote.destroy()
        if self._work is not None:
            shutil.rmtree(self._work, ignore_errors=True)
            self._work = None

    def close(self) -> None:
        with self.lock:
            self._closed = True
            self.spares = 0
            spares, self._pool = self._pool, []
            self._stop()
        self._emptied.set()  # a waiting spare thread sees there is nothing to do
        self._wanted.set()
        for vm in spares:
            vm.destroy()
        self.drain()
        if self._on_close is not None:
            self._on_close()
            self._on_close = None


def systrap_snapshots(cache: Path) -> Path:
    """Where the catalog templates' systrap snapshots live in `cache` (apart from kvm's
    `templates/python.json` and its snapshot: one platform's snapshot cannot run on the other)."""
    return cache / "templates" / "systrap"


# The snapshots this process uses (path -> its shared flock, `templates.cache.hold`), kept to its exit.
_holds: dict[Path, Any] = {}
_holds_lock = threading.Lock()


def _hold_snapshot(snap: Path) -> bool:
    """Mark `snap` used by this process for its life (a later prune elsewhere leaves it); whether
    it is there whole."""
    with _holds_lock:
        if snap in _holds:
            return True
        f = _cachelib.hold(snap, "systrap.state")
        if f is not None:
            _holds[snap] = f
        return f is not None


def _prune_snapshots(current: Path) -> None:
    """Remove the template's snapshots of other states (an older root filesystem, agent or engine
    format) that no process holds, and the temporaries of snapshots whose writer is gone."""
    name = current.name.rsplit("-", 1)[0]
    try:
        entries = list(current.parent.iterdir())
    except OSError:
        return
    for d in entries:
        if d != current and d.is_dir() and d.name.rsplit("-", 1)[0] == name and len(d.name) == len(current.name):
            if _cachelib.remove_unheld(d):
                _log.info("removed the systrap snapshot %s of an earlier template state", d)
    _cachelib.sweep(current.parent)


def save_snapshot(vm: Vm, dest: Path) -> None:
    """Checkpoint `vm` (a systrap agent at its ready point) into `dest`, whole or not at all: into a
    directory beside it, renamed into place. Another process that got there first wins (its
    snapshot is the same template state) and this one is dropped."""
    # A temporary the cache's sweep removes if this process is killed mid-write (`_prune_snapshots`).
    with _cachelib.Temp(dest) as tmp:
        vm.snapshot(tmp)
        try:
            os.rename(tmp, dest)
        except OSError:
            if not (dest / "systrap.state").is_file():
                raise


def template(name: str, cache: Path | None, disk_quota: int, shared_memory: int) -> LiveTemplate:
    """The systrap template `name`: the catalog's "python" (root filesystem built on first use,
    no /dev/kvm needed), else a container image (a path, or a reference in the local image store)
    baked live under that name (`client.env(ref)` in one step), else NotFoundError."""
    from collimate_core.sdk.embedded import DEFAULT_SPARES

    if name != "python":
        from collimate_core.templates.bake import find_or_bake

        t = find_or_bake(name, cache, platform="systrap")
        if t is None:
            from collimate_core.sdk.errors import NotFoundError
            from collimate_core.templates.oci import default_store

            store = default_store(Path(cache) if cache else _catalog.cache_dir())
            raise NotFoundError(
                f"no template named {name!r}: on systrap the catalog has 'python', and image templates are those "
                f"this client baked (Template.bake) or an image named {name!r} in the local image store {store}"
            )
        assert isinstance(t, LiveTemplate)
        t.disk_quota = t.disk_quota or disk_quota
        t.shared_memory = t.shared_memory or shared_memory
        t.set_spares(DEFAULT_SPARES)
        return t
    root = _catalog.python_root(cache)
    snapshots = systrap_snapshots(Path(cache) if cache else _catalog.cache_dir())
    t = LiveTemplate(name, root, disk_quota, shared_memory, _catalog.guest_cpus(), snapshot_root=snapshots)
    t.set_spares(DEFAULT_SPARES)
    return t
