//! Snapshots of a systrap guest process, and restores from them.
//!
//! A systrap guest's memory is the mappings of its stub (a host process), not a guest-physical
//! image, so the snapshot holds those instead of kvm's `vm.mem` and vCPU; the guest OS state is
//! kvm's ([`OsState`], with the writable mounts' copies in `fs/`), and the state file is framed as
//! kvm's (`crate::persist::encode_as`: magic, version, length, CRC). Two files beside `fs/`:
//! - `systrap.state`: [`SystrapState`]: the general registers, FS base and XSAVE area at the
//!   snapshot's exit, each mapping (address range, protection, where its pages are in the memory
//!   file) and the `OsState`.
//! - `systrap.mem`: the mappings' contents, one after the other, page aligned, sparse where zero.
//!   An anonymous mapping keeps only the pages the guest has (`/proc/<pid>/pagemap`: present or
//!   swapped; where the host maps it from a file, a restored snapshot's, all of it). A read-only
//!   private file mapping of a file the guest's root still holds (program text, read-only data)
//!   is kept by guest path and offset ([`MappedFile`]; the file's device and inode are checked at
//!   the restore) with only the pages its process copied on write (relocations made before an
//!   mprotect) in the memory file; any other file mapping is copied whole.
//!
//! A restore is a fresh stub whose mappings are the memory file mapped `MAP_PRIVATE` at each
//! mapping's place, and the program files at theirs: every sandbox restored from one snapshot
//! shares those pages in the host's page cache, copy-on-write, as kvm's restores share `vm.mem`. The registers go into the stub's
//! shared page and the XSAVE area into its boot frame (`Stub::load_xsave`).
//!
//! What a snapshot cannot hold, refused with an error that says what to do: more than one thread,
//! child processes, shared mappings (`MAP_SHARED`, as on kvm), and what `OsState` cannot hold
//! (pipes, sockets: `guestos::persist`).

use std::os::fd::AsFd;
use std::os::unix::fs::FileExt;
use std::path::Path;

use kvm_bindings::kvm_regs;
use serde::{Deserialize, Serialize};

use super::{Capture, Process, DEFAULT_BUDGET};
use crate::error::{Error, Result};
use crate::guestos::persist::{OsState, ScratchRoot};
use crate::persist::{self, SYSTRAP_STATE_FILE};
use crate::platform::systrap::{self as st, memory, patch, Stub};

pub const MEMORY_FILE: &str = "systrap.mem";
/// Bump whenever [`SystrapState`] changes shape (3: the patched syscall sites, `patches`).
pub const FORMAT_VERSION: u32 = 3;
const PAGE: u64 = 4096;
/// How much guest memory one read through the stub moves.
const CHUNK: usize = 1 << 20;

/// One mapping of the guest: `[start, end)` with `prot`, its pages at `offset` in the memory file;
/// or, for a read-only private file mapping ([`MappedFile`]), its file, with only the pages the
/// guest's process changed (`patches`) in the memory file.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct Region {
    pub start: u64,
    pub end: u64,
    pub prot: u32,
    pub offset: u64,
    pub file: Option<MappedFile>,
    /// In a file region: runs of pages (first page, count, from `start`) that are the process's
    /// own copies (written before the mapping became read-only: relocations), at the same place
    /// in the memory file as the region's other pages would be.
    pub patches: Vec<(u64, u64)>,
}

/// A read-only private file mapping kept by guest path and file offset, not copied: the file is
/// the same one at the restore (its device and inode are checked).
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq, Eq)]
pub struct MappedFile {
    pub path: String,
    pub offset: u64,
    pub dev: u64,
    pub ino: u64,
}

/// Everything of a systrap snapshot but the pages.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SystrapState {
    pub regs: kvm_regs,
    pub fs_base: u64,
    pub xsave: Vec<u8>,
    /// The guest's address-space limit (the stub's RLIMIT_AS) and what `sysinfo` reports.
    pub budget: u64,
    pub regions: Vec<Region>,
    pub os: OsState,
    /// The syscall sites patched in the memory as saved (`platform::systrap::patch`): a
    /// restore writes their trampolines back.
    pub patches: patch::Saved,
}

