//! DNS messages (RFC 1035), just what the engine needs: read a guest's query, write the answer
//! the broker decided on, and ask an upstream server (the broker's resolver, when one is set).
//!
//! The guest never reaches a DNS server: its UDP datagrams to port 53 are answered by the VMM
//! itself from the broker's reply (so a name the policy does not admit is NXDOMAIN without a packet
//! leaving the host, and a query cannot carry data out).

use std::net::{IpAddr, Ipv4Addr, Ipv6Addr, SocketAddr, UdpSocket};
use std::time::Duration;

pub const TYPE_A: u16 = 1;
pub const TYPE_AAAA: u16 = 28;
pub const RCODE_NXDOMAIN: u8 = 3;
pub const RCODE_FORMERR: u8 = 1;
pub const RCODE_SERVFAIL: u8 = 2;
/// TTL of the answers the engine gives (short: a policy change should not outlive a cache).
const TTL: u32 = 30;

/// A guest's question.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Query {
    pub id: u16,
    pub rd: bool,
    /// Lower case, without the trailing dot.
    pub name: String,
    pub qtype: u16,
    pub qclass: u16,
    /// The question section as sent (echoed in the answer).
    question: Vec<u8>,
}

/// Read a name at `off`; returns it and the offset after it in the original position (pointers
/// followed, at most 32 of them, so a loop cannot hang us).
fn read_name(msg: &[u8], mut off: usize) -> Option<(String, usize)> {
    let mut labels: Vec<String> = Vec::new();
    let mut end = None;
    let mut jumps = 0;
    loop {
        let len = *msg.get(off)? as usize;
        if len & 0xc0 == 0xc0 {
            let ptr = ((len & 0x3f) << 8) | *msg.get(off + 1)? as usize;
            end.get_or_insert(off + 2);
            jumps += 1;
            if jumps > 32 {
                return None;
            }
            off = ptr;
            continue;
        }
        if len & 0xc0 != 0 {
            return None;
        }
        if len == 0 {
            end.get_or_insert(off + 1);
            break;
        }
        let label = msg.get(off + 1..off + 1 + len)?;
        labels.push(String::from_utf8_lossy(label).to_ascii_lowercase());
        off += 1 + len;
        if labels.iter().map(|l| l.len() + 1).sum::<usize>() > 255 {
            return None;
        }
    }
    Some((labels.join("."), end?))
}

fn u16_at(m: &[u8], i: usize) -> Option<u16> {
    Some(u16::from_be_bytes([*m.get(i)?, *m.get(i + 1)?]))
}

/// Parse a query with one question; None for anything else (the VMM then answers FORMERR when
/// it can read an id).
pub fn parse_query(msg: &[u8]) -> Option<Query> {
    let id = u16_at(msg, 0)?;
    let flags = u16_at(msg, 2)?;
    if flags & 0x8000 != 0 || u16_at(msg, 4)? != 1 {
        return None;
    }
    let (name, after) = read_name(msg, 12)?;
    let qtype = u16_at(msg, after)?;
    let qclass = u16_at(msg, after + 2)?;
    Some(Query { id, rd: flags & 0x0100 != 0, name, qtype, qclass, question: msg[12..after + 4].to_vec() })
}

