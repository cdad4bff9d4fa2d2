//! The Linux personality's state in snapshots, and each sandbox's private writable directories.
//!
//! A snapshot of a Linux guest carries, besides memory and vCPU: the address-space bookkeeping
//! ([`Mm`]), the process settings ([`Proc`]), the fd table as descriptions that can be reopened
//! (guest path, open flags, offset), and a copy of every writable mount (`fs/m<i>/` beside the state
//! file). Host pipes, sockets, memfds and ptys cannot be reopened, so a snapshot with one open says which
//! fd it is and refuses.
//!
//! Writable mounts are host directories. A sandbox made from a snapshot, or forked from another
//! sandbox, gets its own copy in its runtime directory ([`vm_dir`]), so sandboxes never see each
//! other's files; the controller deletes that directory when it destroys the sandbox.

use std::collections::{BTreeMap, HashMap};
use std::os::fd::{AsRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::Ordering;
use std::sync::Arc;

use serde::{Deserialize, Serialize};

use std::os::fd::AsFd;

use super::files::{Files, Kind, OpenFile};
use super::tree;
use super::process::Proc;
use super::mm::{MapFd, Mm, Vma};
use super::vfs::Vfs;
use super::GuestOs;
use crate::error::{Error, Result};

/// One open file description, as it can be recreated.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub enum FileState {
    /// A file or directory reopened by guest path with these status flags, at this offset.
    Path { path: String, flags: i32, offset: u64, dir: bool },
    Capture(u8),
    /// The agent channel (its queues are empty at a snapshot: the agent is idle).
    Agent,
    Null,
    Zero,
    Random,
    Data { bytes: Vec<u8>, pos: u64, path: Option<String> },
    VirtDir { entries: Vec<(String, u8)>, path: Option<String> },
}

/// A guest process's OS state, serializable.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct OsState {
    pub mm: Mm,
    pub proc: Proc,
    pub enosys: BTreeMap<u64, u64>,
    /// The process's threads: the loaded one's registers are the vCPU's, the others' are here.
    pub threads: super::thread::Threads,
    /// Descriptions, and the fd table as (fd, index into `files`, cloexec): dup'd fds share.
    pub files: Vec<FileState>,
    pub fds: Vec<(i32, u32, bool)>,
    /// Host path of the read-only root filesystem.
    pub root: PathBuf,
    /// Writable mounts: guest path; their contents are in the snapshot's `fs/m<i>/`.
    pub mounts: Vec<String>,
    /// Read-only mounts besides the root: guest path and host directory.
    pub ro_mounts: Vec<(String, PathBuf)>,
}

/// Where sandboxes keep their private writable directories: `$COLLIMATE_RUNTIME_DIR`, else a
/// directory in /dev/shm (memory-backed: forks copy these trees), else in the temp directory.
pub fn runtime_dir() -> PathBuf {
    if let Some(d) = std::env::var_os("COLLIMATE_RUNTIME_DIR") {
        return PathBuf::from(d);
    }
    let shm = Path::new("/dev/shm");
    if shm.is_dir() {
        return shm.join("collimate");
    }
    std::env::temp_dir().join("collimate-runtime")
}

/// The private directory of the sandbox whose VMM process is `pid`.
pub fn vm_dir(pid: i32) -> PathBuf {
    runtime_dir().join(format!("vm-{pid}"))
}

/// Where a sandbox keeps its private copies of the writable mounts (`m0`, `m1`, ...): its own
/// tmpfs (`crate::quota`: the disk quota) and, for /dev/shm, which is shared memory, its
/// shared-memory pool (`vstate::shared::pool`, a tmpfs sized to its shared-memory limit); or, where
/// the host cannot make them (no CAP_SYS_ADMIN) and for template zygotes, a directory under the
/// runtime directory ([`vm_dir`]).
#[derive(Clone, Debug)]
pub enum ScratchRoot {
    Dir(PathBuf),
    Tmpfs { disk: Arc<OwnedFd>, shm: Option<Arc<OwnedFd>> },
}

/// Where a snapshot's `fs/` keeps a writable root's upper layer (`crate::overlay`); a sandbox's
/// tmpfs keeps it at `crate::overlay::UPPER`.
pub const ROOT_UPPER: &str = "root";