/// Read the state file of the systrap snapshot in `dir`; a kvm snapshot there gets the error
/// that says to restore it on kvm.
pub fn read_state(dir: &Path) -> Result<SystrapState> {
    let path = dir.join(SYSTRAP_STATE_FILE);
    if !path.exists() && dir.join(persist::STATE_FILE).exists() {
        return Err(persist::wrong_platform(dir, "kvm", "systrap"));
    }
    let bytes = std::fs::read(&path)
        .map_err(|e| Error::SnapshotCorrupt { path: path.display().to_string(), reason: format!("cannot read: {e}") })?;
    persist::decode_as(&bytes, &path.display().to_string(), FORMAT_VERSION)
}

/// Whether a snapshot keeps the guest's patched syscall sites (the default), or puts their code
/// back as it was and saves none (`COLLIMATE_SYSTRAP_PATCH_SNAPSHOT=0`, what snapshots did
/// before; read once per process, to compare).
pub fn patch_snapshot_enabled() -> bool {
    static ON: std::sync::OnceLock<bool> = std::sync::OnceLock::new();
    *ON.get_or_init(|| std::env::var_os("COLLIMATE_SYSTRAP_PATCH_SNAPSHOT").is_none_or(|v| v != "0"))
}

fn refuse(what: String) -> Error {
    Error::InvalidArgument(what)
}

impl Process {
    /// Write this guest process to `dir` (created if missing). It must be parked between runs
    /// (after a yield, an agent exchange or a timeout), single-threaded and without children; it
    /// goes on unchanged afterwards.
    pub fn snapshot(&mut self, dir: &Path) -> Result<()> {
        if self.exited.is_some() {
            return Err(refuse("the sandbox's first process has ended: there is nothing to snapshot; start a new sandbox".into()));
        }
        if self.os.threads.multi() {
            return Err(refuse(
                "the guest process has more than one thread; a systrap snapshot holds one: join the threads before the snapshot".into(),
            ));
        }
        if !self.os.sig.children.is_empty() {
            return Err(refuse(format!(
                "the guest process has {} child process(es); a systrap snapshot holds one process: wait for them before the snapshot",
                self.os.sig.children.len()
            )));
        }
        let shared = self.os.mm.vmas.values().filter(|v| v.shared).count();
        if shared > 0 {
            return Err(refuse(format!(
                "the guest has {shared} shared memory mapping(s) (MAP_SHARED: multiprocessing, shared_memory, mmap of a file); \
                 a snapshot cannot hold them: end the processes that use them, or unmap them, before the snapshot"
            )));
        }
        std::os::unix::fs::DirBuilderExt::mode(std::fs::DirBuilder::new().recursive(true), 0o700)
            .create(dir)
            .map_err(Error::sys("create snapshot directory"))?;
        let xsave = self.stub.pending_xsave().map_err(|e| Error::Remote(format!("systrap: the guest's XSAVE area: {e}")))?;
        let os = OsState::capture(&self.os, Some(&dir.join("fs")))?;
        // Beside, then renamed: `dir` may be the snapshot this process was restored from, whose
        // memory file it maps.
        let tmp = dir.join(format!(".{MEMORY_FILE}.tmp"));
        let file = std::os::unix::fs::OpenOptionsExt::mode(std::fs::OpenOptions::new().write(true).create(true).truncate(true), 0o600)
            .open(&tmp)
            .map_err(Error::sys("create the snapshot's memory file"))?;
        // Patched syscall sites go into the snapshot as they are, with their trampolines'
        // table (platform::systrap::patch), so restores run patched from their first syscall;
        // unless COLLIMATE_SYSTRAP_PATCH_SNAPSHOT=0: their code as it was, nothing patched.
        let patches = if patch_snapshot_enabled() {
            // Its sites that trapped once are patched first: each restore would patch them at
            // its first trap there, and each reset drop that again.
            self.stub.patch_seen();
            self.stub.saved_patches()
        } else {
            self.stub.unpatch_all().map_err(|e| Error::Remote(format!("systrap: unpatch syscall sites: {e}")))?;
            patch::Saved::default()
        };
        let regions = self.write_memory(&file)?;
        drop(file);
        std::fs::rename(&tmp, dir.join(MEMORY_FILE)).map_err(Error::sys("rename the snapshot's memory file"))?;
        let state = SystrapState { regs: self.regs, fs_base: self.fs_base, xsave, budget: self.budget, regions, os, patches };
        persist::write_file(dir, SYSTRAP_STATE_FILE, &persist::encode_as(&state, FORMAT_VERSION)?)
    }

