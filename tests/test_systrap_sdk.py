"""The embedded SDK on the systrap platform (docs/platforms.md, sdk/live.py): the catalog "python"
template from a zygote restored from its systrap snapshot (tests/test_systrap_snapshot.py), sessions, execs, fork groups, grading and seeds through the public
SDK with platform="systrap"; with /dev/kvm hidden, `connect()` picks systrap and runs the
quick-start. Needs seccomp filters (systrap) and the python root filesystem (COLLIMATE_ROOTFS, or
built into the cache on first use); not /dev/kvm.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from collimate_rl import (
    EmbeddedClient,
    NotFoundError,
    Ready,
    Sandbox,
    SandboxDied,
    Template,
    UnitTestReward,
    connect,
    extract_code,
    grade,
    grade_batch,
    rollout_once,
)
from collimate_core.sdk import platform as pf
from collimate_core.sdk.errors import InvalidArgument
from hostprocs import stub_of
from platforms import systrap_client

SEED = "c0ffee00" * 8


@pytest.fixture(scope="module")
def client():
    return systrap_client()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def test_a_session_execs_code_and_commands_and_keeps_state(client):
    with client.session("python") as s:
        assert s.platform == "systrap"
        r = s.exec(code="x = 41\nimport os\nprint(sum(range(1000)), os.getpid())")
        assert (r.ok, r.stdout, r.platform) == (True, "499500 1\n", "systrap"), r
        r = s.exec(code="print(x + 1)")
        assert r.stdout == "42\n", r
        r = s.exec(command="echo hi from $$; echo err >&2; exit 3")
        assert (r.exit_code, r.stderr) == (3, "err\n"), r
        assert r.stdout.startswith("hi from ") and 2 <= int(r.stdout.split()[-1]) < 100, r.stdout
        # Files across execs, and byte-exact upload and download.
        s.upload_bytes("/work/task.py", b"import json\njson.dump({'n': 7}, open('/work/out.json', 'w'))\n")
        r = s.exec(command="cd /work && python3 task.py", timeout_seconds=120)
        assert r.ok, r
        assert s.download("/work/out.json") == b'{"n": 7}'


# In the agent: the engine's spawn call (docs/spawn.md) made directly, with a pipe as the child's
# stdin and another as its stdout (the call keeps fds 0-2), an environment of its own and the
# agent's cwd; then a missing program. Prints one JSON line.
SPAWN_DIRECTLY = """
import collimate_agent as a, json, os
out = {}
os.chdir("/tmp")
saved = os.dup(0), os.dup(1)
i_r, i_w = os.pipe()
o_r, o_w = os.pipe()
os.write(i_w, b"from stdin\\n")
os.close(i_w)
os.dup2(i_r, 0)
os.dup2(o_w, 1)
try:
    pid = a._spawn([b"/bin/sh", b"-c", b"cat; pwd; echo $FOO; exit 5"], [b"FOO=bar"])
finally:
    os.dup2(saved[0], 0)
    os.dup2(saved[1], 1)
    for fd in (i_r, o_w) + saved:
        os.close(fd)
_, status = os.waitpid(pid, 0)
out["child"] = [pid > 1, os.waitstatus_to_exitcode(status), os.read(o_r, 4096).decode()]
try:
    a._spawn([b"/no/such/program"], [])
except OSError as e:
    out["missing"] = e.errno
