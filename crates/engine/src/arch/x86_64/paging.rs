//! Four-level page tables that the host builds and walks in guest memory.
//!
//! The guest never sees its page tables (they are not mapped in its virtual address space), so it
//! cannot change them; the host is the only writer.
//!
//! Large pages for program text. Under shadow paging every 4 KiB page a fresh VM touches costs a
//! fault in KVM (about 4 us on kvm_pvm), and each forked sandbox is a fresh VM: CPython's first
//! exec in a fork touches some 230 pages of its own text and read-only data. [`AddressSpace::promote`]
//! maps a whole 2 MiB block of such pages with one large page instead: a copy of the 512 pages in
//! a 2 MiB-aligned block of the large-page region at the top of guest memory
//! ([`huge_region`]), which KVM maps without dirty logging and the host backs with a transparent
//! huge page, so one fault maps all of it. The page table the large page replaced is kept, with its
//! frames, and stays the host's view: every walk here reads the per-page flags from it and the
//! contents from the copy, which is what the guest sees. Any edit of a page in the block first
//! puts the page table back ([`AddressSpace::demote`]), carrying over whatever the host wrote into
//! the copy. Large pages are only ever read-only: the guest never writes the region, so no page
//! of it needs dirty tracking. The copy is executable if any page of the block is: read-only data
//! sharing a block with text becomes executable to the guest (its /proc/self/maps is unchanged).

use std::cell::RefCell;

use serde::{Deserialize, Serialize};

use super::layout::*;
use crate::error::{Error, Result};
use crate::vstate::memory::GuestMemory;

pub const PTE_P: u64 = 1;
pub const PTE_W: u64 = 1 << 1;
pub const PTE_U: u64 = 1 << 2;
pub const PTE_A: u64 = 1 << 5;
pub const PTE_D: u64 = 1 << 6;
/// In a page-directory entry: maps a 2 MiB large page instead of pointing at a page table.
pub const PTE_PS: u64 = 1 << 7;
/// A bit the MMU ignores (one of those left to software): set on entries the host marked accessed
/// when it filled their pages from a file (`guestos::mm`), so that a report of the pages a run
/// touched (`vmm::spawn_prefault`) can tell them from the pages the guest used.
pub const PTE_FILLED: u64 = 1 << 9;
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
    /// The large-page region above `end` (see the module comment): the next unused 2 MiB block and
    /// the region's end; both 0 in a memory without one. Its blocks are never handed out again.
    #[serde(default)]
    pub huge_next: u64,
    #[serde(default)]
    pub huge_end: u64,
}

impl FrameAllocator {
    pub fn new(mem_size: u64) -> FrameAllocator {
        match huge_region(mem_size) {
            Some((start, end)) => {
                FrameAllocator { next: FRAME_POOL_START, end: start, free: Vec::new(), huge_next: start, huge_end: end }
            }
            None => FrameAllocator { next: FRAME_POOL_START, end: mem_size, free: Vec::new(), huge_next: 0, huge_end: 0 },
        }
    }

    /// One unused 2 MiB block of the large-page region, if any is left.
    pub fn alloc_huge(&mut self) -> Option<u64> {
        if self.huge_next + HUGE_PAGE > self.huge_end {
            return None;
        }
        let p = self.huge_next;
        self.huge_next += HUGE_PAGE;
        Some(p)
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
        if pa >= self.end {
            return; // a large page's: the region is never reused for ordinary pages
        }
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
    if !mem.is_zero(pa, PAGE_SIZE as usize)? {
        mem.write(pa, &[0u8; PAGE_SIZE as usize])?;
    }
    Ok(())
}

/// One 2 MiB block of the address space mapped by a large page (see the module comment).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct HugeChunk {
    /// The block's guest-virtual address.
    pub va: u64,
    /// Guest-physical address of its page-directory entry.
    pub slot: u64,
    /// The entry the large page replaced (pointing at the kept page table).
    pub saved: u64,
    /// The copy the large page maps.
    pub block: u64,
}

/// The guest's address space: a PML4 root in guest memory.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct AddressSpace {
    pub root: u64,
    /// The blocks mapped by large pages. Changed through `&self` (promote and demote are rare, and
    /// callers hold the address space shared next to the memory they edit); the VMM process is
    /// single-threaded.
    #[serde(default)]
    pub huge: RefCell<Vec<HugeChunk>>,
}