    /// Copy every mapping's pages into `file`; the regions saying where each went.
    fn write_memory(&mut self, file: &std::fs::File) -> Result<Vec<Region>> {
        let pagemap = memory::open_pagemap(self.stub.pid()).ok();
        // Where the host maps a file (a program's, or a restored snapshot's memory file), an
        // untouched page is the file's, not zero.
        let host_files = memory::file_mappings(self.stub.pid()).ok();
        let mut regions = Vec::new();
        let mut at = 0u64;
        let mut buf = vec![0u8; CHUNK];
        let vmas: Vec<(u64, crate::guestos::mm::Vma)> = self.os.mm.vmas.iter().map(|(&s, v)| (s, v.clone())).collect();
        for (start, v) in vmas {
            let end = v.end;
            let pages = ((end - start) / PAGE) as usize;
            let on_host: Vec<u64> = host_files
                .as_ref()
                .map(|f| f.iter().filter(|&&(a, b, _)| a < end && start < b).map(|&(_, _, ino)| ino).collect())
                .unwrap_or_else(|| vec![0]);
            let flags = pagemap.as_ref().and_then(|pm| memory::page_flags(pm, start, pages).ok());
            let by_path = match &flags {
                Some(_) => self.kept_by_path(start, &v, &on_host),
                None => None,
            };
            // Which pages to copy: a file region's own copies; an anonymous mapping's pages that
            // have memory (where the host maps no file there); otherwise all.
            let want: Option<Vec<bool>> = match (&flags, &by_path) {
                (Some(f), Some(_)) => Some(f.iter().map(|&e| e & memory::PAGE_OWN != 0 && e & memory::PAGE_FILE == 0).collect()),
                (Some(f), None) if v.file.is_none() && on_host.is_empty() => Some(f.iter().map(|&e| e & memory::PAGE_OWN != 0).collect()),
                _ => None,
            };
            let mut patches = Vec::new();
            let mut i = 0;
            while i < pages {
                if want.as_ref().is_some_and(|o| !o[i]) {
                    i += 1;
                    continue;
                }
                let mut n = 1;
                while i + n < pages && (n * PAGE as usize) < CHUNK && want.as_ref().is_none_or(|o| o[i + n]) {
                    n += 1;
                }
                let va = start + i as u64 * PAGE;
                let chunk = &mut buf[..n * PAGE as usize];
                if self.stub.read(va, chunk).is_err() {
                    // Page by page: one the guest cannot read (PROT_NONE, past a file's end) is zero.
                    for (p, page) in chunk.chunks_mut(PAGE as usize).enumerate() {
                        if self.stub.read(va + p as u64 * PAGE, page).is_err() {
                            page.fill(0);
                        }
                    }
                }
                for (p, page) in chunk.chunks(PAGE as usize).enumerate() {
                    if by_path.is_some() || page.iter().any(|&b| b != 0) {
                        let off = at + (i + p) as u64 * PAGE;
                        file.write_all_at(page, off).map_err(Error::sys("write the snapshot's memory file"))?;
                    }
                }
                if by_path.is_some() {
                    patches.push((i as u64, n as u64));
                }
                i += n;
            }
            regions.push(Region { start, end, prot: v.prot, offset: at, file: by_path, patches });
            at += end - start;
        }
        file.set_len(at).map_err(Error::sys("size the snapshot's memory file"))?;
        Ok(regions)
    }

    /// The file a mapping can be kept by (see [`MappedFile`]): a read-only private mapping of a
    /// file the guest names by path, which the host maps there (`on_host`: the inodes the host
    /// maps over the range) and which the guest's root still holds as that very file.
    fn kept_by_path(&self, _start: u64, v: &crate::guestos::mm::Vma, on_host: &[u64]) -> Option<MappedFile> {
        let id = v.file?;
        if v.shared || v.prot & libc::PROT_WRITE as u32 != 0 || !v.name.starts_with('/') {
            return None;
        }
        // Only files of the read-only image: a writable root (an overlay, which a restore mounts
        // later, if at all) or a writable mount may hold another file by then.
        let vfs = &self.os.vfs;
        let writable = |m: &crate::guestos::vfs::Mount| m.writable && (v.name == m.at || v.name.starts_with(&format!("{}/", m.at)));
        if vfs.root_mounted() || vfs.root_layer.is_some() || vfs.mounts.iter().any(|m| m.at != "/" && writable(m)) {
            return None;
        }
        if on_host.is_empty() || on_host.iter().any(|&ino| ino != id.ino) {
            return None;
        }
        let (dev, ino) = file_id(&self.os.vfs, &v.name)?;
        (dev == id.dev && ino == id.ino).then(|| MappedFile { path: v.name.clone(), offset: v.offset, dev, ino })
    }

