//! The guest's file descriptor table and the file syscalls.
//!
//! A guest fd names an [`OpenFile`] (Linux's "open file description": offset and status flags are
//! shared by the fds `dup` makes). Most are host fds opened inside the sandbox's view ([`Vfs`]);
//! the initial stdout and stderr are captured into the run's output; `/dev` and `/proc` files are
//! made up by the engine ([`special`]).
//!
//! Path syscalls look the path up through [`Vfs::resolve`] (which follows symlinks itself, inside
//! the sandbox) and then make the `*at` host call on the last component, relative to the
//! directory fd the lookup ended in, with the no-follow variant. Relative paths start at the cwd
//! (`os.proc.cwd`) or at the remembered guest path of a directory fd.
//!
//! Blocking: a read or write on a host pipe waits at most [`WAIT_SLICE_MS`] inside one syscall and
//! then restarts the syscall (`signal::ERESTARTSYS`: the guest re-executes it), so that a VMM never
//! blocks past its run's deadline and the wait goes on in the next run. poll/select return EINTR
//! after a slice when their timeout is longer (libc and Python retry with the remaining time).

mod path;
pub(crate) mod poll;
pub mod pty;
mod epoll;
pub mod inet;
mod socket;
pub mod special;
pub mod stamp;
#[cfg(test)]
mod tests;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::Arc;

use super::limits;
use super::process::Proc;
use super::random;
use super::{Ctx, Errno, GuestOs, Output, SysResult};
use super::{EAGAIN, EBADF, EFAULT, EINTR, EINVAL, EISDIR, EMFILE, ENOTDIR, ENOTTY, ESPIPE};
use crate::vmm::OUTPUT_CAP;

pub(crate) const EBUSY: Errno = Errno(16);
pub(crate) const EXDEV: Errno = Errno(18);
pub(crate) const ENODEV: Errno = Errno(19);

/// Default limit on open fds (RLIMIT_NOFILE's soft limit): fds are below this.
pub const NOFILE: usize = 1024;
/// Largest fd table, whatever RLIMIT_NOFILE says.
pub const MAX_NOFILE: usize = 1 << 16;
/// Largest transfer one read/write-like syscall makes; a larger request transfers less (as a
/// short read or write, which callers handle).
pub const MAX_IO: usize = 16 << 20;
/// Longest a host pipe, poll or select wait lasts inside one syscall (then EINTR).
pub const WAIT_SLICE_MS: i32 = 100;
/// Most iovecs per readv/writev, as Linux.
const UIO_MAXIOV: u64 = 1024;

/// What a guest open file is.
pub enum Kind {
    /// A host file, directory, pipe or memfd (opened inside the sandbox; host-side O_CLOEXEC).
    Host(OwnedFd),
    /// The sandbox's stdout (1) or stderr (2): writes go to the pipe in `os.stdio` (set by the
    /// controller, and replaced for a fork, so every fd that shares this file follows), or without
    /// one into the run's captured output (`ctx.out`, capped at OUTPUT_CAP).
    Capture(u8),
    /// `/dev/null`; also the initial stdin.
    Null,
    /// `/dev/zero`.
    Zero,
    /// `/dev/random`, `/dev/urandom`.
    Random,
    /// A read-only file whose contents the engine made when it was opened (`/proc` files).
    Data(Vec<u8>),
    /// A directory listing the engine made when it was opened (`/dev`, `/proc`...): names and
    /// `d_type`s.
    VirtDir(Vec<(String, u8)>),
    /// The in-guest agent's channel to the host (fd 3 of an agent process): reads return the
    /// request the controller queued; a read with nothing queued pauses the run (the agent is
    /// idle) and is restarted when the next request arrives; writes queue the response.
    Agent(std::sync::Mutex<AgentIo>),
    /// An epoll instance (see `epoll`).
    Epoll(epoll::Epoll),
}

/// The two directions of the agent channel.
#[derive(Default)]
pub struct AgentIo {
    pub inbox: std::collections::VecDeque<u8>,
    pub outbox: Vec<u8>,
}

/// `file_read` on an idle agent channel: the caller restarts the syscall and ends the run.
pub const AGENT_IDLE: Errno = Errno(-1);
/// The value of the `Yield` that ends a run when the agent is idle.
pub const AGENT_IDLE_YIELD: u64 = 0x6167_656e_7400; // "agent"

/// An open file description: what `open` creates and `dup` shares.
pub struct OpenFile {
    pub kind: Kind,
    /// Normalised guest path of a file or directory opened by path (None for pipes, memfds,
    /// captured output). Relative `*at` lookups start here; /proc/self/fd shows it.
    pub path: Option<String>,
    /// What /proc/self/fd shows for a file without a path (memfds).
    pub label: Option<String>,
    /// Status flags (access mode, O_APPEND, O_NONBLOCK, O_PATH) of engine files; host files keep
    /// theirs in the host kernel.
    pub flags: AtomicI32,
    /// File offset of engine files.
    pub pos: AtomicU64,
    /// A directory.
    pub dir: bool,
    /// A host pipe, socket or character device: reads and writes may block.
    pub stream: bool,
    /// On a read-only mount: metadata changes through the fd (fchmod, futimens...) fail with EROFS.
    pub ro: bool,
    /// A guest network socket: what the engine keeps beside its host descriptor (see `inet`).
    pub net: Option<Box<inet::NetSock>>,
    /// A Unix socket's names as the guest gave them (see `socket::sys_getname`).
    pub unix_names: std::sync::Mutex<socket::UnixNames>,
}

impl OpenFile {
    pub fn new(kind: Kind, path: Option<String>, flags: i32) -> OpenFile {
        let dir = matches!(kind, Kind::VirtDir(_));
        OpenFile {
            kind,
            path,
            label: None,
            flags: AtomicI32::new(flags),
            pos: AtomicU64::new(0),
            dir,
            stream: false,
            ro: true,
            net: None,
            unix_names: Default::default(),
        }
    }

    /// A host fd; `path` is its guest path if it was opened by one.
    pub fn host(fd: OwnedFd, path: Option<String>, ro: bool) -> OpenFile {
        // SAFETY: a zeroed stat is valid; fstat fills it (on failure it stays zero: a plain file).
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: a valid fd and out-pointer.
        unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
        let fmt = st.st_mode & libc::S_IFMT;
        OpenFile {
            kind: Kind::Host(fd),
            path,
            label: None,
            flags: AtomicI32::new(0),
            pos: AtomicU64::new(0),
            dir: fmt == libc::S_IFDIR,
            stream: matches!(fmt, libc::S_IFIFO | libc::S_IFSOCK | libc::S_IFCHR),
            ro,
            net: None,
            unix_names: Default::default(),
        }
    }

    /// The host fd, for host files.
    pub fn host_fd(&self) -> Option<RawFd> {
        match &self.kind {
            Kind::Host(fd) => Some(fd.as_raw_fd()),
            _ => None,
        }
    }

    /// Status flags as F_GETFL reports them.
    pub fn status_flags(&self) -> Result<i32, Errno> {
        match self.host_fd() {
            Some(fd) => cvt(unsafe_fcntl(fd, libc::F_GETFL, 0)).map(|v| v as i32),
            None => Ok(self.flags.load(Ordering::Relaxed)),
        }
    }

    fn can_read(&self) -> bool {
        let f = self.flags.load(Ordering::Relaxed);
        f & libc::O_PATH == 0 && matches!(f & libc::O_ACCMODE, libc::O_RDONLY | libc::O_RDWR)
    }

    fn can_write(&self) -> bool {
        let f = self.flags.load(Ordering::Relaxed);
        f & libc::O_PATH == 0 && matches!(f & libc::O_ACCMODE, libc::O_WRONLY | libc::O_RDWR)
    }
}

/// One slot of the fd table.
#[derive(Clone)]
pub struct Fd {
    pub file: Arc<OpenFile>,
    pub cloexec: bool,
}

/// The fd table. A clone shares every open file description, as fork's copy of the table does.
#[derive(Clone)]
pub struct Files {
    slots: Vec<Option<Fd>>,
    /// RLIMIT_NOFILE: new fds are below this. `dispatch` takes it from `os.proc`'s rlimits.
    pub limit: usize,
}

impl Default for Files {
    /// The table a new process starts with: [`Files::standard`].
    fn default() -> Files {
        Files::standard()
    }
}

impl Files {
    /// An empty table.
    pub fn empty() -> Files {
        Files { slots: Vec::new(), limit: NOFILE }
    }

    /// stdin reads as /dev/null; stdout and stderr are captured into the run's output.
    pub fn standard() -> Files {
        let mut f = Files::empty();
        let null = OpenFile::new(Kind::Null, Some("/dev/null".into()), libc::O_RDONLY);
        let out = |k| OpenFile::new(Kind::Capture(k), None, libc::O_WRONLY);
        for file in [null, out(1), out(2)] {
            f.slots.push(Some(Fd { file: Arc::new(file), cloexec: false }));
        }
        f
    }