/// The writable mount that lives in the shared-memory pool rather than on the disk quota.
pub const SHM_MOUNT: &str = "/dev/shm";

impl ScratchRoot {
    /// The root that holds the mount at guest path `at`, opened (a directory is created if missing).
    pub fn open(&self, at: &str) -> std::io::Result<OwnedFd> {
        match self {
            ScratchRoot::Dir(p) => tree::open_dir_path(p, true),
            ScratchRoot::Tmpfs { shm: Some(shm), .. } if at == SHM_MOUNT => shm.try_clone(),
            ScratchRoot::Tmpfs { disk, .. } => disk.try_clone(),
        }
    }

    /// What mount `i` (at guest path `at`) is called in messages and in [`super::vfs::Mount::host`].
    pub fn label(&self, i: usize, at: &str) -> PathBuf {
        match self {
            ScratchRoot::Dir(p) => p.join(format!("m{i}")),
            ScratchRoot::Tmpfs { shm: Some(_), .. } if at == SHM_MOUNT => PathBuf::from(format!("<sandbox shared memory>/m{i}")),
            ScratchRoot::Tmpfs { .. } => PathBuf::from(format!("<sandbox tmpfs>/m{i}")),
        }
    }

    /// A fresh, empty directory for mount `i` (at guest path `at`) holding a copy of the tree `src`.
    pub fn fill(&self, i: usize, at: &str, src: std::os::fd::BorrowedFd<'_>) -> std::io::Result<OwnedFd> {
        let root = self.open(at)?;
        let dir = tree::fresh_dir(root.as_fd(), &format!("m{i}"))?;
        tree::copy_tree_at(src, dir.as_fd())?;
        Ok(dir)
    }
}

fn lost(what: String) -> Error {
    Error::InvalidArgument(what)
}

impl OsState {
    /// Capture `os`. With `fs_dir`, copy the writable mounts' contents there (`m0`, `m1`, ...).
    pub fn capture(os: &GuestOs, fs_dir: Option<&Path>) -> Result<OsState> {
        let mut index: HashMap<*const OpenFile, u32> = HashMap::new();
        let mut files = Vec::new();
        let mut fds = Vec::new();
        for fd in os.files.open_fds() {
            let slot = os.files.get(fd).map_err(|_| lost(format!("fd {fd} vanished")))?;
            let key = Arc::as_ptr(&slot.file);
            let i = match index.get(&key) {
                Some(&i) => i,
                None => {
                    files.push(describe(fd, &slot.file)?);
                    index.insert(key, files.len() as u32 - 1);
                    files.len() as u32 - 1
                }
            };
            fds.push((fd, i, slot.cloexec));
        }
        let root = os
            .vfs
            .mounts
            .iter()
            .find(|m| m.at == "/")
            .map(|m| m.host.clone())
            .ok_or_else(|| lost("the sandbox has no root mount".into()))?;
        // A writable root is its upper layer, kept apart (the merged view is the whole image).
        let writable: Vec<_> = os.vfs.mounts.iter().filter(|m| m.writable && m.at != "/").collect();
        if let Some(dir) = fs_dir {
            let _ = std::fs::remove_dir_all(dir);
            let dest = ScratchRoot::Dir(dir.to_path_buf());
            for (i, m) in writable.iter().enumerate() {
                dest.fill(i, &m.at, m.dir.as_fd()).map_err(Error::sys("copy a writable mount into the snapshot"))?;
            }
            if let Some(layer) = &os.vfs.root_layer {
                // Present (if empty) whenever the root is writable: a restore then knows it is.
                let to = tree::open_dir_path(dir, true).and_then(|d| tree::fresh_dir(d.as_fd(), ROOT_UPPER));
                to.and_then(|to| layer.upper.as_ref().map_or(Ok(()), |up| tree::copy_tree_at(up.as_fd(), to.as_fd())))
                    .map_err(Error::sys("copy the writable root's layer into the snapshot"))?;
            }
        }
        Ok(OsState {
            mm: os.mm.clone(),
            proc: Proc { next_pid: super::signal::host::next_pid().unwrap_or(os.proc.next_pid), ..os.proc.clone() },
            enosys: os.enosys.clone(),
            threads: os.threads.clone(),
            files,
            fds,
            root,
            mounts: writable.iter().map(|m| m.at.clone()).collect(),
            ro_mounts: os.vfs.mounts.iter().filter(|m| !m.writable && m.at != "/").map(|m| (m.at.clone(), m.host.clone())).collect(),
        })
    }

