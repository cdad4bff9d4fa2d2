//! Shared memory between guest processes (issue 15): MAP_SHARED mappings seen by every process at
//! once, and futexes on shared pages that wake waiters in other processes, with real CPython.

mod common;

use common::{launcher, python_rootfs};

use std::path::{Path, PathBuf};
use std::time::Duration;

use collimate_engine::{RunExit, RunResult, SpawnSpec, Vm, VmConfig};

fn sandbox(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("linux-shared-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("work")).unwrap();
    std::fs::create_dir_all(d.join("shm")).unwrap();
    d
}

fn run_py(root: &Path, work: &Path, code: &str) -> RunResult {
    let s = SpawnSpec {
        root: root.to_path_buf(),
        // /dev/shm as in the SDK's sandboxes: sem_open and multiprocessing's heap live there.
        mounts: vec![("/work".into(), work.to_path_buf()), ("/dev/shm".into(), work.with_file_name("shm"))],
        argv: vec![b"/usr/bin/python3".to_vec(), b"-c".to_vec(), code.as_bytes().to_vec()],
        envp: vec![b"PATH=/usr/bin:/bin".to_vec(), b"HOME=/root".to_vec(), b"LANG=C.UTF-8".to_vec()],
        cwd: "/work".into(),
        ..Default::default()
    };
    let mut vm = Vm::spawn(&launcher(), &s, &VmConfig::default()).unwrap();
    vm.run(Duration::from_secs(120)).unwrap()
}

fn out(r: &RunResult) -> String {
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "stdout:\n{}\nstderr:\n{}", String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr));
    String::from_utf8_lossy(&r.stdout).into_owned()
}

const COHERENT: &str = r#"
import os, mmap
fd = os.open("/work/f", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 4096)
m = mmap.mmap(fd, 4096)
m[0:2] = b"pa"
print("pread sees the guest's write:", os.pread(fd, 2, 0))
os.pwrite(fd, b"hw", 2)
print("the mapping sees pwrite:", bytes(m[0:4]))
m2 = mmap.mmap(fd, 4096)
m2[4:6] = b"m2"
print("two mappings:", bytes(m[0:6]), bytes(m2[0:6]))
a = mmap.mmap(-1, 4096)
pid = os.fork()
if pid == 0:
    m[6:8] = b"ch"
    a[0:5] = b"child"
    os._exit(0)
os.waitpid(pid, 0)
print("after fork:", bytes(m[0:8]), bytes(a[0:5]))
"#;

#[test]
fn shared_mappings_are_coherent_in_and_across_processes() {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let base = sandbox("coherent");
    let o = out(&run_py(&root, &base.join("work"), COHERENT));
    assert_eq!(
        o,
        "pread sees the guest's write: b'pa'\nthe mapping sees pwrite: b'pahw'\ntwo mappings: b'pahwm2' b'pahwm2'\nafter fork: b'pahwm2ch' b'child'\n"
    );
}

const TRUNCATED: &str = r#"
import mmap, os, signal
fd = os.open("/work/t", os.O_RDWR | os.O_CREAT, 0o600)
os.ftruncate(fd, 2 * mmap.PAGESIZE)
m = mmap.mmap(fd, 2 * mmap.PAGESIZE)
m[0] = 1; m[mmap.PAGESIZE] = 2
pid = os.fork()
if pid == 0:
    os.ftruncate(fd, 0)
    x = m[mmap.PAGESIZE]
    os._exit(0)
_, status = os.waitpid(pid, 0)
print("child", os.WIFSIGNALED(status) and os.WTERMSIG(status))
print("parent goes on", os.pread(fd, 1, 0))
"#;

#[test]
fn a_page_of_a_file_truncated_under_a_shared_mapping_is_sigbus_for_the_toucher() {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let base = sandbox("truncated");
    let o = out(&run_py(&root, &base.join("work"), TRUNCATED));
    assert_eq!(o, "child 7\nparent goes on b''\n");
}

/// Outside replay mode (no reseed: the processes run in parallel on the host) a contended lock
/// waits on the host and is woken by the other VMM process.
const CONTENDED: &str = r#"
import multiprocessing as mp, os, time
mp.set_start_method("fork")
N = 300
def work(counter, lock):
    for _ in range(N):
        with lock:
            v = counter.value
            os.sched_yield()
            counter.value = v + 1
counter = mp.RawValue("i", 0)
lock = mp.Lock()
ps = [mp.Process(target=work, args=(counter, lock)) for _ in range(2)]
for p in ps: p.start()
for p in ps: p.join()
print(counter.value, [p.exitcode for p in ps])
s = mp.Semaphore(0)
t = time.monotonic()
print("timed out", s.acquire(timeout=0.2) is False, time.monotonic() - t >= 0.2)
"#;

#[test]
fn a_contended_lock_excludes_and_wakes_across_processes_outside_replay() {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let base = sandbox("contended");
    let o = out(&run_py(&root, &base.join("work"), CONTENDED));
    assert_eq!(o, "600 [0, 0]\ntimed out True True\n");
}

#[test]
fn a_snapshot_of_a_guest_with_shared_mappings_is_refused_with_a_clear_error() {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let base = sandbox("snapshot");
    let work = base.join("work");
    let s = SpawnSpec {
        root: root.to_path_buf(),
        mounts: vec![("/work".into(), work.clone())],
        argv: vec![b"/usr/bin/python3".to_vec(), b"-c".to_vec(), b"import mmap, time\nm = mmap.mmap(-1, 4096)\nprint('mapped', flush=True)\ntime.sleep(3600)".to_vec()],
        envp: vec![b"PATH=/usr/bin:/bin".to_vec()],
        cwd: "/work".into(),
        ..Default::default()
    };
    let mut vm = Vm::spawn(&launcher(), &s, &VmConfig::default()).unwrap();
    // Until it has mapped and printed (in runs of 5 s: a slow host, such as the upstream-KVM
    // lane's emulated one, takes longer to start Python), then it sleeps.
    let mut stdout = Vec::new();
    for _ in 0..60 {
        let r = vm.run(Duration::from_secs(5)).unwrap();
        assert_eq!(r.exit, RunExit::Timeout, "{}", String::from_utf8_lossy(&r.stderr));
        stdout.extend_from_slice(&r.stdout);
        if !stdout.is_empty() {
            break;
        }
    }
    assert_eq!(String::from_utf8_lossy(&stdout), "mapped\n");
    let err = vm.snapshot(&base.join("snap")).unwrap_err().to_string();
    assert!(err.contains("shared memory mapping") && err.contains("before the snapshot"), "{err}");
    // The guest goes on.
    assert_eq!(vm.run(Duration::from_millis(200)).unwrap().exit, RunExit::Timeout);
}
