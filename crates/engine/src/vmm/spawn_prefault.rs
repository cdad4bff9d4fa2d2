//! The pages a cached program's runs touch, made ready before its next spawns run: each of them
//! private and writable on the host, its guest page-table entry marked accessed (and dirty if
//! writable), so that KVM maps it and its touched neighbours at one shadow fault.
//!
//! # Why
//! A spawned program starts in a new VM over its cached image (`image_cache`), and on kvm_pvm each
//! first touch of a page is a shadow fault, a world switch of 25-30 us here. busybox `sh -c true`
//! took 147 of them (117 pages, a page read before it is written twice), 4.4 ms of its 7 ms in the
//! guest. KVM's fault handler also maps up to 7 neighbouring entries of the same guest page table
//! (its prefetch), but only entries whose accessed bit is set and whose host page is present and
//! writable (looked up without faulting, for write); the cached image is a private file mapping,
//! read-only on the host until a page is copied, and the loader writes no accessed bits, so it
//! never prefetched. A dirty bit left clear also makes KVM map a writable page read-only first
//! (to set the bit at the first write): a second fault per written page.
//!
//! # How
//! Each image cache entry has a small shared region (inherited by the forks of the process that
//! built it, so a template's sandboxes learn together). The first two processes that run the image
//! without a hint report, when their guest ends, the user pages whose accessed bit is set (KVM sets
//! it on every page it walks for a fault: the pages the run touched). Later spawns take the pages
//! both reported (a page only one run's own work touched is left alone), and before their VM
//! exists mark those entries accessed (and dirty where writable) and copy those pages
//! (`MADV_POPULATE_WRITE`, about 3.6 us a page here against the 25-30 us fault each may save). A
//! wrong guess costs a page copy, never correctness: the copy holds what the image held, and the
//! bits only say what a run would have made them say. `COLLIMATE_SPAWN_PREFAULT=0` turns it off
//! (set in the environment the engine starts with), to compare.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Arc;

use crate::arch::x86_64::layout::PAGE_SIZE;
use crate::arch::x86_64::paging::{AddressSpace, PTE_A, PTE_FILLED, PTE_U};
use crate::vstate::memory::GuestMemory;

/// Most pages one report holds; a run that touched more reports none (it is not a short command).
const MAX_PAGES: usize = 4096;
/// Reports taken before hints are given.
const REPORTS: usize = 2;
/// KVM's prefetch looks at the aligned group of 8 entries around a fault, and stops at the first it cannot map.
const GROUP: u64 = 8;

#[repr(C)]
struct Report {
    /// 0 while unwritten, then 1 + the number of pages.
    state: AtomicU32,
    /// Guest-virtual page addresses, ascending.
    pages: [u64; MAX_PAGES],
}

#[repr(C)]
struct Region {
    claims: AtomicU32,
    reports: [Report; REPORTS],
}

fn region_size() -> usize {
    std::mem::size_of::<Region>().next_multiple_of(PAGE_SIZE as usize)
}

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_SPAWN_PREFAULT").is_none_or(|v| v != "0"))
}

/// A region's mapping, unmapped when the last holder in this process lets go.
struct Mapping(NonNull<Region>);

impl Drop for Mapping {
    fn drop(&mut self) {
        // SAFETY: the mapping `Touched::new` made; no reference into it outlives its last holder.
        unsafe { libc::munmap(self.0.as_ptr().cast(), region_size()) };
    }
}

/// One cached image's region (see the module comment). Clones name the same region: the image
/// cache entry holds it, and so does a process loaded from the image until it has reported.
#[derive(Clone)]
pub(super) struct Touched(Arc<Mapping>);

// SAFETY: the region is shared only through its atomics, and written once per report slot by the
// process that claimed it; the VMM process is single-threaded.
unsafe impl Send for Mapping {}
// SAFETY: as above.
unsafe impl Sync for Mapping {}

