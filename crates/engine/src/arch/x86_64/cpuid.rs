//! The CPU template: the CPUID a sandbox template's guests see, recorded in its snapshot and given
//! to every clone.
//!
//! A program asks CPUID which instructions it may use, once, and picks its code paths by the
//! answer: glibc's string functions (an AVX2, EVEX or RTM variant of `memcpy`), numpy's SIMD
//! dispatch, OpenSSL. A template baked on one CPU model and cloned on another would give its
//! clones other answers, so the same seed would run other code. So the CPUID is fixed when the
//! template's first process starts ([`CpuTemplate::of_host`]), stored with the snapshot
//! (`persist::SnapshotState::cpu`), and every VM restored from it, forked from it or reset gets
//! exactly those entries with `KVM_SET_CPUID2` whatever the host it runs on. A host that lacks a
//! feature the template says the guest has cannot run it: [`CpuTemplate::check`] refuses the
//! restore with what is missing and what to do.
//!
//! # The baseline
//!
//! The entries are the host's `KVM_GET_SUPPORTED_CPUID` with these features cleared
//! ([`BASELINE_CLEARED`]):
//! * **RDRAND, RDSEED**: hardware randomness the engine cannot trap or replay; hidden, a program
//!   that checks CPUID draws its randomness from the sandbox CRNG instead (docs/replay.md).
//! * **AVX-512 (every subset), AMX**: on upstream KVM their register state is not enabled in the
//!   guest's XCR0 (x87, SSE, AVX only: `vmm::XCR0`), so the guest cannot use them; advertised,
//!   they would only make a template demand them of every host it is cloned on. (Under kvm_pvm
//!   the guest's `xgetbv` reads the host's XCR0 and AVX-512 runs: see below.)
//! * **HLE, RTM** (TSX): present or not on one CPU model depending on microcode and the host
//!   kernel's `tsx=`; glibc picks its `*_rtm` string functions by it.
//! * **WAITPKG** (`umwait`, `tpause`): waits bounded by the TSC, which a replay does not
//!   reproduce.
//!
//! and leaf 2 as [`super::regs::cache_descriptors`] gives it. The other features stay: a
//! template asks for what its baking host had, and the check compares only the feature leaves
//! ([`FEATURE_REGS`]) a program dispatches on; family, model and cache leaves are the template's
//! on every host.
//!
//! # kvm_pvm
//!
//! Under kvm_pvm (probe: `tests/cpu_template.rs`) CPUID executed in ring 3 exits, but the
//! feature registers (leaf 1 ECX/EDX, leaf 7 EBX/ECX/EDX) are the host CPU's whatever
//! `KVM_SET_CPUID2` says (less a few kvm_pvm removes: PCID, INVPCID, ...), RDRAND and RDSEED
//! included; the other registers (family and model, leaf 0xd, 0x80000001) are `KVM_SET_CPUID2`'s.
//! Its XCR0 is the host's too, so numpy there dispatches to AVX-512 on an AVX-512 host
//! (`tests/test_cpus.py`).
//! The template then records what the host CPU shows there too ([`CpuTemplate::unfiltered`]), and
//! a clone on a kvm_pvm host whose CPU shows other features is refused, since nothing could hide
//! the difference.

use kvm_bindings::{kvm_cpuid_entry2, CpuId, KVM_MAX_CPUID_ENTRIES};
use serde::{Deserialize, Serialize};

/// One CPUID entry as `KVM_SET_CPUID2` takes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Leaf {
    pub function: u32,
    pub index: u32,
    pub flags: u32,
    pub regs: [u32; 4],
}

/// Register numbers in [`Leaf::regs`].
pub const EAX: usize = 0;
pub const EBX: usize = 1;
pub const ECX: usize = 2;
pub const EDX: usize = 3;

/// The CPUID of a template's guests (see the module docs).
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct CpuTemplate {
    /// What `KVM_SET_CPUID2` gets, on every host.
    pub entries: Vec<Leaf>,
    /// On a host whose ring-3 CPUID is not filtered (kvm_pvm), the feature registers
    /// ([`FEATURE_REGS`]) the host CPU answers, which the guest sees instead of `entries`'.
    pub unfiltered: Option<Vec<Leaf>>,
}

