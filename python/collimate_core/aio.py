"""`collimate_core.aio` (also `collimate_rl.aio`): the SDK surface, awaited.

The same names as the sync package, as `redis.asyncio` mirrors `redis`: `connect`, `Sandbox`
(= `Session`), `ForkGroup`, `Env`, `rollout_once`, `Template`, `grade`, `grade_batch`, and every
non-IO name (errors, `ExecResult`, `UnitTestReward`, `extract_code`, seeds) re-exported as is.

    async with aio.connect() as client:
        r = await aio.rollout_once("python", code="print(1)", client=client)
        async with client.session("python") as sess:
            await sess.exec(code="prefix = 1")
            async with sess.fork_group(64) as grp:
                rewards = await grp.map(run)          # run: async def run(i, child) or a plain function
                async for i, reward in grp.as_completed(run): ...

One implementation under both surfaces. Every async method runs the sync implementation's call
(`_session.Sandbox.exec`, `EmbeddedClient.fork`, `grade_batch`, ...) on a bounded pool of worker
threads owned by the async client, and awaits it; the sync API never starts an event loop.

Why threads, and why that is the right shape for the embedded engine: each embedded call is one
blocking request to a VMM process over a Unix socket, made by Rust code that releases the GIL for
its whole duration (crates/py). There is no socket the event loop could poll instead: the request,
the guest's run and the reply are one call into the engine. A worker thread blocked in that call
costs no CPU and holds no GIL, so N threads give N execs in flight, and the sync code stays the
single source of the semantics (strict group width, teardown, error mapping, metering).

The HTTP remote client goes through the same threads: its request building lives inline in
`RemoteClient`'s methods (sdk/remote.py), and sharing it with an `httpx.AsyncClient` path would mean
restructuring that module; a thread per in-flight request over the sync client's pooled
connections keeps one implementation of the wire format. The Ray client (`connect(ray=...)`) is the
same: its calls are `ray.get` on host actors.

Bounds: at most `limit` (default 32, `connect(limit=)`) calls of one client run at once; the rest
wait in the pool's queue, holding no descriptor. `rollout_once` runs its fork, exec and teardown as
one job, so 256 concurrent rollouts hold at most `limit` sandboxes at a time.

Cancellation: a task that is cancelled destroys what it owns before the CancelledError reaches it.
A cancelled `Sandbox` start or `fork_group` destroys what the worker made; a cancelled `exec`
(or `rollout_once`, or `map`/`as_completed` of a group) stops the guest at once (on the embedded
engine and on Ray hosts: SIGKILL of its VMM process through a pidfd taken when the sandbox was made)
and destroys the sandbox. Over HTTP the server finishes the exec first (the delete waits for it, at
most the exec's timeout). A cancelled `grade`/`grade_batch` waits for the candidates in flight
(each bounded by its timeout); their sandboxes are gone when the CancelledError arrives.
"""

from __future__ import annotations

import asyncio
import functools
import inspect
import os
import signal
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator, Awaitable, Callable, Sequence

import collimate_core as _sync
from collimate_core import *  # noqa: F403 - the non-IO names, as the sync package has them
from collimate_core import __all__ as _sync_all
from collimate_core.sdk import session as _session
from collimate_core.sdk.errors import CollimateError, GroupError, InvalidArgument
from collimate_core.sdk.egress import coerce as _coerce_egress
from collimate_core.sdk.embedded import check_exec_args
from collimate_core.sdk.results import ExecResult

DEFAULT_LIMIT = 32

__all__ = sorted(
    {n for n in _sync_all}
    | {"AsyncClient", "AsyncTemplateHandle", "DEFAULT_LIMIT"}
)


# --- running the sync implementation on worker threads -----------------------------------------


