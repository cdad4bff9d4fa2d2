"""Per-sandbox network egress (docs/egress.md): the policy, and its enforcement by the engine.

Real sockets only to loopback and to a network namespace this file creates itself (a veth pair with
TEST-NET-3 addresses, 203.0.113.0/24): nothing here reaches any other address. The broker's
upstream DNS is a DNS server this file runs on loopback, which records every question it is asked.
"""

from __future__ import annotations

import ast
import contextlib
import errno
import hashlib
import http.server
import ipaddress
import os
import random
import secrets
import shutil
import socket
import socketserver
import struct
import subprocess
import threading
import time
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from collimate_core import Egress, EmbeddedClient, InvalidArgument, Sandbox
from collimate_core import _core
from collimate_core.sdk import egress as eg

HAVE_KVM = os.path.exists("/dev/kvm") and bool(os.environ.get("COLLIMATE_ROOTFS"))
kvm = pytest.mark.skipif(not HAVE_KVM, reason="needs /dev/kvm and COLLIMATE_ROOTFS (a built rootfs)")


# --- the policy: parsing ----------------------------------------------------------------------

ISSUE_RULES = ["index.example.org", "*.files.example.net", "host:443", "203.0.113.0/24", "203.0.113.7:5432", "[2001:db8::1]:443"]


def test_the_issue_rules_parse_in_both_parsers():
    for r in ISSUE_RULES:
        assert str(eg.parse_rule(r)) == r
        assert _core._egress_canonical(r) == r


label = st.from_regex(r"[a-z0-9]([a-z0-9-]{0,10}[a-z0-9])?", fullmatch=True)
name = st.lists(label, min_size=1, max_size=4).map(".".join).filter(lambda n: not n.replace(".", "").isdigit())
port = st.integers(1, 65535)


@st.composite
def valid_rule(draw):
    kind = draw(st.sampled_from(["name", "wild", "v4", "v6"]))
    p = draw(st.none() | port)
    if kind in ("name", "wild"):
        host = draw(name)
        host = ("*." + host) if kind == "wild" else host
        return host if p is None else f"{host}:{p}"
    if kind == "v4":
        plen = draw(st.integers(0, 32))
        net = ipaddress.IPv4Network((draw(st.integers(0, 2**32 - 1)), plen), strict=False)
        text = str(net.network_address) if plen == 32 else str(net)
        return text if p is None else f"{text}:{p}"
    plen = draw(st.integers(0, 128))
    net = ipaddress.IPv6Network((draw(st.integers(0, 2**128 - 1)), plen), strict=False)
    if net.network_address.ipv4_mapped is not None:
        net = ipaddress.ip_network("2001:db8::/32")  # the two libraries print mapped forms differently
    text = str(net.network_address) if net.prefixlen == 128 else str(net)
    return text if p is None else f"[{text}]:{p}"


@settings(max_examples=300, deadline=None)
@given(valid_rule())
def test_valid_rules_round_trip_and_both_parsers_agree(rule):
    parsed = eg.parse_rule(rule)
    assert eg.parse_rule(str(parsed)) == parsed
    assert _core._egress_canonical(rule) == str(parsed)


@settings(max_examples=300, deadline=None)
@given(st.text(alphabet="ab.*:/[]-_019 \t", max_size=20))
def test_any_string_is_a_rule_or_a_clear_error_in_both_parsers(text):
    try:
        py = str(eg.parse_rule(text))
    except InvalidArgument as e:
        assert "a rule is a host name" in str(e) and repr(text) in str(e)
        py = None
    try:
        rs = _core._egress_canonical(text)
    except ValueError as e:
        assert "a rule is a host name" in str(e)
        rs = None
    assert py == rs, (text, py, rs)


@pytest.mark.parametrize(
    "bad", ["", " index.example.org", "a b", "1.2.3", "1.2.3.4/33", "1.2.3.4/24", "x:0", "x:65536", "x:080", "*x.com",
            "a.*.com", "[::1", "[1.2.3.4]:80", "a..b", "-a.com", "host:", ":80", "http://x.org", 5, None]
)
def test_malformed_rules_say_what_a_rule_looks_like(bad):
    with pytest.raises(InvalidArgument, match=r"a rule is a host name \(\"index.example.org\"\)"):
        Egress.allow(bad)


def test_bad_egress_values_are_refused_before_anything_is_forked():
    with pytest.raises(InvalidArgument, match="egress= takes an Egress"):
        eg.coerce(42)
    with pytest.raises(InvalidArgument, match="a rule is"):
        Sandbox("python", client=object(), egress=["not a rule!"])


# --- the policy: what it admits ---------------------------------------------------------------

SPECIAL = ["127.0.0.1", "127.9.9.9", "10.1.2.3", "172.16.0.1", "172.31.255.1", "192.168.1.1", "169.254.169.254",
           "0.0.0.0", "::1", "::", "fd00::1", "fe80::1", "::ffff:127.0.0.1", "::ffff:169.254.169.254",
           # issue 32's gaps: CGNAT (a metadata service lives there), benchmarking, IETF assignments,
           # NAT64 carrying 169.254.169.254, 6to4, IPv4-compatible, IPv4-mapped's block, site-local,
           # discard-only, the IETF IPv6 block, documentation
           "100.64.0.1", "100.100.100.200", "198.18.0.1", "198.19.255.255", "192.0.0.170", "64:ff9b::a9fe:a9fe",
           "2002:a9fe:a9fe::1", "::169.254.169.254", "::a00:1", "fec0::1", "100::1", "2001::1", "2001:db8::1",
           "192.0.2.1", "198.51.100.1", "203.0.113.1", "240.0.0.1", "255.255.255.255", "3fff::1", "5f00::1"]


@pytest.mark.parametrize("addr", SPECIAL)
def test_special_addresses_are_never_reached_by_names_or_internet(addr):
    assert not Egress.internet().admits(addr, 80)
    assert not Egress.allow("metadata.test", "*.test").admits(addr, 80, name="metadata.test")
    # Only an IP or CIDR rule that contains them admits them.
    v4 = ipaddress.ip_address(addr)
    v4 = v4.ipv4_mapped or v4 if v4.version == 6 else v4
    rule = f"[{v4}]:80" if v4.version == 6 else f"{v4}:80"
    assert Egress.allow(rule).admits(addr, 80)
    assert not Egress.allow(rule).admits(addr, 81)


def _special_cases():
    """Each range of the special-purpose table: its first and last address, and the addresses just
    outside it (with the range they must not be blamed on)."""
    cases = []
    for net, name in eg.special_ranges():
        first, last = net.network_address, net.broadcast_address
        cases += [(str(first), f"{net} {name}", True), (str(last), f"{net} {name}", True)]
        if int(first) > 0:
            cases.append((str(first - 1), f"{net} {name}", False))
        if int(last) < (1 << net.max_prefixlen) - 1:
            cases.append((str(last + 1), f"{net} {name}", False))
    return cases


def test_the_special_table_is_the_registries_one_copy():
    ranges = {str(n) for n, _ in eg.special_ranges()}
    # Every entry the issue names (both IANA registries, multicast, site-local), from the one copy.
    for r in ["0.0.0.0/8", "10.0.0.0/8", "100.64.0.0/10", "127.0.0.0/8", "169.254.0.0/16", "172.16.0.0/12",
              "192.0.0.0/24", "192.0.2.0/24", "192.31.196.0/24", "192.52.193.0/24", "192.88.99.0/24",
              "192.168.0.0/16", "192.175.48.0/24", "198.18.0.0/15", "198.51.100.0/24", "203.0.113.0/24",
              "240.0.0.0/4", "255.255.255.255/32", "224.0.0.0/4", "::1/128", "::/128", "::ffff:0:0/96",
              "64:ff9b::/96", "64:ff9b:1::/48", "100::/64", "2001::/23", "2001::/32", "2001:2::/48",
              "2001:db8::/32", "2002::/16", "fc00::/7", "fe80::/10", "fec0::/10", "ff00::/8", "3fff::/20",
              "5f00::/16"]:
        assert r in ranges, r
    assert not hasattr(eg, "SPECIAL_NETS")  # no second, hand-kept copy in Python


@pytest.mark.parametrize("addr,range_,inside", _special_cases())
def test_each_special_range_holds_inside_and_not_just_outside(addr, range_, inside):
    why = eg.special_reason(addr)
    if inside:
        assert why is not None and not Egress.internet().admits(addr, 443), (addr, range_)
    else:
        # Just outside: special only through another range or an IPv4 address it carries.
        assert why is None or not why.endswith(": " + range_), (addr, why)


def test_ipv4_inside_ipv6_is_unwrapped_and_named():
    why = eg.special_reason("64:ff9b::a9fe:a9fe")
    assert why and "64:ff9b::/96" in why
    why = eg.special_reason("::169.254.169.254")
    assert why and "IPv4-compatible" in why and "169.254.0.0/16" in why
    assert eg.special_reason("::8.8.8.8") is None and eg.special_reason("8.8.8.8") is None
    assert not Egress.allow("8.8.0.0/16").narrower_than(Egress.allow("::/0")) and Egress.allow("100.64.0.0/10").narrower_than(
        Egress.allow("100.64.0.0/10"))
    assert not Egress.allow("100.64.0.0/10").narrower_than(Egress.internet())
    assert not Egress.allow("::a00:0/120").narrower_than(Egress.internet())  # ::10.0.0.0/24


def test_public_ranges_and_the_flow_cap_are_checked():
    with pytest.raises(InvalidArgument, match="never public"):
        eg.set_public_ranges(["127.0.0.0/16"])
    with pytest.raises(InvalidArgument, match="never public"):
        eg.set_public_ranges(["169.254.0.0/16"])
    with pytest.raises(InvalidArgument, match="1..=2000"):
        eg.set_max_flows(5000)
    assert eg.max_flows() == 1024


def test_a_name_rule_admits_only_the_engines_own_answers():
    # (11.22.33.9: a public address, never dialled here; TEST-NET ranges are special-purpose)
    p = Egress.allow("index.example.org:443", "*.files.example.net")
    assert not p.admits("11.22.33.9", 443)  # an IP literal under a name-only policy
    assert p.admits("11.22.33.9", 443, name="index.example.org")
    assert not p.admits("11.22.33.9", 80, name="index.example.org")
    assert p.admits("11.22.33.9", 80, name="files.files.example.net")
    assert p.admits_name("a.b.files.example.net") and not p.admits_name("files.example.net")
    assert not p.admits_name("evilfiles.example.net") and not p.admits_name("index.example.org.evil.test")
    assert Egress.internet().admits("11.22.33.9", 1) and not Egress.none().admits("11.22.33.9", 1)


NARROWER = [
    ("a.index.example.org", "*.index.example.org"),
    ("*.a.index.example.org", "*.index.example.org"),
    ("index.example.org:443", "index.example.org"),
    ("203.0.113.0/25", "203.0.113.0/24"),
    ("203.0.113.7:5432", "203.0.113.0/24"),
    ("[2001:db8::1]:443", "2001:db8::/32"),
]


