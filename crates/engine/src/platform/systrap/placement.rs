//! Where a sandbox's two halves run: the VMM thread that serves a stub and the stub itself, kept
//! on one host CPU while that pays, spread over two while a spin answers the hand-off, and moved
//! off a CPU that something else keeps busy.
//!
//! # Why
//! Every trapped syscall hands the turn from the stub to the VMM thread and back. When each side
//! sleeps while the other works, a hand-off wakes a sleeping task; Linux puts it on an idle CPU
//! if there is one, its previous CPU first. On an idle host the other CPU is halted, and on a
//! nested host (kvm_pvm here) waking a halted vCPU costs tens of microseconds: a Python-driven
//! two-process futex pair costs 41-45 us a round trip on this 2-core host idle, 7.5-11 us under
//! load, where the wake-up finds the CPU it runs on busy and queues there. So the idle host was
//! the slow case: a project's test suite 4.1x native idle against 1.26-1.85x under load, and the
//! whole process tree pinned to one CPU (`taskset -c 0`) made it 1.57x (docs/systrap.md, "An
//! idle host, and one CPU for both sides"). On one CPU a hand-off is a same-CPU switch (a
//! `sched_yield` lets the other side run; 5-6 us here), never a cross-CPU wake.
//!
//! But a pair pinned to a CPU that another task keeps busy waits behind that task's slice at
//! every hand-off: the same suite ran 29x native pinned behind a busy loop. And where the two
//! sides run at once on two CPUs and the guest calls again within the VMM's short spin (a tight
//! syscall loop), the spin answers the hand-off in about 3 us with no switch at all, better than
//! a same-CPU switch.
//!
//! # The rule
//! Decided per stub by its serving thread, in windows of [`WINDOW`] ([`FIRST_WINDOW`] after a pin
//! and after the sandbox was idle for [`IDLE_GAP`]), checked at each run: one clock read (a
//! `clock_gettime` syscall, 0.3 us, while the thread traps `rdtsc`; the vDSO otherwise), no
//! state of the whole host:
//! - **Pinned** (the start): the serving thread and the stub are bound to one CPU, the serving
//!   thread's own when it pins, and hand off by yield-then-sleep ([`super::Handoff::yield_then_sleep`],
//!   no spin: a spin on a shared CPU only delays the other side). At the end of each pinned window
//!   the two tasks' run-queue waits are read (`/proc/<tid>/schedstat`, their own accounting),
//!   each less what the other task ran meanwhile (on a CPU of their own each waits while the
//!   other runs): if that waited [`STARVED_WAIT_NS`] or more on average each time they were put
//!   on the CPU and more than an eighth of the window, the CPU is busy with other work: go
//!   **Unpinned**. (Until 2026-12-07 the waits were summed as they were, and a guest computing
//!   100 us or more between its syscalls looked starved by its own serving thread's wait: the
//!   pair was unpinned and every hand-off became a wake of the other, idle CPU.)
//! - **Unpinned** for a back-off of windows (1, doubling up to [`MAX_BACKOFF`] while each return
//!   finds the CPU busy again), letting the scheduler place both where there is room; then pin
//!   again on the serving thread's CPU then.
//! - **Probe**: every so often (after [`FIRST_PROBE`] pinned windows, doubling to
//!   [`MAX_PROBE`] while probes fail) the pair runs unpinned with the stub's configured hand-off
//!   (the adaptive spin) for [`PROBE_RUNS`] runs or a window, whichever ends first. If the VMM's
//!   spin answered at least [`SPREAD_ANSWERED`] of its waits (at least [`MIN_SPINS`] of them; a
//!   wait whose spin was skipped counts as not answered), the pair stays **Spread** (unpinned,
//!   spinning) while that holds, judged each window; otherwise it pins again.
//!
//! Pinning and unpinning are `sched_setaffinity` calls (the stub is a separate process; the
//! serving thread is the calling thread), to one CPU of the set the process had when [`prepare`]
//! ran (never outside what the host or the user allowed: `taskset`, cgroup cpusets). A thread
//! that stops serving a stub (the stub dropped) gets that set back.
//!
//! `COLLIMATE_SYSTRAP_PLACEMENT=0` (read once per process) leaves both to the scheduler, as
//! before: to compare in benches. [`super::Stub::set_placement`] per stub.

