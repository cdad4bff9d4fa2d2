//! The messages between a VMM process and the broker, on the sandbox's broker socket.
//!
//! The broker socket is a `SOCK_SEQPACKET` pair: the broker holds one end, every VMM process of
//! the sandbox inherits the other (a guest fork is a host fork). Several processes may ask at once,
//! so each request carries its own reply socket (one end of a fresh pair, passed with SCM_RIGHTS):
//! a datagram is never read by the wrong process. A reply to `Connect` carries the connected TCP
//! socket and a liveness descriptor (see `broker`).

use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};

use serde::{Deserialize, Serialize};

#[derive(Debug, thiserror::Error)]
pub enum WireError {
    /// A socket call failed.
    #[error("{op}: {source}")]
    Sys { op: &'static str, source: std::io::Error },
    /// The peer sent something we cannot decode.
    #[error("undecodable message: {0}")]
    Decode(String),
    /// The peer closed its end (a broker that is gone: fail closed).
    #[error("the broker is gone")]
    Closed,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum NetRequest {
    /// Dial `addr` (as the guest gave it) for guest process `pid`.
    Connect { pid: i32, addr: SocketAddr },
    /// A UDP socket connected to `addr` (as the guest gave it), for guest process `pid`.
    ConnectUdp { pid: i32, addr: SocketAddr },
    /// Resolve `name`: IPv6 addresses if `v6`, else IPv4.
    Resolve { pid: i32, name: String, v6: bool },
}

#[derive(Debug, Serialize, Deserialize)]
pub enum NetReply {
    /// The connected socket and the liveness descriptor ride with this message. `relay`: the
    /// socket is one end of a socket pair the broker relays or serves from a recording
    /// (`egress::tape`), and this is the local address the guest's socket answers.
    Connected { relay: Option<SocketAddr> },
    /// The connection is refused with this errno (policy: ECONNREFUSED; a failed dial: its errno).
    Refused { errno: i32 },
    /// The name is admitted; its addresses (possibly none: NODATA).
    Addrs(Vec<IpAddr>),
    /// Not admitted: NXDOMAIN, and nothing left the host.
    NxDomain,
}

/// Largest message either side sends.
pub const MAX_MSG: usize = 64 * 1024;

/// A `SOCK_SEQPACKET` pair with close-on-exec.
pub fn seqpacket_pair() -> Result<(OwnedFd, OwnedFd), WireError> {
    let mut sv = [0 as RawFd; 2];
    // SAFETY: socketpair writes two descriptors into `sv`.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, sv.as_mut_ptr()) } != 0 {
        return Err(WireError::Sys { op: "socketpair", source: std::io::Error::last_os_error() });
    }
    // SAFETY: two fresh descriptors we own.
    Ok(unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) })
}

/// Send one datagram with `fds` attached.
pub fn send<T: Serialize>(sock: RawFd, msg: &T, fds: &[RawFd]) -> Result<(), WireError> {
    let payload = postcard::to_stdvec(msg).map_err(|e| WireError::Decode(e.to_string()))?;
    let mut iov = libc::iovec { iov_base: payload.as_ptr() as *mut _, iov_len: payload.len() };
    let space = cmsg_space(fds.len());
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: a zeroed msghdr is valid; we fill its pointers with buffers that outlive the call.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    if !fds.is_empty() {
        hdr.msg_control = cbuf.as_mut_ptr().cast();
        hdr.msg_controllen = space;
        // SAFETY: msg_control points at `space` bytes; CMSG_FIRSTHDR is then non-null and the data
        // area holds `fds.len()` descriptors (CMSG_LEN of that size).
        unsafe {
            let c = libc::CMSG_FIRSTHDR(&hdr);
            (*c).cmsg_level = libc::SOL_SOCKET;
            (*c).cmsg_type = libc::SCM_RIGHTS;
            (*c).cmsg_len = libc::CMSG_LEN((fds.len() * 4) as u32) as usize;
            std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
        }
    }
    // SAFETY: sendmsg with the header built above.
    let r = unsafe { libc::sendmsg(sock, &hdr, libc::MSG_NOSIGNAL) };
    if r < 0 {
        let e = std::io::Error::last_os_error();
        if e.raw_os_error() == Some(libc::EPIPE) || e.raw_os_error() == Some(libc::ECONNRESET) {
            return Err(WireError::Closed);
        }
        return Err(WireError::Sys { op: "sendmsg", source: e });
    }
    Ok(())
}

