//! Guest processes: fork, vfork, clone and clone3 as host forks of this VMM process; execve; and
//! where signals reach the guest (syscall returns, interrupted runs, faults).
//!
//! # A guest fork is a host fork
//! The parent captures its vCPU as the child must resume (back in ring 3 after the syscall, rax =
//! 0, on the given stack with the given TLS) and makes the child with a raw `clone` whose exit
//! signal is 0: a "clone child" the host never reaps on its own (not even under the SIGCHLD =
//! SIG_IGN that forked sandboxes rely on), which the parent's guest reaps with wait4/waitid through
//! a pidfd (`guestos::signal`). The child closes what belongs to the parent's conversation with
//! its controller, builds its own KVM VM over the inherited copy-on-write memory
//! (`Machine::rebuild_after_fork`) and runs its guest on its own until the guest exits: an exit
//! code becomes the host `_exit` code, a fatal signal kills the VMM process by that same signal,
//! so the parent's wait sees exactly what Linux would report. It never talks to the controller;
//! its output reaches it through the sandbox's stdout/stderr pipes, which it shares.
//!
//! clone with CLONE_THREAD makes a thread of this process (`vmm::threads`); CLONE_VM without
//! CLONE_THREAD and without CLONE_VFORK answers EAGAIN. A fork of a multi-threaded process copies
//! only the calling thread, which becomes the child's first thread, as on Linux; execve ends the
//! other threads. CLONE_VM | CLONE_VFORK (posix_spawn, vfork, CPython's subprocess) does not copy
//! this process: the child runs on this process's vCPU until it execs or exits, and its program
//! then starts in fresh memory in a host process forked without the guest memory (`spawn`). A
//! multi-threaded process's vfork is a copying fork instead (its other threads would otherwise be
//! scheduled while the child's identity is installed), and so is every vfork with
//! `COLLIMATE_VFORK=copy`, to compare. A guest child's execve loads the program into fresh memory
//! too (a new VM, no old image to unmap); the sandbox's first process execs in place, in the
//! memory its snapshot maps.
//!
//! # Lifetimes
//! Guest processes die with their sandbox: each child asks the host for a parent-death signal. If
//! its parent was the sandbox's first process (whose VMM is killed when the VM is destroyed) or
//! the host adopted it elsewhere, it kills itself; if its parent was another guest process, the
//! sandbox's first process adopts it (that VMM is a child subreaper), as init would, and it lives
//! on. When the guest of the first process ends (exit or fatal signal), its children are killed,
//! as the end of a pid namespace's init kills the namespace; orphans it had adopted live until the
//! VM is destroyed or reset: a reset kills every guest process (see `kill_children`).
//!
//! A sandbox has at most [`MAX_PROCESSES`] live processes (fewer if its RLIMIT_NPROC says so),
//! counted in a page shared by its VMM processes; fork answers EAGAIN beyond that.
//!
//! # Limits
//! Child processes run on their own: they go on while the first process is paused between runs
//! (in replay mode taking turns with it, see `guestos::sched`). A forked sandbox (`Vm::fork`), a
//! snapshot or a reset does not carry the guest's children: in a clone they read as killed by
//! SIGKILL, a reset kills them. Process groups and sessions are not tracked beyond the guest's own
//! ids; kill reaches the process itself, its children, its parent and pid 1. Orphans adopted by
//! the first process are reaped by the host and not counted out of the process limit.

