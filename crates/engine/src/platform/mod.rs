//! Platforms: what runs the guest's code, behind the boundary `guestos` is written against.
//!
//! After gVisor's `pkg/sentry/platform`: the syscall personality ([`crate::guestos`], our Sentry)
//! implements Linux and never asks which platform it runs on; a platform runs guest code and
//! holds its address space. What `guestos` needs of a platform, and nothing more, is [`Memory`]:
//! - read and write guest memory by virtual address (`Ctx::read`, `Ctx::write`, the exec loader's
//!   initial stack);
//! - change the address space: map (anonymous memory, or a host file at an offset, private or
//!   shared), unmap, protect;
//! - what the guest's memory costs (`sysinfo`, `/proc/meminfo`, `/proc/self/statm`).
//!
//! The registers and the FS base reach handlers as `kvm_bindings::kvm_regs` and the `fs.base` of a
//! `kvm_sregs`: plain structs here, whatever the platform (systrap copies its own register frame
//! into them and back). Running a context until its next syscall, fault or signal is the run
//! loop's business, one per platform, and so are clone, fork and snapshots (below); the scheduler
//! of a process's threads (`vmm::threads`, M:1) only swaps those register structs between runs, so
//! it stays platform-neutral.
//!
//! # The platforms
//! - **kvm** ([`kvm`]): guest ring 3 in a KVM VM with no guest kernel. Guest memory is one host
//!   mapping (`vstate::memory`, guest-physical), the engine keeps the guest's page tables
//!   (`arch::x86_64::paging`) and hands out frames; `guestos::mm` edits those page tables. The
//!   rest of this platform has not moved here yet: `vstate/` (VM, vCPU, memory, TLB, the host
//!   profiles) and `arch/x86_64/` (page tables, descriptor tables, the ring-0 stubs) are the kvm
//!   platform, and the KVM run loop is `vmm::Machine::run`. Moving them under `platform/kvm/` is
//!   a rename for later.
//! - **systrap** (`platform/systrap/`): each guest process is a confined host process (the stub)
//!   whose syscalls a seccomp filter traps to a SIGSYS handler that passes the registers to the
//!   VMM through a shared page. Guest memory lives in the stub at the guest's own virtual
//!   addresses; the host kernel keeps the page tables, so there are no frames and no guest page
//!   tables. `guestos` keeps its own record of the mappings (VMAs, brk, /proc/self/maps) and asks
//!   the stub to map, unmap and protect ([`HostSpace`]); the VMM reads and writes by virtual
//!   address through it. Its run loop is `vmm::systrap`.
//!
//! # What each platform adds for clone, fork, snapshot and reset
//! kvm has all of these today; on systrap guest fork works (`vmm::systrap`) and the rest is
//! still to build, in this shape:
//! - **Guest fork** (fork/vfork/clone without CLONE_VM) is a host fork of the VMM process on both.
//!   kvm: guest memory is `MAP_PRIVATE`, the child makes a new VM over it. systrap: the child VMM
//!   also forks the stub (`Stub::fork`, the host's copy-on-write of the stub's pages).
//! - **Bake / snapshot**: kvm writes guest-physical memory to a file (`persist`). systrap reads the
//!   stub's mappings (the VMAs `guestos` records) into a memory file and the registers into the
//!   state file.
//! - **Clone from a template / restore**: kvm maps the memory file `MAP_PRIVATE` and forks a
//!   paused zygote VMM. systrap: a zygote stub + VMM pair, forked together per clone; a restore
//!   maps the snapshot's memory file `MAP_PRIVATE` at each VMA's address inside a fresh stub.
//! - **Reset**: kvm restores dirty pages from the file. systrap: `MADV_DONTNEED` on the stub's
//!   private file mappings (the next access sees the snapshot file again), or a new clone.
//! - **Shared memory across guest processes** (MAP_SHARED): kvm gives each a window in a KVM slot
//!   (`vstate::shared`); systrap maps the same host file `MAP_SHARED` in each stub.

pub mod kvm;
pub mod systrap;

use std::os::fd::RawFd;

use crate::guestos::Errno;

/// A guest address space that the host kernel keeps: the platform maps, unmaps and protects
/// inside the guest's host process, and reads and writes its memory by virtual address (systrap).
///
/// Errors are the errno the guest should see (EFAULT for an address nothing maps, ENOMEM when
/// the host refuses memory).
pub trait HostSpace {
    /// Copy guest memory at virtual address `va` into `buf`.
    fn read(&self, va: u64, buf: &mut [u8]) -> Result<(), Errno>;
    /// Copy `data` to guest virtual address `va`, whatever the page's protection (the loader
    /// writes read-only pages too, as a kernel does).
    fn write(&mut self, va: u64, data: &[u8]) -> Result<(), Errno>;
    /// Map [va, va+len) (page aligned, replacing whatever was there): `file` is a host descriptor
    /// of the VMM and the file offset, `None` for anonymous memory; `flags` are mmap's
    /// (MAP_PRIVATE or MAP_SHARED; MAP_FIXED is implied).
    fn map(&mut self, va: u64, len: u64, prot: u32, flags: u32, file: Option<(RawFd, u64)>) -> Result<(), Errno>;
    /// Unmap [va, va+len).
    fn unmap(&mut self, va: u64, len: u64) -> Result<(), Errno>;
    /// Change the protection of [va, va+len).
    fn protect(&mut self, va: u64, len: u64, prot: u32) -> Result<(), Errno>;
    /// The guest memory the sandbox may use, in bytes (what `sysinfo` reports as total).
    fn budget(&self) -> u64;
    /// The virtual range [start, end) the platform keeps for itself (systrap's stub code and
    /// shared page): never handed to the guest, and guest calls that would change it fail.
    fn reserved(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// The guest's memory as a syscall handler reaches it: on the platform running this process.
pub enum Memory<'a> {
    /// The engine's own page tables over guest-physical memory.
    Kvm(kvm::Memory<'a>),
    /// An address space the host kernel keeps (systrap).
    Host(&'a mut dyn HostSpace),
}

impl Memory<'_> {
    /// Total guest memory, in bytes.
    pub fn total(&self) -> u64 {
        match self {
            Memory::Kvm(k) => k.mem.size(),
            Memory::Host(h) => h.budget(),
        }
    }

    /// Guest memory not handed out yet, in bytes; `mapped` is what the process's mappings add up
    /// to (where the platform does not count its pages itself, that is the estimate).
    pub fn free(&self, mapped: u64) -> u64 {
        match self {
            Memory::Kvm(k) => k.frames.available() * crate::arch::x86_64::layout::PAGE_SIZE,
            Memory::Host(h) => h.budget().saturating_sub(mapped),
        }
    }

    /// Guest memory this process uses, in bytes, never more than `mapped` (its mappings' size).
    pub fn used(&self, mapped: u64) -> u64 {
        match self {
            Memory::Kvm(k) => k.used().min(mapped),
            Memory::Host(h) => mapped.min(h.budget()),
        }
    }
}
