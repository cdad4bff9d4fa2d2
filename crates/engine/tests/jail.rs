//! The VMM process's jail (crates/engine/src/vmm/jail.rs), seen from outside through /proc: its own
//! mount and network namespaces holding only the sandbox's directories, the seccomp filter, the
//! resource limits; and that a jailed VMM still snapshots anywhere, restores and forks. With
//! CAP_SYS_ADMIN (root on CI) every layer must be on; without it the namespaces are off and the rest
//! still applies. The Linux guest needs the python rootfs (COLLIMATE_ROOTFS, see scripts/test.sh).

mod common;

use common::{launcher, python_rootfs, scratch, spawn_python_paused};

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};
use std::time::Duration;

use collimate_engine::{RunExit, SpawnSpec, Vm, VmConfig};

const T: Duration = Duration::from_secs(60);

/// Whether this process may make namespaces (CAP_SYS_ADMIN in its effective set), as the VMM
/// processes it starts then may.
fn can_make_namespaces() -> bool {
    let status = std::fs::read_to_string("/proc/self/status").unwrap();
    let eff = status.lines().find_map(|l| l.strip_prefix("CapEff:")).unwrap().trim();
    const CAP_SYS_ADMIN: u32 = 21;
    u64::from_str_radix(eff, 16).unwrap() & (1 << CAP_SYS_ADMIN) != 0
}

/// Pauses at yield 7 after writing /work/a; then writes /work/b and prints both.
const PROGRAM: &str = r#"
import ctypes
open("/work/a", "w").write("a")
ctypes.CDLL(None).syscall(0x40000000, 7)
open("/work/b", "w").write("b")
print(open("/work/a").read() + open("/work/b").read())
"#;

fn spawn_paused(root: &Path, work: &Path) -> Vm {
    spawn_python_paused(root, vec![("/work".into(), work.to_path_buf())], PROGRAM)
}

fn finish(vm: &mut Vm) -> String {
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{r:?} {}", String::from_utf8_lossy(&r.stderr));
    String::from_utf8_lossy(&r.stdout).trim().to_string()
}

fn ns(pid: &str, kind: &str) -> PathBuf {
    std::fs::read_link(format!("/proc/{pid}/ns/{kind}")).unwrap()
}

fn proc_file(pid: i32, name: &str) -> String {
    std::fs::read_to_string(format!("/proc/{pid}/{name}")).unwrap()
}

fn runtime_dir() -> PathBuf {
    std::fs::canonicalize(collimate_engine::guestos::persist::runtime_dir()).unwrap()
}

/// The first component of each path: what the jail's root may hold.
/// The top-level names of `paths` in the jail's root, and the jail's own devpts instance (the
/// guests' pseudo-terminals: never the host's).
fn tops(paths: &[&Path]) -> BTreeSet<String> {
    paths
        .iter()
        .filter_map(|p| p.components().nth(1).map(|c| c.as_os_str().to_string_lossy().into_owned()))
        .chain([".collimate-pts".to_string()])
        .collect()
}

/// The jail's devpts is an instance of its own: it holds no pty of the host's.
fn assert_own_devpts(pid: i32) {
    let mountinfo = proc_file(pid, "mountinfo");
    let line = mountinfo.lines().find(|l| l.split(' ').nth(4) == Some("/.collimate-pts")).unwrap_or_else(|| panic!("{mountinfo}"));
    assert!(line.contains(" - devpts ") && line.contains("nosuid") && line.contains("noexec"), "{line}");
    // A pty of the host's, open right now, must not show there.
    let host_pty = std::fs::OpenOptions::new().read(true).write(true).open("/dev/ptmx");
    assert!(host_pty.is_err() || std::fs::read_dir("/dev/pts").unwrap().count() > 1, "the host's pty is listed on the host");
    let ptys: Vec<String> = entries(&PathBuf::from(format!("/proc/{pid}/root/.collimate-pts"))).into_iter().filter(|n| n != "ptmx").collect();
    assert!(ptys.is_empty(), "host ptys visible in the jail: {ptys:?}");
}

