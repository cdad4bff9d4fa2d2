//! The threads of a guest process, as host-side state.
//!
//! # Shape: M:1
//! A guest process keeps its one vCPU, and all its threads take turns on it: the VMM's thread
//! scheduler (`vmm::threads`) swaps a thread's registers, XSAVE area and FS/GS base into the vCPU
//! before the next KVM_RUN. Guest memory, page tables and TLB never change on a switch, so a
//! switch costs a few ioctls, and snapshots, forks and resets copy a [`Threads`] table like any
//! other state. What this gives up is parallel speed inside one sandbox (RL fleets get theirs from
//! many sandboxes); what it gains is that the host stays single-threaded per guest process (forks
//! stay host forks) and that the schedule can be a function of the program (replay mode).
//!
//! A [`Thread`] holds everything that is per thread: registers, XSAVE, FS/GS base, the signal mask
//! and alternate stack, thread-directed pending signals, clear_child_tid, the robust list, the
//! name, a sliced sleep's deadline, and a [`RunState`]. It is kept apart from the vCPU so that a
//! vCPU per thread stays possible later.
//!
//! The thread whose state is in the vCPU is *loaded*; its per-thread values then live where the
//! single-threaded runtime always kept them (the vCPU, and `Proc::sigmask`, `altstack`,
//! `clear_child_tid`, `robust_list`, `comm`, `sleep`, `SigState::saved_mask`), so every syscall
//! handler works on the calling thread unchanged; its record here is stale until it is parked.
//! A process with one thread never parks it: nothing of this costs it anything.
//!
//! # Ids and the cap
//! Thread ids come from the sandbox's pid counter (as on Linux, tids and pids share one space);
//! the first thread's tid is the process id (stored as 0: "the pid", which survives a fork).
//! Every thread counts as a task against the sandbox's process limit (`vmm::process::MAX_PROCESSES`
//! and RLIMIT_NPROC, which Linux also counts in threads): clone answers EAGAIN beyond it, which
//! pthread_create reports and Python turns into "can't start new thread".

use serde::{Deserialize, Serialize};

use super::futex::{FutexKey, FutexTable};
use super::clock::PendingSleep;
use super::signal_state::AltStack;
use super::{Ctx, Errno, GuestOs, SysResult, EINVAL};

const ETIMEDOUT: Errno = Errno(110);

/// What a thread is doing.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RunState {
    /// Runnable (or running, when loaded).
    Runnable,
    /// Waiting on a futex until woken, or until `deadline` (the scheduler's clock, see
    /// [`Threads::now`]).
    Futex { key: FutexKey, bitset: u32, deadline: Option<u64> },
    /// In a blocking syscall that is re-executed when the thread runs again (a read of an empty
    /// pipe, a wait for a child, a sleep, a poll): ready again at `deadline`, or on every round.
    Retry { deadline: Option<u64> },
    /// In a sleep (nanosleep, clock_nanosleep) that is re-executed once `deadline` has come (or a
    /// signal is there): never retried before.
    Sleep { deadline: u64 },
}

/// One thread's own state (see the module comment for when it is current).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Thread {
    /// 0 for the process's first thread (its tid is the pid).
    pub tid: i32,
    pub state: RunState,
    pub regs: kvm_bindings::kvm_regs,
    pub fs_base: u64,
    pub gs_base: u64,
    /// The XSAVE area (KVM's 4 KiB region); empty until the thread is first parked.
    pub xsave: Vec<u32>,
    pub sigmask: u64,
    pub altstack: AltStack,
    /// Signals sent to this thread (tgkill), not yet taken in.
    pub pending: u64,
    pub clear_child_tid: u64,
    pub robust_list: (u64, u64),
    pub comm: [u8; 16],
    pub sleep: Option<PendingSleep>,
    pub saved_mask: Option<u64>,
    /// Scheduler bookkeeping of the blocking call it is in (`guestos::sched`); not kept in
    /// snapshots (a restored thread restarts its call afresh).
    #[serde(skip)]
    pub carry: super::sched::ThreadCarry,
    /// The round in which it last retried its blocking call (see `vmm::threads`).
    #[serde(skip)]
    pub retried_in: u64,
    /// Its blocking call waits (also) on a network socket, whose peer is outside the sandbox:
    /// while every thread waits, time then passes as on the host instead of jumping to the
    /// earliest deadline (`vmm::threads`, `guestos::sched::yield_blocked_on`).
    #[serde(skip)]
    pub network: bool,
}

