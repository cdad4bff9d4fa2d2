//! Confinement of a stub process: what it may reach besides the syscalls the filter admits.
//!
//! Applied by the new process between its creation and its jump into the blob (see [`Stub::spawn`]).

/// What the VMM asks of a new stub's confinement.
#[derive(Debug, Clone)]
pub struct Confinement {
    /// The host uid and gid the stub runs as when the VMM is root (default 65534, nobody).
    pub uid: u32,
    /// See `uid`.
    pub gid: u32,
    /// RLIMIT_NPROC: counted per user over the whole host (every stub runs as `uid`), so it bounds
    /// all stubs together; forks of stubs need room (default 4096).
    pub max_processes: u64,
    /// RLIMIT_AS: bounds the address space a guest can grab by calling into the blob behind the
    /// VMM's back (`None`: unbounded; guest memory is usually bounded where it is created).
    pub address_space: Option<u64>,
    /// Create the namespaces where the host allows them (default true).
    pub namespaces: bool,
}

impl Default for Confinement {
    fn default() -> Self {
        Confinement { uid: 65534, gid: 65534, max_processes: 4096, address_space: None, namespaces: true }
    }
}

/// What the host granted a stub.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ConfinementReport {
    /// New mount namespace with an empty tmpfs as root (no host file reachable by path).
    pub mount_ns: bool,
    /// New network namespace (no interfaces but a down loopback).
    pub net_ns: bool,
    /// New IPC namespace (no host SysV IPC or POSIX message queues).
    pub ipc_ns: bool,
    /// New UTS namespace.
    pub uts_ns: bool,
    /// New user namespace (capabilities in it dropped; no uid mapping).
    pub user_ns: bool,
    /// Runs as the unprivileged `Confinement::uid` (false when the VMM itself was not root and the
    /// stub keeps the VMM's uid).
    pub unprivileged_uid: bool,
    /// `cpuid` traps (CPUID faulting). Without it the guest's `cpuid` runs natively and sees the
    /// host CPU, so output that depends on CPU features may differ between hosts.
    pub cpuid_faulting: bool,
}
