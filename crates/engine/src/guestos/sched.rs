//! Deterministic scheduling of a sandbox's process tree in replay mode.
//!
//! Every guest process is a VMM process of its own, and the host runs them in parallel. That is
//! what makes a process tree fast, and what makes it irreproducible: two children writing to one
//! pipe interleave as the host's scheduler decides, so does which of two concurrent forks gets the
//! next pid, which child a `wait()` reaps first, and how much virtual time a parent's timeout sees
//! pass. In replay mode the processes of a sandbox therefore take turns, with a **run token** in
//! the page they share ([`Region`]):
//!
//! - A process runs guest code only while it holds the token (the run loop's gate, [`gate`]). The
//!   holder keeps it until it would block: a read of an empty pipe, a wait for a child, a sleep, a
//!   poll... Those calls do not wait on the host (the `WAIT_SLICE_MS` waits of the non-replay
//!   path); they ask to yield ([`yield_blocked`]) and restart, and the gate passes the token on.
//! - The token goes round in guest-pid order (the next live process after the holder, wrapping):
//!   which process runs next depends only on the guest pids and on what each process did, both
//!   of which replay reproduces. A process that gets the token retries its call; it may block
//!   again.
//! - **Time** is one virtual clock for the whole tree: a process publishes its monotonic virtual
//!   time when it passes the token and the next holder moves its clock up to it, so time only
//!   moves forward and every process sees the same timeline. When a whole round passes without
//!   progress (everybody is blocked), virtual time jumps to the earliest deadline among the
//!   blocked processes (a sleep, a poll or sigtimedwait timeout): a parent's `timeout=3` on a
//!   child that sleeps an hour ends after 3 virtual seconds, at once and in every replay alike.
//!   Nobody with a deadline: the tree waits for something outside it (the host draining a pipe);
//!   the token keeps going round with a short real pause per round.
//! - A process that is done (exit, fatal signal) leaves its slot and hands the token on; one that
//!   died without doing so (a host SIGKILL) is noticed by the waiters (its pidfd) and removed.
//!
//! A holder that makes syscalls without blocking hands the token on after [`TURN_QUANTUM`] of them
//! when another process is runnable and none waits for a deadline ([`count_call`]): a count, so
//! replay reproduces it.
//!
//! Not deterministic, by design: a process that keeps the token for more than [`PREEMPT`] while
//! another waits for a deadline (or [`PREEMPT_ANYWAY`] in any case) is preempted (the waiters
//! signal it), so that a spinning child cannot starve the parent that would kill it on a timeout,
//! nor a process that spins on memory another one writes; where it was preempted depends on the
//! host's speed. Between execs (the agent is idle, [`State::Away`]) background processes go
//! on in real time, as before, and a new exec no longer takes turns with them ([`new_exec`]).
//!
//! Outside replay mode, or with one process, none of this applies and processes run in parallel.

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicPtr, AtomicU32, AtomicU64, Ordering};
use std::time::{Duration, Instant};

/// Slots in the region: one per live process (the sandbox's process limit).
pub const SLOTS: usize = 256;
/// How long the holder may run guest code without passing the token while another process waits
/// for a deadline (a parent's timeout on a spinning child), before the waiters preempt it.
pub const PREEMPT: Duration = Duration::from_millis(200);
/// How long it may when nobody has a deadline (a process that spins on memory another one writes).
pub const PREEMPT_ANYWAY: Duration = Duration::from_secs(2);
/// Syscalls the holder makes in one turn, while another member is runnable and nobody waits for a
/// deadline, before it hands the turn on (and stays runnable): see [`count_call`].
pub const TURN_QUANTUM: u32 = 100;
/// How long a waiter sleeps on the token before it checks the holder (alive? preempt it?).
const CHECK: Duration = Duration::from_millis(10);
/// The real pause per round when the whole tree waits for something outside it.
const IDLE_PAUSE: Duration = Duration::from_millis(1);

/// What a slot's process is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u32)]
pub enum State {
    Free = 0,
    /// Runnable, or running (the holder).
    Run = 1,
    /// Waiting for a condition that another process may bring about (or a deadline).
    Blocked = 2,
    /// The sandbox's first process between execs: serving its controller, not its guest. Skipped.
    Away = 3,
    /// A process left over from an earlier exec (a background job): it runs on its own, in real
    /// time, and takes no turns (see [`new_exec`]).
    Detached = 4,
    /// Done (it left, or was killed) while its host process is still ending: until that is gone it
    /// holds its descriptors, so the other end of a pipe it wrote sees no EOF yet. It takes no
    /// turns, but a round without progress does not count while it ends ([`sweep_leaving`]).
    Leaving = 5,
}

/// One process's slot.
#[repr(C)]
pub struct Slot {
    pid: AtomicU32,
    host: AtomicI32,
    state: AtomicU32,
    /// Its process group (`kill(-pgid, ..)` finds the group's members here, see
    /// `guestos::signal`): inherited from the parent at the fork, changed by setpgid and setsid.
    pgid: AtomicU32,
    /// Virtual monotonic ns the process waits for (u64::MAX: none).
    deadline: AtomicU64,
    /// Host CLOCK_MONOTONIC ns when it last took the token.
    since: AtomicU64,
    /// Set when a SIGKILL meant for this process came while it was still starting (no host pid
    /// yet): it kills itself once it has one (see [`doom`]).
    doomed: AtomicU32,
    /// The call it last passed the token from, blocked (number, first two arguments): what a
    /// report of a run that timed out says it waits in ([`describe_tree`]).
    call_nr: AtomicU64,
    call_args: [AtomicU64; 2],
    /// 1 while it is blocked in a call that waits (also) on a network socket: what it waits for
    /// comes from outside the sandbox, in real time, so a round without progress must not move
    /// virtual time to its deadline ([`everybody_waits`]).
    network: AtomicU32,
}

/// The scheduler's shared memory: a few pages every VMM process of the sandbox maps.
#[repr(C)]
pub struct Region {
    /// Guest pid of the holder; 0 when nobody holds it.
    token: AtomicU32,
    /// Consecutive passes without progress.
    idle: AtomicU32,
    /// Set while some process changes the slots (a spin lock; held for a few instructions).
    lock: AtomicU32,
    _pad: u32,
    /// The tree's virtual monotonic time (ns), as the last holder published it.
    mono: AtomicU64,
    slots: [Slot; SLOTS],
}

/// Bytes to map for a [`Region`].
pub const REGION_BYTES: usize = std::mem::size_of::<Region>().div_ceil(4096) * 4096;

