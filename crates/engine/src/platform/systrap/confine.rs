//! Confinement of a stub process: what it may reach besides the syscalls the filter admits.
//!
//! Applied by the new process between its creation and its jump into the blob (see [`Stub::spawn`]).

/// What the VMM asks of a new stub's confinement.
#[derive(Debug, Clone)]
pub struct Confinement {
    /// The host uid and gid the stub runs as when the VMM is root (default 65534, nobody).
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// RLIMIT_NPROC: counted per user over the whole host (every stub runs as `uid`), so it bounds
    /// all stubs together; forks of stubs need room (default 4096).
    pub max_processes: u64,
    /// RLIMIT_AS: bounds the address space a guest can grab by calling into the blob behind the
    /// VMM's back (`None`: unbounded; guest memory is usually bounded where it is created).
    pub address_space: Option<u64>,
    /// RLIMIT_DATA: bounds the private writable memory a guest can map (`None`: unbounded). Unlike
    /// RLIMIT_AS it does not count reservations (PROT_NONE, as glibc's per-thread malloc arenas
    /// reserve 64 MiB each) nor read-only mappings: closer to kvm, where guest memory is the
    /// pages used, so a 1 GiB guest starts 100 threads there as on kvm (RLIMIT_AS stopped it at 60).
    pub data: Option<u64>,
    /// Create the namespaces where the host allows them (default true).
    pub namespaces: bool,
    /// Trap `rdtsc` from the start (PR_SET_TSC; default true). On a nested host each context
    /// switch into or out of a trapping stub rewrites CR4, which costs an exit to the hypervisor,
    /// so a VMM that decides per exec spawns with this off and turns it on only for the execs that
    /// need it ([`super::Stub::set_traps`]).
    pub trap_rdtsc: bool,
    /// Trap `cpuid` from the start where the CPU has CPUID faulting (default true). The same
    /// per-switch cost (an MSR write) on a nested host; also switchable later.
    pub trap_cpuid: bool,
}

impl Default for Confinement {
    fn default() -> Self {
        Confinement { uid: 65534, gid: 65534, max_processes: 4096, address_space: None, data: None, namespaces: true, trap_rdtsc: true, trap_cpuid: true }
    }
}

impl Confinement {
    /// The default confinement with `rdtsc` and `cpuid` trapped from the start only if `replay`.
    /// Outside replay, as on KVM outside replay, `rdtsc` reads the host's TSC and `cpuid` shows
    /// the host CPU. Each trap costs every context switch into or out of the stub a CR4 or MSR
    /// write, an exit to the hypervisor on a nested host (benches/systrap.rs): a served sandbox
    /// spawns with `for_replay(false)` and switches the traps per exec ([`super::Stub::set_traps`]).
    pub fn for_replay(replay: bool) -> Confinement {
        Confinement { trap_rdtsc: replay, trap_cpuid: replay, ..Confinement::default() }
    }
}

/// What the host granted a stub.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfinementReport {
    /// New mount namespace with an empty tmpfs as root (no host file reachable by path).
    pub mount_ns: bool,
    /// New network namespace (no interfaces but a down loopback).
    pub net_ns: bool,
    /// New IPC namespace (no host SysV IPC or POSIX message queues).
    pub ipc_ns: bool,
    /// New UTS namespace.
    pub uts_ns: bool,
    /// New user namespace (capabilities in it dropped; no uid mapping).
    pub user_ns: bool,
    /// Runs as the unprivileged `Confinement::uid` (false when the VMM itself was not root and the
    /// stub keeps the VMM's uid).
    pub unprivileged_uid: bool,
    /// The CPU has CPUID faulting, so `cpuid` can be trapped ([`super::Stub::set_traps`]).
    /// Without it the guest's `cpuid` always runs natively and sees the host CPU, so output that
    /// depends on CPU features may differ between hosts.
    pub cpuid_faulting: bool,
}

/// `ConfinementReport` bits as the new stub writes them to the shared page.
pub(super) const REPORT_MOUNT_NS: u32 = 1;
pub(super) const REPORT_NET_NS: u32 = 2;
pub(super) const REPORT_IPC_NS: u32 = 4;
pub(super) const REPORT_UTS_NS: u32 = 8;
pub(super) const REPORT_USER_NS: u32 = 16;
pub(super) const REPORT_UNPRIVILEGED: u32 = 32;
pub(super) const REPORT_CPUID: u32 = 64;
pub(super) const REPORT_EMPTY_ROOT: u32 = 128;
/// Not a confinement: `cpuid` traps from the start (`Confinement::trap_cpuid` and the CPU has it).
pub(super) const REPORT_CPUID_TRAPPED: u32 = 256;

