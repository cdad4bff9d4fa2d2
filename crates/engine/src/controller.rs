//! The caller's side: a [`Vm`] is a handle to one VMM process.
//!
//! Handles are `Send`; each blocks only on its own process, so many can be driven from many threads.
//! Dropping a handle kills its VMM process (and so frees the VM, its memory and descriptors).

use std::ffi::OsString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command};
use std::time::{Duration, Instant};

use kvm_bindings::kvm_regs;

use std::sync::Arc;

use crate::channel::{Channel, RecvError};
use crate::egress::{LogEntry, Policy, SandboxNet};
use crate::error::{Error, Result};
use crate::protocol::{JailStatus, MemStats, Platform, Request, ResetStats, Response, RunResult};
use crate::quota::{DiskQuota, DiskUsage, Scratch};
use crate::vstate::vcpu::VcpuState;

/// How to start a fresh VMM process: a program that calls [`crate::vmm::serve_fd`]`(3)`.
#[derive(Clone, Debug)]
pub struct Launcher {
    program: PathBuf,
    args: Vec<OsString>,
}

/// Settings for a booted VM.
#[derive(Clone, Debug)]
pub struct VmConfig {
    /// Guest-physical memory in bytes (sparse: only touched pages cost host memory).
    pub mem_size: u64,
    /// How many CPUs a Linux guest sees (sched_getaffinity, sysconf, /proc/cpuinfo,
    /// /sys/devices/system/cpu); its threads still take turns on one vCPU. None: the engine's
    /// default, `COLLIMATE_CPUS` or 1 (see `guestos::cpu`).
    pub cpus: Option<u32>,
    /// What runs a spawned Linux program (`Vm::spawn`): KVM (the default) or systrap. Booted and
    /// restored VMs are KVM's.
    pub platform: Platform,
}

impl Default for VmConfig {
    fn default() -> Self {
        VmConfig { mem_size: 1 << 30, cpus: None, platform: Platform::Kvm }
    }
}

/// Slack on top of a run's own budget before the controller decides the VMM process is hung.
const HANG_GRACE: Duration = Duration::from_secs(30);
/// The largest file [`Vm::download`] reads (the SDK's default download limit; uploads have the same).
pub const DOWNLOAD_MAX: u64 = 256 << 20;
/// How long a control request (not a run) may take.
const CONTROL_TIMEOUT: Duration = Duration::from_secs(120);

impl Launcher {
    pub fn new(program: impl Into<PathBuf>, args: Vec<OsString>) -> Launcher {
        Launcher { program: program.into(), args }
    }

    fn spawn(&self) -> Result<(Child, Channel)> {
        let (ours, theirs) = Channel::pair()?;
        let fd = theirs.raw_fd();
        let mut cmd = Command::new(&self.program);
        cmd.args(&self.args).stdin(std::process::Stdio::null()).stdout(std::process::Stdio::null());
        // SAFETY: only async-signal-safe calls (dup2, fcntl) between fork and exec.
        unsafe {
            cmd.pre_exec(move || {
                if fd == 3 {
                    if libc::fcntl(3, libc::F_SETFD, 0) < 0 {
                        return Err(std::io::Error::last_os_error());
                    }
                } else if libc::dup2(fd, 3) < 0 {
                    return Err(std::io::Error::last_os_error());
                }
                Ok(())
            });
        }
        let child = cmd.spawn().map_err(Error::sys("start VMM process"))?;
        drop(theirs);
        Ok((child, ours))
    }
}

enum Process {
    Launched(Child),
    Forked(OwnedFd),
    Gone,
}

/// A handle to a VM living in its own VMM process.
pub struct Vm {
    chan: Channel,
    process: Process,
    pid: i32,
    /// Read ends of the guest's stdout and stderr pipes (Linux programs only): every process of
    /// the sandbox writes to them, and `run` drains them while the guest runs.
    stdio: Option<Stdio>,
    /// The layers of its jail the VMM process runs in, as it said in `Ready`.
    jail: JailStatus,
    /// The last run left background processes: the next run gets fresh stdout/stderr pipes (see
    /// `RunResult::others`), and theirs are closed (their writes then fail, as over a closed
    /// terminal or connection).
    rotate_stdio: bool,
    /// This sandbox's own tmpfs (a descriptor of it, from its `Ready`): its disk usage and quota.
    scratch: Option<Scratch>,
    /// Its shared-memory pool (`quota::SHARED_MEMORY` unless set), from the same `Ready`.
    shm: Option<Scratch>,
    /// The shared-memory pool of the children this VM forks (and the size of this VM's own pool,
    /// if it has one); `None` where `quota` is.
    shm_quota: Option<DiskQuota>,
    /// The disk quota of the children this VM forks (and of this VM, if it has a tmpfs); `None`
    /// where the host cannot make tmpfs instances (no CAP_SYS_ADMIN).
    quota: Option<DiskQuota>,
    /// Its sandboxes (its forks, and itself after a reset) have a writable root (`crate::overlay`):
    /// each fork and reset takes an overlay context made here (`Request::WritableRoot`).
    writable_root: bool,
    /// This sandbox's network state on the trusted side (`crate::egress`): its policy, flows and
    /// log. A fork gets a copy of the policy; its broker socket goes to the VMM with the first
    /// stdio pipes (`net_sent`).
    net: Arc<SandboxNet>,
    net_sent: bool,
    /// What runs its guest (its forks' too).
    platform: Platform,
}

