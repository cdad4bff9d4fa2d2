//! The VMM's reads and writes of a stub's (the guest's) memory.
//!
//! Through `/proc/<pid>/mem`, opened once per stub and kept open, with `pread`/`pwrite` at the guest
//! virtual address (std's `FileExt::read_exact_at`/`write_all_at`). Chosen over `process_vm_readv`/`process_vm_writev` because only it writes into
//! read-only private pages (the kernel breaks copy-on-write for it as for a debugger), which the
//! personality needs (e.g. for a guest's `ptrace(POKETEXT)` or loading into a read-only mapping); and
//! it is as fast for the sizes that matter (measured in benches/systrap.rs). Both are safe against a
//! concurrent unmap: the kernel walks the page tables under the mm's lock and returns an error or a
//! short count for a missing page, never a fault in the VMM.
//!
//! The access check (`PTRACE_MODE_ATTACH`) happens when the file is opened: a spawned stub is opened
//! while it still has the VMM's credentials; a forked stub (already unprivileged and not dumpable)
//! needs the VMM to hold CAP_SYS_PTRACE. `/proc` itself is reached through a directory fd opened by
//! [`proc_dir`] before any jail hides it.

use std::ffi::CString;
use std::fs::File;
use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;
use std::sync::OnceLock;

static PROC: OnceLock<OwnedFd> = OnceLock::new();

