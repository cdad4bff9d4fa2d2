//! The guest OS personality: the Linux x86-64 system calls the engine services so that unmodified
//! programs (Debian's CPython, busybox) run in guest ring 3 with no guest kernel.
//!
//! One VMM process runs one guest process. A syscall traps to the host (see `vmm`), which calls
//! [`dispatch`] with a [`Ctx`] giving access to the guest's memory (through the platform that runs
//! it: `crate::platform`) and registers. Each
//! area lives in its own module:
//! - [`exec`]: loading ELF programs (static, PIE, with PT_INTERP) and the initial stack.
//! - [`mm`]: the address space as the guest sees it: mmap, munmap, mprotect, brk, mremap.
//! - [`vfs`] and [`files`]: guest paths resolved inside the sandbox's file system, and the fd table.
//! - [`process`]: a process's state ([`process::Proc`]), pids, process groups, sessions, prctl;
//!   around it, one module per concept: [`identity`] (user and group ids, uname), [`limits`]
//!   (rlimits), [`clock`] (clocks, sleeps, the replay clocks), [`timer`] (alarm, itimers, POSIX timers,
//!   timerfd), [`random`] (getrandom, reseeding),
//!   [`signal_state`] (dispositions, mask, alternate stack), [`cpu`] (the CPUs the guest sees,
//!   affinity, scheduling settings, sysinfo) and [`thread_area`] (arch_prctl, robust lists).
//! - [`thread`] and [`futex`]: a process's threads (host-side state, switched on its one vCPU by
//!   `vmm::threads`) and the futexes they wait on.
//! - [`signal`]: signals (generation, handler frames, sigreturn), kill, and waiting for children.
//! - [`crng`]: the sandbox CRNG every guest random byte comes from (seedable for replays).
//! - [`futex_shared`]: futexes on shared pages, which wake waiters in other guest processes.
//!
//! A syscall nobody services returns ENOSYS and is counted per number, so gaps show up in reports.

pub mod clock;
pub mod cpu;
pub mod crng;
pub mod exec;
pub mod files;
pub mod futex;
pub mod futex_shared;
pub mod identity;
pub mod limits;
pub mod mm;
pub mod persist;
pub mod process;
pub mod proctab;
pub mod random;
pub mod sched;
pub mod signal;
pub mod signal_state;
pub mod thread;
pub mod thread_area;
pub mod timer;
pub mod tree;
pub mod vdso;
pub mod vfs;

use std::collections::BTreeMap;

use kvm_bindings::{kvm_regs, kvm_sregs};

use crate::platform::Memory;
use crate::protocol::RunExit;

/// A Linux errno value (positive).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Errno(pub i32);

pub const EPERM: Errno = Errno(1);
pub const E2BIG: Errno = Errno(7);
pub const ENODATA: Errno = Errno(61);
pub const ENOENT: Errno = Errno(2);
pub const ESRCH: Errno = Errno(3);
pub const EINTR: Errno = Errno(4);
pub const EIO: Errno = Errno(5);
pub const EBADF: Errno = Errno(9);
pub const ECHILD: Errno = Errno(10);
pub const EAGAIN: Errno = Errno(11);
pub const ENOMEM: Errno = Errno(12);
pub const EACCES: Errno = Errno(13);
pub const EFAULT: Errno = Errno(14);
pub const EEXIST: Errno = Errno(17);
pub const ENOTDIR: Errno = Errno(20);
pub const EISDIR: Errno = Errno(21);
pub const EINVAL: Errno = Errno(22);
pub const EMFILE: Errno = Errno(24);
pub const ENOTTY: Errno = Errno(25);
pub const EFBIG: Errno = Errno(27);
pub const ESPIPE: Errno = Errno(29);
pub const EROFS: Errno = Errno(30);
pub const EPIPE: Errno = Errno(32);
pub const ERANGE: Errno = Errno(34);
pub const ENAMETOOLONG: Errno = Errno(36);
pub const ENOSYS: Errno = Errno(38);
pub const ENOTEMPTY: Errno = Errno(39);
pub const ELOOP: Errno = Errno(40);
pub const EOPNOTSUPP: Errno = Errno(95);

impl Errno {
    /// The errno of a host error (the host and the guest are both Linux x86-64).
    pub fn from_io(e: &std::io::Error) -> Errno {
        Errno(e.raw_os_error().unwrap_or(EIO.0))
    }
    /// The errno left by the last failed libc call.
    pub fn last() -> Errno {
        Errno::from_io(&std::io::Error::last_os_error())
    }
}

