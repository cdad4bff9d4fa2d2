//! A guest process on the systrap platform: its stub (`platform::systrap::Stub`), the guest OS
//! state, and the run loop beside the KVM one (`Machine::run`).
//!
//! The loop runs the stub until its next exit: a trapped syscall goes to [`guestos::dispatch`]
//! with the guest's memory reached through the stub ([`StubSpace`]) and its result goes back in
//! rax; `rdtsc` and `cpuid` are answered here.
//!
//! Signals take the KVM loop's path where it is platform-neutral (`process::signals_after_syscall`
//! after every call: SIGPIPE, timers, the next pending signal; `process::fault_delivery` for a
//! fault): a handler's `rt_sigframe` goes on the guest's stack through `platform::Memory`
//! (`signal::setup_frame`) with the XSAVE area of the stub's host signal frame (`Stub::xsave`),
//! and rt_sigreturn puts it back there (`Stub::set_xsave`). A page fault the guest does not
//! handle ends it by SIGSEGV, as Linux's default action would (SEGV_ACCERR where guestos records
//! a mapping, SEGV_MAPERR elsewhere); SIGILL, SIGFPE, SIGTRAP and SIGBUS likewise.
//!
//! execve loads the new program into the same stub (`exec::commit_host`). A guest fork (fork,
//! vfork, clone without CLONE_VM) is a fork of the stub (`Stub::fork`) and a host fork of this
//! VMM process, as on kvm: the child VMM owns the new stub, the parent releases its copy of that
//! handle, and the parent's wait4/waitid read the child's end through its pidfd
//! (`guestos::signal`'s children, the same machinery as kvm's). The guest's fds 1 and 2 are two
//! memfds every process of the tree appends to ([`Capture`]), read after each run; the first
//! process's end takes its children with it. In a served sandbox the process tree is kvm's
//! ([`proctree`]: the scheduler's slots, the roster and the process table): kill, tgkill and
//! killpg reach any process of the sandbox, setpgid/setsid make groups and sessions,
//! `/proc/<pid>` shows every process of the sandbox and none of the host's, and an orphan is
//! adopted by the first process.
//!
//! Threads (clone with CLONE_THREAD) are M:1 on the process's stub, as on kvm's vCPU: the KVM
//! VMM's scheduler (`vmm::threads`) runs them, reaching the stub through `ThreadCpu`
//! ([`threads`]). A guest that computes without trapping is stopped by a kick
//! (`platform::systrap::preempt`, `Exit::Interrupted`): for a slice's end, a guest timer and the
//! run's deadline ([`preempt`]'s timer), and a signal from another guest process (its carrier's
//! handler), so each reaches it within a slice, and a timed-out run is resumable.
//!
//! Not yet on this platform (each answers as noted): clone's other sharing flags (a process
//! sharing memory without being a thread, ENOSYS); shared futexes across processes, snapshots
//! of more than one process or thread ([`snapshot`]), and replay mode's turns between a
//! sandbox's processes (`sched::gate`: they run in parallel in replay mode too).
//!
//! Two ways to run one: [`Process::spawn`] runs the first process in the caller's own process
//! (tests and benches; a child's guest pid is then its VMM's host pid), and [`serve`] makes a
//! launched VMM process serve it over the controller protocol (the SDK's `platform="systrap"`;
//! guest pids from the serving tree's pid page, as on kvm).

mod load;
mod preempt;
mod proctree;
mod reset;
mod serve;
pub mod snapshot;
mod spawn;
mod threads;
mod warm;

pub(super) use serve::{serve_first, serve_restore};

use std::os::fd::{AsRawFd, BorrowedFd};
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_regs, kvm_sregs};

use crate::error::{Error, Result};
use super::process::{self, AfterSyscall, Entry};
use crate::guestos::signal::{self, Child, Delivery};
use crate::guestos::{self, Errno, GuestOs, EAGAIN, EFAULT, EINVAL, EIO, ENOSYS};
use crate::platform::systrap::{self as st, tsc, Confinement, Exit, Stub};
use crate::platform::{HostSpace, Memory};
use crate::protocol::{RunExit, RunResult, SpawnSpec};

/// The error for what a systrap sandbox cannot do yet (`what`: "snapshot", ...).
pub fn unsupported(what: &str) -> Error {
    Error::InvalidArgument(format!(
        "{what} is not supported on the systrap platform yet; use platform=\"kvm\" for it (docs/platforms.md says what \
         each platform offers)"
    ))
}

/// The guest memory a systrap process may map (what `sysinfo` reports as total): the KVM
/// platform's default guest memory size.
pub const DEFAULT_BUDGET: u64 = 1 << 30;

/// A stub as `guestos` reaches guest memory: [`HostSpace`] over [`Stub`].
pub struct StubSpace<'a> {
    pub stub: &'a mut Stub,
    pub budget: u64,
    /// The last stub failure that was not the guest's doing (the stub is gone, the host refused),
    /// which an errno cannot tell: for the VMM's own error messages.
    pub failure: Option<String>,
}

impl StubSpace<'_> {
    fn errno(&mut self, e: st::Error) -> Errno {
        if !matches!(e, st::Error::Fault { .. } | st::Error::Reserved { .. } | st::Error::Op { .. }) {
            self.failure = Some(e.to_string());
        }
        errno_of(e)
    }
}

/// The errno a guest sees for a stub error.
fn errno_of(e: st::Error) -> Errno {
    match e {
        st::Error::Fault { .. } => EFAULT,
        st::Error::Reserved { .. } => EINVAL,
        st::Error::Op { source, .. } | st::Error::Host { source, .. } => Errno::from_io(&source),
        st::Error::Spawn { .. } | st::Error::Gone { .. } | st::Error::NotParked { .. } => EIO,
    }
}

