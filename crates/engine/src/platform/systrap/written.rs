//! The pages a process has written (and the file pages it has mapped) since it was forked, read
//! from `/proc/<pid>/pagemap`, and the same faults taken ahead of use in another fork of the same
//! parent.
//!
//! A fork shares its parent's anonymous pages copy-on-write: the first write to each is a host
//! page fault that copies it (9-11 us on a nested host; a first touch of a page the parent never
//! had, 5 us). A clone of the python template's agent took about 420 of them in its stub at its
//! first exec, where the second exec took none. Which pages those are is the same from clone to
//! clone (the agent's exec loop, the interpreter's frames and allocator), so they can be learned
//! from one clone and written ahead in the next, off the path of its first exec.
//!
//! [`learn`] reads them: in a private writable mapping, present, anonymous (pagemap's "file or
//! shared-anonymous page" bit clear) and mapped by this process alone ("exclusively mapped": a
//! page the fork still shares with its parent has two mappers). It also reads the file pages the
//! fork has mapped: a host fork copies no page-table entries of a file mapping that has no
//! private copies (the program's text, a library's), so each later touch of those is a fault
//! too (a read fault that maps a 64 KiB group at once: about half of the agent's first-exec
//! faults). [`populate_here`] and [`Stub::populate`] make another fork take those faults now
//! (`MADV_POPULATE_WRITE`: the kernel faults each page in for writing, exactly as the write
//! would, without changing its contents; `MADV_POPULATE_READ` for the file pages): the guest
//! sees nothing. A page guessed wrong costs one page copy and its memory, never correctness; an
//! address that is not such a mapping in the other fork makes that run's advice fail, which is
//! skipped.

use std::io;
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd};
use std::os::unix::fs::FileExt;

use super::{layout, memory, Error, Result, Stub};

const PAGE: u64 = 4096;
/// pagemap entry bits (Documentation/admin-guide/mm/pagemap.rst).
const PRESENT: u64 = 1 << 63;
const FILE_OR_SHARED: u64 = 1 << 61;
const EXCLUSIVE: u64 = 1 << 56;
/// Entries read per pread of pagemap.
const CHUNK: usize = 512;

/// Whose pages: a stub (by host pid) or the calling process.
#[derive(Clone, Copy, Debug)]
pub enum Whose {
    Pid(i32),
    This,
}

impl Whose {
    fn dir(self) -> String {
        match self {
            Whose::Pid(pid) => pid.to_string(),
            Whose::This => "self".into(),
        }
    }
}

fn open_proc(whose: Whose, file: &str) -> io::Result<std::fs::File> {
    let dir = memory::proc_dir()?;
    let path = std::ffi::CString::new(format!("{}/{file}", whose.dir())).map_err(|_| io::Error::from(io::ErrorKind::InvalidInput))?;
    // SAFETY: `dir` is an open directory fd, `path` is NUL-terminated; the fd is owned below.
    let fd = unsafe { libc::openat(dir.as_raw_fd(), path.as_ptr(), libc::O_RDONLY | libc::O_CLOEXEC) };
    if fd < 0 {
        return Err(io::Error::last_os_error());
    }
    // SAFETY: just opened, owned by nobody else.
    Ok(std::fs::File::from(unsafe { OwnedFd::from_raw_fd(fd) }))
}

/// The private mappings of `whose` (`[start, end)`, writable or not), from its
/// `/proc/<pid>/maps`.
fn private_mappings(whose: Whose) -> io::Result<Vec<(u64, u64, bool)>> {
    let maps = open_proc(whose, "maps")?;
    let mut text = Vec::new();
    let mut off = 0u64;
    let mut buf = vec![0u8; 64 << 10];
    loop {
        let n = maps.read_at(&mut buf, off)?;
        if n == 0 {
            break;
        }
        text.extend_from_slice(&buf[..n]);
        off += n as u64;
    }
    let mut out = Vec::new();
    for line in String::from_utf8_lossy(&text).lines() {
        let mut f = line.split_whitespace();
        let (Some(range), Some(perms)) = (f.next(), f.next()) else { continue };
        let p = perms.as_bytes();
        if p.len() < 4 || p[0] != b'r' || p[3] != b'p' {
            continue;
        }
        let Some((a, b)) = range.split_once('-') else { continue };
        let (Ok(a), Ok(b)) = (u64::from_str_radix(a, 16), u64::from_str_radix(b, 16)) else { continue };
        if b <= layout::TASK_SIZE {
            out.push((a, b, p[1] == b'w'));
        }
    }
    Ok(out)
}

