//! The thread scheduler: a guest process's threads take turns on its one vCPU (M:1; the thread
//! state itself is `guestos::thread`).
//!
//! # When threads switch
//! The run loop asks [`schedule`] before every KVM_RUN. The loaded thread keeps the vCPU until
//! - its syscall parks it: a futex wait, sched_yield, exit, or a blocking call (a read of an empty
//!   pipe, a wait, a sleep, a poll) that asked to yield (`guestos::sched::yield_blocked`) and is
//!   re-executed when the thread runs again;
//! - its slice ends while another thread could run: after [`SLICE`] of wall time (a tick timer
//!   kicks the vCPU out of KVM_RUN), or in replay mode after [`QUANTUM`] syscalls and faults,
//!   which is a function of the program alone. Replay mode keeps a guard of the VMM's CPU
//!   time ([`REPLAY_GUARD`]; CPU, not wall time, so that a loaded host does not set it off) for a
//!   thread that spins without a syscall (that long without any event: [`spun`]); a switch made
//!   by it depends on the host's speed, and the run is marked as not reproducible
//!   ([`nondeterministic`]).
//!
//! The next thread is the first one after the current in creation order (round robin) that is
//! runnable or in a blocking call it has not retried since a runnable thread last ran. So a
//! blocked call is retried once per slice of the threads that compute: a thread that spins on a
//! condition that a blocked sibling must clear (multiprocessing's worker handler polls the
//! result pipe that the result handler's read would drain) lets that sibling go on, as Linux's
//! wake-up would. When every thread is in a blocking call and each has retried once, there is a
//! short host pause before the next round. When every thread waits on a futex, the process waits
//! for the earliest deadline: on the host, or in replay mode by moving virtual time there at once (when
//! the sandbox's other processes take turns, by passing the turn). No deadline, no other process
//! that could signal it and no signal pending is a deadlock: the process ends by SIGABRT with a
//! report listing every thread on its stderr, instead of hanging until the run's timeout.
//!
//! # Signals
//! Dispositions are the process's. The loaded thread's mask is `Proc::sigmask`; a parked thread
//! keeps its own. A process-directed signal that the loaded thread blocks goes to the first thread
//! that does not: a thread waiting on a futex is woken with EINTR, one in a blocking call retries
//! it (and gets EINTR or a restart by the usual rules), and it is run next. A signal sent with
//! tgkill waits in the thread's own set until it is loaded; it is then pending for the process
//! (delivered at once unless that thread blocks it).

use std::sync::atomic::{AtomicBool, AtomicI32, AtomicUsize, Ordering};
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_regs, kvm_xsave};

use super::Machine;
use crate::arch::x86_64::regs;
use crate::error::{Error, Result};
use crate::guestos::signal::{self, host};
use crate::guestos::thread::{self, RunState, Switch, Thread};
use crate::guestos::{sched, Errno, GuestOs, EAGAIN, EINVAL};
use crate::protocol::RunExit;

/// The CPU a guest process's threads take turns on, as the scheduler needs it: the guest OS
/// state, and the loaded thread's CPU state saved and replaced. A KVM vCPU ([`Machine`], below)
/// and a systrap stub (`vmm::systrap::Process`) are each one; the functions of this module are
/// generic over it (monomorphized: the KVM path calls the vCPU directly, as before).
pub(super) trait ThreadCpu {
    fn os(&self) -> Option<&GuestOs>;
    fn os_mut(&mut self) -> Option<&mut GuestOs>;
    /// The loaded thread's general registers, FS base and GS base (the CPU stopped in user mode,
    /// at a syscall's return or between two instructions).
    fn cpu_regs(&mut self) -> Result<(kvm_regs, u64, u64)>;
    /// Make these the registers the guest resumes with.
    fn set_cpu_regs(&mut self, regs: &kvm_regs, fs_base: u64, gs_base: u64) -> Result<()>;
    /// The loaded thread's XSAVE area into `out` (replacing what it held).
    fn cpu_xsave(&mut self, out: &mut Vec<u32>) -> Result<()>;
    /// Make `area` (one that `cpu_xsave` gave) the XSAVE state the guest resumes with.
    fn set_cpu_xsave(&mut self, area: &[u32]) -> Result<()>;
    /// Write guest memory (clone's tid words), best effort as Linux's put_user there.
    fn write_guest(&mut self, va: u64, data: &[u8]);
    /// Whether the CPU stopped in the guest's user code (not in a ring-0 stub of the KVM VM).
    fn in_user_mode(&mut self) -> Result<bool>;
    /// The CPU time (ns) the guest's code and its VMM thread have used, for replay mode's guard
    /// ([`REPLAY_GUARD`]). On KVM the guest runs on the VMM thread: its own CPU clock.
    fn cpu_ns(&self) -> u64 {
        cpu_ns()
    }
}

