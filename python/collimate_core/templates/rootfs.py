"""Build a template's root filesystem from Debian packages: `apt-get download` + `dpkg -x`, no chroot.

The recipe's packages and their transitive Depends/Pre-Depends are downloaded into `<cache>/debs/`
(kept across builds; COLLIMATE_DEB_CACHE puts them elsewhere, e.g. outside a cache CI empties) and unpacked with `dpkg -x`, so no maintainer script runs. The tree is then
finished by hand (usrmerge symlinks, python3 and busybox applet links, /etc basics), checked natively
with its own dynamic loader, and renamed into `<cache>/rootfs/<name>-<key>/`
(one build per key at a time, however many threads and processes ask: see cache.py). The key hashes the
recipe, the resolved package versions and BUILD_VERSION, so a build with an unchanged key is a no-op.
A finished tree holds a manifest, `.collimate-rootfs.json`. The tree is a build product: never commit it.

Stdlib only: `guest/rootfs/build.py` loads this file by path, without importing collimate_core.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import importlib.util
import time
from pathlib import Path
from typing import Callable

if __package__:
    from collimate_core.templates import cache as _cache
else:  # loaded by path (guest/rootfs/build.py, tests/test_rootfs.py): its sibling, the same way
    _spec = importlib.util.spec_from_file_location("collimate_cache", Path(__file__).with_name("cache.py"))
    _cache = importlib.util.module_from_spec(_spec)
    _spec.loader.exec_module(_cache)

# Bump whenever the build steps change, so that existing trees are not reused.
BUILD_VERSION = 6

RECIPES: dict[str, tuple[str, ...]] = {
    # bash, tar, zip and unzip: what programs (and CPython's own tests) run as external tools;
    # busybox gives the rest of the usual command line.
    "python": ("python3.11-minimal", "libpython3.11-stdlib", "busybox-static", "bash", "tar", "zip", "unzip"),
}

# Dependencies that are only there to run maintainer scripts and triggers, which a `dpkg -x` tree
# never runs; they are left out with all that only they pull in (dpkg brings tar, libmd0, ...).
# Of an alternative group (`a | b`) the first real package is taken, as apt does, so the python
# recipe takes media-types, not mime-support -> mailcap -> perl, and meets only dpkg
# (readline-common: `dpkg | install-info`, for its info-directory trigger). The manifest lists the
# exclusions a build met.
EXCLUDED = {
    "dpkg": "only runs maintainer scripts and triggers, which a dpkg -x tree never runs",
    "install-info": "only updates the info directory from a trigger",
    "debconf": "only asks configuration questions from maintainer scripts",
    "perl-base": "only the language of maintainer scripts here",
    "perl": "only the language of maintainer scripts here (mailcap's update-mime)",
}

BUSYBOX_APPLETS = (
    "sh ls cat echo tr wc head tail sort grep sed mkdir rm cp mv env true false test [ sleep "
    "printf seq uname id pwd touch chmod ln"
).split()
PASSWD = [
    ("root", 0, 0, "/root", "/bin/sh"), ("daemon", 1, 1, "/usr/sbin", "/usr/sbin/nologin"),
    ("bin", 2, 2, "/bin", "/usr/sbin/nologin"), ("sys", 3, 3, "/dev", "/usr/sbin/nologin"),
    ("nobody", 65534, 65534, "/nonexistent", "/usr/sbin/nologin"),
    ("sandbox", 1000, 1000, "/work", "/bin/sh"),
]
GROUPS = [
    ("root", 0), ("daemon", 1), ("bin", 2), ("sys", 3), ("adm", 4), ("tty", 5), ("disk", 6),
    ("mail", 8), ("staff", 50), ("users", 100), ("nogroup", 65534), ("sandbox", 1000),
]
ALTERNATIVES = {"usr/sbin/rmt": "rmt-tar"}
ASYNCIO_HOOK_MARK = "collimate: asyncio child watcher"
ASYNCIO_HOOK = f"""

# {ASYNCIO_HOOK_MARK} (no threads in the sandbox: the pidfd watcher instead of one thread per child)
class _CollimateAsyncioHook:
    def find_spec(self, name, path=None, target=None):
        if name != "asyncio.unix_events":
            return None
        import sys, importlib.util
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(name)
        run = spec.loader.exec_module

        def exec_module(module):
            run(module)
            module.ThreadedChildWatcher = module.PidfdChildWatcher

        spec.loader.exec_module = exec_module
        return spec


