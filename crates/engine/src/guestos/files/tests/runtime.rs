//! Unit tests for what running CPython's regression tests in the sandbox found missing or wrong
//! (tests/test_cpython_battery.py): each names the CPython test it stands for.

use super::*;
use crate::guestos::clock::{SYS_CLOCK_SETTIME, SYS_SETTIMEOFDAY};
use crate::guestos::cpu::{
    SYS_GETPRIORITY, SYS_SCHED_GETPARAM, SYS_SCHED_GETSCHEDULER, SYS_SCHED_GET_PRIORITY_MAX, SYS_SCHED_GET_PRIORITY_MIN,
    SYS_SCHED_RR_GET_INTERVAL, SYS_SCHED_SETPARAM, SYS_SCHED_SETSCHEDULER, SYS_SETPRIORITY,
};
use crate::guestos::{ENODATA, EOPNOTSUPP, EPERM, ESRCH};

const SYS_CLOCK_GETTIME: u64 = 228;
const SYS_SELECT: u64 = 23;
const SYS_POLL: u64 = 7;

fn set_replay(h: &mut H, real_ns: u64, mono_ns: u64) {
    let c = &mut h.os.proc.clocks;
    c.replay = true;
    c.real_base = real_ns;
    c.mono_base = mono_ns;
    c.elapsed = 0;
}

fn monotonic(h: &mut H) -> u64 {
    let b = h.buf(16);
    assert_eq!(h.call(SYS_CLOCK_GETTIME, &[libc::CLOCK_MONOTONIC as u64, b, 0]), 0);
    let raw = h.get(b, 16);
    let s = u64::from_le_bytes(raw[..8].try_into().unwrap());
    let ns = u64::from_le_bytes(raw[8..].try_into().unwrap());
    s * 1_000_000_000 + ns
}

/// test_subprocess.test_pass_fds: a child closes the fds it must not keep while it lists
/// /proc/self/fd (CPython's close_fds fallback, with a buffer of one record). Positions are fd
/// numbers, so no fd after a closed one is skipped.
#[test]
fn proc_self_fd_can_be_listed_while_closing() {
    let mut h = H::new();
    let mut fds = Vec::new();
    for _ in 0..10 {
        fds.push(h.open("/work/b.txt", libc::O_RDONLY, 0));
    }
    let dir = h.open("/proc/self/fd", libc::O_RDONLY | libc::O_DIRECTORY, 0);
    let b = h.buf(32); // one record per call
    loop {
        let n = h.call(GETDENTS64, &[dir as u64, b, 32]);
        assert!(n >= 0, "getdents64: {n}");
        if n == 0 {
            break;
        }
        let raw = h.get(b, n as usize);
        let name = &raw[19..];
        let name = std::str::from_utf8(&name[..name.iter().position(|&c| c == 0).unwrap()]).unwrap();
        if let Ok(fd) = name.parse::<i64>() {
            if fd >= 3 && fd != dir {
                assert_eq!(h.call(CLOSE, &[fd as u64]), 0);
            }
        }
    }
    for fd in fds {
        assert_eq!(h.call(CLOSE, &[fd as u64]), e(EBADF), "fd {fd} was skipped");
    }
    // Rewinding lists the directory again from the start.
    assert_eq!(h.call(LSEEK, &[dir as u64, 0, libc::SEEK_SET as u64]), 0);
    let names: Vec<String> = h.list(dir).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec![".", "..", "0", "1", "2", &dir.to_string()]);
}

/// test_subprocess.test_failed_child_execute_fd_leak lists /proc/<its pid>/fd.
#[test]
fn own_proc_directory_by_pid() {
    let mut h = H::new();
    h.os.proc.pid = 4242;
    let fd = h.open("/proc/4242/fd", libc::O_RDONLY | libc::O_DIRECTORY, 0);
    assert!(fd >= 0, "open /proc/4242/fd: {fd}");
    let names: Vec<String> = h.list(fd).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec![".", "..", "0", "1", "2", &fd.to_string()]);
    assert!(h.read_path("/proc/4242/status").unwrap().starts_with(b"Name:"));
    assert_eq!(h.open("/proc/4243/fd", libc::O_RDONLY, 0), e(ENOENT));
    assert_eq!(h.open("/proc/42420/status", libc::O_RDONLY, 0), e(ENOENT));
}