use std::os::fd::{AsRawFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Mutex;
use std::time::Duration;

use kvm_bindings::{kvm_regs, kvm_sregs};
use kvm_ioctls::VcpuFd;

use super::{exit_process, Machine, Pool};
use crate::arch::x86_64::regs;
use crate::channel::Channel;
use crate::error::{Error, Result};
use crate::guestos::exec;
use crate::guestos::mm::{Access, Fault, Space, TASK_SIZE};
use crate::guestos::signal::{self, host, Child, Delivery, Next, SigInfo};
use crate::guestos::{Errno, GuestOs, EFAULT, EINVAL, ENOENT, EPERM};
use crate::protocol::RunExit;
use crate::vstate::vcpu::VcpuState;

const SYS_RT_SIGRETURN: u64 = 15;
const SYS_CLONE: u64 = 56;
const SYS_FORK: u64 = 57;
const SYS_VFORK: u64 = 58;
const SYS_EXECVE: u64 = 59;
const SYS_EXECVEAT: u64 = 322;
const SYS_CLONE3: u64 = 435;
/// Engine call (not Linux): start a program as a new child process, see [`super::spawn::direct`].
pub const SYS_SPAWN: u64 = 0x4000_0001;
/// `SYS_SPAWN` flags: the child keeps only fds 0-2 (CPython's `close_fds=True`) ...
pub const SPAWN_CLOSE_FDS: u64 = 1;
/// ... and starts with SIGPIPE and SIGXFSZ at their default (CPython's `restore_signals=True`).
pub const SPAWN_RESTORE_SIGNALS: u64 = 2;

/// Most processes a sandbox may have at once (zombies included, as Linux counts RLIMIT_NPROC).
pub const MAX_PROCESSES: u32 = 256;

/// Write-like syscalls: EPIPE from them raises SIGPIPE.
const WRITES: &[u64] = &[1, 18, 20, 40, 275, 278, 296, 326, 328];

const CLONE_VM: u64 = 0x100;
const CLONE_FS: u64 = 0x200;
const CLONE_FILES: u64 = 0x400;
const CLONE_SIGHAND: u64 = 0x800;
const CLONE_PIDFD: u64 = 0x1000;
const CLONE_PTRACE: u64 = 0x2000;
const CLONE_VFORK: u64 = 0x4000;
const CLONE_PARENT: u64 = 0x8000;
const CLONE_THREAD: u64 = 0x1_0000;
const CLONE_SYSVSEM: u64 = 0x4_0000;
pub(super) const CLONE_SETTLS: u64 = 0x8_0000;
pub(super) const CLONE_PARENT_SETTID: u64 = 0x10_0000;
pub(super) const CLONE_CHILD_CLEARTID: u64 = 0x20_0000;
const CLONE_DETACHED: u64 = 0x40_0000;
const CLONE_UNTRACED: u64 = 0x80_0000;
pub(super) const CLONE_CHILD_SETTID: u64 = 0x100_0000;
const CLONE_IO: u64 = 0x8000_0000;
pub(super) const CLONE_CLEAR_SIGHAND: u64 = 0x1_0000_0000;
/// New namespaces (NEWNS, NEWCGROUP, NEWUTS, NEWIPC, NEWUSER, NEWPID, NEWNET, NEWTIME): not for us.
const CLONE_NAMESPACES: u64 = 0x2_0000 | 0x200_0000 | 0x400_0000 | 0x800_0000 | 0x1000_0000 | 0x2000_0000 | 0x4000_0000 | 0x80;
/// Flags that change nothing here.
const CLONE_HARMLESS: u64 = CLONE_FS | CLONE_PTRACE | CLONE_SYSVSEM | CLONE_DETACHED | CLONE_UNTRACED | CLONE_IO;

/// Whether the VMM (not `guestos::dispatch`) serves syscall `nr` of a Linux guest.
pub(super) fn intercepts(nr: u64) -> bool {
    matches!(nr, SYS_RT_SIGRETURN | SYS_CLONE | SYS_FORK | SYS_VFORK | SYS_EXECVE | SYS_EXECVEAT | SYS_CLONE3 | SYS_SPAWN)
}

/// A syscall as it was entered: its number and the address after the `syscall` instruction.
pub(super) struct Entry {
    nr: u64,
    rip: u64,
}

impl Entry {
    pub(super) fn of(r: &kvm_regs) -> Entry {
        Entry { nr: r.rax, rip: r.rcx }
    }

    /// Where the guest goes on after the call (just after its `syscall` instruction).
    pub(super) fn rip(&self) -> u64 {
        self.rip
    }
}

fn ret(r: &mut kvm_regs, res: std::result::Result<u64, Errno>) {
    r.rax = match res {
        Ok(v) => v,
        Err(e) => (-(e.0 as i64)) as u64,
    };
}

/// Serve an intercepted syscall (see [`intercepts`]). `r` holds the registers for the return to
/// ring 3 (rip after the `syscall`).
pub(super) fn syscall(m: &mut Machine, r: &mut kvm_regs, sregs: &mut kvm_sregs) -> Result<Option<RunExit>> {
    let a = [r.rdi, r.rsi, r.rdx, r.r10, r.r8, r.r9];
    match r.rax {
        SYS_FORK | SYS_VFORK | SYS_CLONE | SYS_CLONE3 => {
            let args = match r.rax {
                SYS_FORK => Ok(CloneArgs { flags: 0, exit_signal: signal::SIGCHLD as u64, ..Default::default() }),
                SYS_VFORK => Ok(CloneArgs { flags: CLONE_VM | CLONE_VFORK, exit_signal: signal::SIGCHLD as u64, ..Default::default() }),
                // x86-64: clone(flags, stack, parent_tid, child_tid, tls).
                SYS_CLONE => Ok(CloneArgs {
                    flags: a[0] & !0xff,
                    exit_signal: a[0] & 0xff,
                    stack: a[1],
                    stack_size: 0,
                    parent_tid: a[2],
                    child_tid: a[3],
                    tls: a[4],
                }),
                _ => clone3_args(m, a[0], a[1]),
            };
            let nr = r.rax;
            match args.and_then(|c| check_clone(&c).map(|_| c)) {
                // A vfork child that forks becomes a process of its own first (see `spawn`).
                Ok(_) if super::spawn::active(m) => super::spawn::nested_fork(m, nr, r, sregs)?,
                // A thread of this process, on its vCPU (see `vmm::threads`).
                Ok(c) if c.flags & CLONE_THREAD != 0 => {
                    let t = super::threads::NewThread { flags: c.flags, sp: child_sp(&c), parent_tid: c.parent_tid, child_tid: c.child_tid, tls: c.tls };
                    let res = super::threads::clone_thread(m, r, sregs, t);
                    ret(r, res);
                }
                Ok(c) if super::spawn::serves(m, &c) => {
                    let res = super::spawn::begin(m, r, sregs, &c).map(|_| 0);
                    ret(r, res);
                }
                Ok(c) => {
                    let res = fork(m, r, &c);
                    ret(r, res);
                }
                Err(e) => ret(r, Err(e)),
            }
        }
        SYS_EXECVE => return exec(m, r, sregs, libc::AT_FDCWD, a[0], a[1], a[2], 0),
        SYS_EXECVEAT => return exec(m, r, sregs, a[0] as i32, a[1], a[2], a[3], a[4] as i32),
        SYS_RT_SIGRETURN => return sigreturn(m, r),
        SYS_SPAWN => {
            crate::trace::take_counts("image");
            if let Err(e) = spawn_call(m, r, sregs, a) {
                ret(r, Err(e));
            }
        }
        _ => {}
    }
    Ok(None)
}

// --- fork --------------------------------------------------------------------------------------

#[derive(Default, Clone, Copy, Debug)]
pub(super) struct CloneArgs {
    pub(super) flags: u64,
    pub(super) exit_signal: u64,
    /// The child's stack: clone's stack pointer, or clone3's stack base (with its size).
    pub(super) stack: u64,
    pub(super) stack_size: u64,
    pub(super) parent_tid: u64,
    pub(super) child_tid: u64,
    pub(super) tls: u64,
}

impl CloneArgs {
    /// A vfork: the child shares the memory and its parent waits for its exec or exit.
    pub(super) fn is_vfork(&self) -> bool {
        self.flags & (CLONE_VM | CLONE_VFORK) == CLONE_VM | CLONE_VFORK && self.flags & CLONE_THREAD == 0
    }
}

fn clone3_args(m: &Machine, ptr: u64, size: u64) -> std::result::Result<CloneArgs, Errno> {
    const VER0: u64 = 64;
    if !(VER0..=4096).contains(&size) {
        return Err(EINVAL);
    }
    let mut b = vec![0u8; size as usize];
    m.runtime.aspace.read_virt(&m.mem, ptr, &mut b, true).map_err(|_| EFAULT)?;
    let w = |i: usize| b.get(i * 8..i * 8 + 8).map_or(0, |s| u64::from_le_bytes(s.try_into().unwrap_or_default()));
    // flags, pidfd, child_tid, parent_tid, exit_signal, stack, stack_size, tls, set_tid,
    // set_tid_size, cgroup; anything past what we know must be zero.
    if b.iter().skip(88).any(|&x| x != 0) || w(9) != 0 || w(8) != 0 {
        return Err(EINVAL);
    }
    let (stack, stack_size) = (w(5), w(6));
    if (stack == 0) != (stack_size == 0) {
        return Err(EINVAL);
    }
    Ok(CloneArgs { flags: w(0), exit_signal: w(4), stack, stack_size, parent_tid: w(3), child_tid: w(2), tls: w(7) })
}

/// The child's stack pointer, if the caller gave a stack.
pub(super) fn child_sp(c: &CloneArgs) -> Option<u64> {
    if c.stack == 0 {
        None
    } else if c.stack_size != 0 {
        c.stack.checked_add(c.stack_size)
    } else {
        Some(c.stack)
    }
}

/// Refuse what a clone cannot be here.
fn check_clone(c: &CloneArgs) -> std::result::Result<(), Errno> {
    let f = c.flags;
    if f & CLONE_THREAD != 0 && f & CLONE_SIGHAND == 0 || f & CLONE_SIGHAND != 0 && f & CLONE_VM == 0 {
        return Err(EINVAL);
    }
    // A thread of this process, on its vCPU: `threads::clone_thread` checks its flags.
    if f & CLONE_THREAD != 0 {
        return Ok(());
    }
    // Shared memory without being a thread (CLONE_VM alone) is not offered.
    if f & CLONE_VM != 0 && f & CLONE_VFORK == 0 {
        return Err(crate::guestos::EAGAIN);
    }
    if f & CLONE_NAMESPACES != 0 {
        return Err(EPERM);
    }
    let known = CLONE_VM | CLONE_VFORK | CLONE_SETTLS | CLONE_PARENT_SETTID | CLONE_CHILD_SETTID | CLONE_CHILD_CLEARTID
        | CLONE_CLEAR_SIGHAND | CLONE_HARMLESS;
    // CLONE_FILES (a shared fd table), CLONE_PARENT, CLONE_PIDFD, CLONE_INTO_CGROUP and unknown
    // flags are refused.
    if f & !known != 0 || f & (CLONE_FILES | CLONE_PARENT | CLONE_PIDFD) != 0 || c.exit_signal > 64 {
        return Err(EINVAL);
    }
    if f & CLONE_SETTLS != 0 && c.tls >= TASK_SIZE {
        return Err(EPERM);
    }
    Ok(())
}

/// Controller descriptors of this process (its channel, the spare pool's channels and pidfds): a
/// guest child closes them first thing.
static CONTROL_FDS: Mutex<Vec<RawFd>> = Mutex::new(Vec::new());
/// The signal a guest child gets when its parent process dies (see the module comment).
fn reaper_signal() -> libc::c_int {
    libc::SIGRTMIN() + 2
}
static REAPER_FOR: AtomicI32 = AtomicI32::new(0);

/// Called by `serve` before each request: remember the controller's descriptors, and make this
/// process the sandbox's first process (guest pid 1) for its guest children: a subreaper that
/// adopts orphans. In a forked sandbox (a new serving process), the guest's inherited children
/// belong to the original sandbox: they become phantoms here.
pub(super) fn serving(m: &mut Machine, chan: &Channel, pool: &Pool) {
    let mut fds = vec![chan.raw_fd()];
    for s in &pool.spares {
        fds.extend([s.chan.as_raw_fd(), s.pidfd.as_raw_fd()]);
    }
    if let Ok(mut v) = CONTROL_FDS.lock() {
        *v = fds;
    }
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    let top = host::top();
    if top != me {
        if top != 0 {
            if let Some(os) = m.os.as_mut() {
                for c in os.sig.children.iter_mut() {
                    c.pidfd = None;
                }
            }
        }
        host::set_top(me);
        // Guest pids go on from the sandbox this one was forked from (its page, still mapped
        // here until the new one replaces it), else from the snapshot's count.
        let next = host::next_pid().or(m.os.as_ref().map(|os| os.proc.next_pid)).unwrap_or(2);
        host::new_process_count(next);
        super::threads::count_in_new_tree(m);
        crate::guestos::sched::new_tree(m.os.as_ref().map_or(1, |os| os.proc.pid));
        crate::guestos::proctab::new_tree();
        if let Some(os) = m.os.as_ref() {
            let mem = crate::platform::kvm::Memory::new(&mut m.mem, &mut m.runtime.frames, &m.runtime.aspace);
            crate::guestos::proctab::refresh(os, &crate::platform::Memory::Kvm(mem));
        }
        crate::guestos::futex_shared::new_tree();
        // SAFETY: plain prctl on this process.
        unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    }
}

/// Parent-death signal handler of a guest child: survive only if the sandbox's first process
/// adopted us (our parent was another guest process); otherwise the sandbox is gone.
extern "C" fn on_parent_death(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: getppid, getpid, nanosleep and kill are async-signal-safe, and so is
    // `adopted_or_die` (atomics).
    unsafe {
        // The signal comes when the parent's *thread* exits. A VMM process has another one (KVM's
        // "kvm-nx-lpage-recovery" worker, in its thread group on recent kernels), so the parent
        // may still be exiting, not yet replaced by the process that adopts us: wait for that
        // (up to 2 s), or an orphan would take itself for its parent's child and die.
        // Already adopted (the signal can arrive after `child_main` saw the adoption and noted
        // the first process as its parent): nothing to wait for. Waiting then was a stall of
        // 2000 sleeps, seconds on a loaded host, in which a background job did nothing.
        let before = PARENT.load(Ordering::SeqCst);
        let pause = libc::timespec { tv_sec: 0, tv_nsec: 1_000_000 };
        for _ in 0..2000 {
            let now = libc::getppid();
            if now != before || now == host::top() {
                break;
            }
            libc::nanosleep(&pause, std::ptr::null_mut());
        }
        let top = host::top();
        if top == 0 || libc::getppid() != top || !host::adopted_or_die(libc::getpid()) {
            libc::kill(libc::getpid(), libc::SIGKILL);
        }
        PARENT.store(top, Ordering::SeqCst);
    }
    host::note_parent_gone();
}

/// The host pid of this guest process's parent (its creator, then the first process that adopted
/// it), for `on_parent_death`.
static PARENT: AtomicI32 = AtomicI32::new(0);

pub(super) fn install_reaper() {
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    if REAPER_FOR.swap(me, Ordering::SeqCst) == me {
        return;
    }
    // SAFETY: a zeroed sigaction is valid; we fill handler, flags and an empty mask.
    let mut sa: libc::sigaction = unsafe { std::mem::zeroed() };
    sa.sa_sigaction = on_parent_death as *const () as usize;
    sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
    // SAFETY: valid pointers to our sigaction and its mask.
    unsafe {
        libc::sigemptyset(&mut sa.sa_mask);
        libc::sigaction(reaper_signal(), &sa, std::ptr::null_mut());
    }
}

fn fork(m: &mut Machine, r: &kvm_regs, c: &CloneArgs) -> std::result::Result<u64, Errno> {
    crate::trace::mark_n("fork.enter", c.flags);
    let Some(os) = m.os.as_ref() else { return Err(crate::guestos::ENOSYS) };
    if host::stale() {
        return Err(crate::guestos::EAGAIN); // a reset ended this process's world: no new processes
    }
    let parent_pid = os.proc.pid;
    let nproc = os.proc.rlimits.get(6).map_or(u64::MAX, |l| l.cur);
    // The child resumes after the syscall in ring 3 with rax = 0.
    let mut state = m.capture().map_err(|_| crate::guestos::EAGAIN)?;
    state.regs = *r;
    state.regs.rax = 0;
    if let Some(sp) = child_sp(c) {
        state.regs.rsp = sp;
    }
    state.sregs.cs = regs::user_code_segment();
    state.sregs.ss = regs::user_data_segment();
    if c.flags & CLONE_SETTLS != 0 {
        state.sregs.fs.base = c.tls;
    }
    // A sandbox has at most MAX_PROCESSES processes (and no more than its RLIMIT_NPROC allows):
    // each is a VMM process with a VM of its own.
    if !host::add_process(nproc.min(MAX_PROCESSES as u64) as u32) {
        return Err(crate::guestos::EAGAIN);
    }
    host::install();
    install_reaper();
    // SAFETY: getpid cannot fail.
    let parent_host = unsafe { libc::getpid() };
    let generation = host::my_generation();
    // The child's guest pid (the sandbox's own numbering; the host pid is the VMM's business).
    // SAFETY: getpid cannot fail (the fallback outside a sandbox tree, which has no counter).
    let pid = host::alloc_pid().unwrap_or_else(|| unsafe { libc::getpid() });
    // Take in what arrived for us and fork with the carrier signal blocked: the child starts with
    // nothing pending, and what is sent to it early waits on the host until its first run.
    host::block(true);
    if let Some(os) = m.os.as_mut() {
        signal::gather(os);
    }
    crate::guestos::sched::before_fork(pid);
    // SAFETY: a raw clone with exit signal 0 and no other flags: a fork whose child the host never
    // reaps on its own. This process is single-threaded, so the child may go on in Rust; it never
    // returns from `child_main`.
    let rc = unsafe { libc::syscall(libc::SYS_clone, 0 as libc::c_ulong, 0usize, 0usize, 0usize, 0usize) };
    if rc == 0 {
        child_main(m, state, c, pid, parent_pid, parent_host, generation);
    }
    host::block(false);
    crate::trace::mark("fork.parent");
    if rc < 0 {
        let e = Errno::last();
        host::process_gone();
        crate::guestos::sched::killed(pid);
        return Err(e);
    }
    let host_pid = rc as i32;
    let pidfd = match signal::pidfd_open(host_pid) {
        Ok(fd) => fd,
        Err(e) => {
            // SAFETY: the child is ours and not reaped, so the pid is still its; reap it.
            unsafe {
                libc::kill(host_pid, libc::SIGKILL);
                libc::waitpid(host_pid, std::ptr::null_mut(), libc::__WALL);
            }
            host::process_gone();
            crate::guestos::sched::killed(pid);
            return Err(e);
        }
    };
    if c.flags & CLONE_PARENT_SETTID != 0 {
        let _ = m.runtime.aspace.write_virt(&mut m.mem, c.parent_tid, &pid.to_le_bytes(), true);
    }
    if let Some(os) = m.os.as_mut() {
        os.sig.children.push(Child { pid, pidfd: Some(pidfd), notified: false, exit_signal: c.exit_signal as i32 });
        // Count the fork in the CRNG, in step with the child's derivation of its own stream.
        let _ = os.proc.crng.fork_child();
    }
    Ok(pid as u64)
}

/// The child side of a guest fork. Never returns.
fn child_main(m: &mut Machine, state: VcpuState, c: &CloneArgs, guest_pid: i32, parent_pid: i32, parent_host: i32, generation: u32) -> ! {
    crate::trace::take_counts("parent");
    crate::trace::mark("child.start");
    enter_child_process(m, guest_pid, parent_host, generation);
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    if let Some(os) = m.os.as_mut() {
        os.sig.children.clear(); // our copies of the siblings' pidfds
        os.sig.pending = 0;
        os.sig.saved_mask = None;
        os.sig.parent = signal::pidfd_open(parent_host).ok();
        os.sig.parent_host = parent_host;
        os.proc.pid = guest_pid;
        os.proc.ppid = parent_pid;
        os.proc.started_ns = crate::guestos::clock::mono_peek(&os.proc);
        os.proc.sleep = None;
        // A stream of its own, derived from the parent's (deterministic for replays; see guestos::crng).
        os.proc.crng = os.proc.crng.fork_child();
        os.proc.timers.on_fork();
        crate::guestos::sched::set_timer_deadline(u64::MAX);
        os.proc.clear_child_tid = if c.flags & CLONE_CHILD_CLEARTID != 0 { c.child_tid } else { 0 };
        if c.flags & CLONE_CLEAR_SIGHAND != 0 {
            signal::on_exec(os);
        }
        drop(detach_agent(os));
    }
    if let Err(e) = m.rebuild_after_fork(&state) {
        eprintln!("collimate: guest process {me}: cannot make its VM: {e}");
        die_by(libc::SIGKILL);
    }
    crate::trace::mark("child.vm");
    if c.flags & CLONE_CHILD_SETTID != 0 {
        let _ = m.runtime.aspace.write_virt(&mut m.mem, c.child_tid, &guest_pid.to_le_bytes(), true);
    }
    run_child(m)
}

/// Whether this process is a guest child (not a sandbox's first process): its execve may load
/// the program into fresh memory, having no snapshot to reset to (see `spawn`).
static GUEST_CHILD: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The host side of becoming guest process `guest_pid` in a freshly forked VMM process, whose
/// parent is host process `parent_host`: the parent-death signal, the controller's descriptors
/// closed, the scheduler's slot, no core files.
pub(super) fn enter_child_process(m: &mut Machine, guest_pid: i32, parent_host: i32, generation: u32) {
    GUEST_CHILD.store(true, Ordering::SeqCst);
    // A guest process is not a sandbox fork: it reports nothing to `prefault` and forks no sandboxes.
    m.learn = Default::default();
    // Nor, until it loads a cached program of its own, to `spawn_prefault`.
    m.touched = None;
    // Tmpfs instances kept for the controller's children to come are not a guest child's.
    m.scratch_stock.clear();
    become_guest_child(guest_pid, parent_host, generation);
    // Only the calling thread is copied (its siblings stay the parent's, and counted there).
    super::threads::only_current(m, false);
}

/// The platform-neutral part of [`enter_child_process`] (kvm's and systrap's guest forks): the
/// parent-death signal (adoption by the first process, see `on_parent_death`), the controller's
/// descriptors closed, the scheduler's slot and the process table's entry, no core files.
/// `install_reaper` must have run in the parent.
pub(super) fn become_guest_child(guest_pid: i32, parent_host: i32, generation: u32) {
    // SAFETY: plain prctl/getppid calls; the parent-death signal has a handler (install_reaper).
    unsafe {
        libc::prctl(libc::PR_SET_PDEATHSIG, reaper_signal() as libc::c_ulong, 0, 0, 0);
        let (this, top) = (libc::getpid(), host::top());
        PARENT.store(parent_host, Ordering::SeqCst);
        // Not if the sandbox was reset since the fork began. If the parent died before we could
        // ask to follow it (`sh -c 'job &'`), we are an orphan like any other: adopted by the
        // sandbox's first process unless that was the parent (see `on_parent_death`).
        let ok = host::set_my_generation(generation)
            && (libc::getppid() == parent_host
                || (top != 0 && parent_host != top && libc::getppid() == top && host::adopted_or_die(this)));
        if !ok {
            libc::kill(this, libc::SIGKILL);
        }
        if libc::getppid() == top && parent_host != top {
            PARENT.store(top, Ordering::SeqCst);
        }
    }
    // Nothing of the parent's conversation with its controller stays open here.
    super::lifeline::forget();
    if let Ok(mut v) = CONTROL_FDS.lock() {
        for fd in v.drain(..) {
            // SAFETY: closing our copies of the controller's descriptors; the objects owning them
            // live in stack frames of the parent's `serve` that this process never returns to.
            unsafe { libc::close(fd) };
        }
    }
    host::reset_child();
    crate::guestos::sched::child_started(guest_pid);
    crate::guestos::proctab::child_started();
    crate::guestos::futex_shared::child_started();
    // No core files on the host when the guest dies by a core-dumping signal (RLIMIT_CORE is 0
    // in the guest too, so the wait status carries no core flag either way).
    let no_core = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: setrlimit with a valid struct.
    unsafe { libc::setrlimit(libc::RLIMIT_CORE, &no_core) };
}

/// Run a child process's guest to its end. A panic must not unwind into the parent's stack
/// frames, which this process inherited.
pub(super) fn run_child(m: &mut Machine) -> ! {
    if let Some(os) = m.os.as_ref() {
        let mem = crate::platform::kvm::Memory::new(&mut m.mem, &mut m.runtime.frames, &m.runtime.aspace);
            crate::guestos::proctab::refresh(os, &crate::platform::Memory::Kvm(mem));
    }
    let _ = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| child_loop(m)));
    die_by(libc::SIGKILL)
}

