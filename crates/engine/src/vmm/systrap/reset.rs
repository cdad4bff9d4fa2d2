//! Reset of a systrap sandbox (`Request::Reset`, `Request::ResetKeepFiles`): back to the
//! snapshot its template's zygote was restored from, in place, as kvm's `Machine::reset`.
//!
//! # What is kept, and why this design
//! A systrap zygote is restored from a snapshot (`super::snapshot`) and never runs: each of its
//! guest mappings is a `MAP_PRIVATE` mapping of the snapshot's memory file or of a program file,
//! and its clones inherit those mappings by a fork of its stub. So the template's memory is the
//! files' pages at known places. [`Origin`], made by the restore and inherited by every clone
//! (it is the VMM's own memory, copied by the VMM's fork, with its descriptors), holds the
//! snapshot's registers, XSAVE area and guest OS state, the descriptors each mapping came from,
//! and the stub's host mappings right after the restore (`/proc/<stub>/maps`).
//!
//! A reset compares the stub's host mappings now with that list:
//! - a mapping that is still exactly the template's (range, protection, file, offset) keeps its
//!   page tables; only the pages the sandbox copied on write (present and not the file's, in
//!   `/proc/<stub>/pagemap`) are dropped with `MADV_DONTNEED`, so they read the file's page again;
//! - one that changed (unmapped, protected, mapped over, moved) is mapped again from its file;
//! - what the sandbox mapped since (heap growth, mmap'd regions, thread stacks, shared memory) is
//!   unmapped.
//!
//! No page is copied: the work is one `pagemap` read per mapping and one stub call per
//! [`crate::platform::systrap::shared`]'s batch of runs of dropped pages, which are then faulted in
//! again from the file (`MADV_POPULATE_WRITE`: the next exec likely writes them too, and a recycled
//! sandbox is reset on the SDK's reaper thread, off its next user's path); the next exec finds its
//! page tables for the pages it did not write. The registers, FS base and XSAVE area go back to the snapshot's in the parked stub, and the
//! guest OS state is rebuilt from the snapshot's as kvm's reset does (`restore_os`: files, fds,
//! memory map, process facts, signal handlers and mask, umask, cwd, rlimits, clocks, threads;
//! the writable mounts copied again from the snapshot, into the sandbox's own tmpfs), with fresh
//! entropy for an unseeded CRNG.
//!
//! Other guest processes (a background process an exec left, an orphan the first process
//! adopted) are killed first, as kvm's reset does (`process::kill_children`): a reset is the
//! state of a new clone, which has one process, and killing is what kvm users already get (the
//! alternative, refusing, would make every sandbox whose exec left a daemon unrecyclable).
//! Threads other than the first are dropped with the OS state (they live in this VMM's state
//! and the stub's one host thread; their stacks are mappings made since, so unmapped).
//!
//! Refused with `ResetUnavailable` (the caller makes a new clone instead): a sandbox whose
//! template was spawned, not restored from a snapshot (a live zygote's anonymous memory cannot be
//! dropped back to anything: `MADV_DONTNEED` zero-fills it), and one whose first process has
//! ended (its stub is gone). A reset that fails part way kills the stub: the sandbox then answers
//! as one whose first process ended, never with half of its last owner's state.

use std::os::fd::{AsFd, AsRawFd, OwnedFd};
use std::path::PathBuf;
use std::sync::Arc;
use std::time::Instant;

use kvm_bindings::kvm_regs;

use super::snapshot::SystrapState;
use super::{Process, StubSpace};
use crate::error::{Error, Result};
use crate::guestos::persist::{OsState, ScratchRoot};
use crate::guestos::{self, signal};
use crate::platform::systrap::{layout, memory, reaper, Stub};
use crate::protocol::{ResetStats, RunExit};

const PAGE: u64 = 4096;
/// Pagemap entries read at once.
const PAGEMAP_CHUNK: usize = 16 << 10;

/// Where the guest's pages of one part of a template mapping come from.
struct Piece {
    start: u64,
    end: u64,
    prot: i32,
    file: Arc<OwnedFd>,
    offset: u64,
}

/// The state a reset returns to: the snapshot a zygote was restored from (see the module docs).
pub(super) struct Origin {
    dir: PathBuf,
    regs: kvm_regs,
    fs_base: u64,
    xsave: Vec<u8>,
    os: OsState,
    pieces: Vec<Piece>,
    /// The stub's host mappings in the guest's range right after the restore.
    layout: Vec<memory::Mapping>,
}

