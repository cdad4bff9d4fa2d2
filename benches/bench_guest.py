"""Benchmarks of the guest runtime (Debian's CPython in the sandbox); see benches/conftest.py for the
summary table. Each sandbox figure has a native baseline measured in the same run, and the ratio
to it is printed under the table (`x_native`):

- `python3 -c pass`, cold: a VMM process spawned from the root filesystem (ELF load, dynamic
  linking, interpreter start-up, `exit`), and the same command run by the agent of a sandbox
  forked from the template (fork + execve inside the guest); natively: the root filesystem's own
  python3.11 started through its own loader.
- syscall round trip: a loop of getppid() in the guest, timed on the host (guest clocks are
  virtual) minus the same loop without the syscall; per call.
- pipe round trip between a parent and its child (the sandbox's processes take turns in replay
  mode: two token passes per round trip), per round trip; natively: the same program on the host.
- file read: a 64 MiB file read in the guest (`open().read()`), minus an empty exec; MiB/s.
- upload and download of 64 MiB through the SDK; natively: writing and reading a 64 MiB file.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

import pytest
from collimate_core import Sandbox, Vm, connect
from collimate_core.templates.catalog import GUEST_ENV
from conftest import HOST_PYTHON

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

BIG = 64 << 20
SYSCALLS = 20_000
_medians: dict[str, float] = {}


def _root() -> Path:
    if os.environ.get("COLLIMATE_ROOTFS"):
        return Path(os.environ["COLLIMATE_ROOTFS"])
    from collimate_core.templates.rootfs import build_rootfs

    return build_rootfs("python")


@pytest.fixture(scope="module")
def root() -> Path:
    return _root()


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


@pytest.fixture(scope="module")
def sb(client):
    with Sandbox("python", client=client) as s:
        assert s.exec(command="true").ok
        yield s


def _record(benchmark, name: str, baseline: str | None = None) -> float:
    median = statistics.median(benchmark.stats.stats.data)
    _medians[name] = median
    if baseline and baseline in _medians:
        benchmark.extra_info["x_native"] = round(median / _medians[baseline], 2)
    return median


# --- python3 -c pass ----------------------------------------------------------------------------


def test_python_pass_native(benchmark, root):
    libpath = f"{root}/lib/x86_64-linux-gnu:{root}/usr/lib/x86_64-linux-gnu"
    cmd = [f"{root}/usr/lib64/ld-linux-x86-64.so.2", "--inhibit-cache", "--library-path", libpath,
           f"{root}/usr/bin/python3.11", "-c", "pass"]
    env = dict(GUEST_ENV, PYTHONHOME=f"{root}/usr")

    def run():
        subprocess.run(cmd, env=env, check=True)

    benchmark.pedantic(run, rounds=30, warmup_rounds=2)
    _record(benchmark, "native")


def test_python_pass_sandbox_spawned(benchmark, root, tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "tmp").mkdir()
    mounts = {"/work": tmp_path / "work", "/tmp": tmp_path / "tmp"}

    def run():
        vm = Vm.spawn(root, ["/usr/bin/python3", "-c", "pass"], env=GUEST_ENV, cwd="/work", mounts=mounts)
        try:
            r = vm.run(60.0)
            assert r.kind == "exited" and r.code == 0, r
        finally:
            vm.destroy()

    benchmark.pedantic(run, rounds=15, warmup_rounds=1)
    _record(benchmark, "spawned", "native")


def test_python_pass_sandbox_exec(benchmark, sb):
    def run():
        r = sb.exec(command="python3 -c pass", timeout_seconds=60)
        assert r.ok, r

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    _record(benchmark, "exec", "native")


# --- syscall round trip -------------------------------------------------------------------------

LOOP = "import os\nf = {f}\nfor _ in range({n}): f()\n"


def _timed_exec(sb, code: str) -> float:
    t = time.perf_counter()
    r = sb.exec(code=code, timeout_seconds=120)
    took = time.perf_counter() - t
    assert r.ok, r
    return took


def test_syscall_getppid_native(benchmark):
    def run():
        for _ in range(SYSCALLS):
            os.getppid()

    benchmark.pedantic(run, rounds=20, warmup_rounds=2)
    median = _record(benchmark, "getppid_native")
    benchmark.extra_info["per_call_us"] = round(median / SYSCALLS * 1e6, 3)


def test_syscall_getppid_sandbox(benchmark, sb):
    noop = sorted(_timed_exec(sb, LOOP.format(f="int", n=SYSCALLS)) for _ in range(7))[3]
    benchmark.pedantic(lambda: _timed_exec(sb, LOOP.format(f="os.getppid", n=SYSCALLS)), rounds=9, warmup_rounds=1)
    per_call = sorted((t - noop) / SYSCALLS for t in benchmark.stats.stats.data)
    benchmark.extra_info["per_call_us"] = round(statistics.median(per_call) * 1e6, 2)
    benchmark.extra_info["per_call_p99_us"] = round(per_call[-1] * 1e6, 2)
    _record(benchmark, "getppid_sandbox", "getppid_native")


# --- two processes taking turns -----------------------------------------------------------------

# A parent and its child exchange one byte over two pipes, ROUND_TRIPS times. In the sandbox
# (replay mode) every exchange passes the run token twice (guestos::sched); natively the host
# wakes the other process. Per round trip, minus the same program with no round trips.
ROUND_TRIPS = 2000
PINGPONG = (
    "import os\nN = {n}\na, b = os.pipe(); c, d = os.pipe()\n"
    "if os.fork() == 0:\n"
    "    for _ in range(N): os.read(a, 1); os.write(d, b'x')\n"
    "    os._exit(0)\n"
    "for _ in range(N): os.write(b, b'x'); os.read(c, 1)\n"
    "os.wait()\n"
)


def test_pipe_round_trip_native(benchmark):
    def once(n: int) -> float:
        t = time.perf_counter()
        subprocess.run([HOST_PYTHON, "-c", PINGPONG.format(n=n)], check=True)
        return time.perf_counter() - t

    empty = sorted(once(0) for _ in range(5))[2]
    benchmark.pedantic(lambda: once(ROUND_TRIPS), rounds=9, warmup_rounds=1)
    per = sorted((t - empty) / ROUND_TRIPS for t in benchmark.stats.stats.data)
    benchmark.extra_info["per_round_trip_us"] = round(statistics.median(per) * 1e6, 2)
    _record(benchmark, "pingpong_native")


def test_pipe_round_trip_sandbox(benchmark, sb):
    empty = sorted(_timed_exec(sb, PINGPONG.format(n=0)) for _ in range(5))[2]
    benchmark.pedantic(lambda: _timed_exec(sb, PINGPONG.format(n=ROUND_TRIPS)), rounds=9, warmup_rounds=1)
    per = sorted((t - empty) / ROUND_TRIPS for t in benchmark.stats.stats.data)
    benchmark.extra_info["per_round_trip_us"] = round(statistics.median(per) * 1e6, 2)
    benchmark.extra_info["per_round_trip_p99_us"] = round(per[-1] * 1e6, 2)
    _record(benchmark, "pingpong_sandbox", "pingpong_native")


# --- file read ----------------------------------------------------------------------------------


def test_file_read_native(benchmark, tmp_path):
    p = tmp_path / "big.bin"
    p.write_bytes(os.urandom(BIG))

    def run():
        with open(p, "rb") as f:
            assert len(f.read()) == BIG

    benchmark.pedantic(run, rounds=10, warmup_rounds=1)
    median = _record(benchmark, "read_native")
    benchmark.extra_info["MiB_per_s"] = round(64 / median)


def test_file_read_sandbox(benchmark, sb):
    sb.upload_bytes("/work/big.bin", os.urandom(BIG))
    base = sorted(_timed_exec(sb, "pass") for _ in range(5))[2]
    code = f"with open('/work/big.bin', 'rb') as f: assert len(f.read()) == {BIG}"
    benchmark.pedantic(lambda: _timed_exec(sb, code), rounds=7, warmup_rounds=1)
    median = _record(benchmark, "read_sandbox", "read_native")
    benchmark.extra_info["MiB_per_s"] = round(64 / max(median - base, 1e-6))


# --- upload and download ------------------------------------------------------------------------


def test_write_64mib_native(benchmark):
    data = os.urandom(BIG)
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    try:
        benchmark.pedantic(lambda: Path(d, "f").write_bytes(data), rounds=10, warmup_rounds=1)
    finally:
        Path(d, "f").unlink(missing_ok=True)
        os.rmdir(d)
    _record(benchmark, "write_native")


def test_upload_64mib(benchmark, sb):
    data = os.urandom(BIG)
    benchmark.pedantic(lambda: sb.upload_bytes("/work/up.bin", data), rounds=10, warmup_rounds=1)
    median = _record(benchmark, "upload", "write_native")
    benchmark.extra_info["MiB_per_s"] = round(64 / median)


def test_read_64mib_native(benchmark):
    data = os.urandom(BIG)
    d = tempfile.mkdtemp(dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    Path(d, "f").write_bytes(data)
    try:
        benchmark.pedantic(lambda: Path(d, "f").read_bytes(), rounds=10, warmup_rounds=1)
    finally:
        Path(d, "f").unlink()
        os.rmdir(d)
    _record(benchmark, "readback_native")


def test_download_64mib(benchmark, sb):
    data = os.urandom(BIG)
    sb.upload_bytes("/work/down.bin", data)
    got = benchmark.pedantic(lambda: sb.download("/work/down.bin"), rounds=10, warmup_rounds=1)
    assert got == data
    median = _record(benchmark, "download", "readback_native")
    benchmark.extra_info["MiB_per_s"] = round(64 / median)
