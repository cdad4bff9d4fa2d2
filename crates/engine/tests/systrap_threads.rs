//! Threads and preemption on the systrap platform, with Debian's CPython from the python
//! template's root filesystem: a guest process's threads take turns on its one stub (the KVM
//! VMM's scheduler, `vmm::threads`, over `vmm::systrap::threads`), and a guest that computes
//! without syscalls is stopped by a kick (`platform::systrap::preempt`) for its slice's end, its
//! own timer, a signal from another process, or the run's deadline.
//!
//! The tests take turns (one lock): the scheduler's tick timer and the registered stub to kick
//! belong to the test process as a whole, as they belong to a VMM process.

mod common;

use std::sync::Mutex;
use std::time::Duration;

use collimate_engine::platform::systrap::Confinement;
use collimate_engine::vmm::systrap::Process;
use collimate_engine::{RunExit, RunResult};

/// Long enough for a loaded 2-core host; a test that needs a preemption to end would reach it
/// (and fail with `Timeout`) without one.
const T: Duration = Duration::from_secs(120);

static ONE_AT_A_TIME: Mutex<()> = Mutex::new(());

fn spawn(argv: &[&str]) -> Option<Process> {
    let spec = common::python_spec(common::python_rootfs()?, argv);
    Some(Process::spawn(&spec, &Confinement::default()).expect("spawn on systrap"))
}

fn python(code: &str) -> Option<RunResult> {
    let mut p = spawn(&["/usr/bin/python3", "-c", code])?;
    Some(p.run(T).expect("run on systrap"))
}

fn exited(r: &RunResult) -> i32 {
    match r.exit {
        RunExit::Exited { code } => code,
        other => panic!("did not exit: {other:?}; stdout {:?} stderr {:?}", String::from_utf8_lossy(&r.stdout), String::from_utf8_lossy(&r.stderr)),
    }
}

fn lock() -> std::sync::MutexGuard<'static, ()> {
    ONE_AT_A_TIME.lock().unwrap_or_else(|p| p.into_inner())
}

#[test]
fn threads_start_compute_and_join() {
    let _one = lock();
    let code = r#"import threading
out = [0] * 6
def work(i):
    s = 0
    for k in range(200000 + i):
        s += k % 7
    out[i] = s
ts = [threading.Thread(target=work, args=(i,)) for i in range(6)]
for t in ts: t.start()
for t in ts: t.join()
print(threading.active_count(), out == [sum(k % 7 for k in range(200000 + i)) for i in range(6)])
"#;
    let Some(r) = python(code) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "1 True\n");
}

#[test]
fn a_condition_and_a_queue_between_producer_and_consumers() {
    let _one = lock();
    let code = r#"import threading, queue
q = queue.Queue(maxsize=3)
got = []
lock = threading.Lock()
cv = threading.Condition(lock)
done = [0]
def consume():
    while True:
        x = q.get()
        if x is None:
            break
        with cv:
            got.append(x)
            cv.notify_all()
    with cv:
        done[0] += 1
        cv.notify_all()
cs = [threading.Thread(target=consume) for _ in range(3)]
for c in cs: c.start()
for i in range(200): q.put(i)
for _ in cs: q.put(None)
with cv:
    cv.wait_for(lambda: done[0] == 3, timeout=60)
for c in cs: c.join()
print(len(got), sorted(got) == list(range(200)))
"#;
    let Some(r) = python(code) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "200 True\n");
}

#[test]
fn a_thread_pool_maps() {
    let _one = lock();
    let code = r#"from concurrent.futures import ThreadPoolExecutor
def f(x):
    return sum(range(x * 1000))
with ThreadPoolExecutor(max_workers=4) as ex:
    r = list(ex.map(f, range(40)))
print(r == [sum(range(x * 1000)) for x in range(40)])
"#;
    let Some(r) = python(code) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "True\n");
}

#[test]
fn a_thread_blocked_in_a_read_while_another_computes() {
    // The reader blocks in read(2) on an empty pipe (a blocking call retried between the other
    // thread's slices); the main thread computes without syscalls for a while (only a slice's end
    // lets the reader retry), then writes.
    let _one = lock();
    let code = r#"import os, threading
r, w = os.pipe()
got = []
t = threading.Thread(target=lambda: got.append(os.read(r, 10)))
t.start()
s = 0
for k in range(3000000):
    s += k
os.write(w, b'ping')
t.join()
print(got, s)
"#;
    let Some(r) = python(code) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), format!("[b'ping'] {}\n", (0..3_000_000u64).sum::<u64>()));
}

#[test]
fn a_deadlock_is_reported_not_hung() {
    let _one = lock();
    let code = r#"import threading
l = threading.Lock()
l.acquire()
t = threading.Thread(target=l.acquire)
t.start()
t.join()
"#;
    let Some(r) = python(code) else { return };
    assert_eq!(r.exit, RunExit::Signaled { signo: libc::SIGABRT }, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    let err = String::from_utf8_lossy(&r.stderr);
    assert!(err.contains("deadlock"), "stderr: {err}");
}

#[test]
fn a_computing_loop_is_ended_by_its_own_alarm() {
    // `while True: pass` makes no syscall: only a kick delivers SIGALRM (signal.alarm) and then
    // SIGVTALRM's... the setitimer one (ITIMER_REAL) to the handler, which ends the loop.
    let _one = lock();
    let code = r#"import signal, sys
def h(*a):
    raise KeyboardInterrupt
signal.signal(signal.SIGALRM, h)
signal.alarm(1)
try:
    while True:
        pass
except KeyboardInterrupt:
    print('alarm')
signal.setitimer(signal.ITIMER_REAL, 0.2)
n = 0
try:
    while True:
        n += 1
except KeyboardInterrupt:
    print('itimer', n > 0)
"#;
    let Some(r) = python(code) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "alarm\nitimer True\n");
}

