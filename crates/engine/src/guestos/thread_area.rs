//! What a thread sets up about itself when it starts: its FS and GS bases (arch_prctl, where
//! glibc's thread pointer lives), the child-tid pointer (set_tid_address), the robust futex list,
//! rseq (not offered) and membarrier.
//!
//! With threads, thread::dispatch answers set_tid_address first (see [`super::thread`]); the
//! answers here are a single-threaded process's.

use super::process::is_self;
use super::{Ctx, GuestOs, SysResult, EINVAL, ENOSYS, EPERM, ESRCH};

pub const SYS_ARCH_PRCTL: u64 = 158;
pub const SYS_SET_TID_ADDRESS: u64 = 218;
pub const SYS_SET_ROBUST_LIST: u64 = 273;
pub const SYS_GET_ROBUST_LIST: u64 = 274;
pub const SYS_MEMBARRIER: u64 = 324;
pub const SYS_RSEQ: u64 = 334;

pub(super) const ARCH_SET_GS: u64 = 0x1001;
pub(super) const ARCH_SET_FS: u64 = 0x1002;
pub(super) const ARCH_GET_FS: u64 = 0x1003;
const ARCH_GET_GS: u64 = 0x1004;

/// Handle a thread's set-up call (arch_prctl, set_tid_address, robust lists, rseq, membarrier); `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_ARCH_PRCTL => arch_prctl(ctx, a[0], a[1]),
        SYS_SET_TID_ADDRESS => {
            p.clear_child_tid = a[0];
            Ok(p.pid as u64)
        }
        SYS_SET_ROBUST_LIST => {
            if a[1] != 24 {
                Err(EINVAL)
            } else {
                p.robust_list = (a[0], a[1]);
                Ok(0)
            }
        }
        SYS_GET_ROBUST_LIST => {
            if !is_self(p, a[0]) {
                Err(ESRCH)
            } else {
                let (head, len) = p.robust_list;
                ctx.write(a[1], &head.to_le_bytes()).and_then(|_| ctx.write(a[2], &len.to_le_bytes())).map(|_| 0)
            }
        }
        // glibc registers rseq areas when the kernel has them and copes without.
        SYS_RSEQ => Err(ENOSYS),
        SYS_MEMBARRIER => Ok(0),
        _ => return None,
    };
    Some(r)
}

fn arch_prctl(ctx: &mut Ctx, code: u64, addr: u64) -> SysResult {
    match code {
        ARCH_SET_FS | ARCH_SET_GS => {
            if addr >= super::mm::TASK_SIZE {
                return Err(EPERM);
            }
            if code == ARCH_SET_FS {
                ctx.sregs.fs.base = addr;
            } else {
                ctx.sregs.gs.base = addr;
            }
            Ok(0)
        }
        ARCH_GET_FS => {
            let v = ctx.sregs.fs.base;
            ctx.write(addr, &v.to_le_bytes()).map(|_| 0)
        }
        ARCH_GET_GS => {
            let v = ctx.sregs.gs.base;
            ctx.write(addr, &v.to_le_bytes()).map(|_| 0)
        }
        // ARCH_GET_CPUID/SET_CPUID, the CET and AMX requests: not offered.
        _ => Err(EINVAL),
    }
}