impl ConfinementReport {
    pub(super) fn from_bits(b: u32) -> ConfinementReport {
        ConfinementReport {
            mount_ns: b & REPORT_MOUNT_NS != 0 && b & REPORT_EMPTY_ROOT != 0,
            net_ns: b & REPORT_NET_NS != 0,
            ipc_ns: b & REPORT_IPC_NS != 0,
            uts_ns: b & REPORT_UTS_NS != 0,
            user_ns: b & REPORT_USER_NS != 0,
            unprivileged_uid: b & REPORT_UNPRIVILEGED != 0,
            cpuid_faulting: b & REPORT_CPUID != 0,
        }
    }
}

/// The setup steps of a new stub, in order; a failure reports its index (`Page::boot_step`).
pub(super) const STEPS: &[&str] = &[
    "none",
    "prctl(PR_SET_PDEATHSIG)",
    "wait for the VMM",
    "mount namespace: make / private",
    "mount namespace: empty tmpfs root",
    "pivot_root to the empty root",
    "setgroups/setresgid/setresuid",
    "capabilities: drop",
    "rlimits",
    "personality(ADDR_NO_RANDOMIZE)",
    "prctl(PR_SET_TSC, PR_TSC_SIGSEGV)",
    "map the stub region",
    "signal handlers",
    "close fds",
    "seccomp filter",
    "unregister rseq",
];

/// Everything the new process needs, prepared by the VMM: the new process only makes syscalls
/// (it is a copy of a possibly multi-threaded VMM, so it must not allocate or take locks).
pub(super) struct ChildArgs<'a> {
    pub parent: i32,
    pub sock: i32,
    pub memfd: i32,
    pub page: *mut super::shared::Page,
    pub conf: Confinement,
    pub filter: &'a [seccompiler::sock_filter],
    pub blob: &'static [u8],
    pub pivot_dir: Option<&'a std::ffi::CStr>,
    pub root: bool,
}

/// The kernel's `struct sigaction` for `rt_sigaction` (glibc's wrapper would substitute its own
/// restorer, which is not mapped in the stub).
#[repr(C)]
struct KernelSigaction {
    handler: u64,
    flags: u64,
    restorer: u64,
    mask: u64,
}

// glibc's rseq registration (since glibc 2.35): where in the thread's TLS and how long.
extern "C" {
    static __rseq_offset: isize;
    static __rseq_size: u32;
}
/// The signature glibc registers rseq with on x86.
const RSEQ_SIG: u32 = 0x5305_3053;

/// `sa_flags` bit: `restorer` is set (not exported by the libc crate).
const SA_RESTORER: u64 = 0x0400_0000;

/// Signals whose delivery means a guest exit: the synchronous ones, and the VMM's kick
/// (`preempt::KICK_SIGNAL`).
pub(super) const TRAPPED_SIGNALS: [i32; 7] =
    [libc::SIGSYS, libc::SIGSEGV, libc::SIGBUS, libc::SIGILL, libc::SIGFPE, libc::SIGTRAP, super::preempt::KICK_SIGNAL];

