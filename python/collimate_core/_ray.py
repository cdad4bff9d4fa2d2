"""Scale-out on Ray: one host actor per KVM node, and a client with the SDK's surface over them.

    pip install collimate-core[ray]
    ray start --head --resources='{"collimate_host": 64}'      # on every KVM node: its slot count
    collimate ray-host --address auto                          # start the host actors (once)
    client = connect(ray="auto")                               # or COLLIMATE_RAY_ADDRESS

Hosts. A node advertises the custom resource `collimate_host` with its slot count (the sandboxes
it may hold at once). `start_hosts()` (what `collimate ray-host` runs; `connect(ray=...)` does it
too for nodes that have none yet) starts one `HostActor` on each such node, pinned there by hard
node affinity (a VM pool cannot move), named `collimate-host-<node id>` in the `collimate`
namespace and detached, so every driver of the cluster shares it. The actor wraps that node's
embedded engine (`EmbeddedClient`): zygotes, spare clones, recycling, metering, as on one host.
It is a threaded actor: its calls run concurrently, each a blocking engine call with the GIL
released, exactly as the embedded client's own threads.

Placement (by template warmth, decided in the driver, written to `client.placement_log`):
- a session (a sandbox made from a template) goes to a host where that template is warm (its
  zygote is running) or warming (a first sandbox of it is being made there) and a slot is free,
  least loaded first; to a cold host (least loaded) only when no such host has a free slot, so a
  host makes one cold start of a template at a time; CapacityError when no host has a slot;
- a fork group and every later call on a sandbox go to the host holding its VM: a group is never
  split, and children run next to their parent's memory;
- `client.env(ref, width=N)` spreads the expected width over the hosts (N / hosts each), which
  warms the template on all of them.

Templates: `Template.bake(client, ...)` bakes on every host into its own engine (the image must be
reachable under the same path or store reference on each node), and the template is warm on every
host that baked it; `Template.list/get/delete` work as on one host.

Failure: a host that is lost (its node removed, its actor dead) makes every call on it raise
`HostLost` (a `GroupError`, so a fork group's map raises it as is, and never a reward); the host is
dropped from placement, and later sessions go to the hosts that are left. Nothing is retried
behind the caller's back: resampling a group is the caller's explicit, idempotent call.

Leases: a host destroys a sandbox nobody touched for its lease (`RayClient(lease=)`, or
COLLIMATE_RAY_LEASE; default 600 s), never one in a call; a client's daemon thread touches what it
holds every lease / 3, so a driver that dies leaves no sandbox running past its lease.

Every `ExecResult` of this client carries `host`, the Ray node id it ran on.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
import weakref
from dataclasses import dataclass
from typing import Any

from collimate_core.sdk.embedded import Usage, _template_name
from collimate_core.sdk.errors import (
    CapacityError,
    CollimateError,
    HostLost,
    InvalidArgument,
    NotFoundError,
    SandboxTimeout,
)

RESOURCE = "collimate_host"
NAMESPACE = "collimate"
ACTOR_PREFIX = "collimate-host-"
# Calls a host actor serves at once: every child of a wide group may be in an exec.
HOST_CONCURRENCY = 512


def _ray():
    try:
        import ray
    except ImportError:
        raise CollimateError("Ray scale-out needs Ray: pip install 'collimate-core[ray]'") from None
    return ray


# --- the host actor ------------------------------------------------------------------------------


class HostActor:
    """One KVM node's embedded engine, served to drivers (see the module docs)."""

    def __init__(self, node_id: str, slots: int, cache: str | None = None):
        from collimate_core.sdk.embedded import EmbeddedClient

        _start_watchdog()
        self.node_id = node_id
        self.slots = slots
        self.client = EmbeddedClient(cache=cache, max_sandboxes=max(1, slots))
        self._boxes: dict[str, tuple[Any, Any]] = {}  # id -> (box, its interrupt)
        # Leases: a sandbox nobody touched (a call, or its driver's keepalive) for its lease is
        # destroyed, so a driver that dies leaves nothing running past it; never one in a call.
        self._touched: dict[str, float] = {}
        self._lease: dict[str, float] = {}
        self._busy: dict[str, int] = {}
        self._bakes: dict[str, Any] = {}  # template name -> the handle of this host's bake of it
        self._lock = threading.Lock()
        threading.Thread(target=self._reap_expired, daemon=True, name="collimate-lease").start()

    def _box(self, box_id: str) -> Any:
        with self._lock:
            entry = self._boxes.get(box_id)
            if entry is not None:
                self._touched[box_id] = time.monotonic()
        if entry is None:
            raise NotFoundError(f"no live sandbox {box_id!r} on host {self.node_id}")
        return entry[0]

    def _keep(self, box: Any, lease: float) -> str:
        from collimate_core.aio import _Interrupt

        with self._lock:
            self._boxes[box.id] = (box, _Interrupt(self.client, box))
            self._touched[box.id] = time.monotonic()
            self._lease[box.id] = lease
        return box.id

    def keepalive(self, box_ids: list[str]) -> list[str]:
        """Touch these sandboxes; the ids of those this host no longer has."""
        now, gone = time.monotonic(), []
        with self._lock:
            for i in box_ids:
                if i in self._boxes:
                    self._touched[i] = now
                else:
                    gone.append(i)
        return gone

    def _reap_expired(self) -> None:
        while True:
            time.sleep(0.5)
            now = time.monotonic()
            with self._lock:
                expired = [i for i, t in self._touched.items()
                           if i in self._boxes and not self._busy.get(i) and now - t > self._lease.get(i, 600.0)]
            for i in expired:
                try:
                    self.destroy(i)
                except Exception:  # noqa: BLE001 - a sandbox that fails to go is retried next round
                    pass

    def info(self) -> dict:
        with self.client._lock:
            warm = sorted(self.client._templates)
        with self._lock:
            live = len(self._boxes)
        # pid and token: which processes are this host's (its VMM processes carry the token)
        return {"node_id": self.node_id, "slots": self.slots, "live": live, "warm": warm, "pid": os.getpid(),
                "token": os.environ.get("COLLIMATE_HOST_TOKEN")}

    def create(self, template: str, disk_quota: int | None = None, lease: float = 600.0) -> tuple[str, bool]:
        box = self.client.create(template, disk_quota)
        return self._keep(box, lease), box.warm_hit

    def fork(self, box_id: str, n: int, lease: float = 600.0) -> list[str]:
        return [self._keep(b, lease) for b in self.client.fork(self._box(box_id), n)]

    def exec(self, box_id: str, kw: dict) -> Any:
        box = self._box(box_id)
        with self._lock:
            self._busy[box_id] = self._busy.get(box_id, 0) + 1
        try:
            r = self.client.exec(box, **kw)
        finally:
            with self._lock:
                self._busy[box_id] -= 1
                if not self._busy[box_id]:
                    del self._busy[box_id]
                self._touched[box_id] = time.monotonic()
        return dataclasses.replace(r, host=self.node_id)

    def destroy(self, box_id: str) -> None:
        with self._lock:
            entry = self._boxes.pop(box_id, None)
            self._touched.pop(box_id, None)
            self._lease.pop(box_id, None)
        if entry is not None:
            entry[1].close()
            self.client.destroy(entry[0])

    def abort(self, box_id: str) -> None:
        """Stop the sandbox's call in flight now (its VMM is killed; destroy() reaps it)."""
        with self._lock:
            entry = self._boxes.get(box_id)
        if entry is not None:
            entry[1]()

    def vmm_pid(self, box_id: str) -> int:
        """The host pid of the sandbox's VMM process (waits while an exec of it is running)."""
        return self._box(box_id).vm.pid

    def reset(self, box_id: str) -> None:
        self.client.reset(self._box(box_id))

    def upload(self, box_id: str, path: str, data: bytes) -> None:
        self.client.upload(self._box(box_id), path, data)

    def download(self, box_id: str, path: str) -> bytes:
        return self.client.download(self._box(box_id), path)

    def disk_usage(self, box_id: str) -> dict | None:
        return self.client.disk_usage(self._box(box_id))

    def expect_width(self, template: str, width: int) -> None:
        self.client.expect_width(template, width)

    # templates: Template.bake/list/get/delete on this host's engine
    def bake(self, name: str, image: str, ready: Any, width: int, store: str | None) -> Any:
        from collimate_core.templates.bake import Template

        handle = Template.bake(self.client, name=name, image=image, ready=ready, width=width, store=store)
        with self._lock:
            self._bakes[name] = handle
        return handle.status()

    def template_status(self, name: str) -> Any:
        from collimate_core.templates.bake import Template

        with self._lock:
            h = self._bakes.get(name)
        return (h if h is not None else Template.get(self.client, name)).status()

    def template_list(self) -> list:
        from collimate_core.templates.bake import Template

        return Template.list(self.client)

    def template_delete(self, name: str) -> None:
        from collimate_core.templates.bake import Template

        with self._lock:
            self._bakes.pop(name, None)
        Template.delete(self.client, name)

    def release_template(self, template: str) -> None:
        self.client.release_template(template)

    def usage(self, since: float | None, until: float | None) -> Usage:
        return self.client.usage(since, until)

    def shutdown(self) -> None:
        """Destroy every sandbox and zygote of this host (the actor stays, empty)."""
        with self._lock:
            entries, self._boxes = list(self._boxes.values()), {}
        for _, interrupt in entries:
            interrupt.close()
        self.client.close()


