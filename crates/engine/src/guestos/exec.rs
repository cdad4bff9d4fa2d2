//! Loading a Linux program: ELF (static or dynamic, PIE or not), its interpreter, the initial stack.
//!
//! What Linux's `binfmt_elf` and `binfmt_script` do, without address-space randomisation:
//! - `#!interp [arg]` scripts run their interpreter with argv = [interp, arg?, path, argv[1..]];
//! - a non-PIE program (ET_EXEC) goes where its headers say, a PIE (ET_DYN) at [`PIE_BASE`];
//! - a program with PT_INTERP also gets its interpreter (ld-linux, itself ET_DYN) at [`INTERP_BASE`],
//!   and starts there; mmap then places mappings top-down below the interpreter;
//! - the heap (brk) starts at the first page above the program's highest segment;
//! - an 8 MiB stack ends at `STACK_TOP` and starts with argc, argv, envp and the auxiliary vector.
//!
//! Every mapping is a VMA in [`super::mm::Mm`], so the guest's later mmap/munmap/mprotect/brk (and
//! /proc/self/maps) see the same picture as on Linux, with the vDSO (`super::vdso`) below the stack
//! and its address in AT_SYSINFO_EHDR.

use std::io::Read;
use std::os::unix::fs::{MetadataExt, PermissionsExt};

use goblin::elf::header::{EI_CLASS, EI_DATA, ELFCLASS64, ELFDATA2LSB, EM_X86_64, ET_DYN, ET_EXEC};
use goblin::elf::program_header::{ProgramHeader, PF_R, PF_W, PF_X, PT_INTERP, PT_LOAD, PT_PHDR};
use goblin::elf::Elf;

use super::mm::{page_down, page_up, FileId, Mm, Space, Vma, MMAP_MIN_ADDR, MMAP_TOP, PROT_EXEC, PROT_READ, PROT_WRITE, TASK_SIZE};
use super::{random, signal_state, Errno, GuestOs, EACCES, EINVAL, EIO, ELOOP, ENOMEM};
use crate::arch::x86_64::layout::{PAGE_SIZE, STACK_TOP};
use crate::arch::x86_64::paging::{AddressSpace, FrameAllocator};
use crate::platform::HostSpace;
use crate::vstate::memory::GuestMemory;

const E2BIG: Errno = Errno(7);
const ENOEXEC: Errno = Errno(8);
const ELIBBAD: Errno = Errno(80);

/// Where a position-independent program is loaded (Linux's ELF_ET_DYN_BASE without randomisation).
pub const PIE_BASE: u64 = 0x5555_5555_4000;
/// Where the program interpreter is loaded; mmap allocates top-down below it.
pub const INTERP_BASE: u64 = MMAP_TOP;
/// The initial stack mapping: 8 MiB, Linux's default RLIMIT_STACK, backed up front.
pub const STACK_RESERVE: u64 = 8 << 20;
/// The largest program or interpreter file we read.
const MAX_IMAGE: u64 = 512 << 20;
/// Linux's limits on exec arguments: one string (MAX_ARG_STRLEN) and all of them (a quarter of the
/// 8 MiB stack limit).
const MAX_ARG_STRLEN: usize = 32 * PAGE_SIZE as usize;
const MAX_ARG_TOTAL: usize = 2 << 20;
/// `#!` lines are read from the first BINPRM_BUF_SIZE bytes, and scripts may nest this deep.
const BINPRM_BUF_SIZE: usize = 256;
const MAX_INTERP_DEPTH: usize = 4;

const AT_NULL: u64 = 0;
const AT_PHDR: u64 = 3;
const AT_PHENT: u64 = 4;
const AT_PHNUM: u64 = 5;
const AT_PAGESZ: u64 = 6;
const AT_BASE: u64 = 7;
const AT_FLAGS: u64 = 8;
const AT_ENTRY: u64 = 9;
const AT_UID: u64 = 11;
const AT_EUID: u64 = 12;
const AT_GID: u64 = 13;
const AT_EGID: u64 = 14;
const AT_PLATFORM: u64 = 15;
const AT_HWCAP: u64 = 16;
const AT_CLKTCK: u64 = 17;
const AT_SECURE: u64 = 23;
const AT_RANDOM: u64 = 25;
const AT_HWCAP2: u64 = 26;
const AT_EXECFN: u64 = 31;
const AT_SYSINFO_EHDR: u64 = 33;
const AT_MINSIGSTKSZ: u64 = 51;

/// Where the loaded program starts.
#[derive(Debug, Clone, Copy)]
pub struct Image {
    pub entry: u64,
    pub rsp: u64,
}

/// One ELF object mapped into the guest.
#[derive(Debug, Clone, Copy)]
struct Mapped {
    /// Load bias (0 for ET_EXEC).
    bias: u64,
    entry: u64,
    /// Guest address of the program headers (0 if no segment maps them), their count.
    phdr: u64,
    phnum: u64,
    /// The page-aligned end of the highest segment.
    end: u64,
}

/// A program file read from the sandbox.
struct Program {
    /// Its bytes: all of them ([`Reading::Whole`]), or ([`Reading::Headers`]) its start up to the end of
    /// its program headers and PT_INTERP path at least.
    bytes: std::sync::Arc<Vec<u8>>,
    /// The file's length.
    size: u64,
    /// Its normalised guest path.
    path: String,
    id: FileId,
}

/// Load the program at guest path `path` (resolved through `os.vfs`) into a fresh address space,
/// with its interpreter if it has one, and build the initial stack from `argv` and `envp`.
pub fn load(
    os: &mut GuestOs,
    mem: &mut GuestMemory,
    frames: &mut FrameAllocator,
    aspace: &AddressSpace,
    path: &[u8],
    argv: &[Vec<u8>],
    envp: &[Vec<u8>],
) -> Result<Image, Errno> {
    let p = prepare(os, path, argv, envp)?;
    commit(os, mem, frames, aspace, p, envp)
}

/// A program ready to be loaded: everything that can fail because of a missing, unreadable or
/// malformed file has been checked (execve's errors before its point of no return).
pub struct Prepared {
    prog: Program,
    interp: Option<Program>,
    argv: Vec<Vec<u8>>,
    exec_fn: Vec<u8>,
}

impl Prepared {
    /// About how many bytes loading it writes into guest memory (its files' sizes).
    pub fn image_bytes(&self) -> u64 {
        self.prog.size + self.interp.as_ref().map_or(0, |i| i.size)
    }

    /// The bytes of the program and of its interpreter (what a load of it depends on).
    pub fn files(&self) -> (&std::sync::Arc<Vec<u8>>, Option<&std::sync::Arc<Vec<u8>>>) {
        (&self.prog.bytes, self.interp.as_ref().map(|i| &i.bytes))
    }
}

/// How much of a program file a load reads into the VMM.
#[derive(Clone, Copy, PartialEq, Eq, Debug)]
pub enum Reading {
    /// The whole file: a load that copies the segments into guest memory ([`commit`], kvm).
    Whole,
    /// Its headers only: a load whose platform maps the file itself ([`commit_host`], systrap),
    /// where the segments' pages come from the host's mapping of the file. Reading a program
    /// whole there was most of an exec: `python3` (6.6 MB) took about 5 ms of a 21 ms
    /// `python3 -S -c pass` (the VMM's fresh heap pages faulted in one by one).
    Headers,
}

/// Read the program at `path` (following `#!` scripts) and its interpreter, and check their ELF
/// headers, without touching the address space.
pub fn prepare(os: &GuestOs, path: &[u8], argv: &[Vec<u8>], envp: &[Vec<u8>]) -> Result<Prepared, Errno> {
    prepare_reading(os, path, argv, envp, Reading::Whole)
}