static REGION: AtomicPtr<Region> = AtomicPtr::new(std::ptr::null_mut());
/// This process's guest pid (0: not in a sandbox tree).
static ME: AtomicU32 = AtomicU32::new(0);
/// Whether this process holds the token.
static HOLDING: AtomicBool = AtomicBool::new(false);
/// Whether this process runs in replay mode (the gate keeps it current).
static REPLAY: AtomicBool = AtomicBool::new(false);
/// A yield asked by the current syscall: 0 none, 1 blocked (deadline in YIELD_DEADLINE).
static YIELD: AtomicU32 = AtomicU32::new(0);
static YIELD_DEADLINE: AtomicU64 = AtomicU64::new(u64::MAX);
/// The waiters asked this process to pass the token (see [`PREEMPT`]).
static PREEMPTED: AtomicBool = AtomicBool::new(false);
/// Whether the process did something since it took the token (a round of passes with no progress
/// means everybody is blocked).
static PROGRESS: AtomicBool = AtomicBool::new(false);
/// Host CLOCK_MONOTONIC ns when this process last took the token (the start of its turn: a
/// preempted turn moves the tree's virtual time by its length, see [`pass`]).
static TURN_START: AtomicU64 = AtomicU64::new(0);

/// Syscalls that completed (did not yield) in this process's current turn.
static TURN_CALLS: AtomicU32 = AtomicU32::new(0);
/// The turn's quantum is used up and another member is runnable: the gate hands the turn on.
static QUANTUM_DUE: AtomicBool = AtomicBool::new(false);

/// This process takes the token (it was not holding it): its turn starts now.
fn start_turn() {
    if !HOLDING.swap(true, Ordering::SeqCst) {
        TURN_START.store(crate::guestos::clock::monotonic_ns(), Ordering::SeqCst);
        TURN_CALLS.store(0, Ordering::Relaxed);
        QUANTUM_DUE.store(false, Ordering::Relaxed);
    }
}

fn region() -> Option<&'static Region> {
    let p = REGION.load(Ordering::Acquire);
    // SAFETY: set by `attach` to a shared mapping of REGION_BYTES that is never unmapped.
    (!p.is_null()).then(|| unsafe { &*p })
}

