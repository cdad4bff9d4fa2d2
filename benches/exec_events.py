"""What one `exec` costs in events, per platform profile: VM exits by kind, guest syscalls and guest
page faults for `exec(command="true")` and `exec(code="print(1)")` in a warm python sandbox, next
to the price of one event measured in the same run on the same host.

    python3 benches/exec_events.py [N]        (default 15 execs of each)

Counts come from the engine's own trace (`crates/engine/src/trace.rs`, `COLLIMATE_TRACE=2`): every
KVM_RUN a VMM process makes (`*.runs`), every guest page fault it serves (`*.faults`), every guest
syscall it serves (`sys`), every clock read the vDSO answered without an exit (`vdso`), summed
over the sandbox's processes between the start and the end of each exec. A process's KVM_RUN and
fault counts are reported only when it forks or ends, and `exec(code=...)` runs in the sandbox's
long-lived agent, which does neither: so each such exec is followed by an `exec(command="true")`
(whose fork reports the agent's counts) and its counts are the window's minus the median of
`true`'s alone (in the steady state the agent's counts after a fork land in the next window, the
same for every window). Exits by kind: a guest syscall is one exit, a page
fault the VMM serves is one; "other" is the rest of the KVM_RUN returns (timer and signal
interruptions, I/O the guest does, the engine's own stops).

Prices, measured here in the same run: one exit (`collimate doctor`'s `out` loop,
`vstate::profile::exit_cost`), one guest syscall (`collimate doctor`'s `getpid` loop, a bare
guest), one first touch of a fresh guest page (a Python program in the sandbox touching 2,000
fresh pages of an anonymous mmap, minus the same with one page, over 1,999). The trace counts
only the faults that exit to the VMM (the guest's own #PF, e.g. a page the VMM maps lazily);
faults KVM serves itself (its shadow page tables, the host's first touch of guest memory) never
reach the VMM and are not counted: their time shows in `run_us` and in the page price.
Wall times are measured in a second run without the trace (it writes a line per syscall), with
their median, p99 and the ratio to the same work done directly on the host (/bin/true,
/usr/bin/python3 -c 'print(1)', each started by subprocess.run; `exec(code=...)` runs in the
sandbox's warm agent interpreter, the host baseline starts an interpreter, hence its ratio below
1). Every figure names its platform profile and host kind.
"""

from __future__ import annotations

import json
import math
import os
import re
import statistics
import subprocess
import sys
import time

PAGES = 2000
CASES = {
    "true": {"command": "true"},
    "print(1)": {"code": "print(1)"},
    f"touch {PAGES} pages": {"code": f"import mmap\nm = mmap.mmap(-1, {PAGES} * 4096)\nfor i in range(0, {PAGES} * 4096, 4096):\n    m[i] = 1\n"},
    "touch 1 page": {"code": "import mmap\nm = mmap.mmap(-1, 4096)\nm[0] = 1\n"},
}
HOST_PYTHON = "/usr/bin/python3" if os.path.exists("/usr/bin/python3") else os.path.realpath(sys.executable)

RUNNER = """
import json, os, sys, time
os.environ.pop("COLLIMATE_API_KEY", None)
from collimate_core import Sandbox, connect
cases = json.loads(sys.argv[1]); n = int(sys.argv[2])
with Sandbox("python", client=connect()) as sb:
    for label, kw in cases.items():
        for _ in range(3):
            sb.exec(**kw)
        for _ in range(n):
            sys.stderr.write(f"BEGIN {label}\\n"); sys.stderr.flush()
            t = time.perf_counter()
            r = sb.exec(**kw)
            wall = (time.perf_counter() - t) * 1e3
            if label != "true":
                sb.exec(command="true")  # the agent forks: its counts so far are reported
            sys.stderr.write(f"END {wall:.3f} {r.exit_code}\\n"); sys.stderr.flush()
"""


def run(n: int, trace: bool) -> list[tuple[str, float, list[list[str]]]]:
    """[(case, wall ms, the trace lines of that exec)] for n execs of each case."""
    env = dict(os.environ, COLLIMATE_TRACE="2" if trace else "0")
    p = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(CASES), str(n)], env=env, capture_output=True, text=True)
    out, cur, marks = [], None, []
    for line in p.stderr.splitlines():
        if line.startswith("BEGIN "):
            cur, marks = line[6:], []
        elif line.startswith("END ") and cur is not None:
            wall, code = line.split()[1:3]
            if code != "0":
                sys.exit(f"exec {cur!r} exited with {code}")
            out.append((cur, float(wall), marks))
            cur = None
        elif line.startswith("collimate-trace ") and cur is not None:
            marks.append(line.split())
    if p.returncode != 0 or len(out) != n * len(CASES):
        sys.exit(f"the runner failed (status {p.returncode}):\n{p.stderr[-3000:]}")
    return out


