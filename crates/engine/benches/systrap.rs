//! The systrap platform's hot path, with its baselines measured in the same run (systrap does not
//! use KVM; every figure says "systrap" or "native"):
//! - native `getppid` (the floor);
//! - a futex wake-and-wait round trip between two host processes (the baseline);
//! - a bare trapped guest syscall round trip through a stub (the VMM answers at once), with the
//!   wake-up tuned several ways (`Handoff`: futex only, yields, spins), with `rdtsc` and `cpuid`
//!   trapped (replay mode) and not;
//! - a 4 KiB guest memory read through /proc/<pid>/mem and through process_vm_readv;
//! - first, in alternated rounds (the load moves): a served sandbox's stub as it was (rdtsc and
//!   cpuid trapped for its whole life), as it is now in a replay exec (rdtsc switched on by
//!   `Stub::set_traps`) and outside replay or with `COLLIMATE_TRAP_RDTSC=0` (nothing switched
//!   on), each with the default hand-off (yield, then sleep) and the adaptive spin
//!   (`Handoff::adaptive`), each right after a futex baseline, with the ranges over the rounds;
//!   then the two hand-offs with the VMM thread and the stub pinned to one CPU (where a spin
//!   cannot be answered), with a guest that computes between syscalls (the VMM thread's CPU time
//!   per round trip: what a spin that is not answered burns), and pinned to two CPUs. In the
//!   same alternated rounds: the hand-off with one yield and with none (futex only) before the
//!   sleep, and a guest looping over `mov eax, 39; syscall` (glibc's site) with the site patched
//!   (`platform::systrap::patch`, the default) and not (`Stub::set_patching(false)`, as
//!   `COLLIMATE_SYSTRAP_PATCH=0`), with the patched sites and entries counted.
//!   `COLLIMATE_BENCH_TRAPS_ONLY=1` stops after that section.
//!
//! Each case prints median and p99 over individually timed operations, and the ratio of the
//! trapped round trip to the futex round trip; criterion then reports its own estimate of the mean
//! for the same closures. Run: `cargo bench -p collimate-engine --bench systrap`.

use std::sync::atomic::{AtomicU32, Ordering};
use std::time::{Duration, Instant};

use collimate_engine::platform::systrap::{kvm_regs, memory, tsc, Confinement, Exit, Handoff, Stub, Template, Traps};
use criterion::{criterion_group, criterion_main, Criterion};

const SAMPLES: usize = 10_000;

struct Stats {
    median_us: f64,
    p99_us: f64,
}

fn measure(mut op: impl FnMut()) -> Stats {
    for _ in 0..SAMPLES / 10 {
        op();
    }
    // The clock_gettime syscall for every row: after a replay row this thread traps rdtsc as its
    // stub does, and the vDSO's clock would be rescued (`tsc`). It adds the same ~0.3 us to every
    // sample ("clock read" row).
    let mut t: Vec<u64> = (0..SAMPLES)
        .map(|_| {
            let s = raw_ns();
            op();
            raw_ns() - s
        })
        .collect();
    t.sort_unstable();
    let q = |p: f64| t[((t.len() - 1) as f64 * p) as usize] as f64 / 1000.0;
    Stats { median_us: q(0.5), p99_us: q(0.99) }
}

