//! Time the guest sees: clocks, sleeps, CPU times, and the virtual clocks of replay mode.
//!
//! Everything the host decides for the guest that a replay would have to reproduce goes through one
//! function per kind: [`super::random::random_bytes`] for randomness and [`clock_now`] for clocks.
//!
//! # Deterministic replay
//!
//! A reseed with `replay` ([`super::random::reseed`]) switches the clocks ([`Proc::clocks`]) to
//! **virtual time**: every clock starts where the guest last saw it
//! (or at [`REPLAY_EPOCH_NS`] / [`REPLAY_MONOTONIC_NS`] if it never read one) and advances only by
//! [`CLOCK_QUANTUM_NS`] per clock read (clock_gettime, gettimeofday, time, times, getrusage, sysinfo)
//! and by the durations the guest sleeps. A sleep (nanosleep, clock_nanosleep, futex timeouts) of a
//! process alone in its sandbox returns at once: nothing else could act while it waits, so waiting
//! would change nothing it can observe but the wall time it cannot see. With other guest processes
//! alive, the processes take turns on one virtual clock (`guestos::sched`): the sleep hands the
//! turn on and ends when the tree's time reaches its deadline (the other processes run meanwhile,
//! as under Linux: a parent that sleeps to let its child start, a `timeout` on a child). Virtual
//! time moves by exactly the length either way. CPU-time clocks advance by the quantum only.
//! Most of these reads happen in the guest's vDSO (`super::vdso`), which keeps a copy of the
//! virtual clocks in a page of its own; the run loop folds its reads back into [`Proc::clocks`]
//! at every exit, so every function here sees them.
//! Replay mode stays on until the next reseed (which may turn it off) or a reset to a state without
//! it. It is part of [`Proc`], so snapshots, forks and resets carry it. See docs/replay.md.
//!
//! With other threads able to run, a sleep does not wait on the host: it yields to them and is
//! retried once its deadline has come (`guestos::sched::yield_blocked`). Otherwise sleeping
//! (nanosleep, clock_nanosleep) happens on the host in slices of
//! at most [`SLEEP_SLICE`]: when a slice ends before the deadline, the syscall is restarted (the guest
//! re-executes its `syscall` instruction, and the deadline is remembered in [`Proc::sleep`]). The
//! run loop therefore regains control between slices and a run's time budget is honoured even in the
//! middle of a long sleep, which simply continues in the next run.

use serde::{Deserialize, Serialize};

use super::process::Proc;
use super::{Ctx, Errno, GuestOs, SysResult, EFAULT, EINVAL, EPERM};

/// Longest host sleep inside one syscall before the run loop gets control back.
pub const SLEEP_SLICE: std::time::Duration = std::time::Duration::from_millis(50);

/// A sleep that was cut into slices: the syscall it belongs to and its deadline.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct PendingSleep {
    /// rip just after the `syscall` instruction, the syscall number and its first four arguments:
    /// the restarted call must match all of them to continue this sleep.
    pub rip: u64,
    pub nr: u64,
    pub args: [u64; 4],
    /// CLOCK_MONOTONIC nanoseconds.
    pub deadline_ns: u64,
}

/// The virtual clocks the guest sees once [`super::random::reseed`] turned on replay mode start at
/// the REALTIME the guest last read or, if it never read one, at this one: 2025-01-01T00:00:00Z.
pub const REPLAY_EPOCH_NS: u64 = 1_735_689_600 * 1_000_000_000;
/// Where virtual CLOCK_MONOTONIC starts for a guest that never read it: 1 s after "boot".
pub const REPLAY_MONOTONIC_NS: u64 = 1_000_000_000;
/// How far virtual time moves per clock read in replay mode: 1 us, so that consecutive reads differ
/// even at gettimeofday's resolution.
pub const CLOCK_QUANTUM_NS: u64 = 1_000;

