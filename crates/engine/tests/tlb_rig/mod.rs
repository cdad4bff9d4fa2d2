//! A bare guest for page-table coherence experiments, built from the engine's own modules
//! (`GuestMemory`, `FrameAllocator`/`AddressSpace`, `KvmVm`, `arch::x86_64::regs`) without a VMM
//! process, so the host can edit guest page tables between two `KVM_RUN`s and watch what the guest
//! sees. Shared by `tests/tlb.rs` and `examples/pt_coherence.rs` (included there with `#[path]`).
#![allow(dead_code)]

use std::time::{Duration, Instant};

use collimate_engine::arch::x86_64::layout::*;
use collimate_engine::arch::x86_64::paging::{
    setup_address_space, AddressSpace, FrameAllocator, PTE_NX, PTE_P, PTE_U, PTE_W,
};
use collimate_engine::arch::x86_64::regs;
use collimate_engine::vstate::memory::GuestMemory;
use collimate_engine::vstate::tlb;
use collimate_engine::vstate::vcpu::set_msrs;
use collimate_engine::vstate::vm::KvmVm;
use kvm_bindings::{kvm_msr_entry, kvm_userspace_memory_region, KVM_MAX_CPUID_ENTRIES, KVM_MEM_LOG_DIRTY_PAGES};
use kvm_ioctls::{Kvm, VcpuExit, VcpuFd};

/// Guest code (assembled from the listing below with GNU as). `rsi` holds `MAILBOX` throughout.
///
/// ```text
/// top:   mov rax,[rsi]; mov rbx,[rsi+8]          ; command, address
///        cmp rax,1; je rd; cmp rax,2; je wr; cmp rax,3; je touch
///        out 0x9f,al; jmp top
/// rd:    mov rax,[rbx]; mov [rsi+40],rax; out 0x80,al; jmp top     ; read one qword
/// wr:    mov rcx,[rsi+16]; mov [rbx],rcx; out 0x81,al; jmp top     ; write one qword
/// touch: mov rcx,[rsi+24]; xor edx,edx                            ; read the first qword of
///  1:    add rdx,[rbx]; add rbx,4096; dec rcx; jnz 1b              ; [rsi+24] pages from rbx
///        mov [rsi+40],rdx; out 0x82,al; jmp top
/// ```
pub const GUEST_CODE: [u8; 80] = [
    0x48, 0x8b, 0x06, 0x48, 0x8b, 0x5e, 0x08, 0x48, 0x83, 0xf8, 0x01, 0x74, 0x10, 0x48, 0x83, 0xf8, 0x02, 0x74, 0x15,
    0x48, 0x83, 0xf8, 0x03, 0x74, 0x1a, 0xe6, 0x9f, 0xeb, 0xe3, 0x48, 0x8b, 0x03, 0x48, 0x89, 0x46, 0x28, 0xe6, 0x80,
    0xeb, 0xd8, 0x48, 0x8b, 0x4e, 0x10, 0x48, 0x89, 0x0b, 0xe6, 0x81, 0xeb, 0xcd, 0x48, 0x8b, 0x4e, 0x18, 0x31, 0xd2,
    0x48, 0x03, 0x13, 0x48, 0x81, 0xc3, 0x00, 0x10, 0x00, 0x00, 0x48, 0xff, 0xc9, 0x75, 0xf1, 0x48, 0x89, 0x56, 0x28,
    0xe6, 0x82, 0xeb, 0xb0,
];
pub const CODE_VA: u64 = 0x40_0000;
pub const MAILBOX: u64 = 0x60_0000;
/// Where the experiments put their data pages.
pub const DATA_VA: u64 = 0x1000_0000;
const ADDR_MASK: u64 = 0x000f_ffff_ffff_f000;
const CR4_PGE: u64 = 1 << 7;
const CR4_TSD: u64 = 1 << 2;

/// What one guest operation ended in.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Outcome {
    /// The operation completed; for reads and touches the value the guest read.
    Done(u64),
    /// A guest exception, seen through the ring-0 stub.
    Fault { vector: u8, error_code: u64, cr2: u64 },
}

