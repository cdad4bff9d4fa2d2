"""Signals to the whole sandbox, and the death of its interpreter (issue 14).

`os.kill(-1, 9)` follows Linux (kill(2)): every process of the sandbox except guest pid 1 (the
in-guest agent, the sandbox's interpreter) and the caller. Before, it killed the agent itself when
the agent sent it, and the next exec ran in a fresh interpreter without saying so. When the agent
does die (os._exit, a fatal signal, a crash), the dying exec's result and the next exec's result
both say so (`interpreter_died`, `interpreter_restarted`, `note`), and files in /tmp and /work are
not kept: the sandbox is restored from its template. An exec that times out is not a death: what
it started is killed and the sandbox is kept (tests/test_exec_timeout.py).
"""

from __future__ import annotations

import os

import pytest
from collimate_core import EmbeddedClient, Sandbox, UnitTestReward, grade

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    c = EmbeddedClient()
    yield c
    c.close()


@pytest.fixture
def sb(client):
    with Sandbox("python", client=client) as s:
        yield s


def run(sb, code: str, **kw):
    r = sb.exec(code=code, timeout_seconds=kw.pop("timeout_seconds", 60), **kw)
    assert not r.interpreter_died and not r.interpreter_restarted and r.note == "", r
    return r


# Processes that sleep until killed, each holding the write end of a "life" pipe whose read end
# the agent keeps: the pipe reads EOF once every one of them has died, which is how the agent
# knows that processes it cannot wait for (grandchildren) are gone. A process that must survive
# closes its copy.
SLEEPERS = """
import os, signal, time
life_r, life_w = os.pipe()

def sleeper(then=None):
    pid = os.fork()
    if pid == 0:
        if then is not None:
            then()
        while True:
            time.sleep(1000)
    return pid

def all_dead():
    # A blocking read, no timeout: a sandbox's processes take turns on one virtual clock, which
    # may jump past a timeout while a killed process is still being torn down on the host. If
    # one survived, the exec times out instead.
    return os.read(life_r, 1) == b""
"""


def test_kill_minus_one_from_pid_1_spares_it_and_kills_every_other_process(sb):
    run(sb, SLEEPERS + """
state = {"steps": 1}
kids = [sleeper(), sleeper(), sleeper(lambda: sleeper())]   # the third has a child of its own
os.close(life_w)
print(os.getpid(), len(kids))
""")
    r = run(sb, """
os.kill(-1, signal.SIGKILL)
print("caller alive", os.getpid())
print([os.waitpid(k, 0)[1] for k in kids])   # each killed by SIGKILL (wait status 9)
print("grandchild dead", all_dead())
state["steps"] += 1
""")
    assert r.stdout == "caller alive 1\n[9, 9, 9]\ngrandchild dead True\n", r
    # The interpreter kept its state; with nobody left to signal, kill(-1) is ESRCH as on Linux.
    r = run(sb, """
try:
    os.kill(-1, signal.SIGTERM)
except ProcessLookupError as e:
    print("ESRCH", e.errno)
print(state)
""")
    assert r.stdout == "ESRCH 3\n{'steps': 2}\n", r


def test_kill_minus_one_reaches_the_children_forked_while_it_goes_out(sb):
    # Three processes that keep forking sleepers while pid 1 sends kill(-1, SIGKILL): on Linux a
    # fork and that signal exclude each other, so no child may survive, however many had been
    # made. A survivor would hold the life pipe open. The forking starts in one exec and the kill
    # comes in the next, so that they fork in real time (between execs background processes do
    # not take turns) while the kill goes out.
    run(sb, SLEEPERS + """
started_r, started_w = os.pipe()

def forker():
    os.write(started_w, b"x")
    for _ in range(25):
        try:
            sleeper()
        except OSError:
            break

forkers = [sleeper(forker) for _ in range(3)]
os.close(life_w)
os.read(started_r, 3)
""")
    r = run(sb, """
os.kill(-1, signal.SIGKILL)
print([os.waitpid(f, 0)[1] for f in forkers], "all dead", all_dead())
""")
    assert r.stdout == "[9, 9, 9] all dead True\n", r


