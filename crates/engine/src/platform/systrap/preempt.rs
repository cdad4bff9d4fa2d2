//! Preemption: stopping a stub that runs guest code at its next instruction boundary, as a tick
//! timer kicks a vCPU out of `KVM_RUN`.
//!
//! A guest that computes without syscalls or faults never traps, so the VMM would not hear from its
//! stub until it does. A *kick* is one host signal, [`KICK_SIGNAL`], sent to the stub process
//! through its pidfd ([`Stub::kick`], or [`kick_raw`] from a signal handler of the VMM). The stub
//! handles it like its traps (`confine`'s signal setup: the blob's handler on the alternate stack,
//! every signal blocked while it runs): the handler copies the interrupted guest's registers, FS
//! base and XSAVE address to the shared page and hands the turn over, and [`Stub::run`] returns
//! [`Exit::Interrupted`](super::Exit::Interrupted) with the guest's state at that boundary. Running
//! again resumes it there.
//!
//! A kick that arrives while the stub is already parked in its handler (it trapped meanwhile, or
//! the VMM has the turn) stays pending in the stub, blocked by the handler's mask, and fires when the
//! handler returns to guest code: the next `run` then comes back at once with `Interrupted`
//! before the guest executes an instruction. That is `immediate_exit`'s rule on KVM, and it closes
//! the race between "the VMM decides to stop the guest" and "the guest trapped anyway": a kick is
//! never lost, at worst answered by one empty round trip. Kicks coalesce (a standard signal is
//! pending at most once). A forked stub starts with none pending (fork clears them).
//!
//! The signal is not one the host kernel sends on its own to the stub (no interval timers there:
//! `setitimer` and `timer_create` are not among the blob's admitted syscalls), and guest code cannot
//! send host signals (every guest syscall traps), so `Interrupted` always means the VMM's kick.

use std::os::fd::{AsRawFd, RawFd};

use super::{Error, Result, Stub};

/// The host signal that stops a running stub.
pub const KICK_SIGNAL: i32 = libc::SIGVTALRM;

/// `si_code` of a signal sent by a process (`SI_USER`), as a kick is.
pub(super) const SI_USER: i32 = 0;

impl Stub {
    /// Stop the guest code this stub runs at its next instruction boundary: the current (or next)
    /// [`Stub::run`] returns [`Exit::Interrupted`](super::Exit::Interrupted). See the module docs.
    pub fn kick(&self) -> Result<()> {
        if kick_raw(self.pidfd.as_raw_fd()) {
            Ok(())
        } else {
            Err(Error::Host { call: "pidfd_send_signal (kick)", source: std::io::Error::last_os_error() })
        }
    }

    /// The descriptor [`kick_raw`] takes for this stub (valid while the `Stub` lives), for a VMM's
    /// signal handler that must kick whichever stub runs.
    pub fn kick_fd(&self) -> RawFd {
        self.pidfd.as_raw_fd()
    }
}

/// Kick the stub whose pidfd is `pidfd` ([`Stub::kick_fd`]). Async-signal-safe (one syscall);
/// false if the host refused (the stub is gone).
pub fn kick_raw(pidfd: RawFd) -> bool {
    // SAFETY: pidfd_send_signal with no siginfo on a descriptor the caller vouches for; a
    // descriptor that is not a pidfd only makes the call fail.
    unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd, KICK_SIGNAL, 0usize, 0u32) == 0 }
}
