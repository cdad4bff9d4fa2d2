"""Typed stubs of the native module `collimate_core._core` (crates/py/src/lib.rs).

tests/test_stubs.py checks that this file and the module name the same things.
"""

from os import PathLike
from types import TracebackType
from typing import Literal, Self, TypedDict, final

class CollimateError(Exception):
    """Base class of every error raised by collimate_core."""

class EngineError(CollimateError):
    """The engine (a VMM process, KVM or the host) failed to carry out an operation."""

class SnapshotError(CollimateError):
    """A snapshot directory cannot be used: corrupt, truncated, another format version, or its CPU template needs a feature this host's CPU lacks (bake it again on this host)."""

class VmDestroyedError(CollimateError):
    """The Vm was destroyed; it can no longer be used."""

class _Regs(TypedDict, total=False):
    rax: int
    rbx: int
    rcx: int
    rdx: int
    rsi: int
    rdi: int
    rsp: int
    rbp: int
    r8: int
    r9: int
    r10: int
    r11: int
    r12: int
    r13: int
    r14: int
    r15: int
    rip: int
    rflags: int

class _ResetStats(TypedDict):
    dirty_pages: int
    duration: float

class _DiskUsage(TypedDict):
    bytes: int
    inodes: int
    quota_bytes: int
    quota_inodes: int

class _MemStats(TypedDict):
    private_bytes: int
    dirty_pages: int

class _JailStatus(TypedDict):
    rlimits: bool
    namespaces: bool
    seccomp: bool

_RunKind = Literal["exited", "signaled", "yield", "io", "fault", "timeout", "shutdown"]

@final
class _EgressEntry(TypedDict):
    time: float
    pid: int
    kind: str
    name: str | None
    address: str | None
    port: int
    rule: str | None
    verdict: str
    detail: str
    bytes_out: int
    bytes_in: int
    open: bool

class _TapeOutcome(TypedDict):
    mode: str
    path: str
    flows: int
    errors: list[str]

class RunResult:
    """The outcome of one `Vm.run()`; fields that do not apply to `kind` are None."""

    @property
    def kind(self) -> _RunKind: ...
    @property
    def code(self) -> int | None:
        """Exit status ("exited")."""
    @property
    def signal(self) -> int | None:
        """The signal that killed a Linux guest's process ("signaled")."""
    @property
    def value(self) -> int | None:
        """The yielded value ("yield") or the value written by `out` ("io")."""
    @property
    def port(self) -> int | None:
        """I/O port ("io")."""
    @property
    def vector(self) -> int | None:
        """Exception vector ("fault")."""
    @property
    def error_code(self) -> int | None:
        """Exception error code ("fault")."""
    @property
    def rip(self) -> int | None:
        """Faulting instruction pointer ("fault")."""
    @property
    def cr2(self) -> int | None:
        """Faulting address of a page fault ("fault")."""
    @property
    def stdout(self) -> bytes: ...
    @property
    def stderr(self) -> bytes: ...
    @property
    def duration(self) -> float:
        """Seconds the guest ran for."""
    @property
    def enosys(self) -> int:
        """Syscalls the engine answered with -ENOSYS during this run."""
    @property
    def agent(self) -> bytes:
        """What the in-guest agent wrote to its channel during this run."""
    @property
    def truncated(self) -> bool:
        """Output beyond the cap (16 MiB per stream) was dropped."""
    @property
    def nondeterministic(self) -> bool:
        """Replay mode: a thread switch was made by the wall clock (a thread spun without a
        syscall), so a replay of this run may interleave its threads differently."""

