"""What one `exec` costs in events, per platform profile: VM exits by kind, guest syscalls, guest
page faults, CPUIDs and KVM's own MMU faults (shadow faults under shadow paging) for
`exec(command="true")` and `exec(code="print(1)")` in a warm python sandbox, next to the price of
one event measured in the same run on the same host.

    python3 benches/exec_events.py [N]        (default 15 execs of each)

Counts come from the engine's own trace (`crates/engine/src/trace.rs`, `COLLIMATE_TRACE=2`): every
KVM_RUN a VMM process makes (`*.runs`), every guest page fault it serves (`*.faults`), every guest
syscall it serves (`sys`), every clock read the vDSO answered without an exit (`vdso`), summed
over the sandbox's processes between the start and the end of each exec. A process's KVM_RUN and
fault counts are reported only when it forks or ends, and `exec(code=...)` runs in the sandbox's
long-lived agent, which does neither: so each such exec is followed by an `exec(command="true")`
(whose fork reports the agent's counts) and its counts are the window's minus the median of
`true`'s alone (in the steady state the agent's counts after a fork land in the next window, the
same for every window).

What the VMM never sees, KVM's tracepoints count (root and tracefs needed; omitted, saying why,
otherwise): every CPUID the guest executes (`kvm:kvm_cpuid`: KVM answers CPUID in the kernel, on
every profile), every guest page fault KVM's MMU serves by installing a translation
(`kvmmmu:kvm_mmu_spte_requested`: shadow faults under shadow paging, kvm_pvm and npt=0; NPT/EPT
violations under TDP) and, where the profile emits it (upstream KVM, not kvm_pvm), every exit
to KVM (`kvm:kvm_exit`). They are recorded in a tracefs instance of this process's own for its
descendants only (the sandboxes' VMM processes), on CLOCK_MONOTONIC, and counted over each
exec alone (the `true` after an exec(code=...) left out).

Exits by kind: a guest syscall is one exit, a page fault the VMM serves is one; "other" is the rest of the KVM_RUN returns (timer and signal
interruptions, I/O the guest does, the engine's own stops).

Prices, measured here in the same run: one exit (`collimate doctor`'s `out` loop,
`vstate::profile::exit_cost`), one guest syscall (`collimate doctor`'s `getpid` loop, a bare
guest), one CPUID (an exec looping over 5,000 CPUIDs through ctypes against the same exec
calling a bare `ret`, in the CPU time of the sandbox's VMM processes from the host's schedstat:
the sandbox's clocks are virtual, and wall time stretches with the machine's load), one first touch of a
fresh guest page (a Python program in the sandbox touching 2,000 fresh pages of an anonymous
mmap, minus the same with one page, over 1,999). The engine's trace counts only the faults that
exit to the VMM (the guest's own #PF, e.g. a page the VMM maps lazily); those KVM serves itself
(its shadow page tables, the host's first touch of guest memory) never reach the VMM: they are
the "KVM MMU faults" column, and their time shows in `run_us` and in the page price.
Wall times are measured in a second run without the trace (it writes a line per syscall), with
their median, p99 and the ratio to the same work done directly on the host (/bin/true,
/usr/bin/python3 -c 'print(1)', each started by subprocess.run; `exec(code=...)` runs in the
sandbox's warm agent interpreter, the host baseline starts an interpreter, hence its ratio below
1). Every figure names its platform profile and host kind.
"""

from __future__ import annotations

import bisect
import json
import math
import os
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

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
            sys.stderr.write(f"BEGIN {label} {time.monotonic_ns()}\\n"); sys.stderr.flush()
            t = time.perf_counter()
            r = sb.exec(**kw)
            wall = (time.perf_counter() - t) * 1e3
            done = time.monotonic_ns()
            if label != "true":
                sb.exec(command="true")  # the agent forks: its counts so far are reported
            sys.stderr.write(f"END {wall:.3f} {r.exit_code} {done}\\n"); sys.stderr.flush()
