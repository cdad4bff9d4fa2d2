"""Container images, offline: read them, verify them, unpack them into a root filesystem.

Sources (never a registry):
  - an OCI image layout: a directory with `oci-layout`, `index.json` and `blobs/sha256/<hex>`, or a
    tar archive of one (`skopeo copy docker://... oci:<dir>` / `oci-archive:<file>`);
  - a `docker save` archive: `manifest.json` plus the config and layer tars (docker 25 and later
    also write an OCI layout into the archive; it is read as one).

An image is named by a path (`/path/to/layout`, `/path/to/image.tar`, optionally `@sha256:<hex>`
or `:<tag>` for a layout holding several), or by a reference (`name`, `name:tag`,
`registry/name@sha256:<hex>`) looked up in a local image store: a directory whose entries are such
layouts and archives (default `<cache>/images/`, or `$COLLIMATE_IMAGES`). A reference that is in no
store would need a registry pull; the error says how to put the image in the store instead.

Digests: every blob read is hashed and must match the digest it is named by: the manifest (and an
index it came through), the config, and every layer blob; each layer's uncompressed stream must
match its `rootfs.diff_ids` entry in the config. A pinned `@sha256:` must equal the image's
manifest digest, the index digest it was selected through, or its config digest (the image id,
which is what a `docker save` archive has).

Unpacking applies the layers in order into a fresh directory: whiteouts (`.wh.<name>`) delete what
lower layers put there, opaque markers (`.wh..wh..opq`) hide a directory's lower contents; modes
(with setuid/setgid/sticky bits), ownership (when the host lets us), symlinks (kept verbatim, also
absolute ones: the engine resolves them inside the sandbox), hard links and fifos are kept; device
nodes are skipped (the engine serves /dev). Entry names that are absolute or climb with `..` are
refused, and every path is resolved component by component the way the guest would see it
(symlinks are interpreted inside the tree, `..` stops at its root), so nothing is ever written
outside the tree. The result is cached by image id under `<cache>/images/rootfs/<hex>/`; a
finished tree holds `.collimate-image.json`.

Stdlib only (a zstd-compressed layer needs the `zstandard` package).
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import re
import shutil
import stat
import tarfile
import time
import zlib
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO

from collimate_core.templates import cache as _cache
from collimate_core.sdk.errors import CollimateError

# Bump when the unpacking steps change, so cached trees are rebuilt.
UNPACK_VERSION = 1
MARKER = ".collimate-image.json"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
DIGEST_RE = re.compile(r"^sha256:[0-9a-f]{64}$")
INDEX_TYPES = ("application/vnd.oci.image.index.v1+json", "application/vnd.docker.distribution.manifest.list.v2+json")
REF_NAME = "org.opencontainers.image.ref.name"
CONTAINERD_NAME = "io.containerd.image.name"
# Mount points the engine needs in every tree (the writable /work and /tmp, the agent at
# /opt/collimate; /dev and /proc are served by the engine).
MOUNT_POINTS = (("work", 0o755), ("tmp", 0o1777), ("dev", 0o755), ("proc", 0o555), ("opt/collimate", 0o755))
ARCHIVE_SUFFIXES = (".tar", ".tar.gz", ".tgz", ".oci", ".oci.tar", ".docker.tar")

Log = Callable[[str], None]


class ImageError(CollimateError):
    """An image cannot be used: not found, not verifiable, or damaged. The message says why and,
    where it can, what to do."""


# --- references ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Reference:
    """`[registry/]repository[:tag][@sha256:<hex>]`."""

    registry: str | None
    repository: str
    tag: str | None
    digest: str | None

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}" if self.registry else self.repository

    def __str__(self) -> str:
        s = self.name
        if self.tag:
            s += f":{self.tag}"
        if self.digest:
            s += f"@{self.digest}"
        return s


def parse_reference(ref: str) -> Reference:
    s = ref.strip()
    if not s:
        raise ImageError("the image reference is empty")
    digest = None
    if "@" in s:
        s, digest = s.rsplit("@", 1)
        check_digest(digest, f"in image reference {ref!r}")
    tag = None
    last = s.rsplit("/", 1)[-1]
    if ":" in last:
        s, tag = s.rsplit(":", 1)
        if not re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", tag):
            raise ImageError(f"image reference {ref!r}: {tag!r} is not a valid tag")
    registry = None
    first, _, rest = s.partition("/")
    if rest and ("." in first or ":" in first or first == "localhost"):
        registry, s = first, rest
    if not s or not re.fullmatch(r"[a-z0-9]+(?:[._-]+[a-z0-9]+|/[a-z0-9]+)*", s.lower()):
        raise ImageError(f"image reference {ref!r}: {s!r} is not a valid repository name")
    return Reference(registry, s, tag, digest)


def _canonical(name: str, tag: str | None) -> tuple[str, str]:
    """(repository as docker.io would name it, tag) for comparing references."""
    r = parse_reference(name)
    repo = r.name
    for prefix in ("docker.io/", "index.docker.io/", "registry-1.docker.io/"):
        repo = repo.removeprefix(prefix)
    repo = repo.removeprefix("library/")
    return repo, tag or r.tag or "latest"


def check_digest(digest: str, what: str = "") -> str:
    if not isinstance(digest, str) or not DIGEST_RE.match(digest):
        algo = digest.split(":", 1)[0] if isinstance(digest, str) and ":" in digest else None
        if algo and algo != "sha256":
            raise ImageError(f"unsupported digest algorithm {algo!r} {what}: only sha256 digests are supported")
        raise ImageError(f"{digest!r} {what} is not a digest (expected sha256:<64 hex digits>)")
    return digest


# --- containers: a layout directory or an archive ---------------------------------------------


def _clean_member(name: str) -> str:
    """A relative path inside a layout or archive, without `.`/empty parts; refuses climbing."""
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if name.startswith("/") or ".." in parts or not parts:
        raise ImageError(f"unsafe path {name!r} in the image")
    return "/".join(parts)


class _Container:
    source: Path

    def exists(self, name: str) -> bool:
        raise NotImplementedError

    def open(self, name: str) -> IO[bytes]:
        raise NotImplementedError

    def read(self, name: str, limit: int = 64 << 20) -> bytes:
        with self.open(name) as f:
            data = f.read(limit + 1)
        if len(data) > limit:
            raise ImageError(f"{name} in {self.source} is larger than {limit >> 20} MiB; not a manifest or config")
        return data

    def close(self) -> None:
        pass

    def blob_name(self, digest: str) -> str:
        return "blobs/sha256/" + check_digest(digest).split(":", 1)[1]


class _DirContainer(_Container):
    def __init__(self, path: Path):
        self.source = path
        self.real = os.path.realpath(path)

    def _path(self, name: str) -> str:
        p = os.path.join(self.real, _clean_member(name))
        real = os.path.realpath(p)
        if not real.startswith(self.real + os.sep):
            raise ImageError(f"{name} in {self.source} leads outside the image directory")
        return real

    def exists(self, name: str) -> bool:
        try:
            return os.path.isfile(self._path(name))
        except ImageError:
            return False

    def open(self, name: str) -> IO[bytes]:
        try:
            return open(self._path(name), "rb")
        except FileNotFoundError:
            raise ImageError(f"{name} is missing from {self.source}") from None


class _TarContainer(_Container):
    def __init__(self, path: Path):
        self.source = path
        try:
            self.tf = tarfile.open(path, "r:*")
            self.members = {}
            for m in self.tf.getmembers():
                try:
                    self.members[_clean_member(m.name)] = m
                except ImageError:
                    continue  # not something we would ever read
        except (tarfile.TarError, OSError, EOFError, gzip.BadGzipFile) as e:
            raise ImageError(f"{path} is not a readable tar archive: {e}") from None

    def exists(self, name: str) -> bool:
        m = self.members.get(name)
        return m is not None and (m.isfile() or m.issym() or m.islnk())

    def open(self, name: str) -> IO[bytes]:
        m = self.members.get(_clean_member(name))
        if m is None:
            raise ImageError(f"{name} is missing from {self.source}")
        try:
            f = self.tf.extractfile(m)
        except (tarfile.TarError, KeyError) as e:
            raise ImageError(f"{name} in {self.source} cannot be read: {e}") from None
        if f is None:
            raise ImageError(f"{name} in {self.source} is not a file")
        return f

    def close(self) -> None:
        self.tf.close()


def _container(path: Path) -> _Container:
    if path.is_dir():
        return _DirContainer(path)
    if path.is_file():
        return _TarContainer(path)
    raise ImageError(f"no image at {path}: no such file or directory")


# --- images ----------------------------------------------------------------------------------


@dataclass
class ImageConfig:
    """The parts of an image's config that decide how its programs run."""

    env: list[str] = field(default_factory=list)
    entrypoint: list[str] = field(default_factory=list)
    cmd: list[str] = field(default_factory=list)
    working_dir: str = ""
    user: str = ""

    @classmethod
    def from_config(cls, config: dict) -> ImageConfig:
        c = config.get("config") or config.get("container_config") or {}
        return cls(
            env=[str(e) for e in c.get("Env") or []],
            entrypoint=[str(a) for a in c.get("Entrypoint") or []],
            cmd=[str(a) for a in c.get("Cmd") or []],
            working_dir=str(c.get("WorkingDir") or ""),
            user=str(c.get("User") or ""),
        )

    def env_dict(self) -> dict[str, str]:
        out: dict[str, str] = {}
        for e in self.env:
            k, sep, v = e.partition("=")
            if k and sep:
                out[k] = v
        return out