class _Interrupt:
    """Stops a sandbox's in-flight call from any thread without waiting for it.

    On the embedded engine (and a Ray host's), an exec is a Rust call holding the Vm's lock for
    the guest's whole run, so nothing that takes that lock (destroy, pid) can interrupt it. A pidfd
    of the VMM process, opened while the sandbox is idle, can: SIGKILL ends the run, the exec
    raises SandboxDied, and the sandbox's teardown reaps it. A pidfd (not the pid) so that a
    process already gone can never be confused with a later one of the same pid.
    """

    def __init__(self, client: Any, box: Any):
        self._client, self._box = client, box
        self._fd: int | None = None
        self._closed = False
        self._lock = threading.Lock()
        vm = getattr(box, "vm", None)
        if vm is not None:
            try:
                self._fd = os.pidfd_open(vm.pid)
            except (OSError, CollimateError):
                self._fd = None  # already gone: nothing to stop

    def __call__(self) -> None:
        with self._lock:
            if self._closed:
                return  # the sandbox is gone: nothing in flight
            fd = self._fd
            if fd is not None:
                try:
                    signal.pidfd_send_signal(fd, signal.SIGKILL)
                except OSError:
                    pass
                return
        abort = getattr(self._client, "abort", None)
        if abort is not None:  # a Ray client: the host actor kills it (its own pidfd)
            threading.Thread(target=_quietly, args=(abort, self._box), daemon=True, name="collimate-abort").start()
        # Over HTTP there is nothing to interrupt: the server's delete waits for the exec.

    def close(self) -> None:
        with self._lock:
            fd, self._fd, self._closed = self._fd, None, True
        if fd is not None:
            os.close(fd)


