"""Issue 5, shown: the Pro quickstart's GRPO rollout loop as written, a GRPO-shaped end-to-end
group of 64 with a shared prefix, a child killed mid-run failing the whole group and leaving
nothing behind, the RL quickstart's Sandbox snippet and `client.env(...)` / `client.usage()` as
written, `Sandbox.attach` from another thread, and bursts beyond capacity that wait.

Caller-supplied names in the snippets (task_source, sample_batch, update_policy, handle, the
"swe-rollout" template that Template.bake would make) are defined here; the snippets' own lines
are verbatim.
"""

from __future__ import annotations

import glob
import json
import os
import select
import signal
import tempfile
import threading
import time
from pathlib import Path

import pytest

from collimate_rl import CapacityError, GroupError, NotFoundError, Sandbox, connect
from collimate_core import EmbeddedClient, Vm
from collimate_core.templates.catalog import bake_python
from hostprocs import GONE

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

WIDTH = 64


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    c = connect()  # reads COLLIMATE_API_KEY: none, so the embedded engine on this host
    yield c


def drain(c) -> None:
    """Wait until sandboxes already destroyed are torn down (or reset and recycled)."""
    c._reaper.submit(lambda: None).result()


def eventually(check, timeout=10.0, what=""):
    deadline = time.monotonic() + timeout
    while True:
        value = check()
        if value or time.monotonic() > deadline:
            assert value, what() if callable(what) else (what or check)
            return value
        time.sleep(0.02)


# --- host bookkeeping: what "nothing left behind" is checked against ---------------------------


def runtime_dir() -> Path:
    """Where VMM processes keep their private writable directories (guestos::persist::runtime_dir)."""
    if os.environ.get("COLLIMATE_RUNTIME_DIR"):
        return Path(os.environ["COLLIMATE_RUNTIME_DIR"])
    if os.path.isdir("/dev/shm"):
        return Path("/dev/shm/collimate")
    return Path(tempfile.gettempdir()) / "collimate-runtime"


def descendants(root: int | None = None) -> set[int]:
    """Every live process below `root` (default: this process): VMM processes (zygotes, sandboxes,
    spares, guest children)."""
    parent = {}
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            text = Path(stat).read_text()
        except OSError:
            continue
        fields = text[text.rindex(")") + 2 :].split()
        if fields[0] not in GONE:
            parent[int(stat.split("/")[2])] = int(fields[1])
    mine, todo = set(), [os.getpid() if root is None else root]
    while todo:
        p = todo.pop()
        kids = [c for c, pp in parent.items() if pp == p]
        mine.update(kids)
        todo.extend(kids)
    return mine


def fd_count() -> int:
    return len(os.listdir("/proc/self/fd"))


def vm_dirs() -> set[int]:
    return {int(d.name[3:]) for d in runtime_dir().glob("vm-*")} if runtime_dir().exists() else set()


def fds() -> dict[int, str]:
    out = {}
    for fd in os.listdir("/proc/self/fd"):
        try:
            out[int(fd)] = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            pass
    return out


def threads() -> int:
    return threading.active_count()


# --- the Pro quickstart's rollout loop, as written -------------------------------------------


TASK_CMD = (
    "mkdir -p /work/task && printf '3 1 2 5 4\\n' > /work/task/input.txt && "
    "echo '{\"name\": \"sort\", \"n\": 5}' > /work/task/meta.json && echo prefix-done"
)


def candidate(i: int) -> str:
    """Candidate i of a group: reads the task's files, sorts, some of them wrongly."""
    wrong = i % 3 == 1
    return (
        f"xs = [int(x) for x in open('/work/task/input.txt').read().split()]\n"
        f"out = sorted(xs{', reverse=True' if wrong else ''})\n"
        f"open('/work/answer.txt', 'w').write('candidate {i}')\n"
        f"print('candidate {i}', out)\n"
        f"assert out == [1, 2, 3, 4, 5]\n"
    )


