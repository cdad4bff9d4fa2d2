//! The trees the engine serves itself: `/dev` and `/proc`. The host's own `/dev` and `/proc` are
//! never opened: every node here is made up from the guest's state.
//!
//! `/dev`: null, zero, random, urandom, stdin/stdout/stderr and fd (symlinks into /proc/self/fd),
//! ptmx and pts/ (pseudo-terminals: host ones, see `pty`).
//! `/proc`: self (exe, cwd, root, fd/, maps, status, stat, statm, cmdline, environ, mounts),
//! thread-self, cpuinfo, meminfo, stat, uptime, loadavg, mounts, and a directory per process of
//! the sandbox (never the host's): `/proc/<pid>` of the caller is its `/proc/self`; another
//! process's has stat, status, statm, cmdline, comm, environ, cwd, exe, root and fd/ (empty: its
//! descriptors are its own), from what it published in the sandbox's process table
//! (`guestos::proctab`). `/proc/self` reads as a symlink to the caller's pid (lstat, readlink).
//! `/sys`: devices/system/cpu only, with online, possible, present and a cpuN directory per CPU,
//! which with /proc/cpuinfo and /proc/stat show the sandbox's CPU count (see `guestos::cpu`).
//!
//! The symlinks of these trees are named in `vfs::virtual_link` (the walk follows them); the
//! `/proc/self/fd/N` links are "magic": following one gives the open file itself.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::{Kind, OpenFile};
use crate::guestos::proctab::{self, Facts};
use crate::guestos::vfs::{self, Lookup};
use crate::guestos::{Ctx, Errno, GuestOs, EACCES, EEXIST, EINVAL, EISDIR, ENOENT, ENOTDIR};

/// What a path in these trees names.
pub enum Node {
    Dir,
    /// A read-only text file generated when opened.
    File,
    Null,
    Zero,
    Random,
    /// A symlink (followed by the walk when the lookup follows).
    Link(String),
    /// `/proc/self/fd/N`: the guest's open fd N.
    Fd(i32),
    /// `/dev/ptmx`.
    Ptmx,
    /// `/dev/pts/N`, a pty this process holds.
    Pty(u32),
}

const DT_DIR: u8 = 4;
const DT_CHR: u8 = 2;
const DT_REG: u8 = 8;
const DT_LNK: u8 = 10;

const DEV_FILES: [(&str, u8); 10] = [
    ("null", DT_CHR),
    ("ptmx", DT_CHR),
    ("pts", DT_DIR),
    ("zero", DT_CHR),
    ("random", DT_CHR),
    ("urandom", DT_CHR),
    ("stdin", DT_LNK),
    ("stdout", DT_LNK),
    ("stderr", DT_LNK),
    ("fd", DT_LNK),
];
const PROC_FILES: [(&str, u8); 8] = [
    ("self", DT_LNK),
    ("thread-self", DT_LNK),
    ("cpuinfo", DT_REG),
    ("meminfo", DT_REG),
    ("stat", DT_REG),
    ("uptime", DT_REG),
    ("loadavg", DT_REG),
    ("mounts", DT_LNK),
];
/// The entries of another process's directory, /proc/<pid>.
const PID_FILES: [(&str, u8); 10] = [
    ("stat", DT_REG),
    ("status", DT_REG),
    ("statm", DT_REG),
    ("cmdline", DT_REG),
    ("comm", DT_REG),
    ("environ", DT_REG),
    ("cwd", DT_LNK),
    ("exe", DT_LNK),
    ("root", DT_LNK),
    ("fd", DT_DIR),
];
const SELF_FILES: [(&str, u8); 13] = [
    ("exe", DT_LNK),
    ("task", DT_DIR),
    ("comm", DT_REG),
    ("cwd", DT_LNK),
    ("root", DT_LNK),
    ("fd", DT_DIR),
    ("maps", DT_REG),
    ("status", DT_REG),
    ("stat", DT_REG),
    ("statm", DT_REG),
    ("cmdline", DT_REG),
    ("environ", DT_REG),
    ("mounts", DT_REG),
];

/// The guest's current directory.
pub fn cwd(os: &GuestOs) -> &str {
    if os.proc.cwd.is_empty() {
        "/"
    } else {
        &os.proc.cwd
    }
}

/// The guest path of the running program (the target of `/proc/self/exe`), once the program
/// loader has recorded it.
pub fn exe(os: &GuestOs) -> Option<&str> {
    Some(os.proc.exe.as_str()).filter(|e| !e.is_empty())
}

/// The guest's pid as its /proc files show it.
fn pid(os: &GuestOs) -> i32 {
    os.proc.pid
}

