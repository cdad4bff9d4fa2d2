//! Unix-domain sockets: socketpair(2) (asyncio's self-pipe, multiprocessing's Pipe) and socket(2)
//! with bind/listen/accept/connect on paths inside the sandbox. Each is a host socket of the VMM,
//! so the processes of one sandbox that share it (a guest fork shares its descriptors) talk through
//! it; a path socket is bound in the sandbox's own directories, which no other sandbox sees.
//!
//! Network sockets (AF_INET, AF_INET6) are `inet`'s: each call here hands them over.
//!
//! Not served: other families (EAFNOSUPPORT), abstract addresses (the host's socket
//! namespace may be shared by clones of one template: EACCES), passing descriptors or credentials
//! (control messages: EOPNOTSUPP). Blocking calls wait in slices, as reads of a pipe do.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::Arc;

use super::{cvt, OpenFile};
use crate::guestos::signal::{self, SigInfo};
use crate::guestos::vfs::Lookup;
use crate::guestos::{Ctx, Errno, GuestOs, SysResult, EACCES, EAGAIN, EFAULT, EINVAL, EOPNOTSUPP};

const AF_UNIX: u64 = 1;
const EAFNOSUPPORT: Errno = Errno(97);
const ENOTSOCK: Errno = Errno(88);
const ENOPROTOOPT: Errno = Errno(92);
const EPROTONOSUPPORT: Errno = Errno(93);
const EINPROGRESS: i32 = 115;
const SUN_PATH_MAX: usize = 108;
const SOCK_TYPES: [i32; 3] = [libc::SOCK_STREAM, libc::SOCK_DGRAM, libc::SOCK_SEQPACKET];
/// The send/recv flags we pass on; others are refused.
const MSG_KNOWN: i32 = libc::MSG_OOB
    | libc::MSG_PEEK
    | libc::MSG_DONTROUTE
    | libc::MSG_TRUNC
    | libc::MSG_DONTWAIT
    | libc::MSG_EOR
    | libc::MSG_WAITALL
    | libc::MSG_NOSIGNAL
    | libc::MSG_MORE
    | libc::MSG_CMSG_CLOEXEC;

fn check_type(ty: i32) -> Result<(i32, bool, bool), Errno> {
    let kind = ty & 0xf;
    if !SOCK_TYPES.contains(&kind) || ty & !(0xf | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) != 0 {
        return Err(EINVAL);
    }
    Ok((kind, ty & libc::SOCK_NONBLOCK != 0, ty & libc::SOCK_CLOEXEC != 0))
}

fn add(os: &mut GuestOs, fd: OwnedFd, cloexec: bool) -> Result<i32, Errno> {
    let f = OpenFile::host(fd, None, false);
    os.files.alloc(0, Arc::new(f), cloexec)
}

pub fn sys_socketpair(os: &mut GuestOs, ctx: &mut Ctx, domain: u64, ty: i32, proto: i32, svp: u64) -> SysResult {
    if domain != AF_UNIX {
        return Err(EAFNOSUPPORT);
    }
    let (kind, nonblock, cloexec) = check_type(ty)?;
    if proto != 0 {
        return Err(EPROTONOSUPPORT);
    }
    let mut sv = [0 as RawFd; 2];
    let host_ty = kind | libc::SOCK_CLOEXEC | if nonblock { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: socketpair writes two descriptors into `sv`.
    cvt(unsafe { libc::socketpair(libc::AF_UNIX, host_ty, 0, sv.as_mut_ptr()) } as i64)?;
    // SAFETY: two fresh descriptors we own.
    let (a, b) = unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) };
    super::install_pair(os, ctx, a, b, cloexec, svp)
}

pub fn sys_socket(os: &mut GuestOs, domain: u64, ty: i32, proto: i32) -> SysResult {
    if domain == libc::AF_INET as u64 || domain == libc::AF_INET6 as u64 {
        return super::inet::socket(os, domain as i32, ty, proto);
    }
    if domain != AF_UNIX {
        return Err(EAFNOSUPPORT);
    }
    let (kind, nonblock, cloexec) = check_type(ty)?;
    if proto != 0 {
        return Err(EPROTONOSUPPORT);
    }
    let host_ty = kind | libc::SOCK_CLOEXEC | if nonblock { libc::SOCK_NONBLOCK } else { 0 };
    // SAFETY: socket with constant arguments; the result is checked and owned below.
    let fd = cvt(unsafe { libc::socket(libc::AF_UNIX, host_ty, 0) } as i64)?;
    // SAFETY: a fresh descriptor we own.
    add(os, unsafe { OwnedFd::from_raw_fd(fd as RawFd) }, cloexec).map(|fd| fd as u64)
}

