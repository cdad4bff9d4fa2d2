//! The guest's address space on a platform whose page tables the host kernel keeps (systrap):
//! the platform half of each call. The VMA records and what every platform checks the same way
//! (/proc/self/maps, brk, placement, the argument checks and errnos Linux gives) are [`Mm`]'s, in
//! mm.rs, shared with kvm, whose half (frames and page tables) is there too; here every change of
//! the mappings is made by the platform ([`HostSpace`]: map, unmap, protect inside the guest's host
//! process).
//!
//! There are no frames and no lazy mappings here: a private file mapping is a host `MAP_PRIVATE`
//! mapping of the file, whose pages the host kernel faults in; a shared one is a host
//! `MAP_SHARED` mapping of the same file in every process that maps it. What differs from kvm:
//! - mremap that moves a private mapping copies its contents through the platform (no frames to
//!   remap); one that grows a file mapping in place is refused (ENOMEM) as on kvm.
//! - MADV_DONTNEED zeroes private anonymous memory (a fresh anonymous mapping over it), as Linux
//!   does; on file mappings it leaves the contents alone (the kvm simplification).
//! - mincore reports every mapped page resident.
//! - a private file mapping made again over itself (same file, same offsets, pages still the
//!   file's) only changes its protection: `host_remap_in_place`.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::{
    dup_cloexec, map_source, Heap, MapFd, MapFile, Mm, Reserved, Vma, MADV_DONTNEED, MADV_DONTNEED_LOCKED, MAP_ANONYMOUS, MAP_PRIVATE,
    MAP_SHARED, MREMAP_FIXED, PROT_READ, PROT_WRITE, SYS_BRK, SYS_MADVISE, SYS_MINCORE, SYS_MLOCK, SYS_MLOCK2, SYS_MLOCKALL, SYS_MMAP,
    SYS_MPROTECT, SYS_MREMAP, SYS_MSYNC, SYS_MUNLOCK, SYS_MUNLOCKALL, SYS_MUNMAP,
};
use crate::guestos::{Errno, GuestOs, SysResult, EINVAL, ENOMEM};
use crate::platform::HostSpace;

const ANON_PRIVATE: u32 = MAP_PRIVATE | MAP_ANONYMOUS;

impl Mm {
    /// Forget the VMAs of [start, end) (page aligned), without touching the platform.
    fn forget_range(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        for k in self.split_range(start, end) {
            self.vmas.remove(&k);
        }
    }

    /// Remove the VMAs and the host mappings of [start, end).
    pub fn host_unmap_range(&mut self, h: &mut dyn HostSpace, start: u64, end: u64) -> Result<(), Errno> {
        if start >= end {
            return Ok(());
        }
        h.unmap(start, end - start)?;
        self.forget_range(start, end);
        Ok(())
    }

    /// Map [start, end) as `vma` says, on the platform and in the VMA list (replacing both).
    /// `file`: the host descriptor and offset for a file mapping.
    pub fn host_map(&mut self, h: &mut dyn HostSpace, start: u64, vma: Vma, file: Option<(i32, u64)>) -> Result<(), Errno> {
        let flags = if vma.shared { MAP_SHARED } else { MAP_PRIVATE } | if file.is_none() { MAP_ANONYMOUS } else { 0 };
        h.map(start, vma.end - start, vma.prot, flags, file)?;
        self.forget_range(start, vma.end);
        self.insert(start, vma);
        Ok(())
    }

    /// mmap(2) on a host-kept address space. `file` is `None` for anonymous memory.
    pub fn host_mmap(&mut self, h: &mut dyn HostSpace, addr: u64, len: u64, prot: u32, flags: u32, file: Option<MapFile>) -> Result<u64, Errno> {
        let (start, len, shared) = self.mmap_place(addr, len, prot, flags, reserved(h))?;
        let mut vma = Vma { end: start + len, prot, shared, name: String::new(), file: None, offset: 0, lazy: None, window: None, pristine: false };
        let source = match &file {
            Some(f) => {
                vma.of_file(f, len, i64::MAX as u64)?;
                if shared {
                    // Kept for mremap, which maps the file again at the new place.
                    vma.lazy = Some(MapFd(Arc::new(dup_cloexec(f.fd)?)));
                } else {
                    vma.pristine = prot & PROT_WRITE == 0;
                    if self.host_remap_in_place(h, start, &vma)? {
                        return Ok(start);
                    }
                }
                Some((f.fd, f.offset))
            }
            // Shared anonymous memory is a memfd, shared with the fork children of this process
            // (the host fork of the stub keeps a MAP_SHARED mapping shared).
            None if shared => {
                let fd = Arc::new(crate::vstate::shared::memfd(len).map_err(|_| ENOMEM)?);
                vma.lazy = Some(MapFd(fd.clone()));
                let raw = fd.as_raw_fd();
                self.host_map(h, start, vma, Some((raw, 0)))?;
                return Ok(start);
            }
            None => None,
        };
        self.host_map(h, start, vma, source)?;
        Ok(start)
    }

