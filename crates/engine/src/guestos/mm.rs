//! The guest address space as the guest sees it (mmap, munmap, mprotect, brk, mremap).
//!
//! [`Mm`] keeps the list of virtual memory areas (VMAs) the way Linux does: every user mapping the
//! guest can see is inside exactly one VMA, and every VMA knows its protection and what backs it (for
//! /proc/self/maps). The page tables follow the VMAs eagerly: a page is backed by a frame from the
//! moment it becomes accessible, except in a file mapping longer than [`LAZY_MAP_MIN`], whose pages
//! are read in from the file when the guest first touches them.
//!
//! How protections become page-table entries:
//! - an accessible page is present, user, writable only with PROT_WRITE, and NX unless PROT_EXEC;
//! - a PROT_NONE page that has contents (it was accessible once, or maps a file) stays present but
//!   without the user bit, so ring 3 faults on it and its contents survive a later mprotect;
//! - a PROT_NONE anonymous page that never had contents has no frame at all, so the large
//!   reservations that CPython and glibc make cost nothing until they are mprotect'ed.
//!
//! Lazy file mappings (demand paging). Mapping a large file whole is common (CPython's test_mmap
//! maps 4 GiB sparse files and reads one page), and copying it in at mmap time would take as many
//! frames as the file has pages, far more than a sandbox has. A mapping longer than
//! [`LAZY_MAP_MIN`] therefore gets no frames at mmap time; its VMA keeps a descriptor of the file
//! ([`Lazy`]). A guest access to a page without a frame faults to the VMM (`vmm::process::on_fault`),
//! which asks [`Mm::fault`] to read in the [`FAULT_AROUND`] block around it and resumes the guest;
//! the syscall layer does the same for the buffers it reads and writes on the guest's behalf
//! ([`read_user`], [`write_user`]). As on Linux, a page wholly past the end of the file raises
//! SIGBUS, and an access the VMA's protection does not allow raises SIGSEGV (SEGV_ACCERR). Every
//! other operation here works on the pages that are present and leaves the others to the file.
//!
//! Frames given back (munmap, brk, MAP_FIXED over a mapping, mremap) go to the frame allocator's free
//! list and are cleared when handed out again. Every frame whose translation an operation removed,
//! narrowed or moved is reported in [`Space::stale`] (and from there `Ctx::stale_frames`), because
//! KVM keeps using cached translations after the host edits page tables (see `vstate::tlb`); the VMM
//! invalidates them before the guest runs again. Granting more access needs nothing, and neither
//! does reading in a page that was not present.
//!
//! Shared mappings (MAP_SHARED of a file, including /dev/shm and /tmp on the sandbox's tmpfs;
//! MAP_SHARED|MAP_ANONYMOUS, also of /dev/zero) are truly shared. Each guest process is a VMM
//! process of its own whose guest memory is `MAP_PRIVATE` (a host fork copies it), so a shared
//! mapping cannot live there: it gets a window (`vstate::shared`), a host `MAP_SHARED` mapping of
//! the file's host descriptor (of a new memfd for anonymous memory) at guest-physical addresses of
//! its own, in a KVM memory slot of its own, and its VMA records where ([`Vma::window`]). Its pages
//! point into the window and never take frames; every process mapping the file, and every guest
//! fork child of the process that mapped it (the host fork keeps the window shared, and the child's
//! new VM gets the same slots), sees every write at once, with no msync: msync only checks its
//! arguments. Two mappings of one file in one process are two windows, coherent through the host
//! page cache. Up to [`LAZY_MAP_MIN`] the pages are pointed at the window at mmap (page tables
//! only: a first touch is then a fault inside KVM, not in the VMM); longer mappings, like lazy file
//! mappings, when first touched (the [`Fault`] path; their VMAs carry the window's descriptor in
//! [`Vma::lazy`], so syscall buffers in pages not yet pointed anywhere are read from the file).
//! munmap, mprotect, partial unmaps and mremap that moves or shrinks work on them as on other
//! mappings; a window goes (its slot deleted before the guest runs again) when no VMA maps any of
//! it ([`Mm::drop_unused_windows`]), so execve and exit drop them all (a small one keeps its KVM
//! slot, parked for the next shared mapping of its length: `vstate::shared::Parked`). Shared
//! anonymous memory is a nameless file in the sandbox's shared-memory pool
//! (`vstate::shared::pool`, `crate::quota::SHARED_MEMORY`): a mapping longer than what the pool has
//! left is ENOMEM, and a touch of a page the pool has no room for ends the process by SIGBUS, as
//! below for a file that shrank. Limits: at most
//! `vstate::shared::MAX_WINDOWS` shared mappings per process (mmap answers ENOMEM beyond, as Linux
//! does past vm.max_map_count); mremap cannot grow a shared mapping (ENOMEM), nor duplicate one
//! (old_len 0: EINVAL); mprotect cannot make a shared mapping of a file opened read-only writable
//! (EACCES, as on Linux). A file that shrinks under a mapping (another process truncates it): a
//! guest access to a page now past the end makes KVM fail the run, and the process ends by SIGBUS
//! as it would by Linux's default action, but a SIGBUS handler of its own does not run (the
//! faulting address is not known there); the VMM's own accesses check the size first (EFAULT).
//!
//! How the sandbox-level operations treat shared mappings:
//! - **Snapshots** (template bakes, `snapshot`): a read-only shared mapping (of a file opened
//!   read-only, e.g. Python's `mmap(..., access=ACCESS_READ)`) becomes a private copy of its file
//!   first ([`Mm::unshare_read_only`]), whose pages the snapshot holds, as it holds a lazy file
//!   mapping's. A snapshot refuses a guest with writable shared mappings (a clear error: end the
//!   processes that use them, or unmap them, first): their contents live in host mappings of files
//!   and memfds that a snapshot's memory file does not hold. A template therefore never has any
//!   window.
//! - **Forks of a sandbox** (`fork_group`, a clone of a live sandbox, a spare) are separate
//!   sandboxes: a child's windows stop being shared with the parent's before it runs
//!   ([`Mm::privatize_windows`]). A window of a file follows the file, of which each sandbox has
//!   its own copy (`persist::privatize` copied the writable mounts and reopened the mapped files):
//!   it maps the child's copy now. Shared anonymous memory (and a file unlinked since it was
//!   mapped) gets a copy of its contents at the fork, in a new memfd: the child's processes go on
//!   sharing it among themselves, not with the parent's. A read-only window of a file of the
//!   writable mounts follows the child's copy too; one of the root filesystem stays.
//! - **Resets** go back to the template, which has none: every window goes.
//!
//! Simplifications, all deliberate for now:
//! - MADV_DONTNEED zeroes private anonymous pages (as Linux does); on file mappings it leaves the
//!   contents alone instead of reloading them from the file, except in lazy ones, where it drops
//!   the pages and the next access reads the file again (as Linux does).
//! - mremap can grow a file mapping only by moving it, never by extending it in place with more file
//!   data: growing a file mapping answers ENOMEM.

pub mod host;

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::files::Kind;
use super::{Ctx, Errno, GuestOs, SysResult, EACCES, EBADF, EEXIST, EFAULT, EINVAL, ENOMEM};
use crate::arch::x86_64::layout::PAGE_SIZE;
use crate::arch::x86_64::paging::{zero_page, AddressSpace, FrameAllocator, PTE_A, PTE_D, PTE_FILLED, PTE_NX, PTE_U, PTE_W};
use crate::error::Error;
use crate::vstate::memory::GuestMemory;

pub const PROT_NONE: u32 = 0;
pub const PROT_READ: u32 = 1;
pub const PROT_WRITE: u32 = 2;
pub const PROT_EXEC: u32 = 4;
const PROT_GROWSDOWN: u32 = 0x0100_0000;
const PROT_GROWSUP: u32 = 0x0200_0000;

pub const MAP_SHARED: u32 = 0x01;
pub const MAP_PRIVATE: u32 = 0x02;
pub const MAP_SHARED_VALIDATE: u32 = 0x03;
pub const MAP_FIXED: u32 = 0x10;
pub const MAP_ANONYMOUS: u32 = 0x20;
pub const MAP_FIXED_NOREPLACE: u32 = 0x10_0000;

const MREMAP_MAYMOVE: u64 = 1;
const MREMAP_FIXED: u64 = 2;

const MADV_DONTNEED: u64 = 4;
const MADV_DONTNEED_LOCKED: u64 = 24;
/// The highest advice value Linux 6.1 knows (MADV_COLLAPSE).
const MADV_MAX: u64 = 25;

const ENODEV: Errno = Errno(19);
const EOVERFLOW: Errno = Errno(75);

/// The end of user space (Linux's TASK_SIZE on x86-64 with 4-level paging).
pub const TASK_SIZE: u64 = 0x7fff_ffff_f000;
/// Nothing is mapped below this (Linux's default vm.mmap_min_addr).
pub const MMAP_MIN_ADDR: u64 = 0x1_0000;
/// mmap places mappings top-down from here (the program interpreter is loaded at this address).
pub const MMAP_TOP: u64 = 0x7fff_f7a0_0000;
/// The largest mapping one call may ask for.
const MAX_MAP: u64 = 1 << 46;
/// The frame address bits of a page-table entry.
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
/// File mappings longer than this are read in page by page as the guest touches them (see the
/// module comment); shorter ones are copied in whole at mmap time, which costs one syscall instead
/// of a fault per block and is what nearly every mapping (shared libraries, small data files) needs.
pub const LAZY_MAP_MIN: u64 = 64 << 20;
/// The longest anonymous mapping (or heap growth) whose host pages are filled at once
/// ([`Mm::populate_anon`]).
pub const ANON_PREFILL_MAX: u64 = 2 << 20;

/// How much of a lazy mapping one fault reads in: the aligned block around the faulting page (Linux's
/// default fault_around_bytes). Larger blocks would take fewer faults (each is a VM exit, tens of
/// microseconds on kvm_pvm) but give a frame to every page of them, touched or not, and a sparse
/// reader of a large file would run out of frames sooner.
pub const FAULT_AROUND: u64 = 64 << 10;

/// Identity of a mapped file, shown in /proc/self/maps.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FileId {
    pub dev: u64,
    pub ino: u64,
}

/// One virtual memory area [start, end); the start is the key in [`Mm::vmas`].
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Vma {
    pub end: u64,
    /// PROT_* bits.
    pub prot: u32,
    /// Asked for with MAP_SHARED (a window: see the module comment).
    pub shared: bool,
    /// What /proc/self/maps shows: a guest path, "[heap]", "[stack]" or "" for anonymous memory.
    pub name: String,
    /// The mapped file and the file offset of `start`; `None` for anonymous memory.
    pub file: Option<FileId>,
    pub offset: u64,
    /// A file mapping longer than [`LAZY_MAP_MIN`]: where pages that have no frame yet are read
    /// from. A snapshot does not keep it (see [`Mm::read_in_lazy`]). Every shared mapping has
    /// one too: the file (or memfd) of its window.
    #[serde(skip)]
    pub lazy: Option<MapFd>,
    /// A shared mapping: the guest-physical address in its window (`vstate::shared`) that the
    /// VMA's start maps to. Its pages point there, never at frames; a snapshot holds none
    /// ([`Mm::shared_count`]).
    #[serde(skip)]
    pub window: Option<u64>,
    /// A private file mapping whose pages are still the file's: made by mmap without
    /// PROT_WRITE and never made writable since (a host-kept address space, `mm/host.rs`, maps
    /// the same file again over it by changing only its protection). False wherever that is not
    /// known, so a restored snapshot starts with none.
    #[serde(skip)]
    pub pristine: bool,
}

/// A mapping's own descriptor of its file, kept while any part of the mapping is (the guest may
/// close its descriptor right after mmap): where a shared mapping's written pages go back
/// ([`Vma::backing`]), and where a lazy mapping reads the pages the guest touches ([`Vma::lazy`]).
/// Equal when it is the same descriptor.
#[derive(Clone, Debug)]
pub struct MapFd(pub Arc<OwnedFd>);

impl PartialEq for MapFd {
    fn eq(&self, other: &MapFd) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }
}
impl Eq for MapFd {}

impl Vma {
    /// Make this (private or shared, with its protection set) a mapping of `f`: checks the offset
    /// (page aligned, else EINVAL; offset + `len` at most `max_end`, else EOVERFLOW) and the file
    /// ([`check_file`]). Returns the file's size.
    fn of_file(&mut self, f: &MapFile, len: u64, max_end: u64) -> Result<u64, Errno> {
        if f.offset % PAGE_SIZE != 0 {
            return Err(EINVAL);
        }
        f.offset.checked_add(len).filter(|&e| e <= max_end).ok_or(EOVERFLOW)?;
        let (id, size) = check_file(f.fd, self.prot, self.shared)?;
        self.file = Some(id);
        self.offset = f.offset;
        self.name = f.name.clone();
        Ok(size)
    }

    pub fn anon(end: u64, prot: u32, name: &str) -> Vma {
        Vma { end, prot, shared: false, name: name.to_string(), file: None, offset: 0, lazy: None, window: None, pristine: false }
    }
}

/// Virtual memory areas of the guest process and its program break.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Mm {
    pub vmas: BTreeMap<u64, Vma>,
    /// Where the heap starts (page aligned, just above the program) and the current break.
    pub brk_start: u64,
    pub brk: u64,
    /// Top-down mmap placement starts below this address.
    pub mmap_top: u64,
    /// Whether a lazy mapping was ever made here: spares [`Mm::lazy_areas`] a walk over every VMA
    /// on every syscall of the processes that never make one (nearly all). Never cleared.
    #[serde(skip)]
    pub maybe_lazy: bool,
    /// A shared mapping was unmapped (wholly or in part) since [`Mm::drop_unused_windows`] last
    /// looked: some window may have no VMA left.
    #[serde(skip)]
    pub windows_unmapped: bool,
}

impl Default for Mm {
    fn default() -> Self {
        Mm { vmas: BTreeMap::new(), brk_start: 0, brk: 0, mmap_top: MMAP_TOP, maybe_lazy: false, windows_unmapped: false }
    }
}

/// The guest memory, frames and page tables an [`Mm`] operation works on.
pub struct Space<'a> {
    pub mem: &'a mut GuestMemory,
    pub frames: &'a mut FrameAllocator,
    pub aspace: &'a AddressSpace,
    /// Frames whose translations were removed, narrowed or redirected: the guest must forget them
    /// before it runs again (handed to `Ctx::stale_frames`, see `vstate::tlb`).
    pub stale: Vec<u64>,
}