/// The host socket behind guest fd `fd` (ENOTSOCK for anything else).
fn host_socket(os: &GuestOs, fd: i32) -> Result<RawFd, Errno> {
    let f = os.files.file(fd)?;
    let h = f.host_fd().ok_or(ENOTSOCK)?;
    if super::special::file_stat(&f)?.st_mode & libc::S_IFMT != libc::S_IFSOCK {
        return Err(ENOTSOCK);
    }
    Ok(h)
}

fn nonblocking(h: RawFd) -> bool {
    // SAFETY: fcntl F_GETFL on a descriptor we hold.
    unsafe { libc::fcntl(h, libc::F_GETFL) & libc::O_NONBLOCK != 0 }
}

/// Run `op` without blocking the VMM: a blocking guest call that would block waits (a slice at
/// most) for `events` as reads of a pipe do, then is restarted (ERESTARTSYS) to try again.
fn sliced(h: RawFd, events: i16, dontwait: bool, mut op: impl FnMut() -> i64) -> Result<u64, Errno> {
    let r = op();
    if r >= 0 {
        return Ok(r as u64);
    }
    let e = Errno::last();
    if (e != EAGAIN && e.0 != EINPROGRESS) || dontwait || nonblocking(h) {
        return Err(e);
    }
    super::wait_stream(h, events)?;
    Err(signal::ERESTARTSYS)
}

/// The names of a Unix socket as the guest sees them. The host socket is bound (and connected)
/// by a name relative to its directory (see [`in_dir`]), so the host's getsockname gives only that
/// last component, and a program that passes the name on (multiprocessing's managers send their
/// listener's `getsockname()` to their clients) would hand out a path that does not exist.
#[derive(Default, Clone)]
pub struct UnixNames {
    /// The path it was bound to; for an accepted socket, its listener's.
    pub local: Option<Vec<u8>>,
    /// The path it connected to.
    pub peer: Option<Vec<u8>>,
}

/// The path of a guest sockaddr_un (up to its NUL), as given.
fn sun_path(ctx: &Ctx, addr: u64, len: u32) -> Result<Vec<u8>, Errno> {
    let b = ctx.read_vec(addr, len as usize)?;
    Ok(b.get(2..).unwrap_or_default().iter().copied().take_while(|&c| c != 0).collect())
}

/// A guest sockaddr_un naming a path in the sandbox: the host directory and name to bind or
/// connect to (relative to that directory).
fn unix_path(os: &GuestOs, ctx: &Ctx, addr: u64, len: u32, create: bool) -> Result<(OwnedFd, CString), Errno> {
    if addr == 0 {
        return Err(EFAULT);
    }
    if (len as usize) < 2 || len as usize > 2 + SUN_PATH_MAX {
        return Err(EINVAL);
    }
    let b = ctx.read_vec(addr, len as usize)?;
    if u16::from_le_bytes([b[0], b[1]]) as u64 != AF_UNIX {
        return Err(EAFNOSUPPORT);
    }
    let path: Vec<u8> = b[2..].iter().copied().take_while(|&c| c != 0).collect();
    if path.is_empty() {
        // Abstract (or autobind) addresses: refused, see the module comment.
        return Err(EACCES);
    }
    let mode = if create { Lookup::Parent } else { Lookup::Follow };
    let r = os.vfs.resolve(&os.proc.cwd, &path, mode, None)?;
    if r.is_virtual() {
        return Err(EACCES);
    }
    if create && !r.writable() {
        return Err(crate::guestos::EROFS);
    }
    let (d, n) = r.host().ok_or(EACCES)?;
    // SAFETY: dup of a directory descriptor the resolution holds (we keep our own for the call).
    let dir = cvt(unsafe { libc::fcntl(d, libc::F_DUPFD_CLOEXEC, 0) } as i64)?;
    // SAFETY: a fresh descriptor we own.
    Ok((unsafe { OwnedFd::from_raw_fd(dir as RawFd) }, n.to_owned()))
}

