//! The page shared by the VMM and one stub, and the hand-over of the turn between them.
//!
//! One page of a memfd, mapped `MAP_SHARED` by the VMM and at [`layout::SHARED`] in the stub. The
//! word `state` says whose turn it is: [`STUB_TURN`] while the stub works or the guest runs,
//! [`VMM_TURN`] once the stub has reported an exit or finished a command. Whoever hands the turn over
//! stores the new state with a full barrier (`xchg`) and then issues a futex wake only if the other
//! side said it sleeps (`*_sleeping`); whoever waits spins a bounded number of times, then sets its
//! `*_sleeping` flag (again with a full barrier), checks `state` once more and sleeps in
//! `FUTEX_WAIT`. The two barriers order "store state, load sleeping" against "store sleeping, load
//! state", so a wake is never lost and a spinning peer costs no syscall.
//!
//! The guest can write this page (it shares the stub's address space); the VMM reads from it only
//! values the guest controls anyway, and never trusts `state` to mean the stub is alive (it also
//! watches the stub's pidfd).

use crate::guestos::vdso;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU32, Ordering};

use super::layout;

/// The stub's turn: it runs the guest or a command.
pub const STUB_TURN: u32 = 1;
/// The VMM's turn: the stub is parked in its handler.
pub const VMM_TURN: u32 = 2;

/// What the stub reported when it handed the turn over (`Page::exit`).
pub const EXIT_EVENT: u32 = 1;
/// The stub reached its first trap after spawn: parked, no guest context yet.
pub const EXIT_BOOT: u32 = 2;
/// A command finished; its result is in `Page::ret`.
pub const EXIT_DONE: u32 = 3;

/// Resume the guest from `gregs` (the first 18: r8..r15, rdi, rsi, rbp, rbx, rdx, rax, rcx, rsp,
/// rip, eflags) and `fs_base`.
pub const CMD_RUN: u64 = 1;
/// Execute syscall `args[0]` with arguments `args[1..7]`; the result goes to `ret`.
pub const CMD_SYSCALL: u64 = 2;
/// Fork: `args[0]` is the new shared page's memfd, `args[1]` the new socket (fd numbers in the
/// stub); or, with `args[2]` the address of a `recvmsg` header in the scratch area, the two fds
/// the VMM sent, received first (at [`BATCH_FDS`]; one round trip for both steps). The child
/// maps the memfd over its shared page, moves the socket to [`layout::SOCK_FD`] and reports
/// `ret = 0` there; the parent reports the child's pid (or `-errno`).
pub const CMD_FORK: u64 = 3;
/// `madvise(start, len, args[0])` for each of `args[1]` (start, len) pairs of u64 at
/// [`SCRATCH`] (at most [`ADVISE_MAX`]); `ret` = how many succeeded. Nothing a guest could not
/// do with `CMD_SYSCALL` from the blob: one round trip instead of one per range.
pub const CMD_ADVISE: u64 = 4;
/// Most ranges one `CMD_ADVISE` takes: what fits in the scratch area.
pub const ADVISE_MAX: usize = (4096 - SCRATCH) / 16;
/// Make `args[1]` syscalls one after the other, each `(nr, a0, .., a5)` (7 u64) at [`BATCH_AT`],
/// at most [`BATCH_MAX`]; each one's result replaces its `nr`; the first that fails (a result in
/// `-4095..0`) ends the list; `ret` = how many ran. An `a0` or `a4` (close's and mmap's fd) equal to
/// `FD_RECEIVED[i]` stands for the `i`th fd at [`BATCH_FDS`], where a `recvmsg` earlier in the
/// list (the scratch area's message header, as for single commands) put the fds the VMM sent.
/// Nothing a guest could not do with `CMD_SYSCALL` from the blob: one round trip instead of one
/// per call (a program load's mappings: docs/systrap.md).
pub const CMD_BATCH: u64 = 5;
/// Where [`CMD_BATCH`]'s list starts in the page: after the message header, iovec, data byte and
/// control buffer that a `recvmsg` into the scratch area uses (128 bytes).
pub const BATCH_AT: usize = SCRATCH + 128;
/// Where the fds a `recvmsg` into the scratch area received are (in its control buffer, after
/// the 16-byte `cmsghdr`).
pub const BATCH_FDS: usize = SCRATCH + 96 + 16;
/// Most syscalls one [`CMD_BATCH`] takes.
pub const BATCH_MAX: usize = (4096 - BATCH_AT) / 56;
/// The argument values a [`CMD_BATCH`] entry names a received fd by (no fd, address or length a
/// close or mmap takes).
pub const FD_RECEIVED: [i64; 2] = [-2, -3];

