//! The guest pages a fork is going to touch, made ready before it runs: private and writable on
//! the host, their guest page-table entries marked accessed, so that KVM maps each with its
//! touched neighbours at one shadow fault.
//!
//! # Why
//! A forked sandbox shares its guest memory with its parent copy-on-write, and its new KVM VM
//! starts with no shadow page tables, so every page its guest touches first is a shadow fault (a
//! world switch, 20-30 us on kvm_pvm). Traced (fork_group(64) of the python template, each
//! child's first exec of `pass`): 588 faults a child, 460 of them reads. KVM's fault handler also
//! maps up to 7 neighbours of the faulting entry (the aligned group of 8), but only entries whose
//! accessed bit is set and whose host page is present and writable (looked up for write, without
//! faulting): a page shared copy-on-write with the parent is read-only on the host, so a fork
//! took one fault per page it read. A page it wrote took two or three: KVM's fault breaks the
//! host's copy-on-write, whose MMU-notifier invalidation makes the same fault retry, and a page
//! read before it is written was mapped read-only first.
//!
//! # How
//! Each fork makes private copies (`MADV_POPULATE_WRITE`, a few us a page) of the pages its
//! siblings touched, and sets their entries' accessed bit, before its VM exists (no shadow entries
//! to invalidate yet). The dirty bit is left as it was: KVM does not prefetch a writable entry
//! with the dirty bit set while the slot's dirty log is on (every slot's is, for resets and
//! snapshots), but it does map a clean one read-only.
//!
//! Which pages: a VMM process that forks keeps a small shared region. The first two forks since
//! its guest last ran claim a report each; such a fork clears the accessed bit of every user page
//! before its VM starts, and after its first run (after replying, so the run's caller does not
//! wait for it) writes there the pages whose bit KVM set again: the pages the run touched. Later
//! forks take the pages both reported, so a page only one child's own work touched is left alone.
//! Until the first reports arrive, the hint inherited from this process's own parent stands in (a
//! sandbox and its siblings run the same agent). A template's zygote never runs, so it learns once
//! from its first clones. A wrong guess costs a page copy, never correctness: a private copy holds
//! what the shared page held, and the guest does not see the accessed bits. The price is memory: a
//! fork holds private copies of the hinted pages (at most [`MAX_PAGES`], 32 MiB; about 2.5 MiB
//! for the python template's agent) instead of sharing them. `COLLIMATE_PREFAULT=0` turns it off,
//! to compare.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::arch::x86_64::layout::PAGE_SIZE;
use crate::arch::x86_64::paging::{AddressSpace, PTE_A, PTE_D, PTE_U};
use crate::vstate::memory::GuestMemory;

/// Most pages one report holds; a first run that touched more is not a typical one and reports none.
const MAX_PAGES: usize = 8192;
/// Reports per batch.
const REPORTS: usize = 2;
/// In a report and the hint, set in a page's address (bit 0: addresses are page-aligned) if the
/// run wrote the page.
const WRITTEN: u64 = 1;

#[repr(C)]
struct Report {
    /// 0 while being written, then 1 + the number of pages.
    state: AtomicU32,
    /// Guest-virtual page addresses, ascending, with [`WRITTEN`].
    pages: [u64; MAX_PAGES],
}

#[repr(C)]
struct Region {
    claims: AtomicU32,
    reports: [Report; REPORTS],
}

/// What one VMM process knows and owes (see the module comment).
#[derive(Default)]
pub struct Learner {
    /// The region this process's forks report into, and the pid that made it (a fork inherits the
    /// mapping and makes its own before it forks in turn).
    region: Option<(NonNull<Region>, i32)>,
    /// Set in a fork that claimed a report: the parent's region and the slot, until this process
    /// has reported its first run.
    report_to: Option<(NonNull<Region>, usize)>,
    /// Guest-virtual pages to make ready in a fork, ascending, with [`WRITTEN`].
    hint: Vec<u64>,
    /// This process's guest ran since the reports were opened: the next batch asks for new ones.
    stale: bool,
}