print(json.dumps(out))
"""


def test_commands_start_through_the_engines_spawn_call(client):
    # Failed before the systrap VMM served the call: it answered ENOSYS (38) and the agent fell
    # back to subprocess (a vfork running CPython's pre-exec code in the guest).
    with client.session("python") as s:
        r = s.exec(code=SPAWN_DIRECTLY)
        assert r.ok, r
        out = json.loads(r.stdout)
        assert out == {"child": [True, 5, "from stdin\n/tmp\nbar\n"], "missing": 2}, out
        # Through exec(command=...): stdout, stderr, the exit code, env and cwd; the agent's
        # channel (fd 3) is closed in the child and SIGPIPE is back to its default (yes dies by
        # it: 141), as the spawn's flags ask and as on kvm.
        r = s.exec(command="echo out; echo err >&2; echo $FOO; pwd; exit 7", env={"FOO": "baz"}, cwd="/work")
        assert (r.exit_code, r.stdout, r.stderr) == (7, "out\nbaz\n/work\n", "err\n"), r
        r = s.exec(command="(yes; echo $? >&2) | head -1; echo x >&3; echo rc=$?")
        assert (r.exit_code, r.stdout, r.stderr) == (0, "y\nrc=1\n", "141\n/bin/sh: 3: Bad file descriptor\n"), r
        # A missing binary: the shell's error, as on kvm.
        r = s.exec(command="no-such-binary --flag")
        assert (r.exit_code, r.stderr) == (127, "/bin/sh: no-such-binary: not found\n"), r
        # The spawns left the agent's memory out of their stub forks and put it back: a fork of
        # the agent afterwards still has all of it.
        r = s.exec(code="import os\nbig = bytes(range(256)) * 4096\npid = os.fork()\n"
                        "if pid == 0:\n    os._exit(0 if big[4097] == 1 and len(big) == 1 << 20 else 1)\n"
                        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))")
        assert r.stdout == "0\n", r
        # From the children of a fork group: each spawns from its own VMM and stub.
        with s.fork_group(2) as grp:
            for i, child in enumerate(grp):
                r = child.exec(code=SPAWN_DIRECTLY)
                assert r.ok and json.loads(r.stdout) == out, r
                r = child.exec(command=f"echo child {i}; exit {i + 3}")
                assert (r.exit_code, r.stdout) == (i + 3, f"child {i}\n"), r


def test_sandboxes_come_from_spare_clones_made_ahead(client):
    # Failed before the SDK kept spares on systrap: every sandbox was cloned when asked for
    # (warm_hit False).
    t = client._template("python")
    client.expect_width("python", 2)
    try:
        for _ in range(600):  # the background thread clones them: up to a minute
            if len(t._pool) == 2:
                break
            time.sleep(0.1)
        assert len(t._pool) == 2
        _no_recycled(client, t)  # sandboxes recycled by reset are taken first
        with Sandbox("python", client=client) as a, Sandbox("python", client=client) as b:
            assert (a.warm_hit, b.warm_hit) == (True, True)
            # Each spare is a sandbox of its own, at the template's ready point.
            a.exec(code="x = 'a'")
            assert b.exec(code="print('x' in dir())").stdout == "False\n"
            assert a.exec(code="print(x)").stdout == "a\n"
            assert b.exec(command="echo b").stdout == "b\n"
        # Taken spares are replaced; a width of 0 drops them.
        _wait_for_spares(t, 2)
        client.expect_width("python", 0)
        assert t._pool == []
        _no_recycled(client, t)
        with Sandbox("python", client=client) as c:
            assert not c.warm_hit and c.exec(code="print(3)").stdout == "3\n"
    finally:
        client.release_template("python")


def _no_recycled(client, t) -> None:
    """Template `t` holds no recycled sandbox (the client's reaper thread done with those that ended)."""
    client._reaper.submit(lambda: None).result()
    t.drain()


def _minflt(pid: int) -> int:
    """Host page faults (minor) `pid` has taken, from /proc/<pid>/stat."""
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[7])




def test_a_spares_first_exec_takes_the_faults_of_a_second_one(client):
    # A clone shares the zygote's memory copy-on-write: before, a spare's first exec took about
    # 420 host page faults in its stub and 9 in its VMM (copies of the pages it wrote, and the
    # program's text mapped again), its second none. Now the first clones report what their first
    # exec wrote and mapped, and each later clone takes those faults before it is handed out
    # (vmm/systrap/warm.rs). Left: the pages the exec's heap grows into (brk), which a clone
    # does not have yet. Failed on the previous main (416-426 against 0).
    # A client of its own, so that its zygote's first clones are this test's (the module's client
    # is the process's shared one, whose first clones other modules' sandboxes may have been,
    # with other first execs: 138 faults were left in one CI run).
    own = EmbeddedClient(platform="systrap")
    try:
        _spare_first_exec(own)
    finally:
        own.close()


def _wait_for_spares(t, n: int) -> None:
    """Until template `t` holds `n` spare clones (made by its thread), at most 60 s."""
    for _ in range(600):
        if len(t._pool) == n:
            break
        time.sleep(0.1)
    assert len(t._pool) == n


def _spare_first_exec(client) -> None:
    t = client._template("python")
    for _ in range(3):  # the template's first clones report their first exec
        with Sandbox("python", client=client) as sb:
            assert sb.exec(code="x = 1").ok and sb.exec(command="true").ok
    client.expect_width("python", 0)  # spares made from now on, after the reports
    client.expect_width("python", 2)
    try:
        _wait_for_spares(t, 2)
        _no_recycled(client, t)  # a spare's first exec, not a recycled sandbox's
        with Sandbox("python", client=client) as sb:
            assert sb.warm_hit
            vmm = sb._box.vm.pid
            stub = stub_of(vmm)
            faults = []
            for _ in range(2):
                before = _minflt(vmm) + _minflt(stub)
                assert sb.exec(code="x = 1").ok
                faults.append(_minflt(vmm) + _minflt(stub) - before)
        first, second = faults
        assert first <= second + 32, f"first exec {first} host page faults, second {second}"
    finally:
        client.release_template("python")


