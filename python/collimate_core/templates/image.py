"""`Image`: a container image built in Python, step by step, on this host (docs/templates.md).

    image = (Image.debian_slim()
             .apt_install("git", "make")
             .pip_install("pytest==8.3.4")
             .add_local_dir("./project", "/work/project")
             .env({"PYTHONHASHSEED": "0"})
             .workdir("/work/project"))
    Template.bake(client, name="swe", image=image)      # or image.export_oci("./swe-oci")

Each step but env/workdir makes one layer, a deterministic tar kept in `<cache>/image-layers/<key>/`
under a key that hashes what the layer is made of (resolved Debian package versions, the pip
requirements and options, the bytes of local files), never which image it belongs to: two images
with the same step share its layer, and a second build makes nothing. Once its layers are cached,
an image builds with no network at all.

- Debian packages: their Depends closure minus what the layers below already hold, fetched with
  `apt-get download` (kept in the same .deb cache as the root filesystems) and unpacked with
  `dpkg -x`: no maintainer script runs (rootfs.py's rules, whose resolver this reuses).
- PyPI: `pip wheel` on the host (sdists are built here, with this host's Python, which must be the
  image's minor version), then each wheel unpacked into /usr/local/lib/python3.X/dist-packages
  and its scripts into /usr/local/bin with the image's /usr/bin/python3 as interpreter.
- Local files and directories, copied as they are (modes kept, owner root, fixed times).

`export_oci(path)` writes an OCI image layout (uncompressed layers), which is also what
`Template.bake(image=Image...)` bakes from (through `<cache>/image-builds/<digest>/`).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterable

from collimate_core.sdk.errors import InvalidArgument
from collimate_core.templates import cache as _cache
from collimate_core.templates import rootfs as _rootfs
from collimate_core.templates.oci import ImageError

# Bump when a layer's recipe changes, so that older layers are not reused.
LAYER_VERSION = 1
# Every file of a layer gets this mtime: the same inputs give the same bytes, hence the same digest.
LAYER_MTIME = 1_700_000_000
LAYER_DONE = "layer.json"
LAYER_TAR = "layer.tar"
MEDIA_LAYER = "application/vnd.oci.image.layer.v1.tar"
MEDIA_CONFIG = "application/vnd.oci.image.config.v1+json"
MEDIA_MANIFEST = "application/vnd.oci.image.manifest.v1+json"
MEDIA_INDEX = "application/vnd.oci.image.index.v1+json"
USRMERGE = ("bin", "sbin", "lib", "lib32", "lib64", "libx32")

Say = Callable[[str], None]


class ImageBuildError(ImageError):
    """A step of an Image could not be built (the message says which and what to do)."""


@dataclass(frozen=True)
class _Step:
    kind: str  # base, apt, pip, file, dir
    args: tuple


@dataclass(frozen=True)
class BuiltLayer:
    """One layer in the cache: its tar, its digest (of the uncompressed tar, so also its diff_id)."""

    key: str
    path: Path
    digest: str
    size: int
    what: str


@dataclass(frozen=True)
class BuiltImage:
    layers: tuple[BuiltLayer, ...]
    config: dict

    def config_bytes(self) -> bytes:
        return json.dumps(self.config, sort_keys=True, separators=(",", ":")).encode()

    def manifest_bytes(self) -> bytes:
        cfg = self.config_bytes()
        manifest = {
            "schemaVersion": 2,
            "mediaType": MEDIA_MANIFEST,
            "config": {"mediaType": MEDIA_CONFIG, "digest": _digest(cfg), "size": len(cfg)},
            "layers": [{"mediaType": MEDIA_LAYER, "digest": l.digest, "size": l.size} for l in self.layers],
        }
        return json.dumps(manifest, sort_keys=True, separators=(",", ":")).encode()

    @property
    def digest(self) -> str:
        """The image's manifest digest (what `name@sha256:...` pins)."""
        return _digest(self.manifest_bytes())


