//! Making a running guest see the host's edits of its page tables.
//!
//! The host owns the guest page tables and edits them through its own mapping of guest memory
//! (mmap, munmap, mprotect, brk of the guest program). Whether the guest sees an edit depends on its
//! direction:
//!
//! * **Adding or widening a translation** (a non-present entry made present, a read-only entry made
//!   writable) needs nothing: the next guest access that the old translation did not allow exits to
//!   KVM, which walks the guest page tables again and finds the new entry.
//! * **Removing, narrowing or redirecting a translation** (munmap, mprotect to fewer rights, a PTE
//!   pointed at another frame) needs [`invalidate_frames`] on the frames the old entries pointed at,
//!   or [`flush_guest_tlb`], before the guest runs again. Without it the guest keeps using the old
//!   translation indefinitely.
//!
//! # Evidence (kvm_pvm, shadow paging; `examples/pt_coherence.rs`, `tests/tlb.rs`)
//!
//! Measured on a kvm_pvm host (Linux 6.18, `tdp_mmu=N`): the guest reads A, the host edits A's PTE,
//! applies a method, the guest touches A again.
//!
//! | method | remap A to another frame | clear A's PTE | clear A's write bit |
//! |---|---|---|---|
//! | none | stale | stale | stale |
//! | KVM_SET_SREGS, same CR3 | stale | stale | stale |
//! | KVM_SET_SREGS x2, CR4.PGE or CR4.TSD flipped and restored | stale | stale | stale |
//! | KVM_SET_SREGS x2, CR3 to a copy of the PML4 and back (or left on the copy) | stale | stale | stale |
//! | KVM_SET_USER_MEMORY_REGION x2, dirty logging off and on | stale | stale | seen |
//! | host `mprotect` R then RW of the **old frame's** host page ([`invalidate_frames`]) | seen | seen | seen |
//! | KVM_SET_USER_MEMORY_REGION x2, slot deleted and re-added ([`flush_guest_tlb`]) | seen | seen | seen |
//!
//! Why: KVM shadows each guest page-table page once and afterwards trusts its shadow, because it
//! expects every change to arrive as a guest write to a write-protected page; a write by the host
//! process bypasses that. A CR3 or CR4 change only drops the roots: KVM finds the same shadow pages
//! again by guest-physical address (traced: `kvm_mmu_get_page ... existing`). What does work is
//! dropping the shadow *leaf* entries: KVM's MMU notifier zaps every shadow PTE that maps a host
//! range whose protection changes, and the guest's next access to that address re-walks the guest
//! page tables. Deleting the memory slot zaps every shadow page (`kvm_mmu_zap_all_fast`).
//!
//! Costs measured there (release build; one exit round trip to the VMM is about 25 us; every page the
//! guest touches afterwards and whose shadow entry was dropped refaults inside the kernel, without an
//! exit to the VMM, for about 0.5 us, or 0.8 us when the shadow page tables are rebuilt too):
//! * [`invalidate_frames`]: about 23-31 us for one frame, 95 us for all 512 frames of one 2 MiB
//!   block (one mprotect pair each time), about 29 us per block for frames scattered over many
//!   blocks. This kernel zaps the whole 2 MiB-aligned block of host virtual memory around the
//!   protected range (traced with `kvm_mmu_set_spte`: exactly the 512 pages of that block refault),
//!   so up to 511 neighbouring pages refault too: at most about 250 us more per block. (Traced
//!   later with `kvm_unmap_hva_range`: the mprotect's own notifier covers only its range; the
//!   block-wide one comes from splitting the mapping's area at the range's edge. A block with few
//!   frames therefore takes the exact path instead, [`EXACT_MAX_PAGES`].)
//! * [`flush_guest_tlb`]: about 310 us with 4,096 pages in the shadow, 0.9-1.1 ms with 16,384, then
//!   the refault of every page the guest touches. Past about 30 blocks of frames to invalidate it
//!   costs the same as [`invalidate_frames`].
//! * For comparison, the vCPU-level methods that do not work cost 10 us (KVM_SET_SREGS, which the
//!   engine already does on every syscall return), 16 us (CR4 flip) and 22 us (CR3 switch).
//!
//! # Rules for callers
//! * Call [`invalidate_frames`] with every frame whose translation was removed, narrowed or
//!   redirected, after editing the page tables and before the next `KVM_RUN`, and before such a
//!   frame is handed out again: until then the guest can still read and write it through the old
//!   translation, even once it holds someone else's data or a page table.
//! * Intermediate entries (PML4, PDPT, PD) may only go from non-present to present, with permissive
//!   flags (the leaf decides). A page-table page may be unlinked and replaced if every frame it
//!   mapped is invalidated (tested: the guest sees the new table). KVM keeps the shadow of the old
//!   table linked under its parent; reusing a freed page-table page as anything else is untested,
//!   so do a [`flush_guest_tlb`] before handing one out again.
//!
//! # Hardware virtualization (VMX/SVM): what the profile decides (`vstate::profile`)
//! * **Shadow paging** (`ept=0`/`npt=0`, and kvm_pvm): the situation measured above; the
//!   invalidations here are the whole mechanism. `tests/tlb.rs` passes in the emulated kvm_amd lane
//!   with `npt=0` (`scripts/kvm-lane`).
//! * **EPT/NPT**: KVM does not shadow guest page tables; the guest's own TLB, tagged by VPID/ASID
//!   and kept across exits, holds the stale translations, `KVM_SET_SREGS` flushes only when
//!   CR0/CR3/CR4/EFER change, and no ioctl flushes it. The invalidations above still run (they drop
//!   KVM's EPT/NPT entries of the frames, whose flush also drops the guest's combined
//!   translations, but that is KVM's implementation, not a contract); what the architecture
//!   guarantees is the guest's own flush: every invalidation owes one ([`request_guest_flush`]),
//!   and the next entry goes through the ring-0 flush stub, which reloads CR3 (no PCID, no global
//!   pages: every translation goes) and `iretq`s to ring 3 without an exit. `invlpg` per page
//!   would keep the rest of the TLB, but the invalidations know frames, not the virtual
//!   addresses that mapped them. `tests/flush_contract.rs` checks on every host that the flush the
//!   profile requires ran (QEMU's TCG flushes its whole TLB at every VMRUN, so the emulated lane
//!   shows the stub works on upstream KVM, not that a missing flush would show).
//! * Widening a translation without a flush may fault spuriously on a real TLB (the entry
//!   cached in its stricter form); the VMM retries such a fault (`Machine::spurious_fault`)
//!   without counting it as the program's.

