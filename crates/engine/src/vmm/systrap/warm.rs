//! Clones of a served systrap sandbox made ready for their first exec before it is asked for.
//!
//! # Why
//! A clone (`Request::Fork`: a fork of the parked stub and a host fork of this VMM) shares the
//! guest's memory and the VMM's with the sandbox it was forked from, copy-on-write. So its first
//! exec paid a host page fault for every page it wrote: about 420 in the stub and 9 in the VMM for
//! the python template's agent (`x = 1`), 3.6-6 ms at 5-11 us each on this nested host, where
//! its second exec took none and 0.67 ms. The SDK's spares (`sdk/live.py`) are clones made ahead
//! by a background thread; they took those faults on the user's first exec all the same.
//!
//! # How
//! The same pages are written from clone to clone (the agent's loop, the interpreter's frames and
//! allocator, the VMM's own state), so they are learned from one clone and copied ahead
//! (`MADV_POPULATE_WRITE`: the guest sees nothing) in the next ones right after they reply
//! `Ready` (the stub applies the whole list in one round trip), which for a spare is off the path
//! of its first exec
//! (`platform::systrap::written`). A VMM that forks keeps a small shared region; the first
//! [`REPORTS`] clones forked since its guest last ran claim its reports and, after their first
//! run (once replied, so the caller does not wait), write there the pages they and their stubs
//! have written since the fork, and the file pages they mapped (a fork maps none of its parent's
//! file pages, so each touch of the program's text is a fault too). Later clones take what the
//! reports name together (the first execs may differ: a command, code); until a report arrives,
//! what this process itself inherited stands in (a sandbox and its clones run the same agent).
//! A template's zygote never runs, so it learns once, from its first clones. A wrong guess costs
//! a page copy and its memory, never correctness: a first run that wrote more than
//! [`MAX_WRITTEN`] pages (16 MiB) is not a typical one and reports nothing; the python agent's
//! first execs name about 1.5 MiB written.
//!
//! Only a `Fork` of one clone (a sandbox, or a spare the SDK makes ahead) takes them ahead. A fork
//! group's children do not: there it is on the group's path, and it cost more than it saved
//! (fork_group(64) of a session: the stubs' CPU rose by 2.2 ms a child, one round trip to the stub
//! per run of pages, while their first execs took 0.5 ms less). They still report, for the
//! sandboxes cloned from them later. `COLLIMATE_SYSTRAP_WARM=0` turns it off, to compare.

use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use crate::platform::systrap::written::{self, Learned, Whose};
use crate::platform::systrap::Stub;

/// Most runs of pages a report holds (stub and VMM, written and mapped, together).
pub const MAX_RUNS: usize = 2048;
/// Reports per region: the hint is what they name together (the first clones' first execs may
/// differ: a command, code).
const REPORTS: usize = 3;
/// A first run that wrote more pages than this (16 MiB) is not a typical one: it reports nothing.
const MAX_WRITTEN: u64 = 4096;

const FREE: u32 = 0;
const CLAIMED: u32 = 1;
const READY: u32 = 2;

#[repr(C)]
struct Region {
    reports: [Report; REPORTS],
}

#[repr(C)]
struct Report {
    state: AtomicU32,
    /// How many runs of each list follow in `runs`: the stub's written and mapped pages, then
    /// the VMM's.
    counts: [u32; 4],
    runs: [(u64, u64); MAX_RUNS],
}

/// What one VMM process knows and owes (see the module comment).
#[derive(Default)]
pub struct Warm {
    /// The region this process's clones report into (a clone inherits the mapping and makes its
    /// own before it forks in turn).
    region: Option<NonNull<Region>>,
    /// Set in a clone that claimed its parent's region, until it has reported its first run.
    report_to: Option<(NonNull<Region>, usize)>,
    /// The faults to take ahead in a clone: its stub's and this process's.
    stub: Learned,
    vmm: Learned,
    /// This process's guest ran since its region was made: the next fork opens a new one.
    stale: bool,
    /// A new clone that is to take the hinted faults once it has replied `Ready` ([`Warm::settle`]).
    pending: bool,
}

fn enabled() -> bool {
    std::env::var_os("COLLIMATE_SYSTRAP_WARM").is_none_or(|v| v != "0")
}