    pub fn get(&self, fd: i32) -> Result<&Fd, Errno> {
        usize::try_from(fd).ok().and_then(|i| self.slots.get(i)).and_then(Option::as_ref).ok_or(EBADF)
    }

    fn get_mut(&mut self, fd: i32) -> Result<&mut Fd, Errno> {
        usize::try_from(fd).ok().and_then(|i| self.slots.get_mut(i)).and_then(Option::as_mut).ok_or(EBADF)
    }

    /// The open file behind `fd`.
    pub fn file(&self, fd: i32) -> Result<Arc<OpenFile>, Errno> {
        self.get(fd).map(|f| f.file.clone())
    }

    /// The host fd behind guest `fd` (for file mmap): EBADF if `fd` is not open, ENODEV if it is
    /// not a host file (captured output, /dev/zero, /proc files: the caller handles /dev/zero by
    /// looking at [`Kind`]).
    pub fn host_fd(&self, fd: i32) -> Result<RawFd, Errno> {
        self.get(fd)?.file.host_fd().ok_or(ENODEV)
    }

    /// What /proc/self/fd and /proc/self/maps show for `fd`: its guest path, or a label such as
    /// "/memfd:name (deleted)" or "pipe:[ino]". None if `fd` is not open.
    pub fn guest_path(&self, fd: i32) -> Option<String> {
        self.get(fd).ok().map(|f| special::describe(&f.file))
    }

    /// The guest path of directory `fd`, for `*at` lookups.
    pub fn dir_path(&self, fd: i32) -> Result<String, Errno> {
        let f = &self.get(fd)?.file;
        match &f.path {
            Some(p) if f.dir => Ok(p.clone()),
            _ => Err(ENOTDIR),
        }
    }

    /// Put `file` at the lowest free fd that is at least `min`.
    pub fn alloc(&mut self, min: i32, file: Arc<OpenFile>, cloexec: bool) -> Result<i32, Errno> {
        let min = usize::try_from(min).map_err(|_| EINVAL)?;
        if min >= self.limit {
            return Err(EINVAL);
        }
        let free = (min..self.limit).find(|&i| self.slots.get(i).is_none_or(Option::is_none)).ok_or(EMFILE)?;
        if free >= self.slots.len() {
            self.slots.resize(free + 1, None);
        }
        self.slots[free] = Some(Fd { file, cloexec });
        Ok(free as i32)
    }

    /// Put `file` at `fd`, closing what was there (dup2).
    pub fn install(&mut self, fd: i32, file: Arc<OpenFile>, cloexec: bool) -> Result<(), Errno> {
        let i = usize::try_from(fd).map_err(|_| EBADF)?;
        if i >= self.limit {
            return Err(EBADF);
        }
        if i >= self.slots.len() {
            self.slots.resize(i + 1, None);
        }
        self.slots[i] = Some(Fd { file, cloexec });
        Ok(())
    }

    pub fn close(&mut self, fd: i32) -> Result<(), Errno> {
        let i = usize::try_from(fd).map_err(|_| EBADF)?;
        match self.slots.get_mut(i) {
            Some(s @ Some(_)) => {
                *s = None;
                while self.slots.last().is_some_and(Option::is_none) {
                    self.slots.pop();
                }
                Ok(())
            }
            _ => Err(EBADF),
        }
    }

    pub fn set_cloexec(&mut self, fd: i32, on: bool) -> Result<(), Errno> {
        self.get_mut(fd)?.cloexec = on;
        Ok(())
    }

    /// Close every close-on-exec fd (for execve).
    pub fn close_on_exec(&mut self) {
        for s in self.slots.iter_mut() {
            if s.as_ref().is_some_and(|f| f.cloexec) {
                *s = None;
            }
        }
    }

    /// The open fds, ascending.
    pub fn open_fds(&self) -> impl Iterator<Item = i32> + '_ {
        self.slots.iter().enumerate().filter(|(_, s)| s.is_some()).map(|(i, _)| i as i32)
    }
}

/// Which of `fds` are ready now (poll(2) with a zero timeout): how many. A zero-timeout poll still
/// fails with EINTR when a host signal comes (the thread tick, a preemption: both have handlers),
/// which says nothing about the descriptors: it is asked again. Taking EINTR for "ready" sent a
/// read of an empty pipe to wait on the host while its process held the turn, and the writer,
/// which needed the turn, never came (a `multiprocessing.Pool` that hung now and then).
pub(crate) fn poll_now(fds: &mut [libc::pollfd]) -> Result<usize, Errno> {
    loop {
        // SAFETY: a valid array of pollfds of the length we pass; no waiting.
        let n = unsafe { libc::poll(fds.as_mut_ptr(), fds.len() as libc::nfds_t, 0) };
        match cvt(n as i64) {
            Err(e) if e == EINTR => continue,
            r => return r.map(|n| n as usize),
        }
    }
}

fn cvt(r: i64) -> Result<u64, Errno> {
    if r < 0 {
        Err(Errno::last())
    } else {
        Ok(r as u64)
    }
}

/// Run `f` with the host umask set to the guest's (creations must honour the guest's umask only).
pub(crate) fn with_umask<T>(umask: u32, f: impl FnOnce() -> T) -> T {
    // SAFETY: umask only changes this process's file creation mask; the VMM is single-threaded
    // and restores it at once.
    let old = unsafe { libc::umask((umask & 0o777) as libc::mode_t) };
    let r = f();
    // SAFETY: as above.
    unsafe { libc::umask(old) };
    r
}

fn unsafe_fcntl(fd: RawFd, cmd: i32, arg: i64) -> i64 {
    // SAFETY: fcntl commands with integer arguments on an fd we own.
    unsafe { libc::fcntl(fd, cmd, arg) as i64 }
}

/// The raw bytes of a plain-data struct (same layout in host and guest: both Linux x86-64).
pub(crate) fn bytes_of<T: Copy>(v: &T) -> &[u8] {
    // SAFETY: T is a plain C struct (Copy, no pointers we follow); we only read its bytes, all of
    // which were initialised (the structs are zeroed before being filled).
    unsafe { std::slice::from_raw_parts((v as *const T).cast::<u8>(), std::mem::size_of::<T>()) }
}