/// `flags` bit: the CPU and kernel let user code use `rdfsbase`/`wrfsbase`.
pub const FLAG_FSGSBASE: u32 = 1;

/// Offset of the scratch area in the page (message headers for fd passing).
pub const SCRATCH: usize = 1024;

/// The layout of the shared page. Offsets are used by the blob's assembly (`offset_of!`).
#[repr(C)]
pub struct Page {
    pub state: AtomicU32,
    pub stub_sleeping: AtomicU32,
    pub vmm_sleeping: AtomicU32,
    /// How many times the stub polls `state` before it sleeps.
    pub stub_spin: u32,
    pub flags: u32,
    /// `EXIT_*`.
    pub exit: u32,
    /// `si_signo`, `si_code` of the trap.
    pub signo: u32,
    pub code: i32,
    /// `si_addr` (for SIGSYS, the address after the syscall instruction).
    pub addr: u64,
    /// `si_syscall` for SIGSYS.
    pub sysnr: u64,
    /// The address (in the stub) of the XSAVE area in the signal frame.
    pub fpstate: u64,
    pub fs_base: u64,
    /// The signal frame's `mcontext.gregs` (Linux's `REG_*` order).
    pub gregs: [u64; 23],
    pub cmd: u64,
    pub args: [u64; 7],
    pub ret: i64,
    /// Set by a new stub before it jumps into the blob: which setup step failed and its errno.
    pub boot_step: u32,
    pub boot_errno: i32,
    /// The confinement the new stub obtained (`confine::REPORT_*` bits).
    pub report: u32,
    /// How many times the stub calls `sched_yield` (checking `state` after each) between its spin
    /// and its sleep.
    pub stub_yields: u32,
    /// Set by the stub when its spin ran out before the VMM answered (it then yields and sleeps);
    /// read and cleared by the VMM at its next hand-off (an adaptive [`Handoff`]).
    pub stub_missed: AtomicU32,
    /// Where the guest's virtual clock page is (the vDSO's data page, `guestos::vdso`), for the
    /// stub to answer a trapped `rdtsc` itself, as the VMM would (`Stub::set_clock_page`); 0: every
    /// trapped `rdtsc` goes to the VMM.
    pub clock_page: u64,
    /// Set by the blob's handler when the VMM's kick arrived while the stub ran its own code
    /// outside a signal handler (a patched site's entry, `patch.rs`); the next return to the
    /// guest reports the kick instead.
    pub kick_pending: u32,
    /// Set by the VMM when it replaced the XSAVE area of a patched site's exit
    /// ([`layout::XSAVE_BUF`](super::layout::XSAVE_BUF)): the return loads it (`xrstor`).
    pub xsave_dirty: u32,
    /// The XSAVE components a patched site's entry saves (the signal frame's, `xfeatures`).
    pub xsave_mask: u64,
    /// Syscalls that entered through a patched site (counted by the blob).
    pub patched_entries: u64,
    /// The clock page's words (`clock_page`, when set) as the guest left them, copied by the blob
    /// at each exit of the guest (not a command's): what the VMM folds (`guestos::vdso::fold_host`)
    /// without reading the guest's memory, one `pread` of `/proc/<pid>/mem` fewer per exit.
    pub clock_copy: [u64; vdso::WORDS],
}

const _: () = assert!(std::mem::size_of::<Page>() <= SCRATCH);

