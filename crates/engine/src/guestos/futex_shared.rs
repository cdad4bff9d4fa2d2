//! Futexes on shared pages: waits that other guest processes of the sandbox wake.
//!
//! A futex word in a shared mapping (a window, see `vstate::shared`) is named, as on Linux, by the
//! file it lies in and its offset there: the host file's (device, inode) and the byte offset. Every
//! process mapping that file (or, for shared anonymous memory, inheriting that memfd) computes
//! the same key wherever the word is in its address space. Each guest process is its own VMM
//! process, so a wait is a record in a table all the sandbox's VMM processes map ([`Table`], a
//! shared anonymous mapping made with the sandbox's process tree and inherited by every guest
//! fork, like `sched`'s region): the waiter files a record (key, bitset, order of arrival), checks
//! the word, and waits; a waker marks up to `n` matching records woken, oldest first, and wakes
//! them with a host FUTEX_WAKE on the record's state word.
//!
//! The hook: the guest's futex call (`thread::futex`; `futex.rs` once private futexes move
//! there) first asks [`futex`] here, which answers only for a non-private futex whose word lies
//! in a shared mapping of a sandbox that has other processes; for everything else it returns
//! `None` and the private path goes on as before (a FUTEX_PRIVATE_FLAG futex never crosses
//! processes on Linux either: it is keyed by the address space).
//!
//! Blocking, and replay. Outside replay mode the waiter waits on the host in slices
//! ([`signal::WAIT_SLICE_MS`]) and restarts its call in between (so that signals, the run's
//! deadline and the preemption of the run get through), keeping its record and its deadline
//! across the restarts. In replay mode the sandbox's processes take turns (`sched`): a waiter
//! must not keep the turn, so it files its record and yields as blocked, with its timeout as a
//! deadline in virtual time; when the turn comes back it looks at its record (woken: 0; deadline
//! reached: ETIMEDOUT; else yield again). Wakers run only while holding the turn, so which
//! records exist, their order and who wakes which are all functions of the turn order, which
//! replay reproduces; a timed wait that nobody wakes ends when the tree's virtual time reaches
//! its deadline (`sched`'s jump to the earliest deadline when every process waits).
//!
//! With threads (the M:1 scheduler, `vmm::threads`): a thread's shared wait never waits on the
//! host while other threads of its process exist; it yields to them (`sched::yield_blocked`) and
//! polls its record when its turn comes back, so a sibling thread can be the one that wakes it.
//! The wait in progress ([`PENDING`]) is still one per process: when two threads of a process
//! wait on shared words at once, the later one frees the earlier one's record, which then files
//! again on its retry and finds the word changed if a wake came meanwhile (EAGAIN, a spurious
//! wake-up that glibc's callers retry, as Linux allows).
//!
//! Limits: [`RECORDS`] waits at once in a sandbox (one per process today; threads may add
//! more). A full table first reclaims the records of processes that died without leaving; if
//! still full the wait answers EAGAIN (glibc then looks at the word again and retries). PI
//! futexes are not offered on shared pages either (ENOSYS).

