"""The async twin (collimate_rl.aio): the same scenarios through the sync and the async surface.

Each row of SCENARIOS is one scenario written twice, as the product documents' snippets (shared/
seeds) and again with await; both run against the embedded engine and against `collimate serve`
on loopback (tests/test_http.py's Server), and must give the same, expected answer. Then the bounds
(256 concurrent rollout_once from one event loop, nothing leaked) and cancellation (a task
cancelled mid-exec frees its sandbox).
"""

from __future__ import annotations

import asyncio
import gc
import os
import sys
from pathlib import Path

import pytest

import collimate_core
import collimate_rl
from collimate_rl import aio
from hostprocs import alive

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

SEED = "c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00"
TESTS = "assert solve([3,1,2]) == [1,2,3]\n"
CODES = ["def solve(xs):\n    return sorted(xs)\n", "def solve(xs):\n    return xs\n", "import os; os._exit(0)",
         "while True: pass"]
BLOB = bytes(range(256)) * 4096 + b"\x00tail\xff"  # 1 MiB and a bit, every byte value


def test_the_alias_exposes_the_same_names():
    assert set(collimate_rl.aio.__all__) == set(collimate_core.aio.__all__)
    for name in ("connect", "Sandbox", "rollout_once", "Template", "grade", "grade_batch", "ForkGroup", "Env"):
        assert getattr(collimate_rl.aio, name) is getattr(collimate_core.aio, name)
        assert getattr(collimate_core.aio, name) is not getattr(collimate_core, name)
    assert collimate_rl.aio.HostLost is collimate_core.HostLost
    assert issubclass(collimate_core.HostLost, collimate_core.CollimateError)
    assert set(collimate_core.__all__) <= set(collimate_core.aio.__all__)


# --- the scenarios: (sync, async, expected) ---------------------------------------------------


def s_rollout_once(c):
    r = collimate_rl.rollout_once("python", code="print(sum(range(1000)))", seed=SEED, client=c)
    return r.ok, r.stdout.strip(), r.seed, r.seed_ack, r.host


async def a_rollout_once(c):
    r = await aio.rollout_once("python", code="print(sum(range(1000)))", seed=SEED, client=c)
    return r.ok, r.stdout.strip(), r.seed, r.seed_ack, r.host


def s_replay(c):
    code = "import random, os; print(random.random(), os.urandom(4).hex())"
    r1 = collimate_rl.rollout_once("python", code=code, client=c)
    r2 = collimate_rl.rollout_once("python", code=code, seed=r1.seed, client=c)
    r3 = collimate_rl.rollout_once("python", code=code, seed=SEED, client=c)
    return r1.stdout == r2.stdout, r1.stdout != r3.stdout, r3.stdout


async def a_replay(c):
    code = "import random, os; print(random.random(), os.urandom(4).hex())"
    r1 = await aio.rollout_once("python", code=code, client=c)
    r2 = await aio.rollout_once("python", code=code, seed=r1.seed, client=c)
    r3 = await aio.rollout_once("python", code=code, seed=SEED, client=c)
    return r1.stdout == r2.stdout, r1.stdout != r3.stdout, r3.stdout


def s_stateful(c):
    with collimate_rl.Sandbox("python", client=c) as sb:
        sb.upload_bytes("/work/task.py", b"import json; json.dump({'n': 7}, open('out.json', 'w'))\n")
        r = sb.exec(command="cd /work && python3 task.py", timeout_seconds=120)
        artifact = sb.download("/work/out.json") if r.ok else None
        sb.exec(code="state = 'kept'")
        kept = sb.exec(code="print(state)").stdout
        sb.reset()
        after = sb.exec(code="print('state' in globals())").stdout
        return r.ok, artifact, isinstance(sb.warm_hit, bool), kept, after


async def a_stateful(c):
    async with aio.Sandbox("python", client=c) as sb:
        await sb.upload_bytes("/work/task.py", b"import json; json.dump({'n': 7}, open('out.json', 'w'))\n")
        r = await sb.exec(command="cd /work && python3 task.py", timeout_seconds=120)
        artifact = await sb.download("/work/out.json") if r.ok else None
        await sb.exec(code="state = 'kept'")
        kept = (await sb.exec(code="print(state)")).stdout
        await sb.reset()
        after = (await sb.exec(code="print('state' in globals())")).stdout
        return r.ok, artifact, isinstance(sb.warm_hit, bool), kept, after


