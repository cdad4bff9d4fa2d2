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

from collimate_rl import EmbeddedClient, InvalidArgument, Sandbox

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
        n, err, r = fill(sb, flags)
        assert err == "ENOSPC" and 400 <= n <= 512, r.stdout + r.stderr
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


# --- a shared-memory limit of the sandbox's own (shared_memory=) -------------------------------

# Writes a memfd (made with the flags {flags}) 1 MiB at a time up to 1 GiB: how many MiB fit, and
# the error that stopped it.
FILL_MEMFD = """
import errno, os
fd, n, err = os.memfd_create("fill", {flags}), 0, None
try:
    while n < 1024:
        os.write(fd, b"m" * (1 << 20)); n += 1
except OSError as e:
    err = errno.errorcode.get(e.errno, str(e.errno))
os.close(fd)
print(n, err)
"""


def fill(sb, flags: str = "0") -> tuple[int, str, object]:
    r = sb.exec(code=FILL_MEMFD.format(flags=flags), timeout_seconds=300)
    n, err = r.stdout.split()
    return int(n), err, r


def map_past(sb, mib: int):
    """A shared anonymous mapping of `mib` MiB, longer than the pool: ENOMEM, named in the result."""
    r = sb.exec(code=f"import mmap\ntry:\n    mmap.mmap(-1, {mib} << 20)\nexcept OSError as e:\n    print(e.errno)")
    assert r.stdout.strip() == "12" and r.limit == "shared_memory", r
    return r


def test_a_sandbox_of_64_mib_of_shared_memory_stops_at_64_mib_and_its_forks_too(client):
    with Sandbox("python", client=client, shared_memory="64M") as sb:
        pool = sb._box.vm.shared_memory_usage()
        assert pool["quota_bytes"] == 64 * MiB, pool
        n, err, r = fill(sb)
        # 64 MiB less what /dev/shm and the interpreter's own shared mappings already hold.
        assert err == "ENOSPC" and 64 - (pool["bytes"] >> 20) - 2 <= n <= 64, r
        # The refused write is named too.
        assert r.limit == "shared_memory" and "shared-memory limit of the sandbox (64 MiB)" in r.note, r
        # As is one into a /dev/shm file.
        r = sb.exec(command="head -c 100000000 /dev/zero > /dev/shm/fill; echo rc=$?; rm -f /dev/shm/fill")
        assert r.stdout == "rc=1\n" and r.limit == "shared_memory", r
        # The disk quota's ENOSPC is not (the pool has room).
        r = sb.exec(command="head -c 100000000 /dev/zero > /tmp/fill; echo rc=$?; rm -f /tmp/fill")
        assert r.stdout == "rc=1\n" and r.limit == "", r
        # A mapping longer than what is left: ENOMEM, and the result names the limit and its size.
        r = map_past(sb, 96)
        assert "shared-memory limit of the sandbox (64 MiB)" in r.note, r
        assert "shared_memory=" in r.note, r.note  # says what to do
        # Its forks have the same limit.
        with sb.fork_group(2) as g:
            for child in g:
                assert child._box.vm.shared_memory_usage()["quota_bytes"] == 64 * MiB
                n, err, r = fill(child)
                assert err == "ENOSPC" and n <= 64, r
                assert "(64 MiB)" in map_past(child, 96).note
    # The next sandbox of the template has the default again (a recycled clone is resized back).
    with Sandbox("python", client=client) as sb:
        assert sb._box.vm.shared_memory_usage()["quota_bytes"] == LIMIT


def test_a_client_wide_shared_memory_limit_and_a_larger_one_per_sandbox():
    c = EmbeddedClient(disk_quota="16M", shared_memory="32M")
    try:
        with Sandbox("python", client=c) as sb:
            assert sb._box.vm.shared_memory_usage()["quota_bytes"] == 32 * MiB
            n, err, r = fill(sb)
            assert err == "ENOSPC" and n <= 32, r
            assert "(32 MiB)" in map_past(sb, 48).note
        with Sandbox("python", client=c, shared_memory="600M") as sb:
            n, err, r = fill(sb)
            assert err == "ENOSPC" and 560 <= n <= 600, r
            assert "(600 MiB)" in map_past(sb, 640).note
            # A limit below what the pool holds is refused, saying what to do.
            r = sb.exec(code="import os\nfd = os.memfd_create('keep')\nos.write(fd, b'k' * (8 << 20))")
            with pytest.raises(Exception, match=r"below what the sandbox's shared memory holds.*free some first"):
                sb._box.vm.set_shared_memory(4 * MiB)
    finally:
        c.close()