def test_kill_minus_one_from_a_child_spares_pid_1_and_the_caller(sb):
    # pid 1 -> A (sleeps), B (sleeps), C -> G (sleeps), C -> D, and D sends kill(-1, SIGKILL).
    # Everybody but pid 1 and D dies: A and B (D's uncles), C (D's own parent, not pid 1) and G
    # (a sibling of D). D, adopted by pid 1 when C dies, reports on a pipe and waits to be told.
    r = run(sb, SLEEPERS + """
report_r, report_w = os.pipe()
go_r, go_w = os.pipe()

def d_main():
    os.close(life_w)
    os.read(go_r, 1)
    try:
        os.kill(-1, signal.SIGKILL)
        msg = "sent"
    except OSError as e:
        msg = "error %d" % e.errno
    os.write(report_w, ("%s by %d\\n" % (msg, os.getpid())).encode())
    os.read(go_r, 1)          # alive until pid 1 has checked the others
    os._exit(0)

def c_main():
    sleeper()                 # G
    d = os.fork()
    if d == 0:
        d_main()
    while True:
        time.sleep(1000)

a, b = sleeper(), sleeper()
c = sleeper(c_main)
os.close(life_w)
state = "kept"
os.write(go_w, b"x")
line = b""
while not line.endswith(b"\\n"):
    line += os.read(report_r, 100)
print(line.decode().strip())
print("others dead", all_dead())
print([os.waitpid(p, 0)[1] for p in (a, b, c)])
os.write(go_w, b"x")          # D may end now
print("caller alive", os.getpid(), state)
""")
    lines = r.stdout.splitlines()
    assert lines[0].startswith("sent by ") and int(lines[0].split()[-1]) not in (1,), r
    assert lines[1:] == ["others dead True", "[9, 9, 9]", "caller alive 1 kept"], r
    # D ended on its own afterwards (pid 1 adopted it; nothing is left to signal).
    r = run(sb, """
import time
for _ in range(200):
    try:
        os.kill(-1, 0)
    except ProcessLookupError:
        print("nobody left"); break
    time.sleep(0.05)
""")
    assert r.stdout == "nobody left\n", r


def test_kill_minus_one_from_a_shell_leaves_the_interpreter(sb):
    run(sb, "state = 'kept'")
    r = sb.exec(command="sleep 1000 & sleep 1000 & kill -9 -1; echo shell alive $?", timeout_seconds=60)
    assert r.ok and r.stdout == "shell alive 0\n" and not r.interpreter_died, r
    assert run(sb, "print(state)").stdout == "kept\n"


def test_a_process_group_is_signalled_whole_and_alone(sb):
    # pid 1 -> A (leads group A) -> A1 (in group A, a grandchild of pid 1); pid 1 -> B (group 1).
    r = run(sb, SLEEPERS + """
ready_r, ready_w = os.pipe()

def lead():
    os.setpgid(0, 0)
    sleeper()                 # A1, in A's group
    os.write(ready_w, b"x")

a = sleeper(lead)
b = os.fork()
if b == 0:
    os.close(life_w)          # B must survive: it does not hold the life pipe
    while True:
        time.sleep(1000)
os.close(life_w)
os.read(ready_r, 1)
os.kill(-a, signal.SIGKILL)
print("group dead", all_dead(), os.waitpid(a, 0)[1])
print("b alive", os.waitpid(b, os.WNOHANG) == (0, 0))
# kill(0, ..) is the caller's own group: pid 1 and B (group 1), not the caller alone.
got = []
signal.signal(signal.SIGUSR1, lambda *a: got.append(1))
os.kill(0, signal.SIGUSR1)    # B dies of it (default action), pid 1 runs its handler
print("handler", got, os.waitpid(b, 0)[1] == signal.SIGUSR1)
try:
    os.kill(-a, 0)
except ProcessLookupError:
    print("group gone")
""")
    assert r.stdout == "group dead True 9\nb alive True\nhandler [1] True\ngroup gone\n", r