impl Warm {
    /// In the process that forks, before a `Fork`'s clones: a region for their report, a new
    /// one if the guest ran since the last (what the old one learned is kept as the hint).
    pub fn before_fork(&mut self) {
        if !enabled() {
            return;
        }
        if let Some(r) = self.region {
            if !self.stale {
                return;
            }
            self.take_report(r);
            // SAFETY: our own mapping of the region (clones hold their own); nothing refers to it.
            unsafe { libc::munmap(r.as_ptr().cast(), std::mem::size_of::<Region>()) };
            self.region = None;
        }
        // SAFETY: a new shared anonymous mapping (zeroed: FREE), kept for this process's life
        // or until replaced above.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), std::mem::size_of::<Region>(), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
        };
        self.region = if p == libc::MAP_FAILED { None } else { NonNull::new(p.cast()) };
        self.stale = false;
    }

    /// The guest of this process ran (or changed): its clones from now on learn anew.
    pub fn guest_changed(&mut self) {
        self.stale = true;
    }

    /// Take what the ready reports of `r` name together as the hint (none ready: keep it).
    fn take_report(&mut self, r: NonNull<Region>) {
        let mut lists: [Vec<(u64, u64)>; 4] = Default::default();
        let mut any = false;
        for slot in 0..REPORTS {
            // SAFETY: the region stays mapped while we hold it; a report's runs are read only
            // once READY (published with Release by its reporter).
            unsafe {
                let report = &raw const (*r.as_ptr()).reports[slot];
                if (*report).state.load(Ordering::Acquire) != READY {
                    continue;
                }
                any = true;
                let mut at = 0;
                for (i, list) in lists.iter_mut().enumerate() {
                    let n = ((*report).counts[i] as usize).min(MAX_RUNS - at);
                    list.extend_from_slice(&(&(*report).runs)[at..at + n]);
                    at += n;
                }
            }
        }
        if !any {
            return;
        }
        let [sw, sr, vw, vr] = lists.map(merge);
        self.stub = Learned { write: sw, read: sr };
        self.vmm = Learned { write: vw, read: vr };
    }

    /// In a new clone, before it replies `Ready`: take its parent's report (or claim it, to
    /// write it after the first run); with `populate`, [`Warm::settle`] takes the hinted faults.
    pub fn in_clone(&mut self, populate: bool) {
        if let Some(r) = self.region.take() {
            self.take_report(r);
            // SAFETY: the region is mapped; the state words are atomic.
            let claimed = (0..REPORTS).find(|&i| unsafe {
                (*r.as_ptr()).reports[i].state.compare_exchange(FREE, CLAIMED, Ordering::AcqRel, Ordering::Acquire).is_ok()
            });
            if let Some(slot) = claimed {
                self.report_to = Some((r, slot));
            } else {
                // SAFETY: our copy of the parent's mapping; nothing else here refers to it.
                unsafe { libc::munmap(r.as_ptr().cast(), std::mem::size_of::<Region>()) };
            }
        }
        self.stale = false;
        self.pending = populate && enabled();
    }

    /// In a clone that has replied `Ready` and waits for its first request: take the hinted
    /// faults in its stub and in this process, once. Done after the reply so that the caller
    /// (the SDK's spare thread, holding its template's lock) does not wait for it; a request
    /// that arrives meanwhile waits at most for the rest.
    pub fn settle(&mut self, stub: &mut Stub) {
        if !std::mem::take(&mut self.pending) {
            return;
        }
        written::populate_here(&self.vmm);
        let _ = stub.populate(&self.stub);
        crate::trace::mark("clone.settled");
    }

    /// After a run of this clone has been answered: if it owes its parent a report, write what
    /// it and its stub have written and mapped since the fork.
    pub fn after_run(&mut self, stub: &Stub) {
        let Some((r, slot)) = self.report_to.take() else { return };
        let per = MAX_RUNS / 4;
        let mut s = stub.learn(per).unwrap_or_default();
        let mut v = written::learn(Whose::This, (0, 0), per).unwrap_or_default();
        let written_pages = |l: &Learned| l.write.iter().map(|r| r.1 / 4096).sum::<u64>();
        if written_pages(&s) + written_pages(&v) > MAX_WRITTEN {
            (s, v) = Default::default();
        }
        // SAFETY: we claimed the report, so nobody else writes it; it is published with Release.
        unsafe {
            let region = r.as_ptr();
            let report = &raw mut (*region).reports[slot];
            let mut at = 0;
            for (i, list) in [&s.write, &s.read, &v.write, &v.read].into_iter().enumerate() {
                (&mut (*report).runs)[at..at + list.len()].copy_from_slice(list);
                (*report).counts[i] = list.len() as u32;
                at += list.len();
            }
            (*report).state.store(READY, Ordering::Release);
            libc::munmap(region.cast(), std::mem::size_of::<Region>());
        }
    }
}

/// Runs sorted and merged where they overlap or touch.
fn merge(mut runs: Vec<(u64, u64)>) -> Vec<(u64, u64)> {
    runs.sort_unstable();
    let mut out: Vec<(u64, u64)> = Vec::with_capacity(runs.len());
    for (start, len) in runs {
        match out.last_mut() {
            Some((s, l)) if *s + *l >= start => *l = (*l).max(start + len - *s),
            _ => out.push((start, len)),
        }
    }
    out
}

#[cfg(test)]
mod tests {
    #[test]
    fn reports_merge_into_one_hint() {
        let runs = vec![(0x5000, 0x1000), (0x1000, 0x2000), (0x2000, 0x2000), (0x9000, 0x1000), (0x6000, 0x1000)];
        assert_eq!(super::merge(runs), vec![(0x1000, 0x3000), (0x5000, 0x2000), (0x9000, 0x1000)]);
    }
}