impl<'a> Space<'a> {
    pub fn new(mem: &'a mut GuestMemory, frames: &'a mut FrameAllocator, aspace: &'a AddressSpace) -> Space<'a> {
        Space { mem, frames, aspace, stale: Vec::new() }
    }
}

/// A file to map: an open host descriptor, the offset, and the name maps shows.
pub struct MapFile {
    pub fd: RawFd,
    pub offset: u64,
    pub name: String,
}

/// The kind of access a page fault was for.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Access {
    Read,
    Write,
    Exec,
}

impl Access {
    /// The access a #PF error code describes: bit 1 is set for a write, bit 4 for an instruction
    /// fetch.
    pub fn of_error_code(error_code: u64) -> Access {
        if error_code & 0x10 != 0 {
            Access::Exec
        } else if error_code & 0x2 != 0 {
            Access::Write
        } else {
            Access::Read
        }
    }

    /// Whether a mapping with protection `prot` allows it (on x86 every right includes reading).
    fn allowed(self, prot: u32) -> bool {
        match self {
            Access::Read => prot & (PROT_READ | PROT_WRITE | PROT_EXEC) != 0,
            Access::Write => prot & PROT_WRITE != 0,
            Access::Exec => prot & PROT_EXEC != 0,
        }
    }

    /// Whether the leaf entry `pte` of a present page allows it from ring 3.
    pub(crate) fn allowed_by_pte(self, pte: u64) -> bool {
        pte & PTE_U != 0
            && match self {
                Access::Read => true,
                Access::Write => pte & PTE_W != 0,
                Access::Exec => pte & PTE_NX == 0,
            }
    }
}

/// What became of a guest page fault (see [`Mm::fault`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// Not in a lazy mapping: the fault is the guest's own (a signal, as before).
    NotLazy,
    /// The page has its frame now: the guest retries the access.
    Resolved,
    /// The page was present already and allows the access: the guest faulted on a translation
    /// cached from before it was (see `vstate::tlb`). The frame's cached translations must be
    /// dropped before the guest retries.
    Stale(u64),
    /// The mapping's protection does not allow the access: SIGSEGV with SEGV_ACCERR.
    Denied,
    /// The page lies wholly past the end of the file, or the file could not be read: SIGBUS.
    Bus,
    /// No frame left for the page: the process cannot go on.
    OutOfMemory,
}

/// A lazy mapping as host-side accesses to guest memory see it: a copy of what its VMA says, which
/// `Ctx` carries because syscall handlers hold the [`Mm`] and the `Ctx` apart.
#[derive(Clone, Debug)]
pub struct LazyArea {
    pub start: u64,
    pub end: u64,
    pub prot: u32,
    /// The file offset of `start`.
    pub offset: u64,
    pub file: Arc<OwnedFd>,
    /// A shared mapping's window address of `start` (see [`Vma::window`]).
    pub window: Option<u64>,
}

impl LazyArea {
    fn of(start: u64, v: &Vma) -> Option<LazyArea> {
        let MapFd(file) = v.lazy.as_ref()?;
        Some(LazyArea { start, end: v.end, prot: v.prot, offset: v.offset, file: file.clone(), window: v.window })
    }

    fn contains(&self, va: u64) -> bool {
        (self.start..self.end).contains(&va)
    }

    /// Where the pages that show the file end: a page past it lies wholly beyond the end of the
    /// file. Asked of the file each time, since it may have grown or shrunk since mmap.
    fn file_end(&self) -> Result<u64, Errno> {
        let size = file_size(self.file.as_raw_fd())?;
        let shown = page_up(size).unwrap_or(u64::MAX).saturating_sub(self.offset);
        Ok(self.start.saturating_add(shown).min(self.end))
    }

    /// Give the pages without a frame in the [`FAULT_AROUND`] block around `va` (clipped to the
    /// mapping and to the end of the file) frames holding the file's bytes, zero past its end.
    /// Pages that are present keep their contents (a private mapping's may differ from the file).
    fn read_in(&self, sp: &mut Space, va: u64) -> Fault {
        let Ok(file_end) = self.file_end() else { return Fault::Bus };
        if page_down(va) >= file_end {
            return Fault::Bus;
        }
        let block = va & !(FAULT_AROUND - 1);
        let (from, to) = (block.max(self.start), block.saturating_add(FAULT_AROUND).min(file_end));
        let Ok(present) = sp.aspace.present_pages(sp.mem, from, to) else { return Fault::Bus };
        if present.len() as u64 == (to - from) / PAGE_SIZE {
            return Fault::Resolved;
        }
        let present: std::collections::HashSet<u64> = present.into_iter().map(|(va, _)| va).collect();
        if let Some(window) = self.window {
            return map_window_pages(sp, from, to, window + (from - self.start), self.prot, &present);
        }
        let mut buf = vec![0u8; (to - from) as usize];
        if pread_full(self.file.as_raw_fd(), &mut buf, self.offset + (from - self.start)).is_err() {
            return Fault::Bus;
        }
        let flags = pte_flags(self.prot) | filled_flags(self.prot);
        let mut done = Vec::new();
        for (page, data) in (from..to).step_by(PAGE_SIZE as usize).zip(buf.chunks(PAGE_SIZE as usize)) {
            if present.contains(&page) {
                continue;
            }
            let step = sp.frames.alloc_with(sp.mem, data).and_then(|pa| {
                sp.aspace.map_page(sp.mem, sp.frames, page, pa, flags).inspect_err(|_| sp.frames.release(pa))
            });
            if step.is_err() {
                // The guest has not run since these were mapped: nothing can have cached them.
                for page in done {
                    if let Ok(Some(pa)) = sp.aspace.unmap_page(sp.mem, page) {
                        sp.frames.release(pa);
                    }
                }
                return Fault::OutOfMemory;
            }
            done.push(page);
        }
        Fault::Resolved
    }

    /// Read the file bytes that [va, va + buf.len()) shows (pages without a frame), zero past the
    /// end of the file. EFAULT if any of it lies in a page wholly past the end.
    fn read_file(&self, va: u64, buf: &mut [u8]) -> Result<(), Errno> {
        if va + buf.len() as u64 > self.file_end()? {
            return Err(EFAULT);
        }
        let n = pread_full(self.file.as_raw_fd(), buf, self.offset + (va - self.start))?;
        buf[n..].fill(0);
        Ok(())
    }
}

/// Point the pages of [from, to) that are not in `present` at the window pages from `gpa` on (a
/// shared mapping: no frames are taken, only page tables). Taken back on failure.
fn map_window_pages(sp: &mut Space, from: u64, to: u64, gpa: u64, prot: u32, present: &std::collections::HashSet<u64>) -> Fault {
    let flags = pte_flags(prot);
    let mut done = Vec::new();
    for page in (from..to).step_by(PAGE_SIZE as usize) {
        if present.contains(&page) {
            continue;
        }
        if sp.aspace.map_page(sp.mem, sp.frames, page, gpa + (page - from), flags).is_err() {
            // The guest has not run since these were mapped: nothing can have cached them.
            for page in done {
                let _ = sp.aspace.unmap_page(sp.mem, page);
            }
            return Fault::OutOfMemory;
        }
        done.push(page);
    }
    Fault::Resolved
}

/// Read guest memory at user address `va` for a syscall of the guest (its buffer), like
/// `AddressSpace::read_virt` with `user`, except that pages of the lazy mappings `lazy` that have no
/// frame are read from their file, as the guest would see them, without taking frames. EFAULT where
/// the guest could not read.
pub fn read_user(lazy: &[LazyArea], mem: &GuestMemory, aspace: &AddressSpace, va: u64, buf: &mut [u8]) -> Result<(), Errno> {
    let mut done = 0usize;
    while done < buf.len() {
        let cur = va.checked_add(done as u64).ok_or(EFAULT)?;
        let mut n = ((PAGE_SIZE - (cur & (PAGE_SIZE - 1))) as usize).min(buf.len() - done);
        match aspace.translate(mem, cur) {
            Ok((pa, pte)) if pte & PTE_U != 0 => mem.read(pa, &mut buf[done..done + n]).map_err(|_| EFAULT)?,
            Ok(_) => return Err(EFAULT),
            Err(_) => {
                let area = lazy.iter().find(|a| a.contains(cur) && Access::Read.allowed(a.prot)).ok_or(EFAULT)?;
                // The pages after this one that have no frame either: one read of the file for all.
                while done + n < buf.len() {
                    let next = cur + n as u64;
                    if !area.contains(next) || aspace.translate(mem, next).is_ok() {
                        break;
                    }
                    n += (PAGE_SIZE as usize).min(buf.len() - done - n);
                }
                area.read_file(cur, &mut buf[done..done + n])?;
            }
        }
        done += n;
    }
    Ok(())
}

/// Write guest memory at user address `va` for a syscall of the guest, like
/// `AddressSpace::write_virt` with `user`, except that pages of the lazy mappings `lazy` that have no
/// frame are read in first (as a guest write would fault them in). Like `write_virt`, ignores the
/// write bit: a page the guest may read, the host may write. EFAULT where that is not so, or when
/// no frame is left.
pub fn write_user(lazy: &[LazyArea], sp: &mut Space, va: u64, data: &[u8]) -> Result<(), Errno> {
    let mut done = 0usize;
    while done < data.len() {
        let cur = va.checked_add(done as u64).ok_or(EFAULT)?;
        let n = ((PAGE_SIZE - (cur & (PAGE_SIZE - 1))) as usize).min(data.len() - done);
        let (pa, pte) = match sp.aspace.translate(sp.mem, cur) {
            Ok(t) => t,
            Err(_) => {
                let area = lazy.iter().find(|a| a.contains(cur) && Access::Read.allowed(a.prot)).ok_or(EFAULT)?;
                if area.read_in(sp, cur) != Fault::Resolved {
                    return Err(EFAULT);
                }
                sp.aspace.translate(sp.mem, cur).map_err(|_| EFAULT)?
            }
        };
        if pte & PTE_U == 0 {
            return Err(EFAULT);
        }
        sp.mem.write(pa, &data[done..done + n]).map_err(|_| EFAULT)?;
        done += n;
    }
    Ok(())
}

/// The errno for an engine error while editing the guest's memory.
fn errno_of(e: Error) -> Errno {
    match e {
        Error::OutOfGuestMemory(_) => ENOMEM,
        _ => EFAULT,
    }
}

pub fn page_up(x: u64) -> Option<u64> {
    x.checked_add(PAGE_SIZE - 1).map(|v| v & !(PAGE_SIZE - 1))
}

pub fn page_down(x: u64) -> u64 {
    x & !(PAGE_SIZE - 1)
}

/// Leaf flags besides [`pte_flags`] for pages the host fills from a file before the guest runs
/// again (a private file mapping copied in at mmap, a lazy mapping's fault-around block): marked
/// accessed, and dirty where writable, as the guest's first use of each would leave them.
///
/// Why: under shadow paging every page a guest touches first is a fault in KVM (25-30 us on
/// kvm_pvm), and KVM's fault handler also maps up to 7 neighbours of the faulting entry (its
/// aligned group of 8) at no extra trap, but only entries whose accessed bit is set and whose host
/// page is present and writable; a writable entry without its dirty bit is mapped read-only first
/// and faults again when written. These pages were just written by the host, so they qualify once
/// marked: a library's pages then fault in up to 8 at a time (`python3 -c pass`: 1,099 -> 964
/// shadow faults). The guest does not see its page tables, so nothing else changes; the mark
/// [`PTE_FILLED`] keeps these pages out of `vmm::spawn_prefault`'s reports.
/// `COLLIMATE_MARK_FILLED=0` leaves the bits clear, to compare.
fn filled_flags(prot: u32) -> u64 {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let on = *ON.get_or_init(|| std::env::var_os("COLLIMATE_MARK_FILLED").is_none_or(|v| v != "0"));
    if !on || prot & (PROT_READ | PROT_WRITE | PROT_EXEC) == 0 {
        return 0;
    }
    PTE_A | PTE_FILLED | if prot & PROT_WRITE != 0 { PTE_D } else { 0 }
}

/// Page-table flags of an accessible page with protection `prot`; PROT_NONE gives a present page
/// that ring 3 cannot touch.
pub fn pte_flags(prot: u32) -> u64 {
    if prot & (PROT_READ | PROT_WRITE | PROT_EXEC) == 0 {
        return PTE_NX;
    }
    let mut f = PTE_U;
    if prot & PROT_WRITE != 0 {
        f |= PTE_W;
    }
    if prot & PROT_EXEC == 0 {
        f |= PTE_NX;
    }
    f
}

/// Whether going from leaf flags `old` to `new` takes away an access the guest had.
fn restricts(old: u64, new: u64) -> bool {
    (old & PTE_U != 0 && new & PTE_U == 0)
        || (old & PTE_W != 0 && new & PTE_W == 0)
        || (old & PTE_NX == 0 && new & PTE_NX != 0)
}

/// Check an address range the guest names: `addr` page aligned, `len` rounded up to pages, all of it
/// inside user space. Returns the page-aligned end.
fn user_range(addr: u64, len: u64) -> Result<u64, Errno> {
    if addr % PAGE_SIZE != 0 {
        return Err(EINVAL);
    }
    let len = page_up(len).ok_or(ENOMEM)?;
    let end = addr.checked_add(len).ok_or(ENOMEM)?;
    if end > TASK_SIZE {
        return Err(ENOMEM);
    }
    Ok(end)
}

/// A virtual range [start, end) a platform keeps for itself: guest mappings never touch it.
#[derive(Clone, Copy)]
struct Reserved(u64, u64);

impl Reserved {
    /// No range (kvm).
    const NONE: Reserved = Reserved(0, 0);

    fn touches(self, start: u64, end: u64) -> bool {
        start < self.1 && self.0 < end
    }
}

/// A move of the heap's top by brk(2), as page-aligned ranges: [old_top, new_top) is mapped, or
/// [new_top, old_top) unmapped.
enum Heap {
    Grow(u64, u64),
    Shrink(u64, u64),
}

impl Mm {
    /// The VMA containing `addr`, as (start, vma).
    pub fn vma_at(&self, addr: u64) -> Option<(u64, &Vma)> {
        self.vmas.range(..=addr).next_back().filter(|(_, v)| v.end > addr).map(|(s, v)| (*s, v))
    }

    /// Whether any VMA overlaps [start, end).
    pub fn overlaps(&self, start: u64, end: u64) -> bool {
        if let Some((_, v)) = self.vmas.range(..start).next_back() {
            if v.end > start {
                return true;
            }
        }
        self.vmas.range(start..end).next().is_some()
    }

    /// Whether VMAs cover every byte of [start, end).
    pub fn covered(&self, start: u64, end: u64) -> bool {
        self.covered_by(start, end, |_| true)
    }