class Image:
    """A container image described step by step; every method returns a new Image.

    Start from `Image.debian_slim()` (Debian 12 with its CPython 3.11, busybox, bash and tar: the
    python template's root filesystem, without Debian's EXTERNALLY-MANAGED marker, so that pip
    installs as in Python's official images). Nothing is built until `build`, `export_oci` or
    `Template.bake(image=...)` asks.
    """

    def __init__(self, _steps: tuple[_Step, ...] = (), _env: tuple[tuple[str, str], ...] = (), _workdir: str = ""):
        self._steps = _steps
        self._env = _env
        self._workdir = _workdir

    def _with(self, step: _Step | None = None, **kw: Any) -> "Image":
        steps = self._steps + ((step,) if step is not None else ())
        return Image(steps, kw.get("env", self._env), kw.get("workdir", self._workdir))

    # --- bases ---------------------------------------------------------------------------------

    @staticmethod
    def debian_slim(python_version: str | None = None) -> "Image":
        """Debian 12 (bookworm) with Debian's CPython 3.11 as python3, busybox, bash, tar, zip."""
        if python_version not in (None, "3.11"):
            raise InvalidArgument(
                f"debian_slim(python_version={python_version!r}): this base has Debian 12's CPython 3.11 only; "
                "for another Python, bake an OCI image that has it (Template.bake(image='path/or/ref'))"
            )
        return Image((_Step("base", ("python",)),))

    # --- steps -----------------------------------------------------------------------------------

    def apt_install(self, *packages: str) -> "Image":
        """Debian packages and their Depends (not Recommends), unpacked without maintainer scripts."""
        names = _strings(packages, "apt_install")
        bad = [p for p in names if not p or p.startswith("-") or any(c.isspace() for c in p)]
        if bad:
            raise InvalidArgument(f"apt_install: not package names: {bad!r}")
        return self._with(_Step("apt", tuple(names)))

    def pip_install(
        self,
        *requirements: str,
        find_links: str | os.PathLike | Iterable[str | os.PathLike] = (),
        index_url: str | None = None,
        extra_index_url: str | None = None,
        offline: bool = False,
        pre: bool = False,
    ) -> "Image":
        """PyPI packages (with their dependencies), built into wheels on this host and installed
        into /usr/local/lib/python3.11/dist-packages. A requirement may be a local path (an sdist,
        a wheel, a project directory). `find_links`: directories of wheels and sdists to take
        packages from; `offline=True`: only from there (no index at all). Pin versions for a
        reproducible image: a cached layer is reused for the same requirement strings."""
        # A local path (sdist, wheel, project directory) is taken as it is now, wherever the
        # build runs from.
        reqs = [str(Path(r).resolve()) if os.path.exists(r) else r for r in _strings(requirements, "pip_install")]
        links = [find_links] if isinstance(find_links, (str, os.PathLike)) else list(find_links)
        links = [str(Path(p).resolve()) for p in links]
        local = tuple(sorted(_file_digest(Path(r)) for r in reqs if os.path.exists(r)))
        return self._with(_Step("pip", (tuple(reqs), tuple(links), index_url, extra_index_url, offline, pre, local)))

    def add_local_file(self, local_path: str | os.PathLike, remote_path: str, mode: int | None = None) -> "Image":
        """Copy one host file to the absolute `remote_path` (its mode, or `mode`)."""
        src = Path(local_path)
        if not src.is_file():
            raise InvalidArgument(f"add_local_file: {src} is not a file")
        return self._with(_Step("file", (str(src.resolve()), _remote(remote_path), mode)))

    def add_local_dir(self, local_path: str | os.PathLike, remote_path: str, ignore: Iterable[str] = ()) -> "Image":
        """Copy a host directory's contents to the absolute `remote_path` (symlinks as links).
        `ignore`: names to leave out wherever they occur (".git", "__pycache__")."""
        src = Path(local_path)
        if not src.is_dir():
            raise InvalidArgument(f"add_local_dir: {src} is not a directory")
        return self._with(_Step("dir", (str(src.resolve()), _remote(remote_path), tuple(sorted(ignore)))))

    def env(self, vars: dict[str, str]) -> "Image":
        """Environment variables of every process the image runs (PATH too, if given)."""
        if not isinstance(vars, dict) or not all(isinstance(k, str) and k and "=" not in k for k in vars):
            raise InvalidArgument(f"env takes a dict of names to values, not {vars!r}")
        merged = dict(self._env)
        merged.update({k: str(v) for k, v in vars.items()})
        return self._with(env=tuple(merged.items()))

    def workdir(self, path: str) -> "Image":
        """The working directory of the image's processes (and of a sandbox's execs)."""
        return self._with(workdir=_remote(path))

    # --- building --------------------------------------------------------------------------------

    def build(self, cache: str | os.PathLike | None = None, progress: Say | None = None, force: bool = False) -> BuiltImage:
        """Build (or find in the cache) every layer; return them with the image's config."""
        say = progress or (lambda msg: None)
        c = Path(cache) if cache is not None else _cache.cache_dir()
        if not self._steps or self._steps[0].kind != "base":
            raise InvalidArgument("an Image starts from a base: Image.debian_slim()")
        ctx = _Context(c, say, force)
        layers = tuple(_build_step(ctx, s) for s in self._steps)
        env = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"}
        env.update(dict(self._env))
        config = {
            "architecture": "amd64",
            "os": "linux",
            "config": {"Env": [f"{k}={v}" for k, v in env.items()], **({"WorkingDir": self._workdir} if self._workdir else {})},
            "rootfs": {"type": "layers", "diff_ids": [l.digest for l in layers]},
            "history": [{"created_by": f"collimate Image: {l.what}"} for l in layers],
        }
        return BuiltImage(layers, config)

    def export_oci(self, path: str | os.PathLike, *, cache: str | os.PathLike | None = None,
                   tag: str = "latest", progress: Say | None = None) -> Path:
        """Build, and write the image as an OCI image layout directory at `path` (made if missing;
        blobs already there are kept). Returns `path`."""
        built = self.build(cache, progress)
        return write_layout(built, Path(path), tag)

    def layout(self, cache: str | os.PathLike | None = None, progress: Say | None = None) -> Path:
        """The image as an OCI layout in the cache (`<cache>/image-builds/<digest>/`), for a bake."""
        c = Path(cache) if cache is not None else _cache.cache_dir()
        built = self.build(c, progress)
        dest = c / "image-builds" / built.digest.split(":", 1)[1][:32]
        _cache.build_once(
            dest, lambda p: (p / "index.json").is_file(), lambda tmp: write_layout(built, tmp, "latest", link=True),
            kind="image", key=dest.name, cache=c, say=progress,
        )
        return dest

    def __repr__(self) -> str:
        parts = []
        for s in self._steps:
            if s.kind == "base":
                parts.append("Image.debian_slim()")
            elif s.kind == "apt":
                parts.append(f".apt_install({', '.join(map(repr, s.args))})")
            elif s.kind == "pip":
                parts.append(f".pip_install({', '.join(map(repr, s.args[0]))})")
            elif s.kind == "file":
                parts.append(f".add_local_file({s.args[0]!r}, {s.args[1]!r})")
            else:
                parts.append(f".add_local_dir({s.args[0]!r}, {s.args[1]!r})")
        if self._env:
            parts.append(f".env({dict(self._env)!r})")
        if self._workdir:
            parts.append(f".workdir({self._workdir!r})")
        return "".join(parts) or "Image()"