/// Wall time a thread runs before another runnable thread gets the vCPU (CPython's switch
/// interval is 5 ms too).
pub const SLICE: Duration = Duration::from_millis(5);
/// In replay mode, syscalls and faults a thread makes before another runnable thread gets a turn.
pub const QUANTUM: u32 = 100;
/// In replay mode, wall time a thread may run without reaching [`QUANTUM`] (a spin loop) before it
/// is switched out anyway.
pub const REPLAY_GUARD: Duration = Duration::from_millis(200);
/// Most threads a sandbox's processes may have beyond their first ones (RLIMIT_NPROC lower still).
pub const MAX_THREADS: u32 = 512;
/// The pause between idle rounds (every thread in a blocking call, none got anywhere).
const IDLE_PAUSE: Duration = Duration::from_millis(1);
const ETIMEDOUT: Errno = Errno(110);

/// Set when a switch happened that replay cannot reproduce (see [`REPLAY_GUARD`]); cleared by
/// [`take_nondeterministic`].
static NONDETERMINISTIC: AtomicBool = AtomicBool::new(false);

/// Whether a replay run switched threads by the wall clock since the last call (and so may not
/// reproduce), clearing the mark.
pub fn take_nondeterministic() -> bool {
    NONDETERMINISTIC.swap(false, Ordering::SeqCst)
}

/// A replay run did something whose place depends on the host's speed (a timer reached by
/// computing, `guestos::timer::charge`).
pub fn mark_nondeterministic() {
    NONDETERMINISTIC.store(true, Ordering::SeqCst);
}

/// Per-process scheduler bookkeeping that is not guest state.
struct Slice {
    /// When the loaded thread was loaded.
    since: Instant,
    /// This VMM thread's CPU time (ns) then: the replay guard counts CPU time, not wall time, so
    /// that a loaded host keeping the process off the CPU does not make it fire (and a run lose
    /// its reproducibility) while the thread is not computing at all.
    cpu: u64,
    /// Its syscalls and faults since then.
    events: u32,
    /// `events` when the replay guard's window of CPU time began (at `cpu`; see [`spun`]).
    guard_events: u32,
    /// Rounds so far: a round ends when a runnable thread is loaded, or when every thread waited and
    /// each blocked call was retried once (see the module comment and `pick`).
    round: u64,
}

static SLICE_STATE: std::sync::Mutex<Option<Slice>> = std::sync::Mutex::new(None);

/// The calling host thread's CPU time in ns (guest time in KVM_RUN included).
fn cpu_ns() -> u64 {
    let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec we own.
    if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut t) } != 0 {
        return 0;
    }
    (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
}

fn with_slice<T>(f: impl FnOnce(&mut Slice) -> T) -> T {
    let mut g = SLICE_STATE.lock().unwrap_or_else(|p| p.into_inner());
    let s = g.get_or_insert_with(|| Slice { since: Instant::now(), cpu: cpu_ns(), events: 0, guard_events: 0, round: 0 });
    f(s)
}

/// Replay mode's guard: whether the loaded thread ran [`REPLAY_GUARD`] of CPU time (`now`,
/// [`ThreadCpu::cpu_ns`]) without an event (a syscall, a fault, a clock read in the vDSO), as a spin loop does. A window
/// in which events came restarts it, so a thread that makes events is switched by their count
/// alone ([`QUANTUM`]), however slow the host: where an exit costs milliseconds (the upstream-KVM
/// lane's emulated host), a quantum of events took more than the guard's CPU time, and the switch
/// came where the host's speed put it, so a fork and its parent (whose clock differs: a forked
/// VMM's CPU clock starts again from zero, which restarts a window here too) replayed apart.
fn spun(now: u64) -> bool {
    with_slice(|s| {
        if now < s.cpu || (now - s.cpu >= REPLAY_GUARD.as_nanos() as u64 && s.events != s.guard_events) {
            s.cpu = now;
            s.guard_events = s.events;
            return false;
        }
        now - s.cpu >= REPLAY_GUARD.as_nanos() as u64
    })
}

/// A syscall or fault of the loaded thread (replay mode's quantum counts these).
pub(super) fn count_event() {
    count_events(1);
}