/// A way for the host to make the guest forget translations after it has edited page tables.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Flush {
    /// Nothing at all.
    None,
    /// KVM_SET_SREGS with the state just read back by KVM_GET_SREGS (same CR3).
    SregsSameCr3,
    /// Two KVM_SET_SREGS: CR4.PGE flipped, then restored (CR4 change => kvm_mmu_reset_context).
    Cr4PgeToggle,
    /// The same with CR4.TSD.
    Cr4TsdToggle,
    /// CR3 set to a fresh copy of the PML4 page, then back to the real root (two KVM_SET_SREGS).
    Cr3CopyAndBack,
    /// CR3 set to a fresh copy of the PML4 page and left there (one KVM_SET_SREGS).
    Cr3CopyStay,
    /// KVM_SET_USER_MEMORY_REGION: delete slot 0, add it again (zaps every shadow page), through
    /// `vstate::tlb::flush_guest_tlb`.
    MemslotReadd,
    /// KVM_SET_USER_MEMORY_REGION: slot 0 flags without, then with, dirty logging.
    MemslotDirtyLogToggle,
    /// Host `mprotect(PROT_READ)` then `mprotect(PROT_READ|PROT_WRITE)` of the host pages of the
    /// frames the old translations pointed at (`vstate::tlb::invalidate_frames`): the MMU notifier
    /// makes KVM drop every shadow PTE that maps them.
    MprotectOldFrames,
    /// The same, but on the host page of the edited guest page-table page (not the data frame).
    MprotectPtPage,
    /// `invalidate_frames_exact` of the old frames: each dropped by `GuestMemory::zap_in_place`.
    ExactOldFrames,
    /// `invalidate_frames_exact` of the old frames and 64 more of their 2 MiB block: past
    /// `EXACT_MAX_PAGES` a block takes one mprotect pair instead of dropping pages exactly.
    MprotectOldFramesBlock,
}

impl Flush {
    pub const ALL: [Flush; 12] = [
        Flush::None,
        Flush::SregsSameCr3,
        Flush::Cr4PgeToggle,
        Flush::Cr4TsdToggle,
        Flush::Cr3CopyAndBack,
        Flush::Cr3CopyStay,
        Flush::MemslotDirtyLogToggle,
        Flush::MprotectPtPage,
        Flush::MprotectOldFrames,
        Flush::ExactOldFrames,
        Flush::MprotectOldFramesBlock,
        Flush::MemslotReadd,
    ];
}

/// A guest with no VMM process around it. Field order is drop order: vCPU and VM before memory.
pub struct Rig {
    pub vcpu: VcpuFd,
    pub vm: KvmVm,
    pub mem: GuestMemory,
    pub kvm: Kvm,
    /// Page-table pages and the guest's code and mailbox come from here (low memory)...
    pub frames: FrameAllocator,
    /// ...data frames from here (the upper half), so that they never share a 2 MiB block with a
    /// page-table page (the measured kernel invalidates whole 2 MiB blocks of host memory).
    pub data: FrameAllocator,
    pub aspace: AddressSpace,
    /// Current CR3 (the real root, or a copy of it after `Flush::Cr3CopyStay`).
    pub cr3: u64,
    pub exits: u64,
}

fn index(va: u64, level: u32) -> u64 {
    (va >> (12 + 9 * level)) & 0x1ff
}

impl Rig {
    pub fn new(mem_size: u64) -> Rig {
        let kvm = Kvm::new().expect("/dev/kvm");
        let mut mem = GuestMemory::anonymous(mem_size).unwrap();
        let mut frames = FrameAllocator::new(mem_size);
        let aspace = setup_address_space(&mut mem, &mut frames).unwrap();
        aspace.map_fresh(&mut mem, &mut frames, CODE_VA, PAGE_SIZE, PTE_U).unwrap();
        aspace.write_virt(&mut mem, CODE_VA, &GUEST_CODE, false).unwrap();
        aspace.map_fresh(&mut mem, &mut frames, MAILBOX, PAGE_SIZE, PTE_U | PTE_W | PTE_NX).unwrap();
        let vm = KvmVm::new(&kvm, &mem, mem_size).unwrap(); // the whole of it: the rig maps any frame
        let mut cpuid = kvm.get_supported_cpuid(KVM_MAX_CPUID_ENTRIES).unwrap();
        regs::filter_cpuid(&mut cpuid);
        let vcpu = vm.fd.create_vcpu(0).unwrap();
        vcpu.set_cpuid2(&cpuid).unwrap();
        let sregs = vcpu.get_sregs().unwrap();
        vcpu.set_sregs(&regs::initial_sregs(sregs, aspace.root)).unwrap();
        let mut xcrs = vcpu.get_xcrs().unwrap();
        xcrs.nr_xcrs = 1;
        xcrs.xcrs[0].xcr = 0;
        xcrs.xcrs[0].value = 0b111;
        vcpu.set_xcrs(&xcrs).unwrap();
        let msrs: Vec<_> = regs::initial_msrs()
            .into_iter()
            .map(|(index, data)| kvm_msr_entry { index, data, ..Default::default() })
            .collect();
        set_msrs(&vcpu, &msrs).unwrap();
        let mut r = regs::initial_regs(CODE_VA, STACK_TOP);
        r.rsi = MAILBOX;
        vcpu.set_regs(&r).unwrap();
        let cr3 = aspace.root;
        let mut data = FrameAllocator::new(mem_size);
        data.next = mem_size / 2;
        Rig { vcpu, vm, mem, kvm, frames, data, aspace, cr3, exits: 0 }
    }

