"""`collimate doctor`: what this host offers the engine, measured in a few seconds.

The KVM module and its paging mode (the engine's platform profile, `vstate::profile`), whether the
host is itself a virtual machine, CPUID faulting, user namespaces, seccomp, disk quotas, the
cost of one exit and of one guest syscall here, and which platform `connect()` will use.
"""

from __future__ import annotations

import json
import os
import statistics
import struct
import sys
from typing import Any

# A static x86-64 program: `getpid` N times, then exit(0). Its syscalls are the engine's own
# bare-guest set (vmm::syscalls), so it needs no root filesystem.
_BASE = 0x400000


def _syscall_loop_elf(n: int) -> bytes:
    if not 1 <= n < 2**31:
        raise ValueError("n must be in [1, 2**31)")
    code = (
        b"\x41\xbc" + struct.pack("<I", n)  # mov r12d, n
        + b"\xb8\x27\x00\x00\x00"  # 1: mov eax, 39 (getpid)
        + b"\x0f\x05"  # syscall
        + b"\x41\xff\xcc"  # dec r12d
        + b"\x75\xf4"  # jnz 1b
        + b"\xb8\x3c\x00\x00\x00"  # mov eax, 60 (exit)
        + b"\x31\xff"  # xor edi, edi
        + b"\x0f\x05"  # syscall
    )
    ehdr_size, phdr_size = 64, 56
    entry = _BASE + ehdr_size + phdr_size
    size = ehdr_size + phdr_size + len(code)
    ehdr = (
        b"\x7fELF\x02\x01\x01" + b"\x00" * 9
        + struct.pack("<HHIQQQIHHHHHH", 2, 62, 1, entry, ehdr_size, 0, 0, ehdr_size, phdr_size, 1, 0, 0, 0)
    )
    phdr = struct.pack("<IIQQQQQQ", 1, 5, 0, _BASE, _BASE, size, size, 0x1000)  # PT_LOAD, R+X
    return ehdr + phdr + code


def _median_syscall_ns(rounds: int = 5, n: int = 2000) -> float:
    """Per guest syscall: the run time of N+1 syscalls minus that of 1, over N; the median of
    `rounds` pairs run alternately."""
    from collimate_core._core import Vm

    short, long_ = _syscall_loop_elf(1), _syscall_loop_elf(n + 1)
    costs = []
    for _ in range(rounds):
        d = []
        for elf in (short, long_):
            vm = Vm.boot(elf, 64 << 20)
            try:
                r = vm.run(30.0)
                if r.kind != "exited":
                    raise RuntimeError(f"the syscall probe ended with {r.kind}, not an exit")
                d.append(r.duration)
            finally:
                vm.destroy()
        costs.append((d[1] - d[0]) / n * 1e9)
    return statistics.median(costs)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def _cpuid_faulting() -> bool:
    flags = next((line for line in (_read("/proc/cpuinfo") or "").splitlines() if line.startswith("flags")), "")
    return "cpuid_fault" in flags.split()


def _user_namespaces() -> tuple[bool, str]:
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        return False, "user.max_user_namespaces is 0"
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0" and os.geteuid() != 0:
        return False, "kernel.unprivileged_userns_clone is 0"
    if not hasattr(os, "unshare"):
        return True, "allowed by sysctl (not tried: Python < 3.12)"
    pid = os.fork()
    if pid == 0:
        try:
            os.unshare(os.CLONE_NEWUSER)
            os._exit(0)
        except OSError:
            os._exit(1)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) == 0, "tried: unshare(CLONE_NEWUSER)"


def _seccomp() -> bool:
    return any(line.startswith("Seccomp:") for line in (_read("/proc/self/status") or "").splitlines())


def _platform() -> str:
    if os.environ.get("COLLIMATE_API_KEY"):
        url = os.environ.get("COLLIMATE_BASE_URL") or "http://127.0.0.1:8477"
        return f"remote: the control plane at {url} (COLLIMATE_API_KEY is set)"
    if os.environ.get("COLLIMATE_RAY_ADDRESS"):
        return f"ray: the cluster at {os.environ['COLLIMATE_RAY_ADDRESS']} (COLLIMATE_RAY_ADDRESS is set)"
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return "none: the embedded engine needs /dev/kvm (absent or not accessible to this user)"
    return "embedded: the engine in this process, on /dev/kvm"


def report() -> dict[str, Any]:
    """Everything `collimate doctor` prints, as a dict."""
    out: dict[str, Any] = {"kvm": os.path.exists("/dev/kvm"), "platform": _platform()}
    ns_ok, ns_how = _user_namespaces()
    out.update(cpuid_faulting=_cpuid_faulting(), user_namespaces=ns_ok, user_namespaces_how=ns_how, seccomp=_seccomp())
    if not os.access("/dev/kvm", os.R_OK | os.W_OK):
        return out
    from collimate_core import _core
    from collimate_core._core import Vm

    out["profile"] = _core._kvm_profile(measure_exit=True)
    out["quota"] = _core._quota_available()
    vm = Vm.boot(_syscall_loop_elf(1), 64 << 20)
    try:
        out["jail"] = vm.jail()
    finally:
        vm.destroy()
    out["syscall_ns"] = _median_syscall_ns()
    return out


def _yes(b: Any) -> str:
    return "yes" if b else ("no" if b is not None else "cannot tell")


def run_cli(args: Any) -> None:
    r = report()
    if getattr(args, "json", False):
        json.dump(r, sys.stdout, indent=2)
        print()
        return
    p = r.get("profile")
    rows = []
    if p is None:
        rows.append(("kvm", "no usable /dev/kvm" if not r["kvm"] else "/dev/kvm is not accessible to this user"))
    else:
        paging = {"tdp": "two-dimensional (EPT/NPT)", "shadow": "shadow paging"}[p["paging"]]
        rows += [
            ("kvm", f"{p['name']} ({paging}; detected from {p['source']})"),
            ("nested", f"{_yes(p['nested'])} (the KVM host itself runs in a virtual machine)"),
            ("I/O exits", "RIP at the instruction: completed before each save" if p["io_completes_on_next_run"] else "RIP past the instruction"),
            ("guest TLB", "needs a guest-side flush after host edits" if p["guest_tlb_flush"] else "host edits reach it through KVM's shadow MMU"),
            ("ring-3 CPUID", "filtered by the VM's CPUID" if p["cpuid_filtered"] else "NOT filtered (the host CPU answers)"),
        ]
    rows += [
        ("CPUID faulting", _yes(r["cpuid_faulting"])),
        ("user namespaces", f"{_yes(r['user_namespaces'])} ({r['user_namespaces_how']})"),
        ("seccomp", _yes(r["seccomp"])),
    ]
    if p is not None:
        j = r["jail"]
        rows += [
            ("disk quotas", _yes(r["quota"]) + ("" if r["quota"] else " (sandboxes keep files without a per-sandbox quota)")),
            ("VMM jail", f"namespaces {_yes(j['namespaces'])}, seccomp {_yes(j['seccomp'])}, rlimits {_yes(j['rlimits'])}"),
            ("one exit", f"{p['exit_ns'] / 1000:.1f} us (median of 2,000, {p['name']})"),
            ("one guest syscall", f"{r['syscall_ns'] / 1000:.1f} us (median of 5 runs of 2,000 getpid, {p['name']})"),
        ]
    rows.append(("connect()", r["platform"]))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def add_subcommand(sub: Any) -> None:
    d = sub.add_parser("doctor", help="what this host offers the engine (KVM kind, paging, jail, costs)")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