use std::sync::atomic::{AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::time::Duration;

use super::process::Proc;
use super::signal::ERESTARTSYS;
use super::{Ctx, Errno, SysResult, EAGAIN, EINVAL, ENOSYS};

const ETIMEDOUT: Errno = Errno(110);

/// Waits at once in one sandbox.
pub const RECORDS: usize = 1024;

const FUTEX_WAIT: u64 = 0;
const FUTEX_WAKE: u64 = 1;
const FUTEX_REQUEUE: u64 = 3;
const FUTEX_CMP_REQUEUE: u64 = 4;
const FUTEX_WAKE_OP: u64 = 5;
const FUTEX_WAIT_BITSET: u64 = 9;
const FUTEX_WAKE_BITSET: u64 = 10;
const FUTEX_PRIVATE_FLAG: u64 = 128;

const FREE: u32 = 0;
const WAITING: u32 = 1;
const WOKEN: u32 = 2;

/// One wait.
#[repr(C)]
struct Record {
    /// FREE, WAITING or WOKEN; the waiter sleeps on the host on this word.
    state: AtomicU32,
    bitset: AtomicU32,
    dev: AtomicU64,
    ino: AtomicU64,
    off: AtomicU64,
    /// Order of arrival (the table's counter when it was filed): wakes go oldest first.
    seq: AtomicU64,
    /// The waiter's host pid (a record whose process died is reclaimed).
    host: AtomicI32,
    _pad: u32,
}

/// The sandbox's table of waits, in memory every VMM process of the sandbox shares.
#[repr(C)]
struct Table {
    /// Held while records are filed, woken, requeued or freed (a few hundred instructions).
    lock: AtomicU32,
    _pad: u32,
    next_seq: AtomicU64,
    records: [Record; RECORDS],
}

const TABLE_BYTES: usize = std::mem::size_of::<Table>().div_ceil(4096) * 4096;

static TABLE: AtomicPtr<Table> = AtomicPtr::new(std::ptr::null_mut());

fn table() -> Option<&'static Table> {
    let p = TABLE.load(Ordering::Acquire);
    // SAFETY: set by `new_tree` to a shared mapping of TABLE_BYTES that is never unmapped (a newer
    // tree's replaces the pointer; the old mapping stays, unused).
    (!p.is_null()).then(|| unsafe { &*p })
}

/// The word a futex call names: the host file and offset behind its page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Key {
    pub dev: u64,
    pub ino: u64,
    pub off: u64,
}

/// The wait this process has filed and is blocked in (its call restarts until it ends).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Pending {
    record: usize,
    /// The call: return address, futex address and command.
    rip: u64,
    uaddr: u64,
    op: u64,
    /// When the wait times out: host monotonic ns outside replay, virtual ns in replay.
    deadline: Option<u64>,
}

static PENDING: std::sync::Mutex<Option<Pending>> = std::sync::Mutex::new(None);

/// A new sandbox process tree (its first process): a table of its own, inherited by the
/// processes it forks. Called beside `sched::new_tree`.
pub fn new_tree() {
    // SAFETY: a new anonymous shared mapping; nothing else refers to it yet.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), TABLE_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
    };
    if p != libc::MAP_FAILED {
        TABLE.store(p.cast(), Ordering::Release);
    }
    forget_pending();
}

/// The sandbox is back to its first process (a reset): no wait survives.
pub fn reset() {
    if let Some(t) = table() {
        with_lock(t, || t.records.iter().for_each(|r| r.state.store(FREE, Ordering::SeqCst)));
    }
    forget_pending();
}

/// In a new guest child process: the parent's wait is not its own.
pub fn child_started() {
    forget_pending();
}

/// This process is done: its waits go.
pub fn leave() {
    if let Ok(mut p) = PENDING.lock() {
        if let (Some(t), Some(w)) = (table(), p.take()) {
            free(t, w.record);
        }
    }
}

fn forget_pending() {
    if let Ok(mut p) = PENDING.lock() {
        *p = None;
    }
}

fn with_lock<T>(t: &Table, f: impl FnOnce() -> T) -> T {
    // As in `sched`: a holder killed inside (a host SIGKILL) would never let go, so after about
    // a million tries the lock is taken over.
    let mut tries = 0u32;
    while t.lock.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
        tries += 1;
        if tries > 1 << 20 {
            break;
        }
        std::hint::spin_loop();
    }
    let v = f();
    t.lock.store(0, Ordering::Release);
    v
}

fn free(t: &Table, i: usize) {
    with_lock(t, || t.records[i].state.store(FREE, Ordering::SeqCst));
}

