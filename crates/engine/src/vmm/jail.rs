//! The jail of a VMM process: defense in depth around the engine itself.
//!
//! A guest reaches nothing but the syscalls the engine services. The jail bounds what a VMM process
//! could do if the engine were subverted anyway (a bug in the syscall layer, in the ELF loader or in
//! snapshot parsing, exploited by a hostile guest or file). Three layers, applied in this order by
//! [`enter`]:
//! 1. **Resource limits** (inherited by forks): open files ([`NOFILE`]), file size (the guest's files,
//!    [`FILE_SIZE_DEFAULT`] unless `COLLIMATE_MAX_FILE_SIZE` says otherwise, but never below the
//!    VM's memory size, since the memfd, the snapshot memory file and its copies are that large), no
//!    core dumps. SIGXFSZ is ignored, so an oversized write fails with EFBIG (which the guest sees, as
//!    on Linux) instead of killing the sandbox. Not set: RLIMIT_AS (guest memory is one large
//!    `MAP_NORESERVE` mapping, so address space says nothing about memory use) and RLIMIT_NPROC
//!    (counted per user, so it would couple unrelated sandboxes; and root ignores it). Guest memory
//!    is bounded by `mem_size` where it is created: the memfd or snapshot file is exactly that long
//!    (`GuestMemory::anonymous`/`from_file`), the KVM memory slot covers exactly that range
//!    (`KvmVm::new`), and the guest gets frames only from `FrameAllocator::new(mem_size)`; host-side
//!    buffers a guest can grow are capped where they are filled (e.g. `OUTPUT_CAP`).
//! 2. **Namespaces** (need CAP_SYS_ADMIN): an empty network namespace (only a loopback that is down;
//!    a VMM never needs a network), and a mount namespace whose root is a read-only tmpfs holding
//!    only, each at its own host path: the sandbox's root filesystem and read-only mounts
//!    (read-only), its writable mounts and the runtime directory where forks make their private copies
//!    (read-write), and for a restored VM the snapshot directory (read-only: `reset` copies its
//!    `fs/` again). All of them `nosuid,nodev,noexec`; besides them, a devpts instance of the jail's
//!    own for the guests' pseudo-terminals. Nothing of the host's `/proc`, `/dev`, `/etc`
//!    or `/home`: the engine serves the guest's `/dev` and `/proc` itself, and `/dev/kvm` is opened
//!    before the pivot ([`take_kvm`]). Without the privilege, the VMM runs without namespaces and
//!    says so ([`JailStatus::namespaces`]); the controller logs that once.
//! 3. **seccomp**: an allow-list ([`allowed_syscalls`], the one place that lists them). Anything
//!    else raises SIGSYS, whose handler prints the syscall number and ends the process.
//!
//! When: a launched VMM process enters the jail after it has *received* its first request (Boot,
//! Spawn or Restore, which name every host path the VM will ever use) and *before* serving it, so
//! parsing the ELF or the snapshot already runs jailed; forks inherit everything. Not after serving
//! it, because a directory fd opened before the pivot keeps pointing into the host's mount tree, and
//! `openat(fd, "../..")` climbs from it to the host's root (verified on this kernel): the `Vfs` mount
//! fds and a restored guest's open directories must be opened inside the jail.
//!
//! Snapshot destinations are chosen by the controller anywhere on the host, after the jail is up.
//! The controller hands the VMM the destination as a *detached copy of its mount*
//! (`open_tree(OPEN_TREE_CLONE)`, attached to `Request::Snapshot` with SCM_RIGHTS; see
//! [`open_snapshot_dest`]) and the VMM writes the snapshot relative to it ([`in_snapshot_dest`]). Unlike a plain
//! directory fd, `..` stops at the root of a detached mount, so the fd opens exactly that directory
//! tree and nothing else of the host. Staging the snapshot in the runtime directory for the
//! controller to move instead would copy the memory file across file systems (tmpfs to disk).
//!
//! Not contained: signals. Without a PID namespace a VMM process can still `kill` or `pidfd_open`
//! any process its credentials allow: it needs both for its own forks and guest processes, and
//! seccomp cannot tell a sandbox's pids from others. A PID namespace per zygote would close this;
//! it changes what the controller's pids mean, so it is left for later.

use std::ffi::CString;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::{Mutex, OnceLock};

use kvm_ioctls::Kvm;
use seccompiler::{
    BpfProgram, SeccompAction, SeccompCmpArgLen as Len, SeccompCmpOp as Op, SeccompCondition as Cond, SeccompFilter,
    SeccompRule,
};

use crate::error::{Error, Result};
use crate::protocol::{JailStatus, Request};

/// Most open files a VMM process (the engine's own plus the guest's) may hold.
pub const NOFILE: u64 = 4096;
/// Largest file a guest may write, unless `COLLIMATE_MAX_FILE_SIZE` (bytes) says otherwise.
pub const FILE_SIZE_DEFAULT: u64 = 1 << 30;
/// Exit status of a VMM process that made a syscall outside the allow-list (128 + SIGSYS).
pub const SECCOMP_EXIT: i32 = 159;