@dataclass
class Layer:
    name: str  # member name in the container
    digest: str | None  # the blob's digest (OCI); None when only the diff id is known (docker save)
    diff_id: str | None  # sha256 of the uncompressed tar, from the config
    media_type: str = ""
    size: int | None = None


@dataclass
class Image:
    """One image in a container, its manifest and config read and verified."""

    source: Path
    format: str  # "oci-layout", "oci-archive" or "docker-save"
    manifest_digest: str | None
    config_digest: str
    config: dict
    layers: list[Layer]
    names: list[str]
    index_digest: str | None = None
    container: _Container | None = field(default=None, repr=False)

    @property
    def id(self) -> str:
        """The image id: its config digest (it pins every layer's content through diff_ids)."""
        return self.config_digest

    @property
    def digest(self) -> str:
        """The digest a registry would show: the manifest's, else (docker save) the image id."""
        return self.manifest_digest or self.config_digest

    @property
    def image_config(self) -> ImageConfig:
        return ImageConfig.from_config(self.config)

    def digests(self) -> set[str]:
        return {d for d in (self.manifest_digest, self.config_digest, self.index_digest) if d}

    def close(self) -> None:
        if self.container is not None:
            self.container.close()


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _load_json(data: bytes, what: str) -> dict | list:
    try:
        return json.loads(data)
    except ValueError as e:
        raise ImageError(f"{what} is not valid JSON: {e}") from None


def _read_blob(c: _Container, digest: str, what: str) -> bytes:
    data = c.read(c.blob_name(digest))
    got = _sha256(data)
    if got != digest:
        raise ImageError(f"{what} blob {digest} does not match its digest (its content hashes to {got}): the image is corrupt")
    return data


def _platform_ok(p: dict | None) -> bool:
    return not p or (p.get("os") in (None, "linux") and p.get("architecture") in (None, "amd64"))


