//! Loading a Linux program: ELF (static or dynamic, PIE or not), its interpreter, the initial stack.

use super::{Errno, GuestOs, ENOSYS};
use crate::arch::x86_64::paging::{AddressSpace, FrameAllocator};
use crate::vstate::memory::GuestMemory;

/// Where the loaded program starts.
#[derive(Debug, Clone, Copy)]
pub struct Image {
    pub entry: u64,
    pub rsp: u64,
}

/// Load the program at guest path `path` (resolved through `os.vfs`) into a fresh address space,
/// with its interpreter if it has one, and build the initial stack from `argv` and `envp`.
pub fn load(
    _os: &mut GuestOs,
    _mem: &mut GuestMemory,
    _frames: &mut FrameAllocator,
    _aspace: &AddressSpace,
    _path: &[u8],
    _argv: &[Vec<u8>],
    _envp: &[Vec<u8>],
) -> Result<Image, Errno> {
    Err(ENOSYS)
}
