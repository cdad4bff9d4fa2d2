"""`_core.Vm` on the systrap platform: a served systrap VMM process driven through the same
controller protocol as a KVM one (spawn, run, the agent channel, clones, destroy).

Needs the python rootfs (COLLIMATE_ROOTFS, set by scripts/test.sh); no /dev/kvm.
"""

from __future__ import annotations

import os
import time

import pytest

from collimate_core import EngineError, Vm

from collimate_core.templates.catalog import AGENT_DIR, AGENT_IDLE, frame, unframe
from hostprocs import alive, descendants


def reply(r) -> dict:
    return unframe(r.agent)


def exec_code(vm, code: str, timeout: float = 60):
    return vm.agent_call(frame({"op": "exec", "code": code}), timeout)


def wait_gone(pids: set[int], limit: float = 20.0) -> set[int]:
    """The pids of `pids` still alive after at most `limit` seconds (a forked stub whose VMM was
    killed ends at its next wait, within about a second)."""
    end = time.monotonic() + limit
    left = {p for p in pids if alive(p)}
    while left and time.monotonic() < end:
        time.sleep(0.05)
        left = {p for p in left if alive(p)}
    return left


@pytest.fixture
def agent(rootfs, tmp_path):
    (tmp_path / "work").mkdir()
    (tmp_path / "tmp").mkdir()
    vm = Vm.spawn(
        rootfs,
        ["/usr/bin/python3", "/opt/collimate/agent.py"],
        env={"PATH": "/usr/bin:/bin"},
        cwd="/work",
        mounts={"/work": tmp_path / "work", "/tmp": tmp_path / "tmp"},
        ro_mounts={"/opt/collimate": AGENT_DIR},
        agent=True,
        platform="systrap",
    )
    r = vm.run(120)
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    yield vm
    vm.destroy()


def test_platform_is_chosen_at_spawn_and_checked(rootfs):
    with pytest.raises(ValueError, match='"kvm".*"systrap"'):
        Vm.spawn(rootfs, ["/bin/true"], platform="gvisor")
    vm = Vm.spawn(rootfs, ["/bin/sh", "-c", "echo out; echo err >&2; exit 7"], platform="systrap")
    try:
        assert vm.platform == "systrap"
        r = vm.run(60)
        assert (r.kind, r.code, r.stdout, r.stderr) == ("exited", 7, b"out\n", b"err\n")
    finally:
        vm.destroy()


def test_a_signal_ends_the_run_as_signaled(rootfs):
    vm = Vm.spawn(rootfs, ["/bin/sh", "-c", "kill -TERM $$"], platform="systrap")
    try:
        r = vm.run(60)
        assert (r.kind, r.signal) == ("signaled", 15), r
    finally:
        vm.destroy()


def test_agent_execs_code_and_commands_with_guest_pids(agent):
    r = exec_code(agent, "x = 41\nimport os\nprint(sum(range(1000)), os.getpid())")
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    assert reply(r)["exit_code"] == 0
    assert r.stdout == b"499500 1\n"
    r = exec_code(agent, "print(x + 1)")
    assert r.stdout == b"42\n"
    # A shell command: a guest fork and exec; its pid is the sandbox's (2, 3, ...), not a host pid.
    r = agent.agent_call(frame({"op": "exec", "command": "echo hi from $$; exit 3"}), 60)
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    assert reply(r)["exit_code"] == 3
    pid = int(r.stdout.split()[-1])
    assert r.stdout.startswith(b"hi from ") and 2 <= pid < 100, r.stdout


def test_a_snapshot_of_the_agent_restores_with_its_state(agent, tmp_path):
    # docs/systrap.md, "Snapshots": the agent at its idle read, its interpreter's state kept.
    assert exec_code(agent, "x = 41").kind == "yield"
    agent.snapshot(tmp_path / "snap")
    assert reply(agent.agent_call(frame({"op": "ping"}), 30)) == {"pong": True}  # it goes on
    with Vm.restore(tmp_path / "snap") as vm:
        assert vm.platform == "systrap"
        assert exec_code(vm, "print(x + 1)").stdout == b"42\n"


def test_a_snapshot_of_more_than_one_thread_is_refused_clearly(agent, tmp_path):
    r = exec_code(agent, "import threading\nev = threading.Event()\nt = threading.Thread(target=ev.wait)\nt.start()")
    assert r.kind == "yield", r
    with pytest.raises(EngineError, match="more than one thread; a systrap snapshot holds one: join the threads"):
        agent.snapshot(tmp_path / "snap")
    assert exec_code(agent, "ev.set(); t.join(); print('joined')").stdout == b"joined\n"
    agent.snapshot(tmp_path / "snap")  # one thread again


def test_a_computing_run_that_times_out_stops_resumably(agent):
    # The run's deadline kicks the stub (docs/systrap.md, "Preemption"): code computing without
    # syscalls stops there as code that makes them does (before, a watchdog killed the stub and
    # the sandbox's process was gone), goes on when resumed, and end_exec interrupts it as on kvm.
    before = descendants(agent.pid)  # the sandbox's own tree (other threads of pytest may start processes)
    r = exec_code(agent, "z = 3\nwhile True:\n    pass", timeout=1.0)
    assert r.kind == "timeout", r
    r = agent.run(1.0)
    assert r.kind == "timeout", r  # resumed: still computing
    r = agent.end_exec(2, 60)  # SIGINT: KeyboardInterrupt in the exec's code
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    assert reply(r)["exit_code"] == 1 and b"KeyboardInterrupt" in r.stderr, r.stderr
    r = exec_code(agent, "print(z)")
    assert r.stdout == b"3\n"
    assert not {p for p in descendants(agent.pid) - before if alive(p)}