impl Thread {
    pub fn new(tid: i32) -> Thread {
        Thread {
            tid,
            state: RunState::Runnable,
            regs: Default::default(),
            fs_base: 0,
            gs_base: 0,
            xsave: Vec::new(),
            sigmask: 0,
            altstack: AltStack { sp: 0, flags: 2, size: 0 },
            pending: 0,
            clear_child_tid: 0,
            robust_list: (0, 0),
            comm: [0; 16],
            sleep: None,
            saved_mask: None,
            carry: Default::default(),
            retried_in: 0,
            network: false,
        }
    }

    /// Its tid, given its process's pid.
    pub fn tid_in(&self, pid: i32) -> i32 {
        if self.tid == 0 {
            pid
        } else {
            self.tid
        }
    }

    pub fn name(&self) -> String {
        let end = self.comm.iter().position(|&b| b == 0).unwrap_or(16);
        String::from_utf8_lossy(&self.comm[..end]).into_owned()
    }
}

// Registers are plain integers: equality is total.
impl Eq for Thread {}

/// Why the loaded thread stops being the one that runs, as a syscall handler asks for it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Switch {
    /// Park it on a futex (its return value comes with the wake).
    Futex { key: FutexKey, bitset: u32, deadline: Option<u64> },
    /// sched_yield: the others first, then it again.
    Yield,
    /// It exited (exit(2) with other threads alive).
    Exit,
}

/// Every thread of the process.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
pub struct Threads {
    /// The threads, the first thread first (while it lives), then in creation order.
    pub list: Vec<Thread>,
    /// Index of the loaded thread (valid while `loaded`).
    pub cur: usize,
    /// Whether the vCPU holds `list[cur]`'s state. False only while every thread waits.
    pub loaded: bool,
    pub futex: FutexTable,
    /// What the loaded thread's syscall asked for (taken by the scheduler after the syscall).
    #[serde(skip)]
    pub switch: Option<Switch>,
    /// Threads woken by the current syscall (a futex wake, a thread's exit): their waits return 0.
    #[serde(skip)]
    pub woken: Vec<i32>,
}

impl Eq for Threads {}

impl Default for Threads {
    fn default() -> Self {
        Threads { list: vec![Thread::new(0)], cur: 0, loaded: true, futex: Default::default(), switch: None, woken: Vec::new() }
    }
}

impl Threads {
    /// More than one thread (the scheduler has work to do).
    pub fn multi(&self) -> bool {
        self.list.len() > 1
    }

    /// The loaded thread's tid.
    pub fn current_tid(&self, pid: i32) -> i32 {
        self.list.get(self.cur).map_or(pid, |t| t.tid_in(pid))
    }

    pub fn index_of(&self, tid: i32, pid: i32) -> Option<usize> {
        self.list.iter().position(|t| t.tid_in(pid) == tid)
    }

    /// Make the woken threads runnable (their futex waits return 0).
    pub fn apply_wakes(&mut self) {
        for tid in std::mem::take(&mut self.woken) {
            if let Some(t) = self.list.iter_mut().find(|t| t.tid == tid || (t.tid == 0 && tid == 0)) {
                if matches!(t.state, RunState::Futex { .. }) {
                    t.state = RunState::Runnable;
                    t.regs.rax = 0;
                }
            }
        }
    }

