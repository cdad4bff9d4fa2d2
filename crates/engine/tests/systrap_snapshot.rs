//! Snapshots of a served systrap sandbox (`vmm::systrap::snapshot`): CPython paused at a ready
//! point with state in its memory (a variable), an open file at a known offset and a working
//! directory, written to a snapshot, the original destroyed, then restored twice: each restore
//! resumes with that state and goes on apart from the other. No /dev/kvm involved.

mod common;

use std::time::Duration;

use collimate_engine::{Platform, RunExit, SpawnSpec, Vm, VmConfig};

const T: Duration = Duration::from_secs(60);

/// Makes /work/d its cwd, opens /work/d/log holding "0123456789" at offset 4, keeps a dict,
/// pauses (yield 7); then reads /work/who, prints its state, writes who at the file's offset,
/// pauses again (yield 8) and prints the file and the dict.
const PROGRAM: &str = r#"
import ctypes, os
libc = ctypes.CDLL(None)
os.makedirs('/work/d', exist_ok=True); os.chdir('/work/d')
f = open('/work/d/log', 'w+'); f.write('0123456789'); f.flush(); f.seek(4)
state = {'n': sum(i * i for i in range(1000)), 'tag': 'template'}
libc.syscall(0x40000000, 7)
who = open('/work/who').read()
state['tag'] += '-' + who
print(state['n'], state['tag'], f.tell(), os.getcwd(), flush=True)
f.write(who); f.flush()
libc.syscall(0x40000000, 8)
print(open('log').read(), state['tag'])
"#;

#[test]
fn a_restored_python_keeps_its_state_and_two_restores_go_on_apart() {
    let Some(root) = common::python_rootfs() else {
        eprintln!("no python rootfs: skipping");
        return;
    };
    let dir = common::scratch("systrap-snapshot");
    let spec = SpawnSpec {
        mounts: vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))],
        cwd: "/work".into(),
        ..common::python_spec(root, &["/usr/bin/python3", "-c", PROGRAM])
    };
    let cfg = VmConfig { platform: Platform::Systrap, ..Default::default() };
    let mut vm = Vm::spawn(&common::launcher(), &spec, &cfg).expect("spawn on systrap");
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Yield { value: 7 }, "{}", String::from_utf8_lossy(&r.stderr));
    let snap = dir.join("snap");
    vm.snapshot(&snap).expect("snapshot of a systrap sandbox");
    vm.destroy().unwrap();
    assert!(snap.join("systrap.state").is_file() && snap.join("systrap.mem").is_file());

    let n: u64 = (0..1000u64).map(|i| i * i).sum();
    let mut kids: Vec<Vm> = (0..2).map(|_| Vm::restore(&common::launcher(), &snap).expect("restore on systrap")).collect();
    for (i, k) in kids.iter_mut().enumerate() {
        assert_eq!(k.platform(), Platform::Systrap);
        k.upload("/work/who", format!("k{i}").as_bytes(), 0o644).unwrap();
    }
    for (i, k) in kids.iter_mut().enumerate() {
        let r = k.run(T).unwrap();
        assert_eq!(r.exit, RunExit::Yield { value: 8 }, "{}", String::from_utf8_lossy(&r.stderr));
        // The variable, the file's offset and the cwd are the snapshot's; `who` is this clone's.
        assert_eq!(String::from_utf8_lossy(&r.stdout), format!("{n} template-k{i} 4 /work/d\n"));
    }
    for (i, k) in kids.iter_mut().enumerate() {
        // Each wrote into its own copy of the file, at the offset the snapshot had.
        assert_eq!(k.download("/work/d/log").unwrap(), format!("0123k{i}6789").into_bytes());
        let r = k.run(T).unwrap();
        assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
        assert_eq!(String::from_utf8_lossy(&r.stdout), format!("0123k{i}6789 template-k{i}\n"));
    }
    // The snapshot's own copy of the mount is untouched by its restores.
    assert_eq!(std::fs::read(snap.join("fs/m0/d/log")).unwrap(), b"0123456789");
    drop(kids);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_restored_sandbox_clones_and_snapshots_again() {
    let Some(root) = common::python_rootfs() else { return };
    let dir = common::scratch("systrap-snapshot-fork");
    let spec = SpawnSpec {
        mounts: vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))],
        cwd: "/work".into(),
        ..common::python_spec(root, &["/usr/bin/python3", "-c", PROGRAM])
    };
    let cfg = VmConfig { platform: Platform::Systrap, ..Default::default() };
    let mut vm = Vm::spawn(&common::launcher(), &spec, &cfg).unwrap();
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Yield { value: 7 });
    vm.snapshot(&dir.join("a")).unwrap();
    vm.destroy().unwrap();
    // A restored sandbox is a zygote like any other: clones of it, and a snapshot of it.
    let mut z = Vm::restore(&common::launcher(), &dir.join("a")).unwrap();
    z.snapshot(&dir.join("b")).unwrap();
    let mut kids = z.fork(2).unwrap();
    kids.push(Vm::restore(&common::launcher(), &dir.join("b")).unwrap());
    for (i, k) in kids.iter_mut().enumerate() {
        k.upload("/work/who", format!("c{i}").as_bytes(), 0o644).unwrap();
        let r = k.run(T).unwrap();
        assert_eq!(r.exit, RunExit::Yield { value: 8 }, "kid {i}: {}", String::from_utf8_lossy(&r.stderr));
        assert!(String::from_utf8_lossy(&r.stdout).contains(&format!(" template-c{i} 4 /work/d")), "{}", String::from_utf8_lossy(&r.stdout));
    }
    drop(kids);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_program_file_changed_since_the_snapshot_refuses_the_restore() {
    // Read-only file mappings of the image are kept by path, with the file's identity: a restore
    // over another file there says so instead of running the wrong code.
    let Some(root) = common::python_rootfs() else { return };
    let dir = common::scratch("systrap-snapshot-changed");
    let image = dir.join("image");
    std::fs::create_dir_all(image.join("bin")).unwrap();
    std::fs::copy(root.join("usr/bin/busybox"), image.join("bin/busybox")).unwrap();
    let spec = SpawnSpec {
        mounts: vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))],
        ..common::python_spec(image.clone(), &["/bin/busybox", "sleep", "30"])
    };
    let cfg = VmConfig { platform: Platform::Systrap, ..Default::default() };
    let mut vm = Vm::spawn(&common::launcher(), &spec, &cfg).unwrap();
    assert_eq!(vm.run(Duration::from_millis(300)).unwrap().exit, RunExit::Timeout);
    vm.snapshot(&dir.join("snap")).unwrap();
    vm.destroy().unwrap();
    // The same file: the restore runs (and is stopped by its own timeout again).
    let mut again = Vm::restore(&common::launcher(), &dir.join("snap")).unwrap();
    assert_eq!(again.run(Duration::from_millis(300)).unwrap().exit, RunExit::Timeout);
    again.destroy().unwrap();
    // Another file at that path (a new inode with the same bytes).
    std::fs::copy(image.join("bin/busybox"), image.join("bin/busybox.new")).unwrap();
    std::fs::rename(image.join("bin/busybox.new"), image.join("bin/busybox")).unwrap();
    let e = Vm::restore(&common::launcher(), &dir.join("snap")).unwrap_err().to_string();
    assert!(e.contains("/bin/busybox is not the file the snapshot mapped") && e.contains("take the snapshot again"), "{e}");
    let _ = std::fs::remove_dir_all(&dir);
}