impl Touched {
    /// A new, empty region; `None` if it cannot be made (then the image is spawned without).
    pub(super) fn new() -> Option<Touched> {
        if !enabled() {
            return None;
        }
        // SAFETY: a new shared anonymous mapping, zeroed: no claims, no reports.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), region_size(), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
        };
        if p == libc::MAP_FAILED {
            return None;
        }
        NonNull::new(p.cast::<Region>()).map(|r| Touched(Arc::new(Mapping(r))))
    }

    fn region(&self) -> &Region {
        // SAFETY: a live mapping of region_size() bytes made by `new`, unmapped only when the
        // last `Touched` holding it is dropped.
        unsafe { self.0 .0.as_ref() }
    }

    /// The pages every report named, once all reports are in.
    pub(super) fn hint(&self) -> Option<Vec<u64>> {
        let r = self.region();
        let mut lists = Vec::with_capacity(REPORTS);
        for rep in &r.reports {
            let n = rep.state.load(Ordering::Acquire);
            if n == 0 {
                return None;
            }
            lists.push(&rep.pages[..(n - 1) as usize]);
        }
        let mut out = lists[0].to_vec();
        for l in &lists[1..] {
            out.retain(|p| l.binary_search(p).is_ok());
        }
        Some(out)
    }

    /// Whether a report is still wanted from a run without a hint.
    pub(super) fn wants_report(&self) -> bool {
        (self.region().claims.load(Ordering::Relaxed) as usize) < REPORTS
    }

    /// Report the pages this process's guest touched: the user pages whose accessed bit is set
    /// (by KVM: not the file pages the host marked when it filled them, `PTE_FILLED`).
    pub(super) fn report(&self, mem: &GuestMemory, aspace: &AddressSpace) {
        let slot = self.region().claims.fetch_add(1, Ordering::AcqRel) as usize;
        crate::trace::mark_n("spawn_prefault.report", slot as u64);
        if slot >= REPORTS {
            return;
        }
        let pages: Vec<u64> = match aspace.present_pages(mem, 0, u64::MAX) {
            Ok(p) => p.into_iter().filter(|&(_, e)| e & (PTE_A | PTE_U | PTE_FILLED) == PTE_A | PTE_U).map(|(va, _)| va).collect(),
            Err(_) => Vec::new(),
        };
        let n = if pages.len() > MAX_PAGES { 0 } else { pages.len() };
        let rep = self.0 .0.as_ptr();
        // SAFETY: this process claimed `slot` and is its only writer; readers look at its pages
        // only after the Release store of its state below. `n` <= MAX_PAGES entries.
        unsafe {
            let dst = std::ptr::addr_of_mut!((*rep).reports[slot].pages).cast::<u64>();
            std::ptr::copy_nonoverlapping(pages.as_ptr(), dst, n);
        }
        self.region().reports[slot].state.store(1 + n as u32, Ordering::Release);
    }
}

/// Before a spawned program's VM exists: mark the hinted pages' entries used and copy their
/// pages (see the module comment). Pages the image does not map (yet) are skipped.
pub(super) fn apply(mem: &mut GuestMemory, aspace: &AddressSpace, pages: &[u64]) {
    let vas = with_gaps(pages);
    crate::trace::mark_n("spawn_prefault.pages", vas.len() as u64);
    let frames: Vec<u64> = vas.iter().filter_map(|&va| aspace.mark_used(mem, va).ok().flatten()).collect();
    mem.populate_frames_for_write(frames);
}