__import__("sys").meta_path.insert(0, _CollimateAsyncioHook())
"""
MANIFEST = ".collimate-rootfs.json"
VERIFY_MODULES = ("json", "re", "hashlib", "sqlite3", "zipfile", "tempfile", "subprocess")
DEPENDS_FLAGS = ("--recurse", "--no-recommends", "--no-suggests", "--no-conflicts", "--no-breaks",
                 "--no-replaces", "--no-enhances")

_apt_updated = False


class RootfsError(RuntimeError):
    """A root filesystem build failed; the message says which step and why."""


def default_cache() -> Path:
    return _cache.cache_dir()


def _finished(dest: Path) -> bool:
    return (dest / MANIFEST).is_file()


class _NeedsFreshLists(Exception):
    """Planning or downloading failed (its cause): the package lists may be missing or stale, so
    refresh them and plan again (the key may change with them)."""


def build_rootfs(name: str = "python", cache: str | os.PathLike | None = None,
                 progress: Callable[[str], None] | None = None, force: bool = False) -> Path:
    """Build (or find already built) the root filesystem of recipe `name`; return its directory.
    Safe to call from many threads and processes at once: one of them builds (under the tree's
    lock, see cache.py), the others wait and use its tree."""
    say = progress or (lambda msg: None)
    if name not in RECIPES:
        raise RootfsError(f"unknown recipe {name!r}; known: {', '.join(sorted(RECIPES))}")
    cache = Path(cache) if cache is not None else default_cache()
    _cache.sweep(cache / "rootfs")
    while True:
        try:
            t0 = time.monotonic()
            try:
                plan = _plan(RECIPES[name], say)
            except RootfsError as e:
                raise _NeedsFreshLists() from e
            dest = cache / "rootfs" / f"{name}-{plan['key']}"
            if _finished(dest) and not force:
                say(f"{dest} is up to date")
                return dest
            t_resolve = time.monotonic() - t0
            built = _cache.build_once(
                dest, _finished, lambda tmp: _build(tmp, name, plan, cache, say, t0, t_resolve),
                kind="rootfs", key=dest.name, cache=cache, force=force, say=say)
            if not built:
                say(f"{dest} was finished by a concurrent build; using it")
            return dest
        except _NeedsFreshLists as e:
            err = e.__cause__
            # Missing (fresh machine) or stale package lists: refresh them once, then try again.
            if _apt_updated:
                raise err from None
            say(f"{err}\nrefreshing the package lists and trying again")
            try:
                with _cache.Lock(cache / "apt-update"):  # apt refuses a second update at once
                    _apt_update(say)
            except RootfsError as u:
                raise RootfsError(f"{err}\n(refreshing the package lists failed too: {u})") from None


def _build(root: Path, name: str, plan: dict, cache: Path, say, t0: float, t_resolve: float) -> None:
    """Download the plan's packages and make the tree in the empty directory `root`."""
    os.chmod(root, 0o755)  # the guest's / (a cache entry starts private)
    try:
        debs = _download(plan["packages"], _cache.deb_dir(cache), say)
    except RootfsError as e:
        raise _NeedsFreshLists() from e
    t_download = time.monotonic() - t0 - t_resolve
    t1 = time.monotonic()
    for i, deb in enumerate(debs, 1):
        say(f"extract [{i}/{len(debs)}] {deb.name}")
        _run(["dpkg", "-x", str(deb), str(root)], f"dpkg -x {deb.name}")
    t_extract = time.monotonic() - t1
    say("finish tree: usrmerge, links, /etc")
    _finish_tree(root)
    say("byte-compile the standard library")
    _compile_stdlib(root)
    say("verify tree natively")
    version = _verify(root)
    say(f"verified: python {version}")
    files, size = _tree_size(root)
    manifest = {
        "name": name, "key": plan["key"], "build_version": BUILD_VERSION,
        "recipe": list(RECIPES[name]), "packages": plan["packages"], "excluded": plan["excluded"],
        "python_version": version, "files": files, "size_bytes": size,
        "debs_bytes": sum(p["size"] for p in plan["packages"]),
        "built_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "seconds": {"resolve": round(t_resolve, 2), "download": round(t_download, 2),
                    "extract": round(t_extract, 2), "total": round(time.monotonic() - t0, 2)},
    }
    (root / MANIFEST).write_text(json.dumps(manifest, indent=1) + "\n")
    say(f"built {root.parent / (name + '-' + plan['key'])}: {len(plan['packages'])} packages, {files} files, "
        f"{size / 2**20:.1f} MiB in {manifest['seconds']['total']} s")


