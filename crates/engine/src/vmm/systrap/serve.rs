//! A systrap sandbox as a served VMM process: the controller protocol (`crate::protocol`) over
//! a systrap first process, beside the KVM `Machine`'s `vmm::serve`.
//!
//! The launched VMM process receives `Spawn` with `Platform::Systrap` and enters its jail
//! (`jail::enter_systrap`): the first stub is spawned after the resource limits and before the
//! namespaces and the seccomp filter (a stub's spawn clones with namespace flags, which the
//! allow-list refuses); everything later stays within them. The program is loaded into that stub
//! with the controller's pipes as fds 1 and 2, and this process becomes the top of its sandbox's
//! process tree (guest pids from its pid page, as on kvm: the first process is 1, guest forks
//! count on from 2).
//!
//! `Fork` (a clone of the sandbox) is a fork of the parked stub (`Stub::fork`) and a host fork of
//! this process; each child owns its stub, gets its own copy of the writable mounts (in its tmpfs,
//! as kvm's forks) and its own process tree, and serves its own channel. Copy-on-write of the
//! guest's memory is the host kernel's.
//!
//! A run's timeout: the run's timer kicks the stub at the deadline (`super::preempt`), so a guest
//! that computes without syscalls stops there as one that makes them does: resumable, as on kvm.
//! A watchdog timer ([`Watchdog`]) stays as the last resort for a stub that does not answer (it
//! kills the stub when the run's time is up and a little more; the run then ends as `Timeout` and
//! the sandbox's first process is gone, later runs answering `Signaled(SIGKILL)`).
//!
//! `EndExec` after an exec that timed out while its processes made syscalls (a command waiting
//! for a child, a sleeping `time.sleep`): the agent's children are SIGKILLed and the agent gets
//! the interrupt signal, as on kvm.
//!
//! `Snapshot` writes the sandbox's first process (`super::snapshot`; one process, one thread);
//! a `Restore` of such a snapshot as the first request ([`serve_restore`]) serves it again.
//!
//! `Reset` and `ResetKeepFiles` return a sandbox restored from a snapshot, or a clone of one, to
//! that snapshot in place (`super::reset`).
//!
//! Not here yet, each refused with [`super::unsupported`]'s error: spare pools, the vCPU state
//! and memory statistics.

use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::sync::atomic::{AtomicBool, AtomicI32, Ordering};
use std::sync::Arc;
use std::time::Duration;

use super::{unsupported, Process};
use crate::channel::{Channel, RecvError};
use crate::error::{Error, Result};
use crate::guestos::persist::ScratchRoot;
use crate::guestos::{self, signal};
use crate::platform::systrap::{reaper, Confinement, PendingFork, Stub};
use crate::protocol::{Request, Response, RunExit, RunResult};
use crate::vmm::{exit_discarding, exit_process, jail, lifeline, reply, reply_with_fds};

/// Serve a launched VMM process whose first request is `Spawn` on systrap. Never returns.
pub(in crate::vmm) fn serve_first(mut first: Request, fds: Vec<OwnedFd>, mut chan: Channel) -> ! {
    // Nothing trapped but syscalls and faults: a replay exec turns the `rdtsc` trap on for its
    // length (`Process::sync_traps` at each reseed), since every context switch into or out of a
    // trapping stub costs an exit to the hypervisor on a nested host.
    let mut conf = Confinement::for_replay(false);
    // The guest's memory is what the Spawn asks for, as on kvm, where it is the VM's memory: here
    // the stub's private writable memory (RLIMIT_DATA, inherited by its forks), so that a guest
    // that allocates without end gets ENOMEM (Python's MemoryError) at that size instead of
    // growing into the host's memory. The stub's own pages (its blob and shared page) are a few
    // hundred KiB of it. Not RLIMIT_AS: that counts reservations too (glibc reserves 64 MiB of
    // PROT_NONE per thread's malloc arena besides its 8 MiB stack), and stopped a 1 GiB guest at
    // 60 threads where kvm, which counts the pages used, starts CPython's 100-thread tests.
    if let Request::Spawn { mem_size, .. } = &first {
        conf.data = Some(*mem_size);
    }
    let stub = first_stub(&mut first, &conf, &mut chan);
    let Request::Spawn { spec, cpus, .. } = first else {
        reply(&mut chan, Err(Error::Protocol("systrap serves a Spawn request".into())));
        exit_process(1)
    };
    serve_new_tree(Process::with_stub(&spec, stub, Some(fds), cpus), chan)
}

