//! What differs between the KVM hosts the engine runs on: the one place that says so.
//!
//! Every mechanism that depends on how the host's KVM behaves asks [`current`] instead of assuming
//! the development hosts' `kvm_pvm`. The profile is detected once per process, before the jail
//! hides `/sys` (`vmm::jail::enter`), and forks inherit it.
//!
//! # The hosts
//! * **kvm_pvm** (paravirtual, pagetable-based: no VMX/SVM in the CPU; our development and CI
//!   machines). Shadow paging; ring 0 emulated; every exit tens of microseconds.
//! * **kvm_intel / kvm_amd with two-dimensional paging** (EPT/NPT; bare metal, and most cloud VMs
//!   with nested virtualization). The guest's TLB is tagged (VPID/ASID) and kept across exits.
//! * **kvm_intel / kvm_amd with shadow paging** (`ept=0` / `npt=0`, or a CPU without it).
//!
//! Nested: whether the KVM host is itself a virtual machine (CPUID leaf 1, ECX bit 31, "hypervisor
//! present", as the host process sees it). kvm_pvm is always nested in practice.
//!
//! # The differences, each with its evidence
//! | what | kvm_pvm | upstream, TDP | upstream, shadow | evidence |
//! |---|---|---|---|---|
//! | RIP at a `KVM_EXIT_IO` for `out`/`in` | past the instruction | at it: KVM completes it on the next `KVM_RUN` | same as TDP | `tests/vm.rs` `registers_and_ymm_survive_snapshot_restore_bit_for_bit` (lane: `Io { port: 224 }` without [`Profile::io_completes_on_next_run`]); `scripts/kvm-lane/probe.c` prints RIP at the first exit |
//! | a host edit that narrows a guest translation | dropped by KVM's MMU notifier ([`vstate::tlb`](super::tlb)) | the guest's own TLB keeps it: the ring-0 flush stub reloads CR3 on the next entry, [`FlushMethod`] | as kvm_pvm | `tests/tlb.rs` on kvm_pvm and in the lane with `npt=0`; `tests/flush_contract.rs` on every host (the stub's count) |
//! | a #PF the page tables already allow | a stale shadow entry | a real TLB's stale entry after a widening | as kvm_pvm | `vmm::Machine::spurious_fault` |
//! | `KVM_SET_SREGS` with the same CR3 | flushes nothing (shadow roots kept) | flushes only if CR0/CR3/CR4/EFER change | as TDP | `vstate::tlb`'s table (kvm_pvm); KVM's `__set_sregs` |
//! | CPUID executed in ring 3 | not filtered: the host CPU answers | filtered by `KVM_SET_CPUID2` | filtered | `arch::x86_64::regs::filter_cpuid` |
//! | cost of one exit | 20-55 us | about 1-3 us on bare metal | more (shadow faults exit) | docs/spawn.md, `collimate doctor` |
//!
//! `COLLIMATE_KVM_PROFILE` (`kvm_pvm`, `tdp`, `shadow`) overrides the detection: to take the
//! upstream paths on a kvm_pvm machine in tests, or to correct a host this module misreads.

use std::path::Path;
use std::sync::OnceLock;

/// Which KVM module the host runs.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Kind {
    Pvm,
    Intel,
    Amd,
    /// `/sys/module` said nothing we know (or was not readable): treated as upstream KVM, whose
    /// paths are correct on every host, only slower on kvm_pvm.
    Unknown,
}

/// How the host's KVM translates guest-physical addresses.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Paging {
    /// KVM shadows the guest's page tables (kvm_pvm, `ept=0`/`npt=0`).
    Shadow,
    /// EPT (Intel) or NPT (AMD): the guest walks its own page tables in hardware.
    Tdp,
}

/// How a translation the host removed or narrowed leaves the guest (see `vstate::tlb`).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum FlushMethod {
    /// Drop KVM's shadow entries through its MMU notifier (an mprotect pair, or a slot replaced):
    /// the shadow page tables are the only cache of guest translations.
    HostZap,
    /// The shadow zap as well, and the guest's own TLB must drop the entry: under TDP a host edit
    /// of a guest page table is invisible to KVM, and the tagged TLB keeps the old translation.
    HostZapAndGuestTlb,
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Profile {
    pub kind: Kind,
    pub paging: Paging,
    /// Whether the KVM host itself runs in a virtual machine; `None` where it cannot be told.
    pub nested: Option<bool>,
    /// Where the profile came from: `sysfs`, or `COLLIMATE_KVM_PROFILE`.
    pub source: &'static str,
}

impl Profile {
    /// Whether, at a `KVM_EXIT_IO`, the vCPU's RIP is still at the I/O instruction, to be moved
    /// past it by the next `KVM_RUN` (upstream KVM's `complete_userspace_io`). Then any state
    /// saved or overwritten before that run must first be completed with a `KVM_RUN` with
    /// `immediate_exit = 1` (the KVM API documentation's remedy): a snapshot would otherwise store
    /// RIP at the `out`, and its restore would execute it again. kvm_pvm has moved RIP already.
    pub fn io_completes_on_next_run(&self) -> bool {
        self.kind != Kind::Pvm
    }

