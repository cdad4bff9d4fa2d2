"""What a long-running client holds (issue 14's soak found two things that grew without bound).

- Usage metering is in time buckets (collimate_core.sdk.meter): the meter grows with the time the
  client has run, not with what it served (a list of events grew by every exec, in the embedded
  client and in the server's engine).
- Destroyed sandboxes wait for the reaper thread in a bounded queue: fork groups destroyed faster
  than it tears them down no longer pile up as live VMM processes.
"""

from __future__ import annotations

import math
import os

import pytest
from collimate_core.sdk.meter import FINE_SPAN, Meter
from hostprocs import GONE


def test_a_long_span_lands_in_minute_buckets_and_keeps_its_total():
    m = Meter()
    end = 1_000_000.0
    m.close_span(end - 86_400, end)  # a sandbox that lived for a day
    assert len(m.buckets) < 86_400 // 60 + FINE_SPAN + 3
    assert m.window(-math.inf, math.inf)["sandbox_seconds"] == pytest.approx(86_400)
    assert m.window(end - 600, end)["sandbox_seconds"] == pytest.approx(600)  # the last hour: exact
    assert all(width == 60 for width, start in m.buckets if start < end - FINE_SPAN - 60)
    m.compact(now=end)
    assert m.window(-math.inf, math.inf)["sandbox_seconds"] == pytest.approx(86_400)


@pytest.mark.kvm
@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_the_embedded_clients_meter_does_not_grow_with_execs():
    import time

    from collimate_core import EmbeddedClient, Sandbox

    os.environ.pop("COLLIMATE_API_KEY", None)
    c = EmbeddedClient()
    try:
        t0 = time.time()
        with Sandbox("python", client=c) as sb:
            for _ in range(300):
                sb.exec(code="pass")
        seconds = time.time() - t0
        assert c.usage().execs == 300 and c.usage().sandboxes == 1
        assert len(c._meter.buckets) <= seconds + 2  # one bucket per second that saw something
    finally:
        c.close()


def our_vmm_processes() -> int:
    """Live VMM processes running this checkout's extension (guest processes included)."""
    import collimate_core._core as core
    from pathlib import Path

    ext, n = core.__file__.encode(), 0
    for entry in Path("/proc").iterdir():
        try:
            if entry.name.isdigit() and b"_vmm_main" in (entry / "cmdline").read_bytes() and ext in (entry / "cmdline").read_bytes():
                n += (entry / "stat").read_text().rsplit(")", 1)[1].split()[0] not in GONE
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            pass
    return n


@pytest.mark.kvm
@pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")
def test_destroyed_fork_groups_do_not_pile_up_as_live_processes():
    from collimate_core import EmbeddedClient
    from collimate_core.sdk.embedded import RECYCLE_MAX, REAP_BACKLOG

    os.environ.pop("COLLIMATE_API_KEY", None)
    width = 8
    c = EmbeddedClient()
    try:
        with c.session("python") as s:
            s.exec(code="pass")
        c._reaper.submit(lambda: None).result()
        base = our_vmm_processes()
        peak = backlog = 0
        for _ in range(60):
            with c.session("python") as sess:
                with sess.fork_group(width) as grp:
                    grp.map(lambda i, child: child.exec(code="pass"))
            backlog = max(backlog, c._reaping)
            peak = max(peak, our_vmm_processes())
        assert backlog <= REAP_BACKLOG
        # Beyond the pools (spares, recycled sandboxes), at most the reaper's queue and one group.
        assert peak - base <= REAP_BACKLOG + RECYCLE_MAX + width + 1, (base, peak)
    finally:
        c.close()
