//! Ending a guest child process without making its parent wait for the host to free its memory
//! and its VM.
//!
//! # Why
//! A guest process is a host process (see `process`), and its parent's wait returns when that
//! host process has exited. Linux's exit frees the process's memory and closes its descriptors
//! before the parent is told: for a VMM that is the guest memory (every page the program touched,
//! page tables, the copied program) and the KVM VM with its shadow pages. On this host each freed
//! page and the VM's teardown cost enough to be a large part of a short command's wall time
//! (docs/spawn.md: "exit to the agent's wait4").
//!
//! # How
//! Just before the host exit, [`defer`] starts a helper process that shares this process's memory
//! (CLONE_VM) and holds a copy of only the VM's and vCPU's descriptors; it closes every other
//! descriptor it inherited (the guest's files; this process waits until it has, so that a pipe
//! the parent reads reaches EOF when this process ends, as before) and waits on this process's
//! pidfd. This process's exit then only
//! drops its references, the parent's wait returns, and the helper, last to hold them, frees the
//! memory and the VM. The helper blocks every signal but SIGKILL and ends as soon as this process
//! is gone; it is nobody's guest process (reparented to the VMM's reaper, which ignores SIGCHLD).
//!
//! Where the helper cannot be made (no pidfd, no memory for its stack), the exit goes on as before.
//!
//! A systrap child VMM ([`arm_memory`]) has no VM: what its exit frees is its copy of the parent
//! VMM's memory (page tables and the pages it wrote), so its helper keeps no descriptor but the
//! pidfd it waits on.

use std::os::fd::RawFd;
use std::sync::atomic::{AtomicBool, AtomicI32, AtomicU32, Ordering};

/// The helper runs a few syscalls: a small stack is plenty.
const STACK_SIZE: usize = 64 * 1024;

/// What the exiting process keeps alive through the helper: its VM and vCPU descriptors, set by
/// [`arm`] (-1: none, no helper).
static KEEP: [AtomicI32; 2] = [AtomicI32::new(-1), AtomicI32::new(-1)];
/// Whether the next [`defer`] starts a helper ([`arm`], [`arm_memory`]).
static ARMED: AtomicBool = AtomicBool::new(false);

/// What the helper needs, written at the bottom of its stack mapping.
#[repr(C)]
struct Args {
    pidfd: RawFd,
    /// Descriptors to keep open (ascending, -1 for none).
    keep: [RawFd; 3],
    /// Set (and woken, a futex) once the helper has closed the rest.
    closed: AtomicU32,
}

/// The descriptors the next [`defer`] keeps alive (the VM's, then the vCPU's).
pub(super) fn arm(vm: RawFd, vcpu: RawFd) {
    KEEP[0].store(vm, Ordering::Relaxed);
    KEEP[1].store(vcpu, Ordering::Relaxed);
    ARMED.store(true, Ordering::Relaxed);
}

/// The next [`defer`] hands only this process's memory to a helper (a systrap child VMM: no VM).
pub(super) fn arm_memory() {
    ARMED.store(true, Ordering::Relaxed);
}

/// Whether `COLLIMATE_TEARDOWN=inline` asks for the plain exit (to compare).
fn inline() -> bool {
    std::env::var_os("COLLIMATE_TEARDOWN").is_some_and(|v| v == "inline")
}

