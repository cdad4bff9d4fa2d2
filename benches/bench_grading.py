"""grade_batch against a plain subprocess-per-candidate grader, in the same run (issue 7).

The group: 64 candidates of a small unit-test task (8 solutions, right and wrong, 8 times over).
- grade_batch: one clone of the python template, the grader installed once, then one forked child
  per candidate (the candidate, then the tests, in an isolated sandbox), WORKERS at a time.
- the plain grader: `python3 -c candidate + tests` per candidate on the host, no isolation, WORKERS
  at a time; the verdict is the exit status. It runs the host's Debian CPython (/usr/bin/python3,
  the same interpreter the python template runs) when the host has one.

Both run with the same parallelism (WORKERS = the host's cores); grade_batch also runs with its
default (the cores + 1). Printed after the benchmarks: median, p99, per candidate, and the speedup
(the plain grader's median over this grader's; >= 1.00x: at least as fast). Timings are printed,
never asserted. The first grade_batch of a process prepares its template (the setup and the grader,
checkpointed once); that is done before timing, as a trainer pays it once per run.
"""

from __future__ import annotations

import math
import os
import statistics
import subprocess
from concurrent.futures import ThreadPoolExecutor

import pytest

from collimate_core import EmbeddedClient, Sandbox, UnitTestReward, grade_batch
from conftest import HOST_PYTHON

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

WIDTH = 64
WORKERS = os.cpu_count() or 2
ROUNDS = 12

TESTS = """\
assert dedup_sorted([3, 1, 2, 3]) == [1, 2, 3]
assert dedup_sorted([]) == []
assert dedup_sorted([5, 5, 5]) == [5]
assert dedup_sorted([-1, 10, -1, 0]) == [-1, 0, 10]
assert dedup_sorted(list(range(50, 0, -1))) == list(range(1, 51))
"""
_SOLUTIONS = [
    ("def dedup_sorted(xs):\n    return sorted(set(xs))\n", 1.0),
    ("def dedup_sorted(xs):\n    out = []\n    for x in sorted(xs):\n        if not out or out[-1] != x:\n            out.append(x)\n    return out\n", 1.0),
    ("def dedup_sorted(xs):\n    return sorted(dict.fromkeys(xs))\n", 1.0),
    ("import heapq\ndef dedup_sorted(xs):\n    h = list(set(xs))\n    heapq.heapify(h)\n    return [heapq.heappop(h) for _ in range(len(h))]\n", 1.0),
    ("def dedup_sorted(xs):\n    return sorted(xs)\n", 0.0),  # keeps duplicates
    ("def dedup_sorted(xs):\n    return list(set(xs))\n", 0.0),  # unordered
    ("def dedup_sorted(xs):\n    return tuple(sorted(set(xs)))\n", 0.0),  # a tuple, not a list
    ("def dedup_sorted(xs):\n    raise NotImplementedError\n", 0.0),
]
CANDIDATES = [_SOLUTIONS[i % len(_SOLUTIONS)][0] + f"# candidate {i}\n" for i in range(WIDTH)]
EXPECTED = [_SOLUTIONS[i % len(_SOLUTIONS)][1] for i in range(WIDTH)]
_runs: dict[str, list[float]] = {}


@pytest.fixture(scope="module")
def client():
    c = EmbeddedClient()
    c._template("python")  # bake (first run) or load the template; start its zygote
    with Sandbox("python", client=c) as sb:
        sb.exec(code="pass")
    yield c
    c.close()


def _drain(c: EmbeddedClient) -> None:
    """Untimed: wait until the last round's sandboxes are torn down or recycled."""
    c._reaper.submit(lambda: None).result()


def plain_grader(codes: list[str]) -> list[float]:
    def one(code: str) -> float:
        p = subprocess.run([HOST_PYTHON, "-c", code + "\n" + TESTS], capture_output=True, timeout=60, cwd="/tmp")
        return 1.0 if p.returncode == 0 else 0.0

    with ThreadPoolExecutor(max_workers=WORKERS) as pool:
        return list(pool.map(one, codes))


def test_plain_subprocess_grader_64(benchmark):
    """64 x `python3 -c candidate + tests` on the host, WORKERS at a time."""
    assert plain_grader(CANDIDATES) == EXPECTED
    benchmark.pedantic(plain_grader, args=(CANDIDATES,), rounds=ROUNDS, warmup_rounds=1)
    benchmark.extra_info["interpreter"] = HOST_PYTHON
    _runs[f"plain python3 -c, {WORKERS} workers"] = list(benchmark.stats.stats.data)


@pytest.mark.parametrize("workers", [WORKERS, None], ids=["same_workers", "default_workers"])
def test_grade_batch_64(benchmark, client, workers):
    """grade_batch of the same 64 candidates: WORKERS at a time, then its default."""
    spec = UnitTestReward(tests=TESTS, timeout_seconds=10)

    def batch():
        return [g.reward for g in grade_batch(CANDIDATES, spec, client=client, max_workers=workers)]

    assert batch() == EXPECTED
    benchmark.pedantic(batch, setup=lambda: _drain(client), rounds=ROUNDS, warmup_rounds=1)
    shown = WORKERS if workers is not None else f"default {(os.cpu_count() or 2) + 1}"
    _runs[f"grade_batch, {shown} workers"] = list(benchmark.stats.stats.data)


def _p99(data: list[float]) -> float:
    ordered = sorted(data)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def test_print_grading_table(capsys):
    """The table (runs after the benchmarks above)."""
    plain = f"plain python3 -c, {WORKERS} workers"
    if plain not in _runs or len(_runs) < 2:
        pytest.skip("needs the benchmarks of this file in the same run")
    base_median = statistics.median(_runs[plain])
    lines = [
        "",
        f"grading a group of {WIDTH} candidates ({os.cpu_count()} cores; host interpreter {HOST_PYTHON})",
        f"{'grader':<40} {'rounds':>6} {'median':>11} {'p99':>11} {'per cand.':>10} {'speedup':>8}",
    ]
    for name, data in _runs.items():
        median = statistics.median(data)
        lines.append(
            f"{name:<40} {len(data):>6} {median * 1e3:8.1f} ms {_p99(data) * 1e3:8.1f} ms "
            f"{median / WIDTH * 1e3:7.2f} ms {base_median / median:7.2f}x"
        )
    lines.append("(speedup = the plain grader's median / this grader's median; >= 1.00x is at least as fast)")
    with capsys.disabled():
        print("\n".join(lines))
