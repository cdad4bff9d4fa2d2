//! Four-level page tables that the host builds and walks in guest memory.
//!
//! The guest never sees its page tables (they are not mapped in its virtual address space), so it
//! cannot change them; the host is the only writer.

use serde::{Deserialize, Serialize};

use super::layout::*;
use crate::error::{Error, Result};
use crate::vstate::memory::GuestMemory;

pub const PTE_P: u64 = 1;
pub const PTE_W: u64 = 1 << 1;
pub const PTE_U: u64 = 1 << 2;
pub const PTE_NX: u64 = 1 << 63;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;

/// Hands out guest-physical pages. Part of the snapshot (runtime) state.
///
/// Pages come from two places: never-used memory above `next` (zero in the backing file, so handing
/// one out costs nothing) and `free`, pages the guest gave back (munmap, brk shrink), which hold old
/// contents until [`FrameAllocator::alloc_zeroed`] clears them.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct FrameAllocator {
    pub next: u64,
    pub end: u64,
    /// Freed pages, reused last-in first-out.
    #[serde(default)]
    pub free: Vec<u64>,
}

impl FrameAllocator {
    pub fn new(mem_size: u64) -> FrameAllocator {
        FrameAllocator { next: FRAME_POOL_START, end: mem_size, free: Vec::new() }
    }

    /// One zeroed page from never-used memory (never a freed one: the caller cannot clear it).
    pub fn alloc(&mut self) -> Result<u64> {
        if self.next + PAGE_SIZE > self.end {
            return Err(Error::OutOfGuestMemory(format!("{} MiB in use", self.end >> 20)));
        }
        let p = self.next;
        self.next += PAGE_SIZE;
        Ok(p)
    }

    /// One zeroed page, reusing a freed page (cleared here) before touching never-used memory.
    pub fn alloc_zeroed(&mut self, mem: &mut GuestMemory) -> Result<u64> {
        match self.free.pop() {
            Some(p) => {
                if let Err(e) = zero_page(mem, p) {
                    self.free.push(p);
                    return Err(e);
                }
                Ok(p)
            }
            None => self.alloc(),
        }
    }

    /// One page holding `data` (at most a page; the rest reads as zero), reusing a freed page before
    /// touching never-used memory. All-zero contents write nothing to a never-used page, so a page
    /// read in from a hole of a sparse file stays shared with the backing file.
    pub fn alloc_with(&mut self, mem: &mut GuestMemory, data: &[u8]) -> Result<u64> {
        if data.iter().all(|&b| b == 0) {
            return self.alloc_zeroed(mem);
        }
        let p = match self.free.pop() {
            Some(p) => p,
            None => self.alloc()?,
        };
        let mut page = [0u8; PAGE_SIZE as usize];
        let n = data.len().min(page.len());
        page[..n].copy_from_slice(&data[..n]);
        if let Err(e) = mem.write(p, &page) {
            self.release(p);
            return Err(e);
        }
        Ok(p)
    }

    /// Give a page back for reuse. The caller has removed every mapping of it.
    pub fn release(&mut self, pa: u64) {
        debug_assert_eq!(pa % PAGE_SIZE, 0);
        self.free.push(pa & !(PAGE_SIZE - 1));
    }

    /// Pages still available (never used plus freed).
    pub fn available(&self) -> u64 {
        self.end.saturating_sub(self.next) / PAGE_SIZE + self.free.len() as u64
    }
}

/// Clear one guest page. A page that already reads as zero is left alone, so that a freed page the
/// guest never wrote stays shared with the backing file instead of becoming a private copy.
pub fn zero_page(mem: &mut GuestMemory, pa: u64) -> Result<()> {
    let mut buf = [0u8; PAGE_SIZE as usize];
    mem.read(pa, &mut buf)?;
    if buf.iter().any(|&b| b != 0) {
        buf.fill(0);
        mem.write(pa, &buf)?;
    }
    Ok(())
}

/// The guest's address space: a PML4 root in guest memory.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct AddressSpace {
    pub root: u64,
}

fn index(va: u64, level: u32) -> u64 {
    (va >> (12 + 9 * level)) & 0x1ff
}

impl AddressSpace {
    pub fn new(_mem: &mut GuestMemory, frames: &mut FrameAllocator) -> Result<AddressSpace> {
        let root = frames.alloc()?;
        Ok(AddressSpace { root })
    }

