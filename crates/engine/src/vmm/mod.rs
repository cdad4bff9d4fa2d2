//! The VMM process: one per guest. It owns the guest memory mapping, the KVM VM and vCPU, and the
//! host-side runtime state, and serves [`Request`]s from its controller until the controller goes away.
//!
//! A fork is a host `fork()` of this process while the guest is paused: the child inherits the
//! `MAP_PRIVATE` guest memory copy-on-write, makes its own KVM VM over it (a KVM VM belongs to the
//! address space that created it), restores the vCPU state captured just before the fork, and serves
//! its own channel. The parent goes on.

mod prefault;
mod process;
mod image_cache;
mod spawn_prefault;
mod spawn;
mod teardown;
mod threads;
pub(crate) mod jail;
mod lifeline;
mod syscalls;
pub mod systrap;

use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};

use kvm_bindings::CpuId;
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};
use serde::{Deserialize, Serialize};

use crate::arch::x86_64::layout::*;
use crate::guestos::persist::ScratchRoot;
use crate::guestos::{self, GuestOs};
use crate::protocol::SpawnSpec;
use crate::arch::x86_64::paging::{setup_address_space, AddressSpace, FrameAllocator};
use crate::arch::x86_64::cpuid::CpuTemplate;
use crate::arch::x86_64::regs;
use crate::channel::{Channel, RecvError};
use crate::error::{Error, RemoteError, Result};
use crate::persist::{self, SnapshotState};
use crate::protocol::{MemStats, Request, ResetStats, Response, RunExit, RunResult};
use crate::vstate::memory::GuestMemory;
use crate::vstate::vcpu::{supported_msrs, Preempter, VcpuState};
use crate::vstate::vm::{slot_size_for, KvmVm};

/// Host-side state of the guest that is not in KVM or guest memory. Part of every snapshot.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct RuntimeState {
    pub frames: FrameAllocator,
    pub aspace: AddressSpace,
    /// Syscalls answered with ENOSYS since boot.
    pub enosys: u64,
}

/// XCR0 we enable: x87, SSE, AVX.
const XCR0: u64 = 0b111;
pub use crate::protocol::OUTPUT_CAP;

/// A paused or running guest inside this process. Field order is drop order: the vCPU and VM go
/// before the memory they map.
pub struct Machine {
    vcpu: VcpuFd,
    vm: KvmVm,
    mem: GuestMemory,
    kvm: Kvm,
    /// The CPUID every vCPU of this sandbox gets (`arch::x86_64::cpuid`): this host's for a new
    /// sandbox, the template's for one restored from a snapshot; forks and execs keep it.
    cpu: CpuTemplate,
    cpuid: CpuId,
    msr_list: Vec<u32>,
    runtime: RuntimeState,
    /// The state `reset` returns to: the snapshot this VM (or its ancestor) was restored from. `None`
    /// for a booted VM, whose memory file holds nothing to return to.
    reset_point: Option<(VcpuState, RuntimeState)>,
    /// For a Linux guest restored from a snapshot: the OS state and the snapshot directory whose
    /// `fs/` holds the writable mounts' contents, which `reset` copies back.
    os_reset_point: Option<(crate::guestos::persist::OsState, PathBuf)>,
    preempter: Preempter,
    /// How the guest ended (`Exited` or `Signaled`), once it has.
    exited: Option<RunExit>,
    /// Whether the guest ran since the last reset (see `GuestMemory::end_mapped`).
    ran: bool,
    /// The Linux personality, for VMs that run Linux programs (`spawn`); `None` for the engine's
    /// bare test guests, which get the minimal syscall set in `syscalls`.
    os: Option<GuestOs>,
    /// The pages forks of this VM copy before they run, and this fork's report (`prefault`).
    learn: prefault::Learner,
    /// Where this sandbox's private copies of its writable mounts live: its own tmpfs (the disk
    /// quota, see `crate::quota`) or a directory under the runtime directory.
    scratch: ScratchRoot,
    /// Tmpfs instances from the controller (`Request::AddScratch`) for the next children, in pairs
    /// (disk quota, shared-memory pool): each new sandbox (a fork or a spare) takes a pair. Once any
    /// has come, children are never made without.
    scratch_stock: Vec<OwnedFd>,
    /// Overlay contexts from the controller, one for each pair of `scratch_stock`, while
    /// `writable_root` (`crate::overlay`).
    overlay_stock: Vec<OwnedFd>,
    /// The sandboxes forked from this VM get a writable root (`Request::WritableRoot`).
    writable_root: bool,
    /// The overlay context a `Reset` brought for the sandbox's fresh writable root.
    reset_ctx: Option<OwnedFd>,
    quota_mode: bool,
    /// Set while this process runs its vfork child on its own vCPU (see `spawn`).
    vfork: Option<Box<spawn::Vfork>>,
    /// The cached image this process's program was loaded from, while it still wants a report of
    /// the pages a run touches (`spawn_prefault`).
    touched: Option<spawn_prefault::Touched>,
    /// Register writes through `kvm_run` waiting for the next run (see `vstate::sync`).
    sync: crate::vstate::sync::RegSync,
    /// The vCPU stopped at an I/O exit whose instruction KVM completes on the next `KVM_RUN`
    /// (upstream KVM; see [`Machine::complete_io`]).
    io_pending: bool,
    /// The last page fault retried as spurious (see [`Machine::spurious_fault`]).
    last_spurious: Option<(u64, u64)>,
    /// Whether the vCPU's CR4.TSD is set (`vstate::tsc_trap`), as the state last written to it
    /// says (kept with every write of whole register sets, so that no run has to read it).
    tsd: bool,
}

fn open_kvm() -> Result<Kvm> {
    // A jailed process has no /dev: it opened /dev/kvm before the pivot.
    jail::take_kvm().unwrap_or_else(Kvm::new).map_err(Error::KvmUnavailable)
}

/// This host's CPU template (`arch::x86_64::cpuid`).
fn host_cpu(kvm: &Kvm) -> Result<CpuTemplate> {
    let unfiltered = !crate::vstate::profile::current().cpuid_filtered();
    CpuTemplate::of_host(kvm, unfiltered).map_err(Error::kvm("KVM_GET_SUPPORTED_CPUID"))
}

fn kvm_cpuid(cpu: &CpuTemplate) -> Result<CpuId> {
    cpu.to_kvm().map_err(Error::InvalidArgument)
}

fn new_vcpu(vm: &KvmVm, cpuid: &CpuId) -> Result<VcpuFd> {
    let vcpu = vm.fd.create_vcpu(0).map_err(Error::kvm("KVM_CREATE_VCPU"))?;
    vcpu.set_cpuid2(cpuid).map_err(Error::kvm("KVM_SET_CPUID2"))?;
    Ok(vcpu)
}

/// Memory, VM and vCPU of a freshly loaded program.
struct Image {
    vcpu: VcpuFd,
    vm: KvmVm,
    mem: GuestMemory,
    runtime: RuntimeState,
}

impl Image {
    /// Fresh zeroed memory of `mem_size` bytes with the ring-0 layout, filled by `load` (which
    /// returns the entry point and initial stack pointer), and a VM and vCPU ready to run it.
    fn new(
        kvm: &Kvm,
        cpuid: &CpuId,
        mem_size: u64,
        prefault: u64,
        base: Option<(std::fs::File, FrameAllocator, AddressSpace)>,
        load: impl FnOnce(&mut GuestMemory, &mut FrameAllocator, &AddressSpace) -> Result<(u64, u64)>,
    ) -> Result<Image> {
        if mem_size < MIN_MEM_SIZE || mem_size % PAGE_SIZE != 0 {
            return Err(Error::InvalidArgument(format!(
                "mem_size {mem_size} must be a multiple of 4096 and at least {MIN_MEM_SIZE}"
            )));
        }
        // Over a cached image of the program (`image_cache`), the layout and the program's
        // segments are there already (and `load` knows it): nothing to write or fault in.
        let base_cached = base.as_ref().map(|_| ());
        let (mut mem, mut frames, aspace) = match base {
            Some((file, frames, aspace)) => (GuestMemory::over_image(file, mem_size)?, frames, aspace),
            None => {
                let mut mem = GuestMemory::anonymous(mem_size)?;
                let mut frames = FrameAllocator::new(mem_size);
                let aspace = setup_address_space(&mut mem, &mut frames)?;
                // The program's bytes go into the frames after the layout's.
                mem.populate_for_write(frames.next, prefault);
                (mem, frames, aspace)
            }
        };
        crate::trace::mark("image.layout");
        let (entry, rsp) = load(&mut mem, &mut frames, &aspace)?;
        crate::trace::mark("image.program");
        // A program loaded over a cached image starts without KVM's dirty log, like a forked
        // sandbox (see `prefault`): its spawn hint's pages then fault in with their writable
        // neighbours too.
        let logged = base_cached.is_none() || !lazy_dirty_log();
        let vm = KvmVm::with_log(kvm, &mem, slot_size_for(frames.next, mem_size), logged)?;
        let vcpu = new_vcpu(&vm, cpuid)?;
        crate::trace::mark("image.vm");
        let sregs = vcpu.get_sregs().map_err(Error::kvm("KVM_GET_SREGS"))?;
        vcpu.set_sregs(&regs::initial_sregs(sregs, aspace.root)).map_err(Error::kvm("KVM_SET_SREGS"))?;
        let mut xcrs = vcpu.get_xcrs().map_err(Error::kvm("KVM_GET_XCRS"))?;
        xcrs.nr_xcrs = 1;
        xcrs.xcrs[0].xcr = 0;
        xcrs.xcrs[0].value = XCR0;
        vcpu.set_xcrs(&xcrs).map_err(Error::kvm("KVM_SET_XCRS"))?;
        let entries: Vec<_> = regs::initial_msrs()
            .into_iter()
            .map(|(index, data)| kvm_bindings::kvm_msr_entry { index, data, ..Default::default() })
            .collect();
        crate::vstate::vcpu::set_msrs(&vcpu, &entries)?;
        vcpu.set_regs(&regs::initial_regs(entry, rsp)).map_err(Error::kvm("KVM_SET_REGS"))?;
        Ok(Image { vcpu, vm, mem, runtime: RuntimeState { frames, aspace, enosys: 0 } })
    }
}