/// End this process as a guest process ended: by its exit code or its fatal signal.
pub(super) fn end_like(exit: RunExit) -> ! {
    match exit {
        RunExit::Exited { code } => exit_process(code & 0xff),
        RunExit::Signaled { signo } => die_by(signo),
        _ => die_by(libc::SIGKILL),
    }
}

/// The in-guest agent's channel belongs to the sandbox's first process: a child sees /dev/null.
/// Returns the channel (the caller's to keep or drop).
pub(super) fn detach_agent(os: &mut GuestOs) -> Option<std::sync::Arc<crate::guestos::files::OpenFile>> {
    let agent = os.agent.take()?;
    let fds: Vec<i32> = os.files.open_fds().collect();
    for fd in fds {
        let Ok(f) = os.files.get(fd) else { continue };
        if std::sync::Arc::ptr_eq(&f.file, &agent) {
            let cloexec = f.cloexec;
            let null = crate::guestos::files::OpenFile::new(crate::guestos::files::Kind::Null, Some("/dev/null".into()), libc::O_RDWR);
            let _ = os.files.install(fd, std::sync::Arc::new(null), cloexec);
        }
    }
    Some(agent)
}

/// Run the guest of a child process until it ends, then end this process the same way.
fn child_loop(m: &mut Machine) -> ! {
    loop {
        let ran = m.run(Duration::from_secs(3600));
        // However it ends, the memory and the VM are freed after the parent saw the end.
        super::teardown::arm(m.vm.fd.as_raw_fd(), m.vcpu.as_raw_fd());
        // A run that ended reports the pages it touched, if its image still wants reports.
        if ran.as_ref().is_ok_and(|r| matches!(r.exit, RunExit::Exited { .. } | RunExit::Signaled { .. })) {
            if let Some(t) = m.touched.take() {
                t.report(&m.mem, &m.runtime.aspace);
            }
        }
        match ran {
            Ok(r) => match r.exit {
                RunExit::Exited { code } => exit_process(code & 0xff),
                RunExit::Signaled { signo } => die_by(signo),
                RunExit::Timeout | RunExit::Yield { .. } => {}
                RunExit::Io { .. } | RunExit::Fault { .. } => die_by(libc::SIGSEGV),
                RunExit::Shutdown => die_by(libc::SIGKILL),
            },
            Err(e) => {
                eprintln!("collimate: guest process {}: {e}", std::process::id());
                die_by(libc::SIGKILL);
            }
        }
    }
}

