//! Shared windows: host `MAP_SHARED` mappings placed in guest-physical space beside guest memory.
//!
//! Guest memory proper ([`super::memory::GuestMemory`]) is one `MAP_PRIVATE` mapping, so that a host
//! `fork()` of the VMM process copies it on write: right for private memory, wrong for a guest
//! `MAP_SHARED` mapping, whose writes every process mapping the same file (or, for shared anonymous
//! memory, every process forked since) must see at once. Each such guest mapping therefore gets a
//! [`Window`]: a host `MAP_SHARED` mapping of the file's host descriptor (a memfd for anonymous
//! memory) at guest-physical addresses of its own above [`WINDOW_BASE`], far above any guest
//! memory, which the VMM gives a KVM memory slot of its own (`vstate::vm::KvmVm::sync_windows`).
//! The guest's page tables point the mapping's pages there. A host fork keeps `MAP_SHARED`
//! mappings shared, so a guest fork child sees the parent's window through the same host pages,
//! and two windows of one file (in one process or in two) are coherent through the host page cache.
//!
//! Windows never hold guest page tables or frames of the frame allocator, and their pages are
//! never in the private-page record (`GuestMemory::dirty`): resets and snapshots do not see them.
//! What snapshots, sandbox forks and resets do with them is in `guestos::mm`'s module comment.
//!
//! A window's host pages past the end of its file, or that its tmpfs has no room for (the sandbox's
//! shared-memory pool, [`pool`], or its disk quota is full), would raise SIGBUS in the VMM when
//! touched, so host-side accesses ([`Windows::read`], [`Windows::write`]) check the file's size
//! first and go through the file (`pread`, `pwrite`), answering with an error (EFAULT to the
//! guest) instead.

use std::collections::BTreeMap;
use std::os::fd::{AsRawFd, OwnedFd};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use crate::arch::x86_64::layout::PAGE_SIZE;

/// Windows live in [WINDOW_BASE, WINDOW_BASE + WINDOW_SPACE) of guest-physical space (256-512 GiB:
/// above any guest memory a sandbox is given, and below the 48 physical address bits of the
/// machines we run on).
pub const WINDOW_BASE: u64 = 1 << 38;
pub const WINDOW_SPACE: u64 = 1 << 38;
/// Windows one process may hold: each is a KVM memory slot (KVM has a few hundred to 32,764 per
/// VM, and a VM's slot lookups get slower with many), a host mapping and a host descriptor. A
/// guest asking for more gets ENOMEM from mmap, as Linux answers past vm.max_map_count.
pub const MAX_WINDOWS: usize = 256;
/// The cap in force: [`MAX_WINDOWS`], or fewer if this host's KVM has fewer memory slots
/// ([`limit_windows`]).
static CAP: AtomicUsize = AtomicUsize::new(MAX_WINDOWS);

/// At most `slots` windows per process (the KVM slots this host leaves for them).
pub fn limit_windows(slots: usize) {
    CAP.store(slots.min(MAX_WINDOWS), Ordering::Relaxed);
}

/// Windows are placed on 2 MiB boundaries (so that guest-physical and host addresses can agree
/// modulo 2 MiB, which KVM needs to map a large page).
const ALIGN: u64 = 2 << 20;

/// What went wrong making a window.
#[derive(Debug, thiserror::Error)]
pub enum WindowError {
    /// too many shared mappings in one process (at most MAX_WINDOWS)
    #[error("too many shared mappings in one process (at most {MAX_WINDOWS})")]
    TooMany,
    /// no room left in the guest-physical space for shared mappings
    #[error("no room left in the guest-physical space for shared mappings")]
    NoRoom,
    /// the host could not map the file shared
    #[error("the host could not map the file shared: {0}")]
    Map(std::io::Error),
}

/// One shared window.
pub struct Window {
    pub gpa: u64,
    pub len: u64,
    ptr: *mut u8,
    /// The mapped host file (a memfd for shared anonymous memory), and the file offset of `gpa`.
    pub fd: Arc<OwnedFd>,
    pub offset: u64,
    /// Mapped writable (the file is open for writing).
    pub writable: bool,
    /// A file of the guest's (true) or a memfd of ours for anonymous memory (false).
    pub file: bool,
    /// The host file's identity (device, inode): with the file offset, what names a futex word
    /// in it for every process (see `guestos::futex_shared`).
    pub key: (u64, u64),
}

