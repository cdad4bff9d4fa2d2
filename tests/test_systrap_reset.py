"""Reset on systrap (vmm/systrap/reset.rs, docs/systrap.md "Reset"): a sandbox that ends is reset
in place and recycled by its template (sdk/live.py), and a recycled sandbox shows nothing of its
last owner compared with a fresh clone of the template: files, environment, cwd, umask, signal
handlers, modules and globals, processes, threads, mappings, open fds, the guest memory itself;
the same seed gives the same output in both; and recycling leaks no host process, descriptor or
memory. `COLLIMATE_SYSTRAP_RECYCLE=0` turns recycling off (these tests then fail at "recycled").
Needs seccomp filters (systrap) and the python root filesystem; not /dev/kvm.
"""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest

from collimate_rl import Sandbox
from hostprocs import orphaned_stubs
from platforms import systrap_client

SEED = "5eed0001" * 8

# What the last owner of a sandbox does: every kind of state a user's code can leave behind.
DIRTY = r"""
import ctypes, json, mmap, os, signal, subprocess, sys, threading, time
open('/tmp/owner', 'w').write('secret')
open('/work/owner', 'w').write('secret')
open('/dev/shm/owner', 'w').write('secret')
os.environ['OWNER'] = 'secret'
os.chdir('/tmp')
os.umask(0o077)
signal.signal(signal.SIGUSR1, lambda *a: None)
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGUSR2])
import string
string.ascii_letters = 'owner'
os.path.owner = 'secret'  # a module the agent itself uses
sys.modules['owner_module'] = type(sys)('owner_module')
OWNER = 'secret'
owner_file = open('/tmp/owner')
owner_sock = __import__('socket').socketpair()
owner_map = mmap.mmap(-1, 1 << 20)
owner_map[:6] = b'secret'
owner_filemap = mmap.mmap(os.open('/work/owner', os.O_RDWR), 0)
owner_proc = subprocess.Popen(['sleep', '1000'])
owner_thread = threading.Thread(target=time.sleep, args=(1000,), daemon=True)
owner_thread.start()
# Memory the template has: a byte of an existing object changed in place.
buf = ctypes.create_string_buffer(b'x' * 64)
ctypes.memmove(ctypes.addressof(ctypes.c_char.from_address(id(sys.version) + 48)), b'OWNED', 5)
"""

# What a sandbox shows of its state (the same in any two sandboxes in the template's state).
FINGERPRINT = r"""
import json, os, signal, sys, threading
um = os.umask(0o022); os.umask(um)
def ls(d):
    try:
        return sorted(os.listdir(d))
    except OSError as e:
        return str(e)
print('files', ls('/tmp'), ls('/work'), ls('/dev/shm'))
print('env', sorted(os.environ.items()))
print('cwd', os.getcwd(), 'umask', oct(um))
print('handlers', [repr(signal.getsignal(s)) for s in range(1, 32) if s not in (9, 19)])
print('blocked', sorted(int(s) for s in signal.pthread_sigmask(signal.SIG_BLOCK, [])))
import string
print('module', string.ascii_letters, hasattr(os.path, 'owner'))
print('modules', sorted(sys.modules))
print('globals', sorted(k for k in globals() if not k.startswith('__')))
print('version', sys.version)
print('procs', ls('/proc/self/task'), [p for p in ls('/proc') if p.isdigit()])
print('threads', threading.active_count())
print('fds', ls('/proc/self/fd'))
print('maps', open('/proc/self/maps').read())
"""


@pytest.fixture(scope="module")
def client():
    return systrap_client()


def _recycled(t, pid: int, limit: float = 30.0) -> bool:
    """Until template `t` holds the sandbox whose VMM is `pid`, recycled (reset by the client's
    reaper thread after the sandbox ended)."""
    end = time.monotonic() + limit
    while not any(vm.pid == pid for vm in list(t.recycled)) and time.monotonic() < end:
        time.sleep(0.02)
    return any(vm.pid == pid for vm in list(t.recycled))


def _fresh(client, code: str, seed: str | None = None):
    """`code` run in a fresh clone of the template (never recycled); no recycled sandbox is left."""
    t = client._template("python")
    t.drain()
    with Sandbox("python", client=client) as sb:
        pid = sb._box.vm.pid
        assert pid not in _recycled_pids
        r = sb.exec(code=code, seed=seed)
        assert r.ok, r
    _recycled(t, pid)
    t.drain()
    return r.stdout, pid