fn errno_error(op: &str, path: &str, e: Errno) -> crate::Error {
    let msg = std::io::Error::from_raw_os_error(e.0);
    // Only a read-only root says EROFS (a writable root, `crate::overlay`, takes writes anywhere).
    let hint = if e == EROFS { " (the root is read-only here: only /tmp, /work, /dev/shm and a baked image's HOME are writable)" } else { "" };
    crate::Error::InvalidArgument(format!("{op} {path}: {msg}{hint}"))
}

/// What a syscall returns to the guest: a value for rax, or an errno (returned as -errno).
pub type SysResult = std::result::Result<u64, Errno>;

/// Captured output of the guest's fds 1 and 2 during one run, and ENOSYS counts.
#[derive(Default)]
pub struct Output {
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub enosys: u64,
}

/// Everything a syscall handler may touch besides the [`GuestOs`] state itself.
pub struct Ctx<'a> {
    /// The guest's memory, on the platform running this process (see `platform`).
    pub memory: Memory<'a>,
    /// The guest's registers; `rip` already points after the `syscall` instruction. Handlers may
    /// change them (rax is overwritten with the result afterwards).
    pub regs: &'a mut kvm_regs,
    /// Special registers: `fs.base`/`gs.base` for arch_prctl.
    pub sregs: &'a mut kvm_sregs,
    pub out: &'a mut Output,
    /// Set by a handler that removed, narrowed or redirected mappings in a way `stale_frames` does
    /// not describe: every cached translation is dropped before the guest resumes (costly).
    pub flush_tlb: bool,
    /// Guest-physical frames whose translations a handler removed, narrowed or redirected. KVM keeps
    /// using cached translations after the host edits page tables (see `vstate::tlb`), so these are
    /// invalidated before the guest resumes, and before any of them is handed out again.
    pub stale_frames: Vec<u64>,
    /// Set by a handler that ends the run after this syscall (e.g. the agent waiting for work).
    pub stop: Option<RunExit>,
    /// The guest's lazy file mappings (`GuestOs::mm.lazy_areas()`), whose pages without a frame
    /// [`Ctx::read`] and [`Ctx::write`] serve as a guest access would: empty for nearly every
    /// process, and then those never look further than the page tables.
    pub lazy: Vec<mm::LazyArea>,
}