/// `n` events: the clock reads the vDSO answered without an exit count as the syscalls they were.
pub(super) fn count_events(n: u64) {
    with_slice(|s| s.events = s.events.saturating_add(n.min(u32::MAX as u64) as u32));
}

/// How many clock reads the loaded thread may make in the vDSO before the read after which
/// [`schedule`] would switch threads in replay mode (at least [`QUANTUM`] events, and another
/// thread ready: runnable, or its deadline reached by the quanta those reads add). That read makes
/// the syscall, so the switch comes where every read exiting would have put it (`guestos::vdso`).
/// No limit with one thread; outside replay mode the vDSO makes every read a syscall anyway.
pub(super) fn vdso_budget<C: ThreadCpu>(m: &C) -> u64 {
    let Some(os) = m.os() else { return 0 };
    let th = &os.threads;
    if !os.proc.clocks.replay || !th.multi() || !th.loaded {
        return if os.proc.clocks.replay && !th.multi() { u64::MAX } else { 0 };
    }
    let events = with_slice(|s| s.events) as u64;
    let to_quantum = (QUANTUM as u64).saturating_sub(events);
    let now = thread::now(&os.proc.clocks);
    let to_ready = if others_ready(m, now) {
        0
    } else {
        th.list
            .iter()
            .enumerate()
            .filter(|(i, _)| *i != th.cur)
            .filter_map(|(_, t)| match t.state {
                RunState::Futex { deadline, .. } | RunState::Retry { deadline } => deadline,
                RunState::Sleep { deadline } => Some(deadline),
                RunState::Runnable => None,
            })
            .min()
            .map_or(u64::MAX, |d| d.saturating_sub(now).div_ceil(crate::guestos::clock::CLOCK_QUANTUM_NS))
    };
    to_quantum.max(to_ready).saturating_sub(1)
}

// --- clone -------------------------------------------------------------------------------------

/// What clone(CLONE_THREAD) asked for.
pub(super) struct NewThread {
    pub flags: u64,
    /// The new thread's stack pointer (None: the caller's).
    pub sp: Option<u64>,
    pub parent_tid: u64,
    pub child_tid: u64,
    pub tls: u64,
}

const CLONE_VM: u64 = 0x100;
const CLONE_FS: u64 = 0x200;
const CLONE_FILES: u64 = 0x400;
const CLONE_SIGHAND: u64 = 0x800;
const CLONE_THREAD: u64 = 0x1_0000;
const CLONE_SYSVSEM: u64 = 0x4_0000;
const CLONE_SETTLS: u64 = 0x8_0000;
const CLONE_PARENT_SETTID: u64 = 0x10_0000;
const CLONE_CHILD_CLEARTID: u64 = 0x20_0000;
const CLONE_DETACHED: u64 = 0x40_0000;
const CLONE_UNTRACED: u64 = 0x80_0000;
const CLONE_CHILD_SETTID: u64 = 0x100_0000;
const CLONE_IO: u64 = 0x8000_0000;

/// clone with CLONE_THREAD: a new thread of this process, runnable, resuming after the syscall
/// with rax = 0 on its own stack and TLS. Returns its tid to the caller.
pub(super) fn clone_thread<C: ThreadCpu>(m: &mut C, r: &kvm_regs, fs_base: u64, gs_base: u64, t: NewThread) -> std::result::Result<u64, Errno> {
    let need = CLONE_VM | CLONE_SIGHAND | CLONE_THREAD;
    let allowed = need | CLONE_FS | CLONE_FILES | CLONE_SYSVSEM | CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID
        | CLONE_DETACHED | CLONE_UNTRACED | CLONE_CHILD_SETTID | CLONE_IO;
    // A thread shares memory, handlers, files and the fs context (one process, one table each).
    if t.flags & need != need || t.flags & !allowed != 0 || t.flags & (CLONE_FS | CLONE_FILES) != CLONE_FS | CLONE_FILES {
        return Err(EINVAL);
    }
    if t.flags & CLONE_SETTLS != 0 && t.tls >= crate::guestos::mm::TASK_SIZE {
        return Err(crate::guestos::EPERM);
    }
    let Some(os) = m.os() else { return Err(crate::guestos::ENOSYS) };
    if host::stale() {
        return Err(EAGAIN);
    }
    let nproc = os.proc.rlimits.get(6).map_or(u64::MAX, |l| l.cur);
    if !host::add_thread(nproc.min(MAX_THREADS as u64) as u32) || os.threads.list.len() > MAX_THREADS as usize {
        return Err(EAGAIN);
    }
    let mut xsave = Vec::new();
    m.cpu_xsave(&mut xsave).map_err(|_| EAGAIN)?;
    // SAFETY: getpid cannot fail (the fallback outside a sandbox tree, which has no counter).
    let tid = host::alloc_pid().unwrap_or_else(|| unsafe { libc::getpid() } + m.os().map_or(1, |o| o.threads.list.len() as i32));
    let Some(os) = m.os_mut() else { return Err(crate::guestos::ENOSYS) };
    let mut th = Thread::new(tid);
    th.regs = *r;
    th.regs.rax = 0;
    if let Some(sp) = t.sp {
        th.regs.rsp = sp;
    }
    th.fs_base = if t.flags & CLONE_SETTLS != 0 { t.tls } else { fs_base };
    th.gs_base = gs_base;
    th.xsave = xsave;
    th.sigmask = os.proc.sigmask;
    th.comm = os.proc.comm;
    th.clear_child_tid = if t.flags & CLONE_CHILD_CLEARTID != 0 { t.child_tid } else { 0 };
    os.threads.list.push(th);
    let tid_bytes = tid.to_le_bytes();
    if t.flags & CLONE_PARENT_SETTID != 0 {
        m.write_guest(t.parent_tid, &tid_bytes);
    }
    if t.flags & CLONE_CHILD_SETTID != 0 {
        m.write_guest(t.child_tid, &tid_bytes);
    }
    sched::set_thread_turns(true);
    Ok(tid as u64)
}