@pytest.mark.parametrize("child,parent", NARROWER)
def test_narrower(child, parent):
    assert Egress.allow(child).narrower_than(Egress.allow(parent))
    assert not Egress.allow(parent).narrower_than(Egress.allow(child))
    Egress.allow(child).check_narrower(Egress.allow(parent))
    with pytest.raises(InvalidArgument, match="may only narrow"):
        Egress.allow(parent).check_narrower(Egress.allow(child))


def test_narrower_with_internet_and_none():
    inet = Egress.internet()
    assert Egress.none().narrower_than(Egress.none())
    assert Egress.none().narrower_than(inet) and not inet.narrower_than(Egress.none())
    assert Egress.allow("x.org", "8.8.8.0/24").narrower_than(inet)
    assert not Egress.allow("10.0.0.0/24").narrower_than(inet)  # private: internet() does not reach it
    assert not Egress.allow("0.0.0.0/0").narrower_than(inet)
    assert (inet | Egress.allow("10.0.0.5:80")).narrower_than(inet | Egress.allow("10.0.0.0/24"))


@settings(max_examples=200, deadline=None)
@given(st.lists(valid_rule(), max_size=4), st.lists(valid_rule(), max_size=4), st.booleans())
def test_narrower_is_sound(a, b, inet):
    """If A is narrower than B, every (address, port, name) A admits, B admits: checked on the
    addresses and names A's own rules name."""
    pa, pb = Egress.allow(*a), Egress(Egress.allow(*b).rules, inet)
    assert pa.narrower_than(pa) and pa.narrower_than(pa | pb)
    if not pa.narrower_than(pb):
        return
    for r in pa.rules:
        ports = [r.port] if r.port is not None else [1, 443, 65535]
        for p in ports:
            if r.kind == "net":
                for addr in (r.net.network_address, r.net.broadcast_address):
                    if pa.admits(str(addr), p):
                        assert pb.admits(str(addr), p), (r, addr, p)
            else:
                n = r.value if r.kind == "name" else "x." + r.value
                assert pb.admits_name(n)
                assert pb.admits("11.22.33.5", p, name=n), (r, n, p)  # a public address


def test_json_form_round_trips():
    p = Egress.allow(*ISSUE_RULES) | Egress.internet()
    assert eg.coerce(p.to_json()) == p
    assert eg.coerce(None) == Egress.none() and eg.coerce("internet") == Egress.internet()
    with pytest.raises(InvalidArgument, match="unknown egress field"):
        eg.coerce({"rules": [], "allow": []})


# --- enforcement: fixtures --------------------------------------------------------------------


class _Body(http.server.BaseHTTPRequestHandler):
    body = b"served from the host's loopback\n"
    hits = 0

    def do_GET(self):
        type(self).hits += 1
        self.send_response(200)
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def http_server():
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Body)
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield srv.server_address[1]
    srv.shutdown()
    srv.server_close()


class DnsServer:
    """A tiny authoritative DNS server on loopback for the broker's upstream: answers A records
    from `zone`, NXDOMAIN otherwise, and records every question."""

    def __init__(self, zone: dict[str, str]):
        self.zone = zone
        self.asked: list[str] = []
        self.sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.sock.bind(("127.0.0.1", 0))
        self.sock.settimeout(0.2)
        self.port = self.sock.getsockname()[1]
        self.stop = False
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self):
        while not self.stop:
            try:
                msg, peer = self.sock.recvfrom(4096)
            except (socket.timeout, OSError):
                continue
            qid, = struct.unpack("!H", msg[:2])
            i, labels = 12, []
            while msg[i]:
                labels.append(msg[i + 1 : i + 1 + msg[i]].decode())
                i += 1 + msg[i]
            qname = ".".join(labels).lower()
            qtype, = struct.unpack("!H", msg[i + 1 : i + 3])
            self.asked.append(qname)
            question = msg[12 : i + 5]
            ip = self.zone.get(qname)
            if ip is None:
                self.sock.sendto(struct.pack("!HHHHHH", qid, 0x8183, 1, 0, 0, 0) + question, peer)
                continue
            answers = b""
            if qtype == 1:
                answers = b"\xc0\x0c" + struct.pack("!HHIH", 1, 1, 30, 4) + socket.inet_aton(ip)
            self.sock.sendto(struct.pack("!HHHHHH", qid, 0x8180, 1, 1 if answers else 0, 0, 0) + question + answers, peer)

    def close(self):
        self.stop = True
        self.thread.join(2)
        self.sock.close()