    /// A guest process restored from the snapshot in `dir` into a new stub confined by `conf`
    /// (with the snapshot's address-space limit), run in the caller's process (as
    /// [`Process::spawn`]): its fds 1 and 2 are captured in each run's result, its writable
    /// mounts are private copies under this process's runtime directory.
    pub fn restore(dir: &Path, conf: &st::Confinement) -> Result<Process> {
        let state = read_state(dir)?;
        let conf = st::Confinement { address_space: Some(state.budget), ..conf.clone() };
        let stub = Stub::spawn(&conf).map_err(|e| Error::Remote(format!("systrap: {e}")))?;
        Self::restore_into(dir, state, stub, None, &super::super::own_dir())
    }

    /// The snapshot in `dir` (its `state`, read by [`read_state`]) restored into `stub` (new and
    /// empty: a `Stub::spawn` or a `Template`'s). `stdio`: its fds 1 and 2 (a served sandbox's
    /// pipes); `None`: captured in each run's result. Its writable mounts are private copies in
    /// `scratch`, as a kvm restore's.
    pub(super) fn restore_into(
        dir: &Path,
        state: SystrapState,
        mut stub: Stub,
        stdio: Option<Vec<std::os::fd::OwnedFd>>,
        scratch: &ScratchRoot,
    ) -> Result<Process> {
        let stub_err = |what: &str, e: st::Error| Error::Remote(format!("systrap: restore {}: {what}: {e}", dir.display()));
        let mem = std::fs::File::open(dir.join(MEMORY_FILE)).map_err(|e| Error::SnapshotCorrupt {
            path: dir.join(MEMORY_FILE).display().to_string(),
            reason: format!("cannot open: {e}"),
        })?;
        let size = mem.metadata().map_err(Error::sys("stat the snapshot's memory file"))?.len();
        if state.regions.iter().any(|r| r.end < r.start || r.offset + (r.end - r.start) > size) {
            return Err(Error::SnapshotCorrupt {
                path: dir.join(MEMORY_FILE).display().to_string(),
                reason: format!("shorter ({size} bytes) than the mappings it holds"),
            });
        }
        let mut os = super::super::restore_os(&state.os, dir, scratch, false, None)?;
        // Adjacent mappings with the same protection whose pages follow each other in the file
        // are one host mapping (fewer round trips to the stub).
        let mut runs: Vec<Region> = Vec::new();
        for r in &state.regions {
            match runs.last_mut() {
                Some(l) if l.file.is_none() && r.file.is_none() && l.end == r.start && l.prot == r.prot && l.offset + (l.end - l.start) == r.offset => {
                    l.end = r.end
                }
                _ => runs.push(r.clone()),
            }
        }
        let flags = libc::MAP_PRIVATE | libc::MAP_NORESERVE;
        // Each mapping's file, kept for resets (`super::reset`).
        let mem = std::sync::Arc::new(std::os::fd::OwnedFd::from(mem));
        let mut origin = super::reset::OriginBuilder::new();
        for r in &runs {
            let Some(f) = &r.file else {
                stub.map(r.start, r.end - r.start, r.prot as i32, flags, Some(mem.as_fd()), r.offset).map_err(|e| stub_err("map guest memory", e))?;
                origin.mapped(r.start, r.end - r.start, r.prot as i32, &mem, r.offset);
                continue;
            };
            let changed = || Error::SnapshotCorrupt {
                path: dir.join(SYSTRAP_STATE_FILE).display().to_string(),
                reason: format!("{} is not the file the snapshot mapped (it changed or is gone); take the snapshot again", f.path),
            };
            let fd = os.vfs.open("/", f.path.as_bytes(), libc::O_RDONLY | libc::O_CLOEXEC, 0).map_err(|_| changed())?;
            if fstat_id(&fd) != Some((f.dev, f.ino)) {
                return Err(changed());
            }
            stub.map(r.start, r.end - r.start, r.prot as i32, flags, Some(fd.as_fd()), f.offset).map_err(|e| stub_err("map a program file", e))?;
            origin.mapped(r.start, r.end - r.start, r.prot as i32, &std::sync::Arc::new(fd), f.offset);
            for &(p, n) in &r.patches {
                let (va, off) = (r.start + p * PAGE, r.offset + p * PAGE);
                stub.map(va, n * PAGE, r.prot as i32, flags, Some(mem.as_fd()), off).map_err(|e| stub_err("map guest memory", e))?;
                origin.mapped(va, n * PAGE, r.prot as i32, &mem, off);
            }
        }
        let reset = origin.finish(dir.to_path_buf(), &state, &stub)?;
        prefault(&mut stub, &runs, mem.as_fd());
        stub.load_xsave(&state.xsave).map_err(|e| stub_err("load the XSAVE area (a snapshot from another CPU?)", e))?;
        stub.restore_patches(state.patches.clone()).map_err(|e| stub_err("restore the patched syscall sites", e))?;
        let (capture, stdio) = match stdio {
            Some(fds) => (None, fds),
            None => {
                let (c, fds) = Capture::new().map_err(Error::sys("memfds for the guest's stdout and stderr"))?;
                (Some(c), fds)
            }
        };
        os.set_stdio(stdio)?;
        crate::guestos::signal::host::install();
        let guest_pid = os.proc.pid;
        Ok(Process {
            stub,
            os,
            regs: state.regs,
            fs_base: state.fs_base,
            budget: if state.budget == 0 { DEFAULT_BUDGET } else { state.budget },
            exited: None,
            capture,
            guest_pid,
            child_stubs: Vec::new(),
            writable_root: false,
            warm: super::warm::Warm::default(),
            vvar: Default::default(),
            traps: super::Traps::default(),
            reset,
        })
    }
}