/// The pages to make ready for `touched` (ascending): in each aligned group of [`GROUP`] entries
/// with two or more touched pages, every page from the group's first up to its last touched one,
/// since KVM's prefetch walks the group from its start and stops at the first entry it cannot map;
/// a page touched alone in its group is made ready by itself (nothing to prefetch around it).
pub(super) fn with_gaps(touched: &[u64]) -> Vec<u64> {
    let mut out = Vec::with_capacity(touched.len() * 2);
    let mut i = 0;
    while i < touched.len() {
        let group = touched[i] & !(GROUP * PAGE_SIZE - 1);
        let mut j = i;
        while j + 1 < touched.len() && touched[j + 1] & !(GROUP * PAGE_SIZE - 1) == group {
            j += 1;
        }
        if j == i {
            out.push(touched[i]);
        } else {
            out.extend((group..=touched[j]).step_by(PAGE_SIZE as usize));
        }
        i = j + 1;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    use crate::arch::x86_64::paging::{setup_address_space, FrameAllocator, PTE_D, PTE_W};

    const P: u64 = PAGE_SIZE;

    #[test]
    fn runs_report_the_pages_they_touched_and_later_spawns_get_what_both_touched() {
        const MEM: u64 = 64 << 20;
        let mut mem = GuestMemory::anonymous(MEM).unwrap();
        let mut fr = FrameAllocator::new(MEM);
        let a = setup_address_space(&mut mem, &mut fr).unwrap();
        let base = 0x40_0000;
        for i in 0..16 {
            let frame = fr.alloc_zeroed(&mut mem).unwrap();
            let w = if i >= 8 { PTE_W } else { 0 };
            a.map_page(&mut mem, &mut fr, base + i * P, frame, PTE_U | w).unwrap();
        }
        // Marking: accessed, plus dirty where writable; the frame comes back; unmapped: None.
        let f3 = a.translate(&mem, base + 3 * P).unwrap().0;
        assert_eq!(a.mark_used(&mut mem, base + 3 * P).unwrap(), Some(f3));
        assert_eq!(a.pte(&mem, base + 3 * P).unwrap() & (PTE_A | PTE_D), PTE_A);
        a.mark_used(&mut mem, base + 9 * P).unwrap();
        assert_eq!(a.pte(&mem, base + 9 * P).unwrap() & (PTE_A | PTE_D), PTE_A | PTE_D);
        assert_eq!(a.mark_used(&mut mem, base + 64 * P).unwrap(), None);

        // A page the host marked when it filled it from a file (guestos::mm) is not the guest's
        // touch: no report names it.
        let f14 = a.translate(&mem, base + 14 * P).unwrap().0;
        a.set_flags(&mut mem, base + 14 * P, PTE_U | PTE_W | PTE_A | PTE_D | PTE_FILLED).unwrap();
        assert_eq!(a.translate(&mem, base + 14 * P).unwrap().0, f14);

        let t = Touched::new().unwrap();
        assert!(t.wants_report() && t.hint().is_none());
        // First run touched pages 3 and 9; the second 3, 9 and 12 (its own work): 12 is not hinted.
        t.report(&mem, &a);
        assert!(t.hint().is_none(), "one report is not enough");
        a.mark_used(&mut mem, base + 12 * P).unwrap();
        t.report(&mem, &a);
        assert!(!t.wants_report());
        assert_eq!(t.hint(), Some(vec![base + 3 * P, base + 9 * P]));
        t.report(&mem, &a);
        assert_eq!(t.hint(), Some(vec![base + 3 * P, base + 9 * P]), "later reports change nothing");

        // Applying it to a fresh copy of the layout marks those pages (and the gap in their group).
        let before = a.pte(&mem, base + 5 * P).unwrap();
        assert_eq!(before & PTE_A, 0);
        apply(&mut mem, &a, &[base + 3 * P, base + 5 * P]);
        assert_ne!(a.pte(&mem, base + 4 * P).unwrap() & PTE_A, 0, "the gap before the group's last touched page");
        assert_eq!(a.pte(&mem, base + 6 * P).unwrap() & PTE_A, 0, "nothing after it");
    }

    #[test]
    fn groups_with_several_touched_pages_are_filled_from_their_start_to_their_last_touched_page() {
        let g = GROUP * P;
        // Group 0: pages 2 and 5 touched -> 0..=5. Group 1: page 3 alone -> itself. Group 2: 0 and 1.
        let touched = [2 * P, 5 * P, g + 3 * P, 2 * g, 2 * g + P];
        let want: Vec<u64> = (0..=5).map(|k| k * P).chain([g + 3 * P, 2 * g, 2 * g + P]).collect();
        assert_eq!(with_gaps(&touched), want);
        assert!(with_gaps(&[]).is_empty());
    }
}