    /// Only the loaded thread remains, and it becomes the first thread (tid = pid): a fork's child
    /// (Linux copies the calling thread alone) and execve (the other threads end). Returns how many
    /// threads went (the caller gives their tasks back to the process count).
    pub fn only_current(&mut self) -> usize {
        let gone = self.list.len().saturating_sub(1);
        let keep = self.list.get(self.cur).map_or(0, |t| t.tid);
        self.futex.retain_thread(keep);
        self.futex.cancel(keep);
        if self.list.len() > 1 {
            let mut t = self.list.swap_remove(self.cur.min(self.list.len() - 1));
            t.tid = 0;
            t.state = RunState::Runnable;
            self.list = vec![t];
        } else if let Some(t) = self.list.first_mut() {
            t.tid = 0;
            t.state = RunState::Runnable;
        }
        self.cur = 0;
        self.loaded = true;
        self.switch = None;
        self.woken.clear();
        gone
    }

    /// The earliest deadline of a waiting thread.
    pub fn earliest_deadline(&self) -> Option<u64> {
        self.list
            .iter()
            .filter_map(|t| match t.state {
                RunState::Futex { deadline, .. } | RunState::Retry { deadline } => deadline,
                RunState::Sleep { deadline } => Some(deadline),
                RunState::Runnable => None,
            })
            .min()
    }

    /// A line per thread for a deadlock report: tid, name, what it waits for.
    pub fn describe(&self, pid: i32) -> String {
        let mut s = String::new();
        for t in &self.list {
            let what = match t.state {
                RunState::Runnable => "runnable".to_string(),
                RunState::Futex { key, deadline, .. } => {
                    let at = match key {
                        FutexKey::Private { addr } => format!("{addr:#x}"),
                        FutexKey::Shared { object, offset } => format!("shared object {object} + {offset:#x}"),
                    };
                    match deadline {
                        Some(_) => format!("futex wait on {at} with a timeout"),
                        None => format!("futex wait on {at}, no timeout (a lock, a condition, a join)"),
                    }
                }
                RunState::Retry { deadline } => {
                    let call = super::sched::carried_call(&t.carry).map_or("a system call".to_string(), |(nr, a)| super::nr::describe_call(nr, a));
                    format!("blocked in {call}{}", if deadline.is_some() { " with a timeout" } else { "" })
                }
                RunState::Sleep { .. } => "sleeping".to_string(),
            };
            s.push_str(&format!("  thread {} ({}): {} at rip {:#x}\n", t.tid_in(pid), t.name(), what, t.regs.rip));
        }
        s
    }
}

/// The clock thread deadlines are on: virtual CLOCK_MONOTONIC in replay mode, the host's otherwise.
pub fn now(clocks: &super::clock::Clocks) -> u64 {
    if clocks.replay {
        clocks.mono_now()
    } else {
        super::clock::monotonic_ns()
    }
}

/// The robust-list walk at a thread's exit (Linux's exit_robust_list): every robust mutex the
/// thread still holds gets FUTEX_OWNER_DIED, and one waiter is woken. `head` is the thread's
/// `struct robust_list_head` (list, futex_offset, list_op_pending). Bounded, as Linux's.
pub fn walk_robust_list(
    words: &mut dyn super::futex::Words,
    read_u64: &mut dyn FnMut(u64) -> Result<u64, super::Errno>,
    futex: &mut FutexTable,
    head: u64,
    tid: i32,
    woken: &mut Vec<i32>,
) {
    const ROBUST_LIST_LIMIT: usize = 2048;
    let Ok(first) = read_u64(head) else { return };
    let Ok(offset) = read_u64(head + 8) else { return };
    let pending = read_u64(head + 16).unwrap_or(0);
    let mut handle = |entry: u64, words: &mut dyn super::futex::Words, woken: &mut Vec<i32>| {
        // The low bit of an entry marks a PI futex, which is not offered here.
        let addr = (entry & !1).wrapping_add(offset);
        if addr % 4 != 0 {
            return;
        }
        let Ok(v) = words.read_u32(addr) else { return };
        if v & super::futex::FUTEX_TID_MASK != tid as u32 {
            return;
        }
        let new = (v & super::futex::FUTEX_WAITERS) | super::futex::FUTEX_OWNER_DIED;
        if words.write_u32(addr, new).is_ok() && v & super::futex::FUTEX_WAITERS != 0 {
            woken.extend(futex.wake(super::futex::key_of(addr, true), 1, super::futex::FUTEX_BITSET_MATCH_ANY));
        }
    };
    let mut entry = first;
    let mut n = 0;
    while entry != head && entry != 0 && n < ROBUST_LIST_LIMIT {
        let next = read_u64(entry & !1).unwrap_or(0);
        if entry != pending {
            handle(entry, words, woken);
        }
        entry = next;
        n += 1;
    }
    if pending != 0 {
        handle(pending, words, woken);
    }
}

