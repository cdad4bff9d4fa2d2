//! Timers: alarm, setitimer/getitimer, POSIX timers (timer_create, timer_settime, timer_gettime,
//! timer_getoverrun, timer_delete) and timerfd, all on the guest's clocks.
//!
//! A timer is a deadline on the timer clock ([`super::thread::now`]: the virtual monotonic clock
//! in replay mode, the host's otherwise; CLOCK_REALTIME timers are converted to it when set) or,
//! for ITIMER_VIRTUAL, ITIMER_PROF and CPU-clock POSIX timers, on the process's CPU clock. It
//! fires when its process looks ([`fire_due`]): at every syscall, at every look for signals in a
//! blocking call, and when the run loop's host timer kicks the vCPU out of the guest
//! ([`host_budget`]). Firing raises its signal (or counts an expiration of a timerfd) and rearms
//! an interval timer past now, counting the overruns.
//!
//! What makes a timer fire in virtual time:
//! - **A wait**: every blocking call's deadline is the earlier of its own and the process's next
//!   timer (`guestos::sched::set_timer_deadline`), so when every process of the sandbox waits,
//!   the tree's virtual clock jumps to the timer and its process runs again to fire it
//!   (`timeout 1 sleep 5`: timeout's SIGALRM at virtual 1 s, then its SIGTERM ends the sleep).
//!   A process alone in its sandbox that sleeps, waits for a signal or blocks reading a pipe
//!   past its timer has its clock moved to the timer instead ([`until_next`], [`blocked_alone`]).
//! - **Thread-directed**: a SIGEV_THREAD_ID timer's signal is for its thread (pending in that
//!   thread's own set while it is parked, as a tgkill's); nothing is sent once it has exited.
//! - **Clock reads**: the vDSO answers at most as many reads as reach the timer's deadline; the
//!   read that gets there makes the syscall that fires it ([`vdso_budget`]).
//! - **Computing**: a process that runs guest code without exits while a timer is armed has its
//!   virtual clock follow the real time it runs: the run loop arms a host timer for the time left
//!   to the deadline (less what earlier stretches of computing already used), and when that
//!   kicks, virtual time moves to the deadline ([`charge`]). Where in the program that happens
//!   depends on the host's speed, so such a run is marked not reproducible (`seed_ack`).
//!
//! Linux's inheritance: a fork's child starts with no timers ([`Timers::on_fork`]); execve keeps
//! alarm and the itimers and deletes POSIX timers ([`Timers::on_exec`]). Timerfds are files
//! (`files::Kind::Host` on a host eventfd that counts expirations, see [`sys_timerfd_create`]):
//! the process that armed one fires it; a fork's child shares the file but not the timer.

use std::os::fd::{FromRawFd, OwnedFd};
use std::sync::atomic::AtomicU64;
use std::sync::atomic::Ordering::Relaxed;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use super::clock::{self, timespec_bytes};
use super::signal::{self, SigInfo};
use super::{Ctx, Errno, GuestOs, SysResult, EFAULT, EINVAL};

const SIGALRM: i32 = 14;
const SIGVTALRM: i32 = 26;
const SIGPROF: i32 = 27;
const SI_TIMER: i32 = -2;
const SIGEV_SIGNAL: i32 = 0;
const SIGEV_NONE: i32 = 1;
const SIGEV_THREAD_ID: i32 = 4;
const TIMER_ABSTIME: u64 = 1;
/// The most POSIX timers one process may have (Linux's limit is RLIMIT_SIGPENDING).
const MAX_TIMERS: usize = 4096;

/// One armed (or disarmed) countdown: the deadline (0: disarmed) and the reload interval, ns.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Arm {
    pub deadline: u64,
    pub interval: u64,
}

/// What a timer measures.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Base {
    /// The timer clock (monotonic; realtime deadlines are converted when set).
    #[default]
    Wall,
    /// The process's CPU time.
    Cpu,
}

/// A POSIX timer (timer_create).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PosixTimer {
    pub id: i32,
    pub base: Base,
    /// Whether it was created on CLOCK_REALTIME (timer_settime's TIMER_ABSTIME reads that clock).
    pub realtime: bool,
    /// SIGEV_SIGNAL / SIGEV_THREAD_ID (a signal) or SIGEV_NONE (nothing).
    pub signo: i32,
    /// SIGEV_THREAD_ID: the thread its signal is for (its tid); 0: the process (SIGEV_SIGNAL).
    pub tid: i32,
    pub value: u64,
    pub arm: Arm,
    /// Expirations not delivered (the signal was still pending), for timer_getoverrun.
    pub overrun: u32,
}