#[test]
fn a_computing_child_is_ended_by_its_parents_sigterm() {
    let _one = lock();
    let code = r#"import os, signal, time
pid = os.fork()
if pid == 0:
    while True:
        pass
time.sleep(0.3)
os.kill(pid, signal.SIGTERM)
_, st = os.waitpid(pid, 0)
print(os.WIFSIGNALED(st), os.WTERMSIG(st))
"#;
    let Some(r) = python(code) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "True 15\n");
}

#[test]
fn a_fork_from_a_threaded_process_has_one_thread() {
    // The parent has a second thread parked on an Event; the child of its fork runs only the
    // forking thread (the other one is the parent's): it computes, exits, and the parent's
    // thread still finishes.
    let _one = lock();
    let code = r#"import os, threading
ev = threading.Event()
res = []
t = threading.Thread(target=lambda: (ev.wait(), res.append('thread')))
t.start()
pid = os.fork()
if pid == 0:
    print('child', len(os.listdir('/proc/self/task')), flush=True)
    os._exit(7)
_, st = os.waitpid(pid, 0)
ev.set()
t.join()
print('parent', os.WEXITSTATUS(st), res, len(os.listdir('/proc/self/task')))
"#;
    let Some(r) = python(code) else { return };
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    assert_eq!(String::from_utf8_lossy(&r.stdout), "child 1\nparent 7 ['thread'] 1\n");
}

#[test]
fn a_run_of_computing_code_times_out_resumably() {
    // The run's deadline stops a guest that never traps; the process lives on and later runs
    // resume it (before, a run only returned at the guest's next trap).
    let _one = lock();
    let Some(mut p) = spawn(&["/usr/bin/python3", "-c", "while True: pass"]) else { return };
    for _ in 0..2 {
        let r = p.run(Duration::from_millis(1500)).expect("run on systrap");
        assert_eq!(r.exit, RunExit::Timeout, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    }
}

#[test]
fn an_event_ping_pong_reads_the_clocks_without_trapping() {
    // Two threads hand a turn back and forth through two Events: per round trip 4 futex calls and
    // two thread switches, and about 19 clock reads (CPython's GIL waits are timed). In replay
    // mode the vDSO answers those reads inside the guest, as on kvm (`guestos::vdso`); before the
    // vDSO was mapped on systrap each was a trapped syscall (24 traps per round trip, 778 us
    // against kvm's 256). Counted, not timed: the traps a round trip adds.
    let _one = lock();
    let code = |n: u32| {
        format!(
            "import threading, time\nN = {n}\na, b = threading.Event(), threading.Event()\n\
def other():\n    for _ in range(N):\n        a.wait(); a.clear(); b.set()\n\
t = threading.Thread(target=other); t.start()\n\
for _ in range(N):\n    a.set(); b.wait(); b.clear()\nt.join()\nprint(time.monotonic() > 0)\n"
        )
    };
    let traps = |n: u32| {
        let mut p = spawn(&["/usr/bin/python3", "-c", &code(n)])?;
        p.reseed([7; 32], true);
        let r = p.run(T).expect("run on systrap");
        assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
        assert_eq!(String::from_utf8_lossy(&r.stdout), "True\n");
        Some(p.traps())
    };
    let Some(none) = traps(0) else { return };
    let Some(some) = traps(300) else { return };
    let per = (some.syscalls - none.syscalls) as f64 / 300.0;
    let kicks = (some.interrupts - none.interrupts) as f64 / 300.0;
    eprintln!("per round trip: {per:.2} trapped syscalls, {kicks:.3} kicks ({none:?} without round trips, {some:?} with 300)");
    assert!(per <= 8.0, "{per:.2} trapped syscalls per round trip ({none:?} without round trips, {some:?} with 300)");
}

#[test]
fn a_sleep_loop_waits_for_a_thread_timed_wait() {
    // CPython's lock tests wait for a worker thread with `while not done: time.sleep(0.01)`.
    // In replay mode with threads taking turns, a sleep's virtual deadline is kept across its
    // restarts by the call it belongs to (`guestos::sched::deadline`); systrap's loop never said
    // which call that was, so the first sleep's deadline stayed and every later sleep returned at
    // once: this loop went round 490,048 times (1 us of virtual time each) instead of about 50,
    // and test_thread's LockTests.test_timeout took 45 s.
    let _one = lock();
    let code = r#"import threading, time
lock = threading.Lock(); lock.acquire()
res = []
t = threading.Thread(target=lambda: res.append(lock.acquire(timeout=0.5))); t.start()
n = 0
while not res:
    time.sleep(0.01); n += 1
t.join()
print(res, n)
"#;
    let Some(mut p) = spawn(&["/usr/bin/python3", "-c", code]) else { return };
    p.reseed([9; 32], true);
    let r = p.run(T).expect("run on systrap");
    assert_eq!(exited(&r), 0, "stderr: {}", String::from_utf8_lossy(&r.stderr));
    let out = String::from_utf8_lossy(&r.stdout);
    let n: u32 = out.trim().strip_prefix("[False] ").and_then(|n| n.parse().ok()).unwrap_or_else(|| panic!("stdout: {out}"));
    assert!((45..=55).contains(&n), "{n} sleeps of 10 ms for a 0.5 s timed wait (stdout {out})");
}