    /// What a host edit that removes, narrows or redirects a guest translation needs before the
    /// guest runs again.
    pub fn flush_method(&self) -> FlushMethod {
        match self.paging {
            Paging::Shadow => FlushMethod::HostZap,
            Paging::Tdp => FlushMethod::HostZapAndGuestTlb,
        }
    }

    /// Whether CPUID executed by the guest in ring 3 gets the answers of `KVM_SET_CPUID2`.
    pub fn cpuid_filtered(&self) -> bool {
        self.kind != Kind::Pvm
    }

    /// A short name: `kvm_pvm`, `kvm_amd/npt`, `kvm_intel/shadow`...
    pub fn name(&self) -> String {
        let module = match self.kind {
            Kind::Pvm => return "kvm_pvm".into(),
            Kind::Intel => "kvm_intel",
            Kind::Amd => "kvm_amd",
            Kind::Unknown => "kvm",
        };
        let paging = match (self.kind, self.paging) {
            (_, Paging::Shadow) => "shadow",
            (Kind::Intel, Paging::Tdp) => "ept",
            (Kind::Amd, Paging::Tdp) => "npt",
            _ => "tdp",
        };
        format!("{module}/{paging}")
    }
}

/// This process's profile, detected at the first call.
pub fn current() -> &'static Profile {
    static PROFILE: OnceLock<Profile> = OnceLock::new();
    PROFILE.get_or_init(|| {
        let nested = host_is_virtual();
        match std::env::var("COLLIMATE_KVM_PROFILE") {
            Ok(v) if !v.is_empty() => overridden(&v, nested),
            _ => detect(Path::new("/sys/module"), nested),
        }
    })
}

/// The profile `COLLIMATE_KVM_PROFILE` names; an unknown value is reported and ignored.
fn overridden(v: &str, nested: Option<bool>) -> Profile {
    let (kind, paging) = match v {
        "kvm_pvm" | "pvm" => (Kind::Pvm, Paging::Shadow),
        "tdp" => (Kind::Unknown, Paging::Tdp),
        "shadow" => (Kind::Unknown, Paging::Shadow),
        _ => {
            eprintln!("collimate: COLLIMATE_KVM_PROFILE={v:?} is not kvm_pvm, tdp or shadow; detecting instead");
            return detect(Path::new("/sys/module"), nested);
        }
    };
    Profile { kind, paging, nested, source: "COLLIMATE_KVM_PROFILE" }
}

/// The profile `/sys/module` (or a directory laid out like it) describes.
pub fn detect(sys_module: &Path, nested: Option<bool>) -> Profile {
    let param = |module: &str, name: &str| -> Option<String> {
        std::fs::read_to_string(sys_module.join(module).join("parameters").join(name)).ok().map(|s| s.trim().to_owned())
    };
    let yes = |v: Option<String>| v.is_some_and(|v| matches!(v.as_str(), "Y" | "y" | "1"));
    let (kind, paging) = if sys_module.join("kvm_pvm").exists() {
        (Kind::Pvm, Paging::Shadow)
    } else if sys_module.join("kvm_intel").exists() {
        (Kind::Intel, if yes(param("kvm_intel", "ept")) { Paging::Tdp } else { Paging::Shadow })
    } else if sys_module.join("kvm_amd").exists() {
        (Kind::Amd, if yes(param("kvm_amd", "npt")) { Paging::Tdp } else { Paging::Shadow })
    } else {
        // Correct everywhere (see `Kind::Unknown`): TDP asks for the most.
        (Kind::Unknown, Paging::Tdp)
    };
    Profile { kind, paging, nested, source: "sysfs" }
}

/// CPUID leaf 1, ECX bit 31: set by every hypervisor for its guests.
fn host_is_virtual() -> Option<bool> {
    #[cfg(target_arch = "x86_64")]
    {
        let r = std::arch::x86_64::__cpuid(1);
        Some(r.ecx & (1 << 31) != 0)
    }
    #[cfg(not(target_arch = "x86_64"))]
    None
}