/// bind/connect by a name relative to `dir`: the host calls take only paths, so the VMM (single
/// threaded) steps into `dir` for the call and back to `/`.
fn in_dir(dir: &OwnedFd, name: &CString, call: impl FnOnce(&libc::sockaddr_un, u32) -> i64) -> i64 {
    // SAFETY: a zeroed sockaddr_un is valid; the name fits (checked by the caller's length).
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    sa.sun_family = libc::AF_UNIX as u16;
    let bytes = name.as_bytes();
    if bytes.len() >= sa.sun_path.len() {
        // SAFETY: sets errno for the caller's Errno::last().
        unsafe { *libc::__errno_location() = libc::ENAMETOOLONG };
        return -1;
    }
    for (d, s) in sa.sun_path.iter_mut().zip(bytes) {
        *d = *s as libc::c_char;
    }
    let len = (2 + bytes.len() + 1) as u32;
    // SAFETY: fchdir to a directory we hold, then back to the root the jail gave us.
    if unsafe { libc::fchdir(dir.as_raw_fd()) } != 0 {
        return -1;
    }
    let r = call(&sa, len);
    let saved = Errno::last();
    // SAFETY: a constant path.
    unsafe { libc::chdir(c"/".as_ptr()) };
    // SAFETY: restores errno for the caller.
    unsafe { *libc::__errno_location() = saved.0 };
    r
}

pub fn sys_bind(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, addr: u64, len: u32) -> SysResult {
    let h = host_socket(os, fd)?;
    if os.files.file(fd)?.net.is_some() {
        return super::inet::bind(ctx, addr, len);
    }
    let (dir, name) = unix_path(os, ctx, addr, len, true)?;
    let umask = os.proc.umask;
    // SAFETY: bind of our socket to a sockaddr_un built by `in_dir`.
    let r = super::with_umask(umask, || in_dir(&dir, &name, |sa, l| unsafe { libc::bind(h, (sa as *const libc::sockaddr_un).cast(), l) } as i64));
    cvt(r)?;
    let path = sun_path(ctx, addr, len)?;
    if let Ok(mut names) = os.files.file(fd)?.unix_names.lock() {
        names.local = Some(path);
    }
    Ok(0)
}

pub fn sys_connect(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, addr: u64, len: u32) -> SysResult {
    let h = host_socket(os, fd)?;
    let f = os.files.file(fd)?;
    if let Some(n) = f.net.as_ref() {
        return super::inet::connect(os, ctx, &f, n, addr, len);
    }
    let (dir, name) = unix_path(os, ctx, addr, len, false)?;
    // SAFETY: connect of our socket to a sockaddr_un built by `in_dir`.
    sliced(h, libc::POLLOUT, false, || in_dir(&dir, &name, |sa, l| unsafe { libc::connect(h, (sa as *const libc::sockaddr_un).cast(), l) } as i64))?;
    // The listener's name, as this side knows it (Linux reports the name the listener bound,
    // which is this path unless it was bound by another relative one).
    let path = sun_path(ctx, addr, len)?;
    if let Ok(mut names) = f.unix_names.lock() {
        names.peer = Some(path);
    }
    Ok(0)
}

pub fn sys_listen(os: &mut GuestOs, fd: i32, backlog: i32) -> SysResult {
    let h = host_socket(os, fd)?;
    if os.files.file(fd)?.net.is_some() {
        return super::inet::listen();
    }
    // SAFETY: listen on our socket.
    cvt(unsafe { libc::listen(h, backlog) } as i64).map(|_| 0)
}

