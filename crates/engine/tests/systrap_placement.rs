//! Systrap's placement with a real stub (platform::systrap::placement): the test thread plays the
//! serving VMM thread of a guest that computes between syscalls. The pair is bound to one CPU;
//! with a busy loop bound to that CPU the placement sees the waits and unbinds it.
//! Needs two CPUs or more (on one there is nothing to place); nothing here is timed.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};

use collimate_engine::platform::systrap::placement::{self, Mode};
use collimate_engine::platform::systrap::{kvm_regs, Confinement, Exit, Stub};

/// A stub running `mov ecx, iters; 1: dec ecx; jnz 1b; syscall; jmp back` forever: guest work
/// between syscalls (a hand-off the VMM's short spin does not answer).
fn compute_loop_stub(iters: u32) -> (Stub, kvm_regs) {
    let mut stub = Stub::spawn(&Confinement::default()).expect("spawn a systrap stub");
    stub.map(0x40_0000, 4096, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_PRIVATE, None, 0).unwrap();
    let mut code = vec![0xb9];
    code.extend_from_slice(&iters.to_le_bytes()); // mov ecx, iters
    code.extend_from_slice(&[0xff, 0xc9, 0x75, 0xfc, 0x0f, 0x05, 0xeb, 0xf3]); // dec ecx; jnz -4; syscall; jmp -13
    stub.write(0x40_0000, &code).unwrap();
    stub.map(0x50_0000, 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, None, 0).unwrap();
    let regs = kvm_regs { rip: 0x40_0000, rsp: 0x50_1000, rflags: 0x202, ..Default::default() };
    (stub, regs)
}

fn allowed(tid: i32) -> Vec<usize> {
    // SAFETY: a zeroed cpu_set_t is valid; sched_getaffinity writes at most its size.
    let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
    // SAFETY: `set` is a valid cpu_set_t of the size given.
    assert_eq!(unsafe { libc::sched_getaffinity(tid, std::mem::size_of::<libc::cpu_set_t>(), &mut set) }, 0);
    // SAFETY: CPU_ISSET only reads `set`.
    (0..libc::CPU_SETSIZE as usize).filter(|&c| unsafe { libc::CPU_ISSET(c, &set) }).collect()
}

fn serve(stub: &mut Stub, regs: &mut kvm_regs, fs: &mut u64) {
    assert_eq!(stub.run(regs, fs).expect("run"), Exit::Syscall);
    regs.rax = 0;
}

/// A computing guest's stub after its first run, and the CPU the pair was pinned to then.
fn pinned_pair() -> (Stub, kvm_regs, u64, usize) {
    let (mut stub, mut regs) = compute_loop_stub(20_000);
    let mut fs = 0;
    serve(&mut stub, &mut regs, &mut fs);
    let Mode::Pinned { cpu, .. } = stub.placement().mode() else { panic!("not pinned: {:?}", stub.placement().mode()) };
    (stub, regs, fs, cpu)
}

fn placeable() -> bool {
    if placement::home().len() < 2 {
        eprintln!("one CPU: nothing to place");
        return false;
    }
    assert!(placement::enabled_by_env(), "COLLIMATE_SYSTRAP_PLACEMENT=0 is set: unset it to run these tests");
    true
}

#[test]
fn a_guest_that_computes_between_syscalls_shares_one_cpu_with_its_serving_thread() {
    if !placeable() {
        return;
    }
    let (mut stub, _, _, cpu) = pinned_pair();
    assert_eq!(allowed(0), vec![cpu], "the serving thread");
    assert_eq!(allowed(stub.pid()), vec![cpu], "the stub");
    assert!(placement::home().contains(&cpu));
    // Turned off, both get every CPU back.
    stub.set_placement(false);
    assert_eq!(allowed(0), placement::home());
    assert_eq!(allowed(stub.pid()), placement::home());
}

#[test]
fn a_pair_whose_cpu_is_kept_busy_is_unbound_from_it() {
    if !placeable() {
        return;
    }
    let (mut stub, mut regs, mut fs, cpu) = pinned_pair();
    // A busy loop bound to the pair's CPU, for at most 10 s.
    let stop = Arc::new(AtomicBool::new(false));
    let busy = {
        let stop = stop.clone();
        std::thread::spawn(move || {
            // SAFETY: a zeroed cpu_set_t is valid; CPU_SET writes inside it.
            let mut set: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: `cpu` < CPU_SETSIZE.
            unsafe { libc::CPU_SET(cpu, &mut set) };
            // SAFETY: as above.
            assert_eq!(unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &set) }, 0);
            let end = Instant::now() + Duration::from_secs(10);
            while !stop.load(Ordering::Relaxed) && Instant::now() < end {
                std::hint::spin_loop();
            }
        })
    };
    let before = stub.placement().starved;
    let deadline = Instant::now() + Duration::from_secs(8);
    while stub.placement().starved == before && Instant::now() < deadline {
        serve(&mut stub, &mut regs, &mut fs);
    }
    stop.store(true, Ordering::Relaxed);
    busy.join().unwrap();
    assert!(stub.placement().starved > before, "the pair stayed bound to CPU {cpu} behind a busy loop for 8 s");
    assert!(!matches!(stub.placement().mode(), Mode::Pinned { cpu: c, .. } if c == cpu));
}