use std::sync::atomic::{AtomicBool, Ordering};

use super::memory::GuestMemory;
use super::profile::{self, FlushMethod};
use super::vm::KvmVm;
use crate::arch::x86_64::layout::PAGE_SIZE;
use crate::error::{Error, Result};

/// Frames within one such block of host virtual memory share one mprotect pair. On the measured
/// kernel the MMU-notifier invalidation covers the whole 2 MiB-aligned block anyway.
pub const INVALIDATION_BLOCK: u64 = 2 << 20;

/// Make the guest drop every translation that points at the guest-physical frames `gpas`, so that
/// its next access to any of them walks the (host-edited) guest page tables again.
///
/// Use after removing, narrowing or redirecting translations to these frames, before the guest runs
/// again. How: `mprotect(PROT_READ)` then `mprotect(PROT_READ | PROT_WRITE)` of the host pages backing
/// the frames, one pair per 2 MiB block of host virtual memory (spanning the first to the last
/// frame given in that block); KVM's MMU notifier zaps the shadow PTEs of that range. Guest memory
/// contents, and which host pages are present, are not changed. Call it between two `KVM_RUN`s,
/// from the thread that owns `mem` (no other thread may write guest memory meanwhile: for a moment
/// it is read-only). Returns how many mprotect pairs were made.
pub fn invalidate_frames(mem: &GuestMemory, gpas: &[u64]) -> Result<usize> {
    invalidate(mem, gpas, false)
}

/// [`invalidate_frames`] for the translations a guest's own syscall narrowed or removed (mprotect,
/// munmap, mremap, ...): a block with only a few such frames has exactly those dropped instead
/// ([`EXACT_MAX_PAGES`], [`GuestMemory::zap_in_place`]), keeping the translations of the rest of
/// its block. Their contents stay; a page that reads as the file's afterwards is the file's again
/// (not present on the host until touched), which is why a reset, which has just put pages back
/// to the file's contents and wants them present for the next run, uses [`invalidate_frames`].
pub fn invalidate_frames_exact(mem: &GuestMemory, gpas: &[u64]) -> Result<usize> {
    invalidate(mem, gpas, exact_enabled())
}

