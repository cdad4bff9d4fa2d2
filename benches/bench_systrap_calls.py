"""What one guest syscall costs on systrap, call by call, beside the same call natively and beside
what two host processes pay to talk on this host (issue 35: the price of a trapped syscall).

Run: `pytest -s benches/bench_systrap_calls.py` (about a minute). Printed, never asserted.

Rows, each a Python loop of CALLS calls:
- sandbox: the loop as `exec(code=...)` in a systrap session, timed on the host, less the same
  loop calling nothing (a replay exec's clocks are virtual, so the guest cannot time itself); the
  best of three execs a round.
- native: the same loop in /usr/bin/python3, timed inside (perf_counter), less the empty loop.
- floor: natively, a pipe round trip to a second process pinned to the same CPU in place of the
  call, with GAP iterations of a dictionary workload between: two processes and two context
  switches, what a trap's hand-off is. Against the sandbox's `getppid` with the same work between.
Rounds alternate sandbox and native. Medians and p99s over the rounds, and the ratio to native.

Where the figures come from (docs/systrap.md, "Fewer host calls per exit, and where the floor
is"): a trap is two context switches plus about 1.5 us per host call the serving thread makes
(a `stat`: the path's read from the guest's memory, `fstatat`, the result's write).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import tempfile
import textwrap
import time

import pytest

from conftest import HOST_PYTHON

CALLS = int(os.environ.get("COLLIMATE_BENCH_CALLS", "5000"))
ROUNDS = int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "5"))
GAP = 100

SETUP = textwrap.dedent("""\
    import os
    open("/tmp/bench-calls", "w").write("x" * 100)
    fd = os.open("/tmp/bench-calls", os.O_RDONLY)
    """)

KINDS = {
    "getppid": "os.getppid()",
    "stat (a file of the image)": "os.stat('/usr/lib/python3.11/os.py')",
    "stat (missing)": "os.path.exists('/usr/lib/python3.11/missing.py')",
    "fstat": "os.fstat(fd)",
    "lseek": "os.lseek(fd, 0, 0)",
    "pread 100 B": "os.pread(fd, 100, 0)",
    "isatty": "os.isatty(fd)",
    "open + close": "os.close(os.open('/usr/lib/python3.11/os.py', os.O_RDONLY))",
}

WORK = textwrap.dedent("""\
    d = {i: str(i) for i in range(20000)}
    keys = list(d)
    acc = 0
    def work(i):
        global acc
        for j in range(i * GAP, (i + 1) * GAP):
            acc += len(d[keys[(j * 7919) % 20000]])
    """).replace("GAP", str(GAP))


def _systrap_available() -> bool:
    from collimate_core.sdk import platform as pf

    return pf.probe_systrap().available


pytestmark = pytest.mark.skipif(not _systrap_available(), reason="no systrap platform here (the host refuses seccomp filters)")


def _loop(body: str, n: int) -> str:
    return f"for _ in range({n}):\n    {body}\n"


def _native(body: str, n: int, setup: str = SETUP) -> float:
    """Seconds per call of `body` in /usr/bin/python3, less the empty loop's."""
    script = setup + textwrap.dedent(f"""\
        import time
        def run(n, f):
            t = time.perf_counter()
            for i in range(n):
                f(i)
            return time.perf_counter() - t
        full = min(run({n}, lambda i: {body}) for _ in range(3))
        empty = min(run({n}, lambda i: None) for _ in range(3))
        print((full - empty) / {n})
        """)
    r = subprocess.run([HOST_PYTHON, "-c", script], capture_output=True, text=True, check=True)
    return float(r.stdout)


def _sandbox(session, body: str, n: int) -> float:
    """Seconds per call of `body` in the session, timed on the host, less the empty loop's."""

    def best(code: str) -> float:
        times = []
        for _ in range(3):
            t = time.perf_counter()
            r = session.exec(code=code)
            times.append(time.perf_counter() - t)
            assert r.exit_code == 0, r.stderr
        return min(times)

    full = best(f"f = lambda i: {body}\nfor i in range({n}): f(i)\n")
    empty = best(f"f = lambda i: None\nfor i in range({n}): f(i)\n")
    return (full - empty) / n