/// A process's timers.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Timers {
    /// ITIMER_REAL (and alarm), ITIMER_VIRTUAL, ITIMER_PROF.
    pub real: Arm,
    pub virt: Arm,
    pub prof: Arm,
    pub posix: Vec<PosixTimer>,
    /// Whether the wall deadlines are on the virtual clock (replay mode) or the host's.
    pub virtual_base: bool,
    /// Timerfds this process armed. Host-side only (a snapshot holds none).
    #[serde(skip)]
    pub fds: Vec<TimerFd>,
}

/// A timerfd this process armed: its host eventfd (the guest's file) and its countdown.
#[derive(Clone)]
pub struct TimerFd {
    pub file: Arc<super::files::OpenFile>,
    pub arm: Arm,
    pub realtime: bool,
}

impl std::fmt::Debug for TimerFd {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TimerFd({:?}, realtime {})", self.arm, self.realtime)
    }
}

impl PartialEq for TimerFd {
    fn eq(&self, o: &Self) -> bool {
        Arc::ptr_eq(&self.file, &o.file) && self.arm == o.arm
    }
}
impl Eq for TimerFd {}

impl Timers {
    /// A fork's child: no alarm, no itimers, no POSIX timers, no timerfd countdowns (Linux).
    pub fn on_fork(&mut self) {
        *self = Timers { virtual_base: self.virtual_base, ..Default::default() };
    }

    /// execve: POSIX timers go; alarm and the itimers stay.
    pub fn on_exec(&mut self) {
        self.posix.clear();
        self.fds.clear();
    }

    /// Whether a countdown is armed at all (the fast path of every syscall).
    pub fn armed(&self) -> bool {
        self.real.deadline != 0
            || self.virt.deadline != 0
            || self.prof.deadline != 0
            || self.posix.iter().any(|t| t.arm.deadline != 0)
            || self.fds.iter().any(|t| t.arm.deadline != 0)
    }

    /// The earliest wall deadline on the timer clock (u64::MAX: none).
    pub fn next_wall(&self) -> u64 {
        let posix = self.posix.iter().filter(|t| t.base == Base::Wall).map(|t| t.arm.deadline);
        let fds = self.fds.iter().map(|t| t.arm.deadline);
        std::iter::once(self.real.deadline).chain(posix).chain(fds).filter(|&d| d != 0).min().unwrap_or(u64::MAX)
    }

    fn next_cpu(&self) -> u64 {
        let posix = self.posix.iter().filter(|t| t.base == Base::Cpu).map(|t| t.arm.deadline);
        [self.virt.deadline, self.prof.deadline].into_iter().chain(posix).filter(|&d| d != 0).min().unwrap_or(u64::MAX)
    }
}

/// The timer clock now (see the module comment).
fn wall_now(os: &GuestOs) -> u64 {
    super::thread::now(&os.proc.clocks)
}

/// The process's CPU time now, without counting as a clock read.
fn cpu_now(os: &GuestOs) -> u64 {
    let c = &os.proc.clocks;
    if c.replay {
        c.cpu_base.saturating_add(c.cpu_elapsed)
    } else {
        let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_gettime into a local timespec.
        unsafe { libc::clock_gettime(libc::CLOCK_PROCESS_CPUTIME_ID, &mut ts) };
        (ts.tv_sec.max(0) as u64) * 1_000_000_000 + ts.tv_nsec.max(0) as u64
    }
}

/// CLOCK_REALTIME now minus the timer clock now: what converts a realtime deadline.
fn real_offset(os: &mut GuestOs) -> i128 {
    let c = os.proc.clocks;
    let real = if c.replay { c.real_base.saturating_add(c.elapsed) } else { host_real() };
    real as i128 - wall_now(os) as i128
}

fn host_real() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut ts) };
    (ts.tv_sec.max(0) as u64) * 1_000_000_000 + ts.tv_nsec.max(0) as u64
}