@final
class Vm:
    """A handle to one VMM process running one guest. Every call releases the GIL."""

    @staticmethod
    def boot(elf: bytes, mem_size: int = 1073741824) -> Vm:
        """Start a VMM process and load a static, non-PIE x86-64 ELF; paused until run()."""
    @staticmethod
    def spawn(
        root: str | PathLike[str],
        argv: list[str],
        env: dict[str, str] | None = None,
        cwd: str = "/",
        mounts: dict[str, str | PathLike[str]] | None = None,
        mem_size: int = 1073741824,
        ro_mounts: dict[str, str | PathLike[str]] | None = None,
        agent: bool = False,
        uid: int | None = None,
        gid: int | None = None,
        groups: list[int] | None = None,
        cpus: int | None = None,
        platform: str = "kvm",
    ) -> Vm:
        """Start a VMM process running the Linux program `argv[0]` from root filesystem `root`,
        as `uid`/`gid` with supplementary `groups` (default: root). The guest sees `cpus` CPUs
        (1 to 64; default `COLLIMATE_CPUS` or 1); its threads still share one vCPU. `platform`:
        "kvm" (a KVM virtual machine) or "systrap" (a confined host process per guest process,
        every syscall trapped; no snapshot, reset or spare pool yet: docs/systrap.md)."""
    @staticmethod
    def restore(dir: str | PathLike[str]) -> Vm:
        """Start a VMM process from a snapshot directory (`vm.state`, `vm.mem`)."""
    def run(self, timeout: float) -> RunResult:
        """Run the guest until it exits, yields, does I/O, faults, or `timeout` seconds pass."""
    def snapshot(self, dir: str | PathLike[str]) -> None:
        """Write the paused VM to `dir`; the VM stays usable."""
    def fork(self, n: int) -> list[Vm]:
        """`n` copy-on-write children of this paused VM."""
    def set_spare_pool(self, n: int) -> None:
        """Keep `n` pre-forked children ready so `fork`/`clone` only hand one over (template zygotes)."""
    def set_writable_root(self, on: bool) -> None:
        """Give the sandboxes this zygote forks from now on a writable root (the image under a
        copy-up layer in each one's disk quota); drops the spares (set the spare pool again)."""
    @property
    def platform(self) -> str:
        """What this VM runs on: "kvm" or "systrap" (a clone keeps its parent's)."""
    @property
    def writable_root(self) -> bool:
        """Whether this VM's sandboxes have a writable root."""
    def clone(self) -> Vm:
        """One copy-on-write child: `fork(1)[0]`."""
    def reset(self, keep_files: bool = False) -> _ResetStats:
        """Return to the snapshot this VM was restored or cloned from; with `keep_files`, its
        writable mounts (/tmp, /work) stay as they are."""
    def agent_call(self, input: bytes, timeout: float, seed: bytes | None = None, replay: bool = True,
                   wall_clock_ns: int | None = None) -> RunResult:
        """Send `input` to the in-guest agent (fd 3); run until it waits again. Reply in `.agent`.
        With `seed` (32 bytes), reseed first as `reseed(seed, replay)`, in the same round trip;
        with `wall_clock_ns` too, virtual REALTIME starts no earlier than that."""
    def end_exec(self, signal: int, timeout: float) -> RunResult:
        """After an agent_call that timed out: SIGKILL every guest process that exec started, send
        the agent guest signal `signal` (0: none) and run until it waits again (at most `timeout`
        seconds). Files and the agent's memory are kept."""
    def upload(self, path: str, data: bytes, mode: int = 0o644) -> None:
        """Write a file into a Linux guest's file system (/tmp and /work), byte-exact."""
    def download(self, path: str, max_bytes: int = 268435456) -> bytes:
        """Read a regular file of a Linux guest's file system, byte-exact, if it holds at most
        `max_bytes` (a FIFO, a device or a directory is refused at once: CollimateError)."""
    def open_download(self, path: str, max_bytes: int) -> tuple[int, int]:
        """Open a regular file of a Linux guest's file system of at most `max_bytes` for reading:
        (a file descriptor the caller owns and closes, the file's size)."""
    def reseed(self, seed: bytes, replay: bool = True) -> None:
        """Reseed the paused guest's sandbox CRNG with `seed` (exactly 32 bytes, else ValueError).

        With `replay`, the guest's clocks run on deterministic virtual time from now on. The same
        seed on the same paused state reproduces the guest's random bytes (and clock readings).
        """
    def read_mem(self, addr: int, n: int) -> bytes: ...
    def write_mem(self, addr: int, data: bytes) -> None: ...
    def regs(self) -> _Regs: ...
    def set_regs(self, regs: _Regs) -> None:
        """Update the named registers; the others keep their values."""
    def vcpu_state(self) -> bytes:
        """The full captured vCPU state, serialized; for equality checks only."""
    def mem_stats(self) -> _MemStats: ...
    def set_disk_quota(self, bytes: int, inodes: int | None = None) -> None:
        """Disk quota of this sandbox's writable mounts together (its own tmpfs) and of the
        children it forks from now on; refused below what they hold."""
    def disk_usage(self) -> _DiskUsage | None:
        """What the writable mounts hold and their quota; None without a tmpfs of its own."""
    def take_shared_memory_limit_reached(self) -> bool:
        """Whether the shared-memory limit refused anything since the last call."""
    def shared_memory_usage(self) -> dict[str, int] | None:
        """What the shared-memory pool (shared anonymous mappings, memfds, /dev/shm) holds
        (`bytes`) and its limit (`quota_bytes`); None where disk_usage is None."""
    def set_shared_memory(self, bytes: int) -> None:
        """Shared-memory limit of this sandbox (its pool: shared anonymous mappings, memfds and
        /dev/shm together) and of the children it forks from now on; at least 1 MiB, refused
        below what the pool holds."""
    @property
    def shared_memory(self) -> int | None:
        """The shared-memory limit in bytes this VM's children get; None if the host gives none."""
    @property
    def disk_quota(self) -> tuple[int, int] | None:
        """The (bytes, inodes) quota this VM's children get; None if the host gives none."""
    def jail(self) -> _JailStatus:
        """Which layers of its jail the VMM process runs in: resource limits, its own mount and
        network namespaces (root only), the seccomp filter."""
    @property
    def pid(self) -> int:
        """Host pid of the VMM process."""
    def set_egress(self, rules: list[str], internet: bool = False) -> int:
        """Replace this sandbox's egress policy; open connections it forbids are reset (returns how
        many). Later forks start from it. A bad rule raises ValueError."""
    def seal_egress(self) -> None:
        """From now on `set_egress` may not go beyond this sandbox's policy now (a fork's ceiling:
        its policy when it was forked); it may narrow below it and widen back up to it."""
    def egress_ceiling(self) -> tuple[list[str], bool] | None:
        """The ceiling `seal_egress` set, as (rule strings, internet), or None."""
    def clear_egress(self) -> None:
        """Forget this sandbox's network past (a recycled clone): no network, an empty log."""
    def egress(self) -> tuple[list[str], bool]:
        """This sandbox's egress policy: (rule strings, internet)."""
    def egress_log(self) -> list[_EgressEntry]:
        """Connection attempts and DNS answers, oldest first."""
    def egress_bytes(self) -> tuple[int, int]:
        """Egress bytes of this sandbox's connections: (sent and acknowledged, received)."""
    def egress_tape_begin(self, path: str | PathLike[str]) -> tuple[str, int | None]:
        """Open the next exec's egress recording: ("replay" (the file exists) or "record", the wall
        clock the exec's virtual REALTIME starts at: now, or the recording's)."""
    def egress_tape_end(self, save: bool = True) -> _TapeOutcome:
        """Close the exec's recording (saved when it recorded, if `save`); its mode, flows and errors."""
    def destroy(self) -> None:
        """Kill and reap the VMM process. Idempotent."""
    def __enter__(self) -> Self: ...
    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        _exc: BaseException | None,
        _tb: TracebackType | None,
    ) -> bool: ...