/// A new sandbox tree (its first process, guest pid `pid`): a region of its own, inherited by the
/// processes it forks.
pub fn new_tree(pid: i32) {
    // SAFETY: a new anonymous shared mapping; nothing else refers to it yet.
    let p = unsafe {
        libc::mmap(std::ptr::null_mut(), REGION_BYTES, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
    };
    if p != libc::MAP_FAILED {
        attach(p.cast(), pid);
    }
}

/// Use `mem` (a fresh zeroed shared mapping of [`REGION_BYTES`]) as this sandbox's region, with
/// this process (guest pid `pid`) as its only member.
fn attach(mem: *mut u8, pid: i32) {
    REGION.store(mem.cast(), Ordering::Release);
    ME.store(pid as u32, Ordering::SeqCst);
    HOLDING.store(false, Ordering::SeqCst);
    if let Some(r) = region() {
        r.token.store(0, Ordering::SeqCst);
        r.idle.store(0, Ordering::SeqCst);
        r.mono.store(0, Ordering::SeqCst);
        for s in &r.slots {
            s.pid.store(0, Ordering::SeqCst);
            s.state.store(State::Free as u32, Ordering::SeqCst);
        }
        // SAFETY: getpid cannot fail.
        register(r, pid as u32, unsafe { libc::getpid() }, State::Run, pid as u32);
    }
    // The roster of an earlier tree (this process was forked from another sandbox's first
    // process) is not this tree's.
    super::signal::roster::leave_tree();
}

/// The sandbox is back to its first process (guest pid `pid`) alone (a reset): every other slot
/// is freed, and the first process is a member again. One whose guest had ended had left the
/// turns (`leave`); the sandbox restored after that took turns without it, so its children
/// were alone in the tree (a timeout report saw no one to describe, and their turns did not
/// include the first process).
pub fn reset(pid: i32) {
    let Some(r) = region() else { return };
    let me = pid as u32;
    ME.store(me, Ordering::SeqCst);
    with_lock(r, || {
        for s in r.slots.iter().filter(|s| s.pid.load(Ordering::SeqCst) != me) {
            s.state.store(State::Free as u32, Ordering::SeqCst);
            s.pid.store(0, Ordering::SeqCst);
        }
    });
    if slot_of(r, me).is_none() {
        // Between runs, as `away` leaves it. SAFETY: getpid cannot fail.
        register(r, me, unsafe { libc::getpid() }, State::Away, me);
    }
    r.token.store(0, Ordering::SeqCst);
    r.idle.store(0, Ordering::SeqCst);
    HOLDING.store(false, Ordering::SeqCst);
}

fn with_lock<T>(r: &Region, f: impl FnOnce() -> T) -> T {
    // Held for a few loads and stores. A holder killed right there (a host SIGKILL) would never
    // let go: after about a million tries (milliseconds) the lock is taken over.
    let mut tries = 0u32;
    while r.lock.compare_exchange(0, 1, Ordering::Acquire, Ordering::Relaxed).is_err() {
        tries += 1;
        if tries > 1 << 20 {
            r.lock.store(1, Ordering::Release);
            break;
        }
        std::hint::spin_loop();
    }
    let v = f();
    r.lock.store(0, Ordering::Release);
    v
}

fn slot_of(r: &Region, pid: u32) -> Option<&Slot> {
    r.slots.iter().find(|s| s.pid.load(Ordering::SeqCst) == pid)
}

fn register(r: &Region, pid: u32, host: i32, state: State, pgid: u32) {
    if !r.slots.iter().any(|s| s.pid.load(Ordering::SeqCst) == 0) {
        // Full: outside replay mode nobody else frees the slots of processes that have ended.
        sweep_leaving(r);
    }
    with_lock(r, || {
        let slot = slot_of(r, pid).or_else(|| r.slots.iter().find(|s| s.pid.load(Ordering::SeqCst) == 0));
        if let Some(s) = slot {
            s.host.store(host, Ordering::SeqCst);
            s.state.store(state as u32, Ordering::SeqCst);
            s.deadline.store(u64::MAX, Ordering::SeqCst);
            s.network.store(0, Ordering::SeqCst);
            s.pgid.store(pgid, Ordering::SeqCst);
            s.doomed.store(0, Ordering::SeqCst);
            s.pid.store(pid, Ordering::SeqCst);
        }
    });
}

/// Members that take turns: running, runnable or blocked (not away, not free).
fn members(r: &Region) -> usize {
    r.slots.iter().filter(|s| matches!(s.state.load(Ordering::SeqCst), 1 | 2) && s.pid.load(Ordering::SeqCst) != 0).count()
}

/// Whether blocking calls take turns instead of waiting on the host: the tree takes turns
/// ([`tree_active`]), or other threads of this process can run meanwhile ([`set_thread_turns`]).
pub fn active() -> bool {
    THREAD_TURNS.load(Ordering::Relaxed) || tree_active()
}

/// Whether the tree takes turns now: replay mode, this process a member, and another member.
pub fn tree_active() -> bool {
    // The process count first: one atomic load, where most runs (a process alone) end.
    REPLAY.load(Ordering::Relaxed)
        && !super::signal::host::alone()
        && region().is_some_and(|r| is_member(r, ME.load(Ordering::SeqCst)) && members(r) > 1)
}

/// Whether `pid` takes turns (runnable, running or blocked).
fn is_member(r: &Region, pid: u32) -> bool {
    slot_of(r, pid).is_some_and(|s| matches!(s.state.load(Ordering::SeqCst), 1 | 2))
}

/// The sandbox's first process starts an exec: what is left of earlier ones (background jobs)
/// no longer takes turns with it. Those run on their own in real time (they did between the
/// execs already); the processes this exec starts take turns. Without this a job spinning in
/// the background would hold every later exec up until it is preempted.
pub fn new_exec(replay: bool, mono: u64) {
    REPLAY.store(replay, Ordering::Relaxed);
    let Some(r) = region() else { return };
    let me = ME.load(Ordering::SeqCst);
    if me == 0 {
        return;
    }
    // The tree's time starts where the first process's clock does (a replay's from where the guest
    // last saw it), not where an earlier run's processes left it: a child of this run that took
    // its first turn caught up to that and saw a wait's time counted again (a 0.3 s answer read
    // 0.6 s, 0.9 s, ... late in successive runs).
    r.mono.store(mono, Ordering::SeqCst);
    with_lock(r, || {
        for s in r.slots.iter() {
            let pid = s.pid.load(Ordering::SeqCst);
            if pid != 0 && pid != me && matches!(s.state.load(Ordering::SeqCst), 1 | 2) {
                s.state.store(State::Detached as u32, Ordering::SeqCst);
            }
        }
    });
    back();
    take_now(r);
    // Those waiting for a turn look again: the detached go on on their own.
    futex_wake(&r.token);
}

/// Before a guest fork of child `pid`: its slot exists before it can run (it takes turns from its
/// first run; a detached process's children are on their own too), and in replay mode the parent
/// holds the token (it is the one running), so the child waits for its turn whatever the host runs
/// first. A fork that fails gives the slot back with [`killed`].
pub fn before_fork(pid: i32) {
    let Some(r) = region() else { return };
    if REPLAY.load(Ordering::Relaxed) {
        take_now(r);
    }
    let mine = slot_of(r, ME.load(Ordering::SeqCst));
    let detached = mine.is_some_and(|s| s.state.load(Ordering::SeqCst) == State::Detached as u32);
    let pgid = mine.map_or(1, |s| s.pgid.load(Ordering::SeqCst));
    // The child proves it is alive to the others with a lock of the roster's (see
    // `guestos::signal::roster`), which it takes before it fills in its host pid.
    super::signal::roster::before_fork();
    // The host pid is the child's to fill in (`child_started`).
    register(r, pid as u32, 0, if detached { State::Detached } else { State::Run }, pgid);
}

/// In a new child process: its guest pid; its slot (made by the parent) gets its host pid.
pub fn child_started(pid: i32) {
    if let Ok(mut c) = CALL.lock() {
        *c = (CallKey::default(), None);
    }
    if let Ok(mut w) = WRITE.lock() {
        *w = None;
    }
    ME.store(pid as u32, Ordering::SeqCst);
    HOLDING.store(false, Ordering::SeqCst);
    YIELD.store(0, Ordering::SeqCst);
    PREEMPTED.store(false, Ordering::SeqCst);
    super::signal::roster::join(pid);
    if let Some(s) = region().and_then(|r| slot_of(r, pid as u32)) {
        // SAFETY: getpid cannot fail.
        s.host.store(unsafe { libc::getpid() }, Ordering::SeqCst);
        // After the store: a sender that saw no host pid has set `doomed` first (see `doom`).
        if s.doomed.load(Ordering::SeqCst) != 0 {
            killed(pid);
            // SAFETY: this process ends by the signal it was sent.
            unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
        }
    }
}

/// A SIGKILL for guest process `pid`, which has a slot but may not have started yet: if it has no
/// host pid, it kills itself as soon as it has one ([`child_started`]). Returns the host pid it
/// has now (0: none yet, the process dies on its own), for the caller to signal it. A process
/// that has started may be signalled twice: SIGKILL is idempotent.
pub fn doom(pid: i32) -> i32 {
    let Some(s) = region().and_then(|r| slot_of(r, pid as u32)) else { return 0 };
    if s.host.load(Ordering::SeqCst) > 0 {
        return s.host.load(Ordering::SeqCst);
    }
    s.doomed.store(1, Ordering::SeqCst);
    // After the store: a child that stored its host pid before it sees `doomed` is ours to signal.
    s.host.load(Ordering::SeqCst)
}

/// Make this process the holder without waiting (it is the one running).
fn take_now(r: &Region) {
    let me = ME.load(Ordering::SeqCst);
    if me != 0 {
        r.token.store(me, Ordering::SeqCst);
        start_turn();
        if let Some(s) = slot_of(r, me) {
            s.since.store(crate::guestos::clock::monotonic_ns(), Ordering::SeqCst);
        }
    }
}

/// The current syscall would block: pass the token (blocked until `deadline`, virtual monotonic
/// ns) once it has returned, and restart it. False when the tree does not take turns: the caller
/// waits on the host as before.
pub fn yield_blocked(deadline: Option<u64>) -> bool {
    yield_blocked_on(deadline, false)
}

/// [`yield_blocked`] for a call that waits (also) on a network socket (`network`): its peer is
/// outside the sandbox, so while it waits virtual time moves with real time instead of jumping
/// to its deadline when nobody else can move (a 20 s read timeout on a server that takes 0.3 s to
/// answer expired at once). The network makes such a run irreproducible anyway; a recording's
/// replay answers at once and is not affected.
pub fn yield_blocked_on(deadline: Option<u64>, network: bool) -> bool {
    // The process's next timer ends every wait (`guestos::timer`): a wait without a deadline of
    // its own gets the timer's, so time can jump there when everybody waits.
    let timer = TIMER_NEXT.load(Ordering::Relaxed);
    let deadline = match deadline {
        Some(d) => Some(d.min(timer)),
        None => (timer != u64::MAX).then_some(timer),
    };
    if THREAD_TURNS.load(Ordering::Relaxed) {
        NETWORK_WAIT.store(network, Ordering::SeqCst);
        // Another thread of this process runs meanwhile (`vmm::threads`); the call is retried
        // when this thread's turn comes back (from `deadline` on, if it has one).
        THREAD_DEADLINE.store(deadline.unwrap_or(u64::MAX), Ordering::SeqCst);
        THREAD_YIELD.store(true, Ordering::SeqCst);
        return true;
    }
    if !tree_active() {
        return false;
    }
    YIELD_DEADLINE.store(deadline.unwrap_or(u64::MAX), Ordering::SeqCst);
    NETWORK_WAIT.store(network, Ordering::SeqCst);
    YIELD.store(1, Ordering::SeqCst);
    true
}

/// The loaded process's next timer deadline (`guestos::timer`; u64::MAX: none), on the same
/// clock as the yields' deadlines.
static TIMER_NEXT: AtomicU64 = AtomicU64::new(u64::MAX);

pub fn set_timer_deadline(d: u64) {
    TIMER_NEXT.store(d, Ordering::Relaxed);
}

/// Whether the call that last yielded waits on a network socket (see [`yield_blocked_on`]):
/// read once, by the pass that follows or by the thread scheduler parking the thread.
static NETWORK_WAIT: AtomicBool = AtomicBool::new(false);

pub fn take_network_wait() -> bool {
    NETWORK_WAIT.swap(false, Ordering::SeqCst)
}

/// The thread scheduler's idle turn is for threads of which one waits on a network socket.
pub fn mark_network_wait() {
    NETWORK_WAIT.store(true, Ordering::SeqCst);
}

/// The syscall being served (rip after it, number, first four arguments), and the deadline a
/// blocked call computed: a restart of the same call keeps it; any other call drops it.
#[derive(Clone, Copy, PartialEq, Eq, Default, Debug)]
struct CallKey {
    rip: u64,
    nr: u64,
    args: [u64; 4],
}
static CALL: std::sync::Mutex<(CallKey, Option<(CallKey, u64)>)> =
    std::sync::Mutex::new((CallKey { rip: 0, nr: 0, args: [0; 4] }, None));

/// Before every syscall.
pub fn begin_syscall(rip: u64, nr: u64, args: [u64; 4]) {
    let key = CallKey { rip, nr, args };
    if let Ok(mut c) = CALL.lock() {
        c.0 = key;
        if c.1.is_some_and(|(k, _)| k != key) {
            c.1 = None;
        }
    }
}

/// The call that asked to yield is interrupted instead (a signal is to be delivered, from a timer
/// that fired in it): no yield. Without this the turn was passed with the call's deadline and
/// time jumped there before the handler ran (a handler of a 0.5 s timer saw 0.6 s).
pub fn cancel_yield() {
    YIELD.store(0, Ordering::SeqCst);
    THREAD_YIELD.store(false, Ordering::SeqCst);
    THREAD_SLEEP.store(false, Ordering::SeqCst);
    NETWORK_WAIT.store(false, Ordering::SeqCst);
}

/// The current call returned to the guest (it is not being restarted): its deadline is done
/// with. The same call made again (a loop of `time.sleep(0.3)`: the same rip and arguments)
/// computes a new one; it kept the old one, and ended at once when that had been reached.
pub fn call_done() {
    if let Ok(mut c) = CALL.lock() {
        c.1 = None;
    }
}

/// The virtual deadline of the current call: `now + timeout` when it started (kept across its
/// restarts).
pub fn deadline(now: u64, timeout: u64) -> u64 {
    let Ok(mut c) = CALL.lock() else { return now.saturating_add(timeout) };
    let key = c.0;
    match c.1 {
        Some((k, d)) if k == key => d,
        _ => {
            let d = now.saturating_add(timeout);
            c.1 = Some((key, d));
            d
        }
    }
}

/// A blocking write to a pipe that goes on in later turns: the call it continues (rip, fd, and the
/// buffer and count of the rest), what it has written so far, and the caller's buffer and count
/// registers to give back when it returns.
#[derive(Clone, Copy)]
struct WriteCarry {
    rip: u64,
    fd: i32,
    buf: u64,
    count: u64,
    written: u64,
    regs: (u64, u64),
}
static WRITE: std::sync::Mutex<Option<WriteCarry>> = std::sync::Mutex::new(None);

/// At a write(2) that takes turns: what earlier turns of this same call wrote, and the caller's
/// (rsi, rdx) to restore when it returns ((0, current) if it is a new call).
pub fn write_resumed(rip: u64, fd: i32, buf: u64, count: u64) -> (u64, (u64, u64)) {
    let carry = WRITE.lock().ok().and_then(|mut w| w.take());
    match carry {
        Some(c) if c.rip == rip && c.fd == fd && c.buf == buf && c.count == count => (c.written, c.regs),
        _ => (0, (buf, count)),
    }
}

/// The write goes on in the next turn: the guest re-executes it for the rest (`buf`, `count` put
/// in its registers), the total so far is kept.
pub fn write_continues(regs: &mut kvm_bindings::kvm_regs, fd: i32, buf: u64, count: u64, written: u64, caller: (u64, u64)) {
    regs.rsi = buf;
    regs.rdx = count;
    if let Ok(mut w) = WRITE.lock() {
        *w = Some(WriteCarry { rip: regs.rip, fd, buf, count, written, regs: caller });
    }
}

// --- threads of this process ---------------------------------------------------------------

/// Whether another thread of this process can run while the loaded one would block (set by the
/// VMM's thread scheduler, `vmm::threads`, each time it loads a thread).
static THREAD_TURNS: AtomicBool = AtomicBool::new(false);
/// The loaded thread's blocking call asked to yield to the other threads, with this deadline
/// (the scheduler's clock, `guestos::thread::now`; u64::MAX for none).
static THREAD_YIELD: AtomicBool = AtomicBool::new(false);
static THREAD_DEADLINE: AtomicU64 = AtomicU64::new(u64::MAX);
/// The yield is a sleep's: nothing but its deadline (or a signal) can end it, so the scheduler
/// does not retry it before then.
static THREAD_SLEEP: AtomicBool = AtomicBool::new(false);

/// [`yield_blocked`] for a sleep that only its deadline ends (nanosleep, clock_nanosleep).
pub fn yield_sleeping(deadline: u64) -> bool {
    if !yield_blocked(Some(deadline)) {
        return false;
    }
    if THREAD_YIELD.load(Ordering::SeqCst) {
        THREAD_SLEEP.store(true, Ordering::SeqCst);
    }
    true
}

pub fn set_thread_turns(on: bool) {
    THREAD_TURNS.store(on, Ordering::Relaxed);
}

/// The yield the loaded thread's last syscall asked for, if any: Some((deadline, whether it is
/// a sleep, see [`yield_sleeping`])).
pub fn take_thread_yield() -> Option<(Option<u64>, bool)> {
    let sleep = THREAD_SLEEP.swap(false, Ordering::SeqCst);
    if !THREAD_YIELD.swap(false, Ordering::SeqCst) {
        return None;
    }
    let d = THREAD_DEADLINE.swap(u64::MAX, Ordering::SeqCst);
    Some(((d != u64::MAX).then_some(d), sleep))
}

/// A thread's share of this module's per-call bookkeeping (the deadline a restarted call keeps,
/// a blocking write's carry): saved when the thread is parked, put back when it is loaded.
#[derive(Clone, Copy, Default)]
pub struct ThreadCarry {
    call: Option<(CallKey, Option<(CallKey, u64)>)>,
    write: Option<WriteCarry>,
}

impl std::fmt::Debug for ThreadCarry {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ThreadCarry")
    }
}

