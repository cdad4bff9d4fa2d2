//! Syscall-site patching: a guest `syscall` that trapped from the common site
//! `mov eax, N; syscall` (`b8 NN NN NN NN 0f 05`) enters the blob by a jump next time, without
//! the seccomp SIGSYS's signal delivery and `rt_sigreturn` (gVisor's systrap does the same).
//!
//! The VMM rewrites the site's 5-byte `mov` into `jmp rel32` to a trampoline of its own, 32 bytes
//! in [`layout::TRAMP`]: `mov eax, N; movabs rcx, site + 7; jmp syscall_entry` (the blob's
//! entry, which reports the same exit the SIGSYS would: rcx and r11 hold what the `syscall`
//! instruction would leave there). The site's `0f 05` stays: a guest thread stopped between the
//! `mov` and the `syscall` (threads share the stub, M:1) resumes there and traps as before, and
//! no other thread can run the bytes while they are written (the stub is parked). A guest
//! stopped inside a trampoline (a kick) is reported at the site's `syscall` with `rax = N`, the
//! state it has there ([`rewind`]). Conditions, each checked when the site traps the
//! [`PATCH_AT`]-th time:
//! - the bytes are that pattern with the trapped syscall's number;
//! - the site is within a `jmp rel32` of the trampolines (libraries, placed below the reserved
//!   range, are; a non-PIE program at 4 MiB is not, and keeps trapping);
//! - the page is a private executable mapping ([`private_code`]): the write is a copy on write
//!   of this process's page, never written through to a file or to memory shared with another
//!   process, as a debugger's breakpoint is.
//!
//! What a guest can tell: its own code's bytes at a patched site read `e9 xx xx xx xx 0f 05`
//! instead of `b8 NN 00 00 00 0f 05` (gVisor accepts the same), and a guest interrupted inside
//! a trampoline is reported at the site. Which sites get patched follows only from the guest's
//! own execution (the traps of each site) and, for a restored guest, its snapshot's, so a replay
//! patches the same sites at the same points; the syscalls themselves, their results and every
//! register are as unpatched.
//!
//! Forks (host forks) carry the patched pages, the trampolines and the [`Patcher`]. A snapshot
//! keeps them too (`vmm::systrap::snapshot`): the patched pages are the process's copies of
//! private code pages, saved in its memory file as any page it copied, and the patcher's table
//! is a [`Saved`]. A restore writes the trampolines back before the guest runs
//! ([`super::Stub::restore_patches`]), so a template's clones and restores run its hot sites
//! patched from their first syscall instead of learning each again through two SIGSYS traps
//! (29 sites in the python agent's snapshot; a patched call 3-4 us cheaper here, 6-7 against
//! 9.4-11.4 us for `os.getppid()` in an SDK exec). Before it is saved, the sites that trapped
//! once are patched too ([`super::Stub::patch_seen`]): each restore would patch them at its first
//! trap there, and each reset drop that copy again. A reset
//! ([`super::Stub::reset_patches`], `vmm::systrap::reset`) returns to that state: the snapshot's
//! patched pages are its memory file's and stay, the sandbox's own patches were its copies and
//! are dropped, and the slots after the snapshot's are free again (never the snapshot's: its
//! pages still jump to them).
//!
//! `COLLIMATE_SYSTRAP_PATCH=0` turns it off (read once per process; [`super::Stub::set_patching`]
//! per stub): nothing is patched, and a stub restored from a snapshot taken patched puts each
//! site's `mov` back (at the restore and at each reset), so no guest code runs through a
//! trampoline. `COLLIMATE_SYSTRAP_PATCH_SNAPSHOT=0` takes snapshots unpatched, as before
//! ([`super::Stub::unpatch_all`]), to compare.

use std::collections::{HashMap, HashSet};
use std::io::Read;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};

use super::{blob, layout, memory};

/// Bytes per trampoline; slot 0 is not used.
pub const SLOT: u64 = 32;
/// How many sites one stub patches at most.
pub const SLOTS: u64 = layout::TRAMP_LEN / SLOT;
/// A site is looked at on its this-many-th trap: one that traps once (most of a short program's:
/// `sh -c true`) is not worth a read of the process's maps and two writes.
pub const PATCH_AT: u32 = 2;

/// Patching is on unless `COLLIMATE_SYSTRAP_PATCH=0` (read once per process).
pub fn enabled_by_env() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_SYSTRAP_PATCH").is_none_or(|v| v != "0"))
}

