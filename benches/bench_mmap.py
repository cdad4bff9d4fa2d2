"""Small mappings (issue 31): what one 16 KiB anonymous mmap/munmap pair costs in a sandbox, beside
the same program under native /usr/bin/python3 in the same run. CPython 3.11 makes hundreds of
thousands of such pairs in a hypothesis-heavy test suite; `mmap.mmap(-1, n)`, Python's default, is a
MAP_SHARED|MAP_ANONYMOUS one.

Run: `python3 benches/bench_mmap.py` (or `pytest -s benches/bench_mmap.py`). Each platform the
host runs (kvm, systrap) gets a row per kind, each beside a native baseline measured right after it.

How it measures: every figure is taken from the host (the guest's clocks are virtual). One sample is
the wall time of one exec of the program making N pairs (each writes one byte of its mapping, as a
user of the memory would) minus the median wall time of the same program making none, divided by N.
The native baseline runs the same program text as a subprocess of /usr/bin/python3, timed the same
way. Median and p99 over ROUNDS samples; the machine is shared, so compare the ratio within one run.

What a pair costs in exits (perf's KVM tracepoints over 1,000 pairs in one exec; kvm_pvm): the two
syscalls exit to the VMM (2 `kvm_userspace_exit`) and the first write is one shadow fault inside KVM
(1 `kvm_mmu_spte_requested`), private or shared. Before shared windows were parked
(`vstate::shared::Parked`) a shared pair also deleted a KVM memory slot, which dropped every
translation of the VM: about 64 shadow faults a pair.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

ROUNDS = int(os.environ.get("COLLIMATE_BENCH_ROUNDS", "11"))
PAIRS = 500
NATIVE_PAIRS = 50000
NATIVE = "/usr/bin/python3"
PLATFORM = "kvm_pvm" if os.path.exists("/sys/module/kvm_pvm") else "kvm"

PAIR = r"""
import mmap
n = N
flags = FLAGS
for _ in range(n):
    m = mmap.mmap(-1, 16384, flags=flags)
    m[0] = 1
    m.close()
"""

KINDS = {
    "private anonymous (MAP_PRIVATE)": "mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS",
    "shared anonymous (Python's default)": "mmap.MAP_SHARED | mmap.MAP_ANONYMOUS",
}


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def native_run(code: str) -> float:
    t = time.perf_counter()
    subprocess.run([NATIVE, "-c", code], check=True)
    return time.perf_counter() - t


def sandbox_run(sb, code: str) -> float:
    t = time.perf_counter()
    r = sb.exec(code=code, timeout_seconds=300)
    took = time.perf_counter() - t
    assert r.exit_code == 0, r.stderr
    return took


def per_pair(run, program: str, n: int) -> list[float]:
    """Samples of (time of n pairs - median time of none) / n, in microseconds."""
    zero = statistics.median(run(program.replace("N\n", "0\n", 1)) for _ in range(5))
    full = program.replace("N\n", f"{n}\n", 1)
    return [(run(full) - zero) / n * 1e6 for _ in range(ROUNDS)]


def row(name: str, platform: str, sandbox: list[float], native: list[float]) -> str:
    ms, mn = statistics.median(sandbox), statistics.median(native)
    return (
        f"{name:<38} {platform:<8} median {ms:8.1f} us  p99 {pct(sandbox, 0.99):8.1f} us | "
        f"native median {mn:6.2f} us  p99 {pct(native, 0.99):6.2f} us | ratio {ms / mn:6.0f}x"
    )


def platforms() -> list[str]:
    """The sandbox platforms this host runs: kvm where /dev/kvm is, systrap where seccomp filters
    are allowed (issue 35)."""
    from collimate_core.sdk import platform as pf

    out = ["kvm"] if os.path.exists("/dev/kvm") else []
    return out + (["systrap"] if pf.probe_systrap().available else [])


def main() -> None:
    from collimate_rl import Sandbox, connect

    names = platforms()
    lines = [
        f"host {PLATFORM}; platforms {', '.join(names)}; {ROUNDS} samples per figure; a sample = one exec of N "
        f"16 KiB mmap/write/munmap pairs minus one of none, / N (N={PAIRS} in a sandbox, {NATIVE_PAIRS} natively); "
        "the native baseline is measured beside each platform's figure"
    ]
    clients = {name: connect(platform=name) for name in names}
    for kind, flags in KINDS.items():
        prog = PAIR.replace("FLAGS", flags)
        for name, client in clients.items():
            with Sandbox("python", client=client) as sb:
                sb_t = per_pair(lambda code: sandbox_run(sb, code), prog, PAIRS)
            nat_t = per_pair(native_run, prog, NATIVE_PAIRS)
            lines.append(row(kind, name, sb_t, nat_t))
    print("\n".join(lines))


def test_bench_mmap():
    """pytest entry point: prints the table (nothing is asserted about speed)."""
    main()


if __name__ == "__main__":
    sys.exit(main())