def test_the_pro_quickstart_rollout_loop_as_written(client):
    handle = "python"  # what Template.bake(...) returns; a catalog template here
    seen = []

    def sample_batch():  # your trainer
        return [TASK_CMD], [[candidate(i + step) for i in range(WIDTH)]]

    def update_policy(candidates, rewards):
        seen.append((candidates, rewards))

    # --- verbatim from the Pro quickstart, section 2 -----------------------------------------
    def rollout_group(task_cmd: str, candidates: list[str]) -> list[float]:
        """Grade one GRPO group of len(candidates) == WIDTH completions."""
        with client.session(handle) as sess:
            # Shared prefix: paid ONCE for the whole group.
            sess.exec(command=task_cmd, timeout_seconds=120)

            # Fork the mid-episode state into WIDTH isolated live children.
            with sess.fork_group(WIDTH) as grp:
                def run(i, child):
                    r = child.exec(code=candidates[i], timeout_seconds=120)
                    return 1.0 if r.ok else 0.0

                return grp.map(run)          # parallel, positional
        # exiting the blocks tears down every child, then the parent — even on error

    for step in range(2):  # the guide says range(1000); two steps show the loop
        prompts, groups = sample_batch()      # your trainer
        for task_cmd, candidates in zip(prompts, groups):
            rewards = rollout_group(task_cmd, candidates)
            update_policy(candidates, rewards)
    # -------------------------------------------------------------------------------------------

    assert len(seen) == 2
    for step, (cands, rewards) in enumerate(seen):
        assert rewards == [0.0 if (i + step) % 3 == 1 else 1.0 for i in range(WIDTH)]
    assert client.usage().live_sandboxes == 0


# --- GRPO-shaped end to end ------------------------------------------------------------------


PREFIX_CODE = """
import json, fractions, statistics, collections, decimal
TASK = json.load(open('/work/task/meta.json'))
DATA = [int(x) for x in open('/work/task/input.txt').read().split()]

class Checker:
    def __init__(self, want):
        self.want, self.calls = want, []
    def check(self, got):
        self.calls.append(got)
        return got == self.want

checker = Checker(sorted(DATA))
cache = {k: fractions.Fraction(k, 7) for k in range(1000)}   # state held in the agent
"""


def grpo_candidate(i: int) -> str:
    """Uses the prefix's objects and modules; writes a file; right unless i % 5 in (1, 3)."""
    bug = {1: "[::-1]", 3: "[1:]"}.get(i % 5, "")
    return (
        "import os\n"
        "assert not os.path.exists('/work/answer.txt'), 'a sibling leaked a file'\n"
        "assert checker.calls == [], 'a sibling leaked state'\n"
        f"open('/work/answer.txt', 'w').write('{i}')\n"
        f"got = sorted(DATA){bug}\n"
        f"print('candidate', {i}, TASK['name'], statistics.mean(DATA), cache[{i}], 'json' in dir())\n"
        "if not checker.check(got): raise SystemExit(1)\n"
    )


def test_grpo_group_of_64_with_a_shared_prefix(client):
    with client.session("python") as sess:
        r = sess.exec(command=TASK_CMD, timeout_seconds=120)
        assert r.ok and r.stdout == "prefix-done\n", r
        r = sess.exec(code=PREFIX_CODE, timeout_seconds=120)
        assert r.ok, r.stderr
        with sess.fork_group(WIDTH) as grp:
            assert len(grp) == WIDTH and len({c.default_seed for c in grp}) == WIDTH

            def run(i, child):
                r = child.exec(code=grpo_candidate(i), timeout_seconds=120)
                assert r.seed == child.default_seed and r.seed_ack == "verified"
                return (1.0 if r.ok else 0.0), r.stdout

            results = grp.map(run)
        rewards = [rw for rw, _ in results]
        assert rewards == [0.0 if i % 5 in (1, 3) else 1.0 for i in range(WIDTH)]
        for i, (_, out) in enumerate(results):
            assert out == f"candidate {i} sort 3 {i}/7 True\n" if i % 7 else out.startswith(f"candidate {i} "), out
        # The parent is untouched by its children.
        r = sess.exec(code="import os; print(checker.calls, os.path.exists('/work/answer.txt'), len(cache))")
        assert r.stdout == "[] False 1000\n"
    assert client.usage().live_sandboxes == 0