/// The device and inode of the file the guest path `path` names in `vfs`.
fn file_id(vfs: &crate::guestos::vfs::Vfs, path: &str) -> Option<(u64, u64)> {
    let fd = vfs.open("/", path.as_bytes(), libc::O_RDONLY | libc::O_CLOEXEC, 0).ok()?;
    fstat_id(&fd)
}

fn fstat_id(fd: &std::os::fd::OwnedFd) -> Option<(u64, u64)> {
    let m = std::fs::File::from(fd.try_clone().ok()?).metadata().ok()?;
    Some((std::os::unix::fs::MetadataExt::dev(&m), std::os::unix::fs::MetadataExt::ino(&m)))
}

/// Give the restored stub the page-table entries of its memory now, as the process it was taken
/// from had them. A fork of a stub (a clone of the sandbox) copies the entries of a private file
/// mapping only once that mapping has anonymous memory (the host's rule: otherwise the child
/// faults each page in from the page cache again), so without this every clone of a restored
/// zygote would fault in every page its first exec touches (a clone's first exec measured 3-4x a
/// live zygote's in benches/bench_systrap_sdk.py). Each readable program-file mapping is populated
/// for reading (the page cache's pages, still shared by every restore of the snapshot: nothing is
/// copied), and of the memory file's mappings only the pages the file holds data for: its holes
/// are pages the process never had (most of a thread's 8 MiB stack, the heap's untouched tail;
/// 19 of the python agent's 24 MiB), and every entry populated is one more that each fork of the
/// stub copies and each exit tears down (`COLLIMATE_SYSTRAP_PREFAULT_HOLES=1` populates them too,
/// what the restore did before: docs/systrap.md, "fork_group(64)"). One page of each writable
/// mapping is populated for writing (its anonymous memory begins). Best effort: a host without
/// `MADV_POPULATE_*` (Linux 5.14) or `SEEK_DATA` only loses the speed.
fn prefault(stub: &mut Stub, runs: &[Region], mem: std::os::fd::BorrowedFd<'_>) {
    const MADV_POPULATE_WRITE: i32 = 23;
    let holes_too = std::env::var_os("COLLIMATE_SYSTRAP_PREFAULT_HOLES").is_some_and(|v| v == "1");
    let mut read = Vec::new();
    for r in runs {
        if r.prot & libc::PROT_READ as u32 == 0 {
            continue;
        }
        if r.file.is_some() || holes_too {
            read.push((r.start, r.end - r.start));
        } else {
            read.extend(data_runs(mem, r.offset, r.end - r.start).into_iter().map(|(at, len)| (r.start + (at - r.offset), len)));
        }
    }
    let _ = stub.populate(&crate::platform::systrap::written::Learned { write: Vec::new(), read });
    for r in runs {
        if r.prot & libc::PROT_WRITE as u32 != 0 {
            let _ = stub.advise(r.start, PAGE, MADV_POPULATE_WRITE);
        }
    }
}

