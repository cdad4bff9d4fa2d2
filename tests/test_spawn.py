"""Spawning programs the fast way keeps Linux's semantics (issue 17; design in
crates/engine/src/vmm/spawn.rs): a vfork child (CPython's subprocess, glibc's posix_spawn) runs
on its parent's vCPU until it execs or exits, and the program starts in fresh memory in a VMM
process of its own. Each test runs real programs (Debian's CPython, busybox) in a sandbox of the
"python" template and checks what a program sees: exit codes, output, descriptors inherited or
closed by O_CLOEXEC, environment and directory, signals, wait statuses, the process cap, a
crashing program, a failed exec, and replays of spawned programs' output.
"""

from __future__ import annotations

import os

import pytest
from collimate_core import Sandbox, connect

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


@pytest.fixture
def sb(client):
    with Sandbox("python", client=client) as s:
        yield s


def run(sb, code: str, **kw):
    r = sb.exec(code=code, timeout_seconds=kw.pop("timeout_seconds", 60), **kw)
    assert r.exit_code == 0, (r.stdout, r.stderr)
    return r.stdout


def test_subprocess_uses_vfork_and_exit_codes_and_output_come_back(sb):
    out = run(sb, (
        "import subprocess, sys\n"
        "assert subprocess._USE_VFORK\n"
        "for code in (0, 1, 7, 255):\n"
        "    print(subprocess.run(['/bin/sh', '-c', f'exit {code}']).returncode)\n"
        "p = subprocess.run(['/bin/sh', '-c', 'echo out; echo err >&2; exit 3'], capture_output=True, text=True)\n"
        "print(repr(p.stdout), repr(p.stderr), p.returncode)\n"
    ))
    assert out.splitlines() == ["0", "1", "7", "255", "'out\\n' 'err\\n' 3"]


def test_environment_directory_and_arguments(sb):
    out = run(sb, (
        "import subprocess\n"
        "p = subprocess.run(['/bin/sh', '-c', 'echo \"$FOO|$#|$1\"; pwd'], env={'FOO': 'bar', 'PATH': '/usr/bin:/bin'},\n"
        "                   cwd='/tmp', capture_output=True, text=True)\n"
        "print(p.stdout, end='')\n"
        "p = subprocess.run(['/bin/sh', '-c', 'echo \"$FOO|$#|$1\"', 'sh', 'a b'], capture_output=True, text=True)\n"
        "print(p.stdout, end='')\n"
    ))
    assert out.splitlines() == ["bar|0|", "/tmp", "|1|a b"]


def test_descriptors_are_inherited_or_closed_by_cloexec(sb):
    out = run(sb, (
        "import os, subprocess\n"
        "r, w = os.pipe()                    # O_CLOEXEC, as os.pipe makes them\n"
        "ri, wi = os.pipe(); os.set_inheritable(wi, True)\n"
        "env = {'PATH': '/usr/bin:/bin'}\n"
        # posix_spawn closes nothing itself: only O_CLOEXEC decides.
        "pid = os.posix_spawn('/bin/sh', ['sh', '-c', f'echo kept >&{wi}; echo gone >&{w} || echo closed >&{wi}'], env)\n"
        "_, st = os.waitpid(pid, 0)\n"
        "os.close(wi); os.close(w)\n"
        "print(os.read(ri, 100).decode().split(), os.read(r, 100), os.waitstatus_to_exitcode(st))\n"
        # subprocess with pass_fds keeps exactly those.
        "a, b = os.pipe()\n"
        "p = subprocess.run(['/bin/sh', '-c', f'echo via-pass-fds >&{b}'], pass_fds=(b,))\n"
        "os.close(b)\n"
        "print(os.read(a, 100).decode().strip(), p.returncode)\n"
        "c, d = os.pipe(); os.set_inheritable(d, True)\n"
        "p = subprocess.run(['/bin/sh', '-c', f'echo x >&{d}'], stderr=subprocess.DEVNULL)  # close_fds\n"
        "print(p.returncode != 0)\n"
    ))
    assert out.splitlines() == ["['kept', 'closed'] b'' 0", "via-pass-fds 0", "True"]