/// [`prepare`] for [`commit_host`]: reads only the files' headers ([`Reading::Headers`]).
/// `COLLIMATE_SYSTRAP_EXEC_HEADERS=0` reads them whole, as before (read once per process; to
/// compare in benches).
pub fn prepare_headers(os: &GuestOs, path: &[u8], argv: &[Vec<u8>], envp: &[Vec<u8>]) -> Result<Prepared, Errno> {
    static WHOLE: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    let whole = *WHOLE.get_or_init(|| std::env::var_os("COLLIMATE_SYSTRAP_EXEC_HEADERS").is_some_and(|v| v == "0"));
    prepare_reading(os, path, argv, envp, if whole { Reading::Whole } else { Reading::Headers })
}

fn prepare_reading(os: &GuestOs, path: &[u8], argv: &[Vec<u8>], envp: &[Vec<u8>], read: Reading) -> Result<Prepared, Errno> {
    check_strings(argv, envp)?;
    let mut path = path.to_vec();
    let mut argv = argv.to_vec();
    let exec_fn = path.clone();
    let mut depth = 0;
    let prog = loop {
        let prog = read_program(os, &path, read)?;
        let Some((interp, arg)) = parse_shebang(&prog.bytes)? else { break prog };
        depth += 1;
        if depth > MAX_INTERP_DEPTH {
            return Err(ELOOP);
        }
        let mut next = vec![interp.clone()];
        next.extend(arg);
        next.push(path.clone());
        next.extend(argv.iter().skip(1).cloned());
        argv = next;
        path = interp;
        check_strings(&argv, envp)?;
    };
    let interp = match elf_interp(&prog, true)? {
        Some(ip) => {
            let interp = read_program(os, &ip, read)?;
            if elf_interp(&interp, false)?.is_some() {
                return Err(ELIBBAD);
            }
            Some(interp)
        }
        None => None,
    };
    Ok(Prepared { prog, interp, argv, exec_fn })
}

/// Map a prepared program into the (empty) address space and build its stack.
pub fn commit(
    os: &mut GuestOs,
    mem: &mut GuestMemory,
    frames: &mut FrameAllocator,
    aspace: &AddressSpace,
    p: Prepared,
    envp: &[Vec<u8>],
) -> Result<Image, Errno> {
    commit_laid(os, mem, frames, aspace, p, envp, None)
}

/// [`commit`], where `laid` (if given) says the program's files are already mapped in `mem`,
/// `frames` and `aspace`: what [`lay_out`] returned for the same files.
pub fn commit_laid(
    os: &mut GuestOs,
    mem: &mut GuestMemory,
    frames: &mut FrameAllocator,
    aspace: &AddressSpace,
    p: Prepared,
    envp: &[Vec<u8>],
    laid: Option<Laid>,
) -> Result<Image, Errno> {
    let Prepared { prog, interp, argv, exec_fn } = p;
    let mut sp = Space::new(mem, frames, aspace);
    let (main, entry, at_base) = match laid {
        Some(l) => {
            os.mm = l.mm;
            (l.main, l.entry, l.at_base)
        }
        None => {
            os.mm = Mm::default();
            map_program(&mut os.mm, &mut sp, &prog, interp.as_ref())?
        }
    };
    finish(os, &mut sp, Loaded { prog: &prog, main, entry, at_base, argv: &argv, exec_fn: &exec_fn }, envp)
}

/// What a load mapped, and the process it starts: the rest of it ([`finish`]) is the same on
/// every platform.
struct Loaded<'a> {
    prog: &'a Program,
    main: Mapped,
    entry: u64,
    at_base: u64,
    argv: &'a [Vec<u8>],
    exec_fn: &'a [u8],
}

/// The platform half of a load's last steps ([`finish`]).
trait LoadSpace {
    /// Map [lo, hi) as the stack, readable and writable, and record it in `mm`.
    fn map_stack(&mut self, mm: &mut Mm, lo: u64, hi: u64) -> Result<(), Errno>;
    /// Map the vDSO; its address for AT_SYSINFO_EHDR (0: none).
    fn map_vdso(&mut self, mm: &mut Mm) -> Result<u64, Errno>;
    /// Write the initial stack's bytes at `va`.
    fn write(&mut self, va: u64, data: &[u8]) -> Result<(), Errno>;
    /// The guest's memory, for the facts the process table publishes.
    fn memory(&mut self) -> crate::platform::Memory<'_>;
}

impl LoadSpace for Space<'_> {
    fn map_stack(&mut self, mm: &mut Mm, lo: u64, hi: u64) -> Result<(), Errno> {
        Mm::populate(self, lo, hi, PROT_READ | PROT_WRITE)?;
        mm.insert(lo, Vma::anon(hi, PROT_READ | PROT_WRITE, "[stack]"));
        Ok(())
    }

    fn map_vdso(&mut self, mm: &mut Mm) -> Result<u64, Errno> {
        super::vdso::map(mm, self)
    }

    fn write(&mut self, va: u64, data: &[u8]) -> Result<(), Errno> {
        self.aspace.write_virt(self.mem, va, data, false).map_err(|_| E2BIG)
    }

    fn memory(&mut self) -> crate::platform::Memory<'_> {
        crate::platform::Memory::Kvm(crate::platform::kvm::Memory::new(&mut *self.mem, &mut *self.frames, self.aspace))
    }
}

/// The vDSO is mapped through the platform (`vdso::map_host`).
impl LoadSpace for dyn HostSpace + '_ {
    fn map_stack(&mut self, mm: &mut Mm, lo: u64, hi: u64) -> Result<(), Errno> {
        mm.host_map(self, lo, Vma::anon(hi, PROT_READ | PROT_WRITE, "[stack]"), None)
    }

    fn map_vdso(&mut self, mm: &mut Mm) -> Result<u64, Errno> {
        super::vdso::map_host(mm, self)
    }

    fn write(&mut self, va: u64, data: &[u8]) -> Result<(), Errno> {
        HostSpace::write(self, va, data)
    }

    fn memory(&mut self) -> crate::platform::Memory<'_> {
        crate::platform::Memory::Host(self)
    }
}

/// The end of a load, once the program and its interpreter are mapped: the heap starts after the
/// program, the stack and the vDSO are mapped, the initial stack (arguments, environment, auxv)
/// written, and the process's new name and arguments published.
fn finish<S: LoadSpace + ?Sized>(os: &mut GuestOs, sp: &mut S, l: Loaded, envp: &[Vec<u8>]) -> Result<Image, Errno> {
    let main = l.main;
    os.mm.brk_start = main.end;
    os.mm.brk = main.end;
    os.mm.mmap_top = INTERP_BASE;

    let stack_lo = STACK_TOP - STACK_RESERVE;
    if os.mm.overlaps(stack_lo, STACK_TOP) {
        return Err(ENOMEM);
    }
    sp.map_stack(&mut os.mm, stack_lo, STACK_TOP)?;
    let vdso = sp.map_vdso(&mut os.mm)?;

    let mut random = [0u8; 16];
    random::random_bytes(&mut os.proc, &mut random)?;
    let aux = AuxInfo { main, entry: main.entry, at_base: l.at_base, random, uid: os.proc.uid, gid: os.proc.gid, vdso };
    let mut write = |va: u64, data: &[u8]| sp.write(va, data);
    let (rsp, args_area) = build_stack(&mut write, l.argv, envp, l.exec_fn, &aux)?;
    os.proc.exe = l.prog.path.clone();
    os.proc.set_comm_from_path(l.exec_fn);
    os.proc.args_area = args_area;
    super::proctab::publish(&super::proctab::own_facts(os, &sp.memory(), true), true);
    Ok(Image { entry: l.entry, rsp })
}

