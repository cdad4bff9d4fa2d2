//! A writable root for a sandbox: the host kernel's overlayfs over the image's root filesystem,
//! its upper layer on the sandbox's own disk-quota tmpfs (`crate::quota`).
//!
//! [`mount_root`] makes a *detached* overlay mount (`fsconfig` + `fsmount` on an overlay context
//! from [`context`], as the quota's tmpfs is made): the lower layer is the image's root directory
//! (read-only, never written: the kernel copies a file up before its first write), the upper and
//! work directories are [`UPPER`] and [`WORK`] on the sandbox's tmpfs, handed to overlayfs as
//! descriptors (`FSCONFIG_SET_FD`), since that tmpfs has no path anywhere. What the host kernel
//! then does, with no lookup code of ours: copy-up on write, chmod, chown, truncate or rename of an
//! image file; whiteouts for deleted image files (a 0/0 character device in the upper layer; the
//! image keeps the file); opaque directories; merged directory listings. Every byte and inode
//! copied up or created counts against the sandbox's quota (past it: ENOSPC, as for /work).
//!
//! Options: `userxattr` (overlayfs's own markers, such as an opaque directory's, are `user.overlay.*`
//! extended attributes, which a copy of the upper layer can carry without CAP_SYS_ADMIN; it also
//! rules out redirects, and the kernel refuses an explicit `redirect_dir` with it), no `index` and
//! no `metacopy` (an upper layer is then a plain tree of whole files,
//! whiteouts and markers: copied to a fork's tmpfs or a snapshot's `fs/`, it means the same over
//! the same image). Mount attributes `nosuid,nodev,noexec`, as every jail mount (the engine loads
//! guest programs itself; the host never executes them); on systrap without `noexec`, as that
//! VMM's bind mounts ([`allow_exec`]: its stub maps program files executable).
//!
//! Why the host's overlayfs and not a copy-up in `guestos::vfs`: the walk would have to look in the
//! upper layer before the image at every component, merge `getdents` of two directories, record
//! and honour deletions, and copy up on every kind of write (open for write, truncate, chmod,
//! rename, link, xattrs, a shared writable mapping); overlayfs does all of it, and the `Vfs` keeps
//! its single walk over one directory tree: while mounted, the root `Mount` is the merged view and
//! writable, and `Vfs::root_layer` holds the image's directory and the upper layer's.
//!
//! Why the context and the mount are split: the jailed VMM may not call `fsopen` (its argument, a
//! file system type by name, is a string its seccomp filter cannot check: allowing it would allow
//! a new procfs or sysfs), but `fsconfig` and `fsmount` on a context it was handed reach only what
//! its mount namespace already shows it (the jail allows those two, `fsmount` only with
//! `nosuid,nodev,noexec`). So the controller makes the contexts.
//!
//! The wiring (who mounts what, when):
//! - A template's zygote is told `Request::WritableRoot { on: true }` (`Vm::set_writable_root`;
//!   the SDK does it for a template whose `template.json` says `writable_root`, the default for
//!   image bakes). From then on the controller sends an overlay context with each fork's tmpfs
//!   pair (`Fork`, `SparePool`, `AddScratch` carry threes), and each forked sandbox's controller
//!   handle inherits the setting, so its own forks and resets get contexts too.
//! - A forked child (`persist::privatize`) copies its parent's upper layer (a zygote's: the
//!   snapshot's `fs/root`; a live sandbox's: its tmpfs's [`UPPER`]) into its own tmpfs, then mounts
//!   its own overlay over it, before anything looks through it (overlayfs caches what it looked up:
//!   an upper layer must not change under a mount in use). Files the parent had open on its root
//!   are reopened on the child's. The mount is eager, at the fork, not at the first write: a
//!   sandbox's processes are host forks of one another that share the one mount, and a lazy mount
//!   in one would not reach the others.
//! - A reset (`Request::Reset`, with a fresh context: one mounts once, and the old mount's cached
//!   lookups must not outlive an emptied upper layer) drops the old overlay, empties the upper
//!   layer, copies the template's into it and mounts again; `ResetKeepFiles` keeps the mount.
//! - A snapshot (a bake) copies the upper layer into its `fs/root` (present, even empty, whenever
//!   the root is writable); a restore from it starts with that layer.
//!
//! Cost: one-off probe on kvm_pvm's host kernel (6.18, 2 cores shared with other work, a loop of
//! 200): a detached tmpfs made and dropped in 0.2 to 1.9 ms, an overlay over it 0.4 to 3 ms more,
//! an unused overlay context 0.2 ms. The SDK-level cost (enter + exec + exit, forks) is measured
//! by benches/bench_writable_root.py and given in docs/templates.md.

