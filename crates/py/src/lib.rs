//! `collimate_core._core`: the thin PyO3 layer over `collimate_engine`.
//!
//! This crate only converts arguments, releases the GIL around every engine call and maps engine
//! errors onto a small exception tree. Anything with behaviour belongs in the engine crate.

use std::collections::HashMap;
use std::path::PathBuf;
use std::sync::{Mutex, MutexGuard, OnceLock, PoisonError};
use std::time::Duration;

use collimate_engine::{Launcher, RunExit, VmConfig};
use kvm_bindings::kvm_regs;
use pyo3::create_exception;
use pyo3::exceptions::{PyException, PyValueError};
use pyo3::prelude::*;
use pyo3::pybacked::PyBackedBytes;
use pyo3::types::{PyBytes, PyDict, PyType};

create_exception!(
    collimate_core._core,
    CollimateError,
    PyException,
    "Base class of every error raised by collimate_core."
);
create_exception!(
    collimate_core._core,
    EngineError,
    CollimateError,
    "The engine (a VMM process, KVM or the host) failed to carry out an operation."
);
create_exception!(
    collimate_core._core,
    SnapshotError,
    CollimateError,
    "A snapshot directory cannot be used: corrupt, truncated, or written by another format version."
);
create_exception!(
    collimate_core._core,
    VmDestroyedError,
    CollimateError,
    "The Vm was destroyed (destroy() or the end of a with-block); it can no longer be used."
);

/// Why a call into the engine failed, before it is turned into a Python exception (which needs no
/// GIL to build, but keeping the two apart keeps the closures given to `detach` free of PyO3 types).
enum Failure {
    Destroyed,
    Engine(collimate_engine::Error),
}

impl From<collimate_engine::Error> for Failure {
    fn from(err: collimate_engine::Error) -> Self {
        Failure::Engine(err)
    }
}

impl Failure {
    /// `op` names the Python-level call, e.g. `Vm.restore('/tmp/snap')`.
    fn into_pyerr(self, op: &str) -> PyErr {
        match self {
            Failure::Destroyed => VmDestroyedError::new_err(format!(
                "{op}: this Vm was destroyed; create a new one with Vm.boot(), Vm.restore() or clone()"
            )),
            Failure::Engine(err) => engine_error(op, err),
        }
    }
}

/// Maps an engine error onto the exception tree. The engine's messages already say what to do; this
/// adds which Python call failed.
fn engine_error(op: &str, err: collimate_engine::Error) -> PyErr {
    use collimate_engine::Error as E;
    match err {
        E::SnapshotCorrupt { .. } | E::SnapshotVersion { .. } | E::HostCpu { .. } => {
            SnapshotError::new_err(format!("{op}: {err}"))
        }
        E::Destroyed => Failure::Destroyed.into_pyerr(op),
        other => EngineError::new_err(format!("{op}: {other}")),
    }
}

/// The names of the general-purpose registers as `regs()` reports them, in `kvm_regs` order.
const REG_NAMES: [&str; 18] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rsp", "rbp", "r8", "r9", "r10", "r11", "r12", "r13",
    "r14", "r15", "rip", "rflags",
];

fn reg_slot<'a>(regs: &'a mut kvm_regs, name: &str) -> Option<&'a mut u64> {
    Some(match name {
        "rax" => &mut regs.rax,
        "rbx" => &mut regs.rbx,
        "rcx" => &mut regs.rcx,
        "rdx" => &mut regs.rdx,
        "rsi" => &mut regs.rsi,
        "rdi" => &mut regs.rdi,
        "rsp" => &mut regs.rsp,
        "rbp" => &mut regs.rbp,
        "r8" => &mut regs.r8,
        "r9" => &mut regs.r9,
        "r10" => &mut regs.r10,
        "r11" => &mut regs.r11,
        "r12" => &mut regs.r12,
        "r13" => &mut regs.r13,
        "r14" => &mut regs.r14,
        "r15" => &mut regs.r15,
        "rip" => &mut regs.rip,
        "rflags" => &mut regs.rflags,
        _ => return None,
    })
}

static LAUNCHER: OnceLock<Launcher> = OnceLock::new();

