//! `/bin/sh -c true` natively, on systrap and on KVM, side by side in one run: median and p99 of
//! each and their ratio to the native baseline. Each sample is a whole start: the native row is
//! fork + exec + wait of the host's /bin/sh; the systrap row spawns a confined stub, loads the
//! rootfs's busybox sh into it and runs it to its exit (`vmm::systrap::Process`); the KVM row
//! spawns a VMM process with a new VM, loads the same program and runs it (`Vm::spawn` + `run`).
//!
//! Run: `COLLIMATE_ROOTFS=... cargo bench -p collimate-engine --bench platforms`. Nothing here
//! asserts a time. Name the platform (the KVM module: kvm_pvm here) next to any figure you quote.
//! systrap rows: outside replay (the second: its stub forked from a parked `Template` stub) (rdtsc and cpuid not trapped, `Confinement::for_replay(false)`),
//! in replay mode (both trapped), and in replay mode with the old hand-off (each side spinning
//! ~5.7 ms). Two more rows split the first systrap row into the stub's spawn with the program's
//! load, and the run of the guest to its exit. COLLIMATE_BENCH_TAIL=1 prints each row's slowest.

#[path = "../tests/common/mod.rs"]
mod common;

use std::time::{Duration, Instant};

use collimate_engine::platform::systrap::{Confinement, Handoff, Template};
use collimate_engine::vmm::systrap::Process;
use collimate_engine::{RunExit, SpawnSpec, Vm, VmConfig};

const T: Duration = Duration::from_secs(30);

fn samples() -> usize {
    std::env::var("COLLIMATE_BENCH_SAMPLES").ok().and_then(|s| s.parse().ok()).unwrap_or(100)
}

fn stats(v: &mut [Duration]) -> (Duration, Duration) {
    v.sort();
    let p = |q: f64| v[((v.len() as f64 - 1.0) * q).round() as usize];
    (p(0.5), p(0.99))
}

fn main() {
    let Some(root) = common::python_rootfs() else {
        eprintln!("no python rootfs (COLLIMATE_ROOTFS): nothing to measure");
        return;
    };
    let spec = SpawnSpec {
        root,
        argv: vec![b"/bin/sh".to_vec(), b"-c".to_vec(), b"true".to_vec()],
        envp: vec![b"PATH=/usr/bin:/bin".to_vec()],
        cwd: "/".into(),
        ..Default::default()
    };
    let n = samples();
    let old = Handoff { vmm_spin: Duration::from_micros(5_700), stub_spin: 200_000, yields: 0, adaptive: false };
    // (name, confinement, hand-off; None: the default)
    let spin50 = Handoff { vmm_spin: Duration::from_micros(50), stub_spin: 2_000, yields: 2, adaptive: false };
    let systraps: [(&str, Confinement, Option<Handoff>); 7] = [
        ("systrap", Confinement::for_replay(false), None),
        ("systrap, from a template", Confinement::for_replay(false), None),
        ("systrap, spin 50 us/2000", Confinement::for_replay(false), Some(spin50.clone())),
        ("systrap, template, spin 50 us", Confinement::for_replay(false), Some(spin50)),
        ("systrap, old spin", Confinement::for_replay(false), Some(old.clone())),
        ("systrap, replay traps", Confinement::for_replay(true), None),
        ("systrap, replay traps, old spin", Confinement::for_replay(true), Some(old)),
    ];
    let mut rows: Vec<(&str, Vec<Duration>)> = vec![("native /bin/sh -c true", vec![]), ("kvm", vec![])];
    for (name, _, _) in &systraps {
        rows.push((name, vec![]));
    }
    rows.push(("  systrap: spawn + load", vec![]));
    rows.push(("  systrap: run to exit", vec![]));
    let launcher = common::launcher();
    let mut template = Template::new(&Confinement::for_replay(false)).expect("systrap template stub");
    // Interleaved, so that load on the machine falls on every row alike.
    for _ in 0..n {
        let t = Instant::now();
        let st = std::process::Command::new("/bin/sh").args(["-c", "true"]).status().expect("run /bin/sh");
        rows[0].1.push(t.elapsed());
        assert!(st.success());

        for (i, (_, conf, h)) in systraps.iter().enumerate() {
            let t = Instant::now();
            let mut p = if i == 1 || i == 3 { Process::spawn_from(&spec, &mut template) } else { Process::spawn(&spec, conf) }.expect("systrap spawn");
            if let Some(h) = h {
                p.set_handoff(h.clone());
            }
            let loaded = t.elapsed();
            let r = p.run(T).expect("systrap run");
            let ran = t.elapsed() - loaded;
            drop(p);
            rows[2 + i].1.push(t.elapsed());
            if i == 0 {
                let k = rows.len();
                rows[k - 2].1.push(loaded);
                rows[k - 1].1.push(ran);
            }
            assert_eq!(r.exit, RunExit::Exited { code: 0 });
        }

        let t = Instant::now();
        let mut vm = Vm::spawn(&launcher, &spec, &VmConfig::default()).expect("kvm spawn");
        let r = vm.run(T).expect("kvm run");
        vm.destroy().expect("kvm destroy");
        rows[1].1.push(t.elapsed());
        assert_eq!(r.exit, RunExit::Exited { code: 0 });
    }
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("host load (1/5/15 min) at the end: {}", load.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
    let (base, _) = stats(&mut rows[0].1.clone());
    println!("/bin/sh -c true, {n} samples each (kvm: this host's KVM module, e.g. kvm_pvm)");
    println!("{:<26} {:>12} {:>12} {:>10}", "platform", "median", "p99", "x native");
    for (name, v) in rows.iter_mut() {
        let (med, p99) = stats(v);
        if std::env::var_os("COLLIMATE_BENCH_TAIL").is_some() {
            println!("  slowest: {:?}", v.iter().rev().take(4).collect::<Vec<_>>());
        }
        println!("{:<26} {:>10.3}ms {:>10.3}ms {:>9.2}x", name, med.as_secs_f64() * 1e3, p99.as_secs_f64() * 1e3, med.as_secs_f64() / base.as_secs_f64());
    }
}
