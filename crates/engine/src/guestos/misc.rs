//! Identity, time, randomness, limits, signal bookkeeping, thread-area setup.
//!
//! Most of these calls are bookkeeping: they store what the guest sets and hand it back. Signal
//! dispositions, the mask and the alternate stack are kept here; delivering signals, kill and
//! waiting for children are in [`super::signal`], fork and execve in `vmm::process`. With threads
//! (see [`super::thread`]), the per-thread fields of [`Proc`] (`sigmask`, `altstack`,
//! `clear_child_tid`, `robust_list`, `comm`, `sleep`) are the calling thread's: the thread
//! scheduler swaps them with the vCPU's registers. gettid, set_tid_address, sched_yield and futex
//! are in [`super::thread`] and [`super::futex`].
//!
//! Everything the host decides for the guest that a replay would have to reproduce goes through one
//! function per kind: [`random_bytes`] for randomness and [`clock_now`] for clocks.
//!
//! # Deterministic replay
//!
//! Randomness comes from the sandbox CRNG ([`super::crng::Crng`], in [`Proc::crng`]): seeded from
//! host entropy when the sandbox is made, given fresh host entropy on every unseeded sandbox clone
//! ([`diverge`]), and reset to a known stream by [`reseed`]. A reseed with `replay` also switches
//! the clocks ([`Proc::clocks`]) to **virtual time**: every clock starts where the guest last saw it
//! (or at [`REPLAY_EPOCH_NS`] / [`REPLAY_MONOTONIC_NS`] if it never read one) and advances only by
//! [`CLOCK_QUANTUM_NS`] per clock read (clock_gettime, gettimeofday, time, times, getrusage, sysinfo)
//! and by the durations the guest sleeps. A sleep (nanosleep, clock_nanosleep, futex timeouts) of a
//! process alone in its sandbox returns at once: nothing else could act while it waits, so waiting
//! would change nothing it can observe but the wall time it cannot see. With other guest processes
//! alive, the processes take turns on one virtual clock (`guestos::sched`): the sleep hands the
//! turn on and ends when the tree's time reaches its deadline (the other processes run meanwhile,
//! as under Linux: a parent that sleeps to let its child start, a `timeout` on a child). Virtual
//! time moves by exactly the length either way. CPU-time clocks advance by the quantum only.
//! Replay mode stays on until the next reseed (which may turn it off) or a reset to a state without
//! it. Both are part of [`Proc`], so snapshots, forks and resets carry them. See docs/replay.md.
//!
//! With other threads able to run, a sleep does not wait on the host: it yields to them and is
//! retried once its deadline has come (`guestos::sched::yield_blocked`). Otherwise sleeping
//! (nanosleep, clock_nanosleep) happens on the host in slices of
//! at most [`SLEEP_SLICE`]: when a slice ends before the deadline, the syscall is restarted (the guest
//! re-executes its `syscall` instruction, and the deadline is remembered in [`Proc::sleep`]). The
//! run loop therefore regains control between slices and a run's time budget is honoured even in the
//! middle of a long sleep, which simply continues in the next run.

use serde::{Deserialize, Serialize};

use super::crng::{Crng, Seed};
use super::{Ctx, Errno, GuestOs, SysResult, EFAULT, EINVAL, ENOSYS, EPERM, ESRCH};


/// Signals 1..=64.
pub const NSIG: usize = 64;
const SIGKILL: u64 = 9;
const SIGSTOP: u64 = 19;
/// Resource limits RLIMIT_CPU (0) ..= RLIMIT_RTTIME (15).
pub const RLIM_NLIMITS: usize = 16;
pub const RLIM_INFINITY: u64 = u64::MAX;
pub const RLIMIT_STACK: usize = 3;
pub const RLIMIT_NOFILE: usize = 7;
/// Longest host sleep inside one syscall before the run loop gets control back.
pub const SLEEP_SLICE: std::time::Duration = std::time::Duration::from_millis(50);
/// The smallest alternate signal stack Linux accepts (MINSIGSTKSZ).
pub const MINSIGSTKSZ: u64 = 2048;

/// One signal's disposition, as rt_sigaction's `struct k_sigaction` holds it on x86-64.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SigAction {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    pub cur: u64,
    pub max: u64,
}

/// The alternate signal stack (sigaltstack's `stack_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AltStack {
    pub sp: u64,
    pub flags: i32,
    pub size: u64,
}

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

/// Process identity and per-process settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proc {
    /// The guest's current directory (a normalised guest path).
    pub cwd: String,
    /// The running program's guest path (what /proc/self/exe names).
    pub exe: String,
    /// The thread name (PR_SET_NAME), NUL padded.
    pub comm: [u8; 16],
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    /// Real, effective, saved and file-system user ids; the same for groups.
    pub uid: [u32; 4],
    pub gid: [u32; 4],
    pub groups: Vec<u32>,
    pub umask: u32,
    pub rlimits: Vec<Rlimit>,
    /// Dispositions of signals 1..=64 (index 0 is signal 1).
    pub sigactions: Vec<SigAction>,
    pub sigmask: u64,
    pub altstack: AltStack,
    /// set_tid_address's pointer and set_robust_list's list.
    pub clear_child_tid: u64,
    pub robust_list: (u64, u64),
    pub pdeathsig: i32,
    pub dumpable: u64,
    pub no_new_privs: bool,
    /// CLOCK_MONOTONIC nanoseconds when the process started (uptime, times).
    pub start_ns: u64,
    /// The sandbox's next guest pid when this state was captured (see `signal::host::alloc_pid`).
    #[serde(default = "first_child_pid")]
    pub next_pid: i32,
    /// The nice value (-20..=19), bookkeeping only (see setpriority).
    #[serde(default)]
    pub nice: i32,
    pub sleep: Option<PendingSleep>,
    /// The sandbox CRNG: every random byte the guest gets. A guest fork gives the child
    /// `crng.fork_child()` (see `vmm::process`), a sandbox clone calls [`diverge`].
    pub crng: Crng,
    /// What the guest's clocks show: the host's, or virtual time in replay mode.
    pub clocks: Clocks,
}

fn first_child_pid() -> i32 {
    2
}

impl Default for Proc {
    fn default() -> Self {
        let inf = Rlimit { cur: RLIM_INFINITY, max: RLIM_INFINITY };
        let mut rlimits = vec![inf; RLIM_NLIMITS];
        rlimits[RLIMIT_STACK] = Rlimit { cur: 8 << 20, max: RLIM_INFINITY };
        rlimits[4] = Rlimit { cur: 0, max: RLIM_INFINITY }; // CORE
        rlimits[6] = Rlimit { cur: 4096, max: 4096 }; // NPROC
        rlimits[RLIMIT_NOFILE] = Rlimit { cur: 1024, max: 4096 };
        rlimits[8] = Rlimit { cur: 8 << 20, max: 8 << 20 }; // MEMLOCK
        rlimits[11] = Rlimit { cur: 4096, max: 4096 }; // SIGPENDING
        rlimits[12] = Rlimit { cur: 819_200, max: 819_200 }; // MSGQUEUE
        rlimits[13] = Rlimit { cur: 0, max: 0 }; // NICE
        rlimits[14] = Rlimit { cur: 0, max: 0 }; // RTPRIO
        Proc {
            cwd: "/".into(),
            exe: String::new(),
            comm: [0; 16],
            pid: 1,
            ppid: 0,
            pgid: 1,
            sid: 1,
            uid: [0; 4],
            gid: [0; 4],
            groups: Vec::new(),
            umask: 0o022,
            rlimits,
            sigactions: vec![SigAction::default(); NSIG],
            sigmask: 0,
            altstack: AltStack { sp: 0, flags: SS_DISABLE, size: 0 },
            clear_child_tid: 0,
            robust_list: (0, 0),
            pdeathsig: 0,
            dumpable: 1,
            no_new_privs: false,
            start_ns: monotonic_ns(),
            next_pid: first_child_pid(),
            nice: 0,
            sleep: None,
            crng: Crng::from_host_entropy(),
            clocks: Clocks::default(),
        }
    }
}

impl Proc {
    /// A resource limit (RLIMIT_*); unknown resources read as unlimited.
    pub fn rlimit(&self, resource: usize) -> Rlimit {
        self.rlimits.get(resource).copied().unwrap_or(Rlimit { cur: RLIM_INFINITY, max: RLIM_INFINITY })
    }

    /// Set the thread name from a program path (its last component, at most 15 bytes).
    pub fn set_comm_from_path(&mut self, path: &[u8]) {
        let base = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
        self.comm = [0; 16];
        let n = base.len().min(15);
        self.comm[..n].copy_from_slice(&base[..n]);
    }
}

