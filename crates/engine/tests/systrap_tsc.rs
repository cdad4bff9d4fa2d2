//! The serving thread takes its stub's `rdtsc` mode in a replay exec (`platform::systrap::tsc`),
//! so a context switch between the two writes no CR4 (an exit to the hypervisor on a nested
//! host). What must hold, counted rather than timed: the guest's `rdtsc` still traps and reads
//! the virtual clock; the VMM thread's own clock reads on the serving path do not run `rdtsc`
//! (each would be a SIGSEGV rescued by the handler, `tsc::rescues`, and two CR4 writes).
//! Debian's CPython from the python template's root filesystem.

mod common;

use std::time::Duration;

use collimate_engine::platform::systrap::{tsc, Confinement, Handoff};
use collimate_engine::vmm::systrap::Process;
use collimate_engine::RunExit;

#[test]
fn a_replay_exec_serves_its_syscalls_with_the_vmm_thread_trapping_rdtsc_and_no_rescues() {
    let Some(root) = common::python_rootfs() else { return };
    // 3000 trapped syscalls, then the guest's own rdtsc through ctypes (x86-64 code in an
    // executable mapping: `rdtsc; shl rdx, 32; or rax, rdx; ret`), twice.
    let code = r#"import os, mmap, ctypes
for _ in range(3000):
    os.getppid()
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(bytes([0x0f, 0x31, 0x48, 0xc1, 0xe2, 0x20, 0x48, 0x09, 0xd0, 0xc3]))
f = ctypes.CFUNCTYPE(ctypes.c_uint64)(ctypes.addressof(ctypes.c_char.from_buffer(m)))
a, b = f(), f()
print(0 < b - a < 10**6)
"#;
    let spec = common::python_spec(root, &["/usr/bin/python3", "-c", code]);
    let mut p = Process::spawn(&spec, &Confinement::for_replay(false)).expect("spawn on systrap");
    // Yield then sleep: every hand-off is a context switch, the case the matching is for.
    p.set_handoff(Handoff::yield_then_sleep());
    p.reseed([5; 32], true);
    let traps = p.sync_traps().expect("switch the stub's traps for a replay exec");
    assert!(traps.rdtsc, "a replay exec traps the guest's rdtsc");
    let before = tsc::rescues();
    let r = p.run(Duration::from_secs(120)).expect("run on systrap");
    let rescues = tsc::rescues() - before;
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    // The guest's rdtsc read the virtual clock (one quantum per read, a few reads apart), not
    // the host's counter, which moves by millions of cycles per millisecond.
    assert_eq!(String::from_utf8_lossy(&r.stdout), "True\n");
    let syscalls = p.traps().syscalls;
    assert!(syscalls >= 3000, "{syscalls} trapped syscalls");
    assert!(tsc::enabled(), "COLLIMATE_SYSTRAP_TSC_MATCH=0 is set: this test checks the matching");
    // A few rescues may come at the run's edges (the run's start and end read the clock through
    // the vDSO); one per syscall would cost more than the matching saves.
    assert!(rescues * 100 < syscalls, "{rescues} of the VMM thread's own rdtsc rescued in {syscalls} trapped syscalls");
    eprintln!("{syscalls} trapped syscalls, {rescues} rescues; VMM thread trapping after the run: {}", tsc::thread_traps());
}