/// The VMM process is a fresh interpreter (the one running us) that loads this extension module
/// by its file path and calls `_vmm_main()`. Only the extension is loaded, not the package: every
/// module and mapping in the VMM is copied by each fork of a sandbox and torn down by each exit, so
/// the VMM stays as small as an interpreter can be (about 47 mappings instead of about 180).
/// `-I -S` keep user site-packages, `PYTHON*` variables and `.pth` files out of it; the
/// extension's path is passed as `argv[1]` (no quoting).
fn launcher(py: Python<'_>) -> PyResult<&'static Launcher> {
    if let Some(launcher) = LAUNCHER.get() {
        return Ok(launcher);
    }
    let executable: Option<PathBuf> = py.import("sys")?.getattr("executable")?.extract()?;
    let executable = executable.filter(|p| !p.as_os_str().is_empty()).ok_or_else(|| {
        EngineError::new_err(
            "cannot start a VMM process: sys.executable is empty, so this interpreter cannot \
             start another one; run collimate_core from a regular python executable",
        )
    })?;
    let module = py.import("collimate_core._core")?;
    let path: PathBuf = module.getattr("__file__")?.extract()?;
    let args = vec![
        "-I".into(),
        "-S".into(),
        "-c".into(),
        "import sys, importlib.util as u; \
         s = u.spec_from_file_location('collimate_core._core', sys.argv[1]); \
         m = u.module_from_spec(s); s.loader.exec_module(m); m._vmm_main()"
            .into(),
        path.into_os_string(),
    ];
    Ok(LAUNCHER.get_or_init(|| Launcher::new(executable, args)))
}

/// Entry point of a VMM process: serves the channel on fd 3, then exits the process.
#[pyfunction]
fn _vmm_main() {
    collimate_engine::vmm::serve_fd(3);
}

/// The outcome of one `Vm.run()`.
#[pyclass(module = "collimate_core._core", frozen, get_all)]
struct RunResult {
    /// "exited", "signaled", "yield", "io", "fault", "timeout" or "shutdown".
    kind: &'static str,
    /// Exit status of `exit`/`exit_group` ("exited").
    code: Option<i32>,
    /// The signal that killed a Linux guest's process ("signaled").
    signal: Option<i32>,
    /// The yielded value ("yield") or the value written by `out` ("io").
    value: Option<u64>,
    port: Option<u16>,
    vector: Option<u8>,
    error_code: Option<u64>,
    rip: Option<u64>,
    cr2: Option<u64>,
    stdout: Py<PyBytes>,
    stderr: Py<PyBytes>,
    /// Wall-clock seconds the guest ran for.
    duration: f64,
    /// Syscalls the engine does not service (answered -ENOSYS) during this run.
    enosys: u64,
    /// Output beyond the cap (16 MiB per stream) was dropped.
    truncated: bool,
    /// What the in-guest agent wrote to its channel during this run.
    agent: Py<PyBytes>,
    /// In replay mode: a thread switch was made by the wall clock, so a replay may differ.
    nondeterministic: bool,
}

impl RunResult {
    fn new(py: Python<'_>, result: collimate_engine::RunResult) -> Self {
        let mut out = RunResult {
            kind: "",
            code: None,
            signal: None,
            value: None,
            port: None,
            vector: None,
            error_code: None,
            rip: None,
            cr2: None,
            stdout: PyBytes::new(py, &result.stdout).unbind(),
            stderr: PyBytes::new(py, &result.stderr).unbind(),
            duration: result.duration.as_secs_f64(),
            enosys: result.enosys,
            truncated: result.truncated,
            agent: PyBytes::new(py, &result.agent).unbind(),
            nondeterministic: result.nondeterministic,
        };
        match result.exit {
            RunExit::Exited { code } => {
                out.kind = "exited";
                out.code = Some(code);
            }
            RunExit::Yield { value } => {
                out.kind = "yield";
                out.value = Some(value);
            }
            RunExit::Io { port, value } => {
                out.kind = "io";
                out.port = Some(port);
                out.value = Some(u64::from(value));
            }
            RunExit::Fault { vector, error_code, rip, cr2 } => {
                out.kind = "fault";
                out.vector = Some(vector);
                out.error_code = Some(error_code);
                out.rip = Some(rip);
                out.cr2 = Some(cr2);
            }
            RunExit::Timeout => out.kind = "timeout",
            RunExit::Shutdown => out.kind = "shutdown",
            RunExit::Signaled { signo } => {
                out.kind = "signaled";
                out.signal = Some(signo);
            }
        }
        out
    }
}

#[pymethods]
impl RunResult {
    fn __repr__(&self, py: Python<'_>) -> String {
        let mut parts = vec![format!("kind={:?}", self.kind)];
        let hex = |name: &str, v: Option<u64>| v.map(|v| format!("{name}={v:#x}"));
        parts.extend(self.code.map(|c| format!("code={c}")));
        parts.extend(self.signal.map(|s| format!("signal={s}")));
        parts.extend(self.port.map(|p| format!("port={p:#x}")));
        parts.extend(self.value.map(|v| format!("value={v}")));
        parts.extend(self.vector.map(|v| format!("vector={v}")));
        parts.extend(hex("error_code", self.error_code));
        parts.extend(hex("rip", self.rip));
        parts.extend(hex("cr2", self.cr2));
        for (name, buf) in [("stdout", &self.stdout), ("stderr", &self.stderr)] {
            let buf = buf.as_bytes(py);
            if !buf.is_empty() {
                parts.push(format!("{name}={}", bytes_repr(buf, 60)));
            }
        }
        if self.truncated {
            parts.push("truncated=True".to_string());
        }
        if self.enosys > 0 {
            parts.push(format!("enosys={}", self.enosys));
        }
        parts.push(format!("duration={:.6}", self.duration));
        format!("RunResult({})", parts.join(", "))
    }
}

/// A Python-style `b'...'` literal of at most `limit` bytes of `buf`.
fn bytes_repr(buf: &[u8], limit: usize) -> String {
    let mut s = String::from("b'");
    for &b in buf.iter().take(limit) {
        match b {
            b'\\' => s.push_str("\\\\"),
            b'\'' => s.push_str("\\'"),
            b'\n' => s.push_str("\\n"),
            b'\r' => s.push_str("\\r"),
            b'\t' => s.push_str("\\t"),
            0x20..=0x7e => s.push(char::from(b)),
            _ => s.push_str(&format!("\\x{b:02x}")),
        }
    }
    s.push('\'');
    if buf.len() > limit {
        s.push_str(&format!("...({} bytes)", buf.len()));
    }
    s
}

/// A handle to one VMM process (one guest).
///
/// The engine `Vm` lives behind a mutex so that `destroy()` can take it out while other Python
/// threads still hold the object; every engine call runs with the GIL released.
#[pyclass(name = "Vm", module = "collimate_core._core", frozen)]
struct PyVm {
    inner: Mutex<Option<collimate_engine::Vm>>,
    /// The sandbox's network state (policy, flows, log): reached without the Vm's lock, so a
    /// policy change or a usage report never waits for an exec that is running.
    net: std::sync::Arc<collimate_engine::egress::SandboxNet>,
}

impl PyVm {
    fn wrap(vm: collimate_engine::Vm) -> Self {
        let net = vm.net();
        PyVm { inner: Mutex::new(Some(vm)), net }
    }

    fn lock(&self) -> MutexGuard<'_, Option<collimate_engine::Vm>> {
        // A panic in the engine surfaces as a PanicException; the handle stays usable (or
        // destroyable) afterwards rather than poisoning every later call.
        self.inner.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Runs `f` on the engine Vm with the GIL released.
    fn with<T, F>(&self, py: Python<'_>, op: &str, f: F) -> PyResult<T>
    where
        T: Send,
        F: Send + FnOnce(&mut collimate_engine::Vm) -> Result<T, Failure>,
    {
        py.detach(|| {
            let mut guard = self.lock();
            let vm = guard.as_mut().ok_or(Failure::Destroyed)?;
            f(vm)
        })
        .map_err(|e| e.into_pyerr(op))
    }
}

impl Drop for PyVm {
    fn drop(&mut self) {
        let vm = self.inner.get_mut().unwrap_or_else(PoisonError::into_inner).take();
        if let Some(vm) = vm {
            // Nothing can report an error from a finalizer; the engine still kills and reaps.
            let _ = vm.destroy();
        }
    }
}

fn duration_from_secs(op: &str, secs: f64) -> PyResult<Duration> {
    Duration::try_from_secs_f64(secs).map_err(|_| {
        PyValueError::new_err(format!(
            "{op}: timeout must be a finite, non-negative number of seconds, got {secs}"
        ))
    })
}

#[pymethods]
impl PyVm {
    /// Starts a fresh VMM process and loads a static, non-PIE x86-64 ELF; paused until run().
    #[staticmethod]
    #[pyo3(signature = (elf, mem_size = 1 << 30), text_signature = "(elf, mem_size=1073741824)")]
    fn boot(py: Python<'_>, elf: PyBackedBytes, mem_size: u64) -> PyResult<PyVm> {
        let launcher = launcher(py)?;
        let cfg = VmConfig { mem_size, ..Default::default() };
        py.detach(|| collimate_engine::Vm::boot(launcher, &elf, &cfg))
            .map(PyVm::wrap)
            .map_err(|e| engine_error(&format!("Vm.boot(mem_size={mem_size})"), e))
    }

    /// Starts a fresh VMM process running the Linux program `argv[0]` from the root filesystem
    /// `root`, with writable host directories `mounts` ({guest path: host dir}); paused until run().
    /// `uid`/`gid`/`groups`: the identity it starts with (default root), e.g. an image's User.
    /// `cpus`: how many CPUs the guest sees (1 to 64; default `COLLIMATE_CPUS` or 1), fixed for
    /// the sandbox, its snapshots and forks; its threads still share one vCPU.
    /// `platform`: what runs it, "kvm" (a VM per guest process, the default) or "systrap" (each
    /// guest process a confined host process whose syscalls trap to the VMM; no snapshots yet).
    #[staticmethod]
    #[pyo3(signature = (root, argv, env = None, cwd = "/".to_string(), mounts = None, mem_size = 1 << 30, ro_mounts = None, agent = false, uid = None, gid = None, groups = None, cpus = None, platform = "kvm".to_string()))]
    #[allow(clippy::too_many_arguments)]
    fn spawn(
        py: Python<'_>,
        root: PathBuf,
        argv: Vec<String>,
        env: Option<HashMap<String, String>>,
        cwd: String,
        mounts: Option<HashMap<String, PathBuf>>,
        mem_size: u64,
        ro_mounts: Option<HashMap<String, PathBuf>>,
        agent: bool,
        uid: Option<u32>,
        gid: Option<u32>,
        groups: Option<Vec<u32>>,
        cpus: Option<u32>,
        platform: String,
    ) -> PyResult<PyVm> {
        if argv.is_empty() {
            return Err(PyValueError::new_err("Vm.spawn: argv is empty; argv[0] names the program"));
        }
        let platform: collimate_engine::Platform =
            platform.parse().map_err(|e: collimate_engine::Error| PyValueError::new_err(format!("Vm.spawn: {e}")))?;
        let launcher = launcher(py)?;
        let mut envp: Vec<Vec<u8>> = env
            .unwrap_or_default()
            .into_iter()
            .map(|(k, v)| format!("{k}={v}").into_bytes())
            .collect();
        envp.sort();
        let spec = collimate_engine::SpawnSpec {
            root,
            mounts: mounts.unwrap_or_default().into_iter().collect(),
            argv: argv.iter().map(|a| a.clone().into_bytes()).collect(),
            envp,
            cwd,
            ro_mounts: ro_mounts.unwrap_or_default().into_iter().collect(),
            agent,
            user: (uid.is_some() || gid.is_some() || groups.is_some()).then(|| collimate_engine::GuestUser {
                uid: uid.unwrap_or(0),
                gid: gid.unwrap_or(0),
                groups: groups.unwrap_or_default(),
            }),
        };
        let cfg = VmConfig { mem_size, cpus, platform };
        py.detach(|| collimate_engine::Vm::spawn(launcher, &spec, &cfg))
            .map(PyVm::wrap)
            .map_err(|e| engine_error(&format!("Vm.spawn({:?})", argv[0]), e))
    }

    /// Starts a fresh VMM process from a snapshot directory: a kvm one (`vm.state`, `vm.mem`) or a
    /// systrap one (`systrap.state`, `systrap.mem`), on the platform it was taken on.
    #[staticmethod]
    fn restore(py: Python<'_>, dir: PathBuf) -> PyResult<PyVm> {
        let launcher = launcher(py)?;
        py.detach(|| collimate_engine::Vm::restore(launcher, &dir))
            .map(PyVm::wrap)
            .map_err(|e| engine_error(&format!("Vm.restore({:?})", dir.display().to_string()), e))
    }

    fn run(&self, py: Python<'_>, timeout: f64) -> PyResult<RunResult> {
        let timeout = duration_from_secs("Vm.run", timeout)?;
        let result = self.with(py, "Vm.run", |vm| Ok(vm.run(timeout)?))?;
        Ok(RunResult::new(py, result))
    }

    fn snapshot(&self, py: Python<'_>, dir: PathBuf) -> PyResult<()> {
        let op = format!("Vm.snapshot({:?})", dir.display().to_string());
        self.with(py, &op, |vm| Ok(vm.snapshot(&dir)?))
    }

    fn fork(&self, py: Python<'_>, n: usize) -> PyResult<Vec<PyVm>> {
        let op = format!("Vm.fork({n})");
        let children = self.with(py, &op, |vm| Ok(vm.fork(n)?))?;
        Ok(children.into_iter().map(PyVm::wrap).collect())
    }

    /// Keep `n` pre-forked children of this paused VM ready so a fork costs only the hand-over
    /// (for template zygotes, which never run; any change to the guest discards them).
    fn set_spare_pool(&self, py: Python<'_>, n: usize) -> PyResult<()> {
        let op = format!("Vm.set_spare_pool({n})");
        self.with(py, &op, |vm| Ok(vm.set_spare_pool(n)?))
    }

    /// Give the sandboxes this VM (a template's zygote) forks from now on a writable root: the
    /// image under a copy-up layer in each one's disk quota. Drops its spare clones (set the spare
    /// pool again after). Without disk quotas (no CAP_SYS_ADMIN) the root stays read-only.
    fn set_writable_root(&self, py: Python<'_>, on: bool) -> PyResult<()> {
        let op = format!("Vm.set_writable_root({on})");
        self.with(py, &op, |vm| Ok(vm.set_writable_root(on)?))
    }

    /// What runs this VM's guest: "kvm" or "systrap" (its clones run on the same).
    #[getter]
    fn platform(&self, py: Python<'_>) -> PyResult<&'static str> {
        self.with(py, "Vm.platform", |vm| Ok(vm.platform().name()))
    }

    /// Whether the sandboxes of this VM have a writable root (`set_writable_root`).
    #[getter]
    fn writable_root(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, "Vm.writable_root", |vm| Ok(vm.writable_root()))
    }

    fn clone(&self, py: Python<'_>) -> PyResult<PyVm> {
        self.with(py, "Vm.clone", |vm| Ok(vm.clone_vm()?)).map(PyVm::wrap)
    }

    /// Returns the VM to the snapshot it was restored or cloned from; with `keep_files`, its
    /// writable mounts (/tmp, /work) stay as they are.
    #[pyo3(signature = (keep_files = false))]
    fn reset<'py>(&self, py: Python<'py>, keep_files: bool) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.with(py, "Vm.reset", |vm| Ok(if keep_files { vm.reset_keep_files()? } else { vm.reset()? }))?;
        let out = PyDict::new(py);
        out.set_item("dirty_pages", stats.dirty_pages)?;
        out.set_item("duration", stats.duration.as_secs_f64())?;
        Ok(out)
    }

    /// Sends `input` to the in-guest agent (its fd 3) and runs until the agent waits again; the
    /// result's `agent` holds its reply. With `seed` (32 bytes), the sandbox CRNG is reseeded
    /// first, as `reseed(seed, replay)` would, in the same round trip; with `wall_clock_ns` too,
    /// virtual REALTIME starts no earlier than that (nanoseconds since the epoch).
    #[pyo3(signature = (input, timeout, seed = None, replay = true, wall_clock_ns = None))]
    fn agent_call(&self, py: Python<'_>, input: PyBackedBytes, timeout: f64, seed: Option<PyBackedBytes>, replay: bool, wall_clock_ns: Option<u64>) -> PyResult<RunResult> {
        let timeout = duration_from_secs("Vm.agent_call", timeout)?;
        let seed: Option<[u8; 32]> = match seed {
            None => None,
            Some(s) => Some(s.as_ref().try_into().map_err(|_| {
                PyValueError::new_err(format!("Vm.agent_call: a seed is exactly 32 bytes, got {} bytes", s.len()))
            })?),
        };
        let result = self.with(py, "Vm.agent_call", |vm| {
            Ok(match seed {
                Some(seed) => vm.agent_call_seeded(&input, timeout, collimate_engine::protocol::ExecSeed { seed, replay, wall_clock_ns })?,
                None => vm.agent_call(&input, timeout)?,
            })
        })?;
        Ok(RunResult::new(py, result))
    }

    /// After an `agent_call` that timed out: SIGKILLs every guest process that exec started,
    /// sends the agent guest signal `signal` (0: none; SIGINT ends running Python code with
    /// KeyboardInterrupt) and runs until the agent waits again, for at most `timeout` seconds.
    /// Files and the agent's memory are kept. The result is as `agent_call`'s.
    #[pyo3(signature = (signal, timeout))]
    fn end_exec(&self, py: Python<'_>, signal: i32, timeout: f64) -> PyResult<RunResult> {
        let timeout = duration_from_secs("Vm.end_exec", timeout)?;
        let result = self.with(py, "Vm.end_exec", |vm| Ok(vm.end_exec(signal, timeout)?))?;
        Ok(RunResult::new(py, result))
    }

    /// Writes a file into a Linux guest's file system (/tmp and /work), byte-exact.
    #[pyo3(signature = (path, data, mode = 0o644))]
    fn upload(&self, py: Python<'_>, path: String, data: PyBackedBytes, mode: u32) -> PyResult<()> {
        let op = format!("Vm.upload({path:?})");
        self.with(py, &op, |vm| Ok(vm.upload(&path, &data, mode)?))
    }

    /// Reseeds the sandbox CRNG of this paused Linux VM with `seed` (exactly 32 bytes); with
    /// `replay`, its clocks run on deterministic virtual time from now on (docs/replay.md).
    #[pyo3(signature = (seed, replay = true))]
    fn reseed(&self, py: Python<'_>, seed: PyBackedBytes, replay: bool) -> PyResult<()> {
        let seed: [u8; 32] = seed.as_ref().try_into().map_err(|_| {
            PyValueError::new_err(format!(
                "Vm.reseed: a seed is exactly 32 bytes (64 hex characters as text; see collimate_core._seeds.parse_seed), got {} bytes",
                seed.len()
            ))
        })?;
        self.with(py, "Vm.reseed", |vm| Ok(vm.reseed(seed, replay)?))
    }

    /// Reads a regular file of a Linux guest's file system, byte-exact, if it holds at most
    /// `max_bytes` (anything else, a FIFO or a device, is refused at once).
    #[pyo3(signature = (path, max_bytes = collimate_engine::controller::DOWNLOAD_MAX))]
    fn download<'py>(&self, py: Python<'py>, path: String, max_bytes: u64) -> PyResult<Bound<'py, PyBytes>> {
        let op = format!("Vm.download({path:?})");
        let data = self.with(py, &op, |vm| {
            use std::io::Read;
            let (f, size) = vm.open_download(&path, max_bytes)?;
            let mut out = Vec::with_capacity(size as usize);
            f.take(size).read_to_end(&mut out).map_err(|e| collimate_engine::Error::Sys { op: "read downloaded file", source: e })?;
            Ok(out)
        })?;
        Ok(PyBytes::new(py, &data))
    }

    /// Opens a regular file of a Linux guest's file system for reading, if it holds at most
    /// `max_bytes`: returns (a file descriptor the caller owns and must close, its size). Reading
    /// it costs the engine no memory: the caller streams or reads it as it likes.
    fn open_download(&self, py: Python<'_>, path: String, max_bytes: u64) -> PyResult<(i32, u64)> {
        let op = format!("Vm.open_download({path:?})");
        self.with(py, &op, |vm| {
            let (f, size) = vm.open_download(&path, max_bytes)?;
            Ok((std::os::fd::IntoRawFd::into_raw_fd(f), size))
        })
    }

    fn read_mem<'py>(&self, py: Python<'py>, addr: u64, n: usize) -> PyResult<Bound<'py, PyBytes>> {
        let op = format!("Vm.read_mem({addr:#x}, {n})");
        let data = self.with(py, &op, |vm| Ok(vm.read_mem(addr, n)?))?;
        Ok(PyBytes::new(py, &data))
    }

    fn write_mem(&self, py: Python<'_>, addr: u64, data: PyBackedBytes) -> PyResult<()> {
        let op = format!("Vm.write_mem({addr:#x}, <{} bytes>)", data.len());
        self.with(py, &op, |vm| Ok(vm.write_mem(addr, &data)?))
    }

    fn regs<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let mut regs = self.with(py, "Vm.regs", |vm| Ok(vm.regs()?))?;
        let out = PyDict::new(py);
        for name in REG_NAMES {
            if let Some(v) = reg_slot(&mut regs, name) {
                out.set_item(name, *v)?;
            }
        }
        Ok(out)
    }

    /// Updates the registers named in `regs`; the others keep their values.
    fn set_regs(&self, py: Python<'_>, regs: HashMap<String, u64>) -> PyResult<()> {
        let mut probe = kvm_regs::default();
        if let Some(bad) = regs.keys().find(|k| reg_slot(&mut probe, k).is_none()) {
            return Err(PyValueError::new_err(format!(
                "Vm.set_regs: unknown register {bad:?}; valid names: {}",
                REG_NAMES.join(", ")
            )));
        }
        self.with(py, "Vm.set_regs", |vm| {
            let mut current = vm.regs()?;
            for (name, value) in &regs {
                if let Some(slot) = reg_slot(&mut current, name) {
                    *slot = *value;
                }
            }
            Ok(vm.set_regs(&current)?)
        })
    }

    /// The full captured vCPU state, serialized (for equality checks; the layout is not an API).
    fn vcpu_state<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyBytes>> {
        let state = self.with(py, "Vm.vcpu_state", |vm| Ok(vm.vcpu_state()?))?;
        let bytes = postcard::to_allocvec(&state).map_err(|e| {
            EngineError::new_err(format!("Vm.vcpu_state: cannot serialize the vCPU state: {e}"))
        })?;
        Ok(PyBytes::new(py, &bytes))
    }

    fn mem_stats<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let stats = self.with(py, "Vm.mem_stats", |vm| Ok(vm.mem_stats()?))?;
        let out = PyDict::new(py);
        out.set_item("private_bytes", stats.private_bytes)?;
        out.set_item("dirty_pages", stats.dirty_pages)?;
        Ok(out)
    }

    /// Sets the disk quota of this sandbox's writable mounts together (its own tmpfs; refused
    /// below what they hold) and of every child it forks from now on. `inodes`: files,
    /// directories and symlinks (default 65536).
    #[pyo3(signature = (bytes, inodes = None))]
    fn set_disk_quota(&self, py: Python<'_>, bytes: u64, inodes: Option<u64>) -> PyResult<()> {
        let q = collimate_engine::quota::DiskQuota {
            bytes,
            inodes: inodes.unwrap_or(collimate_engine::quota::DEFAULT_QUOTA.inodes),
        };
        self.with(py, "Vm.set_disk_quota", |vm| Ok(vm.set_disk_quota(q)?))
    }

    /// What this sandbox's writable mounts hold and their quota (`bytes`, `inodes`,
    /// `quota_bytes`, `quota_inodes`), or None if it has no tmpfs of its own (a template zygote,
    /// a booted or restored VM, or a host that cannot make one).
    fn disk_usage<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let usage = self.with(py, "Vm.disk_usage", |vm| Ok(vm.disk_usage()?))?;
        usage
            .map(|u| {
                let out = PyDict::new(py);
                out.set_item("bytes", u.bytes)?;
                out.set_item("inodes", u.inodes)?;
                out.set_item("quota_bytes", u.quota_bytes)?;
                out.set_item("quota_inodes", u.quota_inodes)?;
                Ok(out)
            })
            .transpose()
    }

    /// What this sandbox's shared memory (shared anonymous mappings, memfds, /dev/shm) holds and
    /// its limit (`bytes`, `quota_bytes`), or None where `disk_usage` is None.
    fn shared_memory_usage<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyDict>>> {
        let usage = self.with(py, "Vm.shared_memory_usage", |vm| Ok(vm.shared_memory_usage()?))?;
        usage
            .map(|u| {
                let out = PyDict::new(py);
                out.set_item("bytes", u.bytes)?;
                out.set_item("quota_bytes", u.quota_bytes)?;
                Ok(out)
            })
            .transpose()
    }

    /// Whether this sandbox's shared-memory limit refused anything (an mmap, a page, a write)
    /// since the last call.
    fn take_shared_memory_limit_reached(&self, py: Python<'_>) -> PyResult<bool> {
        self.with(py, "Vm.take_shared_memory_limit_reached", |vm| Ok(vm.take_shared_memory_limit_reached()))
    }

    /// Sets the shared-memory limit of this sandbox (the size of its shared-memory pool: shared
    /// anonymous mappings, memfds and /dev/shm together; refused below what they hold and below
    /// 1 MiB) and of every child it forks from now on.
    fn set_shared_memory(&self, py: Python<'_>, bytes: u64) -> PyResult<()> {
        self.with(py, "Vm.set_shared_memory", |vm| Ok(vm.set_shared_memory(bytes)?))
    }

    /// The shared-memory limit in bytes this VM's children get (and its own), or None if this
    /// host gives none.
    #[getter]
    fn shared_memory(&self, py: Python<'_>) -> PyResult<Option<u64>> {
        self.with(py, "Vm.shared_memory", |vm| Ok(vm.shared_memory()))
    }

    /// The disk quota (bytes, inodes) this VM's children get, or None if this host gives none.
    #[getter]
    fn disk_quota(&self, py: Python<'_>) -> PyResult<Option<(u64, u64)>> {
        self.with(py, "Vm.disk_quota", |vm| Ok(vm.disk_quota().map(|q| (q.bytes, q.inodes))))
    }

    /// Which layers of its jail the VMM process runs in (see the engine's `vmm::jail`).
    fn jail<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyDict>> {
        let jail = self.with(py, "Vm.jail", |vm| Ok(vm.jail()))?;
        let out = PyDict::new(py);
        out.set_item("rlimits", jail.rlimits)?;
        out.set_item("namespaces", jail.namespaces)?;
        out.set_item("seccomp", jail.seccomp)?;
        Ok(out)
    }

    /// Host pid of the VMM process.
    #[getter]
    fn pid(&self, py: Python<'_>) -> PyResult<i32> {
        self.with(py, "Vm.pid", |vm| Ok(vm.pid()))
    }

    /// Replace this sandbox's egress policy (rule strings, and whether public addresses are
    /// admitted on any port); open connections the new policy forbids are reset. Returns how many
    /// were. Forks made afterwards start from this policy. A bad rule, or a policy beyond the
    /// sandbox's ceiling (`seal_egress`), raises ValueError saying so.
    #[pyo3(signature = (rules, internet = false))]
    fn set_egress(&self, py: Python<'_>, rules: Vec<String>, internet: bool) -> PyResult<usize> {
        let p = collimate_engine::egress::Policy::parse(&rules, internet).map_err(|e| PyValueError::new_err(e.to_string()))?;
        py.detach(|| self.net.set_policy_within(p)).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// From now on `set_egress` may not go beyond this sandbox's policy now (a fork's ceiling:
    /// its policy when it was forked); it may narrow below it and widen back up to it.
    fn seal_egress(&self) {
        self.net.seal()
    }

    /// The ceiling `seal_egress` set, as (rule strings, internet), or None.
    fn egress_ceiling(&self) -> Option<(Vec<String>, bool)> {
        self.net.ceiling().map(|p| (p.rules.iter().map(|r| r.to_string()).collect(), p.internet))
    }

    /// Forget this sandbox's network past (for a recycled clone's next owner): no network, an
    /// empty log, its connections closed.
    fn clear_egress(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| self.net.clear());
        Ok(())
    }

    /// This sandbox's egress policy as (rule strings, internet).
    fn egress(&self) -> PyResult<(Vec<String>, bool)> {
        let p = self.net.policy();
        Ok((p.rules.iter().map(|r| r.to_string()).collect(), p.internet))
    }

    /// This sandbox's connection attempts and DNS answers, oldest first: dicts with time, pid,
    /// kind ("connect", "udp", "dns"), name, address, port, rule, verdict, detail, bytes_out, bytes_in, open.
    fn egress_log<'py>(&self, py: Python<'py>) -> PyResult<Vec<Bound<'py, PyDict>>> {
        let log = py.detach(|| self.net.log());
        log.into_iter()
            .map(|e| {
                let d = PyDict::new(py);
                d.set_item("seq", e.seq)?;
                d.set_item("time", e.time)?;
                d.set_item("pid", e.pid)?;
                d.set_item("kind", e.kind)?;
                d.set_item("name", e.name)?;
                d.set_item("address", e.addr.map(|a| a.to_string()))?;
                d.set_item("port", e.port)?;
                d.set_item("rule", e.rule)?;
                d.set_item("verdict", e.verdict)?;
                d.set_item("detail", e.detail)?;
                d.set_item("bytes_out", e.bytes_out)?;
                d.set_item("bytes_in", e.bytes_in)?;
                d.set_item("open", e.open)?;
                Ok(d)
            })
            .collect()
    }

    /// Open the egress recording of the exec about to run: replay the file at `path` if it
    /// exists, else record to it (docs/egress.md, "Record and replay"). Returns ("replay" or
    /// "record", the wall clock the exec's virtual REALTIME is to start at: now when recording, the
    /// recording's when replaying, None for a recording without one). A file that is not a valid
    /// recording raises ValueError saying so.
    fn egress_tape_begin(&self, py: Python<'_>, path: std::path::PathBuf) -> PyResult<(&'static str, Option<u64>)> {
        py.detach(|| self.net.begin_tape(path)).map_err(|e| PyValueError::new_err(e.to_string()))
    }

    /// Close the exec's recording (saving it when it recorded, if `save`): a dict with mode
    /// ("recorded", "replayed", or "" when none was open or it was not saved), path, flows, and
    /// errors (each divergence of a replay, in words).
    #[pyo3(signature = (save = true))]
    fn egress_tape_end<'py>(&self, py: Python<'py>, save: bool) -> PyResult<Bound<'py, PyDict>> {
        let o = py.detach(|| self.net.end_tape(save));
        let d = PyDict::new(py);
        d.set_item("mode", o.mode)?;
        d.set_item("path", o.path.to_string_lossy().into_owned())?;
        d.set_item("flows", o.flows)?;
        d.set_item("errors", o.errors)?;
        Ok(d)
    }

    /// Egress bytes of this sandbox's connections: (sent and acknowledged by the peer, received).
    fn egress_bytes(&self, py: Python<'_>) -> PyResult<(u64, u64)> {
        Ok(py.detach(|| self.net.bytes()))
    }

    /// Kills and reaps the VMM process. Idempotent.
    fn destroy(&self, py: Python<'_>) -> PyResult<()> {
        py.detach(|| match self.lock().take() {
            Some(vm) => vm.destroy(),
            None => Ok(()),
        })
        .map_err(|e| engine_error("Vm.destroy", e))
    }

    fn __enter__(slf: Py<Self>) -> Py<Self> {
        slf
    }

    #[pyo3(signature = (exc_type, _exc, _tb))]
    fn __exit__(
        &self,
        py: Python<'_>,
        exc_type: Option<Bound<'_, PyType>>,
        _exc: Option<Bound<'_, PyAny>>,
        _tb: Option<Bound<'_, PyAny>>,
    ) -> PyResult<bool> {
        let destroyed = self.destroy(py);
        // Never let a cleanup error hide the exception that ended the with-block.
        if exc_type.is_none() {
            destroyed?;
        }
        Ok(false)
    }

    fn __repr__(&self) -> String {
        match self.inner.try_lock() {
            Ok(guard) => match guard.as_ref() {
                Some(vm) => format!("<Vm pid={}>", vm.pid()),
                None => "<Vm destroyed>".to_string(),
            },
            Err(_) => "<Vm busy>".to_string(),
        }
    }
}