impl PartialEq for ThreadCarry {
    fn eq(&self, _: &Self) -> bool {
        true // bookkeeping, not state: two threads never differ by it in any way that matters
    }
}

/// Take the loaded thread's bookkeeping out (it is being parked).
pub fn save_carry() -> ThreadCarry {
    ThreadCarry {
        call: CALL.lock().ok().map(|mut c| std::mem::take(&mut *c)),
        write: WRITE.lock().ok().and_then(|mut w| w.take()),
    }
}

/// Put a thread's bookkeeping back (it is being loaded).
pub fn restore_carry(c: ThreadCarry) {
    if let (Some(v), Ok(mut call)) = (c.call, CALL.lock()) {
        *call = v;
    }
    if let Ok(mut w) = WRITE.lock() {
        *w = c.write;
    }
}

/// Every thread of this process waits and the tree takes turns: pass the token as a blocked
/// process would (until `deadline`, virtual ns) and wait for it to come back. False if the run's
/// deadline passed first.
///
/// What the threads did in this turn counts, as a blocked process's calls before the one that
/// blocked do: a thread that accepted a connection, answered it and blocked in accept again made
/// progress, and the client blocked on the answer must get its turn before anybody concludes that
/// nobody can move (which would move virtual time to the earliest deadline: a server whose main
/// thread waits with `Event.wait(1)` had its clients see a second pass per request). The calls
/// that only yielded to other threads are not progress ([`after_syscall`]).
pub fn idle_turn(mono: u64, advance: &mut dyn FnMut(u64), deadline: Option<u64>, run_deadline: Instant) -> bool {
    YIELD_DEADLINE.store(deadline.unwrap_or(u64::MAX), Ordering::SeqCst);
    YIELD.store(1, Ordering::SeqCst);
    matches!(gate(true, mono, advance, run_deadline), Gate::Run)
}

