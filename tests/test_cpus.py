"""The CPU count a guest sees (issue 15): configurable, 1 by default, and with 2 or more the
thread pools programs size from it still work on the sandbox's one vCPU.

The count is a setting of the sandbox (`Vm.spawn(cpus=)`, else the engine's `COLLIMATE_CPUS`,
else 1; crates/engine/src/guestos/cpu.rs): sched_getaffinity, sysconf, /proc/cpuinfo, /proc/stat
and /sys/devices/system/cpu all agree on it. The numpy test uses numpy's own wheel from PyPI
(it bundles OpenBLAS), downloaded once into the cache (`<cache>/wheels`) and mounted read-only
into the sandbox; it skips, saying why, only if that download fails.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import subprocess
import zipfile

import pytest
from collimate_core import Vm
from collimate_core.templates.cache import cache_dir

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

NUMPY = "numpy==1.26.4"  # the newest numpy with a cp311 manylinux2014 wheel and OpenBLAS 0.3.23
WHEEL_GLOB = "numpy-1.26.4-cp311-cp311-manylinux*_x86_64.whl"


def guest(rootfs: str, code: str, *, cpus: int | None = None, env: dict | None = None, ro_mounts=None,
          timeout: float = 120) -> dict:
    """Run `code` in Debian's python3 in a fresh sandbox; it prints one JSON line, returned."""
    kw = {} if cpus is None else {"cpus": cpus}
    with Vm.spawn(rootfs, ["/usr/bin/python3", "-c", code], env=env or {}, ro_mounts=ro_mounts, **kw) as vm:
        r = vm.run(timeout)
    assert (r.kind, r.code) == ("exited", 0), (r.kind, r.code, r.stderr.decode(errors="replace")[-3000:])
    out = json.loads(r.stdout.decode().strip().splitlines()[-1])
    out["_duration"] = r.duration
    return out


WHAT_THE_GUEST_SEES = r"""
import json, os, subprocess, sys
def read(p):
    try:
        with open(p) as f:
            return f.read()
    except OSError as e:
        return f"error {e.errno}"
status = read("/proc/self/status")
print(json.dumps({
    "cpu_count": os.cpu_count(),
    "affinity": sorted(os.sched_getaffinity(0)),
    "onln": os.sysconf("SC_NPROCESSORS_ONLN"),
    "conf": os.sysconf("SC_NPROCESSORS_CONF"),
    "cpuinfo": read("/proc/cpuinfo").count("processor\t:"),
    "stat": [l.split()[0] for l in read("/proc/stat").splitlines() if l.startswith("cpu")],
    "online": read("/sys/devices/system/cpu/online"),
    "possible": read("/sys/devices/system/cpu/possible"),
    "sys": sorted(os.listdir("/sys/devices/system/cpu")),
    "allowed": [l for l in status.splitlines() if l.startswith("Cpus_allowed_list")],
    "child": subprocess.run([sys.executable, "-c", "import os; print(os.cpu_count(), len(os.sched_getaffinity(0)))"],
                            capture_output=True, text=True).stdout.split(),
}))
"""


def test_one_cpu_by_default(rootfs, monkeypatch):
    monkeypatch.delenv("COLLIMATE_CPUS", raising=False)
    s = guest(rootfs, WHAT_THE_GUEST_SEES)
    assert (s["cpu_count"], s["affinity"], s["onln"], s["conf"], s["cpuinfo"]) == (1, [0], 1, 1, 1)
    assert s["stat"] == ["cpu", "cpu0"] and s["online"] == "0\n" and s["sys"] == ["cpu0", "online", "possible", "present"]
    assert s["child"] == ["1", "1"]


def test_every_interface_shows_the_configured_count(rootfs):
    s = guest(rootfs, WHAT_THE_GUEST_SEES, cpus=4)
    assert (s["cpu_count"], s["affinity"], s["onln"], s["conf"], s["cpuinfo"]) == (4, [0, 1, 2, 3], 4, 4, 4)
    assert s["stat"] == ["cpu", "cpu0", "cpu1", "cpu2", "cpu3"]
    assert s["online"] == s["possible"] == "0-3\n"
    assert s["sys"] == ["cpu0", "cpu1", "cpu2", "cpu3", "online", "possible", "present"]
    assert s["allowed"] == ["Cpus_allowed_list:\t0-3"]
    assert s["child"] == ["4", "4"], "a process the sandbox starts sees the same count"