fn entries(dir: &Path) -> BTreeSet<String> {
    std::fs::read_dir(dir).unwrap().map(|e| e.unwrap().file_name().to_string_lossy().into_owned()).collect()
}

/// Checks every layer of a live VMM process `pid` from outside.
fn assert_jailed(vm: &Vm, root: &Path, work: &Path) {
    let pid = vm.pid();
    let status = proc_file(pid, "status");
    assert!(status.lines().any(|l| l == "Seccomp:\t2"), "no seccomp filter:\n{status}");
    assert!(status.lines().any(|l| l == "NoNewPrivs:\t1"), "{status}");
    let limits = proc_file(pid, "limits");
    let limit = |name: &str| -> Vec<String> {
        let line = limits.lines().find(|l| l.starts_with(name)).unwrap_or_else(|| panic!("{name} in {limits}"));
        line[name.len()..].split_whitespace().take(2).map(str::to_string).collect()
    };
    assert_eq!(limit("Max open files"), ["4096", "4096"], "{limits}");
    assert_eq!(limit("Max core file size"), ["0", "0"], "{limits}");
    assert_eq!(limit("Max file size"), ["1073741824", "1073741824"], "{limits}");
    assert_eq!(limit("Max address space"), ["unlimited", "unlimited"], "{limits}");
    let jail = vm.jail();
    assert!(jail.rlimits && jail.seccomp, "{jail:?}");
    if !can_make_namespaces() {
        assert!(!jail.namespaces, "{jail:?}");
        return;
    }
    assert!(jail.namespaces, "with CAP_SYS_ADMIN, the VMM must get its namespaces: {jail:?}");
    assert_ne!(ns(&pid.to_string(), "mnt"), ns("self", "mnt"));
    assert_ne!(ns(&pid.to_string(), "net"), ns("self", "net"));
    // Its root holds the sandbox's directories and the runtime directory, at their host paths, and
    // nothing else of the host: no /proc, no /etc, no /dev but the path to the runtime directory.
    let jroot = PathBuf::from(format!("/proc/{pid}/root"));
    let runtime = runtime_dir();
    assert_eq!(entries(&jroot), tops(&[root, work, &runtime]));
    assert_own_devpts(pid);
    for absent in ["proc", "etc", "sys", "home", "dev/kvm", "dev/null"] {
        let on_the_way = runtime.starts_with(Path::new("/").join(absent));
        assert!(!jroot.join(absent).exists() || on_the_way, "/{absent} in the jail");
    }
    let inside = |p: &Path| jroot.join(p.strip_prefix("/").unwrap());
    assert!(inside(root).join("usr/bin/python3").exists());
    // The root filesystem is read-only in there, the writable mount is not.
    let err = std::fs::write(inside(root).join("jail-probe"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "{err}");
    std::fs::write(inside(work).join("jail-probe"), b"x").unwrap();
    std::fs::remove_file(work.join("jail-probe")).unwrap();
    let net = proc_file(pid, "net/dev");
    let ifaces: Vec<&str> = net.lines().skip(2).filter_map(|l| l.split(':').next()).map(str::trim).collect();
    assert_eq!(ifaces, ["lo"], "{net}");
}

#[test]
fn a_spawned_linux_guest_runs_jailed() {
    let Some(root) = python_rootfs() else { return };
    let root = std::fs::canonicalize(root).unwrap();
    let d = scratch("jail-spawn");
    let mut vm = spawn_paused(&root, &d.join("work"));
    assert_jailed(&vm, &root, &d.join("work"));
    // Forks inherit the jail, and make their private copies of /work inside it.
    let mut kids = vm.fork(2).unwrap();
    for kid in &mut kids {
        assert_eq!(kid.jail(), vm.jail());
        let (k, p) = (kid.pid().to_string(), vm.pid().to_string());
        assert_eq!(ns(&k, "mnt"), ns(&p, "mnt"));
        assert_eq!(ns(&k, "net"), ns(&p, "net"));
        assert!(proc_file(kid.pid(), "status").lines().any(|l| l == "Seccomp:\t2"));
        assert_eq!(finish(kid), "ab");
    }
    assert_eq!(finish(&mut vm), "ab");
    assert!(vm.mem_stats().unwrap().private_bytes > 0, "the controller reads it from /proc");
    drop((vm, kids));
    let _ = std::fs::remove_dir_all(&d);
}

#[test]
fn a_jailed_vmm_snapshots_outside_its_jail_and_restores() {
    let Some(root) = python_rootfs() else { return };
    let root = std::fs::canonicalize(root).unwrap();
    let d = scratch("jail-snap");
    let mut vm = spawn_paused(&root, &d.join("work"));
    // A destination that exists nowhere in the jail, not even its parent.
    let snap = d.join("snapshots/nested/one");
    vm.snapshot(&snap).unwrap();
    assert!(snap.join("vm.state").is_file() && snap.join("vm.mem").is_file() && snap.join("fs/m0/a").is_file());
    // Snapshotting again over the same directory (the files are replaced beside, then renamed).
    vm.snapshot(&snap).unwrap();
    drop(vm);
    let mut restored = Vm::restore(&launcher(), &snap).unwrap();
    let restored_work = collimate_engine::guestos::persist::vm_dir(restored.pid()).join("m0");
    assert_jailed_restore(&restored, &snap);
    let mut clone = restored.clone_vm().unwrap();
    assert_eq!(finish(&mut clone), "ab");
    assert_eq!(finish(&mut restored), "ab");
    restored.reset().unwrap();
    assert_eq!(finish(&mut restored), "ab", "reset copies the snapshot's files again, from inside the jail");
    assert!(restored_work.join("b").exists());
    drop((restored, clone));
    let _ = std::fs::remove_dir_all(&d);
}

fn assert_jailed_restore(vm: &Vm, snap: &Path) {
    if !can_make_namespaces() {
        return;
    }
    let jroot = PathBuf::from(format!("/proc/{}/root", vm.pid()));
    let snap = std::fs::canonicalize(snap).unwrap();
    let inside = jroot.join(snap.strip_prefix("/").unwrap());
    assert!(inside.join("vm.state").is_file());
    let err = std::fs::write(inside.join("jail-probe"), b"x").unwrap_err();
    assert_eq!(err.raw_os_error(), Some(libc::EROFS), "the snapshot is bound read-only: {err}");
}

#[test]
fn a_booted_vm_is_jailed_with_only_the_runtime_directory() {
    let mut vm = Vm::boot(&launcher(), &common::testvm_elf(), &VmConfig::default()).unwrap();
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Yield { value: common::READY_YIELD });
    let jail = vm.jail();
    assert!(jail.rlimits && jail.seccomp && jail.namespaces == can_make_namespaces(), "{jail:?}");
    if can_make_namespaces() {
        assert_eq!(entries(&PathBuf::from(format!("/proc/{}/root", vm.pid()))), tops(&[&runtime_dir()]));
    }
}

#[test]
fn a_spawn_that_fails_inside_the_jail_says_why() {
    let d = scratch("jail-fail");
    let spec = SpawnSpec {
        root: d.join("work"),
        argv: vec![b"/no/such/program".to_vec()],
        cwd: "/".into(),
        ..Default::default()
    };
    let err = Vm::spawn(&launcher(), &spec, &VmConfig::default()).unwrap_err();
    assert!(err.to_string().contains("/no/such/program"), "{err}");
    let spec = SpawnSpec { root: d.join("no-such-root"), ..spec };
    let err = Vm::spawn(&launcher(), &spec, &VmConfig::default()).unwrap_err();
    assert!(err.to_string().contains("sandbox root"), "{err}");
    let _ = std::fs::remove_dir_all(&d);
}
