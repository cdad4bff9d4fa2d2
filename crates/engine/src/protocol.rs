//! Messages between the controller and a VMM process.

use std::path::PathBuf;
use std::time::Duration;

use kvm_bindings::kvm_regs;
use serde::{Deserialize, Serialize};

use crate::error::RemoteError;
use crate::vstate::vcpu::VcpuState;

/// How an agent call reseeds the guest first (see `Request::AgentCall`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct ExecSeed {
    pub seed: [u8; 32],
    /// Switch the clocks to virtual time (`guestos::random::reseed`).
    pub replay: bool,
    /// Virtual REALTIME starts at least here (nanoseconds since the epoch): the host's wall clock
    /// for a sandbox with a network, a recording's for its replay (docs/replay.md). None: where
    /// the guest last saw it.
    pub wall_clock_ns: Option<u64>,
}

#[derive(Debug, Serialize, Deserialize)]
pub enum Request {
    /// First message to a launched VMM process: load an ELF into a new VM.
    Boot { elf: Vec<u8>, mem_size: u64 },
    /// First message to a launched VMM process: run a Linux program from a root filesystem, on
    /// `platform` (a KVM `Machine`, or a systrap stub: `vmm::systrap::serve`).
    Spawn {
        spec: SpawnSpec,
        mem_size: u64,
        cpus: Option<u32>,
        #[serde(default)]
        platform: Platform,
    },
    /// First message to a launched VMM process: restore a snapshot directory.
    Restore { dir: PathBuf },
    Run { timeout: Duration },
    Snapshot { dir: PathBuf },
    /// Fork this paused VMM process into `n` children; the reply carries, per child, its channel and
    /// a pidfd.
    Fork { n: u32 },
    /// Replace the guest's stdout and stderr with the two pipe write ends attached to this message
    /// (every descriptor of the guest that referred to the old ones). A third descriptor, if
    /// attached, is the sandbox's broker socket (`crate::egress`): sent once to each new sandbox.
    SetStdio,
    /// Keep `n` pre-forked children ready so that `Fork` answers without creating a VM.
    SparePool { n: u32 },
    /// The attached descriptors are detached tmpfs instances (`crate::quota`), one per child to
    /// come: every fork and spare made from now on takes one for its writable mounts (its disk
    /// quota), and none is made without. The controller sends as many as it will ask children for.
    AddScratch,
    /// Whether the sandboxes forked from now on have a writable root (`crate::overlay`: the image
    /// under a copy-up layer on each one's tmpfs). When on, the descriptors with `Fork`,
    /// `SparePool` and `AddScratch` come in threes (disk, shared memory, an overlay context), and
    /// a `Reset` of such a sandbox carries a context for its fresh root. Drops the spares.
    WritableRoot { on: bool },
    Reset,
    /// `Reset` that keeps the sandbox's writable mounts (/tmp, /work, ... as they are now): a
    /// fresh agent from the template over the files the sandbox has (an interpreter that had to
    /// be given up after a timeout).
    ResetKeepFiles,
    /// Queue `input` for the in-guest agent (its fd 3) and run until the agent waits for more (the
    /// run ends with `Yield { value: AGENT_IDLE_YIELD }`); the result carries what it wrote.
    /// With `reseed`, the sandbox CRNG is reseeded first (as `Reseed`): one round trip per exec.
    AgentCall { input: Vec<u8>, timeout: Duration, reseed: Option<ExecSeed> },
    /// After an `AgentCall` that timed out: SIGKILL every guest process that exec started (the
    /// sandbox's first process, the agent, excepted; files and the agent's memory are kept), send
    /// the agent guest signal `signal` if it is not 0 (SIGINT ends a code exec's Python with
    /// KeyboardInterrupt), and run until the agent waits for its next request, as `AgentCall`
    /// does, for at most `timeout`.
    EndExec { signal: i32, timeout: Duration },
    /// Write a file into a Linux guest's file system (writable mounts only), byte-exact; parent
    /// directories are created.
    Upload { path: String, data: Vec<u8>, mode: u32 },
    /// Open a regular file of a Linux guest's file system, at most `max` bytes long, for the
    /// controller to read: the reply (`FileFd`) carries the open file, so its bytes are neither
    /// copied in the VMM nor framed on the channel.
    Download { path: String, max: u64 },
    /// Reseed a Linux guest's sandbox CRNG with `seed` (32 bytes) and, with `replay`, switch its
    /// clocks to deterministic virtual time (see `guestos::random::reseed` and docs/replay.md).
    Reseed { seed: [u8; 32], replay: bool },
    ReadMem { gva: u64, len: u64 },
    WriteMem { gva: u64, data: Vec<u8> },
    GetRegs,
    SetRegs(kvm_regs),
    VcpuState,
    MemStats,
    Shutdown,
}

/// What runs a sandbox's guest processes (docs/platforms.md): KVM, or systrap (each guest process
/// a confined host process whose syscalls trap to the VMM).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub enum Platform {
    #[default]
    Kvm,
    Systrap,
}

impl Platform {
    /// Its name as users write it: "kvm" or "systrap".
    pub fn name(self) -> &'static str {
        match self {
            Platform::Kvm => "kvm",
            Platform::Systrap => "systrap",
        }
    }
}

impl std::str::FromStr for Platform {
    type Err = crate::error::Error;