    /// Map one 4 KiB page `va -> pa` with leaf flags `flags` (PTE_P is implied).
    pub fn map_page(
        &self,
        mem: &mut GuestMemory,
        frames: &mut FrameAllocator,
        va: u64,
        pa: u64,
        flags: u64,
    ) -> Result<()> {
        let mut table = self.root;
        for level in (1..4).rev() {
            let slot = table + index(va, level) * 8;
            let e = mem.read_u64(slot)?;
            table = if e & PTE_P != 0 {
                e & ADDR_MASK
            } else {
                let t = frames.alloc_zeroed(mem)?;
                // Intermediate entries are permissive; the leaf decides user/write/exec.
                mem.write_u64(slot, t | PTE_P | PTE_W | PTE_U)?;
                t
            };
        }
        mem.write_u64(table + index(va, 0) * 8, (pa & ADDR_MASK) | flags | PTE_P)
    }

    /// Allocate and map fresh zeroed pages over [va, va+len).
    pub fn map_fresh(
        &self,
        mem: &mut GuestMemory,
        frames: &mut FrameAllocator,
        va: u64,
        len: u64,
        flags: u64,
    ) -> Result<()> {
        let start = va & !(PAGE_SIZE - 1);
        let end = (va + len).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let mut p = start;
        while p < end {
            let frame = frames.alloc_zeroed(mem)?;
            self.map_page(mem, frames, p, frame, flags)?;
            p += PAGE_SIZE;
        }
        Ok(())
    }

    /// Guest-physical address of the leaf entry for `va`, if every table above it exists.
    fn leaf_slot(&self, mem: &GuestMemory, va: u64) -> Result<Option<u64>> {
        let mut table = self.root;
        for level in (1..4).rev() {
            let e = mem.read_u64(table + index(va, level) * 8)?;
            if e & PTE_P == 0 {
                return Ok(None);
            }
            table = e & ADDR_MASK;
        }
        Ok(Some(table + index(va, 0) * 8))
    }

    /// The leaf entry for `va` (0 if absent).
    pub fn pte(&self, mem: &GuestMemory, va: u64) -> Result<u64> {
        match self.leaf_slot(mem, va)? {
            Some(slot) => mem.read_u64(slot),
            None => Ok(0),
        }
    }

    /// Remove the mapping of the page at `va`. Returns the frame it mapped, if any; the caller frees
    /// it and flushes the guest TLB. Page-table pages stay allocated.
    pub fn unmap_page(&self, mem: &mut GuestMemory, va: u64) -> Result<Option<u64>> {
        let Some(slot) = self.leaf_slot(mem, va)? else { return Ok(None) };
        let e = mem.read_u64(slot)?;
        if e & PTE_P == 0 {
            return Ok(None);
        }
        mem.write_u64(slot, 0)?;
        Ok(Some(e & ADDR_MASK))
    }

    /// Replace the leaf flags of the page at `va` with `flags` (PTE_P implied), keeping its frame.
    /// Returns the old flags, or `None` if the page is not mapped.
    pub fn set_flags(&self, mem: &mut GuestMemory, va: u64, flags: u64) -> Result<Option<u64>> {
        let Some(slot) = self.leaf_slot(mem, va)? else { return Ok(None) };
        let e = mem.read_u64(slot)?;
        if e & PTE_P == 0 {
            return Ok(None);
        }
        let new = (e & ADDR_MASK) | flags | PTE_P;
        if new != e {
            mem.write_u64(slot, new)?;
        }
        Ok(Some(e & !ADDR_MASK))
    }