/// test_subprocess.test_restore_signals reads SigIgn from /proc/self/status.
#[test]
fn proc_status_shows_the_signal_masks() {
    let mut h = H::new();
    h.os.proc.sigactions[12].handler = crate::guestos::signal::SIG_IGN; // SIGPIPE
    h.os.proc.sigactions[1].handler = 0x40_1000; // SIGINT: a handler
    h.os.proc.sigmask = 1 << 9; // SIGUSR1
    let s = String::from_utf8(h.read_path("/proc/self/status").unwrap()).unwrap();
    assert!(s.contains("SigBlk:\t0000000000000200\n"), "{s}");
    assert!(s.contains("SigIgn:\t0000000000001000\n"), "{s}");
    assert!(s.contains("SigCgt:\t0000000000000002\n"), "{s}");
}

/// test_os.ExtendedAttributeTests, shutil's copyxattr: user attributes on the sandbox's writable
/// files, kept on the host file (set, get, list, remove, by path and fd); none on the engine's own
/// files; changes only in the "user." namespace, only where writable.
#[test]
fn xattrs_live_on_the_host_files() {
    let mut h = H::new();
    let p = h.cstr("/work/b.txt");
    let b = h.buf(256);
    let name = h.cstr("user.x");
    let value = h.put(b"hello");
    assert_eq!(h.call(LISTXATTR, &[p, b, 256]), 0);
    assert_eq!(h.call(GETXATTR, &[p, name, b, 256]), e(ENODATA));
    assert_eq!(h.call(SETXATTR, &[p, name, value, 5, 0]), 0);
    assert_eq!(h.call(SETXATTR, &[p, name, value, 5, libc::XATTR_CREATE as u64]), e(EEXIST));
    assert_eq!(h.call(GETXATTR, &[p, name, 0, 0]), 5); // the size
    assert_eq!(h.call(GETXATTR, &[p, name, b, 256]), 5);
    assert_eq!(h.get(b, 5), b"hello");
    assert_eq!(h.call(GETXATTR, &[p, name, b, 2]), e(ERANGE));
    assert_eq!(h.call(LISTXATTR, &[p, b, 256]), 7);
    assert_eq!(h.get(b, 7), b"user.x\0");
    let fd = h.open("/work/b.txt", libc::O_RDONLY, 0) as u64;
    assert_eq!(h.call(FGETXATTR, &[fd, name, b, 256]), 5);
    assert_eq!(h.call(FREMOVEXATTR, &[fd, name]), 0);
    assert_eq!(h.call(LISTXATTR, &[p, b, 256]), 0);
    // The trusted namespace is the guest's own (root's, as under Linux), kept under a user
    // attribute of the engine's that the guest never sees as such.
    let trusted = h.cstr("trusted.x");
    assert_eq!(h.call(SETXATTR, &[p, trusted, value, 5, 0]), 0);
    assert_eq!(h.call(GETXATTR, &[p, trusted, b, 256]), 5);
    assert_eq!(h.get(b, 5), b"hello");
    assert_eq!(h.call(LISTXATTR, &[p, 0, 0]), 10);
    assert_eq!(h.call(LISTXATTR, &[p, b, 9]), e(ERANGE));
    assert_eq!(h.call(LISTXATTR, &[p, b, 256]), 10);
    assert_eq!(h.get(b, 10), b"trusted.x\0");
    let host = std::ffi::CString::new(h.dir.0.join("work/b.txt").into_os_string().into_encoded_bytes()).unwrap();
    let mut names = [0u8; 256];
    // SAFETY: a C string and a buffer of 256 bytes.
    let n = unsafe { libc::listxattr(host.as_ptr(), names.as_mut_ptr().cast(), names.len()) };
    assert_eq!(&names[..n.max(0) as usize], b"user.collimate.trusted.x\0", "kept in the host's user namespace");
    let reserved = h.cstr("user.collimate.trusted.x");
    assert_eq!(h.call(GETXATTR, &[p, reserved, b, 256]), e(ENODATA));
    assert_eq!(h.call(SETXATTR, &[p, reserved, value, 5, 0]), e(EOPNOTSUPP));
    // Not root: trusted attributes are invisible and cannot be changed (Linux: CAP_SYS_ADMIN).
    h.os.proc.uid = [1000; 4];
    assert_eq!(h.call(LISTXATTR, &[p, b, 256]), 0);
    assert_eq!(h.call(GETXATTR, &[p, trusted, b, 256]), e(ENODATA));
    assert_eq!(h.call(SETXATTR, &[p, trusted, value, 5, 0]), e(EPERM));
    assert_eq!(h.call(REMOVEXATTR, &[p, trusted]), e(EPERM));
    h.os.proc.uid = [0; 4];
    assert_eq!(h.call(REMOVEXATTR, &[p, trusted]), 0);
    assert_eq!(h.call(LISTXATTR, &[p, b, 256]), 0);
    // A symlink itself takes trusted attributes (not user ones), as under Linux.
    assert!(std::os::unix::fs::symlink("/work/b.txt", h.dir.0.join("work/sub/ln")).is_ok());
    let ln = h.cstr("/work/sub/ln");
    let ln_user = h.cstr("user.y");
    assert_eq!(h.call(LSETXATTR, &[ln, ln_user, value, 5, 0]), e(EPERM));
    assert_eq!(h.call(LSETXATTR, &[ln, trusted, value, 3, 0]), 0);
    assert_eq!(h.call(LGETXATTR, &[ln, trusted, b, 256]), 3);
    assert_eq!(h.call(LLISTXATTR, &[ln, b, 256]), 10);
    assert_eq!(h.get(b, 10), b"trusted.x\0");
    assert_eq!(h.call(LISTXATTR, &[ln, b, 256]), 0, "followed: b.txt has none left");
    assert_eq!(h.call(LREMOVEXATTR, &[ln, trusted]), 0);
    assert_eq!(h.call(LLISTXATTR, &[ln, b, 256]), 0);
    // Other namespaces are the host's business.
    let security = h.cstr("security.x");
    assert_eq!(h.call(SETXATTR, &[p, security, value, 5, 0]), e(EOPNOTSUPP));
    let missing = h.cstr("/work/missing");
    assert_eq!(h.call(LISTXATTR, &[missing, b, 256]), e(ENOENT));
    assert_eq!(h.call(FLISTXATTR, &[99, b, 256]), e(EBADF));
    let null = h.cstr("/dev/null");
    assert_eq!(h.call(LISTXATTR, &[null, b, 256]), e(EOPNOTSUPP));
}