/// The host's `/proc`, opened on first use and kept for the life of the process.
pub fn proc_dir() -> io::Result<&'static OwnedFd> {
    if let Some(fd) = PROC.get() {
        return Ok(fd);
    }
    // SAFETY: a NUL-terminated literal path; the returned fd is owned below.
    let fd = unsafe { libc::open(c"/proc".as_ptr(), libc::O_PATH | libc::O_DIRECTORY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: `fd` was just opened and nobody else owns it.
    let owned = unsafe { OwnedFd::from_raw_fd(fd) };
    Ok(PROC.get_or_init(|| owned))
}

/// Open `/proc/<pid>/mem` for reading and writing.
pub fn open_mem(pid: i32) -> io::Result<File> {
    let dir = proc_dir()?;
    let path = CString::new(format!("{pid}/mem")).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `dir` is an open directory fd, `path` is NUL-terminated; the fd is owned below.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), path.as_ptr(), libc::O_RDWR | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just opened, owned by nobody else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// Read `buf.len()` bytes at `va`; false if any byte could not be read (a short read: the page is
/// not mapped or not readable, or `va` is past what a file offset reaches). The caller gives the
/// guest EFAULT.
pub fn read(mem: &File, va: u64, buf: &mut [u8]) -> bool {
    mem.read_exact_at(buf, va).is_ok()
}

/// Write `data` at `va`; false if any byte could not be written (a prefix may have been).
pub fn write(mem: &File, va: u64, data: &[u8]) -> bool {
    mem.write_all_at(data, va).is_ok()
}

/// `process_vm_readv` of `buf.len()` bytes at `va` in `pid`: the alternative the bench compares
/// against (it cannot write read-only pages, so writes never use it).
pub fn read_vm(pid: i32, va: u64, buf: &mut [u8]) -> bool {
    let local = libc::iovec { iov_base: buf.as_mut_ptr().cast(), iov_len: buf.len() };
    let remote = libc::iovec { iov_base: va as *mut libc::c_void, iov_len: buf.len() };
    // SAFETY: `local` describes a valid writable buffer; the remote side is checked by the kernel.
    let n = unsafe { libc::process_vm_readv(pid, &local, 1, &remote, 1, 0) };
    n == buf.len() as isize
}

/// Open `/proc/<pid>/pagemap` (what [`page_flags`] reads).
pub fn open_pagemap(pid: i32) -> io::Result<File> {
    let dir = proc_dir()?;
    let path = CString::new(format!("{pid}/pagemap")).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `dir` is an open directory fd, `path` is NUL-terminated; the fd is owned below.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just opened, owned by nobody else.
    Ok(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// A page has memory in the process: present, or swapped out (`/proc/<pid>/pagemap` bits 63, 62).
pub const PAGE_OWN: u64 = (1 << 63) | (1 << 62);
/// A present page is the page cache's (a file's page not copied on write) or shared (bit 61).
pub const PAGE_FILE: u64 = 1 << 61;

/// The pagemap entries of the `pages` pages from `va` (page aligned): [`PAGE_OWN`] says whether
/// a page has memory of its own in the process (an anonymous page written or read in; a private
/// file page copied on write or read from the file), [`PAGE_FILE`] whether a present one is still
/// the file's. A page never touched reads as zero in an anonymous mapping and has nothing to keep.
pub fn page_flags(pagemap: &File, va: u64, pages: usize) -> io::Result<Vec<u64>> {
    let mut raw = vec![0u8; pages * 8];
    pagemap.read_exact_at(&mut raw, va / 4096 * 8)?;
    Ok(raw.chunks_exact(8).map(|e| u64::from_le_bytes(e.try_into().unwrap_or_default())).collect())
}

/// The ranges of `pid`'s address space that the host maps from a file (`/proc/<pid>/maps` lines
/// with an inode), with that inode: there a page the process has not touched is the file's, not
/// zero.
pub fn file_mappings(pid: i32) -> io::Result<Vec<(u64, u64, u64)>> {
    Ok(mappings(pid)?.into_iter().filter(|m| m.ino != 0).map(|m| (m.start, m.end, m.ino)).collect())
}

/// One line of `/proc/<pid>/maps`: a host mapping of the process.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Mapping {
    pub start: u64,
    pub end: u64,
    /// `rwxp` / `rwxs` as the kernel writes them.
    pub perms: [u8; 4],
    pub offset: u64,
    /// `major:minor` as the kernel writes it (hex), and the inode (0: anonymous).
    pub dev: String,
    pub ino: u64,
    /// The path or `[name]` (empty for an anonymous mapping).
    pub name: String,
}

impl Mapping {
    /// Its protection as `mmap`'s `PROT_*` bits.
    pub fn prot(&self) -> i32 {
        let mut p = 0;
        if self.perms[0] == b'r' {
            p |= libc::PROT_READ;
        }
        if self.perms[1] == b'w' {
            p |= libc::PROT_WRITE;
        }
        if self.perms[2] == b'x' {
            p |= libc::PROT_EXEC;
        }
        p
    }
}

/// Every mapping of `pid` (`/proc/<pid>/maps`), in address order.
pub fn mappings(pid: i32) -> io::Result<Vec<Mapping>> {
    let dir = proc_dir()?;
    let path = CString::new(format!("{pid}/maps")).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `dir` is an open directory fd, `path` is NUL-terminated; the fd is owned below.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just opened, owned by nobody else.
    let text = io::read_to_string(File::from(unsafe { OwnedFd::from_raw_fd(fd) }))?;
    Ok(text.lines().filter_map(parse_mapping).collect())
}

fn parse_mapping(line: &str) -> Option<Mapping> {
    // start-end perms offset dev inode [path]
    let mut f = line.splitn(6, char::is_whitespace);
    let (a, b) = f.next()?.split_once('-')?;
    let perms: [u8; 4] = f.next()?.as_bytes().try_into().ok()?;
    let offset = u64::from_str_radix(f.next()?, 16).ok()?;
    let dev = f.next()?.to_string();
    let ino = f.next()?.parse().ok()?;
    let name = f.next().unwrap_or("").trim().to_string();
    Some(Mapping { start: u64::from_str_radix(a, 16).ok()?, end: u64::from_str_radix(b, 16).ok()?, perms, offset, dev, ino, name })
}

#[cfg(test)]
mod tests {
    #[test]
    fn maps_lines_parse() {
        let m = super::parse_mapping("7f00a000-7f00c000 r-xp 00002000 fd:01 1234                       /usr/lib/x (deleted)").unwrap();
        assert_eq!((m.start, m.end, &m.perms, m.offset, m.dev.as_str(), m.ino), (0x7f00a000, 0x7f00c000, b"r-xp", 0x2000, "fd:01", 1234));
        assert_eq!(m.name, "/usr/lib/x (deleted)");
        assert_eq!(m.prot(), libc::PROT_READ | libc::PROT_EXEC);
        let anon = super::parse_mapping("1000-2000 rw-p 00000000 00:00 0 ").unwrap();
        assert_eq!((anon.ino, anon.name.as_str(), anon.prot()), (0, "", libc::PROT_READ | libc::PROT_WRITE));
        let mine = super::mappings(std::process::id() as i32).unwrap();
        assert!(mine.iter().any(|m| m.name == "[stack]"));
    }
}