/// The clock mode changed (a reseed turned replay mode on or off): every deadline keeps the
/// time it had left. `old_wall`, `old_cpu`: the timer clock and the CPU clock in the old mode,
/// read just before the switch.
pub fn rebase(os: &mut GuestOs, old_wall: u64, old_cpu: u64) {
    if !os.proc.timers.armed() {
        os.proc.timers.virtual_base = os.proc.clocks.replay;
        return;
    }
    let (wall, cpu) = (wall_now(os), cpu_now(os));
    let move_to = |a: &mut Arm, old: u64, new: u64| {
        if a.deadline != 0 {
            a.deadline = new.saturating_add(a.deadline.saturating_sub(old)).max(1);
        }
    };
    let t = &mut os.proc.timers;
    move_to(&mut t.real, old_wall, wall);
    move_to(&mut t.virt, old_cpu, cpu);
    move_to(&mut t.prof, old_cpu, cpu);
    for p in t.posix.iter_mut() {
        match p.base {
            Base::Wall => move_to(&mut p.arm, old_wall, wall),
            Base::Cpu => move_to(&mut p.arm, old_cpu, cpu),
        }
    }
    for f in t.fds.iter_mut() {
        move_to(&mut f.arm, old_wall, wall);
    }
    t.virtual_base = os.proc.clocks.replay;
    restart_burn(os);
}

/// The timer clock and the CPU clock now, for [`rebase`].
pub fn clocks_now(os: &GuestOs) -> (u64, u64) {
    (wall_now(os), cpu_now(os))
}

/// Tell the schedulers the next wall deadline (blocking calls wait at most until it).
fn publish(os: &GuestOs) {
    super::sched::set_timer_deadline(os.proc.timers.next_wall());
}

/// Reload `a` (fired at `now`): the next deadline past `now`, and how many expirations were
/// missed meanwhile.
fn reload(a: &mut Arm, now: u64) -> u64 {
    if a.interval == 0 {
        a.deadline = 0;
        return 0;
    }
    let missed = now.saturating_sub(a.deadline) / a.interval;
    a.deadline = a.deadline.saturating_add((missed + 1).saturating_mul(a.interval));
    missed
}

/// Fire every timer that is due: its signal is raised (or its timerfd counts the expirations).
pub fn fire_due(os: &mut GuestOs) {
    if !os.proc.timers.armed() {
        super::sched::set_timer_deadline(u64::MAX);
        return;
    }
    let now = wall_now(os);
    let t = &os.proc.timers;
    let wall_due = t.next_wall() <= now;
    let cpu = if t.next_cpu() != u64::MAX { cpu_now(os) } else { 0 };
    let cpu_due = cpu != 0 && os.proc.timers.next_cpu() <= cpu;
    if !wall_due && !cpu_due {
        publish(os);
        return;
    }
    // Each signal with the thread it is for (0: the process).
    let mut raise: Vec<(SigInfo, i32)> = Vec::new();
    let t = &mut os.proc.timers;
    for (a, sig, at) in [(&mut t.real, SIGALRM, now), (&mut t.virt, SIGVTALRM, cpu), (&mut t.prof, SIGPROF, cpu)] {
        if a.deadline != 0 && at != 0 && a.deadline <= at {
            reload(a, at);
            raise.push((SigInfo { signo: sig, code: signal::SI_KERNEL, ..Default::default() }, 0));
        }
    }
    for p in t.posix.iter_mut() {
        let at = if p.base == Base::Wall { now } else { cpu };
        if p.arm.deadline == 0 || at == 0 || p.arm.deadline > at {
            continue;
        }
        let missed = reload(&mut p.arm, at);
        if p.signo == 0 {
            continue;
        }
        p.overrun = p.overrun.saturating_add(missed.min(u32::MAX as u64) as u32);
        raise.push((SigInfo { signo: p.signo, code: SI_TIMER, pid: p.id, uid: p.overrun, value: p.value, ..Default::default() }, p.tid));
    }
    for f in t.fds.iter_mut() {
        if f.arm.deadline == 0 || f.arm.deadline > now {
            continue;
        }
        let n = reload(&mut f.arm, now) + 1;
        if let Some(fd) = f.file.host_fd() {
            // SAFETY: adding to our own eventfd counter (8 bytes from a local); a full counter
            // (EAGAIN) keeps what it has.
            unsafe { libc::write(fd, (&n as *const u64).cast(), 8) };
        }
    }
    t.fds.retain(|f| f.arm.deadline != 0 || Arc::strong_count(&f.file) > 1);
    for (info, tid) in raise {
        let bit = 1u64 << (info.signo - 1);
        // A thread-directed timer's thread: the loaded one (whose pending set is the process's
        // while it runs) or a parked one (its own set, as tgkill's). Gone: nothing is sent, as
        // Linux sends nothing for a timer whose thread exited.
        let parked = if tid == 0 || (os.threads.loaded && tid == os.threads.current_tid(os.proc.pid)) {
            None
        } else {
            match os.threads.index_of(tid, os.proc.pid) {
                Some(i) => Some(i),
                None => continue,
            }
        };
        let thread_pending = parked.map_or(0, |i| os.threads.list[i].pending);
        // A POSIX timer's signal still pending counts as an overrun instead (Linux).
        if info.code == SI_TIMER && (os.sig.pending | thread_pending) & bit != 0 {
            continue;
        }
        if info.code == SI_TIMER {
            if let Some(p) = os.proc.timers.posix.iter_mut().find(|p| p.id == info.pid) {
                p.overrun = 0;
            }
        }
        match parked {
            None => signal::raise(os, info),
            Some(i) => signal::raise_for_thread(os, i, info),
        }
    }
    restart_burn(os);
    publish(os);
}

