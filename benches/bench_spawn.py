"""Benchmarks of starting programs in a sandbox (issue 17), each beside its native baseline measured
in the same run; see benches/conftest.py for the summary table (median, p99, ratio to a host fork)
and the `x_native` ratio under it (sandbox median / native median; above 1, we are slower):

- `exec(command="true")` against `/bin/sh -c true`, `exec(command="true;")` (a compound command,
  the same shell path), and `true` through the agent's `subprocess` fallback (the path before the
  engine's spawn call, in a second sandbox of this run);
- `exec(command="echo hi | wc -c")` against `/bin/sh -c "echo hi | wc -c"`;
- `exec(command="cd /work && python3 task.py")` against `cd <dir> && /usr/bin/python3 task.py`;
- `fork_group(64)` + a map of `exec(command="true")` (the map's default: up to 32 at a time)
  against 64 `/bin/sh -c true` from 32 threads.

Natively the shell is the host's /bin/sh and Python the host's /usr/bin/python3, called directly
(never through a version manager's shim). Where the time of a sandboxed spawn goes is in
docs/spawn.md (`COLLIMATE_TRACE=1`).
"""

from __future__ import annotations

import os
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest
from collimate_core import Sandbox, connect

from conftest import host_fork_baseline

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

TASK = b"import json\nprint(json.dumps(sum(range(1000))))\n"
WIDTH = 64
_medians: dict[str, float] = {}


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


@pytest.fixture(scope="module")
def sb(client):
    with Sandbox("python", client=client) as s:
        s.upload_bytes("/work/task.py", TASK)
        assert s.exec(command="true").ok
        yield s


@pytest.fixture(scope="module")
def task_dir(tmp_path_factory):
    d = tmp_path_factory.mktemp("task")
    (d / "task.py").write_bytes(TASK)
    return d


def _record(benchmark, name: str, baseline: str | None = None) -> None:
    median = statistics.median(benchmark.stats.stats.data)
    _medians[name] = median
    if baseline and baseline in _medians:
        benchmark.extra_info["x_native"] = round(median / _medians[baseline], 2)


def test_host_fork_baseline(benchmark):
    host_fork_baseline(benchmark)


def _sh(command: str, cwd=None) -> None:
    subprocess.run(["/bin/sh", "-c", command], check=True, cwd=cwd, stdout=subprocess.DEVNULL)


def test_native_sh_true(benchmark):
    benchmark.pedantic(lambda: _sh("true"), rounds=60, warmup_rounds=3)
    _record(benchmark, "native true")


def test_sandbox_command_true(benchmark, sb):
    def run():
        r = sb.exec(command="true")
        assert r.exit_code == 0, r

    benchmark.pedantic(run, rounds=60, warmup_rounds=3)
    _record(benchmark, "true", "native true")


def test_sandbox_command_true_through_the_shell(benchmark, sb):
    def run():
        r = sb.exec(command="true;")
        assert r.exit_code == 0, r

    benchmark.pedantic(run, rounds=60, warmup_rounds=3)
    _record(benchmark, "true;", "native true")


@pytest.fixture(scope="module")
def sb_subprocess(client):
    # The agent's fallback: subprocess.run's vfork child runs CPython's pre-exec code in the guest.
    with Sandbox("python", client=client) as s:
        r = s.exec(code="import sys; m = sys.modules['collimate_agent']; print(m._spawn is not None); m._spawn = None")
        assert r.stdout == "True\n", r
        assert s.exec(command="true").ok
        yield s


def test_sandbox_command_true_via_subprocess(benchmark, sb_subprocess):
    def run():
        r = sb_subprocess.exec(command="true")
        assert r.exit_code == 0, r

    benchmark.pedantic(run, rounds=60, warmup_rounds=3)
    _record(benchmark, "true via subprocess", "native true")


def test_native_sh_pipeline(benchmark):
    benchmark.pedantic(lambda: _sh("echo hi | wc -c"), rounds=60, warmup_rounds=3)
    _record(benchmark, "native pipe")


def test_sandbox_command_pipeline(benchmark, sb):
    def run():
        r = sb.exec(command="echo hi | wc -c")
        assert r.exit_code == 0 and r.stdout.strip() == "3", r

    benchmark.pedantic(run, rounds=60, warmup_rounds=3)
    _record(benchmark, "pipe", "native pipe")


def test_native_python_task(benchmark, task_dir):
    def run():
        out = subprocess.run(f"cd {task_dir} && /usr/bin/python3 task.py", shell=True, check=True, capture_output=True)
        assert out.stdout == b"499500\n"

    benchmark.pedantic(run, rounds=30, warmup_rounds=2)
    _record(benchmark, "native task")


def test_sandbox_python_task(benchmark, sb):
    def run():
        r = sb.exec(command="cd /work && python3 task.py", timeout_seconds=60)
        assert r.exit_code == 0 and r.stdout == "499500\n", r

    benchmark.pedantic(run, rounds=30, warmup_rounds=2)
    _record(benchmark, "task", "native task")


def test_native_64_sh_true(benchmark):
    def run():
        with ThreadPoolExecutor(32) as pool:
            list(pool.map(lambda _: _sh("true"), range(WIDTH)))

    benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    _record(benchmark, "native 64")


def test_sandbox_fork_group_commands(benchmark, sb):
    def run():
        with sb.fork_group(WIDTH) as grp:
            codes = grp.map(lambda i, child: child.exec(command="true").exit_code)
        assert codes == [0] * WIDTH, codes

    benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    _record(benchmark, "group 64", "native 64")