// --- switching ---------------------------------------------------------------------------------

/// Save the loaded thread into its record, with run state `state` (the CPU is in user mode). What
/// a save and a load cost depends on the CPU (see the `ThreadCpu` impls).
fn park<C: ThreadCpu>(m: &mut C, state: RunState) -> Result<()> {
    let (regs, fs_base, gs_base) = m.cpu_regs()?;
    let Some(mut xs) = m.os_mut().and_then(|os| os.threads.list.get_mut(os.threads.cur)).map(|t| std::mem::take(&mut t.xsave)) else {
        return Ok(());
    };
    let saved = m.cpu_xsave(&mut xs);
    let Some(os) = m.os_mut() else { return Ok(()) };
    let i = os.threads.cur;
    let Some(t) = os.threads.list.get_mut(i) else { return Ok(()) };
    t.xsave = xs;
    saved?;
    t.regs = regs;
    t.fs_base = fs_base;
    t.gs_base = gs_base;
    t.sigmask = os.proc.sigmask;
    t.altstack = os.proc.altstack;
    t.clear_child_tid = os.proc.clear_child_tid;
    t.robust_list = os.proc.robust_list;
    t.comm = os.proc.comm;
    t.sleep = os.proc.sleep.take();
    t.saved_mask = os.sig.saved_mask.take();
    t.carry = sched::save_carry();
    t.state = state;
    os.threads.loaded = false;
    Ok(())
}

/// Load thread `i` into the CPU and the per-thread fields of the OS state.
fn load<C: ThreadCpu>(m: &mut C, i: usize) -> Result<()> {
    let cpu = m.cpu_ns();
    let Some(t) = m.os_mut().and_then(|os| os.threads.list.get_mut(i)) else { return Ok(()) };
    let (regs, fs_base, gs_base, xs) = (t.regs, t.fs_base, t.gs_base, std::mem::take(&mut t.xsave));
    let set = m.set_cpu_regs(&regs, fs_base, gs_base).and_then(|_| if xs.is_empty() { Ok(()) } else { m.set_cpu_xsave(&xs) });
    let Some(os) = m.os_mut() else { return Ok(()) };
    let Some(t) = os.threads.list.get_mut(i) else { return Ok(()) };
    t.xsave = xs;
    set?;
    os.proc.sigmask = t.sigmask;
    os.proc.altstack = t.altstack;
    os.proc.clear_child_tid = t.clear_child_tid;
    os.proc.robust_list = t.robust_list;
    os.proc.comm = t.comm;
    os.proc.sleep = t.sleep.take();
    os.sig.saved_mask = t.saved_mask.take();
    sched::restore_carry(std::mem::take(&mut t.carry));
    // Signals sent to this thread are the process's now that it runs (see the module comment).
    os.sig.pending |= std::mem::take(&mut t.pending);
    t.state = RunState::Runnable;
    os.threads.cur = i;
    os.threads.loaded = true;
    with_slice(|s| {
        s.since = Instant::now();
        s.cpu = cpu;
        s.events = 0;
        s.guard_events = 0;
    });
    set_turns(m);
    Ok(())
}

