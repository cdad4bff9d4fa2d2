//! A sandbox's stubs end with their VMMs: one reaper process per sandbox holds a pidfd of every
//! VMM process of the sandbox's tree and of the stub that VMM runs, and SIGKILLs a stub as soon as
//! its VMM is gone.
//!
//! # Why
//! A stub that runs guest code never looks at its VMM: it checks its socket only while it waits
//! for the VMM (blob.rs). A guest that computes without syscalls (`while :; do :; done`) never
//! waits, so when its VMM is SIGKILLed (the sandbox destroyed, `end_exec` killing an exec's
//! processes, the controller killed and the VMMs with it) the stub spins on a host CPU for good,
//! reparented to init. Only the first stub of a sandbox has `PR_SET_PDEATHSIG`: the others are
//! children of the stub they were forked from, not of their VMM.
//!
//! # Why a reaper, and not a timer in the stub
//! A CPU-time timer armed in the stub (its handler checking the VMM at each tick) costs less, but
//! everything inside the stub is the guest's to use (mod.rs, "Trust"): guest code can jump into
//! the blob and make its admitted syscalls with its own arguments, and can block host signals by
//! handing `rt_sigreturn` a frame of its own making (the mask comes from the frame). A hostile
//! guest could switch such a timer off and then outlive its sandbox on purpose. The reaper is a
//! host process that no guest code runs in; SIGKILL cannot be blocked, and a pidfd never names a
//! recycled pid. A PID namespace would take every stub with its first process, but it ends with
//! that process, which a forked stub must outlive (confine.rs).
//!
//! # How
//! [`start`], in the top VMM of a tree (the sandbox's first process, or a clone), makes a
//! `SOCK_SEQPACKET` socket pair and clones the reaper with `CLONE_VM` (no page tables copied: the
//! VMM may be a fork of a large launcher) on a stack of its own, every signal blocked; it closes
//! every descriptor but its end of the socket and a pidfd of the top VMM, and makes raw syscalls
//! only (no libc: it would write the VMM thread's `errno`, whose TLS it shares). Every VMM of the
//! tree inherits the other end. A VMM calls [`register`] before its stub first runs guest code:
//! one message carries a pidfd of the VMM and one of its stub (SCM_RIGHTS). So every stub that
//! runs guest code has been handed to the reaper, however far behind the reaper is: a message
//! still queued when its VMM dies is read later, finds that VMM's pidfd readable and kills the
//! stub then. The reaper polls the pidfds:
//! - a VMM's turns readable (it ended: exited, killed by `end_exec`, by its parent's end, by the
//!   host's OOM killer): its stub gets SIGKILL;
//! - the top VMM's turns readable (the sandbox destroyed, its controller gone: `vmm::lifeline`):
//!   every registered stub and VMM gets SIGKILL; a registration still arriving is killed as it is
//!   read, until no VMM holds the socket any more (it hangs up) or [`GRACE_MS`] passes without a
//!   message; then the reaper ends.
//!
//! A stub whose VMM is gone while it waits (parked) ends at its next wait, as before (blob.rs).
//! A registration that fails (the reaper is gone) ends the VMM before its stub runs.
//!
//! # Limits
//! `COLLIMATE_SYSTRAP_REAPER=0` in the VMM's environment starts none, to compare (benches).
//! Only a served sandbox's tree has a reaper (`vmm::systrap::serve`). A first process run inside
//! the caller's own process (`vmm::systrap::Process::spawn`: tests and benches) relies on the
//! parent-death signal of its child VMMs and on killing its children's stubs itself.

use std::io;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, IntoRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicUsize, Ordering};

use super::{pidfd_open, send_fds, Error, Result, Stub};

/// How many (VMM, stub) pairs one reaper holds: a sandbox has at most 256 live processes
/// (`vmm::process::MAX_PROCESSES`); the rest is room for ended ones not yet polled. A
/// registration beyond it is killed at once (both the VMM and its stub).
pub const CAPACITY: usize = 1024;

/// After the top VMM's end: how long the reaper waits for the last VMMs of the tree to let go of
/// the socket (each one killed as it registers), in milliseconds.
pub const GRACE_MS: i64 = 10_000;

/// The reaper's task name (`ps`, /proc/<pid>/comm).
pub const NAME: &[u8; 16] = b"collimate-reap\0\0";

const STACK: usize = 64 << 10;