/// End this process by host signal `sig`, so that its parent's wait sees WIFSIGNALED.
fn die_by(sig: i32) -> ! {
    crate::trace::take_counts("image");
    crate::trace::mark_n("host.die", sig as u64);
    crate::guestos::sched::leave();
    crate::guestos::futex_shared::leave();
    super::teardown::defer();
    // SAFETY: resetting and unblocking `sig`, then sending it to ourselves; SIGKILL if it did not
    // end us (it always does: the guest only dies by terminating signals).
    unsafe {
        libc::signal(sig, libc::SIG_DFL);
        let mut set: libc::sigset_t = std::mem::zeroed();
        libc::sigemptyset(&mut set);
        libc::sigaddset(&mut set, sig);
        libc::sigprocmask(libc::SIG_UNBLOCK, &set, std::ptr::null_mut());
        libc::kill(libc::getpid(), sig);
        libc::kill(libc::getpid(), libc::SIGKILL);
    }
    exit_process(128 + sig)
}

/// The guest of this process ended (exit or fatal signal). The sandbox's first process takes its
/// children with it.
pub(super) fn guest_ended(m: &mut Machine) {
    if let Some(os) = m.os.as_mut() {
        if os.proc.pid == 1 {
            signal::kill_children(os);
        }
    }
}