impl Ctx<'_> {
    /// Copy guest memory at a user virtual address into `buf`. EFAULT if unmapped or not user.
    /// Pages of a lazy file mapping that were never touched read from the file.
    pub fn read(&self, va: u64, buf: &mut [u8]) -> std::result::Result<(), Errno> {
        match &self.memory {
            Memory::Kvm(k) => match k.aspace.read_virt(k.mem, va, buf, true) {
                Ok(()) => Ok(()),
                Err(_) if !self.lazy.is_empty() => mm::read_user(&self.lazy, k.mem, k.aspace, va, buf),
                Err(_) => Err(EFAULT),
            },
            Memory::Host(h) => h.read(va, buf),
        }
    }

    pub fn read_vec(&self, va: u64, len: usize) -> std::result::Result<Vec<u8>, Errno> {
        let mut v = vec![0u8; len];
        self.read(va, &mut v)?;
        Ok(v)
    }

    pub fn read_u64(&self, va: u64) -> std::result::Result<u64, Errno> {
        let mut b = [0u8; 8];
        self.read(va, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// Copy `data` to a user virtual address. EFAULT if unmapped or not user. Pages of a lazy file
    /// mapping that were never touched are read in first, as a guest write would.
    pub fn write(&mut self, va: u64, data: &[u8]) -> std::result::Result<(), Errno> {
        match &mut self.memory {
            Memory::Kvm(k) => match k.aspace.write_virt(k.mem, va, data, true) {
                Ok(()) => Ok(()),
                Err(_) if !self.lazy.is_empty() => {
                    // Reading a page in only adds translations: nothing for `stale_frames`.
                    let mut sp = mm::Space::new(&mut *k.mem, &mut *k.frames, k.aspace);
                    mm::write_user(&self.lazy, &mut sp, va, data)
                }
                Err(_) => Err(EFAULT),
            },
            Memory::Host(h) => h.write(va, data),
        }
    }

    /// A NUL-terminated string from guest memory (at most `max` bytes before the NUL).
    pub fn read_cstr(&self, va: u64, max: usize) -> std::result::Result<Vec<u8>, Errno> {
        let mut out = Vec::new();
        let mut p = va;
        loop {
            // Read up to the end of the current page at a time.
            let chunk = (4096 - (p & 4095)) as usize;
            let mut buf = vec![0u8; chunk];
            self.read(p, &mut buf)?;
            if let Some(i) = buf.iter().position(|&b| b == 0) {
                out.extend_from_slice(&buf[..i]);
                return Ok(out);
            }
            out.extend_from_slice(&buf);
            if out.len() > max {
                return Err(ENAMETOOLONG);
            }
            p += chunk as u64;
        }
    }
}

/// Per-process state of the guest OS: one guest process per VMM process.
pub struct GuestOs {
    pub mm: mm::Mm,
    pub files: files::Files,
    pub vfs: vfs::Vfs,
    pub proc: process::Proc,
    /// ENOSYS answers by syscall number since the process started.
    pub enosys: BTreeMap<u64, u64>,
    /// The sandbox's stdout and stderr pipes (write ends), shared by all its guest processes.
    pub stdio: Option<[std::os::fd::OwnedFd; 2]>,
    /// The agent channel (fd 3 of an agent process), if this process is the in-guest agent.
    pub agent: Option<std::sync::Arc<files::OpenFile>>,
    /// Pending signals, children and parent (see [`signal`]).
    pub sig: signal::SigState,
    /// The process's threads (see [`thread`]).
    pub threads: thread::Threads,
}

impl GuestOs {
    /// A process with nothing loaded yet: the standard fds, default settings, the given view.
    pub fn new(vfs: vfs::Vfs) -> GuestOs {
        GuestOs {
            mm: Default::default(),
            files: Default::default(),
            vfs,
            proc: Default::default(),
            enosys: Default::default(),
            stdio: None,
            agent: None,
            sig: Default::default(),
            threads: Default::default(),
        }
    }

    /// Make fd 3 the agent channel.
    pub fn install_agent(&mut self) -> std::result::Result<(), Errno> {
        let f = std::sync::Arc::new(files::OpenFile::new(
            files::Kind::Agent(Default::default()),
            None,
            libc::O_RDWR,
        ));
        self.files.install(3, f.clone(), false)?;
        self.agent = Some(f);
        Ok(())
    }

    /// Queue a request for the agent.
    pub fn agent_send(&self, data: &[u8]) -> crate::error::Result<()> {
        let io = self.agent_io()?;
        io.lock().map_err(|_| crate::Error::Protocol("agent channel poisoned".into()))?.inbox.extend(data);
        Ok(())
    }

    /// Take what the agent wrote.
    pub fn agent_take(&self) -> crate::error::Result<Vec<u8>> {
        let io = self.agent_io()?;
        Ok(std::mem::take(&mut io.lock().map_err(|_| crate::Error::Protocol("agent channel poisoned".into()))?.outbox))
    }

    fn agent_io(&self) -> crate::error::Result<&std::sync::Mutex<files::AgentIo>> {
        match self.agent.as_deref().map(|f| &f.kind) {
            Some(files::Kind::Agent(io)) => Ok(io),
            _ => Err(crate::Error::InvalidArgument("this sandbox has no in-guest agent".into())),
        }
    }

    /// Write `data` to guest path `path` (creating parent directories), as the host.
    pub fn upload(&self, path: &str, data: &[u8], mode: u32) -> crate::error::Result<()> {
        use std::io::Write;
        let abs = vfs::join("/", path.as_bytes()).map_err(|e| errno_error("upload", path, e))?;
        let mut parents = Vec::new();
        let mut p = std::path::Path::new(&abs).parent();
        while let Some(d) = p {
            if d.as_os_str() == "/" {
                break;
            }
            parents.push(d.to_string_lossy().into_owned());
            p = d.parent();
        }
        for d in parents.iter().rev() {
            match self.vfs.open("/", d.as_bytes(), libc::O_PATH | libc::O_DIRECTORY, 0) {
                Ok(_) => {}
                Err(_) => self.mkdir(d).map_err(|e| errno_error("upload", d, e))?,
            }
        }
        // Written beside, then renamed over the target: an upload that does not fit (the disk
        // quota) fails whole, leaving the old file as it was and nothing half-written.
        use std::os::fd::{AsRawFd, FromRawFd};
        let (parent, name) = abs.rsplit_once('/').ok_or_else(|| errno_error("upload", &abs, EINVAL))?;
        let parent = if parent.is_empty() { "/" } else { parent };
        if !self.vfs.writable(&abs) {
            if self.vfs.root_mounted() {
                // A writable root (`crate::overlay`): what is not writable is a mount over it.
                return Err(crate::Error::InvalidArgument(format!(
                    "upload {abs}: {} (a read-only mount over the sandbox's writable root: the engine's own files or /proc, /dev)",
                    std::io::Error::from_raw_os_error(EROFS.0)
                )));
            }
            return Err(errno_error("upload", &abs, EROFS));
        }
        let dir = self.vfs.open("/", parent.as_bytes(), libc::O_PATH | libc::O_DIRECTORY, 0).map_err(|e| errno_error("upload", parent, e))?;
        let c = |s: &str| std::ffi::CString::new(vfs::guest_bytes(s)).map_err(|_| errno_error("upload", &abs, EINVAL));
        let (target, tmp) = (c(name)?, c(&format!(".{name}.collimate-upload"))?);
        // SAFETY: a plain C struct, for which all zeroes is a valid value.
        let mut old: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstatat fills the struct we pass; the name is a valid C string relative to `dir`.
        let existed = unsafe { libc::fstatat(dir.as_raw_fd(), target.as_ptr(), &mut old, libc::AT_SYMLINK_NOFOLLOW) } == 0
            && old.st_mode & libc::S_IFMT == libc::S_IFREG;
        // SAFETY: unlinkat/openat relative to our directory fd with valid C strings; results checked.
        let fd = unsafe {
            libc::unlinkat(dir.as_raw_fd(), tmp.as_ptr(), 0);
            libc::openat(dir.as_raw_fd(), tmp.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW | libc::O_CLOEXEC, mode & 0o7777)
        };
        if fd < 0 {
            return Err(errno_error("upload", &abs, Errno::last()));
        }
        // SAFETY: a descriptor we just opened.
        let mut f = unsafe { std::fs::File::from_raw_fd(fd) };
        let written = f.write_all(data).and_then(|_| {
            if existed {
                // The file it replaces keeps its mode and owner, as an overwrite in place would.
                // SAFETY: fchmod/fchown on our own descriptor.
                if unsafe { libc::fchmod(fd, old.st_mode & 0o7777) } != 0 || unsafe { libc::fchown(fd, old.st_uid, old.st_gid) } != 0 {
                    return Err(std::io::Error::last_os_error());
                }
            }
            // SAFETY: renameat within our directory fd, valid C strings.
            if unsafe { libc::renameat(dir.as_raw_fd(), tmp.as_ptr(), dir.as_raw_fd(), target.as_ptr()) } != 0 {
                return Err(std::io::Error::last_os_error());
            }
            // Not in the guest's future: the file and its directory get the guest's time
            // (`files::stamp`), not the host's.
            let t = files::stamp::upload_time(&self.proc);
            // SAFETY: futimens on our descriptor and utimensat on our directory fd, with local
            // arrays of two timespecs.
            unsafe {
                libc::futimens(fd, [t, t].as_ptr());
                libc::utimensat(dir.as_raw_fd(), c".".as_ptr(), [libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT }, t].as_ptr(), 0);
            }
            Ok(())
        });
        if let Err(e) = written {
            // SAFETY: removing our own temporary, relative to our directory fd.
            unsafe { libc::unlinkat(dir.as_raw_fd(), tmp.as_ptr(), 0) };
            let shm = abs == persist::SHM_MOUNT || abs.starts_with(&format!("{}/", persist::SHM_MOUNT));
            if shm && matches!(e.raw_os_error(), Some(libc::ENOSPC)) {
                return Err(crate::Error::InvalidArgument(format!(
                    "upload {abs}: {} bytes do not fit in the sandbox's shared memory ({} MiB for /dev/shm, shared mappings \
                     and memfds together); free some or upload to /tmp or /work",
                    data.len(),
                    crate::vstate::shared::pool()
                        .and_then(|p| crate::quota::usage_of(&p).ok())
                        .map_or(crate::quota::SHARED_MEMORY.bytes, |u| u.quota_bytes)
                        >> 20
                )));
            }
            if matches!(e.raw_os_error(), Some(libc::ENOSPC | libc::EDQUOT)) {
                return Err(crate::Error::InvalidArgument(format!(
                    "upload {abs}: {} bytes do not fit in the sandbox's disk quota (/tmp and /work together); \
                     free space in it or give the sandbox a larger disk_quota",
                    data.len()
                )));
            }
            return Err(crate::Error::Sys { op: "write uploaded file", source: e });
        }
        Ok(())
    }

    fn mkdir(&self, path: &str) -> std::result::Result<(), Errno> {
        let (parent, name) = path.rsplit_once('/').ok_or(EINVAL)?;
        let parent = if parent.is_empty() { "/" } else { parent };
        let dir = self.vfs.open("/", parent.as_bytes(), libc::O_PATH | libc::O_DIRECTORY, 0)?;
        let c = std::ffi::CString::new(name).map_err(|_| EINVAL)?;
        // SAFETY: mkdirat relative to a directory fd we own, with a valid C string.
        if unsafe { libc::mkdirat(std::os::fd::AsRawFd::as_raw_fd(&dir), c.as_ptr(), 0o755) } != 0 {
            let e = Errno::last();
            if e != EEXIST {
                return Err(e);
            }
        }
        Ok(())
    }

    /// Open guest path `path` for the host to read, as the host: a regular file only, opened
    /// without blocking (a FIFO or a device the guest made would hang the opener) and at most
    /// `max` bytes long. Returns the open file and its size; the caller reads it (the bytes are
    /// not copied here: see `Request::Download`).
    pub fn download(&self, path: &str, max: u64) -> crate::error::Result<(std::os::fd::OwnedFd, u64)> {
        let flags = libc::O_RDONLY | libc::O_NONBLOCK | libc::O_NOCTTY;
        let fd = self.vfs.open("/", path.as_bytes(), flags, 0).map_err(|e| errno_error("download", path, e))?;
        // SAFETY: a plain C struct, for which all zeroes is a valid value.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: fstat fills the struct we pass, on a descriptor we own.
        if unsafe { libc::fstat(std::os::fd::AsRawFd::as_raw_fd(&fd), &mut st) } != 0 {
            return Err(crate::Error::last_os("fstat downloaded file"));
        }
        let kind = match st.st_mode & libc::S_IFMT {
            libc::S_IFREG => None,
            libc::S_IFDIR => Some("a directory"),
            libc::S_IFIFO => Some("a FIFO (named pipe)"),
            libc::S_IFSOCK => Some("a socket"),
            libc::S_IFCHR => Some("a character device"),
            libc::S_IFBLK => Some("a block device"),
            _ => Some("not a regular file"),
        };
        if let Some(kind) = kind {
            return Err(crate::Error::InvalidArgument(format!(
                "download {path}: it is {kind}; only regular files can be downloaded (copy what you need into a file first, \
                 e.g. with exec(command=\"cat {path} > /tmp/out\", timeout_seconds=...))"
            )));
        }
        let size = st.st_size.max(0) as u64;
        if size > max {
            return Err(crate::Error::InvalidArgument(format!(
                "download {path}: the file is {size} bytes, over the download limit of {max} bytes; \
                 split or compress it in the sandbox, or raise the limit (max_download)"
            )));
        }
        Ok((fd, size))
    }

    /// Make `fds` (pipe write ends from the controller: stdout, stderr) the guest's fds 1 and 2,
    /// replacing every descriptor that referred to the previous ones.
    pub fn set_stdio(&mut self, fds: Vec<std::os::fd::OwnedFd>) -> crate::error::Result<()> {
        let [out, err]: [std::os::fd::OwnedFd; 2] = fds
            .try_into()
            .map_err(|v: Vec<_>| crate::Error::Protocol(format!("stdio needs 2 descriptors, got {}", v.len())))?;
        self.stdio = Some([out, err]);
        Ok(())
    }
}