impl Window {
    pub fn host_addr(&self) -> u64 {
        self.ptr as u64
    }

    /// The host protection of the mapping.
    pub fn prot(&self) -> libc::c_int {
        if self.writable {
            libc::PROT_READ | libc::PROT_WRITE
        } else {
            libc::PROT_READ
        }
    }

    /// How many bytes from the window's start lie in pages that show the file (not wholly past
    /// its end, where a host access would raise SIGBUS): all of it for a memfd of ours.
    fn shown(&self) -> u64 {
        if !self.file {
            return self.len;
        }
        // SAFETY: a zeroed stat is valid; fstat on a descriptor we own, the result is checked.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above.
        if unsafe { libc::fstat(self.fd.as_raw_fd(), &mut st) } != 0 {
            return 0;
        }
        let pages = (st.st_size as u64).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        pages.saturating_sub(self.offset).min(self.len)
    }

    /// Whether [at, at + len) of the window lies in pages that show the file.
    fn in_file(&self, at: u64, len: u64) -> bool {
        at.saturating_add(len) <= self.shown()
    }
}

impl Drop for Window {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: unmapping the host mapping this window made and owns.
            unsafe { libc::munmap(self.ptr.cast(), self.len as usize) };
        }
    }
}

/// Windows up to this long are parked when their mappings go ([`Parked`]).
const PARK_MAX_LEN: u64 = 2 << 20;
/// At most this many parked windows per process.
const PARK_MAX: usize = 8;

/// A window whose guest mappings went, kept with its guest-physical range, its host address and so
/// its KVM slot, for the next shared mapping of the same length. Deleting a KVM memory slot makes
/// KVM drop every translation of the VM (with shadow paging, as on kvm_pvm: the guest then faults
/// its whole working set in again), which made a 16 KiB `mmap.mmap(-1, n)`/`close` pair cost about
/// 64 shadow faults; a parked window is re-pointed at the next file in place (`MAP_FIXED`, which
/// drops the translations of that range only) and its slot never changes. Its host range holds an
/// inaccessible anonymous mapping meanwhile: the file (and its memory in the pool) is let go at
/// once, and nothing in the guest's page tables points there.
struct Parked {
    gpa: u64,
    len: u64,
    ptr: *mut u8,
}

impl Drop for Parked {
    fn drop(&mut self) {
        // SAFETY: unmapping the placeholder mapping this parked window owns.
        unsafe { libc::munmap(self.ptr.cast(), self.len as usize) };
    }
}

/// A process's shared windows, by guest-physical start.
#[derive(Default)]
pub struct Windows {
    map: BTreeMap<u64, Window>,
    parked: Vec<Parked>,
    /// Bumped on every change, so the VMM re-syncs its KVM slots only when there is something new.
    generation: u64,
}

impl Windows {
    pub fn is_empty(&self) -> bool {
        self.map.is_empty()
    }
    pub fn len(&self) -> usize {
        self.map.len()
    }
    pub fn generation(&self) -> u64 {
        self.generation
    }
    pub fn iter(&self) -> impl Iterator<Item = &Window> {
        self.map.values()
    }

