"""The embedded engine: templates, sandboxes and forks in this process's host, no server.

`connect()` without an API key returns the process-wide `EmbeddedClient`. Each template runs one
zygote (a VMM process restored from the template's snapshot, never run) that forks sandboxes and
keeps a few pre-forked spares; a sandbox is one VMM process running the in-guest agent.
"""

from __future__ import annotations

import functools
import hashlib
import math
import os
import secrets
import signal as _signal
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from collimate_core import _core
from collimate_core._core import EngineError as _CoreEngineError
from collimate_core._core import OUTPUT_CAP, Vm
from collimate_core.sdk.errors import (
    CapacityError,
    CollimateError,
    InvalidArgument,
    NotFoundError,
    SandboxDied,
)
from collimate_core.sdk import egress as _egress
from collimate_core.sdk import live as _live
from collimate_core.sdk import platform as _platform
from collimate_core.sdk import quota as _quota
from collimate_core.sdk.egress import Egress, set_resolver
from collimate_core.sdk.meter import Meter
from collimate_core.sdk.results import ExecResult
from collimate_core.sdk.seeds import fresh_seed, parse_seed
from collimate_core.templates.catalog import frame as _frame
from collimate_core.templates.catalog import unframe as _unframe
from collimate_core.templates.catalog import AGENT_IDLE, Baked, bake_catalog, cache_dir

ACK_CONTEXT = b"collimate/seed-ack/v1"
MAX_UPLOAD = 256 << 20
# The largest code= an exec sends (the agent compiles it whole; 20 MiB ended in a bare MemoryError
# inside the guest) and the largest command= (Linux's MAX_ARG_STRLEN, 128 KiB with its NUL: sh -c
# gets the command as one argument).
MAX_CODE = 1 << 20
MAX_COMMAND = (128 << 10) - 1
# The largest file `download` reads (COLLIMATE_MAX_DOWNLOAD or the client's max_download): a
# sparse file costs the sandbox no quota but its whole size to read.
MAX_DOWNLOAD = 256 << 20
DEFAULT_SPARES = 2
MAX_SPARES = 16
RECYCLE_MAX = 8
# Destroyed sandboxes waiting for the reaper thread at most; beyond it, destroy tears down in the
# caller. Without a bound, fork groups destroyed faster than one thread tears them down (8
# children every ~70 ms on a 2-core host) left each of them a live VMM process in its queue: over
# 1,700 after 300 groups, growing for as long as the load lasted. 65 lets a group of 64 and its
# parent go at once (their teardown overlaps the trainer's next step); under sustained load a
# smaller bound was faster here (fewer idle VMMs: about 120 vs 140-200 ms per fork_group(8) cycle
# with 16 vs 65, on a busy host).
REAP_BACKLOG = 65


def reaper_threads() -> int:
    """Threads that tear down and reset ended sandboxes (`COLLIMATE_REAP_THREADS`, default one
    per CPU this process may use, at most 4). A reset for reuse (systrap's and kvm's recycling)
    costs a few hundred microseconds of engine work outside the GIL; with one thread, the resets
    of a grading batch's ended sandboxes queued behind each other and only 68% of the next
    batch's candidates found a recycled sandbox (262 of 384, docs/systrap.md)."""
    raw = os.environ.get("COLLIMATE_REAP_THREADS", "")
    if raw.strip():
        try:
            n = int(raw)
        except ValueError:
            raise InvalidArgument(f"COLLIMATE_REAP_THREADS={raw!r}: give a whole number of threads, 1 or more") from None
        if n < 1:
            raise InvalidArgument(f"COLLIMATE_REAP_THREADS={raw!r}: give a whole number of threads, 1 or more")
        return n
    return max(1, min(4, len(os.sched_getaffinity(0))))


@functools.lru_cache(maxsize=256)
def expected_ack(seed: bytes) -> str:
    """The ack an agent returns after a correct reseed with `seed` (see guest/agent.py). The
    keystream comes from the engine's CRNG (`_core._crng_stream`, about a microsecond): the
    Python reference (`seeds.crng_stream`) took 0.2-0.25 ms holding the GIL, once per exec, which
    a fork group's map of 64 execs paid on one core (docs/systrap.md, "fork_group(64)"). Cached:
    the execs of a grading batch all run with one seed (two execs per candidate)."""
    return hashlib.sha256(ACK_CONTEXT + seed + _core._crng_stream(seed, 32)).hexdigest()


def check_exec_args(code: Any, command: Any, timeout: Any, seed: Any) -> bytes | None:
    """Validate an exec's arguments before anything is forked or run; the seed's 32 bytes (None
    for a fresh one). Raises InvalidArgument (a ValueError) saying what is expected."""
    if (code is None) == (command is None):
        raise InvalidArgument("exec needs exactly one of code= (Python source) or command= (a shell command)")
    if not isinstance(code if code is not None else command, str):
        raise InvalidArgument("code= and command= take a str")
    n = len((code if code is not None else command).encode("utf-8", "surrogatepass"))
    if code is not None and n > MAX_CODE:
        raise InvalidArgument(
            f"code= is {n} bytes, over the limit of {MAX_CODE} ({MAX_CODE >> 20} MiB); put the program in a file "
            "(upload_bytes('/work/main.py', source)) and run it (command='python3 /work/main.py')"
        )
    if command is not None and n > MAX_COMMAND:
        raise InvalidArgument(
            f"command= is {n} bytes, over Linux's limit of {MAX_COMMAND} bytes for one argument (sh -c takes it as "
            "one); put the script in a file (upload_bytes('/work/run.sh', script)) and run it (command='sh /work/run.sh')"
        )
    if isinstance(timeout, bool) or not (isinstance(timeout, (int, float)) and timeout > 0):
        raise InvalidArgument(f"timeout_seconds must be a positive number, not {timeout!r}")
    if seed is None:
        return None
    try:
        return parse_seed(seed)
    except (TypeError, ValueError) as e:
        raise InvalidArgument(str(e)) from None