/// One stub's patching state (copied into its forks, which share its trampolines' pages).
#[derive(Debug, Clone)]
pub struct Patcher {
    pub enabled: bool,
    /// The trampolines and the XSAVE buffer are mapped in the stub.
    ready: bool,
    /// Each patched site's syscall number and return address, by slot (slot 1 first): the
    /// trampolines' contents, and the next free slot (its length + 1).
    table: Vec<(u32, u64)>,
    /// Return addresses of syscalls whose sites were found unpatchable (not checked again).
    rejected: HashSet<u64>,
    /// Traps so far of each site not yet looked at, by return address.
    seen: HashMap<u64, u32>,
    /// What a reset brings this stub back to: the snapshot's sites, and whether they are
    /// patched here (the restore kept them) or were put back ([`Origin`]). `None`: nothing
    /// restored (a reset starts over from no site).
    origin: Option<Origin>,
}

/// The snapshot's patching state a restored stub and its forks go back to at a reset
/// ([`super::Stub::restore_patches`], [`super::Stub::reset_patches`]).
#[derive(Debug, Clone)]
pub struct Origin {
    pub saved: std::sync::Arc<Saved>,
    /// The restore kept the sites patched (their trampolines written); else it put their `mov`
    /// back (patching was off in the restoring stub) and a reset puts it back again.
    pub patched: bool,
}

/// A stub's patching state as a snapshot keeps it (`vmm::systrap::snapshot`): with the guest's
/// pages as patched, a restore writes these trampolines back into its stub's reserved range and
/// goes on as the snapshotted process would have, patching the same sites at the same points.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct Saved {
    /// Each patched site's syscall number and return address, by slot (slot 1 first).
    pub sites: Vec<(u32, u64)>,
    /// Return addresses of sites found unpatchable, ascending.
    pub rejected: Vec<u64>,
    /// Traps so far of sites not yet looked at, by return address, ascending.
    pub seen: Vec<(u64, u32)>,
}

impl Default for Patcher {
    fn default() -> Patcher {
        Patcher {
            enabled: enabled_by_env(),
            ready: false,
            table: Vec::new(),
            rejected: HashSet::new(),
            seen: HashMap::new(),
            origin: None,
        }
    }
}

impl Patcher {
    /// Sites patched so far in this stub's address space (including its parent's, for a fork,
    /// and the snapshot's, for a restore).
    pub fn sites(&self) -> u64 {
        self.table.len() as u64
    }

    /// The next free slot.
    fn next(&self) -> u64 {
        self.table.len() as u64 + 1
    }

    /// Whether the syscall that returns to `ret` is worth a look now: patching is on, there is
    /// a free slot, the site was not found unpatchable before, and this is its [`PATCH_AT`]-th trap.
    pub fn wants(&mut self, ret: u64) -> bool {
        if !self.enabled || self.next() >= SLOTS || self.rejected.contains(&ret) {
            return false;
        }
        let n = self.seen.entry(ret).or_insert(0);
        *n += 1;
        *n >= PATCH_AT
    }

    /// The sites that trapped but were not looked at yet, ascending.
    pub fn seen_sites(&self) -> Vec<u64> {
        let mut v: Vec<u64> = self.seen.keys().copied().collect();
        v.sort_unstable();
        v
    }

    /// [`Patcher::wants`] for a site that trapped before, without a trap now: patching is on and
    /// there is a free slot.
    pub fn wants_now(&self, ret: u64) -> bool {
        self.enabled && self.next() < SLOTS && !self.rejected.contains(&ret)
    }

    pub fn reject(&mut self, ret: u64) {
        self.seen.remove(&ret);
        self.rejected.insert(ret);
    }

    /// No site is patched and none was looked at: the state of a stub that has run no guest (a
    /// reset of one restored from nothing: its pages are the files' again). Without it each
    /// reset left its sites' slots taken, and a sandbox recycled about a hundred times stopped
    /// patching.
    pub fn forget(&mut self) {
        self.table.clear();
        self.rejected.clear();
        self.seen.clear();
    }

    /// This state, for a snapshot (sorted, so that the same run writes the same bytes).
    pub fn save(&self) -> Saved {
        let mut rejected: Vec<u64> = self.rejected.iter().copied().collect();
        rejected.sort_unstable();
        let mut seen: Vec<(u64, u32)> = self.seen.iter().map(|(&r, &n)| (r, n)).collect();
        seen.sort_unstable();
        Saved { sites: self.table.clone(), rejected, seen }
    }

    /// Take `s` as this stub's state (its sites' trampolines written by the caller, or, with
    /// `patched` false, their `mov`s put back: then they count as unpatchable, not patched).
    pub fn load(&mut self, s: &Saved, patched: bool) {
        self.rejected = s.rejected.iter().copied().collect();
        self.seen = s.seen.iter().copied().collect();
        if patched {
            self.table = s.sites.clone();
        } else {
            self.table.clear();
            self.rejected.extend(s.sites.iter().map(|&(_, ret)| ret));
        }
    }

    /// The state a reset returns to ([`Patcher::origin`]).
    pub fn origin(&self) -> Option<&Origin> {
        self.origin.as_ref()
    }