    fn from_str(s: &str) -> Result<Platform, Self::Err> {
        match s {
            "kvm" => Ok(Platform::Kvm),
            "systrap" => Ok(Platform::Systrap),
            other => Err(crate::error::Error::InvalidArgument(format!(
                "unknown platform {other:?}; use \"kvm\" (a VM per guest process, needs /dev/kvm) or \"systrap\" \
                 (each guest process a confined host process under a trap-everything seccomp filter)"
            ))),
        }
    }
}

impl std::fmt::Display for Platform {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A Linux program to run in a sandbox.
#[derive(Debug, Clone, Default, Serialize, Deserialize)]
pub struct SpawnSpec {
    /// Host directory holding the sandbox's root filesystem (read-only to the guest).
    pub root: PathBuf,
    /// Host directories that appear writable at guest paths, e.g. ("/tmp", <dir>), ("/work", <dir>).
    pub mounts: Vec<(String, PathBuf)>,
    /// argv[0] is the program's guest path (resolved from `cwd`).
    pub argv: Vec<Vec<u8>>,
    pub envp: Vec<Vec<u8>>,
    pub cwd: String,
    /// Host directories that appear read-only at guest paths (e.g. the agent's code).
    #[serde(default)]
    pub ro_mounts: Vec<(String, PathBuf)>,
    /// Give the program fd 3 as the agent channel (see `Request::AgentCall`).
    #[serde(default)]
    pub agent: bool,
    /// The identity the program starts with (a container image's User); None: root.
    #[serde(default)]
    pub user: Option<GuestUser>,
}

/// A guest process identity: real, effective, saved and file-system ids all start at these.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct GuestUser {
    pub uid: u32,
    pub gid: u32,
    /// Supplementary groups.
    #[serde(default)]
    pub groups: Vec<u32>,
}

impl Request {
    /// Whether serving this request can change the guest (memory, vCPU or runtime state).
    pub fn changes_guest(&self) -> bool {
        matches!(
            self,
            Request::Run { .. }
                | Request::Reset
                | Request::ResetKeepFiles
                | Request::WriteMem { .. }
                | Request::SetRegs(_)
                | Request::SetStdio
                | Request::Upload { .. }
                | Request::Reseed { .. }
                | Request::AgentCall { .. }
                | Request::EndExec { .. }
                | Request::WritableRoot { .. }
        )
    }
}

#[derive(Debug, Serialize, Deserialize)]
pub enum Response {
    Ok,
    /// Sent by a new VMM process (launched or forked) once its VM is ready to run.
    Ready { pid: i32, linux: bool, jail: JailStatus },
    Run(RunResult),
    Forked { pids: Vec<i32> },
    Reset(ResetStats),
    Mem(Vec<u8>),
    /// The file a `Download` opened is attached (one descriptor); `size` is its length when opened.
    FileFd { size: u64 },
    Regs(kvm_regs),
    VcpuState(Box<VcpuState>),
    MemStats(MemStats),
    Err(RemoteError),
}

/// Most output one run keeps per stream (stdout, stderr); the rest is dropped and the run's result
/// says so (`RunResult::truncated`).
pub const OUTPUT_CAP: usize = 16 << 20;

/// Why a run stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunExit {
    /// The guest called exit or exit_group.
    Exited { code: i32 },
    /// The guest called the yield hypercall (syscall 0x4000_0000, rdi = value). Resumable.
    Yield { value: u64 },
    /// The guest executed `out` on a port. Resumable.
    Io { port: u16, value: u32 },
    /// The guest raised an exception it cannot handle. The vCPU is left at the faulting instruction.
    Fault { vector: u8, error_code: u64, rip: u64, cr2: u64 },
    /// The time budget ran out; the host stopped the vCPU. Resumable.
    Timeout,
    /// The guest triple-faulted.
    Shutdown,
    /// A Linux guest's process was killed by signal `signo` (its default action, or a fault it has
    /// no handler for). Final, like `Exited`.
    Signaled { signo: i32 },
}

#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RunResult {
    pub exit: RunExit,
    pub stdout: Vec<u8>,
    pub stderr: Vec<u8>,
    pub duration: Duration,
    /// Syscalls the engine does not service (answered -ENOSYS) during this run.
    pub enosys: u64,
    /// Output beyond the cap was dropped.
    pub truncated: bool,
    /// What the in-guest agent wrote to its channel during this run.
    #[serde(default)]
    pub agent: Vec<u8>,
    /// Guest processes of the sandbox other than its first one still alive when the run ended
    /// (background jobs): the controller gives the next run fresh stdout/stderr pipes, so their
    /// later output does not land in it.
    #[serde(default)]
    pub others: u32,
    /// In replay mode: a thread switch during this run was made by the wall clock (a thread that
    /// ran without a syscall for longer than the guard), so a replay may interleave differently.
    #[serde(default)]
    pub nondeterministic: bool,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct ResetStats {
    pub dirty_pages: u64,
    pub duration: Duration,
}

/// Which layers of its jail a VMM process runs in (see `vmm::jail`); forks inherit their parent's.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct JailStatus {
    /// Resource limits: open files, file size, no core dumps.
    pub rlimits: bool,
    /// Its own mount namespace, holding only the sandbox's directories, and an empty network
    /// namespace. Needs CAP_SYS_ADMIN; without it the other layers still apply.
    pub namespaces: bool,
    /// The seccomp allow-list.
    pub seccomp: bool,
}

#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
pub struct MemStats {
    /// Private (not shared with any other process or file) resident memory of the VMM process.
    pub private_bytes: u64,
    /// Guest pages this VM has written since its memory was mapped (or last reset).
    pub dirty_pages: u64,
}
