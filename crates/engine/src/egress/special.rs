//! Special addresses: the ones a name rule or `internet()` never reaches (docs/egress.md).
//!
//! Three sources, all asked when a policy is checked:
//! - the special-purpose table ([`REGISTRY`], `special.tsv`): every entry of IANA's IPv4 and IPv6
//!   Special-Purpose Address Registries, multicast and IPv6's old site-local block. The SDK reads
//!   the same file through the engine, so there is one copy;
//! - IPv4 inside IPv6: an IPv6 address that carries an IPv4 one (IPv4-mapped, IPv4-compatible
//!   `::a.b.c.d`, NAT64 `64:ff9b::/96`, 6to4 `2002::/16`, Teredo) is as special as that address;
//! - the host's own addresses: every address of every interface, both families, read from the
//!   kernel at each check (never cached), so that a service the host binds on 0.0.0.0 or `::` is
//!   not reached through a non-loopback address of the host.
//!
//! An operator may declare some special-purpose ranges public ([`set_public`], or
//! `COLLIMATE_EGRESS_PUBLIC`): a lab network reached by name. Never loopback, link-local or
//! unspecified ranges, and never the host's own addresses.

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr};
use std::sync::{OnceLock, RwLock};

use super::policy::{parse_net, Net};

/// The special-purpose table, one range a line: the block, a tab, its name (`#` comments).
pub const REGISTRY: &str = include_str!("special.tsv");

/// One range of the table.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Range {
    pub net: Net,
    pub name: &'static str,
}

/// The table, parsed once ([`REGISTRY`] is part of the build: a test checks every line parses).
pub fn table() -> &'static [Range] {
    static T: OnceLock<Vec<Range>> = OnceLock::new();
    T.get_or_init(|| {
        registry_lines().filter_map(|(cidr, name)| parse_net(cidr).ok().map(|net| Range { net, name })).collect()
    })
}

fn registry_lines() -> impl Iterator<Item = (&'static str, &'static str)> {
    REGISTRY.lines().filter(|l| !l.trim().is_empty() && !l.starts_with('#')).map(|l| match l.split_once('\t') {
        Some((c, n)) => (c.trim(), n.trim()),
        None => (l.trim(), ""),
    })
}

/// Blocks [`set_public`] refuses to declare public: loopback, unspecified, link-local (metadata).
const NEVER_PUBLIC: &[&str] = &["0.0.0.0/8", "127.0.0.0/8", "169.254.0.0/16", "::/128", "::1/128", "::ffff:0:0/96", "fe80::/10"];

/// Why an operator's public range is refused.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
#[error("egress public range {range:?}: {why}; give CIDR blocks such as \"203.0.113.0/24\" (a lab network), never loopback, link-local or unspecified ones")]
pub struct PublicRangeError {
    pub range: String,
    pub why: String,
}

fn public_ranges() -> &'static RwLock<Vec<Net>> {
    static P: OnceLock<RwLock<Vec<Net>>> = OnceLock::new();
    P.get_or_init(|| {
        let from_env = std::env::var("COLLIMATE_EGRESS_PUBLIC").ok().and_then(|s| parse_public(&s).ok()).unwrap_or_default();
        RwLock::new(from_env)
    })
}

/// Parse a comma-separated list of CIDR blocks an operator declares public.
pub fn parse_public(spec: &str) -> Result<Vec<Net>, PublicRangeError> {
    let mut out = Vec::new();
    for s in spec.split(',').map(str::trim).filter(|s| !s.is_empty()) {
        let bad = |why: String| PublicRangeError { range: s.to_string(), why };
        let n = parse_net(s).map_err(bad)?;
        if let Some(never) = NEVER_PUBLIC.iter().filter_map(|c| parse_net(c).ok()).find(|c| c.overlaps(&n)) {
            return Err(bad(format!("it overlaps {never}, which is never public")));
        }
        out.push(n);
    }
    Ok(out)
}

/// Declare these special-purpose ranges public for every sandbox of this process (an empty list:
/// none, the default). The host's own addresses stay special whatever this says.
pub fn set_public(nets: Vec<Net>) {
    *public_ranges().write().unwrap_or_else(|p| p.into_inner()) = nets;
}

/// The ranges declared public now.
pub fn public() -> Vec<Net> {
    public_ranges().read().unwrap_or_else(|p| p.into_inner()).clone()
}