/// Serve a launched VMM process whose first request is `Restore` of a systrap snapshot
/// (`super::snapshot`): a new stub, spawned in the jail as the first one of a `Spawn` is, takes
/// the snapshot's memory, registers and guest OS state. Never returns.
pub(in crate::vmm) fn serve_restore(mut first: Request, mut chan: Channel) -> ! {
    let Request::Restore { dir } = &first else {
        reply(&mut chan, Err(Error::Protocol("serve_restore serves a Restore request".into())));
        exit_process(1)
    };
    let budget = match super::snapshot::read_state(dir) {
        Ok(s) => s.budget,
        Err(e) => {
            reply(&mut chan, Err(e));
            exit_process(1)
        }
    };
    // As a spawned sandbox's stub (`serve_first`): nothing trapped but syscalls and faults until
    // an exec's reseed switches rdtsc on (`Process::sync_traps`), and the guest's memory limit
    // as RLIMIT_DATA.
    let mut conf = Confinement::for_replay(false);
    conf.data = Some(budget);
    let stub = first_stub(&mut first, &conf, &mut chan);
    let Request::Restore { dir } = first else { exit_process(1) };
    // Read again inside the jail, from the directory as bound there.
    let restored = super::snapshot::read_state(&dir)
        .and_then(|state| Process::restore_into(&dir, state, stub, None, &crate::vmm::own_dir()));
    serve_new_tree(restored, chan)
}

/// Enter the jail, spawning the sandbox's first stub (confined by `conf`) on the way; a failure
/// is the controller's reply and this process's end.
fn first_stub(first: &mut Request, conf: &Confinement, chan: &mut Channel) -> Stub {
    match jail::enter_systrap(first, || Stub::spawn(conf).map_err(|e| Error::Remote(format!("systrap: {e}")))) {
        Ok((_, stub)) => stub,
        Err(e) => {
            reply(chan, Err(e));
            exit_process(1)
        }
    }
}

/// A first process made (spawned or restored): the top of a new tree, Ready, then served.
fn serve_new_tree(made: Result<Process>, mut chan: Channel) -> ! {
    let mut p = match made.and_then(|mut p| new_tree(&mut p).map(|_| p)) {
        Ok(p) => p,
        Err(e) => {
            reply(&mut chan, Err(e));
            exit_process(1)
        }
    };
    reply(&mut chan, Ok(Response::Ready { pid: host_pid(), linux: true, jail: jail::status() }));
    serve(&mut p, chan, Vec::new())
}

fn host_pid() -> i32 {
    // SAFETY: getpid cannot fail.
    unsafe { libc::getpid() }
}

/// This process is the top of a sandbox's process tree from now on (the first one, or a clone):
/// guest signals to the first process and guest pids go through it, as kvm's `process::serving`.
/// Its stubs end with their VMMs: the tree's reaper starts here (`platform::systrap::reaper`).
fn new_tree(p: &mut Process) -> Result<()> {
    let me = host_pid();
    if signal::host::top() != 0 && signal::host::top() != me {
        // A clone: the guest children of the sandbox it was forked from are not its own.
        for c in p.os.sig.children.iter_mut() {
            c.pidfd = None;
        }
    }
    signal::host::set_top(me);
    let next = signal::host::next_pid().unwrap_or(p.os.proc.next_pid);
    signal::host::new_process_count(next);
    // The tree's scheduler slots and process table (kill of any of its processes, /proc/<pid>).
    let mut space = super::StubSpace { stub: &mut p.stub, budget: p.budget, failure: None };
    super::proctree::new_tree(&p.os, &crate::platform::Memory::Host(&mut space));
    crate::trace::mark("tree.proctree");
    // SAFETY: a plain prctl on this process: orphaned guest processes come back to it.
    unsafe { libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) };
    reaper::start(&p.stub).map_err(|e| Error::Remote(format!("systrap: the sandbox's reaper: {e}")))
}