/// Tell blocking calls whether another thread could run meanwhile, and keep the tick timer armed
/// exactly then.
fn set_turns<C: ThreadCpu>(m: &C) {
    let Some(os) = m.os() else { return };
    let th = &os.threads;
    let others = th.list.iter().enumerate().any(|(i, t)| {
        i != th.cur
            && match t.state {
                RunState::Runnable | RunState::Retry { .. } | RunState::Sleep { .. } => true,
                RunState::Futex { deadline, .. } => deadline.is_some(),
            }
    });
    sched::set_thread_turns(others && th.multi());
    let tick = if !others || !th.multi() {
        None
    } else if os.proc.clocks.replay {
        Some(REPLAY_GUARD)
    } else {
        Some(SLICE)
    };
    ticker::set(tick);
}

/// Whether a thread other than the loaded one can run now (runnable, or its deadline passed).
fn others_ready<C: ThreadCpu>(m: &C, now: u64) -> bool {
    let Some(os) = m.os() else { return false };
    let th = &os.threads;
    th.list.iter().enumerate().any(|(i, t)| {
        i != th.cur
            && match t.state {
                RunState::Runnable | RunState::Retry { deadline: None } => true,
                RunState::Futex { deadline: Some(d), .. } | RunState::Retry { deadline: Some(d) } | RunState::Sleep { deadline: d } => d <= now,
                RunState::Futex { deadline: None, .. } => false,
            }
    })
}

/// Before every KVM_RUN of a Linux guest: switch threads if the loaded one is done for now, and
/// wait if nobody can run. `Some(exit)` ends the run (its deadline passed while every thread
/// waited, or the process is deadlocked).
pub(super) fn schedule<C: ThreadCpu>(m: &mut C, deadline: Instant) -> Result<Option<RunExit>> {
    // Replay mode's guard reads the CPU clock (only where it may switch a computing thread out).
    let guard_cpu = m.os().is_some_and(|os| os.proc.clocks.replay && os.threads.multi() && os.threads.loaded && os.threads.switch.is_none()).then(|| m.cpu_ns());
    let Some(os) = m.os_mut() else { return Ok(None) };
    let th = &mut os.threads;
    if !th.multi() && th.loaded && th.switch.is_none() {
        return Ok(None);
    }
    th.apply_wakes();
    let replay = os.proc.clocks.replay;
    let thread_yield = sched::take_thread_yield();
    if os.threads.loaded {
        match os.threads.switch.take() {
            Some(Switch::Exit) => {
                let i = os.threads.cur;
                os.threads.list.remove(i);
                os.threads.loaded = false;
                os.threads.cur = if i == 0 { os.threads.list.len().saturating_sub(1) } else { i - 1 };
                let _ = sched::save_carry();
                host::threads_gone(1);
            }
            Some(Switch::Futex { key, bitset, deadline }) => park(m, RunState::Futex { key, bitset, deadline })?,
            Some(Switch::Yield) => park(m, RunState::Runnable)?,
            None => match thread_yield {
                Some((Some(d), true)) => park(m, RunState::Sleep { deadline: d })?,
                Some((d, _)) => {
                    let network = sched::take_network_wait();
                    park(m, RunState::Retry { deadline: d })?;
                    if let Some(t) = m.os_mut().and_then(|os| os.threads.list.get_mut(os.threads.cur)) {
                        t.network = network;
                    }
                }
                None => {
                    if !os.threads.multi() {
                        return Ok(None);
                    }
                    let (since, events) = with_slice(|s| (s.since, s.events));
                    let guard = replay && guard_cpu.is_some_and(spun);
                    let due = if replay { events >= QUANTUM || guard } else { since.elapsed() >= SLICE };
                    let mut now = thread::now(&os.proc.clocks);
                    if guard && events < QUANTUM && !others_ready(m, now) && in_ring3(m)? {
                        // A thread computing without syscalls while others wait for a deadline
                        // (CPython's GIL: the waiter's 5 ms): virtual time would never get
                        // there. The guard lets it come, at a point the host's speed chose.
                        if let Some(d) = m.os().and_then(|os| os.threads.earliest_deadline()) {
                            if let Some(os) = m.os_mut() {
                                os.proc.clocks.pass(d.saturating_sub(now));
                                now = thread::now(&os.proc.clocks);
                            }
                        }
                    }
                    if !due || !others_ready(m, now) || !in_ring3(m)? {
                        set_turns(m);
                        return Ok(None);
                    }
                    if replay && events < QUANTUM {
                        NONDETERMINISTIC.store(true, Ordering::SeqCst);
                    }
                    park(m, RunState::Runnable)?
                }
            },
        }
    }
    pick(m, deadline)
}