def _candidates_oci(c: _Container) -> list[tuple[dict, list[str], str | None]]:
    """(manifest descriptor, names, index digest) of every linux/amd64 image in an OCI layout."""
    if not c.exists("index.json"):
        raise ImageError(f"{c.source} has no index.json: not an OCI image layout")
    index = _load_json(c.read("index.json"), f"{c.source}/index.json")
    if not isinstance(index, dict) or not isinstance(index.get("manifests"), list):
        raise ImageError(f"{c.source}/index.json has no manifests list")
    out: list[tuple[dict, list[str], str | None]] = []

    def walk(descs: list, names: list[str], via: str | None, depth: int) -> None:
        for d in descs:
            if not isinstance(d, dict) or "digest" not in d:
                raise ImageError(f"a manifest descriptor in {c.source} has no digest")
            ann = d.get("annotations") or {}
            own = [n for n in (ann.get(CONTAINERD_NAME), ann.get(REF_NAME)) if n] or names
            if d.get("mediaType") in INDEX_TYPES:
                if depth > 4:
                    raise ImageError(f"image indexes in {c.source} nest too deep")
                sub = _load_json(_read_blob(c, d["digest"], "image index"), f"image index {d['digest']}")
                walk(sub.get("manifests") or [], own, via or d["digest"], depth + 1)
            elif _platform_ok(d.get("platform")):
                out.append((d, own, via))

    walk(index["manifests"], [], None, 0)
    return out


def _names_match(names: list[str], entry_name: str | None, ref: Reference, any_tag: bool = True) -> bool:
    """Whether an image named `names` (in store entry `entry_name`) is what `ref` names. A
    reference without a tag names its repository's images whatever their tag (`latest` is
    preferred among several, see _select) unless `any_tag` is false."""
    want = _canonical(ref.name, ref.tag)
    loose = any_tag and ref.tag is None

    def same(repo_tag: tuple[str, str]) -> bool:
        return repo_tag == want or (loose and repo_tag[0] == want[0])

    for n in names:
        try:
            if same(_canonical(n, None)):  # a full reference
                return True
        except ImageError:
            pass
        try:
            # skopeo's oci:<dir>:<tag> records just the tag: the store entry's name is the repository
            if entry_name and re.fullmatch(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}", n) and same(_canonical(entry_name, n)):
                return True
        except ImageError:
            continue
    if entry_name and not names:
        try:
            return same(_canonical(entry_name, None))
        except ImageError:
            return False
    return False


def open_image(
    path: str | os.PathLike,
    ref: Reference | None = None,
    *,
    digest: str | None = None,
    tag: str | None = None,
    entry_name: str | None = None,
    log: Log | None = None,
) -> Image:
    """Open the image at `path` (a layout directory or an archive), select the one `ref`, `digest`
    or `tag` names (or the only one there is), and read and verify its manifest and config."""
    say = log or (lambda m: None)
    path = Path(path)
    c = _container(path)
    try:
        img = _open(c, path, ref, digest or (ref.digest if ref else None), tag, entry_name, say)
    except BaseException:
        c.close()
        raise
    img.container = c
    return img


def _open(c, path, ref, digest, tag, entry_name, say) -> Image:
    is_oci = c.exists("oci-layout") or c.exists("index.json")
    if is_oci and c.exists("index.json"):
        if c.exists("oci-layout"):
            layout = _load_json(c.read("oci-layout"), "oci-layout")
            version = layout.get("imageLayoutVersion") if isinstance(layout, dict) else None
            if version and not str(version).startswith("1."):
                raise ImageError(f"{path}: unsupported OCI layout version {version}")
        cands = _candidates_oci(c)
        if not cands:
            raise ImageError(f"{path} holds no linux/amd64 image (the engine runs x86-64 Linux programs only)")
        chosen = _select(
            [(d["digest"], names, via, d) for d, names, via in cands], path, ref, digest, tag, entry_name
        )
        d, names, via = chosen[3], chosen[1], chosen[2]
        manifest_bytes = _read_blob(c, d["digest"], "manifest")
        manifest = _load_json(manifest_bytes, f"manifest {d['digest']}")
        if not isinstance(manifest, dict) or "config" not in manifest or "layers" not in manifest:
            raise ImageError(f"manifest {d['digest']} in {path} has no config or layers")
        cfg_digest = check_digest(manifest["config"].get("digest"), "(the config's digest)")
        config = _load_json(_read_blob(c, cfg_digest, "config"), f"config {cfg_digest}")
        layers = []
        for i, ld in enumerate(manifest["layers"]):
            ldig = check_digest(ld.get("digest"), f"(layer {i + 1}'s digest)")
            layers.append(Layer(c.blob_name(ldig), ldig, None, ld.get("mediaType", ""), ld.get("size")))
        img = Image(path, "oci-layout" if path.is_dir() else "oci-archive", d["digest"], cfg_digest, config, layers,
                    names, via)
    elif c.exists("manifest.json"):
        entries = _load_json(c.read("manifest.json"), f"{path}/manifest.json")
        if not isinstance(entries, list) or not entries:
            raise ImageError(f"{path}/manifest.json lists no images: not a docker save archive")
        cands = []
        for e in entries:
            if not isinstance(e, dict) or "Config" not in e or "Layers" not in e:
                raise ImageError(f"{path}/manifest.json has an entry without Config or Layers")
            cfg_bytes = c.read(_clean_member(e["Config"]))
            cands.append((_sha256(cfg_bytes), list(e.get("RepoTags") or []), None, (e, cfg_bytes)))
        chosen = _select(cands, path, ref, digest, tag, entry_name)
        e, cfg_bytes = chosen[3]
        cfg_digest = chosen[0]
        stem = Path(e["Config"]).name.removesuffix(".json")
        if re.fullmatch(r"[0-9a-f]{64}", stem) and f"sha256:{stem}" != cfg_digest:
            raise ImageError(f"config {e['Config']} in {path} does not match its name (it hashes to {cfg_digest}): "
                             "the archive is corrupt")
        config = _load_json(cfg_bytes, f"config {e['Config']}")
        layers = [Layer(_clean_member(name), None, None, "") for name in e["Layers"]]
        img = Image(path, "docker-save", None, cfg_digest, config, layers, chosen[1])
    else:
        raise ImageError(
            f"{path} is neither an OCI image layout (oci-layout + index.json + blobs/) nor a docker save archive "
            "(manifest.json + layer tars)"
        )

    if not isinstance(img.config, dict):
        raise ImageError(f"the config of {path} is not a JSON object")
    arch, osname = img.config.get("architecture"), img.config.get("os")
    if (arch and arch != "amd64") or (osname and osname != "linux"):
        raise ImageError(f"{path} is a {osname}/{arch} image; the engine runs linux/amd64 (x86-64) programs only")
    diff_ids = (img.config.get("rootfs") or {}).get("diff_ids")
    if not isinstance(diff_ids, list) or len(diff_ids) != len(img.layers):
        raise ImageError(
            f"the config of {path} lists {len(diff_ids) if isinstance(diff_ids, list) else 'no'} diff_ids for "
            f"{len(img.layers)} layers: the image is inconsistent"
        )
    for layer, diff in zip(img.layers, diff_ids):
        layer.diff_id = check_digest(diff, "(a diff_id in the config)")
    if digest and digest not in img.digests():
        raise ImageError(
            f"digest mismatch: {path} holds {img.digest} (config {img.config_digest}), not the pinned {digest}"
        )
    say(describe(img))
    return img


