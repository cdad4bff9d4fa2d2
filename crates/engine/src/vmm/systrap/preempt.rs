//! Stopping a systrap guest that computes: the run's deadline and the guest's own timers.
//!
//! The KVM loop arms a one-shot POSIX timer (`vstate::vcpu::Preempter`) at the earlier of the run's
//! deadline and the next guest timer's; its handler sets `immediate_exit`. The same timer serves a
//! systrap process: while its guest runs, the stub is registered as the one to kick
//! (`guestos::signal::host::set_kick_stub`), so the handler, the carrier of signals from other
//! guest processes and the scheduler's tick all stop it (`platform::systrap::preempt`). A guest
//! spinning in `while True` then gets its SIGALRM within the timer's precision, a signal from its
//! parent or sibling at once, and a run's timeout ends it resumably at the deadline instead of the
//! watchdog killing its stub.

use std::sync::Mutex;
use std::time::Duration;

use crate::error::Result;
use crate::guestos::signal::host;
use crate::platform::systrap::{preempt::KICK_SIGNAL, Stub};
use crate::vstate::vcpu::Preempter;

/// This process's timer. POSIX timers are not inherited across fork: a forked VMM process makes
/// its own (the parent's id means nothing there and is forgotten, not deleted).
struct Timer {
    owner: i32,
    timer: Preempter,
}

// SAFETY: a POSIX timer id is a process-wide handle that any thread may arm or delete.
unsafe impl Send for Timer {}

static TIMER: Mutex<Option<Timer>> = Mutex::new(None);

fn with_timer<T>(f: impl FnOnce(&Preempter) -> Result<T>) -> Result<T> {
    let mut g = TIMER.lock().unwrap_or_else(|p| p.into_inner());
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    if g.as_ref().is_some_and(|t| t.owner != me) {
        if let Some(old) = g.take() {
            std::mem::forget(old.timer);
        }
    }
    if g.is_none() {
        *g = Some(Timer { owner: me, timer: Preempter::new()? });
    }
    match g.as_ref() {
        Some(t) => f(&t.timer),
        None => unreachable!("the timer was just made"),
    }
}

/// While a systrap guest runs: its stub is the one kicks stop, and the timer is armed.
pub(super) struct Running;

impl Running {
    /// Register `stub` for kicks and arm the timer for `after` (the run's time left).
    pub(super) fn enter(stub: &Stub, after: Duration) -> Result<Running> {
        host::set_kick_stub(Some((stub.kick_fd(), KICK_SIGNAL)));
        let r = Running;
        arm(after)?;
        Ok(r)
    }
}

impl Drop for Running {
    fn drop(&mut self) {
        host::set_kick_stub(None);
        let _ = with_timer(|t| t.disarm());
    }
}

/// Kick the running stub after `after` (rearming replaces the last deadline).
pub(super) fn arm(after: Duration) -> Result<()> {
    with_timer(|t| t.arm(after))
}