struct Stdio {
    out: OwnedFd,
    err: OwnedFd,
}

pub use crate::protocol::OUTPUT_CAP;

fn pipe() -> Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: pipe2 fills two descriptors we then own.
    if unsafe { libc::pipe2(fds.as_mut_ptr(), libc::O_CLOEXEC) } != 0 {
        return Err(Error::last_os("pipe2"));
    }
    // SAFETY: fresh descriptors from pipe2.
    let (r, w) = unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) };
    // SAFETY: fcntl on our own descriptor.
    unsafe { libc::fcntl(r.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    Ok((r, w))
}

impl Stdio {
    /// New pipes: ours (read ends) and the write ends for the guest.
    fn new() -> Result<(Stdio, [OwnedFd; 2])> {
        let (out, out_w) = pipe()?;
        let (err, err_w) = pipe()?;
        Ok((Stdio { out, err }, [out_w, err_w]))
    }

    /// Read what is available now; true if a stream hit the cap.
    fn drain(&self, out: &mut Vec<u8>, err: &mut Vec<u8>) -> bool {
        let mut truncated = false;
        for (fd, buf) in [(&self.out, out), (&self.err, err)] {
            let mut chunk = [0u8; 65536];
            loop {
                // SAFETY: reading into our own buffer from our own non-blocking descriptor.
                let n = unsafe { libc::read(fd.as_raw_fd(), chunk.as_mut_ptr().cast(), chunk.len()) };
                if n <= 0 {
                    break;
                }
                let room = OUTPUT_CAP.saturating_sub(buf.len());
                truncated |= (n as usize) > room;
                buf.extend_from_slice(&chunk[..(n as usize).min(room)]);
            }
        }
        truncated
    }
}

impl std::fmt::Debug for Vm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Vm(pid={})", self.pid)
    }
}

impl Vm {
    fn launch(launcher: &Launcher, first: Request) -> Result<Vm> {
        Self::launch_with(launcher, first, None, &[])
    }

    fn launch_with(launcher: &Launcher, first: Request, stdio: Option<Stdio>, fds: &[RawFd]) -> Result<Vm> {
        let platform = match &first {
            Request::Spawn { platform, .. } => *platform,
            Request::Restore { dir } => crate::persist::platform_of(dir).unwrap_or(Platform::Kvm),
            _ => Platform::Kvm,
        };
        let (child, chan) = launcher.spawn()?;
        let pid = child.id() as i32;
        let mut vm = Vm {
            chan,
            process: Process::Launched(child),
            pid,
            stdio,
            jail: JailStatus::default(),
            rotate_stdio: false,
            scratch: None,
            shm: None,
            quota: crate::quota::available().then_some(crate::quota::DEFAULT_QUOTA),
            shm_quota: crate::quota::available().then_some(crate::quota::SHARED_MEMORY),
            writable_root: false,
            net: SandboxNet::new(Policy::default()),
            net_sent: false,
            platform,
        };
        if let Err(e) = vm.chan.send(&first, fds) {
            return Err(vm.died(format!("send failed: {e}")));
        }
        match vm.recv(CONTROL_TIMEOUT)? {
            Response::Ready { linux, jail, .. } => {
                vm.jail = jail;
                warn_unjailed(jail);
                // New pipes (a restored VM has none yet) and, with them, its broker socket.
                if linux && (vm.stdio.is_none() || !vm.net_sent) {
                    vm.attach_stdio()?;
                }
                Ok(vm)
            }
            other => Err(Error::Protocol(format!("expected Ready, got {other:?}"))),
        }
    }

    /// Start a VMM process and boot a static ELF in it. The guest is paused until [`Vm::run`].
    pub fn boot(launcher: &Launcher, elf: &[u8], cfg: &VmConfig) -> Result<Vm> {
        Self::launch(launcher, Request::Boot { elf: elf.to_vec(), mem_size: cfg.mem_size })
    }

    /// Start a VMM process running the Linux program `spec.argv[0]` from `spec.root` on
    /// `cfg.platform`. Paused until [`Vm::run`].
    pub fn spawn(launcher: &Launcher, spec: &crate::protocol::SpawnSpec, cfg: &VmConfig) -> Result<Vm> {
        let (stdio, ends) = Stdio::new()?;
        let fds = [ends[0].as_raw_fd(), ends[1].as_raw_fd()];
        let first = Request::Spawn { spec: spec.clone(), mem_size: cfg.mem_size, cpus: cfg.cpus, platform: cfg.platform };
        Self::launch_with(launcher, first, Some(stdio), &fds)
    }