use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

use super::memory;

/// How long a decision stands before it is looked at again.
pub const WINDOW: Duration = Duration::from_millis(4);
/// A pair that ran nothing for this long (the sandbox idle between execs) starts a window of
/// [`FIRST_WINDOW`] at its next run: the CPU it was pinned to may have become busy meanwhile, and
/// behind a busy task every hand-off waits a time slice.
pub const IDLE_GAP: Duration = Duration::from_millis(10);
/// The first window after an idle gap, and a new pin's.
pub const FIRST_WINDOW: Duration = Duration::from_millis(1);
/// A pinned pair is on a busy CPU when each time one of its two tasks was put on the CPU it had
/// waited this long on average: longer than a wake-up of another, idle CPU costs here.
pub const STARVED_WAIT_NS: u64 = 50_000;
/// The longest an unpinned back-off lasts, in windows (256 ms).
pub const MAX_BACKOFF: u32 = 64;
/// Pinned windows before the first probe of a spread pair.
pub const FIRST_PROBE: u32 = 4;
/// The longest run of pinned windows between probes (about a second).
pub const MAX_PROBE: u32 = 256;
/// The share of the VMM's spins that must be answered for a pair to stay spread.
pub const SPREAD_ANSWERED: f64 = 0.9;
/// The fewest waits a window must have had to judge a spread pair by.
pub const MIN_SPINS: u32 = 16;
/// A probe ends after this many runs, or its window, whichever comes first: on an idle host
/// each of a failing probe's waits is a wake-up of the other CPU, so it is kept short.
pub const PROBE_RUNS: u32 = 32;
/// More misses than this in a probe and its spin cannot answer [`SPREAD_ANSWERED`] of
/// [`PROBE_RUNS`] waits: it ends there.
pub const PROBE_MISSES: u32 = PROBE_RUNS - (PROBE_RUNS * 9).div_ceil(10);
const _: () = assert!(SPREAD_ANSWERED == 0.9, "PROBE_MISSES counts tenths of SPREAD_ANSWERED");

/// Placement is on unless `COLLIMATE_SYSTRAP_PLACEMENT=0` (read once per process).
pub fn enabled_by_env() -> bool {
    static ON: OnceLock<bool> = OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_SYSTRAP_PLACEMENT").is_none_or(|v| v != "0"))
}

/// The CPUs this process tree may use, taken at the first call (from [`super::prepare`], before
/// any pinning); forks inherit the value. Empty if the host would not say (then nothing is pinned).
pub fn home() -> &'static [usize] {
    static HOME: OnceLock<Vec<usize>> = OnceLock::new();
    HOME.get_or_init(|| {
        // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity writes at most its size.
        let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
        // SAFETY: `set` is a valid cpu_set_t of the size given.
        if unsafe { libc::sched_getaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }
            != 0
        {
            return Vec::new();
        }
        // SAFETY: CPU_ISSET only reads `set`.
        (0..libc::CPU_SETSIZE as usize)
            .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
            .collect()
    })
}

/// Bind task `tid` (0: the calling thread) to `cpus`.
fn set_affinity(tid: i32, cpus: &[usize]) -> bool {
    // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    for &c in cpus {
        // SAFETY: `c` < CPU_SETSIZE (it came from `home`).
        unsafe { libc::CPU_SET(c, &mut set) };
    }
    // SAFETY: `set` is a valid cpu_set_t of the size given.
    unsafe { libc::sched_setaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0 }
}

/// Give task `tid` every CPU of [`home`] back: for work a pinned pair starts that should not
/// queue on the pair's CPU (a guest child VMM's teardown helper, `vmm::teardown`, which frees the
/// child's memory while its parent, on that CPU, goes on).
pub fn unbind(tid: i32) {
    let home = home();
    if home.len() > 1 {
        set_affinity(tid, home);
    }
}

/// The CPU the calling thread runs on now.
fn current_cpu() -> Option<usize> {
    // SAFETY: no preconditions.
    let c = unsafe { libc::sched_getcpu() };
    usize::try_from(c).ok()
}