/// test_posix.test_mknod / test_mkfifo: regular files and FIFOs can be made; sockets and devices
/// are refused with EPERM (which CPython's tests accept or skip on), after the path's own errors.
/// A FIFO works across an open for writing (which waits, in slices, for a reader) and reads.
#[test]
fn mknod_makes_regular_files_and_fifos() {
    let mut h = H::new();
    let p = h.cstr("/tmp/regular");
    assert_eq!(h.call(MKNOD, &[p, (libc::S_IFREG | 0o640) as u64, 0]), 0);
    assert!(std::fs::metadata(h.host("tmp/regular")).unwrap().is_file());
    assert_eq!(h.call(MKNOD, &[p, (libc::S_IFREG | 0o640) as u64, 0]), e(EEXIST));
    let p = h.cstr("/tmp/plain");
    assert_eq!(h.call(MKNODAT, &[libc::AT_FDCWD as u64, p, 0o600, 0]), 0);
    let f = h.cstr("/tmp/fifo");
    assert_eq!(h.call(MKNOD, &[f, (libc::S_IFIFO | 0o600) as u64, 0]), 0);
    assert!(std::os::unix::fs::FileTypeExt::is_fifo(&std::fs::metadata(h.host("tmp/fifo")).unwrap().file_type()));
    assert_eq!(h.call(MKNOD, &[f, (libc::S_IFIFO | 0o600) as u64, 0]), e(EEXIST));
    // No reader yet: a non-blocking writer gets ENXIO; a blocking one waits (restart).
    assert_eq!(h.open("/tmp/fifo", libc::O_WRONLY | libc::O_NONBLOCK, 0), e(Errno(libc::ENXIO)));
    let r = h.open("/tmp/fifo", libc::O_RDONLY, 0); // at once: its first read waits for a writer
    assert!(r >= 0, "{r}");
    let w = h.open("/tmp/fifo", libc::O_WRONLY, 0);
    assert!(w >= 0, "{w}");
    let msg = h.put(b"through the fifo");
    assert_eq!(h.call(WRITE, &[w as u64, msg, 16]), 16);
    assert_eq!(h.call(CLOSE, &[w as u64]), 0);
    assert_eq!(h.read_all(r), b"through the fifo");
    for kind in [libc::S_IFSOCK, libc::S_IFCHR, libc::S_IFBLK] {
        let p = h.cstr("/tmp/special");
        assert_eq!(h.call(MKNOD, &[p, (kind | 0o600) as u64, 0]), e(EPERM));
    }
    assert!(!h.host("tmp/special").exists());
    let p = h.cstr("/etc/fifo");
    assert_eq!(h.call(MKNOD, &[p, (libc::S_IFIFO | 0o600) as u64, 0]), e(EROFS));
    let p = h.cstr("/work/nodir/fifo");
    assert_eq!(h.call(MKNOD, &[p, (libc::S_IFIFO | 0o600) as u64, 0]), e(ENOENT));
    let p = h.cstr("/tmp/odd");
    assert_eq!(h.call(MKNOD, &[p, 0o170000, 0]), e(EINVAL));
}

