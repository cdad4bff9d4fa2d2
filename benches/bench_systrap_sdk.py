"""The SDK's hot paths on kvm and on systrap side by side (`EmbeddedClient(platform=...)`), each
beside a native baseline measured in the same run; see benches/conftest.py for the summary table
(median, p99, ratio to a host fork) and the `x_native` ratio under it:

- `exec(command="true")` in a live session against `/bin/sh -c true` called directly;
- a sandbox from the catalog "python" template, one `exec(code=...)`, and its exit (a clone of the
  zygote on both platforms; kvm may serve it from its spare pool or a recycled sandbox, systrap
  from the SDK's spares, made ahead by a thread of the client) against `/usr/bin/python3 -c "x = 1"` called directly;
- `fork_group(4)` and `fork_group(64)` of a session and one exec of code in each child (`map`);
- on systrap, the sandbox row paced (0.1 s between sandboxes, so each is a spare made and
  settled ahead, as where sandboxes are asked for with idle time between them), and with its
  clones' first-exec faults not taken ahead (`COLLIMATE_SYSTRAP_WARM=0`, vmm/systrap/warm.rs:
  what systrap did before), the two alternated round by round in one benchmark (the default is
  the timed row; the other's median and p99 are in its extra info);
- on systrap, `exec(command="true")` with the engine's spawn call refused
  (`COLLIMATE_SYSTRAP_SPAWN=0`: the agent's subprocess fallback, what systrap did before it served
  the call), beside the row above.

Needs seccomp filters for the systrap rows and /dev/kvm for the kvm rows.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time

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


def test_sandbox_exec_exit_paced_warm_ab(benchmark):
    """Systrap's sandbox row, paced, with spares that took their first exec's faults ahead (timed)
    and, alternated round by round, from a client whose clones do not (`COLLIMATE_SYSTRAP_WARM=0`)."""
    from collimate_core.sdk import platform as pf

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    os.environ["COLLIMATE_SYSTRAP_WARM"] = "0"  # read by the zygote's VMM, which its clones inherit
    try:
        cold = EmbeddedClient(platform="systrap")
        with cold.session("python") as s:
            assert s.exec(command="true").ok
    finally:
        os.environ.pop("COLLIMATE_SYSTRAP_WARM", None)
    warm = EmbeddedClient(platform="systrap")
    with warm.session("python") as s:
        assert s.exec(command="true").ok
    for c in (cold, warm):  # the template's first clones report their first exec (code)
        for _ in range(3):
            with Sandbox("python", client=c) as sb:
                assert sb.exec(code="x = 1").ok
    off: list[float] = []

    def one(c):
        with Sandbox("python", client=c) as sb:
            assert sb.exec(code="x = 1").ok

    def setup():
        time.sleep(0.1)
        t0 = time.perf_counter()
        one(cold)
        off.append(time.perf_counter() - t0)
        time.sleep(0.1)

    try:
        benchmark.pedantic(lambda: one(warm), setup=setup, rounds=30, warmup_rounds=2)
    finally:
        cold.close()
        warm.close()
    off.sort()
    benchmark.extra_info["platform"] = "systrap"
    benchmark.extra_info["warm_off_median_ms"] = round(statistics.median(off) * 1e3, 3)
    benchmark.extra_info["warm_off_p99_ms"] = round(off[max(0, -(-99 * len(off) // 100) - 1)] * 1e3, 3)
    _record(benchmark, "systrap sandbox paced, first-exec faults taken ahead", "native python")


@pytest.mark.parametrize("n, rounds", [(4, 10), (64, 3)], ids=["fork_group_4_map", "fork_group_64_map"])
def test_fork_group_map(benchmark, client, n, rounds):
    with client.session("python") as s:
        s.exec(code="x = 1")

        def run():
            with s.fork_group(n) as grp:
                assert all(r.ok for r in grp.map(lambda i, c: c.exec(code=f"y = x + {i}")))

        benchmark.pedantic(run, rounds=rounds, warmup_rounds=1)
    benchmark.extra_info["platform"] = client.platform