def test_signals_reach_the_spawned_program_and_wait_statuses_say_so(sb):
    out = run(sb, (
        "import os, signal, subprocess, time\n"
        "p = subprocess.Popen(['/bin/sleep', '30'])\n"
        "time.sleep(0.2)\n"
        "p.send_signal(signal.SIGTERM)\n"
        "print(p.wait())\n"
        "p = subprocess.run(['/bin/sh', '-c', 'kill -KILL $$'])\n"
        "print(p.returncode)\n"
        "pid = os.posix_spawn('/bin/sh', ['sh', '-c', 'exit 42'], {})\n"
        "_, st = os.waitpid(pid, 0)\n"
        "print(os.WIFEXITED(st), os.WEXITSTATUS(st))\n"
        "pid = os.posix_spawn('/bin/sh', ['sh', '-c', 'kill -USR1 $$'], {})\n"
        "_, st = os.waitpid(pid, 0)\n"
        "print(os.WIFSIGNALED(st), os.WTERMSIG(st) == signal.SIGUSR1)\n"
        # SIGCHLD reaches the parent for a spawned child.
        "got = []\n"
        "signal.signal(signal.SIGCHLD, lambda *a: got.append(1))\n"
        "subprocess.run(['/bin/true'])\n"
        "print(bool(got))\n"
    ))
    assert out.splitlines() == ["-15", "-9", "True 42", "True True", "True"]


def test_a_spawned_program_that_crashes(sb):
    out = run(sb, (
        "import subprocess\n"
        "p = subprocess.run(['/usr/bin/python3', '-c', 'import ctypes; ctypes.string_at(0)'], capture_output=True)\n"
        "print(p.returncode)\n"
        "p = subprocess.run(['/bin/sh', '-c', 'kill -SEGV $$'])\n"
        "print(p.returncode)\n"
    ))
    assert out.splitlines() == ["-11", "-11"]


def test_a_failed_exec_is_reported_to_the_parent(sb):
    # CPython's child writes the errno to a pipe; glibc's posix_spawn child writes it into the
    # memory it shares with its parent, which only a vfork served in place lets the parent see.
    out = run(sb, (
        "import os, subprocess\n"
        "try:\n"
        "    subprocess.run(['/no/such/program'])\n"
        "except FileNotFoundError as e:\n"
        "    print('subprocess', e.errno)\n"
        "try:\n"
        "    os.posix_spawn('/no/such/program', ['x'], {})\n"
        "except FileNotFoundError as e:\n"
        "    print('posix_spawn', e.errno)\n"
        "open('/tmp/noexec', 'w').write('#!/bin/sh\\necho hi\\n')\n"
        "try:\n"
        "    subprocess.run(['/tmp/noexec'])\n"
        "except PermissionError as e:\n"
        "    print('noexec', e.errno)\n"
        "os.chmod('/tmp/noexec', 0o755)\n"
        "print(subprocess.run(['/tmp/noexec'], capture_output=True, text=True).stdout.strip())\n"
    ))
    assert out.splitlines() == ["subprocess 2", "posix_spawn 2", "noexec 13", "hi"]


def test_many_spawns_in_a_row_and_at_once(sb):
    out = run(sb, (
        "import subprocess\n"
        "outs = [subprocess.run(['/bin/echo', str(i)], capture_output=True, text=True).stdout for i in range(100)]\n"
        "print(outs == [f'{i}\\n' for i in range(100)])\n"
        "ps = [subprocess.Popen(['/bin/sh', '-c', f'sleep 0.2; exit {i}']) for i in range(20)]\n"
        "print([p.wait() for p in ps] == list(range(20)))\n"
    ), timeout_seconds=120)
    assert out.splitlines() == ["True", "True"]


def test_a_spawn_bomb_is_stopped_by_the_process_cap(sb):
    # Children blocked on input that never comes (a sleep would end: in replay mode virtual time
    # jumps to the deadline when every process waits).
    out = run(sb, (
        "import subprocess\n"
        "ps = []\n"
        "try:\n"
        "    while len(ps) < 1000:\n"
        "        ps.append(subprocess.Popen(['/bin/sh', '-c', 'read x'], stdin=subprocess.PIPE))\n"
        "except OSError as e:\n"
        "    print(type(e).__name__, e.errno, len(ps))\n"
        "print(sum(p.poll() is None for p in ps) == len(ps))\n"
        "for p in ps: p.kill()\n"
        "print(sorted({p.wait() for p in ps}))\n"
        "print(subprocess.run(['/bin/true']).returncode)\n"
    ), timeout_seconds=300)
    first, alive, killed, again = out.splitlines()
    name, errno_, n = first.split()
    assert (name, errno_) == ("BlockingIOError", "11") and 100 <= int(n) < 256, out
    assert alive == "True" and killed == "[-9]" and again == "0", out