def test_affinity_can_narrow_within_the_count(rootfs):
    s = guest(rootfs, r"""
import json, os
os.sched_setaffinity(0, {1, 2, 9})  # CPU 9 does not exist: ignored, as Linux does
narrowed = sorted(os.sched_getaffinity(0))
try:
    os.sched_setaffinity(0, {5})
    err = None
except OSError as e:
    err = e.errno
status = open("/proc/self/status").read()
print(json.dumps({"narrowed": narrowed, "err": err, "after": sorted(os.sched_getaffinity(0)),
                  "list": [l for l in status.splitlines() if l.startswith("Cpus_allowed_list")]}))
""", cpus=3)
    assert s == {"narrowed": [1, 2], "err": 22, "after": [1, 2], "list": ["Cpus_allowed_list:\t1-2"],
                 "_duration": s["_duration"]}


def test_the_engine_default_comes_from_collimate_cpus(rootfs, monkeypatch):
    monkeypatch.setenv("COLLIMATE_CPUS", "3")
    assert guest(rootfs, WHAT_THE_GUEST_SEES)["cpu_count"] == 3
    assert guest(rootfs, WHAT_THE_GUEST_SEES, cpus=2)["cpu_count"] == 2, "the explicit count wins"
    monkeypatch.setenv("COLLIMATE_CPUS", "many")
    with pytest.raises(Exception, match="COLLIMATE_CPUS"):
        guest(rootfs, WHAT_THE_GUEST_SEES)


@pytest.mark.parametrize("cpus", [0, 65])
def test_a_count_out_of_range_is_refused(rootfs, cpus):
    with pytest.raises(Exception, match="1 to 64 CPUs"):
        guest(rootfs, WHAT_THE_GUEST_SEES, cpus=cpus)


def test_thread_pool_executor_default_sizing_on_one_vcpu(rootfs):
    """ThreadPoolExecutor() sizes itself min(32, cpu_count + 4): 8 workers for 4 CPUs. A barrier
    of 8 parties proves 8 distinct threads run at once (taking turns on the one vCPU)."""
    s = guest(rootfs, r"""
import concurrent.futures as cf, hashlib, json, threading
barrier = threading.Barrier(8, timeout=60)
def meet(i):
    barrier.wait()
    return threading.get_ident()
with cf.ThreadPoolExecutor() as ex:
    workers = ex._max_workers
    idents = list(ex.map(meet, range(8)))
    digests = list(ex.map(lambda i: hashlib.sha256(str(i).encode() * 10000).hexdigest(), range(64)))
print(json.dumps({"workers": workers, "threads": len(set(idents)), "digests": digests}))
""", cpus=4)
    assert s["workers"] == 8 and s["threads"] == 8
    assert s["digests"] == [hashlib.sha256(str(i).encode() * 10000).hexdigest() for i in range(64)]


@pytest.fixture(scope="module")
def numpy_dir():
    """numpy's wheel from PyPI, unpacked in the cache (downloaded once; never in git)."""
    wheels = cache_dir() / "wheels"
    dest = wheels / "numpy-1.26.4-cp311"
    if (dest / "numpy" / "__init__.py").exists():
        return dest
    wheels.mkdir(parents=True, exist_ok=True)
    found = sorted(wheels.glob(WHEEL_GLOB))
    if not found:
        cmd = ["/usr/bin/python3", "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--python-version",
               "3.11", "--implementation", "cp", "--abi", "cp311", "--platform", "manylinux2014_x86_64",
               "-d", str(wheels), NUMPY]
        try:
            r = subprocess.run(cmd, capture_output=True, timeout=600)
            why = r.stderr.decode(errors="replace")[-500:]
        except (OSError, subprocess.TimeoutExpired) as e:
            why = str(e)
        found = sorted(wheels.glob(WHEEL_GLOB))
        if not found:
            pytest.skip(f"could not download {NUMPY}'s wheel from PyPI: {why}")
    tmp = wheels / f".numpy-unpack-{os.getpid()}"
    with zipfile.ZipFile(found[-1]) as z:
        z.extractall(tmp)
    for p in tmp.rglob("*.so*"):
        p.chmod(0o755)
    try:
        tmp.rename(dest)
    except OSError:  # another process unpacked it first
        pass
    return dest


