//! The crate's error type, shared by the controller and the VMM process.
//!
//! Errors raised inside a VMM process travel back to the controller as a [`crate::protocol::RemoteError`]
//! and are turned back into the same variant here, so a caller matches on one enum.

use serde::{Deserialize, Serialize};

/// Result alias used throughout the engine.
pub type Result<T> = std::result::Result<T, Error>;

/// Everything that can go wrong in the engine. The message says what failed and what to do.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// `/dev/kvm` could not be opened: the host needs KVM and the caller needs access to it.
    #[error("cannot open /dev/kvm ({0}); run on a KVM host as a user with access to /dev/kvm")]
    KvmUnavailable(#[source] kvm_ioctls::Error),
    /// A KVM ioctl failed.
    #[error("KVM {op} failed: {source}")]
    Kvm {
        op: &'static str,
        #[source]
        source: kvm_ioctls::Error,
    },
    /// A host system call failed.
    #[error("{op} failed: {source}")]
    Sys {
        op: &'static str,
        #[source]
        source: std::io::Error,
    },
    /// The guest program image could not be loaded.
    #[error("cannot load guest program: {0}")]
    Image(String),
    /// The guest ran out of guest-physical memory.
    #[error("guest memory exhausted ({0}); give the VM more memory (mem_size)")]
    OutOfGuestMemory(String),
    /// A guest virtual address was not mapped.
    #[error("guest address {0:#x} is not mapped")]
    BadGuestAddress(u64),
    /// The snapshot file is damaged: truncated, bit-flipped or not a snapshot at all.
    #[error("snapshot {path} is damaged: {reason}; re-create it (bake the template again)")]
    SnapshotCorrupt { path: String, reason: String },
    /// The snapshot was written by a different, incompatible engine version.
    #[error("snapshot {path} has format version {found}, this engine reads version {expected}; re-create it with this engine")]
    SnapshotVersion { path: String, found: u32, expected: u32 },
    /// Reset was asked of a VM that has no clean reset point.
    /// The snapshot's CPU template asks for what this host's CPU cannot give
    /// (`arch::x86_64::cpuid`).
    #[error("snapshot {path} cannot run on this host: {reason}")]
    HostCpu { path: String, reason: String },

    #[error("cannot reset: {0}")]
    ResetUnavailable(String),
    /// An argument was out of range.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The VMM process died or stopped answering.
    #[error("VMM process {pid} is gone ({reason}); the sandbox is lost, create a new one")]
    VmmDied { pid: i32, reason: String },
    /// The VMM process answered something the protocol does not allow.
    #[error("protocol error talking to VMM process: {0}")]
    Protocol(String),
    /// An error reported by the VMM process that has no more specific variant.
    #[error("{0}")]
    Remote(String),
    /// The VM was already destroyed.
    #[error("the VM was destroyed; create or clone a new one")]
    Destroyed,
}

impl Error {
    pub(crate) fn sys(op: &'static str) -> impl FnOnce(std::io::Error) -> Error {
        move |source| Error::Sys { op, source }
    }

    pub(crate) fn kvm(op: &'static str) -> impl FnOnce(kvm_ioctls::Error) -> Error {
        move |source| Error::Kvm { op, source }
    }

    pub(crate) fn last_os(op: &'static str) -> Error {
        Error::Sys { op, source: std::io::Error::last_os_error() }
    }
}

/// An error as it crosses the process boundary: the variant is kept so the controller can rebuild it.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RemoteError {
    SnapshotCorrupt { path: String, reason: String },
    SnapshotVersion { path: String, found: u32, expected: u32 },
    HostCpu { path: String, reason: String },
    ResetUnavailable(String),
    InvalidArgument(String),
    BadGuestAddress(u64),
    OutOfGuestMemory(String),
    Image(String),
    KvmUnavailable(String),
    Other(String),
}

impl From<&Error> for RemoteError {
    fn from(e: &Error) -> Self {
        match e {
            Error::SnapshotCorrupt { path, reason } => {
                RemoteError::SnapshotCorrupt { path: path.clone(), reason: reason.clone() }
            }
            Error::SnapshotVersion { path, found, expected } => {
                RemoteError::SnapshotVersion { path: path.clone(), found: *found, expected: *expected }
            }
            Error::HostCpu { path, reason } => RemoteError::HostCpu { path: path.clone(), reason: reason.clone() },
            Error::ResetUnavailable(s) => RemoteError::ResetUnavailable(s.clone()),
            Error::InvalidArgument(s) => RemoteError::InvalidArgument(s.clone()),
            Error::BadGuestAddress(a) => RemoteError::BadGuestAddress(*a),
            Error::OutOfGuestMemory(s) => RemoteError::OutOfGuestMemory(s.clone()),
            Error::Image(s) => RemoteError::Image(s.clone()),
            Error::KvmUnavailable(_) => RemoteError::KvmUnavailable(e.to_string()),
            other => RemoteError::Other(other.to_string()),
        }
    }
}

impl From<RemoteError> for Error {
    fn from(e: RemoteError) -> Self {
        match e {
            RemoteError::SnapshotCorrupt { path, reason } => Error::SnapshotCorrupt { path, reason },
            RemoteError::SnapshotVersion { path, found, expected } => {
                Error::SnapshotVersion { path, found, expected }
            }
            RemoteError::HostCpu { path, reason } => Error::HostCpu { path, reason },
            RemoteError::ResetUnavailable(s) => Error::ResetUnavailable(s),
            RemoteError::InvalidArgument(s) => Error::InvalidArgument(s),
            RemoteError::BadGuestAddress(a) => Error::BadGuestAddress(a),
            RemoteError::OutOfGuestMemory(s) => Error::OutOfGuestMemory(s),
            RemoteError::Image(s) => Error::Image(s),
            RemoteError::KvmUnavailable(s) | RemoteError::Other(s) => Error::Remote(s),
        }
    }
}