NETNS_HOST, NETNS_PEER = "203.0.113.1", "203.0.113.2"
NETNS_HOST6, NETNS_PEER6 = "2001:db8:c0::1", "2001:db8:c0::2"
# TEST-NET-3 and IPv6's documentation block are special-purpose (IANA): this file's test network
# is declared public (egress.set_public_ranges) while it exists, as an operator would a lab network.
TEST_PUBLIC = ["203.0.113.0/24", "2001:db8::/32"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


@pytest.fixture(scope="module")
def testnet(tmp_path_factory):
    """A network namespace with an HTTP server at 203.0.113.2 (TEST-NET-3), reached from the host
    over a veth pair: a 'public' address that is nowhere on the internet. The host's end of the
    pair has 203.0.113.1 and 2001:db8:c0::1: addresses of the host that are not loopback."""
    if os.geteuid() != 0 or shutil.which("ip") is None:
        pytest.skip("needs root and iproute2 to create a network namespace (ip netns add)")
    tag = secrets.token_hex(3)
    ns, host_if, peer_if = f"cx-eg-{tag}", f"cxeh{tag}", f"cxep{tag}"
    made = _ip("netns", "add", ns, check=False)
    if made.returncode != 0:
        pytest.skip(f"ip netns add is impossible here: {made.stderr.strip()}")
    server = None
    try:
        _ip("link", "add", host_if, "type", "veth", "peer", "name", peer_if)
        _ip("link", "set", peer_if, "netns", ns)
        _ip("addr", "add", f"{NETNS_HOST}/24", "dev", host_if)
        _ip("addr", "add", f"{NETNS_HOST6}/64", "dev", host_if, "nodad")
        _ip("link", "set", host_if, "up")
        _ip("-n", ns, "addr", "add", f"{NETNS_PEER}/24", "dev", peer_if)
        _ip("-n", ns, "addr", "add", f"{NETNS_PEER6}/64", "dev", peer_if, "nodad")
        _ip("-n", ns, "link", "set", peer_if, "up")
        _ip("-n", ns, "link", "set", "lo", "up")
        root = tmp_path_factory.mktemp("netns-www")
        (root / "index.html").write_bytes(b"served from inside the test network namespace\n")
        server = subprocess.Popen(
            ["ip", "netns", "exec", ns, "/usr/bin/python3", "-m", "http.server", "--bind", NETNS_PEER, "8080",
             "--directory", str(root)],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        for _ in range(100):  # bounded: up to 10 s for the server to listen
            try:
                socket.create_connection((NETNS_PEER, 8080), timeout=0.5).close()
                break
            except OSError:
                time.sleep(0.1)
        else:
            pytest.skip("the HTTP server in the test namespace did not start")
        eg.set_public_ranges(TEST_PUBLIC)
        yield {"ns": ns, "addr": NETNS_PEER, "port": 8080, "host_if": host_if, "host_addr": NETNS_HOST,
               "host_addr6": NETNS_HOST6}
    finally:
        eg.set_public_ranges([])
        if server is not None:
            server.kill()
            server.wait(5)
        _ip("link", "del", host_if, check=False)
        _ip("netns", "del", ns, check=False)


@pytest.fixture(scope="module")
def dns(testnet):
    server = DnsServer({"pkg.test": testnet["addr"], "loop.test": "127.0.0.1", "meta.test": "169.254.169.254",
                        "rebind.test": testnet["host_addr"],
                        "a.tls.test": testnet["addr"], "b.tls.test": testnet["addr"]})
    eg.set_resolver(f"dns:127.0.0.1:{server.port}")
    yield server
    eg.set_resolver("system")
    server.close()


@pytest.fixture(scope="module")
def client():
    c = EmbeddedClient()
    yield c
    c.close()


def fetch(url: str, timeout: float = 10) -> str:
    """Guest code: GET `url`, print the body or the error's errno/class."""
    return (
        "import urllib.request, socket\n"
        "try:\n"
        f"    print(urllib.request.urlopen({url!r}, timeout={timeout}).read().decode(), end='')\n"
        "except Exception as e:\n"
        "    r = getattr(e, 'reason', e)\n"
        "    print('ERR', type(r).__name__, getattr(r, 'errno', None))\n"
    )


def run(sb, code: str) -> str:
    r = sb.exec(code=code, timeout_seconds=60)
    assert r.ok, r.stderr
    return r.stdout


# --- enforcement ------------------------------------------------------------------------------


@kvm
def test_default_is_no_network_and_the_denial_is_logged(client, http_server):
    with Sandbox("python", client=client) as sb:
        assert sb.egress == Egress.none()
        out = run(sb, fetch(f"http://127.0.0.1:{http_server}/"))
        assert out == f"ERR ConnectionRefusedError {errno.ECONNREFUSED}\n"
        (entry,) = sb.egress_log()
        assert entry["kind"] == "connect" and entry["verdict"] == "denied" and entry["rule"] is None
        assert (entry["address"], entry["port"]) == ("127.0.0.1", http_server)
        assert entry["pid"] >= 1 and entry["time"] > 0


@kvm
def test_an_explicit_ip_rule_admits_a_loopback_server(client, http_server):
    before = client.usage()
    hits = _Body.hits
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{http_server}")) as sb:
        assert run(sb, fetch(f"http://127.0.0.1:{http_server}/")) == _Body.body.decode()
        assert _Body.hits == hits + 1  # the server's own count agrees
        # Another port of loopback stays closed.
        assert "ConnectionRefusedError" in run(sb, fetch(f"http://127.0.0.1:{http_server + 1 if http_server < 65535 else 1}/"))
        log = sb.egress_log()
        ok = [e for e in log if e["verdict"] == "allowed"]
        assert len(ok) == 1 and ok[0]["rule"] == f"127.0.0.1:{http_server}" and not ok[0]["open"]
        assert ok[0]["bytes_out"] > 50 and ok[0]["bytes_in"] > len(_Body.body)
        assert [e["verdict"] for e in log].count("denied") == 1
        live = client.usage()
        assert live.egress_bytes_in - before.egress_bytes_in >= ok[0]["bytes_in"]
    after = client.usage()
    assert after.egress_bytes_out - before.egress_bytes_out == ok[0]["bytes_out"]
    assert after.egress_bytes_in - before.egress_bytes_in == ok[0]["bytes_in"]


@kvm
def test_internet_does_not_reach_loopback_or_metadata(client, http_server):
    with Sandbox("python", client=client, egress=Egress.internet()) as sb:
        assert "ConnectionRefusedError" in run(sb, fetch(f"http://127.0.0.1:{http_server}/"))
        assert "ConnectionRefusedError" in run(sb, fetch("http://169.254.169.254/latest/meta-data/", 3))
        assert "ConnectionRefusedError" in run(sb, fetch(f"http://[::1]:{http_server}/"))
        assert all(e["verdict"] == "denied" for e in sb.egress_log())


@kvm
def test_a_name_rule_resolved_by_the_broker_reaches_the_test_network(client, dns, testnet):
    url = f"http://pkg.test:{testnet['port']}/index.html"
    with Sandbox("python", client=client, egress=Egress.allow(f"pkg.test:{testnet['port']}")) as sb:
        assert run(sb, fetch(url)) == "served from inside the test network namespace\n"
        log = sb.egress_log()
        answers = [e for e in log if e["kind"] == "dns" and e["verdict"] == "allowed"]
        assert answers and answers[0]["name"] == "pkg.test" and testnet["addr"] in answers[0]["detail"]
        (flow,) = [e for e in log if e["kind"] == "connect"]
        assert (flow["name"], flow["address"], flow["rule"], flow["verdict"]) == (
            "pkg.test", testnet["addr"], f"pkg.test:{testnet['port']}", "allowed")
        # The same address as an IP literal: a guest-chosen IP never satisfies a name rule.
        out = run(sb, fetch(f"http://{testnet['addr']}:{testnet['port']}/index.html"))
        # (it was answered for pkg.test in this sandbox, so only the port decides here)
        assert out == "served from inside the test network namespace\n"
    with Sandbox("python", client=client, egress=Egress.allow(f"pkg.test:{testnet['port']}")) as sb:
        # A fresh sandbox that never asked for pkg.test: the literal is refused.
        out = run(sb, fetch(f"http://{testnet['addr']}:{testnet['port']}/index.html"))
        assert out == f"ERR ConnectionRefusedError {errno.ECONNREFUSED}\n"


@kvm
def test_internet_reaches_a_public_test_address(client, testnet):
    with Sandbox("python", client=client, egress=Egress.internet()) as sb:
        out = run(sb, fetch(f"http://{testnet['addr']}:{testnet['port']}/index.html"))
        assert out == "served from inside the test network namespace\n"
        assert sb.egress_log()[-1]["rule"] == "internet()"


@kvm
def test_names_resolving_to_private_addresses_are_withheld(client, dns, http_server):
    with Sandbox("python", client=client, egress=Egress.allow("loop.test", "meta.test")) as sb:
        code = (
            "import socket\n"
            "for n in ['loop.test', 'meta.test']:\n"
            "    try:\n"
            "        print(n, socket.getaddrinfo(n, 80, socket.AF_INET, socket.SOCK_STREAM))\n"
            "    except socket.gaierror as e:\n"
            "        print(n, 'gaierror')\n"
        )
        assert run(sb, code) == "loop.test gaierror\nmeta.test gaierror\n"
        assert "withheld" in " ".join(e["detail"] for e in sb.egress_log())
        # and the loopback server stays out of reach by its address too
        assert "ConnectionRefusedError" in run(sb, fetch(f"http://127.0.0.1:{http_server}/"))


@kvm
def test_names_not_admitted_are_nxdomain_and_no_query_leaves(client, dns, testnet):
    secret = "exfil-" + secrets.token_hex(6) + ".pkg.test"
    with Sandbox("python", client=client, egress=Egress.allow("pkg.test")) as sb:
        code = (
            "import socket\n"
            f"for n in [{secret!r}, 'elsewhere.test', 'pkg.test']:\n"
            "    try:\n"
            "        print(n, sorted({a[4][0] for a in socket.getaddrinfo(n, 80)}))\n"
            "    except socket.gaierror as e:\n"
            "        print(n, 'gaierror', e.errno == socket.EAI_NONAME)\n"
        )
        out = run(sb, code).splitlines()
        assert out == [f"{secret} gaierror True", "elsewhere.test gaierror True", f"pkg.test ['{testnet['addr']}']"]
        nx = {e["name"] for e in sb.egress_log() if e["verdict"] == "nxdomain"}
        assert {secret, "elsewhere.test"} <= nx and "pkg.test" not in nx
    # No packet left for the names the policy does not admit: the upstream server never saw them.
    assert secret not in dns.asked and "elsewhere.test" not in dns.asked
    assert "pkg.test" in dns.asked


@kvm
def test_udp_beyond_dns_raw_and_packet_sockets_are_refused(client):
    with Sandbox("python", client=client, egress=Egress.internet()) as sb:
        code = (
            "import socket\n"
            "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
            "for call in (lambda: u.sendto(b'x', ('203.0.113.2', 9)), lambda: u.connect(('203.0.113.2', 9))):\n"
            "    try:\n"
            "        call(); print('sent')\n"
            "    except OSError as e:\n"
            "        print(e.errno)\n"
            "for fam, ty in ((socket.AF_INET, socket.SOCK_RAW), (socket.AF_PACKET, socket.SOCK_RAW)):\n"
            "    try:\n"
            "        socket.socket(fam, ty, 0); print('made')\n"
            "    except OSError as e:\n"
            "        print(e.errno)\n"
        )
        assert run(sb, code).split() == [str(errno.ENETUNREACH), str(errno.ENETUNREACH), str(errno.EPERM), str(errno.EAFNOSUPPORT)]


@pytest.fixture
def udp_echo():
    """A UDP echo server on loopback that counts the datagrams it gets (bounded: it stops with the test)."""
    sock = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    sock.bind(("127.0.0.1", 0))
    sock.settimeout(0.2)
    got: list[bytes] = []
    stop = threading.Event()

    def serve():
        while not stop.is_set():
            try:
                data, peer = sock.recvfrom(65536)
            except (socket.timeout, OSError):
                continue
            got.append(data)
            sock.sendto(b"echo:" + data, peer)

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    yield sock.getsockname()[1], got
    stop.set()
    t.join(2)
    sock.close()


UDP_CODE = (
    "import socket\n"
    "u = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); u.settimeout(10)\n"
    "u.sendto(b'one', ('127.0.0.1', {port}))\n"
    "data, src = u.recvfrom(100); print(data.decode(), src == ('127.0.0.1', {port}))\n"
    "c = socket.socket(socket.AF_INET, socket.SOCK_DGRAM); c.settimeout(10)\n"
    "c.connect(('127.0.0.1', {port})); c.send(b'two'); print(c.recv(100).decode(), c.getpeername()[1] == {port})\n"
    "for call in (lambda: u.sendto(b'x', ('127.0.0.1', {other})), lambda: c.connect(('203.0.113.2', 9))):\n"
    "    try:\n"
    "        call(); print('sent')\n"
    "    except OSError as e:\n"
    "        print(e.errno)\n"
)


@kvm
def test_udp_under_a_rule_naming_its_port_reaches_a_loopback_echo_server(client, udp_echo):
    port, got = udp_echo
    other = port + 1 if port < 65535 else port - 1
    code = UDP_CODE.format(port=port, other=other)
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{port}")) as sb:
        assert run(sb, code).split("\n") == ["echo:one True", "echo:two True", str(errno.ENETUNREACH), str(errno.ENETUNREACH), ""]
        assert got == [b"one", b"two"]  # the server's own count agrees
        log = [e for e in sb.egress_log() if e["kind"] == "udp"]
        assert [(e["verdict"], e["port"]) for e in log] == [("allowed", port), ("allowed", port), ("denied", other), ("denied", 9)]
        assert log[0]["rule"] == f"127.0.0.1:{port}" and "needs a rule with a port" in log[2]["detail"]
    # A rule without a port is for TCP: it does not admit UDP to that address.
    with Sandbox("python", client=client, egress=Egress.allow("127.0.0.1")) as sb:
        out = run(sb, "import socket\nu = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)\n"
                      "try:\n    u.sendto(b'x', ('127.0.0.1', %d)); print('sent')\nexcept OSError as e:\n    print(e.errno)\n" % port)
        assert out == f"{errno.ENETUNREACH}\n"
    assert got == [b"one", b"two"]


class _Echo(socketserver.BaseRequestHandler):
    def handle(self):
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass


@contextlib.contextmanager
def tcp_server(handler):
    """A threading TCP server on loopback with `handler`, serving in a thread: yields its port."""
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), handler)
    srv.daemon_threads = True
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    try:
        yield srv.server_address[1]
    finally:
        srv.shutdown()
        srv.server_close()


@pytest.fixture(scope="module")
def echo_server():
    with tcp_server(_Echo) as port:
        yield port


OPEN_ECHO = (
    "import socket\n"
    "s = socket.create_connection(('127.0.0.1', {port}), timeout=10)\n"
    "s.sendall(b'ping'); print(s.recv(4).decode())\n"
)
USE_ECHO = (
    "try:\n"
    "    s.sendall(b'again'); d = s.recv(5)\n"
    "    print(d.decode() if d else 'EOF')\n"
    "except OSError as e:\n"
    "    print('ERR', type(e).__name__)\n"
)


RECV_FIRST = (
    "for call in (lambda: s.recv(5), lambda: s.recv(5), lambda: s.sendall(b'x')):\n"
    "    try:\n"
    "        d = call()\n"
    "        print('EOF' if d == b'' else d)\n"
    "    except OSError as e:\n"
    "        print('ERR', type(e).__name__)\n"
)


@kvm
def test_set_egress_resets_the_connections_it_forbids(client, echo_server):
    rule = f"127.0.0.1:{echo_server}"
    with Sandbox("python", client=client, egress=Egress.allow(rule, "pkg.test")) as sb:
        assert run(sb, OPEN_ECHO.format(port=echo_server)) == "ping\n"
        sb.set_egress(Egress.allow(rule))  # still admitted: the connection lives on
        assert run(sb, USE_ECHO) == "again\n"
        sb.set_egress(Egress.allow("pkg.test"))
        assert sb.egress == Egress.allow("pkg.test")
        assert run(sb, USE_ECHO) == "ERR ConnectionResetError\n"
        flow = [e for e in sb.egress_log() if e["kind"] == "connect"][0]
        assert (flow["verdict"], flow["bytes_out"], flow["bytes_in"]) == ("reset", 9, 9)  # ping + again, echoed
        # and a new connection is refused
        out = sb.exec(code=OPEN_ECHO.format(port=echo_server), timeout_seconds=30)
        assert not out.ok and "ConnectionRefusedError" in out.stderr