def s_group64(c):
    candidates = [f"print(prefix + {i})" if i % 3 else "raise SystemExit(1)" for i in range(64)]
    with c.session("python") as sess:
        sess.exec(code="prefix = 1000", timeout_seconds=120)
        with sess.fork_group(64, seed=SEED) as grp:
            def run(i, child):
                r = child.exec(code=candidates[i], timeout_seconds=120)
                return (1.0 if r.ok else 0.0), r.stdout, r.seed
            out = grp.map(run)
        return out, len(grp)


async def a_group64(c):
    candidates = [f"print(prefix + {i})" if i % 3 else "raise SystemExit(1)" for i in range(64)]
    async with c.session("python") as sess:
        await sess.exec(code="prefix = 1000", timeout_seconds=120)
        async with sess.fork_group(64, seed=SEED) as grp:
            async def run(i, child):
                r = await child.exec(code=candidates[i], timeout_seconds=120)
                return (1.0 if r.ok else 0.0), r.stdout, r.seed
            out = await grp.map(run)
            seen = {}
            async for i, res in grp.as_completed(run):  # the same group again, as each child finishes
                seen[i] = res
            assert [seen[i] for i in range(64)] == out
        return out, len(grp)


def group64_expected():
    seeds = collimate_rl.group_seeds(SEED, 64)
    out = [((1.0, f"{1000 + i}\n", seeds[i]) if i % 3 else (0.0, "", seeds[i])) for i in range(64)]
    return out, 0


def s_env_and_sync_fn(c):
    with c.env("python", width=4) as env:
        with env.sandbox() as sess:
            sess.exec(code="base = 5")
            with sess.fork_group(4) as grp:
                return grp.map(lambda i, child: child.exec(code=f"print(base * {i})").stdout)


async def a_env_and_sync_fn(c):
    async with c.env("python", width=4) as env:
        async with env.sandbox() as sess:
            await sess.exec(code="base = 5")
            async with sess.fork_group(4) as grp:
                # a plain function: it gets the sync children and runs on worker threads
                return await grp.map(lambda i, child: child.exec(code=f"print(base * {i})").stdout)


def s_grading(c):
    spec = collimate_rl.UnitTestReward(template="python", tests=TESTS, timeout_seconds=2)
    one = collimate_rl.grade(collimate_rl.extract_code("```python\n" + CODES[0] + "```"), spec, client=c)
    many = collimate_rl.grade_batch(CODES, spec, client=c, seed=SEED)
    return one.reward, [g.reward for g in many], {g.seed for g in many}


async def a_grading(c):
    spec = aio.UnitTestReward(template="python", tests=TESTS, timeout_seconds=2)
    one = await aio.grade(aio.extract_code("```python\n" + CODES[0] + "```"), spec, client=c)
    many = await aio.grade_batch(CODES, spec, client=c, seed=SEED)
    return one.reward, [g.reward for g in many], {g.seed for g in many}


def _errors_of(calls) -> list[str]:
    return [type(e).__name__ for e in calls]


def s_errors(c):
    seen = []
    for call in (
        lambda: collimate_rl.rollout_once("no-such-template", code="print(1)", client=c),
        lambda: collimate_rl.rollout_once("python", code="print(1)", seed="c0ffee", client=c),
        lambda: collimate_rl.rollout_once("python", client=c),
        lambda: collimate_rl.Sandbox.attach(c, "sbx_0000000000000000"),
    ):
        try:
            call()
        except collimate_rl.CollimateError as e:
            seen.append(e)
    with collimate_rl.Sandbox("python", client=c) as sb:
        try:
            sb.upload_bytes("/usr/bin/evil", b"x")
        except collimate_rl.CollimateError as e:
            seen.append(e)
        with sb.fork_group(2) as grp:
            def run(i, child):
                if i == 1:
                    child.kill()  # gone under the group: an infrastructure failure, never a reward
                return child.exec(code="print(1)").ok
            try:
                grp.map(run)
            except collimate_rl.CollimateError as e:
                seen.append(e)
            left = len(grp)
        user = sb.exec(code="raise ValueError('nope')")
    return _errors_of(seen), left, user.exit_code, "ValueError: nope" in user.stderr