fn fd_number(s: &str) -> Option<i32> {
    if s.is_empty() || s.len() > 10 || (s.len() > 1 && s.starts_with('0')) || !s.bytes().all(|b| b.is_ascii_digit()) {
        return None;
    }
    s.parse().ok()
}

/// `/proc/<pid>...` of the caller's own pid as `/proc/self...`; other paths as they are.
fn own_path<'p>(os: &GuestOs, path: &'p str) -> std::borrow::Cow<'p, str> {
    match proc_pid(path) {
        Some((n, rest)) if n == pid(os) => format!("/proc/self{rest}").into(),
        _ => path.into(),
    }
}

/// The pid and the rest of a `/proc/<pid>[/...]` path.
fn proc_pid(path: &str) -> Option<(i32, &str)> {
    let rest = path.strip_prefix("/proc/")?;
    let end = rest.find('/').unwrap_or(rest.len());
    Some((fd_number(&rest[..end])?, &rest[end..]))
}

/// Another live process of the sandbox named by a `/proc/<pid>[/...]` path: its facts and the
/// rest of the path.
fn other_process<'p>(os: &GuestOs, path: &'p str) -> Option<(Facts, &'p str)> {
    let (n, rest) = proc_pid(path)?;
    if n == pid(os) {
        return None;
    }
    Some((proctab::read(n)?, rest))
}

/// What `rest` names in another process's directory.
fn pid_node(f: &Facts, rest: &str) -> Option<Node> {
    Some(match rest {
        "" | "/fd" => Node::Dir,
        "/cwd" => Node::Link(f.cwd.clone()),
        "/root" => Node::Link("/".into()),
        "/exe" if !f.exe.is_empty() => Node::Link(f.exe.clone()),
        r if PID_FILES.iter().any(|(n, t)| *t == DT_REG && r.strip_prefix('/') == Some(*n)) => Node::File,
        _ => return None,
    })
}

/// What `path` (a normalised guest path in these trees) names, if anything.
pub fn lookup(os: &GuestOs, path: &str) -> Option<Node> {
    let path = &*own_path(os, path);
    if let Some(t) = vfs::virtual_link(path, cwd(os), exe(os)) {
        return Some(Node::Link(t));
    }
    if let Some((f, rest)) = other_process(os, path) {
        return pid_node(&f, rest);
    }
    let node = match path {
        "/dev" | "/dev/pts" | "/proc" | "/proc/self" | "/proc/self/fd" => Node::Dir,
        "/dev/null" => Node::Null,
        "/dev/ptmx" => Node::Ptmx,
        "/dev/zero" => Node::Zero,
        "/dev/random" | "/dev/urandom" => Node::Random,
        "/proc/cpuinfo" | "/proc/meminfo" | "/proc/stat" | "/proc/uptime" | "/proc/loadavg" => Node::File,
        "/sys" | "/sys/devices" | "/sys/devices/system" | SYS_CPU => Node::Dir,
        p => {
            if let Some(name) = p.strip_prefix("/sys/devices/system/cpu/") {
                return sys_cpu_node(os, name);
            }
            if let Some(name) = p.strip_prefix("/dev/pts/") {
                return super::pty::lookup(os, name).map(Node::Pty);
            }
            if let Some(name) = p.strip_prefix("/proc/self/") {
                if SELF_FILES.iter().any(|(n, t)| *n == name && *t == DT_REG) {
                    return Some(Node::File);
                }
            }
            if let Some(rest) = p.strip_prefix("/proc/self/task") {
                return task_node(os, rest);
            }
            let n = fd_number(p.strip_prefix("/proc/self/fd/")?)?;
            os.files.get(n).ok()?;
            Node::Fd(n)
        }
    };
    Some(node)
}

