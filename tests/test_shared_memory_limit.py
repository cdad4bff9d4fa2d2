"""A sandbox's shared memory is bounded and charged (issue 32, findings 1 and 11).

Shared anonymous mappings (`mmap.mmap(-1, n)`, Python's default: MAP_SHARED|MAP_ANONYMOUS), memfds
and /dev/shm are host memory the guest's own memory limit did not see: a 1 GiB sandbox touched
6 GiB of host memory through them. They now live in the sandbox's shared-memory pool, a tmpfs of its
own of 512 MiB (docs/quotas.md): past it an mmap gets ENOMEM, a write ENOSPC, a touch SIGBUS, and
the exec's result names the limit. /dev/shm is in that pool, not on the disk quota, so a full /tmp
leaves `multiprocessing.Lock()` working.

The host side is measured per process, independently of the rest of the machine: the shared
memory the sandbox's VMM process has resident (RssShmem of /proc/<pid>/status).
"""

from __future__ import annotations

import os

import pytest

from collimate_rl import EmbeddedClient, Sandbox

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

MiB = 1 << 20
LIMIT = 512 * MiB

# Maps shared anonymous memory 64 MiB at a time up to 1 GiB, touching every page; keeps the maps.
MAP_SHARED_ANON = """
import errno, mmap
maps, err = [], None
try:
    for _ in range(16):
        m = mmap.mmap(-1, 64 << 20)
        for off in range(0, 64 << 20, 4096):
            m[off] = 1
        maps.append(m)
except OSError as e:
    err = errno.errorcode.get(e.errno, str(e.errno))
print(len(maps), err)
"""

# Two shared mappings that each fit when made and together do not: touching them runs into the limit.
TOUCH_PAST = """
import mmap
a, b = mmap.mmap(-1, 300 << 20), mmap.mmap(-1, 300 << 20)
for m in (a, b):
    for off in range(0, 300 << 20, 4096):
        m[off] = 1
print("touched 600 MiB")
"""


def rss_shmem(pid: int) -> int:
    """The shared memory process `pid` has resident, in bytes."""
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("RssShmem:"):
                return int(line.split()[1]) * 1024
    raise AssertionError(f"no RssShmem for {pid}")


@pytest.fixture(scope="module")
def client():
    c = EmbeddedClient(disk_quota="16M")
    with Sandbox("python", client=c) as sb:
        if sb.disk_usage() is None:
            pytest.fail("this host gives no quotas (needs root for tmpfs instances)")
    yield c
    c.close()


def test_shared_anonymous_memory_stops_at_the_limit_with_enomem_and_the_host_holds_no_more(client):
    with Sandbox("python", client=client) as sb:
        pid = sb._box.vm.pid
        before = rss_shmem(pid)
        r = sb.exec(code=MAP_SHARED_ANON, timeout_seconds=300)
        n, err = r.stdout.split()
        # 64 MiB mappings: the pool holds 8 of them at most (less what /dev/shm already holds).
        assert err == "ENOMEM" and 6 <= int(n) <= 8, r.stdout + r.stderr
        assert r.limit == "shared_memory" and "shared-memory limit of the sandbox (512 MiB)" in r.note, r
        assert not r.timed_out
        # The mappings are still alive (the interpreter keeps them): the host holds them, and no more.
        held = rss_shmem(pid) - before
        # (Beyond the pool, the exec may touch a few shared pages of the VMM's own: the process
        # table /proc reads, one page a process.)
        assert int(n) * 64 * MiB - 4 * MiB <= held <= LIMIT + MiB, f"the VMM holds {held / MiB:.0f} MiB of shared memory"
        # Once they are gone the memory is the sandbox's again.
        r = sb.exec(code="maps.clear(); import gc; gc.collect(); m = __import__('mmap').mmap(-1, 256 << 20); m[-1] = 1; print('ok')")
        assert r.stdout.strip() == "ok" and r.limit == "", r


def test_touching_shared_mappings_past_the_limit_is_sigbus_named_as_the_memory_limit_not_a_timeout(client):
    with Sandbox("python", client=client) as sb:
        sb.upload_bytes("/work/touch.py", TOUCH_PAST.encode())
        r = sb.exec(command="python3 /work/touch.py", timeout_seconds=300)
        assert "touched 600 MiB" not in r.stdout, r
        assert r.exit_code == 128 + 7 and not r.timed_out, r  # SIGBUS, as Linux's tmpfs gives it
        assert r.limit == "shared_memory" and "shared-memory limit" in r.note, r
        # The process is gone and so is its memory: the sandbox goes on.
        r = sb.exec(code="print(1)")
        assert r.stdout == "1\n" and r.limit == ""


@pytest.mark.parametrize("flags", ["0", "os.MFD_ALLOW_SEALING"])
def test_memfds_are_shared_memory_too(client, flags):
    # MFD_ALLOW_SEALING too: a sealable memfd was a host memfd outside every limit.
    with Sandbox("python", client=client) as sb:
        r = sb.exec(code=f"""
import errno, os
fd, n, err = os.memfd_create("big", {flags}), 0, None
try:
    while n < 1024:
        os.write(fd, b"m" * (1 << 20)); n += 1
except OSError as e:
    err = errno.errorcode.get(e.errno, str(e.errno))
os.close(fd)
print(n, err)
""", timeout_seconds=300)
        n, err = r.stdout.split()
        assert err == "ENOSPC" and 400 <= int(n) <= 512, r.stdout + r.stderr
        # Seals are refused as for a memfd made without MFD_ALLOW_SEALING (EPERM), never granted
        # on memory outside the pool.
        r = sb.exec(code=f"""
import fcntl, os
fd = os.memfd_create("s", {flags})
try:
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_WRITE)
    print("sealed")
except PermissionError:
    print("EPERM")
""")
        assert r.stdout.strip() == "EPERM", r.stdout + r.stderr


def test_dev_shm_has_its_own_room_when_tmp_is_full(client):
    with Sandbox("python", client=client) as sb:
        r = sb.exec(code="""
import errno, multiprocessing
try:
    with open('/tmp/fill', 'wb') as f:
        while True:
            f.write(b'q' * (1 << 20)); f.flush()
except OSError as e:
    print(errno.errorcode[e.errno])
lock = multiprocessing.Lock()
with lock:
    pass
open('/dev/shm/seg', 'wb').write(b's' * (4 << 20))
print('lock ok')
""")
        assert r.stdout.splitlines() == ["ENOSPC", "lock ok"], r.stdout + r.stderr
        assert sb.disk_usage()["bytes"] >= 15 * MiB
        usage = sb._box.vm.shared_memory_usage()
        assert usage["quota_bytes"] == LIMIT and 4 * MiB <= usage["bytes"] < 5 * MiB, usage
