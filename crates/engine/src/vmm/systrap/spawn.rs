//! The engine's spawn call (`SYS_SPAWN`, docs/spawn.md) on the systrap platform.
//!
//! On kvm, `vmm::spawn::direct` serves it: the caller's vCPU becomes a vfork child, the child's
//! resets are applied in the VMM, and the program starts in a process of its own. Here a guest
//! fork is already a fork of the stub and of this VMM process ([`Process::fork`]), so the spawn
//! is that vfork with the child's pre-exec code done in its VMM instead of in the guest: the
//! parent forks (`CLONE_VM | CLONE_VFORK`, so it resumes once the child has exec'd), and the
//! child VMM, before its first run, applies the resets and loads the program into its stub
//! ([`exec_pending`]), exactly as its execve would. What the caller saves is the child's own
//! code between the vfork and the execve (CPython's `_posixsubprocess`: about 68 syscalls, each a
//! trap and a hand-off between the stub and the VMM) and the agent's fallback to `subprocess`.
//!
//! The child is the same process a vfork and an execve make (pid, CRNG derivation, pidfd, its
//! place among the parent's children), so wait and signals see no difference; the errors the
//! execve would fail with before its point of no return (a missing program, E2BIG, ENOEXEC) come
//! back from the call itself, before any fork, as on kvm.
//!
//! **Empty stubs made ahead.** The child's stub holds none of the parent's memory (its exec
//! replaces it): the guest's stub forked with every guest mapping advised out of the fork
//! (`MADV_DONTFORK`, then back): three commands and the stub's host fork on the call's path. Such
//! a stub has nothing in it but the platform's reserved range, and nothing of the guest's state
//! (the fd table, cwd, ids, signals, clocks, CRNG, pid and the reaper's registration are the
//! VMM's, and the child VMM is still forked at the call), so one made earlier serves as well. From
//! a process's second call on, the VMM keeps one such stub as a factory (`Spares`): each call's
//! stub is a fork of it (one command, no advice), and a served sandbox forks the next one ahead,
//! after each reply, while the controller has nothing for it ([`make_spare`]): the call then takes
//! it without a command. At the call the stub gets the guest stub's `rdtsc` mode and hand-off
//! (`Stub::set_traps`: no command when unchanged). The stubs are the making VMM's and serve its
//! current stub only: a forked VMM lets go of the copies it inherited ([`forget_spare`]), a
//! clone's fork kills them first ([`drop_spare`]), and those made from another stub (a reset that
//! replaced it) are dropped at the call. `COLLIMATE_SYSTRAP_SPARE` (see `SpareMode`) compares.

use std::cell::{Cell, RefCell};
use std::sync::Mutex;

use std::os::fd::{AsRawFd, RawFd};

use super::{read_cstr, read_strv, Fork, Process, StubSpace, CLONE_VFORK, CLONE_VM, VFORK_FD};
use crate::platform::systrap::Stub;
use crate::guestos::{self, exec, signal, Errno, EINVAL, ENOSYS};
use crate::protocol::RunExit;
use crate::vmm::process::{SPAWN_CLOSE_FDS, SPAWN_RESTORE_SIGNALS};

/// What the child VMM of a spawn does before its first run: set by the caller just before its
/// fork, taken by the child (and cleared in the parent after the fork). A VMM process runs one
/// guest process on one thread, so at most one is pending.
static PENDING: Mutex<Option<Pending>> = Mutex::new(None);

struct Pending {
    prepared: exec::Prepared,
    envp: Vec<Vec<u8>>,
    close_fds: bool,
    restore_signals: bool,
    /// The child's stub was forked without the guest's memory (nothing of the old image to unmap).
    empty: bool,
}

impl Process {
    /// `SYS_SPAWN(path, argv, envp, flags)`: the child's pid in rax, or the errno the call fails
    /// with (ENOSYS where it is not served: a multi-threaded caller, `COLLIMATE_SYSTRAP_SPAWN=0`;
    /// the caller falls back to vfork and execve).
    pub(super) fn spawn_call(&mut self) {
        let r = self.spawn_inner();
        self.regs.rax = match r {
            Ok(pid) => pid as u64,
            Err(e) => (-(e.0 as i64)) as u64,
        };
    }

