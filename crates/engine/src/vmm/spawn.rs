//! Spawning a program without copying the calling VMM: vfork children run on their parent's
//! vCPU until they exec or exit, and the program they exec starts in fresh memory.
//!
//! # Why
//! A guest fork is a host fork of the VMM (see `process`). For a big parent (the Python agent
//! running `subprocess.run`) that costs in both processes: the host fork write-protects every
//! page of the parent's guest memory, so the parent's next run takes a copy-on-write break and a
//! shadow fault for each page it writes; the child makes a KVM VM over a copy it throws away at
//! execve a few syscalls later, where the exec unmaps the parent's whole image, zeroes reused
//! frames for the new stack, and the child's exit tears the big mapping down before its parent
//! sees it end. Measured on this host (docs/spawn.md): most of an `exec(command="true")`.
//!
//! # vfork on the parent's vCPU
//! A vfork (or clone with CLONE_VM | CLONE_VFORK: glibc's posix_spawn, CPython's
//! `_posixsubprocess`) suspends the parent until the child execs or exits, and the child runs in
//! the parent's memory. So the VMM needs no second process for it: it saves the parent's
//! registers, FPU state and per-process OS state (identity, fd table, signal state), installs the
//! child's copies, and goes on running the guest as the child, with the child's pid, on the same
//! vCPU and the same memory (what the child writes, its parent sees, as on Linux). This is a
//! context swap, not a scheduler: exactly one of the two runs. What the host sends this process
//! meanwhile is the suspended parent's and is held until it resumes (`signal::host::hold`).
//!
//! The child's run ends in one of three ways, and each ends with a host process that stands for
//! the child, so wait, SIGCHLD, the process count and the replay scheduler see what they see for
//! a forked child (`Child` with a pidfd, a slot in `sched`):
//! - **execve**: this process forks a host child with the guest memory left out of the fork
//!   (`GuestMemory::exclude_from_fork`: no page table copied, nothing write-protected here), and
//!   that child loads the program into fresh memory with a new VM (`Machine::replace_image`);
//!   the parent resumes with the child's pid. The host fork copies only the VMM's own heap.
//! - **exit or a fatal signal** before any exec: the same fork, whose child ends at once by
//!   that exit code or signal (a zombie with the right status for the parent's wait).
//! - **anything this cannot serve in place** (the child forks, or the sandbox is snapshotted
//!   meanwhile): the child becomes a real process by a copying fork, as every child was before
//!   ([`materialize`]), and the parent resumes.
//!
//! A run that ends while the child runs (its run budget, a timeout) leaves this process as it is:
//! the next run goes on with the child, a reset discards it with the rest of the world
//! ([`abandon`]), a snapshot first makes it a real process ([`settle`]). The agent's channel
//! stays reachable for the controller meanwhile (the child's descriptors of it read /dev/null).
//!
//! # The engine's spawn call
//! A vfork child's own code before its execve still runs in the guest, one VM exit per syscall:
//! CPython's `_posixsubprocess` (and glibc's posix_spawn) reset every signal's disposition one
//! by one, about 68 syscalls and 3.3 ms here before the program starts. `SYS_SPAWN` (not Linux,
//! 0x4000_0001: path, argv, envp, flags) does what that code does for the common case (keep fds
//! 0-2, SIGPIPE and SIGXFSZ back to default; handlers are reset by the exec anyway) inside the
//! VMM, and then what a vfork child's execve does ([`direct`]): one exit for the whole spawn.
//! The child is the same as a vfork child's (pid, CRNG derivation, roster slot, pidfd), so wait,
//! signals and replays see no difference. The agent uses it for `exec(command=...)` and falls
//! back to `subprocess` on ENOSYS (a multi-threaded caller, `COLLIMATE_VFORK=copy`).
//!
//! # Limits
//! Until it execs or exits, the child has no slot of its own in the sandbox's process roster:
//! another process's kill of its pid finds none (ESRCH), and /proc lists it after its exec.
//! Guest memory is one mapping here; memory shared through other host mappings follows the
//! fork's ordinary rules.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::sync::Arc;

use kvm_bindings::{kvm_regs, kvm_sregs, kvm_xsave};

use super::process::{self, CloneArgs};
use super::Machine;
use crate::arch::x86_64::regs;
use crate::error::{Error, Result};
use crate::guestos::exec;
use crate::guestos::files::{Files, OpenFile};
use crate::guestos::process::Proc;
use crate::guestos::signal::{self, host, Child, SigState};
use crate::guestos::{Errno, EAGAIN, ENOSYS};
use crate::protocol::RunExit;