/// The part of a load that depends only on the files, not on the process, its arguments or
/// environment: the program's and its interpreter's segments, into `mm` (fresh). Returns the
/// program's mapping, the entry point and the interpreter's base.
fn map_program(mm: &mut Mm, sp: &mut Space, prog: &Program, interp: Option<&Program>) -> Result<(Mapped, u64, u64), Errno> {
    let (main, _) = map_elf(mm, sp, prog, PIE_BASE, true)?;
    let (entry, at_base) = match interp {
        Some(interp) => {
            let (m, _) = map_elf(mm, sp, interp, INTERP_BASE, false)?;
            (m.entry, m.bias)
        }
        None => (main.entry, 0),
    };
    Ok((main, entry, at_base))
}

/// What [`map_program`] leaves besides the memory it wrote (see [`lay_out`]).
#[derive(Clone, Debug)]
pub struct Laid {
    mm: Mm,
    main: Mapped,
    entry: u64,
    at_base: u64,
}

/// What [`commit`] does first, in fresh memory laid out by `setup_address_space`: map the
/// program's files. For `vmm::image_cache`, which keeps the memory, the frame allocator and
/// address space, and this result, and gives them to [`commit_laid`] for the next load of the
/// same files: the same code would have written the same bytes.
pub fn lay_out(mem: &mut GuestMemory, frames: &mut FrameAllocator, aspace: &AddressSpace, p: &Prepared) -> Result<Laid, Errno> {
    let mut sp = Space::new(mem, frames, aspace);
    let mut mm = Mm::default();
    let (main, entry, at_base) = map_program(&mut mm, &mut sp, &p.prog, p.interp.as_ref())?;
    Ok(Laid { mm, main, entry, at_base })
}

/// [`commit`] on a platform whose address space the host kernel keeps (systrap): whatever the
/// old program mapped goes, the segments become private mappings of the program's files (the host
/// kernel faults their pages in), the stack is anonymous memory written through the platform.
/// There is no vDSO (AT_SYSINFO_EHDR 0): the guest's clock reads are syscalls.
pub fn commit_host(os: &mut GuestOs, h: &mut dyn HostSpace, p: Prepared, envp: &[Vec<u8>]) -> Result<Image, Errno> {
    let Prepared { prog, interp, argv, exec_fn } = p;
    let prog_fd = open_program(os, &prog)?;
    let interp_fd = interp.as_ref().map(|i| open_program(os, i)).transpose()?;
    // The old image goes in as few unmaps as its mappings allow: adjacent mappings together (each
    // unmap is a round trip to the stub on systrap).
    let mut old: Vec<(u64, u64)> = Vec::new();
    for (&start, v) in os.mm.vmas.iter() {
        match old.last_mut() {
            Some(last) if last.1 == start => last.1 = v.end,
            _ => old.push((start, v.end)),
        }
    }
    crate::trace::mark_n("exec.unmaps", old.len() as u64);
    for (start, end) in old {
        h.unmap(start, end - start)?;
    }
    os.mm = Mm::default();
    let mut load = |mm: &mut Mm, prog: &Program, fd: &std::os::fd::OwnedFd, base: u64, main: bool| {
        use std::os::fd::AsRawFd;
        map_elf_with(mm, prog, base, main, &mut |mm, ph, bias| map_segment_host(mm, h, prog, fd.as_raw_fd(), ph, bias))
    };
    let (main, _) = load(&mut os.mm, &prog, &prog_fd, PIE_BASE, true)?;
    let (entry, at_base) = match (&interp, &interp_fd) {
        (Some(i), Some(fd)) => {
            let (m, _) = load(&mut os.mm, i, fd, INTERP_BASE, false)?;
            (m.entry, m.bias)
        }
        _ => (main.entry, 0),
    };
    finish(os, h, Loaded { prog: &prog, main, entry, at_base, argv: &argv, exec_fn: &exec_fn }, envp)
}

/// The program file again, for mapping (the loader read its headers before).
fn open_program(os: &GuestOs, prog: &Program) -> Result<std::os::fd::OwnedFd, Errno> {
    let (fd, _) = os.vfs.open_path("/", prog.path.as_bytes(), libc::O_RDONLY, 0)?;
    Ok(fd)
}

/// Where a PT_LOAD segment goes, the same on every platform: its protection, its bytes [va,
/// file_end) from the file and [file_end, mem_end) zero, in the pages [start, end).
#[derive(Clone, Copy)]
struct Segment {
    prot: u32,
    va: u64,
    start: u64,
    file_end: u64,
    mem_end: u64,
    end: u64,
}

impl Segment {
    fn of(ph: &ProgramHeader, bias: u64) -> Result<Segment, Errno> {
        let va = ph.p_vaddr.wrapping_add(bias);
        let mem_end = va + ph.p_memsz;
        Ok(Segment { prot: prot_of(ph), va, start: page_down(va), file_end: va + ph.p_filesz, mem_end, end: page_up(mem_end).ok_or(ENOEXEC)? })
    }

    /// Old linkers let two segments share a page: if the previous segment maps the first page,
    /// `protect` gives it both segments' rights (the union, passed to it) and it is not mapped
    /// again. Returns the first page this segment maps itself.
    fn share_first_page(&self, mm: &mut Mm, protect: impl FnOnce(&mut Mm, u32) -> Result<(), Errno>) -> Result<u64, Errno> {
        let Some((_, v)) = mm.vma_at(self.start) else { return Ok(self.start) };
        let both = v.prot | self.prot;
        protect(mm, both)?;
        Ok(self.start + PAGE_SIZE)
    }

    /// The new pages [first_new, end) (which must be free: ENOEXEC): where the file's pages end,
    /// and the VMA of the file's part (named after the program, at its file offset), if any; the
    /// pages past it are the bss's, anonymous.
    fn new_pages(&self, mm: &Mm, prog: &Program, ph: &ProgramHeader, first_new: u64) -> Result<(u64, Option<Vma>), Errno> {
        if mm.overlaps(first_new, self.end) {
            return Err(ENOEXEC);
        }
        let file_pages_end = page_up(self.file_end).ok_or(ENOEXEC)?.clamp(first_new, self.end);
        let file = (first_new < file_pages_end).then(|| {
            let offset = page_down(ph.p_offset) + (first_new - self.start);
            Vma { end: file_pages_end, prot: self.prot, shared: false, name: prog.path.clone(), file: Some(prog.id), offset, lazy: None, window: None, pristine: false }
        });
        Ok((file_pages_end, file))
    }
}

