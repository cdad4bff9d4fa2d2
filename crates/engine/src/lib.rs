//! collimate-engine: KVM sandboxes that fork in about a millisecond.
//!
//! A guest program runs in ring 3 of a long-mode KVM guest with no guest kernel; this crate plays the
//! kernel. Each guest lives in its own VMM process ([`vmm`]); the caller holds a [`Vm`] handle
//! ([`controller`]) and talks to it over a Unix socket ([`channel`]). Guest memory is a file mapped
//! `MAP_PRIVATE | MAP_NORESERVE` ([`vstate::memory`]), so a clone is a host `fork()` of a paused VMM
//! process followed by a new KVM VM over the inherited mapping and a restore of the vCPU state
//! ([`vstate::vcpu`]). Snapshots are a state file plus a raw memory file ([`persist`]).

pub mod arch;
pub mod channel;
pub mod controller;
pub mod egress;
pub mod error;
pub mod guestos;
pub mod loader;
pub mod overlay;
pub mod persist;
pub mod platform;
pub mod protocol;
pub mod quota;
pub mod trace;
pub mod vmm;
pub mod vstate;

pub use controller::{Launcher, Vm, VmConfig};
pub use error::{Error, Result};
pub use protocol::{GuestUser, JailStatus, MemStats, Platform, ResetStats, RunExit, RunResult, SpawnSpec};
pub use vstate::vcpu::VcpuState;