/// The suspended parent of a vfork child this process is running.
pub(super) struct Vfork {
    /// The child's guest pid.
    pid: i32,
    /// The signal its end raises in the parent (SIGCHLD).
    exit_signal: i32,
    /// The reset generation the child belongs to (see `signal::host`).
    generation: u32,
    /// CLONE_CHILD_CLEARTID: where its exit writes 0 (in the shared memory).
    clear_tid: u64,
    parent: Saved,
}

/// What the parent resumes with.
struct Saved {
    regs: kvm_regs,
    sregs: kvm_sregs,
    xsave: kvm_xsave,
    proc: Proc,
    files: Files,
    sig: SigState,
    agent: Option<Arc<OpenFile>>,
}

/// Whether this process is running a vfork child.
pub(super) fn active(m: &Machine) -> bool {
    m.vfork.is_some()
}

/// Whether `COLLIMATE_VFORK=copy` asks for the old copying vfork (to compare).
fn copying() -> bool {
    static COPY: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *COPY.get_or_init(|| std::env::var_os("COLLIMATE_VFORK").is_some_and(|v| v == "copy"))
}

/// Whether a clone with these flags is served here (a vfork, not nested in another, from a
/// process with one thread: the thread scheduler would run the parent's other threads while the
/// child's identity is installed).
pub(super) fn serves(m: &Machine, c: &CloneArgs) -> bool {
    c.is_vfork() && !active(m) && !copying() && !m.os.as_ref().is_some_and(|os| os.threads.multi())
}

/// vfork / clone(CLONE_VM | CLONE_VFORK): become the child. `r` and `sregs` are what the guest
/// resumes with (the child: rax = 0, its stack, its TLS).
pub(super) fn begin(m: &mut Machine, r: &mut kvm_regs, sregs: &mut kvm_sregs, c: &CloneArgs) -> std::result::Result<(), Errno> {
    crate::trace::mark_n("vfork.enter", c.flags);
    let Some(os) = m.os.as_ref() else { return Err(ENOSYS) };
    if host::stale() {
        return Err(EAGAIN);
    }
    let nproc = os.proc.rlimits.get(6).map_or(u64::MAX, |l| l.cur);
    let xsave = m.vcpu.get_xsave().map_err(|_| EAGAIN)?;
    if !host::add_process(nproc.min(process::MAX_PROCESSES as u64) as u32) {
        return Err(EAGAIN);
    }
    host::install();
    process::install_reaper();
    // SAFETY: getpid cannot fail (the fallback outside a sandbox tree, which has no counter).
    let pid = host::alloc_pid().unwrap_or_else(|| unsafe { libc::getpid() });
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    let Some(os) = m.os.as_mut() else { return Err(ENOSYS) };
    // Take in what arrived for the parent before the child runs, then hold the rest.
    signal::gather(os);
    host::hold(true);
    let parent_pid = os.proc.pid;
    let mut proc = os.proc.clone();
    proc.pid = pid;
    proc.ppid = parent_pid;
    proc.started_ns = crate::guestos::clock::mono_peek(&proc);
    proc.sleep = None;
    proc.crng = proc.crng.fork_child();
    proc.timers.on_fork();
    proc.clear_child_tid = 0;
    // Counted in the parent's CRNG too, in step with the child's derivation (as a fork does).
    let _ = os.proc.crng.fork_child();
    let files = os.files.clone();
    let sig = SigState { parent: signal::pidfd_open(me).ok(), parent_host: me, ..Default::default() };
    let parent = Saved {
        regs: { let mut p = *r; p.rax = pid as u64; p },
        sregs: *sregs,
        xsave,
        proc: std::mem::replace(&mut os.proc, proc),
        files: std::mem::replace(&mut os.files, files),
        sig: std::mem::replace(&mut os.sig, sig),
        agent: None,
    };
    let mut vf = Box::new(Vfork { pid, exit_signal: c.exit_signal as i32, generation: host::my_generation(), clear_tid: 0, parent });
    // The child's fds that were the agent's channel read /dev/null; the channel itself stays
    // reachable for the controller (a run that ends meanwhile still collects its replies).
    vf.parent.agent = process::detach_agent(os);
    os.agent = vf.parent.agent.clone();
    if c.flags & process::CLONE_CLEAR_SIGHAND != 0 {
        signal::on_exec(os);
    }
    if c.flags & process::CLONE_CHILD_CLEARTID != 0 {
        vf.clear_tid = c.child_tid;
    }
    if c.flags & process::CLONE_PARENT_SETTID != 0 {
        let _ = m.runtime.aspace.write_virt(&mut m.mem, c.parent_tid, &pid.to_le_bytes(), true);
    }
    if c.flags & process::CLONE_CHILD_SETTID != 0 {
        let _ = m.runtime.aspace.write_virt(&mut m.mem, c.child_tid, &pid.to_le_bytes(), true);
    }
    r.rax = 0;
    if let Some(sp) = process::child_sp(c) {
        r.rsp = sp;
    }
    if c.flags & process::CLONE_SETTLS != 0 {
        sregs.fs.base = c.tls;
    }
    m.vfork = Some(vf);
    Ok(())
}

