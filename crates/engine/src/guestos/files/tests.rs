//! Unit tests of the file layer: real syscalls through `guestos::dispatch` on guest memory built
//! without KVM (a memfd-backed GuestMemory with a user scratch area mapped in its page tables).

use super::nr::*;
use super::*;
use crate::arch::x86_64::paging::{setup_address_space, AddressSpace, FrameAllocator, PTE_U, PTE_W};
use crate::guestos::vfs::Vfs;
use crate::guestos::{dispatch, Output, EACCES, EEXIST, ENOENT, EOPNOTSUPP, ERANGE, EROFS};
use crate::vstate::memory::GuestMemory;

const MEM: u64 = 64 << 20;
/// Guest user scratch area.
const SCRATCH: u64 = 0x1000_0000;
const SCRATCH_LEN: u64 = 1 << 20;
/// An address nothing maps.
const UNMAPPED: u64 = 0x2000_0000;

struct TempDir(std::path::PathBuf);
impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

struct H {
    os: GuestOs,
    mem: GuestMemory,
    frames: FrameAllocator,
    aspace: AddressSpace,
    regs: kvm_bindings::kvm_regs,
    sregs: kvm_bindings::kvm_sregs,
    out: Output,
    /// Next free scratch byte.
    brk: u64,
    dir: TempDir,
}

fn e(err: Errno) -> i64 {
    -(err.0 as i64)
}

impl H {
    fn new() -> H {
        static N: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);
        let n = N.fetch_add(1, std::sync::atomic::Ordering::SeqCst);
        let d = std::env::temp_dir().join(format!("files-test-{}-{n}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        for p in ["root/etc", "root/usr/bin", "root/tmp", "tmp", "work/sub"] {
            std::fs::create_dir_all(d.join(p)).unwrap();
        }
        std::fs::write(d.join("root/etc/hostname"), "sandbox\n").unwrap();
        std::fs::write(d.join("root/usr/bin/prog"), "#!prog").unwrap();
        std::fs::write(d.join("secret"), "host secret").unwrap();
        std::fs::write(d.join("work/sub/a.txt"), "alpha").unwrap();
        std::fs::write(d.join("work/b.txt"), "bravo").unwrap();
        std::os::unix::fs::symlink("usr/bin", d.join("root/bin")).unwrap();
        let mut vfs = Vfs::new(&d.join("root")).unwrap();
        vfs.mount("/tmp", &d.join("tmp"), true).unwrap();
        vfs.mount("/work", &d.join("work"), true).unwrap();
        let mut os = GuestOs {
            mm: Default::default(),
            files: Files::standard(),
            vfs,
            proc: Default::default(),
            enosys: Default::default(),
            stdio: None,
            agent: None,
            sig: Default::default(),
            threads: Default::default(),
        };
        os.proc.cwd = "/".into();
        let mut mem = GuestMemory::anonymous(MEM).unwrap();
        let mut frames = FrameAllocator::new(MEM);
        let aspace = setup_address_space(&mut mem, &mut frames).unwrap();
        aspace.map_fresh(&mut mem, &mut frames, SCRATCH, SCRATCH_LEN, PTE_U | PTE_W).unwrap();
        H {
            os,
            mem,
            frames,
            aspace,
            regs: Default::default(),
            sregs: Default::default(),
            out: Output::default(),
            brk: SCRATCH,
            dir: TempDir(d),
        }
    }

    fn host(&self, p: &str) -> std::path::PathBuf {
        self.dir.0.join(p)
    }

    fn call(&mut self, nr: u64, args: &[u64]) -> i64 {
        let mut a = [0u64; 6];
        a[..args.len()].copy_from_slice(args);
        self.regs.rax = nr;
        self.regs.rdi = a[0];
        self.regs.rsi = a[1];
        self.regs.rdx = a[2];
        self.regs.r10 = a[3];
        self.regs.r8 = a[4];
        self.regs.r9 = a[5];
        let mut ctx = Ctx {
            memory: crate::platform::Memory::Kvm(crate::platform::kvm::Memory::new(&mut self.mem, &mut self.frames, &self.aspace)),
            regs: &mut self.regs,
            sregs: &mut self.sregs,
            out: &mut self.out,
            flush_tlb: false,
            stale_frames: Vec::new(),
            stop: None,
            lazy: self.os.mm.lazy_areas(),
        };
        assert!(dispatch(&mut self.os, &mut ctx).is_none());
        self.regs.rax as i64
    }

    /// Copy `data` into fresh scratch memory; its guest address.
    fn put(&mut self, data: &[u8]) -> u64 {
        let at = self.brk;
        self.aspace.write_virt(&mut self.mem, at, data, true).unwrap();
        self.brk = (at + data.len() as u64 + 15) & !15;
        assert!(self.brk < SCRATCH + SCRATCH_LEN);
        at
    }

    fn cstr(&mut self, s: &str) -> u64 {
        let mut v = s.as_bytes().to_vec();
        v.push(0);
        self.put(&v)
    }

    fn buf(&mut self, len: usize) -> u64 {
        self.put(&vec![0u8; len])
    }

