//! A served systrap sandbox's stubs end with their VMMs (`platform::systrap::reaper`): a child and
//! a grandchild that compute without syscalls (dash's `while :; do :; done`) never wait, so they
//! never notice on their own that their VMM is gone. No /dev/kvm involved.
//!
//! Stubs are found on the host by their credentials (the confinement's `nobody`, 65534) among the
//! sandbox's VMM's descendants, recorded before the kill and looked up again after it.

mod common;

use std::collections::{BTreeSet, HashMap};
use std::time::{Duration, Instant};

use collimate_engine::{Platform, RunExit, Vm, VmConfig};

/// The confinement's host user for stubs (`Confinement`'s default).
const STUB_UID: u32 = 65534;
/// How long the stubs may take to go after their VMMs: a liveness bound (a leaked stub spins for
/// good), not a speed claim.
const BOUND: Duration = Duration::from_secs(30);

/// A first process, a child and a grandchild, each in a busy loop without syscalls.
const TREE: &str = r#"sh -c "sh -c 'while :; do :; done' & while :; do :; done" & while :; do :; done"#;

struct Proc {
    ppid: i32,
    uid: u32,
    state: char,
    comm: String,
}

fn read(pid: i32) -> Option<Proc> {
    let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).ok()?;
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).ok()?;
    let (comm, rest) = (stat[stat.find('(')? + 1..stat.rfind(')')?].to_string(), &stat[stat.rfind(')')? + 2..]);
    let mut f = rest.split_whitespace();
    let state = f.next()?.chars().next()?;
    let ppid = f.next()?.parse().ok()?;
    let uid = status.lines().find_map(|l| l.strip_prefix("Uid:"))?.split_whitespace().next()?.parse().ok()?;
    Some(Proc { ppid, uid, state, comm })
}

/// Whether `pid` still runs or sleeps (a zombie or a dead task neither runs nor holds memory).
fn alive(pid: i32) -> bool {
    read(pid).is_some_and(|p| !matches!(p.state, 'Z' | 'X'))
}

/// Every live process below `top` by the host's parent links.
fn descendants(top: i32) -> HashMap<i32, Proc> {
    let mut all: HashMap<i32, Proc> = HashMap::new();
    for e in std::fs::read_dir("/proc").unwrap().flatten() {
        if let Some(pid) = e.file_name().to_str().and_then(|n| n.parse().ok()) {
            if let Some(p) = read(pid) {
                all.insert(pid, p);
            }
        }
    }
    let mut out = HashMap::new();
    let mut todo = vec![top];
    while let Some(parent) = todo.pop() {
        let kids: Vec<i32> = all.iter().filter(|(_, p)| p.ppid == parent).map(|(&pid, _)| pid).collect();
        for k in kids {
            todo.push(k);
            if let Some(p) = all.remove(&k) {
                if !matches!(p.state, 'Z' | 'X') {
                    out.insert(k, p);
                }
            }
        }
    }
    out
}

fn stubs(procs: &HashMap<i32, Proc>) -> BTreeSet<i32> {
    procs.iter().filter(|(_, p)| p.uid == STUB_UID).map(|(&pid, _)| pid).collect()
}

fn wait_until(bound: Duration, mut f: impl FnMut() -> bool) -> bool {
    let end = Instant::now() + bound;
    while Instant::now() < end {
        if f() {
            return true;
        }
        std::thread::sleep(Duration::from_millis(100));
    }
    f()
}

/// A served sandbox running [`TREE`], its first process paused by a run's timeout while the
/// child and grandchild compute on; with the host pids of its three stubs.
fn busy_tree() -> Option<(Vm, BTreeSet<i32>)> {
    let root = common::python_rootfs()?;
    let spec = common::python_spec(root, &["/bin/sh", "-c", TREE]);
    let cfg = VmConfig { platform: Platform::Systrap, ..Default::default() };
    let mut vm = Vm::spawn(&common::launcher(), &spec, &cfg).expect("spawn on systrap");
    let r = vm.run(Duration::from_secs(2)).expect("run on systrap");
    assert_eq!(r.exit, RunExit::Timeout, "{}", String::from_utf8_lossy(&r.stderr));
    let top = vm.pid();
    let mut found = BTreeSet::new();
    let three = wait_until(BOUND, || {
        found = stubs(&descendants(top));
        found.len() >= 3
    });
    assert!(three, "the tree's three stubs did not appear: {found:?}");
    Some((vm, found))
}

#[test]
fn destroying_a_sandbox_ends_the_stubs_of_its_computing_children() {
    // On main the child's and the grandchild's stubs (forked stubs: no parent-death signal) spun
    // on, reparented to init, after their VMMs died with the first one.
    let Some((vm, stubs)) = busy_tree() else { return };
    let vmms: Vec<i32> = descendants(vm.pid()).iter().filter(|(_, p)| p.uid != STUB_UID).map(|(&pid, _)| pid).collect();
    vm.destroy().expect("destroy");
    let gone = wait_until(BOUND, || stubs.iter().chain(&vmms).all(|&p| !alive(p)));
    let left: Vec<i32> = stubs.iter().chain(&vmms).copied().filter(|&p| alive(p)).collect();
    for &p in &left {
        // SAFETY: a plain kill of a process this test found among its sandbox's (not to load the rest of the run).
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert!(gone, "stubs or VMMs outlived their destroyed sandbox: {left:?}");
}

#[test]
fn a_killed_guest_process_takes_its_stub_with_it_while_the_sandbox_lives() {
    // The child's and the grandchild's VMMs SIGKILLed from outside (as the host's OOM killer
    // would, or `end_exec` for the grandchild): on main their stubs spun on until the sandbox's end
    // and past it; the first process's VMM killed only its direct children's stubs, at `end_exec`.
    let Some((mut vm, stubs)) = busy_tree() else { return };
    let top = vm.pid();
    let procs = descendants(top);
    let first: BTreeSet<i32> = stubs.iter().copied().filter(|p| procs[p].ppid == top).collect();
    assert_eq!(first.len(), 1, "one stub is the first process's: {stubs:?}");
    let forked: BTreeSet<i32> = stubs.difference(&first).copied().collect();
    let victims: Vec<i32> = procs.iter().filter(|(_, p)| p.uid != STUB_UID && p.comm != "collimate-reap").map(|(&pid, _)| pid).collect();
    assert!(victims.len() >= 2, "the child's and grandchild's VMMs: {victims:?}");
    for &v in &victims {
        // SAFETY: a plain kill of a VMM process of this test's sandbox.
        unsafe { libc::kill(v, libc::SIGKILL) };
    }
    let gone = wait_until(BOUND, || forked.iter().all(|&p| !alive(p)));
    let left: Vec<i32> = forked.iter().copied().filter(|&p| alive(p)).collect();
    // The sandbox lives on: its first process answers.
    let alive_after = first.iter().all(|&p| alive(p)) && alive(top);
    let r = vm.run(Duration::from_secs(1)).expect("run after the kills");
    vm.destroy().expect("destroy");
    for &p in &left {
        // SAFETY: as above.
        unsafe { libc::kill(p, libc::SIGKILL) };
    }
    assert!(gone, "the stubs of killed guest processes outlived them: {left:?}");
    assert!(alive_after, "the first process went with its children");
    assert_eq!(r.exit, RunExit::Timeout);
}