def test_recycled_fork_children_come_back_pristine(client):
    """Children of a group are reset and may serve the next sandbox: none of the prefix survives."""
    with client.session("python") as sess:
        sess.exec(command=TASK_CMD)
        sess.exec(code=PREFIX_CODE)
        with sess.fork_group(8) as grp:
            grp.map(lambda i, c: c.exec(code="open('/work/child', 'w').write('x')"))
    drain(client)
    for _ in range(8):
        with Sandbox("python", client=client) as sb:
            r = sb.exec(code="import os, sys; print('checker' in globals(), os.listdir('/work'), 'fractions' in sys.modules)")
            assert r.stdout == "False [] False\n", r


def _vm_pid(child) -> int:
    return child._live().vm.pid


def test_a_child_killed_mid_run_fails_the_group_and_leaves_nothing_behind():
    c = EmbeddedClient()
    # The first child: the group is torn down in order, so the victim reaches the reaper while the
    # pool of recycled sandboxes has room (the session took one from it) and its reset is tried on
    # a dead VMM, which must still free every descriptor.
    victim_at = 0

    def one_group(kill: bool, pids: dict, pidfds: dict):
        killed = threading.Event()

        def killer(pid):
            # Wait until the victim's program runs (it spins: its VMM process's CPU time grows; its
            # files are on a tmpfs of its own, which the host cannot look into), then SIGKILL it.
            def cpu(p: int) -> float:
                f = open(f"/proc/{p}/stat").read().rsplit(")", 1)[1].split()
                return (int(f[11]) + int(f[12])) / os.sysconf("SC_CLK_TCK")

            start = cpu(pid)
            eventually(lambda: cpu(pid) - start >= 0.3, 60, "victim never ran")
            os.kill(pid, signal.SIGKILL)
            killed.set()

        with c.session("python") as sess:
            sess.exec(command=TASK_CMD, timeout_seconds=120)
            sess.exec(code=PREFIX_CODE, timeout_seconds=120)
            with sess.fork_group(WIDTH) as grp:
                for i, child in enumerate(grp):
                    pids[i] = child._live().vm.pid
                    pidfds[i] = os.pidfd_open(pids[i])
                if kill:
                    t = threading.Thread(target=killer, args=(pids[victim_at],))
                    t.start()

                def run(i, child):
                    code = grpo_candidate(i)
                    if kill and i == victim_at:
                        code = "while True: pass\n"
                    r = child.exec(code=code, timeout_seconds=120)
                    return 1.0 if r.ok else 0.0

                try:
                    return grp.map(run)
                finally:
                    if kill:
                        t.join()
                        assert killed.is_set()
                        assert len(grp) == 0, "the group was not torn down before the error surfaced"

    def exited(fd) -> bool:
        return bool(select.select([fd], [], [], 0)[0])  # a pidfd turns readable when its process ends

    try:
        # A first, healthy group: the template's pools (spare clones, recycled sandboxes) reach
        # their steady size, which is the baseline.
        pids, pidfds = {}, {}
        rewards = one_group(False, pids, pidfds)
        assert rewards == [0.0 if i % 5 in (1, 3) else 1.0 for i in range(WIDTH)]
        for fd in pidfds.values():
            os.close(fd)
        drain(c)
        # This client's processes all live below its zygote (clones are its forks; orphaned fork
        # children are adopted by it, a subreaper). Wait until their number is steady (the zygote
        # refills its spares at idle priority).
        zygote = c._templates["python"].zygote.pid
        steady = []

        def settled():
            steady.append(len(descendants(zygote)))
            return len(steady) >= 25 and len(set(steady[-25:])) == 1  # steady for half a second

        eventually(settled, 20, "the client's processes never settled")
        base = (len(descendants(zygote)), fd_count(), threads())
        base_fds = fds()
        assert c.usage().live_sandboxes == 0

        pids, pidfds = {}, {}
        with pytest.raises(GroupError, match=f"child {victim_at} of {WIDTH} failed.*torn down") as e:
            one_group(True, pids, pidfds)
        print(e.value)
        assert c.usage().live_sandboxes == 0 and not c._boxes
        drain(c)

        # The victim: its process is gone, and so is its private directory.
        victim = pids[victim_at]
        assert exited(pidfds[victim_at])
        assert victim not in vm_dirs(), "the killed sandbox's runtime directory is left behind"
        # Every other child is gone too (process and directory), except those reset into the
        # template's pool of recycled sandboxes, which is back at its steady size.
        recycled = {vm.pid for vm in c._templates["python"].recycled}
        for i, pid in pids.items():
            if pid in recycled:
                assert not exited(pidfds[i])
            else:
                assert exited(pidfds[i]), f"child {i} (pid {pid}) is still running"
                assert pid not in vm_dirs(), f"child {i}'s runtime directory is left behind"
        for fd in pidfds.values():
            os.close(fd)
        # No process, descriptor or thread more than before the failed group.
        eventually(lambda: (len(descendants(zygote)), fd_count(), threads()) == base, 10,
                   lambda: f"processes, fds, threads: {(len(descendants(zygote)), fd_count(), threads())} != {base}; "
                   f"new fds: { {k: v for k, v in fds().items() if base_fds.get(k) != v} }, "
                   f"gone: { {k: v for k, v in base_fds.items() if fds().get(k) != v} }")
        assert not (set(pids.values()) - recycled) & descendants(zygote)
    finally:
        c.close()
    # After close(): no process of this client remains and none of its directories.
    eventually(lambda: not descendants() & set(pids.values()), 10, "processes left after close()")
    assert not vm_dirs() & set(pids.values())