    /// The KVM slots the windows need, live and parked: (guest-physical start, length, host address).
    pub fn slots(&self) -> impl Iterator<Item = (u64, u64, u64)> + '_ {
        self.map.values().map(|w| (w.gpa, w.len, w.host_addr())).chain(self.parked.iter().map(|p| (p.gpa, p.len, p.ptr as u64)))
    }

    /// Park window `w` (its mappings went): see [`Parked`]. Returns it back if it is not parked.
    fn park(&mut self, mut w: Window) -> Option<Window> {
        if w.len > PARK_MAX_LEN || self.parked.len() >= PARK_MAX {
            return Some(w);
        }
        // SAFETY: replaces, in place, the host mapping this window owns (exactly its range) with an
        // inaccessible anonymous one; the result is checked.
        let p = unsafe {
            libc::mmap(
                w.ptr.cast(),
                w.len as usize,
                libc::PROT_NONE,
                libc::MAP_PRIVATE | libc::MAP_ANONYMOUS | libc::MAP_NORESERVE | libc::MAP_FIXED,
                -1,
                0,
            )
        };
        if p == libc::MAP_FAILED {
            return Some(w);
        }
        self.parked.push(Parked { gpa: w.gpa, len: w.len, ptr: w.ptr });
        w.ptr = std::ptr::null_mut(); // the parked window owns the host range now
        None
    }

    /// Map `len` bytes (page multiple) of `fd` from `offset` shared; returns the window's
    /// guest-physical start.
    pub fn map(&mut self, fd: Arc<OwnedFd>, offset: u64, len: u64, writable: bool, file: bool) -> Result<u64, WindowError> {
        let cap = CAP.load(Ordering::Relaxed);
        if self.map.len() >= cap {
            return Err(WindowError::TooMany);
        }
        // SAFETY: a zeroed stat is valid; fstat on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; the result is checked.
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
            return Err(WindowError::Map(std::io::Error::last_os_error()));
        }
        // A parked window of this length: the file goes where it was, and the slot stays.
        if let Some(i) = self.parked.iter().position(|p| p.len == len) {
            let p = self.parked.swap_remove(i);
            if host_map(&fd, offset, len, writable, Some(p.ptr)).is_ok() {
                let (gpa, ptr) = (p.gpa, p.ptr);
                std::mem::forget(p); // the window owns the host range now
                self.map.insert(gpa, Window { gpa, len, ptr, fd, offset, writable, file, key: (st.st_dev, st.st_ino) });
                self.generation += 1;
                return Ok(gpa);
            }
            self.generation += 1; // dropped: its slot goes
        }
        // Room for a new slot: parked windows give theirs up first.
        while self.map.len() + self.parked.len() >= cap && self.parked.pop().is_some() {
            self.generation += 1;
        }
        let gpa = self.free_range(len).ok_or(WindowError::NoRoom)?;
        let ptr = host_map(&fd, offset, len, writable, None).map_err(WindowError::Map)?;
        self.map.insert(gpa, Window { gpa, len, ptr, fd, offset, writable, file, key: (st.st_dev, st.st_ino) });
        self.generation += 1;
        Ok(gpa)
    }

    /// The lowest free 2 MiB-aligned range of `len` bytes in the window space.
    fn free_range(&self, len: u64) -> Option<u64> {
        let mut taken: Vec<(u64, u64)> = self.map.values().map(|w| (w.gpa, w.len)).chain(self.parked.iter().map(|p| (p.gpa, p.len))).collect();
        taken.sort_unstable();
        let mut at = WINDOW_BASE;
        for (gpa, wlen) in taken {
            if gpa >= at.checked_add(len)? {
                break;
            }
            at = (gpa + wlen).div_ceil(ALIGN) * ALIGN;
        }
        (at.checked_add(len)? <= WINDOW_BASE + WINDOW_SPACE).then_some(at)
    }

    /// The window holding guest-physical address `gpa`.
    pub fn find(&self, gpa: u64) -> Option<&Window> {
        self.map.range(..=gpa).next_back().map(|(_, w)| w).filter(|w| gpa < w.gpa + w.len)
    }

    /// Keep only the windows `keep` holds on to (by guest-physical start); the others are unmapped.
    /// Small ones are parked ([`Parked`]): their slots stay.
    pub fn retain(&mut self, keep: impl Fn(&Window) -> bool) {
        let gone: Vec<u64> = self.map.values().filter(|w| !keep(w)).map(|w| w.gpa).collect();
        if gone.is_empty() {
            return;
        }
        for gpa in gone {
            if let Some(w) = self.map.remove(&gpa) {
                drop(self.park(w));
            }
        }
        self.generation += 1;
    }

    /// Unmap every window, parked ones too.
    pub fn clear(&mut self) {
        if !self.map.is_empty() || !self.parked.is_empty() {
            self.map.clear();
            self.parked.clear();
            self.generation += 1;
        }
    }

    /// The host address of `gpa`, checked to lie, with `len` bytes after it, in one window and in
    /// pages that show its file.
    fn host(&self, gpa: u64, len: usize) -> Option<*mut u8> {
        let w = self.find(gpa)?;
        let at = gpa - w.gpa;
        if at.checked_add(len as u64)? > w.len || !w.in_file(at, len as u64) {
            return None;
        }
        // SAFETY: `at + len` lies inside the mapping, checked above.
        Some(unsafe { w.ptr.add(at as usize) })
    }

    /// Read through the window's file (`pread`), not its mapping: a page the file does not hold
    /// yet reads as zeros without being allocated, so a full pool cannot raise SIGBUS in the VMM.
    pub fn read(&self, gpa: u64, buf: &mut [u8]) -> Option<()> {
        self.host(gpa, buf.len())?;
        let w = self.find(gpa)?;
        read_file_at(&w.fd, buf, w.offset + (gpa - w.gpa)).ok()
    }

    /// Write through the window (host side: a read-only window is written too, as Linux's kernel
    /// writes a read-only mapping's page for the guest's syscalls only where it may; the caller has
    /// checked the guest's rights).
    pub fn write(&mut self, gpa: u64, data: &[u8]) -> Option<()> {
        let w = self.find(gpa)?;
        if !w.writable {
            return None;
        }
        let p = self.host(gpa, data.len())?;
        // Through the file (`pwrite`) where it is not opened for appending: a page it has to
        // allocate in a full tmpfs is ENOSPC there (EFAULT to the guest), where a store through
        // the mapping would raise SIGBUS in the VMM.
        // SAFETY: F_GETFL on a descriptor we hold.
        let flags = unsafe { libc::fcntl(w.fd.as_raw_fd(), libc::F_GETFL) };
        if flags >= 0 && flags & libc::O_APPEND == 0 {
            let file = std::mem::ManuallyDrop::new(
                // SAFETY: borrows the window's descriptor for the write; ManuallyDrop keeps it open.
                unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(w.fd.as_raw_fd()) },
            );
            let written = std::os::unix::fs::FileExt::write_all_at(&*file, data, w.offset + (gpa - w.gpa));
            if written.as_ref().is_err_and(|e| e.raw_os_error() == Some(libc::ENOSPC)) && !w.file {
                note_limit_reached();
            }
            return written.ok();
        }
        // SAFETY: `host` checked the range lies inside a live writable mapping backed by the file.
        unsafe { std::ptr::copy_nonoverlapping(data.as_ptr(), p, data.len()) };
        Some(())
    }

    /// Re-point window `gpa` at `fd` (a fork of the sandbox got its own copy of the file), at the
    /// same host address, or, with `fd` None, at a fresh memfd holding a copy of what it shows now.
    /// Returns the descriptor it maps now.
    pub fn replace(&mut self, gpa: u64, fd: Option<Arc<OwnedFd>>) -> std::io::Result<Arc<OwnedFd>> {
        let w = self.map.get_mut(&gpa).ok_or_else(|| std::io::Error::from_raw_os_error(libc::ENOENT))?;
        let copied = fd.is_none();
        let (fd, offset) = match fd {
            Some(fd) => (fd, w.offset),
            None => {
                let copy = memfd(w.len)?;
                // Only the pages that show the file are read (the others would raise SIGBUS).
                let shown = w.shown();
                let out = std::fs::File::from(copy.try_clone()?);
                // Read through the file, not the mapping: a read fault on a hole of a tmpfs file
                // would allocate the page (in the parent's pool).
                let mut buf = vec![0u8; 1 << 20];
                let mut at = 0;
                while at < shown {
                    let n = (shown - at).min(1 << 20) as usize;
                    read_file_at(&w.fd, &mut buf[..n], w.offset + at)?;
                    if buf[..n].iter().any(|&b| b != 0) {
                        std::os::unix::fs::FileExt::write_all_at(&out, &buf[..n], at)?;
                    }
                    at += n as u64;
                }
                (Arc::new(copy), 0)
            }
        };
        host_map(&fd, offset, w.len, w.writable, Some(w.ptr))?;
        // SAFETY: a zeroed stat is valid; fstat on a descriptor we own.
        let mut st: libc::stat = unsafe { std::mem::zeroed() };
        // SAFETY: as above; a failure leaves the old key (futexes then key on the old file).
        if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } == 0 {
            w.key = (st.st_dev, st.st_ino);
        }
        w.fd = fd.clone();
        w.offset = offset;
        if copied {
            w.file = false; // a memfd of ours, exactly as long as the window
        }
        self.generation += 1;
        Ok(fd)
    }
}