fn in_ring3<C: ThreadCpu>(m: &mut C) -> Result<bool> {
    m.in_user_mode()
}

/// Nothing is loaded: load the next thread to run, waiting for one if need be.
fn pick<C: ThreadCpu>(m: &mut C, deadline: Instant) -> Result<Option<RunExit>> {
    loop {
        let Some(os) = m.os_mut() else { return Ok(None) };
        let replay = os.proc.clocks.replay;
        if os.threads.list.is_empty() {
            // Cannot happen (the last thread's exit is the process's), but never run nothing.
            return Ok(Some(RunExit::Exited { code: 0 }));
        }
        signal::gather(os);
        let now = thread::now(&os.proc.clocks);
        let pending = os.sig.pending;
        let th = &mut os.threads;
        // Deadlines that passed.
        for t in th.list.iter_mut() {
            match t.state {
                RunState::Futex { deadline: Some(d), .. } if d <= now => {
                    th.futex.cancel(t.tid);
                    t.state = RunState::Runnable;
                    t.regs.rax = (-(ETIMEDOUT.0 as i64)) as u64;
                }
                RunState::Retry { deadline: Some(d) } | RunState::Sleep { deadline: d } if d <= now => t.state = RunState::Runnable,
                _ => {}
            }
        }
        // A signal goes to the first thread that does not block it (see the module comment).
        let mut signalled = None;
        for (i, t) in th.list.iter_mut().enumerate() {
            let p = (pending | t.pending) & !(t.sigmask & !signal::UNBLOCKABLE);
            if p == 0 {
                continue;
            }
            match t.state {
                RunState::Futex { .. } => {
                    th.futex.cancel(t.tid);
                    t.state = RunState::Runnable;
                    t.regs.rax = (-(crate::guestos::EINTR.0 as i64)) as u64;
                }
                RunState::Retry { .. } | RunState::Sleep { .. } => t.state = RunState::Runnable,
                RunState::Runnable => {}
            }
            signalled = Some(i);
            break;
        }
        // The next in round-robin order that can go on: a runnable thread, or one in a blocking
        // call that has not retried it in this round. A round ends when a runnable thread is
        // loaded (what it does may be what a blocked call waits for), or when every thread waits
        // and each has retried once (the idle pause below).
        let n = th.list.len();
        let start = (th.cur + 1) % n;
        let round = with_slice(|s| s.round);
        let next = signalled.or_else(|| {
            (0..n).map(|k| (start + k) % n).find(|&i| match th.list[i].state {
                RunState::Runnable => true,
                RunState::Retry { .. } => th.list[i].retried_in != round,
                RunState::Futex { .. } | RunState::Sleep { .. } => false,
            })
        });
        if let Some(i) = next {
            if matches!(th.list[i].state, RunState::Retry { .. }) {
                th.list[i].retried_in = round;
            } else {
                with_slice(|s| s.round += 1);
            }
            load(m, i)?;
            return Ok(None);
        }
        let any_retry = th.list.iter().any(|t| matches!(t.state, RunState::Retry { .. }));
        if Instant::now() >= deadline {
            return Ok(Some(RunExit::Timeout));
        }
        let earliest = th.earliest_deadline();
        if any_retry {
            // Every thread is in a blocking call and each has retried once: a short pause. One
            // that waits on the network waits for the world outside: time passes as on the host.
            with_slice(|s| s.round += 1);
            let network = th.list.iter().any(|t| t.network && matches!(t.state, RunState::Retry { .. }));
            if replay && sched::tree_active() {
                if network {
                    sched::mark_network_wait();
                }
                let clocks = &mut os.proc.clocks;
                let mono = clocks.mono_now();
                if !sched::idle_turn(mono, &mut |ns| clocks.pass(ns), earliest, deadline) {
                    return Ok(Some(RunExit::Timeout));
                }
            } else if let (true, Some(d), false) = (replay, earliest, network) {
                // Replay mode: a whole round got nowhere and nothing outside the process can act
                // (no other process takes turns): the next deadline comes at once.
                os.proc.clocks.pass(d.saturating_sub(now));
            } else {
                let from = Instant::now();
                host_pause(IDLE_PAUSE);
                if replay && network {
                    os.proc.clocks.pass(from.elapsed().as_nanos() as u64);
                }
            }
            continue;
        }
        // Every thread waits on a futex.
        let shared = th.list.iter().any(|t| matches!(t.state, RunState::Futex { key: crate::guestos::futex::FutexKey::Shared { .. }, .. }));
        if earliest.is_none() && !shared && host::alone() && !host::pending() {
            return Ok(Some(deadlock(m)));
        }
        if replay && sched::tree_active() {
            let clocks = &mut os.proc.clocks;
            let mono = clocks.mono_now();
            if !sched::idle_turn(mono, &mut |ns| clocks.pass(ns), earliest, deadline) {
                return Ok(Some(RunExit::Timeout));
            }
            continue;
        }
        match earliest {
            // Replay mode: nothing else can happen before the deadline, so it comes at once.
            Some(d) if replay => os.proc.clocks.pass(d.saturating_sub(now)),
            Some(d) => host_pause(Duration::from_nanos(d.saturating_sub(now)).min(Duration::from_millis(50))),
            None => host_pause(Duration::from_millis(10)),
        }
    }
}