_recycled_pids: set[int] = set()


def _children(pid: int) -> list[int]:
    return [int(p) for p in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]


def _readable_ranges(maps: str) -> list[tuple[int, int]]:
    out = []
    for line in maps.splitlines():
        f = line.split()
        if len(f) >= 2 and f[1][0] == "r":
            a, b = (int(x, 16) for x in f[0].split("-"))
            out.append((a, b))
    return out


def _memory(vm, ranges) -> list:
    """What the guest's memory holds over `ranges` (None where it cannot be read)."""
    out = []
    for a, b in ranges:
        try:
            out.append(vm.read_mem(a, b - a))
        except Exception as e:  # noqa: BLE001 - an unmapped range in one and not the other shows
            out.append(type(e).__name__)
    return out


def test_a_recycled_sandbox_shows_nothing_of_its_last_owner(client):
    t = client._template("python")
    assert t.resettable(), "recycling is off (COLLIMATE_SYSTRAP_RECYCLE=0) or the zygote was not restored"
    fresh, _ = _fresh(client, FINGERPRINT)
    with Sandbox("python", client=client) as sb:
        owner = sb._box.vm.pid
        r = sb.exec(code=DIRTY)
        assert r.ok, r
        dirty = sb.exec(code=FINGERPRINT)
        assert dirty.ok, dirty
    # The fingerprint sees each thing the owner did (so that the comparison below can fail).
    for what in ("files", "env", "cwd", "handlers", "blocked", "module", "modules", "globals", "version", "procs", "threads", "fds"):
        a = next(x for x in fresh.splitlines() if x.startswith(what + " "))
        b = next(x for x in dirty.stdout.splitlines() if x.startswith(what + " "))
        assert a != b, f"the fingerprint does not show the owner's {what}"
    assert fresh.split("maps ", 1)[1] != dirty.stdout.split("maps ", 1)[1]
    assert _recycled(t, owner), "the sandbox was not recycled"
    # The guest's memory, byte for byte, right after the reset against a fresh clone's (neither
    # has run since), over every readable mapping either shows.
    vm = t.take_recycled()
    assert vm.pid == owner and not t.recycled
    other = t.zygote.clone()
    try:
        ranges = _readable_ranges(fresh.split("maps ", 1)[1]) + _readable_ranges(dirty.stdout.split("maps ", 1)[1])
        mine, theirs = _memory(vm, ranges), _memory(other, ranges)
        differ = [(hex(a), hex(b)) for (a, b), x, y in zip(ranges, mine, theirs) if x != y]
        assert not differ, f"guest memory differs from a fresh clone's at {differ[:10]}"
    finally:
        other.destroy()
    assert t.offer(vm)
    _recycled_pids.add(owner)
    with Sandbox("python", client=client) as sb:
        assert sb._box.vm.pid == owner, "the next sandbox did not take the recycled one"
        again = sb.exec(code=FINGERPRINT)
        assert again.ok, again
        # The owner's background process and its stub are gone from the host.
        assert len(_children(owner)) == 1, _children(owner)  # the tree's reaper only
    for a, b in zip(fresh.splitlines(), again.stdout.splitlines()):
        assert a == b, f"a recycled sandbox differs from a fresh clone:\n fresh:    {a[:300]}\n recycled: {b[:300]}"
    assert fresh == again.stdout


def test_the_same_seed_gives_the_same_output_recycled_and_fresh(client):
    code = "import random, os, time, uuid\nprint(random.random(), os.urandom(8).hex(), uuid.uuid4(), time.time(), time.monotonic())"
    fresh, _ = _fresh(client, code, SEED)
    t = client._template("python")
    with Sandbox("python", client=client) as sb:
        owner = sb._box.vm.pid
        assert sb.exec(code="import random, os\nrandom.random(); os.urandom(64); x = 1").ok
    assert _recycled(t, owner)
    with Sandbox("python", client=client) as sb:
        assert sb._box.vm.pid == owner
        r = sb.exec(code=code, seed=SEED)
        assert r.ok and r.seed_ack == "verified", r
    assert r.stdout == fresh
    # Unseeded, a recycled sandbox's CRNG is fresh (not its last owner's stream again).
    with Sandbox("python", client=client) as sb:
        a = sb.exec(code="import os\nprint(os.urandom(16).hex())").stdout
    with Sandbox("python", client=client) as sb:
        b = sb.exec(code="import os\nprint(os.urandom(16).hex())").stdout
    assert a != b