/// test_os.UtimeTests.test_utime_current: "now" is the guest's clock, virtual in replay mode.
#[test]
fn utime_now_is_the_guests_now() {
    let mut h = H::new();
    let t0: u64 = 1_735_689_600 * 1_000_000_000;
    set_replay(&mut h, t0, 1_000_000_000);
    let p = h.cstr("/work/b.txt");
    assert_eq!(h.call(UTIMENSAT, &[libc::AT_FDCWD as u64, p, 0, 0]), 0);
    let st = h.stat("/work/b.txt", 0).unwrap();
    assert_eq!(st.st_mtime as u64, t0 / 1_000_000_000);
    assert_eq!(st.st_atime as u64, t0 / 1_000_000_000);
    // UTIME_NOW for one of the two, an explicit time for the other.
    let times = [0i64, libc::UTIME_NOW, 1_000_000_000, 0];
    let raw: Vec<u8> = times.iter().flat_map(|v| v.to_le_bytes()).collect();
    let tp = h.put(&raw);
    assert_eq!(h.call(UTIMENSAT, &[libc::AT_FDCWD as u64, p, tp, 0]), 0);
    let st = h.stat("/work/b.txt", 0).unwrap();
    assert_eq!((st.st_atime as u64, st.st_mtime), (t0 / 1_000_000_000, 1_000_000_000));
}

/// test_select.test_returned_list_identity: select(0, ..., 1 s) is a sleep. In replay mode it used
/// to wait forever: each slice ended with EINTR, and the retry with "the remaining time" saw a
/// virtual clock that had not moved.
#[test]
fn select_and_poll_time_out_in_virtual_time() {
    let mut h = H::new();
    set_replay(&mut h, 1_735_689_600 * 1_000_000_000, 1_000_000_000);
    let before = monotonic(&mut h);
    let tv = h.put(&[1u64.to_le_bytes(), 500_000u64.to_le_bytes()].concat());
    let start = std::time::Instant::now();
    assert_eq!(h.call(SYS_SELECT, &[0, 0, 0, 0, tv]), 0);
    assert!(start.elapsed() < std::time::Duration::from_millis(500), "select slept on the host (1.5 s)");
    let waited = monotonic(&mut h) - before;
    assert!((1_500_000_000..1_600_000_000).contains(&waited), "virtual time moved by {waited} ns");
    // A wait on a host pipe with nothing to read lets virtual time pass as it waits, until the
    // guest's timeout is reached (the guest retries EINTR with what remains, as Python does).
    let fds = h.buf(8);
    assert_eq!(h.call(PIPE2, &[fds, 0]), 0);
    let rfd = u32::from_le_bytes(h.get(fds, 4).try_into().unwrap()) as u64;
    let pfd = h.put(&[(rfd as u32).to_le_bytes(), [1, 0, 0, 0]].concat()); // POLLIN
    let deadline = monotonic(&mut h) + 300_000_000;
    let mut calls = 0;
    loop {
        let now = monotonic(&mut h);
        if now >= deadline {
            break;
        }
        let left_ms = (deadline - now).div_ceil(1_000_000);
        let r = h.call(SYS_POLL, &[pfd, 1, left_ms]);
        assert!(r == 0 || r == e(EINTR), "poll: {r}");
        calls += 1;
        assert!(calls < 20, "poll never timed out in virtual time");
        if r == 0 {
            break;
        }
    }
    assert!(monotonic(&mut h) >= deadline);
}

