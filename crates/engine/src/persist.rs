//! The snapshot format: a paused VM as two files in a directory.
//!
//! `vm.state`:
//! ```text
//! offset 0   8 bytes  magic "CLMTSNAP"
//! offset 8   u32 LE   format version (FORMAT_VERSION)
//! offset 12  u64 LE   payload length N
//! offset 20  N bytes  payload: postcard encoding of `SnapshotState`
//! offset 20+N u32 LE  CRC-32 (IEEE) of bytes [0, 20+N)
//! ```
//! `vm.mem`: the guest-physical memory image, raw, exactly `mem_size` bytes, sparse where zero. It is
//! mapped `MAP_PRIVATE | MAP_NORESERVE` by every VM restored from it and never written after creation.
//!
//! The CRC detects every corruption of up to 32 consecutive bits and all but 2^-32 of the rest; the
//! length fields catch truncation. Bump `FORMAT_VERSION` whenever `SnapshotState` changes shape.

use std::path::Path;

use serde::{Deserialize, Serialize};

use crate::error::{Error, Result};
use crate::vmm::RuntimeState;
use crate::vstate::vcpu::VcpuState;

pub const MAGIC: &[u8; 8] = b"CLMTSNAP";
pub const FORMAT_VERSION: u32 = 12;
pub const STATE_FILE: &str = "vm.state";
pub const MEMORY_FILE: &str = "vm.mem";
const HEADER: usize = 20;

/// Everything but memory.
#[derive(Clone, Debug, Serialize, Deserialize, PartialEq)]
pub struct SnapshotState {
    pub mem_size: u64,
    pub vcpu: VcpuState,
    pub runtime: RuntimeState,
    /// The Linux personality's state, for VMs running a Linux program; the writable mounts'
    /// contents are in `fs/` beside the state file.
    pub os: Option<crate::guestos::persist::OsState>,
    /// The CPUID the guest was given (`arch::x86_64::cpuid`), given again to every VM restored
    /// from this snapshot. Since version 11.
    pub cpu: crate::arch::x86_64::cpuid::CpuTemplate,
}

pub fn encode(state: &SnapshotState) -> Result<Vec<u8>> {
    encode_as(state, FORMAT_VERSION)
}

pub fn decode(bytes: &[u8], path: &str) -> Result<SnapshotState> {
    decode_as(bytes, path, FORMAT_VERSION)
}

/// `state` in this file's framing (magic, `version`, length, postcard payload, CRC): the one format
/// every platform's state file uses (the systrap platform's, `vmm::systrap::snapshot`, too).
pub fn encode_as<T: Serialize>(state: &T, version: u32) -> Result<Vec<u8>> {
    let payload = postcard::to_stdvec(state).map_err(|e| Error::Protocol(format!("encode snapshot: {e}")))?;
    let mut out = Vec::with_capacity(HEADER + payload.len() + 4);
    out.extend_from_slice(MAGIC);
    out.extend_from_slice(&version.to_le_bytes());
    out.extend_from_slice(&(payload.len() as u64).to_le_bytes());
    out.extend_from_slice(&payload);
    let crc = crc32fast::hash(&out);
    out.extend_from_slice(&crc.to_le_bytes());
    Ok(out)
}

/// The state [`encode_as`] framed, checked (magic, lengths, CRC, `version`).
pub fn decode_as<T: serde::de::DeserializeOwned>(bytes: &[u8], path: &str, expected: u32) -> Result<T> {
    let corrupt = |reason: String| Error::SnapshotCorrupt { path: path.to_string(), reason };
    if bytes.len() < 8 || &bytes[..8] != MAGIC {
        return Err(corrupt("not a collimate snapshot state file (bad magic)".into()));
    }
    if bytes.len() < HEADER + 4 {
        return Err(corrupt(format!("truncated: {} bytes", bytes.len())));
    }
    let version = u32::from_le_bytes(bytes[8..12].try_into().unwrap_or_default());
    let len = u64::from_le_bytes(bytes[12..20].try_into().unwrap_or_default());
    let expect_total = (HEADER as u64).checked_add(len).and_then(|v| v.checked_add(4));
    if expect_total != Some(bytes.len() as u64) {
        // A CRC failure is the better message when the length field itself is what got damaged.
        let crc_ok = crc32fast::hash(&bytes[..bytes.len() - 4])
            == u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap_or_default());
        return Err(corrupt(if crc_ok || expect_total.unwrap_or(0) > bytes.len() as u64 {
            format!("truncated or extended: {} bytes, header says {}", bytes.len(), HEADER as u64 + len + 4)
        } else {
            "checksum mismatch".into()
        }));
    }
    let body = &bytes[..bytes.len() - 4];
    let crc = u32::from_le_bytes(bytes[bytes.len() - 4..].try_into().unwrap_or_default());
    if crc32fast::hash(body) != crc {
        return Err(corrupt("checksum mismatch".into()));
    }
    if version != expected {
        return Err(Error::SnapshotVersion { path: path.to_string(), found: version, expected });
    }
    postcard::from_bytes(&body[HEADER..]).map_err(|e| corrupt(format!("undecodable state: {e}")))
}