def test_shell_commands_pipelines_and_background_jobs(sb):
    r = sb.exec(command="echo hi | wc -c; (exit 4); echo $?; sh -c 'sleep 0.1 & wait; echo waited'", timeout_seconds=60)
    assert r.exit_code == 0 and r.stdout.split() == ["3", "4", "waited"], r


def test_spawned_programs_replay_with_a_seed(client):
    cmd = "head -c 8 /dev/urandom | busybox base64; python3 -c 'import os, random; print(os.urandom(4).hex(), random.random())'"
    seed = "5eed" * 16

    def once(s):
        with Sandbox("python", client=client) as box:
            r = box.exec(command=cmd, seed=s, timeout_seconds=60)
            assert r.exit_code == 0, r
            return r.stdout

    a, b = once(seed), once(seed)
    assert a == b and len(a.split()) == 3, a
    assert once("0" * 63 + "1") != a


def test_posix_spawn_of_a_shell_that_forks(sb):
    # The spawned shell is a process of its own whose forks (its pipeline) are ordinary forks.
    out = run(sb, (
        "import os, sys\n"
        "sys.stdout.flush()\n"
        "pid = os.posix_spawn('/bin/sh', ['sh', '-c', 'echo a | cat; echo b | cat; exit 9'], os.environ)\n"
        "_, st = os.waitpid(pid, 0)\n"
        "print(os.waitstatus_to_exitcode(st))\n"
    ))
    assert out.split() == ["a", "b", "9"]


def test_a_vfork_child_that_blocks_before_its_exec_times_out_cleanly(sb):
    # A raw vfork (through ctypes) whose child blocks on a pipe nobody writes to: it blocks on its
    # parent's vCPU, between vfork and exec. The exec times out like any other (the result says
    # so), the sandbox's reset ends the child with the rest, and the sandbox goes on.
    r = sb.exec(code=(
        "import ctypes, os\n"
        "r, w = os.pipe()\n"
        "pid = ctypes.CDLL(None, use_errno=True).syscall(58)\n"
        "if pid == 0:\n"
        "    os.read(r, 1)\n"
        "    os._exit(0)\n"
        "print('parent resumed', pid)\n"
    ), timeout_seconds=2)
    assert r.timed_out and "parent resumed" not in r.stdout, r
    r = sb.exec(command="echo after", timeout_seconds=30)
    assert r.exit_code == 0 and r.stdout == "after\n", r


def test_a_command_starts_by_the_engines_spawn_call_with_what_subprocess_would_give_it(sb):
    # exec(command=...) starts /bin/sh by the engine's spawn call (one VM exit instead of the vfork
    # child's pre-exec code); the shell must see what subprocess.run gave it: only fds 0-2 (an
    # inheritable fd 9 of the agent is closed), SIGPIPE and SIGXFSZ at their default (the agent
    # ignores both), the exec's env and cwd, and wait statuses that say how it ended.
    assert run(sb, (
        "import os, signal, sys\n"
        "m = sys.modules['collimate_agent']  # the agent's module (its code runs as __main__)\n"
        "fd = os.open('/etc/hostname', os.O_RDONLY)\n"
        "os.dup2(fd, 9)\n"
        "os.set_inheritable(9, True)\n"
        "print(m._spawn is not None, signal.getsignal(signal.SIGPIPE) == signal.SIG_IGN)\n"
    )).split() == ["True", "True"]
    r = sb.exec(command="(: <&9) 2>/dev/null && echo open || echo closed; echo \"$FOO\"; pwd",
                env={"FOO": "bar baz"}, cwd="/tmp")
    assert (r.exit_code, r.stdout.splitlines()) == (0, ["closed", "bar baz", "/tmp"]), r
    assert sb.exec(command="kill -PIPE $$; echo survived").exit_code == 128 + 13
    assert sb.exec(command="kill -XFSZ $$; echo survived").exit_code == 128 + 25
    r = sb.exec(command="echo out; echo err >&2; kill -TERM $$")
    assert (r.exit_code, r.stdout, r.stderr) == (128 + 15, "out\n", "err\n"), r
    assert sb.exec(command="exit 7").exit_code == 7


