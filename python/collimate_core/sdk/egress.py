"""Egress: which network destinations one sandbox may reach.

A policy is a value (immutable, hashable, comparable). The default everywhere is `Egress.none()`:
no network. `Egress.allow(*rules)` admits what its rules name; `Egress.internet()` admits public
addresses on any port. A rule is one of:

- a host name, `"index.example.org"`, or a wildcard, `"*.files.example.net"` (any name below it, not the name
  itself), either with an optional port: `"host:443"`;
- an IP address or CIDR block, optionally with a port: `"203.0.113.0/24"`, `"203.0.113.7:5432"`,
  `"[2001:db8::1]:443"`, `"2001:db8::/32"`.

Special addresses are never reached through a name rule or `internet()`: only an IP or CIDR rule
that contains them admits them. They are every range of IANA's IPv4 and IPv6 Special-Purpose
Address Registries (loopback, private, CGNAT, link-local and metadata, documentation, benchmarking,
NAT64, 6to4, ...; `special_ranges()` lists them: the engine's table, the one copy), an IPv6 address
carrying such an IPv4 one, and every address of the host's own interfaces (read at each check).

The engine enforces a policy at the socket (see docs/egress.md): names are resolved by the
engine's broker, never trusted from the guest. `record=True` (on `allow` or `internet`) records
each exec's flows with its seed, and a replay of that exec (the same sandbox state and seed) is
served the recorded bytes instead of the network (docs/egress.md, "Record and replay"). The Rust twin of this module is the engine's
`egress::policy`; both parse the same rule strings and must agree (tests check it).
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Any, Union

from collimate_core.sdk.errors import InvalidArgument

RULE_HELP = (
    'a rule is a host name ("index.example.org") or wildcard ("*.files.example.net"), either with an optional '
    '":port" ("host:443"), or an IP address or CIDR block with an optional port ("203.0.113.0/24", '
    '"203.0.113.7:5432", "[2001:db8::1]:443", "2001:db8::/32"); ports are 1..65535'
)

IpNet = Union[ipaddress.IPv4Network, ipaddress.IPv6Network]

_LABEL = re.compile(r"^[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?$")


def _v4_of(addr: ipaddress.IPv4Address | ipaddress.IPv6Address):
    """An IPv4-mapped IPv6 address is its IPv4 address (so ::ffff:127.0.0.1 is loopback)."""
    if isinstance(addr, ipaddress.IPv6Address) and addr.ipv4_mapped is not None:
        return addr.ipv4_mapped
    return addr


def special_ranges() -> list[tuple[IpNet, str]]:
    """The special-purpose table, (block, name) pairs: the engine's copy (there is no other)."""
    from collimate_core import _core

    return [(ipaddress.ip_network(c), n) for c, n in _core._egress_special_ranges()]


