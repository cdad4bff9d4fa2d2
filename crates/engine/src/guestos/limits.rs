//! Resource limits (getrlimit, setrlimit, prlimit64): kept per process in
//! [`super::process::Proc`], inherited across fork, and read by the modules they bound (the fd
//! table reads RLIMIT_NOFILE, exec the stack size).

use serde::{Deserialize, Serialize};

use super::process::{is_self, Proc};
use super::{Ctx, GuestOs, SysResult, EFAULT, EINVAL, EPERM, ESRCH};

/// Resource limits RLIMIT_CPU (0) ..= RLIMIT_RTTIME (15).
pub const RLIM_NLIMITS: usize = 16;
pub const RLIM_INFINITY: u64 = u64::MAX;
pub const RLIMIT_STACK: usize = 3;
pub const RLIMIT_NOFILE: usize = 7;

#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Rlimit {
    pub cur: u64,
    pub max: u64,
}

pub const SYS_GETRLIMIT: u64 = 97;
pub const SYS_SETRLIMIT: u64 = 160;
pub const SYS_PRLIMIT64: u64 = 302;

/// Handle a resource-limit call; `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_PRLIMIT64 => prlimit(p, ctx, a[0], a[1], a[2], a[3]),
        SYS_GETRLIMIT => prlimit(p, ctx, 0, a[0], 0, a[1]),
        SYS_SETRLIMIT => prlimit(p, ctx, 0, a[0], a[1], 0),
        _ => return None,
    };
    Some(r)
}

fn prlimit(p: &mut Proc, ctx: &mut Ctx, pid: u64, resource: u64, new: u64, old: u64) -> SysResult {
    if !is_self(p, pid) {
        return Err(ESRCH);
    }
    let res = resource as usize;
    if res >= RLIM_NLIMITS {
        return Err(EINVAL);
    }
    let new_lim = if new != 0 {
        let b = ctx.read_vec(new, 16)?;
        let cur = u64::from_le_bytes(b[..8].try_into().map_err(|_| EFAULT)?);
        let max = u64::from_le_bytes(b[8..].try_into().map_err(|_| EFAULT)?);
        if cur > max {
            return Err(EINVAL);
        }
        Some(Rlimit { cur, max })
    } else {
        None
    };
    if old != 0 {
        let l = p.rlimit(res);
        let mut b = [0u8; 16];
        b[..8].copy_from_slice(&l.cur.to_le_bytes());
        b[8..].copy_from_slice(&l.max.to_le_bytes());
        ctx.write(old, &b)?;
    }
    if let Some(l) = new_lim {
        // Raising a hard limit needs CAP_SYS_RESOURCE, which only root has here.
        if l.max > p.rlimit(res).max && p.uid[1] != 0 {
            return Err(EPERM);
        }
        if let Some(slot) = p.rlimits.get_mut(res) {
            *slot = l;
        }
    }
    Ok(0)
}