/// Sleep on the host (a guest signal from another process cuts it short).
fn host_pause(d: Duration) {
    let ts = libc::timespec { tv_sec: d.as_secs() as i64, tv_nsec: d.subsec_nanos() as i64 };
    // SAFETY: a relative sleep on a local timespec; an early return is fine.
    unsafe { libc::clock_nanosleep(libc::CLOCK_MONOTONIC, 0, &ts, std::ptr::null_mut()) };
}

/// Every thread waits and nothing can wake any of them: say so on the sandbox's stderr and end
/// the process (SIGABRT), rather than hang until the run's timeout.
fn deadlock<C: ThreadCpu>(m: &mut C) -> RunExit {
    if let Some(os) = m.os() {
        let msg = format!(
            "collimate: deadlock in guest process {}: every thread waits and nothing can wake them:\n{}",
            os.proc.pid,
            os.threads.describe(os.proc.pid)
        );
        report(&msg);
    }
    RunExit::Signaled { signo: signal::SIGABRT }
}

/// The process ends (exit_group, a fatal signal): its other threads give their tasks back.
pub(super) fn process_ended<C: ThreadCpu>(m: &mut C) {
    ticker::set(None);
    sched::set_thread_turns(false);
    if let Some(os) = m.os_mut() {
        let extra = os.threads.list.len().saturating_sub(1) as u32;
        host::threads_gone(extra);
    }
}

/// The run ends: no ticks while the guest is paused.
pub(super) fn run_ended() {
    ticker::set(None);
}

/// Only the calling thread goes on: in a guest fork's child, whose copies of the other threads
/// were never its own (they live on in the parent and stay counted there: `give_back` false).
pub(super) fn only_current<C: ThreadCpu>(m: &mut C, give_back: bool) {
    if let Some(os) = m.os_mut() {
        let gone = os.threads.only_current();
        if give_back {
            host::threads_gone(gone as u32);
        }
    }
    sched::set_thread_turns(false);
    ticker::set(None);
}

/// A new sandbox tree begins with this process (a sandbox fork): its extra threads are counted.
pub(super) fn count_in_new_tree<C: ThreadCpu>(m: &C) {
    let extra = m.os().map_or(0, |os| os.threads.list.len().saturating_sub(1));
    host::set_thread_count(extra as u32);
}

/// The tick timer: a one-shot per slice, signalling a VMM-private real-time signal whose handler
/// kicks the vCPU out of KVM_RUN. It is SA_RESTART, so host calls the engine makes are restarted
/// rather than failing with EINTR. POSIX timers are not inherited across fork: each process
/// makes its own on first use.
mod ticker {
    use super::*;

    static TIMER: AtomicUsize = AtomicUsize::new(0);
    static OWNER: AtomicI32 = AtomicI32::new(0);
    static ARMED: AtomicBool = AtomicBool::new(false);

    fn signal() -> libc::c_int {
        libc::SIGRTMIN() + 4
    }

    extern "C" fn on_tick(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
        host::kick();
    }

    fn timer() -> Option<libc::timer_t> {
        // SAFETY: getpid cannot fail.
        let me = unsafe { libc::getpid() };
        if OWNER.load(Ordering::SeqCst) != me {
            // SAFETY: a zeroed sigaction/sigevent is valid; we fill what we use.
            unsafe {
                let mut sa: libc::sigaction = std::mem::zeroed();
                sa.sa_sigaction = on_tick as *const () as usize;
                sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
                libc::sigemptyset(&mut sa.sa_mask);
                libc::sigaction(signal(), &sa, std::ptr::null_mut());
                let mut sev: libc::sigevent = std::mem::zeroed();
                sev.sigev_notify = libc::SIGEV_SIGNAL;
                sev.sigev_signo = signal();
                let mut t: libc::timer_t = std::ptr::null_mut();
                if libc::timer_create(libc::CLOCK_MONOTONIC, &mut sev, &mut t) != 0 {
                    return None;
                }
                TIMER.store(t as usize, Ordering::SeqCst);
            }
            OWNER.store(me, Ordering::SeqCst);
            ARMED.store(false, Ordering::SeqCst);
        }
        Some(TIMER.load(Ordering::SeqCst) as libc::timer_t)
    }