# --- the steps -------------------------------------------------------------------------------------


@dataclass
class _Context:
    cache: Path
    say: Say
    force: bool
    base_packages: frozenset = frozenset()
    python_version: str = "3.11"


def _build_step(ctx: _Context, step: _Step) -> BuiltLayer:
    if step.kind == "base":
        root = _rootfs.build_rootfs(step.args[0], ctx.cache, ctx.say)
        manifest = json.loads((root / _rootfs.MANIFEST).read_text())
        ctx.base_packages = frozenset(p["name"] for p in manifest["packages"])
        ctx.python_version = ".".join(str(manifest["python_version"]).split(".")[:2])
        def fill_base(d: Path) -> None:
            _copy_tree(root, d)
            # As Python's official images: pip installs without --break-system-packages (PEP 668's
            # marker is Debian's, for a system whose Python apt manages; an image's is the user's).
            for marker in d.glob("usr/lib/python3*/EXTERNALLY-MANAGED"):
                marker.unlink()

        return _layer(ctx, ("base", root.name, "no-EXTERNALLY-MANAGED"), f"Debian 12 base ({root.name})", fill_base)
    if step.kind == "apt":
        return _apt_layer(ctx, step.args)
    if step.kind == "pip":
        return _pip_layer(ctx, *step.args)
    if step.kind == "file":
        src, remote, mode = step.args
        def fill(d: Path) -> None:
            dst = d / remote.lstrip("/")
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            if mode is not None:
                os.chmod(dst, mode)
        return _layer(ctx, ("file", _file_digest(Path(src)), remote, mode), f"add {src} at {remote}", fill)
    src, remote, ignore = step.args
    def fill_dir(d: Path) -> None:
        dst = d / remote.lstrip("/")
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copytree(src, dst, symlinks=True, ignore=shutil.ignore_patterns(*ignore) if ignore else None)
    return _layer(ctx, ("dir", _tree_digest(Path(src), ignore), remote), f"add {src} at {remote}", fill_dir)