/// test_os.test_set_get_priority, test_posix.test_sched_priority and test_sched_rr_get_interval,
/// the POSIX scheduler API: nice 0 and SCHED_OTHER, answered rather than ENOSYS.
#[test]
fn priority_and_scheduler_calls() {
    let mut h = H::new();
    assert_eq!(h.call(SYS_GETPRIORITY, &[0, 0]), 20); // 20 - nice
    assert_eq!(h.call(SYS_SETPRIORITY, &[0, 0, 0]), 0);
    // Root may set any nice value; it is kept (bookkeeping: the host schedules the sandbox).
    assert_eq!(h.call(SYS_SETPRIORITY, &[0, 0, 5]), 0);
    assert_eq!(h.call(SYS_GETPRIORITY, &[0, 0]), 15);
    assert_eq!(h.call(SYS_SETPRIORITY, &[0, 0, (-25i64) as u64]), 0); // clamped to -20
    assert_eq!(h.call(SYS_GETPRIORITY, &[0, 0]), 40);
    assert_eq!(h.call(SYS_SETPRIORITY, &[0, 4242, 0]), e(ESRCH));
    assert_eq!(h.call(SYS_GETPRIORITY, &[7, 0]), e(EINVAL));
    assert_eq!(h.call(SYS_SCHED_GETSCHEDULER, &[0]), 0);
    assert_eq!(h.call(SYS_SCHED_GETSCHEDULER, &[-1i64 as u64]), e(EINVAL));
    assert_eq!(h.call(SYS_SCHED_GETSCHEDULER, &[0xffff_ffff]), e(EINVAL)); // pid_t -1 in a 64-bit register
    assert_eq!(h.call(SYS_SCHED_GETPARAM, &[0xffff_ffff, 0x1000_0000]), e(EINVAL));
    let b = h.put(&7i32.to_le_bytes());
    assert_eq!(h.call(SYS_SCHED_GETPARAM, &[0, b]), 0);
    assert_eq!(h.get(b, 4), 0i32.to_le_bytes());
    assert_eq!(h.call(SYS_SCHED_SETPARAM, &[0, b]), 0);
    assert_eq!(h.call(SYS_SCHED_SETSCHEDULER, &[0, 0, b]), 0);
    let rt = h.put(&10i32.to_le_bytes());
    assert_eq!(h.call(SYS_SCHED_SETSCHEDULER, &[0, 1, rt]), e(EPERM)); // SCHED_FIFO
    assert_eq!(h.call(SYS_SCHED_SETPARAM, &[0, rt]), e(EINVAL)); // SCHED_OTHER takes 0 only
    assert_eq!(h.call(SYS_SCHED_GET_PRIORITY_MAX, &[1]), 99);
    assert_eq!(h.call(SYS_SCHED_GET_PRIORITY_MIN, &[1]), 1);
    assert_eq!(h.call(SYS_SCHED_GET_PRIORITY_MAX, &[0]), 0);
    assert_eq!(h.call(SYS_SCHED_GET_PRIORITY_MIN, &[42]), e(EINVAL));
    let ts = h.buf(16);
    assert_eq!(h.call(SYS_SCHED_RR_GET_INTERVAL, &[0, ts]), 0);
}

/// test_time.test_clock_settime (EPERM, not ENOSYS) and test_pthread_getcpuclockid (a CPU clock
/// named by the process's own guest pid).
#[test]
fn clocks_cannot_be_set_and_own_cpu_clocks_read() {
    let mut h = H::new();
    let ts = h.put(&[0u64.to_le_bytes(), 0u64.to_le_bytes()].concat());
    assert_eq!(h.call(SYS_CLOCK_SETTIME, &[libc::CLOCK_REALTIME as u64, ts]), e(EPERM));
    assert_eq!(h.call(SYS_CLOCK_SETTIME, &[libc::CLOCK_MONOTONIC as u64, ts]), e(EINVAL));
    assert_eq!(h.call(SYS_SETTIMEOFDAY, &[ts, 0]), e(EPERM));
    h.os.proc.pid = 4242;
    let thread_clock = ((!4242i32) << 3) | 4 | 2; // MAKE_THREAD_CPUCLOCK(4242, CPUCLOCK_SCHED)
    let b = h.buf(16);
    assert_eq!(h.call(SYS_CLOCK_GETTIME, &[thread_clock as i64 as u64, b]), 0);
    let other = ((!4243i32) << 3) | 4 | 2;
    assert_eq!(h.call(SYS_CLOCK_GETTIME, &[other as i64 as u64, b]), e(EINVAL));
}

