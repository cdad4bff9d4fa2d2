//! The serving thread's own `rdtsc` mode, kept equal to its stub's so that switching between the
//! two never rewrites CR4.
//!
//! A stub that traps `rdtsc` (`PR_SET_TSC(PR_TSC_SIGSEGV)`, every replay exec) is a task with
//! Linux's `TIF_NOTSC`. The host kernel sets CR4.TSD while such a task runs and clears it while
//! any other does, so each context switch between the stub and a task without the flag writes
//! CR4: on a nested host (kvm_pvm here) an exit to the hypervisor, about 4 us. A trapped round
//! trip that sleeps has two such switches (stub to VMM thread and back on one CPU) and cost
//! 13.3 us against 4.9 us with neither task trapping (a two-process futex ping-pong, one side
//! trapping: 13.3 us; both: 4.9 us, the same as neither; load 7-8, 2026-12-07).
//!
//! So the VMM thread that serves a stub takes the stub's mode before each hand-off
//! ([`match_stub`], called by `Stub::run` and its commands): in a replay exec it traps `rdtsc`
//! too, and a switch between the two is between two `TIF_NOTSC` tasks. Guest `rdtsc` stays
//! trapped (the stub's mode is unchanged). The VMM thread must then not run `rdtsc` itself: its
//! clock reads on the hand-off path go through the `clock_gettime` syscall ([`now`], about 0.3 us
//! here; the kernel reads the TSC in ring 0, which CR4.TSD does not stop). Any other `rdtsc` of
//! the thread (the vDSO behind `Instant::now`, in code that does not know) faults: a SIGSEGV
//! handler installed by [`install`] recognises the instruction, turns the thread's trap off
//! (`PR_TSC_ENABLE`) and returns, so the instruction runs again natively; the next hand-off
//! turns it back on. Correct either way, at the price of two CR4 writes and a signal per such
//! rescue ([`rescues`] counts them). Threads and host forks of a trapping thread inherit the
//! mode and are rescued the same way at their first read.
//!
//! `COLLIMATE_SYSTRAP_TSC_MATCH=0` (read once per process) leaves the VMM thread's mode alone, as
//! before: to compare in benches.

use std::cell::Cell;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicU8, AtomicUsize, Ordering};
use std::sync::OnceLock;
use std::time::{Duration, Instant};

thread_local! {
    /// Whether this thread traps `rdtsc` now, as far as this module set it (a thread started by
    /// a trapping one inherits the trap but starts with `false`; its first `rdtsc` corrects it).
    static TRAPPING: Cell<bool> = const { Cell::new(false) };
}

/// Rescues since the process started ([`rescues`]).
static RESCUES: AtomicU64 = AtomicU64::new(0);
/// The SIGSEGV action that was in place before ours (a `libc::sigaction` stored as its handler
/// word and flags), to pass on every fault that is not an `rdtsc`.
static OLD_HANDLER: AtomicUsize = AtomicUsize::new(libc::SIG_DFL);
static OLD_FLAGS: AtomicUsize = AtomicUsize::new(0);
static INSTALLED: AtomicBool = AtomicBool::new(false);

const SI_KERNEL: i32 = 0x80;

/// Whether the serving thread follows its stub's mode (`COLLIMATE_SYSTRAP_TSC_MATCH`, default on).
pub fn enabled() -> bool {
    match MATCHING.load(Ordering::Relaxed) {
        0 => {
            let on = std::env::var_os("COLLIMATE_SYSTRAP_TSC_MATCH").is_none_or(|v| v != "0");
            MATCHING.store(if on { 2 } else { 1 }, Ordering::Relaxed);
            on
        }
        v => v == 2,
    }
}

/// 0: not read yet, 1: off, 2: on ([`enabled`]).
static MATCHING: AtomicU8 = AtomicU8::new(0);