/// Runs of pages (start, length in bytes), ascending: what a fork wrote since it was forked
/// (`write`: private anonymous copies) and the file pages it has mapped (`read`: a fork maps
/// none of its parent's file pages but those it copied; each later touch is a fault).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Learned {
    pub write: Vec<(u64, u64)>,
    pub read: Vec<(u64, u64)>,
}

impl Learned {
    /// How many pages it names.
    pub fn pages(&self) -> u64 {
        self.write.iter().chain(&self.read).map(|r| r.1 / PAGE).sum()
    }
}

/// Pages of one mapping whose gap is at most this many pages are read in one run (a file page
/// maps with its neighbours anyway: the kernel's fault-around).
const READ_GAP: u64 = 16;

fn push(runs: &mut Vec<(u64, u64)>, va: u64, gap: u64, floor: u64) {
    match runs.last_mut() {
        Some((start, len)) if *start >= floor && *start + *len + gap * PAGE >= va => *len = va + PAGE - *start,
        _ => runs.push((va, PAGE)),
    }
}

/// What `whose` has written and mapped since it was forked (see [`Learned`] and the module docs),
/// outside `[skip.0, skip.1)`, at most `max` runs of each kind (the rest are left out).
pub fn learn(whose: Whose, skip: (u64, u64), max: usize) -> io::Result<Learned> {
    let maps = private_mappings(whose)?;
    let pagemap = open_proc(whose, "pagemap")?;
    let mut out = Learned::default();
    let mut entries = vec![0u8; CHUNK * 8];
    for (start, end, writable) in maps {
        if start < skip.1 && end > skip.0 {
            continue;
        }
        let mut va = start;
        while va < end && out.write.len() < max && out.read.len() < max {
            let n = (((end - va) / PAGE) as usize).min(CHUNK);
            let got = pagemap.read_at(&mut entries[..n * 8], va / PAGE * 8)? / 8;
            if got == 0 {
                break;
            }
            for i in 0..got {
                let e = u64::from_le_bytes(entries[i * 8..i * 8 + 8].try_into().expect("8 bytes"));
                let page = va + i as u64 * PAGE;
                if e & PRESENT == 0 {
                    continue;
                }
                if e & FILE_OR_SHARED != 0 {
                    push(&mut out.read, page, READ_GAP, start);
                } else if writable && e & EXCLUSIVE != 0 {
                    push(&mut out.write, page, 0, start);
                }
            }
            va += got as u64 * PAGE;
        }
    }
    out.write.truncate(max);
    out.read.truncate(max);
    Ok(out)
}

/// `MADV_POPULATE_WRITE` over `l.write` and `MADV_POPULATE_READ` over `l.read` in the calling
/// process; how many pages it did (runs the kernel refused, where this process has another
/// mapping, are skipped).
pub fn populate_here(l: &Learned) -> u64 {
    let mut done = 0;
    for (runs, advice) in [(&l.write, libc::MADV_POPULATE_WRITE), (&l.read, libc::MADV_POPULATE_READ)] {
        for &(va, len) in runs {
            // SAFETY: the advice faults pages in without changing their contents or any mapping,
            // so no reference in this process is invalidated.
            if unsafe { libc::madvise(va as *mut libc::c_void, len as usize, advice) } == 0 {
                done += len / PAGE;
            }
        }
    }
    done
}

impl Stub {
    /// What this stub has written and mapped since it was forked ([`learn`]), at most `max` runs
    /// of each kind; the reserved range is left out.
    pub fn learn(&self, max: usize) -> Result<Learned> {
        learn(Whose::Pid(self.pid), (layout::STUB_BASE, layout::STUB_END), max).map_err(|source| Error::Host { call: "read /proc/<pid>/pagemap of a stub", source })
    }

