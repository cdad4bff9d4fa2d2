//! The CPU template (`arch::x86_64::cpuid`) and the `rdtsc` trap (`vstate::tsc_trap`), with real
//! programs: small static C programs built with the host's gcc at test time, run from a template
//! (spawn, pause, snapshot) in clones reseeded alike.
//! - `rdtsc` and `rdtscp` replay bit for bit and count virtual nanoseconds where the profile
//!   traps them (upstream KVM; kvm_pvm with `COLLIMATE_TRAP_RDTSC=1`); on kvm_pvm without it
//!   they are the host's counter, as docs/replay.md says.
//! - CPUID leaves 1 and 7 print the same in every clone; RDRAND and RDSEED are hidden where
//!   ring-3 CPUID is filtered, the host CPU's under kvm_pvm; a recorded CPU model (leaf 1 EAX)
//!   is the one every clone sees, whatever the host's.
//! - A template whose CPU needs a feature this host lacks is refused with what to do.
//!
//! Needs gcc and a root filesystem (COLLIMATE_ROOTFS; the programs are static, any root does).

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Duration;

use collimate_engine::arch::x86_64::cpuid::{CpuTemplate, EBX, ECX};
use collimate_engine::vstate::profile;
use collimate_engine::{persist, Error, RunExit, SpawnSpec, Vm, VmConfig};
use common::{launcher, python_rootfs, scratch};

const T: Duration = Duration::from_secs(60);
const SEED: [u8; 32] = [0x7c; 32];

/// Pause (the yield hypercall, value 7), then print what `body` prints.
fn program(body: &str) -> String {
    format!(
        r#"#include <stdio.h>
#include <stdint.h>
#include <unistd.h>
#include <cpuid.h>
#include <x86intrin.h>
int main(void) {{
    syscall(0x40000000, 7);
{body}
    return 0;
}}
"#
    )
}

const RDTSC: &str = r#"
    uint64_t t[4];
    for (int i = 0; i < 4; i++) t[i] = __rdtsc();
    unsigned aux = 77;
    uint64_t p = __rdtscp(&aux);
    for (int i = 0; i < 4; i++) printf("rdtsc %llu\n", (unsigned long long)t[i]);
    printf("rdtscp %llu %u\n", (unsigned long long)p, aux);
"#;

const CPUID: &str = r#"
    unsigned a, b, c, d;
    __cpuid_count(1, 0, a, b, c, d);
    printf("leaf1 %08x %08x %08x\n", a, c, d);
    __cpuid_count(7, 0, a, b, c, d);
    printf("leaf7 %08x %08x %08x %08x\n", a, b, c, d);
"#;

/// `src` built static into `dir/name`; None (the test skips) without gcc.
fn build(dir: &Path, name: &str, src: &str) -> Option<PathBuf> {
    let c = dir.join(format!("{name}.c"));
    std::fs::write(&c, src).unwrap();
    let out = dir.join(name);
    match Command::new("gcc").args(["-O2", "-static", "-o"]).arg(&out).arg(&c).output() {
        Ok(o) if o.status.success() => Some(out),
        Ok(o) => panic!("gcc failed: {}", String::from_utf8_lossy(&o.stderr)),
        Err(_) if std::env::var_os("COLLIMATE_REQUIRE_KVM").is_some() => panic!("no gcc: scripts/setup.sh installs it"),
        Err(_) => None,
    }
}

/// A template of the program `/work/<name>` paused at its yield, snapshotted in `dir/snap`.
fn template(dir: &Path, name: &str) -> PathBuf {
    let spec = SpawnSpec {
        root: python_rootfs().unwrap(),
        mounts: vec![("/work".into(), dir.join("work"))],
        argv: vec![format!("/work/{name}").into_bytes()],
        envp: vec![b"PATH=/usr/bin:/bin".to_vec()],
        cwd: "/work".into(),
        ..Default::default()
    };
    let mut vm = Vm::spawn(&launcher(), &spec, &VmConfig::default()).unwrap();
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Yield { value: 7 }, "{r:?} {}", String::from_utf8_lossy(&r.stderr));
    let snap = dir.join(format!("snap-{name}"));
    vm.snapshot(&snap).unwrap();
    vm.destroy().unwrap();
    snap
}

fn finish(vm: &mut Vm) -> String {
    let r = vm.run(T).unwrap();
    assert_eq!(r.exit, RunExit::Exited { code: 0 }, "{}", String::from_utf8_lossy(&r.stderr));
    String::from_utf8(r.stdout).unwrap()
}

/// Two clones of `snap`, both reseeded with SEED (replay mode), and a restore of it in a new
/// process, also reseeded: their outputs.
fn three_clones(snap: &Path) -> Vec<String> {
    let mut zygote = Vm::restore(&launcher(), snap).unwrap();
    let mut kids = zygote.fork(2).unwrap();
    let mut again = Vm::restore(&launcher(), snap).unwrap();
    kids.push(again.clone_vm().unwrap());
    let mut outs = Vec::new();
    for k in &mut kids {
        k.reseed(SEED, true).unwrap();
        outs.push(finish(k));
    }
    drop((kids, zygote, again));
    outs
}

fn setup(name: &str, prog: &str) -> Option<(PathBuf, PathBuf)> {
    python_rootfs()?;
    let dir = scratch(name);
    build(&dir.join("work"), "prog", prog)?;
    let snap = template(&dir, "prog");
    Some((dir, snap))
}

fn numbers(out: &str, key: &str) -> Vec<u64> {
    out.lines().filter(|l| l.starts_with(key)).map(|l| l.split(' ').nth(1).unwrap().parse().unwrap()).collect()
}

