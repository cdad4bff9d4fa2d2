"""A trainer's first step on a fresh host: many threads and processes reach for the same cache
entries at once, on a cache that starts empty (python/collimate_core/templates/cache.py has the rules).

Each test runs on a COLLIMATE_CACHE of its own that starts empty, without COLLIMATE_ROOTFS, so
that the python template's root filesystem is built too. Downloaded Debian packages are inputs,
kept outside it (COLLIMATE_DEB_CACHE, else the surrounding cache's), and so is the image the
image template is baked from (COLLIMATE_IMAGES). "Built exactly once" is read from the cache's
build log, `<cache>/builds.jsonl`, which every finished build appends one line to.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
from collections import Counter
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))

from collimate_core import EmbeddedClient, UnitTestReward, grade_batch, rollout_once
from collimate_core.templates import cache as _cache
from imagefixtures import Layer, busybox_layer, write_docker_save

REPO = Path(__file__).resolve().parents[1]
THREADS, PROCESSES = 8, 3
IMAGE = "toolbox:1.0"
SPEC = dict(tests="assert solve([3, 1, 2]) == [1, 2, 3]\nassert solve([]) == []\n")
GOOD, BAD = "def solve(xs):\n    return sorted(xs)\n", "def solve(xs):\n    return xs\n"


def work(client) -> None:
    """What one worker does, in a thread of this process or in a process of its own: the catalog
    template, an image template (a busybox image without Python: command execs through the
    collimate-exec helper), and a grading spec."""
    r = rollout_once("python", code="print(6 * 7)", client=client)
    assert r.ok and r.stdout == "42\n" and r.seed_ack == "verified", r
    r = rollout_once(IMAGE, command="echo $FROM_ENTRYPOINT; cat /etc/motd", client=client)
    assert r.ok and r.stdout == "yes\ntoolbox motd\n", r
    rewards = [g.reward for g in grade_batch([GOOD, BAD], UnitTestReward(**SPEC), client=client)]
    assert rewards == [1.0, 0.0], rewards


pytestmark = [
    pytest.mark.kvm,
    pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm"),
    pytest.mark.skipif(not (shutil.which("apt-get") and shutil.which("dpkg")),
                       reason="building a root filesystem needs Debian's apt-get and dpkg"),
]


@pytest.fixture
def fresh(tmp_path, monkeypatch):
    """(an empty cache, the environment for processes using it). This process uses it too."""
    outer_root = os.environ.get("COLLIMATE_ROOTFS")
    if not outer_root:
        if os.environ.get("COLLIMATE_REQUIRE_KVM") == "1":
            pytest.fail("COLLIMATE_ROOTFS is not set: build it with `python3 guest/rootfs/build.py`")
        pytest.skip("no python rootfs to take the image's busybox from (set COLLIMATE_ROOTFS)")
    cache, images = tmp_path / "cache", tmp_path / "images"
    cache.mkdir()
    images.mkdir()
    extra = Layer().dir("work").file("etc/motd", b"toolbox motd\n").bytes()
    cfg = {"Env": ["PATH=/bin"], "Entrypoint": ["/bin/env", "FROM_ENTRYPOINT=yes"], "WorkingDir": "/work"}
    write_docker_save(images / "toolbox.tar", [busybox_layer(Path(outer_root) / "usr/bin/busybox"), extra], cfg,
                      repo_tags=[IMAGE])
    env = {
        "COLLIMATE_CACHE": str(cache),
        "COLLIMATE_IMAGES": str(images),
        "COLLIMATE_DEB_CACHE": str(_cache.deb_dir(_cache.cache_dir())),  # before the switch below
    }
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.delenv("COLLIMATE_ROOTFS")
    penv = {**os.environ, "PYTHONPATH": os.pathsep.join([str(REPO / "python"), os.environ.get("PYTHONPATH", "")])}
    return cache, penv


def leftovers(cache: Path, records: list[dict]) -> list[str]:
    """What the cache holds besides finished entries (the builds' paths) and their indexes."""
    entries = {Path(r["path"]).relative_to(cache) for r in records}
    allowed = {Path(_cache.BUILD_LOG), Path("templates/python.json")}
    for e in entries:
        if e.parts[:2] == ("templates", "images"):  # <name>-<hash>/v<N>: the name's index and lock
            allowed |= {e.parent / "index.json", e.parent / ".lock"}
    found = []

    def walk(d: Path) -> None:
        for p in sorted(d.iterdir()):
            rel = p.relative_to(cache)
            if rel in entries or rel in allowed:
                continue
            if p.is_dir() and not p.is_symlink() and any(e.is_relative_to(rel) for e in entries | allowed):
                walk(p)
            else:
                found.append(str(rel))

    walk(cache)
    found += [str(p.relative_to(cache)) for p in cache.rglob("*.tmp")]  # inside entries too
    return found


def test_threads_and_processes_on_an_empty_cache_build_each_artefact_once(fresh):
    cache, penv = fresh
    script = textwrap.dedent(f"""
        import sys
        sys.path.insert(0, {str(REPO / "tests")!r})
        from collimate_core import EmbeddedClient
        from test_first_use import work
        client = EmbeddedClient(cache={str(cache)!r})
        print("ready", flush=True)
        sys.stdin.readline()  # go
        work(client)
        client.close()
        print("ok", flush=True)
    """)
    procs = [subprocess.Popen([sys.executable, "-c", script], env=penv, cwd=REPO, text=True,
                              stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
             for _ in range(PROCESSES)]
    try:
        for p in procs:
            assert p.stdout.readline() == "ready\n", p.communicate()[1][-3000:]
        client = EmbeddedClient(cache=cache)
        start = threading.Barrier(THREADS + 1)
        errors: list[BaseException] = []

        def thread() -> None:
            start.wait()
            try:
                work(client)
            except BaseException as e:  # noqa: BLE001 - reported below
                errors.append(e)

        threads = [threading.Thread(target=thread) for _ in range(THREADS)]
        for t in threads:
            t.start()
        for p in procs:  # all at once: the processes and the threads
            p.stdin.write("go\n")
            p.stdin.flush()
        start.wait()
        for t in threads:
            t.join()
        outs = [p.communicate(timeout=900) for p in procs]
        client.close()
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert not errors, errors
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0 and out == "ok\n", err[-3000:]

    records = _cache.builds(cache)
    kinds = Counter(r["kind"] for r in records)
    # The python template's root filesystem and the template, the image's tree, the helper, the
    # image template and the grading template: each built once, by one of the 11 workers.
    assert kinds == {"rootfs": 1, "template": 1, "image-rootfs": 1, "exec-helper": 1, "image-template": 1,
                     "grading": 1}, json.dumps(records, indent=1)
    assert {r["pid"] for r in records} <= {os.getpid(), *(p.pid for p in procs)}
    assert leftovers(cache, records) == []


KILLED = """
import os, sys, time
from pathlib import Path
from collimate_core.templates import oci as _oci, rootfs as _rootfs
cache, what = Path(sys.argv[1]), sys.argv[2]

def stop_at(prefix):
    def say(msg):
        if msg.startswith(prefix):  # the build holds its lock and has a half-made tree now
            print("mid", flush=True)
            time.sleep(3600)
    return say

if what == "rootfs":
    _rootfs.build_rootfs("python", cache=cache, progress=stop_at("extract [5/"))
else:
    img = _oci.resolve("toolbox:1.0", _oci.default_store(cache))
    _oci.build_rootfs(img, cache, stop_at("applied layer 1/"))
"""


@pytest.mark.parametrize("what", ["rootfs", "image-rootfs"])
def test_a_build_killed_midway_leaves_nothing_the_next_one_trips_over(fresh, what):
    cache, penv = fresh
    p = subprocess.Popen([sys.executable, "-c", KILLED, str(cache), what], env=penv, text=True,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert p.stdout.readline() == "mid\n", p.communicate()[1][-3000:]
        parent = cache / ("rootfs" if what == "rootfs" else "images/rootfs")
        half = [q for q in parent.iterdir() if q.name.endswith(".tmp")]
        locks = [q for q in parent.iterdir() if q.name.endswith(".lock")]
        assert len(half) == 1 and any(half[0].iterdir()) and len(locks) == 1, sorted(parent.iterdir())
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()

    if what == "rootfs":
        from collimate_core.templates import rootfs as _rootfs

        root = _rootfs.build_rootfs("python", cache=cache)
        assert (root / _rootfs.MANIFEST).is_file() and (root / "usr/bin/python3").exists()
    else:
        from collimate_core.templates import oci as _oci

        img = _oci.resolve(IMAGE, _oci.default_store(cache))
        try:
            root, created = _oci.build_rootfs(img, cache)
        finally:
            img.close()
        assert created and (root / "etc/motd").read_text() == "toolbox motd\n"
    # The killed build's lock died with it; its half tree was swept by the next build.
    assert not half[0].exists()
    assert sorted(q.name for q in parent.iterdir()) == [root.name]
    records = _cache.builds(cache)
    assert [r["kind"] for r in records] == [what] and records[0]["pid"] == os.getpid()
    assert leftovers(cache, records) == []
