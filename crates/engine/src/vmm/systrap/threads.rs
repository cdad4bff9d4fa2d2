//! Threads of a systrap guest process: M:1 on its one stub, scheduled by the KVM VMM's scheduler
//! (`vmm::threads`: slices, futex waits, blocking calls retried, the replay quantum, the deadlock
//! report, signal routing), which reaches the CPU through [`ThreadCpu`]. Here the CPU is the
//! stub: a thread's general registers and FS base are the [`Process`]'s between two exits, its
//! XSAVE area is the one in the stub's host signal frame (`Stub::xsave`/`set_xsave`), so a switch
//! costs two reads and one write of the stub's memory and no round trip to it. The GS base is not
//! a systrap guest's to set (arch_prctl(ARCH_SET_GS) is not served), so it stays 0.
//!
//! A slice ends by the scheduler's tick timer, whose handler kicks the stub
//! (`guestos::signal::host::kick`, `platform::systrap::preempt`); the stub stops at the guest's
//! next instruction boundary and `Stub::run` returns `Exit::Interrupted`, as KVM_RUN returns
//! EINTR.

use kvm_bindings::kvm_regs;

use super::super::process::{self, AfterSyscall};
use super::super::threads::{self as sched_threads, NewThread, ThreadCpu};
use super::{Process, StubSpace};
use crate::error::{Error, Result};
use crate::guestos::{signal, Errno, GuestOs};
use crate::platform::HostSpace;
use crate::protocol::RunExit;

impl ThreadCpu for Process {
    fn os(&self) -> Option<&GuestOs> {
        Some(&self.os)
    }

    fn os_mut(&mut self) -> Option<&mut GuestOs> {
        Some(&mut self.os)
    }

    fn cpu_regs(&mut self) -> Result<(kvm_regs, u64, u64)> {
        Ok((self.regs, self.fs_base, 0))
    }

    fn set_cpu_regs(&mut self, regs: &kvm_regs, fs_base: u64, _gs_base: u64) -> Result<()> {
        self.regs = *regs;
        self.fs_base = fs_base;
        Ok(())
    }

    fn cpu_xsave(&mut self, out: &mut Vec<u32>) -> Result<()> {
        let area = self.stub.xsave().map_err(|e| Error::Remote(format!("systrap: {e}")))?;
        out.clear();
        out.extend(area.chunks_exact(4).map(|w| u32::from_le_bytes([w[0], w[1], w[2], w[3]])));
        Ok(())
    }

    fn set_cpu_xsave(&mut self, area: &[u32]) -> Result<()> {
        let bytes: Vec<u8> = area.iter().flat_map(|w| w.to_le_bytes()).collect();
        self.stub.set_xsave(&bytes).map_err(|e| Error::Remote(format!("systrap: {e}")))
    }

    fn write_guest(&mut self, va: u64, data: &[u8]) {
        let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        let _ = space.write(va, data);
    }

    fn in_user_mode(&mut self) -> Result<bool> {
        // A parked stub stopped in guest code: the blob never exits to the VMM from its own.
        Ok(true)
    }

    /// The guest computes in the stub process, not on the VMM thread: both CPU clocks.
    fn cpu_ns(&self) -> u64 {
        let mut clock: libc::clockid_t = 0;
        let mut t = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: clock_getcpuclockid and clock_gettime write one value each that we own.
        let stub = unsafe {
            if libc::clock_getcpuclockid(self.stub.pid(), &mut clock) != 0 || libc::clock_gettime(clock, &mut t) != 0 {
                0
            } else {
                (t.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(t.tv_nsec as u64)
            }
        };
        let mut v = libc::timespec { tv_sec: 0, tv_nsec: 0 };
        // SAFETY: as above, this thread's own CPU clock.
        let vmm = if unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut v) } == 0 {
            (v.tv_sec as u64).saturating_mul(1_000_000_000).saturating_add(v.tv_nsec as u64)
        } else {
            0
        };
        stub.saturating_add(vmm)
    }
}

impl Process {
    /// clone(CLONE_THREAD): a new thread of this process on its stub (`vmm::threads::clone_thread`).
    pub(super) fn clone_thread(&mut self, t: NewThread) -> std::result::Result<u64, Errno> {
        let regs = self.regs;
        let fs_base = self.fs_base;
        sched_threads::clone_thread(self, &regs, fs_base, 0, t)
    }

    /// The stub stopped between two instructions (`Exit::Interrupted`: a slice's end, a guest timer
    /// or the run's deadline, a signal from another process): act on a signal that is ready now,
    /// as the KVM loop does when KVM_RUN returns EINTR (`process::on_interrupt`).
    pub(super) fn interrupted(&mut self) -> Option<RunExit> {
        if !signal::host::pending() && self.os.sig.pending == 0 {
            return None;
        }
        signal::gather(&mut self.os);
        if !signal::has_ready(&mut self.os) {
            return None;
        }
        match process::signals_at_interrupt(&mut self.os, &mut self.regs) {
            AfterSyscall::Resume(exit) => exit,
            AfterSyscall::Deliver(d, exit) => {
                if self.deliver(&d) {
                    exit
                } else {
                    Some(RunExit::Signaled { signo: libc::SIGSEGV })
                }
            }
        }
    }
}