/// The guest OS state of a sandbox's first process, before its program is loaded: the root
/// filesystem and mounts, stdio (`None`: fds 1 and 2 are captured in each run's output), the agent
/// channel, user, CPUs and working directory `spec` asks for. The same on every platform.
pub(crate) fn new_guest_os(spec: &SpawnSpec, cpus: Option<u32>, stdio: Option<Vec<OwnedFd>>) -> Result<GuestOs> {
    if spec.argv.is_empty() {
        return Err(Error::InvalidArgument("argv is empty; argv[0] names the program".into()));
    }
    let mut vfs = guestos::vfs::Vfs::new(&spec.root).map_err(Error::sys("open the sandbox root"))?;
    for (at, host) in &spec.mounts {
        vfs.mount(at, host, true).map_err(Error::sys("open a sandbox mount"))?;
    }
    for (at, host) in &spec.ro_mounts {
        vfs.mount(at, host, false).map_err(Error::sys("open a sandbox mount"))?;
    }
    let mut os = GuestOs::new(vfs);
    if let Some(stdio) = stdio {
        os.set_stdio(stdio)?;
    }
    if spec.agent {
        os.install_agent().map_err(|e| Error::Remote(format!("cannot install the agent channel: errno {}", e.0)))?;
    }
    if let Some(u) = &spec.user {
        os.proc.uid = [u.uid; 4];
        os.proc.gid = [u.gid; 4];
        os.proc.groups = u.groups.clone();
    }
    let cpus = match cpus {
        Some(n) => n,
        None => guestos::cpu::default_cpus().map_err(Error::InvalidArgument)?,
    };
    guestos::cpu::set_cpus(&mut os.proc, cpus).map_err(Error::InvalidArgument)?;
    os.proc.cwd = guestos::vfs::join("/", spec.cwd.as_bytes())
        .map_err(|e| Error::InvalidArgument(format!("cwd {:?}: errno {}", spec.cwd, e.0)))?;
    Ok(os)
}

impl Machine {
    /// A new VM running a static ELF.
    pub fn boot(elf: &[u8], mem_size: u64) -> Result<Machine> {
        Self::boot_with(mem_size, |mem, frames, aspace| {
            let l = crate::loader::load_static_elf(elf, mem, frames, aspace)?;
            Ok((l.entry, l.rsp))
        })
    }

    /// A new VM whose memory `load` fills (returning entry point and initial stack pointer).
    fn boot_with(
        mem_size: u64,
        load: impl FnOnce(&mut GuestMemory, &mut FrameAllocator, &AddressSpace) -> Result<(u64, u64)>,
    ) -> Result<Machine> {
        let kvm = open_kvm()?;
        let cpu = host_cpu(&kvm)?;
        let cpuid = kvm_cpuid(&cpu)?;
        let img = Image::new(&kvm, &cpuid, mem_size, 0, None, load)?;
        let msr_list = supported_msrs(&img.vcpu, regs::SNAPSHOT_MSRS);
        Ok(Machine {
            vcpu: img.vcpu,
            vm: img.vm,
            mem: img.mem,
            kvm,
            cpu,
            cpuid,
            msr_list,
            runtime: img.runtime,
            reset_point: None,
            preempter: Preempter::new()?,
            exited: None,
            ran: false,
            os: None,
            os_reset_point: None,
            learn: prefault::Learner::default(),
            scratch: own_dir(),
            scratch_stock: Vec::new(),
            overlay_stock: Vec::new(),
            writable_root: false,
            reset_ctx: None,
            quota_mode: false,
            vfork: None,
            touched: None,
            sync: Default::default(),
            io_pending: false,
            last_spurious: None,
            tsd: false,
        })
    }

    /// Replace this machine's memory, VM and vCPU by a fresh image that `load` fills (writing
    /// about `prefault` bytes of program, faulted in first): what an
    /// execve of a guest child process does (see `spawn`). `old_mapped`: whether the old memory
    /// is still mapped in this process (false in a process forked with the memory excluded, where
    /// unmapping its range could hit the new mapping). The run's preemption and kick follow the
    /// new vCPU.
    fn replace_image(
        &mut self,
        old_mapped: bool,
        prefault: u64,
        base: Option<(std::fs::File, FrameAllocator, AddressSpace)>,
        load: impl FnOnce(&mut GuestMemory, &mut FrameAllocator, &AddressSpace) -> Result<(u64, u64)>,
    ) -> Result<()> {
        let img = Image::new(&self.kvm, &self.cpuid, self.mem.size(), prefault, base, load)?;
        // The kick (a signal handler: the run's preemption, a signal from another process) must
        // never see the old vCPU's kvm_run page once it is unmapped: a preemption that fired
        // between the drop below and the new `set_kick` wrote to a page that was gone and
        // crashed the VMM (a guest child's execve died by SIGSEGV, 1 in 10 with threads in the
        // parent). Until the new vCPU is registered, a kick only sets the flags it sets anyway.
        crate::guestos::signal::host::set_kick(std::ptr::null_mut());
        let vcpu = std::mem::replace(&mut self.vcpu, img.vcpu);
        let vm = std::mem::replace(&mut self.vm, img.vm);
        let mem = std::mem::replace(&mut self.mem, img.mem);
        // The old vCPU and VM go before the memory they map.
        drop(vcpu);
        drop(vm);
        if old_mapped {
            drop(mem);
        } else {
            mem.abandon();
        }
        self.runtime = img.runtime;
        self.sync.reset();
        self.io_pending = false;
        self.tsd = false;
        crate::vstate::tlb::forget_guest_flush();
        self.preempter.attach(&mut self.vcpu);
        crate::guestos::signal::host::set_kick(self.vcpu.get_kvm_run());
        Ok(())
    }
    /// A new VM running a Linux program from a root filesystem.
    pub fn spawn(spec: &SpawnSpec, mem_size: u64, cpus: Option<u32>, stdio: Vec<OwnedFd>) -> Result<Machine> {
        let mut os = new_guest_os(spec, cpus, Some(stdio))?;
        let mut m = Machine::boot_with(mem_size, |mem, frames, aspace| {
            guestos::exec::load(&mut os, mem, frames, aspace, &spec.argv[0], &spec.argv, &spec.envp)
                .map(|img| (img.entry, img.rsp))
                .map_err(|e| {
                    Error::Image(format!(
                        "cannot start {}: {}",
                        String::from_utf8_lossy(&spec.argv[0]),
                        std::io::Error::from_raw_os_error(e.0)
                    ))
                })
        })?;
        m.os = Some(os);
        Ok(m)
    }

    /// A VM restored from a snapshot directory, paused.
    pub fn restore(dir: &Path) -> Result<Machine> {
        let state = persist::read_state(dir)?;
        let kvm = open_kvm()?;
        let mem = GuestMemory::from_file(&dir.join(persist::MEMORY_FILE), state.mem_size)?;
        let vm = KvmVm::new(&kvm, &mem, slot_size_for(state.runtime.frames.next, state.mem_size))?;
        // The template's CPU, if this host can give it (a clone never runs on another CPU than
        // its template's without saying so).
        state.cpu.check(&host_cpu(&kvm)?).map_err(|e| Error::HostCpu { path: dir.display().to_string(), reason: e.to_string() })?;
        let cpu = state.cpu.clone();
        let cpuid = kvm_cpuid(&cpu)?;
        let vcpu = new_vcpu(&vm, &cpuid)?;
        state.vcpu.restore(&vcpu)?;
        let tsd = state.vcpu.sregs.cr4 & crate::vstate::tsc_trap::CR4_TSD != 0;
        let msr_list = supported_msrs(&vcpu, regs::SNAPSHOT_MSRS);
        let scratch = own_dir();
        let (os, os_reset_point) = match state.os {
            Some(os_state) => {
                let os = restore_os(&os_state, dir, &scratch, false, None)?;
                (Some(os), Some((os_state, dir.to_path_buf())))
            }
            None => (None, None),
        };
        Ok(Machine {
            vcpu,
            vm,
            mem,
            kvm,
            cpu,
            cpuid,
            msr_list,
            runtime: state.runtime.clone(),
            reset_point: Some((state.vcpu, state.runtime)),
            preempter: Preempter::new()?,
            exited: None,
            ran: false,
            os,
            os_reset_point,
            learn: prefault::Learner::default(),
            scratch,
            scratch_stock: Vec::new(),
            overlay_stock: Vec::new(),
            writable_root: false,
            reset_ctx: None,
            quota_mode: false,
            vfork: None,
            touched: None,
            sync: Default::default(),
            io_pending: false,
            last_spurious: None,
            tsd,
        })
    }

    /// Keep the tmpfs instances attached to a request for the children to come; once any came,
    /// no child is made without one.
    fn add_scratch(&mut self, mut fds: Vec<OwnedFd>) {
        // Pairs (disk, shared memory), or with a writable root threes (and an overlay context).
        let unit = if self.writable_root { 3 } else { 2 };
        fds.truncate(fds.len() / unit * unit);
        if !fds.is_empty() {
            self.quota_mode = true;
            let mut fds = fds.into_iter();
            while let (Some(disk), Some(shm)) = (fds.next(), fds.next()) {
                self.scratch_stock.extend([disk, shm]);
                if self.writable_root {
                    self.overlay_stock.extend(fds.next());
                }
            }
        }
    }

    /// Give the sandboxes forked from this VM from now on a writable root, or not
    /// (`Request::WritableRoot`). This VM's own root stays as it is.
    fn set_writable_root(&mut self, on: bool) -> Result<()> {
        let Some(os) = self.os.as_mut() else {
            return Err(Error::InvalidArgument("this VM runs no Linux program; it has no root file system".into()));
        };
        if on && os.vfs.root_layer.is_none() {
            os.vfs.want_root_layer(None).map_err(Error::sys("open the sandbox root"))?;
        } else if !on && os.vfs.root_mounted() {
            return Err(Error::InvalidArgument("this sandbox's root is already writable; a template's zygote can turn it off".into()));
        } else if !on {
            os.vfs.root_layer = None;
        }
        self.writable_root = on;
        Ok(())
    }

    /// Whether this VM runs a Linux program (and so has stdio pipes).
    pub fn is_linux(&self) -> bool {
        self.os.is_some()
    }

    /// If the VM has no dirty log (a forked sandbox's first stretch, see `prefault`): count the
    /// pages its entries' dirty bits name as written, and turn KVM's log on from here. Before
    /// anything needs the record of written pages, and before an operation that drops entries
    /// wholesale (an execve).
    pub(crate) fn end_unlogged(&mut self) -> Result<()> {
        if !self.vm.unlogged() {
            return Ok(());
        }
        self.record_dirty_bits()?;
        self.mem.end_mapped(self.ran);
        self.vm.start_dirty_log()
    }