/// `mcontext.gregs` indexes (Linux x86-64 `REG_*`).
pub mod reg {
    pub const R8: usize = 0;
    pub const R9: usize = 1;
    pub const R10: usize = 2;
    pub const R11: usize = 3;
    pub const R12: usize = 4;
    pub const R13: usize = 5;
    pub const R14: usize = 6;
    pub const R15: usize = 7;
    pub const RDI: usize = 8;
    pub const RSI: usize = 9;
    pub const RBP: usize = 10;
    pub const RBX: usize = 11;
    pub const RDX: usize = 12;
    pub const RAX: usize = 13;
    pub const RCX: usize = 14;
    pub const RSP: usize = 15;
    pub const RIP: usize = 16;
    pub const EFL: usize = 17;
    pub const ERR: usize = 19;
    pub const TRAPNO: usize = 20;
}

/// The VMM's mapping of one shared page, with the memfd behind it.
#[derive(Debug)]
pub struct SharedPage {
    ptr: NonNull<Page>,
    memfd: OwnedFd,
}

// SAFETY: the mapping is owned by this value and only reached through it; the other process that
// writes it is synchronized with through the atomics in `Page`.
unsafe impl Send for SharedPage {}

impl SharedPage {
    /// A new zeroed page in a new memfd, mapped here.
    pub fn new() -> io::Result<SharedPage> {
        // SAFETY: the name is a NUL-terminated literal; the flags are valid.
        let fd = unsafe { libc::memfd_create(c"collimate-systrap".as_ptr(), libc::MFD_CLOEXEC) };
        if fd < 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: `fd` was just returned by memfd_create and is owned by nobody else.
        let memfd = unsafe { OwnedFd::from_raw_fd(fd) };
        // SAFETY: plain syscall on an fd we own.
        if unsafe { libc::ftruncate(fd, layout::SHARED_LEN as i64) } != 0 {
            return Err(io::Error::last_os_error());
        }
        // SAFETY: a new shared mapping of a memfd we own, at an address the kernel picks.
        let p = unsafe {
            libc::mmap(std::ptr::null_mut(), layout::SHARED_LEN as usize, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_SHARED, fd, 0)
        };
        if p == libc::MAP_FAILED {
            return Err(io::Error::last_os_error());
        }
        let ptr = NonNull::new(p.cast::<Page>()).ok_or_else(|| io::Error::from(io::ErrorKind::Other))?;
        Ok(SharedPage { ptr, memfd })
    }

    /// The memfd (to map it in the stub).
    pub fn memfd(&self) -> &OwnedFd {
        &self.memfd
    }

    /// The page. Fields other than the atomics must be read or written only while it is the VMM's
    /// turn (the stub is parked); the guest may still scribble on them, so they are guest data.
    pub fn page(&self) -> *mut Page {
        self.ptr.as_ptr()
    }

    /// The base address of the mapping, as bytes.
    pub fn bytes(&self) -> *mut u8 {
        self.ptr.as_ptr().cast()
    }

    fn state(&self) -> &AtomicU32 {
        // SAFETY: the page stays mapped for `self`'s life; `AtomicU32` has the layout of u32.
        unsafe { &(*self.ptr.as_ptr()).state }
    }

    /// Hand the turn to the stub (after the command fields are written). With an adaptive
    /// `policy`, first set how long the stub will spin when it hands the turn back, from whether
    /// its spin answered last time (`spin`).
    pub fn hand_to_stub(&self, policy: &Handoff, spin: &mut SpinState) {
        // SAFETY: as in `state`.
        let p = unsafe { &*self.ptr.as_ptr() };
        if policy.adaptive {
            // The stub's wait that this hand-off ends used the spin set at the last one: it paid
            // unless the stub said its spin ran out.
            let missed = p.stub_missed.swap(0, Ordering::SeqCst) != 0;
            if spin.stub_spun {
                spin.stub.record(!missed);
            }
            let n = if spin.stub.try_spin() { policy.stub_spin } else { 0 };
            spin.stub_spun = n > 0;
            // SAFETY: the stub reads this word only when it starts to wait, after the swap below.
            unsafe { std::ptr::write_volatile(&raw mut (*self.ptr.as_ptr()).stub_spin, n) };
        }
        p.state.swap(STUB_TURN, Ordering::SeqCst);
        if p.stub_sleeping.load(Ordering::SeqCst) != 0 {
            futex_wake(&p.state);
        }
    }