/// The entries of directory `path` (with "." and ".."), or None if it is not one.
pub fn list(os: &GuestOs, path: &str) -> Option<Vec<(String, u8)>> {
    let path = &*own_path(os, path);
    let mut v: Vec<(String, u8)> = vec![(".".into(), DT_DIR), ("..".into(), DT_DIR)];
    if let Some((f, rest)) = other_process(os, path) {
        match rest {
            "" => v.extend(PID_FILES.iter().filter(|(n, _)| *n != "exe" || !f.exe.is_empty()).map(|(n, t)| (n.to_string(), *t))),
            "/fd" => {}
            _ => return None,
        }
        return Some(v);
    }
    let fixed: &[(&str, u8)] = match path {
        "/dev" => &DEV_FILES,
        "/proc" => {
            v.extend(PROC_FILES.iter().map(|(n, t)| (n.to_string(), *t)));
            v.extend(proctab::pids(pid(os)).into_iter().map(|p| (p.to_string(), DT_DIR)));
            return Some(v);
        }
        "/proc/self" => &SELF_FILES,
        "/proc/self/fd" => {
            v.extend(os.files.open_fds().map(|fd| (fd.to_string(), DT_LNK)));
            return Some(v);
        }
        "/dev/pts" => {
            v.extend(super::pty::held_numbers(os).into_iter().map(|n| (n.to_string(), DT_CHR)));
            return Some(v);
        }
        "/proc/self/task" => {
            v.extend(os.threads.list.iter().map(|t| (t.tid_in(pid(os)).to_string(), DT_DIR)));
            return Some(v);
        }
        p if p.starts_with("/proc/self/task/") && task_of(os, p).is_some() => &TASK_FILES,
        "/sys" | "/sys/devices" | "/sys/devices/system" => {
            let name = match path {
                "/sys" => "devices",
                "/sys/devices" => "system",
                _ => "cpu",
            };
            v.push((name.to_string(), DT_DIR));
            return Some(v);
        }
        SYS_CPU => {
            v.extend(SYS_CPU_FILES.iter().map(|n| (n.to_string(), DT_REG)));
            v.extend((0..os.proc.cpus).map(|i| (format!("cpu{i}"), DT_DIR)));
            return Some(v);
        }
        p if p.strip_prefix("/sys/devices/system/cpu/").is_some_and(|n| matches!(sys_cpu_node(os, n), Some(Node::Dir))) => &[],
        _ => return None,
    };
    v.extend(fixed.iter().filter(|(n, _)| !(path == "/proc/self" && *n == "exe" && exe(os).is_none())).map(|(n, t)| (n.to_string(), *t)));
    // Mounts inside the tree (a sandbox's /dev/shm) are its entries too.
    let prefix = format!("{path}/");
    v.extend(
        os.vfs.mounts.iter().filter_map(|m| m.at.strip_prefix(&prefix)).filter(|n| !n.contains('/')).map(|n| (n.to_string(), DT_DIR)),
    );
    Some(v)
}

/// Generated contents of file node `path`.
fn content(os: &GuestOs, ctx: &Ctx, path: &str) -> Vec<u8> {
    let path = &*own_path(os, path);
    if let Some((f, rest)) = other_process(os, path) {
        return pid_content(&f, rest);
    }
    let s = match path {
        "/proc/cpuinfo" => cpuinfo(os.proc.cpus),
        "/proc/meminfo" => meminfo(os, ctx),
        "/proc/stat" => proc_stat(os),
        "/proc/uptime" => {
            let up = crate::guestos::clock::mono_peek(&os.proc) / 10_000_000;
            format!("{}.{:02} 0.00\n", up / 100, up % 100)
        }
        "/proc/loadavg" => format!("0.00 0.00 0.00 1/{} {}\n", proctab::pids(pid(os)).len(), crate::guestos::signal::host::next_pid().map_or(pid(os), |n| n - 1)),
        p if p.starts_with("/sys/devices/system/cpu/") => format!("{}\n", crate::guestos::cpu::cpu_list(os.proc.cpus)),
        "/proc/self/status" => status(os) + &vm_lines(&own_facts(os, ctx)),
        "/proc/self/stat" => stat_line(&own_facts(os, ctx), 'R', os.proc.args_area),
        "/proc/self/statm" => statm(&own_facts(os, ctx)),
        "/proc/self/cmdline" => return proctab::args_text(os, &ctx.memory, 0, usize::MAX),
        "/proc/self/environ" => return proctab::args_text(os, &ctx.memory, 1, usize::MAX),
        "/proc/self/mounts" => mounts(os),
        "/proc/self/maps" => return maps(os),
        "/proc/self/comm" => format!("{}\n", comm(os)),
        p if p.starts_with("/proc/self/task/") => return task_content(os, p),
        _ => String::new(),
    };
    s.into_bytes()
}

/// /proc/cpuinfo for `n` CPUs: one block per CPU, all of one package.
fn cpuinfo(n: u32) -> String {
    let mut s = String::new();
    for i in 0..n {
        s.push_str(&format!(
            "processor\t: {i}\nvendor_id\t: GenuineIntel\ncpu family\t: 6\nmodel\t\t: 85\n\
model name\t: collimate virtual CPU\nstepping\t: 0\ncpu MHz\t\t: 2000.000\ncache size\t: 16384 KB\n\
physical id\t: 0\nsiblings\t: {n}\ncore id\t\t: {i}\ncpu cores\t: {n}\napicid\t\t: {i}\nfpu\t\t: yes\n\
fpu_exception\t: yes\ncpuid level\t: 13\nwp\t\t: yes\n\
flags\t\t: fpu vme de pse tsc msr pae mce cx8 apic sep mtrr pge mca cmov pat pse36 clflush mmx fxsr \
sse sse2 syscall nx lm constant_tsc nopl pni pclmulqdq ssse3 cx16 sse4_1 sse4_2 popcnt aes xsave avx\n\
bogomips\t: 4000.00\nclflush size\t: 64\ncache_alignment\t: 64\n\
address sizes\t: 46 bits physical, 48 bits virtual\npower management:\n\n"
        ));
    }
    s
}

