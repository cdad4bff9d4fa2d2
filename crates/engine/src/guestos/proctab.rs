//! The sandbox's process table: what `/proc/<pid>` shows of the sandbox's other processes.
//!
//! Every guest process is a VMM process of its own, so what `ps` reads about a process (its ids,
//! parent, group, start time, memory, name, command line, environment, directory, program) is in
//! that process's memory only. Each process therefore publishes those facts in its own entry of a
//! table that every VMM process of the sandbox maps (a shared mapping made with the sandbox's
//! process tree, inherited by every fork, never the host's `/proc`): at its start (the fork), at
//! execve, and after the calls that change what it shows (chdir, fchdir, the set*id calls, prctl,
//! setpgid, setsid, setpriority, clone; brk, mmap, munmap and mremap update the memory figures
//! only). A process writes only its own entry; a reader copies an entry under its sequence count
//! (odd while the owner writes). Which processes exist is the scheduler's roster
//! (`sched::processes`): an entry left by a process that is gone is not shown, and is reused.
//!
//! Replay: a process publishes in its own turn and a reader reads in its own, and every value is
//! the guest's (guest pids, the virtual clock's start times, the guest memory's page counts), so
//! with turn-taking what `ps` prints depends only on the turns, which replay reproduces.
//!
//! Bounds: a command line or environment longer than [`ARGS_MAX`] bytes, or a directory or program
//! path longer than [`PATH_MAX`], shows its first bytes only (the process's own `/proc/self` files
//! are read from its memory and have no such bound).

use std::sync::atomic::{AtomicU32, AtomicU64, AtomicU8, AtomicUsize, Ordering};

use super::GuestOs;
use crate::platform::Memory;

/// Entries: one per live process (the scheduler's slots).
const ENTRIES: usize = super::sched::SLOTS;
/// Bytes kept of a command line, and of an environment.
pub const ARGS_MAX: usize = 4096;
/// Bytes kept of the working directory, and of the program path.
pub const PATH_MAX: usize = 1024;

// The numbers of an entry.
const PPID: usize = 0;
const PGID: usize = 1;
const SID: usize = 2;
const UID: usize = 3; // 4 words: real, effective, saved, file system
const GID: usize = 7; // 4 words
const STARTED: usize = 11;
const VSIZE: usize = 12;
const RSS: usize = 13;
const THREADS: usize = 14;
const NICE: usize = 15;
const UMASK: usize = 16;
const NUMS: usize = 17;

// The texts of an entry, each with its own length word.
const CMDLINE: usize = 0;
const ENVIRON: usize = 1;
const CWD: usize = 2;
const EXE: usize = 3;
const COMM: usize = 4;
const TEXTS: usize = 5;
const TEXT_AT: [usize; TEXTS] = [0, ARGS_MAX, 2 * ARGS_MAX, 2 * ARGS_MAX + PATH_MAX, 2 * ARGS_MAX + 2 * PATH_MAX];
const TEXT_MAX: [usize; TEXTS] = [ARGS_MAX, ARGS_MAX, PATH_MAX, PATH_MAX, 16];
const TEXT_BYTES: usize = 2 * ARGS_MAX + 2 * PATH_MAX + 16;

#[repr(C)]
struct Entry {
    /// Odd while the owner writes.
    seq: AtomicU32,
    nums: [AtomicU64; NUMS],
    lens: [AtomicU32; TEXTS],
    text: [AtomicU8; TEXT_BYTES],
}

#[repr(C)]
struct Table {
    /// Each entry's owner, a guest pid (0: free), kept apart from the entries so that finding
    /// one reads one page: a forked process has none of the shared table mapped yet, and every
    /// page it touches first is a fault (with the owners inside the 10 KiB entries, a new
    /// process's first publish touched a page per entry, 256 faults).
    owners: [AtomicU32; ENTRIES],
    entries: [Entry; ENTRIES],
}

const TABLE_BYTES: usize = std::mem::size_of::<Table>().div_ceil(4096) * 4096;

static TABLE: std::sync::atomic::AtomicPtr<Table> = std::sync::atomic::AtomicPtr::new(std::ptr::null_mut());
/// The index of this process's entry (usize::MAX: none claimed yet).
static MINE: AtomicUsize = AtomicUsize::new(usize::MAX);