    pub fn set_origin(&mut self, o: Origin) {
        self.origin = Some(o);
    }

    /// The site was patched.
    fn patched(&mut self, nr: u32, ret: u64) {
        self.seen.remove(&ret);
        self.table.push((nr, ret));
    }
}

/// The 7 bytes of the site a syscall of number `nr` returning to `ret` must have, and the
/// trampoline slot's address; `None` when the site is out of a `jmp rel32`'s reach.
pub fn plan(p: &Patcher, ret: u64, nr: u64) -> Option<([u8; 7], u64, [u8; 5])> {
    let nr32 = u32::try_from(nr).ok()?;
    let site = ret.checked_sub(7)?;
    let mut want = [0xb8, 0, 0, 0, 0, 0x0f, 0x05];
    want[1..5].copy_from_slice(&nr32.to_le_bytes());
    let tramp = layout::TRAMP + p.next() * SLOT;
    let rel = i32::try_from(tramp as i64 - (site as i64 + 5)).ok()?;
    let mut jmp = [0xe9, 0, 0, 0, 0];
    jmp[1..].copy_from_slice(&rel.to_le_bytes());
    Some((want, tramp, jmp))
}

/// The trampoline at `tramp` for syscall `nr` returning to `ret`.
pub fn trampoline(tramp: u64, nr: u32, ret: u64) -> [u8; SLOT as usize] {
    let mut t = [0xcc; SLOT as usize]; // int3 after the jump
    t[0] = 0xb8;
    t[1..5].copy_from_slice(&nr.to_le_bytes());
    t[5] = 0x48;
    t[6] = 0xb9;
    t[7..15].copy_from_slice(&ret.to_le_bytes());
    t[15] = 0xe9;
    let rel = blob::syscall_entry() as i64 - (tramp as i64 + 20);
    t[16..20].copy_from_slice(&(rel as i32).to_le_bytes());
    t
}

/// The syscall number and return address a trampoline's bytes name, if they are one.
pub fn parse(t: &[u8; 20]) -> Option<(u32, u64)> {
    if t[0] != 0xb8 || t[5] != 0x48 || t[6] != 0xb9 || t[15] != 0xe9 {
        return None;
    }
    let nr = u32::from_le_bytes(t[1..5].try_into().ok()?);
    let ret = u64::from_le_bytes(t[7..15].try_into().ok()?);
    Some((nr, ret))
}

/// Where a guest stopped at `rip` inside a trampoline stands in its own code: (rip, rax) at the
/// site's `syscall`, where resuming does what the trampoline would.
pub fn rewind(mem: &std::fs::File, rip: u64) -> Option<(u64, u64)> {
    if !(layout::TRAMP..layout::TRAMP + layout::TRAMP_LEN).contains(&rip) {
        return None;
    }
    let base = rip & !(SLOT - 1);
    let mut t = [0u8; 20];
    if !memory::read(mem, base, &mut t) {
        return None;
    }
    let (nr, ret) = parse(&t)?;
    Some((ret - 2, nr as u64))
}

/// Whether `[addr, addr + len)` lies in one private executable mapping of process `pid`: asked
/// with the `PROCMAP_QUERY` ioctl on its maps file (Linux 6.11; about 1 us here), else read
/// from the maps text (about 0.5 ms for a Python process's on a nested host).
pub fn private_code(pid: i32, addr: u64, len: u64) -> bool {
    let Ok(dir) = memory::proc_dir() else { return false };
    let Ok(path) = std::ffi::CString::new(format!("{pid}/maps")) else { return false };
    // SAFETY: `dir` is an open directory fd and `path` NUL-terminated; the fd is owned below.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return false;
    }
    // SAFETY: just opened, owned by nobody else.
    let mut f = std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) });
    if let Some(answer) = query(&f, addr, len) {
        return answer;
    }
    let mut text = String::new();
    if f.read_to_string(&mut text).is_err() {
        return false;
    }
    text.lines().any(|l| {
        let mut it = l.split_whitespace();
        let (Some(range), Some(perms)) = (it.next(), it.next()) else { return false };
        let Some((a, b)) = range.split_once('-') else { return false };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { return false };
        a <= addr && addr + len <= b && perms.as_bytes().get(2) == Some(&b'x') && perms.as_bytes().get(3) == Some(&b'p')
    })
}

/// Linux's `struct procmap_query` (include/uapi/linux/fs.h).
#[repr(C)]
#[derive(Default)]
struct ProcmapQuery {
    size: u64,
    query_flags: u64,
    query_addr: u64,
    vma_start: u64,
    vma_end: u64,
    vma_flags: u64,
    vma_page_size: u64,
    vma_offset: u64,
    inode: u64,
    dev_major: u32,
    dev_minor: u32,
    vma_name_size: u32,
    build_id_size: u32,
    vma_name_addr: u64,
    build_id_addr: u64,
}

