//! Guest TLB coherence after the host edits guest page tables (needs /dev/kvm).
//!
//! The guest reads or writes address A so that KVM has a translation for it, the host edits A's page
//! table entry through its mapping of guest memory, and the guest touches A again. Built on the
//! engine's public modules (`tests/tlb_rig`), not on a VMM process, because the host has to edit page
//! tables between two `KVM_RUN`s. See `vstate::tlb` for the measurements these tests pin down and
//! `examples/pt_coherence.rs` for the full table and the costs.

mod tlb_rig;

use collimate_engine::arch::x86_64::paging::{PTE_NX, PTE_P, PTE_U, PTE_W};
use collimate_engine::vstate::tlb::{flush_guest_tlb, invalidate_frames, invalidate_frames_exact, INVALIDATION_BLOCK};
use tlb_rig::{Flush, Outcome, Rig, DATA_VA};

const MEM: u64 = 64 << 20;
const A: u64 = DATA_VA + 0x5000;
const X: u64 = 0x1111_1111_1111_1111;
const Y: u64 = 0x2222_2222_2222_2222;

fn is_page_fault_at(o: Outcome, va: u64, error_code: u64) -> bool {
    matches!(o, Outcome::Fault { vector: 14, cr2, error_code: e } if cr2 == va && e == error_code)
}

// The stale-translation cases check their outcome with these, which say `stale translation` when
// the guest still used the old one: the lane's negative control (`scripts/kvm-lane/job.sh`) runs
// them with the engine's invalidation off (`COLLIMATE_TEST_NO_INVALIDATION=1`) and requires each
// to fail with exactly that, not with some other assertion.

/// The guest read `o` at a page the host remapped from a frame holding `old` to one holding `new`.
fn assert_sees_remap(o: Outcome, old: u64, new: u64) {
    assert!(o != Outcome::Done(old), "stale translation: the guest still reads the old frame ({old:#x}) after a remap");
    assert_eq!(o, Outcome::Done(new));
}

/// The guest read (`error_code` 0x4) or wrote (0x7) `va`, which the host unmapped or
/// write-protected, and did `o`; `old` is what a read through the old translation returns.
fn assert_faults(o: Outcome, va: u64, error_code: u64, old: Option<u64>) {
    assert!(
        !matches!(o, Outcome::Done(v) if old.is_none_or(|old| v == old)),
        "stale translation: the access at {va:#x} went through the old translation ({o:x?}) instead of faulting"
    );
    assert!(is_page_fault_at(o, va, error_code), "{o:x?}");
}

/// (b) A remapped from X to Y. Returns what the guest reads afterwards.
fn remap(how: Flush) -> Outcome {
    let mut r = Rig::new(MEM);
    let (fx, fy) = (r.frame(X), r.frame(Y));
    r.map(A, fx, PTE_W | PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    r.set_pte(A, fy | PTE_P | PTE_U | PTE_W | PTE_NX);
    r.flush(how, &[fx], &[]);
    r.read(A)
}

/// (c) A unmapped. Returns what a guest read of A does afterwards.
fn unmap(how: Flush) -> Outcome {
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_W | PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    r.set_pte(A, 0);
    r.flush(how, &[fx], &[]);
    r.read(A)
}

/// (d) A made read-only after the guest wrote it. Returns what a second guest write does, and the
/// value the frame holds afterwards.
fn write_protect(how: Flush) -> (Outcome, u64) {
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_W | PTE_NX);
    assert!(matches!(r.write(A, 5), Outcome::Done(_)));
    let pte = r.pte(A);
    r.set_pte(A, pte & !PTE_W);
    r.flush(how, &[fx], &[]);
    let o = r.write(A, 6);
    (o, r.mem.read_u64(fx).unwrap())
}

#[test]
fn remap_is_seen_after_invalidate_frames() {
    assert_sees_remap(remap(Flush::MprotectOldFrames), X, Y);
}

#[test]
fn unmap_faults_after_invalidate_frames() {
    assert_faults(unmap(Flush::MprotectOldFrames), A, 0x4, Some(X)); // user read, not present
}

#[test]
fn write_protect_faults_after_invalidate_frames() {
    let (o, v) = write_protect(Flush::MprotectOldFrames);
    assert_faults(o, A, 0x7, None); // user write, present
    assert_eq!(v, 5);
}