fn table() -> Option<&'static Table> {
    let p = TABLE.load(Ordering::Acquire);
    // SAFETY: set by `new_tree` to a shared mapping of a whole `Table` that is never unmapped;
    // every field is an atomic, for which all-zero bytes are a valid value.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// A new sandbox tree (its first process): a table of its own, inherited by the processes it
/// forks (a table from the tree this process was forked from is not its own).
pub fn new_tree() {
    // SAFETY: a new anonymous shared mapping; nothing else refers to it yet.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), TABLE_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
    };
    if p != libc::MAP_FAILED {
        TABLE.store(p.cast(), Ordering::Release);
    }
    MINE.store(usize::MAX, Ordering::SeqCst);
}

/// In a new guest child process: its entry is still to be claimed (the parent's is the parent's).
pub fn child_started() {
    MINE.store(usize::MAX, Ordering::SeqCst);
}

/// The sandbox is back to its first process (guest pid `pid`) alone: every other entry is free.
pub fn reset(pid: i32) {
    let Some(t) = table() else { return };
    for o in t.owners.iter().filter(|o| o.load(Ordering::SeqCst) != pid as u32) {
        o.store(0, Ordering::SeqCst);
    }
}

/// This process (guest pid `pid`) is done: its entry is free.
pub fn leave(pid: i32) {
    if let Some(o) = table().and_then(|t| t.owners.get(MINE.swap(usize::MAX, Ordering::SeqCst))) {
        let _ = o.compare_exchange(pid as u32, 0, Ordering::SeqCst, Ordering::SeqCst);
    }
}

/// The guest pids of the sandbox's live processes, `me` among them, in order.
pub fn pids(me: i32) -> Vec<i32> {
    let mut v: Vec<i32> = super::sched::processes().iter().map(|p| p.pid).collect();
    v.push(me);
    v.sort_unstable();
    v.dedup();
    v
}

/// This process's entry: the one it has, else a free one, else one a process that is gone left.
fn own_entry(t: &'static Table, pid: u32) -> Option<&'static Entry> {
    let mine = MINE.load(Ordering::Relaxed);
    if t.owners.get(mine).is_some_and(|o| o.load(Ordering::SeqCst) == pid) {
        return Some(&t.entries[mine]);
    }
    let claim = |i: usize, old: u32| {
        t.owners[i].compare_exchange(old, pid, Ordering::SeqCst, Ordering::SeqCst).is_ok().then(|| {
            MINE.store(i, Ordering::SeqCst);
            &t.entries[i]
        })
    };
    if let Some(i) = t.owners.iter().position(|o| o.load(Ordering::SeqCst) == pid) {
        MINE.store(i, Ordering::SeqCst);
        return Some(&t.entries[i]);
    }
    if let Some(e) = (0..ENTRIES).find_map(|i| (t.owners[i].load(Ordering::SeqCst) == 0).then(|| claim(i, 0)).flatten()) {
        return Some(e);
    }
    let live = pids(pid as i32);
    (0..ENTRIES).find_map(|i| {
        let old = t.owners[i].load(Ordering::SeqCst);
        (!live.contains(&(old as i32))).then(|| claim(i, old)).flatten()
    })
}

/// What `/proc/<pid>` shows of one process.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Facts {
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    pub uid: [u32; 4],
    pub gid: [u32; 4],
    /// When it started, on the guest's CLOCK_MONOTONIC (ns).
    pub started_ns: u64,
    /// Its mappings' total size and its resident memory (bytes).
    pub vsize: u64,
    pub rss: u64,
    pub threads: u32,
    pub nice: i32,
    pub umask: u32,
    /// NUL-separated, as `/proc/<pid>/cmdline` and `environ` show them.
    pub cmdline: Vec<u8>,
    pub environ: Vec<u8>,
    pub cwd: String,
    pub exe: String,
    pub comm: String,
}

/// This process's memory figures: the total size of its mappings, and the guest memory it uses
/// (the frames handed out and not given back), never more than the former.
pub fn memory(os: &GuestOs, mem: &Memory) -> (u64, u64) {
    let vsize: u64 = os.mm.vmas.iter().map(|(start, v)| v.end - start).sum();
    (vsize, mem.used(vsize))
}

