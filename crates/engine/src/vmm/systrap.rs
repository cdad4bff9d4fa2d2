//! A guest process on the systrap platform: its stub (`platform::systrap::Stub`), the guest OS
//! state, and the run loop beside the KVM one (`Machine::run`).
//!
//! The loop runs the stub until its next exit: a trapped syscall goes to [`guestos::dispatch`]
//! with the guest's memory reached through the stub ([`StubSpace`]) and its result goes back in
//! rax; `rdtsc` and `cpuid` are answered here; a fault or a signal the guest raised ends the
//! process by that signal (SIGSEGV for a page fault), as Linux's default action would.
//!
//! execve loads the new program into the same stub (`exec::commit_host`). Not yet on this
//! platform (each answers as noted): guest fork and clone (the other calls the KVM VMM serves
//! itself, `process::intercepts`: ENOSYS), signal handlers (a fault kills the
//! process even with a handler installed; rt_sigreturn ENOSYS), shared futexes across processes,
//! snapshots, and the KVM VMM's process tree, scheduler and controller protocol: [`Process`] runs
//! one process in the caller's own process.

use std::os::fd::BorrowedFd;
use std::time::{Duration, Instant};

use kvm_bindings::{kvm_regs, kvm_sregs};

use crate::error::{Error, Result};
use crate::guestos::{self, Errno, GuestOs, EFAULT, EINVAL, EIO, ENOSYS};
use crate::platform::systrap::{self as st, Confinement, Exit, Stub};
use crate::platform::{HostSpace, Memory};
use crate::protocol::{RunExit, RunResult, SpawnSpec};

/// The guest memory a systrap process may map (what `sysinfo` reports as total): the KVM
/// platform's default guest memory size.
pub const DEFAULT_BUDGET: u64 = 1 << 30;

/// A stub as `guestos` reaches guest memory: [`HostSpace`] over [`Stub`].
pub struct StubSpace<'a> {
    pub stub: &'a mut Stub,
    pub budget: u64,
    /// The last stub failure that was not the guest's doing (the stub is gone, the host refused),
    /// which an errno cannot tell: for the VMM's own error messages.
    pub failure: Option<String>,
}

impl StubSpace<'_> {
    fn errno(&mut self, e: st::Error) -> Errno {
        if !matches!(e, st::Error::Fault { .. } | st::Error::Reserved { .. } | st::Error::Op { .. }) {
            self.failure = Some(e.to_string());
        }
        errno_of(e)
    }
}

/// The errno a guest sees for a stub error.
fn errno_of(e: st::Error) -> Errno {
    match e {
        st::Error::Fault { .. } => EFAULT,
        st::Error::Reserved { .. } => EINVAL,
        st::Error::Op { source, .. } | st::Error::Host { source, .. } => Errno::from_io(&source),
        st::Error::Spawn { .. } | st::Error::Gone { .. } | st::Error::NotParked { .. } => EIO,
    }
}

impl HostSpace for StubSpace<'_> {
    fn read(&self, va: u64, buf: &mut [u8]) -> std::result::Result<(), Errno> {
        self.stub.read(va, buf).map_err(errno_of)
    }

    fn write(&mut self, va: u64, data: &[u8]) -> std::result::Result<(), Errno> {
        self.stub.write(va, data).map_err(|e| self.errno(e))
    }

    fn map(&mut self, va: u64, len: u64, prot: u32, flags: u32, file: Option<(i32, u64)>) -> std::result::Result<(), Errno> {
        let (fd, offset) = match file {
            // SAFETY: the descriptor is the caller's and open for the length of this call
            // (`HostSpace::map`'s contract); the stub only sends it.
            Some((fd, off)) => (Some(unsafe { BorrowedFd::borrow_raw(fd) }), off),
            None => (None, 0),
        };
        self.stub.map(va, len, prot as i32, flags as i32, fd, offset).map_err(|e| self.errno(e))
    }

    fn unmap(&mut self, va: u64, len: u64) -> std::result::Result<(), Errno> {
        self.stub.unmap(va, len).map_err(|e| self.errno(e))
    }

    fn protect(&mut self, va: u64, len: u64, prot: u32) -> std::result::Result<(), Errno> {
        self.stub.protect(va, len, prot as i32).map_err(|e| self.errno(e))
    }

    fn budget(&self) -> u64 {
        self.budget
    }

    fn reserved(&self) -> (u64, u64) {
        Stub::reserved_range()
    }
}

/// One guest process on systrap: its stub, its OS state and its registers between runs.
pub struct Process {
    stub: Stub,
    os: GuestOs,
    regs: kvm_regs,
    fs_base: u64,
    budget: u64,
    exited: Option<RunExit>,
}

