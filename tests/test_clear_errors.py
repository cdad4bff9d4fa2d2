"""Errors that say what happened and what to do (issue 32, finding 9).

- a `cwd=` that does not exist: InvalidArgument before anything runs, and the interpreter (its
  state) goes on; before, the agent's own traceback came back as the program's, with seed_ack
  `no-ack`;
- a `code=` or `command=` over its size limit: InvalidArgument before it is sent, saying to put
  the program in a file; before, 20 MiB of code ended in a bare MemoryError inside the guest;
- uploads where nothing is writable: one rule in every message (a read-only root: only /tmp, /work, /dev/shm, HOME);
- a write past the disk quota: the guest gets ENOSPC, as on Linux. busybox's `head` reports any
  stdio error as "standard output: I/O error" (its own fixed text: it does not print errno), so
  the check is that busybox says the same in the sandbox as on this host over a tmpfs of the same
  size, and that programs which print errno say "No space left on device".
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
from collimate_core import EmbeddedClient, InvalidArgument, Sandbox
from collimate_core.sdk.embedded import MAX_CODE, MAX_COMMAND
from collimate_core.sdk.quota import WRITABLE_RULE

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]

QUOTA = 16 << 20


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    c = EmbeddedClient(disk_quota=QUOTA)
    yield c
    c.close()


def test_a_missing_cwd_is_an_invalid_argument_and_the_interpreter_goes_on(client):
    with Sandbox("python", client=client) as sb:
        assert sb.exec(code="x = 41").ok
        with pytest.raises(InvalidArgument, match=r"cwd='/no/such/dir'.*No such file or directory.*mkdir -p /no/such/dir"):
            sb.exec(code="x += 1", cwd="/no/such/dir")
        with pytest.raises(InvalidArgument, match="Not a directory"):
            sb.exec(command="true", cwd="/etc/passwd")
        r = sb.exec(code="x += 1; print(x)", cwd="/tmp")
        assert r.ok and r.stdout == "42\n" and r.seed_ack == "verified" and not r.interpreter_restarted, r


def test_code_and_command_over_their_limits_are_refused_before_they_are_sent(client):
    with Sandbox("python", client=client) as sb:
        with pytest.raises(InvalidArgument, match=r"code= is 20971520 bytes, over the limit.*upload_bytes"):
            sb.exec(code="#" * (20 << 20))
        with pytest.raises(InvalidArgument, match=r"command= is .* over Linux's limit.*sh /work/run.sh"):
            sb.exec(command="true #" + "x" * MAX_COMMAND)
        # At the limits, they run.
        r = sb.exec(code="x = 1\n" * ((MAX_CODE - 20) // 6) + "print('ran')", timeout_seconds=300)
        assert r.ok and r.stdout == "ran\n", r.stderr[-2000:]
        r = sb.exec(command="echo ran #" + "x" * (MAX_COMMAND - 10))
        assert r.ok and r.stdout == "ran\n", r


def test_upload_errors_state_one_rule(client):
    with Sandbox("python", client=client) as sb:
        for path in ("/etc/x", "/usr/bin/x", "/x"):
            with pytest.raises(InvalidArgument) as e:
                sb.upload_bytes(path, b"x")
            assert str(e.value).count("writable") == 1 and WRITABLE_RULE in str(e.value), e.value
        for d in ("/tmp", "/work", "/dev/shm"):  # the rule is true
            sb.upload_bytes(f"{d}/ok", b"ok")
            assert sb.download(f"{d}/ok") == b"ok"


def native_busybox_head(tmp_path, n: int) -> str:
    """stderr of this host's busybox `head -c n /dev/zero` into a tmpfs of QUOTA bytes."""
    d = tmp_path / "mnt"
    d.mkdir()
    r = subprocess.run(
        ["unshare", "-m", "sh", "-c",
         f"mount -t tmpfs -o size={QUOTA} none {d} && busybox head -c {n} /dev/zero > {d}/f"],
        capture_output=True, text=True, timeout=120,
    )
    if "mount" in r.stderr and "head" not in r.stderr:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr}")
    assert r.returncode == 1, r
    return r.stderr


@pytest.mark.skipif(shutil.which("busybox") is None or shutil.which("unshare") is None or os.geteuid() != 0,
                    reason="needs busybox, unshare and root for the native baseline")