/// [`map_segment`] on a host-kept address space: the file pages are a private mapping of the
/// program file, the bss pages past them anonymous; the few bytes a kernel writes itself (a page
/// two segments share, the zeros after the file bytes in their last page) go through the
/// platform, with the page made writable for the time of the write.
fn map_segment_host(mm: &mut Mm, h: &mut dyn HostSpace, prog: &Program, file: std::os::fd::RawFd, ph: &ProgramHeader, bias: u64) -> Result<(), Errno> {
    let seg = Segment::of(ph, bias)?;
    let Segment { prot, va, start, file_end, mem_end, end } = seg;
    let first_new = seg.share_first_page(mm, |mm, both| mm.host_mprotect(h, start, PAGE_SIZE, both).map(|_| ()))?;
    if first_new < end {
        let (file_pages_end, file_vma) = seg.new_pages(mm, prog, ph, first_new)?;
        if let Some(vma) = file_vma {
            let offset = vma.offset;
            mm.host_map(h, first_new, vma, Some((file, offset)))?;
        }
        if file_pages_end < end {
            mm.host_map(h, file_pages_end, Vma::anon(end, prot, ""), None)?;
        }
    }
    if first_new != start {
        let upto = file_end.min(first_new);
        if upto > va {
            let off = ph.p_offset as usize;
            poke(mm, h, va, &prog.range(file, off as u64, (upto - va) as usize)?)?;
        }
    }
    // As Linux's loader: with a bss, the rest of the page after the file bytes reads as zeros up to
    // the page's end, not only to the segment's (ld.so's early allocator uses that slack past its
    // `_end`, expecting zeros).
    if mem_end > file_end && file_end % PAGE_SIZE != 0 {
        let zero_end = page_up(file_end).ok_or(ENOEXEC)?;
        poke(mm, h, file_end, &vec![0u8; (zero_end - file_end) as usize])?;
    }
    Ok(())
}

/// Write `data` (within one VMA) the way a kernel does, whatever the page's protection.
fn poke(mm: &Mm, h: &mut dyn HostSpace, va: u64, data: &[u8]) -> Result<(), Errno> {
    let prot = mm.vma_at(va).map(|(_, v)| v.prot).ok_or(ENOEXEC)?;
    let (lo, hi) = (page_down(va), page_up(va + data.len() as u64).ok_or(ENOEXEC)?);
    if prot & PROT_WRITE == 0 {
        h.protect(lo, hi - lo, prot | PROT_WRITE)?;
    }
    h.write(va, data)?;
    if prot & PROT_WRITE == 0 {
        h.protect(lo, hi - lo, prot)?;
    }
    Ok(())
}

/// Reject argument lists Linux would refuse (E2BIG) or could not represent (a NUL inside a string).
fn check_strings(argv: &[Vec<u8>], envp: &[Vec<u8>]) -> Result<(), Errno> {
    let mut total = 0usize;
    for s in argv.iter().chain(envp) {
        if s.contains(&0) {
            return Err(EINVAL);
        }
        if s.len() + 1 > MAX_ARG_STRLEN {
            return Err(E2BIG);
        }
        total += s.len() + 1 + 8;
    }
    if total > MAX_ARG_TOTAL {
        return Err(E2BIG);
    }
    Ok(())
}

/// Open and read a program file (all of it or its headers, `read`): a regular file with an
/// execute bit.
fn read_program(os: &GuestOs, path: &[u8], read: Reading) -> Result<Program, Errno> {
    let (fd, gpath) = os.vfs.open_path(&os.proc.cwd, path, libc::O_RDONLY, 0)?;
    let mut f = std::fs::File::from(fd);
    let mut md = f.metadata().map_err(|e| Errno::from_io(&e))?;
    // An image file under a writable root: read as the image's, whose identity every sandbox of
    // the template shares (the cache below hits; see `Vfs::image_file`).
    if let Some(img) = os.vfs.image_file(&gpath) {
        let img = std::fs::File::from(img);
        if let Some(m) = img.metadata().ok().filter(|m| m.len() == md.len() && m.mtime() == md.mtime() && m.mtime_nsec() == md.mtime_nsec()) {
            (f, md) = (img, m);
        }
    }
    if !md.is_file() || md.permissions().mode() & 0o111 == 0 {
        return Err(EACCES);
    }
    if md.len() > MAX_IMAGE {
        return Err(ENOMEM);
    }
    let id = FileId { dev: md.dev(), ino: md.ino() };
    let key = CacheKey { id, size: md.len(), mtime: (md.mtime(), md.mtime_nsec()), ctime: (md.ctime(), md.ctime_nsec()) };
    let size = md.len();
    if let Some(bytes) = cached(&key) {
        return Ok(Program { bytes, size, path: gpath, id });
    }
    if read == Reading::Headers {
        let bytes = std::sync::Arc::new(read_head(&f, size).map_err(|e| Errno::from_io(&e))?);
        return Ok(Program { bytes, size, path: gpath, id });
    }
    let mut bytes = Vec::with_capacity(size as usize);
    f.by_ref().take(MAX_IMAGE).read_to_end(&mut bytes).map_err(|e| Errno::from_io(&e))?;
    // A file that changed while it was read (in a writable directory): what was read decides.
    let size = bytes.len() as u64;
    let bytes = std::sync::Arc::new(bytes);
    remember(key, &bytes);
    Ok(Program { bytes, size, path: gpath, id })
}

/// The first read of a program's headers: the shebang line's 256 bytes, and the ELF and program
/// headers of any ordinary object.
const HEAD: u64 = 8 << 10;

/// The start of a program file of `size` bytes, up to the end of its program headers and of its
/// PT_INTERP path (all that [`prepare`] and [`commit_host`] read of it besides the bytes of a
/// page two segments share, which [`Program::range`] reads then). A file that is not an ELF object
/// (a script, garbage) gives its first [`HEAD`] bytes; the checks after say what it is.
fn read_head(f: &std::fs::File, size: u64) -> std::io::Result<Vec<u8>> {
    let mut want = size.min(HEAD);
    // At most three reads: the first page; the program headers; the PT_INTERP they point to
    // (headers that still point further are malformed, and the checks after refuse them).
    let mut reads = 0;
    loop {
        reads += 1;
        let mut b = vec![0u8; want as usize];
        std::os::unix::fs::FileExt::read_exact_at(f, &mut b, 0)?;
        let need = head_end(&b).unwrap_or(0).min(size);
        if need <= want || reads == 3 {
            return Ok(b);
        }
        want = need;
    }
}

/// Where the headers [`read_head`] must cover end, as far as `b` shows them.
fn head_end(b: &[u8]) -> Option<u64> {
    let hdr = Elf::parse_header(b).ok()?;
    let ph_end = hdr.e_phoff.checked_add(u64::from(hdr.e_phnum).checked_mul(u64::from(hdr.e_phentsize))?)?;
    if ph_end > b.len() as u64 {
        return Some(ph_end);
    }
    let (_, phdrs) = parse_elf(b).ok()?;
    let interp_end = phdrs.iter().filter(|p| p.p_type == PT_INTERP).filter_map(|p| p.p_offset.checked_add(p.p_filesz)).max().unwrap_or(0);
    Some(ph_end.max(interp_end))
}

impl Program {
    /// `len` of the file's bytes from `off`: from those read, else from the file (`fd`, open on
    /// it) if only its headers were read.
    fn range(&self, fd: std::os::fd::RawFd, off: u64, len: usize) -> Result<std::borrow::Cow<'_, [u8]>, Errno> {
        let end = off.checked_add(len as u64).filter(|&e| e <= self.size).ok_or(ENOEXEC)?;
        if let Some(b) = self.bytes.get(off as usize..end as usize) {
            return Ok(std::borrow::Cow::Borrowed(b));
        }
        let mut b = vec![0u8; len];
        // SAFETY: `fd` is an open descriptor the caller holds; the buffer is `len` bytes.
        let n = unsafe { libc::pread(fd, b.as_mut_ptr().cast(), len, off as libc::off_t) };
        if n != len as isize {
            return Err(EIO);
        }
        Ok(std::borrow::Cow::Owned(b))
    }
}

/// What identifies a program file's contents: the file, its size, and its modification and
/// change times (a write or a rename over it changes them).
#[derive(Clone, Copy, PartialEq, Eq)]
struct CacheKey {
    id: FileId,
    size: u64,
    mtime: (i64, i64),
    ctime: (i64, i64),
}

