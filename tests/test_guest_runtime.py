"""The guest runtime through the SDK: Debian's CPython 3.11 and busybox, unmodified, in sandboxes of
the "python" template (issue 3, "Show"): shell commands, pipelines and redirections, the standard
library (json, re, hashlib, subprocess, tempfile, sqlite3, zipfile), byte-exact upload and
download, the output cap's truncation flag, exit codes and signals.
"""

from __future__ import annotations

import hashlib
import os

import pytest
from collimate_core import Sandbox, connect

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

OUTPUT_CAP = 16 << 20  # vmm::OUTPUT_CAP

TASK = b"""\
import json, sys
from collections import Counter

words = open("words.txt").read().split()
print(json.dumps(Counter(words).most_common(2)))
print("argv", sys.argv[1:], file=sys.stderr)
"""


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


@pytest.fixture
def sb(client):
    with Sandbox("python", client=client) as s:
        yield s


def sh(sb, command: str, **kw):
    return sb.exec(command=command, timeout_seconds=kw.pop("timeout_seconds", 60), **kw)


# --- commands ------------------------------------------------------------------------------------


def test_uploaded_task_runs_from_work(sb):
    sb.upload_bytes("/work/task.py", TASK)
    sb.upload_bytes("/work/words.txt", b"b a b c b a\n")
    r = sh(sb, "cd /work && python3 task.py one two")
    assert r.ok, r.stderr
    assert r.stdout == '[["b", 3], ["a", 2]]\n'
    assert r.stderr == "argv ['one', 'two']\n"
    r = sh(sb, "python3 task.py", cwd="/work")
    assert r.ok and r.stdout.startswith('[["b", 3]')


def test_pipelines(sb):
    assert sh(sb, "echo hi | tr a-z A-Z").stdout == "HI\n"
    r = sh(sb, "seq 1 1000 | grep 7 | sort -r | head -3 | wc -l")
    assert r.ok and r.stdout.strip() == "3"
    r = sh(sb, "printf 'b\\na\\nc\\n' | sort | tr '\\n' ,")
    assert r.stdout == "a,b,c,"
    # A pipeline into python and back out.
    r = sh(sb, "seq 1 100 | python3 -c 'import sys; print(sum(map(int, sys.stdin)))' | cat")
    assert r.stdout == "5050\n"


def test_redirections(sb):
    r = sh(sb, "echo written > /tmp/x; cat /tmp/x")
    assert r.ok and r.stdout == "written\n"
    r = sh(sb, "echo more >> /tmp/x; wc -l < /tmp/x")
    assert r.stdout.strip() == "2"
    r = sh(sb, "ls /no/such/dir 2>&1")
    assert r.exit_code == 1 and "No such file" in r.stdout and r.stderr == ""
    r = sh(sb, "echo to-stderr 1>&2")
    assert r.stdout == "" and r.stderr == "to-stderr\n"
    r = sh(sb, "(echo out; echo err >&2) > /tmp/both 2>&1; cat /tmp/both")
    assert r.stdout == "out\nerr\n"
    r = sh(sb, "echo gone > /dev/null; cat /dev/null; echo $?")
    assert r.stdout == "0\n"
    assert sb.download("/tmp/x") == b"written\nmore\n"