/// This process's facts: from its state, and its command line and environment from its memory
/// (where execve laid them out, `Proc::args_area`, as Linux reads them: a program that rewrites its
/// argv shows the new text).
pub fn own_facts(os: &GuestOs, mem: &Memory, args: bool) -> Facts {
    let p = &os.proc;
    let (vsize, rss) = memory(os, mem);
    let (cmdline, environ) = if args { (args_text(os, mem, 0, usize::MAX), args_text(os, mem, 1, usize::MAX)) } else { Default::default() };
    Facts {
        pid: p.pid,
        ppid: p.ppid,
        pgid: p.pgid,
        sid: p.sid,
        uid: p.uid,
        gid: p.gid,
        started_ns: p.started(),
        vsize,
        rss,
        threads: os.threads.list.len().max(1) as u32,
        nice: p.nice,
        umask: p.umask,
        cmdline,
        environ,
        cwd: if p.cwd.is_empty() { "/".into() } else { p.cwd.clone() },
        exe: p.exe.clone(),
        comm: p.comm_name(),
    }
}

/// This process's command line (`which` 0) or environment (1), at most `max` bytes, read from its
/// memory; empty where there is none (no execve recorded one) or it is not readable.
pub fn args_text(os: &GuestOs, mem: &Memory, which: usize, max: usize) -> Vec<u8> {
    let [a, b, c] = os.proc.args_area;
    let (start, end) = if which == 0 { (a, b) } else { (b, c) };
    let len = (end.saturating_sub(start) as usize).min(max).min(1 << 20);
    let mut buf = vec![0u8; len];
    let read = match mem {
        Memory::Kvm(k) => super::mm::read_user(&os.mm.lazy_areas(), k.mem, k.aspace, start, &mut buf),
        Memory::Host(h) => h.read(start, &mut buf),
    };
    match read {
        Ok(()) => buf,
        Err(_) => Vec::new(),
    }
}

/// Publish this process's facts. `args`: its command line and environment when they changed
/// (execve, its start), else the entry keeps those it has.
pub fn publish(f: &Facts, args: bool) {
    let Some(t) = table() else { return };
    let Some(e) = own_entry(t, f.pid as u32) else { return };
    e.seq.fetch_add(1, Ordering::SeqCst);
    let nums: [(usize, u64); 9] = [
        (PPID, f.ppid as u64),
        (PGID, f.pgid as u64),
        (SID, f.sid as u64),
        (STARTED, f.started_ns),
        (VSIZE, f.vsize),
        (RSS, f.rss),
        (THREADS, f.threads as u64),
        (NICE, f.nice as i64 as u64),
        (UMASK, f.umask as u64),
    ];
    for (i, v) in nums {
        e.nums[i].store(v, Ordering::Relaxed);
    }
    for k in 0..4 {
        e.nums[UID + k].store(f.uid[k] as u64, Ordering::Relaxed);
        e.nums[GID + k].store(f.gid[k] as u64, Ordering::Relaxed);
    }
    put_text(e, CWD, f.cwd.as_bytes());
    put_text(e, EXE, f.exe.as_bytes());
    put_text(e, COMM, f.comm.as_bytes());
    if args {
        put_text(e, CMDLINE, &f.cmdline);
        put_text(e, ENVIRON, &f.environ);
    }
    e.seq.fetch_add(1, Ordering::SeqCst);
}

/// Publish this process's facts after a call that changed them, or at its start: with its
/// command line and environment the first time (an entry of its own is still to be made).
pub fn refresh(os: &GuestOs, mem: &Memory) {
    let Some(t) = table() else { return };
    let first = t.owners.get(MINE.load(Ordering::Relaxed)).is_none_or(|o| o.load(Ordering::SeqCst) != os.proc.pid as u32);
    publish(&own_facts(os, mem, first), first);
}

/// Update this process's memory figures only (after brk, mmap, munmap, mremap).
pub fn publish_memory(pid: i32, vsize: u64, rss: u64) {
    let Some(t) = table() else { return };
    let mine = MINE.load(Ordering::Relaxed);
    if t.owners.get(mine).is_none_or(|o| o.load(Ordering::Relaxed) != pid as u32) {
        return;
    }
    let e = &t.entries[mine];
    e.seq.fetch_add(1, Ordering::SeqCst);
    e.nums[VSIZE].store(vsize, Ordering::Relaxed);
    e.nums[RSS].store(rss, Ordering::Relaxed);
    e.seq.fetch_add(1, Ordering::SeqCst);
}

