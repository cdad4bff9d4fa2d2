//! The CPUs the guest sees and its scheduling settings: affinity, getcpu, nice values, policies,
//! sched_yield, and sysinfo.
//!
//! The guest runs on one vCPU; every guest process is under SCHED_OTHER and what it sets here is
//! bookkeeping that never reaches the host, which schedules the sandbox as a whole.
//!
//! # The CPU count
//!
//! How many CPUs the guest sees is a setting of the sandbox ([`Proc::cpus`], 1 unless
//! `VmConfig::cpus` or the engine's `COLLIMATE_CPUS` say otherwise, at most [`MAX_CPUS`]). Every
//! place a program learns it agrees: sched_getaffinity (glibc's `CPU_COUNT`, `nproc`,
//! `os.sched_getaffinity`), /sys/devices/system/cpu/{online,possible,present} and /proc/stat
//! (`sysconf(_SC_NPROCESSORS_ONLN)`, `os.cpu_count()`), /proc/cpuinfo and the cpuN directories
//! (`_SC_NPROCESSORS_CONF`, OpenBLAS, OpenMP). The threads a program starts for them still take
//! turns on the one vCPU (`vmm::threads`): a count above 1 makes thread pools (OpenBLAS,
//! `ThreadPoolExecutor()`) start that many workers, which costs switches and buys no parallelism,
//! so 1 is the default; more is for programs whose behaviour depends on it. The count is fixed when
//! the sandbox's first process starts and carried by snapshots and forks: libraries read it once
//! (OpenBLAS sizes its pool when it loads), so a template and its clones must agree.
//!
//! The affinity mask sched_setaffinity sets is kept per process (Linux keeps it per thread) and
//! only answered back; getcpu names the first CPU in it.

use super::clock::{clock_now_ns, timespec_bytes};
use super::process::{is_self, Proc};
use super::{Ctx, Errno, GuestOs, SysResult, EINVAL, EPERM, ESRCH};

/// Most CPUs a sandbox may show (one 64-bit affinity word).
pub const MAX_CPUS: u32 = 64;

/// The CPU count a sandbox gets when its config names none: `COLLIMATE_CPUS`, else 1.
pub fn default_cpus() -> Result<u32, String> {
    match std::env::var("COLLIMATE_CPUS") {
        Ok(v) => match v.trim().parse::<u32>() {
            Ok(n) if (1..=MAX_CPUS).contains(&n) => Ok(n),
            _ => Err(format!("COLLIMATE_CPUS={v:?} is not a CPU count: a sandbox sees 1 to {MAX_CPUS} CPUs")),
        },
        Err(_) => Ok(1),
    }
}

/// Give a new sandbox's first process `n` CPUs (all of them in its affinity mask).
pub fn set_cpus(p: &mut Proc, n: u32) -> Result<(), String> {
    if !(1..=MAX_CPUS).contains(&n) {
        return Err(format!("a sandbox sees 1 to {MAX_CPUS} CPUs, not {n}"));
    }
    p.cpus = n;
    p.affinity = all_cpus(n);
    Ok(())
}

/// The mask of CPUs 0..n.
pub fn all_cpus(n: u32) -> u64 {
    if n >= 64 {
        u64::MAX
    } else {
        (1u64 << n) - 1
    }
}

/// CPUs 0..n as a Linux CPU list ("0", "0-3"), as /sys/devices/system/cpu/online shows them.
pub fn cpu_list(n: u32) -> String {
    if n <= 1 {
        "0".into()
    } else {
        format!("0-{}", n - 1)
    }
}

/// A CPU mask as a Linux CPU list ("0,2-3").
pub fn mask_list(mask: u64) -> String {
    let mut parts = Vec::new();
    let mut i = 0;
    while i < 64 {
        if mask & (1 << i) == 0 {
            i += 1;
            continue;
        }
        let start = i;
        while i < 64 && mask & (1 << i) != 0 {
            i += 1;
        }
        parts.push(if i - 1 == start { start.to_string() } else { format!("{start}-{}", i - 1) });
    }
    parts.join(",")
}

pub const SYS_SCHED_YIELD: u64 = 24;
pub const SYS_GETPRIORITY: u64 = 140;
pub const SYS_SETPRIORITY: u64 = 141;
pub const SYS_SCHED_SETPARAM: u64 = 142;
pub const SYS_SCHED_GETPARAM: u64 = 143;
pub const SYS_SCHED_SETSCHEDULER: u64 = 144;
pub const SYS_SCHED_GETSCHEDULER: u64 = 145;
pub const SYS_SCHED_GET_PRIORITY_MAX: u64 = 146;
pub const SYS_SCHED_GET_PRIORITY_MIN: u64 = 147;
pub const SYS_SCHED_RR_GET_INTERVAL: u64 = 148;
pub const SYS_SCHED_SETAFFINITY: u64 = 203;
pub const SYS_SCHED_GETAFFINITY: u64 = 204;
pub const SYS_GETCPU: u64 = 309;
pub const SYS_SYSINFO: u64 = 99;