/// Linux x86-64 syscall numbers of the file layer.
pub mod nr {
    pub const READ: u64 = 0;
    pub const WRITE: u64 = 1;
    pub const OPEN: u64 = 2;
    pub const CLOSE: u64 = 3;
    pub const STAT: u64 = 4;
    pub const FSTAT: u64 = 5;
    pub const LSTAT: u64 = 6;
    pub const POLL: u64 = 7;
    pub const LSEEK: u64 = 8;
    pub const IOCTL: u64 = 16;
    pub const PREAD64: u64 = 17;
    pub const PWRITE64: u64 = 18;
    pub const READV: u64 = 19;
    pub const WRITEV: u64 = 20;
    pub const ACCESS: u64 = 21;
    pub const PIPE: u64 = 22;
    pub const SELECT: u64 = 23;
    pub const DUP: u64 = 32;
    pub const DUP2: u64 = 33;
    pub const SENDFILE: u64 = 40;
    pub const SPLICE: u64 = 275;
    pub const FCNTL: u64 = 72;
    pub const FLOCK: u64 = 73;
    pub const FSYNC: u64 = 74;
    pub const FDATASYNC: u64 = 75;
    pub const TRUNCATE: u64 = 76;
    pub const FTRUNCATE: u64 = 77;
    pub const GETCWD: u64 = 79;
    pub const CHDIR: u64 = 80;
    pub const FCHDIR: u64 = 81;
    pub const RENAME: u64 = 82;
    pub const MKDIR: u64 = 83;
    pub const RMDIR: u64 = 84;
    pub const CREAT: u64 = 85;
    pub const LINK: u64 = 86;
    pub const UNLINK: u64 = 87;
    pub const SYMLINK: u64 = 88;
    pub const READLINK: u64 = 89;
    pub const CHMOD: u64 = 90;
    pub const FCHMOD: u64 = 91;
    pub const CHOWN: u64 = 92;
    pub const FCHOWN: u64 = 93;
    pub const SETXATTR: u64 = 188;
    pub const LSETXATTR: u64 = 189;
    pub const FSETXATTR: u64 = 190;
    pub const GETXATTR: u64 = 191;
    pub const LGETXATTR: u64 = 192;
    pub const FGETXATTR: u64 = 193;
    pub const LISTXATTR: u64 = 194;
    pub const LLISTXATTR: u64 = 195;
    pub const FLISTXATTR: u64 = 196;
    pub const REMOVEXATTR: u64 = 197;
    pub const LREMOVEXATTR: u64 = 198;
    pub const FREMOVEXATTR: u64 = 199;
    pub const LCHOWN: u64 = 94;
    pub const UTIME: u64 = 132;
    pub const STATFS: u64 = 137;
    pub const FSTATFS: u64 = 138;
    pub const SYNC: u64 = 162;
    pub const READAHEAD: u64 = 187;
    pub const GETDENTS64: u64 = 217;
    pub const FADVISE64: u64 = 221;
    pub const UTIMES: u64 = 235;
    pub const OPENAT: u64 = 257;
    pub const MKDIRAT: u64 = 258;
    pub const MKNOD: u64 = 133;
    pub const MKNODAT: u64 = 259;
    pub const FCHOWNAT: u64 = 260;
    pub const FUTIMESAT: u64 = 261;
    pub const NEWFSTATAT: u64 = 262;
    pub const UNLINKAT: u64 = 263;
    pub const RENAMEAT: u64 = 264;
    pub const LINKAT: u64 = 265;
    pub const SYMLINKAT: u64 = 266;
    pub const READLINKAT: u64 = 267;
    pub const FCHMODAT: u64 = 268;
    pub const FACCESSAT: u64 = 269;
    pub const PSELECT6: u64 = 270;
    pub const PPOLL: u64 = 271;
    pub const SYNC_FILE_RANGE: u64 = 277;
    pub const UTIMENSAT: u64 = 280;
    pub const FALLOCATE: u64 = 285;
    pub const DUP3: u64 = 292;
    pub const PIPE2: u64 = 293;
    pub const PREADV: u64 = 295;
    pub const PWRITEV: u64 = 296;
    pub const SYNCFS: u64 = 306;
    pub const RENAMEAT2: u64 = 316;
    pub const MEMFD_CREATE: u64 = 319;
    pub const EVENTFD: u64 = 284;
    pub const SOCKET: u64 = 41;
    pub const CONNECT: u64 = 42;
    pub const ACCEPT: u64 = 43;
    pub const SENDTO: u64 = 44;
    pub const RECVFROM: u64 = 45;
    pub const SENDMSG: u64 = 46;
    pub const SENDMMSG: u64 = 307;
    pub const RECVMSG: u64 = 47;
    pub const SHUTDOWN: u64 = 48;
    pub const BIND: u64 = 49;
    pub const LISTEN: u64 = 50;
    pub const GETSOCKNAME: u64 = 51;
    pub const GETPEERNAME: u64 = 52;
    pub const SOCKETPAIR: u64 = 53;
    pub const SETSOCKOPT: u64 = 54;
    pub const GETSOCKOPT: u64 = 55;
    pub const ACCEPT4: u64 = 288;
    pub const EPOLL_CREATE: u64 = 213;
    pub const EPOLL_WAIT: u64 = 232;
    pub const EPOLL_CTL: u64 = 233;
    pub const EPOLL_PWAIT: u64 = 281;
    pub const EPOLL_CREATE1: u64 = 291;
    pub const EPOLL_PWAIT2: u64 = 441;
    pub const EVENTFD2: u64 = 290;
    pub const COPY_FILE_RANGE: u64 = 326;
    pub const PREADV2: u64 = 327;
    pub const PWRITEV2: u64 = 328;
    pub const STATX: u64 = 332;
    pub const CLOSE_RANGE: u64 = 436;
    pub const FACCESSAT2: u64 = 439;
    pub const FCHMODAT2: u64 = 452;
}