/// accept/accept4: the peer of a Unix socket is unnamed (the address reads back as the family).
pub fn sys_accept(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, addr: u64, lenp: u64, flags: i32) -> SysResult {
    if flags & !(libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) != 0 {
        return Err(EINVAL);
    }
    let h = host_socket(os, fd)?;
    if os.files.file(fd)?.net.is_some() {
        return super::inet::listen();
    }
    let host_flags = libc::SOCK_CLOEXEC | (flags & libc::SOCK_NONBLOCK);
    // A blocking accept with no connection pending must not block the VMM on the host: the
    // connecting process may be waiting for its turn, or the connecting thread for this one's
    // (a manager's server thread accepting while its main thread waits: SharedMemoryManager).
    // So it waits as a read of an empty pipe does, and accept4 runs once one is pending. While
    // processes take turns (or with threads) nobody else can take that connection in between.
    if !nonblocking(h) {
        super::wait_stream(h, libc::POLLIN)?;
    }
    // SAFETY: accept4 without an address (we report the unnamed family ourselves).
    let new = sliced(h, libc::POLLIN, false, || unsafe { libc::accept4(h, std::ptr::null_mut(), std::ptr::null_mut(), host_flags) } as i64)?;
    // SAFETY: a fresh descriptor we own.
    let owned = unsafe { OwnedFd::from_raw_fd(new as RawFd) };
    let gfd = add(os, owned, flags & libc::SOCK_CLOEXEC != 0)?;
    let local = os.files.file(fd)?.unix_names.lock().ok().and_then(|n| n.local.clone());
    if let Ok(mut names) = os.files.file(gfd)?.unix_names.lock() {
        names.local = local;
    }
    if addr != 0 && lenp != 0 {
        write_unnamed(ctx, addr, lenp)?;
    }
    Ok(gfd as u64)
}

fn write_unnamed(ctx: &mut Ctx, addr: u64, lenp: u64) -> Result<(), Errno> {
    let b = ctx.read_vec(lenp, 4)?;
    let room = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    let fam = (AF_UNIX as u16).to_le_bytes();
    ctx.write(addr, &fam[..room.min(2)])?;
    ctx.write(lenp, &2u32.to_le_bytes())
}

/// getsockname/getpeername: the family and, for a named socket, its name as the guest gave it
/// ([`UnixNames`]); else what the host keeps.
pub fn sys_getname(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, addr: u64, lenp: u64, peer: bool) -> SysResult {
    let h = host_socket(os, fd)?;
    let f = os.files.file(fd)?;
    if let Some(n) = f.net.as_ref() {
        return super::inet::getname(ctx, &f, n, addr, lenp, peer);
    }
    let known = f.unix_names.lock().ok().and_then(|n| if peer { n.peer.clone() } else { n.local.clone() });
    if let Some(path) = known {
        // Still connected? A peer that is gone makes getpeername fail as the host says.
        if peer {
            // SAFETY: a zeroed sockaddr_un is valid; the host fills at most its size.
            let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
            let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
            // SAFETY: our socket, a buffer of `len` bytes.
            cvt(unsafe { libc::getpeername(h, (&mut sa as *mut libc::sockaddr_un).cast(), &mut len) } as i64)?;
        }
        let mut bytes = (AF_UNIX as u16).to_le_bytes().to_vec();
        bytes.extend_from_slice(&path);
        bytes.push(0);
        let b = ctx.read_vec(lenp, 4)?;
        let room = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
        ctx.write(addr, &bytes[..room.min(bytes.len())])?;
        ctx.write(lenp, &(bytes.len() as u32).to_le_bytes())?;
        return Ok(0);
    }
    // SAFETY: a zeroed sockaddr_un is valid; the host fills at most its size.
    let mut sa: libc::sockaddr_un = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_un>() as libc::socklen_t;
    let p = (&mut sa as *mut libc::sockaddr_un).cast();
    // SAFETY: our socket, a buffer of `len` bytes.
    cvt(unsafe { if peer { libc::getpeername(h, p, &mut len) } else { libc::getsockname(h, p, &mut len) } } as i64)?;
    let b = ctx.read_vec(lenp, 4)?;
    let room = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    // SAFETY: sockaddr_un is plain bytes; `len` of them are filled.
    let bytes = unsafe { std::slice::from_raw_parts((&sa as *const libc::sockaddr_un).cast::<u8>(), len as usize) };
    ctx.write(addr, &bytes[..room.min(bytes.len())])?;
    ctx.write(lenp, &len.to_le_bytes())?;
    Ok(0)
}

fn check_msg_flags(flags: i32) -> Result<(), Errno> {
    if flags & !MSG_KNOWN != 0 {
        return Err(EOPNOTSUPP);
    }
    Ok(())
}