use std::ffi::CStr;
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::sync::atomic::{AtomicBool, Ordering};

use crate::error::{Error, Result};

// The new mount API's constants (include/uapi/linux/mount.h) not in `libc` for every target.
const FSOPEN_CLOEXEC: u32 = 0x1;
const FSCONFIG_SET_FLAG: u32 = 0;
const FSCONFIG_SET_STRING: u32 = 1;
const FSCONFIG_SET_FD: u32 = 5;
const FSCONFIG_CMD_CREATE: u32 = 6;
const FSMOUNT_CLOEXEC: u32 = 0x1;
const MOUNT_ATTR_NOSUID: u64 = 0x2;
const MOUNT_ATTR_NODEV: u64 = 0x4;
const MOUNT_ATTR_NOEXEC: u64 = 0x8;

/// Whether this process mounts its overlays without `noexec` ([`allow_exec`]).
static EXEC: AtomicBool = AtomicBool::new(false);

/// Mount this process's overlays without `noexec` from now on: a systrap VMM's stub maps the
/// guest's program files executable (`mmap` with `PROT_EXEC` of a file on a `noexec` mount is
/// EPERM), as its jail's bind mounts are (`vmm::jail`; its seccomp filter admits `fsmount`
/// without `MOUNT_ATTR_NOEXEC` for the same reason). A KVM VMM never calls it.
pub fn allow_exec() {
    EXEC.store(true, Ordering::Relaxed);
}

/// The upper layer's directory on the sandbox's tmpfs.
pub const UPPER: &CStr = c"root";
/// Overlayfs's work directory on the sandbox's tmpfs (same file system as [`UPPER`], as it requires).
pub const WORK: &CStr = c"root.work";

fn fd_result(rc: libc::c_long, op: &'static str) -> Result<OwnedFd> {
    if rc < 0 {
        return Err(Error::last_os(op));
    }
    // SAFETY: a descriptor the kernel just returned to us.
    Ok(unsafe { OwnedFd::from_raw_fd(rc as i32) })
}

fn fsconfig(fs: &OwnedFd, cmd: u32, key: Option<&CStr>, value: Option<&CStr>, aux: i32) -> std::io::Result<()> {
    let k = key.map_or(std::ptr::null(), CStr::as_ptr);
    let v = value.map_or(std::ptr::null(), CStr::as_ptr);
    // SAFETY: valid C strings or nulls, as fsconfig takes them for `cmd`; the context fd is ours.
    if unsafe { libc::syscall(libc::SYS_fsconfig, fs.as_raw_fd(), cmd, k, v, aux) } < 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// `dir/name` as an O_PATH directory descriptor, made (mode 0755) if missing.
fn subdir(dir: BorrowedFd<'_>, name: &CStr) -> Result<OwnedFd> {
    // SAFETY: a valid C string relative to a directory descriptor we hold.
    let made = unsafe { libc::mkdirat(dir.as_raw_fd(), name.as_ptr(), 0o755) } == 0;
    if !made && std::io::Error::last_os_error().raw_os_error() != Some(libc::EEXIST) {
        return Err(Error::last_os("make the root overlay's directories on the sandbox's tmpfs"));
    }
    let flags = libc::O_PATH | libc::O_DIRECTORY | libc::O_NOFOLLOW | libc::O_CLOEXEC;
    // SAFETY: as above; the result is checked.
    fd_result(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags) } as libc::c_long, "open the root overlay's directories")
}