/// Handle a file syscall; `None` if `nr` is not one of ours.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    use nr::*;
    // The fd limit follows setrlimit(RLIMIT_NOFILE).
    if let Some(r) = os.proc.rlimits.get(limits::RLIMIT_NOFILE) {
        os.files.limit = usize::try_from(r.cur).unwrap_or(usize::MAX).min(MAX_NOFILE);
    }
    let fd0 = a[0] as i32;
    let at = libc::AT_FDCWD;
    let r = match nr {
        READ => match sys_read(os, ctx, fd0, a[1], a[2], None) {
            // The agent waits for its next request: pause the run, restart this read on resume.
            Err(AGENT_IDLE) => {
                ctx.regs.rip -= 2;
                ctx.stop = Some(crate::protocol::RunExit::Yield { value: AGENT_IDLE_YIELD });
                Ok(nr)
            }
            r => r,
        },
        WRITE => sys_write(os, ctx, fd0, a[1], a[2], None),
        PREAD64 => offset(a[3]).and_then(|o| sys_read(os, ctx, fd0, a[1], a[2], Some(o))),
        PWRITE64 => offset(a[3]).and_then(|o| sys_write(os, ctx, fd0, a[1], a[2], Some(o))),
        READV => sys_readv(os, ctx, fd0, a[1], a[2], None),
        WRITEV => sys_writev(os, ctx, fd0, a[1], a[2], None),
        PREADV => offset(a[3]).and_then(|o| sys_readv(os, ctx, fd0, a[1], a[2], Some(o))),
        PWRITEV => offset(a[3]).and_then(|o| sys_writev(os, ctx, fd0, a[1], a[2], Some(o))),
        PREADV2 | PWRITEV2 => {
            let off = if a[3] as i64 == -1 { Ok(None) } else { offset(a[3]).map(Some) };
            off.and_then(|o| {
                if nr == PREADV2 {
                    sys_readv(os, ctx, fd0, a[1], a[2], o)
                } else {
                    sys_writev(os, ctx, fd0, a[1], a[2], o)
                }
            })
        }
        LSEEK => sys_lseek(os, fd0, a[1] as i64, a[2] as i32),
        CLOSE => os.files.close(fd0).map(|_| 0),
        CLOSE_RANGE => sys_close_range(os, a[0] as u32, a[1] as u32, a[2] as u32),
        DUP => os.files.file(fd0).and_then(|f| os.files.alloc(0, f, false)).map(|fd| fd as u64),
        DUP2 => sys_dup3(os, fd0, a[1] as i32, 0, true),
        DUP3 => sys_dup3(os, fd0, a[1] as i32, a[2] as i32, false),
        FCNTL => sys_fcntl(os, ctx, fd0, a[1] as i32, a[2]),
        IOCTL => sys_ioctl(os, ctx, fd0, a[1] as u32, a[2]),
        FLOCK | FSYNC | FDATASYNC | SYNCFS | FADVISE64 | READAHEAD | SYNC_FILE_RANGE => os.files.get(fd0).map(|_| 0),
        SYNC => Ok(0),
        FSTAT => path::sys_fstat(os, ctx, fd0, a[1]),
        GETDENTS64 => sys_getdents64(os, ctx, fd0, a[1], a[2]),
        FTRUNCATE => sys_ftruncate(os, fd0, a[1] as i64),
        FALLOCATE => sys_fallocate(os, fd0, a[1] as i32, a[2] as i64, a[3] as i64),
        FCHMOD => path::sys_fchmod(os, fd0, a[1] as u32),
        FCHOWN => path::sys_fchown(os, fd0, a[1] as u32, a[2] as u32),
        PIPE => sys_pipe2(os, ctx, a[0], 0),
        PIPE2 => sys_pipe2(os, ctx, a[0], a[1] as i32),
        MEMFD_CREATE => sys_memfd_create(os, ctx, a[0], a[1] as u32),
        SENDFILE => sys_sendfile(os, ctx, fd0, a[1] as i32, a[2], a[3]),
        SPLICE => sys_splice(os, ctx, fd0, a[1], a[2] as i32, a[3], a[4], a[5] as u32),
        COPY_FILE_RANGE => sys_copy_file_range(os, ctx, fd0, a[1], a[2] as i32, a[3], a[4], a[5] as u32),
        POLL => poll::sys_poll(os, ctx, a[0], a[1], poll::timeout_ms(a[2] as i32)),
        PPOLL => poll::timeout_ts(ctx, a[2]).and_then(|t| poll::sys_poll(os, ctx, a[0], a[1], t)),
        SELECT => poll::timeout_tv(ctx, a[4]).and_then(|t| poll::sys_select(os, ctx, a[0] as i32, [a[1], a[2], a[3]], t)),
        PSELECT6 => poll::timeout_ts(ctx, a[4]).and_then(|t| poll::sys_select(os, ctx, a[0] as i32, [a[1], a[2], a[3]], t)),
        OPEN => path::sys_openat(os, ctx, at, a[0], a[1] as i32, a[2] as u32),
        OPENAT => path::sys_openat(os, ctx, fd0, a[1], a[2] as i32, a[3] as u32),
        CREAT => path::sys_openat(os, ctx, at, a[0], libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC, a[1] as u32),
        STAT => path::sys_fstatat(os, ctx, at, a[0], a[1], 0),
        LSTAT => path::sys_fstatat(os, ctx, at, a[0], a[1], libc::AT_SYMLINK_NOFOLLOW),
        NEWFSTATAT => path::sys_fstatat(os, ctx, fd0, a[1], a[2], a[3] as i32),
        STATX => path::sys_statx(os, ctx, fd0, a[1], a[2] as i32, a[3] as u32, a[4]),
        ACCESS => path::sys_faccessat(os, ctx, at, a[0], a[1] as i32, 0),
        FACCESSAT => path::sys_faccessat(os, ctx, fd0, a[1], a[2] as i32, 0),
        FACCESSAT2 => path::sys_faccessat(os, ctx, fd0, a[1], a[2] as i32, a[3] as i32),
        READLINK => path::sys_readlinkat(os, ctx, at, a[0], a[1], a[2]),
        READLINKAT => path::sys_readlinkat(os, ctx, fd0, a[1], a[2], a[3]),
        GETCWD => path::sys_getcwd(os, ctx, a[0], a[1]),
        CHDIR => path::sys_chdir(os, ctx, a[0]),
        FCHDIR => path::sys_fchdir(os, fd0),
        MKDIR => path::sys_mkdirat(os, ctx, at, a[0], a[1] as u32),
        MKDIRAT => path::sys_mkdirat(os, ctx, fd0, a[1], a[2] as u32),
        MKNOD => path::sys_mknodat(os, ctx, at, a[0], a[1] as u32),
        MKNODAT => path::sys_mknodat(os, ctx, fd0, a[1], a[2] as u32),
        RMDIR => path::sys_unlinkat(os, ctx, at, a[0], libc::AT_REMOVEDIR),
        UNLINK => path::sys_unlinkat(os, ctx, at, a[0], 0),
        UNLINKAT => path::sys_unlinkat(os, ctx, fd0, a[1], a[2] as i32),
        RENAME => path::sys_renameat2(os, ctx, at, a[0], at, a[1], 0),
        RENAMEAT => path::sys_renameat2(os, ctx, fd0, a[1], a[2] as i32, a[3], 0),
        RENAMEAT2 => path::sys_renameat2(os, ctx, fd0, a[1], a[2] as i32, a[3], a[4] as u32),
        LINK => path::sys_linkat(os, ctx, at, a[0], at, a[1], 0),
        LINKAT => path::sys_linkat(os, ctx, fd0, a[1], a[2] as i32, a[3], a[4] as i32),
        SYMLINK => path::sys_symlinkat(os, ctx, a[0], at, a[1]),
        SYMLINKAT => path::sys_symlinkat(os, ctx, a[0], a[1] as i32, a[2]),
        CHMOD => path::sys_fchmodat(os, ctx, at, a[0], a[1] as u32, 0),
        FCHMODAT => path::sys_fchmodat(os, ctx, fd0, a[1], a[2] as u32, 0),
        FCHMODAT2 => path::sys_fchmodat(os, ctx, fd0, a[1], a[2] as u32, a[3] as i32),
        CHOWN => path::sys_fchownat(os, ctx, at, a[0], a[1] as u32, a[2] as u32, 0),
        LCHOWN => path::sys_fchownat(os, ctx, at, a[0], a[1] as u32, a[2] as u32, libc::AT_SYMLINK_NOFOLLOW),
        FCHOWNAT => path::sys_fchownat(os, ctx, fd0, a[1], a[2] as u32, a[3] as u32, a[4] as i32),
        TRUNCATE => path::sys_truncate(os, ctx, a[0], a[1] as i64),
        STATFS => path::sys_statfs(os, ctx, a[0], a[1]),
        FSTATFS => path::sys_fstatfs(os, ctx, fd0, a[1]),
        UTIMENSAT => path::sys_utimensat(os, ctx, fd0, a[1], a[2], a[3] as i32),
        UTIMES => path::sys_utimes(os, ctx, at, a[0], a[1]),
        FUTIMESAT => path::sys_utimes(os, ctx, fd0, a[1], a[2]),
        UTIME => path::sys_utime(os, ctx, a[0], a[1]),
        // Extended attributes: the host files' own, in the "user." namespace for changes (see
        // path::sys_xattr); the engine's files (/dev, /proc, pipes of its own) have none.
        SETXATTR | GETXATTR | LISTXATTR | REMOVEXATTR => path::sys_xattr(os, ctx, nr, a, path::XattrOn::Path(0)),
        LSETXATTR | LGETXATTR | LLISTXATTR | LREMOVEXATTR => {
            path::sys_xattr(os, ctx, nr, a, path::XattrOn::Path(libc::AT_SYMLINK_NOFOLLOW))
        }
        FSETXATTR | FGETXATTR | FLISTXATTR | FREMOVEXATTR => path::sys_xattr(os, ctx, nr, a, path::XattrOn::Fd(fd0)),
        EVENTFD => sys_eventfd(os, a[0] as u32, 0),
        SOCKETPAIR => socket::sys_socketpair(os, ctx, a[0], a[1] as i32, a[2] as i32, a[3]),
        SOCKET => socket::sys_socket(os, a[0], a[1] as i32, a[2] as i32),
        BIND => socket::sys_bind(os, ctx, fd0, a[1], a[2] as u32),
        CONNECT => socket::sys_connect(os, ctx, fd0, a[1], a[2] as u32),
        LISTEN => socket::sys_listen(os, fd0, a[1] as i32),
        ACCEPT => socket::sys_accept(os, ctx, fd0, a[1], a[2], 0),
        ACCEPT4 => socket::sys_accept(os, ctx, fd0, a[1], a[2], a[3] as i32),
        GETSOCKNAME => socket::sys_getname(os, ctx, fd0, a[1], a[2], false),
        GETPEERNAME => socket::sys_getname(os, ctx, fd0, a[1], a[2], true),
        SENDTO => socket::sys_sendto(os, ctx, fd0, a[1], a[2], a[3] as i32, a[4]),
        RECVFROM => socket::sys_recvfrom(os, ctx, fd0, a[1], a[2], a[3] as i32, a[4], a[5]),
        SENDMSG => socket::sys_sendmsg(os, ctx, fd0, a[1], a[2] as i32),
        SENDMMSG => socket::sys_sendmmsg(os, ctx, fd0, a[1], a[2] as u32, a[3] as i32),
        RECVMSG => socket::sys_recvmsg(os, ctx, fd0, a[1], a[2] as i32),
        SHUTDOWN => socket::sys_shutdown(os, fd0, a[1] as i32),
        SETSOCKOPT => socket::sys_sockopt(os, ctx, fd0, a[1] as i32, a[2] as i32, a[3], a[4], true),
        GETSOCKOPT => socket::sys_sockopt(os, ctx, fd0, a[1] as i32, a[2] as i32, a[3], a[4], false),
        EPOLL_CREATE => epoll::sys_epoll_create(os, Some(a[0] as i32), 0),
        EPOLL_CREATE1 => epoll::sys_epoll_create(os, None, a[0] as i32),
        EPOLL_CTL => epoll::sys_epoll_ctl(os, ctx, fd0, a[1], a[2] as i32, a[3]),
        EPOLL_WAIT | EPOLL_PWAIT | EPOLL_PWAIT2 => epoll::timeout_of_wait(ctx, nr == EPOLL_PWAIT2, a[3])
            .and_then(|t| epoll::sys_epoll_wait(os, ctx, fd0, a[1], a[2] as i32, t)),
        EVENTFD2 => sys_eventfd(os, a[0] as u32, a[1] as i32),
        _ => return None,
    };
    // In replay mode what the guest writes carries its clock's time (see `stamp`).
    if os.proc.clocks.replay && r.as_ref().is_ok_and(|&n| n > 0 || matches!(nr, FTRUNCATE | FALLOCATE)) {
        let out = match nr {
            WRITE | PWRITE64 | WRITEV | PWRITEV | PWRITEV2 | FALLOCATE | FTRUNCATE | SENDFILE => Some(fd0),
            COPY_FILE_RANGE => Some(a[2] as i32),
            _ => None,
        };
        if let Some(f) = out.and_then(|fd| os.files.file(fd).ok()) {
            if let (Some(h), false, false) = (f.host_fd(), f.stream, f.dir) {
                stamp::written(&os.proc, h);
            }
        }
    }
    Some(r)
}

/// A file offset argument (EINVAL if negative).
fn offset(v: u64) -> Result<u64, Errno> {
    if (v as i64) < 0 {
        Err(EINVAL)
    } else {
        Ok(v)
    }
}

/// Wait (at most [`WAIT_SLICE_MS`]) until host stream `fd` is ready for `events`. ERESTARTSYS if it
/// is not by then and blocks; Ok if it is ready or non-blocking (the host call then answers).
pub(super) fn wait_stream(fd: RawFd, events: i16) -> Result<(), Errno> {
    wait_stream_or_turn(fd, events, true)
}