    /// A `GuestOs` in this state whose writable mounts are the directories `mount_dirs` (one per
    /// entry of `mounts`, already holding the right contents; with their labels).
    pub fn rebuild(&self, mount_dirs: Vec<(OwnedFd, PathBuf)>) -> Result<GuestOs> {
        let mut vfs = Vfs::new(&self.root).map_err(Error::sys("open the sandbox root"))?;
        for (at, (dir, label)) in self.mounts.iter().zip(mount_dirs) {
            vfs.mount_fd(at, dir, true, label).map_err(Error::sys("open a sandbox mount"))?;
        }
        for (at, dir) in &self.ro_mounts {
            vfs.mount(at, dir, false).map_err(Error::sys("open a sandbox mount"))?;
        }
        let mut os = GuestOs::new(vfs);
        os.mm = self.mm.clone();
        os.proc = self.proc.clone();
        os.enosys = self.enosys.clone();
        os.threads = self.threads.clone();
        os.files = reopen(&os.vfs, &self.files, &self.fds)?;
        // The agent channel is the file at fd 3 if that is one.
        os.agent = os.files.file(3).ok().filter(|f| matches!(f.kind, Kind::Agent(_)));
        Ok(os)
    }
}

fn describe(fd: i32, f: &OpenFile) -> Result<FileState> {
    let flags = f.status_flags().map_err(|e| lost(format!("fd {fd}: errno {}", e.0)))?;
    Ok(match &f.kind {
        Kind::Host(_) if super::files::pty::is_pty(f) => {
            return Err(lost(format!("fd {fd} is a pseudo-terminal, which a snapshot cannot hold; close it before snapshotting")));
        }
        Kind::Host(h) => {
            let Some(path) = f.path.clone() else {
                return Err(lost(format!(
                    "fd {fd} is a pipe, socket or memfd, which a snapshot cannot hold; close it before snapshotting"
                )));
            };
            // SAFETY: lseek on a descriptor we own; a pipe would fail, but those have no path.
            let off = unsafe { libc::lseek(h.as_raw_fd(), 0, libc::SEEK_CUR) };
            FileState::Path { path, flags, offset: off.max(0) as u64, dir: f.dir }
        }
        Kind::Capture(k) => FileState::Capture(*k),
        Kind::Agent(_) => FileState::Agent,
        Kind::Null => FileState::Null,
        Kind::Zero => FileState::Zero,
        Kind::Random => FileState::Random,
        Kind::Data(b) => FileState::Data { bytes: b.clone(), pos: f.pos.load(Ordering::Relaxed), path: f.path.clone() },
        Kind::VirtDir(e) => FileState::VirtDir { entries: e.clone(), path: f.path.clone() },
        Kind::Epoll(_) => {
            return Err(lost(format!("fd {fd} is an epoll instance, which a snapshot cannot hold; close it before snapshotting")));
        }
    })
}

