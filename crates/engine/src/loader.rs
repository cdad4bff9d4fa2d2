//! Loading a static x86-64 ELF executable into a fresh address space.
//!
//! Dynamic executables (PT_INTERP) and the Linux initial-stack contents beyond an empty argv/envp/auxv
//! belong to the guest runtime; this loader covers the static, non-PIE programs the engine tests run.

use goblin::elf::{program_header, Elf};

use crate::arch::x86_64::layout::{PAGE_SIZE, STACK_SIZE, STACK_TOP};
use crate::arch::x86_64::paging::{AddressSpace, FrameAllocator, PTE_NX, PTE_U, PTE_W};
use crate::error::{Error, Result};
use crate::vstate::memory::GuestMemory;

/// Where a loaded program starts.
pub struct Loaded {
    pub entry: u64,
    pub rsp: u64,
}

/// Highest user virtual address (the canonical lower half).
const USER_END: u64 = 0x0000_8000_0000_0000;

pub fn load_static_elf(
    bytes: &[u8],
    mem: &mut GuestMemory,
    frames: &mut FrameAllocator,
    aspace: &AddressSpace,
) -> Result<Loaded> {
    let elf = Elf::parse(bytes).map_err(|e| Error::Image(format!("not an ELF file: {e}")))?;
    if !elf.is_64 || elf.header.e_machine != goblin::elf::header::EM_X86_64 {
        return Err(Error::Image("not an x86-64 ELF64 executable".into()));
    }
    if elf.interpreter.is_some() {
        return Err(Error::Image("dynamic executables (PT_INTERP) are not supported by the static loader".into()));
    }
    if elf.header.e_type != goblin::elf::header::ET_EXEC {
        return Err(Error::Image("only non-PIE executables (ET_EXEC) are supported by the static loader".into()));
    }
    for ph in elf.program_headers.iter().filter(|p| p.p_type == program_header::PT_LOAD) {
        let (va, memsz, filesz, off) = (ph.p_vaddr, ph.p_memsz, ph.p_filesz, ph.p_offset);
        let end = va.checked_add(memsz).filter(|&e| e <= USER_END);
        if end.is_none() || filesz > memsz || va < PAGE_SIZE {
            return Err(Error::Image(format!("PT_LOAD at {va:#x} (+{memsz:#x}) is outside user space")));
        }
        let file_end = off.checked_add(filesz).filter(|&e| e as usize <= bytes.len());
        if file_end.is_none() {
            return Err(Error::Image(format!("PT_LOAD at {va:#x} reaches past the end of the file")));
        }
        let mut flags = PTE_U;
        if ph.is_write() {
            flags |= PTE_W;
        }
        if !ph.is_executable() {
            flags |= PTE_NX;
        }
        // Pages shared by two segments (a common linker layout) keep the first mapping; make the
        // overlap permissive enough for both by mapping only pages not yet present.
        let start = va & !(PAGE_SIZE - 1);
        let stop = (va + memsz).div_ceil(PAGE_SIZE) * PAGE_SIZE;
        let mut p = start;
        while p < stop {
            if aspace.translate(mem, p).is_err() {
                aspace.map_fresh(mem, frames, p, PAGE_SIZE, flags)?;
            }
            p += PAGE_SIZE;
        }
        aspace.write_virt(mem, va, &bytes[off as usize..(off + filesz) as usize], false)?;
    }
    aspace.map_fresh(mem, frames, STACK_TOP - STACK_SIZE, STACK_SIZE, PTE_U | PTE_W | PTE_NX)?;
    // Linux's initial stack: argc = 0, argv NULL, envp NULL, auxv AT_NULL; rsp 16-byte aligned at argc.
    let rsp = STACK_TOP - 64;
    aspace.write_virt(mem, rsp, &[0u8; 48], false)?;
    Ok(Loaded { entry: elf.entry, rsp })
}