/// A task's scheduler accounting (`/proc/<pid>/task/<tid>/schedstat`): time on a CPU, time
/// waiting on a run queue, and how many times it was put on a CPU.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Schedstat {
    pub run_ns: u64,
    pub wait_ns: u64,
    pub slices: u64,
}

impl Schedstat {
    /// Parse the file's one line, "run wait slices".
    pub fn parse(text: &str) -> Option<Schedstat> {
        let mut it = text.split_ascii_whitespace().map(|w| w.parse::<u64>().ok());
        Some(Schedstat {
            run_ns: it.next()??,
            wait_ns: it.next()??,
            slices: it.next()??,
        })
    }

    /// Read `path` under the host's `/proc` (opened before any jail: [`memory::proc_dir`]).
    fn read(path: &str) -> Option<Schedstat> {
        let dir = memory::proc_dir().ok()?;
        let c = std::ffi::CString::new(path).ok()?;
        // SAFETY: a valid directory fd and NUL-terminated path.
        let fd = unsafe {
            libc::openat(
                dir.as_raw_fd(),
                c.as_ptr(),
                libc::O_RDONLY | libc::O_CLOEXEC,
            )
        };
        if fd < 0 {
            return None;
        }
        // SAFETY: a fresh fd we own.
        let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
        let mut s = String::new();
        f.read_to_string(&mut s).ok()?;
        Schedstat::parse(&s)
    }

    fn since(self, before: Schedstat) -> Schedstat {
        Schedstat {
            run_ns: self.run_ns.saturating_sub(before.run_ns),
            wait_ns: self.wait_ns.saturating_sub(before.wait_ns),
            slices: self.slices.saturating_sub(before.slices),
        }
    }
}

/// Whether a pinned pair's window (`vmm` and `stub`: each task's accounting over `window`) says
/// its CPU is busy with other work: see the module's rule. A task's run-queue wait counts only
/// past what its partner ran meanwhile: on a CPU of their own each waits while the other runs
/// (the serving thread, yielded, behind a guest that computes 100 us between its syscalls waits
/// 100 us a slice, and that is not other work); the wait the partner's running does not explain
/// is what other tasks took.
pub fn starved(vmm: Schedstat, stub: Schedstat, window: Duration) -> bool {
    let slices = vmm.slices + stub.slices;
    if slices == 0 {
        return false;
    }
    let foreign = vmm.wait_ns.saturating_sub(stub.run_ns) + stub.wait_ns.saturating_sub(vmm.run_ns);
    foreign / slices >= STARVED_WAIT_NS && foreign.saturating_mul(8) > window.as_nanos() as u64
}

/// Where the pair stands ([`Placement`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Mode {
    /// Not decided yet: the first check pins.
    Start,
    /// Both bound to this CPU; `windows` pinned windows so far since the last probe.
    Pinned { cpu: usize, windows: u32 },
    /// Unbound after a busy CPU, for `left` more windows.
    Unpinned { left: u32 },
    /// Unbound for one window, to see whether the spin answers.
    Probe,
    /// Unbound, the spin answering.
    Spread,
}

/// What the serving thread must do after [`Placement::check`].
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Change {
    /// Use yield-then-sleep (the pair now shares a CPU).
    Pinned,
    /// Use the stub's configured hand-off (the pair may run on two CPUs).
    Unpinned,
}

/// One stub's placement, kept by the VMM's [`super::Stub`].
#[derive(Debug, Clone)]
pub struct Placement {
    pub enabled: bool,
    mode: Mode,
    /// Runs since the window began.
    runs: u32,
    /// The first window is unpinned ([`Placement::start_unpinned`]).
    defer: bool,
    window_start: Option<Instant>,
    window_len: Duration,
    last_run: Option<Instant>,
    /// The pair's accounting at the window's start (pinned windows only).
    base: Option<(Schedstat, Schedstat)>,
    /// The serving thread that is bound (to give its CPUs back on drop).
    bound_tid: Option<i32>,
    /// Windows between probes now, and the back-off after a busy CPU.
    probe_every: u32,
    backoff: u32,
    /// The VMM's spins answered since the window's start (fed by the stub).
    pub answered: u32,
    /// Unpins after a busy CPU so far (tests).
    pub starved: u64,
}