/// [`wait_stream`] on a stream whose other end is the host (the controller's stdout and stderr
/// pipes), never another guest process: it waits on the host even while processes take turns.
fn wait_host_stream(fd: RawFd, events: i16) -> Result<(), Errno> {
    wait_stream_or_turn(fd, events, false)
}

fn wait_stream_or_turn(fd: RawFd, events: i16, turns: bool) -> Result<(), Errno> {
    let mut p = libc::pollfd { fd, events, revents: 0 };
    if poll_now(std::slice::from_mut(&mut p))? != 0 {
        return Ok(());
    }
    if cvt(unsafe_fcntl(fd, libc::F_GETFL, 0))? as i32 & libc::O_NONBLOCK != 0 {
        return Ok(());
    }
    // Replay mode, other processes: their turn (see `guestos::sched`), then try again.
    if turns && super::sched::yield_blocked(None) {
        return Err(super::signal::ERESTARTSYS);
    }
    // SAFETY: one valid pollfd.
    match unsafe { libc::poll(&mut p, 1, WAIT_SLICE_MS) } {
        // Not ready yet: restart the syscall (the run loop gets control in between).
        0 => Err(super::signal::ERESTARTSYS),
        r if r < 0 && Errno::last() == EINTR => Err(super::signal::ERESTARTSYS),
        r if r < 0 => Err(Errno::last()),
        _ => Ok(()),
    }
}

/// Read up to `n` bytes from open file `f` (at `off`, or at and advancing its offset).
pub fn file_read(f: &OpenFile, proc: &mut Proc, n: usize, off: Option<u64>) -> Result<Vec<u8>, Errno> {
    let n = n.min(MAX_IO);
    let fd = match &f.kind {
        Kind::Host(fd) => fd.as_raw_fd(),
        Kind::VirtDir(_) => return Err(EISDIR),
        Kind::Epoll(_) => return Err(EINVAL),
        _ if !f.can_read() => return Err(EBADF),
        Kind::Capture(_) => return Err(EBADF),
        Kind::Null => return Ok(Vec::new()),
        Kind::Agent(io) => {
            let mut io = io.lock().map_err(|_| super::EIO)?;
            if io.inbox.is_empty() {
                return Err(AGENT_IDLE);
            }
            let take = n.min(io.inbox.len());
            return Ok(io.inbox.drain(..take).collect());
        }
        Kind::Zero => return Ok(vec![0; n]),
        Kind::Random => {
            let mut v = vec![0; n];
            random::random_bytes(proc, &mut v)?;
            return Ok(v);
        }
        Kind::Data(d) => {
            let pos = off.unwrap_or_else(|| f.pos.load(Ordering::Relaxed));
            let start = usize::try_from(pos).unwrap_or(usize::MAX).min(d.len());
            let end = start.saturating_add(n).min(d.len());
            if off.is_none() {
                f.pos.store(end as u64, Ordering::Relaxed);
            }
            return Ok(d[start..end].to_vec());
        }
    };
    if f.stream && n > 0 {
        if let Some(ns) = f.net.as_ref() {
            inet::await_peer(ns, fd, false);
        }
        wait_stream(fd, libc::POLLIN)?;
    }
    let mut v: Vec<u8> = Vec::with_capacity(n);
    // SAFETY: the kernel writes at most `n` bytes into the vector's spare capacity.
    let r = unsafe {
        match off {
            Some(o) => libc::pread(fd, v.as_mut_ptr().cast(), n, o as i64),
            None => libc::read(fd, v.as_mut_ptr().cast(), n),
        }
    };
    let got = cvt(r as i64)? as usize;
    if let (0, true, Some(ns)) = (got, n > 0, f.net.as_ref()) {
        inet::reset_at_end(ns)?;
    }
    // SAFETY: the kernel initialised `got <= n` bytes.
    unsafe { v.set_len(got.min(n)) };
    Ok(v)
}

/// Where the sandbox's stdout and stderr go: the controller's pipes, else the run's output.
pub struct Sinks<'a> {
    pub out: &'a mut Output,
    pub stdio: Option<&'a [OwnedFd; 2]>,
}

/// Write `data` to open file `f` (at `off`, or at and advancing its offset).
pub fn file_write(f: &OpenFile, sinks: &mut Sinks, data: &[u8], off: Option<u64>) -> Result<usize, Errno> {
    let fd = match &f.kind {
        Kind::Host(fd) => fd.as_raw_fd(),
        Kind::Epoll(_) => return Err(EINVAL),
        _ if !f.can_write() => return Err(EBADF),
        Kind::Capture(k) => {
            if off.is_some() {
                return Err(ESPIPE);
            }
            if let Some(pipes) = sinks.stdio {
                let fd = pipes[usize::from(*k == 2)].as_raw_fd();
                if !data.is_empty() {
                    // The controller drains these: a wait here is never one for another guest
                    // process's turn (see `guestos::sched`), so it is a wait on the host.
                    wait_host_stream(fd, libc::POLLOUT)?;
                }
                // SAFETY: `data` is valid for its length; the pipe is ours.
                let r = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
                return cvt(r as i64).map(|n| n as usize);
            }
            let sink = if *k == 1 { &mut sinks.out.stdout } else { &mut sinks.out.stderr };
            let keep = data.len().min(OUTPUT_CAP.saturating_sub(sink.len()));
            sink.extend_from_slice(&data[..keep]);
            return Ok(data.len());
        }
        Kind::Null | Kind::Zero | Kind::Random => return Ok(data.len()),
        Kind::Agent(io) => {
            if off.is_some() {
                return Err(ESPIPE);
            }
            io.lock().map_err(|_| super::EIO)?.outbox.extend_from_slice(data);
            return Ok(data.len());
        }
        Kind::Data(_) | Kind::VirtDir(_) => return Err(EBADF),
    };
    if f.stream && !data.is_empty() {
        wait_stream(fd, libc::POLLOUT)?;
        if super::sched::active() {
            return write_without_blocking(fd, data);
        }
    }
    // SAFETY: `data` is valid for its length.
    let r = unsafe {
        match off {
            Some(o) => libc::pwrite(fd, data.as_ptr().cast(), data.len(), o as i64),
            None => libc::write(fd, data.as_ptr().cast(), data.len()),
        }
    };
    cvt(r as i64).map(|n| n as usize)
}

/// A write to a host stream while the sandbox's processes take turns (`guestos::sched`): what
/// fits now, never waiting on the host, since the reader may be a guest process waiting for its
/// turn. The description's O_NONBLOCK is set for the call and put back: nobody else of the sandbox
/// runs meanwhile. The rest of a blocking write follows in the caller's next turn (`sys_write`).
fn write_without_blocking(fd: RawFd, data: &[u8]) -> Result<usize, Errno> {
    let fl = cvt(unsafe_fcntl(fd, libc::F_GETFL, 0))? as i32;
    let set = fl & libc::O_NONBLOCK == 0;
    if set {
        cvt(unsafe_fcntl(fd, libc::F_SETFL, (fl | libc::O_NONBLOCK) as i64))?;
    }
    // SAFETY: `data` is valid for its length.
    let r = unsafe { libc::write(fd, data.as_ptr().cast(), data.len()) };
    let res = cvt(r as i64).map(|n| n as usize);
    if set {
        let _ = unsafe_fcntl(fd, libc::F_SETFL, fl as i64);
        if res == Err(EAGAIN) && super::sched::yield_blocked(None) {
            return Err(super::signal::ERESTARTSYS);
        }
    }
    res
}

/// A read of `f` that is to wait more (`e` is ERESTARTSYS). On a stream only the sandbox can fill
/// (a pipe, a socketpair, an eventfd or timerfd; not a network socket), a process alone in its
/// sandbox waits for nothing but its timers: its clock moves to the next one, which fires
/// (`guestos::timer::blocked_alone`), so that `signal.alarm(1); os.read(r, 1)` gets its SIGALRM
/// and the read's EINTR (or its restart, with SA_RESTART) as under Linux.
fn blocked_read(os: &mut GuestOs, f: &OpenFile, e: Errno) {
    if e == super::signal::ERESTARTSYS && f.stream && f.net.is_none() {
        super::timer::blocked_alone(os);
    }
}

fn sys_read(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, buf: u64, count: u64, off: Option<u64>) -> SysResult {
    let f = os.files.file(fd)?;
    if off.is_some() && matches!(f.kind, Kind::Capture(_)) {
        return Err(ESPIPE);
    }
    let v = file_read(&f, &mut os.proc, count.min(MAX_IO as u64) as usize, off).inspect_err(|&e| blocked_read(os, &f, e))?;
    ctx.write(buf, &v)?;
    Ok(v.len() as u64)
}

