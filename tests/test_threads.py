"""Threads in the guest runtime (issue 15): Debian's CPython, unmodified, with real threads.

A guest process's threads take turns on its one vCPU (M:1, see crates/engine/src/vmm/threads.rs):
these tests run the threading, queue, concurrent.futures and asyncio machinery users' code relies
on, through the public SDK. Every exec passes a seed, so these run in replay mode (virtual time,
deterministic schedule); a few also check what replays reproduce.

What happens to a thread still running when an exec ends: the interpreter (and so its threads)
lives on between execs, paused with the sandbox: such a thread does not run while the sandbox is
idle, and goes on while the next exec runs (test_a_thread_left_running_pauses_between_execs).
"""

from __future__ import annotations

import os

import pytest
from collimate_rl import EmbeddedClient, Sandbox, connect

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

SEED = "11" * 32


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


@pytest.fixture
def sb(client):
    with Sandbox("python", client=client) as s:
        yield s


def run(sb, code: str, timeout: float = 60, **kw):
    r = sb.exec(code=code, timeout_seconds=timeout, **kw)
    assert r.exit_code == 0 and not r.interpreter_died and not r.timed_out, r
    return r


def test_producers_and_consumers_over_a_queue_and_a_condition(sb):
    r = run(
        sb,
        """
import threading, queue
q = queue.Queue(maxsize=3)
cv = threading.Condition()
done = []
def produce(k):
    for i in range(250):
        q.put((k, i))
def consume():
    while (item := q.get()) is not None:
        with cv:
            done.append(item)
            cv.notify_all()
producers = [threading.Thread(target=produce, args=(k,)) for k in range(4)]
consumers = [threading.Thread(target=consume) for _ in range(4)]
for t in producers + consumers:
    t.start()
with cv:
    assert cv.wait_for(lambda: len(done) == 1000, timeout=60)
for _ in consumers:
    q.put(None)
for t in producers + consumers:
    t.join()
print(len(done), sorted(done) == sorted((k, i) for k in range(4) for i in range(250)))
print(threading.active_count())
""",
    )
    assert r.stdout == "1000 True\n1\n"


def test_a_thread_pool_maps(sb):
    r = run(
        sb,
        """
from concurrent.futures import ThreadPoolExecutor
import threading
with ThreadPoolExecutor(max_workers=6) as ex:
    out = list(ex.map(lambda x: (x * x, threading.get_ident()), range(500)))
print(sum(v for v, _ in out), len({t for _, t in out}) >= 1)
""",
    )
    assert r.stdout == f"{sum(x * x for x in range(500))} True\n"


def test_a_timer_fires_after_its_interval(sb):
    r = run(
        sb,
        """
import threading, time
fired = threading.Event()
t0 = time.monotonic()
threading.Timer(0.25, fired.set).start()
print(fired.wait(10), time.monotonic() - t0 >= 0.25)
cancelled = threading.Timer(5, lambda: print("never"))
cancelled.start(); cancelled.cancel(); cancelled.join()
print("cancelled")
""",
    )
    assert r.stdout == "True True\ncancelled\n"


def test_asyncio_to_thread_and_run_in_executor(sb):
    r = run(
        sb,
        """
import asyncio, time, threading
def blocking(x):
    time.sleep(0.02)
    return x * 2, threading.current_thread() is not threading.main_thread()
async def main():
    got = await asyncio.gather(*(asyncio.to_thread(blocking, i) for i in range(6)))
    loop = asyncio.get_running_loop()
    more = await loop.run_in_executor(None, blocking, 10)
    return got, more
got, more = asyncio.run(main())
print([v for v, _ in got], all(o for _, o in got), more)
""",
    )
    assert r.stdout == "[0, 2, 4, 6, 8, 10] True (20, True)\n"


def test_a_thread_that_raises_reports_and_the_rest_goes_on(sb):
    r = run(
        sb,
        """
import threading
def bad():
    raise ValueError("boom in a thread")
t = threading.Thread(target=bad, name="bad-one")
t.start(); t.join()
print("joined", t.is_alive())
""",
    )
    assert r.stdout == "joined False\n"
    assert "ValueError: boom in a thread" in r.stderr and "bad-one" in r.stderr


