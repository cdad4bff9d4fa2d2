"""Choosing the platform a client's sandboxes run on: "kvm" or "systrap" (docs/platforms.md).

`EmbeddedClient(platform=...)`, `connect(platform=...)`, `COLLIMATE_PLATFORM` and `collimate serve
--platform` take "auto" (the default), "kvm" or "systrap". Auto's rule, in this order:

1. kvm, when `/dev/kvm` opens read-write and creates a VM (KVM_CREATE_VM). The host's KVM module
   (kvm_pvm, kvm_intel or kvm_amd, from /sys/module) and its two-dimensional paging parameter
   (`ept`/`npt`) are reported with the choice.
2. else systrap, when the host lets a process install a seccomp filter (tried in a child process
   with an allow-all filter). User namespaces are reported (tried: unshare(CLONE_NEWUSER) in a
   child): the systrap stub takes one where the host allows it, and is confined without it.
3. else an error that says what is missing and what to do.

The choice is logged once per client on the "collimate_core" logger (INFO), with what the host
offers. Systrap sandboxes need the engine's `Vm.spawn(..., platform="systrap")` (detected by
feature; a build without it raises `PlatformUnavailable` saying so) and run the catalog template
"python" from a live zygote (sdk/live.py).
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import functools
import inspect
import logging
import os
from dataclasses import dataclass, field
from typing import Any

from collimate_core.sdk.errors import InvalidArgument, PlatformUnavailable

PLATFORMS = ("auto", "kvm", "systrap")
ENV = "COLLIMATE_PLATFORM"
log = logging.getLogger("collimate_core")

# <linux/kvm.h>: _IO(KVMIO, 0x00) and _IO(KVMIO, 0x01)
_KVM_GET_API_VERSION = 0xAE00
_KVM_CREATE_VM = 0xAE01
_KVM_API_VERSION = 12
# The paging parameter of each module (kvm_pvm has none: it always shadows the guest's tables).
_PAGING_PARAM = {"kvm_intel": "ept", "kvm_amd": "npt"}

# Whether the SDK's embedded systrap path (templates as live zygotes spawned at first use, clones
# forked from them: sdk/live.py) is written.
SDK_SERVES_SYSTRAP = True


def check(value: Any, where: str = "platform") -> str:
    """`value` if it names a platform choice, else InvalidArgument naming the three."""
    if isinstance(value, str) and value in PLATFORMS:
        return value
    raise InvalidArgument(f"{where} must be 'auto', 'kvm' or 'systrap', not {value!r}")


def requested(platform: Any = None) -> str:
    """The choice asked for: `platform`, else COLLIMATE_PLATFORM, else "auto"."""
    if platform is not None:
        return check(platform)
    env = os.environ.get(ENV)
    if env:
        return check(env, ENV)
    return "auto"


@dataclass
class KvmOffer:
    """What the host offers the kvm platform."""

    available: bool
    why: str  # in words: what worked, or what failed
    module: str | None = None  # kvm_pvm, kvm_intel, kvm_amd (from /sys/module), or None
    paging: str = ""  # "ept=Y", "npt=1", "shadow paging (paravirtual)", "" when unknown

    def describe(self) -> str:
        what = self.module or "KVM module not named in /sys/module"
        return f"{what}" + (f", {self.paging}" if self.paging else "")


@dataclass
class SystrapOffer:
    """What the host offers the systrap platform, and whether this build serves it."""

    available: bool  # the host allows what systrap needs
    why: str
    seccomp: bool = False
    seccomp_how: str = ""
    user_namespaces: bool = False
    user_namespaces_how: str = ""
    binding: bool = False  # the engine's Vm.spawn takes platform=
    served: bool = False  # binding and the SDK's systrap path
    missing: list[str] = field(default_factory=list)


def _read(path: str) -> str | None:
    try:
        with open(path) as f:
            return f.read().strip()
    except OSError:
        return None


def kvm_module() -> tuple[str | None, str]:
    """The loaded KVM module and its paging parameter, from /sys/module."""
    for m in ("kvm_pvm", "kvm_intel", "kvm_amd"):
        if os.path.isdir(f"/sys/module/{m}"):
            if m == "kvm_pvm":
                return m, "shadow paging (paravirtual)"
            p = _PAGING_PARAM[m]
            v = _read(f"/sys/module/{m}/parameters/{p}")
            return m, f"{p}={v}" if v is not None else f"{p} unknown"
    return None, ""


def probe_kvm() -> KvmOffer:
    """Whether /dev/kvm opens read-write and creates a VM (the VM is closed at once)."""
    module, paging = kvm_module()
    try:
        fd = os.open("/dev/kvm", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        why = "/dev/kvm does not exist" if e.errno == errno.ENOENT else f"/dev/kvm does not open read-write ({e.strerror})"
        return KvmOffer(False, why, module, paging)
    try:
        try:
            version = fcntl.ioctl(fd, _KVM_GET_API_VERSION)
        except OSError as e:
            return KvmOffer(False, f"/dev/kvm opens but is not KVM (KVM_GET_API_VERSION: {e.strerror})", module, paging)
        if version != _KVM_API_VERSION:
            return KvmOffer(False, f"/dev/kvm speaks KVM API {version}, not {_KVM_API_VERSION}", module, paging)
        try:
            vm = fcntl.ioctl(fd, _KVM_CREATE_VM, 0)
        except OSError as e:
            return KvmOffer(False, f"/dev/kvm opens but cannot create a VM (KVM_CREATE_VM: {e.strerror})", module, paging)
        os.close(vm)
    finally:
        os.close(fd)
    return KvmOffer(True, "/dev/kvm opens and creates a VM", module, paging)


@functools.lru_cache(maxsize=1)
def _kvm_cached() -> KvmOffer:
    return probe_kvm()


# <linux/prctl.h>, <linux/seccomp.h>, <linux/filter.h>
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2
_BPF_RET_K = 0x06
_SECCOMP_RET_ALLOW = 0x7FFF0000
_CLONE_NEWUSER = 0x10000000


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(_SockFilter))]


def _in_child(step) -> int:
    """Run `step()` (returns an exit code) in a forked child; its exit code (-1: it died)."""
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            code = step()
        finally:
            os._exit(code)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) if os.WIFEXITED(status) else -1


def _seccomp() -> tuple[bool, str]:
    """Whether this process may install a seccomp filter: an allow-all one, in a child."""
    if not any(line.startswith("Seccomp:") for line in (_read("/proc/self/status") or "").splitlines()):
        return False, "the kernel has no seccomp (no Seccomp: line in /proc/self/status)"
    libc = ctypes.CDLL(None, use_errno=True)
    prog_filter = (_SockFilter * 1)(_SockFilter(_BPF_RET_K, 0, 0, _SECCOMP_RET_ALLOW))
    prog = _SockFprog(1, prog_filter)

    def step() -> int:
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            return 2
        if libc.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
            return 3
        return 0

    code = _in_child(step)
    if code == 0:
        return True, "tried: no_new_privs and an allow-all filter"
    if code == 2:
        return False, "prctl(PR_SET_NO_NEW_PRIVS) failed"
    return False, "installing a seccomp filter failed (prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER))"


def user_namespaces() -> tuple[bool, str]:
    """Whether a process may make a user namespace: the sysctls, then unshare in a child."""
    if _read("/proc/sys/user/max_user_namespaces") == "0":
        return False, "user.max_user_namespaces is 0"
    if _read("/proc/sys/kernel/unprivileged_userns_clone") == "0" and os.geteuid() != 0:
        return False, "kernel.unprivileged_userns_clone is 0"
    libc = ctypes.CDLL(None, use_errno=True)

    def step() -> int:
        return 0 if libc.unshare(_CLONE_NEWUSER) == 0 else 1

    return _in_child(step) == 0, "tried: unshare(CLONE_NEWUSER)"


def binding_serves_systrap(spawn: Any = None) -> bool:
    """Whether the engine's binding spawns systrap processes: its `Vm.spawn` (or `spawn`) takes
    `platform`."""
    if spawn is None:
        from collimate_core._core import Vm

        spawn = Vm.spawn
    try:
        return "platform" in inspect.signature(spawn).parameters
    except (TypeError, ValueError):  # no signature to read: not the binding that takes it
        return False


def probe_systrap() -> SystrapOffer:
    seccomp, seccomp_how = _seccomp()
    userns, userns_how = user_namespaces()
    binding = binding_serves_systrap()
    missing = [] if seccomp else [f"seccomp filters ({seccomp_how})"]
    if seccomp:
        why = "seccomp filters can be installed; user namespaces " + (
            "too" if userns else "not (the stub is confined without one)")
    else:
        why = "seccomp filters cannot be installed: " + seccomp_how
    return SystrapOffer(
        available=seccomp, why=why, seccomp=seccomp, seccomp_how=seccomp_how, user_namespaces=userns,
        user_namespaces_how=userns_how, binding=binding, served=binding and SDK_SERVES_SYSTRAP, missing=missing,
    )


@dataclass
class Choice:
    """What a client runs on, and why."""

    asked: str  # auto, kvm or systrap
    platform: str  # kvm or systrap ("" when neither can run here)
    reason: str  # auto's rule as it applied here, or "asked for"
    kvm: KvmOffer
    systrap: SystrapOffer | None  # None when not probed (kvm was chosen)

    def offers(self) -> str:
        """What the host offers, in one line."""
        k = f"kvm {'yes' if self.kvm.available else 'no'} ({self.kvm.describe()}; {self.kvm.why})"
        s = self.systrap
        if s is None:
            t = "systrap not probed"
        else:
            t = (f"systrap {'yes' if s.available else 'no'} (seccomp filters {'yes' if s.seccomp else 'no'}, "
                 f"user namespaces {'yes' if s.user_namespaces else 'no'}; "
                 f"this build {'serves' if s.served else 'does not serve'} it)")
        return f"{k}; {t}"


def choose(asked: str, *, cached: bool = True, kvm: KvmOffer | None = None,
           systrap: SystrapOffer | None = None) -> Choice:
    """Apply the rule (module docs) to `asked` ("auto", "kvm" or "systrap"), probing what is not
    given; never raises for what the host lacks (see `problem`)."""
    if kvm is None:
        kvm = _kvm_cached() if cached else probe_kvm()
    if asked == "kvm":
        return Choice(asked, "kvm", "asked for", kvm, systrap)
    if asked == "systrap":
        return Choice(asked, "systrap", "asked for", kvm, systrap or probe_systrap())
    if kvm.available:
        return Choice(asked, "kvm", f"auto: {kvm.why} ({kvm.describe()})", kvm, systrap)
    s = systrap or probe_systrap()
    if s.available:
        return Choice(asked, "systrap", f"auto: no usable KVM ({kvm.why}); {s.why}", kvm, s)
    return Choice(asked, "", f"auto: no usable KVM ({kvm.why}) and no systrap ({s.why})", kvm, s)


_KVM_HELP = (
    "give this process read-write access to /dev/kvm (load kvm_intel or kvm_amd, or run on a VM type with nested "
    "virtualization; add the user to the kvm group)"
)


def problem(c: Choice) -> str | None:
    """Why a client cannot run sandboxes on `c`, with what to do; None when it can."""
    if c.platform == "kvm":
        if c.kvm.available:
            return None
        return f"platform='kvm' needs a usable /dev/kvm, and here {c.kvm.why}: {_KVM_HELP}"
    who = ("platform='systrap' was asked for" if c.asked == "systrap"
           else f"auto chose systrap (no usable KVM: {c.kvm.why})")
    if c.platform == "systrap":
        s = c.systrap
        assert s is not None
        if not s.available:
            return f"{who}, which needs what this host does not allow: {', '.join(s.missing)}"
        if not s.served:
            what = ("its engine's Vm.spawn takes no platform=" if not s.binding
                    else "its engine spawns systrap processes, but the SDK's systrap templates are not written")
            return (f"{who}, but this build of collimate_core does not serve systrap sandboxes yet ({what}): use "
                    "platform='kvm' on a host where /dev/kvm opens and creates a VM (`collimate doctor` says whether "
                    "this one does)")
        return None
    s = c.systrap
    return (f"no platform can run sandboxes here: no usable KVM ({c.kvm.why}) and no systrap "
            f"({s.why if s else 'not probed'}): {_KVM_HELP} for platform 'kvm', or allow seccomp filters for "
            "'systrap' (a container runtime's seccomp profile or no_new_privs policy may forbid them)")


def resolve(platform: Any = None) -> Choice:
    """The choice for a new client: asked (argument, COLLIMATE_PLATFORM, "auto"), applied,
    logged once, and PlatformUnavailable when this host or build cannot serve it."""
    c = choose(requested(platform))
    msg = problem(c)
    log.info("collimate_core platform: %s (%s); host offers: %s", c.platform or "none", c.reason, c.offers())
    if msg is not None:
        raise PlatformUnavailable(msg)
    return c
