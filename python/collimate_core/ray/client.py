"""The Ray client: the SDK's surface over the host actors (host.py), placement by template warmth,
leases, and `collimate ray-host`. The whole design is in this package's docstring."""

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
    PlatformUnavailable,
    SandboxTimeout,
)
from collimate_core.ray.host import ACTOR_PREFIX, NAMESPACE, _host_nodes, _ray, start_hosts, stop_hosts


# --- the driver side -----------------------------------------------------------------------------


@dataclass
class RaySandbox:
    """A sandbox on a host actor (what `create`, `get` and `fork` return)."""

    id: str
    template: str
    warm_hit: bool
    host: str
    parent: str | None = None
    egress: Any = None  # its network policy (collimate_core.sdk.egress.Egress), as its host keeps it
    platform: str = "kvm"  # what it runs on (its host's platform): kvm or systrap


@dataclass
class _Host:
    node_id: str
    actor: Any
    slots: int
    live: int = 0  # sandboxes this client holds there (and reserved while a create or fork is in flight)
    warm: set = dataclasses.field(default_factory=set)
    starting: dict = dataclasses.field(default_factory=dict)  # template -> cold starts in flight here
    lost: str | None = None
    platform: str = "kvm"  # what its sandboxes run on (the host actor chose when it started)


class RayClient:
    """The SDK's client surface over the host actors of a Ray cluster (see the module docs).
    Thread-safe; `Sandbox`, sessions, fork groups, envs, `rollout_once`, `grade`, `grade_batch`
    and `collimate_core.aio` all work on it unchanged."""

    def __init__(self, address: str = "auto", *, start: bool = True, call_timeout: float = 600.0,
                 lease: float | None = None, runtime_env: dict | None = None, platform: str | None = None):
        from collimate_core.sdk.platform import check as _check_platform

        # "auto", "kvm" or "systrap": passed to the host actors this client starts; a host that
        # chose another platform (when it started) is not used by this client.
        self.platform_asked = None if platform is None else _check_platform(platform)
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
            start_hosts(platform=self.platform_asked)
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
        asked = self.platform_asked
        # Hosts whose actor could not serve the platform it chose, and hosts on another platform
        # than this client asked for: not used.
        unavailable = {n: i["unavailable"] for n, i in infos.items() if i.get("unavailable")}
        other = {n: i.get("platform", "kvm") for n, i in infos.items() if n not in unavailable
                 and asked not in (None, "auto") and i.get("platform", "kvm") != asked}
        with self._lock:
            for node_id, (actor, slots) in found.items():
                if node_id not in infos or node_id in other or node_id in unavailable:
                    continue
                h = self._hosts.get(node_id)
                if h is None or h.lost:
                    h = self._hosts[node_id] = _Host(node_id, actor, slots)
                h.warm |= set(infos[node_id]["warm"])
                h.platform = infos[node_id].get("platform", "kvm")
            usable = sorted(n for n, h in self._hosts.items() if not h.lost)
        if unavailable and not usable and not other:
            raise PlatformUnavailable(
                "no collimate host of this cluster can run sandboxes: "
                + "; ".join(f"host {n}: {why}" for n, why in sorted(unavailable.items()))
                + " (a host chooses its platform when its actor starts: `collimate ray-host --stop`, then start them "
                "with a platform they can serve)"
            )
        if other and not usable:
            raise InvalidArgument(
                f"platform={asked!r}: every collimate host of this cluster already runs another platform "
                f"({', '.join(f'{n}: {p}' for n, p in sorted(other.items()))}); a host chooses when its actor starts: "
                f"`collimate ray-host --stop`, then connect again with platform={asked!r} (or ask for 'auto')"
            )
        return usable

    @property
    def platform(self) -> str:
        """What this client's sandboxes run on: its hosts' platform ("kvm" or "systrap"; both,
        comma-separated, when its hosts differ)."""
        with self._lock:
            kinds = sorted({h.platform for h in self._hosts.values() if not h.lost})
        return ",".join(kinds) or (self.platform_asked or "auto")

    def hosts(self) -> list[dict]:
        """Each host as this client sees it: node id, slots, live (this client's), warm, lost."""
        with self._lock:
            return [{"node_id": h.node_id, "slots": h.slots, "live": h.live, "warm": sorted(h.warm), "lost": h.lost,
                     "platform": h.platform}
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

    def create(self, template: str, disk_quota: int | str | None = None, egress: Any = None,
               shared_memory: int | str | None = None) -> RaySandbox:
        from collimate_core.sdk import egress as _egress

        policy = _egress.coerce(egress)  # bad rules raise before anything is placed
        if not isinstance(template, str) or not template:
            raise InvalidArgument(f"template must be a template name such as 'python', not {template!r}")
        if disk_quota is not None:
            from collimate_core.sdk.quota import disk_quota as _check_quota

            disk_quota = _check_quota(disk_quota)
        if shared_memory is not None:
            from collimate_core.sdk.quota import shared_memory as _check_shared

            shared_memory = _check_shared(shared_memory)
        h, cold = self._place(template)
        try:
            box_id, warm = self._call(h, "create", template, disk_quota, self.lease, policy, shared_memory)
        except BaseException:
            with self._lock:
                h.live = max(0, h.live - 1)
                if cold:
                    h.starting[template] -= 1
            raise
        box = RaySandbox(box_id, template, warm, h.node_id, egress=policy, platform=h.platform)
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

    def fork(self, box: RaySandbox, n: int, egress: Any = None) -> list[RaySandbox]:
        """`n` children of `box`, all on its host (a group is never split). They inherit its egress
        policy, or get `egress` (which may only narrow it: the host's engine checks)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise InvalidArgument(f"a fork group needs width >= 1, not {n!r}")
        from collimate_core.sdk import egress as _egress

        policy = None if egress is None else _egress.coerce(egress)
        h = self._host_of(box)
        with self._lock:
            if h.live + n > h.slots and not h.lost:
                raise CapacityError(f"a fork group of {n} does not fit on host {h.node_id} next to its parent "
                                    f"({h.live} of {h.slots} slots held); use a narrower group")
            h.live += n
            self._log(op="fork", template=box.template, host=h.node_id, parent=box.id, width=n)
        try:
            ids = self._call(h, "fork", box.id, n, self.lease, policy)
        except BaseException:
            with self._lock:
                h.live = max(0, h.live - n)
            raise
        kids = [RaySandbox(i, box.template, False, h.node_id, parent=box.id, egress=policy or box.egress,
                           platform=box.platform) for i in ids]
        with self._lock:
            for k in kids:
                self._boxes[k.id] = k
        return kids

    def reset(self, box: RaySandbox) -> None:
        self._call(self._host_of(box), "reset", box.id)

    def set_egress(self, box: RaySandbox, egress: Any) -> int:
        from collimate_core.sdk import egress as _egress

        policy = _egress.coerce(egress)
        n = self._call(self._host_of(box), "set_egress", box.id, policy)
        box.egress = policy
        return n

    def egress_log(self, box: RaySandbox) -> list[dict]:
        return self._call(self._host_of(box), "egress_log", box.id)

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

    def session(self, handle: Any = "python", *, disk_quota: int | str | None = None, egress: Any = None,
                shared_memory: int | str | None = None):
        from collimate_core.sdk.session import Session

        return Session(_template_name(handle), client=self, disk_quota=disk_quota, egress=egress,
                       shared_memory=shared_memory)

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
             cache: Any = None, egress: Any = None) -> RayTemplateHandle:
        from collimate_core.templates.bake import check_bake_args

        if cache is not None:
            raise InvalidArgument("Template.bake(cache=...) is for the embedded engine; each Ray host keeps its own")
        ready = check_bake_args(image, ready, width)
        versions = [self.client._call(h, "bake", name, os.fspath(image), ready, width,
                                      None if store is None else os.fspath(store), egress).version
                    for h in self._alive()]
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
    r.add_argument("--platform", default=None, choices=("auto", "kvm", "systrap"),
                   help="what the new host actors' sandboxes run on (default: each node's COLLIMATE_PLATFORM, else auto)")


def run_cli(args) -> None:
    if args.stop:
        ray = _ray()
        ray.init(address=args.address or os.environ.get("COLLIMATE_RAY_ADDRESS") or "auto", namespace=NAMESPACE,
                 log_to_driver=False)
        stop_hosts()
        print("stopped the collimate host actors")
        return
    nodes = start_hosts(args.address, cache=args.cache, platform=args.platform)
    try:
        client = RayClient(args.address or "auto", start=False)
    except CollimateError as e:
        raise SystemExit(f"collimate ray-host: {e}") from None
    for h in client.hosts():
        print(f"host {h['node_id']}: {h['slots']} slots, platform {h['platform']}, warm: {', '.join(h['warm']) or '-'}")
    if not nodes:
        raise SystemExit("collimate ray-host: no node advertises the collimate_host resource "
                         "(ray start --resources='{\"collimate_host\": SLOTS}')")