STDLIB = r'''
import hashlib, json, re, sqlite3, subprocess, sys, tempfile, zipfile, io, os

assert json.loads(json.dumps({"a": [1, 2.5, None, "\u00e9"]})) == {"a": [1, 2.5, None, "\u00e9"]}
assert re.findall(r"(\w+)@(\w+)\.com", "x a@b.com y c@d.com") == [("a", "b"), ("c", "d")]
assert hashlib.sha256(b"abc").hexdigest().startswith("ba7816bf")
assert hashlib.md5(b"").hexdigest() == "d41d8cd98f00b204e9800998ecf8427e"

child = subprocess.run([sys.executable, "-c", "import os; print(os.getpid() != 1, os.getppid())"],
                       capture_output=True, text=True, check=True)
assert child.stdout.split()[0] == "True", child.stdout
echo = subprocess.run(["sh", "-c", "echo $0 $1; exit 3", "a", "b"], capture_output=True, text=True)
assert (echo.returncode, echo.stdout) == (3, "a b\n")
out = subprocess.check_output("seq 3 | tac 2>/dev/null || seq 3 | sort -r", shell=True, text=True)
assert out.split() == ["3", "2", "1"], out

with tempfile.TemporaryDirectory() as d:
    path = os.path.join(d, "db.sqlite")
    con = sqlite3.connect(path)
    con.execute("create table t (k text primary key, v integer)")
    con.executemany("insert into t values (?, ?)", [("a", 1), ("b", 2), ("c", 3)])
    con.commit()
    con.close()
    con = sqlite3.connect(path)
    assert con.execute("select sum(v) from t where k != 'b'").fetchone() == (4,)
    with tempfile.NamedTemporaryFile("w+", dir=d, suffix=".txt", delete=False) as f:
        f.write("tempfile")
    assert open(f.name).read() == "tempfile"
    zpath = os.path.join(d, "a.zip")
    with zipfile.ZipFile(zpath, "w", zipfile.ZIP_DEFLATED) as z:
        z.writestr("dir/hello.txt", "hello " * 1000)
        z.write(f.name, "t.txt")
    with zipfile.ZipFile(zpath) as z:
        assert z.testzip() is None
        assert z.read("dir/hello.txt") == b"hello " * 1000
        assert sorted(z.namelist()) == ["dir/hello.txt", "t.txt"]
print("stdlib ok", sqlite3.sqlite_version)
'''


def test_python_c_with_the_standard_library(sb):
    sb.upload_bytes("/work/stdlib_check.py", STDLIB.encode())
    # As `python3 -c` (the program text in argv) and as a file.
    r = sh(sb, 'python3 -c "$(cat /work/stdlib_check.py)"')
    assert r.ok, r.stderr
    assert r.stdout.startswith("stdlib ok 3.")
    r = sh(sb, "python3 /work/stdlib_check.py")
    assert r.ok, r.stderr
    # And in the sandbox's persistent interpreter (code=).
    r = sb.exec(code=STDLIB, timeout_seconds=60)
    assert r.ok, r.stderr


def test_busybox_applets_and_the_environment(sb):
    r = sh(sb, "id -u; pwd; echo $HOME; uname -s; ls / | tr '\\n' ' '")
    lines = r.stdout.splitlines()
    assert lines[0] == "0" and lines[2] == "/work" and lines[3] == "Linux", r.stdout
    for d in ("bin", "etc", "tmp", "usr", "work"):
        assert d in lines[4].split()
    r = sh(sb, "echo $GREETING", env={"GREETING": "hello"})
    assert r.stdout == "hello\n"


def test_commands_get_the_template_environment_not_the_agents(sb):
    """The agent's own PYTHONUNBUFFERED / PYTHONDONTWRITEBYTECODE (issue 31, item 6) reach no command
    nor the processes it starts; the template's env and the exec's envs do."""
    r = sh(sb, "env; python3 -c 'import os, sys; print(\"py\", sorted(k for k in os.environ if k.startswith(\"PYTHON\")), "
               "sys.flags.dont_write_bytecode)'", env={"MINE": "1"})
    assert r.ok, r.stderr
    names = {line.split("=", 1)[0] for line in r.stdout.splitlines() if "=" in line}
    assert "PYTHONUNBUFFERED" not in names and "PYTHONDONTWRITEBYTECODE" not in names, r.stdout
    assert not any(n.startswith("COLLIMATE") for n in names), r.stdout
    assert {"PATH", "HOME", "LANG", "MINE"} <= names, r.stdout
    assert "py [] 0\n" in r.stdout, r.stdout
    # A code exec's subprocesses inherit the same environment.
    r = sb.exec(code="import subprocess; print(subprocess.run(['env'], capture_output=True, text=True).stdout)",
                timeout_seconds=60)
    assert r.ok and "PATH=" in r.stdout and "PYTHONUNBUFFERED" not in r.stdout, r.stdout + r.stderr


# --- files ---------------------------------------------------------------------------------------