/// The key of the futex word at guest address `uaddr`, if it lies in a shared mapping.
fn key_of(ctx: &Ctx, uaddr: u64) -> Option<Key> {
    // Shared mappings are windows of the kvm platform only so far.
    let crate::platform::Memory::Kvm(k) = &ctx.memory else { return None };
    let pa = match k.aspace.translate(k.mem, uaddr) {
        Ok((pa, _)) => pa,
        // Not present yet (a lazy shared mapping): its VMA says where the page is in the window.
        Err(_) => {
            let area = ctx.lazy.iter().find(|a| (a.start..a.end).contains(&uaddr))?;
            area.window? + (uaddr - area.start)
        }
    };
    let w = k.mem.windows.find(pa)?;
    Some(Key { dev: w.key.0, ino: w.key.1, off: w.offset + (pa - w.gpa) })
}

/// How the futex call reads its wait's timeout (see [`futex`]).
pub type TimeoutFn<'a> = dyn Fn(&mut Proc, &Ctx) -> Result<Option<u64>, Errno> + 'a;

/// The guest's futex(2), for words in shared mappings; `None`: not one of those (the private
/// path serves it). `timeout` gives the wait's timeout as ns from now (host time outside replay,
/// virtual time in replay), `None` for none.
pub fn futex(
    p: &mut Proc,
    ctx: &mut Ctx,
    a: [u64; 6],
    timeout: &TimeoutFn<'_>,
) -> Option<SysResult> {
    let (uaddr, op, val, uaddr2, val3) = (a[0], a[1], a[2] as u32, a[4], a[5] as u32);
    let cmd = op & 0x7f;
    if op & FUTEX_PRIVATE_FLAG != 0 || super::signal::host::alone() {
        return None;
    }
    let t = table()?;
    let key = key_of(ctx, uaddr)?;
    Some(match cmd {
        FUTEX_WAIT | FUTEX_WAIT_BITSET => {
            let bitset = if cmd == FUTEX_WAIT { u32::MAX } else { val3 };
            if bitset == 0 {
                return Some(Err(EINVAL));
            }
            wait(t, p, ctx, key, uaddr, op, val, bitset, timeout)
        }
        FUTEX_WAKE | FUTEX_WAKE_BITSET => {
            let bitset = if cmd == FUTEX_WAKE { u32::MAX } else { val3 };
            if bitset == 0 {
                return Some(Err(EINVAL));
            }
            Ok(wake(t, key, val, bitset) as u64)
        }
        FUTEX_REQUEUE | FUTEX_CMP_REQUEUE => {
            let to = if uaddr2 % 4 != 0 { None } else { key_of(ctx, uaddr2) };
            let Some(to) = to else { return Some(Err(EINVAL)) };
            if cmd == FUTEX_CMP_REQUEUE {
                match read_u32(ctx, uaddr) {
                    Ok(v) if v != val3 => return Some(Err(EAGAIN)),
                    Ok(_) => {}
                    Err(e) => return Some(Err(e)),
                }
            }
            // The count to requeue comes in the timeout argument's place.
            Ok(requeue(t, key, to, val, a[3] as u32) as u64)
        }
        FUTEX_WAKE_OP => {
            if uaddr2 % 4 != 0 {
                return Some(Err(EINVAL));
            }
            let old = match apply_op(ctx, uaddr2, val3) {
                Ok(old) => old,
                Err(e) => return Some(Err(e)),
            };
            let mut n = wake(t, key, val, u32::MAX);
            if op_holds(val3, old) {
                if let Some(k2) = key_of(ctx, uaddr2) {
                    n += wake(t, k2, a[3] as u32, u32::MAX);
                }
            }
            Ok(n as u64)
        }
        _ => Err(ENOSYS),
    })
}

fn read_u32(ctx: &Ctx, va: u64) -> Result<u32, Errno> {
    let mut b = [0u8; 4];
    ctx.read(va, &mut b)?;
    Ok(u32::from_le_bytes(b))
}

/// FUTEX_WAKE_OP's operation on *uaddr2; returns the old value.
fn apply_op(ctx: &mut Ctx, uaddr2: u64, val3: u32) -> Result<u32, Errno> {
    let mut arg = (val3 >> 12) & 0xfff;
    if (val3 >> 28) & 8 != 0 {
        arg = 1u32.checked_shl(arg).unwrap_or(0);
    }
    let old = read_u32(ctx, uaddr2)?;
    let new = match (val3 >> 28) & 7 {
        0 => arg,
        1 => old.wrapping_add(arg),
        2 => old | arg,
        3 => old & !arg,
        4 => old ^ arg,
        _ => return Err(ENOSYS),
    };
    ctx.write(uaddr2, &new.to_le_bytes())?;
    Ok(old)
}