def special_reason(addr: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> str | None:
    """Why `addr` is never reached through a name rule or internet(): its registry range, the
    IPv4 address it carries, or that the host has it. None for a public address."""
    from collimate_core import _core

    return _core._egress_special(str(ipaddress.ip_address(addr) if isinstance(addr, str) else addr))


def is_special(addr: str | ipaddress.IPv4Address | ipaddress.IPv6Address) -> bool:
    """Whether `addr` is special (see `special_reason`)."""
    return special_reason(addr) is not None


def _net_is_public(net: IpNet) -> bool:
    from collimate_core import _core

    return bool(_core._egress_net_is_public(str(net)))


def set_public_ranges(ranges: Any) -> None:
    """Treat these special-purpose CIDR blocks as public for every sandbox of this process (a lab
    network reached by name or internet()); `[]` for none (the default). Never loopback,
    link-local or unspecified blocks, and never the host's own addresses. The server reads
    COLLIMATE_EGRESS_PUBLIC (comma-separated) at start."""
    from collimate_core import _core

    if isinstance(ranges, str) or not isinstance(ranges, (list, tuple)):
        raise InvalidArgument(f"set_public_ranges takes a list of CIDR blocks, not {ranges!r}")
    try:
        _core._set_egress_public(",".join(str(r) for r in ranges))
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def public_ranges() -> list[str]:
    """The special-purpose blocks declared public now (`set_public_ranges`)."""
    from collimate_core import _core

    return list(_core._egress_public())


def set_max_flows(n: int) -> None:
    """The most flows (TCP connections and UDP flows) one sandbox holds open at once, for every
    sandbox of this process (default 1,024; at most 2,000). Past it the guest's connect fails with
    EMFILE and the egress log has a "capped" entry saying why. The server reads
    COLLIMATE_EGRESS_MAX_FLOWS at start."""
    from collimate_core import _core

    if isinstance(n, bool) or not isinstance(n, int):
        raise InvalidArgument(f"set_max_flows takes a number of flows, not {n!r}")
    try:
        _core._egress_max_flows(n)
    except ValueError as e:
        raise InvalidArgument(str(e)) from None


def max_flows() -> int:
    """The per-sandbox flow cap now (`set_max_flows`)."""
    from collimate_core import _core

    return int(_core._egress_max_flows())


class EgressLog(list):
    """A sandbox's egress log: its entries, oldest first (a list of dicts), and `dropped`, how many
    older entries it no longer holds (it keeps the newest 10,000). Each entry's `seq` is its place
    since the sandbox started."""

    dropped: int

    def __init__(self, entries: Any = (), dropped: int | None = None):
        super().__init__(entries)
        if dropped is None:
            dropped = int(self[0].get("seq", 0)) if self else 0
        self.dropped = dropped

    def __repr__(self) -> str:
        return f"EgressLog({list.__repr__(self)}, dropped={self.dropped})"


def _bad(rule: Any, why: str) -> InvalidArgument:
    return InvalidArgument(f"invalid egress rule {rule!r}: {why}; {RULE_HELP}")


def _port(rule: str, text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535 or (len(text) > 1 and text[0] == "0"):
        raise _bad(rule, f"port {text!r} is not a number in 1..65535")
    return int(text)


def _name(rule: str, text: str) -> str:
    name = text.lower()
    if name.endswith("."):
        name = name[:-1]
    if not name or len(name) > 253:
        raise _bad(rule, "a host name has 1 to 253 characters")
    for label in name.split("."):
        if not _LABEL.match(label):
            raise _bad(rule, f"{label!r} is not a host name label (letters, digits, '-', '_'; 1 to 63)")
    if re.fullmatch(r"[0-9.]+", name):
        raise _bad(rule, "this looks like an IPv4 address but is not one")
    return name


@dataclass(frozen=True)
class Rule:
    """One parsed rule. `kind` is "name", "wildcard" or "net"; `port` None means any port."""

    kind: str
    value: str  # the name, the wildcard's suffix (without "*."), or the network in CIDR form
    port: int | None = None

    @property
    def net(self) -> IpNet:
        return ipaddress.ip_network(self.value)

    def __str__(self) -> str:
        if self.kind == "net":
            net = self.net
            host = str(net.network_address) if net.prefixlen == net.max_prefixlen else str(net)
            if self.port is None:
                return host
            return f"[{host}]:{self.port}" if net.version == 6 else f"{host}:{self.port}"
        host = self.value if self.kind == "name" else "*." + self.value
        return host if self.port is None else f"{host}:{self.port}"

    def _port_within(self, other: "Rule") -> bool:
        return other.port is None or other.port == self.port

    def within(self, other: "Rule") -> bool:
        """Whether everything this rule admits, `other` admits."""
        if not self._port_within(other):
            return False
        if self.kind == "net" or other.kind == "net":
            if self.kind != other.kind:
                return False
            a, b = self.net, other.net
            return a.version == b.version and a.subnet_of(b)  # type: ignore[arg-type]
        if other.kind == "name":
            return self.kind == "name" and self.value == other.value
        # other is *.suffix: names strictly below it
        return self.value.endswith("." + other.value) or (self.kind == "wildcard" and self.value == other.value)

    def admits_name(self, name: str) -> bool:
        if self.kind == "name":
            return name == self.value
        if self.kind == "wildcard":
            return name.endswith("." + self.value)
        return False


def _order(r: Rule) -> tuple:
    return (r.kind, r.value, -1 if r.port is None else r.port)


def parse_rule(rule: Any) -> Rule:
    """Parse one rule string; InvalidArgument says what a valid rule looks like."""
    if not isinstance(rule, str):
        raise _bad(rule, f"a rule is a string, not {type(rule).__name__}")
    text = rule.strip()
    if not text or text != rule or any(c.isspace() for c in text):
        raise _bad(rule, "empty or contains whitespace")
    port: int | None = None
    host = text
    if text.startswith("["):
        close = text.find("]")
        if close < 0:
            raise _bad(rule, "'[' without ']'")
        host, rest = text[1:close], text[close + 1 :]
        if rest:
            if not rest.startswith(":"):
                raise _bad(rule, "after ']' comes ':port'")
            port = _port(rule, rest[1:])
        if ":" not in host:
            raise _bad(rule, "brackets are for IPv6 addresses")
        return Rule("net", _network(rule, host), port)
    if text.count(":") == 1:
        host, p = text.split(":")
        port = _port(rule, p)
    elif text.count(":") > 1:
        # A bare IPv6 address or block (a port needs brackets).
        return Rule("net", _network(rule, text), None)
    if _looks_v4(host) or ("/" in host and not host.startswith("*.")):
        return Rule("net", _network(rule, host), port)
    if host.startswith("*."):
        return Rule("wildcard", _name(rule, host[2:]), port)
    if "*" in host:
        raise _bad(rule, "a wildcard is '*.' followed by a name")
    if "/" in host:
        raise _bad(rule, "a CIDR block is an IP address, '/', and a prefix length")
    return Rule("name", _name(rule, host), port)


def _looks_v4(host: str) -> bool:
    parts = host.split("/")[0].split(".")
    return len(parts) == 4 and all(p.isdigit() for p in parts)


def _network(rule: str, text: str) -> str:
    if "/" in text:
        addr, _, plen = text.partition("/")
        if not plen.isdigit() or (len(plen) > 1 and plen[0] == "0"):
            raise _bad(rule, f"prefix length {plen!r} is not a number")
    try:
        net = ipaddress.ip_network(text, strict=True)
    except ValueError as e:
        raise _bad(rule, str(e)) from None
    return str(net)


@dataclass(frozen=True)
class Egress:
    """A sandbox's network policy. Build one with `none()`, `allow(*rules)` or `internet()`."""

    rules: tuple[Rule, ...] = ()
    internet_access: bool = False
    # Record each exec's flows, and replay them for an exec with the same state and seed.
    record: bool = False

    # constructors
    @classmethod
    def none(cls) -> "Egress":
        """No network (the default everywhere)."""
        return cls()

    @classmethod
    def allow(cls, *rules: str, record: bool = False) -> "Egress":
        """Admit what `rules` name (see the module doc for their form). `record=True`: record each
        exec's flows with its seed, and serve them back to a replay of that exec."""
        if len(rules) == 1 and isinstance(rules[0], (list, tuple)):
            rules = tuple(rules[0])
        parsed = tuple(sorted(set(parse_rule(r) for r in rules), key=_order))
        return cls(parsed, False, _record_flag(record))

    @classmethod
    def internet(cls, *, record: bool = False) -> "Egress":
        """Public addresses on any port (never loopback, private, link-local or metadata)."""
        return cls((), True, _record_flag(record))

    # questions
    @property
    def is_none(self) -> bool:
        return not self.rules and not self.internet_access

    def admits_name(self, name: str) -> bool:
        """Whether the engine answers DNS queries for `name` (a name rule or internet())."""
        name = name.lower().rstrip(".")
        return self.internet_access or any(r.admits_name(name) for r in self.rules)

    def admits(self, address: str, port: int, *, name: str | None = None) -> bool:
        """Whether a connection to `address`:`port` is admitted (`name`: the name the engine's own
        resolver gave that address for)."""
        a = _v4_of(ipaddress.ip_address(address))
        for r in self.rules:
            if r.kind == "net" and (r.port is None or r.port == port):
                net = r.net
                if a.version == net.version and a in net:
                    return True
        if is_special(a):
            return False
        if self.internet_access:
            return True
        if name is None:
            return False
        n = name.lower().rstrip(".")
        return any(r.admits_name(n) and (r.port is None or r.port == port) for r in self.rules)

    def narrower_than(self, other: "Egress") -> bool:
        """Whether everything this policy admits, `other` admits too (a fork may only narrow).

        Conservative: a rule must fit inside one rule of `other` (or, for names and public blocks,
        inside `other`'s internet()); a block split across two rules of `other` counts as wider."""
        other = coerce(other)
        if self.internet_access and not other.internet_access:
            return False
        for r in self.rules:
            if any(r.within(o) for o in other.rules):
                continue
            if other.internet_access and (r.kind != "net" or _net_is_public(r.net)):
                continue
            return False
        return True

    def check_within(self, ceiling: "Egress", sandbox: str) -> None:
        """Raise InvalidArgument unless this policy lies within a fork's ceiling (its policy when
        it was forked): `set_egress` may narrow below it and widen back up to it, never beyond."""
        if not self.narrower_than(ceiling):
            wider = [str(r) for r in self.rules if not Egress((r,)).narrower_than(ceiling)]
            if self.internet_access and not ceiling.internet_access:
                wider.insert(0, "internet()")
            raise InvalidArgument(
                f"sandbox {sandbox} is a fork: its egress may not go beyond its policy when it was forked, "
                f"{ceiling}; {self} also admits {', '.join(wider)}; pass a policy within {ceiling}"
            )

    def check_narrower(self, parent: "Egress", what: str = "a fork") -> None:
        """Raise InvalidArgument unless this policy is narrower than (or equal to) `parent`."""
        if not self.narrower_than(parent):
            wider = [str(r) for r in self.rules if not Egress((r,)).narrower_than(parent)]
            if self.internet_access and not parent.internet_access:
                wider.insert(0, "internet()")
            raise InvalidArgument(
                f"{what} may only narrow its parent's egress policy {parent}: {self} also admits "
                f"{', '.join(wider)}; pass a policy whose rules lie inside the parent's"
            )

    # wire form (HTTP bodies, the engine)
    def to_json(self) -> dict:
        d: dict = {"internet": self.internet_access, "rules": [str(r) for r in self.rules]}
        if self.record:
            d["record"] = True
        return d

    @classmethod
    def from_json(cls, d: Any) -> "Egress":
        return coerce(d)

    def rule_strings(self) -> list[str]:
        return [str(r) for r in self.rules]

    def __str__(self) -> str:
        if self.is_none:
            return "Egress.none()"
        parts = [repr(str(r)) for r in self.rules]
        rec = "record=True" if self.record else ""
        if self.internet_access:
            inet = f"Egress.internet({rec})"
            return inet if not parts else f"{inet} + Egress.allow({', '.join(parts)})"
        return f"Egress.allow({', '.join(parts + ([rec] if rec else []))})"

    __repr__ = __str__

    def __or__(self, other: "Egress") -> "Egress":
        """The union of two policies (e.g. `Egress.internet() | Egress.allow("10.0.0.5:80")`)."""
        o = coerce(other)
        return Egress(tuple(sorted(set(self.rules) | set(o.rules), key=_order)), self.internet_access or o.internet_access,
                      self.record or o.record)

    __add__ = __or__


def coerce(p: Any) -> Egress:
    """An Egress from what a caller may pass: an Egress, None (none()), "none", "internet", a
    list of rule strings, or the JSON form {"internet": bool, "rules": [...]}."""
    if p is None:
        return Egress.none()
    if isinstance(p, Egress):
        return p
    if isinstance(p, str):
        if p == "none":
            return Egress.none()
        if p == "internet":
            return Egress.internet()
        return Egress.allow(p)
    if isinstance(p, dict):
        unknown = set(p) - {"internet", "rules", "record"}
        if unknown:
            raise InvalidArgument(f"unknown egress field(s) {sorted(unknown)}: an egress policy is "
                                  "{'internet': bool, 'rules': [rule, ...], 'record': bool}")
        inet = p.get("internet", False)
        if not isinstance(inet, bool):
            raise InvalidArgument(f"egress 'internet' is true or false, not {inet!r}")
        rules = p.get("rules") or []
        if not isinstance(rules, (list, tuple)):
            raise InvalidArgument(f"egress 'rules' is a list of rule strings, not {rules!r}")
        e = Egress.allow(*rules, record=p.get("record", False))
        return Egress(e.rules, inet, e.record)
    if isinstance(p, (list, tuple)):
        return Egress.allow(*p)
    raise InvalidArgument(f"egress= takes an Egress (Egress.none(), Egress.allow(...), Egress.internet()), not {p!r}")


def _record_flag(v: Any) -> bool:
    if not isinstance(v, bool):
        raise InvalidArgument(f"egress record= is True or False, not {v!r}")
    return v


def parse_ceiling(text: str) -> Egress:
    """The `--egress-ceiling` argument: "none", "internet", or comma-separated rules."""
    t = text.strip()
    if t in ("none", "internet"):
        return coerce(t)
    parts = [r.strip() for r in t.split(",") if r.strip()]
    inet = "internet" in parts
    e = Egress.allow(*[r for r in parts if r != "internet"])
    return Egress(e.rules, inet)


def resolver_spec(r: Any) -> str:
    """The engine's form of a resolver setting: "system", "dns:HOST:PORT", or a {name: [ip]} map."""
    if isinstance(r, dict):
        parts = []
        for name, ips in r.items():
            ips = [ips] if isinstance(ips, str) else list(ips)
            for ip in ips:
                ipaddress.ip_address(ip)  # a bad address raises ValueError here, with the address
            parts.append(f"{name}={','.join(ips)}")
        return "hosts:" + ";".join(parts)
    if isinstance(r, str):
        return r
    raise InvalidArgument(f"egress_resolver is 'system', 'dns:HOST:PORT' or a {{name: [ip, ...]}} map, not {r!r}")


def set_resolver(r: Any) -> None:
    """Where the engine's broker resolves admitted names, for every sandbox of this process."""
    from collimate_core import _core

    try:
        _core._set_egress_resolver(resolver_spec(r))
    except ValueError as e:
        raise InvalidArgument(str(e)) from None