/// Virtual ns from now to the next wall timer (replay mode), for a process alone in its sandbox
/// whose wait would pass it: its clock moves there instead. None: no timer, or not replay mode.
pub fn until_next(proc: &super::process::Proc) -> Option<u64> {
    if !proc.clocks.replay {
        return None;
    }
    let next = proc.timers.next_wall();
    (next != u64::MAX).then(|| next.saturating_sub(proc.clocks.mono_now()))
}

/// A process alone in its sandbox, with one thread, blocked on something only the sandbox could
/// end (a read of a pipe, see `files::blocked_read`): in replay mode its clock moves to its next
/// wall timer, which fires, as for a process alone that sleeps or waits for a signal. Before, the
/// wait went on in host time and a timer reached by the time charged for it raised its signal
/// after the call had been set to restart, so the handler ran and the read went on waiting:
/// Python's handler (which runs when the read returns EINTR) never did.
pub fn blocked_alone(os: &mut GuestOs) {
    if os.threads.multi() || !signal::host::alone() {
        return;
    }
    if let Some(t) = until_next(&os.proc) {
        os.proc.clocks.pass(t);
        fire_due(os);
    }
}

/// How many 1 us clock reads the vDSO may answer before the next timer is due (replay mode);
/// u64::MAX without one.
pub fn vdso_budget(os: &GuestOs) -> u64 {
    match until_next(&os.proc) {
        Some(ns) => ns / clock::CLOCK_QUANTUM_NS,
        None => u64::MAX,
    }
}

/// Computing counted towards the timers in replay mode (see the module comment): the real ns the
/// process ran (in the guest, or waiting on the host alone) since the virtual monotonic time
/// [`BURN_BASE`]. Its timers see the later of the virtual clock and BURN_BASE + BURNT, so time
/// that also moved the virtual clock (a preempted turn the tree counted) is not counted twice.
/// Per VMM process; restarted whenever a timer is set or fires.
static BURNT: AtomicU64 = AtomicU64::new(0);
static BURN_BASE: AtomicU64 = AtomicU64::new(0);

fn restart_burn(os: &GuestOs) {
    BURNT.store(0, Relaxed);
    BURN_BASE.store(wall_now(os), Relaxed);
}

/// How long the next entry into the guest may run before the run loop must look at the timers
/// (None: no timer to watch): the time left to the next deadline.
pub fn host_budget(os: &GuestOs) -> Option<std::time::Duration> {
    let t = &os.proc.timers;
    if !t.armed() {
        return None;
    }
    let next = t.next_wall();
    let now = wall_now(os);
    let mut left = if next == u64::MAX { u64::MAX } else { next.saturating_sub(now) };
    if os.proc.clocks.replay {
        let burnt = BURN_BASE.load(Relaxed).saturating_add(BURNT.load(Relaxed));
        left = next.saturating_sub(now.max(burnt));
    } else if t.next_cpu() != u64::MAX {
        left = left.min(t.next_cpu().saturating_sub(cpu_now(os)));
    }
    (left != u64::MAX).then(|| std::time::Duration::from_nanos(left.max(1_000)))
}

