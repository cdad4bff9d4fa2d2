//! Shared helpers for the engine integration tests: build and drive the guest
//! test program `guest/testprogs/testvm` (see `guest/testprogs/README.md` for
//! the mailbox protocol). Only depends on `std`.
//!
//! Use from a test file with `mod common;`.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::OnceLock;

// --- fixed guest addresses (must match guest/testprogs/testvm.S) ---------------
pub const ENTRY: u64 = 0x40_0000;
pub const MAILBOX: u64 = 0x60_0000;
pub const MAILBOX_SIZE: usize = 5 * 8;
pub const MAILBOX_CMD: u64 = MAILBOX;
pub const MAILBOX_ARG0: u64 = MAILBOX + 8;
pub const MAILBOX_ARG1: u64 = MAILBOX + 16;
pub const MAILBOX_ARG2: u64 = MAILBOX + 24;
pub const MAILBOX_RESULT: u64 = MAILBOX + 32;
pub const REGS_IN: u64 = 0x60_1000;
pub const REGS_OUT: u64 = 0x60_2000;
pub const REGS_SIZE: usize = 4096;
pub const HEAP: u64 = 0x100_0000;
pub const PAGE_SIZE: u64 = 4096;
pub const HEAP_PAGES: u64 = 32768;
pub const HEAP_SIZE: u64 = HEAP_PAGES * PAGE_SIZE; // 128 MiB

// --- regs_in / regs_out layout ------------------------------------------------
/// Order of the 15 GPRs at offset 0 of `regs_in`/`regs_out` (rsp is not loaded).
pub const GPR_ORDER: [&str; 15] = [
    "rax", "rbx", "rcx", "rdx", "rsi", "rdi", "rbp", "r8", "r9", "r10", "r11", "r12", "r13", "r14",
    "r15",
];
pub const NUM_GPRS: usize = 15;
/// `regs_out` only: rsp when the guest stored the registers (informational).
pub const REGS_RSP_OFFSET: usize = 120;
/// `regs_out` only: rflags when the guest stored the registers (informational).
pub const REGS_RFLAGS_OFFSET: usize = 128;
pub const REGS_YMM_OFFSET: usize = 256;
pub const NUM_YMM: usize = 16;
pub const YMM_SIZE: usize = 32;
/// Bytes of `regs_in`/`regs_out` actually used (GPRs + ymm0..15).
pub const REGS_USED: usize = REGS_YMM_OFFSET + NUM_YMM * YMM_SIZE; // 768

// --- protocol --------------------------------------------------------------
/// Value of the very first yield ("ready").
pub const READY_YIELD: u64 = 0;
/// LOADREGS exits with `out 0xE0, al`.
pub const IO_PORT: u16 = 0xE0;
pub const YIELD_NR: u64 = 0x4000_0000;
pub const ENOSYS: i64 = 38;

pub const CMD_FILL: u64 = 1;
pub const CMD_SUM: u64 = 2;
pub const CMD_SPIN: u64 = 3;
pub const CMD_LOADREGS: u64 = 4;
pub const CMD_WRITE: u64 = 5;
pub const CMD_WRITE_ERR: u64 = 6;
pub const CMD_FAULT: u64 = 7;
pub const CMD_EXIT: u64 = 8;
pub const CMD_UNKNOWN_SYSCALL: u64 = 9;
pub const CMD_HELLO: u64 = 10;

/// -1: unknown command, out-of-range FILL/SUM/WRITE, unknown fault kind.
pub const RESULT_ERROR: u64 = u64::MAX;

pub const HELLO_TEXT: &[u8] = b"hello from the guest\n";

/// CMD_FAULT kinds (arg0).
pub const FAULT_UD2: u64 = 0;
pub const FAULT_NULL_WRITE: u64 = 1;
pub const FAULT_KERNEL_JUMP: u64 = 2;
pub const FAULT_INT3: u64 = 3;
pub const FAULT_DIV0: u64 = 4;
pub const FAULT_KERNEL_ADDR: u64 = 0xffff_ff80_0000_0000;