/// The program files this VMM process read last, kept for the next exec of the same file: the
/// processes it forks (the programs a shell or the agent spawns) inherit them. A program is read
/// whole (busybox: 2 MB, 1.3 ms here) before it is copied into guest memory; this skips the read.
static CACHE: std::sync::Mutex<Vec<(CacheKey, std::sync::Arc<Vec<u8>>)>> = std::sync::Mutex::new(Vec::new());
/// Programs kept, and the largest kept.
const CACHE_FILES: usize = 8;
const CACHE_MAX_FILE: u64 = 64 << 20;

fn cached(key: &CacheKey) -> Option<std::sync::Arc<Vec<u8>>> {
    let c = CACHE.lock().ok()?;
    c.iter().find(|(k, _)| k == key).map(|(_, b)| b.clone())
}

fn remember(key: CacheKey, bytes: &std::sync::Arc<Vec<u8>>) {
    if key.size > CACHE_MAX_FILE {
        return;
    }
    if let Ok(mut c) = CACHE.lock() {
        c.retain(|(k, _)| k.id != key.id);
        if c.len() >= CACHE_FILES {
            c.remove(0);
        }
        c.push((key, bytes.clone()));
    }
}

/// A script's interpreter and its optional argument.
type Shebang = (Vec<u8>, Option<Vec<u8>>);

/// `#!interp [arg]` from the start of a file: `None` if it is not a script. As Linux: the line is
/// read from the first 256 bytes, the interpreter ends at the first blank, and everything after
/// it (trimmed) is one optional argument.
fn parse_shebang(bytes: &[u8]) -> Result<Option<Shebang>, Errno> {
    if !bytes.starts_with(b"#!") {
        return Ok(None);
    }
    let head = &bytes[2..bytes.len().min(BINPRM_BUF_SIZE)];
    let line = match head.iter().position(|&b| b == b'\n') {
        Some(i) => &head[..i],
        None => {
            // A line cut by the buffer is only usable if the interpreter itself was not cut.
            let trimmed = head.iter().position(|&b| b != b' ' && b != b'\t').map_or(&head[..0], |i| &head[i..]);
            if !trimmed.iter().any(|&b| b == b' ' || b == b'\t') && bytes.len() > BINPRM_BUF_SIZE {
                return Err(ENOEXEC);
            }
            head
        }
    };
    let line = match line.iter().position(|&b| b == 0) {
        Some(i) => &line[..i],
        None => line,
    };
    let blank = |b: &u8| *b == b' ' || *b == b'\t';
    let start = line.iter().position(|b| !blank(b)).ok_or(ENOEXEC)?;
    let line = &line[start..];
    let end = line.iter().position(blank).unwrap_or(line.len());
    let interp = line[..end].to_vec();
    let rest = &line[end..];
    let arg = match (rest.iter().position(|b| !blank(b)), rest.iter().rposition(|b| !blank(b))) {
        (Some(a), Some(b)) => Some(rest[a..=b].to_vec()),
        _ => None,
    };
    Ok(Some((interp, arg)))
}

fn prot_of(ph: &ProgramHeader) -> u32 {
    let mut p = 0;
    if ph.p_flags & PF_R != 0 {
        p |= PROT_READ;
    }
    if ph.p_flags & PF_W != 0 {
        p |= PROT_WRITE;
    }
    if ph.p_flags & PF_X != 0 {
        p |= PROT_EXEC;
    }
    p
}

/// The ELF header and program headers of an x86-64 executable or shared object (ENOEXEC if it is
/// not one).
fn parse_elf(bytes: &[u8]) -> Result<(goblin::elf::Header, Vec<ProgramHeader>), Errno> {
    let hdr = Elf::parse_header(bytes).map_err(|_| ENOEXEC)?;
    if hdr.e_ident[EI_CLASS] != ELFCLASS64
        || hdr.e_ident[EI_DATA] != ELFDATA2LSB
        || hdr.e_machine != EM_X86_64
        || !(hdr.e_type == ET_EXEC || hdr.e_type == ET_DYN)
        || hdr.e_phentsize as usize != std::mem::size_of::<goblin::elf64::program_header::ProgramHeader>()
    {
        return Err(ENOEXEC);
    }
    let ctx = goblin::container::Ctx::new(goblin::container::Container::Big, goblin::container::Endian::Little);
    let phoff = usize::try_from(hdr.e_phoff).map_err(|_| ENOEXEC)?;
    if phoff > bytes.len() {
        return Err(ENOEXEC);
    }
    let phdrs = ProgramHeader::parse(bytes, phoff, hdr.e_phnum as usize, ctx).map_err(|_| ENOEXEC)?;
    Ok((hdr, phdrs))
}

/// The PT_INTERP path of an ELF object, if it has one.
fn interp_path(bytes: &[u8], phdrs: &[ProgramHeader]) -> Result<Option<Vec<u8>>, Errno> {
    match phdrs.iter().find(|p| p.p_type == PT_INTERP) {
        Some(p) => {
            let s = usize::try_from(p.p_offset).map_err(|_| ENOEXEC)?;
            let e = p.p_offset.checked_add(p.p_filesz).filter(|&e| e <= bytes.len() as u64).ok_or(ENOEXEC)? as usize;
            let raw = bytes.get(s..e).ok_or(ENOEXEC)?;
            let path = &raw[..raw.iter().position(|&b| b == 0).unwrap_or(raw.len())];
            if path.is_empty() || path.len() >= super::vfs::PATH_MAX {
                return Err(ENOEXEC);
            }
            Ok(Some(path.to_vec()))
        }
        None => Ok(None),
    }
}

/// Check an ELF object the way `map_elf` will (headers, loadable segments inside the file) and
/// return its PT_INTERP path (only asked for the main program).
fn elf_interp(prog: &Program, main: bool) -> Result<Option<Vec<u8>>, Errno> {
    let bytes = &prog.bytes[..];
    let (_, phdrs) = parse_elf(bytes)?;
    let mut any = false;
    for ph in phdrs.iter().filter(|p| p.p_type == PT_LOAD) {
        any = true;
        ph.p_vaddr.checked_add(ph.p_memsz).and_then(page_up).ok_or(ENOEXEC)?;
        let file_end = ph.p_offset.checked_add(ph.p_filesz).ok_or(ENOEXEC)?;
        if ph.p_filesz > ph.p_memsz || file_end > prog.size || ph.p_vaddr % PAGE_SIZE != ph.p_offset % PAGE_SIZE {
            return Err(ENOEXEC);
        }
    }
    if !any {
        return Err(ENOEXEC);
    }
    if main {
        interp_path(bytes, &phdrs)
    } else {
        Ok(None)
    }
}

/// Map an ELF object's PT_LOAD segments; an ET_DYN object goes at `base`. Returns where it went and
/// its PT_INTERP path, if any (only asked for the main program).
fn map_elf(mm: &mut Mm, sp: &mut Space, prog: &Program, base: u64, main: bool) -> Result<(Mapped, Option<Vec<u8>>), Errno> {
    map_elf_with(mm, prog, base, main, &mut |mm, ph, bias| map_segment(mm, sp, prog, ph, bias))
}

/// How [`map_elf_with`] maps one PT_LOAD segment (given the load bias): the platform's way.
type SegmentMapper<'a> = dyn FnMut(&mut Mm, &ProgramHeader, u64) -> Result<(), Errno> + 'a;

