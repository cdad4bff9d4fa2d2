//! A sandbox's VMM process ends with its controller, whatever the guest is doing.
//!
//! A VMM process waiting for a request sees its channel close when the controller dies and exits
//! (`serve`). During a run it does not read the channel: a guest spinning in a loop would go on
//! burning a core until the run's own deadline (up to an hour over HTTP). So while a run is on,
//! the channel is armed for signal-driven I/O (O_ASYNC, owner this process, F_SETSIG): the kernel
//! sends [`signal`] when the peer hangs up, and the handler ends the process with SIGKILL (its
//! guest processes follow: see `process::on_parent_death`).
//!
//! Why not PR_SET_PDEATHSIG: a sandbox's VMM is usually a child of its template's zygote, which
//! may go away while the sandbox lives on, and the death signal of a launched VMM fires when the
//! controller's *thread* that started it ends (any Python worker thread). The channel belongs to
//! the controller process itself. Why only during runs: the controller writes nothing on the
//! channel while it waits for a run's reply, so the signal means a hang-up there; between runs a
//! request arriving would raise it too, interrupting whatever the VMM was doing.

use std::sync::atomic::{AtomicI32, Ordering};

/// fcntl(2)'s F_SETSIG (Linux; the libc crate does not name it).
const F_SETSIG: libc::c_int = 10;

/// The channel armed now (-1: none).
static ARMED: AtomicI32 = AtomicI32::new(-1);
/// The process that last set itself as the channel's owner (a fork must set it again).
static OWNER: AtomicI32 = AtomicI32::new(0);

/// The signal the kernel sends when an armed channel's peer hangs up.
pub(super) fn signal() -> libc::c_int {
    libc::SIGRTMIN() + 5
}

/// Whether the channel on `fd` has lost its peer (the controller closed it or died).
fn hung_up(fd: libc::c_int) -> bool {
    let mut p = libc::pollfd { fd, events: libc::POLLRDHUP, revents: 0 };
    // SAFETY: poll on one pollfd we own, without waiting.
    let n = unsafe { libc::poll(&mut p, 1, 0) };
    n == 1 && p.revents & (libc::POLLHUP | libc::POLLRDHUP | libc::POLLERR) != 0
}

extern "C" fn on_hangup(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let fd = ARMED.load(Ordering::SeqCst);
    if fd >= 0 && hung_up(fd) {
        // SAFETY: kill and getpid are async-signal-safe.
        unsafe { libc::kill(libc::getpid(), libc::SIGKILL) };
    }
}

/// Before a run: have the kernel signal this process if the channel on `fd` hangs up, and end
/// the process now if it already has.
pub(super) fn arm(fd: libc::c_int) {
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    if OWNER.swap(me, Ordering::SeqCst) != me {
        // SAFETY: a zeroed sigaction is valid; we fill handler, flags and an empty mask. The
        // fcntls act on our own channel descriptor.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_hangup as *const () as usize;
            sa.sa_flags = libc::SA_SIGINFO | libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            libc::sigaction(signal(), &sa, std::ptr::null_mut());
            libc::fcntl(fd, F_SETSIG, signal());
            libc::fcntl(fd, libc::F_SETOWN, me);
        }
    }
    ARMED.store(fd, Ordering::SeqCst);
    set_async(fd, true);
    on_hangup(0, std::ptr::null_mut(), std::ptr::null_mut());
}

/// After a run, before its reply: requests arriving on the channel raise nothing.
pub(super) fn disarm() {
    let fd = ARMED.swap(-1, Ordering::SeqCst);
    if fd >= 0 {
        set_async(fd, false);
    }
}

/// In a new guest process (a fork during a run): the channel is not its own (it closes its copy),
/// and the file's owner stays the process that armed it.
pub(super) fn forget() {
    ARMED.store(-1, Ordering::SeqCst);
}

fn set_async(fd: libc::c_int, on: bool) {
    // SAFETY: F_GETFL/F_SETFL on our own channel descriptor.
    unsafe {
        let flags = libc::fcntl(fd, libc::F_GETFL);
        if flags >= 0 {
            let want = if on { flags | libc::O_ASYNC } else { flags & !libc::O_ASYNC };
            if want != flags {
                libc::fcntl(fd, libc::F_SETFL, want);
            }
        }
    }
}