def test_sandbox_reset_resets_in_place_and_keeps_the_vmm(client):
    with Sandbox("python", client=client) as sb:
        pid = sb._box.vm.pid
        sb.exec(code="z = 5\nopen('/work/z', 'w').write('z')")
        sb.reset()
        assert sb._box.vm.pid == pid  # reset, not a new clone
        r = sb.exec(code="import os\nprint('z' in globals(), os.path.exists('/work/z'))")
        assert r.stdout == "False False\n", r


def test_an_ended_agent_is_not_recycled_and_a_reset_gets_a_new_clone(client):
    t = client._template("python")
    t.drain()
    with Sandbox("python", client=client) as sb:
        pid = sb._box.vm.pid
        r = sb.exec(code="import os\nos._exit(3)")
        assert r.interpreter_died, r
        # Its first process is gone: the engine refuses the reset, and a new clone takes its place.
        with pytest.raises(Exception, match="first process has ended"):
            sb._box.vm.reset()
        sb.reset()
        assert sb._box.vm.pid != pid
        assert sb.exec(code="print(1)").stdout == "1\n"


def test_recycling_leaks_no_host_process_descriptor_or_memory(client):
    t = client._template("python")
    t.drain()
    stubs_before = orphaned_stubs()
    dirty = "import subprocess, threading, time, mmap\np = subprocess.Popen(['sleep', '1000'])\nm = mmap.mmap(-1, 8 << 20)\nm.write(b'x' * (8 << 20))\nthreading.Thread(target=time.sleep, args=(1000,), daemon=True).start()\nopen('/tmp/f', 'w').write('x' * 100000)"
    seen = []
    for i in range(12):
        with Sandbox("python", client=client) as sb:
            pid = sb._box.vm.pid
            assert sb.exec(code=dirty).ok
        assert _recycled(t, pid)
        fds = len(os.listdir(f"/proc/{pid}/fd"))
        rss = int(Path(f"/proc/{pid}/status").read_text().split("VmRSS:")[1].split()[0])
        seen.append((pid, fds, rss, len(_children(pid)), len(os.listdir("/proc/self/fd"))))
    pids = {s[0] for s in seen}
    assert len(pids) == 1, f"not one recycled sandbox: {seen}"
    # The VMM's descriptors and memory stay where the first round left them; its only child is
    # its tree's reaper (the owner's `sleep` and its stub went).
    assert max(s[1] for s in seen[1:]) <= seen[0][1], seen
    assert max(s[2] for s in seen[2:]) <= seen[1][2] + 4096, seen
    assert all(s[3] == 1 for s in seen), seen
    assert orphaned_stubs() - stubs_before == set()
    # This process's descriptors (the recycled sandbox's and the spares' channels) do not grow.
    assert max(s[4] for s in seen[2:]) <= seen[1][4], seen


def test_a_sandbox_spawned_not_restored_refuses_a_reset_with_what_to_do(tmp_path):
    # A live-booted agent's memory is anonymous: nothing to drop it back to.
    from collimate_core.templates import catalog

    systrap_client()  # skips where the host allows no seccomp filter
    work = catalog.agent_dirs(prefix="collimate-reset-test-")
    vm = catalog.spawn_agent(catalog.python_root(None), work, 1, platform="systrap")
    try:
        catalog.run_to_idle(vm, "a spawned agent")
        with pytest.raises(Exception, match="spawned, not restored from a snapshot.*start a new sandbox"):
            vm.reset()
        clone = vm.clone()
        try:
            with pytest.raises(Exception, match="spawned, not restored"):
                clone.reset()
        finally:
            clone.destroy()
    finally:
        vm.destroy()
        shutil.rmtree(work, ignore_errors=True)