    /// A private file mapping `vma` at `start` over the same file already mapped there at the
    /// same offsets, with pages that are still the file's ([`Vma::pristine`]): the host mapping
    /// already shows what a new one would, so only its protection changes (one call in the
    /// guest's process, or none) instead of a new mapping (on systrap: the descriptor passed to
    /// the stub, then its mmap and close, three round trips). This is how the dynamic loader maps
    /// a library: the whole file read-only, then each segment again with MAP_FIXED, the text and
    /// read-only data at the offsets they already have. False if it does not apply.
    /// (A guest syscall that writes its result into such a read-only mapping, EFAULT on Linux,
    /// is written here as into any guest page, and the page is then no longer the file's: a
    /// guest that does that and maps the file there again sees what was written.)
    fn host_remap_in_place(&mut self, h: &mut dyn HostSpace, start: u64, vma: &Vma) -> Result<bool, Errno> {
        let end = vma.end;
        if vma.file.is_none() || !self.covered(start, end) {
            return Ok(false);
        }
        let same = self.vmas.range(..end).filter(|(s, v)| v.end > start && **s < end).all(|(&s, v)| {
            !v.shared && v.pristine && v.file == vma.file && v.offset.wrapping_add(start.max(s) - s) == vma.offset + (start.max(s) - start)
        });
        if !same {
            return Ok(false);
        }
        if !self.parts(start, end, |v| v.prot != vma.prot).is_empty() {
            h.protect(start, end - start, vma.prot)?;
        }
        self.forget_range(start, end);
        self.insert(start, vma.clone());
        crate::trace::mark("mmap.in_place");
        Ok(true)
    }

    /// munmap(2).
    pub fn host_munmap(&mut self, h: &mut dyn HostSpace, addr: u64, len: u64) -> Result<u64, Errno> {
        let end = Self::munmap_end(addr, len)?;
        self.host_unmap_range(h, addr, end)?;
        Ok(0)
    }

    /// mprotect(2).
    pub fn host_mprotect(&mut self, h: &mut dyn HostSpace, addr: u64, len: u64, prot: u32) -> Result<u64, Errno> {
        let Some((end, prot)) = self.mprotect_range(addr, len, prot)? else { return Ok(0) };
        // The host checks a shared mapping of a read-only file (EACCES) itself.
        h.protect(addr, end - addr, prot)?;
        for k in self.split_range(addr, end) {
            if let Some(v) = self.vmas.get_mut(&k) {
                v.prot = prot;
                // Writable once: its pages may be copies from now on.
                v.pristine &= prot & PROT_WRITE == 0;
            }
        }
        self.merge_around(addr, end);
        Ok(0)
    }

    /// brk(2): returns the new break, or the old one if it cannot move.
    pub fn host_brk(&mut self, h: &mut dyn HostSpace, new: u64) -> u64 {
        self.move_brk(new, |mm, heap| match heap {
            Heap::Grow(old_top, new_top) => mm.host_map(h, old_top, Vma::anon(new_top, PROT_READ | PROT_WRITE, "[heap]"), None),
            Heap::Shrink(new_top, old_top) => mm.host_unmap_range(h, new_top, old_top),
        })
    }

    /// mremap(2).
    pub fn host_mremap(&mut self, h: &mut dyn HostSpace, old: u64, old_len: u64, new_len: u64, flags: u64, new_addr: u64) -> Result<u64, Errno> {
        let (old_len, new_len, old_end, vstart, mut tmpl) = self.mremap_source(old, old_len, new_len, flags)?;
        if tmpl.file.is_some() || tmpl.shared {
            tmpl.offset += old - vstart;
        }
        // A moved or grown private mapping holds copies (anonymous memory), not the file's pages.
        tmpl.pristine = false;
        if tmpl.shared && new_len > old_len {
            return Err(ENOMEM);
        }
        if flags & MREMAP_FIXED != 0 {
            let new_end = Self::mremap_target(new_addr, new_len, old, old_end, reserved(h))?;
            self.host_unmap_range(h, new_addr, new_end)?;
            return self.host_move(h, old, old_len, new_addr, new_len, tmpl);
        }
        if new_len <= old_len {
            self.host_unmap_range(h, old + new_len, old_end)?;
            return Ok(old);
        }
        if let Some(grow_end) = self.grow_in_place(old, old_end, new_len, &tmpl, reserved(h)) {
            let mut ext = tmpl.clone();
            ext.end = grow_end;
            self.host_map(h, old_end, ext, None)?;
            return Ok(old);
        }
        let dest = self.move_dest(flags, new_len, &tmpl)?;
        self.host_move(h, old, old_len, dest, new_len, tmpl)
    }

