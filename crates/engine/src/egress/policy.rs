//! The egress policy of one sandbox: rules, and the questions the broker asks of them.
//!
//! The Rust twin of the SDK's `collimate_core.sdk.egress` (same rule strings, same answers; the
//! Python tests check both agree). A rule is a host name (`index.example.org`), a wildcard
//! (`*.files.example.net`: names strictly below it), an IP address or a CIDR block, each with an
//! optional port (`host:443`, `203.0.113.7:5432`, `[2001:db8::1]:443`). `internet` admits public
//! addresses on any port. Special addresses ([`is_special`]: IANA's special-purpose ranges, IPv4
//! inside IPv6, the host's own addresses; `super::special`) are reached only through an IP or CIDR
//! rule that contains them: never through a name (whatever it resolves to) or `internet`.

use std::fmt;
use std::net::IpAddr;

use serde::{Deserialize, Serialize};

/// Why a rule string is not a rule.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("invalid egress rule {rule:?}: {why}; {HELP}")]
pub struct RuleError {
    pub rule: String,
    pub why: String,
}

/// What a valid rule looks like (the end of every [`RuleError`]).
pub const HELP: &str = "a rule is a host name (\"index.example.org\") or wildcard (\"*.files.example.net\"), either with an \
optional \":port\" (\"host:443\"), or an IP address or CIDR block with an optional port (\"203.0.113.0/24\", \
\"203.0.113.7:5432\", \"[2001:db8::1]:443\", \"2001:db8::/32\"); ports are 1..65535";

/// An IP network: an address with its host bits clear, and a prefix length.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Net {
    pub addr: IpAddr,
    pub prefix: u8,
}

fn bits(a: IpAddr) -> (u128, u8) {
    match a {
        IpAddr::V4(v) => (u32::from(v) as u128, 32),
        IpAddr::V6(v) => (u128::from(v), 128),
    }
}

impl Net {
    fn range(&self) -> (u128, u128, u8) {
        let (v, w) = bits(self.addr);
        // The host part's mask: all of it for a /0 (a shift by the full 128 bits would overflow).
        let host = match w - self.prefix {
            0 => 0,
            128 => u128::MAX,
            n => (1u128 << n) - 1,
        };
        (v & !host, v | host, w)
    }

    /// The first and the last address of the block.
    pub fn bounds(&self) -> (IpAddr, IpAddr) {
        let (lo, hi, w) = self.range();
        if w == 32 {
            (IpAddr::V4((lo as u32).into()), IpAddr::V4((hi as u32).into()))
        } else {
            (IpAddr::V6(lo.into()), IpAddr::V6(hi.into()))
        }
    }

    /// Whether `a`, as written (an IPv4-mapped address is IPv6 here), is in the block.
    pub fn contains_exact(&self, a: IpAddr) -> bool {
        let (lo, hi, w) = self.range();
        let (v, aw) = bits(a);
        w == aw && lo <= v && v <= hi
    }

    pub fn contains(&self, a: IpAddr) -> bool {
        let (lo, hi, w) = self.range();
        let (v, aw) = bits(canonical(a));
        w == aw && lo <= v && v <= hi
    }

    /// Whether every address of `self` is in `other`.
    pub fn within(&self, other: &Net) -> bool {
        let (lo, hi, w) = self.range();
        let (olo, ohi, ow) = other.range();
        w == ow && olo <= lo && hi <= ohi
    }

    pub fn overlaps(&self, other: &Net) -> bool {
        let (lo, hi, w) = self.range();
        let (olo, ohi, ow) = other.range();
        w == ow && lo <= ohi && olo <= hi
    }
}

impl fmt::Display for Net {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let (_, w) = bits(self.addr);
        if self.prefix == w {
            write!(f, "{}", self.addr)
        } else {
            write!(f, "{}/{}", self.addr, self.prefix)
        }
    }
}

/// An IPv4-mapped IPv6 address is its IPv4 address (so `::ffff:127.0.0.1` is loopback).
pub fn canonical(a: IpAddr) -> IpAddr {
    match a {
        IpAddr::V6(v) => match v.to_ipv4_mapped() {
            Some(v4) => IpAddr::V4(v4),
            None => a,
        },
        a => a,
    }
}

/// Special-purpose (IANA's registries, IPv4 inside IPv6 unwrapped) or one of the host's own
/// addresses: never reached through a name rule or `internet` ([`super::special`]).
pub fn is_special(a: IpAddr) -> bool {
    super::special::reason(a).is_some()
}