// --- the thread syscalls -----------------------------------------------------------------------

const SYS_SCHED_YIELD: u64 = 24;
const SYS_GETTID: u64 = 186;
const SYS_TKILL: u64 = 200;
const SYS_FUTEX: u64 = 202;
const SYS_SET_TID_ADDRESS: u64 = 218;
const SYS_TGKILL: u64 = 234;

/// Guest memory through a syscall's [`Ctx`], as futex calls read it.
struct CtxWords<'a, 'b>(&'a mut Ctx<'b>);

impl super::futex::Words for CtxWords<'_, '_> {
    fn read_u32(&mut self, addr: u64) -> Result<u32, Errno> {
        let mut b = [0u8; 4];
        self.0.read(addr, &mut b)?;
        Ok(u32::from_le_bytes(b))
    }
    fn write_u32(&mut self, addr: u64, v: u32) -> Result<(), Errno> {
        self.0.write(addr, &v.to_le_bytes())
    }
    fn read_timespec(&mut self, addr: u64) -> Result<u64, Errno> {
        super::clock::read_timespec(self.0, addr)
    }
}

/// The calls that depend on which thread makes them; `None` for every other call.
pub fn dispatch(os: &mut GuestOs, ctx: &mut Ctx, nr: u64, a: [u64; 6]) -> Option<SysResult> {
    let pid = os.proc.pid;
    let r = match nr {
        SYS_GETTID => Ok(os.threads.current_tid(pid) as u64),
        SYS_SET_TID_ADDRESS => {
            os.proc.clear_child_tid = a[0];
            Ok(os.threads.current_tid(pid) as u64)
        }
        SYS_SCHED_YIELD => {
            if os.threads.multi() {
                os.threads.switch = Some(Switch::Yield);
            }
            Ok(0)
        }
        SYS_FUTEX => futex(os, ctx, a),
        // Signals to one of this process's other threads; everything else is `signal`'s.
        SYS_TKILL | SYS_TGKILL if os.threads.multi() => {
            let (tgid, tid, sig) = if nr == SYS_TGKILL { (Some(a[0] as i32), a[1] as i32, a[2]) } else { (None, a[0] as i32, a[1]) };
            let me = os.threads.current_tid(pid);
            let idx = os.threads.index_of(tid, pid);
            match idx {
                // To itself (pthread_kill of the calling thread): pending for it at once.
                Some(_) if tid == me && tgid.is_none_or(|g| g == pid) && tid != pid => {
                    if sig > super::signal_state::NSIG as u64 {
                        Err(EINVAL)
                    } else {
                        if sig != 0 {
                            super::signal::raise(os, super::signal::SigInfo::sent(sig as i32, super::signal::SI_TKILL, pid));
                        }
                        Ok(0)
                    }
                }
                Some(i) if tid != me && tgid.is_none_or(|g| g == pid) && tid > 0 => {
                    if sig > super::signal_state::NSIG as u64 {
                        Err(EINVAL)
                    } else {
                        if sig != 0 {
                            let s = sig as i32;
                            if os.sig.pending & (1 << (s - 1)) == 0 && os.threads.list[i].pending & (1 << (s - 1)) == 0 {
                                os.sig.info[(s - 1) as usize] = super::signal::SigInfo::sent(s, super::signal::SI_TKILL, pid);
                            }
                            os.threads.list[i].pending |= 1 << (s - 1);
                        }
                        Ok(0)
                    }
                }
                _ => return None,
            }
        }
        _ => return None,
    };
    Some(r)
}