/// After the process ran `ran` of real time (in the guest, or in a host wait while alone) with a
/// timer armed: count it and, in replay mode, when that computing reached the next wall deadline
/// ahead of the virtual clock, move the virtual clock there. Then fire what is due. Returns true
/// when the computing moved the clock (the run is then not reproducible).
pub fn charge(os: &mut GuestOs, ran: std::time::Duration) -> bool {
    if !os.proc.timers.armed() {
        return false;
    }
    let mut moved = false;
    if os.proc.clocks.replay {
        let next = os.proc.timers.next_wall();
        let burnt = BURNT.fetch_add(ran.as_nanos() as u64, Relaxed) + ran.as_nanos() as u64;
        let now = os.proc.clocks.mono_now();
        if next != u64::MAX && now < next && BURN_BASE.load(Relaxed).saturating_add(burnt) >= next {
            os.proc.clocks.pass(next - now);
            moved = true;
        }
    }
    fire_due(os);
    moved
}

// --- the syscalls ------------------------------------------------------------------------------

pub const SYS_GETITIMER: u64 = 36;
pub const SYS_ALARM: u64 = 37;
pub const SYS_SETITIMER: u64 = 38;
pub const SYS_TIMER_CREATE: u64 = 222;
pub const SYS_TIMER_SETTIME: u64 = 223;
pub const SYS_TIMER_GETTIME: u64 = 224;
pub const SYS_TIMER_GETOVERRUN: u64 = 225;
pub const SYS_TIMER_DELETE: u64 = 226;
pub const SYS_TIMERFD_CREATE: u64 = 283;
pub const SYS_TIMERFD_SETTIME: u64 = 286;
pub const SYS_TIMERFD_GETTIME: u64 = 287;

/// Handle a timer call; `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let r = match nr {
        SYS_ALARM => Ok(sys_alarm(os, a[0] as u32)),
        SYS_GETITIMER => which(a[0]).and_then(|w| {
            let v = itimer_value(os, w);
            ctx.write(a[1], &timeval_pair(v))
        }).map(|_| 0),
        SYS_SETITIMER => sys_setitimer(os, ctx, a[0], a[1], a[2]),
        SYS_TIMER_CREATE => sys_timer_create(os, ctx, a[0] as i32, a[1], a[2]),
        SYS_TIMER_SETTIME => sys_timer_settime(os, ctx, a[0] as i32, a[1], a[2], a[3]),
        SYS_TIMER_GETTIME => posix_index(os, a[0] as i32).and_then(|i| {
            let p = os.proc.timers.posix[i].clone();
            let v = remaining(os, p.base, p.arm);
            ctx.write(a[1], &timespec_pair(v))
        }).map(|_| 0),
        SYS_TIMER_GETOVERRUN => posix_index(os, a[0] as i32).map(|i| os.proc.timers.posix[i].overrun as u64),
        SYS_TIMER_DELETE => posix_index(os, a[0] as i32).map(|i| {
            os.proc.timers.posix.remove(i);
            publish(os);
            0
        }),
        SYS_TIMERFD_CREATE => sys_timerfd_create(os, a[0] as i32, a[1] as i32),
        SYS_TIMERFD_SETTIME => sys_timerfd_settime(os, ctx, a[0] as i32, a[1] as i32, a[2], a[3]),
        SYS_TIMERFD_GETTIME => timerfd_of(os, a[0] as i32).and_then(|f| {
            let arm = os.proc.timers.fds.iter().find(|t| Arc::ptr_eq(&t.file, &f)).map_or(Arm::default(), |t| t.arm);
            let v = remaining(os, Base::Wall, arm);
            ctx.write(a[1], &timespec_pair(v))
        }).map(|_| 0),
        _ => return None,
    };
    Some(r)
}

/// (interval, value left) of a countdown, ns.
fn remaining(os: &GuestOs, base: Base, a: Arm) -> (u64, u64) {
    if a.deadline == 0 {
        return (a.interval, 0);
    }
    let now = if base == Base::Wall { wall_now(os) } else { cpu_now(os) };
    (a.interval, a.deadline.saturating_sub(now).max(1))
}

