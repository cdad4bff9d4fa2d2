//! A KVM VM over a [`GuestMemory`] mapping, with dirty logging on.
//!
//! Slot 0 covers guest-physical memory from 0 up to the frames the guest has been given so far
//! ([`slot_size_for`]), not the whole of it: KVM allocates per-slot bookkeeping in proportion to the
//! slot's size (with shadow paging, 8 bytes of reverse map and 2 of write tracking per 4 KiB page,
//! 2.5 MiB for 1 GiB, plus the dirty bitmaps), zeroed when the slot is added, and every new
//! process and every fork of a sandbox makes a new VM: a 1 GiB slot cost each clone that much
//! allocating and zeroing for memory it mostly never touches, and even a 128 MiB one (320 KiB of
//! fresh host pages) took 0.47 ms of each spawn of busybox, traced here (a 32 MiB one 0.05 ms).
//! So the first slot leaves only [`SLOT_STEP`] of room, and the VMM extends the covered range
//! before the guest runs with frames beyond it by adding a growth slot right above (from
//! [`FIRST_GROWTH_SLOT`] on), at least as big as what is covered already: adding a slot keeps the
//! shadow page tables, where deleting and re-adding slot 0 (the old way, still the fallback when
//! the growth slots run out) dropped them all. The host reaches all of memory through its own
//! mapping, slot or not.
//!
//! Slot 1 is the large-page region at the top of guest memory ([`huge_region`]), which holds only
//! read-only large-page copies of program text (see `arch::x86_64::paging`). It is the one slot
//! without dirty logging: KVM maps nothing larger than 4 KiB in a dirty-logged slot, and the guest
//! never writes this one (host writes are recorded by `GuestMemory` itself).
//!
//! Slots from [`FIRST_WINDOW_SLOT`] on are the guest's shared mappings, one per window of
//! `GuestMemory::windows` (see `vstate::shared`), without dirty logging (their pages are never
//! private to a process, so neither reset nor snapshot has anything to do with them).
//! [`KvmVm::sync_windows`] makes the slots follow the windows before the guest runs: a slot is
//! deleted before its guest-physical range or slot number is used again.

use std::collections::BTreeMap;

