"""Host processes as the tests see them through /proc.

A process that has exited is either a zombie (``Z``, not yet reaped) or dead (``X``: reaped, being
released; a parent that ignores SIGCHLD, as VMM processes do, reaps its children at their exit, and a
pidfd turns readable a moment before /proc forgets them). Neither runs or holds memory: both count as
gone.
"""

from __future__ import annotations

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
