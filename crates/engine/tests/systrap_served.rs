//! A systrap sandbox as a served VMM process (`vmm::systrap::serve`): the controller's `Vm` spawns,
//! runs, clones and destroys it through the same protocol as a KVM one. No /dev/kvm involved.

mod common;

use std::time::Duration;

use collimate_engine::{Platform, RunExit, SpawnSpec, Vm, VmConfig};

const T: Duration = Duration::from_secs(60);

fn spawn(argv: &[&str]) -> Option<(Vm, std::path::PathBuf)> {
    let root = common::python_rootfs()?;
    static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
    let dir = common::scratch(&format!("systrap-served-{}", N.fetch_add(1, std::sync::atomic::Ordering::SeqCst)));
    let spec = SpawnSpec {
        root,
        mounts: vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))],
        argv: argv.iter().map(|s| s.as_bytes().to_vec()).collect(),
        envp: vec![b"PATH=/usr/bin:/bin".to_vec(), b"HOME=/root".to_vec()],
        cwd: "/work".into(),
        ..Default::default()
    };
    let cfg = VmConfig { platform: Platform::Systrap, ..Default::default() };
    let vm = Vm::spawn(&common::launcher(), &spec, &cfg).expect("spawn on systrap");
    assert_eq!(vm.platform(), Platform::Systrap);
    Some((vm, dir))
}

#[test]
fn a_served_sandbox_runs_a_shell_with_guest_pids() {
    // $$ is the first process (1); a forked child's pid is the sandbox's next (2), not a host pid.
    let Some((mut vm, _)) = spawn(&["/bin/sh", "-c", "echo $$; sh -c 'echo $$'; echo err >&2; exit 5"]) else { return };
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 5 }, "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "1\n2\n");
    assert_eq!(r.stderr, b"err\n");
    // The end is final, as on kvm.
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Exited { code: 5 });
    vm.destroy().unwrap();
}

#[test]
fn a_served_sandbox_yields_and_resumes() {
    let prog = "import ctypes, os\nprint('a', flush=True)\nctypes.CDLL(None).syscall(0x40000000, 7)\nprint('b', os.getpid())";
    let Some((mut vm, _)) = spawn(&["/usr/bin/python3", "-c", prog]) else { return };
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Yield { value: 7 }, "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout, b"a\n");
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 });
    assert_eq!(r.stdout, b"b 1\n");
}

#[test]
fn clones_of_a_served_sandbox_go_on_apart() {
    let prog = "import ctypes, os\nx = 'p'\nctypes.CDLL(None).syscall(0x40000000, 7)\nopen('/work/f', 'a').write(x)\nprint(open('/work/f').read(), os.getpid())";
    let Some((mut vm, dir)) = spawn(&["/usr/bin/python3", "-c", prog]) else { return };
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Yield { value: 7 });
    let mut kids = vm.fork(2).unwrap();
    for k in &mut kids {
        assert_eq!(k.platform(), Platform::Systrap);
        let r = k.run(T).unwrap();
        assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
        // Each clone writes its own copy of /work: one 'p' each, and the parent's is untouched.
        assert_eq!(r.stdout, b"p 1\n");
    }
    assert!(!dir.join("work/f").exists());
    let r = vm.run(T).unwrap();
    assert_eq!(r.stdout, b"p 1\n");
}

#[test]
fn snapshot_of_an_ended_sandbox_is_refused() {
    // Snapshots work on systrap (tests/systrap_snapshot.rs); one of a process that has ended
    // says so.
    let Some((mut vm, dir)) = spawn(&["/bin/sh", "-c", "exit 0"]) else { return };
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Exited { code: 0 });
    let e = vm.snapshot(&dir.join("snap")).unwrap_err().to_string();
    assert!(e.contains("has ended: there is nothing to snapshot"), "{e}");
}