# A VMM process notices that its controller is gone only when it next reads its socket: one in the
# middle of a guest's run would keep running until that exec's timeout after its host actor died
# (a node removed, the actor killed). So each host actor marks its environment (which its zygotes
# and every VMM forked from them inherit) with a token and starts a watchdog, detached from it
# (Ray ends a dead worker's children), that waits for the actor's process to end (a pidfd), then
# SIGKILLs every process carrying the token.
_WATCHDOG = r"""
import os, select, signal, sys, time
pid, marker = int(sys.argv[1]), ("COLLIMATE_HOST_TOKEN=" + sys.argv[2]).encode()
fd = os.pidfd_open(pid)
if os.fork():
    os._exit(0)  # not the actor's child: Ray ends a dead worker's children, this must outlive it
select.select([fd], [], [])
for _ in range(50):
    found = 0
    for d in os.listdir("/proc"):
        if d.isdigit() and int(d) != os.getpid():
            try:
                with open(f"/proc/{d}/environ", "rb") as f:
                    if marker in f.read().split(b"\0"):
                        os.kill(int(d), signal.SIGKILL)
                        found += 1
            except OSError:
                pass
    if not found:
        break
    time.sleep(0.05)
"""


def _start_watchdog() -> None:
    import secrets
    import subprocess
    import sys

    token = secrets.token_hex(16)
    env = {k: v for k, v in os.environ.items() if k != "COLLIMATE_HOST_TOKEN"}
    subprocess.run([sys.executable, "-I", "-S", "-c", _WATCHDOG, str(os.getpid()), token], env=env,
                   stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                   start_new_session=True, close_fds=True, check=True, timeout=60)
    os.environ["COLLIMATE_HOST_TOKEN"] = token  # inherited by the zygotes this actor starts from now on


