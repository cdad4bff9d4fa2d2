"""Container images built in Python for the tests: tar layers, OCI image layouts (directory and
archive) and `docker save` archives (tar + JSON + sha256). No docker, no registry.

    layer = Layer().file("etc/motd", b"hi\\n").symlink("bin/sh", "busybox").bytes()
    info = write_oci_layout(tmp / "img", [base, layer], config={"Env": ["A=1"]}, ref_name="latest")
    write_docker_save(tmp / "img.tar", [base, layer], config={...}, repo_tags=["img:latest"])
"""

from __future__ import annotations

import gzip
import hashlib
import io
import json
import os
import importlib.util
import shutil
import subprocess
import tarfile
import tempfile
from pathlib import Path

MTIME = 1_700_000_000

# A module that does real work at import: the stand-in for `import torch` in the benchmark and
# the tests (a sieve and a table built in pure Python; a few hundred milliseconds in a guest).
SLOWMOD = b'''"""slowmod: expensive to import, on purpose."""
import hashlib


def _primes(n):
    sieve = bytearray([1]) * (n + 1)
    sieve[0:2] = b"\\x00\\x00"
    for i in range(2, int(n ** 0.5) + 1):
        if sieve[i]:
            sieve[i * i :: i] = bytes(len(range(i * i, n + 1, i)))
    return [i for i, v in enumerate(sieve) if v]


PRIMES = _primes(2_000_000)
TABLE = {p: hashlib.sha256(str(p).encode()).hexdigest()[:8] for p in PRIMES[:60_000]}
DIGEST = hashlib.sha256(repr(PRIMES[-1000:]).encode()).hexdigest()
'''


def sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Layer:
    """A layer tar, entry by entry (PAX format, fixed mtimes)."""

    def __init__(self) -> None:
        self.buf = io.BytesIO()
        self.tf = tarfile.open(fileobj=self.buf, mode="w", format=tarfile.PAX_FORMAT)

    def _info(self, name: str, type_: bytes, mode: int, **kw) -> tarfile.TarInfo:
        ti = tarfile.TarInfo(name)
        ti.type = type_
        ti.mode = mode
        ti.mtime = kw.pop("mtime", MTIME)
        ti.uid = kw.pop("uid", 0)
        ti.gid = kw.pop("gid", 0)
        for k, v in kw.items():
            setattr(ti, k, v)
        return ti

    def file(self, name: str, data: bytes = b"", mode: int = 0o644, **kw) -> Layer:
        ti = self._info(name, tarfile.REGTYPE, mode, size=len(data), **kw)
        self.tf.addfile(ti, io.BytesIO(data))
        return self

    def dir(self, name: str, mode: int = 0o755, **kw) -> Layer:
        self.tf.addfile(self._info(name, tarfile.DIRTYPE, mode, **kw))
        return self

    def symlink(self, name: str, target: str, **kw) -> Layer:
        self.tf.addfile(self._info(name, tarfile.SYMTYPE, 0o777, linkname=target, **kw))
        return self

    def hardlink(self, name: str, target: str, **kw) -> Layer:
        self.tf.addfile(self._info(name, tarfile.LNKTYPE, 0o644, linkname=target, **kw))
        return self

    def fifo(self, name: str, mode: int = 0o644) -> Layer:
        self.tf.addfile(self._info(name, tarfile.FIFOTYPE, mode))
        return self

    def chardev(self, name: str) -> Layer:
        self.tf.addfile(self._info(name, tarfile.CHRTYPE, 0o666, devmajor=1, devminor=3))
        return self

    def whiteout(self, path: str) -> Layer:
        d, _, base = path.rstrip("/").rpartition("/")
        return self.file(f"{d}/.wh.{base}" if d else f".wh.{base}")

    def opaque(self, dirpath: str) -> Layer:
        return self.file(f"{dirpath.rstrip('/')}/.wh..wh..opq")

    def tree(self, root: str | os.PathLike, prefix: str = "", skip: tuple[str, ...] = ()) -> Layer:
        """A host directory, recursively and in sorted order (symlinks and hard links kept)."""
        root = Path(root)

        def keep(ti: tarfile.TarInfo) -> tarfile.TarInfo | None:
            rel = ti.name[len(prefix) :].lstrip("/") if prefix else ti.name
            if any(rel == s or rel.startswith(s + "/") for s in skip):
                return None
            ti.mtime = MTIME
            return ti

        for name in sorted(os.listdir(root)):
            self.tf.add(root / name, arcname=f"{prefix}{name}", recursive=True, filter=keep)
        return self

    def bytes(self) -> bytes:
        self.tf.close()
        return self.buf.getvalue()