    /// Fault in `l` (learned from another fork of the same parent) in this stub now, executed
    /// by the stub: one round trip per [`super::shared::ADVISE_MAX`] runs; how many runs it did.
    /// Runs the host refuses (not such a mapping here) are skipped; a stub that is gone is an
    /// error.
    pub fn populate(&mut self, l: &Learned) -> Result<u64> {
        use super::shared::{ADVISE_MAX, CMD_ADVISE, SCRATCH};
        if !self.parked {
            return Err(Error::NotParked { what: "fault pages in" });
        }
        let mut done = 0;
        for (runs, advice) in [(&l.write, libc::MADV_POPULATE_WRITE), (&l.read, libc::MADV_POPULATE_READ)] {
            let runs: Vec<(u64, u64)> = runs.iter().copied().filter(|&(va, len)| !layout::touches_reserved(va, len)).collect();
            for batch in runs.chunks(ADVISE_MAX) {
                // SAFETY: the VMM's turn (the stub is parked: `command` checks); the batch fits
                // in the scratch area of the mapped page (ADVISE_MAX).
                unsafe {
                    let at = self.page.bytes().add(SCRATCH).cast::<u64>();
                    for (i, &(va, len)) in batch.iter().enumerate() {
                        at.add(2 * i).write(va);
                        at.add(2 * i + 1).write(len);
                    }
                }
                done += self.command(CMD_ADVISE, [advice as u64, batch.len() as u64, 0, 0, 0, 0, 0])? as u64;
            }
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn adjacent_pages_make_one_run() {
        let mut r = Vec::new();
        for p in [0x1000, 0x2000, 0x3000, 0x8000] {
            push(&mut r, p, 0, 0);
        }
        assert_eq!(r, vec![(0x1000, 0x3000), (0x8000, 0x1000)]);
        // With a gap allowed, within one mapping only.
        let mut r = Vec::new();
        for (p, floor) in [(0x1000, 0), (0x4000, 0), (0x6000, 0x6000)] {
            push(&mut r, p, 4, floor);
        }
        assert_eq!(r, vec![(0x1000, 0x4000), (0x6000, 0x1000)]);
    }

    #[test]
    fn a_fork_sees_what_it_wrote_and_not_what_it_shares() {
        // Two pages of this process, forked: the child writes the first only.
        let len = 2 * PAGE as usize;
        // SAFETY: a new private anonymous mapping, unmapped at the end.
        let p = unsafe { libc::mmap(std::ptr::null_mut(), len, libc::PROT_READ | libc::PROT_WRITE, libc::MAP_PRIVATE | libc::MAP_ANONYMOUS, -1, 0) };
        assert_ne!(p, libc::MAP_FAILED);
        let (a, b) = (p as u64, p as u64 + PAGE);
        // SAFETY: writing inside the mapping just made.
        unsafe { std::ptr::write_bytes(p.cast::<u8>(), 7, len) };
        memory::proc_dir().expect("/proc");
        let mut pipe = [0; 2];
        // SAFETY: pipe2 fills two descriptors.
        assert_eq!(unsafe { libc::pipe2(pipe.as_mut_ptr(), 0) }, 0);
        // SAFETY: the child only writes, reads /proc and writes a byte to the pipe before _exit.
        let pid = unsafe { libc::fork() };
        if pid == 0 {
            // SAFETY: inside the mapping.
            unsafe { *(a as *mut u8) = 1 };
            let w = learn(Whose::This, (0, 0), 1 << 20).unwrap_or_default().write;
            let has = |p: u64| w.iter().any(|&(s, l)| s <= p && p < s + l);
            let ok = has(a) && !has(b);
            // SAFETY: our pipe; then leave without running the test harness's exit path.
            unsafe {
                libc::write(pipe[1], [ok as u8].as_ptr().cast(), 1);
                libc::_exit(0);
            }
        }
        let mut r = [0u8];
        // SAFETY: reading one byte from our pipe; reaping our child; unmapping ours.
        unsafe {
            libc::read(pipe[0], r.as_mut_ptr().cast(), 1);
            libc::waitpid(pid, std::ptr::null_mut(), 0);
            libc::munmap(p, len);
        }
        assert_eq!(r[0], 1, "the child saw its written page and not the shared one");
    }
}