/// The IPv4 addresses an IPv6 address carries, with how: IPv4-mapped, IPv4-compatible, NAT64's
/// well-known prefix, 6to4, and Teredo (its server and its client's obfuscated address).
pub fn embedded_v4(a: Ipv6Addr) -> Vec<(Ipv4Addr, &'static str)> {
    let v = u128::from(a);
    let low = Ipv4Addr::from(v as u32);
    let mut out = Vec::new();
    if let Some(m) = a.to_ipv4_mapped() {
        out.push((m, "IPv4-mapped"));
    } else if v >> 32 == 0 && v > 1 {
        out.push((low, "IPv4-compatible"));
    } else if v >> 32 == 0x0064_ff9b_0000_0000_0000_0000 {
        out.push((low, "NAT64"));
    } else if v >> 112 == 0x2002 {
        out.push((Ipv4Addr::from((v >> 80) as u32), "6to4"));
    } else if v >> 96 == 0x2001_0000 {
        out.push((Ipv4Addr::from((v >> 64) as u32), "Teredo server"));
        out.push((Ipv4Addr::from(!(v as u32)), "Teredo client"));
    }
    out
}

/// Every address of every interface of the host (both families), read now.
pub fn host_addrs() -> Vec<IpAddr> {
    let mut head: *mut libc::ifaddrs = std::ptr::null_mut();
    // SAFETY: getifaddrs fills `head` with a list we free below with freeifaddrs.
    if unsafe { libc::getifaddrs(&mut head) } != 0 {
        return Vec::new();
    }
    let mut out = Vec::new();
    let mut p = head;
    while !p.is_null() {
        // SAFETY: `p` is a node of the list getifaddrs returned, alive until freeifaddrs.
        let ifa = unsafe { &*p };
        if !ifa.ifa_addr.is_null() {
            // SAFETY: ifa_addr points to a sockaddr whose family says which variant it is.
            let fam = unsafe { (*ifa.ifa_addr).sa_family } as i32;
            if fam == libc::AF_INET {
                // SAFETY: an AF_INET sockaddr is a sockaddr_in.
                let s = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in>() };
                out.push(IpAddr::V4(Ipv4Addr::from(u32::from_be(s.sin_addr.s_addr))));
            } else if fam == libc::AF_INET6 {
                // SAFETY: an AF_INET6 sockaddr is a sockaddr_in6.
                let s = unsafe { &*ifa.ifa_addr.cast::<libc::sockaddr_in6>() };
                out.push(IpAddr::V6(Ipv6Addr::from(s.sin6_addr.s6_addr)));
            }
        }
        p = ifa.ifa_next;
    }
    // SAFETY: the list getifaddrs gave us, freed once.
    unsafe { libc::freeifaddrs(head) };
    out.sort();
    out.dedup();
    out
}

fn in_table(a: IpAddr, public: &[Net]) -> Option<&'static Range> {
    if public.iter().any(|n| n.contains_exact(a)) {
        return None;
    }
    // The most specific entry names it best.
    table().iter().filter(|r| r.net.contains_exact(a)).max_by_key(|r| r.net.prefix)
}

/// Why `a` is special (the registry's name for its range, or that the host has it), or None for
/// a public address.
pub fn reason(a: IpAddr) -> Option<String> {
    reason_with(a, &host_addrs())
}

