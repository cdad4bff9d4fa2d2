//! Who the guest process is: user and group ids (the setuid family, supplementary groups) and the
//! machine it runs on (uname).
//!
//! The ids live in [`super::process::Proc`]; privilege is an effective uid of 0, checked with Linux's
//! rules, and reaches nothing outside the sandbox.

use super::{Ctx, Errno, GuestOs, SysResult, EINVAL, EPERM};

pub const SYS_UNAME: u64 = 63;
pub const SYS_GETUID: u64 = 102;
pub const SYS_GETGID: u64 = 104;
pub const SYS_SETUID: u64 = 105;
pub const SYS_SETGID: u64 = 106;
pub const SYS_GETEUID: u64 = 107;
pub const SYS_GETEGID: u64 = 108;
pub const SYS_SETREUID: u64 = 113;
pub const SYS_SETREGID: u64 = 114;
pub const SYS_GETGROUPS: u64 = 115;
pub const SYS_SETGROUPS: u64 = 116;
pub const SYS_SETRESUID: u64 = 117;
pub const SYS_GETRESUID: u64 = 118;
pub const SYS_SETRESGID: u64 = 119;
pub const SYS_GETRESGID: u64 = 120;
pub const SYS_SETFSUID: u64 = 122;
pub const SYS_SETFSGID: u64 = 123;

/// The fields of `struct utsname` (65 bytes each).
pub const UTS_SYSNAME: &str = "Linux";
pub const UTS_NODENAME: &str = "sandbox";
pub const UTS_RELEASE: &str = "6.1.0-collimate";
pub const UTS_VERSION: &str = "#1 SMP PREEMPT_DYNAMIC";
pub const UTS_MACHINE: &str = "x86_64";
pub const UTS_DOMAINNAME: &str = "(none)";

/// `struct utsname` as uname(2) writes it.
pub fn utsname() -> [u8; 390] {
    let mut b = [0u8; 390];
    for (i, f) in [UTS_SYSNAME, UTS_NODENAME, UTS_RELEASE, UTS_VERSION, UTS_MACHINE, UTS_DOMAINNAME].iter().enumerate() {
        b[i * 65..i * 65 + f.len()].copy_from_slice(f.as_bytes());
    }
    b
}

fn u32s(v: &[u32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

const KEEP: u32 = u32::MAX;

/// setresuid/setresgid on `ids` (real, effective, saved, file-system), as Linux does it: with
/// privilege (effective uid 0) any ids; without, each new id must be one of the current real,
/// effective or saved ids. -1 keeps an id; the file-system id follows the effective one.
fn set_res(ids: &mut [u32; 4], r: u32, e: u32, s: u32, privileged: bool) -> Result<u64, Errno> {
    if !privileged && [r, e, s].iter().any(|&w| w != KEEP && !ids[..3].contains(&w)) {
        return Err(EPERM);
    }
    for (i, w) in [r, e, s].into_iter().enumerate() {
        if w != KEEP {
            ids[i] = w;
        }
    }
    ids[3] = ids[1];
    Ok(0)
}

/// setuid/setgid: with privilege, all four ids; without, the effective (and file-system) id, to
/// the real or saved one.
fn set_one(ids: &mut [u32; 4], id: u32, privileged: bool) -> Result<u64, Errno> {
    if privileged {
        *ids = [id; 4];
    } else if id == ids[0] || id == ids[2] {
        ids[1] = id;
        ids[3] = id;
    } else {
        return Err(EPERM);
    }
    Ok(0)
}

/// setreuid/setregid: the real id may become the effective one, the effective id any of the
/// three; the saved id follows the new effective id when the real id is set or the effective id
/// moves away from the real one.
fn set_re(ids: &mut [u32; 4], r: u32, e: u32, privileged: bool) -> Result<u64, Errno> {
    let old = *ids;
    if !privileged && ((r != KEEP && r != old[0] && r != old[1]) || (e != KEEP && !old[..3].contains(&e))) {
        return Err(EPERM);
    }
    if r != KEEP {
        ids[0] = r;
    }
    if e != KEEP {
        ids[1] = e;
    }
    if r != KEEP || (e != KEEP && e != old[0]) {
        ids[2] = ids[1];
    }
    ids[3] = ids[1];
    Ok(0)
}

/// setfsuid/setfsgid: returns the previous id whether or not it changes.
fn set_fs(ids: &mut [u32; 4], id: u32, privileged: bool) -> Result<u64, Errno> {
    let old = ids[3];
    if id != KEEP && (privileged || ids.contains(&id)) {
        ids[3] = id;
    }
    Ok(old as u64)
}

/// Handle a user, group or uname call; `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_UNAME => ctx.write(a[0], &utsname()).map(|_| 0),
        SYS_GETUID => Ok(p.uid[0] as u64),
        SYS_GETEUID => Ok(p.uid[1] as u64),
        SYS_GETGID => Ok(p.gid[0] as u64),
        SYS_GETEGID => Ok(p.gid[1] as u64),
        SYS_GETGROUPS => {
            let size = a[0] as i32;
            let n = p.groups.len();
            if size < 0 || (size != 0 && (size as usize) < n) {
                Err(EINVAL)
            } else if size == 0 {
                Ok(n as u64)
            } else {
                ctx.write(a[1], &u32s(&p.groups)).map(|_| n as u64)
            }
        }
        SYS_SETGROUPS => {
            let size = a[0] as i32;
            if !(0..=65536).contains(&size) {
                Err(EINVAL)
            } else if p.uid[1] != 0 {
                Err(EPERM)
            } else {
                ctx.read_vec(a[1], size as usize * 4).map(|b| {
                    p.groups = b.chunks_exact(4).map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]])).collect();
                    0
                })
            }
        }
        // The setuid family: privilege is an effective uid of 0 (CAP_SETUID and CAP_SETGID).
        SYS_SETUID | SYS_SETGID | SYS_SETREUID | SYS_SETREGID | SYS_SETRESUID | SYS_SETRESGID | SYS_SETFSUID | SYS_SETFSGID => {
            let privileged = p.uid[1] == 0;
            let user = matches!(nr, SYS_SETUID | SYS_SETREUID | SYS_SETRESUID | SYS_SETFSUID);
            let ids = if user { &mut p.uid } else { &mut p.gid };
            let id = |i: usize| a[i] as u32;
            match nr {
                SYS_SETUID | SYS_SETGID => set_one(ids, id(0), privileged),
                SYS_SETREUID | SYS_SETREGID => set_re(ids, id(0), id(1), privileged),
                SYS_SETRESUID | SYS_SETRESGID => set_res(ids, id(0), id(1), id(2), privileged),
                _ => set_fs(ids, id(0), privileged),
            }
        }
        SYS_GETRESUID | SYS_GETRESGID => {
            let ids = if nr == SYS_GETRESUID { p.uid } else { p.gid };
            ctx.write(a[0], &ids[0].to_le_bytes())
                .and_then(|_| ctx.write(a[1], &ids[1].to_le_bytes()))
                .and_then(|_| ctx.write(a[2], &ids[2].to_le_bytes()))
                .map(|_| 0)
        }
        _ => return None,
    };
    Some(r)
}
