//! The systrap platform: a guest process runs as a confined host process of its own, and every
//! syscall its code makes traps to the VMM through shared memory. No KVM.
//!
//! # Shape
//! A [`Stub`] is one host process that holds one guest process's address space. Its only code of its
//! own is a small position-independent blob ([`blob`]) copied to a fixed high address
//! ([`Stub::reserved_range`]); everything else in its address space is the guest's, placed there by
//! the VMM with [`Stub::map`]. Guest code runs natively in that process. A seccomp filter
//! ([`filter`]) lets through only the few syscalls the blob makes *from the blob's own code*; any
//! syscall from anywhere else (guest code) is not executed but raises SIGSYS. The blob's signal
//! handler, on an alternate stack inside the reserved range, copies the guest's registers from the
//! signal frame into a page shared with the VMM ([`shared`]), hands the turn to the VMM (a short spin,
//! then a futex), waits for the VMM's answer and returns from the signal with the (possibly changed)
//! registers. Page faults (SIGSEGV), bus errors, `rdtsc` (trapped with `PR_SET_TSC`), `cpuid`
//! (trapped with CPUID faulting where the CPU has it) and other synchronous signals take the same
//! path. While the stub is parked in its handler the VMM can also make it execute a few syscalls on
//! the guest's address space (map, unmap, protect) and fork.
//!
//! # Trust
//! Guest code and the blob share one address space, so the guest can write the shared page and the
//! blob's stack, and can even jump into the blob. Nothing there is trusted (as in gVisor's systrap):
//! the boundary is the seccomp filter (which admits from the blob's addresses only the syscalls in
//! [`filter::STUB_SYSCALLS`], with their dangerous arguments pinned) and the confinement around it
//! ([`confine`]: no capabilities, no_new_privs, namespaces, an empty root, rlimits). What a hostile
//! guest can do with the blob is edit its own address space; the VMM treats every value it reads back
//! (registers, exit reasons) as guest-controlled.
//!
//! # What the VMM (the personality) must do
//! - Never hand out guest addresses in [`Stub::reserved_range`] and refuse guest `mmap(MAP_FIXED)`,
//!   `munmap`, `mprotect`, `mremap` and `madvise` on it (the methods here return
//!   [`Error::Reserved`] as a backstop).
//! - Emulate every syscall reported by [`Exit::Syscall`]: the guest's syscalls never run on the host.
//! - Call [`prepare`] once before anything hides the host's `/proc` (the VMM's own jail pivots
//!   to an empty root), since guest memory is reached through `/proc/<pid>/mem`.
//! - Call [`Stub::spawn`] and [`Stub::fork`] from a thread that lives as long as the stub
//!   (`PR_SET_PDEATHSIG` fires when the spawning *thread* exits).
//!
//! One guest context per stub at a time: the registers live in one shared page and one signal
//! frame. A guest process's threads share its stub and take turns on it (the VMM saves one
//! thread's registers, FS base and XSAVE and loads another's at an exit), and the VMM can stop
//! guest code that computes without trapping ([`preempt`]).

pub mod batch;
pub mod blob;
pub mod confine;
pub mod filter;
pub mod layout;
pub mod memory;
pub mod patch;
pub mod placement;
pub mod preempt;
pub mod reaper;
pub mod shared;
pub mod template;
pub mod tsc;
pub mod written;

use std::ffi::CString;
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::sync::atomic::Ordering;

use shared::SharedPage;
pub use shared::Handoff;
pub use template::Template;

pub use confine::{Confinement, ConfinementReport};
pub use kvm_bindings::kvm_regs;

/// What went wrong on the VMM's side of a stub. Guest behaviour never produces these: it produces an
/// [`Exit`].
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The stub could not be created.
    #[error("the systrap stub could not be created at step `{step}`: {source}; the engine needs Linux x86-64 with seccomp, run as root or with user namespaces allowed")]
    Spawn {
        step: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The stub process ended while the VMM needed it.
    #[error("the systrap stub process (pid {pid}) is gone and the guest it held is lost; spawn a new one")]
    Gone { pid: i32 },
    /// A VMM request touched the reserved range.
    #[error("the range {addr:#x}+{len:#x} touches the systrap stub's reserved range; guest mappings must stay outside Stub::reserved_range()")]
    Reserved { addr: u64, len: u64 },
    /// The host kernel refused an address-space edit the stub made for the VMM.
    #[error("the systrap stub's {op} failed: {source}; check the arguments against mmap(2)")]
    Op {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// Guest memory access hit an unmapped or inaccessible byte.
    #[error("guest address {addr:#x} (+{len} bytes) is not mapped or not accessible (EFAULT)")]
    Fault { addr: u64, len: usize },
    /// The request needs a stub parked at a guest exit.
    #[error("the systrap stub cannot {what} now: it has no guest exit to work on; call run() first")]
    NotParked { what: &'static str },
    /// A host call on the VMM's side failed.
    #[error("host call {call} failed: {source}")]
    Host {
        call: &'static str,
        #[source]
        source: std::io::Error,
    },
}

/// The result type of this platform.
pub type Result<T> = std::result::Result<T, Error>;

/// Why [`Stub::run`] returned. In every case the registers passed to `run` now hold the guest's
/// registers at the exit, and `fs_base` its FS base.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Exit {
    /// The guest made a syscall, which did not run on the host. `rax` holds the syscall number,
    /// `rdi, rsi, rdx, r10, r8, r9` its arguments, `rip` the address after the `syscall`
    /// instruction (and `rcx`, `r11` what the instruction put there). Set `rax` to the result and
    /// call `run` again to return it.
    Syscall,
    /// A page fault at `addr` (a read unless `write`; an instruction fetch if `exec`), not served by
    /// the host. `rip` is the faulting instruction: serve the fault (e.g. [`Stub::map`]) and `run`
    /// again to retry it, or deliver a signal.
    Fault { addr: u64, write: bool, exec: bool },
    /// The guest executed `rdtsc` (`rdtscp` if `rdtscp`). `rip` is the instruction (2 bytes, 3 for
    /// `rdtscp`): set `rax`/`rdx` (and `rcx` for `rdtscp`), advance `rip` and `run` again.
    Rdtsc { rdtscp: bool },
    /// The guest executed `cpuid` (only while the stub traps it, [`Stub::set_traps`], which needs
    /// a CPU with CPUID faulting, [`ConfinementReport::cpuid_faulting`]). `rip` is the 2-byte instruction: set
    /// `rax, rbx, rcx, rdx`, advance `rip` by 2 and `run` again.
    Cpuid,
    /// Any other synchronous signal the guest raised: SIGILL, SIGFPE, SIGTRAP, SIGBUS, or a SIGSEGV
    /// that is not a page fault (a general protection fault such as a privileged instruction).
    /// `code` and `addr` are the host's `si_code` and `si_addr`. `rip` is where it happened.
    Signal { signo: i32, code: i32, addr: u64 },
    /// The VMM kicked the stub ([`Stub::kick`], [`preempt`]): the guest stopped between two
    /// instructions at `rip`. `run` again to resume it there.
    Interrupted,
    /// The stub process ended (killed by the host, or by the seccomp filter because code jumped into
    /// the blob with a syscall it may not make). `status` is the raw wait status if known.
    Exited { status: Option<i32> },
}

/// A confined host process holding one guest process's address space and running its code.
///
/// Dropping a `Stub` kills its process. See the module docs for the contract with the VMM.
#[derive(Debug)]
pub struct Stub {
    pid: i32,
    pidfd: OwnedFd,
    sock: OwnedFd,
    mem: std::fs::File,
    page: SharedPage,
    /// The stub is a child of this process (spawned, not forked): reap it on drop.
    child: bool,
    parked: bool,
    /// A guest context exists (the first `run` happened, or this stub was forked from one that had).
    has_guest: bool,
    report: ConfinementReport,
    /// Whether `rdtsc` and `cpuid` trap in this stub now ([`Stub::set_traps`]).
    traps: Traps,
    handoff: Handoff,
    /// Whether each side's spins pay (an adaptive `handoff`).
    spin: shared::SpinState,
    /// [`Stub::set_clock_page`] named a page for the next run (the stub copies it at the exit).
    clock_page: bool,
    /// The time of the next run, if the caller read the clock just before ([`Stub::set_now`]).
    now: Option<std::time::Instant>,
    exited: Option<Option<i32>>,
    /// Commands handed to the stub so far (round trips besides `run`): [`Stub::commands`].
    commands: u64,
    /// Syscall sites patched into jumps to the blob ([`patch`]).
    patch: patch::Patcher,
    /// Where the serving thread and the stub run ([`placement`]).
    place: placement::Placement,
    /// The hand-off [`Stub::set_handoff`] chose; `handoff` is it, or yield-then-sleep while
    /// [`placement`] keeps both on one CPU.
    chosen: Handoff,
}

/// Which of the guest's non-syscall instructions trap to the VMM ([`Exit::Rdtsc`], [`Exit::Cpuid`]).
///
/// A stub process's own setting (`PR_SET_TSC`, `ARCH_SET_CPUID`), switched by the stub's blob on
/// the VMM's command, so a VMM can trap per exec rather than for the stub's whole life: on a
/// nested host every context switch into or out of a trapping process rewrites CR4 (rdtsc) or an
/// MSR (CPUID faulting), an exit to the hypervisor, which made a bare trapped round trip 29 us
/// instead of 6 (docs/systrap.md). Forks inherit it.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Traps {
    /// `rdtsc` and `rdtscp` trap (`PR_TSC_SIGSEGV`).
    pub rdtsc: bool,
    /// `cpuid` traps (CPUID faulting; only where [`ConfinementReport::cpuid_faulting`]).
    pub cpuid: bool,
}