/// The sandbox's shared-memory pool: the root of a tmpfs of its own (`crate::quota`, made by the
/// controller with the sandbox's shared-memory limit as its size), where its shared anonymous
/// memory, its guest memfds and its /dev/shm live. One per VMM process (a VMM process serves one
/// sandbox); none in template zygotes and where the host cannot make tmpfs instances, where
/// shared anonymous memory is a plain memfd, as before.
static POOL: std::sync::Mutex<Option<Arc<OwnedFd>>> = std::sync::Mutex::new(None);

/// Make `root` this process's shared-memory pool (a forked sandbox's, before its first run).
pub fn set_pool(root: Option<Arc<OwnedFd>>) {
    *POOL.lock().unwrap_or_else(|e| e.into_inner()) = root;
}

/// This process's shared-memory pool, if it has one.
pub fn pool() -> Option<Arc<OwnedFd>> {
    POOL.lock().unwrap_or_else(|e| e.into_inner()).clone()
}

/// Bytes still free in the pool (None: no pool).
pub fn pool_free() -> Option<u64> {
    free_in(pool().as_deref())
}

fn free_in(root: Option<&OwnedFd>) -> Option<u64> {
    crate::quota::usage_of(root?).ok().map(|u| u.quota_bytes.saturating_sub(u.bytes))
}

