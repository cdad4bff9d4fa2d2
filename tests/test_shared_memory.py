"""Issue 15, shared memory between the processes of one sandbox, shown with real CPython through the
public SDK: MAP_SHARED mappings (a /dev/shm file, anonymous memory across fork) that every process
sees at once, without msync; multiprocessing's Value, Array, Lock, Semaphore, Pipe and
shared_memory between a parent and forked children (the 'fork' start method; Pool and Queue need
threads, which are not part of this); a lock that really excludes; replay of all that with one seed;
fork_group children that do not share their parent's shared memory; and a guest that maps too many
shared regions getting an error while the host and other sandboxes go on.

How it works: `guestos/mm.rs` (windows, and what snapshots, forks and resets do with them) and
`guestos/futex_shared.rs` (waits across processes, and replay).
"""

from __future__ import annotations

import os

import pytest

from collimate_rl import Sandbox, connect

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

SEED = "5eed" * 16


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


def run(client, code: str, seed: str | None = None, timeout: float = 120) -> str:
    with Sandbox("python", client=client) as sb:
        r = sb.exec(code=code, timeout_seconds=timeout, seed=seed)
    assert r.exit_code == 0, f"stdout:\n{r.stdout}\nstderr:\n{r.stderr}"
    return r.stdout


DEV_SHM_FILE = r"""
import mmap, os
fd = os.open("/dev/shm/board", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 3 * mmap.PAGESIZE)
m = mmap.mmap(fd, 3 * mmap.PAGESIZE)
to_child, to_parent = os.pipe(), os.pipe()
pid = os.fork()
if pid == 0:
    # The child maps the file again: a mapping of its own, of the same file.
    c = mmap.mmap(fd, 3 * mmap.PAGESIZE)
    os.read(to_child[0], 1)
    seen = bytes(c[0:6])
    c[mmap.PAGESIZE:mmap.PAGESIZE + 5] = b"child"
    os.write(to_parent[1], seen)
    os._exit(0)
m[0:6] = b"parent"
os.write(to_child[1], b"g")
print("child saw", os.read(to_parent[0], 6))
os.waitpid(pid, 0)
print("parent sees", bytes(m[mmap.PAGESIZE:mmap.PAGESIZE + 5]))
print("the file holds", os.pread(fd, 6, 0), os.pread(fd, 5, mmap.PAGESIZE))
"""


def test_two_processes_mapping_one_dev_shm_file_see_each_others_writes_without_msync(client):
    assert run(client, DEV_SHM_FILE) == "child saw b'parent'\nparent sees b'child'\nthe file holds b'parent' b'child'\n"


ANON_ACROSS_FORK = r"""
import mmap, os
m = mmap.mmap(-1, 1 << 20)
m[0:5] = b"first"
r, w = os.pipe()
pid = os.fork()
if pid == 0:
    m[(1 << 20) - 5:] = b"child"
    m[0:5] = b"FIRST"
    os.write(w, b"x")
    os._exit(0)
os.read(r, 1)
print(bytes(m[0:5]), bytes(m[(1 << 20) - 5:]))
os.waitpid(pid, 0)
# A private mapping is not shared, as on Linux.
p = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE)
pid = os.fork()
if pid == 0:
    p[0:1] = b"c"
    os._exit(0)
os.waitpid(pid, 0)
print("private", bytes(p[0:1]))
"""


def test_anonymous_shared_memory_is_shared_across_fork_and_private_stays_private(client):
    assert run(client, ANON_ACROSS_FORK) == "b'FIRST' b'child'\nprivate b'\\x00'\n"


MULTIPROCESSING = r"""
import multiprocessing as mp
from multiprocessing import shared_memory
mp.set_start_method("fork")

def child(value, array, sem, conn, shm_name):
    value.value = 41
    array[3] = 2.5
    shm = shared_memory.SharedMemory(name=shm_name)
    shm.buf[0:5] = b"hello"
    shm.close()
    conn.send(("done", value.value))
    sem.release()

if __name__ == "__main__":
    value = mp.Value("i", 0)
    array = mp.Array("d", 8)
    sem = mp.Semaphore(0)
    parent_end, child_end = mp.Pipe()
    shm = shared_memory.SharedMemory(create=True, size=4096)
    p = mp.Process(target=child, args=(value, array, sem, child_end, shm.name))
    p.start()
    print("acquired", sem.acquire(timeout=30))
    print("pipe", parent_end.recv())
    p.join()
    print("value", value.value + 1, "array", array[3], "shm", bytes(shm.buf[0:5]), "exitcode", p.exitcode)
    # A timed wait nobody ends times out (in virtual time: at once, and alike in every replay).
    print("timed out", sem.acquire(timeout=0.5) is False)
    shm.close()
    shm.unlink()
"""