def _quietly(fn: Callable, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - best effort: the sandbox's teardown reports what matters
        pass


def _retrieved(fut: asyncio.Future) -> None:
    if not fut.cancelled():
        fut.exception()  # a failure after its awaiter left is handled by the caller, not logged


def _wrap(cf) -> asyncio.Future:
    fut = asyncio.wrap_future(cf)
    fut.add_done_callback(_retrieved)
    return fut


async def _settle(cf) -> Any:
    """Wait for a call that has started (a concurrent future, or its asyncio wrapper), ignoring
    further cancellation; its result, or None if it raised."""
    fut = cf if isinstance(cf, asyncio.Future) else _wrap(cf)
    while not fut.done():
        try:
            await asyncio.shield(fut)
        except asyncio.CancelledError:
            continue
        except BaseException:  # noqa: BLE001 - the call's own failure: nothing was made
            break
    return None if fut.cancelled() or fut.exception() is not None else fut.result()


class AsyncClient:
    """The async surface of a sync client (`EmbeddedClient`, `RemoteClient`, `RayClient`).

    Its calls run on at most `limit` worker threads. `async with` closes the pool, and the sync
    client too when this object made it (`connect()` shares the process's engine: not closed).
    """

    def __init__(self, sync: Any, *, limit: int = DEFAULT_LIMIT, owns: bool = False, shared: bool = False):
        if isinstance(limit, bool) or not isinstance(limit, int) or limit < 1:
            raise InvalidArgument(f"limit must be a positive int, not {limit!r}")
        self.sync = sync
        self.limit = limit
        self._owns = owns
        self._shared = shared  # the one wrapper of a sync client (_async_client): never shut down
        self._pool = ThreadPoolExecutor(max_workers=limit, thread_name_prefix="collimate-aio")

    async def _call(self, fn: Callable, *args: Any, interrupt: Callable[[], None] | None = None,
                    undo: Callable[[Any], None] | None = None, **kw: Any) -> Any:
        """`fn(*args, **kw)` on a worker thread. If the awaiting task is cancelled while it runs:
        `interrupt()` (stop it now), wait for it to end, `undo(result)` (destroy what it made),
        then re-raise the CancelledError. A call still queued is just dropped."""
        cf = self._pool.submit(functools.partial(fn, *args, **kw))
        fut = _wrap(cf)
        try:
            return await asyncio.shield(fut)
        except asyncio.CancelledError:
            if cf.cancel():
                raise
            if interrupt is not None:
                interrupt()
            made = await _settle(fut)
            if made is not None and undo is not None:
                await _settle(self._pool.submit(_quietly, undo, made))
            raise

    # the client's own surface
    async def usage(self, since: float | None = None, until: float | None = None):
        return await self._call(self.sync.usage, since, until)

    async def expect_width(self, template: str, width: int) -> None:
        await self._call(self.sync.expect_width, template, width)

    async def release_template(self, template: str) -> None:
        await self._call(self.sync.release_template, template)

    def session(self, handle: Any = "python", *, disk_quota: int | str | None = None, egress: Any = None,
                shared_memory: int | str | None = None) -> "Sandbox":
        from collimate_core.sdk.embedded import _template_name

        return Sandbox(_template_name(handle), client=self, disk_quota=disk_quota, egress=egress,
                       shared_memory=shared_memory)

    def env(self, ref: Any, width: int = 1) -> "Env":
        from collimate_core.sdk.embedded import _template_name

        return Env(self, _template_name(ref), width)

    def __getattr__(self, name: str) -> Any:
        # Anything else the sync client has (placement_log, hosts, templates, images ...), as is.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.sync, name)

    async def close(self) -> None:
        if self._owns:
            await self._call(self.sync.close)
        if not self._shared:
            self._pool.shutdown(wait=False)

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    def __repr__(self) -> str:
        return f"AsyncClient({self.sync!r}, limit={self.limit})"


_wrapped: "weakref.WeakKeyDictionary[Any, AsyncClient]" = weakref.WeakKeyDictionary()
_wrapped_lock = threading.Lock()


def _async_client(client: Any) -> AsyncClient:
    """The AsyncClient for `client`: itself, the shared one of a sync client, or connect()'s."""
    if isinstance(client, AsyncClient):
        return client
    if client is None:
        client = _sync.connect()
    with _wrapped_lock:
        a = _wrapped.get(client)
        if a is None:
            a = _wrapped[client] = AsyncClient(client, shared=True)
        return a


def _sync_client(client: Any) -> Any:
    return client.sync if isinstance(client, AsyncClient) else client


class _Pending:
    """Both `await x` and `async with x as y`: what `connect()` and `fork_group()` return."""

    def __init__(self, make: Callable[[], Awaitable[Any]]):
        self._make = make
        self._made: Any = None

    def __await__(self):
        return self._make().__await__()

    async def __aenter__(self) -> Any:
        self._made = await self._make()
        return await self._made.__aenter__()

    async def __aexit__(self, *exc) -> None:
        await self._made.__aexit__(*exc)


def connect(api_key: str | None = None, *, base_url: str | None = None, ray: str | None = None,
            limit: int = DEFAULT_LIMIT, platform: str | None = None) -> _Pending:
    """`await aio.connect(...)` or `async with aio.connect(...) as client`: an AsyncClient over
    what the sync `connect` returns for the same arguments (the embedded engine without a key,
    the control plane with one, a Ray cluster with `ray=` or COLLIMATE_RAY_ADDRESS; `platform=` as
    there)."""

    async def make() -> AsyncClient:
        kw: dict[str, Any] = {"base_url": base_url}
        if ray is not None:
            kw["ray"] = ray
        if platform is not None:
            kw["platform"] = platform
        loop = asyncio.get_running_loop()
        # ray.init and a key's first client are blocking; not on the loop's thread.
        sync = await loop.run_in_executor(None, functools.partial(_sync.connect, api_key, **kw))
        if limit == DEFAULT_LIMIT:
            return _async_client(sync)
        return AsyncClient(sync, limit=limit)

    return _Pending(make)


# --- sandboxes, groups, envs -------------------------------------------------------------------


class Sandbox:
    """`collimate_core.Sandbox`, awaited: `async with Sandbox("python", client=c) as sb`."""

    def __init__(self, template: Any = "python", *, client: Any = None, default_seed: str | None = None,
                 disk_quota: int | str | None = None, egress: Any = None, shared_memory: int | str | None = None):
        self.client = _async_client(client)
        self.sync = _session.Sandbox(template, client=self.client.sync, default_seed=default_seed,
                                     disk_quota=disk_quota, egress=egress, shared_memory=shared_memory)
        self._interrupt: _Interrupt | None = None

    @classmethod
    def _adopt(cls, client: AsyncClient, sync_sb: Any) -> "Sandbox":
        sb = cls.__new__(cls)
        sb.client, sb.sync = client, sync_sb
        sb._interrupt = _Interrupt(client.sync, sync_sb._box)
        return sb

    @property
    def template(self) -> str:
        return self.sync.template

    @property
    def default_seed(self) -> str | None:
        return self.sync.default_seed

    # lifecycle
    async def start(self) -> "Sandbox":
        if self.sync._box is None:
            def start() -> Any:
                self.sync.start()
                self._interrupt = _Interrupt(self.client.sync, self.sync._box)
                return self

            await self.client._call(start, undo=lambda sb: _run_kill(sb))
        return self

    async def __aenter__(self) -> "Sandbox":
        return await self.start()

    async def __aexit__(self, *exc) -> None:
        await self.kill()

    async def kill(self) -> None:
        """Destroy the sandbox now (idempotent); not interrupted by a cancellation."""
        if self.sync._box is None:
            return
        cf = self.client._pool.submit(_run_kill, self)
        await _settle(cf)
        if cf.exception() is not None:
            raise cf.exception()

    close = kill

    @classmethod
    async def attach(cls, client: Any, session_id: str) -> "Sandbox":
        """Re-adopt a live sandbox by id."""
        a = _async_client(client)
        return await a._call(lambda: cls._adopt(a, _session.Sandbox.attach(a.sync, session_id)),
                             undo=lambda sb: sb._interrupt.close())

    @property
    def session_id(self) -> str:
        return self.sync.session_id

    sandbox_id = session_id

    @property
    def warm_hit(self) -> bool:
        return self.sync.warm_hit

    @property
    def platform(self) -> str:
        """What the sandbox runs on: "kvm" or "systrap"."""
        return self.sync.platform

    # work
    async def exec(self, command: str | None = None, *, code: str | None = None, timeout_seconds: float = 60.0,
                   seed: str | None = None, env: dict[str, str] | None = None, cwd: str | None = None) -> ExecResult:
        """Run a shell `command` or Python `code`. Cancelled, it stops the guest and destroys the
        sandbox (see the module's docs)."""
        check_exec_args(code, command, timeout_seconds, seed if seed is not None else self.sync.default_seed)
        self.sync._live()
        try:
            return await self.client._call(self.sync.exec, command, code=code, timeout_seconds=timeout_seconds,
                                           seed=seed, env=env, cwd=cwd, interrupt=self._stop)
        except asyncio.CancelledError:
            await self.kill()
            raise

    def _stop(self) -> None:
        if self._interrupt is not None:
            self._interrupt()

    async def upload_bytes(self, path: str, data: bytes) -> None:
        await self.client._call(self.sync.upload_bytes, path, data)

    async def download(self, path: str) -> bytes:
        return await self.client._call(self.sync.download, path)

    async def disk_usage(self) -> dict | None:
        return await self.client._call(self.sync.disk_usage)

    async def reset(self) -> None:
        await self.client._call(self.sync.reset)

    # network
    @property
    def egress(self) -> Any:
        """This sandbox's network policy (an Egress)."""
        return self.sync.egress

    async def set_egress(self, egress: Any) -> None:
        """Change the live sandbox's network policy; connections it forbids are reset."""
        await self.client._call(self.sync.set_egress, egress)

    async def egress_log(self) -> list[dict]:
        """The sandbox's connection attempts and DNS answers (see `Sandbox.egress_log`)."""
        return await self.client._call(self.sync.egress_log)

    def fork_group(self, width: int, *, seed: str | None = None, egress: Any = None) -> _Pending:
        """`async with sb.fork_group(n) as grp` (or `grp = await sb.fork_group(n)`): `n` live
        children; leaving the block destroys every child."""

        async def make() -> ForkGroup:
            def fork() -> ForkGroup:
                return ForkGroup(self.client, self.sync.fork_group(width, seed=seed, egress=egress))

            return await self.client._call(fork, undo=lambda g: g._sync.close())

        return _Pending(make)

    def __repr__(self) -> str:
        return f"aio.{self.sync!r}"


def _run_kill(sb: Sandbox) -> None:
    """Destroy a sandbox (a worker thread's job) and drop its pidfd."""
    try:
        sb.sync.kill()
    finally:
        if sb._interrupt is not None:
            sb._interrupt.close()


Session = Sandbox


def _is_async(fn: Callable) -> bool:
    while isinstance(fn, functools.partial):
        fn = fn.func
    return inspect.iscoroutinefunction(fn) or inspect.iscoroutinefunction(getattr(fn, "__call__", None))


class ForkGroup:
    """`collimate_core.ForkGroup`, awaited. Strict width: `map` returns every result or raises.

    `fn(i, child)` for `map` and `as_completed`: an `async def` gets the async children and runs
    on the event loop; a plain function gets the sync children (`collimate_core.Sandbox`) and runs
    on the client's worker threads, exactly as the sync `ForkGroup.map` runs it.
    """

    def __init__(self, client: AsyncClient, sync_group: Any):
        self.client = client
        self._sync = sync_group
        self.base_seed = sync_group.base_seed
        self.children = [Sandbox._adopt(client, c) for c in sync_group.children]

    def __len__(self) -> int:
        return len(self.children)

    def __iter__(self):
        return iter(self.children)

    def __getitem__(self, i: int) -> Sandbox:
        return self.children[i]

    async def __aenter__(self) -> "ForkGroup":
        return self

    async def __aexit__(self, *exc) -> None:
        await self.close()

    async def close(self) -> None:
        """Destroy every child (not interrupted by a cancellation)."""
        children, self.children = self.children, []
        self._sync.children = []
        if children:
            await _settle(self.client._pool.submit(lambda: [_run_kill(c) for c in children]))

    def _stop_all(self, children: list[Sandbox]) -> None:
        for c in children:
            c._stop()

    def _start(self, fn: Callable) -> tuple[list[Sandbox], list[asyncio.Task]]:
        children = list(self.children)
        if not children:
            raise GroupError("the group is closed")
        if _is_async(fn):
            tasks = [asyncio.ensure_future(fn(i, c)) for i, c in enumerate(children)]
        else:
            tasks = [asyncio.ensure_future(self.client._call(fn, i, c.sync, interrupt=c._stop))
                     for i, c in enumerate(children)]
        return children, tasks

    async def _fail(self, children: list[Sandbox], tasks: list[asyncio.Task], failed_at: int | None,
                    failure: BaseException | None) -> None:
        """Stop every child still running, wait for its task, tear the group down, and raise the
        sync map's verdict for `failure` (GroupError for an infrastructure failure; HostLost,
        already a group verdict, as is)."""
        self._stop_all(children)
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.close()
        if failure is None:
            return
        if isinstance(failure, CollimateError) and not isinstance(failure, GroupError):
            raise GroupError(
                f"child {failed_at} of {len(children)} failed ({failure}); the group was torn down, resample it"
            ) from failure
        raise failure

    async def map(self, fn: Callable[[int, Any], Any]) -> list[Any]:
        """fn(i, child) for every child concurrently; results in positional order. A failure of
        any child tears the whole group down (GroupError for an infrastructure failure, else the
        exception of `fn`); a cancelled map stops every child and tears the group down."""
        children, tasks = self._start(fn)
        try:
            await asyncio.wait(tasks, return_when=asyncio.FIRST_EXCEPTION)
        except asyncio.CancelledError:
            await self._fail(children, tasks, None, None)
            raise
        for i, t in enumerate(tasks):
            if t.done() and not t.cancelled() and t.exception() is not None:
                await self._fail(children, tasks, i, t.exception())
        return [t.result() for t in tasks]

    async def as_completed(self, fn: Callable[[int, Any], Any]) -> AsyncIterator[tuple[int, Any]]:
        """`async for i, result in grp.as_completed(fn)`: each child's result as it finishes. A
        failure tears the group down and raises (after the results already yielded); leaving the
        loop early stops the children still running and tears the group down."""
        children, tasks = self._start(fn)
        index = {t: i for i, t in enumerate(tasks)}
        pending = set(tasks)
        try:
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
                for t in sorted(done, key=index.__getitem__):
                    if t.exception() is not None:
                        await self._fail(children, tasks, index[t], t.exception())
                    yield index[t], t.result()
        finally:
            if pending:  # the consumer left early, or was cancelled
                await self._fail(children, tasks, None, None)


class Env:
    """`collimate_core.Env`, awaited: `async with client.env(ref, width=N) as env`."""

    def __init__(self, client: Any, template: str, width: int):
        self.client = _async_client(client)
        self.sync = _session.Env(self.client.sync, template, width)
        self.template, self.width = template, width

    async def __aenter__(self) -> "Env":
        await self.client._call(self.sync.__enter__)
        return self

    async def __aexit__(self, *exc) -> None:
        await _settle(self.client._pool.submit(self.sync.__exit__, None, None, None))

    def sandbox(self) -> Sandbox:
        return Sandbox(self.template, client=self.client)


async def rollout_once(template: Any = "python", *, code: str | None = None, command: str | None = None,
                       seed: str | None = None, client: Any = None, timeout_seconds: float = 60.0,
                       env: dict[str, str] | None = None, disk_quota: int | str | None = None,
                       egress: Any = None, shared_memory: int | str | None = None) -> ExecResult:
    """Fork an ephemeral clone, run once, discard it: the sync `rollout_once` on one worker
    thread (so a sandbox exists only while a thread works on it). Cancelled, it stops the guest
    and destroys the clone."""
    check_exec_args(code, command, timeout_seconds, seed)
    _coerce_egress(egress)  # bad rules raise before anything is forked
    a = _async_client(client)
    made: list[_Interrupt] = []
    cancelled = threading.Event()

    def run() -> ExecResult | None:
        sb = _session.Sandbox(template, client=a.sync, disk_quota=disk_quota, egress=egress, shared_memory=shared_memory)
        with sb:
            made.append(_Interrupt(a.sync, sb._box))
            try:
                if cancelled.is_set():  # cancelled while the clone was being made: do not run
                    return None
                return sb.exec(command, code=code, timeout_seconds=timeout_seconds, seed=seed, env=env)
            finally:
                made[0].close()

    def interrupt() -> None:
        cancelled.set()  # before looking at `made`: run() looks at it after appending
        if made:
            made[0]()

    return await a._call(run, interrupt=interrupt)


# --- templates and grading ---------------------------------------------------------------------


class AsyncTemplateHandle:
    """A `TemplateHandle`, awaited: `await handle.wait(timeout)`, `await handle.status()`."""

    def __init__(self, client: AsyncClient, handle: Any):
        self.client, self.sync = client, handle
        self.name, self.version = handle.name, handle.version

    @property
    def id(self) -> str:
        return f"{self.name}@v{self.version}"

    async def status(self):
        return await self.client._call(self.sync.status)

    async def wait(self, timeout: float | None = None):
        return await self.client._call(self.sync.wait, timeout)

    async def delete(self) -> None:
        await self.client._call(self.sync.delete)

    def __repr__(self) -> str:
        return f"aio.{self.sync!r}"


class Template:
    """`collimate_core.Template`, awaited: `handle = await Template.bake(client, name=..., image=...)`."""

    @staticmethod
    async def bake(client: Any, name: str, image: Any, ready: Any = None, width: int = 1,
                   **kw: Any) -> AsyncTemplateHandle:
        a = _async_client(client)
        h = await a._call(_sync.Template.bake, a.sync, name, image, ready, width, **kw)
        return AsyncTemplateHandle(a, h)

    @staticmethod
    async def list(client: Any = None, **kw: Any) -> list:
        a = _async_client(client)
        return await a._call(_sync.Template.list, a.sync, **kw)

    @staticmethod
    async def get(client: Any, name: str, **kw: Any) -> AsyncTemplateHandle:
        a = _async_client(client)
        return AsyncTemplateHandle(a, await a._call(_sync.Template.get, a.sync, name, **kw))

    @staticmethod
    async def delete(client: Any, name: str, **kw: Any) -> None:
        a = _async_client(client)
        await a._call(_sync.Template.delete, a.sync, name, **kw)


async def grade(code: str, spec: Any, *, client: Any = None, seed: str | None = None):
    """`collimate_core.grade`, awaited (on a worker thread)."""
    a = _async_client(client)
    return await a._call(_sync.grade, code, spec, client=a.sync, seed=seed)


async def grade_batch(codes: Sequence[str], spec: Any, *, client: Any = None, seed: str | None = None,
                      max_workers: int | None = None) -> list:
    """`collimate_core.grade_batch`, awaited: the group is graded by the sync implementation's
    own workers, driven from one worker thread of the client."""
    a = _async_client(client)
    return await a._call(_sync.grade_batch, list(codes), spec, client=a.sync, seed=seed, max_workers=max_workers)