def _engine_error(e: _CoreEngineError, what: str) -> Exception:
    msg = str(e)
    if "is gone" in msg or "VMM process" in msg:
        return SandboxDied(f"{what}: {msg}")
    return e


@dataclass
class Usage:
    """Metered totals over a window."""

    sandbox_seconds: float = 0.0
    sandboxes: int = 0  # sandboxes started from a template (fork-group children are `forks`)
    execs: int = 0
    forks: int = 0
    bytes_in: int = 0
    bytes_out: int = 0
    live_sandboxes: int = 0
    # Network egress (see sdk/egress.py): bytes the sandboxes' connections sent (acknowledged by
    # the peer) and received.
    egress_bytes_out: int = 0
    egress_bytes_in: int = 0


class _Template:
    """A template's zygote, its spare clones, and sandboxes recycled by reset.

    A sandbox that ends is reset (its dirty pages, files, registers and OS state go back to the
    template: the same state a new clone would have) and kept for the next one: its KVM VM, page
    tables and host mappings are warm, so its first exec is about twice as fast as a new clone's.
    """

    def __init__(self, baked: Baked, disk_quota: int, shared_memory: int = _quota.SHARED_MEMORY):
        self.baked = baked
        self.lock = threading.Lock()
        self.zygote = Vm.restore(baked.path)
        # The quota of this template's sandboxes: the template's own, else the client's.
        self.disk_quota = getattr(baked, "disk_quota", None) or disk_quota
        if self.zygote.disk_quota is not None:
            self.zygote.set_disk_quota(self.disk_quota, _quota.inodes_for(self.disk_quota))
        # Their shared-memory limit: the template's own, else the client's.
        self.shared_memory = getattr(baked, "shared_memory", None) or shared_memory
        if self.zygote.shared_memory is not None and self.zygote.shared_memory != self.shared_memory:
            self.zygote.set_shared_memory(self.shared_memory)
        # A template baked from an image has a writable root, as a container does (docs/templates.md).
        if getattr(baked, "meta", {}).get("writable_root"):
            self.zygote.set_writable_root(True)
        self.spares = 0
        self.recycled: list[Vm] = []
        self.set_spares(DEFAULT_SPARES)
        # The state its sandboxes start from, as egress recordings name it: the snapshot file
        # (a re-bake writes a new one), so a recording made in one process replays in another.
        st = Path(baked.path).stat()
        self.state = hashlib.sha256(f"{baked.name}\0{baked.path}\0{st.st_size}\0{st.st_mtime_ns}".encode()).hexdigest()

    def take_recycled(self) -> Vm | None:
        with self.lock:
            return self.recycled.pop() if self.recycled else None

    def has_room(self) -> bool:
        """Whether `offer` would keep a sandbox now (checked before paying for its reset)."""
        with self.lock:
            return len(self.recycled) < RECYCLE_MAX

    def offer(self, vm: Vm) -> bool:
        """Keep `vm` (already reset) for reuse; False if the pool is full."""
        with self.lock:
            if len(self.recycled) >= RECYCLE_MAX:
                return False
            self.recycled.append(vm)
            return True

    def drain(self) -> None:
        with self.lock:
            vms, self.recycled = self.recycled, []
        for vm in vms:
            vm.destroy()

    def set_spares(self, n: int) -> None:
        n = max(0, min(n, MAX_SPARES))
        with self.lock:
            if n != self.spares:
                self.zygote.set_spare_pool(n)
                self.spares = n

    def clone(self) -> tuple[Vm, bool]:
        with self.lock:
            warm = self.spares > 0
            return self.zygote.clone(), warm

    def close(self) -> None:
        self.drain()
        self.zygote.destroy()


# How long an exec that timed out has, once its processes are killed, for its interpreter to
# answer (seconds of wall time).
END_EXEC_GRACE = 10.0


@dataclass
class _Box:
    id: str
    template: str
    vm: Vm
    created: float
    warm_hit: bool
    lock: threading.RLock = field(default_factory=threading.RLock)
    agent_alive: bool = True
    # Why the interpreter's state was lost (it died, or an exec timed out), until an exec has said
    # so: the next exec's result is marked `interpreter_restarted` (see ExecResult).
    lost: str = ""
    closed: bool = False
    # The _Template (version) this sandbox was made from: a re-baked name gets a new one, and a
    # sandbox of the old version must not be reset into the new version's pool.
    origin: Any = None
    # Its disk quota and shared-memory limit, and what admission charged for it (guest memory +
    # shared memory + disk quota).
    disk_quota: int = 0
    shared_memory: int = _quota.SHARED_MEMORY
    charge: int = 0
    # Its network policy (the engine enforces it; this is the SDK's copy, for narrowing checks).
    egress: Egress = field(default_factory=Egress.none)
    # A fork's ceiling: its policy when it was forked (set_egress may not go beyond it); None for
    # a sandbox made from a template.
    ceiling: Egress | None = None
    # The guest state it is in, as egress recordings name it (`_state_after`): its template's,
    # then a digest of each exec and upload since; a fork's children start from their parent's.
    state: str = ""
    # What it runs on: "kvm" or "systrap" (its client's platform).
    platform: str = "kvm"


def _mib(n: int) -> str:
    """`n` bytes as MiB, with a fraction only where there is one."""
    return f"{n >> 20} MiB" if n % (1 << 20) == 0 else f"{n / (1 << 20):.2f} MiB"


def _state_after(state: str, *parts: bytes) -> str:
    """The state after one more step (an exec: its seed and request; an upload: path and data)."""
    h = hashlib.sha256(b"collimate/egress-state/v1\0" + state.encode())
    for p in parts:
        h.update(len(p).to_bytes(8, "little") + p)
    return h.hexdigest()


