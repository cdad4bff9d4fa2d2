"""Installing at bake time (docs/egress.md, "Installing packages at bake time"): `pip install` from a
package index and `git clone` over HTTP in a bake whose policy allows the server, and the same
commands refused in the template's sandboxes, which start with `Egress.none()`.

Real parts only: the image is the catalog python rootfs plus a layer of Debian's own python3-pip
and git packages (what `RUN apt-get install -y python3-pip git` adds to an image), the wheel is
built here by hand (METADATA, WHEEL, RECORD with its hashes), the index is a PEP 503 "simple"
directory, and the repository a bare one served both as "dumb" HTTP (its files, after
`git update-server-info`) and as smart HTTP (the host's `git http-backend` as a CGI program), all
from one HTTP server on loopback that counts the connections and requests it gets. Nothing here
reaches any other address (the Debian packages come from apt's configured sources, through apt).
"""

from __future__ import annotations

import base64
import ctypes
import hashlib
import http.server
import io
import os
import secrets
import shutil
import subprocess
import sys
import threading
import zipfile
from pathlib import Path

import pytest

from collimate_core import Egress, EmbeddedClient, Ready, Sandbox, Template
from collimate_core.sdk import egress as eg
from collimate_core.templates import cache as _cache

sys.path.insert(0, str(Path(__file__).resolve().parent))
from imagefixtures import Layer, debian_layer, write_oci_layout  # noqa: E402

HAVE_KVM = os.path.exists("/dev/kvm") and bool(os.environ.get("COLLIMATE_ROOTFS"))
pytestmark = pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm and COLLIMATE_ROOTFS (a built rootfs)")

PKG, VERSION = "cxgreet", "1.0"
GREETING = "installed at bake time"
WHEEL = f"{PKG}-{VERSION}-py3-none-any.whl"
MODULE = f'GREETING = {GREETING!r}\n\n\ndef greet(name):\n    return f"{{GREETING}}: {{name}}"\n'


