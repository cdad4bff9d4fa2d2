//! Copying and removing directory trees through directory descriptors.
//!
//! A sandbox's writable mounts live on its own detached tmpfs (`crate::quota`), which has no path
//! anywhere, so everything the engine does to them goes through descriptors: `openat`, `mkdirat`,
//! `unlinkat` relative to a directory it holds, never following a symlink. A copy keeps what a
//! sandbox can observe of its files: directories, regular files (contents, mode, holes), symlinks,
//! and owners (a guest that runs as a user owns what it made). Hard links become separate files;
//! FIFOs, sockets and device nodes are not copied, except the 0/0 character device that marks a
//! deleted file in an overlay's upper layer (a whiteout, see `crate::overlay`); overlayfs's own
//! `user.overlay.*` attributes (an opaque directory's marker, a copied-up file's origin) are kept
//! on directories and regular files, so a copied upper layer means the same over the same image.

use std::ffi::{CStr, CString};
use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, FromRawFd, OwnedFd};
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

fn cvt(rc: libc::c_int) -> io::Result<libc::c_int> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc)
    }
}

fn openat(dir: BorrowedFd<'_>, name: &CStr, flags: libc::c_int, mode: libc::mode_t) -> io::Result<OwnedFd> {
    // SAFETY: a valid C string relative to a directory descriptor we hold; the result is checked.
    let fd = cvt(unsafe { libc::openat(dir.as_raw_fd(), name.as_ptr(), flags | libc::O_CLOEXEC | libc::O_NOFOLLOW, mode) })?;
    // SAFETY: a descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn fstatat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<libc::stat> {
    // SAFETY: a plain C struct, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat fills the struct we pass; the name is a valid C string.
    cvt(unsafe { libc::fstatat(dir.as_raw_fd(), name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(st)
}

fn fstat(fd: BorrowedFd<'_>) -> io::Result<libc::stat> {
    // SAFETY: a plain C struct, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstat fills the struct we pass.
    cvt(unsafe { libc::fstat(fd.as_raw_fd(), &mut st) })?;
    Ok(st)
}

/// The names in directory `dir` (any descriptor of it, O_PATH included), without `.` and `..`.
fn entries(dir: BorrowedFd<'_>) -> io::Result<Vec<CString>> {
    let rd = openat(dir, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    let raw = std::mem::ManuallyDrop::new(rd).as_raw_fd();
    // SAFETY: fdopendir takes ownership of `raw` (closed by closedir below).
    let d = unsafe { libc::fdopendir(raw) };
    if d.is_null() {
        let e = io::Error::last_os_error();
        // SAFETY: fdopendir failed, so `raw` is still ours to close.
        unsafe { libc::close(raw) };
        return Err(e);
    }
    let mut names = Vec::new();
    loop {
        // SAFETY: `d` is an open DIR stream; readdir's entry is valid until the next call.
        let ent = unsafe { libc::readdir(d) };
        if ent.is_null() {
            break;
        }
        // SAFETY: d_name is a NUL-terminated name inside the entry.
        let name = unsafe { CStr::from_ptr((*ent).d_name.as_ptr()) };
        if name != c"." && name != c".." {
            names.push(name.to_owned());
        }
    }
    // SAFETY: closing the stream we opened (and the descriptor it owns).
    unsafe { libc::closedir(d) };
    Ok(names)
}

/// Give the object `name` in `dir` the owner of `st`, unless both are root's.
fn keep_owner(dir: BorrowedFd<'_>, name: &CStr, st: &libc::stat) -> io::Result<()> {
    if st.st_uid == 0 && st.st_gid == 0 {
        return Ok(());
    }
    // SAFETY: a valid C string relative to our directory; fchownat is on the jail's allow-list.
    cvt(unsafe { libc::fchownat(dir.as_raw_fd(), name.as_ptr(), st.st_uid, st.st_gid, libc::AT_SYMLINK_NOFOLLOW) })?;
    Ok(())
}

/// Copy the contents of directory `src` into directory `dst` (both descriptors, O_PATH is
/// enough), and give `dst` the mode and owner of `src`.
pub fn copy_tree_at(src: BorrowedFd<'_>, dst: BorrowedFd<'_>) -> io::Result<()> {
    let st = fstat(src)?;
    let d = openat(dst, c".", libc::O_RDONLY | libc::O_DIRECTORY, 0)?;
    // SAFETY: fchmod/fchown on a directory descriptor we hold.
    cvt(unsafe { libc::fchmod(d.as_raw_fd(), st.st_mode & 0o7777) })?;
    if st.st_uid != 0 || st.st_gid != 0 {
        // SAFETY: as above.
        cvt(unsafe { libc::fchown(d.as_raw_fd(), st.st_uid, st.st_gid) })?;
    }
    for name in entries(src)? {
        let est = fstatat(src, &name)?;
        match est.st_mode & libc::S_IFMT {
            libc::S_IFDIR => {
                // SAFETY: a valid C string relative to our directory.
                cvt(unsafe { libc::mkdirat(d.as_raw_fd(), name.as_ptr(), 0o700) })?;
                let from = openat(src, &name, libc::O_PATH | libc::O_DIRECTORY, 0)?;
                let to = openat(d.as_fd(), &name, libc::O_PATH | libc::O_DIRECTORY, 0)?;
                copy_tree_at(from.as_fd(), to.as_fd())?;
                let dirs = |fd: &OwnedFd| openat(fd.as_fd(), c".", libc::O_RDONLY | libc::O_DIRECTORY, 0);
                copy_overlay_xattrs(&dirs(&from)?, &dirs(&to)?)?;
            }
            libc::S_IFLNK => {
                let target = readlinkat(src, &name)?;
                // SAFETY: valid C strings relative to our directory.
                cvt(unsafe { libc::symlinkat(target.as_ptr(), d.as_raw_fd(), name.as_ptr()) })?;
                keep_owner(d.as_fd(), &name, &est)?;
            }
            libc::S_IFREG => {
                let from = openat(src, &name, libc::O_RDONLY, 0)?;
                let to = openat(d.as_fd(), &name, libc::O_WRONLY | libc::O_CREAT | libc::O_EXCL, 0o600)?;
                copy_file(&from, &to, est.st_size as u64)?;
                // SAFETY: fchmod on the descriptor just created (after the data: a set-id bit would
                // be cleared by the writes).
                cvt(unsafe { libc::fchmod(to.as_raw_fd(), est.st_mode & 0o7777) })?;
                keep_owner(d.as_fd(), &name, &est)?;
                copy_overlay_xattrs(&from, &to)?;
            }
            libc::S_IFCHR if est.st_rdev == 0 => {
                // SAFETY: a valid C string relative to our directory; a 0/0 character device (an
                // overlay whiteout) needs no CAP_MKNOD and is the one device the jail lets us make.
                cvt(unsafe { libc::mknodat(d.as_raw_fd(), name.as_ptr(), libc::S_IFCHR, 0) })?;
                keep_owner(d.as_fd(), &name, &est)?;
            }
            _ => {}
        }
    }
    Ok(())
}

/// Prefix of overlayfs's own extended attributes with `userxattr` (see `crate::overlay`).
const OVERLAY_XATTR: &[u8] = b"user.overlay.";

/// Copy the `user.overlay.*` extended attributes of `from` to `to` (open descriptors, not O_PATH).
/// A file system without user attributes has none to copy.
fn copy_overlay_xattrs(from: &OwnedFd, to: &OwnedFd) -> io::Result<()> {
    // SAFETY: with a null buffer and size 0, flistxattr only returns the size the list needs.
    let size = unsafe { libc::flistxattr(from.as_raw_fd(), std::ptr::null_mut(), 0) };
    if size == 0 {
        return Ok(());
    }
    if size < 0 {
        let e = io::Error::last_os_error();
        return if e.raw_os_error() == Some(libc::ENOTSUP) { Ok(()) } else { Err(e) };
    }
    let mut names = vec![0u8; size as usize];
    // SAFETY: flistxattr writes at most names.len() bytes into our buffer.
    let n = cvt_size(unsafe { libc::flistxattr(from.as_raw_fd(), names.as_mut_ptr().cast(), names.len()) })?;
    names.truncate(n);
    for name in names.split(|&b| b == 0).filter(|n| n.starts_with(OVERLAY_XATTR)) {
        let name = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
        // SAFETY: with a null buffer and size 0, fgetxattr only returns the value's size.
        let size = cvt_size(unsafe { libc::fgetxattr(from.as_raw_fd(), name.as_ptr(), std::ptr::null_mut(), 0) })?;
        let mut value = vec![0u8; size];
        // SAFETY: fgetxattr writes at most value.len() bytes into our buffer; the name is a C string.
        let len = cvt_size(unsafe { libc::fgetxattr(from.as_raw_fd(), name.as_ptr(), value.as_mut_ptr().cast(), value.len()) })?;
        // SAFETY: fsetxattr reads `len` bytes of our buffer; the name is a C string.
        cvt(unsafe { libc::fsetxattr(to.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), len, 0) })?;
    }
    Ok(())
}

fn cvt_size(rc: libc::ssize_t) -> io::Result<usize> {
    if rc < 0 {
        Err(io::Error::last_os_error())
    } else {
        Ok(rc as usize)
    }
}

fn readlinkat(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<CString> {
    let mut buf = vec![0u8; libc::PATH_MAX as usize + 1];
    // SAFETY: readlinkat writes at most buf.len() bytes into our buffer.
    let n = unsafe { libc::readlinkat(dir.as_raw_fd(), name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(io::Error::last_os_error());
    }
    buf.truncate(n as usize);
    CString::new(buf).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))
}

/// Copy the data of `from` into the empty file `to`, keeping holes (a sparse file stays sparse,
/// so it costs its copy's quota only what it holds), then give `to` the length `size`.
fn copy_file(from: &OwnedFd, to: &OwnedFd, size: u64) -> io::Result<()> {
    let mut off: i64 = 0;
    loop {
        // SAFETY: lseek on our own descriptor.
        let data = unsafe { libc::lseek(from.as_raw_fd(), off, libc::SEEK_DATA) };
        if data < 0 {
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::ENXIO) => break, // no data after `off`
                _ => return copy_range(from, to, 0, size),
            }
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(from.as_raw_fd(), data, libc::SEEK_HOLE) };
        let end = if hole < 0 { size as i64 } else { hole };
        copy_range(from, to, data as u64, end as u64)?;
        off = end;
        if off as u64 >= size {
            break;
        }
    }
    // SAFETY: ftruncate on the descriptor we created.
    cvt(unsafe { libc::ftruncate(to.as_raw_fd(), size as i64) })?;
    Ok(())
}

/// Copy bytes [start, end) at the same offsets: `copy_file_range` (within the kernel), else
/// pread/pwrite.
fn copy_range(from: &OwnedFd, to: &OwnedFd, start: u64, end: u64) -> io::Result<()> {
    let mut pos = start;
    let mut fallback = false;
    let mut buf = Vec::new();
    while pos < end {
        let want = ((end - pos) as usize).min(1 << 30);
        if !fallback {
            let (mut a, mut b) = (pos as i64, pos as i64);
            // SAFETY: both descriptors are ours; the offsets are our own variables.
            let n = unsafe { libc::copy_file_range(from.as_raw_fd(), &mut a, to.as_raw_fd(), &mut b, want, 0) };
            if n > 0 {
                pos += n as u64;
                continue;
            }
            if n == 0 {
                break; // the file shrank under us
            }
            match io::Error::last_os_error().raw_os_error() {
                Some(libc::EXDEV | libc::EINVAL | libc::ENOSYS | libc::EOPNOTSUPP | libc::EPERM) => fallback = true,
                _ => return Err(io::Error::last_os_error()),
            }
            continue;
        }
        buf.resize(want.min(1 << 20), 0);
        // SAFETY: pread into our buffer.
        let n = unsafe { libc::pread(from.as_raw_fd(), buf.as_mut_ptr().cast(), buf.len(), pos as i64) };
        if n < 0 {
            return Err(io::Error::last_os_error());
        }
        if n == 0 {
            break;
        }
        let mut done = 0usize;
        while done < n as usize {
            // SAFETY: pwrite from our buffer.
            let w = unsafe { libc::pwrite(to.as_raw_fd(), buf[done..].as_ptr().cast(), n as usize - done, (pos + done as u64) as i64) };
            if w < 0 {
                return Err(io::Error::last_os_error());
            }
            done += w as usize;
        }
        pos += n as u64;
    }
    Ok(())
}

/// Remove `name` in `dir` and, if it is a directory, everything beneath it. Missing is fine.
pub fn remove_tree_at(dir: BorrowedFd<'_>, name: &CStr) -> io::Result<()> {
    let st = match fstatat(dir, name) {
        Ok(st) => st,
        Err(e) if e.raw_os_error() == Some(libc::ENOENT) => return Ok(()),
        Err(e) => return Err(e),
    };
    if st.st_mode & libc::S_IFMT == libc::S_IFDIR {
        let sub = openat(dir, name, libc::O_PATH | libc::O_DIRECTORY, 0)?;
        for child in entries(sub.as_fd())? {
            remove_tree_at(sub.as_fd(), &child)?;
        }
        // SAFETY: a valid C string relative to our directory.
        cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), libc::AT_REMOVEDIR) })?;
    } else {
        // SAFETY: as above.
        cvt(unsafe { libc::unlinkat(dir.as_raw_fd(), name.as_ptr(), 0) })?;
    }
    Ok(())
}