fn cmsg_space(n: usize) -> usize {
    if n == 0 {
        0
    } else {
        // SAFETY: CMSG_SPACE is arithmetic.
        unsafe { libc::CMSG_SPACE((n * 4) as u32) as usize }
    }
}

/// Receive one datagram and up to 4 descriptors (blocking unless `sock` is non-blocking).
pub fn recv<T: for<'de> Deserialize<'de>>(sock: RawFd) -> Result<(T, Vec<OwnedFd>), WireError> {
    // Not zeroed: the kernel writes what it received and only that is read (a message is a few
    // dozen bytes; clearing 64 KiB for each would cost more than the call).
    let mut buf: Vec<u8> = Vec::with_capacity(MAX_MSG);
    let mut iov = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: MAX_MSG };
    let space = cmsg_space(4);
    let mut cbuf = vec![0u64; space.div_ceil(8)];
    // SAFETY: a zeroed msghdr is valid; its buffers outlive the call.
    let mut hdr: libc::msghdr = unsafe { std::mem::zeroed() };
    hdr.msg_iov = &mut iov;
    hdr.msg_iovlen = 1;
    hdr.msg_control = cbuf.as_mut_ptr().cast();
    hdr.msg_controllen = space;
    // SAFETY: recvmsg into the header above.
    let n = unsafe { libc::recvmsg(sock, &mut hdr, libc::MSG_CMSG_CLOEXEC) };
    if n < 0 {
        return Err(WireError::Sys { op: "recvmsg", source: std::io::Error::last_os_error() });
    }
    // SAFETY: recvmsg wrote `n` bytes (at most MAX_MSG, the capacity) at the start of `buf`.
    unsafe { buf.set_len(n as usize) };
    let mut fds = Vec::new();
    // SAFETY: walking the control messages the kernel wrote into `cbuf`; each SCM_RIGHTS payload
    // holds descriptors the kernel installed for us (we take ownership of each once).
    unsafe {
        let mut c = libc::CMSG_FIRSTHDR(&hdr);
        while !c.is_null() {
            if (*c).cmsg_level == libc::SOL_SOCKET && (*c).cmsg_type == libc::SCM_RIGHTS {
                let data = libc::CMSG_DATA(c).cast::<RawFd>();
                let count = ((*c).cmsg_len - libc::CMSG_LEN(0) as usize) / 4;
                for i in 0..count {
                    fds.push(OwnedFd::from_raw_fd(std::ptr::read_unaligned(data.add(i))));
                }
            }
            c = libc::CMSG_NXTHDR(&hdr, c);
        }
    }
    if n == 0 && fds.is_empty() {
        return Err(WireError::Closed);
    }
    let msg = postcard::from_bytes(&buf).map_err(|e| WireError::Decode(e.to_string()))?;
    Ok((msg, fds))
}

/// One request and its reply, from a VMM process: a fresh reply pair, the request with one end
/// attached, then wait for the reply on the other (at most `timeout_ms`; then the broker is taken
/// as gone: fail closed).
pub fn call(broker: RawFd, req: &NetRequest, timeout_ms: i32) -> Result<(NetReply, Vec<OwnedFd>), WireError> {
    let ours = start(broker, req)?;
    answer(&ours, timeout_ms)
}

/// Send a request and return the socket its reply will come on (readable once it has: a
/// non-blocking connect polls it).
pub fn start(broker: RawFd, req: &NetRequest) -> Result<OwnedFd, WireError> {
    let (ours, theirs) = seqpacket_pair()?;
    send(broker, req, &[theirs.as_raw_fd()])?;
    Ok(ours)
}

/// The reply on `ours` (from `start`), waiting at most `timeout_ms` (0: only if it is there).
pub fn answer(ours: &OwnedFd, timeout_ms: i32) -> Result<(NetReply, Vec<OwnedFd>), WireError> {
    let mut pfd = libc::pollfd { fd: ours.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    loop {
        // SAFETY: one valid pollfd.
        let r = unsafe { libc::poll(&mut pfd, 1, timeout_ms) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        if r <= 0 {
            return Err(WireError::Closed);
        }
        break;
    }
    recv(ours.as_raw_fd())
}