impl HostSpace for StubSpace<'_> {
    fn read(&self, va: u64, buf: &mut [u8]) -> std::result::Result<(), Errno> {
        self.stub.read(va, buf).map_err(errno_of)
    }

    fn write(&mut self, va: u64, data: &[u8]) -> std::result::Result<(), Errno> {
        self.stub.write(va, data).map_err(|e| self.errno(e))
    }

    fn map(&mut self, va: u64, len: u64, prot: u32, flags: u32, file: Option<(i32, u64)>) -> std::result::Result<(), Errno> {
        let (fd, offset) = match file {
            // SAFETY: the descriptor is the caller's and open for the length of this call
            // (`HostSpace::map`'s contract); the stub only sends it.
            Some((fd, off)) => (Some(unsafe { BorrowedFd::borrow_raw(fd) }), off),
            None => (None, 0),
        };
        self.stub.map(va, len, prot as i32, flags as i32, fd, offset).map_err(|e| self.errno(e))
    }

    fn unmap(&mut self, va: u64, len: u64) -> std::result::Result<(), Errno> {
        self.stub.unmap(va, len).map_err(|e| self.errno(e))
    }

    fn protect(&mut self, va: u64, len: u64, prot: u32) -> std::result::Result<(), Errno> {
        self.stub.protect(va, len, prot as i32).map_err(|e| self.errno(e))
    }

    fn budget(&self) -> u64 {
        self.budget
    }

    fn reserved(&self) -> (u64, u64) {
        Stub::reserved_range()
    }
}

/// One guest process on systrap: its stub, its OS state and its registers between runs.
pub struct Process {
    stub: Stub,
    os: GuestOs,
    regs: kvm_regs,
    fs_base: u64,
    budget: u64,
    exited: Option<RunExit>,
    /// fds 1 and 2 as memfds read after each run; `None` when they are the controller's pipes
    /// (a served sandbox, [`serve`]).
    capture: Option<Capture>,
    /// The guest's pid in its sandbox (its first process: 1).
    guest_pid: i32,
    /// Pidfds of the stubs of the guest children this process forked. A child's VMM killed from
    /// here (`end_exec`, the first process's end) cannot end its stub, and a stub that computes
    /// without syscalls never notices that its VMM is gone: it would spin on the host for good.
    /// So they are killed with their VMMs ([`Process::kill_child_stubs`]). In a served sandbox
    /// its reaper does that for every stub of the tree (`platform::systrap::reaper`); this is
    /// what a first process run in the caller's own process has.
    child_stubs: Vec<std::os::fd::OwnedFd>,
    /// The sandboxes forked from this one get a writable root (`Request::WritableRoot`; forks
    /// carry an overlay context with each tmpfs pair, as on kvm: `crate::overlay`).
    writable_root: bool,
    /// The pages its clones copy ahead of their first exec, and what it owes as a clone
    /// ([`warm`]).
    warm: warm::Warm,
    /// The vDSO's data page as last read or written (`guestos::vdso::Seen`).
    vvar: guestos::vdso::Seen,
    traps: Traps,
    /// What a reset returns to ([`reset`]).
    reset: reset::Point,
}

/// How often the stub handed the turn to this VMM since the process began, by cause (what a
/// thread hand-off or a clock read costs, counted rather than timed: `tests/systrap_threads.rs`).
#[derive(Debug, Default, Clone, Copy, PartialEq, Eq)]
pub struct Traps {
    /// Syscalls the guest trapped with (clock reads its vDSO answered are not among them).
    pub syscalls: u64,
    /// Kicks that stopped computing code (`Exit::Interrupted`: a slice's end, a timer, a signal).
    pub interrupts: u64,
    /// Trapped `rdtsc`/`rdtscp` the VMM answered (those the stub answered from the clock page,
    /// `Stub::set_clock_page`, are not among them).
    pub rdtsc: u64,
}

/// What the guest's processes write to fds 1 and 2: two memfds in append mode, shared by every
/// VMM process of the tree (a forked child writes to the same open files), read after each run.
struct Capture {
    files: [std::fs::File; 2],
    read: [u64; 2],
}

impl Capture {
    fn new() -> std::io::Result<(Capture, Vec<std::os::fd::OwnedFd>)> {
        use std::os::fd::{FromRawFd, OwnedFd};
        let make = |name: &std::ffi::CStr| -> std::io::Result<(std::fs::File, OwnedFd)> {
            // SAFETY: memfd_create with a NUL-terminated name; the result is checked.
            let fd = unsafe { libc::memfd_create(name.as_ptr(), libc::MFD_CLOEXEC) };
            if fd < 0 {
                return Err(std::io::Error::last_os_error());
            }
            // SAFETY: a new descriptor that nothing else owns.
            let file = unsafe { std::fs::File::from_raw_fd(fd) };
            // Appending, so that every process of the tree adds to the end whatever order they
            // write in (the VMM reads with pread, which the flag does not affect).
            // SAFETY: fcntl on the descriptor just made; the results are checked.
            let w = unsafe {
                if libc::fcntl(fd, libc::F_SETFL, libc::O_APPEND) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                let w = libc::fcntl(fd, libc::F_DUPFD_CLOEXEC, 0);
                if w < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                std::fs::File::from_raw_fd(w)
            };
            Ok((file, OwnedFd::from(w)))
        };
        let (out, out_w) = make(c"collimate-stdout")?;
        let (err, err_w) = make(c"collimate-stderr")?;
        Ok((Capture { files: [out, err], read: [0, 0] }, vec![out_w, err_w]))
    }

    /// What was written to fd `i` (0: stdout, 1: stderr) since the last take.
    fn take(&mut self, i: usize) -> Vec<u8> {
        use std::os::unix::fs::FileExt;
        let len = self.files[i].metadata().map(|m| m.len()).unwrap_or(0);
        let mut v = vec![0u8; len.saturating_sub(self.read[i]) as usize];
        let n = self.files[i].read_at(&mut v, self.read[i]).unwrap_or(0);
        v.truncate(n);
        self.read[i] += n as u64;
        v
    }
}