/// What a guest clock measures.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum ClockKind {
    /// CLOCK_REALTIME, _COARSE, _ALARM, CLOCK_TAI.
    Real,
    /// CLOCK_MONOTONIC, _RAW, _COARSE, CLOCK_BOOTTIME, _ALARM.
    Mono,
    /// This process's (or thread's) CPU time.
    Cpu,
}

/// The guest's clocks: the host's, or in replay mode virtual ones (see the module comment). All
/// values are nanoseconds.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Clocks {
    /// Replay mode: virtual time.
    pub replay: bool,
    /// Virtual REALTIME, MONOTONIC and CPU time when replay mode began.
    pub real_base: u64,
    pub mono_base: u64,
    pub cpu_base: u64,
    /// Virtual time since then (clock-read quanta and sleeps), and virtual CPU time (quanta only).
    pub elapsed: u64,
    pub cpu_elapsed: u64,
    /// The last REALTIME, MONOTONIC and CPU time values the guest was given, in either mode; 0 if
    /// none. Replay mode starts from them, so the guest never sees its clocks go back.
    pub seen_real: u64,
    pub seen_mono: u64,
    pub seen_cpu: u64,
}

impl Clocks {
    /// Turn on replay mode: virtual clocks from where the guest last saw them. `start_ns` (the
    /// process start on the monotonic clock) moves with a monotonic clock the guest never read.
    ///
    /// A guest that has a past starts at the next whole second of REALTIME after it (and
    /// MONOTONIC moves by as much): a run (one exec) begins in a later second than anything an
    /// earlier run wrote. Virtual time moves only by clock reads and sleeps, so without this an
    /// agent's edit in one exec could get the same whole-second mtime as the file it replaces
    /// (written by the bake or an earlier exec), and CPython, whose bytecode cache compares
    /// whole-second mtimes and sizes, kept running the old code of a same-size edit. Between two
    /// commands of a real session at least that much time passes too. Deterministic: a function
    /// of the guest's own past.
    pub(super) fn start_replay(&mut self, start_ns: &mut u64) {
        // Where the guest's time got to: what it read, or in a run already in replay mode, where
        // virtual time went unread (a sleep's end, a file stamped with it).
        let (last_real, last_mono) = if self.replay {
            (self.seen_real.max(self.real_now()), self.seen_mono.max(self.mono_now()))
        } else {
            (self.seen_real, self.seen_mono)
        };
        self.replay = true;
        let gap = if last_real != 0 { (last_real / 1_000_000_000 + 1) * 1_000_000_000 - last_real } else { 0 };
        self.real_base = if last_real != 0 { last_real + gap } else { REPLAY_EPOCH_NS };
        self.mono_base = if last_mono != 0 {
            last_mono + gap
        } else {
            *start_ns = REPLAY_MONOTONIC_NS;
            REPLAY_MONOTONIC_NS
        };
        self.cpu_base = self.seen_cpu;
        self.elapsed = 0;
        self.cpu_elapsed = 0;
    }

    /// Before replay mode starts (`start_replay`): virtual REALTIME is to start no earlier than
    /// `ns` (the host's wall clock for a sandbox with a network, a recording's for its replay).
    /// Never backwards: a guest that saw a later time starts there.
    pub fn start_real_at_least(&mut self, ns: u64) {
        self.seen_real = self.seen_real.max(ns);
    }

    /// Virtual time of `kind` now (replay mode), without advancing it.
    fn virtual_ns(&self, kind: ClockKind) -> u64 {
        match kind {
            ClockKind::Real => self.real_base.saturating_add(self.elapsed),
            ClockKind::Mono => self.mono_base.saturating_add(self.elapsed),
            ClockKind::Cpu => self.cpu_base.saturating_add(self.cpu_elapsed),
        }
    }

    /// Virtual CLOCK_REALTIME now (replay mode), without advancing it (file times, `files::stamp`).
    pub fn real_now(&self) -> u64 {
        self.virtual_ns(ClockKind::Real)
    }

