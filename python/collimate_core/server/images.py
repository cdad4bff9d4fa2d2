"""Tenants' image stores: uploaded archives (OCI layout or `docker save`) verified against their
digests and kept per tenant under its image quota, and the namespace of its templates."""

from __future__ import annotations

import hashlib
import io
import json
import os
import re
import threading
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from collimate_core.templates import cache as _cache
from collimate_core.sdk.errors import InvalidArgument, NotFoundError
from collimate_core.server.config import IMAGE_NAME
from collimate_core.server.errors import _no_image, _over_quota
from collimate_core.server.models import ImageInfo


def _tenant_key(tenant: str) -> str:
    return hashlib.sha256(tenant.encode()).hexdigest()[:24]


def _namespace(tenant: str) -> str:
    """The prefix of the engine names of a tenant's templates (tenant template names have no "/")."""
    return f"tenant-{_tenant_key(tenant)}/"


class _ImageStore:
    """A tenant's image store: the archives it uploaded, and an index of them beside the store.

    `<name>.tar` is the newest upload under `name`, the one the bare name refers to; older uploads
    under the name stay as `<name>@<hex>.tar`, named by their reference `name@sha256:<hex>`, until
    deleted. The index (`images.json`, next to the store, never inside it) records each upload:
    digest, image id, format, layers, bytes, when. Uploading the same image under the same name
    again replaces that upload. Blocking (run in worker threads); one lock per tenant orders the
    changes, so the quota check and the rename that keeps an upload happen together; an flock on
    the index (`.images.json.lock`) orders them with other server processes on the same cache.
    """

    def __init__(self, path: Path):
        self.path = path
        self.index_path = path.parent / "images.json"
        self.lock = threading.Lock()

    @contextmanager
    def _changing(self):
        """Both locks, for a change (the thread lock first: one flock waiter per process)."""
        with self.lock, _cache.Lock(self.index_path):
            _cache.sweep(self.path)  # uploads a killed server left
            yield

    def _archives(self) -> dict[str, Path]:
        try:
            return {e.name: Path(e.path) for e in os.scandir(self.path)
                    if not e.name.startswith(".") and e.name.endswith(".tar") and e.is_file(follow_symlinks=False)}
        except FileNotFoundError:
            return {}

    def used(self) -> int:
        """Bytes the tenant keeps: every file of the store but uploads still arriving."""
        total = 0
        try:
            for e in os.scandir(self.path):
                if not e.name.startswith(".upload") and e.is_file(follow_symlinks=False):
                    total += e.stat(follow_symlinks=False).st_size
        except FileNotFoundError:
            pass
        return total

    def _load(self) -> dict[str, list[dict]]:
        """name -> its uploads, oldest first (the last is the newest, `<name>.tar`). Files the index
        does not know (kept by an older server) are described from the archive itself; records of
        files that are gone are dropped."""
        try:
            raw = json.loads(self.index_path.read_text())["images"]
            index = {n: [v for v in vs if isinstance(v, dict) and _RECORD <= v.keys() and isinstance(v["file"], str)]
                     for n, vs in raw.items() if isinstance(vs, list)}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            index = {}
        files = self._archives()
        known = set()
        for name in list(index):
            index[name] = [v for v in index[name] if v["file"] in files]
            known.update(v["file"] for v in index[name])
        for fname, path in files.items():
            name = fname.removesuffix(".tar").split("@", 1)[0]
            if fname in known or not re.fullmatch(IMAGE_NAME, name):
                continue
            rec = _describe_archive(path)
            if rec is not None:
                index.setdefault(name, []).append(rec)
        for name, vs in list(index.items()):
            if not vs:
                del index[name]
            else:
                vs.sort(key=lambda v: (v["file"] == f"{name}.tar", v.get("uploaded", 0.0)))
        return index

    def _save(self, index: dict[str, list[dict]]) -> None:
        _cache.write_atomic(self.index_path, json.dumps({"images": index}, indent=1, sort_keys=True))

    def listing(self) -> tuple[dict[str, list[dict]], int]:
        with self.lock:
            return self._load(), self.used()

    def room(self, name: str | None) -> tuple[int, int]:
        """(bytes kept, the most an upload under `name` could replace)."""
        with self.lock:
            index = self._load() if name else {}
            return self.used(), max((v["bytes"] for v in index.get(name or "", [])), default=0)

    def pin(self, ref: str) -> str | None | bool:
        """The exact upload a bake's reference names: for `name`, `name@<digest>` of the newest upload
        under it; `name@<digest>` itself if there is such an upload under the name; False if there
        is none; None for other references (tags, registries: looked up by the images' own names)."""
        from collimate_core.templates import oci as _oci

        try:
            r = _oci.parse_reference(ref)
        except _oci.ImageError:
            return None
        if r.registry or r.tag or not re.fullmatch(IMAGE_NAME, r.repository):
            return None
        with self.lock:
            versions = self._load().get(r.repository)
        if not versions:
            return False
        if r.digest is None:
            return f"{r.repository}@{versions[-1]['digest']}"
        return ref if any(r.digest in (v["digest"], v["image_id"]) for v in versions) else False

    def keep(self, tmp: Path, name: str, info: dict, size: int, quota: int) -> dict:
        """Keep the verified upload `tmp` as the newest under `name`; 413 (and nothing kept) if it
        would take the tenant over `quota` bytes."""
        with self._changing():
            index = self._load()
            versions = index.get(name, [])
            same = next((v for v in versions if v["digest"] == info["digest"]), None)
            used = self.used()
            replaced = (self.path / same["file"]).stat().st_size if same is not None else 0
            if quota and used - replaced + size > quota:
                raise _over_quota(used, quota, size)
            newest = f"{name}.tar"
            for v in versions:
                if v is not same and v["file"] == newest:  # the one before stays, under its digest
                    older = f"{name}@{v['digest'].split(':', 1)[1]}.tar"
                    # A second name first, then the new upload over the first: `<name>.tar` never
                    # goes missing for a bake reading the store meanwhile (no lock needed there).
                    try:
                        os.link(self.path / newest, self.path / older)
                    except FileExistsError:
                        os.replace(self.path / newest, self.path / older)
                    v["file"] = older
            if same is not None:
                versions.remove(same)
                if same["file"] != newest:
                    (self.path / same["file"]).unlink(missing_ok=True)
            os.replace(tmp, self.path / newest)
            rec = {"file": newest, "digest": info["digest"], "image_id": info["image_id"], "format": info["format"],
                   "layers": info["layers"], "bytes": size, "uploaded": time.time()}
            versions.append(rec)
            index[name] = versions
            self._save(index)
            return {"record": rec, "versions": len(versions), "used": used - replaced + size}

    def delete(self, name: str, digest: str | None) -> list[dict]:
        """Remove the uploads under `name` (or the one with `digest`); the newest left becomes what
        the name refers to. NotFoundError if there is none."""
        with self._changing():
            index = self._load()
            versions = index.get(name, [])
            if digest is None:
                # also archives under the name that hold no single image (not listed, but counted)
                files = [p for f, p in self._archives().items() if f.removesuffix(".tar").split("@", 1)[0] == name]
                if not files:
                    raise _no_image(name)
                for path in files:
                    path.unlink(missing_ok=True)
                index.pop(name, None)
                self._save(index)
                return versions
            if not versions:
                raise _no_image(name)
            gone = [v for v in versions if digest in (v["digest"], v["image_id"])]
            if not gone:
                raise NotFoundError(f"image {name!r} has no upload with digest {digest}: GET /v1/images/{name} "
                                    "lists its uploads")
            left = [v for v in versions if all(v is not g for g in gone)]
            for v in gone:
                (self.path / v["file"]).unlink(missing_ok=True)
            newest = f"{name}.tar"
            if left and left[-1]["file"] != newest:
                os.replace(self.path / left[-1]["file"], self.path / newest)
                left[-1]["file"] = newest
            if left:
                index[name] = left
            else:
                index.pop(name, None)
            self._save(index)
            return gone