    /// A fresh data frame filled with the 8-byte pattern `fill`.
    pub fn frame(&mut self, fill: u64) -> u64 {
        let f = self.data.alloc().unwrap();
        let page: Vec<u8> = (0..PAGE_SIZE / 8).flat_map(|_| fill.to_le_bytes()).collect();
        self.mem.write(f, &page).unwrap();
        f
    }

    /// Map `va -> pa` (user, with `flags`), building intermediate tables as needed.
    pub fn map(&mut self, va: u64, pa: u64, flags: u64) {
        self.aspace.map_page(&mut self.mem, &mut self.frames, va, pa, PTE_U | flags).unwrap();
    }

    /// Guest-physical address of the leaf PTE of `va` (the tables down to it must exist).
    pub fn pte_gpa(&self, va: u64) -> u64 {
        let mut table = self.aspace.root;
        for level in (1..4).rev() {
            let e = self.mem.read_u64(table + index(va, level) * 8).unwrap();
            assert!(e & PTE_P != 0, "no level-{level} table for {va:#x}");
            table = e & ADDR_MASK;
        }
        table + index(va, 0) * 8
    }
    pub fn pte(&self, va: u64) -> u64 {
        self.mem.read_u64(self.pte_gpa(va)).unwrap()
    }
    pub fn set_pte(&mut self, va: u64, v: u64) {
        let g = self.pte_gpa(va);
        self.mem.write_u64(g, v).unwrap();
    }

    fn mailbox(&mut self, cmd: u64, addr: u64, val: u64, count: u64) {
        let mut b = Vec::with_capacity(32);
        for w in [cmd, addr, val, count] {
            b.extend_from_slice(&w.to_le_bytes());
        }
        self.aspace.write_virt(&mut self.mem, MAILBOX, &b, false).unwrap();
    }

    /// Run the guest until its next exit and classify it.
    pub fn run_once(&mut self) -> Outcome {
        loop {
            self.exits += 1;
            let port = match self.vcpu.run() {
                Ok(VcpuExit::IoOut(port, _)) => port,
                Ok(VcpuExit::IoIn(_, d)) => {
                    d.fill(0);
                    continue;
                }
                Ok(other) => panic!("unexpected exit {other:?}"),
                Err(e) if e.errno() == libc::EINTR || e.errno() == libc::EAGAIN => continue,
                Err(e) => panic!("KVM_RUN: {e}"),
            };
            return match port {
                0x80..=0x82 => {
                    let mut b = [0u8; 8];
                    self.aspace.read_virt(&self.mem, MAILBOX + 40, &mut b, false).unwrap();
                    Outcome::Done(u64::from_le_bytes(b))
                }
                p if (VECTOR_PORT_BASE..VECTOR_PORT_BASE + 32).contains(&p) => self.fault((p - VECTOR_PORT_BASE) as u8),
                p => panic!("guest exited on port {p:#x}"),
            };
        }
    }

    /// The guest took an exception: read the frame, go back to ring 3 at `top` (the way the engine
    /// returns to user: KVM_SET_REGS + KVM_SET_SREGS with the user segments).
    fn fault(&mut self, vector: u8) -> Outcome {
        let mut r = self.vcpu.get_regs().unwrap();
        let mut s = self.vcpu.get_sregs().unwrap();
        let with_code = has_error_code(vector);
        let mut frame = [0u8; 48];
        let len = if with_code { 48 } else { 40 };
        self.aspace.read_virt(&self.mem, r.rsp, &mut frame[..len], false).unwrap();
        let word = |i: usize| u64::from_le_bytes(frame[i * 8..i * 8 + 8].try_into().unwrap());
        let (error_code, base) = if with_code { (word(0), 1) } else { (0, 0) };
        r.rip = CODE_VA;
        r.rflags = word(base + 2);
        r.rsp = word(base + 3);
        s.cs = regs::user_code_segment();
        s.ss = regs::user_data_segment();
        self.vcpu.set_regs(&r).unwrap();
        self.vcpu.set_sregs(&s).unwrap();
        Outcome::Fault { vector, error_code, cr2: s.cr2 }
    }

    pub fn read(&mut self, va: u64) -> Outcome {
        self.mailbox(1, va, 0, 0);
        self.run_once()
    }
    pub fn write(&mut self, va: u64, v: u64) -> Outcome {
        self.mailbox(2, va, v, 0);
        self.run_once()
    }
    /// Read the first qword of each of `n` consecutive pages from `va`; returns the sum.
    pub fn touch(&mut self, va: u64, n: u64) -> Outcome {
        self.mailbox(3, va, 0, n);
        self.run_once()
    }

