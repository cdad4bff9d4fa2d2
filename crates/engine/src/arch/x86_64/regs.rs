//! The initial vCPU state of a ring-3 guest, the MSRs we carry in snapshots, and the CPUID we expose.

use kvm_bindings::{kvm_regs, kvm_segment, kvm_sregs, CpuId};

use super::layout::*;
use super::tables::{GDT_LIMIT, IDT_LIMIT};

pub const MSR_IA32_TSC: u32 = 0x10;
pub const MSR_IA32_SYSENTER_CS: u32 = 0x174;
pub const MSR_IA32_SYSENTER_ESP: u32 = 0x175;
pub const MSR_IA32_SYSENTER_EIP: u32 = 0x176;
pub const MSR_IA32_CR_PAT: u32 = 0x277;
pub const MSR_STAR: u32 = 0xc000_0081;
pub const MSR_LSTAR: u32 = 0xc000_0082;
pub const MSR_CSTAR: u32 = 0xc000_0083;
pub const MSR_SYSCALL_MASK: u32 = 0xc000_0084;
pub const MSR_FS_BASE: u32 = 0xc000_0100;
pub const MSR_GS_BASE: u32 = 0xc000_0101;
pub const MSR_KERNEL_GS_BASE: u32 = 0xc000_0102;
pub const MSR_TSC_AUX: u32 = 0xc000_0103;

/// The MSRs a snapshot carries, in restore order. TSC comes first so that anything derived from it
/// (a TSC deadline, were there a LAPIC) would be restored against the right clock.
pub const SNAPSHOT_MSRS: &[u32] = &[
    MSR_IA32_TSC,
    MSR_IA32_SYSENTER_CS,
    MSR_IA32_SYSENTER_ESP,
    MSR_IA32_SYSENTER_EIP,
    MSR_IA32_CR_PAT,
    MSR_STAR,
    MSR_LSTAR,
    MSR_CSTAR,
    MSR_SYSCALL_MASK,
    MSR_FS_BASE,
    MSR_GS_BASE,
    MSR_KERNEL_GS_BASE,
    MSR_TSC_AUX,
];

const CR0_PE: u64 = 1;
const CR0_MP: u64 = 1 << 1;
const CR0_ET: u64 = 1 << 4;
const CR0_NE: u64 = 1 << 5;
const CR0_WP: u64 = 1 << 16;
const CR0_PG: u64 = 1 << 31;
const CR4_PAE: u64 = 1 << 5;
const CR4_OSFXSR: u64 = 1 << 9;
const CR4_OSXMMEXCPT: u64 = 1 << 10;
const CR4_OSXSAVE: u64 = 1 << 18;
const EFER_SCE: u64 = 1;
const EFER_LME: u64 = 1 << 8;
const EFER_LMA: u64 = 1 << 10;
const EFER_NXE: u64 = 1 << 11;

/// RFLAGS of a fresh guest: IF (bit 9), reserved bit 1, and IOPL 3 so ring-3 `out` exits straight to
/// the host as a port-I/O exit (the only devices are ours).
pub const INITIAL_RFLAGS: u64 = 0x3202;
/// Flags cleared on `syscall` entry: TF, IF, DF, AC.
pub const SYSCALL_MASK: u64 = 0x100 | 0x200 | 0x400 | 0x4_0000;

pub fn user_code_segment() -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: USER_CS,
        type_: 11,
        present: 1,
        dpl: 3,
        db: 0,
        s: 1,
        l: 1,
        g: 1,
        ..Default::default()
    }
}

pub fn user_data_segment() -> kvm_segment {
    kvm_segment {
        base: 0,
        limit: 0xffff_ffff,
        selector: USER_DS,
        type_: 3,
        present: 1,
        dpl: 3,
        db: 1,
        s: 1,
        l: 0,
        g: 1,
        ..Default::default()
    }
}

/// Special registers for long mode, ring 3, with our descriptor tables.
pub fn initial_sregs(mut s: kvm_sregs, pml4: u64) -> kvm_sregs {
    s.cs = user_code_segment();
    let ds = user_data_segment();
    s.ds = ds;
    s.es = ds;
    s.fs = ds;
    s.gs = ds;
    s.ss = ds;
    s.gdt.base = kva(GDT_GPA);
    s.gdt.limit = GDT_LIMIT;
    s.idt.base = kva(IDT_GPA);
    s.idt.limit = IDT_LIMIT;
    s.tr = kvm_segment {
        base: kva(TSS_GPA),
        limit: TSS_LIMIT as u32,
        selector: TSS_SEL,
        type_: 11,
        present: 1,
        ..Default::default()
    };
    s.cr3 = pml4;
    s.cr0 = CR0_PE | CR0_MP | CR0_ET | CR0_NE | CR0_WP | CR0_PG;
    s.cr4 = CR4_PAE | CR4_OSFXSR | CR4_OSXMMEXCPT | CR4_OSXSAVE;
    s.efer = EFER_SCE | EFER_LME | EFER_LMA | EFER_NXE;
    s
}

/// MSR values of a fresh guest: the syscall entry points at the syscall stub.
pub fn initial_msrs() -> Vec<(u32, u64)> {
    vec![
        (MSR_STAR, ((KERNEL_DS as u64) << 48) | ((KERNEL_CS as u64) << 32)),
        (MSR_LSTAR, kva(STUBS_GPA + SYSCALL_STUB_OFFSET)),
        (MSR_CSTAR, kva(STUBS_GPA + SYSCALL_STUB_OFFSET)),
        (MSR_SYSCALL_MASK, SYSCALL_MASK),
        (MSR_FS_BASE, 0),
        (MSR_GS_BASE, 0),
        (MSR_KERNEL_GS_BASE, 0),
    ]
}

pub fn initial_regs(entry: u64, rsp: u64) -> kvm_regs {
    kvm_regs { rip: entry, rsp, rflags: INITIAL_RFLAGS, ..Default::default() }
}

/// The CPUID the guest is given: the host's supported set without RDRAND and RDSEED, so that
/// randomness comes from the host (note: under kvm_pvm, CPUID executed in ring 3 is not filtered).
pub fn filter_cpuid(cpuid: &mut CpuId) {
    for e in cpuid.as_mut_slice() {
        if e.function == 1 {
            e.ecx &= !(1 << 30); // RDRAND
        }
        if e.function == 7 && e.index == 0 {
            e.ebx &= !(1 << 18); // RDSEED
        }
    }
}