def describe(img: Image) -> str:
    names = f" [{', '.join(img.names)}]" if img.names else ""
    return (f"image {img.digest} ({img.format}, {len(img.layers)} layers, id {img.config_digest[:19]}){names} "
            f"from {img.source}")


def _select(cands, path, ref, digest, tag, entry_name):
    """Pick one of (digest, names, via, payload): by digest, else by reference/tag, else the only one."""
    if digest:
        hits = [cd for cd in cands if digest in (cd[0], cd[2])]
        if not hits and len(cands) > 1:
            shown = ", ".join(cd[0] for cd in cands)
            raise ImageError(f"digest mismatch: no image in {path} has digest {digest} (it holds {shown})")
        # With one candidate, its config/manifest digests are compared once they are read.
        return hits[0] if hits else cands[0]
    if ref is not None or tag is not None:
        want = ref or Reference(None, entry_name or "image", tag, None)
        hits = [cd for cd in cands if _names_match(cd[1], entry_name, want)]
        if tag is not None and not hits:
            hits = [cd for cd in cands if tag in cd[1]]
        if len({cd[0] for cd in hits}) > 1:  # an untagged reference: prefer :latest
            exact = [cd for cd in hits if _names_match(cd[1], entry_name, want, any_tag=False)]
            hits = exact or hits
        if hits:
            cands = hits
        elif ref is not None and entry_name is None:
            raise ImageError(f"no image named {ref} in {path}")
        elif tag is not None:
            raise ImageError(f"no image tagged {tag!r} in {path}")
    distinct = {cd[0] for cd in cands}
    if len(distinct) > 1:
        listing = "; ".join(f"{cd[0]} ({', '.join(cd[1]) or 'unnamed'})" for cd in cands)
        raise ImageError(f"{path} holds several images ({listing}); name one with @sha256:<digest> or :<tag>")
    return cands[0]


# --- the local image store -------------------------------------------------------------------


def default_store(cache: Path) -> Path:
    env = os.environ.get("COLLIMATE_IMAGES")
    return Path(env) if env else Path(cache) / "images"


def _entry_name(p: Path) -> str:
    n = p.name
    for suf in sorted(ARCHIVE_SUFFIXES, key=len, reverse=True):
        if n.endswith(suf):
            return n[: -len(suf)]
    return n


def _store_entries(store: Path) -> list[Path]:
    if not store.is_dir():
        return []
    out = []
    for p in sorted(store.iterdir()):
        if p.name.startswith(".") or p.name == "rootfs":
            continue
        if p.is_dir() and ((p / "index.json").is_file() or (p / "manifest.json").is_file()) or p.is_file() and p.name.endswith(ARCHIVE_SUFFIXES):
            out.append(p)
    return out


def pull_hint(ref: str, store: Path) -> str:
    try:
        repo = parse_reference(ref).repository
    except ImageError:
        repo = "image"
    short = re.sub(r"[^A-Za-z0-9._-]", "_", repo.rsplit("/", 1)[-1])
    return (
        f"Images are never pulled from a registry here. Put it in the local image store {store} (or anywhere, "
        f"and pass that path as image=...), then bake again:\n"
        f"  skopeo copy docker://{ref} oci:{store}/{short}:latest     # an OCI image layout\n"
        f"  docker pull {ref} && docker save {ref} -o {store}/{short}.tar     # a docker save archive\n"
        f"  (or `skopeo copy docker://{ref} oci-archive:{store}/{short}.tar`)"
    )