/// [`map_elf`] with the segments mapped by `segment`.
fn map_elf_with(mm: &mut Mm, prog: &Program, base: u64, main: bool, segment: &mut SegmentMapper) -> Result<(Mapped, Option<Vec<u8>>), Errno> {
    let bytes = &prog.bytes;
    let (hdr, phdrs) = parse_elf(bytes)?;
    let loads: Vec<&ProgramHeader> = phdrs.iter().filter(|p| p.p_type == PT_LOAD).collect();
    if loads.is_empty() {
        return Err(ENOEXEC);
    }
    let mut lo = u64::MAX;
    let mut hi = 0u64;
    for ph in &loads {
        let end = ph.p_vaddr.checked_add(ph.p_memsz).ok_or(ENOEXEC)?;
        let file_end = ph.p_offset.checked_add(ph.p_filesz).ok_or(ENOEXEC)?;
        if ph.p_filesz > ph.p_memsz || file_end > prog.size || ph.p_vaddr % PAGE_SIZE != ph.p_offset % PAGE_SIZE {
            return Err(ENOEXEC);
        }
        lo = lo.min(page_down(ph.p_vaddr));
        hi = hi.max(page_up(end).ok_or(ENOEXEC)?);
    }
    let bias = if hdr.e_type == ET_DYN { base.wrapping_sub(lo) } else { 0 };
    let (lo_b, hi_b) = (lo.wrapping_add(bias), hi.wrapping_add(bias));
    if lo_b < MMAP_MIN_ADDR || hi_b > TASK_SIZE || lo_b >= hi_b {
        return Err(EINVAL);
    }
    if mm.overlaps(lo_b, hi_b) {
        return Err(ENOMEM);
    }

    for ph in &loads {
        segment(mm, ph, bias)?;
    }

    let phdr_va = phdrs
        .iter()
        .find(|p| p.p_type == PT_PHDR)
        .map(|p| p.p_vaddr)
        .or_else(|| {
            loads
                .iter()
                .find(|p| p.p_offset <= hdr.e_phoff && hdr.e_phoff < p.p_offset + p.p_filesz)
                .map(|p| p.p_vaddr + (hdr.e_phoff - p.p_offset))
        })
        .map_or(0, |v| v.wrapping_add(bias));
    let interp = if main { interp_path(bytes, &phdrs)? } else { None };
    let m = Mapped { bias, entry: hdr.e_entry.wrapping_add(bias), phdr: phdr_va, phnum: hdr.e_phnum as u64, end: hi_b };
    Ok((m, interp))
}

/// Map one PT_LOAD segment: frames, file bytes, zeroed bss, VMAs (the file part named after the
/// program, the bss pages past it anonymous, as Linux shows them).
fn map_segment(mm: &mut Mm, sp: &mut Space, prog: &Program, ph: &ProgramHeader, bias: u64) -> Result<(), Errno> {
    let seg = Segment::of(ph, bias)?;
    let Segment { prot, va, start, file_end, mem_end, end } = seg;
    let first_new = seg.share_first_page(mm, |mm, both| mm.mprotect(sp, start, PAGE_SIZE, both).map(|_| ()))?;
    if first_new < end {
        let (file_pages_end, file_vma) = seg.new_pages(mm, prog, ph, first_new)?;
        Mm::populate(sp, first_new, end, prot)?;
        if let Some(vma) = file_vma {
            mm.insert(first_new, vma);
        }
        if file_pages_end < end {
            mm.insert(file_pages_end, Vma::anon(end, prot, ""));
        }
    }
    // The file bytes: from the start of the page (as a file mapping shows them) unless that page
    // belongs to the previous segment too.
    let copy_va = if first_new == start { start } else { va };
    let copy_off = (ph.p_offset - (va - copy_va)) as usize;
    let copy_end = (ph.p_offset + ph.p_filesz) as usize;
    let err = |_| EINVAL;
    // A load that copies needs the whole file ([`Reading::Whole`]).
    let bytes = prog.bytes.get(copy_off..copy_end).ok_or(ENOEXEC)?;
    sp.aspace.write_virt(sp.mem, copy_va, bytes, false).map_err(err)?;
    // bss in the page the file bytes end in (a fresh page is zero already; a shared one may not be).
    if mem_end > file_end {
        let zero_end = page_up(file_end).ok_or(ENOEXEC)?.min(mem_end);
        let zeros = vec![0u8; (zero_end - file_end) as usize];
        sp.aspace.write_virt(sp.mem, file_end, &zeros, false).map_err(err)?;
    }
    Ok(())
}

/// What the auxiliary vector says about the program.
struct AuxInfo {
    main: Mapped,
    entry: u64,
    at_base: u64,
    random: [u8; 16],
    uid: [u32; 4],
    gid: [u32; 4],
    /// The vDSO's ELF header.
    vdso: u64,
}

/// The host CPU's feature bits (CPUID leaf 1, EDX), as Linux reports them in AT_HWCAP.
fn hwcap() -> u64 {
    #[allow(unused_unsafe)]
    // SAFETY: CPUID leaf 1 exists on every x86-64 CPU and has no side effects.
    let r = unsafe { std::arch::x86_64::__cpuid(1) };
    r.edx as u64
}

/// Write the initial stack below `STACK_TOP`; returns rsp (16-byte aligned, pointing at argc)
/// and where the argv and envp strings are (`Proc::args_area`).
///
/// Layout, from the top: 8 zero bytes, the exec file name, the argv and envp strings, "x86_64",
/// 16 random bytes, padding, then auxv, envp, argv and argc growing down to rsp.
fn build_stack(sp: &mut StackWriter, argv: &[Vec<u8>], envp: &[Vec<u8>], exec_fn: &[u8], aux: &AuxInfo) -> Result<(u64, [u64; 3]), Errno> {
    let mut top = STACK_TOP - 8;
    let mut push = |sp: &mut StackWriter, data: &[u8]| -> Result<u64, Errno> {
        top -= data.len() as u64;
        sp(top, data).map_err(|_| E2BIG)?;
        Ok(top)
    };
    let cstr = |s: &[u8]| {
        let mut v = s.to_vec();
        v.push(0);
        v
    };
    push(sp, &[0u8; 8])?;
    let execfn = push(sp, &cstr(exec_fn))?;
    let mut strings = Vec::new();
    let mut offs = Vec::with_capacity(argv.len() + envp.len());
    for s in argv.iter().chain(envp) {
        offs.push(strings.len() as u64);
        strings.extend_from_slice(s);
        strings.push(0);
    }
    let strings_at = push(sp, &strings)?;
    let argv_bytes: u64 = argv.iter().map(|s| s.len() as u64 + 1).sum();
    let args_area = [strings_at, strings_at + argv_bytes, strings_at + strings.len() as u64];
    let ptrs: Vec<u64> = offs.iter().map(|o| strings_at + o).collect();
    let (argv_p, envp_p) = ptrs.split_at(argv.len());
    let platform = push(sp, b"x86_64\0")?;
    let random = push(sp, &aux.random)?;

    let auxv: [(u64, u64); 21] = [
        (AT_SYSINFO_EHDR, aux.vdso),
        (AT_PHDR, aux.main.phdr),
        (AT_PHENT, std::mem::size_of::<goblin::elf64::program_header::ProgramHeader>() as u64),
        (AT_PHNUM, aux.main.phnum),
        (AT_PAGESZ, PAGE_SIZE),
        (AT_BASE, aux.at_base),
        (AT_FLAGS, 0),
        (AT_ENTRY, aux.entry),
        (AT_UID, aux.uid[0] as u64),
        (AT_EUID, aux.uid[1] as u64),
        (AT_GID, aux.gid[0] as u64),
        (AT_EGID, aux.gid[1] as u64),
        (AT_SECURE, 0),
        (AT_RANDOM, random),
        (AT_HWCAP, hwcap()),
        (AT_HWCAP2, 0),
        (AT_CLKTCK, 100),
        (AT_PLATFORM, platform),
        (AT_EXECFN, execfn),
        (AT_MINSIGSTKSZ, signal_state::MINSIGSTKSZ),
        (AT_NULL, 0),
    ];
    let mut words: Vec<u64> = Vec::with_capacity(3 + ptrs.len() + 2 * auxv.len());
    words.push(argv.len() as u64);
    words.extend_from_slice(argv_p);
    words.push(0);
    words.extend_from_slice(envp_p);
    words.push(0);
    for (k, v) in auxv {
        words.push(k);
        words.push(v);
    }
    let table: Vec<u8> = words.iter().flat_map(|w| w.to_le_bytes()).collect();
    let rsp = (random - table.len() as u64) & !15;
    if rsp < STACK_TOP - STACK_RESERVE + PAGE_SIZE {
        return Err(E2BIG);
    }
    sp(rsp, &table).map_err(|_| E2BIG)?;
    Ok((rsp, args_area))
}