fn serve(p: &mut Process, mut chan: Channel, mut scratch: Vec<OwnedFd>) -> ! {
    loop {
        p.warm.settle(&mut p.stub);
        let (req, fds) = match chan.recv::<Request>() {
            Ok(v) => v,
            Err(RecvError::Closed) => exit_discarding(0),
            Err(RecvError::TimedOut) => continue,
            Err(RecvError::Failed(_)) => exit_discarding(2),
        };
        let runs = matches!(req, Request::Run { .. } | Request::AgentCall { .. } | Request::EndExec { .. });
        if req.changes_guest() {
            p.warm.guest_changed();
        }
        if runs {
            crate::trace::mark("serve.run");
            // The controller going away mid-run ends this process (see `lifeline`).
            lifeline::arm(chan.raw_fd());
        }
        let resp = match req {
            Request::Run { timeout } => p.run_watched(timeout).map(Response::Run),
            Request::AgentCall { input, timeout, reseed } => {
                if let Some(s) = reseed {
                    if let Some(ns) = s.wall_clock_ns {
                        p.os.proc.clocks.start_real_at_least(ns);
                    }
                    guestos::random::reseed(&mut p.os, s.seed, s.replay);
                }
                p.sync_traps().and_then(|_| p.os.agent_send(&input)).and_then(|_| agent_run(p, timeout))
            }
            Request::EndExec { signal: interrupt, timeout } => end_exec(p, interrupt).and_then(|_| agent_run(p, timeout)),
            Request::Fork { n } => {
                scratch.extend(fds);
                match fork_children(p, &mut chan, &mut scratch, n) {
                    Ok(()) => continue,
                    Err(e) => Err(e),
                }
            }
            Request::AddScratch => {
                scratch.extend(fds);
                Ok(Response::Ok)
            }
            Request::SparePool { n: 0 } => {
                scratch.extend(fds);
                Ok(Response::Ok)
            }
            Request::SparePool { .. } => Err(unsupported("a spare pool of pre-forked clones")),
            Request::WritableRoot { on } => set_writable_root(p, on).map(|_| Response::Ok),
            Request::SetStdio => {
                // A third descriptor is the sandbox's broker socket (see `guestos::files::inet`).
                let mut fds = fds;
                if fds.len() == 3 {
                    if let Some(b) = fds.pop() {
                        guestos::files::inet::set_broker(&p.os, b);
                    }
                }
                p.os.set_stdio(fds).map(|_| Response::Ok)
            }
            Request::Upload { path, data, mode } => p.os.upload(&path, &data, mode).map(|_| Response::Ok),
            Request::Download { path, max } => match p.os.download(&path, max) {
                Ok((fd, size)) => {
                    reply_with_fds(&mut chan, Ok(Response::FileFd { size }), &[fd.as_raw_fd()]);
                    continue;
                }
                Err(e) => Err(e),
            },
            Request::Reseed { seed, replay } => {
                guestos::random::reseed(&mut p.os, seed, replay);
                p.sync_traps().map(|_| Response::Ok)
            }
            Request::ReadMem { gva, len } => {
                let mut buf = vec![0u8; usize::try_from(len).unwrap_or(usize::MAX).min(64 << 20)];
                p.stub.read(gva, &mut buf).map(|_| Response::Mem(buf)).map_err(|e| Error::InvalidArgument(format!("read of guest memory: {e}")))
            }
            Request::WriteMem { gva, data } => {
                p.stub.write(gva, &data).map(|_| Response::Ok).map_err(|e| Error::InvalidArgument(format!("write of guest memory: {e}")))
            }
            Request::GetRegs => Ok(Response::Regs(p.regs)),
            Request::SetRegs(r) => {
                p.regs = r;
                Ok(Response::Ok)
            }
            Request::Snapshot { dir } => jail::in_snapshot_dest(&dir, fds, |d| p.snapshot(d)).map(|_| Response::Ok),
            Request::Reset => p.reset(false, fds.into_iter().next()).map(Response::Reset),
            Request::ResetKeepFiles => p.reset(true, None).map(Response::Reset),
            Request::VcpuState => Err(unsupported("a vCPU state (there is no vCPU)")),
            Request::MemStats => Err(unsupported("memory statistics")),
            Request::Shutdown => {
                reply(&mut chan, Ok(Response::Ok));
                exit_process(0)
            }
            Request::Boot { .. } | Request::Restore { .. } | Request::Spawn { .. } => {
                Err(Error::InvalidArgument("this VMM process already has a sandbox".into()))
            }
        };
        lifeline::disarm();
        reply(&mut chan, resp);
        if runs {
            crate::trace::mark("serve.replied");
            // A clone that owes its parent the pages of its first run writes them now, after
            // the reply (see `warm`).
            p.warm.after_run(&p.stub);
            // The next spawn call's stub, made while the controller has nothing for us.
            super::spawn::make_spare(p, chan.raw_fd());
        }
    }
}

