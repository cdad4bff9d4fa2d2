//! Syscall-site patching on systrap (`platform::systrap::patch`): a `mov eax, N; syscall` site
//! that trapped once enters the blob through a jump afterwards. Real stub processes; the test
//! plays the VMM.

mod common;

use collimate_engine::platform::systrap::{kvm_regs, preempt, Confinement, Exit, Stub};
use collimate_engine::vmm::systrap::Process;
use collimate_engine::RunExit;

/// Where the site's code goes: where guestos places libraries, within a `jmp rel32` of the
/// stub's trampolines.
const SITE: u64 = 0x7fff_a000_0000;
const STACK: u64 = 0x7fff_a010_0000;
const PAGE: u64 = 4096;
const RX: i32 = libc::PROT_READ | libc::PROT_EXEC;

/// 0x00 mov eax, 39 (getppid); 0x05 syscall; 0x07 movq rbx, xmm0; 0x0c jmp 0x00;
/// 0x0e ud2; 0x10 jmp . (a guest computing without syscalls).
const LOOP: &[u8] = &[0xb8, 39, 0, 0, 0, 0x0f, 0x05, 0x66, 0x48, 0x0f, 0x7e, 0xc3, 0xeb, 0xf2, 0x0f, 0x0b, 0xeb, 0xfe];
const UD2: u64 = SITE + 0x0e;
const SPIN: u64 = SITE + 0x10;

/// 0x00 mov eax, 39; 0x05 syscall; 0x07 mov rdx, [rip - 14] (its own first 8 bytes); 0x0e jmp 0x00.
const READER: &[u8] = &[0xb8, 39, 0, 0, 0, 0x0f, 0x05, 0x48, 0x8b, 0x15, 0xf2, 0xff, 0xff, 0xff, 0xeb, 0xf0];

fn stub_with(code: &[u8], flags: i32) -> (Stub, kvm_regs) {
    let mut stub = Stub::spawn(&Confinement::default()).expect("spawn a stub");
    // A shared mapping is writable (the host refuses a debugger's write to a read-only one).
    let (anon, prot) = if flags & libc::MAP_SHARED != 0 { (libc::MAP_ANONYMOUS, RX | libc::PROT_WRITE) } else { (0, RX) };
    stub.map(SITE, PAGE, prot, flags | anon, None, 0).expect("map code");
    stub.write(SITE, code).expect("write code");
    stub.map(STACK - PAGE, PAGE, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, None, 0).expect("map stack");
    let regs = kvm_regs { rip: SITE, rsp: STACK, rflags: 0x202, ..Default::default() };
    (stub, regs)
}

fn site_bytes(stub: &Stub) -> [u8; 7] {
    let mut b = [0; 7];
    stub.read(SITE, &mut b).expect("read the site");
    b
}

const ORIGINAL: [u8; 7] = [0xb8, 39, 0, 0, 0, 0x0f, 0x05];

/// Registers the loop does not touch, set by the VMM at one exit and expected at the next.
fn mark(regs: &mut kvm_regs, i: u64) {
    (regs.rdx, regs.rsi, regs.rdi, regs.rbp) = (i, i + 1, i + 2, i + 3);
    (regs.r8, regs.r9, regs.r10, regs.r12, regs.r13, regs.r14, regs.r15) = (i + 8, i + 9, i + 10, i + 12, i + 13, i + 14, i + 15);
}

fn marked(regs: &kvm_regs, i: u64) -> bool {
    let mut want = *regs;
    mark(&mut want, i);
    (regs.rdx, regs.rsi, regs.rdi, regs.rbp, regs.r8, regs.r9, regs.r10, regs.r12, regs.r13, regs.r14, regs.r15)
        == (want.rdx, want.rsi, want.rdi, want.rbp, want.r8, want.r9, want.r10, want.r12, want.r13, want.r14, want.r15)
}