static STATUS: OnceLock<JailStatus> = OnceLock::new();
/// /dev/kvm, opened before the pivot for the first `Machine` of this process.
static KVM: Mutex<Option<std::result::Result<Kvm, kvm_ioctls::Error>>> = Mutex::new(None);

/// What is in force in this process (forks inherit it).
pub fn status() -> JailStatus {
    STATUS.get().copied().unwrap_or_default()
}

/// The /dev/kvm handle opened before the jail went up, once; `None` outside a jailed process or
/// after the first call.
pub fn take_kvm() -> Option<std::result::Result<Kvm, kvm_ioctls::Error>> {
    KVM.lock().ok()?.take()
}

/// A host directory (`source`, canonical) that appears in the jail at `path`: the path the VMM
/// process will use for it (the same, except for paths a snapshot recorded, which are used as
/// they are written there).
#[derive(Debug, Clone, PartialEq, Eq)]
struct Bind {
    path: PathBuf,
    source: PathBuf,
    writable: bool,
}

/// Put the VMM process in its jail. `first` is the launched process's first request: its host
/// paths are made canonical (the jail binds them at those paths, and the process's working directory
/// will be the jail's root). Returns what is in force; an error means the jail could not be built
/// although the host allows it, and the process must not go on.
pub fn enter(first: &mut Request) -> Result<JailStatus> {
    enter_with(first, None::<fn() -> Result<()>>).map(|(status, _)| status)
}

/// [`enter`] for a systrap VMM (`vmm::systrap::serve`): no /dev/kvm; the host's `/proc` is opened
/// first (`platform::systrap::prepare`: guest memory is `/proc/<stub>/mem`, also for the stubs
/// forked later), then `make_stub` runs after the resource limits and before the namespaces and
/// the seccomp filter, since spawning a stub clones with namespace flags, which the allow-list
/// refuses. Everything later (guest forks: `Stub::fork` plus a plain clone of this process,
/// the stub's socket and shared page, `/proc/<pid>/mem` through that descriptor) is within it.
pub fn enter_systrap<T>(first: &mut Request, make_stub: impl FnOnce() -> Result<T>) -> Result<(JailStatus, T)> {
    let (status, stub) = enter_with(first, Some(make_stub))?;
    let stub = stub.ok_or_else(|| Error::Protocol("the systrap jail made no stub".into()))?;
    Ok((status, stub))
}

fn enter_with<T>(first: &mut Request, systrap: Option<impl FnOnce() -> Result<T>>) -> Result<(JailStatus, Option<T>)> {
    let runtime = crate::guestos::persist::runtime_dir();
    std::fs::create_dir_all(&runtime).map_err(Error::sys("create the runtime directory"))?;
    let runtime = std::fs::canonicalize(&runtime).map_err(Error::sys("resolve the runtime directory"))?;
    // runtime_dir() must name the bound directory after the pivot whatever the cwd or symlinks.
    std::env::set_var("COLLIMATE_RUNTIME_DIR", &runtime);
    let mut binds = vec![Bind { path: runtime.clone(), source: runtime.clone(), writable: true }];
    let mem_size = plan(first, &mut binds);

    set_rlimits(mem_size)?;
    let exec = systrap.is_some();
    let made = match systrap {
        Some(make_stub) => {
            crate::platform::systrap::prepare().map_err(|e| Error::Remote(format!("systrap: {e}")))?;
            Some(make_stub()?)
        }
        None => {
            // What kind of KVM this is, while /sys is still there (forks inherit it).
            crate::vstate::profile::current();
            *KVM.lock().map_err(|_| Error::Protocol("kvm slot poisoned".into()))? = Some(Kvm::new());
            None
        }
    };
    let namespaces = match unshare() {
        Ok(()) => {
            build_root(&runtime, &binds, exec)?;
            true
        }
        Err(e) if matches!(e.raw_os_error(), Some(libc::EPERM | libc::EINVAL | libc::ENOSPC | libc::ENOSYS)) => false,
        Err(e) => return Err(Error::Sys { op: "unshare the mount and network namespaces", source: e }),
    };
    install(&filter_for(exec)?)?;
    let status = JailStatus { rlimits: true, namespaces, seccomp: true };
    let _ = STATUS.set(status);
    Ok((status, made))
}