/// The answer to `q`: `rcode`, and `addrs` as A or AAAA records (those of the question's type).
pub fn answer(q: &Query, rcode: u8, addrs: &[IpAddr]) -> Vec<u8> {
    let records: Vec<&IpAddr> = addrs
        .iter()
        .filter(|a| (q.qtype == TYPE_A && a.is_ipv4()) || (q.qtype == TYPE_AAAA && a.is_ipv6()))
        .collect();
    let mut m = Vec::with_capacity(64 + records.len() * 28);
    m.extend_from_slice(&q.id.to_be_bytes());
    // QR, opcode 0, AA, RD as asked, RA, rcode.
    let flags: u16 = 0x8000 | 0x0400 | if q.rd { 0x0100 } else { 0 } | 0x0080 | rcode as u16;
    m.extend_from_slice(&flags.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    m.extend_from_slice(&(records.len() as u16).to_be_bytes());
    m.extend_from_slice(&0u16.to_be_bytes());
    m.extend_from_slice(&0u16.to_be_bytes());
    m.extend_from_slice(&q.question);
    for a in records {
        m.extend_from_slice(&[0xc0, 12]); // the name: a pointer to the question's
        let (ty, data): (u16, Vec<u8>) = match a {
            IpAddr::V4(v) => (TYPE_A, v.octets().to_vec()),
            IpAddr::V6(v) => (TYPE_AAAA, v.octets().to_vec()),
        };
        m.extend_from_slice(&ty.to_be_bytes());
        m.extend_from_slice(&1u16.to_be_bytes());
        m.extend_from_slice(&TTL.to_be_bytes());
        m.extend_from_slice(&(data.len() as u16).to_be_bytes());
        m.extend_from_slice(&data);
    }
    m
}

/// A FORMERR answer to a message we could not read (if it has an id at all).
pub fn formerr(msg: &[u8]) -> Option<Vec<u8>> {
    let id = u16_at(msg, 0)?;
    let mut m = id.to_be_bytes().to_vec();
    m.extend_from_slice(&(0x8000u16 | RCODE_FORMERR as u16).to_be_bytes());
    m.extend_from_slice(&[0; 8]);
    Some(m)
}

/// Build a query for `name` (the broker's upstream question).
pub fn build_query(id: u16, name: &str, qtype: u16) -> Option<Vec<u8>> {
    let mut m = id.to_be_bytes().to_vec();
    m.extend_from_slice(&0x0100u16.to_be_bytes()); // RD
    m.extend_from_slice(&[0, 1, 0, 0, 0, 0, 0, 0]);
    for label in name.split('.').filter(|l| !l.is_empty()) {
        if label.len() > 63 {
            return None;
        }
        m.push(label.len() as u8);
        m.extend_from_slice(label.as_bytes());
    }
    m.push(0);
    m.extend_from_slice(&qtype.to_be_bytes());
    m.extend_from_slice(&1u16.to_be_bytes());
    Some(m)
}

/// The A/AAAA records of an answer to query `id`; Err(rcode) for an error answer.
pub fn parse_answer(msg: &[u8], id: u16) -> Result<Vec<IpAddr>, u8> {
    let bad = RCODE_SERVFAIL;
    if u16_at(msg, 0).ok_or(bad)? != id {
        return Err(bad);
    }
    let flags = u16_at(msg, 2).ok_or(bad)?;
    let rcode = (flags & 0xf) as u8;
    if rcode != 0 {
        return Err(rcode);
    }
    let qd = u16_at(msg, 4).ok_or(bad)?;
    let an = u16_at(msg, 6).ok_or(bad)?;
    let mut off = 12;
    for _ in 0..qd {
        off = read_name(msg, off).ok_or(bad)?.1 + 4;
    }
    let mut out = Vec::new();
    for _ in 0..an {
        off = read_name(msg, off).ok_or(bad)?.1;
        let ty = u16_at(msg, off).ok_or(bad)?;
        let len = u16_at(msg, off + 8).ok_or(bad)? as usize;
        let data = msg.get(off + 10..off + 10 + len).ok_or(bad)?;
        match (ty, len) {
            (TYPE_A, 4) => out.push(IpAddr::V4(Ipv4Addr::new(data[0], data[1], data[2], data[3]))),
            (TYPE_AAAA, 16) => {
                let mut b = [0u8; 16];
                b.copy_from_slice(data);
                out.push(IpAddr::V6(Ipv6Addr::from(b)));
            }
            _ => {}
        }
        off += 10 + len;
    }
    Ok(out)
}

/// Ask `server` for `name`'s A (or AAAA) records over UDP; at most two tries of `timeout`.
pub fn ask_upstream(server: SocketAddr, name: &str, v6: bool, timeout: Duration) -> std::io::Result<Result<Vec<IpAddr>, u8>> {
    let bind: SocketAddr = if server.is_ipv4() { "0.0.0.0:0".parse().unwrap_or(server) } else { "[::]:0".parse().unwrap_or(server) };
    let sock = UdpSocket::bind(bind)?;
    sock.set_read_timeout(Some(timeout))?;
    sock.connect(server)?;
    let mut idb = [0u8; 2];
    // SAFETY: getrandom into a 2-byte buffer we own (a query id an off-path spoofer cannot guess).
    unsafe { libc::getrandom(idb.as_mut_ptr().cast(), 2, 0) };
    let id = u16::from_ne_bytes(idb);
    let q = build_query(id, name, if v6 { TYPE_AAAA } else { TYPE_A })
        .ok_or_else(|| std::io::Error::new(std::io::ErrorKind::InvalidInput, "bad name"))?;
    let mut buf = [0u8; 4096];
    for _ in 0..2 {
        sock.send(&q)?;
        match sock.recv(&mut buf) {
            Ok(n) => return Ok(parse_answer(&buf[..n], id)),
            Err(e) if matches!(e.kind(), std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut) => continue,
            Err(e) => return Err(e),
        }
    }
    Err(std::io::Error::new(std::io::ErrorKind::TimedOut, "no answer from the upstream DNS server"))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn query_answer_round_trip() {
        let q = build_query(0x1234, "Files.Example.ORG", TYPE_A).unwrap();
        let p = parse_query(&q).unwrap();
        assert_eq!((p.id, p.name.as_str(), p.qtype, p.rd), (0x1234, "files.example.org", TYPE_A, true));
        let a = answer(&p, 0, &["203.0.113.5".parse().unwrap(), "2001:db8::1".parse().unwrap()]);
        assert_eq!(parse_answer(&a, 0x1234), Ok(vec!["203.0.113.5".parse().unwrap()]));
        assert_eq!(parse_answer(&answer(&p, RCODE_NXDOMAIN, &[]), 0x1234), Err(RCODE_NXDOMAIN));
    }

    #[test]
    fn hostile_messages_are_refused_not_followed() {
        // A pointer to itself, truncated messages, garbage.
        let mut m = build_query(1, "a", TYPE_A).unwrap();
        m[12] = 0xc0;
        m[13] = 12;
        assert!(parse_query(&m).is_none());
        for n in 0..12 {
            assert!(parse_query(&m[..n]).is_none());
        }
        assert!(parse_query(&[0xff; 300]).is_none());
    }
}