def test_the_spawn_call_reports_errors_and_a_threaded_agent_falls_back_to_subprocess(sb):
    out = run(sb, (
        "import os, sys\n"
        "m = sys.modules['collimate_agent']  # the agent's module (its code runs as __main__)\n"
        "for argv in ([b'/nonexistent'], [b'/etc/hostname']):\n"
        "    try:\n"
        "        m._spawn(argv, [])\n"
        "    except OSError as e:\n"
        "        print(type(e).__name__, e.errno)\n"
        "pid = m._spawn([b'/bin/sh', b'-c', b'exit 5'], [b'A=1'])\n"
        "print(os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))\n"
    ))
    assert out.splitlines() == ["FileNotFoundError 2", "PermissionError 13", "5"], out
    # With a second thread in the agent the call is not served in place (ENOSYS): subprocess runs it.
    run(sb, "import threading, time\nthreading.Thread(target=time.sleep, args=(30,), daemon=True).start()\n")
    r = sb.exec(command="echo via-subprocess; exit 3")
    assert (r.exit_code, r.stdout) == (3, "via-subprocess\n"), r


def test_programs_started_again_from_a_cached_image_see_their_own_arguments_and_files(sb):
    # A program's loaded image is cached by the spawning process (crates/engine/src/vmm/image_cache.rs)
    # and later spawns of the same file start over it: each run must still see its own arguments
    # and environment, the image must follow the file (replaced by another program at the same
    # path: static busybox, then dynamic bash with its interpreter), and a second program in the
    # same process must not get the first one's image.
    out = run(sb, (
        "import os, shutil, sys\n"
        "m = sys.modules['collimate_agent']  # the agent's module (its code runs as __main__)\n"
        "def go(*argv, env=(b'WORD=w',)):\n"
        "    sys.stdout.flush()\n"
        "    pid = m._spawn(list(argv), list(env))\n"
        "    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])\n"
        "shutil.copy('/bin/busybox', '/tmp/sh')\n"
        "for word in (b'one', b'two'):\n"
        "    go(b'/tmp/sh', b'-c', b'echo $0 $WORD', word, env=[b'WORD=' + word])\n"
        "os.unlink('/tmp/sh')\n"
        "shutil.copy('/usr/bin/bash', '/tmp/sh')\n"
        "for i in (b'3', b'4'):\n"
        "    go(b'/tmp/sh', b'-c', b'echo bash $BASH_VERSINFO $0; exit $0', i)\n"
        "print(go(b'/tmp/sh', b'-c', b'exit 9'), go(b'/bin/sh', b'-c', b'exit 8'), go(b'/usr/bin/printf', b'%s\\\\n', b'printf'))\n"
    ))
    lines = out.splitlines()
    assert lines[:2] == ["one one", "two two"], out
    assert [ln.split()[0] + " " + ln.split()[2] for ln in lines[2:4]] == ["bash 3", "bash 4"] and lines[2].split()[1].isdigit(), out
    assert lines[4:] == ["printf", "9 8 0"], out


TRACED_RUNNER = """
import os, sys
os.environ.pop("COLLIMATE_API_KEY", None)
from collimate_core import Sandbox, connect
with Sandbox("python", client=connect()) as sb:
    for i in range(int(sys.argv[2])):
        r = sb.exec(command=sys.argv[1])
        sys.stderr.write(f"EXEC {i} {r.exit_code} {r.stdout!r}\\n")
"""


def run_traced(command: str, n: int, **env: str) -> list[str]:
    """Run `command` n times in one sandbox of a fresh engine with COLLIMATE_TRACE=1; its stderr
    lines: the trace marks, and an `EXEC i exit_code stdout` line after each exec."""
    import subprocess
    import sys

    env = dict(os.environ, COLLIMATE_TRACE="1", **env)
    p = subprocess.run([sys.executable, "-c", TRACED_RUNNER, command, str(n)], env=env, capture_output=True, text=True, timeout=300)
    return p.stderr.splitlines()