    /// Virtual CLOCK_MONOTONIC now (replay mode), without advancing it: the sandbox's process tree
    /// shares this timeline (see `guestos::sched`).
    pub fn mono_now(&self) -> u64 {
        self.virtual_ns(ClockKind::Mono)
    }

    /// Let `ns` of virtual time pass (a sleep): wall clocks move, CPU time does not.
    pub fn pass(&mut self, ns: u64) {
        self.elapsed = self.elapsed.saturating_add(ns);
    }

    /// Virtual time until the absolute time `deadline` on a clock of `kind` (0 if it has passed).
    fn until(&self, kind: ClockKind, deadline: u64) -> u64 {
        deadline.saturating_sub(self.virtual_ns(kind))
    }

    fn saw(&mut self, kind: ClockKind, ns: u64) {
        match kind {
            ClockKind::Real => self.seen_real = ns,
            ClockKind::Mono => self.seen_mono = ns,
            ClockKind::Cpu => self.seen_cpu = ns,
        }
    }
}

/// What guest clock `clock` measures; EINVAL for clocks that do not exist here (CPU clocks of other
/// processes, CLOCK_SGI_CYCLE, unknown ids).
fn clock_kind(clock: i32) -> Result<ClockKind, Errno> {
    match clock {
        0 | 5 | 8 | 11 => Ok(ClockKind::Real),
        1 | 4 | 6 | 7 | 9 => Ok(ClockKind::Mono),
        2 | 3 => Ok(ClockKind::Cpu),
        c if c < 0 => host_clock(c).map(|_| ClockKind::Cpu),
        _ => Err(EINVAL),
    }
}

/// The time on guest clock `clock` as (seconds, nanoseconds).
///
/// The one source of guest time: the host's clocks, or virtual time in replay mode (see the module
/// comment). CPU-time clocks of this process (including the pid-0 encodings glibc uses) read the
/// VMM process's CPU time. Other processes' clocks do not exist: EINVAL.
pub fn clock_now(proc: &mut Proc, clock: i32) -> Result<(i64, i64), Errno> {
    let ns = clock_now_ns(proc, clock)?;
    Ok(((ns / 1_000_000_000) as i64, (ns % 1_000_000_000) as i64))
}

/// [`clock_now`] in nanoseconds.
pub fn clock_now_ns(proc: &mut Proc, clock: i32) -> Result<u64, Errno> {
    let clock = own_cpu_clock(proc, clock);
    let kind = clock_kind(clock)?;
    let c = &mut proc.clocks;
    let ns = if c.replay {
        c.elapsed = c.elapsed.saturating_add(CLOCK_QUANTUM_NS);
        c.cpu_elapsed = c.cpu_elapsed.saturating_add(CLOCK_QUANTUM_NS);
        c.virtual_ns(kind)
    } else {
        ns_of(host_clock_now(clock)?)
    };
    c.saw(kind, ns);
    Ok(ns)
}

/// What a trapped `rdtsc` or `rdtscp` reads (`vstate::tsc_trap`, replay mode only): the virtual
/// CLOCK_MONOTONIC in nanoseconds, so a counter of 1 GHz, and a clock read like any other (it
/// advances virtual time by one quantum: two reads never return the same count).
pub fn tsc_now(proc: &mut Proc) -> u64 {
    // CLOCK_MONOTONIC always exists.
    clock_now_ns(proc, libc::CLOCK_MONOTONIC).unwrap_or_default()
}

/// The host's time on the clock that stands for guest clock `clock`.
fn host_clock_now(clock: i32) -> Result<(i64, i64), Errno> {
    let host = host_clock(clock)?;
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a local timespec; the result is checked.
    if unsafe { libc::clock_gettime(host, &mut ts) } != 0 {
        return Err(EINVAL);
    }
    Ok((ts.tv_sec, ts.tv_nsec))
}