    /// Capture the vCPU. kvm_pvm reads XCR0 back as 0 after we set it (AVX keeps working); an XCR0
    /// without the x87 bit is architecturally invalid and would be refused on restore, so we record
    /// the value we set instead.
    fn capture(&mut self) -> Result<VcpuState> {
        self.complete_io()?;
        let mut s = VcpuState::capture(&self.vcpu, &self.msr_list)?;
        if s.xcrs.nr_xcrs >= 1 && s.xcrs.xcrs[0].xcr == 0 && s.xcrs.xcrs[0].value & 1 == 0 {
            s.xcrs.xcrs[0].value = XCR0;
        }
        Ok(s)
    }

    /// Let KVM finish the I/O instruction the vCPU stopped at, without running the guest any
    /// further: a `KVM_RUN` with `immediate_exit = 1`, which completes the instruction (RIP past
    /// it; an `in`'s value into RAX) and returns EINTR before entering the guest. Upstream KVM
    /// leaves RIP at the instruction at a `KVM_EXIT_IO` and completes it on the next run
    /// (`vstate::profile`), so state read or replaced before that run would be a vCPU that has
    /// not executed its `out`: a snapshot stored so would execute it again when restored. Called
    /// before every capture (snapshot, clone, fork), when a run hands the vCPU back (reset,
    /// the controller's register requests) and before a thread switch overwrites the registers.
    /// (Where the VMM writes another RIP, KVM's completion sees that and leaves it alone.)
    fn complete_io(&mut self) -> Result<()> {
        if !std::mem::take(&mut self.io_pending) {
            return Ok(());
        }
        // A register write still in the sync area is applied by this run, before the completion.
        self.sync.before_run(&mut self.vcpu);
        self.vcpu.set_kvm_immediate_exit(1);
        let ran = self.vcpu.run().map(|exit| format!("{exit:?}"));
        self.vcpu.set_kvm_immediate_exit(0);
        match ran {
            Err(e) if e.errno() == libc::EINTR => Ok(()),
            Err(e) => Err(Error::Kvm { op: "KVM_RUN (immediate_exit, to complete an I/O instruction)", source: e }),
            Ok(exit) => Err(Error::Remote(format!("completing an I/O instruction entered the guest: exit {exit}"))),
        }
    }