/// Back to the parent: its state replaces the child's (already gone to its own process, or
/// discarded), with `child` recorded among its children. Writes the parent's registers to the
/// vCPU and into `r`/`sregs` (the caller's view of what the guest resumes with).
fn resume_parent(m: &mut Machine, child: Option<Child>, r: &mut kvm_regs, sregs: &mut kvm_sregs) -> Result<()> {
    let Some(vf) = m.vfork.take() else { return Ok(()) };
    let Saved { regs, sregs: psregs, xsave, proc, files, sig, agent } = vf.parent;
    if let Some(os) = m.os.as_mut() {
        let child_mono = os.proc.clocks.mono_now();
        os.proc = proc;
        // The parent was suspended while the child ran: its clock has moved on as much.
        let mono = os.proc.clocks.mono_now();
        if os.proc.clocks.replay && child_mono > mono {
            os.proc.clocks.pass(child_mono - mono);
        }
        os.files = files;
        os.sig = sig;
        os.agent = agent;
        if let Some(c) = child {
            os.sig.children.push(c);
        }
    }
    host::hold(false);
    *r = regs;
    *sregs = psregs;
    m.vcpu.set_regs(r).map_err(Error::kvm("KVM_SET_REGS"))?;
    m.vcpu.set_sregs(sregs).map_err(Error::kvm("KVM_SET_SREGS"))?;
    // SAFETY: a complete kvm_xsave captured from this vCPU.
    unsafe { m.vcpu.set_xsave(&xsave) }.map_err(Error::kvm("KVM_SET_XSAVE"))?;
    crate::trace::mark("vfork.resumed");
    Ok(())
}

/// What a [`direct`] spawn does to the child before its exec (see `process::SYS_SPAWN`).
pub(super) struct Resets {
    /// Close every fd but 0, 1 and 2.
    pub(super) close_fds: bool,
    /// SIGPIPE and SIGXFSZ back to their default disposition (the Python agent ignores both).
    pub(super) restore_signals: bool,
}

/// The engine's spawn call: become a vfork child (`c`), apply `resets`, exec `prepared` in a
/// process of its own; the parent resumes with the child's pid in `r.rax`. An error leaves no
/// child behind and the parent as it was.
pub(super) fn direct(
    m: &mut Machine,
    r: &mut kvm_regs,
    sregs: &mut kvm_sregs,
    c: &CloneArgs,
    resets: Resets,
    prepared: exec::Prepared,
    envp: &[Vec<u8>],
) -> std::result::Result<(), Errno> {
    let (saved_r, saved_s) = (*r, *sregs);
    begin(m, r, sregs, c)?;
    if let Some(os) = m.os.as_mut() {
        if resets.close_fds {
            let extra: Vec<i32> = os.files.open_fds().filter(|&fd| fd > 2).collect();
            for fd in extra {
                let _ = os.files.close(fd);
            }
        }
        if resets.restore_signals {
            for sig in [signal::SIGPIPE, signal::SIGXFSZ] {
                if let Some(a) = os.proc.sigactions.get_mut(sig as usize - 1) {
                    *a = crate::guestos::signal_state::SigAction::default();
                }
            }
        }
    }
    crate::trace::mark("vfork.exec");
    match fork_child(m, Then::Exec(prepared, envp), r, sregs) {
        Ok(()) => Ok(()),
        Err(e) => {
            if active(m) {
                // No process was made: undo the child's count and identity.
                host::process_gone();
                *r = saved_r;
                *sregs = saved_s;
                resume_parent(m, None, r, sregs).map_err(|_| EAGAIN)?;
                *r = saved_r;
                *sregs = saved_s;
            }
            Err(e)
        }
    }
}