/// (leaf, sub-leaf, register, bit, name) of every feature the baseline clears.
pub const BASELINE_CLEARED: &[(u32, u32, usize, u32, &str)] = &[
    (1, 0, ECX, 30, "rdrand"),
    (7, 0, EBX, 4, "hle"),
    (7, 0, EBX, 11, "rtm"),
    (7, 0, EBX, 16, "avx512f"),
    (7, 0, EBX, 17, "avx512dq"),
    (7, 0, EBX, 18, "rdseed"),
    (7, 0, EBX, 21, "avx512ifma"),
    (7, 0, EBX, 26, "avx512pf"),
    (7, 0, EBX, 27, "avx512er"),
    (7, 0, EBX, 28, "avx512cd"),
    (7, 0, EBX, 30, "avx512bw"),
    (7, 0, EBX, 31, "avx512vl"),
    (7, 0, ECX, 1, "avx512vbmi"),
    (7, 0, ECX, 5, "waitpkg"),
    (7, 0, ECX, 6, "avx512_vbmi2"),
    (7, 0, ECX, 11, "avx512_vnni"),
    (7, 0, ECX, 12, "avx512_bitalg"),
    (7, 0, ECX, 14, "avx512_vpopcntdq"),
    (7, 0, EDX, 2, "avx512_4vnniw"),
    (7, 0, EDX, 3, "avx512_4fmaps"),
    (7, 0, EDX, 8, "avx512_vp2intersect"),
    (7, 0, EDX, 22, "amx_bf16"),
    (7, 0, EDX, 23, "avx512_fp16"),
    (7, 0, EDX, 24, "amx_tile"),
    (7, 0, EDX, 25, "amx_int8"),
    (7, 1, EAX, 5, "avx512_bf16"),
];

/// The registers holding the features programs dispatch on: (leaf, sub-leaf, register).
pub const FEATURE_REGS: &[(u32, u32, usize)] = &[
    (1, 0, ECX),
    (1, 0, EDX),
    (7, 0, EBX),
    (7, 0, ECX),
    (7, 0, EDX),
    (7, 1, EAX),
    (0xd, 1, EAX),
    (0x8000_0001, 0, ECX),
    (0x8000_0001, 0, EDX),
];

/// Names of common feature bits, for the refusal's message: (leaf, sub-leaf, register, bit, name).
const NAMES: &[(u32, u32, usize, u32, &str)] = &[
    (1, 0, ECX, 0, "sse3"),
    (1, 0, ECX, 1, "pclmulqdq"),
    (1, 0, ECX, 9, "ssse3"),
    (1, 0, ECX, 12, "fma"),
    (1, 0, ECX, 13, "cx16"),
    (1, 0, ECX, 19, "sse4_1"),
    (1, 0, ECX, 20, "sse4_2"),
    (1, 0, ECX, 22, "movbe"),
    (1, 0, ECX, 23, "popcnt"),
    (1, 0, ECX, 25, "aes"),
    (1, 0, ECX, 26, "xsave"),
    (1, 0, ECX, 28, "avx"),
    (1, 0, ECX, 29, "f16c"),
    (1, 0, EDX, 25, "sse"),
    (1, 0, EDX, 26, "sse2"),
    (7, 0, EBX, 3, "bmi1"),
    (7, 0, EBX, 5, "avx2"),
    (7, 0, EBX, 8, "bmi2"),
    (7, 0, EBX, 9, "erms"),
    (7, 0, EBX, 19, "adx"),
    (7, 0, EBX, 29, "sha_ni"),
    (7, 0, ECX, 8, "gfni"),
    (7, 0, ECX, 9, "vaes"),
    (7, 0, ECX, 10, "vpclmulqdq"),
    (7, 0, ECX, 22, "rdpid"),
    (7, 0, EDX, 4, "fsrm"),
    (7, 1, EAX, 4, "avx_vnni"),
    (0xd, 1, EAX, 0, "xsaveopt"),
    (0xd, 1, EAX, 1, "xsavec"),
    (0x8000_0001, 0, ECX, 5, "lzcnt"),
    (0x8000_0001, 0, ECX, 6, "sse4a"),
    (0x8000_0001, 0, EDX, 27, "rdtscp"),
];

