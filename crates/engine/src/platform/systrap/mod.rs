//! The systrap platform: a guest process runs as a confined host process of its own, and every
//! syscall its code makes traps to the VMM through shared memory. No KVM.
//!
//! # Shape
//! A [`Stub`] is one host process that holds one guest process's address space. Its only code of its
//! own is a small position-independent blob ([`blob`]) copied to a fixed high address
//! ([`Stub::reserved_range`]); everything else in its address space is the guest's, placed there by
//! the VMM with [`Stub::map`]. Guest code runs natively in that process. A seccomp filter
//! ([`filter`]) lets through only the few syscalls the blob makes *from the blob's own code*; any
//! syscall from anywhere else (guest code) is not executed but raises SIGSYS. The blob's signal
//! handler, on an alternate stack inside the reserved range, copies the guest's registers from the
//! signal frame into a page shared with the VMM ([`shared`]), hands the turn to the VMM (a short spin,
//! then a futex), waits for the VMM's answer and returns from the signal with the (possibly changed)
//! registers. Page faults (SIGSEGV), bus errors, `rdtsc` (trapped with `PR_SET_TSC`), `cpuid`
//! (trapped with CPUID faulting where the CPU has it) and other synchronous signals take the same
//! path. While the stub is parked in its handler the VMM can also make it execute a few syscalls on
//! the guest's address space (map, unmap, protect) and fork.
//!
//! # Trust
//! Guest code and the blob share one address space, so the guest can write the shared page and the
//! blob's stack, and can even jump into the blob. Nothing there is trusted (as in gVisor's systrap):
//! the boundary is the seccomp filter (which admits from the blob's addresses only the syscalls in
//! [`filter::STUB_SYSCALLS`], with their dangerous arguments pinned) and the confinement around it
//! ([`confine`]: no capabilities, no_new_privs, namespaces, an empty root, rlimits). What a hostile
//! guest can do with the blob is edit its own address space; the VMM treats every value it reads back
//! (registers, exit reasons) as guest-controlled.
//!
//! # What the VMM (the personality) must do
//! - Never hand out guest addresses in [`Stub::reserved_range`] and refuse guest `mmap(MAP_FIXED)`,
//!   `munmap`, `mprotect`, `mremap` and `madvise` on it (the methods here return
//!   [`Error::Reserved`] as a backstop).
//! - Emulate every syscall reported by [`Exit::Syscall`]: the guest's syscalls never run on the host.
//! - Call [`prepare`] once before anything hides the host's `/proc` (the VMM's own jail pivots
//!   to an empty root), since guest memory is reached through `/proc/<pid>/mem`.
//! - Call [`Stub::spawn`] and [`Stub::fork`] from a thread that lives as long as the stub
//!   (`PR_SET_PDEATHSIG` fires when the spawning *thread* exits).
//!
//! One guest thread per stub for now: the registers live in one shared page and one signal frame.

pub mod blob;
pub mod confine;
pub mod filter;
pub mod layout;
pub mod memory;
pub mod shared;

use std::os::fd::BorrowedFd;

pub use confine::{Confinement, ConfinementReport};
pub use kvm_bindings::kvm_regs;