/// SIGPIPE for a send to a closed peer, unless MSG_NOSIGNAL (Linux raises it with EPIPE).
fn pipe_signal(os: &mut GuestOs, r: &Result<u64, Errno>, flags: i32) {
    if matches!(r, Err(e) if *e == crate::guestos::EPIPE) && flags & libc::MSG_NOSIGNAL == 0 {
        let pid = os.proc.pid;
        signal::raise(os, SigInfo::sent(signal::SIGPIPE, signal::SI_USER, pid));
    }
}

/// send/sendto on a connected socket (a destination address is for unconnected datagram
/// sockets, which are not served: EOPNOTSUPP).
pub fn sys_sendto(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, buf: u64, len: u64, flags: i32, dest: u64) -> SysResult {
    check_msg_flags(flags)?;
    let h = host_socket(os, fd)?;
    let f = os.files.file(fd)?;
    if let Some(n) = f.net.as_ref() {
        let data = ctx.read_vec(buf, (len as usize).min(super::MAX_IO))?;
        if n.is_dns() {
            let to = if dest != 0 { Some(super::inet::read_dest(ctx, dest, 28)?) } else { None };
            return super::inet::dns_send(os, h, n, &data, to);
        }
        super::inet::pending_reset(n, h)?;
        // A destination on a connected TCP socket is ignored, as Linux does.
        let host_flags = flags | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
        // SAFETY: send of a buffer we own.
        let r = sliced(h, libc::POLLOUT, flags & libc::MSG_DONTWAIT != 0, || unsafe {
            libc::send(h, data.as_ptr().cast(), data.len(), host_flags)
        } as i64);
        pipe_signal(os, &r, flags);
        return r;
    }
    if dest != 0 {
        return Err(EOPNOTSUPP);
    }
    let data = ctx.read_vec(buf, (len as usize).min(super::MAX_IO))?;
    let host_flags = flags | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    // SAFETY: send of a buffer we own.
    let r = sliced(h, libc::POLLOUT, flags & libc::MSG_DONTWAIT != 0, || unsafe {
        libc::send(h, data.as_ptr().cast(), data.len(), host_flags)
    } as i64);
    pipe_signal(os, &r, flags);
    r
}

/// recv/recvfrom: the sender of a Unix socket's data is unnamed.
#[allow(clippy::too_many_arguments)]
pub fn sys_recvfrom(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, buf: u64, len: u64, flags: i32, addr: u64, lenp: u64) -> SysResult {
    check_msg_flags(flags)?;
    let h = host_socket(os, fd)?;
    let n = (len as usize).min(super::MAX_IO);
    // Not zeroed: only what the host call wrote is copied out (a recv(65536) of a short message
    // would otherwise clear 64 KiB each time).
    let mut data: Vec<u8> = Vec::with_capacity(n);
    let host_flags = (flags | libc::MSG_DONTWAIT) & !libc::MSG_WAITALL;
    if let Some(ns) = os.files.file(fd)?.net.as_ref() {
        super::inet::await_peer(ns, h, flags & libc::MSG_DONTWAIT != 0);
    }
    // SAFETY: recv into the spare capacity of `data`, `n` bytes.
    let got = sliced(h, libc::POLLIN, flags & libc::MSG_DONTWAIT != 0, || unsafe {
        libc::recv(h, data.as_mut_ptr().cast(), n, host_flags)
    } as i64)?;
    if let (0, Some(ns)) = (got, os.files.file(fd)?.net.as_ref()) {
        super::inet::reset_at_end(ns)?;
    }
    // SAFETY: the host call wrote `got` bytes (at most `n`, the capacity; MSG_TRUNC on a datagram
    // socket may report more than it wrote, hence the min).
    unsafe { data.set_len((got as usize).min(n)) };
    ctx.write(buf, &data)?;
    if addr != 0 && lenp != 0 {
        match os.files.file(fd)?.net.as_ref() {
            Some(ns) => super::inet::write_source(ctx, ns, addr, lenp)?,
            None => ctx.write(lenp, &0u32.to_le_bytes())?,
        }
    }
    Ok(got)
}

/// struct msghdr on x86-64: name, namelen (+pad), iov, iovlen, control, controllen, flags.
struct MsgHdr {
    name: u64,
    namelen: u32,
    iov: u64,
    iovlen: u64,
    controllen: u64,
}