def _apt_layer(ctx: _Context, packages: tuple[str, ...]) -> BuiltLayer:
    try:
        names, excluded = _rootfs._closure(packages)
        names = [n for n in names if n not in ctx.base_packages]
        info = _rootfs._package_info(names) if names else []
    except _rootfs.RootfsError as e:
        raise ImageBuildError(
            f"apt_install{packages!r}: {e}\n(unknown names, or stale package lists: run `apt-get update`)"
        ) from None
    key = ("apt", tuple((p["name"], p["version"], p["arch"]) for p in info))

    def fill(d: Path) -> None:
        try:
            debs = _rootfs._download(info, _cache.deb_dir(ctx.cache), ctx.say)
        except _rootfs.RootfsError as e:
            raise ImageBuildError(f"apt_install{packages!r}: {e}") from None
        for deb in debs:
            ctx.say(f"dpkg -x {deb.name}")
            _run(["dpkg", "-x", str(deb), str(d)], f"dpkg -x {deb.name}")
        _usrmerge(d)

    what = f"apt_install {' '.join(packages)} ({len(info)} packages)"
    return _layer(ctx, key, what, fill)


def _pip_layer(ctx: _Context, reqs, links, index_url, extra_index_url, offline, pre, local) -> BuiltLayer:
    host = f"{sys.version_info[0]}.{sys.version_info[1]}"
    if host != ctx.python_version:
        raise ImageBuildError(
            f"pip_install builds wheels with this host's Python ({host}); the image's is {ctx.python_version}: "
            f"build the image from a Python {ctx.python_version} interpreter"
        )
    listing = tuple(sorted((str(p), tuple(sorted(os.listdir(p))) if os.path.isdir(p) else ()) for p in links))
    key = ("pip", reqs, listing, index_url, extra_index_url, offline, pre, local, host)

    def fill(d: Path) -> None:
        site = d / "usr" / "local" / "lib" / f"python{ctx.python_version}" / "dist-packages"
        with tempfile.TemporaryDirectory(prefix="collimate-pip-") as tmp:
            wheels = Path(tmp) / "wheels"
            cmd = [sys.executable, "-m", "pip", "wheel", "--disable-pip-version-check", "-q", "-w", str(wheels)]
            for link in links:
                cmd += ["--find-links", link]
            if offline:
                cmd.append("--no-index")
            if index_url:
                cmd += ["--index-url", index_url]
            if extra_index_url:
                cmd += ["--extra-index-url", extra_index_url]
            if pre:
                cmd.append("--pre")
            ctx.say(f"pip wheel {' '.join(reqs)}")
            _run(cmd + list(reqs), "pip wheel " + " ".join(reqs))
            found = sorted(wheels.glob("*.whl"))
            ctx.say(f"install {len(found)} wheels: {', '.join(w.name for w in found)}")
            _run([sys.executable, "-m", "pip", "install", "--disable-pip-version-check", "-q", "--no-index",
                  "--no-deps", "--no-compile", "--no-warn-script-location", "--target", str(site),
                  *map(str, found)], "pip install --target")
        scripts = site / "bin"
        if scripts.is_dir():
            dest = d / "usr" / "local" / "bin"
            dest.mkdir(parents=True, exist_ok=True)
            for s in sorted(scripts.iterdir()):
                _retarget_script(s, dest / s.name)
            shutil.rmtree(scripts)

    return _layer(ctx, key, f"pip_install {' '.join(reqs)}", fill)


