//! The kvm platform's memory, as syscall handlers reach it: guest-physical memory, the frames
//! handed out of it, and the page tables the engine keeps for the guest (see the platform docs
//! in `platform` for where the rest of this platform lives).

use crate::arch::x86_64::layout::PAGE_SIZE;
use crate::arch::x86_64::paging::{AddressSpace, FrameAllocator};
use crate::vstate::memory::GuestMemory;

/// Guest memory, its frame allocator and the guest's page tables.
pub struct Memory<'a> {
    pub mem: &'a mut GuestMemory,
    pub frames: &'a mut FrameAllocator,
    pub aspace: &'a AddressSpace,
}

impl<'a> Memory<'a> {
    pub fn new(mem: &'a mut GuestMemory, frames: &'a mut FrameAllocator, aspace: &'a AddressSpace) -> Memory<'a> {
        Memory { mem, frames, aspace }
    }

    /// The frames handed out and not given back, in bytes.
    pub fn used(&self) -> u64 {
        self.frames.next.saturating_sub(self.frames.free.len() as u64 * PAGE_SIZE)
    }
}
