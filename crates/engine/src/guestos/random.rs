//! Randomness the guest gets (getrandom, AT_RANDOM, /dev/urandom), and the replay switch.
//!
//! Everything the host decides for the guest that a replay would have to reproduce goes through one
//! function per kind: [`random_bytes`] for randomness and [`super::clock::clock_now`] for clocks.
//!
//! # Deterministic replay
//!
//! Randomness comes from the sandbox CRNG ([`super::crng::Crng`], in [`Proc::crng`]): seeded from
//! host entropy when the sandbox is made, given fresh host entropy on every unseeded sandbox clone
//! ([`diverge`]), and reset to a known stream by [`reseed`]. A reseed with `replay` also switches
//! the clocks to virtual time (see [`super::clock`]). Both are part of [`Proc`], so snapshots, forks
//! and resets carry them. See docs/replay.md.

use super::crng::Seed;
use super::process::Proc;
use super::{Ctx, Errno, GuestOs, SysResult, EINVAL};

/// Fill `buf` with random bytes for the guest (getrandom, AT_RANDOM, /dev/urandom and /dev/random).
///
/// The one source of guest randomness: the sandbox CRNG in [`Proc::crng`] (see the module comment).
pub fn random_bytes(proc: &mut Proc, buf: &mut [u8]) -> Result<(), Errno> {
    proc.crng.fill(buf);
    Ok(())
}

/// Reseed the sandbox CRNG of `os` with `seed` and, with `replay`, run its clocks on virtual time
/// from now on (without, on the host's clocks). Meant for a pause point: between runs, before the
/// code whose randomness should be reproducible. Everything the guest draws afterwards is a function
/// of `seed` and of what the guest does; the same holds for the clocks in replay mode.
pub fn reseed(os: &mut GuestOs, seed: Seed, replay: bool) {
    let (wall, cpu) = super::timer::clocks_now(os);
    let p = &mut os.proc;
    p.crng.reseed(seed);
    // A sleep cut into slices restarts from its full duration in the new mode.
    p.sleep = None;
    if replay {
        p.clocks.start_replay(&mut p.start_ns);
    } else {
        p.clocks.replay = false;
    }
    super::timer::rebase(os, wall, cpu);
}

/// After a sandbox clone (a fork of the VMM process, a restore, a reset): give an unseeded CRNG
/// fresh host entropy, so that **unseeded clones never share randomness**. A CRNG seeded by
/// [`reseed`] keeps its stream: clones of a seeded sandbox replay alike until reseeded.
pub fn diverge(os: &mut GuestOs) {
    os.proc.crng.diverge();
}

pub const SYS_GETRANDOM: u64 = 318;

/// Handle getrandom; `None` if `nr` is not one of these.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let p = &mut os.proc;
    let r = match nr {
        SYS_GETRANDOM => getrandom(p, ctx, a[0], a[1], a[2]),
        _ => return None,
    };
    Some(r)
}

fn getrandom(p: &mut Proc, ctx: &mut Ctx, buf: u64, len: u64, flags: u64) -> SysResult {
    const GRND_NONBLOCK: u64 = 1;
    const GRND_RANDOM: u64 = 2;
    const GRND_INSECURE: u64 = 4;
    if flags & !(GRND_NONBLOCK | GRND_RANDOM | GRND_INSECURE) != 0 || flags & (GRND_RANDOM | GRND_INSECURE) == GRND_RANDOM | GRND_INSECURE {
        return Err(EINVAL);
    }
    // Linux may return fewer bytes than asked for large requests; so do we, past 1 MiB.
    let n = len.min(1 << 20) as usize;
    let mut b = vec![0u8; n];
    random_bytes(p, &mut b)?;
    ctx.write(buf, &b)?;
    Ok(n as u64)
}