def test_multiprocessing_value_array_semaphore_pipe_and_shared_memory(client):
    assert run(client, MULTIPROCESSING) == (
        "acquired True\npipe ('done', 41)\nvalue 42 array 2.5 shm b'hello' exitcode 0\ntimed out True\n"
    )


COUNTER = r"""
import multiprocessing as mp, os
mp.set_start_method("fork")
N = 400

def work(counter, lock):
    for _ in range(N):
        with lock:
            v = counter.value
            os.sched_yield()  # a chance for the other process to run inside the critical section
            counter.value = v + 1

if __name__ == "__main__":
    counter = mp.RawValue("i", 0)
    lock = mp.Lock()
    ps = [mp.Process(target=work, args=(counter, lock)) for _ in range(2)]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    print(counter.value, [p.exitcode for p in ps])
"""


def test_a_multiprocessing_lock_really_excludes_across_processes(client):
    assert run(client, COUNTER) == "800 [0, 0]\n"


PING_PONG = r"""
import multiprocessing as mp, os, random
mp.set_start_method("fork")

def player(name, mine, theirs, log, rounds):
    for i in range(rounds):
        mine.acquire()
        log.append("%s%d:%d" % (name, i, random.randrange(1000)))
        theirs.release()

if __name__ == "__main__":
    a, b = mp.Semaphore(1), mp.Semaphore(0)
    board = mp.Array("c", 4096)
    class Log:
        def append(self, s):
            with board.get_lock():
                cur = board.value
                board.value = cur + s.encode() + b" "
    ps = [mp.Process(target=player, args=("a", a, b, Log(), 5)), mp.Process(target=player, args=("b", b, a, Log(), 5))]
    for p in ps:
        p.start()
    for p in ps:
        p.join()
    print(board.value.decode().strip())
    print("pids", [p.pid for p in ps], "rand", random.random())
"""


def test_replay_the_same_seed_gives_the_same_output_10_times(client):
    outs = {run(client, PING_PONG, seed=SEED) for _ in range(10)}
    assert len(outs) == 1, outs
    out = outs.pop()
    turns = out.splitlines()[0].split()
    # Strict alternation a0 b0 a1 b1 ..., each with the child's own random draw.
    assert [t.split(":")[0] for t in turns] == [f"{x}{i}" for i in range(5) for x in "ab"], out
    other = run(client, PING_PONG, seed="00" * 32)
    assert other.splitlines()[0] != out.splitlines()[0], "the draws follow the seed"


HOLD = r"""
import mmap, os
anon = mmap.mmap(-1, 4096)
anon[0:6] = b"parent"
fd = os.open("/dev/shm/held", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
filemap = mmap.mmap(fd, 4096)
filemap[0:6] = b"parent"
print("held")
"""

WRITE_MINE = "anon[0:6] = b'child%d'; filemap[0:6] = b'child%d'; print(bytes(anon[0:6]), bytes(filemap[0:6]))"
READ = "print(bytes(anon[0:6]), bytes(filemap[0:6]), os.pread(fd, 6, 0))"


def test_fork_group_children_of_a_sandbox_holding_shared_mappings_are_isolated(client):
    with client.session("python") as sess:
        assert sess.exec(code=HOLD).stdout == "held\n"
        with sess.fork_group(2) as grp:
            first, second = grp[0], grp[1]
            assert first.exec(code=WRITE_MINE % (0, 0)).stdout == "b'child0' b'child0'\n"
            # The sibling and the parent still see what the parent wrote: each sandbox has its
            # own copy of shared anonymous memory and of its files.
            assert second.exec(code=READ).stdout == "b'parent' b'parent' b'parent'\n"
            assert second.exec(code=WRITE_MINE % (1, 1)).stdout == "b'child1' b'child1'\n"
            assert first.exec(code=READ).stdout == "b'child0' b'child0' b'child0'\n"
        assert sess.exec(code=READ).stdout == "b'parent' b'parent' b'parent'\n"