def _tape_name(state: str, seed: bytes) -> str:
    """The recording of the exec with `seed` run in `state`: what a replay must match."""
    return hashlib.sha256(b"collimate/egress-tape/v1\0" + state.encode() + b"\0" + seed).hexdigest()


class EmbeddedClient:
    """Runs sandboxes on this host through the embedded engine. Thread-safe.

    `platform`: "auto" (default: COLLIMATE_PLATFORM, else auto), "kvm" or "systrap"; auto's rule
    is in sdk/platform.py and docs/platforms.md, and the choice is logged once (the
    "collimate_core" logger). `client.platform` says what was chosen. A platform this host or
    build cannot serve raises PlatformUnavailable here, saying what to do."""

    def __init__(
        self,
        *,
        platform: str | None = None,
        cache: str | Path | None = None,
        max_sandboxes: int = 512,
        capacity_timeout: float = 60.0,
        disk_quota: int | str | None = None,
        memory_budget: int | str | None = None,
        egress_resolver: str | dict | None = None,
        max_download: int | str | None = None,
        shared_memory: int | str | None = None,
    ):
        self.platform_choice = _platform.resolve(platform)
        self.platform: str = self.platform_choice.platform
        self.cache = Path(cache) if cache else None
        env = os.environ.get("COLLIMATE_MAX_DOWNLOAD")
        self.max_download = (
            _quota.parse_size(max_download, "max_download") if max_download is not None
            else _quota.parse_size(env, "COLLIMATE_MAX_DOWNLOAD") if env else MAX_DOWNLOAD
        )
        # Where the engine resolves names egress policies admit: "system", "dns:HOST:PORT", or a
        # {name: [ip, ...]} map (tests, air-gapped hosts). Process-wide: the broker is one thread.
        if egress_resolver is not None:
            set_resolver(egress_resolver)
        self.max_sandboxes = max_sandboxes
        self.capacity_timeout = capacity_timeout
        # Every sandbox's writable mounts share one quota (see quota.py); the budget is admission by
        # worst case (guest memory + shared memory + disk quota of every live sandbox), off unless set.
        self.disk_quota = _quota.disk_quota(disk_quota) if disk_quota is not None else _quota.default_disk_quota()
        self.memory_budget = (
            _quota.parse_size(memory_budget, "memory_budget") if memory_budget is not None else _quota.default_memory_budget()
        )
        # Each sandbox's shared-memory pool (shared mappings, memfds, /dev/shm; 512 MiB unless set).
        self.shared_memory = (
            _quota.shared_memory(shared_memory, self.memory_budget) if shared_memory is not None
            else _quota.default_shared_memory(self.memory_budget)
        )
        self._charged = 0  # bytes of the budget held by live and admitted sandboxes
        self._templates: dict[str, _Template] = {}
        self._starting: dict[str, threading.Lock] = {}  # systrap: a template's zygote being started
        self._boxes: dict[str, _Box] = {}
        self._lock = threading.RLock()
        self._slots = threading.Condition(self._lock)
        self._reserved = 0  # slots admitted but not yet registered (see _admit)
        # Metered totals in time buckets (a list of events grew with every exec, without bound).
        self._meter = Meter()
        self._compacted = time.time()
        # Tearing a VMM process down takes about a millisecond, a reset for reuse a few hundred
        # microseconds; a sandbox's exit does not wait for either. Reaper threads
        # (`reaper_threads`) do them; close() waits for them.
        self._reaper = ThreadPoolExecutor(max_workers=reaper_threads(), thread_name_prefix="collimate-reaper")
        self._reaping = 0  # sandboxes handed to the reaper and not yet torn down or recycled

    # --- templates ---------------------------------------------------------------------------

    def _template(self, name: str) -> _Template:
        if not isinstance(name, str) or not name:
            raise InvalidArgument(f"template must be a template name such as 'python', not {name!r}")
        with self._lock:
            t = self._templates.get(name)
        if t is not None:
            return t
        if self.platform == "systrap":
            # The zygote is restored from the template's systrap snapshot, made on first use (sdk/live.py).
            # One zygote per name, started under that name's lock (not the client's: starting one
            # takes seconds, and the other sandboxes go on meanwhile).
            with self._lock:
                starting = self._starting.setdefault(name, threading.Lock())
            with starting:
                with self._lock:
                    t = self._templates.get(name)
                if t is None:
                    t = _live.template(name, self.cache, self.disk_quota, self.shared_memory)
                    with self._lock:
                        self._templates[name] = t
                return t
        baked = bake_catalog(name, self.cache)
        with self._lock:
            if name not in self._templates:
                self._templates[name] = _Template(baked, self.disk_quota, self.shared_memory)
            return self._templates[name]

    def register_template(self, name: str, baked: Baked) -> None:
        if self.platform == "systrap":
            if not isinstance(baked, _live.LiveTemplate):
                raise _live.image_templates_unavailable(f"registering template {name!r} (a snapshot baked on kvm)")
            # A live zygote baked on this client (Template.bake on systrap): its quotas, else the client's.
            baked.disk_quota = baked.disk_quota or self.disk_quota
            baked.shared_memory = baked.shared_memory or self.shared_memory
            with self._lock:
                old = self._templates.pop(name, None)
                self._templates[name] = baked
            if old is not None:
                old.close()
            baked.set_spares(DEFAULT_SPARES)
            return
        with self._lock:
            old = self._templates.pop(name, None)
            self._templates[name] = _Template(baked, self.disk_quota, self.shared_memory)
        if old is not None:
            old.close()

    def unregister_template(self, name: str) -> bool:
        """Forget template `name` (its zygote and recycled sandboxes go); live sandboxes keep
        running. True if it was registered."""
        with self._lock:
            old = self._templates.pop(name, None)
        if old is None:
            return False
        old.close()
        return True

    def expect_width(self, template: str, width: int) -> None:
        """Keep `width` clones of `template` ready (up to the pool limit) before a burst."""
        if width < 0:
            raise InvalidArgument(f"width must be >= 0, not {width}")
        self._template(template).set_spares(width)

    def release_template(self, template: str) -> None:
        """Hand back the capacity `expect_width` reserved. Never destructive."""
        with self._lock:
            t = self._templates.get(template)
        if t is not None:
            t.set_spares(DEFAULT_SPARES)

    # --- sandboxes ---------------------------------------------------------------------------

    def _admit(self, n: int, disk_quota: int, shared_memory: int | None = None) -> int:
        """Reserve `n` sandbox slots under max_sandboxes, and their charge (guest memory, shared
        memory and disk quota each) under memory_budget, waiting up to capacity_timeout for room; returns the
        charge of one. A reservation is held until the sandboxes are registered (or
        `_unreserve`d on failure), so concurrent callers can never overshoot a limit between
        admission and registration."""
        charge = _quota.memory_charge(shared_memory) + disk_quota
        if n > self.max_sandboxes:
            raise CapacityError(
                f"a fork group of {n} can never fit under max_sandboxes={self.max_sandboxes}; "
                f"raise the limit or use a narrower group"
            )
        budget = self.memory_budget
        if budget is not None and n * charge > budget:
            raise CapacityError(
                f"{n} sandbox(es) of {charge >> 20} MiB each (guest memory + shared memory + disk quota) can never fit in "
                f"memory_budget={budget >> 20} MiB; raise the budget, give smaller disk quotas or shared_memory, or use a narrower group"
            )
        deadline = time.monotonic() + self.capacity_timeout
        with self._slots:
            while True:
                over_count = len(self._boxes) + self._reserved + n > self.max_sandboxes
                over_budget = budget is not None and self._charged + n * charge > budget
                if not (over_count or over_budget):
                    break
                left = deadline - time.monotonic()
                if left <= 0:
                    if over_count:
                        raise CapacityError(
                            f"max_sandboxes={self.max_sandboxes} live sandboxes reached "
                            f"(waited {self.capacity_timeout:g}s for room for {n}); destroy some or raise the limit"
                        )
                    raise CapacityError(
                        f"memory_budget={budget >> 20} MiB reached: {self._charged >> 20} MiB held by live sandboxes, "
                        f"{n} more need {n * charge >> 20} MiB (guest memory + shared memory + disk quota; waited "
                        f"{self.capacity_timeout:g}s); destroy some, raise the budget or give smaller disk quotas or shared_memory"
                    )
                self._slots.wait(left)
            self._reserved += n
            self._charged += n * charge
        return charge

    def _unreserve(self, n: int, charge: int = 0) -> None:
        with self._slots:
            self._reserved -= n
            self._charged -= n * charge
            self._slots.notify_all()

    def _register(self, box: _Box) -> _Box:
        """Turn one reserved slot into a live sandbox."""
        with self._slots:
            self._reserved -= 1
            self._boxes[box.id] = box
        return box

    def create(self, template: str, disk_quota: int | str | None = None, egress: Any = None,
               shared_memory: int | str | None = None) -> _Box:
        policy = _egress.coerce(egress)  # bad rules raise before anything is forked
        quota = _quota.disk_quota(disk_quota) if disk_quota is not None else None
        shm = _quota.shared_memory(shared_memory, self.memory_budget) if shared_memory is not None else None
        t = self._template(template)
        quota = quota or t.disk_quota
        shm = shm or t.shared_memory
        charge = self._admit(1, quota, shm)
        try:
            vm = t.take_recycled()
            warm = vm is not None
            if vm is None:
                vm, warm = t.clone()
            else:
                vm.clear_egress()  # a recycled clone: nothing of its last owner's network
            if not policy.is_none:
                vm.set_egress(policy.rule_strings(), policy.internet_access)
            # Its own quota (or back to the template's, for a recycled one that had another).
            if vm.disk_quota is not None and vm.disk_quota[0] != quota:
                try:
                    vm.set_disk_quota(quota, _quota.inodes_for(quota))
                except BaseException:
                    vm.destroy()
                    raise
            # And its own shared-memory limit (or back to the template's).
            if vm.shared_memory is not None and vm.shared_memory != shm:
                try:
                    vm.set_shared_memory(shm)
                except BaseException:
                    vm.destroy()
                    raise
        except BaseException as e:
            self._unreserve(1, charge)
            if isinstance(e, _CoreEngineError):
                if "invalid argument" in str(e):
                    what = "shared_memory" if "shared-memory" in str(e) else "disk_quota"
                    raise InvalidArgument(f"{what} for a sandbox of {template!r}: {e}") from e
                raise _engine_error(e, f"forking a sandbox of {template!r}") from e
            raise
        self._count("sandboxes", 1)
        box = _Box("sbx_" + secrets.token_hex(8), template, vm, time.time(), warm, origin=t, disk_quota=quota, charge=charge,
                   egress=policy, state=t.state, shared_memory=shm, platform=self.platform)
        return self._register(box)

    def get(self, sandbox_id: str) -> _Box:
        with self._lock:
            box = self._boxes.get(sandbox_id)
        if box is None or box.closed:
            raise NotFoundError(f"no live sandbox {sandbox_id!r} on this client")
        return box

    def destroy(self, box: _Box) -> None:
        with box.lock:
            if box.closed:
                return
            box.closed = True
            self._count_egress(box)
            with self._slots:
                self._boxes.pop(box.id, None)
                self._charged -= box.charge
                self._meter.close_span(box.created, time.time())
            with self._lock:
                t = self._templates.get(box.template)
            if box.origin is not None and t is not box.origin:
                t = None  # its template was re-baked or deleted: not reusable, just destroyed
            with self._slots:
                queued = self._reaping < REAP_BACKLOG
                self._reaping += queued
            if not queued:  # backpressure: the reaper is behind, tear down here
                self._reap(box.vm, t, False)
                return
            try:
                self._reaper.submit(self._reap, box.vm, t, True)
            except RuntimeError:  # the client is closing: tear down here
                self._reap(box.vm, None, True)

    def _reap(self, vm: Vm, template: "_Template | None", queued: bool) -> None:
        try:
            if template is not None and template.has_room():
                try:
                    vm.reset()
                    if template.offer(vm):
                        return
                except CollimateError:
                    # A dead or broken sandbox is not reused. (A Vm whose process died reports
                    # VmDestroyedError here, not EngineError; it still holds descriptors.)
                    pass
            vm.destroy()
        finally:
            with self._slots:
                self._reaping -= queued
                self._slots.notify_all()

    def fork(self, box: _Box, n: int, egress: Any = None) -> list[_Box]:
        if not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"a fork group needs width >= 1, not {n!r}")
        # A fork inherits its parent's policy and may only narrow it: checked before forking.
        policy = box.egress if egress is None else _egress.coerce(egress)
        policy.check_narrower(box.egress, "fork_group(egress=...)")
        # Children get their parent's quota and shared-memory limit (and start with its files).
        charge = self._admit(n, box.disk_quota or self.disk_quota, box.shared_memory)
        try:
            with box.lock:
                if not box.agent_alive:
                    self._restore(box)  # as exec does: the last program ended the agent, start from the template
                vms = box.vm.fork(n)
                lost = box.lost  # the children start from the template too: their first exec says so
                state = box.state
            for vm in vms:
                if egress is not None and policy != box.egress:
                    vm.set_egress(policy.rule_strings(), policy.internet_access)
                # A fork's ceiling is its policy as forked: set_egress may narrow below it and widen
                # back up to it, never beyond (the engine holds it too).
                vm.seal_egress()
        except BaseException as e:
            self._unreserve(n, charge)
            if isinstance(e, _CoreEngineError):
                raise _engine_error(e, f"forking sandbox {box.id}") from e
            raise
        self._count("forks", n)
        now = time.time()
        return [
            self._register(
                _Box("sbx_" + secrets.token_hex(8), box.template, vm, now, False, origin=box.origin, lost=lost,
                     disk_quota=box.disk_quota, charge=charge, egress=policy, state=state, ceiling=policy,
                     shared_memory=box.shared_memory, platform=box.platform)
            )
            for vm in vms
        ]

    def reset(self, box: _Box) -> None:
        """Back to the template: dirty pages, files and registers, without a new VM."""
        with box.lock:
            self._restore(box)
            box.lost = ""  # asked for: the next exec has nothing to report

    def _restore(self, box: _Box) -> None:
        """Back to the template after the agent died or an exec timed out (`box.lost` stays set
        until an exec has reported it)."""
        with box.lock:
            if box.platform == "systrap":
                # Reset in place where the template's zygote was restored from a snapshot (see
                # sdk/live.py); else, or if the reset is refused (the agent's process ended), a
                # new clone takes the sandbox's place.
                resettable = getattr(box.origin, "resettable", None)
                if box.agent_alive and resettable is not None and resettable():
                    try:
                        box.vm.reset()
                    except CollimateError:
                        pass
                    else:
                        box.state = box.origin.state
                        return
                self._replace(box)
                return
            try:
                box.vm.reset()
            except _CoreEngineError as e:
                raise _engine_error(e, f"resetting sandbox {box.id}") from e
            box.agent_alive = True
            if box.origin is not None:
                box.state = box.origin.state

    def _replace(self, box: _Box) -> None:
        """`_restore` on systrap, which has no reset: a new clone of the template's zygote takes
        the sandbox's place (with its network policy) and the old VMM is destroyed."""
        t = box.origin
        if t is None or t.zygote is None:
            raise SandboxDied(f"sandbox {box.id} cannot be restored: its template is gone")
        try:
            vm, _ = t.clone()
        except _CoreEngineError as e:
            raise _engine_error(e, f"restoring sandbox {box.id} from its template") from e
        try:
            if not box.egress.is_none:
                vm.set_egress(box.egress.rule_strings(), box.egress.internet_access)
            if box.ceiling is not None:
                vm.seal_egress()
        except BaseException:
            vm.destroy()
            raise
        old, box.vm = box.vm, vm
        old.destroy()
        box.agent_alive = True
        box.state = t.state

    def exec(
        self,
        box: _Box,
        *,
        code: str | None = None,
        command: str | None = None,
        timeout: float = 60.0,
        seed: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        seed_bytes = check_exec_args(code, command, timeout, seed)
        if seed_bytes is None:
            seed_bytes = bytes.fromhex(fresh_seed())
        seed_hex = seed_bytes.hex()
        with self._lock:
            t = box.origin or self._templates.get(box.template)
        handshake = t is None or t.baked.seed_ack
        req: dict[str, Any] = {"op": "exec", "seed": seed_hex}
        if code is not None:
            req["code"] = code
        else:
            req["command"] = command
        if env:
            req["env"] = {str(k): str(v) for k, v in env.items()}
        if cwd:
            req["cwd"] = cwd
        with box.lock:
            if box.closed:
                raise NotFoundError(f"sandbox {box.id} was destroyed")
            if not box.agent_alive:
                self._restore(box)  # the previous program ended the agent: start from the template
            frame = _frame(req)
            tape, wall = self._tape_begin(box, seed_bytes) if box.egress.record else (None, None)
            if tape is None and not box.egress.is_none:
                # A sandbox with a network reads the true date (TLS certificates, signed API
                # requests, HTTP dates need it): its virtual REALTIME starts at the host's clock.
                # With record=True the recording keeps that start and its replay starts there.
                wall = time.time_ns()
            try:
                r = box.vm.agent_call(frame, float(timeout), seed_bytes, True, wall)
            except BaseException as e:
                if tape is not None:
                    box.vm.egress_tape_end(False)  # an exec that failed records nothing
                if isinstance(e, _CoreEngineError):
                    raise _engine_error(e, f"exec in sandbox {box.id}") from e
                raise
            # Not saved for an exec that timed out: where a timeout cuts a run is the host's
            # speed, and a recording that ends there would make every replay of the exec diverge.
            outcome = box.vm.egress_tape_end(r.kind != "timeout") if tape is not None else None
            if outcome is not None and tape == "record" and r.kind == "timeout":
                outcome["errors"].append("this exec timed out: its network recording was not saved")
            # The next exec starts from the state this one left (the request, code included, is
            # part of it: a replay of a later exec needs the same earlier ones).
            box.state = _state_after(box.state, b"exec", frame)
            restarted, box.lost = box.lost, ""
            died = False
            timed_out = r.kind == "timeout"
            stdout, stderr = r.stdout, r.stderr
            ended = ""
            truncated = r.truncated
            if timed_out:
                # End what the exec started and keep the sandbox (docs/sessions.md).
                stdout, stderr, ended = self._end_exec(box, code is not None, stdout, stderr)
                # The engine caps each run's output; the exec's, two runs here (on systrap the
                # output still in the pipe reaches end_exec's run), is capped as one.
                truncated = truncated or len(stdout) > OUTPUT_CAP or len(stderr) > OUTPUT_CAP
                stdout, stderr = stdout[:OUTPUT_CAP], stderr[:OUTPUT_CAP]
            reply = _unframe(r.agent) if r.kind == "yield" and r.value == AGENT_IDLE else None
            if timed_out:
                exit_code = 124
                verdict = "no-ack" if handshake else "off"
            elif reply is not None and "cwd_error" in reply:
                raise InvalidArgument(
                    f"exec cwd={cwd!r}: cannot change to it in the sandbox: {reply['cwd_error']}; nothing ran. "
                    f"Create it first (exec(command='mkdir -p {cwd}')) or pass an existing directory"
                )
            elif reply is not None and "exit_code" in reply:
                exit_code = int(reply["exit_code"])
                ack = reply.get("seed_ack")
                if not handshake:
                    verdict = "off"
                elif ack is None:
                    verdict = "no-ack"
                else:
                    verdict = "verified" if ack == expected_ack(seed_bytes) else "mismatch"
                if verdict == "verified" and getattr(r, "nondeterministic", False):
                    # A thread was switched out by the wall clock (see docs/replay.md): the seed
                    # took, but a replay may interleave the threads differently.
                    verdict = "not-reproducible"
            else:
                # The program ended or stopped the agent (os._exit, a fatal signal): the sandbox
                # is restored from its template before its next exec.
                box.agent_alive = False
                verdict = "no-ack" if handshake else "off"
                if r.kind == "exited":
                    exit_code = r.code or 0
                elif r.kind == "signaled":
                    exit_code = 128 + (getattr(r, "signal", 0) or 0)
                else:
                    exit_code = 128 + 11 if r.kind in ("fault", "shutdown") else 1
                died = True
                box.lost = "died (" + _how_it_ended(r) + ")"
        notes = []
        limit = ""
        if box.vm.take_shared_memory_limit_reached():
            limit = "shared_memory"
            notes.append(
                f"the shared-memory limit of the sandbox ({_mib(box.shared_memory)}) was reached by its shared "
                "mappings during this exec (shared anonymous mappings such as mmap.mmap(-1, n), memfds and /dev/shm "
                "together): an mmap got ENOMEM, a write ENOSPC or a process SIGBUS; map, write or keep less shared memory, "
                "or give the sandbox more (shared_memory=)"
            )
        if restarted:
            kept = restarted.endswith("after a timeout")  # replaced over its files (_end_exec)
            notes.append(
                f"this exec ran in a fresh interpreter: the sandbox's interpreter {restarted} in an earlier exec "
                + (
                    "(earlier Python state and processes are gone; files in /tmp and /work were kept)"
                    if kept
                    else "and the sandbox was restored from its template (earlier Python state, processes and "
                    "files in /tmp and /work are gone)"
                )
            )
        if ended:
            notes.append(ended)
        if died:
            notes.append(
                f"the sandbox's interpreter (the agent, guest pid 1) {box.lost} during this exec; the next exec "
                "runs in a fresh interpreter restored from the template (Python state, processes and files in "
                "/tmp and /work are lost)"
            )
        replay, replay_error = "", ""
        if outcome is not None:
            replay = "diverged" if outcome["mode"] == "replayed" and outcome["errors"] else outcome["mode"]
            replay_error = "; ".join(outcome["errors"])
            if replay == "diverged":
                notes.append(f"this exec's network replay diverged from its recording: {replay_error}")
            elif replay_error:
                notes.append(replay_error)
        note = "; ".join(notes)
        self._count("execs", 1, bytes_out=len(stdout) + len(stderr))
        return ExecResult(
            exit_code=exit_code,
            stdout=stdout.decode(errors="replace"),
            stderr=stderr.decode(errors="replace"),
            seed=seed_hex,
            seed_ack=verdict,
            duration=r.duration,
            timed_out=timed_out,
            truncated=truncated,
            stdout_bytes=stdout,
            stderr_bytes=stderr,
            interpreter_died=died,
            interpreter_restarted=bool(restarted),
            note=note,
            limit=limit,
            egress_replay=replay,
            egress_error=replay_error,
            platform=box.platform,
        )

    def _end_exec(self, box: _Box, python: bool, stdout: bytes, stderr: bytes) -> tuple[bytes, bytes, str]:
        """An exec ran out of time: SIGKILL every process it started, interrupt the interpreter
        if it was running the exec's Python code (SIGINT: KeyboardInterrupt), and let it answer.
        Files are kept either way; the interpreter's state too if it answers within
        END_EXEC_GRACE. If it does not (it ignores SIGINT, is stuck in C code), it is replaced
        by a fresh one from the template over the sandbox's files, and the next exec says so
        (`interpreter_restarted`), on systrap too where the engine resets the sandbox in place
        (a template restored from a snapshot, recycling on). Where it cannot (the interpreter
        died, or the engine's watchdog killed it: its stub did not stop at the deadline) a systrap
        sandbox gets a new clone of the template at its next exec instead, files lost. Returns the
        output with what came meanwhile, and a note."""
        try:
            r = box.vm.end_exec(int(_signal.SIGINT) if python else 0, END_EXEC_GRACE)
        except _CoreEngineError as e:
            if box.platform == "systrap" and "first process has ended" in str(e):
                # The engine's watchdog killed the interpreter: its stub did not stop at the
                # deadline's kick (computing code is stopped there and interrupted as on kvm).
                return stdout, stderr, self._lost_on_systrap(box, "was killed by the timeout")
            raise _engine_error(e, f"ending the timed-out exec in sandbox {box.id}") from e
        stdout, stderr = stdout + r.stdout, stderr + r.stderr
        reply = _unframe(r.agent) if r.kind == "yield" and r.value == AGENT_IDLE else None
        what = "its Python code was interrupted (KeyboardInterrupt) and " if python else ""
        if reply is not None and "exit_code" in reply:
            return stdout, stderr, (
                "this exec timed out: the processes it started were killed, " + what + "the sandbox is kept "
                "(files in /tmp and /work, the interpreter's state, processes earlier execs left running)"
            )
        how = "did not stop within {:g}s of the timeout".format(END_EXEC_GRACE) if r.kind == "timeout" else (
            "died (" + _how_it_ended(r) + ")"
        )
        if box.platform == "systrap":
            # A fresh interpreter over the sandbox's files where the engine can reset it in place
            # (docs/systrap.md, "Reset"); else (its first process ended) a new clone.
            resettable = getattr(box.origin, "resettable", None)
            try:
                if resettable is None or not resettable():
                    raise CollimateError("no reset")
                box.vm.reset(keep_files=True)
            except CollimateError:
                return stdout, stderr, self._lost_on_systrap(box, how)
            box.agent_alive = True
            box.lost = "did not stop after a timeout" if r.kind == "timeout" else "died after a timeout"
            return stdout, stderr, (
                f"this exec timed out and the sandbox's interpreter {how}: the next exec runs in a fresh interpreter "
                "(Python state and processes are lost; files in /tmp and /work are kept)"
            )
        try:
            box.vm.reset(keep_files=True)
        except _CoreEngineError as e:
            raise _engine_error(e, f"restarting the interpreter of sandbox {box.id}") from e
        box.agent_alive = True
        box.lost = "did not stop after a timeout" if r.kind == "timeout" else "died after a timeout"
        return stdout, stderr, (
            f"this exec timed out and the sandbox's interpreter {how}: the next exec runs in a fresh interpreter "
            "(Python state and processes are lost; files in /tmp and /work are kept)"
        )

    def _lost_on_systrap(self, box: _Box, how: str) -> str:
        """A timed-out exec whose interpreter cannot go on, on systrap, where the sandbox cannot be
        reset in place (its first process ended, or no reset for its template), so its files
        cannot be kept: the next exec gets a new clone of the template. The note."""
        box.agent_alive = False
        box.lost = f"{how} when an exec timed out (systrap: the sandbox was replaced)"
        return (
            f"this exec timed out and the sandbox's interpreter {how}: on the systrap platform the next exec runs "
            "in a fresh interpreter cloned from the template (Python state, processes and files in /tmp and /work "
            "are lost)"
        )

    def _tape_begin(self, box: _Box, seed: bytes) -> tuple[str, int | None]:
        """Open the recording of this exec (`record=True`): replay it if one exists for this
        state and seed, else record it (docs/egress.md, "Record and replay"). Returns the mode and
        where the exec's virtual wall clock starts (now when recording, the recording's when
        replaying)."""
        name = _tape_name(box.state, seed)
        path = (self.cache or cache_dir()) / "egress-tapes" / name[:2] / f"{name}.tape"
        try:
            return box.vm.egress_tape_begin(str(path))
        except ValueError as e:
            raise CollimateError(f"exec in sandbox {box.id}: {e}") from e

    def upload(self, box: _Box, path: str, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"upload_bytes takes bytes, not {type(data).__name__}")
        if len(data) > MAX_UPLOAD:
            raise InvalidArgument(f"upload of {len(data)} bytes is over the {MAX_UPLOAD >> 20} MiB limit; split it")
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidArgument(f"upload path must be an absolute guest path such as /work/x, not {path!r}")
        with box.lock:
            if not box.agent_alive:
                # The last program ended the agent: the next exec starts from the template, which
                # would drop this file. Restore the sandbox now, so the upload is there for it.
                self._restore(box)
            try:
                box.vm.upload(path, bytes(data))
            except _CoreEngineError as e:
                raise _invalid_or_died(e, f"upload to {path}") from e
            box.state = _state_after(box.state, b"upload", path.encode(), hashlib.sha256(bytes(data)).digest())
        self._count("bytes_in", len(data))

    def disk_usage(self, box: _Box) -> dict | None:
        """What the sandbox's writable mounts hold and their quota (bytes, inodes, quota_bytes,
        quota_inodes); None on a host that cannot give quotas (no CAP_SYS_ADMIN)."""
        with box.lock:
            try:
                return box.vm.disk_usage()
            except _CoreEngineError as e:
                raise _engine_error(e, f"disk usage of sandbox {box.id}") from e

    def open_download(self, box: _Box, path: str, max_bytes: int | None = None) -> tuple[int, int]:
        """Open a regular file of the sandbox of at most `max_bytes` (the client's max_download):
        (a file descriptor the caller reads and closes, its size). A FIFO, a device or a
        directory is refused at once (InvalidArgument) and the sandbox goes on."""
        limit = self.max_download if max_bytes is None else max_bytes
        if not isinstance(path, str) or not path.startswith("/"):
            raise InvalidArgument(f"download path must be an absolute guest path such as /work/x, not {path!r}")
        with box.lock:
            try:
                return box.vm.open_download(path, limit)
            except _CoreEngineError as e:
                raise _invalid_or_died(e, f"download of {path}") from e

    def download(self, box: _Box, path: str) -> bytes:
        fd, size = self.open_download(box, path)
        # One bytes object of the file's size, read straight into (no copy in the VMM or here).
        with os.fdopen(fd, "rb", buffering=0) as f:
            data = f.read(size) if size else b""
            while len(data) < size:  # a regular file gives all of it at once; a shrunk one less
                more = f.read(size - len(data))
                if not more:
                    break
                data += more
        self._count("bytes_out", len(data))
        return data

    # --- network egress ----------------------------------------------------------------------

    def set_egress(self, box: _Box, egress: Any) -> int:
        """Replace a live sandbox's policy; its connections the new one forbids are reset (returns
        how many were)."""
        policy = _egress.coerce(egress)
        if box.ceiling is not None:
            policy.check_within(box.ceiling, box.id)
        with box.lock:
            if box.closed:
                raise NotFoundError(f"sandbox {box.id} is gone")
            try:
                n = box.vm.set_egress(policy.rule_strings(), policy.internet_access)
            except _CoreEngineError as e:
                raise _engine_error(e, f"set_egress on sandbox {box.id}") from e
            except ValueError as e:  # beyond the engine's ceiling for it
                raise InvalidArgument(f"sandbox {box.id}: {e}") from None
            box.egress = policy
            return n

    def egress_log(self, box: _Box) -> _egress.EgressLog:
        """The sandbox's connection attempts and DNS answers (see `Sandbox.egress_log`)."""
        try:
            return _egress.EgressLog(box.vm.egress_log())
        except _CoreEngineError as e:
            raise _engine_error(e, f"egress_log of sandbox {box.id}") from e

    def _count_egress(self, box: _Box) -> None:
        try:
            out, inn = box.vm.egress_bytes()
        except CollimateError:
            return
        if out or inn:
            self._count("egress_bytes_out", out, egress_bytes_in=inn)

    # --- metering ----------------------------------------------------------------------------

    def _count(self, what: str, amount: float, **more: float) -> None:
        now = time.time()
        with self._lock:
            self._meter.add(what, amount, t=now)
            for k, v in more.items():
                self._meter.add(k, v, t=now)
            if now - self._compacted > 60:
                self._meter.compact(now)
                self._compacted = now

    def usage(self, since: float | None = None, until: float | None = None) -> Usage:
        """Metered totals between `since` and `until` (Unix times; default: all time, now). Kept in
        one-second buckets for the last hour and one-minute buckets before it: a window that cuts
        through a bucket counts the part of it that it covers."""
        lo = since if since is not None else 0.0
        hi = until if until is not None else time.time()
        with self._lock:
            # No bound: every bucket whole (the current second's is not over yet).
            w = self._meter.window(-math.inf if since is None else lo, math.inf if until is None else hi)
            live = [(b.created, hi) for b in self._boxes.values()]
            live_boxes = list(self._boxes.values())
        u = Usage(
            sandboxes=round(w["sandboxes"]), execs=round(w["execs"]), forks=round(w["forks"]),
            bytes_in=round(w["bytes_in"]), bytes_out=round(w["bytes_out"]), live_sandboxes=len(live),
        )
        u.sandbox_seconds = w["sandbox_seconds"] + sum(max(0.0, min(e, hi) - max(s, lo)) for s, e in live)
        u.egress_bytes_out, u.egress_bytes_in = round(w["egress_bytes_out"]), round(w["egress_bytes_in"])
        if until is None:  # live sandboxes' connections count as of now
            for b in live_boxes:
                try:
                    o, i = b.vm.egress_bytes()
                except CollimateError:
                    continue
                u.egress_bytes_out += o
                u.egress_bytes_in += i
        return u

    def close(self) -> None:
        """Destroy every sandbox and zygote of this client."""
        with self._lock:
            boxes = list(self._boxes.values())
            templates = list(self._templates.values())
            self._templates.clear()
        for b in boxes:
            self.destroy(b)
        self._reaper.shutdown(wait=True)
        self._reaper = ThreadPoolExecutor(max_workers=reaper_threads(), thread_name_prefix="collimate-reaper")
        for t in templates:
            t.close()

    # --- the SDK surface on the client -------------------------------------------------------

    def session(self, handle: Any = "python", *, disk_quota: int | str | None = None, egress: Any = None,
                shared_memory: int | str | None = None):
        from collimate_core.sdk.session import Session

        return Session(_template_name(handle), client=self, disk_quota=disk_quota, egress=egress,
                       shared_memory=shared_memory)

    def env(self, ref: Any, width: int = 1):
        from collimate_core.sdk.session import Env

        return Env(self, _template_name(ref), width)


def _template_name(handle: Any) -> str:
    name = getattr(handle, "name", handle)
    if not isinstance(name, str):
        raise InvalidArgument(f"expected a template name or handle, not {handle!r}")
    return name


def _how_it_ended(r: Any) -> str:
    """How a run that ended the agent ended, in words."""
    if r.kind == "exited":
        return f"it exited with status {r.code or 0}"
    if r.kind == "signaled":
        n = getattr(r, "signal", 0) or 0
        try:
            name = _signal.Signals(n).name
        except ValueError:
            name = "unknown"
        return f"killed by signal {n} ({name})"
    if r.kind == "fault":
        return f"it crashed (exception vector {r.vector} at rip {r.rip:#x})" if r.rip is not None else "it crashed"
    if r.kind == "shutdown":
        return "the guest shut down"
    return f"it stopped answering (run ended with {r.kind!r})"


def _invalid_or_died(e: _CoreEngineError, what: str) -> Exception:
    msg = str(e)
    if "invalid argument" in msg or "No such file" in msg or _quota.WRITABLE_RULE in msg:
        return InvalidArgument(f"{what}: {msg}")
    return _engine_error(e, what)