/// The host clock that stands for guest clock `clock`.
fn host_clock(clock: i32) -> Result<libc::clockid_t, Errno> {
    match clock {
        0..=9 | 11 => Ok(clock),
        c if c < 0 => {
            // A CPU clock: ~pid << 3 | thread << 2 | kind (0 prof, 1 virt, 2 sched).
            let pid = !(c >> 3);
            if (c & 3) == 3 || (pid != 0 && pid != 1) {
                return Err(EINVAL);
            }
            Ok(if c & 4 != 0 { libc::CLOCK_THREAD_CPUTIME_ID } else { libc::CLOCK_PROCESS_CPUTIME_ID })
        }
        _ => Err(EINVAL),
    }
}

/// A CPU-time clock id that names this process (or its one thread) by its guest pid, as the
/// pid-0 encoding of the same clock: clock_getcpuclockid(getpid()) and pthread_getcpuclockid
/// give such ids, and a guest process other than pid 1 has a pid `host_clock` does not know.
fn own_cpu_clock(proc: &Proc, clock: i32) -> i32 {
    if clock < 0 && proc.pid > 1 && !(clock >> 3) == proc.pid {
        (!0 << 3) | (clock & 7)
    } else {
        clock
    }
}

fn clock_res(proc: &Proc, clock: i32) -> Result<(i64, i64), Errno> {
    let clock = own_cpu_clock(proc, clock);
    if proc.clocks.replay {
        // Fixed answers (the host's coarse resolution depends on its HZ): 4 ms for the coarse clocks.
        clock_kind(clock)?;
        return Ok((0, if clock == 5 || clock == 6 { 4_000_000 } else { 1 }));
    }
    let host = host_clock(clock)?;
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_getres into a local timespec; the result is checked.
    if unsafe { libc::clock_getres(host, &mut ts) } != 0 {
        return Err(EINVAL);
    }
    Ok((ts.tv_sec, ts.tv_nsec))
}

/// The guest's CLOCK_MONOTONIC now, without counting a clock read (replay mode's reads each
/// move virtual time): for the engine's own records, such as a process's start time.
pub fn mono_peek(proc: &Proc) -> u64 {
    if proc.clocks.replay {
        proc.clocks.mono_now()
    } else {
        monotonic_ns()
    }
}

/// The guest's CLOCK_REALTIME now, without counting a clock read (see [`mono_peek`]).
pub fn real_peek(proc: &Proc) -> u64 {
    if proc.clocks.replay {
        proc.clocks.virtual_ns(ClockKind::Real)
    } else {
        host_clock_now(libc::CLOCK_REALTIME).map(ns_of).unwrap_or(0)
    }
}

/// The host's CLOCK_MONOTONIC in nanoseconds (host-side deadlines; not what the guest sees).
pub fn monotonic_ns() -> u64 {
    host_clock_now(libc::CLOCK_MONOTONIC).map(ns_of).unwrap_or(0)
}

pub(super) fn timespec_bytes(s: i64, ns: i64) -> [u8; 16] {
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&s.to_le_bytes());
    b[8..].copy_from_slice(&ns.to_le_bytes());
    b
}

/// A guest `struct timespec`, validated (0 <= nsec < 1e9, sec >= 0) and converted to nanoseconds.
pub(crate) fn read_timespec(ctx: &Ctx, va: u64) -> Result<u64, Errno> {
    let b = ctx.read_vec(va, 16)?;
    let s = i64::from_le_bytes(b[..8].try_into().map_err(|_| EFAULT)?);
    let ns = i64::from_le_bytes(b[8..].try_into().map_err(|_| EFAULT)?);
    if s < 0 || !(0..1_000_000_000).contains(&ns) {
        return Err(EINVAL);
    }
    Ok((s as u64).saturating_mul(1_000_000_000).saturating_add(ns as u64))
}

fn ns_of(t: (i64, i64)) -> u64 {
    (t.0.max(0) as u64).saturating_mul(1_000_000_000).saturating_add(t.1.max(0) as u64)
}