    /// Whether VMAs for which `fits` holds cover every byte of [start, end).
    fn covered_by(&self, start: u64, end: u64, fits: impl Fn(&Vma) -> bool) -> bool {
        let mut at = start;
        while at < end {
            match self.vma_at(at) {
                Some((_, v)) if fits(v) => at = v.end,
                _ => return false,
            }
        }
        true
    }

    /// Map with large pages every 2 MiB block of the address space that private, read-only file
    /// mappings cover whole (program text and read-only data: see `paging`'s module comment), as far
    /// as the large-page region has room. Returns how many blocks it mapped; the caller makes the
    /// guest drop its old translations of them before it runs again.
    pub fn promote_text(&self, sp: &mut Space) -> crate::error::Result<usize> {
        use crate::arch::x86_64::layout::HUGE_PAGE;
        let fits = |v: &Vma| {
            v.file.is_some() && !v.shared && v.lazy.is_none() && v.prot & PROT_READ != 0 && v.prot & PROT_WRITE == 0
        };
        let mut blocks = std::collections::BTreeSet::new();
        for (&start, v) in self.vmas.iter().filter(|(_, v)| fits(v)) {
            let mut b = start & !(HUGE_PAGE - 1);
            while b < v.end {
                blocks.insert(b);
                b += HUGE_PAGE;
            }
        }
        let mut n = 0;
        for b in blocks {
            if self.covered_by(b, b + HUGE_PAGE, fits) && sp.aspace.promote(sp.mem, sp.frames, b)? {
                n += 1;
            }
        }
        Ok(n)
    }

    /// Cut the VMA containing `at` in two, so that a VMA starts at `at`.
    fn split(&mut self, at: u64) {
        let Some((start, v)) = self.vma_at(at) else { return };
        if start == at {
            return;
        }
        let mut tail = v.clone();
        if tail.file.is_some() {
            tail.offset += at - start;
        }
        if let Some(w) = tail.window.as_mut() {
            *w += at - start;
        }
        if let Some(head) = self.vmas.get_mut(&start) {
            head.end = at;
        }
        self.vmas.insert(at, tail);
    }

    /// Merge neighbouring VMAs with the same attributes around [start, end], so that repeated
    /// mprotect/brk/mmap calls do not fragment the list (and mremap sees one area, as on Linux).
    fn merge_around(&mut self, start: u64, end: u64) {
        let from = self.vmas.range(..start).next_back().map(|(s, _)| *s).unwrap_or(start);
        let keys: Vec<u64> = self.vmas.range(from..=end).map(|(s, _)| *s).collect();
        let mut cur: Option<u64> = None;
        for k in keys {
            if let Some(c) = cur {
                let mergeable = match (self.vmas.get(&c), self.vmas.get(&k)) {
                    (Some(a), Some(b)) => {
                        a.end == k
                            && a.prot == b.prot
                            && a.shared == b.shared
                            && a.name == b.name
                            && a.file == b.file
                            && a.lazy == b.lazy
                            && (a.file.is_none() || a.offset + (a.end - c) == b.offset)
                            && a.window.map(|w| w + (a.end - c)) == b.window
                            && a.pristine == b.pristine
                    }
                    _ => false,
                };
                if mergeable {
                    if let Some(b) = self.vmas.remove(&k) {
                        if let Some(a) = self.vmas.get_mut(&c) {
                            a.end = b.end;
                        }
                    }
                    continue;
                }
            }
            cur = Some(k);
        }
    }

    /// Back every page of [start, end) that has no frame with a fresh zeroed one, mapped with `prot`.
    /// On failure the pages mapped by this call are taken back.
    pub fn populate(sp: &mut Space, start: u64, end: u64, prot: u32) -> Result<(), Errno> {
        Self::populate_flags(sp, start, end, pte_flags(prot))
    }

    /// [`Mm::populate`] for new anonymous memory (mmap, brk). A writable mapping of up to
    /// [`ANON_PREFILL_MAX`] also gets its host pages now (`MADV_POPULATE_WRITE`, zero pages) and
    /// its entries marked accessed and dirty ([`PTE_FILLED`] too: the host's doing, not a run's).
    ///
    /// Why: a fresh frame's host page is not present until first touched, and KVM's fault handler
    /// maps a faulting entry's neighbours (its aligned group of 8) only where the host page is
    /// present and writable and the entry accessed, so anonymous memory faulted in one page at a
    /// time: `import torch` as a fresh sandbox's first exec took 34,974 shadow faults, 12,291 with
    /// this; `python3 -c pass` 611 -> 339. Small mappings are the ones programs fill (allocator
    /// arenas, the heap's growth); a large one may be a reservation that is never touched, and is
    /// left to fault in. Host memory: at most what the guest was given anyway (its frames).
    /// `COLLIMATE_ANON_PREFILL=0` turns it off, to compare.
    fn populate_anon(sp: &mut Space, start: u64, end: u64, prot: u32) -> Result<(), Errno> {
        static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let on = *ON.get_or_init(|| std::env::var_os("COLLIMATE_ANON_PREFILL").is_none_or(|v| v != "0"));
        if !on || end - start > ANON_PREFILL_MAX || prot & PROT_WRITE == 0 {
            return Self::populate(sp, start, end, prot);
        }
        let mut frames = Vec::new();
        Self::populate_into(sp, start, end, pte_flags(prot) | PTE_A | PTE_D | PTE_FILLED, Some(&mut frames))?;
        sp.mem.populate_frames_for_write(frames);
        Ok(())
    }

    /// [`Mm::populate`] with the leaf flags given.
    fn populate_flags(sp: &mut Space, start: u64, end: u64, flags: u64) -> Result<(), Errno> {
        Self::populate_into(sp, start, end, flags, None)
    }

    /// [`Mm::populate_flags`], adding the frames it maps to `frames`.
    fn populate_into(sp: &mut Space, start: u64, end: u64, flags: u64, mut frames: Option<&mut Vec<u64>>) -> Result<(), Errno> {
        let present: std::collections::HashSet<u64> =
            sp.aspace.present_pages(sp.mem, start, end).map_err(errno_of)?.into_iter().map(|(va, _)| va).collect();
        // Fail at once, not after taking every free frame, when the request cannot fit.
        let needed = (end.saturating_sub(start) / PAGE_SIZE).saturating_sub(present.len() as u64);
        if needed > sp.frames.available() {
            return Err(ENOMEM);
        }
        let mut done = Vec::new();
        let mut va = start;
        let mut res = Ok(());
        while va < end {
            if !present.contains(&va) {
                let step = sp.frames.alloc_zeroed(sp.mem).and_then(|pa| {
                    sp.aspace.map_page(sp.mem, sp.frames, va, pa, flags).map(|_| pa).inspect_err(|_| sp.frames.release(pa))
                });
                match step {
                    Err(e) => {
                        res = Err(errno_of(e));
                        break;
                    }
                    Ok(pa) => {
                        if let Some(f) = frames.as_deref_mut() {
                            f.push(pa);
                        }
                    }
                }
                done.push(va);
            }
            va += PAGE_SIZE;
        }
        if res.is_err() {
            for va in done {
                if let Ok(Some(pa)) = sp.aspace.unmap_page(sp.mem, va) {
                    sp.frames.release(pa);
                }
            }
        }
        res
    }

    /// Remove every page mapping in [start, end) and free the frames.
    fn unmap_pages(sp: &mut Space, start: u64, end: u64) -> Result<(), Errno> {
        sp.aspace.before_unmap(sp.mem, start, end).map_err(errno_of)?;
        for (va, _) in sp.aspace.present_pages(sp.mem, start, end).map_err(errno_of)? {
            if let Some(pa) = sp.aspace.unmap_page(sp.mem, va).map_err(errno_of)? {
                sp.frames.release(pa);
                sp.stale.push(pa);
            }
        }
        Ok(())
    }

    /// Remove the VMAs and pages of [start, end) (page aligned).
    pub fn unmap_range(&mut self, sp: &mut Space, start: u64, end: u64) -> Result<(), Errno> {
        if start >= end {
            return Ok(());
        }
        for k in self.split_range(start, end) {
            if self.vmas.remove(&k).is_some_and(|v| v.window.is_some()) {
                self.windows_unmapped = true;
            }
        }
        Self::unmap_pages(sp, start, end)
    }

    /// Record a VMA over [start, end) (which must be free) without touching the page tables.
    pub fn insert(&mut self, start: u64, vma: Vma) {
        let end = vma.end;
        self.vmas.insert(start, vma);
        self.merge_around(start, end);
    }

    /// A free range of `len` bytes, as high as possible below `top`.
    fn find_free(&self, len: u64, top: u64) -> Option<u64> {
        let mut hi = top;
        for (&start, v) in self.vmas.range(..top).rev() {
            if v.end <= hi && hi - v.end >= len {
                return Some(hi - len);
            }
            hi = hi.min(start);
        }
        (hi >= MMAP_MIN_ADDR + len).then(|| hi - len)
    }

    fn placement(&self, hint: u64, len: u64) -> Result<u64, Errno> {
        if hint != 0 {
            if let Some(h) = page_up(hint) {
                if h >= MMAP_MIN_ADDR && h.checked_add(len).is_some_and(|e| e <= TASK_SIZE) && !self.overlaps(h, h + len) {
                    return Ok(h);
                }
            }
        }
        self.find_free(len, self.mmap_top).ok_or(ENOMEM)
    }

    /// Split the VMAs at `start` and `end`; the starts of the VMAs inside [start, end).
    fn split_range(&mut self, start: u64, end: u64) -> Vec<u64> {
        self.split(start);
        self.split(end);
        self.vmas.range(start..end).map(|(s, _)| *s).collect()
    }

    /// mmap(2)'s checks and placement, before any platform work: the mapping's start, its length
    /// rounded up to pages, and whether it is shared. A placement that would touch `reserved` (the
    /// platform's own range, [`Reserved::NONE`] on kvm) is made again as without a hint; a fixed
    /// address in it is ENOMEM.
    fn mmap_place(&self, addr: u64, len: u64, prot: u32, flags: u32, reserved: Reserved) -> Result<(u64, u64, bool), Errno> {
        if len == 0 {
            return Err(EINVAL);
        }
        let len = page_up(len).filter(|&l| l <= MAX_MAP).ok_or(ENOMEM)?;
        if prot & !(PROT_READ | PROT_WRITE | PROT_EXEC) != 0 {
            return Err(EINVAL);
        }
        let kind = flags & MAP_SHARED_VALIDATE;
        if kind == 0 {
            return Err(EINVAL);
        }
        let start = if flags & (MAP_FIXED | MAP_FIXED_NOREPLACE) != 0 {
            if addr % PAGE_SIZE != 0 {
                return Err(EINVAL);
            }
            let end = addr.checked_add(len).filter(|&e| e <= TASK_SIZE).ok_or(ENOMEM)?;
            if addr < MMAP_MIN_ADDR {
                return Err(EPERM_MMAP);
            }
            if flags & MAP_FIXED == 0 && self.overlaps(addr, end) {
                return Err(EEXIST);
            }
            addr
        } else {
            match self.placement(addr, len)? {
                // A hint into the platform's own range: placed as without one.
                s if reserved.touches(s, s + len) => self.find_free(len, self.mmap_top).ok_or(ENOMEM)?,
                s => s,
            }
        };
        if reserved.touches(start, start + len) {
            return Err(ENOMEM);
        }
        Ok((start, len, kind != MAP_PRIVATE))
    }

    /// munmap(2)'s checks: the end of [addr, addr+len).
    fn munmap_end(addr: u64, len: u64) -> Result<u64, Errno> {
        if len == 0 {
            return Err(EINVAL);
        }
        user_range(addr, len).map_err(|_| EINVAL)
    }

    /// mprotect(2)'s checks: the end of the range and the protection to give it (without
    /// PROT_GROWSDOWN/PROT_GROWSUP); `None` for an empty range; ENOMEM where no VMA covers a byte.
    fn mprotect_range(&self, addr: u64, len: u64, prot: u32) -> Result<Option<(u64, u32)>, Errno> {
        let prot = prot & !(PROT_GROWSDOWN | PROT_GROWSUP);
        if prot & !(PROT_READ | PROT_WRITE | PROT_EXEC) != 0 {
            return Err(EINVAL);
        }
        let end = user_range(addr, len)?;
        if addr == end {
            return Ok(None);
        }
        if !self.covered(addr, end) {
            return Err(ENOMEM);
        }
        Ok(Some((end, prot)))
    }

    /// brk(2) on any platform: `resize` does the platform's part of moving the heap's top (and
    /// records a grown heap's VMA). Returns the new break, or the old one if it cannot move.
    fn move_brk(&mut self, new: u64, resize: impl FnOnce(&mut Mm, Heap) -> Result<(), Errno>) -> u64 {
        if new < self.brk_start || new > self.mmap_top {
            return self.brk;
        }
        let (Some(old_top), Some(new_top)) = (page_up(self.brk), page_up(new)) else { return self.brk };
        let moved = if new_top > old_top {
            !self.overlaps(old_top, new_top) && resize(self, Heap::Grow(old_top, new_top)).is_ok()
        } else {
            new_top == old_top || resize(self, Heap::Shrink(new_top, old_top)).is_ok()
        };
        if !moved {
            return self.brk;
        }
        self.brk = new;
        new
    }

    /// mremap(2)'s checks of the flags and the old range: its page-rounded old and new lengths,
    /// its end, and the VMA at `old` (start, and a copy to make the new mapping from).
    fn mremap_source(&self, old: u64, old_len: u64, new_len: u64, flags: u64) -> Result<(u64, u64, u64, u64, Vma), Errno> {
        if flags & !(MREMAP_MAYMOVE | MREMAP_FIXED) != 0 || (flags & MREMAP_FIXED != 0 && flags & MREMAP_MAYMOVE == 0) {
            return Err(EINVAL);
        }
        if old % PAGE_SIZE != 0 {
            return Err(EINVAL);
        }
        let old_len = page_up(old_len).ok_or(EINVAL)?;
        let new_len = page_up(new_len).filter(|&l| l != 0 && l <= MAX_MAP).ok_or(EINVAL)?;
        if old_len == 0 {
            // Duplicating a shared mapping: not offered.
            return Err(EINVAL);
        }
        let old_end = old.checked_add(old_len).filter(|&e| e <= TASK_SIZE).ok_or(EFAULT)?;
        let (vstart, v) = self.vma_at(old).ok_or(EFAULT)?;
        if v.end < old_end {
            return Err(EFAULT);
        }
        Ok((old_len, new_len, old_end, vstart, v.clone()))
    }