/// A fresh, empty directory `name` in `dir` (whatever was there removed first), opened O_PATH.
pub fn fresh_dir(dir: BorrowedFd<'_>, name: &str) -> io::Result<OwnedFd> {
    let c = CString::new(name).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    remove_tree_at(dir, &c)?;
    // SAFETY: a valid C string relative to our directory.
    cvt(unsafe { libc::mkdirat(dir.as_raw_fd(), c.as_ptr(), 0o755) })?;
    openat(dir, &c, libc::O_PATH | libc::O_DIRECTORY, 0)
}

/// A directory by host path, opened O_PATH (created with its parents if missing).
pub fn open_dir_path(path: &Path, create: bool) -> io::Result<OwnedFd> {
    if create {
        std::fs::create_dir_all(path)?;
    }
    let c = CString::new(path.as_os_str().as_bytes()).map_err(|_| io::Error::from_raw_os_error(libc::EINVAL))?;
    // SAFETY: a valid C string; the result is checked.
    let fd = cvt(unsafe { libc::open(c.as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) })?;
    // SAFETY: a descriptor the kernel just gave us.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// Whether the tree under `dir` holds `rel` (a relative guest-side path without `..`) as the very
/// file (device, inode) `id`.
pub fn holds(dir: BorrowedFd<'_>, rel: &str, id: (u64, u64)) -> bool {
    let Ok(c) = CString::new(rel) else { return false };
    // SAFETY: a plain C struct, for which all zeroes is a valid value.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: fstatat fills the struct we pass (following symlinks, as the guest's mmap did).
    if unsafe { libc::fstatat(dir.as_raw_fd(), c.as_ptr(), &mut st, 0) } != 0 {
        return false;
    }
    (st.st_dev, st.st_ino) == id
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::{MetadataExt, PermissionsExt};

    #[test]
    fn copies_files_dirs_symlinks_modes_and_holes_then_removes() {
        let t = tempfile_dir();
        let src = t.join("src");
        std::fs::create_dir_all(src.join("a/b")).unwrap();
        std::fs::write(src.join("a/b/f"), b"hello").unwrap();
        std::fs::set_permissions(src.join("a/b/f"), std::fs::Permissions::from_mode(0o751)).unwrap();
        std::os::unix::fs::symlink("b/f", src.join("a/link")).unwrap();
        let sparse = std::fs::File::create(src.join("sparse")).unwrap();
        sparse.set_len(64 << 20).unwrap();
        use std::os::unix::fs::FileExt;
        sparse.write_at(b"tail", (64 << 20) - 4).unwrap();
        drop(sparse);
        let (from, to) = (open_dir_path(&src, false).unwrap(), open_dir_path(&t.join("dst"), true).unwrap());
        copy_tree_at(from.as_fd(), to.as_fd()).unwrap();
        let dst = t.join("dst");
        assert_eq!(std::fs::read(dst.join("a/b/f")).unwrap(), b"hello");
        assert_eq!(std::fs::metadata(dst.join("a/b/f")).unwrap().permissions().mode() & 0o7777, 0o751);
        assert_eq!(std::fs::read_link(dst.join("a/link")).unwrap(), Path::new("b/f"));
        let m = std::fs::metadata(dst.join("sparse")).unwrap();
        assert_eq!(m.len(), 64 << 20);
        assert!(m.blocks() * 512 < 1 << 20, "the hole was filled: {} blocks", m.blocks());
        assert_eq!(&std::fs::read(dst.join("sparse")).unwrap()[(64 << 20) - 4..], b"tail");
        let root = open_dir_path(&t, false).unwrap();
        assert!(holds(root.as_fd(), "dst/a/b/f", {
            let m = std::fs::metadata(dst.join("a/b/f")).unwrap();
            (m.dev(), m.ino())
        }));
        remove_tree_at(root.as_fd(), c"dst").unwrap();
        assert!(!dst.exists());
        remove_tree_at(root.as_fd(), c"dst").unwrap(); // missing is fine
        let _ = std::fs::remove_dir_all(&t);
    }

    #[test]
    fn keeps_overlay_attributes_of_any_size_and_drops_the_others() {
        if !crate::quota::available() {
            eprintln!("skipped: no CAP_SYS_ADMIN for tmpfs instances");
            return;
        }
        let s = crate::quota::Scratch::new(crate::quota::MIN_QUOTA).unwrap();
        for d in [c"src", c"dst"] {
            // SAFETY: a valid C string relative to the tmpfs root we hold.
            cvt(unsafe { libc::mkdirat(s.0.as_raw_fd(), d.as_ptr(), 0o755) }).unwrap();
        }
        let src = openat(s.0.as_fd(), c"src", libc::O_PATH | libc::O_DIRECTORY, 0).unwrap();
        let f = openat(src.as_fd(), c"f", libc::O_WRONLY | libc::O_CREAT, 0o644).unwrap();
        let big = vec![b'x'; 10_000];
        for (name, value) in [(c"user.overlay.origin", &big[..]), (c"user.other", &b"1"[..])] {
            // SAFETY: a C string name and our buffer.
            cvt(unsafe { libc::fsetxattr(f.as_raw_fd(), name.as_ptr(), value.as_ptr().cast(), value.len(), 0) }).unwrap();
        }
        let dst = openat(s.0.as_fd(), c"dst", libc::O_PATH | libc::O_DIRECTORY, 0).unwrap();
        copy_tree_at(src.as_fd(), dst.as_fd()).unwrap();
        let g = openat(dst.as_fd(), c"f", libc::O_RDONLY, 0).unwrap();
        let mut buf = vec![0u8; 20_000];
        // SAFETY: fgetxattr writes at most buf.len() bytes into our buffer.
        let n = unsafe { libc::fgetxattr(g.as_raw_fd(), c"user.overlay.origin".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        assert_eq!(n, 10_000, "{}", io::Error::last_os_error());
        assert_eq!(&buf[..10_000], &big[..]);
        // SAFETY: as above.
        let n = unsafe { libc::fgetxattr(g.as_raw_fd(), c"user.other".as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
        assert_eq!((n, io::Error::last_os_error().raw_os_error()), (-1, Some(libc::ENODATA)));
    }

    fn tempfile_dir() -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("collimate-tree-{}-{:?}", std::process::id(), std::thread::current().id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }
}