/// The 512 entries of the page table at `table`, read in one go (walks over a whole address space
/// read every entry of every table).
fn entries(mem: &GuestMemory, table: u64) -> Result<Box<[u64; 512]>> {
    let mut bytes = [0u8; PAGE_SIZE as usize];
    mem.read(table, &mut bytes)?;
    let mut out = Box::new([0u64; 512]);
    for (e, b) in out.iter_mut().zip(bytes.chunks_exact(8)) {
        *e = u64::from_le_bytes(b.try_into().expect("8 bytes"));
    }
    Ok(out)
}

fn index(va: u64, level: u32) -> u64 {
    (va >> (12 + 9 * level)) & 0x1ff
}

impl AddressSpace {
    pub fn new(_mem: &mut GuestMemory, frames: &mut FrameAllocator) -> Result<AddressSpace> {
        let root = frames.alloc()?;
        Ok(AddressSpace { root, huge: RefCell::default() })
    }

    /// The saved entry and copy of the large page whose directory entry is at `slot`.
    fn saved(&self, slot: u64) -> Result<(u64, u64)> {
        let huge = self.huge.borrow();
        let h = huge.iter().find(|h| h.slot == slot).ok_or(Error::BadGuestAddress(slot))?;
        Ok((h.saved, h.block))
    }

    /// Guest-physical address of the page-directory entry for `va`, if the tables above it exist.
    fn pd_slot(&self, mem: &GuestMemory, va: u64) -> Result<Option<u64>> {
        let mut table = self.root;
        for level in (2..4).rev() {
            let e = mem.read_u64(table + index(va, level) * 8)?;
            if e & PTE_P == 0 {
                return Ok(None);
            }
            table = e & ADDR_MASK;
        }
        Ok(Some(table + index(va, 1) * 8))
    }

    /// Map the 2 MiB block at `va` (aligned) with a large page, if every page of it is present,
    /// user-readable and read-only and a block of the large-page region is left. Returns whether it
    /// did. The caller makes the guest forget the block's old translations before it runs again
    /// (they still show the same contents until then).
    pub fn promote(&self, mem: &mut GuestMemory, frames: &mut FrameAllocator, va: u64) -> Result<bool> {
        debug_assert_eq!(va % HUGE_PAGE, 0);
        let Some(slot) = self.pd_slot(mem, va)? else { return Ok(false) };
        let e = mem.read_u64(slot)?;
        if e & PTE_P == 0 || e & PTE_PS != 0 {
            return Ok(false);
        }
        let pt = e & ADDR_MASK;
        let mut ptes = [0u64; 512];
        let mut exec = false;
        for (i, p) in ptes.iter_mut().enumerate() {
            *p = mem.read_u64(pt + i as u64 * 8)?;
            if *p & PTE_P == 0 || *p & PTE_U == 0 || *p & PTE_W != 0 {
                return Ok(false);
            }
            exec |= *p & PTE_NX == 0;
        }
        let Some(block) = frames.alloc_huge() else { return Ok(false) };
        let mut page = [0u8; PAGE_SIZE as usize];
        for (i, p) in ptes.iter().enumerate() {
            mem.read(p & ADDR_MASK, &mut page)?;
            if page.iter().any(|&b| b != 0) {
                mem.write(block + i as u64 * PAGE_SIZE, &page)?;
            }
        }
        self.huge.borrow_mut().push(HugeChunk { va, slot, saved: e, block });
        let nx = if exec { 0 } else { PTE_NX };
        // Accessed set, so KVM has nothing to write back into the entry.
        mem.write_u64(slot, block | PTE_P | PTE_U | PTE_A | PTE_PS | nx)?;
        Ok(true)
    }

    /// Put back the page table of the large page whose directory entry is at `slot`, first copying
    /// into the table's frames every page the host changed in the copy (unless `discard`: the
    /// caller is about to unmap the whole block). The guest forgets the large page at once.
    fn demote(&self, mem: &mut GuestMemory, slot: u64, discard: bool) -> Result<()> {
        let h = {
            let mut huge = self.huge.borrow_mut();
            let i = huge.iter().position(|h| h.slot == slot).ok_or(Error::BadGuestAddress(slot))?;
            huge.remove(i)
        };
        if !discard {
            let pt = h.saved & ADDR_MASK;
            let (mut copy, mut old) = ([0u8; PAGE_SIZE as usize], [0u8; PAGE_SIZE as usize]);
            for i in 0..512 {
                let e = mem.read_u64(pt + i * 8)?;
                if e & PTE_P == 0 {
                    continue;
                }
                mem.read(h.block + i * PAGE_SIZE, &mut copy)?;
                mem.read(e & ADDR_MASK, &mut old)?;
                if copy != old {
                    mem.write(e & ADDR_MASK, &copy)?;
                }
            }
        }
        mem.write_u64(slot, h.saved)?;
        crate::vstate::tlb::invalidate_frames(mem, &[h.block, h.block + HUGE_PAGE - PAGE_SIZE])?;
        Ok(())
    }