/// How the host child of [`fork_child`] goes on.
enum Then<'a> {
    /// Load the program into fresh memory and run it.
    Exec(exec::Prepared, &'a [Vec<u8>]),
    /// End at once, as the child ended.
    End(RunExit),
    /// Go on running the guest where it is (a copying fork), in this vCPU state.
    Copy(Box<crate::vstate::vcpu::VcpuState>),
}

/// Fork the host process that stands for the vfork child and resume the parent. Errors before
/// the fork are the child's (its execve fails with them).
fn fork_child(m: &mut Machine, then: Then, r: &mut kvm_regs, sregs: &mut kvm_sregs) -> std::result::Result<(), Errno> {
    let Some(vf) = m.vfork.as_ref() else { return Err(ENOSYS) };
    let (pid, generation) = (vf.pid, vf.generation);
    let copy = matches!(then, Then::Copy(_));
    // A program spawned again is cached here, before the fork: this process's later spawns, and
    // the processes it forks, load it without copying (see `image_cache`).
    if let Then::Exec(p, _) = &then {
        super::image_cache::ensure(m.mem.size(), p, false);
    }
    // The child tells us once it holds no descriptor but its own (see `child_main`).
    let mut ends = [0; 2];
    // SAFETY: pipe2 fills two descriptors on success; checked.
    if unsafe { libc::pipe2(ends.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Errno::last());
    }
    // SAFETY: two fresh descriptors we own.
    let (ready_r, ready_w) = unsafe { (OwnedFd::from_raw_fd(ends[0]), OwnedFd::from_raw_fd(ends[1])) };
    // The child's slot exists before it can run (and in replay mode this process holds the turn).
    crate::guestos::sched::before_fork(pid);
    host::block(true);
    if !copy && m.mem.exclude_from_fork(true).is_err() {
        host::block(false);
        crate::guestos::sched::killed(pid);
        return Err(EAGAIN);
    }
    // SAFETY: a raw clone with exit signal 0 (a child the host never reaps on its own); this
    // process is single-threaded, so the child may go on in Rust; it never returns from
    // `child_main`.
    let rc = unsafe { libc::syscall(libc::SYS_clone, 0 as libc::c_ulong, 0usize, 0usize, 0usize, 0usize) };
    if rc == 0 {
        drop(ready_r);
        child_main(m, then, pid, generation, ready_w);
    }
    drop(ready_w);
    crate::trace::mark("vfork.cloned");
    if !copy {
        let _ = m.mem.exclude_from_fork(false);
    }
    host::block(false);
    if rc < 0 {
        let e = Errno::last();
        crate::guestos::sched::killed(pid);
        return Err(e);
    }
    let host_pid = rc as i32;
    wait_ready(&ready_r);
    let pidfd = match signal::pidfd_open(host_pid) {
        Ok(fd) => fd,
        Err(e) => {
            // SAFETY: the child is ours and not reaped, so the pid is still its; reap it.
            unsafe {
                libc::kill(host_pid, libc::SIGKILL);
                libc::waitpid(host_pid, std::ptr::null_mut(), libc::__WALL);
            }
            crate::guestos::sched::killed(pid);
            return Err(e);
        }
    };
    let exit_signal = m.vfork.as_ref().map_or(signal::SIGCHLD, |v| v.exit_signal);
    let child = Child { pid, pidfd: Some(pidfd), notified: false, exit_signal };
    resume_parent(m, Some(child), r, sregs).map_err(|_| EAGAIN)
}

/// Block until the child of [`fork_child`] says it is ready (or is gone).
fn wait_ready(ready: &OwnedFd) {
    let mut b = [0u8; 1];
    loop {
        // SAFETY: reading one byte into our buffer from a descriptor we own.
        let n = unsafe { libc::read(ready.as_raw_fd(), b.as_mut_ptr().cast(), 1) };
        if n >= 0 || std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
            return;
        }
    }
}