# --- the RL quickstart's Sandbox snippet, client.env, client.usage -------------------------


def test_the_rl_quickstart_sandbox_snippet_as_written(client):
    task_source = (
        b"import json, random, sys\n"
        b"data = {'python': sys.version_info[:2], 'roll': random.random(), 'bytes': list(range(256))}\n"
        b"json.dump(data, open('out.json', 'w'))\n"
        b"print('wrote out.json')\n"
    )
    artifact = None

    # --- verbatim from the RL quickstart, "A stateful rollout with Sandbox" --------------------
    with Sandbox("python", client=client) as sb:       # ~ms warm fork
        sb.upload_bytes("/work/task.py", task_source)     # byte-exact file in
        r = sb.exec(command="cd /work && python task.py", timeout_seconds=120)
        if r.ok:
            artifact = sb.download("/work/out.json")       # byte-exact file out
        print("warm hit:", sb.warm_hit)                     # served warm?
    # -------------------------------------------------------------------------------------------

    assert r.ok and r.stdout == "wrote out.json\n", r
    assert r.seed_ack == "verified" and len(r.seed) == 64
    out = json.loads(artifact)
    assert out["python"] == [3, 11] and out["bytes"] == list(range(256))


def test_client_env_snippet_as_written(client):
    # What Template.bake(client, name="swe-rollout", ...) would leave behind: a template by that name.
    client.register_template("swe-rollout", bake_python())
    task_cmd = TASK_CMD
    candidates = [candidate(i) for i in range(WIDTH)]

    def run(i, child):
        r = child.exec(code=candidates[i], timeout_seconds=120)
        return 1.0 if r.ok else 0.0

    t = client._template("swe-rollout")
    # --- verbatim from the Pro quickstart, section 3 -------------------------------------------
    with client.env("swe-rollout", width=WIDTH) as env:   # width ready up front
        assert t.spares == 16  # the zygote's pool of ready clones, at its cap
        with env.sandbox() as sess:
            sess.exec(command=task_cmd, timeout_seconds=120)
            with sess.fork_group(WIDTH) as grp:
                rewards = grp.map(run)
    # exit → release: capacity relaxes immediately (idle decay is the fallback)
    # -------------------------------------------------------------------------------------------
    assert t.spares == 2  # released to the default
    assert rewards == [0.0 if i % 3 == 1 else 1.0 for i in range(WIDTH)]
    with pytest.raises(NotFoundError, match="catalog"):
        with client.env("no-such-env", width=4):
            pass