/// FUTEX_WAKE_OP's comparison of the old value.
fn op_holds(val3: u32, old: u32) -> bool {
    let arg = val3 & 0xfff;
    match (val3 >> 24) & 0xf {
        0 => old == arg,
        1 => old != arg,
        2 => old < arg,
        3 => old <= arg,
        4 => old > arg,
        5 => old >= arg,
        _ => false,
    }
}

#[allow(clippy::too_many_arguments)]
fn wait(
    t: &Table,
    p: &mut Proc,
    ctx: &mut Ctx,
    key: Key,
    uaddr: u64,
    op: u64,
    val: u32,
    bitset: u32,
    timeout: &TimeoutFn<'_>,
) -> SysResult {
    let replay = p.clocks.replay && super::sched::active();
    let now = |p: &Proc| if replay { p.clocks.mono_now() } else { super::clock::monotonic_ns() };
    let this = |w: &Pending| w.rip == ctx.regs.rip && w.uaddr == uaddr && w.op == op;
    let earlier = PENDING.lock().ok().and_then(|mut g| g.take());
    let pending = match earlier {
        Some(w) if this(&w) && t.records[w.record].state.load(Ordering::SeqCst) != FREE => w,
        other => {
            // Another call (a signal handler's) left its wait: it ended there.
            if let Some(w) = other {
                free(t, w.record);
            }
            let rel = timeout(p, ctx)?;
            let Some(record) = file(t, key, bitset) else { return Err(EAGAIN) };
            // Filed before the word is read: a waker that changes it after this read finds us.
            match read_u32(ctx, uaddr) {
                Ok(v) if v == val => {}
                Ok(_) => {
                    free(t, record);
                    return Err(EAGAIN);
                }
                Err(e) => {
                    free(t, record);
                    return Err(e);
                }
            }
            let start = now(p);
            let deadline = rel.map(|r| if replay { super::sched::deadline(start, r) } else { start.saturating_add(r) });
            Pending { record, rip: ctx.regs.rip, uaddr, op, deadline }
        }
    };
    let r = &t.records[pending.record];
    if r.state.load(Ordering::SeqCst) == WOKEN {
        free(t, pending.record);
        return Ok(0);
    }
    let timed_out = |at: u64| pending.deadline.is_some_and(|d| at >= d);
    if timed_out(now(p)) {
        // Woken in between after all: the wake counted us, so it is a wake.
        let woken = with_lock(t, || r.state.swap(FREE, Ordering::SeqCst) == WOKEN);
        return if woken { Ok(0) } else { Err(ETIMEDOUT) };
    }
    // Taking turns (the tree's in replay mode, or this process's threads': its other threads run
    // meanwhile, and may be the ones to wake it): pass the turn on, blocked until the deadline;
    // retried when it comes back. The deadline is on the clock the turns keep (virtual in replay
    // mode, the host's otherwise), which is `now`'s.
    let yielded = super::sched::active() && super::sched::yield_blocked(pending.deadline);
    if !yielded {
        let slice = Duration::from_millis(super::signal::WAIT_SLICE_MS as u64);
        let left = pending.deadline.map_or(slice, |d| Duration::from_nanos(d.saturating_sub(now(p))).min(slice));
        host_wait(&r.state, WAITING, left);
        if r.state.load(Ordering::SeqCst) == WOKEN {
            free(t, pending.record);
            return Ok(0);
        }
        if timed_out(now(p)) {
            let woken = with_lock(t, || r.state.swap(FREE, Ordering::SeqCst) == WOKEN);
            return if woken { Ok(0) } else { Err(ETIMEDOUT) };
        }
    }
    if let Ok(mut g) = PENDING.lock() {
        *g = Some(pending);
    }
    Err(ERESTARTSYS)
}