def resolve(image: str | os.PathLike, store: Path, log: Log | None = None) -> Image:
    """The image `image` names: a path (optionally with @sha256:<digest> or :<tag>), or a reference
    found in the local store `store`. Raises ImageError with what to do when it is not there."""
    say = log or (lambda m: None)
    if isinstance(image, os.PathLike):
        return open_image(Path(image), log=say)
    if not isinstance(image, str) or not image.strip():
        raise ImageError(f"image must be a path or an image reference, not {image!r}")
    text = image.strip()
    # A path, possibly pinned (`path@sha256:...`) or tagged (`layout:tag`).
    base, _, pin = text.partition("@sha256:")
    pin_digest = check_digest(f"sha256:{pin}", "(the pinned digest)") if pin else None
    looks_like_path = text.startswith(("/", "./", "../", "~")) or base.endswith(ARCHIVE_SUFFIXES)
    if not looks_like_path and os.path.exists(base):
        try:
            parse_reference(text)
        except ImageError:
            looks_like_path = True
    if looks_like_path:
        for candidate, tag in ((base, None), tuple(base.rsplit(":", 1)) if ":" in base else (None, None)):
            if candidate and os.path.exists(os.path.expanduser(candidate)):
                p = Path(os.path.expanduser(candidate))
                return open_image(p, digest=pin_digest, tag=tag, log=say)
        raise ImageError(f"no image at {base}: no such file or directory")

    ref = parse_reference(text)
    entries = _store_entries(store)
    say(f"looking up {ref} in the image store {store} ({len(entries)} entries)")
    mismatch = None
    for p in entries:
        name = _entry_name(p)
        try:
            if ref.digest:
                img = open_image(p, digest=ref.digest, entry_name=name)
            else:
                img = open_image(p, ref, entry_name=name)
        except ImageError as e:
            msg = str(e)
            if ref.digest and "digest mismatch" in msg:
                if _entry_matches(p, ref):
                    mismatch = msg
                continue
            if "no image named" in msg or "no image tagged" in msg:
                continue
            # A damaged entry that this reference names is an error; others are skipped.
            if _entry_matches(p, ref):
                raise
            continue
        if ref.digest or _names_match(img.names, name, ref):
            say(describe(img))
            return img
        img.close()
    if mismatch:
        raise ImageError(mismatch)
    raise ImageError(f"image {ref} is not in the local image store {store}.\n" + pull_hint(str(ref), store))


def _entry_matches(p: Path, ref: Reference) -> bool:
    """Whether store entry `p` is named after `ref`'s repository (in full, or its last part as
    `skopeo copy ... oci:<store>/<name>:<tag>` names it)."""
    try:
        entry = _canonical(_entry_name(p), None)[0]
        repo = _canonical(ref.name, None)[0]
    except ImageError:
        return False
    return entry in (repo, repo.rsplit("/", 1)[-1])


# --- verification ----------------------------------------------------------------------------


class _HashingReader(io.RawIOBase):
    """Reads through `f`, hashing what passes."""

    def __init__(self, f: IO[bytes]):
        self.f = f
        self.h = hashlib.sha256()
        self.n = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b) -> int:
        data = self.f.read(len(b))
        self.h.update(data)
        self.n += len(data)
        b[: len(data)] = data
        return len(data)

    def digest(self) -> str:
        return "sha256:" + self.h.hexdigest()


def _drain(r: IO[bytes]) -> None:
    while r.read(1 << 20):
        pass


def _decompressed(raw: IO[bytes], what: str) -> IO[bytes]:
    """The uncompressed stream of a layer blob, by its magic bytes (tar, gzip or zstd)."""
    head = raw.peek(4)[:4] if hasattr(raw, "peek") else b""
    if head[:2] == b"\x1f\x8b":
        return gzip.GzipFile(fileobj=raw, mode="rb")
    if head == b"\x28\xb5\x2f\xfd":
        try:
            import zstandard  # type: ignore[import-not-found]
        except ImportError:
            raise ImageError(
                f"{what} is zstd-compressed and the zstandard package is not installed: `pip install zstandard`, "
                "or convert the image: skopeo copy --dest-compress-format gzip ..."
            ) from None
        return zstandard.ZstdDecompressor().stream_reader(raw)
    return raw


def verify_layers(img: Image, log: Log | None = None) -> None:
    """Hash every layer blob (OCI: its digest; docker save: its uncompressed content, the diff
    id) before anything is unpacked, so a damaged image fails before any work."""
    say = log or (lambda m: None)
    c = img.container
    assert c is not None
    t0 = time.monotonic()
    total = 0
    for i, layer in enumerate(img.layers, 1):
        what = f"layer {i}/{len(img.layers)} ({layer.digest or layer.name})"
        with c.open(layer.name) as f:
            hr = _HashingReader(f)
            buf = io.BufferedReader(hr, 1 << 20)
            if layer.digest:
                _drain(buf)
                want, got = layer.digest, hr.digest()
            else:
                inner = _HashingReader(_decompressed(buf, what))
                try:
                    _drain(inner)
                except (OSError, EOFError, gzip.BadGzipFile) as e:
                    raise ImageError(f"{what} is corrupt: {e}") from None
                want, got = layer.diff_id, inner.digest()
            total += hr.n
        if got != want:
            raise ImageError(f"{what} does not match its digest: expected {want}, the blob hashes to {got}; "
                             "the layer is corrupt")
    say(f"verified {len(img.layers)} layer blobs ({total / 2**20:.1f} MiB) in {time.monotonic() - t0:.2f}s")


# --- unpacking -------------------------------------------------------------------------------


class LayerError(ImageError):
    pass


def _split_entry(name: str) -> list[str]:
    if name.startswith("/"):
        raise LayerError(f"absolute path {name!r}")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise LayerError(f"path {name!r} climbs out with '..'")
    if any("\0" in p for p in parts):
        raise LayerError(f"path {name!r} holds a NUL byte")
    return parts