def test_client_usage_as_written(client):
    before = client.usage()
    with Sandbox("python", client=client) as sb:
        sb.upload_bytes("/work/in.bin", b"x" * 1000)
        sb.exec(code="print('y' * 99)")
        sb.download("/work/in.bin")
        with sb.fork_group(3) as grp:
            grp.map(lambda i, c: c.exec(code="pass"))
        time.sleep(0.05)
    # --- verbatim from the Pro quickstart, section 4 -------------------------------------------
    print(client.usage())   # GET /v1/usage — your metered totals, any window
    # -------------------------------------------------------------------------------------------
    after = client.usage()
    assert after.sandboxes - before.sandboxes == 1
    assert after.forks - before.forks == 3
    assert after.execs - before.execs == 4
    assert after.bytes_in - before.bytes_in == 1000
    assert after.bytes_out - before.bytes_out == 100 + 1000
    assert after.sandbox_seconds - before.sandbox_seconds >= 0.05
    assert after.live_sandboxes == 0
    # A window: nothing happened in the last hour before `before` was taken... except what did.
    window = client.usage(since=time.time() - 3600)
    assert window.execs >= 4
    assert client.usage(until=0).execs == 0


# --- Sandbox.attach from another thread -----------------------------------------------------


def test_attach_from_another_thread_recovers_a_worker(client):
    ids, out, errors = [], [], []

    def worker():  # starts an episode, then "crashes" without cleaning up
        sb = Sandbox("python", client=client).start()
        sb.exec(code="episode = ['step 1']")
        ids.append(sb.session_id)

    def recovery():
        try:
            sb = Sandbox.attach(client, ids[0])
            sb.exec(code="episode.append('step 2')")
            out.append(sb.exec(code="print(episode)").stdout)
            sb.kill()
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    for target in (worker, recovery):
        t = threading.Thread(target=target)
        t.start()
        t.join()
    assert not errors, errors
    assert out == ["['step 1', 'step 2']\n"]
    with pytest.raises(NotFoundError):
        Sandbox.attach(client, ids[0])

    # Attach while the owner is still using it: calls are serialized per sandbox.
    with Sandbox("python", client=client) as sb:
        sb.exec(code="n = 0")
        def bump():
            other = Sandbox.attach(client, sb.session_id)
            for _ in range(10):
                other.exec(code="n += 1")
        ts = [threading.Thread(target=bump) for _ in range(3)]
        for t in ts:
            t.start()
        for _ in range(10):
            sb.exec(code="n += 1")
        for t in ts:
            t.join()
        assert sb.exec(code="print(n)").stdout == "40\n"


# --- capacity: bursts wait, the limit names itself -------------------------------------------