// SAFETY: the VMM process is single-threaded; the region is shared with other processes only
// through the atomics above.
unsafe impl Send for Learner {}

fn region_size() -> usize {
    std::mem::size_of::<Region>().next_multiple_of(PAGE_SIZE as usize)
}

impl Learner {
    /// This process's guest ran (or changed otherwise): what its forks touch may differ now.
    pub fn guest_changed(&mut self) {
        self.stale = true;
    }

    /// In the parent, before forking: take the reports that are complete, and if the guest ran
    /// since the reports were opened, open them again for this batch. Makes this process's region
    /// first; that can fail (no memory), and then nothing is learned and forks go on without.
    pub fn before_forks(&mut self) {
        self.take_reports();
        if std::env::var_os("COLLIMATE_PREFAULT").is_some_and(|v| v == "0") {
            self.hint.clear();
        }
    }

    fn take_reports(&mut self) {
        // SAFETY: getpid cannot fail.
        let me = unsafe { libc::getpid() };
        match self.region {
            Some((r, owner)) if owner == me => {
                // SAFETY: our own live mapping of a Region.
                let region = unsafe { r.as_ref() };
                let mut sets: Vec<&[u64]> = Vec::new();
                for rep in &region.reports {
                    let s = rep.state.load(Ordering::Acquire);
                    if s > 0 {
                        sets.push(&rep.pages[..(s - 1) as usize]);
                    }
                }
                if let Some((first, rest)) = sets.split_first() {
                    let mut h: Vec<u64> = first.to_vec();
                    for s in rest {
                        h.retain_mut(|p| match s.binary_search_by_key(&(*p & !WRITTEN), |q| q & !WRITTEN) {
                            Ok(k) => {
                                *p |= s[k] & WRITTEN;
                                true
                            }
                            Err(_) => false,
                        });
                    }
                    self.hint = h;
                }
                if !std::mem::take(&mut self.stale) {
                    return;
                }
                for rep in &region.reports {
                    rep.state.store(0, Ordering::Relaxed);
                }
                region.claims.store(0, Ordering::Release);
            }
            _ => {
                // SAFETY: a new shared anonymous mapping (zeroed: no claims, no reports).
                let p = unsafe {
                    libc::mmap(
                        std::ptr::null_mut(),
                        region_size(),
                        libc::PROT_READ | libc::PROT_WRITE,
                        libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                        -1,
                        0,
                    )
                };
                // An inherited region stays mapped (our parent's forks may still report into it
                // through their own copies); ours replaces it here.
                self.region = if p == libc::MAP_FAILED { None } else { NonNull::new(p.cast::<Region>()).map(|r| (r, me)) };
                self.stale = false;
            }
        }
    }

    /// In a fork, before its VM exists (which has no dirty log: see the module comment): clear
    /// the dirty bits of the user pages (the accessed bits too if this fork claims a report of
    /// the batch), then make the hinted pages ready.
    pub fn in_fork(&mut self, mem: &mut GuestMemory, aspace: &AddressSpace) {
        self.report_to = self.region.and_then(|(r, _)| {
            // SAFETY: the parent's shared mapping of a Region, inherited and never unmapped here.
            let slot = unsafe { r.as_ref() }.claims.fetch_add(1, Ordering::AcqRel) as usize;
            (slot < REPORTS).then_some((r, slot))
        });
        let bits = if self.report_to.is_some() { PTE_A | PTE_D } else { PTE_D };
        if aspace.clear_used_bits(mem, bits).is_err() {
            self.report_to = None;
        }
        let written: std::collections::HashSet<u64> = self.hint.iter().filter(|&&p| p & WRITTEN != 0).map(|&p| p & !WRITTEN).collect();
        let touched: Vec<u64> = self.hint.iter().map(|&p| p & !WRITTEN).collect();
        let frames: Vec<u64> = super::spawn_prefault::with_gaps(&touched)
            .into_iter()
            .filter_map(|va| aspace.mark_touched(mem, va, written.contains(&va)).ok().flatten())
            .collect();
        crate::trace::mark_n("prefault.pages", frames.len() as u64);
        // Failure (an old kernel) costs speed only.
        mem.populate_frames_for_write(frames);
    }