class Tree:
    """A root filesystem being built, with guest-style path resolution on the host."""

    MAX_LINKS = 40

    def __init__(self, root: Path):
        self.root = os.path.realpath(root)
        self.chown = hasattr(os, "geteuid") and os.geteuid() == 0

    def _host(self, parts: list[str]) -> str:
        return os.path.join(self.root, *parts) if parts else self.root

    def resolve_dir(self, parts: list[str], create: bool = False, made: Callable[[list[str]], None] | None = None,
                    _depth: int = 0) -> list[str] | None:
        """The real (symlink-free) components of directory `parts`, following symlinks the way the
        guest would (inside the tree; `..` stops at its root). Missing directories are created
        with `create`; None if one is missing (or is not a directory) otherwise."""
        cur: list[str] = []
        todo = list(parts)
        links = _depth
        while todo:
            comp = todo.pop(0)
            if comp in ("", "."):
                continue
            if comp == "..":
                if cur:
                    cur.pop()
                continue
            p = self._host(cur + [comp])
            try:
                st = os.lstat(p)
            except FileNotFoundError:
                if not create:
                    return None
                os.mkdir(p, 0o755)
                cur.append(comp)
                if made:
                    made(list(cur))
                continue
            if stat.S_ISLNK(st.st_mode):
                links += 1
                if links > self.MAX_LINKS:
                    raise LayerError(f"too many levels of symbolic links at /{'/'.join(cur + [comp])}")
                target = os.readlink(p)
                if target.startswith("/"):
                    cur = []
                todo = [t for t in target.split("/") if t] + todo
                continue
            if not stat.S_ISDIR(st.st_mode):
                if create:
                    raise LayerError(f"/{'/'.join(cur + [comp])} is not a directory")
                return None
            cur.append(comp)
        return cur

    def resolve(self, path: str, follow: bool = True) -> str | None:
        """Host path of guest path `path` (absolute), following a final symlink with `follow`;
        None if it does not exist."""
        parts = [p for p in path.split("/") if p]
        for _ in range(self.MAX_LINKS):
            if not parts:
                return self.root
            parent = self.resolve_dir(parts[:-1])
            if parent is None:
                return None
            last = parts[-1]
            if last == "..":
                return self._host(parent[:-1])
            if last == ".":
                return self._host(parent)
            p = self._host(parent + [last])
            if not os.path.lexists(p):
                return None
            if follow and os.path.islink(p):
                target = os.readlink(p)
                parts = [t for t in target.split("/") if t] if target.startswith("/") else parent + [
                    t for t in target.split("/") if t]
                continue
            return p
        raise LayerError(f"too many levels of symbolic links resolving {path}")

    def find_program(self, name: str, path_var: str, cwd: str = "/") -> str | None:
        """The guest path `name` runs as (PATH search for a bare name), if it is an executable file."""
        if "/" in name:
            cands = [name if name.startswith("/") else os.path.join(cwd or "/", name)]
        else:
            cands = [os.path.join(d or ".", name) for d in path_var.split(":")]
        for cand in cands:
            host = self.resolve(cand if cand.startswith("/") else "/" + cand)
            if host and os.path.isfile(host) and os.stat(host).st_mode & 0o111:
                return os.path.normpath(cand)
        return None


def _remove(p: str) -> None:
    st = os.lstat(p)
    if stat.S_ISDIR(st.st_mode):
        shutil.rmtree(p)
    else:
        os.unlink(p)


class _Applier:
    def __init__(self, tree: Tree, log: Log):
        self.tree = tree
        self.log = log
        self.dir_meta: dict[tuple[str, ...], tuple[int, float, int, int]] = {}
        self.skipped_devices = 0

    def apply(self, tf: tarfile.TarFile, what: str) -> int:
        created: set[tuple[str, ...]] = set()
        opaque: list[tuple[str, ...]] = []
        n = 0

        def made(parts: list[str]) -> None:
            created.add(tuple(parts))

        for m in tf:
            n += 1
            try:
                parts = _split_entry(m.name)
            except LayerError as e:
                raise LayerError(f"{what}: unsafe entry: {e}") from None
            if not parts:
                if m.isdir():
                    self.dir_meta[()] = (m.mode & 0o7777, m.mtime, m.uid, m.gid)
                continue
            base = parts[-1]
            if base.startswith(".wh."):
                parent = self.tree.resolve_dir(parts[:-1], create=base == ".wh..wh..opq", made=made)
                if parent is None:
                    continue
                if base == ".wh..wh..opq":
                    opaque.append(tuple(parent))
                else:
                    victim = base[len(".wh."):]
                    if victim in ("", ".", "..") or "/" in victim:
                        raise LayerError(f"{what}: bad whiteout {m.name!r}")
                    key = tuple(parent + [victim])
                    p = self.tree._host(list(key))
                    if key not in created and os.path.lexists(p):
                        _remove(p)
                continue
            parent = self.tree.resolve_dir(parts[:-1], create=True, made=made)
            assert parent is not None
            key = tuple(parent + [base])
            target = self.tree._host(list(key))
            self._entry(tf, m, target, key, what)
            created.add(key)
        for d in opaque:
            self._opaque(d, created)
        return n

    def _entry(self, tf: tarfile.TarFile, m: tarfile.TarInfo, target: str, key: tuple[str, ...], what: str) -> None:
        exists = os.path.lexists(target)
        if m.isdir():
            if exists and not (os.path.isdir(target) and not os.path.islink(target)):
                _remove(target)
                exists = False
            if not exists:
                os.mkdir(target, 0o755)
            self.dir_meta[key] = (m.mode & 0o7777, m.mtime, m.uid, m.gid)
            return
        if exists:
            _remove(target)
        if m.isreg():
            src = tf.extractfile(m)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
            try:
                with os.fdopen(fd, "wb", closefd=False) as out:
                    if src is not None:
                        shutil.copyfileobj(src, out, 1 << 20)
                if self.tree.chown:
                    os.fchown(fd, m.uid, m.gid)
                os.fchmod(fd, m.mode & 0o7777)
            finally:
                os.close(fd)
            os.utime(target, (m.mtime, m.mtime), follow_symlinks=False)
        elif m.issym():
            if "\0" in m.linkname:
                raise LayerError(f"{what}: symlink {m.name!r} has a NUL byte in its target")
            os.symlink(m.linkname, target)
            if self.tree.chown:
                os.lchown(target, m.uid, m.gid)
            try:
                os.utime(target, (m.mtime, m.mtime), follow_symlinks=False)
            except (NotImplementedError, OSError):
                pass
        elif m.islnk():
            try:
                lparts = _split_entry(m.linkname)
            except LayerError as e:
                raise LayerError(f"{what}: hard link {m.name!r}: unsafe target: {e}") from None
            lparent = self.tree.resolve_dir(lparts[:-1])
            src = self.tree._host(lparent + [lparts[-1]]) if lparent is not None and lparts else None
            if src is None or not os.path.lexists(src):
                raise LayerError(f"{what}: hard link {m.name!r} -> {m.linkname!r}: the target does not exist")
            if os.path.isdir(src) and not os.path.islink(src):
                raise LayerError(f"{what}: hard link {m.name!r} -> {m.linkname!r}: the target is a directory")
            os.link(src, target, follow_symlinks=False)
        elif m.isfifo():
            os.mkfifo(target, 0o600)
            if self.tree.chown:
                os.lchown(target, m.uid, m.gid)
            os.chmod(target, m.mode & 0o7777)  # not the umask's
        elif m.ischr() or m.isblk():
            self.skipped_devices += 1
        else:
            raise LayerError(f"{what}: entry {m.name!r} has an unsupported type {m.type!r}")

    def _opaque(self, d: tuple[str, ...], created: set[tuple[str, ...]]) -> None:
        """Remove what lower layers put under directory `d` (entries of this layer stay)."""
        host = self.tree._host(list(d))
        try:
            names = os.listdir(host)
        except FileNotFoundError:
            return
        for name in names:
            key = d + (name,)
            p = os.path.join(host, name)
            if key not in created:
                _remove(p)
            elif os.path.isdir(p) and not os.path.islink(p):
                self._opaque(key, created)

    def finish(self) -> None:
        """Directory modes and times last (deepest first), so a read-only directory of one layer
        does not stop a later layer from writing into it."""
        for key in sorted(self.dir_meta, key=len, reverse=True):
            mode, mtime, uid, gid = self.dir_meta[key]
            p = self.tree._host(list(key))
            if not (os.path.isdir(p) and not os.path.islink(p)):
                continue
            if self.tree.chown:
                os.lchown(p, uid, gid)
            os.chmod(p, mode)
            os.utime(p, (mtime, mtime))