def test_the_spare_thread_leaves_a_new_sandbox_alone_while_a_spare_is_left(client, monkeypatch):
    # Before, taking a spare made the thread clone the next one at once, beside the new
    # sandbox's first exec on the same cores (that exec took 3-10 ms instead of 2 on 2 cores).
    # Now it waits REFILL_AFTER while another spare is left, and clones at once when none is.
    # Failed on the previous main (the pool was back at 2 while the first sandbox lived).
    from collimate_core.sdk import live

    t = client._template("python")
    client.expect_width("python", 2)
    try:
        _wait_for_spares(t, 2)
        monkeypatch.setattr(live, "REFILL_AFTER", 3600.0, raising=False)
        _no_recycled(client, t)  # spares taken, not recycled sandboxes
        with Sandbox("python", client=client) as a:
            assert a.warm_hit and a.exec(code="x = 1").ok
            for _ in range(30):  # a clone takes well under a second here; 3 s to see none
                time.sleep(0.1)
                assert len(t._pool) == 1, "the spare thread cloned while a spare was left"
            with Sandbox("python", client=client) as b:  # the last spare: it clones at once
                assert b.warm_hit
                for _ in range(600):
                    if t._pool:
                        break
                    time.sleep(0.1)
                assert len(t._pool) == 1
    finally:
        monkeypatch.undo()
        if hasattr(t, "_emptied"):
            t._emptied.set()  # wake the thread from its long wait
        client.release_template("python")


def _ppid(pid: int) -> int:
    return int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])


def test_a_fork_group_of_64_gives_64_distinct_children_forked_from_the_session(client):
    # The VMM forks a group's stubs without waiting for each to park (its clone waits): every
    # child must still be a fork of the session (its VMM a child of the session's VMM, its stub
    # of the session's stub) with the session's state and its own.
    with client.session("python") as s:
        s.exec(code="base = 1000")
        vmm = s._box.vm.pid
        stub = stub_of(vmm)
        with s.fork_group(64) as grp:
            kids = [c._box.vm.pid for c in grp.children]
            assert len(set(kids)) == 64
            assert {_ppid(k) for k in kids} == {vmm}
            assert {_ppid(stub_of(k)) for k in kids} == {stub}
            results = grp.map(lambda i, c: c.exec(code=f"mine = base + {i}\nprint(mine)"))
            assert [r.stdout for r in results] == [f"{1000 + i}\n" for i in range(64)], results
            assert grp.children[7].exec(code="print(mine)").stdout == "1007\n"
        assert s.exec(code="print('mine' in dir())").stdout == "False\n"


def test_fork_group_children_start_from_the_parent_and_keep_their_own_state(client):
    with client.session("python") as s:
        s.exec(code="state = ['parent']\nopen('/work/f', 'w').write('parent')")
        with s.fork_group(3) as grp:
            assert [c.platform for c in grp] == ["systrap"] * 3
            out = grp.map(lambda i, c: c.exec(code=f"state.append({i})\nopen('/work/f', 'w').write('kid{i}')\nprint(state)"))
            assert [r.stdout for r in out] == [f"['parent', {i}]\n" for i in range(3)]
            out = grp.map(lambda i, c: c.exec(code="print(state, open('/work/f').read())"))
            assert [r.stdout for r in out] == [f"['parent', {i}] kid{i}\n" for i in range(3)]
        r = s.exec(code="print(state, open('/work/f').read())")
        assert r.stdout == "['parent'] parent\n"


def test_seeds_are_echoed_acked_and_reproduce(client):
    code = "import random, os\nprint(random.random(), os.urandom(8).hex())"
    r1 = rollout_once("python", code=code, seed=SEED, client=client)
    r2 = rollout_once("python", code=code, seed=SEED, client=client)
    r3 = rollout_once("python", code=code, client=client)
    assert r1.ok and r1.seed == SEED and r1.seed_ack == "verified", r1
    assert r2.stdout == r1.stdout and r2.seed_ack == "verified"
    # No seed: a fresh one, echoed, which replays the run.
    assert r3.ok and len(r3.seed) == 64 and r3.seed != SEED and r3.stdout != r1.stdout
    r4 = rollout_once("python", code=code, seed=r3.seed, client=client)
    assert r4.stdout == r3.stdout and r4.seed_ack == "verified"
    # The virtual clocks too, from one zygote.
    clocks = "import time\nprint(time.time(), time.monotonic())"
    c1 = rollout_once("python", code=clocks, seed=SEED, client=client)
    c2 = rollout_once("python", code=clocks, seed=SEED, client=client)
    assert c1.ok and c1.stdout == c2.stdout, (c1, c2)