    /// Every mapped 4 KiB page in [start, end) of the lower half, as (virtual address, leaf entry),
    /// in address order. Skips absent tables, so a sparse range costs little to scan.
    pub fn present_pages(&self, mem: &GuestMemory, start: u64, end: u64) -> Result<Vec<(u64, u64)>> {
        let end = end.min(1 << 47);
        let mut out = Vec::new();
        if start < end {
            self.walk(mem, self.root, 3, 0, start, end, &mut out)?;
        }
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn walk(&self, mem: &GuestMemory, table: u64, level: u32, base: u64, start: u64, end: u64, out: &mut Vec<(u64, u64)>) -> Result<()> {
        let span = 1u64 << (12 + 9 * level);
        let first = start.saturating_sub(base) / span;
        let last = ((end - 1 - base) / span).min(511);
        for i in first..=last {
            let e = mem.read_u64(table + i * 8)?;
            if e & PTE_P == 0 {
                continue;
            }
            let va = base + i * span;
            if level == 0 {
                out.push((va, e));
            } else {
                self.walk(mem, e & ADDR_MASK, level - 1, va, start, end, out)?;
            }
        }
        Ok(())
    }

    /// Translate a guest virtual address to (guest-physical address, leaf flags).
    pub fn translate(&self, mem: &GuestMemory, va: u64) -> Result<(u64, u64)> {
        let mut table = self.root;
        for level in (0..4).rev() {
            let e = mem.read_u64(table + index(va, level) * 8)?;
            if e & PTE_P == 0 {
                return Err(Error::BadGuestAddress(va));
            }
            if level == 0 {
                return Ok(((e & ADDR_MASK) | (va & (PAGE_SIZE - 1)), e));
            }
            table = e & ADDR_MASK;
        }
        unreachable!()
    }

    /// Read guest-virtual memory; `user` requires every page to be user-accessible.
    pub fn read_virt(&self, mem: &GuestMemory, va: u64, buf: &mut [u8], user: bool) -> Result<()> {
        let mut done = 0usize;
        while done < buf.len() {
            let cur = va.checked_add(done as u64).ok_or(Error::BadGuestAddress(va))?;
            let (pa, flags) = self.translate(mem, cur)?;
            if user && flags & PTE_U == 0 {
                return Err(Error::BadGuestAddress(cur));
            }
            let n = ((PAGE_SIZE - (cur & (PAGE_SIZE - 1))) as usize).min(buf.len() - done);
            mem.read(pa, &mut buf[done..done + n])?;
            done += n;
        }
        Ok(())
    }

    /// Write guest-virtual memory (host side: ignores the write bit, honours `user`).
    pub fn write_virt(&self, mem: &mut GuestMemory, va: u64, data: &[u8], user: bool) -> Result<()> {
        let mut done = 0usize;
        while done < data.len() {
            let cur = va.checked_add(done as u64).ok_or(Error::BadGuestAddress(va))?;
            let (pa, flags) = self.translate(mem, cur)?;
            if user && flags & PTE_U == 0 {
                return Err(Error::BadGuestAddress(cur));
            }
            let n = ((PAGE_SIZE - (cur & (PAGE_SIZE - 1))) as usize).min(data.len() - done);
            mem.write(pa, &data[done..done + n])?;
            done += n;
        }
        Ok(())
    }
}

/// Lay out the supervisor area and its higher-half mapping. Returns the address space.
///
/// The area is mapped with the user bit set: under kvm_pvm the `syscall` entry and exception delivery
/// fetch the ring-0 stub with user-mode permissions (a supervisor-only stub page faults with a
/// user-mode instruction-fetch #PF). Ring 3 can therefore read these pages, but only the ring-0 stack
/// is writable and only the stub page is executable; nothing here is secret, and a guest that
/// scribbles on its own stack page can only break itself.
pub fn setup_address_space(mem: &mut GuestMemory, frames: &mut FrameAllocator) -> Result<AddressSpace> {
    mem.write(0, &super::tables::supervisor_area())?;
    let aspace = AddressSpace::new(mem, frames)?;
    let mut gpa = 0;
    while gpa < SUPERVISOR_AREA {
        let flags = if gpa == STUBS_GPA {
            PTE_U
        } else if (RING0_STACK_TOP_GPA - RING0_STACK_PAGES * PAGE_SIZE..RING0_STACK_TOP_GPA).contains(&gpa) {
            PTE_U | PTE_W | PTE_NX
        } else {
            PTE_U | PTE_NX
        };
        aspace.map_page(mem, frames, kva(gpa), gpa, flags)?;
        gpa += PAGE_SIZE;
    }
    Ok(aspace)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn map_and_translate() {
        let mut mem = GuestMemory::anonymous(16 << 20).unwrap();
        let mut fr = FrameAllocator::new(16 << 20);
        let a = setup_address_space(&mut mem, &mut fr).unwrap();
        a.map_fresh(&mut mem, &mut fr, 0x40_0000, 3 * 4096, PTE_U | PTE_W).unwrap();
        a.write_virt(&mut mem, 0x40_0ffe, b"abcd", true).unwrap();
        let mut b = [0u8; 4];
        a.read_virt(&mem, 0x40_0ffe, &mut b, true).unwrap();
        assert_eq!(&b, b"abcd");
        assert!(a.read_virt(&mem, 0x50_0000, &mut b, true).is_err());
        // The supervisor area is mapped read-only except for the ring-0 stack.
        let (_, gdt_flags) = a.translate(&mem, kva(GDT_GPA)).unwrap();
        assert_eq!(gdt_flags & PTE_W, 0);
        let (_, stack_flags) = a.translate(&mem, kva(RING0_STACK_TOP_GPA - 8)).unwrap();
        assert_ne!(stack_flags & PTE_W, 0);
    }

    #[test]
    fn allocator_runs_out_cleanly() {
        let mut fr = FrameAllocator { next: 0, end: 8192, free: vec![] };
        fr.alloc().unwrap();
        fr.alloc().unwrap();
        assert!(matches!(fr.alloc(), Err(Error::OutOfGuestMemory(_))));
    }

    #[test]
    fn unmap_reuse_and_flags() {
        let mut mem = GuestMemory::anonymous(16 << 20).unwrap();
        let mut fr = FrameAllocator::new(16 << 20);
        let a = setup_address_space(&mut mem, &mut fr).unwrap();
        a.map_fresh(&mut mem, &mut fr, 0x40_0000, 4096, PTE_U | PTE_W).unwrap();
        a.write_virt(&mut mem, 0x40_0010, b"dirty", true).unwrap();
        assert_eq!(a.set_flags(&mut mem, 0x40_0000, PTE_U | PTE_NX).unwrap(), Some(PTE_P | PTE_U | PTE_W));
        let (pa, flags) = a.translate(&mem, 0x40_0000).unwrap();
        assert_eq!(flags & (PTE_W | PTE_NX | PTE_U), PTE_U | PTE_NX);
        assert_eq!(a.unmap_page(&mut mem, 0x40_0000).unwrap(), Some(pa));
        assert!(a.translate(&mem, 0x40_0000).is_err());
        assert_eq!(a.unmap_page(&mut mem, 0x40_0000).unwrap(), None);
        assert_eq!(a.set_flags(&mut mem, 0x40_0000, PTE_U).unwrap(), None);
        assert_eq!(a.pte(&mem, 0x1234_5678_9000).unwrap(), 0);
        let avail = fr.available();
        fr.release(pa);
        assert_eq!(fr.available(), avail + 1);
        // The freed page comes back first, cleared.
        let again = fr.alloc_zeroed(&mut mem).unwrap();
        assert_eq!(again, pa);
        let mut b = [1u8; 4096];
        mem.read(again, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0));
    }

