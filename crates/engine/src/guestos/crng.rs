//! The sandbox CRNG: the one source of every random byte a guest gets (getrandom, /dev/urandom and
//! /dev/random, AT_RANDOM), so that a reseed with a known seed makes the guest's randomness
//! reproducible.
//!
//! # Construction, version 1 (`collimate-crng-v1`)
//!
//! - **Key.** A reseed with a 32-byte seed sets `key = SHA-256("collimate-crng-v1" || seed)` (the
//!   17 ASCII bytes of the tag, then the seed; no separator, no length).
//! - **Output.** The ChaCha20 keystream under `key`: 20 rounds, djb's layout with a 64-bit block
//!   counter starting at 0 and a 64-bit nonce of 0. For the first 2^32 blocks (256 GiB) this is
//!   RFC 8439 ChaCha20 with an all-zero 96-bit nonce and initial counter 0. The state is the key and
//!   the number of bytes handed out so far (`pos`), so the bytes a guest gets never depend on how
//!   its reads were split.
//! - **New sandbox.** Seeded as above with 32 bytes from the host's CSPRNG (getrandom).
//! - **Sandbox clone** (a fork of the VMM process, a restore of a snapshot, a reset):
//!   [`Crng::diverge`] replaces the key with `SHA-256("collimate-crng-v1/mix" || key || host32)`,
//!   `host32` fresh host entropy, and restarts the stream, unless the CRNG was seeded explicitly.
//!   **Unseeded clones never share randomness**; a seeded one keeps its deterministic stream (that
//!   is what makes a replay of a forked branch reproducible), and every clone can be reseeded.
//! - **Guest fork** (a process of the sandbox forking, as Linux does): the child's CRNG is
//!   [`Crng::fork_child`]: `key' = SHA-256("collimate-crng-v1/fork" || key || n as u64 LE)` where `n`
//!   counts the parent's forks from 0; the child's stream starts at 0. Deterministic, so replays stay
//!   reproducible, and parent and child (and siblings) draw different streams.
//!
//! The test vectors (here and in tests/data/seed_vectors.json, checked from Rust and Python) pin
//! the construction; a change to it is a new version with a new tag.

use rand_chacha::rand_core::{Rng, SeedableRng};
use rand_chacha::ChaCha20Rng;
use serde::{Deserialize, Serialize};
use sha2::{Digest, Sha256};

/// Domain tag of the seed-to-key derivation, and so the construction's version.
pub const TAG: &[u8] = b"collimate-crng-v1";
const TAG_MIX: &[u8] = b"collimate-crng-v1/mix";
const TAG_FORK: &[u8] = b"collimate-crng-v1/fork";

/// A seed: 32 bytes (64 hex characters where people see it).
pub type Seed = [u8; 32];

/// The sandbox CRNG's state: part of a process's OS state, so it is carried in snapshots.
#[derive(Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Crng {
    /// The ChaCha20 key.
    key: [u8; 32],
    /// Bytes of the keystream handed out.
    pos: u64,
    /// Guest forks made so far (numbers the children's streams).
    forks: u64,
    /// Whether the key came from an explicit seed (a reseed) rather than host entropy: a seeded
    /// CRNG keeps its stream across clones ([`Crng::diverge`] leaves it alone).
    seeded: bool,
}

impl std::fmt::Debug for Crng {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        // The key stays out of logs: with it, every later byte the guest gets is known.
        f.debug_struct("Crng").field("pos", &self.pos).field("forks", &self.forks).field("seeded", &self.seeded).finish()
    }
}

impl Default for Crng {
    /// A CRNG seeded from host entropy (what a new sandbox gets).
    fn default() -> Self {
        Crng::from_host_entropy()
    }
}

fn sha256(parts: &[&[u8]]) -> [u8; 32] {
    let mut h = Sha256::new();
    for p in parts {
        h.update(p);
    }
    h.finalize().into()
}

/// 32 bytes from the host's CSPRNG.
pub fn host_entropy() -> [u8; 32] {
    let mut b = [0u8; 32];
    let mut got = 0;
    while got < b.len() {
        // SAFETY: getrandom into the unfilled tail of a local buffer; the result is checked.
        let n = unsafe { libc::getrandom(b[got..].as_mut_ptr().cast(), b.len() - got, 0) };
        if n < 0 {
            let e = std::io::Error::last_os_error();
            if e.raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            // getrandom(2) without GRND_NONBLOCK on an initialised pool does not fail otherwise;
            // a sandbox without randomness is not something to carry on with.
            panic!("host getrandom failed: {e}");
        }
        got += n as usize;
    }
    b
}