@kvm
def test_fork_group_inherits_narrows_and_cannot_widen(client, http_server, echo_server):
    parent_policy = Egress.allow(f"127.0.0.1:{http_server}", f"127.0.0.1:{echo_server}")
    with Sandbox("python", client=client, egress=parent_policy) as sb:
        assert run(sb, OPEN_ECHO.format(port=echo_server)) == "ping\n"  # a connection the forks inherit
        live_before = client.usage().live_sandboxes
        with pytest.raises(InvalidArgument, match="may only narrow"):
            sb.fork_group(2, egress=Egress.internet())
        with pytest.raises(InvalidArgument, match="may only narrow"):
            sb.fork_group(2, egress=Egress.allow("127.0.0.0/8"))
        assert client.usage().live_sandboxes == live_before  # nothing was forked
        with sb.fork_group(2) as g:
            for child in g:
                assert child.egress == parent_policy
                assert run(child, fetch(f"http://127.0.0.1:{http_server}/")) == _Body.body.decode()
                # The parent's connection is not shared: it reads as reset in the child.
                assert run(child, USE_ECHO) == "ERR ConnectionResetError\n"
        assert run(sb, USE_ECHO) == "again\n"  # and the parent's still works
        with sb.fork_group(1) as g:
            # Whichever call comes first reports the reset (a receive here), as after a RST; then
            # the socket is at its end, and the parent's connection is untouched.
            assert run(g[0], RECV_FIRST) == "ERR ConnectionResetError\nEOF\nERR BrokenPipeError\n"
        assert run(sb, USE_ECHO) == "again\n"
        with sb.fork_group(2, egress=Egress.allow(f"127.0.0.1:{echo_server}")) as g:
            for child in g:
                assert child.egress == Egress.allow(f"127.0.0.1:{echo_server}")
                assert "ConnectionRefusedError" in run(child, fetch(f"http://127.0.0.1:{http_server}/"))
            # Policies are copied, never shared: changing one child changes nothing else.
            g[0].set_egress(Egress.none())
            assert run(g[1], OPEN_ECHO.format(port=echo_server)) == "ping\n"
        assert run(sb, fetch(f"http://127.0.0.1:{http_server}/")) == _Body.body.decode()


@kvm
def test_session_and_rollout_once_take_egress(client, http_server):
    from collimate_core import rollout_once

    r = rollout_once("python", code=fetch(f"http://127.0.0.1:{http_server}/"), client=client,
                     egress=Egress.allow(f"127.0.0.1:{http_server}"))
    assert r.stdout == _Body.body.decode()
    r = rollout_once("python", code=fetch(f"http://127.0.0.1:{http_server}/"), client=client)
    assert "ConnectionRefusedError" in r.stdout
    with client.session("python", egress=Egress.allow(f"127.0.0.1:{http_server}")) as sess:
        assert run(sess, fetch(f"http://127.0.0.1:{http_server}/")) == _Body.body.decode()


@kvm
def test_a_recycled_sandbox_keeps_nothing_of_its_last_owners_network(client, http_server):
    for _ in range(3):  # bounded: enough for the pool to hand a recycled clone back
        with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{http_server}")) as sb:
            run(sb, fetch(f"http://127.0.0.1:{http_server}/"))
        time.sleep(0.2)
        with Sandbox("python", client=client) as sb:
            assert sb.egress_log() == []
            assert "ConnectionRefusedError" in run(sb, fetch(f"http://127.0.0.1:{http_server}/"))


@kvm
def test_flows_and_broker_registrations_do_not_leak(http_server):
    c = EmbeddedClient()
    try:
        with Sandbox("python", client=c) as warm:
            run(warm, "print(1)")
        base_fds = len(os.listdir("/proc/self/fd"))
        base_reg = _core._egress_broker_sandboxes()
        for i in range(6):  # live flows, and flows relayed by a recording (record=True)
            with Sandbox("python", client=c, egress=Egress.allow(f"127.0.0.1:{http_server}", record=i % 2 == 1)) as sb:
                run(sb, fetch(f"http://127.0.0.1:{http_server}/") + "import socket\nkeep = socket.create_connection(('127.0.0.1', %d))\n" % http_server)
    finally:
        c.close()
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and (
        len(os.listdir("/proc/self/fd")) > base_fds or _core._egress_broker_sandboxes() > base_reg
    ):
        time.sleep(0.05)
    assert len(os.listdir("/proc/self/fd")) <= base_fds
    assert _core._egress_broker_sandboxes() <= base_reg


# --- over HTTP: the server's ceiling ------------------------------------------------------------


@pytest.fixture(scope="module")
def ceiling_server(tmp_path_factory, http_server, echo_server):
    """`collimate serve --egress-ceiling` admitting the loopback HTTP server's port only."""
    if not HAVE_KVM:
        pytest.skip("needs /dev/kvm and COLLIMATE_ROOTFS")
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from test_http import Server, _cli

    store = tmp_path_factory.mktemp("egress-keys") / "keys.json"
    key = _cli("keys", "--key-store", str(store), "create", "--tenant", "carol").strip()
    ceiling = f"127.0.0.1:{http_server},127.0.0.1:{echo_server},pkg.test"
    srv = Server(tmp_path_factory.mktemp("egress-srv"), store, "--egress-ceiling", ceiling, "--preload", "python")
    yield srv, key
    srv.stop()


@kvm
def test_over_http_the_ceiling_holds_and_flows_are_logged(ceiling_server, http_server, echo_server):
    import httpx

    from collimate_core import RemoteClient

    srv, key = ceiling_server
    h = {"Authorization": f"Bearer {key}"}
    with RemoteClient(key, srv.url) as rc:
        # Wider than the ceiling: a clear 403, and no sandbox.
        for wide in ({"internet": True}, {"rules": ["127.0.0.0/8"]}, {"rules": ["*.test"]}):
            r = httpx.post(f"{srv.url}/v1/sandboxes", json={"template": "python", "egress": wide}, headers=h, timeout=60)
            assert r.status_code == 403, r.text
            assert "--egress-ceiling" in r.json()["error"]["message"]
        assert rc.sandboxes() == []
        r = httpx.post(f"{srv.url}/v1/sandboxes", json={"egress": {"rules": ["not a rule"]}}, headers=h, timeout=60)
        assert r.status_code == 400 and "a rule is a host name" in r.json()["error"]["message"]
        with pytest.raises(InvalidArgument, match="egress-ceiling"):
            Sandbox("python", client=rc, egress=Egress.internet()).start()
        # Within it: the same SDK surface as the embedded engine.
        with Sandbox("python", client=rc, egress=Egress.allow(f"127.0.0.1:{http_server}", f"127.0.0.1:{echo_server}")) as sb:
            assert run(sb, fetch(f"http://127.0.0.1:{http_server}/")) == _Body.body.decode()
            info = httpx.get(f"{srv.url}/v1/sandboxes/{sb.session_id}", headers=h, timeout=30).json()
            assert sorted(info["egress"]["rules"]) == sorted([f"127.0.0.1:{http_server}", f"127.0.0.1:{echo_server}"])
            log = sb.egress_log()
            assert [e["verdict"] for e in log] == ["allowed"] and log[0]["bytes_in"] > 0
            # Fork groups narrow and cannot widen, over HTTP too (checked by the client and the server).
            with pytest.raises(InvalidArgument, match="may only narrow"):
                sb.fork_group(2, egress=Egress.allow("pkg.test"))
            r = httpx.post(f"{srv.url}/v1/sandboxes/{sb.session_id}/fork_group",
                           json={"width": 2, "egress": {"rules": ["pkg.test"]}}, headers=h, timeout=60)
            assert r.status_code == 400 and "may only narrow" in r.text
            with sb.fork_group(2, egress=Egress.allow(f"127.0.0.1:{echo_server}")) as g:
                for child in g:
                    assert child.egress == Egress.allow(f"127.0.0.1:{echo_server}")
                    assert "ConnectionRefusedError" in run(child, fetch(f"http://127.0.0.1:{http_server}/"))
            # set_egress over HTTP: within the ceiling only; it resets what it forbids.
            assert run(sb, OPEN_ECHO.format(port=echo_server)) == "ping\n"
            with pytest.raises(InvalidArgument, match="egress-ceiling"):
                sb.set_egress(Egress.internet())
            sb.set_egress(Egress.allow(f"127.0.0.1:{http_server}"))
            assert run(sb, USE_ECHO) == "ERR ConnectionResetError\n"
            sid = sb.session_id
        usage = rc.usage()
        assert usage.egress_bytes_in > len(_Body.body) and usage.egress_bytes_out > 0
    # Each flow is a JSON line of the server's log.
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not [e for e in srv.events() if e.get("event") == "egress" and e.get("sandbox") == sid and e.get("verdict") == "reset"]:
        time.sleep(0.1)
    flows = [e for e in srv.events() if e.get("event") == "egress" and e.get("sandbox") == sid]
    assert {f["verdict"] for f in flows} == {"allowed", "reset"}
    assert all({"time", "pid", "address", "port", "rule", "bytes_out", "bytes_in"} <= f.keys() for f in flows)


@kvm
def test_over_http_record_and_replay(ceiling_server, http_server):
    from collimate_core import RemoteClient

    srv, key = ceiling_server
    seed = secrets.token_hex(32)
    pol = Egress.allow(f"127.0.0.1:{http_server}", record=True)
    with RemoteClient(key, srv.url) as rc:
        hits = _Body.hits
        outs = []
        for _ in range(2):
            with Sandbox("python", client=rc, egress=pol) as sb:
                assert sb.egress == pol
                r = sb.exec(code=fetch(f"http://127.0.0.1:{http_server}/"), seed=seed, timeout_seconds=60)
                outs.append((r.stdout, r.egress_replay, [e["verdict"] for e in sb.egress_log()]))
        assert outs == [(_Body.body.decode(), "recorded", ["allowed"]), (_Body.body.decode(), "replayed", ["replayed"])]
        assert _Body.hits == hits + 1  # the replay reached no server


@kvm
def test_the_async_twin_takes_the_same_parameters(client, http_server, echo_server):
    import asyncio

    from collimate_core import aio

    async def main():
        ac = aio.AsyncClient(client)
        pol = Egress.allow(f"127.0.0.1:{http_server}", f"127.0.0.1:{echo_server}")
        async with aio.Sandbox("python", client=ac, egress=pol) as sb:
            assert sb.egress == pol
            r = await sb.exec(code=fetch(f"http://127.0.0.1:{http_server}/"))
            assert r.stdout == _Body.body.decode()
            async with sb.fork_group(2, egress=Egress.allow(f"127.0.0.1:{echo_server}")) as g:
                r = await g[0].exec(code=fetch(f"http://127.0.0.1:{http_server}/"))
                assert "ConnectionRefusedError" in r.stdout
            await sb.set_egress(Egress.none())
            assert [e["verdict"] for e in await sb.egress_log()] == ["allowed"]
        r = await aio.rollout_once("python", code=fetch(f"http://127.0.0.1:{http_server}/"), client=ac,
                                   egress=Egress.allow(f"127.0.0.1:{http_server}"))
        assert r.stdout == _Body.body.decode()
        async with ac.session("python", egress=Egress.allow(f"127.0.0.1:{http_server}")) as s:
            assert (await s.exec(code=fetch(f"http://127.0.0.1:{http_server}/"))).stdout == _Body.body.decode()

    asyncio.run(main())


