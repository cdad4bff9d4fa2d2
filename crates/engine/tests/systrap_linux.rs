//! Unmodified Linux programs from the python template's root filesystem (Debian's busybox and
//! CPython) on the systrap platform, through `guestos`: no /dev/kvm involved. Each runs in a
//! confined stub process of its own (`platform::systrap`), its syscalls served by the same
//! personality as on KVM (`vmm::systrap::Process`).

mod common;

use std::time::Duration;

use collimate_engine::platform::systrap::Confinement;
use collimate_engine::vmm::systrap::Process;
use collimate_engine::{RunExit, RunResult, SpawnSpec};

const T: Duration = Duration::from_secs(60);

fn run(argv: &[&str]) -> Option<RunResult> {
    let root = common::python_rootfs()?;
    let spec = SpawnSpec {
        root,
        argv: argv.iter().map(|s| s.as_bytes().to_vec()).collect(),
        envp: vec![b"PATH=/usr/bin:/bin".to_vec(), b"HOME=/root".to_vec()],
        cwd: "/".into(),
        ..Default::default()
    };
    let mut p = Process::spawn(&spec, &Confinement::default()).expect("spawn on systrap");
    Some(p.run(T).expect("run on systrap"))
}

fn exited(r: &RunResult) -> i32 {
    match r.exit {
        RunExit::Exited { code } => code,
        other => panic!("did not exit: {other:?}; stdout {:?} stderr {:?}", String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr)),
    }
}

#[test]
fn busybox_echo() {
    let Some(r) = run(&["/bin/busybox", "echo", "hello", "systrap"]) else { return };
    assert_eq!(exited(&r), 0);
    assert_eq!(r.stdout, b"hello systrap\n");
}

#[test]
fn busybox_sh_builtins_and_files() {
    // A shell script without fork: builtins, a file written and read back through guest fds
    // (/tmp is read-only without a mount: the read side is what is exercised).
    let Some(r) = run(&["/bin/sh", "-c", "read -r l < /etc/os-release; echo \"${l%%=*}\"; x=$((6*7)); echo $x"]) else { return };
    assert_eq!(exited(&r), 0);
    assert_eq!(String::from_utf8_lossy(&r.stdout), "PRETTY_NAME\n42\n");
}

#[test]
fn debian_python3_prints() {
    let Some(r) = run(&["/usr/bin/python3", "-c", "import sys; print(1+1); print(sys.platform, file=sys.stderr)"]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout, b"2\n");
    assert_eq!(r.stderr, b"linux\n");
}

#[test]
fn python3_memory_calls() {
    // mmap/munmap/mprotect/mremap/brk on this platform: a large bytearray grows (realloc ->
    // mremap), an anonymous mmap is written and read, and a file mapping shows the file.
    let code = "import mmap\n\
b = bytearray(1 << 20)\n\
b += bytearray(8 << 20)\n\
b[-1] = 7\n\
m = mmap.mmap(-1, 1 << 16)\n\
m[100:105] = b'abcde'\n\
f = open('/etc/os-release', 'rb')\n\
fm = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)\n\
print(len(b), b[-1], m[100:105].decode(), fm[:12].decode())\n";
    let Some(r) = run(&["/usr/bin/python3", "-c", code]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), format!("{} 7 abcde PRETTY_NAME=\n", 9 << 20));
}

#[test]
fn a_segfault_ends_the_process_by_sigsegv() {
    let Some(r) = run(&["/usr/bin/python3", "-c", "import ctypes; ctypes.string_at(8)"]) else { return };
    assert_eq!(r.exit, RunExit::Signaled { signo: libc::SIGSEGV });
}

#[test]
fn processes_from_one_template_stub() {
    // Two guest processes in stubs forked from one parked template (platform::systrap::Template).
    let Some(root) = common::python_rootfs() else { return };
    let mut t = collimate_engine::platform::systrap::Template::new(&Confinement::for_replay(false)).expect("template stub");
    for word in ["one", "two"] {
        let spec = SpawnSpec {
            root: root.clone(),
            argv: vec![b"/bin/busybox".to_vec(), b"echo".to_vec(), word.as_bytes().to_vec()],
            envp: vec![b"PATH=/usr/bin:/bin".to_vec()],
            cwd: "/".into(),
            ..Default::default()
        };
        let r = Process::spawn_from(&spec, &mut t).expect("spawn from the template").run(T).expect("run on systrap");
        assert_eq!(exited(&r), 0);
        assert_eq!(r.stdout, format!("{word}\n").as_bytes());
    }
}