impl Crng {
    /// The CRNG after a reseed with `seed` (see the module documentation).
    pub fn from_seed(seed: Seed) -> Crng {
        Crng { key: sha256(&[TAG, &seed]), pos: 0, forks: 0, seeded: true }
    }

    /// A CRNG keyed from host entropy, as for a new sandbox.
    pub fn from_host_entropy() -> Crng {
        Crng { seeded: false, ..Crng::from_seed(host_entropy()) }
    }

    /// Restart from `seed`: the same output as [`Crng::from_seed`] whatever came before.
    pub fn reseed(&mut self, seed: Seed) {
        *self = Crng::from_seed(seed);
    }

    /// Whether the current key came from an explicit seed.
    pub fn is_seeded(&self) -> bool {
        self.seeded
    }

    /// Bytes handed out since the last (re)seed.
    pub fn position(&self) -> u64 {
        self.pos
    }

    /// The next `buf.len()` bytes of the stream.
    pub fn fill(&mut self, buf: &mut [u8]) {
        if buf.is_empty() {
            return;
        }
        let mut rng = ChaCha20Rng::from_seed(self.key);
        rng.set_word_pos(u128::from(self.pos / 4));
        let mut done = 0;
        let skip = (self.pos % 4) as usize;
        if skip != 0 {
            let w = rng.next_u32().to_le_bytes();
            let n = (4 - skip).min(buf.len());
            buf[..n].copy_from_slice(&w[skip..skip + n]);
            done = n;
        }
        let whole = (buf.len() - done) / 4 * 4;
        rng.fill_bytes(&mut buf[done..done + whole]);
        done += whole;
        if done < buf.len() {
            let w = rng.next_u32().to_le_bytes();
            let n = buf.len() - done;
            buf[done..].copy_from_slice(&w[..n]);
        }
        self.pos = self.pos.wrapping_add(buf.len() as u64);
    }

    /// Mix fresh host entropy in and restart the stream, unless the CRNG was seeded explicitly:
    /// called for every sandbox clone (fork of the VMM process, restore, reset), so that clones of
    /// one unseeded template never share randomness. Returns whether it changed the key.
    pub fn diverge(&mut self) -> bool {
        if self.seeded {
            return false;
        }
        self.key = sha256(&[TAG_MIX, &self.key, &host_entropy()]);
        self.pos = 0;
        self.forks = 0;
        true
    }