    /// Move [old, old+old_len) to `dest` (free, `new_len` bytes): a shared mapping maps its file
    /// again there; a private one gets a fresh mapping holding a copy of its contents.
    fn host_move(&mut self, h: &mut dyn HostSpace, old: u64, old_len: u64, dest: u64, new_len: u64, mut tmpl: Vma) -> Result<u64, Errno> {
        let keep = old_len.min(new_len);
        tmpl.end = dest + new_len;
        if tmpl.shared {
            let fd = tmpl.lazy.as_ref().map(|l| l.0.clone()).ok_or(EINVAL)?;
            let offset = tmpl.offset;
            self.host_map(h, dest, tmpl, Some((fd.as_raw_fd(), offset)))?;
        } else {
            let prot = tmpl.prot;
            // Written while writable, then given the mapping's protection.
            let mut staging = tmpl.clone();
            staging.prot = PROT_READ | PROT_WRITE;
            self.host_map(h, dest, staging, None)?;
            let mut buf = vec![0u8; (keep as usize).min(1 << 20)];
            let mut done = 0;
            while done < keep {
                let n = ((keep - done) as usize).min(buf.len());
                // Pages the guest cannot read (PROT_NONE) are read by the platform all the same.
                h.read(old + done, &mut buf[..n])?;
                h.write(dest + done, &buf[..n])?;
                done += n as u64;
            }
            if prot != PROT_READ | PROT_WRITE {
                self.host_mprotect(h, dest, new_len, prot)?;
            }
        }
        self.host_unmap_range(h, old, old + old_len)?;
        Ok(dest)
    }

    /// madvise(2).
    pub fn host_madvise(&mut self, h: &mut dyn HostSpace, addr: u64, len: u64, advice: u64) -> Result<u64, Errno> {
        let Some(end) = Self::madvise_range(addr, len, advice)? else { return Ok(0) };
        if advice == MADV_DONTNEED || advice == MADV_DONTNEED_LOCKED {
            if !self.covered(addr, end) {
                return Err(ENOMEM);
            }
            for (s, e, prot) in self.parts(addr, end, |v| v.file.is_none() && !v.shared) {
                h.map(s, e - s, prot, ANON_PRIVATE, None)?;
            }
        }
        Ok(0)
    }

    /// mincore(2): every mapped page counts as resident.
    fn host_mincore(&self, addr: u64, len: u64) -> Result<Vec<u8>, Errno> {
        let (_, pages) = self.mincore_pages(addr, len)?;
        Ok(vec![1u8; pages])
    }
}

/// The range the platform keeps for itself.
fn reserved(h: &dyn HostSpace) -> Reserved {
    let (lo, hi) = h.reserved();
    Reserved(lo, hi)
}

/// Handle a memory-management syscall on a host-kept address space; `None` if `nr` is not one
/// of ours.
pub fn dispatch(os: &mut GuestOs, h: &mut dyn HostSpace, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let r = match nr {
        SYS_MMAP => map_source(os, &a).and_then(|file| os.mm.host_mmap(h, a[0], a[1], a[2] as u32, a[3] as u32, file)),
        SYS_MUNMAP => os.mm.host_munmap(h, a[0], a[1]),
        SYS_MPROTECT => os.mm.host_mprotect(h, a[0], a[1], a[2] as u32),
        SYS_BRK => Ok(os.mm.host_brk(h, a[0])),
        SYS_MREMAP => os.mm.host_mremap(h, a[0], a[1], a[2], a[3], a[4]),
        SYS_MADVISE => os.mm.host_madvise(h, a[0], a[1], a[2]),
        SYS_MSYNC => os.mm.msync(a[0], a[1], a[2]),
        SYS_MINCORE => os.mm.host_mincore(a[0], a[1]).and_then(|v| h.write(a[2], &v).map(|_| 0)),
        SYS_MLOCK | SYS_MUNLOCK | SYS_MLOCKALL | SYS_MUNLOCKALL | SYS_MLOCK2 => Ok(0),
        _ => return None,
    };
    Some(r)
}