/// Where the engine's broker resolves the names egress policies admit, for every sandbox of this
/// process: "system" (the host's resolver), "dns:HOST:PORT" (an upstream DNS server) or
/// "hosts:NAME=IP[,IP];NAME=IP" (a fixed map). A bad spec raises ValueError.
#[pyfunction(name = "_set_egress_resolver")]
fn set_egress_resolver(spec: &str) -> PyResult<()> {
    let r = collimate_engine::egress::Resolver::parse(spec).map_err(|e| PyValueError::new_err(e.to_string()))?;
    collimate_engine::egress::broker::set_resolver(r).map_err(|e| EngineError::new_err(e.to_string()))
}

/// The special-purpose table (`egress::special`, the one copy): (CIDR block, name) pairs.
#[pyfunction(name = "_egress_special_ranges")]
fn egress_special_ranges() -> Vec<(String, String)> {
    collimate_engine::egress::special::table().iter().map(|r| (r.net.to_string(), r.name.to_string())).collect()
}

/// Why an address is special (a registry range, IPv4 inside IPv6, or the host's own), or None.
#[pyfunction(name = "_egress_special")]
fn egress_special(addr: &str) -> PyResult<Option<String>> {
    let a: std::net::IpAddr = addr.parse().map_err(|_| PyValueError::new_err(format!("{addr:?} is not an IP address")))?;
    Ok(collimate_engine::egress::special::reason(a))
}

