//! Deterministic replay with CPython: a program pauses (the yield hypercall) before it imports the
//! modules that draw randomness, the host reseeds the sandbox CRNG at the pause, and the program
//! goes on. Same template + same seed = the same output (os.urandom, random, uuid4, secrets,
//! tempfile names, time.time, time.monotonic); another seed or no seed = other output. Through
//! snapshot, restore, fork (clone), reset, and a snapshot of a seeded sandbox. Needs the python
//! rootfs (COLLIMATE_ROOTFS; scripts/test.sh builds it).

mod common;

use common::{launcher, python_rootfs, scratch};

use std::time::Duration;

use collimate_engine::{RunExit, SpawnSpec, Vm, VmConfig};

const T: Duration = Duration::from_secs(60);

/// Pauses (yield 7) before importing anything that draws randomness; then prints one line per
/// source, then the clocks and two object addresses. The set's order comes from the str hash secret, which CPython draws at startup, before
/// the pause.
const PROGRAM: &str = r#"
import ctypes, os
ctypes.CDLL(None).syscall(0x40000000, 7)
import random, uuid, secrets, time, tempfile
fd, name = tempfile.mkstemp(dir="/tmp")
os.close(fd)
lines = [
    "urandom " + os.urandom(16).hex(),
    "random " + repr(random.random()),
    "uuid4 " + str(uuid.uuid4()),
    "secrets " + secrets.token_hex(8),
    "tempfile " + os.path.basename(name),
    "set " + "|".join({"alpha", "beta", "gamma", "delta", "epsilon", "zeta", "eta", "theta"}),
    "time " + repr(time.time()),
    "monotonic " + repr(time.monotonic()),
    "perf_counter " + repr(time.perf_counter()),
    "id " + hex(id(object())) + "," + hex(id([1, 2, 3])),
]
print("\n".join(lines))
"#;

/// The lines whose values come from the CRNG.
const RANDOM_LINES: [&str; 5] = ["urandom", "random", "uuid4", "secrets", "tempfile"];
const CLOCK_LINES: [&str; 3] = ["time", "monotonic", "perf_counter"];

fn spec(dir: &std::path::Path) -> SpawnSpec {
    SpawnSpec {
        root: python_rootfs().unwrap(),
        mounts: vec![("/work".into(), dir.join("work")), ("/tmp".into(), dir.join("tmp"))],
        argv: vec![b"/usr/bin/python3".to_vec(), b"-c".to_vec(), PROGRAM.as_bytes().to_vec()],
        envp: vec![b"PATH=/usr/bin:/bin".to_vec()],
        cwd: "/work".into(),
        ..Default::default()
    }
}

fn run_to_pause(vm: &mut Vm) {
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Yield { value: 7 }, "{r:?} {}", String::from_utf8_lossy(&r.stderr));
}

/// Run to the end; the printed lines as (name, value).
fn finish(vm: &mut Vm) -> Vec<(String, String)> {
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
    let out = String::from_utf8(r.stdout).unwrap();
    let lines: Vec<(String, String)> = out
        .lines()
        .map(|l| {
            let (k, v) = l.split_once(' ').unwrap();
            (k.to_string(), v.to_string())
        })
        .collect();
    assert_eq!(lines.len(), 10, "{out}");
    lines
}

fn get<'a>(out: &'a [(String, String)], key: &str) -> &'a str {
    &out.iter().find(|(k, _)| k == key).unwrap().1
}

/// Every CRNG-derived line differs between the two outputs.
fn all_random_differ(a: &[(String, String)], b: &[(String, String)]) {
    for k in RANDOM_LINES {
        assert_ne!(get(a, k), get(b, k), "{k} is the same in\n{a:?}\n{b:?}");
    }
}

const S1: [u8; 32] = [0xc0; 32];
const S2: [u8; 32] = [0x5e; 32];