def _host_nodes(ray) -> list[tuple[str, int]]:
    """(node id, slots) of every alive node that advertises the collimate_host resource."""
    out = []
    for n in ray.nodes():
        slots = n.get("Resources", {}).get(RESOURCE)
        if n.get("Alive") and slots:
            out.append((n["NodeID"], int(slots)))
    return sorted(out)


def start_hosts(address: str | None = None, *, cache: str | None = None) -> list[str]:
    """Start a host actor on every node advertising `collimate_host` that has none yet (an
    existing one is kept); the node ids that have one. What `collimate ray-host` runs."""
    ray = _ray()
    if not ray.is_initialized():
        ray.init(address=address or os.environ.get("COLLIMATE_RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                 log_to_driver=False)
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    remote = ray.remote(HostActor)
    started = []
    for node_id, slots in _host_nodes(ray):
        remote.options(
            name=ACTOR_PREFIX + node_id, namespace=NAMESPACE, get_if_exists=True, lifetime="detached",
            num_cpus=0, resources={RESOURCE: 0.001}, max_concurrency=HOST_CONCURRENCY, max_restarts=0,
            scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
        ).remote(node_id, slots, cache)
        started.append(node_id)
    return started


def stop_hosts() -> None:
    """Destroy every host's sandboxes and kill the host actors (their VMM processes end with them)."""
    ray = _ray()
    for node_id, _ in _host_nodes(ray):
        try:
            actor = ray.get_actor(ACTOR_PREFIX + node_id, namespace=NAMESPACE)
        except ValueError:
            continue
        try:
            ray.get(actor.shutdown.remote(), timeout=60)
        except Exception:  # noqa: BLE001 - killed below all the same
            pass
        ray.kill(actor)


# --- the driver side -----------------------------------------------------------------------------


@dataclass
class RaySandbox:
    """A sandbox on a host actor (what `create`, `get` and `fork` return)."""

    id: str
    template: str
    warm_hit: bool
    host: str
    parent: str | None = None


@dataclass
class _Host:
    node_id: str
    actor: Any
    slots: int
    live: int = 0  # sandboxes this client holds there (and reserved while a create or fork is in flight)
    warm: set = dataclasses.field(default_factory=set)
    starting: dict = dataclasses.field(default_factory=dict)  # template -> cold starts in flight here
    lost: str | None = None


class RayClient:
    """The SDK's client surface over the host actors of a Ray cluster (see the module docs).
    Thread-safe; `Sandbox`, sessions, fork groups, envs, `rollout_once`, `grade`, `grade_batch`
    and `collimate_core.aio` all work on it unchanged."""

    def __init__(self, address: str = "auto", *, start: bool = True, call_timeout: float = 600.0,
                 lease: float | None = None, runtime_env: dict | None = None):
        ray = self._ray = _ray()
        if not ray.is_initialized():
            ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, runtime_env=runtime_env)
        self.address = address
        self.call_timeout = call_timeout
        # A host destroys this client's sandboxes `lease` seconds after the client last touched them
        # (a daemon thread touches every held sandbox each lease / 3 while the process lives).
        self.lease = float(lease if lease is not None else os.environ.get("COLLIMATE_RAY_LEASE", 600.0))
        if not self.lease > 0:
            raise InvalidArgument(f"lease must be a positive number of seconds, not {lease!r}")
        self._beat: threading.Thread | None = None
        self._closed = False
        self._remote_templates = RayTemplates(self)  # Template.bake/list/get/delete hand over to it
        self._lock = threading.Lock()
        self._hosts: dict[str, _Host] = {}
        self._boxes: dict[str, RaySandbox] = {}
        self.placement_log: list[dict] = []
        self.refresh(start=start)

    # --- hosts ---------------------------------------------------------------------------------

    def refresh(self, *, start: bool = True) -> list[str]:
        """Find the host actors (starting missing ones with `start`) and what each has warm."""
        ray = self._ray
        if start:
            start_hosts()
        found = {}
        for node_id, slots in _host_nodes(ray):
            try:
                found[node_id] = (ray.get_actor(ACTOR_PREFIX + node_id, namespace=NAMESPACE), slots)
            except ValueError:
                continue
        infos = {}
        for node_id, (actor, _) in found.items():
            try:
                infos[node_id] = ray.get(actor.info.remote(), timeout=self.call_timeout)
            except Exception:  # noqa: BLE001 - an actor that does not answer is not a host
                continue
        with self._lock:
            for node_id, (actor, slots) in found.items():
                if node_id not in infos:
                    continue
                h = self._hosts.get(node_id)
                if h is None or h.lost:
                    h = self._hosts[node_id] = _Host(node_id, actor, slots)
                h.warm |= set(infos[node_id]["warm"])
            return sorted(n for n, h in self._hosts.items() if not h.lost)

    def hosts(self) -> list[dict]:
        """Each host as this client sees it: node id, slots, live (this client's), warm, lost."""
        with self._lock:
            return [{"node_id": h.node_id, "slots": h.slots, "live": h.live, "warm": sorted(h.warm), "lost": h.lost}
                    for h in sorted(self._hosts.values(), key=lambda h: h.node_id)]

    def _log(self, **entry: Any) -> None:
        entry["time"] = time.time()
        self.placement_log.append(entry)

    def _lose(self, h: _Host, why: str) -> None:
        with self._lock:
            if h.lost is None:
                h.lost = why
                self._log(op="lost", host=h.node_id, reason=why)
            for bid in [b for b, box in self._boxes.items() if box.host == h.node_id]:
                del self._boxes[bid]
            h.live = 0

    def _call(self, h: _Host, method: str, *args: Any, timeout: float | None = None) -> Any:
        """`method(*args)` on host `h`'s actor: its result, the SDK error it raised, or HostLost."""
        ray = self._ray
        if h.lost:
            raise HostLost(f"host {h.node_id} was lost ({h.lost}); resample on another host")
        try:
            return ray.get(getattr(h.actor, method).remote(*args), timeout=timeout or self.call_timeout)
        except ray.exceptions.RayTaskError as e:
            cause = e.cause if getattr(e, "cause", None) is not None else e
            if isinstance(cause, CollimateError):
                raise cause from None
            raise
        except ray.exceptions.GetTimeoutError:
            waited = timeout or self.call_timeout
            raise SandboxTimeout(f"host {h.node_id} did not answer {method} in {waited:g} s") from None
        except (ray.exceptions.RayActorError, ray.exceptions.NodeDiedError, ray.exceptions.WorkerCrashedError,
                ray.exceptions.ObjectLostError) as e:
            why = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            self._lose(h, why)
            raise HostLost(f"host {h.node_id} was lost during {method} ({why}); nothing of it was scored, "
                           f"resample on another host") from None

    def _start_heartbeat(self) -> None:
        with self._lock:
            if self._beat is None and not self._closed:
                self._beat = threading.Thread(target=_heartbeat, args=(weakref.ref(self),), daemon=True,
                                              name="collimate-ray-keepalive")
                self._beat.start()

    def _keepalive(self) -> None:
        """Touch every sandbox this client holds, on each of their hosts."""
        with self._lock:
            by_host: dict[str, list[str]] = {}
            for b in self._boxes.values():
                by_host.setdefault(b.host, []).append(b.id)
            hosts = {n: self._hosts[n] for n in by_host if n in self._hosts and not self._hosts[n].lost}
        refs = [(hosts[n].actor.keepalive.remote(ids)) for n, ids in by_host.items() if n in hosts]
        try:
            for gone in self._ray.get(refs, timeout=self.call_timeout):
                with self._lock:
                    for i in gone:
                        self._boxes.pop(i, None)
        except Exception:  # noqa: BLE001 - a host that does not answer is found lost by the next call on it
            pass

    def _host_of(self, box: RaySandbox) -> _Host:
        with self._lock:
            h = self._hosts.get(box.host)
        if h is None:
            raise NotFoundError(f"sandbox {box.id} is on an unknown host {box.host}")
        return h

    def _place(self, template: str, n: int = 1) -> tuple[_Host, bool]:
        """The host for a new session of `template` (slots reserved), by warmth then load, and
        whether it is a cold start there."""
        with self._lock:
            alive = [h for h in self._hosts.values() if not h.lost]
            if not alive:
                raise CapacityError("no collimate host on the Ray cluster: start nodes with the collimate_host "
                                    "resource and `collimate ray-host`")
            free = [h for h in alive if h.live + n <= h.slots]
            warm = [h for h in free if template in h.warm]
            # A host starting the template (its first sandbox of it in flight) is warm in a moment:
            # one cold start per template and host at a time, the others wait there for it.
            warming = [h for h in free if template not in h.warm and h.starting.get(template)]
            if warm or warming:
                pool, why = warm + warming, "warm" if warm else "warming"
            else:
                pool, why = free, "cold"
            if not pool:
                raise CapacityError(f"every collimate host is full ({sum(h.slots for h in alive)} slots on "
                                    f"{len(alive)} hosts); destroy sandboxes or add nodes")
            h = min(pool, key=lambda h: (h.live / h.slots, h.node_id))
            self._log(op="create", template=template, host=h.node_id, reason=why, load=h.live, slots=h.slots,
                      warm_hosts=sorted(x.node_id for x in alive if template in x.warm))
            h.live += n
            if why == "cold":
                h.starting[template] = h.starting.get(template, 0) + 1
            return h, why == "cold"

    # --- the client surface (as EmbeddedClient) -----------------------------------------------

    def create(self, template: str, disk_quota: int | str | None = None) -> RaySandbox:
        if not isinstance(template, str) or not template:
            raise InvalidArgument(f"template must be a template name such as 'python', not {template!r}")
        if disk_quota is not None:
            from collimate_core.sdk.quota import disk_quota as _check_quota

            disk_quota = _check_quota(disk_quota)
        h, cold = self._place(template)
        try:
            box_id, warm = self._call(h, "create", template, disk_quota, self.lease)
        except BaseException:
            with self._lock:
                h.live = max(0, h.live - 1)
                if cold:
                    h.starting[template] -= 1
            raise
        box = RaySandbox(box_id, template, warm, h.node_id)
        with self._lock:
            h.warm.add(template)
            if cold:
                h.starting[template] -= 1
            self._boxes[box_id] = box
        self._start_heartbeat()
        return box

    def get(self, sandbox_id: str) -> RaySandbox:
        with self._lock:
            box = self._boxes.get(sandbox_id)
        if box is None:
            raise NotFoundError(f"no live sandbox {sandbox_id!r} on this client")
        return box

    def destroy(self, box: RaySandbox) -> None:
        with self._lock:
            if self._boxes.pop(box.id, None) is None:
                return
            h = self._hosts.get(box.host)
            if h is not None:
                h.live = max(0, h.live - 1)
        if h is None or h.lost:
            return  # its host (and the sandbox with it) is gone already
        try:
            self._call(h, "destroy", box.id)
        except HostLost:
            pass

    def abort(self, box: RaySandbox) -> None:
        """Stop the sandbox's call in flight (collimate_core.aio's cancellation)."""
        h = self._host_of(box)
        if not h.lost:
            h.actor.abort.remote(box.id)

    def exec(self, box: RaySandbox, *, code: str | None = None, command: str | None = None, timeout: float = 60.0,
             seed: str | None = None, env: dict[str, str] | None = None, cwd: str | None = None):
        from collimate_core.sdk.embedded import check_exec_args

        check_exec_args(code, command, timeout, seed)
        kw = {"code": code, "command": command, "timeout": timeout, "seed": seed, "env": env, "cwd": cwd}
        return self._call(self._host_of(box), "exec", box.id, kw, timeout=float(timeout) + self.call_timeout)

    def fork(self, box: RaySandbox, n: int) -> list[RaySandbox]:
        """`n` children of `box`, all on its host (a group is never split)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"a fork group needs width >= 1, not {n!r}")
        h = self._host_of(box)
        with self._lock:
            if h.live + n > h.slots and not h.lost:
                raise CapacityError(f"a fork group of {n} does not fit on host {h.node_id} next to its parent "
                                    f"({h.live} of {h.slots} slots held); use a narrower group")
            h.live += n
            self._log(op="fork", template=box.template, host=h.node_id, parent=box.id, width=n)
        try:
            ids = self._call(h, "fork", box.id, n, self.lease)
        except BaseException:
            with self._lock:
                h.live = max(0, h.live - n)
            raise
        kids = [RaySandbox(i, box.template, False, h.node_id, parent=box.id) for i in ids]
        with self._lock:
            for k in kids:
                self._boxes[k.id] = k
        return kids

    def reset(self, box: RaySandbox) -> None:
        self._call(self._host_of(box), "reset", box.id)

    def upload(self, box: RaySandbox, path: str, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"upload_bytes takes bytes, not {type(data).__name__}")
        self._call(self._host_of(box), "upload", box.id, path, bytes(data))

    def download(self, box: RaySandbox, path: str) -> bytes:
        return self._call(self._host_of(box), "download", box.id, path)

    def disk_usage(self, box: RaySandbox) -> dict | None:
        return self._call(self._host_of(box), "disk_usage", box.id)

    def expect_width(self, template: str, width: int) -> None:
        """Spread `width` over the hosts: each keeps its share of clones ready (and is warm)."""
        if isinstance(width, bool) or not isinstance(width, int) or width < 0:
            raise InvalidArgument(f"width must be an int >= 0, not {width!r}")
        with self._lock:
            alive = [h for h in self._hosts.values() if not h.lost]
        share = -(-width // max(1, len(alive)))
        for h in alive:
            self._call(h, "expect_width", template, share)
            with self._lock:
                h.warm.add(template)
            self._log(op="expect", template=template, host=h.node_id, width=share)

    def release_template(self, template: str) -> None:
        with self._lock:
            alive = [h for h in self._hosts.values() if not h.lost]
        for h in alive:
            self._call(h, "release_template", template)

    def usage(self, since: float | None = None, until: float | None = None) -> Usage:
        """The hosts' metered totals added up (every driver's use of them)."""
        total = Usage()
        with self._lock:
            alive = [h for h in self._hosts.values() if not h.lost]
        for h in alive:
            u = self._call(h, "usage", since, until)
            for f in dataclasses.fields(Usage):
                setattr(total, f.name, getattr(total, f.name) + getattr(u, f.name))
        return total

    def session(self, handle: Any = "python", *, disk_quota: int | str | None = None):
        from collimate_core.sdk.session import Session

        return Session(_template_name(handle), client=self, disk_quota=disk_quota)

    def env(self, ref: Any, width: int = 1):
        from collimate_core.sdk.session import Env

        return Env(self, _template_name(ref), width)

    def close(self) -> None:
        """Destroy this client's sandboxes (the host actors stay for other drivers)."""
        with self._lock:
            self._closed = True
            boxes = list(self._boxes.values())
        for b in boxes:
            try:
                self.destroy(b)
            except CollimateError:
                pass

    def __repr__(self) -> str:
        return f"RayClient({self.address!r}, hosts={len([h for h in self._hosts.values() if not h.lost])})"