MANY = r"""
import errno, mmap
maps, err = [], None
for i in range(5000):
    try:
        maps.append(mmap.mmap(-1, 4096))
    except OSError as e:
        err = e.errno
        break
print("mapped", len(maps), "then", errno.errorcode.get(err))
maps[-1][0:2] = b"ok"
print(bytes(maps[-1][0:2]))
del maps
m = mmap.mmap(-1, 4096)
print("after unmapping, again", len(m))
"""


def test_a_guest_mapping_thousands_of_shared_regions_gets_an_error_and_everything_goes_on(client):
    with Sandbox("python", client=client) as sb:
        r = sb.exec(code=MANY, timeout_seconds=120)
        assert r.exit_code == 0, r.stderr
        lines = r.stdout.splitlines()
        n = int(lines[0].split()[1])
        assert 100 <= n < 5000 and lines[0].endswith("then ENOMEM"), r.stdout
        assert lines[1:] == ["b'ok'", "after unmapping, again 4096"]
        # The same sandbox, and another one, keep working.
        assert sb.exec(code="print(6 * 7)").stdout == "42\n"
    assert run(client, ANON_ACROSS_FORK).startswith("b'FIRST'")


EDGES = r"""
import ctypes, mmap, os, signal, subprocess
P = mmap.PAGESIZE
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
m = mmap.mmap(-1, 3 * P)
m[0:1] = b"a"; m[P:P + 1] = b"b"; m[2 * P:2 * P + 1] = b"c"
# execve drops the shared mappings: the new program's maps hold none.
maps = subprocess.run(["/bin/cat", "/proc/self/maps"], capture_output=True, text=True).stdout
print("after exec", sum(" rw-s " in l for l in maps.splitlines()))
# A shared view of a file opened read-only cannot be made writable (EACCES, as on Linux).
fd = os.open("/dev/shm/ro", os.O_RDWR | os.O_CREAT, 0o600); os.write(fd, b"x" * P); os.close(fd)
fd = os.open("/dev/shm/ro", os.O_RDONLY)
ro = mmap.mmap(fd, P, prot=mmap.PROT_READ)
ro_at = next(int(l.split("-")[0], 16) for l in open("/proc/self/maps") if l.rstrip().endswith("/dev/shm/ro"))
rc = libc.mprotect(ro_at, P, mmap.PROT_READ | mmap.PROT_WRITE)
print("read-only", bytes(ro[0:1]), rc, ctypes.get_errno() == 13)
base = ctypes.addressof((ctypes.c_char * P).from_buffer(m))
# munmap the middle page: the others stay shared with a child.
print("munmap middle", libc.munmap(base + P, P))
pid = os.fork()
if pid == 0:
    ctypes.memmove(base + 2 * P, b"C", 1)
    ctypes.memmove(base, b"A", 1)
    os._exit(0)
os.waitpid(pid, 0)
print("ends", ctypes.string_at(base, 1), ctypes.string_at(base + 2 * P, 1))
# mprotect a shared page read-only: a write kills the writer with SIGSEGV, the page keeps its data.
print("mprotect", libc.mprotect(base, P, mmap.PROT_READ))
pid = os.fork()
if pid == 0:
    ctypes.memmove(base, b"Z", 1)
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("writer", os.WIFSIGNALED(status) and os.WTERMSIG(status) == signal.SIGSEGV, ctypes.string_at(base, 1))
os._exit(0)  # m's buffer is exported to ctypes: skip its teardown
"""


def test_exec_munmap_of_part_and_mprotect_of_shared_mappings(client):
    out = run(client, EDGES)
    assert out == "after exec 0\nread-only b'x' -1 True\nmunmap middle 0\nends b'A' b'C'\nmprotect 0\nwriter True b'A'\n", out


def test_a_reset_drops_the_shared_mappings_and_the_sandbox_goes_on(client):
    with Sandbox("python", client=client) as sb:
        assert sb.exec(code=HOLD).stdout == "held\n"
        maps = "print(sum(' rw-s ' in l for l in open('/proc/self/maps')))"
        assert sb.exec(code=maps).stdout == "2\n"
        sb.reset()
        assert sb.exec(code=maps).stdout == "0\n"
        assert run(client, ANON_ACROSS_FORK).startswith("b'FIRST'")
        assert sb.exec(code=ANON_ACROSS_FORK).stdout.startswith("b'FIRST'")