#[test]
fn clones_reseeded_alike_print_the_same() {
    if python_rootfs().is_none() {
        eprintln!("no python rootfs: skipping");
        return;
    }
    let dir = scratch("linux-replay");
    let snap = dir.join("snap");
    let mut vm = Vm::spawn(&launcher(), &spec(&dir), &VmConfig::default()).unwrap();
    run_to_pause(&mut vm);
    vm.snapshot(&snap).unwrap();
    vm.destroy().unwrap();

    // Clones of one template: two with seed S1, one with S2, two unseeded.
    let mut zygote = Vm::restore(&launcher(), &snap).unwrap();
    let mut kids = zygote.fork(5).unwrap();
    kids[0].reseed(S1, true).unwrap();
    kids[1].reseed(S1, true).unwrap();
    kids[2].reseed(S2, true).unwrap();
    let outs: Vec<_> = kids.iter_mut().map(finish).collect();

    assert_eq!(outs[0], outs[1], "same template, same seed: identical output");
    all_random_differ(&outs[0], &outs[2]);
    // The virtual clocks do not depend on the seed: the same reads see the same times.
    for k in CLOCK_LINES {
        assert_eq!(get(&outs[0], k), get(&outs[2], k));
    }
    // Unseeded clones never share randomness, with each other or with the seeded ones.
    all_random_differ(&outs[3], &outs[4]);
    all_random_differ(&outs[0], &outs[3]);
    // What CPython drew before the pause (the str hash secret) is part of the template.
    assert_eq!(get(&outs[0], "set"), get(&outs[3], "set"));

    // Reset returns to the template; a reseed with S1 replays the S1 run exactly, no reseed does not.
    let k = &mut kids[2];
    k.reset().unwrap();
    k.reseed(S1, true).unwrap();
    assert_eq!(finish(k), outs[0], "reset + reseed replays");
    k.reset().unwrap();
    all_random_differ(&finish(k), &outs[0]);
    k.reset().unwrap();
    all_random_differ(&finish(k), &outs[3]);

    // A seeded sandbox's CRNG and clocks are in its snapshot: restores of it replay without a
    // reseed (a seeded CRNG is not diverged), and replay the S1 run.
    let snap2 = dir.join("snap-seeded");
    let mut seeded = zygote.clone_vm().unwrap();
    seeded.reseed(S1, true).unwrap();
    seeded.snapshot(&snap2).unwrap();
    seeded.destroy().unwrap();
    let mut r1 = Vm::restore(&launcher(), &snap2).unwrap();
    let mut r2 = Vm::restore(&launcher(), &snap2).unwrap();
    let (o1, o2) = (finish(&mut r1), finish(&mut r2));
    assert_eq!(o1, o2);
    assert_eq!(o1, outs[0]);
    // And the restored template's own unseeded clones still diverge.
    let mut u = zygote.fork(2).unwrap();
    all_random_differ(&finish(&mut u[0]), &finish(&mut u[1]));
    drop((kids, u, r1, r2, zygote));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn spawns_reseeded_before_the_first_run_print_the_same() {
    if python_rootfs().is_none() {
        eprintln!("no python rootfs: skipping");
        return;
    }
    // Reseeded before CPython starts, even the str hash secret is reproducible.
    let dir = scratch("linux-replay-spawn");
    let mut outs = Vec::new();
    for seed in [S1, S1, S2] {
        let mut vm = Vm::spawn(&launcher(), &spec(&dir), &VmConfig::default()).unwrap();
        vm.reseed(seed, true).unwrap();
        run_to_pause(&mut vm);
        outs.push(finish(&mut vm));
        let _ = std::fs::remove_dir_all(dir.join("tmp"));
        std::fs::create_dir_all(dir.join("tmp")).unwrap();
    }
    assert_eq!(outs[0], outs[1]);
    all_random_differ(&outs[0], &outs[2]);
    // The default epoch of a guest that never read the clock before the reseed: 2025-01-01.
    let t: f64 = get(&outs[0], "time").parse().unwrap();
    assert!((1_735_689_600.0..1_735_689_700.0).contains(&t), "{t}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// A guest fork: parent and child draw different bytes, and the pair replays under a seed.
const FORKING: &str = r#"
import os
pid = os.fork()
if pid == 0:
    print("child", os.urandom(8).hex(), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
print("parent", os.urandom(8).hex(), flush=True)
"#;

#[test]
fn guest_forks_draw_derived_streams() {
    if python_rootfs().is_none() {
        eprintln!("no python rootfs: skipping");
        return;
    }
    let dir = scratch("linux-replay-fork");
    let mut outs = Vec::new();
    for seed in [S1, S1, S2] {
        let mut s = spec(&dir);
        s.argv[2] = FORKING.as_bytes().to_vec();
        let mut vm = Vm::spawn(&launcher(), &s, &VmConfig::default()).unwrap();
        vm.reseed(seed, true).unwrap();
        let r = vm.run(T).unwrap();
        assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
        let out = String::from_utf8(r.stdout).unwrap();
        let words: Vec<&str> = out.split_whitespace().collect();
        assert_eq!(words.len(), 4, "{out}");
        assert_eq!((words[0], words[2]), ("child", "parent"), "{out}");
        assert_ne!(words[1], words[3], "parent and child share randomness");
        outs.push(out);
    }
    assert_eq!(outs[0], outs[1]);
    assert_ne!(outs[0], outs[2]);
    let _ = std::fs::remove_dir_all(&dir);
}

/// Clock reads through the vDSO (glibc's `clock_gettime`, which `time.monotonic_ns` calls) and
/// through the syscall (ctypes' `syscall(228, ...)`) advance one virtual clock by one quantum each,
/// in the main thread and in another, before and after a pause where the host snapshots, forks
/// and resets the process. Also: the vDSO is mapped and named as Linux names it.
const VDSO_PROGRAM: &str = r#"
import ctypes, threading, time
libc = ctypes.CDLL(None)
libc.getauxval.restype = ctypes.c_ulong
class TS(ctypes.Structure):
    _fields_ = [("s", ctypes.c_long), ("ns", ctypes.c_long)]
def sys_mono():
    ts = TS()
    assert libc.syscall(228, 1, ctypes.byref(ts)) == 0
    return ts.s * 10**9 + ts.ns
maps = open("/proc/self/maps").read()
print("mapped", "[vdso]" in maps and "[vvar]" in maps and libc.getauxval(33) != 0)
a = time.monotonic_ns(); b = sys_mono(); c = time.monotonic_ns()
libc.syscall(0x40000000, 7)
d = time.monotonic_ns(); e = sys_mono(); f = time.monotonic_ns()
got = []
t = threading.Thread(target=lambda: got.extend((time.monotonic_ns(), sys_mono(), time.monotonic_ns())))
t.start(); t.join()
print("steps", b - a, c - b, e - d, f - e, got[1] - got[0], got[2] - got[1])
print("times", a, d, got[0], time.time_ns(), time.process_time_ns())
class TV(ctypes.Structure):
    _fields_ = [("s", ctypes.c_long), ("us", ctypes.c_long)]
tv = TV()
r0 = time.time_ns(); assert libc.gettimeofday(ctypes.byref(tv), None) == 0; r1 = time.time_ns()
t = ctypes.c_long(); s = libc.time(ctypes.byref(t))
p0 = time.process_time_ns(); time.monotonic_ns(); p1 = time.process_time_ns()
print("realtime", tv.s * 10**9 + tv.us * 1000 - r0, r1 - (tv.s * 10**9 + tv.us * 1000), s == t.value == r1 // 10**9, p1 - p0)
print("res", time.clock_getres(time.CLOCK_MONOTONIC), time.clock_getres(time.CLOCK_REALTIME), time.clock_getres(6))
"#;

#[test]
fn vdso_reads_and_syscall_reads_share_the_virtual_clock() {
    if python_rootfs().is_none() {
        eprintln!("no python rootfs: skipping");
        return;
    }
    let dir = scratch("linux-replay-vdso");
    let mut s = spec(&dir);
    s.argv[2] = VDSO_PROGRAM.as_bytes().to_vec();
    let finish_vdso = |vm: &mut Vm| {
        let r = vm.run(T).unwrap();
        assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
        // No thread switch where the host's speed put it (the replay guard): a program that makes
        // syscalls and clock reads is switched by their count alone, on a slow host too.
        assert!(!r.nondeterministic, "a switch by the replay guard");
        String::from_utf8(r.stdout).unwrap()
    };
    let mut vm = Vm::spawn(&launcher(), &s, &VmConfig::default()).unwrap();
    vm.reseed(S1, true).unwrap();
    run_to_pause(&mut vm);
    let mut kids = vm.fork(2).unwrap();
    let first = finish_vdso(&mut vm);
    assert!(first.contains("mapped True\n"), "{first}");
    // Every read is one quantum (1 us) after the one before, whichever way it was made.
    assert!(first.contains("steps 1000 1000 1000 1000 1000 1000\n"), "{first}");
    // gettimeofday and time through the vDSO, on the REALTIME clock; CPU time moves by the
    // quantum per read, the vDSO's included; clock_getres's fixed answers (4 ms: MONOTONIC_COARSE).
    assert!(first.contains("realtime 1000 1000 True 2000\n"), "{first}");
    assert!(first.contains("res 1e-09 1e-09 0.004\n"), "{first}");
    for k in kids.iter_mut() {
        assert_eq!(finish_vdso(k), first, "a fork at the pause replays the rest");
    }
    // Through a snapshot on disk, its restore's clone, and a reset of that clone.
    let snap = dir.join("snap");
    let at_pause = kids.pop().unwrap();
    drop(kids);
    let mut again = Vm::spawn(&launcher(), &s, &VmConfig::default()).unwrap();
    again.reseed(S1, true).unwrap();
    run_to_pause(&mut again);
    again.snapshot(&snap).unwrap();
    again.destroy().unwrap();
    let mut zygote = Vm::restore(&launcher(), &snap).unwrap();
    let mut clone = zygote.clone_vm().unwrap();
    // (The thread's part of a restored process differs from a fork's by one read, before the
    // vDSO too: the thread scheduler's count of events is host state, which a fork keeps and a
    // restore starts afresh. Between restores it replays.)
    let restored = finish_vdso(&mut clone);
    assert!(restored.contains("steps 1000 1000 1000 1000 1000 1000\n"), "{restored}");
    assert_eq!(restored.split("times").next(), first.split("times").next());
    clone.reset().unwrap();
    assert_eq!(finish_vdso(&mut clone), restored, "a reset to the pause replays the rest");
    assert_eq!(finish_vdso(&mut zygote), restored);
    at_pause.destroy().unwrap();
    drop((clone, vm));
    let _ = std::fs::remove_dir_all(&dir);
}