/// What a systrap exec traps (docs/replay.md, "The CPU and the time-stamp counter"):
/// - `rdtsc` in a replay exec (`replay`: the guest's clocks are virtual), so that a program that
///   reads the counter directly reads the virtual clock and replays; never outside replay, where
///   the guest reads the host's clocks anyway. `COLLIMATE_TRAP_RDTSC=0` turns it off in replay
///   too (each context switch into or out of a trapping stub rewrites CR4, an exit to the
///   hypervisor on a nested host: benches/systrap.rs).
/// - `cpuid` never: the VMM would answer a trapped `cpuid` with the host CPU's own answer (there
///   is no pinned CPU model on systrap), which is what the guest reads natively, so CPUID faulting
///   only cost every context switch an MSR write. A guest's `cpuid` is the host's (`cpuid: host`).
pub fn exec_traps(replay: bool) -> st::Traps {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let off = *OFF.get_or_init(|| std::env::var_os("COLLIMATE_TRAP_RDTSC").is_some_and(|v| v == "0"));
    st::Traps { rdtsc: replay && !off, cpuid: false }
}

impl Process {
    /// A new confined stub running the program `spec` names from its root filesystem. Its fds 1
    /// and 2 are captured in each run's output (its children's too: see [`Capture`]).
    pub fn spawn(spec: &SpawnSpec, conf: &Confinement) -> Result<Process> {
        let stub = Stub::spawn(conf).map_err(|e| Error::Remote(format!("systrap: {e}")))?;
        Self::with_stub(spec, stub, None, Some(1))
    }

    /// As [`Process::spawn`], in a stub forked from `template` (`platform::systrap::Template`:
    /// no new namespaces or clone of the VMM per process).
    pub fn spawn_from(spec: &SpawnSpec, template: &mut st::Template) -> Result<Process> {
        let stub = template.spawn().map_err(|e| Error::Remote(format!("systrap: {e}")))?;
        Self::with_stub(spec, stub, None, Some(1))
    }

    /// The program `spec` names loaded into `stub`. `stdio`: the guest's fds 1 and 2 (the
    /// controller's pipes); `None`: captured in each run's result ([`Capture`]).
    fn with_stub(spec: &SpawnSpec, mut stub: Stub, stdio: Option<Vec<std::os::fd::OwnedFd>>, cpus: Option<u32>) -> Result<Process> {
        let (capture, stdio) = match stdio {
            Some(fds) => (None, fds),
            None => {
                let (c, fds) = Capture::new().map_err(Error::sys("memfds for the guest's stdout and stderr"))?;
                (Some(c), fds)
            }
        };
        let mut os = super::new_guest_os(spec, cpus, Some(stdio))?;
        let budget = DEFAULT_BUDGET;
        let cannot = |e: Errno, failure: Option<String>| {
            Error::Image(format!(
                "cannot start {}: {}{}",
                String::from_utf8_lossy(&spec.argv[0]),
                std::io::Error::from_raw_os_error(e.0),
                failure.map(|f| format!(" ({f})")).unwrap_or_default()
            ))
        };
        let prepared = guestos::exec::prepare_headers(&os, &spec.argv[0], &spec.argv, &spec.envp).map_err(|e| cannot(e, None))?;
        let mut space = load::Batched::new(&mut stub, budget);
        let img = guestos::exec::commit_host(&mut os, &mut space, prepared, &spec.envp).and_then(|img| space.finish().map(|_| img));
        let img = img.map_err(|e| cannot(e, space.failure()))?;
        let regs = kvm_regs { rip: img.entry, rsp: img.rsp, rflags: 0x202, ..Default::default() };
        // Signals from its children arrive as kvm's do (`signal::host`'s carrier, handled in
        // this whole process: one systrap first process per host process).
        signal::host::install();
        let guest_pid = os.proc.pid;
        Ok(Process { stub, os, regs, fs_base: 0, budget, exited: None, capture, guest_pid, child_stubs: Vec::new(), writable_root: false, warm: warm::Warm::default(), vvar: Default::default(), traps: Traps::default(), reset: Default::default() })
    }

    /// Switch the stub's `rdtsc`/`cpuid` traps to what the guest's mode asks for: after a reseed,
    /// before the exec runs ([`exec_traps`]). The guest processes the exec forks inherit them.
    pub fn sync_traps(&mut self) -> Result<st::Traps> {
        if self.exited.is_some() {
            return Ok(self.stub.traps()); // no stub left to switch; the next exec will fail
        }
        self.stub.set_traps(exec_traps(self.os.proc.clocks.replay)).map_err(|e| Error::Remote(format!("systrap: {e}")))
    }

    /// The commands this process's VMM has handed its stub so far (`Stub::commands`).
    pub fn stub_commands(&self) -> u64 {
        self.stub.commands()
    }

    /// Syscalls of this process that entered through a patched site, and the sites patched
    /// (`platform::systrap::patch`).
    pub fn stub_patched(&self) -> (u64, u64) {
        (self.stub.patched_entries(), self.stub.patched_sites())
    }

    /// Patch syscall sites of this process from now on, or not (`Stub::set_patching`; on unless
    /// `COLLIMATE_SYSTRAP_PATCH=0`); the processes it forks later inherit it.
    pub fn set_patching(&mut self, on: bool) {
        self.stub.set_patching(on);
    }

    /// The stub's rdtsc/cpuid traps now in force.
    pub fn stub_traps(&self) -> st::Traps {
        self.stub.traps()
    }

    /// How the VMM and the stub wait for each other (`platform::systrap::Handoff`; tuning and
    /// benches).
    pub fn set_handoff(&mut self, h: st::Handoff) {
        self.stub.set_handoff(h);
    }

    /// The guest OS state (files, memory map, process facts).
    pub fn os(&self) -> &GuestOs {
        &self.os
    }

    /// Reseed the guest's randomness and, with `replay`, run its clocks on virtual time from now
    /// on (`guestos::random::reseed`; a served sandbox's seeded exec).
    pub fn reseed(&mut self, seed: [u8; 32], replay: bool) {
        guestos::random::reseed(&mut self.os, seed, replay);
    }

    /// The traps served so far ([`Traps`]).
    pub fn traps(&self) -> Traps {
        self.traps
    }

