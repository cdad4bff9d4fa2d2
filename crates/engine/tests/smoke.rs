mod common;
use collimate_engine::{Launcher, RunExit, Vm, VmConfig};
use common::*;
use std::time::Duration;

fn launcher() -> Launcher {
    Launcher::new(env!("CARGO_BIN_EXE_collimate-vmm"), vec![])
}

#[test]
fn boots_and_yields_ready() {
    let mut vm = Vm::boot(&launcher(), &testvm_elf(), &VmConfig::default()).unwrap();
    let r = vm.run(Duration::from_secs(5)).unwrap();
    assert_eq!(r.exit, RunExit::Yield { value: READY_YIELD }, "{r:?}");
    vm.write_mem(MAILBOX, &mailbox(CMD_HELLO, 0, 0, 0)).unwrap();
    let r = vm.run(Duration::from_secs(5)).unwrap();
    assert_eq!(r.exit, RunExit::Yield { value: CMD_HELLO });
    assert_eq!(r.stdout, HELLO_TEXT);
}
