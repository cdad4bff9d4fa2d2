"""What an idle sandbox costs the host, on kvm and on systrap, beside a native peer in the same run.

Issue 35 asks that an idle clone on systrap cost about what it does on kvm. Measured here: N
sandboxes of the catalog "python" template, each after one `exec(code=...)` that imports a few
modules and keeps a small object (what a sandbox of a GRPO group holds between its turns), then
left idle; the host memory they add is the proportional set size (PSS: each shared page counted
once over the processes that share it, so the template's pages shared copy-on-write count once in
all) of every process this benchmark's process started, after minus before, per sandbox. The
peer is what a user would pick without a sandbox: N warm `/usr/bin/python3` processes (called
directly) that ran the same code and wait on stdin.

Also printed: host processes per sandbox (kvm: one VMM; systrap: a VMM and its stub) and CPU
time they burn while idle (user + system over IDLE_SECONDS: an idle sandbox must not spin).
Memory and CPU are printed, never asserted. Needs /dev/kvm for the kvm rows and seccomp filters
for the systrap rows.
"""

from __future__ import annotations

import os
import subprocess
import time

import pytest

from collimate_core import EmbeddedClient, Sandbox
from conftest import HOST_PYTHON

N = 16
IDLE_SECONDS = 2.0
CODE = "import json, re, collections\nkept = [dict(a=i) for i in range(2000)]\nprint(len(kept))"
_rows: dict[str, dict[str, float]] = {}


def _tree() -> dict[int, int]:
    """pid -> parent pid of every process on the host."""
    out = {}
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                out[int(d)] = int(open(f"/proc/{d}/stat").read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def _descendants() -> list[int]:
    tree, me = _tree(), os.getpid()
    children: dict[int, list[int]] = {}
    for pid, ppid in tree.items():
        children.setdefault(ppid, []).append(pid)
    out, todo = [], [me]
    while todo:
        for c in children.get(todo.pop(), []):
            out.append(c)
            todo.append(c)
    return out


def _pss_kib(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            for line in open(f"/proc/{pid}/smaps_rollup"):
                if line.startswith("Pss:"):
                    total += int(line.split()[1])
        except OSError:
            pass  # gone, or not ours to read
    return total


def _cpu_ticks(pids: list[int]) -> int:
    total = 0
    for pid in pids:
        try:
            f = open(f"/proc/{pid}/stat").read().rsplit(")", 1)[1].split()
            total += int(f[11]) + int(f[12])
        except (OSError, IndexError, ValueError):
            pass
    return total


def _measure(name: str, start_all) -> None:
    before = set(_descendants())
    pss0 = _pss_kib(sorted(before))
    handles = start_all()
    try:
        time.sleep(0.5)  # let the spares' thread and any teardown settle
        procs = [p for p in _descendants() if p not in before]
        pss = _pss_kib(sorted(before) + procs) - pss0
        t0 = _cpu_ticks(procs)
        time.sleep(IDLE_SECONDS)
        cpu = (_cpu_ticks(procs) - t0) / os.sysconf("SC_CLK_TCK")
        _rows[name] = {"pss_mib": pss / 1024 / N, "procs": len(procs) / N, "cpu_ms": cpu * 1e3 / N / IDLE_SECONDS}
    finally:
        for h in handles:
            h()


def test_native_warm_python():
    def start_all():
        ps = []
        for _ in range(N):
            p = subprocess.Popen([HOST_PYTHON, "-c", CODE + "\nimport sys\nsys.stdout.flush()\nsys.stdin.read()"],
                                 stdin=subprocess.PIPE, stdout=subprocess.PIPE)
            assert p.stdout.readline().strip() == b"2000"
            ps.append(p)

        def stop(p):
            p.stdin.close()
            p.wait(timeout=30)
            p.stdout.close()
        return [lambda p=p: stop(p) for p in ps]

    _measure("native python3, warm and waiting", start_all)


@pytest.mark.parametrize("platform", ["kvm", "systrap"])
def test_idle_sandboxes(platform):
    if platform == "kvm" and not os.path.exists("/dev/kvm"):
        pytest.skip("needs /dev/kvm")
    c = EmbeddedClient(platform=platform)
    try:
        with Sandbox("python", client=c) as sb:  # the template's first use is not measured
            sb.exec(code="pass")

        def start_all():
            boxes = []
            for _ in range(N):
                sb = Sandbox("python", client=c).__enter__()
                r = sb.exec(code=CODE)
                assert r.ok and r.stdout == "2000\n", r
                boxes.append(sb)
            return [lambda sb=sb: sb.__exit__(None, None, None) for sb in boxes]

        _measure(f"{platform} sandbox, idle after one exec", start_all)
    finally:
        c.close()


def test_print_idle_table(capsys):
    if not _rows:
        pytest.skip("needs the measurements of this file in the same run")
    native = _rows.get("native python3, warm and waiting")
    lines = ["", f"idle cost per sandbox ({N} of each; PSS of the processes they add, CPU over {IDLE_SECONDS:.0f} s idle; "
                 f"load {open('/proc/loadavg').read().split()[0]})",
             f"{'what':<40} {'PSS MiB':>8} {'x native':>9} {'procs':>6} {'CPU ms/s':>9}"]
    for name, r in _rows.items():
        ratio = f"{r['pss_mib'] / native['pss_mib']:8.2f}x" if native else f"{'-':>9}"
        lines.append(f"{name:<40} {r['pss_mib']:8.2f} {ratio} {r['procs']:6.1f} {r['cpu_ms']:9.2f}")
    with capsys.disabled():
        print("\n".join(lines))
