//! Several edits of a stub's address space in one round trip ([`shared::CMD_BATCH`]).
//!
//! Each [`Stub::map`], [`Stub::unmap`] and [`Stub::protect`] is a hand-off to the parked stub and
//! back, and a file mapping is three (the stub's `recvmsg` of the fd, the `mmap`, the `close`).
//! A program load makes a dozen or more such edits in a row with nothing to read in between but
//! their success (busybox's shell: 16 round trips), so a [`Batch`] collects them and
//! [`Stub::run_batch`] hands them over at once: the fds the file mappings name go over the
//! socket together, and the stub's list is their `recvmsg`, the calls, and a `close` of each fd.
//! What the stub does is exactly what the single commands do (the same syscalls from the blob,
//! under the same filter); only the round trips are fewer.

use std::io;
use std::os::fd::{AsFd, AsRawFd, BorrowedFd, OwnedFd, RawFd};

use super::shared::{ADVISE_MAX, BATCH_AT, BATCH_FDS, BATCH_MAX, CMD_ADVISE, CMD_BATCH, FD_RECEIVED, SCRATCH};
use super::{host, layout, send_fds, Error, Result, Stub};

/// One queued call: the syscall and its arguments (an fd argument as an index into the batch's
/// fds, resolved at run time), and what a success returns where that matters (mmap: the address).
#[derive(Debug)]
struct Call {
    op: &'static str,
    nr: i64,
    args: [u64; 6],
    expect: Option<u64>,
}

/// Address-space edits for one [`Stub::run_batch`], in order.
#[derive(Debug, Default)]
pub struct Batch {
    calls: Vec<Call>,
    /// Copies of the host fds the file mappings name (so the caller's may close before the run),
    /// with the caller's fd number and the file's identity, to send each file once.
    fds: Vec<(RawFd, (u64, u64), OwnedFd)>,
}

/// How many fds one batch passes (what the scratch area's control buffer holds).
const FDS_MAX: usize = FD_RECEIVED.len();

impl Batch {
    /// An empty batch.
    pub fn new() -> Batch {
        Batch::default()
    }

    /// Whether nothing is queued.
    pub fn is_empty(&self) -> bool {
        self.calls.is_empty()
    }

    /// How many calls are queued.
    pub fn len(&self) -> usize {
        self.calls.len()
    }

    /// Whether one more call naming `fd` (`None`: none) fits; if not, run the batch first. The
    /// list also holds the `recvmsg` and a `close` per fd.
    pub fn fits(&self, fd: Option<BorrowedFd<'_>>) -> bool {
        let new_fd = fd.is_some_and(|fd| self.fd_index(fd).is_none());
        let fds = self.fds.len() + new_fd as usize;
        fds <= FDS_MAX && self.calls.len() + 1 + (fds > 0) as usize + fds <= BATCH_MAX
    }

    fn fd_index(&self, fd: BorrowedFd<'_>) -> Option<usize> {
        let id = file_id(fd).ok()?;
        self.fds.iter().position(|(raw, i, _)| *raw == fd.as_raw_fd() && *i == id)
    }

    /// Queue [`Stub::map`]'s `mmap(va, len, prot, flags | MAP_FIXED, fd, offset)`. The fd is
    /// copied now. Errors as `map`'s: the reserved range, and [`Batch::fits`] not checked.
    pub fn map(&mut self, va: u64, len: u64, prot: i32, flags: i32, fd: Option<BorrowedFd<'_>>, offset: u64) -> Result<()> {
        if layout::touches_reserved(va, len) {
            return Err(Error::Reserved { addr: va, len });
        }
        if !self.fits(fd) {
            return Err(Error::Op { op: "batch", source: io::Error::other("the batch is full; run it first") });
        }
        let flags = (flags | libc::MAP_FIXED) as u64;
        let (flags, fd_arg) = match fd {
            None => (flags | libc::MAP_ANONYMOUS as u64, u64::MAX),
            Some(fd) => {
                let i = match self.fd_index(fd) {
                    Some(i) => i,
                    None => {
                        let id = file_id(fd).map_err(host("fstat of a file to map"))?;
                        let copy = fd.try_clone_to_owned().map_err(host("dup of a file to map"))?;
                        self.fds.push((fd.as_raw_fd(), id, copy));
                        self.fds.len() - 1
                    }
                };
                (flags, FD_RECEIVED[i] as u64)
            }
        };
        self.calls.push(Call { op: "mmap", nr: libc::SYS_mmap, args: [va, len, prot as u64, flags, fd_arg, offset], expect: Some(va) });
        Ok(())
    }

