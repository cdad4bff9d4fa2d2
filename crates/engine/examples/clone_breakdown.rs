//! Where the time of a clone goes: hand-over vs first run, cold vs with spares.
//! `cargo run --release -p collimate-engine --example clone_breakdown -- <testvm ELF>`
use std::time::{Duration, Instant};

use collimate_engine::{Launcher, Vm, VmConfig};

fn main() {
    let elf = std::fs::read(std::env::args().nth(1).expect("path to a guest ELF")).unwrap();
    let exe = std::env::current_exe().unwrap();
    let vmm = exe.parent().unwrap().parent().unwrap().join("collimate-vmm");
    let l = Launcher::new(vmm, vec![]);
    let dir = std::env::temp_dir().join(format!("breakdown-{}", std::process::id()));
    let mut vm = Vm::boot(&l, &elf, &VmConfig::default()).unwrap();
    vm.run(Duration::from_secs(5)).unwrap();
    vm.snapshot(&dir).unwrap();
    let mut z = Vm::restore(&l, &dir).unwrap();
    for spares in [0usize, 2] {
        z.set_spare_pool(spares).unwrap();
        let (mut a, mut b) = (vec![], vec![]);
        for _ in 0..300 {
            std::thread::sleep(Duration::from_millis(3));
            let t = Instant::now();
            let mut c = z.clone_vm().unwrap();
            let t1 = t.elapsed();
            c.run(Duration::from_secs(5)).unwrap();
            let t2 = t.elapsed() - t1;
            a.push(t1);
            b.push(t2);
            c.destroy().unwrap();
        }
        a.sort();
        b.sort();
        println!("spares={spares}: clone p50 {:?} p99 {:?} | first run p50 {:?} p99 {:?}", a[150], a[297], b[150], b[297]);
    }
    std::fs::remove_dir_all(&dir).unwrap();
}
