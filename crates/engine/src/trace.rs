//! Timestamps of the steps of a guest process's life, for finding where a spawn's time goes.
//!
//! With `COLLIMATE_TRACE=1` in the environment of the VMM processes, each [`mark`] writes one line
//! to the process's stderr: `collimate-trace <host CLOCK_MONOTONIC ns> <host pid> <what>`. The
//! lines of all the processes of a sandbox interleave on the controller's stderr and sort by
//! time; `benches/spawn_breakdown.py` turns them into the table in `docs/spawn.md`. Off (the
//! default), a mark is one relaxed atomic load: the marks stay in the code.
//!
//! A line is one `write(2)` of a stack buffer, so a mark costs a few microseconds when on and
//! allocates nothing (it is called between `fork` and the child's first run).

use std::sync::atomic::{AtomicU64, AtomicU8, Ordering};

/// 0: not decided yet, 1: off, 2: on, 3: on with every syscall.
static STATE: AtomicU8 = AtomicU8::new(0);

fn state() -> u8 {
    match STATE.load(Ordering::Relaxed) {
        0 => {
            let v = match std::env::var("COLLIMATE_TRACE").as_deref() {
                Ok("1") => 2,
                Ok("2") => 3,
                _ => 1,
            };
            STATE.store(v, Ordering::Relaxed);
            v
        }
        v => v,
    }
}

/// Whether tracing is on (read once per process from `COLLIMATE_TRACE`: `1` marks the steps of
/// a process's life, `2` every syscall too).
pub fn on() -> bool {
    state() >= 2
}

/// Mark syscall `nr` as it is entered (with `COLLIMATE_TRACE=2`).
pub fn syscall(nr: u64) {
    if state() == 3 {
        mark_with("sys", Some(nr));
    }
}

/// Mark a command the VMM hands a parked systrap stub (with `COLLIMATE_TRACE=2`): `what` is the
/// syscall number it makes for the VMM, or 1000 + the command for the others (fork, advise).
pub fn stub_command(what: u64) {
    if state() == 3 {
        mark_with("cmd", Some(what));
    }
}

/// Mark `n` clock reads the vDSO answered in the guest since the last exit (with
/// `COLLIMATE_TRACE=2`; replay mode, see `guestos::vdso`).
pub fn vdso_reads(n: u64) {
    if state() == 3 {
        mark_with("vdso", Some(n));
    }
}

/// Record that this process reached step `what` now (see the module docs).
pub fn mark(what: &str) {
    if !on() {
        return;
    }
    mark_with(what, None);
}

/// [`mark`] with a number after the step's name (a syscall number, a count).
pub fn mark_n(what: &str, n: u64) {
    if !on() {
        return;
    }
    mark_with(what, Some(n));
}

/// KVM_RUN calls, guest page faults and nanoseconds spent in KVM_RUN since the last [`take_counts`].
static RUNS: AtomicU64 = AtomicU64::new(0);
static FAULTS: AtomicU64 = AtomicU64::new(0);
static RUN_NS: AtomicU64 = AtomicU64::new(0);

/// Count one KVM_RUN that took `ns` (only when tracing).
pub fn count_run(ns: u64) {
    RUNS.fetch_add(1, Ordering::Relaxed);
    RUN_NS.fetch_add(ns, Ordering::Relaxed);
}

/// Count one guest page fault the host served.
pub fn count_fault() {
    FAULTS.fetch_add(1, Ordering::Relaxed);
}

/// Mark the counts since the last call (as `<what>.runs`, `.faults`, `.run_us`) and start over.
pub fn take_counts(what: &str) {
    let (runs, faults, ns) = (RUNS.swap(0, Ordering::Relaxed), FAULTS.swap(0, Ordering::Relaxed), RUN_NS.swap(0, Ordering::Relaxed));
    if !on() {
        return;
    }
    let mut name = [0u8; 64];
    for (suffix, v) in [(".runs", runs), (".faults", faults), (".run_us", ns / 1000)] {
        let n = what.len().min(40);
        name[..n].copy_from_slice(&what.as_bytes()[..n]);
        name[n..n + suffix.len()].copy_from_slice(suffix.as_bytes());
        mark_with(std::str::from_utf8(&name[..n + suffix.len()]).unwrap_or("counts"), Some(v));
    }
}

fn mark_with(what: &str, n: Option<u64>) {
    let mut ts = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime writes one timespec; getpid cannot fail.
    let pid = unsafe {
        libc::clock_gettime(libc::CLOCK_MONOTONIC, &mut ts);
        libc::getpid()
    };
    let ns = ts.tv_sec as u64 * 1_000_000_000 + ts.tv_nsec as u64;
    let mut buf = [0u8; 160];
    let mut w = Cursor { buf: &mut buf, len: 0 };
    w.put(b"collimate-trace ");
    w.num(ns);
    w.put(b" ");
    w.num(pid as u64);
    w.put(b" ");
    w.put(what.as_bytes());
    if let Some(n) = n {
        w.put(b" ");
        w.num(n);
    }
    w.put(b"\n");
    let len = w.len;
    // SAFETY: writing our own initialized buffer to fd 2; a failed write only loses the line.
    unsafe { libc::write(2, buf.as_ptr().cast(), len) };
}

struct Cursor<'a> {
    buf: &'a mut [u8],
    len: usize,
}

impl Cursor<'_> {
    fn put(&mut self, b: &[u8]) {
        let n = b.len().min(self.buf.len() - self.len);
        self.buf[self.len..self.len + n].copy_from_slice(&b[..n]);
        self.len += n;
    }

    fn num(&mut self, mut v: u64) {
        let mut digits = [0u8; 20];
        let mut i = digits.len();
        loop {
            i -= 1;
            digits[i] = b'0' + (v % 10) as u8;
            v /= 10;
            if v == 0 {
                break;
            }
        }
        self.put(&digits[i..]);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cursor_writes_numbers_and_stops_at_the_end() {
        let mut buf = [0u8; 8];
        let mut c = Cursor { buf: &mut buf, len: 0 };
        c.num(0);
        c.put(b" ");
        c.num(1234567890);
        assert_eq!(&buf, b"0 123456");
    }
}