/// Whether this process runs in replay mode inside a sandbox tree (members or not).
pub fn replaying() -> bool {
    REPLAY.load(Ordering::Relaxed) && region().is_some()
}

/// Whether guest process `pid` is a member of the tree (live and not left).
pub fn member(pid: i32) -> bool {
    region().is_some_and(|r| slot_of(r, pid as u32).is_some_and(|s| s.state.load(Ordering::SeqCst) != State::Leaving as u32))
}

/// A guest process of this sandbox as its slot records it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Process {
    pub pid: i32,
    /// Its VMM's host pid; 0 while it is still starting (forked, not yet run).
    pub host: i32,
    pub pgid: i32,
}

/// Every guest process of the sandbox that has a slot: the processes that have not left. A slot
/// can outlive its process (one killed by the host from outside the sandbox), so the host pid is
/// only a claim; `guestos::signal::roster` checks it before anything is sent there.
pub fn processes() -> Vec<Process> {
    let Some(r) = region() else { return Vec::new() };
    with_lock(r, || {
        r.slots
            .iter()
            .filter_map(|s| {
                let pid = s.pid.load(Ordering::SeqCst);
                (pid != 0 && s.state.load(Ordering::SeqCst) != State::Leaving as u32).then(|| Process {
                    pid: pid as i32,
                    host: s.host.load(Ordering::SeqCst),
                    pgid: s.pgid.load(Ordering::SeqCst) as i32,
                })
            })
            .collect()
    })
}

/// The processes the current exec started (members of the turns: running, runnable or
/// blocked), this one excepted; what earlier execs left is detached ([`new_exec`]) and not
/// listed.
pub fn exec_processes() -> Vec<Process> {
    let Some(r) = region() else { return Vec::new() };
    let me = ME.load(Ordering::SeqCst);
    with_lock(r, || {
        r.slots
            .iter()
            .filter_map(|s| {
                let pid = s.pid.load(Ordering::SeqCst);
                (pid != 0 && pid != me && matches!(s.state.load(Ordering::SeqCst), 1 | 2)).then(|| Process {
                    pid: pid as i32,
                    host: s.host.load(Ordering::SeqCst),
                    pgid: s.pgid.load(Ordering::SeqCst) as i32,
                })
            })
            .collect()
    })
}

/// A line per process of the tree for a report of a run that timed out: its pid, whether it holds
/// the turn, and what it waits in (the call it last passed the turn from). Empty when this process
/// is alone or the tree does not take turns (outside replay mode nothing here is current).
pub fn describe_tree() -> String {
    let Some(r) = region() else { return String::new() };
    if !REPLAY.load(Ordering::Relaxed) || members(r) <= 1 {
        return String::new();
    }
    let token = r.token.load(Ordering::SeqCst);
    let mut lines: Vec<(u32, String)> = r
        .slots
        .iter()
        .filter_map(|s| {
            let pid = s.pid.load(Ordering::SeqCst);
            let state = s.state.load(Ordering::SeqCst);
            if pid == 0 || state == State::Free as u32 {
                return None;
            }
            let what = match state {
                x if x == State::Run as u32 && pid == token => "running (holds the turn)".to_string(),
                x if x == State::Run as u32 => "runnable".to_string(),
                x if x == State::Blocked as u32 => {
                    let call = super::nr::describe_call(
                        s.call_nr.load(Ordering::Relaxed),
                        [s.call_args[0].load(Ordering::Relaxed), s.call_args[1].load(Ordering::Relaxed), 0, 0],
                    );
                    let timeout = if s.deadline.load(Ordering::SeqCst) == u64::MAX { "" } else { " with a timeout" };
                    format!("blocked in {call}{timeout}")
                }
                x if x == State::Away as u32 => "serving its controller".to_string(),
                x if x == State::Detached as u32 => "detached (left over from an earlier exec)".to_string(),
                _ => "ending".to_string(),
            };
            Some((pid, format!("  process {pid}: {what}\n")))
        })
        .collect();
    lines.sort_unstable_by_key(|(pid, _)| *pid);
    lines.into_iter().map(|(_, l)| l).collect()
}

/// The call a parked thread was in (number, arguments), from its bookkeeping.
pub fn carried_call(c: &ThreadCarry) -> Option<(u64, [u64; 4])> {
    c.call.map(|(k, _)| (k.nr, k.args))
}