impl Default for Handoff {
    /// [`Handoff::adaptive`]: a short spin on each side, used only while it is answered within it.
    /// Measured on a 2-core nested VM (kvm_pvm host), load 8-12, benches/systrap.rs
    /// (`per_exec_traps`, alternated rounds, 2026-12-07): with the two sides on different CPUs
    /// the bare round trip is 2.8-3.2 us (0.62-0.70x a two-process futex round trip in the same
    /// round), with `rdtsc` trapped too (no context switch, so no CR4 rewrite); where the spin is
    /// not answered (both on one CPU, or the other CPU busy) it backs off to yield-then-sleep and
    /// costs the same 5.4-5.7 us. A fixed spin was bimodal instead (~3 us, or 100-135 us and
    /// p99 in ms when the scheduler kept both on one CPU), and the old 200000 `pause`s a side took
    /// hundreds of ms at the p99 under load.
    ///
    /// `COLLIMATE_SYSTRAP_HANDOFF=yield` makes [`Handoff::yield_then_sleep`] the default instead
    /// (read once per process; to compare in benches).
    fn default() -> Handoff {
        static YIELD: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
        let plain = *YIELD.get_or_init(|| std::env::var_os("COLLIMATE_SYSTRAP_HANDOFF").is_some_and(|v| v == "yield"));
        if plain {
            Handoff::yield_then_sleep()
        } else {
            Handoff::adaptive()
        }
    }
}

impl Handoff {
    /// No spin: each side yields twice, then sleeps in a futex (the default before the adaptive
    /// spin: 5.4-7.5 us either way on the host above).
    pub fn yield_then_sleep() -> Handoff {
        Handoff { vmm_spin: std::time::Duration::ZERO, stub_spin: 0, yields: 2, adaptive: false }
    }

    /// A short spin on each side (10 us on the VMM's, 350 `pause`s, about 10 us, on the stub's)
    /// used only while it is answered within it, then the two yields and the sleep
    /// ([`Handoff::adaptive`]'s field says how it backs off).
    pub fn adaptive() -> Handoff {
        Handoff { vmm_spin: std::time::Duration::from_micros(10), stub_spin: 350, yields: 2, adaptive: true }
    }
}

/// How long [`Stub::spawn`] waits for a new stub's first report before it gives up.
pub const BOOT_TIMEOUT: std::time::Duration = std::time::Duration::from_secs(30);

/// Open the host's `/proc` now, for every stub this process will make. Call it before anything
/// (the VMM's jail) hides `/proc`; calling it again does nothing. [`Stub::spawn`] calls it too.
pub fn prepare() -> Result<()> {
    tsc::install().map_err(|source| Error::Host { call: "sigaction(SIGSEGV) for the VMM thread's rdtsc", source })?;
    placement::home();
    memory::proc_dir().map(|_| ()).map_err(|source| Error::Host { call: "open /proc", source })
}

fn host(call: &'static str) -> impl FnOnce(io::Error) -> Error {
    move |source| Error::Host { call, source }
}

fn socketpair() -> io::Result<(OwnedFd, OwnedFd)> {
    let mut fds = [0; 2];
    // SAFETY: `fds` is a valid array of two ints for the kernel to fill.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_SEQPACKET | libc::SOCK_CLOEXEC, 0, fds.as_mut_ptr()) } != 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: both fds were just created and are owned by nobody else.
    Ok(unsafe { (OwnedFd::from_raw_fd(fds[0]), OwnedFd::from_raw_fd(fds[1])) })
}