fn net_is_public(n: &Net) -> bool {
    super::special::net_is_public(n)
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub enum Target {
    /// Exactly this name (lower case, no trailing dot).
    Name(String),
    /// Names strictly below this suffix.
    Wildcard(String),
    Net(Net),
}

#[derive(Clone, Debug, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
pub struct Rule {
    pub target: Target,
    /// None: any port.
    pub port: Option<u16>,
}

impl fmt::Display for Rule {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (&self.target, self.port) {
            (Target::Name(n), None) => write!(f, "{n}"),
            (Target::Name(n), Some(p)) => write!(f, "{n}:{p}"),
            (Target::Wildcard(n), None) => write!(f, "*.{n}"),
            (Target::Wildcard(n), Some(p)) => write!(f, "*.{n}:{p}"),
            (Target::Net(n), None) => write!(f, "{n}"),
            (Target::Net(n), Some(p)) if n.addr.is_ipv6() => write!(f, "[{n}]:{p}"),
            (Target::Net(n), Some(p)) => write!(f, "{n}:{p}"),
        }
    }
}

impl Rule {
    fn port_ok(&self, port: u16) -> bool {
        self.port.is_none_or(|p| p == port)
    }

    /// Whether this name rule admits `name` (lower case, no trailing dot).
    pub fn admits_name(&self, name: &str) -> bool {
        match &self.target {
            Target::Name(n) => n == name,
            Target::Wildcard(s) => name.len() > s.len() + 1 && name.ends_with(s.as_str()) && name.as_bytes()[name.len() - s.len() - 1] == b'.',
            Target::Net(_) => false,
        }
    }

    /// Whether everything this rule admits, `other` admits.
    pub fn within(&self, other: &Rule) -> bool {
        if other.port.is_some() && other.port != self.port {
            return false;
        }
        match (&self.target, &other.target) {
            (Target::Net(a), Target::Net(b)) => a.within(b),
            (Target::Net(_), _) | (_, Target::Net(_)) => false,
            (Target::Name(a), Target::Name(b)) => a == b,
            (Target::Wildcard(_), Target::Name(_)) => false,
            (Target::Name(a), Target::Wildcard(_)) => other.admits_name(a),
            (Target::Wildcard(a), Target::Wildcard(b)) => a == b || other.admits_name(a),
        }
    }
}

fn bad(rule: &str, why: impl Into<String>) -> RuleError {
    RuleError { rule: rule.to_string(), why: why.into() }
}

fn parse_port(rule: &str, t: &str) -> Result<u16, RuleError> {
    let ok = !t.is_empty() && t.bytes().all(|c| c.is_ascii_digit()) && !(t.len() > 1 && t.starts_with('0'));
    match t.parse::<u32>() {
        Ok(p) if ok && (1..=65535).contains(&p) => Ok(p as u16),
        _ => Err(bad(rule, format!("port {t:?} is not a number in 1..65535"))),
    }
}

pub fn parse_net(t: &str) -> Result<Net, String> {
    let (a, p) = match t.split_once('/') {
        Some((a, p)) => (a, Some(p)),
        None => (t, None),
    };
    let addr: IpAddr = a.parse().map_err(|_| format!("{a:?} is not an IP address"))?;
    let w = if addr.is_ipv4() { 32 } else { 128 };
    let prefix = match p {
        None => w,
        Some(p) => {
            let ok = !p.is_empty() && p.bytes().all(|c| c.is_ascii_digit()) && !(p.len() > 1 && p.starts_with('0'));
            match p.parse::<u8>() {
                Ok(v) if ok && v <= w => v,
                _ => return Err(format!("prefix length {p:?} is not a number in 0..{w}")),
            }
        }
    };
    let n = Net { addr, prefix };
    let (lo, _, _) = n.range();
    if lo != bits(addr).0 {
        return Err(format!("{t} has host bits set"));
    }
    Ok(n)
}

fn looks_v4(host: &str) -> bool {
    let head = host.split('/').next().unwrap_or("");
    let parts: Vec<&str> = head.split('.').collect();
    parts.len() == 4 && parts.iter().all(|p| !p.is_empty() && p.bytes().all(|c| c.is_ascii_digit()))
}