async def a_errors(c):
    seen = []
    for call in (
        lambda: aio.rollout_once("no-such-template", code="print(1)", client=c),
        lambda: aio.rollout_once("python", code="print(1)", seed="c0ffee", client=c),
        lambda: aio.rollout_once("python", client=c),
        lambda: aio.Sandbox.attach(c, "sbx_0000000000000000"),
    ):
        try:
            await call()
        except aio.CollimateError as e:
            seen.append(e)
    async with aio.Sandbox("python", client=c) as sb:
        try:
            await sb.upload_bytes("/usr/bin/evil", b"x")
        except aio.CollimateError as e:
            seen.append(e)
        async with sb.fork_group(2) as grp:
            async def run(i, child):
                if i == 1:
                    await child.kill()
                return (await child.exec(code="print(1)")).ok
            try:
                await grp.map(run)
            except aio.CollimateError as e:
                seen.append(e)
            left = len(grp)
        user = await sb.exec(code="raise ValueError('nope')")
    return _errors_of(seen), left, user.exit_code, "ValueError: nope" in user.stderr


def s_timeouts(c):
    with collimate_rl.Sandbox("python", client=c) as sb:
        r = sb.exec(code="while True: pass", timeout_seconds=0.5)
        after = sb.exec(code="print('alive')")
        return r.timed_out, r.ok, r.exit_code, after.stdout


async def a_timeouts(c):
    async with aio.Sandbox("python", client=c) as sb:
        r = await sb.exec(code="while True: pass", timeout_seconds=0.5)
        after = await sb.exec(code="print('alive')")
        return r.timed_out, r.ok, r.exit_code, after.stdout


def s_files(c):
    with collimate_rl.Sandbox("python", client=c) as sb:
        sb.upload_bytes("/tmp/blob", BLOB)
        digest = sb.exec(code="import hashlib; print(hashlib.sha256(open('/tmp/blob','rb').read()).hexdigest())")
        sb.exec(code="open('/work/back', 'wb').write(open('/tmp/blob', 'rb').read()[::-1])")
        return digest.stdout.strip(), sb.download("/work/back") == BLOB[::-1]


async def a_files(c):
    async with aio.Sandbox("python", client=c) as sb:
        await sb.upload_bytes("/tmp/blob", BLOB)
        digest = await sb.exec(code="import hashlib; print(hashlib.sha256(open('/tmp/blob','rb').read()).hexdigest())")
        await sb.exec(code="open('/work/back', 'wb').write(open('/tmp/blob', 'rb').read()[::-1])")
        return digest.stdout.strip(), (await sb.download("/work/back")) == BLOB[::-1]


def s_templates(c):
    names = sorted(t.name for t in collimate_rl.Template.list(c))
    try:
        collimate_rl.Template.get(c, "no-such-template")
    except collimate_rl.NotFoundError as e:
        return names, type(e).__name__


async def a_templates(c):
    names = sorted(t.name for t in await aio.Template.list(c))
    try:
        await aio.Template.get(c, "no-such-template")
    except aio.NotFoundError as e:
        return names, type(e).__name__


class _Any:
    """Equal to anything: a part of an answer only checked equal across the two surfaces."""

    def __eq__(self, other) -> bool:
        return True


ANY = _Any()


def _expected(name: str, backend: str):
    import hashlib

    return {
        "rollout_once": (True, "499500", SEED, "verified", None),
        "replay": (True, True, ANY),  # r3's stdout: checked equal across the surfaces only
        "templates": (ANY, "NotFoundError"),
        "stateful": (True, b'{"n": 7}', True, "kept\n", "False\n"),
        "group64": group64_expected(),
        "env_and_sync_fn": ["0\n", "5\n", "10\n", "15\n"],
        "grading": (1.0, [1.0, 0.0, 0.0, 0.0], {SEED}),
        "errors": (["NotFoundError", "InvalidArgument", "InvalidArgument", "NotFoundError", "InvalidArgument",
                    "GroupError"], 0, 1, True),
        "timeouts": (True, False, 124, "alive\n"),
        "files": (hashlib.sha256(BLOB).hexdigest(), True),
    }[name]