/// Sleep until `deadline` (CLOCK_MONOTONIC ns, computed by `deadline` unless this is the restart of
/// a sliced sleep), then answer `done`. See the module comment for the slicing.
fn sleep_until(
    proc: &mut Proc,
    ctx: &mut Ctx,
    nr: u64,
    a: [u64; 6],
    deadline: impl FnOnce() -> Result<u64, Errno>,
    done: SysResult,
) -> SysResult {
    let key = PendingSleep { rip: ctx.regs.rip, nr, args: [a[0], a[1], a[2], a[3]], deadline_ns: 0 };
    let deadline = match proc.sleep.take() {
        Some(p) if PendingSleep { deadline_ns: 0, ..p } == key => p.deadline_ns,
        _ => deadline()?,
    };
    let now = monotonic_ns();
    if now >= deadline {
        return done;
    }
    // Other threads of this process run meanwhile (see `guestos::thread`): no host sleep; the
    // call is retried once the deadline has come.
    if super::sched::active() && super::sched::yield_sleeping(deadline) {
        proc.sleep = Some(PendingSleep { deadline_ns: deadline, ..key });
        ctx.regs.rip = ctx.regs.rip.wrapping_sub(2);
        return Ok(nr);
    }
    let mut slice = (deadline - now).min(SLEEP_SLICE.as_nanos() as u64);
    // A timer of the process (on this same host clock outside replay mode) ends the slice: the
    // restart that follows fires it (`guestos::timer`).
    if !proc.clocks.replay {
        slice = slice.min(proc.timers.next_wall().saturating_sub(now).max(1));
    }
    let ts = libc::timespec { tv_sec: (slice / 1_000_000_000) as i64, tv_nsec: (slice % 1_000_000_000) as i64 };
    // SAFETY: a relative host sleep on a local timespec. An early return (EINTR from the run's
    // preemption signal) is fine: the deadline decides below.
    unsafe { libc::clock_nanosleep(libc::CLOCK_MONOTONIC, 0, &ts, std::ptr::null_mut()) };
    if monotonic_ns() >= deadline {
        return done;
    }
    // Restart: back to the `syscall` instruction (2 bytes, 0f 05) with rax = the syscall number.
    proc.sleep = Some(PendingSleep { deadline_ns: deadline, ..key });
    ctx.regs.rip = ctx.regs.rip.wrapping_sub(2);
    Ok(nr)
}

/// A sleep of `d` ns in replay mode: virtual time moves by exactly `d` when it ends (see the
/// module comment); it waits on the host (sliced, as `sleep_until`) only if other guest processes
/// of the sandbox are alive to run meanwhile.
fn virtual_sleep(proc: &mut Proc, ctx: &mut Ctx, nr: u64, a: [u64; 6], d: u64, done: SysResult) -> SysResult {
    // Taking turns with other processes (see `guestos::sched`): the sleep ends when the tree's
    // virtual time reaches its deadline.
    if super::sched::active() {
        proc.sleep = None;
        let now = proc.clocks.mono_now();
        let deadline = super::sched::deadline(now, d);
        if now >= deadline {
            return done;
        }
        super::sched::yield_sleeping(deadline);
        return Err(super::signal::ERESTARTSYS);
    }
    if super::signal::host::alone() {
        // The end is kept across a restart (a timer's signal that did not end the sleep).
        let key = PendingSleep { rip: ctx.regs.rip, nr, args: [a[0], a[1], a[2], a[3]], deadline_ns: 0 };
        let now = proc.clocks.mono_now();
        let end = match proc.sleep.take() {
            Some(p) if PendingSleep { deadline_ns: 0, ..p } == key => p.deadline_ns,
            _ => now.saturating_add(d),
        };
        // A timer due first interrupts the sleep there (`guestos::timer`): the clock moves to it
        // and the call restarts, so its signal is delivered (EINTR, with the time left in `rem`).
        if let Some(t) = super::timer::until_next(proc).filter(|&t| now.saturating_add(t) < end) {
            proc.clocks.pass(t);
            proc.sleep = Some(PendingSleep { deadline_ns: end, ..key });
            let rem = match nr {
                SYS_NANOSLEEP => a[1],
                _ if a[1] & 1 == 0 => a[3],
                _ => 0,
            };
            if rem != 0 {
                let left = end - now - t;
                ctx.write(rem, &timespec_bytes((left / 1_000_000_000) as i64, (left % 1_000_000_000) as i64))?;
            }
            return Err(super::signal::ERESTARTSYS);
        }
        proc.clocks.pass(end.saturating_sub(now));
        return done;
    }
    let r = sleep_until(proc, ctx, nr, a, || Ok(monotonic_ns().saturating_add(d)), done);
    if proc.sleep.is_none() {
        proc.clocks.pass(d); // ended (not restarted for another slice)
    }
    r
}

