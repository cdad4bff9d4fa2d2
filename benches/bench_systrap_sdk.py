"""The SDK's hot paths on kvm and on systrap side by side (`EmbeddedClient(platform=...)`), each
beside a native baseline measured in the same run; see benches/conftest.py for the summary table
(median, p99, ratio to a host fork) and the `x_native` ratio under it:

- `exec(command="true")` in a live session against `/bin/sh -c true` called directly;
- a sandbox from the catalog "python" template, one `exec(code=...)`, and its exit (a clone of the
  zygote on both platforms; kvm may serve it from its spare pool or a recycled sandbox, systrap
  from the SDK's spares, made ahead by a thread of the client) against `/usr/bin/python3 -c "x = 1"` called directly;
- `fork_group(4)` and `fork_group(64)` of a session and one exec of code in each child (`map`);
- on systrap, `exec(command="true")` with the engine's spawn call refused
  (`COLLIMATE_SYSTRAP_SPAWN=0`: the agent's subprocess fallback, what systrap did before it served
  the call), beside the row above;
- on systrap, the template's zygote restored from its systrap snapshot (what the client uses now,
  sdk/live.py) against a live zygote (the agent booted in this process, what it used before): a
  clone of each (`Vm.clone()` + destroy), a fresh VMM restored from the snapshot file
  (`Vm.restore` + destroy), and a sandbox of each (enter + `exec(code)` + exit, no spares), against
  `/usr/bin/python3 -c "x = 1"` called directly.

Needs seccomp filters for the systrap rows and /dev/kvm for the kvm rows.
"""

from __future__ import annotations

import os
import statistics
import subprocess

import pytest
from collimate_core import EmbeddedClient, Sandbox

from conftest import host_fork_baseline

PLATFORMS = ["kvm", "systrap"]
_medians: dict[str, float] = {}


def _record(benchmark, name: str, baseline: str | None = None) -> None:
    _medians[name] = statistics.median(benchmark.stats.stats.data)
    if baseline and baseline in _medians:
        benchmark.extra_info["x_native"] = round(_medians[name] / _medians[baseline], 2)


@pytest.fixture(scope="module", params=PLATFORMS)
def client(request):
    platform = request.param
    if platform == "kvm" and not os.path.exists("/dev/kvm"):
        pytest.skip("needs /dev/kvm")
    c = EmbeddedClient(platform=platform)
    with c.session("python") as s:  # the template's first use (a bake or a zygote start) is not measured
        assert s.exec(command="true").ok
    yield c
    c.close()


def test_host_fork_baseline(benchmark):
    host_fork_baseline(benchmark)


def test_native_sh_true(benchmark):
    benchmark.pedantic(lambda: subprocess.run(["/bin/sh", "-c", "true"], check=True), rounds=40, warmup_rounds=3)
    _record(benchmark, "native true")


def test_native_python(benchmark):
    benchmark.pedantic(lambda: subprocess.run(["/usr/bin/python3", "-c", "x = 1"], check=True), rounds=20,
                       warmup_rounds=2)
    _record(benchmark, "native python")


def test_session_exec_true(benchmark, client):
    with client.session("python") as s:
        def run():
            assert s.exec(command="true").ok

        benchmark.pedantic(run, rounds=40, warmup_rounds=3)
    benchmark.extra_info["platform"] = client.platform
    _record(benchmark, f"{client.platform} exec true", "native true")


def test_session_exec_true_subprocess_fallback(benchmark):
    from collimate_core.sdk import platform as pf

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    os.environ["COLLIMATE_SYSTRAP_SPAWN"] = "0"  # read by the zygote's VMM, which its clones inherit
    try:
        c = EmbeddedClient(platform="systrap")
        s = c.session("python")
        s.__enter__()
    finally:
        os.environ.pop("COLLIMATE_SYSTRAP_SPAWN", None)
    try:
        def run():
            assert s.exec(command="true").ok

        benchmark.pedantic(run, rounds=40, warmup_rounds=3)
    finally:
        s.__exit__(None, None, None)
        c.close()
    benchmark.extra_info["platform"] = "systrap"
    _record(benchmark, "systrap exec true, subprocess fallback", "native true")


def test_sandbox_exec_exit(benchmark, client):
    def run():
        with Sandbox("python", client=client) as sb:
            assert sb.exec(code="x = 1").ok

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    benchmark.extra_info["platform"] = client.platform
    _record(benchmark, f"{client.platform} sandbox", "native python")


@pytest.mark.parametrize("n, rounds", [(4, 10), (64, 3)], ids=["fork_group_4_map", "fork_group_64_map"])
def test_fork_group_map(benchmark, client, n, rounds):
    with client.session("python") as s:
        s.exec(code="x = 1")

        def run():
            with s.fork_group(n) as grp:
                assert all(r.ok for r in grp.map(lambda i, c: c.exec(code=f"y = x + {i}")))

        benchmark.pedantic(run, rounds=rounds, warmup_rounds=1)
    benchmark.extra_info["platform"] = client.platform


@pytest.fixture(scope="module")
def zygotes():
    """The systrap client's restored "python" zygote and a live one beside it (`python-live`: the
    agent booted and run to its ready point in this process, no snapshot), neither with spares."""
    from collimate_core.sdk import live, platform as pf
    from collimate_core.templates import catalog

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    c = EmbeddedClient(platform="systrap")
    with c.session("python") as s:  # makes the snapshot if there is none (not measured)
        assert s.exec(code="x = 1").ok
    restored = c._templates["python"]
    assert restored.restored_from is not None
    booted = live.LiveTemplate("python-live", restored.baked.root, restored.disk_quota, restored.shared_memory,
                               catalog.guest_cpus())
    assert booted.restored_from is None
    c.register_template("python-live", booted)
    c.expect_width("python", 0)
    c.expect_width("python-live", 0)
    yield c, restored, booted
    c.close()


@pytest.mark.parametrize("which", ["live", "restored"])
def test_systrap_zygote_clone(benchmark, zygotes, which):
    _, restored, booted = zygotes
    z = (booted if which == "live" else restored).zygote

    def run():
        z.clone().destroy()

    benchmark.pedantic(run, rounds=40, warmup_rounds=3)
    benchmark.extra_info["platform"] = "systrap"
    _record(benchmark, f"systrap clone of a {which} zygote", "native python")


def test_systrap_restore_from_snapshot(benchmark, zygotes):
    from collimate_core._core import Vm

    snap = zygotes[1].restored_from

    def run():
        Vm.restore(snap).destroy()

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    benchmark.extra_info["platform"] = "systrap"
    _record(benchmark, "systrap restore of the snapshot", "native python")


@pytest.mark.parametrize("which", ["live", "restored"])
def test_systrap_sandbox_of_a_zygote(benchmark, zygotes, which):
    c = zygotes[0]
    name = "python-live" if which == "live" else "python"

    def run():
        with Sandbox(name, client=c) as sb:
            assert sb.exec(code="x = 1").ok

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    benchmark.extra_info["platform"] = "systrap"
    _record(benchmark, f"systrap sandbox of a {which} zygote", "native python")
