"""Per-sandbox disk quota and the host budget (issue: a trainer's first step on a fresh host).

Each sandbox's /tmp and /work share one quota, a tmpfs of its own that the kernel enforces: the
guest gets ENOSPC past it, the host holds at most the quotas of the live sandboxes (tmpfs pages are
host memory; measured on the sandboxes' own tmpfs instances, not the machine's Shmem, which other
sandboxes on the machine move), and reset and destroy give the space back. /dev/shm is in the
sandbox's shared-memory pool (tests/test_shared_memory_limit.py).
"""

from __future__ import annotations

import os
import re
import time

import pytest

from collimate_rl import CapacityError, EmbeddedClient, InvalidArgument, Sandbox, rollout_once

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

MiB = 1 << 20

# Writes `mib` MiB to `path` in 1 MiB pieces; prints how many fit and the error that stopped it.
FILL = """
import errno, os
n, err = 0, None
try:
    with open({path!r}, "wb") as f:
        for _ in range({mib}):
            f.write(b"q" * (1 << 20)); f.flush(); n += 1
except OSError as e:
    err = errno.errorcode.get(e.errno, str(e.errno))
print(n, err)
"""


def _children() -> dict[int, list[int]]:
    kids: dict[int, list[int]] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue
            kids.setdefault(ppid, []).append(int(d))
    return kids


def our_processes() -> list[int]:
    """This test process and its descendants: the controller and every VMM process of its sandboxes
    (other users' sandboxes on the machine are not in it)."""
    kids, out, todo = _children(), [], [os.getpid()]
    while todo:
        p = todo.pop()
        out.append(p)
        todo.extend(kids.get(p, []))
    return out


def tmpfs_devices(vmm_pid: int) -> set[int]:
    """The tmpfs instances a sandbox keeps its files in (its disk quota and its shared-memory
    pool): the file systems of the directories its VMM process holds for its mounts (/m0, /m1, ...)."""
    devs = set()
    for fd in os.listdir(f"/proc/{vmm_pid}/fd"):
        path = f"/proc/{vmm_pid}/fd/{fd}"
        try:
            if re.fullmatch(r"/m\d+", os.readlink(path)):
                devs.add(os.stat(path).st_dev)
        except OSError:
            pass
    return devs


def held_on(devs: set[int]) -> dict[int, int]:
    """Bytes each of the tmpfs instances `devs` holds, for those still held open or mapped by a
    process of ours (a tmpfs nobody holds is gone, with every page it had: the kernel frees a detached
    mount with its last reference). Measured by the kernel's accounting of those instances alone, so
    the rest of the machine does not move it."""
    held: dict[int, int] = {}
    for pid in our_processes():
        paths = []
        try:
            paths += [f"/proc/{pid}/fd/{fd}" for fd in os.listdir(f"/proc/{pid}/fd")]
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    cols = line.split()
                    major, minor = (int(x, 16) for x in cols[3].split(":"))
                    if os.makedev(major, minor) in devs:
                        paths.append(f"/proc/{pid}/map_files/{cols[0]}")
        except OSError:
            continue  # gone meanwhile
        for path in paths:
            try:
                st = os.stat(path)
                if st.st_dev in devs and st.st_dev not in held:
                    v = os.statvfs(path)
                    held[st.st_dev] = (v.f_blocks - v.f_bfree) * v.f_frsize
            except OSError:
                pass
    return held


@pytest.fixture(scope="module")
def client():
    c = EmbeddedClient(disk_quota="64M")
    c.create("python")  # the template is baked and its zygote up before anything is measured
    yield c
    c.close()


def quota_supported(client) -> bool:
    with Sandbox("python", client=client) as sb:
        return sb.disk_usage() is not None