def _record_hash(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


def build_wheel() -> bytes:
    """A pure-Python wheel (PEP 427): the module, then METADATA, WHEEL and a RECORD that lists
    every file with its hash and size (pip checks them)."""
    info = f"{PKG}-{VERSION}.dist-info"
    files = {
        f"{PKG}/__init__.py": MODULE.encode(),
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: {PKG}\nVersion: {VERSION}\nSummary: a test package\n".encode(),
        f"{info}/WHEEL": b"Wheel-Version: 1.0\nGenerator: test_egress_bake\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{n},{_record_hash(d)},{len(d)}\n" for n, d in files.items()) + f"{info}/RECORD,,\n"
    files[f"{info}/RECORD"] = record.encode()
    buf = io.BytesIO()
    with zipfile.ZipFile(buf, "w", zipfile.ZIP_DEFLATED) as z:
        for n, d in files.items():
            z.writestr(zipfile.ZipInfo(n, (2024, 1, 1, 0, 0, 0)), d)
    return buf.getvalue()


def write_index(root: Path, wheel: bytes) -> None:
    """A PEP 503 simple index at root/simple/ with one project, its file under root/packages/."""
    (root / "packages").mkdir(parents=True)
    (root / "packages" / WHEEL).write_bytes(wheel)
    sha = hashlib.sha256(wheel).hexdigest()
    (root / "simple" / PKG).mkdir(parents=True)
    (root / "simple" / "index.html").write_text(f'<!DOCTYPE html>\n<html><body><a href="{PKG}/">{PKG}</a></body></html>\n')
    (root / "simple" / PKG / "index.html").write_text(
        f'<!DOCTYPE html>\n<html><body><a href="../../packages/{WHEEL}#sha256={sha}">{WHEEL}</a></body></html>\n')


def write_repo(root: Path, work: Path) -> str:
    """A bare repository at root/repo.git for dumb HTTP: a first commit in a pack, a second as loose
    objects (a clone fetches both kinds), then `git update-server-info`. Returns the head commit."""
    env = {**os.environ, "GIT_AUTHOR_NAME": "t", "GIT_AUTHOR_EMAIL": "t@example.org", "GIT_COMMITTER_NAME": "t",
           "GIT_COMMITTER_EMAIL": "t@example.org", "GIT_AUTHOR_DATE": "2024-01-01T00:00:00Z",
           "GIT_COMMITTER_DATE": "2024-01-01T00:00:00Z", "GIT_CONFIG_NOSYSTEM": "1", "HOME": str(work)}

    def git(*args: str, cwd: Path = work) -> str:
        return subprocess.run(["git", *args], cwd=cwd, env=env, check=True, capture_output=True, text=True).stdout

    bare = root / "repo.git"
    work.mkdir(parents=True)
    git("init", "-q", "-b", "main", ".")
    (work / "README").write_text("cloned over HTTP at bake time\n")
    git("add", ".")
    git("commit", "-q", "-m", "first")
    git("clone", "-q", "--bare", str(work), str(bare))
    git("repack", "-q", "-a", "-d", cwd=bare)
    (work / "solve.py").write_text("def solve(x):\n    return x * 2\n")
    git("add", ".")
    git("commit", "-q", "-m", "second")
    git("push", "-q", str(bare), "main")
    git("update-server-info", cwd=bare)
    return git("rev-parse", "HEAD").strip()


class _Static(http.server.SimpleHTTPRequestHandler):
    """Files under the server's directory (the index, dumb HTTP), `git http-backend` under /smart/
    (smart HTTP); HTTP/1.0, so one request per connection; connections and requests counted."""

    def setup(self):
        super().setup()
        with self.server.lock:
            self.server.connections += 1

    def log_request(self, code="-", size="-"):
        with self.server.lock:
            self.server.requests.append((self.path, int(code)))

    def log_message(self, fmt, *args):
        pass


    def do_GET(self):
        if self.path.startswith("/smart/"):
            return self.smart()
        return super().do_GET()

    def do_POST(self):
        if self.path.startswith("/smart/"):
            return self.smart()
        self.send_error(405)

    def smart(self):
        """Smart HTTP under /smart/: the host's `git http-backend`, run as a CGI program (RFC 3875
        variables in, a header block then the body out), one process per request, 60 s at most."""
        path, _, query = self.path[len("/smart"):].partition("?")
        body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
        env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin"), "GIT_PROJECT_ROOT": self.directory,
               "GIT_HTTP_EXPORT_ALL": "1", "GATEWAY_INTERFACE": "CGI/1.1", "REQUEST_METHOD": self.command,
               "PATH_INFO": path, "QUERY_STRING": query, "CONTENT_TYPE": self.headers.get("Content-Type", ""),
               "CONTENT_LENGTH": str(len(body)), "REMOTE_ADDR": self.client_address[0],
               "HTTP_GIT_PROTOCOL": self.headers.get("Git-Protocol", "")}
        out = subprocess.run(["git", "http-backend"], input=body, env=env, capture_output=True, timeout=60).stdout
        head, _, payload = out.partition(b"\r\n\r\n")
        headers = [line.split(b":", 1) for line in head.split(b"\r\n") if b":" in line]
        status = next((int(v.split()[0]) for k, v in headers if k.lower() == b"status"), 200)
        self.send_response(status)
        for k, v in headers:
            if k.lower() != b"status":
                self.send_header(k.decode(), v.strip().decode())
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)


def _in_netns(ns: str, make):
    """`make()` run in a thread that has joined network namespace `ns` (setns moves only the
    calling thread): a socket it makes lives in `ns`, whichever thread serves it afterwards."""
    out: dict = {}

    def run():
        try:
            libc = ctypes.CDLL(None, use_errno=True)
            fd = os.open(f"/run/netns/{ns}", os.O_RDONLY)
            try:
                if libc.setns(fd, 0x40000000) != 0:  # CLONE_NEWNET
                    raise OSError(ctypes.get_errno(), f"setns into {ns}")
            finally:
                os.close(fd)
            out["value"] = make()
        except BaseException as e:  # noqa: BLE001 - handed to the caller
            out["error"] = e

    t = threading.Thread(target=run)
    t.start()
    t.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


class StaticServer:
    def __init__(self, directory: Path, host: str = "127.0.0.1", netns: str | None = None):
        handler = lambda *a, **kw: _Static(*a, directory=str(directory), **kw)  # noqa: E731
        self.root = directory
        make = lambda: http.server.ThreadingHTTPServer((host, 0), handler)  # noqa: E731
        self.srv = make() if netns is None else _in_netns(netns, make)
        self.srv.lock, self.srv.connections, self.srv.requests = threading.Lock(), 0, []
        self.port = self.srv.server_address[1]
        self.thread = threading.Thread(target=self.srv.serve_forever, daemon=True)
        self.thread.start()

    @property
    def connections(self) -> int:
        with self.srv.lock:
            return self.srv.connections

    @property
    def requests(self) -> list[tuple[str, int]]:
        with self.srv.lock:
            return list(self.srv.requests)

    def close(self):
        self.srv.shutdown()
        self.srv.server_close()
        self.thread.join(5)