/// Exception vector each CMD_FAULT kind should produce.
pub fn fault_vector(kind: u64) -> u8 {
    match kind {
        FAULT_UD2 => 6,          // #UD
        FAULT_NULL_WRITE => 14,  // #PF, cr2 = 0
        FAULT_KERNEL_JUMP => 14, // #PF, cr2 = rip = FAULT_KERNEL_ADDR
        FAULT_INT3 => 3,         // #BP (needs a DPL-3 IDT gate)
        FAULT_DIV0 => 0,         // #DE
        _ => panic!("unknown fault kind {kind}"),
    }
}

// --- build -------------------------------------------------------------------
/// Path of `guest/testprogs/build.sh`.
pub fn build_script() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("../../guest/testprogs/build.sh")
}

/// Build `testvm` (once per test process) into `CARGO_TARGET_TMPDIR/guest`
/// and return its path. Panics with the build output on failure.
pub fn testvm_path() -> &'static Path {
    static PATH: OnceLock<PathBuf> = OnceLock::new();
    PATH.get_or_init(|| {
        let outdir = Path::new(env!("CARGO_TARGET_TMPDIR")).join("guest");
        let script = build_script();
        let out = Command::new("bash")
            .arg(&script)
            .arg(&outdir)
            .output()
            .unwrap_or_else(|e| panic!("cannot run bash {}: {e}", script.display()));
        assert!(
            out.status.success(),
            "{} {} failed ({}):\n{}{}",
            script.display(),
            outdir.display(),
            out.status,
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr),
        );
        let path = outdir.join("testvm");
        assert!(
            path.is_file(),
            "build succeeded but {} is missing",
            path.display()
        );
        path
    })
}

/// The bytes of the `testvm` ELF (built once per test process).
pub fn testvm_elf() -> Vec<u8> {
    static ELF: OnceLock<Vec<u8>> = OnceLock::new();
    ELF.get_or_init(|| {
        let path = testvm_path();
        std::fs::read(path).unwrap_or_else(|e| panic!("reading {}: {e}", path.display()))
    })
    .clone()
}

// --- mailbox / register helpers ------------------------------------------------
/// 40 bytes to write at `MAILBOX`: cmd, arg0, arg1, arg2, result = 0.
pub fn mailbox(cmd: u64, a0: u64, a1: u64, a2: u64) -> Vec<u8> {
    [cmd, a0, a1, a2, 0]
        .iter()
        .flat_map(|v| v.to_le_bytes())
        .collect()
}

/// (cmd, arg0, arg1, arg2, result) from `read_mem(MAILBOX, MAILBOX_SIZE)`.
pub fn unpack_mailbox(data: &[u8]) -> [u64; 5] {
    assert!(
        data.len() >= MAILBOX_SIZE,
        "mailbox needs {MAILBOX_SIZE} bytes, got {}",
        data.len()
    );
    std::array::from_fn(|i| u64_at(data, i * 8))
}

/// The `result` field of a mailbox read with `read_mem(MAILBOX, MAILBOX_SIZE)`.
pub fn mailbox_result(data: &[u8]) -> u64 {
    unpack_mailbox(data)[4]
}

/// Guest address of heap page `page`.
pub fn heap_page(page: u64) -> u64 {
    HEAP + page * PAGE_SIZE
}

/// `REGS_USED` (768) bytes to write at `REGS_IN` for CMD_LOADREGS.
pub fn pack_regs_in(gprs: &[u64; NUM_GPRS], ymm: &[[u8; YMM_SIZE]; NUM_YMM]) -> Vec<u8> {
    let mut buf = vec![0u8; REGS_USED];
    for (i, v) in gprs.iter().enumerate() {
        buf[i * 8..i * 8 + 8].copy_from_slice(&v.to_le_bytes());
    }
    for (i, v) in ymm.iter().enumerate() {
        let off = REGS_YMM_OFFSET + i * YMM_SIZE;
        buf[off..off + YMM_SIZE].copy_from_slice(v);
    }
    buf
}

/// (GPRs in `GPR_ORDER`, ymm0..15) from `read_mem(REGS_OUT, REGS_USED)`.
pub fn unpack_regs(data: &[u8]) -> ([u64; NUM_GPRS], [[u8; YMM_SIZE]; NUM_YMM]) {
    assert!(
        data.len() >= REGS_USED,
        "regs need {REGS_USED} bytes, got {}",
        data.len()
    );
    let gprs = std::array::from_fn(|i| u64_at(data, i * 8));
    let ymm = std::array::from_fn(|i| {
        let off = REGS_YMM_OFFSET + i * YMM_SIZE;
        data[off..off + YMM_SIZE].try_into().unwrap()
    });
    (gprs, ymm)
}

