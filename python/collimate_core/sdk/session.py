"""Sandboxes, sessions, fork groups and environments: the SDK surface over a client."""

from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Any, Callable, TypeVar

from collimate_core.sdk.egress import Egress
from collimate_core.sdk.egress import coerce as coerce_egress
from collimate_core.sdk.embedded import check_exec_args
from collimate_core.sdk.errors import CollimateError, GroupError, InvalidArgument
from collimate_core.sdk.results import ExecResult
from collimate_core.sdk import workers as _workers
from collimate_core.sdk.seeds import fresh_seed, group_seeds, parse_seed

T = TypeVar("T")


class Sandbox:
    """One isolated sandbox, forked from a template in about a millisecond.

    A context manager: entering forks a fresh clone of `template`, leaving destroys it, even on
    error. Outside a `with` block, call `start()` and `kill()` yourself.
    """

    def __init__(
        self,
        template: Any = "python",
        *,
        client: Any = None,
        default_seed: str | None = None,
        disk_quota: int | str | None = None,
        egress: Any = None,
        shared_memory: int | str | None = None,
    ):
        from collimate_core.sdk.client import connect
        from collimate_core.sdk.quota import disk_quota as _check_quota
        from collimate_core.sdk.quota import shared_memory as _check_shared

        self.client = client if client is not None else connect()
        self.template = getattr(template, "name", template)
        self.default_seed = default_seed
        # Bytes (or "512M", "2G") for /tmp and /work together; None: the template's.
        self.disk_quota = _check_quota(disk_quota) if disk_quota is not None else None
        # Bytes (or "256M") for its shared memory: shared mappings, memfds and /dev/shm together;
        # None: the template's (512 MiB unless the client or server sets another).
        self.shared_memory = _check_shared(shared_memory) if shared_memory is not None else None
        # Its network policy (default: none); bad rules raise here, before anything is forked.
        self.egress_policy = coerce_egress(egress)
        self._box = None

    # lifecycle
    def start(self) -> "Sandbox":
        if self._box is None:
            kw: dict[str, Any] = {}
            if self.disk_quota is not None:
                kw["disk_quota"] = self.disk_quota
            if self.shared_memory is not None:
                kw["shared_memory"] = self.shared_memory
            if not self.egress_policy.is_none:
                kw["egress"] = self.egress_policy
            self._box = self.client.create(self.template, **kw)
        return self

    def __enter__(self) -> "Sandbox":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.kill()

    def kill(self) -> None:
        """Destroy the sandbox now (idempotent)."""
        if self._box is not None:
            box, self._box = self._box, None
            self.client.destroy(box)

    close = kill

    @classmethod
    def attach(cls, client: Any, session_id: str) -> "Sandbox":
        """Re-adopt a live sandbox by id (e.g. after a worker restarted)."""
        sb = cls.__new__(cls)
        sb.client = client
        sb._box = client.get(session_id)
        sb.template = sb._box.template
        sb.default_seed = None
        sb.disk_quota = None
        sb.shared_memory = None
        sb.egress_policy = getattr(sb._box, "egress", None) or Egress.none()
        return sb

    def _live(self):
        if self._box is None:
            raise InvalidArgument("the sandbox is not running: use it in a `with` block or call start()")
        return self._box

    @property
    def session_id(self) -> str:
        return self._live().id

    sandbox_id = session_id

    @property
    def platform(self) -> str:
        """What the sandbox runs on: "kvm" or "systrap" (docs/platforms.md)."""
        return self._live().platform

    @property
    def warm_hit(self) -> bool:
        """Whether the sandbox was served from the template's pool of ready clones."""
        return self._live().warm_hit

    # work
    def exec(
        self,
        command: str | None = None,
        *,
        code: str | None = None,
        timeout_seconds: float = 60.0,
        seed: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
    ) -> ExecResult:
        """Run a shell `command` or Python `code` (in the sandbox's persistent interpreter)."""
        if seed is None:
            seed = self.default_seed
        check_exec_args(code, command, timeout_seconds, seed)  # bad input raises before anything runs
        return self.client.exec(
            self._live(), code=code, command=command, timeout=timeout_seconds, seed=seed, env=env, cwd=cwd
        )

    def upload_bytes(self, path: str, data: bytes) -> None:
        """Write `data` to `path` in the sandbox, byte-exact (anywhere in a writable root; where
        the root is read-only, only under /tmp, /work, /dev/shm and a baked image's HOME; at most
        256 MiB, over HTTP the server's --max-upload)."""
        self.client.upload(self._live(), path, data)

    def download(self, path: str) -> bytes:
        """Read `path` from the sandbox, byte-exact: a regular file of at most the client's
        max_download (256 MiB unless set; `EmbeddedClient(max_download=)`, COLLIMATE_MAX_DOWNLOAD,
        `collimate serve --max-download`). Anything else (a FIFO, a device, a directory, a larger
        file) raises InvalidArgument at once, and the sandbox goes on."""
        return self.client.download(self._live(), path)

    def disk_usage(self) -> dict | None:
        """What /tmp and /work hold together and their quota: bytes, inodes,
        quota_bytes, quota_inodes (None where the host gives no quotas)."""
        return self.client.disk_usage(self._live())

    def reset(self) -> None:
        """Return to the pristine template (memory, files, registers), keeping the same id."""
        self.client.reset(self._live())

    def fork_group(self, width: int, *, seed: str | None = None, egress: Any = None) -> "ForkGroup":
        """Fork this live sandbox into `width` children that inherit its memory and files.

        The children inherit its egress policy; `egress=` may only narrow it (a wider policy
        raises InvalidArgument before anything is forked)."""
        base = fresh_seed() if seed is None else parse_seed(seed).hex()
        policy = self.egress_policy
        if egress is not None:
            policy = coerce_egress(egress)
            policy.check_narrower(self.egress_policy, "fork_group(egress=...)")
        if egress is None:
            boxes = self.client.fork(self._live(), width)
        else:
            boxes = self.client.fork(self._live(), width, egress=policy)
        return ForkGroup(self.client, boxes, base, self.template, policy)

    # network
    @property
    def egress(self) -> Egress:
        """This sandbox's network policy."""
        return self.egress_policy

    def set_egress(self, egress: Any) -> None:
        """Change this live sandbox's network policy; its open connections the new policy
        forbids are reset (the guest reads ECONNRESET). Its later forks start from this one.
        A fork's ceiling is its policy when it was forked: it may narrow below it and widen
        back up to it, never beyond (InvalidArgument says what the ceiling is)."""
        policy = coerce_egress(egress)
        self.client.set_egress(self._live(), policy)
        self.egress_policy = policy

    def egress_log(self) -> list[dict]:
        """This sandbox's connection attempts and DNS answers, oldest first: dicts with seq (the
        entry's place since the sandbox started), time, pid (the guest process), kind ("connect",
        "udp" or "dns"), name, address, port, rule (the one that matched), verdict ("allowed",
        "denied", "nxdomain", "reset", "failed", "capped"), detail, bytes_out, bytes_in, open.
        The log keeps the newest 10,000 entries: the result's `dropped` says how many older ones
        it no longer holds."""
        return self.client.egress_log(self._live())

    def __repr__(self) -> str:
        state = self._box.id if self._box is not None else "not started"
        return f"Sandbox({self.template!r}, {state})"