_RECORD = {"file", "digest", "image_id", "format", "layers", "bytes", "uploaded"}  # an upload in the index


def _describe_archive(path: Path) -> dict | None:
    """An index record for an archive the index does not know; None if it holds no single image."""
    from collimate_core.templates import oci as _oci

    try:
        img = _oci.open_image(path)
    except Exception:  # noqa: BLE001 - not listed, still counted and deletable by name
        return None
    try:
        st = path.stat()
        return {"file": path.name, "digest": img.digest, "image_id": img.id, "format": img.format,
                "layers": len(img.layers), "bytes": st.st_size, "uploaded": st.st_mtime}
    finally:
        img.close()


def _image_info(name: str, rec: dict, latest: bool) -> ImageInfo:
    return ImageInfo(name=name, reference=f"{name}@{rec['digest']}", digest=rec["digest"], image_id=rec["image_id"],
                     format=rec["format"], layers=rec["layers"], bytes=rec["bytes"], uploaded=rec["uploaded"],
                     latest=latest)


_UPLOAD_HINT = ("upload the image with POST /v1/images (Template.bake from the remote client does it for you) and "
                "bake from the reference it answers")


def _check_image_reference(image: str) -> str:
    """`image` if it is an image reference; 400 if it looks like a path: a tenant never names a
    file on this host, only images in its own store."""
    from collimate_core.templates import oci as _oci

    text = image.strip()
    base = text.split("@", 1)[0]
    if (text.startswith(("/", ".", "~")) or "\\" in text or "//" in text or "/." in text or "./" in text
            or base.endswith(_oci.ARCHIVE_SUFFIXES)):
        raise InvalidArgument(f"image {image!r} looks like a path: a server never reads images from its own disk for "
                              f"you; {_UPLOAD_HINT}")
    try:
        _oci.parse_reference(text)
    except _oci.ImageError as e:
        raise InvalidArgument(f"image {image!r} is not an image reference (name, name:tag or name@sha256:<hex>): {e}; "
                              f"to bake a local image, {_UPLOAD_HINT}") from None
    return text


