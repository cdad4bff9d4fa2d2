"""Issue 31, items 1 and 4, shown: timers fire under the sandbox's virtual clock, and file times
come from the guest's clock.

- alarm, setitimer, timer_create/timer_settime (through Debian's coreutils `timeout`, which arms a
  CLOCK_REALTIME POSIX timer) and timerfd are deadlines of the virtual clock: `timeout 1 sleep 5`
  ends the sleep at virtual 1 s with 124, at once; a busy loop under `timeout 2` is killed after
  about 2 s of the CPU time it burns.
- Files written in the sandbox are stamped with the guest's clock, so `make` sees no clock skew
  and GNU tar no time stamp in the future (docs/replay.md, "File times").

The image is the python template's rootfs plus Debian's coreutils and make (`debian_layer`).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest

from collimate_core import EmbeddedClient, Ready, Sandbox, Template
from collimate_core.templates import cache as _cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from imagefixtures import Layer, debian_layer, write_oci_layout  # noqa: E402

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

SEED = "5eed" * 16


@pytest.fixture(scope="module")
def client(tmp_path_factory):
    """A cache of this file's own with the image "tools": the catalog rootfs plus Debian's
    coreutils and make, baked as template "tools"."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        pytest.skip("needs Debian's apt-get and dpkg to add coreutils and make to the image")
    cache = tmp_path_factory.mktemp("timers-cache")
    base_root = Path(os.environ.get("COLLIMATE_ROOTFS") or _rootfs())
    base = Layer().tree(base_root, skip=(".collimate-rootfs.json",)).bytes()
    tools = debian_layer(["coreutils", "make"], base_root, _cache.deb_dir(_cache.cache_dir()))
    (cache / "images").mkdir()
    write_oci_layout(cache / "images" / "tools", [base, tools], {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/work"},
                     ref_name="1.0")
    c = EmbeddedClient(cache=cache)
    try:
        st = Template.bake(c, name="tools", image="tools:1.0", ready=Ready(cmd="true")).wait(600)
        assert st.phase == "Live", (st.error, st.log[-3000:])
        yield c
    finally:
        c.close()


def _rootfs() -> str:
    import subprocess
    root = Path(__file__).resolve().parents[1]
    return subprocess.run([sys.executable, str(root / "guest/rootfs/build.py")], check=True, capture_output=True,
                          text=True).stdout.strip()


def run(client, command: str, seed=SEED, timeout: float = 60):
    with Sandbox("tools", client=client) as sb:
        return sb.exec(command=command, seed=seed, timeout_seconds=timeout)


# --- item 1: timers under the virtual clock ------------------------------------------------------


def test_timeout_ends_a_sleep_at_its_virtual_deadline(client):
    """coreutils timeout arms timer_create(CLOCK_REALTIME) + timer_settime and waits in sigsuspend
    while its child sleeps: the tree's clock jumps to the timer (1 s), not to the sleep's end
    (5 s). On main the sleep ended first: 0."""
    r = run(client, "timeout 1 sleep 5; echo status=$?; timeout -s KILL 1 sleep 5; echo status=$?; "
                    "timeout 5 sleep 1; echo status=$?")
    assert r.stdout.split() == ["status=124", "status=137", "status=0"], (r.stdout, r.stderr)
    assert r.seed_ack == "verified", r.seed_ack


def test_timeout_replays_exactly(client):
    """The virtual time at which the timer fired, as the guest's clock shows it, is the same in
    every replay: the jump is a function of the deadlines, not of the host."""
    cmd = ("python3 -c 'import time; print(time.monotonic())'; timeout 1 sleep 5; "
           "python3 -c 'import time; print(time.monotonic())'")
    # The clock reads of a multi-process exec may differ by a microsecond between sandboxes
    # (docs/replay.md, "Virtual time across separate sandboxes"): the jump itself is exact.
    for _ in range(3):
        before, after = (float(x) for x in run(client, cmd).stdout.split())
        assert round(after - before, 3) == 1.0, (before, after)


def test_alarm_kills_a_sleeping_python(client):
    """signal.alarm(1) then time.sleep(5): SIGALRM at virtual 1 s (default action: the process
    dies, 128 + 14). On main it printed NO-ALARM."""
    r = run(client, "python3 -c 'import signal, time; signal.alarm(1); time.sleep(5); print(\"NO-ALARM\")'; "
                    "echo status=$?")
    assert "NO-ALARM" not in r.stdout and "status=142" in r.stdout, (r.stdout, r.stderr)


def test_setitimer_ticks_in_virtual_time(client):
    """An interval ITIMER_REAL whose handler counts: its ticks come at 0.5, 0.75, 1.0 ... virtual
    seconds while the process sleeps, and getitimer reads what is left."""
    code = (
        "import signal, time\n"
        "t0 = time.monotonic(); ticks = []\n"
        "signal.signal(signal.SIGALRM, lambda *a: ticks.append(round(time.monotonic() - t0, 2)))\n"
        "signal.setitimer(signal.ITIMER_REAL, 0.5, 0.25)\n"
        "time.sleep(1.1)\n"
        "left, interval = signal.getitimer(signal.ITIMER_REAL)\n"
        "signal.setitimer(signal.ITIMER_REAL, 0)\n"
        "print(ticks, interval, 0 < left <= 0.25)\n"
    )
    r = run(client, f"python3 -c '{code}'")
    assert r.stdout.strip() == "[0.5, 0.75, 1.0] 0.25 True", (r.stdout, r.stderr)


def test_alarm_ends_a_busy_loop_by_the_cpu_time_it_burns(client):
    """No syscall, no clock read: the host timer kicks the vCPU out when the computing reached the
    alarm, and virtual time moves there. Where that is depends on the host's speed: the verdict
    says not-reproducible. On main the loop ran until the exec's own timeout."""
    code = (
        "import signal\n"
        "def late(*a): raise TimeoutError('alarm')\n"
        "signal.signal(signal.SIGALRM, late)\n"
        "signal.alarm(1)\n"
        "n = 0\n"
        "try:\n    while n < 10**15: n += 1\n"
        "except TimeoutError as e: print('stopped by', e)\n"
    )
    with Sandbox("tools", client=client) as sb:
        r = sb.exec(code=code, seed=SEED, timeout_seconds=60)
        assert r.stdout == "stopped by alarm\n", (r.stdout, r.stderr)
        assert r.seed_ack == "not-reproducible", r.seed_ack
        # The same in a process of its own (an exec's command): it dies of SIGALRM.
        r = sb.exec(command="python3 -c 'import signal; signal.alarm(1)\nwhile True: pass'; echo status=$?",
                    seed=SEED, timeout_seconds=60)
        assert r.stdout == "status=142\n", (r.stdout, r.stderr)


def test_timeout_kills_a_busy_bash_loop(client):
    """`timeout 2 bash -c 'while :; do :; done'`: the loop makes no syscall; the waiting parent's
    deadline preempts it and the turns it ran move the tree's clock. On main: never killed."""
    r = run(client, "timeout 2 bash -c 'while :; do :; done'; echo status=$?", timeout=120)
    assert r.stdout.split() == ["status=124"], (r.stdout, r.stderr)


TIMERFD = r'''
import ctypes, os, select, struct, time
libc = ctypes.CDLL(None, use_errno=True)
CLOCK_MONOTONIC = 1
fd = libc.timerfd_create(CLOCK_MONOTONIC, 0)
assert fd >= 0, ctypes.get_errno()
spec = struct.pack("qqqq", 0, 200_000_000, 1, 0)       # interval 0.2 s, first after 1 s
buf = ctypes.create_string_buffer(spec)
assert libc.timerfd_settime(fd, 0, buf, None) == 0, ctypes.get_errno()
t0 = time.monotonic()
r, _, _ = select.select([fd], [], [], 10)
first = round(time.monotonic() - t0, 2)
n1 = struct.unpack("Q", os.read(fd, 8))[0]
time.sleep(0.5)
n2 = struct.unpack("Q", os.read(fd, 8))[0]
cur = ctypes.create_string_buffer(32)
libc.timerfd_gettime(fd, cur)
interval = struct.unpack("qqqq", cur.raw)[:2]
print(bool(r), first, n1, n2, interval)
'''


def test_timerfd_is_readable_at_its_virtual_deadline(client):
    """timerfd_create/settime/gettime through ctypes (CPython 3.11 has no os.timerfd_create):
    select sees it readable at virtual 1 s, a read gives the expiration count (2 more after
    0.5 s at 0.2 s intervals), gettime reads the interval. On main: ENOSYS."""
    with Sandbox("tools", client=client) as sb:
        sb.upload_bytes("/work/tfd.py", TIMERFD.encode())
        r = sb.exec(command="python3 /work/tfd.py", seed=SEED, timeout_seconds=60)
    assert r.stdout.strip() == "True 1.0 1 2 (0, 200000000)", (r.stdout, r.stderr)


# --- item 4: one clock for files -------------------------------------------------------------------


def test_make_sees_no_clock_skew(client):
    """A Makefile and its sources written by the exec (and one uploaded): make builds, then finds
    everything up to date, and never warns of a file in the future. On main the written files had
    the host's time, ahead of the guest's clock: "Clock skew detected"."""
    with Sandbox("tools", client=client) as sb:
        sb.upload_bytes("/work/p/Makefile", b"out.txt: a.txt b.txt\n\tcat a.txt b.txt > out.txt\n")
        sb.upload_bytes("/work/p/b.txt", b"uploaded\n")
        r = sb.exec(command="cd /work/p && echo a > a.txt && make && make && touch a.txt && make",
                    seed=SEED, timeout_seconds=60)
    out = r.stdout + r.stderr
    assert r.exit_code == 0, out
    assert "skew" not in out and "in the future" not in out, out
    assert out.count("cat a.txt b.txt > out.txt") == 2 and "is up to date" in out, out


def test_tar_sees_no_time_stamp_in_the_future(client):
    """Files written now, archived and extracted with GNU tar: no "time stamp ... in the future",
    and their mtime is the guest's clock (within the exec). On main tar warned for each."""
    cmd = ("cd /work && echo x > f && sleep 1 && tar cf t.tar f && rm f && tar xf t.tar && "
           "python3 -c 'import os, time; print(abs(time.time() - os.stat(\"/work/f\").st_mtime) < 5)'")
    r = run(client, cmd)
    assert "in the future" not in r.stderr, r.stderr
    assert r.exit_code == 0 and r.stdout.strip() == "True", (r.stdout, r.stderr)


def test_a_written_files_ctime_is_not_after_its_mtime(client):
    """After a write, Linux has ctime == mtime; CPython's test_filetime checks ctime <= mtime. The
    host's kernel sets ctime from the host's clock, ahead of the guest's, and nothing can set it:
    before this, stat reported a ctime in the guest's future, after the re-stamped mtime."""
    code = ("import os; fn = '/tmp/ft'; open(fn, 'wb').write(b'foo')\n"
            "with open(fn, 'ab', 0) as f: f.write(b'bar')\n"
            "s = os.stat(fn); import time\n"
            "print(s.st_ctime <= s.st_mtime, s.st_ctime <= time.time())\n")
    with Sandbox("tools", client=client) as sb:
        r = sb.exec(code=code, seed=SEED, timeout_seconds=60)
    assert r.ok and r.stdout.split() == ["True", "True"], (r.stdout, r.stderr)


def test_a_same_size_edit_in_a_later_exec_is_not_hidden_by_the_bytecode_cache(client):
    """An agent's edit must be what runs next. CPython's bytecode cache is valid while the
    source's whole-second mtime and size match; virtual time moves only by clock reads and sleeps,
    so an edit in the next exec landed in the same second as the file it replaced, and a same-size
    edit (a sign flip) ran the old code (found by benches/bench_swe.py: a patch that breaks a test
    scored 1.0). Each run in replay mode now starts in a later second than the guest's past."""
    with Sandbox("tools", client=client) as sb:
        steps = [
            ("command", "mkdir -p /work/pkg && printf 'X = 1\\n' > /work/pkg/m.py"),
            ("command", "cd /work/pkg && python3 -c 'import m; print(m.X)' && ls __pycache__"),
            ("command", "sed -i 's/X = 1/X = 2/' /work/pkg/m.py"),
            ("command", "cd /work/pkg && python3 -c 'import m; print(m.X)'"),
        ]
        outs = []
        for kind, text in steps:
            r = sb.exec(**{kind: text}, seed=SEED, timeout_seconds=60)
            assert r.exit_code == 0, (kind, text, r.stdout, r.stderr)
            outs.append(r.stdout.strip())
    assert outs[1].split() == ["1", "m.cpython-311.pyc"] and outs[3] == "2", outs