/// This process's group changed (setpgid, setsid).
pub fn set_pgid(pgid: i32) {
    if let Some(s) = region().and_then(|r| slot_of(r, ME.load(Ordering::SeqCst))) {
        s.pgid.store(pgid as u32, Ordering::SeqCst);
    }
}

/// After every syscall: one that did not ask to yield (to the other processes, or to the other
/// threads of this one) is progress (a round of passes without any means everybody is blocked).
pub fn after_syscall() {
    if YIELD.load(Ordering::Relaxed) == 0 && !THREAD_YIELD.load(Ordering::Relaxed) {
        PROGRESS.store(true, Ordering::Relaxed);
    }
}

/// After every syscall the guest made (not the vDSO's clock reads, whose count between two exits
/// depends on the host): a holder that completed [`TURN_QUANTUM`] calls in its turn while another
/// member waits for the token runnable (a child it forked that never ran, one preempted or
/// passed the same way) hands the turn on at the gate, runnable itself. Without this a process
/// that never blocks (a parent polling a child with `waitpid(WNOHANG)` in a loop) kept the turn
/// until the waiters preempted it, 2 s later, at a point the host's speed chose; the count makes
/// the hand-off a function of the program. Not while a member waits for a deadline: then the
/// holder's turn is what moves virtual time there ([`PREEMPT`], real time), as before. Not to
/// members blocked without a deadline either: they retry when the holder blocks, as before (a
/// busy child would otherwise hand its waiting parent a pointless turn every quantum).
pub fn count_call() {
    if !HOLDING.load(Ordering::Relaxed) || YIELD.load(Ordering::Relaxed) != 0 || THREAD_YIELD.load(Ordering::Relaxed) {
        return;
    }
    if TURN_CALLS.fetch_add(1, Ordering::Relaxed) + 1 < TURN_QUANTUM {
        return;
    }
    TURN_CALLS.store(0, Ordering::Relaxed);
    let Some(r) = region() else { return };
    if !tree_active() {
        return;
    }
    let me = ME.load(Ordering::SeqCst);
    let runnable = r.slots.iter().any(|s| {
        let pid = s.pid.load(Ordering::SeqCst);
        pid != 0 && pid != me && s.state.load(Ordering::SeqCst) == State::Run as u32
    });
    if runnable && !deadline_waited_for(r) {
        QUANTUM_DUE.store(true, Ordering::Relaxed);
    }
}

/// Host signal handler side: the waiters want the token.
pub fn preempt_requested() {
    PREEMPTED.store(true, Ordering::SeqCst);
}

/// The host signal waiters send a holder that ran too long (SIGRTMIN + 1 carries guest signals,
/// + 2 is a guest child's parent-death signal).
pub fn preempt_signal() -> libc::c_int {
    libc::SIGRTMIN() + 3
}

/// What the run loop's gate decided.
pub enum Gate {
    Run,
    /// The run's deadline passed while waiting for the token.
    Timeout,
}

/// The run loop's gate, before every entry into the guest. `mono` is this process's virtual
/// monotonic time: read (to publish it) and moved up to the tree's time on taking the token.
pub fn gate(replay: bool, mono: u64, advance: &mut dyn FnMut(u64), deadline: Instant) -> Gate {
    REPLAY.store(replay, Ordering::Relaxed);
    let Some(r) = region() else { return Gate::Run };
    let me = ME.load(Ordering::SeqCst);
    let asked = YIELD.swap(0, Ordering::SeqCst);
    let preempted = PREEMPTED.swap(false, Ordering::SeqCst);
    let quantum = QUANTUM_DUE.swap(false, Ordering::Relaxed);
    if !tree_active() {
        // Alone or not in replay: run freely (holding the token, if anyone is to take turns later).
        if replay && me != 0 && r.token.load(Ordering::SeqCst) != me && is_member(r, me) && (super::signal::host::alone() || members(r) <= 1) {
            take_now(r);
        }
        return Gate::Run;
    }
    if HOLDING.load(Ordering::SeqCst) {
        if asked == 1 {
            pass(r, me, mono, Pass::Blocked(YIELD_DEADLINE.load(Ordering::SeqCst)));
        } else if preempted {
            pass(r, me, mono, Pass::Preempted);
        } else if quantum {
            pass(r, me, mono, Pass::Quantum);
        }
    }
    if HOLDING.load(Ordering::SeqCst) || r.token.load(Ordering::SeqCst) == me {
        start_turn();
        return Gate::Run;
    }
    match acquire(r, me, deadline) {
        false => Gate::Timeout,
        true => {
            let tree = r.mono.load(Ordering::SeqCst);
            if tree > mono {
                advance(tree - mono);
            }
            Gate::Run
        }
    }
}

/// Right after a call asked to yield (and before it goes back to the guest to be restarted): hand
/// the turn on and wait for it to come back (a short while: beyond that the run loop's gate waits,
/// with the run's deadline). True if this process holds the turn again and may retry the call at
/// once; false if the call must go back through the guest (a host signal arrived, the turn is
/// still elsewhere, nothing was asked).
pub fn turn_again(replay: bool, mono: u64, advance: &mut dyn FnMut(u64)) -> bool {
    if YIELD.load(Ordering::SeqCst) == 0 || super::signal::host::pending() {
        return false;
    }
    let deadline = Instant::now() + RETRY_WAIT;
    match gate(replay, mono, advance, deadline) {
        Gate::Run => HOLDING.load(Ordering::SeqCst) && !super::signal::host::pending() && !PREEMPTED.load(Ordering::SeqCst),
        Gate::Timeout => false,
    }
}

/// How long [`turn_again`] waits for the turn inside a syscall.
const RETRY_WAIT: Duration = Duration::from_millis(20);

/// The sandbox's first process ends a run (its agent is idle, or the run timed out): it steps
/// aside until its next run. `mono`: its virtual time, published.
pub fn away(mono: u64) {
    let Some(r) = region() else { return };
    let me = ME.load(Ordering::SeqCst);
    if me == 0 {
        return;
    }
    if let Some(s) = slot_of(r, me) {
        s.state.store(State::Away as u32, Ordering::SeqCst);
    }
    if HOLDING.swap(false, Ordering::SeqCst) || r.token.load(Ordering::SeqCst) == me {
        r.mono.fetch_max(mono, Ordering::SeqCst);
        hand_on(r, me);
    }
}

/// The first process starts a run: it takes turns again.
pub fn back() {
    let Some(r) = region() else { return };
    if let Some(s) = slot_of(r, ME.load(Ordering::SeqCst)) {
        if s.state.load(Ordering::SeqCst) == State::Away as u32 {
            s.state.store(State::Run as u32, Ordering::SeqCst);
        }
    }
}