    #[test]
    fn alloc_with_fills_a_page() {
        let mut mem = GuestMemory::anonymous(16 << 20).unwrap();
        let mut fr = FrameAllocator::new(16 << 20);
        let mut b = [1u8; 4096];
        let p = fr.alloc_with(&mut mem, b"data").unwrap();
        mem.read(p, &mut b).unwrap();
        assert_eq!(&b[..4], b"data");
        assert!(b[4..].iter().all(|&x| x == 0));
        // A freed page comes back holding the new contents only, or cleared.
        mem.write(p + 100, b"old").unwrap();
        fr.release(p);
        assert_eq!(fr.alloc_with(&mut mem, b"new").unwrap(), p);
        mem.read(p, &mut b).unwrap();
        assert_eq!(&b[..3], b"new");
        assert!(b[3..].iter().all(|&x| x == 0));
        fr.release(p);
        assert_eq!(fr.alloc_with(&mut mem, &[0; 4096]).unwrap(), p);
        mem.read(p, &mut b).unwrap();
        assert!(b.iter().all(|&x| x == 0));
        // All zero into never-used memory: nothing is written, the page stays the backing file's.
        let dirty = mem.dirty().count();
        let q = fr.alloc_with(&mut mem, &[0; 4096]).unwrap();
        assert_ne!(q, p);
        assert_eq!(mem.dirty().count(), dirty);
    }

    #[test]
    fn present_pages_skips_holes() {
        let mut mem = GuestMemory::anonymous(16 << 20).unwrap();
        let mut fr = FrameAllocator::new(16 << 20);
        let a = setup_address_space(&mut mem, &mut fr).unwrap();
        a.map_fresh(&mut mem, &mut fr, 0x40_0000, 2 * 4096, PTE_U).unwrap();
        a.map_fresh(&mut mem, &mut fr, 0x7fff_0000_0000, 4096, PTE_U).unwrap();
        let v: Vec<u64> = a.present_pages(&mem, 0, 1 << 47).unwrap().into_iter().map(|(va, _)| va).collect();
        assert_eq!(v, vec![0x40_0000, 0x40_1000, 0x7fff_0000_0000]);
        let v = a.present_pages(&mem, 0x40_1000, 0x40_2000).unwrap();
        assert_eq!(v.len(), 1);
        assert_eq!(v[0].0, 0x40_1000);
    }
}