/// Turn matching on or off for this process (benches compare the two in one run); off also
/// gives the calling thread its native `rdtsc` back.
pub fn set_matching(on: bool) {
    MATCHING.store(if on { 2 } else { 1 }, Ordering::Relaxed);
    if !on {
        release();
    }
}

/// How many `rdtsc`s of trapping VMM threads the handler has let through since the process
/// started (each cost a signal and two CR4 writes).
pub fn rescues() -> u64 {
    RESCUES.load(Ordering::Relaxed)
}

/// Whether the calling thread traps `rdtsc` now (as far as this module knows).
pub fn thread_traps() -> bool {
    TRAPPING.with(Cell::get)
}

fn set_mode(trap: bool) -> bool {
    let mode = if trap { libc::PR_TSC_SIGSEGV } else { libc::PR_TSC_ENABLE };
    // SAFETY: prctl(PR_SET_TSC) changes only the calling thread's TSC flag.
    let ok = unsafe { libc::prctl(libc::PR_SET_TSC, mode, 0, 0, 0) } == 0;
    if ok {
        TRAPPING.with(|t| t.set(trap));
    }
    ok
}

/// Give the calling thread `trap` as its `rdtsc` mode (a stub's, before handing it the turn).
/// Nothing when it has it already; nothing when matching is off ([`enabled`]) or the handler
/// that rescues the thread's own reads could not be installed.
pub fn match_stub(trap: bool) {
    if trap == thread_traps() || !enabled() {
        return;
    }
    if trap && !ours_in_place() {
        return;
    }
    set_mode(trap);
}

/// Give the calling thread its native `rdtsc` back (before it creates a process that must start
/// with `rdtsc` native, since a new stub sets its own mode; or before it does other work).
pub fn release() {
    if thread_traps() {
        set_mode(false);
    }
}

/// Install the SIGSEGV handler that rescues a trapping VMM thread's own `rdtsc` (see the module
/// docs). Call it before anything (a jail) forbids `rt_sigaction`; [`match_stub`] checks again
/// that it is still the process's handler before it turns a trap on.
pub fn install() -> std::io::Result<()> {
    if INSTALLED.load(Ordering::Acquire) && ours_in_place() {
        return Ok(());
    }
    // SAFETY: a zeroed sigaction is valid for the kernel to fill or read; the handler below is
    // async-signal-safe (a few loads, prctl, and the old handler as the kernel would call it).
    unsafe {
        let mut old: libc::sigaction = std::mem::zeroed();
        if libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut old) != 0 {
            return Err(std::io::Error::last_os_error());
        }
        if old.sa_sigaction != handler_addr() {
            OLD_HANDLER.store(old.sa_sigaction, Ordering::Relaxed);
            OLD_FLAGS.store(old.sa_flags as usize, Ordering::Relaxed);
        }
        let mut new: libc::sigaction = std::mem::zeroed();
        new.sa_sigaction = handler_addr();
        new.sa_flags = libc::SA_SIGINFO | libc::SA_ONSTACK;
        libc::sigemptyset(&mut new.sa_mask);
        if libc::sigaction(libc::SIGSEGV, &new, std::ptr::null_mut()) != 0 {
            return Err(std::io::Error::last_os_error());
        }
    }
    INSTALLED.store(true, Ordering::Release);
    Ok(())
}

fn ours_in_place() -> bool {
    // SAFETY: reading the current action into a local.
    unsafe {
        let mut cur: libc::sigaction = std::mem::zeroed();
        libc::sigaction(libc::SIGSEGV, std::ptr::null(), &mut cur) == 0 && cur.sa_sigaction == handler_addr()
    }
}

fn handler_addr() -> usize {
    on_segv as *const () as usize
}