/// What a sandbox keeps for its resets: the origin (none: not resettable) and where its
/// writable mounts live (its tmpfs; `None`: its VMM's own directory).
#[derive(Clone, Default)]
pub(super) struct Point {
    origin: Option<Arc<Origin>>,
    scratch: Option<ScratchRoot>,
}

impl Point {
    /// The sandbox's writable mounts are in `scratch` from now on (a clone's tmpfs).
    pub(super) fn set_scratch(&mut self, scratch: ScratchRoot) {
        self.scratch = Some(scratch);
    }
}

/// Builds an [`Origin`] while a snapshot is restored (`Process::restore_into`).
pub(super) struct OriginBuilder {
    pieces: Vec<Piece>,
}

impl OriginBuilder {
    pub(super) fn new() -> OriginBuilder {
        OriginBuilder { pieces: Vec::new() }
    }

    /// `[start, start + len)` was mapped from `file` at `offset` with `prot` (a later piece over an
    /// earlier one replaces that part of it, as `MAP_FIXED` did).
    pub(super) fn mapped(&mut self, start: u64, len: u64, prot: i32, file: &Arc<OwnedFd>, offset: u64) {
        let end = start + len;
        let mut out = Vec::with_capacity(self.pieces.len() + 2);
        for p in self.pieces.drain(..) {
            if p.end <= start || end <= p.start {
                out.push(p);
                continue;
            }
            if p.start < start {
                out.push(Piece { start: p.start, end: start, prot: p.prot, file: p.file.clone(), offset: p.offset });
            }
            if end < p.end {
                out.push(Piece { start: end, end: p.end, prot: p.prot, file: p.file.clone(), offset: p.offset + (end - p.start) });
            }
        }
        out.push(Piece { start, end, prot, file: file.clone(), offset });
        out.sort_by_key(|p| p.start);
        self.pieces = out;
    }

    /// The origin of the process restored from `state` in `dir` into `stub`, now that its
    /// memory is mapped.
    pub(super) fn finish(self, dir: PathBuf, state: &SystrapState, stub: &Stub) -> Result<Point> {
        let layout = guest_mappings(stub.pid())?;
        let origin = Origin { dir, regs: state.regs, fs_base: state.fs_base, xsave: state.xsave.clone(), os: state.os.clone(), pieces: self.pieces, layout };
        Ok(Point { origin: Some(Arc::new(origin)), scratch: None })
    }
}

/// The host mappings of stub `pid` in the guest's range (not the stub's own, nor the host's
/// vDSO).
fn guest_mappings(pid: i32) -> Result<Vec<memory::Mapping>> {
    let all = memory::mappings(pid).map_err(Error::sys("read the stub's mappings"))?;
    let (lo, hi) = Stub::reserved_range();
    Ok(all
        .into_iter()
        .filter(|m| m.end <= layout::TASK_SIZE && !(m.start < hi && lo < m.end) && !m.name.starts_with("[v"))
        .collect())
}

/// Whether a reset faults the pages it dropped in writable mappings in again
/// (`COLLIMATE_SYSTRAP_WARM=0` turns it off with the clones' faults taken ahead: `super::warm`).
fn refill_enabled() -> bool {
    std::env::var_os("COLLIMATE_SYSTRAP_WARM").is_none_or(|v| v != "0")
}

fn unavailable(why: &str) -> Error {
    Error::ResetUnavailable(format!("{why}; start a new sandbox (a clone of the template) instead"))
}

fn stub_err(what: &str) -> impl Fn(crate::platform::systrap::Error) -> Error + '_ {
    move |e| Error::Remote(format!("systrap: reset: {what}: {e}"))
}