def _retarget_script(src: Path, dst: Path) -> None:
    """A console script pip wrote for this host's interpreter, pointed at the image's python3."""
    data = src.read_bytes()
    if data.startswith(b"#!"):
        first, nl, rest = data.partition(b"\n")
        if b"python" in first:
            data = b"#!/usr/bin/python3" + nl + rest
    dst.write_bytes(data)
    os.chmod(dst, 0o755)


def _usrmerge(d: Path) -> None:
    """Debian 12 packages ship files under /bin, /lib, ...; the base has those as links into /usr
    (usrmerge), and a layer's directory there would replace the link: move them under /usr."""
    for name in USRMERGE:
        top = d / name
        if top.is_dir() and not top.is_symlink():
            _merge(top, d / "usr" / name)


def _merge(src: Path, dst: Path) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    for e in sorted(src.iterdir()):
        t = dst / e.name
        if e.is_dir() and not e.is_symlink() and t.is_dir() and not t.is_symlink():
            _merge(e, t)
        else:
            if os.path.lexists(t):
                if t.is_dir() and not t.is_symlink():
                    shutil.rmtree(t)
                else:
                    t.unlink()
            e.rename(t)
    shutil.rmtree(src)


def _copy_tree(src: Path, dst: Path) -> None:
    for e in sorted(src.iterdir()):
        if e.name == _rootfs.MANIFEST:
            continue
        if e.is_dir() and not e.is_symlink():
            shutil.copytree(e, dst / e.name, symlinks=True)
        else:
            shutil.copy2(e, dst / e.name, follow_symlinks=False)
    shutil.copy2(src / _rootfs.MANIFEST, dst / _rootfs.MANIFEST)


# --- layers in the cache ---------------------------------------------------------------------------


def _layer(ctx: _Context, key_parts: tuple, what: str, fill: Callable[[Path], None]) -> BuiltLayer:
    key = hashlib.sha256(json.dumps([LAYER_VERSION, *key_parts], default=str).encode()).hexdigest()[:32]
    entry = ctx.cache / "image-layers" / key
    done = lambda p: (p / LAYER_DONE).is_file()

    def build(tmp: Path) -> None:
        ctx.say(f"layer {key[:12]}: {what}")
        with tempfile.TemporaryDirectory(prefix="collimate-layer-", dir=tmp) as t:
            tree = Path(t) / "tree"
            tree.mkdir()
            fill(tree)
            digest, size = _write_tar(tree, tmp / LAYER_TAR)
        (tmp / LAYER_DONE).write_text(json.dumps({"digest": digest, "size": size, "what": what}) + "\n")

    if entry.parent.is_dir() and (ctx.force or not done(entry)):
        _cache.sweep(entry.parent)  # leftovers of killed builds
    _cache.build_once(entry, done, build, kind="image-layer", key=key, cache=ctx.cache, force=ctx.force, say=ctx.say)
    meta = json.loads((entry / LAYER_DONE).read_text())
    return BuiltLayer(key, entry / LAYER_TAR, meta["digest"], meta["size"], what)


