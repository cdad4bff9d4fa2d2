//! Guest network sockets (AF_INET, AF_INET6): TCP through the broker, DNS answered by the engine.
//!
//! A VMM process lives in an empty network namespace and may not open a network socket (seccomp);
//! the broker on the trusted side does that (`crate::egress`). A guest TCP socket starts as a
//! placeholder host socket (an AF_UNIX one: it polls, reads and fstats as a socket, and holds the
//! guest fd's host descriptor number). `connect` copies the address once from guest memory and
//! asks the broker over the sandbox's broker socket; on success the broker passes the connected
//! TCP socket back and it is `dup3`'d over the placeholder, so every later read, write, poll, epoll,
//! shutdown and sockopt is the host's own call on it, as for any other host descriptor.
//! On a non-blocking socket the connect answers EINPROGRESS and the broker's reply is taken later
//! (`finish_connect`): poll watches the reply socket for the guest's POLLOUT, and SO_ERROR, a
//! second connect or a send take it. A denied
//! connect fails with ECONNREFUSED (a policy denial behaves like a host that refuses: immediate,
//! never a hang; ENETUNREACH would say there is no route, which is not what happened).
//!
//! DNS: a datagram to port 53 never leaves the VMM: the VMM reads the query, asks the broker (which
//! answers for admitted names only), and queues the answer on the guest's socket (one end of an
//! AF_UNIX datagram pair, so poll and recv work as usual), from the address the guest sent to
//! (glibc checks it). Other UDP destinations are brokered like TCP: a connect, or a send to a new
//! destination, asks the broker, which admits it only under a rule naming that port and hands back
//! a UDP socket connected to it; that is `dup3`'d over the guest's socket, which from then on
//! sends to and receives from that peer alone (an unconnected socket that sends elsewhere is
//! connected anew: answers from the earlier peer are no longer received). Denied: ENETUNREACH.
//! Raw sockets need a capability the guest lacks (EPERM); no socket listens.
//!
//! A sandbox fork (not a guest fork) gets a broker socket of its own (`set_broker`); the TCP
//! connections it inherited belong to its parent and read as reset in the child.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, SocketAddrV4, SocketAddrV6};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex};

use super::{cvt, OpenFile};
use crate::egress::{dns, wire};
use crate::guestos::{Ctx, Errno, GuestOs, SysResult, EINVAL};

const EAFNOSUPPORT: Errno = Errno(97);
const EPERM: Errno = Errno(1);
const EISCONN: Errno = Errno(106);
const ENOTCONN: Errno = Errno(107);
const ECONNREFUSED: Errno = Errno(111);
const ECONNRESET: Errno = Errno(104);
const ENETUNREACH: Errno = Errno(101);
const EOPNOTSUPP: Errno = Errno(95);
const EPROTONOSUPPORT: Errno = Errno(93);
const ESOCKTNOSUPPORT: Errno = Errno(94);
const EADDRNOTAVAIL: Errno = Errno(99);
const EINPROGRESS: Errno = Errno(115);
const EALREADY: Errno = Errno(114);
const DNS_PORT: u16 = 53;
/// How long a VMM waits for the broker before failing closed (a dial's own bound plus slack).
const BROKER_WAIT_MS: i32 = 13_000;

/// The sandbox's broker socket (the VMM end), shared by its processes.
static BROKER: Mutex<Option<OwnedFd>> = Mutex::new(None);

fn broker_fd() -> Option<RawFd> {
    BROKER.lock().unwrap_or_else(|p| p.into_inner()).as_ref().map(|f| f.as_raw_fd())
}

/// What the engine keeps beside a guest network socket's host descriptor.
pub struct NetSock {
    pub family: i32,
    /// SOCK_STREAM (TCP) or SOCK_DGRAM (DNS).
    pub kind: i32,
    state: Mutex<State>,
}