    fn spawn_inner(&mut self) -> std::result::Result<i32, Errno> {
        let (path, argv, envp, flags) = (self.regs.rdi, self.regs.rsi, self.regs.rdx, self.regs.r10);
        if flags & !(SPAWN_CLOSE_FDS | SPAWN_RESTORE_SIGNALS) != 0 {
            return Err(EINVAL);
        }
        if off() || self.os.threads.multi() {
            // As on kvm: the caller's other threads would run in the child's identity.
            return Err(ENOSYS);
        }
        let space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        let path = read_cstr(&space, path, guestos::vfs::PATH_MAX)?;
        let argv = read_strv(&space, argv)?;
        let envp = read_strv(&space, envp)?;
        crate::trace::mark("spawn.enter");
        let prepared = exec::prepare_headers(&self.os, &path, &argv, &envp)?;
        let mut pending = Pending { prepared, envp, close_fds: flags & SPAWN_CLOSE_FDS != 0, restore_signals: flags & SPAWN_RESTORE_SIGNALS != 0, empty: false };
        let c = Fork { flags: CLONE_VM | CLONE_VFORK, exit_signal: signal::SIGCHLD as u64, stack: 0, parent_tid: 0, child_tid: 0, tls: 0 };
        // The child's stub gets none of the guest's memory (its exec replaces it all): the host
        // fork copies no page table of it, and leaves the caller's pages writable, where a
        // copying fork write-protects them and the caller's next writes fault one page at a time
        // (about 160 faults per spawn of the Python agent, counted with perf). As kvm's spawn
        // leaves guest memory out of its fork (`GuestMemory::exclude_from_fork`).
        // An empty stub made earlier (`Spares`) is such a stub already.
        if let Some(stub) = self.empty_stub() {
            pending.empty = true;
            *lock() = Some(pending);
            let pid = self.fork_with(&c, Some(stub));
            lock().take();
            crate::trace::mark("spawn.resumed");
            return pid;
        }
        let runs = guest_runs(&self.os);
        let excluded = exclude(&mut self.stub, &runs, true);
        if !excluded {
            exclude(&mut self.stub, &runs, false);
        }
        pending.empty = excluded;
        *lock() = Some(pending);
        let pid = self.fork(&c);
        if excluded && !exclude(&mut self.stub, &runs, false) {
            // The guest's memory would be left out of its later forks, whose children would fault.
            eprintln!("collimate: systrap: the guest's memory could not be put back into its forks after a spawn");
        }
        crate::trace::mark("spawn.resumed");
        // Ours is the parent's copy: the child took its own.
        lock().take();
        pid
    }
}

/// The empty stubs of this VMM's spawn calls (see the module docs): made by the VMM `owner` (a
/// host pid) from its guest's stub `parent_stub` (a host pid), and valid while both hold.
struct Spares {
    owner: i32,
    parent_stub: i32,
    /// Forked from the guest's stub with all of the guest's memory left out; it never runs a
    /// guest: each call's stub is its fork.
    factory: Stub,
    /// A fork of `factory` made ahead for the next call ([`make_spare`]).
    ready: Option<Stub>,
}

thread_local! {
    // A VMM serves its guest on one thread.
    static SPARES: RefCell<Option<Spares>> = const { RefCell::new(None) };
    /// The host pid of the VMM whose guest made a spawn call (a forked VMM inherits another's).
    static USED: Cell<i32> = const { Cell::new(0) };
}

fn host_pid() -> i32 {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() }
}

/// What `COLLIMATE_SYSTRAP_SPARE` asks for, to compare: `0` no factory (every call forks the
/// guest's stub with its memory advised out and back, 3 commands); `factory` each call forks the
/// factory (1 command); unset (`idle`) a fork of it made ahead after each reply of a served
/// sandbox. (Made right after each call instead, while the child runs, it was on the call's path
/// on 2 busy cores: 0.78 ms at load 7.)
#[derive(Clone, Copy, PartialEq, Eq)]
enum SpareMode {
    Off,
    Factory,
    Idle,
}

fn spare_mode() -> SpareMode {
    static MODE: std::sync::OnceLock<SpareMode> = std::sync::OnceLock::new();
    *MODE.get_or_init(|| match std::env::var("COLLIMATE_SYSTRAP_SPARE").as_deref() {
        Ok("0") => SpareMode::Off,
        Ok("factory") => SpareMode::Factory,
        _ => SpareMode::Idle,
    })
}