class RayTemplateHandle:
    """A template baked on every host (Template.bake on a RayClient): the TemplateHandle
    interface; its phase is Failed if any host's bake failed, Building while any builds, else Live."""

    def __init__(self, client: RayClient, name: str, version: int | None):
        self.client, self.name, self.version = client, name, version

    @property
    def id(self) -> str:
        return f"{self.name}@v{self.version}"

    def statuses(self) -> dict[str, Any]:
        """Each host's status of this template, by node id."""
        c = self.client
        with c._lock:
            alive = [h for h in c._hosts.values() if not h.lost]
        return {h.node_id: c._call(h, "template_status", self.name) for h in alive}

    def status(self):
        sts = self.statuses()
        if not sts:
            raise NotFoundError(f"no host has template {self.name!r}")
        phases = {st.phase for st in sts.values()}
        worst = next(st for st in sts.values() if st.phase == ("Failed" if "Failed" in phases else
                                                              "Building" if "Building" in phases else "Live"))
        if worst.phase == "Live":
            with self.client._lock:
                for n in sts:
                    self.client._hosts[n].warm.add(self.name)
        return worst

    @property
    def phase(self) -> str:
        return self.status().phase

    def wait(self, timeout: float | None = None):
        """Poll every host until its bake ends; the status (see `status`)."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            st = self.status()
            if st.phase != "Building":
                return st
            if deadline is not None and time.monotonic() >= deadline:
                raise SandboxTimeout(f"template {self.name!r} is still building on a host after {timeout:g}s")
            time.sleep(0.1)

    def delete(self) -> None:
        self.client._remote_templates.delete(self.name)

    def __repr__(self) -> str:
        return f"RayTemplateHandle({self.name!r})"


class RayTemplates:
    """Template.bake/list/get/delete on a RayClient: each host bakes the image into its own
    engine (so a path or a store reference must name the image on every node: a shared
    directory, or the same local store on each)."""

    def __init__(self, client: RayClient):
        self.client = client

    def _alive(self) -> list[_Host]:
        with self.client._lock:
            return [h for h in self.client._hosts.values() if not h.lost]

    def bake(self, name: str, image: Any, ready: Any = None, width: int = 1, *, store: Any = None,
             cache: Any = None) -> RayTemplateHandle:
        from collimate_core.templates.bake import check_bake_args

        if cache is not None:
            raise InvalidArgument("Template.bake(cache=...) is for the embedded engine; each Ray host keeps its own")
        ready = check_bake_args(image, ready, width)
        versions = [self.client._call(h, "bake", name, os.fspath(image), ready, width,
                                      None if store is None else os.fspath(store)).version for h in self._alive()]
        for h in self._alive():
            self.client._log(op="bake", template=name, host=h.node_id)
        return RayTemplateHandle(self.client, name, max((v for v in versions if v is not None), default=None))

    def list(self) -> list:
        hosts = self._alive()
        return self.client._call(hosts[0], "template_list") if hosts else []

    def get(self, name: str) -> RayTemplateHandle:
        st = RayTemplateHandle(self.client, name, None).status()  # NotFoundError if a host has none
        return RayTemplateHandle(self.client, name, st.version)

    def delete(self, name: str) -> None:
        found = False
        for h in self._alive():
            try:
                self.client._call(h, "template_delete", name)
                found = True
            except NotFoundError:
                pass  # hosts sharing one cache: another host's delete took its files already
            with self.client._lock:
                h.warm.discard(name)
        if not found:
            raise NotFoundError(f"no image template named {name!r} on any host")


def _heartbeat(ref: "weakref.ref[RayClient]") -> None:
    """Keep a client's sandboxes leased; ends with the client (closed or garbage-collected)."""
    while True:
        client = ref()
        if client is None or client._closed:
            return
        period = max(0.2, client.lease / 3)
        del client  # hold no strong reference while waiting
        time.sleep(period)
        client = ref()
        if client is None or client._closed:
            return
        client._keepalive()
        del client


# --- `collimate ray-host` -------------------------------------------------------------------------


def add_subcommand(sub) -> None:
    r = sub.add_parser("ray-host", help="start (or stop) a collimate host actor on every Ray node that advertises "
                       "the collimate_host resource")
    r.add_argument("--address", default=None, help="the Ray cluster (default: COLLIMATE_RAY_ADDRESS, else auto)")
    r.add_argument("--cache", default=None, help="each host's cache directory (default: its COLLIMATE_CACHE)")
    r.add_argument("--stop", action="store_true", help="destroy every host's sandboxes and stop the host actors")


def run_cli(args) -> None:
    if args.stop:
        ray = _ray()
        ray.init(address=args.address or os.environ.get("COLLIMATE_RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                 log_to_driver=False)
        stop_hosts()
        print("stopped the collimate host actors")
        return
    nodes = start_hosts(args.address, cache=args.cache)
    client = RayClient(args.address or "auto", start=False)
    for h in client.hosts():
        print(f"host {h['node_id']}: {h['slots']} slots, warm: {', '.join(h['warm']) or '-'}")
    if not nodes:
        raise SystemExit("collimate ray-host: no node advertises the collimate_host resource "
                         "(ray start --resources='{\"collimate_host\": SLOTS}')")