/// Called right before this process's `_exit` (or its fatal signal): hand the teardown of the
/// guest memory and the VM to a helper (see the module docs). Does nothing unless [`arm`]ed.
pub(super) fn defer() {
    let keep = [KEEP[0].swap(-1, Ordering::Relaxed), KEEP[1].swap(-1, Ordering::Relaxed)];
    if !ARMED.swap(false, Ordering::Relaxed) || inline() {
        return;
    }
    // SAFETY: getpid cannot fail; pidfd_open returns a new descriptor or -1.
    let pidfd = unsafe { libc::syscall(libc::SYS_pidfd_open, libc::getpid(), 0) } as RawFd;
    if pidfd < 0 {
        return;
    }
    // SAFETY: a fresh private anonymous mapping, checked; never unmapped (it goes with the memory).
    let stack = unsafe {
        libc::mmap(std::ptr::null_mut(), STACK_SIZE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if stack == libc::MAP_FAILED {
        // SAFETY: closing the descriptor we just opened.
        unsafe { libc::close(pidfd) };
        return;
    }
    let mut k = [keep[0], keep[1], pidfd];
    k.sort_unstable();
    let args = stack.cast::<Args>();
    // SAFETY: the mapping is STACK_SIZE bytes, writable and aligned for Args; the helper reads it.
    unsafe { args.write(Args { pidfd, keep: k, closed: AtomicU32::new(0) }) };
    // SAFETY: a zeroed sigset_t is a valid (empty) set.
    let mut all: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    let mut old: libc::sigset_t = unsafe { std::mem::zeroed() };
    // SAFETY: sigset operations on local sets; the helper starts with every signal blocked (it
    // inherits the mask), and this process's mask is put back after the clone.
    unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old);
    }
    // SAFETY: the helper runs `helper` on its own stack (the top of the mapping, 16-byte aligned)
    // in our memory; it touches only its Args and makes raw syscalls, and this process does
    // nothing but exit meanwhile. SIGCHLD is what its end raises in whoever adopted it.
    unsafe {
        let top = stack.cast::<u8>().add(STACK_SIZE);
        let rc = libc::clone(helper, top.cast(), libc::CLONE_VM | libc::SIGCHLD, args.cast());
        libc::pthread_sigmask(libc::SIG_SETMASK, &old, std::ptr::null_mut());
        libc::close(pidfd);
        if rc > 0 {
            // Not on this process's CPU, where systrap's placement may have bound it and its
            // parent goes on.
            crate::platform::systrap::placement::unbind(rc);
            crate::trace::mark("teardown.deferred");
            // Until the helper has closed its copies of the guest's descriptors, a pipe this
            // process writes would not show EOF when its parent sees it end.
            // Bounded: a helper killed meanwhile has lost its descriptors anyway.
            let closed = &(*args).closed;
            let wait = libc::timespec { tv_sec: 0, tv_nsec: 20_000_000 };
            for _ in 0..50 {
                if closed.load(Ordering::Acquire) != 0 {
                    break;
                }
                libc::syscall(libc::SYS_futex, closed.as_ptr(), libc::FUTEX_WAIT, 0u32, &wait as *const libc::timespec);
            }
        }
    }
}

/// The helper: close what is not to be kept, wait until the exiting process is gone, end (its
/// exit frees the memory and, with the last descriptor, the VM).
extern "C" fn helper(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `defer` wrote an Args at `arg` and does not change it.
    let a = unsafe { &*arg.cast::<Args>() };
    let mut from: u32 = 0;
    for &fd in &a.keep {
        if fd < 0 {
            continue;
        }
        if (fd as u32) > from {
            // SAFETY: closing descriptors of this helper's own table (a copy).
            unsafe { libc::syscall(libc::SYS_close_range, from, fd as u32 - 1, 0u32) };
        }
        from = fd as u32 + 1;
    }
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_close_range, from, u32::MAX, 0u32) };
    a.closed.store(1, Ordering::Release);
    // SAFETY: waking the exiting process, which waits on this word.
    unsafe { libc::syscall(libc::SYS_futex, a.closed.as_ptr(), libc::FUTEX_WAKE, 1u32) };
    let mut pfd = libc::pollfd { fd: a.pidfd, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd; readable once the process has exited (every signal is blocked:
    // no EINTR; any other error ends the helper at once, which is only slower for the parent).
    unsafe { libc::syscall(libc::SYS_poll, &mut pfd as *mut libc::pollfd, 1u64, -1i64) };
    0
}