fn sys_write(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, buf: u64, count: u64, off: Option<u64>) -> SysResult {
    let f = os.files.file(fd)?;
    if let (Some(n), Some(h)) = (f.net.as_ref().filter(|n| n.is_dns()), f.host_fd()) {
        let data = ctx.read_vec(buf, (count as usize).min(MAX_IO))?;
        return inet::dns_send(os, h, n, &data, None);
    }
    if let (Some(n), Some(h)) = (f.net.as_ref(), f.host_fd()) {
        inet::pending_reset(n, h)?;
    }
    // Taking turns (`guestos::sched`), a blocking write to a pipe that does not fit goes on in the
    // writer's next turns, and returns once, with the whole count, as under Linux.
    let turns = off.is_none() && f.stream && super::sched::active() && f.status_flags().is_ok_and(|fl| fl & libc::O_NONBLOCK == 0);
    if turns {
        let carried = super::sched::write_resumed(ctx.regs.rip, fd, buf, count);
        return match write_pieces(os, ctx, &f, buf, count, None) {
            Ok(n) if n < count && n > 0 || (n == 0 && count > 0) => {
                super::sched::write_continues(ctx.regs, fd, buf + n, count - n, carried.0 + n, carried.1);
                super::sched::yield_blocked(None);
                Err(super::signal::ERESTARTSYS)
            }
            Ok(n) => {
                (ctx.regs.rsi, ctx.regs.rdx) = carried.1;
                Ok(carried.0 + n)
            }
            Err(e) if e == super::signal::ERESTARTSYS => {
                if carried.0 > 0 {
                    super::sched::write_continues(ctx.regs, fd, buf, count, carried.0, carried.1);
                }
                Err(e)
            }
            Err(e) => {
                (ctx.regs.rsi, ctx.regs.rdx) = carried.1;
                if carried.0 > 0 { Ok(carried.0) } else { Err(e) }
            }
        };
    }
    write_pieces(os, ctx, &f, buf, count, off)
}

/// write(2) in pieces of at most MAX_IO.
fn write_pieces(os: &mut GuestOs, ctx: &mut Ctx, f: &OpenFile, buf: u64, count: u64, off: Option<u64>) -> SysResult {
    // Linux writes all of a large write to a file or a blocking pipe (a single write(2) moves up
    // to 2 GiB): one bigger than MAX_IO goes in MAX_IO pieces, and ends early only where a piece
    // does (short, or an error after some bytes were written, which is then the answer).
    let mut done = 0u64;
    loop {
        let len = (count - done).min(MAX_IO as u64) as usize;
        let piece = ctx.read_vec(buf.wrapping_add(done), len).and_then(|data| {
            file_write(f, &mut Sinks { out: ctx.out, stdio: os.stdio.as_ref() }, &data, off.map(|o| o + done))
        });
        match piece {
            Ok(n) => {
                done += n as u64;
                if n < len || done >= count {
                    return Ok(done);
                }
            }
            Err(e) => return if done > 0 { Ok(done) } else { Err(e) },
        }
    }
}

/// The (base, len) pairs of a guest iovec array, their total capped at [`MAX_IO`].
fn iovecs(ctx: &Ctx, iov: u64, cnt: u64) -> Result<Vec<(u64, usize)>, Errno> {
    if cnt > UIO_MAXIOV {
        return Err(EINVAL);
    }
    let raw = ctx.read_vec(iov, cnt as usize * 16)?;
    let mut v = Vec::with_capacity(cnt as usize);
    let mut total: u64 = 0;
    for c in raw.chunks_exact(16) {
        let base = u64::from_le_bytes(c[..8].try_into().map_err(|_| EFAULT)?);
        let len = u64::from_le_bytes(c[8..].try_into().map_err(|_| EFAULT)?);
        if len > isize::MAX as u64 {
            return Err(EINVAL);
        }
        total = total.checked_add(len).filter(|t| *t <= isize::MAX as u64).ok_or(EINVAL)?;
        let room = (MAX_IO as u64).saturating_sub(total - len);
        v.push((base, len.min(room) as usize));
    }
    Ok(v)
}

fn sys_readv(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, iov: u64, cnt: u64, off: Option<u64>) -> SysResult {
    let f = os.files.file(fd)?;
    let iov = iovecs(ctx, iov, cnt)?;
    let total: usize = iov.iter().map(|(_, l)| l).sum();
    let v = file_read(&f, &mut os.proc, total, off).inspect_err(|&e| blocked_read(os, &f, e))?;
    let mut done = 0;
    for (base, len) in iov {
        if done >= v.len() {
            break;
        }
        let n = len.min(v.len() - done);
        ctx.write(base, &v[done..done + n])?;
        done += n;
    }
    Ok(v.len() as u64)
}

fn sys_writev(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, iov: u64, cnt: u64, off: Option<u64>) -> SysResult {
    let f = os.files.file(fd)?;
    let iov = iovecs(ctx, iov, cnt)?;
    let mut data = Vec::new();
    for (base, len) in iov {
        data.extend_from_slice(&ctx.read_vec(base, len)?);
    }
    file_write(&f, &mut Sinks { out: ctx.out, stdio: os.stdio.as_ref() }, &data, off).map(|n| n as u64)
}

fn sys_lseek(os: &mut GuestOs, fd: i32, off: i64, whence: i32) -> SysResult {
    let f = os.files.file(fd)?;
    let len = match &f.kind {
        Kind::Host(h) => {
            // SAFETY: lseek on an fd we own.
            return cvt(unsafe { libc::lseek(h.as_raw_fd(), off, whence) });
        }
        Kind::Capture(_) | Kind::Agent(_) | Kind::Epoll(_) => return Err(ESPIPE),
        Kind::Null | Kind::Zero | Kind::Random => return Ok(0),
        Kind::Data(d) => d.len() as i64,
        Kind::VirtDir(d) => d.len() as i64,
    };
    let base = match whence {
        libc::SEEK_SET => 0,
        libc::SEEK_CUR => f.pos.load(Ordering::Relaxed) as i64,
        libc::SEEK_END => len,
        _ => return Err(EINVAL),
    };
    let pos = base.checked_add(off).filter(|p| *p >= 0).ok_or(EINVAL)?;
    f.pos.store(pos as u64, Ordering::Relaxed);
    Ok(pos as u64)
}

fn sys_close_range(os: &mut GuestOs, first: u32, last: u32, flags: u32) -> SysResult {
    const UNSHARE: u32 = 1 << 1;
    const CLOEXEC: u32 = 1 << 2;
    if first > last || flags & !(UNSHARE | CLOEXEC) != 0 {
        return Err(EINVAL);
    }
    let fds: Vec<i32> = os.files.open_fds().filter(|&fd| fd as u32 >= first && fd as u32 <= last).collect();
    for fd in fds {
        if flags & CLOEXEC != 0 {
            os.files.set_cloexec(fd, true)?;
        } else {
            os.files.close(fd)?;
        }
    }
    Ok(0)
}

fn sys_dup3(os: &mut GuestOs, old: i32, new: i32, flags: i32, dup2: bool) -> SysResult {
    let f = os.files.file(old)?;
    if old == new {
        return if dup2 { Ok(new as u64) } else { Err(EINVAL) };
    }
    if flags & !libc::O_CLOEXEC != 0 {
        return Err(EINVAL);
    }
    os.files.install(new, f, flags & libc::O_CLOEXEC != 0)?;
    Ok(new as u64)
}

fn sys_fcntl(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, cmd: i32, arg: u64) -> SysResult {
    let f = os.files.file(fd)?;
    match cmd {
        libc::F_DUPFD | libc::F_DUPFD_CLOEXEC => {
            let min = i32::try_from(arg).map_err(|_| EINVAL)?;
            os.files.alloc(min, f, cmd == libc::F_DUPFD_CLOEXEC).map(|fd| fd as u64)
        }
        libc::F_GETFD => Ok(if os.files.get(fd)?.cloexec { libc::FD_CLOEXEC as u64 } else { 0 }),
        libc::F_SETFD => os.files.set_cloexec(fd, arg as i32 & libc::FD_CLOEXEC != 0).map(|_| 0),
        libc::F_GETFL => f.status_flags().map(|v| v as u64),
        libc::F_SETFL => {
            let settable = libc::O_APPEND | libc::O_ASYNC | libc::O_DIRECT | libc::O_NOATIME | libc::O_NONBLOCK;
            match f.host_fd() {
                Some(h) => cvt(unsafe_fcntl(h, libc::F_SETFL, (arg as i32 & settable) as i64)).map(|_| 0),
                None => {
                    let old = f.flags.load(Ordering::Relaxed);
                    f.flags.store((old & !settable) | (arg as i32 & settable), Ordering::Relaxed);
                    Ok(0)
                }
            }
        }
        libc::F_GETLK | libc::F_OFD_GETLK => {
            // Nobody else holds locks here: report the region unlocked (l_type is the first i16).
            ctx.write(arg, &(libc::F_UNLCK as i16).to_le_bytes())?;
            Ok(0)
        }
        libc::F_SETLK | libc::F_SETLKW | libc::F_OFD_SETLK | libc::F_OFD_SETLKW => Ok(0),
        // F_GETOWN, F_SETOWN, F_SETSIG, F_GETSIG, F_NOTIFY: no signals for I/O here.
        libc::F_GETOWN | libc::F_SETOWN | 10 | 11 | libc::F_NOTIFY => Ok(0),
        libc::F_GETPIPE_SZ | libc::F_SETPIPE_SZ | libc::F_ADD_SEALS | libc::F_GET_SEALS => match f.host_fd() {
            Some(h) => cvt(unsafe_fcntl(h, cmd, arg as i64)),
            None => Err(EINVAL),
        },
        _ => Err(EINVAL),
    }
}

