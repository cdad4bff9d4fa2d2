"""The VMM process's jail, from Python: VMM processes started by the embedded engine (a Python
interpreter running `_vmm_main`) are jailed like the Rust ones (crates/engine/tests/jail.rs holds the
detailed checks). With CAP_SYS_ADMIN (root on CI) every layer must be on; without it the namespaces
are off.
"""

from __future__ import annotations

import os

import pytest

from collimate_core import Vm
from guestprogs import READY_YIELD, load_testvm

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]


def proc_status(pid: int) -> dict[str, str]:
    with open(f"/proc/{pid}/status") as f:
        return dict(line.rstrip("\n").split(":\t", 1) for line in f if ":\t" in line)


def can_make_namespaces() -> bool:
    """CAP_SYS_ADMIN in this process's effective set (21 = CAP_SYS_ADMIN)."""
    return bool(int(proc_status(os.getpid())["CapEff"], 16) & (1 << 21))


def test_vmm_processes_from_python_are_jailed(tmp_path):
    root = can_make_namespaces()
    with Vm.boot(load_testvm(tmp_path / "testvm")) as vm:
        r = vm.run(10.0)
        assert (r.kind, r.value) == ("yield", READY_YIELD), r
        assert vm.jail() == {"rlimits": True, "namespaces": root, "seccomp": True}
        assert proc_status(vm.pid)["Seccomp"] == "2"
        if root:
            for ns in ("mnt", "net"):
                assert os.readlink(f"/proc/{vm.pid}/ns/{ns}") != os.readlink(f"/proc/self/ns/{ns}")
            # No Python installation, no /proc, no /etc in there: the interpreter that started the
            # VMM process is out of reach once it has handed over to the engine.
            assert not {"usr", "proc", "etc"} & set(os.listdir(f"/proc/{vm.pid}/root"))
        # A snapshot to a directory the jail does not hold, and a clone from it.
        vm.snapshot(tmp_path / "snap")
        with Vm.restore(tmp_path / "snap") as z, z.clone() as c:
            assert c.jail() == vm.jail()
            assert c.run(10.0).kind == "yield"
