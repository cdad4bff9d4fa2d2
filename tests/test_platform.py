"""Choosing the platform (kvm or systrap): every selection surface, auto's rule with /dev/kvm
present and hidden (a mount namespace with an empty file bound over it), the log line, doctor's
report, and `Sandbox.platform` / `ExecResult.platform` embedded and over HTTP (docs/platforms.md).
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import shutil
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

import collimate_core
from collimate_core import (
    EmbeddedClient,
    InvalidArgument,
    PlatformUnavailable,
    RemoteClient,
    Sandbox,
    connect,
)
from collimate_core.sdk import platform as pf

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_http import Server, _cli, _env  # noqa: E402

HAVE_KVM = os.path.exists("/dev/kvm")
THREE = "'auto', 'kvm' or 'systrap'"
NOT_SERVED = "does not serve systrap sandboxes yet"
# Whether this build serves systrap sandboxes: the engine's binding (Vm.spawn takes platform=) and
# the SDK's systrap templates. While it does not, choosing systrap must say so.
SERVED = pf.binding_serves_systrap() and pf.SDK_SERVES_SYSTRAP


def _module() -> str | None:
    return next((m for m in ("kvm_pvm", "kvm_intel", "kvm_amd") if os.path.isdir(f"/sys/module/{m}")), None)


@pytest.fixture
def no_remote(monkeypatch):
    for k in ("COLLIMATE_API_KEY", "COLLIMATE_BASE_URL", "COLLIMATE_RAY_ADDRESS", "COLLIMATE_PLATFORM"):
        monkeypatch.delenv(k, raising=False)


# --- validation on every surface ----------------------------------------------------------------


@pytest.mark.parametrize("bad", ["bogus", "KVM", "", 3, True])
def test_a_bad_platform_is_an_invalid_argument_naming_the_three(no_remote, monkeypatch, bad):
    with pytest.raises(InvalidArgument, match=THREE) as e:
        EmbeddedClient(platform=bad)
    assert repr(bad) in str(e.value)
    with pytest.raises(InvalidArgument, match=THREE):
        connect(platform=bad)
    with pytest.raises(InvalidArgument, match=THREE):
        connect("col_test_0000", base_url="http://127.0.0.1:9", platform=bad)  # before any request
    with pytest.raises(InvalidArgument, match=THREE):
        collimate_core.RayClient(platform=bad)  # before Ray is touched
    if isinstance(bad, str) and bad:
        monkeypatch.setenv("COLLIMATE_PLATFORM", bad)
        with pytest.raises(InvalidArgument, match=f"COLLIMATE_PLATFORM must be {THREE}"):
            connect()
        with pytest.raises(InvalidArgument, match="COLLIMATE_PLATFORM"):
            EmbeddedClient()


def test_collimate_serve_refuses_a_bad_platform_before_it_starts(tmp_path):
    r = subprocess.run([sys.executable, "-m", "collimate_core", "serve", "--port", "0", "--platform", "bogus"],
                       capture_output=True, text=True, env=_env(), timeout=60)
    assert r.returncode == 2 and "--platform" in r.stderr and "'auto', 'kvm', 'systrap'" in r.stderr
    r = subprocess.run([sys.executable, "-m", "collimate_core", "serve", "--port", "0"], capture_output=True,
                       text=True, env=_env() | {"COLLIMATE_PLATFORM": "bogus"}, timeout=60)
    assert r.returncode == 1 and f"collimate serve: COLLIMATE_PLATFORM must be {THREE}, not 'bogus'" in r.stderr


# --- systrap: chosen, and not served by this build yet --------------------------------------------


@pytest.mark.skipif(SERVED, reason="this build serves systrap sandboxes")
def test_choosing_systrap_says_this_build_does_not_serve_it_and_what_to_do(no_remote, monkeypatch, tmp_path):
    with pytest.raises(PlatformUnavailable) as e:
        EmbeddedClient(platform="systrap")
    msg = str(e.value)
    assert "platform='systrap' was asked for" in msg and NOT_SERVED in msg and "platform='kvm'" in msg
    assert ("Vm.spawn takes no platform=" in msg) != pf.binding_serves_systrap()
    monkeypatch.setenv("COLLIMATE_PLATFORM", "systrap")
    with pytest.raises(PlatformUnavailable, match=NOT_SERVED):
        connect()
    with pytest.raises(PlatformUnavailable, match=NOT_SERVED):
        connect(platform="systrap")
    # `collimate serve --platform systrap` stops at once with the same words (no server starts).
    r = subprocess.run([sys.executable, "-m", "collimate_core", "serve", "--port", "0", "--platform", "systrap",
                        "--key-store", str(tmp_path / "keys.json")], capture_output=True, text=True, env=_env(),
                       timeout=60)
    assert r.returncode == 1 and NOT_SERVED in r.stderr and "collimate serve: platform='systrap'" in r.stderr


def test_the_binding_is_detected_by_feature():
    assert pf.binding_serves_systrap(lambda root, argv, env=None, platform="kvm": None) is True
    assert pf.binding_serves_systrap(lambda root, argv, env=None: None) is False
    assert pf.binding_serves_systrap(object()) is False  # nothing callable: no signature
    from collimate_core._core import Vm

    assert pf.binding_serves_systrap() == pf.binding_serves_systrap(Vm.spawn)


# --- auto with /dev/kvm present ---------------------------------------------------------------------


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_auto_picks_kvm_where_dev_kvm_creates_a_vm_and_logs_it_once(no_remote, monkeypatch, caplog):
    caplog.set_level(logging.INFO, logger="collimate_core")
    c = EmbeddedClient()
    try:
        assert c.platform == "kvm" and c.platform_choice.asked == "auto"
        lines = [r.getMessage() for r in caplog.records if r.name == "collimate_core"]
        assert len(lines) == 1, lines
        line = lines[0]
        assert line.startswith("collimate_core platform: kvm (auto: /dev/kvm opens and creates a VM")
        assert "host offers: kvm yes" in line
        module = _module()
        if module:
            assert module in line
            if module != "kvm_pvm":
                assert ("ept=" if module == "kvm_intel" else "npt=") in line
    finally:
        c.close()
    for asked in ("kvm", "auto"):
        assert connect(platform=asked).platform == "kvm"
    assert connect(platform="kvm") is connect(platform="kvm")  # shared per choice
    monkeypatch.setenv("COLLIMATE_PLATFORM", "kvm")
    assert connect().platform == "kvm" and connect() is connect(platform="kvm")


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_doctor_shows_both_platforms_and_what_auto_picks(no_remote):
    from collimate_core import doctor

    out = doctor.report()
    assert out["platforms"]["kvm"]["available"] is True and out["platforms"]["kvm"]["module"] == _module()
    assert out["auto"] == {"platform": "kvm", "why": out["auto"]["why"], "problem": None}
    assert out["auto"]["why"].startswith("auto: /dev/kvm opens and creates a VM")
    assert set(out["platforms"]["systrap"]) >= {"available", "seccomp", "user_namespaces", "binding", "served"}
    assert out["platform"].startswith("embedded: the engine in this process, on kvm")


# --- auto with /dev/kvm hidden (a mount namespace) -------------------------------------------------

_HIDDEN = r"""
import io, json, logging, sys
buf = io.StringIO()
h = logging.StreamHandler(buf)
logging.getLogger("collimate_core").addHandler(h)
logging.getLogger("collimate_core").setLevel(logging.INFO)
import collimate_core
from collimate_core import doctor
out = {}
try:
    c = collimate_core.connect()
    out["chose"] = c.platform