fn sys_ioctl(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, req: u32, arg: u64) -> SysResult {
    const FIONREAD: u32 = 0x541b;
    const FIONBIO: u32 = 0x5421;
    const FIONCLEX: u32 = 0x5450;
    const FIOCLEX: u32 = 0x5451;
    let f = os.files.file(fd)?;
    match req {
        FIOCLEX | FIONCLEX => os.files.set_cloexec(fd, req == FIOCLEX).map(|_| 0),
        FIONREAD => {
            let n: i32 = match &f.kind {
                Kind::Host(h) => {
                    let mut n: libc::c_int = 0;
                    // SAFETY: FIONREAD writes one int.
                    cvt(unsafe { libc::ioctl(h.as_raw_fd(), libc::FIONREAD, &mut n) } as i64)?;
                    n
                }
                Kind::Data(d) => d.len().saturating_sub(f.pos.load(Ordering::Relaxed) as usize) as i32,
                Kind::Null | Kind::Zero | Kind::Random => 0,
                _ => return Err(ENOTTY),
            };
            ctx.write(arg, &n.to_le_bytes())?;
            Ok(0)
        }
        FIONBIO => {
            let mut b = [0u8; 4];
            ctx.read(arg, &mut b)?;
            let on = i32::from_le_bytes(b) != 0;
            let fl = f.status_flags()?;
            let fl = if on { fl | libc::O_NONBLOCK } else { fl & !libc::O_NONBLOCK };
            match f.host_fd() {
                Some(h) => cvt(unsafe_fcntl(h, libc::F_SETFL, fl as i64)).map(|_| 0),
                None => {
                    f.flags.store(fl, Ordering::Relaxed);
                    Ok(0)
                }
            }
        }
        _ if pty::is_pty(&f) => pty::ioctl(os, ctx, &f, req, arg),
        // Nothing else is a terminal (TCGETS, TIOCGWINSZ, TIOCGPGRP...).
        _ => Err(ENOTTY),
    }
}

fn sys_getdents64(os: &mut GuestOs, ctx: &mut Ctx, fd: i32, dirp: u64, count: u64) -> SysResult {
    let f = os.files.file(fd)?;
    let count = count.min(1 << 20) as usize;
    let buf = match &f.kind {
        Kind::Host(h) => {
            let mut v: Vec<u8> = Vec::with_capacity(count);
            // SAFETY: getdents64 writes at most `count` bytes into the spare capacity.
            let r = unsafe { libc::syscall(libc::SYS_getdents64, h.as_raw_fd(), v.as_mut_ptr(), count) };
            let n = cvt(r)? as usize;
            // SAFETY: the kernel initialised `n <= count` bytes.
            unsafe { v.set_len(n.min(count)) };
            v
        }
        // /proc/self/fd is listed as it is now, as Linux does, and positioned by fd number.
        Kind::VirtDir(_) if f.path.as_deref() == Some("/proc/self/fd") => {
            fd_dirents(&f, &special::list(os, "/proc/self/fd").unwrap_or_default(), count)?
        }
        Kind::VirtDir(entries) => dirents(&f, entries, count)?,
        _ => return Err(ENOTDIR),
    };
    ctx.write(dirp, &buf)?;
    Ok(buf.len() as u64)
}

/// The records of /proc/self/fd (".", "..", then one per open fd, ascending). As in Linux, an
/// entry's position is its fd number (+2), not its index: a reader that closes fds while it lists
/// them (CPython's close_fds in a child before exec) must not skip the ones after.
fn fd_dirents(f: &OpenFile, entries: &[(String, u8)], count: usize) -> Result<Vec<u8>, Errno> {
    let mut out = Vec::new();
    let pos = f.pos.load(Ordering::Relaxed);
    let mut next = pos;
    for (i, (name, ty)) in entries.iter().enumerate() {
        let key = if i < 2 { i as u64 } else { name.parse::<u64>().map_or(u64::MAX - 1, |n| n + 2) };
        if key < pos {
            continue;
        }
        let reclen = (19 + name.len() + 1).div_ceil(8) * 8;
        if out.len() + reclen > count {
            if out.is_empty() {
                return Err(EINVAL);
            }
            break;
        }
        out.extend_from_slice(&(1000 + key).to_le_bytes());
        out.extend_from_slice(&((key + 1) as i64).to_le_bytes());
        out.extend_from_slice(&(reclen as u16).to_le_bytes());
        out.push(*ty);
        out.extend_from_slice(name.as_bytes());
        out.resize(out.len() + reclen - 19 - name.len(), 0);
        next = key + 1;
    }
    f.pos.store(next, Ordering::Relaxed);
    Ok(out)
}

/// linux_dirent64 records of an engine directory, from its offset, filling at most `count` bytes.
fn dirents(f: &OpenFile, entries: &[(String, u8)], count: usize) -> Result<Vec<u8>, Errno> {
    let mut out = Vec::new();
    let mut pos = f.pos.load(Ordering::Relaxed) as usize;
    while let Some((name, ty)) = entries.get(pos) {
        let reclen = (19 + name.len() + 1).div_ceil(8) * 8;
        if out.len() + reclen > count {
            if out.is_empty() {
                return Err(EINVAL);
            }
            break;
        }
        let ino = 1000 + pos as u64;
        out.extend_from_slice(&ino.to_le_bytes());
        out.extend_from_slice(&((pos + 1) as i64).to_le_bytes());
        out.extend_from_slice(&(reclen as u16).to_le_bytes());
        out.push(*ty);
        out.extend_from_slice(name.as_bytes());
        out.resize(out.len() + reclen - 19 - name.len(), 0);
        pos += 1;
    }
    f.pos.store(pos as u64, Ordering::Relaxed);
    Ok(out)
}

fn sys_ftruncate(os: &mut GuestOs, fd: i32, len: i64) -> SysResult {
    let f = os.files.file(fd)?;
    if len < 0 {
        return Err(EINVAL);
    }
    match f.host_fd() {
        // SAFETY: ftruncate on an fd we own; the host checks it is open for writing.
        Some(h) => cvt(unsafe { libc::ftruncate(h, len) } as i64),
        None => Err(EINVAL),
    }
}

fn sys_fallocate(os: &mut GuestOs, fd: i32, mode: i32, off: i64, len: i64) -> SysResult {
    let f = os.files.file(fd)?;
    match f.host_fd() {
        // SAFETY: fallocate on an fd we own; the host checks the arguments and the access mode.
        Some(h) => cvt(unsafe { libc::fallocate(h, mode, off, len) } as i64),
        None => Err(ENODEV),
    }
}

fn sys_pipe2(os: &mut GuestOs, ctx: &mut Ctx, fds: u64, flags: i32) -> SysResult {
    if flags & !(libc::O_CLOEXEC | libc::O_NONBLOCK | libc::O_DIRECT) != 0 {
        return Err(EINVAL);
    }
    let mut p = [0 as RawFd; 2];
    // SAFETY: pipe2 writes two fds into `p`.
    cvt(unsafe { libc::pipe2(p.as_mut_ptr(), libc::O_CLOEXEC | (flags & (libc::O_NONBLOCK | libc::O_DIRECT))) } as i64)?;
    // SAFETY: two fresh descriptors we own.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(p[0]), OwnedFd::from_raw_fd(p[1])) };
    install_pair(os, ctx, r, w, flags & libc::O_CLOEXEC != 0, fds)
}