/// The registration socket of this process's tree (-1: none, outside a served tree).
static REG: AtomicI32 = AtomicI32::new(-1);
/// The reaper's memory in this process (its stack and table), and the process that made it.
static REGION: AtomicUsize = AtomicUsize::new(0);
static REGION_OWNER: AtomicI32 = AtomicI32::new(0);
/// The host pid of this process's reaper (0: none started here).
static PID: AtomicI32 = AtomicI32::new(0);

/// The host pid of the reaper this process started, if any (a child of this process that is
/// not a guest process: a reset waits for every other child to go).
pub fn pid() -> Option<i32> {
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    (REGION_OWNER.load(Ordering::SeqCst) == me).then(|| PID.load(Ordering::SeqCst)).filter(|&p| p > 0)
}

/// What the reaper works on: written by [`start`] before the clone, then the reaper's alone.
#[repr(C)]
struct Table {
    top: RawFd,
    rx: RawFd,
    n: usize,
    owners: [RawFd; CAPACITY],
    stubs: [RawFd; CAPACITY],
    polls: [libc::pollfd; CAPACITY + 2],
    name: [u8; 16],
    /// recvmsg's buffers: the header, one data byte, room for two descriptors.
    iov: libc::iovec,
    byte: u8,
    control: [u64; 4],
    msg: libc::msghdr,
}

const fn region_len() -> usize {
    (std::mem::size_of::<Table>() + STACK + 4095) & !4095
}

/// Whether `COLLIMATE_SYSTRAP_REAPER=0` asks for no reaper (to measure what it costs: benches).
fn off() -> bool {
    std::env::var_os("COLLIMATE_SYSTRAP_REAPER").is_some_and(|v| v == "0")
}