/// The name, in the pool's root (where the guest cannot reach: its /dev/shm is a directory
/// below), of the empty file that says the pool's limit refused something since the controller
/// last looked (`quota::Scratch::take_marker`). A file, because the refusal may happen in any of
/// the sandbox's VMM processes.
pub const LIMIT_MARKER: &std::ffi::CStr = c"limit-reached";

/// Record that the sandbox's shared-memory limit refused something (an mmap, a page, a write).
pub fn note_limit_reached() {
    note_limit_reached_in(pool().as_deref());
}

fn note_limit_reached_in(root: Option<&OwnedFd>) {
    if let Some(root) = root {
        // SAFETY: openat relative to a directory descriptor we hold, with a valid C string.
        let fd = unsafe { libc::openat(root.as_raw_fd(), LIMIT_MARKER.as_ptr(), libc::O_CREAT | libc::O_WRONLY | libc::O_CLOEXEC, 0o600) };
        if fd >= 0 {
            // SAFETY: the descriptor just opened.
            unsafe { libc::close(fd) };
        }
    }
}

/// Whether the pool is full (less than 64 KiB left): a page the kernel could not give a
/// shared mapping was refused by the limit, not by a file that shrank.
pub fn pool_full() -> bool {
    pool_free().is_some_and(|free| free < (64 << 10))
}

/// A new, empty, nameless file in the shared-memory pool (`O_TMPFILE`: it goes with its last
/// descriptor and mapping), or a memfd where there is no pool. Its pages are the pool's: past the
/// pool's size a write gets ENOSPC and a fault through a mapping SIGBUS, from the kernel.
pub fn pool_file() -> std::io::Result<OwnedFd> {
    pool_file_in(pool().as_deref())
}