/// The directories `first` needs (added to `binds`, its paths made canonical) and the VM's memory
/// size (0 if not known yet). A Linux guest's snapshot names its root filesystem and read-only
/// mounts, so those are read from its state file.
fn plan(first: &mut Request, binds: &mut Vec<Bind>) -> u64 {
    // A path that does not resolve stays as given: the open inside the jail then fails with the
    // error the caller expects (ENOENT) instead of the jail failing.
    let mut add = |p: &mut PathBuf, writable: bool| {
        if let Ok(c) = std::fs::canonicalize(&*p) {
            *p = c;
            binds.push(Bind { path: p.clone(), source: p.clone(), writable });
        }
    };
    match first {
        Request::Boot { mem_size, .. } => *mem_size,
        Request::Spawn { spec, mem_size, .. } => {
            add(&mut spec.root, false);
            for (_, p) in &mut spec.ro_mounts {
                add(p, false);
            }
            for (_, p) in &mut spec.mounts {
                add(p, true);
            }
            *mem_size
        }
        Request::Restore { dir } => {
            add(dir, false);
            // A damaged state file is reported by the restore itself, inside the jail.
            let (os, mem_size) = match crate::persist::platform_of(dir) {
                Some(crate::protocol::Platform::Systrap) => match super::systrap::snapshot::read_state(dir) {
                    Ok(s) => (Some(s.os), s.budget),
                    Err(_) => return 0,
                },
                _ => match crate::persist::read_state(dir) {
                    Ok(s) => (s.os, s.mem_size),
                    Err(_) => return 0,
                },
            };
            if let Some(os) = &os {
                let recorded = std::iter::once(&os.root).chain(os.ro_mounts.iter().map(|(_, p)| p));
                let plain = |p: &&PathBuf| p.is_absolute() && !p.components().any(|c| c == std::path::Component::ParentDir);
                for p in recorded.filter(plain) {
                    if let Ok(source) = std::fs::canonicalize(p) {
                        binds.push(Bind { path: p.clone(), source, writable: false });
                    }
                }
            }
            mem_size
        }
        _ => 0,
    }
}

fn set_rlimit(resource: libc::__rlimit_resource_t, value: u64, op: &'static str) -> Result<()> {
    let lim = libc::rlimit { rlim_cur: value, rlim_max: value };
    // SAFETY: setrlimit with a valid struct.
    if unsafe { libc::setrlimit(resource, &lim) } != 0 {
        return Err(Error::last_os(op));
    }
    Ok(())
}

fn set_rlimits(mem_size: u64) -> Result<()> {
    let file_size = std::env::var("COLLIMATE_MAX_FILE_SIZE")
        .ok()
        .and_then(|v| v.parse::<u64>().ok())
        .unwrap_or(FILE_SIZE_DEFAULT)
        .max(mem_size);
    let mut cur = libc::rlimit { rlim_cur: 0, rlim_max: 0 };
    // SAFETY: getrlimit into a local struct.
    unsafe { libc::getrlimit(libc::RLIMIT_NOFILE, &mut cur) };
    // Never above the hard limit we were given: only root may raise it.
    set_rlimit(libc::RLIMIT_NOFILE, NOFILE.min(cur.rlim_max), "setrlimit(RLIMIT_NOFILE)")?;
    set_rlimit(libc::RLIMIT_FSIZE, file_size, "setrlimit(RLIMIT_FSIZE)")?;
    set_rlimit(libc::RLIMIT_CORE, 0, "setrlimit(RLIMIT_CORE)")?;
    // SAFETY: ignoring a signal.
    unsafe { libc::signal(libc::SIGXFSZ, libc::SIG_IGN) };
    Ok(())
}

