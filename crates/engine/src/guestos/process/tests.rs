//! Unit tests of the per-process calls: [`super`] (process tree, umask, prctl) and the modules
//! split from it by concept (identity, limits, clock, random, signal_state, cpu, thread_area).

use crate::arch::x86_64::paging::{setup_address_space, AddressSpace, FrameAllocator, PTE_NX, PTE_U, PTE_W};
use crate::guestos::clock::*;
use crate::guestos::cpu::*;
use crate::guestos::identity::*;
use crate::guestos::limits::*;
use crate::guestos::process::*;
use crate::guestos::random::*;
use crate::guestos::signal_state::*;
use crate::guestos::thread_area::*;
use crate::guestos::{Ctx, GuestOs, Output};
use crate::vstate::memory::GuestMemory;
use kvm_bindings::{kvm_regs, kvm_sregs};

const BUF: u64 = 0x1000_0000;

struct T {
    mem: GuestMemory,
    frames: FrameAllocator,
    aspace: AddressSpace,
    regs: kvm_regs,
    sregs: kvm_sregs,
    out: Output,
    os: GuestOs,
    _dir: std::path::PathBuf,
}

impl T {
    fn new() -> T {
        let mut mem = GuestMemory::anonymous(16 << 20).unwrap();
        let mut frames = FrameAllocator::new(16 << 20);
        let aspace = setup_address_space(&mut mem, &mut frames).unwrap();
        aspace.map_fresh(&mut mem, &mut frames, BUF, 2 * 4096, PTE_U | PTE_W | PTE_NX).unwrap();
        let dir = std::env::temp_dir().join(format!("proc-test-{}-{:?}", std::process::id(), std::thread::current().id()));
        std::fs::create_dir_all(&dir).unwrap();
        let os = GuestOs {
            mm: Default::default(),
            files: Default::default(),
            vfs: crate::guestos::vfs::Vfs::new(&dir).unwrap(),
            proc: Default::default(),
            enosys: Default::default(),
            stdio: None,
            agent: None,
            sig: Default::default(),
            threads: Default::default(),
        };
        T { mem, frames, aspace, regs: Default::default(), sregs: Default::default(), out: Default::default(), os, _dir: dir }
    }
    fn call(&mut self, nr: u64, a: [u64; 6]) -> i64 {
        self.regs.rax = nr;
        self.regs.rip = 0x40_1002;
        let mut ctx = Ctx {
            memory: crate::platform::Memory::Kvm(crate::platform::kvm::Memory::new(&mut self.mem, &mut self.frames, &self.aspace)),
            regs: &mut self.regs,
            sregs: &mut self.sregs,
            out: &mut self.out,
            flush_tlb: false,
            stale_frames: Vec::new(),
            stop: None,
            lazy: self.os.mm.lazy_areas(),
        };
        match crate::guestos::per_process_dispatch(&mut self.os, &mut ctx, nr, a) {
            Some(Ok(v)) => v as i64,
            Some(Err(e)) => -(e.0 as i64),
            None => panic!("syscall {nr} not handled"),
        }
    }
    fn read(&self, va: u64, n: usize) -> Vec<u8> {
        let mut b = vec![0u8; n];
        self.aspace.read_virt(&self.mem, va, &mut b, true).unwrap();
        b
    }
    fn write(&mut self, va: u64, d: &[u8]) {
        self.aspace.write_virt(&mut self.mem, va, d, true).unwrap();
    }
}

fn cstr(b: &[u8]) -> &[u8] {
    &b[..b.iter().position(|&c| c == 0).unwrap_or(b.len())]
}

#[test]
fn uname_layout() {
    let mut t = T::new();
    assert_eq!(t.call(SYS_UNAME, [BUF, 0, 0, 0, 0, 0]), 0);
    let b = t.read(BUF, 390);
    let fields: Vec<&[u8]> = b.chunks(65).map(cstr).collect();
    assert_eq!(fields, [&b"Linux"[..], b"sandbox", b"6.1.0-collimate", UTS_VERSION.as_bytes(), b"x86_64", b"(none)"]);
    assert_eq!(t.call(SYS_UNAME, [0x10, 0, 0, 0, 0, 0]), -14);
}