@pytest.mark.kvm
@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_a_seed_gives_the_same_crng_output_as_on_kvm(client):
    # What holds across the platforms: everything drawn from the guest CRNG. (The virtual clocks
    # do not: they start at each platform's own snapshot of the template, made apart.)
    code = "import random, os, uuid\nprint(random.random(), os.urandom(8).hex(), uuid.uuid4())"
    kvm = connect(platform="kvm")
    a = rollout_once("python", code=code, seed=SEED, client=kvm)
    b = rollout_once("python", code=code, seed=SEED, client=client)
    assert (a.platform, b.platform) == ("kvm", "systrap")
    assert a.ok and a.stdout == b.stdout and a.seed_ack == b.seed_ack == "verified", (a, b)


def test_grade_and_a_group_give_rewards(client):
    spec = UnitTestReward(template="python", tests="assert solve([3,1,2]) == [1,2,3]\n")
    good = extract_code("Here:\n```python\ndef solve(x):\n    return sorted(x)\n```\n")
    result = grade(good, spec, client=client, seed=SEED)
    assert result.reward == 1.0 and result.seed == SEED and result.seed_ack == "verified", result
    rewards = grade_batch([good, "def solve(x):\n    return x\n", "def solve(x:\n"], spec, client=client, seed=SEED)
    assert [r.reward for r in rewards] == [1.0, 0.0, 0.0]
    assert [r.seed for r in rewards[:2]] == [SEED, SEED]  # (the third does not compile: nothing ran)


def test_grading_prepares_its_template_once_and_clones_it(client):
    """On systrap the spec's setup and the grader are prepared once, in a live zygote the client
    keeps (`grading/pool.py`), and every candidate of every later group is a clone of it, as on kvm
    (before, each grade_batch forked a parent prepared anew). A candidate's writes stay its own."""
    spec = UnitTestReward(template="python", setup="open('/work/data', 'w').write('7')\nSETUP = 1\n",
                          tests="assert solve() == 7 and SETUP == 1\n")
    good = "def solve():\n    return int(open('/work/data').read())\n"
    spoil = "open('/work/data', 'w').write('0')\nSETUP = 2\ndef solve():\n    return 7\n"
    assert [r.reward for r in grade_batch([spoil, good, good], spec, client=client, seed=SEED)] == [0.0, 1.0, 1.0]
    prepared = {n: t for n, t in client._templates.items() if n.startswith("__grading__-")}
    assert len(prepared) >= 1, list(client._templates)
    zygotes = {n: t.zygote.pid for n, t in prepared.items()}
    assert [r.reward for r in grade_batch([good, spoil, good], spec, client=client, seed=SEED)] == [1.0, 0.0, 1.0]
    again = {n: t.zygote.pid for n, t in client._templates.items() if n.startswith("__grading__-")}
    assert again == zygotes  # the same prepared zygote served the second group
    bad = UnitTestReward(template="python", setup="raise SystemExit(3)\n", tests="assert True\n")
    with pytest.raises(InvalidArgument, match="setup failed"):
        grade_batch([good], bad, client=client, seed=SEED)


def test_a_timeout_or_a_dead_interpreter_gets_a_fresh_clone(client):
    with Sandbox("python", client=client) as sb:
        sb.exec(code="y = 1\nopen('/work/kept', 'w').write('x')")
        # Waiting (syscalls): the exec is ended as on kvm and the sandbox kept.
        r = sb.exec(code="import os\nr, w = os.pipe()\nos.read(r, 1)", timeout_seconds=1)
        assert r.timed_out and r.exit_code == 124 and "KeyboardInterrupt" in r.stderr, r
        assert "the sandbox is kept" in r.note, r.note
        r = sb.exec(code="import os\nprint('y' in globals(), os.path.exists('/work/kept'))")
        assert r.ok and r.stdout == "True True\n" and not r.interpreter_restarted, r
        # Computing code is interrupted as on kvm (tests/test_systrap_threads.py); an interpreter
        # that ignores the interrupt does not stop: it is reset in place over the sandbox's files,
        # as on kvm (docs/systrap.md, "Reset"; before, the next exec was a new clone, files lost).
        r = sb.exec(code="import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True:\n    pass", timeout_seconds=1)
        assert r.timed_out and r.exit_code == 124, r
        assert "files in /tmp and /work are kept" in r.note, r.note
        r = sb.exec(code="import os\nprint('y' in globals(), os.path.exists('/work/kept'))")
        assert r.ok and r.stdout == "False True\n" and r.interpreter_restarted, r
        r = sb.exec(code="import os\nos._exit(3)")
        assert r.exit_code == 3 and r.interpreter_died, r
        assert sb.exec(code="print('again')").stdout == "again\n"
        sb.exec(code="z = 5")
        sb.reset()  # a new clone of the template
        assert sb.exec(code="print('z' in globals())").stdout == "False\n"


