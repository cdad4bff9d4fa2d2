//! A served systrap sandbox's process tree: the same platform-neutral machinery as kvm's
//! (`vmm::process`), not a copy of it.
//!
//! - The scheduler's slots (`guestos::sched`): which guest process is which host process and in
//!   which process group; kill of any process of the sandbox (a sibling, a grandchild, pid 1),
//!   `kill(0|-pgid|-1, ..)`, setpgid/setsid and `tgkill` go through them and the roster's locks
//!   (`guestos::signal`), as on kvm. The host process a signal is sent to is the guest process's
//!   VMM (the carrier signal, `signal::host`), which takes it in at the guest's next trap or in a
//!   blocking call's next slice, as it already did for a parent and its child.
//! - The process table (`guestos::proctab`): each VMM publishes its guest's facts, so
//!   `/proc/<pid>/{stat,status,cmdline,comm,environ,cwd,exe}` and the `/proc` listing show every
//!   process of the sandbox and nothing of the host's (procps `ps`, `pgrep`, psutil).
//! - Lifetimes: an orphan (its parent guest process ended) is adopted by the sandbox's first
//!   process, as on kvm (`process::become_guest_child`), instead of dying with its parent.
//! - The process limit: at most `process::MAX_PROCESSES` (or RLIMIT_NPROC) live processes.
//!
//! Not here: replay's turn-taking (the run token, `sched::gate`): systrap processes run in
//! parallel in replay mode too, so what a tree of processes prints in a seeded exec may depend on
//! the host's scheduling (docs/systrap.md).

use crate::guestos::signal::host;
use crate::guestos::{proctab, sched, Errno, GuestOs, EAGAIN};
use crate::platform::Memory;

/// This VMM is the top of a sandbox's tree (its first process, or a clone of a sandbox): a
/// scheduler region and a process table of its own, with the first process in both.
pub(super) fn new_tree(os: &GuestOs, mem: &Memory) {
    sched::new_tree(os.proc.pid);
    crate::trace::mark("tree.sched");
    proctab::new_tree();
    crate::trace::mark("tree.proctab");
    proctab::refresh(os, mem);
}

/// What a guest fork takes from the parent to the child (see [`before_fork`]).
pub(super) struct Forking {
    pub generation: u32,
}

/// Before the host fork of guest process `pid`: count it (EAGAIN beyond the sandbox's limit),
/// make its slot, make sure its parent-death signal is handled in the child.
pub(super) fn before_fork(os: &GuestOs, pid: i32) -> Result<Forking, Errno> {
    if host::stale() {
        return Err(EAGAIN); // a reset ended this process's world
    }
    let nproc = os.proc.rlimits.get(6).map_or(u64::MAX, |l| l.cur);
    if !host::add_process(nproc.min(crate::vmm::process::MAX_PROCESSES as u64) as u32) {
        return Err(EAGAIN);
    }
    crate::vmm::process::install_reaper();
    sched::before_fork(pid);
    Ok(Forking { generation: host::my_generation() })
}

/// The host fork of guest process `pid` failed: it never was.
pub(super) fn fork_failed(pid: i32) {
    host::process_gone();
    sched::killed(pid);
}

/// In the child VMM of a guest fork: become guest process `pid` of the tree (its slot, its roster
/// lock, its parent-death signal; the controller's descriptors are not its own).
pub(super) fn child_started(pid: i32, parent_host: i32, f: &Forking) {
    crate::vmm::process::become_guest_child(pid, parent_host, f.generation);
}

/// Publish the child's facts once its state is its own (pid, parent, start time).
pub(super) fn publish(os: &GuestOs, mem: &Memory) {
    proctab::refresh(os, mem);
}