"""


def run(n: int, trace: bool) -> list[tuple[str, float, list[list[str]], tuple[int, int]]]:
    """[(case, wall ms, the trace lines of that exec, (start, end) in CLOCK_MONOTONIC ns)] for n
    execs of each case."""
    env = dict(os.environ, COLLIMATE_TRACE="2" if trace else "0")
    p = subprocess.run([sys.executable, "-c", RUNNER, json.dumps(CASES), str(n)], env=env, capture_output=True, text=True)
    out, cur, marks, begin = [], None, [], 0
    for line in p.stderr.splitlines():
        if line.startswith("BEGIN "):
            cur, begin = line[6:].rsplit(" ", 1)
            begin, marks = int(begin), []
        elif line.startswith("END ") and cur is not None:
            wall, code, done = line.split()[1:4]
            if code != "0":
                sys.exit(f"exec {cur!r} exited with {code}")
            out.append((cur, float(wall), marks, (begin, int(done))))
            cur = None
        elif line.startswith("collimate-trace ") and cur is not None:
            marks.append(line.split())
    if p.returncode != 0 or len(out) != n * len(CASES):
        sys.exit(f"the runner failed (status {p.returncode}):\n{p.stderr[-3000:]}")
    return out


# KVM's own tracepoints, counted per exec window (KvmEvents): CPUIDs the guest executed (KVM
# answers them in the kernel: the VMM never sees them), the page faults KVM's MMU resolved by
# installing a translation (shadow faults under shadow paging: kvm_pvm, npt=0; NPT/EPT
# violations under TDP), and the exits to KVM (the kvm_exit tracepoint: upstream KVM only,
# kvm_pvm does not emit it).
KVM_EVENTS = {"cpuids": "kvm/kvm_cpuid", "KVM MMU faults": "kvmmmu/kvm_mmu_spte_requested", "KVM exits": "kvm/kvm_exit"}
TRACEFS = Path("/sys/kernel/tracing")


class KvmEvents:
    """A tracefs instance of this process's own with KVM_EVENTS enabled for this process and its
    descendants (`set_event_pid` with `event-fork`: the sandboxes' VMM processes; other VMMs on
    the machine are not counted), timestamps on CLOCK_MONOTONIC (the exec windows' clock).
    Needs root and tracefs; where either is missing, `why` says so and the counts are omitted."""

    def __init__(self) -> None:
        self.dir: Path | None = None
        self.why = ""
        self.enabled: list[str] = []

    def __enter__(self) -> KvmEvents:
        d = TRACEFS / "instances" / f"collimate-exec-events-{os.getpid()}"
        try:
            if not (TRACEFS / "instances").is_dir():
                raise OSError(f"no tracefs at {TRACEFS} (mount -t tracefs tracefs {TRACEFS})")
            d.mkdir()
            self.dir = d
            (d / "trace_clock").write_text("mono")
            (d / "buffer_size_kb").write_text("32768")
            (d / "options" / "event-fork").write_text("1")
            (d / "set_event_pid").write_text(str(os.getpid()))
        except OSError as e:
            self.why = f"KVM's tracepoints not readable here: {e}"
            self.close()
            return self
        for name, ev in KVM_EVENTS.items():
            try:
                (d / "events" / ev / "enable").write_text("1")
                self.enabled.append(name)
            except OSError:
                pass  # this kernel has no such tracepoint: that column is omitted
        return self

    def __exit__(self, *exc) -> None:
        if self.dir is not None:
            (self.dir / "tracing_on").write_text("0")

    def events(self) -> dict[str, list[int]]:
        """Timestamps (CLOCK_MONOTONIC ns, sorted) of each counted event since the start."""
        out: dict[str, list[int]] = {name: [] for name in self.enabled}
        if self.dir is None:
            return out
        by_event = {ev.split("/")[1]: name for name, ev in KVM_EVENTS.items()}
        lost = sum(int(m.group(1)) for f in (self.dir / "per_cpu").glob("cpu*/stats")
                   for m in [re.search(r"^overrun: (\d+)", f.read_text(), re.M)] if m)
        if lost:
            self.why = f"{lost} KVM trace events were lost (the trace buffer overflowed): the KVM counts are low"
        pat = re.compile(r"\s(\d+)\.(\d{6}): (\w+):")
        with open(self.dir / "trace") as f:
            for line in f:
                m = pat.search(line)
                if m and m.group(3) in by_event:
                    out[by_event[m.group(3)]].append(int(m.group(1)) * 1_000_000_000 + int(m.group(2)) * 1000)
        for ts in out.values():
            ts.sort()
        return out

    def close(self) -> None:
        if self.dir is not None:
            try:
                (self.dir / "events" / "enable").write_text("0")
                self.dir.rmdir()
            except OSError:
                pass
            self.dir = None


def in_window(ts: list[int], window: tuple[int, int]) -> int:
    return bisect.bisect_right(ts, window[1]) - bisect.bisect_left(ts, window[0])


# The price of one CPUID in a guest: an exec running a loop of CPUIDs (leaf 0, through ctypes)
# against the same exec calling a bare `ret` instead, timed on the host (the sandbox's clocks are
# virtual in replay mode), over the loop's length; on this host, the same loops timed in-process.
CPUID_LOOP = r"""
import ctypes, mmap, sys, time
# push rbx; mov r8, rdx; mov eax, edi; mov ecx, esi; cpuid; mov [r8..+12], eax..edx; pop rbx; ret; then a bare ret
CODE = bytes.fromhex("534989d089f889f10fa24189004189580441894808418950" "0c5bc3" "c3")
buf = mmap.mmap(-1, 4096, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
buf.write(CODE)
addr = ctypes.addressof(ctypes.c_char.from_buffer(buf))
proto = ctypes.CFUNCTYPE(None, ctypes.c_uint32, ctypes.c_uint32, ctypes.POINTER(ctypes.c_uint32))
f = proto(addr) if WHICH == "cpuid" else proto(addr + len(CODE) - 1)
r = (ctypes.c_uint32 * 4)()
for _ in range(LOOP):
    f(0, 0, r)
"""
LOOP = 5000


def descendants_cpu_ns() -> int:
    """CPU time (ns, every thread, /proc/PID/task/TID/schedstat) of this process's descendants: the
    sandboxes' VMM processes, whose threads run the guest (KVM_RUN time is theirs)."""
    parent: dict[int, int] = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    parent[int(d)] = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    mine, total = {os.getpid()}, 0
    grew = True
    while grew:
        grew = False
        for pid, pp in parent.items():
            if pp in mine and pid not in mine:
                mine.add(pid)
                grew = True
    for pid in mine - {os.getpid()}:
        try:
            for tid in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{tid}/schedstat") as f:
                    total += int(f.read().split()[0])
        except (OSError, ValueError):
            pass
    return total


def cpuid_price() -> tuple[float, float, tuple[float, float]]:
    """(us of the sandbox's VMM CPU time per CPUID, us of wall time per CPUID, (CPU, wall) us per
    CPUID on this host), medians of 7 pairs. On a loaded machine the wall figure stretches with the load (the
    VMM waits for a core); the CPU time does not."""
    from collimate_core import Sandbox, connect

    def code(which: str) -> str:
        return f"WHICH = {which!r}; LOOP = {LOOP}\n" + CPUID_LOOP

    def host_once(which: str) -> tuple[float, float]:
        c, t = time.thread_time(), time.perf_counter()
        exec(compile(code(which), "cpuid-loop", "exec"), {})
        return time.thread_time() - c, time.perf_counter() - t

    cpu, walls, here = [], [], []
    with Sandbox("python", client=connect()) as sb:
        for w in ("cpuid", "ret"):
            sb.exec(code=code(w))
        for _ in range(7):
            t, c = {}, {}
            for w in ("cpuid", "ret"):
                c0, t0 = descendants_cpu_ns(), time.perf_counter()
                r = sb.exec(code=code(w))
                t[w], c[w] = time.perf_counter() - t0, descendants_cpu_ns() - c0
                if r.exit_code != 0:
                    sys.exit(f"the CPUID loop failed in the sandbox: {r.stderr[-2000:]}")
            cpu.append((c["cpuid"] - c["ret"]) / LOOP / 1000)
            walls.append((t["cpuid"] - t["ret"]) / LOOP * 1e6)
            a, b = host_once("cpuid"), host_once("ret")
            here.append(((a[0] - b[0]) / LOOP * 1e6, (a[1] - b[1]) / LOOP * 1e6))
    return statistics.median(cpu), statistics.median(walls), (statistics.median(h[0] for h in here), statistics.median(h[1] for h in here))


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

    kvm = KvmEvents()
    try:
        with kvm:
            traced = run(n, trace=True)
        kvm_ts = kvm.events()
    finally:
        kvm.close()
    walls = run(n, trace=False)
    cpuid_us, cpuid_wall_us, host_cpuid_us = cpuid_price()
    per: dict[str, list[dict[str, int]]] = {}
    kper: dict[str, list[dict[str, int]]] = {}
    for label, _, marks, window in traced:
        per.setdefault(label, []).append(counts(marks))
        # KVM's events are timestamped: counted over the exec itself, without the `true` after it.
        kper.setdefault(label, []).append({k: in_window(ts, window) for k, ts in kvm_ts.items()})
    wall: dict[str, list[float]] = {}
    for label, ms, _, _ in walls:
        wall.setdefault(label, []).append(ms)
    med = {label: {k: statistics.median(c[k] for c in cs) for k in cs[0]} for label, cs in per.items()}
    for label in med:
        if label != "true":
            # run_us stays the window's (with the `true` after it): a difference of medians of
            # times this noisy can come out negative.
            med[label] = {k: v if k == "run_us" else v - med["true"][k] for k, v in med[label].items()}
    kvm_keys = [k for k in KVM_EVENTS if k in kvm_ts and (k != "KVM exits" or kvm_ts[k])]
    for label, cs in kper.items():
        med[label].update({k: statistics.median(c[k] for c in cs) for k in kvm_keys})
    many, one = f"touch {PAGES} pages", "touch 1 page"
    dfaults = med[many]["faults"] - med[one]["faults"]
    fault_us = (statistics.median(wall[many]) - statistics.median(wall[one])) * 1000 / (PAGES - 1)

    print(f"\nexec event counts, median of {n} execs each ({where})")
    keys = ["runs", "syscalls", "faults", "other exits", "vdso reads", *kvm_keys, "run_us"]
    print("(runs: KVM_RUNs; exits by kind: syscalls, faults the VMM served, other; run_us: time in KVM_RUN, for the")
    print(" exec(code=...) rows including the exec(command='true') that follows each)")
    print("(from KVM's tracepoints, over the exec alone: cpuids: CPUIDs the guest executed, answered by KVM in the kernel;")
    print(" KVM MMU faults: guest page faults KVM's MMU served by installing a translation, shadow faults under shadow paging;")
    print(" KVM exits: every exit to KVM, where the profile emits kvm_exit (upstream KVM, not kvm_pvm))")
    if kvm.why or not kvm_keys:
        print(f"(KVM's counts: {kvm.why or 'none of its tracepoints could be enabled'})")
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
    print(f"| CPUID executed by the guest (an exit KVM answers in the kernel) | {cpuid_us:.1f} | the sandbox's VMM CPU time (schedstat) for an exec of a loop of {LOOP:,} CPUIDs through ctypes minus the same exec calling a bare `ret`, over {LOOP:,}, median of 7; wall time the same way {cpuid_wall_us:.1f} us; this host's own CPUID, the same loops in-process: {host_cpuid_us[0]:.2f} us of CPU time, {host_cpuid_us[1]:.2f} us of wall time |")
    print(f"| first touch of a fresh guest page | {fault_us:.1f} | exec wall of {many} minus touch 1 page, over {PAGES - 1} pages ({dfaults:g} more of them exited to the VMM as faults; the rest KVM served) |")
    print("\nwhere the exec's time goes (median counts x price):")
    for label in ("true", "print(1)"):
        m = med[label]
        est = m["syscalls"] * syscall_us + (m["faults"] + max(m["other exits"], 0)) * exit_us
        cpuids = f" + {m['cpuids']:g} CPUIDs x {cpuid_us:.1f}" if "cpuids" in m else ""
        est += m.get("cpuids", 0) * cpuid_us
        print(f"  {label}: {m['syscalls']:g} syscalls x {syscall_us:.1f} + {m['faults'] + m['other exits']:g} fault and other exits x {exit_us:.1f}{cpuids} = {est / 1000:.2f} ms of {statistics.median(wall[label]):.2f} ms wall ({m['run_us'] / 1000:.2f} ms in KVM_RUN{'' if label == 'true' else ', with the true after it'})")


if __name__ == "__main__":
    main()
