"""Bring-your-own-image templates: bake a container image into a template that sandboxes fork from.

    handle = Template.bake(client, name="swe-rollout", image="swe-rollout@sha256:...",
                           ready=Ready(code="import torch"), width=64)
    status = handle.wait(timeout=600)          # status.phase: "Live", or "Failed" with status.log
    with client.session(handle) as sess: ...   # forks from the baked ready state

A bake, in a background thread (`handle.wait()` blocks on it; `handle.status()` does not):
  1. resolve the image (a path, or a reference in the local image store; never a registry) and
     verify its digests (oci.py);
  2. unpack its layers into a read-only root filesystem, cached by image id;
  3. check the image: its Entrypoint must exist; find python3 (PATH, /usr/bin) and /bin/sh;
  4. start the in-guest agent in the image: with Python, `guest/image_agent.py` on the image's own
     interpreter (code and command execs, the seed-ack handshake); without, `collimate-exec`, a
     small static helper compiled from `guest/exec_helper.c` on the first such bake (command execs
     only, seed_ack "off"). Both speak agent.py's fd-3 protocol and are mounted at /opt/collimate.
     The agent runs with the image's Env (plus HOME from its User), in its WorkingDir (/work if it
     has none); the image's /work and /tmp contents seed the writable /work and /tmp, and its HOME
     (/root, /home/<user>) is writable too, seeded with the image's (`_writable_home`);
  5. run `Ready(cmd=...)` as a command exec and `Ready(code=...)` in the agent's interpreter; a
     non-zero exit fails the bake. Modules Ready imports are loaded in every clone;
  6. checkpoint the agent at its idle read, check a clone answers, and commit the version;
  7. register it with the client: `client.session(name)`, `client.env(name)`, `Sandbox(name)`.
A failure at any step ends in phase "Failed" with the build log, and removes what the bake made.
On systrap steps 1-5 are the same; the Ready steps run in the booted agent itself (its clone with
the writable root), which is then checkpointed as a systrap snapshot and committed, `template.json`
saying `"platform": "systrap"` (`_Build._live`, sdk/live.py; docs/templates.md, "On systrap").

On disk (`<cache>/templates/images/<name>-<hash>/`): `index.json` names the current version;
`v<N>/` holds `snapshot/` (vm.state, vm.mem, fs/), `template.json` and `build.log`. Re-baking a name
makes version N+1; sandboxes of older versions keep running (each live version holds a shared
flock on `v<N>/.lock`), and unused older versions are pruned by later bakes and deletes.

The image's User is resolved to uid, gid and supplementary groups (from its /etc/passwd and
/etc/group, as docker does) and the agent and everything it runs start as that user: getuid(),
`id`, and the owner of every file they create (files the image seeds /work and /tmp with keep the
image's owners). File modes are not enforced against that user: inside its sandbox a guest may
read and write what a root guest may (the sandbox is the isolation boundary, not the uid).
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import re
import shutil
import subprocess
import tempfile
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from collimate_core.templates import cache as _cachelib  # (_cache is this module's own helper)
from collimate_core.templates import oci as _oci
from collimate_core._core import EngineError as _CoreEngineError
from collimate_core._core import SNAPSHOT_FORMAT, SYSTRAP_SNAPSHOT_FORMAT, Vm
from collimate_core.sdk.errors import (
    CollimateError,
    InvalidArgument,
    NotFoundError,
    PlatformUnavailable,
    SandboxTimeout,
)
from collimate_core.templates.catalog import AGENT_DIR, AGENT_IDLE, CATALOG, Baked, agent_env, cache_dir, guest_cpus
from collimate_core.templates.catalog import frame as _frame
from collimate_core.templates.catalog import unframe as _unframe

# Bump when what a baked version holds changes shape (agent protocol, layout).
FORMAT = 1
AGENT_START_TIMEOUT = 120.0
LOG_OUTPUT_CAP = 64 << 10
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._:/@+-]{0,254}$")
HELPER_SRC = AGENT_DIR / "exec_helper.c"
PHASES = ("Building", "Live", "Failed")

_lock = threading.RLock()
_builds: dict[tuple[str, str], _Build] = {}  # (cache, name) -> the latest build in this process
_sync_locks: dict[tuple[str, str], threading.Lock] = {}
_rootfs_in_use: dict[str, int] = {}  # image id -> in-flight bakes of this process using its tree


class BuildError(CollimateError):
    """A bake failed; the message says which step and why (the full log is on the status)."""


@dataclass(frozen=True)
class Ready:
    """The ready state a template is checkpointed in.

    `cmd`: a command run through the agent before the checkpoint (as a command exec: the image's
    Entrypoint, shell, Env and WorkingDir apply); it must exit 0. What it leaves is files (in /work
    and /tmp): it is a child process, so modules it imports are not kept loaded. `code`: Python run
    in the template's agent, so what it imports and defines is already there in every clone (needs
    Python in the image). Both may be given: `cmd` runs first. `timeout`: seconds for each.
    """

    cmd: str | None = None
    code: str | None = None
    timeout: float = 600.0

    def __post_init__(self) -> None:
        for k in ("cmd", "code"):
            v = getattr(self, k)
            if v is not None and not isinstance(v, str):
                raise InvalidArgument(f"Ready({k}=...) takes a str, not {type(v).__name__}")
        if isinstance(self.timeout, bool) or not (isinstance(self.timeout, (int, float)) and self.timeout > 0):
            raise InvalidArgument(f"Ready(timeout=...) must be a positive number, not {self.timeout!r}")


@dataclass
class TemplateStatus:
    """Where a template (one version of it) is: phase "Building", "Live" or "Failed"."""

    name: str
    version: int | None
    phase: str
    log: str = ""
    error: str | None = None
    image: str = ""
    digest: str | None = None  # the image's manifest digest (docker save: its image id)
    image_id: str | None = None  # the config digest
    agent: str | None = None  # "python" (code and command execs) or "exec" (command execs only)
    seed_ack: str | None = None  # "verified" with the Python agent's handshake, else "off"
    width: int = 1
    user: dict = field(default_factory=dict)  # the image's User, resolved: guests run as it
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    working_dir: str = ""
    env: dict[str, str] = field(default_factory=dict)
    created: float | None = None
    seconds: float | None = None

    @property
    def live(self) -> bool:
        return self.phase == "Live"

    @property
    def failed(self) -> bool:
        return self.phase == "Failed"

    def __str__(self) -> str:
        s = f"template {self.name!r} v{self.version}: {self.phase}"
        return s + (f" ({self.error})" if self.error else "")


@dataclass
class ImageBaked(Baked):
    """A baked image template version, as the client registers it."""

    version: int = 0
    meta: dict = field(default_factory=dict)
    # A shared flock on v<N>/.lock while this version may be in use (see _prune).
    hold: Any = field(default=None, repr=False, compare=False)


# --- the store ---------------------------------------------------------------------------------


def _cache(client: Any = None, cache: str | os.PathLike | None = None) -> Path:
    if cache is not None:
        return Path(cache)
    c = getattr(client, "cache", None)
    return Path(c) if c else cache_dir()


def templates_root(cache: Path) -> Path:
    return Path(cache) / "templates" / "images"


def _tdir(cache: Path, name: str) -> Path:
    safe = re.sub(r"[^A-Za-z0-9._-]", "_", name)[:64]
    return templates_root(cache) / f"{safe}-{hashlib.sha256(name.encode()).hexdigest()[:8]}"


def _check_name(name: Any) -> str:
    if not isinstance(name, str) or not NAME_RE.match(name):
        raise InvalidArgument(
            f"template name must be 1-255 characters of letters, digits and ._:/@+- (starting with a letter or "
            f"digit), not {name!r}"
        )
    if name in CATALOG:
        raise InvalidArgument(f"{name!r} is a catalog template; bake your image under another name")
    return name


def _read_json(p: Path) -> dict | None:
    try:
        v = json.loads(p.read_text())
        return v if isinstance(v, dict) else None
    except (OSError, ValueError):
        return None


def _write_json(p: Path, obj: dict) -> None:
    # Whole or not at all; a killed writer's temporary is swept by _prune (see cache.py).
    _cachelib.write_atomic(p, json.dumps(obj, indent=1) + "\n")


class _NameLock:
    """An exclusive flock on <tdir>/.lock (version numbering, the index, pruning)."""

    def __init__(self, tdir: Path):
        self.tdir = tdir

    def __enter__(self) -> _NameLock:
        while True:
            self.tdir.mkdir(parents=True, exist_ok=True)
            f = open(self.tdir / ".lock", "a+")
            fcntl.flock(f, fcntl.LOCK_EX)
            try:
                if os.stat(self.tdir / ".lock").st_ino == os.fstat(f.fileno()).st_ino:
                    self.f = f
                    return self
            except FileNotFoundError:
                pass
            f.close()  # the directory was pruned while we waited: lock the new one

    def __exit__(self, *exc) -> None:
        self.f.close()


def _versions(tdir: Path) -> list[int]:
    out = []
    for p in tdir.iterdir() if tdir.is_dir() else ():
        m = re.fullmatch(r"\.?v(\d+)(?:\.\d+\.tmp)?", p.name)
        if m:
            out.append(int(m.group(1)))
    return out


def _current(tdir: Path) -> int | None:
    idx = _read_json(tdir / "index.json")
    v = idx.get("current") if idx else None
    return v if isinstance(v, int) else None


def _hold(vdir: Path) -> Any:
    f = open(vdir / ".lock", "a+")
    fcntl.flock(f, fcntl.LOCK_SH)
    return f


def _registered(baked: ImageBaked) -> Any:
    """What the client registers for a committed version: the version itself on kvm, a zygote
    restored from its systrap snapshot on systrap (`sdk/live.py`)."""
    if baked.meta.get("platform") == "systrap":
        from collimate_core.sdk.live import LiveTemplate

        return LiveTemplate.from_image(baked)
    return baked


def load_template(name: str, cache: Path, platform: str = "kvm") -> ImageBaked | None:
    """The current version of image template `name` on disk, or None if there is none. A version
    baked on the other platform (its snapshot cannot run on this one) raises PlatformUnavailable
    saying what to do."""
    tdir = _tdir(cache, name)
    state_file = "systrap.state" if platform == "systrap" else "vm.state"
    while True:
        n = _current(tdir)
        if n is None:
            return None
        vdir = tdir / f"v{n}"
        meta = _read_json(vdir / "template.json")
        if meta and meta.get("name") == name and meta.get("platform", "kvm") != platform:
            if platform == "systrap":
                from collimate_core.sdk.live import image_templates_unavailable

                raise image_templates_unavailable(f"template {name!r}")
            raise PlatformUnavailable(
                f"template {name!r} v{n} was baked on the systrap platform: its snapshot is a systrap one, which a kvm "
                f"sandbox cannot restore; use it with connect(platform='systrap'), or bake it again on this client "
                f"(Template.bake(client, {name!r}, ...)) to have a kvm version"
            )
        if not meta or meta.get("name") != name or not (vdir / "snapshot" / state_file).is_file():
            return None
        wanted = SYSTRAP_SNAPSHOT_FORMAT if platform == "systrap" else SNAPSHOT_FORMAT
        if meta.get("format") != FORMAT or meta.get("snapshot_format") != wanted:
            raise NotFoundError(f"template {name!r} v{n} was baked by another version of collimate; bake it again")
        root = Path(meta["rootfs"])
        if not (root / _oci.MARKER).is_file():
            raise NotFoundError(
                f"template {name!r} v{n}: its root filesystem {root} is gone (cache cleared?); bake it again"
            )
        if meta.get("agent_dir") and not Path(meta["agent_dir"]).is_dir():
            raise NotFoundError(
                f"template {name!r} v{n} maps an agent directory that is gone ({meta['agent_dir']}: baked by a "
                f"collimate installed elsewhere, or an older layout); bake it again"
            )
        try:
            hold = _hold(vdir)
        except FileNotFoundError:
            continue  # pruned (a re-bake made it old) since we read the index: look again
        # A prune that took v<N> an instant before our hold removes it: only a hold on the
        # version's own, still present lock file counts.
        try:
            kept = os.stat(vdir / ".lock").st_ino == os.fstat(hold.fileno()).st_ino
        except FileNotFoundError:
            kept = False
        if kept and (vdir / "snapshot" / state_file).is_file():
            return ImageBaked(name, vdir / "snapshot", root, True, seed_ack=bool(meta.get("handshake")), version=n,
                              meta=meta, hold=hold, disk_quota=meta.get("disk_quota"),
                              shared_memory=meta.get("shared_memory"))
        hold.close()


def _status_from_meta(meta: dict, log: str = "") -> TemplateStatus:
    keys = TemplateStatus.__dataclass_fields__
    st = TemplateStatus(**{k: meta[k] for k in keys if k in meta and k not in ("phase", "log")}, phase="Live")
    st.log = log
    return st


def _prune(cache: Path, tdir: Path | None = None) -> None:
    """Remove what no one uses: template versions other than the current one that no live
    sandbox holds (a shared flock; any process), bakes whose process is gone, and unpacked root
    filesystems no template version refers to."""
    root = templates_root(cache)
    tdirs = [tdir] if tdir is not None else (sorted(root.iterdir()) if root.is_dir() else [])
    for td in tdirs:
        if not td.is_dir():
            continue
        with _NameLock(td):
            _cachelib.sweep(td)  # index.json temporaries of killed writers
            cur = _current(td)
            for p in list(td.iterdir()):
                m = re.fullmatch(r"v(\d+)", p.name)
                if m and int(m.group(1)) != cur:
                    _remove_if_unused(p)
                elif re.fullmatch(r"\.v\d+\.(\d+)\.tmp", p.name):
                    pid = int(p.name.split(".")[2])
                    if not _cachelib.alive(pid):
                        shutil.rmtree(p, ignore_errors=True)
            left = [p for p in td.iterdir() if p.name != ".lock" and not p.name.endswith(".tmp")]
            if not left and not any(p.name.endswith(".tmp") for p in td.iterdir()):
                shutil.rmtree(td, ignore_errors=True)
    _prune_rootfs(cache)


def _remove_if_unused(vdir: Path) -> bool:
    try:
        f = open(vdir / ".lock", "a+")
    except OSError:
        shutil.rmtree(vdir, ignore_errors=True)
        return True
    try:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            return False  # a live sandbox (here or in another process) still uses it
        shutil.rmtree(vdir, ignore_errors=True)
        return True
    finally:
        f.close()


def _rootfs_used(cache: Path) -> set[str]:
    """The image ids (hex) whose unpacked trees a template version or a bake (any process:
    its building.json; this process: _rootfs_in_use) refers to."""
    used: set[str] = set()
    root = templates_root(cache)
    for td in root.iterdir() if root.is_dir() else ():
        for v in td.iterdir() if td.is_dir() else ():
            meta = _read_json(v / "template.json") or _read_json(v / "building.json") or {}
            if meta.get("image_id"):
                used.add(meta["image_id"].split(":", 1)[-1])
    with _lock:
        used |= {k.split(":", 1)[-1] for k, n in _rootfs_in_use.items() if n > 0}
    return used


def _prune_rootfs(cache: Path) -> None:
    rdir = _oci.rootfs_dir(cache)
    if not rdir.is_dir():
        return
    used = _rootfs_used(cache)
    for p in rdir.iterdir():
        if re.fullmatch(r"[0-9a-f]{64}", p.name) and p.name not in used:
            # Decided again under the tree's lock: a bake may have started using it meanwhile.
            _oci.remove_rootfs(cache, "sha256:" + p.name, unused=lambda h=p.name: h not in _rootfs_used(cache))


# --- the exec helper ---------------------------------------------------------------------------


def exec_helper(cache: Path, log=None) -> Path:
    """The directory holding `collimate-exec` (static, built from guest/exec_helper.c with the
    host's C compiler once per source version; cached in <cache>/helpers/)."""
    say = log or (lambda m: None)
    src = HELPER_SRC.read_bytes()
    flags = ["-O2", "-static", "-s", "-Wall"]
    key = hashlib.sha256(src + " ".join(flags).encode()).hexdigest()[:16]
    d = Path(cache) / "helpers" / f"exec-{key}"
    exe = d / "collimate-exec"
    if exe.is_file():
        return d
    cc = os.environ.get("CC") or next((c for c in ("cc", "gcc", "clang") if shutil.which(c)), None)
    if not cc:
        raise BuildError(
            "this image has no Python, so its template runs commands through collimate-exec, a small static helper "
            "built from guest/exec_helper.c; building it needs a C compiler with static libc (apt-get install gcc "
            "libc6-dev), and none was found"
        )
    t0 = time.monotonic()

    def build(tmp: Path) -> None:
        os.chmod(tmp, 0o755)  # mounted into guests, whose user may not be root (a cache entry starts private)
        res = subprocess.run([cc, *flags, "-o", str(tmp / "collimate-exec"), str(HELPER_SRC)],
                             capture_output=True, text=True, check=False)
        if res.returncode != 0:
            raise BuildError(f"building collimate-exec with {cc} failed (exit {res.returncode}):\n"
                             f"{(res.stderr or res.stdout)[-3000:]}")
        # It runs natively too: without arguments it prints its usage and exits 111.
        check = subprocess.run([str(tmp / "collimate-exec")], capture_output=True, text=True, timeout=10, check=False)
        if check.returncode != 111:
            raise BuildError(f"collimate-exec does not run (exit {check.returncode}): {check.stderr[-500:]}")

    # One build however many bakes need it at once (the others wait and use it).
    if _cachelib.build_once(d, lambda p: (p / "collimate-exec").is_file(), build, kind="exec-helper", key=d.name,
                         cache=Path(cache), say=say):
        say(f"built collimate-exec with {cc} in {time.monotonic() - t0:.2f}s")
    return d


# --- one bake ----------------------------------------------------------------------------------


def _copy_owned(src: str, dst: Path) -> None:
    """Copy a directory of the image with its files' owners (when we may: as root)."""
    shutil.copytree(src, dst, symlinks=True)
    if os.geteuid() != 0:
        return
    for dirpath, dirnames, filenames in os.walk(src):
        rel = os.path.relpath(dirpath, src)
        for name in [".", *dirnames, *filenames]:
            st = os.lstat(os.path.join(dirpath, name))
            os.lchown(os.path.normpath(os.path.join(dst, rel, name)), st.st_uid, st.st_gid)


# Largest HOME of an image that becomes writable (it is copied into every sandbox, as /work is).
HOME_COPY_LIMIT = 64 << 20
# Where a HOME is part of the system's tree, never made a writable copy of its own.
_SYSTEM_DIRS = ("/usr", "/etc", "/bin", "/sbin", "/lib", "/lib64", "/opt", "/proc", "/sys", "/dev", "/var", "/srv")


def _writable_home(home: str, tree: Any, say: Any) -> str | None:
    """The image's HOME, if it becomes a writable mount (pip install --user, dotfiles, caches):
    not /, not inside the writable mounts already or a system directory, and small enough to copy
    into each sandbox."""
    home = "/" + home.strip("/") if home.startswith("/") else ""
    if home in ("", "/") or any(home == d or home.startswith(d + "/") for d in ("/work", "/tmp", "/dev/shm", *_SYSTEM_DIRS)):
        return None
    src = tree.resolve(home)
    if src and os.path.isdir(src):
        size = sum(os.lstat(os.path.join(d, f)).st_size for d, _, fs in os.walk(src) for f in fs)
        if size > HOME_COPY_LIMIT:
            say(f"HOME {home} stays read-only: the image has {size >> 20} MiB there (more than "
                f"{HOME_COPY_LIMIT >> 20} MiB to copy into every sandbox)")
            return None
    return home


def _tail(b: bytes) -> str:
    s = b.decode(errors="replace")
    return s if len(s) <= LOG_OUTPUT_CAP else "[...]\n" + s[-LOG_OUTPUT_CAP:]


def _refused_hint(refused: list[dict], policy: Any) -> str:
    """What to add to a failed Ready step's error when the bake's egress policy refused some of
    its network: the likely cause, and the fix."""
    if not refused:
        return ""
    where = sorted({e["name"] or f"{e['address']}:{e['port']}" for e in refused})
    shown = ", ".join(where[:5]) + (f" and {len(where) - 5} more" if len(where) > 5 else "")
    return (f"; the bake's egress policy ({policy if policy is not None else 'Egress.none()'}) refused "
            f"{len(refused)} network request(s) ({shown}): a Ready step that installs or clones needs "
            "Template.bake(..., egress=Egress.allow(...)) naming those servers (docs/egress.md)")


@dataclass
class _Spec:
    name: str
    image: Any
    ready: Ready
    width: int
    cache: Path
    store: Path
    disk_quota: int | None = None
    # The network policy of the bake and its Ready step only (the template's sandboxes start from
    # their own default, no network).
    egress: Any = None
    # How many CPUs its sandboxes see (catalog.guest_cpus).
    cpus: int = 1
    # The shared-memory limit of its sandboxes (None: the client's).
    shared_memory: int | None = None
    # Whether its sandboxes' root stays the image's, read-only (else a copy-up layer makes it writable).
    read_only_root: bool = False
    # "kvm" (a checkpoint) or "systrap" (a live zygote: sdk/live.py).
    platform: str = "kvm"


class _Build:
    """One bake: its log, its outcome, and the work (run in a thread by Template.bake)."""

    def __init__(self, spec: _Spec, on_commit: Any = None):
        self.registered: Any = None  # what the client registers for the committed version (`_commit`)
        self.spec = spec
        self.on_commit = on_commit  # called with the new version under the name's lock (registers it)
        self.lines: list[str] = []
        self.t0 = time.monotonic()
        self.created = time.time()
        self.done = threading.Event()
        self.status = TemplateStatus(spec.name, None, "Building", image=str(spec.image), width=spec.width,
                                     created=self.created)
        self.lock = threading.Lock()
        self.tdir = _tdir(spec.cache, spec.name)
        self.vtmp: Path | None = None
        self.baked: ImageBaked | None = None
        self.egress_logged = 0  # the seq of the next guest egress log entry for the bake's log
        self._reserve()

    def log(self, msg: str) -> None:
        with self.lock:
            for line in str(msg).splitlines() or [""]:
                self.lines.append(f"[{time.monotonic() - self.t0:7.2f}s] {line}")

    def text(self) -> str:
        with self.lock:
            return "\n".join(self.lines) + ("\n" if self.lines else "")

    def snapshot_status(self) -> TemplateStatus:
        with self.lock:
            st = TemplateStatus(**{k: getattr(self.status, k) for k in TemplateStatus.__dataclass_fields__})
        st.log = self.text()
        return st

    def _reserve(self) -> None:
        """Take the next version number (a `.v<N>.<pid>.tmp` directory) under the name's lock."""
        with _NameLock(self.tdir):
            n = max([*_versions(self.tdir), _current(self.tdir) or 0, 0]) + 1
            self.vtmp = self.tdir / f".v{n}.{os.getpid()}.tmp"
            self.vtmp.mkdir(mode=0o700)  # private: vm.mem holds what the Ready step loaded
        self.status.version = n

    # the work ---------------------------------------------------------------------------------

    def run(self) -> ImageBaked:
        """Bake; on failure, remove everything this bake made and raise BuildError."""
        spec, say = self.spec, self.log
        img = None
        image_id = None
        created_rootfs = False
        vm = None
        pre_zygote = None  # with a writable root, the Ready step runs in a clone of it
        workdirs: Path | None = None
        try:
            say(f"baking template {spec.name!r} v{self.status.version} from {spec.image}")
            image = spec.image
            if not isinstance(image, (str, os.PathLike)):  # an Image builder: its layers, as an OCI layout
                try:
                    image = image.layout(spec.cache, say)
                except _oci.ImageError as e:
                    raise BuildError(str(e)) from None
            try:
                img = _oci.resolve(image, spec.store, say)
            except _oci.ImageError as e:
                raise BuildError(str(e)) from None
            image_id = img.id
            with _lock:
                _rootfs_in_use[image_id] = _rootfs_in_use.get(image_id, 0) + 1
            _write_json(self.vtmp / "building.json", {"name": spec.name, "image_id": image_id, "pid": os.getpid()})
            with self.lock:
                self.status.digest, self.status.image_id = img.digest, img.id
            icfg = img.image_config
            try:
                root, created_rootfs = _oci.build_rootfs(img, spec.cache, say)
            except _oci.ImageError as e:
                raise BuildError(str(e)) from None
            finally:
                img.close()
            tree = _oci.Tree(root)

            # What runs, and how.
            try:
                user = _oci.resolve_user(tree, icfg.user)
            except _oci.ImageError as e:
                raise BuildError(str(e)) from None
            env = icfg.env_dict()
            env.setdefault("PATH", _oci.DEFAULT_PATH)
            env.setdefault("HOME", user["home"] or "/")
            workdir = icfg.working_dir or "/work"
            if not workdir.startswith("/"):
                workdir = "/" + workdir
            if icfg.user:
                say(f"User {icfg.user!r} -> uid {user['uid']}, gid {user['gid']}, groups {user['groups']}")
            if icfg.entrypoint:
                prog = tree.find_program(icfg.entrypoint[0], env["PATH"], workdir)
                if prog is None:
                    raise BuildError(
                        f"the image's Entrypoint {icfg.entrypoint} names {icfg.entrypoint[0]!r}, which is not an "
                        f"executable file in the image (looked on PATH={env['PATH']}): every command exec would fail"
                    )
                say(f"Entrypoint {icfg.entrypoint} -> {prog}")
            elif icfg.cmd and tree.find_program(icfg.cmd[0], env["PATH"], workdir) is None:
                say(f"warning: the image's Cmd {icfg.cmd} names {icfg.cmd[0]!r}, which is not in the image; an "
                    "empty command exec will fail")
            python = next(
                (p for p in (tree.find_program("python3", env["PATH"]), tree.find_program("/usr/bin/python3", ""))
                 if p), None)
            shell = "/bin/sh" if tree.find_program("/bin/sh", "") else None
            if spec.ready.code is not None and python is None:
                raise BuildError(
                    "Ready(code=...) runs in the template's Python agent, but the image has no python3 (not on its "
                    f"PATH={env['PATH']}, nor /usr/bin/python3): use Ready(cmd=...)"
                )
            agent_cfg = {"entrypoint": icfg.entrypoint, "cmd": icfg.cmd, "shell": shell}
            spawn_env = env
            if python:
                spawn_env = agent_env(env)  # its own settings, which commands do not inherit
                argv = [python, "/opt/collimate/image_agent.py", json.dumps(agent_cfg)]
                agent_dir = AGENT_DIR
                kind = "python"
            else:
                agent_dir = exec_helper(spec.cache, say)
                e, c = icfg.entrypoint, icfg.cmd
                argv = ["/opt/collimate/collimate-exec", shell or "-", str(len(e)), *e, str(len(c)), *c]
                kind = "exec"
            say(f"agent: {kind} ({argv[0]}), shell: {shell or 'none'}, WorkingDir {workdir}")
            with self.lock:
                self.status.agent = kind
                self.status.seed_ack = "verified" if kind == "python" else "off"
                self.status.user = user
                self.status.entrypoint, self.status.cmd = icfg.entrypoint, icfg.cmd
                self.status.working_dir, self.status.env = workdir, env

            # The writable mounts, seeded with what the image has there.
            workdirs = Path(tempfile.mkdtemp(prefix="collimate-bake-"))
            mounts = {}
            # /dev/shm too: POSIX semaphores and shared memory (multiprocessing.Lock) need it.
            for guest, mode in (("/work", 0o755), ("/tmp", 0o1777), ("/dev/shm", 0o1777)):
                host = workdirs / guest.strip("/").replace("/", "-")
                src = tree.resolve(guest)
                if src and os.path.isdir(src) and os.listdir(src):
                    _copy_owned(src, host)
                    say(f"seeded {guest} with the image's {len(os.listdir(src))} entries")
                else:
                    host.mkdir()
                os.chmod(host, mode)
                mounts[guest] = host
            home = _writable_home(env["HOME"], tree, say)
            if home is not None:
                host = workdirs / "home"
                src = tree.resolve(home)
                if src and os.path.isdir(src):
                    _copy_owned(src, host)
                else:
                    host.mkdir(mode=0o700)
                    if os.geteuid() == 0:
                        os.chown(host, user["uid"], user["gid"])
                mounts[home] = host
                say(f"HOME {home} is writable (the sandbox's own copy of the image's, in its disk quota)")

            if spec.platform == "systrap":
                live = self._live(root, argv, spawn_env, workdir, mounts, agent_dir, user, kind, workdirs,
                                  image_id, icfg, img)
                workdirs = None  # the live template's now (its seed mounts), as is the root's use
                image_id = None
                return live

            # Boot the agent to its idle point, then the ready state.
            try:
                vm = Vm.spawn(root, argv, env=spawn_env, cwd=workdir, mounts=mounts,
                              ro_mounts={"/opt/collimate": agent_dir}, agent=True,
                              uid=user["uid"], gid=user["gid"], groups=user["groups"], cpus=spec.cpus)
            except (_CoreEngineError, ValueError, OSError) as e:
                raise BuildError(f"starting the agent in the image failed: {e}") from None
            self._boot(vm, argv)
            if (spec.ready.cmd is not None or spec.ready.code is not None) and not spec.read_only_root:
                # The Ready step writes where a sandbox would (pip install into /usr/local, files
                # in /etc): in a clone with the writable root, whose copy-up layer the checkpoint keeps.
                pre = self.vtmp / "before-ready"
                vm.snapshot(pre)
                vm.destroy()
                vm = None
                pre_zygote = Vm.restore(pre)
                pre_zygote.set_writable_root(True)
                if spec.disk_quota is not None and pre_zygote.disk_quota is not None:
                    from collimate_core.sdk import quota as _quota

                    pre_zygote.set_disk_quota(spec.disk_quota, _quota.inodes_for(spec.disk_quota))
                vm = pre_zygote.clone()
                say(f"VMM processes {pre_zygote.pid} (the booted agent) and {vm.pid} (its clone for the Ready step)")
                if spec.egress is not None and not spec.egress.is_none:
                    vm.set_egress(spec.egress.rule_strings(), spec.egress.internet_access)
                say("Ready step in a clone with the writable root (what it writes anywhere in the image is kept)")
            self._ready_steps(vm)

            # Checkpoint, and check that a clone of it answers.
            say("checkpointing")
            snap = self.vtmp / "snapshot"
            vm.snapshot(snap)
            vm.destroy()
            vm = None
            if pre_zygote is not None:
                pre_zygote.destroy()
                pre_zygote = None
                shutil.rmtree(self.vtmp / "before-ready", ignore_errors=True)
            with Vm.restore(snap) as zygote:
                if not spec.read_only_root:
                    zygote.set_writable_root(True)
                with zygote.clone() as clone:
                    say(f"VMM processes {zygote.pid} (the checkpoint) and {clone.pid} (its clone)")
                    r = clone.agent_call(_frame({"op": "ping"}), 60.0)
                    if _unframe(r.agent) != {"pong": True}:
                        raise BuildError(f"a clone of the checkpoint did not answer ({r.kind}): "
                                         f"{r.stderr.decode(errors='replace')[-2000:]}")
            size = sum(f.lstat().st_blocks * 512 for f in snap.rglob("*") if f.is_file() and not f.is_symlink())
            say(f"checkpoint {size / 2**20:.1f} MiB on disk; a clone answers")

            return self._commit(root, agent_dir, argv, kind, img)
        except BaseException as e:
            for v in (vm, pre_zygote):
                if v is not None:
                    try:
                        v.destroy()
                    except CollimateError:
                        pass
            if image_id is not None:
                with _lock:
                    _rootfs_in_use[image_id] -= 1
                image_id, gone = None, image_id
            else:
                gone = None
            self._cleanup(gone if created_rootfs else None)
            if isinstance(e, BuildError):
                raise
            if isinstance(e, (CollimateError, OSError)):
                raise BuildError(f"{type(e).__name__}: {e}") from e
            raise
        finally:
            if workdirs is not None:
                shutil.rmtree(workdirs, ignore_errors=True)
            if image_id is not None:
                with _lock:
                    _rootfs_in_use[image_id] -= 1

    def _commit(self, root: Path, agent_dir: Path, argv: list[str], kind: str, img: Any,
                platform: str = "kvm") -> ImageBaked:
        """Commit the checkpoint in `vtmp/snapshot` as version v<N> of the template: its
        template.json, then v<N>/ and index.json, and the client's registration (`on_commit`;
        on systrap a zygote restored from the snapshot, `sdk/live.py`'s `LiveTemplate.from_image`)."""
        spec, say = self.spec, self.log
        # Commit: v<N>/ and index.json.
        n = self.status.version
        with self.lock:
            self.status.seconds = round(time.monotonic() - self.t0, 2)
        meta = {
            **{k: v for k, v in asdict(self.snapshot_status()).items() if k not in ("log", "phase", "error")},
            "format": FORMAT,
            "snapshot_format": SYSTRAP_SNAPSHOT_FORMAT if platform == "systrap" else SNAPSHOT_FORMAT,
            "platform": platform,  # whose snapshot this is (load_template refuses the other's)
            "rootfs": str(root),
            "agent_dir": str(agent_dir),
            "argv": argv,
            "ready": {"cmd": spec.ready.cmd, "code": spec.ready.code},
            "source": str(getattr(img, "source", "")),
            "image_format": getattr(img, "format", ""),
            "handshake": kind == "python",  # the agent acks reseeds (seed_ack "verified")
            "disk_quota": spec.disk_quota,  # its sandboxes' quota (None: the client's)
            "cpus": spec.cpus,  # the CPU count its sandboxes see
            "shared_memory": spec.shared_memory,  # its sandboxes' shared-memory limit (None: the client's)
            "writable_root": not spec.read_only_root,  # a copy-up layer over the image (embedded.py)
        }
        _write_json(self.vtmp / "template.json", meta)
        (self.vtmp / "building.json").unlink(missing_ok=True)
        say(f"live: template {spec.name!r} v{n}")
        (self.vtmp / "build.log").write_text(self.text())
        with _NameLock(self.tdir):
            # The index and the client's registration change together (one bake at a time).
            vdir = self.tdir / f"v{n}"
            self.vtmp.rename(vdir)
            self.vtmp = None
            old_index = _read_json(self.tdir / "index.json")
            try:
                baked = ImageBaked(spec.name, vdir / "snapshot", root, True, seed_ack=kind == "python",
                                   disk_quota=spec.disk_quota, shared_memory=spec.shared_memory, version=n,
                                   meta=meta, hold=_hold(vdir))
                _write_json(self.tdir / "index.json", {"name": spec.name, "current": n})
                registered = _registered(baked)
                if platform == "systrap":
                    self.registered = registered  # for `_live` to return (it takes it from here)
                if self.on_commit is not None:
                    self.on_commit(registered)
                _cachelib.record_build(spec.cache, "image-template", f"{spec.name}@v{n}", vdir,
                                    time.monotonic() - self.t0)
            except BaseException:
                if old_index:
                    _write_json(self.tdir / "index.json", old_index)
                else:
                    (self.tdir / "index.json").unlink(missing_ok=True)
                shutil.rmtree(vdir, ignore_errors=True)
                raise
        return baked

    def _live(self, root: Path, argv: list[str], spawn_env: dict, workdir: str, mounts: dict, agent_dir: Path,
              user: dict, kind: str, workdirs: Path, image_id: str, icfg: Any, img: Any = None) -> Any:
        """The bake on systrap: a live zygote (sdk/live.py) copies the image's seeded writable
        mounts into new directories, spawns the agent on the image's root, boots it and runs the
        Ready steps in it; once a clone of it answers, the zygote is checkpointed (a systrap
        snapshot) and committed to the template store as kvm's versions are (`_commit`), and what
        the client registers is a zygote restored from that snapshot: another process (or client)
        finds the version on disk and restores it without baking again."""
        from collimate_core.sdk.live import LiveTemplate

        spec, say = self.spec, self.log

        def start() -> tuple[Any, Path]:
            work = Path(tempfile.mkdtemp(prefix="collimate-zygote-"))
            vm = None
            try:
                own = {}
                for guest, host in mounts.items():
                    d = work / host.name
                    _copy_owned(str(host), d)
                    own[guest] = d
                try:
                    vm = Vm.spawn(root, argv, env=spawn_env, cwd=workdir, mounts=own,
                                  ro_mounts={"/opt/collimate": agent_dir}, agent=True, uid=user["uid"],
                                  gid=user["gid"], groups=user["groups"], cpus=spec.cpus, platform="systrap")
                except (_CoreEngineError, ValueError, OSError) as e:
                    raise BuildError(f"starting the agent in the image on systrap failed: {e}") from None
                self._boot(vm, argv)
                if not spec.read_only_root:
                    # As on kvm: the writable root is its clones'; so the zygote is a clone of the
                    # booted agent, whose root (the copy-up layer the Ready step writes) its own
                    # clones copy.
                    vm.set_writable_root(True)
                    if spec.disk_quota is not None and vm.disk_quota is not None:
                        from collimate_core.sdk import quota as _quota

                        vm.set_disk_quota(spec.disk_quota, _quota.inodes_for(spec.disk_quota))
                    booted, vm = vm, None
                    try:
                        vm = booted.clone()
                    finally:
                        booted.destroy()
                    if spec.egress is not None and not spec.egress.is_none:
                        vm.set_egress(spec.egress.rule_strings(), spec.egress.internet_access)
                    say(f"VMM process {vm.pid}: a clone of the booted agent with the writable root")
                if spec.ready.cmd is not None or spec.ready.code is not None:
                    say("Ready step in the zygote itself (systrap: its clones start from it as it is after the step)")
                self._ready_steps(vm)
                if spec.egress is not None and not spec.egress.is_none:
                    vm.clear_egress()  # the bake's policy is the bake's: sandboxes start with no network
                return vm, work
            except BaseException:
                if vm is not None:
                    vm.destroy()
                shutil.rmtree(work, ignore_errors=True)
                raise

        # The version directory stays while the template lives: its building.json (image id and
        # this pid) is how a prune in any process sharing the cache sees the unpacked root
        # filesystem in use (`_rootfs_used`); a prune removes it once this process is gone.
        vtmp = self.vtmp

        def released() -> None:
            shutil.rmtree(workdirs, ignore_errors=True)
            if vtmp is not None:
                shutil.rmtree(vtmp, ignore_errors=True)
            with _lock:
                _rootfs_in_use[image_id] -= 1

        state = hashlib.sha256(json.dumps(
            ["collimate/live-image-template/v1", spec.name, image_id, argv, workdir, spawn_env, user, spec.cpus,
             spec.ready.cmd, spec.ready.code, str(agent_dir)], sort_keys=True).encode()).hexdigest()
        live = LiveTemplate.image(spec.name, root, start, state, disk_quota=spec.disk_quota,
                                  shared_memory=spec.shared_memory, seed_ack=kind == "python", on_close=released)
        try:
            say(f"VMM process {live.zygote.pid}: the live zygote (systrap)")
            clone, _ = live.clone()
            with clone:
                r = clone.agent_call(_frame({"op": "ping"}), 60.0)
                if _unframe(r.agent) != {"pong": True}:
                    raise BuildError(f"a clone of the zygote did not answer ({r.kind}): "
                                     f"{r.stderr.decode(errors='replace')[-2000:]}")
            say("a clone answers; checkpointing")
            with live.lock:
                live.zygote.snapshot(self.vtmp / "snapshot")
            self._commit(root, agent_dir, argv, kind, img, platform="systrap")
        except BaseException:
            live._on_close = None  # the bake's cleanup (run's handler) releases the root and mounts
            live.close()
            raise
        live.close()  # the committed version's hold keeps its root filesystem from now on
        registered, self.registered = self.registered, None
        return registered

    def _boot(self, vm: Any, argv: list[str]) -> None:
        """Run a spawned agent (under the bake's egress policy) to its idle read, or raise BuildError."""
        spec, say = self.spec, self.log
        say(f"VMM process {vm.pid}: the agent's boot")
        if spec.egress is not None and not spec.egress.is_none:
            vm.set_egress(spec.egress.rule_strings(), spec.egress.internet_access)
            say(f"egress for the bake and its Ready step: {spec.egress}")
        r = vm.run(AGENT_START_TIMEOUT)
        if (r.kind, r.value) != ("yield", AGENT_IDLE):
            say(f"agent stdout:\n{_tail(r.stdout)}" if r.stdout else "agent stdout: (empty)")
            say(f"agent stderr:\n{_tail(r.stderr)}" if r.stderr else "agent stderr: (empty)")
            how = {"exited": f"exited with status {r.code}", "signaled": f"was killed by signal {r.signal}",
                   "timeout": f"did not get there in {AGENT_START_TIMEOUT:.0f}s"}.get(r.kind, f"stopped: {r.kind}")
            raise BuildError(f"the agent ({argv[0]}) did not reach its ready point: it {how}")
        say(f"agent ready in {r.duration:.2f}s (guest time)")

    def _ready_steps(self, vm: Any) -> None:
        """Run Ready(cmd=...) then Ready(code=...) through the agent; a failure raises BuildError."""
        spec, say = self.spec, self.log
        for what, key, src_text in (("cmd", "command", spec.ready.cmd), ("code", "code", spec.ready.code)):
            if src_text is None:
                continue
            say(f"Ready({what}=...): running {src_text!r}" if len(src_text) < 200 else f"Ready({what}=...)")
            r = vm.agent_call(_frame({"op": "exec", key: src_text}), float(spec.ready.timeout))
            reply = _unframe(r.agent) if (r.kind, r.value) == ("yield", AGENT_IDLE) else None
            if r.stdout:
                say(f"Ready({what}) stdout:\n{_tail(r.stdout)}")
            if r.stderr:
                say(f"Ready({what}) stderr:\n{_tail(r.stderr)}")
            refused = self._log_egress(vm)
            if reply is None or "exit_code" not in reply:
                how = (f"ran out of its {spec.ready.timeout:g}s" if r.kind == "timeout"
                       else f"ended the agent ({r.kind}{f', status {r.code}' if r.code is not None else ''})")
                raise BuildError(f"Ready({what}=...) {how}{_refused_hint(refused, spec.egress)}")
            if reply["exit_code"] != 0:
                raise BuildError(f"Ready({what}=...) exited with status {reply['exit_code']}"
                                 f"{_refused_hint(refused, spec.egress)}")
            say(f"Ready({what}=...) done in {r.duration:.2f}s")

    def _log_egress(self, vm: Any) -> list[dict]:
        """Write the Ready step's new egress log entries to the bake's log (whatever the policy:
        a refusal is how a bake without an allow rule fails); return the refused ones."""
        # By seq, not position: the log keeps the newest 10,000 entries (docs/egress.md).
        entries = [e for e in vm.egress_log() if e["seq"] >= self.egress_logged]
        if entries:
            self.egress_logged = entries[-1]["seq"] + 1
        for e in entries:
            detail = f" ({e['detail']})" if e["verdict"] != "allowed" and e["detail"] else ""
            self.log(f"egress: {e['kind']} {e['name'] or ''} {e['address'] or ''}:{e['port']} {e['verdict']} "
                     f"{e['rule'] or ''} out={e['bytes_out']} in={e['bytes_in']}{detail}")
        return [e for e in entries if e["verdict"] in ("denied", "nxdomain")]

    def _cleanup(self, created_rootfs: str | None) -> None:
        """Leave nothing behind: the version directory, the name's directory if it held only
        this bake, and a root filesystem this bake unpacked that nothing else uses."""
        if self.vtmp is not None:
            shutil.rmtree(self.vtmp, ignore_errors=True)
            self.vtmp = None
        with _NameLock(self.tdir):
            left = [p for p in self.tdir.iterdir() if p.name != ".lock"] if self.tdir.is_dir() else []
            if not left:
                shutil.rmtree(self.tdir, ignore_errors=True)
        if created_rootfs:
            _prune_rootfs(self.spec.cache)  # it is kept if another template or bake uses it

    def finish(self, baked: ImageBaked | None, error: BaseException | None) -> None:
        with self.lock:
            self.status.seconds = round(time.monotonic() - self.t0, 2)
            if error is None:
                self.status.phase = "Live"
            else:
                self.status.phase = "Failed"
                self.status.error = str(error).splitlines()[0] if str(error) else type(error).__name__
        if error is not None:
            self.log(f"FAILED: {error}")
        self.done.set()


# --- the SDK surface ---------------------------------------------------------------------------


class TemplateHandle:
    """A template being baked or baked: `wait()` for it, `status()` to look."""

    def __init__(self, build: _Build | None = None, status: TemplateStatus | None = None, client: Any = None):
        self._build = build
        self._status = status
        self.client = client
        st = self.status()
        self.name: str = st.name
        self.version: int | None = st.version

    @property
    def id(self) -> str:
        return f"{self.name}@v{self.version}"

    def status(self) -> TemplateStatus:
        if self._build is not None:
            return self._build.snapshot_status()
        assert self._status is not None
        return self._status

    @property
    def phase(self) -> str:
        return self.status().phase

    def wait(self, timeout: float | None = None) -> TemplateStatus:
        """Block until the bake ends; its status ("Live", or "Failed" with `.log` and `.error`).
        Raises SandboxTimeout (a TimeoutError) if it is still building after `timeout` seconds."""
        if self._build is not None and not self._build.done.wait(timeout):
            st = self.status()
            tail = "\n".join(st.log.splitlines()[-5:])
            raise SandboxTimeout(f"template {self.name!r} v{self.version} is still building after {timeout:g}s; "
                                 f"the log so far ends with:\n{tail}")
        return self.status()

    def delete(self) -> None:
        Template.delete(self.client, self.name)

    def __repr__(self) -> str:
        return f"TemplateHandle({self.name!r}, v{self.version}, {self.phase})"


def check_bake_args(image: Any, ready: Any, width: Any) -> Ready:
    """Template.bake's arguments, embedded or remote: the Ready to use, or InvalidArgument."""
    if ready is None:
        ready = Ready()
    if not isinstance(ready, Ready):
        raise InvalidArgument(f"ready must be a Ready(cmd=... | code=...), not {ready!r}")
    if isinstance(width, bool) or not isinstance(width, int) or width < 1:
        raise InvalidArgument(f"width must be a positive int, not {width!r}")
    from collimate_core.templates.image import Image

    if isinstance(image, Image):
        return ready
    if not isinstance(image, (str, os.PathLike)) or not str(image).strip():
        raise InvalidArgument(f"image must be an Image, a path or an image reference, not {image!r}")
    return ready


class Template:
    """Bring-your-own-image templates on the embedded engine."""

    @staticmethod
    def bake(
        client: Any,
        name: str,
        image: Any,
        ready: Ready | None = None,
        width: int = 1,
        *,
        store: str | os.PathLike | None = None,
        cache: str | os.PathLike | None = None,
        disk_quota: int | str | None = None,
        egress: Any = None,
        cpus: int | None = None,
        shared_memory: int | str | None = None,
        read_only_root: bool = False,
    ) -> TemplateHandle:
        """Bake `image` into template `name` in the background; returns at once.

        `image`: an `Image` (the SDK's builder: Image.debian_slim().apt_install(...)...), a path to an OCI image layout (directory or archive) or a `docker save` archive
        (optionally `@sha256:<digest>`), or a reference (`name`, `name:tag`, `name@sha256:...`)
        in the local image store `store` (default $COLLIMATE_IMAGES, else <cache>/images/).
        `ready`: what to run before the checkpoint (Ready(cmd=...) and/or Ready(code=...)).
        `width`: how wide you expect to fork (a hint: recorded, and the zygote keeps that many
        clones ready, up to the engine's pool limit, while the template is registered).
        `disk_quota`: bytes (or "512M", "2G") for /tmp and /work together in each of the
        template's sandboxes (default: the client's, 1 GiB).
        `shared_memory`: bytes (or "256M") of shared memory (shared mappings, memfds and /dev/shm
        together) in each of the template's sandboxes (default: the client's, 512 MiB).
        `egress`: the network policy of the bake and its Ready step (e.g. a package index to install
        from); the template's sandboxes then start from their own default, no network.
        `cpus`: how many CPUs its sandboxes see (sched_getaffinity, os.cpu_count(), /proc/cpuinfo;
        default COLLIMATE_CPUS, else 1), fixed at the bake since libraries read it once (OpenBLAS
        sizes its pool when numpy loads). The threads still take turns on one vCPU: a count above 1
        only makes thread pools start more workers.
        `read_only_root`: keep the sandboxes' root filesystem the image's, read-only (EROFS outside
        /tmp, /work, /dev/shm and HOME). By default it is writable as in a container: writes land
        in a copy-up layer in the sandbox's disk quota (docs/templates.md, "The writable root").
        """
        from collimate_core.sdk import egress as _egress
        from collimate_core.sdk import quota as _quota

        policy = _egress.coerce(egress)  # bad rules raise before anything is baked
        quota = _quota.disk_quota(disk_quota) if disk_quota is not None else None
        shm = _quota.shared_memory(shared_memory, getattr(client, "memory_budget", None)) if shared_memory is not None else None
        ncpus = guest_cpus(cpus)
        if client is None:
            from collimate_core.sdk.client import connect

            client = connect()
        if getattr(client, "_remote_templates", None) is not None:  # a RemoteClient: over HTTP (sdk/remote.py)
            if disk_quota is not None:
                raise InvalidArgument(
                    "Template.bake(disk_quota=...) is for the embedded engine; over HTTP the server's --disk-quota "
                    "applies, and each sandbox may ask for less (Sandbox(..., disk_quota=...))"
                )
            if shared_memory is not None:
                raise InvalidArgument(
                    "Template.bake(shared_memory=...) is for the embedded engine; over HTTP the server's "
                    "--shared-memory applies, and each sandbox may ask for less (Sandbox(..., shared_memory=...))"
                )
            if cpus is not None:
                raise InvalidArgument("Template.bake(cpus=...) is for the embedded engine")
            if not isinstance(image, (str, os.PathLike)):
                raise InvalidArgument(
                    "Template.bake over HTTP takes an image reference in the server's image store: write the Image "
                    "there with image.export_oci(path) and pass its name"
                )
            return client._remote_templates.bake(name, image, ready, width, store=store, cache=cache, egress=policy,
                                                 read_only_root=bool(read_only_root))
        if not hasattr(client, "register_template"):
            raise InvalidArgument("Template.bake needs the embedded engine (connect() without an API key)")
        platform = getattr(client, "platform", "kvm")
        _check_name(name)
        ready = check_bake_args(image, ready, width)
        c = _cache(client, cache)
        spec = _Spec(name, image, ready, width, c, Path(store) if store else _oci.default_store(c), quota, policy, ncpus,
                     shared_memory=shm, read_only_root=bool(read_only_root), platform=platform)
        def register(baked: ImageBaked) -> None:
            client.register_template(name, baked)
            if width > 1 and hasattr(client, "expect_width"):
                client.expect_width(name, width)

        build = _Build(spec, register)
        with _lock:
            _builds[(str(c), name)] = build

        def work() -> None:
            baked, error = None, None
            try:
                baked = build.run()
                try:
                    _prune(c)  # older versions no sandbox uses any more
                except OSError as e:
                    build.log(f"warning: pruning old versions: {e}")
            except BaseException as e:  # noqa: BLE001 - reported on the status
                error = e
            finally:
                build.finish(baked, error)

        threading.Thread(target=work, name=f"collimate-bake-{name}", daemon=True).start()
        return TemplateHandle(build, client=client)

    @staticmethod
    def list(client: Any = None, *, cache: str | os.PathLike | None = None) -> list[TemplateStatus]:
        """Every image template: live ones on disk and this process's bakes in progress."""
        if getattr(client, "_remote_templates", None) is not None:
            return client._remote_templates.list()
        c = _cache(client, cache)
        out: dict[str, TemplateStatus] = {}
        root = templates_root(c)
        for td in sorted(root.iterdir()) if root.is_dir() else ():
            idx = _read_json(td / "index.json")
            if not idx or not isinstance(idx.get("current"), int):
                continue
            meta = _read_json(td / f"v{idx['current']}" / "template.json")
            if meta and meta.get("name") == idx.get("name"):
                out[meta["name"]] = _status_from_meta(meta)
        with _lock:
            builds = [b for (cc, _), b in _builds.items() if cc == str(c) and not b.done.is_set()]
        for b in builds:
            if b.spec.name not in out:
                out[b.spec.name] = b.snapshot_status()
        return [out[k] for k in sorted(out)]

    @staticmethod
    def get(client: Any, name: str, *, cache: str | os.PathLike | None = None) -> TemplateHandle:
        """The handle of template `name`: its bake in progress in this process, else its current
        version on disk. NotFoundError if there is neither."""
        if getattr(client, "_remote_templates", None) is not None:
            return client._remote_templates.get(name)
        c, b = _local_build(client, cache, name)
        if b is not None and not b.done.is_set():
            return TemplateHandle(b, client=client)
        tdir = _tdir(c, name)
        n = _current(tdir)
        meta = _read_json(tdir / f"v{n}" / "template.json") if n is not None else None
        if not meta:
            if b is not None:  # a failed bake of this process: its status and log
                return TemplateHandle(b, client=client)
            raise NotFoundError(f"no image template named {name!r}")
        log = ""
        try:
            log = (tdir / f"v{n}" / "build.log").read_text()
        except OSError:
            pass
        return TemplateHandle(status=_status_from_meta(meta, log), client=client)

    @staticmethod
    def delete(client: Any, name: str, *, cache: str | os.PathLike | None = None) -> None:
        """Delete template `name`: no new sandboxes; live ones keep running, and its files go when
        the last of them ends (at a later bake or delete). NotFoundError if there is no such template."""
        if getattr(client, "_remote_templates", None) is not None:
            return client._remote_templates.delete(name)
        c, b = _local_build(client, cache, name)
        if b is not None and not b.done.is_set():
            raise InvalidArgument(f"template {name!r} is still building; wait for it, then delete it")
        tdir = _tdir(c, name)
        registered = False
        if client is not None and hasattr(client, "unregister_template"):
            registered = client.unregister_template(name)
        if not tdir.is_dir() and not registered:
            raise NotFoundError(f"no image template named {name!r}")
        if tdir.is_dir():
            with _NameLock(tdir):
                (tdir / "index.json").unlink(missing_ok=True)
        _prune(c)
        with _lock:
            _builds.pop((str(c), name), None)


def _local_build(client: Any, cache: str | os.PathLike | None, name: str) -> tuple[Path, Any]:
    """The cache template `name` lives in for `client`, and this process's bake of it there (done
    or not; None if this process never baked it)."""
    c = _cache(client, cache)
    with _lock:
        return c, _builds.get((str(c), name))


# --- catalog images: client.env(ref) bakes in one step -----------------------------------------


def find_or_bake(name: str, cache: Path | None, platform: str = "kvm") -> Any:
    """For the client's template lookup: image template `name` on disk; else, if `name` is an
    image (a path, or a reference in the local image store), bake it now under that name (no Ready
    step) and return it; None if it is neither. An image reference that would need a registry pull
    raises NotFoundError saying how to provide the image. On systrap the version on disk is a
    systrap snapshot (`_find_or_bake_live`); a version of the other platform is refused (its
    snapshot cannot run there)."""
    c = Path(cache) if cache else cache_dir()
    if platform == "systrap":
        return _find_or_bake_live(name, c)
    baked = load_template(name, c)
    if baked is not None:
        return baked
    with _lock:
        b = _builds.get((str(c), name))
        lk = _sync_locks.setdefault((str(c), name), threading.Lock())
    if b is not None and not b.done.is_set():
        raise NotFoundError(f"template {name!r} is still building; wait for its handle (handle.wait()) first")
    store = _oci.default_store(c)
    try:
        ref = _oci.parse_reference(name) if not name.startswith(("/", ".", "~")) else None
    except _oci.ImageError:
        return None
    # One bake of the image, however many threads (lk) and processes (the flock) ask at once:
    # the others wait here, then find the version it committed.
    with lk, _cachelib.Lock(_tdir(c, name)):
        baked = load_template(name, c)  # a concurrent caller may have baked it meanwhile
        if baked is not None:
            return baked
        if not _image_in_store(name, ref, store):
            return None
        build = _Build(_Spec(name, name, Ready(), 1, c, store, cpus=guest_cpus()))
        try:
            baked = build.run()
        except BuildError as e:
            build.finish(None, e)
            raise BuildError(f"baking image {name!r} failed: {e}\n--- build log ---\n{build.text()}") from None
        build.finish(baked, None)
        _prune(c)
        return baked


def _image_in_store(name: str, ref: Any, store: Any) -> bool:
    """Whether `name` (parsed as `ref`, None for a path) resolves to an image in `store`. False
    for a plain name the store lacks (it may be a catalog template); NotFoundError, saying why, for
    a path, or a reference with a registry or a digest, that does not resolve."""
    try:
        _oci.resolve(name, store).close()
    except _oci.ImageError as e:
        if ref is not None and (ref.registry or ref.digest):
            raise NotFoundError(f"no template named {name!r}, and {e}") from None
        if ref is None:
            raise NotFoundError(str(e)) from None
        return False
    return True


def _find_or_bake_live(name: str, c: Path) -> Any:
    """find_or_bake on systrap: image template `name` on disk (a version baked on systrap: its
    zygote restored from the snapshot; one baked on kvm is refused), else `name` as an image,
    baked now, else None."""
    from collimate_core.sdk.live import LiveTemplate

    baked = load_template(name, c, platform="systrap")
    if baked is not None:
        return LiveTemplate.from_image(baked)
    store = _oci.default_store(c)
    try:
        ref = _oci.parse_reference(name) if not name.startswith(("/", ".", "~")) else None
    except _oci.ImageError:
        return None
    if not _image_in_store(name, ref, store):
        return None
    with _lock:
        lk = _sync_locks.setdefault((str(c), name), threading.Lock())
    # One bake however many threads and processes ask at once (as find_or_bake on kvm).
    with lk, _cachelib.Lock(_tdir(c, name)):
        baked = load_template(name, c, platform="systrap")
        if baked is not None:
            return LiveTemplate.from_image(baked)
        return _bake_live_now(name, c, store)


def _bake_live_now(name: str, c: Path, store: Any) -> Any:
    build = _Build(_Spec(name, name, Ready(), 1, c, store, cpus=guest_cpus(), platform="systrap"))
    try:
        live = build.run()
    except BuildError as e:
        build.finish(None, e)
        raise BuildError(f"baking image {name!r} failed: {e}\n--- build log ---\n{build.text()}") from None
    build.finish(live, None)
    return live