def _run(cmd: list[str], what: str, check: bool = True, **kw) -> str:
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, **kw)
    except FileNotFoundError:
        raise RootfsError(f"{what}: {cmd[0]} not found (building a root filesystem needs Debian's "
                          "apt-get, apt-cache and dpkg)") from None
    if check and res.returncode != 0:
        tail = "\n".join((res.stderr or res.stdout).strip().splitlines()[-15:])
        shown = " ".join(cmd) if len(" ".join(cmd)) < 300 else f"{cmd[0]} ..."
        raise RootfsError(f"{what} failed (exit {res.returncode}): {shown}\n{tail}")
    return res.stdout


def _apt_update(say) -> None:
    global _apt_updated
    say("apt-get update")
    _run(["apt-get", "update"], "apt-get update")
    _apt_updated = True


def _plan(roots, say) -> dict:
    """Resolve the closure of `roots` to exact packages and compute the build key."""
    names, excluded = _closure(roots)
    packages = _package_info(names)
    recipe = {"build_version": BUILD_VERSION, "recipe": list(roots),
              "packages": [[p["name"], p["version"], p["arch"]] for p in packages]}
    key = hashlib.sha256(json.dumps(recipe, sort_keys=True).encode()).hexdigest()[:16]
    say(f"resolved {len(packages)} packages (excluded: {', '.join(excluded) or 'none'}); key {key}")
    return {"key": key, "packages": packages, "excluded": excluded}


def _closure(roots) -> tuple[list[str], dict[str, str]]:
    """Depends/Pre-Depends closure of `roots`, taking the first real alternative of each group."""
    # It fails when no root is known: _package_info then says which are unknown.
    out = _run(["apt-cache", "depends", *DEPENDS_FLAGS, *roots], "apt-cache depends", check=False)
    graph: dict[str, list[list[str]]] = {}
    cur, group = None, []
    for line in out.splitlines():
        if not line.startswith(" "):
            cur = graph.setdefault(line.strip(), [])
        elif line[1] in " |" and line[2:].lstrip().startswith(("Depends:", "PreDepends:")):
            group.append(line.split(":", 1)[1].strip())
            if line[1] != "|":  # '|' marks an alternative continued on the next line
                cur.append(group)
                group = []
        # lines indented by four list the providers of a virtual package: not followed
    names, excluded, todo = set(), {}, list(roots)
    while todo:
        pkg = todo.pop()
        if pkg in names:
            continue
        names.add(pkg)
        for alts in graph.get(pkg, []):
            real = [a for a in alts if not a.startswith("<")]  # <name>: virtual, skipped
            if not real:
                continue
            if real[0] in EXCLUDED:
                excluded[real[0]] = EXCLUDED[real[0]]
            else:
                todo.append(real[0])
    return sorted(names), dict(sorted(excluded.items()))


def _package_info(names) -> list[dict]:
    out = _run(["apt-cache", "show", "--no-all-versions", *names], "apt-cache show", check=False)
    info = {}
    for stanza in out.split("\n\n"):
        fields = dict(line.split(": ", 1) for line in stanza.splitlines()
                      if ": " in line and not line.startswith(" "))
        if "Filename" in fields and fields["Package"] not in info:  # else: installed, no source
            info[fields["Package"]] = {
                "name": fields["Package"], "version": fields["Version"],
                "arch": fields["Architecture"], "size": int(fields["Size"]),
                "installed_kib": int(fields.get("Installed-Size", 0)), "sha256": fields["SHA256"]}
    missing = [n for n in names if n not in info]
    if missing:
        raise RootfsError(f"no downloadable candidate for package(s): {', '.join(missing)} "
                          "(unknown name, or not in the configured apt sources)")
    return [info[n] for n in names]


def _download(packages, debdir: Path, say) -> list[Path]:
    """Download the exact package versions into `debdir` (reused: files are checked by SHA256)."""
    debdir.mkdir(parents=True, exist_ok=True)
    debs, want = [], []
    for p in packages:
        path = debdir / f"{p['name']}_{p['version'].replace(':', '%3a')}_{p['arch']}.deb"
        debs.append(path)
        if not (path.is_file() and _sha256(path) == p["sha256"]):
            want.append((p, path))
    if not want:
        say(f"all {len(debs)} .debs are cached")
        return debs
    say(f"apt-get download: {len(want)} of {len(debs)} packages, "
        f"{sum(p['size'] for p, _ in want) / 2**20:.1f} MiB")
    _cache.sweep(debdir)  # downloads of killed builds
    with _cache.Temp(debdir / "download") as tmp:
        _run(["apt-get", "download", *(f"{p['name']}={p['version']}" for p, _ in want)],
             "apt-get download", cwd=tmp)
        for p, path in want:
            got = Path(tmp) / path.name
            if not got.is_file() or _sha256(got) != p["sha256"]:
                raise RootfsError(f"apt-get download did not produce a valid {path.name}")
            got.rename(path)
    return debs