def test_thread_identity_names_and_proc_task(sb):
    r = run(
        sb,
        """
import os, threading, ctypes
libc = ctypes.CDLL(None)
out = {}
def body():
    libc.prctl(15, b"worker-x", 0, 0, 0)  # PR_SET_NAME
    out["tid"] = threading.get_native_id()
    out["pid"] = os.getpid()
    out["comm"] = open(f"/proc/self/task/{out['tid']}/comm").read()
    out["tasks"] = sorted(int(t) for t in os.listdir("/proc/self/task"))
    ready.set(); go.wait()
ready, go = threading.Event(), threading.Event()
t = threading.Thread(target=body); t.start(); ready.wait()
main_comm = open("/proc/self/comm").read()
threads_line = [l for l in open("/proc/self/status") if l.startswith("Threads:")][0].split()[1]
go.set(); t.join()
print(out["pid"] == os.getpid() == 1, out["tid"] != 1, out["comm"].strip(), main_comm.strip() != "worker-x")
print(out["tasks"] == sorted([1, out["tid"]]), threads_line)
print(sorted(int(t) for t in os.listdir("/proc/self/task")))
""",
    )
    assert r.stdout == "True True worker-x True\nTrue 2\n[1]\n"


def test_signals_go_to_the_main_thread_handler_and_tgkill_reaches_a_thread(sb):
    r = run(
        sb,
        """
import os, signal, threading, time
got = []
signal.signal(signal.SIGUSR1, lambda s, f: got.append(("usr1", threading.current_thread().name)))
signal.signal(signal.SIGUSR2, lambda s, f: got.append(("usr2", threading.current_thread().name)))
stop = threading.Event()
def worker():
    # This thread blocks SIGUSR1: a signal to the process goes to one that does not.
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    # A thread signals itself (tgkill to its own tid); Python runs handlers in the main thread.
    signal.pthread_kill(threading.get_ident(), signal.SIGUSR2)
    while not stop.wait(0.01):
        pass
t = threading.Thread(target=worker, name="w"); t.start()
time.sleep(0.05)
os.kill(os.getpid(), signal.SIGUSR1)
time.sleep(0.05)
signal.pthread_kill(threading.main_thread().ident, signal.SIGUSR1)
time.sleep(0.05)
stop.set(); t.join()
print(got)
""",
    )
    assert r.stdout == "[('usr2', 'MainThread'), ('usr1', 'MainThread'), ('usr1', 'MainThread')]\n"


def test_a_thread_left_running_pauses_between_execs(sb):
    run(
        sb,
        """
import threading, time
ticks = []
def ticker():
    while True:
        ticks.append(time.monotonic())
        time.sleep(0.01)
threading.Thread(target=ticker, daemon=True).start()
time.sleep(0.05)
""",
    )
    r = run(
        sb,
        """
import threading
before = len(ticks)
time.sleep(0.1)
after = len(ticks)
print(threading.active_count(), after > before)
""",
    )
    assert r.stdout == "2 True\n"


def test_ten_thousand_short_lived_threads_leave_nothing_behind(sb):
    r = run(
        sb,
        """
import threading, os
def nothing():
    pass
for _ in range(10_000):
    t = threading.Thread(target=nothing)
    t.start(); t.join()
print(threading.active_count(), os.listdir("/proc/self/task"))
""",
        timeout=300,
    )
    assert r.stdout == "1 ['1']\n"


def test_a_thread_bomb_stops_at_the_cap_and_the_sandbox_lives_on(client, sb):
    r = run(
        sb,
        """
import threading
threading.stack_size(64 * 1024)  # small stacks: the cap, not the sandbox's memory, ends it
stop = threading.Event()
started, error = 0, None
try:
    while started < 5000:
        threading.Thread(target=stop.wait).start()
        started += 1
except RuntimeError as e:
    error = str(e)
stop.set()
for t in threading.enumerate():
    if t is not threading.main_thread():
        t.join()
print(error, started, threading.active_count())
""",
        timeout=300,
    )
    # MAX_THREADS (crates/engine/src/vmm/threads.rs): extra threads per sandbox.
    assert r.stdout == "can't start new thread 512 1\n"
    # The cap gave its threads back: the same sandbox starts threads again, another one too.
    again = run(sb, "import threading; t = threading.Thread(target=print, args=('again',)); t.start(); t.join()")
    assert again.stdout == "again\n"
    with Sandbox("python", client=client) as other:
        assert run(other, "print(6 * 7)").stdout == "42\n"