    /// Run the guest until it exits, is killed by a signal, or `timeout` passes.
    pub fn run(&mut self, timeout: Duration) -> Result<RunResult> {
        let start = Instant::now();
        let mut out = guestos::Output::default();
        let exit = match self.exited {
            Some(e) => e,
            None => self.run_loop(&mut out, start + timeout)?,
        };
        super::threads::run_ended();
        let report = super::threads::take_report();
        if matches!(exit, RunExit::Exited { .. } | RunExit::Signaled { .. }) && self.exited.is_none() {
            self.exited = Some(exit);
            super::threads::process_ended(self);
            // The first process takes its children with it, as on kvm.
            signal::kill_children(&mut self.os);
        }
        let (mut stdout, mut stderr) = (out.stdout, out.stderr);
        // The scheduler's deadlock report goes where the guest's stderr goes.
        if !report.is_empty() {
            match self.os.stdio.as_ref() {
                Some([_, err]) if self.capture.is_none() => {
                    // SAFETY: writing a local buffer to the sandbox's stderr pipe; a short write
                    // loses the tail of a diagnostic only.
                    unsafe { libc::write(std::os::fd::AsRawFd::as_raw_fd(err), report.as_ptr().cast(), report.len()) };
                }
                _ => stderr.extend_from_slice(report.as_bytes()),
            }
        }
        if let Some(capture) = &mut self.capture {
            stdout.extend(capture.take(0));
            stderr.extend(capture.take(1));
        }
        Ok(RunResult {
            exit,
            stdout,
            stderr,
            duration: start.elapsed(),
            enosys: out.enosys,
            truncated: false,
            agent: Vec::new(),
            others: 0,
            nondeterministic: false,
        })
    }

    fn run_loop(&mut self, out: &mut guestos::Output, deadline: Instant) -> Result<RunExit> {
        // Kicks stop this stub while its guest runs; the timer does at the deadline (`preempt`).
        let _running = preempt::Running::enter(&self.stub, deadline.saturating_duration_since(Instant::now()))?;
        // A signal that waits (end_exec's interrupt, one that came between runs) is delivered
        // before the guest goes on, not at its next syscall.
        if let Some(exit) = self.interrupted() {
            return Ok(exit);
        }
        let mut short_armed = false;
        // The time read after each exit is the next run's (below); none is left from a loop before.
        self.stub.set_now(None);
        loop {
            // The process's threads take turns on the stub (`vmm::threads`). (Where they all wait
            // here, the next run's time is the one read before the wait: placement's windows
            // are then one run late, nothing else reads it.)
            if let Some(exit) = super::threads::schedule(self, deadline)? {
                return Ok(exit);
            }
            // A guest timer due while the guest computes: the timer kicks the stub when it is.
            let timer_budget = guestos::timer::host_budget(&self.os);
            if timer_budget.is_some() || short_armed {
                let left = deadline.saturating_duration_since(tsc::now());
                short_armed = timer_budget.is_some_and(|b| b < left);
                preempt::arm(timer_budget.map_or(left, |b| b.min(left)))?;
            }
            // The vDSO's clock state, as on kvm (`guestos::vdso`): out before the guest runs,
            // its reads back in before anything else looks at time.
            let budget = super::threads::vdso_budget(self).min(guestos::timer::vdso_budget(&self.os));
            let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
            guestos::vdso::publish_host(&self.os, &mut space, &mut self.vvar, budget);
            // A trapped rdtsc answered from that page in the stub (the blob's `answer_rdtsc`).
            self.stub.set_clock_page(if local_rdtsc() { guestos::vdso::clock_page(&self.os) } else { None });
            let entered = timer_budget.map(|_| tsc::now());
            let exit = self.stub.run(&mut self.regs, &mut self.fs_base).map_err(|e| Error::Remote(format!("systrap: {e}")))?;
            let copied = self.stub.clock_words();
            let space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
            let reads = guestos::vdso::fold_host(&mut self.os, &space, &mut self.vvar, copied);
            if reads > 0 {
                // What those reads' syscalls would have done to the schedulers.
                super::threads::count_events(reads);
                guestos::sched::begin_syscall(guestos::vdso::VDSO_VA, guestos::clock::SYS_CLOCK_GETTIME, [0; 4]);
                guestos::sched::after_syscall();
                crate::trace::vdso_reads(reads);
            }
            if let Some(t) = entered {
                if guestos::timer::charge(&mut self.os, tsc::now().saturating_duration_since(t)) {
                    super::threads::mark_nondeterministic();
                }
            }
            match exit {
                Exit::Interrupted => {
                    self.traps.interrupts += 1;
                    if let Some(exit) = self.interrupted() {
                        return Ok(exit);
                    }
                }
                Exit::Syscall => {
                    self.traps.syscalls += 1;
                    super::threads::count_event();
                    if let Some(exit) = self.syscall(out) {
                        return Ok(exit);
                    }
                }
                Exit::Rdtsc { rdtscp } => {
                    self.traps.rdtsc += 1;
                    crate::trace::mark("rdtsc.vmm");
                    // The guest's clock, not the host's TSC: replays see the same values. As on kvm
                    // (`guestos::clock::tsc_now`): a clock read, so it advances one quantum and two
                    // reads never return the same count (before, two reads with no clock read
                    // between them returned the same value, and 0 outside replay).
                    let ns = guestos::clock::tsc_now(&mut self.os.proc);
                    self.regs.rax = ns & 0xffff_ffff;
                    self.regs.rdx = ns >> 32;
                    if rdtscp {
                        self.regs.rcx = 0;
                    }
                    self.regs.rip += if rdtscp { 3 } else { 2 };
                }
                Exit::Cpuid => {
                    #[allow(unused_unsafe)]
                    // SAFETY: CPUID has no side effects and every leaf is defined (unknown leaves
                    // answer the highest basic leaf's values).
                    let r = unsafe { std::arch::x86_64::__cpuid_count(self.regs.rax as u32, self.regs.rcx as u32) };
                    (self.regs.rax, self.regs.rbx, self.regs.rcx, self.regs.rdx) = (r.eax as u64, r.ebx as u64, r.ecx as u64, r.edx as u64);
                    self.regs.rip += 2;
                }
                Exit::Fault { addr, write, exec } => {
                    super::threads::count_event();
                    // The host only says whether the access was a write or a fetch; whether
                    // something is mapped there is guestos's record (SEGV_ACCERR, else MAPERR).
                    let mapped = self.os.mm.vma_at(addr).is_some();
                    let err = (mapped as u64) | ((write as u64) << 1) | 4 | ((exec as u64) << 4);
                    let code = if mapped { SEGV_ACCERR } else { SEGV_MAPERR };
                    if let Some(exit) = self.fault(libc::SIGSEGV, code, 14, err, addr) {
                        return Ok(exit);
                    }
                }
                Exit::Signal { signo, code, addr } => {
                    let vector = match signo {
                        libc::SIGFPE => 0,
                        libc::SIGTRAP => 3,
                        libc::SIGILL => 6,
                        libc::SIGBUS => 17,
                        libc::SIGSEGV => 13,
                        // Only guest code scribbling on the stub's shared page gets here.
                        _ => return Ok(RunExit::Signaled { signo: libc::SIGSEGV }),
                    };
                    if let Some(exit) = self.fault(signo, code, vector, 0, addr) {
                        return Ok(exit);
                    }
                }
                Exit::Exited { status } => {
                    return Err(Error::Remote(format!("systrap: the stub process ended under the guest (wait status {status:?})")));
                }
            }
            // Not `Instant::now`: in a replay exec this thread traps rdtsc as its stub does
            // (`platform::systrap::tsc`), so a clock read is a syscall: the next run's placement
            // uses this one.
            let now = tsc::now();
            if now >= deadline {
                return Ok(RunExit::Timeout);
            }
            self.stub.set_now(Some(now));
        }
    }