/// The median cost of one exit to this process and back on this host: a real-mode guest that
/// runs `out` in a loop, `samples` of them (`collimate doctor`; every figure names the host it was
/// measured on, [`Profile::name`]).
pub fn exit_cost(samples: usize) -> Result<std::time::Duration, String> {
    use kvm_bindings::kvm_userspace_memory_region;
    use kvm_ioctls::{Kvm, VcpuExit};
    let kvm = Kvm::new().map_err(|e| format!("open /dev/kvm: {e}"))?;
    let vm = kvm.create_vm().map_err(|e| format!("KVM_CREATE_VM: {e}"))?;
    // SAFETY: a fresh anonymous shared mapping of one page, checked below; unmapped on return
    // after the VM that maps it is dropped.
    let page = unsafe {
        libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
    };
    if page == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    struct Unmap(*mut libc::c_void);
    impl Drop for Unmap {
        fn drop(&mut self) {
            // SAFETY: the page mapped above, no longer in any VM (dropped before this guard).
            unsafe { libc::munmap(self.0, 4096) };
        }
    }
    let _unmap = Unmap(page);
    const LOOP: [u8; 4] = [0xe6, 0xe0, 0xeb, 0xfc]; // 1: out 0xe0, al; jmp 1b
    // SAFETY: `page` is 4096 writable bytes.
    unsafe { std::ptr::copy_nonoverlapping(LOOP.as_ptr(), page.cast::<u8>(), LOOP.len()) };
    let region = kvm_userspace_memory_region { slot: 0, flags: 0, guest_phys_addr: 0x1000, memory_size: 4096, userspace_addr: page as u64 };
    // SAFETY: the region is our live mapping, which outlives the VM (`_unmap` drops last).
    unsafe { vm.set_user_memory_region(region) }.map_err(|e| format!("KVM_SET_USER_MEMORY_REGION: {e}"))?;
    let mut vcpu = vm.create_vcpu(0).map_err(|e| format!("KVM_CREATE_VCPU: {e}"))?;
    let mut sregs = vcpu.get_sregs().map_err(|e| format!("KVM_GET_SREGS: {e}"))?;
    sregs.cs.base = 0;
    sregs.cs.selector = 0;
    vcpu.set_sregs(&sregs).map_err(|e| format!("KVM_SET_SREGS: {e}"))?;
    let regs = kvm_bindings::kvm_regs { rip: 0x1000, rflags: 2, ..Default::default() };
    vcpu.set_regs(&regs).map_err(|e| format!("KVM_SET_REGS: {e}"))?;
    let mut times = Vec::with_capacity(samples.max(1));
    for _ in 0..samples.max(1) + 1 {
        let t = std::time::Instant::now();
        match vcpu.run() {
            Ok(VcpuExit::IoOut(..)) => times.push(t.elapsed()),
            other => return Err(format!("the exit probe stopped with {other:?}")),
        }
    }
    times.remove(0); // the first run maps the page
    times.sort_unstable();
    Ok(times[times.len() / 2])
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A directory laid out like /sys/module, removed on drop.
    struct Sys(std::path::PathBuf);
    impl Sys {
        fn path(&self) -> &Path {
            &self.0
        }
    }
    impl Drop for Sys {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }

    fn sys(files: &[(&str, &str)]) -> Sys {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let d = Sys(std::env::temp_dir().join(format!("collimate-profile-{}-{n}", std::process::id())));
        std::fs::create_dir_all(d.path()).unwrap();
        for (path, value) in files {
            let p = d.path().join(path);
            std::fs::create_dir_all(p.parent().unwrap()).unwrap();
            std::fs::write(p, value).unwrap();
        }
        d
    }

    #[test]
    fn kvm_pvm_is_shadow_paging_with_rip_past_the_out() {
        let d = sys(&[("kvm_pvm/refcnt", "1\n"), ("kvm/parameters/tdp_mmu", "N\n")]);
        let p = detect(d.path(), Some(true));
        assert_eq!((p.kind, p.paging), (Kind::Pvm, Paging::Shadow));
        assert!(!p.io_completes_on_next_run());
        assert_eq!(p.flush_method(), FlushMethod::HostZap);
        assert_eq!(p.name(), "kvm_pvm");
    }

    #[test]
    fn upstream_modules_read_their_paging_parameter() {
        let amd = detect(sys(&[("kvm_amd/parameters/npt", "1\n")]).path(), Some(false));
        assert_eq!((amd.kind, amd.paging, amd.name().as_str()), (Kind::Amd, Paging::Tdp, "kvm_amd/npt"));
        assert!(amd.io_completes_on_next_run());
        assert_eq!(amd.flush_method(), FlushMethod::HostZapAndGuestTlb);
        let amd0 = detect(sys(&[("kvm_amd/parameters/npt", "0\n")]).path(), None);
        assert_eq!((amd0.paging, amd0.name().as_str()), (Paging::Shadow, "kvm_amd/shadow"));
        assert_eq!(amd0.flush_method(), FlushMethod::HostZap);
        let intel = detect(sys(&[("kvm_intel/parameters/ept", "Y\n")]).path(), Some(true));
        assert_eq!((intel.kind, intel.paging, intel.name().as_str()), (Kind::Intel, Paging::Tdp, "kvm_intel/ept"));
        let intel0 = detect(sys(&[("kvm_intel/parameters/ept", "N\n")]).path(), None);
        assert_eq!(intel0.paging, Paging::Shadow);
    }

    #[test]
    fn an_unreadable_sysfs_takes_the_paths_correct_everywhere() {
        let p = detect(sys(&[]).path(), None);
        assert_eq!(p.kind, Kind::Unknown);
        assert!(p.io_completes_on_next_run());
        assert_eq!(p.flush_method(), FlushMethod::HostZapAndGuestTlb);
    }

    #[test]
    fn the_override_names_a_profile() {
        assert_eq!(overridden("tdp", None).paging, Paging::Tdp);
        assert_eq!(overridden("kvm_pvm", None).kind, Kind::Pvm);
        assert_eq!(overridden("shadow", None).source, "COLLIMATE_KVM_PROFILE");
    }
}
