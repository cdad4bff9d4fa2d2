//! A program load into a stub (execve, the spawn call's child) with its address-space edits
//! batched: [`Batched`] is the [`HostSpace`] `guestos::exec::commit_host` loads through. Its maps,
//! unmaps and protects are queued (`platform::systrap::batch`) and handed to the stub together
//! when something needs them done: a read of guest memory or the load's end
//! ([`Batched::finish`]). Its writes (the loader's pokes, the vDSO's image, the initial stack: made
//! through the stub's memory file, not by the stub) wait for the edits queued before them and are
//! made right after that batch, so a write between two edits does not split the batch: an edit
//! that touches a waiting write's range runs the batch and the writes first, which keeps every
//! write after the edits before it and before those after it that could change what it wrote.
//! busybox's shell took 16 round trips to the stub to load; it takes 1 (2 with its writes made at
//! once).
//!
//! `COLLIMATE_SYSTRAP_BATCH=0` makes each edit its own command again (as before), to compare.
//!
//! An edit that fails is reported by the call that ran the batch rather than by its own: a load
//! fails after its point of no return either way (the process ends by SIGSEGV), so only where it
//! fails moves, not what the guest sees.

use std::cell::RefCell;
use std::os::fd::BorrowedFd;

use crate::guestos::Errno;
use crate::platform::systrap::batch::Batch;
use crate::platform::systrap::Stub;
use crate::platform::HostSpace;

/// A stub's address space with edits batched (see the module docs).
pub(super) struct Batched<'a> {
    stub: RefCell<&'a mut Stub>,
    batch: RefCell<Batch>,
    /// Writes waiting for the queued edits (see the module docs): address and bytes, in order.
    writes: RefCell<Vec<(u64, Vec<u8>)>>,
    budget: u64,
    /// The last stub failure that was not the guest's doing (as `StubSpace::failure`).
    failure: RefCell<Option<String>>,
}

impl<'a> Batched<'a> {
    pub(super) fn new(stub: &'a mut Stub, budget: u64) -> Batched<'a> {
        Batched { stub: RefCell::new(stub), batch: RefCell::new(Batch::new()), writes: RefCell::new(Vec::new()), budget, failure: RefCell::new(None) }
    }

    /// The last failure of the stub itself (gone, or the host refused), for the VMM's messages.
    pub(super) fn failure(&self) -> Option<String> {
        self.failure.borrow_mut().take()
    }

    fn errno(&self, e: crate::platform::systrap::Error) -> Errno {
        use crate::platform::systrap::Error as E;
        if !matches!(e, E::Fault { .. } | E::Reserved { .. } | E::Op { .. }) {
            *self.failure.borrow_mut() = Some(e.to_string());
        }
        super::errno_of(e)
    }

    /// Run what is queued: the edits, then the writes that waited for them.
    fn flush(&self) -> Result<(), Errno> {
        let mut batch = self.batch.borrow_mut();
        if !batch.is_empty() {
            let r = self.stub.borrow_mut().run_batch(&mut batch);
            r.map_err(|e| self.errno(e))?;
        }
        drop(batch);
        let writes = std::mem::take(&mut *self.writes.borrow_mut());
        for (va, data) in writes {
            let r = self.stub.borrow().write(va, &data);
            r.map_err(|e| self.errno(e))?;
        }
        Ok(())
    }

    /// Run what is queued first if an edit of `[va, va + len)` could change what a waiting write
    /// wrote (or unmap where it writes).
    fn before_edit(&self, va: u64, len: u64) -> Result<(), Errno> {
        let end = va.saturating_add(len);
        let overlaps = self.writes.borrow().iter().any(|(w, d)| *w < end && va < w.saturating_add(d.len() as u64));
        if overlaps {
            self.flush()?;
        }
        Ok(())
    }

    /// Run what is still queued: the load's last edits.
    pub(super) fn finish(&mut self) -> Result<(), Errno> {
        self.flush()
    }

    fn queue(&mut self, range: (u64, u64), fd: Option<BorrowedFd<'_>>, f: impl FnOnce(&mut Batch) -> crate::platform::systrap::Result<()>) -> Result<(), Errno> {
        self.before_edit(range.0, range.1)?;
        if !self.batch.get_mut().fits(fd) {
            self.flush()?;
        }
        let r = f(self.batch.get_mut());
        r.map_err(|e| self.errno(e))
    }

    /// An edit made at once with its single command (`COLLIMATE_SYSTRAP_BATCH=0`).
    fn single(&mut self, f: impl FnOnce(&mut Stub) -> crate::platform::systrap::Result<()>) -> Result<(), Errno> {
        let r = f(self.stub.get_mut());
        r.map_err(|e| self.errno(e))
    }
}

/// Whether `COLLIMATE_SYSTRAP_BATCH=0` asks for one command per edit (each batch of one call
/// made with the single commands), to compare.
pub(super) fn off() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var_os("COLLIMATE_SYSTRAP_BATCH").is_some_and(|v| v == "0"))
}

impl HostSpace for Batched<'_> {
    fn read(&self, va: u64, buf: &mut [u8]) -> Result<(), Errno> {
        self.flush()?;
        let r = self.stub.borrow().read(va, buf);
        r.map_err(|e| self.errno(e))
    }

    fn write(&mut self, va: u64, data: &[u8]) -> Result<(), Errno> {
        if off() || self.batch.get_mut().is_empty() {
            self.flush()?;
            let r = self.stub.get_mut().write(va, data);
            return r.map_err(|e| self.errno(e));
        }
        self.writes.get_mut().push((va, data.to_vec()));
        Ok(())
    }

    fn map(&mut self, va: u64, len: u64, prot: u32, flags: u32, file: Option<(i32, u64)>) -> Result<(), Errno> {
        let (fd, offset) = match file {
            // SAFETY: the descriptor is the caller's and open for the length of this call
            // (`HostSpace::map`'s contract); the batch takes a copy of it now.
            Some((fd, off)) => (Some(unsafe { BorrowedFd::borrow_raw(fd) }), off),
            None => (None, 0),
        };
        if off() {
            return self.single(|s| s.map(va, len, prot as i32, flags as i32, fd, offset));
        }
        self.queue((va, len), fd, |b| b.map(va, len, prot as i32, flags as i32, fd, offset))
    }

    fn unmap(&mut self, va: u64, len: u64) -> Result<(), Errno> {
        if off() {
            return self.single(|s| s.unmap(va, len));
        }
        self.queue((va, len), None, |b| b.unmap(va, len))
    }

    fn protect(&mut self, va: u64, len: u64, prot: u32) -> Result<(), Errno> {
        if off() {
            return self.single(|s| s.protect(va, len, prot as i32));
        }
        self.queue((va, len), None, |b| b.protect(va, len, prot as i32))
    }

    fn budget(&self) -> u64 {
        self.budget
    }

    fn reserved(&self) -> (u64, u64) {
        Stub::reserved_range()
    }
}