def test_a_fork_group_child_is_recycled_to_the_template_not_its_parent(client):
    # A fork group's child descends from its parent sandbox, not from the template: recycled, it
    # is reset to the template (the snapshot its zygote was restored from), files and memory.
    t = client._template("python")
    t.drain()
    with Sandbox("python", client=client) as parent:
        assert parent.exec(code="PARENT = 1\nopen('/tmp/parent', 'w').write('p')").ok
        with parent.fork_group(2) as grp:
            pids = [c._box.vm.pid for c in grp]
            assert grp.map(lambda i, c: c.exec(code="CHILD = 1\nopen('/work/child', 'w').write('c')").ok) == [True, True]
    assert all(_recycled(t, p) for p in pids), [vm.pid for vm in t.recycled]
    with Sandbox("python", client=client) as sb:
        assert sb._box.vm.pid in pids
        r = sb.exec(code="import os\nprint('PARENT' in globals(), 'CHILD' in globals(), os.listdir('/tmp'), os.listdir('/work'))")
        assert r.stdout == "False False [] []\n", r


# The syscall sites patched into jumps to the stub's trampolines (platform/systrap/patch.rs), as
# the guest sees them in its own code: each `e9 rel32 0f 05` of an executable mapping whose jump
# lands in the trampolines (layout.rs: TRAMP, 64 KiB); then the site byte of getppid and
# sched_yield (0xb8: the `mov`, 0xe9: the jump).
PATCHED_SITES = r"""
import ctypes, re
STUB = 0x7fff_fe00_0000
TRAMP, END = STUB + 0x17000, STUB + 0x27000
sites = []
for line in open('/proc/self/maps').read().splitlines():
    f = line.split()
    if f[1] != 'r-xp':
        continue
    a, b = (int(x, 16) for x in f[0].split('-'))
    if a >= STUB:
        continue
    mem = ctypes.string_at(a, b - a)
    for m in re.finditer(rb'\xe9(....)\x0f\x05', mem, re.S):
        if TRAMP <= a + m.start() + 5 + int.from_bytes(m.group(1), 'little', signed=True) < END:
            sites.append(hex(a + m.start()))
libc = ctypes.CDLL(None)
def site(f):
    b = ctypes.string_at(ctypes.cast(f, ctypes.c_void_p).value, 32)
    return hex(b[b.find(b'\x0f\x05') - 5])
print(len(sites), site(libc.getppid), site(libc.sched_yield), ' '.join(sites))
"""

# An owner that patches two sites of its own (each called 3 times: patched at its second trap).
OWN_SITES = "import os\nfor _ in range(3):\n    os.sched_yield(); os.getppid()\nprint(os.getppid())"


@pytest.mark.skipif(os.environ.get("COLLIMATE_SYSTRAP_PATCH") == "0", reason="syscall-site patching is off")
def test_a_fresh_and_a_recycled_sandbox_run_the_templates_patched_sites(client):
    # The template's snapshot keeps the agent's hot sites patched (29 for the python
    # agent); a clone's first exec finds them patched before it calls them, and a recycled
    # sandbox finds the same ones, not its last owner's (whose own sites were its pages,
    # dropped), with the owner's slots free again and the template's intact (getppid answers
    # as getppid). Before snapshots kept them, a fresh clone's first exec saw 3 here (those
    # its own first traps had patched) and a recycled one the same.
    fresh, _ = _fresh(client, PATCHED_SITES)
    n, getppid, sched_yield, *sites = fresh.split()
    assert int(n) >= 10 and (getppid, sched_yield) == ("0xb8", "0xb8"), fresh
    t = client._template("python")
    with Sandbox("python", client=client) as sb:
        owner = sb._box.vm.pid
        ppid = sb.exec(code=OWN_SITES).stdout
        mine = sb.exec(code=PATCHED_SITES).stdout.split()
        assert mine[1:3] == ["0xe9", "0xe9"] and int(mine[0]) >= int(n) + 2, mine
    assert _recycled(t, owner)
    for _ in range(2):
        with Sandbox("python", client=client) as sb:
            assert sb._box.vm.pid == owner, "the next sandbox did not take the recycled one"
            again = sb.exec(code=PATCHED_SITES).stdout
            assert again == fresh, f"recycled: {again[:300]}\nfresh:    {fresh[:300]}"
            # The owner's sites patched again, into the slots after the template's.
            assert sb.exec(code=OWN_SITES).stdout == ppid
        assert _recycled(t, owner)
