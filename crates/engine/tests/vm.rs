//! Integration tests that need /dev/kvm: boot, snapshot/restore, fork, reset, preemption, faults,
//! teardown. Guest: guest/testprogs/testvm.S (built by the test, see common/mod.rs).

mod common;

use std::path::PathBuf;
use std::time::{Duration, Instant};

use collimate_engine::{Error, RunExit, Vm, VmConfig};
use common::*;

const T: Duration = Duration::from_secs(10);

fn tmpdir(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// A booted testvm, run to its ready yield.
fn ready_vm() -> Vm {
    let mut vm = Vm::boot(&launcher(), &testvm_elf(), &VmConfig::default()).unwrap();
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Yield { value: READY_YIELD });
    vm
}

/// Send one mailbox command and run to its yield; returns the result word.
fn cmd(vm: &mut Vm, c: u64, a0: u64, a1: u64, a2: u64) -> u64 {
    vm.write_mem(MAILBOX, &mailbox(c, a0, a1, a2)).unwrap();
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Yield { value: c }, "{r:?}");
    mailbox_result(&vm.read_mem(MAILBOX, MAILBOX_SIZE).unwrap())
}

/// A snapshot of a ready testvm, and a zygote restored from it.
fn zygote(name: &str) -> (Vm, PathBuf) {
    let dir = tmpdir(name);
    let mut vm = ready_vm();
    vm.snapshot(&dir).unwrap();
    vm.destroy().unwrap();
    (Vm::restore(&launcher(), &dir).unwrap(), dir)
}

fn pattern_regs(seed: u64) -> ([u64; NUM_GPRS], [[u8; YMM_SIZE]; NUM_YMM]) {
    let mut x = seed | 1;
    let mut next = || {
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        x
    };
    let gprs = std::array::from_fn(|_| next());
    let ymm = std::array::from_fn(|_| {
        let mut b = [0u8; YMM_SIZE];
        for c in b.chunks_mut(8) {
            c.copy_from_slice(&next().to_le_bytes());
        }
        b
    });
    (gprs, ymm)
}

#[test]
fn runs_commands_and_captures_output() {
    let mut vm = ready_vm();
    assert_eq!(cmd(&mut vm, CMD_FILL, 10, 7, 0), 10);
    assert_eq!(cmd(&mut vm, CMD_SUM, 10, 0, 0), 70);
    vm.write_mem(MAILBOX, &mailbox(CMD_HELLO, 0, 0, 0)).unwrap();
    let r = vm.run(T).unwrap();
    assert_eq!(r.stdout, HELLO_TEXT);
    assert_eq!(cmd(&mut vm, CMD_UNKNOWN_SYSCALL, 999, 0, 0) as i64, -ENOSYS);
    vm.write_mem(MAILBOX, &mailbox(CMD_EXIT, 3, 0, 0)).unwrap();
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Exited { code: 3 });
}

#[test]
fn registers_and_ymm_survive_snapshot_restore_bit_for_bit() {
    let dir = tmpdir("regs");
    let mut vm = ready_vm();
    let (gprs, ymm) = pattern_regs(0x1234_5678);
    vm.write_mem(REGS_IN, &pack_regs_in(&gprs, &ymm)).unwrap();
    vm.write_mem(MAILBOX, &mailbox(CMD_LOADREGS, 0, 0, 0)).unwrap();
    // The guest stops on `out` with every register loaded from REGS_IN.
    assert!(matches!(vm.run(T).unwrap().exit, RunExit::Io { port: IO_PORT, .. }));
    let before = vm.vcpu_state().unwrap();
    vm.snapshot(&dir).unwrap();
    vm.destroy().unwrap();

    let mut restored = Vm::restore(&launcher(), &dir).unwrap();
    let after = restored.vcpu_state().unwrap();
    assert_eq!(before.regs, after.regs);
    assert_eq!(before.sregs, after.sregs);
    assert_eq!(before.xsave, after.xsave, "XSAVE (x87/SSE/AVX) differs");
    assert_eq!(before.msrs.iter().filter(|m| m.index != 0x10).collect::<Vec<_>>(),
               after.msrs.iter().filter(|m| m.index != 0x10).collect::<Vec<_>>());
    assert_eq!(restored.run(T).unwrap().exit, RunExit::Yield { value: CMD_LOADREGS });
    let (g2, y2) = unpack_regs(&restored.read_mem(REGS_OUT, REGS_USED).unwrap());
    assert_eq!(g2, gprs);
    assert_eq!(y2, ymm);
}

#[test]
fn forked_children_diverge_and_never_see_each_other() {
    let mut parent = ready_vm();
    assert_eq!(cmd(&mut parent, CMD_FILL, 64, 1, 0), 64); // shared prefix: 64 pages of 1s
    let mut kids = parent.fork(4).unwrap();
    for (i, k) in kids.iter_mut().enumerate() {
        assert_eq!(k.regs().unwrap().rip, parent.regs().unwrap().rip);
        assert_eq!(cmd(k, CMD_SUM, 64, 0, 0), 64, "child {i} inherits the prefix");
        cmd(k, CMD_FILL, 64, 10 + i as u64, 0);
    }
    assert_eq!(cmd(&mut parent, CMD_SUM, 64, 0, 0), 64, "parent untouched");
    cmd(&mut parent, CMD_FILL, 64, 99, 0);
    for (i, k) in kids.iter_mut().enumerate() {
        assert_eq!(cmd(k, CMD_SUM, 64, 0, 0), 64 * (10 + i as u64), "child {i} sees only its own writes");
        assert_eq!(k.read_mem(heap_page(5), 1).unwrap(), vec![10 + i as u8]);
    }
    // A grandchild forked from a child mid-run inherits that child's memory.
    let mut g = kids[2].clone_vm().unwrap();
    assert_eq!(cmd(&mut g, CMD_SUM, 64, 0, 0), 64 * 12);
}

