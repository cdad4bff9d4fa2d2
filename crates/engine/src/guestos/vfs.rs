//! Guest paths resolved inside the sandbox's file system, never outside it.
//!
//! The sandbox sees a read-only root (the template's root filesystem) plus writable directories
//! mounted at guest paths (`/tmp`, `/work`), plus two trees the engine serves itself (`/dev` and
//! `/proc`, see `files::special`): the host's `/dev` and `/proc` are never opened.
//!
//! Resolution is a component-by-component walk done here, the way the kernel's own path walk goes:
//! - every host lookup is an `openat2` of ONE component relative to a directory fd we hold, with
//!   `RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS`, so the host kernel never
//!   follows a symlink or a `..` for us;
//! - a symlink is read with `readlinkat` and its target spliced into the remaining components; an
//!   absolute target restarts at the sandbox root (`RESOLVE_IN_ROOT` semantics);
//! - `..` goes to the parent of the *guest* path we are at (so `/tmp/..` is `/`, not the parent of
//!   the host directory mounted at `/tmp`), and never above `/`;
//! - crossing a mount point switches to that mount's directory fd, so a symlink in `/work` to
//!   `/usr/lib/x` reaches the root filesystem, and `/tmp/../etc` the root's `/etc`.
//!
//! A lookup returns the directory that holds the last component and that component's name
//! ([`Resolved`]); the caller then makes the `*at` host call on that single name, always with the
//! no-follow variant (`AT_SYMLINK_NOFOLLOW`, `RESOLVE_NO_SYMLINKS`), so that a symlink swapped in
//! between the lookup and the call is acted on itself or refused, never followed by the host.
//!
//! Fast path: a path with no `..` whose directory part contains no symlink is opened in one
//! `openat2(RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS)` from the mount that holds it; a symlink on the
//! way makes that fail with ELOOP and the walk takes over.
//!
//! Paths are UTF-8 here (a guest path that is not is refused with EINVAL).

use std::collections::VecDeque;
use std::ffi::{CStr, CString};
use std::os::fd::{AsRawFd, BorrowedFd, FromRawFd, OwnedFd, RawFd};
use std::path::Path;

use super::{Errno, EACCES, EEXIST, EINVAL, ELOOP, ENAMETOOLONG, ENOENT, EROFS};

/// Longest guest path (with its NUL), as Linux.
pub const PATH_MAX: usize = 4096;
/// Longest path component, as Linux.
pub const NAME_MAX: usize = 255;
/// Most symlinks one lookup follows, as Linux.
pub const MAX_SYMLINKS: u32 = 40;

/// Guest directories the engine serves itself (see `files::special`).
pub const VIRTUAL_ROOTS: [&str; 3] = ["/dev", "/proc", "/sys"];

/// How every single-component host lookup is made.
pub const RESOLVE_ONE: u64 = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;

/// A host directory that appears at a guest path.
pub struct Mount {
    /// Normalised guest path without a trailing slash ("/" for the root).
    pub at: String,
    pub dir: OwnedFd,
    pub writable: bool,
    /// The host directory (for snapshots and for giving a forked sandbox its own copy).
    pub host: std::path::PathBuf,
}

/// The sandbox's file system view.
#[derive(Default)]
pub struct Vfs {
    /// Longest `at` first, so lookups pick the innermost mount; the root ("/") is last.
    pub mounts: Vec<Mount>,
    /// Set when the root is (or, in a template's zygote, will be in each clone) writable: the
    /// image under a copy-up layer (`crate::overlay`).
    pub root_layer: Option<RootLayer>,
    /// Directories of a read-only image root opened before ([`DirCache`]).
    dirs: std::sync::Mutex<DirCache>,
}

/// The directories of a read-only root that lookups opened, kept open: a path's directory part
/// is then found without the `openat2` and `close` that opening it again would cost (two of a
/// `stat`'s seven host calls on systrap, where the import system stats thousands of paths under
/// a few dozen directories). Only for the root mount of an image with no writable layer over it:
/// the image's files never change (the engine's cache holds them read-only), so a directory path
/// names the same directory for the sandbox's life. Keyed by the root's host path too, so that a
/// root mounted again elsewhere starts afresh. Bounded: emptied when full.
#[derive(Default)]
struct DirCache {
    root: std::path::PathBuf,
    dirs: std::collections::HashMap<String, std::sync::Arc<OwnedFd>>,
}

/// Directories [`DirCache`] keeps open at most.
const DIR_CACHE: usize = 64;

/// A writable root: the host's overlayfs over the image's root directory, its upper layer on the
/// sandbox's tmpfs (`crate::overlay`). While mounted, the root [`Mount`] is the merged view and
/// writable; the upper layer is what forks, snapshots and resets copy, never the merged view.
pub struct RootLayer {
    /// The image's root directory (the lower layer, never written).
    pub image: OwnedFd,
    /// The upper layer's directory: on the sandbox's tmpfs while mounted; in a zygote restored
    /// from a snapshot, the snapshot's copy (each clone copies it before it mounts its own).
    pub upper: Option<OwnedFd>,
}

/// Guest paths are bytes; the engine keeps them as `String`s whose bytes that are not UTF-8 are
/// escaped, each as one character of Unicode's last private-use plane: byte `b` (0x80..=0xff) as
/// U+10FF00 + b. A name that really contains one of those characters (U+10FF80..=U+10FFFF) has each
/// of its bytes escaped too, so the mapping is one to one. `/` and `.` are never escaped, so paths
/// split and join as before; [`guest_bytes`] gives the bytes back for the host and the guest.
const ESCAPE_BASE: u32 = 0x10_FF00;

