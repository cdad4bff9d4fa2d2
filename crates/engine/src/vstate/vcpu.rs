//! vCPU state: capture and restore, and preemption of a running vCPU.
//!
//! Capture order: MP_STATE, REGS, SREGS, XSAVE, XCRS, DEBUGREGS, MSRS, VCPU_EVENTS. Events come last
//! because reading the other state must not change a pending exception or interrupt shadow; MP_STATE
//! first because it says whether the rest is meaningful.
//!
//! Restore order (into a vCPU whose CPUID is already set: CPUID decides which XSAVE features and MSRs
//! are valid, so it must come before either):
//! 1. SREGS: CR0/CR4/EFER put the vCPU in long mode with OSXSAVE, which XCRS and XSAVE depend on.
//! 2. REGS.
//! 3. XCRS before XSAVE: XCR0 says which XSAVE components are enabled.
//! 4. XSAVE (FPU, SSE, AVX).
//! 5. DEBUGREGS.
//! 6. MSRS: TSC first in the list (see `arch::x86_64::regs::SNAPSHOT_MSRS`).
//! 7. VCPU_EVENTS late: pending exceptions and interrupt shadows refer to the state restored above.
//! 8. MP_STATE last: it may make the vCPU runnable.
//!
//! No LAPIC is captured: our VMs have no in-kernel irqchip (no interrupts are ever injected).

use std::sync::atomic::{AtomicPtr, Ordering};
use std::time::Duration;

use kvm_bindings::{
    kvm_debugregs, kvm_mp_state, kvm_msr_entry, kvm_regs, kvm_run, kvm_sregs, kvm_vcpu_events,
    kvm_xcrs, kvm_xsave, Msrs,
};
use kvm_ioctls::VcpuFd;
use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};

/// Everything KVM holds about one vCPU, serializable.
#[derive(Clone, Serialize, Deserialize, PartialEq)]
pub struct VcpuState {
    pub mp_state: kvm_mp_state,
    pub regs: kvm_regs,
    pub sregs: kvm_sregs,
    /// The 4 KiB legacy + extended XSAVE region of `kvm_xsave` (FPU, SSE, AVX).
    pub xsave: Vec<u32>,
    pub xcrs: kvm_xcrs,
    pub debugregs: kvm_debugregs,
    pub msrs: Vec<kvm_msr_entry>,
    pub events: kvm_vcpu_events,
}

impl std::fmt::Debug for VcpuState {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VcpuState").field("regs", &self.regs).field("msrs", &self.msrs.len()).finish()
    }
}

impl VcpuState {
    pub fn capture(vcpu: &VcpuFd, msr_list: &[u32]) -> Result<VcpuState> {
        let mp_state = vcpu.get_mp_state().map_err(Error::kvm("KVM_GET_MP_STATE"))?;
        let regs = vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
        let sregs = vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
        let xsave = vcpu.get_xsave().map_err(Error::kvm("KVM_GET_XSAVE"))?.region.to_vec();
        let xcrs = vcpu.get_xcrs().map_err(Error::kvm("KVM_GET_XCRS"))?;
        let debugregs = vcpu.get_debug_regs().map_err(Error::kvm("KVM_GET_DEBUGREGS"))?;
        let msrs = get_msrs(vcpu, msr_list)?;
        let events = vcpu.get_vcpu_events().map_err(Error::kvm("KVM_GET_VCPU_EVENTS"))?;
        Ok(VcpuState { mp_state, regs, sregs, xsave, xcrs, debugregs, msrs, events })
    }

    /// Restore in the order documented at the top of this module. CPUID must already be set.
    pub fn restore(&self, vcpu: &VcpuFd) -> Result<()> {
        vcpu.set_sregs(&self.sregs).map_err(Error::kvm("KVM_SET_SREGS"))?;
        vcpu.set_regs(&self.regs).map_err(Error::kvm("KVM_SET_REGS"))?;
        vcpu.set_xcrs(&self.xcrs).map_err(Error::kvm("KVM_SET_XCRS"))?;
        let mut xsave = kvm_xsave::default();
        if self.xsave.len() != xsave.region.len() {
            return Err(Error::InvalidArgument(format!("XSAVE region of {} words", self.xsave.len())));
        }
        xsave.region.copy_from_slice(&self.xsave);
        // SAFETY: `xsave` is a complete kvm_xsave of the legacy 4 KiB size, which is what KVM_SET_XSAVE
        // reads; KVM validates its contents against the vCPU's CPUID.
        unsafe { vcpu.set_xsave(&xsave) }.map_err(Error::kvm("KVM_SET_XSAVE"))?;
        vcpu.set_debug_regs(&self.debugregs).map_err(Error::kvm("KVM_SET_DEBUGREGS"))?;
        set_msrs(vcpu, &self.msrs)?;
        vcpu.set_vcpu_events(&self.events).map_err(Error::kvm("KVM_SET_VCPU_EVENTS"))?;
        vcpu.set_mp_state(self.mp_state).map_err(Error::kvm("KVM_SET_MP_STATE"))?;
        Ok(())
    }
}

pub fn get_msrs(vcpu: &VcpuFd, list: &[u32]) -> Result<Vec<kvm_msr_entry>> {
    let entries: Vec<kvm_msr_entry> =
        list.iter().map(|&index| kvm_msr_entry { index, ..Default::default() }).collect();
    let mut msrs = Msrs::from_entries(&entries).map_err(|e| Error::Protocol(format!("msr list: {e:?}")))?;
    let n = vcpu.get_msrs(&mut msrs).map_err(Error::kvm("KVM_GET_MSRS"))?;
    if n != list.len() {
        return Err(Error::Kvm {
            op: "KVM_GET_MSRS",
            source: kvm_ioctls::Error::new(libc::EINVAL),
        });
    }
    Ok(msrs.as_slice().to_vec())
}