/// After `how`, the guest sees all three edits: the remap, the unmap and the write protection.
fn assert_remap_unmap_write_protect_seen(how: Flush) {
    assert_sees_remap(remap(how), X, Y);
    assert_faults(unmap(how), A, 0x4, Some(X));
    let (o, v) = write_protect(how);
    assert_faults(o, A, 0x7, None);
    assert_eq!(v, 5);
}

/// The exact path (`invalidate_frames_exact` of a few frames) and, with many frames in a block, its
/// mprotect pair for the block: the guest sees the edits the same way.
#[test]
fn remap_unmap_write_protect_are_seen_after_an_exact_invalidation() {
    assert_remap_unmap_write_protect_seen(Flush::ExactOldFrames);
}

#[test]
fn remap_unmap_write_protect_are_seen_after_one_mprotect_pair_for_the_block() {
    assert_remap_unmap_write_protect_seen(Flush::MprotectOldFramesBlock);
}

#[test]
fn remap_unmap_write_protect_are_seen_after_flush_guest_tlb() {
    assert_remap_unmap_write_protect_seen(Flush::MemslotReadd);
}

/// (a) Adding a translation needs no flush: neither a page the guest never touched, nor one it
/// faulted on while it was not present (x86 does not cache non-present entries, and KVM walks the
/// guest tables again on every fault).
#[test]
fn new_mappings_are_seen_without_a_flush() {
    let mut r = Rig::new(MEM);
    let (fnb, fx) = (r.frame(7), r.frame(X));
    r.map(A - 0x1000, fnb, PTE_W | PTE_NX);
    assert_eq!(r.read(A - 0x1000), Outcome::Done(7));
    r.map(A, fx, PTE_W | PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X), "never-touched page mapped next to a used one");

    let b = A + 0x3000;
    let o = r.read(b);
    assert!(is_page_fault_at(o, b, 0x4), "{o:x?}");
    let fy = r.frame(Y);
    r.map(b, fy, PTE_W | PTE_NX);
    assert_eq!(r.read(b), Outcome::Done(Y), "page mapped after the guest faulted on it");

    let far = 0x0000_4000_0000_3000; // no PML4 entry yet: every level is new
    let o = r.read(far);
    assert!(is_page_fault_at(o, far, 0x4), "{o:x?}");
    r.map(far, fx, PTE_NX);
    assert_eq!(r.read(far), Outcome::Done(X), "page mapped under new page-table pages");
}

/// (a) Widening (read-only to writable) needs no flush either. On kvm_pvm the first write after the
/// change succeeds; real TLBs may fault spuriously once, so one retry is allowed.
#[test]
fn write_permission_added_is_seen_without_a_flush() {
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    let o = r.write(A, 9);
    assert!(is_page_fault_at(o, A, 0x7), "{o:x?}");
    let pte = r.pte(A);
    r.set_pte(A, pte | PTE_W);
    let mut o = r.write(A, 9);
    if std::path::Path::new("/sys/module/kvm_pvm").exists() {
        assert!(matches!(o, Outcome::Done(_)), "{o:x?}");
    } else if is_page_fault_at(o, A, 0x7) {
        o = r.write(A, 9);
    }
    assert!(matches!(o, Outcome::Done(_)), "{o:x?}");
    assert_eq!(r.mem.read_u64(fx).unwrap(), 9);
}