fn unshare() -> std::io::Result<()> {
    // SAFETY: unshare affects only this process (single-threaded here: see serve_fd).
    if unsafe { libc::unshare(libc::CLONE_NEWNS | libc::CLONE_NEWNET) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

fn cstr(p: &Path) -> Result<CString> {
    CString::new(p.as_os_str().as_encoded_bytes())
        .map_err(|_| Error::InvalidArgument(format!("path {} contains a NUL byte", p.display())))
}

fn check(rc: libc::c_int, op: &'static str) -> Result<()> {
    if rc != 0 {
        return Err(Error::last_os(op));
    }
    Ok(())
}

/// An error about `path` (jail setup errors name the directory).
fn at<'a>(path: &'a Path, op: &'static str) -> impl FnOnce(std::io::Error) -> Error + 'a {
    move |e| Error::Sys { op, source: std::io::Error::new(e.kind(), format!("{}: {e}", path.display())) }
}

fn mount(
    src: Option<&Path>,
    target: &Path,
    fstype: Option<&str>,
    flags: libc::c_ulong,
    data: Option<&str>,
    op: &'static str,
) -> Result<()> {
    let src = src.map(cstr).transpose()?;
    let path = target;
    let target = cstr(target)?;
    let fstype = fstype.map(|s| CString::new(s).unwrap_or_default());
    let data = data.map(|s| CString::new(s).unwrap_or_default());
    let p = |c: &Option<CString>| c.as_ref().map_or(std::ptr::null(), |c| c.as_ptr());
    // SAFETY: NUL-terminated strings or nulls, as mount(2) takes them.
    if unsafe { libc::mount(p(&src), target.as_ptr(), p(&fstype), flags, p(&data).cast()) } != 0 {
        return Err(at(path, op)(std::io::Error::last_os_error()));
    }
    Ok(())
}

fn pivot_root(new_root: &Path, put_old: &Path) -> Result<()> {
    let (a, b) = (cstr(new_root)?, cstr(put_old)?);
    // SAFETY: two NUL-terminated paths.
    check(unsafe { libc::syscall(libc::SYS_pivot_root, a.as_ptr(), b.as_ptr()) } as libc::c_int, "pivot_root")
}

fn chdir(p: &Path) -> Result<()> {
    let c = cstr(p)?;
    // SAFETY: a NUL-terminated path.
    check(unsafe { libc::chdir(c.as_ptr()) }, "chdir")
}

fn umount_detach(p: &Path, op: &'static str) -> Result<()> {
    let c = cstr(p)?;
    // SAFETY: a NUL-terminated path.
    check(unsafe { libc::umount2(c.as_ptr(), libc::MNT_DETACH) }, op)
}

/// Make the new root and pivot into it (bubblewrap's sequence): a scratch tmpfs, mounted on
/// `scratch`, becomes the root so that the whole host tree sits under `/oldroot`; the jail's root, a
/// second tmpfs at `/newroot`, gets the binds from there; then the host tree is detached and
/// `/newroot` becomes `/`.
/// `exec`: the sandbox's directories are mounted without `noexec` (a systrap VMM hands the
/// guest's program files to its stub, which maps them executable; a KVM VMM maps nothing
/// executable).
fn build_root(scratch: &Path, binds: &[Bind], exec: bool) -> Result<()> {
    const JAIL_FLAGS: libc::c_ulong = libc::MS_NOSUID | libc::MS_NODEV | libc::MS_NOEXEC;
    // Nothing we mount may propagate back to the host.
    mount(None, Path::new("/"), None, libc::MS_REC | libc::MS_PRIVATE, None, "make all mounts private")?;
    // Any directory serves as the scratch tmpfs's mount point (the caller passes the runtime
    // directory: it exists and is ours); once the tmpfs has become the root it hides nothing.
    let tmpfs = |at: &Path, opts: &str, op| mount(Some(Path::new("jail")), at, Some("tmpfs"), JAIL_FLAGS, Some(opts), op);
    tmpfs(scratch, "mode=0700,size=64k", "mount the scratch tmpfs")?;
    chdir(scratch)?;
    for d in ["oldroot", "newroot"] {
        std::fs::create_dir(d).map_err(Error::sys("create a jail directory"))?;
    }
    pivot_root(Path::new("."), Path::new("oldroot"))?;
    chdir(Path::new("/"))?;
    tmpfs(Path::new("/newroot"), "mode=0755,size=1m", "mount the jail's root")?;

    // Parents before children (sorted paths), so that a bind inside another lands on top of it.
    let mut binds = binds.to_vec();
    binds.sort_by(|a, b| a.path.cmp(&b.path).then(b.writable.cmp(&a.writable)));
    binds.dedup_by(|b, a| a.path == b.path);
    for b in &binds {
        let rel = b.path.strip_prefix("/").unwrap_or(&b.path);
        let target = Path::new("/newroot").join(rel);
        std::fs::create_dir_all(&target).map_err(at(&b.path, "create a mount point in the jail"))?;
        let source = Path::new("/oldroot").join(b.source.strip_prefix("/").unwrap_or(&b.source));
        mount(Some(&source), &target, None, libc::MS_BIND, None, "bind a directory into the jail")?;
        let ro = if b.writable { 0 } else { libc::MS_RDONLY };
        let flags = if exec { JAIL_FLAGS & !libc::MS_NOEXEC } else { JAIL_FLAGS };
        mount(None, &target, None, libc::MS_BIND | libc::MS_REMOUNT | flags | ro, None, "restrict a bind mount")?;
    }
    mount_devpts();
    umount_detach(Path::new("/oldroot"), "detach the host's mounts")?;
    chdir(Path::new("/newroot"))?;
    // pivot_root(".", ".") stacks the old root (the scratch tmpfs) on top of the new one at "/";
    // detaching it leaves the new root.
    pivot_root(Path::new("."), Path::new("."))?;
    umount_detach(Path::new("."), "detach the scratch tmpfs")?;
    chdir(Path::new("/"))?;
    let ro_root = libc::MS_BIND | libc::MS_REMOUNT | libc::MS_RDONLY | JAIL_FLAGS;
    mount(None, Path::new("/"), None, ro_root, None, "make the jail's root read-only")
}

/// Where the jail's own devpts instance is mounted (guests' pseudo-terminals, see `guestos::files::pty`).
const PTS: &str = "/.collimate-pts";

/// Mount a devpts instance of the jail's own (never the host's terminals) at [`PTS`] in the new
/// root; without one the guests have no pseudo-terminals (opening /dev/ptmx says ENOENT), which
/// is no reason to fail the jail. Device nodes must open there, so this mount alone is not
/// `nodev`; devpts holds nothing but ptys.
fn mount_devpts() {
    let target = Path::new("/newroot").join(PTS.trim_start_matches('/'));
    let mounted = std::fs::create_dir(&target).is_ok()
        && mount(
            Some(Path::new("devpts")),
            &target,
            Some("devpts"),
            libc::MS_NOSUID | libc::MS_NOEXEC,
            Some("newinstance,ptmxmode=0666,mode=0620"),
            "mount the jail's devpts",
        )
        .is_ok();
    crate::guestos::files::pty::set_dir(mounted.then(|| PathBuf::from(PTS)));
}

/// Controller side: a handle on `dir` (created if missing) that a jailed VMM process can write a
/// snapshot through: a detached copy of the mount at `dir`, rooted there. `..` stops at its root, so
/// it gives access to that directory tree only.
pub fn open_snapshot_dest(dir: &Path) -> Result<OwnedFd> {
    // Owner-only, as what goes in it (see `GuestMemory::write_image`).
    std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
        .create(dir)
        .map_err(Error::sys("create snapshot directory"))?;
    std::fs::set_permissions(dir, std::os::unix::fs::PermissionsExt::from_mode(0o700)).map_err(Error::sys("make the snapshot directory private"))?;
    let c = cstr(dir)?;
    // SAFETY: open_tree with a NUL-terminated path; the result is checked.
    let fd = unsafe {
        libc::syscall(libc::SYS_open_tree, libc::AT_FDCWD, c.as_ptr(), libc::OPEN_TREE_CLONE | libc::OPEN_TREE_CLOEXEC)
    } as libc::c_int;
    if fd < 0 {
        return Err(Error::last_os("open_tree the snapshot directory"));
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// VMM side of `Request::Snapshot`: run `write` on the destination, which is the directory the
/// controller attached ([`open_snapshot_dest`]) if it attached one, else `dir`.
pub fn in_snapshot_dest(dir: &Path, fds: Vec<OwnedFd>, write: impl FnOnce(&Path) -> Result<()>) -> Result<()> {
    let Some(dest) = fds.into_iter().next() else {
        return write(dir);
    };
    // SAFETY: fchdir to a directory fd we own.
    check(unsafe { libc::fchdir(dest.as_raw_fd()) }, "enter the snapshot directory")?;
    let r = write(Path::new("."));
    // The working directory is the jail's root again (see `build_root`).
    chdir(Path::new("/"))?;
    r
}

// --- seccomp ---------------------------------------------------------------------------------

fn cond(arg: u8, len: Len, op: Op, value: u64) -> Cond {
    // The only failure is an argument index above 5; ours are literals.
    Cond::new(arg, len, op, value).unwrap_or_else(|e| panic!("bad seccomp condition: {e}"))
}

fn rule(conds: Vec<Cond>) -> SeccompRule {
    SeccompRule::new(conds).unwrap_or_else(|e| panic!("bad seccomp rule: {e}"))
}

/// `arg` has none of the bits in `mask`.
fn none_of(arg: u8, mask: u64) -> SeccompRule {
    rule(vec![cond(arg, Len::Qword, Op::MaskedEq(mask), 0)])
}

/// `arg` (a 32-bit value) equals one of `values`.
fn one_of(arg: u8, values: &[u64]) -> Vec<SeccompRule> {
    values.iter().map(|&v| rule(vec![cond(arg, Len::Dword, Op::Eq, v)])).collect()
}

/// Every syscall a VMM process makes once jailed, with the arguments it may pass where they matter.
/// An empty rule list allows the call with any arguments. What is missing on purpose: mount and
/// namespace calls (mount, umount2, pivot_root, unshare, setns, open_tree, move_mount, fsopen,
/// fspick; `fsconfig` and `fsmount` are there for contexts the controller made),
/// execve, ptrace and process_vm_*, socket (no new sockets; the channels come from socketpair),
/// clone3 (its flags sit behind a pointer seccomp cannot read; fork uses clone, and there are no threads),
/// bpf, perf_event_open, io_uring, userfaultfd, keyctl, module and reboot calls, setuid and friends,
/// and changing a resource limit other than RLIMIT_CORE (root could otherwise raise them again).
pub fn allowed_syscalls() -> Vec<(i64, Vec<SeccompRule>)> {
    use libc::*;
    const KVMIO: u64 = 0xAE;
    let no_exec = || vec![none_of(2, PROT_EXEC as u64)];
    let ns_flags =
        (CLONE_NEWNS | CLONE_NEWCGROUP | CLONE_NEWUTS | CLONE_NEWIPC | CLONE_NEWUSER | CLONE_NEWPID | CLONE_NEWNET) as u64;
    let mut ioctls = vec![rule(vec![cond(1, Len::Dword, Op::MaskedEq(0xff00), KVMIO << 8)])];
    // Outside KVM: FIONREAD for a guest's pipes, and the fd flags std sets.
    ioctls.extend(one_of(1, &[FIONREAD, FIONBIO, FIOCLEX, FIONCLEX]));
    // The guests' pseudo-terminals (host ptys of the jail's own devpts).
    ioctls.extend(one_of(1, &crate::guestos::files::pty::host_requests()));
    // systrap: whether a syscall site's mapping is private code (platform::systrap::patch).
    ioctls.extend(one_of(1, &[crate::platform::systrap::patch::PROCMAP_QUERY]));
    let any = Vec::new;
    vec![
        // KVM: every VM, vCPU and dirty-log call is an ioctl of type KVMIO on a KVM fd.
        (SYS_ioctl, ioctls),
        // Guest memory and the heap. No new executable mappings: the VMM never needs one.
        (SYS_mmap, no_exec()),
        (SYS_mprotect, no_exec()),
        (SYS_munmap, any()),
        (SYS_mremap, any()),
        (SYS_madvise, any()),
        (SYS_brk, any()),
        (SYS_memfd_create, any()),
        // The guest's file layer (guestos::files, vfs) and snapshots: I/O on open files...
        (SYS_read, any()),
        (SYS_write, any()),
        (SYS_pread64, any()),
        (SYS_pwrite64, any()),
        (SYS_readv, any()),
        (SYS_writev, any()),
        (SYS_preadv, any()),
        (SYS_pwritev, any()),
        (SYS_preadv2, any()),
        (SYS_pwritev2, any()),
        (SYS_lseek, any()),
        (SYS_ftruncate, any()),
        (SYS_fallocate, any()),
        (SYS_fsync, any()),
        (SYS_fdatasync, any()),
        (SYS_sync_file_range, any()),
        (SYS_fadvise64, any()),
        (SYS_copy_file_range, any()),
        (SYS_sendfile, any()),
        (SYS_getdents64, any()),
        (SYS_fstat, any()),
        (SYS_fstatfs, any()),
        (SYS_fchmod, any()),
        // A guest running as a user (an image's User) owns what it creates; chown(2) itself.
        (SYS_fchown, any()),
        // Extended attributes of the sandbox's files, through descriptors (guestos::files::path).
        (SYS_fgetxattr, any()),
        (SYS_flistxattr, any()),
        (SYS_fsetxattr, any()),
        (SYS_fremovexattr, any()),
        // A symlink's own attributes, by name from inside its directory.
        (SYS_lgetxattr, any()),
        (SYS_llistxattr, any()),
        (SYS_lsetxattr, any()),
        (SYS_lremovexattr, any()),
        (SYS_fchownat, any()),
        (SYS_flock, any()),
        // ...and by path. These reach only what the mount namespace holds (and in it, the engine
        // resolves guest paths with openat2 beneath the sandbox's directories).
        (SYS_openat, any()),
        (SYS_openat2, any()),
        (SYS_open, any()),
        (SYS_newfstatat, any()),
        (SYS_statx, any()),
        (SYS_stat, any()),
        (SYS_lstat, any()),
        (SYS_statfs, any()),
        (SYS_faccessat, any()),
        (SYS_faccessat2, any()),
        (SYS_access, any()),
        (SYS_readlinkat, any()),
        (SYS_readlink, any()),
        (SYS_mkdirat, any()),
        // FIFOs (mknod of anything else is refused in guestos before it gets here), and the 0/0
        // character device of an overlay whiteout (`guestos::tree` copying an upper layer).
        (
            SYS_mknodat,
            vec![
                rule(vec![cond(2, Len::Dword, Op::MaskedEq(libc::S_IFMT as u64), libc::S_IFIFO as u64)]),
                rule(vec![cond(2, Len::Dword, Op::MaskedEq(libc::S_IFMT as u64), libc::S_IFCHR as u64), cond(3, Len::Qword, Op::Eq, 0)]),
            ],
        ),
        // A sandbox's writable root (`crate::overlay`): configuring and mounting an overlay context
        // the controller made (never `fsopen`: a file system type by name is a string seccomp cannot
        // read); the mount detached, and always `nosuid,nodev,noexec`.
        (SYS_fsconfig, any()),
        (SYS_fsmount, vec![rule(vec![cond(2, Len::Qword, Op::MaskedEq(0xe), 0xe)])]),
        (SYS_mkdir, any()),
        (SYS_unlinkat, any()),
        (SYS_unlink, any()),
        (SYS_rmdir, any()),
        (SYS_renameat2, any()),
        (SYS_renameat, any()),
        (SYS_rename, any()),
        (SYS_linkat, any()),
        (SYS_link, any()),
        (SYS_symlinkat, any()),
        (SYS_symlink, any()),
        (SYS_fchmodat, any()),
        (SYS_fchmodat2, any()),
        (SYS_chmod, any()),
        (SYS_utimensat, any()),
        (SYS_umask, any()),
        (SYS_getcwd, any()),
        (SYS_fchdir, any()),
        (SYS_chdir, any()),
        // Descriptors and waiting on them.
        (SYS_close, any()),
        (SYS_close_range, any()),
        (SYS_dup, any()),
        (SYS_dup2, any()),
        (SYS_dup3, any()),
        (SYS_fcntl, any()),
        (SYS_pipe2, any()),
        (SYS_eventfd2, any()),
        (SYS_poll, any()),
        (SYS_ppoll, any()),
        // The controller channels: Unix socket pairs made with socketpair (for forks), messages
        // with SCM_RIGHTS, a receive timeout.
        (SYS_socketpair, one_of(0, &[AF_UNIX as u64])),
        (SYS_sendmsg, any()),
        (SYS_recvmsg, any()),
        (SYS_sendto, any()),
        (SYS_recvfrom, any()),
        (SYS_setsockopt, any()),
        (SYS_getsockopt, any()),
        (SYS_shutdown, any()),
        // A guest's Unix sockets (guestos::files::socket): Unix only, named in its own directories.
        (SYS_socket, one_of(0, &[AF_UNIX as u64])),
        (SYS_bind, any()),
        (SYS_connect, any()),
        (SYS_listen, any()),
        (SYS_accept4, any()),
        (SYS_getsockname, any()),
        (SYS_getpeername, any()),
        // Forks of this VMM process (sandbox forks, guest processes: never into new namespaces),
        // their pidfds, and signals between a sandbox's processes (vmm::process, guestos::signal).
        (SYS_clone, vec![none_of(0, ns_flags)]),
        (SYS_kill, any()),
        (SYS_rt_sigqueueinfo, any()),
        (SYS_rt_tgsigqueueinfo, any()),
        (SYS_wait4, any()),
        (SYS_waitid, any()),
        (SYS_pidfd_open, any()),
        (SYS_pidfd_send_signal, any()),
        (SYS_getpid, any()),
        (SYS_gettid, any()),
        (SYS_getppid, any()),
        (SYS_getuid, any()),
        (SYS_geteuid, any()),
        (SYS_getgid, any()),
        (SYS_getegid, any()),
        (SYS_set_robust_list, any()),
        (SYS_rseq, any()),
        (SYS_exit, any()),
        (SYS_exit_group, any()),
        // Signals: the preemption timer's handler, abort() (tgkill to itself).
        (SYS_rt_sigaction, any()),
        (SYS_rt_sigprocmask, any()),
        (SYS_rt_sigreturn, any()),
        (SYS_sigaltstack, any()),
        (SYS_restart_syscall, any()),
        (SYS_tgkill, any()),
        // Time and the preemption timer (vstate::vcpu::Preempter).
        (SYS_timer_create, any()),
        (SYS_timer_settime, any()),
        (SYS_timer_gettime, any()),
        (SYS_timer_delete, any()),
        (SYS_clock_gettime, any()),
        (SYS_clock_getres, any()),
        (SYS_clock_nanosleep, any()),
        (SYS_nanosleep, any()),
        (SYS_gettimeofday, any()),
        // Scheduling (spares are built at idle priority), locks, randomness, accounting.
        (SYS_sched_setscheduler, one_of(0, &[0])),
        (SYS_sched_getscheduler, any()),
        (SYS_sched_yield, any()),
        // systrap's placement: a serving thread and its stub bound to one CPU (platform::systrap::placement).
        (SYS_sched_setaffinity, any()),
        (SYS_sched_getaffinity, any()),
        (SYS_getcpu, any()),
        (SYS_futex, any()),
        (SYS_getrandom, any()),
        (SYS_getrusage, any()),
        (SYS_prctl, one_of(0, &[PR_SET_NAME, PR_GET_NAME, PR_SET_CHILD_SUBREAPER, PR_SET_PDEATHSIG, PR_GET_PDEATHSIG, PR_SET_TSC].map(|o| o as u64))),
        // Resource limits: reading any, setting only RLIMIT_CORE (guest processes pin it at 0).
        (SYS_getrlimit, any()),
        (SYS_setrlimit, one_of(0, &[RLIMIT_CORE as u64])),
        (
            SYS_prlimit64,
            vec![
                rule(vec![cond(0, Len::Dword, Op::Eq, 0), cond(2, Len::Qword, Op::Eq, 0)]),
                rule(vec![cond(0, Len::Dword, Op::Eq, 0), cond(1, Len::Dword, Op::Eq, RLIMIT_CORE as u64)]),
            ],
        ),
    ]
}

/// The filter: the allow-list, SIGSYS for anything else.
#[cfg(test)]
fn filter() -> Result<BpfProgram> {
    filter_for(false)
}

/// The filter of a VMM; `exec`: a systrap VMM's, which may also mount its sandbox's overlay root
/// without `noexec` (`fsmount` with `nosuid,nodev` only: `crate::overlay::allow_exec`), as its bind
/// mounts are made without it (`build_root`).
fn filter_for(exec: bool) -> Result<BpfProgram> {
    let rules = allowed_syscalls()
        .into_iter()
        .map(|(nr, r)| {
            if exec && nr == libc::SYS_fsmount {
                (nr, vec![rule(vec![cond(2, Len::Qword, Op::MaskedEq(0x6), 0x6)])])
            } else {
                (nr, r)
            }
        })
        .collect();
    let f = SeccompFilter::new(rules, SeccompAction::Trap, SeccompAction::Allow, seccompiler::TargetArch::x86_64)
        .map_err(|e| Error::Protocol(format!("seccomp filter: {e}")))?;
    f.try_into().map_err(|e: seccompiler::BackendError| Error::Protocol(format!("seccomp filter: {e}")))
}

/// SIGSYS from the filter: say which syscall was refused (so whoever adds a host call to the engine
/// knows to list it in `allowed_syscalls`), then end the process; the controller sees the VMM die.
extern "C" fn on_sigsys(_: libc::c_int, info: *mut libc::siginfo_t, _: *mut libc::c_void) {
    // SAFETY: the kernel passes a valid siginfo; for SIGSYS its `_sigsys` member holds the call
    // address (offset 16) and the syscall number (offset 24), per the x86-64 siginfo layout.
    let nr = unsafe { *(info as *const u8).add(24).cast::<i32>() };
    let mut msg =
        *b"collimate-vmm: seccomp refused syscall ----; add it to vmm::jail::allowed_syscalls if the engine needs it\n";
    let digits = &mut msg[39..43];
    let mut n = nr.clamp(0, 9999);
    for d in digits.iter_mut().rev() {
        *d = b'0' + (n % 10) as u8;
        n /= 10;
    }
    // SAFETY: write and _exit are async-signal-safe (and on the allow-list).
    unsafe {
        libc::write(2, msg.as_ptr().cast(), msg.len());
        libc::_exit(SECCOMP_EXIT);
    }
}

/// Allocates nothing (a forked child of a threaded process may call it).
fn install(prog: &BpfProgram) -> Result<()> {
    // SAFETY: installing a SA_SIGINFO handler for SIGSYS; the handler only writes and exits.
    unsafe {
        let mut sa: libc::sigaction = std::mem::zeroed();
        sa.sa_sigaction = on_sigsys as *const () as usize;
        sa.sa_flags = libc::SA_SIGINFO;
        check(libc::sigaction(libc::SIGSYS, &sa, std::ptr::null_mut()), "sigaction(SIGSYS)")?;
    }
    // All threads: a Python launcher may have started some before handing over to us.
    seccompiler::apply_filter_all_threads(prog).map_err(|e| Error::Protocol(format!("install the seccomp filter: {e}")))
}

#[cfg(test)]
mod tests {
    use super::*;

    /// In a child: install the filter, make an allowed call, then a refused one (socket). The
    /// child must end with SECCOMP_EXIT from the SIGSYS handler, having said which call it was.
    #[test]
    fn a_refused_syscall_ends_the_process_and_says_which() {
        let prog = filter().unwrap();
        let mut p = [0; 2];
        // SAFETY: a pipe for the child's stderr.
        assert_eq!(unsafe { libc::pipe(p.as_mut_ptr()) }, 0);
        // SAFETY: the child calls only dup2, `install` (no allocation), raw syscalls and _exit.
        let pid = unsafe { libc::fork() };
        assert!(pid >= 0);
        if pid == 0 {
            // SAFETY: as above.
            unsafe {
                libc::dup2(p[1], 2);
                if install(&prog).is_err() || libc::getpid() <= 0 {
                    libc::_exit(1);
                }
                libc::socket(libc::AF_INET, libc::SOCK_STREAM, 0);
                libc::_exit(0);
            }
        }
        // SAFETY: our copy of the write end; the read end becomes a File.
        let mut r = unsafe {
            libc::close(p[1]);
            std::fs::File::from_raw_fd(p[0])
        };
        let mut said = String::new();
        std::io::Read::read_to_string(&mut r, &mut said).unwrap();
        let mut st = 0;
        // SAFETY: waiting for our own child.
        assert_eq!(unsafe { libc::waitpid(pid, &mut st, 0) }, pid);
        assert!(libc::WIFEXITED(st), "status {st:#x}");
        assert_eq!(libc::WEXITSTATUS(st), SECCOMP_EXIT);
        assert!(said.contains(&format!("refused syscall {:04}", libc::SYS_socket)), "{said}");
    }

    #[test]
    fn each_syscall_is_listed_once() {
        // A second entry would silently replace the first when the list becomes the filter's map.
        let mut seen = std::collections::BTreeSet::new();
        for (nr, _) in allowed_syscalls() {
            assert!(seen.insert(nr), "syscall {nr} listed twice");
        }
    }

    #[test]
    fn plan_binds_spawn_paths_canonically() {
        let d = std::env::temp_dir().join(format!("jail-plan-{}", std::process::id()));
        std::fs::create_dir_all(d.join("root")).unwrap();
        std::fs::create_dir_all(d.join("work")).unwrap();
        let spec = crate::protocol::SpawnSpec {
            root: d.join("root/../root"),
            mounts: vec![("/work".into(), d.join("work")), ("/gone".into(), d.join("missing"))],
            ..Default::default()
        };
        let mut req = Request::Spawn { spec, mem_size: 2 << 30, cpus: None, platform: Default::default() };
        let mut binds = Vec::new();
        assert_eq!(plan(&mut req, &mut binds), 2 << 30);
        let canon = std::fs::canonicalize(&d).unwrap();
        assert_eq!(
            binds,
            vec![
                Bind { path: canon.join("root"), source: canon.join("root"), writable: false },
                Bind { path: canon.join("work"), source: canon.join("work"), writable: true }
            ]
        );
        let Request::Spawn { spec, .. } = req else { unreachable!() };
        assert_eq!(spec.root, canon.join("root"));
        assert_eq!(spec.mounts[1].1, d.join("missing"), "a path that does not resolve stays as given");
        std::fs::remove_dir_all(&d).unwrap();
    }
}
