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

/// A first process run in the test's own process takes over process-wide state (the carrier of
/// guest signals, `signal::host`: one systrap first process per host process, vmm/systrap.rs), so
/// the tests of this binary, which the harness runs on parallel threads, take turns: a SIGUSR1 one
/// guest sent its parent (this process) reached another test's guest (seen once in CI).
static ONE_AT_A_TIME: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn one_at_a_time() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

fn run(argv: &[&str]) -> Option<RunResult> {
    let _turn = one_at_a_time();
    let spec = common::python_spec(common::python_rootfs()?, argv);
    let mut p = Process::spawn(&spec, &Confinement::default()).expect("spawn on systrap");
    Some(p.run(T).expect("run on systrap"))
}

fn exited(r: &RunResult) -> i32 {
    match r.exit {
        RunExit::Exited { code } => code,
        other => panic!("did not exit: {other:?}; stdout {:?} stderr {:?}", String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr)),
    }
}

/// A program's load hands its address-space edits to the stub in a few batches
/// (`vmm::systrap::load`), not one round trip per mapping: busybox's static shell took 16
/// commands (a `recvmsg`, an `mmap` and a `close` for each of its 4 file segments, then its bss,
/// stack, vvar and vDSO), then 2 (the loader's write of its data page's bss tail split the
/// batch), now 1: the writes wait for the edits queued before them (fails with that split: 2).
/// The program then runs as before.
#[test]
fn a_program_loads_in_a_few_round_trips() {
    let _turn = one_at_a_time();
    let Some(root) = common::python_rootfs() else { return };
    let spec = common::python_spec(root, &["/bin/busybox", "echo", "loaded"]);
    let mut p = Process::spawn(&spec, &Confinement::default()).expect("spawn on systrap");
    assert_eq!(p.stub_commands(), 1, "the load took {} round trips to the stub", p.stub_commands());
    let r = p.run(T).expect("run on systrap");
    assert_eq!(exited(&r), 0);
    assert_eq!(r.stdout, b"loaded\n");
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

/// `prog` with a copy of its program header table appended at the end of the file and the ELF
/// header pointing there (the loader must read the headers wherever they are; the in-memory
/// table that PT_PHDR names stays where it was, so the program runs as before).
fn with_headers_at_the_end(prog: &[u8]) -> Vec<u8> {
    let u64_at = |o: usize| u64::from_le_bytes(prog[o..o + 8].try_into().unwrap());
    let u16_at = |o: usize| u16::from_le_bytes(prog[o..o + 2].try_into().unwrap());
    let (phoff, phentsize, phnum) = (u64_at(0x20) as usize, u16_at(0x36) as usize, u16_at(0x38) as usize);
    let mut out = prog.to_vec();
    out.resize(out.len().next_multiple_of(8), 0);
    let at = out.len() as u64;
    out.extend_from_slice(&prog[phoff..phoff + phentsize * phnum]);
    out[0x20..0x28].copy_from_slice(&at.to_le_bytes());
    out
}

/// Runs `argv` on systrap with `dir` mounted at /work.
fn run_in(dir: &std::path::Path, argv: &[&str], envp: &[&str]) -> Option<RunResult> {
    let _turn = one_at_a_time();
    let mut spec = common::python_spec(common::python_rootfs()?, argv);
    spec.mounts = vec![("/work".into(), dir.to_path_buf())];
    spec.envp.extend(envp.iter().map(|e| e.as_bytes().to_vec()));
    let mut p = Process::spawn(&spec, &Confinement::default()).expect("spawn on systrap");
    Some(p.run(T).expect("run on systrap"))
}

/// A load on systrap reads a program's headers, not the whole file (the host maps the segments
/// from the file): CPython's 6.6 MB took about 5 ms to read whole. Where the headers are is up to
/// the file: here CPython with its program header table moved past the first pages (8 KiB are
/// read first), which the load must then read from there (an exec that kept only the first read
/// would refuse it as ENOEXEC or map garbage).
#[test]
fn a_program_whose_headers_are_at_its_end_runs() {
    let Some(root) = common::python_rootfs() else { return };
    let dir = common::scratch("headers-at-end");
    let prog = std::fs::read(root.join("usr/bin/python3.11")).expect("the rootfs's python3.11");
    let moved = with_headers_at_the_end(&prog);
    assert!(moved.len() > prog.len() && u64::from_le_bytes(moved[0x20..0x28].try_into().unwrap()) > 1 << 20);
    std::fs::write(dir.join("work/python3"), &moved).unwrap();
    std::fs::set_permissions(dir.join("work/python3"), std::os::unix::fs::PermissionsExt::from_mode(0o755)).unwrap();
    let Some(r) = run_in(&dir.join("work"), &["/work/python3", "-S", "-c", "print(6 * 7)"], &["PYTHONHOME=/usr"]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout, b"42\n");
    let _ = std::fs::remove_dir_all(&dir);
}

/// Two segments that share a page (a linker told not to page-align them, `ld -n`), the second's
/// bytes past the first 8 KiB of the file: the loader writes them into the shared page itself,
/// reading them from the file when it read only the headers (before, from the whole file it had
/// read). The program prints its data segment's bytes and exits with one of them, as natively.
#[test]
fn segments_sharing_a_page_get_their_bytes_from_the_file() {
    let dir = common::scratch("shared-page");
    let work = dir.join("work");
    std::fs::write(
        work.join("p.S"),
        ".text\n.globl _start\n_start:\n mov $1, %eax\n mov $1, %edi\n lea msg(%rip), %rsi\n mov $6, %edx\n syscall\n \
         movzbl code(%rip), %edi\n mov $60, %eax\n syscall\n.fill 9000, 1, 0xcc\n.balign 16, 0xcc\n\
         .data\nmsg: .ascii \"shared\"\ncode: .byte 7\n",
    )
    .unwrap();
    std::fs::write(
        work.join("p.ld"),
        "PHDRS { text PT_LOAD FILEHDR PHDRS FLAGS(5); data PT_LOAD FLAGS(7); }\n\
         SECTIONS { . = 0x400000 + SIZEOF_HEADERS; .text : { *(.text) } :text . = ALIGN(16); .data : { *(.data) } :data /DISCARD/ : { *(.note*) *(.comment) } }\n",
    )
    .unwrap();
    let built = std::process::Command::new("gcc")
        .args(["-nostdlib", "-static", "-no-pie", "-Wl,-n", "-Wl,--build-id=none", "-Wl,--no-warn-rwx-segments", "-Wl,-T"])
        .arg(work.join("p.ld"))
        .arg("-o")
        .arg(work.join("p"))
        .arg(work.join("p.S"))
        .status();
    match built {
        Ok(s) => assert!(s.success(), "gcc failed"),
        Err(_) => {
            eprintln!("gcc not found: skipping");
            return;
        }
    }
    // The layout the test is about: the data segment starts inside the text's last page, past 8 KiB.
    let elf = std::fs::read(work.join("p")).unwrap();
    let ph = |i: usize, o: usize| u64::from_le_bytes(elf[64 + i * 56 + o..64 + i * 56 + o + 8].try_into().unwrap());
    let (text_end, data_va, data_off) = (ph(0, 16) + ph(0, 40), ph(1, 16), ph(1, 8));
    assert!(data_va / 4096 == (text_end - 1) / 4096 && data_off > 8192, "{text_end:#x} {data_va:#x} {data_off:#x}");
    let Some(r) = run_in(&work, &["/work/p"], &[]) else { return };
    assert_eq!(exited(&r), 7, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout, b"shared");
    let _ = std::fs::remove_dir_all(&dir);
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
fn a_file_mapped_again_over_itself_shows_the_file() {
    // The dynamic loader's way: a file mapped whole, then parts of it again with MAP_FIXED at the
    // offsets they already have (the mapping is kept, only its protection changes: mm/host.rs),
    // at another offset, and over a part made writable and written, then read-only again (as
    // RELRO is): a new mapping there, showing the file's bytes again, not the written copy.
    let code = "import ctypes, os\n\
libc = ctypes.CDLL(None, use_errno=True)\n\
libc.mmap.restype = ctypes.c_void_p\n\
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n\
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n\
R, W, PRIV, FIXED, P = 1, 2, 2, 0x10, 4096\n\
path = '/usr/lib/python3.11/os.py'\n\
data = open(path, 'rb').read(4 * P)\n\
fd = os.open(path, os.O_RDONLY)\n\
base = libc.mmap(None, 4 * P, R, PRIV, fd, 0)\n\
at = lambda i: ctypes.string_at(base + i * P, P)\n\
def remap(i, prot, off): assert libc.mmap(base + i * P, P, prot, PRIV | FIXED, fd, off) == base + i * P, ctypes.get_errno()\n\
remap(1, R, P)\n\
ok = [at(1) == data[P:2 * P]]\n\
assert libc.mprotect(base + P, P, R | W) == 0\n\
ctypes.memset(base + P, 0x41, 8)\n\
ok.append(at(1)[:9] == b'A' * 8 + data[P + 8:P + 9])\n\
assert libc.mprotect(base + P, P, R) == 0\n\
remap(1, R, P)\n\
ok.append(at(1) == data[P:2 * P])\n\
remap(2, R, 0)\n\
ok.append(at(2) == data[:P])\n\
remap(3, R | 4, 3 * P)\n\
ok.append(at(3) == data[3 * P:4 * P])\n\
print(ok)\n";
    let Some(r) = run(&["/usr/bin/python3", "-c", code]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "[True, True, True, True, True]\n");
}

#[test]
fn mremap_grows_next_to_the_stub_by_moving() {
    // A mapping that ends where the stub's reserved range begins cannot grow in place there:
    // mremap with MREMAP_MAYMOVE moves it (as Linux would with a neighbour in the way) and keeps
    // its contents; without MAYMOVE it is ENOMEM. The stub's pages are untouched (the process
    // goes on trapping).
    let code = format!("import ctypes, os\n\
libc = ctypes.CDLL(None, use_errno=True)\n\
libc.mmap.restype = ctypes.c_void_p\n\
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n\
libc.mremap.restype = ctypes.c_void_p\n\
libc.mremap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t, ctypes.c_int]\n\
at = {base} - 4096\n\
p = libc.mmap(at, 4096, 3, 0x22 | 0x100000, -1, 0)\n\
assert p == at, hex(p or 0)\n\
ctypes.memset(p, 0x5a, 4096)\n\
r = libc.mremap(p, 4096, 8192, 0)\n\
print(r == 2**64 - 1, ctypes.get_errno())\n\
q = libc.mremap(p, 4096, 8192, 1)\n\
print(q not in (p, 2**64 - 1), ctypes.string_at(q, 4096) == b'Z' * 4096)\n\
print(os.getpid() > 0)\n", base = collimate_engine::platform::systrap::layout::STUB_BASE);
    let Some(r) = run(&["/usr/bin/python3", "-c", &code]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), format!("True {}\nTrue True\nTrue\n", libc::ENOMEM));
}

#[test]
fn a_segfault_ends_the_process_by_sigsegv() {
    let Some(r) = run(&["/usr/bin/python3", "-c", "import ctypes; ctypes.string_at(8)"]) else { return };
    assert_eq!(r.exit, RunExit::Signaled { signo: libc::SIGSEGV });
}

#[test]
fn a_python_signal_handler_runs_and_returns() {
    // rt_sigaction, kill to itself, the frame on the guest's stack, rt_sigreturn back into the
    // interpreter (whose registers and floating-point state must come back intact), twice.
    let code = "import signal, os\n\
n = []\n\
signal.signal(signal.SIGUSR1, lambda *a: n.append(1) or print('got'))\n\
x = 1.5\n\
os.kill(os.getpid(), signal.SIGUSR1)\n\
os.kill(os.getpid(), signal.SIGUSR1)\n\
print(len(n), x * 3)\n";
    let Some(r) = run(&["/usr/bin/python3", "-c", code]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "got\ngot\n2 4.5\n");
}

#[test]
fn an_unhandled_signal_ends_the_process_by_it() {
    let Some(r) = run(&["/usr/bin/python3", "-c", "import os, signal; os.kill(os.getpid(), signal.SIGTERM); print('not reached')"]) else { return };
    assert_eq!(r.exit, RunExit::Signaled { signo: libc::SIGTERM });
    assert_eq!(r.stdout, b"");
}

#[test]
fn a_fault_runs_the_guests_handler_then_ends_by_sigsegv() {
    // CPython's faulthandler: its SIGSEGV handler (on an alternate stack) prints the traceback,
    // puts the default action back and returns; the retried access then kills the process.
    let Some(r) = run(&["/usr/bin/python3", "-X", "faulthandler", "-c", "import ctypes; ctypes.string_at(8)"]) else { return };
    assert_eq!(r.exit, RunExit::Signaled { signo: libc::SIGSEGV }, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert!(String::from_utf8_lossy(&r.stderr).contains("Segmentation fault"), "stderr: {}", String::from_utf8_lossy(&r.stderr));
}

#[test]
fn a_shell_pipeline_forks_and_reaps() {
    // Two forks (each a host fork of the VMM and a fork of the stub), a pipe between them, an
    // execve in each child, and wait4 for both in the shell.
    let Some(r) = run(&["/bin/sh", "-c", "echo a | cat"]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout, b"a\n");
}

#[test]
fn exit_statuses_reach_the_parent() {
    let Some(r) = run(&["/bin/sh", "-c", "exit 3"]) else { return };
    assert_eq!(exited(&r), 3);
    // A subshell (fork) exiting 3, a child program failing, a child killed by a signal.
    let Some(r) = run(&["/bin/sh", "-c", "(exit 3); echo $?; /bin/busybox false; echo $?; sh -c 'kill -9 $$'; echo $?"]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "3\n1\n137\n");
}

#[test]
fn python_subprocess_runs_a_program() {
    // CPython's subprocess: vfork (or fork) + execve, its error pipe, waitpid.
    let code = "import subprocess\n\
r = subprocess.run(['/bin/echo', 'x'], capture_output=True)\n\
print(r.returncode, r.stdout)\n\
print(subprocess.run(['/bin/sh', '-c', 'exit 5']).returncode)\n";
    let Some(r) = run(&["/usr/bin/python3", "-c", code]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "0 b'x\\n'\n5\n");
}

#[test]
fn signals_travel_between_parent_and_child() {
    // The shell kills its background child (SIGTERM: 143), and a child signals its parent,
    // whose Python handler runs.
    let Some(r) = run(&["/bin/sh", "-c", "sleep 30 & kill $!; wait $!; echo $?"]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout, b"143\n");
    let code = "import os, signal, subprocess\n\
signal.signal(signal.SIGUSR1, lambda *a: print('got'))\n\
subprocess.run(['/bin/sh', '-c', 'kill -USR1 $PPID'])\n\
print('done')\n";
    let Some(r) = run(&["/usr/bin/python3", "-c", code]) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "got\ndone\n");
}

#[test]
fn processes_from_one_template_stub() {
    // Two guest processes in stubs forked from one parked template (platform::systrap::Template).
    let Some(root) = common::python_rootfs() else { return };
    let _turn = one_at_a_time();
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