    /// Start a VMM process with the snapshot in `dir`, paused.
    pub fn restore(launcher: &Launcher, dir: &Path) -> Result<Vm> {
        Self::launch(launcher, Request::Restore { dir: dir.to_path_buf() })
    }

    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// What runs this VM's guest: KVM or systrap.
    pub fn platform(&self) -> Platform {
        self.platform
    }

    /// The layers of its jail this VM's VMM process runs in.
    pub fn jail(&self) -> JailStatus {
        self.jail
    }

    fn call(&mut self, req: &Request, timeout: Duration) -> Result<Response> {
        self.call_with_fds(req, &[], timeout)
    }

    fn call_with_fds(&mut self, req: &Request, fds: &[RawFd], timeout: Duration) -> Result<Response> {
        if matches!(self.process, Process::Gone) {
            return Err(Error::Destroyed);
        }
        if let Err(e) = self.chan.send(req, fds) {
            return Err(self.died(format!("send failed: {e}")));
        }
        self.recv(timeout)
    }

    /// A request whose answer carries descriptors.
    fn call_with_fds_back(&mut self, req: &Request, timeout: Duration) -> Result<(Response, Vec<OwnedFd>)> {
        if matches!(self.process, Process::Gone) {
            return Err(Error::Destroyed);
        }
        if let Err(e) = self.chan.send(req, &[]) {
            return Err(self.died(format!("send failed: {e}")));
        }
        self.recv_with_fds(timeout)
    }

    fn recv(&mut self, timeout: Duration) -> Result<Response> {
        self.recv_with_fds(timeout).map(|(r, _)| r)
    }

    fn recv_with_fds(&mut self, timeout: Duration) -> Result<(Response, Vec<OwnedFd>)> {
        self.chan.set_read_timeout(Some(timeout))?;
        match self.chan.recv::<Response>() {
            Ok((Response::Err(e), _)) => Err(e.into()),
            Ok((r, fds)) => Ok((r, fds)),
            Err(RecvError::Closed) => Err(self.died("it exited".into())),
            Err(RecvError::TimedOut) => {
                let e = self.died(format!("no answer within {timeout:?}; killed it"));
                Err(e)
            }
            Err(RecvError::Failed(e)) => Err(self.died(e.to_string())),
        }
    }

    fn died(&mut self, reason: String) -> Error {
        self.kill();
        Error::VmmDied { pid: self.pid, reason }
    }

    /// Run the guest until it stops (exit, yield, port I/O, fault) or `timeout` passes.
    pub fn run(&mut self, timeout: Duration) -> Result<RunResult> {
        self.run_request(Request::Run { timeout }, timeout)
    }

    fn run_request(&mut self, req: Request, timeout: Duration) -> Result<RunResult> {
        if self.rotate_stdio && self.stdio.is_some() {
            self.attach_stdio()?;
            self.rotate_stdio = false;
        }
        let Some(stdio) = self.stdio.take() else {
            return match self.call(&req, timeout + HANG_GRACE)? {
                Response::Run(r) => Ok(r),
                other => Err(Error::Protocol(format!("expected Run, got {other:?}"))),
            };
        };
        let res = self.run_draining(&stdio, req, timeout);
        self.stdio = Some(stdio);
        if let Ok(r) = &res {
            self.rotate_stdio = r.others > 0;
        }
        res
    }