/// File a wait for `key`; `None` if the table is full even after reclaiming dead processes' records.
fn file(t: &Table, key: Key, bitset: u32) -> Option<usize> {
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    let take = |t: &Table| {
        with_lock(t, || {
            let i = t.records.iter().position(|r| r.state.load(Ordering::SeqCst) == FREE)?;
            let r = &t.records[i];
            r.bitset.store(bitset, Ordering::SeqCst);
            r.dev.store(key.dev, Ordering::SeqCst);
            r.ino.store(key.ino, Ordering::SeqCst);
            r.off.store(key.off, Ordering::SeqCst);
            r.seq.store(t.next_seq.fetch_add(1, Ordering::SeqCst), Ordering::SeqCst);
            r.host.store(me, Ordering::SeqCst);
            r.state.store(WAITING, Ordering::SeqCst);
            Some(i)
        })
    };
    take(t).or_else(|| {
        let owners: Vec<(usize, i32)> =
            t.records.iter().enumerate().filter(|(_, r)| r.state.load(Ordering::SeqCst) != FREE).map(|(i, r)| (i, r.host.load(Ordering::SeqCst))).collect();
        for (i, host) in owners {
            if !alive(host) {
                free(t, i);
            }
        }
        take(t)
    })
}

fn matches(r: &Record, key: Key) -> bool {
    r.dev.load(Ordering::SeqCst) == key.dev && r.ino.load(Ordering::SeqCst) == key.ino && r.off.load(Ordering::SeqCst) == key.off
}

/// The waiting records for `key` whose bitset meets `bitset`, oldest first.
fn waiting(t: &Table, key: Key, bitset: u32) -> Vec<usize> {
    let mut v: Vec<(u64, usize)> = t
        .records
        .iter()
        .enumerate()
        .filter(|(_, r)| r.state.load(Ordering::SeqCst) == WAITING && matches(r, key) && r.bitset.load(Ordering::SeqCst) & bitset != 0)
        .map(|(i, r)| (r.seq.load(Ordering::SeqCst), i))
        .collect();
    v.sort_unstable();
    v.into_iter().map(|(_, i)| i).collect()
}

/// Wake up to `n` waits for `key`; returns how many.
fn wake(t: &Table, key: Key, n: u32, bitset: u32) -> u32 {
    let woken = with_lock(t, || {
        let w: Vec<usize> = waiting(t, key, bitset).into_iter().take(n as usize).collect();
        for &i in &w {
            t.records[i].state.store(WOKEN, Ordering::SeqCst);
        }
        w
    });
    for &i in &woken {
        host_wake(&t.records[i].state);
    }
    woken.len() as u32
}

/// Wake up to `n` waits for `key` and move up to `m` more to `to`; returns how many were woken and
/// moved (FUTEX_CMP_REQUEUE's answer; FUTEX_REQUEUE's is the woken count, which glibc ignores).
fn requeue(t: &Table, key: Key, to: Key, n: u32, m: u32) -> u32 {
    let (woken, moved) = with_lock(t, || {
        let all = waiting(t, key, u32::MAX);
        let (wake, rest) = all.split_at(all.len().min(n as usize));
        for &i in wake {
            t.records[i].state.store(WOKEN, Ordering::SeqCst);
        }
        let moved = rest.len().min(m as usize);
        for &i in &rest[..moved] {
            let r = &t.records[i];
            r.dev.store(to.dev, Ordering::SeqCst);
            r.ino.store(to.ino, Ordering::SeqCst);
            r.off.store(to.off, Ordering::SeqCst);
        }
        (wake.to_vec(), moved)
    });
    for &i in &woken {
        host_wake(&t.records[i].state);
    }
    (woken.len() + moved) as u32
}

/// Wait on the host while `word` holds `val`, at most `timeout` (a host signal ends it early).
fn host_wait(word: &AtomicU32, val: u32, timeout: Duration) {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: timeout.subsec_nanos() as i64 };
    // SAFETY: FUTEX_WAIT on a word of a shared mapping (not private: other processes wake it).
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, val, &ts as *const libc::timespec, 0usize, 0u32) };
}