def test_past_the_quota_the_guest_gets_enospc_and_a_sibling_keeps_writing(client):
    if not quota_supported(client):
        pytest.fail("this host gives no disk quotas (needs root for tmpfs instances)")
    with Sandbox("python", client=client) as a, Sandbox("python", client=client) as b:
        r = a.exec(code=FILL.format(path="/tmp/big", mib=100))
        n, err = r.stdout.split()
        assert err == "ENOSPC" and 60 <= int(n) <= 64, r.stdout + r.stderr
        # Every writable mount shares the one quota: /work is full too. /dev/shm is shared memory,
        # on the sandbox's shared-memory limit instead (tests/test_shared_memory_limit.py).
        r = a.exec(code="open('/work/x', 'wb').write(b'y' * (1 << 20))")
        assert "No space left on device" in r.stderr
        r = a.exec(code=FILL.format(path="/dev/shm/seg", mib=1))
        assert r.stdout.split() == ["1", "None"], r.stdout + r.stderr
        # The sibling is unaffected: it writes up to its own quota.
        r = b.exec(code=FILL.format(path="/work/mine", mib=40))
        assert r.stdout.split() == ["40", "None"], r.stdout + r.stderr
        ua, ub = a.disk_usage(), b.disk_usage()
        assert ua["quota_bytes"] == ub["quota_bytes"] == 64 * MiB
        assert ua["bytes"] == 64 * MiB and 40 * MiB <= ub["bytes"] < 41 * MiB
        # Deleting frees the space inside the sandbox at once.
        r = a.exec(code="import os; os.remove('/tmp/big'); open('/tmp/again', 'wb').write(b'z' * (8 << 20)); print('ok')")
        assert r.stdout.strip() == "ok", r.stderr


def test_inodes_are_part_of_the_quota(client):
    with Sandbox("python", client=client, disk_quota="8M") as sb:
        assert sb.disk_usage()["quota_inodes"] == 4096
        r = sb.exec(code="""
import errno, os
os.mkdir('/tmp/d')
n = 0
try:
    while n < 10000:
        open(f'/tmp/d/{n}', 'w').close(); n += 1
except OSError as e:
    print(n, errno.errorcode[e.errno])
""")
        n, err = r.stdout.split()
        assert err == "ENOSPC" and 4000 < int(n) < 4096, r.stdout + r.stderr


def test_the_host_holds_at_most_the_quotas_and_destroy_and_reset_give_it_back(client):
    boxes = [Sandbox("python", client=client).start() for _ in range(3)]
    devs: set[int] = set()
    try:
        for sb in boxes:
            r = sb.exec(code=FILL.format(path="/tmp/fill", mib=200))
            assert r.stdout.split()[1] == "ENOSPC", r.stdout + r.stderr
            mine = tmpfs_devices(sb._box.vm.pid)
            assert len(mine) == 2, f"a disk tmpfs and a shared-memory pool, not {len(mine)} file systems"
            devs |= mine
            # What this sandbox makes the host hold in files: its full 64 MiB quota, nothing past it.
            held = held_on(mine)
            assert 63 * MiB <= sum(held.values()) <= 64 * MiB + MiB, {d: b / MiB for d, b in held.items()}
        boxes[0].reset()
        assert boxes[0].disk_usage()["bytes"] < MiB
        assert sum(held_on(tmpfs_devices(boxes[0]._box.vm.pid)).values()) < MiB
        r = boxes[0].exec(code="import os; print(os.path.exists('/tmp/fill'))")
        assert r.stdout.strip() == "False"
    finally:
        for sb in boxes:
            sb.kill()
    # The reaper thread resets or destroys them just after kill() returns: a recycled sandbox keeps
    # its tmpfs instances, emptied; a destroyed one's are gone. Either way they hold nothing.
    deadline = time.monotonic() + 10
    while sum(held_on(devs).values()) > MiB and time.monotonic() < deadline:
        time.sleep(0.1)
    left = held_on(devs)
    assert sum(left.values()) <= MiB, f"{sum(left.values()) / MiB:.0f} MiB still held after destroy"


