"""Usage metering in time buckets (collimate_core._meter), and that a client's meter grows with
the time it has run, not with what it served (issue 14's soak: a list of events grew by every
exec, without bound, in the embedded client and in the server's engine)."""

from __future__ import annotations

import math
import os

import pytest
from collimate_core._meter import FINE_SPAN, Meter


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