@kvm
def test_bake_with_egress_installs_and_its_sandboxes_start_with_none(tmp_path_factory, http_server):
    """Template.bake(egress=...) is for the bake and its Ready step: Ready fetches from the loopback
    server (as a package install would from an index); the template's sandboxes have no network."""
    import sys

    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from imagefixtures import Layer, write_oci_layout

    from collimate_core import Ready, Template

    cache = tmp_path_factory.mktemp("egress-bake")
    store = cache / "images"
    store.mkdir()
    base = Layer().tree(Path(os.environ["COLLIMATE_ROOTFS"]), skip=(".collimate-rootfs.json",)).bytes()
    write_oci_layout(store / "netapp", [base], {"Env": ["PATH=/usr/bin:/bin"], "WorkingDir": "/work"}, ref_name="1.0")
    install = (
        "import urllib.request\n"
        f"open('/work/installed.txt', 'wb').write(urllib.request.urlopen('http://127.0.0.1:{http_server}/', timeout=10).read())\n"
    )
    c = EmbeddedClient(cache=cache)
    try:
        failed = Template.bake(c, name="offline", image="netapp:1.0", ready=Ready(code=install)).wait(600)
        assert failed.phase == "Failed" and "Ready(code=...)" in (failed.error or "")
        st = Template.bake(c, name="online", image="netapp:1.0", ready=Ready(code=install),
                           egress=Egress.allow(f"127.0.0.1:{http_server}")).wait(600)
        assert st.phase == "Live", st.log
        assert "egress: connect" in st.log and "allowed" in st.log
        with Sandbox("online", client=c) as sb:
            assert sb.download("/work/installed.txt") == _Body.body
            assert sb.egress == Egress.none()
            assert "ConnectionRefusedError" in run(sb, fetch(f"http://127.0.0.1:{http_server}/"))
    finally:
        c.close()


@kvm
def test_socket_options_set_before_connect_reach_the_real_socket(client, echo_server):
    code = (
        "import socket\n"
        "s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)\n"
        "s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)\n"
        "s.setsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE, 1)\n"
        "s.settimeout(10)\n"
        f"s.connect(('127.0.0.1', {echo_server}))\n"
        "print(s.getsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY) != 0,\n"
        "      s.getsockopt(socket.SOL_SOCKET, socket.SO_KEEPALIVE) != 0,\n"
        "      s.getsockopt(socket.SOL_SOCKET, socket.SO_TYPE) == socket.SOCK_STREAM,\n"
        "      s.family == socket.AF_INET, s.getpeername() == ('127.0.0.1', %d),\n"
        "      s.getsockname()[0])\n"
        "s.sendall(b'hi'); print(s.recv(2)); s.shutdown(socket.SHUT_WR); print(s.recv(1)); s.close()\n"
    ) % echo_server
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{echo_server}")) as sb:
        assert run(sb, code) == "True True True True True 127.0.0.1\nb'hi'\nb''\n"


# --- record and replay --------------------------------------------------------------------------


class _Counting(http.server.BaseHTTPRequestHandler):
    """Answers each request with its own number: a live second request could never repeat the first."""

    requests: list[str] = []

    def do_GET(self):
        type(self).requests.append(self.path)
        body = f"answer {len(self.requests)} to {self.path}\n".encode()
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


RECORDED = (
    "import random, urllib.request\n"
    "path = '/item/%d' % random.getrandbits(32)\n"  # the seed decides what the guest sends
    "print(urllib.request.urlopen('http://127.0.0.1:{port}' + path, timeout=10).read().decode(), end='')\n"
)


@kvm
def test_a_recorded_exec_replays_from_the_recording_and_a_divergence_is_reset(client, tmp_path):
    _Counting.requests = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    seed = secrets.token_hex(32)
    policy = Egress.allow(f"127.0.0.1:{port}", record=True)
    code = RECORDED.format(port=port)
    try:
        with Sandbox("python", client=client, egress=policy) as sb:
            first = sb.exec(code=code, seed=seed, timeout_seconds=60)
            assert first.ok, first.stderr
            assert first.egress_replay == "recorded" and first.egress_error == ""
            (flow,) = [e for e in sb.egress_log() if e["kind"] == "connect"]
            assert flow["verdict"] == "allowed" and flow["detail"] == "recorded"
        assert len(_Counting.requests) == 1 and first.stdout == f"answer 1 to {_Counting.requests[0]}\n"
    finally:
        srv.shutdown()
        srv.server_close()  # the server is gone: a replay that dialled would be refused
    for _ in range(2):  # a fresh sandbox of the same template, the same seed: served from the recording
        with Sandbox("python", client=client, egress=policy) as sb:
            again = sb.exec(code=code, seed=seed, timeout_seconds=60)
            assert again.ok, again.stderr
            assert (again.stdout, again.egress_replay, again.egress_error) == (first.stdout, "replayed", "")
            (flow,) = [e for e in sb.egress_log() if e["kind"] == "connect"]
            assert flow["verdict"] == "replayed" and flow["bytes_in"] > len(first.stdout)
    assert len(_Counting.requests) == 1  # the server saw no new request
    # Changed code with the same seed: it sends other bytes than the recording has, and is reset.
    changed = code.replace("'/item/%d'", "'/other/%d'")
    with Sandbox("python", client=client, egress=policy) as sb:
        r = sb.exec(code=changed, seed=seed, timeout_seconds=60)
        assert not r.ok and "ConnectionResetError" in r.stderr, r.stderr
        assert r.egress_replay == "diverged" and "different bytes than the recording at byte 5" in r.egress_error
        assert "replay diverged" in r.note
        (flow,) = [e for e in sb.egress_log() if e["kind"] == "connect"]
        assert flow["verdict"] == "diverged" and "different bytes" in flow["detail"]
    assert len(_Counting.requests) == 1
    # Without record=True the same exec goes to the network (and the server is gone).
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{port}")) as sb:
        r = sb.exec(code=code, seed=seed, timeout_seconds=60)
        assert "ConnectionRefusedError" in r.stderr and r.egress_replay == ""


def test_record_is_part_of_the_policy_value():
    p = Egress.allow("127.0.0.1:80", record=True)
    assert p.record and p != Egress.allow("127.0.0.1:80") and "record=True" in str(p)
    assert eg.coerce(p.to_json()) == p and p.to_json()["record"] is True
    assert "record" not in Egress.allow("127.0.0.1:80").to_json()
    assert Egress.allow("127.0.0.1:80").narrower_than(p) and p.narrower_than(Egress.allow("127.0.0.0/8"))
    with pytest.raises(InvalidArgument, match="record= is True or False"):
        Egress.allow("x.org", record="yes")


NONBLOCKING_CONNECT = (
    "import errno, select, socket\n"
    "def attempt(port, poller, again=False):\n"
    "    s = socket.socket(); s.setblocking(False)\n"
    "    err = s.connect_ex(('127.0.0.1', port))\n"
    # Asked again at once: still under way (EALREADY) or done (EISCONN). (After a failure Linux
    # reports the error to that second connect and SO_ERROR is then 0: not asked for those.)
    "    again = s.connect_ex(('127.0.0.1', port)) if again else errno.EALREADY\n"
    "    if poller == 'select':\n"
    "        _, w, _ = select.select([], [s], [], 10); ready = bool(w)\n"
    "    else:\n"
    "        p = select.epoll(); p.register(s, select.EPOLLOUT); ready = bool(p.poll(10))\n"
    "    so = s.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)\n"
    "    out = [errno.errorcode.get(err, err), errno.errorcode.get(again, again) in ('EALREADY', 'EISCONN'),\n"
    "           ready, errno.errorcode.get(so, so)]\n"
    "    if so == 0:\n"
    "        s.setblocking(True); s.sendall(b'nb'); out.append(s.recv(2).decode())\n"
    "    print(*out)\n"
    "attempt({port}, 'select', True); attempt({port}, 'epoll'); attempt({closed}, 'select'); attempt({denied}, 'epoll')\n"
)


@kvm
def test_a_non_blocking_connect_answers_einprogress_and_completes_by_poll(client, echo_server):
    """The guest is not held for the broker's dial: EINPROGRESS, then select/epoll for POLLOUT and
    SO_ERROR give the outcome (0, ECONNREFUSED from the dial, ECONNREFUSED from the policy)."""
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    closed = probe.getsockname()[1]  # bound, never listening: a dial to it is refused
    try:
        denied = closed + 1 if closed < 65535 else closed - 1
        pol = Egress.allow(f"127.0.0.1:{echo_server}", f"127.0.0.1:{closed}")
        with Sandbox("python", client=client, egress=pol) as sb:
            out = run(sb, NONBLOCKING_CONNECT.format(port=echo_server, closed=closed, denied=denied)).splitlines()
            assert out == ["EINPROGRESS True True 0 nb", "EINPROGRESS True True 0 nb",
                           "EINPROGRESS True True ECONNREFUSED", "EINPROGRESS True True ECONNREFUSED"], out
            verdicts = [e["verdict"] for e in sb.egress_log() if e["kind"] == "connect"]
            assert verdicts == ["allowed", "allowed", "failed", "denied"]
        # Outside replay mode (an engine-level call without a seed, as a bake's Ready step runs)
        # the connect's end is taken when its reply has come, never waited for at the first look.
        from collimate_core.templates.catalog import frame

        box = client.create("python", egress=pol)
        try:
            r = box.vm.agent_call(frame({"op": "exec", "code": NONBLOCKING_CONNECT.format(port=echo_server, closed=closed, denied=denied)}), 60.0)
            assert r.stdout.decode().splitlines() == out, r.stderr
        finally:
            client.destroy(box)
    finally:
        probe.close()


@kvm
def test_https_replays_byte_exact_from_its_recording(client, tmp_path):
    """TLS: the guest's handshake draws its randomness from the seeded CRNG and reads virtual clocks,
    so a replay sends the same ClientHello, key share and Finished again, and the recorded server
    flight decrypts as before: the same page with the server gone."""
    import ssl

    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=tls.test"],
                   check=True, capture_output=True)
    ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    ctx.load_cert_chain(cert, key)
    _Counting.requests = []
    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Counting)
    srv.socket = ctx.wrap_socket(srv.socket, server_side=True)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    code = (
        "import random, ssl, urllib.request\n"
        "ctx = ssl.create_default_context(); ctx.check_hostname = False; ctx.verify_mode = ssl.CERT_NONE\n"
        f"url = 'https://127.0.0.1:{port}/secret/%d' % random.getrandbits(32)\n"
        "print(urllib.request.urlopen(url, context=ctx, timeout=10).read().decode(), end='')\n"
    )
    seed = secrets.token_hex(32)
    policy = Egress.allow(f"127.0.0.1:{port}", record=True)
    try:
        with Sandbox("python", client=client, egress=policy) as sb:
            first = sb.exec(code=code, seed=seed, timeout_seconds=60)
        assert first.ok and first.egress_replay == "recorded", first.stderr
        assert first.stdout.startswith("answer 1 to /secret/")
    finally:
        srv.shutdown()
        srv.server_close()
    with Sandbox("python", client=client, egress=policy) as sb:
        again = sb.exec(code=code, seed=seed, timeout_seconds=60)
    assert (again.stdout, again.egress_replay, again.egress_error) == (first.stdout, "replayed", ""), again.stderr
    assert len(_Counting.requests) == 1


