"""Metered totals in time buckets, for `usage(since, until)` windows (the embedded client's and
the control plane's per tenant).

Kept as buckets, not as a list of events, so that a long-lived client or server holds memory in
proportion to the time it has run, not to the number of sandboxes and execs it served.
"""

from __future__ import annotations

import math
import time

FIELDS = ("sandboxes", "execs", "forks", "bytes_in", "bytes_out", "sandbox_seconds", "egress_bytes_out", "egress_bytes_in")
FINE_SPAN = 3600  # seconds kept at one-second resolution; older ones at one minute


class Meter:
    """A tenant's metered totals in time buckets: one second for the last hour, one minute before.

    Counters land in the bucket of their time; a finished sandbox's seconds are spread over the
    buckets it lived in. A window query takes buckets that lie wholly inside it and the covered
    fraction of the two it cuts through.
    """

    def __init__(self) -> None:
        self.buckets: dict[tuple[int, int], list[float]] = {}  # (width, start) -> amounts
        self.spent = 0.0  # sandbox-seconds of finished sandboxes, all time

    def _bucket(self, t: float) -> list[float]:
        key = (1, int(t))
        b = self.buckets.get(key)
        if b is None:
            b = self.buckets[key] = [0.0] * len(FIELDS)
        return b

    def add(self, what: str, amount: float, t: float | None = None) -> None:
        self._bucket(time.time() if t is None else t)[FIELDS.index(what)] += amount

    def close_span(self, start: float, end: float) -> None:
        self.spent += max(0.0, end - start)
        i = FIELDS.index("sandbox_seconds")
        # Seconds more than FINE_SPAN before the end go straight into the minute buckets that
        # `compact` would fold them into: a sandbox that lived for a day makes about 5,000 buckets,
        # not 86,400.
        cut = math.floor(end) - FINE_SPAN
        s = start
        while s < end:
            if s < cut:
                first = math.floor(s / 60) * 60
                e, key = min(end, cut, first + 60), (60, first)
            else:
                first = math.floor(s)
                e, key = min(end, first + 1), (1, first)
            b = self.buckets.get(key)
            if b is None:
                b = self.buckets[key] = [0.0] * len(FIELDS)
            b[i] += e - s
            s = e

    def compact(self, now: float) -> None:
        cut = int(now) - FINE_SPAN
        for key in [k for k in self.buckets if k[0] == 1 and k[1] < cut]:
            vals = self.buckets.pop(key)
            coarse = self.buckets.setdefault((60, key[1] - key[1] % 60), [0.0] * len(FIELDS))
            for i, v in enumerate(vals):
                coarse[i] += v

    def window(self, lo: float, hi: float) -> dict[str, float]:
        out = [0.0] * len(FIELDS)
        for (width, start), vals in self.buckets.items():
            cover = min(hi, start + width) - max(lo, start)
            if cover <= 0:
                continue
            frac = min(1.0, cover / width)
            for i, v in enumerate(vals):
                out[i] += v * frac
        return dict(zip(FIELDS, out))
