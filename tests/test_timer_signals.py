"""Issue 31's timer leftovers: where a timer's signal goes, and what it interrupts.

- A blocking read of a pipe that a signal interrupts returns EINTR, so that Python runs its
  handler there: `signal.alarm(1); os.read(r, 1)` raises the handler's exception (or
  KeyboardInterrupt) out of the read, and a handler that returns lets the read go on (PEP 475).
  In the sandbox's own interpreter (`exec(code=...)`), a process alone in its sandbox, the read
  used to wait on forever: the alarm came, its C-level handler ran, and the read was restarted
  without ever returning to Python.
- The same for the SIGINT an exec's timeout sends to the interpreter: KeyboardInterrupt comes
  out of the read, and the interpreter (with its state) is kept instead of replaced.
- A POSIX timer made with SIGEV_THREAD_ID signals that thread, not the process: a thread that
  waits for the signal in sigtimedwait gets it (si_code SI_TIMER), and the main thread's handler
  does not run, though the main thread makes system calls meanwhile. It used to go to the
  process, where the main thread took it.

Each program runs in a sandbox and under the host's /usr/bin/python3 in the same test; the outputs
must be the same, and the expected one.
"""

from __future__ import annotations

import os
import subprocess

import pytest

from collimate_core import Sandbox

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

NATIVE = "/usr/bin/python3"

PIPE_READ = r"""
import os, signal

class Alarm(Exception):
    pass

def raise_alarm(signo, frame):
    raise Alarm()

r, w = os.pipe()
signal.signal(signal.SIGALRM, raise_alarm)
signal.alarm(1)
try:
    os.read(r, 1)
    print("read returned")
except Alarm:
    print("the handler's exception came out of the read")

# A handler that returns: the read goes on (PEP 475) and gets the byte the handler wrote.
signal.signal(signal.SIGALRM, lambda signo, frame: os.write(w, b"x"))
signal.setitimer(signal.ITIMER_REAL, 0.25)
print("then read", os.read(r, 1))

# SIGINT's default Python handler: KeyboardInterrupt out of the read. Installed explicitly: a
# Python started with SIGINT ignored (a background job of a shell, as CI may run it) has none.
signal.signal(signal.SIGINT, signal.default_int_handler)
signal.signal(signal.SIGALRM, lambda signo, frame: os.kill(os.getpid(), signal.SIGINT))
signal.alarm(1)
try:
    os.read(r, 1)
    print("read returned")
except KeyboardInterrupt:
    print("KeyboardInterrupt")
signal.signal(signal.SIGALRM, signal.SIG_DFL)
os.close(r)
os.close(w)
"""
PIPE_READ_OUT = "the handler's exception came out of the read\nthen read b'x'\nKeyboardInterrupt\n"

THREAD_TIMER = r"""
import ctypes, signal, threading, time

libc = ctypes.CDLL(None, use_errno=True)

class SigEvent(ctypes.Structure):  # struct sigevent (x86-64): value, signo, notify, tid, padding
    _fields_ = [("value", ctypes.c_uint64), ("signo", ctypes.c_int), ("notify", ctypes.c_int),
                ("tid", ctypes.c_int), ("pad", ctypes.c_int * 11)]

class ITimerSpec(ctypes.Structure):
    _fields_ = [("interval", ctypes.c_long * 2), ("value", ctypes.c_long * 2)]

SIGEV_THREAD_ID, CLOCK_MONOTONIC = 4, 1
libc.timer_create.argtypes = [ctypes.c_int, ctypes.POINTER(SigEvent), ctypes.POINTER(ctypes.c_void_p)]
libc.timer_settime.argtypes = [ctypes.c_void_p, ctypes.c_int, ctypes.POINTER(ITimerSpec), ctypes.c_void_p]
libc.timer_delete.argtypes = [ctypes.c_void_p]

in_main = []
signal.signal(signal.SIGUSR1, lambda signo, frame: in_main.append(signo))
got = {}
ready = threading.Event()

def waiter():
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGUSR1})
    got["tid"] = threading.get_native_id()
    ready.set()
    info = signal.sigtimedwait({signal.SIGUSR1}, 5)
    got["info"] = None if info is None else (info.si_signo, info.si_code)

t = threading.Thread(target=waiter)
t.start()
ready.wait()
ev = SigEvent(value=7, signo=signal.SIGUSR1, notify=SIGEV_THREAD_ID, tid=got["tid"])
timer = ctypes.c_void_p()
assert libc.timer_create(CLOCK_MONOTONIC, ctypes.byref(ev), ctypes.byref(timer)) == 0, ctypes.get_errno()
spec = ITimerSpec()
spec.value[1] = 200_000_000
assert libc.timer_settime(timer, 0, ctypes.byref(spec), None) == 0, ctypes.get_errno()
# The main thread goes on making system calls (where a process-directed signal would be taken,
# as the main thread does not block it) while the waiting thread waits.
end = time.monotonic() + 3
while t.is_alive() and time.monotonic() < end:
    time.sleep(0.01)
t.join()
libc.timer_delete(timer)
signal.signal(signal.SIGUSR1, signal.SIG_DFL)
print("waiting thread got", got["info"], "main thread's handler ran", len(in_main), "times")
"""
# si_code SI_TIMER is -2.
THREAD_TIMER_OUT = "waiting thread got (10, -2) main thread's handler ran 0 times\n"