/// Whether no address of a CIDR block is special (narrowing under internet()).
#[pyfunction(name = "_egress_net_is_public")]
fn egress_net_is_public(cidr: &str) -> PyResult<bool> {
    let n = collimate_engine::egress::policy::parse_net(cidr).map_err(PyValueError::new_err)?;
    Ok(collimate_engine::egress::special::net_is_public(&n))
}

/// Declare special-purpose ranges public for this process ("" for none): a lab network.
#[pyfunction(name = "_set_egress_public")]
fn set_egress_public(spec: &str) -> PyResult<()> {
    let nets = collimate_engine::egress::special::parse_public(spec).map_err(|e| PyValueError::new_err(e.to_string()))?;
    collimate_engine::egress::special::set_public(nets);
    Ok(())
}

/// The ranges declared public now.
#[pyfunction(name = "_egress_public")]
fn egress_public() -> Vec<String> {
    collimate_engine::egress::special::public().iter().map(|n| n.to_string()).collect()
}

/// The per-sandbox flow cap: with `n`, set it (ValueError out of 1..=2000); returns it.
#[pyfunction(name = "_egress_max_flows")]
#[pyo3(signature = (n = None))]
fn egress_max_flows(n: Option<usize>) -> PyResult<usize> {
    if let Some(n) = n {
        collimate_engine::egress::broker::set_max_flows(n).map_err(|e| PyValueError::new_err(e.to_string()))?;
    }
    Ok(collimate_engine::egress::broker::max_flows())
}

