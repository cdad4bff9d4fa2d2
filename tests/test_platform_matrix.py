"""Every SDK feature on both platforms in one run (issue 35, "Show": the platform matrix).

Each test takes the `platform` fixture, so it runs on kvm and on systrap (tests/platforms.py;
`COLLIMATE_TEST_PLATFORMS` narrows it, and CI runs the systrap side again with /dev/kvm hidden).
The same assertions hold on both; where systrap does not do what kvm does yet, the systrap case is
marked `systrap_gap(reason)`, an expected failure that fails the run the day it passes. What the
matrix leaves to one platform, and why, is the table in docs/platforms.md ("The test matrix").

The hostile corpus (test_hostile.py, test_hostile_combined.py) and the CPython battery
(test_cpython_battery.py) take the same fixture.
"""

from __future__ import annotations

import errno
import http.server
import os
import socketserver
import threading

import pytest

from collimate_core import Egress, EmbeddedClient, Sandbox, UnitTestReward, extract_code, grade, grade_batch, rollout_once

SEED = "5eed0000" * 8
MiB = 1 << 20


@pytest.fixture(scope="module")
def client(platform):
    for k in ("COLLIMATE_API_KEY", "COLLIMATE_RAY_ADDRESS"):
        os.environ.pop(k, None)
    c = EmbeddedClient(platform=platform)
    assert c.platform == platform
    yield c
    c.close()


def test_a_session_keeps_state_and_moves_files_both_ways(client, platform):
    with client.session("python") as s:
        assert s.platform == platform
        r = s.exec(code="x = 20\nprint(x + 1)")
        assert (r.ok, r.stdout, r.platform) == (True, "21\n", platform), r
        assert s.exec(code="print(x * 2)").stdout == "40\n"
        r = s.exec(command="echo out; echo err >&2; exit 5")
        assert (r.exit_code, r.stdout, r.stderr) == (5, "out\n", "err\n"), r
        blob = bytes(range(256)) * 1000
        s.upload_bytes("/work/in.bin", blob)
        r = s.exec(command="cd /work && python3 -c \"d = open('in.bin','rb').read(); open('out.bin','wb').write(d[::-1])\"",
                   timeout_seconds=120)
        assert r.ok, r
        assert s.download("/work/out.bin") == blob[::-1]


def test_a_fork_group_starts_from_the_parent_and_keeps_children_apart(client):
    with client.session("python") as s:
        s.exec(code="acc = [0]\nopen('/work/who', 'w').write('parent')")
        with s.fork_group(3) as grp:
            out = grp.map(lambda i, c: c.exec(code=f"acc.append({i})\nopen('/work/who', 'w').write('kid{i}')\nprint(acc)"))
            assert [r.stdout for r in out] == [f"[0, {i}]\n" for i in range(3)]
            out = grp.map(lambda i, c: c.exec(command="cat /work/who"))
            assert [r.stdout for r in out] == [f"kid{i}" for i in range(3)]
        assert s.exec(code="print(acc, open('/work/who').read())").stdout == "[0] parent\n"


def test_grading_gives_rewards(client):
    spec = UnitTestReward(template="python", tests="assert solve(4) == 16\n")
    good = extract_code("```python\ndef solve(n):\n    return n * n\n```")
    assert grade(good, spec, client=client, seed=SEED).reward == 1.0
    rewards = grade_batch([good, "def solve(n):\n    return n\n", "def solve(:\n"], spec, client=client, seed=SEED)
    assert [r.reward for r in rewards] == [1.0, 0.0, 0.0]


def test_a_seed_replays_and_is_acked(client):
    code = "import random, os, uuid\nprint(random.random(), os.urandom(8).hex(), uuid.uuid4())"
    a = rollout_once("python", code=code, seed=SEED, client=client)
    b = rollout_once("python", code=code, seed=SEED, client=client)
    assert a.ok and a.seed == SEED and a.seed_ack == b.seed_ack == "verified", a
    assert a.stdout == b.stdout
    c = rollout_once("python", code=code, client=client)
    assert c.seed != SEED and c.stdout != a.stdout
    assert rollout_once("python", code=code, seed=c.seed, client=client).stdout == c.stdout


def test_a_timeout_ends_the_exec_and_keeps_the_sandbox(client):
    with Sandbox("python", client=client) as sb:
        sb.exec(code="kept = 1")
        r = sb.exec(code="import os\nr, w = os.pipe()\nos.read(r, 1)", timeout_seconds=1)
        assert r.timed_out and r.exit_code == 124 and not r.ok, r
        r = sb.exec(code="print(kept)")
        assert r.stdout == "1\n" and not r.interpreter_restarted, r


def test_a_reset_gives_the_templates_state_back(client):
    with Sandbox("python", client=client) as sb:
        sb.exec(code="gone = 1\nopen('/work/gone', 'w').write('x')")
        sb.reset()
        r = sb.exec(code="import os\nprint('gone' in globals(), os.path.exists('/work/gone'))")
        assert r.stdout == "False False\n", r


def test_the_disk_quota_holds(client):
    with Sandbox("python", client=client, disk_quota=8 * MiB) as sb:
        r = sb.exec(command="cat /dev/zero > /work/fill; echo rc=$?", timeout_seconds=120)
        assert "rc=1" in r.stdout and "No space left on device" in r.stderr, r
        usage = sb.disk_usage()
        assert usage is not None and usage["bytes"] <= 8 * MiB, usage
        assert sb.exec(command="rm /work/fill && echo freed").stdout == "freed\n"


def test_memory_exhaustion_is_a_memoryerror_in_the_guest(client):
    with Sandbox("python", client=client) as sb:
        r = sb.exec(code="b = []\ntry:\n    while True: b.append(bytearray(64 << 20))\nexcept MemoryError:\n    print('MemoryError')",
                    timeout_seconds=120)
        assert r.ok and r.stdout == "MemoryError\n", r
        assert sb.exec(code="print('after')").stdout == "after\n"


class _Body(http.server.BaseHTTPRequestHandler):
    def do_GET(self):  # noqa: N802 - the stdlib's name
        self.send_response(200)
        self.send_header("Content-Length", "5")
        self.end_headers()
        self.wfile.write(b"hello")

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def http_server():
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _Body)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


FETCH = (
    "import urllib.request\n"
    "try:\n"
    "    print(urllib.request.urlopen('http://127.0.0.1:{port}/', timeout=10).read().decode())\n"
    "except Exception as e:\n"
    "    r = getattr(e, 'reason', e)\n"
    "    print('ERR', type(r).__name__, getattr(r, 'errno', None))\n"
)


def test_egress_is_denied_by_default_and_an_allowed_address_is_reached(client, http_server):
    with Sandbox("python", client=client) as sb:
        r = sb.exec(code=FETCH.format(port=http_server), timeout_seconds=60)
        assert r.stdout == f"ERR ConnectionRefusedError {errno.ECONNREFUSED}\n", r
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{http_server}")) as sb:
        r = sb.exec(code=FETCH.format(port=http_server), timeout_seconds=60)
        assert r.stdout == "hello\n", r
        assert [e["verdict"] for e in sb.egress_log()] == ["allowed"]


def test_threads_run(client):
    code = "import threading\nout = []\nts = [threading.Thread(target=out.append, args=(i,)) for i in range(4)]\n" \
           "[t.start() for t in ts]; [t.join() for t in ts]\nprint(sorted(out))"
    with Sandbox("python", client=client) as sb:
        r = sb.exec(code=code, timeout_seconds=60)
        assert r.ok and r.stdout == "[0, 1, 2, 3]\n", r