SCENARIOS = {
    "rollout_once": (s_rollout_once, a_rollout_once),
    "replay": (s_replay, a_replay),
    "stateful": (s_stateful, a_stateful),
    "group64": (s_group64, a_group64),
    "env_and_sync_fn": (s_env_and_sync_fn, a_env_and_sync_fn),
    "grading": (s_grading, a_grading),
    "errors": (s_errors, a_errors),
    "timeouts": (s_timeouts, a_timeouts),
    "files": (s_files, a_files),
    "templates": (s_templates, a_templates),
}


@pytest.fixture(scope="module")
def embedded():
    c = collimate_core.EmbeddedClient(max_sandboxes=160)
    yield c
    c.close()


@pytest.fixture(scope="module")
def http_client(tmp_path_factory):
    from test_http import Server, _cli

    store = tmp_path_factory.mktemp("aio-keys") / "keys.json"
    key = _cli("keys", "--key-store", str(store), "create", "--tenant", "aio").strip()
    srv = Server(tmp_path_factory.mktemp("aio-srv"), store, "--max-sandboxes", "160")
    c = collimate_core.RemoteClient(key, srv.url)
    yield c
    c.close()
    srv.stop()


@pytest.mark.parametrize("backend", ["embedded", "http"])
@pytest.mark.parametrize("name", list(SCENARIOS))
def test_scenario_through_both_surfaces(name, backend, request):
    client = request.getfixturevalue("embedded" if backend == "embedded" else "http_client")
    sync_fn, async_fn = SCENARIOS[name]
    got_sync = sync_fn(client)

    async def run():
        async with aio.AsyncClient(client) as ac:  # the async surface over the same client
            return await async_fn(ac)

    got_async = asyncio.run(run())
    assert got_sync == got_async
    assert got_sync == _expected(name, backend)


def test_aio_connect_is_awaitable_and_a_context_manager(monkeypatch):
    monkeypatch.delenv("COLLIMATE_API_KEY", raising=False)

    async def run():
        client = await aio.connect()
        assert client.sync is collimate_rl.connect()  # the process's engine, shared
        async with aio.connect(limit=4) as small:
            assert small.limit == 4 and small.sync is client.sync
            r = await aio.rollout_once("python", code="print(2)", client=small)
        r2 = await aio.rollout_once("python", code="print(3)")  # no client: connect()'s
        return r.stdout, r2.stdout

    assert asyncio.run(run()) == ("2\n", "3\n")


def test_aio_template_bake_wait_and_session(tmp_path):
    root = os.environ.get("COLLIMATE_ROOTFS")
    if not root:
        pytest.skip("no python rootfs (set COLLIMATE_ROOTFS: python3 guest/rootfs/build.py)")
    from imagefixtures import Layer, busybox_layer, write_docker_save

    extra = Layer().dir("work").file("etc/motd", b"aio motd\n").bytes()
    image = tmp_path / "images" / "tool.tar"
    image.parent.mkdir()
    write_docker_save(image, [busybox_layer(Path(root) / "usr/bin/busybox"), extra],
                      {"Env": ["PATH=/bin"], "WorkingDir": "/work"}, repo_tags=["tool:1.0"])
    client = collimate_core.EmbeddedClient(cache=tmp_path)

    async def run():
        ac = aio.AsyncClient(client)
        handle = await aio.Template.bake(ac, name="tool", image=str(image), ready=aio.Ready(cmd="echo warm > /work/w"))
        status = await handle.wait(timeout=300)
        assert status.phase == "Live", status.log
        assert [t.name for t in await aio.Template.list(ac)] == ["tool"]
        async with ac.session(handle) as sess:
            r = await sess.exec(command="cat /etc/motd /work/w")
        await handle.delete()
        with pytest.raises(aio.NotFoundError):
            await aio.Template.get(ac, "tool")
        return r

    try:
        r = asyncio.run(run())
    finally:
        client.close()
    assert r.ok and r.stdout == "aio motd\nwarm\n", r


