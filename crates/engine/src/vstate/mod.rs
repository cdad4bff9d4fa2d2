//! Generic KVM wrappers: guest memory, the VM and its vCPU state.
pub mod memory;
pub mod profile;
pub mod shared;
pub mod sync;
pub mod tlb;
pub mod vcpu;
pub mod vm;
