//! The guest's vDSO: clock reads that do not leave the guest.
//!
//! There is no guest kernel, so every syscall is a VM exit, and CPython reads the clocks all the
//! time (the GIL's timed waits, `time.monotonic`, `time.time`): 17 of the 32 syscalls of a thread's
//! create+join are clock_gettime. Linux answers those in user space, from the vDSO it maps into
//! every process; glibc finds it through AT_SYSINFO_EHDR. Here too: [`map`] puts a small ELF shared
//! object ([`IMAGE`], built from `vdso/vdso.S` by the crate's build script) at [`VDSO_VA`] in every
//! process at exec, with a data page ([`VVAR_VA`], the page below it), shown in /proc/self/maps
//! as `[vdso]` and `[vvar]`. It exports `__vdso_clock_gettime`, `__vdso_gettimeofday`,
//! `__vdso_time` and `__vdso_clock_getres` with version LINUX_2.6, as glibc looks them up. Both
//! pages are ordinary VMAs and guest memory, so forks, snapshots, restores and resets carry them.
//!
//! # What it answers
//! **Replay mode only** (see `guestos::clock`): a clock read there is a pure function of the
//! virtual clocks, which the vDSO can compute. The data page holds a copy of the process's
//! [`Clocks`] (REALTIME and MONOTONIC bases and the time elapsed since), the quantum, and a
//! limit. A read of a REALTIME or MONOTONIC clock (ids 0, 5, 8, 11 and 1, 4, 6, 7, 9, as
//! `clock_now` sorts them) adds the quantum to `elapsed` with one `cmpxchg`, if that does not
//! pass the limit, and answers base + elapsed, exactly what the syscall would have;
//! clock_getres gives the same fixed answers.
//! Everything else (CPU-time clocks, unknown ids, and every clock outside replay mode, where the
//! page says mode 0) makes the real syscall from inside the vDSO, as Linux's does for clocks it
//! cannot read. Outside replay mode the clocks are the host's, which the guest cannot read
//! without the VMM (no host time base and TSC scaling is published): those reads still exit.
//!
//! # Keeping the VMM's clock exact
//! The page is the clock's state while the guest runs, [`Proc::clocks`] while the VMM does: the run
//! loop [`publish`]es the clocks into the page before every KVM_RUN and [`fold`]s the page back
//! right after it returns, before anything (a syscall, a fault, the schedulers, a timeout, a
//! snapshot or fork) looks at time. Folding adds the reads' quanta to `elapsed` and to the CPU
//! clock (as `clock_now_ns` would have), and sets what the guest last saw of REALTIME and
//! MONOTONIC. The run loop then does what those reads' syscalls would have done to the schedulers:
//! they count as the thread scheduler's events and as progress for the sandbox's turns.
//!
//! What a read's exit used to decide besides the clock is the thread switch of replay mode (after
//! `vmm::threads::QUANTUM` events, once another thread is ready). The limit keeps that exact: it
//! is `elapsed` plus a quantum for each read the loaded thread may make before the read at which
//! a switch would have come, which then makes the syscall (`vmm::threads::vdso_budget`); a
//! process with one thread has no limit. So a replay sees the same times and the same schedule as
//! with every read exiting.
//!
//! A read writes the page once, with the `cmpxchg` that is the read itself; it checks the limit
//! before and writes nothing else first. The VMM stops the vCPU between any two instructions (a
//! signal, its timers) and [`publish`]es again before it resumes, so every read is wholly before
//! or wholly after that; a read another thread's reads overtook (a switch between instructions:
//! the M:1 threads share the page) fails its `cmpxchg` and checks again. (The first vDSO kept a
//! budget word that a read decremented before its `xadd` of `elapsed`: stopped between the two,
//! the publish gave the decrement back and the switch came one read late, in a replay that had
//! to match. QEMU's TCG, which takes interrupts only between its translated blocks, stops a guest
//! right after that decrement's branch far more often than hardware would: the upstream-KVM lane.)
//! Images made by that vDSO (in snapshots taken before) still run: the page keeps its budget word.
//!
//! The guest can write the page (it must: the vDSO advances it). Whatever it writes only changes
//! what it itself sees, and the VMM's state is taken from its own copy plus the count of quanta.