    /// The CRNG of a child process forked by the guest: derived deterministically from this one
    /// and the number of forks it made before (see the module documentation).
    pub fn fork_child(&mut self) -> Crng {
        let n = self.forks;
        self.forks = self.forks.wrapping_add(1);
        Crng { key: sha256(&[TAG_FORK, &self.key, &n.to_le_bytes()]), pos: 0, forks: 0, seeded: self.seeded }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hex(b: &[u8]) -> String {
        b.iter().map(|x| format!("{x:02x}")).collect()
    }

    fn unhex(s: &str) -> Vec<u8> {
        (0..s.len()).step_by(2).map(|i| u8::from_str_radix(&s[i..i + 2], 16).unwrap()).collect()
    }

    fn seed_of(s: &str) -> Seed {
        unhex(s).try_into().unwrap()
    }

    fn take(c: &mut Crng, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        c.fill(&mut v);
        v
    }

    /// The raw keystream is standard ChaCha20: RFC 7539 appendix A.1, test vectors 1 and 2 (zero
    /// key, zero nonce, block counters 0 and 1).
    #[test]
    fn keystream_is_rfc_chacha20() {
        let mut c = Crng { key: [0; 32], pos: 0, forks: 0, seeded: true };
        let out = take(&mut c, 128);
        assert_eq!(
            hex(&out[..64]),
            "76b8e0ada0f13d90405d6ae55386bd28bdd219b8a08ded1aa836efcc8b770dc7\
             da41597c5157488d7724e03fb8d84a376a43b8f41518a11cc387b669b2ee6586"
        );
        assert_eq!(
            hex(&out[64..]),
            "9f07e7be5551387a98ba977c732d080dcb0f29a048e3656912c6533e32ee7aed\
             29b721769ce64e43d57133b074d839d531ed1f28510afb45ace10a1f4b794d6f"
        );
    }

    /// Known answers for the whole construction, shared with the Python side.
    #[test]
    fn known_answers_from_the_shared_vectors() {
        let text = include_str!("../../../../tests/data/seed_vectors.json");
        // A tiny reader for the "crng" entries: {"seed": "...", "offset": N, "hex": "..."}.
        let section = &text[text.find("\"crng\"").expect("crng section")..];
        let section = &section[..section.find(']').unwrap()];
        let mut n = 0;
        for entry in section.split('{').skip(1) {
            let field = |name: &str| {
                let i = entry.find(&format!("\"{name}\"")).unwrap() + name.len() + 2;
                let rest = entry[i..].trim_start_matches([' ', ':']);
                rest[..rest.find([',', '}', '\n']).unwrap()].trim().trim_matches('"').to_string()
            };
            let (seed, offset, want) = (seed_of(&field("seed")), field("offset").parse::<usize>().unwrap(), field("hex"));
            let mut c = Crng::from_seed(seed);
            let got = take(&mut c, offset + want.len() / 2);
            assert_eq!(hex(&got[offset..]), want, "seed {}", field("seed"));
            n += 1;
        }
        assert!(n >= 3, "only {n} crng vectors");
        // And one spelled out here: seed = 32 zero bytes.
        let mut c = Crng::from_seed([0; 32]);
        assert_eq!(hex(&take(&mut c, 32)), "ccce174ddda08b6788294501ad61d93049490188c5f6f4798052cbfd703a2510");
    }

    #[test]
    fn output_does_not_depend_on_read_sizes() {
        let seed = [7u8; 32];
        let whole = take(&mut Crng::from_seed(seed), 1000);
        let mut c = Crng::from_seed(seed);
        let mut pieces = Vec::new();
        for n in [1, 2, 3, 0, 5, 64, 7, 128, 1, 300, 4, 485] {
            pieces.extend(take(&mut c, n));
        }
        assert_eq!(pieces, whole);
        assert_eq!(c.position(), 1000);
    }

    #[test]
    fn reseed_is_deterministic() {
        let seed = seed_of("c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00");
        let mut a = Crng::from_host_entropy();
        let mut b = Crng::from_host_entropy();
        assert!(!a.is_seeded());
        assert_ne!(take(&mut a, 32), take(&mut b, 32), "host-seeded CRNGs differ");
        take(&mut b, 77);
        a.reseed(seed);
        b.reseed(seed);
        assert!(a.is_seeded());
        assert_eq!(a, b);
        assert_eq!(take(&mut a, 64), take(&mut b, 64));
        let mut other = Crng::from_seed(seed_of("c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee00c0ffee01"));
        assert_ne!(take(&mut Crng::from_seed(seed), 64), take(&mut other, 64));
    }

    #[test]
    fn serde_round_trip_continues_the_stream() {
        let mut c = Crng::from_seed([3; 32]);
        take(&mut c, 13);
        let bytes = postcard::to_allocvec(&c).unwrap();
        let mut back: Crng = postcard::from_bytes(&bytes).unwrap();
        assert_eq!(back, c);
        assert_eq!(take(&mut back, 100), take(&mut c, 100));
        // Unseeded state round-trips too, flag included.
        let u = Crng::from_host_entropy();
        let back: Crng = postcard::from_bytes(&postcard::to_allocvec(&u).unwrap()).unwrap();
        assert_eq!(back, u);
        assert!(!back.is_seeded());
    }

    #[test]
    fn fork_streams_differ_and_are_deterministic() {
        let mut parent = Crng::from_seed([9; 32]);
        take(&mut parent, 10);
        let mut twin = parent.clone();
        let mut c1 = parent.fork_child();
        let mut c2 = parent.fork_child();
        let (p, a, b) = (take(&mut parent, 64), take(&mut c1, 64), take(&mut c2, 64));
        assert_ne!(p, a);
        assert_ne!(p, b);
        assert_ne!(a, b);
        // The same history gives the same children.
        let mut t1 = twin.fork_child();
        assert_eq!(take(&mut t1, 64), a);
        assert!(c1.is_seeded());
        // The construction, spelled out.
        let k = sha256(&[TAG_FORK, &Crng::from_seed([9; 32]).key, &0u64.to_le_bytes()]);
        assert_eq!(Crng::from_seed([9; 32]).fork_child().key, k);
    }

    #[test]
    fn unseeded_clones_diverge_seeded_ones_do_not() {
        let template = Crng::from_host_entropy();
        let (mut a, mut b) = (template.clone(), template.clone());
        assert!(a.diverge() && b.diverge());
        assert_ne!(take(&mut a, 32), take(&mut b, 32));
        let seeded = Crng::from_seed([1; 32]);
        let (mut a, mut b) = (seeded.clone(), seeded.clone());
        assert!(!a.diverge() && !b.diverge());
        assert_eq!(take(&mut a, 32), take(&mut b, 32));
    }

    #[test]
    fn debug_hides_the_key() {
        let c = Crng::from_seed([0; 32]);
        let s = format!("{c:?}");
        assert!(!s.contains("key") && s.contains("pos"), "{s}");
    }
}