@kvm
def test_an_exec_that_times_out_leaves_no_recording(client, http_server):
    seed = secrets.token_hex(32)
    policy = Egress.allow(f"127.0.0.1:{http_server}", record=True)
    spin = fetch(f"http://127.0.0.1:{http_server}/") + "while True:\n    pass\n"
    with Sandbox("python", client=client, egress=policy) as sb:
        r = sb.exec(code=spin, seed=seed, timeout_seconds=2)
        assert r.timed_out and r.egress_replay == "" and "was not saved" in r.egress_error
    with Sandbox("python", client=client, egress=policy) as sb:  # same state and seed: records anew
        r = sb.exec(code=fetch(f"http://127.0.0.1:{http_server}/"), seed=seed, timeout_seconds=60)
        assert (r.stdout, r.egress_replay) == (_Body.body.decode(), "recorded")


# --- resets, UDP recordings, and a connect racing a policy change --------------------------------


class _ResetAfter(socketserver.BaseRequestHandler):
    """Reads b'hello', answers b'part', reads b'more', then resets the connection (SO_LINGER 0)."""

    connections = 0

    def handle(self):
        type(self).connections += 1
        s = self.request
        got = b""
        while len(got) < 5 and (d := s.recv(5 - len(got))):
            got += d
        s.sendall(b"part")
        got = b""
        while len(got) < 4 and (d := s.recv(4 - len(got))):
            got += d
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
        s.close()  # a RST, not a FIN

    def finish(self):
        pass


RESET_CODE = (
    "import socket\n"
    "s = socket.create_connection(('127.0.0.1', {port}), timeout=10)\n"
    "s.sendall(b'hello'); print(s.recv(4)); s.sendall(b'more')\n"
    "for call in (lambda: s.recv(10), lambda: s.recv(10), lambda: s.sendall(b'x')):\n"
    "    try:\n"
    "        d = call(); print('EOF' if d == b'' else d)\n"
    "    except OSError as e:\n"
    "        print('ERR', type(e).__name__)\n"
)


@kvm
def test_a_peers_reset_reads_as_econnreset_live_while_recording_and_in_a_replay(client):
    """A server that resets its connection: the guest's next call fails with ECONNRESET, then it
    sees the end, and a send fails with EPIPE, as on Linux; the same when the broker relays the flow
    to record it (a socket pair carries no RST), and when a replay serves it from the recording."""
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _ResetAfter)
    srv.daemon_threads = True
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    want = "b'part'\nERR ConnectionResetError\nEOF\nERR BrokenPipeError\n"
    seed = secrets.token_hex(32)
    code = RESET_CODE.format(port=port)
    rec = Egress.allow(f"127.0.0.1:{port}", record=True)
    try:
        with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{port}")) as sb:
            assert run(sb, code) == want  # the guest holds the real socket: the kernel's own reset
        with Sandbox("python", client=client, egress=rec) as sb:
            r = sb.exec(code=code, seed=seed, timeout_seconds=60)
            assert (r.ok, r.stdout, r.egress_replay, r.egress_error) == (True, want, "recorded", ""), r.stderr
        assert _ResetAfter.connections == 2
    finally:
        srv.shutdown()
        srv.server_close()
    with Sandbox("python", client=client, egress=rec) as sb:
        r = sb.exec(code=code, seed=seed, timeout_seconds=60)
        assert (r.ok, r.stdout, r.egress_replay, r.egress_error) == (True, want, "replayed", ""), r.stderr
    assert _ResetAfter.connections == 2  # nothing dialled: the server is gone anyway


@kvm
def test_a_set_egress_reset_of_a_recorded_flow_reads_as_econnreset(client, echo_server):
    rule = f"127.0.0.1:{echo_server}"
    with Sandbox("python", client=client, egress=Egress.allow(rule, record=True)) as sb:
        r = sb.exec(code=OPEN_ECHO.format(port=echo_server), seed=secrets.token_hex(32), timeout_seconds=60)
        assert (r.stdout, r.egress_replay) == ("ping\n", "recorded"), r.stderr
        sb.set_egress(Egress.none())
        assert run(sb, RECV_FIRST) == "ERR ConnectionResetError\nEOF\nERR BrokenPipeError\n"
        (flow,) = [e for e in sb.egress_log() if e["kind"] == "connect"]
        assert flow["verdict"] == "reset"


@kvm
def test_udp_flows_are_recorded_and_replayed_datagram_by_datagram(client, udp_echo):
    port, got = udp_echo
    other = port + 1 if port < 65535 else port - 1
    code = UDP_CODE.format(port=port, other=other)
    want = ["echo:one True", "echo:two True", str(errno.ENETUNREACH), str(errno.ENETUNREACH), ""]
    seed = secrets.token_hex(32)
    pol = Egress.allow(f"127.0.0.1:{port}", record=True)
    with Sandbox("python", client=client, egress=pol) as sb:
        r = sb.exec(code=code, seed=seed, timeout_seconds=60)
        assert (r.ok, r.stdout.split("\n"), r.egress_replay, r.egress_error) == (True, want, "recorded", ""), r.stderr
        log = [e for e in sb.egress_log() if e["kind"] == "udp"]
        assert [(e["verdict"], e["detail"]) for e in log[:2]] == [("allowed", "recorded")] * 2
    assert got == [b"one", b"two"]
    for _ in range(2):  # fresh sandboxes, the same seed: the answers come from the recording
        with Sandbox("python", client=client, egress=pol) as sb:
            r = sb.exec(code=code, seed=seed, timeout_seconds=60)
            assert (r.ok, r.stdout.split("\n"), r.egress_replay, r.egress_error) == (True, want, "replayed", ""), r.stderr
            log = [e for e in sb.egress_log() if e["kind"] == "udp"]
            assert [e["verdict"] for e in log] == ["replayed", "replayed", "denied", "denied"]
            assert (log[0]["bytes_out"], log[0]["bytes_in"]) == (3, 8)
    assert got == [b"one", b"two"]  # the server heard nothing new
    # Another datagram than the recording's: that flow diverges, and the result says where.
    with Sandbox("python", client=client, egress=pol) as sb:
        r = sb.exec(code=code.replace("b'one'", "b'uno'"), seed=seed, timeout_seconds=60)
        assert r.egress_replay == "diverged" and "UDP datagram 0 differs from the recording" in r.egress_error, r.egress_error
    assert got == [b"one", b"two"]


class _CountingEcho(socketserver.BaseRequestHandler):
    accepted = 0

    def handle(self):
        type(self).accepted += 1
        try:
            while data := self.request.recv(65536):
                self.request.sendall(data)
        except OSError:
            pass


RACE_CODE = (
    "import socket\n"
    "kept, seen = [], {{}}\n"
    "for i in range({n}):\n"
    "    try:\n"
    "        s = socket.create_connection(('127.0.0.1', {port}), timeout=10)\n"
    "        s.sendall(b'p'); d = s.recv(1)\n"
    "        k = 'ok' if d == b'p' else 'eof'\n"
    "        kept.append(s)\n"
    "    except OSError as e:\n"
    "        k = type(e).__name__\n"
    "    seen[k] = seen.get(k, 0) + 1\n"
    "print(sorted(seen.items()))\n"
)
AFTER_RACE = (
    "alive = 0\n"
    "for s in kept:\n"
    "    try:\n"
    "        s.sendall(b'q'); alive += s.recv(1) == b'q'\n"
    "    except OSError:\n"
    "        pass\n"
    "print(len(kept), alive)\n"
)


@kvm
def test_connects_racing_policy_changes_never_leave_a_forbidden_connection_open(client):
    """While the guest makes connection after connection (and keeps each open), the host flips its
    policy between admitting the server and nothing, every few milliseconds. Each connect is refused or admitted whole;
    after the last change to nothing, none of the kept connections works (each admitted one was
    reset, including those whose dial raced a change), the log has no open admitted flow, and the
    server's own count of accepted connections equals the dials the log shows."""
    from collimate_core.templates.catalog import frame

    _CountingEcho.accepted = 0
    srv = socketserver.ThreadingTCPServer(("127.0.0.1", 0), _CountingEcho)
    srv.daemon_threads = True
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    box = client.create("python", egress=Egress.allow(f"127.0.0.1:{port}"))
    try:
        done = threading.Event()
        flips = [0]

        def flip():
            # Nothing for 1 ms, then the server for 4 ms: a connect and its echo take about a
            # millisecond in a sandbox, so on a loaded host some still complete between changes
            # (with 1 ms both ways, none did in one run), and every change races dials.
            deadline = time.monotonic() + 60  # bounded in time and count
            while not done.is_set() and time.monotonic() < deadline and flips[0] < 20_000:
                deny = flips[0] % 2 == 0
                box.vm.set_egress([] if deny else [f"127.0.0.1:{port}"], False)
                flips[0] += 1
                time.sleep(0.001 if deny else 0.004)

        t = threading.Thread(target=flip, daemon=True)
        t.start()
        try:
            r = box.vm.agent_call(frame({"op": "exec", "code": RACE_CODE.format(n=200, port=port)}), 120.0)
        finally:
            done.set()
            t.join(10)
        box.vm.set_egress([], False)
        out = r.stdout.decode()
        seen = dict(ast.literal_eval(out))  # e.g. [('ConnectionRefusedError', 93), ('ok', 107)]
        assert set(seen) <= {"ok", "ConnectionRefusedError", "ConnectionResetError", "BrokenPipeError", "eof"}, (out, r.stderr)
        assert sum(seen.values()) == 200 and flips[0] > 10
        assert seen.get("ok", 0) > 0 and seen.get("ConnectionRefusedError", 0) > 0, out  # the race was run
        kept, alive = map(int, box.vm.agent_call(frame({"op": "exec", "code": AFTER_RACE}), 60.0).stdout.split())
        assert kept == seen.get("ok", 0) + seen.get("eof", 0) and alive == 0
        log = [e for e in box.vm.egress_log() if e["kind"] == "connect"]
        assert not [e for e in log if e["open"] and e["verdict"] == "allowed"]
        dialled = [e for e in log if e["verdict"] in ("allowed", "reset") or "changed while the connection was being made" in e["detail"]]
        for _ in range(100):  # the server's accept loop may trail the last dial (bounded: 1 s)
            if _CountingEcho.accepted >= len(dialled):
                break
            time.sleep(0.01)
        assert _CountingEcho.accepted == len(dialled)
    finally:
        client.destroy(box)
        srv.shutdown()
        srv.server_close()


class _EchoV6(socketserver.ThreadingTCPServer):
    address_family = socket.AF_INET6
    daemon_threads = True


IPV6_CODE = (
    "import socket\n"
    "for addr in {addrs!r}:\n"
    "    try:\n"
    "        s = socket.create_connection(addr, timeout=10); s.sendall(b'six'); print(s.recv(3).decode(), s.family.name)\n"
    "    except OSError as e:\n"
    "        print('ERR', type(e).__name__)\n"
)