/// How [`build_stack`] writes guest memory (the platform's way).
type StackWriter<'a> = dyn FnMut(u64, &[u8]) -> Result<(), Errno> + 'a;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::paging::{setup_address_space, PTE_NX, PTE_U, PTE_W};
    use std::path::{Path, PathBuf};
    use std::process::Command;

    struct T {
        mem: GuestMemory,
        frames: FrameAllocator,
        aspace: AddressSpace,
        os: GuestOs,
        root: PathBuf,
    }

    fn tmp(name: &str) -> PathBuf {
        let d = std::env::temp_dir().join(format!("exec-test-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        d
    }

    impl T {
        fn new(root: PathBuf) -> T {
            let mut mem = GuestMemory::anonymous(256 << 20).unwrap();
            let mut frames = FrameAllocator::new(256 << 20);
            let aspace = setup_address_space(&mut mem, &mut frames).unwrap();
            let os = GuestOs {
                mm: Default::default(),
                files: Default::default(),
                vfs: crate::guestos::vfs::Vfs::new(&root).unwrap(),
                proc: Default::default(),
                enosys: Default::default(),
                stdio: None,
                agent: None,
                sig: Default::default(),
                threads: Default::default(),
            };
            T { mem, frames, aspace, os, root }
        }
        fn load(&mut self, argv: &[&str], envp: &[&str]) -> Result<Image, Errno> {
            let argv: Vec<Vec<u8>> = argv.iter().map(|s| s.as_bytes().to_vec()).collect();
            let envp: Vec<Vec<u8>> = envp.iter().map(|s| s.as_bytes().to_vec()).collect();
            load(&mut self.os, &mut self.mem, &mut self.frames, &self.aspace, &argv[0].clone(), &argv, &envp)
        }
        fn u64_at(&self, va: u64) -> u64 {
            let mut b = [0u8; 8];
            self.aspace.read_virt(&self.mem, va, &mut b, true).unwrap();
            u64::from_le_bytes(b)
        }
        fn cstr_at(&self, va: u64) -> String {
            let mut out = Vec::new();
            let mut p = va;
            loop {
                let mut b = [0u8; 1];
                self.aspace.read_virt(&self.mem, p, &mut b, true).unwrap();
                if b[0] == 0 {
                    return String::from_utf8(out).unwrap();
                }
                out.push(b[0]);
                p += 1;
            }
        }
        fn flags(&self, va: u64) -> u64 {
            self.aspace.translate(&self.mem, va).unwrap().1
        }
        /// argc, argv, envp and auxv read back from the stack at `rsp`.
        fn stack(&self, rsp: u64) -> (Vec<String>, Vec<String>, std::collections::BTreeMap<u64, u64>) {
            let argc = self.u64_at(rsp);
            let mut p = rsp + 8;
            let mut argv = Vec::new();
            for _ in 0..argc {
                argv.push(self.cstr_at(self.u64_at(p)));
                p += 8;
            }
            assert_eq!(self.u64_at(p), 0);
            p += 8;
            let mut envp = Vec::new();
            while self.u64_at(p) != 0 {
                envp.push(self.cstr_at(self.u64_at(p)));
                p += 8;
            }
            p += 8;
            let mut aux = std::collections::BTreeMap::new();
            loop {
                let (k, v) = (self.u64_at(p), self.u64_at(p + 8));
                if k == AT_NULL {
                    break;
                }
                aux.insert(k, v);
                p += 16;
            }
            (argv, envp, aux)
        }
    }

    /// Compile a C program with the host gcc into `root/<name>`; `None` (skip) without gcc.
    fn gcc(root: &Path, name: &str, src: &str, flags: &[&str]) -> Option<PathBuf> {
        let c = root.join(format!("{name}.c"));
        std::fs::write(&c, src).unwrap();
        let out = root.join(name);
        match Command::new("gcc").args(flags).arg("-o").arg(&out).arg(&c).status() {
            Ok(s) if s.success() => Some(out),
            Ok(s) => panic!("gcc failed: {s}"),
            Err(_) => {
                eprintln!("gcc not found: skipping");
                None
            }
        }
    }

    const HELLO: &str = "#include <unistd.h>\nint main(){write(1,\"hi\\n\",3);return 0;}\n";

    fn check_common(t: &T, img: &Image, argv: &[&str]) -> std::collections::BTreeMap<u64, u64> {
        assert_eq!(img.rsp % 16, 0);
        let (a, e, aux) = t.stack(img.rsp);
        assert_eq!(a, argv);
        assert_eq!(e, ["A=1", "HOME=/root"]);
        assert_eq!(aux[&AT_PAGESZ], 4096);
        assert_eq!(aux[&AT_PHENT], 56);
        assert_eq!(aux[&AT_CLKTCK], 100);
        assert_eq!(aux[&AT_MINSIGSTKSZ], 2048);
        assert_eq!(aux[&AT_SECURE], 0);
        // The vDSO: its ELF header where AT_SYSINFO_EHDR says, readable and executable by the
        // program, its data page writable, both named in /proc/self/maps.
        assert_eq!(aux[&AT_SYSINFO_EHDR], super::super::vdso::VDSO_VA);
        assert_eq!(t.u64_at(aux[&AT_SYSINFO_EHDR]) as u32, 0x464c_457f);
        let f = t.flags(aux[&AT_SYSINFO_EHDR]);
        assert_eq!(f & (PTE_U | PTE_W | PTE_NX), PTE_U);
        let f = t.flags(super::super::vdso::VVAR_VA);
        assert_eq!(f & (PTE_U | PTE_W | PTE_NX), PTE_U | PTE_W | PTE_NX);
        assert_eq!(t.cstr_at(aux[&AT_PLATFORM]), "x86_64");
        assert_eq!(t.cstr_at(aux[&AT_EXECFN]), argv[0]);
        assert_ne!(aux[&AT_HWCAP] & (1 << 25), 0, "SSE");
        let rnd = aux[&AT_RANDOM];
        assert!(rnd > img.rsp && rnd < STACK_TOP);
        // The program headers are readable where AT_PHDR says: the first is PT_PHDR or PT_LOAD.
        let first_type = t.u64_at(aux[&AT_PHDR]) as u32;
        assert!(first_type == PT_PHDR || first_type == PT_LOAD || first_type == 6, "{first_type}");
        // The stack is writable, not executable; the heap starts empty, page aligned.
        let f = t.flags(img.rsp);
        assert_eq!(f & (PTE_U | PTE_W | PTE_NX), PTE_U | PTE_W | PTE_NX);
        assert_eq!(t.os.mm.brk % 4096, 0);
        assert_eq!(t.os.mm.brk, t.os.mm.brk_start);
        let maps = t.os.mm.maps();
        assert!(maps.contains("[stack]"), "{maps}");
        assert!(maps.contains("r-xp 00000000 00:00 0") && maps.contains("[vdso]") && maps.contains("[vvar]"), "{maps}");
        // The entry point is mapped executable.
        let f = t.flags(img.entry);
        assert_eq!(f & (PTE_U | PTE_NX), PTE_U, "entry {:#x} not executable", img.entry);
        aux
    }

    #[test]
    fn static_program() {
        let root = tmp("static");
        let Some(_) = gcc(&root, "hello", HELLO, &["-static", "-O1"]) else { return };
        let mut t = T::new(root.clone());
        let img = t.load(&["/hello", "x y"], &["A=1", "HOME=/root"]).unwrap();
        let aux = check_common(&t, &img, &["/hello", "x y"]);
        assert_eq!(aux[&AT_BASE], 0);
        assert_eq!(aux[&AT_ENTRY], img.entry);
        assert!(img.entry >= 0x40_0000 && img.entry < 0x100_0000);
        assert_eq!(t.os.proc.exe, "/hello");
        assert_eq!(&t.os.proc.comm[..6], b"hello\0");
        // The first page holds the ELF header; text is read-only, data writable and not executable.
        let mut magic = [0u8; 4];
        t.aspace.read_virt(&t.mem, 0x40_0000, &mut magic, true).unwrap();
        assert_eq!(&magic, b"\x7fELF");
        let data = t.os.mm.vmas.iter().find(|(_, v)| v.prot == PROT_READ | PROT_WRITE && v.name == "/hello");
        let (dstart, _) = data.expect("a writable segment");
        assert_eq!(t.flags(*dstart) & (PTE_W | PTE_NX), PTE_W | PTE_NX);
        assert!(t.os.mm.brk_start > *dstart);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn static_pie_program() {
        let root = tmp("spie");
        let Some(_) = gcc(&root, "hello", HELLO, &["-static-pie", "-O1"]) else { return };
        let mut t = T::new(root.clone());
        let img = t.load(&["/hello"], &["A=1", "HOME=/root"]).unwrap();
        let aux = check_common(&t, &img, &["/hello"]);
        assert!(img.entry > PIE_BASE && img.entry < PIE_BASE + (64 << 20));
        assert_eq!(aux[&AT_BASE], 0);
        assert_eq!(*t.os.mm.vmas.keys().next().unwrap(), PIE_BASE);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn dynamic_program_and_its_interpreter() {
        let root = tmp("dyn");
        let Some(_) = gcc(&root, "hello", HELLO, &["-O1"]) else { return };
        let ld = Path::new("/lib64/ld-linux-x86-64.so.2");
        if !ld.exists() {
            return;
        }
        std::fs::create_dir_all(root.join("lib64")).unwrap();
        std::fs::copy(ld, root.join("lib64/ld-linux-x86-64.so.2")).unwrap();
        let mut t = T::new(root.clone());
        let img = t.load(&["/hello"], &["A=1", "HOME=/root"]).unwrap();
        let aux = check_common(&t, &img, &["/hello"]);
        assert_eq!(aux[&AT_BASE], INTERP_BASE);
        assert!(img.entry > INTERP_BASE && img.entry < INTERP_BASE + (16 << 20), "starts in ld.so");
        assert!(aux[&AT_ENTRY] > PIE_BASE && aux[&AT_ENTRY] < PIE_BASE + (16 << 20));
        assert!(aux[&AT_PHDR] > PIE_BASE);
        assert_eq!(t.os.proc.exe, "/hello");
        assert!(t.os.mm.maps().contains("/lib64/ld-linux-x86-64.so.2"));
        // mmap goes below the interpreter.
        let mut sp = Space::new(&mut t.mem, &mut t.frames, &t.aspace);
        let a = t.os.mm.mmap(&mut sp, 0, 4096, PROT_READ, super::super::mm::MAP_PRIVATE | super::super::mm::MAP_ANONYMOUS, None).unwrap();
        assert_eq!(a, INTERP_BASE - 4096);
        std::fs::remove_dir_all(&root).unwrap();
    }

    #[test]
    fn scripts_run_their_interpreter() {
        let root = tmp("script");
        let Some(_) = gcc(&root, "hello", HELLO, &["-static"]) else { return };
        std::fs::create_dir_all(root.join("bin")).unwrap();
        std::fs::rename(root.join("hello"), root.join("bin/interp")).unwrap();
        std::fs::write(root.join("s.sh"), "#!/bin/interp  -x  -y \necho\n").unwrap();
        std::fs::set_permissions(root.join("s.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(root.join("t.sh"), "#!/s.sh\n").unwrap();
        std::fs::set_permissions(root.join("t.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::write(root.join("noexec"), "#!/bin/interp\n").unwrap();
        let mut t = T::new(root.clone());
        let img = t.load(&["/t.sh", "arg"], &["A=1", "HOME=/root"]).unwrap();
        let (argv, _, aux) = t.stack(img.rsp);
        assert_eq!(argv, ["/bin/interp", "-x  -y", "/s.sh", "/t.sh", "arg"]);
        assert_eq!(t.cstr_at(aux[&AT_EXECFN]), "/t.sh");
        assert_eq!(t.os.proc.exe, "/bin/interp");
        assert_eq!(t.load(&["/noexec"], &[]).unwrap_err(), EACCES);
        assert_eq!(t.load(&["/missing"], &[]).unwrap_err(), super::super::ENOENT);
        std::fs::write(root.join("loop.sh"), "#!/loop.sh\n").unwrap();
        std::fs::set_permissions(root.join("loop.sh"), std::fs::Permissions::from_mode(0o755)).unwrap();
        assert_eq!(t.load(&["/loop.sh"], &[]).unwrap_err(), ELOOP);
        std::fs::remove_dir_all(&t.root).unwrap();
    }

    #[test]
    fn shebang_parsing() {
        assert_eq!(parse_shebang(b"\x7fELF").unwrap(), None);
        assert_eq!(parse_shebang(b"#!/bin/sh\n").unwrap(), Some((b"/bin/sh".to_vec(), None)));
        assert_eq!(parse_shebang(b"#! /usr/bin/env python3 \n").unwrap(), Some((b"/usr/bin/env".to_vec(), Some(b"python3".to_vec()))));
        assert_eq!(parse_shebang(b"#!/bin/sh").unwrap(), Some((b"/bin/sh".to_vec(), None)));
        assert_eq!(parse_shebang(b"#!   \n").unwrap_err(), ENOEXEC);
        let long = format!("#!/{}\n", "x".repeat(300));
        assert_eq!(parse_shebang(long.as_bytes()).unwrap_err(), ENOEXEC);
    }

    #[test]
    fn bad_files_are_refused() {
        let root = tmp("bad");
        std::fs::write(root.join("junk"), b"\x7fELF not really").unwrap();
        std::fs::set_permissions(root.join("junk"), std::fs::Permissions::from_mode(0o755)).unwrap();
        std::fs::create_dir(root.join("dir")).unwrap();
        let mut t = T::new(root.clone());
        assert_eq!(t.load(&["/junk"], &[]).unwrap_err(), ENOEXEC);
        assert_eq!(t.load(&["/dir"], &[]).unwrap_err(), EACCES);
        assert_eq!(t.load(&["/junk", "a\0b"], &[]).unwrap_err(), EINVAL);
        let huge = "x".repeat(200_000);
        assert_eq!(t.load(&["/junk", &huge], &[]).unwrap_err(), E2BIG);
        std::fs::remove_dir_all(&root).unwrap();
    }
}