/// Give the guest two new host descriptors (a pipe's ends, a socket pair) and write their numbers
/// to `out` (int[2]); on any failure neither stays open.
pub(crate) fn install_pair(os: &mut GuestOs, ctx: &mut Ctx, a: OwnedFd, b: OwnedFd, cloexec: bool, out: u64) -> SysResult {
    let fa = os.files.alloc(0, Arc::new(OpenFile::host(a, None, false)), cloexec)?;
    let fb = match os.files.alloc(0, Arc::new(OpenFile::host(b, None, false)), cloexec) {
        Ok(fd) => fd,
        Err(e) => {
            let _ = os.files.close(fa);
            return Err(e);
        }
    };
    let mut v = [0u8; 8];
    v[..4].copy_from_slice(&fa.to_le_bytes());
    v[4..].copy_from_slice(&fb.to_le_bytes());
    if let Err(e) = ctx.write(out, &v) {
        let _ = os.files.close(fa);
        let _ = os.files.close(fb);
        return Err(e);
    }
    Ok(0)
}

/// eventfd(2): a host eventfd, so that the processes of the sandbox that share it (a guest fork
/// shares its descriptors) wait on and signal one counter; blocking reads and writes are sliced
/// like a pipe's.
fn sys_eventfd(os: &mut GuestOs, initval: u32, flags: i32) -> SysResult {
    if flags & !(libc::EFD_CLOEXEC | libc::EFD_NONBLOCK | libc::EFD_SEMAPHORE) != 0 {
        return Err(EINVAL);
    }
    // SAFETY: eventfd with valid flags; the result is checked and owned below.
    let fd = cvt(unsafe { libc::eventfd(initval, libc::EFD_CLOEXEC | (flags & (libc::EFD_NONBLOCK | libc::EFD_SEMAPHORE))) } as i64)?;
    // SAFETY: a fresh descriptor we own.
    let mut f = OpenFile::host(unsafe { OwnedFd::from_raw_fd(fd as RawFd) }, None, false);
    f.stream = true;
    f.label = Some("anon_inode:[eventfd]".into());
    os.files.alloc(0, Arc::new(f), flags & libc::EFD_CLOEXEC != 0).map(|fd| fd as u64)
}

fn sys_memfd_create(os: &mut GuestOs, ctx: &mut Ctx, name: u64, flags: u32) -> SysResult {
    const KNOWN: u32 = libc::MFD_CLOEXEC | libc::MFD_ALLOW_SEALING | libc::MFD_NOEXEC_SEAL | libc::MFD_EXEC;
    let name = ctx.read_cstr(name, 249).map_err(|e| if e == EFAULT { e } else { EINVAL })?;
    if name.len() > 249 || flags & !KNOWN != 0 {
        return Err(EINVAL);
    }
    // A file of the sandbox's shared-memory pool, charged to its shared-memory limit (a memfd is
    // shared memory): past it a write gets ENOSPC. Also with MFD_ALLOW_SEALING: a sealable memfd
    // would be host memory outside every limit of the sandbox, so the guest gets a memfd whose
    // F_ADD_SEALS fails with EPERM, as Linux answers for one made without that flag.
    let fd = crate::vstate::shared::pool_file().map_err(|e| Errno(e.raw_os_error().unwrap_or(libc::ENOMEM)))?;
    let mut f = OpenFile::host(fd, None, false);
    f.label = Some(format!("/memfd:{} (deleted)", String::from_utf8_lossy(&name)));
    os.files.alloc(0, Arc::new(f), flags & libc::MFD_CLOEXEC != 0).map(|fd| fd as u64)
}

/// Copy up to `count` bytes from `inf` to `outf` through a buffer (sendfile, copy_file_range).
/// `in_off`/`out_off`: explicit offsets (advanced here), else the files' own.
fn copy_loop(
    sinks: &mut Sinks,
    proc: &mut Proc,
    inf: &OpenFile,
    outf: &OpenFile,
    mut in_off: Option<&mut u64>,
    mut out_off: Option<&mut u64>,
    count: u64,
) -> Result<u64, Errno> {
    const CHUNK: usize = 1 << 16;
    let count = count.min(MAX_IO as u64) as usize;
    let mut done = 0usize;
    while done < count {
        let want = CHUNK.min(count - done);
        let data = match file_read(inf, proc, want, in_off.as_deref().copied()) {
            Ok(d) => d,
            Err(e) if done > 0 && (e == EINTR || e == EAGAIN || e == super::signal::ERESTARTSYS) => break,
            Err(e) => return Err(e),
        };
        if data.is_empty() {
            break;
        }
        let w = match file_write(outf, sinks, &data, out_off.as_deref().copied()) {
            Ok(w) => w,
            Err(e) if done > 0 => {
                let _ = e;
                break;
            }
            Err(e) => return Err(e),
        };
        if let Some(o) = in_off.as_deref_mut() {
            *o += w as u64;
        } else if w < data.len() {
            // Give back what was read but not written.
            if let Some(h) = inf.host_fd() {
                // SAFETY: lseek on an fd we own.
                unsafe { libc::lseek(h, w as i64 - data.len() as i64, libc::SEEK_CUR) };
            }
        }
        if let Some(o) = out_off.as_deref_mut() {
            *o += w as u64;
        }
        done += w;
        if w < data.len() || data.len() < want {
            break;
        }
    }
    Ok(done as u64)
}

fn read_off(ctx: &Ctx, p: u64) -> Result<Option<u64>, Errno> {
    if p == 0 {
        return Ok(None);
    }
    Ok(Some(offset(ctx.read_u64(p)?)?))
}

fn sys_sendfile(os: &mut GuestOs, ctx: &mut Ctx, out_fd: i32, in_fd: i32, offp: u64, count: u64) -> SysResult {
    let outf = os.files.file(out_fd)?;
    let inf = os.files.file(in_fd)?;
    let mut off = read_off(ctx, offp)?;
    let n = copy_loop(&mut Sinks { out: ctx.out, stdio: os.stdio.as_ref() }, &mut os.proc, &inf, &outf, off.as_mut(), None, count)?;
    if let Some(o) = off {
        ctx.write(offp, &o.to_le_bytes())?;
    }
    Ok(n)
}

/// copy_file_range and splice: copy through `copy_loop` at the guest's offset pointers (0: the
/// files' own offsets), writing the advanced offsets back.
fn copy_at(os: &mut GuestOs, ctx: &mut Ctx, inf: &OpenFile, outf: &OpenFile, in_offp: u64, out_offp: u64, len: u64) -> SysResult {
    let mut ioff = read_off(ctx, in_offp)?;
    let mut ooff = read_off(ctx, out_offp)?;
    let n = copy_loop(&mut Sinks { out: ctx.out, stdio: os.stdio.as_ref() }, &mut os.proc, inf, outf, ioff.as_mut(), ooff.as_mut(), len)?;
    if let Some(o) = ioff {
        ctx.write(in_offp, &o.to_le_bytes())?;
    }
    if let Some(o) = ooff {
        ctx.write(out_offp, &o.to_le_bytes())?;
    }
    Ok(n)
}

/// A pipe end (a host FIFO or pipe, or one of the engine's streams).
fn is_pipe(f: &OpenFile) -> bool {
    match f.host_fd() {
        Some(_) => special::file_stat(f).is_ok_and(|st| st.st_mode & libc::S_IFMT == libc::S_IFIFO),
        None => f.stream,
    }
}

/// splice(2): moves data between a pipe and a file (or two pipes), as a copy through the engine
/// (the host's zero-copy is not needed for the sizes sandboxes move). Linux's rules on arguments:
/// one end must be a pipe, a pipe end takes no offset (ESPIPE).
#[allow(clippy::too_many_arguments)]
fn sys_splice(os: &mut GuestOs, ctx: &mut Ctx, in_fd: i32, in_offp: u64, out_fd: i32, out_offp: u64, len: u64, flags: u32) -> SysResult {
    const KNOWN: u32 = 1 | 2 | 4 | 8; // SPLICE_F_MOVE, _NONBLOCK, _MORE, _GIFT
    if flags & !KNOWN != 0 {
        return Err(EINVAL);
    }
    let inf = os.files.file(in_fd)?;
    let outf = os.files.file(out_fd)?;
    let (in_pipe, out_pipe) = (is_pipe(&inf), is_pipe(&outf));
    if !in_pipe && !out_pipe {
        return Err(EINVAL);
    }
    if (in_pipe && in_offp != 0) || (out_pipe && out_offp != 0) {
        return Err(ESPIPE);
    }
    if inf.dir || outf.dir {
        return Err(EINVAL);
    }
    copy_at(os, ctx, &inf, &outf, in_offp, out_offp, len)
}

#[allow(clippy::too_many_arguments)]
fn sys_copy_file_range(os: &mut GuestOs, ctx: &mut Ctx, in_fd: i32, in_offp: u64, out_fd: i32, out_offp: u64, len: u64, flags: u32) -> SysResult {
    if flags != 0 {
        return Err(EINVAL);
    }
    let inf = os.files.file(in_fd)?;
    let outf = os.files.file(out_fd)?;
    if inf.dir || outf.dir {
        return Err(EISDIR);
    }
    copy_at(os, ctx, &inf, &outf, in_offp, out_offp, len)
}
