//! The guest's address space on a platform whose page tables the host kernel keeps (systrap):
//! the same VMA bookkeeping as on kvm ([`Mm`]: /proc/self/maps, brk, placement, the checks and
//! errnos Linux gives), with every change of the mappings also made by the platform
//! ([`HostSpace`]: map, unmap, protect inside the guest's host process).
//!
//! There are no frames and no lazy mappings here: a private file mapping is a host `MAP_PRIVATE`
//! mapping of the file, whose pages the host kernel faults in; a shared one is a host
//! `MAP_SHARED` mapping of the same file in every process that maps it. What differs from kvm:
//! - mremap that moves a private mapping copies its contents through the platform (no frames to
//!   remap); one that grows a file mapping in place is refused (ENOMEM) as on kvm.
//! - MADV_DONTNEED zeroes private anonymous memory (a fresh anonymous mapping over it), as Linux
//!   does; on file mappings it leaves the contents alone (the kvm simplification).
//! - mincore reports every mapped page resident.

use std::os::fd::AsRawFd;
use std::sync::Arc;

use super::{
    check_file, dup_cloexec, map_source, page_up, user_range, MapFd, MapFile, Mm, Vma, EOVERFLOW, EPERM_MMAP, MADV_DONTNEED,
    MADV_DONTNEED_LOCKED, MADV_MAX, MAP_ANONYMOUS, MAP_FIXED, MAP_FIXED_NOREPLACE, MAP_PRIVATE, MAP_SHARED, MAP_SHARED_VALIDATE, MAX_MAP,
    MMAP_MIN_ADDR, MREMAP_FIXED, MREMAP_MAYMOVE, PROT_EXEC, PROT_GROWSDOWN, PROT_GROWSUP, PROT_READ, PROT_WRITE, SYS_BRK,
    SYS_MADVISE, SYS_MINCORE, SYS_MLOCK, SYS_MLOCK2, SYS_MLOCKALL, SYS_MMAP, SYS_MPROTECT, SYS_MREMAP, SYS_MSYNC, SYS_MUNLOCK,
    SYS_MUNLOCKALL, SYS_MUNMAP, TASK_SIZE,
};
use crate::arch::x86_64::layout::PAGE_SIZE;
use crate::guestos::{Errno, GuestOs, SysResult, EEXIST, EFAULT, EINVAL, ENOMEM};
use crate::platform::HostSpace;

const ANON_PRIVATE: u32 = MAP_PRIVATE | MAP_ANONYMOUS;