fn timespec_pair((interval, value): (u64, u64)) -> Vec<u8> {
    let mut b = timespec_bytes((interval / 1_000_000_000) as i64, (interval % 1_000_000_000) as i64).to_vec();
    b.extend_from_slice(&timespec_bytes((value / 1_000_000_000) as i64, (value % 1_000_000_000) as i64));
    b
}

fn timeval_pair((interval, value): (u64, u64)) -> Vec<u8> {
    // A value left is rounded up to whole microseconds, as Linux does (never 0 while armed).
    let us = |ns: u64| ns.div_ceil(1_000);
    let (i, v) = (us(interval), us(value));
    timespec_pair(((i / 1_000_000) * 1_000_000_000 + (i % 1_000_000), (v / 1_000_000) * 1_000_000_000 + (v % 1_000_000)))
}

fn read_pair(ctx: &Ctx, va: u64, micro: bool) -> Result<(u64, u64), Errno> {
    let b = ctx.read_vec(va, 32)?;
    let f = |o: usize| i64::from_le_bytes(b[o..o + 8].try_into().unwrap_or_default());
    let unit = if micro { 1_000_000 } else { 1_000_000_000 };
    let ns = |s: i64, sub: i64| -> Result<u64, Errno> {
        if s < 0 || !(0..unit).contains(&sub) {
            return Err(EINVAL);
        }
        Ok((s as u64).saturating_mul(1_000_000_000).saturating_add(sub as u64 * (1_000_000_000 / unit as u64)))
    };
    Ok((ns(f(0), f(8))?, ns(f(16), f(24))?))
}

fn which(w: u64) -> Result<u32, Errno> {
    if w <= 2 { Ok(w as u32) } else { Err(EINVAL) }
}

fn itimer(os: &mut GuestOs, w: u32) -> &mut Arm {
    match w {
        0 => &mut os.proc.timers.real,
        1 => &mut os.proc.timers.virt,
        _ => &mut os.proc.timers.prof,
    }
}

fn itimer_value(os: &mut GuestOs, w: u32) -> (u64, u64) {
    let a = *itimer(os, w);
    remaining(os, if w == 0 { Base::Wall } else { Base::Cpu }, a)
}

/// Arm `w` to go off `value` ns from now (0: disarm), reloading with `interval`.
fn set_itimer(os: &mut GuestOs, w: u32, value: u64, interval: u64) {
    let now = if w == 0 { wall_now(os) } else { cpu_now(os) };
    *itimer(os, w) = if value == 0 { Arm::default() } else { Arm { deadline: now.saturating_add(value).max(1), interval } };
    restart_burn(os);
    publish(os);
}

fn sys_alarm(os: &mut GuestOs, secs: u32) -> u64 {
    let (_, left) = itimer_value(os, 0);
    set_itimer(os, 0, secs as u64 * 1_000_000_000, 0);
    // Seconds left of the previous alarm, rounded to the nearest (at least 1 if one was set).
    if left == 0 { 0 } else { ((left + 500_000_000) / 1_000_000_000).max(1) }
}

fn sys_setitimer(os: &mut GuestOs, ctx: &mut Ctx, w: u64, new: u64, old: u64) -> SysResult {
    let w = which(w)?;
    let (interval, value) = if new == 0 { (0, 0) } else { read_pair(ctx, new, true)? };
    let prev = itimer_value(os, w);
    if old != 0 {
        ctx.write(old, &timeval_pair(prev))?;
    }
    set_itimer(os, w, value, interval);
    Ok(0)
}

fn posix_index(os: &GuestOs, id: i32) -> Result<usize, Errno> {
    os.proc.timers.posix.iter().position(|t| t.id == id).ok_or(EINVAL)
}

/// The base and realtime-ness of a clock a timer may run on.
fn timer_clock(os: &GuestOs, clock: i32) -> Result<(Base, bool), Errno> {
    match clock {
        0 | 8 | 11 => Ok((Base::Wall, true)),
        1 | 7 | 9 => Ok((Base::Wall, false)),
        2 => Ok((Base::Cpu, false)),
        c if c < 0 && (c & 7) != 3 && (!(c >> 3) == 0 || !(c >> 3) == os.proc.pid) && c & 4 == 0 => Ok((Base::Cpu, false)),
        _ => Err(EINVAL),
    }
}

