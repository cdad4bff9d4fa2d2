"""The python template's root filesystem recipe (python/collimate_core/templates/rootfs.py, CLI
guest/rootfs/build.py). Builds for real from Debian's package archive into a temporary cache
(about 14 MiB of .debs, a few seconds); skipped only where apt-get or dpkg is missing.

The module is loaded by path, as guest/rootfs/build.py does: the recipe needs no native module.
"""

import importlib.util
import json
import os
import shutil
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("collimate_rootfs",
                                               REPO / "python/collimate_core/templates/rootfs.py")
rootfs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rootfs)

pytestmark = pytest.mark.skipif(
    not (shutil.which("apt-get") and shutil.which("apt-cache") and shutil.which("dpkg")),
    reason="building a root filesystem needs Debian's apt-get, apt-cache and dpkg")


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    cache = tmp_path_factory.mktemp("cache")
    messages: list[str] = []
    root = rootfs.build_rootfs("python", cache=cache, progress=messages.append)
    return cache, root, messages


def _native(root: Path, *args: str, **kw) -> subprocess.CompletedProcess:
    """Run the tree's python with the tree's own loader and libraries, on the host."""
    libpath = f"{root}/lib/x86_64-linux-gnu:{root}/usr/lib/x86_64-linux-gnu"
    return subprocess.run(
        [f"{root}/usr/lib64/ld-linux-x86-64.so.2", "--inhibit-cache", "--library-path", libpath,
         f"{root}/usr/bin/python3.11", "-S", *args],
        env={"PYTHONHOME": f"{root}/usr", "PATH": f"{root}/usr/bin"},
        capture_output=True, text=True, timeout=60, **kw)


def test_manifest(built):
    cache, root, messages = built
    manifest = json.loads((root / rootfs.MANIFEST).read_text())
    assert root.parent == cache / "rootfs"
    assert root.name == f"python-{manifest['key']}"
    assert manifest["recipe"] == list(rootfs.RECIPES["python"])
    versions = {p["name"]: p["version"] for p in manifest["packages"]}
    for pkg in (*rootfs.RECIPES["python"], "libpython3.11-minimal", "libc6", "libsqlite3-0",
                "zlib1g", "libssl3", "libffi8", "libexpat1"):
        assert versions.get(pkg), pkg
    assert not set(versions) & set(rootfs.EXCLUDED), "a maintainer-script package got in"
    assert "perl" not in " ".join(versions)
    assert "dpkg" in manifest["excluded"]
    assert all(p["size"] > 0 and len(p["sha256"]) == 64 for p in manifest["packages"])
    assert manifest["size_bytes"] > 20 * 2**20 and manifest["files"] > 500
    assert manifest["python_version"].startswith("3.11.")
    assert set(manifest["seconds"]) == {"resolve", "download", "extract", "total"}
    assert any(m.startswith("verified: python 3.11") for m in messages)
    kept = {d.name for d in rootfs._cache.deb_dir(cache).glob("*.deb")}  # may be shared: a superset
    assert {f"{p['name']}_{p['version'].replace(':', '%3a')}_{p['arch']}.deb" for p in manifest["packages"]} <= kept


def test_layout(built):
    _, root, _ = built
    for d in ("bin", "sbin", "lib", "lib64"):
        assert os.readlink(root / d) == f"usr/{d}"
    loader = (root / "lib64/ld-linux-x86-64.so.2").resolve()
    assert loader.is_file() and loader.is_relative_to(root)
    assert os.readlink(root / "usr/bin/python3") == "python3.11"
    for applet in rootfs.BUSYBOX_APPLETS:
        assert os.readlink(root / "usr/bin" / applet) == "busybox", applet
    assert (root / "bin/busybox").is_file()
    for tool in ("bash", "tar", "zip", "unzip"):  # external tools programs expect, from Debian
        assert (root / "usr/bin" / tool).is_file() and not (root / "usr/bin" / tool).is_symlink(), tool
    assert "nogroup:x:65534:" in (root / "etc/group").read_text()
    assert "nobody:x:65534:65534:" in (root / "etc/passwd").read_text()
    assert stat.S_IMODE((root / "tmp").stat().st_mode) == 0o1777
    for d in ("work", "dev", "proc", "etc"):
        assert (root / d).is_dir()
    assert "sandbox:x:1000:1000:" in (root / "etc/passwd").read_text()
    assert (root / "etc/passwd").read_text().startswith("root:x:0:0:")
    assert "sandbox:x:1000:" in (root / "etc/group").read_text()
    assert (root / "etc/hostname").read_text() == "sandbox\n"
    assert "localhost" in (root / "etc/hosts").read_text()
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            p = os.path.join(dirpath, n)
            if os.path.islink(p):
                assert not os.readlink(p).startswith("/"), f"absolute symlink {p}"
                assert os.path.exists(p), f"dangling symlink {p}"
                assert Path(p).resolve().is_relative_to(root), f"symlink out of the tree {p}"