def busybox_layer(busybox: str | os.PathLike, applets=("sh", "echo", "cat", "ls", "env", "true", "false",
                                                        "pwd", "id", "sleep", "test", "printf", "mkdir")) -> bytes:
    """A busybox-only root: /bin/busybox (static) and applet links, /etc/passwd, nothing else."""
    layer = Layer().dir("bin").dir("etc").dir("root", 0o700)
    layer.file("bin/busybox", Path(busybox).read_bytes(), 0o755)
    for a in applets:
        layer.symlink(f"bin/{a}", "busybox")
    layer.file("etc/passwd", b"root:x:0:0:root:/root:/bin/sh\napp:x:1000:1000:app:/home/app:/bin/sh\n")
    layer.file("etc/group", b"root:x:0:\napp:x:1000:\n")
    return layer.bytes()


def _rootfs_module():
    """The rootfs builder (python/collimate_core/templates/rootfs.py), loaded by path as
    guest/rootfs/build.py does."""
    src = Path(__file__).resolve().parents[1] / "python/collimate_core/templates/rootfs.py"
    spec = importlib.util.spec_from_file_location("collimate_rootfs", src)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def debian_layer(packages: list[str], base: str | os.PathLike, debdir: str | os.PathLike,
                 links: dict[str, str] | None = None, bytecode: bool = False) -> bytes:
    """The layer `RUN apt-get install -y PACKAGES` would add on top of the built rootfs `base`:
    the Depends closure of `packages` less what `base`'s manifest already has, downloaded with
    `apt-get download` into `debdir` (reused) and unpacked with `dpkg -x`, as the rootfs builder
    does (no maintainer script runs), with the usrmerge moves a Debian 12 install makes.
    `links` (path -> target, relative to the root) are symlinks the maintainer scripts would have
    made, such as update-alternatives' `usr/lib/x86_64-linux-gnu/libblas.so.3`. `bytecode`: compile
    the layer's Python modules as py3compile in the packages' postinst does (an install ships
    __pycache__/*.pyc; without them every import compiles from source, and a read-only sandbox
    cannot cache the result). The sources get the layer's fixed mtime first, so the .pyc match."""
    rootfs = _rootfs_module()
    have = {p["name"] for p in json.loads((Path(base) / rootfs.MANIFEST).read_text())["packages"]}
    names, _excluded = rootfs._closure(packages)
    extra = [n for n in names if n not in have]
    debs = rootfs._download(rootfs._package_info(extra), Path(debdir), lambda msg: None)
    with tempfile.TemporaryDirectory(prefix="debian-layer-") as tmp:
        root = Path(tmp)
        for deb in debs:
            subprocess.run(["dpkg", "-x", str(deb), tmp], check=True, capture_output=True)
        for d in ("bin", "sbin", "lib", "lib64"):  # the base has these as links into /usr
            if (root / d).is_dir() and not (root / d).is_symlink():
                (root / "usr" / d).mkdir(parents=True, exist_ok=True)
                rootfs._merge_into(root / d, root / "usr" / d, root)
        for link, target in (links or {}).items():
            if not (root / link).parent.joinpath(target).exists():
                raise FileNotFoundError(f"debian_layer: link {link} -> {target}: no such file in the layer")
            (root / link).unlink(missing_ok=True)
            (root / link).symlink_to(target)
        rootfs._relativize_links(root)
        if bytecode:
            _compile_bytecode(root, base)
        return Layer().tree(root).bytes()


