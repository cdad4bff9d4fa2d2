"""Shared fixtures and the summary table for the pytest-benchmark files in benches/.

Run: `pytest benches/` (after `maturin develop --release`). Timings never decide pass/fail;
the table printed at the end gives median, p99 and the ratio to the host baseline
(os.fork + _exit + waitpid) measured in the same run.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "tests"))

from guestprogs import READY_YIELD, load_testvm  # noqa: E402

from collimate_core import Vm  # noqa: E402

BASELINE = "test_host_fork_baseline"
# The host interpreter the native baselines run: the distribution's binary, called directly (a
# version manager's shim on PATH adds ~100 ms a start and would flatter the sandbox); the real
# binary behind sys.executable only where there is no /usr/bin/python3.
HOST_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(sys.executable)


def host_fork_baseline(benchmark) -> None:
    """The host baseline every table compares with, measured in this run: os.fork() + os._exit(0)
    + waitpid, in this process. Each benchmark file runs it as its test_host_fork_baseline."""

    def fork_exit_wait():
        pid = os.fork()
        if pid == 0:
            os._exit(0)
        os.waitpid(pid, 0)

    benchmark.pedantic(fork_exit_wait, rounds=300, warmup_rounds=10)


@pytest.fixture(scope="session")
def elf(tmp_path_factory) -> bytes:
    return load_testvm(tmp_path_factory.mktemp("testvm"))


@pytest.fixture(scope="session")
def zygote(elf, tmp_path_factory):
    """testvm restored from a snapshot taken at its first `yield(0)`; clones start there."""
    snap = tmp_path_factory.mktemp("ready")
    with Vm.boot(elf) as vm:
        r = vm.run(10.0)
        assert (r.kind, r.value) == ("yield", READY_YIELD), r
        vm.snapshot(snap)
    with Vm.restore(snap) as vm:
        yield vm


def _p99(data: list[float]) -> float:
    ordered = sorted(data)
    return ordered[max(0, math.ceil(0.99 * len(ordered)) - 1)]


def _fmt_time(seconds: float) -> str:
    if seconds >= 1e-3:
        return f"{seconds * 1e3:9.3f} ms"
    return f"{seconds * 1e6:9.1f} us"


def pytest_terminal_summary(terminalreporter, exitstatus, config):
    session = getattr(config, "_benchmarksession", None)
    benches = [b for b in getattr(session, "benchmarks", []) if b.stats.data]
    if not benches:
        return
    baseline = next((b for b in benches if b.name == BASELINE), None)
    base_median = sorted(baseline.stats.data)[len(baseline.stats.data) // 2] if baseline else None
    write = terminalreporter.write_line
    terminalreporter.section("collimate benchmarks")
    write(f"{'benchmark':<44} {'rounds':>6} {'median':>12} {'p99':>12} {'x host fork':>12}")
    for b in benches:
        data = b.stats.data
        median = b.stats.median
        ratio = f"{median / base_median:11.2f}x" if base_median else f"{'-':>12}"
        p99 = _fmt_time(_p99(data))
        write(f"{b.name:<44} {len(data):>6} {_fmt_time(median):>12} {p99:>12} {ratio}")
    notes = [(b.name, k, v) for b in benches for k, v in sorted(b.extra_info.items())]
    if notes:
        write("")
        for name, key, value in notes:
            shown = f"{value / (1 << 20):.2f} MiB" if key.endswith("_bytes") else str(value)
            write(f"{name}: {key} = {shown}")
    if base_median:
        write(f"(x host fork = median / median of {BASELINE}: os.fork() + os._exit(0) + waitpid)")