/// Run to the next exit, which must be the site's getppid as a syscall would report it.
fn syscall_exit(stub: &mut Stub, regs: &mut kvm_regs, fs: &mut u64) {
    assert_eq!(stub.run(regs, fs).expect("run"), Exit::Syscall);
    assert_eq!((regs.rip, regs.rax, regs.rcx), (SITE + 7, 39, SITE + 7), "reported as the syscall instruction would be");
    assert_eq!(regs.r11 & 0xff, regs.rflags & 0xff, "r11 holds rflags, as after a syscall");
}

/// With patching on (the default unless COLLIMATE_SYSTRAP_PATCH=0) the site is patched at its
/// second trap and every later call enters through the jump, with the registers and results of an
/// unpatched one; with it off nothing is patched.
#[test]
fn a_trapped_site_is_patched_and_entered_through_the_jump() {
    for on in [true, false] {
        let (mut stub, mut regs) = stub_with(LOOP, libc::MAP_PRIVATE);
        if !on {
            stub.set_patching(false);
        }
        let mut fs = 0;
        for i in 0..50u64 {
            syscall_exit(&mut stub, &mut regs, &mut fs);
            if i > 0 {
                assert!(marked(&regs, i), "round {i}: the guest's registers survive the round trip (patching {on})");
            }
            mark(&mut regs, i + 1);
            regs.rax = 4242; // getppid's answer
        }
        if on {
            assert_eq!(stub.patched_sites(), 1);
            assert_eq!(stub.patched_entries(), 48, "every call after the second (the site's second trap patches it) enters through the jump");
            let b = site_bytes(&stub);
            assert_eq!((b[0], b[5], b[6]), (0xe9, 0x0f, 0x05), "jmp rel32, the syscall kept: {b:x?}");
        } else {
            assert_eq!((stub.patched_sites(), stub.patched_entries()), (0, 0));
            assert_eq!(site_bytes(&stub), ORIGINAL);
        }
    }
}

/// A guest reading its own code sees the jump where the `mov` was, and goes on working.
#[test]
fn a_guest_reading_its_code_sees_the_patched_bytes() {
    let (mut stub, mut regs) = stub_with(READER, libc::MAP_PRIVATE);
    stub.set_patching(true);
    let mut fs = 0;
    for i in 0..5 {
        syscall_exit(&mut stub, &mut regs, &mut fs);
        if i >= 2 {
            let seen = regs.rdx.to_le_bytes();
            assert_eq!(&seen[..7], &site_bytes(&stub), "the guest reads what is there");
            assert_eq!(seen[0], 0xe9);
        }
    }
    assert!(stub.patched_entries() >= 3);
}

/// A shared mapping's code is never written (it would reach every process mapping it).
#[test]
fn a_site_in_a_shared_mapping_is_not_patched() {
    let (mut stub, mut regs) = stub_with(LOOP, libc::MAP_SHARED);
    stub.set_patching(true);
    let mut fs = 0;
    for _ in 0..10 {
        syscall_exit(&mut stub, &mut regs, &mut fs);
    }
    assert_eq!((stub.patched_sites(), stub.patched_entries()), (0, 0));
    assert_eq!(site_bytes(&stub), ORIGINAL);
}