/// Start this tree's reaper in its top VMM (this process) and hand it `first`, the stub this
/// process runs. In a clone, the tree it was forked from is forgotten first.
pub fn start(first: &Stub) -> Result<()> {
    forget();
    if off() {
        return Ok(());
    }
    // SAFETY: getpid cannot fail.
    let me = unsafe { libc::getpid() };
    let old = REGION.swap(0, Ordering::SeqCst);
    if old != 0 && REGION_OWNER.load(Ordering::SeqCst) != me {
        // SAFETY: our copy of the region of the tree this process was forked from; its reaper
        // works in that process's memory, not in this copy.
        unsafe { libc::munmap(old as *mut libc::c_void, region_len()) };
    }
    let host = |call| move |source| Error::Host { call, source };
    let (tx, rx) = seqpacket_pair().map_err(host("socketpair for the reaper"))?;
    let top = pidfd_open(me).map_err(host("pidfd_open of the top VMM"))?;
    // SAFETY: a fresh private anonymous mapping, checked; the reaper uses it for as long as it
    // lives (this process never unmaps it; a fork's copy is unmapped above).
    let region = unsafe {
        libc::mmap(std::ptr::null_mut(), region_len(), libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
    };
    if region == libc::MAP_FAILED {
        return Err(host("mmap for the reaper")(io::Error::last_os_error()));
    }
    let t = region.cast::<Table>();
    // SAFETY: the mapping is zeroed, large enough and aligned for a Table; nothing else uses it.
    unsafe {
        (*t).top = top.as_raw_fd();
        (*t).rx = rx.as_raw_fd();
        (*t).name = *NAME;
    }
    // SAFETY: zeroed sigsets are valid (empty) sets.
    let (mut all, mut old_mask): (libc::sigset_t, libc::sigset_t) = unsafe { (std::mem::zeroed(), std::mem::zeroed()) };
    // SAFETY: the reaper starts with every signal blocked (it inherits the mask; the VMM's
    // handlers must never run on its stack), and this thread's mask is put back after the clone.
    // The reaper runs `reaper_main` on the top of the region, in this process's memory, touching
    // only its Table and making raw syscalls.
    let rc = unsafe {
        libc::sigfillset(&mut all);
        libc::pthread_sigmask(libc::SIG_BLOCK, &all, &mut old_mask);
        let top_of_stack = region.cast::<u8>().add(region_len()) as usize & !15;
        let rc = libc::clone(reaper_main, top_of_stack as *mut libc::c_void, libc::CLONE_VM | libc::SIGCHLD, t.cast());
        let e = io::Error::last_os_error();
        libc::pthread_sigmask(libc::SIG_SETMASK, &old_mask, std::ptr::null_mut());
        if rc < 0 {
            libc::munmap(region, region_len());
            return Err(host("clone of the reaper")(e));
        }
        rc
    };
    debug_assert!(rc > 0);
    REGION.store(region as usize, Ordering::SeqCst);
    REGION_OWNER.store(me, Ordering::SeqCst);
    PID.store(rc, Ordering::SeqCst);
    drop((rx, top)); // the reaper's copies are its own
    REG.store(tx.into_raw_fd(), Ordering::SeqCst);
    register(first).map(|_| ())
}

/// Hand this process (a VMM of a tree with a reaper) and `stub`, the stub it runs, to the
/// reaper. Call it before the stub first runs guest code. `Ok(false)`: this process has no
/// reaper (outside a served tree); nothing was registered.
pub fn register(stub: &Stub) -> Result<bool> {
    let reg = REG.load(Ordering::SeqCst);
    if reg < 0 {
        return Ok(false);
    }
    // SAFETY: getpid cannot fail.
    let me = pidfd_open(unsafe { libc::getpid() }).map_err(|source| Error::Host { call: "pidfd_open of this VMM", source })?;
    // SAFETY: REG is open for as long as it is stored (closed only by `forget`, on this thread).
    let sock = unsafe { BorrowedFd::borrow_raw(reg) };
    send_fds(sock, &[me.as_raw_fd(), stub.pidfd().as_raw_fd()])
        .map_err(|source| Error::Host { call: "sendmsg to the sandbox's reaper (is it gone?)", source })?;
    Ok(true)
}

/// In a process that leaves the tree (a clone becoming a sandbox of its own): close its copy of
/// the tree's registration socket, so that the old tree's reaper sees its VMMs go.
pub fn forget() {
    let fd = REG.swap(-1, Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: our descriptor, no longer stored anywhere.
        drop(unsafe { OwnedFd::from_raw_fd(fd) });
    }
}

fn seqpacket_pair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two ints for the kernel to fill.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

/// A raw system call: no libc wrapper (which would set the VMM thread's `errno`, see the module
/// docs). Returns the kernel's result (a negative errno on failure).
///
/// # Safety
/// The arguments must be valid for system call `nr`.
unsafe fn sys(nr: libc::c_long, a: [usize; 4]) -> isize {
    let ret: isize;
    // SAFETY: the caller's; `syscall` clobbers rcx and r11 only.
    unsafe {
        std::arch::asm!(
            "syscall",
            inlateout("rax") nr as isize => ret,
            in("rdi") a[0],
            in("rsi") a[1],
            in("rdx") a[2],
            in("r10") a[3],
            lateout("rcx") _,
            lateout("r11") _,
            options(nostack),
        );
    }
    ret
}

fn close(fd: RawFd) {
    // SAFETY: closing a descriptor of the reaper's own table.
    unsafe { sys(libc::SYS_close, [fd as usize, 0, 0, 0]) };
}

fn kill(pidfd: RawFd) {
    // SAFETY: pidfd_send_signal on a pidfd of the reaper's table; a process that has ended makes
    // it fail harmlessly (ESRCH).
    unsafe { sys(libc::SYS_pidfd_send_signal, [pidfd as usize, libc::SIGKILL as usize, 0, 0]) };
}

impl Table {
    /// SIGKILL every registered stub, then every registered VMM, and let go of them all.
    fn kill_all(&mut self) {
        for i in 0..self.n {
            kill(self.stubs[i]);
        }
        for i in 0..self.n {
            kill(self.owners[i]);
            close(self.owners[i]);
            close(self.stubs[i]);
        }
        self.n = 0;
    }

    /// Read every queued registration. False once the socket has hung up (no VMM holds it).
    fn drain(&mut self, top_alive: bool) -> bool {
        loop {
            self.iov = libc::iovec { iov_base: (&raw mut self.byte).cast(), iov_len: 1 };
            // SAFETY: an all-zero msghdr is valid; its pointers, set below, are into this Table.
            self.msg = unsafe { std::mem::zeroed() };
            self.msg.msg_iov = &raw mut self.iov;
            self.msg.msg_iovlen = 1;
            self.msg.msg_control = self.control.as_mut_ptr().cast();
            self.msg.msg_controllen = std::mem::size_of_val(&self.control);
            self.control = [0; 4];
            // SAFETY: recvmsg into this Table's buffers, without waiting.
            let r = unsafe { sys(libc::SYS_recvmsg, [self.rx as usize, (&raw mut self.msg) as usize, libc::MSG_DONTWAIT as usize, 0]) };
            if r == -(libc::EINTR as isize) {
                continue;
            }
            if r < 0 {
                // EAGAIN: nothing more queued; any other error will not go away (poll would
                // report the socket again at once): as an end of file.
                return r == -(libc::EAGAIN as isize);
            }
            // One SCM_RIGHTS header (16 bytes: length, level, type) and up to two descriptors.
            let len = self.control[0] as usize;
            let (level, ty) = (self.control[1] as u32 as i32, (self.control[1] >> 32) as u32 as i32);
            let fds = if self.msg.msg_controllen >= 16 && level == libc::SOL_SOCKET && ty == libc::SCM_RIGHTS {
                [(self.control[2] as u32) as i32, (self.control[2] >> 32) as u32 as i32]
            } else {
                [-1, -1]
            };
            let count = if fds[0] < 0 { 0 } else if len >= 24 { 2 } else { 1 };
            if count == 2 {
                let (owner, stub) = (fds[0], fds[1]);
                if top_alive && self.n < CAPACITY {
                    self.owners[self.n] = owner;
                    self.stubs[self.n] = stub;
                    self.n += 1;
                } else {
                    kill(stub);
                    kill(owner);
                    close(owner);
                    close(stub);
                }
            } else if count == 1 {
                close(fds[0]);
            }
            if r == 0 && count == 0 {
                return false; // end of file: every VMM has let go of the socket
            }
        }
    }
}

/// The reaper (see the module docs). Never returns: it ends by `exit`.
extern "C" fn reaper_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: `start` wrote a Table at `arg` and never touches it again.
    let t = unsafe { &mut *arg.cast::<Table>() };
    let (lo, hi) = if t.top < t.rx { (t.top, t.rx) } else { (t.rx, t.top) };
    // SAFETY: closing every descriptor of the reaper's own table but `lo` and `hi` (the VMM's
    // channel, stub sockets and the registration socket's sending end must not be held here).
    unsafe {
        if lo > 0 {
            sys(libc::SYS_close_range, [0, lo as usize - 1, 0, 0]);
        }
        if hi > lo + 1 {
            sys(libc::SYS_close_range, [lo as usize + 1, hi as usize - 1, 0, 0]);
        }
        sys(libc::SYS_close_range, [hi as usize + 1, u32::MAX as usize, 0, 0]);
        sys(libc::SYS_prctl, [libc::PR_SET_NAME as usize, t.name.as_ptr() as usize, 0, 0]);
    }
    let (mut top_alive, mut rx_open) = (true, true);
    loop {
        t.polls[0] = libc::pollfd { fd: if top_alive { t.top } else { -1 }, events: libc::POLLIN, revents: 0 };
        t.polls[1] = libc::pollfd { fd: if rx_open { t.rx } else { -1 }, events: libc::POLLIN, revents: 0 };
        for i in 0..t.n {
            t.polls[2 + i] = libc::pollfd { fd: t.owners[i], events: libc::POLLIN, revents: 0 };
        }
        let timeout = if top_alive { -1 } else { GRACE_MS };
        // SAFETY: poll on 2 + n valid pollfds of this Table.
        let r = unsafe { sys(libc::SYS_poll, [t.polls.as_mut_ptr() as usize, 2 + t.n, timeout as usize, 0]) };
        if r == 0 {
            break; // the grace after the top's end passed without a message
        }
        if r < 0 {
            if r != -(libc::EINTR as isize) {
                let pause = libc::timespec { tv_sec: 0, tv_nsec: 10_000_000 };
                // SAFETY: a short sleep before polling again (ENOMEM: the host is short of memory).
                unsafe { sys(libc::SYS_nanosleep, [(&raw const pause) as usize, 0, 0, 0]) };
            }
            continue;
        }
        if top_alive && t.polls[0].revents != 0 {
            top_alive = false;
            t.kill_all();
            if !rx_open {
                break; // nothing can register any more
            }
        } else {
            // In reverse, so that moving the last entry into a freed slot moves one already seen.
            let mut i = t.n;
            while i > 0 {
                i -= 1;
                if t.polls[2 + i].revents != 0 {
                    kill(t.stubs[i]);
                    close(t.stubs[i]);
                    close(t.owners[i]);
                    t.n -= 1;
                    t.owners[i] = t.owners[t.n];
                    t.stubs[i] = t.stubs[t.n];
                }
            }
        }
        if rx_open && t.polls[1].revents != 0 && !t.drain(top_alive) {
            // No VMM of the tree holds the socket any more: nothing can register. After the
            // top's end that is the end; before it (the top let go of its end, which it does
            // not), the registered VMMs are still watched, and the top.
            if !top_alive {
                break;
            }
            rx_open = false;
        }
    }
    t.kill_all();
    // SAFETY: ends this task only (the VMM's memory it shares is the VMM's).
    unsafe { sys(libc::SYS_exit, [0, 0, 0, 0]) };
    0
}
