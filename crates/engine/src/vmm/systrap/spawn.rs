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

use std::sync::Mutex;

use super::{read_cstr, read_strv, Fork, Process, StubSpace, CLONE_VFORK, CLONE_VM, VFORK_FD};
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
        let prepared = exec::prepare(&self.os, &path, &argv, &envp)?;
        let mut pending = Pending { prepared, envp, close_fds: flags & SPAWN_CLOSE_FDS != 0, restore_signals: flags & SPAWN_RESTORE_SIGNALS != 0, empty: false };
        let c = Fork { flags: CLONE_VM | CLONE_VFORK, exit_signal: signal::SIGCHLD as u64, stack: 0, parent_tid: 0, child_tid: 0, tls: 0 };
        // The child's stub gets none of the guest's memory (its exec replaces it all): the host
        // fork copies no page table of it, and leaves the caller's pages writable, where a
        // copying fork write-protects them and the caller's next writes fault one page at a time
        // (about 160 faults per spawn of the Python agent, counted with perf). As kvm's spawn
        // leaves guest memory out of its fork (`GuestMemory::exclude_from_fork`).
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
fn exclude(stub: &mut crate::platform::systrap::Stub, runs: &[(u64, u64)], out: bool) -> bool {
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
