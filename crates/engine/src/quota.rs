//! A sandbox's disk quota and its shared-memory limit: two tmpfs instances of its own, made by the
//! controller and never attached anywhere.
//!
//! A sandbox's writable mounts (`/tmp`, `/work`, ...) are the directories `m0`, `m1`, ... of one
//! tmpfs of its own (its disk quota); /dev/shm, its shared anonymous memory and its guest memfds
//! are in a second one, its shared-memory pool ([`SHARED_MEMORY`]): shared memory is memory, and
//! a full /tmp must not stop `multiprocessing.Lock()`. Each is created with `fsopen("tmpfs")` + `fsconfig(size, nr_inodes)` +
//! `fsmount` (the new mount API) by the controller, which runs in the host's mount namespace, and
//! handed to the VMM process as a descriptor. The tmpfs is a *detached* mount: it appears in no
//! mount table, the VMM reaches it only through that descriptor (and the directory descriptors it
//! opens beneath it), and the kernel frees it, and every page it holds, when the last descriptor and
//! the last open file in it close. So:
//! - Past its quota a guest write fails with ENOSPC (bytes or inodes) exactly as on Linux, enforced by
//!   the kernel; the host and the other sandboxes are unaffected.
//! - The host never holds more than the quotas of the live sandboxes: a destroyed or killed sandbox's
//!   space goes back when its processes are gone, with no cleanup step that could be skipped.
//! - The VMM process needs no mount syscalls: its seccomp filter allows none.
//!
//! Why not one directory per sandbox on a shared tmpfs (as before) with the engine counting bytes:
//! every write, truncate, fallocate, link, rename and shared-mapping write-back would need an exact
//! account, and an unlinked file that is still open keeps its space; the kernel already does all of
//! that for a tmpfs. Why not a mounted tmpfs per sandbox: a mount attached in a namespace outlives a
//! killed process unless somebody unmounts it.
//!
//! The VMM keeps a small stock of these descriptors (the controller sends them with
//! [`crate::protocol::Request::AddScratch`] ahead of a fork or a spare pool); each new sandbox takes
//! one and sends it back to the controller with its `Ready`, so the controller can read the usage
//! ([`Scratch::usage`]) and change the quota of a live sandbox ([`Scratch::resize`]).

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use crate::error::{Error, Result};

/// The quota of a sandbox's writable mounts together.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct DiskQuota {
    /// Bytes of file data (tmpfs `size`, rounded up to pages by the kernel).
    pub bytes: u64,
    /// Files, directories and symlinks (tmpfs `nr_inodes`; the root directory is one).
    pub inodes: u64,
}

/// Default quota of a sandbox: 1 GiB and 65,536 inodes.
pub const DEFAULT_QUOTA: DiskQuota = DiskQuota { bytes: 1 << 30, inodes: 65536 };

/// The smallest quota accepted: room for a template's writable mounts and a little more.
pub const MIN_QUOTA: DiskQuota = DiskQuota { bytes: 1 << 20, inodes: 64 };

/// A sandbox's default shared-memory limit: the size of its shared-memory pool, a second tmpfs of
/// its own that holds its shared anonymous mappings (`mmap(MAP_SHARED|MAP_ANONYMOUS)`, Python's
/// `mmap.mmap(-1, n)`), its guest memfds and its /dev/shm (`vstate::shared::pool`). Half of the
/// sandbox's 1 GiB of guest memory, as Linux sizes /dev/shm by default at half of RAM. Past it a
/// mapping larger than what is left gets ENOMEM, a write ENOSPC and a touch of a page of a mapping
/// SIGBUS, all from the kernel's tmpfs accounting, and the exec's result names the limit. A
/// sandbox may have another size ([`shared_memory`], `controller::Vm::set_shared_memory`).
pub const SHARED_MEMORY: DiskQuota = DiskQuota { bytes: 512 << 20, inodes: SHARED_MEMORY_INODES };

/// Files a shared-memory pool holds at most (each shared mapping, memfd and /dev/shm file is one),
/// whatever its size.
pub const SHARED_MEMORY_INODES: u64 = 16384;

/// The smallest shared-memory limit accepted: a few POSIX semaphores and a small `multiprocessing`
/// pool fit in 1 MiB.
pub const MIN_SHARED_MEMORY: u64 = 1 << 20;

