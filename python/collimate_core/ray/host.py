"""The Ray host actor: one per KVM node, wrapping that node's embedded engine.

`start_hosts()` starts one on every node that advertises the `collimate_host` resource, pinned
there by hard node affinity; `stop_hosts()` ends them. The driver side (placement, leases, the
SDK surface) is client.py; the whole design is in this package's docstring.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from typing import Any

from collimate_core.sdk.embedded import Usage
from collimate_core.sdk.errors import CollimateError, NotFoundError, PlatformUnavailable

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

    def __init__(self, node_id: str, slots: int, cache: str | None = None, platform: str | None = None):
        from collimate_core.sdk.embedded import EmbeddedClient

        _start_watchdog()
        self.node_id = node_id
        self.slots = slots
        # What this host's sandboxes run on, chosen once when the actor starts (the platform the
        # first `start_hosts` asked for, else the node's COLLIMATE_PLATFORM, else auto). A node
        # that cannot serve it keeps an actor that says why (`info`) and serves nothing.
        self.unavailable: str | None = None
        try:
            self.client = EmbeddedClient(cache=cache, max_sandboxes=max(1, slots), platform=platform)
        except PlatformUnavailable as e:
            self.client, self.unavailable = None, str(e)
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
        if self.client is None:
            return {"node_id": self.node_id, "slots": self.slots, "live": 0, "warm": [], "pid": os.getpid(),
                    "token": os.environ.get("COLLIMATE_HOST_TOKEN"), "platform": None, "unavailable": self.unavailable}
        with self.client._lock:
            warm = sorted(self.client._templates)
        with self._lock:
            live = len(self._boxes)
        # pid and token: which processes are this host's (its VMM processes carry the token)
        return {"node_id": self.node_id, "slots": self.slots, "live": live, "warm": warm, "pid": os.getpid(),
                "token": os.environ.get("COLLIMATE_HOST_TOKEN"), "platform": self.client.platform}

    def create(self, template: str, disk_quota: int | None = None, lease: float = 600.0, egress: Any = None,
               shared_memory: int | None = None) -> tuple[str, bool]:
        box = self.client.create(template, disk_quota, egress=egress, shared_memory=shared_memory)
        return self._keep(box, lease), box.warm_hit

    def fork(self, box_id: str, n: int, lease: float = 600.0, egress: Any = None) -> list[str]:
        return [self._keep(b, lease) for b in self.client.fork(self._box(box_id), n, egress=egress)]

    def set_egress(self, box_id: str, egress: Any) -> int:
        return self.client.set_egress(self._box(box_id), egress)

    def egress_log(self, box_id: str) -> list[dict]:
        return self.client.egress_log(self._box(box_id))

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
    def bake(self, name: str, image: str, ready: Any, width: int, store: str | None, egress: Any = None) -> Any:
        from collimate_core.templates.bake import Template

        handle = Template.bake(self.client, name=name, image=image, ready=ready, width=width, store=store, egress=egress)
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
        if self.client is not None:
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


def start_hosts(address: str | None = None, *, cache: str | None = None, platform: str | None = None) -> list[str]:
    """Start a host actor on every node advertising `collimate_host` that has none yet (an
    existing one is kept, with the platform it chose); the node ids that have one. What
    `collimate ray-host` runs. `platform`: "auto", "kvm" or "systrap" for the new actors (None:
    each node's COLLIMATE_PLATFORM, else auto)."""
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
        ).remote(node_id, slots, cache, platform)
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