    fn get(&self, at: u64, len: usize) -> Vec<u8> {
        let mut v = vec![0u8; len];
        self.aspace.read_virt(&self.mem, at, &mut v, true).unwrap();
        v
    }

    fn open(&mut self, p: &str, flags: i32, mode: u32) -> i64 {
        let s = self.cstr(p);
        self.call(OPENAT, &[libc::AT_FDCWD as u64, s, flags as u64, mode as u64])
    }

    fn read_all(&mut self, fd: i64) -> Vec<u8> {
        let b = self.buf(4096);
        let mut out = Vec::new();
        loop {
            let n = self.call(READ, &[fd as u64, b, 4096]);
            assert!(n >= 0, "read: {n}");
            if n == 0 {
                return out;
            }
            out.extend(self.get(b, n as usize));
        }
    }

    fn read_path(&mut self, p: &str) -> Result<Vec<u8>, i64> {
        let fd = self.open(p, libc::O_RDONLY, 0);
        if fd < 0 {
            return Err(fd);
        }
        let v = self.read_all(fd);
        assert_eq!(self.call(CLOSE, &[fd as u64]), 0);
        Ok(v)
    }

    fn write(&mut self, fd: i64, data: &[u8]) -> i64 {
        let b = self.put(data);
        self.call(WRITE, &[fd as u64, b, data.len() as u64])
    }

    fn stat(&mut self, p: &str, flags: i32) -> Result<libc::stat, i64> {
        let s = self.cstr(p);
        let b = self.buf(144);
        let r = self.call(NEWFSTATAT, &[libc::AT_FDCWD as u64, s, b, flags as u64]);
        if r < 0 {
            return Err(r);
        }
        let raw = self.get(b, 144);
        // SAFETY: 144 bytes read from a struct stat the syscall wrote.
        Ok(unsafe { std::ptr::read_unaligned(raw.as_ptr().cast::<libc::stat>()) })
    }

    /// getdents64 of `fd` until the end: (name, d_type).
    fn list(&mut self, fd: i64) -> Vec<(String, u8)> {
        let b = self.buf(512);
        let mut v = Vec::new();
        loop {
            let n = self.call(GETDENTS64, &[fd as u64, b, 512]);
            assert!(n >= 0, "getdents64: {n}");
            if n == 0 {
                return v;
            }
            let raw = self.get(b, n as usize);
            let mut off = 0;
            while off < raw.len() {
                let reclen = u16::from_le_bytes([raw[off + 16], raw[off + 17]]) as usize;
                let ty = raw[off + 18];
                let name = &raw[off + 19..off + reclen];
                let end = name.iter().position(|&c| c == 0).unwrap();
                v.push((String::from_utf8(name[..end].to_vec()).unwrap(), ty));
                off += reclen;
            }
        }
    }
}

#[test]
fn syscall_numbers_match_libc() {
    let pairs: [(u64, libc::c_long); 20] = [
        (READ, libc::SYS_read),
        (OPENAT, libc::SYS_openat),
        (NEWFSTATAT, libc::SYS_newfstatat),
        (STATX, libc::SYS_statx),
        (GETDENTS64, libc::SYS_getdents64),
        (RENAMEAT2, libc::SYS_renameat2),
        (UTIMENSAT, libc::SYS_utimensat),
        (PSELECT6, libc::SYS_pselect6),
        (PPOLL, libc::SYS_ppoll),
        (DUP3, libc::SYS_dup3),
        (PIPE2, libc::SYS_pipe2),
        (MEMFD_CREATE, libc::SYS_memfd_create),
        (COPY_FILE_RANGE, libc::SYS_copy_file_range),
        (CLOSE_RANGE, libc::SYS_close_range),
        (FACCESSAT2, libc::SYS_faccessat2),
        (FADVISE64, libc::SYS_fadvise64),
        (FALLOCATE, libc::SYS_fallocate),
        (PREADV2, libc::SYS_preadv2),
        (SYNC_FILE_RANGE, libc::SYS_sync_file_range),
        (FUTIMESAT, libc::SYS_futimesat),
    ];
    for (ours, theirs) in pairs {
        assert_eq!(ours, theirs as u64);
    }
}