    /// After a run in a fork: the report this run is to fill, if it is the first run of a fork
    /// that claimed one.
    pub fn take_report(&mut self) -> Option<ReportSlot> {
        self.report_to.take().map(|(region, slot)| ReportSlot { region, slot })
    }
}

/// One report to write (see [`Learner::take_report`]).
pub struct ReportSlot {
    region: NonNull<Region>,
    slot: usize,
}

impl ReportSlot {
    /// Write the user pages of `aspace` whose accessed bit is set (the pages touched since the
    /// fork cleared the bits), ascending, with [`WRITTEN`] where the dirty bit is set too.
    pub fn write(self, mem: &GuestMemory, aspace: &AddressSpace) {
        let pages: Vec<u64> = match aspace.present_pages(mem, 0, u64::MAX) {
            Ok(p) => p
                .into_iter()
                .filter(|&(_, e)| e & (PTE_A | PTE_U) == PTE_A | PTE_U)
                .map(|(va, e)| va | if e & PTE_D != 0 { WRITTEN } else { 0 })
                .collect(),
            Err(_) => Vec::new(),
        };
        let n = if pages.len() > MAX_PAGES { 0 } else { pages.len() }; // not a typical first run: none
        // SAFETY: the slot was claimed by this process alone (the claim counter), in a live shared
        // mapping; the parent reads it only after the release store below. `n` <= MAX_PAGES.
        unsafe {
            let dst = std::ptr::addr_of_mut!((*self.region.as_ptr()).reports[self.slot].pages).cast::<u64>();
            std::ptr::copy_nonoverlapping(pages.as_ptr(), dst, n);
            (*self.region.as_ptr()).reports[self.slot].state.store(n as u32 + 1, Ordering::Release);
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::paging::{setup_address_space, FrameAllocator, PTE_W};

    const P: u64 = PAGE_SIZE;
    const BASE: u64 = 0x40_0000;

    /// Whether the guest page at `gpa` is a copy of this process's own: /proc/self/pagemap says
    /// present and mapped exclusively (not shared with the parent copy-on-write).
    fn private(mem: &GuestMemory, gpa: u64) -> bool {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut e = [0u8; 8];
        f.read_exact_at(&mut e, (mem.host_addr() / PAGE_SIZE + gpa / PAGE_SIZE) * 8).unwrap();
        let e = u64::from_le_bytes(e);
        e & (1 << 63) != 0 && e & (1 << 56) != 0
    }

    /// 64 writable user pages at BASE, every entry accessed and dirty (a parent's history) but
    /// those of pages 8..16, which were never touched.
    fn space() -> (GuestMemory, AddressSpace) {
        const MEM: u64 = 16 << 20;
        let mut mem = GuestMemory::anonymous(MEM).unwrap();
        let mut fr = FrameAllocator::new(MEM);
        let a = setup_address_space(&mut mem, &mut fr).unwrap();
        for i in 0..64 {
            let frame = fr.alloc_zeroed(&mut mem).unwrap();
            let used = if (8..16).contains(&i) { 0 } else { PTE_A | PTE_D };
            a.map_page(&mut mem, &mut fr, BASE + i * P, frame, PTE_U | PTE_W | used).unwrap();
        }
        (mem, a)
    }

    fn bits(mem: &GuestMemory, a: &AddressSpace, i: u64) -> u64 {
        a.pte(mem, BASE + i * P).unwrap() & (PTE_A | PTE_D)
    }

    /// A fork's first run, as KVM would leave it: `read` pages accessed, `wrote` accessed and dirty.
    fn run(mem: &mut GuestMemory, a: &AddressSpace, read: &[u64], wrote: &[u64]) {
        for &i in read {
            a.mark_touched(mem, BASE + i * P, false).unwrap();
        }
        for &i in wrote {
            a.mark_touched(mem, BASE + i * P, true).unwrap();
        }
    }

    #[test]
    fn two_forks_report_what_they_touched_and_later_forks_get_what_both_did() {
        let (mut mem, a) = space();
        let mut parent = Learner::default();
        parent.before_forks();
        assert!(parent.hint.is_empty());
        let fork = |parent: &Learner| Learner { region: parent.region, ..Default::default() };

        // The first two forks of the batch claim the reports: their entries lose the accessed and
        // dirty bits before their VM runs; a third fork's lose the dirty bit only.
        let mut f0 = fork(&parent);
        f0.in_fork(&mut mem, &a);
        assert!(f0.report_to.is_some());
        assert_eq!(bits(&mem, &a, 5), 0, "a reporting fork starts with clean entries");
        assert_eq!(bits(&mem, &a, 30), 0);
        run(&mut mem, &a, &[5, 12], &[6, 7]);
        f0.take_report().unwrap().write(&mem, &a);
        assert!(f0.take_report().is_none(), "one report per fork");

        let mut f1 = fork(&parent);
        f1.in_fork(&mut mem, &a);
        run(&mut mem, &a, &[6, 20], &[5, 7]);
        f1.take_report().unwrap().write(&mem, &a);

        let mut f2 = fork(&parent);
        f2.in_fork(&mut mem, &a);
        assert!(f2.report_to.is_none(), "two reports per batch");

        // Both touched 5, 6 and 7; written by either: 5, 6 and 7 (5 by the second, 6 by the first).
        parent.before_forks();
        assert_eq!(parent.hint, [BASE + 5 * P | WRITTEN, BASE + 6 * P | WRITTEN, BASE + 7 * P | WRITTEN]);

        // Until the parent's guest runs, nobody else reports; after it ran, the next batch does.
        let mut f = fork(&parent);
        f.region = parent.region;
        assert!(Learner { region: parent.region, ..Default::default() }.take_report().is_none());
        parent.guest_changed();
        parent.before_forks();
        assert_eq!(parent.hint.len(), 3, "the last batch's, until new reports are in");
        f.in_fork(&mut mem, &a);
        assert!(f.report_to.is_some());
        run(&mut mem, &a, &[9], &[]);
        f.take_report().unwrap().write(&mem, &a);
        parent.before_forks();
        assert_eq!(parent.hint, [BASE + 9 * P], "a page only read is not marked written");
    }

    #[test]
    fn a_fork_marks_and_copies_the_hinted_pages_and_the_gaps_of_their_groups() {
        let (mut mem, a) = space();
        // Page 9 read, page 12 written: group 8..16 is filled from 8 to 12.
        let hint = vec![BASE + 9 * P, BASE + 12 * P | WRITTEN, BASE + 40 * P];
        // SAFETY: the test process may have threads; the child only touches its own memory,
        // reads /proc and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let mut child = Learner { hint, ..Default::default() };
            child.in_fork(&mut mem, &a);
            let frame = |i: u64| a.translate(&mem, BASE + i * P).unwrap().0;
            let checks = [
                bits(&mem, &a, 9) == PTE_A,
                bits(&mem, &a, 12) == PTE_A | PTE_D,
                bits(&mem, &a, 8) == PTE_A,
                bits(&mem, &a, 13) == 0,
                bits(&mem, &a, 3) == PTE_A, // the dirty bit cleared, the accessed one kept
                bits(&mem, &a, 40) == PTE_A,
                (8..=12).chain([40]).all(|i| private(&mem, frame(i))),
                ![7, 13, 39, 41].iter().any(|&i| private(&mem, frame(i))),
            ];
            let failed = checks.iter().position(|&c| !c).map_or(0, |k| k + 1);
            // SAFETY: ending the forked child without running the parent's destructors.
            unsafe { libc::_exit(failed as i32) };
        }
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status), "the fork died: {status:#x}");
        assert_eq!(libc::WEXITSTATUS(status), 0, "check number {} failed in the fork", libc::WEXITSTATUS(status));
    }
}
