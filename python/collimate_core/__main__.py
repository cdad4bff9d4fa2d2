"""`python -m collimate_core demo`: the main job, end to end on this host.

Bakes a template (a guest paused at its ready point, checkpointed to the cache directory), forks a
GRPO-shaped group from it (one parent runs a shared prefix, N live children each run a candidate),
grades every child, and prints the fork latencies next to a host baseline measured in the same run.

Until the python template lands (CPython in the sandbox), the guest is the engine's test program
(guest/testprogs/testvm.S), whose "candidates" are memory computations checked by the host.
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import subprocess
import sys
import time
from pathlib import Path

from collimate_core import Vm

REPO = Path(__file__).resolve().parents[2]
MAILBOX, HEAP, PAGE = 0x600000, 0x1000000, 4096
FILL, SUM = 1, 2


def cache_dir() -> Path:
    base = os.environ.get("COLLIMATE_CACHE") or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "collimate"
    )
    return Path(base)


def command(vm: Vm, cmd: int, a0: int = 0, a1: int = 0, a2: int = 0) -> int:
    vm.write_mem(MAILBOX, struct.pack("<5Q", cmd, a0, a1, a2, 0))
    r = vm.run(10.0)
    if (r.kind, r.value) != ("yield", cmd):
        raise RuntimeError(f"guest did not finish command {cmd}: {r!r}")
    return struct.unpack("<5Q", vm.read_mem(MAILBOX, 40))[4]


def bake(cache: Path) -> Path:
    """Build the guest program and checkpoint it at its ready point (once; cached)."""
    script = REPO / "guest" / "testprogs" / "build.sh"
    if not script.exists():
        sys.exit("demo: run from a checkout of collimate_core (guest/testprogs is needed)")
    out = subprocess.run(["bash", str(script), str(cache / "guest")], check=True, capture_output=True, text=True)
    elf_path = Path(out.stdout.strip().splitlines()[-1])
    template = cache / "templates" / "testvm"
    if not (template / "vm.state").exists():
        with Vm.boot(elf_path.read_bytes()) as vm:
            r = vm.run(10.0)
            if (r.kind, r.value) != ("yield", 0):
                raise RuntimeError(f"template did not reach its ready point: {r!r}")
            vm.snapshot(str(template))
    return template


def pct(xs: list[float], p: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, round((len(xs) - 1) * p))]


def host_fork_ms() -> float:
    t = time.perf_counter()
    pid = os.fork()
    if pid == 0:
        os._exit(0)
    os.waitpid(pid, 0)
    return (time.perf_counter() - t) * 1e3


def demo(width: int, clones: int) -> None:
    cache = cache_dir()
    t0 = time.perf_counter()
    template = bake(cache)
    print(f"template: {template} ({time.perf_counter() - t0:.2f} s)")

    with Vm.restore(str(template)) as zygote:
        zygote.set_spare_pool(2)
        clone_ms = []
        for _ in range(clones):
            time.sleep(0.002)
            t = time.perf_counter()
            with zygote.clone() as c:
                c.run(10.0)  # to the clone's first guest exit
                clone_ms.append((time.perf_counter() - t) * 1e3)
        baseline = [host_fork_ms() for _ in range(clones)]

        with zygote.clone() as parent:
            command(parent, FILL, 2560, 1, 0)  # shared prefix: 10 MiB of state, computed once
            t = time.perf_counter()
            group = parent.fork(width)
            group_ms = (time.perf_counter() - t) * 1e3
            try:
                rewards = []
                for i, child in enumerate(group):
                    command(child, FILL, 16, i % 200, 0)  # candidate i
                    total = command(child, SUM, 2560, 0, 0)
                    expected = 16 * (i % 200) + (2560 - 16)
                    rewards.append(1.0 if total == expected else 0.0)
            finally:
                for child in group:
                    child.destroy()

    b50 = statistics.median(baseline)
    print(f"group of {width}: rewards {sum(rewards):.0f}/{width} = 1.0, positional")
    print(f"{'':34} {'median':>9} {'p99':>9} {'x host fork':>12}")
    print(f"{'host os.fork()+_exit+wait':34} {b50:8.2f}ms {pct(baseline, .99):8.2f}ms {1.0:12.2f}")
    c50 = statistics.median(clone_ms)
    print(f"{'clone from template, to 1st exit':34} {c50:8.2f}ms {pct(clone_ms, .99):8.2f}ms {c50 / b50:12.2f}")
    print(f"{f'live fork into {width} (10 MiB dirty)':34} {group_ms:8.2f}ms {'':>9} {group_ms / b50:12.2f}")


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog="python -m collimate_core")
    sub = ap.add_subparsers(dest="cmd", required=True)
    d = sub.add_parser("demo", help="bake a template, fork a group, grade it, print fork latency")
    d.add_argument("--width", type=int, default=64)
    d.add_argument("--clones", type=int, default=200)
    args = ap.parse_args(argv)
    if args.cmd == "demo":
        demo(args.width, args.clones)


if __name__ == "__main__":
    main()