fn pidfd_open(pid: i32) -> io::Result<OwnedFd> {
    // SAFETY: plain syscall; the returned fd is owned below.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just created, owned by nobody else.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

/// Send `fds` over `sock` with SCM_RIGHTS (one data byte).
fn send_fds(sock: BorrowedFd<'_>, fds: &[RawFd]) -> io::Result<()> {
    let mut byte = 0u8;
    let mut iov = libc::iovec { iov_base: (&raw mut byte).cast(), iov_len: 1 };
    let data_len = std::mem::size_of_val(fds);
    // SAFETY: CMSG_SPACE only computes a size.
    let space = unsafe { libc::CMSG_SPACE(data_len as u32) } as usize;
    let mut cbuf = [0u64; 8];
    assert!(space <= std::mem::size_of_val(&cbuf));
    // SAFETY: an all-zero msghdr is valid; the pointers set below outlive the sendmsg call.
    let mut msg: libc::msghdr = unsafe { std::mem::zeroed() };
    msg.msg_iov = &mut iov;
    msg.msg_iovlen = 1;
    msg.msg_control = cbuf.as_mut_ptr().cast();
    msg.msg_controllen = space;
    // SAFETY: `msg` has a control buffer of `space` bytes, enough for one cmsg with `fds`.
    unsafe {
        let c = libc::CMSG_FIRSTHDR(&msg);
        (*c).cmsg_level = libc::SOL_SOCKET;
        (*c).cmsg_type = libc::SCM_RIGHTS;
        (*c).cmsg_len = libc::CMSG_LEN(data_len as u32) as usize;
        std::ptr::copy_nonoverlapping(fds.as_ptr(), libc::CMSG_DATA(c).cast::<RawFd>(), fds.len());
        if libc::sendmsg(sock.as_raw_fd(), &msg, libc::MSG_NOSIGNAL) != 1 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

/// Whether user code may use `rdfsbase`/`wrfsbase` here (the kernel says so in AT_HWCAP2).
fn has_fsgsbase() -> bool {
    // SAFETY: getauxval only reads the auxiliary vector.
    unsafe { libc::getauxval(libc::AT_HWCAP2) & 2 != 0 }
}

/// An existing directory to mount the empty root on (the stub never looks it up again).
fn pivot_dir() -> Option<CString> {
    ["/tmp", "/mnt", "/proc", "/dev", "/run"].iter().find(|d| std::path::Path::new(d).is_dir()).map(|d| CString::new(*d).expect("no NUL"))
}

impl Stub {
    /// The guest-virtual range `[start, end)` this platform keeps for itself in every stub: the blob's
    /// code (read and execute), the shared page and the blob's stacks. The VMM must never map guest
    /// memory there and must refuse guest requests that would change it.
    pub const fn reserved_range() -> (u64, u64) {
        (layout::STUB_BASE, layout::STUB_END)
    }

    /// Create a confined stub with an empty address space (nothing mapped outside
    /// [`Stub::reserved_range`]) and no guest context yet: map code and a stack, then [`Stub::run`]
    /// with the entry registers (the FPU/SSE state starts as the host's defaults). The stub is a
    /// child of the calling process and gets SIGKILL when the calling thread exits.
    pub fn spawn(conf: &Confinement) -> Result<Stub> {
        prepare()?;
        let page = SharedPage::new().map_err(|source| Error::Spawn { step: "shared page", source })?;
        // SAFETY: the page is ours and nobody else maps it yet.
        unsafe {
            (*page.page()).stub_spin = Handoff::default().stub_spin;
            (*page.page()).stub_yields = Handoff::default().yields;
            (*page.page()).flags = if has_fsgsbase() { shared::FLAG_FSGSBASE } else { 0 };
            (*page.page()).state.store(shared::STUB_TURN, Ordering::SeqCst);
            (*page.page()).kick_pending = 0; // a forked stub starts with no kick
        }
        let (sock, stub_sock) = socketpair().map_err(|source| Error::Spawn { step: "socketpair", source })?;
        let filter = filter::program();
        let pivot = pivot_dir();
        // SAFETY: geteuid has no preconditions.
        let root = unsafe { libc::geteuid() } == 0;
        let args = confine::ChildArgs {
            // SAFETY: getpid has no preconditions.
            parent: unsafe { libc::getpid() },
            sock: stub_sock.as_raw_fd(),
            memfd: page.memfd().as_raw_fd(),
            page: page.page(),
            conf: conf.clone(),
            filter: &filter,
            blob: blob::code(),
            pivot_dir: pivot.as_deref(),
            root,
        };
        const STACK: usize = 256 << 10;
        // SAFETY: a new private anonymous mapping for the child's stack; unmapped below.
        let stack = unsafe {
            libc::mmap(std::ptr::null_mut(), STACK, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0)
        };
        if stack == libc::MAP_FAILED {
            return Err(Error::Spawn { step: "child stack", source: io::Error::last_os_error() });
        }
        let top = stack as usize + STACK;
        // The child inherits this thread's rdtsc mode; it sets the one `conf` asks for itself.
        tsc::release();
        // SAFETY: without CLONE_VM the child runs `child_main` on its own copy of `stack` and of
        // `args`; the parent's copies stay valid until clone returns (and `args` beyond).
        let pid = unsafe {
            libc::clone(confine::child_main, (top & !15) as *mut libc::c_void, libc::SIGCHLD, (&raw const args) as *mut libc::c_void)
        };
        let clone_err = io::Error::last_os_error();
        // SAFETY: the parent's copy of the child stack is no longer used.
        unsafe { libc::munmap(stack, STACK) };
        if pid < 0 {
            return Err(Error::Spawn { step: "clone", source: clone_err });
        }
        drop(stub_sock);
        let pidfd = match pidfd_open(pid) {
            Ok(fd) => fd,
            Err(source) => {
                // SAFETY: `pid` is our child; kill and reap it.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                return Err(Error::Spawn { step: "pidfd_open", source });
            }
        };
        // From here the child is owned by a Stub (Drop kills and reaps it).
        let mem = match memory::open_mem(pid) {
            Ok(m) => m,
            Err(source) => {
                // SAFETY: as above.
                unsafe {
                    libc::kill(pid, libc::SIGKILL);
                    libc::waitpid(pid, std::ptr::null_mut(), 0);
                }
                return Err(Error::Spawn { step: "open /proc/<pid>/mem", source });
            }
        };
        let mut stub = Stub {
            pid,
            pidfd,
            sock,
            mem,
            page,
            child: true,
            parked: false,
            has_guest: false,
            report: ConfinementReport::default(),
            traps: Traps { rdtsc: conf.trap_rdtsc, cpuid: false },
            handoff: Handoff::default(),
            spin: shared::SpinState::default(),
            clock_page: false,
            now: None,
            exited: None,
            commands: 0,
            patch: patch::Patcher::default(),
            place: placement::Placement::default(),
            chosen: Handoff::default(),
        };
        // The child has waited for this byte before changing its credentials, so the mem file above
        // was opened with the VMM's own.
        // SAFETY: writing one byte from a local to our socket.
        if unsafe { libc::write(stub.sock.as_raw_fd(), [1u8].as_ptr().cast(), 1) } != 1 {
            return Err(Error::Spawn { step: "start the stub", source: io::Error::last_os_error() });
        }
        // A new stub reports within milliseconds; one that has not reported after BOOT_TIMEOUT is
        // stuck before its first trap (as glibc's set*id wrappers once made it, waiting for VMM
        // threads the clone does not have): fail the spawn rather than wait for ever.
        let deadline = std::time::Instant::now() + BOOT_TIMEOUT;
        let page = &stub.page as *const SharedPage;
        let policy = stub.handoff.clone();
        let mut spin = shared::SpinState::default();
        // SAFETY: `page` is a field of `stub` that `alive` does not touch (as in `Stub::wait`).
        let booted = unsafe { (*page).wait_for_stub(&policy, &mut spin, || stub.alive() && std::time::Instant::now() < deadline) };
        if !booted && stub.exited.is_none() {
            return Err(Error::Spawn {
                step: "the stub's boot",
                source: io::Error::new(io::ErrorKind::TimedOut, format!("no report from the new stub within {} s", BOOT_TIMEOUT.as_secs())),
            });
        }
        if !booted {
            // SAFETY: the child wrote these before it exited (or left them zero).
            let (step, errno) = unsafe { ((*stub.page.page()).boot_step, (*stub.page.page()).boot_errno) };
            let name = confine::STEPS.get(step as usize).copied().unwrap_or("unknown");
            let source = if errno != 0 { io::Error::from_raw_os_error(errno) } else { io::Error::other(format!("exit status {:?}", stub.exited)) };
            return Err(Error::Spawn { step: if step == 0 { "the stub's boot" } else { name }, source });
        }
        // SAFETY: it is the VMM's turn; the page is mapped.
        let (exit, bits) = unsafe { ((*stub.page.page()).exit, (*stub.page.page()).report) };
        if exit != shared::EXIT_BOOT {
            return Err(Error::Spawn { step: "the stub's boot", source: io::Error::other(format!("unexpected first report {exit}")) });
        }
        stub.report = ConfinementReport::from_bits(bits);
        stub.traps.cpuid = bits & confine::REPORT_CPUID_TRAPPED != 0;
        stub.parked = true;
        Ok(stub)
    }

    /// How many commands this handle has handed the stub (each a round trip to it besides
    /// `run`: a map, a fork, a batch...), to count what a step costs (tests, docs/systrap.md).
    pub fn commands(&self) -> u64 {
        self.commands
    }

    /// The host pid of the stub process.
    pub fn pid(&self) -> i32 {
        self.pid
    }

    /// A pidfd of the stub process (for [`reaper::register`]; never a recycled pid).
    pub fn pidfd(&self) -> BorrowedFd<'_> {
        self.pidfd.as_fd()
    }

    /// What confinement the host granted this stub (namespaces, CPUID faulting).
    pub fn report(&self) -> &ConfinementReport {
        &self.report
    }

    /// Whether `rdtsc` and `cpuid` trap in this stub now.
    pub fn traps(&self) -> Traps {
        self.traps
    }

    /// Make `rdtsc` and `cpuid` trap or run natively from the guest's next instruction on (each
    /// change is one command to the parked stub; nothing when the state is already `want`).
    /// `cpuid` can trap only where [`ConfinementReport::cpuid_faulting`]; returns the state now in
    /// force. Guest processes forked from this stub later inherit it.
    pub fn set_traps(&mut self, want: Traps) -> Result<Traps> {
        if want.rdtsc != self.traps.rdtsc {
            let mode = if want.rdtsc { libc::PR_TSC_SIGSEGV } else { libc::PR_TSC_ENABLE };
            self.syscall("prctl(PR_SET_TSC)", libc::SYS_prctl, [libc::PR_SET_TSC as u64, mode as u64, 0, 0, 0, 0])?;
            self.traps.rdtsc = want.rdtsc;
        }
        let cpuid = want.cpuid && self.report.cpuid_faulting;
        if cpuid != self.traps.cpuid {
            self.syscall("arch_prctl(ARCH_SET_CPUID)", libc::SYS_arch_prctl, [filter::ARCH_SET_CPUID as u64, (!cpuid) as u64, 0, 0, 0, 0])?;
            self.traps.cpuid = cpuid;
        }
        Ok(self.traps)
    }

    /// Answer the guest's trapped `rdtsc` in the stub from the virtual clock in the guest page at
    /// `va` (the vDSO's data page, `guestos::vdso::clock_page`), or send each to the VMM (None).
    /// See the blob's `answer_rdtsc`. Takes effect at the guest's next `rdtsc`.
    pub fn set_clock_page(&mut self, va: Option<u64>) {
        // SAFETY: the stub reads this word only in its handler, while this thread waits for it;
        // an aligned u64.
        unsafe { std::ptr::write_volatile(&raw mut (*self.page.page()).clock_page, va.unwrap_or(0)) };
        self.clock_page = va.is_some();
    }

    /// The time of the next [`Stub::run`], read by the caller (a run loop that reads the clock
    /// after every exit anyway): placement then reads no clock of its own. None forgets it (a
    /// loop that starts, so that a time left from an earlier one is not taken for now).
    pub fn set_now(&mut self, now: Option<std::time::Instant>) {
        self.now = now;
    }

    /// The clock page's words as the guest left them at the exit [`Stub::run`] just returned,
    /// copied by the stub (the page [`Stub::set_clock_page`] named for that run); None without one.
    pub fn clock_words(&self) -> Option<[u64; crate::guestos::vdso::WORDS]> {
        if !self.clock_page || !self.parked || self.exited.is_some() {
            return None;
        }
        // SAFETY: the VMM's turn (parked): the stub wrote the words before it handed over.
        Some(unsafe { std::ptr::read_volatile(&raw const (*self.page.page()).clock_copy) })
    }

    /// Tuning: how the VMM and the stub wait for each other's answer ([`Handoff`]). See
    /// benches/systrap.rs.
    pub fn set_handoff(&mut self, h: Handoff) {
        // SAFETY: the stub reads these words only while it waits; a torn read is impossible
        // (aligned u32s), and a stale one only changes how long it spins once.
        unsafe {
            std::ptr::write_volatile(&raw mut (*self.page.page()).stub_spin, h.stub_spin);
            std::ptr::write_volatile(&raw mut (*self.page.page()).stub_yields, h.yields);
        }
        self.chosen = h.clone();
        self.handoff = h;
        self.spin = shared::SpinState::default();
        if matches!(self.place.mode(), placement::Mode::Pinned { .. }) {
            self.apply_placement(placement::Change::Pinned);
        }
    }

    /// Keep this stub and its serving thread on one CPU while that pays, or not
    /// ([`placement`]; on by default unless `COLLIMATE_SYSTRAP_PLACEMENT=0`). Off gives both
    /// back every CPU the process may use.
    pub fn set_placement(&mut self, on: bool) {
        if let Some(c) = self.place.set_enabled(self.pid, on) {
            self.apply_placement(c);
        }
    }

    /// Leave this stub and its serving thread to the scheduler for a first window before they
    /// are pinned ([`placement::Placement::start_unpinned`]): the children of a fork group,
    /// which run at once, are spread by the scheduler instead of all pinned on their parent's CPU.
    pub fn start_unpinned(&mut self) {
        self.place.start_unpinned();
    }

    /// The placement's state and counts (tests, benches).
    pub fn placement(&self) -> &placement::Placement {
        &self.place
    }

    /// Take the hand-off a placement change calls for: yield-then-sleep on a shared CPU (a spin
    /// there only delays the other side), else the chosen one, with fresh spin records.
    fn apply_placement(&mut self, change: placement::Change) {
        let h = match change {
            placement::Change::Pinned => Handoff::yield_then_sleep(),
            placement::Change::Unpinned => self.chosen.clone(),
        };
        // SAFETY: as in `set_handoff`.
        unsafe {
            std::ptr::write_volatile(&raw mut (*self.page.page()).stub_spin, h.stub_spin);
            std::ptr::write_volatile(&raw mut (*self.page.page()).stub_yields, h.yields);
        }
        self.handoff = h;
        self.spin = shared::SpinState::default();
    }

    /// The current [`Handoff`].
    pub fn handoff(&self) -> &Handoff {
        &self.handoff
    }

    fn alive(&mut self) -> bool {
        if self.exited.is_some() {
            return false;
        }
        let mut pfd = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: one valid pollfd, no timeout.
        let n = unsafe { libc::poll(&mut pfd, 1, 0) };
        if n == 0 {
            return true;
        }
        let mut status = None;
        if self.child {
            let mut st = 0;
            // SAFETY: `pid` is our exited child; reap it.
            if unsafe { libc::waitpid(self.pid, &mut st, libc::WNOHANG) } == self.pid {
                status = Some(st);
            }
        }
        self.exited = Some(status);
        false
    }

    /// Wait for the stub's report; false if it died.
    fn wait(&mut self) -> bool {
        let policy = self.handoff.clone();
        let page = &self.page as *const SharedPage;
        // SAFETY: `page` is a field of `self` that `alive` does not touch; the raw pointer only
        // splits the borrow.
        let spin = &mut self.spin as *mut shared::SpinState;
        // SAFETY: as for `page`: `alive` does not touch `spin` either.
        unsafe { (*page).wait_for_stub(&policy, &mut *spin, || self.alive()) }
    }

    /// Hand a command to the parked stub and wait for its `EXIT_DONE`; the command's result.
    fn command(&mut self, cmd: u64, args: [u64; 7]) -> Result<i64> {
        self.command_send(cmd, args)?;
        self.command_wait()
    }

    /// The first half of [`Stub::command`]: hand it over and return while the stub works (the
    /// stub is not parked until [`Stub::command_wait`]; every other command is refused meanwhile).
    fn command_send(&mut self, cmd: u64, args: [u64; 7]) -> Result<()> {
        if !self.parked {
            return Err(Error::NotParked { what: "take a command" });
        }
        crate::trace::stub_command(if cmd == shared::CMD_SYSCALL { args[0] } else { 1000 + cmd });
        self.commands += 1;
        let p = self.page.page();
        // SAFETY: the VMM's turn: the stub does not read these until `hand_to_stub`.
        unsafe {
            (*p).cmd = cmd;
            (*p).args = args;
        }
        self.parked = false;
        self.match_tsc();
        self.page.hand_to_stub(&self.handoff, &mut self.spin);
        Ok(())
    }

    /// The second half of [`Stub::command`]: wait for the command [`Stub::command_send`] handed
    /// over; its result.
    fn command_wait(&mut self) -> Result<i64> {
        if !self.wait() {
            return Err(Error::Gone { pid: self.pid });
        }
        self.parked = true;
        // SAFETY: the VMM's turn again.
        Ok(unsafe { std::ptr::read_volatile(&raw const (*self.page.page()).ret) })
    }

    /// Give this (the serving) thread the stub's `rdtsc` mode before a hand-off, so a context
    /// switch between the two writes no CR4 ([`tsc`]); but not for a wait that spins: while the
    /// adaptive spin is answered there is no switch to save, and with both sides trapping the
    /// spins were not answered (two CPUs, benches/systrap.rs: 50 of 51 missed, a 45 us round trip
    /// against 3.1 us), for a reason not found yet.
    fn match_tsc(&self) {
        tsc::match_stub(self.traps.rdtsc && !self.spin.vmm_spins(&self.handoff));
    }

    fn syscall(&mut self, op: &'static str, nr: i64, a: [u64; 6]) -> Result<u64> {
        let r = self.command(shared::CMD_SYSCALL, [nr as u64, a[0], a[1], a[2], a[3], a[4], a[5]])?;
        if (-4095..0).contains(&r) {
            return Err(Error::Op { op, source: io::Error::from_raw_os_error(-r as i32) });
        }
        Ok(r as u64)
    }

    /// Run guest code from `regs` and `fs_base` until the next exit; on return both hold the guest's
    /// state at that exit. Only the general-purpose registers, `rip` and `rflags` (the bits user mode
    /// may change) are taken from `regs`; segment registers stay the host's user segments.
    pub fn run(&mut self, regs: &mut kvm_regs, fs_base: &mut u64) -> Result<Exit> {
        if let Some(status) = self.exited {
            return Ok(Exit::Exited { status });
        }
        if !self.parked {
            return Err(Error::NotParked { what: "run" });
        }
        let p = self.page.page();
        use shared::reg::*;
        let mut g = [0u64; 18];
        g[R8] = regs.r8;
        g[R9] = regs.r9;
        g[R10] = regs.r10;
        g[R11] = regs.r11;
        g[R12] = regs.r12;
        g[R13] = regs.r13;
        g[R14] = regs.r14;
        g[R15] = regs.r15;
        g[RDI] = regs.rdi;
        g[RSI] = regs.rsi;
        g[RBP] = regs.rbp;
        g[RBX] = regs.rbx;
        g[RDX] = regs.rdx;
        g[RAX] = regs.rax;
        g[RCX] = regs.rcx;
        g[RSP] = regs.rsp;
        g[RIP] = regs.rip;
        g[EFL] = regs.rflags;
        // SAFETY: the VMM's turn; the stub copies these into the frame after `hand_to_stub`.
        unsafe {
            std::ptr::copy_nonoverlapping(g.as_ptr(), (&raw mut (*p).gregs).cast::<u64>(), 18);
            (*p).fs_base = *fs_base;
            (*p).cmd = shared::CMD_RUN;
        }
        self.parked = false;
        self.has_guest = true;
        if self.place.enabled {
            self.place.answered += self.spin.take_vmm_answered();
            let now = self.now.take().unwrap_or_else(tsc::now);
            if let Some(change) = self.place.check_at(self.pid, now) {
                self.apply_placement(change);
            }
        }
        self.match_tsc();
        self.page.hand_to_stub(&self.handoff, &mut self.spin);
        if !self.wait() {
            return Ok(Exit::Exited { status: self.exited.flatten() });
        }
        self.parked = true;
        // SAFETY: the VMM's turn; every value is guest-controlled data, read by volatile copies.
        let (gr, fsb, signo, code, addr, sysnr, exit) = unsafe {
            (
                std::ptr::read_volatile(&raw const (*p).gregs),
                std::ptr::read_volatile(&raw const (*p).fs_base),
                std::ptr::read_volatile(&raw const (*p).signo) as i32,
                std::ptr::read_volatile(&raw const (*p).code),
                std::ptr::read_volatile(&raw const (*p).addr),
                std::ptr::read_volatile(&raw const (*p).sysnr),
                std::ptr::read_volatile(&raw const (*p).exit),
            )
        };
        *regs = kvm_regs {
            rax: gr[RAX],
            rbx: gr[RBX],
            rcx: gr[RCX],
            rdx: gr[RDX],
            rsi: gr[RSI],
            rdi: gr[RDI],
            rsp: gr[RSP],
            rbp: gr[RBP],
            r8: gr[R8],
            r9: gr[R9],
            r10: gr[R10],
            r11: gr[R11],
            r12: gr[R12],
            r13: gr[R13],
            r14: gr[R14],
            r15: gr[R15],
            rip: gr[RIP],
            rflags: gr[EFL],
        };
        *fs_base = fsb;
        if exit != shared::EXIT_EVENT {
            // Only guest code (writing the shared page) can make this happen.
            return Ok(Exit::Signal { signo: 0, code: exit as i32, addr: 0 });
        }
        let exit = self.classify(regs, signo, code, addr, sysnr, &gr);
        // SAFETY: the VMM's turn. The trap came through a patched site if its XSAVE area is there.
        let patched_entry = unsafe { std::ptr::read_volatile(&raw const (*p).fpstate) } == layout::XSAVE_BUF;
        match exit {
            // Stopped inside a trampoline: at the site's `syscall`, as far as the guest goes.
            Exit::Interrupted => {
                if let Some((rip, rax)) = patch::rewind(&self.mem, regs.rip) {
                    regs.rip = rip;
                    regs.rax = rax;
                }
            }
            Exit::Syscall if !patched_entry && self.patch.wants(regs.rip) => {
                self.try_patch(regs.rip, regs.rax);
            }
            _ => {}
        }
        Ok(exit)
    }

    /// Patch the site of the syscall `nr` that trapped and returns to `ret`, if it qualifies
    /// ([`patch`]); a site that does not is not looked at again.
    fn try_patch(&mut self, ret: u64, nr: u64) {
        let Some((want, tramp, jmp)) = patch::plan(&self.patch, ret, nr) else {
            return self.patch.reject(ret);
        };
        let site = ret - 7;
        let mut have = [0u8; 7];
        if !memory::read(&self.mem, site, &mut have) || have != want || !patch::private_code(self.pid, site, 7) {
            return self.patch.reject(ret);
        }
        if self.prepare_trampolines().is_err() {
            self.patch.enabled = false;
            return;
        }
        // The trampoline first, then the jump to it (the stub is parked: nothing runs the bytes).
        let t = patch::trampoline(tramp, nr as u32, ret);
        if !memory::write(&self.mem, tramp, &t) || !memory::write(&self.mem, site, &jmp) {
            return self.patch.reject(ret);
        }
        patch::advance(&mut self.patch, nr as u32, ret);
    }

    /// Map the trampolines and the XSAVE buffer of patched entries, the buffer's software bytes
    /// (the kernel's format marks, what `rt_sigreturn` checks) copied from this exit's frame.
    fn prepare_patching(&mut self) -> Result<()> {
        let (at, len) = self.frame_fpstate()?;
        if len <= 512 {
            return Err(Error::Op { op: "patch", source: io::Error::other("no XSAVE frame") });
        }
        let mut sw = [0u8; 48];
        self.read(at + 464, &mut sw)?;
        let mut magic2 = [0u8; 4];
        self.read(at + len as u64, &mut magic2)?;
        if len as u64 + 4 > layout::XSAVE_BUF_LEN {
            return Err(Error::Op { op: "patch", source: io::Error::other("XSAVE area too large") });
        }
        let anon = (libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_FIXED) as u64;
        let rw = (libc::PROT_READ | libc::PROT_WRITE) as u64;
        let rx = (libc::PROT_READ | libc::PROT_EXEC) as u64;
        self.syscall("mmap", libc::SYS_mmap, [layout::XSAVE_BUF, layout::XSAVE_BUF_LEN, rw, anon, u64::MAX, 0])?;
        self.syscall("mmap", libc::SYS_mmap, [layout::TRAMP, layout::TRAMP_LEN, rx, anon, u64::MAX, 0])?;
        if !memory::write(&self.mem, layout::XSAVE_BUF + 464, &sw) || !memory::write(&self.mem, layout::XSAVE_BUF + len as u64, &magic2) {
            return Err(Error::Fault { addr: layout::XSAVE_BUF, len });
        }
        let mask = u64::from_le_bytes(sw[8..16].try_into().expect("8 bytes"));
        // SAFETY: the VMM's turn.
        unsafe { (*self.page.page()).xsave_mask = mask };
        Ok(())
    }

    /// Turn syscall-site patching on or off for this stub from now on (on unless
    /// `COLLIMATE_SYSTRAP_PATCH=0`); sites patched already stay patched.
    pub fn set_patching(&mut self, on: bool) {
        self.patch.enabled = on;
    }

    /// How many syscall sites are patched in this stub's address space ([`patch`]).
    pub fn patched_sites(&self) -> u64 {
        self.patch.sites()
    }

    /// How many syscalls entered the blob through a patched site, in this stub (and, for a fork,
    /// in the stub it was forked from before the fork).
    pub fn patched_entries(&self) -> u64 {
        // SAFETY: a counter the blob only increments; a torn read cannot happen on x86-64.
        unsafe { std::ptr::read_volatile(&raw const (*self.page.page()).patched_entries) }
    }

    /// The patching state to save with a snapshot of the guest's memory as it is now, patched
    /// ([`patch::Saved`]; [`Stub::restore_patches`] puts it back).
    pub fn saved_patches(&self) -> patch::Saved {
        self.patch.save()
    }

    /// Patch now every site that trapped once and was not looked at yet (in the order of their
    /// addresses, so the same run gives the same slots), as its next trap would: for a snapshot,
    /// whose every restore and recycled sandbox would otherwise patch each of them again at its
    /// first trap there (the python agent's reply `write`, once an exec) and drop it at its
    /// reset. Returns how many were patched.
    pub fn patch_seen(&mut self) -> u64 {
        let before = self.patch.sites();
        for ret in self.patch.seen_sites() {
            let mut have = [0u8; 7];
            if self.read(ret.wrapping_sub(7), &mut have).is_err() || have[0] != 0xb8 || have[5..] != [0x0f, 0x05] {
                self.patch.reject(ret);
                continue;
            }
            let nr = u32::from_le_bytes(have[1..5].try_into().expect("4 bytes"));
            if self.patch.wants_now(ret) {
                self.try_patch(ret, nr as u64);
            }
        }
        self.patch.sites() - before
    }

    /// A stub that has run no guest yet, holding a snapshot's memory (its sites as they were
    /// patched): write the snapshot's trampolines into the reserved range and take its patching
    /// state, so the guest runs patched from its first syscall. With patching off in this stub
    /// ([`Stub::set_patching`], `COLLIMATE_SYSTRAP_PATCH=0`) each site gets its `mov` back
    /// instead (no guest code runs through a trampoline), and stays unpatched. Either way the
    /// state is what [`Stub::reset_patches`] returns to, in this stub and its forks. Returns the
    /// sites patched now.
    pub fn restore_patches(&mut self, saved: patch::Saved) -> Result<u64> {
        if saved.sites.len() as u64 >= patch::SLOTS {
            return Err(Error::Op { op: "restore patches", source: io::Error::other(format!("{} sites, room for {}", saved.sites.len(), patch::SLOTS - 1)) });
        }
        let patched = self.patch.enabled && !saved.sites.is_empty() && self.prepare_trampolines().is_ok();
        let origin = patch::Origin { saved: std::sync::Arc::new(saved), patched };
        self.back_to(&origin)?;
        self.patch.set_origin(origin);
        Ok(self.patch.sites())
    }

    /// A reset dropped the guest's pages back to the snapshot's (the sites this stub patched
    /// since hold their `mov` again, the snapshot's hold their jump): the patching state goes
    /// back to the snapshot's too ([`Stub::restore_patches`]), the snapshot's trampolines
    /// written again and the slots after them free. A stub restored from nothing starts over.
    pub fn reset_patches(&mut self) -> Result<()> {
        match self.patch.origin().cloned() {
            Some(o) => self.back_to(&o),
            None => {
                self.patch.forget();
                Ok(())
            }
        }
    }

    /// The trampolines mapped (once per stub; its forks inherit them).
    fn prepare_trampolines(&mut self) -> Result<()> {
        if !patch::is_ready(&self.patch) {
            self.prepare_patching()?;
            patch::set_ready(&mut self.patch);
        }
        Ok(())
    }

    /// The patching state of `o`: its trampolines written, or its sites' `mov`s put back.
    fn back_to(&mut self, o: &patch::Origin) -> Result<()> {
        let sites = &o.saved.sites;
        if o.patched {
            let t = patch::trampolines(sites);
            if !memory::write(&self.mem, layout::TRAMP + patch::SLOT, &t) {
                return Err(Error::Fault { addr: layout::TRAMP + patch::SLOT, len: t.len() });
            }
        } else {
            for (i, &(nr, ret)) in sites.iter().enumerate() {
                let (site, tramp) = (ret.wrapping_sub(7), layout::TRAMP + (i as u64 + 1) * patch::SLOT);
                let (jmp, orig) = patch::site_bytes(site, tramp, nr);
                let mut have = [0u8; 5];
                if self.read(site, &mut have).is_ok() && have == jmp && !memory::write(&self.mem, site, &orig) {
                    return Err(Error::Fault { addr: site, len: 5 });
                }
            }
        }
        self.patch.load(&o.saved, o.patched);
        Ok(())
    }

    /// Put every patched site's original `mov eax, N` back (where the site still holds this
    /// stub's jump): for a snapshot taken unpatched (`COLLIMATE_SYSTRAP_PATCH_SNAPSHOT=0`, what
    /// snapshots were before they kept the sites). This stub does not patch those sites again
    /// (their traps go through SIGSYS). Returns how many were restored.
    pub fn unpatch_all(&mut self) -> Result<u64> {
        let mut n = 0;
        for slot in patch::slots(&self.patch) {
            let tramp = layout::TRAMP + slot * patch::SLOT;
            let mut t = [0u8; 20];
            self.read(tramp, &mut t)?;
            let Some((nr, ret)) = patch::parse(&t) else { continue };
            let site = ret - 7;
            let mut have = [0u8; 5];
            if self.read(site, &mut have).is_err() {
                continue;
            }
            let (jmp, orig) = patch::site_bytes(site, tramp, nr);
            if have != jmp {
                continue;
            }
            if !memory::write(&self.mem, site, &orig) {
                return Err(Error::Fault { addr: site, len: 5 });
            }
            self.patch.reject(ret);
            n += 1;
        }
        Ok(n)
    }

    fn classify(&self, regs: &mut kvm_regs, signo: i32, code: i32, addr: u64, sysnr: u64, gregs: &[u64; 23]) -> Exit {
        let (err, trapno) = (gregs[shared::reg::ERR], gregs[shared::reg::TRAPNO]);
        const SYS_SECCOMP: i32 = 1;
        const SI_KERNEL: i32 = 0x80;
        const AUDIT_ARCH_X86_64: u64 = 0xc000_003e;
        const PF: u64 = 14;
        match signo {
            // An x86-64 syscall; another architecture's (i386 `int 0x80`) is what kvm makes of
            // it, a general protection fault at the instruction (2 bytes back), with the
            // registers as they were.
            libc::SIGSYS if code == SYS_SECCOMP && sysnr >> 32 == AUDIT_ARCH_X86_64 => {
                regs.rax = sysnr & 0xffff_ffff;
                Exit::Syscall
            }
            libc::SIGSYS if code == SYS_SECCOMP => {
                regs.rax = sysnr & 0xffff_ffff;
                regs.rip = regs.rip.wrapping_sub(2);
                Exit::Signal { signo: libc::SIGSEGV, code: SI_KERNEL, addr: 0 }
            }
            preempt::KICK_SIGNAL if code == preempt::SI_USER => Exit::Interrupted,
            libc::SIGSEGV if trapno == PF && code != SI_KERNEL => Exit::Fault { addr, write: err & 2 != 0, exec: err & 16 != 0 },
            libc::SIGSEGV if code == SI_KERNEL => {
                let mut insn = [0u8; 2];
                let _ = self.read(regs.rip, &mut insn);
                let mut third = [0u8; 1];
                match insn {
                    [0x0f, 0x31] => Exit::Rdtsc { rdtscp: false },
                    [0x0f, 0xa2] if self.traps.cpuid => Exit::Cpuid,
                    [0x0f, 0x01] if self.read(regs.rip + 2, &mut third).is_ok() && third[0] == 0xf9 => Exit::Rdtsc { rdtscp: true },
                    _ => Exit::Signal { signo, code, addr },
                }
            }
            _ => Exit::Signal { signo, code, addr },
        }
    }

    /// Read guest memory at virtual address `va` into `buf`. Safe while the address space changes:
    /// an unmapped or unreadable byte gives [`Error::Fault`], never a crash.
    pub fn read(&self, va: u64, buf: &mut [u8]) -> Result<()> {
        if memory::read(&self.mem, va, buf) {
            Ok(())
        } else {
            Err(Error::Fault { addr: va, len: buf.len() })
        }
    }

    /// Write `data` to guest memory at `va`, as a debugger does: also into read-only private pages
    /// (copy-on-write; e.g. relocations in text). Unmapped bytes give [`Error::Fault`]; a write that
    /// faults part-way may have written a prefix. Refused in the reserved range.
    pub fn write(&self, va: u64, data: &[u8]) -> Result<()> {
        if layout::touches_reserved(va, data.len() as u64) {
            return Err(Error::Reserved { addr: va, len: data.len() as u64 });
        }
        if memory::write(&self.mem, va, data) {
            Ok(())
        } else {
            Err(Error::Fault { addr: va, len: data.len() })
        }
    }

    /// `mmap(va, len, prot, flags | MAP_FIXED, fd, offset)` executed by the stub in the guest's
    /// address space: replaces whatever was mapped at `[va, va+len)`. `flags` are Linux `MAP_*` flags
    /// (`MAP_PRIVATE` or `MAP_SHARED`, `MAP_ANONYMOUS` when `fd` is `None`, `MAP_NORESERVE`...). The
    /// fd is passed to the stub with SCM_RIGHTS and closed there after the mmap. The stub must be
    /// parked (spawned, or after an exit of `run`).
    pub fn map(&mut self, va: u64, len: u64, prot: i32, flags: i32, fd: Option<BorrowedFd<'_>>, offset: u64) -> Result<()> {
        if layout::touches_reserved(va, len) {
            return Err(Error::Reserved { addr: va, len });
        }
        let flags = (flags | libc::MAP_FIXED) as u64;
        let Some(fd) = fd else {
            let r = self.syscall("mmap", libc::SYS_mmap, [va, len, prot as u64, flags | libc::MAP_ANONYMOUS as u64, u64::MAX, offset])?;
            return if r == va { Ok(()) } else { Err(Error::Op { op: "mmap", source: io::Error::other("mapped elsewhere") }) };
        };
        send_fds(self.sock.as_fd(), &[fd.as_raw_fd()]).map_err(host("sendmsg"))?;
        let remote = self.receive_fds(1)?[0];
        let r = self.syscall("mmap", libc::SYS_mmap, [va, len, prot as u64, flags, remote as u64, offset]);
        let c = self.syscall("close", libc::SYS_close, [remote as u64, 0, 0, 0, 0, 0]);
        let r = r?;
        c?;
        if r == va {
            Ok(())
        } else {
            Err(Error::Op { op: "mmap", source: io::Error::other("mapped elsewhere") })
        }
    }

    /// Pass `n` fds (already sent on the socket by the caller) into the stub: its `recvmsg` into the
    /// scratch area of the shared page; returns their numbers in the stub.
    fn receive_fds(&mut self, n: usize) -> Result<[i32; 2]> {
        assert!((1..=2).contains(&n));
        let msg_addr = self.recv_header();
        self.syscall("recvmsg", libc::SYS_recvmsg, [layout::SOCK_FD as u64, msg_addr, 0, 0, 0, 0])?;
        self.received_fds()
    }

    /// Lay out a `recvmsg` header for up to two fds in the scratch area; its address in the stub.
    fn recv_header(&mut self) -> u64 {
        let base = self.page.bytes();
        let off = shared::SCRATCH;
        let stub_addr = |o: usize| layout::SHARED + o as u64;
        // Layout in the scratch area: msghdr at +0, iovec at +64, one data byte at +80, control
        // buffer at +96 (room for two fds).
        // SAFETY: CMSG_SPACE only computes a size.
        let space = unsafe { libc::CMSG_SPACE(8) } as usize;
        // SAFETY: the VMM's turn; the scratch area lies inside the mapped page.
        unsafe {
            let msg = base.add(off).cast::<libc::msghdr>();
            std::ptr::write_bytes(base.add(off), 0, 128);
            (*msg).msg_iov = stub_addr(off + 64) as *mut libc::iovec;
            (*msg).msg_iovlen = 1;
            (*msg).msg_control = stub_addr(off + 96) as *mut libc::c_void;
            (*msg).msg_controllen = space;
            let iov = base.add(off + 64).cast::<libc::iovec>();
            (*iov).iov_base = stub_addr(off + 80) as *mut libc::c_void;
            (*iov).iov_len = 1;
        }
        stub_addr(off)
    }

    /// The fds the stub's `recvmsg` into [`Stub::recv_header`]'s header received.
    fn received_fds(&self) -> Result<[i32; 2]> {
        let (base, off) = (self.page.bytes(), shared::SCRATCH);
        // SAFETY: the VMM's turn; reading the control buffer the stub's recvmsg filled (16-byte
        // cmsghdr, then the fds).
        let (level, ty, fds) = unsafe {
            let c = base.add(off + 96).cast::<libc::cmsghdr>();
            let data = base.add(off + 96 + 16).cast::<i32>();
            ((*c).cmsg_level, (*c).cmsg_type, [std::ptr::read_volatile(data), std::ptr::read_volatile(data.add(1))])
        };
        if level != libc::SOL_SOCKET || ty != libc::SCM_RIGHTS {
            return Err(Error::Op { op: "recvmsg", source: io::Error::other("no fds arrived") });
        }
        Ok(fds)
    }

    /// `munmap(va, len)` in the guest's address space.
    pub fn unmap(&mut self, va: u64, len: u64) -> Result<()> {
        if layout::touches_reserved(va, len) {
            return Err(Error::Reserved { addr: va, len });
        }
        self.syscall("munmap", libc::SYS_munmap, [va, len, 0, 0, 0, 0]).map(|_| ())
    }

    /// `mprotect(va, len, prot)` in the guest's address space.
    pub fn protect(&mut self, va: u64, len: u64, prot: i32) -> Result<()> {
        if layout::touches_reserved(va, len) {
            return Err(Error::Reserved { addr: va, len });
        }
        self.syscall("mprotect", libc::SYS_mprotect, [va, len, prot as u64, 0, 0, 0]).map(|_| ())
    }

    /// `madvise(va, len, advice)` in the guest's address space (e.g. `MADV_DONTFORK` around a
    /// [`Stub::fork`] whose child needs none of the guest's memory: a spawn).
    pub fn advise(&mut self, va: u64, len: u64, advice: i32) -> Result<()> {
        if layout::touches_reserved(va, len) {
            return Err(Error::Reserved { addr: va, len });
        }
        self.syscall("madvise", libc::SYS_madvise, [va, len, advice as u64, 0, 0, 0]).map(|_| ())
    }

    /// Fork the stub: the host copies the guest's whole address space copy-on-write (what is mapped
    /// `MAP_SHARED` stays shared), and the new stub is parked at the same guest exit as this one, so
    /// `run` on it continues the same guest context. The new stub gets its own shared page and socket.
    /// Its process is a child of this stub's process, not of the caller: it is not killed when the
    /// caller's thread exits but when its handle is dropped, or at its next trap after every copy of
    /// its socket is closed (a forked guest computing without syscalls outlives a killed VMM until
    /// then, unless the VMM registered it with its tree's [`reaper`], which kills it at once).
    pub fn fork(&mut self) -> Result<Stub> {
        let mut child = self.fork_unparked()?;
        child.await_parked()?;
        Ok(child)
    }

    /// [`Stub::fork`] without waiting for the new stub to park at its copy of the exit: the
    /// caller goes on (to fork the next one, say) while the new process is scheduled. Call
    /// [`Stub::await_parked`] on the new stub before anything else (another process may: the new
    /// handle survives a host fork of the VMM).
    pub fn fork_unparked(&mut self) -> Result<Stub> {
        let pending = self.fork_begin()?;
        self.fork_finish(pending)
    }

    /// [`Stub::fork_unparked`] in two halves: hand the stub its fork and return while it forks
    /// (this stub is busy until [`Stub::fork_finish`]; every other command is refused meanwhile),
    /// so the caller can do other work, such as a host fork of its own process for the previous
    /// stub's child, in parallel with it (`vmm::systrap`'s fork group). A host fork of the caller
    /// meanwhile leaves the [`PendingFork`] in both processes: the side that does not finish it
    /// drops its copy (its fds and mapping only).
    pub fn fork_begin(&mut self) -> Result<PendingFork> {
        let page = SharedPage::new().map_err(host("memfd for the fork's shared page"))?;
        // SAFETY: the VMM's turn on the old page; the new page is ours alone: it starts as a copy (the
        // parked exit's registers and XSAVE address stay valid in the child) with the stub's turn.
        unsafe {
            std::ptr::copy_nonoverlapping(self.page.bytes(), page.bytes(), shared::SCRATCH);
            (*page.page()).stub_sleeping.store(0, Ordering::SeqCst);
            (*page.page()).vmm_sleeping.store(0, Ordering::SeqCst);
            (*page.page()).state.store(shared::STUB_TURN, Ordering::SeqCst);
            (*page.page()).kick_pending = 0; // a forked stub starts with no kick
        }
        let (sock, stub_sock) = socketpair().map_err(host("socketpair"))?;
        send_fds(self.sock.as_fd(), &[page.memfd().as_raw_fd(), stub_sock.as_raw_fd()]).map_err(host("sendmsg"))?;
        drop(stub_sock);
        // The stub receives the two fds and forks in one command (`CMD_FORK` with a header).
        let msg = self.recv_header();
        // SAFETY: the VMM's turn; the fd slots lie in the mapped page. An fd that does not
        // arrive stays -1: the child cannot map its page and ends (checked below too).
        unsafe {
            let at = self.page.bytes().add(shared::BATCH_FDS).cast::<i32>();
            at.write_volatile(-1);
            at.add(1).write_volatile(-1);
        }
        self.command_send(shared::CMD_FORK, [0, 0, msg, 0, 0, 0, 0])?;
        Ok(PendingFork { page, sock })
    }

    /// Wait for the fork [`Stub::fork_begin`] handed this stub; the new stub, not parked yet
    /// (see [`Stub::fork_unparked`]).
    pub fn fork_finish(&mut self, pending: PendingFork) -> Result<Stub> {
        let PendingFork { page, sock } = pending;
        let pid = self.command_wait()?;
        if pid <= 0 {
            return Err(Error::Op { op: "fork", source: io::Error::from_raw_os_error(-pid as i32) });
        }
        self.received_fds()?;
        let pid = pid as i32;
        let pidfd = pidfd_open(pid).map_err(host("pidfd_open"))?;
        let mem = match memory::open_mem(pid) {
            Ok(m) => m,
            Err(e) => {
                // SAFETY: signalling the stub we just made through its pidfd.
                unsafe { libc::syscall(libc::SYS_pidfd_send_signal, pidfd.as_raw_fd(), libc::SIGKILL, 0usize, 0) };
                return Err(host("open /proc/<pid>/mem of a forked stub (needs CAP_SYS_PTRACE)")(e));
            }
        };
        let child = Stub {
            pid,
            pidfd,
            sock,
            mem,
            page,
            child: false,
            parked: false,
            has_guest: self.has_guest,
            report: self.report.clone(),
            traps: self.traps,
            handoff: self.handoff.clone(),
            spin: shared::SpinState::default(),
            clock_page: false,
            now: None,
            exited: None,
            commands: 0,
            patch: self.patch.clone(),
            place: self.place.for_fork(),
            chosen: self.chosen.clone(),
        };
        Ok(child)
    }

    /// Wait until a stub from [`Stub::fork_unparked`] has parked (at once if it has).
    pub fn await_parked(&mut self) -> Result<()> {
        if self.parked {
            return Ok(());
        }
        if !self.wait() {
            return Err(Error::Gone { pid: self.pid });
        }
        self.parked = true;
        Ok(())
    }

    /// Give up this handle without killing the process: for the side of a host fork of the VMM that
    /// does not own this stub (both sides inherit every `Stub`). Closes this side's fds and mapping.
    pub fn release(self) {
        let mut me = std::mem::ManuallyDrop::new(self);
        // SAFETY: each field is dropped exactly once here and `me` is never used again (the
        // ManuallyDrop keeps `Stub::drop`, which kills the process, from running).
        unsafe {
            std::ptr::drop_in_place(&raw mut me.pidfd);
            std::ptr::drop_in_place(&raw mut me.sock);
            std::ptr::drop_in_place(&raw mut me.mem);
            std::ptr::drop_in_place(&raw mut me.page);
            std::ptr::drop_in_place(&raw mut me.report);
        }
    }

    fn fpstate(&self) -> Result<(u64, usize)> {
        if !self.has_guest {
            return Err(Error::NotParked { what: "reach the XSAVE area" });
        }
        self.frame_fpstate()
    }

    /// The XSAVE area of the host signal frame the parked stub sits in: the guest's at an exit, the
    /// stub's own at its boot trap (where [`Stub::load_xsave`] puts a saved guest's).
    fn frame_fpstate(&self) -> Result<(u64, usize)> {
        if !self.parked {
            return Err(Error::NotParked { what: "reach the XSAVE area" });
        }
        // SAFETY: the VMM's turn.
        let at = unsafe { std::ptr::read_volatile(&raw const (*self.page.page()).fpstate) };
        // The software-reserved bytes of the FXSAVE area say whether an XSAVE header follows.
        let mut sw = [0u8; 24];
        self.read(at + 464, &mut sw)?;
        let magic1 = u32::from_le_bytes(sw[0..4].try_into().expect("4 bytes"));
        let xstate_size = u32::from_le_bytes(sw[16..20].try_into().expect("4 bytes")) as usize;
        let len = if magic1 == 0x4650_5853 && (512..=64 << 10).contains(&xstate_size) { xstate_size } else { 512 };
        Ok((at, len))
    }

    /// The guest's XSAVE area (x87, SSE, AVX... in the standard, non-compacted XSAVE layout, the same
    /// layout as `kvm_xsave`'s region) at the current exit, as the host saved it in the signal frame.
    /// Costs one read of guest-stub memory; nothing is copied on the trap path.
    pub fn xsave(&self) -> Result<Vec<u8>> {
        let (at, len) = self.fpstate()?;
        self.read_xsave(at, len)
    }

    /// The XSAVE area the next `run` restores: [`Stub::xsave`] after a guest exit, or what
    /// [`Stub::load_xsave`] put in a stub that has not run its guest yet.
    pub fn pending_xsave(&self) -> Result<Vec<u8>> {
        let (at, len) = self.frame_fpstate()?;
        self.read_xsave(at, len)
    }

    fn read_xsave(&self, at: u64, len: usize) -> Result<Vec<u8>> {
        let mut v = vec![0; len];
        memory::read(&self.mem, at, &mut v).then_some(v).ok_or(Error::Fault { addr: at, len })
    }

    /// Replace the XSAVE area that the next `run` restores. `area` must be as long as what
    /// [`Stub::xsave`] returns.
    pub fn set_xsave(&mut self, area: &[u8]) -> Result<()> {
        let (at, len) = self.fpstate()?;
        self.put_xsave(at, len, area)
    }

    /// As [`Stub::set_xsave`], also in a stub that has run no guest yet (parked at its boot trap):
    /// the first `run` then starts the guest with this FPU state (a restored snapshot's). `area`
    /// must be as long as this host's XSAVE frame (a snapshot taken on a host with another XSAVE
    /// size is refused here).
    pub fn load_xsave(&mut self, area: &[u8]) -> Result<()> {
        let (at, len) = self.frame_fpstate()?;
        self.put_xsave(at, len, area)
    }

    fn put_xsave(&mut self, at: u64, len: usize, area: &[u8]) -> Result<()> {
        if area.len() != len {
            return Err(Error::Op { op: "set_xsave", source: io::Error::other(format!("the area is {} bytes, the frame holds {len}", area.len())) });
        }
        // The frame is in the reserved range, so `write`'s check does not apply.
        memory::write(&self.mem, at, area).then_some(()).ok_or(Error::Fault { addr: at, len })?;
        if at == layout::XSAVE_BUF {
            // A patched entry's area: its return loads it (a signal frame's is loaded by rt_sigreturn).
            // SAFETY: the VMM's turn.
            unsafe { (*self.page.page()).xsave_dirty = 1 };
        }
        Ok(())
    }
}

/// A fork handed to a stub by [`Stub::fork_begin`] and not yet finished: the new stub's shared
/// page and socket.
pub struct PendingFork {
    page: SharedPage,
    sock: OwnedFd,
}

impl Drop for Stub {
    fn drop(&mut self) {
        if self.place.enabled && self.exited.is_none() {
            // Its exit frees its memory: not on the CPU its serving thread goes on with.
            placement::unbind(self.pid);
        }
        self.place.release();
        if self.exited.is_none() {
            // SAFETY: signalling our stub through its pidfd (never a recycled pid).
            unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.pidfd.as_raw_fd(), libc::SIGKILL, 0usize, 0) };
        }
        if self.child && !matches!(self.exited, Some(Some(_))) {
            // SAFETY: reaping our own child, which was just killed.
            unsafe { libc::waitpid(self.pid, std::ptr::null_mut(), 0) };
        }
    }
}