    /// Queue [`Stub::unmap`]'s `munmap(va, len)`.
    pub fn unmap(&mut self, va: u64, len: u64) -> Result<()> {
        self.plain("munmap", libc::SYS_munmap, va, len, 0)
    }

    /// Queue [`Stub::protect`]'s `mprotect(va, len, prot)`.
    pub fn protect(&mut self, va: u64, len: u64, prot: i32) -> Result<()> {
        self.plain("mprotect", libc::SYS_mprotect, va, len, prot as u64)
    }

    fn plain(&mut self, op: &'static str, nr: i64, va: u64, len: u64, a2: u64) -> Result<()> {
        if layout::touches_reserved(va, len) {
            return Err(Error::Reserved { addr: va, len });
        }
        if !self.fits(None) {
            return Err(Error::Op { op: "batch", source: io::Error::other("the batch is full; run it first") });
        }
        self.calls.push(Call { op, nr, args: [va, len, a2, 0, 0, 0], expect: None });
        Ok(())
    }
}

/// A file's device and inode (to tell whether a batch already holds it).
fn file_id(fd: BorrowedFd<'_>) -> io::Result<(u64, u64)> {
    // SAFETY: an all-zero stat is valid; fstat fills it for a descriptor we borrow.
    let mut st: libc::stat = unsafe { std::mem::zeroed() };
    // SAFETY: as above.
    if unsafe { libc::fstat(fd.as_raw_fd(), &mut st) } != 0 {
        return Err(io::Error::last_os_error());
    }
    Ok((st.st_dev, st.st_ino))
}

