//! What a process has set about signals: dispositions (rt_sigaction), the mask (rt_sigprocmask)
//! and the alternate stack (sigaltstack).
//!
//! This is bookkeeping kept in [`super::process::Proc`]; generating and delivering signals, handler
//! frames, sigreturn, kill and waiting for children are in [`super::signal`]. With threads, the
//! mask and the alternate stack are the calling thread's (see [`super::thread`]).

use serde::{Deserialize, Serialize};

use super::process::Proc;
use super::{Ctx, Errno, GuestOs, SysResult, EFAULT, EINVAL};

/// Signals 1..=64.
pub const NSIG: usize = 64;
const SIGKILL: u64 = 9;
const SIGSTOP: u64 = 19;

/// The smallest alternate signal stack Linux accepts (MINSIGSTKSZ).
pub const MINSIGSTKSZ: u64 = 2048;

/// One signal's disposition, as rt_sigaction's `struct k_sigaction` holds it on x86-64.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SigAction {
    pub handler: u64,
    pub flags: u64,
    pub restorer: u64,
    pub mask: u64,
}

/// The alternate signal stack (sigaltstack's `stack_t`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct AltStack {
    pub sp: u64,
    pub flags: i32,
    pub size: u64,
}

pub const SYS_RT_SIGACTION: u64 = 13;
pub const SYS_RT_SIGPROCMASK: u64 = 14;
pub const SYS_SIGALTSTACK: u64 = 131;

const SS_ONSTACK: i32 = 1;
pub(super) const SS_DISABLE: i32 = 2;
const SS_AUTODISARM: i32 = 1 << 31;

/// Handle rt_sigaction, rt_sigprocmask or sigaltstack; `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_RT_SIGACTION => rt_sigaction(p, ctx, a[0], a[1], a[2], a[3]),
        SYS_RT_SIGPROCMASK => rt_sigprocmask(p, ctx, a[0], a[1], a[2], a[3]),
        SYS_SIGALTSTACK => sigaltstack(p, ctx, a[0], a[1]),
        _ => return None,
    };
    Some(r)
}

fn check_sig(sig: u64) -> Result<usize, Errno> {
    if (1..=NSIG as u64).contains(&sig) {
        Ok(sig as usize - 1)
    } else {
        Err(EINVAL)
    }
}

fn rt_sigaction(p: &mut Proc, ctx: &mut Ctx, sig: u64, act: u64, oact: u64, setsize: u64) -> SysResult {
    if setsize != 8 {
        return Err(EINVAL);
    }
    let i = check_sig(sig)?;
    if act != 0 && (sig == SIGKILL || sig == SIGSTOP) {
        return Err(EINVAL);
    }
    let new = if act != 0 {
        let b = ctx.read_vec(act, 32)?;
        let w = |k: usize| u64::from_le_bytes([b[k], b[k + 1], b[k + 2], b[k + 3], b[k + 4], b[k + 5], b[k + 6], b[k + 7]]);
        Some(SigAction { handler: w(0), flags: w(8), restorer: w(16), mask: w(24) })
    } else {
        None
    };
    let old = p.sigactions.get(i).copied().unwrap_or_default();
    if oact != 0 {
        let mut b = [0u8; 32];
        for (k, v) in [old.handler, old.flags, old.restorer, old.mask].iter().enumerate() {
            b[k * 8..k * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        ctx.write(oact, &b)?;
    }
    if let (Some(n), Some(slot)) = (new, p.sigactions.get_mut(i)) {
        *slot = n;
    }
    Ok(0)
}

fn rt_sigprocmask(p: &mut Proc, ctx: &mut Ctx, how: u64, set: u64, oset: u64, setsize: u64) -> SysResult {
    const SIG_BLOCK: u64 = 0;
    const SIG_UNBLOCK: u64 = 1;
    const SIG_SETMASK: u64 = 2;
    if setsize != 8 {
        return Err(EINVAL);
    }
    let new = if set != 0 {
        let s = ctx.read_u64(set)?;
        let m = match how {
            SIG_BLOCK => p.sigmask | s,
            SIG_UNBLOCK => p.sigmask & !s,
            SIG_SETMASK => s,
            _ => return Err(EINVAL),
        };
        // SIGKILL and SIGSTOP cannot be blocked.
        Some(m & !((1 << (SIGKILL - 1)) | (1 << (SIGSTOP - 1))))
    } else {
        None
    };
    if oset != 0 {
        ctx.write(oset, &p.sigmask.to_le_bytes())?;
    }
    if let Some(m) = new {
        p.sigmask = m;
    }
    Ok(0)
}

fn sigaltstack(p: &mut Proc, ctx: &mut Ctx, ss: u64, old: u64) -> SysResult {
    let new = if ss != 0 {
        let b = ctx.read_vec(ss, 24)?;
        let sp = u64::from_le_bytes(b[..8].try_into().map_err(|_| EFAULT)?);
        let flags = i32::from_le_bytes(b[8..12].try_into().map_err(|_| EFAULT)?);
        let size = u64::from_le_bytes(b[16..24].try_into().map_err(|_| EFAULT)?);
        let mode = flags & !SS_AUTODISARM;
        if mode != 0 && mode != SS_DISABLE && mode != SS_ONSTACK {
            return Err(EINVAL);
        }
        if mode == SS_DISABLE {
            Some(AltStack { sp: 0, flags: SS_DISABLE, size: 0 })
        } else if size < MINSIGSTKSZ {
            return Err(super::ENOMEM);
        } else {
            Some(AltStack { sp, flags: flags & SS_AUTODISARM, size })
        }
    } else {
        None
    };
    if old != 0 {
        let s = p.altstack;
        let mut b = [0u8; 24];
        b[..8].copy_from_slice(&s.sp.to_le_bytes());
        b[8..12].copy_from_slice(&s.flags.to_le_bytes());
        b[16..24].copy_from_slice(&s.size.to_le_bytes());
        ctx.write(old, &b)?;
    }
    if let Some(n) = new {
        p.altstack = n;
    }
    Ok(0)
}