def _sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return hashlib.file_digest(f, "sha256").hexdigest()


def _finish_tree(root: Path) -> None:
    """Do what maintainer scripts and base-files would: make the unpacked tree usable."""
    # usrmerge: Debian 12 packages ship files under /bin, /lib, ... as well as /usr. Move them under
    # /usr and make the top-level names symlinks, as on an installed Debian 12.
    for d in ("bin", "sbin", "lib", "lib64"):
        top, usr = root / d, root / "usr" / d
        usr.mkdir(parents=True, exist_ok=True)
        if top.is_dir() and not top.is_symlink():
            _merge_into(top, usr, root)
        if not top.is_symlink():
            top.symlink_to(f"usr/{d}")
    _relativize_links(root)

    usrbin = root / "usr/bin"
    for name in ("python3", "python"):  # `python task.py` works as in the usual images
        if not os.path.lexists(usrbin / name):
            (usrbin / name).symlink_to("python3.11")
    # asyncio's default child watcher starts a thread per child process, and the sandbox runs no
    # threads: use the pidfd watcher (Python 3.12's default where pidfds exist), set when asyncio
    # is first imported, so that nothing is imported at startup for it.
    site = root / "etc/python3.11/sitecustomize.py"
    if site.is_file() and ASYNCIO_HOOK_MARK not in site.read_text():
        with open(site, "a") as f:
            f.write(ASYNCIO_HOOK)
    # What maintainer scripts would have made with update-alternatives (tar's /etc/rmt points there).
    for link, target in ALTERNATIVES.items():
        if (root / link).parent.joinpath(target).exists() and not os.path.lexists(root / link):
            (root / link).symlink_to(target)
    for applet in BUSYBOX_APPLETS:  # sh -> busybox too: there is no dash
        if not any(os.path.lexists(root / d / applet) for d in ("usr/bin", "usr/sbin")):
            (usrbin / applet).symlink_to("busybox")

    os.chmod(root, 0o755)
    for d, mode in (("tmp", 0o1777), ("work", 0o755), ("dev", 0o755), ("proc", 0o755),
                    ("root", 0o700), ("etc", 0o755)):
        (root / d).mkdir(exist_ok=True)
        os.chmod(root / d, mode)
    if os.geteuid() == 0:
        os.chown(root / "work", 1000, 1000)
    etc = root / "etc"
    # The accounts and groups of a Debian base system (ids as Debian assigns them), plus the
    # sandbox user: programs look some of them up by name (nobody, nogroup, staff, users).
    (etc / "passwd").write_text("".join(f"{n}:x:{u}:{g}:{n}:{h}:{s}\n" for n, u, g, h, s in PASSWD))
    (etc / "group").write_text("".join(f"{n}:x:{g}:\n" for n, g in GROUPS))
    (etc / "hostname").write_text("sandbox\n")
    (etc / "hosts").write_text("127.0.0.1\tlocalhost\n127.0.1.1\tsandbox\n"
                               "::1\tlocalhost ip6-localhost ip6-loopback\n")


def _merge_into(src: Path, dst: Path, root: Path) -> None:
    for entry in list(src.iterdir()):
        target = dst / entry.name
        if entry.is_dir() and not entry.is_symlink() and target.is_dir() and not target.is_symlink():
            _merge_into(entry, target, root)
        elif os.path.lexists(target):
            same = (os.readlink(entry) == os.readlink(target) if entry.is_symlink() and
                    target.is_symlink() else _same_file(entry, target))
            if not same:
                raise RootfsError(f"usrmerge conflict: /{entry.relative_to(root)} and "
                                  f"/{target.relative_to(root)} differ")
        else:
            entry.rename(target)
    shutil.rmtree(src)


def _same_file(a: Path, b: Path) -> bool:
    return (a.is_file() and b.is_file() and not a.is_symlink() and not b.is_symlink()
            and a.read_bytes() == b.read_bytes())