    /// Demote the large page covering `va`, if there is one.
    fn demote_at(&self, mem: &mut GuestMemory, va: u64) -> Result<()> {
        if self.huge.borrow().is_empty() {
            return Ok(());
        }
        if let Some(slot) = self.pd_slot(mem, va)? {
            if mem.read_u64(slot)? & (PTE_P | PTE_PS) == PTE_P | PTE_PS {
                self.demote(mem, slot, false)?;
            }
        }
        Ok(())
    }

    /// Before unmapping [start, end): demote the large pages inside it without copying anything
    /// back (their pages are going), and the ones it cuts through with.
    pub fn before_unmap(&self, mem: &mut GuestMemory, start: u64, end: u64) -> Result<()> {
        let inside: Vec<(u64, u64)> = self
            .huge
            .borrow()
            .iter()
            .filter(|h| h.va < end && h.va + HUGE_PAGE > start)
            .map(|h| (h.slot, h.va))
            .collect();
        for (slot, va) in inside {
            self.demote(mem, slot, va >= start && va + HUGE_PAGE <= end)?;
        }
        Ok(())
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
            let mut e = mem.read_u64(slot)?;
            if level == 1 && e & (PTE_P | PTE_PS) == PTE_P | PTE_PS {
                self.demote(mem, slot, false)?;
                e = mem.read_u64(slot)?;
            }
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

    /// Guest-physical address of the leaf entry for `va`, if every table above it exists, and
    /// for a page under a large page, the page's frame in the copy (the entry is the kept table's).
    fn leaf_slot(&self, mem: &GuestMemory, va: u64) -> Result<Option<(u64, Option<u64>)>> {
        let mut table = self.root;
        let mut copy = None;
        for level in (1..4).rev() {
            let slot = table + index(va, level) * 8;
            let mut e = mem.read_u64(slot)?;
            if e & PTE_P == 0 {
                return Ok(None);
            }
            if level == 1 && e & PTE_PS != 0 {
                let (saved, block) = self.saved(slot)?;
                e = saved;
                copy = Some(block + index(va, 0) * PAGE_SIZE);
            }
            table = e & ADDR_MASK;
        }
        Ok(Some((table + index(va, 0) * 8, copy)))
    }

    /// Mark the leaf entry for `va` accessed, and dirty if it is writable: what the guest's first
    /// use of the page makes KVM write there (see `vmm::spawn_prefault`). Returns the page's frame;
    /// `None` if `va` is not mapped, or mapped by a large page.
    pub fn mark_used(&self, mem: &mut GuestMemory, va: u64) -> Result<Option<u64>> {
        let Some((slot, None)) = self.leaf_slot(mem, va)? else { return Ok(None) };
        let e = mem.read_u64(slot)?;
        if e & PTE_P == 0 {
            return Ok(None);
        }
        let used = e | PTE_A | if e & PTE_W != 0 { PTE_D } else { 0 };
        if used != e {
            mem.write_u64(slot, used)?;
        }
        Ok(Some(e & ADDR_MASK))
    }

    /// Set the accessed bit of the leaf entry for `va`, and the dirty bit too if `dirty` and the
    /// entry is writable (see `vmm::prefault`). Returns the page's frame; `None` if `va` is not
    /// mapped, or mapped by a large page.
    pub fn mark_touched(&self, mem: &mut GuestMemory, va: u64, dirty: bool) -> Result<Option<u64>> {
        let Some((slot, None)) = self.leaf_slot(mem, va)? else { return Ok(None) };
        let e = mem.read_u64(slot)?;
        if e & PTE_P == 0 {
            return Ok(None);
        }
        let want = e | PTE_A | if dirty && e & PTE_W != 0 { PTE_D } else { 0 };
        if want != e {
            mem.write_u64(slot, want)?;
        }
        Ok(Some(e & ADDR_MASK))
    }

    /// Clear `bits` (of [`PTE_A`] and [`PTE_D`]) in every user 4 KiB leaf entry of the lower half
    /// (large pages are left alone), so that the bits KVM sets from now on say which pages the
    /// guest touched and wrote. Only for a VM whose translations are all gone (a new one): KVM
    /// sets the bits when it walks an entry to make a translation. The guest does not see its
    /// page tables. Returns how many entries changed.
    pub fn clear_used_bits(&self, mem: &mut GuestMemory, bits: u64) -> Result<usize> {
        let mut n = 0;
        self.clear_bits_in(mem, self.root, 3, bits & (PTE_A | PTE_D), &mut n)?;
        Ok(n)
    }

    fn clear_bits_in(&self, mem: &mut GuestMemory, table: u64, level: u32, bits: u64, n: &mut usize) -> Result<()> {
        // The lower half only: entries 0..256 of the root.
        let last = if level == 3 { 255 } else { 511 };
        for i in 0..=last {
            let slot = table + i * 8;
            let e = mem.read_u64(slot)?;
            if e & PTE_P == 0 {
                continue;
            }
            if level == 0 {
                if e & PTE_U != 0 && e & bits != 0 {
                    mem.write_u64(slot, e & !bits)?;
                    *n += 1;
                }
            } else if !(level == 1 && e & PTE_PS != 0) {
                self.clear_bits_in(mem, e & ADDR_MASK, level - 1, bits, n)?;
            }
        }
        Ok(())
    }

    /// The frames of every present leaf entry, both halves, whose dirty bit is set (a large page's
    /// whole block), for a VM without a dirty log (see `KvmVm::with_log`): the pages written
    /// through it since the bits were cleared, and possibly more.
    pub fn dirty_frames(&self, mem: &GuestMemory) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        self.dirty_in(mem, self.root, 3, &mut out)?;
        Ok(out)
    }