#[derive(Default)]
struct State {
    /// TCP: the peer, once connected; UDP: the connected (DNS server) address.
    peer: Option<SocketAddr>,
    /// TCP: the liveness end the broker watches (see `egress::broker`).
    live: Option<OwnedFd>,
    /// TCP: options set before connect (applied to the real socket after it).
    pending: Vec<(i32, i32, Vec<u8>)>,
    /// UDP: the VMM's end of the datagram pair (answers are queued through it), and where the
    /// last query went (the answers' source address).
    dns_end: Option<OwnedFd>,
    last_server: Option<SocketAddr>,
    /// A sandbox fork's copy of its parent's connection.
    inherited: bool,
    /// TCP: a non-blocking connect under way: the socket its reply comes on, where to, and the
    /// placeholder's peer (held, so the placeholder reads EAGAIN rather than EOF meanwhile).
    connecting: Option<(OwnedFd, SocketAddr, OwnedFd)>,
    /// In replay mode the first look at a connect under way waits for its end, so that what the
    /// guest sees does not depend on how fast the broker dialled.
    settle: bool,
    /// TCP: how a non-blocking connect ended, for SO_ERROR (read once).
    connect_err: Option<Errno>,
    /// UDP: the destination of the brokered UDP socket the guest's descriptor now is.
    udp_to: Option<SocketAddr>,
    /// TCP through a recording (`egress::tape`): the host descriptor is a socket pair's end the
    /// broker relays or serves, and this is the local address getsockname answers. TCP and IP
    /// options are then kept by the engine (there is no TCP socket here to take them).
    relay: Option<SocketAddr>,
}

impl NetSock {
    fn lock(&self) -> std::sync::MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn is_dns(&self) -> bool {
        self.kind == libc::SOCK_DGRAM
    }

    /// Whether what it carries comes from outside the sandbox: a TCP socket, or a UDP socket the
    /// broker connected (not the engine's own DNS socket, which the VMM answers itself).
    pub fn external(&self) -> bool {
        !self.is_dns() || self.lock().udp_to.is_some()
    }
}

fn pair(ty: i32) -> Result<(OwnedFd, OwnedFd), Errno> {
    let mut sv = [0 as RawFd; 2];
    // SAFETY: socketpair writes two descriptors into `sv`.
    cvt(unsafe { libc::socketpair(libc::AF_UNIX, ty | libc::SOCK_CLOEXEC, 0, sv.as_mut_ptr()) } as i64)?;
    // SAFETY: two fresh descriptors we own.
    Ok(unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) })
}

/// socket(AF_INET or AF_INET6, ...).
pub fn socket(os: &mut GuestOs, domain: i32, ty: i32, proto: i32) -> SysResult {
    let kind = ty & 0xf;
    if ty & !(0xf | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC) != 0 {
        return Err(EINVAL);
    }
    let (nonblock, cloexec) = (ty & libc::SOCK_NONBLOCK != 0, ty & libc::SOCK_CLOEXEC != 0);
    let flags = if nonblock { libc::SOCK_NONBLOCK } else { 0 };
    let (fd, dns_end) = match kind {
        libc::SOCK_STREAM if proto == 0 || proto == libc::IPPROTO_TCP => (pair(libc::SOCK_STREAM | flags)?.0, None),
        libc::SOCK_DGRAM if proto == 0 || proto == libc::IPPROTO_UDP => {
            let (guest, vmm) = pair(libc::SOCK_DGRAM | flags)?;
            (guest, Some(vmm))
        }
        libc::SOCK_RAW => return Err(EPERM),
        libc::SOCK_STREAM | libc::SOCK_DGRAM => return Err(EPROTONOSUPPORT),
        _ => return Err(ESOCKTNOSUPPORT),
    };
    let mut f = OpenFile::host(fd, None, false);
    f.net = Some(Box::new(NetSock { family: domain, kind, state: Mutex::new(State { dns_end, ..Default::default() }) }));
    os.files.alloc(0, Arc::new(f), cloexec).map(|fd| fd as u64)
}

/// A guest sockaddr_in or sockaddr_in6, copied once.
fn read_addr(ctx: &Ctx, addr: u64, len: u32) -> Result<SocketAddr, Errno> {
    if len < 2 {
        return Err(EINVAL);
    }
    let b = ctx.read_vec(addr, (len as usize).min(28))?;
    let fam = u16::from_le_bytes([b[0], b[1]]) as i32;
    match fam {
        libc::AF_INET if b.len() >= 16 => {
            let port = u16::from_be_bytes([b[2], b[3]]);
            Ok(SocketAddr::V4(SocketAddrV4::new(Ipv4Addr::new(b[4], b[5], b[6], b[7]), port)))
        }
        libc::AF_INET6 if b.len() >= 24 => {
            let port = u16::from_be_bytes([b[2], b[3]]);
            let mut a = [0u8; 16];
            a.copy_from_slice(&b[8..24]);
            let scope = if b.len() >= 28 { u32::from_le_bytes([b[24], b[25], b[26], b[27]]) } else { 0 };
            Ok(SocketAddr::V6(SocketAddrV6::new(Ipv6Addr::from(a), port, 0, scope)))
        }
        libc::AF_INET | libc::AF_INET6 => Err(EINVAL),
        _ => Err(EAFNOSUPPORT),
    }
}