/// `_IOWR('f', 17, struct procmap_query)` (the VMM's jail admits it: `vmm::jail`).
pub const PROCMAP_QUERY: u64 = (3 << 30) | ((std::mem::size_of::<ProcmapQuery>() as u64) << 16) | (0x66 << 8) | 17;
const VMA_EXECUTABLE: u64 = 4;
const VMA_SHARED: u64 = 8;

/// The `PROCMAP_QUERY` answer for [`private_code`]; `None` where the kernel lacks the ioctl.
fn query(maps: &std::fs::File, addr: u64, len: u64) -> Option<bool> {
    let mut q = ProcmapQuery { size: std::mem::size_of::<ProcmapQuery>() as u64, query_addr: addr, ..Default::default() };
    // SAFETY: the ioctl reads and writes one `procmap_query` we own, sized in its `size` field;
    // the name and build-id pointers are null with zero sizes, so nothing else is written.
    let r = unsafe { libc::ioctl(maps.as_raw_fd(), PROCMAP_QUERY as _, &mut q as *mut ProcmapQuery) };
    if r != 0 {
        let e = std::io::Error::last_os_error().raw_os_error();
        // ENOENT: no mapping covers addr; anything else: ask the text instead.
        return if e == Some(libc::ENOENT) { Some(false) } else { None };
    }
    Some(q.vma_start <= addr && addr + len <= q.vma_end && q.vma_flags & VMA_EXECUTABLE != 0 && q.vma_flags & VMA_SHARED == 0)
}

/// Mark the patcher ready after the caller mapped the trampolines and the XSAVE buffer.
pub fn set_ready(p: &mut Patcher) {
    p.ready = true;
}

pub fn is_ready(p: &Patcher) -> bool {
    p.ready
}

/// Take the next slot (after the caller wrote it) for the site of syscall `nr` returning to `ret`.
pub fn advance(p: &mut Patcher, nr: u32, ret: u64) {
    p.patched(nr, ret);
}

/// The slots in use.
pub fn slots(p: &Patcher) -> std::ops::Range<u64> {
    1..p.next()
}

/// The trampolines of `sites` (slot 1 first), as one run of bytes from slot 1's address.
pub fn trampolines(sites: &[(u32, u64)]) -> Vec<u8> {
    let mut out = Vec::with_capacity(sites.len() * SLOT as usize);
    for (i, &(nr, ret)) in sites.iter().enumerate() {
        out.extend_from_slice(&trampoline(layout::TRAMP + (i as u64 + 1) * SLOT, nr, ret));
    }
    out
}

/// The 5 bytes a site holds when patched to jump to the trampoline at `tramp`, and those it held
/// before (`mov eax, nr`).
pub fn site_bytes(site: u64, tramp: u64, nr: u32) -> ([u8; 5], [u8; 5]) {
    let mut jmp = [0xe9, 0, 0, 0, 0];
    jmp[1..].copy_from_slice(&((tramp as i64 - (site as i64 + 5)) as i32).to_le_bytes());
    let mut orig = [0xb8, 0, 0, 0, 0];
    orig[1..].copy_from_slice(&nr.to_le_bytes());
    (jmp, orig)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_trampoline_parses_back() {
        let t = trampoline(layout::TRAMP + SLOT, 39, 0x7fff_f000_1234);
        let head: [u8; 20] = t[..20].try_into().unwrap();
        assert_eq!(parse(&head), Some((39, 0x7fff_f000_1234)));
        let p = Patcher::default();
        let (want, tramp, jmp) = plan(&p, 0x7fff_f000_1234, 39).unwrap();
        assert_eq!(want, [0xb8, 39, 0, 0, 0, 0x0f, 0x05]);
        assert_eq!(tramp, layout::TRAMP + SLOT);
        assert_eq!(jmp[0], 0xe9);
        // A non-PIE program's text is out of reach.
        assert!(plan(&p, 0x40_1007, 39).is_none());
    }

    #[test]
    fn the_maps_query_tells_private_code_from_shared() {
        let pid = std::process::id() as i32;
        let code = a_trampoline_parses_back as *const () as u64;
        assert!(private_code(pid, code, 7), "this test's own text");
        // SAFETY: a new shared executable anonymous page, unmapped below.
        let shared = unsafe {
            libc::mmap(std::ptr::null_mut(), 4096, libc::PROT_READ | libc::PROT_EXEC, libc::MAP_SHARED | libc::MAP_ANONYMOUS, -1, 0)
        };
        assert_ne!(shared, libc::MAP_FAILED);
        assert!(!private_code(pid, shared as u64, 7));
        // SAFETY: the page mapped above.
        unsafe { libc::munmap(shared, 4096) };
        assert!(!private_code(pid, 8, 7), "nothing mapped at 8");
    }
}
