//! Pseudo-terminals: `/dev/ptmx` and `/dev/pts/N`, served by a host devpts instance.
//!
//! A terminal is more than a byte pipe: its line discipline echoes, edits lines (ICANON), turns
//! "\n" into "\r\n" on output, raises signals for ^C... and programs that use a pty (os.openpty,
//! pty.fork, `script`) rely on all of it. So the engine does not imitate one: the jail mounts a
//! devpts instance of its own (`vmm::jail`, `newinstance`) and a guest's ptys are that instance's,
//! opened with O_NOCTTY (never the VMM's controlling terminal). Reads, writes and polls are those of
//! any host character device (a stream: waits in slices like pipes); the terminal ioctls in
//! [`ioctl`] pass through.
//!
//! The instance is shared by every VMM process forked from the one that mounted it, which can be
//! several sandboxes (the clones of a template). So a guest may open `/dev/pts/N` by path, and
//! sees it in `/dev/pts`, only while it holds pty N (its master or a slave) in its own fd table:
//! the way programs reach a slave by name (ptsname after openpty, a child that inherited the
//! master) works, and another sandbox's terminal cannot be opened. Pty numbers come from the shared
//! instance, so they are not part of deterministic replay.
//!
//! Not served: controlling terminals. TIOCSCTTY and TIOCNOTTY succeed as bookkeeping (pty.fork's
//! child calls login_tty, which needs the former), but the terminal never sends job-control
//! signals, and TIOCGPGRP/TIOCGSID answer ENOTTY (no controlling terminal), as they would for a
//! process whose session has none. Without the jail's namespaces (an unprivileged engine) the
//! host's own `/dev/pts` serves, under the same rule.

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::PathBuf;
use std::sync::{Arc, OnceLock};

use super::{cvt, Kind, OpenFile};
use crate::guestos::{Ctx, Errno, GuestOs, SysResult, EINVAL, ENOENT, ENOTTY};

/// Where the devpts instance is: set by the jail when it mounted one.
static DIR: OnceLock<Option<PathBuf>> = OnceLock::new();

/// Record the devpts instance the jail mounted (None: it could not mount one).
pub fn set_dir(dir: Option<PathBuf>) {
    let _ = DIR.set(dir);
}

/// The devpts directory guests' ptys come from: the jail's instance, or without a jail the
/// host's `/dev/pts`.
fn dir() -> Option<&'static PathBuf> {
    DIR.get_or_init(|| Some(PathBuf::from("/dev/pts"))).as_ref()
}

const TCGETS: u32 = 0x5401;
const TCSETS: u32 = 0x5402;
const TCSETSW: u32 = 0x5403;
const TCSETSF: u32 = 0x5404;
const TCSBRK: u32 = 0x5409;
const TCXONC: u32 = 0x540a;
const TCFLSH: u32 = 0x540b;
const TIOCSCTTY: u32 = 0x540e;
const TIOCGPGRP: u32 = 0x540f;
const TIOCOUTQ: u32 = 0x5411;
const TIOCGWINSZ: u32 = 0x5413;
const TIOCSWINSZ: u32 = 0x5414;
const TIOCPKT: u32 = 0x5420;
const TIOCNOTTY: u32 = 0x5422;
const TIOCGSID: u32 = 0x5429;
const TIOCGPTN: u32 = 0x8004_5430;
const TIOCSPTLCK: u32 = 0x4004_5431;
const TIOCGPTLCK: u32 = 0x8004_5439;
const TIOCGPTPEER: u32 = 0x5441;

/// The terminal ioctls that pass through to the host pty (the VMM's seccomp filter allows exactly
/// these, see `vmm::jail::allowed_syscalls`), with the size of the argument each reads and writes:
/// (request, bytes in, bytes out). An `int` argument by value has (0, 0).
pub const PASS: [(u32, usize, usize); 13] = [
    (TCGETS, 0, 36),
    (TCSETS, 36, 0),
    (TCSETSW, 36, 0),
    (TCSETSF, 36, 0),
    (TCSBRK, 0, 0),
    (TCXONC, 0, 0),
    (TCFLSH, 0, 0),
    (TIOCOUTQ, 0, 4),
    (TIOCGWINSZ, 0, 8),
    (TIOCSWINSZ, 8, 0),
    (TIOCPKT, 4, 0),
    (TIOCSPTLCK, 4, 0),
    (TIOCGPTLCK, 0, 4),
];

/// The requests the seccomp filter must allow on any descriptor for ptys.
pub fn host_requests() -> Vec<u64> {
    PASS.iter().map(|p| p.0 as u64).chain([TIOCGPTN as u64, TIOCGPTPEER as u64]).collect()
}

/// Whether `f` is one of the sandbox's ptys (master or slave).
pub fn is_pty(f: &OpenFile) -> bool {
    matches!(f.kind, Kind::Host(_)) && f.path.as_deref().is_some_and(|p| p == "/dev/ptmx" || p.starts_with("/dev/pts/"))
}

/// The number of the pty whose master `fd` is.
fn master_number(fd: RawFd) -> Option<u32> {
    let mut n: libc::c_uint = 0;
    // SAFETY: TIOCGPTN writes one unsigned int.
    (unsafe { libc::ioctl(fd, TIOCGPTN as _, &mut n) } == 0).then_some(n)
}

/// The pty number of an open pty file (its master's or its slave's).
fn number(f: &OpenFile) -> Option<u32> {
    let Kind::Host(h) = &f.kind else { return None };
    match f.path.as_deref()? {
        "/dev/ptmx" => master_number(h.as_raw_fd()),
        p => p.strip_prefix("/dev/pts/")?.parse().ok(),
    }
}