Session = Sandbox


class ForkGroup:
    """`width` live children of one sandbox. A context manager: leaving destroys every child.

    Strict width: `map` returns all results or raises; a partial group is never returned.
    """

    def __init__(self, client: Any, boxes: list, base_seed: str, template: str, egress: Any = None):
        self.client = client
        self.base_seed = base_seed
        seeds = group_seeds(base_seed, len(boxes))
        self.children: list[Sandbox] = []
        for box, s in zip(boxes, seeds):
            child = Sandbox.__new__(Sandbox)
            child.client, child._box, child.template, child.default_seed = client, box, template, s
            child.disk_quota = None
            child.shared_memory = None
            child.egress_policy = coerce_egress(egress)
            self.children.append(child)
        self._lock = threading.Lock()

    def __len__(self) -> int:
        return len(self.children)

    def __iter__(self):
        return iter(self.children)

    def __getitem__(self, i: int) -> Sandbox:
        return self.children[i]

    def __enter__(self) -> "ForkGroup":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        with self._lock:
            children, self.children = self.children, []
        for c in children:
            c.kill()

    def map(self, fn: Callable[[int, Sandbox], T], *, max_workers: int | None = None) -> list[T]:
        """Call fn(i, child) for every child in parallel; results in positional order.

        An infrastructure failure in any child (it died, the engine failed) tears the whole group
        down and raises GroupError; an exception of `fn` itself tears it down and propagates.
        """
        children = list(self.children)
        if not children:
            raise GroupError("the group is closed")
        workers = max_workers or min(len(children), 32)
        if not isinstance(workers, int) or workers < 1:
            raise InvalidArgument(f"map(max_workers=...) must be a positive int, not {max_workers!r}")
        # `workers` runners take the children in order, on threads kept from map to map (workers.py).
        futures: list[Future] = [Future() for _ in children]
        todo = iter(enumerate(children))
        take = threading.Lock()
        done = threading.Semaphore(0)

        def runner() -> None:
            while True:
                with take:
                    nxt = next(todo, None)
                if nxt is None:
                    return
                i, c = nxt
                try:
                    futures[i].set_result(fn(i, c))
                except BaseException as e:  # noqa: BLE001 - handed to the caller below
                    futures[i].set_exception(e)

        runners = min(workers, len(children))
        for _ in range(runners):
            _workers.submit(runner, done.release)
        for _ in range(runners):
            done.acquire()
        results: list[T] = []
        failure: BaseException | None = None
        for i, f in enumerate(futures):
            try:
                results.append(f.result())
            except BaseException as e:  # noqa: BLE001 - re-raised below after teardown
                if failure is None:
                    failure = e
                    failed_at = i
        if failure is not None:
            self.close()
            if isinstance(failure, CollimateError) and not isinstance(failure, GroupError):
                raise GroupError(
                    f"child {failed_at} of {len(children)} failed ({failure}); the group was torn down, resample it"
                ) from failure
            raise failure
        return results