    /// Serve the syscall in the registers, then act on pending signals as Linux does on the way
    /// back to user mode (the KVM loop's `process::signals_after_syscall`); the run's end if it
    /// ends it.
    fn syscall(&mut self, out: &mut guestos::Output) -> Option<RunExit> {
        let entry = Entry::of(&self.regs);
        let nr = self.regs.rax;
        crate::trace::syscall(nr);
        // The call a blocked call's restart continues, as on kvm: its deadline (a sleep's, a
        // poll's timeout in virtual time) is kept across its restarts and dropped when it returns.
        // Without it the first timed wait's deadline stayed for good once threads took turns, and
        // every later `time.sleep` returned at once (a sleep loop waiting for another thread spun).
        let r = &self.regs;
        guestos::sched::begin_syscall(r.rip, nr, [r.rdi, r.rsi, r.rdx, r.r10]);
        let exit = if nr == SYS_EXECVE {
            self.vvar.forget();
            self.execve()
        } else if nr == SYS_RT_SIGRETURN {
            self.sigreturn()
        } else if matches!(nr, SYS_FORK | SYS_VFORK | SYS_CLONE) {
            let r = &self.regs;
            let (flags, exit_signal) = match nr {
                SYS_FORK => (0, libc::SIGCHLD as u64),
                SYS_VFORK => (CLONE_VM | CLONE_VFORK, libc::SIGCHLD as u64),
                _ => (r.rdi & !0xff, r.rdi & 0xff),
            };
            let c = Fork { flags, exit_signal, stack: if nr == SYS_CLONE { r.rsi } else { 0 }, parent_tid: r.rdx, child_tid: r.r10, tls: r.r8 };
            let res = if flags & CLONE_THREAD != 0 {
                let sp = (c.stack != 0).then_some(c.stack);
                let t = super::threads::NewThread { flags, sp, parent_tid: c.parent_tid, child_tid: c.child_tid, tls: c.tls };
                self.clone_thread(t).map(|tid| tid as i32)
            } else {
                self.fork(&c)
            };
            self.regs.rax = match res {
                Ok(pid) => pid as u64,
                Err(e) => (-(e.0 as i64)) as u64,
            };
            None
        } else if nr == process::SYS_SPAWN {
            self.spawn_call();
            None
        } else if intercepted(nr) {
            self.regs.rax = (-(ENOSYS.0 as i64)) as u64;
            *self.os.enosys.entry(nr).or_default() += 1;
            out.enosys += 1;
            None
        } else {
            self.dispatch(out)
        };
        let exit = match process::signals_after_syscall(&mut self.os, &entry, &mut self.regs, exit) {
            AfterSyscall::Resume(exit) => exit,
            AfterSyscall::Deliver(d, exit) => {
                if self.deliver(&d) {
                    exit
                } else {
                    Some(RunExit::Signaled { signo: libc::SIGSEGV })
                }
            }
        };
        if self.regs.rip != entry.rip().wrapping_sub(2) {
            guestos::sched::call_done();
        }
        exit
    }

    fn dispatch(&mut self, out: &mut guestos::Output) -> Option<RunExit> {
        let mut sregs = kvm_sregs::default();
        sregs.fs.base = self.fs_base;
        let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        let mut ctx = guestos::Ctx {
            memory: Memory::Host(&mut space),
            regs: &mut self.regs,
            sregs: &mut sregs,
            out,
            flush_tlb: false,
            stale_frames: Vec::new(),
            stop: None,
            lazy: Vec::new(),
        };
        let exit = guestos::dispatch(&mut self.os, &mut ctx);
        self.fs_base = sregs.fs.base;
        exit
    }

    /// A fault or another synchronous signal of the guest's code: enter its handler, or end the
    /// process by it. `vector` is the x86 exception it stands for (the sigcontext's trapno).
    fn fault(&mut self, sig: i32, code: i32, vector: u8, err: u64, cr2: u64) -> Option<RunExit> {
        match process::fault_delivery(&self.os, sig, code, vector, err, self.regs.rip, cr2) {
            Some(d) if self.deliver(&d) => None,
            Some(_) => Some(RunExit::Signaled { signo: libc::SIGSEGV }),
            None => Some(RunExit::Signaled { signo: sig }),
        }
    }

    /// Enter the handler for `d`: the frame goes on the guest's stack with the XSAVE area the
    /// stub's host frame holds. False: the frame could not be written (the process dies by SIGSEGV).
    fn deliver(&mut self, d: &Delivery) -> bool {
        let Ok(xsave) = self.stub.xsave() else { return false };
        let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        let mut mem = Memory::Host(&mut space);
        signal::setup_frame(&mut self.os, &mut mem, &mut self.regs, &xsave, d).is_ok()
    }