/// The VMM's kick stops a guest looping over a patched site wherever it is (its code, the
/// trampoline, the blob's entry and return): every exit is the syscall or an interruption in
/// the guest's own code, with its registers intact; and it stops one computing after a patched
/// syscall's return.
#[test]
fn kicks_interrupt_a_guest_at_a_patched_site() {
    let (mut stub, mut regs) = stub_with(LOOP, libc::MAP_PRIVATE);
    stub.set_patching(true);
    let mut fs = 0;
    for _ in 0..2 {
        syscall_exit(&mut stub, &mut regs, &mut fs);
    }
    assert_eq!(stub.patched_sites(), 1);
    let fd = stub.kick_fd();
    let done = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let kicker = {
        let done = done.clone();
        std::thread::spawn(move || {
            for _ in 0..3000 {
                preempt::kick_raw(fd);
                std::thread::sleep(std::time::Duration::from_micros(30));
            }
            done.store(true, std::sync::atomic::Ordering::SeqCst);
        })
    };
    let (mut syscalls, mut kicks, mut i) = (0u64, 0u64, 0u64);
    mark(&mut regs, i);
    while !done.load(std::sync::atomic::Ordering::SeqCst) || i < 100 {
        let e = stub.run(&mut regs, &mut fs).expect("run");
        assert!(marked(&regs, i), "exit {i} ({e:?} at {:#x}): registers intact", regs.rip);
        match e {
            Exit::Syscall => {
                assert_eq!((regs.rip, regs.rax), (SITE + 7, 39));
                syscalls += 1;
            }
            Exit::Interrupted => {
                assert!((SITE..SITE + LOOP.len() as u64).contains(&regs.rip), "interrupted in the guest's code, not at {:#x}", regs.rip);
                kicks += 1;
            }
            other => panic!("unexpected exit {other:?} at {:#x}", regs.rip),
        }
        i += 1;
        mark(&mut regs, i);
    }
    kicker.join().unwrap();
    assert!(kicks > 0 && syscalls > 0, "{kicks} kicks, {syscalls} syscalls");
    assert!(stub.patched_entries() > 0);
    // Computing after a patched return (the rt_sigreturn path: rip is not the return address);
    // kicks left over from the storm may still end a run or two.
    while stub.run(&mut regs, &mut fs).expect("run") != Exit::Syscall {}
    assert_eq!(regs.rip, SITE + 7);
    regs.rip = SPIN;
    let fd = stub.kick_fd();
    let k = std::thread::spawn(move || {
        std::thread::sleep(std::time::Duration::from_millis(50));
        preempt::kick_raw(fd);
    });
    // Kicks left over from the storm may end the run early: run until it stops in the loop.
    loop {
        let e = stub.run(&mut regs, &mut fs).expect("run");
        assert_eq!(e, Exit::Interrupted);
        if regs.rip == SPIN {
            break;
        }
    }
    k.join().unwrap();
}

/// A fork carries the patched page and the trampolines; forked while parked at a patched entry,
/// the child returns through it and goes on entering through the jump, apart from its parent.
#[test]
fn a_fork_carries_the_patched_site() {
    let (mut stub, mut regs) = stub_with(LOOP, libc::MAP_PRIVATE);
    stub.set_patching(true);
    let mut fs = 0;
    for _ in 0..4 {
        syscall_exit(&mut stub, &mut regs, &mut fs);
    }
    assert_eq!(stub.patched_entries(), 2);
    let mut child = stub.fork().expect("fork");
    let (mut cregs, mut cfs) = (regs, fs);
    for _ in 0..5 {
        syscall_exit(&mut child, &mut cregs, &mut cfs);
    }
    assert_eq!(child.patched_entries(), 7);
    assert_eq!(child.patched_sites(), 1);
    assert_eq!(site_bytes(&child)[0], 0xe9);
    syscall_exit(&mut stub, &mut regs, &mut fs);
    assert_eq!(stub.patched_entries(), 3, "the parent counts its own");
}

