//! Engine hot paths, measured with criterion and summarised as median / p99 / ratio to a host baseline
//! (fork() + _exit() + waitpid() of this benchmark process) measured in the same run.
//!
//! Run: `cargo bench -p collimate-engine --bench fork`. Nothing here asserts a time.

#[path = "../tests/common/mod.rs"]
#[allow(dead_code)]
mod common;

use std::path::PathBuf;
use std::sync::Mutex;
use std::time::{Duration, Instant};

use collimate_engine::{RunExit, Vm, VmConfig};
use common::*;
use criterion::{criterion_group, criterion_main, Criterion};

const T: Duration = Duration::from_secs(30);

static SAMPLES: Mutex<Vec<(String, Vec<Duration>)>> = Mutex::new(Vec::new());

fn record(name: &str, d: Duration) {
    let mut s = SAMPLES.lock().unwrap();
    match s.iter_mut().find(|(n, _)| n == name) {
        Some((_, v)) => v.push(d),
        None => s.push((name.to_string(), vec![d])),
    }
}

fn cmd(vm: &mut Vm, c: u64, a0: u64, a1: u64, a2: u64) {
    vm.write_mem(MAILBOX, &mailbox(c, a0, a1, a2)).unwrap();
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Yield { value: c });
}

fn zygote() -> Vm {
    let dir = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("bench-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    let mut vm = Vm::boot(&launcher(), &testvm_elf(), &VmConfig::default()).unwrap();
    assert_eq!(vm.run(T).unwrap().exit, RunExit::Yield { value: READY_YIELD });
    vm.snapshot(&dir).unwrap();
    vm.destroy().unwrap();
    Vm::restore(&launcher(), &dir).unwrap()
}

fn host_fork_baseline() -> Duration {
    let t = Instant::now();
    // SAFETY: the child only calls _exit.
    let pid = unsafe { libc::fork() };
    if pid == 0 {
        // SAFETY: async-signal-safe exit in the child.
        unsafe { libc::_exit(0) };
    }
    let mut st = 0;
    // SAFETY: waiting for our own child.
    unsafe { libc::waitpid(pid, &mut st, 0) };
    t.elapsed()
}

fn benches(c: &mut Criterion) {
    let mut z = zygote();
    let mut g = c.benchmark_group("engine");
    g.sample_size(100).measurement_time(Duration::from_secs(4));

    g.bench_function("host fork+_exit+wait (baseline)", |b| {
        b.iter_custom(|iters| {
            let mut total = Duration::ZERO;
            for _ in 0..iters {
                let d = host_fork_baseline();
                record("host fork+_exit+wait (baseline)", d);
                total += d;
            }
            total
        })
    });

    // What a Linux sandbox's disk quota adds to each clone and fork: its own tmpfs instance
    // (the bare test guest here has no files, so its clones below make none).
    if collimate_engine::quota::available() {
        let name = "tmpfs for a sandbox's disk quota";
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let s = collimate_engine::quota::Scratch::new(collimate_engine::quota::DEFAULT_QUOTA).unwrap();
                    let d = t.elapsed();
                    drop(s);
                    record(name, d);
                    total += d;
                }
                total
            })
        });
    }

    // The zygote waits at its ready yield; a clone's first instructions read the (empty) mailbox
    // and yield again.
    for (spares, name) in [(0, "clone to first guest exit, cold"), (2, "clone to first guest exit, 2 spares")] {
        z.set_spare_pool(spares).unwrap();
        g.bench_function(name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let mut c = z.clone_vm().unwrap();
                    c.run(T).unwrap();
                    let d = t.elapsed();
                    record(name, d);
                    total += d;
                    c.destroy().unwrap();
                }
                total
            })
        });
    }
    z.set_spare_pool(0).unwrap();

    // A live, mid-episode guest with 10 MiB dirty.
    let mut live = z.clone_vm().unwrap();
    cmd(&mut live, CMD_FILL, 2560, 1, 0);
    for n in [1usize, 64] {
        let name = format!("live fork, 10 MiB dirty, into {n}");
        let sample = if n == 1 { 100 } else { 10 };
        g.sample_size(sample.max(10));
        g.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    let t = Instant::now();
                    let kids = live.fork(n).unwrap();
                    let d = t.elapsed();
                    record(&name, d);
                    total += d;
                    drop(kids);
                }
                total
            })
        });
    }
    g.sample_size(100);

    let mut clone = z.clone_vm().unwrap();
    for pages in [10u64, 100, 1000] {
        let name = format!("reset, {pages} dirty pages");
        g.bench_function(&name, |b| {
            b.iter_custom(|iters| {
                let mut total = Duration::ZERO;
                for _ in 0..iters {
                    cmd(&mut clone, CMD_FILL, pages, 3, 0);
                    // Reset's own duration, measured inside the VMM process (no IPC in the figure).
                    let st = clone.reset().unwrap();
                    record(&name, st.duration);
                    total += st.duration;
                }
                total
            })
        });
    }
    g.finish();

    let idle = z.clone_vm().unwrap();
    let mut idle = idle;
    let stats = idle.mem_stats().unwrap();
    summary(stats.private_bytes, stats.dirty_pages);
}

fn pct(v: &mut [Duration], p: f64) -> Duration {
    v.sort();
    v[((v.len() as f64 - 1.0) * p).round() as usize]
}

fn summary(idle_private: u64, idle_dirty: u64) {
    let mut s = SAMPLES.lock().unwrap();
    let base = s.iter_mut().find(|(n, _)| n.contains("baseline")).map(|(_, v)| pct(v, 0.5)).unwrap();
    println!("\n{:<44} {:>8} {:>10} {:>10} {:>12}", "engine benchmark", "samples", "median", "p99", "x baseline");
    for (name, v) in s.iter_mut() {
        let (p50, p99) = (pct(v, 0.5), pct(v, 0.99));
        println!(
            "{:<44} {:>8} {:>10} {:>10} {:>12.2}",
            name,
            v.len(),
            format!("{:.1?}", p50),
            format!("{:.1?}", p99),
            p50.as_secs_f64() / base.as_secs_f64()
        );
    }
    println!(
        "idle clone private memory: {:.1} KiB ({} dirty guest pages)\n",
        idle_private as f64 / 1024.0,
        idle_dirty
    );
}

criterion_group!(engine, benches);
criterion_main!(engine);