/// /proc/stat for the sandbox's CPUs (glibc counts its cpuN lines when /sys is missing). Its boot
/// time is when the guest's CLOCK_MONOTONIC was 0, on its CLOCK_REALTIME: a process's start time
/// (`btime` plus its stat's starttime) is then on the guest's own clock.
fn proc_stat(os: &GuestOs) -> String {
    let mut s = String::from("cpu  0 0 0 0 0 0 0 0 0 0\n");
    for i in 0..os.proc.cpus {
        s.push_str(&format!("cpu{i} 0 0 0 0 0 0 0 0 0 0\n"));
    }
    let clock = crate::guestos::clock::real_peek(&os.proc).saturating_sub(crate::guestos::clock::mono_peek(&os.proc));
    let n = proctab::pids(pid(os)).len();
    s.push_str(&format!(
        "intr 0\nctxt 0\nbtime {}\nprocesses {n}\nprocs_running 1\nprocs_blocked 0\nsoftirq 0 0 0 0 0 0 0 0 0 0 0\n",
        clock / 1_000_000_000
    ));
    s
}

/// This process's facts, as the process table would show them (see `proctab::own_facts`).
fn own_facts(os: &GuestOs, ctx: &Ctx) -> Facts {
    proctab::own_facts(os, &ctx.memory, false)
}

/// Clock ticks (USER_HZ, 100 a second) of `ns` nanoseconds.
fn ticks(ns: u64) -> u64 {
    ns / 10_000_000
}

/// A /proc/<pid>/stat line (Linux's 52 fields). CPU times read 0; `args` is where the command
/// line and environment are in the process's memory (0s for another process).
fn stat_line(f: &Facts, state: char, args: [u64; 3]) -> String {
    let [arg_start, arg_end, env_end] = args;
    format!(
        "{} ({}) {state} {} {} {} 0 -1 4194304 0 0 0 0 0 0 0 0 {} {} {} 0 {} {} {} 18446744073709551615 1 1 0 0 0 0 0 0 0 0 0 0 17 0 0 0 0 0 0 0 0 0 {arg_start} {arg_end} {arg_end} {env_end} 0\n",
        f.pid,
        f.comm,
        f.ppid,
        f.pgid,
        f.sid,
        20 + f.nice,
        f.nice,
        f.threads.max(1),
        ticks(f.started_ns),
        f.vsize,
        f.rss / 4096,
    )
}

/// /proc/<pid>/statm: sizes in pages (size, resident, shared, text, lib, data, dirty).
fn statm(f: &Facts) -> String {
    format!("{} {} 0 0 0 0 0\n", f.vsize / 4096, f.rss / 4096)
}

/// The memory lines of a status file.
fn vm_lines(f: &Facts) -> String {
    format!("VmPeak:\t{0:>8} kB\nVmSize:\t{0:>8} kB\nVmHWM:\t{1:>8} kB\nVmRSS:\t{1:>8} kB\n", f.vsize / 1024, f.rss / 1024)
}

/// A file of another process's directory.
fn pid_content(f: &Facts, rest: &str) -> Vec<u8> {
    let s = match rest {
        "/stat" => stat_line(f, 'S', [0; 3]),
        "/statm" => statm(f),
        "/comm" => format!("{}\n", f.comm),
        "/cmdline" => return f.cmdline.clone(),
        "/environ" => return f.environ.clone(),
        "/status" => {
            let (u, g) = (f.uid, f.gid);
            format!(
                "Name:\t{}\nUmask:\t{:04o}\nState:\tS (sleeping)\nTgid:\t{p}\nNgid:\t0\nPid:\t{p}\nPPid:\t{}\nTracerPid:\t0\n\
Uid:\t{}\t{}\t{}\t{}\nGid:\t{}\t{}\t{}\t{}\nFDSize:\t64\nGroups:\t\n{}Threads:\t{}\n\
SigQ:\t0/0\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\nSigBlk:\t0000000000000000\n\
SigIgn:\t0000000000000000\nSigCgt:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t0\n\
voluntary_ctxt_switches:\t0\nnonvoluntary_ctxt_switches:\t0\n",
                f.comm,
                f.umask,
                f.ppid,
                u[0],
                u[1],
                u[2],
                u[3],
                g[0],
                g[1],
                g[2],
                g[3],
                vm_lines(f),
                f.threads.max(1),
                p = f.pid,
            )
        }
        _ => String::new(),
    };
    s.into_bytes()
}

