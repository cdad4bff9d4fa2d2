//! The guest address space as the guest sees it (mmap, munmap, mprotect, brk, mremap).

use super::{Ctx, GuestOs, SysResult};

/// Virtual memory areas of the guest process.
#[derive(Default)]
pub struct Mm {}

/// Handle a memory-management syscall; `None` if `nr` is not one of ours.
pub fn dispatch(_os: &mut GuestOs, _ctx: &mut Ctx, _nr: u64, _a: [u64; 6]) -> Option<SysResult> {
    None
}