def _write_tar(tree: Path, out: Path) -> tuple[str, int]:
    """`tree` as a layer tar: sorted, fixed times, owner root; hard links kept."""

    def norm(ti: tarfile.TarInfo) -> tarfile.TarInfo:
        ti.mtime = LAYER_MTIME
        ti.uid = ti.gid = 0
        ti.uname = ti.gname = "root"
        return ti

    with tarfile.open(out, "w", format=tarfile.PAX_FORMAT) as tf:
        for dirpath, dirnames, filenames in os.walk(tree):
            dirnames.sort()
            rel = os.path.relpath(dirpath, tree)
            for name in sorted(dirnames + filenames):
                p = os.path.join(dirpath, name)
                arc = name if rel == "." else f"{rel}/{name}"
                tf.add(p, arcname=arc, recursive=False, filter=norm)
    h = hashlib.sha256()
    with open(out, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return "sha256:" + h.hexdigest(), out.stat().st_size


def write_layout(built: BuiltImage, dest: Path, tag: str = "latest", link: bool = False) -> Path:
    """`built` as an OCI image layout directory at `dest` (`link`: hard-link layer blobs from the
    cache where the file system allows)."""
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    for l in built.layers:
        b = blobs / l.digest.split(":", 1)[1]
        if b.exists():
            continue
        if link:
            try:
                os.link(l.path, b)
                continue
            except OSError:
                pass
        shutil.copyfile(l.path, b)
    cfg, man = built.config_bytes(), built.manifest_bytes()
    for data in (cfg, man):
        (blobs / _digest(data).split(":", 1)[1]).write_bytes(data)
    index = {
        "schemaVersion": 2,
        "mediaType": MEDIA_INDEX,
        "manifests": [{
            "mediaType": MEDIA_MANIFEST, "digest": _digest(man), "size": len(man),
            "platform": {"architecture": "amd64", "os": "linux"},
            "annotations": {"org.opencontainers.image.ref.name": tag},
        }],
    }
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    (dest / "index.json").write_text(json.dumps(index, sort_keys=True))
    return dest


# --- helpers ---------------------------------------------------------------------------------------


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _strings(items: tuple, what: str) -> list[str]:
    if not items:
        raise InvalidArgument(f"{what} needs at least one name")
    out = []
    for i in items:
        if isinstance(i, (list, tuple)):
            out.extend(_strings(tuple(i), what))
        elif isinstance(i, (str, os.PathLike)):
            out.append(str(i))
        else:
            raise InvalidArgument(f"{what}: {i!r} is not a string")
    return out


def _remote(path: str) -> str:
    if not isinstance(path, str) or not path.startswith("/") or ".." in path.split("/"):
        raise InvalidArgument(f"{path!r}: an image path is absolute and has no '..'")
    return "/" + path.strip("/") if path != "/" else "/"


def _file_digest(p: Path) -> str:
    if p.is_dir():
        return _tree_digest(p, ())
    with open(p, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _tree_digest(root: Path, ignore: tuple[str, ...]) -> str:
    """What a directory holds: names, kinds, modes, link targets and file bytes."""
    import fnmatch

    h = hashlib.sha256()
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if not any(fnmatch.fnmatch(d, i) for i in ignore))
        for name in sorted(filenames + dirnames):
            if any(fnmatch.fnmatch(name, i) for i in ignore):
                continue
            p = os.path.join(dirpath, name)
            st = os.lstat(p)
            h.update(f"{os.path.relpath(p, root)}\0{st.st_mode:o}\0".encode())
            if os.path.islink(p):
                h.update(os.readlink(p).encode())
            elif os.path.isfile(p):
                with open(p, "rb") as f:
                    h.update(hashlib.file_digest(f, "sha256").digest())
    return h.hexdigest()


def _run(cmd: list[str], what: str) -> None:
    try:
        r = subprocess.run(cmd, capture_output=True, text=True)
    except FileNotFoundError:
        raise ImageBuildError(f"{what}: {cmd[0]} not found") from None
    if r.returncode != 0:
        tail = "\n".join((r.stderr or r.stdout).strip().splitlines()[-15:])
        raise ImageBuildError(f"{what} failed (exit {r.returncode}):\n{tail}")