extern "C" fn on_segv(sig: i32, info: *mut libc::siginfo_t, ctx: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo and ucontext to an SA_SIGINFO handler.
    let rip = unsafe {
        if (*info).si_code != SI_KERNEL {
            0
        } else {
            (*ctx.cast::<libc::ucontext_t>()).uc_mcontext.gregs[libc::REG_RIP as usize] as u64
        }
    };
    if rip != 0 {
        // SAFETY: `rip` is where the thread was executing, so its bytes are mapped and readable
        // (an instruction fetch succeeded there); 3 bytes may cross into an unmapped page only for
        // an instruction shorter than 3 bytes at a page's end, which is why the third is read
        // only after the first two say rdtscp.
        let is_rdtsc = unsafe {
            let p = rip as *const u8;
            let (a, b) = (std::ptr::read_volatile(p), std::ptr::read_volatile(p.add(1)));
            (a, b) == (0x0f, 0x31) || ((a, b) == (0x0f, 0x01) && std::ptr::read_volatile(p.add(2)) == 0xf9)
        };
        if is_rdtsc && set_mode(false) {
            RESCUES.fetch_add(1, Ordering::Relaxed);
            return; // the instruction runs again, natively
        }
    }
    let old = OLD_HANDLER.load(Ordering::Relaxed);
    if old == libc::SIG_DFL || old == libc::SIG_IGN {
        // A fault the process did not expect: the default action, as if we were not here (the
        // instruction faults again once this returns).
        // SAFETY: restoring the default action of SIGSEGV.
        unsafe {
            let mut dfl: libc::sigaction = std::mem::zeroed();
            dfl.sa_sigaction = libc::SIG_DFL;
            libc::sigaction(libc::SIGSEGV, &dfl, std::ptr::null_mut());
        }
        return;
    }
    if OLD_FLAGS.load(Ordering::Relaxed) & libc::SA_SIGINFO as usize != 0 {
        // SAFETY: the previous handler was installed with SA_SIGINFO: call it as the kernel would.
        let f: extern "C" fn(i32, *mut libc::siginfo_t, *mut libc::c_void) = unsafe { std::mem::transmute(old) };
        f(sig, info, ctx);
    } else {
        // SAFETY: a plain handler takes the signal number only.
        let f: extern "C" fn(i32) = unsafe { std::mem::transmute(old) };
        f(sig);
    }
}

/// `Instant::now()` without `rdtsc` while the calling thread traps it: the `clock_gettime`
/// syscall (the same clock, `CLOCK_MONOTONIC`, read by the kernel), else the vDSO.
pub fn now() -> Instant {
    if !thread_traps() {
        return Instant::now();
    }
    static BASE: OnceLock<(Instant, u64)> = OnceLock::new();
    // Taken once per process with the thread's trap off for a moment (a rescue would do it too).
    let (base, base_ns) = *BASE.get_or_init(|| {
        set_mode(false);
        let pair = (Instant::now(), raw_monotonic_ns());
        set_mode(true);
        pair
    });
    let ns = raw_monotonic_ns();
    base + Duration::from_nanos(ns.saturating_sub(base_ns))
}

fn raw_monotonic_ns() -> u64 {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: the clock_gettime syscall (not the vDSO) writes one timespec we own.
    unsafe { libc::syscall(libc::SYS_clock_gettime, libc::CLOCK_MONOTONIC, &mut ts) };
    ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trapping_threads_own_rdtsc_is_rescued_and_its_clock_keeps_going() {
        std::thread::spawn(|| {
            install().expect("install the handler");
            let before = Instant::now();
            match_stub(true);
            assert!(thread_traps());
            let a = now();
            assert!(thread_traps(), "now() must not leave the trap");
            let n = rescues();
            // SAFETY: rdtsc has no side effects; here it faults and is rescued.
            let t = unsafe { core::arch::x86_64::_rdtsc() };
            assert!(t > 0);
            assert_eq!(rescues(), n + 1);
            assert!(!thread_traps());
            let b = Instant::now();
            assert!(before <= a && a <= b);
            match_stub(false);
        })
        .join()
        .expect("the thread");
    }
}
