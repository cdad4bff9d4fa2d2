//! The stub's seccomp filter: every syscall from guest code traps; the blob's own few are admitted.
//!
//! Hand-built BPF rather than `seccompiler`'s rule compiler, because the decision depends on
//! `seccomp_data.instruction_pointer`, which seccompiler's conditions (syscall arguments only)
//! cannot express; seccompiler still installs the program ([`seccompiler::apply_filter`]).
//!
//! The program, in order:
//! 1. another architecture (i386 `int 0x80`): `SECCOMP_RET_TRAP`, wherever it comes from (the
//!    syscall does not run); the VMM gives the guest the SIGSEGV that kvm's general protection
//!    fault gives it (`Stub::run`: the personality serves x86-64 only).
//! 2. the return address outside `[CODE, blob::allowed_end()]`: `SECCOMP_RET_TRAP` (SIGSYS to the
//!    blob's handler; the syscall does not run). This is every guest syscall.
//! 3. from the blob: the syscalls in [`STUB_SYSCALLS`], `clone` only as a plain fork, `arch_prctl`
//!    only to get or set the FS base or to turn CPUID faulting on or off (`ARCH_SET_CPUID`),
//!    `prctl` only as `PR_SET_TSC` (trap `rdtsc` or not); anything else kills the process. Guest
//!    code can jump into the blob, so this list, not the blob, is the boundary of what reaches the
//!    host kernel. The two trap switches are the VMM's per-exec choice (`Stub::set_traps`); a guest
//!    that jumps into the blob to flip them changes only what its own `rdtsc`/`cpuid` read (the
//!    host's counter and CPU, which a guest outside replay reads anyway), never the host.

use seccompiler::sock_filter;

use super::{blob, layout};

/// Syscalls the blob may make (from its own code only).
pub const STUB_SYSCALLS: &[(i64, &str)] = &[
    (libc::SYS_rt_sigreturn, "rt_sigreturn: return from the trap into the guest"),
    (libc::SYS_futex, "futex: the wake-up with the VMM"),
    (libc::SYS_ppoll, "ppoll: notice that the VMM is gone"),
    (libc::SYS_sched_yield, "sched_yield: let the VMM run before sleeping"),
    (libc::SYS_exit_group, "exit_group: end when the VMM is gone"),
    (libc::SYS_mmap, "mmap: the VMM's map()"),
    (libc::SYS_munmap, "munmap: unmap(), and the boot unmapping the VMM's image"),
    (libc::SYS_mprotect, "mprotect: protect()"),
    (libc::SYS_mremap, "mremap: moving a guest mapping"),
    (libc::SYS_madvise, "madvise: dropping guest pages"),
    (libc::SYS_recvmsg, "recvmsg: fds from the VMM (SCM_RIGHTS)"),
    (libc::SYS_close, "close: those fds, after the mmap"),
    (libc::SYS_dup2, "dup2: a forked stub's own socket"),
];

const LD_W_ABS: u16 = 0x20; // BPF_LD | BPF_W | BPF_ABS
const JEQ_K: u16 = 0x15; // BPF_JMP | BPF_JEQ | BPF_K
const JGE_K: u16 = 0x35;
const JGT_K: u16 = 0x25;
const RET_K: u16 = 0x06;

const AUDIT_ARCH_X86_64: u32 = 0xc000_003e;
const OFF_NR: u32 = 0;
const OFF_ARCH: u32 = 4;
const OFF_IP_LO: u32 = 8;
const OFF_IP_HI: u32 = 12;
const OFF_ARG0_LO: u32 = 16;
const OFF_ARG0_HI: u32 = 20;

/// `arch_prctl(ARCH_SET_CPUID, on)`: 0 turns CPUID faulting on for the calling thread, 1 off.
pub const ARCH_SET_CPUID: u32 = 0x1012;

fn stmt(code: u16, k: u32) -> sock_filter {
    sock_filter { code, jt: 0, jf: 0, k }
}

fn jump(code: u16, k: u32, jt: u8, jf: u8) -> sock_filter {
    sock_filter { code, jt, jf, k }
}