/// Threads share the stub (M:1): one stopped between the site's `mov` and `syscall` when the
/// site was patched traps there as before; one switched to at a patched exit gets every register
/// the VMM gives it (rcx and r11 too, through rt_sigreturn), and the XSAVE area the VMM writes
/// is what the guest then runs with.
#[test]
fn threads_at_a_patched_site_and_switches_there() {
    let (mut stub, mut regs) = stub_with(LOOP, libc::MAP_PRIVATE);
    stub.set_patching(true);
    let mut fs = 0;
    for _ in 0..3 {
        syscall_exit(&mut stub, &mut regs, &mut fs);
    }
    assert_eq!(stub.patched_entries(), 1);
    // A thread stopped at the site's syscall instruction (rax already 39).
    let saved = regs;
    let mut other = kvm_regs { rip: SITE + 5, rax: 39, rsp: STACK - 256, rflags: 0x202, ..Default::default() };
    syscall_exit(&mut stub, &mut other, &mut fs);
    assert_eq!(stub.patched_entries(), 1, "through the trap, as before");
    // Switch (at that exit, or a patched one) to a thread at ud2 with rcx, r11 and CF its own.
    for _ in 0..2 {
        let mut t = kvm_regs { rip: UD2, rcx: 0xdead, r11: 0x77, rbx: 5, rsp: STACK - 512, rflags: 0x203, ..Default::default() };
        match stub.run(&mut t, &mut fs).expect("run") {
            Exit::Signal { signo, .. } => assert_eq!(signo, libc::SIGILL),
            e => panic!("{e:?}"),
        }
        assert_eq!((t.rip, t.rcx, t.r11, t.rbx, t.rflags & 1), (UD2, 0xdead, 0x77, 5, 1));
        // Back to the first thread: a patched exit follows.
        regs = saved;
        syscall_exit(&mut stub, &mut regs, &mut fs);
    }
    assert_eq!(stub.patched_entries(), 3);
    // The XSAVE area at a patched exit: xmm0 set by the VMM is what `movq rbx, xmm0` reads.
    let mut area = stub.xsave().expect("xsave at a patched exit");
    area[160..168].copy_from_slice(&0x1122_3344_5566_7788u64.to_le_bytes());
    stub.set_xsave(&area).expect("set_xsave");
    syscall_exit(&mut stub, &mut regs, &mut fs);
    assert_eq!(regs.rbx, 0x1122_3344_5566_7788);
    assert_eq!(&stub.xsave().expect("xsave")[160..168], &0x1122_3344_5566_7788u64.to_le_bytes());
}

/// For a snapshot every patched site gets its `mov` back (a restored stub has no trampolines);
/// the guest goes on through the trap.
#[test]
fn unpatch_all_restores_the_original_code() {
    let (mut stub, mut regs) = stub_with(LOOP, libc::MAP_PRIVATE);
    stub.set_patching(true);
    let mut fs = 0;
    for _ in 0..3 {
        syscall_exit(&mut stub, &mut regs, &mut fs);
    }
    assert_eq!(site_bytes(&stub)[0], 0xe9);
    assert_eq!(stub.unpatch_all().expect("unpatch"), 1);
    assert_eq!(site_bytes(&stub), ORIGINAL);
    let entries = stub.patched_entries();
    for _ in 0..5 {
        syscall_exit(&mut stub, &mut regs, &mut fs);
    }
    assert_eq!(stub.patched_entries(), entries);
    assert_eq!(site_bytes(&stub), ORIGINAL);
}

/// Before a snapshot the sites that trapped once are patched (`Stub::patch_seen`), as their
/// next trap would patch them: the next call enters through the jump; one never trapped is not.
#[test]
fn patch_seen_patches_the_sites_that_trapped_once() {
    let (mut stub, mut regs) = stub_with(LOOP, libc::MAP_PRIVATE);
    stub.set_patching(true);
    assert_eq!(stub.patch_seen(), 0, "nothing trapped yet");
    let mut fs = 0;
    syscall_exit(&mut stub, &mut regs, &mut fs);
    assert_eq!(stub.patched_sites(), 0, "one trap: not looked at yet");
    assert_eq!(stub.patch_seen(), 1);
    assert_eq!(site_bytes(&stub)[0], 0xe9);
    syscall_exit(&mut stub, &mut regs, &mut fs);
    assert_eq!((stub.patched_sites(), stub.patched_entries()), (1, 1));
    assert_eq!(stub.patch_seen(), 0, "nothing left to patch");
}

