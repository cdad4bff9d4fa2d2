"""Host processes as the tests see them through /proc.

A process that has exited is either a zombie (``Z``, not yet reaped) or dead (``X``: reaped, being
released; a parent that ignores SIGCHLD, as VMM processes do, reaps its children at their exit, and a
pidfd turns readable a moment before /proc forgets them). Neither runs or holds memory: both count as
gone.
"""

from __future__ import annotations

import os
from pathlib import Path

GONE = frozenset("ZX")


def state(pid: int) -> str | None:
    """The one-letter state of `pid` (R, S, D, Z, X, ...), or None when /proc has no such process."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError):
        return None
    return text[text.rindex(")") + 2]


def alive(pid: int) -> bool:
    """True unless `pid` has exited (gone from /proc, a zombie, or dead)."""
    s = state(pid)
    return s is not None and s not in GONE


def describe(pid: int) -> str:
    """State and wait channel of `pid`, for an assertion message."""
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text()
    except OSError:
        wchan = "?"
    return f"pid {pid}: state {state(pid)}, wchan {wchan}"


def descendants(pid: int) -> set[int]:
    """Every process below `pid` by /proc's parent links (reparented ones not included)."""
    kids: dict[int, list[int]] = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                s = (d / "stat").read_text()
            except OSError:
                continue
            kids.setdefault(int(s[s.rindex(")") + 2:].split()[1]), []).append(int(d.name))
    out, todo = set(), [pid]
    while todo:
        for k in kids.get(todo.pop(), []):
            out.add(k)
            todo.append(k)
    return out


# The host user systrap stubs run as (platform::systrap::Confinement's default: nobody).
STUB_UID = 65534


def without_reapers(pids: set[int]) -> set[int]:
    """`pids` but systrap trees' reapers (a child of its top VMM for the sandbox's life, no guest
    process: platform/systrap/reaper.rs). A recycled systrap sandbox's VMM lives on with it."""
    def reaper(p: int) -> bool:
        try:
            return Path(f"/proc/{p}/comm").read_text().strip() == "collimate-reap"
        except OSError:
            return False

    return {p for p in pids if not reaper(p)}


def guest_descendants(pid: int) -> set[int]:
    """`descendants` but a systrap tree's reaper (`without_reapers`)."""
    return without_reapers(descendants(pid))


def stub_of(vmm: int) -> int:
    """The stub of a systrap VMM: the process whose /proc/<pid>/mem it holds open."""
    for fd in Path(f"/proc/{vmm}/fd").iterdir():
        try:
            link = os.readlink(fd)
        except OSError:
            continue
        if link.endswith("/mem"):
            return int(link.split("/")[-2])
    raise AssertionError(f"VMM {vmm} holds no stub's /proc/<pid>/mem")


def orphaned_stubs() -> set[int]:
    """Live systrap stub processes whose parent is gone (reparented to init): stubs run as
    `STUB_UID` with no cmdline of their own. One whose sandbox is gone is a leak; while a sandbox
    lives, an adopted orphan's stub is one too, legitimately."""
    out = set()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            status = (d / "status").read_text()
            cmdline = (d / "cmdline").read_bytes()
        except OSError:
            continue
        fields = dict(line.split(":", 1) for line in status.splitlines() if ":" in line)
        ppid = int(fields.get("PPid", "0").strip() or 0)
        uid = int(fields.get("Uid", "0").split()[0])
        if ppid == 1 and uid == STUB_UID and not cmdline and alive(int(d.name)):
            out.add(int(d.name))
    return out
