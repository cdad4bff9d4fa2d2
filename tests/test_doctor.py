"""`collimate doctor`: the host report (needs /dev/kvm for its KVM half)."""

import os

import pytest

from collimate_core import doctor
from collimate_core._core import Vm

needs_kvm = pytest.mark.skipif(not os.access("/dev/kvm", os.R_OK | os.W_OK), reason="needs /dev/kvm")


@needs_kvm
def test_the_syscall_probe_is_a_static_program_the_engine_runs_to_its_exit():
    for n in (1, 3):
        vm = Vm.boot(doctor._syscall_loop_elf(n), 64 << 20)
        try:
            r = vm.run(30.0)
            assert (r.kind, r.code, r.enosys) == ("exited", 0, 0)
        finally:
            vm.destroy()
    with pytest.raises(ValueError):
        doctor._syscall_loop_elf(0)


@needs_kvm
def test_the_report_names_the_module_sysfs_shows_and_measures_both_costs(capsys):
    r = doctor.report()
    p = r["profile"]
    module = next((m for m in ("kvm_pvm", "kvm_intel", "kvm_amd") if os.path.exists(f"/sys/module/{m}")), None)
    if module and p["source"] == "sysfs":
        assert p["name"].startswith(module)
    assert p["io_completes_on_next_run"] == (p["kind"] != "pvm")
    assert p["exit_ns"] > 0 and r["syscall_ns"] > 0
    assert set(r["jail"]) == {"rlimits", "namespaces", "seccomp"}
    assert r["platform"].startswith(("embedded", "remote", "ray"))
    doctor.run_cli(type("Args", (), {"json": False})())
    out = capsys.readouterr().out
    for row in ("kvm", "nested", "one exit", "one guest syscall", "connect()"):
        assert row in out