#[test]
fn lowest_free_fd_dup2_and_cloexec() {
    let mut h = H::new();
    let a = h.open("/etc/hostname", libc::O_RDONLY, 0);
    let b = h.open("/etc/hostname", libc::O_RDONLY | libc::O_CLOEXEC, 0);
    let c = h.open("/work/b.txt", libc::O_RDONLY, 0);
    assert_eq!((a, b, c), (3, 4, 5));
    assert_eq!(h.call(FCNTL, &[b as u64, libc::F_GETFD as u64]), libc::FD_CLOEXEC as i64);
    assert_eq!(h.call(FCNTL, &[a as u64, libc::F_GETFD as u64]), 0);
    assert_eq!(h.call(CLOSE, &[4]), 0);
    assert_eq!(h.call(CLOSE, &[4]), e(EBADF));
    assert_eq!(h.call(DUP, &[a as u64]), 4);
    // dup2 over an open fd closes it and shares the offset of the source.
    assert_eq!(h.call(DUP2, &[c as u64, a as u64]), a);
    assert_eq!(h.read_all(a), b"bravo");
    assert_eq!(h.call(LSEEK, &[c as u64, 0, libc::SEEK_CUR as u64]), 5);
    assert_eq!(h.call(DUP2, &[c as u64, c as u64]), c);
    assert_eq!(h.call(DUP3, &[c as u64, c as u64, 0]), e(EINVAL));
    assert_eq!(h.call(DUP3, &[c as u64, 10, libc::O_CLOEXEC as u64]), 10);
    assert_eq!(h.call(FCNTL, &[10, libc::F_GETFD as u64]), libc::FD_CLOEXEC as i64);
    assert_eq!(h.call(FCNTL, &[c as u64, libc::F_DUPFD_CLOEXEC as u64, 7]), 7);
    assert_eq!(h.call(FCNTL, &[7, libc::F_GETFD as u64]), libc::FD_CLOEXEC as i64);
    assert_eq!(h.call(IOCTL, &[7, 0x5450]), 0); // FIONCLEX
    assert_eq!(h.call(FCNTL, &[7, libc::F_GETFD as u64]), 0);
    assert_eq!(h.call(DUP2, &[c as u64, 5000]), e(EBADF));
    h.os.files.close_on_exec();
    assert_eq!(h.call(FCNTL, &[10, libc::F_GETFD as u64]), e(EBADF));
    assert_eq!(h.call(FCNTL, &[7, libc::F_GETFD as u64]), 0);
    // The limit.
    h.os.proc.rlimits[crate::guestos::limits::RLIMIT_NOFILE].cur = 12;
    while h.call(DUP, &[0]) >= 0 {}
    assert_eq!(h.call(DUP, &[0]), e(EMFILE));
    assert_eq!(h.os.files.open_fds().count(), 12);
    assert_eq!(h.call(CLOSE_RANGE, &[3, u32::MAX as u64, 0]), 0);
    assert_eq!(h.os.files.open_fds().collect::<Vec<_>>(), vec![0, 1, 2]);
    assert_eq!(h.os.files.host_fd(1), Err(ENODEV));
    assert_eq!(h.os.files.host_fd(9), Err(EBADF));
}

#[test]
fn standard_streams() {
    let mut h = H::new();
    assert_eq!(h.write(1, b"out "), 4);
    assert_eq!(h.write(2, b"err"), 3);
    let b = h.put(b"more\n");
    let iov = h.put(&[b.to_le_bytes(), 2u64.to_le_bytes(), (b + 2).to_le_bytes(), 3u64.to_le_bytes()].concat());
    assert_eq!(h.call(WRITEV, &[1, iov, 2]), 5);
    assert_eq!(h.out.stdout, b"out more\n");
    assert_eq!(h.out.stderr, b"err");
    assert_eq!(h.read_all(0), b"");
    assert_eq!(h.call(LSEEK, &[1, 0, libc::SEEK_CUR as u64]), e(ESPIPE));
    assert_eq!(h.call(IOCTL, &[1, libc::TCGETS, h.brk]), e(ENOTTY));
    assert_eq!(h.call(IOCTL, &[0, libc::TIOCGWINSZ, h.brk]), e(ENOTTY));
    // /dev/stdout is fd 1.
    let fd = h.open("/dev/stdout", libc::O_WRONLY, 0);
    assert!(fd >= 3);
    assert_eq!(h.write(fd, b"via /dev/stdout\n"), 16);
    assert!(h.out.stdout.ends_with(b"via /dev/stdout\n"));
    // Bad pointers.
    assert_eq!(h.call(WRITE, &[1, UNMAPPED, 10]), e(EFAULT));
    let fd = h.open("/etc/hostname", libc::O_RDONLY, 0);
    assert_eq!(h.call(READ, &[fd as u64, UNMAPPED, 10]), e(EFAULT));
    assert_eq!(h.call(OPENAT, &[libc::AT_FDCWD as u64, UNMAPPED, 0]), e(EFAULT));
    assert_eq!(h.call(READ, &[99, h.brk, 10]), e(EBADF));
}

