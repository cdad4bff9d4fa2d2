//! Private copies, made before a fork runs, of the guest pages it is going to write.
//!
//! A forked sandbox shares its guest memory with its parent copy-on-write, and its new KVM VM
//! starts with no shadow page tables. Traced on kvm_pvm (fork_group(64) of the python template, each
//! child's first exec of `pass`): a child's guest writes about 170 shared pages, and each costs two
//! or three shadow faults instead of one. KVM's fault handler breaks the host's copy-on-write,
//! whose MMU-notifier invalidation makes the same fault retry; a page read before it is written
//! was mapped read-only (the host page was not writable then) and faults once more. Pages that are
//! already private and writable when the VM starts take one fault each, and a read maps them
//! writable at once. So each fork makes private copies (`MADV_POPULATE_WRITE`) of the pages its
//! siblings wrote, before its VM exists (no shadow entries to invalidate yet).
//!
//! Which pages: a VMM process that forks keeps a small shared region; its first two forks since
//! its guest last ran write there the pages their first run wrote, from KVM's dirty log of their
//! fresh VM (after replying, so the run's caller does not wait for it). Later forks copy the pages
//! both reported, so a page only one child's own work wrote is left alone. Until the first reports
//! arrive, the hint inherited from this process's own parent stands in (a sandbox and its siblings
//! run the same agent). A template's zygote never runs, so it learns once from its first clones. A wrong guess costs a page copy, never correctness: a private copy holds what the shared
//! page held. `COLLIMATE_PREFAULT=0` turns the copying off, to compare.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::arch::x86_64::layout::PAGE_SIZE;
use crate::vstate::memory::GuestMemory;

/// Most pages one report holds; a first run that wrote more is not a typical one and reports none.
const MAX_PAGES: usize = 8192;
/// Reports per batch.
const REPORTS: usize = 2;