/// The CPU directory of /sys, and the CPU lists in it (each "0-<n-1>").
const SYS_CPU: &str = "/sys/devices/system/cpu";
const SYS_CPU_FILES: [&str; 3] = ["online", "possible", "present"];

/// What `name` (a path below /sys/devices/system/cpu) names: a CPU list, or an (empty) cpuN
/// directory of a CPU the sandbox has.
fn sys_cpu_node(os: &GuestOs, name: &str) -> Option<Node> {
    if SYS_CPU_FILES.contains(&name) {
        return Some(Node::File);
    }
    let i: u32 = name.strip_prefix("cpu").filter(|d| !d.is_empty() && d.bytes().all(|b| b.is_ascii_digit()))?.parse().ok()?;
    (i < os.proc.cpus && name == format!("cpu{i}")).then_some(Node::Dir)
}

fn meminfo(os: &GuestOs, ctx: &Ctx) -> String {
    let total = ctx.memory.total() / 1024;
    let free = match &ctx.memory {
        crate::platform::Memory::Kvm(k) => k.frames.end.saturating_sub(k.frames.next) / 1024,
        crate::platform::Memory::Host(_) => ctx.memory.free(os.mm.vmas.iter().map(|(s, v)| v.end - s).sum()) / 1024,
    };
    let mut s = String::new();
    for (k, v) in [
        ("MemTotal:", total),
        ("MemFree:", free),
        ("MemAvailable:", free),
        ("Buffers:", 0),
        ("Cached:", 0),
        ("SwapCached:", 0),
        ("SwapTotal:", 0),
        ("SwapFree:", 0),
        ("Shmem:", 0),
    ] {
        s.push_str(&format!("{k:<16}{v:>8} kB\n"));
    }
    s
}

/// The files of a thread's directory, /proc/self/task/<tid>.
const TASK_FILES: [(&str, u8); 3] = [("comm", DT_REG), ("status", DT_REG), ("stat", DT_REG)];

/// The thread a /proc/self/task/<tid>[/...] path names (its index in the thread table).
fn task_of(os: &GuestOs, path: &str) -> Option<usize> {
    let rest = path.strip_prefix("/proc/self/task/")?;
    let tid = fd_number(rest.split('/').next()?)?;
    os.threads.index_of(tid, pid(os))
}

/// What /proc/self/task + `rest` names.
fn task_node(os: &GuestOs, rest: &str) -> Option<Node> {
    if rest.is_empty() {
        return Some(Node::Dir);
    }
    let path = format!("/proc/self/task{rest}");
    task_of(os, &path)?;
    let parts: Vec<&str> = rest.trim_start_matches('/').split('/').collect();
    match parts.as_slice() {
        [_] => Some(Node::Dir),
        [_, f] if TASK_FILES.iter().any(|(n, _)| n == f) => Some(Node::File),
        _ => None,
    }
}

/// The name of thread `i` (the loaded thread's is the process's current `comm`).
fn thread_comm(os: &GuestOs, i: usize) -> String {
    if i == os.threads.cur && os.threads.loaded {
        return comm(os);
    }
    let name = os.threads.list.get(i).map(|t| t.name()).unwrap_or_default();
    if name.is_empty() {
        comm(os)
    } else {
        name
    }
}

fn task_content(os: &GuestOs, path: &str) -> Vec<u8> {
    let Some(i) = task_of(os, path) else { return Vec::new() };
    let tid = os.threads.list[i].tid_in(pid(os));
    let s = match path.rsplit('/').next() {
        Some("comm") => format!("{}\n", thread_comm(os, i)),
        Some("stat") => {
            let p = pid(os);
            format!("{tid} ({}) R {} {p} {p} 0 -1 4194304 0 0 0 0 0 0 0 0 20 0 1 0 0 0 0\n", thread_comm(os, i), os.proc.ppid)
        }
        Some("status") => {
            let s = status(os);
            s.replacen(&format!("Pid:\t{}\n", pid(os)), &format!("Pid:\t{tid}\n"), 1)
                .replacen(&format!("Name:\t{}\n", comm(os)), &format!("Name:\t{}\n", thread_comm(os, i)), 1)
        }
        _ => String::new(),
    };
    s.into_bytes()
}

