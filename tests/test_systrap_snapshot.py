"""Systrap snapshots through the SDK (sdk/live.py, docs/systrap.md): the catalog "python" template's
zygote is checkpointed into the cache once (templates/systrap/) and every client process restores
it from there instead of booting the agent again, so a second process uses the template without
re-baking it and its seeded runs read what the first process's read, virtual clocks included (as
on kvm). Needs seccomp filters (systrap) and the python root filesystem; not /dev/kvm.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from collimate_rl import EmbeddedClient, rollout_once
from collimate_core.sdk import platform as pf

sys.path.insert(0, str(Path(__file__).resolve().parent))

pytestmark = pytest.mark.skipif(not pf.probe_systrap().available,
                                reason="this host does not allow seccomp filters (systrap)")

SEED = "c0ffee00" * 8
CODE = "import time, random, os\nprint(time.time(), time.monotonic(), random.random(), os.urandom(4).hex())"

# The second client process: the same cache, a session with state across execs, a seeded run.
SECOND = r"""
import json, sys
from collimate_rl import EmbeddedClient, rollout_once
c = EmbeddedClient(platform="systrap", cache=sys.argv[1])
with c.session("python") as s:
    a = s.exec(code="x = 41")
    b = s.exec(code="import os\nprint(x + 1, os.getcwd())")
seeded = rollout_once("python", code=sys.argv[2], seed=sys.argv[3], client=c)
t = c._templates["python"]
print(json.dumps({"restored_from": str(t.restored_from), "out": b.stdout, "ok": a.ok and b.ok,
                  "seeded": seeded.stdout, "ack": seeded.seed_ack}))
c.close()
"""


def test_a_second_process_restores_the_template_instead_of_baking_it(tmp_path):
    cache = tmp_path / "cache"
    c = EmbeddedClient(platform="systrap", cache=cache)
    try:
        with c.session("python") as s:
            assert s.exec(code="print(6 * 7)").stdout == "42\n"
        t = c._templates["python"]
        snap = t.restored_from
        assert snap is not None and snap.parent == cache / "templates" / "systrap", snap
        assert (snap / "systrap.state").is_file() and (snap / "systrap.mem").is_file()
        first = rollout_once("python", code=CODE, seed=SEED, client=c)
        assert first.ok and first.seed_ack == "verified", first
    finally:
        c.close()
    made = (snap / "systrap.state").stat().st_mtime_ns

    env = dict(os.environ)
    env.pop("COLLIMATE_API_KEY", None)
    r = subprocess.run([sys.executable, "-c", SECOND, str(cache), CODE, SEED], capture_output=True, text=True,
                       timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    # The same snapshot, not a new bake: the file was not written again.
    assert out["restored_from"] == str(snap)
    assert (snap / "systrap.state").stat().st_mtime_ns == made
    assert out["ok"] and out["out"] == "42 /work\n", out
    # One template state for every process: a seed replays in the other process, clocks too
    # (before, each process booted its own zygote, whose clocks started at its own start).
    assert out["seeded"] == first.stdout and out["ack"] == "verified", (out, first.stdout)


def test_a_damaged_snapshot_is_made_again(tmp_path):
    cache = tmp_path / "cache"
    c = EmbeddedClient(platform="systrap", cache=cache)
    try:
        with c.session("python") as s:
            assert s.exec(code="print(1)").ok
        snap = c._templates["python"].restored_from
    finally:
        c.close()
    state = snap / "systrap.state"
    data = bytearray(state.read_bytes())
    data[len(data) // 2] ^= 0x5A
    state.write_bytes(bytes(data))
    # A cache entry: the engine refuses it (its CRC), and the client makes it again.
    c = EmbeddedClient(platform="systrap", cache=cache)
    try:
        with c.session("python") as s:
            assert s.exec(code="print(2)").stdout == "2\n"
        assert c._templates["python"].restored_from == snap
        assert state.read_bytes() != bytes(data)
    finally:
        c.close()


HOLDER = """
import fcntl, sys, time
f = open(sys.argv[1], "a+")
fcntl.flock(f, fcntl.LOCK_SH)
print("held", flush=True)
time.sleep(600)
"""


def test_snapshots_of_earlier_template_states_are_removed_unless_in_use(tmp_path):
    """A new template state (another root filesystem, agent or engine format) leaves the earlier
    states' snapshots behind: the client that makes or restores the current one removes them,
    but not one another process still uses (its hold, `templates.cache.hold`), nor another
    template's, nor the one it uses itself."""
    from collimate_core.templates import cache as cachelib

    cache = tmp_path / "cache"
    root = cache / "templates" / "systrap"
    old, held, other = root / "python-00000000000000a1", root / "python-00000000000000a2", root / "image-00000000000000a3"
    for d in (old, held, other):
        d.mkdir(parents=True)
        (d / "systrap.state").write_bytes(b"an earlier state")
        (d / "systrap.mem").write_bytes(bytes(4096))
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True)
    dead_tmp = cachelib.temp_path(root / "python-00000000000000a4").with_name(
        f".python-00000000000000a4.{gone.stdout.strip()}.1-0000.tmp")
    dead_tmp.mkdir()
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(held / ".hold")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        c = EmbeddedClient(platform="systrap", cache=cache)
        try:
            with c.session("python") as s:
                assert s.exec(code="print(3)").stdout == "3\n"
            snap = c._templates["python"].restored_from
            assert snap is not None and snap.parent == root and snap not in (old, held)
            assert not old.exists(), "an unused snapshot of an earlier state was kept"
            assert not dead_tmp.exists(), "a killed writer's temporary was kept"
            assert (held / "systrap.state").is_file(), "a snapshot another process holds was removed"
            assert (other / "systrap.state").is_file(), "another template's snapshot was removed"
            # This process holds the one it restored: no other process's prune can remove it.
            assert not cachelib.remove_unheld(snap) and (snap / "systrap.state").is_file()
        finally:
            c.close()
    finally:
        holder.kill()
        holder.wait()
    # Once no one holds it, the next client's prune removes it.
    c = EmbeddedClient(platform="systrap", cache=cache)
    try:
        with c.session("python") as s:
            assert s.exec(code="print(4)").stdout == "4\n"
        assert not held.exists() and (other / "systrap.state").is_file()
    finally:
        c.close()