fn escape_byte(out: &mut String, b: u8) {
    out.push(char::from_u32(ESCAPE_BASE + b as u32).unwrap_or(char::REPLACEMENT_CHARACTER));
}

/// The engine's string for guest path bytes (see [`ESCAPE_BASE`]).
pub fn guest_str(bytes: &[u8]) -> String {
    let mut out = String::with_capacity(bytes.len());
    for chunk in bytes.utf8_chunks() {
        for ch in chunk.valid().chars() {
            if ch as u32 >= ESCAPE_BASE + 0x80 {
                let mut buf = [0u8; 4];
                for b in ch.encode_utf8(&mut buf).bytes() {
                    escape_byte(&mut out, b);
                }
            } else {
                out.push(ch);
            }
        }
        for &b in chunk.invalid() {
            escape_byte(&mut out, b);
        }
    }
    out
}

/// The guest path bytes of an engine string (the inverse of [`guest_str`]).
pub fn guest_bytes(s: &str) -> Vec<u8> {
    let mut out = Vec::with_capacity(s.len());
    for ch in s.chars() {
        let c = ch as u32;
        if c >= ESCAPE_BASE + 0x80 {
            out.push((c - ESCAPE_BASE) as u8);
        } else {
            let mut buf = [0u8; 4];
            out.extend_from_slice(ch.encode_utf8(&mut buf).as_bytes());
        }
    }
    out
}

/// Join `path` onto `base` (both guest paths) and drop `.` and empty components. `..` is kept: it
/// is resolved by the walk ([`Vfs::resolve`]), with symlinks, as Linux does.
pub fn join(base: &str, path: &[u8]) -> Result<String, Errno> {
    let path = &guest_str(path);
    if path.len() >= PATH_MAX {
        return Err(ENAMETOOLONG);
    }
    let full = if path.starts_with('/') { path.to_string() } else { format!("{base}/{path}") };
    let parts: Vec<&str> = full.split('/').filter(|c| !c.is_empty() && *c != ".").collect();
    Ok(format!("/{}", parts.join("/")))
}

/// Whether `p` equals `prefix` or lies below it (both normalised guest paths).
pub fn is_under(p: &str, prefix: &str) -> bool {
    if prefix == "/" {
        return p.starts_with('/');
    }
    p == prefix || (p.len() > prefix.len() && p.starts_with(prefix) && p.as_bytes()[prefix.len()] == b'/')
}

/// Whether the normalised guest path `p` lies in a tree the engine serves (`/dev`, `/proc`,
/// `/sys`).
pub fn is_virtual(p: &str) -> bool {
    VIRTUAL_ROOTS.iter().any(|r| is_under(p, r))
}

/// The symlinks of the engine-served trees: `Some(target)` if the normalised guest path `p` is one.
/// `/proc/self/fd/N` are not listed: they are "magic" links that `files` resolves to the open file.
pub fn virtual_link(p: &str, cwd: &str, exe: Option<&str>) -> Option<String> {
    let t = match p {
        "/dev/stdin" => "/proc/self/fd/0",
        "/dev/stdout" => "/proc/self/fd/1",
        "/dev/stderr" => "/proc/self/fd/2",
        "/dev/fd" => "/proc/self/fd",
        "/proc/thread-self" => "/proc/self",
        "/proc/mounts" => "/proc/self/mounts",
        "/proc/self/root" => "/",
        "/proc/self/cwd" => cwd,
        "/proc/self/exe" => return exe.map(str::to_string),
        _ => return None,
    };
    Some(t.to_string())
}

/// The parent of a normalised guest path ("/" for "/").
pub fn parent(p: &str) -> &str {
    match p.rfind('/') {
        Some(0) | None => "/",
        Some(i) => &p[..i],
    }
}

fn child(dir: &str, name: &str) -> String {
    if dir == "/" {
        format!("/{name}")
    } else {
        format!("{dir}/{name}")
    }
}

/// A directory fd: one of the mounts' (borrowed) or one opened during the walk.
pub enum DirFd<'a> {
    Borrowed(BorrowedFd<'a>),
    Owned(OwnedFd),
    /// One kept open by the lookups ([`DirCache`]).
    Shared(std::sync::Arc<OwnedFd>),
}

impl AsRawFd for DirFd<'_> {
    fn as_raw_fd(&self) -> RawFd {
        match self {
            DirFd::Borrowed(b) => b.as_raw_fd(),
            DirFd::Owned(o) => o.as_raw_fd(),
            DirFd::Shared(o) => o.as_raw_fd(),
        }
    }
}

/// How a lookup treats its last component.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lookup {
    /// Follow a symlink in the last component (stat, open, chdir...). A trailing slash requires
    /// a directory.
    Follow,
    /// Do not follow it (lstat, readlink, open with O_NOFOLLOW...). A trailing slash still
    /// follows and requires a directory, as Linux does.
    NoFollow,
    /// For calls that create or remove the last component (mkdir, unlink, rename, symlink...):
    /// trailing slashes are dropped and the last component is never followed.
    Parent,
}

/// Where a lookup ended.
pub enum Target<'a> {
    /// Entry `name` (one component, no slash, never `..`) of host directory `dir`; `name` is `.`
    /// when the object is `dir` itself (the root, a mount point, a path ending in `.` or `..`).
    Host { dir: DirFd<'a>, name: CString, mount: usize, writable: bool },
    /// A node of the engine-served trees; its guest path is [`Resolved::path`].
    Virtual,
}