use super::clock::{Clocks, CLOCK_QUANTUM_NS};
use super::mm::{Mm, Space, Vma, PROT_EXEC, PROT_READ, PROT_WRITE};
use super::{Errno, GuestOs, EINVAL};
use crate::arch::x86_64::layout::{PAGE_SIZE, STACK_TOP};
use crate::arch::x86_64::paging::AddressSpace;
use crate::platform::HostSpace;
use crate::vstate::memory::GuestMemory;

/// The vDSO image (an ELF shared object of one page, linked at 0).
pub static IMAGE: &[u8] = include_bytes!(concat!(env!("OUT_DIR"), "/vdso.so"));

/// Where the image is mapped: a few pages below the 8 MiB stack (`exec::STACK_RESERVE`), where
/// Linux puts it too (above the mmap area).
pub const VDSO_VA: u64 = STACK_TOP - (8 << 20) - 4 * PAGE_SIZE;
/// The data page: right below the image (the vDSO addresses it relative to its own code).
pub const VVAR_VA: u64 = VDSO_VA - PAGE_SIZE;

/// The data page's words (offsets as `vdso/vdso.S` names them; the systrap stub's `rdtsc` answer,
/// `platform::systrap::blob`, uses MODE, MONO_BASE, ELAPSED, QUANTUM, LAST_MONO, LIMIT and
/// TSC_READS).
pub(crate) const MODE: usize = 0;
const REAL_BASE: usize = 1;
pub(crate) const MONO_BASE: usize = 2;
pub(crate) const ELAPSED: usize = 3;
pub(crate) const QUANTUM: usize = 4;
const BUDGET: usize = 5;
const LAST_REAL: usize = 6;
pub(crate) const LAST_MONO: usize = 7;
pub(crate) const LIMIT: usize = 8;
/// `rdtsc`s answered from the page since the VMM last wrote it (the systrap stub answers a
/// trapped `rdtsc` there, as the VMM would, within `LIMIT` as the vDSO's reads: a MONOTONIC read
/// that is not a scheduler event, as a trapped `rdtsc` the VMM answers is not; kvm never writes it).
pub(crate) const TSC_READS: usize = 9;
pub(crate) const WORDS: usize = 10;

/// `MODE`: answer REALTIME and MONOTONIC reads from the page (replay mode); 0: make syscalls.
pub(crate) const MODE_REPLAY: u64 = 1;

/// Map the data page and the image into a fresh process (exec). Returns the image's address for
/// AT_SYSINFO_EHDR.
pub fn map(mm: &mut Mm, sp: &mut Space) -> Result<u64, Errno> {
    if IMAGE.len() as u64 > PAGE_SIZE {
        return Err(EINVAL);
    }
    if mm.overlaps(VVAR_VA, VDSO_VA + PAGE_SIZE) {
        return Err(super::ENOMEM);
    }
    Mm::populate(sp, VVAR_VA, VDSO_VA, PROT_READ | PROT_WRITE)?;
    Mm::populate(sp, VDSO_VA, VDSO_VA + PAGE_SIZE, PROT_READ | PROT_EXEC)?;
    sp.aspace.write_virt(sp.mem, VDSO_VA, IMAGE, false).map_err(|_| EINVAL)?;
    mm.insert(VVAR_VA, Vma::anon(VDSO_VA, PROT_READ | PROT_WRITE, "[vvar]"));
    mm.insert(VDSO_VA, Vma::anon(VDSO_VA + PAGE_SIZE, PROT_READ | PROT_EXEC, "[vdso]"));
    Ok(VDSO_VA)
}

/// [`map`] on an address space the host kernel keeps (systrap): the same two pages, made by the
/// platform ([`Mm::host_map`]); the image is written through it before the page is made
/// read-only and executable.
pub fn map_host(mm: &mut Mm, h: &mut dyn HostSpace) -> Result<u64, Errno> {
    if IMAGE.len() as u64 > PAGE_SIZE {
        return Err(EINVAL);
    }
    if mm.overlaps(VVAR_VA, VDSO_VA + PAGE_SIZE) {
        return Err(super::ENOMEM);
    }
    mm.host_map(h, VVAR_VA, Vma::anon(VDSO_VA, PROT_READ | PROT_WRITE, "[vvar]"), None)?;
    mm.host_map(h, VDSO_VA, Vma::anon(VDSO_VA + PAGE_SIZE, PROT_READ | PROT_EXEC, "[vdso]"), None)?;
    h.write(VDSO_VA, IMAGE)?;
    Ok(VDSO_VA)
}

