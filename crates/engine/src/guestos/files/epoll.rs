//! epoll, emulated by the engine over `poll`: an epoll instance is an engine file holding its
//! interest list (guest fd, events, data); `epoll_wait` polls those fds with the same machinery as
//! poll(2) (host fds on the host, engine files always ready, waits in slices) and reports the ready
//! ones with their data.
//!
//! Differences from Linux, which the programs we run (asyncio, selectors) do not rely on: entries
//! name guest fd numbers, not open file descriptions (an entry whose fd is closed drops out at the
//! next wait; one whose number is reused watches the new file); EPOLLET is reported like level
//! triggering; EPOLLEXCLUSIVE and EPOLLWAKEUP are accepted and ignored. EPOLLONESHOT disables an
//! entry once it is reported, until EPOLL_CTL_MOD.

use std::sync::{Arc, Mutex};

use super::poll::{poll_fds, timeout_ms, timeout_ts, Timeout};
use super::{Kind, OpenFile};
use crate::guestos::{Ctx, Errno, GuestOs, SysResult, EBADF, EEXIST, EINVAL, ENOENT, EPERM};

const EPOLL_CTL_ADD: u64 = 1;
const EPOLL_CTL_DEL: u64 = 2;
const EPOLL_CTL_MOD: u64 = 3;
const EPOLLONESHOT: u32 = 1 << 30;
/// Bits that are flags, not events.
const EPOLL_FLAGS: u32 = (1 << 31) | (1 << 30) | (1 << 29) | (1 << 28);
/// struct epoll_event on x86-64: u32 events, u64 data, packed.
const EVENT_SIZE: usize = 12;
/// Linux's cap on maxevents (INT_MAX / sizeof(struct epoll_event)).
const EP_MAX_EVENTS: i32 = i32::MAX / EVENT_SIZE as i32;

/// One watched fd.
#[derive(Clone, Copy, Debug)]
pub struct Interest {
    pub fd: i32,
    pub events: u32,
    pub data: u64,
    /// EPOLLONESHOT fired: no more reports until EPOLL_CTL_MOD.
    pub disabled: bool,
}

/// The interest list of one epoll instance.
#[derive(Debug, Default)]
pub struct Epoll {
    pub list: Mutex<Vec<Interest>>,
}

pub fn sys_epoll_create(os: &mut GuestOs, size: Option<i32>, flags: i32) -> SysResult {
    if size.is_some_and(|s| s <= 0) || flags & !libc::EPOLL_CLOEXEC != 0 {
        return Err(EINVAL);
    }
    let mut f = OpenFile::new(Kind::Epoll(Epoll::default()), None, libc::O_RDWR);
    f.label = Some("anon_inode:[eventpoll]".into());
    os.files.alloc(0, Arc::new(f), flags & libc::EPOLL_CLOEXEC != 0).map(|fd| fd as u64)
}

fn instance(os: &GuestOs, epfd: i32) -> Result<Arc<OpenFile>, Errno> {
    let f = os.files.file(epfd)?;
    match f.kind {
        Kind::Epoll(_) => Ok(f),
        _ => Err(EINVAL),
    }
}

fn list(f: &OpenFile) -> &Mutex<Vec<Interest>> {
    match &f.kind {
        Kind::Epoll(e) => &e.list,
        _ => unreachable!("checked by `instance`"),
    }
}

pub fn sys_epoll_ctl(os: &mut GuestOs, ctx: &mut Ctx, epfd: i32, op: u64, fd: i32, eventp: u64) -> SysResult {
    let ep = instance(os, epfd)?;
    let target = os.files.file(fd)?;
    if fd == epfd {
        return Err(EINVAL);
    }
    // Linux refuses regular files and directories (always ready, nothing to wait for).
    if target.dir || !is_waitable(&target) {
        return Err(EPERM);
    }
    let (events, data) = if op == EPOLL_CTL_DEL {
        (0, 0)
    } else {
        let b = ctx.read_vec(eventp, EVENT_SIZE)?;
        (u32::from_le_bytes([b[0], b[1], b[2], b[3]]), u64::from_le_bytes(b[4..12].try_into().map_err(|_| EINVAL)?))
    };
    let mut l = list(&ep).lock().map_err(|_| EINVAL)?;
    let at = l.iter().position(|i| i.fd == fd);
    match (op, at) {
        (EPOLL_CTL_ADD, Some(_)) => Err(EEXIST),
        (EPOLL_CTL_ADD, None) => {
            l.push(Interest { fd, events, data, disabled: false });
            Ok(0)
        }
        (EPOLL_CTL_MOD, Some(i)) => {
            l[i] = Interest { fd, events, data, disabled: false };
            Ok(0)
        }
        (EPOLL_CTL_DEL, Some(i)) => {
            l.remove(i);
            Ok(0)
        }
        (EPOLL_CTL_MOD | EPOLL_CTL_DEL, None) => Err(ENOENT),
        _ => Err(EINVAL),
    }
}

/// Host files that can block: pipes, sockets, character devices, eventfds and other anon inodes.
fn is_waitable(f: &OpenFile) -> bool {
    if f.host_fd().is_none() {
        return true;
    }
    let Ok(st) = super::special::file_stat(f) else { return false };
    !matches!(st.st_mode & libc::S_IFMT, libc::S_IFREG | libc::S_IFDIR) || f.label.is_some()
}

/// epoll_wait, epoll_pwait (the signal mask is not applied: nothing in the sandbox interrupts a
/// wait but its own children and peers), epoll_pwait2.
pub fn sys_epoll_wait(os: &mut GuestOs, ctx: &mut Ctx, epfd: i32, eventsp: u64, maxevents: i32, timeout: Timeout) -> SysResult {
    if !(1..=EP_MAX_EVENTS).contains(&maxevents) {
        return Err(EINVAL);
    }
    let ep = instance(os, epfd)?;
    let watched: Vec<Interest> = {
        let mut l = list(&ep).lock().map_err(|_| EBADF)?;
        // Entries whose fd was closed drop out (Linux drops them when the file goes away).
        l.retain(|i| os.files.get(i.fd).is_ok());
        l.iter().filter(|i| !i.disabled).copied().collect()
    };
    let fds: Vec<(i32, i16)> = watched.iter().map(|i| (i.fd, (i.events & !EPOLL_FLAGS & 0xffff) as i16)).collect();
    let revents = poll_fds(os, &fds, timeout)?;
    let mut out = Vec::new();
    let mut fired = Vec::new();
    for (w, r) in watched.iter().zip(&revents) {
        if *r == 0 || out.len() / EVENT_SIZE >= maxevents as usize {
            continue;
        }
        out.extend_from_slice(&(*r as u16 as u32).to_le_bytes());
        out.extend_from_slice(&w.data.to_le_bytes());
        if w.events & EPOLLONESHOT != 0 {
            fired.push(w.fd);
        }
    }
    if !fired.is_empty() {
        let mut l = list(&ep).lock().map_err(|_| EBADF)?;
        for i in l.iter_mut().filter(|i| fired.contains(&i.fd)) {
            i.disabled = true;
        }
    }
    if !out.is_empty() {
        ctx.write(eventsp, &out)?;
    }
    Ok((out.len() / EVENT_SIZE) as u64)
}

pub fn timeout_of_wait(ctx: &Ctx, nr_is_pwait2: bool, arg: u64) -> Result<Timeout, Errno> {
    if nr_is_pwait2 {
        timeout_ts(ctx, arg)
    } else {
        Ok(timeout_ms(arg as i32))
    }
}