/// Write `a` as the guest's sockaddr (truncated to the room the guest gave, as Linux does).
fn write_addr(ctx: &mut Ctx, a: Option<SocketAddr>, family: i32, addr: u64, lenp: u64) -> Result<(), Errno> {
    if addr == 0 || lenp == 0 {
        return Ok(());
    }
    let a = a.unwrap_or(if family == libc::AF_INET6 {
        SocketAddr::new(IpAddr::V6(Ipv6Addr::UNSPECIFIED), 0)
    } else {
        SocketAddr::new(IpAddr::V4(Ipv4Addr::UNSPECIFIED), 0)
    });
    let a = match (family, a) {
        // An IPv6 socket sees IPv4 peers as mapped addresses.
        (libc::AF_INET6, SocketAddr::V4(v4)) => SocketAddr::new(IpAddr::V6(v4.ip().to_ipv6_mapped()), v4.port()),
        (_, a) => a,
    };
    let (ss, len) = crate::egress::broker::sockaddr(a);
    // SAFETY: sockaddr_storage is plain bytes; `len` of them are filled.
    let bytes = unsafe { std::slice::from_raw_parts((&ss as *const libc::sockaddr_storage).cast::<u8>(), len as usize) };
    let b = ctx.read_vec(lenp, 4)?;
    let room = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    ctx.write(addr, &bytes[..room.min(bytes.len())])?;
    ctx.write(lenp, &len.to_le_bytes())
}

/// connect on a guest network socket.
pub fn connect(os: &mut GuestOs, ctx: &mut Ctx, f: &OpenFile, n: &NetSock, addr: u64, len: u32) -> SysResult {
    let to = read_addr(ctx, addr, len)?;
    if n.family == libc::AF_INET && to.is_ipv6() {
        return Err(EAFNOSUPPORT);
    }
    let to = unmap(to);
    if n.is_dns() {
        if to.port() != DNS_PORT {
            let h = f.host_fd().ok_or(EINVAL)?;
            udp_broker(os, h, n, to)?;
        } else if n.lock().udp_to.is_some() {
            return Err(ENETUNREACH); // DNS is the engine's, on a socket of its own
        }
        n.lock().peer = Some(to);
        return Ok(0);
    }
    let h = f.host_fd().ok_or(EINVAL)?;
    if n.lock().connecting.is_some() {
        // Asked again while a non-blocking connect is under way: as Linux answers.
        return match finish_connect(h, n, 0) {
            None => Err(EALREADY),
            Some(Ok(())) => Err(EISCONN),
            Some(Err(e)) => {
                n.lock().connect_err = None;
                Err(e)
            }
        };
    }
    if n.lock().peer.is_some() {
        return Err(EISCONN);
    }
    let Some(broker) = broker_fd() else { return Err(ECONNREFUSED) };
    let req = wire::NetRequest::Connect { pid: os.proc.pid, addr: to };
    // SAFETY: F_GETFL on the placeholder we hold.
    let nonblocking = unsafe { libc::fcntl(h, libc::F_GETFL) } & libc::O_NONBLOCK != 0;
    if nonblocking {
        // The dial goes on in the broker while the guest runs: EINPROGRESS now, and the reply is
        // taken when the guest polls for POLLOUT, reads SO_ERROR, connects again or sends.
        let ours = wire::start(broker, &req).map_err(|_| ECONNREFUSED)?;
        let (placeholder, peer) = pair(libc::SOCK_STREAM | libc::SOCK_NONBLOCK)?;
        // SAFETY: dup3 of a fresh pair's end over the placeholder (whose peer was dropped, so it
        // read EOF); we hold this one's peer until the connect ends.
        cvt(unsafe { libc::dup3(placeholder.as_raw_fd(), h, libc::O_CLOEXEC) } as i64)?;
        let mut st = n.lock();
        st.connecting = Some((ours, to, peer));
        st.settle = os.proc.clocks.replay;
        return Err(EINPROGRESS);
    }
    crate::trace::mark("net.connect");
    let (reply, fds) = wire::call(broker, &req, BROKER_WAIT_MS).map_err(|_| ECONNREFUSED)?;
    let r = adopt(h, n, to, reply, fds);
    crate::trace::mark("net.connected");
    r
}