/// Give the sandboxes forked from this one from now on a writable root, or not (as kvm's
/// `Machine::set_writable_root`): each fork then takes an overlay context after its tmpfs pair and
/// mounts its own overlay over the image (`persist::privatize`). This process's own root stays as
/// it is. The overlays are mounted without `noexec`: the stub maps the guest's program files
/// executable (`crate::overlay::allow_exec`).
fn set_writable_root(p: &mut Process, on: bool) -> Result<()> {
    if on && p.os.vfs.root_layer.is_none() {
        p.os.vfs.want_root_layer(None).map_err(Error::sys("open the sandbox root"))?;
    } else if !on && p.os.vfs.root_mounted() {
        return Err(Error::InvalidArgument("this sandbox's root is already writable; a template's zygote can turn it off".into()));
    } else if !on {
        p.os.vfs.root_layer = None;
    }
    crate::overlay::allow_exec();
    p.writable_root = on;
    Ok(())
}

/// Run until the agent waits for its next request; the result carries what it wrote.
fn agent_run(p: &mut Process, timeout: Duration) -> Result<Response> {
    let mut r = p.run_watched(timeout)?;
    r.agent = p.os.agent_take()?;
    Ok(Response::Run(r))
}

/// An exec ran out of time (`Request::EndExec`): SIGKILL the guest processes the agent started
/// (its children's VMMs, not reaped: the agent's wait reads their end; their own children end
/// with them, `PR_SET_PDEATHSIG`), then send the agent `interrupt` (0: nothing) through the
/// guest-signal carrier. Its memory and files are kept.
fn end_exec(p: &mut Process, interrupt: i32) -> Result<()> {
    if p.exited.is_some() {
        return Err(Error::InvalidArgument(
            "the sandbox's first process has ended (it exited, or a run timed out while it computed without \
             syscalls, which kills it on systrap); start a new sandbox"
                .into(),
        ));
    }
    for c in &p.os.sig.children {
        if let Some(fd) = &c.pidfd {
            let _ = signal::host::send_pidfd(fd.as_raw_fd(), libc::SIGKILL, false, (0, 0));
        }
    }
    p.kill_child_stubs();
    if interrupt > 0 {
        signal::host::send_top(interrupt, (0, 0)).map_err(|e| Error::Remote(format!("cannot interrupt the agent: errno {}", e.0)))?;
    }
    Ok(())
}

impl Process {
    /// [`Process::run`] under a [`Watchdog`] that kills the stub if the guest is still running
    /// without a trap after `timeout` (and a grace): that run ends as `Timeout`.
    fn run_watched(&mut self, timeout: Duration) -> Result<RunResult> {
        if self.exited.is_some() {
            return self.run(timeout); // its end again, without running
        }
        let grace = (timeout / 4).clamp(Duration::from_millis(100), Duration::from_secs(2));
        let dog = Watchdog::arm(self.stub.pid(), timeout + grace)?;
        let r = self.run(timeout);
        let fired = dog.disarm();
        if !fired {
            return r;
        }
        // The watchdog killed the stub: whatever the run says (it may have come back on its own
        // just as the timer fired, with a timeout of its own, or an error), the first process is
        // gone. Say so, so that the next request is refused clearly (`end_exec`) instead of
        // failing on a dead stub's pid.
        self.exited = Some(RunExit::Signaled { signo: libc::SIGKILL });
        signal::kill_children(&mut self.os);
        self.kill_child_stubs();
        let (stdout, stderr, truncated, others) = match r {
            Ok(r) => (r.stdout, r.stderr, r.truncated, r.others),
            Err(_) => (Vec::new(), Vec::new(), false, 0),
        };
        Ok(RunResult {
            exit: RunExit::Timeout,
            stdout,
            stderr,
            duration: timeout + grace,
            enosys: 0,
            truncated,
            agent: Vec::new(),
            others,
            nondeterministic: false,
        })
    }
}

