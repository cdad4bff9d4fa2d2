//! A guest process's state ([`Proc`]) and the calls on its place in the process tree: pids,
//! process groups and sessions, umask, prctl.
//!
//! [`Proc`] is what every other syscall module reads and sets: identity ([`super::identity`]),
//! limits ([`super::limits`]), signal dispositions, mask and alternate stack
//! ([`super::signal_state`]), the CRNG ([`super::random`]) and the clocks ([`super::clock`]). Most of
//! these calls are bookkeeping: they store what the guest sets and hand it back. Delivering signals,
//! kill and waiting for children are in [`super::signal`], fork and execve in `vmm::process`. With
//! threads (see [`super::thread`]), the per-thread fields of [`Proc`] (`sigmask`, `altstack`,
//! `clear_child_tid`, `robust_list`, `comm`, `sleep`) are the calling thread's: the thread
//! scheduler swaps them with the vCPU's registers. gettid, set_tid_address, sched_yield and futex
//! are in [`super::thread`] and [`super::futex`]; the answers here are a single-threaded process's.

use serde::{Deserialize, Serialize};

use super::clock::{monotonic_ns, Clocks, PendingSleep};
use super::crng::Crng;
use super::limits::{Rlimit, RLIMIT_NOFILE, RLIMIT_STACK, RLIM_INFINITY, RLIM_NLIMITS};
use super::signal_state::{AltStack, SigAction, NSIG, SS_DISABLE};
use super::{Ctx, GuestOs, SysResult, EINVAL, EPERM, ESRCH};

/// Process identity and per-process settings.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Proc {
    /// The guest's current directory (a normalised guest path).
    pub cwd: String,
    /// The running program's guest path (what /proc/self/exe names).
    pub exe: String,
    /// The thread name (PR_SET_NAME), NUL padded.
    pub comm: [u8; 16],
    pub pid: i32,
    pub ppid: i32,
    pub pgid: i32,
    pub sid: i32,
    /// Real, effective, saved and file-system user ids; the same for groups.
    pub uid: [u32; 4],
    pub gid: [u32; 4],
    pub groups: Vec<u32>,
    pub umask: u32,
    pub rlimits: Vec<Rlimit>,
    /// Dispositions of signals 1..=64 (index 0 is signal 1).
    pub sigactions: Vec<SigAction>,
    pub sigmask: u64,
    pub altstack: AltStack,
    /// set_tid_address's pointer and set_robust_list's list.
    pub clear_child_tid: u64,
    pub robust_list: (u64, u64),
    pub pdeathsig: i32,
    pub dumpable: u64,
    pub no_new_privs: bool,
    /// CLOCK_MONOTONIC nanoseconds when the process started (uptime, times).
    pub start_ns: u64,
    /// The sandbox's next guest pid when this state was captured (see `signal::host::alloc_pid`).
    #[serde(default = "first_child_pid")]
    pub next_pid: i32,
    /// The nice value (-20..=19), bookkeeping only (see setpriority).
    #[serde(default)]
    pub nice: i32,
    /// Where execve laid out the command line and the environment in the initial stack: the
    /// argv strings are [0, 1), the envp strings [1, 2) (what /proc/<pid>/cmdline and environ
    /// read, as Linux's arg_start..env_end); zeros before any execve.
    #[serde(default)]
    pub args_area: [u64; 3],
    /// When this process started (a fork), on the guest's CLOCK_MONOTONIC; 0: `start_ns`, the
    /// sandbox's first process.
    #[serde(default)]
    pub started_ns: u64,
    pub sleep: Option<PendingSleep>,
    /// The sandbox CRNG: every random byte the guest gets. A guest fork gives the child
    /// `crng.fork_child()` (see `vmm::process`), a sandbox clone calls [`super::random::diverge`].
    pub crng: Crng,
    /// What the guest's clocks show: the host's, or virtual time in replay mode.
    pub clocks: Clocks,
    /// How many CPUs the guest sees, and the affinity mask sched_setaffinity left (bit i: CPU i,
    /// within the first `cpus`); see [`super::cpu`]. Every thread still runs on the one vCPU.
    pub cpus: u32,
    pub affinity: u64,
    /// alarm, the itimers and POSIX timers (see [`super::timer`]).
    #[serde(default)]
    pub timers: super::timer::Timers,
}

fn first_child_pid() -> i32 {
    2
}