fn put_text(e: &Entry, k: usize, s: &[u8]) {
    let n = s.len().min(TEXT_MAX[k]);
    for (slot, b) in e.text[TEXT_AT[k]..TEXT_AT[k] + n].iter().zip(s) {
        slot.store(*b, Ordering::Relaxed);
    }
    e.lens[k].store(n as u32, Ordering::Relaxed);
}

fn get_text(e: &Entry, k: usize) -> Vec<u8> {
    let n = (e.lens[k].load(Ordering::Relaxed) as usize).min(TEXT_MAX[k]);
    e.text[TEXT_AT[k]..TEXT_AT[k] + n].iter().map(|b| b.load(Ordering::Relaxed)).collect()
}

/// The facts process `pid` (another live process of the sandbox) last published.
pub fn read(pid: i32) -> Option<Facts> {
    let live = super::sched::processes();
    if pid <= 0 || !live.iter().any(|p| p.pid == pid) {
        return None;
    }
    // A parent that is gone has handed its children to the first process, as Linux does at the
    // parent's exit; the orphan republishes its parent only when it next runs (`signal::gather`),
    // which a process parked in a long sleep may not do for a while.
    let parent = |ppid: i32| if ppid > 1 && !live.iter().any(|p| p.pid == ppid) { 1 } else { ppid };
    let t = table()?;
    let i = t.owners.iter().position(|o| o.load(Ordering::SeqCst) == pid as u32)?;
    let (e, owner) = (&t.entries[i], &t.owners[i]);
    // The owner writes a few kilobytes at most: a reader that keeps meeting a write gives up
    // after a bounded number of tries (and shows what it copied last).
    let mut f = Facts::default();
    for _ in 0..1000 {
        let s1 = e.seq.load(Ordering::SeqCst);
        if s1 & 1 == 1 {
            std::hint::spin_loop();
            continue;
        }
        let n = |i: usize| e.nums[i].load(Ordering::Relaxed);
        let text = |k: usize| String::from_utf8_lossy(&get_text(e, k)).into_owned();
        f = Facts {
            pid,
            ppid: parent(n(PPID) as i32),
            pgid: n(PGID) as i32,
            sid: n(SID) as i32,
            uid: [n(UID) as u32, n(UID + 1) as u32, n(UID + 2) as u32, n(UID + 3) as u32],
            gid: [n(GID) as u32, n(GID + 1) as u32, n(GID + 2) as u32, n(GID + 3) as u32],
            started_ns: n(STARTED),
            vsize: n(VSIZE),
            rss: n(RSS),
            threads: n(THREADS) as u32,
            nice: n(NICE) as i64 as i32,
            umask: n(UMASK) as u32,
            cmdline: get_text(e, CMDLINE),
            environ: get_text(e, ENVIRON),
            cwd: text(CWD),
            exe: text(EXE),
            comm: text(COMM),
        };
        if e.seq.load(Ordering::SeqCst) == s1 && owner.load(Ordering::SeqCst) == pid as u32 {
            return Some(f);
        }
    }
    (owner.load(Ordering::SeqCst) == pid as u32).then_some(f)
}