    /// Tick every `every` (None: no ticks).
    pub(super) fn set(every: Option<Duration>) {
        if every.is_none() && !ARMED.load(Ordering::SeqCst) {
            return;
        }
        let Some(t) = timer() else { return };
        let d = every.unwrap_or(Duration::ZERO);
        let ts = libc::timespec { tv_sec: d.as_secs() as i64, tv_nsec: d.subsec_nanos() as i64 };
        let spec = libc::itimerspec { it_interval: ts, it_value: ts };
        if every.is_some() && ARMED.load(Ordering::SeqCst) {
            return; // already ticking; the slice start decides
        }
        // SAFETY: our timer and a valid itimerspec (zero disarms).
        unsafe { libc::timer_settime(t, 0, &spec, std::ptr::null_mut()) };
        ARMED.store(every.is_some(), Ordering::SeqCst);
    }
}

/// What the scheduler has to tell the guest's stderr (a deadlock report), for the run's output.
static REPORT: std::sync::Mutex<String> = std::sync::Mutex::new(String::new());

fn report(msg: &str) {
    REPORT.lock().unwrap_or_else(|p| p.into_inner()).push_str(msg);
}

/// Take what [`report`] collected (the run appends it to the guest's stderr).
pub(super) fn take_report() -> String {
    std::mem::take(&mut *REPORT.lock().unwrap_or_else(|p| p.into_inner()))
}


/// The KVM vCPU as the threads' CPU. The general and special registers go through `kvm_run`'s
/// sync area (`vstate::sync`): after a syscall they are the pending write of its return, read
/// without an ioctl, and a load leaves the next thread's as the pending write. Under kvm_pvm each
/// register ioctl costs about as much as a VM exit (15-19 us), so a switch costs the two xsave
/// ioctls only.
impl ThreadCpu for Machine {
    fn os(&self) -> Option<&GuestOs> {
        self.os.as_ref()
    }

    fn os_mut(&mut self) -> Option<&mut GuestOs> {
        self.os.as_mut()
    }

    fn cpu_regs(&mut self) -> Result<(kvm_regs, u64, u64)> {
        let (regs, sregs) = self.sync.current(&mut self.vcpu)?;
        Ok((regs, sregs.fs.base, sregs.gs.base))
    }

    fn set_cpu_regs(&mut self, r: &kvm_regs, fs_base: u64, gs_base: u64) -> Result<()> {
        // The registers are about to be replaced: the stopped instruction first (`Machine::complete_io`).
        self.complete_io()?;
        let (_, mut sregs) = self.sync.current(&mut self.vcpu)?;
        sregs.fs.base = fs_base;
        sregs.gs.base = gs_base;
        sregs.cs = regs::user_code_segment();
        sregs.ss = regs::user_data_segment();
        self.sync.write(&mut self.vcpu, r, &sregs)
    }

    fn cpu_xsave(&mut self, out: &mut Vec<u32>) -> Result<()> {
        let xs = self.vcpu.get_xsave().map_err(Error::kvm("KVM_GET_XSAVE"))?;
        out.clear();
        out.extend_from_slice(&xs.region);
        Ok(())
    }

    fn set_cpu_xsave(&mut self, area: &[u32]) -> Result<()> {
        if area.len() != 1024 {
            return Ok(());
        }
        let mut xs = kvm_xsave::default();
        xs.region.copy_from_slice(area);
        // SAFETY: a complete kvm_xsave captured from this vCPU by `park` or `clone_thread`.
        unsafe { self.vcpu.set_xsave(&xs) }.map_err(Error::kvm("KVM_SET_XSAVE"))
    }

    fn write_guest(&mut self, va: u64, data: &[u8]) {
        let _ = self.runtime.aspace.write_virt(&mut self.mem, va, data, true);
    }

    fn in_user_mode(&mut self) -> Result<bool> {
        let (_, sregs) = self.sync.current(&mut self.vcpu)?;
        Ok(sregs.cs.selector & 3 == 3)
    }
}