    /// Make this entry go through the ring-0 flush stub (`vstate::tlb::request_guest_flush`):
    /// the registers the guest would resume with stay, except that it starts at the stub in ring
    /// 0 with an `iretq` frame (written on the ring-0 stack) that returns to where it was. The
    /// stub's bytes are written again if the memory lacks them (a snapshot made before it
    /// existed).
    fn enter_guest_flush(&mut self) -> Result<()> {
        use crate::arch::x86_64::tables::flush_stub;
        let (mut r, mut s) = self.sync.current(&mut self.vcpu)?;
        if s.cs.selector & 3 != 3 {
            // Not about to resume ring 3 (never expected): every translation goes from the host
            // side instead, which KVM flushes after.
            let log = self.vm.take_dirty_log()?;
            self.mem.sync_dirty(&log);
            return self.vm.replace_slot(self.vm.slot_size());
        }
        let stub = flush_stub();
        let mut have = [0u8; crate::arch::x86_64::tables::FLUSH_STUB_LEN];
        self.mem.read(STUBS_GPA + FLUSH_STUB_OFFSET, &mut have)?;
        if have != stub {
            self.mem.write(STUBS_GPA + FLUSH_STUB_OFFSET, &stub)?;
        }
        let mut frame = [0u8; 40];
        for (i, v) in [r.rip, s.cs.selector as u64, r.rflags, r.rsp, s.ss.selector as u64].into_iter().enumerate() {
            frame[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        self.mem.write(FLUSH_FRAME_GPA, &frame)?;
        r.rip = kva(STUBS_GPA + FLUSH_STUB_OFFSET);
        r.rsp = kva(FLUSH_FRAME_GPA);
        r.rflags = 2;
        s.cs = regs::kernel_code_segment();
        s.ss = regs::kernel_data_segment();
        self.sync.write(&mut self.vcpu, &r, &s)
    }

    /// Whether a guest page fault is one the page tables already allow: a translation the host
    /// widened (a page made present or writable) that the guest's TLB still held in its old form
    /// (hosts with EPT/NPT: the architecture lets a TLB keep a stricter entry until a flush, and
    /// the #PF itself drops it), or a shadow entry KVM kept stale (kvm_pvm: its frame is
    /// invalidated here). The guest retries the access; the fault is not the program's doing, so
    /// it is not counted as an event of its threads' schedule (a fresh fork, whose TLB is empty,
    /// takes fewer such faults than its parent, and must replay alike).
    ///
    /// Only user-mode faults without a reserved-bit or protection-key cause, and never the same
    /// fault twice in a row: one that comes back after the invalidation is the program's.
    fn spurious_fault(&mut self, fault: &RunExit) -> Result<bool> {
        let RunExit::Fault { vector: 14, error_code, cr2, .. } = *fault else { return Ok(false) };
        let again = std::mem::take(&mut self.last_spurious) == Some((cr2, error_code));
        const USER: u64 = 1 << 2;
        const RSVD_OR_PKEY: u64 = (1 << 3) | (1 << 5);
        if again || error_code & USER == 0 || error_code & RSVD_OR_PKEY != 0 {
            return Ok(false);
        }
        let Ok((pa, pte)) = self.runtime.aspace.translate(&self.mem, cr2) else { return Ok(false) };
        if !guestos::mm::Access::of_error_code(error_code).allowed_by_pte(pte) {
            return Ok(false);
        }
        crate::vstate::tlb::invalidate_frames(&self.mem, &[pa & !(PAGE_SIZE - 1)])?;
        self.last_spurious = Some((cr2, error_code));
        Ok(true)
    }

    /// Count as written the frames whose page-table entries' dirty bits are set: the record of
    /// a VM without KVM's dirty log (see `lazy_dirty_log`).
    fn record_dirty_bits(&mut self) -> Result<()> {
        for gpa in self.runtime.aspace.dirty_frames(&self.mem)? {
            self.mem.mark_dirty(gpa);
        }
        Ok(())
    }

    fn sync_dirty(&mut self) -> Result<()> {
        self.end_unlogged()?;
        let log = self.vm.take_dirty_log()?;
        self.mem.sync_dirty(&log);
        Ok(())
    }

    pub fn run(&mut self, timeout: Duration) -> Result<RunResult> {
        let start = Instant::now();
        let mut out = guestos::Output::default();
        if let Some(exit) = self.exited {
            return Ok(RunResult { exit, stdout: vec![], stderr: vec![], duration: Duration::ZERO, enosys: 0, truncated: false, agent: vec![], others: 0, nondeterministic: false });
        }
        let deadline = start + timeout;
        self.ran = true;
        crate::guestos::sched::back();
        self.vcpu.set_kvm_immediate_exit(0);
        self.preempter.attach(&mut self.vcpu);
        self.preempter.arm(timeout)?;
        let guard = process::RunGuard::enter(&mut self.vcpu);
        let res = self.run_loop(deadline, &mut out);
        // Between runs the registers are read and written with the ioctls (captures, forks,
        // the controller's GetRegs).
        let res = res.and_then(|exit| self.sync.settle(&mut self.vcpu).map(|_| exit));
        // Whoever looks at the vCPU next (a snapshot, a reset, the controller) sees it past
        // the instruction it stopped at.
        let res = res.and_then(|exit| self.complete_io().map(|_| exit));
        crate::trace::mark("run.end");
        threads::run_ended();
        let report = threads::take_report();
        if !report.is_empty() {
            self.emit_stderr(&mut out, report.as_bytes());
        }
        if let Ok(RunExit::Timeout) = res {
            let report = self.timeout_report();
            if !report.is_empty() {
                self.emit_stderr(&mut out, report.as_bytes());
            }
        }
        drop(guard);
        self.preempter.disarm()?;
        self.vcpu.set_kvm_immediate_exit(0);
        let exit = res?;
        if let RunExit::Exited { .. } | RunExit::Signaled { .. } = exit {
            self.exited = Some(exit);
            threads::process_ended(self);
            process::guest_ended(self);
            crate::guestos::sched::leave();
        } else if let Some(os) = &self.os {
            crate::guestos::sched::away(os.proc.clocks.mono_now());
        }
        self.runtime.enosys += out.enosys;
        let others = if self.os.is_some() { crate::guestos::signal::host::live_processes().saturating_sub(1) } else { 0 };
        let nondeterministic = threads::take_nondeterministic();
        Ok(RunResult { exit, stdout: out.stdout, stderr: out.stderr, duration: start.elapsed(), enosys: out.enosys, truncated: false, agent: vec![], others, nondeterministic })
    }

    /// What a run that timed out leaves on the guest's stderr: what each process of the sandbox
    /// (in replay mode, where they take turns) and each thread of this one was doing, so that a
    /// program that hangs says where. Empty for a lone single-threaded process (its own output
    /// says enough).
    fn timeout_report(&self) -> String {
        let Some(os) = self.os.as_ref() else { return String::new() };
        let tree = crate::guestos::sched::describe_tree();
        let threads = if os.threads.multi() { os.threads.describe(os.proc.pid) } else { String::new() };
        if tree.is_empty() && threads.is_empty() {
            return String::new();
        }
        let mut s = String::from("collimate: the run timed out; what the sandbox was doing:\n");
        s.push_str(&tree);
        if !threads.is_empty() {
            s.push_str(&format!("  the threads of process {}:\n", os.proc.pid));
            s.push_str(&threads.lines().map(|l| format!("  {l}\n")).collect::<String>());
        }
        s
    }

    /// Write `msg` where the guest's stderr goes (the sandbox's stderr pipe, else the run's output).
    fn emit_stderr(&self, out: &mut guestos::Output, msg: &[u8]) {
        match self.os.as_ref().and_then(|os| os.stdio.as_ref()) {
            Some([_, err]) => {
                // SAFETY: writing a local buffer to our stderr pipe; a short write loses the tail
                // of a diagnostic only.
                unsafe { libc::write(err.as_raw_fd(), msg.as_ptr().cast(), msg.len()) };
            }
            None => out.stderr.extend_from_slice(msg),
        }
    }

    /// Cover every frame the guest has been given with slots before it runs (see `vstate::vm`).
    fn cover_frames(&mut self) -> Result<()> {
        let need = slot_size_for(self.runtime.frames.next, self.mem.size());
        if need > self.vm.slot_size() {
            // A growth slot (see `vstate::vm`); the fallback replaces slot 0, whose log it hands
            // back first.
            if let Some(log) = self.vm.grow(need)? {
                self.mem.sync_dirty(&log);
            }
        }
        Ok(())
    }

    fn run_loop(&mut self, deadline: Instant, out: &mut guestos::Output) -> Result<RunExit> {
        let linux = self.os.is_some();
        // Whether the preemption timer is armed short of the run's deadline, for a guest timer.
        let mut short_armed = false;
        loop {
            // Replay mode: the sandbox's processes take turns (see `guestos::sched`).
            if let Some(os) = self.os.as_mut() {
                let clocks = &mut os.proc.clocks;
                let (replay, mono) = (clocks.replay, clocks.mono_now());
                if let crate::guestos::sched::Gate::Timeout = crate::guestos::sched::gate(replay, mono, &mut |ns| clocks.pass(ns), deadline) {
                    return Ok(RunExit::Timeout);
                }
                // The process's threads take turns on this vCPU (see `threads`).
                if let Some(exit) = threads::schedule(self, deadline)? {
                    return Ok(exit);
                }
            }
            self.cover_frames()?;
            self.vm.sync_windows(&self.mem)?;
            // The vDSO's clock state (see `guestos::vdso`): the clocks out before the guest runs,
            // its reads back in before anything else looks at time.
            if let Some(os) = self.os.as_ref() {
                let budget = threads::vdso_budget(self).min(crate::guestos::timer::vdso_budget(os));
                crate::guestos::vdso::publish(os, &mut self.mem, &self.runtime.aspace, budget);
            }
            // Translations the host took away since the last entry (see `vstate::tlb`).
            if crate::vstate::tlb::take_guest_flush() {
                self.enter_guest_flush()?;
            }
            // A guest timer due while the guest computes without exits: the preemption timer
            // kicks the vCPU out when it is (see `guestos::timer`).
            let timer_budget = self.os.as_ref().and_then(crate::guestos::timer::host_budget);
            if timer_budget.is_some() || short_armed {
                let left = deadline.saturating_duration_since(Instant::now());
                short_armed = timer_budget.is_some_and(|b| b < left);
                self.preempter.arm(timer_budget.map_or(left, |b| b.min(left)))?;
            }
            let traced = crate::trace::on().then(Instant::now);
            let entered = timer_budget.map(|_| Instant::now());
            let host_tsd = self.arm_tsc_trap()?;
            self.sync.before_run(&mut self.vcpu);
            let ran = {
                let _tsd = crate::vstate::tsc_trap::HostTsd::enter(host_tsd);
                self.vcpu.run()
            };
            self.io_pending = matches!(ran, Ok(VcpuExit::IoOut(..) | VcpuExit::IoIn(..)))
                && crate::vstate::profile::current().io_completes_on_next_run()
                && !io_completion_off_for_test();
            if let Some(os) = self.os.as_mut() {
                let reads = crate::guestos::vdso::fold(os, &self.mem, &self.runtime.aspace);
                if reads > 0 {
                    // What those reads' syscalls would have done to the schedulers.
                    threads::count_events(reads);
                    crate::guestos::sched::begin_syscall(crate::guestos::vdso::VDSO_VA, crate::guestos::clock::SYS_CLOCK_GETTIME, [0; 4]);
                    crate::guestos::sched::after_syscall();
                    crate::trace::vdso_reads(reads);
                }
                // The CPU time this run burnt moves virtual time while a timer is due.
                if let Some(t) = entered {
                    if crate::guestos::timer::charge(os, t.elapsed()) {
                        threads::mark_nondeterministic();
                    }
                }
            }
            if let Some(t) = traced {
                crate::trace::count_run(t.elapsed().as_nanos() as u64);
            }
            let exit = match ran {
                Ok(VcpuExit::IoOut(port, data)) => {
                    let mut v = [0u8; 4];
                    let n = data.len().min(4);
                    v[..n].copy_from_slice(&data[..n]);
                    Some((port, u32::from_le_bytes(v)))
                }
                Ok(VcpuExit::IoIn(_, data)) => {
                    data.fill(0);
                    // A Linux program's own `in` (no stub reads a port): see `user_io`.
                    if linux {
                        let exit = self.user_io()?;
                        if let Some(exit) = spawn::filter_exit(self, exit)? {
                            return Ok(exit);
                        }
                    }
                    None
                }
                Ok(VcpuExit::Shutdown) => return Ok(RunExit::Shutdown),
                Ok(other) => {
                    return Err(Error::Remote(format!("unexpected KVM exit: {other:?}")));
                }
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => {
                    self.vcpu.set_kvm_immediate_exit(0);
                    // Signal delivery reads and writes the registers with the ioctls.
                    self.sync.settle(&mut self.vcpu)?;
                    let exit = process::on_interrupt(self)?;
                    if let Some(exit) = spawn::filter_exit(self, exit)? {
                        return Ok(exit);
                    }
                    if Instant::now() >= deadline {
                        return Ok(RunExit::Timeout);
                    }
                    None
                }
                // KVM could not reach the host page behind a guest page: with shared mappings,
                // a page of a file that shrank under the mapping (another process truncated
                // it), or one the tmpfs behind it has no room for (the sandbox's shared-memory
                // pool or its disk quota is full). Linux raises SIGBUS there; the faulting
                // address is not known here, so the process ends by SIGBUS (a handler of its own
                // does not run: see `guestos::mm`).
                Err(e) if e.errno() == libc::EFAULT && linux && !self.mem.windows.is_empty() => {
                    if crate::vstate::shared::pool_full() {
                        crate::vstate::shared::note_limit_reached();
                    }
                    return Ok(RunExit::Signaled { signo: crate::guestos::signal::SIGBUS });
                }
                Err(e) => return Err(Error::Kvm { op: "KVM_RUN", source: e }),
            };
            if let Some((port, value)) = exit {
                if port == SYSCALL_PORT {
                    // A process alone computing or waiting on the host with a timer armed: the
                    // time its calls take counts towards the timer too (not a wait for the turn).
                    let alone = self.os.as_ref().is_some_and(|os| os.proc.timers.armed()) && !crate::guestos::sched::tree_active();
                    let called = alone.then(Instant::now);
                    let exit = self.syscall(out, deadline)?;
                    if let (Some(t), Some(os)) = (called, self.os.as_mut()) {
                        if crate::guestos::timer::charge(os, t.elapsed()) {
                            threads::mark_nondeterministic();
                            // Its signal is delivered before the guest goes on (`on_interrupt`).
                            self.vcpu.set_kvm_immediate_exit(1);
                        }
                    }
                    if let Some(exit) = spawn::filter_exit(self, exit)? {
                        return Ok(exit);
                    }
                } else if (VECTOR_PORT_BASE..VECTOR_PORT_BASE + 32).contains(&port) || port == SPURIOUS_PORT {
                    let vector = if port == SPURIOUS_PORT { 255 } else { (port - VECTOR_PORT_BASE) as u8 };
                    if vector == 14 {
                        crate::trace::count_fault();
                    }
                    let fault = self.exception(vector)?;
                    if linux && self.spurious_fault(&fault)? {
                        continue;
                    }
                    if vector == 13 && self.tsd && self.serve_rdtsc(&fault)? {
                        threads::count_event();
                        continue;
                    }
                    threads::count_event();
                    // A Linux guest gets a signal (its handler runs, or it dies by it).
                    let exit = process::on_fault(self, fault)?;
                    if let Some(exit) = spawn::filter_exit(self, exit)? {
                        return Ok(exit);
                    }
                } else if linux {
                    let exit = self.user_io()?;
                    if let Some(exit) = spawn::filter_exit(self, exit)? {
                        return Ok(exit);
                    }
                } else {
                    return Ok(RunExit::Io { port, value });
                }
            }
            if Instant::now() >= deadline {
                return Ok(RunExit::Timeout);
            }
        }
    }

    /// Before a run: the guest's CR4.TSD as replay mode wants it (`vstate::tsc_trap`). Returns
    /// whether the VMM thread's TSD is to be set for the run too (kvm_pvm, opted in).
    fn arm_tsc_trap(&mut self) -> Result<bool> {
        use crate::vstate::tsc_trap::{Trap, CR4_TSD};
        let trap = crate::vstate::profile::current().rdtsc_trap();
        let want = trap != Trap::Off && self.os.as_ref().is_some_and(|os| os.proc.clocks.replay);
        if self.tsd != want {
            let (r, mut s) = self.sync.current(&mut self.vcpu)?;
            if (s.cr4 & CR4_TSD != 0) != want {
                s.cr4 ^= CR4_TSD;
                self.sync.write(&mut self.vcpu, &r, &s)?;
            }
            self.tsd = want;
        }
        Ok(want && trap == Trap::GuestCr4AndHostThread)
    }

    /// A #GP in ring 3 while CR4.TSD is set: if the guest ran `rdtsc` or `rdtscp`, answer it from
    /// the virtual clock and step past it (true); any other #GP is the program's (false).
    fn serve_rdtsc(&mut self, fault: &RunExit) -> Result<bool> {
        let RunExit::Fault { rip, .. } = *fault else { return Ok(false) };
        let mut insn = [0u8; 3];
        if self.runtime.aspace.read_virt(&self.mem, rip, &mut insn, false).is_err() {
            return Ok(false);
        }
        let Some((rdtscp, len)) = crate::vstate::tsc_trap::decode(&insn) else { return Ok(false) };
        let Some(os) = self.os.as_mut() else { return Ok(false) };
        let tsc = crate::guestos::clock::tsc_now(&mut os.proc);
        // `exception` left the vCPU in ring 3 at the instruction, its registers settled.
        let mut r = self.vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
        r.rax = tsc & 0xffff_ffff;
        r.rdx = tsc >> 32;
        if rdtscp {
            // IA32_TSC_AUX as Linux sets it: the CPU number (0) and NUMA node (0).
            r.rcx = 0;
        }
        r.rip = rip.wrapping_add(len);
        self.vcpu.set_regs(&r).map_err(Error::kvm("KVM_SET_REGS"))?;
        Ok(true)
    }

    /// Back to ring 3: the stubs leave the vCPU in ring 0; the host restores the user segments.
    fn return_to_user(&mut self, regs: &kvm_bindings::kvm_regs, mut sregs: kvm_bindings::kvm_sregs) -> Result<()> {
        sregs.cs = regs::user_code_segment();
        sregs.ss = regs::user_data_segment();
        self.sync.write(&mut self.vcpu, regs, &sregs)
    }

    /// A Linux program ran an I/O instruction of its own (ring 3 may: the TSS's I/O bitmap that
    /// lets the stubs' `out` through under kvm_pvm lets ring 3's through too). Linux answers that
    /// with #GP: SIGSEGV, not an "io" exit of the whole sandbox. (An `out` to the syscall port is a
    /// syscall like any other: the guest chooses nothing it could not with `syscall`.)
    fn user_io(&mut self) -> Result<Option<RunExit>> {
        let r = self.vcpu.get_regs().map_err(Error::kvm("KVM_GET_REGS"))?;
        process::on_fault(self, RunExit::Fault { vector: 13, error_code: 0, rip: r.rip, cr2: 0 })
    }

    fn syscall(&mut self, out: &mut guestos::Output, deadline: Instant) -> Result<Option<RunExit>> {
        // A syscall between two faults at one address makes the second a new one.
        self.last_spurious = None;
        let (mut r, sregs) = self.sync.read(&self.vcpu)?;
        // `syscall` saved the return address in rcx and the flags in r11.
        r.rip = r.rcx;
        r.rflags = r.r11;
        let mut sregs = sregs;
        let entry = process::Entry::of(&r);
        crate::trace::syscall(r.rax);
        crate::guestos::sched::begin_syscall(r.rip, r.rax, [r.rdi, r.rsi, r.rdx, r.r10]);
        let exit = match self.os.as_mut() {
            // fork, execve, sigreturn: the VMM's own business (see `process`).
            Some(_) if process::intercepts(r.rax) => process::syscall(self, &mut r, &mut sregs)?,
            Some(os) => loop {
                let mut ctx = guestos::Ctx {
                    memory: crate::platform::Memory::Kvm(crate::platform::kvm::Memory::new(
                        &mut self.mem,
                        &mut self.runtime.frames,
                        &self.runtime.aspace,
                    )),
                    regs: &mut r,
                    sregs: &mut sregs,
                    out,
                    flush_tlb: false,
                    stale_frames: Vec::new(),
                    stop: None,
                    lazy: os.mm.lazy_areas(),
                };
                let exit = guestos::dispatch(os, &mut ctx);
                let flush = ctx.flush_tlb;
                let stale = std::mem::take(&mut ctx.stale_frames);
                if self.vm.unlogged() {
                    // Without a dirty log the entries' dirty bits are the record, and these
                    // entries were just removed or narrowed: count their frames as written.
                    for &gpa in &stale {
                        self.mem.mark_dirty(gpa);
                    }
                }
                if flush {
                    crate::vstate::tlb::flush_guest_tlb(&mut self.vm, &mut self.mem)?;
                } else if !stale.is_empty() {
                    crate::vstate::tlb::invalidate_frames_exact(&self.mem, &stale)?;
                }
                // Replay turns: a call that would block handed the turn on and is to be restarted.
                // Take the turn back here and retry it at once, instead of through the guest
                // (a KVM_RUN to re-execute its `syscall`), unless a signal is to be delivered.
                // Not past the run's deadline: the run loop checks it only between guest entries, and
                // processes that all wait on each other (a deadlock) would keep passing the turn here.
                let restarted = r.rip == entry.rip().wrapping_sub(2);
                if exit.is_none() && restarted && os.sig.pending == 0 && Instant::now() < deadline {
                    let clocks = &mut os.proc.clocks;
                    if crate::guestos::sched::turn_again(clocks.replay, clocks.mono_now(), &mut |ns| clocks.pass(ns)) {
                        r.rip = entry.rip();
                        crate::guestos::sched::begin_syscall(r.rip, r.rax, [r.rdi, r.rsi, r.rdx, r.r10]);
                        continue;
                    }
                }
                if os.sig.pending != 0 && crate::guestos::signal::has_ready(os) {
                    crate::guestos::sched::cancel_yield();
                }
                break exit;
            },
            None => {
                let (ret, exit) = syscalls::dispatch(&r, &self.runtime.aspace, &self.mem, out);
                r.rax = ret as u64;
                exit
            }
        };
        crate::guestos::sched::after_syscall();
        crate::guestos::sched::count_call();
        threads::count_event();
        let exit = process::after_syscall(self, &entry, &mut r, exit)?;
        if r.rip != entry.rip().wrapping_sub(2) {
            crate::guestos::sched::call_done();
        }
        self.return_to_user(&r, sregs)?;
        Ok(exit)
    }

    fn exception(&mut self, vector: u8) -> Result<RunExit> {
        let (mut r, sregs) = self.sync.read(&self.vcpu)?;
        // A real trap pushed its frame on the ring-0 stack. Anywhere else, ring 3 ran a stub's `out`
        // itself (see `user_io`): a Linux program gets #GP, and no "frame" is read from its stack.
        let ring0_stack = kva(RING0_STACK_TOP_GPA - RING0_STACK_PAGES * PAGE_SIZE)..kva(RING0_STACK_TOP_GPA);
        if self.os.is_some() && !ring0_stack.contains(&r.rsp) {
            return Ok(RunExit::Fault { vector: 13, error_code: 0, rip: r.rip, cr2: 0 });
        }
        // The CPU pushed SS, RSP, RFLAGS, CS, RIP and, for some vectors, an error code.
        let with_code = vector < 32 && has_error_code(vector);
        let mut frame = [0u8; 48];
        let len = if with_code { 48 } else { 40 };
        self.runtime.aspace.read_virt(&self.mem, r.rsp, &mut frame[..len], false)?;
        let word = |i: usize| u64::from_le_bytes(frame[i * 8..i * 8 + 8].try_into().unwrap_or_default());
        let (error_code, base) = if with_code { (word(0), 1) } else { (0, 0) };
        let (rip, rflags, rsp) = (word(base), word(base + 2), word(base + 3));
        // Leave the vCPU where a kernel would before delivering a signal: in ring 3, at the faulting
        // instruction, with the user stack.
        r.rip = rip;
        r.rflags = rflags;
        r.rsp = rsp;
        let cr2 = sregs.cr2;
        self.return_to_user(&r, sregs)?;
        // Signal delivery (`process::on_fault`) uses the ioctls.
        self.sync.settle(&mut self.vcpu)?;
        Ok(RunExit::Fault { vector, error_code, rip, cr2 })
    }

    pub fn snapshot(&mut self, dir: &Path) -> Result<()> {
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(dir)
            .map_err(Error::sys("create snapshot directory"))?;
        // Before anything below edits page-table entries.
        self.end_unlogged()?;
        // Shared mappings live outside guest memory, in host mappings of the sandbox's files and
        // memfds that a snapshot file cannot hold (see `guestos::mm`): read-only ones become
        // private copies of their files, writable ones refuse the snapshot.
        let shared = match self.os.as_mut() {
            Some(os) => {
                let mut sp = guestos::mm::Space::new(&mut self.mem, &mut self.runtime.frames, &self.runtime.aspace);
                os.mm.unshare_read_only(&mut sp).map_err(|e| {
                    Error::OutOfGuestMemory(format!("copying read-only shared mappings for the snapshot: errno {}", e.0))
                })?
            }
            None => guestos::mm::Mm::shared_count(&self.mem),
        };
        if shared > 0 {
            return Err(Error::InvalidArgument(format!(
                "the guest has {shared} writable shared memory mapping(s) (MAP_SHARED: multiprocessing, shared_memory, mmap of a file); \
                 a snapshot cannot hold them: end the processes that use them, or unmap them, before the snapshot"
            )));
        }
        if let Some(os) = &self.os {
            // The state file cannot hold the descriptors lazy file mappings read their pages
            // from: the memory file holds the pages instead.
            let mut sp = guestos::mm::Space::new(&mut self.mem, &mut self.runtime.frames, &self.runtime.aspace);
            os.mm.read_in_lazy(&mut sp)?;
            // Program text goes into large pages here, once, for every sandbox made from this
            // snapshot (see `arch::x86_64::paging`); this VM drops its old translations of it.
            if large_pages() && os.mm.promote_text(&mut sp)? > 0 {
                crate::vstate::tlb::flush_guest_tlb(&mut self.vm, &mut self.mem)?;
            }
        }
        self.sync_dirty()?;
        let os = match &self.os {
            Some(os) => Some(crate::guestos::persist::OsState::capture(os, Some(&dir.join("fs")))?),
            None => None,
        };
        let state =
            SnapshotState { mem_size: self.mem.size(), vcpu: self.capture()?, runtime: self.runtime.clone(), os, cpu: self.cpu.clone() };
        // Write beside, then rename: `dir` may be the snapshot this VM maps, and truncating a mapped
        // file under a running guest would fault it.
        let tmp = dir.join(format!(".{}.tmp", persist::MEMORY_FILE));
        self.mem.write_image(&tmp)?;
        std::fs::rename(&tmp, dir.join(persist::MEMORY_FILE)).map_err(Error::sys("rename snapshot memory file"))?;
        persist::write_state(dir, &state)
    }

    pub fn reset(&mut self) -> Result<ResetStats> {
        self.reset_with(false)
    }

    /// [`Machine::reset`]; with `keep_files`, the writable mounts stay as they are (the guest's
    /// memory, processes, open files and registers still go back to the reset point).
    pub fn reset_with(&mut self, keep_files: bool) -> Result<ResetStats> {
        let start = Instant::now();
        let Some((vcpu, runtime)) = self.reset_point.clone() else {
            return Err(Error::ResetUnavailable(
                "this VM was booted, not restored from a snapshot; snapshot it and restore or clone that".into(),
            ));
        };
        spawn::abandon(self);
        process::kill_children(self);
        let dirty_pages = match self.reset_memory_mapped(&runtime)? {
            Some(n) => n,
            None => {
                self.sync_dirty()?;
                self.mem.discard_private()?
            }
        };
        self.ran = false;
        // The template had no shared mappings (a snapshot refuses them): every one is new.
        self.mem.windows.clear();
        vcpu.restore(&self.vcpu)?;
        self.tsd = vcpu.sregs.cr4 & crate::vstate::tsc_trap::CR4_TSD != 0;
        // The restored page tables, under the same CR3, took translations away.
        crate::vstate::tlb::request_guest_flush();
        self.runtime = runtime;
        self.exited = None;
        let ctx = self.reset_ctx.take();
        if let (Some((os_state, snap)), Some(os)) = (&self.os_reset_point, self.os.as_mut()) {
            let stdio = os.stdio.take();
            let kept = if keep_files { Some(current_mounts(os, os_state)?) } else { None };
            // The old files go first: on the sandbox's tmpfs, what it wrote is freed at once.
            os.files = Default::default();
            os.mm = Default::default();
            let writable_root = os.vfs.root_layer.is_some();
            let mut fresh = match kept {
                Some(dirs) => {
                    let mut o = os_state.rebuild(dirs)?;
                    guestos::random::diverge(&mut o);
                    // The writable root as it is, too.
                    crate::guestos::persist::keep_root(&mut os.vfs, &mut o.vfs);
                    o
                }
                None => {
                    // The old root overlay goes before its upper layer is emptied.
                    os.vfs = Default::default();
                    restore_os(os_state, snap, &self.scratch, writable_root, ctx)?
                }
            };
            fresh.stdio = stdio;
            *os = fresh;
            // Guest pids start over where the template's did.
            crate::guestos::signal::host::set_next_pid(os.proc.next_pid);
        }
        threads::count_in_new_tree(self);
        Ok(ResetStats { dirty_pages, duration: start.elapsed() })
    }

    /// The memory half of a reset for a VM without KVM's dirty log (a forked or recycled
    /// sandbox, see `lazy_dirty_log`), which stays without it: the pages the run wrote are those
    /// its entries' dirty bits name and the host wrote, plus those earlier such resets left mapped;
    /// they get the file's contents back in place, keeping the guest's translations, except the
    /// translations the restored page tables take away ([`AddressSpace::changed_translations`]),
    /// which are dropped; then the dirty bits are cleared for the next run. More pages than a
    /// reset keeps in place are all dropped, with every translation, and the VM still goes on
    /// without a log. `None`, having changed nothing, where this does not apply (a logged VM,
    /// another address space than the reset point's, `COLLIMATE_KEEP_MAPPED=0`): the caller
    /// resets with the log. See `GuestMemory::discard_private_mapped` for why.
    ///
    /// [`AddressSpace::changed_translations`]: crate::arch::x86_64::paging::AddressSpace::changed_translations
    fn reset_memory_mapped(&mut self, to: &RuntimeState) -> Result<Option<u64>> {
        if !self.vm.unlogged() || !keep_mapped() || to.aspace.root != self.runtime.aspace.root {
            return Ok(None);
        }
        self.record_dirty_bits()?;
        let mut stale = {
            let mem = &self.mem;
            self.runtime.aspace.changed_translations(mem, |gpa| mem.is_dirty(gpa), |gpa, buf| mem.read_original(gpa, buf))?
        };
        let n = match self.mem.discard_private_mapped(&stale)? {
            Some((n, let_go)) => {
                stale.extend(let_go);
                crate::vstate::tlb::invalidate_frames_exact(&self.mem, &stale)?;
                n
            }
            None => {
                // More than a reset keeps in place: every private page goes (those left mapped,
                // which may hold unrecorded writes, among them), and every translation with them
                // (the large-page region's blocks are filled, not dropped); no log still.
                self.mem.end_mapped(true);
                let n = self.mem.discard_private()?;
                crate::vstate::tlb::flush_guest_tlb(&mut self.vm, &mut self.mem)?;
                n
            }
        };
        to.aspace.clear_dirty_bits(&mut self.mem)?;
        Ok(Some(n))
    }

    pub fn read_mem(&self, gva: u64, len: u64) -> Result<Vec<u8>> {
        if len > crate::channel::MAX_FRAME as u64 / 2 {
            return Err(Error::InvalidArgument(format!("read of {len} bytes; read in pieces of at most 512 MiB")));
        }
        let mut buf = vec![0u8; len as usize];
        self.runtime.aspace.read_virt(&self.mem, gva, &mut buf, false)?;
        Ok(buf)
    }

    pub fn write_mem(&mut self, gva: u64, data: &[u8]) -> Result<()> {
        let aspace = self.runtime.aspace.clone();
        aspace.write_virt(&mut self.mem, gva, data, false)
    }

    pub fn mem_stats(&mut self) -> Result<MemStats> {
        self.sync_dirty()?;
        // private_bytes is filled in by the controller, from /proc/<pid>: the jail has no /proc.
        Ok(MemStats { private_bytes: 0, dirty_pages: self.mem.dirty().count() })
    }

    /// In a fork, after its first run: report the guest pages it touched to the parent
    /// (`prefault`), if it claimed a report.
    fn report_first_run(&mut self) {
        if let Some(slot) = self.learn.take_report() {
            slot.write(&self.mem, &self.runtime.aspace);
        }
    }

    /// In a freshly forked child: a new VM and vCPU over the inherited memory, in `state`.
    fn rebuild_after_fork(&mut self, state: &VcpuState) -> Result<()> {
        self.rebuild_after_fork_logged(state, true)
    }

    /// [`Machine::rebuild_after_fork`], the new VM dirty-logged or not (a forked sandbox's is not,
    /// until its first [`Machine::sync_dirty`]: see `prefault`).
    fn rebuild_after_fork_logged(&mut self, state: &VcpuState, logged: bool) -> Result<()> {
        let vm = KvmVm::with_log(&self.kvm, &self.mem, slot_size_for(self.runtime.frames.next, self.mem.size()), logged)?;
        let vcpu = new_vcpu(&vm, &self.cpuid)?;
        state.restore(&vcpu)?;
        // The old VM and vCPU belong to the parent's address space; dropping them here only closes our
        // copies of the descriptors and unmaps our copy of its kvm_run page.
        self.vcpu = vcpu;
        self.vm = vm;
        // The new VM has no translations: none of the pages a reset left mapped is mapped here.
        self.mem.forget_mapped();
        self.sync.reset();
        self.io_pending = false;
        self.tsd = state.sregs.cr4 & crate::vstate::tsc_trap::CR4_TSD != 0;
        crate::vstate::tlb::forget_guest_flush();
        // POSIX timers are not inherited across fork: make ours. Forget the parent's handle rather
        // than deleting it, since the id may equal the one just created.
        std::mem::forget(std::mem::replace(&mut self.preempter, Preempter::new()?));
        Ok(())
    }
}

/// Rebuild a Linux guest's OS state from a snapshot in `dir`, with private copies of its writable
/// mounts (from `dir/fs/m<i>`) in `scratch`. Its root is a writable root to be if `writable_root`
/// or the snapshot holds an upper layer (`dir/fs/root`), mounted at once with the context `ctx`.
fn restore_os(
    state: &crate::guestos::persist::OsState,
    dir: &Path,
    scratch: &ScratchRoot,
    writable_root: bool,
    ctx: Option<OwnedFd>,
) -> Result<GuestOs> {
    let mut dirs = Vec::new();
    for i in 0..state.mounts.len() {
        let src = dir.join("fs").join(format!("m{i}"));
        let copied = crate::guestos::tree::open_dir_path(&src, false).and_then(|from| {
            use std::os::fd::AsFd;
            scratch.fill(i, &state.mounts[i], from.as_fd())
        });
        let d = copied.map_err(|e| {
            if e.raw_os_error() == Some(libc::ENOSPC) {
                Error::InvalidArgument(format!(
                    "the template's writable mounts do not fit in the sandbox's disk quota ({e}); give a larger quota"
                ))
            } else {
                Error::SnapshotCorrupt { path: src.display().to_string(), reason: format!("cannot copy the writable mount: {e}") }
            }
        })?;
        dirs.push((d, scratch.label(i, &state.mounts[i])));
    }
    // Every restore and reset is a new clone of the snapshot: an unseeded CRNG gets fresh entropy.
    let mut os = state.rebuild(dirs)?;
    guestos::random::diverge(&mut os);
    let upper = dir.join("fs").join(crate::guestos::persist::ROOT_UPPER);
    let upper = if upper.is_dir() { Some(crate::guestos::tree::open_dir_path(&upper, false).map_err(Error::sys("open the snapshot's root layer"))?) } else { None };
    if writable_root || upper.is_some() {
        os.vfs.want_root_layer(upper).map_err(Error::sys("open the sandbox root"))?;
        if let Some(ctx) = ctx {
            crate::guestos::persist::mount_root(&mut os, scratch, &ctx).map_err(|e| match e {
                Error::Sys { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => Error::InvalidArgument(format!(
                    "the template's writable root does not fit in the sandbox's disk quota ({source}); give a larger quota"
                )),
                e => e,
            })?;
        }
    }
    Ok(os)
}

/// The writable mounts of `os` as they are now, in the order of `state.mounts` (what
/// `OsState::rebuild` takes), for a reset that keeps them.
fn current_mounts(os: &GuestOs, state: &crate::guestos::persist::OsState) -> Result<Vec<(OwnedFd, PathBuf)>> {
    state
        .mounts
        .iter()
        .map(|at| {
            let at = crate::guestos::vfs::join("/", at.as_bytes()).map_err(|e| Error::Remote(format!("mount {at}: errno {}", e.0)))?;
            let m = os
                .vfs
                .mounts
                .iter()
                .find(|m| m.at == at && m.writable)
                .ok_or_else(|| Error::Remote(format!("the sandbox has no writable mount at {at} to keep")))?;
            Ok((m.dir.try_clone().map_err(Error::sys("dup a writable mount"))?, m.host.clone()))
        })
        .collect()
}

/// This process's own directory under the runtime directory.
pub(crate) fn own_dir() -> ScratchRoot {
    // SAFETY: getpid cannot fail.
    ScratchRoot::Dir(crate::guestos::persist::vm_dir(unsafe { libc::getpid() }))
}

fn pidfd_open(pid: i32) -> Result<OwnedFd> {
    // SAFETY: pidfd_open takes a pid and flags; the result is checked.
    let fd = unsafe { libc::syscall(libc::SYS_pidfd_open, pid, 0) } as RawFd;
    if fd < 0 {
        return Err(Error::last_os("pidfd_open"));
    }
    // SAFETY: a new descriptor we own.
    Ok(unsafe { OwnedFd::from_raw_fd(fd) })
}

fn exit_process(code: i32) -> ! {
    crate::trace::take_counts("image");
    crate::trace::mark_n("host.exit", code as u64);
    crate::guestos::sched::leave();
    crate::guestos::futex_shared::leave();
    teardown::defer();
    // SAFETY: _exit never returns; skipping atexit handlers is deliberate (the launcher may be a Python
    // interpreter whose teardown we do not want to run in a VMM process).
    unsafe { libc::_exit(code) }
}

/// Exit a VMM process whose controller is gone, taking its private writable directories with it:
/// nobody else removes them for a process that was never handed to a controller (a spare whose
/// zygote died) or whose controller went away without a kill.
fn exit_discarding(code: i32) -> ! {
    // SAFETY: getpid cannot fail.
    let pid = unsafe { libc::getpid() };
    let _ = std::fs::remove_dir_all(crate::guestos::persist::vm_dir(pid));
    exit_process(code)
}

fn reply(chan: &mut Channel, r: Result<Response>) {
    reply_with_fds(chan, r, &[])
}

fn reply_with_fds(chan: &mut Channel, r: Result<Response>, fds: &[RawFd]) {
    let msg = r.unwrap_or_else(|e| Response::Err(RemoteError::from(&e)));
    if chan.send(&msg, fds).is_err() {
        exit_discarding(0); // controller gone
    }
}

/// A pre-forked child: already has its VM and vCPU restored and has sent `Ready`; waits for requests.
struct Spare {
    pid: i32,
    pidfd: OwnedFd,
    chan: OwnedFd,
}

impl Spare {
    /// Kill the spare, wait until it is gone, and remove its private writable directories (it had
    /// no controller to do that; it may have been killed while copying them).
    fn kill(self) {
        // SAFETY: signalling a process through a pidfd we own.
        unsafe { libc::syscall(libc::SYS_pidfd_send_signal, self.pidfd.as_raw_fd(), libc::SIGKILL, 0usize, 0u32) };
        let mut pfd = libc::pollfd { fd: self.pidfd.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        for _ in 0..100 {
            // SAFETY: one valid pollfd; readable once the process has exited.
            let rc = unsafe { libc::poll(&mut pfd, 1, 10) };
            if rc != 0 && !(rc < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR)) {
                break;
            }
        }
        let _ = std::fs::remove_dir_all(crate::guestos::persist::vm_dir(self.pid));
    }
}

/// Pre-forked children of a paused VM (the zygote pattern: Android's USAP pool does the same for app
/// processes). A fork request takes a spare, so the caller waits only for the hand-over, not for a
/// new KVM VM; the pool refills while this process is idle. Any request that changes the guest
/// discards the spares, which would otherwise be clones of a state that no longer exists.
#[derive(Default)]
struct Pool {
    spares: Vec<Spare>,
    target: usize,
}

impl Pool {
    /// Keep only the tmpfs instances the spares still to be made need (each is an empty tmpfs:
    /// dropping one frees it).
    fn trim_stock(&self, m: &mut Machine) {
        m.scratch_stock.truncate(2 * self.target.saturating_sub(self.spares.len()));
        m.overlay_stock.truncate(self.target.saturating_sub(self.spares.len()));
    }

    fn invalidate(&mut self) {
        self.spares.drain(..).for_each(Spare::kill);
    }
}

/// Largest spare pool a VM may keep.
pub const MAX_SPARES: u32 = 16;

/// Fork one child in `state`. The child never returns from here: it serves its own channel.
fn spawn_child(m: &mut Machine, state: &VcpuState, chan: &Channel, pool: &mut Pool) -> Result<Spare> {
    // The pair's shared-memory pool was pushed after its disk tmpfs.
    let scratch = match (m.scratch_stock.pop(), m.scratch_stock.pop()) {
        (Some(shm), Some(disk)) => Some((disk, shm)),
        _ => None,
    };
    if scratch.is_none() && m.quota_mode {
        return Err(Error::Protocol("no tmpfs for the child's disk quota (send AddScratch before Fork)".into()));
    }
    let ctx = if m.writable_root && scratch.is_some() {
        Some(m.overlay_stock.pop().ok_or_else(|| Error::Protocol("no overlay context for the child's writable root".into()))?)
    } else {
        None
    };
    let (ours, theirs) = Channel::pair()?;
    // SAFETY: this process is single-threaded, so the child may do anything after fork.
    let pid = unsafe { libc::fork() };
    if pid < 0 {
        return Err(Error::last_os("fork"));
    }
    if pid == 0 {
        // Child: drop every descriptor that belongs to the parent's conversations, so that each
        // peer sees EOF exactly when its own process goes away.
        drop(ours);
        lifeline::forget(); // the parent's channel, closed just below
        // SAFETY: closing the parent's channel descriptor in the child; the parent's Channel value
        // is never used again in this process (child_main does not return).
        unsafe { libc::close(chan.raw_fd()) };
        for spare in pool.spares.drain(..) {
            drop(spare); // closes our copies only; the siblings stay alive
        }
        pool.target = 0;
        child_main(m, state, theirs, scratch, ctx);
    }
    drop(theirs);
    drop((scratch, ctx)); // the child's now
    let pidfd = pidfd_open(pid)?;
    Ok(Spare { pid, pidfd, chan: ours.into_owned_fd() })
}

/// Whether the VMs of forked sandboxes and of programs loaded over a cached image start without
/// KVM's dirty log, which keeps KVM's fault handler from mapping a faulting page's writable
/// neighbours (see `prefault`); the record of written pages then comes from the page-table
/// entries' dirty bits until it is first needed ([`Machine::end_unlogged`]).
/// `COLLIMATE_LAZY_DIRTY_LOG=0` logs from the start, as before, to compare.
fn lazy_dirty_log() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_LAZY_DIRTY_LOG").is_none_or(|v| v != "0"))
}

/// Whether [`Machine::complete_io`] is turned off on a host that needs it: the upstream-KVM
/// lane's canary (`scripts/kvm-lane/job.sh`) sets `COLLIMATE_TEST_NO_IO_COMPLETION=1` to show that
/// `vm.rs`'s snapshot test fails there without the completion. For that test only: a snapshot
/// taken at an I/O exit then stores RIP at the `out`, which its restore executes again.
fn io_completion_off_for_test() -> bool {
    static OFF: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *OFF.get_or_init(|| std::env::var_os("COLLIMATE_TEST_NO_IO_COMPLETION").is_some_and(|v| v == "1"))
}

/// Whether a reset of a VM without a dirty log keeps it so and leaves the restored pages mapped
/// ([`Machine::reset_memory_mapped`]). `COLLIMATE_KEEP_MAPPED=0` resets with the log, as before,
/// to compare.
fn keep_mapped() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_KEEP_MAPPED").is_none_or(|v| v != "0"))
}

/// Fork into `n` children; each child replies `Ready` on its own channel, the parent sends the
/// controller one `Forked` message per child carrying that channel and a pidfd.
fn fork_children(m: &mut Machine, chan: &mut Channel, pool: &mut Pool, n: u32) -> Result<()> {
    if n == 0 || n > 4096 {
        return Err(Error::InvalidArgument(format!("fork of {n} children; ask for 1..=4096")));
    }
    if m.exited.is_some() {
        return Err(Error::InvalidArgument("the guest has exited; nothing to fork".into()));
    }
    m.learn.before_forks();
    let mut state = None;
    for _ in 0..n {
        let child = match pool.spares.pop() {
            Some(spare) => spare,
            None => {
                if state.is_none() {
                    m.sync_dirty()?;
                    state = Some(m.capture()?);
                }
                let st = state.as_ref().ok_or_else(|| Error::Protocol("no state".into()))?;
                spawn_child(m, st, chan, pool)?
            }
        };
        chan.send(&Response::Forked { pids: vec![child.pid] }, &[child.chan.as_raw_fd(), child.pidfd.as_raw_fd()])?;
    }
    Ok(())
}

/// Top up the spare pool by one child if the controller has nothing for us right now. Returns
/// false when a request is waiting (serve it first).
fn refill(m: &mut Machine, chan: &Channel, pool: &mut Pool) -> bool {
    let mut pfd = libc::pollfd { fd: chan.raw_fd(), events: libc::POLLIN, revents: 0 };
    // SAFETY: one valid pollfd, zero timeout.
    if unsafe { libc::poll(&mut pfd, 1, 0) } != 0 {
        return false;
    }
    // Build spares at idle priority: they must not slow down the clones that are running now (on a
    // small host the refill would otherwise take a core from them). A spare goes back to normal
    // priority when it is handed a request (see `serve`).
    if m.quota_mode && m.scratch_stock.is_empty() {
        return false; // the next Fork brings the tmpfs for the next spare
    }
    // At idle priority a busy host may leave this process without CPU for long: the lifeline ends
    // it if the controller goes meanwhile (see lifeline).
    lifeline::arm(chan.raw_fd());
    set_idle_priority(true);
    m.learn.before_forks();
    let made = m.sync_dirty().and_then(|_| m.capture()).and_then(|st| spawn_child(m, &st, chan, pool));
    set_idle_priority(false);
    lifeline::disarm();
    match made {
        Ok(spare) => pool.spares.push(spare),
        Err(_) => pool.target = 0, // no room for spares: serve without them
    }
    true
}

fn set_idle_priority(idle: bool) {
    let param = libc::sched_param { sched_priority: 0 };
    let policy = if idle { libc::SCHED_IDLE } else { libc::SCHED_OTHER };
    // SAFETY: changing this thread's own scheduling policy; failure only costs speed.
    unsafe { libc::sched_setscheduler(0, policy, &param) };
}

fn child_main(m: &mut Machine, state: &VcpuState, mut chan: Channel, scratch: Option<(OwnedFd, OwnedFd)>, ctx: Option<OwnedFd>) -> ! {
    // A spare builds itself at its zygote's idle priority: if the zygote (and so the controller)
    // goes meanwhile, the lifeline ends it (nothing is sent to it before its `Ready`).
    lifeline::arm(chan.raw_fd());
    // The siblings' tmpfs instances are not ours to hold (they would stay allocated while we live).
    m.scratch_stock.clear();
    m.overlay_stock.clear();
    let scratch = scratch.map(|(disk, shm)| (std::sync::Arc::new(disk), std::sync::Arc::new(shm)));
    m.scratch = match &scratch {
        Some((disk, shm)) => ScratchRoot::Tmpfs { disk: disk.clone(), shm: Some(shm.clone()) },
        None => own_dir(),
    };
    // Its shared anonymous memory, guest memfds and /dev/shm go in its shared-memory pool (a copy
    // of the parent's shared anonymous memory too, made just below).
    crate::vstate::shared::set_pool(scratch.as_ref().map(|(_, shm)| shm.clone()));
    // A forked sandbox gets its own copy of the writable mounts, and unless its CRNG was seeded,
    // fresh entropy: unseeded clones never share randomness.
    let privatized = match m.os.as_mut() {
        Some(os) => {
            guestos::random::diverge(os);
            crate::guestos::persist::privatize(os, &m.scratch, ctx)
                .and_then(|_| os.mm.privatize_windows(&mut m.mem).map_err(Error::sys("copy a shared mapping for a forked sandbox")))
                .map_err(|e| match e {
                    Error::Sys { source, .. } if source.raw_os_error() == Some(libc::ENOSPC) => Error::InvalidArgument(format!(
                        "the parent's writable mounts do not fit in the child's disk quota ({source}); give the child a larger quota"
                    )),
                    e => e,
                })
        }
        None => Ok(()),
    };
    m.learn.in_fork(&mut m.mem, &m.runtime.aspace);
    match privatized.and_then(|_| m.rebuild_after_fork_logged(state, !lazy_dirty_log())) {
        Ok(()) => {
            // SAFETY: getpid cannot fail.
            let pid = unsafe { libc::getpid() };
            let linux = m.is_linux();
            // The controller keeps descriptors of our tmpfs instances: it reads the usage and sets
            // the quota.
            let fds: Vec<RawFd> = scratch.iter().flat_map(|(disk, shm)| [disk.as_raw_fd(), shm.as_raw_fd()]).collect();
            lifeline::disarm();
            if chan.send(&Response::Ready { pid, linux, jail: jail::status() }, &fds).is_err() {
                exit_discarding(0);
            }
            // Built: wait at normal priority (a wait costs no CPU; at idle priority, noticing that
            // the controller is gone and exiting could take as long as the host stays busy).
            set_idle_priority(false);
        }
        Err(e) => {
            reply(&mut chan, Err(e));
            exit_discarding(1);
        }
    }
    serve(m, chan)
}

fn serve(m: &mut Machine, mut chan: Channel) -> ! {
    let mut pool = Pool::default();
    let mut normal_priority = false;
    loop {
        if pool.spares.len() < pool.target && m.exited.is_none() && refill(m, &chan, &mut pool) {
            continue;
        }
        let (req, fds) = match chan.recv::<Request>() {
            Ok(v) => v,
            Err(RecvError::Closed) => exit_discarding(0),
            Err(RecvError::TimedOut) => continue,
            Err(RecvError::Failed(_)) => exit_discarding(2),
        };
        if !normal_priority {
            set_idle_priority(false); // a spare that has been handed out
            normal_priority = true;
        }
        if req.changes_guest() {
            pool.invalidate();
            m.learn.guest_changed();
        }
        let runs = matches!(req, Request::Run { .. } | Request::AgentCall { .. } | Request::EndExec { .. });
        if runs {
            crate::trace::mark("serve.run");
        }
        process::serving(m, &chan, &pool);
        if runs {
            lifeline::arm(chan.raw_fd());
        }
        let resp = match req {
            Request::Run { timeout } => m.run(timeout).map(Response::Run),
            Request::Snapshot { dir } => spawn::settle(m).and_then(|_| jail::in_snapshot_dest(&dir, fds, |d| m.snapshot(d))).map(|_| Response::Ok),
            Request::Fork { n } => {
                m.add_scratch(fds);
                warm_image_cache(m);
                let forked = fork_children(m, &mut chan, &mut pool, n);
                pool.trim_stock(m);
                match forked {
                    Ok(()) => continue,
                    Err(e) => Err(e),
                }
            }
            Request::SparePool { n } => {
                m.add_scratch(fds);
                warm_image_cache(m);
                if n > MAX_SPARES {
                    Err(Error::InvalidArgument(format!("spare pool of {n}; at most {MAX_SPARES}")))
                } else {
                    pool.target = n as usize;
                    while pool.spares.len() > pool.target {
                        if let Some(s) = pool.spares.pop() {
                            s.kill();
                        }
                    }
                    pool.trim_stock(m);
                    Ok(Response::Ok)
                }
            }
            Request::AddScratch => {
                m.add_scratch(fds);
                Ok(Response::Ok)
            }
            Request::WritableRoot { on } => {
                // The stock came in the other shape: the spares that used it are gone already.
                m.scratch_stock.clear();
                m.overlay_stock.clear();
                m.set_writable_root(on).map(|_| Response::Ok)
            }
            Request::SetStdio => match m.os.as_mut() {
                Some(os) => {
                    // A third descriptor is the sandbox's broker socket (see `guestos::files::inet`).
                    let mut fds = fds;
                    if fds.len() == 3 {
                        if let Some(b) = fds.pop() {
                            guestos::files::inet::set_broker(os, b);
                        }
                    }
                    os.set_stdio(fds).map(|_| Response::Ok)
                }
                None => Err(Error::InvalidArgument("this VM runs no Linux program; it has no stdio".into())),
            },
            Request::Reset => {
                m.reset_ctx = fds.into_iter().next();
                m.reset().map(Response::Reset)
            }
            Request::ResetKeepFiles => m.reset_with(true).map(Response::Reset),
            Request::AgentCall { input, timeout, reseed } => match m.os.as_mut().map(|os| {
                if let Some(s) = reseed {
                    if let Some(ns) = s.wall_clock_ns {
                        os.proc.clocks.start_real_at_least(ns);
                    }
                    guestos::random::reseed(os, s.seed, s.replay);
                }
                os.agent_send(&input)
            }) {
                Some(Ok(())) => run_agent_exec(m, timeout),
                Some(Err(e)) => Err(e),
                None => Err(Error::InvalidArgument("this VM runs no Linux program; it has no agent".into())),
            },
            Request::EndExec { signal, timeout } => match m.os.is_some() {
                true => process::end_exec(m, signal).and_then(|_| run_agent_exec(m, timeout)),
                false => Err(Error::InvalidArgument("this VM runs no Linux program; it has no agent".into())),
            },
            Request::Upload { path, data, mode } => match m.os.as_ref() {
                Some(os) => os.upload(&path, &data, mode).map(|_| Response::Ok),
                None => Err(Error::InvalidArgument("this VM runs no Linux program; it has no files".into())),
            },
            Request::Download { path, max } => match m.os.as_ref() {
                Some(os) => match os.download(&path, max) {
                    Ok((fd, size)) => {
                        reply_with_fds(&mut chan, Ok(Response::FileFd { size }), &[fd.as_raw_fd()]);
                        continue;
                    }
                    Err(e) => Err(e),
                },
                None => Err(Error::InvalidArgument("this VM runs no Linux program; it has no files".into())),
            },
            Request::Reseed { seed, replay } => match m.os.as_mut() {
                Some(os) => {
                    guestos::random::reseed(os, seed, replay);
                    Ok(Response::Ok)
                }
                None => Err(Error::InvalidArgument("this VM runs no Linux program; it has no CRNG to reseed".into())),
            },
            Request::ReadMem { gva, len } => m.read_mem(gva, len).map(Response::Mem),
            Request::WriteMem { gva, data } => m.write_mem(gva, &data).map(|_| Response::Ok),
            Request::GetRegs => m.vcpu.get_regs().map(Response::Regs).map_err(Error::kvm("KVM_GET_REGS")),
            Request::SetRegs(r) => m.vcpu.set_regs(&r).map(|_| Response::Ok).map_err(Error::kvm("KVM_SET_REGS")),
            Request::VcpuState => m.capture().map(|s| Response::VcpuState(Box::new(s))),
            Request::MemStats => m.mem_stats().map(Response::MemStats),
            Request::Shutdown => {
                pool.invalidate();
                reply(&mut chan, Ok(Response::Ok));
                exit_process(0)
            }
            Request::Boot { .. } | Request::Restore { .. } | Request::Spawn { .. } => {
                Err(Error::InvalidArgument("this VMM process already has a VM".into()))
            }
        };
        lifeline::disarm();
        reply(&mut chan, resp);
        if runs {
            crate::trace::mark("serve.replied");
            m.report_first_run();
        }
    }
}

/// Before this process forks sandboxes: cache the images of the programs their commands start
/// (once; the forks inherit them, see `image_cache::warm`).
fn warm_image_cache(m: &Machine) {
    static DONE: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);
    if DONE.swap(true, std::sync::atomic::Ordering::Relaxed) {
        return;
    }
    if let Some(os) = m.os.as_ref() {
        image_cache::warm(os, m.mem.size());
    }
}