def apply_layer(tree: Tree, stream: IO[bytes], what: str, log: Log | None = None,
                applier: _Applier | None = None) -> int:
    """Apply one uncompressed layer tar stream to `tree`; the number of entries."""
    ap = applier or _Applier(tree, log or (lambda m: None))
    try:
        tf = tarfile.open(fileobj=stream, mode="r|")
    except tarfile.TarError as e:
        raise LayerError(f"{what} is not a tar archive: {e}") from None
    try:
        n = ap.apply(tf, what)
    except (tarfile.TarError, EOFError, gzip.BadGzipFile, zlib.error) as e:
        raise LayerError(f"{what} is corrupt: {e}") from None
    if applier is None:
        ap.finish()
    return n


def unpack(img: Image, dest_root: Path, log: Log | None = None) -> dict:
    """Apply `img`'s layers in order into the empty directory `dest_root`, verifying each layer's
    blob digest and diff id as it streams. Returns statistics."""
    say = log or (lambda m: None)
    c = img.container
    assert c is not None
    tree = Tree(dest_root)
    ap = _Applier(tree, say)
    entries = 0
    for i, layer in enumerate(img.layers, 1):
        what = f"layer {i}/{len(img.layers)} ({layer.digest or layer.diff_id})"
        t0 = time.monotonic()
        with c.open(layer.name) as f:
            outer = _HashingReader(f)
            buf = io.BufferedReader(outer, 1 << 20)
            try:
                inner = _HashingReader(_decompressed(buf, what))
                n = apply_layer(tree, io.BufferedReader(inner, 1 << 20), what, say, ap)
                _drain(inner)  # the end-of-archive padding, so the diff id covers all of it
                _drain(buf)
            except (OSError, EOFError, zlib.error) as e:
                raise LayerError(f"{what} is corrupt: {e}") from None
        if layer.digest and outer.digest() != layer.digest:
            raise LayerError(f"{what} does not match its digest: the blob hashes to {outer.digest()}")
        if inner.digest() != layer.diff_id:
            raise LayerError(f"{what}: its uncompressed content hashes to {inner.digest()}, but the config's "
                             f"diff_id is {layer.diff_id}: the layer is corrupt")
        entries += n
        say(f"applied {what}: {n} entries, {outer.n / 2**20:.1f} MiB in {time.monotonic() - t0:.2f}s")
    ap.finish()
    if ap.skipped_devices:
        say(f"skipped {ap.skipped_devices} device nodes (the engine serves /dev itself)")
    return {"entries": entries, "skipped_devices": ap.skipped_devices}


def rootfs_dir(cache: Path) -> Path:
    return Path(cache) / "images" / "rootfs"


def cached_rootfs(cache: Path, image_id: str) -> Path | None:
    dest = rootfs_dir(cache) / check_digest(image_id).split(":", 1)[1]
    try:
        meta = json.loads((dest / MARKER).read_text())
        if meta.get("unpack_version") == UNPACK_VERSION:
            return dest
    except (OSError, ValueError):
        pass
    return None