#[test]
fn stat_matches_host_layout() {
    let mut h = H::new();
    let host = h.host("root/etc/hostname");
    let c = std::ffi::CString::new(host.as_os_str().as_encoded_bytes()).unwrap();
    // SAFETY: test-only host stat.
    let mut want: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: valid path and out-pointer.
    assert_eq!(unsafe { libc::stat(c.as_ptr(), &mut want) }, 0);
    let s = h.cstr("/etc/hostname");
    let b = h.buf(144);
    assert_eq!(h.call(STAT, &[s, b]), 0);
    assert_eq!(h.get(b, 144), bytes_of(&want));
    // fstat of an open fd, and newfstatat with AT_EMPTY_PATH.
    let fd = h.open("/etc/hostname", libc::O_RDONLY, 0) as u64;
    let b2 = h.buf(144);
    assert_eq!(h.call(FSTAT, &[fd, b2]), 0);
    assert_eq!(h.get(b2, 144), bytes_of(&want));
    let empty = h.cstr("");
    assert_eq!(h.call(NEWFSTATAT, &[fd, empty, b2, libc::AT_EMPTY_PATH as u64]), 0);
    assert_eq!(h.get(b2, 144), bytes_of(&want));
    assert_eq!(h.call(NEWFSTATAT, &[fd, empty, b2, 0]), e(ENOENT));
    // statx agrees.
    let sx = h.buf(256);
    assert_eq!(h.call(STATX, &[libc::AT_FDCWD as u64, s, 0, 0xfff, sx]), 0);
    let raw = h.get(sx, 256);
    assert_eq!(u64::from_le_bytes(raw[32..40].try_into().unwrap()), want.st_ino);
    assert_eq!(u64::from_le_bytes(raw[40..48].try_into().unwrap()), want.st_size as u64);
    assert_eq!(u16::from_le_bytes(raw[28..30].try_into().unwrap()) as u32, want.st_mode);
    // lstat of a symlink, stat through it.
    let l = h.stat("/bin", libc::AT_SYMLINK_NOFOLLOW).unwrap();
    assert_eq!(l.st_mode & libc::S_IFMT, libc::S_IFLNK);
    let d = h.stat("/bin", 0).unwrap();
    assert_eq!(d.st_mode & libc::S_IFMT, libc::S_IFDIR);
    assert_eq!(h.stat("/bin/prog", 0).unwrap().st_size, 6);
    assert_eq!(h.stat("/nope", 0).unwrap_err(), e(ENOENT));
    assert_eq!(h.stat("/etc/hostname/", 0).unwrap_err(), e(ENOTDIR));
    // Engine files.
    let n = h.stat("/dev/null", 0).unwrap();
    assert_eq!(n.st_mode & libc::S_IFMT, libc::S_IFCHR);
    assert_eq!(n.st_rdev, libc::makedev(1, 3));
    assert_eq!(h.stat("/dev/stdout", libc::AT_SYMLINK_NOFOLLOW).unwrap().st_mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(h.stat("/dev/stdout", 0).unwrap().st_mode & libc::S_IFMT, libc::S_IFIFO);
}

#[test]
fn getdents64_lists_directories() {
    let mut h = H::new();
    std::fs::write(h.host("work/sub/b"), "").unwrap();
    std::fs::create_dir(h.host("work/sub/dir")).unwrap();
    let fd = h.open("/work/sub", libc::O_RDONLY | libc::O_DIRECTORY, 0);
    let mut names = h.list(fd);
    names.sort();
    let names: Vec<(&str, u8)> = names.iter().map(|(n, t)| (n.as_str(), *t)).collect();
    assert_eq!(names, vec![(".", 4), ("..", 4), ("a.txt", 8), ("b", 8), ("dir", 4)]);
    // A file is not a directory.
    let f = h.open("/work/b.txt", libc::O_RDONLY, 0) as u64;
    let b = h.buf(512);
    assert_eq!(h.call(GETDENTS64, &[f, b, 512]), e(ENOTDIR));
    assert_eq!(h.open("/work/b.txt", libc::O_RDONLY | libc::O_DIRECTORY, 0), e(ENOTDIR));
    // Engine directories.
    let p = h.open("/proc/self/fd", libc::O_RDONLY | libc::O_DIRECTORY, 0);
    let names: Vec<String> = h.list(p).into_iter().map(|(n, _)| n).collect();
    assert_eq!(names, vec![".", "..", "0", "1", "2", &fd.to_string(), &f.to_string(), &p.to_string()]);
    let d = h.open("/dev", libc::O_RDONLY | libc::O_DIRECTORY, 0);
    assert!(h.list(d).iter().any(|(n, t)| n == "urandom" && *t == 2));
}

#[test]
fn read_only_root_and_writable_mounts() {
    let mut h = H::new();
    let cw = libc::O_CREAT | libc::O_WRONLY | libc::O_TRUNC;
    assert_eq!(h.open("/etc/new", cw, 0o644), e(EROFS));
    assert_eq!(h.open("/etc/hostname", libc::O_WRONLY, 0), e(EROFS));
    let p = h.cstr("/etc/newdir");
    assert_eq!(h.call(MKDIR, &[p, 0o755]), e(EROFS));
    let p = h.cstr("/etc");
    assert_eq!(h.call(MKDIR, &[p, 0o755]), e(EEXIST));
    let p = h.cstr("/etc/hostname");
    assert_eq!(h.call(UNLINK, &[p]), e(EROFS));
    assert_eq!(h.call(CHMOD, &[p, 0o777]), e(EROFS));
    assert_eq!(h.call(TRUNCATE, &[p, 0]), e(EROFS));
    let q = h.cstr("/tmp/moved");
    assert_eq!(h.call(RENAME, &[p, q]), e(EROFS));
    assert_eq!(h.call(LINK, &[p, q]), e(EXDEV));
    let fd = h.open("/etc/hostname", libc::O_RDONLY, 0) as u64;
    assert_eq!(h.call(FCHMOD, &[fd, 0o777]), e(EROFS));
    assert_eq!(h.write(fd as i64, b"x"), e(EBADF));
    let w = h.cstr("W_OK");
    let _ = w;
    assert_eq!(h.call(ACCESS, &[p, libc::W_OK as u64]), e(EROFS));
    assert_eq!(h.call(ACCESS, &[p, libc::R_OK as u64]), 0);
    assert_eq!(h.call(ACCESS, &[p, libc::X_OK as u64]), e(EACCES));
    assert_eq!(std::fs::read_to_string(h.host("root/etc/hostname")).unwrap(), "sandbox\n");

    // /tmp and /work are writable: create, write, rename, link, symlink, mkdir, rmdir, unlink.
    let fd = h.open("/tmp/f", cw, 0o644);
    assert!(fd >= 0);
    assert_eq!(h.write(fd, b"hello"), 5);
    assert_eq!(std::fs::read_to_string(h.host("tmp/f")).unwrap(), "hello");
    let (a, b) = (h.cstr("/tmp/f"), h.cstr("/work/sub/g"));
    // Across mounts Linux says EXDEV, whatever the host directories behind them share; so do we.
    assert_eq!(h.call(RENAME, &[a, b]), e(EXDEV));
    assert_eq!(h.call(LINK, &[a, b]), e(EXDEV));
    let fd = h.open("/work/f", cw, 0o644);
    assert_eq!(h.write(fd, b"hello"), 5);
    let a = h.cstr("/work/f");
    assert_eq!(h.call(RENAME, &[a, b]), 0);
    assert_eq!(std::fs::read_to_string(h.host("work/sub/g")).unwrap(), "hello");
    let d = h.cstr("/work/newdir");
    assert_eq!(h.call(MKDIR, &[d, 0o755]), 0);
    assert!(h.host("work/newdir").is_dir());
    assert_eq!(h.call(MKDIR, &[d, 0o755]), e(EEXIST));
    let (t, l) = (h.cstr("sub/g"), h.cstr("/work/link"));
    assert_eq!(h.call(SYMLINK, &[t, l]), 0);
    assert_eq!(h.read_path("/work/link").unwrap(), b"hello");
    let rb = h.buf(64);
    assert_eq!(h.call(READLINK, &[l, rb, 64]), 5);
    assert_eq!(h.get(rb, 5), b"sub/g");
    let hl = h.cstr("/work/hard");
    assert_eq!(h.call(LINK, &[b, hl]), 0);
    assert_eq!(h.stat("/work/hard", 0).unwrap().st_nlink, 2);
    assert_eq!(h.call(TRUNCATE, &[hl, 2]), 0);
    assert_eq!(h.read_path("/work/sub/g").unwrap(), b"he");
    assert_eq!(h.call(CHMOD, &[hl, 0o600]), 0);
    assert_eq!(h.stat("/work/hard", 0).unwrap().st_mode & 0o777, 0o600);
    assert_eq!(h.call(UNLINK, &[d]), e(EISDIR));
    assert_eq!(h.call(RMDIR, &[d]), 0);
    let tmp = h.cstr("/tmp");
    assert_eq!(h.call(RMDIR, &[tmp]), e(EBUSY));
    assert_eq!(h.call(UNLINK, &[l]), 0);
    assert!(h.host("work/sub/g").exists());
    let at = h.cstr("sub/g");
    let work = h.open("/work", libc::O_RDONLY | libc::O_DIRECTORY, 0) as u64;
    assert_eq!(h.call(UNLINKAT, &[work, at, 0]), 0);
    assert!(!h.host("work/sub/g").exists());
    // utimensat on a writable file; O_TMPFILE.
    let ts = h.put(&[5i64.to_le_bytes(), 0i64.to_le_bytes(), 7i64.to_le_bytes(), 0i64.to_le_bytes()].concat());
    assert_eq!(h.call(UTIMENSAT, &[libc::AT_FDCWD as u64, hl, ts, 0]), 0);
    assert_eq!(h.stat("/work/hard", 0).unwrap().st_mtime, 7);
    assert!(h.open("/tmp", libc::O_TMPFILE | libc::O_RDWR, 0o600) >= 0);
}

#[test]
fn no_escape_through_guest_made_symlinks() {
    let mut h = H::new();
    let secret = h.host("secret").to_string_lossy().into_owned();
    for target in ["/../../../../secret", "../../../../../secret", secret.as_str()] {
        let (t, l) = (h.cstr(target), h.cstr("/work/esc"));
        let _ = h.call(UNLINK, &[l]);
        assert_eq!(h.call(SYMLINK, &[t, l]), 0);
        assert_eq!(h.read_path("/work/esc").unwrap_err(), e(ENOENT), "via {target}");
        // Creating through it lands in the sandbox too: /secret on the read-only root, or a
        // directory under /tmp that does not exist.
        let want = if target.starts_with("/..") || target.starts_with("..") { e(EROFS) } else { e(ENOENT) };
        assert_eq!(h.open("/work/esc", libc::O_CREAT | libc::O_WRONLY, 0o644), want, "create via {target}");
    }
    assert_eq!(h.read_path("/work/../../secret").unwrap_err(), e(ENOENT));
    assert_eq!(h.read_path("/tmp/../../../../secret").unwrap_err(), e(ENOENT));
    let cd = h.cstr("/work/sub");
    assert_eq!(h.call(CHDIR, &[cd]), 0);
    assert_eq!(h.read_path("../../../secret").unwrap_err(), e(ENOENT));
    assert_eq!(h.read_path("../../etc/hostname").unwrap(), b"sandbox\n");
    assert_eq!(std::fs::read_to_string(h.host("secret")).unwrap(), "host secret");
    // A symlink swapped into the last component is never followed by a host call.
    let (t, l) = (h.cstr("/etc/hostname"), h.cstr("/work/to-root"));
    assert_eq!(h.call(SYMLINK, &[t, l]), 0);
    assert_eq!(h.open("/work/to-root", libc::O_WRONLY | libc::O_TRUNC, 0), e(EROFS));
    assert_eq!(h.call(CHMOD, &[l, 0o777]), e(EROFS));
    assert_eq!(h.read_path("/work/to-root").unwrap(), b"sandbox\n");
}

#[test]
fn cwd_and_dirfds() {
    let mut h = H::new();
    let b = h.buf(256);
    assert_eq!(h.call(GETCWD, &[b, 256]), 2);
    let p = h.cstr("/work/sub/");
    assert_eq!(h.call(CHDIR, &[p]), 0);
    assert_eq!(h.call(GETCWD, &[b, 256]), 10);
    assert_eq!(h.get(b, 10), b"/work/sub\0");
    assert_eq!(h.call(GETCWD, &[b, 5]), e(ERANGE));
    assert_eq!(h.read_path("a.txt").unwrap(), b"alpha");
    let p = h.cstr("/bin");
    assert_eq!(h.call(CHDIR, &[p]), 0);
    assert_eq!(h.os.proc.cwd, "/usr/bin");
    let p = h.cstr("/etc/hostname");
    assert_eq!(h.call(CHDIR, &[p]), e(ENOTDIR));
    let work = h.open("/work", libc::O_RDONLY | libc::O_DIRECTORY, 0) as u64;
    let rel = h.cstr("sub/a.txt");
    let fd = h.call(OPENAT, &[work, rel, 0, 0]);
    assert_eq!(h.read_all(fd), b"alpha");
    assert_eq!(h.call(OPENAT, &[fd as u64, rel, 0, 0]), e(ENOTDIR));
    assert_eq!(h.call(FCHDIR, &[work]), 0);
    assert_eq!(h.os.proc.cwd, "/work");
    let p = h.cstr("/proc/self/cwd");
    assert_eq!(h.call(READLINK, &[p, b, 256]), 5);
    assert_eq!(h.get(b, 5), b"/work");
    let f = h.cstr("/proc/self/fd/3");
    let n = h.call(READLINK, &[f, b, 256]);
    assert_eq!(h.get(b, n as usize), b"/work");
}

#[test]
fn engine_files() {
    let mut h = H::new();
    let z = h.open("/dev/zero", libc::O_RDONLY, 0);
    let b = h.put(&[0xff; 64]);
    assert_eq!(h.call(READ, &[z as u64, b, 64]), 64);
    assert_eq!(h.get(b, 64), vec![0; 64]);
    let r = h.open("/dev/urandom", libc::O_RDONLY, 0);
    assert_eq!(h.call(READ, &[r as u64, b, 64]), 64);
    assert_ne!(h.get(b, 64), vec![0; 64]);
    let n = h.open("/dev/null", libc::O_RDWR, 0);
    assert_eq!(h.write(n, b"gone"), 4);
    assert_eq!(h.read_all(n), b"");
    let cpu = String::from_utf8(h.read_path("/proc/cpuinfo").unwrap()).unwrap();
    assert!(cpu.contains("processor\t: 0"));
    let mem = String::from_utf8(h.read_path("/proc/meminfo").unwrap()).unwrap();
    assert!(mem.starts_with("MemTotal:") && mem.contains(&format!("{} kB", MEM / 1024)));
    let status = String::from_utf8(h.read_path("/proc/self/status").unwrap()).unwrap();
    assert!(status.contains("Pid:\t"));
    assert!(h.read_path("/proc/self/maps").is_ok());
    assert_eq!(h.open("/proc/cpuinfo", libc::O_WRONLY, 0), e(EACCES));
    assert_eq!(h.open("/dev/nope", libc::O_RDONLY, 0), e(ENOENT));
    let p = h.cstr("/proc/self/fd/1");
    let rb = h.buf(64);
    let len = h.call(READLINK, &[p, rb, 64]);
    assert_eq!(h.get(rb, len as usize), b"pipe:[1]");
    // /proc/self/exe: no program path recorded in these tests.
    let p = h.cstr("/proc/self/exe");
    assert_eq!(h.call(READLINK, &[p, rb, 64]), e(ENOENT));
    // The host's /dev and /proc are never reached.
    // (pid 1 is the guest itself here; any other pid is not visible.)
    assert_eq!(h.open("/proc/99999/environ", libc::O_RDONLY, 0), e(ENOENT));
    assert_eq!(h.open("/dev/kvm", libc::O_RDWR, 0), e(ENOENT));
}

#[test]
fn pipes_poll_and_offsets() {
    let mut h = H::new();
    let fds = h.buf(8);
    assert_eq!(h.call(PIPE2, &[fds, libc::O_CLOEXEC as u64]), 0);
    let raw = h.get(fds, 8);
    let (r, w) = (i32::from_le_bytes(raw[..4].try_into().unwrap()) as u64, i32::from_le_bytes(raw[4..].try_into().unwrap()) as u64);
    assert_eq!((r, w), (3, 4));
    assert_eq!(h.call(FCNTL, &[r, libc::F_GETFD as u64]), libc::FD_CLOEXEC as i64);
    // Empty pipe: poll times out, a blocking read gives up after the slice and restarts (rax = nr,
    // rip back on the `syscall` instruction).
    let pfd = h.put(&[(r as i32).to_le_bytes(), [1, 0, 0, 0]].concat());
    assert_eq!(h.call(POLL, &[pfd, 1, 0]), 0);
    let b = h.buf(16);
    let rip = h.regs.rip;
    assert_eq!(h.call(READ, &[r, b, 16]), READ as i64);
    assert_eq!(h.regs.rip, rip.wrapping_sub(2));
    h.regs.rip = rip;
    assert_eq!(h.write(w as i64, b"ping"), 4);
    assert_eq!(h.call(POLL, &[pfd, 1, 1000]), 1);
    assert_eq!(h.get(pfd + 6, 2), [1, 0]);
    let n = h.buf(4);
    assert_eq!(h.call(IOCTL, &[r, 0x541b, n]), 0);
    assert_eq!(h.get(n, 4), 4i32.to_le_bytes());
    assert_eq!(h.call(READ, &[r, b, 16]), 4);
    assert_eq!(h.get(b, 4), b"ping");
    // O_NONBLOCK through fcntl: EAGAIN.
    assert_eq!(h.call(FCNTL, &[r, libc::F_SETFL as u64, libc::O_NONBLOCK as u64]), 0);
    assert_eq!(h.call(FCNTL, &[r, libc::F_GETFL as u64]) & libc::O_NONBLOCK as i64, libc::O_NONBLOCK as i64);
    assert_eq!(h.call(READ, &[r, b, 16]), e(EAGAIN));
    // select: the write end and stdout are writable.
    let set = h.put(&((1u64 << w) | 2).to_le_bytes());
    let tv = h.put(&[0u8; 16]);
    assert_eq!(h.call(SELECT, &[w + 1, 0, set, 0, tv]), 2);
    assert_eq!(h.call(LSEEK, &[r, 0, 0]), e(ESPIPE));

    // pread/pwrite/readv and sendfile on a file.
    let f = h.open("/tmp/file", libc::O_CREAT | libc::O_RDWR, 0o600) as u64;
    let data = h.put(b"0123456789");
    assert_eq!(h.call(PWRITE64, &[f, data, 10, 100]), 10);
    assert_eq!(h.stat("/tmp/file", 0).unwrap().st_size, 110);
    assert_eq!(h.call(PREAD64, &[f, b, 4, 103]), 4);
    assert_eq!(h.get(b, 4), b"3456");
    assert_eq!(h.call(LSEEK, &[f, 100, libc::SEEK_SET as u64]), 100);
    let (b1, b2) = (h.buf(3), h.buf(3));
    let iov = h.put(&[b1.to_le_bytes(), 3u64.to_le_bytes(), b2.to_le_bytes(), 3u64.to_le_bytes()].concat());
    assert_eq!(h.call(READV, &[f, iov, 2]), 6);
    assert_eq!([h.get(b1, 3), h.get(b2, 3)].concat(), b"012345");
    let off = h.put(&104u64.to_le_bytes());
    assert_eq!(h.call(SENDFILE, &[1, f, off, 100]), 6);
    assert_eq!(h.out.stdout, b"456789");
    assert_eq!(h.get(off, 8), 110u64.to_le_bytes());
    assert_eq!(h.call(LSEEK, &[f, 0, libc::SEEK_CUR as u64]), 106);
    let m = h.cstr("scratch");
    let mfd = h.call(MEMFD_CREATE, &[m, 0]);
    assert!(mfd >= 0);
    assert!(h.os.files.host_fd(mfd as i32).is_ok());
    let p = h.cstr(&format!("/proc/self/fd/{mfd}"));
    let len = h.call(READLINK, &[p, b, 16]);
    assert_eq!(h.get(b, len as usize), b"/memfd:scratch (");
}

/// What CPython's own regression tests and hostile guests found (tests/test_cpython_battery.py).
mod runtime;

/// glibc 2.36's fchmodat(..., AT_SYMLINK_NOFOLLOW) (GNU tar's chmod of what it extracts) opens the
/// file O_PATH and chmods "/proc/self/fd/N": following that magic link gives the open file itself,
/// so chmod, chown, utimensat and stat through it act on the file (issue 31, item 3). A symlink
/// itself and files on read-only mounts are refused as Linux does.
#[test]
fn proc_self_fd_of_o_path_descriptors_changes_the_file() {
    let mut h = H::new();
    let fd = h.open("/work/sub", libc::O_PATH | libc::O_NOFOLLOW | libc::O_CLOEXEC, 0);
    assert!(fd >= 0, "{fd}");
    let p = h.cstr(&format!("/proc/self/fd/{fd}"));
    assert_eq!(h.call(FCHMODAT, &[libc::AT_FDCWD as u64, p, 0o751, 0]), 0);
    use std::os::unix::fs::{MetadataExt, PermissionsExt};
    assert_eq!(std::fs::metadata(h.host("work/sub")).unwrap().permissions().mode() & 0o7777, 0o751);
    // Through /proc/<own pid>/fd/N too, and stat of the link is the file's.
    let own = h.cstr(&format!("/proc/{}/fd/{fd}", h.os.proc.pid));
    assert_eq!(h.call(FCHMODAT, &[libc::AT_FDCWD as u64, own, 0o750, 0]), 0);
    assert_eq!(h.stat(&format!("/proc/self/fd/{fd}"), 0).unwrap().st_mode, libc::S_IFDIR | 0o750);
    // chown to the owner it has (root's to root: allowed) and times.
    let uid = std::fs::metadata(h.host("work/sub")).unwrap().uid();
    let gid = std::fs::metadata(h.host("work/sub")).unwrap().gid();
    assert_eq!(h.call(FCHOWNAT, &[libc::AT_FDCWD as u64, p, uid as u64, gid as u64, 0]), 0);
    let ts = h.put(&[1_000_000i64.to_le_bytes(), 0i64.to_le_bytes(), 2_000_000i64.to_le_bytes(), 0i64.to_le_bytes()].concat());
    assert_eq!(h.call(UTIMENSAT, &[libc::AT_FDCWD as u64, p, ts, 0]), 0);
    assert_eq!(std::fs::metadata(h.host("work/sub")).unwrap().mtime(), 2_000_000);
    // O_PATH files of the read-only root: EROFS, not a change.
    let ro = h.open("/etc/hostname", libc::O_PATH, 0);
    let rp = h.cstr(&format!("/proc/self/fd/{ro}"));
    assert_eq!(h.call(FCHMODAT, &[libc::AT_FDCWD as u64, rp, 0o600, 0]), e(EROFS));
    // Not following (fchmodat2; fchmodat has no flags): the link itself, which takes no mode.
    assert_eq!(h.call(FCHMODAT2, &[libc::AT_FDCWD as u64, p, 0o700, libc::AT_SYMLINK_NOFOLLOW as u64]), e(EOPNOTSUPP));
    assert_eq!(std::fs::metadata(h.host("work/sub")).unwrap().permissions().mode() & 0o7777, 0o750);
    // A file not open there.
    let gone = h.cstr("/proc/self/fd/77");
    assert_eq!(h.call(FCHMODAT, &[libc::AT_FDCWD as u64, gone, 0o700, 0]), e(ENOENT));
}

/// /proc as procps reads it (issue 31, item 5): /proc/self is a symlink to the caller's pid,
/// /proc/<pid> is its directory (listed in /proc), /proc/uptime and a 52-field stat line.
#[test]
fn proc_self_is_a_link_to_the_pid_directory() {
    let mut h = H::new();
    h.os.proc.pid = 7;
    let p = h.cstr("/proc/self");
    let b = h.buf(64);
    let n = h.call(READLINK, &[p, b, 64]);
    assert_eq!(h.get(b, n as usize), b"7");
    assert_eq!(h.stat("/proc/self", libc::AT_SYMLINK_NOFOLLOW).unwrap().st_mode & libc::S_IFMT, libc::S_IFLNK);
    assert_eq!(h.stat("/proc/7", libc::AT_SYMLINK_NOFOLLOW).unwrap().st_mode & libc::S_IFMT, libc::S_IFDIR);
    assert_eq!(h.stat("/proc/self", 0).unwrap().st_mode & libc::S_IFMT, libc::S_IFDIR);
    let d = h.open("/proc", libc::O_RDONLY | libc::O_DIRECTORY, 0);
    let names: Vec<String> = h.list(d).into_iter().map(|(n, _)| n).collect();
    assert!(names.contains(&"7".to_string()) && names.contains(&"uptime".to_string()), "{names:?}");
    let stat = String::from_utf8(h.read_path("/proc/7/stat").unwrap()).unwrap();
    assert!(stat.starts_with("7 (guest) R 0 1 1 "), "{stat}");
    assert_eq!(stat.split_whitespace().count(), 52, "{stat}");
    let up = String::from_utf8(h.read_path("/proc/uptime").unwrap()).unwrap();
    assert_eq!(up.split_whitespace().count(), 2, "{up}");
    // Another pid than the caller's: none here (no sandbox process table in these tests).
    assert_eq!(h.open("/proc/8/stat", libc::O_RDONLY, 0), e(ENOENT));
}