fn sys_timer_create(os: &mut GuestOs, ctx: &mut Ctx, clock: i32, sevp: u64, idp: u64) -> SysResult {
    let (base, realtime) = timer_clock(os, clock)?;
    let id = (0..MAX_TIMERS as i32).find(|i| !os.proc.timers.posix.iter().any(|t| t.id == *i)).ok_or(super::EAGAIN)?;
    // struct sigevent: sigev_value (8), sigev_signo (4), sigev_notify (4), then the tid.
    let (signo, value, tid) = if sevp == 0 {
        (SIGALRM, id as u64, 0)
    } else {
        let b = ctx.read_vec(sevp, 20)?;
        let value = u64::from_le_bytes(b[0..8].try_into().map_err(|_| EFAULT)?);
        let signo = i32::from_le_bytes(b[8..12].try_into().map_err(|_| EFAULT)?);
        let notify = i32::from_le_bytes(b[12..16].try_into().map_err(|_| EFAULT)?);
        let tid = i32::from_le_bytes(b[16..20].try_into().map_err(|_| EFAULT)?);
        match notify {
            SIGEV_NONE => (0, value, 0),
            SIGEV_SIGNAL | SIGEV_THREAD_ID if (1..=64).contains(&signo) => {
                if notify == SIGEV_THREAD_ID && os.threads.index_of(tid, os.proc.pid).is_none() {
                    return Err(EINVAL);
                }
                (signo, value, if notify == SIGEV_THREAD_ID { tid } else { 0 })
            }
            _ => return Err(EINVAL),
        }
    };
    ctx.write(idp, &id.to_le_bytes())?;
    os.proc.timers.posix.push(PosixTimer { id, base, realtime, signo, tid, value, arm: Arm::default(), overrun: 0 });
    Ok(0)
}

/// A new countdown from timer_settime/timerfd_settime's `value`/`interval` (ns), absolute on the
/// clock it was created on if `abs`.
fn new_arm(os: &mut GuestOs, base: Base, realtime: bool, abs: bool, value: u64, interval: u64) -> Arm {
    if value == 0 {
        return Arm { deadline: 0, interval };
    }
    let now = if base == Base::Wall { wall_now(os) } else { cpu_now(os) };
    let deadline = if !abs {
        now.saturating_add(value)
    } else if realtime {
        (value as i128 - real_offset(os)).clamp(1, u64::MAX as i128) as u64
    } else {
        // An absolute CLOCK_MONOTONIC value is on the guest's monotonic clock: the timer clock.
        value
    };
    restart_burn(os);
    Arm { deadline: deadline.max(1), interval }
}

fn sys_timer_settime(os: &mut GuestOs, ctx: &mut Ctx, id: i32, flags: u64, new: u64, old: u64) -> SysResult {
    let i = posix_index(os, id)?;
    let (interval, value) = read_pair(ctx, new, false)?;
    let p = os.proc.timers.posix[i].clone();
    if old != 0 {
        ctx.write(old, &timespec_pair(remaining(os, p.base, p.arm)))?;
    }
    let arm = new_arm(os, p.base, p.realtime, flags & TIMER_ABSTIME != 0, value, interval);
    let p = &mut os.proc.timers.posix[i];
    p.arm = arm;
    p.overrun = 0;
    publish(os);
    // Already due (an absolute time in the past): it fires at this call's end.
    fire_due(os);
    Ok(0)
}