fn futex(os: &mut GuestOs, ctx: &mut Ctx, a: [u64; 6]) -> SysResult {
    if a[0] % 4 != 0 {
        return Err(EINVAL);
    }
    // A word in a shared mapping may be waited on and woken by other processes: served there
    // (`futex_shared`, which answers only for those).
    let (op, timeout) = (a[1], a[3]);
    if let Some(r) = super::futex_shared::futex(&mut os.proc, ctx, a, &|p, ctx| super::clock::futex_timeout(p, ctx, op, timeout)) {
        return r;
    }
    let call = super::futex::Call::decode(a);
    let mut woken = Vec::new();
    let outcome = super::futex::sys_futex(&mut os.threads.futex, &mut CtxWords(ctx), call, &mut woken);
    os.threads.woken.extend(woken);
    match outcome {
        super::futex::Outcome::Done(r) => r,
        super::futex::Outcome::Wait { key, bitset, timeout } => {
            let now = now(&os.proc.clocks);
            let deadline = match timeout {
                None => None,
                Some(super::futex::Timeout::Relative(ns)) => Some(now.saturating_add(ns)),
                // Guest CLOCK_MONOTONIC is the scheduler's clock (virtual in replay mode).
                Some(super::futex::Timeout::AbsMonotonic(t)) => Some(t),
                Some(super::futex::Timeout::AbsRealtime(t)) => {
                    let real = super::clock::clock_now_ns(&mut os.proc, libc::CLOCK_REALTIME)?;
                    Some(now.saturating_add(t.saturating_sub(real)))
                }
            };
            if deadline.is_some_and(|d| d <= now) {
                return Err(ETIMEDOUT);
            }
            // A signal that is already there interrupts the wait before it starts.
            super::signal::gather(os);
            if super::signal::has_ready(os) {
                return Err(super::EINTR);
            }
            let tid = os.threads.list.get(os.threads.cur).map_or(0, |t| t.tid);
            os.threads.futex.wait(tid, key, bitset);
            os.threads.switch = Some(Switch::Futex { key, bitset, deadline });
            // The value the wait returns is set when it ends (see `vmm::threads`).
            Ok(0)
        }
    }
}

/// exit(2) of the loaded thread while others live: clear and wake its clear_child_tid (what
/// pthread_join waits on), give its robust mutexes up, and leave. The scheduler removes it.
pub fn exit_current(os: &mut GuestOs, ctx: &mut Ctx) {
    let tid = os.threads.current_tid(os.proc.pid);
    let mut woken = Vec::new();
    let head = os.proc.robust_list.0;
    if head != 0 {
        walk_robust_list_ctx(&mut CtxWords(ctx), &mut os.threads.futex, head, tid, &mut woken);
    }
    let ctid = os.proc.clear_child_tid;
    if ctid != 0 && ctid % 4 == 0 && ctx.write(ctid, &0u32.to_le_bytes()).is_ok() {
        woken.extend(os.threads.futex.wake(super::futex::key_of(ctid, false), 1, super::futex::FUTEX_BITSET_MATCH_ANY));
    }
    os.threads.woken.extend(woken);
    os.threads.switch = Some(Switch::Exit);
}