def test_a_fork_starts_with_its_parents_usage_and_quota(client):
    with client.session("python", disk_quota="32M") as sess:
        sess.exec(code=FILL.format(path="/work/prefix", mib=10))
        parent = sess.disk_usage()
        assert parent["quota_bytes"] == 32 * MiB and parent["bytes"] >= 10 * MiB
        with sess.fork_group(2) as grp:
            for child in grp:
                u = child.disk_usage()
                assert u["quota_bytes"] == 32 * MiB and abs(u["bytes"] - parent["bytes"]) < MiB
            # Each child fills what is left of its own quota; the parent's files stay as they were.
            outs = grp.map(lambda i, child: child.exec(code=FILL.format(path="/tmp/more", mib=40)).stdout.split())
            assert all(err == "ENOSPC" and 20 <= int(n) <= 22 for n, err in outs), outs
        assert sess.disk_usage()["bytes"] == parent["bytes"]
        r = sess.exec(code="import os; print(os.path.getsize('/work/prefix'), os.path.exists('/tmp/more'))")
        assert r.stdout.split() == [str(10 * MiB), "False"]


def test_a_quota_per_sandbox_and_bad_quotas(client):
    r = rollout_once("python", code=FILL.format(path="/tmp/f", mib=20), disk_quota=8 * MiB, client=client)
    n, err = r.stdout.split()
    assert err == "ENOSPC" and int(n) <= 8
    for bad in (0, -5, "lots", 4096, True, 1.5):
        with pytest.raises(InvalidArgument):
            Sandbox("python", client=client, disk_quota=bad)
    with pytest.raises(InvalidArgument):
        EmbeddedClient(disk_quota="12 parsecs")


def test_posix_semaphores_and_shared_memory_in_dev_shm(client):
    r = rollout_once("python", client=client, code="""
import multiprocessing, os
from multiprocessing import shared_memory
lock = multiprocessing.Lock()
with lock:
    pass
sem = multiprocessing.Semaphore(2)
sem.acquire(); sem.acquire()
print(sem.acquire(timeout=0.01))
m = shared_memory.SharedMemory(create=True, size=1 << 16)
m.buf[:5] = b"hello"
m.close()  # (two live mappings of one file are not coherent yet: that is the threads issue's)
again = shared_memory.SharedMemory(name=m.name)
print(bytes(again.buf[:5]).decode(), len(os.listdir('/dev/shm')))
again.close(); again.unlink()
print(os.listdir('/dev/shm'))
""")
    assert r.ok, r.stderr
    assert r.stdout.split("\n")[:3] == ["False", "hello 1", "[]"]


def test_a_host_budget_queues_then_refuses_with_capacity_error():
    # Room for exactly two sandboxes of 1 GiB guest memory + 512 MiB shared memory + 16 MiB quota each.
    budget = 2 * ((1 << 30) + 512 * MiB + 16 * MiB)
    c = EmbeddedClient(disk_quota="16M", memory_budget=budget, capacity_timeout=0.5)
    try:
        a, b = Sandbox("python", client=c).start(), Sandbox("python", client=c).start()
        t = time.monotonic()
        with pytest.raises(CapacityError, match="memory_budget"):
            Sandbox("python", client=c).start()
        assert time.monotonic() - t >= 0.4  # it waited in the queue first
        with pytest.raises(CapacityError, match="can never fit"):
            a.fork_group(3)
        b.kill()
        with Sandbox("python", client=c) as again:  # b's charge came back
            assert again.exec(code="print(1)").stdout == "1\n"
        # A smaller quota fits in the same room.
        with Sandbox("python", client=c, disk_quota="1M"):
            pass
        a.kill()
    finally:
        c.close()


def test_an_upload_past_the_quota_fails_whole_and_loses_nothing(client):
    with Sandbox("python", client=client, disk_quota="8M") as sb:
        sb.upload_bytes("/work/keep", b"old contents")
        before = sb.disk_usage()["bytes"]
        with pytest.raises(InvalidArgument, match="disk_quota"):
            sb.upload_bytes("/work/keep", b"x" * (16 * MiB))
        # The file it would have replaced is as it was, and nothing half-written takes space.
        assert sb.download("/work/keep") == b"old contents"
        assert sb.disk_usage()["bytes"] == before
        r = sb.exec(code="import os; print(sorted(os.listdir('/work')))")
        assert r.stdout.strip() == "['keep']"
        sb.upload_bytes("/work/keep", b"y" * MiB)
        assert sb.download("/work/keep") == b"y" * MiB
