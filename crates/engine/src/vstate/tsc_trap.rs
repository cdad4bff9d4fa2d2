//! `rdtsc` and `rdtscp` in ring 3, trapped in replay mode so that the guest reads the virtual clock.
//!
//! The time-stamp counter is the host CPU's: a program that reads it directly (a benchmark
//! harness, a hash seeded from it, a JIT's timing) would see other values in every replay. With
//! CR4.TSD set, `rdtsc` and `rdtscp` outside ring 0 raise #GP; the engine's #GP stub exits to the
//! VMM like every exception, which recognises the instruction at RIP, answers it from the virtual
//! clock ([`crate::guestos::clock::tsc_now`]) and moves past it. Outside replay mode CR4.TSD is
//! clear and the counter is read natively (no exit).
//!
//! # What each host does ([`Trap`], from `vstate::profile`)
//! * **Upstream KVM** (kvm_intel, kvm_amd): the guest's CR4.TSD is the CPU's while the guest
//!   runs (VMX and SVM both honour it without an exit): [`Trap::GuestCr4`].
//! * **kvm_pvm**: the guest runs in the host's ring 3 under the host's CR4, so the guest's CR4.TSD
//!   alone changes nothing (probe: `tests/cpu_template.rs`). With the VMM thread's own TSD set as
//!   well (`prctl(PR_SET_TSC, PR_TSC_SIGSEGV)`) the hardware faults and kvm_pvm gives the guest the
//!   #GP its CR4 asks for. That setting must be off whenever the VMM itself runs (its clock reads
//!   go through the vDSO, which runs `rdtsc`), so it is set and cleared around every `KVM_RUN`:
//!   two CR4 writes, which cost about 13 us each on our (nested) kvm_pvm hosts, as much as the
//!   exit itself. So it is opt-in there, `COLLIMATE_TRAP_RDTSC=1` ([`Trap::GuestCr4AndHostThread`]);
//!   by default kvm_pvm reads the counter natively ([`Trap::Off`]) and docs/replay.md says what
//!   that leaves out.

/// CR4.TSD: `rdtsc`/`rdtscp` outside ring 0 raise #GP.
pub const CR4_TSD: u64 = 1 << 2;

/// How this host traps ring-3 `rdtsc` (module docs).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Trap {
    /// Not trapped: the guest reads the host's counter.
    Off,
    /// The guest's CR4.TSD.
    GuestCr4,
    /// The guest's CR4.TSD and the VMM thread's for the length of each `KVM_RUN` (kvm_pvm).
    GuestCr4AndHostThread,
}

/// Whether `COLLIMATE_TRAP_RDTSC=1` asks for the trap where it costs (kvm_pvm); read once per
/// process (asked before every `KVM_RUN`).
pub fn opted_in() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_TRAP_RDTSC").is_some_and(|v| v == "1"))
}

/// The VMM thread's own TSD while a guest that traps `rdtsc` runs on kvm_pvm: set by
/// [`HostTsd::enter`], cleared on drop (before the VMM reads a clock again).
pub struct HostTsd(bool);

impl HostTsd {
    pub fn enter(on: bool) -> HostTsd {
        if on {
            // SAFETY: prctl with integer arguments on this thread; it only changes whether this
            // thread may run rdtsc, and nothing runs here before the drop below but KVM_RUN.
            unsafe { libc::prctl(libc::PR_SET_TSC, libc::PR_TSC_SIGSEGV, 0, 0, 0) };
        }
        HostTsd(on)
    }
}

impl Drop for HostTsd {
    fn drop(&mut self) {
        if self.0 {
            // SAFETY: as in `enter`: back to rdtsc allowed for this thread.
            unsafe { libc::prctl(libc::PR_SET_TSC, libc::PR_TSC_ENABLE, 0, 0, 0) };
        }
    }
}

/// The instruction at a #GP that the trap raised: `rdtsc` (0f 31) or `rdtscp` (0f 01 f9), with its
/// length; `None` for any other #GP.
pub fn decode(bytes: &[u8]) -> Option<(bool, u64)> {
    match bytes {
        [0x0f, 0x31, ..] => Some((false, 2)),
        [0x0f, 0x01, 0xf9, ..] => Some((true, 3)),
        _ => None,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_rdtsc_and_rdtscp_are_served() {
        assert_eq!(decode(&[0x0f, 0x31, 0x90]), Some((false, 2)));
        assert_eq!(decode(&[0x0f, 0x01, 0xf9]), Some((true, 3)));
        assert_eq!(decode(&[0x0f, 0x01, 0xd0]), None); // xgetbv
        assert_eq!(decode(&[0x0f, 0x0b, 0]), None); // ud2
        assert_eq!(decode(&[0x0f]), None);
    }
}