/// The data page's address where a trapped `rdtsc` may be answered from it without the VMM (the
/// systrap stub's, `platform::systrap::Stub::set_clock_page`): in replay mode, in a process that
/// has the page; None otherwise.
pub fn clock_page(os: &GuestOs) -> Option<u64> {
    // Readable too: the stub reads it in its signal handler, where a fault would end it.
    let readable = os.mm.vma_at(VVAR_VA).is_some_and(|(_, v)| v.prot & PROT_READ != 0);
    (os.proc.clocks.replay && mapped(&os.mm) && readable).then_some(VVAR_VA)
}

/// Whether the process has its data page (a program loaded before vDSOs existed, or one that
/// unmapped it, has none: its clock reads all exit).
fn mapped(mm: &Mm) -> bool {
    mm.vma_at(VVAR_VA).is_some_and(|(s, v)| s == VVAR_VA && v.name == "[vvar]" && v.file.is_none())
}

fn read_page(mem: &GuestMemory, aspace: &AddressSpace) -> Option<[u64; WORDS]> {
    let mut b = [0u8; WORDS * 8];
    aspace.read_virt(mem, VVAR_VA, &mut b, false).ok()?;
    let mut w = [0u64; WORDS];
    for (i, c) in b.chunks_exact(8).enumerate() {
        w[i] = u64::from_le_bytes(c.try_into().unwrap_or_default());
    }
    Some(w)
}

/// What the page should say before the guest runs: the clocks, and `budget` reads.
fn page_of(c: &Clocks, budget: u64) -> [u64; WORDS] {
    if !c.replay {
        return [0; WORDS];
    }
    let mut w = [0u64; WORDS];
    w[MODE] = MODE_REPLAY;
    w[REAL_BASE] = c.real_base;
    w[MONO_BASE] = c.mono_base;
    w[ELAPSED] = c.elapsed;
    w[QUANTUM] = CLOCK_QUANTUM_NS;
    w[BUDGET] = budget.min(i64::MAX as u64);
    w[LIMIT] = c.elapsed.saturating_add(budget.saturating_mul(CLOCK_QUANTUM_NS));
    w
}

/// Before KVM_RUN: the clocks into the page, with room for `budget` reads (see the module comment).
/// Writes only when the page would change.
pub fn publish(os: &GuestOs, mem: &mut GuestMemory, aspace: &AddressSpace, budget: u64) {
    if !mapped(&os.mm) {
        return;
    }
    let want = page_of(&os.proc.clocks, budget);
    if read_page(mem, aspace) == Some(want) {
        return;
    }
    let b: Vec<u8> = want.iter().flat_map(|w| w.to_le_bytes()).collect();
    let _ = aspace.write_virt(mem, VVAR_VA, &b, false);
}

/// What the VMM last read of or wrote to the data page of a host-kept address space, so that
/// [`publish_host`] writes only a change and [`fold_host`] is the one read per guest exit.
/// Forget it ([`Seen::forget`]) when something other than these two may have changed the page
/// (an execve maps a new one).
#[derive(Default, Clone, Copy)]
pub struct Seen(Option<[u64; WORDS]>);

impl Seen {
    pub fn forget(&mut self) {
        self.0 = None;
    }
}

fn read_host(h: &dyn HostSpace) -> Option<[u64; WORDS]> {
    let mut b = [0u8; WORDS * 8];
    h.read(VVAR_VA, &mut b).ok()?;
    let mut w = [0u64; WORDS];
    for (i, c) in b.chunks_exact(8).enumerate() {
        w[i] = u64::from_le_bytes(c.try_into().unwrap_or_default());
    }
    Some(w)
}

/// [`publish`] through a host-kept address space (systrap: the stub's memory).
pub fn publish_host(os: &GuestOs, h: &mut dyn HostSpace, seen: &mut Seen, budget: u64) {
    if !mapped(&os.mm) {
        seen.forget();
        return;
    }
    let want = page_of(&os.proc.clocks, budget);
    let now = match seen.0 {
        Some(w) => Some(w),
        None => read_host(h),
    };
    if now == Some(want) {
        seen.0 = Some(want);
        return;
    }
    let b: Vec<u8> = want.iter().flat_map(|w| w.to_le_bytes()).collect();
    seen.0 = h.write(VVAR_VA, &b).is_ok().then_some(want);
}