/// Whether this process holds pty `n` (see the module comment).
pub fn held(os: &GuestOs, n: u32) -> bool {
    os.files.open_fds().any(|fd| os.files.file(fd).is_ok_and(|f| is_pty(&f) && number(&f) == Some(n)))
}

/// The ptys this process holds, for a listing of `/dev/pts`.
pub fn held_numbers(os: &GuestOs) -> Vec<u32> {
    let mut v: Vec<u32> = os.files.open_fds().filter_map(|fd| os.files.file(fd).ok().filter(|f| is_pty(f)).and_then(|f| number(&f))).collect();
    v.sort_unstable();
    v.dedup();
    v
}

/// The pty number `/dev/pts/<name>` names, if the process holds it.
pub fn lookup(os: &GuestOs, name: &str) -> Option<u32> {
    if name.is_empty() || name.len() > 10 || (name.len() > 1 && name.starts_with('0')) {
        return None;
    }
    let n: u32 = name.parse().ok()?;
    held(os, n).then_some(n)
}

fn open_host(name: &str, flags: i32) -> Result<OwnedFd, Errno> {
    let path = dir().ok_or(ENOENT)?.join(name);
    let c = std::ffi::CString::new(path.into_os_string().into_encoded_bytes()).map_err(|_| EINVAL)?;
    let keep = libc::O_ACCMODE | libc::O_NONBLOCK;
    // SAFETY: a NUL-terminated path; the result is checked.
    let fd = cvt(unsafe { libc::open(c.as_ptr(), (flags & keep) | libc::O_NOCTTY | libc::O_CLOEXEC) } as i64)?;
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// open("/dev/ptmx"): a new pty's master.
pub fn open_master(flags: i32) -> Result<Arc<OpenFile>, Errno> {
    let fd = open_host("ptmx", flags)?;
    Ok(Arc::new(OpenFile::host(fd, Some("/dev/ptmx".into()), false)))
}

/// open("/dev/pts/N") of a held pty: its slave.
pub fn open_slave(n: u32, flags: i32) -> Result<Arc<OpenFile>, Errno> {
    let fd = open_host(&n.to_string(), flags)?;
    Ok(Arc::new(OpenFile::host(fd, Some(format!("/dev/pts/{n}")), false)))
}

/// stat of `/dev/ptmx` (None) or of `/dev/pts/N`: the host node's.
pub fn stat(n: Option<u32>) -> Result<libc::stat, Errno> {
    let name = n.map_or_else(|| "ptmx".to_string(), |n| n.to_string());
    let c = std::ffi::CString::new(dir().ok_or(ENOENT)?.join(name).into_os_string().into_encoded_bytes()).map_err(|_| EINVAL)?;
    // SAFETY: a zeroed stat is valid; stat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a NUL-terminated path and a valid out-pointer.
    cvt(unsafe { libc::stat(c.as_ptr(), &mut st) } as i64)?;
    Ok(st)
}

/// A terminal ioctl on pty file `f` (guest fd `fd`).
pub fn ioctl(os: &mut GuestOs, ctx: &mut Ctx, f: &OpenFile, req: u32, arg: u64) -> SysResult {
    let Kind::Host(h) = &f.kind else { return Err(ENOTTY) };
    let h = h.as_raw_fd();
    let master = f.path.as_deref() == Some("/dev/ptmx");
    match req {
        TIOCGPTN if master => {
            let n = master_number(h).ok_or(ENOTTY)?;
            ctx.write(arg, &n.to_le_bytes())?;
            Ok(0)
        }
        TIOCGPTPEER if master => {
            let flags = arg as i32;
            if flags & !(libc::O_ACCMODE | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOCTTY) != 0 {
                return Err(EINVAL);
            }
            let n = master_number(h).ok_or(ENOTTY)?;
            let keep = libc::O_ACCMODE | libc::O_NONBLOCK;
            // SAFETY: TIOCGPTPEER returns a new descriptor or -1; never our controlling terminal.
            let peer = cvt(unsafe { libc::ioctl(h, TIOCGPTPEER as _, (flags & keep) | libc::O_NOCTTY | libc::O_CLOEXEC) } as i64)?;
            // SAFETY: a fresh descriptor we own.
            let fd = unsafe { OwnedFd::from_raw_fd(peer as RawFd) };
            let file = Arc::new(OpenFile::host(fd, Some(format!("/dev/pts/{n}")), false));
            os.files.alloc(0, file, flags & libc::O_CLOEXEC != 0).map(|fd| fd as u64)
        }
        TIOCSCTTY | TIOCNOTTY => Ok(0),
        TIOCGPGRP | TIOCGSID => Err(ENOTTY),
        _ => {
            let &(_, size_in, size_out) = PASS.iter().find(|p| p.0 == req).ok_or(ENOTTY)?;
            // Master-only requests on a slave: the host answers (ENOTTY, as Linux).
            let mut buf = [0u8; 64];
            if size_in > 0 {
                ctx.read(arg, &mut buf[..size_in])?;
            }
            let host_arg: usize = if size_in > 0 || size_out > 0 { buf.as_mut_ptr() as usize } else { arg as usize };
            // SAFETY: a request from PASS with a buffer at least as large as what it reads or writes.
            let r = cvt(unsafe { libc::ioctl(h, req as _, host_arg) } as i64)?;
            if size_out > 0 {
                ctx.write(arg, &buf[..size_out])?;
            }
            Ok(r as u64)
        }
    }
}