/// This process is done (exit or fatal signal): leave, handing the token on. Its slot stays
/// (as [`State::Leaving`]) until its host process is gone.
pub fn leave() {
    let Some(r) = region() else { return };
    let me = ME.swap(0, Ordering::SeqCst);
    if me == 0 {
        return;
    }
    HOLDING.store(false, Ordering::SeqCst);
    super::proctab::leave(me as i32);
    ending(r, me);
}

/// Guest process `pid` of this tree was killed outright (a host SIGKILL): the sender, which holds
/// the token, takes it out of the turns at once, so nobody waits for it.
pub fn killed(pid: i32) {
    if let Some(r) = region() {
        ending(r, pid as u32);
    }
}

/// Process `pid` is done: out of the turns, its slot kept while its host process ends (one that
/// never started has nothing to wait for; the sandbox's first process does not end with its guest).
fn ending(r: &Region, pid: u32) {
    let top = super::signal::host::top();
    let started = with_lock(r, || match slot_of(r, pid) {
        Some(s) if s.host.load(Ordering::SeqCst) > 0 && s.host.load(Ordering::SeqCst) != top => {
            s.state.store(State::Leaving as u32, Ordering::SeqCst);
            true
        }
        _ => false,
    });
    if !started {
        forget(r, pid);
        return;
    }
    // A process that ends is progress (its parent's wait, a read of the pipe it wrote may now
    // succeed): the passes without progress counted before it left do not add up to a round
    // with the passes after it.
    r.idle.store(0, Ordering::SeqCst);
    if r.token.load(Ordering::SeqCst) == pid {
        hand_on(r, pid);
    }
}

/// What [`sweep_leaving`] found.
#[derive(PartialEq, Eq, Debug)]
enum Leaving {
    None,
    /// Some were gone and their slots are free now.
    Gone,
    /// Some are still ending.
    Ending,
}

/// Free the slots of leaving processes whose host process is gone.
fn sweep_leaving(r: &Region) -> Leaving {
    let mut found = Leaving::None;
    for s in r.slots.iter() {
        let pid = s.pid.load(Ordering::SeqCst);
        if pid == 0 || s.state.load(Ordering::SeqCst) != State::Leaving as u32 {
            continue;
        }
        if alive(s.host.load(Ordering::SeqCst)) {
            found = Leaving::Ending;
        } else {
            with_lock(r, || {
                if s.pid.load(Ordering::SeqCst) == pid && s.state.load(Ordering::SeqCst) == State::Leaving as u32 {
                    s.state.store(State::Free as u32, Ordering::SeqCst);
                    s.pid.store(0, Ordering::SeqCst);
                }
            });
            if found == Leaving::None {
                found = Leaving::Gone;
            }
        }
    }
    found
}

fn forget(r: &Region, pid: u32) {
    with_lock(r, || {
        if let Some(s) = slot_of(r, pid) {
            s.state.store(State::Free as u32, Ordering::SeqCst);
            s.pid.store(0, Ordering::SeqCst);
        }
    });
    r.idle.store(0, Ordering::SeqCst); // as in `ending`
    if r.token.load(Ordering::SeqCst) == pid {
        hand_on(r, pid);
    }
}

/// Why the holder passes the token.
#[derive(Clone, Copy)]
enum Pass {
    /// Its call would block until this virtual deadline (u64::MAX: none).
    Blocked(u64),
    /// The waiters preempted it while busy (see [`PREEMPT`]).
    Preempted,
    /// It used up its quantum while another member is runnable ([`count_call`]).
    Quantum,
}

/// Pass the token on from `me`.
fn pass(r: &Region, me: u32, mono: u64, why: Pass) {
    let deadline = match why {
        Pass::Blocked(d) => Some(d),
        Pass::Preempted | Pass::Quantum => None,
    };
    HOLDING.store(false, Ordering::SeqCst);
    r.mono.fetch_max(mono, Ordering::SeqCst);
    if let Some(s) = slot_of(r, me) {
        match deadline {
            Some(d) => {
                if let Ok(c) = CALL.lock() {
                    s.call_nr.store(c.0.nr, Ordering::Relaxed);
                    s.call_args[0].store(c.0.args[0], Ordering::Relaxed);
                    s.call_args[1].store(c.0.args[1], Ordering::Relaxed);
                }
                s.deadline.store(d, Ordering::SeqCst);
                s.network.store(take_network_wait() as u32, Ordering::SeqCst);
                s.state.store(State::Blocked as u32, Ordering::SeqCst);
            }
            None => {
                s.network.store(0, Ordering::SeqCst);
                s.state.store(State::Run as u32, Ordering::SeqCst);
            }
        }
    }
    if deadline.is_none() {
        // Preempted while busy: the turn took real time, and so much virtual time passes for the
        // others (a parent's timeout on a spinning child fires after about as long as on Linux).
        // A quantum's hand-off passes none (the holder's clock reads moved time as far as it
        // went): it is a count, and replays must see the same time.
        // Neither is a round without progress: counting it as one let time jump to the earliest
        // deadline, and a child that was slow to start on a loaded host (a Python start-up over
        // PREEMPT) saw its parent's 10 s select timeout expire at once.
        if let Pass::Preempted = why {
            let turn = crate::guestos::clock::monotonic_ns().saturating_sub(TURN_START.load(Ordering::SeqCst));
            r.mono.fetch_add(turn, Ordering::SeqCst);
        }
        PROGRESS.store(false, Ordering::Relaxed);
        r.idle.store(0, Ordering::SeqCst);
        hand_on(r, me);
        return;
    }
    let progress = PROGRESS.swap(false, Ordering::Relaxed);
    let idle = if progress { r.idle.store(1, Ordering::SeqCst); 1 } else { r.idle.fetch_add(1, Ordering::SeqCst) + 1 };
    if idle as usize >= members(r) {
        // Nobody made progress in a round, but a process that left may not be gone yet: until
        // it is, what it holds (a pipe's write end) has not changed, so its end is not visible
        // yet. That is no reason for time to move: wait for it (it is ending), and everybody
        // looks again once it is gone. A child that wrote its output and exited in one turn had
        // its parent's `communicate(timeout=999)` expire at once.
        match sweep_leaving(r) {
            Leaving::None => everybody_waits(r),
            Leaving::Gone => r.idle.store(0, Ordering::SeqCst),
            Leaving::Ending => {
                r.idle.store(0, Ordering::SeqCst);
                std::thread::sleep(IDLE_PAUSE);
            }
        }
    }
    hand_on(r, me);
}