/// Kill the guest's children (reset: the world they live in is going away).
pub(super) fn kill_children(m: &mut Machine) {
    // SAFETY: getpid cannot fail.
    let top = host::top() == unsafe { libc::getpid() };
    // Every guest process goes, not only the children: orphans the first process adopted, and
    // through them and the children everything below (see `host::new_generation`).
    let adopted = if top { host::new_generation() } else { Vec::new() };
    if let Some(os) = m.os.as_mut() {
        signal::kill_children(os);
    }
    signal::kill_adopted(&adopted);
    if top {
        signal::wait_children_gone(std::time::Duration::from_secs(2));
        // The process budget starts over with the world (see `host::reset_process_count`).
        host::reset_process_count();
        crate::guestos::sched::reset(m.os.as_ref().map_or(1, |os| os.proc.pid));
        crate::guestos::proctab::reset(m.os.as_ref().map_or(1, |os| os.proc.pid));
        crate::guestos::futex_shared::reset();
    }
}

/// An exec ran out of time (`Request::EndExec`): end what it started and keep the sandbox. A
/// vfork child running in place here ends as if SIGKILLed (its parent resumes); every other
/// process the exec started is SIGKILLed (`signal::kill_exec_processes`), so the agent's wait
/// for its command returns; the agent itself is sent `interrupt` (0: nothing). Its memory, its
/// files and the processes earlier execs left running are untouched: unlike a reset.
pub(super) fn end_exec(m: &mut Machine, interrupt: i32) -> Result<()> {
    if super::spawn::active(m) {
        super::spawn::filter_exit(m, Some(RunExit::Signaled { signo: signal::SIGKILL }))?;
    }
    if let Some(os) = m.os.as_mut() {
        signal::kill_exec_processes(os);
        if interrupt > 0 && os.proc.pid == 1 && host::top() != 0 {
            host::send_top(interrupt, (0, 0)).map_err(|e| Error::Remote(format!("cannot interrupt the agent: errno {}", e.0)))?;
        }
    }
    Ok(())
}

// --- execve ------------------------------------------------------------------------------------

const MAX_ARG_STRLEN: usize = 32 * 4096;
const MAX_ARG_STRINGS: usize = 0x7fff_ffff;
const MAX_ARG_TOTAL: usize = 2 << 20;
const AT_SYMLINK_NOFOLLOW: i32 = 0x100;
const AT_EMPTY_PATH: i32 = 0x1000;

fn read_cstr(m: &Machine, va: u64, max: usize) -> std::result::Result<Vec<u8>, Errno> {
    let mut out = Vec::new();
    let mut p = va;
    loop {
        let chunk = (4096 - (p & 4095)) as usize;
        let mut buf = vec![0u8; chunk];
        m.runtime.aspace.read_virt(&m.mem, p, &mut buf, true).map_err(|_| EFAULT)?;
        if let Some(i) = buf.iter().position(|&b| b == 0) {
            out.extend_from_slice(&buf[..i]);
            return Ok(out);
        }
        out.extend_from_slice(&buf);
        if out.len() > max {
            return Err(crate::guestos::ENAMETOOLONG);
        }
        p = p.checked_add(chunk as u64).ok_or(EFAULT)?;
    }
}