fn comm(os: &GuestOs) -> String {
    os.proc.comm_name()
}

fn status(os: &GuestOs) -> String {
    use crate::guestos::signal::{SIG_DFL, SIG_IGN};
    let p = pid(os);
    let (u, g) = (os.proc.uid, os.proc.gid);
    // The signal masks as Linux shows them: blocked, ignored and caught (a handler is set).
    let (mut ign, mut cgt) = (0u64, 0u64);
    for (i, a) in os.proc.sigactions.iter().enumerate().take(64) {
        match a.handler {
            SIG_DFL => {}
            SIG_IGN => ign |= 1 << i,
            _ => cgt |= 1 << i,
        }
    }
    let groups: Vec<String> = os.proc.groups.iter().map(|g| g.to_string()).collect();
    format!(
        "Name:\t{}\nUmask:\t{:04o}\nState:\tR (running)\nTgid:\t{p}\nNgid:\t0\nPid:\t{p}\nPPid:\t{}\nTracerPid:\t0\n\
Uid:\t{}\t{}\t{}\t{}\nGid:\t{}\t{}\t{}\t{}\nFDSize:\t{}\nGroups:\t{}\nThreads:\t{}\n\
SigQ:\t0/0\nSigPnd:\t0000000000000000\nShdPnd:\t0000000000000000\nSigBlk:\t{:016x}\n\
SigIgn:\t{ign:016x}\nSigCgt:\t{cgt:016x}\nCapInh:\t0000000000000000\nCapPrm:\t0000000000000000\n\
CapEff:\t0000000000000000\nCapBnd:\t0000000000000000\nCapAmb:\t0000000000000000\nNoNewPrivs:\t1\nSeccomp:\t0\n\
Cpus_allowed:\t{:x}\nCpus_allowed_list:\t{}\nMems_allowed:\t1\nMems_allowed_list:\t0\n\
voluntary_ctxt_switches:\t0\nnonvoluntary_ctxt_switches:\t0\n",
        comm(os),
        os.proc.umask,
        os.proc.ppid,
        u[0],
        u[1],
        u[2],
        u[3],
        g[0],
        g[1],
        g[2],
        g[3],
        os.files.limit,
        groups.join(" "),
        os.threads.list.len(),
        os.proc.sigmask,
        os.proc.affinity,
        crate::guestos::cpu::mask_list(os.proc.affinity),
    )
}

fn mounts(os: &GuestOs) -> String {
    let mut s = String::new();
    for m in os.vfs.mounts.iter().rev() {
        if m.at == "/" && m.writable {
            // A writable root (`crate::overlay`), as a container's.
            s.push_str("overlay / overlay rw,relatime 0 0\n");
        } else if m.at == "/" {
            s.push_str("/dev/root / ext4 ro,relatime 0 0\n");
        } else {
            let mode = if m.writable { "rw" } else { "ro" };
            s.push_str(&format!("tmpfs {} tmpfs {mode},relatime 0 0\n", m.at));
        }
    }
    s.push_str("proc /proc proc rw,nosuid,nodev,noexec,relatime 0 0\ndevtmpfs /dev devtmpfs rw,nosuid 0 0\n");
    s
}

/// `/proc/self/maps`, as the address-space module writes it.
fn maps(os: &GuestOs) -> Vec<u8> {
    vfs::guest_bytes(&os.mm.maps())
}

/// Open `path` (a normalised guest path in these trees) with open(2) `flags`. `follow` tells
/// whether the lookup followed the last component (it did not for O_NOFOLLOW).
pub fn open(os: &GuestOs, ctx: &Ctx, path: &str, flags: i32, follow: bool) -> Result<Arc<OpenFile>, Errno> {
    let Some(node) = lookup(os, path) else {
        return Err(if flags & libc::O_CREAT != 0 { EACCES } else { ENOENT });
    };
    if flags & (libc::O_CREAT | libc::O_EXCL) == libc::O_CREAT | libc::O_EXCL {
        return Err(EEXIST);
    }
    let writes = vfs::open_writes(flags);
    let is_dir = matches!(node, Node::Dir);
    if flags & libc::O_DIRECTORY != 0 && !is_dir && !matches!(node, Node::Fd(_) | Node::Link(_)) {
        return Err(ENOTDIR);
    }
    let status = flags & (libc::O_ACCMODE | libc::O_APPEND | libc::O_NONBLOCK | libc::O_PATH);
    let kind = match node {
        Node::Dir if writes => return Err(EISDIR),
        Node::Dir => Kind::VirtDir(list(os, path).unwrap_or_default()),
        Node::File if writes => return Err(EACCES),
        Node::File => Kind::Data(content(os, ctx, path)),
        Node::Null => Kind::Null,
        Node::Zero => Kind::Zero,
        Node::Random => Kind::Random,
        // Only reached without following (O_NOFOLLOW): open(2) refuses symlinks then.
        Node::Link(_) => return Err(crate::guestos::ELOOP),
        Node::Fd(_) if !follow => return Err(crate::guestos::ELOOP),
        Node::Fd(n) => return reopen(os, n, flags),
        Node::Ptmx => return super::pty::open_master(flags),
        Node::Pty(n) => return super::pty::open_slave(n, flags),
    };
    Ok(Arc::new(OpenFile::new(kind, Some(path.to_string()), status)))
}