impl Process {
    /// An empty stub for this call, parked, with the guest stub's traps and hand-off: the one
    /// made ahead, or a fork of the factory (made now on the process's second call: a process
    /// that spawns once, a fork group's child running one command, pays nothing for it). None:
    /// the call forks the guest's stub itself.
    fn empty_stub(&mut self) -> Option<Stub> {
        let me = host_pid();
        let used = USED.with(|u| u.replace(me)) == me;
        if spare_mode() == SpareMode::Off || !used {
            return None;
        }
        let mut spares = SPARES.with(|c| c.borrow_mut().take());
        if let Some(sp) = spares.take_if(|sp| sp.owner != me) {
            release(sp); // inherited: another VMM's
        }
        // Made from another stub (a reset replaced it), or gone: dropped (killed).
        drop(spares.take_if(|sp| sp.parent_stub != self.stub.pid() || !alive(&sp.factory)));
        let mut sp = match spares {
            Some(sp) => sp,
            None => self.make_factory()?,
        };
        let want = self.stub.traps();
        let ready = sp.ready.take().filter(alive).and_then(|mut r| (r.await_parked().is_ok() && r.set_traps(want).is_ok()).then_some(r));
        let stub = match ready {
            Some(r) => {
                crate::trace::mark("spawn.spare");
                Some(r)
            }
            None => {
                let f = &mut sp.factory;
                let forked = f.set_traps(want).ok().and_then(|_| f.fork().ok());
                crate::trace::mark("spawn.factory");
                forked
            }
        };
        SPARES.with(|c| *c.borrow_mut() = Some(sp));
        let mut stub = stub?;
        stub.set_handoff(self.stub.handoff().clone());
        Some(stub)
    }

    /// The factory: the guest's stub forked with the guest's memory advised out of the fork.
    fn make_factory(&mut self) -> Option<Spares> {
        let runs = guest_runs(&self.os);
        if !exclude(&mut self.stub, &runs, true) {
            exclude(&mut self.stub, &runs, false);
            return None;
        }
        let factory = self.stub.fork();
        if !exclude(&mut self.stub, &runs, false) {
            eprintln!("collimate: systrap: the guest's memory could not be put back into its forks after a spawn");
        }
        crate::trace::mark("spawn.factory.made");
        Some(Spares { owner: host_pid(), parent_stub: self.stub.pid(), factory: factory.ok()?, ready: None })
    }
}

/// Fork the next call's stub from the factory ahead of the call, if there is a factory and no
/// such stub is ready.
fn make_ready(p: &Process) {
    let me = host_pid();
    let want = p.stub.traps();
    SPARES.with(|c| {
        let mut g = c.borrow_mut();
        let Some(sp) = g.as_mut().filter(|sp| sp.owner == me && sp.parent_stub == p.stub.pid() && sp.ready.is_none()) else { return };
        // Not waiting for it to park: the call does, if it has not by then.
        if sp.factory.set_traps(want).is_ok() {
            sp.ready = sp.factory.fork_unparked().ok();
            crate::trace::mark("spare.made");
        }
    });
}