def test_runs_natively(built):
    _, root, _ = built
    code = ("import sqlite3, json, zipfile, io, hashlib, subprocess;"
            "print(sqlite3.connect(':memory:').execute('select 6*7').fetchone()[0]);"
            "b = io.BytesIO(); zipfile.ZipFile(b, 'w').writestr('a', json.dumps([1]));"
            "print(hashlib.sha256(b'').hexdigest()[:8])")
    res = _native(root, "-c", code)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["42", "e3b0c442"]
    # busybox sh finds the applet symlinks on PATH
    res = subprocess.run([f"{root}/bin/sh", "-c", "echo hello | tr a-z A-Z; seq 3 | wc -l"],
                         env={"PATH": f"{root}/usr/bin"}, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.split() == ["HELLO", "3"]


def test_rebuild_is_noop(built):
    cache, root, _ = built
    manifest = root / rootfs.MANIFEST
    before = manifest.stat()
    messages: list[str] = []
    t = time.monotonic()
    assert rootfs.build_rootfs("python", cache=cache, progress=messages.append) == root
    assert time.monotonic() - t < 30
    assert any("up to date" in m for m in messages)
    assert not any(m.startswith(("extract", "apt-get download")) for m in messages)
    after = manifest.stat()
    assert (after.st_ino, after.st_mtime_ns) == (before.st_ino, before.st_mtime_ns)
    assert sorted(p.name for p in (cache / "rootfs").iterdir()) == [root.name]


def test_sweeps_killed_builds(built):
    # A build killed outright (SIGKILL) leaves its temporary tree; the next build removes it.
    cache, root, _ = built
    dead = subprocess.Popen(["true"])
    dead.wait()
    killed = cache / "rootfs" / f".{root.name}.{dead.pid}.x1.tmp"
    running = cache / "rootfs" / f".{root.name}.{os.getpid()}.x2.tmp"
    for d in (killed, running):
        (d / "root/usr").mkdir(parents=True)
    rootfs.build_rootfs("python", cache=cache)
    assert not killed.exists() and running.exists()
    shutil.rmtree(running)


def test_cli_prints_path(built):
    cache, root, _ = built
    res = subprocess.run([sys.executable, str(REPO / "guest/rootfs/build.py"), "--cache", str(cache)],
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr
    assert res.stdout == f"{root}\n"
    assert "up to date" in res.stderr

    res = subprocess.run([sys.executable, str(REPO / "guest/rootfs/build.py"), "--name", "nope"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode != 0 and "nope" in res.stderr and not res.stdout


def test_unknown_package_fails_cleanly(built, monkeypatch):
    cache, root, _ = built
    monkeypatch.setitem(rootfs.RECIPES, "broken", ("busybox-static", "no-such-package-collimate"))
    with pytest.raises(rootfs.RootfsError, match="no downloadable candidate.*no-such-package-collimate"):
        rootfs.build_rootfs("broken", cache=cache)
    assert sorted(p.name for p in (cache / "rootfs").iterdir()) == [root.name]


def test_failed_verification_leaves_nothing(built, monkeypatch):
    # Downloads and unpacks busybox alone, then fails verification: no loader, no python.
    cache, root, _ = built
    monkeypatch.setitem(rootfs.RECIPES, "broken", ("busybox-static",))
    with pytest.raises(rootfs.RootfsError, match="verify: .*ld-linux-x86-64.so.2"):
        rootfs.build_rootfs("broken", cache=cache)
    assert sorted(p.name for p in (cache / "rootfs").iterdir()) == [root.name]


def test_default_cache(monkeypatch, tmp_path):
    monkeypatch.setenv("COLLIMATE_CACHE", str(tmp_path / "a"))
    assert rootfs.default_cache() == tmp_path / "a"
    monkeypatch.delenv("COLLIMATE_CACHE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "x"))
    assert rootfs.default_cache() == tmp_path / "x/collimate"
    monkeypatch.delenv("XDG_CACHE_HOME")
    monkeypatch.setenv("HOME", str(tmp_path / "h"))
    assert rootfs.default_cache() == tmp_path / "h/.cache/collimate"