def build_rootfs(img: Image, cache: Path, log: Log | None = None,
                 extra_dirs: Iterable[str] = ()) -> tuple[Path, bool]:
    """The image's root filesystem, cached by image id under `<cache>/images/rootfs/<hex>/`;
    (path, whether this call created it). Layers are verified before and while they are applied;
    a failure leaves nothing behind. Concurrent calls for one image unpack it once (the others
    wait on its lock and use that tree); a tree of another unpack version is replaced."""
    say = log or (lambda m: None)
    hexid = img.id.split(":", 1)[1]
    dest = rootfs_dir(cache) / hexid
    # Looked up under the tree's lock: a prune (remove_rootfs) decides under it too, after the
    # caller recorded that it uses this image (building.json), so it cannot take the tree away
    # between this look and that use.
    with _cache.Lock(dest):
        found = cached_rootfs(cache, img.id)
    if found is not None:
        say(f"root filesystem cached: {found}")
        return found, False
    done: dict = {}  # what the build tells the caller

    def build(root: Path) -> None:
        os.chmod(root, 0o755)  # the guest's / (a cache entry starts private)
        verify_layers(img, say)
        t0 = time.monotonic()
        stats = unpack(img, root, say)
        tree = Tree(root)
        for rel, mode in MOUNT_POINTS:
            _ensure_dir(tree, rel, mode)
        workdir = img.image_config.working_dir
        for d in [*extra_dirs, *([workdir] if workdir.startswith("/") else [])]:
            _ensure_dir(tree, d.strip("/"), 0o755)  # docker makes the WorkingDir too
        meta = {
            "unpack_version": UNPACK_VERSION,
            "image_id": img.id,
            "digest": img.digest,
            "manifest_digest": img.manifest_digest,
            "layers": [{"digest": l.digest, "diff_id": l.diff_id} for l in img.layers],
            "config": img.config.get("config") or {},
            "source": str(img.source),
            "format": img.format,
            "stats": stats,
            "seconds": round(time.monotonic() - t0, 2),
            "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (root / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
        done.update(entries=stats["entries"], seconds=meta["seconds"])

    built = _cache.build_once(dest, lambda p: cached_rootfs(cache, img.id) is not None, build,
                              kind="image-rootfs", key=img.id, cache=Path(cache), say=say)
    if not built:
        say(f"root filesystem {dest} was finished concurrently; using it")
        return dest, False
    say(f"unpacked the root filesystem into {dest} ({done['entries']} entries, {done['seconds']}s)")
    return dest, True


def _ensure_dir(tree: Tree, rel: str, mode: int) -> None:
    parts = [p for p in rel.split("/") if p]
    host = tree._host(parts)
    if os.path.lexists(host) and not os.path.islink(host) and not os.path.isdir(host):
        return  # a file where a mount point would go: the mount hides it anyway
    made: list[list[str]] = []
    got = tree.resolve_dir(parts, create=True, made=made.append)
    if got is not None and got == parts and made and made[-1] == parts:
        os.chmod(tree._host(parts), mode)


def remove_rootfs(cache: Path, image_id: str, unused: Callable[[], bool] | None = None) -> bool:
    """Remove the unpacked tree of `image_id` (renamed away first: never a half-removed tree
    under the real name), under its lock so that no unpack or lookup of it runs meanwhile; if
    `unused` is given, only when it still says so under the lock. True if it was removed."""
    dest = rootfs_dir(cache) / check_digest(image_id).split(":", 1)[1]
    if not os.path.lexists(dest):
        return False
    with _cache.Lock(dest):
        if unused is not None and not unused():
            return False
        _cache.remove_entry(dest)
        return True


# --- identity ------------------------------------------------------------------------------


def resolve_user(tree: Tree, user: str) -> dict:
    """The image's User as ids, from the tree's /etc/passwd and /etc/group, as docker does:
    `name`, `uid`, `name:group`, `uid:gid`. An unknown name is an error. `groups`: the
    supplementary groups, those of /etc/group that list the user (with its primary group)."""
    spec = (user or "").strip()
    out = {"spec": spec, "uid": 0, "gid": 0, "name": "root", "home": "/root", "groups": []}
    if not spec:
        passwd = _read_db(tree, "/etc/passwd")
        for row in passwd:
            if len(row) >= 6 and row[2] == "0":
                out["home"] = row[5] or "/root"
                break
        return out
    u, _, g = spec.partition(":")
    passwd = _read_db(tree, "/etc/passwd")
    row = next((r for r in passwd if len(r) >= 4 and (r[0] == u or r[2] == u)), None)
    if row is not None:
        out.update(uid=int(row[2]), gid=int(row[3]) if row[3].isdigit() else 0, name=row[0],
                   home=(row[5] if len(row) > 5 and row[5] else "/"))
    elif u.isdigit():
        out.update(uid=int(u), gid=0, name=None, home="/")
    else:
        raise ImageError(f"the image's User {spec!r}: no user named {u!r} in the image's /etc/passwd")
    if g:
        if g.isdigit():
            out["gid"] = int(g)
        else:
            grow = next((r for r in _read_db(tree, "/etc/group") if len(r) >= 3 and r[0] == g), None)
            if grow is None:
                raise ImageError(f"the image's User {spec!r}: no group named {g!r} in the image's /etc/group")
            out["gid"] = int(grow[2])
    groups = {out["gid"]}
    if out["name"]:
        for r in _read_db(tree, "/etc/group"):
            if len(r) >= 4 and r[2].isdigit() and out["name"] in r[3].split(","):
                groups.add(int(r[2]))
    out["groups"] = sorted(groups)
    return out


def _read_db(tree: Tree, path: str) -> list[list[str]]:
    host = tree.resolve(path)
    if not host or not os.path.isfile(host):
        return []
    try:
        text = Path(host).read_text(errors="replace")
    except OSError:
        return []
    return [line.split(":") for line in text.splitlines() if line and not line.startswith("#")]