fn raw_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: the clock_gettime syscall writes one timespec we own.
    unsafe { libc::syscall(libc::SYS_clock_gettime, libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn print(name: &str, s: &Stats) {
    println!("{name:<58} median {:>8.3} us   p99 {:>8.3} us", s.median_us, s.p99_us);
}

/// Two host processes passing a turn through a futex in a shared page (no spinning).
struct FutexPair {
    word: *const AtomicU32,
    child: i32,
}

impl FutexPair {
    fn new() -> FutexPair {
        // SAFETY: a new shared anonymous page, used only through `word`.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(p, libc::MAP_FAILED);
        let word = p as *const AtomicU32;
        // SAFETY: the child only touches the shared word and exits with _exit.
        let child = unsafe { libc::fork() };
        if child == 0 {
            // SAFETY: the page stays mapped in the child.
            let w = unsafe { &*word };
            loop {
                match w.load(Ordering::Acquire) {
                    1 => {
                        w.store(2, Ordering::Release);
                        wake(w);
                    }
                    // SAFETY: ending the forked child without running the parent's destructors.
                    3 => unsafe { libc::_exit(0) },
                    v => wait(w, v),
                }
            }
        }
        FutexPair { word, child }
    }

    fn round_trip(&self) {
        // SAFETY: the page is mapped for our life.
        let w = unsafe { &*self.word };
        w.store(1, Ordering::Release);
        wake(w);
        loop {
            let v = w.load(Ordering::Acquire);
            if v == 2 {
                break;
            }
            wait(w, v);
        }
    }
}

impl Drop for FutexPair {
    fn drop(&mut self) {
        // SAFETY: as above; then reap our child.
        unsafe {
            (*self.word).store(3, Ordering::Release);
            wake(&*self.word);
            libc::waitpid(self.child, std::ptr::null_mut(), 0);
        }
    }
}

static TIMED: AtomicU32 = AtomicU32::new(0);

fn wait(w: &AtomicU32, v: u32) {
    let ts = libc::timespec { tv_sec: 0, tv_nsec: 50_000_000 };
    let t = if TIMED.load(Ordering::Relaxed) != 0 { &ts as *const libc::timespec } else { std::ptr::null() };
    // SAFETY: a valid aligned word; shared (not private) futex because two processes use it.
    unsafe { libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAIT, v, t) };
}

fn wake(w: &AtomicU32) {
    // SAFETY: as above.
    unsafe { libc::syscall(libc::SYS_futex, w.as_ptr(), libc::FUTEX_WAKE, 1) };
}

/// A stub running `syscall; jmp back` forever.
fn syscall_loop_stub(conf: &Confinement) -> (Stub, kvm_regs) {
    let mut stub = Stub::spawn(conf).expect("spawn a systrap stub");
    stub.map(0x40_0000, 4096, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_PRIVATE, None, 0).unwrap();
    stub.write(0x40_0000, &[0x0f, 0x05, 0xeb, 0xfc]).unwrap();
    stub.map(0x50_0000, 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, None, 0).unwrap();
    let regs = kvm_regs { rip: 0x40_0000, rsp: 0x50_1000, rflags: 0x202, rax: libc::SYS_getppid as u64, ..Default::default() };
    (stub, regs)
}

/// Where [`site_loop_stub`]'s code goes: where guestos places libraries, within a `jmp rel32` of
/// the stub's trampolines (a patchable site).
const SITE_CODE: u64 = 0x7fff_a000_0000;

/// A stub running `mov eax, 39; syscall; jmp back` forever (the site glibc's wrappers have):
/// patched after its first trap unless `patch` is false (`Stub::set_patching`).
fn site_loop_stub(conf: &Confinement, patch: bool) -> (Stub, kvm_regs) {
    let mut stub = Stub::spawn(conf).expect("spawn a systrap stub");
    stub.set_patching(patch);
    stub.map(SITE_CODE, 4096, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_PRIVATE, None, 0).unwrap();
    stub.write(SITE_CODE, &[0xb8, 39, 0, 0, 0, 0x0f, 0x05, 0xeb, 0xf7]).unwrap();
    stub.map(0x50_0000, 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, None, 0).unwrap();
    let regs = kvm_regs { rip: SITE_CODE, rsp: 0x50_1000, rflags: 0x202, ..Default::default() };
    (stub, regs)
}

/// A stub running `mov ecx, iters; 1: dec ecx; jnz 1b; syscall; jmp back` forever: guest work
/// between syscalls.
fn compute_loop_stub(iters: u32) -> (Stub, kvm_regs) {
    let mut stub = Stub::spawn(&Confinement::for_replay(false)).expect("spawn a systrap stub");
    stub.map(0x40_0000, 4096, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_PRIVATE, None, 0).unwrap();
    let mut code = vec![0xb9];
    code.extend_from_slice(&iters.to_le_bytes()); // mov ecx, iters
    code.extend_from_slice(&[0xff, 0xc9, 0x75, 0xfc, 0x0f, 0x05, 0xeb, 0xf3]); // dec ecx; jnz -4; syscall; jmp -13
    stub.write(0x40_0000, &code).unwrap();
    stub.map(0x50_0000, 4096, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE, None, 0).unwrap();
    let regs = kvm_regs { rip: 0x40_0000, rsp: 0x50_1000, rflags: 0x202, ..Default::default() };
    (stub, regs)
}

/// This thread's CPU time in ns.
fn thread_cpu_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_THREAD_CPUTIME_ID, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

fn trapped_round_trip(stub: &mut Stub, regs: &mut kvm_regs, fs: &mut u64) {
    let e = stub.run(regs, fs).expect("run");
    assert_eq!(e, Exit::Syscall);
    regs.rax = 0;
}

/// The round trip of a served sandbox's stub, before and after the traps became per exec, in
/// alternated rounds, each right after its own futex baseline (the default hand-off).
fn per_exec_traps(pair: &FutexPair) {
    const ROUNDS: usize = 5;
    let (y, a) = (Handoff::yield_then_sleep(), Handoff::adaptive());
    let rd = Traps { rdtsc: true, cpuid: false };
    // The last field: whether the VMM thread takes its stub's rdtsc mode (`tsc::match_stub`).
    let y1 = Handoff { yields: 1, ..Handoff::yield_then_sleep() };
    let y0 = Handoff { yields: 0, ..Handoff::yield_then_sleep() };
    let rows: [(&str, Confinement, Traps, Handoff, bool); 14] = [
        ("before: rdtsc+cpuid trapped for life, yield+sleep", Confinement::for_replay(true), Traps::default(), y.clone(), false),
        ("replay exec (rdtsc on), VMM thread not matched, yield+sleep", Confinement::for_replay(false), rd, y.clone(), false),
        ("replay exec (rdtsc on), VMM thread not matched, adaptive", Confinement::for_replay(false), rd, a.clone(), false),
        ("replay exec (rdtsc on), VMM thread matched, yield+sleep", Confinement::for_replay(false), rd, y.clone(), true),
        ("replay exec (rdtsc on), VMM thread matched, adaptive", Confinement::for_replay(false), rd, a.clone(), true),
        ("outside replay (no traps), yield+sleep", Confinement::for_replay(false), Traps::default(), y, true),
        ("outside replay (no traps), adaptive spin", Confinement::for_replay(false), Traps::default(), a, true),
        ("replay exec, matched, 1 yield then sleep", Confinement::for_replay(false), rd, y1, true),
        ("replay exec, matched, no yield (futex only)", Confinement::for_replay(false), rd, y0, true),
        ("SITE unpatched: replay exec, matched, yield+sleep", Confinement::for_replay(false), rd, Handoff::yield_then_sleep(), true),
        ("SITE patched: replay exec, matched, yield+sleep", Confinement::for_replay(false), rd, Handoff::yield_then_sleep(), true),
        ("SITE unpatched: replay exec, matched, adaptive", Confinement::for_replay(false), rd, Handoff::adaptive(), true),
        ("SITE patched: replay exec, matched, adaptive", Confinement::for_replay(false), rd, Handoff::adaptive(), true),
        // The default: placement on (platform::systrap::placement; every other row has it off).
        ("SITE patched: replay exec, matched, adaptive, placement", Confinement::for_replay(false), rd, Handoff::adaptive(), true),
    ];
    // Measure row `i`'s round trip right after a futex baseline taken with this thread's rdtsc
    // native (as the baseline's processes have it).
    let row = |i: usize, stubs: &mut Vec<(Stub, kvm_regs)>, fs: &mut u64| {
        tsc::release();
        let base = measure(|| pair.round_trip());
        tsc::set_matching(rows[i].4);
        let (stub, regs) = &mut stubs[i];
        let s = measure(|| trapped_round_trip(stub, regs, fs));
        tsc::set_matching(true);
        tsc::release();
        (base, s)
    };
    let mut stubs: Vec<(Stub, kvm_regs)> = rows
        .iter()
        .map(|(name, conf, traps, h, _)| {
            let (mut stub, regs) = match name.split(':').next() {
                Some("SITE unpatched") => site_loop_stub(conf, false),
                Some("SITE patched") => site_loop_stub(conf, true),
                _ => syscall_loop_stub(conf),
            };
            if *traps != Traps::default() {
                stub.set_traps(*traps).expect("switch the traps");
            }
            stub.set_handoff(h.clone());
            // Each row measures its hand-off as set, on the CPUs the scheduler picks, but the last.
            stub.set_placement(name.ends_with("placement"));
            (stub, regs)
        })
        .collect();
    let mut fs = 0u64;
    // Per row: (median, p99, median ratio) of each round.
    let mut seen: Vec<Vec<(f64, f64, f64)>> = vec![Vec::new(); rows.len()];
    let mut base_seen = Vec::new();
    for round in 0..ROUNDS {
        for (i, (name, _, _, _, _)) in rows.iter().enumerate() {
            let (base, s) = row(i, &mut stubs, &mut fs);
            let ratio = s.median_us / base.median_us;
            println!(
                "round {round}: futex {:>7.2} us (p99 {:>7.2}) | systrap {name:<54} {:>7.2} us (p99 {:>8.2}) = {ratio:.2}x",
                base.median_us, base.p99_us, s.median_us, s.p99_us
            );
            seen[i].push((s.median_us, s.p99_us, ratio));
            base_seen.push((base.median_us, base.p99_us));
        }
    }
    for (i, (name, ..)) in rows.iter().enumerate() {
        if name.starts_with("SITE") {
            println!("{name}: patched sites {}, patched entries {}", stubs[i].0.patched_sites(), stubs[i].0.patched_entries());
        }
    }
    let range = |v: &mut Vec<f64>| {
        v.sort_by(f64::total_cmp);
        format!("{:.2}-{:.2}", v[0], v[v.len() - 1])
    };
    let (mut bm, mut bp): (Vec<f64>, Vec<f64>) = base_seen.iter().copied().unzip();
    println!("{:<66} median {} us, p99 {} us", "native futex wake+wait round trip, two processes (every round)", range(&mut bm), range(&mut bp));
    for (i, (name, _, _, _, _)) in rows.iter().enumerate() {
        let mut m: Vec<f64> = seen[i].iter().map(|x| x.0).collect();
        let mut p: Vec<f64> = seen[i].iter().map(|x| x.1).collect();
        let mut r: Vec<f64> = seen[i].iter().map(|x| x.2).collect();
        println!("systrap {name:<58} median {} us, p99 {} us, {}x its futex baseline", range(&mut m), range(&mut p), range(&mut r));
    }
    // Both on one CPU: an adaptive spin must stop spinning (each miss backs it off).
    let pin = |pid: i32, cpu: Option<usize>| {
        // SAFETY: a zeroed cpu_set_t is valid; CPU_SET and sched_setaffinity only touch it.
        unsafe {
            let mut set: libc::cpu_set_t = std::mem::zeroed();
            for c in 0..libc::sysconf(libc::_SC_NPROCESSORS_ONLN).max(1) as usize {
                if cpu.is_none_or(|x| x == c) {
                    libc::CPU_SET(c, &mut set);
                }
            }
            libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
        }
    };
    // SAFETY: sched_getcpu has no preconditions.
    let cpu = unsafe { libc::sched_getcpu() }.max(0) as usize;
    let pinned: Vec<usize> = vec![1, 3, 5, 6];
    if pinned.iter().all(|&i| pin(stubs[i].0.pid(), Some(cpu))) && pin(0, Some(cpu)) {
        for round in 0..2 {
            for &i in &pinned {
                let (base, s) = row(i, &mut stubs, &mut fs);
                println!(
                    "pinned round {round}: futex {:>7.2} us (p99 {:>7.2}) | systrap {:<54} {:>7.2} us (p99 {:>8.2}) = {:.2}x",
                    base.median_us, base.p99_us, rows[i].0, s.median_us, s.p99_us, s.median_us / base.median_us
                );
            }
        }
        pin(0, None);
    }
    // A guest that computes 50000 loop iterations (tens of us) between syscalls: the VMM's spin is never answered within
    // its budget. What the VMM thread burns per round trip (its CPU time) with each hand-off.
    for round in 0..2 {
        for (name, h, placed) in [
            ("yield+sleep", Handoff::yield_then_sleep(), false),
            ("adaptive spin", Handoff::adaptive(), false),
            ("placement", Handoff::adaptive(), true),
        ] {
            let (mut stub, mut regs) = compute_loop_stub(50_000);
            stub.set_handoff(h);
            stub.set_placement(placed);
            for _ in 0..200 {
                trapped_round_trip(&mut stub, &mut regs, &mut fs);
            }
            let (cpu0, t0) = (thread_cpu_ns(), Instant::now());
            const N: u64 = 2000;
            for _ in 0..N {
                trapped_round_trip(&mut stub, &mut regs, &mut fs);
            }
            let (cpu, wall) = (thread_cpu_ns() - cpu0, t0.elapsed().as_nanos() as u64);
            println!(
                "computing guest round {round}: systrap {name:<14} round trip {:>7.2} us, VMM thread CPU {:>6.2} us per round trip",
                wall as f64 / N as f64 / 1e3,
                cpu as f64 / N as f64 / 1e3
            );
        }
    }
    // Apart: the VMM thread on one CPU, the stub on another (what a spin needs to be answered;
    // the other work on this host still shares both).
    // SAFETY: sysconf has no preconditions.
    let other = (cpu + 1) % (unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize);
    let apart: Vec<usize> = vec![1, 2, 3, 4, 5, 6];
    if other != cpu && apart.iter().all(|&i| pin(stubs[i].0.pid(), Some(other))) && pin(0, Some(cpu)) {
        for round in 0..2 {
            for &i in &apart {
                let (base, s) = row(i, &mut stubs, &mut fs);
                println!(
                    "apart round {round}: futex {:>7.2} us (p99 {:>7.2}) | systrap {:<54} {:>7.2} us (p99 {:>8.2}) = {:.2}x (rescues so far {})",
                    base.median_us, base.p99_us, rows[i].0, s.median_us, s.p99_us, s.median_us / base.median_us, tsc::rescues()
                );
            }
        }
        pin(0, None);
    }
}

fn bench(c: &mut Criterion) {
    let load = std::fs::read_to_string("/proc/loadavg").unwrap_or_default();
    println!("host load (1/5/15 min): {}", load.split_whitespace().take(3).collect::<Vec<_>>().join(" "));
    // SAFETY: sysconf has no preconditions.
    println!("cpus online: {}", unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) });

    // SAFETY: getppid has no preconditions.
    let native = measure(|| unsafe {
        libc::syscall(libc::SYS_getppid);
    });
    print("native getppid", &native);
    print("clock read (the timer of every row: clock_gettime syscall)", &measure(|| ()));

    let pair = FutexPair::new();
    let futex = measure(|| pair.round_trip());
    print("native futex wake+wait round trip, two processes", &futex);
    per_exec_traps(&pair);
    if std::env::var_os("COLLIMATE_BENCH_TRAPS_ONLY").is_some_and(|v| v == "1") {
        return;
    }
    {
        TIMED.store(1, Ordering::Relaxed);
        let timed = FutexPair::new();
        print("native futex round trip, waits with a 50 ms timeout", &measure(|| timed.round_trip()));
        TIMED.store(0, Ordering::Relaxed);
    }

    // What trapping rdtsc and cpuid costs per context switch on this host, futex only.
    let sleep_only = Handoff { vmm_spin: Duration::ZERO, stub_spin: 0, yields: 0, adaptive: false };
    for (name, tsc, cpuid) in [
        ("systrap futex only, rdtsc and cpuid not trapped", false, false),
        ("systrap futex only, rdtsc trapped, cpuid not", true, false),
        ("systrap futex only, cpuid trapped, rdtsc not", false, true),
    ] {
        let (mut stub, mut regs) = syscall_loop_stub(&Confinement { trap_rdtsc: tsc, trap_cpuid: cpuid, ..Confinement::default() });
        stub.set_handoff(sleep_only.clone());
        let mut fs = 0u64;
        print(name, &measure(|| trapped_round_trip(&mut stub, &mut regs, &mut fs)));
    }
    let (mut trapping, mut regs_t) = syscall_loop_stub(&Confinement::for_replay(true));
    let (mut plain, mut regs_p) = syscall_loop_stub(&Confinement::for_replay(false));
    let mut fs = 0u64;
    let mut best = (f64::MAX, 0.0, String::new());
    let old = Handoff { vmm_spin: Duration::from_micros(5_700), stub_spin: 200_000, yields: 0, adaptive: false };
    let new = Handoff::default();
    // The load moves during a run: each configuration is measured right after a fresh futex
    // baseline, and its ratio is to that baseline. "replay": rdtsc and cpuid trapped.
    for (name, replay, h) in [
        ("futex only, replay", true, sleep_only.clone()),
        ("old default (spin ~5.7 ms each side), replay", true, old.clone()),
        ("default, replay", true, new.clone()),
        ("futex only, outside replay", false, sleep_only.clone()),
        ("old default (spin ~5.7 ms each side), outside replay", false, old.clone()),
        ("yield 2 then futex, no spin, outside replay", false, Handoff { vmm_spin: Duration::ZERO, stub_spin: 0, yields: 2, adaptive: false }),
        ("spin 5 us / 200 pauses, 2 yields, outside replay", false, Handoff { vmm_spin: Duration::from_micros(5), stub_spin: 200, yields: 2, adaptive: false }),
        ("spin 50 us / 2000 pauses, 2 yields, outside replay", false, Handoff { vmm_spin: Duration::from_micros(50), stub_spin: 2_000, yields: 2, adaptive: false }),
        ("default, outside replay", false, new.clone()),
    ] {
        let base = measure(|| pair.round_trip());
        let (stub, regs) = if replay { (&mut trapping, &mut regs_t) } else { (&mut plain, &mut regs_p) };
        stub.set_handoff(h);
        let s = measure(|| trapped_round_trip(stub, regs, &mut fs));
        print("native futex round trip (baseline for the next line)", &base);
        print(&format!("systrap trapped syscall, {name}"), &s);
        let ratio = s.median_us / base.median_us;
        println!("{:<58} ratio to that futex round trip: {:.2}x (median), {:.2}x (p99)", "", ratio, s.p99_us / base.p99_us);
        if s.median_us < best.0 {
            best = (s.median_us, ratio, name.to_string());
        }
    }
    // Pinned: the VMM thread and the stub on one CPU (what a host with few cores could do).
    {
        let pin = |pid: i32, cpu: usize| {
            // SAFETY: a zeroed cpu_set_t is valid; CPU_SET and sched_setaffinity only touch it.
            unsafe {
                let mut set: libc::cpu_set_t = std::mem::zeroed();
                libc::CPU_SET(cpu, &mut set);
                libc::sched_setaffinity(pid, std::mem::size_of::<libc::cpu_set_t>(), &set) == 0
            }
        };
        // SAFETY: sched_getcpu has no preconditions.
        let cpu = unsafe { libc::sched_getcpu() }.max(0) as usize;
        if pin(0, cpu) && pin(plain.pid(), cpu) {
            for (name, h) in [
                ("pinned to one CPU, yield 2 then futex", Handoff::yield_then_sleep()),
                ("pinned to one CPU, adaptive spin", Handoff::adaptive()),
                ("pinned to one CPU, spin 50 us / 2000 pauses, 2 yields", Handoff { vmm_spin: Duration::from_micros(50), stub_spin: 2_000, yields: 2, adaptive: false }),
                ("pinned to one CPU, futex only", sleep_only.clone()),
            ] {
                let base = measure(|| pair.round_trip());
                plain.set_handoff(h);
                let s = measure(|| trapped_round_trip(&mut plain, &mut regs_p, &mut fs));
                print("native futex round trip (baseline for the next line)", &base);
                print(&format!("systrap trapped syscall, {name}, outside replay"), &s);
                println!("{:<58} ratio to that futex round trip: {:.2}x (median), {:.2}x (p99)", "", s.median_us / base.median_us, s.p99_us / base.p99_us);
            }
            // SAFETY: as above.
            let mut all: libc::cpu_set_t = unsafe { std::mem::zeroed() };
            // SAFETY: sysconf has no preconditions.
            for c in 0..unsafe { libc::sysconf(libc::_SC_NPROCESSORS_ONLN) }.max(1) as usize {
                // SAFETY: setting a bit in a local set.
                unsafe { libc::CPU_SET(c, &mut all) };
            }
            // SAFETY: restoring this thread's affinity from a local set.
            unsafe { libc::sched_setaffinity(0, std::mem::size_of::<libc::cpu_set_t>(), &all) };
        }
    }
    plain.set_handoff(Handoff::default());
    let (mut stub, mut regs) = (plain, regs_p);
    println!("systrap best: {} median {:.3} us = {:.2}x its futex baseline (target <= 1.5x and <= 5 us)", best.2, best.0, best.1);

    // What a stub's creation costs, by confinement (each sample a spawn to the first report and the
    // drop that kills and reaps it).
    for (name, conf) in [
        ("systrap Stub::spawn + drop, default confinement", Confinement::for_replay(false)),
        ("systrap Stub::spawn + drop, no namespaces", Confinement { namespaces: false, ..Confinement::for_replay(false) }),
    ] {
        let (mut t, mut d): (Vec<Duration>, Vec<Duration>) = (0..100)
            .map(|_| {
                let s = Instant::now();
                let stub = Stub::spawn(&conf).expect("spawn");
                let spawned = s.elapsed();
                drop(stub);
                (spawned, s.elapsed() - spawned)
            })
            .unzip();
        t.sort_unstable();
        d.sort_unstable();
        let ms = |x: Duration| x.as_secs_f64() * 1e3;
        println!("{name:<58} median {:>8.3} ms   p99 {:>8.3} ms (of it the drop: median {:.3} ms)", ms(t[50] + d[50]), ms(t[98] + d[98]), ms(d[50]));
    }

    {
        // A new stub as a fork of a parked empty one (a small address space to copy, the
        // namespaces already made) instead of a clone of the VMM.
        let mut template = Template::new(&Confinement::for_replay(false)).expect("spawn a template");
        let (mut t, mut d): (Vec<Duration>, Vec<Duration>) = (0..100)
            .map(|_| {
                let s = Instant::now();
                let stub = template.spawn().expect("a stub from the template");
                let spawned = s.elapsed();
                drop(stub);
                (spawned, s.elapsed() - spawned)
            })
            .unzip();
        t.sort_unstable();
        d.sort_unstable();
        let ms = |x: Duration| x.as_secs_f64() * 1e3;
        println!(
            "{:<58} median {:>8.3} ms   p99 {:>8.3} ms (of it the drop: median {:.3} ms)",
            "systrap Template::spawn (fork of a parked stub) + drop",
            ms(t[50] + d[50]),
            ms(t[98] + d[98]),
            ms(d[50])
        );
    }

    let mut buf = vec![0u8; 4096];
    let mem = memory::open_mem(stub.pid()).expect("open mem");
    let pid = stub.pid();
    print("systrap guest read 4 KiB via /proc/<pid>/mem", &measure(|| assert!(memory::read(&mem, 0x50_0000, &mut buf))));
    print("systrap guest read 4 KiB via process_vm_readv", &measure(|| assert!(memory::read_vm(pid, 0x50_0000, &mut buf))));

    let mut g = c.benchmark_group("systrap");
    g.sample_size(20);
    g.measurement_time(std::time::Duration::from_secs(2));
    g.bench_function("native getppid", |b| {
        // SAFETY: as above.
        b.iter(|| unsafe { libc::syscall(libc::SYS_getppid) })
    });
    g.bench_function("native futex round trip", |b| b.iter(|| pair.round_trip()));
    g.bench_function("systrap trapped syscall round trip", |b| b.iter(|| trapped_round_trip(&mut stub, &mut regs, &mut fs)));
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