/// Fill `buf` with random bytes for the guest (getrandom, AT_RANDOM, /dev/urandom and /dev/random).
///
/// The one source of guest randomness: the sandbox CRNG in [`Proc::crng`] (see the module comment).
pub fn random_bytes(proc: &mut Proc, buf: &mut [u8]) -> Result<(), Errno> {
    proc.crng.fill(buf);
    Ok(())
}

/// Reseed the sandbox CRNG of `os` with `seed` and, with `replay`, run its clocks on virtual time
/// from now on (without, on the host's clocks). Meant for a pause point: between runs, before the
/// code whose randomness should be reproducible. Everything the guest draws afterwards is a function
/// of `seed` and of what the guest does; the same holds for the clocks in replay mode.
pub fn reseed(os: &mut GuestOs, seed: Seed, replay: bool) {
    let p = &mut os.proc;
    p.crng.reseed(seed);
    // A sleep cut into slices restarts from its full duration in the new mode.
    p.sleep = None;
    if replay {
        p.clocks.start_replay(&mut p.start_ns);
    } else {
        p.clocks.replay = false;
    }
}

/// After a sandbox clone (a fork of the VMM process, a restore, a reset): give an unseeded CRNG
/// fresh host entropy, so that **unseeded clones never share randomness**. A CRNG seeded by
/// [`reseed`] keeps its stream: clones of a seeded sandbox replay alike until reseeded.
pub fn diverge(os: &mut GuestOs) {
    os.proc.crng.diverge();
}

/// The virtual clocks the guest sees once [`reseed`] turned on replay mode start at the REALTIME the
/// guest last read or, if it never read one, at this one: 2025-01-01T00:00:00Z.
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
    fn start_replay(&mut self, start_ns: &mut u64) {
        self.replay = true;
        self.real_base = if self.seen_real != 0 { self.seen_real } else { REPLAY_EPOCH_NS };
        self.mono_base = if self.seen_mono != 0 {
            self.seen_mono
        } else {
            *start_ns = REPLAY_MONOTONIC_NS;
            REPLAY_MONOTONIC_NS
        };
        self.cpu_base = self.seen_cpu;
        self.elapsed = 0;
        self.cpu_elapsed = 0;
    }

    /// Virtual time of `kind` now (replay mode), without advancing it.
    fn virtual_ns(&self, kind: ClockKind) -> u64 {
        match kind {
            ClockKind::Real => self.real_base.saturating_add(self.elapsed),
            ClockKind::Mono => self.mono_base.saturating_add(self.elapsed),
            ClockKind::Cpu => self.cpu_base.saturating_add(self.cpu_elapsed),
        }
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

/// The host's CLOCK_MONOTONIC in nanoseconds (host-side deadlines; not what the guest sees).
pub fn monotonic_ns() -> u64 {
    host_clock_now(libc::CLOCK_MONOTONIC).map(ns_of).unwrap_or(0)
}

fn timespec_bytes(s: i64, ns: i64) -> [u8; 16] {
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
    let slice = (deadline - now).min(SLEEP_SLICE.as_nanos() as u64);
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
        proc.sleep = None;
        proc.clocks.pass(d);
        return done;
    }
    let r = sleep_until(proc, ctx, nr, a, || Ok(monotonic_ns().saturating_add(d)), done);
    if proc.sleep.is_none() {
        proc.clocks.pass(d); // ended (not restarted for another slice)
    }
    r
}

pub const SYS_RT_SIGACTION: u64 = 13;
pub const SYS_RT_SIGPROCMASK: u64 = 14;
pub const SYS_SCHED_YIELD: u64 = 24;
pub const SYS_NANOSLEEP: u64 = 35;
pub const SYS_GETPID: u64 = 39;
pub const SYS_UNAME: u64 = 63;
pub const SYS_UMASK: u64 = 95;
pub const SYS_GETTIMEOFDAY: u64 = 96;
pub const SYS_GETRLIMIT: u64 = 97;
pub const SYS_GETRUSAGE: u64 = 98;
pub const SYS_SYSINFO: u64 = 99;
pub const SYS_TIMES: u64 = 100;
pub const SYS_GETUID: u64 = 102;
pub const SYS_GETGID: u64 = 104;
pub const SYS_SETUID: u64 = 105;
pub const SYS_SETGID: u64 = 106;
pub const SYS_GETEUID: u64 = 107;
pub const SYS_GETEGID: u64 = 108;
pub const SYS_SETPGID: u64 = 109;
pub const SYS_GETPPID: u64 = 110;
pub const SYS_GETPGRP: u64 = 111;
pub const SYS_SETSID: u64 = 112;
pub const SYS_SETREUID: u64 = 113;
pub const SYS_SETREGID: u64 = 114;
pub const SYS_GETGROUPS: u64 = 115;
pub const SYS_SETGROUPS: u64 = 116;
pub const SYS_SETRESUID: u64 = 117;
pub const SYS_GETRESUID: u64 = 118;
pub const SYS_SETRESGID: u64 = 119;
pub const SYS_GETRESGID: u64 = 120;
pub const SYS_GETPGID: u64 = 121;
pub const SYS_SETFSUID: u64 = 122;
pub const SYS_SETFSGID: u64 = 123;
pub const SYS_GETSID: u64 = 124;
pub const SYS_SIGALTSTACK: u64 = 131;
pub const SYS_PRCTL: u64 = 157;
pub const SYS_ARCH_PRCTL: u64 = 158;
pub const SYS_SETRLIMIT: u64 = 160;
pub const SYS_GETTID: u64 = 186;
pub const SYS_TIME: u64 = 201;
pub const SYS_FUTEX: u64 = 202;
pub const SYS_GETPRIORITY: u64 = 140;
pub const SYS_SETPRIORITY: u64 = 141;
pub const SYS_SCHED_SETPARAM: u64 = 142;
pub const SYS_SCHED_GETPARAM: u64 = 143;
pub const SYS_SCHED_SETSCHEDULER: u64 = 144;
pub const SYS_SCHED_GETSCHEDULER: u64 = 145;
pub const SYS_SCHED_GET_PRIORITY_MAX: u64 = 146;
pub const SYS_SCHED_GET_PRIORITY_MIN: u64 = 147;
pub const SYS_SCHED_RR_GET_INTERVAL: u64 = 148;
pub const SYS_SETTIMEOFDAY: u64 = 164;
pub const SYS_CLOCK_SETTIME: u64 = 227;
pub const SYS_SCHED_SETAFFINITY: u64 = 203;
pub const SYS_SCHED_GETAFFINITY: u64 = 204;
pub const SYS_SET_TID_ADDRESS: u64 = 218;
pub const SYS_CLOCK_GETTIME: u64 = 228;
pub const SYS_CLOCK_GETRES: u64 = 229;
pub const SYS_CLOCK_NANOSLEEP: u64 = 230;
pub const SYS_SET_ROBUST_LIST: u64 = 273;
pub const SYS_GET_ROBUST_LIST: u64 = 274;
pub const SYS_PRLIMIT64: u64 = 302;
pub const SYS_GETCPU: u64 = 309;
pub const SYS_GETRANDOM: u64 = 318;
pub const SYS_MEMBARRIER: u64 = 324;
pub const SYS_RSEQ: u64 = 334;

const ARCH_SET_GS: u64 = 0x1001;
const ARCH_SET_FS: u64 = 0x1002;
const ARCH_GET_FS: u64 = 0x1003;
const ARCH_GET_GS: u64 = 0x1004;

const SS_ONSTACK: i32 = 1;
const SS_DISABLE: i32 = 2;
const SS_AUTODISARM: i32 = 1 << 31;

/// The fields of `struct utsname` (65 bytes each).
pub const UTS_SYSNAME: &str = "Linux";
pub const UTS_NODENAME: &str = "sandbox";
pub const UTS_RELEASE: &str = "6.1.0-collimate";
pub const UTS_VERSION: &str = "#1 SMP PREEMPT_DYNAMIC";
pub const UTS_MACHINE: &str = "x86_64";
pub const UTS_DOMAINNAME: &str = "(none)";

/// `struct utsname` as uname(2) writes it.
pub fn utsname() -> [u8; 390] {
    let mut b = [0u8; 390];
    for (i, f) in [UTS_SYSNAME, UTS_NODENAME, UTS_RELEASE, UTS_VERSION, UTS_MACHINE, UTS_DOMAINNAME].iter().enumerate() {
        b[i * 65..i * 65 + f.len()].copy_from_slice(f.as_bytes());
    }
    b
}

fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// Whether `pid` names this process (0 means "the caller").
fn is_self(proc: &Proc, pid: u64) -> bool {
    let pid = pid as i32;
    pid == 0 || pid == proc.pid
}

const KEEP: u32 = u32::MAX;

/// setresuid/setresgid on `ids` (real, effective, saved, file-system), as Linux does it: with
/// privilege (effective uid 0) any ids; without, each new id must be one of the current real,
/// effective or saved ids. -1 keeps an id; the file-system id follows the effective one.
fn set_res(ids: &mut [u32; 4], r: u32, e: u32, s: u32, privileged: bool) -> Result<u64, Errno> {
    if !privileged && [r, e, s].iter().any(|&w| w != KEEP && !ids[..3].contains(&w)) {
        return Err(EPERM);
    }
    for (i, w) in [r, e, s].into_iter().enumerate() {
        if w != KEEP {
            ids[i] = w;
        }
    }
    ids[3] = ids[1];
    Ok(0)
}

/// setuid/setgid: with privilege, all four ids; without, the effective (and file-system) id, to
/// the real or saved one.
fn set_one(ids: &mut [u32; 4], id: u32, privileged: bool) -> Result<u64, Errno> {
    if privileged {
        *ids = [id; 4];
    } else if id == ids[0] || id == ids[2] {
        ids[1] = id;
        ids[3] = id;
    } else {
        return Err(EPERM);
    }
    Ok(0)
}

/// setreuid/setregid: the real id may become the effective one, the effective id any of the
/// three; the saved id follows the new effective id when the real id is set or the effective id
/// moves away from the real one.
fn set_re(ids: &mut [u32; 4], r: u32, e: u32, privileged: bool) -> Result<u64, Errno> {
    let old = *ids;
    if !privileged && ((r != KEEP && r != old[0] && r != old[1]) || (e != KEEP && !old[..3].contains(&e))) {
        return Err(EPERM);
    }
    if r != KEEP {
        ids[0] = r;
    }
    if e != KEEP {
        ids[1] = e;
    }
    if r != KEEP || (e != KEEP && e != old[0]) {
        ids[2] = ids[1];
    }
    ids[3] = ids[1];
    Ok(0)
}

/// setfsuid/setfsgid: returns the previous id whether or not it changes.
fn set_fs(ids: &mut [u32; 4], id: u32, privileged: bool) -> Result<u64, Errno> {
    let old = ids[3];
    if id != KEEP && (privileged || ids.contains(&id)) {
        ids[3] = id;
    }
    Ok(old as u64)
}

/// Handle a miscellaneous syscall; `None` if `nr` is not one of ours.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_ARCH_PRCTL => arch_prctl(ctx, a[0], a[1]),
        SYS_SET_TID_ADDRESS => {
            p.clear_child_tid = a[0];
            Ok(p.pid as u64)
        }
        SYS_SET_ROBUST_LIST => {
            if a[1] != 24 {
                Err(EINVAL)
            } else {
                p.robust_list = (a[0], a[1]);
                Ok(0)
            }
        }
        SYS_GET_ROBUST_LIST => {
            if !is_self(p, a[0]) {
                Err(ESRCH)
            } else {
                let (head, len) = p.robust_list;
                ctx.write(a[1], &head.to_le_bytes()).and_then(|_| ctx.write(a[2], &len.to_le_bytes())).map(|_| 0)
            }
        }
        // glibc registers rseq areas when the kernel has them and copes without.
        SYS_RSEQ => Err(ENOSYS),
        SYS_PRLIMIT64 => prlimit(p, ctx, a[0], a[1], a[2], a[3]),
        SYS_GETRLIMIT => prlimit(p, ctx, 0, a[0], 0, a[1]),
        SYS_SETRLIMIT => prlimit(p, ctx, 0, a[0], a[1], 0),
        SYS_UNAME => ctx.write(a[0], &utsname()).map(|_| 0),
        SYS_GETPID | SYS_GETTID => Ok(p.pid as u64),
        SYS_GETPPID => Ok(p.ppid as u64),
        SYS_GETUID => Ok(p.uid[0] as u64),
        SYS_GETEUID => Ok(p.uid[1] as u64),
        SYS_GETGID => Ok(p.gid[0] as u64),
        SYS_GETEGID => Ok(p.gid[1] as u64),
        SYS_GETGROUPS => {
            let size = a[0] as i32;
            let n = p.groups.len();
            if size < 0 || (size != 0 && (size as usize) < n) {
                Err(EINVAL)
            } else if size == 0 {
                Ok(n as u64)
            } else {
                ctx.write(a[1], &u32s(&p.groups)).map(|_| n as u64)
            }
        }
        SYS_SETGROUPS => {
            let size = a[0] as i32;
            if !(0..=65536).contains(&size) {
                Err(EINVAL)
            } else if p.uid[1] != 0 {
                Err(EPERM)
            } else {
                ctx.read_vec(a[1], size as usize * 4).map(|b| {
                    p.groups = b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                    0
                })
            }
        }
        // The setuid family: privilege is an effective uid of 0 (CAP_SETUID and CAP_SETGID).
        SYS_SETUID | SYS_SETGID | SYS_SETREUID | SYS_SETREGID | SYS_SETRESUID | SYS_SETRESGID | SYS_SETFSUID | SYS_SETFSGID => {
            let privileged = p.uid[1] == 0;
            let user = matches!(nr, SYS_SETUID | SYS_SETREUID | SYS_SETRESUID | SYS_SETFSUID);
            let ids = if user { &mut p.uid } else { &mut p.gid };
            let id = |i: usize| a[i] as u32;
            match nr {
                SYS_SETUID | SYS_SETGID => set_one(ids, id(0), privileged),
                SYS_SETREUID | SYS_SETREGID => set_re(ids, id(0), id(1), privileged),
                SYS_SETRESUID | SYS_SETRESGID => set_res(ids, id(0), id(1), id(2), privileged),
                _ => set_fs(ids, id(0), privileged),
            }
        }
        SYS_GETRESUID | SYS_GETRESGID => {
            let ids = if nr == SYS_GETRESUID { p.uid } else { p.gid };
            ctx.write(a[0], &ids[0].to_le_bytes())
                .and_then(|_| ctx.write(a[1], &ids[1].to_le_bytes()))
                .and_then(|_| ctx.write(a[2], &ids[2].to_le_bytes()))
                .map(|_| 0)
        }
        SYS_GETPGRP => Ok(p.pgid as u64),
        SYS_GETPGID => {
            if is_self(p, a[0]) {
                Ok(p.pgid as u64)
            } else {
                Err(ESRCH)
            }
        }
        SYS_GETSID => {
            if is_self(p, a[0]) {
                Ok(p.sid as u64)
            } else {
                Err(ESRCH)
            }
        }
        SYS_SETPGID => {
            let pgid = a[1] as i32;
            if !is_self(p, a[0]) {
                Err(ESRCH)
            } else if pgid < 0 {
                Err(EINVAL)
            } else if pgid == p.pgid || (pgid == 0 && p.pgid == p.pid) {
                Ok(0) // no change
            } else if pgid == 0 || pgid == p.pid {
                // Lead a group of its own (a forked process), unless it leads a session.
                if p.sid == p.pid {
                    Err(EPERM)
                } else {
                    p.pgid = p.pid;
                    crate::guestos::sched::set_pgid(p.pgid);
                    Ok(0)
                }
            } else {
                // Process groups of other processes are not tracked: nothing to join.
                Err(EPERM)
            }
        }
        // A process group leader cannot start a session (pid 1 leads its group).
        SYS_SETSID => {
            if p.pgid == p.pid {
                Err(EPERM)
            } else {
                p.sid = p.pid;
                p.pgid = p.pid;
                crate::guestos::sched::set_pgid(p.pgid);
                Ok(p.pid as u64)
            }
        }
        SYS_GETRANDOM => getrandom(p, ctx, a[0], a[1], a[2]),
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
        SYS_SCHED_YIELD => Ok(0),
        // Scheduling: every guest process runs under SCHED_OTHER. Its nice value is kept (and
        // inherited by its children) with Linux's rules: anyone may lower its priority, only root
        // raise it. It does not reach the host, which schedules the sandbox as a whole. Other
        // processes answer as nice 0.
        SYS_GETPRIORITY | SYS_SETPRIORITY => {
            let (which, who) = (a[0], a[1] as i32);
            let me = match which {
                0 => who == 0 || who == p.pid,
                1 => who == 0 || who == p.pgid,
                _ => who == 0 || who as u32 == p.uid[0],
            };
            if which > 2 || who < 0 {
                Err(EINVAL)
            } else if nr == SYS_GETPRIORITY {
                Ok((20 - if me { p.nice } else { 0 }) as u64) // the raw syscall answers 20 - nice
            } else if !me {
                Err(ESRCH)
            } else {
                let want = (a[2] as i32).clamp(-20, 19);
                if want < p.nice && p.uid[1] != 0 {
                    Err(super::EACCES)
                } else {
                    p.nice = want;
                    Ok(0)
                }
            }
        }
        SYS_SCHED_GETSCHEDULER => if (a[0] as i32) < 0 { Err(EINVAL) } else { Ok(0) },
        SYS_SCHED_GETPARAM => {
            if (a[0] as i32) < 0 || a[1] == 0 {
                Err(EINVAL)
            } else {
                ctx.write(a[1], &0i32.to_le_bytes()).map(|_| 0)
            }
        }
        SYS_SCHED_SETSCHEDULER | SYS_SCHED_SETPARAM => {
            let (policy, param) = if nr == SYS_SCHED_SETSCHEDULER { (a[1] as i32, a[2]) } else { (0, a[1]) };
            if (a[0] as i32) < 0 || param == 0 {
                Err(EINVAL)
            } else {
                let mut b = [0u8; 4];
                ctx.read(param, &mut b).and_then(|_| {
                    let prio = i32::from_le_bytes(b);
                    // SCHED_OTHER (0), SCHED_BATCH (3), SCHED_IDLE (5) take priority 0 only;
                    // the real-time policies (1, 2) need privileges the sandbox does not give.
                    match policy & !0x4000_0000 {
                        0 | 3 | 5 if prio == 0 => Ok(0),
                        0 | 3 | 5 => Err(EINVAL),
                        1 | 2 if (1..=99).contains(&prio) => Err(EPERM),
                        _ => Err(EINVAL),
                    }
                })
            }
        }
        SYS_SCHED_GET_PRIORITY_MAX | SYS_SCHED_GET_PRIORITY_MIN => match a[0] {
            0 | 3 | 5 => Ok(0),
            1 | 2 => Ok(if nr == SYS_SCHED_GET_PRIORITY_MAX { 99 } else { 1 }),
            _ => Err(EINVAL),
        },
        SYS_SCHED_RR_GET_INTERVAL => {
            if (a[0] as i32) < 0 {
                Err(EINVAL)
            } else {
                ctx.write(a[1], &timespec_bytes(0, 0)).map(|_| 0)
            }
        }
        // The sandbox may not set the clocks: EPERM for a clock that can be set, EINVAL otherwise.
        SYS_CLOCK_SETTIME => read_timespec(ctx, a[1]).and_then(|_| match a[0] as i32 {
            libc::CLOCK_REALTIME => Err(EPERM),
            _ => Err(EINVAL),
        }),
        SYS_SETTIMEOFDAY => Err(EPERM),
        SYS_SCHED_GETAFFINITY => {
            let len = a[1];
            if !is_self(p, a[0]) {
                Err(ESRCH)
            } else if len < 8 || len % 8 != 0 {
                Err(EINVAL)
            } else {
                ctx.write(a[2], &1u64.to_le_bytes()).map(|_| 8)
            }
        }
        SYS_SCHED_SETAFFINITY => {
            if !is_self(p, a[0]) {
                Err(ESRCH)
            } else if a[1] == 0 {
                Err(EINVAL)
            } else {
                ctx.read_vec(a[2], 1).and_then(|b| if b[0] & 1 != 0 { Ok(0) } else { Err(EINVAL) })
            }
        }
        SYS_GETCPU => {
            let zero = 0u32.to_le_bytes();
            let r = if a[0] != 0 { ctx.write(a[0], &zero) } else { Ok(()) };
            r.and_then(|_| if a[1] != 0 { ctx.write(a[1], &zero) } else { Ok(()) }).map(|_| 0)
        }
        SYS_SYSINFO => sysinfo(p, ctx).and_then(|b| ctx.write(a[0], &b).map(|_| 0)),
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
        SYS_RT_SIGACTION => rt_sigaction(p, ctx, a[0], a[1], a[2], a[3]),
        SYS_RT_SIGPROCMASK => rt_sigprocmask(p, ctx, a[0], a[1], a[2], a[3]),
        SYS_SIGALTSTACK => sigaltstack(p, ctx, a[0], a[1]),
        SYS_PRCTL => prctl(p, ctx, a),
        SYS_UMASK => {
            let old = p.umask;
            p.umask = (a[0] as u32) & 0o777;
            Ok(old as u64)
        }
        SYS_MEMBARRIER => Ok(0),
        _ => return None,
    };
    Some(r)
}