fn invalidate(mem: &GuestMemory, gpas: &[u64], exact: bool) -> Result<usize> {
    if skipped_for_a_negative_control() {
        return Ok(0);
    }
    if !gpas.is_empty() {
        request_guest_flush();
    }
    let base = mem.host_addr();
    // Host pages, with the protection to restore: guest memory's, or a shared window's (see
    // `vstate::shared`: the same MMU notifier drops the translations of its pages).
    // Each tagged with its mapping (0: guest memory; else the window's guest-physical start): one
    // mprotect pair never spans two mappings (there may be unmapped host memory between them).
    let mut pages: Vec<(u64, libc::c_int, u64)> = Vec::with_capacity(gpas.len());
    for &gpa in gpas {
        if gpa >= crate::vstate::shared::WINDOW_BASE {
            // A window that is gone was unmapped on the host, which dropped its translations.
            if let Some(w) = mem.windows.find(gpa) {
                pages.push(((w.host_addr() + (gpa - w.gpa)) & !(PAGE_SIZE - 1), w.prot(), w.gpa));
            }
            continue;
        }
        if gpa >= mem.size() {
            return Err(Error::BadGuestAddress(gpa));
        }
        pages.push(((base + gpa) & !(PAGE_SIZE - 1), libc::PROT_READ | libc::PROT_WRITE, 0));
    }
    pages.sort_unstable();
    pages.dedup();
    let mut pairs = 0;
    let mut i = 0;
    while i < pages.len() {
        let (block, prot, mapping) = (pages[i].0 / INVALIDATION_BLOCK, pages[i].1, pages[i].2);
        let mut j = i;
        while j + 1 < pages.len() && pages[j + 1].0 / INVALIDATION_BLOCK == block && pages[j + 1].2 == mapping {
            j += 1;
        }
        let (first, len) = (pages[i].0 - base, pages[j].0 + PAGE_SIZE - pages[i].0);
        if exact && mapping == 0 && j - i < EXACT_MAX_PAGES && mem.file_backed(first, len) {
            // Runs of consecutive pages, each dropped in place.
            let mut k = i;
            while k <= j {
                let mut l = k;
                while l < j && pages[l + 1].0 == pages[l].0 + PAGE_SIZE {
                    l += 1;
                }
                mem.zap_in_place(pages[k].0 - base, pages[l].0 + PAGE_SIZE - pages[k].0)?;
                k = l + 1;
            }
        } else {
            protect_cycle(pages[i].0, len, prot)?;
            pairs += 1;
        }
        i = j + 1;
    }
    Ok(pairs)
}

/// A block with at most this many frames to invalidate has them dropped exactly
/// ([`GuestMemory::zap_in_place`]) instead of by an mprotect pair.
///
/// Why: an mprotect of part of the mapping splits its area in two, and the kernel then splits any
/// huge-page entry at the new edge, whose MMU notifier covers the whole 2 MiB block whether or not
/// the entry was a huge page: KVM drops the translations of all 512 pages around the few that
/// changed, and the guest refaults every one of them it uses (25-30 us each on kvm_pvm). A
/// program's start narrows a few pages many times (the RELRO `mprotect` of itself and of each
/// library, `munmap`s): CPython's start made 24 such pairs, 48 MiB of translations dropped, and
/// busybox's RELRO step alone refaulted some 20 of its text pages. `MADV_DONTNEED` zaps exactly
/// its range and splits nothing; since guest memory is a private mapping, the pages' contents are
/// saved and put back around it, a copy or three per page: worth it for a few pages, not for
/// thousands.
const EXACT_MAX_PAGES: usize = 64;

/// Whether the exact path is taken (`COLLIMATE_EXACT_INVALIDATION=0`: mprotect pairs only, to
/// compare).
pub fn exact_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_EXACT_INVALIDATION").is_none_or(|v| v != "0"))
}

/// The negative control of the TLB contract, for tests only: with `COLLIMATE_TEST_NO_INVALIDATION=1`
/// [`invalidate_frames`], [`invalidate_frames_exact`] and [`flush_guest_tlb`] do nothing at all (no
/// host-side zap, no guest flush owed), so that `tests/tlb.rs`'s stale-translation cases can be
/// shown to fail without them where the host keeps stale translations (kvm_pvm; upstream KVM's
/// shadow MMU, the emulated lane's `npt=0` boot, `scripts/kvm-lane/job.sh`).
///
/// A hidden setting rather than a cargo feature or a cfg: the lane runs the very test binary it
/// runs for the real check (one build, no second engine build with a feature on), and a control
/// that ran a differently built engine would prove less. Same precedent as the I/O-completion
/// canary (`COLLIMATE_TEST_NO_IO_COMPLETION`). Nothing in the product sets it; a process that has
/// it says so on stderr once, since a guest could then read memory the host took away.
fn skipped_for_a_negative_control() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| {
        let off = std::env::var_os("COLLIMATE_TEST_NO_INVALIDATION").is_some_and(|v| v == "1");
        if off {
            eprintln!("collimate: COLLIMATE_TEST_NO_INVALIDATION=1: guest TLB invalidation is OFF (a negative control for tests, never for use)");
        }
        off
    })
}