def native(code: str) -> str:
    r = subprocess.run([NATIVE, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    return r.stdout


@pytest.fixture(scope="module")
def sandbox():
    with Sandbox("python") as sb:
        yield sb


@pytest.mark.parametrize("code, expected", [(PIPE_READ, PIPE_READ_OUT), (THREAD_TIMER, THREAD_TIMER_OUT)],
                         ids=["eintr-pipe-read", "sigev-thread-id"])
def test_in_the_sandboxs_interpreter_as_natively(sandbox, code, expected):
    """exec(code=...): the sandbox's own interpreter, alone in its sandbox. On main the pipe read
    never returned (the exec timed out) and the thread timer's signal ran the main thread's
    handler."""
    assert native(code) == expected
    r = sandbox.exec(code=code, timeout_seconds=30)
    assert not r.timed_out, ("the exec timed out", r.stdout, r.stderr[-2000:])
    assert (r.exit_code, r.stdout) == (0, expected), r.stderr[-2000:]
    # The interpreter is still the same one (no restart), and goes on.
    again = sandbox.exec(code="print('still here')")
    assert again.stdout == "still here\n" and not again.interpreter_restarted, again


@pytest.mark.parametrize("code, expected", [(PIPE_READ, PIPE_READ_OUT), (THREAD_TIMER, THREAD_TIMER_OUT)],
                         ids=["eintr-pipe-read", "sigev-thread-id"])
def test_in_a_command_as_natively(sandbox, code, expected):
    """The same programs as a shell command's python3 (not alone: the shell and the agent wait)."""
    sandbox.upload_bytes("/tmp/prog.py", code.encode())
    r = sandbox.exec(command="python3 /tmp/prog.py", timeout_seconds=30)
    assert not r.timed_out, ("the exec timed out", r.stdout, r.stderr[-2000:])
    assert (r.exit_code, r.stdout) == (0, expected), r.stderr[-2000:]


def test_an_exec_timeout_interrupts_a_pipe_read_with_keyboardinterrupt(sandbox):
    """An exec that times out while its code blocks reading a pipe: the SIGINT the engine sends
    (docs/sessions.md) ends the read with EINTR, Python raises KeyboardInterrupt, and the
    interpreter lives on with its state. On main the read was restarted under the handler, the
    interpreter never stopped and was replaced (interpreter_restarted, the state gone)."""
    sandbox.exec(code="kept = 'state'")
    r = sandbox.exec(code="import os\nr, w = os.pipe()\nos.read(r, 1)", timeout_seconds=3)
    assert r.timed_out and "KeyboardInterrupt" in r.stderr, (r.note, r.stderr[-2000:])
    after = sandbox.exec(code="print(kept)")
    assert after.stdout == "state\n" and not after.interpreter_restarted, (after, after.note)