/// The host child standing for the vfork child. Never returns.
///
/// Before the parent resumes, this process gives up every descriptor it inherited that is not
/// the child's (the parent's fd table, the controller's) and, for an exec, the child's
/// close-on-exec ones, then writes to `ready`: otherwise the parent could find a pipe still open
/// (CPython's exec-error pipe) or closed depending on how fast the host ran this process, and
/// replays would differ.
fn child_main(m: &mut Machine, then: Then, pid: i32, generation: u32, ready: OwnedFd) -> ! {
    crate::trace::mark("child.start");
    // The parent's state is not ours (dropping it closes our copies of its descriptors); what
    // arrived for it stays with it.
    drop(m.vfork.take());
    host::hold(false);
    let _ = host::take();
    // SAFETY: getppid cannot fail.
    let parent = unsafe { libc::getppid() };
    process::enter_child_process(m, pid, parent, generation);
    if let Some(os) = m.os.as_mut() {
        os.agent = None; // the sandbox's first process's, not ours
        match &then {
            Then::Exec(..) => process::on_exec_state(os),
            Then::End(_) => os.files = Files::empty(),
            Then::Copy(_) => {}
        }
    }
    // SAFETY: writing one byte from our buffer; a parent that is gone does not matter.
    unsafe { libc::write(ready.as_raw_fd(), [1u8].as_ptr().cast(), 1) };
    drop(ready);
    match then {
        Then::End(exit) => process::end_like(exit),
        Then::Copy(state) => {
            if let Err(e) = m.rebuild_after_fork(&state) {
                eprintln!("collimate: guest process {pid}: cannot make its VM: {e}");
                process::end_like(RunExit::Signaled { signo: signal::SIGKILL });
            }
            crate::trace::mark("child.vm");
            process::run_child(m)
        }
        Then::Exec(prepared, envp) => {
            // POSIX timers are not inherited: a new one (the parent's handle is not ours to delete).
            match crate::vstate::vcpu::Preempter::new() {
                Ok(p) => std::mem::forget(std::mem::replace(&mut m.preempter, p)),
                Err(_) => process::end_like(RunExit::Signaled { signo: signal::SIGKILL }),
            }
            match load_fresh(m, false, prepared, envp) {
                Ok(()) => process::run_child(m),
                // Past the point of no return: the process dies, as on Linux.
                Err(_) => process::end_like(RunExit::Signaled { signo: signal::SIGSEGV }),
            }
        }
    }
}

/// The execve's changes to the process (handlers, close-on-exec fds, ...) and its program,
/// loaded into fresh memory with a new VM and vCPU.
pub(super) fn load_fresh(m: &mut Machine, old_mapped: bool, prepared: exec::Prepared, envp: &[Vec<u8>]) -> Result<()> {
    let Some(mut os) = m.os.take() else { return Err(Error::Protocol("no guest OS".into())) };
    // A program that execs another (the shell running a single command, `sh -c 'python3 ...'`)
    // reports the pages its run touched too, before its image goes: otherwise a shell whose every
    // run ends in an exec never gets a hint.
    if let Some(t) = m.touched.take() {
        t.report(&m.mem, &m.runtime.aspace);
    }
    process::on_exec_state(&mut os);
    let bytes = prepared.image_bytes();
    let (base, laid, touched) = match super::image_cache::lookup(m.mem.size(), &prepared) {
        Some(h) => (Some((h.file, h.frames, h.aspace)), Some(h.laid), h.touched),
        None => (None, None, None),
    };
    // The pages earlier runs of this image touched, made ready before the VM exists; a run
    // without them reports its own while reports are wanted (see `spawn_prefault`).
    let hint = touched.as_ref().and_then(|t| t.hint());
    m.touched = touched.filter(|t| hint.is_none() && t.wants_report());
    let loaded = m.replace_image(old_mapped, bytes, base, |mem, frames, aspace| {
        let img = exec::commit_laid(&mut os, mem, frames, aspace, prepared, envp, laid)
            .map(|img| (img.entry, img.rsp))
            .map_err(|e| Error::Image(format!("exec: errno {}", e.0)))?;
        if let Some(pages) = &hint {
            super::spawn_prefault::apply(mem, aspace, pages);
        }
        Ok(img)
    });
    m.os = Some(os);
    loaded?;
    crate::trace::mark("exec.loaded");
    Ok(())
}

/// execve of the vfork child, after everything that can fail was checked (`prepared`): its
/// program starts in a process of its own; the parent resumes. Ok(Err(errno)): the call fails
/// in the child (no process could be made).
pub(super) fn exec(m: &mut Machine, r: &mut kvm_regs, sregs: &mut kvm_sregs, prepared: exec::Prepared, envp: &[Vec<u8>]) -> std::result::Result<(), Errno> {
    crate::trace::mark("vfork.exec");
    fork_child(m, Then::Exec(prepared, envp), r, sregs)
}

