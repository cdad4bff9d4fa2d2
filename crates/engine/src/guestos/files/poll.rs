//! poll, ppoll, select, pselect6. Host fds are polled on the host; engine files are always ready
//! (captured output for writing; /dev/null, /dev/zero, /proc files for both). A wait longer than
//! [`WAIT_SLICE_MS`] ends after that slice with EINTR if nothing is ready, so the VMM never blocks
//! past its run's deadline (libc and Python retry with the remaining time).
//!
//! In replay mode the guest's clocks are virtual (see `clock`): a wait that ends with nothing ready
//! lets virtual time pass by what it waited, as a sleep does, so that a retry with "the remaining
//! time" ends; one that another process ends lets the real time it waited pass. A wait on nothing but engine files (or on no fds at all: `select(0, ..., timeout)`,
//! a common sleep) cannot be ended by anything but its timeout: it returns at once, like a sleep.

use std::time::Duration;

use super::{Kind, WAIT_SLICE_MS};
use crate::guestos::{Ctx, Errno, GuestOs, SysResult, EBADF, EFAULT, EINTR, EINVAL};

/// A guest timeout: None waits forever.
pub type Timeout = Option<Duration>;

pub fn timeout_ms(ms: i32) -> Timeout {
    (ms >= 0).then(|| Duration::from_millis(ms as u64))
}

/// A `struct timespec *` timeout (NULL: forever).
pub fn timeout_ts(ctx: &Ctx, p: u64) -> Result<Timeout, Errno> {
    if p == 0 {
        return Ok(None);
    }
    let b = ctx.read_vec(p, 16)?;
    let sec = i64::from_le_bytes(b[..8].try_into().map_err(|_| EFAULT)?);
    let nsec = i64::from_le_bytes(b[8..].try_into().map_err(|_| EFAULT)?);
    if sec < 0 || !(0..1_000_000_000).contains(&nsec) {
        return Err(EINVAL);
    }
    Ok(Some(Duration::new(sec as u64, nsec as u32)))
}

/// A `struct timeval *` timeout (NULL: forever).
pub fn timeout_tv(ctx: &Ctx, p: u64) -> Result<Timeout, Errno> {
    if p == 0 {
        return Ok(None);
    }
    let b = ctx.read_vec(p, 16)?;
    let sec = i64::from_le_bytes(b[..8].try_into().map_err(|_| EFAULT)?);
    let usec = i64::from_le_bytes(b[8..].try_into().map_err(|_| EFAULT)?);
    if sec < 0 || usec < 0 {
        return Err(EINVAL);
    }
    // Linux normalises large tv_usec.
    let d = Duration::from_secs(sec as u64).saturating_add(Duration::from_micros(usec as u64));
    Ok(Some(d))
}