/// The runs of `[offset, offset + len)` in `file` that hold data (not holes), page-aligned; the
/// whole range where the file system cannot tell (`SEEK_DATA` unsupported).
fn data_runs(file: std::os::fd::BorrowedFd<'_>, offset: u64, len: u64) -> Vec<(u64, u64)> {
    use std::os::fd::AsRawFd;
    let (end, fd) = (offset + len, file.as_raw_fd());
    let mut out = Vec::new();
    let mut at = offset;
    while at < end {
        // SAFETY: lseek on a file we own; no memory is passed.
        let data = unsafe { libc::lseek(fd, at as libc::off_t, libc::SEEK_DATA) };
        if data < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::ENXIO) {
                break; // no data from `at` on
            }
            return vec![(offset, len)];
        }
        let data = (data as u64 / PAGE * PAGE).max(at);
        if data >= end {
            break;
        }
        // SAFETY: as above.
        let hole = unsafe { libc::lseek(fd, data as libc::off_t, libc::SEEK_HOLE) };
        let hole = if hole < 0 { end } else { (hole as u64).div_ceil(PAGE) * PAGE }.min(end);
        out.push((data, hole - data));
        at = hole;
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    fn dir_with(name: &str, file: &str) -> std::path::PathBuf {
        let d = std::env::temp_dir().join(format!("collimate-snap-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&d);
        std::fs::create_dir_all(&d).unwrap();
        std::fs::write(d.join(file), b"x").unwrap();
        d
    }

    #[test]
    fn a_snapshot_of_the_other_platform_says_which_to_use() {
        let kvm = dir_with("kvm", persist::STATE_FILE);
        let e = read_state(&kvm).unwrap_err().to_string();
        assert!(e.contains("taken on the kvm platform and cannot be restored on systrap") && e.contains("platform=\"kvm\""), "{e}");
        let systrap = dir_with("systrap", SYSTRAP_STATE_FILE);
        let e = persist::read_state(&systrap).unwrap_err().to_string();
        assert!(e.contains("taken on the systrap platform and cannot be restored on kvm") && e.contains("platform=\"systrap\""), "{e}");
        assert_eq!(persist::platform_of(&kvm), Some(crate::protocol::Platform::Kvm));
        assert_eq!(persist::platform_of(&systrap), Some(crate::protocol::Platform::Systrap));
        for d in [kvm, systrap] {
            let _ = std::fs::remove_dir_all(d);
        }
    }

    #[test]
    fn the_state_round_trips_and_damage_is_refused() {
        let state = SystrapState {
            regs: kvm_regs { rip: 0x401000, rsp: 0x7ffe_0000, ..Default::default() },
            fs_base: 0x1234,
            xsave: vec![7; 576],
            budget: 1 << 30,
            regions: vec![Region { start: 0x400000, end: 0x401000, prot: 5, offset: 0, file: None, patches: Vec::new() }],
            os: OsState {
                mm: Default::default(),
                proc: Default::default(),
                enosys: Default::default(),
                threads: Default::default(),
                files: Vec::new(),
                fds: Vec::new(),
                root: "/".into(),
                mounts: Vec::new(),
                ro_mounts: Vec::new(),
            },
            patches: patch::Saved { sites: vec![(39, 0x7fff_f000_1007)], rejected: vec![0x7fff_f000_2007], seen: vec![(0x7fff_f000_3007, 1)] },
        };
        let bytes = persist::encode_as(&state, FORMAT_VERSION).unwrap();
        assert_eq!(persist::decode_as::<SystrapState>(&bytes, "x", FORMAT_VERSION).unwrap(), state);
        let mut bad = bytes.clone();
        bad[bytes.len() / 2] ^= 0x5a;
        assert!(persist::decode_as::<SystrapState>(&bad, "x", FORMAT_VERSION).is_err());
        // A kvm state file's version is not a systrap one's.
        assert!(matches!(persist::decode_as::<SystrapState>(&bytes, "x", FORMAT_VERSION + 1), Err(Error::SnapshotVersion { .. })));
    }
}