/// The reply of a non-blocking connect, if it has come (`wait_ms` 0: only look): the connect's
/// end (also kept for SO_ERROR), or None while it is under way.
pub fn finish_connect(h: RawFd, n: &NetSock, wait_ms: i32) -> Option<Result<(), Errno>> {
    let wait_ms = if n.lock().settle { BROKER_WAIT_MS } else { wait_ms };
    let (ours, to, peer) = n.lock().connecting.take()?;
    if wait_ms == 0 && !ready(&ours) {
        n.lock().connecting = Some((ours, to, peer));
        return None;
    }
    let res = match wire::answer(&ours, wait_ms) {
        Ok((reply, fds)) => adopt(h, n, to, reply, fds).map(|_| ()),
        Err(_) => Err(ECONNREFUSED), // the broker closed without answering, or is gone: fail closed
    };
    drop(peer);
    if let Err(e) = res {
        n.lock().connect_err = Some(e);
    }
    Some(res)
}

/// Whether a reply socket has something: the reply, or the broker's hang-up.
fn ready(fd: &OwnedFd) -> bool {
    let mut pfd = libc::pollfd { fd: fd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, no waiting.
    unsafe { libc::poll(&mut pfd, 1, 0) > 0 }
}

/// The reply socket of a non-blocking connect under way (poll watches it for the guest's POLLOUT).
/// In replay mode the connect ends here instead (see `State::settle`), and poll looks at the socket.
pub fn connecting_fd(h: RawFd, n: &NetSock) -> Option<RawFd> {
    let (pending, settle) = {
        let st = n.lock();
        (st.connecting.as_ref().map(|c| c.0.as_raw_fd()), st.settle)
    };
    if pending.is_some() && settle {
        let _ = finish_connect(h, n, BROKER_WAIT_MS);
        return None;
    }
    pending
}

/// The broker's answer to a connect: the connected socket goes over the placeholder.
fn adopt(h: RawFd, n: &NetSock, to: SocketAddr, reply: wire::NetReply, fds: Vec<OwnedFd>) -> SysResult {
    match reply {
        wire::NetReply::Connected { relay } if fds.len() == 2 => {
            let mut fds = fds.into_iter();
            let (tcp, live) = match (fds.next(), fds.next()) {
                (Some(t), Some(l)) => (t, l),
                _ => return Err(ECONNREFUSED),
            };
            // SAFETY: F_GETFL on the placeholder we hold.
            let fl = unsafe { libc::fcntl(h, libc::F_GETFL) };
            // SAFETY: dup3 of the received socket over the placeholder's number: the guest fd's
            // host descriptor now names the connected socket (the placeholder is closed).
            cvt(unsafe { libc::dup3(tcp.as_raw_fd(), h, libc::O_CLOEXEC) } as i64)?;
            drop(tcp);
            // SAFETY: F_SETFL on our descriptor: the guest's O_NONBLOCK, as it had set it.
            unsafe { libc::fcntl(h, libc::F_SETFL, if fl >= 0 { fl & libc::O_NONBLOCK } else { 0 }) };
            let mut st = n.lock();
            for (level, name, v) in st.pending.drain(..) {
                // SAFETY: setsockopt with a buffer we own.
                unsafe { libc::setsockopt(h, level, name, v.as_ptr().cast(), v.len() as libc::socklen_t) };
            }
            st.peer = Some(to);
            st.live = Some(live);
            st.relay = relay;
            Ok(0)
        }
        wire::NetReply::Refused { errno } => Err(Errno(errno)),
        _ => Err(ECONNREFUSED),
    }
}

fn unmap(a: SocketAddr) -> SocketAddr {
    match a {
        SocketAddr::V6(v6) => match v6.ip().to_ipv4_mapped() {
            Some(v4) => SocketAddr::new(IpAddr::V4(v4), v6.port()),
            None => a,
        },
        a => a,
    }
}

/// bind: a client socket may bind the any-address with port 0 (what bind-before-connect code
/// does); nothing else (nothing listens in a sandbox).
pub fn bind(ctx: &mut Ctx, addr: u64, len: u32) -> SysResult {
    let a = read_addr(ctx, addr, len)?;
    if a.port() == 0 && a.ip().is_unspecified() {
        return Ok(0);
    }
    Err(EADDRNOTAVAIL)
}

/// getsockname / getpeername.
pub fn getname(ctx: &mut Ctx, f: &OpenFile, n: &NetSock, addr: u64, lenp: u64, peer: bool) -> SysResult {
    let st = n.lock();
    if n.is_dns() || st.peer.is_none() || st.inherited || st.relay.is_some() {
        if peer && st.peer.is_none() {
            return Err(ENOTCONN);
        }
        let a = if peer { st.peer } else { st.relay };
        drop(st);
        return write_addr(ctx, a, n.family, addr, lenp).map(|_| 0);
    }
    drop(st);
    let h = f.host_fd().ok_or(EINVAL)?;
    // SAFETY: a zeroed sockaddr_storage is valid; the host fills at most its size.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    let p = (&mut ss as *mut libc::sockaddr_storage).cast();
    // SAFETY: our socket, a buffer of `len` bytes.
    cvt(unsafe { if peer { libc::getpeername(h, p, &mut len) } else { libc::getsockname(h, p, &mut len) } } as i64)?;
    // SAFETY: reading the variant the family says the kernel wrote.
    let a = unsafe {
        match ss.ss_family as i32 {
            libc::AF_INET => {
                let s = &*(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>();
                SocketAddr::new(IpAddr::V4(Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr))), u16::from_be(s.sin_port))
            }
            _ => {
                let s = &*(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
                SocketAddr::new(IpAddr::V6(Ipv6Addr::from(s.sin6_addr.s6_addr)), u16::from_be(s.sin6_port))
            }
        }
    };
    write_addr(ctx, Some(a), n.family, addr, lenp).map(|_| 0)
}

/// The socket options of a network socket: SOL_SOCKET identity options answered by the engine
/// (the placeholder is an AF_UNIX socket), options set before connect remembered and applied
/// after it; common TCP and IP options passed to the real socket.
#[allow(clippy::too_many_arguments)]
pub fn sockopt(ctx: &mut Ctx, f: &OpenFile, n: &NetSock, level: i32, name: i32, val: u64, len: u64, set: bool) -> SysResult {
    let connected = {
        let st = n.lock();
        (st.peer.is_some() && st.relay.is_none() && !n.is_dns()) || st.udp_to.is_some()
    };
    let ident = match (level, name) {
        (libc::SOL_SOCKET, libc::SO_DOMAIN) => Some(n.family),
        (libc::SOL_SOCKET, libc::SO_TYPE) => Some(n.kind),
        (libc::SOL_SOCKET, libc::SO_PROTOCOL) => Some(if n.is_dns() { libc::IPPROTO_UDP } else { libc::IPPROTO_TCP }),
        (libc::SOL_SOCKET, libc::SO_ACCEPTCONN) => Some(0),
        _ => None,
    };
    if let (Some(v), false) = (ident, set) {
        return put_int(ctx, val, len, v);
    }
    if (level, name, set) == (libc::SOL_SOCKET, libc::SO_ERROR, false) && !n.is_dns() {
        // A non-blocking connect's outcome (0 while it is under way), read once.
        let h = f.host_fd().ok_or(EINVAL)?;
        let _ = finish_connect(h, n, 0);
        if let Some(Errno(e)) = n.lock().connect_err.take() {
            return put_int(ctx, val, len, e);
        }
        if n.lock().connecting.is_some() {
            return put_int(ctx, val, len, 0);
        }
    }
    let known = matches!(
        (level, name),
        (libc::SOL_SOCKET, libc::SO_KEEPALIVE | libc::SO_RCVBUF | libc::SO_SNDBUF | libc::SO_ERROR | libc::SO_LINGER | libc::SO_REUSEADDR | libc::SO_REUSEPORT | libc::SO_RCVTIMEO | libc::SO_SNDTIMEO | libc::SO_BROADCAST | libc::SO_RCVLOWAT | libc::SO_SNDLOWAT)
            | (libc::IPPROTO_TCP, libc::TCP_NODELAY | libc::TCP_KEEPIDLE | libc::TCP_KEEPINTVL | libc::TCP_KEEPCNT | libc::TCP_USER_TIMEOUT | libc::TCP_QUICKACK | libc::TCP_MAXSEG | libc::TCP_INFO | libc::TCP_CORK)
            | (libc::IPPROTO_IP, libc::IP_TOS | libc::IP_TTL | libc::IP_RECVERR | libc::IP_MTU_DISCOVER)
            | (libc::IPPROTO_IPV6, libc::IPV6_V6ONLY | libc::IPV6_TCLASS | libc::IPV6_RECVERR | libc::IPV6_UNICAST_HOPS)
    );
    if !known {
        return Err(Errno(92)); // ENOPROTOOPT
    }
    let h = f.host_fd().ok_or(EINVAL)?;
    if set {
        if len > 256 {
            return Err(EINVAL);
        }
        let v = ctx.read_vec(val, len as usize)?;
        if !connected {
            // Before connect every option waits for the real socket (the placeholder is another
            // socket: what is set on it would be lost); the engine's DNS socket takes and ignores
            // them, and a relayed one keeps them (its real socket is the broker's).
            if !n.is_dns() {
                n.lock().pending.push((level, name, v));
            }
            return Ok(0);
        }
        // SAFETY: setsockopt with a buffer of `len` bytes we own.
        return cvt(unsafe { libc::setsockopt(h, level, name, v.as_ptr().cast(), len as libc::socklen_t) } as i64).map(|_| 0);
    }
    let b = ctx.read_vec(len, 4)?;
    let room = u32::from_le_bytes([b[0], b[1], b[2], b[3]]).min(256);
    if !connected && (level != libc::SOL_SOCKET || n.lock().pending.iter().any(|(l, nm, _)| *l == level && *nm == name)) {
        let st = n.lock();
        let v = st.pending.iter().rev().find(|(l, nm, _)| *l == level && *nm == name).map(|p| p.2.clone());
        drop(st);
        let v = v.unwrap_or_else(|| 0i32.to_le_bytes().to_vec());
        ctx.write(val, &v[..v.len().min(room as usize)])?;
        return ctx.write(len, &(v.len() as u32).to_le_bytes()).map(|_| 0);
    }
    let mut v = [0u8; 256];
    let mut l = room as libc::socklen_t;
    // SAFETY: getsockopt into a buffer of `l` bytes we own.
    cvt(unsafe { libc::getsockopt(h, level, name, v.as_mut_ptr().cast(), &mut l) } as i64)?;
    ctx.write(val, &v[..(l as usize).min(room as usize)])?;
    ctx.write(len, &l.to_le_bytes())?;
    Ok(0)
}

fn put_int(ctx: &mut Ctx, val: u64, lenp: u64, v: i32) -> SysResult {
    let b = ctx.read_vec(lenp, 4)?;
    let room = u32::from_le_bytes([b[0], b[1], b[2], b[3]]) as usize;
    ctx.write(val, &v.to_le_bytes()[..room.min(4)])?;
    ctx.write(lenp, &4u32.to_le_bytes())?;
    Ok(0)
}

/// Make the guest's UDP socket (host descriptor `h`) a UDP socket the broker connected to `to`.
fn udp_broker(os: &GuestOs, h: RawFd, n: &NetSock, to: SocketAddr) -> Result<(), Errno> {
    if n.family == libc::AF_INET && to.is_ipv6() {
        return Err(EAFNOSUPPORT);
    }
    let Some(broker) = broker_fd() else { return Err(ENETUNREACH) };
    let req = wire::NetRequest::ConnectUdp { pid: os.proc.pid, addr: to };
    let (reply, fds) = wire::call(broker, &req, BROKER_WAIT_MS).map_err(|_| ENETUNREACH)?;
    match reply {
        wire::NetReply::Connected { .. } if fds.len() == 2 => {
            let mut fds = fds.into_iter();
            let (Some(udp), Some(live)) = (fds.next(), fds.next()) else { return Err(ENETUNREACH) };
            // SAFETY: F_GETFL on the guest socket's descriptor.
            let fl = unsafe { libc::fcntl(h, libc::F_GETFL) };
            // SAFETY: dup3 of the received UDP socket over the guest socket's host descriptor.
            cvt(unsafe { libc::dup3(udp.as_raw_fd(), h, libc::O_CLOEXEC) } as i64)?;
            // SAFETY: F_SETFL on our descriptor: the guest's O_NONBLOCK, as it had set it.
            unsafe { libc::fcntl(h, libc::F_SETFL, if fl >= 0 { fl & libc::O_NONBLOCK } else { 0 }) };
            let mut st = n.lock();
            st.udp_to = Some(to);
            st.live = Some(live);
            st.dns_end = None;
            Ok(())
        }
        wire::NetReply::Refused { errno } => Err(Errno(errno)),
        _ => Err(ENETUNREACH),
    }
}

/// A datagram the guest sends on a UDP socket (host descriptor `h`): to `dest` (sendto) or the
/// connected address. DNS is answered by the engine; other destinations are brokered (see the
/// module comment).
pub fn dns_send(os: &GuestOs, h: RawFd, n: &NetSock, data: &[u8], dest: Option<SocketAddr>) -> SysResult {
    let to = match dest.map(unmap) {
        Some(d) => d,
        None => n.lock().peer.ok_or(Errno(89))?, // EDESTADDRREQ
    };
    let brokered = n.lock().udp_to;
    if to.port() != DNS_PORT || brokered.is_some() {
        if to.port() == DNS_PORT {
            return Err(ENETUNREACH); // DNS is the engine's, on a socket of its own
        }
        if brokered != Some(to) {
            udp_broker(os, h, n, to)?;
        }
        // SAFETY: send of a buffer we own on the connected UDP socket.
        return cvt(unsafe { libc::send(h, data.as_ptr().cast(), data.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) } as i64);
    }
    let reply = dns_answer(os, data);
    let mut st = n.lock();
    st.last_server = Some(to);
    if let (Some(reply), Some(end)) = (reply, st.dns_end.as_ref()) {
        // SAFETY: send of a buffer we own on our end of the datagram pair.
        unsafe { libc::send(end.as_raw_fd(), reply.as_ptr().cast(), reply.len(), libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    }
    Ok(data.len() as u64)
}

/// The engine's answer to a guest's DNS message (None: not even an id to answer).
fn dns_answer(os: &GuestOs, msg: &[u8]) -> Option<Vec<u8>> {
    let Some(q) = dns::parse_query(msg) else { return dns::formerr(msg) };
    if q.qclass != 1 {
        return Some(dns::answer(&q, dns::RCODE_NXDOMAIN, &[]));
    }
    let v6 = q.qtype == dns::TYPE_AAAA;
    let Some(broker) = broker_fd() else { return Some(dns::answer(&q, dns::RCODE_NXDOMAIN, &[])) };
    let req = wire::NetRequest::Resolve { pid: os.proc.pid, name: q.name.clone(), v6 };
    Some(match wire::call(broker, &req, BROKER_WAIT_MS) {
        Ok((wire::NetReply::Addrs(a), _)) => dns::answer(&q, 0, &a),
        Ok((wire::NetReply::NxDomain, _)) => dns::answer(&q, dns::RCODE_NXDOMAIN, &[]),
        _ => dns::answer(&q, dns::RCODE_SERVFAIL, &[]),
    })
}

/// The source address of a DNS socket's answers (where its last query went).
pub fn dns_source(n: &NetSock) -> Option<SocketAddr> {
    let st = n.lock();
    st.udp_to.or(st.last_server).or(st.peer)
}

/// Fill a recvfrom/recvmsg source address for a network socket.
pub fn write_source(ctx: &mut Ctx, n: &NetSock, addr: u64, lenp: u64) -> Result<(), Errno> {
    let a = if n.is_dns() { dns_source(n) } else { n.lock().peer };
    write_addr(ctx, a, n.family, addr, lenp)
}

/// A destination address given with sendto/sendmsg.
pub fn read_dest(ctx: &Ctx, addr: u64, len: u32) -> Result<SocketAddr, Errno> {
    read_addr(ctx, addr, len)
}

/// Before a send on a network socket: a non-blocking connect under way ends here if its reply
/// has come (else EAGAIN, as Linux says for a send on a connecting socket); a sandbox fork's
/// inherited connection reports the reset pending on it (SO_ERROR reads and clears it, so a later
/// read sees EOF, as under Linux).
pub fn pending_reset(n: &NetSock, h: RawFd) -> Result<(), Errno> {
    if n.is_dns() {
        return Ok(());
    }
    if n.lock().connecting.is_some() {
        return match finish_connect(h, n, 0) {
            None => Err(crate::guestos::EAGAIN),
            Some(r) => {
                n.lock().connect_err = None;
                r
            }
        };
    }
    if n.lock().relay.is_some() {
        return reset_at_end(n);
    }
    if !n.lock().inherited {
        return Ok(());
    }
    let mut err: i32 = 0;
    let mut len = 4 as libc::socklen_t;
    // SAFETY: SO_ERROR into an int we own, on our descriptor.
    unsafe { libc::getsockopt(h, libc::SOL_SOCKET, libc::SO_ERROR, (&mut err as *mut i32).cast(), &mut len) };
    if err != 0 {
        return Err(Errno(err));
    }
    Ok(())
}

/// A connection through a recording (`egress::tape`) whose peer reset it: the recording relay, or
/// its replay, posts a mark on the flow's liveness pair before it ends the stream (a socket pair
/// cannot carry a RST). Called where a read found the end of the stream, and before a send: the
/// first call after the reset fails with ECONNRESET, later ones see the end, as on a reset TCP
/// socket. A connection the guest holds directly gets the kernel's own reset and no mark.
pub fn reset_at_end(n: &NetSock) -> Result<(), Errno> {
    let st = n.lock();
    let (Some(_), Some(live)) = (st.relay, st.live.as_ref()) else { return Ok(()) };
    let mut b = [0u8; 1];
    // SAFETY: a one-byte non-blocking receive into a buffer we own, on our liveness end.
    let r = unsafe { libc::recv(live.as_raw_fd(), b.as_mut_ptr().cast(), 1, libc::MSG_DONTWAIT) };
    if r == 1 && b[0] == crate::egress::tape::RESET_MARK {
        return Err(ECONNRESET);
    }
    Ok(())
}

/// How long a blocking receive on a TCP socket waits on the host, holding its turn, before the
/// turn is handed on (see [`await_peer`]).
const PEER_GRACE_MS: i32 = 1;

/// Before a blocking receive on network socket `n` (host descriptor `h`) while processes take
/// turns (`guestos::sched`): its peer is outside the sandbox (through the broker), never another
/// guest process, so nothing the others do in their turns can bring its data. A loopback or LAN
/// answer comes within a moment: wait that moment on the host ([`PEER_GRACE_MS`]) before the
/// turn goes round. (Handed on at once, a turn with nobody else able to run comes back after a
/// pause of the scheduler's, and a first exchange on a new connection cost about a millisecond
/// more than on an open one.) Whether the data has come by then depends on the network, as it
/// did when the turn came back.
pub fn await_peer(n: &NetSock, h: RawFd, dontwait: bool) {
    if n.is_dns() || dontwait || !crate::guestos::sched::tree_active() {
        return;
    }
    // SAFETY: F_GETFL on a descriptor we hold.
    if unsafe { libc::fcntl(h, libc::F_GETFL) } & libc::O_NONBLOCK != 0 {
        return;
    }
    let mut p = libc::pollfd { fd: h, events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd.
    unsafe { libc::poll(&mut p, 1, PEER_GRACE_MS) };
}

pub fn listen() -> SysResult {
    Err(EOPNOTSUPP)
}

/// This sandbox's broker socket, from the controller. A new one means this VMM process is a new
/// sandbox (a fork): the TCP connections it inherited are its parent's and read as reset here
/// (ECONNRESET on the next call, as after a RST, then EOF and EPIPE), and the parent keeps them.
pub fn set_broker(os: &GuestOs, fd: OwnedFd) {
    let mut b = BROKER.lock().unwrap_or_else(|p| p.into_inner());
    if b.is_some() {
        for gfd in os.files.open_fds().collect::<Vec<_>>() {
            let Ok(f) = os.files.file(gfd) else { continue };
            let (Some(n), Some(h)) = (f.net.as_ref(), f.host_fd()) else { continue };
            let mut st = n.lock();
            if n.is_dns() && st.udp_to.is_some() {
                // A brokered UDP socket is the parent's: the child's starts over (its next send
                // asks the child's own broker).
                if let Ok((guest, vmm)) = pair(libc::SOCK_DGRAM) {
                    // SAFETY: dup3 of a fresh datagram pair's end over this socket's descriptor.
                    unsafe { libc::dup3(guest.as_raw_fd(), h, libc::O_CLOEXEC) };
                    st.dns_end = Some(vmm);
                }
                st.udp_to = None;
                st.live = None;
                st.peer = None;
                continue;
            }
            if n.is_dns() || st.live.is_none() || st.inherited {
                continue;
            }
            if let Ok((dead, other)) = pair(libc::SOCK_STREAM) {
                // A pair end whose peer closed with a byte unread: Linux leaves ECONNRESET pending
                // on it (unix_release_sock), which the next read reports; `pending_reset` makes a
                // send report it too, as a reset TCP socket's first call does.
                // SAFETY: a one-byte send on our fresh pair; then its other end is closed.
                unsafe { libc::send(dead.as_raw_fd(), b"r".as_ptr().cast(), 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
                drop(other);
                // SAFETY: dup3 of that end over this guest socket's host descriptor (our copy of
                // the parent's connection is closed; the parent keeps its own).
                unsafe { libc::dup3(dead.as_raw_fd(), h, libc::O_CLOEXEC) };
            }
            st.live = None;
            st.inherited = true;
        }
    }
    *b = Some(fd);
}