/// A write bigger than MAX_IO (16 MiB) is written whole, as Linux does, not cut short: CPython's
/// unbuffered `sys.stdout.buffer.write(b"x" * (17 << 20))` (python3 -u) lost its last MiB.
#[test]
fn writes_bigger_than_max_io_are_whole() {
    let mut h = H::new();
    const BIG: u64 = 0x3000_0000;
    let len = MAX_IO + (1 << 20) + 123;
    h.aspace.map_fresh(&mut h.mem, &mut h.frames, BIG, (len as u64).div_ceil(4096) * 4096, PTE_U | PTE_W).unwrap();
    let data: Vec<u8> = (0..len).map(|i| (i % 251) as u8).collect();
    h.aspace.write_virt(&mut h.mem, BIG, &data, true).unwrap();
    let fd = h.open("/tmp/big", libc::O_CREAT | libc::O_WRONLY, 0o644);
    assert_eq!(h.call(WRITE, &[fd as u64, BIG, len as u64]), len as i64);
    assert_eq!(std::fs::read(h.host("tmp/big")).unwrap(), data);
    // pwrite at an offset, in pieces too.
    assert_eq!(h.call(PWRITE64, &[fd as u64, BIG, len as u64, 10]), len as i64);
    let back = std::fs::read(h.host("tmp/big")).unwrap();
    assert_eq!((back.len(), &back[..10], &back[10..]), (len + 10, &data[..10], &data[..]));
    // A fault part way returns what was written before it.
    assert_eq!(h.call(WRITE, &[fd as u64, BIG + (len as u64).div_ceil(4096) * 4096 - MAX_IO as u64, 2 * MAX_IO as u64]), MAX_IO as i64);
    assert_eq!(h.call(WRITE, &[fd as u64, UNMAPPED, 10]), e(EFAULT));
}

/// test_os.test_openpty, pty.fork: /dev/ptmx gives a host pty (its line discipline included),
/// unlocked and reached through TIOCGPTPEER or /dev/pts/N; a pty is reachable by name, and listed,
/// only while the process holds it; terminal ioctls pass through, other files are not terminals.
#[test]
fn ptys_are_host_terminals_held_by_the_guest() {
    const TCGETS: u64 = 0x5401;
    const TIOCGPTN: u64 = 0x8004_5430;
    const TIOCSPTLCK: u64 = 0x4004_5431;
    const TIOCGPTPEER: u64 = 0x5441;
    const TIOCSWINSZ: u64 = 0x5414;
    const TIOCGWINSZ: u64 = 0x5413;
    const TIOCGPGRP: u64 = 0x540f;
    let mut h = H::new();
    let master = h.open("/dev/ptmx", libc::O_RDWR | libc::O_NOCTTY, 0);
    assert!(master >= 0, "open /dev/ptmx: {master}");
    let m = master as u64;
    let b = h.buf(64);
    let zero = h.put(&0i32.to_le_bytes());
    assert_eq!(h.call(IOCTL, &[m, TIOCSPTLCK, zero]), 0);
    assert_eq!(h.call(IOCTL, &[m, TIOCGPTN, b]), 0);
    let n = u32::from_le_bytes(h.get(b, 4).try_into().unwrap());
    let pts = format!("/dev/pts/{n}");
    let names = {
        let d = h.open("/dev/pts", libc::O_RDONLY | libc::O_DIRECTORY, 0);
        h.list(d).into_iter().map(|(name, _)| name).collect::<Vec<_>>()
    };
    assert!(names.contains(&n.to_string()), "{names:?}");
    let slave = h.call(IOCTL, &[m, TIOCGPTPEER, (libc::O_RDWR | libc::O_NOCTTY) as u64]);
    assert!(slave >= 0, "TIOCGPTPEER: {slave}");
    let by_name = h.open(&pts, libc::O_RDWR | libc::O_NOCTTY, 0);
    assert!(by_name >= 0, "open {pts}: {by_name}");
    assert_eq!(h.stat(&pts, 0).map(|st| st.st_mode & libc::S_IFMT), Ok(libc::S_IFCHR));
    // Both ends are terminals (isatty), with the host's line discipline: "\n" goes out as "\r\n".
    assert_eq!(h.call(IOCTL, &[slave as u64, TCGETS, b]), 0);
    assert_eq!(h.call(IOCTL, &[m, TCGETS, b]), 0);
    let ws = h.put(&[24, 0, 80, 0, 0, 0, 0, 0]);
    assert_eq!(h.call(IOCTL, &[slave as u64, TIOCSWINSZ, ws]), 0);
    assert_eq!(h.call(IOCTL, &[m, TIOCGWINSZ, b]), 0);
    assert_eq!(h.get(b, 4), [24, 0, 80, 0]);
    assert_eq!(h.call(IOCTL, &[slave as u64, TIOCGPGRP, b]), e(ENOTTY));
    assert_eq!(h.write(slave, b"hi\n"), 3);
    let got = h.buf(16);
    assert_eq!(h.call(READ, &[m, got, 16]), 4);
    assert_eq!(h.get(got, 4), b"hi\r\n");
    assert_eq!(h.write(master, b"ok\n"), 3);
    assert_eq!(h.call(READ, &[by_name as u64, got, 16]), 3);
    assert_eq!(h.get(got, 3), b"ok\n");
    // Not a terminal: a regular file.
    let file = h.open("/work/b.txt", libc::O_RDONLY, 0);
    assert_eq!(h.call(IOCTL, &[file as u64, TCGETS, b]), e(ENOTTY));
    // Released: the name is gone for this process (another sandbox's pty is never reachable).
    for fd in [master, slave, by_name] {
        assert_eq!(h.call(CLOSE, &[fd as u64]), 0);
    }
    assert_eq!(h.open(&pts, libc::O_RDWR, 0), e(ENOENT));
    assert_eq!(h.stat(&pts, 0).err(), Some(e(ENOENT)));
}