    /// Wait until it is the VMM's turn: poll for `policy.vmm_spin` (time, read from the clock;
    /// with an adaptive policy only while such spins pay, `spin`), then `sched_yield` up to
    /// `policy.yields` times, then sleep. `alive` is asked after each sleep of at most 50 ms; when
    /// it says the stub is gone this returns false.
    pub fn wait_for_stub(&self, policy: &Handoff, spin: &mut SpinState, mut alive: impl FnMut() -> bool) -> bool {
        let state = self.state();
        if !policy.vmm_spin.is_zero() && (!policy.adaptive || spin.vmm.try_spin()) {
            // While this thread traps rdtsc (`tsc`) the budget is a count of `pause`s, as the
            // stub's is (a clock read would be a syscall each time).
            let counted = super::tsc::thread_traps();
            let start = if counted { None } else { Some(std::time::Instant::now()) };
            let mut pauses = (policy.vmm_spin.as_nanos() / PAUSE_NS) as u64;
            let answered = 'spin: loop {
                for _ in 0..32 {
                    if state.load(Ordering::Acquire) == VMM_TURN {
                        break 'spin true;
                    }
                    std::hint::spin_loop();
                }
                let over = match start {
                    Some(t) => t.elapsed() >= policy.vmm_spin,
                    None => {
                        pauses = pauses.saturating_sub(32);
                        pauses == 0
                    }
                };
                if over {
                    break false;
                }
            };
            if policy.adaptive {
                spin.vmm.record(answered);
                spin.vmm_answered += u32::from(answered);
            }
            if answered {
                return true;
            }
        }
        for _ in 0..policy.yields {
            if state.load(Ordering::Acquire) == VMM_TURN {
                return true;
            }
            // SAFETY: sched_yield has no preconditions.
            unsafe { libc::sched_yield() };
        }
        // SAFETY: as in `state`.
        let p = unsafe { &*self.ptr.as_ptr() };
        loop {
            p.vmm_sleeping.swap(1, Ordering::SeqCst);
            if state.load(Ordering::SeqCst) == VMM_TURN {
                p.vmm_sleeping.store(0, Ordering::Relaxed);
                return true;
            }
            futex_wait(state, STUB_TURN, 50_000_000);
            p.vmm_sleeping.store(0, Ordering::Relaxed);
            if state.load(Ordering::Acquire) == VMM_TURN {
                return true;
            }
            if !alive() {
                return false;
            }
        }
    }
}

/// How each side waits for the other's answer before it sleeps in `FUTEX_WAIT` (see
/// [`super::Stub::set_handoff`] and benches/systrap.rs).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Handoff {
    /// How long the VMM polls (with `pause`) before it yields or sleeps.
    pub vmm_spin: std::time::Duration,
    /// How many times the stub polls (with `pause`, ~30 ns each on the machines measured) before it
    /// yields or sleeps. A count, not a time: the stub cannot read a clock while `rdtsc` traps.
    pub stub_spin: u32,
    /// How many times each side calls `sched_yield` (checking after each) between spin and sleep:
    /// on a busy core this lets the other side run without the price of a sleep and a wake.
    pub yields: u32,
    /// Spin only while spinning pays: each side spins its budget again only if its last spin was
    /// answered within it (the two sides run on different CPUs); after a spin that was not, it
    /// skips the spin for the next 1, 2, 4 ... [`MAX_SKIP`] waits (yield, then sleep) and then
    /// tries once more. So on a busy host, or with both sides on one CPU, the spins stop after a
    /// miss, and cost one budget per [`MAX_SKIP`] waits at most.
    pub adaptive: bool,
}

/// About how long one `pause` takes on the machines measured (350 make the stub's ~10 us spin).
const PAUSE_NS: u128 = 30;

/// The longest run of waits an adaptive side skips its spin for after spins that were not answered.
pub const MAX_SKIP: u32 = 256;

