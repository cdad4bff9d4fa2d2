"""Nothing of a systrap sandbox outlives its controller (docs/systrap.md, "Lifetimes"): a controller
process SIGKILLed in the middle of an exec whose command's child and grandchild compute without
syscalls (they never wait on their VMMs, so their stubs never notice on their own) leaves no VMM
and no stub behind. The reaper of each sandbox (`platform::systrap::reaper`) ends them. Needs
seccomp filters (systrap) and the python root filesystem; not /dev/kvm.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from collimate_core.sdk import platform as pf
from hostprocs import STUB_UID, alive, descendants, describe, state

# A liveness bound (a leaked stub spins for good), not a speed claim.
BOUND = 30.0

_CONTROLLER = r"""
import threading
import collimate_core
c = collimate_core.connect(platform="systrap")
s = c.session("python").__enter__()
assert s.exec(command="true").ok
busy = "sh -c 'sh -c \"while :; do :; done\" & while :; do :; done' & while :; do :; done"
threading.Thread(target=lambda: s.exec(command=busy, timeout_seconds=600), daemon=True).start()
print("ready", flush=True)
threading.Event().wait()
"""


def _uid(pid: int) -> int | None:
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("Uid:"):
                return int(line.split()[1])
    except OSError:
        return None
    return None


def _running_stubs(procs: set[int]) -> set[int]:
    return {p for p in procs if _uid(p) == STUB_UID and state(p) == "R"}


def _wait(pred, bound: float) -> bool:
    end = time.monotonic() + bound
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.1)
    return pred()


def test_a_killed_controller_leaves_no_vmm_and_no_stub_behind():
    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    env = {k: v for k, v in os.environ.items() if k not in ("COLLIMATE_API_KEY", "COLLIMATE_RAY_ADDRESS")}
    ctl = subprocess.Popen([sys.executable, "-c", _CONTROLLER], stdout=subprocess.PIPE, text=True, env=env)
    procs: set[int] = set()
    try:
        assert ctl.stdout.readline().strip() == "ready", "the controller did not start its sandbox"
        # The command's shell, its child and its grandchild all compute: three stubs always runnable.
        computing = _wait(lambda: len(_running_stubs(descendants(ctl.pid))) >= 3, BOUND)
        procs = descendants(ctl.pid)
        assert computing, f"the busy tree did not start: {[describe(p) for p in sorted(procs)]}"
        stubs = {p for p in procs if _uid(p) == STUB_UID}
        assert len(stubs) >= 3 and len(procs - stubs) >= 3, [describe(p) for p in sorted(procs)]
    finally:
        ctl.send_signal(signal.SIGKILL)
        ctl.wait()
        ctl.stdout.close()
    gone = _wait(lambda: not any(alive(p) for p in procs), BOUND)
    left = sorted(p for p in procs if alive(p))
    report = [describe(p) + f", uid {_uid(p)}" for p in left]
    for p in left:
        try:
            os.kill(p, signal.SIGKILL)  # not to load the rest of the run
        except ProcessLookupError:
            pass
    assert gone, f"VMMs or stubs outlived their SIGKILLed controller: {report}"