    /// rt_sigreturn: the registers, mask and FPU state from the frame `deliver` wrote. The FPU
    /// state goes back into the stub's host frame, whose software bytes (how the host kernel
    /// restores it) and whose components beyond the frame's x87/SSE/AVX (AVX-512 on such hosts:
    /// they stay as the handler left them) are the host's. A bad frame: SIGSEGV.
    fn sigreturn(&mut self) -> Option<RunExit> {
        const SW: std::ops::Range<usize> = 464..512;
        const BV: std::ops::Range<usize> = 512..520;
        let segv = Some(RunExit::Signaled { signo: libc::SIGSEGV });
        let Ok(mut area) = self.stub.xsave() else { return segv };
        if area.len() < signal::XSTATE_SIZE {
            return segv;
        }
        let sw = area[SW].to_vec();
        let bv_host = u64::from_le_bytes(area[BV].try_into().unwrap_or_default());
        let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        let mem = Memory::Host(&mut space);
        if signal::sigreturn(&mut self.os, &mem, &mut self.regs, &mut area).is_err() {
            return segv;
        }
        area[SW].copy_from_slice(&sw);
        let bv = u64::from_le_bytes(area[BV].try_into().unwrap_or_default()) | (bv_host & !signal::XFEATURES);
        area[BV].copy_from_slice(&bv.to_le_bytes());
        if self.stub.set_xsave(&area).is_err() {
            return segv;
        }
        None
    }
}

impl Process {
    /// execve(path, argv, envp): the new program replaces the old in the same stub. Errors up to
    /// the point of no return go back to the caller; a load that fails after it kills the process
    /// (SIGSEGV), as on Linux.
    fn execve(&mut self) -> Option<RunExit> {
        let (path, argv, envp) = (self.regs.rdi, self.regs.rsi, self.regs.rdx);
        let space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        let args = (|| {
            let path = read_cstr(&space, path, guestos::vfs::PATH_MAX)?;
            let argv = read_strv(&space, argv)?;
            let envp = read_strv(&space, envp)?;
            let prepared = guestos::exec::prepare_headers(&self.os, &path, &argv, &envp)?;
            Ok::<_, Errno>((prepared, envp))
        })();
        let (prepared, envp) = match args {
            Ok(v) => v,
            Err(e) => {
                self.regs.rax = (-(e.0 as i64)) as u64;
                return None;
            }
        };
        let mut space = load::Batched::new(&mut self.stub, self.budget);
        let loaded = guestos::exec::commit_host(&mut self.os, &mut space, prepared, &envp).and_then(|img| space.finish().map(|_| img));
        match loaded {
            Ok(img) => {
                self.regs = crate::arch::x86_64::regs::initial_regs(img.entry, img.rsp);
                self.fs_base = 0;
                process::on_exec_state(&mut self.os);
                let fd = VFORK_FD.swap(-1, std::sync::atomic::Ordering::SeqCst);
                if fd >= 0 {
                    // SAFETY: our end of the vfork pipe: the parent goes on.
                    unsafe { libc::close(fd) };
                }
                None
            }
            Err(_) => Some(RunExit::Signaled { signo: libc::SIGSEGV }),
        }
    }
}

/// fork, vfork or clone of a new process (clone's arguments as x86-64 passes them).
struct Fork {
    flags: u64,
    exit_signal: u64,
    stack: u64,
    parent_tid: u64,
    child_tid: u64,
    tls: u64,
}

impl Process {
    /// A guest fork: the stub is forked (the host's copy-on-write of the guest's memory), then
    /// this VMM process is (a raw clone with exit signal 0, as on kvm: `process::fork`); the child
    /// VMM owns the new stub and runs the child's guest to its end, then ends as it did, so the
    /// parent's wait4/waitid (`guestos::signal`, through the child's pidfd) reads its status.
    /// A vfork copies too; its parent waits until the child has exec'd or ended. Threads
    /// (CLONE_VM without CLONE_VFORK) and clone's other sharing flags: ENOSYS for now.
    fn fork(&mut self, c: &Fork) -> std::result::Result<i32, Errno> {
        self.fork_with(c, None)
    }