fn parse_name(rule: &str, t: &str) -> Result<String, RuleError> {
    let mut name = t.to_ascii_lowercase();
    if name.ends_with('.') {
        name.pop();
    }
    if name.is_empty() || name.len() > 253 {
        return Err(bad(rule, "a host name has 1 to 253 characters"));
    }
    for label in name.split('.') {
        let b = label.as_bytes();
        let inner_ok = b.iter().all(|c| c.is_ascii_lowercase() || c.is_ascii_digit() || *c == b'-' || *c == b'_');
        let edge = |c: u8| c != b'-';
        if b.is_empty() || b.len() > 63 || !inner_ok || !edge(b[0]) || !edge(b[b.len() - 1]) {
            return Err(bad(rule, format!("{label:?} is not a host name label (letters, digits, '-', '_'; 1 to 63)")));
        }
    }
    if name.bytes().all(|c| c.is_ascii_digit() || c == b'.') {
        return Err(bad(rule, "this looks like an IPv4 address but is not one"));
    }
    Ok(name)
}

/// Parse one rule string.
pub fn parse_rule(rule: &str) -> Result<Rule, RuleError> {
    if rule.is_empty() || rule.chars().any(char::is_whitespace) {
        return Err(bad(rule, "empty or contains whitespace"));
    }
    if let Some(rest) = rule.strip_prefix('[') {
        let (host, after) = rest.split_once(']').ok_or_else(|| bad(rule, "'[' without ']'"))?;
        let port = match after {
            "" => None,
            a => Some(parse_port(rule, a.strip_prefix(':').ok_or_else(|| bad(rule, "after ']' comes ':port'"))?)?),
        };
        if !host.contains(':') {
            return Err(bad(rule, "brackets are for IPv6 addresses"));
        }
        return Ok(Rule { target: Target::Net(parse_net(host).map_err(|w| bad(rule, w))?), port });
    }
    let colons = rule.matches(':').count();
    if colons > 1 {
        return Ok(Rule { target: Target::Net(parse_net(rule).map_err(|w| bad(rule, w))?), port: None });
    }
    let (host, port) = match rule.split_once(':') {
        Some((h, p)) => (h, Some(parse_port(rule, p)?)),
        None => (rule, None),
    };
    if looks_v4(host) || (host.contains('/') && !host.starts_with("*.")) {
        return Ok(Rule { target: Target::Net(parse_net(host).map_err(|w| bad(rule, w))?), port });
    }
    if let Some(s) = host.strip_prefix("*.") {
        return Ok(Rule { target: Target::Wildcard(parse_name(rule, s)?), port });
    }
    if host.contains('*') {
        return Err(bad(rule, "a wildcard is '*.' followed by a name"));
    }
    if host.contains('/') {
        return Err(bad(rule, "a CIDR block is an IP address, '/', and a prefix length"));
    }
    Ok(Rule { target: Target::Name(parse_name(rule, host)?), port })
}

/// Which rule admitted a connection (for the log).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Verdict {
    Allowed(String),
    Denied(String),
}

/// One sandbox's policy. `Policy::default()` is no network.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Policy {
    pub rules: Vec<Rule>,
    pub internet: bool,
}

impl Policy {
    pub fn parse(rules: &[String], internet: bool) -> Result<Policy, RuleError> {
        let mut rules = rules.iter().map(|r| parse_rule(r)).collect::<Result<Vec<_>, _>>()?;
        rules.sort();
        rules.dedup();
        Ok(Policy { rules, internet })
    }

    pub fn is_none(&self) -> bool {
        self.rules.is_empty() && !self.internet
    }

    /// Whether the engine answers queries for `name`.
    pub fn admits_name(&self, name: &str) -> bool {
        let n = normal_name(name);
        self.internet || self.rules.iter().any(|r| r.admits_name(&n))
    }

    /// A connection to `addr`:`port`; `names` are the names this sandbox's DNS answers gave `addr`
    /// (never anything the guest said).
    pub fn check(&self, addr: IpAddr, port: u16, names: &[String]) -> Verdict {
        let a = canonical(addr);
        for r in &self.rules {
            if let Target::Net(n) = &r.target {
                if r.port_ok(port) && n.contains(a) {
                    return Verdict::Allowed(r.to_string());
                }
            }
        }
        let admitted = if self.internet {
            Some("internet()".to_string())
        } else {
            names.iter().find_map(|name| self.rules.iter().find(|r| r.port_ok(port) && r.admits_name(name)).map(|r| r.to_string()))
        };
        match admitted {
            // Asked only here, for what a name or internet() would admit (the host's addresses
            // are read now: an interface added since the last check counts).
            Some(rule) => match super::special::reason(a) {
                Some(why) => Verdict::Denied(format!("{why}: refused without an IP rule that contains it ({rule} does not reach special addresses)")),
                None => Verdict::Allowed(rule),
            },
            // Refused either way; the log says why in the words that help most.
            None => match super::special::reason(a) {
                Some(why) => Verdict::Denied(format!("{why}: refused without an IP rule that contains it")),
                None if names.is_empty() => Verdict::Denied("no rule admits this address".into()),
                None => Verdict::Denied("no rule admits this name and port".into()),
            },
        }
    }