# Grading's prepared template (grading/pool.py): a sandbox after the spec's setup, checkpointed
# once into the cache and restored by every process, its state (what the setup left in the
# interpreter and in /work) in every candidate's sandbox.
SETUP = "import json\nopen('/work/data.json', 'w').write('[3, 1, 2]')\nDATA = json.load(open('/work/data.json'))\n"
TESTS = "assert solve(DATA) == [1, 2, 3]\nassert open('/work/data.json').read() == '[3, 1, 2]'\n"
GOOD = "def solve(x):\n    return sorted(x)\n"

GRADE_AGAIN = r"""
import json, sys
from collimate_rl import EmbeddedClient, UnitTestReward, grade
c = EmbeddedClient(platform="systrap", cache=sys.argv[1])
spec = UnitTestReward(template="python", setup=sys.argv[2], tests=sys.argv[3])
r = grade(sys.argv[4], spec, client=c)
names = [n for n in c._templates if n.startswith("__grading__-")]
print(json.dumps({"reward": r.reward, "from": [str(c._templates[n].restored_from) for n in names]}))
c.close()
"""


def test_a_prepared_sandbox_is_snapshotted_once_and_restored_in_another_process(tmp_path):
    from collimate_rl import UnitTestReward, grade

    cache = tmp_path / "cache"
    spec = UnitTestReward(template="python", setup=SETUP, tests=TESTS)
    c = EmbeddedClient(platform="systrap", cache=cache)
    try:
        assert grade(GOOD, spec, client=c).reward == 1.0
        assert grade("def solve(x):\n    return x\n", spec, client=c).reward == 0.0
        names = [n for n in c._templates if n.startswith("__grading__-")]
        assert len(names) == 1, list(c._templates)
        entry = c._templates[names[0]].restored_from
        assert entry is not None and entry.parent == cache / "grading" and (entry / "systrap.state").is_file()
    finally:
        c.close()
    made = (entry / "systrap.state").stat().st_mtime_ns
    env = {k: v for k, v in os.environ.items() if k != "COLLIMATE_API_KEY"}
    r = subprocess.run([sys.executable, "-c", GRADE_AGAIN, str(cache), SETUP, TESTS, GOOD], capture_output=True,
                       text=True, timeout=600, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"reward": 1.0, "from": [str(entry)]}, out
    assert (entry / "systrap.state").stat().st_mtime_ns == made


# An image template baked on systrap is committed to the template store (a systrap snapshot of its
# zygote after the Ready step); another process restores that version instead of baking again, and
# a kvm client is told the version is systrap's.
USE_IMAGE = r"""
import json, sys
from collimate_rl import EmbeddedClient
c = EmbeddedClient(platform="systrap", cache=sys.argv[1])
with c.session("snapbox") as s:
    r = s.exec(command="cat /work/mark; echo $TOOL")
t = c._templates["snapbox"]
print(json.dumps({"out": r.stdout, "ok": r.ok, "from": str(t.restored_from)}))
c.close()
"""


def test_an_image_template_baked_on_systrap_is_used_by_another_process(tmp_path):
    from collimate_rl import PlatformUnavailable, Ready, Template
    from imagefixtures import Layer, busybox_layer, write_docker_save

    root = os.environ.get("COLLIMATE_ROOTFS")
    if not root:
        pytest.skip("no python rootfs (set COLLIMATE_ROOTFS)")
    store = tmp_path / "images"
    store.mkdir()
    write_docker_save(store / "toolbox.tar", [busybox_layer(Path(root) / "usr/bin/busybox"), Layer().dir("work").bytes()],
                      {"Env": ["PATH=/bin", "TOOL=box"], "WorkingDir": "/work"}, repo_tags=["toolbox:1.0"])
    c = EmbeddedClient(cache=tmp_path, platform="systrap")
    try:
        st = Template.bake(c, name="snapbox", image="toolbox:1.0", ready=Ready(cmd="echo baked > /work/mark")).wait(300)
        assert st.phase == "Live", st.log
        with c.session("snapbox") as s:
            assert s.exec(command="cat /work/mark").stdout == "baked\n"
        snap = c._templates["snapbox"].restored_from
        assert snap is not None and (snap / "systrap.state").is_file(), snap
        assert json.loads((snap.parent / "template.json").read_text())["platform"] == "systrap"
    finally:
        c.close()
    made = (snap / "systrap.state").stat().st_mtime_ns
    env = {k: v for k, v in os.environ.items() if k != "COLLIMATE_API_KEY"}
    r = subprocess.run([sys.executable, "-c", USE_IMAGE, str(tmp_path)], capture_output=True, text=True, timeout=600,
                       env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out == {"out": "baked\nbox\n", "ok": True, "from": str(snap)}, out
    assert (snap / "systrap.state").stat().st_mtime_ns == made  # not baked again
    if os.path.exists("/dev/kvm"):
        kvm = EmbeddedClient(platform="kvm", cache=tmp_path)
        try:
            with pytest.raises(PlatformUnavailable, match="baked on the systrap platform") as e:
                with kvm.session("snapbox"):
                    pass
            assert "connect(platform='systrap')" in str(e.value)
        finally:
            kvm.close()