/// Whether a completed call `nr` may have changed what this process's entry shows: 1 for the
/// facts, 2 for the memory figures only, 0 for neither.
pub fn changed_by(nr: u64) -> u8 {
    match nr {
        // chdir, fchdir, setuid, setgid, setpgid, setsid, setreuid, setregid, setgroups, setresuid,
        // setresgid, setfsuid, setfsgid, setpriority, prctl, clone, clone3
        80 | 81 | 105 | 106 | 109 | 112 | 113 | 114 | 116 | 117 | 119 | 122 | 123 | 141 | 157 | 56 | 435 => 1,
        // mmap, munmap, brk, mremap
        9 | 11 | 12 | 25 => 2,
        _ => 0,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The tests that make a table of their own (the module's one table and MINE) run one at a time.
    static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

    /// The first process of a new tree (a sandbox's, or a clone's), and then a process it forks,
    /// each take an entry without reading the rest of the table: in a new shared mapping, and in a
    /// forked process's copy of it, every page read first is a page fault (with the owners inside
    /// the entries, a clone's start and every guest fork paid 256 of them). Counted as the table's
    /// resident pages.
    #[test]
    fn a_process_claims_its_entry_without_touching_the_table() {
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        new_tree();
        let resident = || {
            let t = TABLE.load(Ordering::Acquire);
            let mut vec = vec![0u8; TABLE_BYTES / 4096];
            // SAFETY: the table's own mapping, page aligned, TABLE_BYTES long; vec has a byte per page.
            assert_eq!(unsafe { libc::mincore(t.cast(), TABLE_BYTES, vec.as_mut_ptr()) }, 0);
            vec.iter().filter(|b| *b & 1 == 1).count()
        };
        publish(&Facts { pid: 1, cmdline: b"python3".to_vec(), ..Default::default() }, true);
        let first = resident();
        assert!(first <= 4, "{first} of the table's {} pages were touched to claim one entry", TABLE_BYTES / 4096);
        child_started();
        publish(&Facts { pid: 2, cmdline: b"sh".to_vec(), ..Default::default() }, true);
        let second = resident();
        assert!(second <= first + 4, "{} more pages were touched to claim a second entry", second - first);
        let t = table().unwrap();
        assert_eq!((t.owners[0].load(Ordering::SeqCst), t.owners[1].load(Ordering::SeqCst)), (1, 2));
    }

    #[test]
    fn texts_are_laid_out_without_overlap() {
        for k in 1..TEXTS {
            assert_eq!(TEXT_AT[k], TEXT_AT[k - 1] + TEXT_MAX[k - 1]);
        }
        assert_eq!(TEXT_AT[TEXTS - 1] + TEXT_MAX[TEXTS - 1], TEXT_BYTES);
        assert_eq!(changed_by(80), 1);
        assert_eq!(changed_by(9), 2);
        assert_eq!(changed_by(0), 0);
    }

    /// A new process (a fork, as every guest child is) claims its entry reading the owners' page:
    /// it touches a few pages of the table, not the pages of all 256 entries' pid words (each a
    /// host page fault in a new process, in runs of 16 the host maps around a fault: 43 faults with
    /// the owners inside the entries, 4 now; 0.2 ms of every spawn). Counted as the table's pages
    /// the child's page tables map after its claim (`/proc/self/pagemap`; a forked process maps
    /// none of a shared mapping until it touches it), not as the child's page faults, which also
    /// count its code pages that the host took back meanwhile (a host that pages out cold memory,
    /// as DAMON's `pageout` does: 23 faults there where the table took 4).
    #[test]
    fn a_new_process_claims_its_entry_without_reading_every_entry() {
        const PAGES: usize = TABLE_BYTES / 4096;
        let _serial = SERIAL.lock().unwrap_or_else(|e| e.into_inner());
        new_tree();
        publish(&Facts { pid: 7, ..Default::default() }, true);
        let child = Facts { pid: 9, cwd: "/".into(), ..Default::default() };
        let mut fds = [0; 2];
        // SAFETY: a pipe of two fds; fork's child only reads its pagemap into a stack array,
        // publishes (no allocation on the path the claim takes), writes two words and leaves with
        // _exit.
        unsafe {
            assert_eq!(libc::pipe(fds.as_mut_ptr()), 0);
            let pid = libc::fork();
            if pid == 0 {
                child_started();
                let mapped = || {
                    let t = TABLE.load(Ordering::Acquire) as usize;
                    let fd = libc::open(c"/proc/self/pagemap".as_ptr(), libc::O_RDONLY);
                    let mut e = [0u64; PAGES];
                    let n = libc::pread(fd, e.as_mut_ptr().cast(), PAGES * 8, (t / 4096 * 8) as libc::off_t);
                    libc::close(fd);
                    if n != (PAGES * 8) as isize {
                        return u64::MAX;
                    }
                    e.iter().filter(|&&x| x >> 63 == 1).count() as u64
                };
                let before = mapped();
                publish(&child, true);
                let after = mapped();
                libc::write(fds[1], [before, after].as_ptr().cast(), 16);
                libc::_exit(0);
            }
            let mut got = [0u64; 2];
            assert_eq!(libc::read(fds[0], got.as_mut_ptr().cast(), 16), 16);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
            libc::close(fds[0]);
            libc::close(fds[1]);
            let [before, after] = got;
            assert!(before != u64::MAX && after != u64::MAX, "the child could not read its pagemap");
            // A few faults, each mapping up to 16 pages around it; every entry's pid word would
            // be all of the table's pages.
            assert!(after - before <= 4 * 16 && after - before < PAGES as u64 / 2, "the child's claim mapped {} of the table's {PAGES} pages", after - before);
        }
    }
}