    /// A UDP flow to `addr`:`port`: as [`Policy::check`], but only a rule that names this port
    /// admits it (a rule without a port, and `internet()`, are for TCP: UDP is opened port by
    /// port, so that a rule for a host's web server does not admit datagrams to all its ports).
    pub fn check_udp(&self, addr: IpAddr, port: u16, names: &[String]) -> Verdict {
        let ported = Policy { rules: self.rules.iter().filter(|r| r.port == Some(port)).cloned().collect(), internet: false };
        match ported.check(addr, port, names) {
            Verdict::Denied(why) if why.starts_with("no rule") => Verdict::Denied("no rule names this address and port (UDP needs a rule with a port)".into()),
            Verdict::Denied(why) => Verdict::Denied(format!("{why} (UDP needs a rule with a port)")),
            ok => ok,
        }
    }

    /// Whether everything this policy admits, `other` admits (conservative: each rule must fit in
    /// one rule of `other`, or be a name or public block under `other`'s internet).
    pub fn narrower_than(&self, other: &Policy) -> bool {
        if self.internet && !other.internet {
            return false;
        }
        self.rules.iter().all(|r| {
            other.rules.iter().any(|o| r.within(o))
                || (other.internet
                    && match &r.target {
                        Target::Net(n) => net_is_public(n),
                        _ => true,
                    })
        })
    }
}

impl fmt::Display for Policy {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.is_none() {
            return write!(f, "Egress.none()");
        }
        let rules: Vec<String> = self.rules.iter().map(|r| format!("{:?}", r.to_string())).collect();
        match (self.internet, rules.is_empty()) {
            (true, true) => write!(f, "Egress.internet()"),
            (true, false) => write!(f, "Egress.internet() + Egress.allow({})", rules.join(", ")),
            _ => write!(f, "Egress.allow({})", rules.join(", ")),
        }
    }
}

/// A DNS name as rules compare it: lower case, no trailing dot.
pub fn normal_name(name: &str) -> String {
    let mut n = name.to_ascii_lowercase();
    if n.ends_with('.') {
        n.pop();
    }
    n
}

#[cfg(test)]
mod tests {
    use super::*;

    fn p(rules: &[&str]) -> Policy {
        Policy::parse(&rules.iter().map(|s| s.to_string()).collect::<Vec<_>>(), false).unwrap()
    }

    #[test]
    fn the_issue_rules_parse_and_print_back() {
        for r in ["index.example.org", "*.files.example.net", "host:443", "203.0.113.0/24", "203.0.113.7:5432", "[2001:db8::1]:443", "2001:db8::/32"] {
            assert_eq!(parse_rule(r).unwrap().to_string(), r);
        }
        for r in ["", "a b", "1.2.3", "1.2.3.4/33", "x:0", "x:65536", "*x.com", "[::1", "1.2.3.4/24", "a..b", "-a.com", "host:", "[1.2.3.4]:80", "x:080"] {
            let e = parse_rule(r).unwrap_err();
            assert!(e.to_string().contains("a rule is a host name"), "{e}");
        }
    }

    #[test]
    fn udp_needs_a_rule_that_names_the_port() {
        let ip: IpAddr = "11.22.33.7".parse().unwrap();
        let allowed = |pol: &Policy, port, names: &[String]| matches!(pol.check_udp(ip, port, names), Verdict::Allowed(_));
        assert!(allowed(&p(&["11.22.33.7:5353"]), 5353, &[]));
        assert!(!allowed(&p(&["11.22.33.7:5353"]), 5354, &[]));
        assert!(!allowed(&p(&["11.22.33.7", "11.22.33.0/24"]), 5353, &[]));
        assert!(!allowed(&Policy { rules: vec![], internet: true }, 5353, &[]));
        let name = ["svc.test".to_string()];
        assert!(allowed(&p(&["svc.test:5353"]), 5353, &name));
        assert!(!allowed(&p(&["svc.test:5353"]), 5353, &[])); // an IP literal under a name rule
        assert!(!allowed(&p(&["svc.test"]), 5353, &name));
        assert!(matches!(p(&["11.22.33.7"]).check(ip, 5353, &[]), Verdict::Allowed(_))); // TCP: any port
    }

