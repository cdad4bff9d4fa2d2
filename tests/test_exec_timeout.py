"""An exec that times out ends what it started and keeps the sandbox (docs/sessions.md).

Issue: a hung command (a test that never returns, a `sleep` the agent forgot) used to restore the
sandbox from its template, taking every edit in /work with it.
"""

from __future__ import annotations

import os

import pytest

from collimate_rl import connect

pytestmark = [pytest.mark.kvm, pytest.mark.skipif(not os.path.exists("/dev/kvm"), reason="needs /dev/kvm")]


@pytest.fixture(scope="module")
def client():
    os.environ.pop("COLLIMATE_API_KEY", None)
    return connect()


def test_a_command_that_times_out_keeps_files_and_the_interpreter(client):
    with client.session("python") as s:
        s.upload_bytes("/work/x", b"edited")
        assert s.exec(command="echo tmp > /tmp/y && mkfifo /tmp/hang /tmp/bg /tmp/late").ok
        assert s.exec(code="state = 41").ok
        # A background job of an earlier exec is not this exec's: it outlives the timeouts.
        assert s.exec(command="(cat /tmp/bg > /work/bg_out) > /dev/null 2>&1 &").ok
        # (`sleep` ends at once in the sandbox's virtual time: these hang for real.)
        hangs = ("while :; do :; done", "cat /tmp/hang", "sh -c 'cat /tmp/hang; echo never'", "python3 -c 'while True: pass'")
        for hang in hangs:
            r = s.exec(command=hang, timeout_seconds=2)
            assert r.timed_out and r.exit_code == 124, (hang, r)
            assert not r.interpreter_died, (hang, r)
            assert "the sandbox is kept" in r.note, (hang, r.note)
            after = s.exec(command="cat /work/x /tmp/y")
            assert after.ok and after.stdout == "editedtmp\n", (hang, after)
            assert not after.interpreter_restarted, (hang, after)
            assert s.exec(code="print(state + 1)").stdout == "42\n"
        # What a timed-out exec started is gone: the reader of /tmp/late never reads, so a writer
        # finds nobody (and itself times out), and `echo late` never runs.
        r = s.exec(command="sh -c 'cat /tmp/late; echo late > /work/late'", timeout_seconds=1)
        assert r.timed_out
        w = s.exec(command="echo x > /tmp/late", timeout_seconds=2)
        assert w.timed_out, w
        assert s.exec(command="test -e /work/late").exit_code == 1
        # The earlier background job is still there to read.
        assert s.exec(command="echo alive > /tmp/bg", timeout_seconds=30).ok
        for _ in range(100):
            out = s.exec(command="cat /work/bg_out").stdout
            if out:
                break
        assert out == "alive\n"


def test_python_code_that_times_out_is_interrupted_and_keeps_its_state(client):
    with client.session("python") as s:
        s.upload_bytes("/work/x", b"kept")
        assert s.exec(code="state = {'n': 1}\nimport os\nos.mkfifo('/tmp/f')").ok
        hangs = ("while True: pass", "import subprocess\nsubprocess.run(['cat', '/tmp/f'])")
        for hang in hangs:
            r = s.exec(code=hang, timeout_seconds=2)
            assert r.timed_out and r.exit_code == 124 and not r.interpreter_died, (hang, r)
            assert "KeyboardInterrupt" in r.stderr, (hang, r.stderr)
            after = s.exec(code="print(open('/work/x').read(), state['n'])")
            assert after.stdout == "kept 1\n" and not after.interpreter_restarted, (hang, after)


def test_an_interpreter_that_does_not_stop_is_replaced_and_files_stay(client):
    """SIGINT ignored: the interpreter is replaced, the files stay. Python blocked opening a
    FIFO that has no writer stops instead: the SIGINT ends the open with EINTR, and CPython raises
    KeyboardInterrupt there (before, the engine restarted the call under the handler and the
    interpreter was replaced too)."""
    with client.session("python") as s:
        s.upload_bytes("/work/x", b"kept")
        assert s.exec(code="import os\nos.mkfifo('/tmp/f')\nstate = 1").ok
        r = s.exec(code="open('/tmp/f').read()", timeout_seconds=1)
        assert r.timed_out and "KeyboardInterrupt" in r.stderr, (r.note, r.stderr[-2000:])
        after = s.exec(code="print(open('/work/x').read(), 'state' in globals())")
        assert after.stdout == "kept True\n" and not after.interpreter_restarted, (after, after.note)
        stubborn = ("import signal\nsignal.signal(signal.SIGINT, signal.SIG_IGN)\nwhile True: pass",)
        for hang in stubborn:
            assert s.exec(code="state = 1").ok
            r = s.exec(code=hang, timeout_seconds=1)
            assert r.timed_out and r.exit_code == 124, (hang, r)
            assert "fresh interpreter" in r.note and "files in /tmp and /work are kept" in r.note, (hang, r.note)
            after = s.exec(code="print(open('/work/x').read(), 'state' in globals())")
            assert after.interpreter_restarted and after.stdout == "kept False\n", (hang, after)
            assert "files in /tmp and /work were kept" in after.note, after.note
            assert s.exec(command="echo ok").stdout == "ok\n"