impl Default for Placement {
    fn default() -> Placement {
        Placement {
            enabled: enabled_by_env() && home().len() > 1,
            mode: Mode::Start,
            runs: 0,
            defer: false,
            window_start: None,
            window_len: FIRST_WINDOW,
            last_run: None,
            base: None,
            bound_tid: None,
            probe_every: FIRST_PROBE,
            backoff: 1,
            answered: 0,
            starved: 0,
        }
    }
}

fn gettid() -> i32 {
    // SAFETY: no preconditions.
    unsafe { libc::gettid() }
}

impl Placement {
    /// The current mode.
    pub fn mode(&self) -> Mode {
        self.mode
    }

    /// A copy for a forked stub: it starts undecided (the first check binds it where its serving
    /// thread runs then), with no window or accounting of the parent's.
    pub fn for_fork(&self) -> Placement {
        Placement {
            enabled: self.enabled,
            ..Placement::default()
        }
    }

    /// Called by the serving thread before each run of stub `stub_pid`, whose time `now` it read
    /// (the run loop reads the clock once an exit for its deadline: a syscall while the thread
    /// traps `rdtsc`): end the window if it is over and decide. Returns the hand-off change to
    /// make.
    pub fn check_at(&mut self, stub_pid: i32, now: std::time::Instant) -> Option<Change> {
        if !self.enabled {
            return None;
        }
        let idle = self
            .last_run
            .is_some_and(|t| now.saturating_duration_since(t) >= IDLE_GAP);
        self.last_run = Some(now);
        if self.mode == Mode::Start {
            return self.pin(stub_pid, now);
        }
        if idle && matches!(self.mode, Mode::Pinned { .. }) {
            // A new exec on a pinned pair: look again soon.
            self.begin_window(stub_pid, now);
            self.window_len = FIRST_WINDOW;
            return None;
        }
        self.runs += 1;
        let start = self.window_start.unwrap_or(now);
        let window = now.saturating_duration_since(start);
        // A probe ends after its runs, or as soon as its misses rule out the share it needs
        // (each miss there is a wake of the other CPU: tens of us on an idle nested host).
        let missed = (self.runs - 1).saturating_sub(self.answered);
        let probed = self.mode == Mode::Probe && (self.runs > PROBE_RUNS || missed > PROBE_MISSES);
        if window < self.window_len && !probed {
            return None;
        }
        let runs = self.runs - 1; // the waits counted so far: this run's is to come
        let answered = self.answered;
        match self.mode {
            Mode::Start => unreachable!("handled above"),
            Mode::Pinned { cpu, windows } => {
                let busy = match (self.base, Self::pair(stub_pid)) {
                    (Some(before), Some(after)) => starved(after.0.since(before.0), after.1.since(before.1), window),
                    _ => false,
                };
                if busy {
                    self.starved += 1;
                    self.mode = Mode::Unpinned { left: self.backoff };
                    self.backoff = (self.backoff * 2).min(MAX_BACKOFF);
                    return self.unpin(stub_pid, now);
                }
                self.backoff = 1;
                if windows + 1 >= self.probe_every {
                    self.mode = Mode::Probe;
                    return self.unpin(stub_pid, now);
                }
                self.mode = Mode::Pinned {
                    cpu,
                    windows: windows + 1,
                };
                self.begin_window(stub_pid, now);
                None
            }
            Mode::Unpinned { left } => {
                if left > 1 {
                    self.mode = Mode::Unpinned { left: left - 1 };
                    self.begin_window(stub_pid, now);
                    return None;
                }
                self.pin(stub_pid, now)
            }
            Mode::Probe | Mode::Spread => {
                // Every wait counts: one whose spin was skipped (backed off) was not answered.
                if runs >= MIN_SPINS && f64::from(answered) >= SPREAD_ANSWERED * f64::from(runs) {
                    self.mode = Mode::Spread;
                    self.probe_every = FIRST_PROBE;
                    self.begin_window(stub_pid, now);
                    return None;
                }
                if self.mode == Mode::Probe {
                    self.probe_every = (self.probe_every * 2).min(MAX_PROBE);
                }
                self.pin(stub_pid, now)
            }
        }
    }