    /// [`Process::fork`] with the child's stub given (`stub`: a spawn call's spare, `spawn.rs`)
    /// instead of forked from this one.
    fn fork_with(&mut self, c: &Fork, stub: Option<Stub>) -> std::result::Result<i32, Errno> {
        let vm = c.flags & CLONE_VM != 0;
        if c.flags & !FORK_FLAGS != 0 || (vm && c.flags & CLONE_VFORK == 0) || c.exit_signal > 64 {
            *self.os.enosys.entry(SYS_CLONE).or_default() += 1;
            return Err(ENOSYS);
        }
        // The child's guest pid: the sandbox's own numbering (the serving tree's pid page, as on
        // kvm), or its VMM's host pid where there is no such tree (a first process run in the
        // caller's process: tests and benches).
        crate::trace::mark_n("fork.enter", c.flags);
        let guest_pid = signal::host::alloc_pid();
        // Counted and given its slot in the tree (`proctree`: kill, groups, /proc/<pid>).
        let forking = match guest_pid {
            Some(pid) => Some((pid, proctree::before_fork(&self.os, pid)?)),
            None => None,
        };
        let failed = |e: Errno| {
            if let Some((pid, _)) = &forking {
                proctree::fork_failed(*pid);
            }
            e
        };
        let child_stub = match stub {
            Some(s) => s,
            None => self.stub.fork().map_err(|_| failed(EAGAIN))?,
        };
        crate::trace::mark("fork.stub");
        // A vfork parent waits for the child's exec or end: the end of this pipe.
        let mut vfork = [-1; 2];
        // SAFETY: pipe2 fills two descriptors; checked.
        if c.flags & CLONE_VFORK != 0 && unsafe { libc::pipe2(vfork.as_mut_ptr(), libc::O_CLOEXEC) } < 0 {
            return Err(failed(Errno::last()));
        }
        // SAFETY: getpid cannot fail.
        let parent_host = unsafe { libc::getpid() };
        // Signals between guest processes travel as kvm's do (`signal::host`): take in what
        // arrived for us and fork with the carrier blocked, so the child starts with nothing
        // pending and what is sent to it early waits on the host until it runs.
        signal::host::install();
        signal::host::block(true);
        signal::gather(&mut self.os);
        // SAFETY: a raw clone with exit signal 0 and no other flags: a fork whose child the host
        // never reaps on its own. The child goes on in Rust on this thread only, never returns
        // from `child_main` and never unwinds into the caller's frames.
        let rc = unsafe { libc::syscall(libc::SYS_clone, 0 as libc::c_ulong, 0usize, 0usize, 0usize, 0usize) };
        if rc == 0 {
            crate::trace::mark("child.start");
            signal::host::reset_child();
            signal::host::block(false);
            // SAFETY: closing our copy of the read end.
            unsafe { libc::close(vfork[0]) };
            let stub = child_stub;
            if let Some((pid, f)) = &forking {
                proctree::child_started(*pid, parent_host, f);
            }
            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| self.child_main(stub, c, guest_pid, parent_host, vfork[1])));
            let exit = r.unwrap_or(RunExit::Signaled { signo: libc::SIGKILL });
            // SAFETY: our stub is parked or gone; kill it before this process ends (its handle
            // is not dropped: `end_like` exits at once).
            unsafe { libc::kill(self.stub.pid(), libc::SIGKILL) };
            // The parent's wait returns before this process's copy of the VMM's memory is freed
            // (`vmm::teardown`, as a kvm child's memory and VM are).
            super::teardown::arm_memory();
            process::end_like(exit);
        }
        let e = Errno::last();
        signal::host::block(false);
        if rc >= 0 {
            self.note_child_stub(child_stub.pid());
        }
        if rc < 0 {
            drop(child_stub);
            for fd in vfork.into_iter().filter(|&fd| fd >= 0) {
                // SAFETY: our pipe's descriptors.
                unsafe { libc::close(fd) };
            }
            return Err(failed(e));
        }
        child_stub.release();
        crate::trace::mark("fork.parent");
        let host_pid = rc as i32;
        let pid = guest_pid.unwrap_or(host_pid);
        if vfork[1] >= 0 {
            // SAFETY: closing our write end, then reading to EOF (the child's exec or end).
            unsafe {
                libc::close(vfork[1]);
                let mut b = 0u8;
                while libc::read(vfork[0], (&raw mut b).cast(), 1) < 0 && Errno::last().0 == libc::EINTR {}
                libc::close(vfork[0]);
            }
        }
        let pidfd = match signal::pidfd_open(host_pid) {
            Ok(fd) => fd,
            Err(e) => {
                // SAFETY: the child is ours and not reaped, so the pid is still its; reap it.
                unsafe {
                    libc::kill(host_pid, libc::SIGKILL);
                    libc::waitpid(host_pid, std::ptr::null_mut(), libc::__WALL);
                }
                return Err(failed(e));
            }
        };
        if c.flags & CLONE_PARENT_SETTID != 0 {
            let _ = self.stub.write(c.parent_tid, &pid.to_le_bytes());
        }
        self.os.sig.children.push(Child { pid, pidfd: Some(pidfd), notified: false, exit_signal: c.exit_signal as i32 });
        // Count the fork in the CRNG, in step with the child's derivation of its own stream.
        let _ = self.os.proc.crng.fork_child();
        Ok(pid)
    }

    /// Remember a forked child's stub (see `child_stubs`), dropping those that have ended.
    fn note_child_stub(&mut self, pid: i32) {
        self.child_stubs.retain(|fd| {
            let mut p = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: one valid pollfd; a pidfd polls readable once its process has ended.
            unsafe { libc::poll(&mut p, 1, 0) == 0 }
        });
        if let Ok(fd) = signal::pidfd_open(pid) {
            self.child_stubs.push(fd);
        }
    }

    /// SIGKILL the stubs of the guest children this process forked (with their VMMs, which
    /// cannot do it once killed themselves).
    pub(super) fn kill_child_stubs(&mut self) {
        for fd in self.child_stubs.drain(..) {
            // SAFETY: pidfd_send_signal on our pidfd; a stub that has ended makes it fail (ESRCH).
            unsafe { libc::syscall(libc::SYS_pidfd_send_signal, fd.as_raw_fd(), libc::SIGKILL, 0usize, 0u32) };
        }
    }

    /// The child VMM of a guest fork: take the new stub, become the child process, run it to its
    /// end. `guest_pid`: its pid in the sandbox (`None`: its host pid, outside a serving tree).
    fn child_main(&mut self, stub: Stub, c: &Fork, guest_pid: Option<i32>, parent_host: i32, vfork: i32) -> RunExit {
        std::mem::replace(&mut self.stub, stub).release();
        self.child_stubs.clear(); // our copies of the siblings' stubs: not ours to kill
        spawn::forget_spare(); // the parent's
        // Before the stub runs guest code: the tree's reaper kills it if this process dies
        // (`platform::systrap::reaper`). A child that cannot be registered ends here.
        if let Err(e) = st::reaper::register(&self.stub) {
            eprintln!("collimate: systrap guest process: {e}");
            return RunExit::Signaled { signo: libc::SIGKILL };
        }
        crate::trace::mark("child.registered");
        let inherited = VFORK_FD.swap(vfork, std::sync::atomic::Ordering::SeqCst);
        if inherited >= 0 {
            // SAFETY: the pipe our parent VMM held as a vfork child itself: not ours to hold.
            unsafe { libc::close(inherited) };
        }
        if guest_pid.is_none() {
            // Outside a sandbox's tree: the child VMM ends with the thread that made it (in a
            // tree, `proctree::child_started` set the parent-death signal that lets the first
            // process adopt it instead).
            // SAFETY: a plain prctl.
            unsafe { libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL as libc::c_ulong, 0, 0, 0) };
        }
        // SAFETY: getpid cannot fail.
        let me = guest_pid.unwrap_or_else(|| unsafe { libc::getpid() });
        self.guest_pid = me;
        // The agent's channel belongs to the sandbox's first process (as on kvm).
        drop(super::process::detach_agent(&mut self.os));
        if self.exited.is_some() {
            return RunExit::Signaled { signo: libc::SIGKILL };
        }
        let os = &mut self.os;
        os.sig.children.clear(); // our copies of the siblings' pidfds
        os.sig.pending = 0;
        os.sig.saved_mask = None;
        os.sig.parent = signal::pidfd_open(parent_host).ok();
        os.sig.parent_host = parent_host;
        os.proc.ppid = os.proc.pid;
        os.proc.pid = me;
        os.proc.started_ns = guestos::clock::mono_peek(&os.proc);
        os.proc.sleep = None;
        os.proc.crng = os.proc.crng.fork_child();
        os.proc.timers.on_fork();
        os.proc.clear_child_tid = if c.flags & CLONE_CHILD_CLEARTID != 0 { c.child_tid } else { 0 };
        // The other threads live on in the parent (and stay counted there).
        super::threads::only_current(self, false);
        self.regs.rax = 0;
        if c.stack != 0 {
            self.regs.rsp = c.stack;
        }
        if c.flags & CLONE_SETTLS != 0 {
            self.fs_base = c.tls;
        }
        if c.flags & CLONE_CHILD_SETTID != 0 {
            let _ = self.stub.write(c.child_tid, &me.to_le_bytes());
        }
        if guest_pid.is_some() {
            let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
            proctree::publish(&self.os, &Memory::Host(&mut space));
        }
        if let Some(exit) = spawn::exec_pending(self) {
            return exit;
        }
        if guest_pid.is_some() {
            // Again after a spawn call's program load: /proc shows the new program's cmdline.
            let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
            proctree::publish(&self.os, &Memory::Host(&mut space));
        }
        let mut out = guestos::Output::default();
        match self.run_loop(&mut out, Instant::now() + Duration::from_secs(86_400 * 365)) {
            Ok(exit) => {
                // In a sandbox's tree its children live on, adopted by the first process (as on
                // kvm and Linux); outside one, nothing would adopt them: they and their stubs end.
                if guest_pid.is_none() {
                    signal::kill_children(&mut self.os);
                    self.kill_child_stubs();
                }
                exit
            }
            Err(e) => {
                eprintln!("collimate: systrap guest process {me}: {e}");
                RunExit::Signaled { signo: libc::SIGKILL }
            }
        }
    }
}