/// An overlay file system context (`fsopen("overlay")`), not configured yet: made by the
/// controller, which may make mounts, and handed to a VMM process, which then needs only
/// `fsconfig` and `fsmount` on it ([`mount_root`]), never `fsopen` (its argument, a file system
/// type by name, is a string a seccomp filter cannot check).
pub fn context() -> Result<OwnedFd> {
    // SAFETY: a valid C string; the result is checked.
    fd_result(unsafe { libc::syscall(libc::SYS_fsopen, c"overlay".as_ptr(), FSOPEN_CLOEXEC) }, "fsopen(overlay)")
}

/// Mount the context `ctx` ([`context`]) as a detached overlay: `lower` (a directory descriptor
/// of the image's root, never written) under the upper layer [`UPPER`] of `scratch` (the root of a
/// sandbox's tmpfs). The result is the merged root's directory descriptor. A context mounts once.
pub fn mount_root(ctx: &OwnedFd, lower: BorrowedFd<'_>, scratch: BorrowedFd<'_>) -> Result<OwnedFd> {
    let upper = subdir(scratch, UPPER)?;
    let work = subdir(scratch, WORK)?;
    let configure = || -> std::io::Result<()> {
        fsconfig(ctx, FSCONFIG_SET_FD, Some(c"lowerdir+"), None, lower.as_raw_fd())?;
        fsconfig(ctx, FSCONFIG_SET_FD, Some(c"upperdir"), None, upper.as_raw_fd())?;
        fsconfig(ctx, FSCONFIG_SET_FD, Some(c"workdir"), None, work.as_raw_fd())?;
        fsconfig(ctx, FSCONFIG_SET_FLAG, Some(c"userxattr"), None, 0)?;
        for (k, v) in [(c"index", c"off"), (c"metacopy", c"off")] {
            fsconfig(ctx, FSCONFIG_SET_STRING, Some(k), Some(v), 0)?;
        }
        fsconfig(ctx, FSCONFIG_CMD_CREATE, None, None, 0)
    };
    configure().map_err(Error::sys("configure a sandbox's root overlay"))?;
    let noexec = if EXEC.load(Ordering::Relaxed) { 0 } else { MOUNT_ATTR_NOEXEC };
    let attrs = MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV | noexec;
    // SAFETY: our context descriptor; the result is checked.
    let root = fd_result(unsafe { libc::syscall(libc::SYS_fsmount, ctx.as_raw_fd(), FSMOUNT_CLOEXEC, attrs) }, "fsmount(overlay)")?;
    if read_only(&root) {
        // Overlayfs mounts read-only, rather than failing, when it cannot make its work
        // directories on the upper file system: a full tmpfs (bytes or inodes). The guest would
        // then see EROFS at its first write anywhere in its root, far from the cause.
        return Err(Error::Sys {
            op: "mount the sandbox's writable root (overlayfs fell back to read-only: its work directory does not fit in the \
                 sandbox's disk quota; give the template a larger disk quota)",
            source: std::io::Error::from_raw_os_error(libc::EROFS),
        });
    }
    Ok(root)
}