/// The new stub process: confine itself, map the stub region, install the filter, enter the blob.
///
/// # Safety
/// Runs in the child of a `clone` without `CLONE_VM`, on its own stack; `arg` points to a live
/// `ChildArgs` (in the child's copy of the VMM's memory).
pub(super) extern "C" fn child_main(arg: *mut libc::c_void) -> libc::c_int {
    // SAFETY: the caller passes a pointer to a `ChildArgs` that lives in this process's memory copy.
    let a = unsafe { &*(arg as *const ChildArgs<'_>) };
    let fail = |step: usize| -> ! {
        let e = std::io::Error::last_os_error().raw_os_error().unwrap_or(0);
        // SAFETY: `page` is the VMM's shared mapping, inherited and still mapped here.
        unsafe {
            (*a.page).boot_errno = e;
            (*a.page).boot_step = step as u32;
            libc::_exit(100 + step as i32)
        }
    };
    let mut report = 0u32;
    // SAFETY: for every libc call below: plain syscalls with arguments built here from values
    // prepared by the VMM; pointers point to locals or to `ChildArgs` data, valid for the call.
    unsafe {
        if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL, 0, 0, 0) != 0 || libc::getppid() != a.parent {
            fail(1);
        }
        let mut go = 0u8;
        if libc::read(a.sock, (&raw mut go).cast(), 1) != 1 {
            fail(2);
        }
        if a.conf.namespaces && a.root {
            for (flag, bit) in [
                (libc::CLONE_NEWNS, REPORT_MOUNT_NS),
                (libc::CLONE_NEWNET, REPORT_NET_NS),
                (libc::CLONE_NEWIPC, REPORT_IPC_NS),
                (libc::CLONE_NEWUTS, REPORT_UTS_NS),
            ] {
                if libc::unshare(flag) == 0 {
                    report |= bit;
                }
            }
            if report & REPORT_MOUNT_NS != 0 {
                if let Some(dir) = a.pivot_dir {
                    if libc::mount(std::ptr::null(), c"/".as_ptr(), std::ptr::null(), libc::MS_REC | libc::MS_PRIVATE, std::ptr::null()) != 0 {
                        fail(3);
                    }
                    let flags = libc::MS_RDONLY | libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
                    if libc::mount(c"collimate-stub".as_ptr(), dir.as_ptr(), c"tmpfs".as_ptr(), flags, c"size=4k,nr_inodes=2,mode=0555".as_ptr().cast()) != 0 {
                        fail(4);
                    }
                    if libc::chdir(dir.as_ptr()) != 0
                        || libc::syscall(libc::SYS_pivot_root, c".".as_ptr(), c".".as_ptr()) != 0
                        || libc::umount2(c".".as_ptr(), libc::MNT_DETACH) != 0
                        || libc::chdir(c"/".as_ptr()) != 0
                    {
                        fail(5);
                    }
                    report |= REPORT_EMPTY_ROOT;
                }
            }
        }
        if a.root {
            // Raw syscalls: glibc's wrappers apply the change to every thread it knows of, and
            // this single-threaded clone still has the VMM's thread list (it deadlocks there).
            let (u, g) = (a.conf.uid, a.conf.gid);
            if libc::syscall(libc::SYS_setgroups, 0usize, std::ptr::null::<libc::gid_t>()) != 0
                || libc::syscall(libc::SYS_setresgid, g, g, g) != 0
                || libc::syscall(libc::SYS_setresuid, u, u, u) != 0
            {
                fail(6);
            }
            report |= REPORT_UNPRIVILEGED;
        }
        if a.conf.namespaces && libc::unshare(libc::CLONE_NEWUSER) == 0 {
            report |= REPORT_USER_NS;
        }
        // Whatever capabilities the new user namespace gave: none in the bounding, ambient,
        // inheritable, permitted or effective sets.
        for cap in 0..64 {
            libc::prctl(libc::PR_CAPBSET_DROP, cap, 0, 0, 0);
        }
        libc::prctl(libc::PR_CAP_AMBIENT, libc::PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0);
        let hdr = [0x2008_0522u32, 0]; // _LINUX_CAPABILITY_VERSION_3, this process
        let data = [0u32; 6];
        if libc::syscall(libc::SYS_capset, hdr.as_ptr(), data.as_ptr()) != 0 {
            fail(7);
        }
        let lim = |r: libc::__rlimit_resource_t, v: u64| {
            let l = libc::rlimit { rlim_cur: v, rlim_max: v };
            libc::setrlimit(r, &l) == 0
        };
        let nproc_ok = !a.root || lim(libc::RLIMIT_NPROC, a.conf.max_processes);
        let as_ok = a.conf.address_space.is_none_or(|v| lim(libc::RLIMIT_AS, v));
        let data_ok = a.conf.data.is_none_or(|v| lim(libc::RLIMIT_DATA, v));
        if !(lim(libc::RLIMIT_NOFILE, 8) && lim(libc::RLIMIT_CORE, 0) && lim(libc::RLIMIT_FSIZE, 0) && nproc_ok && as_ok && data_ok) {
            fail(8);
        }
        if libc::personality(libc::ADDR_NO_RANDOMIZE as libc::c_ulong) < 0 {
            fail(9);
        }
        libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0);
        if a.conf.trap_rdtsc && libc::prctl(libc::PR_SET_TSC, libc::PR_TSC_SIGSEGV, 0, 0, 0) != 0 {
            fail(10);
        }
        // ARCH_SET_CPUID answers ENODEV where the CPU has no CPUID faulting; asked to leave cpuid
        // enabled (1) it only probes (this clone of the VMM does not trap cpuid).
        let cpuid_arg = if a.conf.trap_cpuid { 0 } else { 1 };
        if libc::syscall(libc::SYS_arch_prctl, super::filter::ARCH_SET_CPUID, cpuid_arg) == 0 {
            report |= REPORT_CPUID;
            if a.conf.trap_cpuid {
                report |= REPORT_CPUID_TRAPPED;
            }
        }
        // The stub region. Whatever of the VMM lies there in this copy goes first.
        use super::layout as l;
        let rw = libc::PROT_READ | libc::PROT_WRITE;
        let private = libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED;
        let at = |addr: u64| addr as *mut libc::c_void;
        libc::munmap(at(l::STUB_BASE), (l::STUB_END - l::STUB_BASE) as usize);
        if libc::mmap(at(l::CODE), l::CODE_LEN as usize, rw, private, -1, 0) != at(l::CODE) {
            fail(11);
        }
        std::ptr::copy_nonoverlapping(a.blob.as_ptr(), l::CODE as *mut u8, a.blob.len());
        if libc::mprotect(at(l::CODE), l::CODE_LEN as usize, libc::PROT_READ | libc::PROT_EXEC) != 0
            || libc::mmap(at(l::SHARED), l::SHARED_LEN as usize, rw, libc::MAP_SHARED | libc::MAP_FIXED, a.memfd, 0) != at(l::SHARED)
            || libc::mmap(at(l::ALT_STACK), (l::ALT_STACK_LEN + l::BOOT_STACK_LEN) as usize, rw, private, -1, 0) != at(l::ALT_STACK)
        {
            fail(11);
        }
        (*a.page).report = report;
        // Signals: every disposition back to default (the VMM's handlers are not mapped in the
        // stub), the trapped ones to the blob on the alternate stack with everything blocked while
        // it runs, SIGCHLD ignored so forked stubs are reaped by the kernel.
        let dfl = KernelSigaction { handler: 0, flags: 0, restorer: 0, mask: 0 };
        for sig in 1..=64 {
            if sig != libc::SIGKILL && sig != libc::SIGSTOP {
                libc::syscall(libc::SYS_rt_sigaction, sig, &dfl as *const KernelSigaction, 0usize, 8usize);
            }
        }
        let trap = KernelSigaction {
            handler: super::blob::handler(),
            flags: (libc::SA_SIGINFO | libc::SA_ONSTACK) as u64 | SA_RESTORER,
            restorer: super::blob::restorer(),
            mask: u64::MAX,
        };
        for sig in TRAPPED_SIGNALS {
            if libc::syscall(libc::SYS_rt_sigaction, sig, &trap as *const KernelSigaction, 0usize, 8usize) != 0 {
                fail(12);
            }
        }
        let ign = KernelSigaction { handler: 1 /* SIG_IGN */, flags: 0, restorer: 0, mask: 0 };
        libc::syscall(libc::SYS_rt_sigaction, libc::SIGCHLD, &ign as *const KernelSigaction, 0usize, 8usize);
        let ss = libc::stack_t { ss_sp: at(l::ALT_STACK), ss_flags: 0, ss_size: l::ALT_STACK_LEN as usize };
        let empty = 0u64;
        if libc::sigaltstack(&ss, std::ptr::null_mut()) != 0
            || libc::syscall(libc::SYS_rt_sigprocmask, libc::SIG_SETMASK, &empty as *const u64, 0usize, 8usize) != 0
        {
            fail(12);
        }
        // Only the socket stays, as SOCK_FD (the memfd is mapped; everything else is the VMM's).
        if a.sock != l::SOCK_FD && libc::dup2(a.sock, l::SOCK_FD) != l::SOCK_FD {
            fail(13);
        }
        if libc::syscall(libc::SYS_close_range, l::SOCK_FD as u32 + 1, u32::MAX, 0) != 0 {
            fail(13);
        }
        for fd in 0..l::SOCK_FD {
            libc::close(fd);
        }
        // glibc registered an rseq area in the VMM thread's TLS, and the registration survives the
        // clone: once the boot unmaps the TLS, the kernel's next rseq update (at a preemption or a
        // signal) would fail and kill the stub with SIGSEGV. Unregister it.
        if __rseq_size > 0 {
            let tp: u64;
            std::arch::asm!("mov {}, qword ptr fs:0", out(reg) tp, options(nostack, readonly));
            let area = tp.wrapping_add(__rseq_offset as u64);
            let ok = [32u32, __rseq_size].iter().any(|&len| libc::syscall(libc::SYS_rseq, area, len, 1 /* RSEQ_FLAG_UNREGISTER */, RSEQ_SIG) == 0);
            if !ok {
                fail(15);
            }
        }
        // From here on every syscall outside the blob traps, so the next instructions make none.
        if seccompiler::apply_filter(a.filter).is_err() {
            fail(14);
        }
        std::arch::asm!(
            "mov rsp, {sp}",
            "jmp {entry}",
            sp = in(reg) l::BOOT_STACK + l::BOOT_STACK_LEN,
            entry = in(reg) super::blob::boot(),
            options(noreturn),
        );
    }
}