    /// MREMAP_FIXED's destination: the end of [new_addr, new_addr+new_len); EINVAL if it is not
    /// page aligned, not in user space, overlaps the old range [old, old_end) or touches `reserved`.
    fn mremap_target(new_addr: u64, new_len: u64, old: u64, old_end: u64, reserved: Reserved) -> Result<u64, Errno> {
        if new_addr % PAGE_SIZE != 0 {
            return Err(EINVAL);
        }
        let new_end = new_addr.checked_add(new_len).filter(|&e| e <= TASK_SIZE).ok_or(EINVAL)?;
        if (new_addr < old_end && old < new_end) || new_addr < MMAP_MIN_ADDR || reserved.touches(new_addr, new_end) {
            return Err(EINVAL);
        }
        Ok(new_end)
    }

    /// Where mremap grows an anonymous mapping [old, old_end) in place to `new_len` bytes: the new
    /// end, if the room after it is free and outside the platform's `reserved` range (a file
    /// mapping never grows in place). Otherwise the mapping moves, as Linux's would.
    fn grow_in_place(&self, old: u64, old_end: u64, new_len: u64, tmpl: &Vma, reserved: Reserved) -> Option<u64> {
        let grow_end = old.checked_add(new_len).filter(|&e| e <= TASK_SIZE)?;
        (!self.overlaps(old_end, grow_end) && !reserved.touches(old_end, grow_end) && tmpl.file.is_none()).then_some(grow_end)
    }

    /// Where mremap moves a mapping it cannot grow in place: ENOMEM without MREMAP_MAYMOVE, and for
    /// a file mapping (growing one would need more file data, which a VMA does not keep a way to).
    fn move_dest(&self, flags: u64, new_len: u64, tmpl: &Vma) -> Result<u64, Errno> {
        if flags & MREMAP_MAYMOVE == 0 || tmpl.file.is_some() {
            return Err(ENOMEM);
        }
        self.find_free(new_len, self.mmap_top).ok_or(ENOMEM)
    }

    /// madvise(2)'s checks: the end of the range, `None` for an empty one.
    fn madvise_range(addr: u64, len: u64, advice: u64) -> Result<Option<u64>, Errno> {
        if advice > MADV_MAX && !(100..=101).contains(&advice) {
            // 100/101 are MADV_HWPOISON/MADV_SOFT_OFFLINE (privileged; nothing to do).
            return Err(EINVAL);
        }
        let end = user_range(addr, len).map_err(|_| EINVAL)?;
        Ok((addr != end).then_some(end))
    }

    /// The parts of [addr, end) in VMAs for which `which` holds, with their protections.
    fn parts(&self, addr: u64, end: u64, which: impl Fn(&Vma) -> bool) -> Vec<(u64, u64, u32)> {
        self.vmas
            .range(..end)
            .filter(|(s, v)| v.end > addr && **s < end && which(v))
            .map(|(s, v)| ((*s).max(addr), v.end.min(end), v.prot))
            .collect()
    }

    /// mincore(2)'s checks: the end of the range and how many pages it has.
    fn mincore_pages(&self, addr: u64, len: u64) -> Result<(u64, usize), Errno> {
        let end = user_range(addr, len)?;
        if !self.covered(addr, end) {
            return Err(ENOMEM);
        }
        let pages = (end - addr) / PAGE_SIZE;
        if pages > 1 << 24 {
            return Err(ENOMEM);
        }
        Ok((end, pages as usize))
    }

    /// mmap(2). `file` is `None` for anonymous memory.
    pub fn mmap(&mut self, sp: &mut Space, addr: u64, len: u64, prot: u32, flags: u32, file: Option<MapFile>) -> Result<u64, Errno> {
        let (start, len, shared) = self.mmap_place(addr, len, prot, flags, Reserved::NONE)?;
        if shared {
            return self.mmap_shared(sp, start, len, prot, flags, file);
        }
        let end = start + len;
        let mut vma = Vma { end, prot, shared, name: String::new(), file: None, offset: 0, lazy: None, window: None, pristine: false };
        // Everything that can fail for a bad file comes before the old mapping is dropped.
        let data = match &file {
            Some(f) => {
                let size = vma.of_file(f, len, u64::MAX)?;
                if len > LAZY_MAP_MIN {
                    vma.lazy = Some(MapFd(Arc::new(dup_cloexec(f.fd)?)));
                }
                Some(size)
            }
            None => None,
        };
        if flags & MAP_FIXED != 0 {
            self.unmap_range(sp, start, end)?;
        }
        if vma.lazy.is_some() {
            // No frames yet: each page is read in when the guest first touches it (see `fault`).
            self.maybe_lazy = true;
            self.insert(start, vma);
            return Ok(start);
        }
        if data.is_some() {
            Self::populate_flags(sp, start, end, pte_flags(prot) | filled_flags(prot))?;
        } else if prot != PROT_NONE {
            Self::populate_anon(sp, start, end, prot)?;
        }
        if let (Some(f), Some(size)) = (&file, data) {
            if let Err(e) = copy_file(sp, f, start, len, size) {
                let _ = Self::unmap_pages(sp, start, end);
                return Err(e);
            }
        }
        self.insert(start, vma);
        Ok(start)
    }

    /// A shared mapping at `start` (placed, and checked): a window of the file (or of a new memfd
    /// for anonymous memory) that every process mapping it sees at once (see the module comment).
    /// Up to [`LAZY_MAP_MIN`] its pages are pointed at the window now (page tables only; the first
    /// touch of each page is then a fault inside KVM, not in the VMM); longer ones as the guest
    /// touches them, like lazy file mappings.
    fn mmap_shared(&mut self, sp: &mut Space, start: u64, len: u64, prot: u32, flags: u32, file: Option<MapFile>) -> Result<u64, Errno> {
        let end = start + len;
        let mut vma = Vma { end, prot, shared: true, name: String::new(), file: None, offset: 0, lazy: None, window: None, pristine: false };
        let (fd, offset, writable, is_file) = match &file {
            Some(f) => {
                vma.of_file(f, len, i64::MAX as u64)?;
                (Arc::new(dup_cloexec(f.fd)?), f.offset, file_writable(f.fd), true)
            }
            // A file size limit below the length answers EFBIG here: no memory for it.
            None => (Arc::new(crate::vstate::shared::memfd(len).map_err(|_| ENOMEM)?), 0, true, false),
        };
        // Past the cap of windows per process, or of guest-physical room: ENOMEM, as Linux
        // answers past vm.max_map_count.
        let gpa = sp.mem.windows.map(fd.clone(), offset, len, writable, is_file).map_err(|_| ENOMEM)?;
        vma.lazy = Some(MapFd(fd));
        vma.window = Some(gpa);
        let drop_window = |sp: &mut Space| sp.mem.windows.retain(|w| w.gpa != gpa);
        if flags & MAP_FIXED != 0 {
            if let Err(e) = self.unmap_range(sp, start, end) {
                drop_window(sp);
                return Err(e);
            }
        }
        self.maybe_lazy = true;
        if len <= LAZY_MAP_MIN {
            let shown = LazyArea::of(start, &vma).map(|a| a.file_end()).transpose()?.unwrap_or(start);
            if map_window_pages(sp, start, shown, gpa, prot, &Default::default()) != Fault::Resolved {
                drop_window(sp);
                return Err(ENOMEM);
            }
        }
        self.insert(start, vma);
        Ok(start)
    }

    /// Unmap the windows that no VMA maps any more (after munmap, mremap, a MAP_FIXED mapping over
    /// them, execve): their KVM slots go before the guest runs again (`KvmVm::sync_windows`).
    pub fn drop_unused_windows(&mut self, mem: &mut GuestMemory) {
        if !std::mem::take(&mut self.windows_unmapped) {
            return;
        }
        let used: Vec<(u64, u64)> = self.vmas.iter().filter_map(|(s, v)| v.window.map(|w| (w, w + (v.end - s)))).collect();
        mem.windows.retain(|w| used.iter().any(|&(a, b)| a < w.gpa + w.len && w.gpa < b));
    }

    /// How many shared mappings (windows) the process has.
    pub fn shared_count(mem: &GuestMemory) -> usize {
        mem.windows.len()
    }

    /// In a new sandbox forked from this one (`fork_group`, a clone of a live sandbox; not a guest
    /// fork): no window may stay shared with the parent sandbox. A window of a file that
    /// `persist::privatize` gave this sandbox its own copy of maps that copy now, at the same host
    /// address; any other writable window (shared anonymous memory, a file unlinked since) maps a
    /// new memfd holding a copy of what it showed. Other read-only windows (of the root
    /// filesystem, which nobody writes) stay.
    pub fn privatize_windows(&mut self, mem: &mut GuestMemory) -> std::io::Result<()> {
        let windows: Vec<(u64, u64, Arc<OwnedFd>, bool)> = mem.windows.iter().map(|w| (w.gpa, w.len, w.fd.clone(), w.writable)).collect();
        for (gpa, len, old, writable) in windows {
            let in_window = |v: &Vma| v.window.is_some_and(|w| w >= gpa && w < gpa + len);
            let now = self.vmas.values().filter(|v| in_window(v)).find_map(|v| v.lazy.as_ref().map(|l| l.0.clone()));
            let new = match now {
                Some(fd) if !Arc::ptr_eq(&fd, &old) => mem.windows.replace(gpa, Some(fd))?,
                // Not a file of the writable mounts (the root filesystem, which nobody writes, or
                // a file unlinked since): a read-only window stays.
                _ if !writable => continue,
                _ => mem.windows.replace(gpa, None)?,
            };
            for v in self.vmas.values_mut().filter(|v| in_window(v)) {
                v.lazy = Some(MapFd(new.clone()));
            }
        }
        Ok(())
    }

    /// Before a snapshot: every read-only shared mapping (of a file opened read-only) becomes a
    /// private lazy mapping of its file, holding copies of the pages it showed, as every file
    /// mapping was before windows existed; the snapshot then holds its pages like any lazy
    /// mapping's ([`Mm::read_in_lazy`]). Nothing can write through it, so this process sees no
    /// difference until somebody else writes the file. Returns how many writable shared mappings
    /// are left (a snapshot refuses those: see the module comment).
    pub fn unshare_read_only(&mut self, sp: &mut Space) -> Result<usize, Errno> {
        let read_only: Vec<u64> = self
            .vmas
            .iter()
            .filter(|(_, v)| v.window.is_some_and(|w| sp.mem.windows.find(w).is_some_and(|w| !w.writable)))
            .map(|(s, _)| *s)
            .collect();
        for start in read_only {
            let Some(v) = self.vmas.get(&start) else { continue };
            let end = v.end;
            for (va, pte) in sp.aspace.present_pages(sp.mem, start, end).map_err(errno_of)? {
                let mut page = [0u8; PAGE_SIZE as usize];
                // A page past the end of the file (it shrank) shows zeros in the copy.
                let _ = sp.mem.read(pte & ADDR_MASK, &mut page);
                let pa = sp.frames.alloc_with(sp.mem, &page).map_err(errno_of)?;
                sp.aspace.map_page(sp.mem, sp.frames, va, pa, pte & (PTE_U | PTE_W | PTE_NX)).map_err(errno_of)?;
            }
            if let Some(v) = self.vmas.get_mut(&start) {
                v.window = None;
            }
            self.windows_unmapped = true;
        }
        self.drop_unused_windows(sp.mem);
        Ok(sp.mem.windows.len())
    }

    /// munmap(2).
    pub fn munmap(&mut self, sp: &mut Space, addr: u64, len: u64) -> Result<u64, Errno> {
        let end = Self::munmap_end(addr, len)?;
        self.unmap_range(sp, addr, end)?;
        Ok(0)
    }

    /// mprotect(2).
    pub fn mprotect(&mut self, sp: &mut Space, addr: u64, len: u64, prot: u32) -> Result<u64, Errno> {
        let Some((end, prot)) = self.mprotect_range(addr, len, prot)? else { return Ok(0) };
        // A shared mapping of a file opened read-only never becomes writable (EACCES, as on Linux).
        if prot & PROT_WRITE != 0 {
            let from = self.vmas.range(..addr).next_back().map(|(s, _)| *s).unwrap_or(addr);
            let read_only = self.vmas.range(from..end).any(|(s, v)| {
                v.end > addr && *s < end && v.window.is_some_and(|w| !sp.mem.windows.find(w).is_some_and(|w| w.writable))
            });
            if read_only {
                return Err(EACCES);
            }
        }
        let flags = pte_flags(prot);
        for k in self.split_range(addr, end) {
            let Some(v) = self.vmas.get_mut(&k) else { continue };
            v.prot = prot;
            let (vend, lazy) = (v.end, v.lazy.is_some());
            for (va, pte) in sp.aspace.present_pages(sp.mem, k, vend).map_err(errno_of)? {
                if restricts(pte, flags) {
                    sp.stale.push(pte & ADDR_MASK);
                }
                sp.aspace.set_flags(sp.mem, va, flags).map_err(errno_of)?;
            }
            if prot != PROT_NONE && !lazy {
                // Pages of a reservation that never had contents get their frames now (a lazy
                // mapping's come from its file when touched, with the protection of that time).
                Self::populate(sp, k, vend, prot)?;
            }
        }
        self.merge_around(addr, end);
        Ok(0)
    }

    /// brk(2): returns the new break, or the old one if it cannot move.
    pub fn brk(&mut self, sp: &mut Space, new: u64) -> u64 {
        self.move_brk(new, |mm, heap| match heap {
            Heap::Grow(old_top, new_top) => {
                Self::populate_anon(sp, old_top, new_top, PROT_READ | PROT_WRITE)?;
                mm.insert(old_top, Vma::anon(new_top, PROT_READ | PROT_WRITE, "[heap]"));
                Ok(())
            }
            Heap::Shrink(new_top, old_top) => mm.unmap_range(sp, new_top, old_top),
        })
    }

    /// mremap(2).
    pub fn mremap(&mut self, sp: &mut Space, old: u64, old_len: u64, new_len: u64, flags: u64, new_addr: u64) -> Result<u64, Errno> {
        let (old_len, new_len, old_end, vstart, mut tmpl) = self.mremap_source(old, old_len, new_len, flags)?;
        if tmpl.file.is_some() {
            tmpl.offset += old - vstart;
        }
        if let Some(w) = tmpl.window.as_mut() {
            *w += old - vstart;
            // Growing a shared mapping would need a larger window: not offered (moving and
            // shrinking are).
            if new_len > old_len {
                return Err(ENOMEM);
            }
        }
        if flags & MREMAP_FIXED != 0 {
            let new_end = Self::mremap_target(new_addr, new_len, old, old_end, Reserved::NONE)?;
            self.unmap_range(sp, new_addr, new_end)?;
            return self.move_range(sp, old, old_len, new_addr, new_len, tmpl);
        }
        if new_len <= old_len {
            self.unmap_range(sp, old + new_len, old_end)?;
            return Ok(old);
        }
        if let Some(grow_end) = self.grow_in_place(old, old_end, new_len, &tmpl, Reserved::NONE) {
            if tmpl.prot != PROT_NONE {
                Self::populate(sp, old_end, grow_end, tmpl.prot)?;
            }
            let mut ext = tmpl.clone();
            ext.end = grow_end;
            self.insert(old_end, ext);
            return Ok(old);
        }
        let dest = self.move_dest(flags, new_len, &tmpl)?;
        self.move_range(sp, old, old_len, dest, new_len, tmpl)
    }