fn arch_prctl(ctx: &mut Ctx, code: u64, addr: u64) -> SysResult {
    match code {
        ARCH_SET_FS | ARCH_SET_GS => {
            if addr >= super::mm::TASK_SIZE {
                return Err(EPERM);
            }
            if code == ARCH_SET_FS {
                ctx.sregs.fs.base = addr;
            } else {
                ctx.sregs.gs.base = addr;
            }
            Ok(0)
        }
        ARCH_GET_FS => {
            let v = ctx.sregs.fs.base;
            ctx.write(addr, &v.to_le_bytes()).map(|_| 0)
        }
        ARCH_GET_GS => {
            let v = ctx.sregs.gs.base;
            ctx.write(addr, &v.to_le_bytes()).map(|_| 0)
        }
        // ARCH_GET_CPUID/SET_CPUID, the CET and AMX requests: not offered.
        _ => Err(EINVAL),
    }
}

fn prlimit(p: &mut Proc, ctx: &mut Ctx, pid: u64, resource: u64, new: u64, old: u64) -> SysResult {
    if !is_self(p, pid) {
        return Err(ESRCH);
    }
    let res = resource as usize;
    if res >= RLIM_NLIMITS {
        return Err(EINVAL);
    }
    let new_lim = if new != 0 {
        let b = ctx.read_vec(new, 16)?;
        let cur = u64::from_le_bytes(b[..8].try_into().map_err(|_| EFAULT)?);
        let max = u64::from_le_bytes(b[8..].try_into().map_err(|_| EFAULT)?);
        if cur > max {
            return Err(EINVAL);
        }
        Some(Rlimit { cur, max })
    } else {
        None
    };
    if old != 0 {
        let l = p.rlimit(res);
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&l.cur.to_le_bytes());
        b[8..].copy_from_slice(&l.max.to_le_bytes());
        ctx.write(old, &b)?;
    }
    if let Some(l) = new_lim {
        // Raising a hard limit needs CAP_SYS_RESOURCE, which only root has here.
        if l.max > p.rlimit(res).max && p.uid[1] != 0 {
            return Err(EPERM);
        }
        if let Some(slot) = p.rlimits.get_mut(res) {
            *slot = l;
        }
    }
    Ok(0)
}