def _verify_archive(path: Path, digest: str | None, tag: str | None, unpacked_limit: int) -> dict:
    """Open the uploaded archive, select its image (by digest or tag, or the only one), and verify
    it: its manifest and config against their digests, every layer blob against its digest, and
    every layer's uncompressed content against the config's diff id. So the image id (the config
    digest) pins content the tenant really sent, and a root filesystem unpacked for one tenant's
    image may serve another's with the same id. InvalidArgument saying why when it is not a usable
    image."""
    from collimate_core.templates import oci as _oci

    def why(e: BaseException) -> str:
        msg = str(e) if isinstance(e, _oci.ImageError) else f"malformed ({type(e).__name__}: {e})"
        return msg.replace(str(path), "the uploaded archive")

    try:
        img = _oci.open_image(path, digest=digest, tag=tag)
    except Exception as e:  # noqa: BLE001 - whatever a hostile archive does to the reader is a 400
        raise InvalidArgument(f"not a usable image archive: {why(e)}") from None
    try:
        c = img.container
        assert c is not None
        total = 0
        for i, layer in enumerate(img.layers, 1):
            what = f"layer {i}/{len(img.layers)} ({layer.digest or layer.name})"
            with c.open(layer.name) as f:
                raw = _oci._HashingReader(f)
                inner = _oci._HashingReader(_oci._decompressed(io.BufferedReader(raw, 1 << 20), what))
                while chunk := inner.read(1 << 20):
                    total += len(chunk)
                    if total > unpacked_limit:
                        raise _oci.ImageError(f"the layers unpack to more than {unpacked_limit} bytes, this server's "
                                              "limit (8x max_image_upload)")
                _drain_raw(raw)
            if layer.digest and raw.digest() != layer.digest:
                raise _oci.ImageError(f"{what} does not match its digest: the blob hashes to {raw.digest()}")
            if inner.digest() != layer.diff_id:
                raise _oci.ImageError(f"{what}: its content hashes to {inner.digest()}, but the config's diff id is "
                                      f"{layer.diff_id}")
        default = "image"
        for n in img.names:
            try:
                repo = _oci.parse_reference(n).repository.rsplit("/", 1)[-1].lower()
            except _oci.ImageError:
                continue
            if re.fullmatch(IMAGE_NAME, repo):
                default = repo
                break
        return {"digest": img.digest, "image_id": img.id, "format": img.format, "layers": len(img.layers),
                "default_name": default}
    except Exception as e:  # noqa: BLE001
        raise InvalidArgument(f"the image archive is corrupt: {why(e)}") from None
    finally:
        img.close()


def _drain_raw(r: Any) -> None:
    """Read what is left of a layer blob after its compressed stream ended (trailing bytes count
    toward its digest)."""
    while r.read(1 << 20):
        pass