/// A whole round without progress: move virtual time to the earliest deadline; without one, the
/// tree waits for the host (or is deadlocked, as it would be under Linux): pause a little.
fn everybody_waits(r: &Region) {
    r.idle.store(0, Ordering::SeqCst);
    // Between execs (the agent away), or while a process waits on the network, time is the host's.
    let host_time = r.slots.iter().any(|s| {
        let (pid, state) = (s.pid.load(Ordering::SeqCst), s.state.load(Ordering::SeqCst));
        pid != 0 && (state == State::Away as u32 || (state == State::Blocked as u32 && s.network.load(Ordering::SeqCst) == 1))
    });
    let next = r
        .slots
        .iter()
        .filter(|s| s.pid.load(Ordering::SeqCst) != 0 && s.state.load(Ordering::SeqCst) == State::Blocked as u32)
        .map(|s| s.deadline.load(Ordering::SeqCst))
        .min()
        .filter(|&d| d != u64::MAX);
    match next {
        // Between execs, background processes live in real time.
        Some(d) if !host_time => {
            r.mono.fetch_max(d, Ordering::SeqCst);
        }
        _ => {
            let t = Instant::now();
            std::thread::sleep(IDLE_PAUSE);
            if host_time || next.is_some() {
                r.mono.fetch_add(t.elapsed().as_nanos() as u64, Ordering::SeqCst);
            }
        }
    }
}

/// Give the token to the member after `me` in pid order (wrapping), or to nobody.
fn hand_on(r: &Region, me: u32) {
    let mut next: Option<u32> = None;
    let mut first: Option<u32> = None;
    for s in &r.slots {
        let pid = s.pid.load(Ordering::SeqCst);
        if pid == 0 || pid == me || !matches!(s.state.load(Ordering::SeqCst), 1 | 2) {
            continue;
        }
        first = Some(first.map_or(pid, |f: u32| f.min(pid)));
        if pid > me {
            next = Some(next.map_or(pid, |n: u32| n.min(pid)));
        }
    }
    let to = next.or(first).unwrap_or(0);
    // The new holder's time starts now (it may still be starting up: the waiters' preemption
    // counts from here).
    if let Some(s) = slot_of(r, to) {
        s.since.store(crate::guestos::clock::monotonic_ns(), Ordering::SeqCst);
    }
    if to == 0 && slot_of(r, me).is_some_and(|s| matches!(s.state.load(Ordering::SeqCst), 1 | 2)) {
        // Alone among the members: keep it.
        r.token.store(me, Ordering::SeqCst);
    } else {
        r.token.store(to, Ordering::SeqCst);
    }
    futex_wake(&r.token);
}

/// Wait for the token. False if `deadline` passed first.
fn acquire(r: &Region, me: u32, deadline: Instant) -> bool {
    loop {
        // Detached meanwhile (a new exec began, see `new_exec`): this process no longer takes turns.
        if !is_member(r, me) {
            return true;
        }
        let t = r.token.load(Ordering::SeqCst);
        if t == me || (t == 0 && r.token.compare_exchange(0, me, Ordering::SeqCst, Ordering::SeqCst).is_ok()) {
            start_turn();
            PROGRESS.store(false, Ordering::Relaxed);
            if let Some(s) = slot_of(r, me) {
                s.since.store(crate::guestos::clock::monotonic_ns(), Ordering::SeqCst);
                s.state.store(State::Run as u32, Ordering::SeqCst);
            }
            return true;
        }
        if Instant::now() >= deadline {
            return false;
        }
        if !futex_wait(&r.token, t, CHECK) {
            check_holder(r, t);
        }
    }
}

/// A waiter's look at holder `pid` after a while: gone without leaving (remove it), or running
/// guest code past [`PREEMPT`] (ask it to pass).
fn check_holder(r: &Region, pid: u32) {
    if pid == 0 {
        return;
    }
    let Some(s) = slot_of(r, pid) else {
        // Not a member (it left in between): the token is nobody's.
        let _ = r.token.compare_exchange(pid, 0, Ordering::SeqCst, Ordering::SeqCst);
        futex_wake(&r.token);
        return;
    };
    let host = s.host.load(Ordering::SeqCst);
    if host <= 0 {
        return; // a child still starting (see `before_fork`): nothing to check or signal yet
    }
    if !alive(host) {
        if r.token.load(Ordering::SeqCst) == pid {
            forget(r, pid);
        }
        return;
    }
    let since = s.since.load(Ordering::SeqCst);
    let now = crate::guestos::clock::monotonic_ns();
    let limit = if deadline_waited_for(r) { PREEMPT } else { PREEMPT_ANYWAY };
    if s.state.load(Ordering::SeqCst) == State::Run as u32 && now.saturating_sub(since) > limit.as_nanos() as u64 {
        s.since.store(now, Ordering::SeqCst);
        // SAFETY: a signal to a process of our own sandbox tree.
        unsafe { libc::kill(host, preempt_signal()) };
    }
}

/// Whether a member is blocked until a deadline (a sleep, a timeout).
fn deadline_waited_for(r: &Region) -> bool {
    r.slots.iter().any(|s| {
        s.pid.load(Ordering::SeqCst) != 0 && s.state.load(Ordering::SeqCst) == State::Blocked as u32 && s.deadline.load(Ordering::SeqCst) != u64::MAX
    })
}

/// Whether host process `pid` is still running (not exited, not a zombie).
fn alive(pid: i32) -> bool {
    // SAFETY: pidfd_open on a pid; the result is checked and closed.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as i32;
    if fd < 0 {
        return std::io::Error::last_os_error().raw_os_error() != Some(libc::ESRCH);
    }
    let mut p = libc::pollfd { fd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; then closing our descriptor.
    let exited = unsafe { libc::poll(&mut p, 1, 0) } > 0;
    // SAFETY: closing the descriptor we opened.
    unsafe { libc::close(fd) };
    !exited
}

/// Wait while `word` holds `val`, at most `timeout`. False on timeout.
fn futex_wait(word: &AtomicU32, val: u32, timeout: Duration) -> bool {
    let ts = libc::timespec { tv_sec: timeout.as_secs() as i64, tv_nsec: timeout.subsec_nanos() as i64 };
    // SAFETY: FUTEX_WAIT on a word of a shared mapping (not private: other processes wake it).
    let rc = unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, val, &ts as *const libc::timespec, 0usize, 0u32) };
    !(rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::ETIMEDOUT))
}

fn futex_wake(word: &AtomicU32) {
    // SAFETY: FUTEX_WAKE on a word of a shared mapping.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, i32::MAX, 0usize, 0usize, 0u32) };
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn region_fits_the_slots() {
        assert!(REGION_BYTES >= std::mem::size_of::<Region>());
        assert_eq!(REGION_BYTES % 4096, 0);
        assert_eq!(SLOTS as u32, 256, "one slot per process: vmm::process::MAX_PROCESSES");
    }
}