fn getrandom(p: &mut Proc, ctx: &mut Ctx, buf: u64, len: u64, flags: u64) -> SysResult {
    const GRND_NONBLOCK: u64 = 1;
    const GRND_RANDOM: u64 = 2;
    const GRND_INSECURE: u64 = 4;
    if flags & !(GRND_NONBLOCK | GRND_RANDOM | GRND_INSECURE) != 0 || flags & (GRND_RANDOM | GRND_INSECURE) == GRND_RANDOM | GRND_INSECURE {
        return Err(EINVAL);
    }
    // Linux may return fewer bytes than asked for large requests; so do we, past 1 MiB.
    let n = len.min(1 << 20) as usize;
    let mut b = vec![0u8; n];
    random_bytes(p, &mut b)?;
    ctx.write(buf, &b)?;
    Ok(n as u64)
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

/// `struct sysinfo` (112 bytes on x86-64): the guest's memory, one process, no swap.
fn sysinfo(p: &mut Proc, ctx: &Ctx) -> Result<[u8; 112], Errno> {
    let mut b = [0u8; 112];
    let uptime = clock_now_ns(p, libc::CLOCK_MONOTONIC)?.saturating_sub(p.start_ns) / 1_000_000_000;
    let total = ctx.mem.size();
    let free = ctx.frames.available() * crate::arch::x86_64::layout::PAGE_SIZE;
    b[..8].copy_from_slice(&uptime.to_le_bytes());
    b[32..40].copy_from_slice(&total.to_le_bytes());
    b[40..48].copy_from_slice(&free.min(total).to_le_bytes());
    b[80..82].copy_from_slice(&1u16.to_le_bytes());
    b[104..108].copy_from_slice(&1u32.to_le_bytes());
    Ok(b)
}

fn check_sig(sig: u64) -> Result<usize, Errno> {
    if (1..=NSIG as u64).contains(&sig) {
        Ok(sig as usize - 1)
    } else {
        Err(EINVAL)
    }
}

fn rt_sigaction(p: &mut Proc, ctx: &mut Ctx, sig: u64, act: u64, oact: u64, setsize: u64) -> SysResult {
    if setsize != 8 {
        return Err(EINVAL);
    }
    let i = check_sig(sig)?;
    if act != 0 && (sig == SIGKILL || sig == SIGSTOP) {
        return Err(EINVAL);
    }
    let new = if act != 0 {
        let b = ctx.read_vec(act, 32)?;
        let w = |k: usize| u64::from_le_bytes([b[k], b[k + 1], b[k + 2], b[k + 3], b[k + 4], b[k + 5], b[k + 6], b[k + 7]]);
        Some(SigAction { handler: w(0), flags: w(8), restorer: w(16), mask: w(24) })
    } else {
        None
    };
    let old = p.sigactions.get(i).copied().unwrap_or_default();
    if oact != 0 {
        let mut b = [0u8; 32];
        for (k, v) in [old.handler, old.flags, old.restorer, old.mask].iter().enumerate() {
            b[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        ctx.write(oact, &b)?;
    }
    if let (Some(n), Some(slot)) = (new, p.sigactions.get_mut(i)) {
        *slot = n;
    }
    Ok(0)
}

fn rt_sigprocmask(p: &mut Proc, ctx: &mut Ctx, how: u64, set: u64, oset: u64, setsize: u64) -> SysResult {
    const SIG_BLOCK: u64 = 0;
    const SIG_UNBLOCK: u64 = 1;
    const SIG_SETMASK: u64 = 2;
    if setsize != 8 {
        return Err(EINVAL);
    }
    let new = if set != 0 {
        let s = ctx.read_u64(set)?;
        let m = match how {
            SIG_BLOCK => p.sigmask | s,
            SIG_UNBLOCK => p.sigmask & !s,
            SIG_SETMASK => s,
            _ => return Err(EINVAL),
        };
        // SIGKILL and SIGSTOP cannot be blocked.
        Some(m & !((1 << (SIGKILL - 1)) | (1 << (SIGSTOP - 1))))
    } else {
        None
    };
    if oset != 0 {
        ctx.write(oset, &p.sigmask.to_le_bytes())?;
    }
    if let Some(m) = new {
        p.sigmask = m;
    }
    Ok(0)
}

fn sigaltstack(p: &mut Proc, ctx: &mut Ctx, ss: u64, old: u64) -> SysResult {
    let new = if ss != 0 {
        let b = ctx.read_vec(ss, 24)?;
        let sp = u64::from_le_bytes(b[..8].try_into().map_err(|_| EFAULT)?);
        let flags = i32::from_le_bytes(b[8..12].try_into().map_err(|_| EFAULT)?);
        let size = u64::from_le_bytes(b[16..24].try_into().map_err(|_| EFAULT)?);
        let mode = flags & !SS_AUTODISARM;
        if mode != 0 && mode != SS_DISABLE && mode != SS_ONSTACK {
            return Err(EINVAL);
        }
        if mode == SS_DISABLE {
            Some(AltStack { sp: 0, flags: SS_DISABLE, size: 0 })
        } else if size < MINSIGSTKSZ {
            return Err(super::ENOMEM);
        } else {
            Some(AltStack { sp, flags: flags & SS_AUTODISARM, size })
        }
    } else {
        None
    };
    if old != 0 {
        let s = p.altstack;
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&s.sp.to_le_bytes());
        b[8..12].copy_from_slice(&s.flags.to_le_bytes());
        b[16..24].copy_from_slice(&s.size.to_le_bytes());
        ctx.write(old, &b)?;
    }
    if let Some(n) = new {
        p.altstack = n;
    }
    Ok(0)
}

fn prctl(p: &mut Proc, ctx: &mut Ctx, a: [u64; 6]) -> SysResult {
    const PR_SET_PDEATHSIG: u64 = 1;
    const PR_GET_PDEATHSIG: u64 = 2;
    const PR_GET_DUMPABLE: u64 = 3;
    const PR_SET_DUMPABLE: u64 = 4;
    const PR_SET_NAME: u64 = 15;
    const PR_GET_NAME: u64 = 16;
    const PR_SET_NO_NEW_PRIVS: u64 = 38;
    const PR_GET_NO_NEW_PRIVS: u64 = 39;
    match a[0] {
        PR_SET_PDEATHSIG => {
            if a[1] > NSIG as u64 {
                return Err(EINVAL);
            }
            p.pdeathsig = a[1] as i32;
            Ok(0)
        }
        PR_GET_PDEATHSIG => ctx.write(a[1], &p.pdeathsig.to_le_bytes()).map(|_| 0),
        PR_GET_DUMPABLE => Ok(p.dumpable),
        PR_SET_DUMPABLE => {
            if a[1] > 1 {
                return Err(EINVAL);
            }
            p.dumpable = a[1];
            Ok(0)
        }
        PR_SET_NAME => {
            // Like strncpy_from_user(comm, name, 16): at most 15 bytes, and never past a NUL.
            let mut name = [0u8; 16];
            for (i, slot) in name.iter_mut().take(15).enumerate() {
                let mut c = [0u8; 1];
                ctx.read(a[1].wrapping_add(i as u64), &mut c)?;
                if c[0] == 0 {
                    break;
                }
                *slot = c[0];
            }
            p.comm = name;
            Ok(0)
        }
        PR_GET_NAME => {
            let comm = p.comm;
            ctx.write(a[1], &comm).map(|_| 0)
        }
        PR_SET_NO_NEW_PRIVS => {
            if a[1] != 1 || a[2] != 0 || a[3] != 0 || a[4] != 0 {
                return Err(EINVAL);
            }
            p.no_new_privs = true;
            Ok(0)
        }
        PR_GET_NO_NEW_PRIVS => Ok(p.no_new_privs as u64),
        _ => Err(EINVAL),
    }
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

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::paging::{setup_address_space, AddressSpace, FrameAllocator, PTE_NX, PTE_U, PTE_W};
    use crate::guestos::{Output, GuestOs};
    use crate::vstate::memory::GuestMemory;
    use kvm_bindings::{kvm_regs, kvm_sregs};

    const BUF: u64 = 0x1000_0000;

    struct T {
        mem: GuestMemory,
        frames: FrameAllocator,
        aspace: AddressSpace,
        regs: kvm_regs,
        sregs: kvm_sregs,
        out: Output,
        os: GuestOs,
        _dir: std::path::PathBuf,
    }

    impl T {
        fn new() -> T {
            let mut mem = GuestMemory::anonymous(16 << 20).unwrap();
            let mut frames = FrameAllocator::new(16 << 20);
            let aspace = setup_address_space(&mut mem, &mut frames).unwrap();
            aspace.map_fresh(&mut mem, &mut frames, BUF, 2 * 4096, PTE_U | PTE_W | PTE_NX).unwrap();
            let dir = std::env::temp_dir().join(format!("misc-test-{}-{:?}", std::process::id(), std::thread::current().id()));
            std::fs::create_dir_all(&dir).unwrap();
            let os = GuestOs {
                mm: Default::default(),
                files: Default::default(),
                vfs: crate::guestos::vfs::Vfs::new(&dir).unwrap(),
                proc: Default::default(),
                enosys: Default::default(),
                stdio: None,
                agent: None,
                sig: Default::default(),
                threads: Default::default(),
            };
            T { mem, frames, aspace, regs: Default::default(), sregs: Default::default(), out: Default::default(), os, _dir: dir }
        }
        fn call(&mut self, nr: u64, a: [u64; 6]) -> i64 {
            self.regs.rax = nr;
            self.regs.rip = 0x40_1002;
            let mut ctx = Ctx {
                mem: &mut self.mem,
                frames: &mut self.frames,
                aspace: &self.aspace,
                regs: &mut self.regs,
                sregs: &mut self.sregs,
                out: &mut self.out,
                flush_tlb: false,
                stale_frames: Vec::new(),
                stop: None,
                lazy: self.os.mm.lazy_areas(),
            };
            match dispatch(&mut self.os, &mut ctx, nr, a) {
                Some(Ok(v)) => v as i64,
                Some(Err(e)) => -(e.0 as i64),
                None => panic!("syscall {nr} not handled"),
            }
        }
        fn read(&self, va: u64, n: usize) -> Vec<u8> {
            let mut b = vec![0u8; n];
            self.aspace.read_virt(&self.mem, va, &mut b, true).unwrap();
            b
        }
        fn write(&mut self, va: u64, d: &[u8]) {
            self.aspace.write_virt(&mut self.mem, va, d, true).unwrap();
        }
    }

    fn cstr(b: &[u8]) -> &[u8] {
        &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]
    }

    #[test]
    fn uname_layout() {
        let mut t = T::new();
        assert_eq!(t.call(SYS_UNAME, [BUF, 0, 0, 0, 0, 0]), 0);
        let b = t.read(BUF, 390);
        let fields: Vec<&[u8]> = b.chunks(65).map(cstr).collect();
        assert_eq!(fields, [&b"Linux"[..], b"sandbox", b"6.1.0-collimate", UTS_VERSION.as_bytes(), b"x86_64", b"(none)"]);
        assert_eq!(t.call(SYS_UNAME, [0x10, 0, 0, 0, 0, 0]), -14);
    }

    #[test]
    fn identity() {
        let mut t = T::new();
        assert_eq!(t.call(SYS_GETPID, [0; 6]), 1);
        assert_eq!(t.call(SYS_GETTID, [0; 6]), 1);
        assert_eq!(t.call(SYS_GETPPID, [0; 6]), 0);
        assert_eq!(t.call(SYS_GETUID, [0; 6]), 0);
        assert_eq!(t.call(SYS_GETEGID, [0; 6]), 0);
        assert_eq!(t.call(SYS_SETUID, [0; 6]), 0);
        assert_eq!(t.call(SYS_SETRESUID, [u64::MAX, 0, u32::MAX as u64, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_GETRESGID, [BUF, BUF + 4, BUF + 8, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_GETGROUPS, [0; 6]), 0);
        t.write(BUF, &[5, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(t.call(SYS_SETGROUPS, [2, BUF, 0, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_GETGROUPS, [0; 6]), 2);
        assert_eq!(t.call(SYS_GETGROUPS, [1, BUF + 64, 0, 0, 0, 0]), -22);
        assert_eq!(t.call(SYS_GETGROUPS, [2, BUF + 64, 0, 0, 0, 0]), 2);
        assert_eq!(t.read(BUF + 64, 8), [5, 0, 0, 0, 7, 0, 0, 0]);
        assert_eq!(t.call(SYS_GETPGID, [0; 6]), 1);
        assert_eq!(t.call(SYS_GETSID, [77, 0, 0, 0, 0, 0]), -3);
        assert_eq!(t.call(SYS_SETPGID, [0; 6]), 0);
        assert_eq!(t.call(SYS_SETSID, [0; 6]), -1);
        assert_eq!(t.call(SYS_SET_TID_ADDRESS, [BUF, 0, 0, 0, 0, 0]), 1);
        assert_eq!(t.os.proc.clear_child_tid, BUF);
        assert_eq!(t.call(SYS_UMASK, [0o077, 0, 0, 0, 0, 0]), 0o022);
        assert_eq!(t.call(SYS_UMASK, [0o7777, 0, 0, 0, 0, 0]), 0o077);
        assert_eq!(t.os.proc.umask, 0o777);
    }

    #[test]
    fn set_ids_like_linux() {
        let mut t = T::new();
        let keep = u32::MAX as u64;
        // Root drops to a user for a while (effective only), and comes back through the saved id.
        assert_eq!(t.call(SYS_SETRESUID, [keep, 1000, keep, 0, 0, 0]), 0);
        assert_eq!(t.os.proc.uid, [0, 1000, 0, 1000]);
        assert_eq!(t.call(SYS_SETUID, [7, 0, 0, 0, 0, 0]), -1); // no privilege now
        assert_eq!(t.call(SYS_SETUID, [0; 6]), 0); // back to the real id
        assert_eq!(t.os.proc.uid, [0; 4]);
        // Root's setgid and setuid set every id, for good.
        assert_eq!(t.call(SYS_SETGID, [1000, 0, 0, 0, 0, 0]), 0);
        assert_eq!(t.os.proc.gid, [1000; 4]);
        assert_eq!(t.call(SYS_SETUID, [1000, 0, 0, 0, 0, 0]), 0);
        assert_eq!(t.os.proc.uid, [1000; 4]);
        assert_eq!(t.call(SYS_GETEUID, [0; 6]), 1000);
        assert_eq!(t.call(SYS_SETUID, [0; 6]), -1);
        assert_eq!(t.call(SYS_SETRESUID, [keep, 0, keep, 0, 0, 0]), -1);
        assert_eq!(t.call(SYS_SETREUID, [0, keep, 0, 0, 0, 0]), -1);
        assert_eq!(t.call(SYS_SETGID, [0; 6]), -1);
        assert_eq!(t.call(SYS_SETUID, [1000, 0, 0, 0, 0, 0]), 0); // its own id: fine
        // setfsuid answers the old id and changes only to an id the process has.
        assert_eq!(t.call(SYS_SETFSUID, [0; 6]), 1000);
        assert_eq!(t.os.proc.uid[3], 1000);
        // setreuid swaps real and effective (saved follows the new effective id).
        let mut t = T::new();
        assert_eq!(t.call(SYS_SETRESUID, [1, 2, 3, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_SETREUID, [2, 1, 0, 0, 0, 0]), 0);
        assert_eq!(t.os.proc.uid, [2, 1, 1, 1]);
        assert_eq!(t.call(SYS_SETREUID, [3, keep, 0, 0, 0, 0]), -1);
    }

    #[test]
    fn arch_prctl_sets_fs() {
        let mut t = T::new();
        assert_eq!(t.call(SYS_ARCH_PRCTL, [ARCH_SET_FS, 0x7000_1234, 0, 0, 0, 0]), 0);
        assert_eq!(t.sregs.fs.base, 0x7000_1234);
        assert_eq!(t.call(SYS_ARCH_PRCTL, [ARCH_GET_FS, BUF, 0, 0, 0, 0]), 0);
        assert_eq!(t.read(BUF, 8), 0x7000_1234u64.to_le_bytes());
        assert_eq!(t.call(SYS_ARCH_PRCTL, [ARCH_SET_GS, 0x5000, 0, 0, 0, 0]), 0);
        assert_eq!(t.sregs.gs.base, 0x5000);
        assert_eq!(t.call(SYS_ARCH_PRCTL, [ARCH_SET_FS, 0xffff_8000_0000_0000, 0, 0, 0, 0]), -1);
        assert_eq!(t.call(SYS_ARCH_PRCTL, [0x3001, BUF, 0, 0, 0, 0]), -22);
    }

    #[test]
    fn rlimits_round_trip() {
        let mut t = T::new();
        assert_eq!(t.call(SYS_PRLIMIT64, [0, RLIMIT_STACK as u64, 0, BUF, 0, 0]), 0);
        assert_eq!(t.read(BUF, 16)[..8], (8u64 << 20).to_le_bytes());
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&100u64.to_le_bytes());
        b[8..].copy_from_slice(&200u64.to_le_bytes());
        t.write(BUF + 32, &b);
        assert_eq!(t.call(SYS_SETRLIMIT, [RLIMIT_NOFILE as u64, BUF + 32, 0, 0, 0, 0]), 0);
        assert_eq!(t.os.proc.rlimit(RLIMIT_NOFILE), Rlimit { cur: 100, max: 200 });
        assert_eq!(t.call(SYS_GETRLIMIT, [RLIMIT_NOFILE as u64, BUF + 64, 0, 0, 0, 0]), 0);
        assert_eq!(t.read(BUF + 64, 16), b);
        b[..8].copy_from_slice(&300u64.to_le_bytes());
        t.write(BUF + 32, &b);
        assert_eq!(t.call(SYS_SETRLIMIT, [RLIMIT_NOFILE as u64, BUF + 32, 0, 0, 0, 0]), -22);
        assert_eq!(t.call(SYS_PRLIMIT64, [42, 0, 0, BUF, 0, 0]), -3);
        assert_eq!(t.call(SYS_GETRLIMIT, [99, BUF, 0, 0, 0, 0]), -22);
    }

    #[test]
    fn signal_bookkeeping() {
        let mut t = T::new();
        let mut act = [0u8; 32];
        act[..8].copy_from_slice(&0x40_1000u64.to_le_bytes());
        act[8..16].copy_from_slice(&0x0400_0000u64.to_le_bytes());
        t.write(BUF, &act);
        assert_eq!(t.call(SYS_RT_SIGACTION, [2, BUF, BUF + 64, 8, 0, 0]), 0);
        assert_eq!(t.read(BUF + 64, 32), [0u8; 32]);
        assert_eq!(t.call(SYS_RT_SIGACTION, [2, 0, BUF + 64, 8, 0, 0]), 0);
        assert_eq!(t.read(BUF + 64, 32), act);
        assert_eq!(t.call(SYS_RT_SIGACTION, [9, BUF, 0, 8, 0, 0]), -22);
        assert_eq!(t.call(SYS_RT_SIGACTION, [65, 0, 0, 8, 0, 0]), -22);
        assert_eq!(t.call(SYS_RT_SIGACTION, [2, 0, 0, 16, 0, 0]), -22);
        t.write(BUF, &(u64::MAX).to_le_bytes());
        assert_eq!(t.call(SYS_RT_SIGPROCMASK, [0, BUF, BUF + 8, 8, 0, 0]), 0);
        assert_eq!(t.read(BUF + 8, 8), [0; 8]);
        assert_eq!(t.os.proc.sigmask, !(1 << 8) & !(1 << 18));
        assert_eq!(t.call(SYS_RT_SIGPROCMASK, [7, BUF, 0, 8, 0, 0]), -22);
        // sigaltstack: old is disabled; a too small stack is ENOMEM.
        let mut ss = [0u8; 24];
        ss[..8].copy_from_slice(&BUF.to_le_bytes());
        ss[16..].copy_from_slice(&1024u64.to_le_bytes());
        t.write(BUF + 128, &ss);
        assert_eq!(t.call(SYS_SIGALTSTACK, [BUF + 128, BUF + 256, 0, 0, 0, 0]), -12);
        assert_eq!(t.call(SYS_SIGALTSTACK, [0, BUF + 256, 0, 0, 0, 0]), 0);
        assert_eq!(i32::from_le_bytes(t.read(BUF + 256 + 8, 4).try_into().unwrap()), SS_DISABLE);
        ss[16..].copy_from_slice(&65536u64.to_le_bytes());
        t.write(BUF + 128, &ss);
        assert_eq!(t.call(SYS_SIGALTSTACK, [BUF + 128, 0, 0, 0, 0, 0]), 0);
        assert_eq!(t.os.proc.altstack, AltStack { sp: BUF, flags: 0, size: 65536 });
    }

    #[test]
    fn prctl_name_and_deathsig() {
        let mut t = T::new();
        t.write(BUF, b"a-very-long-thread-name\0");
        assert_eq!(t.call(SYS_PRCTL, [15, BUF, 0, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_PRCTL, [16, BUF + 64, 0, 0, 0, 0]), 0);
        assert_eq!(t.read(BUF + 64, 16), b"a-very-long-thr\0");
        assert_eq!(t.call(SYS_PRCTL, [1, 9, 0, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_PRCTL, [2, BUF, 0, 0, 0, 0]), 0);
        assert_eq!(t.read(BUF, 4), 9i32.to_le_bytes());
        assert_eq!(t.call(SYS_PRCTL, [0x5999, 0, 0, 0, 0, 0]), -22);
    }

    #[test]
    fn time_and_random() {
        let mut t = T::new();
        assert_eq!(t.call(SYS_CLOCK_GETTIME, [1, BUF, 0, 0, 0, 0]), 0);
        let a = t.read(BUF, 16);
        assert_eq!(t.call(SYS_CLOCK_GETTIME, [1, BUF, 0, 0, 0, 0]), 0);
        let b = t.read(BUF, 16);
        let ns = |v: &[u8]| {
            i64::from_le_bytes(v[..8].try_into().unwrap()) as i128 * 1_000_000_000 + i64::from_le_bytes(v[8..].try_into().unwrap()) as i128
        };
        assert!(ns(&b) >= ns(&a));
        // glibc's encoding of "this process's CPU clock".
        assert_eq!(t.call(SYS_CLOCK_GETTIME, [(-6i64) as u64, BUF, 0, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_CLOCK_GETTIME, [10, BUF, 0, 0, 0, 0]), -22);
        assert_eq!(t.call(SYS_CLOCK_GETTIME, [(-6i64 - 8 * 41) as u64, BUF, 0, 0, 0, 0]), -22);
        assert_eq!(t.call(SYS_CLOCK_GETRES, [0, BUF, 0, 0, 0, 0]), 0);
        let secs = t.call(SYS_TIME, [BUF, 0, 0, 0, 0, 0]);
        assert!(secs > 1_600_000_000);
        assert_eq!(t.call(SYS_GETTIMEOFDAY, [BUF, BUF + 16, 0, 0, 0, 0]), 0);
        assert!(i64::from_le_bytes(t.read(BUF + 8, 8).try_into().unwrap()) < 1_000_000);
        assert_eq!(t.call(SYS_GETRANDOM, [BUF, 64, 0, 0, 0, 0]), 64);
        let r1 = t.read(BUF, 64);
        assert_eq!(t.call(SYS_GETRANDOM, [BUF, 64, 1, 0, 0, 0]), 64);
        assert_ne!(r1, t.read(BUF, 64));
        assert_eq!(t.call(SYS_GETRANDOM, [BUF, 64, 6, 0, 0, 0]), -22);
        assert_eq!(t.call(SYS_GETRANDOM, [0x20, 64, 0, 0, 0, 0]), -14);
    }

    #[test]
    fn long_sleeps_are_sliced_and_restarted() {
        let mut t = T::new();
        // 120 ms: the first call sleeps one slice and asks for a restart.
        t.write(BUF, &timespec_bytes(0, 120_000_000));
        let start = std::time::Instant::now();
        let mut calls = 0;
        loop {
            calls += 1;
            let rip = 0x40_1002;
            let r = t.call(SYS_NANOSLEEP, [BUF, 0, 0, 0, 0, 0]);
            if r == 0 {
                assert_eq!(t.regs.rip, rip);
                break;
            }
            assert_eq!(r as u64, SYS_NANOSLEEP, "a restart leaves the syscall number in rax");
            assert_eq!(t.regs.rip, rip - 2, "and rip on the syscall instruction");
            assert!(calls < 10);
        }
        let took = start.elapsed();
        assert!(took >= std::time::Duration::from_millis(120), "{took:?}");
        // Generous bounds: a loaded host oversleeps each slice (one CI run saw 2 calls, not 3).
        assert!(took < std::time::Duration::from_secs(5), "{took:?}");
        assert!(calls >= 2, "sliced: restarted at least once ({calls} calls)");
        assert!(t.os.proc.sleep.is_none());
        // Bad requests.
        t.write(BUF, &timespec_bytes(0, 1_000_000_000));
        assert_eq!(t.call(SYS_NANOSLEEP, [BUF, 0, 0, 0, 0, 0]), -22);
        assert_eq!(t.call(SYS_CLOCK_NANOSLEEP, [3, 0, BUF, 0, 0, 0]), -22);
        // An absolute deadline in the past returns at once.
        t.write(BUF, &timespec_bytes(1, 0));
        assert_eq!(t.call(SYS_CLOCK_NANOSLEEP, [1, 1, BUF, 0, 0, 0]), 0);
    }

    #[test]
    fn affinity_and_sysinfo() {
        let mut t = T::new();
        assert_eq!(t.call(SYS_SCHED_GETAFFINITY, [0, 128, BUF, 0, 0, 0]), 8);
        assert_eq!(t.read(BUF, 8), 1u64.to_le_bytes());
        assert_eq!(t.call(SYS_SCHED_GETAFFINITY, [0, 4, BUF, 0, 0, 0]), -22);
        assert_eq!(t.call(SYS_GETCPU, [BUF, BUF + 4, 0, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_SYSINFO, [BUF, 0, 0, 0, 0, 0]), 0);
        let b = t.read(BUF, 112);
        assert_eq!(u64::from_le_bytes(b[32..40].try_into().unwrap()), 16 << 20);
        assert!(u64::from_le_bytes(b[40..48].try_into().unwrap()) > 0);
        assert_eq!(u32::from_le_bytes(b[104..108].try_into().unwrap()), 1);
        assert!(t.call(SYS_TIMES, [BUF, 0, 0, 0, 0, 0]) > 0);
        assert_eq!(t.call(SYS_GETRUSAGE, [0, BUF, 0, 0, 0, 0]), 0);
        assert_eq!(t.call(SYS_GETRUSAGE, [5, BUF, 0, 0, 0, 0]), -22);
        assert_eq!(t.call(SYS_RSEQ, [0; 6]), -38);
        assert_eq!(t.call(SYS_MEMBARRIER, [0; 6]), 0);
    }

    fn ts_ns(b: &[u8]) -> u64 {
        let s = i64::from_le_bytes(b[..8].try_into().unwrap());
        let ns = i64::from_le_bytes(b[8..16].try_into().unwrap());
        s as u64 * 1_000_000_000 + ns as u64
    }

    impl T {
        /// clock_gettime(clock) in ns.
        fn now(&mut self, clock: u64) -> u64 {
            assert_eq!(self.call(SYS_CLOCK_GETTIME, [clock, BUF + 512, 0, 0, 0, 0]), 0);
            ts_ns(&self.read(BUF + 512, 16))
        }
        /// Everything time- and randomness-related a guest can observe, in one transcript.
        fn transcript(&mut self) -> Vec<u8> {
            let mut v = Vec::new();
            for clock in [0u64, 1, 2, 3, 4, 5, 6, 7, 11, (-6i64) as u64] {
                v.extend(self.now(clock).to_le_bytes());
            }
            assert_eq!(self.call(SYS_GETTIMEOFDAY, [BUF, 0, 0, 0, 0, 0]), 0);
            v.extend(self.read(BUF, 16));
            v.extend(self.call(SYS_TIME, [0; 6]).to_le_bytes());
            v.extend(self.call(SYS_TIMES, [BUF, 0, 0, 0, 0, 0]).to_le_bytes());
            v.extend(self.read(BUF, 32));
            assert_eq!(self.call(SYS_GETRUSAGE, [0, BUF, 0, 0, 0, 0]), 0);
            v.extend(self.read(BUF, 32));
            assert_eq!(self.call(SYS_SYSINFO, [BUF, 0, 0, 0, 0, 0]), 0);
            v.extend(self.read(BUF, 8));
            assert_eq!(self.call(SYS_CLOCK_GETRES, [5, BUF, 0, 0, 0, 0]), 0);
            v.extend(self.read(BUF, 16));
            self.write(BUF + 64, &timespec_bytes(0, 500));
            assert_eq!(self.call(SYS_NANOSLEEP, [BUF + 64, 0, 0, 0, 0, 0]), 0);
            v.extend(self.now(1).to_le_bytes());
            assert_eq!(self.call(SYS_GETRANDOM, [BUF, 48, 0, 0, 0, 0]), 48);
            v.extend(self.read(BUF, 48));
            v
        }
    }

    #[test]
    fn reseeded_replay_is_deterministic() {
        let seed = [0x5a; 32];
        let (mut a, mut b) = (T::new(), T::new());
        // Different histories before the reseed: host clocks, different random bytes.
        a.now(0);
        assert_eq!(a.call(SYS_GETRANDOM, [BUF, 16, 0, 0, 0, 0]), 16);
        let (ta, tb) = (a.transcript(), b.transcript());
        assert_ne!(ta, tb);
        // The same state (as two clones of one snapshot have), reseeded alike: identical transcripts.
        b.os.proc = a.os.proc.clone();
        reseed(&mut a.os, seed, true);
        reseed(&mut b.os, seed, true);
        let ta = a.transcript();
        assert_eq!(ta, b.transcript());
        // Another seed: other random bytes, the same clocks.
        let mut c = T::new();
        c.os.proc = a.os.proc.clone();
        reseed(&mut a.os, seed, true);
        reseed(&mut c.os, [0x5b; 32], true);
        let (ta2, tc) = (a.transcript(), c.transcript());
        assert_eq!(ta2[..ta2.len() - 48], tc[..tc.len() - 48]);
        assert_ne!(ta2[ta2.len() - 48..], tc[tc.len() - 48..]);
    }

    #[test]
    fn virtual_clocks_start_where_the_guest_left_them() {
        let mut t = T::new();
        // Never read: the fixed epoch and boot offset.
        reseed(&mut t.os, [1; 32], true);
        assert_eq!(t.now(0), REPLAY_EPOCH_NS + CLOCK_QUANTUM_NS);
        assert_eq!(t.now(1), REPLAY_MONOTONIC_NS + 2 * CLOCK_QUANTUM_NS);
        assert_eq!(t.now(2), 3 * CLOCK_QUANTUM_NS, "CPU time: quanta only");
        // A sleep moves the wall clocks by exactly its length, at once, and not CPU time.
        t.write(BUF, &timespec_bytes(3600, 0));
        let start = std::time::Instant::now();
        assert_eq!(t.call(SYS_NANOSLEEP, [BUF, 0, 0, 0, 0, 0]), 0);
        assert!(start.elapsed() < std::time::Duration::from_secs(1));
        assert_eq!(t.now(1), REPLAY_MONOTONIC_NS + 3_600_000_000_000 + 4 * CLOCK_QUANTUM_NS);
        assert_eq!(t.now(3), 5 * CLOCK_QUANTUM_NS);
        // An absolute sleep to a time already passed does not move time; one ahead moves it there.
        let mono = t.now(1);
        t.write(BUF, &timespec_bytes(0, 5));
        assert_eq!(t.call(SYS_CLOCK_NANOSLEEP, [1, 1, BUF, 0, 0, 0]), 0);
        assert_eq!(t.now(1), mono + CLOCK_QUANTUM_NS);
        let target = mono + 10_000_000_000;
        t.write(BUF, &timespec_bytes((target / 1_000_000_000) as i64, (target % 1_000_000_000) as i64));
        assert_eq!(t.call(SYS_CLOCK_NANOSLEEP, [1, 1, BUF, 0, 0, 0]), 0);
        assert_eq!(t.now(1), target + CLOCK_QUANTUM_NS);
        // A second reseed continues from the last values seen: time never goes back.
        let (real, mono) = (t.now(0), t.now(1));
        reseed(&mut t.os, [2; 32], true);
        assert_eq!(t.now(0), real + CLOCK_QUANTUM_NS);
        assert_eq!(t.now(1), mono + 2 * CLOCK_QUANTUM_NS);
        // Replay off: the host's clocks again.
        reseed(&mut t.os, [2; 32], false);
        let host_real = t.now(0);
        assert!(host_real > 1_600_000_000 * 1_000_000_000 && host_real != real + 2 * CLOCK_QUANTUM_NS);
        // And a replay after host reads starts at the last host value.
        reseed(&mut t.os, [3; 32], true);
        assert_eq!(t.now(0), host_real + CLOCK_QUANTUM_NS);
    }

    #[test]
    fn randomness_comes_from_the_crng() {
        let mut t = T::new();
        reseed(&mut t.os, [0; 32], false);
        assert_eq!(t.call(SYS_GETRANDOM, [BUF, 5, 0, 0, 0, 0]), 5);
        assert_eq!(t.call(SYS_GETRANDOM, [BUF + 5, 27, 2, 0, 0, 0]), 27);
        // The seed-zero vector of collimate-crng-v1, whatever the read sizes.
        let want: Vec<u8> = (0..32)
            .map(|i| u8::from_str_radix(&"ccce174ddda08b6788294501ad61d93049490188c5f6f4798052cbfd703a2510"[2 * i..2 * i + 2], 16).unwrap())
            .collect();
        assert_eq!(t.read(BUF, 32), want);
        assert!(!t.os.proc.clocks.replay);
        // An unseeded clone diverges, a seeded one does not.
        let mut other = T::new();
        other.os.proc = t.os.proc.clone();
        diverge(&mut t.os);
        diverge(&mut other.os);
        assert_eq!(t.os.proc.crng, other.os.proc.crng);
        let fresh = T::new();
        let (mut x, mut y) = (T::new(), T::new());
        x.os.proc = fresh.os.proc.clone();
        y.os.proc = fresh.os.proc.clone();
        diverge(&mut x.os);
        diverge(&mut y.os);
        assert_eq!(x.call(SYS_GETRANDOM, [BUF, 32, 0, 0, 0, 0]), 32);
        assert_eq!(y.call(SYS_GETRANDOM, [BUF + 64, 32, 0, 0, 0, 0]), 32);
        assert_ne!(x.read(BUF, 32), y.read(BUF + 64, 32));
        // A guest fork: the child's stream is derived, not shared.
        let mut parent = t.os.proc.clone();
        let mut child = parent.clone();
        child.crng = parent.crng.fork_child();
        let (mut pb, mut cb) = ([0u8; 16], [0u8; 16]);
        random_bytes(&mut parent, &mut pb).unwrap();
        random_bytes(&mut child, &mut cb).unwrap();
        assert_ne!(pb, cb);
    }

    #[test]
    fn proc_state_round_trips_with_crng_and_clocks() {
        let mut t = T::new();
        reseed(&mut t.os, [4; 32], true);
        t.now(0);
        let bytes = postcard::to_allocvec(&t.os.proc).unwrap();
        let back: Proc = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, t.os.proc);
    }
}