def test_tkill_and_tgkill_check_their_arguments_as_linux_does(sb):
    r = run(sb, """
import ctypes, os
libc = ctypes.CDLL(None, use_errno=True)
def call(nr, *args):
    r = libc.syscall(nr, *args)
    return r if r >= 0 else -ctypes.get_errno()
SYS_tkill, SYS_tgkill = 200, 234
print(call(SYS_tkill, -1, 0), call(SYS_tgkill, -1, 1, 0), call(SYS_tgkill, 0, 1, 0), call(SYS_tgkill, 1, -1, 0))
print(call(SYS_tgkill, 1, 1, 0), call(SYS_tkill, 1, 0), call(SYS_tgkill, 1, 2, 0))
""")
    # EINVAL (22) for a non-positive tid or tgid; signal 0 to itself works; tgid != tid is ESRCH.
    assert r.stdout == "-22 -22 -22 -22\n0 0 -3\n", r


DEATHS = {
    "os._exit": ("import os; os._exit(5)", 5, "exited with status 5"),
    "SIGKILL to itself": ("import os; os.kill(os.getpid(), 9)", 128 + 9, "killed by signal 9 (SIGKILL)"),
    "a crash": ("import ctypes; ctypes.string_at(0)", 128 + 11, "SIGSEGV"),
}


@pytest.mark.parametrize("how", list(DEATHS))
def test_the_dying_exec_and_the_next_one_say_the_interpreter_died(sb, how):
    code, exit_code, words = DEATHS[how]
    run(sb, "state = 'set'; open('/work/kept', 'w').write('x'); open('/tmp/kept', 'w').write('x')")
    r = sb.exec(code=code, timeout_seconds=60)
    assert r.exit_code == exit_code and r.interpreter_died and not r.interpreter_restarted, r
    assert words in r.note and "next exec runs in a fresh interpreter" in r.note, r.note
    r = sb.exec(code="import os; print('state' in globals(), os.path.exists('/work/kept'), os.path.exists('/tmp/kept'))")
    assert r.ok and r.stdout == "False False False\n", r
    assert r.interpreter_restarted and not r.interpreter_died, r
    assert "fresh interpreter" in r.note and words in r.note, r.note
    # Said once: the exec after that is an ordinary one.
    run(sb, "print(1)")


def test_a_timeout_interrupts_the_interpreter_and_keeps_it(sb):
    run(sb, "state = 1")
    r = sb.exec(code="while True: pass", timeout_seconds=0.5)
    assert r.timed_out and not r.interpreter_died and "timed out" in r.note, r
    r = sb.exec(code="print('state' in globals())")
    assert r.stdout == "True\n" and not r.interpreter_restarted and r.note == "", r


def test_a_fork_group_after_a_death_says_its_children_are_fresh(sb):
    r = sb.exec(code="import os; os._exit(0)")
    assert r.ok and r.interpreter_died, r  # exit status 0, but the interpreter is gone
    with sb.fork_group(2) as grp:
        rs = grp.map(lambda i, c: c.exec(code="print('state' in globals())"))
    assert [(x.stdout, x.interpreter_restarted) for x in rs] == [("False\n", True)] * 2, rs
    assert sb.exec(code="print(2)").interpreter_restarted  # and the parent's own next exec


def test_an_explicit_reset_after_a_death_is_not_reported(sb):
    assert sb.exec(code="import os; os._exit(1)").interpreter_died
    sb.reset()
    run(sb, "print(3)")


def test_a_candidate_that_ends_the_interpreter_scores_zero_with_a_reason(client):
    spec = UnitTestReward(tests="assert solve([2, 1]) == [1, 2]\n", timeout_seconds=5)
    for code in ("import os\nos._exit(0)", "import os\nos.kill(os.getpid(), 9)"):
        g = grade(code, spec, client=client)
        assert g.reward == 0.0 and "ended the interpreter" in g.reason, (code, g.reason)
    # kill(-1) from a candidate kills only its own processes: the tests still run.
    candidate = "import os, time\nif os.fork() == 0:\n    time.sleep(1000)\nos.kill(-1, 9)\nos.wait()\ndef solve(xs): return sorted(xs)\n"
    g = grade(candidate, spec, client=client)
    assert g.reward == 1.0, g.reason
