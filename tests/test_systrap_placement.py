"""Systrap's placement (crates/engine/src/platform/systrap/placement.rs): while a sandbox's exec
makes syscalls with compute between them, its stub and the VMM thread serving it are bound to one
host CPU (each hand-off a same-CPU switch), and a pair whose CPU another task keeps busy is
unbound rather than left waiting behind it.

What is checked is each task's allowed CPUs (`Cpus_allowed_list` in /proc/<pid>/task/<tid>/status),
which the engine sets; nothing here times anything. Needs two CPUs or more (on one there is
nothing to place).
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from collimate_rl import Sandbox
from hostprocs import stub_of
from platforms import systrap_client

# Syscalls with tens of microseconds of compute between them (the shape of an import or a test
# suite), `n` of them (a count: a replay exec's clock is the guest's own).
WORKLOAD = """
import os
for _ in range({n}):
    os.stat("/")
    sum(range(2000))
"""


@pytest.fixture(scope="module")
def client():
    if len(os.sched_getaffinity(0)) < 2:
        pytest.skip("one CPU: nothing to place")
    return systrap_client()


def _allowed(pid: int, tid: int | None = None) -> frozenset[int] | None:
    path = Path(f"/proc/{pid}/task/{tid}/status") if tid else Path(f"/proc/{pid}/status")
    try:
        text = path.read_text()
    except OSError:
        return None
    line = next(ln for ln in text.splitlines() if ln.startswith("Cpus_allowed_list:"))
    cpus: set[int] = set()
    for part in line.split(":", 1)[1].strip().split(","):
        lo, _, hi = part.partition("-")
        cpus.update(range(int(lo), int(hi or lo) + 1))
    return frozenset(cpus)


def _pinned_cpu(vmm: int, stub: int) -> int | None:
    """The one CPU the stub and one of the VMM's threads are both bound to, if they are."""
    s = _allowed(stub)
    if s is None or len(s) != 1:
        return None
    for task in Path(f"/proc/{vmm}/task").iterdir():
        if _allowed(vmm, int(task.name)) == s:
            return next(iter(s))
    return None


class _Exec:
    """The workload running in `sb` on a thread of its own, `n` iterations."""

    def __init__(self, sb, n: int):
        self.result = None
        self.thread = threading.Thread(target=self._run, args=(sb, n), daemon=True)
        self.thread.start()

    def _run(self, sb, n):
        self.result = sb.exec(code=WORKLOAD.format(n=n), timeout_seconds=60)

    def running(self) -> bool:
        return self.thread.is_alive()

    def join(self):
        self.thread.join(90)
        assert not self.thread.is_alive(), "the workload's exec did not return"
        assert self.result is not None and self.result.ok, self.result


def _wait_pinned(vmm: int, stub: int, ex: _Exec, deadline: float) -> int | None:
    while ex.running() and time.monotonic() < deadline:
        cpu = _pinned_cpu(vmm, stub)
        if cpu is not None:
            return cpu
        time.sleep(0.01)
    return None


def test_an_exec_runs_its_stub_and_serving_thread_on_one_cpu(client):
    with Sandbox("python", client=client) as sb:
        vmm = sb._box.vm.pid
        stub = stub_of(vmm)
        home = _allowed(stub)
        ex = _Exec(sb, n=40_000)
        cpu = _wait_pinned(vmm, stub, ex, time.monotonic() + 4)
        ex.join()
        assert cpu is not None, (
            f"the stub {stub} and no thread of its VMM {vmm} were bound to one CPU while the exec ran "
            f"(stub allowed {sorted(_allowed(stub) or [])}); COLLIMATE_SYSTRAP_PLACEMENT=0 in the environment?")
        assert cpu in home
        # Between execs the pair may stay bound; it is never bound outside the CPUs it had.
        assert (_allowed(stub) or home) <= home


def test_a_pair_on_a_cpu_kept_busy_is_unbound_from_it(client):
    with Sandbox("python", client=client) as sb:
        vmm = sb._box.vm.pid
        stub = stub_of(vmm)
        ex = _Exec(sb, n=80_000)
        cpu = _wait_pinned(vmm, stub, ex, time.monotonic() + 4)
        assert cpu is not None, "the pair was never bound to one CPU"
        # A busy loop of this test's own, bound to that CPU, for at most 10 s.
        busy = subprocess.Popen([sys.executable, "-c", (
            f"import os, time\nos.sched_setaffinity(0, {{{cpu}}})\n"
            "end = time.monotonic() + 10\nwhile time.monotonic() < end:\n    pass\n")])
        try:
            moved = False
            deadline = time.monotonic() + 5
            while ex.running() and time.monotonic() < deadline:
                if _allowed(stub) != frozenset({cpu}):
                    moved = True
                    break
                time.sleep(0.005)
        finally:
            busy.kill()
            busy.wait()
        ex.join()
        assert moved, f"the stub stayed bound to CPU {cpu} behind a busy loop for 5 s"
