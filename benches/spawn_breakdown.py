"""Where the time of `exec(command=...)` goes, step by step: runs a command N times in a warm
sandbox with COLLIMATE_TRACE=1 (crates/engine/src/trace.rs) and prints the median of each step of
each process (P: the sandbox's first process, the agent; C1...: the processes it starts) and of a
few steps across processes. The tables in docs/spawn.md come from it.

    python3 benches/spawn_breakdown.py [N] [COMMAND]     (defaults: 15, "true")
"""

from __future__ import annotations

import collections
import os
import statistics
import subprocess
import sys

COUNTS = ("image.runs", "image.faults", "image.run_us", "parent.runs", "parent.faults", "parent.run_us")
CROSS = [("P", "vfork.cloned", "C", "child.start"), ("C", "child.start", "C", "exec.loaded"), ("C", "host.exit", "P", "wait4.reaped")]

RUNNER = """
import os, sys, time
os.environ.pop("COLLIMATE_API_KEY", None)
from collimate_core import Sandbox, connect
with Sandbox("python", client=connect()) as sb:
    for _ in range(3):
        sb.exec(command=__CMD__)
    for _ in range(__N__):
        t = time.perf_counter()
        r = sb.exec(command=__CMD__)
        sys.stderr.write(f"WALL {(time.perf_counter() - t) * 1e3:.3f} {r.exit_code}\\n")
"""


def main() -> None:
    n = int(sys.argv[1]) if len(sys.argv) > 1 else 15
    cmd = sys.argv[2] if len(sys.argv) > 2 else "true"
    code = RUNNER.replace("__CMD__", repr(cmd)).replace("__N__", str(n))
    p = subprocess.run([sys.executable, "-c", code], env=dict(os.environ, COLLIMATE_TRACE="1"), capture_output=True, text=True)
    err = p.stderr.splitlines()
    marks = [line.split() for line in err if line.startswith("collimate-trace ")]
    walls = [float(line.split()[1]) for line in err if line.startswith("WALL ")]
    if len(walls) != n:
        sys.exit(p.stderr[-2000:])
    starts = [i for i, m in enumerate(marks) if m[3] == "serve.run"][-n:]
    steps: dict[str, list[float]] = collections.defaultdict(list)
    order: list[str] = []

    def add(name: str, ms: float) -> None:
        steps[name].append(ms)
        if name not in order:
            order.append(name)

    for k, a in enumerate(starts):
        b = starts[k + 1] if k + 1 < len(starts) else len(marks)
        ev = [m for m in marks[a:b] if m[3] not in COUNTS]
        top = ev[0][2]
        end = next((int(m[1]) for m in ev if m[3] == "serve.replied"), None)
        if end is None:
            continue
        ev = [m for m in ev if int(m[1]) <= end]
        pids = list(dict.fromkeys(m[2] for m in ev))
        for i, pid in enumerate(pids):
            role = "P" if pid == top else f"C{i}"
            prev = None
            seen: collections.Counter[str] = collections.Counter()
            for m in (m for m in ev if m[2] == pid):
                seen[m[3]] += 1
                key = m[3] if seen[m[3]] == 1 else f"{m[3]}#{seen[m[3]]}"
                if prev is not None:
                    add(f"{role}: {prev[1]} -> {key}", (int(m[1]) - prev[0]) / 1e6)
                prev = (int(m[1]), key)

        def at(role: str, name: str):
            return next((int(m[1]) for m in ev if (m[2] == top) == (role == "P") and m[3] == name), None)

        for ra, na, rb, nb in CROSS:
            ta, tb = at(ra, na), at(rb, nb)
            if ta is not None and tb is not None:
                add(f"X: {ra}.{na} -> {rb}.{nb}", (tb - ta) / 1e6)
    for name in order:
        v = steps[name]
        if len(v) >= n // 2:
            print(f"{statistics.median(v):8.3f} ms  (n={len(v):2})  {name}")
    print(f"wall: p50 {statistics.median(walls):.2f} ms, min {min(walls):.2f} ms ({n} runs of {cmd!r})")


if __name__ == "__main__":
    main()