impl Process {
    /// Back to the snapshot this sandbox descends from (see the module docs); with `keep_files`
    /// its writable mounts stay as they are. `ctx`: an overlay context for a fresh writable root.
    pub(super) fn reset(&mut self, keep_files: bool, ctx: Option<OwnedFd>) -> Result<ResetStats> {
        let start = Instant::now();
        let Some(origin) = self.reset.origin.clone() else {
            return Err(unavailable("this systrap sandbox's template was spawned, not restored from a snapshot, so it has no state to reset to"));
        };
        if self.exited.is_some() {
            return Err(unavailable("the sandbox's first process has ended, and its memory with it"));
        }
        self.end_other_processes();
        let r = self.reset_memory(&origin).and_then(|dropped| {
            self.stub.load_xsave(&origin.xsave).map_err(stub_err("the XSAVE area"))?;
            self.reset_os(&origin, keep_files, ctx)?;
            Ok(dropped)
        });
        let dropped = match r {
            Ok(n) => n,
            Err(e) => {
                // Never half of the last owner's state: the sandbox is gone instead.
                // SAFETY: pidfd_send_signal on our stub's pidfd.
                unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.stub.pidfd().as_raw_fd(), libc::SIGKILL, 0usize, 0u32) };
                self.exited = Some(RunExit::Signaled { signo: libc::SIGKILL });
                return Err(e);
            }
        };
        self.regs = origin.regs;
        self.fs_base = origin.fs_base;
        self.vvar.forget();
        if let Some(c) = self.capture.as_mut() {
            // Output written before the reset belongs to no one now.
            let _ = (c.take(0), c.take(1));
        }
        Ok(ResetStats { dirty_pages: dropped, duration: start.elapsed() })
    }

    /// Kill every other guest process of the sandbox and start its process table over, as kvm's
    /// `process::kill_children` (this VMM is the top of its tree).
    fn end_other_processes(&mut self) {
        // SAFETY: getpid cannot fail.
        let top = signal::host::top() == unsafe { libc::getpid() };
        let adopted = if top { signal::host::new_generation() } else { Vec::new() };
        signal::kill_children(&mut self.os);
        self.kill_child_stubs();
        signal::kill_adopted(&adopted);
        if top {
            wait_others_gone(std::time::Duration::from_secs(2));
            signal::host::reset_process_count();
            guestos::sched::reset(self.os.proc.pid);
            guestos::proctab::reset(self.os.proc.pid);
            guestos::futex_shared::reset();
        }
        // What the ended processes signalled is the old state's.
        signal::gather(&mut self.os);
    }

    /// The stub's memory back to the template's; how many pages were dropped.
    fn reset_memory(&mut self, o: &Origin) -> Result<u64> {
        let pid = self.stub.pid();
        let now = guest_mappings(pid)?;
        let pagemap = memory::open_pagemap(pid).map_err(Error::sys("open the stub's pagemap"))?;
        // What the sandbox mapped since, outside every template mapping: unmapped.
        for m in &now {
            let mut at = m.start;
            for t in o.layout.iter().filter(|t| t.start < m.end && m.start < t.end) {
                if at < t.start {
                    self.stub.unmap(at, t.start - at).map_err(stub_err("unmap"))?;
                }
                at = at.max(t.end);
            }
            if at < m.end {
                self.stub.unmap(at, m.end - at).map_err(stub_err("unmap"))?;
            }
        }
        // Runs of pages to drop, and those of them in writable mappings, faulted in again (from
        // the file: the template's contents) for the next exec, which likely writes them too.
        let mut drop: Vec<(u64, u64)> = Vec::new();
        let mut refill: Vec<(u64, u64)> = Vec::new();
        for t in &o.layout {
            if !now.contains(t) {
                // Changed: mapped again from its files (MAP_FIXED replaces what is there).
                for p in o.pieces.iter().filter(|p| p.start < t.end && t.start < p.end) {
                    let (s, e) = (p.start.max(t.start), p.end.min(t.end));
                    let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE;
                    self.stub.map(s, e - s, p.prot, flags, Some(p.file.as_fd()), p.offset + (s - p.start)).map_err(stub_err("map"))?;
                }
                continue;
            }
            if t.prot() == 0 {
                // Nothing here is readable; whatever the sandbox wrote before protecting it goes.
                drop.push((t.start, t.end - t.start));
                continue;
            }
            // Only the pages copied on write: the file's pages keep their page-table entries.
            let pages = ((t.end - t.start) / PAGE) as usize;
            let mut i = 0;
            while i < pages {
                let n = (pages - i).min(PAGEMAP_CHUNK);
                let base = t.start + i as u64 * PAGE;
                let flags = memory::page_flags(&pagemap, base, n).map_err(Error::sys("read the stub's pagemap"))?;
                let own = |e: u64| e & memory::PAGE_OWN != 0 && e & memory::PAGE_FILE == 0;
                let mut j = 0;
                while j < n {
                    if !own(flags[j]) {
                        j += 1;
                        continue;
                    }
                    let k = (j..n).find(|&k| !own(flags[k])).unwrap_or(n);
                    let run = (base + j as u64 * PAGE, (k - j) as u64 * PAGE);
                    drop.push(run);
                    if t.prot() & libc::PROT_WRITE != 0 {
                        refill.push(run);
                    }
                    j = k;
                }
                i += n;
            }
        }
        let done = self.stub.advise_runs(&drop, libc::MADV_DONTNEED).map_err(stub_err("madvise"))?;
        if done != drop.len() {
            return Err(Error::Remote(format!("systrap: reset: the host dropped {done} of {} runs of pages", drop.len())));
        }
        // The pages this sandbox patched syscall sites in are among those dropped (a patch is a
        // copy-on-write of a private code page), those the snapshot had patched are its memory
        // file's and stay: the code is the template's again, and so are the patching state
        // and the template's trampolines (platform::systrap::patch).
        self.stub.reset_patches().map_err(stub_err("syscall sites"))?;
        if refill_enabled() {
            let _ = self.stub.advise_runs(&refill, libc::MADV_POPULATE_WRITE);
        }
        Ok(drop.iter().map(|r| r.1 / PAGE).sum())
    }

    /// The guest OS state back to the snapshot's, as kvm's reset rebuilds it.
    fn reset_os(&mut self, o: &Origin, keep_files: bool, ctx: Option<OwnedFd>) -> Result<()> {
        let stdio = self.os.stdio.take();
        let kept = if keep_files { Some(crate::vmm::current_mounts(&self.os, &o.os)?) } else { None };
        // The old files go first: on the sandbox's tmpfs, what it wrote is freed at once.
        self.os.files = Default::default();
        self.os.mm = Default::default();
        let writable_root = self.os.vfs.root_layer.is_some();
        let mut fresh = match kept {
            Some(dirs) => {
                let mut fresh = o.os.rebuild(dirs)?;
                guestos::random::diverge(&mut fresh);
                crate::guestos::persist::keep_root(&mut self.os.vfs, &mut fresh.vfs);
                fresh
            }
            None => {
                // The old root overlay goes before its upper layer is emptied.
                self.os.vfs = Default::default();
                let scratch = self.reset.scratch.clone().unwrap_or_else(crate::vmm::own_dir);
                crate::vmm::restore_os(&o.os, &o.dir, &scratch, writable_root, ctx)?
            }
        };
        fresh.stdio = stdio;
        self.os = fresh;
        signal::host::set_next_pid(self.os.proc.next_pid);
        signal::host::set_thread_count(self.os.threads.list.len().saturating_sub(1) as u32);
        let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        guestos::proctab::refresh(&self.os, &crate::platform::Memory::Host(&mut space));
        Ok(())
    }
}