#[test]
fn rdtsc_replays_from_the_virtual_clock_where_the_profile_traps_it() {
    let trapped = profile::current().rdtsc_trap() != collimate_engine::vstate::tsc_trap::Trap::Off;
    let Some((dir, snap)) = setup("cpu-rdtsc", &program(RDTSC)) else {
        eprintln!("no rootfs or gcc: skipping");
        return;
    };
    let outs = three_clones(&snap);
    let t = numbers(&outs[0], "rdtsc ");
    let p = numbers(&outs[0], "rdtscp");
    assert_eq!(t.len(), 4, "{}", outs[0]);
    if trapped {
        // Bit for bit in every clone, and the virtual clock's nanoseconds: each read one quantum
        // (1 us) after the last, rdtscp's TSC_AUX that of CPU 0.
        assert_eq!(outs[0], outs[1]);
        assert_eq!(outs[0], outs[2]);
        for w in t.windows(2) {
            assert_eq!(w[1] - w[0], 1_000, "{}", outs[0]);
        }
        assert_eq!(p[0] - t[3], 1_000);
        assert!(outs[0].contains(&format!("rdtscp {} 0\n", p[0])), "{}", outs[0]);
    } else {
        // kvm_pvm without COLLIMATE_TRAP_RDTSC=1: the host's counter, as docs/replay.md says.
        assert_ne!(outs[0], outs[1], "the host's TSC moved between the runs");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

fn hex(out: &str, key: &str) -> Vec<u32> {
    let line = out.lines().find(|l| l.starts_with(key)).unwrap();
    line.split(' ').skip(1).map(|v| u32::from_str_radix(v, 16).unwrap()).collect()
}

#[test]
fn cpuid_in_ring3_is_the_templates_where_the_profile_filters_it() {
    let Some((dir, snap)) = setup("cpu-cpuid", &program(CPUID)) else {
        eprintln!("no rootfs or gcc: skipping");
        return;
    };
    let outs = three_clones(&snap);
    assert_eq!(outs[0], outs[1]);
    assert_eq!(outs[0], outs[2]);
    let (l1, l7) = (hex(&outs[0], "leaf1"), hex(&outs[0], "leaf7"));
    let (rdrand, rdseed, avx512f) = (l1[1] >> 30 & 1, l7[1] >> 18 & 1, l7[1] >> 16 & 1);
    if profile::current().cpuid_filtered() {
        assert_eq!((rdrand, rdseed, avx512f), (0, 0, 0), "{}", outs[0]);
    } else {
        // kvm_pvm: the feature registers are the host CPU's, RDRAND and RDSEED included.
        let host1 = std::arch::x86_64::__cpuid_count(1, 0);
        let host7 = std::arch::x86_64::__cpuid_count(7, 0);
        assert_eq!(rdrand, host1.ecx >> 30 & 1, "{}", outs[0]);
        assert_eq!(rdseed, host7.ebx >> 18 & 1, "{}", outs[0]);
    }

    // The template's recorded CPU model (leaf 1 EAX) is what every clone sees, not the host's:
    // a template baked on another CPU model, simulated by editing the recorded one.
    let state = snap.join(persist::STATE_FILE);
    let mut s = persist::read_state(&snap).unwrap();
    let model = 0x000a_0f11;
    assert_ne!(l1[0], model);
    for l in &mut s.cpu.entries {
        if (l.function, l.index) == (1, 0) {
            l.regs[0] = model;
        }
    }
    std::fs::write(&state, persist::encode(&s).unwrap()).unwrap();
    let outs = three_clones(&snap);
    assert_eq!(outs[0], outs[1]);
    assert_eq!(hex(&outs[0], "leaf1")[0], model, "{}", outs[0]);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_template_whose_cpu_needs_a_feature_this_host_lacks_is_refused() {
    let Some((dir, snap)) = setup("cpu-refused", &program(CPUID)) else {
        eprintln!("no rootfs or gcc: skipping");
        return;
    };
    let mut s = persist::read_state(&snap).unwrap();
    let host = s.cpu.clone();
    // A feature this host does not give its guests (leaf 7 EBX, or leaf 1 ECX if all of those
    // are): as if the template had been baked on a newer CPU.
    let (leaf, reg) = if CpuTemplate::reg(&host.entries, 7, 0, EBX) != u32::MAX { (7, EBX) } else { (1, ECX) };
    let have = CpuTemplate::reg(&host.entries, leaf, 0, reg);
    let bit = (0..32).find(|b| have & (1 << b) == 0).unwrap();
    for l in &mut s.cpu.entries {
        if (l.function, l.index) == (leaf, 0) {
            l.regs[reg] |= 1 << bit;
        }
    }
    std::fs::write(snap.join(persist::STATE_FILE), persist::encode(&s).unwrap()).unwrap();
    let err = Vm::restore(&launcher(), &snap).err().expect("a restore on a host without the feature must fail");
    assert!(matches!(err, Error::HostCpu { .. }), "{err:?}");
    let msg = err.to_string();
    assert!(msg.contains("lacks") && msg.contains("bake the template again on this host"), "{msg}");
    // The template as recorded restores.
    s.cpu = host;
    std::fs::write(snap.join(persist::STATE_FILE), persist::encode(&s).unwrap()).unwrap();
    let mut vm = Vm::restore(&launcher(), &snap).unwrap();
    assert!(finish(&mut vm).starts_with("leaf1 "));
    let _ = std::fs::remove_dir_all(&dir);
}