impl Process {
    /// A new confined stub running the program `spec` names from its root filesystem. Its fds 1
    /// and 2 are captured in each run's output.
    pub fn spawn(spec: &SpawnSpec, conf: &Confinement) -> Result<Process> {
        let stub = Stub::spawn(conf).map_err(|e| Error::Remote(format!("systrap: {e}")))?;
        Self::with_stub(spec, stub)
    }

    /// As [`Process::spawn`], in a stub forked from `template` (`platform::systrap::Template`:
    /// no new namespaces or clone of the VMM per process).
    pub fn spawn_from(spec: &SpawnSpec, template: &mut st::Template) -> Result<Process> {
        let stub = template.spawn().map_err(|e| Error::Remote(format!("systrap: {e}")))?;
        Self::with_stub(spec, stub)
    }

    fn with_stub(spec: &SpawnSpec, mut stub: Stub) -> Result<Process> {
        let mut os = super::new_guest_os(spec, Some(1), None)?;
        let budget = DEFAULT_BUDGET;
        let cannot = |e: Errno, failure: Option<String>| {
            Error::Image(format!(
                "cannot start {}: {}{}",
                String::from_utf8_lossy(&spec.argv[0]),
                std::io::Error::from_raw_os_error(e.0),
                failure.map(|f| format!(" ({f})")).unwrap_or_default()
            ))
        };
        let prepared = guestos::exec::prepare(&os, &spec.argv[0], &spec.argv, &spec.envp).map_err(|e| cannot(e, None))?;
        let mut space = StubSpace { stub: &mut stub, budget, failure: None };
        let img = guestos::exec::commit_host(&mut os, &mut space, prepared, &spec.envp).map_err(|e| cannot(e, space.failure.take()))?;
        let regs = kvm_regs { rip: img.entry, rsp: img.rsp, rflags: 0x202, ..Default::default() };
        Ok(Process { stub, os, regs, fs_base: 0, budget, exited: None })
    }

    /// How the VMM and the stub wait for each other (`platform::systrap::Handoff`; tuning and
    /// benches).
    pub fn set_handoff(&mut self, h: st::Handoff) {
        self.stub.set_handoff(h);
    }

    /// The guest OS state (files, memory map, process facts).
    pub fn os(&self) -> &GuestOs {
        &self.os
    }

    /// Run the guest until it exits, is killed by a signal, or `timeout` passes.
    pub fn run(&mut self, timeout: Duration) -> Result<RunResult> {
        let start = Instant::now();
        let mut out = guestos::Output::default();
        let exit = match self.exited {
            Some(e) => e,
            None => self.run_loop(&mut out, start + timeout)?,
        };
        if matches!(exit, RunExit::Exited { .. } | RunExit::Signaled { .. }) {
            self.exited = Some(exit);
        }
        Ok(RunResult {
            exit,
            stdout: out.stdout,
            stderr: out.stderr,
            duration: start.elapsed(),
            enosys: out.enosys,
            truncated: false,
            agent: Vec::new(),
            others: 0,
            nondeterministic: false,
        })
    }

    fn run_loop(&mut self, out: &mut guestos::Output, deadline: Instant) -> Result<RunExit> {
        loop {
            let exit = self.stub.run(&mut self.regs, &mut self.fs_base).map_err(|e| Error::Remote(format!("systrap: {e}")))?;
            match exit {
                Exit::Syscall => {
                    if let Some(exit) = self.syscall(out) {
                        return Ok(exit);
                    }
                }
                Exit::Rdtsc { rdtscp } => {
                    // The guest's clock, not the host's TSC: replays see the same values.
                    let ns = self.os.proc.clocks.mono_now();
                    self.regs.rax = ns & 0xffff_ffff;
                    self.regs.rdx = ns >> 32;
                    if rdtscp {
                        self.regs.rcx = 0;
                    }
                    self.regs.rip += if rdtscp { 3 } else { 2 };
                }
                Exit::Cpuid => {
                    #[allow(unused_unsafe)]
                    // SAFETY: CPUID has no side effects and every leaf is defined (unknown leaves
                    // answer the highest basic leaf's values).
                    let r = unsafe { std::arch::x86_64::__cpuid_count(self.regs.rax as u32, self.regs.rcx as u32) };
                    (self.regs.rax, self.regs.rbx, self.regs.rcx, self.regs.rdx) = (r.eax as u64, r.ebx as u64, r.ecx as u64, r.edx as u64);
                    self.regs.rip += 2;
                }
                Exit::Fault { .. } => return Ok(RunExit::Signaled { signo: libc::SIGSEGV }),
                Exit::Signal { signo, .. } => return Ok(RunExit::Signaled { signo }),
                Exit::Exited { status } => {
                    return Err(Error::Remote(format!("systrap: the stub process ended under the guest (wait status {status:?})")));
                }
            }
            if Instant::now() >= deadline {
                return Ok(RunExit::Timeout);
            }
        }
    }

