"""Admission: the live-sandbox slots and the bounded FIFO queue of creates and forks that wait for
one (429 past the bound or the wait, 409 for a group wider than the server)."""

from __future__ import annotations

import asyncio
from collections import deque

from collimate_core.server.errors import ApiError
from collimate_core.server.metrics import _Metrics


class _Admission:
    """Slots for live sandboxes; requests that do not fit wait in a bounded FIFO queue.

    Runs on the event loop only (threads call `release` through `call_soon_threadsafe`).
    """

    def __init__(self, limit: int, bound: int, timeout: float, metrics: "_Metrics"):
        self.limit, self.bound, self.timeout, self.metrics = limit, bound, timeout, metrics
        self.used = 0
        self.waiting: deque[tuple[int, asyncio.Future]] = deque()

    def _gauges(self) -> None:
        self.metrics.live.set(self.used)
        self.metrics.queue_depth.set(len(self.waiting))

    async def acquire(self, n: int) -> None:
        if n > self.limit:
            self.metrics.rejected.labels("too_wide").inc()
            raise ApiError(
                409, "capacity",
                f"{n} sandboxes can never fit: this server runs at most max_sandboxes={self.limit} live sandboxes",
            )
        if not self.waiting and self.used + n <= self.limit:
            self.used += n
            self._gauges()
            return
        if len(self.waiting) >= self.bound:
            self.metrics.rejected.labels("queue_full").inc()
            raise ApiError(
                429, "capacity",
                f"capacity queue full: {len(self.waiting)} requests already wait (queue bound {self.bound}) for "
                f"max_sandboxes={self.limit} live sandboxes; retry later or delete sandboxes",
                {"Retry-After": "1"},
            )
        fut: asyncio.Future = asyncio.get_running_loop().create_future()
        entry = (n, fut)
        self.waiting.append(entry)
        self.metrics.queued.inc()
        self._gauges()
        try:
            await asyncio.wait_for(asyncio.shield(fut), self.timeout)
        except asyncio.TimeoutError:
            if fut.done():
                return  # granted as the wait ran out
            self.waiting.remove(entry)
            self.metrics.rejected.labels("queue_timeout").inc()
            raise ApiError(
                429, "capacity",
                f"waited {self.timeout:g} s (queue_timeout) for one of max_sandboxes={self.limit} live sandboxes; "
                "retry later or delete sandboxes",
                {"Retry-After": "1"},
            ) from None
        except asyncio.CancelledError:
            if fut.done():
                self.release(n)
            else:
                self.waiting.remove(entry)
            raise
        finally:
            self._gauges()

    def release(self, n: int) -> None:
        self.used -= n
        while self.waiting and self.used + self.waiting[0][0] <= self.limit:
            k, fut = self.waiting.popleft()
            self.used += k
            fut.set_result(None)
        self._gauges()