/// Wait, up to `limit`, until this process has no child left but its tree's reaper: kvm's
/// `signal::wait_children_gone` for a systrap VMM, whose reaper is a child of its own (an orphan
/// re-parented here while the reset killed its parent ends itself: `host::adopted_or_die`).
/// Without `/proc/<pid>/task/<tid>/children` (a kernel built without it) it does not wait.
fn wait_others_gone(limit: std::time::Duration) {
    let end = Instant::now() + limit;
    let reaper = reaper::pid();
    loop {
        let Some(kids) = children() else { return };
        if kids.iter().all(|&k| Some(k) == reaper) || Instant::now() >= end {
            return;
        }
        // Reap what has ended meanwhile (a zombie is still listed as a child).
        signal::reap_one_ended();
        std::thread::sleep(std::time::Duration::from_millis(1));
    }
}

/// This process's children, from `/proc/self/task/<pid>/children` (the VMM's one thread makes
/// every guest fork and the reaper).
fn children() -> Option<Vec<i32>> {
    use std::os::fd::FromRawFd;
    let proc = memory::proc_dir().ok()?;
    // SAFETY: getpid cannot fail.
    let path = std::ffi::CString::new(format!("self/task/{}/children", unsafe { libc::getpid() })).ok()?;
    // SAFETY: `proc` is an open directory fd, `path` is NUL-terminated; the fd is owned below.
    let fd = unsafe { libc::openat(proc.as_raw_fd(), path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return None;
    }
    // SAFETY: just opened, owned by nobody else.
    let text = std::io::read_to_string(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) })).ok()?;
    Some(text.split_whitespace().filter_map(|p| p.parse::<i32>().ok()).collect())
}