fn reopen(vfs: &Vfs, files: &[FileState], fds: &[(i32, u32, bool)]) -> Result<Files> {
    let mut opened: Vec<Arc<OpenFile>> = Vec::with_capacity(files.len());
    for f in files {
        let file = match f {
            FileState::Path { path, flags, offset, dir } => {
                let open_flags = (flags & !(libc::O_CREAT | libc::O_TRUNC | libc::O_EXCL)) | if *dir { libc::O_DIRECTORY } else { 0 };
                let host = vfs
                    .open("/", path.as_bytes(), open_flags, 0)
                    .map_err(|e| lost(format!("cannot reopen {path}: {}", std::io::Error::from_raw_os_error(e.0))))?;
                if !dir {
                    // SAFETY: lseek on the descriptor just opened.
                    unsafe { libc::lseek(host.as_raw_fd(), *offset as i64, libc::SEEK_SET) };
                }
                let ro = !vfs.mounts.iter().any(|m| m.writable && path.starts_with(&m.at));
                OpenFile::host(host, Some(path.clone()), ro)
            }
            FileState::Capture(k) => OpenFile::new(Kind::Capture(*k), None, libc::O_WRONLY),
            FileState::Agent => OpenFile::new(Kind::Agent(Default::default()), None, libc::O_RDWR),
            FileState::Null => OpenFile::new(Kind::Null, Some("/dev/null".into()), libc::O_RDWR),
            FileState::Zero => OpenFile::new(Kind::Zero, Some("/dev/zero".into()), libc::O_RDWR),
            FileState::Random => OpenFile::new(Kind::Random, Some("/dev/urandom".into()), libc::O_RDWR),
            FileState::Data { bytes, pos, path } => {
                let o = OpenFile::new(Kind::Data(bytes.clone()), path.clone(), libc::O_RDONLY);
                o.pos.store(*pos, Ordering::Relaxed);
                o
            }
            FileState::VirtDir { entries, path } => OpenFile::new(Kind::VirtDir(entries.clone()), path.clone(), libc::O_RDONLY),
        };
        opened.push(Arc::new(file));
    }
    let mut table = Files::empty();
    for &(fd, i, cloexec) in fds {
        let file = opened.get(i as usize).ok_or_else(|| lost(format!("fd {fd} names description {i}")))?;
        table.install(fd, file.clone(), cloexec).map_err(|e| lost(format!("fd {fd}: errno {}", e.0)))?;
    }
    Ok(table)
}

/// Give `os` private copies of its writable mounts in `scratch` (a forked sandbox must not share
/// files with its parent), and reopen the files it has open or mapped in them. Other open files
/// (the root filesystem, pipes, engine files) stay shared, as after a Linux fork.
/// With `ctx` (an overlay context) and a writable root wanted, the child mounts its own over a copy
/// of the parent's upper layer; without, its root stays read-only.
pub fn privatize(os: &mut GuestOs, scratch: &ScratchRoot, ctx: Option<OwnedFd>) -> Result<()> {
    // The parent's mounts: guest path and directory (kept open until the files are repointed).
    let mut writable: Vec<(String, OwnedFd)> = Vec::new();
    for m in os.vfs.mounts.iter().filter(|m| m.writable && m.at != "/") {
        writable.push((m.at.clone(), m.dir.try_clone().map_err(Error::sys("dup a sandbox mount"))?));
    }
    for (i, (at, src)) in writable.iter().enumerate() {
        let d = scratch.fill(i, at, src.as_fd()).map_err(Error::sys("copy a writable mount for a forked sandbox"))?;
        os.vfs.mount_fd(at, d, true, scratch.label(i, at)).map_err(Error::sys("open a sandbox mount"))?;
    }
    let parent_root = os.vfs.root_mounted();
    match ctx {
        Some(ctx) if os.vfs.root_layer.is_some() => mount_root(os, scratch, &ctx)?,
        _ if parent_root => {
            return Err(Error::Protocol("no overlay context for a forked sandbox whose parent's root is writable".into()));
        }
        _ => {}
    }
    // Files open on the parent's writable root are reopened on the child's (all of them: which
    // are the parent's copied-up files is not worth telling apart).
    let in_writable =
        |p: &str| parent_root || writable.iter().any(|(at, _)| p == at || p.starts_with(&format!("{at}/")));
    let mut replaced: HashMap<*const OpenFile, Arc<OpenFile>> = HashMap::new();
    for fd in os.files.open_fds().collect::<Vec<_>>() {
        let Ok(slot) = os.files.get(fd) else { continue };
        let (file, cloexec) = (slot.file.clone(), slot.cloexec);
        let Some(path) = file.path.clone().filter(|p| in_writable(p) && file.host_fd().is_some()) else { continue };
        let key = Arc::as_ptr(&file);
        let new = match replaced.get(&key) {
            Some(f) => f.clone(),
            None => {
                // A file that cannot be reopened (unlinked while open) stays shared with the parent.
                let Ok(f) = describe(fd, &file)
                    .and_then(|st| reopen(&os.vfs, &[st], &[(fd, 0, cloexec)]))
                    .and_then(|t| t.file(fd).map_err(|e| lost(format!("fd {fd}: errno {}", e.0))))
                else {
                    continue;
                };
                replaced.insert(key, f.clone());
                f
            }
        };
        let _ = path;
        os.files.install(fd, new, cloexec).map_err(|e| lost(format!("fd {fd}: errno {}", e.0)))?;
    }
    repoint_mappings(os, &writable);
    Ok(())
}

