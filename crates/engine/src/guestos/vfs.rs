//! Guest paths resolved inside the sandbox's file system, never outside it.
//!
//! The sandbox sees a read-only root (the template's root filesystem) plus writable directories
//! mounted at guest paths (`/tmp`, `/work`). Every lookup is a host `openat2` with `RESOLVE_IN_ROOT`
//! from the directory fd of the mount that holds the path: `..` stops at that root and absolute
//! symlinks are taken relative to it, so no guest path can name a host file outside the sandbox.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use super::{Errno, EINVAL, ENAMETOOLONG, EROFS};

/// A host directory that appears at a guest path.
pub struct Mount {
    /// Normalised guest path without a trailing slash ("/" for the root).
    pub at: String,
    pub dir: OwnedFd,
    pub writable: bool,
}

/// The sandbox's file system view.
#[derive(Default)]
pub struct Vfs {
    /// Longest `at` first, so lookups pick the innermost mount.
    pub mounts: Vec<Mount>,
}

/// Join `path` onto `base` (both guest paths) and drop `.` and empty components. `..` is kept: the
/// kernel resolves it (with symlinks) inside the mount's root.
pub fn join(base: &str, path: &[u8]) -> Result<String, Errno> {
    let path = std::str::from_utf8(path).map_err(|_| EINVAL)?;
    if path.len() > 4095 {
        return Err(ENAMETOOLONG);
    }
    let full = if path.starts_with('/') { path.to_string() } else { format!("{base}/{path}") };
    let parts: Vec<&str> = full.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
    Ok(format!("/{}", parts.join("/")))
}

fn open_dir(host: &Path) -> std::io::Result<OwnedFd> {
    let c = CString::new(host.as_os_str().as_encoded_bytes()).map_err(|_| std::io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a valid C string; the result is checked.
    let fd = unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

impl Vfs {
    /// A view whose root is the host directory `root` (read-only).
    pub fn new(root: &Path) -> std::io::Result<Vfs> {
        let mut v = Vfs::default();
        v.mounts.push(Mount { at: "/".into(), dir: open_dir(root)?, writable: false });
        Ok(v)
    }

    /// Make host directory `host` appear at guest path `at`.
    pub fn mount(&mut self, at: &str, host: &Path, writable: bool) -> std::io::Result<()> {
        let at = join("/", at.as_bytes()).map_err(|e| std::io::Error::from_raw_os_error(e.0))?;
        self.mounts.push(Mount { at, dir: open_dir(host)?, writable });
        self.mounts.sort_by(|a, b| b.at.len().cmp(&a.at.len()));
        Ok(())
    }

    /// The mount holding the normalised guest path `abs`, and the path relative to that mount.
    pub fn locate<'a>(&'a self, abs: &'a str) -> (&'a Mount, &'a str) {
        for m in &self.mounts {
            if m.at == "/" {
                return (m, abs.trim_start_matches('/'));
            }
            if abs == m.at {
                return (m, "");
            }
            if abs.len() > m.at.len() && abs.starts_with(&m.at) && abs.as_bytes()[m.at.len()] == b'/' {
                return (m, &abs[m.at.len() + 1..]);
            }
        }
        // A Vfs always has a root mount; an empty one resolves nothing.
        (&self.mounts[self.mounts.len() - 1], abs)
    }

    /// Open guest path `path` (relative to guest directory `cwd`) with open(2) `flags` and `mode`.
    /// Writes (and O_CREAT) on a read-only mount fail with EROFS.
    pub fn open(&self, cwd: &str, path: &[u8], flags: i32, mode: u32) -> Result<OwnedFd, Errno> {
        let abs = join(cwd, path)?;
        let (m, rel) = self.locate(&abs);
        let wants_write = flags & (libc::O_WRONLY | libc::O_RDWR | libc::O_CREAT | libc::O_TRUNC) != 0;
        if wants_write && !m.writable {
            return Err(EROFS);
        }
        openat2_in_root(m.dir.as_raw_fd(), if rel.is_empty() { "." } else { rel }, flags | libc::O_CLOEXEC, mode)
    }
}

/// `openat2(dirfd, path, {flags, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS})`.
pub fn openat2_in_root(dirfd: RawFd, path: &str, flags: i32, mode: u32) -> Result<OwnedFd, Errno> {
    let c = CString::new(path).map_err(|_| EINVAL)?;
    // SAFETY: open_how is plain data; all-zero is valid and we fill every field.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    how.flags = flags as u64;
    how.mode = if flags & (libc::O_CREAT | libc::O_TMPFILE) != 0 { mode as u64 } else { 0 };
    how.resolve = libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS;
    // SAFETY: openat2 with a valid C string and a properly sized open_how; the result is checked.
    let fd = unsafe {
        libc::syscall(libc::SYS_openat2, dirfd, c.as_ptr(), &how as *const libc::open_how, std::mem::size_of::<libc::open_how>())
    };
    if fd < 0 {
        return Err(Errno::last());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd as RawFd) })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn join_normalises() {
        assert_eq!(join("/usr", b"lib/../bin").unwrap(), "/usr/lib/../bin");
        assert_eq!(join("/usr", b"/etc//passwd").unwrap(), "/etc/passwd");
        assert_eq!(join("/", b".").unwrap(), "/");
    }

    #[test]
    fn paths_cannot_leave_the_root() {
        let d = std::env::temp_dir().join(format!("vfs-{}", std::process::id()));
        std::fs::create_dir_all(d.join("root/etc")).unwrap();
        std::fs::write(d.join("root/etc/hostname"), "sandbox").unwrap();
        std::fs::write(d.join("secret"), "host").unwrap();
        std::os::unix::fs::symlink("/../../secret", d.join("root/etc/link")).unwrap();
        let v = Vfs::new(&d.join("root")).unwrap();
        assert!(v.open("/", b"/etc/hostname", libc::O_RDONLY, 0).is_ok());
        assert!(v.open("/etc", b"../../../secret", libc::O_RDONLY, 0).is_err());
        assert!(v.open("/", b"/etc/link", libc::O_RDONLY, 0).is_err());
        assert_eq!(v.open("/", b"/etc/new", libc::O_CREAT | libc::O_WRONLY, 0o644).unwrap_err(), EROFS);
        std::fs::remove_dir_all(&d).unwrap();
    }
}