/// Debian's CPython on glibc, through guestos: `os.getppid()` 2000 times enters through a
/// patched site (glibc's `mov eax, 110; syscall`), and the program's output is as unpatched.
/// Fails with COLLIMATE_SYSTRAP_PATCH=0 (nothing patched).
#[test]
fn cpython_getppid_goes_through_a_patched_site() {
    let Some(root) = common::python_rootfs() else { return };
    let code = "import os\np = {os.getppid() for _ in range(2000)}\nprint(len(p), open('/proc/self/status').read().count('PPid'))";
    let spec = common::python_spec(root, &["/usr/bin/python3", "-c", code]);
    let mut p = Process::spawn(&spec, &Confinement::default()).expect("spawn on systrap");
    let r = p.run(std::time::Duration::from_secs(60)).expect("run on systrap");
    assert!(matches!(r.exit, RunExit::Exited { code: 0 }), "{:?}: {}", r.exit, String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.stdout, b"1 1\n");
    let (entries, sites) = p.stub_patched();
    eprintln!("python3 -c getppid x2000: {entries} patched entries over {sites} sites, {} commands", p.stub_commands());
    assert!(entries >= 1998, "{entries} patched entries over {sites} sites");
}

/// What patching costs a short program: `sh -c true`'s sites (printed; run with --nocapture).
#[test]
fn a_short_program_patches_few_sites() {
    let Some(root) = common::python_rootfs() else { return };
    for argv in [&["/bin/sh", "-c", "true"][..], &["/usr/bin/python3", "-c", "pass"][..]] {
        let spec = common::python_spec(root.clone(), argv);
        let mut p = Process::spawn(&spec, &Confinement::default()).expect("spawn on systrap");
        let t = std::time::Instant::now();
        let r = p.run(std::time::Duration::from_secs(60)).expect("run on systrap");
        assert!(matches!(r.exit, RunExit::Exited { code: 0 }), "{:?}", r.exit);
        let (entries, sites) = p.stub_patched();
        eprintln!("{argv:?}: {entries} patched entries over {sites} sites, {} commands, {:?}", p.stub_commands(), t.elapsed());
    }
}

// --- Snapshots, restores and resets of patched processes -------------------------------------

/// getppid's site patched (3 calls) before the snapshot point (yield 7). After it: what the
/// guest reads at getppid's and sched_yield's sites (`0xb8`: the `mov`, `0xe9`: the jump), first
/// thing (no getppid or sched_yield called yet) and after 3 sched_yields (which patch its site);
/// then what getppid returns (every trampoline still its own site's) and values a seed decides.
const SITES: &str = r#"
import ctypes, os, random, time
libc = ctypes.CDLL(None)
def site(f):
    b = ctypes.string_at(ctypes.cast(f, ctypes.c_void_p).value, 32)
    return hex(b[b.find(b'\x0f\x05') - 5])
for _ in range(3):
    os.getppid()
libc.syscall(0x40000000, 7)
print('resumed', site(libc.getppid), site(libc.sched_yield), flush=True)
for _ in range(3):
    os.sched_yield()
print('ran', site(libc.getppid), site(libc.sched_yield), flush=True)
print('out', os.getppid(), sum(i * i for i in range(1000)), random.random(), os.urandom(8).hex(), time.time(), flush=True)
libc.syscall(0x40000000, 8)
"#;

const SEED: [u8; 32] = [0x5e; 32];
const SEED2: [u8; 32] = [0x17; 32];
const T: std::time::Duration = std::time::Duration::from_secs(60);

/// Bake [`SITES`] to its snapshot point in `dir`, seeded, with patching on or off; the sites it
/// patched.
fn bake_sites(root: std::path::PathBuf, dir: &std::path::Path, patching: bool) -> u64 {
    let spec = common::python_spec(root, &["/usr/bin/python3", "-c", SITES]);
    let mut p = Process::spawn(&spec, &Confinement::default()).expect("spawn on systrap");
    p.set_patching(patching);
    p.reseed(SEED, true);
    let r = p.run(T).expect("run");
    assert_eq!(r.exit, RunExit::Yield { value: 7 }, "{}", String::from_utf8_lossy(&r.stderr));
    p.snapshot(dir).expect("snapshot");
    let sites = p.stub_patched().1;
    // The snapshot leaves the process as it was: still patched.
    let r = p.run(T).expect("run after the snapshot");
    assert_eq!(r.exit, RunExit::Yield { value: 8 }, "{}", String::from_utf8_lossy(&r.stderr));
    let first = String::from_utf8_lossy(&r.stdout).lines().next().unwrap_or_default().to_string();
    let want = if patching { "resumed 0xe9 0xb8" } else { "resumed 0xb8 0xb8" };
    assert_eq!(first, want, "the snapshotted process goes on as it was");
    sites
}

