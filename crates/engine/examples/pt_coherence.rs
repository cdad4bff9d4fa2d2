//! Does a running guest see the host's edits of its page tables, and what makes it see them?
//!
//! `cargo run --release -p collimate-engine --example pt_coherence` (needs /dev/kvm; run as a user who
//! may open it). `pt_coherence one b|c|d|e <Flush>` runs a single trial (handy with the kvmmmu
//! tracepoints on: the trial writes markers into /sys/kernel/tracing/trace_marker when it can).
//! `pt_coherence span <gpa hex>` shows which shadow entries one `invalidate_frames` drops (trace it).
//!
//! Each trial: the guest reads (or writes) address A so that KVM builds a shadow entry, the host edits
//! the translation through its own mapping of guest memory, applies one flush method, and the guest
//! touches A again. Then the cost of the methods: the flush itself and the guest's first accesses
//! afterwards.
#[path = "../tests/tlb_rig/mod.rs"]
mod tlb_rig;

use collimate_engine::arch::x86_64::paging::{PTE_NX, PTE_P, PTE_U, PTE_W};
use collimate_engine::vstate::tlb;
use tlb_rig::*;

const MEM: u64 = 256 << 20;
const A: u64 = DATA_VA + 0x5000;
const X: u64 = 0x1111_1111_1111_1111;
const Y: u64 = 0x2222_2222_2222_2222;

/// A line in the kernel trace buffer (when tracefs is mounted), to find the trial among kvmmmu events.
fn mark(what: &str) {
    let _ = std::fs::write("/sys/kernel/tracing/trace_marker", what);
}

fn show(o: Outcome, want: u64) -> String {
    match o {
        Outcome::Done(v) if v == want => "SEEN".into(),
        Outcome::Done(v) if v == X => "stale (old frame)".into(),
        other => format!("{other:x?}"),
    }
}

fn page_fault_at(o: Outcome, va: u64) -> Option<u64> {
    match o {
        Outcome::Fault { vector: 14, cr2, error_code } if cr2 == va => Some(error_code),
        _ => None,
    }
}

/// (b) remap A from frame X to frame Y.
fn case_b(how: Flush) -> String {
    let mut r = Rig::new(MEM);
    let (fx, fy) = (r.frame(X), r.frame(Y));
    r.map(A, fx, PTE_W | PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    assert_eq!(r.read(A), Outcome::Done(X));
    let pt = r.pte_gpa(A) & !0xfff;
    r.set_pte(A, fy | PTE_P | PTE_U | PTE_W | PTE_NX);
    mark("flush");
    r.flush(how, &[fx], &[pt]);
    mark("read 1");
    let first = r.read(A);
    mark("read 2");
    let second = r.read(A);
    mark("end");
    format!("{} (again: {})", show(first, Y), show(second, Y))
}

/// (c) clear A's PTE.
fn case_c(how: Flush) -> String {
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_W | PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    let pt = r.pte_gpa(A) & !0xfff;
    r.set_pte(A, 0);
    r.flush(how, &[fx], &[pt]);
    let o = r.read(A);
    match page_fault_at(o, A) {
        Some(e) => format!("SEEN (#PF err={e:#x})"),
        None => format!("stale: {}", show(o, 0)),
    }
}

/// (d) clear A's write bit.
fn case_d(how: Flush) -> String {
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_W | PTE_NX);
    assert!(matches!(r.write(A, 5), Outcome::Done(_)));
    assert_eq!(r.read(A), Outcome::Done(5));
    let pt = r.pte_gpa(A) & !0xfff;
    let pte = r.pte(A);
    r.set_pte(A, pte & !PTE_W);
    r.flush(how, &[fx], &[pt]);
    let o = r.write(A, 6);
    let now = r.mem.read_u64(fx).unwrap();
    match page_fault_at(o, A) {
        Some(e) if now == 5 => format!("SEEN (#PF err={e:#x})"),
        _ => format!("stale: write went through ({o:x?}), memory now {now}"),
    }
}