/// (rsp, rflags) the guest saw when storing `regs_out` (informational).
pub fn regs_out_rsp_rflags(data: &[u8]) -> (u64, u64) {
    (
        u64_at(data, REGS_RSP_OFFSET),
        u64_at(data, REGS_RFLAGS_OFFSET),
    )
}

fn u64_at(data: &[u8], off: usize) -> u64 {
    u64::from_le_bytes(data[off..off + 8].try_into().unwrap())
}

// --- Linux guests ----------------------------------------------------------------
/// Starts VMM processes from the test build's `collimate-vmm` binary.
pub fn launcher() -> collimate_engine::Launcher {
    collimate_engine::Launcher::new(env!("CARGO_BIN_EXE_collimate-vmm"), vec![])
}

/// The python template's root filesystem: COLLIMATE_ROOTFS (scripts/test.sh sets it), else a tree
/// in the default cache; None (the test skips) if none was built, unless COLLIMATE_REQUIRE_KVM says
/// the Linux-guest tests must run.
pub fn python_rootfs() -> Option<PathBuf> {
    if let Some(p) = std::env::var_os("COLLIMATE_ROOTFS") {
        return Some(PathBuf::from(p));
    }
    let cache = match std::env::var_os("COLLIMATE_CACHE") {
        Some(c) => PathBuf::from(c),
        None => std::env::var_os("XDG_CACHE_HOME")
            .map_or_else(|| PathBuf::from(std::env::var_os("HOME").unwrap_or_default()).join(".cache"), PathBuf::from)
            .join("collimate"),
    };
    let found = std::fs::read_dir(cache.join("rootfs")).ok().and_then(|dir| {
        dir.filter_map(|e| e.ok().map(|e| e.path())).find(|p| {
            p.file_name().is_some_and(|n| n.to_string_lossy().starts_with("python-")) && p.join("usr/bin/python3").exists()
        })
    });
    if found.is_none() && std::env::var_os("COLLIMATE_REQUIRE_KVM").is_some() {
        panic!("COLLIMATE_ROOTFS is not set: build it with `python3 guest/rootfs/build.py`");
    }
    found
}

/// Spawn `python3 -c program` from `root` with writable `mounts` (cwd /work), run it until it
/// yields 7 (`ctypes.CDLL(None).syscall(0x40000000, 7)`) and return it paused there.
pub fn spawn_python_paused(root: &Path, mounts: Vec<(String, PathBuf)>, program: &str) -> collimate_engine::Vm {
    let spec = collimate_engine::SpawnSpec {
        root: root.to_path_buf(),
        mounts,
        argv: vec![b"/usr/bin/python3".to_vec(), b"-c".to_vec(), program.as_bytes().to_vec()],
        envp: vec![b"PATH=/usr/bin:/bin".to_vec()],
        cwd: "/work".into(),
        ..Default::default()
    };
    let mut vm = collimate_engine::Vm::spawn(&launcher(), &spec, &collimate_engine::VmConfig::default()).unwrap();
    let r = vm.run(std::time::Duration::from_secs(60)).unwrap();
    assert_eq!(r.exit, collimate_engine::RunExit::Yield { value: 7 }, "{r:?} {}", String::from_utf8_lossy(&r.stderr));
    vm
}

/// A fresh scratch directory with `work/` and `tmp/` for a sandbox's writable mounts.
/// A spec running `argv` in the python root filesystem `root`, with the tests' usual environment
/// (`PATH=/usr/bin:/bin`, `HOME=/root`) in `/`.
pub fn python_spec(root: PathBuf, argv: &[&str]) -> collimate_engine::SpawnSpec {
    collimate_engine::SpawnSpec {
        root,
        argv: argv.iter().map(|s| s.as_bytes().to_vec()).collect(),
        envp: vec![b"PATH=/usr/bin:/bin".to_vec(), b"HOME=/root".to_vec()],
        cwd: "/".into(),
        ..Default::default()
    }
}

pub fn scratch(name: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR")).join(format!("{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(d.join("work")).unwrap();
    std::fs::create_dir_all(d.join("tmp")).unwrap();
    d
}