def _compile_bytecode(root: Path, base: str | os.PathLike) -> None:
    """`python3 -m compileall` (the base tree's interpreter, natively) over root's dist-packages,
    with the in-image paths in the code objects. A module that does not compile (py3compile skips
    such files too) leaves no .pyc and exit status 1; anything else is an error."""
    site = root / "usr/lib/python3/dist-packages"
    if not site.is_dir():
        return
    for dirpath, _dirs, files in os.walk(site):
        for n in files:
            if n.endswith(".py"):
                os.utime(os.path.join(dirpath, n), (MTIME, MTIME), follow_symlinks=False)
    argv, env = native_python(base)
    r = subprocess.run([*argv, "-m", "compileall", "-q", "-j", "0", "-s", str(root), "-p", "/", str(site)],
                       env=env, capture_output=True, text=True)
    if r.returncode not in (0, 1):
        raise RuntimeError(f"compileall failed ({r.returncode}): {r.stderr[-2000:]}")


def image_config(layers_uncompressed: list[bytes], config: dict | None = None, *, arch: str = "amd64") -> dict:
    return {
        "architecture": arch,
        "os": "linux",
        "created": "2024-01-01T00:00:00Z",
        "config": dict(config or {}),
        "rootfs": {"type": "layers", "diff_ids": [sha256(b) for b in layers_uncompressed]},
        "history": [{"created_by": f"layer {i}"} for i in range(len(layers_uncompressed))],
    }


_blob_cache: dict[str, Path] = {}


def _write_blob(blobs: Path, data: bytes) -> str:
    d = sha256(data)
    dest = blobs / d.split(":", 1)[1]
    if not dest.exists():
        src = _blob_cache.get(d)
        try:
            if src is None or not src.exists():
                raise OSError
            os.link(src, dest)
        except OSError:
            dest.write_bytes(data)
            if len(data) > 1 << 20:
                _blob_cache[d] = dest
    return d


def write_oci_layout(
    dest: Path,
    layers: list[bytes],
    config: dict | None = None,
    *,
    ref_name: str | None = "latest",
    compress: bool | list[bool] = False,
    raw_config: dict | None = None,
) -> dict:
    """An OCI image layout at `dest` (a directory). `compress`: gzip the layer blobs (all, or per
    layer). Returns the digests: manifest, config, layers, diff_ids."""
    dest = Path(dest)
    blobs = dest / "blobs" / "sha256"
    blobs.mkdir(parents=True, exist_ok=True)
    flags = compress if isinstance(compress, list) else [compress] * len(layers)
    cfg = raw_config or image_config(layers, config)
    cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
    cfg_digest = _write_blob(blobs, cfg_bytes)
    descs = []
    for data, gz in zip(layers, flags):
        blob = gzip.compress(data, compresslevel=1, mtime=0) if gz else data
        d = _write_blob(blobs, blob)
        mt = "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if gz else "")
        descs.append({"mediaType": mt, "digest": d, "size": len(blob)})
    manifest = {
        "schemaVersion": 2,
        "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": cfg_digest, "size": len(cfg_bytes)},
        "layers": descs,
    }
    m_bytes = json.dumps(manifest, sort_keys=True).encode()
    m_digest = _write_blob(blobs, m_bytes)
    desc = {"mediaType": manifest["mediaType"], "digest": m_digest, "size": len(m_bytes),
            "platform": {"architecture": "amd64", "os": "linux"}}
    if ref_name:
        desc["annotations"] = {"org.opencontainers.image.ref.name": ref_name}
    index_path = dest / "index.json"
    index = json.loads(index_path.read_text()) if index_path.exists() else {"schemaVersion": 2, "manifests": []}
    index["manifests"].append(desc)
    index_path.write_text(json.dumps(index))
    (dest / "oci-layout").write_text(json.dumps({"imageLayoutVersion": "1.0.0"}))
    return {"manifest": m_digest, "config": cfg_digest, "layers": [d["digest"] for d in descs],
            "diff_ids": cfg["rootfs"]["diff_ids"]}


def tar_dir(src: Path, out: Path) -> Path:
    """An archive of a layout directory (an `oci-archive`)."""
    with tarfile.open(out, "w") as tf:
        for name in sorted(os.listdir(src)):
            tf.add(src / name, arcname=name)
    return out