/// Fork the parked sandbox into `n` clones; each replies `Ready` on its own channel, and the
/// controller gets one `Forked` per clone with that channel and a pidfd (as kvm's `Fork`).
///
/// Each clone is two forks: its stub's (the parked stub forks itself) and this process's. They
/// overlap (`COLLIMATE_SYSTRAP_FORK_OVERLAP`, on unless `0`): the stub is handed the next clone's
/// fork before this process forks for the previous one (`Stub::fork_begin`), so the two run on two
/// CPUs at once and the chain of a fork group costs about the longer of the two per clone instead
/// of their sum (docs/systrap.md, "fork_group(64)").
fn fork_children(p: &mut Process, chan: &mut Channel, scratch: &mut Vec<OwnedFd>, n: u32) -> Result<()> {
    if n == 0 || n > 4096 {
        return Err(Error::InvalidArgument(format!("fork of {n} children; ask for 1..=4096")));
    }
    if p.exited.is_some() {
        return Err(Error::InvalidArgument("the guest has exited; nothing to fork".into()));
    }
    p.warm.before_fork();
    super::spawn::drop_spare(); // no clone holds a copy of it
    let overlap = fork_overlap();
    // The stub's forks and this process's overlap on two CPUs: not with both bound to one by
    // systrap's placement (measured: fork_group(64) + map 153 against 119 ms so). The parked
    // stub is placed again from its next run; each child is placed from its first (`spread`).
    let placed = p.stub.placement().enabled;
    if placed {
        p.stub.set_placement(false);
    }
    let forked = fork_all(p, chan, scratch, n, overlap, placed);
    if placed {
        p.stub.set_placement(true);
    }
    forked
}

/// [`fork_children`]'s forks, one clone after another.
/// `placed`: the clones' stubs are placed (the parent's placement is off for the forks).
fn fork_all(p: &mut Process, chan: &mut Channel, scratch: &mut Vec<OwnedFd>, n: u32, overlap: bool, placed: bool) -> Result<()> {
    let stub_failed = |e| Error::Remote(format!("systrap: fork of the stub: {e}"));
    // Not waiting for a new stub to park: its VMM does (`clone_main`), so the next clone's fork
    // does not wait for this one's stub to be scheduled.
    crate::trace::mark("fork.begin");
    let mut next = Some(p.stub.fork_begin().map_err(stub_failed)?);
    for i in 0..n {
        if i > 0 {
            crate::trace::mark("fork.begin");
        }
        let Some(pending) = next.take() else { unreachable!("a fork was begun for every clone") };
        let mut child_stub = p.stub.fork_finish(pending).map_err(stub_failed)?;
        child_stub.set_placement(placed);
        crate::trace::mark("fork.stub");
        if overlap && i + 1 < n {
            // The stub forks the next clone's stub while this process forks for this one.
            match p.stub.fork_begin() {
                Ok(f) => next = Some(f),
                Err(e) => return Err(stub_failed(e)),
            }
            crate::trace::mark("fork.next");
        }
        let forked = fork_one(p, chan, scratch, child_stub, n, &mut next);
        if let Err(e) = forked {
            // The stub must be parked again before the error is served: end the fork it is making.
            if let Some(f) = next.take() {
                let _ = p.stub.fork_finish(f);
            }
            return Err(e);
        }
        if !overlap && i + 1 < n {
            next = Some(p.stub.fork_begin().map_err(stub_failed)?);
        }
    }
    Ok(())
}

/// Whether a fork group's two forks per clone overlap (see [`fork_children`]).
fn fork_overlap() -> bool {
    std::env::var_os("COLLIMATE_SYSTRAP_FORK_OVERLAP").is_none_or(|v| v != "0")
}