/// Restore `dir`, reseed with [`SEED2`] and run to yield 8: the stdout lines and the sites
/// patched at the restore (before the guest's first syscall).
/// A snapshot baked with patching on in a scratch directory named `name` (its `snap`), and what a
/// restore of it prints; None where there is no python root filesystem or patching is off.
fn patched_snapshot(name: &str) -> Option<(std::path::PathBuf, Vec<String>)> {
    let root = common::python_rootfs()?;
    if !collimate_engine::platform::systrap::patch::enabled_by_env() {
        return None;
    }
    let dir = common::scratch(name);
    assert!(bake_sites(root, &dir.join("snap"), true) > 0);
    let (want, _) = restore_sites(&dir.join("snap"));
    Some((dir, want))
}

fn restore_sites(dir: &std::path::Path) -> (Vec<String>, u64) {
    let mut p = Process::restore(dir, &Confinement::default()).expect("restore");
    let at_restore = p.stub_patched().1;
    p.reseed(SEED2, true);
    let r = p.run(T).expect("run the restore");
    assert_eq!(r.exit, RunExit::Yield { value: 8 }, "{}", String::from_utf8_lossy(&r.stderr));
    (String::from_utf8_lossy(&r.stdout).lines().map(str::to_string).collect(), at_restore)
}

/// A restore of a snapshot taken patched runs patched from its first syscall: its stub has the
/// snapshot's sites and trampolines before the guest runs, the guest finds getppid's site
/// patched before calling it again, and it patches its own sites into the slots after them
/// (getppid still answers as getppid). Its output is that of a restore of the same program baked
/// with patching off (same seeds), but for the bytes it reads of its own code.
#[test]
fn a_restore_runs_the_snapshots_patched_sites_from_its_first_syscall() {
    let Some(root) = common::python_rootfs() else { return };
    if !collimate_engine::platform::systrap::patch::enabled_by_env() {
        return; // COLLIMATE_SYSTRAP_PATCH=0: nothing is patched to keep
    }
    let dir = common::scratch("systrap-patch-restore");
    let baked = bake_sites(root.clone(), &dir.join("on"), true);
    assert!(baked > 0, "the template patched nothing");
    assert_eq!(bake_sites(root, &dir.join("off"), false), 0);
    let (on, at_restore) = restore_sites(&dir.join("on"));
    assert_eq!(at_restore, baked, "the restore has the snapshot's sites before its first syscall");
    let (off, none) = restore_sites(&dir.join("off"));
    assert_eq!(none, 0);
    assert_eq!(on[..2], ["resumed 0xe9 0xb8", "ran 0xe9 0xe9"], "{on:?}");
    assert_eq!(off[..2], ["resumed 0xb8 0xb8", "ran 0xb8 0xe9"], "{off:?}");
    assert_eq!(on[2..], off[2..], "the same seed, the same output, patched or not");
    // Twice the same: a restore is deterministic.
    assert_eq!(restore_sites(&dir.join("on")).0, on);
    let _ = std::fs::remove_dir_all(&dir);
}

