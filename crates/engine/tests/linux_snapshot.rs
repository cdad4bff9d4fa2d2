//! Linux guests through snapshot, restore, fork and reset: CPython paused mid-program, its open
//! files and writable directories carried in the snapshot, forked sandboxes isolated from each
//! other, reset returning files and memory to the template. Needs the python rootfs (scripts/test.sh
//! builds it and sets COLLIMATE_ROOTFS).

mod common;

use common::{launcher, python_rootfs, scratch, spawn_python_paused};

use std::path::Path;
use std::time::Duration;

use collimate_engine::{RunExit, Vm};

const T: Duration = Duration::from_secs(60);

/// Writes and keeps open /work/state.txt, pauses (yield 7), then appends what /work/who says.
const PROGRAM: &str = r#"
import ctypes, sys
libc = ctypes.CDLL(None)
f = open("/work/state.txt", "w"); f.write("parent\n"); f.flush()
prefix = [i * i for i in range(1000)]          # state held in the interpreter
libc.syscall(0x40000000, 7)
f.write("after-" + open("/work/who").read() + "\n"); f.close()
print(open("/work/state.txt").read().replace("\n", "|"), sum(prefix))
"#;

fn spawn_paused(dir: &Path) -> Vm {
    let mounts = vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))];
    spawn_python_paused(&python_rootfs().unwrap(), mounts, PROGRAM)
}

#[test]
fn forked_python_sandboxes_resume_with_private_files() {
    if python_rootfs().is_none() {
        eprintln!("no python rootfs: skipping");
        return;
    }
    let dir = scratch("linux-snap");
    let snap = dir.join("snap");
    let mut vm = spawn_paused(&dir);
    vm.snapshot(&snap).unwrap();
    vm.destroy().unwrap();

    let mut zygote = Vm::restore(&launcher(), &snap).unwrap();
    let mut kids = zygote.fork(3).unwrap();
    for (i, k) in kids.iter_mut().enumerate() {
        k.upload("/work/who", format!("kid{i}").as_bytes(), 0o644).unwrap();
    }
    let expect = |i: usize| format!("parent|after-kid{i}| {}\n", (0..1000u64).map(|x| x * x).sum::<u64>());
    for (i, k) in kids.iter_mut().enumerate() {
        let r = k.run(T).unwrap();
        assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
        assert_eq!(String::from_utf8_lossy(&r.stdout), expect(i));
        assert_eq!(k.download("/work/state.txt").unwrap(), format!("parent\nafter-kid{i}\n").into_bytes());
    }
    // The template's files are untouched by its children.
    assert_eq!(zygote.download("/work/state.txt").unwrap(), b"parent\n");
    assert!(zygote.download("/work/who").is_err());

    // Reset: memory, registers and files return to the template; the episode replays.
    let k = &mut kids[1];
    k.reset().unwrap();
    assert!(k.download("/work/who").is_err(), "reset must drop files written since the template");
    assert_eq!(k.download("/work/state.txt").unwrap(), b"parent\n");
    k.upload("/work/who", b"again", 0o644).unwrap();
    let r = k.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 });
    assert!(String::from_utf8_lossy(&r.stdout).starts_with("parent|after-again|"));

    // Uploads outside the writable mounts are refused with a clear error.
    let e = kids[0].upload("/usr/bin/evil", b"x", 0o755).unwrap_err();
    assert!(e.to_string().contains("only /tmp, /work, /dev/shm and a baked image's HOME are writable"), "{e}");
    drop(kids);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Maps a sparse file of `size` bytes whole from /tmp/big (longer than the engine's LAZY_MAP_MIN:
/// its pages come from the file when first touched), touches the first page, pauses (yield 7),
/// then prints the head, the tail and two bytes of the middle.
fn lazy_program(size: u64) -> String {
    format!(
        r#"
import ctypes, mmap
size = {size}
with open("/tmp/big", "wb") as f:
    f.write(b"head"); f.seek(size - 8); f.write(b"the tail")
f = open("/tmp/big", "rb")
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
first = m[:4]
ctypes.CDLL(None).syscall(0x40000000, 7)
print(first, m[-8:], m[size // 2:size // 2 + 2])
"#
    )
}

const LAZY_OUTPUT: &str = "b'head' b'the tail' b'\\x00\\x00'\n";

#[test]
fn a_snapshot_holds_the_pages_of_lazy_file_mappings() {
    if python_rootfs().is_none() {
        eprintln!("no python rootfs: skipping");
        return;
    }
    let dir = scratch("linux-snap-lazy");
    let mounts = || vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))];
    let snap = dir.join("snap");
    let mut vm = spawn_python_paused(&python_rootfs().unwrap(), mounts(), &lazy_program(80 << 20));
    vm.snapshot(&snap).unwrap();
    // The snapshot's copy of the file shrinks: what the mapping shows must be in its memory.
    std::fs::write(snap.join("fs/m1/big"), b"gone").unwrap();
    let mut restored = Vm::restore(&launcher(), &snap).unwrap();
    let r = restored.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), LAZY_OUTPUT);
    // The original goes on as well.
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), LAZY_OUTPUT);
    vm.destroy().unwrap();

    // A mapping that cannot be read in whole (1000 MiB, in 1 GiB of guest memory) refuses the
    // snapshot, saying why; the sandbox is unharmed.
    let mut vm = spawn_python_paused(&python_rootfs().unwrap(), mounts(), &lazy_program(1000 << 20));
    let e = vm.snapshot(&dir.join("snap2")).unwrap_err();
    assert!(e.to_string().contains("lazily mapped files (/tmp/big)"), "{e}");
    let r = vm.run(T).unwrap();
    assert_eq!(String::from_utf8_lossy(&r.stdout), LAZY_OUTPUT, "{}", String::from_utf8_lossy(&r.stderr));
    vm.destroy().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}

