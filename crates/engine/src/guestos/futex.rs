//! futex(2) for the threads of one guest process.
//!
//! All threads of a guest process share its one vCPU (see [`super::thread`]), so a futex wait
//! never waits on the host: the waiting thread is parked with its [`FutexKey`] and bitset in the
//! [`FutexTable`], and the VMM's thread scheduler runs another thread. A wake finds waiters in the
//! table in the order they came (FIFO, as Linux does for waiters of equal priority), and the
//! scheduler gives each woken thread its return value (0; ETIMEDOUT when its deadline passes
//! first; EINTR when a signal interrupts it).
//!
//! What [`sys_futex`] serves: WAIT, WAKE, WAIT_BITSET, WAKE_BITSET, REQUEUE, CMP_REQUEUE and
//! WAKE_OP, with FUTEX_PRIVATE_FLAG and FUTEX_CLOCK_REALTIME, relative (WAIT) and absolute
//! (WAIT_BITSET) timeouts. The priority-inheritance operations (LOCK_PI, UNLOCK_PI, TRYLOCK_PI,
//! WAIT_REQUEUE_PI, CMP_REQUEUE_PI, LOCK_PI2) answer ENOSYS: glibc uses them only for mutexes
//! created with PTHREAD_PRIO_INHERIT, and pthread_mutex_init reports ENOTSUP for those when the
//! kernel lacks them; CPython, OpenBLAS and OpenMP runtimes never ask for them.
//!
//! # Keys and the shared-memory hook
//! A futex is named by a [`FutexKey`]. Every word of private memory is `Private { addr }` (its
//! guest virtual address), whatever FUTEX_PRIVATE_FLAG says: a process's threads are its only
//! waiters there. A word in memory shared between guest processes (MAP_SHARED) needs waiters in
//! other VMM processes to be woken, which is a host-level wait: that is what
//! [`FutexKey::Shared`] is for. [`key_of`] is the one place that decides a word's key; the
//! shared-memory part of the runtime makes it answer `Shared` for words of shared mappings, and
//! serves such keys in [`SharedFutex`] (which this module only calls through). Until then every
//! key is private.

use std::collections::VecDeque;

use serde::{Deserialize, Serialize};

use super::{Errno, EAGAIN, EFAULT, EINVAL, ENOSYS};

pub const FUTEX_WAIT: u32 = 0;
pub const FUTEX_WAKE: u32 = 1;
pub const FUTEX_REQUEUE: u32 = 3;
pub const FUTEX_CMP_REQUEUE: u32 = 4;
pub const FUTEX_WAKE_OP: u32 = 5;
pub const FUTEX_WAIT_BITSET: u32 = 9;
pub const FUTEX_WAKE_BITSET: u32 = 10;
pub const FUTEX_PRIVATE_FLAG: u32 = 128;
pub const FUTEX_CLOCK_REALTIME: u32 = 256;
pub const FUTEX_BITSET_MATCH_ANY: u32 = u32::MAX;
/// Robust futexes: the owner died (set in the word by the robust-list walk at a thread's exit).
pub const FUTEX_OWNER_DIED: u32 = 0x4000_0000;
pub const FUTEX_WAITERS: u32 = 0x8000_0000;
pub const FUTEX_TID_MASK: u32 = 0x3fff_ffff;

/// What names a futex.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub enum FutexKey {
    /// A word of this process's private memory, by guest virtual address.
    Private { addr: u64 },
    /// A word of memory shared with other guest processes: the shared object (an id the
    /// shared-memory layer gives each shared mapping's backing) and the word's offset in it.
    /// Waiters on such a key may live in other VMM processes; see the module comment.
    Shared { object: u64, offset: u64 },
}

/// The host-level half of futexes on shared memory, which the shared-memory layer provides. A
/// thread of this process waiting on a shared key is parked here as any other (so the scheduler
/// can run the others); the layer's `wake` must also reach the other processes, and a process
/// whose threads all wait on shared keys waits on the host through `wait_host`.
pub trait SharedFutex {
    /// Wake up to `n` waiters of `key` in other processes (bitset `bitset`); how many it woke.
    fn wake_others(&self, key: FutexKey, n: u32, bitset: u32) -> u32;
}

/// The key of the futex word at `addr` (4-byte aligned, checked by the caller). `private`: the
/// operation carried FUTEX_PRIVATE_FLAG (then the word is never shared, whatever memory it is in).
pub fn key_of(addr: u64, _private: bool) -> FutexKey {
    FutexKey::Private { addr }
}

