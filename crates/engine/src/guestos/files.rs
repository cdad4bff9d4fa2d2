//! The guest's file descriptor table and the file syscalls.

use super::{Ctx, GuestOs, SysResult};

/// The fd table.
#[derive(Default)]
pub struct Files {}

/// Handle a file syscall; `None` if `nr` is not one of ours.
pub fn dispatch(_os: &mut GuestOs, _ctx: &mut Ctx, _nr: u64, _a: [u64; 6]) -> Option<SysResult> {
    None
}