impl Mm {
    /// Forget the VMAs of [start, end) (page aligned), without touching the platform.
    fn forget_range(&mut self, start: u64, end: u64) {
        if start >= end {
            return;
        }
        self.split(start);
        self.split(end);
        let keys: Vec<u64> = self.vmas.range(start..end).map(|(s, _)| *s).collect();
        for k in keys {
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
        if len == 0 {
            return Err(EINVAL);
        }
        let len = page_up(len).filter(|&l| l <= MAX_MAP).ok_or(ENOMEM)?;
        if prot & !(PROT_READ | PROT_WRITE | PROT_EXEC) != 0 {
            return Err(EINVAL);
        }
        let kind = flags & MAP_SHARED_VALIDATE;
        if kind == 0 {
            return Err(EINVAL);
        }
        let shared = kind != MAP_PRIVATE;
        let start = if flags & (MAP_FIXED | MAP_FIXED_NOREPLACE) != 0 {
            if addr % PAGE_SIZE != 0 {
                return Err(EINVAL);
            }
            let end = addr.checked_add(len).filter(|&e| e <= TASK_SIZE).ok_or(ENOMEM)?;
            if addr < MMAP_MIN_ADDR {
                return Err(EPERM_MMAP);
            }
            if flags & MAP_FIXED == 0 && self.overlaps(addr, end) {
                return Err(EEXIST);
            }
            addr
        } else {
            match self.placement(addr, len)? {
                // A hint into the platform's own range: placed as without one.
                s if touches_reserved(h, s, s + len) => self.find_free(len, self.mmap_top).ok_or(ENOMEM)?,
                s => s,
            }
        };
        let end = start + len;
        if touches_reserved(h, start, end) {
            return Err(ENOMEM);
        }
        let mut vma = Vma { end, prot, shared, name: String::new(), file: None, offset: 0, lazy: None, window: None };
        let source = match &file {
            Some(f) => {
                if f.offset % PAGE_SIZE != 0 {
                    return Err(EINVAL);
                }
                f.offset.checked_add(len).filter(|&e| e <= i64::MAX as u64).ok_or(EOVERFLOW)?;
                let (id, _) = check_file(f.fd, prot, shared)?;
                vma.file = Some(id);
                vma.offset = f.offset;
                vma.name = f.name.clone();
                if shared {
                    // Kept for mremap, which maps the file again at the new place.
                    vma.lazy = Some(MapFd(Arc::new(dup_cloexec(f.fd)?)));
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

    /// munmap(2).
    pub fn host_munmap(&mut self, h: &mut dyn HostSpace, addr: u64, len: u64) -> Result<u64, Errno> {
        if len == 0 {
            return Err(EINVAL);
        }
        let end = user_range(addr, len).map_err(|_| EINVAL)?;
        self.host_unmap_range(h, addr, end)?;
        Ok(0)
    }

    /// mprotect(2).
    pub fn host_mprotect(&mut self, h: &mut dyn HostSpace, addr: u64, len: u64, prot: u32) -> Result<u64, Errno> {
        let prot = prot & !(PROT_GROWSDOWN | PROT_GROWSUP);
        if prot & !(PROT_READ | PROT_WRITE | PROT_EXEC) != 0 {
            return Err(EINVAL);
        }
        let end = user_range(addr, len)?;
        if addr == end {
            return Ok(0);
        }
        if !self.covered(addr, end) {
            return Err(ENOMEM);
        }
        // The host checks a shared mapping of a read-only file (EACCES) itself.
        h.protect(addr, end - addr, prot)?;
        self.split(addr);
        self.split(end);
        let keys: Vec<u64> = self.vmas.range(addr..end).map(|(s, _)| *s).collect();
        for k in keys {
            if let Some(v) = self.vmas.get_mut(&k) {
                v.prot = prot;
            }
        }
        self.merge_around(addr, end);
        Ok(0)
    }

    /// brk(2): returns the new break, or the old one if it cannot move.
    pub fn host_brk(&mut self, h: &mut dyn HostSpace, new: u64) -> u64 {
        if new < self.brk_start || new > self.mmap_top {
            return self.brk;
        }
        let (Some(old_top), Some(new_top)) = (page_up(self.brk), page_up(new)) else { return self.brk };
        if new_top > old_top {
            if self.overlaps(old_top, new_top)
                || self.host_map(h, old_top, Vma::anon(new_top, PROT_READ | PROT_WRITE, "[heap]"), None).is_err()
            {
                return self.brk;
            }
        } else if new_top < old_top && self.host_unmap_range(h, new_top, old_top).is_err() {
            return self.brk;
        }
        self.brk = new;
        new
    }

    /// mremap(2).
    pub fn host_mremap(&mut self, h: &mut dyn HostSpace, old: u64, old_len: u64, new_len: u64, flags: u64, new_addr: u64) -> Result<u64, Errno> {
        if flags & !(MREMAP_MAYMOVE | MREMAP_FIXED) != 0 || (flags & MREMAP_FIXED != 0 && flags & MREMAP_MAYMOVE == 0) {
            return Err(EINVAL);
        }
        if old % PAGE_SIZE != 0 {
            return Err(EINVAL);
        }
        let old_len = page_up(old_len).ok_or(EINVAL)?;
        let new_len = page_up(new_len).filter(|&l| l != 0 && l <= MAX_MAP).ok_or(EINVAL)?;
        if old_len == 0 {
            return Err(EINVAL);
        }
        let old_end = old.checked_add(old_len).filter(|&e| e <= TASK_SIZE).ok_or(EFAULT)?;
        let (vstart, v) = self.vma_at(old).ok_or(EFAULT)?;
        if v.end < old_end {
            return Err(EFAULT);
        }
        let mut tmpl = v.clone();
        if tmpl.file.is_some() || tmpl.shared {
            tmpl.offset += old - vstart;
        }
        if tmpl.shared && new_len > old_len {
            return Err(ENOMEM);
        }
        if flags & MREMAP_FIXED != 0 {
            if new_addr % PAGE_SIZE != 0 {
                return Err(EINVAL);
            }
            let new_end = new_addr.checked_add(new_len).filter(|&e| e <= TASK_SIZE).ok_or(EINVAL)?;
            if (new_addr < old_end && old < new_end) || new_addr < MMAP_MIN_ADDR {
                return Err(EINVAL);
            }
            if touches_reserved(h, new_addr, new_end) {
                return Err(EINVAL);
            }
            self.host_unmap_range(h, new_addr, new_end)?;
            return self.host_move(h, old, old_len, new_addr, new_len, tmpl);
        }
        if new_len <= old_len {
            self.host_unmap_range(h, old + new_len, old_end)?;
            return Ok(old);
        }
        if let Some(grow_end) = old.checked_add(new_len).filter(|&e| e <= TASK_SIZE) {
            if !self.overlaps(old_end, grow_end) && tmpl.file.is_none() {
                let mut ext = tmpl.clone();
                ext.end = grow_end;
                self.host_map(h, old_end, ext, None)?;
                return Ok(old);
            }
        }
        if flags & MREMAP_MAYMOVE == 0 || tmpl.file.is_some() {
            return Err(ENOMEM);
        }
        let dest = self.find_free(new_len, self.mmap_top).ok_or(ENOMEM)?;
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
        if advice > MADV_MAX && !(100..=101).contains(&advice) {
            return Err(EINVAL);
        }
        let end = user_range(addr, len).map_err(|_| EINVAL)?;
        if addr == end {
            return Ok(0);
        }
        if advice == MADV_DONTNEED || advice == MADV_DONTNEED_LOCKED {
            if !self.covered(addr, end) {
                return Err(ENOMEM);
            }
            let anon: Vec<(u64, u64, u32)> = self
                .vmas
                .range(..end)
                .filter(|(s, v)| v.end > addr && **s < end && v.file.is_none() && !v.shared)
                .map(|(s, v)| ((*s).max(addr), v.end.min(end), v.prot))
                .collect();
            for (s, e, prot) in anon {
                h.map(s, e - s, prot, ANON_PRIVATE, None)?;
            }
        }
        Ok(0)
    }

    /// mincore(2): every mapped page counts as resident.
    fn host_mincore(&self, addr: u64, len: u64) -> Result<Vec<u8>, Errno> {
        let end = user_range(addr, len)?;
        if !self.covered(addr, end) {
            return Err(ENOMEM);
        }
        let pages = (end - addr) / PAGE_SIZE;
        if pages > 1 << 24 {
            return Err(ENOMEM);
        }
        Ok(vec![1u8; pages as usize])
    }
}

/// Whether [start, end) overlaps the range the platform keeps for itself.
fn touches_reserved(h: &dyn HostSpace, start: u64, end: u64) -> bool {
    let (lo, hi) = h.reserved();
    start < hi && lo < end
}

/// Handle a memory-management syscall on a host-kept address space; `None` if `nr` is not one
/// of ours.
pub fn dispatch(os: &mut GuestOs, h: &mut dyn HostSpace, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let r = match nr {
        SYS_MMAP => {
            let (flags, fd) = (a[3] as u32, a[4] as i32);
            let file = if flags & MAP_ANONYMOUS != 0 { Ok(None) } else { map_source(os, fd, a[5]) };
            file.and_then(|file| os.mm.host_mmap(h, a[0], a[1], a[2] as u32, flags, file))
        }
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