/// The filter program for a stub. Built by the VMM before the stub is created (the new process
/// must not allocate).
pub fn program() -> Vec<sock_filter> {
    let lo = layout::CODE as u32;
    let hi = (layout::CODE >> 32) as u32;
    let end_lo = blob::allowed_end() as u32;
    assert_eq!(blob::allowed_end() >> 32, layout::CODE >> 32, "the blob must not cross a 4 GiB boundary");

    let mut p = vec![
        stmt(LD_W_ABS, OFF_ARCH),
        jump(JEQ_K, AUDIT_ARCH_X86_64, 1, 0),
        stmt(RET_K, libc::SECCOMP_RET_TRAP),
        stmt(LD_W_ABS, OFF_IP_HI),
        jump(JEQ_K, hi, 1, 0),
        stmt(RET_K, libc::SECCOMP_RET_TRAP),
        stmt(LD_W_ABS, OFF_IP_LO),
        jump(JGE_K, lo, 1, 0),
        stmt(RET_K, libc::SECCOMP_RET_TRAP),
        jump(JGT_K, end_lo, 0, 1),
        stmt(RET_K, libc::SECCOMP_RET_TRAP),
        // From the blob.
        stmt(LD_W_ABS, OFF_NR),
    ];
    // Plain allowed syscalls: jeq nr -> ALLOW (placed right after the list and the special cases).
    let specials = 3; // clone, arch_prctl, prctl: each a jeq to its block
    let n = STUB_SYSCALLS.len();
    for (i, (nr, _)) in STUB_SYSCALLS.iter().enumerate() {
        // Instructions after this one before ALLOW: the rest of the list, the special jeqs, KILL.
        let to_allow = (n - i - 1) + specials + 1;
        p.push(jump(JEQ_K, *nr as u32, to_allow as u8, 0));
    }
    // clone -> CLONE block (after ALLOW), arch_prctl -> ARCH block, prctl -> PRCTL block.
    p.push(jump(JEQ_K, libc::SYS_clone as u32, 4, 0)); // skip: arch_prctl jeq, prctl jeq, KILL, ALLOW
    p.push(jump(JEQ_K, libc::SYS_arch_prctl as u32, 9, 0)); // skip: prctl jeq, KILL, ALLOW, the clone block (5), the ARCH block's ALLOW
    p.push(jump(JEQ_K, libc::SYS_prctl as u32, 16, 0)); // skip: KILL, ALLOW, the clone block (5), the ARCH block (9)
    p.push(stmt(RET_K, libc::SECCOMP_RET_KILL_PROCESS));
    p.push(stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    // CLONE block: arg0 == SIGCHLD (a plain fork), high word 0.
    p.push(stmt(LD_W_ABS, OFF_ARG0_LO));
    p.push(jump(JEQ_K, libc::SIGCHLD as u32, 0, 2));
    p.push(stmt(LD_W_ABS, OFF_ARG0_HI));
    p.push(jump(JEQ_K, 0, 1, 0));
    p.push(stmt(RET_K, libc::SECCOMP_RET_KILL_PROCESS));
    // ARCH block: ARCH_SET_FS (0x1002), ARCH_GET_FS (0x1003) or ARCH_SET_CPUID (0x1012), high
    // word 0. (The block above falls through here when the fork is allowed: so ALLOW comes first
    // in this block.)
    p.push(stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    p.push(stmt(LD_W_ABS, OFF_ARG0_HI));
    p.push(jump(JEQ_K, 0, 0, 4)); // -> KILL
    p.push(stmt(LD_W_ABS, OFF_ARG0_LO));
    p.push(jump(JEQ_K, 0x1002, 3, 0)); // -> ALLOW
    p.push(jump(JEQ_K, 0x1003, 2, 0));
    p.push(jump(JEQ_K, ARCH_SET_CPUID, 1, 0));
    p.push(stmt(RET_K, libc::SECCOMP_RET_KILL_PROCESS));
    p.push(stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    // PRCTL block: PR_SET_TSC only, high word 0.
    p.push(stmt(LD_W_ABS, OFF_ARG0_HI));
    p.push(jump(JEQ_K, 0, 0, 2)); // -> KILL
    p.push(stmt(LD_W_ABS, OFF_ARG0_LO));
    p.push(jump(JEQ_K, libc::PR_SET_TSC as u32, 1, 0));
    p.push(stmt(RET_K, libc::SECCOMP_RET_KILL_PROCESS));
    p.push(stmt(RET_K, libc::SECCOMP_RET_ALLOW));
    p
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A tiny interpreter of the subset of classic BPF the program uses, to check the decisions
    /// without installing the filter.
    fn run(p: &[sock_filter], nr: u32, ip: u64, arg0: u64) -> u32 {
        run_as(p, AUDIT_ARCH_X86_64, nr, ip, arg0)
    }

    fn run_as(p: &[sock_filter], arch: u32, nr: u32, ip: u64, arg0: u64) -> u32 {
        let data = |off: u32| -> u32 {
            match off {
                OFF_NR => nr,
                OFF_ARCH => arch,
                OFF_IP_LO => ip as u32,
                OFF_IP_HI => (ip >> 32) as u32,
                OFF_ARG0_LO => arg0 as u32,
                OFF_ARG0_HI => (arg0 >> 32) as u32,
                _ => panic!("unexpected load {off}"),
            }
        };
        let (mut pc, mut a) = (0usize, 0u32);
        loop {
            let i = &p[pc];
            pc += 1;
            match i.code {
                LD_W_ABS => a = data(i.k),
                RET_K => return i.k,
                JEQ_K | JGE_K | JGT_K => {
                    let t = match i.code {
                        JEQ_K => a == i.k,
                        JGE_K => a >= i.k,
                        _ => a > i.k,
                    };
                    pc += if t { i.jt } else { i.jf } as usize;
                }
                c => panic!("unexpected insn {c:#x}"),
            }
        }
    }

    #[test]
    fn guest_syscalls_trap_and_stub_syscalls_are_bounded() {
        let p = program();
        let inside = layout::CODE + 0x10;
        let trap = libc::SECCOMP_RET_TRAP;
        let allow = libc::SECCOMP_RET_ALLOW;
        let kill = libc::SECCOMP_RET_KILL_PROCESS;
        for nr in [libc::SYS_openat, libc::SYS_futex, libc::SYS_mmap, libc::SYS_rt_sigreturn] {
            assert_eq!(run(&p, nr as u32, 0x40_1000, 0), trap);
            assert_eq!(run(&p, nr as u32, layout::CODE - 2, 0), trap);
            assert_eq!(run(&p, nr as u32, blob::allowed_end() + 2, 0), trap, "the boot trap");
        }
        for (nr, _) in STUB_SYSCALLS {
            assert_eq!(run(&p, *nr as u32, inside, 0), allow);
        }
        assert_eq!(run(&p, libc::SYS_munmap as u32, blob::allowed_end(), 0), allow);
        assert_eq!(run(&p, libc::SYS_openat as u32, inside, 0), kill);
        assert_eq!(run(&p, libc::SYS_ptrace as u32, inside, 0), kill);
        assert_eq!(run(&p, libc::SYS_clone as u32, inside, libc::SIGCHLD as u64), allow);
        assert_eq!(run(&p, libc::SYS_clone as u32, inside, libc::CLONE_NEWUSER as u64 | 17), kill);
        assert_eq!(run(&p, libc::SYS_clone as u32, inside, (1 << 32) | 17), kill);
        assert_eq!(run(&p, libc::SYS_arch_prctl as u32, inside, 0x1002), allow);
        assert_eq!(run(&p, libc::SYS_arch_prctl as u32, inside, 0x1003), allow);
        assert_eq!(run(&p, libc::SYS_arch_prctl as u32, inside, 0x1012), allow, "ARCH_SET_CPUID: the per-exec trap switch");
        assert_eq!(run(&p, libc::SYS_arch_prctl as u32, inside, 0x1011), kill, "ARCH_GET_CPUID is not needed");
        assert_eq!(run(&p, libc::SYS_arch_prctl as u32, inside, 0x1001), kill, "ARCH_SET_GS");
        assert_eq!(run(&p, libc::SYS_arch_prctl as u32, inside, (1 << 32) | 0x1002), kill);
        assert_eq!(run(&p, libc::SYS_prctl as u32, inside, libc::PR_SET_TSC as u64), allow);
        assert_eq!(run(&p, libc::SYS_prctl as u32, inside, (1 << 32) | libc::PR_SET_TSC as u64), kill);
        for op in [libc::PR_SET_NO_NEW_PRIVS, libc::PR_SET_SECCOMP, libc::PR_SET_DUMPABLE, libc::PR_SET_MM, libc::PR_CAP_AMBIENT] {
            assert_eq!(run(&p, libc::SYS_prctl as u32, inside, op as u64), kill, "prctl {op}");
        }
        assert_eq!(run(&p, libc::SYS_prctl as u32, 0x40_1000, libc::PR_SET_TSC as u64), trap, "from guest code it traps");
        assert_eq!(run(&p, libc::SYS_openat as u32, (2u64 << 32) | ((layout::CODE & 0xffff_ffff) + 0x10), 0), trap);
        // i386 (`int 0x80`), from the guest or from inside the blob: trapped, never run.
        const AUDIT_ARCH_I386: u32 = 0x4000_0003;
        assert_eq!(run_as(&p, AUDIT_ARCH_I386, 20, 0x40_1000, 0), trap);
        assert_eq!(run_as(&p, AUDIT_ARCH_I386, libc::SYS_futex as u32, inside, 0), trap);
    }
}