fn pool_file_in(root: Option<&OwnedFd>) -> std::io::Result<OwnedFd> {
    use std::os::fd::FromRawFd;
    let fd = match root {
        // SAFETY: openat relative to a directory descriptor we hold, with a valid C string; the
        // result is checked.
        Some(root) => unsafe { libc::openat(root.as_raw_fd(), c".".as_ptr(), libc::O_TMPFILE | libc::O_RDWR | libc::O_CLOEXEC, 0o600) },
        // SAFETY: memfd_create with a valid NUL-terminated name; the result is checked.
        None => unsafe { libc::memfd_create(c"collimate-shared".as_ptr(), libc::MFD_CLOEXEC) },
    };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

/// A new file of `len` bytes for shared anonymous memory ([`pool_file`]). ENOMEM when `len` is
/// more than the pool has free: the mapping could never be touched whole (Linux's strict
/// overcommit answers the same at mmap).
pub fn memfd(len: u64) -> std::io::Result<OwnedFd> {
    memfd_in(pool().as_deref(), len)
}

fn memfd_in(root: Option<&OwnedFd>, len: u64) -> std::io::Result<OwnedFd> {
    if free_in(root).is_some_and(|free| len > free) {
        note_limit_reached_in(root);
        return Err(std::io::Error::from_raw_os_error(libc::ENOMEM));
    }
    let fd = pool_file_in(root)?;
    // SAFETY: ftruncate on our own descriptor.
    if unsafe { libc::ftruncate(fd.as_raw_fd(), len as libc::off_t) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(fd)
}

/// Fill `buf` from `fd` at `offset` with `pread`; what lies past the end of the file (in the last
/// page it has a part of) reads as zeros, as through a mapping.
fn read_file_at(fd: &OwnedFd, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
    let mut done = 0;
    while done < buf.len() {
        let rest = &mut buf[done..];
        // SAFETY: pread into the live buffer `rest`, of its length, from a descriptor we hold.
        let n = unsafe { libc::pread(fd.as_raw_fd(), rest.as_mut_ptr().cast(), rest.len(), (offset + done as u64) as libc::off_t) };
        match n {
            n if n > 0 => done += n as usize,
            0 => {
                rest.fill(0);
                break;
            }
            _ => {
                let e = std::io::Error::last_os_error();
                if e.raw_os_error() != Some(libc::EINTR) {
                    return Err(e);
                }
            }
        }
    }
    Ok(())
}

/// mmap `fd` shared, at `at` (replacing what is there) or where the kernel likes.
fn host_map(fd: &OwnedFd, offset: u64, len: u64, writable: bool, at: Option<*mut u8>) -> std::io::Result<*mut u8> {
    let prot = if writable { libc::PROT_READ | libc::PROT_WRITE } else { libc::PROT_READ };
    let (addr, fixed) = match at {
        Some(p) => (p.cast(), libc::MAP_FIXED),
        None => (std::ptr::null_mut(), 0),
    };
    // SAFETY: a shared mapping of a descriptor we hold; with MAP_FIXED, `at` is a live window of
    // exactly `len` bytes that we own and replace.
    let p = unsafe { libc::mmap(addr, len as usize, prot, libc::MAP_SHARED | fixed, fd.as_raw_fd(), offset as libc::off_t) };
    if p == libc::MAP_FAILED {
        return Err(std::io::Error::last_os_error());
    }
    Ok(p.cast())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn windows_of_one_file_are_coherent_and_placed_apart() {
        let mut ws = Windows::default();
        let fd = Arc::new(memfd(3 * PAGE_SIZE).unwrap());
        let a = ws.map(fd.clone(), 0, 3 * PAGE_SIZE, true, false).unwrap();
        let b = ws.map(fd.clone(), PAGE_SIZE, 2 * PAGE_SIZE, true, false).unwrap();
        assert_eq!(a, WINDOW_BASE);
        assert_eq!(b, WINDOW_BASE + ALIGN);
        ws.write(a + PAGE_SIZE + 5, b"shared").unwrap();
        let mut buf = [0u8; 6];
        ws.read(b + 5, &mut buf).unwrap();
        assert_eq!(&buf, b"shared");
        // Outside any window, or across a window's end: refused.
        assert!(ws.read(a + 3 * PAGE_SIZE, &mut buf).is_none());
        assert!(ws.read(b + 2 * PAGE_SIZE - 3, &mut buf).is_none());
        let g = ws.generation();
        ws.retain(|w| w.gpa != a);
        assert!(ws.generation() > g && ws.len() == 1 && ws.find(a).is_none());
        // The freed range stays parked with its slot, and a mapping of its length takes it again.
        assert_eq!(ws.slots().count(), 2);
        assert_eq!(ws.map(fd.clone(), 0, PAGE_SIZE, true, false).unwrap(), 2 * ALIGN + WINDOW_BASE, "another length: a new range");
        assert_eq!(ws.map(fd, 0, 3 * PAGE_SIZE, true, false).unwrap(), WINDOW_BASE);
    }

    #[test]
    fn a_parked_window_keeps_its_slot_lets_its_file_go_and_shows_the_next_file() {
        let mut ws = Windows::default();
        let first = Arc::new(memfd(4 * PAGE_SIZE).unwrap());
        let a = ws.map(first.clone(), 0, 4 * PAGE_SIZE, true, false).unwrap();
        ws.write(a, b"old").unwrap();
        let slots: Vec<_> = ws.slots().collect();
        ws.retain(|_| false);
        assert!(ws.is_empty() && ws.find(a).is_none());
        assert_eq!(ws.slots().collect::<Vec<_>>(), slots, "the slot stays");
        assert_eq!(Arc::strong_count(&first), 1, "the file is let go");
        let b = ws.map(Arc::new(memfd(4 * PAGE_SIZE).unwrap()), 0, 4 * PAGE_SIZE, true, false).unwrap();
        assert_eq!((b, ws.slots().collect::<Vec<_>>()), (a, slots));
        let mut buf = [9u8; 3];
        ws.read(b, &mut buf).unwrap();
        assert_eq!(&buf, &[0, 0, 0], "the new file's contents, not the old one's");
        // SAFETY: reading the live host mapping of the window, inside its length.
        assert_eq!(unsafe { *(ws.find(b).unwrap().host_addr() as *const u8) }, 0);
        ws.clear();
        assert_eq!(ws.slots().count(), 0);
    }

    #[test]
    fn past_the_end_of_a_file_is_refused_not_a_host_sigbus() {
        let dir = std::env::temp_dir().join(format!("collimate-win-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let f = std::fs::OpenOptions::new().read(true).write(true).create(true).truncate(true).open(dir.join("f")).unwrap();
        f.set_len(100).unwrap();
        let mut ws = Windows::default();
        let a = ws.map(Arc::new(OwnedFd::from(f.try_clone().unwrap())), 0, 4 * PAGE_SIZE, true, true).unwrap();
        ws.write(a + 10, b"x").unwrap();
        assert!(ws.write(a + PAGE_SIZE, b"x").is_none(), "a page wholly past the end");
        let mut b = [0u8; 1];
        assert!(ws.read(a + 2 * PAGE_SIZE, &mut b).is_none());
        // A copy for a forked sandbox holds what the window showed, and is no longer the file.
        let new = ws.replace(a, None).unwrap();
        ws.read(a + 10, &mut b).unwrap();
        assert_eq!(&b, b"x");
        ws.write(a + 10, b"y").unwrap();
        let mut fb = [0u8; 1];
        std::os::unix::fs::FileExt::read_exact_at(&f, &mut fb, 10).unwrap();
        assert_eq!(&fb, b"x", "the file is not written through the copy");
        assert!(Arc::ptr_eq(&new, &ws.find(a).unwrap().fd));
        assert!(ws.read(a + 2 * PAGE_SIZE, &mut b).is_some(), "the copy is a memfd as long as the window");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[test]
    fn the_pool_bounds_shared_memory_with_enomem_and_enospc_never_a_host_sigbus() {
        if !crate::quota::available() {
            eprintln!("skipped: no CAP_SYS_ADMIN for tmpfs instances");
            return;
        }
        let pool = crate::quota::Scratch::new(crate::quota::DiskQuota { bytes: 1 << 20, inodes: 64 }).unwrap();
        let root = Some(&pool.0);
        // A mapping larger than the pool could never be touched whole: refused, and marked.
        let e = memfd_in(root, 2 << 20).unwrap_err();
        assert_eq!(e.raw_os_error(), Some(libc::ENOMEM));
        assert!(pool.take_marker(LIMIT_MARKER) && !pool.take_marker(LIMIT_MARKER));
        // Two that fit when made; writing both whole runs into the pool's size. The host's writes
        // through a window go through the file: ENOSPC (None), where a store would be a SIGBUS.
        let mut ws = Windows::default();
        let (fa, fb) = (Arc::new(memfd_in(root, 1 << 20).unwrap()), Arc::new(memfd_in(root, 1 << 20).unwrap()));
        let a = ws.map(fa, 0, 1 << 20, true, false).unwrap();
        let b = ws.map(fb, 0, 1 << 20, true, false).unwrap();
        let page = [7u8; PAGE_SIZE as usize];
        for at in (0..1 << 20).step_by(PAGE_SIZE as usize) {
            ws.write(a + at, &page).unwrap();
        }
        assert!(ws.write(b, &page).is_none(), "the pool is full");
        assert_eq!(free_in(root), Some(0));
        // Reads of pages the file does not hold allocate nothing and read zeros.
        let mut buf = [1u8; 16];
        ws.read(b + 8 * PAGE_SIZE, &mut buf).unwrap();
        assert_eq!(buf, [0u8; 16]);
        ws.read(a + 5, &mut buf).unwrap();
        assert_eq!(buf, [7u8; 16]);
        // Unmapping gives the room back (the files go with their last mapping and descriptor).
        ws.clear();
        assert_eq!(free_in(root), Some(1 << 20));
    }

    #[test]
    fn the_cap_is_an_error_not_a_failure() {
        let mut ws = Windows::default();
        let fd = Arc::new(memfd(PAGE_SIZE).unwrap());
        for _ in 0..MAX_WINDOWS {
            ws.map(fd.clone(), 0, PAGE_SIZE, true, false).unwrap();
        }
        assert!(matches!(ws.map(fd, 0, PAGE_SIZE, true, false), Err(WindowError::TooMany)));
    }
}
