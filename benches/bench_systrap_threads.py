"""Threads on kvm and on systrap side by side (`EmbeddedClient(platform=...)`), beside a native
baseline measured in the same run (`/usr/bin/python3` called directly); see benches/conftest.py for
the summary table (median, p99, ratio to a host fork) and the `x_native` ratio under it.

- Event ping-pong: two threads hand a turn back and forth through two `threading.Event`s (a futex
  wake and a futex wait per hand-off, and a thread switch on the sandbox's one CPU), per round trip:
  the run's time minus the same program with no round trips, timed from outside (guest clocks are
  virtual), as in benches/bench_threads.py.
- GIL hand-off: two CPU-bound threads counting to N each against one counting to 2N (the price of
  slices and switches; on systrap each slice's end is a kick of the stub).

Needs seccomp filters for the systrap rows and /dev/kvm for the kvm rows. Every figure's platform is
in its name (kvm here is kvm_pvm on the development machines).
"""

from __future__ import annotations

import os
import statistics
import subprocess
import time

import pytest
from collimate_core import EmbeddedClient

from conftest import host_fork_baseline

NATIVE = "/usr/bin/python3"
PLATFORMS = ["kvm", "systrap"]
_medians: dict[str, float] = {}

EVENTS = """
import threading
N = {n}
a, b = threading.Event(), threading.Event()
def other():
    for _ in range(N):
        a.wait(); a.clear(); b.set()
t = threading.Thread(target=other); t.start()
for _ in range(N):
    a.set(); b.wait(); b.clear()
t.join()
"""
ROUND_TRIPS = 500

GIL = """
import threading
N = {n}
def count():
    s = 0
    for i in range(N):
        s += i
ts = [threading.Thread(target=count) for _ in range({threads})]
for t in ts: t.start()
for t in ts: t.join()
"""
COUNT = 1_000_000


@pytest.fixture(scope="module", params=PLATFORMS)
def session(request):
    platform = request.param
    if platform == "kvm" and not os.path.exists("/dev/kvm"):
        pytest.skip("needs /dev/kvm")
    os.environ.pop("COLLIMATE_API_KEY", None)
    c = EmbeddedClient(platform=platform)
    with c.session("python") as s:
        assert s.exec(code="import threading").ok
        yield platform, s
    c.close()


def _native(code: str) -> float:
    t = time.perf_counter()
    subprocess.run([NATIVE, "-c", code], check=True)
    return time.perf_counter() - t


def _sandbox(s, code: str) -> float:
    t = time.perf_counter()
    r = s.exec(code=code, timeout_seconds=300)
    took = time.perf_counter() - t
    assert r.ok, r
    return took


def _per_op(benchmark, name: str, run, n: int, rounds: int) -> None:
    empty = sorted(run(EVENTS.format(n=0)) for _ in range(5))[2]
    benchmark.pedantic(lambda: run(EVENTS.format(n=n)), rounds=rounds, warmup_rounds=1)
    per = sorted((t - empty) / n for t in benchmark.stats.stats.data)
    benchmark.extra_info["per_round_trip_us"] = round(statistics.median(per) * 1e6, 1)
    benchmark.extra_info["per_round_trip_p99_us"] = round(per[-1] * 1e6, 1)
    _medians[name] = statistics.median(per)
    if name != "events native" and "events native" in _medians:
        benchmark.extra_info["x_native"] = round(_medians[name] / _medians["events native"], 1)


def test_host_fork_baseline(benchmark):
    host_fork_baseline(benchmark)


def test_event_ping_pong_native(benchmark):
    _per_op(benchmark, "events native", _native, ROUND_TRIPS * 10, rounds=7)


def test_event_ping_pong(benchmark, session):
    platform, s = session
    _per_op(benchmark, f"events {platform}", lambda c: _sandbox(s, c), ROUND_TRIPS, rounds=7)


def _gil(benchmark, name: str, run) -> None:
    run(GIL.format(n=2 * COUNT, threads=1))  # warm-up: the first run in a sandbox faults its pages in
    one = sorted(run(GIL.format(n=2 * COUNT, threads=1)) for _ in range(3))[1]
    benchmark.pedantic(lambda: run(GIL.format(n=COUNT, threads=2)), rounds=5, warmup_rounds=1)
    two = statistics.median(benchmark.stats.stats.data)
    benchmark.extra_info["two_over_one"] = round(two / one, 2)
    _medians[name] = two / one
    if name != "gil native" and "gil native" in _medians:
        benchmark.extra_info["x_native"] = round(_medians[name] / _medians["gil native"], 2)


def test_gil_hand_off_native(benchmark):
    _gil(benchmark, "gil native", _native)


def test_gil_hand_off(benchmark, session):
    platform, s = session
    _gil(benchmark, f"gil {platform}", lambda c: _sandbox(s, c))
