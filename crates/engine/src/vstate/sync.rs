//! The vCPU's general and special registers through `kvm_run`'s sync area (KVM_CAP_SYNC_REGS)
//! instead of KVM_GET/SET_REGS and KVM_GET/SET_SREGS.
//!
//! Every guest syscall is a VM exit after which the VMM reads both register sets and writes both
//! back (to return to ring 3). Under kvm_pvm each of those four ioctls costs about 15-19 us (the
//! vCPU is loaded and put again for each), more than the exit itself: a syscall cost about 100 us,
//! 70 of them in these ioctls. With the sync area, KVM stores the registers into `kvm_run` as the
//! run ends and loads the ones marked dirty as the next run starts, inside the KVM_RUN the VMM
//! makes anyway.
//!
//! The catch is that a dirty write is pending until the next KVM_RUN applies it: KVM_GET_REGS
//! meanwhile reads the old values, and a KVM_RUN that returns at once (EINTR, an immediate exit)
//! may return before applying it, and then store the old values over it. So:
//! - [`RegSync::write`] keeps its own copy of what it wrote;
//! - [`RegSync::before_run`] writes the copy into the area again while KVM has not taken it (the
//!   dirty bits are still set: KVM clears each bit as it applies it), and forgets it once it has;
//! - [`RegSync::settle`] applies a pending write with the ioctls, for code that uses them before
//!   the next run (signal delivery on an interrupted run, a run that ends, a vfork child's end).
//!
//! Reads ([`RegSync::read`]) are valid right after a KVM_RUN returned, before anything else touched
//! the registers.

use kvm_bindings::{kvm_regs, kvm_sregs, KVM_SYNC_X86_REGS, KVM_SYNC_X86_SREGS};
use kvm_ioctls::VcpuFd;

use crate::error::{Error, Result};

const BOTH: u64 = (KVM_SYNC_X86_REGS | KVM_SYNC_X86_SREGS) as u64;

/// Whether the sync area is used (`COLLIMATE_SYNC_REGS=0`: the ioctls, to compare).
fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_SYNC_REGS").is_none_or(|v| v != "0"))
}

/// A pending register write of one vCPU (see the module docs).
#[derive(Default)]
pub struct RegSync {
    pending: Option<Box<(kvm_regs, kvm_sregs)>>,
}

impl RegSync {
    /// Before each KVM_RUN: ask KVM to store the registers on exit, and make sure a pending write
    /// is still in the area.
    pub fn before_run(&mut self, vcpu: &mut VcpuFd) {
        let run = vcpu.get_kvm_run();
        run.kvm_valid_regs |= BOTH;
        let applied = run.kvm_dirty_regs & BOTH == 0;
        if applied {
            self.pending = None;
        } else if let Some(p) = &self.pending {
            let (r, s) = (p.0, p.1);
            let area = vcpu.sync_regs_mut();
            area.regs = r;
            area.sregs = s;
        }
    }

    /// The registers as the last run left them.
    pub fn read(&self, vcpu: &VcpuFd) -> Result<(kvm_regs, kvm_sregs)> {
        if !enabled() {
            let r = vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
            return Ok((r, vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?));
        }
        let s = vcpu.sync_regs();
        Ok((s.regs, s.sregs))
    }

    /// Set both register sets for the next run.
    pub fn write(&mut self, vcpu: &mut VcpuFd, regs: &kvm_regs, sregs: &kvm_sregs) -> Result<()> {
        if !enabled() {
            vcpu.set_regs(regs).map_err(Error::kvm("KVM_SET_REGS"))?;
            return vcpu.set_sregs(sregs).map_err(Error::kvm("KVM_SET_SREGS"));
        }
        let area = vcpu.sync_regs_mut();
        area.regs = *regs;
        area.sregs = *sregs;
        vcpu.get_kvm_run().kvm_dirty_regs |= BOTH;
        self.pending = Some(Box::new((*regs, *sregs)));
        Ok(())
    }

    /// The registers the next run starts with: a write still pending, else the vCPU's own (the
    /// ioctls). For code that switches what the vCPU runs (`vmm::threads`) without settling: a
    /// thread switch after a syscall then costs no register ioctls, where settling and reading
    /// back cost four.
    pub fn current(&self, vcpu: &mut VcpuFd) -> Result<(kvm_regs, kvm_sregs)> {
        if let Some(p) = &self.pending {
            if vcpu.get_kvm_run().kvm_dirty_regs & BOTH != 0 {
                return Ok((p.0, p.1));
            }
        }
        let r = vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
        Ok((r, vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?))
    }

    /// Apply a write KVM has not taken yet with the ioctls, so that KVM_GET_REGS and friends see
    /// it (and nothing is applied twice).
    pub fn settle(&mut self, vcpu: &mut VcpuFd) -> Result<()> {
        let Some(p) = self.pending.take() else { return Ok(()) };
        let run = vcpu.get_kvm_run();
        if run.kvm_dirty_regs & BOTH == 0 {
            return Ok(());
        }
        run.kvm_dirty_regs &= !BOTH;
        vcpu.set_regs(&p.0).map_err(Error::kvm("KVM_SET_REGS"))?;
        vcpu.set_sregs(&p.1).map_err(Error::kvm("KVM_SET_SREGS"))
    }

    /// A new vCPU (a fork's, an exec's): nothing is pending for it.
    pub fn reset(&mut self) {
        self.pending = None;
    }
}