pub const SYS_NANOSLEEP: u64 = 35;
pub const SYS_GETTIMEOFDAY: u64 = 96;
pub const SYS_GETRUSAGE: u64 = 98;
pub const SYS_TIMES: u64 = 100;
pub const SYS_TIME: u64 = 201;
pub const SYS_SETTIMEOFDAY: u64 = 164;
pub const SYS_CLOCK_SETTIME: u64 = 227;
pub const SYS_CLOCK_GETTIME: u64 = 228;
pub const SYS_CLOCK_GETRES: u64 = 229;
pub const SYS_CLOCK_NANOSLEEP: u64 = 230;

/// Handle a clock, sleep or CPU-time call; `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_CLOCK_GETTIME => clock_now(p, a[0] as i32).and_then(|(s, ns)| ctx.write(a[1], &timespec_bytes(s, ns))).map(|_| 0),
        SYS_CLOCK_GETRES => clock_res(p, a[0] as i32).and_then(|(s, ns)| {
            if a[1] != 0 {
                ctx.write(a[1], &timespec_bytes(s, ns))?;
            }
            Ok(0)
        }),
        SYS_GETTIMEOFDAY => clock_now(p, libc::CLOCK_REALTIME).and_then(|(s, ns)| {
            if a[0] != 0 {
                ctx.write(a[0], &timespec_bytes(s, ns / 1000))?;
            }
            if a[1] != 0 {
                ctx.write(a[1], &[0u8; 8])?; // struct timezone: UTC, no DST
            }
            Ok(0)
        }),
        SYS_TIME => clock_now(p, libc::CLOCK_REALTIME).and_then(|(s, _)| {
            if a[0] != 0 {
                ctx.write(a[0], &s.to_le_bytes())?;
            }
            Ok(s as u64)
        }),
        SYS_NANOSLEEP => read_timespec(ctx, a[0]).and_then(|req| {
            if p.clocks.replay {
                return virtual_sleep(p, ctx, nr, a, req, Ok(0));
            }
            sleep_until(p, ctx, nr, a, || Ok(monotonic_ns().saturating_add(req)), Ok(0))
        }),
        SYS_CLOCK_NANOSLEEP => clock_nanosleep(p, ctx, nr, a),
        // The sandbox may not set the clocks: EPERM for a clock that can be set, EINVAL otherwise.
        SYS_CLOCK_SETTIME => read_timespec(ctx, a[1]).and_then(|_| match a[0] as i32 {
            libc::CLOCK_REALTIME => Err(EPERM),
            _ => Err(EINVAL),
        }),
        SYS_SETTIMEOFDAY => Err(EPERM),
        SYS_TIMES => {
            let ticks = match clock_now_ns(p, libc::CLOCK_MONOTONIC) {
                Ok(ns) => ns / 10_000_000,
                Err(e) => return Some(Err(e)),
            };
            let (user, sys) = cpu_times(p);
            if a[0] != 0 {
                let mut b = [0u8; 32];
                b[..8].copy_from_slice(&(user / 10_000).to_le_bytes());
                b[8..16].copy_from_slice(&(sys / 10_000).to_le_bytes());
                if let Err(e) = ctx.write(a[0], &b) {
                    return Some(Err(e));
                }
            }
            Ok(ticks)
        }
        SYS_GETRUSAGE => {
            let who = a[0] as i32;
            if !(-1..=1).contains(&who) {
                Err(EINVAL)
            } else {
                let mut b = [0u8; 144];
                if who != -1 {
                    let (user, sys) = cpu_times(p);
                    b[..8].copy_from_slice(&(user / 1_000_000).to_le_bytes());
                    b[8..16].copy_from_slice(&(user % 1_000_000).to_le_bytes());
                    b[16..24].copy_from_slice(&(sys / 1_000_000).to_le_bytes());
                    b[24..32].copy_from_slice(&(sys % 1_000_000).to_le_bytes());
                }
                ctx.write(a[1], &b).map(|_| 0)
            }
        }
        _ => return None,
    };
    Some(r)
}