/// The pool of a sandbox whose shared-memory limit is `bytes`; a limit below
/// [`MIN_SHARED_MEMORY`] is refused, saying what is accepted.
pub fn shared_memory(bytes: u64) -> Result<DiskQuota> {
    if bytes < MIN_SHARED_MEMORY {
        return Err(Error::InvalidArgument(format!(
            "shared-memory limit of {bytes} bytes; give at least {MIN_SHARED_MEMORY} bytes (1 MiB)"
        )));
    }
    Ok(DiskQuota { bytes, inodes: SHARED_MEMORY_INODES })
}

/// What a sandbox's writable mounts hold now.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Default)]
pub struct DiskUsage {
    pub bytes: u64,
    pub inodes: u64,
    pub quota_bytes: u64,
    pub quota_inodes: u64,
}

// The new mount API's constants (include/uapi/linux/mount.h).
const FSOPEN_CLOEXEC: u32 = 0x1;
const FSCONFIG_SET_STRING: u32 = 1;
const FSCONFIG_CMD_CREATE: u32 = 6;
const FSCONFIG_CMD_RECONFIGURE: u32 = 7;
const FSMOUNT_CLOEXEC: u32 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;
const FSPICK_CLOEXEC: u32 = 0x1;
const FSPICK_EMPTY_PATH: u32 = 0x8;

/// A detached tmpfs: the root of one sandbox's writable mounts.
#[derive(Debug)]
pub struct Scratch(pub OwnedFd);

