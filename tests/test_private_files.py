"""Snapshots and cache entries are the owner's only (issue 32, finding 10).

A template's memory file holds the whole guest memory: whatever its Ready step loaded (hidden
tests, keys). It was written 0644 in a 0755 directory. Now the engine writes snapshot files 0600
in a 0700 directory, and the cache's entries (temporaries renamed into place, atomic files, locks,
the build log) are 0600 files and 0700 directories; a root filesystem's own root stays 0755 (the
guest sees it as its /).
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from collimate_core.templates import cache as _cache

KVM = pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")


def mode(p: Path) -> int:
    return stat.S_IMODE(os.stat(p).st_mode)


@pytest.mark.kvm
@KVM
def test_snapshots_are_written_owner_only(tmp_path):
    from collimate_core._core import Vm
    from collimate_core.templates.catalog import bake_catalog

    baked = bake_catalog("python")
    snap = Path(baked.path)
    assert mode(snap) == 0o700 and mode(snap / "vm.mem") == 0o600 and mode(snap / "vm.state") == 0o600
    assert mode(baked.root) == 0o755  # the guest's /
    vm = Vm.restore(str(snap))
    try:
        dest = tmp_path / "a" / "snap"
        vm.snapshot(str(dest))
    finally:
        vm.destroy()
    assert {p.name: mode(p) for p in dest.iterdir() if p.is_file()} == {"vm.mem": 0o600, "vm.state": 0o600}
    assert mode(dest) == 0o700


def test_cache_entries_are_written_owner_only(tmp_path):
    entry = tmp_path / "kind" / "entry"

    def build(tmp: Path) -> None:
        (tmp / "x").write_text("x")

    assert _cache.build_once(entry, lambda p: (p / "x").exists(), build, kind="test", key="k", cache=tmp_path)
    assert mode(entry) == 0o700
    assert mode(tmp_path / _cache.BUILD_LOG) == 0o600
    with _cache.Lock(entry):  # removed on release
        assert mode(_cache.lock_path(entry)) == 0o600
    _cache.write_atomic(tmp_path / "index.json", "{}")
    assert mode(tmp_path / "index.json") == 0o600