@kvm
def test_ipv6_flows_follow_the_rules_and_v6_literals_get_no_way_around_them(client):
    """TCP over IPv6: an explicit [::1]:port rule reaches a server on the host's IPv6 loopback; an
    IPv4 rule for the same port does not admit it, and neither do internet() and name rules, nor an
    IPv4-mapped IPv6 literal of loopback or a documentation-range literal under a name rule."""
    srv = _EchoV6(("::1", 0), _Echo)
    port = srv.server_address[1]
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    addrs = [("::1", port), ("::ffff:127.0.0.1", port), ("2001:db8::5", 443)]
    code = IPV6_CODE.format(addrs=addrs)
    try:
        with Sandbox("python", client=client, egress=Egress.allow(f"[::1]:{port}")) as sb:
            assert run(sb, code).splitlines() == ["six AF_INET6", "ERR ConnectionRefusedError", "ERR ConnectionRefusedError"]
            log = [e for e in sb.egress_log() if e["kind"] == "connect"]
            assert [(e["address"], e["verdict"]) for e in log] == [("::1", "allowed"), ("127.0.0.1", "denied"), ("2001:db8::5", "denied")]
            assert log[0]["rule"] == f"[::1]:{port}" and log[0]["bytes_in"] == 3
        for pol in (Egress.allow(f"127.0.0.1:{port}"), Egress.internet(), Egress.allow("pkg.test", "*.pkg.test")):
            with Sandbox("python", client=client, egress=pol) as sb:
                out = run(sb, code).splitlines()
                # internet() admits the documentation address (a public one), which nothing answers here
                assert out[:2] == ["ERR ConnectionRefusedError"] * 2, (pol, out)
                assert out[2].startswith("ERR") and not out[2].startswith("six"), (pol, out)
    finally:
        srv.shutdown()
        srv.server_close()


TLS_SERVER = r"""
import socket, ssl, sys
cert, key, host, port = sys.argv[1:5]
ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
ctx.load_cert_chain(cert, key)
last = [None]
ctx.sni_callback = lambda sock, name, c: last.__setitem__(0, name)
ls = socket.create_server((host, int(port)))
print("ready", flush=True)
while True:  # one connection at a time; the test kills it
    c, _ = ls.accept()
    try:
        last[0] = None
        t = ctx.wrap_socket(c, server_side=True)
        t.recv(1024)
        body = ("sni=%s\n" % last[0]).encode()
        t.sendall(b"HTTP/1.0 200 OK\r\nContent-Length: %d\r\n\r\n" % len(body) + body)
        t.close()
    except (OSError, ssl.SSLError):
        c.close()
"""

TLS_CLIENT = (
    "import socket, ssl, urllib.request\n"
    "ctx = ssl.create_default_context(cafile='/tmp/ca.pem')\n"
    "def get(url):\n"
    "    try:\n"
    "        return urllib.request.urlopen(url, context=ctx, timeout=10).read().decode().strip()\n"
    "    except Exception as e:\n"
    "        r = getattr(e, 'reason', e)\n"
    "        return 'ERR ' + type(r).__name__\n"
    "for name in ('a.tls.test', 'b.tls.test'):\n"
    "    print(name, get('https://%s:{port}/' % name))\n"
    "print('literal', get('https://{addr}:{port}/'))\n"
    # Fronting (docs/egress.md, threat model): the admitted name's address with another name's SNI.
    "ip = socket.getaddrinfo('a.tls.test', {port}, socket.AF_INET)[0][4][0]\n"
    "t = ctx.wrap_socket(socket.create_connection((ip, {port}), timeout=10), server_hostname='b.tls.test')\n"
    "t.sendall(b'GET / HTTP/1.0\\r\\n\\r\\n'); print('fronted', t.recv(4096).split(b'\\r\\n\\r\\n')[-1].decode().strip())\n"
)