# --- fixtures ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache of this file's own, holding an image store with one image: the catalog rootfs plus
    Debian's python3-pip and git (the .debs are kept in the usual deb cache across runs)."""
    if shutil.which("apt-get") is None or shutil.which("dpkg") is None:
        pytest.skip("needs Debian's apt-get and dpkg to add python3-pip and git to the image")
    cache = tmp_path_factory.mktemp("egress-bake-cache")
    base_root = Path(os.environ["COLLIMATE_ROOTFS"])
    base = Layer().tree(base_root, skip=(".collimate-rootfs.json",)).bytes()
    tools = debian_layer(["python3-pip", "git", "curl"], base_root, _cache.deb_dir(_cache.cache_dir()))
    (cache / "images").mkdir()
    write_oci_layout(cache / "images" / "tools", [base, tools], {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/work"},
                     ref_name="1.0")
    return cache


@pytest.fixture(scope="module")
def client(cache):
    c = EmbeddedClient(cache=cache)
    yield c
    c.close()


@pytest.fixture(scope="module")
def www(tmp_path_factory):
    """The index and the repository, served from one loopback server."""
    root = tmp_path_factory.mktemp("www")
    write_index(root, build_wheel())
    head = write_repo(root, tmp_path_factory.mktemp("git-work") / "w")
    srv = StaticServer(root)
    srv.head = head
    yield srv
    srv.close()


def pip_install(port: int, target: str, host: str = "127.0.0.1") -> str:
    # --retries 1: a refused index is retried once, not five times with backoff.
    return (f"python3 -m pip install --no-cache-dir --disable-pip-version-check --root-user-action=ignore "
            f"--retries 1 --timeout 20 --target {target} --index-url http://{host}:{port}/simple/ {PKG}")


def allowed_connects(log: str, port: int) -> int:
    return log.count(f"egress: connect  127.0.0.1:{port} allowed ")


def assert_bake_refused(status, port: int) -> None:
    """A bake without an allow rule: its error names the refusal and the fix, its log each refusal."""
    assert f"the bake's egress policy (Egress.none()) refused" in status.error, status.error
    assert f"(127.0.0.1:{port}): a Ready step that installs or clones needs Template.bake(..., egress=" in status.error
    denied = status.log.count(f"egress: connect  127.0.0.1:{port} denied  out=0 in=0 (127.0.0.1 is special-purpose: "
                              "127.0.0.0/8 loopback (RFC 1122): refused without an IP rule that contains it)")
    assert denied >= 1 and f"refused {denied} network request(s)" in status.error, status.log


def assert_refused_and_logged(sb, port: int) -> None:
    denied = [e for e in sb.egress_log() if e["kind"] == "connect" and e["port"] == port]
    assert denied and all(e["verdict"] == "denied" and e["address"] == "127.0.0.1" for e in denied), denied
    assert all("without an IP rule" in e["detail"] for e in denied), denied


# --- pip install ------------------------------------------------------------------------------


def test_pip_install_from_a_local_index_works_in_a_bake_with_an_allow_rule_only(client, www):
    port = www.port
    ready = Ready(cmd=pip_install(port, "/work/site"),
                  code=f"import sys\nsys.path.insert(0, '/work/site')\nimport {PKG}\n")  # loaded in every clone

    before = www.connections
    offline = Template.bake(client, name="pip-offline", image="tools:1.0", ready=ready).wait(600)
    assert offline.phase == "Failed" and "Ready(cmd=...) exited with status 1" in (offline.error or ""), offline.log
    assert "Connection refused" in offline.log and f"No matching distribution found for {PKG}" in offline.log
    assert_bake_refused(offline, port)
    assert www.connections == before, "a bake without an allow rule reached the index"

    st = Template.bake(client, name="pip-online", image="tools:1.0", ready=ready,
                       egress=Egress.allow(f"127.0.0.1:{port}")).wait(600)
    assert st.phase == "Live", st.log
    assert f"Successfully installed {PKG}-{VERSION}" in st.log
    # The index's own count: the project page and the wheel, one connection each (HTTP/1.0),
    # and every one of them in the bake's egress log.
    assert www.requests[-2:] == [(f"/simple/{PKG}/", 200), (f"/packages/{WHEEL}", 200)], www.requests
    assert www.connections - before == 2 == allowed_connects(st.log, port), st.log

    seen = www.connections
    with Sandbox("pip-online", client=client) as sb:
        assert sb.egress == Egress.none()
        r = sb.exec(code=f"import sys\nprint({PKG!r} in sys.modules)\nimport {PKG}\nprint({PKG}.greet('x'))")
        assert r.ok and r.stdout == f"True\n{GREETING}: x\n", r.stderr
        r = sb.exec(command=f"PYTHONPATH=/work/site python3 -c 'import {PKG}; print({PKG}.__file__)'")
        assert r.exit_code == 0 and r.stdout == f"/work/site/{PKG}/__init__.py\n", r.stderr
        # The same install in the template's sandbox, which has no network: a refused connection.
        r = sb.exec(command=pip_install(port, "/work/again"), timeout_seconds=120)
        assert r.exit_code != 0, r.stdout
        out = r.stdout + r.stderr
        assert "[Errno 111] Connection refused" in out and f"No matching distribution found for {PKG}" in out, out
        assert_refused_and_logged(sb, port)
        assert sb.exec(command="test -e /work/again").exit_code != 0
    assert www.connections == seen, "a sandbox without an allow rule reached the index"


# --- git clone --------------------------------------------------------------------------------


@pytest.mark.parametrize("protocol", ["dumb", "smart"])
def test_git_clone_over_http_works_in_a_bake_with_an_allow_rule_only(client, www, protocol):
    port = www.port
    url = f"http://127.0.0.1:{port}{'/smart' if protocol == 'smart' else ''}/repo.git"
    ready = Ready(cmd=f"git clone {url} /work/repo")
    name = f"git-{protocol}"

    before = www.connections
    offline = Template.bake(client, name=f"{name}-offline", image="tools:1.0", ready=ready).wait(600)
    assert offline.phase == "Failed" and "Ready(cmd=...) exited with status 128" in (offline.error or ""), offline.log
    assert f"Failed to connect to 127.0.0.1 port {port}" in offline.log, offline.log
    assert_bake_refused(offline, port)
    assert www.connections == before, "a bake without an allow rule reached the git server"

    st = Template.bake(client, name=name, image="tools:1.0", ready=ready,
                       egress=Egress.allow(f"127.0.0.1:{port}")).wait(600)
    assert st.phase == "Live", st.log
    got = www.requests[len(www.requests) - (www.connections - before):]
    paths = [p for p, _ in got]
    repo = "/smart/repo.git" if protocol == "smart" else "/repo.git"
    assert paths[0] == f"{repo}/info/refs?service=git-upload-pack", got
    if protocol == "dumb":
        # A static info/refs answers the smart probe; then HEAD, the loose objects of the second
        # commit, the first's as loose objects (404: they are packed), the pack list, the pack's
        # index and the pack.
        assert "/repo.git/HEAD" in paths and "/repo.git/objects/info/packs" in paths, paths
        assert all(c == 200 or (c == 404 and p.startswith("/repo.git/objects/")) for p, c in got), got
        assert any(p.endswith(".pack") for p in paths), paths
        assert any(p.startswith("/repo.git/objects/") and len(p.split("/")[-1]) == 38 for p in paths), paths
    else:
        # The server packs what the clone wants; the guest's git index-pack takes the stream.
        assert set(paths[1:]) == {f"{repo}/git-upload-pack"} and all(c == 200 for _, c in got), got
    assert www.connections - before == len(got) == allowed_connects(st.log, port), (got, st.log)

    seen = www.connections
    with Sandbox(name, client=client) as sb:
        r = sb.exec(command="git -C /work/repo log --format=%H%x20%s && cat /work/repo/solve.py && git -C /work/repo fsck")
        assert r.exit_code == 0, r.stderr
        assert r.stdout.startswith(f"{www.head} second\n") and "first\n" in r.stdout and "return x * 2" in r.stdout
        r = sb.exec(command=f"git clone {url} /work/again", timeout_seconds=120)
        assert r.exit_code == 128, r.stdout
        assert f"Failed to connect to 127.0.0.1 port {port}" in r.stderr and "Couldn't connect to server" in r.stderr, r.stderr
        assert_refused_and_logged(sb, port)
    assert www.connections == seen, "a sandbox without an allow rule reached the git server"

    # The image is not the difference: the same clone in a sandbox allowed to reach the server.
    with Sandbox(name, client=client, egress=Egress.allow(f"127.0.0.1:{port}")) as sb:
        r = sb.exec(command=f"git clone -q {url} /work/again && git -C /work/again rev-parse HEAD", timeout_seconds=120)
        assert r.exit_code == 0 and r.stdout == f"{www.head}\n", r.stderr
    assert www.connections > seen


# --- by name: the guest's own resolver --------------------------------------------------------

TESTNET_ADDR = "203.0.113.77"  # TEST-NET-3: an address that is nowhere on the internet
TESTNET_HOST = "203.0.113.76"  # the host's end of the veth pair


@pytest.fixture(scope="module")
def named_www(www):
    """The same files served at a TEST-NET-3 address in a network namespace this fixture makes
    (reached over a veth pair), and the broker resolving `www.test` to it: a name that resolves to
    an address that is neither loopback nor the host's own (answers with those are withheld from
    name rules). TEST-NET-3 is special-purpose, so it is declared public meanwhile, as an operator
    would a lab network."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to make a network namespace (ip netns add)")
    tag = secrets.token_hex(3)
    ns, a, b = f"cx-wb-{tag}", f"cxwa{tag}", f"cxwb{tag}"
    made = subprocess.run(["ip", "netns", "add", ns], capture_output=True, text=True)
    if made.returncode != 0:
        pytest.skip(f"ip netns add is impossible here: {made.stderr.strip()}")
    srv = None
    try:
        for args in (["link", "add", a, "type", "veth", "peer", "name", b], ["link", "set", b, "netns", ns],
                     ["addr", "add", f"{TESTNET_HOST}/24", "dev", a], ["link", "set", a, "up"],
                     ["-n", ns, "addr", "add", f"{TESTNET_ADDR}/24", "dev", b], ["-n", ns, "link", "set", b, "up"],
                     ["-n", ns, "link", "set", "lo", "up"]):
            subprocess.run(["ip", *args], check=True, capture_output=True)
        srv = StaticServer(www.root, host=TESTNET_ADDR, netns=ns)
        srv.head = www.head
        eg.set_resolver({"www.test": TESTNET_ADDR})
        eg.set_public_ranges(["203.0.113.0/24"])
        yield srv
    finally:
        eg.set_public_ranges([])
        eg.set_resolver("system")
        if srv is not None:
            srv.close()
        subprocess.run(["ip", "link", "del", a], capture_output=True)
        subprocess.run(["ip", "netns", "del", ns], capture_output=True)


def test_git_and_curl_reach_an_admitted_name_through_the_guests_own_resolver(client, named_www):
    """Unmodified git (its HTTP helper, libcurl) and curl in the image resolve `www.test` with
    glibc's resolver, which the engine answers (the policy admits the name), and connect to the
    address it gave; another name is NXDOMAIN; the server's count of connections equals the log's
    allowed ones. (pip by name in a seeded exec is left out: its 20 s read timeout can expire at
    once there, a bug this session found and did not fix; docs/egress.md, "Known problem".)"""
    port = named_www.port
    cmd = (f"git ls-remote http://www.test:{port}/smart/repo.git HEAD && "
           f"curl -sS -o /dev/null -w '%{{http_code}} %{{remote_ip}}\\n' http://www.test:{port}/simple/ && "
           f"(curl -sS http://other.test:{port}/simple/ 2>&1 || true)")
    st = Template.bake(client, name="tools", image="tools:1.0").wait(600)
    assert st.phase == "Live", st.log
    before = named_www.connections
    with Sandbox("tools", client=client, egress=Egress.allow(f"www.test:{port}")) as sb:
        r = sb.exec(command=cmd, timeout_seconds=300)
        assert r.exit_code == 0, (r.stdout, r.stderr)
        lines = r.stdout.splitlines()
        assert lines[0] == f"{named_www.head}\tHEAD", r.stdout
        assert lines[1] == f"200 {TESTNET_ADDR}", r.stdout
        assert lines[2].startswith("curl: (6) Could not resolve host: other.test"), r.stdout
        log = sb.egress_log()
        conns = [e for e in log if e["kind"] == "connect"]
        assert conns and all((e["name"], e["address"], e["verdict"]) == ("www.test", TESTNET_ADDR, "allowed") for e in conns), conns
        assert "other.test" in {e["name"] for e in log if e["verdict"] == "nxdomain"}
        assert named_www.connections - before == len(conns)
    # The same commands with no network: nothing resolves, nothing reaches the server.
    seen = named_www.connections
    with Sandbox("tools", client=client) as sb:
        r = sb.exec(command=f"curl -sS http://www.test:{port}/simple/ 2>&1; git ls-remote http://www.test:{port}/smart/repo.git 2>&1",
                    timeout_seconds=120)
        assert "Could not resolve host: www.test" in r.stdout, r.stdout
    assert named_www.connections == seen