/// A parked thread waiting on a futex.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Waiter {
    pub tid: i32,
    pub key: FutexKey,
    pub bitset: u32,
}

/// The waiters of one process's futexes, oldest first.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FutexTable {
    waiters: VecDeque<Waiter>,
}

impl FutexTable {
    pub fn wait(&mut self, tid: i32, key: FutexKey, bitset: u32) {
        self.cancel(tid);
        self.waiters.push_back(Waiter { tid, key, bitset });
    }

    /// Remove `tid`'s wait (it timed out, was interrupted, exited). Whether it was waiting.
    pub fn cancel(&mut self, tid: i32) -> bool {
        let before = self.waiters.len();
        self.waiters.retain(|w| w.tid != tid);
        self.waiters.len() != before
    }

    /// Take up to `n` waiters of `key` whose bitset meets `bitset`, oldest first.
    pub fn wake(&mut self, key: FutexKey, n: u32, bitset: u32) -> Vec<i32> {
        let mut woken = Vec::new();
        self.waiters.retain(|w| {
            if woken.len() < n as usize && w.key == key && w.bitset & bitset != 0 {
                woken.push(w.tid);
                false
            } else {
                true
            }
        });
        woken
    }

    /// Wake up to `n_wake` waiters of `from`, then move up to `n_requeue` of the rest to `to`.
    /// Returns the woken threads and how many moved.
    pub fn requeue(&mut self, from: FutexKey, to: FutexKey, n_wake: u32, n_requeue: u32) -> (Vec<i32>, u32) {
        let woken = self.wake(from, n_wake, FUTEX_BITSET_MATCH_ANY);
        let mut moved = 0;
        for w in self.waiters.iter_mut() {
            if moved >= n_requeue {
                break;
            }
            if w.key == from {
                w.key = to;
                moved += 1;
            }
        }
        (woken, moved)
    }

    pub fn waiting(&self, tid: i32) -> Option<&Waiter> {
        self.waiters.iter().find(|w| w.tid == tid)
    }

    pub fn is_empty(&self) -> bool {
        self.waiters.is_empty()
    }

    /// Only `keep` remains (a fork copies the calling thread alone, execve ends the others).
    pub fn retain_thread(&mut self, keep: i32) {
        self.waiters.retain(|w| w.tid == keep);
    }
}

/// FUTEX_WAKE_OP's operation on the word at uaddr2: the new value, and whether the comparison
/// with the old value holds (then waiters of uaddr2 are woken too). EINVAL/ENOSYS for unknown
/// operations or comparisons, as Linux.
pub fn wake_op(encoded: u32, old: u32) -> Result<(u32, bool), Errno> {
    let op = (encoded >> 28) & 7;
    let shift = (encoded >> 28) & 8 != 0;
    let cmp = (encoded >> 24) & 15;
    let mut oparg = (encoded << 8) as i32 >> 20; // sign-extended 12 bits
    let cmparg = (encoded << 20) as i32 >> 20;
    if shift {
        if !(0..=31).contains(&oparg) {
            oparg &= 31; // Linux warns and masks
        }
        oparg = 1i32 << oparg;
    }
    let arg = oparg as u32;
    let new = match op {
        0 => arg,
        1 => old.wrapping_add(arg),
        2 => old | arg,
        3 => old & !arg,
        4 => old ^ arg,
        _ => return Err(ENOSYS),
    };
    let o = old as i32;
    let hit = match cmp {
        0 => o == cmparg,
        1 => o != cmparg,
        2 => o < cmparg,
        3 => o <= cmparg,
        4 => o > cmparg,
        5 => o >= cmparg,
        _ => return Err(ENOSYS),
    };
    Ok((new, hit))
}

/// The decoded arguments of a futex(2) call.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Call {
    pub uaddr: u64,
    pub cmd: u32,
    pub private: bool,
    pub realtime: bool,
    pub val: u32,
    /// The timeout pointer (WAIT ops) or val2 (REQUEUE ops: a count).
    pub timeout: u64,
    pub uaddr2: u64,
    pub val3: u32,
}

impl Call {
    pub fn decode(a: [u64; 6]) -> Call {
        let op = a[1] as u32;
        Call {
            uaddr: a[0],
            cmd: op & !(FUTEX_PRIVATE_FLAG | FUTEX_CLOCK_REALTIME),
            private: op & FUTEX_PRIVATE_FLAG != 0,
            realtime: op & FUTEX_CLOCK_REALTIME != 0,
            val: a[2] as u32,
            timeout: a[3],
            uaddr2: a[4],
            val3: a[5] as u32,
        }
    }
}