def counts(marks: list[list[str]]) -> dict[str, int]:
    c = {"runs": 0, "syscalls": 0, "faults": 0, "vdso reads": 0, "run_us": 0}
    for m in marks:
        what, val = m[3], int(m[4]) if len(m) > 4 else 0
        if what == "sys":
            c["syscalls"] += 1
        elif what == "vdso":
            c["vdso reads"] += val
        elif re.fullmatch(r"\w+\.runs", what):
            c["runs"] += val
        elif re.fullmatch(r"\w+\.faults", what):
            c["faults"] += val
        elif re.fullmatch(r"\w+\.run_us", what):
            c["run_us"] += val
    c["other exits"] = c["runs"] - c["syscalls"] - c["faults"]
    return c


def p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, math.ceil(0.99 * len(s)) - 1)]


def host(cmd: list[str], n: int) -> list[float]:
    walls = []
    for _ in range(n + 3):
        t = time.perf_counter()
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
        walls.append((time.perf_counter() - t) * 1e3)
    return walls[3:]


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    from collimate_core import _core
    from collimate_core.doctor import _median_syscall_ns

    prof = _core._kvm_profile(measure_exit=True)
    kind = f"{prof['kind']}, {prof['paging']} paging, {'nested' if prof['nested'] else 'not nested'} ({prof['source']})"
    where = f"platform {prof['name']}; host kind: {kind}; {os.uname().release}; load {os.getloadavg()[0]:.1f}"
    syscall_us = _median_syscall_ns() / 1000
    exit_us = prof["exit_ns"] / 1000

    traced = run(n, trace=True)
    walls = run(n, trace=False)
    per: dict[str, list[dict[str, int]]] = {}
    for label, _, marks in traced:
        per.setdefault(label, []).append(counts(marks))
    wall: dict[str, list[float]] = {}
    for label, ms, _ in walls:
        wall.setdefault(label, []).append(ms)
    med = {label: {k: statistics.median(c[k] for c in cs) for k in cs[0]} for label, cs in per.items()}
    for label in med:
        if label != "true":
            # run_us stays the window's (with the `true` after it): a difference of medians of
            # times this noisy can come out negative.
            med[label] = {k: v if k == "run_us" else v - med["true"][k] for k, v in med[label].items()}
    many, one = f"touch {PAGES} pages", "touch 1 page"
    dfaults = med[many]["faults"] - med[one]["faults"]
    fault_us = (statistics.median(wall[many]) - statistics.median(wall[one])) * 1000 / (PAGES - 1)

    print(f"\nexec event counts, median of {n} execs each ({where})")
    keys = ["runs", "syscalls", "faults", "other exits", "vdso reads", "run_us"]
    print("(runs: KVM_RUNs; exits by kind: syscalls, faults the VMM served, other; run_us: time in KVM_RUN, for the")
    print(" exec(code=...) rows including the exec(command='true') that follows each)")
    print(f"| exec | {' | '.join(keys)} | wall median ms | p99 ms | host baseline median ms | ratio |")
    print("|---" * (len(keys) + 5) + "|")
    base = {"true": host(["/bin/true"], n), "print(1)": host([HOST_PYTHON, "-c", "print(1)"], n)}
    for label in CASES:
        m = med[label]
        w = wall[label]
        b = base.get(label)
        bm = f"{statistics.median(b):.2f}" if b else "-"
        ratio = f"{statistics.median(w) / statistics.median(b):.2f}x" if b else "-"
        print(f"| {label} | {' | '.join(f'{m[k]:g}' for k in keys)} | {statistics.median(w):.2f} | {p99(w):.2f} | {bm} | {ratio} |")
    print(f"\nprice of one event, same run ({where})")
    print("| event | us | how |")
    print("|---|---|---|")
    print(f"| exit (KVM_RUN round trip to the VMM) | {exit_us:.1f} | median of 2,000 `out` exits (collimate doctor) |")
    print(f"| guest syscall | {syscall_us:.1f} | median of 5 runs of 2,000 getpid in a bare guest (collimate doctor) |")
    print(f"| first touch of a fresh guest page | {fault_us:.1f} | exec wall of {many} minus touch 1 page, over {PAGES - 1} pages ({dfaults:g} more of them exited to the VMM as faults; the rest KVM served) |")
    print("\nwhere the exec's time goes (median counts x price):")
    for label in ("true", "print(1)"):
        m = med[label]
        est = m["syscalls"] * syscall_us + (m["faults"] + max(m["other exits"], 0)) * exit_us
        print(f"  {label}: {m['syscalls']:g} syscalls x {syscall_us:.1f} + {m['faults'] + m['other exits']:g} fault and other exits x {exit_us:.1f} = {est / 1000:.2f} ms of {statistics.median(wall[label]):.2f} ms wall ({m['run_us'] / 1000:.2f} ms in KVM_RUN{'' if label == 'true' else ', with the true after it'})")


if __name__ == "__main__":
    main()
