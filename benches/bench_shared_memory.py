"""Shared memory between the processes of one sandbox (issue 15): what a cross-process lock
hand-off and a first touch of a shared page cost, beside the same program under native
/usr/bin/python3 in the same run.

Run: `python3 benches/bench_shared_memory.py` (or through pytest: `pytest -s benches/bench_shared_memory.py`).

How it measures. Inside a sandbox every SDK exec runs on the replay clocks (virtual time: the
guest's own clock readings say nothing about host time), so every figure is taken from the host:
one sample is the wall time of one exec of the program doing N operations, minus the median wall
time of the same program doing none, divided by N. The native baseline runs the same program text
as a subprocess of /usr/bin/python3, timed the same way (its per-process start-up is in the
zero-operation run too and cancels out). Each figure is the median and p99 over ROUNDS samples;
the machine is shared, so compare the ratio within one run rather than figures across runs.

- lock ping-pong: parent and a forked child hand two multiprocessing.Lock objects back and forth
  (each acquires one the other released): one round trip is two futex waits and two wakes across
  processes. In the sandbox the two processes take turns (`guestos::sched`), so a hand-off is a
  pass of the run token between two VMM processes plus the shared-futex wait/wake
  (`guestos::futex_shared`).
- pipe ping-pong: the same hand-off over two pipes, the cross-process wait the sandbox already
  had, for comparison: it shows what the turn-taking costs by itself.
- first touch: the guest maps 64 MiB of shared memory and writes one byte per page; each page's
  first touch is a fault inside KVM (the pages are pointed at the window at mmap, see
  `guestos::mm`). Shown for shared anonymous memory, a /dev/shm file and, for comparison, private
  anonymous memory.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

ROUNDS = int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "15"))
PING_PONGS = 2000
# Natively a round trip takes microseconds: more of them, so that they stand out of the noise of
# an interpreter's start-up.
NATIVE_PING_PONGS = 50000
TOUCH_MIB = 64
NATIVE = "/usr/bin/python3"

PING_PONG = r"""
import multiprocessing as mp, os, sys
mp.set_start_method("fork", force=True)
n = int(sys.argv[1]) if len(sys.argv) > 1 else N
ping, pong = mp.Lock(), mp.Lock()
ping.acquire(); pong.acquire()
pid = os.fork()
if pid == 0:
    for _ in range(n):
        ping.acquire()
        pong.release()
    os._exit(0)
for _ in range(n):
    ping.release()
    pong.acquire()
os.waitpid(pid, 0)
"""

# The same hand-off over two pipes: the cross-process wait the sandbox had before shared memory,
# for comparison (what the turn-taking itself costs).
PIPE_PING_PONG = r"""
import os, sys
n = int(sys.argv[1]) if len(sys.argv) > 1 else N
a, b = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:
    for _ in range(n):
        os.read(a[0], 1)
        os.write(b[1], b"y")
    os._exit(0)
for _ in range(n):
    os.write(a[1], b"x")
    os.read(b[0], 1)
os.waitpid(pid, 0)
"""

TOUCH = r"""
import mmap, os, sys
kind = KIND
pages = int(sys.argv[1]) if len(sys.argv) > 1 else PAGES
size = max(pages, 1) * mmap.PAGESIZE
if kind == "shared":
    m = mmap.mmap(-1, size)
elif kind == "file":
    fd = os.open("/dev/shm/bench-touch", os.O_RDWR | os.O_CREAT, 0o600)
    os.ftruncate(fd, size)
    m = mmap.mmap(fd, size)
    os.unlink("/dev/shm/bench-touch")
else:
    m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE)
for off in range(0, pages * mmap.PAGESIZE, mmap.PAGESIZE):
    m[off] = 1
"""


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def native_run(code: str) -> float:
    t = time.perf_counter()
    subprocess.run([NATIVE, "-c", code], check=True)
    return time.perf_counter() - t


def sandbox_run(sb, code: str) -> float:
    t = time.perf_counter()
    r = sb.exec(code=code, timeout_seconds=300)
    took = time.perf_counter() - t
    assert r.exit_code == 0, r.stderr
    return took


def per_op(run, program: str, n: int) -> list[float]:
    """Samples of (time of n operations - median time of none) / n, in microseconds."""
    zero = statistics.median(run(program.replace("N\n", "0\n", 1).replace("PAGES\n", "0\n", 1)) for _ in range(9))
    full = program.replace("N\n", f"{n}\n", 1).replace("PAGES\n", f"{n}\n", 1)
    return [(run(full) - zero) / n * 1e6 for _ in range(ROUNDS)]


def row(name: str, sandbox: list[float], native: list[float]) -> str:
    ms, mn = statistics.median(sandbox), statistics.median(native)
    return (
        f"{name:<34} sandbox median {ms:9.2f} us  p99 {pct(sandbox, 0.99):9.2f} us | "
        f"native median {mn:8.2f} us  p99 {pct(native, 0.99):8.2f} us | ratio {ms / mn:7.1f}x"
    )


def main() -> None:
    from collimate_rl import Sandbox, connect

    client = connect()
    lines = [
        f"{ROUNDS} samples per figure; each sample = one exec of N operations minus one of none, / N "
        f"(ping-pongs: N={PING_PONGS} in the sandbox, {NATIVE_PING_PONGS} natively; first touch: N = pages)"
    ]
    pages = TOUCH_MIB * 256
    with Sandbox("python", client=client) as sb:
        run_sb = lambda code: sandbox_run(sb, code)  # noqa: E731
        sb_pp = per_op(run_sb, PING_PONG, PING_PONGS)
        nat_pp = per_op(native_run, PING_PONG, NATIVE_PING_PONGS)
        lines.append(row(f"lock ping-pong round trip", sb_pp, nat_pp))
        sb_pipe = per_op(run_sb, PIPE_PING_PONG, PING_PONGS)
        nat_pipe = per_op(native_run, PIPE_PING_PONG, NATIVE_PING_PONGS)
        lines.append(row(f"pipe ping-pong round trip", sb_pipe, nat_pipe))
        for kind in ("shared", "file", "private"):
            prog = TOUCH.replace("KIND", repr(kind))
            sb_t = per_op(run_sb, prog, pages)
            nat_t = per_op(native_run, prog, pages)
            label = {"shared": "shared anonymous", "file": "/dev/shm file", "private": "private anonymous"}[kind]
            lines.append(row(f"first touch, {label} ({TOUCH_MIB} MiB)", sb_t, nat_t))
    print("\n".join(lines))


def test_bench_shared_memory():
    """pytest entry point: prints the table (nothing is asserted about speed)."""
    main()


if __name__ == "__main__":
    sys.exit(main())