/// Opening `/proc/self/fd/N`: Linux opens the file anew (its own offset, `flags`' access mode).
/// Files with a guest path are opened by that path; the others (pipes, memfds, captured output,
/// engine files) share fd N's open file.
fn reopen(os: &GuestOs, n: i32, flags: i32) -> Result<Arc<OpenFile>, Errno> {
    let f = os.files.file(n)?;
    if let (Kind::Host(_), Some(p)) = (&f.kind, &f.path) {
        if !f.stream {
            let r = os.vfs.resolve("/", p.as_bytes(), Lookup::NoFollow, exe(os))?;
            if r.is_virtual() {
                return Err(ENOENT);
            }
            let fd = os.vfs.open_resolved(&r, flags & !(libc::O_CREAT | libc::O_EXCL | libc::O_NOFOLLOW), 0)?;
            return Ok(Arc::new(OpenFile::host(fd, Some(r.path.clone()), !r.writable())));
        }
    }
    Ok(f)
}

/// The target text of `/proc/self/fd/N` for open file `f`.
pub fn describe(f: &OpenFile) -> String {
    if let Some(p) = &f.path {
        return p.clone();
    }
    if let Some(l) = &f.label {
        return l.clone();
    }
    match &f.kind {
        Kind::Capture(k) => format!("pipe:[{k}]"),
        Kind::Agent(_) => "socket:[agent]".to_string(),
        Kind::Host(fd) => {
            // SAFETY: a zeroed stat is valid; fstat fills it.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: a valid fd we own and a valid out-pointer.
            unsafe { libc::fstat(fd.as_raw_fd(), &mut st) };
            match st.st_mode & libc::S_IFMT {
                libc::S_IFIFO => format!("pipe:[{}]", st.st_ino),
                libc::S_IFSOCK => format!("socket:[{}]", st.st_ino),
                _ => "anon_inode:[unknown]".into(),
            }
        }
        _ => "/dev/null".into(),
    }
}

/// readlink(2) of `path` in these trees.
pub fn readlink(os: &GuestOs, path: &str) -> Result<Vec<u8>, Errno> {
    if path == "/proc/self" {
        return Ok(pid(os).to_string().into_bytes());
    }
    match lookup(os, path) {
        Some(Node::Link(t)) => Ok(vfs::guest_bytes(&t)),
        Some(Node::Fd(n)) => Ok(vfs::guest_bytes(&describe(&*os.files.file(n)?))),
        Some(_) => Err(EINVAL),
        None => Err(ENOENT),
    }
}

/// A made-up inode number for an engine node.
fn ino_of(path: &str) -> u64 {
    // FNV-1a: stable across runs and hosts.
    let mut h: u64 = 0xcbf2_9ce4_8422_2325;
    for b in path.bytes() {
        h = (h ^ b as u64).wrapping_mul(0x100_0000_01b3);
    }
    h & 0x7fff_ffff
}

/// A stat of an engine-made object.
pub fn synth_stat(mode: u32, ino: u64, rdev: u64, size: i64, dev: u64) -> libc::stat {
    // SAFETY: libc::stat is plain data; all-zero is valid.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    st.st_mode = mode;
    st.st_ino = ino;
    st.st_rdev = rdev;
    st.st_size = size;
    st.st_dev = dev;
    st.st_nlink = if mode & libc::S_IFMT == libc::S_IFDIR { 2 } else { 1 };
    st.st_blksize = 4096;
    st
}

fn tree_dev(path: &str) -> u64 {
    if vfs::is_under(path, "/dev") {
        libc::makedev(0, 5)
    } else {
        libc::makedev(0, 22)
    }
}