def test_a_sandbox_that_ends_is_recycled_by_reset_or_destroyed_past_the_cap(client):
    # A sandbox that ends is reset in place and kept for the next one (tests/test_systrap_reset.py
    # checks it shows nothing of its last owner); beyond RECYCLE_MAX it is destroyed.
    from collimate_core.sdk.embedded import RECYCLE_MAX

    t = client._template("python")
    t.drain()
    boxes = [Sandbox("python", client=client) for _ in range(RECYCLE_MAX + 1)]
    pids = []
    for sb in boxes:
        sb.__enter__()
        assert sb.exec(command="true").ok
        pids.append(sb._box.vm.pid)
    for sb in boxes:
        sb.__exit__(None, None, None)
    end = time.monotonic() + 30  # the reaper thread resets or tears down each after the exit
    while sum(_alive(p) for p in pids) > RECYCLE_MAX and time.monotonic() < end:
        time.sleep(0.05)
    while len(t.recycled) < RECYCLE_MAX and time.monotonic() < end:
        time.sleep(0.05)
    assert sum(_alive(p) for p in pids) == RECYCLE_MAX
    assert sorted(vm.pid for vm in t.recycled) == sorted(p for p in pids if _alive(p))
    t.drain()
    assert not any(_alive(p) for p in pids if wait_gone(p))


def wait_gone(pid: int, limit: float = 30.0) -> bool:
    end = time.monotonic() + limit
    while _alive(pid) and time.monotonic() < end:
        time.sleep(0.05)
    return True


def test_a_lost_vmm_raises_and_a_lost_zygote_is_started_again(client):
    c = EmbeddedClient(platform="systrap")
    try:
        with c.session("python") as s:
            assert s.exec(code="print(1)").stdout == "1\n"
            os.kill(s._box.vm.pid, signal.SIGKILL)
            # An infrastructure failure raises (never an exit code or a reward).
            with pytest.raises(SandboxDied, match="is gone"):
                s.exec(code="print(2)")
        # No spares (they are clones made before the zygote died), so the next sandbox is a
        # new clone, which finds the zygote gone.
        c.expect_width("python", 0)
        zygote = c._templates["python"].zygote
        os.kill(zygote.pid, signal.SIGKILL)
        with c.session("python") as s:
            assert s.exec(code="print(3)").stdout == "3\n"
        assert c._templates["python"].zygote is not zygote
    finally:
        c.close()


def test_unknown_templates_and_images_say_what_runs_on_systrap(client):
    # Image templates bake live on systrap (test_systrap_images.py); a name that is neither a
    # template nor an image says what there is.
    with pytest.raises(NotFoundError, match="no template named 'swe-rollout': on systrap the catalog has 'python'"):
        with client.session("swe-rollout"):
            pass
    st = Template.bake(client, name="swe", image="example.invalid/swe:1", ready=Ready(cmd="true")).wait(60)
    assert st.phase == "Failed" and "example.invalid/swe:1" in st.error, st


# --- connect() with /dev/kvm hidden (a mount namespace) -------------------------------------------

_QUICKSTART = r"""
import json, logging, os
logging.basicConfig(level=logging.INFO)
from collimate_core.sdk import platform as pf
from collimate_rl import Sandbox, UnitTestReward, connect, extract_code, grade, rollout_once

out = {"kvm": pf.probe_kvm().why}
client = connect()   # no key: the embedded engine, on what auto picks
out["platform"] = client.platform

r = rollout_once("python", code="print(sum(range(1000)))", seed="c0ffee00" * 8, client=client)
assert r.ok and r.stdout.strip() == "499500", r
out["seed"], out["seed_ack"] = r.seed, r.seed_ack

with Sandbox("python", client=client) as sb:
    sb.upload_bytes("/work/task.py", b"import json; json.dump([1, 2], open('/work/out.json', 'w'))")
    r = sb.exec(command="cd /work && python task.py", timeout_seconds=120)
    assert r.ok, r
    out["artifact"] = sb.download("/work/out.json").decode()
    out["sandbox_platform"] = sb.platform

spec = UnitTestReward(template="python", tests="assert solve([3,1,2]) == [1,2,3]\n")
code = extract_code("```python\ndef solve(xs):\n    return sorted(xs)\n```")
out["reward"] = grade(code, spec, client=client).reward
print(json.dumps(out))
"""