/// [`reason`] against a given list of the host's addresses (for a check of several addresses).
pub fn reason_with(a: IpAddr, host: &[IpAddr]) -> Option<String> {
    let public = public();
    let a = super::policy::canonical(a);
    if let Some(r) = in_table(a, &public) {
        return Some(format!("{} is special-purpose: {} {}", a, r.net, r.name));
    }
    let mut carried: Vec<(IpAddr, &'static str)> = vec![(a, "")];
    if let IpAddr::V6(v6) = a {
        for (v4, how) in embedded_v4(v6) {
            if let Some(r) = in_table(IpAddr::V4(v4), &public) {
                return Some(format!("{a} carries {v4} ({how}), which is special-purpose: {} {}", r.net, r.name));
            }
            carried.push((IpAddr::V4(v4), how));
        }
    }
    for (c, how) in carried {
        if host.iter().any(|h| super::policy::canonical(*h) == c) {
            return Some(if how.is_empty() {
                format!("{a} is an address of this host")
            } else {
                format!("{a} carries {c} ({how}), an address of this host")
            });
        }
    }
    None
}

/// Whether no address of `n` is special (for narrowing under `internet()`): no table range
/// overlaps it (outside the public ones), it carries no special IPv4 block, and no host address
/// is in it.
pub fn net_is_public(n: &Net) -> bool {
    let public = public();
    if public.iter().any(|p| n.within(p)) {
        return !host_addrs().iter().any(|h| n.contains_exact(super::policy::canonical(*h)));
    }
    if table().iter().any(|r| r.net.overlaps(n)) {
        return false;
    }
    // An IPv4-compatible block (inside ::/96) carries the IPv4 block of its low bits.
    if let IpAddr::V6(v6) = n.addr {
        let v = u128::from(v6);
        if v >> 32 == 0 && n.prefix >= 96 {
            let inner = Net { addr: IpAddr::V4(Ipv4Addr::from(v as u32)), prefix: n.prefix - 96 };
            if !net_is_public(&inner) {
                return false;
            }
        }
    }
    !host_addrs().iter().any(|h| n.contains_exact(super::policy::canonical(*h)))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_line_of_the_registry_parses() {
        let lines: Vec<_> = registry_lines().collect();
        assert_eq!(table().len(), lines.len(), "a line of special.tsv is not a CIDR block: {lines:?}");
        assert!(table().iter().all(|r| !r.name.is_empty()));
    }

    /// Each range: its first and last address are special, the addresses just outside it are not
    /// (unless another range, or an embedded IPv4 address, makes them so).
    #[test]
    fn inside_and_just_outside_each_range() {
        let host = [];
        for r in table() {
            let (lo, hi) = r.net.bounds();
            for a in [lo, hi] {
                assert!(reason_with(a, &host).is_some(), "{a} in {} {}", r.net, r.name);
            }
        }
        // Just outside: special only through another range (never this one).
        for r in table() {
            let (lo, hi) = r.net.bounds();
            let step = |a: IpAddr, up: bool| -> Option<IpAddr> {
                match a {
                    IpAddr::V4(v) => u32::from(v).checked_add_signed(if up { 1 } else { -1 }).map(|x| IpAddr::V4(x.into())),
                    IpAddr::V6(v) => if up { u128::from(v).checked_add(1) } else { u128::from(v).checked_sub(1) }.map(|x| IpAddr::V6(x.into())),
                }
            };
            for a in [step(lo, false), step(hi, true)].into_iter().flatten() {
                if let Some(why) = reason_with(a, &host) {
                    assert!(!why.ends_with(&format!(": {} {}", r.net, r.name)), "{a} is outside {} but {why}", r.net);
                }
            }
        }
        // The gaps, by hand.
        for (a, special) in [
            ("100.63.255.255", false),
            ("100.64.0.0", true),
            ("100.127.255.255", true),
            ("100.128.0.0", false),
            ("198.17.255.255", false),
            ("198.18.0.0", true),
            ("198.19.255.255", true),
            ("198.20.0.0", false),
            ("192.0.0.255", true),
            ("192.0.1.0", false),
            ("fec0::1", true),
            ("100::1", true),
            ("2001:1ff:ffff::1", true),
            ("2001:200::1", false),
        ] {
            assert_eq!(reason_with(a.parse().unwrap(), &host).is_some(), special, "{a}");
        }
    }

    #[test]
    fn ipv4_inside_ipv6_is_unwrapped() {
        let host = [];
        for (a, special) in [
            ("::ffff:169.254.169.254", true),
            ("::169.254.169.254", true),
            ("::8.8.8.8", false),
            ("64:ff9b::a9fe:a9fe", true),
            ("2002:a9fe:a9fe::1", true),
            ("2001:0:4136:e378:8000:63bf:3fff:fdd2", true),
        ] {
            assert_eq!(reason_with(a.parse().unwrap(), &host).is_some(), special, "{a}");
        }
        let why = reason_with("::169.254.169.254".parse().unwrap(), &host).unwrap();
        assert!(why.contains("IPv4-compatible") && why.contains("169.254.0.0/16"), "{why}");
        assert_eq!(embedded_v4("2002:a9fe:a9fe::1".parse().unwrap()), vec![("169.254.169.254".parse().unwrap(), "6to4")]);
        let teredo = embedded_v4("2001:0:4136:e378:8000:63bf:3fff:fdd2".parse().unwrap());
        assert_eq!(teredo[0].0, "65.54.227.120".parse::<Ipv4Addr>().unwrap());
        assert_eq!(teredo[1].0, "192.0.2.45".parse::<Ipv4Addr>().unwrap());
    }

    #[test]
    fn the_hosts_own_addresses_are_special() {
        let host: Vec<IpAddr> = vec!["8.8.4.4".parse().unwrap(), "2600::5".parse().unwrap()];
        assert!(reason_with("8.8.4.4".parse().unwrap(), &host).unwrap().contains("an address of this host"));
        assert!(reason_with("::ffff:8.8.4.4".parse().unwrap(), &host).is_some());
        assert!(reason_with("::8.8.4.4".parse().unwrap(), &host).unwrap().contains("IPv4-compatible"));
        assert!(reason_with("2600::5".parse().unwrap(), &host).is_some());
        assert!(reason_with("8.8.4.5".parse().unwrap(), &host).is_none());
        // The real list has loopback at least.
        assert!(host_addrs().contains(&"127.0.0.1".parse().unwrap()));
    }

    #[test]
    fn public_ranges_are_refused_for_loopback_and_metadata() {
        assert!(parse_public("203.0.113.0/24, 2001:db8::/32").is_ok());
        for bad in ["127.0.0.0/16", "169.254.169.254", "0.0.0.0/0", "::1", "nonsense"] {
            let e = parse_public(bad).unwrap_err();
            assert!(e.to_string().contains("give CIDR blocks"), "{e}");
        }
    }
}