/// Entry point of a launched VMM process: serve the channel on `fd` (inherited from the launcher).
/// Never returns.
pub fn serve_fd(fd: RawFd) -> ! {
    // SAFETY: the launcher put our end of the channel on `fd` and nothing else in this process owns it.
    let mut chan = Channel::from_owned_fd(unsafe { OwnedFd::from_raw_fd(fd) });
    // SAFETY: plain fcntl/signal/prctl calls on this process.
    unsafe {
        libc::fcntl(fd, libc::F_SETFD, libc::FD_CLOEXEC);
        // Children (forked VMMs) and orphaned grandchildren are reaped by the kernel, never zombies.
        libc::signal(libc::SIGCHLD, libc::SIG_IGN);
        libc::prctl(libc::PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0);
    }
    let (mut first, fds) = match chan.recv::<Request>() {
        Ok(v) => v,
        Err(_) => exit_process(0),
    };
    if let Request::Spawn { platform: crate::protocol::Platform::Systrap, .. } = first {
        systrap::serve_first(first, fds, chan);
    }
    if let Request::Restore { dir } = &first {
        if persist::platform_of(dir) == Some(crate::protocol::Platform::Systrap) {
            systrap::serve_restore(first, chan);
        }
    }
    // Jailed before serving: everything the first request opens is opened inside (see `jail`).
    if let Err(e) = jail::enter(&mut first) {
        reply(&mut chan, Err(e));
        exit_process(1)
    }
    let machine = match first {
        Request::Boot { elf, mem_size } => Machine::boot(&elf, mem_size),
        Request::Restore { dir } => Machine::restore(&dir),
        Request::Spawn { spec, mem_size, cpus, .. } => Machine::spawn(&spec, mem_size, cpus, fds),
        _ => Err(Error::Protocol("the first request must be Boot, Spawn or Restore".into())),
    };
    match machine {
        Ok(mut m) => {
            // SAFETY: getpid cannot fail.
            let pid = unsafe { libc::getpid() };
            let linux = m.is_linux();
            reply(&mut chan, Ok(Response::Ready { pid, linux, jail: jail::status() }));
            serve(&mut m, chan)
        }
        Err(e) => {
            reply(&mut chan, Err(e));
            exit_process(1)
        }
    }
}

/// Whether snapshots map program text with large pages (`COLLIMATE_LARGE_PAGES=0` turns it off, to
/// compare; a template keeps what it was baked with).
fn large_pages() -> bool {
    std::env::var_os("COLLIMATE_LARGE_PAGES").is_none_or(|v| v != "0")
}

/// Run the agent's exec (or what is left of it after `EndExec`) as a new exec of the schedulers,
/// and return the run with the agent's reply.
fn run_agent_exec(m: &mut Machine, timeout: Duration) -> Result<Response> {
    let (replay, mono) = m.os.as_ref().map_or((false, 0), |os| (os.proc.clocks.replay, guestos::thread::now(&os.proc.clocks)));
    crate::guestos::sched::new_exec(replay, mono);
    let mut r = m.run(timeout)?;
    r.agent = m.os.as_ref().map(|os| os.agent_take()).transpose()?.unwrap_or_default();
    Ok(Response::Run(r))
}