def test_connect_without_dev_kvm_picks_systrap_and_runs_the_quickstart():
    if os.geteuid() != 0 or not shutil.which("unshare") or not os.path.exists("/dev/kvm"):
        pytest.skip("needs root, unshare(1) and a /dev/kvm to hide")
    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    empty = Path(os.environ.get("TMPDIR", "/tmp")) / f"collimate-no-kvm-{os.getpid()}"
    empty.write_bytes(b"")
    env = {k: v for k, v in os.environ.items()
           if k not in ("COLLIMATE_API_KEY", "COLLIMATE_BASE_URL", "COLLIMATE_RAY_ADDRESS", "COLLIMATE_PLATFORM")}
    try:
        script = 'mount --bind "$0" /dev/kvm && exec "$@"'
        r = subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(empty),
                            sys.executable, "-c", _QUICKSTART], capture_output=True, text=True, env=env, timeout=600)
    finally:
        empty.unlink()
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["kvm"].startswith("/dev/kvm opens but"), out  # it really was hidden
    assert out["platform"] == out["sandbox_platform"] == "systrap", out
    assert (out["seed"], out["seed_ack"]) == ("c0ffee00" * 8, "verified")
    assert out["artifact"] == "[1, 2]" and out["reward"] == 1.0, out
    assert "collimate_core platform: systrap (auto: no usable KVM" in r.stderr


def test_collimate_serve_on_systrap_serves_the_same_surface(tmp_path):
    # The control plane's engine is an EmbeddedClient: started with --platform systrap it serves
    # the catalog template's sessions, execs and fork groups from the live zygote.
    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_http import Server, _cli

    from collimate_core import RemoteClient

    store = tmp_path / "keys.json"
    key = _cli("keys", "--key-store", str(store), "create", "--tenant", "alice").strip()
    srv = Server(tmp_path, store, "--platform", "systrap")
    try:
        assert srv.health()["platform"] == "systrap"
        with RemoteClient(key, srv.url) as c:
            assert c.platform == "systrap"
            with c.session("python") as s:
                r = s.exec(code="x = 6\nprint(x * 7)", seed=SEED)
                assert (r.stdout, r.platform, r.seed_ack) == ("42\n", "systrap", "verified"), r
                with s.fork_group(2) as grp:
                    assert [r.stdout for r in grp.map(lambda i, ch: ch.exec(code=f"print(x + {i})"))] == ["6\n", "7\n"]
            # An image (uploaded by the remote client) bakes live on the server's systrap engine.
            root = os.environ.get("COLLIMATE_ROOTFS")
            if root:
                from imagefixtures import busybox_layer, write_docker_save

                image = tmp_path / "tool.tar"
                write_docker_save(image, [busybox_layer(Path(root) / "usr/bin/busybox")],
                                  {"Env": ["PATH=/bin", "TOOL=busybox"]}, repo_tags=["tool:1.0"])
                st = Template.bake(c, name="mine", image=str(image)).wait(300)
                assert st.phase == "Live", st.log
                with c.session("mine") as s:
                    r = s.exec(command="echo $TOOL; echo w > /etc/w && cat /etc/w")
                    assert (r.stdout, r.platform) == ("busybox\nw\n", "systrap"), r
    finally:
        srv.stop()
    assert not [e for e in srv.events() if e["level"] == "error"]


def _traced_syscalls(err: str, vmm: int) -> list[int]:
    """The guest syscalls VMM `vmm` served, from `COLLIMATE_TRACE=2` lines on stderr."""
    out = []
    for line in err.splitlines():
        f = line.split()
        if len(f) == 5 and f[0] == "collimate-trace" and f[2] == str(vmm) and f[3] == "sys":
            out.append(int(f[4]))
    return out


def test_a_sandboxs_first_exec_makes_the_syscalls_of_its_second(capfd, monkeypatch):
    # The catalog template's agent runs one exec of `pass` before its snapshot (sdk/live.py,
    # `warm_up`), so a sandbox's first exec is not CPython's first in its process: before, it grew
    # the heap (a brk the second exec does not make) and did 0.9 ms more work in the guest.
    # Counted with the VMM's syscall trace (COLLIMATE_TRACE=2, read by the zygote's VMM, which its
    # clones inherit). Fails without the warm-up (COLLIMATE_SYSTRAP_WARMUP=0: [0, 318, 12, 1, 0]
    # against [0, 318, 1, 0]).
    monkeypatch.setenv("COLLIMATE_TRACE", "2")
    own = EmbeddedClient(platform="systrap")
    try:
        with Sandbox("python", client=own) as sb:
            vmm = sb._box.vm.pid
            capfd.readouterr()
            assert sb.exec(code="x = 1").ok
            first = _traced_syscalls(capfd.readouterr().err, vmm)
            assert sb.exec(code="x = 1").ok
            second = _traced_syscalls(capfd.readouterr().err, vmm)
    finally:
        own.close()
    assert second, "no syscall trace from the sandbox's VMM (COLLIMATE_TRACE=2 did not reach it)"
    assert first == second, f"first exec trapped {first}, second {second}"