/// The host fork of this process for one clone that takes `child_stub`, and its `Forked` to the
/// controller. `next`: a stub fork in flight for the next clone (the clone drops its copy).
fn fork_one(p: &mut Process, chan: &mut Channel, scratch: &mut Vec<OwnedFd>, mut child_stub: Stub, n: u32, next: &mut Option<PendingFork>) -> Result<()> {
    // With a writable root each child's tmpfs pair is followed by its overlay context.
    let ctx = if p.writable_root && !scratch.is_empty() { scratch.pop() } else { None };
    // The pair's shared-memory pool was pushed after its disk tmpfs.
    let tmpfs = match (scratch.pop(), scratch.pop()) {
        (Some(shm), Some(disk)) => Some((disk, shm)),
        _ => None,
    };
    if n > 1 {
        // A group's children run at once: the scheduler spreads them first (systrap's placement
        // would otherwise pin each where it was forked, all on their parent's CPU).
        child_stub.start_unpinned();
    }
    let (ours, theirs) = Channel::pair()?;
    signal::host::block(true);
    signal::gather(&mut p.os);
    // SAFETY: this process is single-threaded, so the child may go on in Rust; it never
    // returns from `clone_main`.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        signal::host::reset_child();
        signal::host::block(false);
        drop(ours);
        // The next clone's stub is its parent's to finish: only this copy's fds and mapping go.
        drop(next.take());
        lifeline::forget();
        reaper::forget();
        // SAFETY: the parent's channel and the siblings' tmpfs instances are not this
        // process's; `chan` is never used here again (`clone_main` does not return).
        unsafe { libc::close(chan.raw_fd()) };
        scratch.clear();
        clone_main(p, child_stub, theirs, tmpfs, ctx, n == 1);
    }
    signal::host::block(false);
    if pid < 0 {
        return Err(Error::last_os("fork"));
    }
    child_stub.release();
    drop(theirs);
    drop((tmpfs, ctx)); // the child's now
    crate::trace::mark("fork.vmm");
    let pidfd = crate::vmm::pidfd_open(pid)?;
    chan.send(&Response::Forked { pids: vec![pid] }, &[ours.raw_fd(), pidfd.as_raw_fd()])?;
    crate::trace::mark("fork.sent");
    Ok(())
}

/// A clone of the sandbox: take the forked stub, become a sandbox of its own, serve `chan`.
/// `alone`: the only clone of its `Fork` (a sandbox or a spare, not a fork group's child).
fn clone_main(p: &mut Process, stub: Stub, mut chan: Channel, tmpfs: Option<(OwnedFd, OwnedFd)>, ctx: Option<OwnedFd>, alone: bool) -> ! {
    std::mem::replace(&mut p.stub, stub).release();
    crate::trace::mark("clone.start");
    if let Err(e) = p.stub.await_parked() {
        reply(&mut chan, Err(Error::Remote(format!("systrap: fork of the stub: {e}"))));
        exit_discarding(1)
    }
    // The faults of a first exec, taken once this clone has replied (off the path of that exec
    // for a spare); not in a fork group's children (see `warm`).
    p.warm.in_clone(alone);
    let tmpfs = tmpfs.map(|(disk, shm)| (Arc::new(disk), Arc::new(shm)));
    let root = match &tmpfs {
        Some((disk, shm)) => ScratchRoot::Tmpfs { disk: disk.clone(), shm: Some(shm.clone()) },
        None => ScratchRoot::Dir(crate::guestos::persist::vm_dir(host_pid())),
    };
    crate::vstate::shared::set_pool(tmpfs.as_ref().map(|(_, shm)| shm.clone()));
    // Its own copy of the writable mounts and, unless its CRNG was seeded, fresh entropy.
    guestos::random::diverge(&mut p.os);
    crate::trace::mark("clone.parked");
    match crate::guestos::persist::privatize(&mut p.os, &root, ctx) {
        Ok(()) => {
            p.reset.set_scratch(root);
            crate::trace::mark("clone.privatized");
            if let Err(e) = new_tree(p) {
                reply(&mut chan, Err(e));
                exit_discarding(1)
            }
            crate::trace::mark("clone.tree");
            let fds: Vec<RawFd> = tmpfs.iter().flat_map(|(disk, shm)| [disk.as_raw_fd(), shm.as_raw_fd()]).collect();
            if chan.send(&Response::Ready { pid: host_pid(), linux: true, jail: jail::status() }, &fds).is_err() {
                exit_discarding(0);
            }
            crate::trace::mark("clone.ready");
            serve(p, chan, Vec::new())
        }
        Err(e) => {
            reply(&mut chan, Err(e));
            exit_discarding(1)
        }
    }
}

