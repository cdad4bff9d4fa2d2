"""Threads through the SDK on systrap (`connect(platform="systrap")`): a session's code starts
threads (concurrent.futures), and code that computes past an exec's timeout is interrupted and its
sandbox kept, as on kvm. The engine side is crates/engine/tests/systrap_threads.rs."""

from __future__ import annotations


import pytest
from collimate_rl import rollout_once

from platforms import systrap_client


@pytest.fixture(scope="module")
def client():
    return systrap_client()


POOL = """
from concurrent.futures import ThreadPoolExecutor
import threading
def f(x):
    return sum(i * i for i in range(x * 500))
with ThreadPoolExecutor(max_workers=4) as ex:
    got = list(ex.map(f, range(32)))
print(got == [sum(i * i for i in range(x * 500)) for x in range(32)], threading.active_count())
"""


def test_a_session_runs_a_thread_pool(client):
    with client.session("python") as s:
        r = s.exec(code=POOL, timeout_seconds=120)
        assert (r.ok, r.stdout, r.platform) == (True, "True 1\n", "systrap"), r
        # Threads that outlive an exec keep running between execs' turns and are joined later.
        r = s.exec(code="import threading, queue\nq = queue.Queue()\nw = threading.Thread(target=lambda: q.put(sum(range(10**5))))\nw.start()")
        assert r.ok, r
        r = s.exec(code="w.join(); print(q.get())", timeout_seconds=60)
        assert (r.ok, r.stdout) == (True, f"{sum(range(10**5))}\n"), r


def test_computing_code_past_its_timeout_is_interrupted_and_the_sandbox_kept(client):
    with client.session("python") as s:
        s.exec(code="y = 1\nopen('/work/kept', 'w').write('x')")
        r = s.exec(code="while True:\n    pass", timeout_seconds=1)
        assert r.timed_out and r.exit_code == 124 and "KeyboardInterrupt" in r.stderr, r
        assert "the sandbox is kept" in r.note, r.note
        r = s.exec(code="import os\nprint('y' in globals(), os.path.exists('/work/kept'))")
        assert r.ok and r.stdout == "True True\n" and not r.interpreter_restarted, r


SPIN = """
import threading, time
flag = []
t = threading.Thread(target=lambda: (time.sleep(0.01), flag.append(1)))
t.start()
while not flag:
    pass
t.join()
print('spun', len(flag))
"""


def test_a_seeded_run_switches_a_spinning_thread_out(client):
    # Replay mode (a seed) switches threads by their events and moves virtual time by them; the
    # main thread spins without any, holding the GIL, until the other thread's sleep has ended and
    # it has run: only replay's guard of CPU time, which on systrap must count the stub's (where
    # the guest computes), lets it.
    r = rollout_once("python", code=SPIN, seed="c0ffee00" * 8, client=client)
    assert (r.ok, r.stdout) == (True, "spun 1\n"), r


HUNDRED = """
import threading
ev = threading.Event()
ts = [threading.Thread(target=ev.wait) for _ in range(100)]
for t in ts:
    t.start()
print(threading.active_count())
ev.set()
for t in ts:
    t.join()
"""


def test_a_sandbox_starts_a_hundred_threads_at_once(client):
    # CPython's test_queue runs 100 threads at once. Each has an 8 MiB stack and glibc reserves
    # 64 MiB (PROT_NONE) per malloc arena: a stub bounded by RLIMIT_AS at the sandbox's 1 GiB
    # stopped at 60 ("can't start new thread"); its private writable memory (RLIMIT_DATA) is the
    # bound now, as kvm's is the pages used.
    with client.session("python") as s:
        r = s.exec(code=HUNDRED, timeout_seconds=120)
        assert (r.ok, r.stdout) == (True, "101\n"), r
