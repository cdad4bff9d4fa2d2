"""Systrap's placement (crates/engine/src/platform/systrap/placement.rs): a sandbox's serving VMM
thread and its stub kept on one host CPU while that pays, against both left to the scheduler
(`COLLIMATE_SYSTRAP_PLACEMENT=0`, what systrap did before), in alternated rounds of one run,
beside the direct native baselines of each row. Printed (run with -s), never asserted.

Run: `pytest -s benches/bench_systrap_placement.py` (about 4 minutes; `-k` one of exec_true,
sandbox, fork_group, grading). The suite and `import torch` rows come from their own benches
with the variable set or not, alternated by hand (docs/systrap.md has the commands):
`COLLIMATE_SYSTRAP_PLACEMENT=0 pytest -s benches/bench_swe.py -k "suite and systrap"`.

Platform: systrap; this repository's machine is a 2-core kvm_pvm VM, where a wake-up of the
other, idle vCPU costs tens of microseconds: the figures depend on how busy the host is, so each
test prints the load before and after.
"""

from __future__ import annotations

import os
import subprocess
import time


from bench_systrap_sdk import _exec_true_rounds, _grading_ab, _print_rows, _recycle_clients, _time_sandbox

VARIANTS = (("placement (default)", {}), ("COLLIMATE_SYSTRAP_PLACEMENT=0 (before)", {"COLLIMATE_SYSTRAP_PLACEMENT": "0"}))


def _load() -> str:
    return " ".join(open("/proc/loadavg").read().split()[:3])


def test_exec_true_placement_rounds():
    """`exec(command="true")` in a session, back to back and paced (5 ms idle before each)."""
    rounds = int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "6"))
    print("\nback to back:")
    _exec_true_rounds(VARIANTS, rounds=rounds)
    print("paced:")
    _exec_true_rounds(VARIANTS, rounds=rounds, pause=0.005)


def test_sandbox_placement_ab():
    """A `Sandbox` enter + exec(code="x = 1") + exit, paced (0.1 s idle before each) and back to
    back, beside `/usr/bin/python3 -c "x = 1"` called directly."""
    clients = _recycle_clients(VARIANTS)
    rows: dict[str, list[float]] = {}
    print(f"\nload (1/5/15 min): {_load()}; platform: systrap on a kvm_pvm host")
    try:
        for rnd in range(int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "8"))):
            order = list(clients) if rnd % 2 == 0 else list(clients)[::-1]
            for _ in range(3):
                t0 = time.perf_counter()
                subprocess.run(["/usr/bin/python3", "-c", "x = 1"], check=True)
                rows.setdefault("native /usr/bin/python3 -c 'x = 1'", []).append((time.perf_counter() - t0) * 1e3)
            for paced in (True, False):
                for m in order:
                    for _ in range(6):
                        _time_sandbox(rows, clients[m], m, paced)
    finally:
        for c in clients.values():
            c.close()
    _print_rows(rows, "native /usr/bin/python3 -c 'x = 1'")
    print(f"load after: {_load()}")


def test_fork_group_64_placement_ab():
    """`fork_group(64)` + map of `exec(code=...)` on a session, beside 64 x `os.fork` + `_exit` +
    `waitpid` of this process."""
    clients = _recycle_clients(VARIANTS)
    sessions = {m: c.session("python").__enter__() for m, c in clients.items()}
    for s in sessions.values():
        assert s.exec(code="x = 1").ok
    rows: dict[str, list[float]] = {}

    def native():
        for i in range(64):
            pid = os.fork()
            if pid == 0:
                os._exit(0)
            os.waitpid(pid, 0)

    print(f"\nload (1/5/15 min): {_load()}; platform: systrap on a kvm_pvm host")
    try:
        for rnd in range(int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "10"))):
            t0 = time.perf_counter()
            native()
            rows.setdefault("native: 64 x os.fork + _exit + waitpid", []).append((time.perf_counter() - t0) * 1e3)
            order = list(sessions) if rnd % 2 == 0 else list(sessions)[::-1]
            for m in order:
                t0 = time.perf_counter()
                with sessions[m].fork_group(64) as grp:
                    assert all(r.ok for r in grp.map(lambda i, c: c.exec(code=f"y = x + {i}")))
                rows.setdefault(f"fork_group(64) + map, {m}", []).append((time.perf_counter() - t0) * 1e3)
    finally:
        for s in sessions.values():
            s.kill()
        for c in clients.values():
            c.close()
    _print_rows(rows, "native: 64 x os.fork + _exit + waitpid")
    print(f"load after: {_load()}")


def test_grading_placement_ab():
    """GRPO-shape grading (HumanEval's canonical solutions, 16 problems x 8 candidates, one
    grade_batch per problem, as benches/bench_grading_specs.py) beside a warm fork server per
    worker on the same candidates (no sandbox)."""
    _grading_ab(VARIANTS)