pub fn set_msrs(vcpu: &VcpuFd, entries: &[kvm_msr_entry]) -> Result<()> {
    let msrs = Msrs::from_entries(entries).map_err(|e| Error::Protocol(format!("msr list: {e:?}")))?;
    let n = vcpu.set_msrs(&msrs).map_err(Error::kvm("KVM_SET_MSRS"))?;
    if n != entries.len() {
        return Err(Error::Kvm { op: "KVM_SET_MSRS", source: kvm_ioctls::Error::new(libc::EINVAL) });
    }
    Ok(())
}

/// The subset of `wanted` that this KVM lets us read (kvm_pvm does not implement every MSR).
pub fn supported_msrs(vcpu: &VcpuFd, wanted: &[u32]) -> Vec<u32> {
    wanted.iter().copied().filter(|&m| get_msrs(vcpu, &[m]).is_ok()).collect()
}

/// The kvm_run page of the vCPU this process runs, for the preemption signal handler.
static KVM_RUN: AtomicPtr<kvm_run> = AtomicPtr::new(std::ptr::null_mut());

extern "C" fn on_preempt(_: libc::c_int, _: *mut libc::siginfo_t, _: *mut libc::c_void) {
    let run = KVM_RUN.load(Ordering::SeqCst);
    if !run.is_null() {
        // SAFETY: `run` points at the live kvm_run mapping registered by `Preempter::attach`; a
        // volatile byte store is async-signal-safe. Setting immediate_exit makes a KVM_RUN that is
        // about to start return EINTR at once, closing the race with the signal itself.
        unsafe { std::ptr::addr_of_mut!((*run).immediate_exit).write_volatile(1) };
    }
    // On systrap the same timer stops the stub that runs the guest (`guestos::signal::host`).
    crate::guestos::signal::host::kick_stub();
}

/// Stops a running vCPU when its time budget runs out: a one-shot POSIX timer raises a real-time
/// signal whose handler sets `immediate_exit`; KVM_RUN then returns EINTR. On systrap it kicks the
/// running stub instead (`platform::systrap::preempt`).
pub struct Preempter {
    timer: libc::timer_t,
}

impl Preempter {
    pub fn signal() -> libc::c_int {
        vmm_sys_util::signal::SIGRTMIN()
    }

    /// Install the handler (once per process; forks inherit it) and make this process's timer.
    /// POSIX timers are not inherited across fork, so each VMM process calls this.
    pub fn new() -> Result<Preempter> {
        vmm_sys_util::signal::register_signal_handler(Self::signal(), on_preempt)
            .map_err(|e| Error::Sys { op: "sigaction", source: std::io::Error::from_raw_os_error(e.errno()) })?;
        // SAFETY: a zeroed sigevent is valid; we fill the fields SIGEV_SIGNAL needs.
        let mut sev: libc::sigevent = unsafe { std::mem::zeroed() };
        sev.sigev_notify = libc::SIGEV_SIGNAL;
        sev.sigev_signo = Self::signal();
        let mut timer: libc::timer_t = std::ptr::null_mut();
        // SAFETY: valid sigevent and out-pointer.
        if unsafe { libc::timer_create(libc::CLOCK_MONOTONIC, &mut sev, &mut timer) } != 0 {
            return Err(Error::last_os("timer_create"));
        }
        Ok(Preempter { timer })
    }

    /// Point the signal handler at this vCPU's kvm_run page.
    pub fn attach(&self, vcpu: &mut VcpuFd) {
        KVM_RUN.store(vcpu.get_kvm_run() as *mut kvm_run, Ordering::SeqCst);
    }

    pub fn detach(&self) {
        KVM_RUN.store(std::ptr::null_mut(), Ordering::SeqCst);
    }

    pub fn arm(&self, after: Duration) -> Result<()> {
        let after = after.max(Duration::from_micros(1));
        let spec = libc::itimerspec {
            it_interval: libc::timespec { tv_sec: 0, tv_nsec: 0 },
            it_value: libc::timespec {
                tv_sec: after.as_secs() as libc::time_t,
                tv_nsec: after.subsec_nanos() as libc::c_long,
            },
        };
        // SAFETY: our timer, a valid itimerspec.
        if unsafe { libc::timer_settime(self.timer, 0, &spec, std::ptr::null_mut()) } != 0 {
            return Err(Error::last_os("timer_settime"));
        }
        Ok(())
    }

    pub fn disarm(&self) -> Result<()> {
        self.arm_zero()
    }

    fn arm_zero(&self) -> Result<()> {
        // SAFETY: zeroed itimerspec disarms the timer.
        let spec: libc::itimerspec = unsafe { std::mem::zeroed() };
        // SAFETY: our timer, a valid itimerspec.
        if unsafe { libc::timer_settime(self.timer, 0, &spec, std::ptr::null_mut()) } != 0 {
            return Err(Error::last_os("timer_settime"));
        }
        Ok(())
    }
}

impl Drop for Preempter {
    fn drop(&mut self) {
        self.detach();
        // SAFETY: deleting our own timer.
        unsafe { libc::timer_delete(self.timer) };
    }
}