    /// The serving thread's and the stub's accounting.
    fn pair(stub_pid: i32) -> Option<(Schedstat, Schedstat)> {
        let me = Schedstat::read("thread-self/schedstat")?;
        let stub = Schedstat::read(&format!("{stub_pid}/schedstat"))?;
        Some((me, stub))
    }

    fn begin_window(&mut self, stub_pid: i32, now: Instant) {
        self.window_start = Some(now);
        self.runs = 0;
        self.answered = 0;
        self.window_len = WINDOW;
        self.base = if matches!(self.mode, Mode::Pinned { .. }) {
            Self::pair(stub_pid)
        } else {
            None
        };
    }

    /// Start unpinned for a first window ([`FIRST_WINDOW`]), then pin where the scheduler put
    /// the serving thread: for a fork group's children, which run at once (pinned at their first
    /// run they would all be on their parent's CPU; most of a group's children end within it).
    pub fn start_unpinned(&mut self) {
        self.defer = true;
    }

    fn pin(&mut self, stub_pid: i32, now: Instant) -> Option<Change> {
        let home = home();
        if self.mode == Mode::Start && std::mem::take(&mut self.defer) {
            self.mode = Mode::Unpinned { left: 1 };
            self.begin_window(stub_pid, now);
            self.window_len = FIRST_WINDOW;
            return Some(Change::Unpinned);
        }
        let Some(cpu) = current_cpu().filter(|c| home.contains(c)) else {
            self.enabled = false;
            return Some(Change::Unpinned);
        };
        if !set_affinity(stub_pid, &[cpu]) || !set_affinity(0, &[cpu]) {
            // Not allowed here (a host that forbids it): leave both to the scheduler for good.
            set_affinity(stub_pid, home);
            set_affinity(0, home);
            self.enabled = false;
            return Some(Change::Unpinned);
        }
        self.bound_tid = Some(gettid());
        crate::trace::mark_n("placement.pin", cpu as u64);
        self.mode = Mode::Pinned { cpu, windows: 0 };
        self.begin_window(stub_pid, now);
        self.window_len = FIRST_WINDOW;
        Some(Change::Pinned)
    }

    fn unpin(&mut self, stub_pid: i32, now: Instant) -> Option<Change> {
        crate::trace::mark(if self.mode == Mode::Probe { "placement.probe" } else { "placement.unpin" });
        let home = home();
        set_affinity(stub_pid, home);
        set_affinity(0, home);
        self.bound_tid = None;
        self.begin_window(stub_pid, now);
        Some(Change::Unpinned)
    }

    /// Turn placement on or off for this stub; off gives both tasks their CPUs back.
    pub fn set_enabled(&mut self, stub_pid: i32, on: bool) -> Option<Change> {
        let was = self.enabled;
        self.enabled = on && home().len() > 1;
        self.mode = Mode::Start;
        self.window_start = None;
        self.last_run = None;
        if was && !self.enabled {
            let home = home();
            set_affinity(stub_pid, home);
            if self.bound_tid == Some(gettid()) {
                set_affinity(0, home);
            }
            self.bound_tid = None;
            return Some(Change::Unpinned);
        }
        None
    }

    /// The stub is going away: give the serving thread its CPUs back if this bound it.
    pub fn release(&mut self) {
        if self.bound_tid.take().is_some_and(|t| t == gettid()) {
            set_affinity(0, home());
        }
    }
}

#[cfg(test)]
mod tests {
    use super::super::tsc;
    use super::*;

    #[test]
    fn parses_schedstat() {
        assert_eq!(
            Schedstat::parse("123 456 7\n"),
            Some(Schedstat {
                run_ns: 123,
                wait_ns: 456,
                slices: 7
            })
        );
        assert_eq!(Schedstat::parse("12 x 3"), None);
        assert_eq!(Schedstat::parse(""), None);
    }

