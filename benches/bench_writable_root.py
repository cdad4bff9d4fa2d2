"""What a writable root costs (docs/templates.md, "The writable root"; crates/engine/src/overlay.rs).

Two templates baked from the same image in this run, one with the default writable root (each
sandbox mounts the host's overlayfs over the image, its copy-up layer on the sandbox's tmpfs) and
one with `read_only_root=True`; the same operations on each, next to host baselines from the same
run: `os.fork() + _exit + waitpid` (the table's ratio) and `/bin/sh -c 'echo 1'` called directly.
Timings are printed, never asserted. Run: `pytest benches/bench_writable_root.py`.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from collimate_rl import Image, Template, connect
from conftest import host_fork_baseline

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

ROUNDS = 150
WIDTH = 16
GAP = 0.003  # a trainer works between rollouts; meanwhile the zygote refills its spare clones


@pytest.fixture(scope="module")
def templates():
    client = connect()
    image = Image.debian_slim()
    handles = {
        "rw": Template.bake(client, name="bench-writable-root", image=image),
        "ro": Template.bake(client, name="bench-read-only-root", image=image, read_only_root=True),
    }
    for h in handles.values():
        st = h.wait(timeout=900)
        assert st.phase == "Live", st.log
    for h in handles.values():  # warm each path once
        with client.session(h) as s:
            s.exec(command="echo 1")
    yield client, handles
    for name in ("bench-writable-root", "bench-read-only-root"):
        Template.delete(client, name)


def _drain(client) -> None:
    """Untimed: wait for sandboxes destroyed in the last round to be torn down or recycled."""
    client._reaper.submit(lambda: None).result()


def test_host_fork_baseline(benchmark):
    host_fork_baseline(benchmark)


def test_host_sh_echo(benchmark):
    """The native command: /bin/sh -c 'echo 1' called directly, output captured."""
    benchmark.pedantic(lambda: subprocess.run(["/bin/sh", "-c", "echo 1"], capture_output=True, check=True),
                       rounds=ROUNDS, warmup_rounds=5)


def _enter_exec_exit(benchmark, client, handle):
    def cycle():
        with client.session(handle) as s:
            r = s.exec(command="echo 1")
        assert r.stdout == "1\n", r

    benchmark.pedantic(cycle, setup=lambda: time.sleep(GAP), rounds=ROUNDS, warmup_rounds=5)


def test_enter_exec_exit_read_only_root(benchmark, templates):
    client, h = templates
    _enter_exec_exit(benchmark, client, h["ro"])


def test_enter_exec_exit_writable_root(benchmark, templates):
    client, h = templates
    _enter_exec_exit(benchmark, client, h["rw"])


def _fork(benchmark, client, handle, width):
    with client.session(handle) as s:
        # With a writable root, the parent has copied up a few files its children inherit.
        s.exec(command="touch /tmp/x; mkdir -p /usr/local/lib/p 2>/dev/null; echo a > /usr/local/lib/p/a 2>/dev/null; true")

        def group():
            with s.fork_group(width) as grp:
                out = grp.map(lambda i, c: c.exec(command="true").exit_code)
            assert out == [0] * width

        benchmark.pedantic(group, setup=lambda: _drain(client), rounds=ROUNDS if width == 1 else 20, warmup_rounds=2)
    _drain(client)


def test_fork_1_exec_read_only_root(benchmark, templates):
    client, h = templates
    _fork(benchmark, client, h["ro"], 1)


def test_fork_1_exec_writable_root(benchmark, templates):
    client, h = templates
    _fork(benchmark, client, h["rw"], 1)


def test_fork_group_16_map_read_only_root(benchmark, templates):
    client, h = templates
    _fork(benchmark, client, h["ro"], WIDTH)


def test_fork_group_16_map_writable_root(benchmark, templates):
    client, h = templates
    _fork(benchmark, client, h["rw"], WIDTH)


def test_fork_1_exec_alternated_writable_root(benchmark, templates):
    """The fork row again with the two templates alternated round by round (this machine's load
    drifts over a run): each timed writable-root round follows one read-only-root round, whose
    median and p99 go in extra_info."""
    client, h = templates
    ro_times: list[float] = []
    with client.session(h["ro"]) as ro, client.session(h["rw"]) as rw:
        for s in (ro, rw):
            s.exec(command="touch /tmp/x; mkdir -p /usr/local/lib/p 2>/dev/null; echo a > /usr/local/lib/p/a 2>/dev/null; true")

        def fork_exec(s):
            with s.fork_group(1) as grp:
                assert grp[0].exec(command="true").exit_code == 0

        def setup():
            _drain(client)
            t = time.perf_counter()
            fork_exec(ro)
            ro_times.append(time.perf_counter() - t)
            _drain(client)

        benchmark.pedantic(lambda: fork_exec(rw), setup=setup, rounds=ROUNDS, warmup_rounds=2)
    _drain(client)
    ro_times = sorted(ro_times[2:])  # as the warmup rounds
    benchmark.extra_info["read_only_root_median_ms"] = round(ro_times[len(ro_times) // 2] * 1e3, 1)
    benchmark.extra_info["read_only_root_p99_ms"] = round(ro_times[max(0, -(-99 * len(ro_times) // 100) - 1)] * 1e3, 1)