    fn dirty_in(&self, mem: &GuestMemory, table: u64, level: u32, out: &mut Vec<u64>) -> Result<()> {
        for e in *entries(mem, table)? {
            if e & PTE_P == 0 {
                continue;
            }
            if level == 0 {
                if e & PTE_D != 0 {
                    out.push(e & ADDR_MASK);
                }
            } else if level == 1 && e & PTE_PS != 0 {
                if e & PTE_D != 0 {
                    let block = e & ADDR_MASK & !(HUGE_PAGE - 1);
                    out.extend((0..512).map(|k| block + k * PAGE_SIZE));
                }
            } else {
                self.dirty_in(mem, e & ADDR_MASK, level - 1, out)?;
            }
        }
        Ok(())
    }

    /// Clear the dirty bit of every present leaf entry, both halves, large pages included, without
    /// counting the tables as written ([`GuestMemory::write_u64_unrecorded`]): after a reset of a
    /// VM without a dirty log, so that the bits KVM sets from here say which pages the next run
    /// wrote ([`AddressSpace::dirty_frames`]). A translation KVM already made writable stays
    /// writable without setting the bit again: the caller keeps those frames on its own record
    /// (`GuestMemory::discard_private_mapped`). Returns how many entries changed.
    pub fn clear_dirty_bits(&self, mem: &mut GuestMemory) -> Result<usize> {
        let mut n = 0;
        self.clear_dirty_in(mem, self.root, 3, &mut n)?;
        Ok(n)
    }

    fn clear_dirty_in(&self, mem: &mut GuestMemory, table: u64, level: u32, n: &mut usize) -> Result<()> {
        for (i, &e) in entries(mem, table)?.iter().enumerate() {
            let slot = table + i as u64 * 8;
            if e & PTE_P == 0 {
                continue;
            }
            if level == 0 || (level == 1 && e & PTE_PS != 0) {
                if e & PTE_D != 0 {
                    mem.write_u64_unrecorded(slot, e & !PTE_D)?;
                    *n += 1;
                }
            } else {
                self.clear_dirty_in(mem, e & ADDR_MASK, level - 1, n)?;
            }
        }
        Ok(())
    }

    /// The frames whose guest translations may be wrong once the page tables are put back as they
    /// are in `original` (a reset to the memory file's contents): for each table page that counts
    /// as written (`written`), every entry that differs from the original in more than its
    /// accessed and dirty bits and the bits the MMU ignores, the frames it maps now (all of a
    /// subtree's leaves, for a table entry) and, for a leaf, the frame it mapped originally. Tables
    /// not written are the original's, and only their subtrees are looked into.
    ///
    /// Entries the run removed or narrowed had their frames invalidated then (`vstate::tlb`'s
    /// rules); these are the ones it added, widened or redirected, whose translations the reset
    /// takes away again.
    pub fn changed_translations(
        &self,
        mem: &GuestMemory,
        written: impl Fn(u64) -> bool,
        original: impl Fn(u64, &mut [u8]) -> Result<()>,
    ) -> Result<Vec<u64>> {
        let mut out = Vec::new();
        let mut page = vec![0u8; PAGE_SIZE as usize];
        self.changed_in(mem, self.root, 3, &written, &original, &mut page, &mut out)?;
        out.sort_unstable();
        out.dedup();
        Ok(out)
    }