@pytest.mark.parametrize("prefault", ["1", "0"])
def test_spawns_after_two_runs_of_an_image_start_with_the_pages_both_touched(prefault):
    # crates/engine/src/vmm/spawn_prefault.rs: the first two runs of a cached image report the pages
    # they touched; later spawns get those pages ready before their VM runs. The commands write and
    # read their data (a loop, a pipeline's fork and exec) and must give the same output every time;
    # the trace marks say when the hint was applied (never with COLLIMATE_SPAWN_PREFAULT=0).
    lines = run_traced("i=0; while [ $i -lt 50 ]; do i=$((i+1)); done; echo $i; echo hi | wc -c", 8, COLLIMATE_SPAWN_PREFAULT=prefault)
    execs = [ln.split(" ", 3) for ln in lines if ln.startswith("EXEC ")]
    assert [(e[2], e[3]) for e in execs] == [("0", repr("50\n3\n"))] * 8, lines[-40:]
    # Each exec's marks lie between its EXEC line and the previous one.
    applied, k = [], 0
    for ln in lines:
        if ln.startswith("EXEC "):
            k += 1
        elif ln.startswith("collimate-trace ") and ln.split()[3] == "spawn_prefault.pages":
            applied.append((k, int(ln.split()[4])))
    if prefault == "0":
        assert applied == [], applied
    else:
        # The shell of exec 0 and 1 (and the pipeline stages that exec busybox) report; from the
        # third exec on, every shell starts with the hint.
        assert {k for k, _ in applied} >= set(range(2, 8)), applied
        assert all(n > 20 for _, n in applied), applied


def test_a_shell_that_execs_its_command_learns_its_pages_too():
    # A single command makes busybox's shell exec it in place, so the shell's run never ends: it
    # reports the pages it touched at its execve (crates/engine/src/vmm/spawn.rs, load_fresh).
    # From the third exec on, the shell starts with the hint (a spawn_prefault.pages mark before
    # its exec.enter), and so does the program it execs (one after). Before, only the program had one.
    lines = run_traced("python3 -c 'import sys; print(6 * 7, sys.argv[1:])' a b", 6)
    execs = [ln.split(" ", 3) for ln in lines if ln.startswith("EXEC ")]
    assert [(e[2], e[3]) for e in execs] == [("0", repr("42 ['a', 'b']\n"))] * 6, lines[-40:]
    # For each exec (the marks between its EXEC line and the previous one): where the hint marks lie
    # relative to the shell's execve.
    per_exec: list[list[str]] = [[] for _ in range(6)]
    k = 0
    for ln in lines:
        if ln.startswith("EXEC "):
            k += 1
        elif ln.startswith("collimate-trace ") and k < 6:
            what = ln.split()[3]
            if what == "exec.enter":
                per_exec[k].append("exec")
            elif what == "spawn_prefault.pages":
                per_exec[k].append("hint")
    for k in range(2, 6):
        assert per_exec[k] == ["hint", "exec", "hint"], (k, per_exec)
    assert per_exec[0] == ["exec"], per_exec


def test_fork_then_exec_while_other_threads_run(sb):
    # A guest child's execve replaces its VM and vCPU while the run's preemption timer keeps
    # firing (other threads in the parent make it fire often). The kick of a preemption that
    # landed between the old vCPU's unmap and the new one's registration wrote to the gone
    # kvm_run page and crashed the child's VMM: the program "died by SIGSEGV", 1 in 5 to 1 in 10
    # with two threads in the parent and the parent polling waitpid as here (CPython's test_os SpawnTests.test_nowait failed that way).
    out = run(sb, (
        "import os, sys, threading, time\n"
        "stop = False\n"
        "def spin():\n"
        "    while not stop:\n"
        "        time.sleep(0.0005)\n"
        "ts = [threading.Thread(target=spin) for _ in range(2)]\n"
        "[t.start() for t in ts]\n"
        "codes = {}\n"
        "for _ in range(40):\n"
        "    pid = os.fork()\n"
        "    if pid == 0:\n"
        "        try:\n"
        "            os.execv('/bin/sh', ['/bin/sh', '-c', 'exit 17'])\n"
        "        finally:\n"
        "            os._exit(99)\n"
        "    delay = 0.001\n"
        "    while True:\n"
        "        p, st = os.waitpid(pid, os.WNOHANG)\n"
        "        if p:\n"
        "            break\n"
        "        time.sleep(delay)\n"
        "        delay = min(delay * 2, 0.1)\n"
        "    c = os.waitstatus_to_exitcode(st)\n"
        "    codes[c] = codes.get(c, 0) + 1\n"
        "stop = True\n"
        "[t.join() for t in ts]\n"
        "print(sorted(codes.items()))\n"
    ), timeout_seconds=240)
    assert out.strip() == "[(17, 40)]", out