def sha(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def test_upload_download_byte_exact(sb):
    payloads = {
        "/work/empty": b"",
        "/work/all_bytes": bytes(range(256)) * 17,
        "/tmp/nested/dir/crlf": b"a\r\nb\rc\n\x00\xff",
    }
    for path, data in payloads.items():
        sb.upload_bytes(path, data)
    for path, data in payloads.items():
        assert sb.download(path) == data, path
    # The guest sees the same bytes (its own sha256), and a file it writes comes back exact.
    code = (
        "import hashlib, sys\n"
        "for p in sys.argv[1:]: print(p, hashlib.sha256(open(p, 'rb').read()).hexdigest())\n"
        "open('/work/from_guest', 'wb').write(bytes(range(255, -1, -1)) * 3)\n"
    )
    sb.upload_bytes("/work/hash.py", code.encode())
    r = sh(sb, "python3 /work/hash.py " + " ".join(payloads))
    assert r.ok, r.stderr
    got = dict(line.split() for line in r.stdout.splitlines())
    assert got == {p: sha(d) for p, d in payloads.items()}
    assert sb.download("/work/from_guest") == bytes(range(255, -1, -1)) * 3
    assert sh(sb, "wc -c < /work/empty").stdout.strip() == "0"


def test_upload_download_64_mib(sb):
    data = os.urandom(64 << 20)
    sb.upload_bytes("/work/big.bin", data)
    r = sh(sb, "python3 -c \"import hashlib; print(hashlib.sha256(open('/work/big.bin','rb').read()).hexdigest())\"")
    assert r.ok and r.stdout.strip() == sha(data)
    # The guest transforms it; the host checks the result byte for byte.
    r = sh(sb, "python3 -c \"d = open('/work/big.bin','rb').read(); open('/tmp/rev.bin','wb').write(d[::-1])\"")
    assert r.ok, r.stderr
    back = sb.download("/tmp/rev.bin")
    assert len(back) == len(data) and sha(back) == sha(data[::-1])
    assert sha(sb.download("/work/big.bin")) == sha(data)


# --- output ----------------------------------------------------------------------------------------


def test_output_over_the_cap_is_truncated_and_flagged(sb):
    n = OUTPUT_CAP + (1 << 20)
    r = sh(sb, f"head -c {n} /dev/zero | tr '\\0' x")
    assert r.ok and r.truncated
    assert len(r.stdout_bytes) == OUTPUT_CAP and set(r.stdout_bytes) == {ord("x")}
    r = sh(sb, f"python3 -c \"import sys; sys.stderr.buffer.write(b'e' * {n})\"")
    assert r.ok and r.truncated and len(r.stderr_bytes) == OUTPUT_CAP
    # One unbuffered write bigger than the engine's 16 MiB I/O piece is written whole (it used to
    # be cut short: the program saw a short write and lost the rest).
    r = sh(sb, f"python3 -u -c \"import sys; print(sys.stdout.buffer.write(b'w' * {n}), file=sys.stderr)\"")
    assert r.ok and r.truncated and r.stderr == f"{n}\n"
    # Up to the cap nothing is lost and nothing is flagged.
    r = sh(sb, f"head -c {OUTPUT_CAP - 4096} /dev/zero")
    assert r.ok and not r.truncated and len(r.stdout_bytes) == OUTPUT_CAP - 4096
    assert sh(sb, "echo small").truncated is False


# --- exit codes and signals --------------------------------------------------------------------


@pytest.mark.parametrize(
    "command, code",
    [
        ("true", 0),
        ("false", 1),
        ("exit 7", 7),
        ("exit 255", 255),
        ("sh -c 'exit 3'; echo $?", 0),
        ("no-such-program", 127),
        ("kill -SEGV $$", 128 + 11),
        ("kill -TERM $$", 128 + 15),
        ("kill -KILL $$", 128 + 9),
        ("kill -ABRT $$", 128 + 6),
        ("python3 -c 'import os; os.abort()'", 128 + 6),
        ("python3 -c 'import os, signal; os.kill(os.getpid(), signal.SIGFPE)'", 128 + 8),
        ("python3 -c 'import ctypes; ctypes.string_at(0)'", 128 + 11),
        ("python3 -c 'raise SystemExit(42)'", 42),
    ],
)
def test_exit_codes_and_signals_of_commands(sb, command, code):
    r = sh(sb, command)
    assert r.exit_code == code, (command, r)
    assert not r.timed_out


def test_signals_seen_from_inside(sb):
    # A child killed by a signal is seen by its parent as killed by that signal.
    r = sh(sb, "sh -c 'kill -SEGV $$'; echo status=$?")
    assert r.stdout == "status=139\n"
    code = (
        "import subprocess, sys, signal\n"
        "p = subprocess.run([sys.executable, '-c', 'import os; os.abort()'])\n"
        "q = subprocess.run(['sh', '-c', 'kill -TERM $$'])\n"
        "print(p.returncode, q.returncode)\n"
        "r = subprocess.run('yes | head -c 5', shell=True, capture_output=True)\n"  # SIGPIPE
        "print(r.returncode, r.stdout)\n"
    )
    r = sb.exec(code=code, timeout_seconds=60)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == ["-6 -15", "0 b'y\\ny\\ny'"]


def test_the_persistent_interpreter_survives_or_is_restored(sb):
    r = sb.exec(code="import os; os.abort()")
    assert r.exit_code == 128 + 6 and not r.ok
    r = sb.exec(code="raise SystemExit(5)")
    assert r.exit_code == 5
    r = sb.exec(code="print('still here')")
    assert r.ok and r.stdout == "still here\n"


def test_select_and_poll_timeouts_end(sb):
    # Regression: in replay mode (every SDK exec) a select/poll timeout used to never end.
    code = (
        "import select, os, time\n"
        "t = time.monotonic(); print(select.select([], [], [], 1.5)); d1 = time.monotonic() - t\n"
        "r, w = os.pipe(); p = select.poll(); p.register(r, select.POLLIN)\n"
        "t = time.monotonic(); print(p.poll(300)); d2 = time.monotonic() - t\n"
        "print(round(d1, 1), d2 >= 0.3)\n"
    )
    r = sb.exec(code=code, timeout_seconds=20)
    assert r.ok and not r.timed_out, r
    assert r.stdout.splitlines() == ["([], [], [])", "[]", "1.5 True"]


def test_an_upload_after_the_agent_died_is_kept(sb):
    # A program that ends the agent (os._exit, a fatal signal) makes the next exec start from the
    # template; an upload in between used to land in the old state and vanish at that restore.
    r = sb.exec(code="open('/work/left', 'w').write('by the dead program'); import os; os._exit(3)")
    assert r.exit_code == 3
    assert sb.download("/work/left") == b"by the dead program"  # still readable before the restore
    sb.upload_bytes("/work/next.py", b"print(len(open('/work/next.py').read()))\n")
    r = sb.exec(command="python3 /work/next.py; ls /work", timeout_seconds=60)
    assert r.ok and r.stdout == "41\nnext.py\n", r


def test_a_background_job_outlives_its_shell(sb):
    # Regression: an orphan (its shell exited at once) took itself for its dying parent's child and
    # killed itself: on recent kernels the parent's thread group (KVM's nx-lpage-recovery worker)
    # outlives its main thread for a moment, so the parent-death signal comes before the adoption.
    for i in range(5):
        r = sh(sb, f"(while [ ! -e /tmp/go{i} ]; do :; done; echo done > /tmp/done{i}) & echo started")
        assert r.ok and r.stdout == "started\n"
    r = sh(sb, "touch /tmp/go0 /tmp/go1 /tmp/go2 /tmp/go3 /tmp/go4; "
               "until [ -e /tmp/done0 ] && [ -e /tmp/done1 ] && [ -e /tmp/done2 ] && [ -e /tmp/done3 ] "
               "&& [ -e /tmp/done4 ]; do :; done; cat /tmp/done*", timeout_seconds=30)
    assert r.ok and not r.timed_out and r.stdout == "done\n" * 5, r


def test_background_output_stays_out_of_later_execs(sb):
    # A job left running by one exec prints later: that output belongs to no later exec. The next
    # exec gets fresh stdout/stderr; the job's own go nowhere (its writes fail, as over a closed
    # connection: this job ignores SIGPIPE to go on), and it can write to a file instead.
    r = sh(sb, "(while [ ! -e /tmp/go ]; do :; done; trap '' PIPE; echo late; echo late-err >&2; "
               "echo done > /tmp/done) & echo started")
    assert r.ok and r.stdout == "started\n", r
    r = sh(sb, "touch /tmp/go; until [ -e /tmp/done ]; do :; done; echo now", timeout_seconds=30)
    assert r.ok and not r.timed_out, r
    assert r.stdout == "now\n" and r.stderr == "", r
    # Without background jobs, output is as always.
    r = sh(sb, "echo a; echo b >&2")
    assert r.stdout == "a\n" and r.stderr == "b\n"


# --- processes talking to each other: sockets, epoll, asyncio, eventfd, FIFOs ----------------------

ASYNCIO = """
import asyncio, os

async def upper(reader, writer):
    writer.write((await reader.readline()).upper())
    await writer.drain()
    writer.close()

async def main():
    # asyncio's own machinery: an epoll selector, a socketpair self-pipe, a Unix server, a
    # subprocess watched through a pidfd, timers.
    server = await asyncio.start_unix_server(upper, path="/tmp/up.sock")
    reader, writer = await asyncio.open_unix_connection("/tmp/up.sock")
    writer.write(b"over a unix socket\\n")
    await writer.drain()
    print((await reader.readline()).decode().strip())
    writer.close()
    server.close()
    await server.wait_closed()
    proc = await asyncio.create_subprocess_exec("sh", "-c", "echo from $0; exit 3", stdout=asyncio.subprocess.PIPE)
    out, _ = await proc.communicate()
    print(out.decode().strip(), proc.returncode)
    results = await asyncio.gather(*(asyncio.sleep(0.01, result=i) for i in range(3)))
    print(results)

asyncio.run(main())
"""


def test_asyncio_servers_subprocesses_and_timers(sb):
    r = sb.exec(code=ASYNCIO, timeout_seconds=60)
    assert r.ok, r.stderr
    assert r.stdout == "OVER A UNIX SOCKET\nfrom sh 3\n[0, 1, 2]\n", r.stdout
    # As a program of its own (not in the agent's interpreter) too.
    sb.upload_bytes("/work/aio.py", ASYNCIO.encode())
    r = sh(sb, "python3 /work/aio.py")
    assert r.ok and r.stdout.startswith("OVER A UNIX SOCKET\n"), r.stderr


def test_multiprocessing_pipes_and_processes(sb):
    code = (
        "import multiprocessing as mp\n"
        "def child(conn): conn.send(('pong', conn.recv())); conn.close()\n"
        "ctx = mp.get_context('fork')\n"
        "a, b = ctx.Pipe()\n"
        "p = ctx.Process(target=child, args=(b,)); p.start(); a.send('ping'); print(a.recv()); p.join()\n"
        "print(p.exitcode)\n"
        "r, w = ctx.Pipe(duplex=False)\n"
        "p = ctx.Process(target=w.send_bytes, args=(b'x' * 200000,)); p.start(); print(len(r.recv_bytes())); p.join()\n"
    )
    r = sb.exec(code=code, timeout_seconds=60)
    assert r.ok, r.stderr
    assert r.stdout == "('pong', 'ping')\n0\n200000\n"


def test_socketpair_epoll_eventfd_fifo_splice_pidfd(sb):
    code = r"""
import os, select, signal, socket
a, b = socket.socketpair()
ep = select.epoll()
ep.register(b.fileno(), select.EPOLLIN)
print("idle", ep.poll(0))
a.sendall(b"ping")
print("ready", ep.poll(1) == [(b.fileno(), select.EPOLLIN)], b.recv(16))
ep.register(a.fileno(), select.EPOLLOUT | select.EPOLLONESHOT)
print("oneshot", len(ep.poll(0)), len(ep.poll(0)))
a.close()
print("hangup", bool(ep.poll(0)[0][1] & select.EPOLLIN), b.recv(16))
# An eventfd shared with a child: the child's write wakes the parent.
efd = os.eventfd(0)
pid = os.fork()
if pid == 0:
    os.eventfd_write(efd, 5); os._exit(0)
print("eventfd", os.eventfd_read(efd)); os.waitpid(pid, 0)
# A FIFO between two processes.
os.mkfifo("/tmp/fifo")
pid = os.fork()
if pid == 0:
    with open("/tmp/fifo", "w") as f: f.write("through the fifo")
    os._exit(0)
with open("/tmp/fifo") as f: print("fifo", f.read())
os.waitpid(pid, 0)
# splice from a file into a pipe; a pidfd that becomes readable when its child ends.
open("/tmp/data", "wb").write(b"spliced bytes")
r, w = os.pipe()
with open("/tmp/data", "rb") as f: n = os.splice(f.fileno(), w, 7)
print("splice", n, os.read(r, 100))
pid = os.fork()
if pid == 0:
    os._exit(4)
pfd = os.pidfd_open(pid)
print("pidfd", select.select([pfd], [], [], 10)[0] == [pfd], os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]))
"""
    r = sb.exec(code=code, timeout_seconds=60)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == [
        "idle []", "ready True b'ping'", "oneshot 1 0", "hangup True b''", "eventfd 5",
        "fifo through the fifo", "splice 7 b'spliced'", "pidfd True 4",
    ], r.stdout


def test_sockets_stay_inside_the_sandbox(sb):
    code = r"""
import socket, errno
for fam, addr in ((socket.AF_INET, ("127.0.0.1", 22)), (socket.AF_INET6, ("::1", 22))):
    try: socket.socket(fam).connect(addr); print("connected")
    except OSError as e: print(errno.errorcode[e.errno])
s = socket.socket(socket.AF_UNIX)
for addr in ("\0abstract", "/etc/sock", "/proc/sock"):
    try: s.bind(addr); print("bound")
    except OSError as e: print(errno.errorcode[e.errno])
"""
    r = sb.exec(code=code)
    assert r.ok, r.stderr
    # No network under the default policy (Egress.none(): the broker refuses, docs/egress.md); no
    # abstract names (the host's namespace); nothing outside the writable dirs.
    assert r.stdout.split() == ["ECONNREFUSED", "ECONNREFUSED", "EACCES", "EROFS", "EACCES"], r.stdout


def test_xattrs_and_chown_on_sandbox_files(sb):
    code = r"""
import os
open("/work/f", "w").close()
os.setxattr("/work/f", "user.tag", b"v1")
print(os.getxattr("/work/f", "user.tag"), os.listxattr("/work/f"))
os.chown("/work/f", 1000, 1000)
st = os.stat("/work/f"); print(st.st_uid, st.st_gid)
try: os.setxattr("/usr/bin/python3", "user.tag", b"x")
except OSError as e: print(e.strerror)
"""
    r = sb.exec(code=code)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == ["b'v1' ['user.tag']", "1000 1000", "Read-only file system"]


def test_trusted_xattrs_are_roots_and_the_sandboxes_own(sb):
    code = r"""
import os, shutil
open("/work/a", "w").close()
os.setxattr("/work/a", "trusted.k", b"42"); os.setxattr("/work/a", "user.u", b"1")
print(sorted(os.listxattr("/work/a")), os.getxattr("/work/a", "trusted.k"))
shutil.copy2("/work/a", "/work/b")  # copies the attributes it can read: both namespaces
print(sorted(os.listxattr("/work/b")))
for name in ("user.collimate.trusted.k", "security.x"):
    try: os.setxattr("/work/a", name, b"x")
    except OSError as e: print(name, e.strerror)
"""
    r = sb.exec(code=code)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == [
        "['trusted.k', 'user.u'] b'42'", "['trusted.k', 'user.u']",
        "user.collimate.trusted.k Operation not supported", "security.x Operation not supported",
    ], r.stdout


def test_pseudo_terminals(sb):
    code = r"""
import os, pty, sys
m, s = os.openpty()
print(os.isatty(m), os.isatty(s), os.get_inheritable(m), os.ttyname(s).startswith("/dev/pts/"))
os.write(s, b"line\n"); print(os.read(m, 100))
pid, fd = pty.fork()
if pid == 0:
    print("child on a tty:", os.isatty(0), os.isatty(1), flush=True)
    os._exit(7)
out = b""
while True:
    try: chunk = os.read(fd, 1024)
    except OSError: break  # EIO: the child closed its side
    if not chunk: break
    out += chunk
print(out, os.waitpid(pid, 0)[1] >> 8)
held = os.listdir("/dev/pts")  # the two ptys this process holds (another sandbox's: never)
print(len(held), os.path.basename(os.ttyname(s)) in held)
"""
    r = sb.exec(code=code, timeout_seconds=60)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == [
        "True True False True", "b'line\\r\\n'", "b'child on a tty: True True\\r\\n' 7", "2 True",
    ], r.stdout


def test_file_names_that_are_not_utf8(sb):
    code = r"""
import os
name = b"/work/caf\xe9-\xff.txt"
with open(name, "wb") as f: f.write(b"latin-1 name")
print(sorted(os.listdir(b"/work")))
print(open(name, "rb").read(), os.stat(name).st_size)
os.mkdir(b"/tmp/d\xfe"); os.chdir(b"/tmp/d\xfe"); print(os.getcwdb())
os.symlink(name, b"/tmp/l\x80"); print(os.readlink(b"/tmp/l\x80"))
print(os.listdir("/work"))  # as str: surrogate escapes, as Python does on Linux
"""
    r = sb.exec(code=code)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == [
        "[b'caf\\xe9-\\xff.txt']", "b'latin-1 name' 12", "b'/tmp/d\\xfe'", "b'/work/caf\\xe9-\\xff.txt'",
        "['caf\\udce9-\\udcff.txt']",
    ], r.stdout


def test_shared_file_mappings_write_back(sb):
    code = r"""
import mmap, os, subprocess, sys
with open("/work/f", "wb") as f: f.write(b"." * 10000)
with open("/work/f", "r+b") as f:
    m = mmap.mmap(f.fileno(), 10000)
    m[0:5] = b"HELLO"; m[8190:8195] = b"WORLD"
    m.flush()  # msync: written pages reach the file
    data = open("/work/f", "rb").read(); print(data[:6], data[8189:8196])
    m[100:103] = b"xyz"
    m.close()  # munmap
print(open("/work/f", "rb").read()[99:104])
# A child that writes through a mapping and exits without msync.
child = "import mmap; f = open('/work/f', 'r+b'); m = mmap.mmap(f.fileno(), 0); m[-3:] = b'END'"
subprocess.run([sys.executable, "-c", child], check=True)
data = open("/work/f", "rb").read(); print(data[-4:], len(data))
# Private and read-only mappings never write.
with open("/work/f", "r+b") as f:
    p = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY); p[0:5] = b"copy!"; p.flush(); p.close()
print(open("/work/f", "rb").read()[:5])
"""
    r = sb.exec(code=code)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == ["b'HELLO.' b'.WORLD.'", "b'.xyz.'", "b'.END' 10000", "b'HELLO'"], r.stdout


def test_large_sparse_file_mappings_read_pages_in_on_demand(sb):
    # A file mapping longer than mm::LAZY_MAP_MIN gets each page from the file when the guest first
    # touches it (CPython's test_mmap LargeMmapTests map whole multi-GiB sparse files and read one
    # page). Here a 1000 MiB file (the guest's files stop at 1 GiB) is mapped three times over: more
    # than the sandbox's memory, where copying each mapping in at mmap time failed with ENOMEM.
    code = r"""
import mmap, signal, subprocess, sys
size = 1000 << 20
total = next(int(l.split()[1]) << 10 for l in open("/proc/meminfo") if l.startswith("MemTotal:"))
print(size < total < 2 * size)
with open("/tmp/sparse", "wb") as f:
    f.write(b"head"); f.seek(size - 8); f.write(b"the tail")
with open("/tmp/sparse", "rb") as f:
    m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
print(len(m) == size, m[-8:], m[:4], m[size // 2])
with open("/tmp/sparse", "r+b") as f:
    p = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_COPY)
p[12345:12350] = b"hello"; print(p[12345:12350], p[-8:], m[12345:12350])
# Syscall buffers in pages never touched: write(2) from one, read(2) into another.
with open("/tmp/out", "wb") as o: print(o.write(memoryview(m)[size - 8192:]))
print(open("/tmp/out", "rb").read()[-8:])
with open("/tmp/sparse", "rb") as f:
    f.seek(size - 8); print(f.readinto(memoryview(p)[size // 3:size // 3 + 8]), p[size // 3:size // 3 + 8])
print(open("/tmp/sparse", "rb").read(4))
# A shared writable one writes back.
with open("/tmp/sparse", "r+b") as f:
    s = mmap.mmap(f.fileno(), 0)
s[size // 2:size // 2 + 6] = b"shared"; s.flush(); s.close()
with open("/tmp/sparse", "rb") as f: f.seek(size // 2); print(f.read(6))
# A page wholly past the end of the file (it shrank since mmap) raises SIGBUS, as on Linux.
child = "import mmap; f = open('/tmp/sparse', 'r+b'); m = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ); f.truncate(4096); m[1 << 20]"
print(subprocess.run([sys.executable, "-c", child]).returncode == -signal.SIGBUS)
"""
    r = sb.exec(code=code, timeout_seconds=60)
    assert r.ok, r.stderr
    assert r.stdout.splitlines() == [
        "True", "True b'the tail' b'head' 0", "b'hello' b'the tail' b'\\x00\\x00\\x00\\x00\\x00'", "8192",
        "b'the tail'", "8 b'the tail'", "b'head'", "b'shared'", "True",
    ], r.stdout


def test_memory_beyond_the_first_slot_and_forks_of_it(sb):
    # The VM's memory slot covers the frames in use and grows as the guest takes more (see
    # vstate::vm): 300 MiB written, read back, and inherited by fork-group children.
    r = sb.exec(code="b = bytearray(300 << 20)\nb[::4096] = b'x' * len(b[::4096])\nprint(sum(b[::4096]))")
    assert r.ok and r.stdout == f"{120 * (300 << 20) // 4096}\n", r
    with sb.fork_group(2) as grp:
        outs = grp.map(lambda i, c: c.exec(code="b[4096 * 7] = 121; print(len(b), b[4096 * 7], b[4096 * 8])").stdout)
    assert outs == [f"{300 << 20} 121 120\n"] * 2
    assert sb.exec(code="print(b[4096 * 7])").stdout == "120\n"


def test_a_timeout_fires_while_a_child_trickles_output(sb):
    # Replay mode's clocks are virtual, and the sandbox's processes take turns on one of them
    # (guestos::sched): the child's sleeps move the time the parent's communicate(timeout) sees, so
    # it expires while the child still writes now and then.
    code = (
        "import subprocess, sys\n"
        "child = 'import sys, time\\nfor i in range(4):\\n    sys.stdout.write(\"a\" * 65536); sys.stdout.flush(); time.sleep(0.2)\\n'\n"
        "p = subprocess.Popen([sys.executable, '-c', child], stdout=subprocess.PIPE)\n"
        "try:\n    p.communicate(timeout=0.4); print('no timeout')\n"
        "except subprocess.TimeoutExpired:\n    print('timeout'); p.kill(); p.communicate()\n"
    )
    r = sb.exec(code=code, timeout_seconds=60)
    assert r.ok and r.stdout == "timeout\n", r


def test_mprotect_in_the_interpreters_large_pages(sb):
    # The python template maps each 2 MiB block of CPython's text and read-only data that the file
    # mappings cover whole with one large page (arch::x86_64::paging). An mprotect in such a block
    # puts the block's page table back while the guest runs code from it; the guest must see the
    # same bytes and go on running. A reset brings back the template's large pages.
    code = r"""
import ctypes, zlib
maps = [l.split() for l in open("/proc/self/maps") if l.rstrip().endswith("/usr/bin/python3.11")]
text = next(m for m in maps if m[1] == "r-xp")
lo, hi = (int(x, 16) for x in text[0].split("-"))
rodata = hi  # the first page after the text: read-only data, in the same 2 MiB block as text
page = lo + 0x10000  # a text page in the block before
assert lo <= page < hi and (page >> 21) != (rodata >> 21), (hex(lo), hex(hi))
libc = ctypes.CDLL(None, use_errno=True)
libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
before = [zlib.crc32(ctypes.string_at(p, 4096)) for p in (page, rodata)]
assert libc.mprotect(rodata, 4096, 1) == 0, ctypes.get_errno()  # PROT_READ, as it was
assert libc.mprotect(page, 4096, 5) == 0, ctypes.get_errno()  # PROT_READ|PROT_EXEC, as it was
after = [zlib.crc32(ctypes.string_at(p, 4096)) for p in (page, rodata)]
print(before == after, sum(i * i for i in range(1000)), sorted({"b": 2, "a": 1}.items()), f"{3.5:.2f}")
"""
    for _ in range(2):
        r = sb.exec(code=code, timeout_seconds=60)
        assert r.exit_code == 0, r.stderr
        assert r.stdout.split("\n")[0] == "True 332833500 [('a', 1), ('b', 2)] 3.50", r.stdout
        sb.reset()
