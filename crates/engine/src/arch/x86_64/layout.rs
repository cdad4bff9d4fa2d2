//! Where things live in guest-physical and guest-virtual memory.
//!
//! Guest-physical memory starts with a small supervisor area (descriptor tables, trap stubs and the
//! ring-0 stack), mapped only at `KERNEL_BASE` in the higher half and never with the user bit. Everything
//! from `FRAME_POOL_START` up is handed out page by page for page tables and user pages.

/// Size of a guest page.
pub const PAGE_SIZE: u64 = 4096;
/// Higher-half virtual address where guest-physical 0 of the supervisor area is mapped.
pub const KERNEL_BASE: u64 = 0xffff_ff80_0000_0000;
/// Guest-physical addresses of the supervisor area.
pub const GDT_GPA: u64 = 0x1000;
pub const IDT_GPA: u64 = 0x2000;
pub const STUBS_GPA: u64 = 0x3000;
/// The TSS and its I/O permission bitmap (0x68 + 8 KiB + 1 bytes).
pub const TSS_GPA: u64 = 0x4000;
/// The TSS limit covers the I/O bitmap: under kvm_pvm the stubs run with CPL 3 semantics for I/O
/// permission (IOPL cleared), so their `out` needs the bitmap to allow the port.
pub const TSS_LIMIT: u64 = 0x68 + 8192;
/// The ring-0 stack: exception frames are pushed below `RING0_STACK_TOP_GPA`.
pub const RING0_STACK_TOP_GPA: u64 = 0x10000;
/// Bytes of guest-physical memory mapped as the supervisor area.
pub const SUPERVISOR_AREA: u64 = 0x10000;
/// Pages of ring-0 stack below `RING0_STACK_TOP_GPA`.
pub const RING0_STACK_PAGES: u64 = 4;
/// First guest-physical page handed out for page tables and user memory.
pub const FRAME_POOL_START: u64 = 0x20_0000;
/// The smallest guest memory we accept.
pub const MIN_MEM_SIZE: u64 = 16 << 20;

/// Size of a large page (a page-directory entry with PS set).
pub const HUGE_PAGE: u64 = 2 << 20;
/// Bytes at the top of guest memory kept for large-page copies of read-only program text (see
/// `paging::AddressSpace::promote`), in memories of at least [`HUGE_REGION_MIN_MEM`].
pub const HUGE_REGION: u64 = 8 << 20;
pub const HUGE_REGION_MIN_MEM: u64 = 128 << 20;

/// The large-page region of a guest memory of `mem_size` bytes: [start, end), 2 MiB aligned, or
/// `None` for a memory too small to spare it. Frames below `start` are the ordinary pool.
pub const fn huge_region(mem_size: u64) -> Option<(u64, u64)> {
    if mem_size < HUGE_REGION_MIN_MEM {
        return None;
    }
    let start = (mem_size - HUGE_REGION) & !(HUGE_PAGE - 1);
    Some((start, start + HUGE_REGION))
}

/// Each IDT vector `v` points at a stub `out (VECTOR_PORT_BASE + v), al` for v < 32.
pub const VECTOR_PORT_BASE: u16 = 0x40;
/// Vectors >= 32 (nothing should raise them) share one stub on this port.
pub const SPURIOUS_PORT: u16 = 0x3e;
/// The `syscall` entry stub (LSTAR) executes `out SYSCALL_PORT, al`.
pub const SYSCALL_PORT: u16 = 0x3f;
/// Bytes per IDT stub.
pub const STUB_SIZE: u64 = 8;
/// Offset of the syscall stub inside the stub page.
pub const SYSCALL_STUB_OFFSET: u64 = 0x800;

/// Offset of the guest-TLB flush stub inside the stub page (see `vstate::tlb`, hosts with
/// EPT/NPT): it counts itself at [`FLUSH_COUNT_GPA`], reloads CR3 and `iretq`s to the frame the host
/// left at [`FLUSH_FRAME_GPA`].
pub const FLUSH_STUB_OFFSET: u64 = 0xc00;
/// Where the flush stub's `iretq` frame (RIP, CS, RFLAGS, RSP, SS) is written: near the top of the
/// ring-0 stack, which nothing else uses while the guest runs in ring 3.
pub const FLUSH_FRAME_GPA: u64 = RING0_STACK_TOP_GPA - 64;
/// A 64-bit count of the flush stub's runs, at the bottom of the ring-0 stack.
pub const FLUSH_COUNT_GPA: u64 = RING0_STACK_TOP_GPA - RING0_STACK_PAGES * PAGE_SIZE;

/// GDT selectors. `STAR` is built so that `syscall` loads KERNEL_CS/KERNEL_DS and `sysret` would load
/// USER_CS/USER_DS (we return from the host instead, see `vstate::vcpu`).
pub const KERNEL_CS: u16 = 0x08;
pub const KERNEL_DS: u16 = 0x10;
pub const USER_DS: u16 = 0x18 | 3;
pub const USER_CS: u16 = 0x20 | 3;
pub const TSS_SEL: u16 = 0x28;

/// Top of the initial user stack and its size.
pub const STACK_TOP: u64 = 0x7fff_ffff_f000;
pub const STACK_SIZE: u64 = 1 << 20;

/// Guest virtual address of a supervisor-area guest-physical address.
pub const fn kva(gpa: u64) -> u64 {
    KERNEL_BASE + gpa
}

/// Which exception vectors push an error code.
pub fn has_error_code(vector: u8) -> bool {
    matches!(vector, 8 | 10 | 11 | 12 | 13 | 14 | 17 | 21 | 29 | 30)
}