/// test_mmap's LargeMmapTests map whole sparse files far larger than the sandbox's memory (lazy file
/// mappings, longer than `mm::LAZY_MAP_MIN`). write(2) from and read(2) into such a mapping's pages
/// that were never touched work as on Linux: the file's bytes go out, the data read lands.
#[test]
fn syscall_buffers_in_lazy_file_mappings() {
    use crate::guestos::mm::{LAZY_MAP_MIN, MAP_PRIVATE, PROT_READ, PROT_WRITE, SYS_MMAP, SYS_MUNMAP};
    use std::os::unix::fs::FileExt;
    let mut h = H::new();
    let len = LAZY_MAP_MIN + (16 << 20);
    let f = std::fs::File::create(h.host("tmp/sparse")).unwrap();
    f.set_len(len).unwrap();
    f.write_all_at(b"the tail", len - 8).unwrap();
    let fd = h.open("/tmp/sparse", libc::O_RDONLY, 0);
    let before = h.frames.available();
    let a = h.call(SYS_MMAP, &[0, len, (PROT_READ | PROT_WRITE) as u64, MAP_PRIVATE as u64, fd as u64, 0]);
    assert!(a > 0, "mmap: {a}");
    let a = a as u64;
    assert_eq!(before, h.frames.available(), "a lazy mapping takes no frames");
    // The mapping keeps a descriptor of its own.
    assert_eq!(h.call(CLOSE, &[fd as u64]), 0);
    // write(2) from pages without frames sends the file's bytes and takes no frames.
    let out = h.open("/tmp/out", libc::O_CREAT | libc::O_WRONLY, 0o644) as u64;
    assert_eq!(h.call(WRITE, &[out, a + len - 8192, 8192]), 8192);
    let back = std::fs::read(h.host("tmp/out")).unwrap();
    assert_eq!((&back[..8184], &back[8184..]), (&[0u8; 8184][..], &b"the tail"[..]));
    assert_eq!(before, h.frames.available());
    // read(2) into one reads the page in, then the data lands there (the file stays as it was).
    let src = h.open("/work/b.txt", libc::O_RDONLY, 0) as u64;
    assert_eq!(h.call(READ, &[src, a + (20 << 20) + 10, 5]), 5);
    assert_eq!(h.get(a + (20 << 20) + 5, 12), b"\0\0\0\0\0bravo\0\0");
    assert!(before > h.frames.available());
    assert_eq!(f.metadata().unwrap().len(), len);
    // Past the end of the mapping: EFAULT, as before.
    assert_eq!(h.call(WRITE, &[out, a + len - 8, 16]), e(EFAULT));
    assert_eq!(h.call(SYS_MUNMAP, &[a, len]), 0);
    assert_eq!(h.call(WRITE, &[out, a + len - 8, 8]), e(EFAULT));
}