    /// Serve the syscall in the registers; the run's end if it ends it.
    fn syscall(&mut self, out: &mut guestos::Output) -> Option<RunExit> {
        let nr = self.regs.rax;
        if nr == SYS_EXECVE {
            return self.execve();
        }
        if intercepted(nr) {
            self.regs.rax = (-(ENOSYS.0 as i64)) as u64;
            *self.os.enosys.entry(nr).or_default() += 1;
            out.enosys += 1;
            return None;
        }
        let mut sregs = kvm_sregs::default();
        sregs.fs.base = self.fs_base;
        let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        let mut ctx = guestos::Ctx {
            memory: Memory::Host(&mut space),
            regs: &mut self.regs,
            sregs: &mut sregs,
            out,
            flush_tlb: false,
            stale_frames: Vec::new(),
            stop: None,
            lazy: Vec::new(),
        };
        let exit = guestos::dispatch(&mut self.os, &mut ctx);
        self.fs_base = sregs.fs.base;
        exit
    }
}

impl Process {
    /// execve(path, argv, envp): the new program replaces the old in the same stub. Errors up to
    /// the point of no return go back to the caller; a load that fails after it kills the process
    /// (SIGSEGV), as on Linux.
    fn execve(&mut self) -> Option<RunExit> {
        let (path, argv, envp) = (self.regs.rdi, self.regs.rsi, self.regs.rdx);
        let mut space = StubSpace { stub: &mut self.stub, budget: self.budget, failure: None };
        let args = (|| {
            let path = read_cstr(&space, path, guestos::vfs::PATH_MAX)?;
            let argv = read_strv(&space, argv)?;
            let envp = read_strv(&space, envp)?;
            let prepared = guestos::exec::prepare(&self.os, &path, &argv, &envp)?;
            Ok::<_, Errno>((prepared, envp))
        })();
        let (prepared, envp) = match args {
            Ok(v) => v,
            Err(e) => {
                self.regs.rax = (-(e.0 as i64)) as u64;
                return None;
            }
        };
        match guestos::exec::commit_host(&mut self.os, &mut space, prepared, &envp) {
            Ok(img) => {
                self.regs = crate::arch::x86_64::regs::initial_regs(img.entry, img.rsp);
                self.fs_base = 0;
                super::process::on_exec_state(&mut self.os);
                None
            }
            Err(_) => Some(RunExit::Signaled { signo: libc::SIGSEGV }),
        }
    }
}

const SYS_EXECVE: u64 = 59;
/// Linux's limits on exec arguments: one string, and all of them together.
const MAX_ARG_STRLEN: usize = 32 * 4096;
const MAX_ARG_TOTAL: usize = 2 << 20;
const E2BIG: Errno = Errno(7);

/// A NUL-terminated string of guest memory, at most `max` bytes.
fn read_cstr(h: &dyn HostSpace, va: u64, max: usize) -> std::result::Result<Vec<u8>, Errno> {
    let mut out = Vec::new();
    let mut p = va;
    loop {
        let mut buf = vec![0u8; (4096 - (p & 4095)) as usize];
        h.read(p, &mut buf)?;
        if let Some(i) = buf.iter().position(|&b| b == 0) {
            out.extend_from_slice(&buf[..i]);
            return Ok(out);
        }
        out.extend_from_slice(&buf);
        if out.len() > max {
            return Err(E2BIG);
        }
        p += buf.len() as u64;
    }
}

/// A NULL-terminated array of strings in guest memory (argv, envp); NULL itself is empty.
fn read_strv(h: &dyn HostSpace, va: u64) -> std::result::Result<Vec<Vec<u8>>, Errno> {
    let mut v = Vec::new();
    let mut total = 0;
    if va == 0 {
        return Ok(v);
    }
    for i in 0.. {
        let mut b = [0u8; 8];
        h.read(va.checked_add(8 * i).ok_or(EFAULT)?, &mut b)?;
        let p = u64::from_le_bytes(b);
        if p == 0 {
            break;
        }
        let s = read_cstr(h, p, MAX_ARG_STRLEN)?;
        total += s.len() + 1 + 8;
        if total > MAX_ARG_TOTAL {
            return Err(E2BIG);
        }
        v.push(s);
    }
    Ok(v)
}

/// The calls the KVM VMM serves itself (fork, clone, execve, rt_sigreturn, spawn), not offered
/// on systrap yet.
fn intercepted(nr: u64) -> bool {
    super::process::intercepts(nr)
}