fn read_msghdr(ctx: &Ctx, p: u64) -> Result<MsgHdr, Errno> {
    let b = ctx.read_vec(p, 56)?;
    let q = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().unwrap_or_default());
    Ok(MsgHdr { name: q(0), namelen: u32::from_le_bytes(b[8..12].try_into().unwrap_or_default()), iov: q(16), iovlen: q(24), controllen: q(40) })
}

fn iovecs(ctx: &Ctx, iov: u64, n: u64) -> Result<Vec<(u64, usize)>, Errno> {
    if n > 1024 {
        return Err(EINVAL);
    }
    let raw = ctx.read_vec(iov, n as usize * 16)?;
    Ok(raw
        .chunks_exact(16)
        .map(|c| (u64::from_le_bytes(c[..8].try_into().unwrap_or_default()), u64::from_le_bytes(c[8..].try_into().unwrap_or_default()) as usize))
        .collect())
}

pub fn sys_sendmsg(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, msgp: u64, flags: i32) -> SysResult {
    check_msg_flags(flags)?;
    let h = host_socket(os, fd)?;
    let m = read_msghdr(ctx, msgp)?;
    if m.controllen != 0 {
        return Err(EOPNOTSUPP); // passing descriptors or credentials
    }
    let f = os.files.file(fd)?;
    let net = f.net.as_ref();
    // A destination: for an engine DNS socket, where the query goes; ignored on a connected TCP
    // socket (as Linux does); not served on Unix sockets.
    if m.name != 0 && net.is_none() {
        return Err(EOPNOTSUPP);
    }
    let mut data = Vec::new();
    for (base, len) in iovecs(ctx, m.iov, m.iovlen)? {
        if data.len() + len > super::MAX_IO {
            return Err(EINVAL);
        }
        data.extend_from_slice(&ctx.read_vec(base, len)?);
    }
    if let Some(n) = net.filter(|n| n.is_dns()) {
        let to = if m.name != 0 { Some(super::inet::read_dest(ctx, m.name, m.namelen)?) } else { None };
        return super::inet::dns_send(os, h, n, &data, to);
    }
    if let Some(n) = net {
        super::inet::pending_reset(n, h)?;
    }
    let host_flags = flags | libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL;
    // SAFETY: send of a buffer we own.
    let r = sliced(h, libc::POLLOUT, flags & libc::MSG_DONTWAIT != 0, || unsafe {
        libc::send(h, data.as_ptr().cast(), data.len(), host_flags)
    } as i64);
    pipe_signal(os, &r, flags);
    r
}

pub fn sys_recvmsg(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, msgp: u64, flags: i32) -> SysResult {
    check_msg_flags(flags)?;
    let h = host_socket(os, fd)?;
    let m = read_msghdr(ctx, msgp)?;
    let iov = iovecs(ctx, m.iov, m.iovlen)?;
    let total: usize = iov.iter().map(|(_, l)| *l).sum::<usize>().min(super::MAX_IO);
    let mut data = vec![0u8; total];
    let host_flags = (flags | libc::MSG_DONTWAIT) & !(libc::MSG_WAITALL | libc::MSG_CMSG_CLOEXEC);
    // SAFETY: a msghdr with one iovec over a buffer we own; no name, no control.
    let mut vec = libc::iovec { iov_base: data.as_mut_ptr().cast(), iov_len: total };
    // SAFETY: a zeroed msghdr is valid.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut vec;
    hdr.msg_iovlen = 1;
    if let Some(ns) = os.files.file(fd)?.net.as_ref() {
        super::inet::await_peer(ns, h, flags & libc::MSG_DONTWAIT != 0);
    }
    // SAFETY: recvmsg into the msghdr above, whose one iovec is our buffer.
    let got = sliced(h, libc::POLLIN, flags & libc::MSG_DONTWAIT != 0, || unsafe { libc::recvmsg(h, &mut hdr, host_flags) } as i64)?;
    if let (0, Some(ns)) = (got, os.files.file(fd)?.net.as_ref()) {
        super::inet::reset_at_end(ns)?;
    }
    let mut left = &data[..(got as usize).min(total)];
    for (base, len) in iov {
        if left.is_empty() {
            break;
        }
        let n = len.min(left.len());
        ctx.write(base, &left[..n])?;
        left = &left[n..];
    }
    // namelen = 0 (unnamed sender; a network socket's peer), controllen = 0, flags as the host set them.
    match os.files.file(fd)?.net.as_ref() {
        Some(ns) if m.name != 0 => {
            ctx.write(msgp + 8, &m.namelen.to_le_bytes())?;
            super::inet::write_source(ctx, ns, m.name, msgp + 8)?;
        }
        _ => ctx.write(msgp + 8, &0u32.to_le_bytes())?,
    }
    ctx.write(msgp + 40, &0u64.to_le_bytes())?;
    ctx.write(msgp + 48, &hdr.msg_flags.to_le_bytes())?;
    Ok(got)
}