/// What a futex call does, once its arguments have been read.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Outcome {
    /// Return this to the caller.
    Done(Result<u64, Errno>),
    /// Park the caller on `key` until woken (0), its deadline passes (ETIMEDOUT) or a signal
    /// comes (EINTR). `timeout`: relative ns, or absolute on the monotonic/realtime clock.
    Wait { key: FutexKey, bitset: u32, timeout: Option<Timeout> },
}

/// A futex wait's timeout as the guest gave it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Timeout {
    Relative(u64),
    AbsMonotonic(u64),
    AbsRealtime(u64),
}

/// Guest memory as a futex call needs it.
pub trait Words {
    fn read_u32(&mut self, addr: u64) -> Result<u32, Errno>;
    fn write_u32(&mut self, addr: u64, v: u32) -> Result<(), Errno>;
    /// A `struct timespec` as nanoseconds (EINVAL if malformed).
    fn read_timespec(&mut self, addr: u64) -> Result<u64, Errno>;
}

/// Serve futex call `c` against `table` for thread `tid`. Woken threads are appended to `woken`
/// (their wait returns 0); the caller makes them runnable.
pub fn sys_futex(table: &mut FutexTable, mem: &mut dyn Words, c: Call, woken: &mut Vec<i32>) -> Outcome {
    let done = Outcome::Done;
    if c.uaddr % 4 != 0 {
        return done(Err(EINVAL));
    }
    let key = key_of(c.uaddr, c.private);
    match c.cmd {
        FUTEX_WAIT | FUTEX_WAIT_BITSET => {
            let bitset = if c.cmd == FUTEX_WAIT { FUTEX_BITSET_MATCH_ANY } else { c.val3 };
            if bitset == 0 {
                return done(Err(EINVAL));
            }
            if c.realtime && c.cmd == FUTEX_WAIT {
                // FUTEX_CLOCK_REALTIME is for the absolute (bitset) waits only.
                return done(Err(ENOSYS));
            }
            let timeout = if c.timeout == 0 {
                None
            } else {
                match mem.read_timespec(c.timeout) {
                    Ok(ns) if c.cmd == FUTEX_WAIT => Some(Timeout::Relative(ns)),
                    Ok(ns) if c.realtime => Some(Timeout::AbsRealtime(ns)),
                    Ok(ns) => Some(Timeout::AbsMonotonic(ns)),
                    Err(e) => return done(Err(e)),
                }
            };
            match mem.read_u32(c.uaddr) {
                Ok(v) if v != c.val => done(Err(EAGAIN)),
                Ok(_) => Outcome::Wait { key, bitset, timeout },
                Err(e) => done(Err(e)),
            }
        }
        FUTEX_WAKE | FUTEX_WAKE_BITSET => {
            let bitset = if c.cmd == FUTEX_WAKE { FUTEX_BITSET_MATCH_ANY } else { c.val3 };
            if bitset == 0 {
                return done(Err(EINVAL));
            }
            let w = table.wake(key, c.val, bitset);
            let n = w.len() as u64;
            woken.extend(w);
            done(Ok(n))
        }
        FUTEX_REQUEUE | FUTEX_CMP_REQUEUE => {
            if c.uaddr2 % 4 != 0 || (c.val as i32) < 0 || (c.timeout as i32) < 0 {
                return done(Err(EINVAL));
            }
            if c.cmd == FUTEX_CMP_REQUEUE {
                match mem.read_u32(c.uaddr) {
                    Ok(v) if v != c.val3 => return done(Err(EAGAIN)),
                    Ok(_) => {}
                    Err(e) => return done(Err(e)),
                }
            }
            let to = key_of(c.uaddr2, c.private);
            let (w, moved) = table.requeue(key, to, c.val, c.timeout as u32);
            let n = w.len() as u64;
            woken.extend(w);
            // REQUEUE answers the woken count; CMP_REQUEUE woken plus requeued.
            done(Ok(if c.cmd == FUTEX_CMP_REQUEUE { n + moved as u64 } else { n }))
        }
        FUTEX_WAKE_OP => {
            if c.uaddr2 % 4 != 0 {
                return done(Err(EINVAL));
            }
            let old = match mem.read_u32(c.uaddr2) {
                Ok(v) => v,
                Err(_) => return done(Err(EFAULT)),
            };
            let (new, hit) = match wake_op(c.val3, old) {
                Ok(v) => v,
                Err(e) => return done(Err(e)),
            };
            if let Err(e) = mem.write_u32(c.uaddr2, new) {
                return done(Err(e));
            }
            let mut w = table.wake(key, c.val, FUTEX_BITSET_MATCH_ANY);
            if hit {
                // val2 (the timeout slot) is the count for the second word.
                w.extend(table.wake(key_of(c.uaddr2, c.private), c.timeout as u32, FUTEX_BITSET_MATCH_ANY));
            }
            let n = w.len() as u64;
            woken.extend(w);
            done(Ok(n))
        }
        // Priority inheritance (LOCK_PI 6, UNLOCK_PI 7, TRYLOCK_PI 8, WAIT_REQUEUE_PI 11,
        // CMP_REQUEUE_PI 12, LOCK_PI2 13) is not offered; see the module comment.
        _ => done(Err(ENOSYS)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::HashMap;

    #[derive(Default)]
    struct Mem(HashMap<u64, u32>, HashMap<u64, u64>);

    impl Words for Mem {
        fn read_u32(&mut self, addr: u64) -> Result<u32, Errno> {
            self.0.get(&addr).copied().ok_or(EFAULT)
        }
        fn write_u32(&mut self, addr: u64, v: u32) -> Result<(), Errno> {
            if !self.0.contains_key(&addr) {
                return Err(EFAULT);
            }
            self.0.insert(addr, v);
            Ok(())
        }
        fn read_timespec(&mut self, addr: u64) -> Result<u64, Errno> {
            self.1.get(&addr).copied().ok_or(EFAULT)
        }
    }

    fn call(uaddr: u64, cmd: u32, val: u32, timeout: u64, uaddr2: u64, val3: u32) -> Call {
        Call::decode([uaddr, (cmd | FUTEX_PRIVATE_FLAG) as u64, val as u64, timeout, uaddr2, val3 as u64])
    }

    fn mem() -> Mem {
        let mut m = Mem::default();
        m.0.insert(0x1000, 5);
        m.0.insert(0x2000, 0);
        m.1.insert(0x3000, 1_000_000);
        m
    }

    /// Park `tid` as the scheduler would after `sys_futex` said Wait.
    fn park(t: &mut FutexTable, m: &mut Mem, tid: i32, c: Call) {
        match sys_futex(t, m, c, &mut Vec::new()) {
            Outcome::Wait { key, bitset, .. } => t.wait(tid, key, bitset),
            o => panic!("expected a wait, got {o:?}"),
        }
    }

    #[test]
    fn wait_compares_the_word_first() {
        let (mut t, mut m) = (FutexTable::default(), mem());
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAIT, 4, 0, 0, 0), &mut vec![]), Outcome::Done(Err(EAGAIN)));
        assert!(matches!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAIT, 5, 0, 0, 0), &mut vec![]), Outcome::Wait { timeout: None, .. }));
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1002, FUTEX_WAIT, 5, 0, 0, 0), &mut vec![]), Outcome::Done(Err(EINVAL)));
        assert_eq!(sys_futex(&mut t, &mut m, call(0x9000, FUTEX_WAIT, 5, 0, 0, 0), &mut vec![]), Outcome::Done(Err(EFAULT)));
    }

    #[test]
    fn timeouts_are_relative_for_wait_and_absolute_for_bitset() {
        let (mut t, mut m) = (FutexTable::default(), mem());
        let rel = sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAIT, 5, 0x3000, 0, 0), &mut vec![]);
        assert!(matches!(rel, Outcome::Wait { timeout: Some(Timeout::Relative(1_000_000)), .. }));
        let abs = sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAIT_BITSET, 5, 0x3000, 0, 1), &mut vec![]);
        assert!(matches!(abs, Outcome::Wait { timeout: Some(Timeout::AbsMonotonic(1_000_000)), bitset: 1, .. }));
        let c = Call { realtime: true, ..call(0x1000, FUTEX_WAIT_BITSET, 5, 0x3000, 0, u32::MAX) };
        assert!(matches!(sys_futex(&mut t, &mut m, c, &mut vec![]), Outcome::Wait { timeout: Some(Timeout::AbsRealtime(_)), .. }));
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAIT_BITSET, 5, 0, 0, 0), &mut vec![]), Outcome::Done(Err(EINVAL)));
    }

    #[test]
    fn wake_counts_and_is_fifo() {
        let (mut t, mut m) = (FutexTable::default(), mem());
        for tid in [11, 12, 13] {
            park(&mut t, &mut m, tid, call(0x1000, FUTEX_WAIT, 5, 0, 0, 0));
        }
        let mut woken = vec![];
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAKE, 2, 0, 0, 0), &mut woken), Outcome::Done(Ok(2)));
        assert_eq!(woken, vec![11, 12]);
        assert_eq!(sys_futex(&mut t, &mut m, call(0x2000, FUTEX_WAKE, 9, 0, 0, 0), &mut woken), Outcome::Done(Ok(0)));
        assert!(t.waiting(13).is_some());
        assert!(t.cancel(13));
        assert!(t.is_empty());
    }

    #[test]
    fn bitsets_select_waiters() {
        let (mut t, mut m) = (FutexTable::default(), mem());
        park(&mut t, &mut m, 1, call(0x1000, FUTEX_WAIT_BITSET, 5, 0, 0, 0b01));
        park(&mut t, &mut m, 2, call(0x1000, FUTEX_WAIT_BITSET, 5, 0, 0, 0b10));
        let mut woken = vec![];
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAKE_BITSET, 9, 0, 0, 0b10), &mut woken), Outcome::Done(Ok(1)));
        assert_eq!(woken, vec![2]);
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAKE_BITSET, 9, 0, 0, 0), &mut woken), Outcome::Done(Err(EINVAL)));
        // A plain WAKE matches every bitset.
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAKE, 9, 0, 0, 0), &mut woken), Outcome::Done(Ok(1)));
    }

    #[test]
    fn requeue_moves_the_rest_and_cmp_requeue_checks_the_word() {
        let (mut t, mut m) = (FutexTable::default(), mem());
        for tid in 1..=4 {
            park(&mut t, &mut m, tid, call(0x1000, FUTEX_WAIT, 5, 0, 0, 0));
        }
        let mut woken = vec![];
        // CMP_REQUEUE with a stale value: EAGAIN, nothing moves.
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_CMP_REQUEUE, 1, 2, 0x2000, 4), &mut woken), Outcome::Done(Err(EAGAIN)));
        // Wake 1, requeue 2: answers 3 (woken + moved).
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_CMP_REQUEUE, 1, 2, 0x2000, 5), &mut woken), Outcome::Done(Ok(3)));
        assert_eq!(woken, vec![1]);
        assert_eq!(t.waiting(2).map(|w| w.key), Some(FutexKey::Private { addr: 0x2000 }));
        assert_eq!(t.waiting(4).map(|w| w.key), Some(FutexKey::Private { addr: 0x1000 }));
        // Plain REQUEUE answers the woken count only.
        woken.clear();
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_REQUEUE, 0, 1, 0x2000, 0), &mut woken), Outcome::Done(Ok(0)));
        assert_eq!(sys_futex(&mut t, &mut m, call(0x2000, FUTEX_WAKE, 10, 0, 0, 0), &mut woken), Outcome::Done(Ok(3)));
        assert_eq!(woken, vec![2, 3, 4]);
    }

    #[test]
    fn wake_op_applies_the_operation_and_wakes_both_words() {
        let (mut t, mut m) = (FutexTable::default(), mem());
        park(&mut t, &mut m, 1, call(0x1000, FUTEX_WAIT, 5, 0, 0, 0));
        park(&mut t, &mut m, 2, call(0x2000, FUTEX_WAIT, 0, 0, 0, 0));
        // glibc's FUTEX_OP_CLEAR_WAKE_IF_GT_ONE: set 0, wake uaddr2 waiters if old > 1.
        let op = (0 << 28) | (4 << 24) | (0 << 12) | 1;
        m.0.insert(0x2000, 2);
        let mut woken = vec![];
        assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, FUTEX_WAKE_OP, 1, 1, 0x2000, op), &mut woken), Outcome::Done(Ok(2)));
        assert_eq!(m.0[&0x2000], 0);
        assert_eq!(woken, vec![1, 2]);
        // FUTEX_OP_ADD with FUTEX_OP_OPARG_SHIFT: old + (1 << 3); old (1) == cmparg (0) fails.
        assert_eq!(wake_op((1 << 28) | (8 << 28) | (3 << 12), 1), Ok((9, false)));
        assert_eq!(wake_op((7 << 28) | 0, 1), Err(ENOSYS));
        assert_eq!(wake_op((2 << 28) | (5 << 24) | (0xf0 << 12) | 1, 1), Ok((0xf1, true)));
    }

    #[test]
    fn pi_operations_are_not_offered() {
        let (mut t, mut m) = (FutexTable::default(), mem());
        for cmd in [6, 7, 8, 11, 12, 13] {
            assert_eq!(sys_futex(&mut t, &mut m, call(0x1000, cmd, 0, 0, 0, 0), &mut vec![]), Outcome::Done(Err(ENOSYS)));
        }
    }
}