#[test]
fn reset_restores_memory_and_registers_exactly() {
    let (mut z, _dir) = zygote("reset");
    let mut c = z.clone_vm().unwrap();
    let pristine = c.read_mem(heap_page(0), 4 * 4096).unwrap();
    let regs = c.regs().unwrap();
    for round in 0..3u64 {
        assert_eq!(cmd(&mut c, CMD_FILL, 300, 5 + round, 0), 300);
        let st = c.reset().unwrap();
        assert!(st.dirty_pages >= 300, "{st:?}");
        assert_eq!(c.read_mem(heap_page(0), 4 * 4096).unwrap(), pristine);
        assert_eq!(c.regs().unwrap(), regs);
        assert_eq!(cmd(&mut c, CMD_SUM, 300, 0, 0), 0);
        c.reset().unwrap();
    }
    // A booted VM has no snapshot to return to.
    let mut b = ready_vm();
    assert!(matches!(b.reset(), Err(Error::ResetUnavailable(_))));
}

#[test]
fn spinning_guest_is_stopped_by_the_timeout() {
    let mut vm = ready_vm();
    vm.write_mem(MAILBOX, &mailbox(CMD_SPIN, 0, 0, 0)).unwrap();
    let t0 = Instant::now();
    let r = vm.run(Duration::from_millis(200)).unwrap();
    assert_eq!(r.exit, RunExit::Timeout);
    assert!(t0.elapsed() < Duration::from_secs(5));
    // Still alive and resumable: it goes on spinning.
    assert_eq!(vm.run(Duration::from_millis(50)).unwrap().exit, RunExit::Timeout);
}

#[test]
fn guest_faults_reach_the_host() {
    for kind in [FAULT_UD2, FAULT_NULL_WRITE, FAULT_KERNEL_JUMP, FAULT_INT3, FAULT_DIV0] {
        let mut vm = ready_vm();
        vm.write_mem(MAILBOX, &mailbox(CMD_FAULT, kind, 0, 0)).unwrap();
        match vm.run(T).unwrap().exit {
            RunExit::Fault { vector, cr2, rip, .. } => {
                assert_eq!(vector, fault_vector(kind), "fault kind {kind}");
                if kind == FAULT_NULL_WRITE {
                    assert_eq!(cr2, 0);
                }
                if kind == FAULT_KERNEL_JUMP {
                    assert_eq!((cr2, rip), (FAULT_KERNEL_ADDR, FAULT_KERNEL_ADDR));
                }
            }
            other => panic!("fault kind {kind}: {other:?}"),
        }
    }
}

#[test]
fn damaged_snapshots_are_refused_clearly() {
    let (z, dir) = zygote("damaged");
    drop(z);
    let state = std::fs::read(dir.join("vm.state")).unwrap();
    let mut flipped = state.clone();
    let mid = flipped.len() / 2;
    flipped[mid] ^= 1;
    std::fs::write(dir.join("vm.state"), &flipped).unwrap();
    let e = Vm::restore(&launcher(), &dir).unwrap_err();
    assert!(matches!(e, Error::SnapshotCorrupt { .. }), "{e}");
    assert!(e.to_string().contains("damaged"), "{e}");
    std::fs::write(dir.join("vm.state"), &state[..state.len() - 9]).unwrap();
    assert!(matches!(Vm::restore(&launcher(), &dir), Err(Error::SnapshotCorrupt { .. })));
    std::fs::write(dir.join("vm.state"), &state).unwrap();
    let mem = std::fs::OpenOptions::new().write(true).open(dir.join("vm.mem")).unwrap();
    mem.set_len(1 << 20).unwrap();
    let e = Vm::restore(&launcher(), &dir).unwrap_err();
    assert!(matches!(e, Error::SnapshotCorrupt { .. }), "{e}");
}

#[test]
fn a_killed_vmm_is_reported_not_hung() {
    let mut vm = ready_vm();
    // SAFETY: killing the VMM process we own.
    unsafe { libc::kill(vm.pid(), libc::SIGKILL) };
    let e = vm.run(T).unwrap_err();
    assert!(matches!(e, Error::VmmDied { .. }), "{e}");
    assert!(matches!(vm.run(T), Err(Error::Destroyed)));
}

#[test]
fn spare_pool_clones_match_cold_clones_and_track_the_parent() {
    let (mut z, _dir) = zygote("spares");
    let mut cold = z.clone_vm().unwrap();
    z.set_spare_pool(3).unwrap();
    std::thread::sleep(Duration::from_millis(300)); // let the pool fill
    let mut warm = z.fork(5).unwrap(); // 3 spares + 2 cold
    let reference = cold.vcpu_state().unwrap();
    for w in &mut warm {
        let s = w.vcpu_state().unwrap();
        assert_eq!(s.regs, reference.regs);
        assert_eq!(s.xsave, reference.xsave);
        assert_eq!(cmd(w, CMD_SUM, 8, 0, 0), 0);
        cmd(w, CMD_FILL, 8, 9, 0);
    }
    // Writing the parent's memory discards its spares: the next clone sees the new state.
    z.write_mem(heap_page(0), &[42]).unwrap();
    let mut after = z.clone_vm().unwrap();
    assert_eq!(after.read_mem(heap_page(0), 1).unwrap(), vec![42]);
    assert!(z.set_spare_pool(1000).is_err());
}
