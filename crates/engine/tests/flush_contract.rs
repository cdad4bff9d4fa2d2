//! The flush contract (needs /dev/kvm and the python root filesystem): after every host edit that
//! narrows or removes a guest translation, the guest runs again only after the flush its host's
//! profile requires (`vstate::profile`, `vstate::tlb`). On kvm_pvm and upstream shadow paging
//! that is KVM's shadow entries dropped by the host; with EPT/NPT the guest's own TLB reloaded by
//! the ring-0 flush stub, whose count of runs (at `FLUSH_COUNT_GPA`) these tests read.
//! `COLLIMATE_KVM_PROFILE=tdp` takes the EPT/NPT path on any host (the lane runs it with its
//! real profile; `.ci/run` on kvm_pvm with both).

mod common;

use std::time::Duration;

use collimate_engine::arch::x86_64::layout::{kva, FLUSH_COUNT_GPA};
use collimate_engine::vstate::profile::{self, FlushMethod};
use collimate_engine::{RunExit, SpawnSpec, Vm, VmConfig};
use common::{launcher, python_rootfs, scratch};

/// Map a page, fill it, then narrow or remove it (`how`) and touch it as the old translation
/// allowed: the process must die by SIGSEGV, never read or write through a stale translation.
const PROGRAM: &str = r#"
import ctypes, sys
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
p = libc.mmap(None, 4096, 3, 0x22, -1, 0)
ctypes.memset(p, 7, 4096)
assert ctypes.string_at(p, 1) == b"\x07"
print("mapped", flush=True)
if sys.argv[1] == "munmap":
    assert libc.munmap(p, 4096) == 0
    ctypes.string_at(p, 1)
else:
    assert libc.mprotect(p, 4096, 1) == 0
    assert ctypes.string_at(p, 1) == b"\x07"
    ctypes.memset(p, 8, 1)
print("survived", flush=True)
"#;

fn narrowed(how: &str) {
    let Some(root) = python_rootfs() else {
        eprintln!("no python rootfs built: skipping");
        return;
    };
    let dir = scratch(&format!("flush-contract-{how}"));
    let s = SpawnSpec {
        root,
        mounts: vec![("/work".into(), dir.join("work"))],
        argv: vec![b"/usr/bin/python3".to_vec(), b"-c".to_vec(), PROGRAM.as_bytes().to_vec(), how.as_bytes().to_vec()],
        envp: vec![b"PATH=/usr/bin:/bin".to_vec()],
        cwd: "/work".into(),
        ..Default::default()
    };
    let mut vm = Vm::spawn(&launcher(), &s, &VmConfig::default()).unwrap();
    let r = vm.run(Duration::from_secs(600)).unwrap();
    assert_eq!(String::from_utf8_lossy(&r.stdout), "mapped\n", "{}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(r.exit, RunExit::Signaled { signo: 11 }, "a stale translation let the access through");
    let count = u64::from_le_bytes(vm.read_mem(kva(FLUSH_COUNT_GPA), 8).unwrap().try_into().unwrap());
    let p = profile::current();
    match p.flush_method() {
        // Every narrowing edit (the program's start makes many: RELRO, munmaps) went through the
        // guest's own flush.
        FlushMethod::HostZapAndGuestTlb => assert!(count > 0, "{}: the guest TLB was never flushed", p.name()),
        // The fastest path of the shadow-paging hosts: the guest never enters ring 0 to flush.
        FlushMethod::HostZap => assert_eq!(count, 0, "{}: the flush stub ran on a shadow-paging host", p.name()),
    }
    drop(vm);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_read_after_munmap_faults_after_the_profiles_flush() {
    narrowed("munmap");
}

#[test]
fn a_write_after_mprotect_to_read_only_faults_after_the_profiles_flush() {
    narrowed("mprotect");
}