    #[test]
    fn special_addresses_need_an_ip_rule() {
        let inet = Policy { rules: vec![], internet: true };
        for a in [
            "127.0.0.1", "10.1.2.3", "172.16.0.1", "192.168.1.1", "169.254.169.254", "::1", "fd00::1", "fe80::1", "::ffff:127.0.0.1",
            // The gaps issue 32 found: CGNAT, benchmarking, IETF assignments, NAT64, 6to4, IPv4-compatible, site-local...
            "100.64.0.1", "198.18.0.1", "192.0.0.1", "64:ff9b::a9fe:a9fe", "2002:a9fe:a9fe::1", "::169.254.169.254", "::ffff:0:1",
            "fec0::1", "100::1", "2001::1", "203.0.113.5",
        ] {
            let ip: IpAddr = a.parse().unwrap();
            assert!(matches!(inet.check(ip, 80, &[]), Verdict::Denied(_)), "{a}");
            assert!(matches!(p(&["example.org"]).check(ip, 80, &["example.org".into()]), Verdict::Denied(_)), "{a}");
        }
        assert_eq!(p(&["127.0.0.1:8000"]).check("127.0.0.1".parse().unwrap(), 8000, &[]), Verdict::Allowed("127.0.0.1:8000".into()));
        assert!(matches!(p(&["127.0.0.1:8000"]).check("127.0.0.1".parse().unwrap(), 8001, &[]), Verdict::Denied(_)));
        assert!(matches!(inet.check("8.8.8.8".parse().unwrap(), 53, &[]), Verdict::Allowed(_)));
    }

    #[test]
    fn a_name_rule_needs_the_engines_own_answer() {
        let pol = p(&["index.example.org:443", "*.files.example.net"]);
        let ip: IpAddr = "11.22.33.9".parse().unwrap();
        assert!(matches!(pol.check(ip, 443, &[]), Verdict::Denied(_)));
        assert_eq!(pol.check(ip, 443, &["index.example.org".into()]), Verdict::Allowed("index.example.org:443".into()));
        assert!(matches!(pol.check(ip, 80, &["index.example.org".into()]), Verdict::Denied(_)));
        assert!(pol.admits_name("files.files.example.net."));
        assert!(!pol.admits_name("files.example.net"));
        assert!(!pol.admits_name("evil-files.example.net"));
    }

    #[test]
    fn narrower() {
        assert!(p(&["a.index.example.org"]).narrower_than(&p(&["*.index.example.org"])));
        assert!(!p(&["*.index.example.org"]).narrower_than(&p(&["a.index.example.org"])));
        assert!(p(&["203.0.113.0/25:80"]).narrower_than(&p(&["203.0.113.0/24"])));
        assert!(!p(&["203.0.113.0/24"]).narrower_than(&p(&["203.0.113.0/24:80"])));
        let inet = Policy { rules: vec![], internet: true };
        assert!(p(&["8.8.8.0/24", "x.org"]).narrower_than(&inet));
        assert!(!p(&["10.0.0.0/24"]).narrower_than(&inet));
        assert!(!inet.narrower_than(&p(&["x.org"])));
        assert!(Policy::default().narrower_than(&Policy::default()));
    }

    #[test]
    fn whole_address_families() {
        let all6 = p(&["::/0"]);
        let all4 = p(&["0.0.0.0/0:443"]);
        assert!(matches!(all6.check("2001:db8::5".parse().unwrap(), 1, &[]), Verdict::Allowed(_)));
        assert!(matches!(all6.check("::1".parse().unwrap(), 1, &[]), Verdict::Allowed(_)), "an explicit block admits loopback");
        assert!(matches!(all4.check("198.51.100.1".parse().unwrap(), 443, &[]), Verdict::Allowed(_)));
        assert!(matches!(all4.check("198.51.100.1".parse().unwrap(), 80, &[]), Verdict::Denied(_)));
        let inet = Policy { rules: vec![], internet: true };
        assert!(!all6.narrower_than(&inet) && !all4.narrower_than(&inet));
        assert!(p(&["2001:db8::/32"]).narrower_than(&all6));
    }
}