fn fd_result(rc: libc::c_long, op: &'static str) -> Result<OwnedFd> {
    if rc < 0 {
        return Err(Error::Sys { op, source: std::io::Error::last_os_error() });
    }
    // SAFETY: a descriptor the kernel just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

/// `fsconfig(fd, FSCONFIG_SET_STRING, key, value)`.
fn set_string(fs: &OwnedFd, key: &str, value: &str) -> std::io::Result<()> {
    let (k, v) = (CString::new(key)?, CString::new(value)?);
    // SAFETY: valid C strings; the context descriptor is ours.
    let rc = unsafe { libc::syscall(libc::SYS_fsconfig, fs.as_raw_fd(), FSCONFIG_SET_STRING, k.as_ptr(), v.as_ptr(), 0) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn command(fs: &OwnedFd, cmd: u32) -> std::io::Result<()> {
    // SAFETY: a command without key or value on our own context descriptor.
    let rc = unsafe { libc::syscall(libc::SYS_fsconfig, fs.as_raw_fd(), cmd, std::ptr::null::<u8>(), std::ptr::null::<u8>(), 0) };
    if rc < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// Refuse a quota below [`MIN_QUOTA`], saying what is accepted.
pub fn check(q: DiskQuota) -> Result<()> {
    if q.bytes < MIN_QUOTA.bytes || q.inodes < MIN_QUOTA.inodes {
        return Err(Error::InvalidArgument(format!(
            "disk quota of {} bytes and {} inodes; give at least {} bytes and {} inodes",
            q.bytes, q.inodes, MIN_QUOTA.bytes, MIN_QUOTA.inodes
        )));
    }
    Ok(())
}

impl Scratch {
    /// A new, empty tmpfs of quota `q` (mode 0755, owned by root; nosuid, nodev, noexec).
    /// Needs CAP_SYS_ADMIN (EPERM otherwise: the caller then runs sandboxes without a quota).
    pub fn new(q: DiskQuota) -> Result<Scratch> {
        Scratch::with_exec(q, false)
    }

    /// [`Scratch::new`], without `noexec` when `exec`: for a systrap sandbox, whose stub maps the
    /// guest's program files executable (a program built or copied into /work runs there, as on
    /// kvm, where the VMM loads programs itself and `noexec` costs the guest nothing). The host
    /// never executes what is there either way: the VMM's seccomp filter has no execve.
    pub fn with_exec(q: DiskQuota, exec: bool) -> Result<Scratch> {
        check(q)?;
        let name = c"tmpfs";
        // SAFETY: a valid C string; the result is checked.
        let fs = fd_result(unsafe { libc::syscall(libc::SYS_fsopen, name.as_ptr(), FSOPEN_CLOEXEC) }, "fsopen(tmpfs)")?;
        let configure = || -> std::io::Result<()> {
            set_string(&fs, "size", &q.bytes.to_string())?;
            set_string(&fs, "nr_inodes", &q.inodes.to_string())?;
            set_string(&fs, "mode", "0755")?;
            command(&fs, FSCONFIG_CMD_CREATE)
        };
        configure().map_err(Error::sys("configure a sandbox's tmpfs"))?;
        let attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | if exec { 0 } else { MOUNT_ATTR_NOEXEC };
        // SAFETY: our context descriptor; the result is checked.
        let mnt = fd_result(unsafe { libc::syscall(libc::SYS_fsmount, fs.as_raw_fd(), FSMOUNT_CLOEXEC, attrs) }, "fsmount(tmpfs)")?;
        Ok(Scratch(mnt))
    }

    /// What the tmpfs holds and its limits.
    pub fn usage(&self) -> Result<DiskUsage> {
        usage_of(&self.0)
    }

    /// Whether the empty file `name` is in the tmpfs's root; it is removed (a marker the sandbox's
    /// VMM processes leave, such as `vstate::shared::LIMIT_MARKER`).
    pub fn take_marker(&self, name: &std::ffi::CStr) -> bool {
        // SAFETY: unlinkat relative to the tmpfs root we hold, with a valid C string.
        unsafe { libc::unlinkat(self.0.as_raw_fd(), name.as_ptr(), 0) == 0 }
    }

    /// Change the quota of the live tmpfs. A quota below what it already holds is refused.
    pub fn resize(&self, q: DiskQuota) -> Result<()> {
        check(q)?;
        self.reconfigure(q).map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                let used = self.usage().unwrap_or_default();
                Error::InvalidArgument(format!(
                    "disk quota of {} bytes and {} inodes is below what the sandbox holds ({} bytes, {} inodes); \
                     free space in it first or give a larger quota",
                    q.bytes, q.inodes, used.bytes, used.inodes
                ))
            } else {
                Error::Sys { op: "reconfigure a sandbox's tmpfs", source: e }
            }
        })
    }

    /// Change the size of a live shared-memory pool to `bytes` ([`shared_memory`]). A size below
    /// what the sandbox's shared memory already holds is refused.
    pub fn resize_pool(&self, bytes: u64) -> Result<()> {
        let q = shared_memory(bytes)?;
        self.reconfigure(q).map_err(|e| {
            if e.raw_os_error() == Some(libc::EINVAL) {
                let used = self.usage().unwrap_or_default();
                Error::InvalidArgument(format!(
                    "shared-memory limit of {bytes} bytes is below what the sandbox's shared memory holds ({} bytes \
                     in /dev/shm, shared mappings and memfds); free some first or give a larger limit",
                    used.bytes
                ))
            } else {
                Error::Sys { op: "reconfigure a sandbox's shared-memory pool", source: e }
            }
        })
    }

    /// `fsconfig` the tmpfs's size and inodes anew (EINVAL: below what it holds).
    fn reconfigure(&self, q: DiskQuota) -> std::io::Result<()> {
        let empty = c"";
        // SAFETY: picks the superblock of the mount our descriptor names; the result is checked.
        let rc = unsafe { libc::syscall(libc::SYS_fspick, self.0.as_raw_fd(), empty.as_ptr(), FSPICK_EMPTY_PATH | FSPICK_CLOEXEC) };
        if rc < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a descriptor the kernel just returned to us.
        let fs = unsafe { OwnedFd::from_raw_fd(rc as i32) };
        set_string(&fs, "size", &q.bytes.to_string())?;
        set_string(&fs, "nr_inodes", &q.inodes.to_string())?;
        command(&fs, FSCONFIG_CMD_RECONFIGURE)
    }
}

/// The usage of the file system `fd` lies on (a tmpfs: its limits are its quota).
pub fn usage_of(fd: &OwnedFd) -> Result<DiskUsage> {
    // SAFETY: a plain C struct, for which all zeroes is a valid value.
    let mut s: libc::statfs = unsafe { std::mem::zeroed() };
    // SAFETY: fstatfs fills the struct we pass; the descriptor is ours.
    if unsafe { libc::fstatfs(fd.as_raw_fd(), &mut s) } != 0 {
        return Err(Error::last_os("fstatfs(sandbox tmpfs)"));
    }
    let bsize = s.f_bsize as u64;
    Ok(DiskUsage {
        bytes: (s.f_blocks - s.f_bfree) * bsize,
        inodes: s.f_files - s.f_ffree,
        quota_bytes: s.f_blocks * bsize,
        quota_inodes: s.f_files,
    })
}

/// Whether this process gives sandboxes tmpfs instances: it may make them (asked once; the answer
/// does not change), and `COLLIMATE_QUOTA=0` does not turn them off (for comparisons; sandboxes
/// then keep their files in the runtime directory with only the per-file size limit).
pub fn available() -> bool {
    static OK: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OK.get_or_init(|| std::env::var_os("COLLIMATE_QUOTA").is_none_or(|v| v != "0") && Scratch::new(MIN_QUOTA).is_ok())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Write;

    fn file_in(s: &Scratch, name: &str) -> std::fs::File {
        let c = CString::new(name).unwrap();
        // SAFETY: a valid C string, relative to the tmpfs root we hold.
        let fd = unsafe { libc::openat(s.0.as_raw_fd(), c.as_ptr(), libc::O_WRONLY | libc::O_CREAT | libc::O_CLOEXEC, 0o644) };
        assert!(fd >= 0, "openat: {}", std::io::Error::last_os_error());
        // SAFETY: fresh descriptor.
        unsafe { std::fs::File::from_raw_fd(fd) }
    }

    #[test]
    fn a_write_past_the_quota_is_enospc_and_resize_lets_it_through() {
        if !available() {
            eprintln!("skipped: no CAP_SYS_ADMIN for tmpfs instances");
            return;
        }
        let s = Scratch::new(DiskQuota { bytes: 2 << 20, inodes: 128 }).unwrap();
        let before = s.usage().unwrap();
        assert_eq!(before.quota_bytes, 2 << 20);
        assert_eq!(before.quota_inodes, 128);
        let mut f = file_in(&s, "big");
        let chunk = vec![7u8; 64 << 10];
        let mut written = 0usize;
        let err = loop {
            match f.write(&chunk) {
                Ok(n) => written += n,
                Err(e) => break e,
            }
            assert!(written <= 3 << 20, "wrote past the quota");
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        assert!(written >= (2 << 20) - (64 << 10), "stopped early at {written}");
        let used = s.usage().unwrap();
        assert_eq!(used.bytes, 2 << 20);
        // Shrinking below what it holds is refused with a clear error; growing lets writes go on.
        assert!(matches!(s.resize(DiskQuota { bytes: 1 << 20, inodes: 128 }), Err(Error::InvalidArgument(_))));
        s.resize(DiskQuota { bytes: 4 << 20, inodes: 128 }).unwrap();
        f.write_all(&chunk).unwrap();
        assert_eq!(s.usage().unwrap().quota_bytes, 4 << 20);
    }

    #[test]
    fn inodes_run_out_with_enospc() {
        if !available() {
            return;
        }
        let s = Scratch::new(DiskQuota { bytes: 1 << 20, inodes: 64 }).unwrap();
        let mut made = 0;
        let err = loop {
            let c = CString::new(format!("d{made}")).unwrap();
            // SAFETY: a valid C string relative to our tmpfs root.
            if unsafe { libc::mkdirat(s.0.as_raw_fd(), c.as_ptr(), 0o755) } != 0 {
                break std::io::Error::last_os_error();
            }
            made += 1;
            assert!(made <= 64);
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        assert_eq!(made, 63, "the root directory is the 64th inode");
    }

    #[test]
    fn a_pool_of_its_own_size_refuses_a_size_below_what_it_holds_and_below_1_mib() {
        let e = shared_memory(4096).unwrap_err().to_string();
        assert!(e.contains("give at least 1048576 bytes"), "{e}");
        if !available() {
            return;
        }
        let pool = Scratch::new(shared_memory(2 << 20).unwrap()).unwrap();
        assert_eq!(pool.usage().unwrap().quota_bytes, 2 << 20);
        file_in(&pool, "held").write_all(&vec![1u8; 3 << 19]).unwrap(); // 1.5 MiB
        let e = pool.resize_pool(1 << 20).unwrap_err().to_string();
        assert!(e.contains("below what the sandbox's shared memory holds") && e.contains("free some first"), "{e}");
        pool.resize_pool(4 << 20).unwrap();
        assert_eq!(pool.usage().unwrap().quota_bytes, 4 << 20);
        assert_eq!(pool.usage().unwrap().quota_inodes, SHARED_MEMORY_INODES);
    }

    #[test]
    fn a_quota_below_the_minimum_is_refused() {
        assert!(matches!(Scratch::new(DiskQuota { bytes: 4096, inodes: 64 }), Err(Error::InvalidArgument(_))));
    }
}