/// A NULL-terminated array of strings (argv, envp); NULL reads as empty.
fn read_strv(m: &Machine, va: u64, total: &mut usize) -> std::result::Result<Vec<Vec<u8>>, Errno> {
    const E2BIG: Errno = Errno(7);
    let mut v = Vec::new();
    if va == 0 {
        return Ok(v);
    }
    for i in 0..MAX_ARG_STRINGS {
        let mut b = [0u8; 8];
        let at = va.checked_add(8 * i as u64).ok_or(EFAULT)?;
        m.runtime.aspace.read_virt(&m.mem, at, &mut b, true).map_err(|_| EFAULT)?;
        let p = u64::from_le_bytes(b);
        if p == 0 {
            break;
        }
        let s = read_cstr(m, p, MAX_ARG_STRLEN).map_err(|e| if e == EFAULT { e } else { E2BIG })?;
        *total += s.len() + 1 + 8;
        if *total > MAX_ARG_TOTAL {
            return Err(E2BIG);
        }
        v.push(s);
    }
    Ok(v)
}

/// `SYS_SPAWN(path, argv, envp, flags)`: what a vfork, the child's resets and its execve do, in one
/// call and without running the child's pre-exec code in the guest. Returns the child's pid in rax
/// (Ok), or the errno the caller gets: ENOSYS where the call is not served in place (the caller
/// falls back to vfork and execve), else what the execve would have failed with.
fn spawn_call(m: &mut Machine, r: &mut kvm_regs, sregs: &mut kvm_sregs, a: [u64; 6]) -> std::result::Result<(), Errno> {
    let flags = a[3];
    if flags & !(SPAWN_CLOSE_FDS | SPAWN_RESTORE_SIGNALS) != 0 {
        return Err(EINVAL);
    }
    let c = CloneArgs { flags: CLONE_VM | CLONE_VFORK, exit_signal: signal::SIGCHLD as u64, ..Default::default() };
    if !super::spawn::serves(m, &c) {
        return Err(crate::guestos::ENOSYS);
    }
    crate::trace::mark("spawn.enter");
    let path = read_cstr(m, a[0], crate::guestos::vfs::PATH_MAX)?;
    let mut total = 0;
    let argv = read_strv(m, a[1], &mut total)?;
    let envp = read_strv(m, a[2], &mut total)?;
    let os = m.os.as_ref().ok_or(crate::guestos::ENOSYS)?;
    let prepared = exec::prepare(os, &path, &argv, &envp)?;
    crate::trace::mark("exec.prepared");
    let resets = super::spawn::Resets { close_fds: flags & SPAWN_CLOSE_FDS != 0, restore_signals: flags & SPAWN_RESTORE_SIGNALS != 0 };
    super::spawn::direct(m, r, sregs, &c, resets, prepared, &envp)
}

#[allow(clippy::too_many_arguments)]
fn exec(
    m: &mut Machine,
    r: &mut kvm_regs,
    sregs: &mut kvm_sregs,
    dirfd: i32,
    path: u64,
    argv: u64,
    envp: u64,
    flags: i32,
) -> Result<Option<RunExit>> {
    crate::trace::take_counts("image");
    crate::trace::mark("exec.enter");
    let prepared = (|| {
        if flags & !(AT_EMPTY_PATH | AT_SYMLINK_NOFOLLOW) != 0 {
            return Err(EINVAL);
        }
        let path = read_cstr(m, path, crate::guestos::vfs::PATH_MAX)?;
        let mut total = 0;
        let argv = read_strv(m, argv, &mut total)?;
        let envp = read_strv(m, envp, &mut total)?;
        let os = m.os.as_ref().ok_or(crate::guestos::ENOSYS)?;
        let full = if path.is_empty() {
            if flags & AT_EMPTY_PATH == 0 {
                return Err(ENOENT);
            }
            // fexecve: the file the fd was opened as.
            let f = os.files.file(dirfd)?;
            f.path.clone().ok_or(ENOENT)?.into_bytes()
        } else if path[0] == b'/' || dirfd == libc::AT_FDCWD {
            path
        } else {
            let mut d = os.files.dir_path(dirfd)?.into_bytes();
            d.push(b'/');
            d.extend_from_slice(&path);
            d
        };
        exec::prepare(os, &full, &argv, &envp).map(|p| (p, envp))
    })();
    let (prepared, envp) = match prepared {
        Ok(v) => v,
        Err(e) => {
            ret(r, Err(e));
            return Ok(None);
        }
    };
    crate::trace::mark("exec.prepared");
    // A vfork child's program starts in a process of its own, the parent resumes (see `spawn`).
    if super::spawn::active(m) {
        if let Err(e) = super::spawn::exec(m, r, sregs, prepared, &envp) {
            ret(r, Err(e));
        }
        return Ok(None);
    }
    // A guest child's program goes into fresh memory: nothing of the old image to unmap, no
    // reused frame to clear, a VM without the old image's shadow pages.
    if GUEST_CHILD.load(Ordering::SeqCst) {
        if super::spawn::load_fresh(m, true, prepared, &envp).is_err() {
            crate::trace::mark("exec.load_fresh_failed");
            return Ok(Some(RunExit::Signaled { signo: signal::SIGSEGV }));
        }
        *r = m.vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
        *sregs = m.vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
        return Ok(None);
    }
    // The point of no return: the old image goes away (and with it the entries' dirty bits, the
    // record of written pages where the VM has no dirty log yet).
    m.end_unlogged()?;
    let Some(os) = m.os.as_mut() else { return Ok(None) };
    let mut sp = Space::new(&mut m.mem, &mut m.runtime.frames, &m.runtime.aspace);
    let unmapped = os.mm.unmap_range(&mut sp, 0, TASK_SIZE);
    os.mm.drop_unused_windows(&mut m.mem);
    crate::trace::mark("exec.unmapped");
    // Every user translation was removed and the frames are about to be reused.
    crate::vstate::tlb::flush_guest_tlb(&mut m.vm, &mut m.mem)?;
    crate::trace::mark("exec.flushed");
    let img = unmapped.and_then(|_| exec::commit(os, &mut m.mem, &mut m.runtime.frames, &m.runtime.aspace, prepared, &envp));
    crate::trace::mark("exec.committed");
    let img = match img {
        Ok(img) => img,
        // Too late to fail the call: the process dies, as on Linux.
        Err(_) => {
            crate::trace::mark("exec.commit_failed");
            return Ok(Some(RunExit::Signaled { signo: signal::SIGSEGV }));
        }
    };
    *r = regs::initial_regs(img.entry, img.rsp);
    sregs.fs.base = 0;
    sregs.gs.base = 0;
    on_exec_state(os);
    // A fresh FPU: x87 and SSE in their initial state, no AVX state.
    let mut xs = m.vcpu.get_xsave().map_err(Error::kvm("KVM_GET_XSAVE"))?;
    let mxcsr_mask = xs.region[7];
    xs.region.fill(0);
    xs.region[0] = 0x037f;
    xs.region[6] = 0x1f80;
    xs.region[7] = mxcsr_mask;
    // SAFETY: a complete kvm_xsave of the size KVM_SET_XSAVE reads; KVM validates it.
    unsafe { m.vcpu.set_xsave(&xs) }.map_err(Error::kvm("KVM_SET_XSAVE"))?;
    crate::trace::mark("exec.loaded");
    Ok(None)
}