/// The result of a lookup: the object's normalised guest path (no symlink, no `.`/`..` in it)
/// and where it lives. The object itself may not exist (for creations).
pub struct Resolved<'a> {
    pub path: String,
    pub target: Target<'a>,
    /// The object's own `lstat`, where the lookup took it: the last component of a lookup that
    /// follows it, which the walk stats to see whether it is a symlink (one host call where a
    /// `readlinkat` and the caller's `fstatat` were two: a followed `stat`, the import system's
    /// most frequent call).
    pub lstat: Option<libc::stat>,
}

impl Resolved<'_> {
    /// The host directory and entry name, unless this is a virtual node.
    pub fn host(&self) -> Option<(RawFd, &CStr)> {
        match &self.target {
            Target::Host { dir, name, .. } => Some((dir.as_raw_fd(), name.as_c_str())),
            Target::Virtual => None,
        }
    }

    /// Whether the object lies on a writable mount.
    pub fn writable(&self) -> bool {
        matches!(self.target, Target::Host { writable: true, .. })
    }

    pub fn is_virtual(&self) -> bool {
        matches!(self.target, Target::Virtual)
    }

    /// Whether the last component was `.`, `..`, a mount point or the root (the object is the
    /// directory fd itself).
    pub fn is_dir_itself(&self) -> bool {
        matches!(&self.target, Target::Host { name, .. } if name.as_bytes() == b".")
    }
}

/// Where the walk is: a directory (host, with its mount) or a virtual node.
struct Cursor<'a> {
    path: String,
    host: Option<(DirFd<'a>, usize)>,
}

impl<'a> Cursor<'a> {
    fn into_resolved(self, vfs: &Vfs) -> Resolved<'a> {
        match self.host {
            Some((dir, mount)) => Resolved {
                path: self.path,
                target: Target::Host { dir, name: CString::from(c"."), mount, writable: vfs.mounts[mount].writable },
                lstat: None,
            },
            None => Resolved { path: self.path, target: Target::Virtual, lstat: None },
        }
    }
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

/// The open(2) flags the kernel accepts from openat2 (others make it fail with EINVAL; open(2)
/// ignores them, so we drop them).
const VALID_OPEN_FLAGS: i32 = libc::O_ACCMODE
    | libc::O_CREAT
    | libc::O_EXCL
    | libc::O_NOCTTY
    | libc::O_TRUNC
    | libc::O_APPEND
    | libc::O_NONBLOCK
    | libc::O_DSYNC
    | libc::O_ASYNC
    | libc::O_DIRECT
    | libc::O_LARGEFILE
    | libc::O_DIRECTORY
    | libc::O_NOFOLLOW
    | libc::O_NOATIME
    | libc::O_CLOEXEC
    | libc::O_PATH
    | libc::O_TMPFILE
    | libc::O_SYNC;

/// The lookup mode open(2) uses for `flags`: O_NOFOLLOW and O_CREAT|O_EXCL do not follow a
/// symlink in the last component.
pub fn open_lookup(flags: i32) -> Lookup {
    if flags & libc::O_NOFOLLOW != 0 || flags & (libc::O_CREAT | libc::O_EXCL) == libc::O_CREAT | libc::O_EXCL {
        Lookup::NoFollow
    } else {
        Lookup::Follow
    }
}

/// Whether open(2) `flags` need a writable file system.
pub fn open_writes(flags: i32) -> bool {
    if flags & libc::O_PATH != 0 {
        return false;
    }
    flags & libc::O_ACCMODE != libc::O_RDONLY || flags & libc::O_TRUNC != 0
}

impl Vfs {
    /// A view whose root is the host directory `root` (read-only).
    pub fn new(root: &Path) -> std::io::Result<Vfs> {
        let mut v = Vfs::default();
        v.mounts.push(Mount { at: "/".into(), dir: open_dir(root)?, writable: false, host: root.to_path_buf() });
        Ok(v)
    }

