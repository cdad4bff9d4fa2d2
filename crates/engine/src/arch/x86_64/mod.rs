//! x86-64: the guest-physical layout, descriptor tables and trap stubs, page tables, and the initial
//! register state of a ring-3 guest with no guest kernel.
pub mod cpuid;
pub mod layout;
pub mod paging;
pub mod regs;
pub mod tables;