use kvm_bindings::{kvm_userspace_memory_region, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::{Kvm, VmFd};

use super::memory::GuestMemory;
use crate::arch::x86_64::layout::huge_region;
use crate::error::{Error, Result};

/// The slots keep at least this much room above the frames in use, in steps of this much.
pub const SLOT_STEP: u64 = 16 << 20;

const PAGE_BYTES: u64 = 4096;

/// The slot size for a guest whose frames lie below `frames_end`, in memory of `mem_size` bytes.
pub fn slot_size_for(frames_end: u64, mem_size: u64) -> u64 {
    (frames_end.saturating_add(SLOT_STEP).div_ceil(SLOT_STEP) * SLOT_STEP).min(mem_size)
}

/// The first slot number of the shared windows.
pub const FIRST_WINDOW_SLOT: u32 = 2;
/// The first slot number of the growth slots, above every window's; at most [`GROWTH_SLOTS`] of them.
pub const FIRST_GROWTH_SLOT: u32 = FIRST_WINDOW_SLOT + super::shared::MAX_WINDOWS as u32;
pub const GROWTH_SLOTS: u32 = 16;

pub struct KvmVm {
    pub fd: VmFd,
    host_addr: u64,
    /// Bytes of guest-physical memory from 0 that slot 0 and the growth slots cover.
    slot_size: u64,
    /// Slot 0 and the growth slots above it: (slot, guest-physical start, length), ascending.
    base: Vec<(u32, u64, u64)>,
    /// KVM's slots per VM (KVM_CAP_NR_MEMSLOTS).
    nr_slots: u32,
    /// Slot 0 never reaches past this (the large-page region, or the end of memory).
    limit: u64,
    /// The window slots KVM has: by guest-physical start, (slot, length, host address).
    windows: BTreeMap<u64, (u32, u64, u64)>,
    /// `GuestMemory::windows`' generation they were synced at (None: never).
    windows_synced: Option<u64>,
    /// The base slots have no dirty log yet (a forked sandbox's VM until its first
    /// `Machine::sync_dirty`: see `vmm::prefault`); `take_dirty_log` hands back an empty log.
    unlogged: bool,
}

impl KvmVm {
    /// A new VM whose slot 0 is the first `slot_size` bytes of `mem`. Called again in every forked
    /// child: a KVM VM is tied to the address space that created it, so a child cannot use its
    /// parent's.
    pub fn new(kvm: &Kvm, mem: &GuestMemory, slot_size: u64) -> Result<KvmVm> {
        Self::with_log(kvm, mem, slot_size, true)
    }

    /// [`KvmVm::new`], with or without KVM's dirty log on the base slots. Without it, KVM's fault
    /// handler also maps the writable neighbours of a faulting entry (it does not while the slot
    /// is dirty-logged), and the caller keeps the record of written pages itself until it turns
    /// the log on ([`KvmVm::start_dirty_log`]).
    pub fn with_log(kvm: &Kvm, mem: &GuestMemory, slot_size: u64, logged: bool) -> Result<KvmVm> {
        // KVM_CREATE_VM fails with EINTR when a signal arrives meanwhile: a guest process forked
        // by a parent that exits at once (`sh -c 'job &'`) gets its parent-death signal here, and
        // used to die at birth. It is retried (the signal's handler has run by then).
        let mut tries = 0;
        let fd = loop {
            match kvm.create_vm() {
                Err(e) if e.errno() == libc::EINTR && tries < 100 => tries += 1,
                r => break r.map_err(Error::kvm("KVM_CREATE_VM"))?,
            }
        };
        let region = huge_region(mem.size());
        let limit = region.map_or(mem.size(), |(start, _)| start);
        let mut vm = KvmVm {
            fd,
            host_addr: mem.host_addr(),
            slot_size: slot_size.min(limit),
            base: Vec::new(),
            nr_slots: kvm.get_nr_memslots() as u32,
            limit,
            windows: BTreeMap::new(),
            windows_synced: None,
            unlogged: !logged,
        };
        vm.set_base(0, 0, vm.slot_size, "KVM_SET_USER_MEMORY_REGION")?;
        vm.base.push((0, 0, vm.slot_size));
        if let Some((start, end)) = region {
            let r = kvm_userspace_memory_region {
                slot: 1,
                flags: 0,
                guest_phys_addr: start,
                memory_size: end - start,
                userspace_addr: vm.host_addr + start,
            };
            // SAFETY: as in `set_slot`: a range of our live mapping of guest memory, which outlives
            // the VM.
            unsafe { vm.fd.set_user_memory_region(r) }.map_err(Error::kvm("KVM_SET_USER_MEMORY_REGION (large pages)"))?;
        }
        // KVM's slots per VM (KVM_CAP_NR_MEMSLOTS) bound the windows a process may have.
        super::shared::limit_windows(kvm.get_nr_memslots().saturating_sub(FIRST_WINDOW_SLOT as usize));
        // A forked child's windows are its parent's (the host fork kept them shared).
        vm.sync_windows(mem)?;
        Ok(vm)
    }

    /// Make the window slots match `mem`'s shared windows: delete the slots of windows that went
    /// (or moved to another host address), then add the new ones.
    pub fn sync_windows(&mut self, mem: &GuestMemory) -> Result<()> {
        let generation = mem.windows.generation();
        if self.windows_synced == Some(generation) {
            return Ok(());
        }
        // Parked windows keep their slots (see `shared::Parked`).
        let want: BTreeMap<u64, (u64, u64)> = mem.windows.slots().map(|(gpa, len, hva)| (gpa, (len, hva))).collect();
        let gone: Vec<u64> = self
            .windows
            .iter()
            .filter(|(gpa, (_, len, hva))| want.get(gpa) != Some(&(*len, *hva)))
            .map(|(gpa, _)| *gpa)
            .collect();
        for gpa in gone {
            if let Some((slot, _, hva)) = self.windows.remove(&gpa) {
                self.set_window(slot, gpa, 0, hva, "KVM_SET_USER_MEMORY_REGION (delete a shared mapping)")?;
            }
        }
        for (gpa, (len, hva)) in want {
            if self.windows.contains_key(&gpa) {
                continue;
            }
            let mut slot = FIRST_WINDOW_SLOT;
            while self.windows.values().any(|(s, _, _)| *s == slot) {
                slot += 1;
            }
            self.set_window(slot, gpa, len, hva, "KVM_SET_USER_MEMORY_REGION (a shared mapping)")?;
            self.windows.insert(gpa, (slot, len, hva));
        }
        self.windows_synced = Some(generation);
        Ok(())
    }

    fn set_window(&self, slot: u32, gpa: u64, len: u64, hva: u64, op: &'static str) -> Result<()> {
        let r = kvm_userspace_memory_region { slot, flags: 0, guest_phys_addr: gpa, memory_size: len, userspace_addr: hva };
        // SAFETY: [hva, hva + len) is a live shared window of `GuestMemory::windows` (or len is 0,
        // which deletes the slot). A window is unmapped only after it left `windows`, and the VMM
        // syncs (deleting its slot) before the guest runs again; until then KVM's MMU notifier
        // has dropped every translation of the unmapped range.
        unsafe { self.fd.set_user_memory_region(r) }.map_err(Error::kvm(op))
    }

    /// Add (or, with `size` 0, delete) the base slot `slot` over [gpa, gpa + size), dirty-logged
    /// unless the VM is [`unlogged`](KvmVm::unlogged).
    fn set_base(&self, slot: u32, gpa: u64, size: u64, op: &'static str) -> Result<()> {
        let region = kvm_userspace_memory_region {
            slot,
            flags: if self.unlogged { 0 } else { KVM_MEM_LOG_DIRTY_PAGES },
            guest_phys_addr: gpa,
            memory_size: size,
            userspace_addr: self.host_addr + gpa,
        };
        // SAFETY: the region is a range of our live mapping of guest memory below `limit` (or
        // empty, which deletes the slot), which outlives the VM (both are owned by the same
        // `Machine`, the VM is dropped first).
        unsafe { self.fd.set_user_memory_region(region) }.map_err(Error::kvm(op))
    }

    /// Whether the base slots have no dirty log (see [`KvmVm::with_log`]).
    pub fn unlogged(&self) -> bool {
        self.unlogged
    }

    /// Turn KVM's dirty log on for the base slots (KVM write-protects their translations, so
    /// every page written from now on is logged). A no-op if it is on.
    pub fn start_dirty_log(&mut self) -> Result<()> {
        if !self.unlogged {
            return Ok(());
        }
        self.unlogged = false;
        for &(slot, gpa, size) in &self.base {
            self.set_base(slot, gpa, size, "KVM_SET_USER_MEMORY_REGION (dirty log on)")?;
        }
        Ok(())
    }

    /// Bytes of guest-physical memory from 0 that slot 0 and the growth slots cover.
    pub fn slot_size(&self) -> u64 {
        self.slot_size
    }

    /// Cover at least `size` bytes from 0: a growth slot above what is covered, at least as big
    /// as that (so a process that keeps growing adds few), keeping every shadow translation and
    /// the dirty logs of the slots already there. Without a growth slot left, slot 0 is replaced
    /// by one covering it all (`replace_slot`, after folding the log in: see there).
    pub fn grow(&mut self, size: u64) -> Result<Option<Vec<u64>>> {
        let size = size.min(self.limit);
        if size <= self.slot_size {
            return Ok(None);
        }
        let slot = FIRST_GROWTH_SLOT + self.base.len() as u32 - 1;
        if slot >= FIRST_GROWTH_SLOT + GROWTH_SLOTS || slot >= self.nr_slots {
            let log = self.take_dirty_log()?;
            self.replace_slot(size)?;
            return Ok(Some(log));
        }
        let end = size.max(self.slot_size.saturating_mul(2)).min(self.limit);
        let start = self.slot_size;
        self.set_base(slot, start, end - start, "KVM_SET_USER_MEMORY_REGION (grow)")?;
        self.base.push((slot, start, end - start));
        self.slot_size = end;
        Ok(None)
    }

    /// Delete slot 0 and the growth slots and add slot 0 again over `size` bytes (at least what
    /// they covered): every shadow translation goes, and KVM's dirty log with it (take it first).
    pub fn replace_slot(&mut self, size: u64) -> Result<()> {
        for &(slot, gpa, _) in self.base.iter().rev() {
            self.set_base(slot, gpa, 0, "KVM_SET_USER_MEMORY_REGION (delete)")?;
        }
        self.base.clear();
        let size = size.max(self.slot_size).min(self.limit);
        self.set_base(0, 0, size, "KVM_SET_USER_MEMORY_REGION (re-add)")?;
        self.base.push((0, 0, size));
        self.slot_size = size;
        Ok(())
    }

    /// Guest-written pages since the last call (KVM clears its log as it hands it over): one
    /// bitmap from guest-physical 0, over slot 0 and the growth slots (each starts on a multiple
    /// of 64 pages, so their bitmaps follow one another word by word).
    pub fn take_dirty_log(&self) -> Result<Vec<u64>> {
        let mut log = Vec::with_capacity((self.slot_size / PAGE_BYTES).div_ceil(64) as usize);
        if self.unlogged {
            log.resize((self.slot_size / PAGE_BYTES).div_ceil(64) as usize, 0);
            return Ok(log);
        }
        for &(slot, gpa, size) in &self.base {
            debug_assert_eq!(gpa % (64 * PAGE_BYTES), 0);
            debug_assert_eq!(log.len() as u64, gpa / (64 * PAGE_BYTES));
            log.extend(self.fd.get_dirty_log(slot, size as usize).map_err(Error::kvm("KVM_GET_DIRTY_LOG"))?);
        }
        Ok(log)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_slot_covers_the_frames_in_use_with_room_in_16_mib_steps() {
        const MIB: u64 = 1 << 20;
        assert_eq!(slot_size_for(0, 1024 * MIB), 16 * MIB);
        assert_eq!(slot_size_for(5 * MIB, 1024 * MIB), 32 * MIB); // 5 + 16 rounded up
        assert_eq!(slot_size_for(16 * MIB, 1024 * MIB), 32 * MIB);
        assert_eq!(slot_size_for(16 * MIB + 1, 1024 * MIB), 48 * MIB);
        assert_eq!(slot_size_for(1000 * MIB, 1024 * MIB), 1024 * MIB); // never past the memory
        assert_eq!(slot_size_for(0, 8 * MIB), 8 * MIB);
    }
}