    /// Move the pages of [old, old+old_len) to `dest` (a free range of `new_len` bytes) by remapping
    /// their frames, drop what does not fit, and back any extra room like the original VMA.
    fn move_range(&mut self, sp: &mut Space, old: u64, old_len: u64, dest: u64, new_len: u64, mut tmpl: Vma) -> Result<u64, Errno> {
        if tmpl.file.is_some() && new_len > old_len {
            return Err(ENOMEM);
        }
        let keep = old_len.min(new_len);
        // Make sure the page tables at the destination can be built before anything moves.
        if sp.frames.available() < 4 + keep / (512 * PAGE_SIZE) {
            return Err(ENOMEM);
        }
        let moved = sp.aspace.present_pages(sp.mem, old, old + keep).map_err(errno_of)?;
        for (va, pte) in moved {
            let Some(pa) = sp.aspace.unmap_page(sp.mem, va).map_err(errno_of)? else { continue };
            sp.stale.push(pa);
            let flags = pte & (PTE_U | PTE_W | PTE_NX);
            if let Err(e) = sp.aspace.map_page(sp.mem, sp.frames, dest + (va - old), pa, flags) {
                sp.frames.release(pa);
                return Err(errno_of(e));
            }
        }
        self.unmap_range(sp, old, old + old_len)?;
        tmpl.end = dest + new_len;
        if new_len > old_len && tmpl.prot != PROT_NONE {
            Self::populate(sp, dest + old_len, dest + new_len, tmpl.prot)?;
        }
        self.insert(dest, tmpl);
        Ok(dest)
    }

    /// madvise(2).
    pub fn madvise(&mut self, sp: &mut Space, addr: u64, len: u64, advice: u64) -> Result<u64, Errno> {
        let Some(end) = Self::madvise_range(addr, len, advice)? else { return Ok(0) };
        if advice == MADV_DONTNEED || advice == MADV_DONTNEED_LOCKED {
            if !self.covered(addr, end) {
                return Err(ENOMEM);
            }
            for (s, e, _) in self.parts(addr, end, |v| v.file.is_none() && v.window.is_none()) {
                for (_, pte) in sp.aspace.present_pages(sp.mem, s, e).map_err(errno_of)? {
                    zero_page(sp.mem, pte & ADDR_MASK).map_err(errno_of)?;
                }
            }
            // Lazy file mappings drop their pages: the next access reads the file again, as on
            // Linux (a shared one's pages are the file's: they are mapped again as they are).
            for (s, e, _) in self.parts(addr, end, |v| v.lazy.is_some()) {
                Self::unmap_pages(sp, s, e)?;
            }
        }
        Ok(0)
    }

    /// msync(2): checks only. A shared mapping's pages are its file's pages (see the module
    /// comment), so there is nothing to write back.
    pub fn msync(&self, addr: u64, len: u64, flags: u64) -> Result<u64, Errno> {
        const MS_ASYNC: u64 = 1;
        const MS_INVALIDATE: u64 = 2;
        const MS_SYNC: u64 = 4;
        if flags & !(MS_ASYNC | MS_INVALIDATE | MS_SYNC) != 0 || flags & (MS_ASYNC | MS_SYNC) == MS_ASYNC | MS_SYNC {
            return Err(EINVAL);
        }
        let end = user_range(addr, len)?;
        if !self.covered(addr, end) {
            return Err(ENOMEM);
        }
        Ok(0)
    }

    /// mincore(2): which pages of [addr, addr+len) are resident (those that have a frame).
    fn mincore(&self, sp: &Space, addr: u64, len: u64) -> Result<Vec<u8>, Errno> {
        let (end, pages) = self.mincore_pages(addr, len)?;
        let mut v = vec![0u8; pages];
        for (va, _) in sp.aspace.present_pages(sp.mem, addr, end).map_err(errno_of)? {
            v[((va - addr) / PAGE_SIZE) as usize] = 1;
        }
        Ok(v)
    }

    /// The lazy mappings, for host-side accesses to guest memory on the guest's behalf (see `Ctx`).
    pub fn lazy_areas(&self) -> Vec<LazyArea> {
        if !self.maybe_lazy {
            return Vec::new();
        }
        self.vmas.iter().filter_map(|(s, v)| LazyArea::of(*s, v)).collect()
    }

    /// A guest page fault at `addr` for `access`: if it lies in a lazy mapping that allows the
    /// access, read in the page and its neighbours (the [`FAULT_AROUND`] block); see [`Fault`] for
    /// the other outcomes.
    pub fn fault(&self, sp: &mut Space, addr: u64, access: Access) -> Fault {
        let Some(area) = self.vma_at(addr).and_then(|(s, v)| LazyArea::of(s, v)) else { return Fault::NotLazy };
        if !access.allowed(area.prot) {
            return Fault::Denied;
        }
        match sp.aspace.translate(sp.mem, addr) {
            Ok((pa, pte)) if access.allowed_by_pte(pte) => Fault::Stale(page_down(pa)),
            // Present and refused: the page tables say no, whatever the VMA says.
            Ok(_) => Fault::Denied,
            Err(_) => area.read_in(sp, addr),
        }
    }

    /// Read in every page of the lazy mappings that shows its file, so that a snapshot, which keeps
    /// pages but no descriptor to read more with, holds them all. The mappings stay lazy in this
    /// process (pages dropped by MADV_DONTNEED, or a file that grows, still read in). Fails, before
    /// taking any frame, when the pages do not fit in the free frames.
    pub fn read_in_lazy(&self, sp: &mut Space) -> crate::error::Result<()> {
        let areas: Vec<(LazyArea, &str)> =
            self.vmas.iter().filter_map(|(s, v)| LazyArea::of(*s, v).map(|a| (a, v.name.as_str()))).collect();
        let unreadable = |name: &str, e: Errno| Error::Sys {
            op: "read in a lazily mapped file for a snapshot",
            source: std::io::Error::other(format!("{name}: {}", std::io::Error::from_raw_os_error(e.0))),
        };
        let mut missing = 0;
        for (a, name) in &areas {
            let end = a.file_end().map_err(|e| unreadable(name, e))?;
            let present = sp.aspace.present_pages(sp.mem, a.start, end)?.len() as u64;
            missing += (end - a.start) / PAGE_SIZE - present;
        }
        // Page-table pages: one per 2 MiB of mapping, and the upper levels of each mapping.
        let tables = missing / 512 + 3 * areas.len() as u64;
        if missing + tables > sp.frames.available() {
            return Err(Error::OutOfGuestMemory(format!(
                "a snapshot holds every page of the lazily mapped files ({}), {} MiB more than the {} MiB free; unmap them before the snapshot",
                areas.iter().map(|(_, n)| *n).collect::<Vec<_>>().join(", "),
                ((missing + tables) * PAGE_SIZE) >> 20,
                (sp.frames.available() * PAGE_SIZE) >> 20,
            )));
        }
        for (a, name) in &areas {
            let end = a.file_end().map_err(|e| unreadable(name, e))?;
            let mut va = a.start;
            while va < end {
                match a.read_in(sp, va) {
                    Fault::Resolved => {}
                    Fault::OutOfMemory => return Err(Error::OutOfGuestMemory(format!("reading in {name} for a snapshot"))),
                    _ => return Err(unreadable(name, super::EIO)),
                }
                va = (va & !(FAULT_AROUND - 1)) + FAULT_AROUND;
            }
        }
        Ok(())
    }

    /// The text of /proc/self/maps.
    pub fn maps(&self) -> String {
        let mut out = String::new();
        for (start, v) in &self.vmas {
            let (dev, ino) = v.file.map(|f| (f.dev, f.ino)).unwrap_or((0, 0));
            let line = format!(
                "{:08x}-{:08x} {}{}{}{} {:08x} {:02x}:{:02x} {}",
                start,
                v.end,
                if v.prot & PROT_READ != 0 { 'r' } else { '-' },
                if v.prot & PROT_WRITE != 0 { 'w' } else { '-' },
                if v.prot & PROT_EXEC != 0 { 'x' } else { '-' },
                if v.shared { 's' } else { 'p' },
                if v.file.is_some() { v.offset } else { 0 },
                libc::major(dev),
                libc::minor(dev),
                ino,
            );
            if v.name.is_empty() {
                out.push_str(&line);
                out.push_str(" \n");
            } else {
                out.push_str(&format!("{line:<72} {}\n", v.name));
            }
        }
        out
    }
}

/// EPERM for a fixed mapping below mmap_min_addr (what Linux answers).
const EPERM_MMAP: Errno = super::EPERM;

/// A descriptor of our own for the file behind `fd` (close-on-exec).
fn dup_cloexec(fd: RawFd) -> Result<OwnedFd, Errno> {
    // SAFETY: F_DUPFD_CLOEXEC of a descriptor we were given; the result is checked.
    let dup = unsafe { libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0) };
    if dup < 0 {
        return Err(Errno::last());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(dup) })
}

/// The size of the file behind `fd`.
fn file_size(fd: RawFd) -> Result<u64, Errno> {
    // SAFETY: a zeroed stat is valid; fstat on a descriptor number, the result is checked.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(Errno::last());
    }
    Ok(st.st_size as u64)
}

/// Whether `fd` is open for reading and writing (a shared mapping of it may write back).
fn file_writable(fd: RawFd) -> bool {
    // SAFETY: F_GETFL on a descriptor number.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    fl >= 0 && fl & libc::O_ACCMODE == libc::O_RDWR
}

/// Check that host descriptor `fd` can be mapped with `prot`: a regular file opened for reading (and
/// for writing if a shared mapping is writable). Returns its identity and size.
fn check_file(fd: RawFd, prot: u32, shared: bool) -> Result<(FileId, u64), Errno> {
    // SAFETY: fstat on a descriptor number into a zeroed stat buffer; the result is checked.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd, &mut st) } != 0 {
        return Err(EBADF);
    }
    if st.st_mode & libc::S_IFMT != libc::S_IFREG {
        return Err(ENODEV);
    }
    // SAFETY: F_GETFL on a descriptor number; the result is checked.
    let fl = unsafe { libc::fcntl(fd, libc::F_GETFL) };
    if fl < 0 {
        return Err(EBADF);
    }
    if fl & libc::O_PATH != 0 {
        return Err(EBADF);
    }
    let acc = fl & libc::O_ACCMODE;
    if acc == libc::O_WRONLY || (shared && prot & PROT_WRITE != 0 && acc != libc::O_RDWR) {
        return Err(EACCES);
    }
    Ok((FileId { dev: st.st_dev, ino: st.st_ino }, st.st_size as u64))
}

/// Copy the file bytes a new mapping shows into its (already zeroed) pages. Bytes past the end of
/// the file read as zero.
fn copy_file(sp: &mut Space, f: &MapFile, start: u64, len: u64, size: u64) -> Result<(), Errno> {
    let avail = size.saturating_sub(f.offset).min(len);
    let mut buf = vec![0u8; (1 << 20).min(avail as usize)];
    let mut done = 0u64;
    while done < avail {
        let want = ((avail - done) as usize).min(buf.len());
        let n = pread_full(f.fd, &mut buf[..want], f.offset + done)?;
        if n == 0 {
            break; // the file shrank since fstat
        }
        sp.aspace.write_virt(sp.mem, start + done, &buf[..n], false).map_err(errno_of)?;
        done += n as u64;
    }
    Ok(())
}

/// pread until `buf` is full or the file ends.
pub fn pread_full(fd: RawFd, buf: &mut [u8], off: u64) -> Result<usize, Errno> {
    let mut got = 0;
    while got < buf.len() {
        // SAFETY: pread into the unfilled tail of `buf`; the result is checked.
        let n = unsafe {
            libc::pread(fd, buf[got..].as_mut_ptr().cast(), buf.len() - got, (off + got as u64) as libc::off_t)
        };
        if n < 0 {
            let e = Errno::last();
            if e == super::EINTR {
                continue;
            }
            return Err(e);
        }
        if n == 0 {
            break;
        }
        got += n as usize;
    }
    Ok(got)
}

/// What mmap(2)'s arguments `a` map: `None` for anonymous memory (MAP_ANONYMOUS, /dev/zero),
/// else the guest descriptor's host descriptor, the offset and the name /proc/self/maps shows.
fn map_source(os: &GuestOs, a: &[u64; 6]) -> Result<Option<MapFile>, Errno> {
    let (flags, fd, offset) = (a[3] as u32, a[4] as i32, a[5]);
    if flags & MAP_ANONYMOUS != 0 {
        return Ok(None);
    }
    let file = os.files.file(fd)?;
    if matches!(file.kind, Kind::Zero) {
        return Ok(None);
    }
    let host = os.files.host_fd(fd)?;
    Ok(Some(MapFile { fd: host, offset, name: os.files.guest_path(fd).unwrap_or_default() }))
}

pub const SYS_MMAP: u64 = 9;
pub const SYS_MPROTECT: u64 = 10;
pub const SYS_MUNMAP: u64 = 11;
pub const SYS_BRK: u64 = 12;
pub const SYS_MREMAP: u64 = 25;
pub const SYS_MSYNC: u64 = 26;
pub const SYS_MINCORE: u64 = 27;
pub const SYS_MADVISE: u64 = 28;
pub const SYS_MLOCK: u64 = 149;
pub const SYS_MUNLOCK: u64 = 150;
pub const SYS_MLOCKALL: u64 = 151;
pub const SYS_MUNLOCKALL: u64 = 152;
pub const SYS_MLOCK2: u64 = 325;