#[test]
fn identity() {
    let mut t = T::new();
    assert_eq!(t.call(SYS_GETPID, [0; 6]), 1);
    assert_eq!(t.call(SYS_GETTID, [0; 6]), 1);
    assert_eq!(t.call(SYS_GETPPID, [0; 6]), 0);
    assert_eq!(t.call(SYS_GETUID, [0; 6]), 0);
    assert_eq!(t.call(SYS_GETEGID, [0; 6]), 0);
    assert_eq!(t.call(SYS_SETUID, [0; 6]), 0);
    assert_eq!(t.call(SYS_SETRESUID, [u64::MAX, 0, u32::MAX as u64, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_GETRESGID, [BUF, BUF + 4, BUF + 8, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_GETGROUPS, [0; 6]), 0);
    t.write(BUF, &[5, 0, 0, 0, 7, 0, 0, 0]);
    assert_eq!(t.call(SYS_SETGROUPS, [2, BUF, 0, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_GETGROUPS, [0; 6]), 2);
    assert_eq!(t.call(SYS_GETGROUPS, [1, BUF + 64, 0, 0, 0, 0]), -22);
    assert_eq!(t.call(SYS_GETGROUPS, [2, BUF + 64, 0, 0, 0, 0]), 2);
    assert_eq!(t.read(BUF + 64, 8), [5, 0, 0, 0, 7, 0, 0, 0]);
    assert_eq!(t.call(SYS_GETPGID, [0; 6]), 1);
    assert_eq!(t.call(SYS_GETSID, [77, 0, 0, 0, 0, 0]), -3);
    assert_eq!(t.call(SYS_SETPGID, [0; 6]), 0);
    assert_eq!(t.call(SYS_SETSID, [0; 6]), -1);
    assert_eq!(t.call(SYS_SET_TID_ADDRESS, [BUF, 0, 0, 0, 0, 0]), 1);
    assert_eq!(t.os.proc.clear_child_tid, BUF);
    assert_eq!(t.call(SYS_UMASK, [0o077, 0, 0, 0, 0, 0]), 0o022);
    assert_eq!(t.call(SYS_UMASK, [0o7777, 0, 0, 0, 0, 0]), 0o077);
    assert_eq!(t.os.proc.umask, 0o777);
}

#[test]
fn set_ids_like_linux() {
    let mut t = T::new();
    let keep = u32::MAX as u64;
    // Root drops to a user for a while (effective only), and comes back through the saved id.
    assert_eq!(t.call(SYS_SETRESUID, [keep, 1000, keep, 0, 0, 0]), 0);
    assert_eq!(t.os.proc.uid, [0, 1000, 0, 1000]);
    assert_eq!(t.call(SYS_SETUID, [7, 0, 0, 0, 0, 0]), -1); // no privilege now
    assert_eq!(t.call(SYS_SETUID, [0; 6]), 0); // back to the real id
    assert_eq!(t.os.proc.uid, [0; 4]);
    // Root's setgid and setuid set every id, for good.
    assert_eq!(t.call(SYS_SETGID, [1000, 0, 0, 0, 0, 0]), 0);
    assert_eq!(t.os.proc.gid, [1000; 4]);
    assert_eq!(t.call(SYS_SETUID, [1000, 0, 0, 0, 0, 0]), 0);
    assert_eq!(t.os.proc.uid, [1000; 4]);
    assert_eq!(t.call(SYS_GETEUID, [0; 6]), 1000);
    assert_eq!(t.call(SYS_SETUID, [0; 6]), -1);
    assert_eq!(t.call(SYS_SETRESUID, [keep, 0, keep, 0, 0, 0]), -1);
    assert_eq!(t.call(SYS_SETREUID, [0, keep, 0, 0, 0, 0]), -1);
    assert_eq!(t.call(SYS_SETGID, [0; 6]), -1);
    assert_eq!(t.call(SYS_SETUID, [1000, 0, 0, 0, 0, 0]), 0); // its own id: fine
    // setfsuid answers the old id and changes only to an id the process has.
    assert_eq!(t.call(SYS_SETFSUID, [0; 6]), 1000);
    assert_eq!(t.os.proc.uid[3], 1000);
    // setreuid swaps real and effective (saved follows the new effective id).
    let mut t = T::new();
    assert_eq!(t.call(SYS_SETRESUID, [1, 2, 3, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_SETREUID, [2, 1, 0, 0, 0, 0]), 0);
    assert_eq!(t.os.proc.uid, [2, 1, 1, 1]);
    assert_eq!(t.call(SYS_SETREUID, [3, keep, 0, 0, 0, 0]), -1);
}

#[test]
fn arch_prctl_sets_fs() {
    let mut t = T::new();
    assert_eq!(t.call(SYS_ARCH_PRCTL, [ARCH_SET_FS, 0x7000_1234, 0, 0, 0, 0]), 0);
    assert_eq!(t.sregs.fs.base, 0x7000_1234);
    assert_eq!(t.call(SYS_ARCH_PRCTL, [ARCH_GET_FS, BUF, 0, 0, 0, 0]), 0);
    assert_eq!(t.read(BUF, 8), 0x7000_1234u64.to_le_bytes());
    assert_eq!(t.call(SYS_ARCH_PRCTL, [ARCH_SET_GS, 0x5000, 0, 0, 0, 0]), 0);
    assert_eq!(t.sregs.gs.base, 0x5000);
    assert_eq!(t.call(SYS_ARCH_PRCTL, [ARCH_SET_FS, 0xffff_8000_0000_0000, 0, 0, 0, 0]), -1);
    assert_eq!(t.call(SYS_ARCH_PRCTL, [0x3001, BUF, 0, 0, 0, 0]), -22);
}

#[test]
fn rlimits_round_trip() {
    let mut t = T::new();
    assert_eq!(t.call(SYS_PRLIMIT64, [0, RLIMIT_STACK as u64, 0, BUF, 0, 0]), 0);
    assert_eq!(t.read(BUF, 16)[..8], (8u64 << 20).to_le_bytes());
    let mut b = [0u8; 16];
    b[..8].copy_from_slice(&100u64.to_le_bytes());
    b[8..].copy_from_slice(&200u64.to_le_bytes());
    t.write(BUF + 32, &b);
    assert_eq!(t.call(SYS_SETRLIMIT, [RLIMIT_NOFILE as u64, BUF + 32, 0, 0, 0, 0]), 0);
    assert_eq!(t.os.proc.rlimit(RLIMIT_NOFILE), Rlimit { cur: 100, max: 200 });
    assert_eq!(t.call(SYS_GETRLIMIT, [RLIMIT_NOFILE as u64, BUF + 64, 0, 0, 0, 0]), 0);
    assert_eq!(t.read(BUF + 64, 16), b);
    b[..8].copy_from_slice(&300u64.to_le_bytes());
    t.write(BUF + 32, &b);
    assert_eq!(t.call(SYS_SETRLIMIT, [RLIMIT_NOFILE as u64, BUF + 32, 0, 0, 0, 0]), -22);
    assert_eq!(t.call(SYS_PRLIMIT64, [42, 0, 0, BUF, 0, 0]), -3);
    assert_eq!(t.call(SYS_GETRLIMIT, [99, BUF, 0, 0, 0, 0]), -22);
}

#[test]
fn signal_bookkeeping() {
    let mut t = T::new();
    let mut act = [0u8; 32];
    act[..8].copy_from_slice(&0x40_1000u64.to_le_bytes());
    act[8..16].copy_from_slice(&0x0400_0000u64.to_le_bytes());
    t.write(BUF, &act);
    assert_eq!(t.call(SYS_RT_SIGACTION, [2, BUF, BUF + 64, 8, 0, 0]), 0);
    assert_eq!(t.read(BUF + 64, 32), [0u8; 32]);
    assert_eq!(t.call(SYS_RT_SIGACTION, [2, 0, BUF + 64, 8, 0, 0]), 0);
    assert_eq!(t.read(BUF + 64, 32), act);
    assert_eq!(t.call(SYS_RT_SIGACTION, [9, BUF, 0, 8, 0, 0]), -22);
    assert_eq!(t.call(SYS_RT_SIGACTION, [65, 0, 0, 8, 0, 0]), -22);
    assert_eq!(t.call(SYS_RT_SIGACTION, [2, 0, 0, 16, 0, 0]), -22);
    t.write(BUF, &(u64::MAX).to_le_bytes());
    assert_eq!(t.call(SYS_RT_SIGPROCMASK, [0, BUF, BUF + 8, 8, 0, 0]), 0);
    assert_eq!(t.read(BUF + 8, 8), [0; 8]);
    assert_eq!(t.os.proc.sigmask, !(1 << 8) & !(1 << 18));
    assert_eq!(t.call(SYS_RT_SIGPROCMASK, [7, BUF, 0, 8, 0, 0]), -22);
    // sigaltstack: old is disabled; a too small stack is ENOMEM.
    let mut ss = [0u8; 24];
    ss[..8].copy_from_slice(&BUF.to_le_bytes());
    ss[16..].copy_from_slice(&1024u64.to_le_bytes());
    t.write(BUF + 128, &ss);
    assert_eq!(t.call(SYS_SIGALTSTACK, [BUF + 128, BUF + 256, 0, 0, 0, 0]), -12);
    assert_eq!(t.call(SYS_SIGALTSTACK, [0, BUF + 256, 0, 0, 0, 0]), 0);
    assert_eq!(i32::from_le_bytes(t.read(BUF + 256 + 8, 4).try_into().unwrap()), SS_DISABLE);
    ss[16..].copy_from_slice(&65536u64.to_le_bytes());
    t.write(BUF + 128, &ss);
    assert_eq!(t.call(SYS_SIGALTSTACK, [BUF + 128, 0, 0, 0, 0, 0]), 0);
    assert_eq!(t.os.proc.altstack, AltStack { sp: BUF, flags: 0, size: 65536 });
}

#[test]
fn prctl_name_and_deathsig() {
    let mut t = T::new();
    t.write(BUF, b"a-very-long-thread-name\0");
    assert_eq!(t.call(SYS_PRCTL, [15, BUF, 0, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_PRCTL, [16, BUF + 64, 0, 0, 0, 0]), 0);
    assert_eq!(t.read(BUF + 64, 16), b"a-very-long-thr\0");
    assert_eq!(t.call(SYS_PRCTL, [1, 9, 0, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_PRCTL, [2, BUF, 0, 0, 0, 0]), 0);
    assert_eq!(t.read(BUF, 4), 9i32.to_le_bytes());
    assert_eq!(t.call(SYS_PRCTL, [0x5999, 0, 0, 0, 0, 0]), -22);
}

#[test]
fn time_and_random() {
    let mut t = T::new();
    assert_eq!(t.call(SYS_CLOCK_GETTIME, [1, BUF, 0, 0, 0, 0]), 0);
    let a = t.read(BUF, 16);
    assert_eq!(t.call(SYS_CLOCK_GETTIME, [1, BUF, 0, 0, 0, 0]), 0);
    let b = t.read(BUF, 16);
    let ns = |v: &[u8]| {
        i64::from_le_bytes(v[..8].try_into().unwrap()) as i128 * 1_000_000_000 + i64::from_le_bytes(v[8..].try_into().unwrap()) as i128
    };
    assert!(ns(&b) >= ns(&a));
    // glibc's encoding of "this process's CPU clock".
    assert_eq!(t.call(SYS_CLOCK_GETTIME, [(-6i64) as u64, BUF, 0, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_CLOCK_GETTIME, [10, BUF, 0, 0, 0, 0]), -22);
    assert_eq!(t.call(SYS_CLOCK_GETTIME, [(-6i64 - 8 * 41) as u64, BUF, 0, 0, 0, 0]), -22);
    assert_eq!(t.call(SYS_CLOCK_GETRES, [0, BUF, 0, 0, 0, 0]), 0);
    let secs = t.call(SYS_TIME, [BUF, 0, 0, 0, 0, 0]);
    assert!(secs > 1_600_000_000);
    assert_eq!(t.call(SYS_GETTIMEOFDAY, [BUF, BUF + 16, 0, 0, 0, 0]), 0);
    assert!(i64::from_le_bytes(t.read(BUF + 8, 8).try_into().unwrap()) < 1_000_000);
    assert_eq!(t.call(SYS_GETRANDOM, [BUF, 64, 0, 0, 0, 0]), 64);
    let r1 = t.read(BUF, 64);
    assert_eq!(t.call(SYS_GETRANDOM, [BUF, 64, 1, 0, 0, 0]), 64);
    assert_ne!(r1, t.read(BUF, 64));
    assert_eq!(t.call(SYS_GETRANDOM, [BUF, 64, 6, 0, 0, 0]), -22);
    assert_eq!(t.call(SYS_GETRANDOM, [0x20, 64, 0, 0, 0, 0]), -14);
}

#[test]
fn long_sleeps_are_sliced_and_restarted() {
    let mut t = T::new();
    // 120 ms: the first call sleeps one slice and asks for a restart.
    t.write(BUF, &timespec_bytes(0, 120_000_000));
    let start = std::time::Instant::now();
    let mut calls = 0;
    loop {
        calls += 1;
        let rip = 0x40_1002;
        let r = t.call(SYS_NANOSLEEP, [BUF, 0, 0, 0, 0, 0]);
        if r == 0 {
            assert_eq!(t.regs.rip, rip);
            break;
        }
        assert_eq!(r as u64, SYS_NANOSLEEP, "a restart leaves the syscall number in rax");
        assert_eq!(t.regs.rip, rip - 2, "and rip on the syscall instruction");
        assert!(calls < 10);
    }
    let took = start.elapsed();
    assert!(took >= std::time::Duration::from_millis(120), "{took:?}");
    // Generous bounds: a loaded host oversleeps each slice (one CI run saw 2 calls, not 3).
    assert!(took < std::time::Duration::from_secs(5), "{took:?}");
    assert!(calls >= 2, "sliced: restarted at least once ({calls} calls)");
    assert!(t.os.proc.sleep.is_none());
    // Bad requests.
    t.write(BUF, &timespec_bytes(0, 1_000_000_000));
    assert_eq!(t.call(SYS_NANOSLEEP, [BUF, 0, 0, 0, 0, 0]), -22);
    assert_eq!(t.call(SYS_CLOCK_NANOSLEEP, [3, 0, BUF, 0, 0, 0]), -22);
    // An absolute deadline in the past returns at once.
    t.write(BUF, &timespec_bytes(1, 0));
    assert_eq!(t.call(SYS_CLOCK_NANOSLEEP, [1, 1, BUF, 0, 0, 0]), 0);
}

#[test]
fn affinity_and_sysinfo() {
    let mut t = T::new();
    assert_eq!(t.call(SYS_SCHED_GETAFFINITY, [0, 128, BUF, 0, 0, 0]), 8);
    assert_eq!(t.read(BUF, 8), 1u64.to_le_bytes());
    assert_eq!(t.call(SYS_SCHED_GETAFFINITY, [0, 4, BUF, 0, 0, 0]), -22);
    assert_eq!(t.call(SYS_GETCPU, [BUF, BUF + 4, 0, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_SYSINFO, [BUF, 0, 0, 0, 0, 0]), 0);
    let b = t.read(BUF, 112);
    assert_eq!(u64::from_le_bytes(b[32..40].try_into().unwrap()), 16 << 20);
    assert!(u64::from_le_bytes(b[40..48].try_into().unwrap()) > 0);
    assert_eq!(u32::from_le_bytes(b[104..108].try_into().unwrap()), 1);
    assert!(t.call(SYS_TIMES, [BUF, 0, 0, 0, 0, 0]) > 0);
    assert_eq!(t.call(SYS_GETRUSAGE, [0, BUF, 0, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_GETRUSAGE, [5, BUF, 0, 0, 0, 0]), -22);
    assert_eq!(t.call(SYS_RSEQ, [0; 6]), -38);
    assert_eq!(t.call(SYS_MEMBARRIER, [0; 6]), 0);
}

#[test]
fn the_cpu_count_is_configurable() {
    let mut t = T::new();
    assert!(set_cpus(&mut t.os.proc, 0).is_err() && set_cpus(&mut t.os.proc, MAX_CPUS + 1).is_err());
    set_cpus(&mut t.os.proc, 4).unwrap();
    assert_eq!(t.call(SYS_SCHED_GETAFFINITY, [0, 128, BUF, 0, 0, 0]), 8);
    assert_eq!(t.read(BUF, 8), 0xfu64.to_le_bytes());
    // Narrow to CPUs 1 and 3 (bit 9 names no CPU of the sandbox: ignored); getcpu follows.
    t.write(BUF, &0x20au64.to_le_bytes());
    assert_eq!(t.call(SYS_SCHED_SETAFFINITY, [0, 8, BUF, 0, 0, 0]), 0);
    assert_eq!(t.call(SYS_SCHED_GETAFFINITY, [0, 8, BUF + 64, 0, 0, 0]), 8);
    assert_eq!(t.read(BUF + 64, 8), 0xau64.to_le_bytes());
    assert_eq!(t.call(SYS_GETCPU, [BUF + 128, 0, 0, 0, 0, 0]), 0);
    assert_eq!(t.read(BUF + 128, 4), 1u32.to_le_bytes());
    // A mask with none of its CPUs; a one-byte mask.
    t.write(BUF, &0x10u64.to_le_bytes());
    assert_eq!(t.call(SYS_SCHED_SETAFFINITY, [0, 8, BUF, 0, 0, 0]), -22);
    t.write(BUF, &[0x04]);
    assert_eq!(t.call(SYS_SCHED_SETAFFINITY, [0, 1, BUF, 0, 0, 0]), 0);
    assert_eq!(t.os.proc.affinity, 4);
    assert_eq!((cpu_list(1), cpu_list(4), mask_list(0b1101_0110)), ("0".into(), "0-3".into(), "1-2,4,6-7".into()));
    assert_eq!(all_cpus(64), u64::MAX);
}

fn ts_ns(b: &[u8]) -> u64 {
    let s = i64::from_le_bytes(b[..8].try_into().unwrap());
    let ns = i64::from_le_bytes(b[8..16].try_into().unwrap());
    s as u64 * 1_000_000_000 + ns as u64
}

impl T {
    /// clock_gettime(clock) in ns.
    fn now(&mut self, clock: u64) -> u64 {
        assert_eq!(self.call(SYS_CLOCK_GETTIME, [clock, BUF + 512, 0, 0, 0, 0]), 0);
        ts_ns(&self.read(BUF + 512, 16))
    }
    /// Everything time- and randomness-related a guest can observe, in one transcript.
    fn transcript(&mut self) -> Vec<u8> {
        let mut v = Vec::new();
        for clock in [0u64, 1, 2, 3, 4, 5, 6, 7, 11, (-6i64) as u64] {
            v.extend(self.now(clock).to_le_bytes());
        }
        assert_eq!(self.call(SYS_GETTIMEOFDAY, [BUF, 0, 0, 0, 0, 0]), 0);
        v.extend(self.read(BUF, 16));
        v.extend(self.call(SYS_TIME, [0; 6]).to_le_bytes());
        v.extend(self.call(SYS_TIMES, [BUF, 0, 0, 0, 0, 0]).to_le_bytes());
        v.extend(self.read(BUF, 32));
        assert_eq!(self.call(SYS_GETRUSAGE, [0, BUF, 0, 0, 0, 0]), 0);
        v.extend(self.read(BUF, 32));
        assert_eq!(self.call(SYS_SYSINFO, [BUF, 0, 0, 0, 0, 0]), 0);
        v.extend(self.read(BUF, 8));
        assert_eq!(self.call(SYS_CLOCK_GETRES, [5, BUF, 0, 0, 0, 0]), 0);
        v.extend(self.read(BUF, 16));
        self.write(BUF + 64, &timespec_bytes(0, 500));
        assert_eq!(self.call(SYS_NANOSLEEP, [BUF + 64, 0, 0, 0, 0, 0]), 0);
        v.extend(self.now(1).to_le_bytes());
        assert_eq!(self.call(SYS_GETRANDOM, [BUF, 48, 0, 0, 0, 0]), 48);
        v.extend(self.read(BUF, 48));
        v
    }
}

#[test]
fn reseeded_replay_is_deterministic() {
    let seed = [0x5a; 32];
    let (mut a, mut b) = (T::new(), T::new());
    // Different histories before the reseed: host clocks, different random bytes.
    a.now(0);
    assert_eq!(a.call(SYS_GETRANDOM, [BUF, 16, 0, 0, 0, 0]), 16);
    let (ta, tb) = (a.transcript(), b.transcript());
    assert_ne!(ta, tb);
    // The same state (as two clones of one snapshot have), reseeded alike: identical transcripts.
    b.os.proc = a.os.proc.clone();
    reseed(&mut a.os, seed, true);
    reseed(&mut b.os, seed, true);
    let ta = a.transcript();
    assert_eq!(ta, b.transcript());
    // Another seed: other random bytes, the same clocks.
    let mut c = T::new();
    c.os.proc = a.os.proc.clone();
    reseed(&mut a.os, seed, true);
    reseed(&mut c.os, [0x5b; 32], true);
    let (ta2, tc) = (a.transcript(), c.transcript());
    assert_eq!(ta2[..ta2.len() - 48], tc[..tc.len() - 48]);
    assert_ne!(ta2[ta2.len() - 48..], tc[tc.len() - 48..]);
}

#[test]
fn virtual_clocks_start_where_the_guest_left_them() {
    let mut t = T::new();
    // Never read: the fixed epoch and boot offset.
    reseed(&mut t.os, [1; 32], true);
    assert_eq!(t.now(0), REPLAY_EPOCH_NS + CLOCK_QUANTUM_NS);
    assert_eq!(t.now(1), REPLAY_MONOTONIC_NS + 2 * CLOCK_QUANTUM_NS);
    assert_eq!(t.now(2), 3 * CLOCK_QUANTUM_NS, "CPU time: quanta only");
    // A sleep moves the wall clocks by exactly its length, at once, and not CPU time.
    t.write(BUF, &timespec_bytes(3600, 0));
    let start = std::time::Instant::now();
    assert_eq!(t.call(SYS_NANOSLEEP, [BUF, 0, 0, 0, 0, 0]), 0);
    assert!(start.elapsed() < std::time::Duration::from_secs(1));
    assert_eq!(t.now(1), REPLAY_MONOTONIC_NS + 3_600_000_000_000 + 4 * CLOCK_QUANTUM_NS);
    assert_eq!(t.now(3), 5 * CLOCK_QUANTUM_NS);
    // An absolute sleep to a time already passed does not move time; one ahead moves it there.
    let mono = t.now(1);
    t.write(BUF, &timespec_bytes(0, 5));
    assert_eq!(t.call(SYS_CLOCK_NANOSLEEP, [1, 1, BUF, 0, 0, 0]), 0);
    assert_eq!(t.now(1), mono + CLOCK_QUANTUM_NS);
    let target = mono + 10_000_000_000;
    t.write(BUF, &timespec_bytes((target / 1_000_000_000) as i64, (target % 1_000_000_000) as i64));
    assert_eq!(t.call(SYS_CLOCK_NANOSLEEP, [1, 1, BUF, 0, 0, 0]), 0);
    assert_eq!(t.now(1), target + CLOCK_QUANTUM_NS);
    // A second reseed continues after the guest's past, at the next whole second of REALTIME
    // (MONOTONIC moves as much): time never goes back, and a new run's writes get a later
    // whole-second mtime than anything before it (CPython's bytecode cache compares those).
    let (real, mono) = (t.now(0), t.now(1));
    let last_real = real + CLOCK_QUANTUM_NS; // the MONOTONIC read moved virtual time on, unread
    let next = (last_real / 1_000_000_000 + 1) * 1_000_000_000;
    reseed(&mut t.os, [2; 32], true);
    assert_eq!(t.now(0), next + CLOCK_QUANTUM_NS);
    assert_eq!(t.now(1), mono + (next - last_real) + 2 * CLOCK_QUANTUM_NS);
    // Replay off: the host's clocks again.
    reseed(&mut t.os, [2; 32], false);
    let host_real = t.now(0);
    assert!(host_real > 1_600_000_000 * 1_000_000_000 && host_real != real + 2 * CLOCK_QUANTUM_NS);
    // And a replay after host reads starts at the next whole second after the last host value.
    reseed(&mut t.os, [3; 32], true);
    assert_eq!(t.now(0), (host_real / 1_000_000_000 + 1) * 1_000_000_000 + CLOCK_QUANTUM_NS);
}

#[test]
fn randomness_comes_from_the_crng() {
    let mut t = T::new();
    reseed(&mut t.os, [0; 32], false);
    assert_eq!(t.call(SYS_GETRANDOM, [BUF, 5, 0, 0, 0, 0]), 5);
    assert_eq!(t.call(SYS_GETRANDOM, [BUF + 5, 27, 2, 0, 0, 0]), 27);
    // The seed-zero vector of collimate-crng-v1, whatever the read sizes.
    let want: Vec<u8> = (0..32)
        .map(|i| u8::from_str_radix(&"ccce174ddda08b6788294501ad61d93049490188c5f6f4798052cbfd703a2510"[2 * i..2 * i + 2], 16).unwrap())
        .collect();
    assert_eq!(t.read(BUF, 32), want);
    assert!(!t.os.proc.clocks.replay);
    // An unseeded clone diverges, a seeded one does not.
    let mut other = T::new();
    other.os.proc = t.os.proc.clone();
    diverge(&mut t.os);
    diverge(&mut other.os);
    assert_eq!(t.os.proc.crng, other.os.proc.crng);
    let fresh = T::new();
    let (mut x, mut y) = (T::new(), T::new());
    x.os.proc = fresh.os.proc.clone();
    y.os.proc = fresh.os.proc.clone();
    diverge(&mut x.os);
    diverge(&mut y.os);
    assert_eq!(x.call(SYS_GETRANDOM, [BUF, 32, 0, 0, 0, 0]), 32);
    assert_eq!(y.call(SYS_GETRANDOM, [BUF + 64, 32, 0, 0, 0, 0]), 32);
    assert_ne!(x.read(BUF, 32), y.read(BUF + 64, 32));
    // A guest fork: the child's stream is derived, not shared.
    let mut parent = t.os.proc.clone();
    let mut child = parent.clone();
    child.crng = parent.crng.fork_child();
    let (mut pb, mut cb) = ([0u8; 16], [0u8; 16]);
    random_bytes(&mut parent, &mut pb).unwrap();
    random_bytes(&mut child, &mut cb).unwrap();
    assert_ne!(pb, cb);
}

#[test]
fn proc_state_round_trips_with_crng_and_clocks() {
    let mut t = T::new();
    reseed(&mut t.os, [4; 32], true);
    t.now(0);
    let bytes = postcard::to_allocvec(&t.os.proc).unwrap();
    let back: Proc = postcard::from_bytes(&bytes).unwrap();
    assert_eq!(back, t.os.proc);
}
