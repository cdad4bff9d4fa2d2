"""Soak (issue 14): many sandbox lifetimes in one process, and nothing may grow.

    python3 -m pytest benches/bench_soak.py -q -s

10,000 create/exec/destroy cycles (`with Sandbox("python") as sb: sb.exec(code="print(1)")`) and
then 1,000 fork-group cycles (a session, `fork_group(8)`, a trivial exec in every child) on one
EmbeddedClient. COLLIMATE_SOAK_CYCLES and COLLIMATE_SOAK_GROUPS change the counts (a quick run:
COLLIMATE_SOAK_CYCLES=500 COLLIMATE_SOAK_GROUPS=50).

Printed, at the start (after a warm-up that fills the client's pools: spare clones, recycled
sandboxes), after each phase and at the end: this process's open descriptors, its VMM processes
(`_vmm_main` processes running this checkout's extension, guest processes included, and the
host's totals next to them), the bytes under the engine's runtime directory (a private one under
/dev/shm for this run, unless COLLIMATE_RUNTIME_DIR names one) and the host's /dev/shm in use,
and this process's RSS; and the p50 of the first and of the last thousand cycles of each phase.

Asserted: only that nothing grew. Descriptors, VMM processes and runtime bytes end within a small
tolerance of the start (the pools are full at both points, the reaper drained), RSS within
RSS_MARGIN; and while the cycles run (sampled every 100 cycles, every 10 groups), the VMM
processes stay within the pools, the reaper's bounded queue and one group: measured only after a
drain, a queue of destroyed sandboxes that grows for as long as the load lasts would not show.
Growth is a leak, a correctness failure; the timings are printed, never asserted.
"""

from __future__ import annotations

import os
import statistics
import tempfile
import time
from pathlib import Path

import pytest

import collimate_core._core as _core
from collimate_core import EmbeddedClient, Sandbox
from collimate_core.sdk.embedded import REAP_BACKLOG, RECYCLE_MAX

pytestmark = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")

CYCLES = int(os.environ.get("COLLIMATE_SOAK_CYCLES", "10000"))
GROUPS = int(os.environ.get("COLLIMATE_SOAK_GROUPS", "1000"))
WIDTH = 8
WINDOW = 1000  # the p50 of the first and of the last this many cycles (at most half of them)

# What "did not grow" allows. The descriptors and processes of the pools the warm-up filled can
# differ by a little at any moment (a spare being refilled at idle priority); RSS moves with the
# allocator's arenas.
FD_TOLERANCE = 4
VMM_TOLERANCE = 2
RUNTIME_TOLERANCE = 1 << 20
RUNTIME_ENTRIES_TOLERANCE = 8
RSS_MARGIN = 16 << 20


def runtime_dir() -> Path:
    """guestos::persist::runtime_dir()."""
    if os.environ.get("COLLIMATE_RUNTIME_DIR"):
        return Path(os.environ["COLLIMATE_RUNTIME_DIR"])
    if Path("/dev/shm").is_dir():
        return Path("/dev/shm/collimate")
    return Path(tempfile.gettempdir()) / "collimate-runtime"


def entries(root: Path) -> int:
    """Files and directories under `root` (a sandbox's private directory left behind is a leak even
    when it is empty)."""
    return sum(len(d) + len(f) for _, d, f in os.walk(root))


def tree_bytes(root: Path) -> int:
    """Bytes allocated under `root` (du: sparse files count what they hold)."""
    total = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            try:
                total += os.lstat(os.path.join(dirpath, name)).st_blocks * 512
            except FileNotFoundError:
                pass
    return total


def shm_used() -> int:
    st = os.statvfs("/dev/shm")
    return (st.f_blocks - st.f_bfree) * st.f_frsize


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def processes() -> tuple[int, int, int]:
    """(VMM processes of this checkout's extension, every VMM process, every process) on the host."""
    ours = vmms = total = 0
    ext = _core.__file__.encode()
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            cmd = (entry / "cmdline").read_bytes()
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (FileNotFoundError, ProcessLookupError, PermissionError):
            continue
        if state == "Z":
            continue
        total += 1
        if b"_vmm_main" in cmd:
            vmms += 1
            ours += ext in cmd
    return ours, vmms, total


def measure(client: EmbeddedClient) -> dict[str, int]:
    # Quiescent: every destroyed sandbox torn down or recycled, the spare pools refilled.
    client._reaper.submit(lambda: None).result()
    time.sleep(0.5)
    ours, vmms, total = processes()
    return {
        "fds": len(os.listdir("/proc/self/fd")),
        "vmm": ours,
        "vmm_host": vmms,
        "procs_host": total,
        "runtime_bytes": tree_bytes(runtime_dir()),
        "runtime_entries": entries(runtime_dir()),
        "shm_host_bytes": shm_used(),
        "rss": rss(),
    }