fn clock_nanosleep(p: &mut Proc, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> SysResult {
    const TIMER_ABSTIME: u64 = 1;
    let clock = a[0] as i32;
    if !matches!(clock, 0 | 1 | 7 | 11) {
        return Err(EINVAL);
    }
    // Read the request up front: a bad pointer is EFAULT even on a restart.
    let req = read_timespec(ctx, a[2])?;
    let abs = a[1] & TIMER_ABSTIME != 0;
    if p.clocks.replay {
        let d = if abs { p.clocks.until(clock_kind(clock)?, req) } else { req };
        return virtual_sleep(p, ctx, nr, a, d, Ok(0));
    }
    sleep_until(
        p,
        ctx,
        nr,
        a,
        || {
            let now = monotonic_ns();
            if abs {
                let clock_now_ns = ns_of(host_clock_now(clock)?);
                Ok(now.saturating_add(req.saturating_sub(clock_now_ns)))
            } else {
                Ok(now.saturating_add(req))
            }
        },
        Ok(0),
    )
}

/// User and system CPU time of the process in microseconds: the VMM process's, or in replay mode
/// the virtual CPU clock (all user time). Reading them counts as a clock read.
fn cpu_times(p: &mut Proc) -> (u64, u64) {
    if p.clocks.replay {
        let ns = clock_now_ns(p, libc::CLOCK_PROCESS_CPUTIME_ID).unwrap_or(0);
        return (ns / 1_000, 0);
    }
    // SAFETY: getrusage into a zeroed local struct.
    let mut ru: libc::rusage = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::getrusage(libc::RUSAGE_SELF, &mut ru) };
    let us = |t: libc::timeval| (t.tv_sec as u64) * 1_000_000 + t.tv_usec as u64;
    (us(ru.ru_utime), us(ru.ru_stime))
}

/// A futex wait's timeout (`timeout`, the guest's timespec, relative for FUTEX_WAIT, absolute on
/// its clock for FUTEX_WAIT_BITSET) as ns from now: on the virtual clocks in replay mode, else on the
/// host's. `None`: no timeout. For waits on shared pages (`futex_shared`).
pub(crate) fn futex_timeout(p: &mut Proc, ctx: &Ctx, op: u64, timeout: u64) -> Result<Option<u64>, Errno> {
    const FUTEX_WAIT_BITSET: u64 = 9;
    const FUTEX_CLOCK_REALTIME: u64 = 256;
    if timeout == 0 {
        return Ok(None);
    }
    let t = read_timespec(ctx, timeout)?;
    if op & 0x7f != FUTEX_WAIT_BITSET {
        return Ok(Some(t));
    }
    let realtime = op & FUTEX_CLOCK_REALTIME != 0;
    if p.clocks.replay {
        return Ok(Some(p.clocks.until(if realtime { ClockKind::Real } else { ClockKind::Mono }, t)));
    }
    let clock = if realtime { libc::CLOCK_REALTIME } else { libc::CLOCK_MONOTONIC };
    Ok(Some(t.saturating_sub(ns_of(host_clock_now(clock)?))))
}