fn walk_robust_list_ctx(words: &mut CtxWords, futex: &mut FutexTable, head: u64, tid: i32, woken: &mut Vec<i32>) {
    // The list's pointers and the futex words are read through one context: collect the
    // pointers first (a bounded walk), then act on the words.
    struct Both<'x, 'a, 'b>(&'x mut CtxWords<'a, 'b>);
    impl super::futex::Words for Both<'_, '_, '_> {
        fn read_u32(&mut self, addr: u64) -> Result<u32, Errno> {
            self.0.read_u32(addr)
        }
        fn write_u32(&mut self, addr: u64, v: u32) -> Result<(), Errno> {
            self.0.write_u32(addr, v)
        }
        fn read_timespec(&mut self, addr: u64) -> Result<u64, Errno> {
            self.0.read_timespec(addr)
        }
    }
    let mut ptrs = std::collections::HashMap::new();
    let mut at = head;
    for _ in 0..2050 {
        let Ok(v) = words.0.read_u64(at & !1) else { break };
        ptrs.insert(at & !1, v);
        if at == head {
            for off in [8u64, 16] {
                if let Ok(x) = words.0.read_u64(head + off) {
                    ptrs.insert(head + off, x);
                }
            }
        }
        if v == head || v == 0 {
            break;
        }
        at = v;
    }
    if let Some(&p) = ptrs.get(&(head + 16)) {
        if p != 0 {
            if let Ok(x) = words.0.read_u64(p & !1) {
                ptrs.insert(p & !1, x);
            }
        }
    }
    walk_robust_list(&mut Both(words), &mut |a| ptrs.get(&a).copied().ok_or(super::EFAULT), futex, head, tid, woken);
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_current_keeps_the_calling_thread_as_the_first() {
        let mut t = Threads::default();
        t.list.push(Thread::new(7));
        t.list.push(Thread::new(8));
        t.cur = 2;
        t.futex.wait(7, FutexKey::Private { addr: 0x10 }, !0);
        assert_eq!(t.only_current(), 2);
        assert_eq!(t.list.len(), 1);
        assert_eq!(t.list[0].tid, 0);
        assert!(t.futex.is_empty());
        assert_eq!(t.current_tid(42), 42);
    }

    #[test]
    fn wakes_make_futex_waiters_runnable_with_zero() {
        let mut t = Threads::default();
        let mut th = Thread::new(5);
        th.state = RunState::Futex { key: FutexKey::Private { addr: 0x10 }, bitset: !0, deadline: None };
        th.regs.rax = 99;
        t.list.push(th);
        t.woken.push(5);
        t.apply_wakes();
        assert_eq!(t.list[1].state, RunState::Runnable);
        assert_eq!(t.list[1].regs.rax, 0);
    }

    #[test]
    fn the_robust_list_walk_marks_held_mutexes_and_wakes_one_waiter() {
        use std::collections::HashMap;
        struct M(HashMap<u64, u32>);
        impl super::super::futex::Words for M {
            fn read_u32(&mut self, a: u64) -> Result<u32, super::super::Errno> {
                self.0.get(&a).copied().ok_or(super::super::EFAULT)
            }
            fn write_u32(&mut self, a: u64, v: u32) -> Result<(), super::super::Errno> {
                self.0.insert(a, v);
                Ok(())
            }
            fn read_timespec(&mut self, _: u64) -> Result<u64, super::super::Errno> {
                Err(super::super::EFAULT)
            }
        }
        // head at 0x100 -> entry 0x200 -> head; futex word at entry + 0x20.
        let mut q: HashMap<u64, u64> = HashMap::new();
        q.insert(0x100, 0x200);
        q.insert(0x108, 0x20);
        q.insert(0x110, 0);
        q.insert(0x200, 0x100);
        let mut words = M(HashMap::from([(0x220, 77 | super::super::futex::FUTEX_WAITERS)]));
        let mut table = FutexTable::default();
        table.wait(3, FutexKey::Private { addr: 0x220 }, !0);
        let mut woken = vec![];
        walk_robust_list(&mut words, &mut |a| q.get(&a).copied().ok_or(super::super::EFAULT), &mut table, 0x100, 77, &mut woken);
        assert_eq!(words.0[&0x220], super::super::futex::FUTEX_OWNER_DIED | super::super::futex::FUTEX_WAITERS);
        assert_eq!(woken, vec![3]);
    }
}