@kvm
def test_a_tls_server_with_several_names_is_reached_only_by_the_admitted_one(client, dns, testnet, tmp_path):
    """A TLS server in the test namespace with a certificate for a.tls.test and b.tls.test (both
    names in the test DNS, one address). Under a rule for a.tls.test the guest verifies the
    certificate and reaches it by that name (the server sees that SNI); b.tls.test is NXDOMAIN
    without a query upstream; the IP literal is refused in a sandbox that never resolved the name.
    What a name rule cannot stop (said in the threat model): the admitted address with another
    name's SNI reaches the same server."""
    if shutil.which("openssl") is None:
        pytest.skip("needs the openssl command to make a test certificate")
    key, cert = tmp_path / "key.pem", tmp_path / "cert.pem"
    subprocess.run(["openssl", "req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes",
                    "-keyout", str(key), "-out", str(cert), "-days", "2", "-subj", "/CN=a.tls.test",
                    "-addext", "subjectAltName=DNS:a.tls.test,DNS:b.tls.test"], check=True, capture_output=True)
    port = 8443
    server = subprocess.Popen(["ip", "netns", "exec", testnet["ns"], "/usr/bin/python3", "-c", TLS_SERVER,
                               str(cert), str(key), testnet["addr"], str(port)], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        assert server.stdout.readline().strip() == b"ready"
        asked = len(dns.asked)
        code = TLS_CLIENT.format(port=port, addr=testnet["addr"])
        with Sandbox("python", client=client, egress=Egress.allow(f"a.tls.test:{port}")) as sb:
            sb.upload_bytes("/tmp/ca.pem", cert.read_bytes())
            out = run(sb, code).splitlines()
            assert out == ["a.tls.test sni=a.tls.test", "b.tls.test ERR gaierror",
                           "literal ERR SSLCertVerificationError", "fronted sni=b.tls.test"], out
            log = sb.egress_log()
            assert {e["name"] for e in log if e["verdict"] == "nxdomain"} == {"b.tls.test"}
            assert all(e["name"] == "a.tls.test" for e in log if e["kind"] == "connect" and e["verdict"] == "allowed")
        assert "b.tls.test" not in dns.asked[asked:] and "a.tls.test" in dns.asked[asked:]
        # A sandbox that never resolved a.tls.test: its address as a literal is refused.
        with Sandbox("python", client=client, egress=Egress.allow(f"a.tls.test:{port}")) as sb:
            sb.upload_bytes("/tmp/ca.pem", cert.read_bytes())
            out = run(sb, f"import socket\ntry:\n    socket.create_connection(({testnet['addr']!r}, {port}), timeout=10); print('open')\n"
                          "except OSError as e:\n    print(type(e).__name__)\n")
            assert out == "ConnectionRefusedError\n"
    finally:
        server.kill()
        server.wait(5)


WALL = "import time\nprint(round(time.time(), 3))\n"


@kvm
def test_a_sandbox_with_a_network_reads_the_true_date_and_a_replay_the_recorded_one(client):
    """Certificates, signed API requests and HTTP dates need the true date: a seeded exec in a
    sandbox whose policy admits a network starts its virtual wall clock at the host's; a recorded
    exec writes that start down and its replay starts there again (the same reading, later); an
    offline sandbox starts where the template's guest last saw the clock, alike in every clone."""
    seed = secrets.token_hex(32)
    offline = []
    for _ in range(2):
        with Sandbox("python", client=client) as sb:
            offline.append(float(sb.exec(code=WALL, seed=seed).stdout))
    assert offline[0] == offline[1]
    with Sandbox("python", client=client, egress=Egress.allow("127.0.0.1:9")) as sb:
        live = float(sb.exec(code=WALL, seed=seed).stdout)
    assert abs(live - time.time()) < 60
    pol = Egress.allow("127.0.0.1:9", record=True)
    with Sandbox("python", client=client, egress=pol) as sb:
        r = sb.exec(code=WALL, seed=seed)
        recorded = float(r.stdout)
        assert r.egress_replay == "recorded" and abs(recorded - time.time()) < 60
    time.sleep(1.1)
    with Sandbox("python", client=client, egress=pol) as sb:
        r = sb.exec(code=WALL, seed=seed)
        assert (r.egress_replay, float(r.stdout)) == ("replayed", recorded)



@pytest.fixture(scope="module")
def late_server():
    """A TCP server that answers each request 1 s after it came (a slow API, an index under load)."""

    class Late(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.recv(100)
            time.sleep(1.0)
            self.request.sendall(b"late answer")

    with tcp_server(Late) as port:
        yield port


LATE_WAIT = """
import os, socket, threading, time
def ask():
    s = socket.create_connection(('127.0.0.1', {port}), timeout=20)
    s.sendall(b'hi')
    t = time.monotonic()
    try:
        got = s.recv(100).decode()
    except OSError as e:
        got = type(e).__name__
    print(got, round(time.monotonic() - t, 3), flush=True)
def in_a_thread():
    t = threading.Thread(target=ask)
    t.start()
    t.join()
if {mode!r} == 'thread':
    in_a_thread()
else:
    pid = os.fork()
    if pid == 0:
        ask() if {mode!r} == 'fork' else in_a_thread()
        os._exit(0)
    os.waitpid(pid, 0)
"""


@kvm
@pytest.mark.parametrize("mode", ["fork", "thread", "thread in a child"])
def test_a_timed_network_wait_in_a_seeded_exec_waits_for_the_answer(client, late_server, mode):
    """In a seeded exec the processes and threads of a sandbox share virtual time, which jumps to
    the next deadline when all of them wait. A wait on a network socket waits for the world
    outside: its time passes as on the host. It once jumped, and a 20 s read timeout on a server
    that answers after 1 s expired at once; and a later exec's child counted an earlier exec's wait
    again. The guest's own measure of the wait is about the server's delay, exec after exec."""
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{late_server}")) as sb:
        for i in range(3):
            r = sb.exec(code=LATE_WAIT.format(port=late_server, mode=mode), seed=f"{i + 1:064x}", timeout_seconds=60)
            assert r.ok, r.stderr
            got, waited = r.stdout.strip().rsplit(" ", 1)
            assert got == "late answer", r.stdout
            # The guest measures from its send: how long its read then waited on the host, the
            # server's 1 s less the host time the guest took to reach the read (tenths of a second
            # on a loaded host). A wait counted twice is 2 s or more; one that took no time is 0.
            assert 0.25 <= float(waited) < 1.9, (i, r.stdout)


@pytest.fixture(scope="module")
def bulk_server():
    """A TCP server that sends 24 MiB of seeded pseudo-random bytes to each client, then closes."""
    data = random.Random(16).randbytes(24 << 20)

    class Bulk(socketserver.BaseRequestHandler):
        def handle(self):
            self.request.sendall(data)

    with tcp_server(Bulk) as port:
        yield port, hashlib.sha256(data).hexdigest()


BULK_READS = """
import hashlib, mmap, os, socket
def download(how):
    s = socket.create_connection(('127.0.0.1', {port}), timeout=30)
    h, total = hashlib.sha256(), 0
    if how == 'recv':  # a new buffer each time (recv's own bytes object)
        while d := s.recv(1 << 20):
            h.update(d); total += len(d)
    elif how == 'recv_into':  # one buffer reused, at an offset that is not page aligned
        buf = bytearray(3 << 20)
        view = memoryview(buf)[4093:4093 + (2 << 20) + 7]
        while n := s.recv_into(view):
            h.update(view[:n]); total += n
    else:  # a fresh anonymous mapping each time: no page of it has a frame before the receive
        while True:
            m = mmap.mmap(-1, 1 << 20)
            n = s.recv_into(m)
            if not n:
                break
            h.update(m[:n]); total += n
            m.close()
    s.close()
    return total, h.hexdigest()
for how in ('recv', 'recv_into', 'mmap'):
    print(how, *download(how))
pid = os.fork()
if pid == 0:
    print('child', *download('recv_into'), flush=True)
    os._exit(0)
os.waitpid(pid, 0)
"""


@kvm
def test_a_bulk_download_lands_byte_exact_in_every_kind_of_buffer(client, bulk_server):
    """24 MiB from a server land byte-exact in every kind of guest buffer a receive is given: a new
    one each time (recv), one reused at an offset that is not page aligned (recv_into), a fresh
    anonymous mapping whose pages have no frame yet, and in a forked child (whose pages are copies
    of its parent's)."""
    port, digest = bulk_server
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{port}")) as sb:
        r = sb.exec(code=BULK_READS.format(port=port), timeout_seconds=120)
        assert r.ok, r.stderr
        lines = r.stdout.split("\n")[:-1]
        assert [ln.split()[0] for ln in lines] == ["recv", "recv_into", "mmap", "child"], r.stdout
        for ln in lines:
            assert ln.split()[1:] == [str(24 << 20), digest], ln


# --- issue 32: the host's own addresses, the log's newest entries, a fork's ceiling, the flow cap --


class _HostService(http.server.BaseHTTPRequestHandler):
    """A service of the host's, bound on every address (0.0.0.0, ::), like `serve --host 0.0.0.0`."""

    hits = 0

    def do_GET(self):
        type(self).hits += 1
        body = b"the host's own service\n"
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *a):
        pass


class _Http6(http.server.ThreadingHTTPServer):
    address_family = socket.AF_INET6

    def server_bind(self):
        self.socket.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
        super().server_bind()


@pytest.fixture(scope="module")
def host_service():
    """The same service on 0.0.0.0 and on ::, each on a port of its own."""
    v4 = http.server.ThreadingHTTPServer(("0.0.0.0", 0), _HostService)
    v6 = _Http6(("::", 0), _HostService)
    for s in (v4, v6):
        threading.Thread(target=s.serve_forever, daemon=True).start()
    yield {"v4": v4.server_address[1], "v6": v6.server_address[1]}
    for s in (v4, v6):
        s.shutdown()
        s.server_close()


@kvm
def test_internet_and_name_rules_never_reach_the_hosts_own_addresses(client, dns, testnet, host_service):
    host4, host6 = testnet["host_addr"], testnet["host_addr6"]
    # From the host, the service answers on the test network's host end (so a refusal below is the policy's).
    with socket.create_connection((host4, host_service["v4"]), timeout=5):
        pass
    with socket.create_connection((host6, host_service["v6"]), timeout=5):
        pass
    hits = _HostService.hits
    with Sandbox("python", client=client, egress=Egress.internet()) as sb:
        # The test network's peer is reached (its range is declared public here) ...
        assert run(sb, fetch(f"http://{testnet['addr']}:{testnet['port']}/index.html")) == \
            "served from inside the test network namespace\n"
        # ... the host's own addresses on it are not, in either family, nor through an IPv6 form of them.
        for url in (f"http://{host4}:{host_service['v4']}/", f"http://[{host6}]:{host_service['v6']}/",
                    f"http://[::ffff:{host4}]:{host_service['v4']}/"):
            assert run(sb, fetch(url, 5)) == f"ERR ConnectionRefusedError {errno.ECONNREFUSED}\n", url
        denied = [e for e in sb.egress_log() if e["verdict"] == "denied"]
        assert len(denied) == 3 and all("an address of this host" in e["detail"] for e in denied), denied
    # DNS rebinding: an admitted name whose answer is the host's address resolves to nothing.
    with Sandbox("python", client=client, egress=Egress.allow("rebind.test")) as sb:
        code = (
            "import socket\n"
            "try:\n"
            f"    print(socket.getaddrinfo('rebind.test', {host_service['v4']}, socket.AF_INET, socket.SOCK_STREAM))\n"
            "except socket.gaierror:\n"
            "    print('gaierror')\n"
        )
        assert run(sb, code) == "gaierror\n"
        (answer,) = [e for e in sb.egress_log() if e["kind"] == "dns"]
        assert "withheld" in answer["detail"] and "an address of this host" in answer["detail"], answer
        assert "ConnectionRefusedError" in run(sb, fetch(f"http://{host4}:{host_service['v4']}/", 5))
    assert _HostService.hits == hits  # the host's service never saw the sandbox
    # An explicit IP rule still admits it (the operator's choice).
    with Sandbox("python", client=client, egress=Egress.allow(f"{host4}:{host_service['v4']}")) as sb:
        assert run(sb, fetch(f"http://{host4}:{host_service['v4']}/")) == "the host's own service\n"


FLOOD = (
    "import socket\n"
    "refused = 0\n"
    "for _ in range({n}):\n"
    "    s = socket.socket()\n"
    "    try:\n"
    "        s.connect(('127.0.0.1', {denied}))\n"
    "    except ConnectionRefusedError:\n"
    "        refused += 1\n"
    "    s.close()\n"
    "s = socket.create_connection(('127.0.0.1', {allowed}))\n"
    "s.sendall(b'after the flood\\n')\n"
    "print(refused, s.recv(100).decode().strip())\n"
    "s.close()\n"
    "try:\n"
    "    socket.create_connection(('127.0.0.1', {denied}))\n"
    "except ConnectionRefusedError:\n"
    "    print('last refused')\n"
)


def _check_flood_log(log, echo_server, http_server, n):
    assert len(log) == 10_000 and log.dropped == n + 2 - 10_000, (len(log), log.dropped)
    allowed, last = log[-2], log[-1]
    assert (allowed["verdict"], allowed["port"], allowed["bytes_out"]) == ("allowed", echo_server, 16)
    assert (last["verdict"], last["port"]) == ("denied", http_server)
    assert [e["seq"] for e in log] == list(range(log.dropped, n + 2))


@kvm
def test_the_egress_log_keeps_the_newest_entries_and_says_how_many_it_dropped(client, echo_server, http_server):
    n = 10_050
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{echo_server}")) as sb:
        r = sb.exec(code=FLOOD.format(n=n, denied=http_server, allowed=echo_server), timeout_seconds=600)
        assert r.ok, r.stderr
        assert r.stdout == f"{n} after the flood\nlast refused\n"
        _check_flood_log(sb.egress_log(), echo_server, http_server, n)


CONNECT_MANY = (
    "import socket, errno\n"
    "held = []\n"
    "try:\n"
    "    for _ in range({n}):\n"
    "        held.append(socket.create_connection(('127.0.0.1', {port})))\n"
    "except OSError as e:\n"
    "    print(len(held), errno.errorcode.get(e.errno))\n"
    "held.pop().close()\n"
    "held.append(socket.create_connection(('127.0.0.1', {port})))\n"
    "print('again', len(held))\n"
)


@kvm
def test_past_the_flow_cap_connect_fails_with_emfile_and_the_log_says_why(client, echo_server):
    before = eg.max_flows()
    eg.set_max_flows(8)
    try:
        with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{echo_server}")) as sb:
            out = run(sb, CONNECT_MANY.format(n=20, port=echo_server))
            assert out == "8 EMFILE\nagain 8\n", out
            (capped,) = [e for e in sb.egress_log() if e["verdict"] == "capped"]
            assert "8 open flows" in capped["detail"] and "EMFILE" in capped["detail"]
    finally:
        eg.set_max_flows(before)


@kvm
def test_a_fork_cannot_widen_past_its_policy_at_fork_time(client, http_server, echo_server):
    import asyncio

    from collimate_core import aio

    echo = f"127.0.0.1:{echo_server}"
    with Sandbox("python", client=client, egress=Egress.allow(f"127.0.0.1:{http_server}", echo)) as sb:
        with sb.fork_group(1, egress=Egress.allow(echo)) as g:
            child = g[0]
            for wide in (Egress.internet(), Egress.allow(f"127.0.0.1:{http_server}"), Egress.allow("127.0.0.0/8")):
                with pytest.raises(InvalidArgument, match=r"is a fork: .*Egress.allow\('127.0.0.1:%d'\)" % echo_server):
                    child.set_egress(wide)
            assert "ConnectionRefusedError" in run(child, fetch(f"http://127.0.0.1:{http_server}/"))
            # Narrow below it, and widen back up to it.
            child.set_egress(Egress.none())
            assert "ConnectionRefusedError" in run(child, fetch(f"http://{echo}/", 3))
            child.set_egress(Egress.allow(echo))
            assert run(child, OPEN_ECHO.format(port=echo_server)) == "ping\n"
            # The engine holds the ceiling too: its own call is refused.
            with pytest.raises(ValueError, match="is a fork"):
                child._box.vm.set_egress(["127.0.0.0/8"], False)
        with sb.fork_group(1, egress=Egress.none()) as g:
            with pytest.raises(InvalidArgument, match="Egress.none()"):
                g[0].set_egress(Egress.allow(echo))
        # The parent (made from a template) is not a fork: it may widen.
        sb.set_egress(Egress.allow(f"127.0.0.1:{http_server}", echo, "127.0.0.1:1"))

    async def main():
        async with aio.Sandbox("python", client=aio.AsyncClient(client), egress=Egress.allow(echo)) as asb:
            async with asb.fork_group(1, egress=Egress.none()) as grp:
                with pytest.raises(InvalidArgument, match="is a fork"):
                    await grp[0].set_egress(Egress.allow(echo))

    asyncio.run(main())


@kvm
def test_over_http_a_forks_ceiling_holds_and_the_log_reports_its_drops(ceiling_server, http_server, echo_server):
    import httpx

    from collimate_core import RemoteClient

    srv, key = ceiling_server
    h = {"Authorization": f"Bearer {key}"}
    echo = f"127.0.0.1:{echo_server}"
    n = 10_050
    with RemoteClient(key, srv.url) as rc:
        with Sandbox("python", client=rc, egress=Egress.allow(echo)) as sb:
            with sb.fork_group(1, egress=Egress.none()) as g:
                child = g[0]
                r = httpx.put(f"{srv.url}/v1/sandboxes/{child.session_id}/egress", json={"rules": [echo]}, headers=h, timeout=60)
                assert r.status_code == 400 and "is a fork" in r.text and "Egress.none()" in r.text, r.text
                with pytest.raises(InvalidArgument, match="is a fork"):
                    child.set_egress(Egress.allow(echo))
            r = sb.exec(code=FLOOD.format(n=n, denied=http_server, allowed=echo_server), timeout_seconds=600)
            assert r.ok and r.stdout == f"{n} after the flood\nlast refused\n", r.stderr
            _check_flood_log(sb.egress_log(), echo_server, http_server, n)
            sid = sb.session_id
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and not [e for e in srv.events() if e.get("event") == "egress_dropped" and e.get("sandbox") == sid]:
        time.sleep(0.1)
    (drop,) = [e for e in srv.events() if e.get("event") == "egress_dropped" and e.get("sandbox") == sid]
    assert drop["dropped"] == drop["total_dropped"] == n + 2 - 10_000
    lines = [e for e in srv.events() if e.get("event") == "egress" and e.get("sandbox") == sid]
    assert len(lines) == 10_000 and lines[-2]["verdict"] == "allowed" and lines[-1]["dropped"] == n + 2 - 10_000