def write_docker_save(out: Path, layers: list[bytes], config: dict | None = None, *,
                      repo_tags: list[str] | None = None) -> dict:
    """A `docker save` archive (legacy layout: <id>.json, <layer>/layer.tar, manifest.json)."""
    cfg = image_config(layers, config)
    cfg_bytes = json.dumps(cfg, sort_keys=True).encode()
    cfg_hex = hashlib.sha256(cfg_bytes).hexdigest()
    entries: list[tuple[str, bytes]] = [(f"{cfg_hex}.json", cfg_bytes)]
    names = []
    for data in layers:
        lid = hashlib.sha256(data).hexdigest()
        entries.append((f"{lid}/VERSION", b"1.0"))
        entries.append((f"{lid}/layer.tar", data))
        names.append(f"{lid}/layer.tar")
    manifest = [{"Config": f"{cfg_hex}.json", "RepoTags": repo_tags or [], "Layers": names}]
    entries.append(("manifest.json", json.dumps(manifest).encode()))
    with tarfile.open(out, "w") as tf:
        for name, data in entries:
            ti = tarfile.TarInfo(name)
            ti.size, ti.mtime, ti.mode = len(data), MTIME, 0o644
            tf.addfile(ti, io.BytesIO(data))
    return {"config": "sha256:" + cfg_hex, "diff_ids": cfg["rootfs"]["diff_ids"]}


def corrupt_blob(layout: Path, digest: str, offset: int = 600) -> None:
    """Flip one byte of a blob in place (its name then no longer matches its content)."""
    p = Path(layout) / "blobs" / "sha256" / digest.split(":", 1)[1]
    data = bytearray(p.read_bytes())
    data[min(offset, len(data) - 1)] ^= 0xFF
    p.unlink()  # it may be a hard link shared with other layouts
    p.write_bytes(bytes(data))


def copy_layout(src: Path, dest: Path) -> Path:
    shutil.copytree(src, dest, copy_function=os.link)
    return dest


# Debian 12's torch (1.13) as `RUN apt-get install -y python3-torch` adds it to the catalog python
# rootfs. torch links libblas.so.3 and liblapack.so.3, which update-alternatives points at a BLAS
# (the closure's first alternative is the reference libblas3/liblapack3); dpkg -x runs no
# maintainer script, so the links are made here.
TORCH_PACKAGES = ["python3-torch"]
TORCH_LINKS = {
    "usr/lib/x86_64-linux-gnu/libblas.so.3": "blas/libblas.so.3",
    "usr/lib/x86_64-linux-gnu/liblapack.so.3": "lapack/liblapack.so.3",
}


def torch_image(store: Path, base: str | os.PathLike, debdir: str | os.PathLike, ref: str = "torch") -> str:
    """An OCI layout `store/<ref>` (an image store entry): the rootfs `base` plus Debian's torch.
    Returns the reference to bake (`<ref>:1.13`). The .debs (~235 MiB) are kept in `debdir`."""
    base_layer = Layer().tree(base, skip=(".collimate-rootfs.json",)).bytes()
    torch = debian_layer(TORCH_PACKAGES, base, debdir, links=TORCH_LINKS, bytecode=True)
    write_oci_layout(Path(store) / ref, [base_layer, torch], {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/work"},
                     ref_name="1.13")
    return f"{ref}:1.13"


def native_python(root: str | os.PathLike) -> tuple[list[str], dict[str, str]]:
    """argv prefix and environment that run the tree `root`'s python3 on the host, through the
    tree's own loader and libraries (as the rootfs builder's "verify tree natively" does), so a
    native baseline runs the very files a sandbox of that tree runs. /lib and /usr/lib are on the
    path as well: the guest's loader searches them by default, and Debian's torch keeps libgloo
    there. It writes no .pyc into the tree (a sandbox's root filesystem is read-only)."""
    root = Path(root).resolve()
    libpath = ":".join(f"{root}/{d}" for d in ("lib/x86_64-linux-gnu", "usr/lib/x86_64-linux-gnu", "lib", "usr/lib"))
    argv = [f"{root}/usr/lib64/ld-linux-x86-64.so.2", "--inhibit-cache", "--library-path", libpath,
            f"{root}/usr/bin/python3.11"]
    return argv, {"PYTHONHOME": f"{root}/usr", "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8",
                  "PYTHONDONTWRITEBYTECODE": "1"}