/// Maps /tmp/big (80 MiB, sparse: a lazy mapping) and /tmp/small (shared, writable), touches the
/// head of the first, pauses (yield 7), then writes what /work/who says through the second and
/// prints what both show.
const FORK_PROGRAM: &str = r#"
import ctypes, mmap
size = 80 << 20
with open("/tmp/big", "wb") as f:
    f.write(b"head"); f.seek(size - 8); f.write(b"the tail")
with open("/tmp/small", "wb") as f:
    f.write(b"." * 100)
f = open("/tmp/big", "rb")
m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
g = open("/tmp/small", "r+b")
s = mmap.mmap(g.fileno(), 0)
first = m[:4]
ctypes.CDLL(None).syscall(0x40000000, 7)
s[:4] = open("/work/who", "rb").read(); s.flush()
print(first, m[-8:], open("/tmp/small").read(5))
"#;

#[test]
fn a_forked_sandbox_maps_its_own_files() {
    use std::os::unix::fs::FileExt;
    if python_rootfs().is_none() {
        eprintln!("no python rootfs: skipping");
        return;
    }
    let dir = scratch("linux-fork-maps");
    let mounts = vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))];
    let mut vm = spawn_python_paused(&python_rootfs().unwrap(), mounts, FORK_PROGRAM);
    let mut kids = vm.fork(1).unwrap();
    // The parent's file changes after the fork, where the mapping was never touched: the child's
    // pages come from its own copy.
    let big = std::fs::OpenOptions::new().write(true).open(dir.join("tmp/big")).unwrap();
    big.write_all_at(b"CHANGED!", (80 << 20) - 8).unwrap();
    let kid = &mut kids[0];
    kid.upload("/work/who", b"kid0", 0o644).unwrap();
    let r = kid.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "b'head' b'the tail' kid0.\n");
    // What the child wrote through its shared mapping went to its own file, not the parent's.
    assert_eq!(&kid.download("/tmp/small").unwrap()[..5], b"kid0.");
    assert_eq!(std::fs::read(dir.join("tmp/small")).unwrap(), [b'.'; 100]);
    vm.upload("/work/who", b"mom!", 0o644).unwrap();
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "b'head' b'CHANGED!' mom!.\n");
    drop(kids);
    vm.destroy().unwrap();
    let _ = std::fs::remove_dir_all(&dir);
}
