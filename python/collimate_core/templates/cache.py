"""The cache directory, and how every writer of it stays safe against other threads and processes.

Several threads of a trainer, several trainer processes and the server may all reach for the same
cache entry (the python template, a root filesystem, an unpacked image, a grading template) at the
same moment, on a fresh machine where none of it exists yet. The rules, used by every writer:

- An entry is built in a temporary sibling, `.<entry>.<pid>.<thread>-<random>.tmp`, unique per
  process and thread, and renamed into place whole: a reader sees a finished entry or none.
- One builder per entry: `Lock(entry)` is an exclusive flock on `.<entry>.lock` beside it. Each
  user opens the file itself (flock belongs to the open file description), so it excludes threads
  of one process as well as other processes. The lock file exists only while someone holds or
  waits for it: the holder removes it on release, and a waiter that wakes on a removed file opens
  the new one (the inode check in `Lock.__enter__`).
- `build_once(...)`: the loser of a race waits on the lock, then finds the winner's entry and uses
  it; it never builds again.
- A process killed mid-build leaves its temporary tree and nothing else (the kernel drops its
  flocks). Each temporary holds an flock on itself while its owner lives, so `sweep(dir)` can tell
  a dead owner's leftovers from a live build's, whatever the pid namespace, and removes them.
- Every finished build appends one JSON line to `<cache>/builds.jsonl` (kind, key, path, pid,
  seconds), so an operator sees what a first use cost, and a test can count builds.

Stdlib only: `rootfs.py` (run by `guest/rootfs/build.py` without collimate_core) loads it by path.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import secrets
import shutil
import threading
import time
from pathlib import Path
from typing import Any, Callable

BUILD_LOG = "builds.jsonl"


def cache_dir() -> Path:
    """The cache directory: COLLIMATE_CACHE, else $XDG_CACHE_HOME/collimate, else ~/.cache/collimate."""
    if os.environ.get("COLLIMATE_CACHE"):
        return Path(os.environ["COLLIMATE_CACHE"])
    xdg = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(xdg) / "collimate"


def deb_dir(cache: Path) -> Path:
    """Where downloaded Debian packages are kept: COLLIMATE_DEB_CACHE, else `<cache>/debs`. They
    are inputs, not build products: CI keeps them outside a cache that starts empty."""
    env = os.environ.get("COLLIMATE_DEB_CACHE")
    return Path(env) if env else Path(cache) / "debs"


# --- locks ---------------------------------------------------------------------------------------


def lock_path(entry: Path) -> Path:
    entry = Path(entry)
    return entry.with_name(f".{entry.name}.lock")


class Lock:
    """An exclusive flock on `.<entry>.lock` beside `entry`, for one thread (open it per use)."""

    def __init__(self, entry: Path, waiting: Callable[[], None] | None = None):
        self.path = lock_path(entry)
        self.fd: int | None = None
        self.waiting = waiting  # called once if another holder makes us wait

    def __enter__(self) -> Lock:
        while True:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            try:
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                except BlockingIOError:
                    if self.waiting is not None:
                        self.waiting()
                        self.waiting = None
                    fcntl.flock(fd, fcntl.LOCK_EX)
                # The holder before us may have removed the file on release: then we hold a lock
                # on a file no one else will open. Lock the one at the path now.
                if os.stat(self.path).st_ino == os.fstat(fd).st_ino:
                    self.fd = fd
                    return self
            except FileNotFoundError:
                pass
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)

    def __exit__(self, *exc) -> None:
        assert self.fd is not None
        try:
            os.unlink(self.path)  # while still held: no one can be holding the file we remove
        except FileNotFoundError:
            pass
        finally:
            os.close(self.fd)
            self.fd = None


# --- temporaries ---------------------------------------------------------------------------------


def temp_path(entry: Path) -> Path:
    """A temporary sibling of `entry` no other process or thread will ever pick."""
    entry = Path(entry)
    return entry.with_name(f".{entry.name}.{os.getpid()}.{threading.get_ident()}-{secrets.token_hex(4)}.tmp")


def _owner_pid(name: str) -> int | None:
    if not (name.startswith(".") and name.endswith(".tmp")):
        return None
    parts = name[:-4].rsplit(".", 2)
    return int(parts[1]) if len(parts) == 3 and parts[1].isdigit() else None


class Temp:
    """A temporary directory (or, with `file=True`, an empty file) beside `entry`, flocked by its
    owner while it lives (see `sweep`); removed on exit unless it was renamed into place."""

    def __init__(self, entry: Path, file: bool = False):
        self.entry = Path(entry)
        self.file = file
        self.path = temp_path(self.entry)
        self.fd: int | None = None

    def __enter__(self) -> Path:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        if self.file:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        else:
            # Private: a template's memory file holds whatever its Ready step loaded (a root
            # filesystem's builder opens its tree's root up to 0755 itself: the guest sees it).
            os.mkdir(self.path, 0o700)
            fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        # Blocking: a sweeper may hold it for a moment, and leaves it alone on seeing our pid.
        fcntl.flock(fd, fcntl.LOCK_EX)
        self.fd = fd
        return self.path

    def __exit__(self, *exc) -> None:
        try:
            if self.file:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass
            else:
                shutil.rmtree(self.path, ignore_errors=True)
        finally:
            if self.fd is not None:
                os.close(self.fd)
                self.fd = None


def sweep(parent: Path) -> list[Path]:
    """Remove the temporaries in `parent` whose owner is gone (killed mid-build); return them.
    A temporary is its owner's while the owner holds its flock; the pid in its name, alive, keeps
    it too (the moment between making it and locking it; a tree being removed by `remove_entry`)."""
    removed = []
    try:
        names = os.listdir(parent)
    except OSError:
        return removed
    for name in names:
        pid = _owner_pid(name)
        if pid is None:
            continue
        p = Path(parent) / name
        try:
            fd = os.open(p, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
        except OSError:
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                continue  # a live build
            if alive(pid):
                continue  # made a moment ago and not locked yet, or being removed (or a reused pid)
            if os.path.isdir(p) and not os.path.islink(p):
                shutil.rmtree(p, ignore_errors=True)
            else:
                try:
                    os.unlink(p)
                except FileNotFoundError:
                    pass
            removed.append(p)
        finally:
            os.close(fd)
    return removed


def alive(pid: int) -> bool:
    """Whether process `pid` exists (one of another user's counts)."""
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def remove_entry(entry: Path) -> None:
    """Remove `entry` atomically first (renamed to a temporary, then deleted): never a half-removed
    tree under the real name. Call it holding the entry's lock."""
    entry = Path(entry)
    gone = temp_path(entry)
    try:
        os.rename(entry, gone)
    except FileNotFoundError:
        return
    except OSError as e:
        if e.errno not in (errno.EXDEV, errno.EBUSY):
            raise
        gone = entry
    shutil.rmtree(gone, ignore_errors=True) if gone.is_dir() and not gone.is_symlink() else gone.unlink(missing_ok=True)


HOLD = ".hold"


def hold(entry: Path, marker: str) -> Any | None:
    """A shared flock on `entry`/.hold, the mark that this process uses the cache entry (kept
    open: it lasts to the holder's exit; `remove_unheld` skips an entry anyone holds); None if
    `entry` is not there whole (no `marker` file in it) or was removed before the hold was taken."""
    try:
        f = open(Path(entry) / HOLD, "a+")
    except (FileNotFoundError, NotADirectoryError):
        return None
    fcntl.flock(f, fcntl.LOCK_SH)
    try:
        if os.stat(Path(entry) / HOLD).st_ino == os.fstat(f.fileno()).st_ino and (Path(entry) / marker).is_file():
            os.utime(entry)  # recently used
            return f
    except FileNotFoundError:
        pass
    f.close()
    return None


def remove_unheld(entry: Path) -> bool:
    """Remove the cache entry `entry` unless a process holds it (`hold`); whether it went."""
    with Lock(entry):
        try:
            f = open(Path(entry) / HOLD, "a+")
        except (FileNotFoundError, NotADirectoryError):
            return False
        with f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except OSError:
                return False  # in use
            remove_entry(entry)
            return True


# --- atomic files ----------------------------------------------------------------------------------


def write_atomic(path: Path, data: bytes | str, mode: int = 0o600, fsync: bool = False) -> None:
    """Replace `path` with `data` at once (readers see the old file or the new one, never a part)."""
    path = Path(path)
    with Temp(path, file=True) as tmp:
        os.chmod(tmp, mode)
        with open(tmp, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            if fsync:
                f.flush()
                os.fsync(f.fileno())
        os.replace(tmp, path)


# --- building once -------------------------------------------------------------------------------


def build_once(
    entry: Path,
    done: Callable[[Path], bool],
    build: Callable[[Path], None],
    *,
    kind: str,
    key: str,
    cache: Path | None,
    force: bool = False,
    say: Callable[[str], None] | None = None,
) -> bool:
    """Make sure the finished entry `entry` exists; True if this call built it.

    `done(path)` says whether a tree at `path` is finished; `build(tmp)` fills the empty directory
    `tmp`, which is then renamed to `entry` (a leftover at `entry` that is not finished is removed
    first). Concurrent callers for the same entry wait on its lock; all but the first find it
    done. `force`: build again even if it is done (the old entry is replaced). A build is recorded
    in `<cache>/builds.jsonl` (not when `cache` is None). `say`: told when we wait for another
    builder."""
    entry = Path(entry)
    if not force and done(entry):
        return False
    waiting = (lambda: say(f"waiting for another build of {entry.name} (thread or process)")) if say else None
    with Lock(entry, waiting):
        if not force and done(entry):
            return False  # the winner of the race built it while we waited
        sweep(entry.parent)
        t0 = time.monotonic()
        with Temp(entry) as tmp:
            build(tmp)
            if os.path.lexists(entry):
                remove_entry(entry)
            os.rename(tmp, entry)
        seconds = time.monotonic() - t0
    if cache is not None:
        record_build(cache, kind, key, entry, seconds)
    return True


def record_build(cache: Path, kind: str, key: str, path: Path | str, seconds: float) -> None:
    """Append one line to `<cache>/builds.jsonl` in one O_APPEND write (lines never interleave)."""
    line = json.dumps({"kind": kind, "key": key, "path": str(path), "pid": os.getpid(),
                       "seconds": round(seconds, 3), "at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime())})
    try:
        Path(cache).mkdir(parents=True, exist_ok=True)
        fd = os.open(Path(cache) / BUILD_LOG, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError:
        return  # a read-only cache: the build stands, its record is only informative
    try:
        os.write(fd, (line + "\n").encode())
    except OSError:
        pass  # a full disk: likewise
    finally:
        os.close(fd)


def builds(cache: Path) -> list[dict]:
    """The records of `<cache>/builds.jsonl`, oldest first."""
    try:
        text = (Path(cache) / BUILD_LOG).read_text()
    except FileNotFoundError:
        return []
    return [json.loads(line) for line in text.splitlines() if line.strip()]