pub fn write_state(dir: &Path, state: &SnapshotState) -> Result<()> {
    write_file(dir, STATE_FILE, &encode(state)?)
}

/// Write `bytes` as `dir/name`, owner-only, beside then renamed (a reader never sees half a file).
pub fn write_file(dir: &Path, name: &str, bytes: &[u8]) -> Result<()> {
    let tmp = dir.join(format!(".{name}.tmp"));
    // Owner-only, as the memory file (see `GuestMemory::write_image`).
    let mut f = std::os::unix::fs::OpenOptionsExt::mode(std::fs::OpenOptions::new().write(true).create(true).truncate(true), 0o600)
        .open(&tmp)
        .map_err(Error::sys("write snapshot state"))?;
    std::io::Write::write_all(&mut f, bytes).map_err(Error::sys("write snapshot state"))?;
    std::fs::rename(&tmp, dir.join(name)).map_err(Error::sys("rename snapshot state"))
}

/// The platform a snapshot directory was taken on, by its state file (`None`: neither is there).
pub fn platform_of(dir: &Path) -> Option<crate::protocol::Platform> {
    if dir.join(STATE_FILE).exists() {
        Some(crate::protocol::Platform::Kvm)
    } else if dir.join(SYSTRAP_STATE_FILE).exists() {
        Some(crate::protocol::Platform::Systrap)
    } else {
        None
    }
}

/// The state file of a snapshot taken on the systrap platform (`vmm::systrap::snapshot`).
pub const SYSTRAP_STATE_FILE: &str = "systrap.state";

/// The error for a snapshot of one platform given to the other.
pub fn wrong_platform(dir: &Path, taken_on: &str, wanted: &str) -> Error {
    Error::InvalidArgument(format!(
        "the snapshot in {} was taken on the {taken_on} platform and cannot be restored on {wanted}: a snapshot holds \
         one platform's guest state (kvm: guest-physical memory and a vCPU; systrap: a host process's mappings and \
         registers); restore it with platform=\"{taken_on}\", or take the snapshot again on {wanted}",
        dir.display()
    ))
}

pub fn read_state(dir: &Path) -> Result<SnapshotState> {
    let path = dir.join(STATE_FILE);
    if !path.exists() && dir.join(SYSTRAP_STATE_FILE).exists() {
        return Err(wrong_platform(dir, "systrap", "kvm"));
    }
    let bytes = std::fs::read(&path).map_err(|e| Error::SnapshotCorrupt {
        path: path.display().to_string(),
        reason: format!("cannot read: {e}"),
    })?;
    decode(&bytes, &path.display().to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::arch::x86_64::paging::{AddressSpace, FrameAllocator};

    fn sample() -> SnapshotState {
        // SAFETY: all-zero is a valid value for these plain-data KVM structs.
        let vcpu = VcpuState {
            mp_state: Default::default(),
            regs: kvm_bindings::kvm_regs { rax: 1, rip: 0x401000, ..Default::default() },
            sregs: Default::default(),
            xsave: vec![0; 1024],
            xcrs: Default::default(),
            debugregs: Default::default(),
            msrs: vec![kvm_bindings::kvm_msr_entry { index: 0x10, data: 5, ..Default::default() }],
            events: Default::default(),
        };
        SnapshotState {
            mem_size: 1 << 30,
            vcpu,
            runtime: RuntimeState {
                frames: FrameAllocator::new(1 << 30),
                aspace: AddressSpace { root: 0x200000, huge: Default::default() },
                enosys: 0,
            },
            os: None,
            cpu: crate::arch::x86_64::cpuid::CpuTemplate { entries: Vec::new(), unfiltered: None },
        }
    }

    #[test]
    fn round_trip() {
        let s = sample();
        assert_eq!(decode(&encode(&s).unwrap(), "x").unwrap(), s);
    }

    #[test]
    fn every_single_byte_flip_and_truncation_is_refused() {
        let bytes = encode(&sample()).unwrap();
        for i in 0..bytes.len() {
            let mut b = bytes.clone();
            b[i] ^= 0x5a;
            assert!(decode(&b, "x").is_err(), "flip at {i} accepted");
        }
        for n in 0..bytes.len() {
            assert!(decode(&bytes[..n], "x").is_err(), "truncation to {n} accepted");
        }
    }

    #[test]
    fn foreign_version_gets_its_own_error() {
        let mut b = encode(&sample()).unwrap();
        b[8..12].copy_from_slice(&99u32.to_le_bytes());
        let n = b.len();
        let crc = crc32fast::hash(&b[..n - 4]);
        b[n - 4..].copy_from_slice(&crc.to_le_bytes());
        assert!(matches!(decode(&b, "x"), Err(Error::SnapshotVersion { found: 99, .. })));
    }
}
