//! New stubs as forks of a parked, empty template stub instead of clones of the VMM.
//!
//! [`Stub::spawn`] clones the VMM process (its page tables are copied, then thrown away by the
//! boot's unmapping) and builds the stub's namespaces, an empty root and its credentials: several
//! milliseconds on a nested host, most of it the namespaces (benches/systrap.rs). A [`Template`]
//! does that once; each [`Template::spawn`] forks the template's stub, parked at its boot trap with
//! nothing mapped outside the reserved range, so the fork copies a few pages and the new stub is
//! exactly what `Stub::spawn` returns: empty, parked, no guest context.
//!
//! What differs from `Stub::spawn`: the stubs of one template share its namespaces (mount, network,
//! IPC, UTS, user; all empty, and reachable by none of the syscalls the filter admits from the
//! blob), and a stub is a child of the template's process, not of the caller: it gets no
//! `PR_SET_PDEATHSIG`; it is killed when its handle is dropped, or ends at its next wait after
//! the VMM's end of its socket closes (see [`Stub::fork`]). The template itself is a child of the
//! thread that made it and dies with that thread; a spawn after that makes a new template.

use super::{Confinement, Result, Stub};

/// A parked empty stub that new stubs are forked from. See the module docs.
#[derive(Debug)]
pub struct Template {
    conf: Confinement,
    stub: Stub,
}

impl Template {
    /// Spawn the template stub with `conf` (every stub forked from it has that confinement). Call it
    /// from a thread that lives as long as the template is used.
    pub fn new(conf: &Confinement) -> Result<Template> {
        Ok(Template { conf: conf.clone(), stub: Stub::spawn(conf)? })
    }

    /// A new empty stub, parked, as from [`Stub::spawn`] with the template's confinement. When the
    /// template's process is gone (its thread exited), a new template is spawned first.
    pub fn spawn(&mut self) -> Result<Stub> {
        match self.stub.fork() {
            Ok(s) => Ok(s),
            Err(_) if !self.stub.alive() => {
                self.stub = Stub::spawn(&self.conf)?;
                self.stub.fork()
            }
            Err(e) => Err(e),
        }
    }

    /// The confinement of the stubs this template makes.
    pub fn confinement(&self) -> &Confinement {
        &self.conf
    }
}