def test_a_write_past_the_quota_gets_enospc_as_on_linux(client, tmp_path):
    n = 2 * QUOTA
    native = native_busybox_head(tmp_path, n)
    with Sandbox("python", client=client) as sb:
        r = sb.exec(command=f"head -c {n} /dev/zero > /tmp/f; echo rc=$?; rm -f /tmp/f", timeout_seconds=120)
        assert r.stdout == "rc=1\n" and r.stderr == native == "head: standard output: I/O error\n", (r, native)
        for cmd in (f"cat /dev/zero > /tmp/f", f"dd if=/dev/zero of=/tmp/f bs=1M count={n >> 20}"):
            r = sb.exec(command=f"{cmd}; rm -f /tmp/f", timeout_seconds=120)
            assert "No space left on device" in r.stderr, (cmd, r)
        r = sb.exec(code=(
            "import os\n"
            "fd = os.open('/tmp/f', os.O_WRONLY | os.O_CREAT)\n"
            "try:\n"
            "    while True:\n"
            "        os.write(fd, bytes(1 << 20))\n"
            "except OSError as e:\n"
            "    print(e.errno, e.strerror)\n"
            "os.remove('/tmp/f')\n"
        ), timeout_seconds=120)
        assert r.stdout == "28 No space left on device\n", r


# --- texts that issue 32's changes (shared memory in the budget, the download cap) made untrue ---


def test_the_download_hint_for_a_fifo_names_a_keyword_exec_takes(client):
    # The hint said exec(..., timeout=...): Sandbox.exec takes timeout_seconds=, so following it
    # raised TypeError.
    import inspect
    import re

    with Sandbox("python", client=client) as sb:
        assert sb.exec(command="mkfifo /work/fifo").ok
        with pytest.raises(InvalidArgument) as e:
            sb.download("/work/fifo")
        msg = str(e.value)
        assert "it is a FIFO" in msg, msg
        hint = re.search(r"exec\(command=\"([^\"]+)\", (\w+)=\.\.\.\)", msg)
        assert hint, msg
        assert hint.group(2) in inspect.signature(Sandbox.exec).parameters, msg
        # The sandbox goes on.
        assert sb.exec(command="echo ok").stdout == "ok\n"


def test_serve_help_says_what_the_memory_budget_charges():
    # The budget charges shared memory too (issue 32); the help said guest memory plus disk quota.
    r = subprocess.run([sys.executable, "-m", "collimate_core", "serve", "--help"], capture_output=True, text=True,
                       env={k: v for k, v in os.environ.items() if k not in ("COLLIMATE_API_KEY", "COLLIMATE_BASE_URL")},
                       timeout=60)
    assert r.returncode == 0, r.stderr
    text = " ".join(r.stdout.split())
    budget = text[text.rindex("--memory-budget SIZE"):]  # the option's help, not the usage line
    budget = budget[:budget.index("(default")]
    assert "shared memory" in budget and "disk quota" in budget, budget
    assert "--shared-memory SIZE" in text


def test_a_download_over_the_servers_cap_names_the_servers_flag(tmp_path_factory):
    # Over HTTP the cap is the server's --max-download; the message told the caller to raise
    # max_download, a knob only the embedded client has.
    from test_http import Server, _cli

    from collimate_core import RemoteClient

    store = tmp_path_factory.mktemp("keys") / "keys.json"
    key = _cli("keys", "--key-store", str(store), "create", "--tenant", "t").strip()
    srv = Server(tmp_path_factory.mktemp("srv"), store, "--max-download", str(1 << 20), "--disk-quota", "16M")
    try:
        with RemoteClient(key, srv.url) as c, Sandbox("python", client=c) as sb:
            assert sb.exec(command="head -c 2000000 /dev/zero > /work/big").ok
            with pytest.raises(InvalidArgument) as e:
                sb.download("/work/big")
            msg = str(e.value)
            assert "over the download limit of 1048576 bytes" in msg and "--max-download" in msg, msg
            assert "raise the limit (max_download)" not in msg, msg
            sb.upload_bytes("/work/small", b"small")
            assert sb.download("/work/small") == b"small"
    finally:
        srv.stop()