def _pipe_floor(n: int) -> float:
    """Seconds per pipe round trip with a second process on this CPU, `work(i)` between, less
    the same loop without the round trips."""
    script = WORK + textwrap.dedent(f"""\
        import os, time
        cpu = os.sched_getaffinity(0)
        os.sched_setaffinity(0, {{min(cpu)}})
        r1, w1 = os.pipe(); r2, w2 = os.pipe()
        pid = os.fork()
        if pid == 0:
            os.close(w1); os.close(r2)
            while True:
                b = os.read(r1, 1)
                if not b:
                    os._exit(0)
                os.write(w2, b)
        os.close(r1); os.close(w2)
        def run(ping):
            t = time.perf_counter()
            for i in range({n}):
                work(i)
                if ping:
                    os.write(w1, b"x"); os.read(r2, 1)
            return time.perf_counter() - t
        full = min(run(True) for _ in range(3))
        empty = min(run(False) for _ in range(3))
        os.close(w1); os.waitpid(pid, 0)
        print((full - empty) / {n})
        """)
    r = subprocess.run([HOST_PYTHON, "-c", script], capture_output=True, text=True, check=True)
    return float(r.stdout)


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, round(0.99 * (len(s) - 1)))]


def _row(name: str, ours: list[float], base: list[float], base_name: str) -> str:
    m, b = statistics.median(ours), statistics.median(base)
    return (f"{name:42s} median {m * 1e6:7.2f} us  p99 {_p99(ours) * 1e6:7.2f} us | {base_name} "
            f"median {b * 1e6:6.2f} us  p99 {_p99(base) * 1e6:6.2f} us | {m / b if b > 0 else float('inf'):6.1f}x")


def test_syscall_costs_against_native():
    from collimate_core.sdk.embedded import EmbeddedClient

    client = EmbeddedClient(platform="systrap")
    ours: dict[str, list[float]] = {k: [] for k in KINDS}
    native: dict[str, list[float]] = {k: [] for k in KINDS}
    try:
        with client.session("python") as s:
            s.exec(code=SETUP)
            for _ in range(ROUNDS):
                for kind, body in KINDS.items():
                    ours[kind].append(_sandbox(s, body, CALLS))
                    native[kind].append(_native(body, CALLS))
    finally:
        client.close()
    print(f"\nload {os.getloadavg()[0]:.1f}; systrap on this host's {_host()}; {CALLS} calls a loop, {ROUNDS} rounds")
    for kind in KINDS:
        print(_row(f"sandbox {kind}", ours[kind], native[kind], "native"))


def test_a_trap_against_two_processes_talking():
    from collimate_core.sdk.embedded import EmbeddedClient

    n = CALLS // 5
    client = EmbeddedClient(platform="systrap")
    ours, floor = [], []
    body = "os.getppid()"
    try:
        with client.session("python") as s:
            s.exec(code=WORK + "import os\n")
            for _ in range(ROUNDS):
                ours.append(_sandbox(s, f"(work(i), {body})", n) - _sandbox(s, "work(i)", n))
                floor.append(_pipe_floor(n))
    finally:
        client.close()
    print(f"\nload {os.getloadavg()[0]:.1f}; {GAP} dictionary lookups between calls; {n} calls a loop, {ROUNDS} rounds")
    print(_row("sandbox getppid between work", ours, floor, "pipe round trip, one CPU"))


def _host() -> str:
    return "kvm_pvm host" if os.path.exists("/sys/module/kvm_pvm") else ("KVM host" if os.path.exists("/dev/kvm") else "host without /dev/kvm")


if __name__ == "__main__":
    sys.exit(pytest.main([__file__, "-s", "-q"]))