impl Default for Proc {
    fn default() -> Self {
        let inf = Rlimit { cur: RLIM_INFINITY, max: RLIM_INFINITY };
        let mut rlimits = vec![inf; RLIM_NLIMITS];
        rlimits[RLIMIT_STACK] = Rlimit { cur: 8 << 20, max: RLIM_INFINITY };
        rlimits[4] = Rlimit { cur: 0, max: RLIM_INFINITY }; // CORE
        rlimits[6] = Rlimit { cur: 4096, max: 4096 }; // NPROC
        rlimits[RLIMIT_NOFILE] = Rlimit { cur: 1024, max: 4096 };
        rlimits[8] = Rlimit { cur: 8 << 20, max: 8 << 20 }; // MEMLOCK
        rlimits[11] = Rlimit { cur: 4096, max: 4096 }; // SIGPENDING
        rlimits[12] = Rlimit { cur: 819_200, max: 819_200 }; // MSGQUEUE
        rlimits[13] = Rlimit { cur: 0, max: 0 }; // NICE
        rlimits[14] = Rlimit { cur: 0, max: 0 }; // RTPRIO
        Proc {
            cwd: "/".into(),
            exe: String::new(),
            comm: [0; 16],
            pid: 1,
            ppid: 0,
            pgid: 1,
            sid: 1,
            uid: [0; 4],
            gid: [0; 4],
            groups: Vec::new(),
            umask: 0o022,
            rlimits,
            sigactions: vec![SigAction::default(); NSIG],
            sigmask: 0,
            altstack: AltStack { sp: 0, flags: SS_DISABLE, size: 0 },
            clear_child_tid: 0,
            robust_list: (0, 0),
            pdeathsig: 0,
            dumpable: 1,
            no_new_privs: false,
            start_ns: monotonic_ns(),
            next_pid: first_child_pid(),
            nice: 0,
            args_area: [0; 3],
            started_ns: 0,
            sleep: None,
            crng: Crng::from_host_entropy(),
            clocks: Clocks::default(),
            cpus: 1,
            affinity: 1,
            timers: Default::default(),
        }
    }
}

impl Proc {
    /// A resource limit (RLIMIT_*); unknown resources read as unlimited.
    pub fn rlimit(&self, resource: usize) -> Rlimit {
        self.rlimits.get(resource).copied().unwrap_or(Rlimit { cur: RLIM_INFINITY, max: RLIM_INFINITY })
    }

    /// When this process started, on the guest's CLOCK_MONOTONIC (ns).
    pub fn started(&self) -> u64 {
        if self.started_ns != 0 {
            self.started_ns
        } else {
            self.start_ns
        }
    }

    /// The process's name as /proc shows it (`comm`): the thread name, else the program's file
    /// name (at most 15 bytes).
    pub fn comm_name(&self) -> String {
        let n = self.comm.iter().position(|&b| b == 0).unwrap_or(self.comm.len());
        if n > 0 {
            return String::from_utf8_lossy(&self.comm[..n]).into_owned();
        }
        let name = self.exe.rsplit('/').next().filter(|e| !e.is_empty()).unwrap_or("guest");
        name.chars().take(15).collect()
    }

    /// Set the thread name from a program path (its last component, at most 15 bytes).
    pub fn set_comm_from_path(&mut self, path: &[u8]) {
        let base = path.rsplit(|&b| b == b'/').next().unwrap_or(path);
        self.comm = [0; 16];
        let n = base.len().min(15);
        self.comm[..n].copy_from_slice(&base[..n]);
    }
}

pub const SYS_GETPID: u64 = 39;
pub const SYS_GETPPID: u64 = 110;
pub const SYS_GETPGRP: u64 = 111;
pub const SYS_SETSID: u64 = 112;
pub const SYS_SETPGID: u64 = 109;
pub const SYS_GETPGID: u64 = 121;
pub const SYS_GETSID: u64 = 124;
pub const SYS_UMASK: u64 = 95;
pub const SYS_PRCTL: u64 = 157;
pub const SYS_GETTID: u64 = 186;

/// Whether `pid` names this process (0 means "the caller").
pub(super) fn is_self(proc: &Proc, pid: u64) -> bool {
    let pid = pid as i32;
    pid == 0 || pid == proc.pid
}