/// Linux x86-64 syscall numbers the dispatcher knows by name.
pub mod nr {
    pub const READ: u64 = 0;
    pub const WRITE: u64 = 1;
    pub const EXIT: u64 = 60;
    pub const EXIT_GROUP: u64 = 231;
    /// Engine hypercall (not Linux): pause and hand `rdi` to the host.
    pub const YIELD: u64 = 0x4000_0000;

    /// A call a process or thread can wait in, as a report of what each was doing says it (a run
    /// that timed out): `read(fd 4)`, `futex(0x.., op 265)`; the number for calls not named here.
    pub fn describe_call(nr: u64, args: [u64; 4]) -> String {
        let fd = args[0] as i32;
        match nr {
            0 => format!("read(fd {fd})"),
            1 => format!("write(fd {fd})"),
            19 => format!("readv(fd {fd})"),
            20 => format!("writev(fd {fd})"),
            42 => format!("connect(fd {fd})"),
            43 => format!("accept(fd {fd})"),
            44 => format!("sendto(fd {fd})"),
            45 => format!("recvfrom(fd {fd})"),
            46 => format!("sendmsg(fd {fd})"),
            47 => format!("recvmsg(fd {fd})"),
            288 => format!("accept4(fd {fd})"),
            202 => format!("futex({:#x}, op {})", args[0], args[1]),
            61 => format!("wait4({})", args[0] as i64),
            247 => format!("waitid({})", args[0] as i64),
            7 => "poll()".into(),
            23 => "select()".into(),
            34 => "pause()".into(),
            35 => "nanosleep()".into(),
            128 => "rt_sigtimedwait()".into(),
            130 => "rt_sigsuspend()".into(),
            230 => "clock_nanosleep()".into(),
            232 => "epoll_wait()".into(),
            270 => "pselect6()".into(),
            271 => "ppoll()".into(),
            281 => "epoll_pwait()".into(),
            _ => format!("syscall {nr}"),
        }
    }
}