/// A clone of a restored sandbox, reset (`Vm::reset`), is back at the snapshot's patched sites,
/// not at none: the sites it patched itself are its own pages, dropped, and the slots they took
/// are free again for the next owner's, which must not take the snapshot's (getppid would
/// return another syscall's result). Three owners in a row print the same.
#[test]
fn a_reset_goes_back_to_the_snapshots_patched_sites() {
    let Some((dir, want)) = patched_snapshot("systrap-patch-reset") else { return };
    assert_eq!(want[..2], ["resumed 0xe9 0xb8", "ran 0xe9 0xe9"], "{want:?}");
    let mut z = collimate_engine::Vm::restore(&common::launcher(), &dir.join("snap")).expect("restore");
    let mut kid = z.fork(1).expect("clone").pop().unwrap();
    for owner in 0..3 {
        if owner > 0 {
            kid.reset().expect("reset");
        }
        kid.reseed(SEED2, true).expect("reseed");
        let r = kid.run(T).expect("run");
        assert_eq!(r.exit, collimate_engine::RunExit::Yield { value: 8 }, "{}", String::from_utf8_lossy(&r.stderr));
        let got: Vec<String> = String::from_utf8_lossy(&r.stdout).lines().map(str::to_string).collect();
        assert_eq!(got, want, "owner {owner}");
    }
    drop(kid);
    drop(z);
    let _ = std::fs::remove_dir_all(&dir);
}

/// `COLLIMATE_SYSTRAP_PATCH=0` keeps every guest off the trampolines, also one restored from a
/// snapshot taken patched: its sites get their `mov` back at the restore and again at each
/// reset, and nothing is patched (run in a child test process with the variable set:
/// [`patching_off_inner`]). Output as a patched restore's, but for the bytes.
#[test]
fn patching_off_puts_a_restored_snapshots_sites_back() {
    let Some((dir, want)) = patched_snapshot("systrap-patch-off") else { return };
    let out = std::process::Command::new(std::env::current_exe().unwrap())
        .args(["--exact", "patching_off_inner", "--ignored", "--nocapture", "--test-threads=1"])
        .env("COLLIMATE_SYSTRAP_PATCH", "0")
        .env("COLLIMATE_TEST_PATCH_SNAPSHOT", dir.join("snap"))
        .env("COLLIMATE_TEST_PATCH_WANT", want[2..].join("\n"))
        .output()
        .expect("run the inner test");
    let text = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(out.status.success() && text.contains("1 passed"), "{text}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// [`patching_off_puts_a_restored_snapshots_sites_back`]'s child: with COLLIMATE_SYSTRAP_PATCH=0.
#[test]
#[ignore = "run by patching_off_puts_a_restored_snapshots_sites_back with COLLIMATE_SYSTRAP_PATCH=0"]
fn patching_off_inner() {
    assert!(!collimate_engine::platform::systrap::patch::enabled_by_env());
    let dir = std::path::PathBuf::from(std::env::var_os("COLLIMATE_TEST_PATCH_SNAPSHOT").expect("the snapshot"));
    let want_out: Vec<String> = std::env::var("COLLIMATE_TEST_PATCH_WANT").unwrap().lines().map(str::to_string).collect();
    let mut want = vec!["resumed 0xb8 0xb8".to_string(), "ran 0xb8 0xb8".to_string()];
    want.extend(want_out);
    let (got, at_restore) = restore_sites(&dir);
    assert_eq!(at_restore, 0);
    assert_eq!(got, want);
    // A reset drops the restored stub's unpatched copies back to the snapshot's patched pages:
    // it puts the `mov`s back again.
    let mut z = collimate_engine::Vm::restore(&common::launcher(), &dir).expect("restore");
    for owner in 0..2 {
        if owner > 0 {
            z.reset().expect("reset");
        }
        z.reseed(SEED2, true).expect("reseed");
        let r = z.run(T).expect("run");
        assert_eq!(r.exit, collimate_engine::RunExit::Yield { value: 8 }, "{}", String::from_utf8_lossy(&r.stderr));
        let got: Vec<String> = String::from_utf8_lossy(&r.stdout).lines().map(str::to_string).collect();
        assert_eq!(got, want, "owner {owner}");
    }
}
