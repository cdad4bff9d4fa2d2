//! Generic KVM wrappers: guest memory, the VM and its vCPU state.
pub mod memory;
pub mod vcpu;
pub mod vm;