/// The engine's reading of one egress rule, printed back in canonical form (the SDK's parser is
/// checked against it); a bad rule raises ValueError saying what a valid rule looks like.
#[pyfunction(name = "_egress_canonical")]
fn egress_canonical(rule: &str) -> PyResult<String> {
    collimate_engine::egress::policy::parse_rule(rule).map(|r| r.to_string()).map_err(|e| PyValueError::new_err(e.to_string()))
}

/// The KVM host profile this process detected (`collimate_engine::vstate::profile`), as a dict;
/// with `measure_exit`, also the median cost of one exit in nanoseconds (`exit_ns`, about 2,000
/// exits of a tiny probe VM).
#[pyfunction(name = "_kvm_profile")]
#[pyo3(signature = (measure_exit = false))]
fn kvm_profile(py: Python<'_>, measure_exit: bool) -> PyResult<Bound<'_, PyDict>> {
    use collimate_engine::vstate::profile::{self, FlushMethod};
    let p = profile::current();
    let d = PyDict::new(py);
    d.set_item("name", p.name())?;
    d.set_item("kind", format!("{:?}", p.kind).to_lowercase())?;
    d.set_item("paging", format!("{:?}", p.paging).to_lowercase())?;
    d.set_item("nested", p.nested)?;
    d.set_item("source", p.source)?;
    d.set_item("io_completes_on_next_run", p.io_completes_on_next_run())?;
    d.set_item("guest_tlb_flush", p.flush_method() == FlushMethod::HostZapAndGuestTlb)?;
    d.set_item("cpuid_filtered", p.cpuid_filtered())?;
    if measure_exit {
        let cost = py.detach(|| profile::exit_cost(2000)).map_err(EngineError::new_err)?;
        d.set_item("exit_ns", cost.as_nanos() as u64)?;
    }
    Ok(d)
}

/// Whether this process can give sandboxes disk quotas (tmpfs instances of their own; see
/// `collimate_engine::quota`).
#[pyfunction(name = "_quota_available")]
fn quota_available(py: Python<'_>) -> bool {
    py.detach(collimate_engine::quota::available)
}

/// The first `n` bytes of the sandbox CRNG's stream after a reseed with the 32-byte `seed` (the
/// engine's own `Crng`, so the SDK's seed-ack check computes what the guest got in microseconds;
/// `sdk/seeds.py` keeps the reference implementation in Python).
#[pyfunction(name = "_crng_stream")]
fn crng_stream<'py>(py: Python<'py>, seed: &[u8], n: usize) -> PyResult<Bound<'py, PyBytes>> {
    let seed: collimate_engine::guestos::crng::Seed =
        seed.try_into().map_err(|_| PyValueError::new_err(format!("a seed is 32 bytes, not {}", seed.len())))?;
    if n > 1 << 20 {
        return Err(PyValueError::new_err(format!("at most 1 MiB of the stream at once, not {n} bytes")));
    }
    let mut buf = vec![0u8; n];
    collimate_engine::guestos::crng::Crng::from_seed(seed).fill(&mut buf);
    Ok(PyBytes::new(py, &buf))
}