    /// Mark the root as a writable root to be (each fork mounts its own, [`Vfs::mount_root_layer`]);
    /// `upper`: an upper layer's contents to start from.
    pub fn want_root_layer(&mut self, upper: Option<OwnedFd>) -> std::io::Result<()> {
        let image = match self.root_layer.take() {
            Some(l) => l.image,
            None => self.mounts.iter().find(|m| m.at == "/").ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))?.dir.try_clone()?,
        };
        self.root_layer = Some(RootLayer { image, upper });
        Ok(())
    }

    /// Mount the writable root with the overlay context `ctx` (`crate::overlay::context`), its upper
    /// layer the directory `crate::overlay::UPPER` of `scratch` (the sandbox's tmpfs), which the
    /// caller has filled, and make it the root mount.
    pub fn mount_root_layer(&mut self, ctx: &OwnedFd, scratch: BorrowedFd<'_>) -> crate::error::Result<()> {
        let Some(layer) = self.root_layer.as_mut() else {
            return Err(crate::error::Error::InvalidArgument("this sandbox has no writable root to mount".into()));
        };
        use std::os::fd::AsFd;
        let merged = crate::overlay::mount_root(ctx, layer.image.as_fd(), scratch)?;
        let upper = openat2_c(scratch.as_raw_fd(), crate::overlay::UPPER, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE_ONE)
            .map_err(|e| crate::error::Error::sys("open the root overlay's upper layer")(std::io::Error::from_raw_os_error(e.0)))?;
        layer.upper = Some(upper);
        let root = self.mounts.iter_mut().find(|m| m.at == "/").ok_or_else(|| crate::error::Error::Remote("the sandbox has no root mount".into()))?;
        root.dir = merged;
        root.writable = true;
        Ok(())
    }

    /// For the normalised guest path `abs` of a file on a mounted writable root that the sandbox
    /// has not copied up (nothing at that path in the upper layer, not even a directory on the
    /// way): the image's own file, opened read-only. Overlayfs gives each mount a device number of
    /// its own, so the merged view's identity of an image file differs in every sandbox; the
    /// image's is the one the template's zygote saw, which caches keyed by file identity (the
    /// program files `exec` keeps, `vmm::image_cache`) can then share.
    pub fn image_file(&self, abs: &str) -> Option<OwnedFd> {
        let layer = self.root_layer.as_ref()?;
        let upper = layer.upper.as_ref()?;
        let (i, rel) = self.locate_idx(abs)?;
        if self.mounts[i].at != "/" || !self.mounts[i].writable || rel.is_empty() {
            return None;
        }
        let beneath = libc::RESOLVE_BENEATH | libc::RESOLVE_NO_SYMLINKS | libc::RESOLVE_NO_MAGICLINKS;
        match openat2(upper.as_raw_fd(), rel, libc::O_PATH, 0, beneath) {
            Err(e) if e == ENOENT => openat2(layer.image.as_raw_fd(), rel, libc::O_RDONLY, 0, beneath).ok(),
            _ => None,
        }
    }

    /// Whether the root is a mounted writable root.
    pub fn root_mounted(&self) -> bool {
        self.root_layer.as_ref().is_some_and(|l| l.upper.is_some()) && self.mounts.iter().any(|m| m.at == "/" && m.writable)
    }

    /// Make host directory `host` appear at guest path `at`.
    pub fn mount(&mut self, at: &str, host: &Path, writable: bool) -> std::io::Result<()> {
        let dir = open_dir(host)?;
        self.mount_fd(at, dir, writable, host.to_path_buf())
    }

    /// Make the directory `dir` (a descriptor: it may lie on a sandbox's detached tmpfs, which has
    /// no path) appear at guest path `at`; `host` is what it is called in messages.
    pub fn mount_fd(&mut self, at: &str, dir: OwnedFd, writable: bool, host: std::path::PathBuf) -> std::io::Result<()> {
        let at = join("/", at.as_bytes()).map_err(|e| std::io::Error::from_raw_os_error(e.0))?;
        if let Some(m) = self.mounts.iter_mut().find(|m| m.at == at) {
            m.dir = dir;
            m.writable = writable;
            m.host = host;
        } else {
            self.mounts.push(Mount { at, dir, writable, host });
        }
        self.mounts.sort_by_key(|m| std::cmp::Reverse(m.at.len()));
        Ok(())
    }

    /// Whether the normalised guest path `p` is in an engine-served tree (`/dev`, `/proc`) and not
    /// on a mount inside one (a sandbox's `/dev/shm` is a writable mount).
    pub fn is_virtual(&self, p: &str) -> bool {
        is_virtual(p) && !self.mounts.iter().any(|m| m.at != "/" && (p == m.at || is_under(p, &m.at)))
    }

    /// Index of the mount holding the normalised guest path `abs`, and the path relative to it.
    pub fn locate_idx<'p>(&self, abs: &'p str) -> Option<(usize, &'p str)> {
        for (i, m) in self.mounts.iter().enumerate() {
            if m.at == "/" {
                return Some((i, abs.trim_start_matches('/')));
            }
            if abs == m.at {
                return Some((i, ""));
            }
            if is_under(abs, &m.at) {
                return Some((i, &abs[m.at.len() + 1..]));
            }
        }
        None
    }

    /// The mount holding the normalised guest path `abs`, and the path relative to that mount.
    pub fn locate<'a>(&'a self, abs: &'a str) -> (&'a Mount, &'a str) {
        match self.locate_idx(abs) {
            Some((i, rel)) => (&self.mounts[i], rel),
            // A Vfs always has a root mount; an empty one resolves nothing.
            None => (&self.mounts[self.mounts.len() - 1], abs),
        }
    }

    /// Whether the mount holding the normalised guest path `abs` is writable.
    pub fn writable(&self, abs: &str) -> bool {
        !self.is_virtual(abs) && self.locate_idx(abs).is_some_and(|(i, _)| self.mounts[i].writable)
    }

    fn mount_cursor(&self, i: usize) -> Cursor<'_> {
        let m = &self.mounts[i];
        Cursor { path: m.at.clone(), host: Some((DirFd::Borrowed(m.dir_fd()), i)) }
    }

    fn root_cursor(&self) -> Result<Cursor<'_>, Errno> {
        let i = self.mounts.iter().position(|m| m.at == "/").ok_or(ENOENT)?;
        Ok(self.mount_cursor(i))
    }

    /// A cursor on a normalised guest path that holds no symlink (walk results, the cwd). ELOOP if
    /// it holds one after all.
    fn open_canonical(&self, abs: &str) -> Result<Cursor<'_>, Errno> {
        if self.is_virtual(abs) {
            return Ok(Cursor { path: abs.to_string(), host: None });
        }
        let (i, rel) = self.locate_idx(abs).ok_or(ENOENT)?;
        if rel.is_empty() {
            return Ok(self.mount_cursor(i));
        }
        let m = &self.mounts[i];
        let cacheable = m.at == "/" && !m.writable && self.root_layer.is_none();
        if cacheable {
            if let Ok(mut c) = self.dirs.lock() {
                if c.root != m.host {
                    c.root = m.host.clone();
                    c.dirs.clear();
                }
                if let Some(fd) = c.dirs.get(rel) {
                    return Ok(Cursor { path: abs.to_string(), host: Some((DirFd::Shared(fd.clone()), i)) });
                }
            }
        }
        let fd = openat2(m.dir.as_raw_fd(), rel, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE_ONE)?;
        if cacheable {
            if let Ok(mut c) = self.dirs.lock() {
                if c.dirs.len() >= DIR_CACHE {
                    c.dirs.clear();
                }
                let fd = std::sync::Arc::new(fd);
                c.dirs.insert(rel.to_string(), fd.clone());
                return Ok(Cursor { path: abs.to_string(), host: Some((DirFd::Shared(fd), i)) });
            }
        }
        Ok(Cursor { path: abs.to_string(), host: Some((DirFd::Owned(fd), i)) })
    }

    /// Resolve guest path `path`, relative to guest directory `cwd` (a path from an earlier
    /// lookup), treating its last component as `mode` says. `exe` is the target of
    /// `/proc/self/exe`. The object need not exist (the caller's host call reports ENOENT), but
    /// every directory on the way must.
    pub fn resolve(&self, cwd: &str, path: &[u8], mode: Lookup, exe: Option<&str>) -> Result<Resolved<'_>, Errno> {
        if path.is_empty() {
            return Err(ENOENT);
        }
        if path.len() >= PATH_MAX {
            return Err(ENAMETOOLONG);
        }
        let path = &guest_str(path);
        let start = if path.starts_with('/') { "/" } else { cwd };
        let mut comps: VecDeque<String> = start
            .split('/')
            .chain(path.split('/'))
            .filter(|c| !c.is_empty() && *c != ".")
            .map(str::to_string)
            .collect();
        if path.ends_with('/') && mode != Lookup::Parent && !comps.is_empty() {
            // "dir/" is "dir/.": dir is followed and must be a directory.
            comps.push_back(".".into());
        }
        // Fast path: no "..", and the directory part opens without meeting a symlink.
        if !comps.iter().any(|c| c == "..") {
            let dir_abs = match comps.len() {
                0 => "/".to_string(),
                n => format!("/{}", comps.iter().take(n - 1).map(String::as_str).collect::<Vec<_>>().join("/")),
            };
            if !self.is_virtual(&dir_abs) {
                match self.open_canonical(&dir_abs) {
                    Ok(cur) => {
                        let last: VecDeque<String> = comps.pop_back().into_iter().collect();
                        return self.walk(cur, last, mode, cwd, exe);
                    }
                    Err(e) if e == ELOOP => {}
                    Err(e) => return Err(e),
                }
            }
        }
        let root = self.root_cursor()?;
        self.walk(root, comps, mode, cwd, exe)
    }

    fn walk<'a>(
        &'a self,
        mut cur: Cursor<'a>,
        mut comps: VecDeque<String>,
        mode: Lookup,
        cwd: &str,
        exe: Option<&str>,
    ) -> Result<Resolved<'a>, Errno> {
        let mut links = 0u32;
        // Splice a symlink's target in front of the remaining components.
        let mut expand = |cur: &mut Cursor<'a>, comps: &mut VecDeque<String>, target: &[u8]| -> Result<(), Errno> {
            links += 1;
            if links > MAX_SYMLINKS {
                return Err(ELOOP);
            }
            if target.is_empty() {
                return Err(ENOENT);
            }
            let t = &guest_str(target);
            for c in t.split('/').rev().filter(|c| !c.is_empty() && *c != ".") {
                comps.push_front(c.to_string());
            }
            if comps.len() > PATH_MAX * 2 {
                return Err(ENAMETOOLONG);
            }
            if t.starts_with('/') {
                *cur = self.root_cursor()?;
            }
            Ok(())
        };
        loop {
            let Some(c) = comps.pop_front() else {
                return Ok(cur.into_resolved(self));
            };
            let last = comps.is_empty();
            if c == "." {
                continue;
            }
            if c == ".." {
                if cur.path != "/" {
                    cur = self.open_canonical(parent(&cur.path))?;
                }
                continue;
            }
            if c.len() > NAME_MAX {
                return Err(ENAMETOOLONG);
            }
            let follow = !last || mode == Lookup::Follow;
            let path = child(&cur.path, &c);
            // A mount point, also one inside an engine-served tree (a sandbox's `/dev/shm`).
            if let Some(i) = self.mounts.iter().position(|m| m.at == path) {
                cur = self.mount_cursor(i);
                continue;
            }
            // The engine-served trees: named lexically, with their own symlinks.
            if cur.host.is_none() || self.is_virtual(&path) {
                if follow {
                    if let Some(t) = virtual_link(&path, cwd, exe) {
                        if t.starts_with('/') {
                            expand(&mut cur, &mut comps, t.as_bytes())?;
                            continue;
                        }
                    }
                }
                if last {
                    return Ok(Resolved { path, target: Target::Virtual, lstat: None });
                }
                cur = Cursor { path, host: None };
                continue;
            }
            let Some((dir, mount)) = cur.host.as_ref() else {
                return Err(ENOENT);
            };
            let (dirfd, mount) = (dir.as_raw_fd(), *mount);
            let name = CString::new(guest_bytes(&c)).map_err(|_| EINVAL)?;
            if last {
                let mut lstat = None;
                if follow {
                    // A symlink is followed; anything else (or nothing: ENOENT) is the object,
                    // whose lstat the caller may use.
                    match lstat_at(dirfd, &name) {
                        Ok(st) if st.st_mode & libc::S_IFMT == libc::S_IFLNK => {
                            if let Ok(t) = readlink_at(dirfd, &name) {
                                expand(&mut cur, &mut comps, &t)?;
                                continue;
                            }
                        }
                        Ok(st) => lstat = Some(st),
                        Err(_) => {}
                    }
                }
                let writable = self.mounts[mount].writable;
                let dir = match cur.host {
                    Some((d, _)) => d,
                    None => return Err(ENOENT),
                };
                return Ok(Resolved { path, target: Target::Host { dir, name, mount, writable }, lstat });
            }
            match openat2(dirfd, &c, libc::O_PATH | libc::O_DIRECTORY, 0, RESOLVE_ONE) {
                Ok(fd) => cur = Cursor { path, host: Some((DirFd::Owned(fd), mount)) },
                Err(e) if e == ELOOP => {
                    let t = readlink_at(dirfd, &name).map_err(|_| ELOOP)?;
                    expand(&mut cur, &mut comps, &t)?;
                }
                Err(e) => return Err(e),
            }
        }
    }

    /// Open guest path `path` (relative to guest directory `cwd`) with open(2) `flags` and `mode`.
    /// Writes (and creations) on a read-only mount fail with EROFS; the engine-served trees
    /// (`/dev`, `/proc`) are not host files and fail with EACCES here (`files` serves them).
    pub fn open(&self, cwd: &str, path: &[u8], flags: i32, mode: u32) -> Result<OwnedFd, Errno> {
        let r = self.resolve(cwd, path, open_lookup(flags), None)?;
        self.open_resolved(&r, flags, mode)
    }

    /// Like [`Vfs::open`], also returning the file's normalised guest path.
    pub fn open_path(&self, cwd: &str, path: &[u8], flags: i32, mode: u32) -> Result<(OwnedFd, String), Errno> {
        let r = self.resolve(cwd, path, open_lookup(flags), None)?;
        let fd = self.open_resolved(&r, flags, mode)?;
        Ok((fd, r.path))
    }

    /// Open a looked-up object with open(2) `flags` and `mode` (the host fd is always O_CLOEXEC).
    pub fn open_resolved(&self, r: &Resolved, flags: i32, mode: u32) -> Result<OwnedFd, Errno> {
        let Some((dir, name)) = r.host() else {
            return Err(EACCES);
        };
        let flags = flags & VALID_OPEN_FLAGS;
        if !r.writable() {
            if open_writes(flags) {
                return Err(EROFS);
            }
            if flags & libc::O_CREAT != 0 {
                // Creating on a read-only file system is EROFS; opening what exists is fine.
                return match openat2_c(dir, name, flags & !(libc::O_CREAT | libc::O_EXCL), 0, RESOLVE_ONE) {
                    Err(e) if e == ENOENT => Err(EROFS),
                    Ok(_) if flags & libc::O_EXCL != 0 => Err(EEXIST),
                    other => other,
                };
            }
        }
        openat2_c(dir, name, flags, mode & 0o7777, RESOLVE_ONE)
    }
}