    fn region(&self, flags: u32) -> kvm_userspace_memory_region {
        kvm_userspace_memory_region {
            slot: 0,
            flags,
            guest_phys_addr: 0,
            memory_size: self.mem.size(),
            userspace_addr: self.mem.host_addr(),
        }
    }

    fn pml4_copy(&mut self) -> u64 {
        let copy = self.frames.alloc().unwrap();
        let mut page = vec![0u8; PAGE_SIZE as usize];
        self.mem.read(self.aspace.root, &mut page).unwrap();
        self.mem.write(copy, &page).unwrap();
        copy
    }

    /// Apply `how`. `old_frames`: frames the changed translations used to point at; `pt_pages`:
    /// guest-physical pages of the page-table pages that were edited.
    pub fn flush(&mut self, how: Flush, old_frames: &[u64], pt_pages: &[u64]) {
        let v = &self.vcpu;
        match how {
            Flush::None => {}
            Flush::SregsSameCr3 => {
                let s = v.get_sregs().unwrap();
                v.set_sregs(&s).unwrap();
            }
            Flush::Cr4PgeToggle | Flush::Cr4TsdToggle => {
                let bit = if how == Flush::Cr4PgeToggle { CR4_PGE } else { CR4_TSD };
                let mut s = v.get_sregs().unwrap();
                s.cr4 ^= bit;
                v.set_sregs(&s).unwrap();
                s.cr4 ^= bit;
                v.set_sregs(&s).unwrap();
            }
            Flush::Cr3CopyAndBack => {
                let copy = self.pml4_copy();
                let v = &self.vcpu;
                let mut s = v.get_sregs().unwrap();
                let orig = s.cr3;
                s.cr3 = copy;
                v.set_sregs(&s).unwrap();
                s.cr3 = orig;
                v.set_sregs(&s).unwrap();
            }
            Flush::Cr3CopyStay => {
                let copy = self.pml4_copy();
                let v = &self.vcpu;
                let mut s = v.get_sregs().unwrap();
                s.cr3 = copy;
                v.set_sregs(&s).unwrap();
                self.cr3 = copy;
            }
            Flush::MemslotReadd => tlb::flush_guest_tlb(&mut self.vm, &mut self.mem).unwrap(),
            Flush::MemslotDirtyLogToggle => {
                // SAFETY: changing only the flags of slot 0, over our own live mapping.
                unsafe {
                    self.vm.fd.set_user_memory_region(self.region(0)).unwrap();
                    self.vm.fd.set_user_memory_region(self.region(KVM_MEM_LOG_DIRTY_PAGES)).unwrap();
                }
            }
            Flush::MprotectOldFrames => {
                tlb::invalidate_frames(&self.mem, old_frames).unwrap();
            }
            Flush::MprotectPtPage => {
                tlb::invalidate_frames(&self.mem, pt_pages).unwrap();
            }
            Flush::ExactOldFrames => {
                assert_eq!(tlb::invalidate_frames_exact(&self.mem, old_frames).unwrap(), 0);
            }
            Flush::MprotectOldFramesBlock => {
                let block = |gpa: u64| (self.mem.host_addr() + gpa) / tlb::INVALIDATION_BLOCK;
                let mut frames = old_frames.to_vec();
                let mut gpa = old_frames[0] & !4095;
                while frames.len() < old_frames.len() + 64 {
                    let up = gpa + 4096;
                    gpa = if block(up) == block(old_frames[0]) && up < self.mem.size() { up } else { gpa - 4096 };
                    if !frames.contains(&gpa) {
                        frames.push(gpa);
                    }
                }
                // One pair for the block; none at all in the negative control, where the
                // engine's invalidation is off (`COLLIMATE_TEST_NO_INVALIDATION=1`).
                let off = std::env::var_os("COLLIMATE_TEST_NO_INVALIDATION").is_some_and(|v| v == "1");
                assert_eq!(tlb::invalidate_frames_exact(&self.mem, &frames).unwrap(), usize::from(!off));
            }
        }
    }
}

/// Median and 99th percentile of a set of durations, in microseconds.
pub fn p50_p99(mut d: Vec<Duration>) -> (f64, f64) {
    d.sort();
    let us = |x: Duration| x.as_secs_f64() * 1e6;
    (us(d[d.len() / 2]), us(d[(d.len() * 99 / 100).min(d.len() - 1)]))
}

pub fn time<T>(f: impl FnOnce() -> T) -> (T, Duration) {
    let t = Instant::now();
    let r = f();
    (r, t.elapsed())
}