fn host_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a word of a shared mapping.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) };
}

/// Whether host process `pid` is still running.
fn alive(pid: i32) -> bool {
    // SAFETY: kill with signal 0 only checks; a zombie still counts, which only delays reclaiming.
    pid > 0 && (unsafe { libc::kill(pid, 0) } == 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn fresh() -> &'static Table {
        // SAFETY: a new anonymous shared mapping for the test, never unmapped.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), TABLE_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        // SAFETY: zeroed memory is a valid Table (all atomics zero: every record FREE).
        unsafe { &*(p as *const Table) }
    }

    const K: Key = Key { dev: 1, ino: 2, off: 64 };
    const K2: Key = Key { dev: 1, ino: 2, off: 128 };

    #[test]
    fn wakes_go_oldest_first_and_count() {
        let t = fresh();
        let a = file(t, K, u32::MAX).unwrap();
        let b = file(t, K, u32::MAX).unwrap();
        let c = file(t, K2, u32::MAX).unwrap();
        assert_eq!(wake(t, K, 1, u32::MAX), 1);
        assert_eq!(t.records[a].state.load(Ordering::SeqCst), WOKEN);
        assert_eq!(t.records[b].state.load(Ordering::SeqCst), WAITING);
        assert_eq!(wake(t, K, 10, u32::MAX), 1);
        assert_eq!(wake(t, K, 10, u32::MAX), 0, "a woken record is not woken twice");
        assert_eq!(t.records[c].state.load(Ordering::SeqCst), WAITING, "another word's waiter stays");
    }

    #[test]
    fn bitsets_and_requeue() {
        let t = fresh();
        let a = file(t, K, 0b01).unwrap();
        let b = file(t, K, 0b10).unwrap();
        assert_eq!(wake(t, K, 10, 0b10), 1);
        assert_eq!(t.records[b].state.load(Ordering::SeqCst), WOKEN);
        let c = file(t, K, u32::MAX).unwrap();
        // Wake none, move both waiters to K2.
        assert_eq!(requeue(t, K, K2, 0, 10), 2);
        assert_eq!(wake(t, K, 10, u32::MAX), 0);
        assert_eq!(wake(t, K2, 10, u32::MAX), 2);
        assert!([a, c].iter().all(|&i| t.records[i].state.load(Ordering::SeqCst) == WOKEN));
    }

    #[test]
    fn a_full_table_reclaims_dead_waiters_then_refuses() {
        let t = fresh();
        for _ in 0..RECORDS {
            file(t, K, u32::MAX).unwrap();
        }
        assert_eq!(file(t, K, u32::MAX), None, "full of live waiters (this process)");
        // One of them belonged to a process that is gone.
        t.records[7].host.store(i32::MAX - 1, Ordering::SeqCst);
        assert_eq!(file(t, K2, u32::MAX), Some(7));
    }

    #[test]
    fn a_wake_reaches_a_waiter_in_another_process() {
        let t = fresh();
        let i = file(t, K, u32::MAX).unwrap();
        // SAFETY: fork in a test; the child only touches the shared table and exits.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            std::thread::sleep(Duration::from_millis(50));
            let n = wake(t, K, 1, u32::MAX);
            // SAFETY: leaving the child at once.
            unsafe { libc::_exit(n as i32) };
        }
        let start = std::time::Instant::now();
        while t.records[i].state.load(Ordering::SeqCst) == WAITING && start.elapsed() < Duration::from_secs(10) {
            host_wait(&t.records[i].state, WAITING, Duration::from_secs(1));
        }
        let mut status = 0;
        // SAFETY: reaping our child.
        unsafe { libc::waitpid(pid, &mut status, 0) };
        assert_eq!(t.records[i].state.load(Ordering::SeqCst), WOKEN);
        assert_eq!(libc::WEXITSTATUS(status), 1);
    }
}