/// In a served sandbox's top VMM, after a reply: fork the next spawn call's stub ahead (see the
/// module docs), unless a request already waits on `chan` (the controller's channel: it goes
/// first) or spares are made elsewhere (`COLLIMATE_SYSTRAP_SPARE`).
pub(super) fn make_spare(p: &mut Process, chan: RawFd) {
    if spare_mode() != SpareMode::Idle || p.exited.is_some() {
        return;
    }
    let mut pfd = libc::pollfd { fd: chan, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no timeout.
    if unsafe { libc::poll(&mut pfd, 1, 0) } != 0 {
        return;
    }
    make_ready(p);
}

fn release(sp: Spares) {
    sp.factory.release();
    if let Some(r) = sp.ready {
        r.release();
    }
}

/// In a VMM forked from the one that made the spares: let go of the inherited handles (the
/// stubs are that VMM's: not killed here).
pub(super) fn forget_spare() {
    let me = host_pid();
    if let Some(sp) = SPARES.with(|c| c.borrow_mut().take_if(|sp| sp.owner != me)) {
        release(sp);
    }
}

/// Kill this VMM's spares (before a host fork that would hand copies of them to a clone).
pub(super) fn drop_spare() {
    let me = host_pid();
    drop(SPARES.with(|c| c.borrow_mut().take_if(|sp| sp.owner == me)));
}

fn alive(stub: &Stub) -> bool {
    let mut pfd = libc::pollfd { fd: stub.pidfd().as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no timeout; a pidfd polls readable once its process has ended.
    unsafe { libc::poll(&mut pfd, 1, 0) == 0 }
}

/// The guest's mappings as runs of adjacent ones.
fn guest_runs(os: &guestos::GuestOs) -> Vec<(u64, u64)> {
    let mut runs: Vec<(u64, u64)> = Vec::new();
    for (&start, v) in os.mm.vmas.iter() {
        match runs.last_mut() {
            Some(last) if last.1 == start => last.1 = v.end,
            _ => runs.push((start, v.end)),
        }
    }
    runs
}

/// Leave `runs` out of the stub's next fork (`out`), or put them back in; false if the host refused.
/// One round trip to the stub for all of them (`Stub::advise_runs`; one per run with
/// `COLLIMATE_SYSTRAP_BATCH=0`, to compare).
fn exclude(stub: &mut Stub, runs: &[(u64, u64)], out: bool) -> bool {
    let advice = if out { libc::MADV_DONTFORK } else { libc::MADV_DOFORK };
    if super::load::off() {
        return runs.iter().all(|&(start, end)| stub.advise(start, end - start, advice).is_ok());
    }
    let ranges: Vec<(u64, u64)> = runs.iter().map(|&(start, end)| (start, end - start)).collect();
    stub.advise_runs(&ranges, advice).is_ok_and(|n| n == ranges.len())
}

/// Whether `COLLIMATE_SYSTRAP_SPAWN=0` asks for the call to be refused (ENOSYS: the agent falls
/// back to subprocess), to compare.
fn off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var_os("COLLIMATE_SYSTRAP_SPAWN").is_some_and(|v| v == "0"))
}

fn lock() -> std::sync::MutexGuard<'static, Option<Pending>> {
    PENDING.lock().unwrap_or_else(|e| e.into_inner())
}

/// In the child VMM of a spawn, before its first run: the resets and the execve. `Some`: the
/// process ends so (its program could not be loaded past the point of no return: SIGSEGV, as an
/// execve's failure there ends a Linux process). `None`: not a spawn's child, or loaded.
pub(super) fn exec_pending(p: &mut Process) -> Option<RunExit> {
    let Pending { prepared, envp, close_fds, restore_signals, empty } = lock().take()?;
    crate::trace::mark("child.pending");
    let os = &mut p.os;
    if close_fds {
        let extra: Vec<i32> = os.files.open_fds().filter(|&fd| fd > 2).collect();
        for fd in extra {
            let _ = os.files.close(fd);
        }
    }
    if restore_signals {
        for sig in [signal::SIGPIPE, signal::SIGXFSZ] {
            if let Some(a) = os.proc.sigactions.get_mut(sig as usize - 1) {
                *a = guestos::signal_state::SigAction::default();
            }
        }
    }
    // The execve's changes to the process first (its close-on-exec fds go, as on kvm's
    // `load_fresh`): then the parent may go on while the program loads, since the call already
    // checked everything that can fail before the point of no return.
    crate::vmm::process::on_exec_state(&mut p.os);
    let fd = VFORK_FD.swap(-1, std::sync::atomic::Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: our end of the vfork pipe: the parent goes on.
        unsafe { libc::close(fd) };
    }
    if empty {
        p.os.mm = guestos::mm::Mm::default();
    }
    let mut space = super::load::Batched::new(&mut p.stub, p.budget);
    match exec::commit_host(&mut p.os, &mut space, prepared, &envp).and_then(|img| space.finish().map(|_| img)) {
        Ok(img) => {
            p.regs = crate::arch::x86_64::regs::initial_regs(img.entry, img.rsp);
            p.fs_base = 0;
            crate::trace::mark("exec.loaded");
            None
        }
        Err(_) => Some(RunExit::Signaled { signo: libc::SIGSEGV }),
    }
}