pub fn sys_shutdown(os: &mut GuestOs, fd: i32, how: i32) -> SysResult {
    let h = host_socket(os, fd)?;
    // SAFETY: shutdown of our socket.
    cvt(unsafe { libc::shutdown(h, how) } as i64).map(|_| 0)
}

/// The socket options a program of ours asks about (level SOL_SOCKET). Credentials
/// (SO_PEERCRED) would be host pids and ids: not served.
const SOCKOPTS: &[i32] = &[
    libc::SO_TYPE,
    libc::SO_ERROR,
    libc::SO_SNDBUF,
    libc::SO_RCVBUF,
    libc::SO_DOMAIN,
    libc::SO_PROTOCOL,
    libc::SO_ACCEPTCONN,
    libc::SO_REUSEADDR,
    libc::SO_KEEPALIVE,
    libc::SO_LINGER,
    libc::SO_PASSCRED,
    libc::SO_RCVLOWAT,
    libc::SO_SNDLOWAT,
    libc::SO_RCVTIMEO,
    libc::SO_SNDTIMEO,
];

#[allow(clippy::too_many_arguments)]
pub fn sys_sockopt(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, level: i32, name: i32, val: u64, len: u64, set: bool) -> SysResult {
    let h = host_socket(os, fd)?;
    let f = os.files.file(fd)?;
    if let Some(n) = f.net.as_ref() {
        return super::inet::sockopt(ctx, &f, n, level, name, val, len, set);
    }
    if level != libc::SOL_SOCKET || !SOCKOPTS.contains(&name) {
        return Err(ENOPROTOOPT);
    }
    if set {
        if len > 64 {
            return Err(EINVAL);
        }
        let v = ctx.read_vec(val, len as usize)?;
        // SAFETY: setsockopt with a buffer of `len` bytes we own.
        return cvt(unsafe { libc::setsockopt(h, level, name, v.as_ptr().cast(), len as libc::socklen_t) } as i64).map(|_| 0);
    }
    let b = ctx.read_vec(len, 4)?;
    let room = u32::from_le_bytes([b[0], b[1], b[2], b[3]]).min(64);
    let mut v = [0u8; 64];
    let mut l = room as libc::socklen_t;
    // SAFETY: getsockopt into a buffer of `l` bytes we own.
    cvt(unsafe { libc::getsockopt(h, level, name, v.as_mut_ptr().cast(), &mut l) } as i64)?;
    ctx.write(val, &v[..(l as usize).min(room as usize)])?;
    ctx.write(len, &l.to_le_bytes())?;
    Ok(0)
}

/// sendmmsg: each message as sendmsg would send it (glibc's resolver sends its A and AAAA
/// queries in one call); the count sent, or the first error if none was.
pub fn sys_sendmmsg(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, vec: u64, vlen: u32, flags: i32) -> SysResult {
    let n = vlen.min(1024) as u64;
    let mut sent = 0u64;
    for i in 0..n {
        // struct mmsghdr: a msghdr (56 bytes) and the count sent (u32, padded to 64).
        let entry = vec + i * 64;
        match sys_sendmsg(os, ctx, fd, entry, flags) {
            Ok(len) => {
                ctx.write(entry + 56, &(len as u32).to_le_bytes())?;
                sent += 1;
            }
            Err(e) if sent == 0 => return Err(e),
            Err(_) => break,
        }
    }
    Ok(sent)
}