def test_the_budget_charges_the_shared_memory_asked_for():
    # Room for exactly one sandbox of 1 GiB guest memory + 256 MiB shared memory + 16 MiB quota
    # and not two; with 64 MiB of shared memory, two fit.
    from collimate_rl import CapacityError

    c = EmbeddedClient(disk_quota="16M", memory_budget=2 * (1024 + 160 + 16) * MiB, capacity_timeout=0.5)
    try:
        with Sandbox("python", client=c, shared_memory="256M"):
            with pytest.raises(CapacityError, match="shared_memory"):
                with Sandbox("python", client=c, shared_memory="256M"):
                    pass
        with Sandbox("python", client=c, shared_memory="64M"), Sandbox("python", client=c, shared_memory="64M"):
            pass
    finally:
        c.close()


@pytest.mark.parametrize("value, says", [
    ("lots", r"shared_memory: 'lots' is not a size; write bytes or e.g. '512M', '2G'"),
    (0, r"a sandbox needs some shared memory .*give at least '1M'"),
    ("0M", r"a sandbox needs some shared memory .*give at least '1M'"),
    ("512K", r"below the smallest, 1 MiB; give at least '1M'"),
    (True, r"shared_memory takes a number of bytes"),
])
def test_a_bad_shared_memory_is_refused_saying_what_to_give(client, value, says):
    with pytest.raises(InvalidArgument, match=says):
        Sandbox("python", client=client, shared_memory=value)
    with pytest.raises(InvalidArgument, match=says):
        client.create("python", shared_memory=value)
    with pytest.raises(InvalidArgument, match=says):
        EmbeddedClient(shared_memory=value)


def test_shared_memory_above_the_memory_budget_is_refused(monkeypatch):
    with pytest.raises(InvalidArgument, match=r"above memory_budget=2048 MiB.*give at most '1024M' or raise the budget"):
        EmbeddedClient(memory_budget="2G", shared_memory="1536M")
    c = EmbeddedClient(memory_budget="2G", disk_quota="16M")
    try:
        with pytest.raises(InvalidArgument, match=r"above memory_budget=2048 MiB"):
            c.create("python", shared_memory="3G")
    finally:
        c.close()
    monkeypatch.setenv("COLLIMATE_SHARED_MEMORY", "nope")
    with pytest.raises(InvalidArgument, match=r"COLLIMATE_SHARED_MEMORY: shared_memory: 'nope' is not a size"):
        EmbeddedClient()
    monkeypatch.setenv("COLLIMATE_SHARED_MEMORY", "48M")
    c = EmbeddedClient(disk_quota="16M")
    try:
        assert c.shared_memory == 48 * MiB
    finally:
        c.close()


def test_shared_memory_over_http(tmp_path_factory):
    import httpx
    from test_http import Server, _cli

    from collimate_rl import RemoteClient

    store = tmp_path_factory.mktemp("keys") / "keys.json"
    key = _cli("keys", "--key-store", str(store), "create", "--tenant", "t").strip()
    srv = Server(tmp_path_factory.mktemp("srv"), store, "--shared-memory", "128M", "--disk-quota", "16M")
    try:
        with RemoteClient(key, srv.url) as c:
            with Sandbox("python", client=c, shared_memory="64M") as sb:
                n, err, r = fill(sb)
                assert err == "ENOSPC" and n <= 64, r
                assert "shared-memory limit of the sandbox (64 MiB)" in map_past(sb, 96).note
            with Sandbox("python", client=c) as sb:  # the server's --shared-memory
                n, err, r = fill(sb)
                assert err == "ENOSPC" and 120 <= n <= 128, r
                assert "(128 MiB)" in map_past(sb, 192).note
            with pytest.raises(InvalidArgument, match=r"above this server's 134217728 \(--shared-memory\); ask for less"):
                c.create("python", shared_memory="256M")
        for bad, says in ((0, "give at least '1M'"), (4096, "give at least '1M'"), ("64M", "valid integer")):
            resp = httpx.post(f"{srv.url}/v1/sandboxes", json={"template": "python", "shared_memory": bad},
                              headers={"Authorization": f"Bearer {key}"})
            assert resp.status_code == 400 and says in resp.json()["error"]["message"], resp.text
    finally:
        srv.stop()


def test_a_templates_shared_memory_limit_is_its_sandboxes_default(client):
    # What Template.bake(shared_memory=) records: the template's sandboxes get it unless they ask.
    import dataclasses

    from collimate_core import Template
    from collimate_core.templates.catalog import bake_catalog

    baked = bake_catalog("python", client.cache)
    client.register_template("python-shm48", dataclasses.replace(baked, shared_memory=48 * MiB))
    try:
        with Sandbox("python-shm48", client=client) as sb:
            assert sb._box.vm.shared_memory_usage()["quota_bytes"] == 48 * MiB
            assert "(48 MiB)" in map_past(sb, 64).note
        with Sandbox("python-shm48", client=client, shared_memory="96M") as sb:
            assert sb._box.vm.shared_memory_usage()["quota_bytes"] == 96 * MiB
    finally:
        client.unregister_template("python-shm48")
    with pytest.raises(InvalidArgument, match="give at least '1M'"):
        Template.bake(client, "never-baked", "no-such-image", shared_memory=0)