fn feature_name(function: u32, index: u32, reg: usize, bit: u32) -> String {
    NAMES
        .iter()
        .chain(BASELINE_CLEARED)
        .find(|n| (n.0, n.1, n.2, n.3) == (function, index, reg, bit))
        .map(|n| n.4.to_string())
        .unwrap_or_else(|| format!("cpuid {function:#x}.{index} {} bit {bit}", ["eax", "ebx", "ecx", "edx"][reg]))
}

/// Why a template's CPU cannot be given on this host.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum Mismatch {
    #[error("this host's CPU lacks {}, which the template's guests were given; bake the template again on this host, or bake it where the CPU has no more than this one's", .0.join(", "))]
    Missing(Vec<String>),
    #[error("under kvm_pvm the guest sees the host CPU's features, and this CPU shows other ones than the template's ({}); bake the template again on this host", .0.join(", "))]
    Unfiltered(Vec<String>),
}

impl CpuTemplate {
    /// This host's template: its supported CPUID less the baseline; under `unfiltered_ring3`
    /// (kvm_pvm) with the host CPU's feature registers too.
    pub fn of_host(kvm: &kvm_ioctls::Kvm, unfiltered_ring3: bool) -> Result<CpuTemplate, kvm_ioctls::Error> {
        let supported = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES)?;
        let mut t = CpuTemplate::from_supported(supported.as_slice());
        if unfiltered_ring3 {
            t.unfiltered = Some(host_feature_leaves());
        }
        Ok(t)
    }

    /// The template of a host whose `KVM_GET_SUPPORTED_CPUID` is `supported`.
    pub fn from_supported(supported: &[kvm_cpuid_entry2]) -> CpuTemplate {
        let descriptors = if std::env::var_os("COLLIMATE_CPUID_LEAF2").is_some_and(|v| v == "host") {
            None
        } else {
            super::regs::cache_descriptors(supported)
        };
        let entries = supported
            .iter()
            .map(|e| {
                let mut l = Leaf { function: e.function, index: e.index, flags: e.flags, regs: [e.eax, e.ebx, e.ecx, e.edx] };
                for &(f, i, r, bit, _) in BASELINE_CLEARED {
                    if (l.function, l.index) == (f, i) {
                        l.regs[r] &= !(1 << bit);
                    }
                }
                if let (2, Some((eax, ebx, ecx))) = (l.function, descriptors) {
                    l.regs = [eax, ebx, ecx, 0];
                }
                l
            })
            .collect();
        CpuTemplate { entries, unfiltered: None }
    }

    /// The entries as `KVM_SET_CPUID2` takes them.
    pub fn to_kvm(&self) -> Result<CpuId, String> {
        let entries: Vec<kvm_cpuid_entry2> = self
            .entries
            .iter()
            .map(|l| kvm_cpuid_entry2 {
                function: l.function,
                index: l.index,
                flags: l.flags,
                eax: l.regs[EAX],
                ebx: l.regs[EBX],
                ecx: l.regs[ECX],
                edx: l.regs[EDX],
                ..Default::default()
            })
            .collect();
        CpuId::from_entries(&entries).map_err(|e| format!("a CPU template of {} CPUID entries: {e:?}", entries.len()))
    }

    /// One register of one leaf (0 where the leaf is absent).
    pub fn reg(entries: &[Leaf], function: u32, index: u32, reg: usize) -> u32 {
        entries.iter().find(|l| l.function == function && l.index == index).map_or(0, |l| l.regs[reg])
    }

    /// Whether this template's guests can run on the host whose own template is `host`: every
    /// feature of [`FEATURE_REGS`] the template gives is one the host supports and, where the
    /// host's ring-3 CPUID is not filtered, the host CPU shows the template's features exactly.
    pub fn check(&self, host: &CpuTemplate) -> Result<(), Mismatch> {
        let missing = missing_bits(&self.entries, &host.entries);
        if !missing.is_empty() {
            return Err(Mismatch::Missing(missing));
        }
        if let Some(here) = &host.unfiltered {
            let there = self.unfiltered.as_deref().unwrap_or(&self.entries);
            let mut diff = missing_bits(there, here);
            diff.extend(missing_bits(here, there).into_iter().map(|n| format!("+{n}")));
            if !diff.is_empty() {
                return Err(Mismatch::Unfiltered(diff));
            }
        }
        Ok(())
    }
}