/// Poll `fds` (fd, events) and return each one's revents. EINTR if nothing became ready within
/// the slice and the guest's timeout is longer.
pub fn poll_fds(os: &mut GuestOs, fds: &[(i32, i16)], timeout: Timeout) -> Result<Vec<i16>, Errno> {
    let mut revents = vec![0i16; fds.len()];
    let mut host: Vec<libc::pollfd> = Vec::new();
    let mut host_idx: Vec<usize> = Vec::new();
    let mut ready = 0;
    let mut connecting: Vec<(usize, usize, std::sync::Arc<super::OpenFile>)> = Vec::new();
    // Whether one of the descriptors is a network socket (its peer is outside the sandbox).
    let mut network = false;
    for (i, &(fd, events)) in fds.iter().enumerate() {
        if fd < 0 {
            continue;
        }
        let Ok(f) = os.files.get(fd) else {
            revents[i] = libc::POLLNVAL;
            ready += 1;
            continue;
        };
        let rw = libc::POLLIN | libc::POLLOUT | libc::POLLRDNORM | libc::POLLWRNORM;
        let r = match &f.file.kind {
            Kind::Host(h) => {
                use std::os::fd::AsRawFd;
                network |= f.file.net.as_ref().is_some_and(|n| n.external());
                // A non-blocking connect under way: its POLLOUT is the broker's reply arriving.
                if let Some(reply) = f.file.net.as_ref().and_then(|n| super::inet::connecting_fd(h.as_raw_fd(), n)) {
                    connecting.push((host.len(), i, f.file.clone()));
                    host.push(libc::pollfd { fd: reply, events: libc::POLLIN, revents: 0 });
                } else {
                    host.push(libc::pollfd { fd: h.as_raw_fd(), events, revents: 0 });
                }
                host_idx.push(i);
                continue;
            }
            Kind::Capture(_) => events & (libc::POLLOUT | libc::POLLWRNORM),
            _ => events & rw,
        };
        revents[i] = r;
        if r != 0 {
            ready += 1;
        }
    }
    // Replay mode with other processes: one look, then their turn (see `guestos::sched`); a
    // timeout is a deadline on the tree's shared virtual time.
    if ready == 0 && crate::guestos::sched::active() {
        super::poll_now(&mut host)?;
        ready += host_revents(&host, &host_idx, fds, &mut revents);
        ready = connected(&host, &connecting, fds, &mut revents, ready);
        if ready > 0 {
            return Ok(revents);
        }
        let deadline = timeout.map(|t| {
            let now = crate::guestos::thread::now(&os.proc.clocks);
            (now, crate::guestos::sched::deadline(now, t.as_nanos().min(u64::MAX as u128) as u64))
        });
        if let Some((now, d)) = deadline {
            if now >= d {
                return Ok(revents);
            }
        }
        if crate::guestos::sched::yield_blocked_on(deadline.map(|(_, d)| d), network) {
            return Err(crate::guestos::signal::ERESTARTSYS);
        }
    }
    let slice = Duration::from_millis(WAIT_SLICE_MS as u64);
    let replay = os.proc.clocks.replay;
    if replay && ready == 0 && host.is_empty() {
        if let Some(t) = timeout {
            os.proc.clocks.pass(t.as_nanos().min(u64::MAX as u128) as u64);
            return Ok(revents);
        }
    }
    let wait = if ready > 0 { Duration::ZERO } else { timeout.map_or(slice, |t| t.min(slice)) };
    let longer = timeout.is_none_or(|t| t > slice);
    let waited_from = std::time::Instant::now();
    // SAFETY: `host` is a valid array of pollfds of the length we pass.
    let n = unsafe { libc::poll(host.as_mut_ptr(), host.len() as libc::nfds_t, wait.as_millis() as i32) };
    if n < 0 {
        return Err(Errno::last());
    }
    ready += host_revents(&host, &host_idx, fds, &mut revents);
    ready = connected(&host, &connecting, fds, &mut revents, ready);
    if ready == 0 && wait > Duration::ZERO && replay && timeout.is_some() {
        os.proc.clocks.pass(wait.as_nanos() as u64);
    } else if ready > 0 && wait > Duration::ZERO && replay {
        // Another process (the only thing that can) ended the wait: the time it took passes in
        // virtual time too, or a caller's timeout ("communicate(timeout=...)") would never come
        // while a child trickles output. Such waits depend on the host's scheduling anyway.
        os.proc.clocks.pass((waited_from.elapsed().min(wait)).as_nanos() as u64);
    }
    if ready == 0 && wait > Duration::ZERO && longer {
        return Err(EINTR);
    }
    Ok(revents)
}

/// Copy the host poll's results into `revents` (for the guest's events and the ones that are
/// always reported); how many became ready.
/// Non-blocking connects whose reply came: taken now (the socket is the connected one from here
/// on), and reported as Linux does: POLLOUT, with POLLERR and POLLHUP if it failed.
fn connected(host: &[libc::pollfd], connecting: &[(usize, usize, std::sync::Arc<super::OpenFile>)], fds: &[(i32, i16)], revents: &mut [i16], mut ready: usize) -> usize {
    for (k, i, f) in connecting {
        let was = revents[*i] != 0;
        revents[*i] = 0;
        if host[*k].revents != 0 {
            if let (Some(n), Some(h)) = (f.net.as_ref(), f.host_fd()) {
                revents[*i] = match super::inet::finish_connect(h, n, 0) {
                    None => 0,
                    Some(Ok(())) => fds[*i].1 & (libc::POLLOUT | libc::POLLWRNORM),
                    Some(Err(_)) => libc::POLLOUT | libc::POLLERR | libc::POLLHUP,
                };
            }
        }
        match (was, revents[*i] != 0) {
            (true, false) => ready -= 1,
            (false, true) => ready += 1,
            _ => {}
        }
    }
    ready
}

