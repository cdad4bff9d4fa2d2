//! Identity, time, randomness, limits, signal bookkeeping, thread-area setup.

use super::{Ctx, GuestOs, SysResult};

/// Process identity and per-process settings.
#[derive(Default)]
pub struct Proc {
    /// The guest's current directory (a normalised guest path).
    pub cwd: String,
}

/// Handle a miscellaneous syscall; `None` if `nr` is not one of ours.
pub fn dispatch(_os: &mut GuestOs, _ctx: &mut Ctx, _nr: u64, _a: [u64; 6]) -> Option<SysResult> {
    None
}