/// A page-table page dropped from its PD entry and a new one installed for the same 2 MiB: enough to
/// invalidate the frames the old table mapped.
#[test]
fn replaced_page_table_is_seen_after_invalidate_frames() {
    let mut r = Rig::new(MEM);
    let (fx, fz, fy) = (r.frame(X), r.frame(7), r.frame(Y));
    let b = A + 0x2000;
    r.map(A, fx, PTE_W | PTE_NX);
    r.map(b, fz, PTE_W | PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    assert_eq!(r.read(b), Outcome::Done(7));
    let old_pt = r.pte_gpa(A) & !0xfff;
    let mut table = r.aspace.root;
    for level in [3u32, 2] {
        table = r.mem.read_u64(table + ((A >> (12 + 9 * level)) & 0x1ff) * 8).unwrap() & 0x000f_ffff_ffff_f000;
    }
    r.mem.write_u64(table + ((A >> 21) & 0x1ff) * 8, 0).unwrap();
    r.map(A, fy, PTE_W | PTE_NX);
    assert_ne!(r.pte_gpa(A) & !0xfff, old_pt);
    invalidate_frames(&r.mem, &[fx, fz]).unwrap();
    assert_sees_remap(r.read(A), X, Y);
    assert_faults(r.read(b), b, 0x4, Some(7));
}

/// Why `vstate::tlb` exists: on kvm_pvm nothing done to the vCPU alone (no flush, KVM_SET_SREGS with
/// the same CR3, a CR4.PGE flip, a CR3 switch to a copy of the root) makes the guest drop a
/// translation the host removed, narrowed or redirected. If this test starts failing, kvm_pvm has
/// changed and a cheaper flush may now work: rerun `examples/pt_coherence.rs`.
#[test]
fn kvm_pvm_keeps_stale_translations_without_invalidation() {
    if !std::path::Path::new("/sys/module/kvm_pvm").exists() {
        eprintln!("not kvm_pvm: nothing to check");
        return;
    }
    for how in [Flush::None, Flush::SregsSameCr3, Flush::Cr4PgeToggle, Flush::Cr3CopyAndBack] {
        assert_eq!(remap(how), Outcome::Done(X), "{how:?}: remap");
        assert_eq!(unmap(how), Outcome::Done(X), "{how:?}: unmap");
        let (o, v) = write_protect(how);
        assert!(matches!(o, Outcome::Done(_)) && v == 6, "{how:?}: write-protect: {o:x?}, {v}");
    }
}

/// Upstream KVM's shadow MMU (`npt=0`/`ept=0`, the emulated lane's second boot) is kvm_pvm's case
/// too: a host edit of a guest page table bypasses the write protection KVM relies on, so without
/// the invalidation the guest keeps its old translations (which is what the stale-translation
/// tests above then show the invalidation fixes).
#[test]
fn upstream_shadow_paging_keeps_stale_translations_without_invalidation() {
    use collimate_engine::vstate::profile::{self, Kind, Paging};
    let p = profile::current();
    if p.paging != Paging::Shadow || p.kind == Kind::Pvm || p.source != "sysfs" {
        eprintln!("{}: not upstream KVM with shadow paging, nothing to check", p.name());
        return;
    }
    assert_eq!(remap(Flush::None), Outcome::Done(X), "remap");
    assert_eq!(unmap(Flush::None), Outcome::Done(X), "unmap");
    let (o, v) = write_protect(Flush::None);
    assert!(matches!(o, Outcome::Done(_)) && v == 6, "write-protect: {o:x?}, {v}");
}

/// `flush_guest_tlb` deletes the memory slot, which discards KVM's dirty log: it must fold the log
/// into guest memory's private-page record first (snapshot and reset depend on it).
#[test]
fn flush_guest_tlb_keeps_the_dirty_log() {
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_W | PTE_NX);
    let before = r.vm.take_dirty_log().unwrap();
    r.mem.sync_dirty(&before);
    let dirty_before = r.mem.dirty().count();
    // A frame nobody wrote yet: only the guest's write below can make it dirty.
    let fresh = r.data.alloc().unwrap();
    r.map(A + 0x1000, fresh, PTE_W | PTE_NX);
    let dirty_mapped = r.mem.dirty().count();
    assert!(matches!(r.write(A + 0x1000, 3), Outcome::Done(_)));
    flush_guest_tlb(&mut r.vm, &mut r.mem).unwrap();
    let page = fresh / 4096;
    assert!(
        r.mem.dirty().runs().iter().any(|&(p, n)| page >= p && page < p + n),
        "guest write lost from the dirty record"
    );
    assert!(r.mem.dirty().count() > dirty_mapped && dirty_mapped >= dirty_before);
    // And dirty logging still works on the re-added slot.
    assert!(matches!(r.write(A, 4), Outcome::Done(_)));
    let log = r.vm.take_dirty_log().unwrap();
    let fx_page = fx / 4096;
    assert_ne!(log[(fx_page / 64) as usize] & (1 << (fx_page % 64)), 0);
}

