"""One sandbox attacks on every front at once while another does its work (issue 32).

A fork bomb, a thread bomb, a disk fill and a memory exhaustion run together in one sandbox, in
one exec. Meanwhile a second sandbox of the same client runs a normal exec (a computation, a
file written and read back, a child process), several times: each of its results must be exactly
right. The host keeps working throughout (it starts processes and a third sandbox works), the
hostile sandbox's own limits hold (its process cap, its disk quota), and afterwards it still
works, and once destroyed its processes are gone.

No timing is asserted: the second sandbox's exec has a generous timeout and must not need it.
It runs on both platforms (tests/platforms.py). On systrap, where threads are not served yet
(clone with CLONE_THREAD is ENOSYS), the thread bomb's first thread fails with a clear
RuntimeError: contained, and the other attacks run into their limits as on kvm.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest
from collimate_core import EmbeddedClient, Sandbox
from hostprocs import alive, descendants, guest_descendants


MiB = 1 << 20
QUOTA = 64 * MiB
MAX_PROCESSES = 256  # vmm::process::MAX_PROCESSES

THREAD_BOMB = """
import threading, time
n = 0
try:
    while True:
        threading.Thread(target=time.sleep, args=(3600,), daemon=True).start()
        n += 1
except Exception as e:
    print("threads", n, type(e).__name__, flush=True)
time.sleep(3600)
"""

MEMORY_HOG = """
import time
held = []
try:
    while True:
        held.append(bytearray(32 << 20))
except MemoryError:
    print("memory", len(held) * 32, "MiB", flush=True)
time.sleep(3600)
"""

# Everything at once, in the background, then wait for all of it (whichever comes first: every
# attack ending at its limit, or the exec's timeout).
STORM = (
    "cat > /tmp/threads.py <<'X'\n" + THREAD_BOMB + "X\n"
    "cat > /tmp/memory.py <<'X'\n" + MEMORY_HOG + "X\n"
    "python3 /tmp/threads.py &\n"
    "python3 /tmp/memory.py &\n"
    "(cat /dev/zero > /work/fill; echo fill-stopped $?) &\n"
    "bomb(){ bomb|bomb& }; bomb &\n"
    "wait\n"
)

# The neighbour's work: a computation, a file written and read back, a child process.
WORK = """
import hashlib, subprocess
data = b"".join(i.to_bytes(4, "little") for i in range(200000))
with open("/work/data", "wb") as f:
    f.write(data)
with open("/work/data", "rb") as f:
    back = f.read()
child = subprocess.run(["/bin/sh", "-c", "echo $((6 * 7))"], capture_output=True, text=True).stdout.strip()
print(hashlib.sha256(back).hexdigest(), back == data, sum(range(10**6)), child)
"""


def expected_work() -> str:
    import hashlib

    data = b"".join(i.to_bytes(4, "little") for i in range(200000))
    return f"{hashlib.sha256(data).hexdigest()} True {sum(range(10**6))} 42\n"


@pytest.fixture(scope="module")
def client(platform):
    os.environ.pop("COLLIMATE_API_KEY", None)
    c = EmbeddedClient(disk_quota=QUOTA, platform=platform)
    assert c.platform == platform
    yield c
    c.close()


def test_a_storm_in_one_sandbox_leaves_its_neighbour_and_the_host_working(client, platform):
    want = expected_work()
    with Sandbox("python", client=client) as hostile, Sandbox("python", client=client) as neighbour:
        assert neighbour.exec(code=WORK, timeout_seconds=300).stdout == want  # before the storm
        vmm = hostile._box.vm.pid
        storm: dict = {}
        # On systrap the storm's exec ends at its timeout: its sleeps are real time there, not the
        # virtual time kvm's replay clocks jump through once every process sleeps. And its fork
        # bomb stays small: a guest process whose parent ends dies with it there (the bomb's
        # shells end at once), so "on" is the exec's shell and one attack, not 20 processes.
        storm_timeout, storm_on = (90, 2) if platform == "systrap" else (300, 20)

        def run_storm():
            try:
                storm["result"] = hostile.exec(command=STORM, timeout_seconds=storm_timeout)
            except BaseException as e:  # noqa: BLE001 - reported by the assertion below
                storm["error"] = e

        t = threading.Thread(target=run_storm)
        t.start()
        try:
            # Wait until the storm is on: the hostile sandbox has many processes.
            deadline = time.monotonic() + 300
            most = 0
            while time.monotonic() < deadline and t.is_alive():
                most = max(most, len(descendants(vmm)))
                if most >= storm_on:
                    break
                time.sleep(0.2)
            assert most >= storm_on or not t.is_alive(), "the storm never started"
            results = []
            while t.is_alive() and len(results) < 5:
                results.append(neighbour.exec(code=WORK, timeout_seconds=300))
                most = max(most, len(descendants(vmm)))
                # The host keeps working: it starts processes.
                assert subprocess.run(["/bin/sh", "-c", "echo host"], capture_output=True, text=True,
                                      timeout=120).stdout == "host\n"
        finally:
            t.join(300)
        assert not t.is_alive(), "the storm's exec did not end"
        assert "error" not in storm, storm.get("error")
        assert results, "the storm ended before the neighbour ran"
        for r in results:
            assert r.ok and r.stdout == want and not r.timed_out, r
        # The storm's own limits held: its process cap and its disk quota.
        assert most <= MAX_PROCESSES + 8, most
        # Each attack ran into its limit: the disk quota (ENOSPC), the process's guest memory
        # (MemoryError below 1 GiB), the thread cap; the exec ended or timed out, as a result.
        r = storm["result"]
        lines = r.stdout.splitlines()
        assert "fill-stopped 1" in lines and "No space left on device" in r.stderr, r
        memory = [int(x.split()[1]) for x in lines if x.startswith("memory ")]
        assert memory and memory[0] <= 1024, r
        threads = [x.split() for x in lines if x.startswith("threads ")]
        assert threads, r
        if platform == "systrap" and threads[0][1] == "0":
            # Threads are not served on systrap yet: the first start fails, clearly (Python's
            # "can't start new thread"), and nothing else is affected. When they are, the cap
            # stops the bomb as on kvm (the branch below).
            assert threads[0][2] == "RuntimeError", r
        else:
            assert int(threads[0][1]) > 0, r
        usage = hostile.disk_usage()
        assert usage is None or usage["bytes"] <= QUOTA, usage
        # A third sandbox works, and so does the hostile one after it is restored.
        with Sandbox("python", client=client) as third:
            assert third.exec(code=WORK, timeout_seconds=300).stdout == want
        r = hostile.exec(command="rm -f /work/fill; echo alive", timeout_seconds=120)
        assert r.stdout == "alive\n", r
        assert neighbour.exec(code=WORK, timeout_seconds=300).stdout == want
        hostile.kill()
        deadline = time.monotonic() + 60
        # (A recycled systrap sandbox's VMM lives on, reset, with its reaper.)
        while alive(vmm) and guest_descendants(vmm) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not alive(vmm) or not guest_descendants(vmm), "the hostile sandbox's processes outlived it"