/// What execve resets in the process besides its image: handlers, close-on-exec descriptors,
/// the thread's bookkeeping.
pub(super) fn on_exec_state(os: &mut GuestOs) {
    signal::on_exec(os);
    // The other threads end; the calling one becomes the first (its tid is the pid).
    let gone = os.threads.only_current();
    host::threads_gone(gone as u32);
    os.files.close_on_exec();
    os.proc.clear_child_tid = 0;
    os.proc.robust_list = (0, 0);
    os.proc.sleep = None;
    os.proc.timers.on_exec();
}

// --- signal delivery ---------------------------------------------------------------------------

fn xsave_bytes(vcpu: &VcpuFd) -> Result<(kvm_bindings::kvm_xsave, Vec<u8>)> {
    let xs = vcpu.get_xsave().map_err(Error::kvm("KVM_GET_XSAVE"))?;
    let bytes = xs.region.iter().flat_map(|w| w.to_le_bytes()).collect();
    Ok((xs, bytes))
}

/// Enter the handler for `d` with the registers in `r` (updated in place). Ok(false): the frame
/// could not be written and the process must die by SIGSEGV.
fn deliver(m: &mut Machine, r: &mut kvm_regs, d: &Delivery) -> Result<bool> {
    let (_, xsave) = xsave_bytes(&m.vcpu)?;
    let Some(os) = m.os.as_mut() else { return Ok(true) };
    let mut mem = crate::platform::Memory::Kvm(crate::platform::kvm::Memory::new(&mut m.mem, &mut m.runtime.frames, &m.runtime.aspace));
    Ok(signal::setup_frame(os, &mut mem, r, &xsave, d).is_ok())
}

fn sigreturn(m: &mut Machine, r: &mut kvm_regs) -> Result<Option<RunExit>> {
    let (mut xs, mut bytes) = xsave_bytes(&m.vcpu)?;
    let Some(os) = m.os.as_mut() else { return Ok(None) };
    let mem = crate::platform::Memory::Kvm(crate::platform::kvm::Memory::new(&mut m.mem, &mut m.runtime.frames, &m.runtime.aspace));
    if signal::sigreturn(os, &mem, r, &mut bytes).is_err() {
        return Ok(Some(RunExit::Signaled { signo: signal::SIGSEGV }));
    }
    for (w, c) in xs.region.iter_mut().zip(bytes.chunks_exact(4)) {
        *w = u32::from_le_bytes([c[0], c[1], c[2], c[3]]);
    }
    // SAFETY: a complete kvm_xsave; KVM validates the contents (a bad one is the guest's fault).
    if unsafe { m.vcpu.set_xsave(&xs) }.is_err() {
        return Ok(Some(RunExit::Signaled { signo: signal::SIGSEGV }));
    }
    Ok(None)
}

/// The `syscall` instruction of the last call that was set to restart (0: the last call did not),
/// and that call's number: see [`on_interrupt`].
static RESTART_RIP: AtomicU64 = AtomicU64::new(0);
static RESTART_NR: AtomicU64 = AtomicU64::new(0);

/// Whether a handler for `act` ends restarting call `nr` with EINTR (Linux: unless SA_RESTART, and
/// always for the sleeps, poll, select and the signal waits).
fn interrupts(nr: u64, act: &crate::guestos::signal_state::SigAction) -> bool {
    signal::NO_RESTART_WITH_HANDLER.contains(&nr) || act.flags & signal::SA_RESTART == 0
}

/// After a syscall of a Linux guest: SIGPIPE for EPIPE, then act on the next pending signal
/// (enter its handler, or end the process by it). `r` is what the guest resumes with.
pub(super) fn after_syscall(m: &mut Machine, entry: &Entry, r: &mut kvm_regs, exit: Option<RunExit>) -> Result<Option<RunExit>> {
    let Some(os) = m.os.as_mut() else { return Ok(exit) };
    match signals_after_syscall(os, entry, r, exit) {
        AfterSyscall::Resume(exit) => Ok(exit),
        AfterSyscall::Deliver(d, exit) => {
            if deliver(m, r, &d)? {
                Ok(exit)
            } else {
                Ok(Some(RunExit::Signaled { signo: signal::SIGSEGV }))
            }
        }
    }
}

/// What a run loop does after a syscall, whatever the platform: go on (with the call's exit),
/// or first enter a handler for a signal (the platform writes the frame: [`signal::setup_frame`]
/// with its memory and XSAVE area).
pub(super) enum AfterSyscall {
    Resume(Option<RunExit>),
    Deliver(Delivery, Option<RunExit>),
}

/// The platform-neutral part of [`after_syscall`]: SIGPIPE for EPIPE, due timers, signals from
/// other processes and children, then the next pending signal. A restarting call that a handler
/// interrupts returns EINTR here (`r` updated).
pub(super) fn signals_after_syscall(os: &mut GuestOs, entry: &Entry, r: &mut kvm_regs, exit: Option<RunExit>) -> AfterSyscall {
    let restarting = r.rip == entry.rip.wrapping_sub(2) && r.rax == entry.nr;
    RESTART_RIP.store(if restarting { r.rip } else { 0 }, Ordering::Relaxed);
    RESTART_NR.store(entry.nr, Ordering::Relaxed);
    if host::stale() {
        // The sandbox was reset since this guest process was forked: it ends here.
        return AfterSyscall::Resume(Some(RunExit::Signaled { signo: signal::SIGKILL }));
    }
    if matches!(exit, Some(RunExit::Exited { .. } | RunExit::Signaled { .. })) {
        return AfterSyscall::Resume(exit);
    }
    if WRITES.contains(&entry.nr) && r.rax as i64 == -(crate::guestos::EPIPE.0 as i64) {
        let pid = os.proc.pid;
        signal::raise(os, SigInfo::sent(signal::SIGPIPE, signal::SI_USER, pid));
    }
    crate::guestos::timer::fire_due(os);
    if os.sig.pending == 0 && !host::pending() && os.sig.children.iter().all(|c| c.notified) {
        if let Some(mask) = os.sig.saved_mask.take() {
            os.proc.sigmask = mask;
        }
        return AfterSyscall::Resume(exit);
    }
    signal::gather(os);
    match signal::next(os) {
        None => {
            if let Some(mask) = os.sig.saved_mask.take() {
                os.proc.sigmask = mask;
            }
            AfterSyscall::Resume(exit)
        }
        Some(Next::Die { sig }) => AfterSyscall::Resume(Some(RunExit::Signaled { signo: sig })),
        Some(Next::Handle { sig, info, act }) => {
            if restarting && interrupts(entry.nr, &act) {
                r.rip = entry.rip;
                r.rax = (-(crate::guestos::EINTR.0 as i64)) as u64;
                os.proc.sleep = None;
                RESTART_RIP.store(0, Ordering::Relaxed);
            }
            AfterSyscall::Deliver(Delivery { sig, info, act, trapno: 0, err: 0, cr2: 0 }, exit)
        }
    }
}