def test_a_deadlock_ends_the_exec_with_every_threads_state(sb):
    r = sb.exec(
        code="""
import threading
a, b = threading.Lock(), threading.Lock()
a.acquire()
def other():
    b.acquire()
    a.acquire()
t = threading.Thread(target=other, name="other")
t.start()
import time; time.sleep(0.05)
b.acquire()
""",
        timeout_seconds=60,
    )
    assert not r.timed_out, r
    assert r.interpreter_died, r
    assert "deadlock in guest process 1" in r.stderr, r.stderr
    assert r.stderr.count("futex wait on") == 2, r.stderr
    # The next exec runs in a fresh interpreter, and says so.
    nxt = sb.exec(code="print('fresh')", timeout_seconds=60)
    assert nxt.stdout == "fresh\n" and nxt.interpreter_restarted


def test_a_thread_spinning_on_what_a_blocked_sibling_drains_lets_it_run(sb):
    """multiprocessing's Pool in miniature: one thread is blocked in a read of an empty pipe (the
    result handler), and once data comes, another (the worker handler) polls the same pipe in a
    loop until the reader has drained it. poll() answers at once, so the poller never blocks; on
    Linux the write wakes the reader. The M:1 scheduler must retry the blocked read between the
    poller's slices: it always loaded a runnable thread before any blocked one, and a Pool.map
    hung now and then in CI with a result in its pipe. Seeded, so the schedule is the same in
    every run: with the old order this program hung every time."""
    r = run(
        sb,
        """
import os, select, threading, time
r, w = os.pipe()
got = []
reader = threading.Thread(target=lambda: got.append(os.read(r, 16)))
reader.start()
time.sleep(0.2)  # the reader is in its read now
os.write(w, b"result")
p = select.poll()
p.register(r, select.POLLIN)
spins = 0
while reader.is_alive():
    p.poll(50)  # at once while the data is there; after the read, a short wait
    spins += 1
reader.join()
print(got, spins > 0)
""",
        timeout=60,
        seed=SEED,
    )
    assert r.stdout == "[b'result'] True\n", r


def test_a_switch_by_the_wall_clock_guard_says_not_reproducible(sb):
    """docs/replay.md's `not-reproducible` verdict, pinned: a thread that spins without a syscall
    while its sibling's sleep is due can only be switched out by the replay guard (CPU time, so
    where it comes depends on the host); the seed took, but the exec says so. Threads that switch
    at their blocking calls only (an Event ping-pong) stay `verified`, and so does the next exec of
    the same sandbox (the mark is the exec's, not the sandbox's)."""
    spin = """
import threading, time
stop = False
def spin():
    n = 0
    while not stop:
        n += 1
t = threading.Thread(target=spin); t.start()
time.sleep(0.05)
stop = True
t.join()
print("ok")
"""
    ping = """
import threading
a, b = threading.Event(), threading.Event()
def other():
    for _ in range(50):
        a.wait(); a.clear(); b.set()
t = threading.Thread(target=other); t.start()
for _ in range(50):
    a.set(); b.wait(); b.clear()
t.join()
print("ok")
"""
    got = [(r.stdout, r.seed_ack) for r in (run(sb, code, seed=SEED) for code in (spin, ping, spin, ping))]
    assert got == [("ok\n", "not-reproducible"), ("ok\n", "verified")] * 2, got