def test_bursts_beyond_capacity_wait_instead_of_failing():
    small = EmbeddedClient(max_sandboxes=3, capacity_timeout=60)
    live, peak, results, errors = [0], [0], [], []
    lock = threading.Lock()

    def rollout(i):
        try:
            with Sandbox("python", client=small) as sb:
                with lock:
                    live[0] += 1
                    peak[0] = max(peak[0], live[0], small.usage().live_sandboxes)
                r = sb.exec(code=f"print({i} * 2)")
                time.sleep(0.05)  # the trainer holds the sandbox a little
                with lock:
                    live[0] -= 1
                results.append((i, r.stdout))
        except BaseException as e:  # noqa: BLE001
            errors.append(e)

    try:
        small._template("python")
        threads_ = [threading.Thread(target=rollout, args=(i,)) for i in range(16)]
        t0 = time.monotonic()
        for t in threads_:
            t.start()
        for t in threads_:
            t.join()
        took = time.monotonic() - t0
        assert not errors, errors
        assert sorted(results) == [(i, f"{i * 2}\n") for i in range(16)]
        assert peak[0] <= 3, f"{peak[0]} sandboxes were live at once under max_sandboxes=3"
        assert took >= 16 / 3 * 0.05 * 0.9, "nobody waited?"

        # A fork group waits for room too.
        with Sandbox("python", client=small) as parent:
            holder = Sandbox("python", client=small).start()
            threading.Timer(0.3, holder.kill).start()
            t0 = time.monotonic()
            with parent.fork_group(2) as grp:  # 1 + 1 + 2 > 3: waits for the holder to go
                assert time.monotonic() - t0 >= 0.25
                assert grp.map(lambda i, c: c.exec(code="print(1)").stdout) == ["1\n", "1\n"]
    finally:
        small.close()


def test_the_capacity_error_names_the_limit():
    small = EmbeddedClient(max_sandboxes=2, capacity_timeout=0.2)
    try:
        with Sandbox("python", client=small) as a, Sandbox("python", client=small):
            with pytest.raises(CapacityError, match="max_sandboxes=2") as e:
                Sandbox("python", client=small).start()
            print(e.value)
            with pytest.raises(CapacityError, match="max_sandboxes=2"):
                a.fork_group(1)
        with Sandbox("python", client=small) as a:
            with pytest.raises(CapacityError, match=r"fork group of 8.*max_sandboxes=2") as e:
                a.fork_group(8)  # can never fit: fails at once
            print(e.value)
        assert small.usage().live_sandboxes == 0
    finally:
        small.close()


def _children(pid: int) -> set[int]:
    try:
        return {int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()}
    except OSError:
        return set()


def test_spare_clones_leave_no_runtime_directories(client):
    """A zygote's pre-forked spares each make a private runtime directory. Spares dropped by a
    smaller pool, and spares orphaned when their zygote is destroyed, must remove it (they have no
    controller that would): every EmbeddedClient.close() used to leave two behind."""
    t = client._template("python")
    zygote = Vm.restore(t.baked.path)
    zpid = zygote.pid
    try:
        zygote.set_spare_pool(4)
        first = eventually(lambda: len(_children(zygote.pid)) >= 4 and _children(zygote.pid), 20, "no spares")
        if zygote.disk_quota is not None:
            # Spares keep their files on a tmpfs of their own: no runtime directory at all.
            assert not first & vm_dirs(), "spares with disk quotas made runtime directories"
        else:
            eventually(lambda: first <= vm_dirs(), 10, "spares have no runtime directories?")
        zygote.set_spare_pool(1)  # drops three spares
        eventually(lambda: len(first - _children(zygote.pid)) >= 3, 10)
        dropped = first - _children(zygote.pid)
        assert not dropped & vm_dirs(), "dropped spares left their runtime directories"
        zygote.set_spare_pool(3)
        spares = eventually(lambda: len(_children(zygote.pid)) >= 3 and _children(zygote.pid), 20, "no spares")
    finally:
        zygote.destroy()
    # The zygote is gone; its spares notice (their channel closes) and clean up as they exit.
    eventually(lambda: not spares & descendants(), 10, "spares outlived their zygote")
    eventually(lambda: not (spares | {zpid}) & vm_dirs(), 10,
               lambda: f"left behind: {sorted((spares | {zpid}) & vm_dirs())}")