/// timerfd_create(2): a host eventfd (the guest's file: reads give the expiration count and
/// block, or EAGAIN, while it is 0; poll and epoll see it readable once the timer fired).
fn sys_timerfd_create(os: &mut GuestOs, clock: i32, flags: i32) -> SysResult {
    const TFD_CLOEXEC: i32 = libc::O_CLOEXEC;
    const TFD_NONBLOCK: i32 = libc::O_NONBLOCK;
    if flags & !(TFD_CLOEXEC | TFD_NONBLOCK) != 0 || !matches!(clock, 0 | 1 | 7 | 8 | 9) {
        return Err(EINVAL);
    }
    // SAFETY: eventfd with valid flags; the result is checked and owned below.
    let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | if flags & TFD_NONBLOCK != 0 { libc::EFD_NONBLOCK } else { 0 }) };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: a fresh descriptor we own.
    let mut f = super::files::OpenFile::host(unsafe { OwnedFd::from_raw_fd(fd) }, None, false);
    f.stream = true;
    f.label = Some("anon_inode:[timerfd]".into());
    // The clock is remembered in the file's position field (unused for a stream): 1 realtime.
    f.pos.store(matches!(clock, 0 | 8) as u64, std::sync::atomic::Ordering::Relaxed);
    os.files.alloc(0, Arc::new(f), flags & TFD_CLOEXEC != 0).map(|fd| fd as u64)
}

fn timerfd_of(os: &GuestOs, fd: i32) -> Result<Arc<super::files::OpenFile>, Errno> {
    let f = os.files.file(fd)?;
    if f.label.as_deref() != Some("anon_inode:[timerfd]") {
        return Err(EINVAL);
    }
    Ok(f)
}

fn sys_timerfd_settime(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, flags: i32, new: u64, old: u64) -> SysResult {
    if flags & !(1 | 2) != 0 {
        return Err(EINVAL);
    }
    let f = timerfd_of(os, fd)?;
    let (interval, value) = read_pair(ctx, new, false)?;
    let prev = os.proc.timers.fds.iter().find(|t| Arc::ptr_eq(&t.file, &f)).map_or(Arm::default(), |t| t.arm);
    if old != 0 {
        ctx.write(old, &timespec_pair(remaining(os, Base::Wall, prev)))?;
    }
    let realtime = f.pos.load(std::sync::atomic::Ordering::Relaxed) == 1;
    let arm = new_arm(os, Base::Wall, realtime, flags & 1 != 0, value, interval);
    // Setting the timer clears the expirations not read yet (Linux).
    if let Some(h) = f.host_fd() {
        let mut p = libc::pollfd { fd: h, events: libc::POLLIN, revents: 0 };
        let mut n = 0u64;
        // SAFETY: a poll of our eventfd without waiting, then a read of it into a local u64 only
        // if it is readable (so it cannot block).
        unsafe {
            if libc::poll(&mut p, 1, 0) == 1 {
                libc::read(h, (&mut n as *mut u64).cast(), 8);
            }
        }
    }
    os.proc.timers.fds.retain(|t| !Arc::ptr_eq(&t.file, &f));
    os.proc.timers.fds.push(TimerFd { file: f.clone(), arm, realtime });
    publish(os);
    fire_due(os);
    Ok(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_interval_timer_reloads_past_now_and_counts_what_it_missed() {
        let mut a = Arm { deadline: 1_000, interval: 250 };
        assert_eq!(reload(&mut a, 1_000), 0);
        assert_eq!(a.deadline, 1_250);
        // Looked at late: three expirations went by unseen, the next is after now.
        assert_eq!(reload(&mut a, 2_000), 3);
        assert_eq!(a.deadline, 2_250);
        let mut once = Arm { deadline: 5, interval: 0 };
        assert_eq!(reload(&mut once, 9), 0);
        assert_eq!(once.deadline, 0, "a one-shot timer is disarmed");
    }

    #[test]
    fn itimer_values_read_as_timevals_rounded_up_to_microseconds() {
        let b = timeval_pair((250_000_000, 1_500_000_001));
        let f = |o: usize| i64::from_le_bytes(b[o..o + 8].try_into().unwrap());
        assert_eq!((f(0), f(8), f(16), f(24)), (0, 250_000, 1, 500_001));
    }

    #[test]
    fn a_fork_child_has_no_timers_and_execve_keeps_the_alarm() {
        let mut t = Timers { real: Arm { deadline: 7, interval: 0 }, ..Default::default() };
        t.posix.push(PosixTimer { id: 0, base: Base::Wall, realtime: true, signo: 14, tid: 0, value: 0, arm: Arm { deadline: 9, interval: 0 }, overrun: 0 });
        assert_eq!(t.next_wall(), 7);
        let mut child = t.clone();
        child.on_fork();
        assert!(!child.armed());
        t.on_exec();
        assert!(t.armed() && t.posix.is_empty() && t.next_wall() == 7);
    }
}