/// What went wrong on the VMM's side of a stub. Guest behaviour never produces these: it produces an
/// [`Exit`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The stub could not be created.
    #[error("the systrap stub could not be created at step `{step}`: {source}; the engine needs Linux x86-64 with seccomp, run as root or with user namespaces allowed")]
    Spawn {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The stub process ended while the VMM needed it.
    #[error("the systrap stub process (pid {pid}) is gone and the guest it held is lost; spawn a new one")]
    Gone { pid: i32 },
    /// A VMM request touched the reserved range.
    #[error("the range {addr:#x}+{len:#x} touches the systrap stub's reserved range; guest mappings must stay outside Stub::reserved_range()")]
    Reserved { addr: u64, len: u64 },
    /// The host kernel refused an address-space edit the stub made for the VMM.
    #[error("the systrap stub's {op} failed: {source}; check the arguments against mmap(2)")]
    Op {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// Guest memory access hit an unmapped or inaccessible byte.
    #[error("guest address {addr:#x} (+{len} bytes) is not mapped or not accessible (EFAULT)")]
    Fault { addr: u64, len: usize },
    /// The request needs a stub parked at a guest exit.
    #[error("the systrap stub cannot {what} now: it has no guest exit to work on; call run() first")]
    NotParked { what: &'static str },
    /// A host call on the VMM's side failed.
    #[error("host call {call} failed: {source}")]
    Host {
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// The result type of this platform.
pub type Result<T> = std::result::Result<T, Error>;

/// Why [`Stub::run`] returned. In every case the registers passed to `run` now hold the guest's
/// registers at the exit, and `fs_base` its FS base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The guest made a syscall, which did not run on the host. `rax` holds the syscall number,
    /// `rdi, rsi, rdx, r10, r8, r9` its arguments, `rip` the address after the `syscall`
    /// instruction (and `rcx`, `r11` what the instruction put there). Set `rax` to the result and
    /// call `run` again to return it.
    Syscall,
    /// A page fault at `addr` (a read unless `write`; an instruction fetch if `exec`), not served by
    /// the host. `rip` is the faulting instruction: serve the fault (e.g. [`Stub::map`]) and `run`
    /// again to retry it, or deliver a signal.
    Fault { addr: u64, write: bool, exec: bool },
    /// The guest executed `rdtsc` (`rdtscp` if `rdtscp`). `rip` is the instruction (2 bytes, 3 for
    /// `rdtscp`): set `rax`/`rdx` (and `rcx` for `rdtscp`), advance `rip` and `run` again.
    Rdtsc { rdtscp: bool },
    /// The guest executed `cpuid` (only where the CPU has CPUID faulting, see
    /// [`ConfinementReport::cpuid_faulting`]). `rip` is the 2-byte instruction: set
    /// `rax, rbx, rcx, rdx`, advance `rip` by 2 and `run` again.
    Cpuid,
    /// Any other synchronous signal the guest raised: SIGILL, SIGFPE, SIGTRAP, SIGBUS, or a SIGSEGV
    /// that is not a page fault (a general protection fault such as a privileged instruction).
    /// `code` and `addr` are the host's `si_code` and `si_addr`. `rip` is where it happened.
    Signal { signo: i32, code: i32, addr: u64 },
    /// The stub process ended (killed by the host, or by the seccomp filter because code jumped into
    /// the blob with a syscall it may not make). `status` is the raw wait status if known.
    Exited { status: Option<i32> },
}

/// A confined host process holding one guest process's address space and running its code.
///
/// Dropping a `Stub` kills its process. See the module docs for the contract with the VMM.
#[derive(Debug)]
pub struct Stub {
    _todo: (),
}

/// Open the host's `/proc` now, for every stub this process will make. Call it before anything
/// (the VMM's jail) hides `/proc`; calling it again does nothing. [`Stub::spawn`] calls it too.
pub fn prepare() -> Result<()> {
    todo!()
}

impl Stub {
    /// The guest-virtual range `[start, end)` this platform keeps for itself in every stub: the blob's
    /// code (read and execute), the shared page and the blob's stacks. The VMM must never map guest
    /// memory there and must refuse guest requests that would change it.
    pub const fn reserved_range() -> (u64, u64) {
        (layout::STUB_BASE, layout::STUB_END)
    }

    /// Create a confined stub with an empty address space (nothing mapped outside
    /// [`Stub::reserved_range`]) and no guest context yet: map code and a stack, then [`Stub::run`]
    /// with the entry registers. The stub is a child of the calling process and gets SIGKILL when the
    /// calling thread exits.
    pub fn spawn(conf: &Confinement) -> Result<Stub> {
        let _ = conf;
        todo!()
    }

    /// The host pid of the stub process.
    pub fn pid(&self) -> i32 {
        todo!()
    }

    /// What confinement the host granted this stub (namespaces, CPUID faulting).
    pub fn report(&self) -> &ConfinementReport {
        todo!()
    }

    /// Run guest code from `regs` and `fs_base` until the next exit; on return both hold the guest's
    /// state at that exit. Only the general-purpose registers, `rip` and `rflags` (the bits user mode
    /// may change) are taken from `regs`; segment registers stay the host's user segments.
    pub fn run(&mut self, regs: &mut kvm_regs, fs_base: &mut u64) -> Result<Exit> {
        let _ = (regs, fs_base);
        todo!()
    }

    /// Read guest memory at virtual address `va` into `buf`. Safe while the address space changes:
    /// an unmapped or unreadable byte gives [`Error::Fault`], never a crash.
    pub fn read(&self, va: u64, buf: &mut [u8]) -> Result<()> {
        let _ = (va, buf);
        todo!()
    }

    /// Write `data` to guest memory at `va`, as a debugger does: also into read-only private pages
    /// (copy-on-write; e.g. relocations in text). Unmapped bytes give [`Error::Fault`]; a write that
    /// faults part-way may have written a prefix.
    pub fn write(&self, va: u64, data: &[u8]) -> Result<()> {
        let _ = (va, data);
        todo!()
    }

    /// `mmap(va, len, prot, flags | MAP_FIXED, fd, offset)` executed by the stub in the guest's
    /// address space: replaces whatever was mapped at `[va, va+len)`. `flags` are Linux `MAP_*` flags
    /// (`MAP_PRIVATE` or `MAP_SHARED`, `MAP_ANONYMOUS` when `fd` is `None`, `MAP_NORESERVE`...). The
    /// fd is passed to the stub with SCM_RIGHTS and closed there after the mmap. The stub must be
    /// parked (spawned, or after an exit of `run`).
    pub fn map(&mut self, va: u64, len: u64, prot: i32, flags: i32, fd: Option<BorrowedFd<'_>>, offset: u64) -> Result<()> {
        let _ = (va, len, prot, flags, fd, offset);
        todo!()
    }

    /// `munmap(va, len)` in the guest's address space.
    pub fn unmap(&mut self, va: u64, len: u64) -> Result<()> {
        let _ = (va, len);
        todo!()
    }

    /// `mprotect(va, len, prot)` in the guest's address space.
    pub fn protect(&mut self, va: u64, len: u64, prot: i32) -> Result<()> {
        let _ = (va, len, prot);
        todo!()
    }

    /// Fork the stub: the host copies the guest's whole address space copy-on-write (what is mapped
    /// `MAP_SHARED` stays shared), and the new stub is parked at the same guest exit as this one, so
    /// `run` on it continues the same guest context. The new stub gets its own shared page and socket.
    /// Its process is a child of this stub's process, not of the caller: it is not killed when the
    /// caller's thread exits but when its handle is dropped, or at its next trap after every copy of
    /// its socket is closed (a forked guest computing without syscalls outlives a killed VMM until
    /// then).
    pub fn fork(&mut self) -> Result<Stub> {
        todo!()
    }

    /// Give up this handle without killing the process: for the side of a host fork of the VMM that
    /// does not own this stub (both sides inherit every `Stub`). Closes this side's fds and mapping.
    pub fn release(self) {
        todo!()
    }

    /// The guest's XSAVE area (x87, SSE, AVX... in the standard, non-compacted XSAVE layout, the same
    /// layout as `kvm_xsave`'s region) at the current exit, as the host saved it in the signal frame.
    /// Costs one read of guest-stub memory; nothing is copied on the trap path.
    pub fn xsave(&self) -> Result<Vec<u8>> {
        todo!()
    }

    /// Replace the XSAVE area that the next `run` restores. `area` must be as long as what
    /// [`Stub::xsave`] returns.
    pub fn set_xsave(&mut self, area: &[u8]) -> Result<()> {
        let _ = area;
        todo!()
    }
}