/// Handle a call on the process's place in the process tree (pids, groups, sessions), umask or prctl; `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_GETPID | SYS_GETTID => Ok(p.pid as u64),
        SYS_GETPPID => Ok(p.ppid as u64),
        SYS_GETPGRP => Ok(p.pgid as u64),
        // Another process's group: the scheduler's roster, whose slot the parent makes (with the
        // group) before its fork returns and which setpgid and setsid keep up; the process table
        // has an entry only once the child has run, so a parent asking right after its fork got
        // ESRCH when the child's host process had not been scheduled yet. Its session: what it
        // published in the process table.
        SYS_GETPGID => {
            if is_self(p, a[0]) {
                Ok(p.pgid as u64)
            } else {
                let pid = a[0] as i32;
                crate::guestos::sched::processes()
                    .into_iter()
                    .find(|q| q.pid == pid)
                    .map(|q| q.pgid as u64)
                    .or_else(|| crate::guestos::proctab::read(pid).map(|f| f.pgid as u64))
                    .ok_or(ESRCH)
            }
        }
        SYS_GETSID => {
            if is_self(p, a[0]) {
                Ok(p.sid as u64)
            } else {
                crate::guestos::proctab::read(a[0] as i32).map(|f| f.sid as u64).ok_or(ESRCH)
            }
        }
        SYS_SETPGID => {
            let pgid = a[1] as i32;
            if !is_self(p, a[0]) {
                Err(ESRCH)
            } else if pgid < 0 {
                Err(EINVAL)
            } else if pgid == p.pgid || (pgid == 0 && p.pgid == p.pid) {
                Ok(0) // no change
            } else if pgid == 0 || pgid == p.pid {
                // Lead a group of its own (a forked process), unless it leads a session.
                if p.sid == p.pid {
                    Err(EPERM)
                } else {
                    p.pgid = p.pid;
                    crate::guestos::sched::set_pgid(p.pgid);
                    Ok(0)
                }
            } else {
                // Process groups of other processes are not tracked: nothing to join.
                Err(EPERM)
            }
        }
        // A process group leader cannot start a session (pid 1 leads its group).
        SYS_SETSID => {
            if p.pgid == p.pid {
                Err(EPERM)
            } else {
                p.sid = p.pid;
                p.pgid = p.pid;
                crate::guestos::sched::set_pgid(p.pgid);
                Ok(p.pid as u64)
            }
        }
        SYS_PRCTL => prctl(p, ctx, a),
        SYS_UMASK => {
            let old = p.umask;
            p.umask = (a[0] as u32) & 0o777;
            Ok(old as u64)
        }
        _ => return None,
    };
    Some(r)
}

fn prctl(p: &mut Proc, ctx: &mut Ctx, a: [u64; 6]) -> SysResult {
    const PR_SET_PDEATHSIG: u64 = 1;
    const PR_GET_PDEATHSIG: u64 = 2;
    const PR_GET_DUMPABLE: u64 = 3;
    const PR_SET_DUMPABLE: u64 = 4;
    const PR_SET_NAME: u64 = 15;
    const PR_GET_NAME: u64 = 16;
    const PR_SET_NO_NEW_PRIVS: u64 = 38;
    const PR_GET_NO_NEW_PRIVS: u64 = 39;
    match a[0] {
        PR_SET_PDEATHSIG => {
            if a[1] > NSIG as u64 {
                return Err(EINVAL);
            }
            p.pdeathsig = a[1] as i32;
            Ok(0)
        }
        PR_GET_PDEATHSIG => ctx.write(a[1], &p.pdeathsig.to_le_bytes()).map(|_| 0),
        PR_GET_DUMPABLE => Ok(p.dumpable),
        PR_SET_DUMPABLE => {
            if a[1] > 1 {
                return Err(EINVAL);
            }
            p.dumpable = a[1];
            Ok(0)
        }
        PR_SET_NAME => {
            // Like strncpy_from_user(comm, name, 16): at most 15 bytes, and never past a NUL.
            let mut name = [0u8; 16];
            for (i, slot) in name.iter_mut().take(15).enumerate() {
                let mut c = [0u8; 1];
                ctx.read(a[1].wrapping_add(i as u64), &mut c)?;
                if c[0] == 0 {
                    break;
                }
                *slot = c[0];
            }
            p.comm = name;
            Ok(0)
        }
        PR_GET_NAME => {
            let comm = p.comm;
            ctx.write(a[1], &comm).map(|_| 0)
        }
        PR_SET_NO_NEW_PRIVS => {
            if a[1] != 1 || a[2] != 0 || a[3] != 0 || a[4] != 0 {
                return Err(EINVAL);
            }
            p.no_new_privs = true;
            Ok(0)
        }
        PR_GET_NO_NEW_PRIVS => Ok(p.no_new_privs as u64),
        _ => Err(EINVAL),
    }
}

#[cfg(test)]
mod tests;