/// In a vfork child's VMM: the write end of the pipe its parent waits on (closed at its exec).
static VFORK_FD: std::sync::atomic::AtomicI32 = std::sync::atomic::AtomicI32::new(-1);

const SYS_RT_SIGRETURN: u64 = 15;
const SYS_CLONE: u64 = 56;
const SYS_FORK: u64 = 57;
const SYS_VFORK: u64 = 58;
const CLONE_VM: u64 = 0x100;
const CLONE_FS: u64 = 0x200;
const CLONE_VFORK: u64 = 0x4000;
const CLONE_THREAD: u64 = 0x1_0000;
const CLONE_SETTLS: u64 = 0x8_0000;
const CLONE_PARENT_SETTID: u64 = 0x10_0000;
const CLONE_CHILD_CLEARTID: u64 = 0x20_0000;
const CLONE_CHILD_SETTID: u64 = 0x100_0000;
/// What a process fork may ask for here: a new process sharing nothing but what fork shares.
const FORK_FLAGS: u64 = CLONE_VM | CLONE_FS | CLONE_VFORK | CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_CLEARTID | CLONE_CHILD_SETTID;
const SYS_EXECVE: u64 = 59;
const SEGV_MAPERR: i32 = 1;
const SEGV_ACCERR: i32 = 2;
/// Linux's limits on exec arguments: one string, and all of them together.
const MAX_ARG_STRLEN: usize = 32 * 4096;
const MAX_ARG_TOTAL: usize = 2 << 20;
const E2BIG: Errno = Errno(7);

/// A NUL-terminated string of guest memory, at most `max` bytes.
fn read_cstr(h: &dyn HostSpace, va: u64, max: usize) -> std::result::Result<Vec<u8>, Errno> {
    let mut out = Vec::new();
    let mut p = va;
    loop {
        let mut buf = vec![0u8; (4096 - (p & 4095)) as usize];
        h.read(p, &mut buf)?;
        if let Some(i) = buf.iter().position(|&b| b == 0) {
            out.extend_from_slice(&buf[..i]);
            return Ok(out);
        }
        out.extend_from_slice(&buf);
        if out.len() > max {
            return Err(E2BIG);
        }
        p += buf.len() as u64;
    }
}

/// A NULL-terminated array of strings in guest memory (argv, envp); NULL itself is empty.
fn read_strv(h: &dyn HostSpace, va: u64) -> std::result::Result<Vec<Vec<u8>>, Errno> {
    let mut v = Vec::new();
    let mut total = 0;
    if va == 0 {
        return Ok(v);
    }
    for i in 0.. {
        let mut b = [0u8; 8];
        h.read(va.checked_add(8 * i).ok_or(EFAULT)?, &mut b)?;
        let p = u64::from_le_bytes(b);
        if p == 0 {
            break;
        }
        let s = read_cstr(h, p, MAX_ARG_STRLEN)?;
        total += s.len() + 1 + 8;
        if total > MAX_ARG_TOTAL {
            return Err(E2BIG);
        }
        v.push(s);
    }
    Ok(v)
}

/// The calls the KVM VMM serves itself (fork, clone, execve, rt_sigreturn, spawn), not offered
/// on systrap yet.
fn intercepted(nr: u64) -> bool {
    process::intercepts(nr)
}

/// Whether the stub answers a replay exec's trapped `rdtsc` itself (`Stub::set_clock_page`):
/// `COLLIMATE_SYSTRAP_RDTSC_LOCAL=0` (read once per process) sends each to the VMM instead, to
/// compare.
fn local_rdtsc() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_SYSTRAP_RDTSC_LOCAL").is_none_or(|v| v != "0"))
}