    #[allow(clippy::too_many_arguments)]
    fn changed_in(
        &self,
        mem: &GuestMemory,
        table: u64,
        level: u32,
        written: &impl Fn(u64) -> bool,
        original: &impl Fn(u64, &mut [u8]) -> Result<()>,
        page: &mut Vec<u8>,
        out: &mut Vec<u64>,
    ) -> Result<()> {
        // What the MMU reads of an entry: not the accessed and dirty bits, nor the software bits.
        const IGNORED: u64 = PTE_A | PTE_D | (0x7 << 9) | (0x7f << 52);
        let was: Option<Vec<u64>> = if written(table) {
            original(table, page)?;
            Some(page.chunks_exact(8).map(|c| u64::from_le_bytes(c.try_into().expect("8 bytes"))).collect())
        } else {
            None
        };
        for (i, &e) in entries(mem, table)?.iter().enumerate() {
            let leaf = level == 0 || (level == 1 && e & PTE_PS != 0);
            if let Some(was) = &was {
                let w = was[i];
                if (e ^ w) & !IGNORED != 0 {
                    if e & PTE_P != 0 {
                        self.frames_under(mem, e, level, out)?;
                    }
                    let was_leaf = level == 0 || (level == 1 && w & PTE_PS != 0);
                    if w & PTE_P != 0 && was_leaf {
                        Self::leaf_frames(w, level, out);
                    }
                    continue;
                }
            }
            if e & PTE_P != 0 && !leaf {
                self.changed_in(mem, e & ADDR_MASK, level - 1, written, original, page, out)?;
            }
        }
        Ok(())
    }

    /// The frames a present entry at `level` maps: its own for a leaf, every leaf's below a table.
    fn frames_under(&self, mem: &GuestMemory, e: u64, level: u32, out: &mut Vec<u64>) -> Result<()> {
        if level == 0 || (level == 1 && e & PTE_PS != 0) {
            Self::leaf_frames(e, level, out);
            return Ok(());
        }
        for c in *entries(mem, e & ADDR_MASK)? {
            if c & PTE_P != 0 {
                self.frames_under(mem, c, level - 1, out)?;
            }
        }
        Ok(())
    }

    fn leaf_frames(e: u64, level: u32, out: &mut Vec<u64>) {
        if level == 0 {
            out.push(e & ADDR_MASK);
        } else {
            let block = e & ADDR_MASK & !(HUGE_PAGE - 1);
            out.extend((0..512).map(|k| block + k * PAGE_SIZE));
        }
    }

    /// The leaf entry for `va` (0 if absent).
    pub fn pte(&self, mem: &GuestMemory, va: u64) -> Result<u64> {
        match self.leaf_slot(mem, va)? {
            Some((slot, copy)) => Ok(with_frame(mem.read_u64(slot)?, copy)),
            None => Ok(0),
        }
    }

