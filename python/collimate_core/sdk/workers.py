"""The threads `ForkGroup.map` runs its calls on: kept after a map for the next one.

A map of 64 execs started up to 32 new threads (a `ThreadPoolExecutor` per call) and joined them
at its end: 4-5 ms of a 64-child map's wall time on a 2-core host, each `Thread.start` waiting for
its thread to run (docs/systrap.md, "fork_group(64)"). Here a thread that finishes a call waits
`LINGER` seconds for the next one before it ends, and a call goes to a waiting thread when there
is one, else to a new thread: so calls never queue behind other maps (a map inside a map, or maps
of several groups from several threads at once, each get threads of their own as before), and
back-to-back maps reuse the same threads.
"""

from __future__ import annotations

import queue
import threading
from typing import Callable

# How long a thread waits for its next call before it ends.
LINGER = 2.0

_lock = threading.Lock()
_calls: queue.SimpleQueue = queue.SimpleQueue()
_idle = 0  # threads waiting on _calls that no call was handed to yet


def submit(call: Callable[[], None], finished: Callable[[], None]) -> None:
    """Run `call()` on a waiting thread or a new one, then `finished()` once that thread waits
    for its next call (so a map that waits for `finished` finds its threads waiting when it
    returns, for the next map). Neither may raise (`call` reports its own outcome)."""
    global _idle
    with _lock:
        if _idle:
            _idle -= 1
            _calls.put((call, finished))
            return
    threading.Thread(target=_work, args=((call, finished),), name="collimate-group", daemon=True).start()


def _work(job) -> None:
    global _idle
    while True:
        call, finished = job
        try:
            call()
        finally:
            with _lock:
                _idle += 1
            finished()
        job = call = finished = None  # nothing of the last call is kept while waiting
        while job is None:
            try:
                job = _calls.get(timeout=LINGER)
            except queue.Empty:
                with _lock:
                    # A call put meanwhile was counted against an idle thread: take it.
                    if _calls.empty():
                        _idle -= 1
                        return