/// [`fold`] through a host-kept address space; `copied`: the page's words as the guest left them
/// at this exit, where the platform copied them out already (the systrap stub does, at every
/// exit while it has the page: `Stub::clock_words`), else they are read through `h`.
pub fn fold_host(os: &mut GuestOs, h: &dyn HostSpace, seen: &mut Seen, copied: Option<[u64; WORDS]>) -> u64 {
    let c = &mut os.proc.clocks;
    if !c.replay || !mapped(&os.mm) {
        return 0;
    }
    let Some(w) = copied.or_else(|| read_host(h)) else {
        seen.forget();
        return 0;
    };
    seen.0 = Some(w);
    fold_words(c, &w)
}

/// After KVM_RUN: the reads the guest made in the vDSO into [`Proc::clocks`]. Returns how many.
pub fn fold(os: &mut GuestOs, mem: &GuestMemory, aspace: &AddressSpace) -> u64 {
    let c = &mut os.proc.clocks;
    if !c.replay || !mapped(&os.mm) {
        return 0;
    }
    let Some(w) = read_page(mem, aspace) else { return 0 };
    fold_words(c, &w)
}

/// Folds the page's reads into `c` and returns how many were the vDSO's (the `rdtsc`s answered
/// from the page, `TSC_READS`, moved the clocks as well but are not scheduler events, as a
/// trapped `rdtsc` the VMM answers is not).
fn fold_words(c: &mut Clocks, w: &[u64; WORDS]) -> u64 {
    let d = w[ELAPSED].wrapping_sub(c.elapsed);
    if d == 0 || d > i64::MAX as u64 {
        return 0;
    }
    let reads = d / CLOCK_QUANTUM_NS;
    let vdso_reads = reads - w[TSC_READS].min(reads);
    let d = reads * CLOCK_QUANTUM_NS;
    let start = c.elapsed;
    c.elapsed = c.elapsed.saturating_add(d);
    c.cpu_elapsed = c.cpu_elapsed.saturating_add(d);
    // What the guest last saw of each clock: base + elapsed after that read (within this run).
    let seen = |last: u64| (last > start && last <= c.elapsed).then_some(last);
    if let Some(e) = seen(w[LAST_REAL]) {
        c.seen_real = c.real_base.saturating_add(e);
    }
    if let Some(e) = seen(w[LAST_MONO]) {
        c.seen_mono = c.mono_base.saturating_add(e);
    }
    vdso_reads
}

#[cfg(test)]
mod tests {
    use super::*;

    fn replay_clocks() -> Clocks {
        let mut c = Clocks::default();
        let mut start = 0;
        c.start_replay(&mut start);
        c
    }

    #[test]
    fn image_is_a_versioned_shared_object() {
        let elf = goblin::elf::Elf::parse(IMAGE).expect("vDSO parses");
        assert_eq!(elf.header.e_type, goblin::elf::header::ET_DYN);
        assert!(elf.program_headers.iter().any(|p| p.p_type == goblin::elf::program_header::PT_DYNAMIC));
        let names: Vec<&str> = elf.dynsyms.iter().filter_map(|s| elf.dynstrtab.get_at(s.st_name)).collect();
        for f in ["__vdso_clock_gettime", "__vdso_gettimeofday", "__vdso_time", "__vdso_clock_getres"] {
            assert!(names.contains(&f), "{f} missing from {names:?}");
        }
        let verdefs: Vec<&str> = elf
            .verdef
            .as_ref()
            .expect("DT_VERDEF")
            .iter()
            .flat_map(|d| d.iter().filter_map(|a| elf.dynstrtab.get_at(a.vda_name)).collect::<Vec<_>>())
            .collect();
        assert!(verdefs.contains(&"LINUX_2.6"), "{verdefs:?}");
        assert!(elf.dynamic.as_ref().is_some_and(|d| d.info.hash.is_some() || d.info.gnu_hash.is_some()));
    }