impl Mount {
    fn dir_fd(&self) -> BorrowedFd<'_> {
        use std::os::fd::AsFd;
        self.dir.as_fd()
    }
}

/// `openat2(dirfd, path, {flags | O_CLOEXEC, mode, resolve})`.
pub fn openat2(dirfd: RawFd, path: &str, flags: i32, mode: u32, resolve: u64) -> Result<OwnedFd, Errno> {
    let c = CString::new(guest_bytes(path)).map_err(|_| EINVAL)?;
    openat2_c(dirfd, &c, flags, mode, resolve)
}

/// [`openat2`] of a host name (raw bytes, as a lookup's [`Resolved::host`] gives it).
pub fn openat2_c(dirfd: RawFd, c: &CStr, flags: i32, mode: u32, resolve: u64) -> Result<OwnedFd, Errno> {
    // SAFETY: open_how is plain data; all-zero is valid and we fill every field.
    let mut how: libc::open_how = unsafe { std::mem::zeroed() };
    let flags = flags | libc::O_CLOEXEC;
    how.flags = flags as u32 as u64;
    how.mode = if flags & libc::O_CREAT != 0 || flags & libc::O_TMPFILE == libc::O_TMPFILE { mode as u64 } else { 0 };
    how.resolve = resolve;
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

/// `openat2(dirfd, path, {flags, mode, RESOLVE_IN_ROOT | RESOLVE_NO_MAGICLINKS})`.
pub fn openat2_in_root(dirfd: RawFd, path: &str, flags: i32, mode: u32) -> Result<OwnedFd, Errno> {
    openat2(dirfd, path, flags, mode, libc::RESOLVE_IN_ROOT | libc::RESOLVE_NO_MAGICLINKS)
}

/// The target of symlink `name` in host directory `dir` (EINVAL if it is not a symlink).
/// `fstatat(dir, name, AT_SYMLINK_NOFOLLOW)`.
pub fn lstat_at(dir: RawFd, name: &CStr) -> Result<libc::stat, Errno> {
    // SAFETY: a zeroed stat is valid; fstatat fills it.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: a valid C string and out-pointer; the result is checked; never follows a symlink.
    if unsafe { libc::fstatat(dir, name.as_ptr(), &mut st, libc::AT_SYMLINK_NOFOLLOW) } < 0 {
        return Err(Errno::last());
    }
    Ok(st)
}

pub fn readlink_at(dir: RawFd, name: &CStr) -> Result<Vec<u8>, Errno> {
    let mut buf = vec![0u8; PATH_MAX];
    // SAFETY: a valid C string and a buffer of the length we pass; the result is checked.
    let n = unsafe { libc::readlinkat(dir, name.as_ptr(), buf.as_mut_ptr().cast(), buf.len()) };
    if n < 0 {
        return Err(Errno::last());
    }
    buf.truncate(n as usize);
    Ok(buf)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::ffi::OsStrExt;

    struct TempDir(std::path::PathBuf);
    impl Drop for TempDir {
        fn drop(&mut self) {
            let _ = std::fs::remove_dir_all(&self.0);
        }
    }
    fn tempdir(tag: &str) -> TempDir {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let d = std::env::temp_dir().join(format!("vfs-{tag}-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        TempDir(d)
    }

    /// root/ (read-only) with etc/hostname, usr/lib/libx, lib -> usr/lib, escaping symlinks; tmp/
    /// and work/ (writable) mounted at /tmp and /work; `secret` outside every mount.
    fn sandbox(tag: &str) -> (TempDir, Vfs) {
        let t = tempdir(tag);
        let d = &t.0;
        for p in ["root/etc", "root/usr/lib", "root/tmp", "tmp", "work/sub"] {
            std::fs::create_dir_all(d.join(p)).unwrap();
        }
        std::fs::write(d.join("root/etc/hostname"), "sandbox").unwrap();
        std::fs::write(d.join("root/usr/lib/libx"), "libx").unwrap();
        std::fs::write(d.join("root/tmp/shadowed"), "root's tmp").unwrap();
        std::fs::write(d.join("secret"), "host").unwrap();
        std::fs::write(d.join("work/sub/data"), "data").unwrap();
        let ln = |t: &str, at: &str| std::os::unix::fs::symlink(t, d.join(at)).unwrap();
        ln("usr/lib", "root/lib");
        ln("/../../secret", "root/etc/abs-escape");
        ln("../../../../secret", "root/etc/rel-escape");
        ln("/usr/lib/libx", "root/etc/abs-inside");
        ln("/etc/hostname", "work/to-root");
        ln("../tmp", "work/to-tmp");
        ln("loop2", "work/loop1");
        ln("loop1", "work/loop2");
        let mut v = Vfs::new(&d.join("root")).unwrap();
        v.mount("/tmp", &d.join("tmp"), true).unwrap();
        v.mount("/work", &d.join("work"), true).unwrap();
        (t, v)
    }

    fn read(v: &Vfs, cwd: &str, p: &str) -> Result<String, Errno> {
        use std::io::Read;
        let fd = v.open(cwd, p.as_bytes(), libc::O_RDONLY, 0)?;
        let mut s = String::new();
        std::fs::File::from(fd).read_to_string(&mut s).unwrap();
        Ok(s)
    }

    #[test]
    fn join_normalises() {
        assert_eq!(join("/usr", b"lib/../bin").unwrap(), "/usr/lib/../bin");
        assert_eq!(join("/usr", b"/etc//passwd").unwrap(), "/etc/passwd");
        assert_eq!(join("/", b".").unwrap(), "/");
    }

    #[test]
    fn path_bytes_round_trip_through_the_escaped_strings() {
        let samples: [&[u8]; 6] = [
            b"plain/ascii",
            "caf\u{e9}/\u{1F600}".as_bytes(),
            b"latin1-\xe9t\xe9",
            b"\xff\xfe\x80",
            "edge-\u{10FF80}-\u{10FFFF}".as_bytes(),
            b"mixed-\xc3\x28/\xf4\x8f\xbe\x80",
        ];
        for s in samples {
            let g = guest_str(s);
            assert_eq!(guest_bytes(&g), s, "{s:?}");
            assert_eq!(g.matches('/').count(), s.iter().filter(|&&b| b == b'/').count());
        }
        assert_eq!(guest_str(b"ascii"), "ascii");
        assert_ne!(guest_str(b"\xe9"), guest_str("\u{10FFE9}".as_bytes()));
        // A non-UTF-8 name is a file like any other, made and found through the escaped form.
        let (t, v) = sandbox("bytes");
        let fd = v.open("/", b"/work/\xff\xfe.txt", libc::O_CREAT | libc::O_WRONLY, 0o644).unwrap();
        drop(fd);
        assert!(t.0.join("work").join(std::ffi::OsStr::from_bytes(b"\xff\xfe.txt")).is_file());
        assert_eq!(join("/work", b"\xff").unwrap(), guest_str(b"/work/\xff"));
    }

    #[test]
    fn paths_cannot_leave_the_root() {
        let (_t, v) = sandbox("escape");
        assert_eq!(read(&v, "/", "/etc/hostname").unwrap(), "sandbox");
        assert_eq!(read(&v, "/etc", "../../../secret").unwrap_err(), ENOENT);
        assert_eq!(read(&v, "/", "/../../secret").unwrap_err(), ENOENT);
        assert_eq!(read(&v, "/", "/etc/abs-escape").unwrap_err(), ENOENT);
        assert_eq!(read(&v, "/", "/etc/rel-escape").unwrap_err(), ENOENT);
        assert_eq!(read(&v, "/tmp", "../../secret").unwrap_err(), ENOENT);
        assert_eq!(read(&v, "/work/sub", "../../../../secret").unwrap_err(), ENOENT);
        // Symlinks resolve inside the sandbox, relative and absolute, across mounts.
        assert_eq!(read(&v, "/", "/etc/abs-inside").unwrap(), "libx");
        assert_eq!(read(&v, "/", "/lib/libx").unwrap(), "libx");
        assert_eq!(read(&v, "/", "/work/to-root").unwrap(), "sandbox");
        assert_eq!(read(&v, "/work", "to-tmp/../etc/hostname").unwrap(), "sandbox");
        assert_eq!(read(&v, "/", "/work/loop1").unwrap_err(), ELOOP);
        // ".." from a mount point is the guest parent, not the host one.
        assert_eq!(read(&v, "/tmp", "../etc/hostname").unwrap(), "sandbox");
        assert_eq!(read(&v, "/", "/work/sub/../../usr/lib/libx").unwrap(), "libx");
        // The mount hides the root's own /tmp.
        assert_eq!(read(&v, "/", "/tmp/shadowed").unwrap_err(), ENOENT);
        // O_NOFOLLOW on a symlink.
        assert_eq!(v.open("/", b"/etc/abs-inside", libc::O_RDONLY | libc::O_NOFOLLOW, 0).unwrap_err(), ELOOP);
    }

    #[test]
    fn resolution_reports_normalised_paths() {
        let (_t, v) = sandbox("paths");
        let r = v.resolve("/", b"/lib/libx", Lookup::Follow, None).unwrap();
        assert_eq!(r.path, "/usr/lib/libx");
        let r = v.resolve("/work", b"to-tmp/", Lookup::Follow, None).unwrap();
        assert_eq!(r.path, "/tmp");
        assert!(r.is_dir_itself() && r.writable());
        let r = v.resolve("/work", b"to-tmp", Lookup::NoFollow, None).unwrap();
        assert_eq!(r.path, "/work/to-tmp");
        let r = v.resolve("/", b"/dev/stdout", Lookup::Follow, None).unwrap();
        assert!(r.is_virtual());
        assert_eq!(r.path, "/proc/self/fd/1");
        let r = v.resolve("/", b"/proc/self/exe", Lookup::Follow, Some("/lib/libx")).unwrap();
        assert_eq!(r.path, "/usr/lib/libx");
        let r = v.resolve("/proc", b"../etc/hostname", Lookup::Follow, None).unwrap();
        assert_eq!(r.path, "/etc/hostname");
        assert!(!r.writable());
        assert_eq!(v.resolve("/", b"/etc/hostname/x", Lookup::Follow, None).err(), Some(super::super::ENOTDIR));
        assert_eq!(v.resolve("/", b"/nope/x", Lookup::Follow, None).err(), Some(ENOENT));
    }

    /// A read-only image root keeps the directories its lookups opened ([`DirCache`]): the second
    /// lookup under the same directory finds it open (the same descriptor; fails without the
    /// cache: each lookup opened its own). A writable mount's directories are opened every time
    /// (there a directory can be renamed away), and what a lookup finds there follows the change.
    #[test]
    fn a_read_only_roots_directories_stay_open_and_a_writable_mounts_do_not() {
        let (t, v) = sandbox("dircache");
        let dir_of = |p: &str| match v.resolve("/", p.as_bytes(), Lookup::Follow, None).unwrap().target {
            Target::Host { dir: DirFd::Shared(fd), .. } => Some(fd.as_raw_fd()),
            Target::Host { .. } => None,
            Target::Virtual => panic!("{p} is not virtual"),
        };
        let first = dir_of("/usr/lib/libx").expect("the root's /usr/lib kept open");
        assert_eq!(dir_of("/usr/lib/missing"), Some(first));
        assert_ne!(dir_of("/etc/hostname"), Some(first));
        assert_eq!(dir_of("/work/sub/data"), None);
        std::fs::rename(t.0.join("work/sub"), t.0.join("work/moved")).unwrap();
        std::fs::create_dir(t.0.join("work/sub")).unwrap();
        std::fs::write(t.0.join("work/sub/data"), "new").unwrap();
        assert_eq!(read(&v, "/", "/work/sub/data").unwrap(), "new");
    }

    #[test]
    fn writes_only_on_writable_mounts() {
        let (t, v) = sandbox("rw");
        let cw = libc::O_CREAT | libc::O_WRONLY;
        assert_eq!(v.open("/", b"/etc/new", cw, 0o644).unwrap_err(), EROFS);
        assert_eq!(v.open("/", b"/etc/hostname", libc::O_RDWR, 0).unwrap_err(), EROFS);
        assert_eq!(v.open("/", b"/etc/hostname", libc::O_RDONLY | libc::O_TRUNC, 0).unwrap_err(), EROFS);
        // O_CREAT on an existing file of a read-only mount just opens it.
        assert!(v.open("/", b"/etc/hostname", libc::O_RDONLY | libc::O_CREAT, 0o644).is_ok());
        assert!(v.open("/", b"/tmp/new", cw, 0o644).is_ok());
        assert!(t.0.join("tmp/new").exists());
        assert!(v.open("/work/sub", b"new", cw, 0o644).is_ok());
        assert!(t.0.join("work/sub/new").exists());
        // A symlink in a writable mount does not make the root writable.
        assert_eq!(v.open("/", b"/work/to-root", libc::O_WRONLY, 0).unwrap_err(), EROFS);
        assert_eq!(std::fs::read_to_string(t.0.join("root/etc/hostname")).unwrap(), "sandbox");
    }
}
