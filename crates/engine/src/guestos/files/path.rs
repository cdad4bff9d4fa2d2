//! The path syscalls: open, stat, access, readlink, cwd, directory and link changes, chmod,
//! times, statfs. Each looks its path up with [`Vfs::resolve`] and makes the host `*at` call on the
//! last component, with the no-follow variant (the lookup did the following, inside the sandbox).

use std::ffi::CStr;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use super::special;
use super::{bytes_of, cvt, OpenFile, EBUSY, EXDEV};
use crate::guestos::vfs::{self, Lookup, Resolved, Vfs, PATH_MAX};
use crate::guestos::{Ctx, Errno, GuestOs, SysResult};
use crate::guestos::{EACCES, EEXIST, EFAULT, EINVAL, EISDIR, ENAMETOOLONG, ENOENT, ENOTDIR, EOPNOTSUPP, ERANGE, EROFS};

const _: () = assert!(std::mem::size_of::<libc::stat>() == 144);
const _: () = assert!(std::mem::size_of::<libc::statfs>() == 120);
/// struct statx is 256 bytes on every Linux architecture.
const STATX_SIZE: usize = 256;

/// A guest path argument.
fn read_path(ctx: &Ctx, p: u64) -> Result<Vec<u8>, Errno> {
    if p == 0 {
        return Err(EFAULT);
    }
    let v = ctx.read_cstr(p, PATH_MAX)?;
    if v.len() >= PATH_MAX {
        return Err(ENAMETOOLONG);
    }
    Ok(v)
}

/// `/proc/<pid>...` with the process's own guest pid, as `/proc/self...` (programs name their own
/// /proc directory by number: CPython's subprocess lists `/proc/<pid>/fd`); None for other paths.
fn own_proc_path(os: &GuestOs, path: &[u8]) -> Option<Vec<u8>> {
    let rest = path.strip_prefix(b"/proc/")?;
    let end = rest.iter().position(|&b| b == b'/').unwrap_or(rest.len());
    let (num, tail) = rest.split_at(end);
    let own = os.proc.pid.to_string();
    // "/proc/<pid>" itself stays: a directory (lstat), where /proc/self is a symlink to it.
    (num == own.as_bytes() && !tail.is_empty()).then(|| [b"/proc/self".as_slice(), tail].concat())
}

/// Look `path` up relative to `dirfd` (AT_FDCWD: the cwd; else the directory fd's guest path).
fn lookup<'v>(vfs: &'v Vfs, os: &GuestOs, dirfd: i32, path: &[u8], mode: Lookup) -> Result<Resolved<'v>, Errno> {
    let own = own_proc_path(os, path);
    let path = own.as_deref().unwrap_or(path);
    let base = if path.first() == Some(&b'/') {
        "/".to_string()
    } else if dirfd == libc::AT_FDCWD {
        special::cwd(os).to_string()
    } else {
        os.files.dir_path(dirfd)?
    };
    vfs.resolve(&base, path, mode, special::exe(os))
}

/// `lookup` with the borrow split GuestOs needs: the result borrows only `os.vfs`.
macro_rules! lookup {
    ($os:expr, $dirfd:expr, $path:expr, $mode:expr) => {
        lookup(&$os.vfs, $os, $dirfd, $path, $mode)
    };
}