POOL_AND_QUEUE = """
import multiprocessing as mp
ctx = mp.get_context("fork")
with ctx.Pool(2) as p:  # worker processes, and the pool's handler threads in this one
    print(p.map(abs, range(-5, 5)))
q = ctx.Queue()  # a feeder thread, a pipe and a lock in shared memory
pr = ctx.Process(target=q.put, args=("hello",))
pr.start()
print(q.get(timeout=30))
pr.join()
v, lock = ctx.Value("i", 0), ctx.Lock()
def inc():
    for _ in range(200):
        with lock:
            v.value += 1
ps = [ctx.Process(target=inc) for _ in range(2)]
for p in ps:
    p.start()
for p in ps:
    p.join()
print(v.value, [p.exitcode for p in ps])
"""


def test_multiprocessing_pool_queue_lock_and_value_with_threads_and_shared_memory(client):
    """What needs both halves of issue 15: Pool(2).map (worker processes fed by the pool's threads
    over pipes with shared locks), a Queue (its feeder thread), a Lock and a Value across
    processes; with a seed twice, the same output."""
    want = "[5, 4, 3, 2, 1, 0, 1, 2, 3, 4]\nhello\n400 [0, 0]\n"
    assert run(client, POOL_AND_QUEUE) == want
    assert run(client, POOL_AND_QUEUE, seed=SEED) == run(client, POOL_AND_QUEUE, seed=SEED) == want


SHARED_MEMORY_MANAGER = """
import os, socket
from multiprocessing.managers import SharedMemoryManager
# A Unix socket's name reads back as it was bound (the manager hands its listener's
# getsockname() to its clients), relative or absolute.
os.chdir("/tmp")
for name in ("/tmp/named.sock", "rel.sock"):
    s = socket.socket(socket.AF_UNIX); s.bind(name); s.listen()
    c = socket.socket(socket.AF_UNIX); c.connect(name)
    a, _ = s.accept()
    print(s.getsockname(), a.getsockname(), c.getpeername())
    for x in (a, c, s):
        x.close()
    os.unlink(name)
with SharedMemoryManager() as smm:  # a server process that accepts and serves from threads
    sl = smm.ShareableList(range(5))
    sl[0] = 42
    sm = smm.SharedMemory(size=64)
    sm.buf[:3] = b"abc"
    print(list(sl), bytes(sm.buf[:3]), sm.size >= 64)
"""


def test_shared_memory_manager_serves_from_its_threads(client):
    """SharedMemoryManager's server process accepts on a Unix socket in one thread while its main
    thread waits (a blocking accept must let the other threads run), and the address it hands
    its clients is its listener's getsockname() (the name as bound, not the host's last
    component); with a seed twice, the same output."""
    want = (
        "/tmp/named.sock /tmp/named.sock /tmp/named.sock\n"
        "rel.sock rel.sock rel.sock\n"
        "[42, 1, 2, 3, 4] b'abc' True\n"
    )
    assert run(client, SHARED_MEMORY_MANAGER) == want
    assert run(client, SHARED_MEMORY_MANAGER, seed=SEED) == run(client, SHARED_MEMORY_MANAGER, seed=SEED) == want


DEFINED_IN_THE_EXEC = """
import multiprocessing as mp, pickle
def square(x):
    return x * x
class Point:
    def __init__(self, x):
        self.x = x
print(pickle.loads(pickle.dumps(Point(3))).x, pickle.loads(pickle.dumps(square))(4))
with mp.get_context("fork").Pool(2) as p:
    print(p.map(square, range(5)), p.apply(Point, (7,)).x)
"""


def test_what_an_exec_defines_pickles_by_reference_as_a_scripts_main_does(client):
    """Code of an exec(code=...) runs as `__main__`, so a function or class it defines pickles by
    reference: Pool.map of it, an instance sent back from a worker. Across two execs of one
    sandbox, the second sees what the first defined."""
    assert run(client, DEFINED_IN_THE_EXEC) == "3 16\n[0, 1, 4, 9, 16] 7\n"
    with Sandbox("python", client=client) as sb:
        sb.exec(code="def cube(x):\n    return x ** 3\n")
        r = sb.exec(code="import multiprocessing as mp\nwith mp.get_context('fork').Pool(2) as p:\n    print(p.map(cube, range(4)))\n")
        assert r.exit_code == 0 and r.stdout == "[0, 1, 8, 27]\n", (r.stdout, r.stderr)