impl Stub {
    /// Make the calls `b` holds in the stub, in order, in one round trip (and empty `b`). The
    /// first that fails ends the list and is the error (the calls before it took effect, as the
    /// single commands in a row would have).
    pub fn run_batch(&mut self, b: &mut Batch) -> Result<()> {
        if b.calls.is_empty() {
            return Ok(());
        }
        if !self.parked {
            return Err(Error::NotParked { what: "take a command" });
        }
        let calls = std::mem::take(&mut b.calls);
        let fds = std::mem::take(&mut b.fds);
        let mut list: Vec<[u64; 7]> = Vec::with_capacity(calls.len() + 1 + fds.len());
        if !fds.is_empty() {
            let raw: Vec<RawFd> = fds.iter().map(|(_, _, f)| f.as_raw_fd()).collect();
            send_fds(self.sock.as_fd(), &raw).map_err(host("sendmsg"))?;
            let msg = self.recv_header();
            // SAFETY: the VMM's turn; the fd slots of the control buffer lie in the mapped page.
            // An fd that does not arrive stays -1 (the calls naming it fail with EBADF).
            unsafe {
                let at = self.page.bytes().add(BATCH_FDS).cast::<i32>();
                at.write_volatile(-1);
                at.add(1).write_volatile(-1);
            }
            list.push([libc::SYS_recvmsg as u64, layout::SOCK_FD as u64, msg, 0, 0, 0, 0]);
        }
        let first = list.len();
        for c in &calls {
            let a = c.args;
            list.push([c.nr as u64, a[0], a[1], a[2], a[3], a[4], a[5]]);
        }
        for placeholder in FD_RECEIVED.iter().take(fds.len()) {
            list.push([libc::SYS_close as u64, *placeholder as u64, 0, 0, 0, 0, 0]);
        }
        debug_assert!(list.len() <= BATCH_MAX);
        // SAFETY: the VMM's turn (parked, checked above); the list fits the page (BATCH_MAX).
        unsafe {
            let at = self.page.bytes().add(BATCH_AT).cast::<[u64; 7]>();
            for (i, e) in list.iter().enumerate() {
                at.add(i).write_volatile(*e);
            }
        }
        let ran = self.command(CMD_BATCH, [0, list.len() as u64, 0, 0, 0, 0, 0])?;
        let result = |i: usize| -> i64 {
            // SAFETY: the VMM's turn again; entry `i` lies in the page.
            unsafe { self.page.bytes().add(BATCH_AT + 56 * i).cast::<i64>().read_volatile() }
        };
        let ran = usize::try_from(ran).unwrap_or(0).min(list.len());
        if !fds.is_empty() {
            if ran == 0 || (-4095..0).contains(&result(0)) {
                let e = if ran == 0 { io::Error::other("not run") } else { io::Error::from_raw_os_error(-result(0) as i32) };
                return Err(Error::Op { op: "recvmsg", source: e });
            }
            self.received_fds()?;
        }
        let mut failed = None;
        for (k, c) in calls.iter().enumerate() {
            let i = first + k;
            if i >= ran {
                failed.get_or_insert(Error::Op { op: c.op, source: io::Error::other("not run") });
                break;
            }
            let r = result(i);
            if (-4095..0).contains(&r) {
                failed = Some(Error::Op { op: c.op, source: io::Error::from_raw_os_error(-r as i32) });
                break;
            }
            if c.expect.is_some_and(|va| va != r as u64) {
                failed = Some(Error::Op { op: c.op, source: io::Error::other("mapped elsewhere") });
                break;
            }
        }
        if failed.is_some() && !fds.is_empty() && ran < list.len() {
            // The list stopped before its closes: close the received fds one by one (the stub
            // holds few: RLIMIT_NOFILE is 8 there).
            let got = self.received_fds().unwrap_or([-1, -1]);
            for fd in got.into_iter().take(fds.len()).filter(|&fd| fd >= 0 && fd != layout::SOCK_FD) {
                let _ = self.syscall("close", libc::SYS_close, [fd as u64, 0, 0, 0, 0, 0]);
            }
        }
        crate::trace::mark_n("stub.batch", calls.len() as u64);
        failed.map_or(Ok(()), Err)
    }
}

impl Stub {
    /// `madvise(start, len, advice)` on each of `runs` in one round trip per [`ADVISE_MAX`] of
    /// them (`shared::CMD_ADVISE`), as [`Stub::advise`] on each would; how many the host took.
    pub fn advise_runs(&mut self, runs: &[(u64, u64)], advice: i32) -> Result<usize> {
        if let Some(&(addr, len)) = runs.iter().find(|&&(va, len)| layout::touches_reserved(va, len)) {
            return Err(Error::Reserved { addr, len });
        }
        let mut done = 0;
        for chunk in runs.chunks(ADVISE_MAX) {
            // SAFETY: the VMM's turn (`command` checks the stub is parked before it hands over);
            // the chunk fits the scratch area (ADVISE_MAX).
            unsafe {
                let at = self.page.bytes().add(SCRATCH).cast::<u64>();
                for (i, &(va, len)) in chunk.iter().enumerate() {
                    at.add(2 * i).write_volatile(va);
                    at.add(2 * i + 1).write_volatile(len);
                }
            }
            done += self.command(CMD_ADVISE, [advice as u64, chunk.len() as u64, 0, 0, 0, 0, 0])?.max(0) as usize;
        }
        Ok(done)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_batch_holds_what_fits_the_page() {
        let mut b = Batch::new();
        let mut n = 0;
        while b.fits(None) {
            b.unmap(0x10_0000 + n as u64 * 0x1000, 0x1000).unwrap();
            n += 1;
        }
        assert_eq!(n, BATCH_MAX);
        assert!(b.unmap(0x20_0000, 0x1000).is_err(), "a full batch refuses a call");
        let mut b = Batch::new();
        assert!(matches!(b.protect(layout::STUB_BASE, 0x1000, 0), Err(Error::Reserved { .. })));
        assert!(b.is_empty());
    }
}