except collimate_core.CollimateError as e:
    out["error"], out["message"] = type(e).__name__, str(e)
try:
    collimate_core.connect(platform="kvm")
except collimate_core.CollimateError as e:
    out["kvm_error"], out["kvm_message"] = type(e).__name__, str(e)
out["log"] = buf.getvalue().splitlines()
r = doctor.report()
out["doctor"] = {k: r[k] for k in ("platforms", "auto", "platform")}
print(json.dumps(out))
"""


# Run first, it denies this process and its children seccomp filters of their own (seccomp(2) and
# prctl(PR_SET_SECCOMP) fail with EPERM), as a container runtime's profile may: a host offering
# neither platform.
_NO_SECCOMP = r"""
import ctypes
class F(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]
class P(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.POINTER(F))]
LD, JEQ, RET = 0x20, 0x15, 0x06
prog = (F * 7)(
    F(LD, 0, 0, 0),          # the syscall number
    F(JEQ, 4, 0, 317),       # seccomp: deny
    F(JEQ, 0, 2, 157),       # prctl: look at its first argument, else allow
    F(LD, 0, 0, 16),         # args[0]
    F(JEQ, 1, 0, 22),        # PR_SET_SECCOMP: deny
    F(RET, 0, 0, 0x7FFF0000),  # allow
    F(RET, 0, 0, 0x00050001),  # errno EPERM
)
libc = ctypes.CDLL(None, use_errno=True)
assert libc.prctl(38, 1, 0, 0, 0) == 0  # no_new_privs
assert libc.prctl(22, 2, ctypes.byref(P(7, prog)), 0, 0) == 0
assert libc.prctl(22, 2, ctypes.byref(P(7, prog)), 0, 0) != 0 and ctypes.get_errno() == 1
"""


def _hidden(code: str, *args: str) -> subprocess.CompletedProcess:
    """`code` run with /dev/kvm hidden: a new mount namespace with an empty file bound over it."""
    if os.geteuid() != 0 or not shutil.which("unshare") or not HAVE_KVM:
        pytest.skip("needs root, unshare(1) and a /dev/kvm to hide")
    empty = Path(os.environ.get("TMPDIR", "/tmp")) / f"collimate-no-kvm-{os.getpid()}"
    empty.write_bytes(b"")
    try:
        script = 'mount --bind "$0" /dev/kvm && exec "$@"'
        return subprocess.run(["unshare", "-m", "--propagation", "private", "sh", "-c", script, str(empty),
                               sys.executable, *args, *(["-c", code] if code else [])],
                              capture_output=True, text=True, env=_env() | {"COLLIMATE_PLATFORM": ""}, timeout=120)
    finally:
        empty.unlink()


def test_auto_without_dev_kvm_picks_systrap_and_says_clearly_what_this_build_lacks():
    r = _hidden(_HIDDEN)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    # What connect() picked, and what it logged (once, with what the host offers).
    assert len(out["log"]) == 2, out["log"]  # connect() and connect(platform="kvm"): one line per client
    line = out["log"][0]
    assert line.startswith("collimate_core platform: systrap (auto: no usable KVM (/dev/kvm opens but")
    assert "host offers: kvm no" in line and "systrap yes (seccomp filters yes" in line
    assert out["log"][1].startswith("collimate_core platform: kvm (asked for); host offers: kvm no")
    if not SERVED:
        assert out["error"] == "PlatformUnavailable", out
        msg = out["message"]
        assert msg.startswith("auto chose systrap (no usable KVM: /dev/kvm opens but")
        assert NOT_SERVED in msg and "use platform='kvm' on a host where /dev/kvm opens and creates a VM" in msg
    else:
        assert out.get("chose") == "systrap", out
    # Asking for kvm there names what is missing.
    assert out["kvm_error"] == "PlatformUnavailable"
    assert out["kvm_message"].startswith("platform='kvm' needs a usable /dev/kvm, and here /dev/kvm opens but")
    # What doctor says.
    d = out["doctor"]
    assert d["platforms"]["kvm"]["available"] is False and d["platforms"]["systrap"]["available"] is True
    assert d["auto"]["platform"] == "systrap" and "no usable KVM" in d["auto"]["why"]
    if not SERVED:
        assert NOT_SERVED in d["auto"]["problem"] and d["platform"].startswith("none: auto chose systrap")


def test_a_host_offering_neither_platform_gets_an_error_naming_both():
    r = _hidden(_NO_SECCOMP + _HIDDEN)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.splitlines()[-1])
    assert out["error"] == "PlatformUnavailable", out
    msg = out["message"]
    assert msg.startswith("no platform can run sandboxes here: no usable KVM (/dev/kvm opens but is not KVM")
    assert "no systrap (seccomp filters cannot be installed: installing a seccomp filter failed" in msg
    assert "read-write access to /dev/kvm" in msg and "allow seccomp filters for 'systrap'" in msg
    assert out["log"][0].startswith("collimate_core platform: none (auto: no usable KVM")
    assert "systrap no (seccomp filters no" in out["log"][0]
    d = out["doctor"]
    assert d["platforms"]["systrap"]["available"] is False and d["auto"]["platform"] is None
    assert d["platform"] == "none: " + msg


def test_doctor_cli_without_dev_kvm_names_both_platforms_and_auto():
    r = _hidden("", "-m", "collimate_core", "doctor")
    assert r.returncode == 0, r.stderr[-3000:]
    rows = {line.split("  ", 1)[0]: line.split("  ", 1)[1].strip() for line in r.stdout.splitlines() if "  " in line}
    assert rows["kvm"].startswith("no usable KVM: /dev/kvm opens but is not KVM")
    assert rows["platform kvm"].startswith("unavailable: /dev/kvm opens but")
    assert rows["platform systrap"].startswith("the host allows it: seccomp filters can be installed")
    assert rows["auto picks"].startswith("systrap (auto: no usable KVM")
    if not SERVED:
        assert rows["auto picks"].endswith("but this build does not serve it yet")
        assert NOT_SERVED in rows["connect()"]
    assert "one exit" not in rows  # nothing measured on a KVM it cannot use


# --- Sandbox.platform and ExecResult.platform ---------------------------------------------------------


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_sandboxes_and_results_say_kvm_embedded(no_remote):
    client = connect(platform="kvm")
    with Sandbox("python", client=client) as sb:
        assert sb.platform == "kvm"
        r = sb.exec(command="true")
        assert r.ok and r.platform == "kvm"
        with sb.fork_group(2) as group:
            assert [c.platform for c in group] == ["kvm", "kvm"]
            assert [x.platform for x in group.map(lambda i, c: c.exec(code=f"print({i})"))] == ["kvm", "kvm"]


@pytest.mark.kvm
@pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm")
def test_the_aio_surface_takes_and_says_the_platform(no_remote):
    from collimate_core import aio

    async def main():
        with pytest.raises(InvalidArgument, match=THREE):
            await aio.connect(platform="bogus")
        async with aio.connect(platform="kvm") as client:
            assert client.platform == "kvm"
            async with aio.Sandbox("python", client=client) as sb:
                return sb.platform, (await sb.exec(command="true")).platform

    assert asyncio.run(main()) == ("kvm", "kvm")


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    if not HAVE_KVM:
        pytest.skip("needs /dev/kvm")
    store = tmp_path_factory.mktemp("keys") / "keys.json"
    key = _cli("keys", "--key-store", str(store), "create", "--tenant", "alice").strip()
    srv = Server(tmp_path_factory.mktemp("srv"), store, "--platform", "kvm", "--max-sandboxes", "8")
    srv.key = key
    yield srv
    srv.stop()


@pytest.mark.kvm
def test_sandboxes_and_results_say_kvm_over_http(server, no_remote):
    assert [e["platform"] for e in server.events() if e["event"] == "ready"] == ["kvm"]
    assert server.health()["platform"] == "kvm"
    with RemoteClient(server.key, server.url) as client:
        assert client.platform == "kvm"
        with Sandbox("python", client=client) as sb:
            assert sb.platform == "kvm"
            info = httpx.get(f"{server.url}/v1/sandboxes/{sb.sandbox_id}",
                             headers={"Authorization": f"Bearer {server.key}"}).json()
            assert info["platform"] == "kvm"
            r = sb.exec(command="true")
            assert r.ok and r.platform == "kvm"
            with sb.fork_group(2) as group:
                assert [c.platform for c in group] == ["kvm", "kvm"]
    assert connect(server.key, base_url=server.url, platform="kvm").platform == "kvm"
    with pytest.raises(InvalidArgument, match=r"runs its sandboxes on 'kvm', not 'systrap'.*--platform systrap"):
        connect(server.key, base_url=server.url, platform="systrap")