/// `invalidate_frames` leaves guest memory as it was (contents and host write access) and makes one
/// mprotect pair per 2 MiB block of host memory; `invalidate_frames_exact` drops a few frames of a
/// block exactly and makes a pair only for a block with many; both refuse addresses outside guest
/// memory.
#[test]
fn invalidate_frames_is_harmless_to_guest_memory() {
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_W | PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    assert_eq!(invalidate_frames(&r.mem, &[fx]).unwrap(), 1);
    assert_eq!(r.mem.read_u64(fx).unwrap(), X);
    // The exact path drops a few frames without an mprotect pair, and the contents stay.
    assert_eq!(invalidate_frames_exact(&r.mem, &[fx]).unwrap(), 0);
    assert_eq!(r.mem.read_u64(fx).unwrap(), X);
    r.mem.write_u64(fx, 42).unwrap(); // would SIGSEGV if the mapping were left read-only
    assert_eq!(r.read(A), Outcome::Done(42));

    let base = r.mem.host_addr();
    let block_start = (base + fx) / INVALIDATION_BLOCK * INVALIDATION_BLOCK - base;
    let same_block = [block_start, block_start + 4096 * 7, block_start + INVALIDATION_BLOCK - 4096];
    let same_block: Vec<u64> = same_block.into_iter().filter(|&g| g < r.mem.size()).collect();
    assert_eq!(invalidate_frames(&r.mem, &same_block).unwrap(), 1);
    assert_eq!(invalidate_frames_exact(&r.mem, &same_block).unwrap(), 0);
    let two_blocks = [block_start + INVALIDATION_BLOCK, fx, fx];
    assert_eq!(invalidate_frames(&r.mem, &two_blocks).unwrap(), 2);
    assert_eq!(invalidate_frames_exact(&r.mem, &two_blocks).unwrap(), 0);
    // Many frames of one block: one pair for the block (its neighbour's single frame: none).
    let many: Vec<u64> = (0..100).map(|i| block_start + 4096 * i).chain([block_start + INVALIDATION_BLOCK]).collect();
    assert_eq!(invalidate_frames_exact(&r.mem, &many).unwrap(), 1);
    let in_two: Vec<u64> =
        (0..200).map(|i| block_start + 4096 * i).chain((0..80).map(|i| block_start + INVALIDATION_BLOCK + 4096 * i)).collect();
    assert_eq!(invalidate_frames_exact(&r.mem, &in_two).unwrap(), 2);
    assert_eq!(r.mem.read_u64(fx).unwrap(), 42);
    assert_eq!(invalidate_frames(&r.mem, &[]).unwrap(), 0);
    assert!(invalidate_frames(&r.mem, &[r.mem.size()]).is_err());
    assert_eq!(r.read(A), Outcome::Done(42));
}

/// `GuestMemory::zap_in_place` (the exact path of `invalidate_frames`) keeps every page's contents
/// over a file-backed private mapping: a page written here (private, different from the file), a
/// page still the file's, a private page written back to the file's bytes, and a hole of the file.
#[test]
fn zapping_pages_in_place_keeps_what_they_held() {
    use std::io::Write;
    const P: usize = 4096;
    let size = 8 << 20;
    // SAFETY: memfd_create with a valid name; checked below.
    let fd = unsafe { libc::memfd_create(c"zap-test".as_ptr(), libc::MFD_CLOEXEC) };
    assert!(fd >= 0);
    // SAFETY: a descriptor we just made and own.
    let mut file = unsafe { <std::fs::File as std::os::fd::FromRawFd>::from_raw_fd(fd) };
    file.set_len(size).unwrap();
    // Pages 0..4 of the file hold 0xA0 + i; from page 4 on it is a hole.
    for i in 0..4u8 {
        file.write_all(&[0xA0 + i; P]).unwrap();
    }
    let mut mem = collimate_engine::vstate::memory::GuestMemory::over_image(file, size).unwrap();
    mem.write(P as u64, &[0x11; P]).unwrap(); // page 1: private, differs from the file
    mem.write(2 * P as u64, &[0xA2; P]).unwrap(); // page 2: private, the file's bytes
    mem.write(5 * P as u64 + 8, &[0x55; 16]).unwrap(); // page 5: in the hole, written
    let page = |mem: &collimate_engine::vstate::memory::GuestMemory, i: usize| {
        let mut b = vec![0u8; P];
        mem.read((i * P) as u64, &mut b).unwrap();
        b
    };
    let before: Vec<Vec<u8>> = (0..8).map(|i| page(&mem, i)).collect();
    assert!(mem.file_backed(0, 8 * P as u64));
    mem.zap_in_place(0, 8 * P as u64).unwrap();
    for (i, b) in before.iter().enumerate() {
        assert_eq!(&page(&mem, i), b, "page {i}");
    }
    // Still writable from the host.
    mem.write(P as u64, &[0x22; 8]).unwrap();
    assert!(mem.zap_in_place(size - P as u64, 2 * P as u64).is_err(), "past the end");
}