class Env:
    """A scoped session at a declared width: `expect_width` on entry, `release_template` on exit."""

    def __init__(self, client: Any, template: str, width: int):
        if not isinstance(width, int) or width < 1:
            raise InvalidArgument(f"width must be a positive int, not {width!r}")
        self.client, self.template, self.width = client, template, width

    def __enter__(self) -> "Env":
        self.client.expect_width(self.template, self.width)
        return self

    def __exit__(self, *exc) -> None:
        self.client.release_template(self.template)

    def sandbox(self) -> Sandbox:
        return Sandbox(self.template, client=self.client)


def rollout_once(
    template: Any = "python",
    *,
    code: str | None = None,
    command: str | None = None,
    seed: str | None = None,
    client: Any = None,
    timeout_seconds: float = 60.0,
    env: dict[str, str] | None = None,
    disk_quota: int | str | None = None,
    egress: Any = None,
    shared_memory: int | str | None = None,
) -> ExecResult:
    """Fork an ephemeral clone, run once, discard it (`egress=`: its network policy)."""
    check_exec_args(code, command, timeout_seconds, seed)  # bad input raises before anything is forked
    with Sandbox(template, client=client, disk_quota=disk_quota, egress=egress, shared_memory=shared_memory) as sb:
        return sb.exec(command, code=code, timeout_seconds=timeout_seconds, seed=seed, env=env)
