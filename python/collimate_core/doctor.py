"""`collimate doctor`: what this host offers the engine, measured in a few seconds.

The KVM module and its paging mode (the engine's platform profile, `vstate::profile`), whether the
host is itself a virtual machine, CPUID faulting, user namespaces, seccomp, disk quotas, the
cost of one exit and of one guest syscall here; both platforms' availability (kvm, systrap), what
auto picks and why (sdk/platform.py), and what `connect()` will use.
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


def _platforms(out: dict[str, Any]) -> None:
    """Both platforms' availability, what `connect()` asks for and what auto picks, and why."""
    from dataclasses import asdict

    from collimate_core.sdk import platform as pf
    from collimate_core.sdk.errors import InvalidArgument

    kvm, systrap = pf.probe_kvm(), pf.probe_systrap()
    out["platforms"] = {"kvm": asdict(kvm), "systrap": asdict(systrap)}
    out.update(user_namespaces=systrap.user_namespaces, user_namespaces_how=systrap.user_namespaces_how,
               seccomp=systrap.seccomp, seccomp_how=systrap.seccomp_how)
    auto = pf.choose("auto", kvm=kvm, systrap=systrap)
    out["auto"] = {"platform": auto.platform or None, "why": auto.reason, "problem": pf.problem(auto)}
    try:
        asked = pf.requested()
    except InvalidArgument as e:
        out["asked"], out["chosen"], out["asked_problem"] = os.environ.get(pf.ENV), None, str(e)
        return
    c = auto if asked == "auto" else pf.choose(asked, kvm=kvm, systrap=systrap)
    out["asked"], out["chosen"], out["asked_problem"] = asked, c.platform or None, pf.problem(c)


def _platform(out: dict[str, Any]) -> str:
    if os.environ.get("COLLIMATE_API_KEY"):
        url = os.environ.get("COLLIMATE_BASE_URL") or "http://127.0.0.1:8477"
        return f"remote: the control plane at {url} (COLLIMATE_API_KEY is set)"
    if os.environ.get("COLLIMATE_RAY_ADDRESS"):
        return f"ray: the cluster at {os.environ['COLLIMATE_RAY_ADDRESS']} (COLLIMATE_RAY_ADDRESS is set)"
    if out.get("asked_problem"):
        return f"none: {out['asked_problem']}"
    how = "asked for with COLLIMATE_PLATFORM" if out["asked"] != "auto" else out["auto"]["why"]
    return f"embedded: the engine in this process, on {out['chosen']} ({how})"


def report() -> dict[str, Any]:
    """Everything `collimate doctor` prints, as a dict."""
    out: dict[str, Any] = {"kvm": os.path.exists("/dev/kvm")}
    _platforms(out)
    out["platform"] = _platform(out)
    out["cpuid_faulting"] = _cpuid_faulting()
    if not out["platforms"]["kvm"]["available"]:
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
    k, s = r["platforms"]["kvm"], r["platforms"]["systrap"]
    if p is None:
        rows.append(("kvm", f"no usable KVM: {k['why']}"))
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
        ("user namespaces", f"{_yes(s['user_namespaces'])} ({s['user_namespaces_how']})"),
        ("seccomp filters", f"{_yes(s['seccomp'])} ({s['seccomp_how']})"),
    ]
    if p is not None:
        j = r["jail"]
        rows += [
            ("disk quotas", _yes(r["quota"]) + ("" if r["quota"] else " (sandboxes keep files without a per-sandbox quota)")),
            ("VMM jail", f"namespaces {_yes(j['namespaces'])}, seccomp {_yes(j['seccomp'])}, rlimits {_yes(j['rlimits'])}"),
            ("one exit", f"{p['exit_ns'] / 1000:.1f} us (median of 2,000, {p['name']})"),
            ("one guest syscall", f"{r['syscall_ns'] / 1000:.1f} us (median of 5 runs of 2,000 getpid, {p['name']})"),
        ]
    kvm_mod = k["module"] or "KVM module not named in /sys/module"
    rows.append(("platform kvm", ("available: " if k["available"] else "unavailable: ") + k["why"]
                 + f" ({kvm_mod}{', ' + k['paging'] if k['paging'] else ''})"))
    served = "this build serves it" if s["served"] else (
        "this build does not serve systrap sandboxes yet ("
        + ("its engine's Vm.spawn takes no platform=" if not s["binding"] else "the SDK's systrap templates are not written")
        + ")")
    rows.append(("platform systrap", ("the host allows it: " if s["available"] else "the host does not allow it: ")
                 + s["why"] + "; " + served))
    a = r["auto"]
    cannot = ""
    if a["problem"]:
        cannot = "; but this build does not serve it yet" if a["platform"] == "systrap" and not s["served"] else (
            f"; it cannot run here: {a['problem']}")
    rows.append(("auto picks", f"{a['platform'] or 'nothing'} ({a['why']}){cannot}"))
    rows.append(("connect()", r["platform"]))
    width = max(len(k) for k, _ in rows)
    for k, v in rows:
        print(f"{k:<{width}}  {v}")


def add_subcommand(sub: Any) -> None:
    d = sub.add_parser("doctor", help="what this host offers the engine (KVM kind, paging, jail, costs)")
    d.add_argument("--json", action="store_true", help="print the report as JSON")