    /// Remove the mapping of the page at `va`. Returns the frame it mapped, if any; the caller frees
    /// it and flushes the guest TLB. Page-table pages stay allocated.
    pub fn unmap_page(&self, mem: &mut GuestMemory, va: u64) -> Result<Option<u64>> {
        self.demote_at(mem, va)?;
        let Some((slot, _)) = self.leaf_slot(mem, va)? else { return Ok(None) };
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
        self.demote_at(mem, va)?;
        let Some((slot, _)) = self.leaf_slot(mem, va)? else { return Ok(None) };
        let e = mem.read_u64(slot)?;
        if e & PTE_P == 0 {
            return Ok(None);
        }
        // The dirty bit stays, as on Linux: it is the record of a write where no dirty log keeps one
        // (`dirty_frames`).
        let new = (e & (ADDR_MASK | PTE_D)) | flags | PTE_P;
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
            self.walk(mem, self.root, 3, 0, start, end, None, &mut out)?;
        }
        Ok(out)
    }

    /// `copy`: in a large page's kept table, the copy whose frames stand for the table's.
    #[allow(clippy::too_many_arguments)]
    fn walk(&self, mem: &GuestMemory, table: u64, level: u32, base: u64, start: u64, end: u64, copy: Option<u64>, out: &mut Vec<(u64, u64)>) -> Result<()> {
        let span = 1u64 << (12 + 9 * level);
        let first = start.saturating_sub(base) / span;
        let last = ((end - 1 - base) / span).min(511);
        for i in first..=last {
            let mut e = mem.read_u64(table + i * 8)?;
            if e & PTE_P == 0 {
                continue;
            }
            let va = base + i * span;
            if level == 0 {
                out.push((va, with_frame(e, copy.map(|b| b + i * PAGE_SIZE))));
            } else {
                let mut below = None;
                if level == 1 && e & PTE_PS != 0 {
                    let (saved, block) = self.saved(table + i * 8)?;
                    (e, below) = (saved, Some(block));
                }
                self.walk(mem, e & ADDR_MASK, level - 1, va, start, end, below, out)?;
            }
        }
        Ok(())
    }

    /// Translate a guest virtual address to (guest-physical address, leaf flags).
    /// Under a large page: the copy's frame, which is what the guest sees, and the kept table's
    /// flags.
    pub fn translate(&self, mem: &GuestMemory, va: u64) -> Result<(u64, u64)> {
        match self.leaf_slot(mem, va)? {
            Some((slot, copy)) => {
                let e = with_frame(mem.read_u64(slot)?, copy);
                if e & PTE_P == 0 {
                    return Err(Error::BadGuestAddress(va));
                }
                Ok(((e & ADDR_MASK) | (va & (PAGE_SIZE - 1)), e))
            }
            None => Err(Error::BadGuestAddress(va)),
        }
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

/// A leaf entry with its frame replaced by `frame` (a large page's copy), if given and present.
fn with_frame(e: u64, frame: Option<u64>) -> u64 {
    match frame {
        Some(f) if e & PTE_P != 0 => (e & !ADDR_MASK) | f,
        _ => e,
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
    fn changed_translations_names_what_a_reset_takes_away_and_nothing_else() {
        // The template: two user pages, the first read-only, written to a memory file.
        let dir = std::env::temp_dir().join(format!("collimate-changed-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("mem");
        let mut fr = FrameAllocator::new(16 << 20);
        let a = {
            let mut mem = GuestMemory::anonymous(16 << 20).unwrap();
            let a = setup_address_space(&mut mem, &mut fr).unwrap();
            a.map_fresh(&mut mem, &mut fr, 0x40_0000, 2 * 4096, PTE_U | PTE_W).unwrap();
            a.set_flags(&mut mem, 0x40_0000, PTE_U).unwrap();
            mem.write_image(&path).unwrap();
            a
        };
        let mut mem = GuestMemory::over_image(std::fs::File::open(&path).unwrap(), 16 << 20).unwrap();
        let changed = |mem: &GuestMemory| {
            a.changed_translations(mem, |gpa| mem.is_dirty(gpa), |gpa, buf| mem.read_original(gpa, buf)).unwrap()
        };
        assert!(changed(&mem).is_empty(), "nothing written yet");
        let (ro, _) = a.translate(&mem, 0x40_0000).unwrap();
        let (rw, _) = a.translate(&mem, 0x40_1000).unwrap();
        // What the guest's use writes (accessed and dirty bits) and a software bit: no change.
        a.mark_used(&mut mem, 0x40_1000).unwrap();
        a.set_flags(&mut mem, 0x40_1000, PTE_U | PTE_W | PTE_FILLED).unwrap();
        assert!(changed(&mem).is_empty());
        // A widened page (its frame), a page mapped under a new table (the table's pages), a
        // narrowed one (its frame: narrowing was invalidated when made, the reset widens it again).
        a.set_flags(&mut mem, 0x40_0000, PTE_U | PTE_W).unwrap();
        a.map_fresh(&mut mem, &mut fr, 0x80_0000, 4096, PTE_U | PTE_W).unwrap();
        let (new, _) = a.translate(&mem, 0x80_0000).unwrap();
        assert_eq!(changed(&mem), { let mut v = vec![ro, new]; v.sort(); v });
        a.set_flags(&mut mem, 0x40_1000, PTE_U).unwrap();
        assert_eq!(changed(&mem), { let mut v = vec![ro, rw, new]; v.sort(); v });
        // Tables not counted as written are taken as the original's (a VM's own writes of the
        // accessed and dirty bits are not recorded): only written tables are compared.
        let mut clean = GuestMemory::over_image(std::fs::File::open(&path).unwrap(), 16 << 20).unwrap();
        let (slot, _) = a.leaf_slot(&clean, 0x40_0000).unwrap().unwrap();
        let e = clean.read_u64(slot).unwrap();
        clean.write_u64_unrecorded(slot, e | PTE_A | PTE_D).unwrap();
        assert!(changed(&clean).is_empty());
        assert_eq!(a.clear_dirty_bits(&mut clean).unwrap(), 1);
        assert_eq!(clean.read_u64(slot).unwrap(), e | PTE_A);
        assert!(clean.dirty().is_empty(), "cleared without counting the table as written");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn allocator_runs_out_cleanly() {
        let mut fr = FrameAllocator { next: 0, end: 8192, free: vec![], huge_next: 0, huge_end: 0 };
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

    /// A 2 MiB block of 32 read-only data pages and 480 text pages, each page holding its index.
    fn text_block(mem: &mut GuestMemory, fr: &mut FrameAllocator, a: &AddressSpace, va: u64) {
        for i in 0..512u64 {
            let pa = fr.alloc_zeroed(mem).unwrap();
            mem.write_u64(pa, i + 1).unwrap();
            let flags = if i < 32 { PTE_U | PTE_NX } else { PTE_U };
            a.map_page(mem, fr, va + i * PAGE_SIZE, pa, flags).unwrap();
        }
    }

    #[test]
    fn read_only_blocks_become_large_pages_and_come_back() {
        const MEM: u64 = 256 << 20;
        let mut mem = GuestMemory::anonymous(MEM).unwrap();
        let mut fr = FrameAllocator::new(MEM);
        let (region, region_end) = huge_region(MEM).unwrap();
        assert_eq!((fr.end, fr.huge_next, fr.huge_end), (region, region, region_end));
        let a = setup_address_space(&mut mem, &mut fr).unwrap();
        let va = 0x40_0000;
        text_block(&mut mem, &mut fr, &a, va);
        let before = a.present_pages(&mem, va, va + HUGE_PAGE).unwrap();
        let used = fr.available();

        assert!(a.promote(&mut mem, &mut fr, va).unwrap());
        assert!(!a.promote(&mut mem, &mut fr, va).unwrap(), "already a large page");
        assert_eq!(fr.available(), used, "the old frames and table are kept");
        let pde = mem.read_u64(a.pd_slot(&mem, va).unwrap().unwrap()).unwrap();
        assert_eq!(pde & (PTE_PS | PTE_P | PTE_U | PTE_W | PTE_NX), PTE_PS | PTE_P | PTE_U, "executable, read-only");
        assert_eq!(pde & ADDR_MASK, region);
        // The host's view: the old per-page flags, the copy's frames and contents.
        let after = a.present_pages(&mem, va, va + HUGE_PAGE).unwrap();
        assert_eq!(after.len(), 512);
        for (i, ((v0, e0), (v1, e1))) in before.iter().zip(&after).enumerate() {
            assert_eq!(v0, v1);
            assert_eq!(e0 & !ADDR_MASK, e1 & !ADDR_MASK);
            assert_eq!(e1 & ADDR_MASK, region + i as u64 * PAGE_SIZE);
            assert_eq!(a.translate(&mem, *v1).unwrap().0, region + i as u64 * PAGE_SIZE);
            assert_eq!(a.pte(&mem, *v1).unwrap(), *e1);
        }
        let mut b = [0u8; 8];
        a.read_virt(&mem, va + 100 * PAGE_SIZE, &mut b, true).unwrap();
        assert_eq!(u64::from_le_bytes(b), 101);

        // A host write lands in the copy; narrowing one page puts the table back with that write.
        a.write_virt(&mut mem, va + 7 * PAGE_SIZE, b"patched!", false).unwrap();
        assert_eq!(a.set_flags(&mut mem, va + 40 * PAGE_SIZE, PTE_U | PTE_NX).unwrap(), Some(PTE_P | PTE_U));
        assert!(a.huge.borrow().is_empty());
        let pde = mem.read_u64(a.pd_slot(&mem, va).unwrap().unwrap()).unwrap();
        assert_eq!(pde & PTE_PS, 0);
        assert_eq!(a.translate(&mem, va).unwrap().0, before[0].1 & ADDR_MASK);
        a.read_virt(&mem, va + 7 * PAGE_SIZE, &mut b, true).unwrap();
        assert_eq!(&b, b"patched!");
        a.read_virt(&mem, va + 8 * PAGE_SIZE, &mut b, true).unwrap();
        assert_eq!(u64::from_le_bytes(b), 9);

        // Unmapping the whole block drops the large page without copying; its frames are never
        // handed out again.
        assert!(a.promote(&mut mem, &mut fr, va).unwrap());
        let block = a.huge.borrow()[0].block;
        assert_eq!(block, region + HUGE_PAGE, "a block is used once");
        a.before_unmap(&mut mem, 0, 1 << 47).unwrap();
        assert!(a.huge.borrow().is_empty());
        let old = a.unmap_page(&mut mem, va).unwrap().unwrap();
        assert!(old < fr.end);
        let avail = fr.available();
        fr.release(block);
        assert_eq!(fr.available(), avail, "a large-page frame is not reused");
        fr.release(old);
        assert_eq!(fr.available(), avail + 1);
    }

    #[test]
    fn blocks_that_cannot_be_large_pages() {
        const MEM: u64 = 128 << 20;
        let mut mem = GuestMemory::anonymous(MEM).unwrap();
        let mut fr = FrameAllocator::new(MEM);
        let a = setup_address_space(&mut mem, &mut fr).unwrap();
        // One writable page, one missing page, one supervisor page: no.
        text_block(&mut mem, &mut fr, &a, 0x40_0000);
        a.set_flags(&mut mem, 0x40_0000 + 9 * PAGE_SIZE, PTE_U | PTE_W).unwrap();
        assert!(!a.promote(&mut mem, &mut fr, 0x40_0000).unwrap());
        text_block(&mut mem, &mut fr, &a, 0x60_0000);
        a.unmap_page(&mut mem, 0x60_0000 + 511 * PAGE_SIZE).unwrap();
        assert!(!a.promote(&mut mem, &mut fr, 0x60_0000).unwrap());
        text_block(&mut mem, &mut fr, &a, 0x80_0000);
        a.set_flags(&mut mem, 0x80_0000, PTE_NX).unwrap();
        assert!(!a.promote(&mut mem, &mut fr, 0x80_0000).unwrap());
        assert!(!a.promote(&mut mem, &mut fr, 0x1000_0000).unwrap(), "nothing mapped");
        // The region has four blocks; a fifth request gets none.
        for va in [0xa0_0000u64, 0xc0_0000, 0xe0_0000, 0x100_0000, 0x120_0000] {
            text_block(&mut mem, &mut fr, &a, va);
        }
        let made: Vec<bool> =
            [0xa0_0000u64, 0xc0_0000, 0xe0_0000, 0x100_0000, 0x120_0000].iter().map(|&va| a.promote(&mut mem, &mut fr, va).unwrap()).collect();
        assert_eq!(made, [true, true, true, true, false]);
        // No region in a small memory.
        let mut small = GuestMemory::anonymous(64 << 20).unwrap();
        let mut fr = FrameAllocator::new(64 << 20);
        let a = setup_address_space(&mut small, &mut fr).unwrap();
        text_block(&mut small, &mut fr, &a, 0x40_0000);
        assert!(!a.promote(&mut small, &mut fr, 0x40_0000).unwrap());
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

    #[test]
    fn used_bits_are_cleared_and_the_dirty_ones_name_the_written_frames() {
        const MEM: u64 = 16 << 20;
        let mut mem = GuestMemory::anonymous(MEM).unwrap();
        let mut fr = FrameAllocator::new(MEM);
        let a = setup_address_space(&mut mem, &mut fr).unwrap();
        let va = 0x40_0000;
        let frames: Vec<u64> = (0..4).map(|_| fr.alloc_zeroed(&mut mem).unwrap()).collect();
        for (i, &f) in frames.iter().enumerate() {
            a.map_page(&mut mem, &mut fr, va + i as u64 * PAGE_SIZE, f, PTE_U | PTE_W | PTE_A | PTE_D).unwrap();
        }
        let before = a.dirty_frames(&mem).unwrap();
        assert!(frames.iter().all(|f| before.contains(f)));
        // The dirty bits go (the accessed ones stay unless asked for): no frame of ours is dirty.
        assert_eq!(a.clear_used_bits(&mut mem, PTE_D).unwrap(), 4);
        assert_eq!(a.pte(&mem, va).unwrap() & (PTE_A | PTE_D), PTE_A);
        assert!(!a.dirty_frames(&mem).unwrap().iter().any(|f| frames.contains(f)));
        // A write (as KVM would record it), then an mprotect that keeps the page writable: the
        // dirty bit stays, so the frame is still named.
        a.mark_touched(&mut mem, va + PAGE_SIZE, true).unwrap();
        a.set_flags(&mut mem, va + PAGE_SIZE, PTE_U | PTE_W).unwrap();
        a.mark_touched(&mut mem, va + 2 * PAGE_SIZE, false).unwrap();
        let after = a.dirty_frames(&mem).unwrap();
        assert!(after.contains(&frames[1]) && !after.contains(&frames[2]) && !after.contains(&frames[0]));
        assert_eq!(a.clear_used_bits(&mut mem, PTE_A | PTE_D).unwrap(), 4);
        assert_eq!(a.pte(&mem, va + PAGE_SIZE).unwrap() & (PTE_A | PTE_D), 0);
        // A read-only entry never gets the dirty bit from a touch.
        a.set_flags(&mut mem, va + 3 * PAGE_SIZE, PTE_U).unwrap();
        a.mark_touched(&mut mem, va + 3 * PAGE_SIZE, true).unwrap();
        assert_eq!(a.pte(&mem, va + 3 * PAGE_SIZE).unwrap() & (PTE_A | PTE_D), PTE_A);
    }
}