def test_a_timed_out_exec_that_waits_is_ended_and_the_agent_goes_on(agent):
    # A command waiting for its child, and code sleeping: both make syscalls, so the run stops
    # at its deadline (resumable), and end_exec ends the exec as on kvm.
    r = agent.agent_call(frame({"op": "exec", "command": "echo start; sleep 1000"}), 2.0)
    assert r.kind == "timeout", r
    r = agent.end_exec(0, 60)
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    assert reply(r)["exit_code"] == 137  # the shell, SIGKILLed, as a shell reports it
    r = exec_code(agent, "x = 5\nimport time\ntime.sleep(1000)", timeout=2.0)
    assert r.kind == "timeout", r
    r = agent.end_exec(2, 60)  # SIGINT: KeyboardInterrupt in the exec's code
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    assert reply(r)["exit_code"] == 1 and b"KeyboardInterrupt" in r.stderr, r.stderr
    r = exec_code(agent, "print(x)")
    assert r.stdout == b"5\n"


def test_clones_each_keep_their_own_state(agent):
    exec_code(agent, "state = ['parent']\nopen('/work/f', 'w').write('parent')")
    kids = [agent.clone(), agent.clone()]
    try:
        for i, k in enumerate(kids):
            assert k.platform == "systrap"
            r = exec_code(k, f"state.append({i})\nopen('/work/f', 'w').write('kid{i}')\nprint(state)")
            assert reply(r)["exit_code"] == 0, r.stderr
            assert r.stdout == f"['parent', {i}]\n".encode()
        for i, k in enumerate(kids):
            r = exec_code(k, "print(state, open('/work/f').read())")
            assert r.stdout == f"['parent', {i}] kid{i}\n".encode()
        r = exec_code(agent, "print(state, open('/work/f').read())")
        assert r.stdout == b"['parent'] parent\n"
        r = kids[0].agent_call(frame({"op": "exec", "command": "echo $$"}), 60)
        assert reply(r)["exit_code"] == 0 and 2 <= int(r.stdout) < 100, r.stdout
    finally:
        for k in kids:
            k.destroy()


def test_destroy_leaves_no_process(rootfs, tmp_path):
    before = descendants(os.getpid())
    (tmp_path / "tmp").mkdir()
    vm = Vm.spawn(
        rootfs,
        ["/usr/bin/python3", "/opt/collimate/agent.py"],
        env={"PATH": "/usr/bin:/bin"},
        mounts={"/tmp": tmp_path / "tmp"},
        ro_mounts={"/opt/collimate": AGENT_DIR},
        agent=True,
        platform="systrap",
    )
    r = vm.run(120)
    assert (r.kind, r.value) == ("yield", AGENT_IDLE), r
    kid = vm.clone()
    # A background guest process in the clone: a guest fork, its own VMM and stub.
    r = kid.agent_call(frame({"op": "exec", "command": "sleep 1000 & echo started"}), 60)
    assert r.stdout == b"started\n", r
    # The sandbox's processes only (other threads of pytest may start processes meanwhile).
    tree = {vm.pid, kid.pid} | descendants(vm.pid) | descendants(kid.pid)
    made = (descendants(os.getpid()) - before) & tree
    stubs = descendants(vm.pid) | descendants(kid.pid)
    assert vm.pid in made and kid.pid in made and stubs, (made, stubs)
    every = made | stubs
    kid.destroy()
    vm.destroy()
    assert not wait_gone(every), "processes left after destroy"


# rdtsc; shl rdx, 32; or rax, rdx; ret: the time-stamp counter read directly, as a JIT or a
# benchmark harness does (no syscall).
RDTSC_TWICE = """
import ctypes, mmap, time
m = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(bytes.fromhex("0f3148c1e2204809d0c3"))
rdtsc = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
t0 = time.monotonic_ns(); a = rdtsc(); b = rdtsc(); t1 = time.monotonic_ns()
print(a < b, t0 <= a < b <= t1)
"""


def test_rdtsc_traps_in_replay_execs_only(agent):
    # docs/replay.md, "The CPU and the time-stamp counter": a systrap stub traps rdtsc only while
    # an exec runs in replay mode (the stub's blob switches PR_SET_TSC at the reseed), where it
    # reads the virtual clock (a clock read: two reads differ by a quantum, inside the guest's own
    # monotonic readings around them); outside replay the host's counter runs natively (no trap,
    # so no CR4 rewrite at every switch into the stub). Before, served stubs trapped rdtsc (and
    # cpuid) for their whole life, answered outside replay with a virtual clock that stood still.
    native = exec_code(agent, RDTSC_TWICE)
    assert native.stdout == b"True False\n", native
    seed = bytes(range(32))
    r = agent.agent_call(frame({"op": "exec", "code": RDTSC_TWICE}), 60, seed=seed, replay=True)
    assert r.stdout == b"True True\n", r
    # A guest fork made in a replay exec inherits its parent's trap (the stub's fork).
    child = "import os, subprocess, sys\nsys.stdout.flush()\nsubprocess.run([sys.executable, '-c', %r])" % RDTSC_TWICE
    r = agent.agent_call(frame({"op": "exec", "code": child}), 60, seed=seed, replay=True)
    assert r.stdout == b"True True\n", r
    agent.reseed(seed, replay=False)
    r = exec_code(agent, RDTSC_TWICE)
    assert r.stdout == b"True False\n", r
