//! The guest syscalls the engine services (a minimal set; everything else answers -ENOSYS).
//!
//! Linux numbering and calling convention: nr in rax, arguments in rdi, rsi, rdx, r10, r8, r9.

use kvm_bindings::kvm_regs;

use crate::guestos::Output;
use crate::protocol::OUTPUT_CAP;
use crate::arch::x86_64::paging::AddressSpace;
use crate::protocol::RunExit;
use crate::vstate::memory::GuestMemory;

pub const SYS_WRITE: u64 = 1;
pub const SYS_GETPID: u64 = 39;
pub const SYS_EXIT: u64 = 60;
pub const SYS_EXIT_GROUP: u64 = 231;
/// Engine hypercall: pause the guest and hand `rdi` to the host.
pub const SYS_YIELD: u64 = 0x4000_0000;

const EBADF: i64 = 9;
const EFAULT: i64 = 14;
const ENOSYS: i64 = 38;

/// Service one syscall. Returns the value for rax and, when the run should stop, why.
pub fn dispatch(r: &kvm_regs, aspace: &AddressSpace, mem: &GuestMemory, out: &mut Output) -> (i64, Option<RunExit>) {
    match r.rax {
        SYS_WRITE => {
            let sink = match r.rdi {
                1 => &mut out.stdout,
                2 => &mut out.stderr,
                _ => return (-EBADF, None),
            };
            let len = r.rdx.min(1 << 30) as usize;
            let keep = len.min(OUTPUT_CAP.saturating_sub(sink.len()));
            let mut buf = vec![0u8; keep];
            if aspace.read_virt(mem, r.rsi, &mut buf, true).is_err() {
                return (-EFAULT, None);
            }
            sink.extend_from_slice(&buf);
            (len as i64, None)
        }
        SYS_GETPID => (1, None),
        SYS_EXIT | SYS_EXIT_GROUP => (0, Some(RunExit::Exited { code: r.rdi as i32 })),
        SYS_YIELD => (0, Some(RunExit::Yield { value: r.rdi })),
        _ => {
            out.enosys += 1;
            (-ENOSYS, None)
        }
    }
}