/// Start the engine's egress broker thread now (the package does on import, so that its thread
/// and wake-up descriptor never look like a leak of the first sandbox's). Not in a VMM process,
/// which must stay single-threaded: it loads only this extension, never the package.
#[pyfunction(name = "_egress_start")]
fn egress_start() -> PyResult<()> {
    collimate_engine::egress::broker::start().map_err(|e| EngineError::new_err(e.to_string()))
}

/// Sandboxes the broker serves now (for leak checks).
#[pyfunction(name = "_egress_broker_sandboxes")]
fn egress_broker_sandboxes() -> usize {
    collimate_engine::egress::broker::registered()
}

#[pymodule]
fn _core(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add_class::<PyVm>()?;
    m.add_class::<RunResult>()?;
    m.add("CollimateError", py.get_type::<CollimateError>())?;
    m.add("EngineError", py.get_type::<EngineError>())?;
    m.add("SnapshotError", py.get_type::<SnapshotError>())?;
    m.add("VmDestroyedError", py.get_type::<VmDestroyedError>())?;
    m.add_function(wrap_pyfunction!(_vmm_main, m)?)?;
    m.add_function(wrap_pyfunction!(set_egress_resolver, m)?)?;
    m.add_function(wrap_pyfunction!(egress_broker_sandboxes, m)?)?;
    m.add_function(wrap_pyfunction!(egress_canonical, m)?)?;
    m.add_function(wrap_pyfunction!(egress_start, m)?)?;
    m.add_function(wrap_pyfunction!(egress_special_ranges, m)?)?;
    m.add_function(wrap_pyfunction!(egress_special, m)?)?;
    m.add_function(wrap_pyfunction!(egress_net_is_public, m)?)?;
    m.add_function(wrap_pyfunction!(set_egress_public, m)?)?;
    m.add_function(wrap_pyfunction!(egress_public, m)?)?;
    m.add_function(wrap_pyfunction!(egress_max_flows, m)?)?;
    m.add_function(wrap_pyfunction!(kvm_profile, m)?)?;
    m.add_function(wrap_pyfunction!(quota_available, m)?)?;
    m.add_function(wrap_pyfunction!(crng_stream, m)?)?;
    m.add("SNAPSHOT_FORMAT", collimate_engine::persist::FORMAT_VERSION)?;
    m.add("OUTPUT_CAP", collimate_engine::controller::OUTPUT_CAP)?;
    m.add("SYSTRAP_SNAPSHOT_FORMAT", collimate_engine::vmm::systrap::snapshot::FORMAT_VERSION)?;
    Ok(())
}
