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

/// Ring 0's code and data segments (what `syscall` loads from STAR), for entering a stub.
pub fn kernel_code_segment() -> kvm_segment {
    kvm_segment { selector: KERNEL_CS, dpl: 0, ..user_code_segment() }
}

pub fn kernel_data_segment() -> kvm_segment {
    kvm_segment { selector: KERNEL_DS, dpl: 0, ..user_data_segment() }
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
///
/// On Intel, leaf 2's cache descriptors are given explicitly (see [`cache_descriptors`]);
/// `COLLIMATE_CPUID_LEAF2=host` keeps the host's, to compare.
pub fn filter_cpuid(cpuid: &mut CpuId) {
    let host_leaf2 = std::env::var_os("COLLIMATE_CPUID_LEAF2").is_some_and(|v| v == "host");
    let descriptors = if host_leaf2 { None } else { cache_descriptors(cpuid.as_slice()) };
    for e in cpuid.as_mut_slice() {
        if e.function == 1 {
            e.ecx &= !(1 << 30); // RDRAND
        }
        if e.function == 7 && e.index == 0 {
            e.ebx &= !(1 << 18); // RDSEED
        }
        if let (2, Some((eax, ebx, ecx))) = (e.function, descriptors) {
            (e.eax, e.ebx, e.ecx, e.edx) = (eax, ebx, ecx, 0);
        }
    }
}

/// Leaf 2 descriptors (`(size, descriptor)`, 64-byte lines) for each cache, from the table glibc
/// and the Intel SDM share, smallest first.
const L1D_DESCRIPTORS: &[(u64, u8)] = &[(16 << 10, 0x0d), (24 << 10, 0x0e), (32 << 10, 0x2c)];
const L1I_DESCRIPTORS: &[(u64, u8)] = &[(32 << 10, 0x30)];
const L2_DESCRIPTORS: &[(u64, u8)] =
    &[(128 << 10, 0x39), (256 << 10, 0x21), (512 << 10, 0x7b), (1 << 20, 0x7c), (2 << 20, 0x7d), (3 << 20, 0x48), (6 << 20, 0x4e)];
const L3_DESCRIPTORS: &[(u64, u8)] = &[
    (512 << 10, 0xd0),
    (1 << 20, 0xd1),
    (2 << 20, 0xd2),
    (4 << 20, 0xe3),
    (8 << 20, 0xe4),
    (12 << 20, 0xea),
    (18 << 20, 0xeb),
    (24 << 20, 0xec),
];

/// Leaf 2 (EAX, EBX, ECX) naming the caches of leaf 4 with explicit descriptors, where the host's
/// leaf 2 says "see leaf 4" (descriptor 0xff, every recent Intel CPU); None otherwise.
///
/// Why: glibc's start-up (every static program, and ld.so for every dynamic one) asks for a dozen
/// cache parameters, and with 0xff each one walks leaf 4 from sub-leaf 0 until it finds its
/// level: about 37 CPUID instructions, each a VM exit under kvm_pvm (~30-40 us), 1.3 ms of every
/// program start (busybox `sh` makes 67 CPUIDs in all). With descriptors each parameter is one
/// leaf-2 CPUID. Each cache gets the largest descriptor not above its leaf-4 size (the guest's
/// sysconf cache sizes become those); leaf 4 itself is unchanged (glibc still reads it for the
/// threads sharing a cache).
pub fn cache_descriptors(entries: &[kvm_bindings::kvm_cpuid_entry2]) -> Option<(u32, u32, u32)> {
    let leaf2 = entries.iter().find(|e| e.function == 2)?;
    let has_ff = [leaf2.eax & !0xff, leaf2.ebx, leaf2.ecx, leaf2.edx]
        .iter()
        .any(|&r| r & 0x8000_0000 == 0 && r.to_le_bytes().contains(&0xff));
    if !has_ff {
        return None;
    }
    let mut sizes = [0u64; 4]; // L1d, L1i, L2, L3
    for e in entries.iter().filter(|e| e.function == 4) {
        let (kind, level) = (e.eax & 0x1f, (e.eax >> 5) & 7);
        let size = (((e.ebx >> 22) + 1) as u64) * ((((e.ebx >> 12) & 0x3ff) + 1) as u64) * (((e.ebx & 0xfff) + 1) as u64) * (e.ecx as u64 + 1);
        let slot = match (level, kind) {
            (1, 1) => 0,
            (1, 2) => 1,
            (2, _) => 2,
            (3, _) => 3,
            _ => continue,
        };
        sizes[slot] = size;
    }
    let pick = |table: &[(u64, u8)], size: u64| -> u32 {
        if size == 0 {
            return 0;
        }
        table.iter().rev().find(|(s, _)| *s <= size).or(table.first()).map_or(0, |&(_, d)| d as u32)
    };
    let (l1d, l1i, l2, l3) =
        (pick(L1D_DESCRIPTORS, sizes[0]), pick(L1I_DESCRIPTORS, sizes[1]), pick(L2_DESCRIPTORS, sizes[2]), pick(L3_DESCRIPTORS, sizes[3]));
    // EAX's low byte: one round of leaf 2. 0xf0: 64-byte prefetching; 0xfe: TLBs in leaf 0x18 (as
    // the host says).
    Some((1 | l1d << 8 | l1i << 16 | l2 << 24, 0xf0 | l3 << 8, 0xfe))
}

#[cfg(test)]
mod tests {
    use super::*;
    use kvm_bindings::kvm_cpuid_entry2;

    fn leaf(function: u32, index: u32, eax: u32, ebx: u32, ecx: u32) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 { function, index, eax, ebx, ecx, ..Default::default() }
    }

    /// The development host's leaves 2 and 4: 48 KiB L1d, 64 KiB L1i, 2 MiB L2, 480 MiB L3.
    fn host() -> Vec<kvm_cpuid_entry2> {
        vec![
            leaf(2, 0, 0x00fe_ff01, 0xf0, 0),
            leaf(4, 0, 0x0400_0121, 0x02c0_003f, 0x3f),
            leaf(4, 1, 0x0400_0122, 0x03c0_003f, 0x3f),
            leaf(4, 2, 0x0400_0143, 0x03c0_003f, 0x7ff),
            leaf(4, 3, 0x0400_4163, 0x03c0_003f, 0x77fff),
            leaf(4, 4, 0, 0, 0),
        ]
    }

    #[test]
    fn leaf2_names_each_cache_without_leaf4() {
        let (eax, ebx, ecx) = cache_descriptors(&host()).expect("0xff in leaf 2");
        // 32 KiB L1d (0x2c), 32 KiB L1i (0x30), 2 MiB L2 (0x7d), 24 MiB L3 (0xec).
        assert_eq!(eax, 0x7d30_2c01);
        assert_eq!(ebx, 0xecf0);
        assert_eq!(ecx, 0xfe);
        for r in [eax >> 8, ebx, ecx] {
            assert!(!r.to_le_bytes().contains(&0xff), "no 'see leaf 4' left: {r:#x}");
        }
    }

    #[test]
    fn leaf2_kept_without_0xff() {
        let mut e = host();
        e[0].eax = 0x0001_2c01; // explicit descriptors already (or an AMD host's zeros)
        assert_eq!(cache_descriptors(&e), None);
        e[0].eax = 0;
        assert_eq!(cache_descriptors(&e), None);
    }

    #[test]
    fn small_caches_take_the_smallest_descriptor() {
        let mut e = host();
        e[3].ecx = 0x3f; // 64 KiB L2: below every L2 descriptor
        let (eax, _, _) = cache_descriptors(&e).unwrap();
        assert_eq!(eax >> 24, 0x39);
    }
}