def test_the_template_warm_up_leaves_nothing_a_sandbox_sees(client):
    # The warm-up exec ran in the template's agent before its snapshot: a sandbox's namespace is
    # still the template's, its PRNG is its own exec's, and nothing is left on its disk or stdout.
    with Sandbox("python", client=client) as a, Sandbox("python", client=client) as b:
        code = ("print(sorted(globals()))\nimport os, random\nprint(random.random())\n"
                "print(sorted(os.listdir('/tmp')), sorted(os.listdir('/work')))")
        ra, rb = a.exec(code=code, seed=SEED), b.exec(code=code, seed=SEED)
        assert ra.ok and rb.ok, (ra, rb)
        names, rand, dirs = ra.stdout.splitlines()
        assert names == "['__builtins__', '__doc__', '__loader__', '__name__', '__package__', '__spec__']"
        assert dirs == "[] []", dirs
        assert ra.stdout == rb.stdout and ra.seed_ack == rb.seed_ack == "verified"


def test_taking_a_spare_does_not_start_a_thread_while_the_spare_thread_lingers():
    # Starting the spare thread cost each sandbox's enter 0.1-0.2 ms (Thread.start waits for the
    # new thread to run); it now stays LINGER seconds once the pool is full, and a sandbox taken
    # meanwhile wakes it. Fails on the previous live.py (the thread ended with the pool full: each
    # take started another).
    from collimate_core.sdk import live

    own = EmbeddedClient(platform="systrap")
    os.environ["COLLIMATE_SYSTRAP_RECYCLE"] = "0"  # spares taken, not recycled sandboxes
    try:
        t = own._template("python")
    finally:
        os.environ.pop("COLLIMATE_SYSTRAP_RECYCLE", None)
    try:
        _wait_for_spares(t, 2)
        idents = []
        for _ in range(3):
            with Sandbox("python", client=own) as sb:
                assert sb.warm_hit and sb.exec(code="x = 1").ok
            _wait_for_spares(t, 2)
            time.sleep(live.REFILL_AFTER)
            idents.append(sorted(th.ident for th in threading.enumerate() if th.name == "collimate-systrap-spares"))
        assert idents[0] and idents[0] == idents[1] == idents[2], idents
    finally:
        own.close()
    # And it goes with its template.
    for _ in range(100):
        if not any(th.name == "collimate-systrap-spares" for th in threading.enumerate()):
            break
        time.sleep(0.05)
    assert not any(th.name == "collimate-systrap-spares" for th in threading.enumerate())


def _exec_events(err: str, vmm: int) -> list[dict[str, list[str]]]:
    """Per exec of the sandbox whose top VMM is `vmm` (from its `serve.run` to its
    `serve.replied`): each process's trace marks and stub commands, by host pid ("P": the top)."""
    execs, cur = [], None
    for line in err.splitlines():
        f = line.split()
        if len(f) < 4 or f[0] != "collimate-trace":
            continue
        who = "P" if f[2] == str(vmm) else f[2]
        if who == "P" and f[3] == "serve.run":
            cur = {}
            execs.append(cur)
        if cur is None:
            continue
        cur.setdefault(who, []).append(" ".join(f[3:]))
        if who == "P" and f[3] == "serve.replied":
            cur = None
    return execs