fn host_revents(host: &[libc::pollfd], host_idx: &[usize], fds: &[(i32, i16)], revents: &mut [i16]) -> usize {
    const ALWAYS: i16 = libc::POLLERR | libc::POLLHUP | libc::POLLNVAL;
    let mut ready = 0;
    for (p, &i) in host.iter().zip(host_idx) {
        revents[i] = p.revents & (fds[i].1 | ALWAYS);
        if revents[i] != 0 {
            ready += 1;
        }
    }
    ready
}

pub fn sys_poll(os: &mut GuestOs, ctx: &mut Ctx, fdsp: u64, nfds: u64, timeout: Timeout) -> SysResult {
    if nfds > os.files.limit as u64 {
        return Err(EINVAL);
    }
    let raw = ctx.read_vec(fdsp, nfds as usize * 8)?;
    let fds: Vec<(i32, i16)> = raw
        .chunks_exact(8)
        .map(|c| (i32::from_le_bytes([c[0], c[1], c[2], c[3]]), i16::from_le_bytes([c[4], c[5]])))
        .collect();
    let revents = poll_fds(os, &fds, timeout)?;
    let mut out = raw;
    for (c, r) in out.chunks_exact_mut(8).zip(&revents) {
        c[6..8].copy_from_slice(&r.to_le_bytes());
    }
    ctx.write(fdsp, &out)?;
    Ok(revents.iter().filter(|r| **r != 0).count() as u64)
}

/// select/pselect6: `sets` are the read, write and except fd_set pointers (0: none).
pub fn sys_select(os: &mut GuestOs, ctx: &mut Ctx, nfds: i32, sets: [u64; 3], timeout: Timeout) -> SysResult {
    if nfds < 0 || nfds as usize > os.files.limit {
        return Err(EINVAL);
    }
    let nfds = nfds as usize;
    let bytes = nfds.div_ceil(64) * 8;
    let mut bits: [Vec<u8>; 3] = Default::default();
    for (b, &p) in bits.iter_mut().zip(&sets) {
        *b = if p == 0 { vec![0; bytes] } else { ctx.read_vec(p, bytes)? };
    }
    let isset = |b: &[u8], fd: usize| b[fd / 8] & (1 << (fd % 8)) != 0;
    let mut fds = Vec::new();
    for fd in 0..nfds {
        let mut ev = 0;
        if isset(&bits[0], fd) {
            ev |= libc::POLLIN;
        }
        if isset(&bits[1], fd) {
            ev |= libc::POLLOUT;
        }
        if isset(&bits[2], fd) {
            ev |= libc::POLLPRI;
        }
        if ev != 0 {
            if os.files.get(fd as i32).is_err() {
                return Err(EBADF);
            }
            fds.push((fd as i32, ev));
        }
    }
    let revents = poll_fds(os, &fds, timeout)?;
    let mut out: [Vec<u8>; 3] = [vec![0; bytes], vec![0; bytes], vec![0; bytes]];
    let mut count = 0;
    for (&(fd, ev), &r) in fds.iter().zip(&revents) {
        let fd = fd as usize;
        let hits = [
            ev & libc::POLLIN != 0 && r & (libc::POLLIN | libc::POLLHUP | libc::POLLERR) != 0,
            ev & libc::POLLOUT != 0 && r & (libc::POLLOUT | libc::POLLERR) != 0,
            ev & libc::POLLPRI != 0 && r & libc::POLLPRI != 0,
        ];
        for (o, hit) in out.iter_mut().zip(hits) {
            if hit {
                o[fd / 8] |= 1 << (fd % 8);
                count += 1;
            }
        }
    }
    for (o, &p) in out.iter().zip(&sets) {
        if p != 0 {
            ctx.write(p, o)?;
        }
    }
    Ok(count)
}