/// Whether the mount `fd` is on is read-only.
fn read_only(fd: &OwnedFd) -> bool {
    // SAFETY: a zeroed statvfs is valid; fstatvfs (the fstatfs syscall) fills it from a
    // descriptor we hold.
    let mut s: libc::statvfs = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    unsafe { libc::fstatvfs(fd.as_raw_fd(), &mut s) == 0 && s.f_flag & libc::ST_RDONLY != 0 }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::quota::{self, DiskQuota, Scratch};
    use std::ffi::CString;
    use std::io::Write;
    use std::os::fd::AsFd;

    fn open_at(dir: BorrowedFd<'_>, path: &str, flags: i32) -> std::io::Result<std::fs::File> {
        let c = CString::new(path).unwrap();
        // SAFETY: a valid C string relative to a directory descriptor we hold.
        let fd = unsafe { libc::openat(dir.as_raw_fd(), c.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOFOLLOW, 0o644) };
        if fd < 0 {
            return Err(std::io::Error::last_os_error());
        }
        // SAFETY: a fresh descriptor.
        Ok(unsafe { std::fs::File::from_raw_fd(fd) })
    }

    fn exists_at(dir: BorrowedFd<'_>, path: &str) -> bool {
        open_at(dir, path, libc::O_PATH).is_ok()
    }

    fn names_at(dir: BorrowedFd<'_>, path: &str) -> Vec<String> {
        let f = open_at(dir, path, libc::O_RDONLY | libc::O_DIRECTORY).unwrap();
        let mut v: Vec<String> = std::fs::read_dir(format!("/proc/self/fd/{}", f.as_raw_fd()))
            .unwrap()
            .map(|e| e.unwrap().file_name().into_string().unwrap())
            .collect();
        v.sort();
        v
    }

    #[test]
    fn a_root_overlay_that_would_be_read_only_is_refused() {
        if !quota::available() {
            eprintln!("skipped: no CAP_SYS_ADMIN for tmpfs instances");
            return;
        }
        let image = std::env::temp_dir().join(format!("collimate-overlay-ro-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&image);
        std::fs::create_dir_all(image.join("etc")).unwrap();
        let lower = std::fs::File::open(&image).unwrap();
        let scratch = Scratch::new(DiskQuota { bytes: 2 << 20, inodes: 128 }).unwrap();
        // The layer's directories exist, then every inode of the tmpfs is taken: overlayfs
        // cannot make its work directory's own subdirectories and would mount read-only.
        drop(subdir(scratch.0.as_fd(), UPPER).unwrap());
        drop(subdir(scratch.0.as_fd(), WORK).unwrap());
        let mut n = 0;
        while open_at(scratch.0.as_fd(), &format!("f{n}"), libc::O_WRONLY | libc::O_CREAT).is_ok() {
            n += 1;
        }
        let err = mount_root(&context().unwrap(), lower.as_fd(), scratch.0.as_fd()).map(drop).unwrap_err().to_string();
        assert!(err.contains("fell back to read-only") && err.contains("disk quota"), "{err}");
        std::fs::remove_dir_all(&image).unwrap();
    }

    #[test]
    fn writes_copy_up_into_the_quota_and_never_reach_the_image() {
        if !quota::available() {
            eprintln!("skipped: no CAP_SYS_ADMIN for tmpfs instances");
            return;
        }
        let image = std::env::temp_dir().join(format!("collimate-overlay-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&image);
        std::fs::create_dir_all(image.join("usr/local/bin")).unwrap();
        std::fs::create_dir_all(image.join("etc")).unwrap();
        std::fs::write(image.join("etc/os-release"), b"image\n").unwrap();
        std::fs::write(image.join("etc/hostname"), b"image\n").unwrap();
        let lower = std::fs::File::open(&image).unwrap();
        let scratch = Scratch::new(DiskQuota { bytes: 2 << 20, inodes: 128 }).unwrap();
        let root = mount_root(&context().unwrap(), lower.as_fd(), scratch.0.as_fd()).unwrap();
        let wr = libc::O_WRONLY | libc::O_CREAT | libc::O_TRUNC;

        // A new file in an image directory, and an image file rewritten: both land in the upper layer.
        open_at(root.as_fd(), "usr/local/bin/x", wr).unwrap().write_all(b"new\n").unwrap();
        open_at(root.as_fd(), "etc/hostname", wr).unwrap().write_all(b"sandbox\n").unwrap();
        assert_eq!(std::fs::read(image.join("etc/hostname")).unwrap(), b"image\n", "the image was written");
        assert!(!image.join("usr/local/bin/x").exists(), "the image was written");
        let upper = open_at(scratch.0.as_fd(), "root", libc::O_PATH | libc::O_DIRECTORY).unwrap();
        assert!(exists_at(upper.as_fd(), "usr/local/bin/x") && exists_at(upper.as_fd(), "etc/hostname"));
        assert!(!exists_at(upper.as_fd(), "etc/os-release"), "an unwritten file was copied up");

        // Deleting an image file hides it in the merged view only; listings merge both layers.
        unlink(root.as_fd(), "etc/os-release", 0);
        assert!(!exists_at(root.as_fd(), "etc/os-release"));
        assert!(image.join("etc/os-release").exists(), "a delete reached the image");
        assert_eq!(names_at(root.as_fd(), "etc"), ["hostname"]);
        assert_eq!(names_at(root.as_fd(), "usr/local/bin"), ["x"]);

        // Copied-up and new bytes count against the sandbox's quota: past it, ENOSPC.
        let mut big = open_at(root.as_fd(), "usr/local/big", wr).unwrap();
        let chunk = vec![1u8; 64 << 10];
        let mut written = 0usize;
        let err = loop {
            match big.write(&chunk) {
                Ok(n) => written += n,
                Err(e) => break e,
            }
            assert!(written <= 3 << 20, "wrote past the quota");
        };
        assert_eq!(err.raw_os_error(), Some(libc::ENOSPC));
        assert!(scratch.usage().unwrap().bytes >= (2 << 20) - (64 << 10));
        drop((big, root));
        let _ = std::fs::remove_dir_all(&image);
    }

    fn unlink(dir: BorrowedFd<'_>, path: &str, flags: libc::c_int) {
        let c = CString::new(path).unwrap();
        // SAFETY: a valid C string relative to a directory descriptor we hold.
        assert_eq!(unsafe { libc::unlinkat(dir.as_raw_fd(), c.as_ptr(), flags) }, 0, "{path}: {}", std::io::Error::last_os_error());
    }

    fn mkdir(dir: BorrowedFd<'_>, path: &str) {
        let c = CString::new(path).unwrap();
        // SAFETY: a valid C string relative to a directory descriptor we hold.
        assert_eq!(unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) }, 0, "{path}: {}", std::io::Error::last_os_error());
    }

    #[test]
    fn a_copied_upper_layer_keeps_deletions_and_replaced_directories() {
        if !quota::available() {
            eprintln!("skipped: no CAP_SYS_ADMIN for tmpfs instances");
            return;
        }
        let image = std::env::temp_dir().join(format!("collimate-overlay-fork-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&image);
        std::fs::create_dir_all(image.join("opt/pkg")).unwrap();
        std::fs::create_dir_all(image.join("etc")).unwrap();
        for f in ["etc/a", "etc/b", "opt/pkg/old1", "opt/pkg/old2"] {
            std::fs::write(image.join(f), b"image\n").unwrap();
        }
        let lower = std::fs::File::open(&image).unwrap();
        let q = DiskQuota { bytes: 2 << 20, inodes: 128 };
        let (parent, child) = (Scratch::new(q).unwrap(), Scratch::new(q).unwrap());
        let root = mount_root(&context().unwrap(), lower.as_fd(), parent.0.as_fd()).unwrap();
        for f in ["etc/a", "opt/pkg/old1", "opt/pkg/old2"] {
            unlink(root.as_fd(), f, 0);
        }
        unlink(root.as_fd(), "opt/pkg", libc::AT_REMOVEDIR);
        mkdir(root.as_fd(), "opt/pkg");
        open_at(root.as_fd(), "opt/pkg/new", libc::O_WRONLY | libc::O_CREAT).unwrap().write_all(b"mine\n").unwrap();
        drop(root);

        // A fork's copy: the parent's upper layer into the child's tmpfs, then its own overlay.
        let from = open_at(parent.0.as_fd(), "root", libc::O_PATH | libc::O_DIRECTORY).unwrap();
        mkdir(child.0.as_fd(), "root");
        let to = open_at(child.0.as_fd(), "root", libc::O_PATH | libc::O_DIRECTORY).unwrap();
        crate::guestos::tree::copy_tree_at(from.as_fd(), to.as_fd()).unwrap();
        let root = mount_root(&context().unwrap(), lower.as_fd(), child.0.as_fd()).unwrap();
        assert!(!exists_at(root.as_fd(), "etc/a"), "the deletion was lost (whiteout not copied)");
        assert_eq!(names_at(root.as_fd(), "etc"), ["b"]);
        assert_eq!(names_at(root.as_fd(), "opt/pkg"), ["new"], "the image's directory shows through (opaque marker not copied)");
        let mut mine = String::new();
        std::io::Read::read_to_string(&mut open_at(root.as_fd(), "opt/pkg/new", libc::O_RDONLY).unwrap(), &mut mine).unwrap();
        assert_eq!(mine, "mine\n");
        assert!(image.join("etc/a").exists() && image.join("opt/pkg/old1").exists(), "the image was written");
        drop(root);
        let _ = std::fs::remove_dir_all(&image);
    }
}