/// One side's record for an adaptive [`Handoff`]: how many waits to skip the spin for, and the
/// current back-off.
#[derive(Debug, Clone, Copy, Default)]
pub struct Backoff {
    skip: u32,
    backoff: u32,
}

impl Backoff {
    /// Whether this wait spins (else one skipped wait is counted).
    fn try_spin(&mut self) -> bool {
        if self.skip == 0 {
            return true;
        }
        self.skip -= 1;
        false
    }

    /// The spin was answered within its budget or not.
    fn record(&mut self, answered: bool) {
        if answered {
            self.backoff = 0;
        } else {
            self.backoff = (self.backoff * 2).clamp(1, MAX_SKIP);
            self.skip = self.backoff;
        }
    }
}

/// The VMM's record of both sides' spins for an adaptive [`Handoff`] (the stub's is decided by
/// the VMM, which sets `Page::stub_spin` before each hand-off: the stub cannot read a clock while
/// `rdtsc` traps, and keeps no state).
#[derive(Debug, Clone, Copy, Default)]
pub struct SpinState {
    vmm: Backoff,
    stub: Backoff,
    /// The stub was told to spin for the wait the next hand-off ends.
    stub_spun: bool,
    /// The VMM's spins answered since the last [`SpinState::take_vmm_answered`] (`placement`
    /// judges a spread pair by them).
    vmm_answered: u32,
}

impl SpinState {
    /// The VMM's spins answered since the last call.
    pub fn take_vmm_answered(&mut self) -> u32 {
        std::mem::take(&mut self.vmm_answered)
    }

    /// Whether the VMM's next wait under `policy` starts with a spin.
    pub fn vmm_spins(&self, policy: &Handoff) -> bool {
        !policy.vmm_spin.is_zero() && (!policy.adaptive || self.vmm.skip == 0)
    }
}

impl Drop for SharedPage {
    fn drop(&mut self) {
        // SAFETY: unmapping the mapping this value owns; nothing borrows it past `self`.
        unsafe { libc::munmap(self.ptr.as_ptr().cast(), layout::SHARED_LEN as usize) };
        let _ = self.memfd.as_raw_fd();
    }
}

/// `FUTEX_WAIT` (shared, not private: the word is in a page two processes map) until `word` is not
/// `expected`, a wake, or `timeout_ns`.
pub fn futex_wait(word: &AtomicU32, expected: u32, timeout_ns: u64) {
    let ts = libc::timespec { tv_sec: (timeout_ns / 1_000_000_000) as i64, tv_nsec: (timeout_ns % 1_000_000_000) as i64 };
    // SAFETY: `word` is a valid aligned u32 for the call's duration; `ts` lives on this stack.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAIT, expected, &ts as *const libc::timespec) };
}

/// `FUTEX_WAKE` one waiter on `word` (shared futex).
pub fn futex_wake(word: &AtomicU32) {
    // SAFETY: `word` is a valid aligned u32; FUTEX_WAKE does not touch memory.
    unsafe { libc::syscall(libc::SYS_futex, word.as_ptr(), libc::FUTEX_WAKE, 1) };
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Spins that are not answered back off 1, 2, 4 ... MAX_SKIP waits; one answered spin ends
    /// the back-off.
    #[test]
    fn an_adaptive_side_backs_off_after_unanswered_spins_and_resumes_after_an_answered_one() {
        let mut b = Backoff::default();
        assert!(b.try_spin() && b.try_spin(), "spins while nothing says it does not pay");
        let mut skipped = Vec::new();
        for _ in 0..12 {
            assert!(b.try_spin());
            b.record(false);
            let mut n = 0;
            while !b.try_spin() {
                n += 1;
            }
            skipped.push(n);
        }
        assert_eq!(skipped, [1, 2, 4, 8, 16, 32, 64, 128, 256, 256, 256, 256]);
        b.record(true);
        assert!(b.try_spin() && b.try_spin(), "an answered spin: spin every time again");
        b.record(false);
        assert!(!b.try_spin() && b.try_spin(), "and a new miss starts the back-off from 1");
    }
}