def test_an_exec_of_a_command_forks_no_stub_on_its_path_and_is_reaped_before_its_teardown(capfd, monkeypatch):
    # docs/systrap.md, "Where exec(command="true") goes": from the agent's second spawn call on,
    # its VMM keeps an empty stub (the agent's stub forked with the agent's memory advised out)
    # and forks the next call's stub from it after each reply, so an exec's spawn makes no stub
    # command at all on its path (before: `CMD_ADVISE` out, `CMD_FORK` of the agent's stub,
    # `CMD_ADVISE` back: "cmd 1004", "cmd 1003", "cmd 1004"). And the child VMM's exit hands its
    # memory to a helper (`vmm::teardown`), so the agent's wait returns before it is freed.
    # Fails on main (3 stub commands per exec's spawn; no deferred teardown); the first with
    # COLLIMATE_SYSTRAP_SPARE=0 too.
    monkeypatch.setenv("COLLIMATE_TRACE", "2")
    own = EmbeddedClient(platform="systrap")
    try:
        with Sandbox("python", client=own) as sb:
            vmm = sb._box.vm.pid
            for _ in range(3):
                assert sb.exec(command="true").ok
            capfd.readouterr()
            results = []
            for i in range(4):
                # Idle time between execs, as a trainer's between its commands: the stub for the
                # next call is made in it (when the next request is already there, that request
                # goes first and the call forks the empty stub on its path: one command).
                time.sleep(0.1)
                results.append(sb.exec(command=f"echo {i}; exit {i}"))
            # The VMM marks `serve.replied` after its reply is sent: the last one may still be on
            # its way when the exec returns (bounded wait; missing, the asserts below say so).
            err = capfd.readouterr().err
            deadline = time.monotonic() + 5
            while err.count(f" {vmm} serve.replied") < 4 and time.monotonic() < deadline:
                time.sleep(0.02)
                err += capfd.readouterr().err
    finally:
        own.close()
    assert [(r.exit_code, r.stdout) for r in results] == [(i, f"{i}\n") for i in range(4)], results
    execs = _exec_events(err, vmm)
    assert len(execs) == 4, err[-3000:]
    for ev in execs:
        top = ev["P"]
        assert "spawn.enter" in top, top
        commands = [e for e in top[top.index("spawn.enter"):top.index("serve.replied")] if e.startswith("cmd ")]
        assert commands in ([], ["cmd 1003"]), f"the agent's VMM handed its stubs {commands} on the exec's path"
    # The stub made in the idle time was taken (all four here, unless the host starved the VMM
    # for the whole pause).
    assert sum("spawn.spare" in ev["P"] for ev in execs) >= 1, execs
    for ev in execs:
        children = [marks for pid, marks in ev.items() if pid != "P"]
        assert len(children) == 1 and "teardown.deferred" in children[0], children


def test_a_command_sees_what_the_agent_changed_since_its_spare_was_made(client):
    # The spawn's empty stub is made between execs; the child VMM is still forked at the call, so
    # a command sees the agent's state at the call: cwd, environment, umask, rlimits, ignored
    # signals, open files (a file the agent opened without close-on-exec is closed by the spawn's
    # close_fds, as subprocess.run does). Passes on main too (the stub holds no guest state);
    # guards that it stays so.
    with client.session("python") as s:
        for _ in range(3):
            assert s.exec(command="true").ok
        setup = (
            "import os, resource, signal\nos.makedirs('/tmp/wd', exist_ok=True)\nos.chdir('/tmp/wd')\n"
            "os.environ['SPARE_X'] = 'x1'\nos.umask(0o027)\n"
            "resource.setrlimit(resource.RLIMIT_NOFILE, (77, 77))\n"
            "signal.signal(signal.SIGINT, signal.SIG_IGN)\n"
            "keep = os.open('/tmp/wd', os.O_RDONLY)\nos.set_inheritable(keep, True)\nprint(keep)"
        )
        r = s.exec(code=setup)
        assert r.ok, r
        fd = int(r.stdout)
        r = s.exec(command=f"pwd; echo $SPARE_X; umask; ulimit -n; kill -INT $$; echo alive; [ -e /proc/self/fd/{fd} ] && echo open || echo closed")
        assert (r.exit_code, r.stdout) == (0, "/tmp/wd\nx1\n0027\n77\nalive\nclosed\n"), r
        # Changed again: the next command sees the new state, not the one of the spare's making.
        r = s.exec(code="os.chdir('/'); os.environ['SPARE_X'] = 'x2'; signal.signal(signal.SIGINT, signal.SIG_DFL)")
        assert r.ok, r
        r = s.exec(command="pwd; echo $SPARE_X; kill -INT $$; echo alive")
        assert (r.exit_code, r.stdout) == (130, "/\nx2\n"), r


def test_a_seeded_command_replays_with_spare_stubs(client):
    # The same seed gives the same output whether the spawn's stub was made ahead or not: the
    # CRNG and the virtual clocks are the VMM's, at the call.
    cmd = "echo $RANDOM $RANDOM; date +%s; python3 -c 'import os, time; print(os.urandom(8).hex()); print(time.time())'"
    outs = []
    for _ in range(2):
        with client.session("python") as s:
            for _ in range(3):
                assert s.exec(command="true", seed=SEED).ok
            r = s.exec(command=cmd, seed=SEED)
            assert r.ok and r.seed_ack == "verified", r
            outs.append(r.stdout)
    with client.session("python") as s:
        r = s.exec(command=cmd, seed=SEED)  # the first spawn: no spare yet
        assert r.ok, r
        outs.append(r.stdout)
    assert outs[0] == outs[1], outs
    # The CRNG's draws; not the clocks, which the three execs before moved on, nor the shell's
    # $RANDOM, which it seeds with its pid (the third session's command is its second process).
    crng = [o.split("\n")[2] for o in outs]
    assert crng[2] == crng[0] and len(crng[0]) == 16, outs