/// The vfork child ended (exit or fatal signal) before any exec: a host process ends the same
/// way for the parent's wait; the parent resumes.
pub(super) fn ended(m: &mut Machine, exit: RunExit) -> Result<()> {
    crate::trace::mark("vfork.ended");
    if let Some(vf) = m.vfork.as_ref() {
        if vf.clear_tid != 0 {
            let tid = vf.clear_tid;
            let _ = m.runtime.aspace.write_virt(&mut m.mem, tid, &0u32.to_le_bytes(), true);
        }
    }
    m.sync.settle(&mut m.vcpu)?;
    let mut r = m.vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
    let mut sregs = m.vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
    if fork_child(m, Then::End(exit), &mut r, &mut sregs).is_err() {
        // No process for it: the parent sees a child that was killed (as a reset leaves them).
        let pid = m.vfork.as_ref().map_or(0, |v| v.pid);
        host::process_gone();
        let exit_signal = m.vfork.as_ref().map_or(signal::SIGCHLD, |v| v.exit_signal);
        resume_parent(m, Some(Child { pid, pidfd: None, notified: false, exit_signal }), &mut r, &mut sregs)?;
    }
    Ok(())
}

/// Make the vfork child a real process by a copying fork (as every fork is), resuming it with
/// `r`/`sregs` (its registers in ring 3); the parent resumes. For what cannot be served in place.
pub(super) fn materialize(m: &mut Machine, child_regs: kvm_regs, child_sregs: kvm_sregs, r: &mut kvm_regs, sregs: &mut kvm_sregs) -> Result<()> {
    crate::trace::mark("vfork.materialize");
    let mut state = m.capture()?;
    state.regs = child_regs;
    state.sregs = child_sregs;
    state.sregs.cs = regs::user_code_segment();
    state.sregs.ss = regs::user_data_segment();
    if fork_child(m, Then::Copy(Box::new(state)), r, sregs).is_err() {
        let pid = m.vfork.as_ref().map_or(0, |v| v.pid);
        host::process_gone();
        let exit_signal = m.vfork.as_ref().map_or(signal::SIGCHLD, |v| v.exit_signal);
        resume_parent(m, Some(Child { pid, pidfd: None, notified: false, exit_signal }), r, sregs)?;
    }
    Ok(())
}

/// Before something that needs the process as its parent (a snapshot): a vfork child in progress
/// becomes a real process, at the point where it is.
pub(super) fn settle(m: &mut Machine) -> Result<()> {
    if !active(m) {
        return Ok(());
    }
    m.sync.settle(&mut m.vcpu)?;
    let cr = m.vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
    let cs = m.vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
    let (mut r, mut s) = (cr, cs);
    materialize(m, cr, cs, &mut r, &mut s)
}

/// A reset: the vfork child goes with the world it lived in; the parent's state comes back (for
/// the reset to kill its children and replace it).
pub(super) fn abandon(m: &mut Machine) {
    let Some(vf) = m.vfork.take() else { return };
    host::process_gone();
    host::hold(false);
    if let Some(os) = m.os.as_mut() {
        let Saved { proc, files, sig, agent, .. } = vf.parent;
        os.proc = proc;
        os.files = files;
        os.sig = sig;
        os.agent = agent;
    }
}

/// The run loop's view of how a step ended: the vfork child's end (exit, fatal signal, a VM
/// shutdown) resumes the parent instead of ending the run.
pub(super) fn filter_exit(m: &mut Machine, exit: Option<RunExit>) -> Result<Option<RunExit>> {
    if !active(m) {
        return Ok(exit);
    }
    match exit {
        Some(e @ (RunExit::Exited { .. } | RunExit::Signaled { .. })) => {
            ended(m, e)?;
            Ok(None)
        }
        Some(RunExit::Shutdown) => {
            ended(m, RunExit::Signaled { signo: signal::SIGKILL })?;
            Ok(None)
        }
        other => Ok(other),
    }
}

/// The vfork child forks (or vforks) itself: it becomes a real process first, which then makes
/// that call again in its own VMM (its registers point back at the `syscall`).
pub(super) fn nested_fork(m: &mut Machine, nr: u64, r: &mut kvm_regs, sregs: &mut kvm_sregs) -> Result<()> {
    let mut again = *r;
    again.rip = r.rip.wrapping_sub(2);
    again.rax = nr;
    let cs = *sregs;
    materialize(m, again, cs, r, sregs)
}