/// Handle a memory-management syscall; `None` if `nr` is not one of ours.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let k = match &mut ctx.memory {
        crate::platform::Memory::Kvm(k) => k,
        crate::platform::Memory::Host(h) => return host::dispatch(os, &mut **h, nr, a),
    };
    let mut sp = Space::new(&mut *k.mem, &mut *k.frames, k.aspace);
    let r = match nr {
        SYS_MMAP => map_source(os, &a).and_then(|file| os.mm.mmap(&mut sp, a[0], a[1], a[2] as u32, a[3] as u32, file)),
        SYS_MUNMAP => os.mm.munmap(&mut sp, a[0], a[1]),
        SYS_MPROTECT => os.mm.mprotect(&mut sp, a[0], a[1], a[2] as u32),
        SYS_BRK => Ok(os.mm.brk(&mut sp, a[0])),
        SYS_MREMAP => os.mm.mremap(&mut sp, a[0], a[1], a[2], a[3], a[4]),
        SYS_MADVISE => os.mm.madvise(&mut sp, a[0], a[1], a[2]),
        SYS_MSYNC => os.mm.msync(a[0], a[1], a[2]),
        SYS_MINCORE => match os.mm.mincore(&sp, a[0], a[1]) {
            Ok(v) => return Some(ctx.write(a[2], &v).map(|_| 0)),
            Err(e) => Err(e),
        },
        // Nothing is ever paged out.
        SYS_MLOCK | SYS_MUNLOCK | SYS_MLOCKALL | SYS_MUNLOCKALL | SYS_MLOCK2 => Ok(0),
        _ => return None,
    };
    let stale = sp.stale;
    os.mm.drop_unused_windows(sp.mem);
    ctx.stale_frames.extend(stale);
    // Later accesses of this syscall to guest memory see the mappings as they are now.
    ctx.lazy = os.mm.lazy_areas();
    Some(r)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::paging::setup_address_space;

    struct T {
        mem: GuestMemory,
        frames: FrameAllocator,
        aspace: AddressSpace,
        mm: Mm,
    }

    impl T {
        fn new() -> T {
            let mut mem = GuestMemory::anonymous(64 << 20).unwrap();
            let mut frames = FrameAllocator::new(64 << 20);
            let aspace = setup_address_space(&mut mem, &mut frames).unwrap();
            let mm = Mm { brk_start: 0x60_0000, brk: 0x60_0000, ..Default::default() };
            T { mem, frames, aspace, mm }
        }
        /// Run `f` with the Mm and a Space; returns its result and whether it left stale frames.
        fn op<R>(&mut self, f: impl FnOnce(&mut Mm, &mut Space) -> R) -> (R, bool) {
            let mut sp = Space::new(&mut self.mem, &mut self.frames, &self.aspace);
            let r = f(&mut self.mm, &mut sp);
            (r, !sp.stale.is_empty())
        }
        fn flags(&self, va: u64) -> Option<u64> {
            self.aspace.translate(&self.mem, va).ok().map(|(_, f)| f)
        }
        fn write(&mut self, va: u64, data: &[u8]) {
            self.aspace.write_virt(&mut self.mem, va, data, true).unwrap();
        }
        fn read(&self, va: u64, n: usize) -> Vec<u8> {
            let mut b = vec![0u8; n];
            self.aspace.read_virt(&self.mem, va, &mut b, true).unwrap();
            b
        }
    }

    const RW: u32 = PROT_READ | PROT_WRITE;
    const ANON: u32 = MAP_PRIVATE | MAP_ANONYMOUS;

    #[test]
    fn anonymous_mmap_is_placed_top_down_and_zeroed() {
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 10_000, RW, ANON, None).unwrap());
        assert_eq!(a, MMAP_TOP - 3 * PAGE_SIZE);
        let (b, _) = t.op(|mm, sp| mm.mmap(sp, 0, 4096, PROT_READ, ANON, None).unwrap());
        assert_eq!(b, a - PAGE_SIZE);
        assert_eq!(t.read(a, 16), vec![0; 16]);
        let f = t.flags(a).unwrap();
        assert!(f & PTE_U != 0 && f & PTE_W != 0 && f & PTE_NX != 0);
        let f = t.flags(b).unwrap();
        assert!(f & PTE_W == 0 && f & PTE_NX != 0);
        assert_eq!(t.mm.vmas.len(), 2);
        // Bad arguments.
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, 0, RW, ANON, None)).0, Err(EINVAL));
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, 4096, RW, MAP_ANONYMOUS, None)).0, Err(EINVAL));
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0x1001, 4096, RW, ANON | MAP_FIXED, None)).0, Err(EINVAL));
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, 1 << 50, RW, ANON, None)).0, Err(ENOMEM));
    }

    #[test]
    fn reused_frames_are_zeroed() {
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 8192, RW, ANON, None).unwrap());
        t.write(a, &[0xaa; 8192]);
        let (r, flush) = t.op(|mm, sp| mm.munmap(sp, a, 8192));
        assert_eq!(r, Ok(0));
        assert!(flush);
        assert!(t.flags(a).is_none());
        assert_eq!(t.frames.free.len(), 2);
        let (b, _) = t.op(|mm, sp| mm.mmap(sp, 0, 8192, RW, ANON, None).unwrap());
        assert_eq!(t.frames.free.len(), 0);
        assert_eq!(t.read(b, 8192), vec![0; 8192]);
    }

    #[test]
    fn fixed_noreplace_and_hints() {
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0x1000_0000, 8192, RW, ANON, None).unwrap());
        assert_eq!(a, 0x1000_0000, "a free hint is honoured");
        let (b, _) = t.op(|mm, sp| mm.mmap(sp, 0x1000_0000, 4096, RW, ANON, None).unwrap());
        assert_ne!(b, a, "a taken hint is not");
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, a + 4096, 4096, RW, ANON | MAP_FIXED_NOREPLACE, None)).0, Err(EEXIST));
        t.write(a, b"old");
        let (c, flush) = t.op(|mm, sp| mm.mmap(sp, a, 4096, PROT_READ, ANON | MAP_FIXED, None).unwrap());
        assert_eq!(c, a);
        assert!(flush, "replacing a page needs a TLB flush");
        assert_eq!(t.read(a, 3), vec![0; 3]);
        // The old VMA was split: [a, a+4K) read-only, [a+4K, a+8K) read-write.
        assert_eq!(t.mm.vma_at(a).unwrap().1.prot, PROT_READ);
        assert_eq!(t.mm.vma_at(a + 4096).unwrap().1.prot, RW);
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0x1000, 4096, RW, ANON | MAP_FIXED, None)).0, Err(EPERM_MMAP));
    }

    #[test]
    fn prot_none_reservations_cost_no_frames() {
        let mut t = T::new();
        let before = t.frames.available();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 1 << 30, PROT_NONE, ANON | 0x4000, None).unwrap());
        assert!(before - t.frames.available() < 8, "a 1 GiB reservation took frames");
        assert!(t.flags(a).is_none());
        // Make 64 KiB of it usable, like glibc's malloc growing a heap.
        let (r, _) = t.op(|mm, sp| mm.mprotect(sp, a, 65536, RW));
        assert_eq!(r, Ok(0));
        t.write(a + 100, b"x");
        assert_eq!(t.mm.vmas.len(), 2);
        assert!(t.flags(a + 65536).is_none());
        // Taking the access away keeps the page (and its contents) but not for ring 3.
        let (r, flush) = t.op(|mm, sp| mm.mprotect(sp, a, 4096, PROT_NONE));
        assert_eq!(r, Ok(0));
        assert!(flush);
        assert_eq!(t.flags(a).unwrap() & PTE_U, 0);
        let (_, flush) = t.op(|mm, sp| mm.mprotect(sp, a, 4096, PROT_READ).unwrap());
        assert!(!flush, "granting access needs no flush");
        assert_eq!(t.read(a + 100, 1), b"x");
        let (r, _) = t.op(|mm, sp| mm.munmap(sp, a, 1 << 30));
        assert_eq!(r, Ok(0));
        assert!(t.mm.vmas.is_empty());
        assert!(before - t.frames.available() < 8, "frames were not given back");
    }

    #[test]
    fn mprotect_needs_a_mapping_and_merges_back() {
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 5 * 4096, RW, ANON, None).unwrap());
        assert_eq!(t.op(|mm, sp| mm.mprotect(sp, a + 1, 4096, PROT_READ)).0, Err(EINVAL));
        assert_eq!(t.op(|mm, sp| mm.mprotect(sp, a, 6 * 4096, PROT_READ)).0, Err(ENOMEM));
        t.op(|mm, sp| mm.mprotect(sp, a + 4096, 4096, PROT_READ).unwrap());
        assert_eq!(t.mm.vmas.len(), 3);
        assert_eq!(t.flags(a + 4096).unwrap() & PTE_W, 0);
        t.op(|mm, sp| mm.mprotect(sp, a + 4096, 4096, RW).unwrap());
        assert_eq!(t.mm.vmas.len(), 1, "equal neighbours merge again");
        t.op(|mm, sp| mm.mprotect(sp, a, 4096, PROT_READ | PROT_EXEC).unwrap());
        assert_eq!(t.flags(a).unwrap() & (PTE_NX | PTE_W), 0);
    }

    #[test]
    fn brk_grows_and_shrinks() {
        let mut t = T::new();
        assert_eq!(t.op(|mm, sp| mm.brk(sp, 0)).0, 0x60_0000);
        assert_eq!(t.op(|mm, sp| mm.brk(sp, 0x60_0100)).0, 0x60_0100);
        t.write(0x60_00ff, b"z");
        assert_eq!(t.op(|mm, sp| mm.brk(sp, 0x62_1000)).0, 0x62_1000);
        t.write(0x62_0fff, b"z");
        assert_eq!(t.mm.vmas.len(), 1);
        assert_eq!(t.mm.vma_at(0x60_0000).unwrap().1.name, "[heap]");
        let (r, flush) = t.op(|mm, sp| mm.brk(sp, 0x60_1000));
        assert_eq!(r, 0x60_1000);
        assert!(flush);
        assert!(t.flags(0x60_1000).is_none());
        assert!(t.flags(0x60_0000).is_some());
        // Below the start, or into another mapping: the break stays.
        assert_eq!(t.op(|mm, sp| mm.brk(sp, 0x10_0000)).0, 0x60_1000);
        t.op(|mm, sp| mm.mmap(sp, 0x70_0000, 4096, RW, ANON | MAP_FIXED, None).unwrap());
        assert_eq!(t.op(|mm, sp| mm.brk(sp, 0x80_0000)).0, 0x60_1000);
    }

    #[test]
    fn mremap_grows_in_place_or_moves_frames() {
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0x2000_0000, 8192, RW, ANON, None).unwrap());
        t.write(a, b"hello");
        let (pa, _) = t.aspace.translate(&t.mem, a).unwrap();
        // Room above: grows in place.
        assert_eq!(t.op(|mm, sp| mm.mremap(sp, a, 8192, 16384, 0, 0)).0, Ok(a));
        assert!(t.flags(a + 12288).is_some());
        // Block the room above; without MAYMOVE it cannot grow.
        t.op(|mm, sp| mm.mmap(sp, a + 16384, 4096, PROT_READ, ANON | MAP_FIXED, None).unwrap());
        assert_eq!(t.op(|mm, sp| mm.mremap(sp, a, 16384, 32768, 0, 0)).0, Err(ENOMEM));
        let (b, flush) = t.op(|mm, sp| mm.mremap(sp, a, 16384, 32768, MREMAP_MAYMOVE, 0));
        let b = b.unwrap();
        assert_ne!(a, b);
        assert!(flush);
        assert_eq!(t.read(b, 5), b"hello");
        assert_eq!(t.aspace.translate(&t.mem, b).unwrap().0, pa, "the frame moved, not a copy");
        assert!(t.flags(a).is_none());
        assert!(t.flags(b + 32768 - 1).is_some());
        assert_eq!(t.mm.vma_at(b).unwrap().1.end, b + 32768);
        // Shrink.
        assert_eq!(t.op(|mm, sp| mm.mremap(sp, b, 32768, 4096, 0, 0)).0, Ok(b));
        assert!(t.flags(b + 4096).is_none());
        // Fixed destination.
        let (c, _) = t.op(|mm, sp| mm.mremap(sp, b, 4096, 4096, MREMAP_MAYMOVE | MREMAP_FIXED, 0x3000_0000));
        assert_eq!(c, Ok(0x3000_0000));
        assert_eq!(t.read(0x3000_0000, 5), b"hello");
        // Not a mapping.
        assert_eq!(t.op(|mm, sp| mm.mremap(sp, b, 4096, 8192, MREMAP_MAYMOVE, 0)).0, Err(EFAULT));
    }

    #[test]
    fn madvise_dontneed_zeroes_anonymous_memory() {
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 8192, RW, ANON, None).unwrap());
        t.write(a, &[7; 8192]);
        assert_eq!(t.op(|mm, sp| mm.madvise(sp, a, 4096, MADV_DONTNEED)).0, Ok(0));
        assert_eq!(t.read(a, 4096), vec![0; 4096]);
        assert_eq!(t.read(a + 4096, 4), vec![7; 4]);
        assert_eq!(t.op(|mm, sp| mm.madvise(sp, a, 4096, 999)).0, Err(EINVAL));
        assert_eq!(t.op(|mm, sp| mm.madvise(sp, a, 4096, 8)).0, Ok(0));
        assert_eq!(t.op(|mm, sp| mm.madvise(sp, a + 8192, 4096, MADV_DONTNEED)).0, Err(ENOMEM));
    }

    #[test]
    fn file_mappings_copy_the_file() {
        let dir = std::env::temp_dir().join(format!("mm-test-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("f");
        let mut content = vec![0u8; 3 * 4096 + 100];
        for (i, b) in content.iter_mut().enumerate() {
            *b = (i % 251) as u8;
        }
        std::fs::write(&p, &content).unwrap();
        let f = std::fs::File::open(&p).unwrap();
        let fd = std::os::fd::AsRawFd::as_raw_fd(&f);
        let mut t = T::new();
        let mf = MapFile { fd, offset: 4096, name: "/f".into() };
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 4 * 4096, PROT_READ, MAP_PRIVATE, Some(mf)).unwrap());
        assert_eq!(t.read(a, 2 * 4096 + 100), content[4096..]);
        assert_eq!(t.read(a + 2 * 4096 + 100, 10), vec![0; 10], "past the end of the file reads zero");
        // The pages the file filled are marked used (see `filled_flags`): accessed, not dirty in a
        // read-only mapping, and marked as the host's; a writable mapping's are dirty too.
        let f0 = t.flags(a).unwrap();
        assert_eq!(f0 & (PTE_A | PTE_D | PTE_FILLED | PTE_W), PTE_A | PTE_FILLED, "{f0:#x}");
        let mf = MapFile { fd, offset: 0, name: "/f".into() };
        let (w, _) = t.op(|mm, sp| mm.mmap(sp, 0, 4096, RW, MAP_PRIVATE, Some(mf)).unwrap());
        let fw = t.flags(w).unwrap();
        assert_eq!(fw & (PTE_A | PTE_D | PTE_FILLED | PTE_W), PTE_A | PTE_D | PTE_FILLED | PTE_W, "{fw:#x}");
        // Small writable anonymous memory is filled by the host as well (`populate_anon`); a larger
        // mapping, or a read-only one, is left to the guest's first use.
        let (anon, _) = t.op(|mm, sp| mm.mmap(sp, 0, 4096, RW, MAP_PRIVATE | MAP_ANONYMOUS, None).unwrap());
        assert_eq!(t.flags(anon).unwrap() & (PTE_A | PTE_D | PTE_FILLED), PTE_A | PTE_D | PTE_FILLED);
        let (big, _) = t.op(|mm, sp| mm.mmap(sp, 0, ANON_PREFILL_MAX + 4096, RW, MAP_PRIVATE | MAP_ANONYMOUS, None).unwrap());
        assert_eq!(t.flags(big).unwrap() & (PTE_A | PTE_D | PTE_FILLED), 0);
        let (ro, _) = t.op(|mm, sp| mm.mmap(sp, 0, 4096, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS, None).unwrap());
        assert_eq!(t.flags(ro).unwrap() & (PTE_A | PTE_D | PTE_FILLED), 0);
        assert_eq!(t.read(anon, 8), vec![0; 8], "filled with zeros");
        let v = t.mm.vma_at(a).unwrap().1.clone();
        assert_eq!((v.offset, v.name.as_str()), (4096, "/f"));
        assert!(t.mm.maps().contains(" 00001000 "));
        assert!(t.mm.maps().trim_end().ends_with("/f"));
        // Splitting a file VMA keeps the offsets right.
        t.op(|mm, sp| mm.mprotect(sp, a + 4096, 4096, PROT_NONE).unwrap());
        assert_eq!(t.mm.vma_at(a + 8192).unwrap().1.offset, 3 * 4096);
        // A write-only descriptor cannot be mapped; a shared writable mapping needs O_RDWR.
        let w = std::fs::OpenOptions::new().write(true).open(&p).unwrap();
        let wf = MapFile { fd: std::os::fd::AsRawFd::as_raw_fd(&w), offset: 0, name: String::new() };
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, 4096, PROT_READ, MAP_PRIVATE, Some(wf))).0, Err(EACCES));
        let rf = MapFile { fd, offset: 0, name: String::new() };
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, 4096, RW, MAP_SHARED, Some(rf))).0, Err(EACCES));
        let rf = MapFile { fd, offset: 1, name: String::new() };
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, 4096, PROT_READ, MAP_PRIVATE, Some(rf))).0, Err(EINVAL));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn out_of_memory_is_enomem_and_leaves_nothing_behind() {
        let mut t = T::new();
        let avail = t.frames.available();
        let too_big = (avail + 10) * PAGE_SIZE;
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, too_big, RW, ANON, None)).0, Err(ENOMEM));
        assert!(t.mm.vmas.is_empty());
        // Exactly as many pages as there are frames: the page tables do not fit, and the frames
        // taken before that are given back.
        let all = t.frames.available() * PAGE_SIZE;
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, all, RW, ANON, None)).0, Err(ENOMEM));
        assert!(t.mm.vmas.is_empty());
        // Everything but page-table pages came back.
        assert!(t.frames.available() + 64 >= avail);
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 4096, RW, ANON, None).unwrap());
        assert_eq!(t.read(a, 8), vec![0; 8]);
    }

    /// A sparse file of `len` bytes with `marks` written at their offsets, in a directory of its own.
    struct Sparse {
        dir: std::path::PathBuf,
        file: std::fs::File,
    }

    impl Sparse {
        fn new(len: u64, marks: &[(u64, &[u8])]) -> Sparse {
            use std::os::unix::fs::FileExt;
            static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
            let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
            let dir = std::env::temp_dir().join(format!("mm-lazy-{}-{n}", std::process::id()));
            std::fs::create_dir_all(&dir).unwrap();
            let file = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.join("f")).unwrap();
            file.set_len(len).unwrap();
            for (off, data) in marks {
                file.write_all_at(data, *off).unwrap();
            }
            Sparse { dir, file }
        }
        fn map(&self) -> MapFile {
            MapFile { fd: self.file.as_raw_fd(), offset: 0, name: "/big".into() }
        }
        fn bytes(&self, off: u64, n: usize) -> Vec<u8> {
            use std::os::unix::fs::FileExt;
            let mut b = vec![0u8; n];
            self.file.read_exact_at(&mut b, off).unwrap();
            b
        }
    }

    impl Drop for Sparse {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.dir);
        }
    }

    /// Longer than LAZY_MAP_MIN, and than the 64 MiB of guest memory `T` has.
    const BIG: u64 = 96 << 20;
    /// Where the tests map it (aligned to FAULT_AROUND, so blocks are easy to name).
    const AT: u64 = 0x1000_0000;

    impl T {
        fn present(&self, va: u64) -> bool {
            self.flags(va).is_some()
        }
        fn fault(&mut self, va: u64, access: Access) -> Fault {
            self.op(|mm, sp| mm.fault(sp, va, access)).0
        }
    }

    #[test]
    fn lazy_file_mappings_read_pages_in_when_touched() {
        let near_end = BIG - 4096 + 10;
        let f = Sparse::new(BIG + 100, &[(0, b"head"), (near_end, b"near the end"), (BIG + 90, b"tail")]);
        let mut t = T::new();
        let before = t.frames.available();
        // Two pages past the end of the file: the first shows its last 100 bytes, the second none.
        let len = BIG + 2 * PAGE_SIZE;
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, AT, len, PROT_READ, MAP_PRIVATE | MAP_FIXED, Some(f.map())).unwrap());
        assert_eq!(t.frames.available(), before, "a lazy mapping takes no frames");
        assert!(!t.present(a) && !t.present(a + BIG));
        assert!(t.mm.maps().trim_end().ends_with("/big"));
        // A touch reads in the aligned block around it, with the file's bytes.
        assert_eq!(t.fault(a + near_end, Access::Read), Fault::Resolved);
        let used = before - t.frames.available();
        assert!((16..=19).contains(&used), "16 pages and their page tables, not {used}");
        assert_eq!(t.read(a + near_end, 12), b"near the end");
        let (m, _) = t.op(|mm, sp| mm.mincore(sp, a + BIG - 2 * FAULT_AROUND, 2 * FAULT_AROUND + 2 * PAGE_SIZE));
        let m = m.unwrap();
        assert_eq!((&m[..16], &m[16..32], &m[32..]), (&[0; 16][..], &[1; 16][..], &[0, 0][..]));
        let f1 = t.flags(a + near_end).unwrap();
        assert!(f1 & PTE_U != 0 && f1 & PTE_W == 0 && f1 & PTE_NX != 0);
        assert_eq!(f1 & (PTE_A | PTE_D | PTE_FILLED), PTE_A | PTE_FILLED, "a block read in is marked used: {f1:#x}");
        // Touching it again is a stale translation, not a read.
        let pa = t.aspace.translate(&t.mem, a + near_end).unwrap().0 & ADDR_MASK;
        assert_eq!(t.fault(a + near_end, Access::Read), Fault::Stale(pa));
        // What the protection does not allow is SEGV_ACCERR, present or not.
        assert_eq!(t.fault(a + near_end, Access::Write), Fault::Denied);
        assert_eq!(t.fault(a + 8 * FAULT_AROUND, Access::Write), Fault::Denied);
        assert_eq!(t.fault(a + 8 * FAULT_AROUND, Access::Exec), Fault::Denied);
        assert!(!t.present(a + 8 * FAULT_AROUND));
        // The first page; the page the file ends in (zero past the end); the page past it: SIGBUS.
        assert_eq!(t.fault(a + 1, Access::Read), Fault::Resolved);
        assert_eq!(t.read(a, 4), b"head");
        assert_eq!(t.fault(a + BIG + 90, Access::Read), Fault::Resolved);
        assert_eq!(t.read(a + BIG + 90, 20), [&b"tail"[..], &[0; 16]].concat());
        assert_eq!(t.fault(a + BIG + PAGE_SIZE, Access::Read), Fault::Bus);
        assert!(!t.present(a + BIG + PAGE_SIZE));
        // Outside a lazy mapping, a fault is the guest's.
        assert_eq!(t.fault(0x5000_0000, Access::Read), Fault::NotLazy);
        // A file that grows shows more.
        f.file.set_len(BIG + 2 * PAGE_SIZE).unwrap();
        assert_eq!(t.fault(a + BIG + PAGE_SIZE, Access::Read), Fault::Resolved);
    }

    #[test]
    fn syscall_buffers_in_lazy_mappings() {
        let pattern: Vec<u8> = (0..3 * FAULT_AROUND).map(|i| (i % 251) as u8).collect();
        let base = BIG - 3 * FAULT_AROUND;
        let f = Sparse::new(BIG, &[(0, b"head"), (base, &pattern)]);
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, AT, BIG, RW, MAP_PRIVATE | MAP_FIXED, Some(f.map())).unwrap());
        let lazy = t.mm.lazy_areas();
        assert_eq!(lazy.len(), 1);
        // The middle block is read in and written to (privately).
        assert_eq!(t.fault(a + base + FAULT_AROUND, Access::Write), Fault::Resolved);
        t.write(a + base + FAULT_AROUND, b"mine");
        let before = t.frames.available();
        // A read across pages without frames and a present one: the file, then the memory, and
        // no frames taken.
        let mut buf = vec![0u8; (FAULT_AROUND + 8) as usize];
        read_user(&lazy, &t.mem, &t.aspace, a + base + 4, &mut buf).unwrap();
        let fa = FAULT_AROUND as usize;
        assert_eq!(buf, [&pattern[4..fa], b"mine", &pattern[fa + 4..fa + 12]].concat());
        assert_eq!(t.frames.available(), before);
        // A write to a page without a frame reads its block in first; the file stays as it was.
        let mut sp = Space::new(&mut t.mem, &mut t.frames, &t.aspace);
        write_user(&lazy, &mut sp, a + 2, b"AD").unwrap();
        assert!(sp.stale.is_empty());
        assert_eq!(t.read(a, 4), b"heAD");
        assert_eq!(t.read(a + 4096, 4), [0; 4]);
        assert!(t.present(a + FAULT_AROUND - PAGE_SIZE) && !t.present(a + FAULT_AROUND));
        assert_eq!(f.bytes(0, 4), b"head");
        // Past the end of the file, past the mapping, or without access: EFAULT.
        let mut b = [0u8; 8];
        assert_eq!(read_user(&lazy, &t.mem, &t.aspace, a + BIG - 4, &mut b), Err(EFAULT));
        t.op(|mm, sp| mm.mprotect(sp, a + 2 * FAULT_AROUND, FAULT_AROUND, PROT_NONE).unwrap());
        let lazy = t.mm.lazy_areas();
        assert_eq!(read_user(&lazy, &t.mem, &t.aspace, a + 2 * FAULT_AROUND, &mut b), Err(EFAULT));
        let mut sp = Space::new(&mut t.mem, &mut t.frames, &t.aspace);
        assert_eq!(write_user(&lazy, &mut sp, a + 2 * FAULT_AROUND, b"x"), Err(EFAULT));
        assert!(!t.present(a + 2 * FAULT_AROUND));
    }

    #[test]
    fn munmap_mprotect_mincore_on_partly_read_in_lazy_mappings() {
        let f = Sparse::new(BIG, &[(10 << 20, b"ten"), (30 << 20, b"thirty")]);
        let mut t = T::new();
        let before = t.frames.available();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, AT, BIG, RW, MAP_PRIVATE | MAP_FIXED, Some(f.map())).unwrap());
        assert_eq!(t.fault(a + (10 << 20), Access::Write), Fault::Resolved);
        assert!(t.flags(a + (10 << 20)).unwrap() & PTE_W != 0);
        let used = before - t.frames.available();
        // mprotect changes the pages that are there and reads nothing in.
        let (r, flush) = t.op(|mm, sp| mm.mprotect(sp, a, BIG, PROT_READ));
        assert_eq!(r, Ok(0));
        assert!(flush, "taking write access away from present pages needs a flush");
        assert_eq!(before - t.frames.available(), used);
        assert_eq!(t.flags(a + (10 << 20)).unwrap() & PTE_W, 0);
        assert_eq!(t.read(a + (10 << 20), 3), b"ten");
        // Later faults follow the new protection.
        assert_eq!(t.fault(a + (30 << 20), Access::Write), Fault::Denied);
        assert_eq!(t.fault(a + (30 << 20), Access::Read), Fault::Resolved);
        assert_eq!(t.flags(a + (30 << 20)).unwrap() & PTE_W, 0);
        t.op(|mm, sp| mm.mprotect(sp, a + (40 << 20), 1 << 20, RW).unwrap());
        assert_eq!(t.mm.vmas.len(), 3);
        assert_eq!(t.mm.vma_at(a + (40 << 20)).unwrap().1.offset, 40 << 20);
        assert_eq!(t.fault(a + (40 << 20), Access::Write), Fault::Resolved);
        assert!(t.flags(a + (40 << 20)).unwrap() & PTE_W != 0);
        let (m, _) = t.op(|mm, sp| mm.mincore(sp, a + (40 << 20) - PAGE_SIZE, 2 * PAGE_SIZE));
        assert_eq!(m, Ok(vec![0, 1]));
        // munmap gives back what is present; the part never touched has nothing to flush.
        let avail = t.frames.available();
        let (r, flush) = t.op(|mm, sp| mm.munmap(sp, a + (8 << 20), 16 << 20));
        assert_eq!(r, Ok(0));
        assert!(flush);
        assert_eq!(t.frames.available(), avail + 16);
        let (r, flush) = t.op(|mm, sp| mm.munmap(sp, a + (60 << 20), 1 << 20));
        assert_eq!(r, Ok(0));
        assert!(!flush);
        assert_eq!(t.fault(a + (10 << 20), Access::Read), Fault::NotLazy);
        assert_eq!(t.mm.vma_at(a + (24 << 20)).unwrap().1.offset, 24 << 20);
        t.op(|mm, sp| mm.munmap(sp, a, BIG).unwrap());
        assert!(t.mm.vmas.is_empty());
        assert!(before - t.frames.available() < 8, "only page tables stay");
    }

    #[test]
    fn madvise_and_mremap_of_lazy_mappings() {
        let f = Sparse::new(BIG, &[(0, b"head"), (BIG - 8, b"the end")]);
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, AT, BIG, RW, MAP_PRIVATE | MAP_FIXED, Some(f.map())).unwrap());
        assert_eq!(t.fault(a, Access::Write), Fault::Resolved);
        t.write(a, b"mine");
        // MADV_DONTNEED drops the private copy: the next touch sees the file again.
        let (r, flush) = t.op(|mm, sp| mm.madvise(sp, a, FAULT_AROUND, MADV_DONTNEED));
        assert_eq!(r, Ok(0));
        assert!(flush);
        assert!(!t.present(a));
        assert_eq!(t.fault(a, Access::Read), Fault::Resolved);
        assert_eq!(t.read(a, 4), b"head");
        t.write(a, b"mine");
        // mremap moves the present pages and the rest stays lazy, at the right file offsets.
        let pa = t.aspace.translate(&t.mem, a).unwrap().0;
        let dest = 0x2000_0000;
        let (r, _) = t.op(|mm, sp| mm.mremap(sp, a, BIG, BIG, MREMAP_MAYMOVE | MREMAP_FIXED, dest));
        assert_eq!(r, Ok(dest));
        assert_eq!(t.aspace.translate(&t.mem, dest).unwrap().0, pa);
        assert_eq!(t.read(dest, 4), b"mine");
        assert_eq!(t.fault(dest + BIG - 8, Access::Read), Fault::Resolved);
        assert_eq!(t.read(dest + BIG - 8, 7), b"the end");
        assert_eq!(t.fault(a, Access::Read), Fault::NotLazy);
        // Growing a file mapping is refused, as for every file mapping; shrinking is fine.
        assert_eq!(t.op(|mm, sp| mm.mremap(sp, dest, BIG, BIG + 4096, MREMAP_MAYMOVE, 0)).0, Err(ENOMEM));
        assert_eq!(t.op(|mm, sp| mm.mremap(sp, dest, BIG, BIG / 2, 0, 0)).0, Ok(dest));
        assert_eq!(t.fault(dest + BIG - 8, Access::Read), Fault::NotLazy);
    }

    #[test]
    fn out_of_frames_in_a_lazy_mapping() {
        let f = Sparse::new(BIG, &[]);
        let mut t = T::new();
        let before = t.frames.available();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, AT, BIG, PROT_READ, MAP_PRIVATE | MAP_FIXED, Some(f.map())).unwrap());
        // A snapshot would need every page: refused before any frame is taken.
        let (r, _) = t.op(|mm, sp| mm.read_in_lazy(sp));
        assert!(matches!(r, Err(Error::OutOfGuestMemory(_))), "{r:?}");
        assert_eq!(t.frames.available(), before);
        // Touch block after block until the frames run out.
        let mut va = a;
        let out = loop {
            assert!(va < a + BIG, "96 MiB of pages fit in 64 MiB of memory");
            match t.fault(va, Access::Read) {
                Fault::Resolved => va += FAULT_AROUND,
                other => break other,
            }
        };
        assert_eq!(out, Fault::OutOfMemory);
        assert!(t.frames.available() < 16 + 3);
        assert!(!t.present(va), "a block that did not fit leaves nothing behind");
        assert_eq!(t.read(va - 1, 1), [0]);
        t.op(|mm, sp| mm.munmap(sp, a, BIG).unwrap());
        assert!(before - t.frames.available() < 64, "only page tables stay");
        assert_eq!(t.fault(va, Access::Read), Fault::NotLazy);
    }

    #[test]
    fn a_snapshot_reads_in_what_the_file_shows() {
        let f = Sparse::new(1 << 20, &[(0, b"start"), ((1 << 20) - 3, b"end")]);
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, AT, BIG, PROT_READ, MAP_PRIVATE | MAP_FIXED, Some(f.map())).unwrap());
        assert!(t.mm.vma_at(a).unwrap().1.lazy.is_some(), "the length decides, not the file's size");
        assert_eq!(t.fault(a + 4096, Access::Read), Fault::Resolved);
        let before = t.frames.available();
        let (r, flush) = t.op(|mm, sp| mm.read_in_lazy(sp));
        r.unwrap();
        assert!(!flush);
        assert!(before - t.frames.available() >= 256 - 16);
        assert_eq!(t.read(a, 5), b"start");
        assert_eq!(t.read(a + (1 << 20) - 3, 3), b"end");
        assert!(!t.present(a + (1 << 20)));
        // Only the pages are saved, not the descriptor.
        let saved: Mm = postcard::from_bytes(&postcard::to_stdvec(&t.mm).unwrap()).unwrap();
        assert!(saved.vmas.values().all(|v| v.lazy.is_none()) && !saved.maybe_lazy);
    }

    const SHARED_ANON: u32 = MAP_SHARED | MAP_ANONYMOUS;

    #[test]
    fn shared_anonymous_memory_lives_in_a_window_and_survives_partial_unmaps_and_moves() {
        use crate::vstate::shared::WINDOW_BASE;
        let mut t = T::new();
        let before = t.frames.available();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 3 * PAGE_SIZE, RW, SHARED_ANON, None).unwrap());
        assert!(before - t.frames.available() <= 3, "page tables only, no frames");
        let pa = t.aspace.translate(&t.mem, a).unwrap().0;
        assert!(pa >= WINDOW_BASE);
        assert!(t.mm.maps().contains(" rw-s "));
        t.write(a + 5, b"hi");
        t.write(a + 2 * PAGE_SIZE, b"end");
        // What the guest wrote is in the window's host pages (which a forked child shares).
        let w = t.mem.windows.find(pa).unwrap();
        let mut b = [0u8; 3];
        std::os::unix::fs::FileExt::read_exact_at(&std::fs::File::from(w.fd.try_clone().unwrap()), &mut b, 2 * PAGE_SIZE).unwrap();
        assert_eq!(&b, b"end");
        // A partial unmap keeps the window; a move keeps pointing into it; growing is refused.
        let avail = t.frames.available();
        let (r, stale) = t.op(|mm, sp| mm.munmap(sp, a + PAGE_SIZE, PAGE_SIZE));
        assert_eq!(r, Ok(0));
        assert!(stale, "the unmapped page's translation must be dropped");
        t.mm.drop_unused_windows(&mut t.mem);
        assert_eq!(t.mem.windows.len(), 1);
        assert_eq!(t.frames.available(), avail, "a window's page is no frame: none goes back to the allocator");
        let dest = 0x2000_0000;
        let (r, _) = t.op(|mm, sp| mm.mremap(sp, a + 2 * PAGE_SIZE, PAGE_SIZE, PAGE_SIZE, MREMAP_MAYMOVE | MREMAP_FIXED, dest));
        assert_eq!(r, Ok(dest));
        assert_eq!(t.aspace.translate(&t.mem, dest).unwrap().0, pa + 2 * PAGE_SIZE);
        assert_eq!(t.read(dest, 3), b"end");
        assert_eq!(t.op(|mm, sp| mm.mremap(sp, dest, PAGE_SIZE, 2 * PAGE_SIZE, MREMAP_MAYMOVE, 0)).0, Err(ENOMEM));
        // MADV_DONTNEED leaves shared contents alone (they are the memfd's).
        assert_eq!(t.op(|mm, sp| mm.madvise(sp, a, PAGE_SIZE, MADV_DONTNEED)).0, Ok(0));
        assert_eq!(t.op(|mm, sp| mm.fault(sp, a, Access::Read)).0, Fault::Resolved);
        assert_eq!(t.read(a + 5, 2), b"hi");
        // Unmapping the rest drops the window.
        t.op(|mm, sp| mm.munmap(sp, a, PAGE_SIZE).unwrap());
        t.mm.drop_unused_windows(&mut t.mem);
        assert_eq!(t.mem.windows.len(), 1, "the moved page still maps it");
        t.op(|mm, sp| mm.munmap(sp, dest, PAGE_SIZE).unwrap());
        t.mm.drop_unused_windows(&mut t.mem);
        assert!(t.mem.windows.is_empty());
    }

    #[test]
    fn shared_file_mappings_are_the_file() {
        let f = Sparse::new(PAGE_SIZE + 10, &[(0, b"head")]);
        let mut t = T::new();
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 4 * PAGE_SIZE, RW, MAP_SHARED, Some(f.map())).unwrap());
        let (b, _) = t.op(|mm, sp| mm.mmap(sp, 0, 2 * PAGE_SIZE, RW, MAP_SHARED, Some(f.map())).unwrap());
        assert_eq!(t.read(a, 4), b"head");
        t.write(a + 1, b"EA");
        assert_eq!(f.bytes(0, 4), b"hEAd", "the file, at once (no msync)");
        assert_eq!(t.read(b, 4), b"hEAd", "another mapping of it too");
        use std::os::unix::fs::FileExt;
        f.file.write_all_at(b"pw", PAGE_SIZE).unwrap();
        assert_eq!(t.read(a + PAGE_SIZE, 2), b"pw");
        assert_eq!(t.mm.msync(a, PAGE_SIZE, 4), Ok(0));
        // Pages wholly past the end of the file: not mapped, and a touch is SIGBUS.
        assert!(t.flags(a + 2 * PAGE_SIZE).is_none());
        assert_eq!(t.op(|mm, sp| mm.fault(sp, a + 2 * PAGE_SIZE, Access::Read)).0, Fault::Bus);
        // The file grows: the page shows it.
        f.file.set_len(3 * PAGE_SIZE).unwrap();
        assert_eq!(t.op(|mm, sp| mm.fault(sp, a + 2 * PAGE_SIZE, Access::Write)).0, Fault::Resolved);
        // A descriptor opened read-only: a read-only shared view, never made writable.
        let ro = std::fs::File::open(f.dir.join("f")).unwrap();
        let map = |fd: &std::fs::File| MapFile { fd: fd.as_raw_fd(), offset: 0, name: "/ro".into() };
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, PAGE_SIZE, RW, MAP_SHARED, Some(map(&ro)))).0, Err(EACCES));
        let (c, _) = t.op(|mm, sp| mm.mmap(sp, 0, PAGE_SIZE, PROT_READ, MAP_SHARED, Some(map(&ro))).unwrap());
        assert_eq!(t.read(c, 4), b"hEAd");
        assert_eq!(t.op(|mm, sp| mm.mprotect(sp, c, PAGE_SIZE, RW)).0, Err(EACCES));
        assert_eq!(t.op(|mm, sp| mm.mprotect(sp, c, PAGE_SIZE, PROT_NONE)).0, Ok(0));
        assert_eq!(t.mem.windows.len(), 3);
        // A fork of the sandbox: the shared anonymous and unlinked ones get copies; read-only stay.
        let (d, _) = t.op(|mm, sp| mm.mmap(sp, 0, PAGE_SIZE, RW, SHARED_ANON, None).unwrap());
        t.write(d, b"anon");
        let old = t.mem.windows.find(t.aspace.translate(&t.mem, d).unwrap().0).unwrap().fd.clone();
        t.mm.privatize_windows(&mut t.mem).unwrap();
        assert_eq!(t.read(d, 4), b"anon");
        t.write(d, b"mine");
        let mut buf = [0u8; 4];
        std::fs::File::from(old.try_clone().unwrap()).read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(&buf, b"anon", "the parent's memfd is no longer written");
        t.write(a, b"H");
        assert_eq!(f.bytes(0, 1), b"h", "nor the parent's file (this test has no copy of it: a memfd)");
        assert_eq!(t.op(|mm, sp| mm.mprotect(sp, c, PAGE_SIZE, PROT_READ)).0, Ok(0));
        assert_eq!(t.read(c, 1), b"h", "a read-only window still shows the file");
    }

    #[test]
    fn a_snapshot_turns_read_only_shared_mappings_into_private_copies() {
        use std::os::unix::fs::FileExt;
        let f = Sparse::new(2 * PAGE_SIZE, &[(0, b"data")]);
        let ro = std::fs::File::open(f.dir.join("f")).unwrap();
        let mut t = T::new();
        let map = MapFile { fd: ro.as_raw_fd(), offset: 0, name: "/ro".into() };
        let (a, _) = t.op(|mm, sp| mm.mmap(sp, 0, 2 * PAGE_SIZE, PROT_READ, MAP_SHARED, Some(map)).unwrap());
        let (b, _) = t.op(|mm, sp| mm.mmap(sp, 0, PAGE_SIZE, RW, SHARED_ANON, None).unwrap());
        assert_eq!(t.mem.windows.len(), 2);
        let (left, _) = t.op(|mm, sp| mm.unshare_read_only(sp));
        assert_eq!(left, Ok(1), "the writable one is left (the snapshot refuses it)");
        assert!(t.aspace.translate(&t.mem, a).unwrap().0 < t.mem.size(), "a frame now");
        assert!(t.aspace.translate(&t.mem, b).unwrap().0 >= crate::vstate::shared::WINDOW_BASE);
        assert_eq!(t.read(a, 4), b"data");
        f.file.write_all_at(b"DATA", 0).unwrap();
        assert_eq!(t.read(a, 4), b"data", "a copy");
        assert!(!t.mm.vma_at(a).unwrap().1.shared || t.mm.vma_at(a).unwrap().1.window.is_none());
    }

    #[test]
    fn too_many_shared_mappings_answer_enomem() {
        use crate::vstate::shared::MAX_WINDOWS;
        let mut t = T::new();
        for _ in 0..MAX_WINDOWS {
            t.op(|mm, sp| mm.mmap(sp, 0, PAGE_SIZE, RW, SHARED_ANON, None).unwrap());
        }
        let before = t.frames.available();
        assert_eq!(t.op(|mm, sp| mm.mmap(sp, 0, PAGE_SIZE, RW, SHARED_ANON, None)).0, Err(ENOMEM));
        assert_eq!(t.frames.available(), before);
        assert_eq!(t.mm.vmas.len(), MAX_WINDOWS, "no VMA for the refused one");
        // Private memory is not limited by it.
        t.op(|mm, sp| mm.mmap(sp, 0, PAGE_SIZE, RW, ANON, None).unwrap());
    }

    #[test]
    fn maps_text() {
        let mut t = T::new();
        t.op(|mm, sp| mm.brk(sp, 0x60_2000));
        t.op(|mm, sp| mm.mmap(sp, 0x1000_0000, 4096, PROT_READ | PROT_EXEC, ANON | MAP_FIXED, None).unwrap());
        let m = t.mm.maps();
        let lines: Vec<&str> = m.lines().collect();
        assert_eq!(lines[0].split_whitespace().collect::<Vec<_>>(), ["00600000-00602000", "rw-p", "00000000", "00:00", "0", "[heap]"]);
        assert_eq!(lines[1].split_whitespace().collect::<Vec<_>>(), ["10000000-10001000", "r-xp", "00000000", "00:00", "0"]);
    }
}