/// In a replay exec the stub answers the guest's trapped `rdtsc` itself, from the virtual clock
/// in the vDSO's data page (the blob's `answer_rdtsc`), instead of a round trip to the VMM per
/// read (libtorch's load runs 131,080 of them): the values are the VMM's (a MONOTONIC read each,
/// one quantum apart, continuing the clock the vDSO's reads move), and almost none reach the VMM.
/// `COLLIMATE_SYSTRAP_RDTSC_LOCAL=0` sends each to the VMM (then this test fails: 2000 of them).
/// `rdtscp` too (TSC_AUX 0, as the VMM answers): libhwy's timer loop, loaded by libtorch, runs
/// 65,536 of them, each a round trip to the VMM before (then this test failed: 1000 of them).
#[test]
fn a_replay_exec_answers_the_guests_rdtsc_in_the_stub() {
    let Some(root) = common::python_rootfs() else { return };
    // `rdtsc; shl rdx, 32; or rax, rdx; ret`, and at +16 `rdtscp; shl rdx, 32; or rax, rdx;
    // mov [rdi], ecx; ret` (TSC_AUX stored where the argument points).
    let code = r#"import mmap, ctypes, time
m = mmap.mmap(-1, 4096, prot=mmap.PROT_READ | mmap.PROT_WRITE | mmap.PROT_EXEC)
m.write(bytes([0x0f, 0x31, 0x48, 0xc1, 0xe2, 0x20, 0x48, 0x09, 0xd0, 0xc3]).ljust(16, b"\xcc")
        + bytes([0x0f, 0x01, 0xf9, 0x48, 0xc1, 0xe2, 0x20, 0x48, 0x09, 0xd0, 0x89, 0x0f, 0xc3]))
base = ctypes.addressof(ctypes.c_char.from_buffer(m))
f = ctypes.CFUNCTYPE(ctypes.c_uint64)(base)
g = ctypes.CFUNCTYPE(ctypes.c_uint64, ctypes.POINTER(ctypes.c_uint32))(base + 16)
aux = ctypes.c_uint32(7)
t = [f() for _ in range(2000)]
mono = time.monotonic_ns()
after = f()
p = [g(ctypes.byref(aux)) for _ in range(1000)]
print(sorted(set(b - a for a, b in zip(t, t[1:]))), t[-1] < mono < after, after - mono)
print(sorted(set(b - a for a, b in zip(p, p[1:]))), after < p[0], aux.value)
"#;
    let spec = common::python_spec(root, &["/usr/bin/python3", "-c", code]);
    let mut p = Process::spawn(&spec, &Confinement::for_replay(false)).expect("spawn on systrap");
    p.reseed([7; 32], true);
    let traps = p.sync_traps().expect("switch the stub's traps for a replay exec");
    assert!(traps.rdtsc, "a replay exec traps the guest's rdtsc");
    let r = p.run(Duration::from_secs(120)).expect("run on systrap");
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    // Consecutive reads one quantum (1000 ns) apart, and in order with the vDSO's MONOTONIC reads.
    assert_eq!(String::from_utf8_lossy(&r.stdout), "[1000] True 1000\n[1000] True 0\n");
    let answered_by_vmm = p.traps().rdtsc;
    assert!(answered_by_vmm < 20, "{answered_by_vmm} of 2001 rdtsc and 1000 rdtscp went to the VMM");
}

/// The vDSO's clock reads between trapped syscalls reach the VMM's clock at each exit (the fold,
/// `guestos::vdso::fold_host`) from the words the stub copies out of the clock page at the exit
/// (`Stub::clock_words`: no read of the guest's memory), so the clock the VMM publishes again
/// before the next run continues it: MONOTONIC one quantum a read, never back, with a syscall
/// between every two reads. (With the copy taken as zeros the VMM kept its old clock and every
/// read after a syscall went back: this failed.)
#[test]
fn vdso_reads_between_syscalls_move_the_vmms_clock() {
    let Some(root) = common::python_rootfs() else { return };
    let code = r#"import os, time
t = []
for _ in range(500):
    t.append(time.monotonic_ns())
    os.getppid()
print(sorted(set(b - a for a, b in zip(t, t[1:]))))
"#;
    let spec = common::python_spec(root, &["/usr/bin/python3", "-c", code]);
    let mut p = Process::spawn(&spec, &Confinement::for_replay(false)).expect("spawn on systrap");
    p.reseed([9; 32], true);
    p.sync_traps().expect("switch the stub's traps for a replay exec");
    let r = p.run(Duration::from_secs(120)).expect("run on systrap");
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert!(p.traps().syscalls >= 500, "{} trapped syscalls", p.traps().syscalls);
    assert_eq!(String::from_utf8_lossy(&r.stdout), "[1000]\n");
}