/// (e) a page-table page dropped (PD entry cleared) and a new one installed for the same 2 MiB:
/// A remapped to Y through the new table, B (mapped through the old one) no longer mapped.
fn case_e(how: Flush) -> String {
    let mut r = Rig::new(MEM);
    let (fx, fz, fy) = (r.frame(X), r.frame(7), r.frame(Y));
    let b = A + 0x2000;
    r.map(A, fx, PTE_W | PTE_NX);
    r.map(b, fz, PTE_W | PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    assert_eq!(r.read(b), Outcome::Done(7));
    // Clear the PD entry: walk to it by hand (PML4 -> PDPT -> PD).
    let old_pt = r.pte_gpa(A) & !0xfff;
    let mut table = r.aspace.root;
    for level in [3u32, 2] {
        let e = r.mem.read_u64(table + ((A >> (12 + 9 * level)) & 0x1ff) * 8).unwrap();
        table = e & 0x000f_ffff_ffff_f000;
    }
    let pde = table + ((A >> 21) & 0x1ff) * 8;
    r.mem.write_u64(pde, 0).unwrap();
    r.map(A, fy, PTE_W | PTE_NX); // allocates a new page table
    assert_ne!(r.pte_gpa(A) & !0xfff, old_pt);
    r.flush(how, &[fx, fz], &[old_pt]);
    let oa = r.read(A);
    let ob = r.read(b);
    format!(
        "A: {}, B: {}",
        show(oa, Y),
        match page_fault_at(ob, b) {
            Some(e) => format!("SEEN (#PF err={e:#x})"),
            None => format!("stale: {}", show(ob, 0)),
        }
    )
}

/// (a) new or widened mappings, no flush at all.
fn case_a() {
    // a1: A never touched, its neighbours in the same page table are.
    let mut r = Rig::new(MEM);
    let (fn_, fx) = (r.frame(7), r.frame(X));
    r.map(A - 0x1000, fn_, PTE_W | PTE_NX);
    r.map(A + 0x1000, fn_, PTE_W | PTE_NX);
    assert_eq!(r.read(A - 0x1000), Outcome::Done(7));
    assert_eq!(r.read(A + 0x1000), Outcome::Done(7));
    r.map(A, fx, PTE_W | PTE_NX);
    println!("(a1) new PTE in a page table the guest uses, A never touched: {}", show(r.read(A), X));

    // a2: the guest touched A while it was not present (and took #PF); then the host maps it.
    let mut r = Rig::new(MEM);
    let (fn_, fx) = (r.frame(7), r.frame(X));
    r.map(A - 0x1000, fn_, PTE_W | PTE_NX);
    assert_eq!(r.read(A - 0x1000), Outcome::Done(7));
    let f = r.read(A);
    assert!(page_fault_at(f, A).is_some(), "{f:x?}");
    r.map(A, fx, PTE_W | PTE_NX);
    println!("(a2) A faulted as not present ({f:x?}), then mapped: {}", show(r.read(A), X));

    // a3: same, but the page table, PD and PDPT entry are all new (a fresh 512 GiB region).
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    let far = 0x0000_4000_0000_3000;
    let f = r.read(far);
    assert!(page_fault_at(f, far).is_some(), "{f:x?}");
    r.map(far, fx, PTE_W | PTE_NX);
    println!("(a3) A under a non-present PML4 entry, faulted first, then mapped: {}", show(r.read(far), X));

    // a4: read-only page made writable (mprotect upgrade) after a guest read built a read-only entry.
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    let pte = r.pte(A);
    r.set_pte(A, pte | PTE_W);
    let o = r.write(A, 9);
    let ok = matches!(o, Outcome::Done(_)) && r.mem.read_u64(fx).unwrap() == 9;
    println!("(a4) read-only -> writable after a read: write {}", if ok { "SEEN".into() } else { format!("{o:x?}") });

    // a5: same after the guest took the write fault on the read-only page.
    let mut r = Rig::new(MEM);
    let fx = r.frame(X);
    r.map(A, fx, PTE_NX);
    assert_eq!(r.read(A), Outcome::Done(X));
    let f = r.write(A, 9);
    let pte = r.pte(A);
    r.set_pte(A, pte | PTE_W);
    let o = r.write(A, 9);
    let ok = matches!(o, Outcome::Done(_)) && r.mem.read_u64(fx).unwrap() == 9;
    println!(
        "(a5) write faulted first ({f:x?}), then made writable: write {}",
        if ok { "SEEN".into() } else { format!("{o:x?}") }
    );
}

fn costs() {
    let n: u64 = 16384;
    println!("\n== costs: {n} data pages (64 MiB, contiguous frames) mapped and touched ==");
    let mut r = Rig::new(MEM);
    let mut frames = vec![];
    for i in 0..n {
        let f = r.frame(1);
        frames.push(f);
        r.map(DATA_VA + i * 4096, f, PTE_W | PTE_NX);
    }
    assert_eq!(r.touch(DATA_VA, n), Outcome::Done(n));
    let mut rt = vec![];
    for _ in 0..300 {
        rt.push(time(|| r.read(DATA_VA)).1);
    }
    let (p50, p99) = p50_p99(rt);
    println!("exit round trip (guest read + out): p50 {p50:.1} us, p99 {p99:.1} us");
    let mut warm = vec![];
    for _ in 0..30 {
        warm.push(time(|| r.touch(DATA_VA, n)).1);
    }
    let (warm50, _) = p50_p99(warm);
    println!("warm touch of all {n} pages: p50 {warm50:.0} us ({:.3} us/page)", warm50 / n as f64);

    let vmas = |r: &Rig| {
        let (lo, hi) = (r.mem.host_addr(), r.mem.host_addr() + r.mem.size());
        std::fs::read_to_string("/proc/self/maps")
            .unwrap()
            .lines()
            .filter(|l| {
                let (a, b) = l.split_once(' ').unwrap().0.split_once('-').unwrap();
                let (a, b) = (u64::from_str_radix(a, 16).unwrap(), u64::from_str_radix(b, 16).unwrap());
                a < hi && b > lo
            })
            .count()
    };
    let before = vmas(&r);
    for i in 0..200 {
        tlb::invalidate_frames(&r.mem, &[frames[i * 37 % frames.len()]]).unwrap();
    }
    println!("host mappings (VMAs) over guest memory: {before} before, {} after 200 invalidations", vmas(&r));
    r.touch(DATA_VA, n);

    let block = |gpa: u64| (r.mem.host_addr() + gpa) / tlb::INVALIDATION_BLOCK;
    let blocks: Vec<u64> = frames.iter().map(|&f| block(f)).collect();
    // Frames picked for the targeted method: k frames in one 2 MiB block, or one in each of k blocks.
    let first_block = blocks[600];
    let one_block: Vec<u64> = frames.iter().zip(&blocks).filter(|(_, &b)| b == first_block).map(|(&f, _)| f).collect();
    let mut per_block: Vec<u64> = vec![];
    for (f, b) in frames.iter().zip(&blocks) {
        if per_block.last().map(|&l| block(l)) != Some(*b) {
            per_block.push(*f + 4096 * 100);
        }
    }
    per_block.retain(|&f| f < frames[n as usize - 1]);
    println!("(a 2 MiB block of host memory holds {} of these pages)", one_block.len());

    let cases: Vec<(String, Flush, Vec<u64>, u64)> = vec![
        ("SregsSameCr3 (does not work)".into(), Flush::SregsSameCr3, vec![], 0),
        ("Cr4PgeToggle (does not work)".into(), Flush::Cr4PgeToggle, vec![], 0),
        ("Cr3CopyAndBack (does not work)".into(), Flush::Cr3CopyAndBack, vec![], 0),
        ("MemslotDirtyLogToggle (only (d))".into(), Flush::MemslotDirtyLogToggle, vec![], 0),
        (
            "invalidate_frames, 1 frame".into(),
            Flush::MprotectOldFrames,
            one_block[..1].to_vec(),
            one_block.len() as u64,
        ),
        (
            format!("invalidate_frames, {} frames in 1 block", one_block.len()),
            Flush::MprotectOldFrames,
            one_block.clone(),
            one_block.len() as u64,
        ),
        (
            format!("invalidate_frames, 1 frame in each of {} blocks", per_block.len()),
            Flush::MprotectOldFrames,
            per_block.clone(),
            n, // (approximately: every block is hit)
        ),
        ("flush_guest_tlb (memslot delete + re-add)".into(), Flush::MemslotReadd, vec![], n),
    ];
    println!("{:<46} {:>10} {:>10} {:>14} {:>12}", "method", "flush p50", "flush p99", "next touch", "us/refault");
    for (name, how, sel, refaulted) in cases {
        let (mut fl, mut cold) = (vec![], vec![]);
        for _ in 0..30 {
            let (_, d) = time(|| r.flush(how, &sel, &[]));
            fl.push(d);
            let (o, d) = time(|| r.touch(DATA_VA, n));
            assert_eq!(o, Outcome::Done(n));
            cold.push(d);
        }
        let (f50, f99) = p50_p99(fl);
        let (c50, _) = p50_p99(cold);
        let per = if refaulted > 0 { format!("{:.2}", (c50 - warm50) / refaulted as f64) } else { "-".into() };
        println!("{name:<46} {f50:>8.1}us {f99:>8.1}us {:>12.0}us {per:>12}", c50);
    }
}

/// Which shadow entries does `invalidate_frames(&[gpa])` drop? 4096 pages on contiguous frames are
/// mapped and touched; after the invalidation the guest touches them again (count the kvmmmu
/// `kvm_mmu_set_spte` events between the "touch" and "end" markers).
fn span(gpa: u64) {
    let mut r = Rig::new(MEM);
    let n = 4096u64;
    for i in 0..n {
        r.map(DATA_VA + i * 4096, (8 << 20) + i * 4096, PTE_NX);
    }
    r.touch(DATA_VA, n);
    r.touch(DATA_VA, n);
    mark("flush");
    r.flush(Flush::MprotectOldFrames, &[gpa], &[]);
    mark("touch");
    r.touch(DATA_VA, n);
    mark("end");
    let off = (r.mem.host_addr() % tlb::INVALIDATION_BLOCK) / 4096;
    let start = ((gpa / 4096 + off) & !511) as i64 - off as i64;
    println!(
        "guest memory is {off:#x} pages into a 2 MiB block: the block around gpa {gpa:#x} is gfns {start:#x}..{:#x}",
        start + 511
    );
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    if args.len() == 3 && args[1] == "span" {
        span(u64::from_str_radix(args[2].trim_start_matches("0x"), 16).unwrap());
        return;
    }
    if args.len() == 4 && args[1] == "one" {
        let how = *Flush::ALL.iter().find(|f| format!("{f:?}") == args[3]).expect("flush method");
        let f = match args[2].as_str() {
            "b" => case_b,
            "c" => case_c,
            "d" => case_d,
            _ => case_e,
        };
        println!("{} {how:?}: {}", args[2], f(how));
        return;
    }
    println!("== (a) host adds or widens mappings, no flush ==");
    case_a();
    for (name, f) in [
        ("(b) remap A to another frame", case_b as fn(Flush) -> String),
        ("(c) unmap A (PTE cleared)", case_c),
        ("(d) write-protect A", case_d),
        ("(e) PD entry cleared, new page table for the same 2 MiB (A -> Y, B unmapped)", case_e),
    ] {
        println!("\n== {name} ==");
        for how in Flush::ALL {
            println!("  {:<22} {}", format!("{how:?}"), f(how));
        }
    }
    costs();
}