SNAPSHOT_FORMAT: int
"""The engine's snapshot format version: snapshots of another version cannot be restored."""
# The most bytes of stdout, and of stderr, one run returns (the engine's protocol::OUTPUT_CAP).
OUTPUT_CAP: int
SYSTRAP_SNAPSHOT_FORMAT: int

def _vmm_main() -> None:
    """Entry point of a VMM process (a fresh interpreter); serves fd 3 and exits the process."""

def _set_egress_resolver(spec: str) -> None:
    """Where the broker resolves admitted names, for every sandbox of this process: "system",
    "dns:HOST:PORT" or "hosts:NAME=IP[,IP];NAME=IP". A bad spec raises ValueError."""

def _egress_broker_sandboxes() -> int:
    """Sandboxes the broker serves now (for leak checks)."""

def _egress_canonical(rule: str) -> str:
    """The engine's reading of one egress rule, in canonical form; ValueError for a bad rule."""

def _egress_start() -> None:
    """Start the egress broker thread (the package does on import; never in a VMM process)."""

def _egress_special_ranges() -> list[tuple[str, str]]:
    """The special-purpose table (the engine's one copy): (CIDR block, registry name) pairs."""

def _egress_special(addr: str) -> str | None:
    """Why an address is special (a registry range, IPv4 inside IPv6, the host's own), or None.
    ValueError for a string that is not an IP address."""

def _egress_net_is_public(cidr: str) -> bool:
    """Whether no address of a CIDR block is special; ValueError for a bad block."""

def _set_egress_public(spec: str) -> None:
    """Declare special-purpose ranges public for this process ("" for none): a lab network.
    ValueError for a bad spec or a range that may never be public (loopback, link-local)."""

def _egress_public() -> list[str]:
    """The ranges declared public now."""

def _egress_max_flows(n: int | None = None) -> int:
    """The per-sandbox flow cap: with `n`, set it (ValueError outside 1..=2000); returns it."""

class _KvmProfile(TypedDict, total=False):
    name: str
    kind: Literal["pvm", "intel", "amd", "unknown"]
    paging: Literal["shadow", "tdp"]
    nested: bool | None
    source: str
    io_completes_on_next_run: bool
    guest_tlb_flush: bool
    cpuid_filtered: bool
    exit_ns: int

def _kvm_profile(measure_exit: bool = False) -> _KvmProfile:
    """The KVM host profile this process detected (the engine's `vstate::profile`); with
    `measure_exit`, also `exit_ns`, the median cost of one exit here (about 2,000 of a probe VM)."""

def _quota_available() -> bool:
    """Whether this process can give sandboxes disk quotas (tmpfs instances of their own)."""

def _crng_stream(seed: bytes, n: int) -> bytes:
    """The first `n` bytes (at most 1 MiB) of the sandbox CRNG's stream after a reseed with the
    32-byte `seed` (the engine's own; the SDK's seed-ack check)."""