/// Less access, then `prot` again: the first call fires the MMU notifier.
fn protect_cycle(addr: u64, len: u64, prot: libc::c_int) -> Result<()> {
    let p = addr as *mut libc::c_void;
    let less = if prot & libc::PROT_WRITE != 0 { libc::PROT_READ } else { libc::PROT_NONE };
    // SAFETY: [addr, addr+len) lies inside the guest-memory mapping or one shared window (checked
    // by the caller), whose protection is `prot`; the mapping's owner is the only thread that
    // writes it (the VMM process is single-threaded) and it is here, and the second call restores
    // the protection.
    if unsafe { libc::mprotect(p, len as usize, less) } != 0 {
        return Err(Error::last_os("mprotect(PROT_READ) for a guest TLB invalidation"));
    }
    // SAFETY: as above. Restoring can only fail for lack of memory to merge/split mappings; retry
    // once, since leaving guest memory read-only would crash the next host write.
    let restore = || unsafe { libc::mprotect(p, len as usize, prot) };
    if restore() != 0 && restore() != 0 {
        return Err(Error::last_os(
            "mprotect(PROT_READ|PROT_WRITE) after a guest TLB invalidation; guest memory is left read-only",
        ));
    }
    Ok(())
}

/// Make the guest drop every translation it has (every shadow page table of the VM).
///
/// The heavy hammer, for edits [`invalidate_frames`] cannot describe (an intermediate page-table
/// entry repointed, a page-table page freed). How: delete memory slot 0 and add it again, exactly
/// as it was. Deleting a slot discards KVM's dirty log, so the log is first folded into `mem`'s own
/// record of private pages (which snapshot and reset rely on).
pub fn flush_guest_tlb(vm: &mut KvmVm, mem: &mut GuestMemory) -> Result<()> {
    if skipped_for_a_negative_control() {
        return Ok(());
    }
    request_guest_flush();
    let log = vm.take_dirty_log()?;
    mem.sync_dirty(&log);
    let size = vm.slot_size();
    vm.replace_slot(size)
}

/// A guest-side flush is owed: set by every invalidation on a profile whose guest TLB survives
/// host edits ([`FlushMethod::HostZapAndGuestTlb`]), taken by the VMM before the next `KVM_RUN`
/// (`vmm::Machine::enter_guest_flush`). One per process: a VMM process runs one vCPU at a time.
static GUEST_FLUSH: AtomicBool = AtomicBool::new(false);

/// Owe the guest a flush of its own TLB before it runs again, if the host's profile needs one:
/// under EPT/NPT a host edit of a guest page table is invisible to KVM, and the guest's TLB,
/// tagged by VPID/ASID, keeps the old translation across exits. (KVM's flush after an EPT/NPT
/// zap, which the invalidations above cause, happens to drop it as well, but that is KVM's
/// implementation, not a contract.) The flush runs in the guest: the flush stub
/// (`arch::x86_64::tables::flush_stub`) reloads CR3, which invalidates every non-global
/// translation by the architecture, and `iretq`s to ring 3, without an exit. It reloads CR3
/// rather than `invlpg`s the pages because the invalidations here know guest-physical frames,
/// not the virtual addresses that mapped them.
pub fn request_guest_flush() {
    if profile::current().flush_method() == FlushMethod::HostZapAndGuestTlb {
        GUEST_FLUSH.store(true, Ordering::Relaxed);
    }
}

/// Take the owed flush (see [`request_guest_flush`]).
pub fn take_guest_flush() -> bool {
    GUEST_FLUSH.swap(false, Ordering::Relaxed)
}

/// Forget an owed flush: the vCPU is new (a fork's, an exec's) and has no translations.
pub fn forget_guest_flush() {
    GUEST_FLUSH.store(false, Ordering::Relaxed);
}
