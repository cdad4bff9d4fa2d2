"""Debian's procps (ps, pgrep) and coreutils' timeout, for a sandbox whose template lacks them:
the packages' Depends closure downloaded with `apt-get download` into the cache's debs/ (reused)
and unpacked with `dpkg -x`, as the rootfs builder does. Writes DEST/bin/{ps,pgrep,timeout} and
DEST/lib/ with the shared libraries the programs need that the base rootfs lacks (run them with
LD_LIBRARY_PATH=<where DEST is in the sandbox>/lib).

    python3 tests/debian_tools.py DEST BASE_ROOTFS
"""

from __future__ import annotations

import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "python"))
from imagefixtures import _rootfs_module  # noqa: E402

PROGRAMS = {"ps": "procps", "pgrep": "procps", "timeout": "coreutils"}


def write_tools(dest: Path, base: Path) -> None:
    from collimate_core.templates import cache as _cache
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        raise RuntimeError("needs Debian's apt-get and dpkg")
    rootfs = _rootfs_module()
    names, _excluded = rootfs._closure(sorted(set(PROGRAMS.values())))
    keep = set(PROGRAMS.values()) | {n for n in names if n.startswith("lib") and n not in ("libc6", "libc-bin")}
    debs = rootfs._download(rootfs._package_info(sorted(keep)), _cache.deb_dir(_cache.cache_dir()), lambda msg: None)
    have = {p.name for p in (base / "usr/lib/x86_64-linux-gnu").glob("*.so*")}
    with tempfile.TemporaryDirectory(prefix="debian-tools-") as tmp:
        root = Path(tmp)
        for deb in debs:
            subprocess.run(["dpkg", "-x", str(deb), tmp], check=True, capture_output=True)
        (dest / "bin").mkdir(parents=True, exist_ok=True)
        (dest / "lib").mkdir(parents=True, exist_ok=True)
        for prog in PROGRAMS:
            src = next(p for p in (root / "usr/bin" / prog, root / "bin" / prog) if p.exists())
            shutil.copyfile(src, dest / "bin" / prog)
            (dest / "bin" / prog).chmod(0o755)
        for libdir in (root / "usr/lib/x86_64-linux-gnu", root / "lib/x86_64-linux-gnu"):
            for so in (libdir.glob("*.so.*") if libdir.is_dir() else ()):
                if so.name not in have:
                    shutil.copyfile(so.resolve(), dest / "lib" / so.name)


if __name__ == "__main__":
    write_tools(Path(sys.argv[1]), Path(sys.argv[2]))