/// KVM_RUN was interrupted (a host signal, the run's preemption): act on a signal that arrived from
/// another process while the guest ran.
pub(super) fn on_interrupt(m: &mut Machine) -> Result<Option<RunExit>> {
    let Some(os) = m.os.as_mut() else { return Ok(None) };
    if !host::pending() && os.sig.pending == 0 {
        return Ok(None);
    }
    signal::gather(os);
    if !signal::has_ready(os) {
        return Ok(None);
    }
    // Only in ring 3: if the vCPU stopped at a ring-0 stub, the syscall return delivers it.
    let sregs = m.vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
    if sregs.cs.selector & 3 != 3 {
        return Ok(None);
    }
    let Some(os) = m.os.as_mut() else { return Ok(None) };
    match signal::next(os) {
        None => Ok(None),
        Some(Next::Die { sig }) => Ok(Some(RunExit::Signaled { signo: sig })),
        Some(Next::Handle { sig, info, act }) => {
            let mut r = m.vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
            // Still at the `syscall` of a call set to restart (a blocking read between two of its
            // waits): the signal interrupts that call, as at its return (`after_syscall`), so that
            // EINTR reaches the program (CPython runs its handlers only then).
            let nr = RESTART_NR.load(Ordering::Relaxed);
            if r.rip != 0 && r.rip == RESTART_RIP.load(Ordering::Relaxed) && r.rax == nr && interrupts(nr, &act) {
                r.rip += 2;
                r.rax = (-(crate::guestos::EINTR.0 as i64)) as u64;
                if let Some(os) = m.os.as_mut() {
                    os.proc.sleep = None;
                }
                RESTART_RIP.store(0, Ordering::Relaxed);
            }
            let d = Delivery { sig, info, act, trapno: 0, err: 0, cr2: 0 };
            if !deliver(m, &mut r, &d)? {
                return Ok(Some(RunExit::Signaled { signo: signal::SIGSEGV }));
            }
            m.vcpu.set_regs(&r).map_err(Error::kvm("KVM_SET_REGS"))?;
            Ok(None)
        }
    }
}

const SEGV_MAPERR: i32 = 1;
const SEGV_ACCERR: i32 = 2;
const BUS_ADRERR: i32 = 2;

/// The signal and si_code a CPU exception raises, as Linux's traps do.
pub(super) fn fault_signal(vector: u8, error_code: u64) -> (i32, i32) {
    match vector {
        0 => (signal::SIGFPE, 1),  // #DE: FPE_INTDIV
        1 => (signal::SIGTRAP, 2), // #DB: TRAP_TRACE
        3 => (signal::SIGTRAP, signal::SI_KERNEL),
        6 => (signal::SIGILL, 2),   // #UD: ILL_ILLOPN
        11 | 12 => (signal::SIGBUS, signal::SI_KERNEL),
        13 => (signal::SIGSEGV, signal::SI_KERNEL),
        14 => (signal::SIGSEGV, if error_code & 1 != 0 { SEGV_ACCERR } else { SEGV_MAPERR }),
        16 | 19 => (signal::SIGFPE, 0),
        17 => (signal::SIGBUS, 1), // #AC: BUS_ADRALN
        _ => (signal::SIGSEGV, signal::SI_KERNEL),
    }
}

/// A guest exception (the vCPU is back at the faulting instruction in ring 3). A page fault in a
/// lazy file mapping reads the page in and the guest goes on (Ok(None)). Otherwise a Linux guest
/// gets the signal: its handler runs (Ok(None): go on), or the process dies by it.
pub(super) fn on_fault(m: &mut Machine, exit: RunExit) -> Result<Option<RunExit>> {
    let RunExit::Fault { vector, error_code, rip, cr2 } = exit else { return Ok(Some(exit)) };
    crate::trace::mark_n("fault.vector", vector as u64);
    crate::trace::mark_n("fault.rip", rip);
    crate::trace::mark_n("fault.cr2", cr2);
    crate::trace::mark_n("fault.error_code", error_code);
    let Some(os) = m.os.as_mut() else { return Ok(Some(exit)) };
    let (mut sig, mut code) = fault_signal(vector, error_code);
    if vector == 14 {
        let mut sp = Space::new(&mut m.mem, &mut m.runtime.frames, &m.runtime.aspace);
        match os.mm.fault(&mut sp, cr2, Access::of_error_code(error_code)) {
            Fault::NotLazy => {}
            // A new translation needs no invalidation (see `vstate::tlb`): the guest retries.
            Fault::Resolved => return Ok(None),
            Fault::Stale(pa) => {
                crate::vstate::tlb::invalidate_frames(&m.mem, &[pa])?;
                return Ok(None);
            }
            Fault::Denied => code = SEGV_ACCERR,
            Fault::Bus => (sig, code) = (signal::SIGBUS, BUS_ADRERR),
            // Linux would call the OOM killer; the sandbox's memory is what ran out, and this
            // process is the one that wanted more.
            Fault::OutOfMemory => return Ok(Some(RunExit::Signaled { signo: signal::SIGBUS })),
        }
    }
    match fault_delivery(os, sig, code, vector, error_code, rip, cr2) {
        Some(d) => {
            let mut r = m.vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
            if !deliver(m, &mut r, &d)? {
                return Ok(Some(RunExit::Signaled { signo: signal::SIGSEGV }));
            }
            m.vcpu.set_regs(&r).map_err(Error::kvm("KVM_SET_REGS"))?;
            Ok(None)
        }
        None => Ok(Some(RunExit::Signaled { signo: sig })),
    }
}

/// The handler to enter for fault signal `sig` (`code` its si_code) raised by exception `vector`,
/// whatever the platform; None: the process dies by `sig` (blocked or not handled: a fault
/// cannot be ignored, Linux's force_sig_fault).
pub(super) fn fault_delivery(os: &GuestOs, sig: i32, code: i32, vector: u8, error_code: u64, rip: u64, cr2: u64) -> Option<Delivery> {
    let addr = match vector {
        14 => cr2,
        11..=13 => 0,
        _ => rip,
    };
    let blocked = os.proc.sigmask & (1 << (sig - 1)) != 0;
    match signal::action(&os.proc, sig) {
        signal::Action::Handler(act) if !blocked => {
            Some(Delivery { sig, info: SigInfo::fault(sig, code, addr), act, trapno: vector as u64, err: error_code, cr2 })
        }
        _ => None,
    }
}

/// For the duration of a run: carry signals from other processes into this one (see
/// `signal::host`), kicking the vCPU out of KVM_RUN when one arrives.
pub(super) struct RunGuard;

impl RunGuard {
    pub(super) fn enter(vcpu: &mut VcpuFd) -> RunGuard {
        host::install();
        host::set_kick(vcpu.get_kvm_run());
        host::block(false);
        RunGuard
    }
}

impl Drop for RunGuard {
    fn drop(&mut self) {
        host::block(true);
        host::set_kick(std::ptr::null_mut());
    }
}
