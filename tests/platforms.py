"""The platform matrix (docs/platforms.md, "The test matrix"): which platforms a test module runs
on, and running a command with /dev/kvm hidden.

A test that takes the `platform` fixture (tests/conftest.py) runs once per platform, "kvm" and
"systrap", in the same pytest run, and is marked `both_platforms`. `COLLIMATE_TEST_PLATFORMS`
("kvm", "systrap" or "kvm systrap", the default) chooses which; CI's second step runs the systrap
side again with /dev/kvm hidden from the process (`python3 tests/platforms.py --no-kvm -- CMD`),
where `COLLIMATE_TEST_NO_KVM=1` makes the fixture check that KVM really is unusable there.

A known difference, systrap not doing yet what kvm does, is the test's expected outcome on that
platform: `systrap_gap(reason)` marks the systrap case `xfail(strict=True)`, so it is listed with
its reason in every run and the run fails the day it passes (flip it then), while any other
failure on systrap fails as usual.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ALL = ("kvm", "systrap")


def selected() -> tuple[str, ...]:
    """The platforms this run covers (`COLLIMATE_TEST_PLATFORMS`, default both)."""
    raw = os.environ.get("COLLIMATE_TEST_PLATFORMS", "").replace(",", " ").split()
    bad = [p for p in raw if p not in ALL]
    if bad:
        raise pytest.UsageError(f"COLLIMATE_TEST_PLATFORMS={' '.join(raw)!r}: each must be one of {ALL}")
    return tuple(p for p in ALL if p in raw) if raw else ALL


def systrap_client():
    """An embedded client on systrap for a systrap-only module (skipped where the host allows no
    seccomp filter), with no API key or Ray address in the environment to send it elsewhere."""
    from collimate_core import connect
    from collimate_core.sdk import platform as pf

    if not pf.probe_systrap().available:
        pytest.skip("this host does not allow seccomp filters (systrap)")
    for k in ("COLLIMATE_API_KEY", "COLLIMATE_RAY_ADDRESS"):
        os.environ.pop(k, None)
    c = connect(platform="systrap")
    assert c.platform == "systrap"
    return c


def systrap_gap(reason: str):
    """The systrap case's expected outcome: a known difference from kvm, with its reason. Strict: a
    pass fails the run, so the mark is flipped when the feature lands."""
    return pytest.mark.xfail(strict=True, reason=f"systrap: {reason}")


def on(platform: str, *marks):
    """`marks` for one platform's case only: `@on("systrap", systrap_gap("threads: ENOSYS"))`."""
    return pytest.mark.platform_marks(platform, *marks)


def hide_kvm_argv(argv: list[str], empty: Path) -> list[str]:
    """`argv` in a new mount namespace whose /dev/kvm is the empty file `empty` bound over it."""
    script = 'mount --bind "$0" /dev/kvm && exec "$@"'
    return ["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(empty), *argv]


def can_hide_kvm() -> str | None:
    """None when this process can hide /dev/kvm from a child, else why not."""
    if os.geteuid() != 0:
        return "needs root (a mount namespace)"
    if not shutil.which("unshare"):
        return "needs unshare(1)"
    if not os.path.exists("/dev/kvm"):
        return "there is no /dev/kvm to hide"
    return None


def run_without_kvm(argv: list[str], **kw) -> subprocess.CompletedProcess:
    """subprocess.run(argv, **kw) with /dev/kvm hidden (an empty file bound over it in a mount
    namespace of its own)."""
    empty = Path(os.environ.get("TMPDIR", "/tmp")) / f"collimate-no-kvm-{os.getpid()}"
    empty.write_bytes(b"")
    try:
        return subprocess.run(hide_kvm_argv(argv, empty), **kw)
    finally:
        empty.unlink()


if __name__ == "__main__":
    # python3 tests/platforms.py --no-kvm -- CMD...: CMD with /dev/kvm hidden, its exit status ours.
    args = sys.argv[1:]
    if args[:2] != ["--no-kvm", "--"] or len(args) < 3:
        sys.exit("usage: python3 tests/platforms.py --no-kvm -- COMMAND [ARGS...]")
    why = can_hide_kvm()
    if why:
        sys.exit(f"cannot hide /dev/kvm: {why}")
    env = os.environ | {"COLLIMATE_TEST_NO_KVM": "1", "COLLIMATE_TEST_PLATFORMS": "systrap"}
    env.pop("COLLIMATE_REQUIRE_KVM", None)
    sys.exit(run_without_kvm(args[2:], env=env).returncode)
