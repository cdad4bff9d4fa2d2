//! Loaded program images kept in memory files, so that starting the same program again (every
//! `exec(command=...)` starts busybox `sh`) neither copies its bytes nor allocates their pages.
//!
//! # Why
//! A spawned program starts in fresh guest memory (`spawn`). Loading it there wrote every page of
//! its file (busybox: 2 MB) into new private pages: on this host each new page costs about 5 us
//! (the host is itself a VM), which made the copy and the faults around it the largest step of a
//! short command (docs/spawn.md), and the exit paid again to free them.
//!
//! # How
//! The fresh memory of a guest process is a private mapping of a memory file (see
//! `vstate::memory`). The first time a process of this tree starts a program, [`ensure`] lays it
//! out once in scratch memory with the code every load starts with (`paging::setup_address_space`,
//! then `exec::lay_out`: the ring-0 layout and the program's and interpreter's segments, which
//! depend on the files alone) and keeps the memory in a memory file, with the frame allocator, the
//! address space and the VMAs that step left. A later load of the same files maps that file
//! instead of an empty one ([`lookup`], `GuestMemory::over_image`), starts from the kept state and
//! goes on where the load would (`exec::commit_laid`: the stack, arguments, auxiliary vector). The
//! program's pages stay the file's pages, shared by every process that runs it until one writes to
//! them (copy-on-write); the memory is the same byte for byte as a load from scratch makes.
//!
//! Entries are per VMM process and inherited by its forks: a program's second spawn caches it in
//! the process that spawns, before the host fork (a program started once does not pay for it),
//! and a template's VMM caches `/bin/sh` and `/usr/bin/python3` before it forks sandboxes
//! ([`warm`]); at most
//! [`MAX_ENTRIES`] programs, the oldest goes first. An entry holds the program's bytes (the key is their identity, so a changed file is
//! a new entry). `COLLIMATE_EXEC_CACHE=0` turns the cache off, to compare.

use std::fs::File;
use std::os::fd::FromRawFd;
use std::os::unix::fs::FileExt;
use std::sync::{Arc, Mutex, Weak};

use crate::arch::x86_64::paging::{setup_address_space, AddressSpace, FrameAllocator};
use crate::error::{Error, Result};
use crate::guestos::{exec, GuestOs};
use crate::vstate::memory::GuestMemory;

use super::spawn_prefault::Touched;

/// Programs kept at most (the oldest goes first).
const MAX_ENTRIES: usize = 8;

struct Entry {
    prog: Arc<Vec<u8>>,
    interp: Option<Arc<Vec<u8>>>,
    mem_size: u64,
    /// `mem_size` bytes: the laid-out image, then a hole.
    file: File,
    frames: FrameAllocator,
    aspace: AddressSpace,
    laid: exec::Laid,
    /// The pages its runs touch (`spawn_prefault`).
    touched: Option<Touched>,
}

/// A cached image to load a program over.
pub(super) struct Hit {
    /// A descriptor of the image file of its own (for `GuestMemory::over_image`).
    pub(super) file: File,
    pub(super) frames: FrameAllocator,
    pub(super) aspace: AddressSpace,
    pub(super) laid: exec::Laid,
    pub(super) touched: Option<Touched>,
}

impl Entry {
    fn is_for(&self, mem_size: u64, p: &exec::Prepared) -> bool {
        let (prog, interp) = p.files();
        self.mem_size == mem_size
            && Arc::ptr_eq(&self.prog, prog)
            && match (&self.interp, interp) {
                (None, None) => true,
                (Some(a), Some(b)) => Arc::ptr_eq(a, b),
                _ => false,
            }
    }
}

static CACHE: Mutex<Vec<Entry>> = Mutex::new(Vec::new());

/// Programs spawned once and not cached (yet): the second spawn caches (a program started once
/// does not pay for the cache, a load and a copy of its image).
static SEEN: Mutex<Vec<Weak<Vec<u8>>>> = Mutex::new(Vec::new());
const MAX_SEEN: usize = 32;