/// Handle a scheduling, affinity or sysinfo call; `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_SCHED_YIELD => Ok(0),
        // Scheduling: every guest process runs under SCHED_OTHER. Its nice value is kept (and
        // inherited by its children) with Linux's rules: anyone may lower its priority, only root
        // raise it. It does not reach the host, which schedules the sandbox as a whole. Other
        // processes answer as nice 0.
        SYS_GETPRIORITY | SYS_SETPRIORITY => {
            let (which, who) = (a[0], a[1] as i32);
            let me = match which {
                0 => who == 0 || who == p.pid,
                1 => who == 0 || who == p.pgid,
                _ => who == 0 || who as u32 == p.uid[0],
            };
            if which > 2 || who < 0 {
                Err(EINVAL)
            } else if nr == SYS_GETPRIORITY {
                Ok((20 - if me { p.nice } else { 0 }) as u64) // the raw syscall answers 20 - nice
            } else if !me {
                Err(ESRCH)
            } else {
                let want = (a[2] as i32).clamp(-20, 19);
                if want < p.nice && p.uid[1] != 0 {
                    Err(super::EACCES)
                } else {
                    p.nice = want;
                    Ok(0)
                }
            }
        }
        SYS_SCHED_GETSCHEDULER => if (a[0] as i32) < 0 { Err(EINVAL) } else { Ok(0) },
        SYS_SCHED_GETPARAM => {
            if (a[0] as i32) < 0 || a[1] == 0 {
                Err(EINVAL)
            } else {
                ctx.write(a[1], &0i32.to_le_bytes()).map(|_| 0)
            }
        }
        SYS_SCHED_SETSCHEDULER | SYS_SCHED_SETPARAM => {
            let (policy, param) = if nr == SYS_SCHED_SETSCHEDULER { (a[1] as i32, a[2]) } else { (0, a[1]) };
            if (a[0] as i32) < 0 || param == 0 {
                Err(EINVAL)
            } else {
                let mut b = [0u8; 4];
                ctx.read(param, &mut b).and_then(|_| {
                    let prio = i32::from_le_bytes(b);
                    // SCHED_OTHER (0), SCHED_BATCH (3), SCHED_IDLE (5) take priority 0 only;
                    // the real-time policies (1, 2) need privileges the sandbox does not give.
                    match policy & !0x4000_0000 {
                        0 | 3 | 5 if prio == 0 => Ok(0),
                        0 | 3 | 5 => Err(EINVAL),
                        1 | 2 if (1..=99).contains(&prio) => Err(EPERM),
                        _ => Err(EINVAL),
                    }
                })
            }
        }
        SYS_SCHED_GET_PRIORITY_MAX | SYS_SCHED_GET_PRIORITY_MIN => match a[0] {
            0 | 3 | 5 => Ok(0),
            1 | 2 => Ok(if nr == SYS_SCHED_GET_PRIORITY_MAX { 99 } else { 1 }),
            _ => Err(EINVAL),
        },
        SYS_SCHED_RR_GET_INTERVAL => {
            if (a[0] as i32) < 0 {
                Err(EINVAL)
            } else {
                ctx.write(a[1], &timespec_bytes(0, 0)).map(|_| 0)
            }
        }
        SYS_SCHED_GETAFFINITY => {
            let len = a[1];
            if !is_self(p, a[0]) {
                Err(ESRCH)
            } else if len < 8 || len % 8 != 0 {
                Err(EINVAL)
            } else {
                ctx.write(a[2], &p.affinity.to_le_bytes()).map(|_| 8)
            }
        }
        // A mask of any length; CPUs past the sandbox's are ignored, as Linux ignores CPUs that
        // do not exist, and a mask with none of its CPUs is EINVAL.
        SYS_SCHED_SETAFFINITY => {
            if !is_self(p, a[0]) {
                Err(ESRCH)
            } else if a[1] == 0 {
                Err(EINVAL)
            } else {
                ctx.read_vec(a[2], a[1].min(8) as usize).and_then(|b| {
                    let mut w = [0u8; 8];
                    w[..b.len()].copy_from_slice(&b);
                    let mask = u64::from_le_bytes(w) & all_cpus(p.cpus);
                    if mask == 0 {
                        return Err(EINVAL);
                    }
                    p.affinity = mask;
                    Ok(0)
                })
            }
        }
        SYS_GETCPU => {
            let cpu = p.affinity.trailing_zeros().min(p.cpus.saturating_sub(1)).to_le_bytes();
            let node = 0u32.to_le_bytes();
            let r = if a[0] != 0 { ctx.write(a[0], &cpu) } else { Ok(()) };
            r.and_then(|_| if a[1] != 0 { ctx.write(a[1], &node) } else { Ok(()) }).map(|_| 0)
        }
        SYS_SYSINFO => {
            let mapped: u64 = os.mm.vmas.iter().map(|(start, v)| v.end - start).sum();
            sysinfo(p, ctx, mapped).and_then(|b| ctx.write(a[0], &b).map(|_| 0))
        }
        _ => return None,
    };
    Some(r)
}

/// `struct sysinfo` (112 bytes on x86-64): the guest's memory, one process, no swap.
fn sysinfo(p: &mut Proc, ctx: &Ctx, mapped: u64) -> Result<[u8; 112], Errno> {
    let mut b = [0u8; 112];
    let uptime = clock_now_ns(p, libc::CLOCK_MONOTONIC)?.saturating_sub(p.start_ns) / 1_000_000_000;
    let total = ctx.memory.total();
    let free = ctx.memory.free(mapped);
    b[..8].copy_from_slice(&uptime.to_le_bytes());
    b[32..40].copy_from_slice(&total.to_le_bytes());
    b[40..48].copy_from_slice(&free.min(total).to_le_bytes());
    b[80..82].copy_from_slice(&1u16.to_le_bytes());
    b[104..108].copy_from_slice(&1u32.to_le_bytes());
    Ok(b)
}