def test_fork_from_a_threaded_process_copies_the_calling_thread(sb):
    r = run(
        sb,
        """
import os, threading, time
stop = threading.Event()
t = threading.Thread(target=stop.wait); t.start()
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    os.write(w, str(threading.active_count()).encode() + b" " + str(len(os.listdir("/proc/self/task"))).encode())
    os._exit(0)
os.waitpid(pid, 0)
print(os.read(r, 100).decode())
stop.set(); t.join()
""",
    )
    # The child's Python still lists the thread object (CPython forgets it only in its own
    # after-fork hook for the threading module, which it runs), but the process has one thread.
    assert r.stdout.split()[1] == "1", r.stdout


def test_a_threaded_server_answers_without_waiting_for_its_main_threads_timeout(sb):
    """A server process: one thread blocks in accept(), its main thread waits with Event.wait(1);
    the client (this process) times its requests on the guest's clock. In replay mode that clock
    is virtual and deterministic: a request costs microseconds of it. Virtual time jumps to the
    earliest deadline only after a whole round in which nobody could move; the server's threads
    answering a request are progress, so its main thread's deadline must not come first (it did:
    a second per request). The figure checked is virtual time, which depends on the schedule
    alone, not on the host's speed."""
    r = run(
        sb,
        r'''
import socket, subprocess, sys, time
SERVER = """
import os, socket, threading
s = socket.socket(socket.AF_UNIX); s.bind("/tmp/echo.sock"); s.listen()
def serve():
    while True:
        c, _ = s.accept(); c.sendall(c.recv(100)); c.close()
threading.Thread(target=serve, daemon=True).start()
print("up", flush=True)
stop = threading.Event()
while not stop.is_set():
    stop.wait(1)
"""
p = subprocess.Popen([sys.executable, "-c", SERVER], stdout=subprocess.PIPE)
assert p.stdout.readline() == b"up\n"
took = []
for i in range(10):
    t = time.monotonic()
    c = socket.socket(socket.AF_UNIX); c.connect("/tmp/echo.sock"); c.sendall(b"%d" % i)
    assert c.recv(100) == b"%d" % i
    c.close()
    took.append(time.monotonic() - t)
p.kill(); p.wait()
print(max(took))
''',
        seed=SEED,
    )
    assert float(r.stdout) < 0.5, r.stdout


RACE = """
import threading, random, time
items, lock = [], threading.Lock()
cv = threading.Condition()
turn = [0]
def racer(k):
    for i in range(60):
        with lock:
            items.append((k, i))
        if i % 7 == 0:
            time.sleep(0.001)
def taker(k):
    for _ in range(5):
        with cv:
            cv.wait_for(lambda: turn[0] % 4 == k)
            items.append(("turn", k))
            turn[0] += 1
            cv.notify_all()
ts = [threading.Thread(target=racer, args=(k,)) for k in range(4)]
ts += [threading.Thread(target=taker, args=(k,)) for k in range(4)]
for t in ts:
    t.start()
for t in ts:
    t.join()
print(random.random())
print(hash(tuple(items)), len(items))
print(items[:12])
"""


def test_replay_reproduces_racing_threads(client):
    """30 replays with one seed (fresh sandboxes, fork-group children, a new client whose zygote
    is restored from the template on disk): one stdout. Another seed changes what the program
    draws from `random`, and nothing else."""
    outs: dict[str, set[str]] = {"fresh": set(), "fork-group": set(), "restored": set()}
    for _ in range(10):
        with Sandbox("python", client=client) as s:
            outs["fresh"].add(run(s, RACE, seed=SEED).stdout)
    with Sandbox("python", client=client) as parent:
        with parent.fork_group(10) as grp:
            for r in grp.map(lambda i, c: c.exec(code=RACE, seed=SEED, timeout_seconds=60)):
                assert r.exit_code == 0, r
                outs["fork-group"].add(r.stdout)
    fresh = EmbeddedClient()
    try:
        for _ in range(10):
            with Sandbox("python", client=fresh) as s:
                outs["restored"].add(run(s, RACE, seed=SEED).stdout)
    finally:
        fresh.close()
    every = set().union(*outs.values())
    assert len(every) == 1, outs
    (same,) = every
    with Sandbox("python", client=client) as s:
        other = run(s, RACE, seed="22" * 32).stdout
    assert other.splitlines()[0] != same.splitlines()[0]
    assert other.splitlines()[1:] == same.splitlines()[1:]
