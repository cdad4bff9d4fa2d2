//! Where the stub keeps its own things in the guest's address space.
//!
//! One fixed range below the guest's vDSO and above where guestos places mappings (its `MMAP_TOP`
//! grows down, the program interpreter sits just above it): the guest never asks for it unless it
//! maps with `MAP_FIXED` there, which the VMM refuses. Fixed, so that a fork and a replay see the
//! same layout.

/// Start of the reserved range.
pub const STUB_BASE: u64 = 0x7fff_fe00_0000;
/// The blob's code, read and execute.
pub const CODE: u64 = STUB_BASE;
/// The longest blob the code area holds.
pub const CODE_LEN: u64 = 0x1000;
/// The page shared with the VMM (a memfd mapped `MAP_SHARED` on both sides).
pub const SHARED: u64 = STUB_BASE + 0x1000;
/// Its length.
pub const SHARED_LEN: u64 = 0x1000;
/// The alternate signal stack: every trap's signal frame (with the guest's XSAVE area) lives here.
pub const ALT_STACK: u64 = STUB_BASE + 0x2000;
/// Its length: a frame with AVX-512 state is under 4 KiB; the handler uses a few hundred bytes.
pub const ALT_STACK_LEN: u64 = 0x10000;
/// The stack the blob's entry code runs on before the first trap.
pub const BOOT_STACK: u64 = ALT_STACK + ALT_STACK_LEN;
/// Its length.
pub const BOOT_STACK_LEN: u64 = 0x1000;
/// Where a patched syscall site's entry saves the guest's XSAVE area (`patch.rs`): the same
/// layout as a signal frame's, so [`super::Stub::xsave`] reads it as one. Mapped at the first patch.
pub const XSAVE_BUF: u64 = BOOT_STACK + BOOT_STACK_LEN;
/// Its length (an XSAVE area with every user component this host has fits).
pub const XSAVE_BUF_LEN: u64 = 0x4000;
/// The trampolines of patched syscall sites (`patch.rs`), read and execute; mapped at the first
/// patch, inherited by forks.
pub const TRAMP: u64 = XSAVE_BUF + XSAVE_BUF_LEN;
/// Its length.
pub const TRAMP_LEN: u64 = 0x1_0000;
/// End of the reserved range (exclusive); room for per-thread stacks later.
pub const STUB_END: u64 = STUB_BASE + 0x10_0000;
/// The end of user space on x86-64 with 4-level paging (Linux's TASK_SIZE).
pub const TASK_SIZE: u64 = 0x7fff_ffff_f000;
/// The fd number of the stub's end of its socket to the VMM.
pub const SOCK_FD: i32 = 3;

const _: () = assert!(TRAMP + TRAMP_LEN <= STUB_END);
const _: () = assert!(STUB_END <= crate::guestos::vdso::VDSO_VA);
const _: () = assert!(STUB_BASE >= crate::guestos::mm::MMAP_TOP + (64 << 20));

/// Whether `[addr, addr+len)` overlaps the reserved range (or wraps).
pub fn touches_reserved(addr: u64, len: u64) -> bool {
    match addr.checked_add(len) {
        Some(end) => addr < STUB_END && end > STUB_BASE,
        None => true,
    }
}