def _relativize_links(root: Path) -> None:
    """Rewrite absolute symlinks as relative ones: same meaning inside the guest, and they resolve
    within the tree (not into the host's /) when the host looks at it, e.g. to verify it."""
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            link = os.path.join(dirpath, n)
            if os.path.islink(link) and (target := os.readlink(link)).startswith("/"):
                rel = os.path.relpath(target, "/" + os.path.relpath(dirpath, root))
                os.unlink(link)
                os.symlink(rel, link)


_VERIFY_CODE = """
import sys, os, zlib, {modules}
root = os.path.realpath(sys.argv[1])
sqlite3.connect(":memory:").execute("select sqlite_version()").fetchone()
hashlib.sha256(b"x").hexdigest(); zlib.decompress(zlib.compress(b"x"))
libs = {{l.split(None, 5)[5].strip() for l in open("/proc/self/maps") if len(l.split(None, 5)) == 6}}
outside = sorted(p for p in libs if ".so" in p and not p.startswith(root + "/"))
files = [os.path.realpath(m.__file__) for m in list(sys.modules.values()) if getattr(m, "__file__", 0)]
outside += sorted(f for f in files if not f.startswith(root + "/"))
if outside:
    sys.exit("loaded from outside the tree: " + ", ".join(outside))
print(sys.version.split()[0])
"""


def _native_python(root: Path) -> tuple[list[str], dict[str, str]]:
    """The command (loader, library path, interpreter) and environment that run the tree's python
    natively, with the tree's own loader and libraries."""
    loader = root / "usr/lib64/ld-linux-x86-64.so.2"
    if not str(loader.resolve()).startswith(f"{root}/") or not loader.resolve().is_file():
        raise RootfsError(f"verify: {loader.relative_to(root)} does not resolve within the tree")
    libpath = f"{root}/lib/x86_64-linux-gnu:{root}/usr/lib/x86_64-linux-gnu"
    env = {"PYTHONHOME": f"{root}/usr", "PATH": "/usr/bin:/bin", "LC_ALL": "C.UTF-8"}
    return [str(loader), "--inhibit-cache", "--library-path", libpath, f"{root}/usr/bin/python3.11"], env


# Left uncompiled, as Debian's py3compile leaves them: the test suite and lib2to3's test data
# (files with syntax errors on purpose).
_NO_BYTECODE = r"/(test|tests|idle_test)/|/lib2to3/tests/"


def _compile_stdlib(root: Path) -> None:
    """What the python packages' postinst does with py3compile (dpkg -x runs no maintainer
    scripts): byte-compile the standard library. A sandbox's root filesystem is read-only, so
    CPython cannot write __pycache__ there: without this, every import of a standard module in a
    new interpreter (`python3 task.py`, a grader's subprocess) compiled it from source again.
    Hash-checked .pyc (PEP 552): valid whatever the files' times, and still checked against their
    source; the names in them are the guest's (/usr/lib/python3.11/...), not the build's."""
    root = root.resolve()
    cmd, env = _native_python(root)
    lib = root / "usr/lib/python3.11"
    _run(cmd + ["-S", "-m", "compileall", "-q", "-j", "0", "--invalidation-mode", "checked-hash",
                "-s", str(root), "-p", "/", "-x", _NO_BYTECODE, str(lib)],
         "byte-compile the standard library", env=env)


def _verify(root: Path) -> str:
    """Run the tree's python and busybox natively with the tree's own loader and libraries."""
    root = root.resolve()
    python, env = _native_python(root)
    code = _VERIFY_CODE.format(modules=", ".join(VERIFY_MODULES))
    cmd = python + ["-S", "-c", code, str(root)]
    version = _run(cmd, "verify python (import " + ", ".join(VERIFY_MODULES) + ")", env=env).strip()
    if _run([f"{root}/bin/busybox", "echo", "ok"], "verify busybox").strip() != "ok":
        raise RootfsError("verify: busybox echo ok did not print ok")
    applets = set(_run([f"{root}/bin/busybox", "--list"], "busybox --list").split())
    if missing := sorted(set(BUSYBOX_APPLETS) - applets):
        raise RootfsError(f"verify: busybox lacks applets: {' '.join(missing)}")
    return version


def _tree_size(root: Path) -> tuple[int, int]:
    files = size = 0
    for dirpath, dirnames, filenames in os.walk(root):
        for n in dirnames + filenames:
            files += 1
            size += os.lstat(os.path.join(dirpath, n)).st_size
    return files, size
