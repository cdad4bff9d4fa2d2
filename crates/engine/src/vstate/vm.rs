//! A KVM VM over a [`GuestMemory`] mapping, with dirty logging on.

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::{Kvm, VmFd};

use super::memory::GuestMemory;
use crate::error::{Error, Result};

pub struct KvmVm {
    pub fd: VmFd,
}

impl KvmVm {
    /// A new VM whose slot 0 is the whole of `mem`. Called again in every forked child: a KVM VM is
    /// tied to the address space that created it, so a child cannot use its parent's.
    pub fn new(kvm: &Kvm, mem: &GuestMemory) -> Result<KvmVm> {
        // KVM_CREATE_VM fails with EINTR when a signal arrives meanwhile: a guest process forked
        // by a parent that exits at once (`sh -c 'job &'`) gets its parent-death signal here, and
        // used to die at birth. It is retried (the signal's handler has run by then).
        let mut tries = 0;
        let fd = loop {
            match kvm.create_vm() {
                Err(e) if e.errno() == libc::EINTR && tries < 100 => tries += 1,
                r => break r.map_err(Error::kvm("KVM_CREATE_VM"))?,
            }
        };
        let region = kvm_userspace_memory_region {
            slot: 0,
            flags: KVM_MEM_LOG_DIRTY_PAGES,
            guest_phys_addr: 0,
            memory_size: mem.size(),
            userspace_addr: mem.host_addr(),
        };
        // SAFETY: the region is our live mapping of `mem.size()` bytes, which outlives the VM (both are
        // owned by the same `Machine`, the VM is dropped first).
        unsafe { fd.set_user_memory_region(region) }.map_err(Error::kvm("KVM_SET_USER_MEMORY_REGION"))?;
        Ok(KvmVm { fd })
    }

    /// Guest-written pages since the last call (KVM clears its log as it hands it over).
    pub fn take_dirty_log(&self, mem_size: u64) -> Result<Vec<u64>> {
        self.fd.get_dirty_log(0, mem_size as usize).map_err(Error::kvm("KVM_GET_DIRTY_LOG"))
    }
}