NUMPY_WORK = r"""
import ctypes, glob, hashlib, json, os
import numpy as np
lib = ctypes.CDLL(glob.glob(os.path.join(os.path.dirname(np.__file__), "..", "numpy.libs", "libopenblas*.so"))[0])
get = getattr(lib, "openblas_get_num_threads64_", None) or lib.openblas_get_num_threads
rng = np.random.default_rng(20251202)
a = rng.standard_normal((384, 384))
b = rng.standard_normal((384, 384))
c = a @ b
x = np.linalg.solve(a, b[:, 0])
u, s, vt = np.linalg.svd(a)
h = lambda v: hashlib.sha256(np.ascontiguousarray(v).tobytes()).hexdigest()
print(json.dumps({"blas_threads": get(), "tasks": len(os.listdir("/proc/self/task")),
                  "matmul": h(c), "solve": h(x), "svd": h(s), "residual": float(np.abs(a @ x - b[:, 0]).max()),
                  "sample": [float(c[0, 0]), float(c[-1, -1])], "x": x.tolist(), "s": s.tolist()}))
"""


def test_numpy_openblas_with_four_threads_matches_one(rootfs, numpy_dir):
    """numpy's OpenBLAS sizes its pool from the CPU count: with 4 CPUs and OPENBLAS_NUM_THREADS=4
    it runs 4 threads (3 workers and the main one) on the one vCPU. The matrix product is
    bit-identical to OPENBLAS_NUM_THREADS=1 (each thread computes whole output blocks); solve and
    SVD agree to rounding, as natively, where threaded LAPACK also sums in another order. With 1 CPU
    OpenBLAS keeps to its single-thread path. The single-thread results are bit-identical to the
    same wheel run natively."""
    mounts = {"/work": str(numpy_dir)}
    env = lambda n: {"PYTHONPATH": "/work", "OPENBLAS_NUM_THREADS": str(n)}
    one = guest(rootfs, NUMPY_WORK, cpus=4, env=env(1), ro_mounts=mounts, timeout=300)
    four = guest(rootfs, NUMPY_WORK, cpus=4, env=env(4), ro_mounts=mounts, timeout=300)
    single_cpu = guest(rootfs, NUMPY_WORK, cpus=1, env=env(4), ro_mounts=mounts, timeout=300)
    assert (one["blas_threads"], one["tasks"]) == (1, 1)
    assert (four["blas_threads"], four["tasks"]) == (4, 4)
    assert (single_cpu["blas_threads"], single_cpu["tasks"]) == (1, 1), "OpenBLAS caps its pool at the CPU count"
    assert one["matmul"] == four["matmul"] == single_cpu["matmul"] and one["sample"] == four["sample"]
    assert one["solve"] == single_cpu["solve"] and one["svd"] == single_cpu["svd"]
    for k in ("x", "s"):
        assert all(math.isclose(p, q, rel_tol=1e-9, abs_tol=1e-12) for p, q in zip(one[k], four[k], strict=True)), k
    assert one["residual"] < 1e-9 and four["residual"] < 1e-9
    host = subprocess.run(["/usr/bin/python3", "-c", NUMPY_WORK], capture_output=True, timeout=300,
                          env={"PYTHONPATH": str(numpy_dir), "OPENBLAS_NUM_THREADS": "1"})
    if host.returncode == 0:  # a host python3 numpy 1.26.4's cp311 wheel can run on
        native = json.loads(host.stdout.decode().strip().splitlines()[-1])
        assert {k: native[k] for k in ("matmul", "solve", "svd")} == {k: one[k] for k in ("matmul", "solve", "svd")}