    #[test]
    fn folding_adds_the_reads_as_the_syscalls_would() {
        let mut c = replay_clocks();
        let mut by_syscall = c;
        let mut w = page_of(&c, 10);
        // Three reads in the vDSO: MONOTONIC, REALTIME, MONOTONIC.
        w[ELAPSED] += CLOCK_QUANTUM_NS;
        w[LAST_MONO] = w[ELAPSED];
        w[ELAPSED] += CLOCK_QUANTUM_NS;
        w[LAST_REAL] = w[ELAPSED];
        w[ELAPSED] += CLOCK_QUANTUM_NS;
        w[LAST_MONO] = w[ELAPSED];
        assert_eq!(fold_words(&mut c, &w), 3);
        // The same reads as syscalls.
        let mut p = super::super::process::Proc { clocks: by_syscall, ..Default::default() };
        for clock in [libc::CLOCK_MONOTONIC, libc::CLOCK_REALTIME, libc::CLOCK_MONOTONIC] {
            super::super::clock::clock_now_ns(&mut p, clock).unwrap();
        }
        by_syscall = p.clocks;
        assert_eq!(c, by_syscall);
        // Nothing new: nothing changes.
        assert_eq!(fold_words(&mut c, &w), 0);
        assert_eq!(c, by_syscall);
    }

    /// What the systrap stub does for a trapped `rdtsc` (`platform::systrap::blob`): a MONOTONIC
    /// read within the limit, counted in TSC_READS.
    fn stub_rdtsc(w: &mut [u64; WORDS]) -> u64 {
        assert!(w[ELAPSED] + w[QUANTUM] <= w[LIMIT]);
        w[ELAPSED] += w[QUANTUM];
        w[LAST_MONO] = w[ELAPSED];
        w[TSC_READS] += 1;
        w[MONO_BASE] + w[ELAPSED]
    }

    #[test]
    fn rdtscs_answered_from_the_page_fold_as_the_vmm_answers_them() {
        let mut c = replay_clocks();
        let mut w = page_of(&c, 10);
        let mut p = super::super::process::Proc { clocks: c, ..Default::default() };
        // rdtsc, a vDSO MONOTONIC read, rdtsc: the same values as the VMM's answers (tsc_now) and
        // the syscall.
        assert_eq!(stub_rdtsc(&mut w), super::super::clock::tsc_now(&mut p));
        w[ELAPSED] += CLOCK_QUANTUM_NS;
        w[LAST_MONO] = w[ELAPSED];
        super::super::clock::clock_now_ns(&mut p, libc::CLOCK_MONOTONIC).unwrap();
        assert_eq!(stub_rdtsc(&mut w), super::super::clock::tsc_now(&mut p));
        // One of the three was the vDSO's (a scheduler event); the clocks are the VMM's.
        assert_eq!(fold_words(&mut c, &w), 1);
        assert_eq!(c, p.clocks);
        // The rdtscs were not events: the next page allows the same number of vDSO reads.
        assert_eq!(page_of(&c, 10)[LIMIT] - page_of(&c, 10)[ELAPSED], 10 * CLOCK_QUANTUM_NS);
        assert_eq!(page_of(&c, 10)[TSC_READS], 0);
    }

    #[test]
    fn the_limit_allows_the_budget_reads_and_a_publish_after_some_keeps_it() {
        let mut c = replay_clocks();
        let w = page_of(&c, 3);
        // What the vDSO's `take` allows: reads while elapsed + quantum stays within the limit.
        let (mut e, mut n) = (w[ELAPSED], 0);
        while e + w[QUANTUM] <= w[LIMIT] {
            e += w[QUANTUM];
            n += 1;
        }
        assert_eq!(n, 3);
        assert_eq!(w[BUDGET], 3, "the budget word of images made before the limit");
        // Two reads folded, then published again with the budget left: the same limit, so a read
        // the VMM stopped halfway (checked, not yet taken) is still right when it resumes.
        let mut g = w;
        g[ELAPSED] += 2 * CLOCK_QUANTUM_NS;
        assert_eq!(fold_words(&mut c, &g), 2);
        assert_eq!(page_of(&c, 1)[LIMIT], w[LIMIT]);
        assert_eq!(page_of(&c, u64::MAX)[LIMIT], u64::MAX, "one thread: no limit");
    }

    #[test]
    fn outside_replay_the_page_says_syscall() {
        assert_eq!(page_of(&Clocks::default(), 5), [0; WORDS]);
        assert_eq!(page_of(&replay_clocks(), u64::MAX)[BUDGET], i64::MAX as u64);
    }
}
