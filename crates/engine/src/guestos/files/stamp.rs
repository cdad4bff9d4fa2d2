//! File times from the guest's clock (docs/replay.md, "File times").
//!
//! The sandbox's files live on the host, whose kernel stamps what changes them with the host's
//! time. In replay mode the guest's clock is virtual (it goes on from where the template last
//! read it), so those stamps were ahead of it by the template's age: `make` warned of clock skew,
//! GNU tar of time stamps in the future. So in replay mode what the guest changes is stamped
//! again with the guest's own CLOCK_REALTIME (read without counting as a clock read, so the
//! guest's clock readings are the same as without it): a write's mtime, a new file's or
//! directory's times, and the mtime of the directory that got the new entry. Uploads between runs
//! get the last time the guest read ([`upload_time`]), which no later reading precedes. Outside
//! replay mode the guest's clock is the host's, and the host's stamps are already right.

use std::ffi::CStr;
use std::os::fd::RawFd;

use crate::guestos::process::Proc;

const OMIT: libc::timespec = libc::timespec { tv_sec: 0, tv_nsec: libc::UTIME_OMIT };

fn ts(ns: u64) -> libc::timespec {
    libc::timespec { tv_sec: (ns / 1_000_000_000) as i64, tv_nsec: (ns % 1_000_000_000) as i64 }
}

/// The guest's CLOCK_REALTIME now in replay mode, without advancing it; None outside replay mode.
pub fn now(p: &Proc) -> Option<libc::timespec> {
    p.clocks.replay.then(|| ts(p.clocks.real_now()))
}

/// The guest wrote to (or truncated, or allocated in) the host file `fd`: its mtime is now.
pub fn written(p: &Proc, fd: RawFd) {
    if let Some(t) = now(p) {
        // SAFETY: futimens on a descriptor the caller holds, with a local array of two timespecs.
        unsafe { libc::futimens(fd, [OMIT, t].as_ptr()) };
    }
}

/// The guest made the entry `n` in host directory `d` (a file, directory, link, FIFO): its times
/// and the directory's mtime are now.
pub fn created_at(p: &Proc, d: RawFd, n: &CStr) {
    if let Some(t) = now(p) {
        // SAFETY: utimensat relative to a directory descriptor the caller holds, with valid C
        // strings and a local array; the entry itself, never a link's target.
        unsafe {
            libc::utimensat(d, n.as_ptr(), [t, t].as_ptr(), libc::AT_SYMLINK_NOFOLLOW);
            libc::utimensat(d, c".".as_ptr(), [OMIT, t].as_ptr(), 0);
        }
    }
}

/// An entry of host directory `d` went or was renamed: the directory's mtime is now.
pub fn dir_changed(p: &Proc, d: RawFd) {
    if let Some(t) = now(p) {
        // SAFETY: as in `created_at`.
        unsafe { libc::utimensat(d, c".".as_ptr(), [OMIT, t].as_ptr(), 0) };
    }
}

/// The time a file uploaded between runs is stamped with: the last wall-clock time the guest was
/// given (replay mode starts its next run there or later), or, for a guest that never read one,
/// the replay epoch; never later than the host's time. So an upload is never in the guest's future.
pub fn upload_time(p: &Proc) -> libc::timespec {
    let seen = if p.clocks.replay {
        p.clocks.real_now().min(p.clocks.seen_real.max(1))
    } else if p.clocks.seen_real != 0 {
        p.clocks.seen_real
    } else {
        crate::guestos::clock::REPLAY_EPOCH_NS
    };
    let mut host = libc::timespec { tv_sec: 0, tv_nsec: 0 };
    // SAFETY: clock_gettime into a local timespec.
    unsafe { libc::clock_gettime(libc::CLOCK_REALTIME, &mut host) };
    let host_ns = (host.tv_sec.max(0) as u64) * 1_000_000_000 + host.tv_nsec.max(0) as u64;
    ts(seen.min(host_ns))
}

/// What the guest's stat reports of a file's ctime in replay mode. The host's kernel sets ctime
/// at every change (a write, the re-stamp above, a chmod) from the host's time, which the guest's
/// clock lags by the template's age, and nothing can set it: a ctime in the guest's future is
/// reported as the file's mtime, which is what Linux holds after a write (ctime == mtime; CPython's
/// test_filetime checks ctime <= mtime). Image files older than the guest's clock are untouched.
fn guest_ctime(p: &Proc, ctime: (i64, i64), mtime: (i64, i64)) -> (i64, i64) {
    if !p.clocks.replay {
        return ctime;
    }
    let now = p.clocks.real_now() as i128;
    let ns = |(s, n): (i64, i64)| s as i128 * 1_000_000_000 + n as i128;
    if ns(ctime) > now { mtime } else { ctime }
}

/// [`guest_ctime`] on a struct stat.
pub fn stat_for_guest(p: &Proc, st: &mut libc::stat) {
    (st.st_ctime, st.st_ctime_nsec) = guest_ctime(p, (st.st_ctime, st.st_ctime_nsec), (st.st_mtime, st.st_mtime_nsec));
}

/// [`guest_ctime`] on a struct statx (stx_ctime at 96, stx_mtime at 112: sec i64, nsec u32).
pub fn statx_for_guest(p: &Proc, b: &mut [u8]) {
    let at = |b: &[u8], off: usize| {
        let s = i64::from_le_bytes(b[off..off + 8].try_into().unwrap_or([0; 8]));
        let n = u32::from_le_bytes(b[off + 8..off + 12].try_into().unwrap_or([0; 4])) as i64;
        (s, n)
    };
    let (s, n) = guest_ctime(p, at(b, 96), at(b, 112));
    b[96..104].copy_from_slice(&s.to_le_bytes());
    b[104..108].copy_from_slice(&(n as u32).to_le_bytes());
}
