//! The GDT, IDT, TSS and the ring-0 trap stubs.
//!
//! Ring 0 is emulated instruction by instruction under kvm_pvm (about 700 ns each), so every stub is
//! a single `out` that exits to the host; the host reads the trap frame and returns to ring 3 itself
//! (a guest `sysretq` ends in a shutdown under kvm_pvm).

use super::layout::*;

const GDT_ENTRIES: usize = 7;

/// The bytes of the supervisor area (guest-physical 0..SUPERVISOR_AREA), ready to copy into memory.
pub fn supervisor_area() -> Vec<u8> {
    let mut area = vec![0u8; SUPERVISOR_AREA as usize];
    let put64 = |area: &mut Vec<u8>, at: u64, v: u64| {
        area[at as usize..at as usize + 8].copy_from_slice(&v.to_le_bytes())
    };

    // GDT: null, kernel code, kernel data, user data, user code, 16-byte TSS descriptor.
    let tss_base = kva(TSS_GPA);
    let tss_limit: u64 = TSS_LIMIT;
    let gdt: [u64; GDT_ENTRIES] = [
        0,
        // Accessed bits preset: the CPU never needs to write the (read-only mapped) GDT.
        0x0020_9b00_0000_0000, // 64-bit code, DPL 0
        0x0000_9300_0000_0000, // data, DPL 0
        0x0000_f300_0000_0000, // data, DPL 3
        0x0020_fb00_0000_0000, // 64-bit code, DPL 3
        (tss_limit & 0xffff)
            | ((tss_base & 0xff_ffff) << 16)
            | (0x89u64 << 40)
            | (((tss_base >> 24) & 0xff) << 56),
        tss_base >> 32,
    ];
    for (i, d) in gdt.iter().enumerate() {
        put64(&mut area, GDT_GPA + 8 * i as u64, *d);
    }

    // TSS: RSP0 at offset 4 is where the CPU switches to on a trap from ring 3.
    put64(&mut area, TSS_GPA + 4, kva(RING0_STACK_TOP_GPA));
    // I/O bitmap right after the TSS, all zero (every port allowed: the only devices are the host's),
    // and the terminating 0xff byte the CPU may read past the last port.
    area[(TSS_GPA + 0x66) as usize..(TSS_GPA + 0x68) as usize].copy_from_slice(&0x68u16.to_le_bytes());
    area[(TSS_GPA + TSS_LIMIT) as usize] = 0xff;

    // Stubs and IDT gates.
    for v in 0..256u64 {
        let stub = if v < 32 { STUBS_GPA + v * STUB_SIZE } else { STUBS_GPA + 32 * STUB_SIZE };
        if v <= 32 {
            let port = if v < 32 { VECTOR_PORT_BASE + v as u16 } else { SPURIOUS_PORT };
            // out imm8, al ; jmp $ (never reached: the host resumes the guest elsewhere)
            area[stub as usize..stub as usize + 4].copy_from_slice(&[0xe6, port as u8, 0xeb, 0xfe]);
        }
        let h = kva(stub);
        // Interrupt gates, DPL 0 except #BP and #OF, which ring 3 may raise with int3/into.
        let attr: u64 = if v == 3 || v == 4 { 0xee } else { 0x8e };
        let lo = (h & 0xffff) | ((KERNEL_CS as u64) << 16) | (attr << 40) | (((h >> 16) & 0xffff) << 48);
        put64(&mut area, IDT_GPA + v * 16, lo);
        put64(&mut area, IDT_GPA + v * 16 + 8, h >> 32);
    }
    let sc = (STUBS_GPA + SYSCALL_STUB_OFFSET) as usize;
    area[sc..sc + 4].copy_from_slice(&[0xe6, SYSCALL_PORT as u8, 0xeb, 0xfe]);
    let fl = (STUBS_GPA + FLUSH_STUB_OFFSET) as usize;
    area[fl..fl + FLUSH_STUB_LEN].copy_from_slice(&flush_stub());
    area
}

/// Bytes of the guest-TLB flush stub (see [`FLUSH_STUB_OFFSET`]).
pub const FLUSH_STUB_LEN: usize = 18;

/// The guest-TLB flush stub, entered in ring 0 with RSP at its `iretq` frame:
/// `lock inc qword [rip + count]; push rax; mov rax, cr3; mov cr3, rax; pop rax; iretq`.
/// Without CR4.PCIDE and CR4.PGE (`regs::initial_sregs`), writing CR3 invalidates every TLB entry
/// and paging-structure cache of the guest, which is what the architecture guarantees; no exit.
pub fn flush_stub() -> [u8; FLUSH_STUB_LEN] {
    let stub = STUBS_GPA + FLUSH_STUB_OFFSET;
    let disp = (FLUSH_COUNT_GPA as i64 - (stub as i64 + 8)) as i32;
    let mut b = [0u8; FLUSH_STUB_LEN];
    b[..4].copy_from_slice(&[0xf0, 0x48, 0xff, 0x05]);
    b[4..8].copy_from_slice(&disp.to_le_bytes());
    b[8..].copy_from_slice(&[0x50, 0x0f, 0x20, 0xd8, 0x0f, 0x22, 0xd8, 0x58, 0x48, 0xcf]);
    b
}

pub const GDT_LIMIT: u16 = (GDT_ENTRIES * 8 - 1) as u16;
pub const IDT_LIMIT: u16 = (256 * 16 - 1) as u16;

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn stubs_exit_on_their_port() {
        let a = supervisor_area();
        let s = (STUBS_GPA + 14 * STUB_SIZE) as usize;
        assert_eq!(&a[s..s + 2], &[0xe6, 0x4e]);
        let sc = (STUBS_GPA + SYSCALL_STUB_OFFSET) as usize;
        assert_eq!(&a[sc..sc + 2], &[0xe6, 0x3f]);
    }

    #[test]
    fn the_flush_stub_counts_itself_reloads_cr3_and_returns() {
        let a = supervisor_area();
        let fl = (STUBS_GPA + FLUSH_STUB_OFFSET) as usize;
        let b = &a[fl..fl + FLUSH_STUB_LEN];
        // The RIP-relative count lands on FLUSH_COUNT_GPA (disp counted from the next instruction).
        let disp = i32::from_le_bytes(b[4..8].try_into().unwrap()) as i64;
        assert_eq!((STUBS_GPA + FLUSH_STUB_OFFSET + 8) as i64 + disp, FLUSH_COUNT_GPA as i64);
        assert_eq!(&b[9..15], &[0x0f, 0x20, 0xd8, 0x0f, 0x22, 0xd8]); // mov rax, cr3; mov cr3, rax
        assert_eq!(&b[16..], &[0x48, 0xcf]); // iretq
        assert!(FLUSH_FRAME_GPA + 40 <= RING0_STACK_TOP_GPA && FLUSH_COUNT_GPA + 8 < FLUSH_FRAME_GPA - 64);
    }
}