/// Whether `prog` was seen before; records it if not.
fn seen_before(prog: &Arc<Vec<u8>>) -> bool {
    let Ok(mut seen) = SEEN.try_lock() else { return false };
    seen.retain(|w| w.strong_count() > 0);
    if seen.iter().any(|w| std::ptr::eq(w.as_ptr(), Arc::as_ptr(prog))) {
        return true;
    }
    if seen.len() >= MAX_SEEN {
        seen.remove(0);
    }
    seen.push(Arc::downgrade(prog));
    false
}

fn enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_EXEC_CACHE").is_none_or(|v| v != "0"))
}

/// The cached image for loading `p` into memory of `mem_size` bytes, if there is one.
pub(super) fn lookup(mem_size: u64, p: &exec::Prepared) -> Option<Hit> {
    if !enabled() {
        return None;
    }
    // try_lock: a process forked by another thread while it held the lock must not wait forever.
    let cache = CACHE.try_lock().ok()?;
    let e = cache.iter().find(|e| e.is_for(mem_size, p))?;
    crate::trace::mark("image_cache.hit");
    Some(Hit { file: e.file.try_clone().ok()?, frames: e.frames.clone(), aspace: e.aspace.clone(), laid: e.laid.clone(), touched: e.touched.clone() })
}

/// Cache the image of `p` for memory of `mem_size` bytes if this is its second spawn here (or
/// `always`). Best effort: a failure leaves loads as they were.
pub(super) fn ensure(mem_size: u64, p: &exec::Prepared, always: bool) {
    if !enabled() {
        return;
    }
    let Ok(mut cache) = CACHE.try_lock() else { return };
    if cache.iter().any(|e| e.is_for(mem_size, p)) || !(seen_before(p.files().0) || always) {
        return;
    }
    crate::trace::mark("image_cache.build");
    let Ok(e) = build(mem_size, p) else { return };
    if cache.len() >= MAX_ENTRIES {
        cache.remove(0);
    }
    cache.push(e);
    crate::trace::mark("image_cache.built");
}

/// What a template's commands start most: the shell (every `exec(command=...)`) and Python
/// (which the shell execs in place, where only what an ancestor cached is found).
const WARM: &[&[u8]] = &[b"/bin/sh", b"/usr/bin/python3"];

/// Cache the programs of [`WARM`] the guest has.
pub(super) fn warm(os: &GuestOs, mem_size: u64) {
    for path in WARM {
        if let Ok(p) = exec::prepare(os, path, &[path.to_vec()], &[]) {
            ensure(mem_size, &p, true);
        }
    }
}

fn build(mem_size: u64, p: &exec::Prepared) -> Result<Entry> {
    let mut mem = GuestMemory::anonymous(mem_size)?;
    let mut frames = FrameAllocator::new(mem_size);
    let aspace = setup_address_space(&mut mem, &mut frames)?;
    mem.populate_for_write(frames.next, p.image_bytes());
    let laid = exec::lay_out(&mut mem, &mut frames, &aspace, p).map_err(|e| Error::Image(format!("caching a program image: errno {}", e.0)))?;
    let len = frames.next;
    let mut bytes = vec![0u8; len as usize];
    mem.read(0, &mut bytes)?;
    // SAFETY: memfd_create with a valid NUL-terminated name; checked.
    let fd = unsafe { libc::memfd_create(c"collimate-image".as_ptr(), libc::MFD_CLOEXEC) };
    if fd < 0 {
        return Err(Error::last_os("memfd_create"));
    }
    // SAFETY: a fresh descriptor we own.
    let file = unsafe { File::from_raw_fd(fd) };
    file.set_len(mem_size).map_err(Error::sys("ftruncate a program image"))?;
    file.write_all_at(&bytes, 0).map_err(Error::sys("write a program image"))?;
    let (prog, interp) = p.files();
    Ok(Entry { prog: prog.clone(), interp: interp.cloned(), mem_size, file, frames, aspace, laid, touched: Touched::new() })
}