    #[test]
    fn a_busy_cpu_is_one_where_each_slice_waited_long() {
        let w = WINDOW;
        let st = |run_ns, wait_ns, slices| Schedstat { run_ns, wait_ns, slices };
        // Alone on a CPU, a syscall loop: many short waits (same-CPU switches).
        assert!(!starved(st(1_900_000, 200_000, 400), st(1_900_000, 200_000, 400), w));
        // Alone on a CPU, a guest computing 100 us between syscalls: the serving thread waits
        // 100 us a slice behind its own stub, which is not other work (the rule that summed the
        // two tasks' waits unpinned this pair: 4.0 ms over 72 slices).
        assert!(!starved(st(400_000, 3_600_000, 36), st(3_600_000, 400_000, 36), w));
        // Behind a busy loop: a few long waits that neither task's running explains.
        assert!(starved(st(200_000, 2_800_000, 3), st(1_000_000, 2_500_000, 3), w));
        // One long wait in a window of nothing else: not enough of the window.
        assert!(!starved(st(50_000, 60_000, 1), st(50_000, 0, 1), w));
        assert!(!starved(Schedstat::default(), Schedstat::default(), w));
    }

    /// A thread of its own standing in for a stub (any task of ours will do): its tid, and what
    /// ends it.
    fn stand_in() -> (i32, impl FnOnce()) {
        let (tx, rx) = std::sync::mpsc::channel::<i32>();
        let (done_tx, done_rx) = std::sync::mpsc::channel::<()>();
        let h = std::thread::spawn(move || {
            tx.send(gettid()).unwrap();
            done_rx.recv().unwrap();
        });
        let tid = rx.recv().unwrap();
        (tid, move || {
            done_tx.send(()).unwrap();
            h.join().unwrap();
        })
    }

    /// A probe whose spin misses ends as soon as its misses rule out the share a spread pair
    /// needs ([`PROBE_MISSES`] + 1 of them), not after all [`PROBE_RUNS`] runs (each miss a wake
    /// of the other CPU); one whose spin answers runs its course. Fails with the probe ended only
    /// by its run count.
    #[test]
    fn a_probe_whose_spin_misses_ends_early() {
        if home().len() < 2 || !enabled_by_env() {
            return; // nothing to decide on one CPU
        }
        let (other, end) = stand_in();
        let t0 = Instant::now();
        let probing = |answer: bool| {
            let mut p = Placement { mode: Mode::Probe, ..Placement::default() };
            p.begin_window(other, t0);
            // Runs 1 us apart: the window never ends on time.
            let mut checks = 0;
            loop {
                checks += 1;
                if answer && checks > 1 {
                    p.answered += 1;
                }
                if p.check_at(other, t0 + Duration::from_micros(checks)).is_some() || checks > 2 * PROBE_RUNS as u64 {
                    p.release();
                    return (checks, p.mode());
                }
            }
        };
        let (checks, mode) = probing(false);
        assert_eq!(checks, u64::from(PROBE_MISSES) + 2, "ended in {mode:?}");
        assert!(matches!(mode, Mode::Pinned { .. }), "{mode:?}");
        let (checks, mode) = probing(true);
        assert_eq!(mode, Mode::Spread);
        assert!(checks > u64::from(PROBE_RUNS), "{checks}");
        end();
    }

    #[test]
    fn the_first_check_pins_to_the_running_cpu_and_release_gives_it_back() {
        if home().len() < 2 || !enabled_by_env() {
            return; // nothing to decide on one CPU
        }
        let (other, end) = stand_in();
        let mut p = Placement::default();
        assert_eq!(p.check_at(other, tsc::now()), Some(Change::Pinned));
        let Mode::Pinned { cpu, .. } = p.mode() else {
            panic!("{:?}", p.mode())
        };
        let allowed = |tid: i32| {
            // SAFETY: as in `home`.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: as in `home`.
            assert_eq!(
                unsafe {
                    libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set)
                },
                0
            );
            // SAFETY: CPU_ISSET only reads `set`.
            (0..libc::CPU_SETSIZE as usize)
                .filter(|&c| unsafe { libc::CPU_ISSET(c, &set) })
                .collect::<Vec<_>>()
        };
        assert_eq!(allowed(0), vec![cpu]);
        assert_eq!(allowed(other), vec![cpu]);
        p.release();
        assert_eq!(allowed(0), home().to_vec());
        assert_eq!(p.set_enabled(other, false), Some(Change::Unpinned));
        assert_eq!(allowed(other), home().to_vec());
        end();
    }
}