/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`: never follows a symlink.
use vfs::lstat_at as host_stat;

/// A looked-up host object's own lstat: the one the lookup took ([`Resolved::lstat`]: a followed
/// lookup's last component), else a host call; None for a virtual node.
fn lstat_of(r: &Resolved) -> Option<Result<libc::stat, Errno>> {
    let (d, n) = r.host()?;
    Some(r.lstat.map_or_else(|| host_stat(d, n), Ok))
}

fn exists(r: &Resolved) -> bool {
    lstat_of(r).is_some_and(|st| st.is_ok())
}

/// The guest's file-system ids, if it does not run as root: what new files must be owned by.
/// (The VMM, root on the host, creates them; a root guest needs no chown.)
fn new_owner(os: &GuestOs) -> Option<(u32, u32)> {
    let (u, g) = (os.proc.uid[3], os.proc.gid[3]);
    (u != 0 || g != 0).then_some((u, g))
}

/// Give a file the guest just made through `fd` to the guest's ids, as Linux would.
fn own_new_fd(os: &GuestOs, fd: RawFd) {
    if let Some((u, g)) = new_owner(os) {
        // SAFETY: fchown on a descriptor we hold. A failure leaves the file root-owned, which the
        // guest can see but which changes nothing it may do (file modes are not enforced).
        unsafe { libc::fchown(fd, u, g) };
    }
}

/// Give the file named `n` in host directory `d`, just made by the guest, to the guest's ids,
/// with the guest's time (`stamp`).
fn own_new_at(os: &GuestOs, d: RawFd, n: &CStr) {
    super::stamp::created_at(&os.proc, d, n);
    if let Some((u, g)) = new_owner(os) {
        // SAFETY: valid fd and C string (one component); the link itself, never its target.
        unsafe { libc::fchownat(d, n.as_ptr(), u, g, libc::AT_SYMLINK_NOFOLLOW) };
    }
}

/// chown(2) permission: root may give anything to anyone; an owner may change the group to one
/// of its own groups; `u32::MAX` (-1) keeps an id.
fn chown_permitted(os: &GuestOs, st: &libc::stat, uid: u32, gid: u32) -> Result<(), Errno> {
    let p = &os.proc;
    if p.uid[1] == 0 {
        return Ok(());
    }
    if uid != u32::MAX && uid != st.st_uid {
        return Err(crate::guestos::EPERM);
    }
    if gid != u32::MAX && gid != st.st_gid && (st.st_uid != p.uid[3] || !(gid == p.gid[3] || p.groups.contains(&gid))) {
        return Err(crate::guestos::EPERM);
    }
    Ok(())
}

/// fchown(2) on a guest descriptor: host files change owner; the engine's own files (pipes,
/// memfds, /dev, /proc) keep theirs, as before.
pub(super) fn sys_fchown(os: &mut GuestOs, fd: i32, uid: u32, gid: u32) -> SysResult {
    let file = os.files.file(fd)?;
    let Some(h) = file.host_fd() else { return Ok(0) };
    let st = special::file_stat(&file)?;
    chown_permitted(os, &st, uid, gid)?;
    if file.ro {
        return Err(EROFS);
    }
    // SAFETY: fchown on a descriptor the file table holds.
    cvt(unsafe { libc::fchown(h, uid, gid) } as i64)
}

/// EROFS unless `r` is on a writable mount; EACCES in the engine-served trees.
fn check_writable(r: &Resolved) -> Result<(), Errno> {
    if r.is_virtual() {
        Err(EACCES)
    } else if !r.writable() {
        Err(EROFS)
    } else {
        Ok(())
    }
}

/// For calls that create `r`: EEXIST if it exists (Linux reports that before EROFS), else EROFS
/// unless writable.
fn check_creatable(r: &Resolved) -> Result<(), Errno> {
    if r.is_virtual() {
        return Err(EACCES);
    }
    if !r.writable() && (exists(r) || r.is_dir_itself()) {
        return Err(EEXIST);
    }
    check_writable(r)
}

/// Where mkdir and mknod make `path`: its parent resolved, and a name that may be made there
/// (EEXIST for what the engine serves in /dev and /proc, EACCES for the rest of those trees).
fn new_name<'a>(os: &'a GuestOs, dirfd: i32, path: &[u8]) -> Result<Resolved<'a>, Errno> {
    let r = lookup!(os, dirfd, path, Lookup::Parent)?;
    if r.is_virtual() {
        return Err(if special::lookup(os, &r.path).is_some() { EEXIST } else { EACCES });
    }
    check_creatable(&r)?;
    Ok(r)
}

fn host_of<'r>(r: &'r Resolved) -> Result<(RawFd, &'r CStr), Errno> {
    r.host().ok_or(EACCES)
}

/// Linux refuses to rename or link across mounts (EXDEV), and so do we, whatever the host
/// directories behind two guest mounts share: the answer must not depend on the host's layout, nor
/// on whether the VMM process is jailed (there every mount is a bind of its own, see vmm::jail).
fn same_mount(a: &Resolved, b: &Resolved) -> Result<(), Errno> {
    match (&a.target, &b.target) {
        (vfs::Target::Host { mount: x, .. }, vfs::Target::Host { mount: y, .. }) if x != y => Err(EXDEV),
        _ => Ok(()),
    }
}

/// The open file that `r`, a followed `/proc/self/fd/N`, names: those are "magic" links, and
/// following one gives the open file itself, not a path (glibc's fchmodat with
/// AT_SYMLINK_NOFOLLOW opens the file O_PATH and chmods "/proc/self/fd/N"). None for anything else.
fn magic_file(os: &GuestOs, r: &Resolved, mode: Lookup) -> Option<Arc<OpenFile>> {
    if mode != Lookup::Follow || !r.is_virtual() {
        return None;
    }
    match special::lookup(os, &r.path) {
        Some(special::Node::Fd(n)) => os.files.file(n).ok(),
        _ => None,
    }
}

/// The host descriptor of open file `f` for a change to its inode (any descriptor of it, O_PATH
/// included): EROFS on a read-only mount, EACCES for the engine's own files.
fn changeable_fd(f: &OpenFile) -> Result<RawFd, Errno> {
    let h = f.host_fd().ok_or(EACCES)?;
    if f.ro {
        return Err(EROFS);
    }
    Ok(h)
}

/// chmod of the open file `f`, as fchmodat2(fd, "", mode, AT_EMPTY_PATH) (any descriptor).
fn chmod_file(f: &OpenFile, mode: u32) -> SysResult {
    const SYS_FCHMODAT2: libc::c_long = 452;
    let h = changeable_fd(f)?;
    // SAFETY: a descriptor we hold and an empty C string.
    match cvt(unsafe { libc::syscall(SYS_FCHMODAT2, h, c"".as_ptr(), mode, libc::AT_EMPTY_PATH) }) {
        // Hosts before Linux 6.6: fchmod (which an O_PATH descriptor refuses with EBADF).
        // SAFETY: fchmod on a descriptor we hold.
        Err(e) if e == crate::guestos::ENOSYS => cvt(unsafe { libc::fchmod(h, mode) } as i64),
        other => other,
    }
}

/// chown of the open file `f` (any descriptor), with chown(2)'s permission rules.
fn chown_file(os: &GuestOs, f: &OpenFile, uid: u32, gid: u32) -> SysResult {
    f.host_fd().ok_or(EACCES)?;
    chown_permitted(os, &special::file_stat(f)?, uid, gid)?;
    let h = changeable_fd(f)?;
    // SAFETY: a descriptor we hold and an empty C string.
    cvt(unsafe { libc::fchownat(h, c"".as_ptr(), uid, gid, libc::AT_EMPTY_PATH) } as i64)
}

pub(super) fn sys_openat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, flags: i32, mode: u32) -> SysResult {
    let path = read_path(ctx, pathp)?;
    let lk = vfs::open_lookup(flags);
    let r = lookup!(os, dirfd, &path, lk)?;
    let file = if r.is_virtual() {
        let p = r.path;
        special::open(os, ctx, &p, flags, lk == Lookup::Follow)?
    } else {
        let tmpfile = flags & libc::O_TMPFILE == libc::O_TMPFILE;
        let creates = flags & libc::O_CREAT != 0 || tmpfile;
        let fifo = !tmpfile && lstat_of(&r).is_some_and(|st| st.is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFIFO));
        let fd = if fifo {
            open_fifo(os, &r, flags)?
        } else if creates {
            let existed = !tmpfile && exists(&r);
            let new = tmpfile || (new_owner(os).is_some() && r.writable() && !existed);
            let fd = super::with_umask(os.proc.umask, || os.vfs.open_resolved(&r, flags, mode))?;
            if new {
                own_new_fd(os, fd.as_raw_fd());
            }
            // The guest's time on what it made or emptied (`stamp`).
            match r.host() {
                Some((d, n)) if !existed && !tmpfile => super::stamp::created_at(&os.proc, d, n),
                _ if flags & libc::O_TRUNC != 0 || tmpfile => super::stamp::written(&os.proc, fd.as_raw_fd()),
                _ => {}
            }
            fd
        } else {
            os.vfs.open_resolved(&r, flags, mode)?
        };
        let mut f = OpenFile::host(fd, Some(r.path.clone()), !r.writable());
        if flags & libc::O_TMPFILE == libc::O_TMPFILE {
            f.dir = false;
            f.label = Some(format!("{}/#{} (deleted)", r.path, f.host_fd().unwrap_or(0)));
            f.path = None;
        }
        Arc::new(f)
    };
    os.files.alloc(0, file, flags & libc::O_CLOEXEC != 0).map(|fd| fd as u64)
}

/// Open a FIFO without ever blocking the VMM in the host's open: the host open is non-blocking,
/// and a guest's blocking open for writing with no reader yet waits in slices (ERESTARTSYS) as its
/// reads and writes do. A blocking open for reading returns at once, and its first read waits (in
/// slices) for a writer's data or close, which is what the open and that read together do under
/// Linux.
fn open_fifo(os: &GuestOs, r: &Resolved, flags: i32) -> Result<OwnedFd, Errno> {
    let fd = match os.vfs.open_resolved(r, flags | libc::O_NONBLOCK, 0) {
        Err(e) if e.0 == libc::ENXIO && flags & libc::O_NONBLOCK == 0 => {
            // A writer and no reader yet: wait a slice (or the other processes' turn), then the
            // guest asks again.
            if crate::guestos::sched::yield_blocked(None) {
                return Err(crate::guestos::signal::ERESTARTSYS);
            }
            // SAFETY: poll with no descriptors is a plain sleep.
            unsafe { libc::poll(std::ptr::null_mut(), 0, super::WAIT_SLICE_MS) };
            return Err(crate::guestos::signal::ERESTARTSYS);
        }
        other => other?,
    };
    if flags & libc::O_NONBLOCK == 0 {
        // SAFETY: fcntl on a descriptor we own.
        let fl = unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_GETFL) };
        // SAFETY: as above.
        cvt(unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFL, fl & !libc::O_NONBLOCK) } as i64)?;
    }
    Ok(fd)
}

/// stat of what `path` names (`path` non-empty).
fn path_stat(os: &GuestOs, dirfd: i32, path: &[u8], mode: Lookup) -> Result<libc::stat, Errno> {
    let r = lookup!(os, dirfd, path, mode)?;
    if r.is_virtual() {
        return special::stat(os, &r.path, mode == Lookup::Follow);
    }
    lstat_of(&r).unwrap_or(Err(EACCES))
}

fn fd_stat(os: &GuestOs, fd: i32) -> Result<libc::stat, Errno> {
    if fd == libc::AT_FDCWD {
        return path_stat(os, fd, b".", Lookup::Follow);
    }
    special::file_stat(&*os.files.file(fd)?)
}

pub(super) fn sys_fstat(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, buf: u64) -> SysResult {
    let mut st = special::file_stat(&*os.files.file(fd)?)?;
    super::stamp::stat_for_guest(&os.proc, &mut st);
    ctx.write(buf, bytes_of(&st))?;
    Ok(0)
}

/// A path argument that may be empty with AT_EMPTY_PATH (then None: the call is on `dirfd`).
fn path_or_empty(ctx: &Ctx, p: u64, flags: i32) -> Result<Option<Vec<u8>>, Errno> {
    if p == 0 && flags & libc::AT_EMPTY_PATH != 0 {
        return Ok(None);
    }
    let v = read_path(ctx, p)?;
    if v.is_empty() {
        return if flags & libc::AT_EMPTY_PATH != 0 { Ok(None) } else { Err(ENOENT) };
    }
    Ok(Some(v))
}

fn follow_flag(flags: i32) -> Lookup {
    if flags & libc::AT_SYMLINK_NOFOLLOW != 0 {
        Lookup::NoFollow
    } else {
        Lookup::Follow
    }
}

pub(super) fn sys_fstatat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, buf: u64, flags: i32) -> SysResult {
    if flags & !(libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH | libc::AT_NO_AUTOMOUNT) != 0 {
        return Err(EINVAL);
    }
    let mut st = match path_or_empty(ctx, pathp, flags)? {
        None => fd_stat(os, dirfd)?,
        Some(p) => path_stat(os, dirfd, &p, follow_flag(flags))?,
    };
    super::stamp::stat_for_guest(&os.proc, &mut st);
    ctx.write(buf, bytes_of(&st))?;
    Ok(0)
}

fn host_statx(dir: RawFd, name: &CStr, flags: i32, mask: u32) -> Result<[u8; STATX_SIZE], Errno> {
    let mut b = [0u8; STATX_SIZE];
    // SAFETY: statx writes one struct statx (256 bytes) into `b`; the name is a valid C string.
    let r = unsafe { libc::syscall(libc::SYS_statx, dir, name.as_ptr(), flags, mask, b.as_mut_ptr()) };
    cvt(r)?;
    Ok(b)
}

/// struct statx from a struct stat (for engine files).
fn statx_of(st: &libc::stat) -> [u8; STATX_SIZE] {
    let mut b = [0u8; STATX_SIZE];
    let mut put = |off: usize, v: &[u8]| b[off..off + v.len()].copy_from_slice(v);
    put(0, &0x7ffu32.to_le_bytes()); // STATX_BASIC_STATS
    put(4, &(st.st_blksize as u32).to_le_bytes());
    put(16, &(st.st_nlink as u32).to_le_bytes());
    put(20, &st.st_uid.to_le_bytes());
    put(24, &st.st_gid.to_le_bytes());
    put(28, &(st.st_mode as u16).to_le_bytes());
    put(32, &st.st_ino.to_le_bytes());
    put(40, &(st.st_size as u64).to_le_bytes());
    put(48, &(st.st_blocks as u64).to_le_bytes());
    for (off, sec, nsec) in [(64, st.st_atime, st.st_atime_nsec), (96, st.st_ctime, st.st_ctime_nsec), (112, st.st_mtime, st.st_mtime_nsec)] {
        put(off, &sec.to_le_bytes());
        put(off + 8, &(nsec as u32).to_le_bytes());
    }
    put(128, &libc::major(st.st_rdev).to_le_bytes());
    put(132, &libc::minor(st.st_rdev).to_le_bytes());
    put(136, &libc::major(st.st_dev).to_le_bytes());
    put(140, &libc::minor(st.st_dev).to_le_bytes());
    b
}

pub(super) fn sys_statx(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, flags: i32, mask: u32, buf: u64) -> SysResult {
    let known = libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH | libc::AT_NO_AUTOMOUNT | libc::AT_STATX_SYNC_TYPE;
    if flags & !known != 0 || flags & libc::AT_STATX_SYNC_TYPE == libc::AT_STATX_SYNC_TYPE {
        return Err(EINVAL);
    }
    let sync = flags & libc::AT_STATX_SYNC_TYPE;
    let mut b = match path_or_empty(ctx, pathp, flags)? {
        None if dirfd == libc::AT_FDCWD => {
            let r = lookup!(os, dirfd, b".", Lookup::Follow)?;
            let (d, n) = host_of(&r).map_err(|_| ENOENT)?;
            host_statx(d, n, libc::AT_SYMLINK_NOFOLLOW | sync, mask)?
        }
        None => {
            let f = os.files.file(dirfd)?;
            match f.host_fd() {
                Some(h) => host_statx(h, c"", libc::AT_EMPTY_PATH | sync, mask)?,
                None => statx_of(&special::file_stat(&f)?),
            }
        }
        Some(p) => {
            let mode = follow_flag(flags);
            let r = lookup!(os, dirfd, &p, mode)?;
            if r.is_virtual() {
                statx_of(&special::stat(os, &r.path, mode == Lookup::Follow)?)
            } else {
                let (d, n) = host_of(&r)?;
                host_statx(d, n, libc::AT_SYMLINK_NOFOLLOW | sync, mask)?
            }
        }
    };
    super::stamp::statx_for_guest(&os.proc, &mut b);
    ctx.write(buf, &b)?;
    Ok(0)
}

pub(super) fn sys_faccessat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, mode: i32, flags: i32) -> SysResult {
    if mode & !(libc::R_OK | libc::W_OK | libc::X_OK) != 0
        || flags & !(libc::AT_SYMLINK_NOFOLLOW | libc::AT_EACCESS | libc::AT_EMPTY_PATH) != 0
    {
        return Err(EINVAL);
    }
    let (st, ro) = match path_or_empty(ctx, pathp, flags)? {
        None => {
            let st = fd_stat(os, dirfd)?;
            let ro = dirfd != libc::AT_FDCWD && os.files.file(dirfd)?.ro;
            (st, ro)
        }
        Some(p) => {
            let lk = follow_flag(flags);
            let r = lookup!(os, dirfd, &p, lk)?;
            if r.is_virtual() {
                (special::stat(os, &r.path, lk == Lookup::Follow)?, false)
            } else {
                let (d, n) = host_of(&r)?;
                (host_stat(d, n)?, !r.writable())
            }
        }
    };
    // The guest is root: read and write are allowed, execute needs some x bit (or a directory).
    let fmt = st.st_mode & libc::S_IFMT;
    if mode & libc::W_OK != 0 && ro && matches!(fmt, libc::S_IFREG | libc::S_IFDIR | libc::S_IFLNK) {
        return Err(EROFS);
    }
    if mode & libc::X_OK != 0 && fmt != libc::S_IFDIR && st.st_mode & 0o111 == 0 {
        return Err(EACCES);
    }
    Ok(0)
}

pub(super) fn sys_readlinkat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, buf: u64, size: u64) -> SysResult {
    if (size as i64) <= 0 {
        return Err(EINVAL);
    }
    let path = read_path(ctx, pathp)?;
    if path.is_empty() {
        return Err(ENOENT);
    }
    let r = lookup!(os, dirfd, &path, Lookup::NoFollow)?;
    let target = if r.is_virtual() {
        special::readlink(os, &r.path)?
    } else {
        let (d, n) = host_of(&r)?;
        vfs::readlink_at(d, n)?
    };
    let n = target.len().min(size as usize);
    ctx.write(buf, &target[..n])?;
    Ok(n as u64)
}

pub(super) fn sys_getcwd(os: &mut GuestOs, ctx: &mut Ctx, buf: u64, size: u64) -> SysResult {
    let mut cwd = vfs::guest_bytes(special::cwd(os));
    cwd.push(0);
    if (size as usize) < cwd.len() {
        return Err(ERANGE);
    }
    ctx.write(buf, &cwd)?;
    Ok(cwd.len() as u64)
}

pub(super) fn sys_chdir(os: &mut GuestOs, ctx: &mut Ctx, pathp: u64) -> SysResult {
    let path = read_path(ctx, pathp)?;
    let r = lookup!(os, libc::AT_FDCWD, &path, Lookup::Follow)?;
    if r.is_virtual() {
        let p = r.path;
        if !matches!(special::lookup(os, &p), Some(special::Node::Dir)) {
            return Err(if special::lookup(os, &p).is_some() { ENOTDIR } else { ENOENT });
        }
        os.proc.cwd = p;
        return Ok(0);
    }
    let (d, n) = host_of(&r)?;
    vfs::openat2_c(d, n, libc::O_PATH | libc::O_DIRECTORY, 0, vfs::RESOLVE_ONE)?;
    let p = r.path;
    os.proc.cwd = p;
    Ok(0)
}

pub(super) fn sys_fchdir(os: &mut GuestOs, fd: i32) -> SysResult {
    os.proc.cwd = os.files.dir_path(fd)?;
    Ok(0)
}

pub(super) fn sys_mkdirat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, mode: u32) -> SysResult {
    let path = read_path(ctx, pathp)?;
    let r = new_name(os, dirfd, &path)?;
    let (d, n) = host_of(&r)?;
    // SAFETY: a valid fd and C string (one component).
    super::with_umask(os.proc.umask, || cvt(unsafe { libc::mkdirat(d, n.as_ptr(), mode & 0o7777) } as i64))?;
    own_new_at(os, d, n);
    Ok(0)
}

/// mknod and mknodat: regular files and FIFOs (host FIFOs in the sandbox's own directories, see
/// `open_fifo`). Devices need privileges the sandbox does not give, and sockets would be host
/// objects the engine does not serve: EPERM, once the path itself is fine (ENOENT, EEXIST, EROFS
/// come first).
pub(super) fn sys_mknodat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, mode: u32) -> SysResult {
    let kind = mode & libc::S_IFMT;
    if ![0, libc::S_IFREG, libc::S_IFIFO, libc::S_IFSOCK, libc::S_IFCHR, libc::S_IFBLK].contains(&kind) {
        return Err(EINVAL);
    }
    let path = read_path(ctx, pathp)?;
    let r = new_name(os, dirfd, &path)?;
    let (d, n) = host_of(&r)?;
    if exists(&r) {
        return Err(EEXIST);
    }
    if kind == libc::S_IFIFO {
        // SAFETY: a valid fd and C string (one component).
        super::with_umask(os.proc.umask, || cvt(unsafe { libc::mknodat(d, n.as_ptr(), libc::S_IFIFO | (mode & 0o7777), 0) } as i64))?;
        own_new_at(os, d, n);
        return Ok(0);
    }
    if kind != 0 && kind != libc::S_IFREG {
        return Err(crate::guestos::EPERM);
    }
    let flags = libc::O_CREAT | libc::O_EXCL | libc::O_WRONLY | libc::O_CLOEXEC | libc::O_NOFOLLOW;
    // SAFETY: a valid fd and C string (one component); the new descriptor is closed at once.
    let fd = super::with_umask(os.proc.umask, || cvt(unsafe { libc::openat(d, n.as_ptr(), flags, mode & 0o7777) } as i64))?;
    own_new_fd(os, fd as RawFd);
    super::stamp::created_at(&os.proc, d, n);
    // SAFETY: closing the descriptor just opened.
    unsafe { libc::close(fd as i32) };
    Ok(0)
}

pub(super) fn sys_unlinkat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, flags: i32) -> SysResult {
    if flags & !libc::AT_REMOVEDIR != 0 {
        return Err(EINVAL);
    }
    let path = read_path(ctx, pathp)?;
    let r = lookup!(os, dirfd, &path, Lookup::Parent)?;
    if flags & libc::AT_REMOVEDIR != 0 && r.is_dir_itself() {
        // rmdir of ".", "..", "/" or a mount point.
        return Err(if r.path == "/" || os.vfs.mounts.iter().any(|m| m.at == r.path) { EBUSY } else { EINVAL });
    }
    check_writable(&r)?;
    let (d, n) = host_of(&r)?;
    if flags & libc::AT_REMOVEDIR == 0 && path.ends_with(b"/") {
        // unlink("x/"): Linux refuses, whatever x is.
        let st = host_stat(d, n)?;
        return Err(if st.st_mode & libc::S_IFMT == libc::S_IFDIR { EISDIR } else { ENOTDIR });
    }
    // SAFETY: a valid fd and C string (one component).
    cvt(unsafe { libc::unlinkat(d, n.as_ptr(), flags) } as i64)?;
    super::stamp::dir_changed(&os.proc, d);
    Ok(0)
}

pub(super) fn sys_renameat2(os: &mut GuestOs, ctx: &mut Ctx, olddir: i32, oldp: u64, newdir: i32, newp: u64, flags: u32) -> SysResult {
    if flags & !(libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE) != 0
        || flags == libc::RENAME_NOREPLACE | libc::RENAME_EXCHANGE
    {
        return Err(EINVAL);
    }
    let old = read_path(ctx, oldp)?;
    let new = read_path(ctx, newp)?;
    let ro = lookup!(os, olddir, &old, Lookup::Parent)?;
    let rn = lookup!(os, newdir, &new, Lookup::Parent)?;
    if ro.is_dir_itself() || rn.is_dir_itself() {
        return Err(EBUSY);
    }
    check_writable(&ro)?;
    check_writable(&rn)?;
    same_mount(&ro, &rn)?;
    let (d1, n1) = host_of(&ro)?;
    let (d2, n2) = host_of(&rn)?;
    // SAFETY: valid fds and C strings (one component each).
    let r = unsafe { libc::renameat2(d1, n1.as_ptr(), d2, n2.as_ptr(), flags) };
    cvt(r as i64)?;
    super::stamp::dir_changed(&os.proc, d1);
    super::stamp::dir_changed(&os.proc, d2);
    Ok(0)
}

pub(super) fn sys_linkat(os: &mut GuestOs, ctx: &mut Ctx, olddir: i32, oldp: u64, newdir: i32, newp: u64, flags: i32) -> SysResult {
    if flags & !(libc::AT_SYMLINK_FOLLOW | libc::AT_EMPTY_PATH) != 0 {
        return Err(EINVAL);
    }
    let new = read_path(ctx, newp)?;
    let rn = lookup!(os, newdir, &new, Lookup::Parent)?;
    check_creatable(&rn)?;
    let (d2, n2) = host_of(&rn)?;
    let r = match path_or_empty(ctx, oldp, flags)? {
        None => {
            let f = os.files.file(olddir)?;
            let h = f.host_fd().ok_or(EXDEV)?;
            if f.ro {
                return Err(EXDEV);
            }
            // SAFETY: valid fds and C strings.
            unsafe { libc::linkat(h, c"".as_ptr(), d2, n2.as_ptr(), libc::AT_EMPTY_PATH) }
        }
        Some(old) => {
            let lk = if flags & libc::AT_SYMLINK_FOLLOW != 0 { Lookup::Follow } else { Lookup::Parent };
            let ro = lookup!(os, olddir, &old, lk)?;
            if ro.is_virtual() {
                return Err(EXDEV);
            }
            if !ro.writable() {
                return Err(EXDEV);
            }
            same_mount(&ro, &rn)?;
            let (d1, n1) = host_of(&ro)?;
            // SAFETY: valid fds and C strings (one component each); linkat does not follow.
            unsafe { libc::linkat(d1, n1.as_ptr(), d2, n2.as_ptr(), 0) }
        }
    };
    cvt(r as i64)?;
    super::stamp::dir_changed(&os.proc, d2);
    Ok(0)
}

pub(super) fn sys_symlinkat(os: &mut GuestOs, ctx: &mut Ctx, targetp: u64, newdir: i32, linkp: u64) -> SysResult {
    let target = read_path(ctx, targetp)?;
    if target.is_empty() {
        return Err(ENOENT);
    }
    let link = read_path(ctx, linkp)?;
    let r = lookup!(os, newdir, &link, Lookup::Parent)?;
    check_creatable(&r)?;
    let (d, n) = host_of(&r)?;
    let t = std::ffi::CString::new(target).map_err(|_| EINVAL)?;
    // SAFETY: valid fd and C strings. The target is stored, never followed by the host.
    cvt(unsafe { libc::symlinkat(t.as_ptr(), d, n.as_ptr()) } as i64)?;
    own_new_at(os, d, n);
    Ok(0)
}

fn host_chmod(d: RawFd, n: &CStr, mode: u32) -> Result<u64, Errno> {
    const SYS_FCHMODAT2: libc::c_long = 452;
    // SAFETY: valid fd and C string; AT_SYMLINK_NOFOLLOW: a symlink is refused, never followed.
    let r = unsafe { libc::syscall(SYS_FCHMODAT2, d, n.as_ptr(), mode, libc::AT_SYMLINK_NOFOLLOW) };
    match cvt(r) {
        Err(e) if e == crate::guestos::ENOSYS => {
            // Hosts before Linux 6.6: open the file itself (not following) and fchmod it.
            let fd = vfs::openat2_c(d, n, libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY, 0, vfs::RESOLVE_ONE)?;
            // SAFETY: fchmod on an fd we own.
            cvt(unsafe { libc::fchmod(fd.as_raw_fd(), mode) } as i64)
        }
        other => other,
    }
}

pub(super) fn sys_fchmodat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, mode: u32, flags: i32) -> SysResult {
    if flags & !(libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH) != 0 {
        return Err(EINVAL);
    }
    let mode = mode & 0o7777;
    let Some(path) = path_or_empty(ctx, pathp, flags)? else {
        return sys_fchmod(os, dirfd, mode);
    };
    let lk = follow_flag(flags);
    let r = lookup!(os, dirfd, &path, lk)?;
    if let Some(f) = magic_file(os, &r, lk) {
        return chmod_file(&f, mode);
    }
    if r.is_virtual() {
        return Err(match special::lookup(os, &r.path) {
            // A symlink itself (not followed): Linux's symlinks take no mode.
            Some(special::Node::Link(_) | special::Node::Fd(_)) => EOPNOTSUPP,
            Some(_) => EACCES,
            None => ENOENT,
        });
    }
    let (d, n) = host_of(&r)?;
    let st = host_stat(d, n)?;
    if st.st_mode & libc::S_IFMT == libc::S_IFLNK {
        return Err(EOPNOTSUPP);
    }
    check_writable(&r)?;
    host_chmod(d, n, mode)
}

pub(super) fn sys_fchmod(os: &mut GuestOs, fd: i32, mode: u32) -> SysResult {
    let f = os.files.file(fd)?;
    match f.host_fd() {
        Some(_) if f.ro => Err(EROFS),
        // SAFETY: fchmod on an fd we own (O_PATH fds fail with EBADF, as in Linux).
        Some(h) => cvt(unsafe { libc::fchmod(h, mode & 0o7777) } as i64),
        None => Err(EACCES),
    }
}

/// chown family: ownership is not modelled; succeed on what exists and may change.
pub(super) fn sys_fchownat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, uid: u32, gid: u32, flags: i32) -> SysResult {
    if flags & !(libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH) != 0 {
        return Err(EINVAL);
    }
    let Some(path) = path_or_empty(ctx, pathp, flags)? else {
        if dirfd == libc::AT_FDCWD {
            let r = lookup!(os, dirfd, b".", Lookup::Follow)?;
            return chown_resolved(os, &r, uid, gid, 0);
        }
        return sys_fchown(os, dirfd, uid, gid);
    };
    let lk = follow_flag(flags);
    let r = lookup!(os, dirfd, &path, lk)?;
    if let Some(f) = magic_file(os, &r, lk) {
        return chown_file(os, &f, uid, gid);
    }
    chown_resolved(os, &r, uid, gid, libc::AT_SYMLINK_NOFOLLOW)
}

fn chown_resolved(os: &GuestOs, r: &Resolved, uid: u32, gid: u32, flags: i32) -> SysResult {
    if r.is_virtual() {
        special::stat(os, &r.path, false)?;
        return Err(EACCES);
    }
    let (d, n) = host_of(r)?;
    let st = host_stat(d, n)?;
    chown_permitted(os, &st, uid, gid)?;
    check_writable(r)?;
    // SAFETY: valid fd and C string (one component, already resolved: never followed here).
    cvt(unsafe { libc::fchownat(d, n.as_ptr(), uid, gid, flags) } as i64)
}

pub(super) fn sys_truncate(os: &mut GuestOs, ctx: &mut Ctx, pathp: u64, len: i64) -> SysResult {
    if len < 0 {
        return Err(EINVAL);
    }
    let path = read_path(ctx, pathp)?;
    let r = lookup!(os, libc::AT_FDCWD, &path, Lookup::Follow)?;
    if r.is_virtual() {
        return Err(if special::lookup(os, &r.path).is_some() { EACCES } else { ENOENT });
    }
    let (d, n) = host_of(&r)?;
    let st = host_stat(d, n)?;
    match st.st_mode & libc::S_IFMT {
        libc::S_IFDIR => return Err(EISDIR),
        libc::S_IFREG => {}
        _ => return Err(EINVAL),
    }
    check_writable(&r)?;
    let fd = vfs::openat2_c(d, n, libc::O_WRONLY | libc::O_NONBLOCK | libc::O_NOCTTY, 0, vfs::RESOLVE_ONE)?;
    // SAFETY: ftruncate on an fd we own.
    cvt(unsafe { libc::ftruncate(fd.as_raw_fd(), len) } as i64)
}

/// struct statfs as the guest sees it, with ST_RDONLY in f_flags (offset 80) for a read-only mount.
fn statfs_bytes(s: &libc::statfs, ro: bool) -> Vec<u8> {
    let mut b = bytes_of(s).to_vec();
    if ro {
        let flags = u64::from_le_bytes(b[80..88].try_into().unwrap_or_default()) | libc::ST_RDONLY;
        b[80..88].copy_from_slice(&flags.to_le_bytes());
    }
    b
}

fn host_statfs(fd: RawFd) -> Result<libc::statfs, Errno> {
    // SAFETY: a zeroed statfs is valid; fstatfs fills it.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: a valid fd (O_PATH is fine) and out-pointer.
    cvt(unsafe { libc::fstatfs(fd, &mut s) } as i64)?;
    Ok(s)
}

pub(super) fn sys_statfs(os: &mut GuestOs, ctx: &mut Ctx, pathp: u64, buf: u64) -> SysResult {
    let path = read_path(ctx, pathp)?;
    let r = lookup!(os, libc::AT_FDCWD, &path, Lookup::Follow)?;
    let s = if r.is_virtual() {
        special::stat(os, &r.path, true)?;
        statfs_bytes(&special::statfs(&r.path), false)
    } else {
        let (d, n) = host_of(&r)?;
        host_stat(d, n)?;
        statfs_bytes(&host_statfs(d)?, !r.writable())
    };
    ctx.write(buf, &s)?;
    Ok(0)
}

pub(super) fn sys_fstatfs(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, buf: u64) -> SysResult {
    let f = os.files.file(fd)?;
    let s = match f.host_fd() {
        Some(h) => statfs_bytes(&host_statfs(h)?, f.ro),
        None => statfs_bytes(&special::statfs(f.path.as_deref().unwrap_or("/dev")), false),
    };
    ctx.write(buf, &s)?;
    Ok(0)
}

/// "Now" in utimensat's times (None, or UTIME_NOW) as the guest's clock shows it: in replay mode
/// virtual time, not the host's (a file touched "now" must read as touched at `time.time()`).
fn guest_now(os: &mut GuestOs, times: Option<[libc::timespec; 2]>) -> Result<Option<[libc::timespec; 2]>, Errno> {
    if !os.proc.clocks.replay {
        return Ok(times);
    }
    let mut t = times.unwrap_or([libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_NOW }; 2]);
    if t.iter().any(|ts| ts.tv_nsec == libc::UTIME_NOW) {
        let (sec, nsec) = crate::guestos::clock::clock_now(&mut os.proc, libc::CLOCK_REALTIME)?;
        for ts in t.iter_mut().filter(|ts| ts.tv_nsec == libc::UTIME_NOW) {
            *ts = libc::timespec { tv_sec: sec, tv_nsec: nsec };
        }
    }
    Ok(Some(t))
}

/// Set times on what `path` (or, if None, `dirfd`) names. `times`: None for "now".
fn set_times(os: &mut GuestOs, dirfd: i32, path: Option<&[u8]>, times: Option<[libc::timespec; 2]>, flags: i32) -> SysResult {
    let times = guest_now(os, times)?;
    let omit_all = times.is_some_and(|t| t.iter().all(|ts| ts.tv_nsec == libc::UTIME_OMIT));
    let tp = times.as_ref().map_or(std::ptr::null(), |t| t.as_ptr());
    let Some(path) = path else {
        if dirfd == libc::AT_FDCWD {
            return set_times(os, dirfd, Some(b"."), times, 0);
        }
        let f = os.files.file(dirfd)?;
        let Some(h) = f.host_fd() else {
            return Err(EACCES);
        };
        if omit_all {
            return Ok(0);
        }
        if f.ro {
            return Err(EROFS);
        }
        // SAFETY: futimens on an fd we own with a null or valid two-timespec array.
        return cvt(unsafe { libc::futimens(h, tp) } as i64);
    };
    let lk = follow_flag(flags);
    let r = lookup!(os, dirfd, path, lk)?;
    if let Some(f) = magic_file(os, &r, lk) {
        let h = changeable_fd(&f)?;
        if omit_all {
            return Ok(0);
        }
        // SAFETY: a descriptor we hold, an empty C string and a null or valid two-timespec array.
        return cvt(unsafe { libc::utimensat(h, c"".as_ptr(), tp, libc::AT_EMPTY_PATH) } as i64);
    }
    if r.is_virtual() {
        special::stat(os, &r.path, true)?;
        return Err(EACCES);
    }
    let (d, n) = host_of(&r)?;
    host_stat(d, n)?;
    if omit_all {
        return Ok(0);
    }
    check_writable(&r)?;
    // SAFETY: valid fd, C string and a null or valid two-timespec array; never follows.
    cvt(unsafe { libc::utimensat(d, n.as_ptr(), tp, libc::AT_SYMLINK_NOFOLLOW) } as i64)
}

fn read_timespecs(ctx: &Ctx, p: u64) -> Result<Option<[libc::timespec; 2]>, Errno> {
    if p == 0 {
        return Ok(None);
    }
    let b = ctx.read_vec(p, 32)?;
    let w = |i: usize| i64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default());
    let mut t = [libc::timespec { tv_sec: 0, tv_nsec: 0 }; 2];
    for (i, ts) in t.iter_mut().enumerate() {
        ts.tv_sec = w(2 * i);
        ts.tv_nsec = w(2 * i + 1);
        if ts.tv_nsec != libc::UTIME_NOW && ts.tv_nsec != libc::UTIME_OMIT && !(0..1_000_000_000).contains(&ts.tv_nsec) {
            return Err(EINVAL);
        }
    }
    Ok(Some(t))
}

pub(super) fn sys_utimensat(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, timesp: u64, flags: i32) -> SysResult {
    if flags & !(libc::AT_SYMLINK_NOFOLLOW | libc::AT_EMPTY_PATH) != 0 {
        return Err(EINVAL);
    }
    let times = read_timespecs(ctx, timesp)?;
    // utimensat(fd, NULL, ...) is futimens(fd).
    let path = if pathp == 0 { None } else { path_or_empty(ctx, pathp, flags)? };
    set_times(os, dirfd, path.as_deref(), times, flags)
}

/// utimes and futimesat: struct timeval[2] (NULL: now).
pub(super) fn sys_utimes(os: &mut GuestOs, ctx: &mut Ctx, dirfd: i32, pathp: u64, tvp: u64) -> SysResult {
    let times = if tvp == 0 {
        None
    } else {
        let b = ctx.read_vec(tvp, 32)?;
        let w = |i: usize| i64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let mut t = [libc::timespec { tv_sec: 0, tv_nsec: 0 }; 2];
        for (i, ts) in t.iter_mut().enumerate() {
            let usec = w(2 * i + 1);
            if !(0..1_000_000).contains(&usec) {
                return Err(EINVAL);
            }
            ts.tv_sec = w(2 * i);
            ts.tv_nsec = usec * 1000;
        }
        Some(t)
    };
    let path = read_path(ctx, pathp)?;
    if path.is_empty() {
        return Err(ENOENT);
    }
    set_times(os, dirfd, Some(&path), times, 0)
}

/// utime: struct utimbuf { actime, modtime } (NULL: now).
pub(super) fn sys_utime(os: &mut GuestOs, ctx: &mut Ctx, pathp: u64, bufp: u64) -> SysResult {
    let times = if bufp == 0 {
        None
    } else {
        let b = ctx.read_vec(bufp, 16)?;
        let w = |i: usize| i64::from_le_bytes(b[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        Some([libc::timespec { tv_sec: w(0), tv_nsec: 0 }, libc::timespec { tv_sec: w(1), tv_nsec: 0 }])
    };
    let path = read_path(ctx, pathp)?;
    if path.is_empty() {
        return Err(ENOENT);
    }
    set_times(os, libc::AT_FDCWD, Some(&path), times, 0)
}

/// What an xattr call names: a path (with AT_SYMLINK_NOFOLLOW for the l* forms) or a descriptor.
pub(super) enum XattrOn {
    Path(i32),
    Fd(i32),
}

const XATTR_NAME_MAX: usize = 255;
const XATTR_SIZE_MAX: usize = 65536;

/// The extended-attribute calls (set/get/list/remove, by path, l* path or fd): on the host file.
/// The guest's "user." attributes are the host file's user attributes. Its "trusted." namespace
/// (Linux: readable and writable with CAP_SYS_ADMIN only, so here by a guest whose effective uid
/// is 0) is kept on the host file under [`TRUSTED_PREFIX`] in the user namespace: the host's own
/// trusted attributes are never the guest's. Names under that prefix are the engine's: a guest
/// neither sees them as user attributes nor sets them. Other namespaces (security, system) are
/// the host's: the guest may read what the host file has, change nothing. Changes only on
/// writable mounts. The engine's own files (/dev, /proc, its pipes) have none: EOPNOTSUPP. A
/// symlink itself, as under Linux, takes no user attributes.
pub(super) fn sys_xattr(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6], on: XattrOn) -> SysResult {
    use super::nr::*;
    let op = match nr {
        SETXATTR | LSETXATTR | FSETXATTR => 0,
        GETXATTR | LGETXATTR | FGETXATTR => 1,
        LISTXATTR | LLISTXATTR | FLISTXATTR => 2,
        _ => 3,
    };
    // The host descriptor to work on, whether changes are allowed, and for a symlink itself its
    // directory and name (no descriptor can name it).
    let (owned, fd, writable, link) = match on {
        XattrOn::Fd(gfd) => {
            let file = os.files.file(gfd)?;
            let Some(h) = file.host_fd() else { return Err(EOPNOTSUPP) };
            (None, h, !file.ro, None)
        }
        XattrOn::Path(flags) => {
            let path = read_path(ctx, a[0])?;
            if path.is_empty() {
                return Err(ENOENT);
            }
            let r = lookup!(os, libc::AT_FDCWD, &path, follow_flag(flags))?;
            if r.is_virtual() {
                special::stat(os, &r.path, flags & libc::AT_SYMLINK_NOFOLLOW == 0)?;
                return Err(EOPNOTSUPP);
            }
            let (d, n) = host_of(&r)?;
            let oflags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_CLOEXEC | libc::O_NOFOLLOW | libc::O_NOCTTY;
            // SAFETY: a valid fd and C string (one component, already resolved).
            match cvt(unsafe { libc::openat(d, n.as_ptr(), oflags) } as i64) {
                // SAFETY: a fresh descriptor we own.
                Ok(h) => (Some(unsafe { OwnedFd::from_raw_fd(h as RawFd) }), h as RawFd, r.writable(), None),
                // The lookup's directory fd closes with `r`: keep a copy of it.
                // SAFETY: F_DUPFD_CLOEXEC of a valid descriptor; the result is checked.
                Err(e) if e.0 == libc::ELOOP => match cvt(unsafe { libc::fcntl(d, libc::F_DUPFD_CLOEXEC, 0) } as i64) {
                    // SAFETY: a fresh descriptor we own.
                    Ok(dir) => (None, -1, r.writable(), Some((unsafe { OwnedFd::from_raw_fd(dir as RawFd) }, n.to_owned()))),
                    Err(e) => return Err(e),
                },
                Err(e) => return Err(e),
            }
        }
    };
    let _keep = owned;
    let symlink = link.is_some();
    let name = if op == 2 { Vec::new() } else { xattr_name(ctx, a[1])? };
    let admin = os.proc.uid[1] == 0;
    if let Some((d, n)) = &link {
        if admin && (op == 2 || XattrNs::of(&name) == XattrNs::Trusted) {
            return symlink_trusted(ctx, op, a, (d.as_raw_fd(), n), &name, writable);
        }
    }
    let (host_name, user) = match XattrNs::of(&name) {
        XattrNs::User => (name, true),
        XattrNs::Reserved => return Err(if op == 0 { EOPNOTSUPP } else { crate::guestos::ENODATA }),
        XattrNs::Trusted if !admin => return Err(if op == 0 || op == 3 { crate::guestos::EPERM } else { crate::guestos::ENODATA }),
        XattrNs::Trusted => ([TRUSTED_PREFIX, &name[b"trusted.".len()..]].concat(), true),
        XattrNs::Other => (name, false),
    };
    let cname = std::ffi::CString::new(host_name).map_err(|_| EINVAL)?;
    match op {
        0 => {
            let (len, flags) = (a[3] as usize, a[4] as i32);
            if flags & !(libc::XATTR_CREATE | libc::XATTR_REPLACE) != 0 {
                return Err(EINVAL);
            }
            if len > XATTR_SIZE_MAX {
                return Err(crate::guestos::E2BIG);
            }
            let value = if len == 0 { Vec::new() } else { ctx.read_vec(a[2], len)? };
            may_change(user, writable, symlink)?;
            // SAFETY: a valid descriptor, C string and buffer of `len` bytes.
            cvt(unsafe { libc::fsetxattr(fd, cname.as_ptr(), value.as_ptr().cast(), value.len(), flags) } as i64).map(|_| 0)
        }
        1 => {
            if symlink {
                return Err(crate::guestos::ENODATA);
            }
            let size = (a[3] as usize).min(XATTR_SIZE_MAX);
            let mut buf = vec![0u8; size];
            // SAFETY: a valid descriptor, C string and buffer of `size` bytes (a null buffer of 0 asks the size).
            let n = cvt(unsafe { libc::fgetxattr(fd, cname.as_ptr(), if size == 0 { std::ptr::null_mut() } else { buf.as_mut_ptr().cast() }, size) } as i64)?;
            if size > 0 {
                ctx.write(a[2], &buf[..n as usize])?;
            }
            Ok(n as u64)
        }
        2 => {
            if symlink {
                return Ok(0);
            }
            // The host's list, translated: it can be longer or shorter than the guest's, so it is
            // always read in full and the guest's size rules (ERANGE) apply to the translation.
            let host = host_names(|b, n| {
                // SAFETY: a valid descriptor and a buffer of the size given (null for 0).
                unsafe { libc::flistxattr(fd, b, n) as i64 }
            })?;
            answer_list(ctx, a, &guest_xattr_list(&host, admin))
        }
        _ => {
            may_change(user, writable, symlink)?;
            // SAFETY: a valid descriptor and C string.
            cvt(unsafe { libc::fremovexattr(fd, cname.as_ptr()) } as i64).map(|_| 0)
        }
    }
}

/// Where the guest's "trusted." attributes live on the host file: in the user namespace, under a
/// name of the engine's (see [`sys_xattr`]).
const TRUSTED_PREFIX: &[u8] = b"user.collimate.trusted.";
/// Where they live on a symlink, which takes no user attributes: in the host's trusted namespace,
/// under the engine's name (so only with the engine's own CAP_SYS_ADMIN; without it EPERM, as an
/// unprivileged process gets).
const LINK_TRUSTED_PREFIX: &[u8] = b"trusted.collimate.";

/// A root guest's trusted attributes of a symlink itself (op: 0 set, 1 get, 2 list, 3 remove):
/// l*xattr calls on its name, made from inside its directory (the working directory is restored).
fn symlink_trusted(ctx: &mut Ctx, op: u8, a: [u64; 6], (d, n): (RawFd, &CStr), name: &[u8], writable: bool) -> SysResult {
    let host_name = (op != 2).then(|| [LINK_TRUSTED_PREFIX, &name[b"trusted.".len()..]].concat());
    let cname = std::ffi::CString::new(host_name.unwrap_or_default()).map_err(|_| EINVAL)?;
    if matches!(op, 0 | 3) && !writable {
        return Err(EROFS);
    }
    let value = if op == 0 {
        let len = a[3] as usize;
        if len > XATTR_SIZE_MAX {
            return Err(crate::guestos::E2BIG);
        }
        if len == 0 { Vec::new() } else { ctx.read_vec(a[2], len)? }
    } else {
        Vec::new()
    };
    let mut buf = vec![0u8; if op == 1 { (a[3] as usize).min(XATTR_SIZE_MAX) } else { 0 }];
    let r = in_dir(d, || {
        let p = n.as_ptr();
        // SAFETY: C strings, and buffers of the lengths given (a null buffer of 0 asks the size).
        let rc = unsafe {
            match op {
                0 => libc::lsetxattr(p, cname.as_ptr(), value.as_ptr().cast(), value.len(), a[4] as i32) as i64,
                1 => libc::lgetxattr(p, cname.as_ptr(), if buf.is_empty() { std::ptr::null_mut() } else { buf.as_mut_ptr().cast() }, buf.len()) as i64,
                3 => libc::lremovexattr(p, cname.as_ptr()) as i64,
                // A C string and a buffer of the size given (null for 0).
                _ => return host_names(|b, n| libc::llistxattr(p, b, n) as i64).map(|v| (v.len() as u64, v)),
            }
        };
        cvt(rc).map(|v| (v, Vec::new()))
    })?;
    match op {
        1 if !buf.is_empty() => {
            ctx.write(a[2], &buf[..r.0 as usize])?;
            Ok(r.0)
        }
        2 => {
            let list: Vec<u8> = r.1.split(|&b| b == 0).filter_map(|h| h.strip_prefix(LINK_TRUSTED_PREFIX)).filter(|x| !x.is_empty()).flat_map(|x| [b"trusted.".as_slice(), x, b"\0"].concat()).collect();
            answer_list(ctx, a, &list)
        }
        _ => Ok(r.0),
    }
}

/// Run `f` with host directory `d` as the working directory, then go back.
fn in_dir<T>(d: RawFd, f: impl FnOnce() -> Result<T, Errno>) -> Result<T, Errno> {
    // SAFETY: a NUL-terminated path; the result is checked.
    let here = cvt(unsafe { libc::open(c".".as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) } as i64)?;
    // SAFETY: a fresh descriptor we own.
    let here = unsafe { OwnedFd::from_raw_fd(here as RawFd) };
    // SAFETY: fchdir to a directory descriptor.
    cvt(unsafe { libc::fchdir(d) } as i64)?;
    let r = f();
    // SAFETY: as above; back where we were.
    unsafe { libc::fchdir(here.as_raw_fd()) };
    r
}

/// The namespace of a guest attribute name.
#[derive(Debug, PartialEq, Eq)]
enum XattrNs {
    User,
    /// A user attribute name under [`TRUSTED_PREFIX`]'s "user.collimate.": the engine's.
    Reserved,
    Trusted,
    Other,
}

impl XattrNs {
    fn of(name: &[u8]) -> XattrNs {
        if name.starts_with(b"user.collimate.") {
            XattrNs::Reserved
        } else if name.starts_with(b"user.") {
            XattrNs::User
        } else if name.starts_with(b"trusted.") && name.len() > b"trusted.".len() {
            XattrNs::Trusted
        } else {
            XattrNs::Other
        }
    }
}

/// A host attribute list (names NUL-terminated, concatenated), all of it: `list(buf, size)` is a
/// flistxattr/llistxattr call (a null buffer of size 0 asks for the size).
fn host_names(list: impl Fn(*mut libc::c_char, usize) -> i64) -> Result<Vec<u8>, Errno> {
    loop {
        let n = cvt(list(std::ptr::null_mut(), 0))? as usize;
        let mut buf = vec![0u8; n];
        match cvt(list(buf.as_mut_ptr().cast(), n)) {
            Ok(m) => {
                buf.truncate(m as usize);
                return Ok(buf);
            }
            // The list grew in between (another process of the sandbox): ask again.
            Err(e) if e == ERANGE => continue,
            Err(e) => return Err(e),
        }
    }
}

/// A list*xattr answer: the size (a size of 0 asks), ERANGE if the guest's buffer is too small,
/// else the list written to it.
fn answer_list(ctx: &mut Ctx, a: [u64; 6], list: &[u8]) -> SysResult {
    let size = a[2] as usize;
    if size == 0 {
        return Ok(list.len() as u64);
    }
    if list.len() > size {
        return Err(ERANGE);
    }
    ctx.write(a[1], list)?;
    Ok(list.len() as u64)
}

/// The guest's view of a host attribute list: the engine's names hidden, its trusted ones shown
/// as "trusted." to a guest with effective uid 0 (Linux lists them to CAP_SYS_ADMIN only).
fn guest_xattr_list(host: &[u8], admin: bool) -> Vec<u8> {
    let mut out = Vec::with_capacity(host.len());
    for name in host.split(|&b| b == 0).filter(|n| !n.is_empty()) {
        if let Some(rest) = name.strip_prefix(TRUSTED_PREFIX) {
            if admin && !rest.is_empty() {
                out.extend_from_slice(b"trusted.");
                out.extend_from_slice(rest);
                out.push(0);
            }
        } else if XattrNs::of(name) != XattrNs::Reserved {
            out.extend_from_slice(name);
            out.push(0);
        }
    }
    out
}

/// Whether an attribute may be set or removed: user attributes, on a writable mount, not on a
/// symlink itself.
fn may_change(user: bool, writable: bool, symlink: bool) -> Result<(), Errno> {
    if !user {
        Err(EOPNOTSUPP)
    } else if !writable {
        Err(EROFS)
    } else if symlink {
        Err(crate::guestos::EPERM)
    } else {
        Ok(())
    }
}

/// An attribute name: 1..=255 bytes (ERANGE beyond, as Linux).
fn xattr_name(ctx: &Ctx, p: u64) -> Result<Vec<u8>, Errno> {
    if p == 0 {
        return Err(EFAULT);
    }
    let v = ctx.read_cstr(p, XATTR_NAME_MAX + 1)?;
    if v.is_empty() || v.len() > XATTR_NAME_MAX {
        return Err(ERANGE);
    }
    Ok(v)
}