#[repr(C)]
struct Report {
    /// 0 while being written, then 1 + the number of pages.
    state: AtomicU32,
    pages: [u32; MAX_PAGES],
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
    /// Set in a fork: the parent's region, until this process has reported its first run.
    report_to: Option<NonNull<Region>>,
    /// Guest-physical page numbers to copy in a fork, ascending.
    hint: Vec<u32>,
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
    /// This process's guest ran (or changed otherwise): what its forks write may differ now.
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
                let mut sets: Vec<&[u32]> = Vec::new();
                for rep in &region.reports {
                    let s = rep.state.load(Ordering::Acquire);
                    if s > 0 {
                        sets.push(&rep.pages[..(s - 1) as usize]);
                    }
                }
                if let Some((first, rest)) = sets.split_first() {
                    let mut h: Vec<u32> = first.to_vec();
                    for s in rest {
                        h.retain(|p| s.binary_search(p).is_ok());
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

    /// In a fork, before its VM exists: copy the hinted pages, and report this fork's first run
    /// to the parent.
    pub fn in_fork(&mut self, mem: &GuestMemory, frames_end: u64) {
        self.report_to = self.region.map(|(r, _)| r);
        let limit = (frames_end.min(mem.size()) / PAGE_SIZE) as u32;
        let mut i = 0;
        while i < self.hint.len() {
            let start = self.hint[i];
            let mut end = start + 1;
            while i + 1 < self.hint.len() && self.hint[i + 1] == end {
                end += 1;
                i += 1;
            }
            i += 1;
            if end > limit {
                continue;
            }
            let addr = mem.host_addr() + start as u64 * PAGE_SIZE;
            // SAFETY: a range of our guest-memory mapping; MADV_POPULATE_WRITE only faults pages in
            // writable (private copies of the same contents). Failure (an old kernel) costs speed.
            unsafe {
                libc::madvise(addr as *mut libc::c_void, ((end - start) as u64 * PAGE_SIZE) as usize, libc::MADV_POPULATE_WRITE)
            };
        }
    }

    /// After a run in a fork: the report slot this run is to fill, if it is the fork's first run
    /// and a slot of the batch is left. The caller hands it KVM's dirty log of its VM.
    pub fn take_report(&mut self) -> Option<ReportSlot> {
        let region = self.report_to.take()?;
        // SAFETY: the parent's shared mapping of a Region, inherited and never unmapped here.
        let slot = unsafe { region.as_ref() }.claims.fetch_add(1, Ordering::AcqRel) as usize;
        (slot < REPORTS).then_some(ReportSlot { region, slot })
    }
}

/// One report to write (see [`Learner::take_report`]).
pub struct ReportSlot {
    region: NonNull<Region>,
    slot: usize,
}

impl ReportSlot {
    /// Write the pages set in `log` (a KVM dirty bitmap: bit n is guest page n), ascending.
    pub fn write(self, log: &[u64]) {
        // SAFETY: the slot was claimed by this process alone (the claim counter), in a live shared
        // mapping; the parent reads it only after the release store below.
        let rep = unsafe { &mut (*self.region.as_ptr()).reports[self.slot] };
        let mut n = 0usize;
        'words: for (w, &word) in log.iter().enumerate() {
            let mut bits = word;
            while bits != 0 {
                let b = bits.trailing_zeros() as usize;
                bits &= bits - 1;
                if n == MAX_PAGES {
                    n = 0; // not a typical first run: report nothing
                    break 'words;
                }
                rep.pages[n] = (w * 64 + b) as u32;
                n += 1;
            }
        }
        rep.state.store(n as u32 + 1, Ordering::Release);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn log_of(pages: &[usize]) -> Vec<u64> {
        let mut log = vec![0u64; 64];
        for &p in pages {
            log[p / 64] |= 1 << (p % 64);
        }
        log
    }

    /// Whether guest page `page` is a private (anonymous) copy in this process: /proc/self/pagemap
    /// says present and not file-backed.
    fn private(mem: &GuestMemory, page: u64) -> bool {
        use std::os::unix::fs::FileExt;
        let f = std::fs::File::open("/proc/self/pagemap").unwrap();
        let mut e = [0u8; 8];
        f.read_exact_at(&mut e, (mem.host_addr() / PAGE_SIZE + page) * 8).unwrap();
        let e = u64::from_le_bytes(e);
        e & (1 << 63) != 0 && e & (1 << 61) == 0
    }

    #[test]
    fn forks_copy_the_pages_both_first_reports_wrote() {
        let mem = GuestMemory::anonymous(16 << 20).unwrap();
        let mut parent = Learner::default();
        parent.before_forks();
        assert!(parent.hint.is_empty());
        // Three forks of the batch report their first runs; only two reports are kept.
        let mut forks: Vec<Learner> = (0..3).map(|_| Learner { region: parent.region, ..Default::default() }).collect();
        for f in &mut forks {
            f.report_to = f.region.map(|(r, _)| r);
        }
        forks[0].take_report().unwrap().write(&log_of(&[5, 6, 7, 100, 700]));
        forks[1].take_report().unwrap().write(&log_of(&[6, 7, 200, 700, 4095]));
        assert!(forks[2].take_report().is_none(), "two reports per batch");
        assert!(forks[0].take_report().is_none(), "one report per fork");
        parent.before_forks();
        assert_eq!(parent.hint, [6, 7, 700]);
        // Until the parent's guest runs, nobody else reports.
        let mut f = Learner { region: parent.region, ..Default::default() };
        f.report_to = f.region.map(|(r, _)| r);
        assert!(f.take_report().is_none());
        // After it ran, the next batch reports afresh: with one report, that one is the hint.
        parent.guest_changed();
        parent.before_forks();
        assert_eq!(parent.hint, [6, 7, 700], "the last batch's, until new reports are in");
        f.report_to = f.region.map(|(r, _)| r);
        f.take_report().unwrap().write(&log_of(&[6, 7, 8]));
        parent.before_forks();
        assert_eq!(parent.hint, [6, 7, 8]);
        // No report in a batch: the hint stands.
        parent.guest_changed();
        parent.before_forks();
        assert_eq!(parent.hint, [6, 7, 8]);

        // A real fork copies exactly the hinted pages (below the frame pool's end).
        parent.hint = vec![6, 7, 8, 3000, 4000];
        // SAFETY: the test process may have threads; the child only makes raw syscalls and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            let mut child = Learner { region: parent.region, hint: parent.hint.clone(), ..Default::default() };
            child.in_fork(&mem, 3500 * PAGE_SIZE);
            let ok = [6, 7, 8, 3000].iter().all(|&p| private(&mem, p))
                && ![5, 9, 2999, 4000].iter().any(|&p| private(&mem, p))
                && child.report_to.is_some();
            // SAFETY: ending the forked child without running the parent's destructors.
            unsafe { libc::_exit(if ok { 0 } else { 1 }) };
        }
        let mut status = 0;
        // SAFETY: waiting for the child forked above.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert!(libc::WIFEXITED(status) && libc::WEXITSTATUS(status) == 0, "the fork's private pages are not the hinted ones");
    }
}
