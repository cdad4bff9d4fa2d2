"""Benchmarks through the public SDK surface (issue 5), next to a host baseline from the same run.

The summary table (benches/conftest.py) prints median, p99 and the ratio to the host baseline
(os.fork + _exit + waitpid); run together with bench_engine.py (`pytest benches/`) it puts these
figures next to the engine-level ones. Targets from the issues, printed, never asserted:
Sandbox enter + exec + exit p50 <= 5 ms; fork_group(64) + map p50 <= 150 ms; grade_batch of 64 at
least as fast as a plain subprocess-per-candidate grader on the host (no isolation).
"""

from __future__ import annotations

import os
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import pytest

from collimate_core import EmbeddedClient, Sandbox, UnitTestReward, grade_batch, rollout_once
from conftest import HOST_PYTHON, host_fork_baseline

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

WIDTH = 64
GAP = 0.003  # a trainer works between rollouts; meanwhile the zygote refills its spare clones
_medians: dict[str, float] = {}

TESTS = "assert solve([3, 1, 2]) == [1, 2, 3]\nassert solve([2, 2, 1]) == [1, 2, 2]\nassert solve([]) == []\n"
_BODIES = [
    "def solve(xs):\n    return sorted(xs)\n",
    "def solve(xs):\n    out = list(xs)\n    out.sort()\n    return out\n",
    "def solve(xs):\n    return sorted(set(xs))\n",  # drops duplicates: 0.0
    "def solve(xs):\n    return xs\n",  # does nothing: 0.0
]
CANDIDATES = [_BODIES[i % len(_BODIES)] + f"# candidate {i}\n" for i in range(WIDTH)]
EXPECTED = [1.0 if i % len(_BODIES) < 2 else 0.0 for i in range(WIDTH)]


@pytest.fixture(scope="module")
def client():
    c = EmbeddedClient()
    c._template("python")  # bake (first run) or load the template; start its zygote
    with Sandbox("python", client=c) as sb:  # warm the path once
        sb.exec(code="print(1)")
    yield c
    c.close()


def _median(benchmark) -> float:
    data = sorted(benchmark.stats.stats.data)
    return data[len(data) // 2]


def _drain(c: EmbeddedClient) -> None:
    """Untimed: wait for sandboxes destroyed in the last round to be torn down or recycled."""
    c._reaper.submit(lambda: None).result()


def test_host_fork_baseline(benchmark):
    host_fork_baseline(benchmark)


def test_sdk_sandbox_enter_exec_exit(benchmark, client):
    """`with Sandbox("python") as sb: sb.exec(code="print(1)")`: clone (or recycled sandbox),
    reseed + one agent round trip, destroy (the teardown itself is asynchronous)."""
    warm = []

    def cycle():
        with Sandbox("python", client=client) as sb:
            r = sb.exec(code="print(1)")
            warm.append(sb.warm_hit)
        assert r.stdout == "1\n" and r.seed_ack == "verified", r

    benchmark.pedantic(cycle, setup=lambda: time.sleep(GAP), rounds=300, warmup_rounds=10)
    benchmark.extra_info["warm_hits"] = f"{sum(warm)}/{len(warm)}"
    benchmark.extra_info["target_p50"] = "5 ms"


def test_sdk_rollout_once(benchmark, client):
    """`rollout_once("python", code="print(1)", seed=...)`: the one-shot convenience."""
    seed = "c0ffee00" * 8

    def once():
        r = rollout_once("python", code="print(1)", seed=seed, client=client)
        assert r.ok and r.seed_ack == "verified"

    benchmark.pedantic(once, setup=lambda: time.sleep(GAP), rounds=200, warmup_rounds=10)


def test_sdk_fork_group_64_map(benchmark, client):
    """A live parent (after a prefix) forks 64 children, each runs exec(code="pass") in the map's
    thread pool, the group closes: `with sess.fork_group(64) as grp: grp.map(...)`."""
    with Sandbox("python", client=client) as sess:
        sess.exec(code="import json, fractions\nprefix = [i * i for i in range(10000)]")

        def group():
            with sess.fork_group(WIDTH) as grp:
                out = grp.map(lambda i, c: c.exec(code="pass").exit_code)
            assert out == [0] * WIDTH

        benchmark.pedantic(group, setup=lambda: _drain(client), rounds=15, warmup_rounds=2)
    _drain(client)
    benchmark.extra_info["target_p50"] = "150 ms"


def _subprocess_grade(code: str, parallel: bool) -> list[float]:
    # The plain grader: candidate + tests in one `python3 -c` per candidate, on the host, no
    # isolation. A verdict is exit status 0.
    def one(c):
        p = subprocess.run([HOST_PYTHON, "-c", c + "\n" + TESTS], capture_output=True, timeout=30)
        return 1.0 if p.returncode == 0 else 0.0

    if parallel:
        with ThreadPoolExecutor(max_workers=2 * (os.cpu_count() or 1)) as pool:
            return list(pool.map(one, CANDIDATES))
    return [one(c) for c in CANDIDATES]


def test_plain_subprocess_grader_64_sequential(benchmark):
    """The baseline of issue 7: 64 candidates graded by one host `python3 -c` each, in turn."""
    rewards = benchmark.pedantic(lambda: _subprocess_grade("", False), rounds=5, warmup_rounds=1)
    assert rewards == EXPECTED
    _medians["sequential"] = _median(benchmark)


def test_plain_subprocess_grader_64_parallel(benchmark):
    """Same, with 2 x cores subprocesses at a time."""
    rewards = benchmark.pedantic(lambda: _subprocess_grade("", True), rounds=5, warmup_rounds=1)
    assert rewards == EXPECTED
    _medians["parallel"] = _median(benchmark)


def test_sdk_grade_batch_64(benchmark, client):
    """grade_batch of 64 small unit-test candidates: one clone, a fork group of 64, two execs per
    child (the candidate, then the tests), in isolated sandboxes."""
    spec = UnitTestReward(tests=TESTS)

    def batch():
        return [g.reward for g in grade_batch(CANDIDATES, spec, client=client)]

    rewards = benchmark.pedantic(batch, setup=lambda: _drain(client), rounds=8, warmup_rounds=1)
    assert rewards == EXPECTED
    m = _median(benchmark)
    for k, v in _medians.items():
        benchmark.extra_info[f"speedup_vs_subprocess_grader_{k}"] = f"{v / m:.2f}x (>= 1.0 is at least as fast)"