def show(label: str, m: dict[str, int]) -> None:
    print(
        f"  {label:<18} fds {m['fds']:>4}  VMM processes {m['vmm']:>3} (host: {m['vmm_host']:>4} VMM, "
        f"{m['procs_host']:>5} in all)  runtime dir {m['runtime_bytes'] / 1024:>7.1f} KiB "
        f"in {m['runtime_entries']:>3} entries  "
        f"/dev/shm in use {m['shm_host_bytes'] / (1 << 20):>8.1f} MiB  RSS {m['rss'] / (1 << 20):>7.1f} MiB"
    )


def p50s(times: list[float]) -> str:
    n = min(WINDOW, max(1, len(times) // 2))  # the first and the last are different cycles
    first, last = statistics.median(times[:n]), statistics.median(times[-n:])
    return f"p50 of the first {n}: {first * 1e3:.2f} ms, of the last {n}: {last * 1e3:.2f} ms"


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    own = "COLLIMATE_RUNTIME_DIR" not in os.environ
    if own:  # this run's VMMs alone: a private runtime directory
        os.environ["COLLIMATE_RUNTIME_DIR"] = tempfile.mkdtemp(prefix="collimate-soak-", dir="/dev/shm")
    c = EmbeddedClient()
    yield c
    c.close()
    if own:
        d = os.environ.pop("COLLIMATE_RUNTIME_DIR")
        for _ in range(100):  # the last VMM processes' directories go as they are reaped
            try:
                os.rmdir(d)
                break
            except OSError:
                time.sleep(0.05)
        else:
            print(f"runtime directory {d} still holds {sorted(os.listdir(d))} 5 s after close")


def enter_exec_exit(client) -> None:
    with Sandbox("python", client=client) as sb:
        r = sb.exec(code="print(1)")
    assert r.ok and r.stdout == "1\n", r


def fork_group_cycle(client) -> None:
    with client.session("python") as sess:
        with sess.fork_group(WIDTH) as grp:
            out = grp.map(lambda i, child: child.exec(code="print(1)").stdout)
    assert out == ["1\n"] * WIDTH, out


def test_soak_nothing_grows(client):
    t0 = time.monotonic()
    # Warm-up: the template's zygote and spares, the recycled pool filled by a group's children.
    for _ in range(20):
        enter_exec_exit(client)
    for _ in range(3):
        fork_group_cycle(client)
    print(f"\nsoak: {CYCLES} create/exec/destroy cycles, then {GROUPS} fork_group({WIDTH}) cycles")
    start = measure(client)
    show("start", start)

    times, peak = [], 0
    for i in range(CYCLES):
        t = time.perf_counter()
        enter_exec_exit(client)
        times.append(time.perf_counter() - t)
        if i % 100 == 0:
            peak = max(peak, processes()[0])
    print(f"  create/exec/destroy: {p50s(times)}; at most {peak} VMM processes meanwhile")
    mid = measure(client)
    show(f"after {CYCLES} cycles", mid)

    gtimes, gpeak = [], 0
    for i in range(GROUPS):
        t = time.perf_counter()
        fork_group_cycle(client)
        gtimes.append(time.perf_counter() - t)
        if i % 10 == 0:
            gpeak = max(gpeak, processes()[0])
    print(f"  fork_group({WIDTH}) + map: {p50s(gtimes)}; at most {gpeak} VMM processes meanwhile")
    end = measure(client)
    show(f"after {GROUPS} groups", end)
    print(f"  {time.monotonic() - t0:.0f} s in all; the client's usage meter holds {len(client._meter.buckets)} buckets")

    grew = []
    checks = (("fds", FD_TOLERANCE), ("vmm", VMM_TOLERANCE), ("runtime_bytes", RUNTIME_TOLERANCE),
              ("runtime_entries", RUNTIME_ENTRIES_TOLERANCE))
    for key, tol in checks:
        for label, m in (("after the cycles", mid), ("at the end", end)):
            if m[key] > start[key] + tol:
                grew.append(f"{key} {label}: {start[key]} -> {m[key]} (tolerance {tol})")
    bound = start["vmm"] + REAP_BACKLOG + RECYCLE_MAX + WIDTH + 1
    if max(peak, gpeak) > bound:
        grew.append(f"VMM processes while cycling: {max(peak, gpeak)} (bound {bound}: the pools, the reaper's queue, a group)")
    if end["rss"] > start["rss"] + RSS_MARGIN:
        grew.append(f"RSS: {start['rss'] >> 20} -> {end['rss'] >> 20} MiB (margin {RSS_MARGIN >> 20} MiB)")
    assert not grew, "grew (a leak): " + "; ".join(grew)