/// A one-shot timer that SIGKILLs a stub from a signal handler (the VMM thread is then waiting
/// for that stub, which never traps on its own).
struct Watchdog {
    timer: libc::timer_t,
    pidfd: OwnedFd,
}

/// The stub the armed watchdog kills (its pidfd), and whether it did.
static TARGET: AtomicI32 = AtomicI32::new(-1);
static FIRED: AtomicBool = AtomicBool::new(false);

fn watchdog_signal() -> i32 {
    // SIGRTMIN..+5 are taken (preempter, guest-signal carrier, reaper, scheduler, lifeline).
    libc::SIGRTMIN() + 7
}

extern "C" fn on_watchdog(_: libc::c_int) {
    let fd = TARGET.load(Ordering::SeqCst);
    if fd >= 0 {
        // SAFETY: pidfd_send_signal is async-signal-safe; `fd` stays open while armed.
        unsafe { libc::syscall(libc::SYS_pidfd_send_signal, fd, libc::SIGKILL, 0usize, 0u32) };
        FIRED.store(true, Ordering::SeqCst);
    }
}

impl Watchdog {
    fn arm(stub: i32, after: Duration) -> Result<Watchdog> {
        let pidfd = crate::vmm::pidfd_open(stub)?;
        FIRED.store(false, Ordering::SeqCst);
        TARGET.store(pidfd.as_raw_fd(), Ordering::SeqCst);
        // SAFETY: installing a handler that only makes async-signal-safe calls; a zeroed
        // sigaction/sigevent/itimerspec is valid and filled in before use; the timer is deleted
        // by `disarm`.
        unsafe {
            let mut sa: libc::sigaction = std::mem::zeroed();
            sa.sa_sigaction = on_watchdog as *const () as usize;
            sa.sa_flags = libc::SA_RESTART;
            libc::sigemptyset(&mut sa.sa_mask);
            if libc::sigaction(watchdog_signal(), &sa, std::ptr::null_mut()) != 0 {
                return Err(Error::last_os("sigaction for the run's watchdog"));
            }
            let mut ev: libc::sigevent = std::mem::zeroed();
            ev.sigev_notify = libc::SIGEV_SIGNAL;
            ev.sigev_signo = watchdog_signal();
            let mut timer: libc::timer_t = std::ptr::null_mut();
            if libc::timer_create(libc::CLOCK_MONOTONIC, &mut ev, &mut timer) != 0 {
                return Err(Error::last_os("timer_create for the run's watchdog"));
            }
            let mut spec: libc::itimerspec = std::mem::zeroed();
            spec.it_value.tv_sec = after.as_secs().min(i64::MAX as u64 / 2) as libc::time_t;
            spec.it_value.tv_nsec = after.subsec_nanos() as libc::c_long;
            if spec.it_value.tv_sec == 0 && spec.it_value.tv_nsec == 0 {
                spec.it_value.tv_nsec = 1;
            }
            if libc::timer_settime(timer, 0, &spec, std::ptr::null_mut()) != 0 {
                let e = Error::last_os("timer_settime for the run's watchdog");
                libc::timer_delete(timer);
                return Err(e);
            }
            Ok(Watchdog { timer, pidfd })
        }
    }

    /// Stop the timer; whether it fired.
    fn disarm(self) -> bool {
        // SAFETY: deleting the timer `arm` made; after this no new expiry is delivered.
        unsafe { libc::timer_delete(self.timer) };
        TARGET.store(-1, Ordering::SeqCst);
        drop(self.pidfd);
        FIRED.swap(false, Ordering::SeqCst)
    }
}