/// Mount `os`'s writable root with the overlay context `ctx`: its upper layer a fresh directory
/// [`crate::overlay::UPPER`] in `scratch` holding a copy of the layer it had (a parent's, or a
/// snapshot's). Overlayfs must not see an upper layer change under a mount in use: the copy is
/// made before the mount, never after.
pub fn mount_root(os: &mut GuestOs, scratch: &ScratchRoot, ctx: &OwnedFd) -> Result<()> {
    let root = scratch.open("/").map_err(Error::sys("open the sandbox's tmpfs"))?;
    let to = tree::fresh_dir(root.as_fd(), ROOT_UPPER).map_err(Error::sys("make the writable root's layer"))?;
    tree::fresh_dir(root.as_fd(), &crate::overlay::WORK.to_string_lossy()).map_err(Error::sys("make the writable root's layer"))?;
    if let Some(up) = os.vfs.root_layer.as_ref().and_then(|l| l.upper.as_ref()) {
        tree::copy_tree_at(up.as_fd(), to.as_fd()).map_err(Error::sys("copy the writable root's layer"))?;
    }
    os.vfs.mount_root_layer(ctx, root.as_fd())
}

/// Move the writable root of `from` (mounted or not) to `to`, whose root is the image's (a reset
/// that keeps the sandbox's files).
pub fn keep_root(from: &mut Vfs, to: &mut Vfs) {
    let Some(layer) = from.root_layer.take() else { return };
    let old = from.mounts.iter().position(|m| m.at == "/" && m.writable);
    if let (Some(i), Some(root)) = (old, to.mounts.iter_mut().find(|m| m.at == "/")) {
        let m = from.mounts.remove(i);
        root.dir = m.dir;
        root.host = m.host;
        root.writable = true;
    }
    to.root_layer = Some(layer);
}

/// Point the file mappings of files in the writable mounts at the private copies [`privatize`]
/// made: the descriptors lazy mappings read their pages from, and shared ones map (their windows
/// follow in `Mm::privatize_windows`). A forked sandbox then neither reads what its parent writes
/// later nor writes into its parent's files.
fn repoint_mappings(os: &mut GuestOs, writable: &[(String, OwnedFd)]) {
    // By the old descriptor (kept here, so that no other takes its address): its replacement.
    let mut reopened: HashMap<*const OwnedFd, (Arc<OwnedFd>, Option<Arc<OwnedFd>>)> = HashMap::new();
    for v in os.mm.vmas.values_mut() {
        let Some(old) = v.lazy.as_ref().map(|l| l.0.clone()) else { continue };
        let (_, new) = reopened
            .entry(Arc::as_ptr(&old))
            .or_insert_with(|| (old.clone(), private_copy(&os.vfs, writable, v, &old).map(Arc::new)));
        let Some(new) = new.clone() else { continue };
        v.lazy = Some(MapFd(new));
    }
}

/// The private copy of the file mapped by `v` through descriptor `old`, opened like `old`, if it
/// lies in a writable mount. It is found by the guest path it was mapped by, and only if the
/// parent's mount still holds that very file there (same inode): one renamed or unlinked since
/// mmap stays shared with the parent.
fn private_copy(vfs: &Vfs, writable: &[(String, OwnedFd)], v: &Vma, old: &OwnedFd) -> Option<OwnedFd> {
    let (at, src) = writable.iter().find(|(at, _)| v.name.starts_with(&format!("{at}/")))?;
    let id = v.file?;
    if !tree::holds(src.as_fd(), &v.name[at.len() + 1..], (id.dev, id.ino)) {
        return None;
    }
    // SAFETY: F_GETFL on a descriptor we hold.
    let acc = unsafe { libc::fcntl(old.as_raw_fd(), libc::F_GETFL) } & libc::O_ACCMODE;
    vfs.open("/", v.name.as_bytes(), acc | libc::O_CLOEXEC, 0).ok()
}