/// Service the syscall in `ctx.regs`. Returns why the run should stop, if it should.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx) -> Option<RunExit> {
    let nr = ctx.regs.rax;
    let a = [ctx.regs.rdi, ctx.regs.rsi, ctx.regs.rdx, ctx.regs.r10, ctx.regs.r8, ctx.regs.r9];
    let res = match nr {
        // One thread of several ends; the process goes on (see `thread`).
        nr::EXIT if os.threads.multi() => {
            thread::exit_current(os, ctx);
            ctx.regs.rax = 0;
            return ctx.stop.take();
        }
        nr::EXIT | nr::EXIT_GROUP => {
            crate::trace::mark("guest.exit");
            return Some(RunExit::Exited { code: a[0] as i32 });
        }
        nr::YIELD => {
            ctx.regs.rax = 0;
            return Some(RunExit::Yield { value: a[0] });
        }
        _ => {
            // A timer due by now fires first: a blocking call retried after the clock reached it
            // sees its signal (or its timerfd readable).
            timer::fire_due(os);
            let r = thread::dispatch(os, ctx, nr, a)
                .or_else(|| mm::dispatch(os, ctx, nr, a))
                .or_else(|| files::dispatch(os, ctx, nr, a))
                .or_else(|| per_process_dispatch(os, ctx, nr, a))
                .or_else(|| signal::dispatch(os, ctx, nr, a));
            match r {
                Some(r) => r,
                None => {
                    *os.enosys.entry(nr).or_default() += 1;
                    ctx.out.enosys += 1;
                    Err(ENOSYS)
                }
            }
        }
    };
    if res.is_ok() {
        match proctab::changed_by(nr) {
            0 => {}
            1 => proctab::refresh(os, &ctx.memory),
            _ => {
                let (vsize, rss) = proctab::memory(os, &ctx.memory);
                proctab::publish_memory(os.proc.pid, vsize, rss);
            }
        }
    }
    ctx.regs.rax = match res {
        Ok(v) => v,
        // Wait more: the guest re-executes its `syscall` (2 bytes) with rax = nr.
        Err(signal::ERESTARTSYS) => {
            ctx.regs.rip = ctx.regs.rip.wrapping_sub(2);
            nr
        }
        Err(e) => {
            // A write the full shared-memory pool refused (a memfd, a /dev/shm file): the exec's
            // result names the limit, as for a refused mapping or page (the same test of the pool).
            if e.0 == libc::ENOSPC && crate::vstate::shared::pool_full() {
                crate::vstate::shared::note_limit_reached();
            }
            (-(e.0 as i64)) as u64
        }
    };
    ctx.stop.take()
}

/// The per-process calls (process tree, identity, limits, clocks, randomness, signal bookkeeping,
/// CPU and thread-area setup), asked after the thread, memory and file calls; their unit tests
/// (`process/tests.rs`) dispatch through this too.
pub(crate) fn per_process_dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    thread_area::dispatch(os, ctx, nr, a)
        .or_else(|| limits::dispatch(os, ctx, nr, a))
        .or_else(|| identity::dispatch(os, ctx, nr, a))
        .or_else(|| process::dispatch(os, ctx, nr, a))
        .or_else(|| random::dispatch(os, ctx, nr, a))
        .or_else(|| clock::dispatch(os, ctx, nr, a))
        .or_else(|| timer::dispatch(os, ctx, nr, a))
        .or_else(|| cpu::dispatch(os, ctx, nr, a))
        .or_else(|| signal_state::dispatch(os, ctx, nr, a))
}