    /// Run while reading the guest's stdout/stderr pipes, so a guest that writes more than a pipe
    /// holds never blocks on us.
    fn run_draining(&mut self, stdio: &Stdio, req: Request, timeout: Duration) -> Result<RunResult> {
        if matches!(self.process, Process::Gone) {
            return Err(Error::Destroyed);
        }
        if let Err(e) = self.chan.send(&req, &[]) {
            return Err(self.died(format!("send failed: {e}")));
        }
        let (mut out, mut err) = (Vec::new(), Vec::new());
        let mut truncated = false;
        let limit = Instant::now() + timeout + HANG_GRACE;
        loop {
            let mut fds = [
                libc::pollfd { fd: self.chan.raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: stdio.out.as_raw_fd(), events: libc::POLLIN, revents: 0 },
                libc::pollfd { fd: stdio.err.as_raw_fd(), events: libc::POLLIN, revents: 0 },
            ];
            let left = limit.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(self.died(format!("no answer within {:?}; killed it", timeout + HANG_GRACE)));
            }
            // SAFETY: three valid pollfds.
            let rc = unsafe { libc::poll(fds.as_mut_ptr(), 3, left.as_millis().min(i32::MAX as u128) as i32) };
            if rc < 0 && std::io::Error::last_os_error().raw_os_error() != Some(libc::EINTR) {
                return Err(Error::last_os("poll"));
            }
            truncated |= stdio.drain(&mut out, &mut err);
            if fds[0].revents != 0 {
                break;
            }
        }
        let mut r = match self.recv(HANG_GRACE)? {
            Response::Run(r) => r,
            other => return Err(Error::Protocol(format!("expected Run, got {other:?}"))),
        };
        truncated |= stdio.drain(&mut out, &mut err);
        out.extend_from_slice(&r.stdout);
        err.extend_from_slice(&r.stderr);
        r.stdout = out;
        r.stderr = err;
        r.truncated |= truncated;
        Ok(r)
    }

    /// Write the VM to `dir` (state file + memory file). The VM stays usable.
    pub fn snapshot(&mut self, dir: &Path) -> Result<()> {
        let req = Request::Snapshot { dir: dir.to_path_buf() };
        if !self.jail.namespaces {
            return self.expect_ok(&req);
        }
        // A jailed VMM process cannot see `dir`: hand it the directory itself (see vmm::jail).
        let dest = crate::vmm::jail::open_snapshot_dest(dir)?;
        match self.call_with_fds(&req, &[dest.as_raw_fd()], CONTROL_TIMEOUT)? {
            Response::Ok => Ok(()),
            other => Err(Error::Protocol(format!("expected Ok, got {other:?}"))),
        }
    }

    /// Fork the paused VM into `n` children (host forks of its VMM process). Each child inherits the
    /// guest's memory copy-on-write and resumes exactly where the parent is.
    pub fn fork(&mut self, n: usize) -> Result<Vec<Vm>> {
        if n == 0 {
            return Ok(vec![]);
        }
        let n32 = u32::try_from(n).map_err(|_| Error::InvalidArgument(format!("fork of {n} children")))?;
        // Each child takes two tmpfs instances of its own (its disk quota and its shared-memory
        // pool): sent with the request, or ahead of
        // it in batches when there are more than one message can carry.
        let scratch = self.make_scratch(n)?;
        let with_fork: Vec<RawFd> = if scratch.len() <= MAX_FDS_PER_MESSAGE { scratch.iter().map(|s| s.as_raw_fd()).collect() } else { vec![] };
        if with_fork.is_empty() {
            let unit = self.scratch_unit();
            for batch in scratch.chunks(MAX_FDS_PER_MESSAGE / unit * unit) {
                let fds: Vec<RawFd> = batch.iter().map(|s| s.as_raw_fd()).collect();
                match self.call_with_fds(&Request::AddScratch, &fds, CONTROL_TIMEOUT)? {
                    Response::Ok => {}
                    other => return Err(Error::Protocol(format!("expected Ok, got {other:?}"))),
                }
            }
        }
        if let Err(e) = self.chan.send(&Request::Fork { n: n32 }, &with_fork) {
            return Err(self.died(format!("send failed: {e}")));
        }
        drop(scratch); // the VMM holds them now
        let mut children = Vec::with_capacity(n);
        for _ in 0..n {
            self.chan.set_read_timeout(Some(CONTROL_TIMEOUT))?;
            match self.chan.recv::<Response>() {
                Ok((Response::Forked { pids }, fds)) if fds.len() == 2 && pids.len() == 1 => {
                    let mut fds = fds.into_iter();
                    let chan = Channel::from_owned_fd(fds.next().ok_or_else(|| Error::Protocol("no fd".into()))?);
                    let pidfd = fds.next().ok_or_else(|| Error::Protocol("no pidfd".into()))?;
                    children.push(Vm {
                        chan,
                        process: Process::Forked(pidfd),
                        pid: pids[0],
                        stdio: None,
                        jail: self.jail,
                        rotate_stdio: false,
                        scratch: None,
                        shm: None,
                        quota: self.quota,
                        shm_quota: self.shm_quota,
                        writable_root: self.writable_root,
                        // Copied, never shared: a fork's policy changes alone.
                        net: SandboxNet::forked(&self.net),
                        net_sent: false,
                        platform: self.platform,
                    });
                }
                Ok((Response::Err(e), _)) => return Err(e.into()),
                Ok((other, _)) => return Err(Error::Protocol(format!("expected Forked, got {other:?}"))),
                Err(RecvError::Closed) => return Err(self.died("it exited during fork".into())),
                Err(RecvError::TimedOut) => return Err(self.died("fork did not answer".into())),
                Err(RecvError::Failed(e)) => return Err(self.died(e.to_string())),
            }
        }
        // Each child gets its stdout/stderr pipes as soon as it is Ready, and the replies are read
        // once every child is: the children answer while the later ones are still being forked,
        // instead of one round trip after another once the last is (a fork group of 64 on systrap
        // waited 5-7 ms for them; docs/systrap.md, "fork_group(64)").
        let mut stdio = Vec::with_capacity(if self.stdio.is_some() { n } else { 0 });
        for child in &mut children {
            match child.recv_with_fds(CONTROL_TIMEOUT)? {
                (Response::Ready { jail, .. }, fds) => {
                    child.jail = jail;
                    let mut fds = fds.into_iter();
                    child.scratch = fds.next().map(Scratch);
                    child.shm = fds.next().map(Scratch);
                }
                (other, _) => return Err(Error::Protocol(format!("expected Ready, got {other:?}"))),
            }
            // A spare made before the quota changed: give it the quota asked for now.
            if let (Some(s), Some(q)) = (&child.scratch, child.quota) {
                let u = s.usage()?;
                if (u.quota_bytes, u.quota_inodes) != (q.bytes, q.inodes) {
                    s.resize(q)?;
                }
            }
            // And the shared-memory limit.
            if let (Some(s), Some(q)) = (&child.shm, child.shm_quota) {
                if s.usage()?.quota_bytes != q.bytes {
                    s.resize_pool(q.bytes)?;
                }
            }
            if self.stdio.is_some() {
                // Each sandbox has its own stdout/stderr: new pipes for every child.
                stdio.push(child.send_stdio()?);
            }
        }
        for (child, pipes) in children.iter_mut().zip(stdio) {
            child.finish_stdio(pipes)?;
        }
        Ok(children)
    }

    /// Give this (Linux) VM new stdout/stderr pipes.
    fn attach_stdio(&mut self) -> Result<()> {
        let pipes = self.send_stdio()?;
        self.finish_stdio(pipes)
    }

    /// The first half of [`Vm::attach_stdio`]: the request sent, its answer not read yet.
    fn send_stdio(&mut self) -> Result<Stdio> {
        let (stdio, ends) = Stdio::new()?;
        let mut fds = vec![ends[0].as_raw_fd(), ends[1].as_raw_fd()];
        let broker = if self.net_sent {
            None
        } else {
            let b = crate::egress::broker::register(self.net.clone()).map_err(|e| Error::Remote(e.to_string()))?;
            fds.push(b.as_raw_fd());
            Some(b)
        };
        if let Err(e) = self.chan.send(&Request::SetStdio, &fds) {
            return Err(self.died(format!("send failed: {e}")));
        }
        drop(ends);
        drop(broker); // the VMM holds it now
        self.net_sent = true;
        Ok(stdio)
    }

    /// The second half of [`Vm::attach_stdio`]: read the answer to [`Vm::send_stdio`]'s request.
    fn finish_stdio(&mut self, stdio: Stdio) -> Result<()> {
        match self.recv(CONTROL_TIMEOUT)? {
            Response::Ok => {
                self.stdio = Some(stdio);
                Ok(())
            }
            other => Err(Error::Protocol(format!("expected Ok, got {other:?}"))),
        }
    }

    /// Keep `n` pre-forked children of this paused VM ready, so a fork costs only the hand-over.
    /// Meant for template zygotes, which never run; anything that changes the guest discards them.
    pub fn set_spare_pool(&mut self, n: usize) -> Result<()> {
        let n32 = u32::try_from(n).map_err(|_| Error::InvalidArgument(format!("spare pool of {n}")))?;
        if n32 > crate::vmm::MAX_SPARES {
            return Err(Error::InvalidArgument(format!("spare pool of {n}; at most {}", crate::vmm::MAX_SPARES)));
        }
        // A tmpfs for each spare (the VMM keeps as many as its spares lack and drops the rest;
        // later forks bring one per child, which tops the spares up again).
        let scratch = self.make_scratch(n)?;
        let fds: Vec<RawFd> = scratch.iter().map(|s| s.as_raw_fd()).collect();
        self.call_with_fds(&Request::SparePool { n: n32 }, &fds, CONTROL_TIMEOUT).and_then(|r| match r {
            Response::Ok => Ok(()),
            other => Err(Error::Protocol(format!("expected Ok, got {other:?}"))),
        })
    }

    /// `n` pairs of new tmpfs instances for this VM's children, one after the other: a disk of
    /// their quota and a shared-memory pool (none if quotas are off, or for the engine's bare test
    /// guests, which have no files); with a writable root, each pair followed by an overlay context.
    fn make_scratch(&self, n: usize) -> Result<Vec<OwnedFd>> {
        match self.quota {
            Some(q) if self.stdio.is_some() => {
                let pool = self.shm_quota.unwrap_or(crate::quota::SHARED_MEMORY);
                let mut v = Vec::with_capacity(n * self.scratch_unit());
                for _ in 0..n {
                    let exec = self.platform == Platform::Systrap;
                    v.push(Scratch::with_exec(q, exec)?.0);
                    v.push(Scratch::with_exec(pool, exec)?.0);
                    if self.writable_root {
                        v.push(crate::overlay::context()?);
                    }
                }
                Ok(v)
            }
            _ => Ok(vec![]),
        }
    }

    /// Descriptors each child takes (see [`Vm::make_scratch`]).
    fn scratch_unit(&self) -> usize {
        if self.writable_root { 3 } else { 2 }
    }

    /// Give the sandboxes this VM forks from now on a writable root (the image under a copy-up
    /// layer in each one's disk quota, `crate::overlay`), or not. Drops its spare clones (the
    /// caller sets the spare pool again). Without tmpfs instances (no quotas) the root stays
    /// read-only.
    pub fn set_writable_root(&mut self, on: bool) -> Result<()> {
        let on = on && self.quota.is_some();
        match self.call(&Request::WritableRoot { on }, CONTROL_TIMEOUT)? {
            Response::Ok => {
                self.writable_root = on;
                Ok(())
            }
            other => Err(Error::Protocol(format!("expected Ok, got {other:?}"))),
        }
    }

    /// Whether its sandboxes have a writable root ([`Vm::set_writable_root`]).
    pub fn writable_root(&self) -> bool {
        self.writable_root
    }

    /// Set the disk quota of this sandbox's writable mounts (if it has a tmpfs of its own: a
    /// quota below what it holds is refused) and of the children it forks from now on.
    pub fn set_disk_quota(&mut self, q: DiskQuota) -> Result<()> {
        if self.quota.is_none() {
            return Err(Error::InvalidArgument(
                "this host cannot give sandboxes a disk quota (making tmpfs instances needs CAP_SYS_ADMIN); \
                 run as root, or leave the quota unset"
                    .into(),
            ));
        }
        if let Some(s) = &self.scratch {
            s.resize(q)?;
        } else {
            crate::quota::check(q)?; // what a child's tmpfs would refuse
        }
        self.quota = Some(q);
        Ok(())
    }

    /// Set the shared-memory limit of this sandbox (the size of its shared-memory pool, if it has
    /// one: a limit below what its shared memory holds is refused) and of the children it forks
    /// from now on. `bytes` is at least `quota::MIN_SHARED_MEMORY`.
    pub fn set_shared_memory(&mut self, bytes: u64) -> Result<()> {
        if self.shm_quota.is_none() {
            return Err(Error::InvalidArgument(
                "this host cannot give sandboxes a shared-memory limit (making tmpfs instances needs CAP_SYS_ADMIN); \
                 run as root, or leave shared_memory unset"
                    .into(),
            ));
        }
        let q = crate::quota::shared_memory(bytes)?;
        if let Some(s) = &self.shm {
            s.resize_pool(bytes)?;
        }
        self.shm_quota = Some(q);
        Ok(())
    }

    /// The shared-memory limit of this VM's children (and its own), in bytes (`None`: no quotas
    /// on this host).
    pub fn shared_memory(&self) -> Option<u64> {
        self.shm_quota.map(|q| q.bytes)
    }

    /// What this sandbox's writable mounts hold, and their quota; `None` if it has no tmpfs of its
    /// own (a template zygote, a booted or restored VM, or a host without quotas).
    pub fn disk_usage(&self) -> Result<Option<DiskUsage>> {
        self.scratch.as_ref().map(Scratch::usage).transpose()
    }

    /// What this sandbox's shared memory holds (shared anonymous mappings, memfds, /dev/shm) and
    /// its limit, in the same form; `None` where [`Vm::disk_usage`] is.
    pub fn shared_memory_usage(&self) -> Result<Option<DiskUsage>> {
        self.shm.as_ref().map(Scratch::usage).transpose()
    }

    /// Whether this sandbox's shared-memory limit refused anything (an mmap, a page, a write)
    /// since the last call.
    pub fn take_shared_memory_limit_reached(&self) -> bool {
        self.shm.as_ref().is_some_and(|s| s.take_marker(crate::vstate::shared::LIMIT_MARKER))
    }

    /// The quota this VM's children get (`None`: no quotas on this host).
    pub fn disk_quota(&self) -> Option<DiskQuota> {
        self.quota
    }

    /// This sandbox's network state, shared (for callers that must not wait for a running exec).
    pub fn net(&self) -> Arc<SandboxNet> {
        self.net.clone()
    }

    /// This sandbox's egress policy (`Policy::default()`: no network).
    pub fn egress(&self) -> Policy {
        self.net.policy()
    }

    /// Replace this sandbox's egress policy; its open connections the new policy forbids are reset.
    /// Returns how many were. Its later forks start from this policy.
    pub fn set_egress(&mut self, p: Policy) -> usize {
        self.net.set_policy(p)
    }

    /// Forget this sandbox's network past (a recycled clone's next owner): no network, empty log.
    pub fn clear_egress(&mut self) {
        self.net.clear()
    }

    /// This sandbox's connection attempts and DNS answers, oldest first.
    pub fn egress_log(&self) -> Vec<LogEntry> {
        self.net.log()
    }

    /// Egress bytes of this sandbox's connections: (sent and acknowledged, received).
    pub fn egress_bytes(&self) -> (u64, u64) {
        self.net.bytes()
    }

    /// One child: see [`Vm::fork`].
    pub fn clone_vm(&mut self) -> Result<Vm> {
        self.fork(1)?.pop().ok_or_else(|| Error::Protocol("fork returned no child".into()))
    }

    /// Return to the snapshot this VM descends from: drop its private pages, restore the vCPU.
    pub fn reset(&mut self) -> Result<ResetStats> {
        self.reset_request(Request::Reset)
    }

    /// [`Vm::reset`] that keeps the sandbox's writable mounts as they are (see
    /// `Request::ResetKeepFiles`).
    pub fn reset_keep_files(&mut self) -> Result<ResetStats> {
        self.reset_request(Request::ResetKeepFiles)
    }

    fn reset_request(&mut self, req: Request) -> Result<ResetStats> {
        // A fresh writable root needs a context of its own (one mounts once).
        let ctx = match req {
            Request::Reset if self.writable_root && self.scratch.is_some() => Some(crate::overlay::context()?),
            _ => None,
        };
        let fds: Vec<RawFd> = ctx.iter().map(|c| c.as_raw_fd()).collect();
        match self.call_with_fds(&req, &fds, CONTROL_TIMEOUT)? {
            Response::Reset(s) => {
                // Output the guest wrote before the reset belongs to no one now.
                if let Some(stdio) = &self.stdio {
                    let (mut a, mut b) = (Vec::new(), Vec::new());
                    stdio.drain(&mut a, &mut b);
                }
                Ok(s)
            }
            other => Err(Error::Protocol(format!("expected Reset, got {other:?}"))),
        }
    }

    /// Send `input` to the in-guest agent and run until it waits for the next request; the
    /// result's `agent` field holds its reply, `stdout`/`stderr` what the sandbox printed.
    pub fn agent_call(&mut self, input: &[u8], timeout: Duration) -> Result<RunResult> {
        self.run_request(Request::AgentCall { input: input.to_vec(), timeout, reseed: None }, timeout)
    }

    /// [`Vm::reseed`] then [`Vm::agent_call`], in one round trip to the VMM (with
    /// `seed.wall_clock_ns`, virtual REALTIME starts no earlier than that).
    pub fn agent_call_seeded(&mut self, input: &[u8], timeout: Duration, seed: crate::protocol::ExecSeed) -> Result<RunResult> {
        self.run_request(Request::AgentCall { input: input.to_vec(), timeout, reseed: Some(seed) }, timeout)
    }

    /// After an agent call that timed out: end what that exec started and let the agent answer
    /// (see `Request::EndExec`).
    pub fn end_exec(&mut self, signal: i32, timeout: Duration) -> Result<RunResult> {
        self.run_request(Request::EndExec { signal, timeout }, timeout)
    }

    /// Write a file into the guest's file system (a Linux guest's writable mounts), byte-exact.
    pub fn upload(&mut self, path: &str, data: &[u8], mode: u32) -> Result<()> {
        self.expect_ok(&Request::Upload { path: path.to_string(), data: data.to_vec(), mode })
    }

    /// Reseed the sandbox CRNG of this (Linux, paused) VM with `seed`; with `replay`, its clocks run
    /// on deterministic virtual time from now on. The same seed on the same paused state then gives
    /// the same random bytes and, in replay mode, the same clock readings (docs/replay.md).
    pub fn reseed(&mut self, seed: [u8; 32], replay: bool) -> Result<()> {
        self.expect_ok(&Request::Reseed { seed, replay })
    }

    /// Read a regular file of the guest's file system, byte-exact, if it holds at most
    /// [`DOWNLOAD_MAX`] bytes (see [`Vm::open_download`]).
    pub fn download(&mut self, path: &str) -> Result<Vec<u8>> {
        use std::io::Read;
        let (f, size) = self.open_download(path, DOWNLOAD_MAX)?;
        let mut out = Vec::with_capacity(size as usize);
        f.take(size).read_to_end(&mut out).map_err(Error::sys("read downloaded file"))?;
        Ok(out)
    }

    /// Open a regular file of the guest's file system for reading, and its size then: refused
    /// (a clear error, and the sandbox goes on) for anything else (a FIFO, a device, a directory)
    /// and for a file over `max` bytes. The VMM opens it without blocking and hands the open file
    /// over, so reading it costs no memory in the VMM and none here beyond what the reader keeps
    /// (a sparse file reads as its size in zeroes: bound it with `max`).
    pub fn open_download(&mut self, path: &str, max: u64) -> Result<(std::fs::File, u64)> {
        match self.call_with_fds_back(&Request::Download { path: path.to_string(), max }, CONTROL_TIMEOUT)? {
            (Response::FileFd { size }, fds) if fds.len() == 1 => {
                let fd = fds.into_iter().next().ok_or_else(|| Error::Protocol("no fd".into()))?;
                Ok((std::fs::File::from(fd), size))
            }
            (other, _) => Err(Error::Protocol(format!("expected FileFd, got {other:?}"))),
        }
    }

    pub fn read_mem(&mut self, gva: u64, len: usize) -> Result<Vec<u8>> {
        match self.call(&Request::ReadMem { gva, len: len as u64 }, CONTROL_TIMEOUT)? {
            Response::Mem(m) => Ok(m),
            other => Err(Error::Protocol(format!("expected Mem, got {other:?}"))),
        }
    }

    pub fn write_mem(&mut self, gva: u64, data: &[u8]) -> Result<()> {
        self.expect_ok(&Request::WriteMem { gva, data: data.to_vec() })
    }

    pub fn regs(&mut self) -> Result<kvm_regs> {
        match self.call(&Request::GetRegs, CONTROL_TIMEOUT)? {
            Response::Regs(r) => Ok(r),
            other => Err(Error::Protocol(format!("expected Regs, got {other:?}"))),
        }
    }

    pub fn set_regs(&mut self, regs: &kvm_regs) -> Result<()> {
        self.expect_ok(&Request::SetRegs(*regs))
    }

    pub fn vcpu_state(&mut self) -> Result<VcpuState> {
        match self.call(&Request::VcpuState, CONTROL_TIMEOUT)? {
            Response::VcpuState(s) => Ok(*s),
            other => Err(Error::Protocol(format!("expected VcpuState, got {other:?}"))),
        }
    }

    pub fn mem_stats(&mut self) -> Result<MemStats> {
        match self.call(&Request::MemStats, CONTROL_TIMEOUT)? {
            // Read here: a jailed VMM process has no /proc.
            Response::MemStats(s) => Ok(MemStats { private_bytes: private_bytes(self.pid)?, ..s }),
            other => Err(Error::Protocol(format!("expected MemStats, got {other:?}"))),
        }
    }

    fn expect_ok(&mut self, req: &Request) -> Result<()> {
        match self.call(req, CONTROL_TIMEOUT)? {
            Response::Ok => Ok(()),
            other => Err(Error::Protocol(format!("expected Ok, got {other:?}"))),
        }
    }

    /// Kill the VMM process and wait until it is gone: its memory, VM and descriptors are freed
    /// when this returns.
    pub fn destroy(mut self) -> Result<()> {
        self.kill();
        Ok(())
    }

    pub fn is_alive(&self) -> bool {
        !matches!(self.process, Process::Gone)
    }

    fn kill(&mut self) {
        match std::mem::replace(&mut self.process, Process::Gone) {
            Process::Launched(mut child) => {
                let _ = child.kill();
                let _ = child.wait();
            }
            Process::Forked(pidfd) => {
                // SAFETY: pidfd_send_signal on a pidfd we own; null siginfo is allowed.
                unsafe {
                    libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, 0usize, 0u32)
                };
                let mut pfd = libc::pollfd { fd: pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
                // A pidfd turns readable when the process has exited. SIGKILL cannot be blocked, so
                // this is bounded by the kernel's teardown of the process.
                for _ in 0..100 {
                    // SAFETY: one valid pollfd.
                    let rc = unsafe { libc::poll(&mut pfd, 1, 100) };
                    if rc != 0 && !(rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)) {
                        break;
                    }
                }
            }
            Process::Gone => return,
        }
        // Its flows go with it (the broker's copies too), and so does its broker socket.
        self.net.close();
        crate::egress::broker::forget(&self.net);
        // Our descriptor of its tmpfs was the last: its space goes back now.
        self.scratch = None;
        self.shm = None;
        // The sandbox's private writable directories (if it had any) go with it.
        let _ = std::fs::remove_dir_all(crate::guestos::persist::vm_dir(self.pid));
    }
}

/// Most descriptors one message carries with SCM_RIGHTS (the kernel's limit is 253).
const MAX_FDS_PER_MESSAGE: usize = 250;

/// Private_Clean + Private_Dirty of process `pid`, in bytes.
fn private_bytes(pid: i32) -> Result<u64> {
    let s = std::fs::read_to_string(format!("/proc/{pid}/smaps_rollup")).map_err(Error::sys("read smaps_rollup"))?;
    Ok(s.lines()
        .filter(|l| l.starts_with("Private_Clean:") || l.starts_with("Private_Dirty:"))
        .filter_map(|l| l.split_whitespace().nth(1)?.parse::<u64>().ok())
        .sum::<u64>()
        * 1024)
}

/// Say once per process that VMM processes run without their namespaces (the usual cause: not root).
fn warn_unjailed(jail: JailStatus) {
    static WARNED: std::sync::Once = std::sync::Once::new();
    if !jail.namespaces {
        WARNED.call_once(|| {
            eprintln!(
                "collimate: VMM processes run without their mount and network namespaces (creating them \
                 needs CAP_SYS_ADMIN); resource limits and the seccomp filter still apply"
            )
        });
    }
}

impl Drop for Vm {
    fn drop(&mut self) {
        self.kill();
    }
}