def test_the_python_template_follows_collimate_cpus(monkeypatch):
    """Through the SDK: the catalog python template is baked with the engine's default count
    (COLLIMATE_CPUS) and kept apart from templates of other counts, and its clones see it."""
    from collimate_core import EmbeddedClient, Sandbox

    monkeypatch.delenv("COLLIMATE_API_KEY", raising=False)
    monkeypatch.setenv("COLLIMATE_CPUS", "2")
    client = EmbeddedClient()
    try:
        code = "import os, concurrent.futures as cf; print(os.cpu_count(), len(os.sched_getaffinity(0)), cf.ThreadPoolExecutor()._max_workers)"
        with Sandbox("python", client=client) as sb:
            r = sb.exec(code=code, timeout_seconds=60)
            assert r.exit_code == 0, r
            assert r.stdout.split() == ["2", "2", "6"]
            with sb.fork_group(2) as grp:
                outs = grp.map(lambda i, c: c.exec(code=code, timeout_seconds=60).stdout.split())
            assert outs == [["2", "2", "6"]] * 2
    finally:
        client.close()


NUMPY_RUNTIME = r"""
import ctypes, io, contextlib, json
ctypes.CDLL(None).syscall(0x40000000, 7)
import numpy as np
from numpy.core._multiarray_umath import __cpu_baseline__, __cpu_dispatch__, __cpu_features__
out = io.StringIO()
with contextlib.redirect_stdout(out), contextlib.redirect_stderr(io.StringIO()):
    np.show_runtime()
print(json.dumps({"show_runtime": [l for l in out.getvalue().splitlines() if "simd" in l.lower() or "'found'" in l or "not_found" in l or l.strip().startswith("'")],
                  "found": sorted(f for f in __cpu_dispatch__ if __cpu_features__[f]),
                  "not_found": sorted(f for f in __cpu_dispatch__ if not __cpu_features__[f]),
                  "baseline": list(__cpu_baseline__)}))
"""


def test_numpy_simd_dispatch_is_the_same_in_every_clone(rootfs, numpy_dir, tmp_path):
    """numpy picks its SIMD kernels from CPUID (and XCR0, by xgetbv) when it is imported
    (np.show_runtime() lists them). Imported after the template's pause, in clones of one template
    (two forks and a restore in this process), it finds the same extensions in each. Where ring-3
    CPUID is filtered (upstream KVM) the CPU template hides AVX-512 (and the guest's XCR0 does not
    enable it), so numpy runs no AVX-512 kernel; under kvm_pvm the guest sees the host CPU's
    features and XCR0, and numpy uses AVX-512 exactly when the host CPU has it (docs/replay.md,
    "The CPU and the time-stamp counter"). Across hosts the CPU template (the refusal of another
    CPU under kvm_pvm) is what keeps this the same; on one host this shows that nothing per clone
    changes it."""
    from collimate_core._core import _kvm_profile

    with Vm.spawn(rootfs, ["/usr/bin/python3", "-c", NUMPY_RUNTIME], env={"PYTHONPATH": "/work"},
                  ro_mounts={"/work": str(numpy_dir)}) as vm:
        r = vm.run(120)
        assert (r.kind, r.value) == ("yield", 7), (r.kind, r.stderr.decode(errors="replace")[-2000:])
        vm.snapshot(tmp_path / "snap")
    outs = []
    with Vm.restore(tmp_path / "snap") as zygote:
        kids = zygote.fork(2)
        with Vm.restore(tmp_path / "snap") as again:
            kids.append(again.clone())
        for k in kids:
            with k:
                k.reseed(bytes(32))
                r = k.run(120)
                assert (r.kind, r.code) == ("exited", 0), r.stderr.decode(errors="replace")[-2000:]
                outs.append(json.loads(r.stdout.decode().strip().splitlines()[-1]))
    assert outs[0] == outs[1] == outs[2]
    assert outs[0]["found"], outs[0]
    avx512 = [f for f in outs[0]["found"] if f.startswith("AVX512")]
    if _kvm_profile()["cpuid_filtered"]:
        assert not avx512, outs[0]["found"]
    else:
        with open("/proc/cpuinfo") as f:
            host_avx512f = " avx512f " in f.read()
        assert ("AVX512F" in avx512) == host_avx512f, (avx512, host_avx512f)
    assert any("SSE" in b for b in outs[0]["baseline"])
    assert outs[0]["show_runtime"], "np.show_runtime() printed its SIMD extensions"