# --- bounds and leaks ----------------------------------------------------------------------------


def _descendants() -> int:
    """This process's descendant processes: zygotes, spare and recycled clones, sandboxes."""
    parents: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
            except OSError:
                continue
            parents.setdefault(int(stat.rsplit(")", 1)[1].split()[1]), []).append(int(d.name))
    todo, n = [os.getpid()], 0
    while todo:
        kids = parents.get(todo.pop(), [])
        n += len(kids)
        todo.extend(kids)
    return n


def _fds() -> int:
    gc.collect()  # descriptors of earlier tests' garbage go now, not in the middle of a count
    return len(os.listdir("/proc/self/fd"))


def test_256_concurrent_rollouts_from_one_loop_leak_nothing():
    fds, procs = _fds(), _descendants()
    client = collimate_core.EmbeddedClient()
    live: list[int] = []

    async def run():
        async with aio.AsyncClient(client, limit=16) as ac:
            async def one(i):
                r = await aio.rollout_once("python", code=f"print({i} * 2)", client=ac)
                live.append(client.usage().live_sandboxes)
                return r

            rs = await asyncio.gather(*[one(i) for i in range(256)])
            return rs, await ac.usage()

    rs, usage = asyncio.run(run())
    assert [r.stdout for r in rs] == [f"{i * 2}\n" for i in range(256)]
    assert all(r.ok and r.seed_ack == "verified" for r in rs)
    assert usage.sandboxes == 256 and usage.execs == 256
    assert max(live) <= 16  # one worker thread per sandbox: the pool's bound is the sandboxes' bound
    client.close()
    assert _descendants() == procs
    assert _fds() == fds


def _utime(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[11])




async def _until(cond, what: str):
    for _ in range(2000):  # a bound on the wait, not a timing assertion
        if cond():
            return
        await asyncio.sleep(0.01)
    raise AssertionError(f"never: {what}")


def test_cancelling_a_task_mid_exec_frees_its_sandbox(embedded):
    before = embedded.usage().live_sandboxes

    async def run():
        ac = aio.AsyncClient(embedded)
        # 1. a cancelled `await sb.exec(...)` of a guest that would spin for ten minutes
        sb = await aio.Sandbox("python", client=ac).start()
        pid = sb.sync._box.vm.pid
        busy = _utime(pid)
        task = asyncio.create_task(sb.exec(code="while True: pass", timeout_seconds=600))
        await _until(lambda: _utime(pid) > busy + 20, "the guest spinning")  # the exec is in flight
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert sb.sync._box is None and not alive(pid)
        with pytest.raises(aio.InvalidArgument, match="not running"):
            await sb.exec(code="print(1)")

        # 2. a cancelled `async with Sandbox(...)` body mid-exec
        pids: list[int] = []

        async def episode():
            async with aio.Sandbox("python", client=ac) as s:
                pids.append(s.sync._box.vm.pid)
                await s.exec(code="while True: pass", timeout_seconds=600)

        task = asyncio.create_task(episode())
        await _until(lambda: pids and _utime(pids[0]) > 20, "the second guest spinning")
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert not alive(pids[0])

        # 3. a cancelled rollout_once, and a cancelled map over a group
        task = asyncio.create_task(aio.rollout_once("python", code="while True: pass", timeout_seconds=600, client=ac))
        await _until(lambda: embedded.usage().live_sandboxes > before, "the rollout's sandbox")
        await asyncio.sleep(0.3)  # into its exec (if not, the cancel drops it before: freed all the same)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert embedded.usage().live_sandboxes == before

        async with ac.session("python") as sess:
            grp = await sess.fork_group(4)
            kids = [c.sync._box.vm.pid for c in grp]

            async def spin(i, child):
                return await child.exec(code="while True: pass", timeout_seconds=600)

            task = asyncio.create_task(grp.map(spin))
            await _until(lambda: all(_utime(p) > 10 for p in kids), "the children spinning")
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            assert len(grp) == 0 and not any(alive(p) for p in kids)
            assert (await sess.exec(code="print('parent fine')")).stdout == "parent fine\n"
        await ac.close()

    asyncio.run(run())
    assert embedded.usage().live_sandboxes == before