/// Names of the features [`FEATURE_REGS`] sets in `want` and not in `have`.
fn missing_bits(want: &[Leaf], have: &[Leaf]) -> Vec<String> {
    let mut out = Vec::new();
    for &(f, i, r) in FEATURE_REGS {
        let lack = CpuTemplate::reg(want, f, i, r) & !CpuTemplate::reg(have, f, i, r);
        for bit in 0..32 {
            if lack & (1 << bit) != 0 {
                out.push(feature_name(f, i, r, bit));
            }
        }
    }
    out
}

/// The feature leaves as this (host) process's CPUID answers them.
fn host_feature_leaves() -> Vec<Leaf> {
    let mut leaves: Vec<Leaf> = Vec::new();
    for &(f, i, _) in FEATURE_REGS {
        if leaves.iter().any(|l| (l.function, l.index) == (f, i)) {
            continue;
        }
        let r = std::arch::x86_64::__cpuid_count(f, i);
        leaves.push(Leaf { function: f, index: i, flags: 0, regs: [r.eax, r.ebx, r.ecx, r.edx] });
    }
    // Bits that follow the guest's own state, not the CPU: OSXSAVE (CR4), the APIC id.
    for l in &mut leaves {
        if (l.function, l.index) == (1, 0) {
            l.regs[ECX] &= !(1 << 27);
        }
    }
    leaves
}

#[cfg(test)]
mod tests {
    use super::*;

    fn leaf(function: u32, index: u32, regs: [u32; 4]) -> kvm_cpuid_entry2 {
        kvm_cpuid_entry2 { function, index, eax: regs[0], ebx: regs[1], ecx: regs[2], edx: regs[3], ..Default::default() }
    }

    fn host() -> Vec<kvm_cpuid_entry2> {
        vec![leaf(1, 0, [0xa10f11, 0, 0x7ed8_3203, 0x178b_fbff]), leaf(7, 0, [1, 0xf1bf_07ab, 0x0040_5fc6, 0x10])]
    }

    #[test]
    fn the_baseline_hides_rdrand_rdseed_avx512_and_tsx() {
        let t = CpuTemplate::from_supported(&host());
        assert_eq!(CpuTemplate::reg(&t.entries, 1, 0, ECX) & (1 << 30), 0);
        let b7 = CpuTemplate::reg(&t.entries, 7, 0, EBX);
        for bit in [4, 11, 16, 17, 18, 21, 28, 30, 31] {
            assert_eq!(b7 & (1 << bit), 0, "bit {bit}");
        }
        assert_ne!(b7 & (1 << 5), 0, "avx2 stays");
        assert_eq!(t.to_kvm().unwrap().as_slice().len(), 2);
    }

    #[test]
    fn a_host_without_a_feature_of_the_template_is_refused_by_name() {
        let t = CpuTemplate::from_supported(&host());
        assert_eq!(t.check(&t.clone()), Ok(()));
        let mut older = host();
        older[1].ebx &= !(1 << 5); // no AVX2
        older[0].ecx &= !(1 << 28); // no AVX
        let err = t.check(&CpuTemplate::from_supported(&older)).unwrap_err();
        assert_eq!(err, Mismatch::Missing(vec!["avx".into(), "avx2".into()]));
        assert!(err.to_string().contains("bake the template again on this host"), "{err}");
        // More features on the new host are hidden: the clone sees the template's.
        assert_eq!(CpuTemplate::from_supported(&older).check(&t), Ok(()));
    }

    #[test]
    fn under_an_unfiltered_ring3_the_host_cpu_must_show_the_same_features() {
        let mut t = CpuTemplate::from_supported(&host());
        t.unfiltered = Some(vec![Leaf { function: 7, index: 0, flags: 0, regs: [0, 0x20, 0, 0] }]);
        let mut here = t.clone();
        assert_eq!(t.check(&here), Ok(()));
        here.unfiltered = Some(vec![Leaf { function: 7, index: 0, flags: 0, regs: [0, 0x120, 0, 0] }]);
        assert_eq!(t.check(&here), Err(Mismatch::Unfiltered(vec!["+bmi2".into()])));
    }
}
