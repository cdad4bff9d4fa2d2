"""Templates: a guest paused at its ready point and checkpointed, which sandboxes fork from.

The catalog template "python" is Debian's CPython 3.11 running the in-guest agent
(`guest/agent.py`), paused at the agent's first read of its channel, with its imports done. It is
baked on first use into the cache directory and reused while its inputs (root filesystem, agent
code, engine snapshot format) are unchanged.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from collimate_core.templates import cache as _cache
from collimate_core._core import SNAPSHOT_FORMAT, Vm
from collimate_core.sdk.errors import EngineError, InvalidArgument, NotFoundError

AGENT_DIR = Path(__file__).resolve().parent.parent / "guest"
AGENT_IDLE = 0x6167656E7400
# Bump when the template's contents change shape (agent protocol, mounts, environment, what exec
# maps into a process: 3 added the vDSO, which a template baked before lacks).
TEMPLATE_VERSION = 4
CATALOG = ("python",)
GUEST_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "HOME": "/work",
    "LANG": "C.UTF-8",
}
# The agent interpreter's own settings (the root filesystem is read-only; its output goes out
# unbuffered): set for it alone, never for what an exec runs (the agent drops them at start).
AGENT_ONLY_ENV = {"PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1"}


def agent_env(env: dict[str, str]) -> dict[str, str]:
    """`env` (what commands get) plus the agent-only settings it does not set itself, named in
    COLLIMATE_AGENT_ENV for the agent to drop."""
    extra = {k: v for k, v in AGENT_ONLY_ENV.items() if k not in env}
    return {**env, **extra, "COLLIMATE_AGENT_ENV": ",".join(extra)}


def cache_dir() -> Path:
    """The cache directory: COLLIMATE_CACHE, else $XDG_CACHE_HOME/collimate (one rule for all)."""
    return _cache.cache_dir()


def frame(obj: dict) -> bytes:
    """One message of the agent channel: a 4-byte little-endian length, then JSON."""
    data = json.dumps(obj).encode()
    return len(data).to_bytes(4, "little") + data


def unframe(data: bytes) -> dict | None:
    """The message at the start of `data`, or None if it is not a whole JSON object."""
    if len(data) < 4:
        return None
    try:
        v = json.loads(data[4 : 4 + int.from_bytes(data[:4], "little")])
    except ValueError:
        return None
    return v if isinstance(v, dict) else None


@dataclass
class Baked:
    """A baked template on disk."""

    name: str
    path: Path
    root: Path
    agent: bool
    # Whether the template advertises the seed-ack handshake (its agent acks reseeds). A template
    # that does not gets the verdict "off" on every exec.
    seed_ack: bool = True
    # The disk quota of its sandboxes (None: the client's; see sdk/quota.py).
    disk_quota: int | None = None
    # The shared-memory limit of its sandboxes (None: the client's; see sdk/quota.py).
    shared_memory: int | None = None


class _Progress:
    """A one-line progress display on stderr (only when it is a terminal, or when asked)."""

    def __init__(self, title: str, enabled: bool | None = None):
        self.title = title
        self.enabled = sys.stderr.isatty() if enabled is None else enabled
        self.start = time.monotonic()

    def __call__(self, step: str) -> None:
        if self.enabled:
            t = time.monotonic() - self.start
            sys.stderr.write(f"\r\x1b[2K[{t:6.1f}s] {self.title}: {step[:70]}")
            sys.stderr.flush()

    def done(self) -> None:
        if self.enabled:
            sys.stderr.write(f"\r\x1b[2K[{time.monotonic() - self.start:6.1f}s] {self.title}: ready\n")
            sys.stderr.flush()


def _agent_hash() -> str:
    """The agent's code and where it lives: a template maps the agent's directory read-only at
    /opt/collimate by its host path, so one baked by a collimate installed elsewhere (or before its
    files moved) cannot be restored here."""
    h = hashlib.sha256((AGENT_DIR / "agent.py").read_bytes())
    h.update(str(AGENT_DIR).encode())
    return h.hexdigest()[:16]


MAX_CPUS = 64


def guest_cpus(value: object = None) -> int:
    """How many CPUs a template's sandboxes see: `value`, else COLLIMATE_CPUS, else 1. Fixed at the
    bake (libraries read it once: OpenBLAS sizes its pool when numpy loads), so it is part of the
    template; the threads still take turns on one vCPU (crates/engine/src/guestos/cpu.rs)."""
    what = "cpus"
    if value is None:
        value, what = os.environ.get("COLLIMATE_CPUS") or 1, "COLLIMATE_CPUS"
    try:
        n = int(str(value).strip()) if not isinstance(value, bool) else None
    except ValueError:
        n = None
    if n is None or not 1 <= n <= MAX_CPUS:
        raise InvalidArgument(f"{what}={value!r}: a sandbox sees 1 to {MAX_CPUS} CPUs")
    return n


def _python_index(cache: Path, wanted_root: str | None, recipe: str) -> Baked | None:
    """The template `templates/python.json` names, if it is finished and still what is wanted."""
    try:
        meta = json.loads((cache / "templates" / "python.json").read_text())
        path = Path(meta["path"])
        if (
            meta.get("version") == TEMPLATE_VERSION
            and meta.get("snapshot_format") == SNAPSHOT_FORMAT
            and meta.get("agent") == _agent_hash()
            and meta.get("cpus", 1) == guest_cpus()
            and (path / "vm.state").exists()
            and Path(meta["root"], "usr/bin/python3").exists()
            and (Path(wanted_root) == Path(meta["root"]) if wanted_root else meta.get("recipe") == recipe)
        ):
            return Baked("python", path, Path(meta["root"]), True)
    except (OSError, ValueError, KeyError, TypeError):
        pass
    return None


def agent_dirs(prefix: str = "collimate-bake-") -> Path:
    """A new host directory holding the agent's writable mounts: work, tmp and shm (/dev/shm:
    POSIX semaphores and shared memory). The caller removes it."""
    work = Path(tempfile.mkdtemp(prefix=prefix))
    (work / "work").mkdir()
    for d in ("tmp", "shm"):
        (work / d).mkdir()
        os.chmod(work / d, 0o1777)  # (mkdir's mode is masked by the umask)
    return work


def spawn_agent(root: Path, work: Path, cpus: int = 1, platform: str = "kvm") -> Vm:
    """The catalog agent on `root` with its writable mounts in `work` (`agent_dirs`), spawned and
    not yet run: the argv, environment and mounts of every python template, on either platform."""
    more = {} if platform == "kvm" else {"platform": platform}
    return Vm.spawn(
        root,
        ["/usr/bin/python3", "/opt/collimate/agent.py"],
        env=agent_env(GUEST_ENV),
        cwd="/work",
        mounts={"/work": work / "work", "/tmp": work / "tmp", "/dev/shm": work / "shm"},
        ro_mounts={"/opt/collimate": AGENT_DIR},
        agent=True,
        cpus=cpus,
        **more,
    )


def run_to_idle(vm: Vm, what: str) -> None:
    """Run a spawned agent to its ready point (its first read of the channel), or raise saying
    why it did not get there."""
    r = vm.run(120.0)
    if (r.kind, r.value) != ("yield", AGENT_IDLE):
        raise EngineError(
            f"{what}: the agent did not reach its ready point ({r!r}); "
            f"stderr: {r.stderr[-2000:].decode(errors='replace')}"
        )


def _bake_snapshot(tmp: Path, root: Path, say: Callable[[str], None], cpus: int = 1) -> None:
    """Boot the agent on `root` to its ready point and checkpoint it into `tmp`."""
    say("starting the agent")
    work = agent_dirs()
    try:
        vm = spawn_agent(root, work, cpus)
        try:
            run_to_idle(vm, "baking the python template")
            say("checkpointing")
            vm.snapshot(tmp)
        finally:
            vm.destroy()
    finally:
        shutil.rmtree(work, ignore_errors=True)


def python_root(cache: Path | None = None, progress: Callable[[str], None] | None = None) -> Path:
    """The root filesystem of the catalog "python" template (COLLIMATE_ROOTFS, else the recipe's,
    built on first use): what systrap spawns its agent on (sdk/live.py checkpoints it there)."""
    from collimate_core.templates import rootfs as _rootfs

    wanted = os.environ.get("COLLIMATE_ROOTFS")
    if wanted:
        return Path(wanted)
    bar = _Progress("python root filesystem") if progress is None else None
    root = Path(_rootfs.build_rootfs("python", cache=Path(cache) if cache else cache_dir(), progress=progress or bar))
    if bar:
        bar.done()
    return root


def bake_python(cache: Path | None = None, progress: Callable[[str], None] | None = None) -> Baked:
    """Bake (or find) the catalog "python" template. Many threads and processes may ask at once
    on an empty cache: one builds the root filesystem and one bakes (each under its entry's lock,
    see cache.py); the others wait and use theirs."""
    from collimate_core.templates import rootfs as _rootfs

    cache = Path(cache) if cache else cache_dir()
    # The root filesystem the template must be on: COLLIMATE_ROOTFS if set, else the recipe's
    # (its exact key needs the package archive: the recipe and build version stand for it here).
    wanted_root = os.environ.get("COLLIMATE_ROOTFS")
    recipe = f"{_rootfs.BUILD_VERSION}|{','.join(_rootfs.RECIPES['python'])}"
    found = _python_index(cache, wanted_root, recipe)
    if found is not None:
        return found

    bar = _Progress("baking template python") if progress is None else None
    say = progress or bar
    root = Path(wanted_root or _rootfs.build_rootfs("python", cache=cache, progress=say))
    cpus = guest_cpus()
    key = hashlib.sha256(f"{TEMPLATE_VERSION}|{SNAPSHOT_FORMAT}|{root}|{_agent_hash()}|{cpus}".encode()).hexdigest()[:16]
    path = cache / "templates" / f"python-{key}"
    # A finished template directory is never replaced (sandboxes of other processes map it);
    # only a leftover without vm.state is.
    _cache.build_once(path, lambda p: (p / "vm.state").exists(), lambda tmp: _bake_snapshot(tmp, root, say, cpus),
                      kind="template", key=path.name, cache=cache, say=say)
    # Written whole and renamed (readers see the old index or the new one); concurrent bakers
    # write the same content.
    _cache.write_atomic(cache / "templates" / "python.json", json.dumps(
        {"version": TEMPLATE_VERSION, "snapshot_format": SNAPSHOT_FORMAT, "recipe": recipe,
         "agent": _agent_hash(), "path": str(path), "root": str(root), "cpus": cpus}))
    if bar:
        bar.done()
    return Baked("python", path, root, True)


def bake_catalog(name: str, cache: Path | None = None) -> Baked:
    """The template a client looks up by name: the catalog's, else an image template baked with
    Template.bake (on disk, so it survives a restart), else a container image in the local image
    store (or at a path), baked now under that name (`client.env(ref)` in one step)."""
    if name == "python":
        return bake_python(cache)
    from collimate_core.templates.bake import find_or_bake

    baked = find_or_bake(name, cache)
    if baked is not None:
        return baked
    from collimate_core.templates.oci import default_store

    store = default_store(Path(cache) if cache else cache_dir())
    raise NotFoundError(
        f"no template named {name!r}: the catalog has {', '.join(CATALOG)}; bake your own with Template.bake, "
        f"or put an image named {name!r} in the local image store {store}"
    )
