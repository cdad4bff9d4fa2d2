//! Teardown leaves nothing behind. In its own test binary so no other test's processes or
//! descriptors come and go while it counts.

mod common;

use std::path::PathBuf;
use std::time::Duration;

use collimate_engine::{RunExit, Vm, VmConfig};
use common::*;

const T: Duration = Duration::from_secs(10);

fn cmd(vm: &mut Vm, c: u64, a0: u64, a1: u64, a2: u64) -> u64 {
    vm.write_mem(MAILBOX, &mailbox(c, a0, a1, a2)).unwrap();
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Yield { value: c });
    mailbox_result(&vm.read_mem(MAILBOX, MAILBOX_SIZE).unwrap())
}

fn zygote(_name: &str) -> (Vm, PathBuf) {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("leak-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut vm = Vm::boot(&launcher(), &testvm_elf(), &VmConfig::default()).unwrap();
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Yield { value: READY_YIELD });
    vm.snapshot(&dir).unwrap();
    vm.destroy().unwrap();
    (Vm::restore(&launcher(), &dir).unwrap(), dir)
}

fn fd_count() -> usize {
    std::fs::read_dir("/proc/self/fd").unwrap().count()
}

fn children_of(pid: i32) -> usize {
    let s = std::fs::read_to_string(format!("/proc/{pid}/task/{pid}/children")).unwrap_or_default();
    s.split_whitespace().count()
}

fn rss_kb(pid: i32) -> u64 {
    let s = std::fs::read_to_string(format!("/proc/{pid}/status")).unwrap();
    s.lines().find(|l| l.starts_with("VmRSS:")).and_then(|l| l.split_whitespace().nth(1)?.parse().ok()).unwrap()
}

#[test]
fn a_thousand_clone_destroy_cycles_leave_nothing_behind() {
    let (mut z, _dir) = zygote("leak");
    // Warm up, then take the baseline.
    for _ in 0..20 {
        let mut c = z.clone_vm().unwrap();
        cmd(&mut c, CMD_FILL, 16, 1, 0);
        c.destroy().unwrap();
    }
    let (fds0, kids0, rss0, zrss0) = (fd_count(), children_of(z.pid()), rss_kb(std::process::id() as i32), rss_kb(z.pid()));
    for i in 0..1000 {
        let mut c = z.clone_vm().unwrap();
        if i % 10 == 0 {
            cmd(&mut c, CMD_FILL, 16, 1, 0);
        }
        c.destroy().unwrap();
    }
    assert_eq!(fd_count(), fds0, "fd leak");
    assert_eq!(children_of(z.pid()), kids0, "process leak");
    let (rss1, zrss1) = (rss_kb(std::process::id() as i32), rss_kb(z.pid()));
    assert!(rss1 < rss0 + 8 * 1024, "controller RSS grew {rss0} -> {rss1} kB");
    assert!(zrss1 < zrss0 + 4 * 1024, "zygote RSS grew {zrss0} -> {zrss1} kB");
}