/// stat(2) (`follow`) or lstat(2) of `path` in these trees.
pub fn stat(os: &GuestOs, path: &str, follow: bool) -> Result<libc::stat, Errno> {
    let node = lookup(os, path).ok_or(ENOENT)?;
    let (ino, dev) = (ino_of(path), tree_dev(path));
    if path == "/proc/self" && !follow {
        return Ok(synth_stat(libc::S_IFLNK | 0o777, ino, 0, pid(os).to_string().len() as i64, dev));
    }
    let synthetic = matches!(node, Node::Dir | Node::File | Node::Link(_));
    let mut st = node_stat(os, path, node, follow, ino, dev)?;
    // A process's directory and files are its owner's (ps reads a process's user from them).
    let owner = match proc_pid(&own_path(os, path)) {
        Some((n, _)) if n == pid(os) => Some((os.proc.uid[1], os.proc.gid[1])),
        Some((n, _)) => proctab::read(n).map(|f| (f.uid[1], f.gid[1])),
        None => vfs::is_under(path, "/proc/self").then_some((os.proc.uid[1], os.proc.gid[1])),
    };
    if let Some((u, g)) = owner.filter(|_| synthetic) {
        st.st_uid = u;
        st.st_gid = g;
    }
    Ok(st)
}

fn node_stat(os: &GuestOs, path: &str, node: Node, follow: bool, ino: u64, dev: u64) -> Result<libc::stat, Errno> {
    let chr = |minor| synth_stat(libc::S_IFCHR | 0o666, ino, libc::makedev(1, minor), 0, dev);
    Ok(match node {
        Node::Dir => synth_stat(libc::S_IFDIR | 0o555, ino, 0, 0, dev),
        Node::File => synth_stat(libc::S_IFREG | 0o444, ino, 0, 0, dev),
        Node::Null => chr(3),
        Node::Zero => chr(5),
        Node::Random => chr(if path.ends_with("urandom") { 9 } else { 8 }),
        Node::Link(t) => synth_stat(libc::S_IFLNK | 0o777, ino, 0, t.len() as i64, dev),
        Node::Fd(n) if follow => file_stat(&*os.files.file(n)?)?,
        Node::Fd(n) => synth_stat(libc::S_IFLNK | 0o700, ino, 0, describe(&*os.files.file(n)?).len() as i64, dev),
        Node::Ptmx => super::pty::stat(None).unwrap_or_else(|_| synth_stat(libc::S_IFCHR | 0o666, ino, libc::makedev(5, 2), 0, dev)),
        Node::Pty(n) => super::pty::stat(Some(n))?,
    })
}

/// fstat(2) of any open file.
pub fn file_stat(f: &OpenFile) -> Result<libc::stat, Errno> {
    let path = f.path.as_deref().unwrap_or("");
    let (ino, dev) = (ino_of(path), tree_dev(path));
    Ok(match &f.kind {
        Kind::Host(fd) => {
            // SAFETY: a zeroed stat is valid; fstat fills it.
            let mut st: libc::stat = unsafe { std::mem::zeroed() };
            // SAFETY: a valid fd we own and a valid out-pointer.
            if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
                return Err(Errno::last());
            }
            st
        }
        // Captured output looks like the pipe it is read through.
        Kind::Capture(k) => synth_stat(libc::S_IFIFO | 0o600, *k as u64, 0, 0, libc::makedev(0, 13)),
        Kind::Agent(_) => synth_stat(libc::S_IFSOCK | 0o600, 3, 0, 0, libc::makedev(0, 13)),
        Kind::Null => synth_stat(libc::S_IFCHR | 0o666, ino, libc::makedev(1, 3), 0, dev),
        Kind::Zero => synth_stat(libc::S_IFCHR | 0o666, ino, libc::makedev(1, 5), 0, dev),
        Kind::Random => synth_stat(libc::S_IFCHR | 0o666, ino, libc::makedev(1, 9), 0, dev),
        Kind::Data(_) => synth_stat(libc::S_IFREG | 0o444, ino, 0, 0, dev),
        Kind::VirtDir(_) => synth_stat(libc::S_IFDIR | 0o555, ino, 0, 0, dev),
        // An anonymous inode, as Linux's eventpoll.
        Kind::Epoll(_) => synth_stat(0o600, ino, 0, 0, libc::makedev(0, 14)),
    })
}

/// statfs(2) of a node of these trees.
pub fn statfs(path: &str) -> libc::statfs {
    // SAFETY: libc::statfs is plain data; all-zero is valid.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    s.f_type = if vfs::is_under(path, "/dev") {
        0x0102_1994
    } else if vfs::is_under(path, "/sys") {
        0x6265_6572 // SYSFS_MAGIC
    } else {
        0x9fa0
    };
    s.f_bsize = 4096;
    s.f_namelen = 255;
    s.f_frsize = 4096;
    s
}
