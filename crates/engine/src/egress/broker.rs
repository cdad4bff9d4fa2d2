//! The broker: the trusted side of every sandbox's network access.
//!
//! One thread in the controller's process (started on first use) serves every sandbox's broker
//! socket (`wire`). For a guest `connect` it checks the sandbox's policy against the address the
//! VMM copied once from guest memory, dials itself (non-blocking, bounded by [`DIAL_TIMEOUT`]) from
//! the host's network namespace, and hands the connected socket to the VMM with SCM_RIGHTS; the VMM
//! then does the guest's I/O on it directly (no relay in the data path). A dial that has ended when
//! its connect returns (loopback, a near peer) is answered in the same turn of the broker thread;
//! one still under way is watched by the broker thread's own poll, never by a thread of its own:
//! a hand-off to another thread on the way back costs more than the dial (see docs/egress.md). For a guest DNS query it
//! answers for names the policy admits by resolving them itself ([`Resolver`]) and remembers which
//! addresses it gave for which name: a name rule admits a connection only to an address the
//! broker's own answer gave for that name, never to an address the guest chose.
//!
//! Flows: the broker keeps a duplicate of each connected socket (to count its bytes with TCP_INFO
//! and to reset it when `set_egress` forbids it) and one end of a liveness pair whose other end
//! lives beside the guest's socket in the VMM: when every VMM process has closed it (the guest
//! closed the socket, or the sandbox died) the broker sees the hang-up and closes its duplicate, so
//! its copy never keeps a connection open.
//!
//! Fail closed: a VMM whose broker is gone gets ECONNREFUSED and NXDOMAIN.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr, ToSocketAddrs};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::sync::{Arc, Mutex, OnceLock};
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use super::dns;
use super::policy::{self, Policy, Verdict};
use super::special;
use super::tape::{self, FlowTape, Outcome, Served, Session};
use super::wire::{self, NetReply, NetRequest};

/// Longest a dial may take before the guest's connect fails with ETIMEDOUT.
pub const DIAL_TIMEOUT: Duration = Duration::from_secs(10);
/// How long one upstream DNS question may take (it is asked twice at most).
const DNS_TIMEOUT: Duration = Duration::from_secs(2);
/// Most log entries one sandbox keeps: the newest; older ones are dropped and counted.
pub const MAX_LOG: usize = 10_000;
/// Most flows (TCP connections and UDP flows) one sandbox holds open at once unless
/// `COLLIMATE_EGRESS_MAX_FLOWS` or [`set_max_flows`] says otherwise. Past it a connect fails with
/// [`FLOW_CAP_ERRNO`] and the log says why. Each flow costs the sandbox's VMM two descriptors
/// (the socket and its liveness end), so the cap stays below [`MAX_FLOWS_LIMIT`].
pub const MAX_FLOWS_DEFAULT: usize = 1024;
/// The largest cap: a VMM process holds at most `vmm::jail::NOFILE` (4,096) descriptors, two a flow
/// plus its own.
pub const MAX_FLOWS_LIMIT: usize = 2000;
/// What the guest's connect returns past the cap: EMFILE ("too many open files").
pub const FLOW_CAP_ERRNO: i32 = libc::EMFILE;

#[derive(Debug, thiserror::Error)]
pub enum BrokerError {
    /// A flow cap out of range.
    #[error("egress flow cap {0}: give a number of flows in 1..={MAX_FLOWS_LIMIT} (each flow holds two of the VMM's 4,096 descriptors)")]
    BadFlowCap(usize),
    /// A policy wider than the sandbox's ceiling (a fork's policy when it was forked).
    #[error("this sandbox is a fork: its egress may not go beyond its policy when it was forked, {ceiling}; {asked} also admits {wider}; pass a policy within {ceiling}")]
    AboveCeiling { ceiling: String, asked: String, wider: String },
    /// Setting up the broker (its thread, its sockets) failed.
    #[error("egress broker: {0}")]
    Setup(String),
    /// A resolver specification that is not one.
    #[error("egress resolver {0:?}: use \"system\", \"dns:HOST:PORT\" (an upstream DNS server) or \"hosts:NAME=IP[,IP];NAME=IP\"")]
    BadResolver(String),
}

/// Where the broker resolves admitted names.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Resolver {
    /// The host's own resolver (getaddrinfo in the controller's process).
    System,
    /// An upstream DNS server asked over UDP.
    Upstream(SocketAddr),
    /// A fixed map (tests, air-gapped hosts): names not in it are NXDOMAIN.
    Hosts(HashMap<String, Vec<IpAddr>>),
}

impl Resolver {
    /// `system`, `dns:HOST:PORT`, or `hosts:NAME=IP[,IP];NAME=IP`.
    pub fn parse(spec: &str) -> Result<Resolver, BrokerError> {
        let bad = || BrokerError::BadResolver(spec.to_string());
        if spec == "system" || spec.is_empty() {
            return Ok(Resolver::System);
        }
        if let Some(a) = spec.strip_prefix("dns:") {
            return a.parse::<SocketAddr>().map(Resolver::Upstream).map_err(|_| bad());
        }
        if let Some(m) = spec.strip_prefix("hosts:") {
            let mut map = HashMap::new();
            for entry in m.split(';').filter(|e| !e.is_empty()) {
                let (name, ips) = entry.split_once('=').ok_or_else(bad)?;
                let ips = ips.split(',').map(|i| i.parse::<IpAddr>().map_err(|_| bad())).collect::<Result<Vec<_>, _>>()?;
                map.insert(policy::normal_name(name), ips);
            }
            return Ok(Resolver::Hosts(map));
        }
        Err(bad())
    }

    fn resolve(&self, name: &str, v6: bool) -> Result<Vec<IpAddr>, String> {
        let keep = |a: &IpAddr| a.is_ipv6() == v6;
        match self {
            Resolver::Hosts(m) => Ok(m.get(name).map(|v| v.iter().copied().filter(keep).collect()).unwrap_or_default()),
            Resolver::Upstream(s) => match dns::ask_upstream(*s, name, v6, DNS_TIMEOUT) {
                Ok(Ok(v)) => Ok(v),
                Ok(Err(dns::RCODE_NXDOMAIN)) => Ok(vec![]),
                Ok(Err(rc)) => Err(format!("upstream DNS answered rcode {rc}")),
                Err(e) => Err(e.to_string()),
            },
            Resolver::System => match (name, 0u16).to_socket_addrs() {
                Ok(it) => {
                    let mut v: Vec<IpAddr> = it.map(|s| s.ip()).filter(keep).collect();
                    v.dedup();
                    Ok(v)
                }
                Err(_) => Ok(vec![]),
            },
        }
    }
}

fn now() -> f64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map(|d| d.as_secs_f64()).unwrap_or(0.0)
}

/// One entry of a sandbox's egress log: a connection attempt or a DNS answer.
#[derive(Clone, Debug, PartialEq)]
pub struct LogEntry {
    /// Its place in the sandbox's log since the sandbox started (0, 1, ...): entries below the
    /// first one kept were dropped (the log keeps the newest [`MAX_LOG`]).
    pub seq: u64,
    /// Seconds since the epoch.
    pub time: f64,
    /// The guest process that asked.
    pub pid: i32,
    /// "connect" or "dns".
    pub kind: &'static str,
    /// The name: the one asked (dns), or the name whose answer gave the address (connect).
    pub name: Option<String>,
    pub addr: Option<IpAddr>,
    pub port: u16,
    /// The rule that admitted it (None when denied).
    pub rule: Option<String>,
    /// "allowed", "denied", "nxdomain", "reset" (a live change forbade it), "failed" (the dial).
    pub verdict: String,
    /// Why, for a denial or failure; the addresses given, for a DNS answer.
    pub detail: String,
    /// Bytes the guest sent that the peer acknowledged, and bytes received.
    pub bytes_out: u64,
    pub bytes_in: u64,
    /// Whether the connection is still open.
    pub open: bool,
}

struct Flow {
    /// Its entry's `seq` in the log.
    log: u64,
    addr: SocketAddr,
    names: Vec<String>,
    /// The broker's copy of the dialled connection (None for a flow served from a recording).
    tcp: Option<OwnedFd>,
    live: OwnedFd,
    /// The byte counts when the broker reset it (a disconnect clears the kernel's counters).
    frozen: Option<(u64, u64)>,
    /// Relayed by a recording (`tape::record`): the guest holds a socket pair's end, not `tcp`.
    relayed: bool,
    /// Served from a recording (`tape::serve`): what was served (no byte left the host).
    served: Option<Arc<Served>>,
}

impl Flow {
    fn bytes(&self) -> (u64, u64) {
        if let Some(f) = self.frozen {
            return f;
        }
        match (&self.tcp, &self.served) {
            (Some(t), _) => tcp_bytes(t.as_raw_fd()),
            (None, Some(s)) => (s.out.load(std::sync::atomic::Ordering::Relaxed), s.inn.load(std::sync::atomic::Ordering::Relaxed)),
            _ => (0, 0),
        }
    }
}

/// A sandbox's log: the newest [`MAX_LOG`] entries, and how many older ones were dropped.
#[derive(Default)]
struct Log {
    entries: std::collections::VecDeque<LogEntry>,
    /// The `seq` of `entries[0]`: as many entries were dropped.
    first: u64,
}

impl Log {
    fn push(&mut self, mut e: LogEntry) -> u64 {
        if self.entries.len() >= MAX_LOG {
            self.entries.pop_front();
            self.first += 1;
        }
        e.seq = self.first + self.entries.len() as u64;
        let seq = e.seq;
        self.entries.push_back(e);
        seq
    }

    fn get_mut(&mut self, seq: u64) -> Option<&mut LogEntry> {
        let i = seq.checked_sub(self.first)?;
        self.entries.get_mut(usize::try_from(i).ok()?)
    }
}

#[derive(Default)]
struct Inner {
    policy: Policy,
    /// The widest policy `set_policy` accepts (a fork's policy when it was forked); None: any.
    ceiling: Option<Policy>,
    /// Dials under way (they become flows): counted against the flow cap.
    dialing: usize,
    /// Address -> the names whose answers gave it (this sandbox's own DNS answers only).
    names: HashMap<IpAddr, Vec<String>>,
    log: Log,
    flows: Vec<Flow>,
    /// Bytes of flows already closed (network bytes: flows served from a recording are not counted).
    done_out: u64,
    done_in: u64,
    closed: bool,
    /// The recording of the exec running now, if its policy records (`tape`).
    tape: Option<Session>,
    /// Its divergences, in words.
    tape_errors: Vec<String>,
}

impl Inner {
    fn push(&mut self, e: LogEntry) -> u64 {
        self.log.push(e)
    }

    /// Why one more flow may not open now (the cap counts open flows and dials under way).
    fn over_cap(&mut self) -> Option<String> {
        let cap = max_flows();
        if self.flows.len() + self.dialing >= cap {
            self.finish_hung_up();
        }
        let open = self.flows.len() + self.dialing;
        (open >= cap).then(|| {
            format!(
                "the sandbox holds {open} open flows, its cap ({cap}; COLLIMATE_EGRESS_MAX_FLOWS or egress.set_max_flows): \
                 the guest's connect failed with EMFILE; close connections first"
            )
        })
    }

    /// Finish the flows whose guest end is closed now. The broker's loop notices a hang-up in
    /// its own time; a guest that closes a connection and opens another at the cap must not get
    /// EMFILE because that loop has not run yet (it had not, on a loaded host).
    fn finish_hung_up(&mut self) {
        let mut i = 0;
        while i < self.flows.len() {
            let mut p = libc::pollfd { fd: self.flows[i].live.as_raw_fd(), events: libc::POLLIN, revents: 0 };
            // SAFETY: poll of one descriptor we hold, without waiting.
            let n = unsafe { libc::poll(&mut p, 1, 0) };
            if n == 1 && p.revents != 0 {
                self.finish(i); // swap_remove: index i holds the next flow now
            } else {
                i += 1;
            }
        }
    }

    fn finish(&mut self, i: usize) {
        let f = self.flows.swap_remove(i);
        let (o, n) = f.bytes();
        if f.served.is_none() {
            self.done_out += o;
            self.done_in += n;
        }
        if let (true, Some(t)) = (f.relayed, &f.tcp) {
            // The relay's threads hold the connection too: end it (the guest has closed its end).
            // SAFETY: shutdown of a socket we hold.
            unsafe { libc::shutdown(t.as_raw_fd(), libc::SHUT_RDWR) };
        }
        if let Some(e) = self.log.get_mut(f.log) {
            e.bytes_out = o;
            e.bytes_in = n;
            e.open = false;
        }
    }
}

/// One sandbox's network state on the trusted side: its policy, its DNS answers, its flows and
/// its log. A fork gets a copy of the policy (never a shared one).
pub struct SandboxNet {
    inner: Mutex<Inner>,
}

/// What a fork of this sandbox may start from.
impl SandboxNet {
    pub fn new(policy: Policy) -> Arc<SandboxNet> {
        Arc::new(SandboxNet { inner: Mutex::new(Inner { policy, ..Default::default() }) })
    }

    /// A fork's: a copy of `parent`'s policy and of its ceiling (never shared).
    pub fn forked(parent: &SandboxNet) -> Arc<SandboxNet> {
        let g = parent.lock();
        Arc::new(SandboxNet { inner: Mutex::new(Inner { policy: g.policy.clone(), ceiling: g.ceiling.clone(), ..Default::default() }) })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|p| p.into_inner())
    }

    pub fn policy(&self) -> Policy {
        self.lock().policy.clone()
    }

    fn is_closed(&self) -> bool {
        self.lock().closed
    }

    /// Replace the policy; open connections the new one forbids are reset (the guest reads
    /// ECONNRESET, the peer gets a RST). Returns how many were reset.
    pub fn set_policy(&self, p: Policy) -> usize {
        let mut g = self.lock();
        g.policy = p;
        Self::enforce(&mut g)
    }

    /// As [`SandboxNet::set_policy`], within the sandbox's ceiling (a fork's policy when it was
    /// forked, [`SandboxNet::seal`]): a wider policy is refused, saying what the ceiling is.
    pub fn set_policy_within(&self, p: Policy) -> Result<usize, BrokerError> {
        let mut g = self.lock();
        if let Some(c) = &g.ceiling {
            if !p.narrower_than(c) {
                let mut wider: Vec<String> = p.rules.iter().filter(|r| !Policy { rules: vec![(*r).clone()], internet: false }.narrower_than(c)).map(|r| r.to_string()).collect();
                if p.internet && !c.internet {
                    wider.insert(0, "internet()".into());
                }
                return Err(BrokerError::AboveCeiling { ceiling: c.to_string(), asked: p.to_string(), wider: wider.join(", ") });
            }
        }
        g.policy = p;
        Ok(Self::enforce(&mut g))
    }

    /// From now on this sandbox's policy may not go beyond what it is now (a fork, when it is
    /// forked: its parent's policy at that moment).
    pub fn seal(&self) {
        let mut g = self.lock();
        g.ceiling = Some(g.policy.clone());
    }

    /// The ceiling [`SandboxNet::seal`] set, if any.
    pub fn ceiling(&self) -> Option<Policy> {
        self.lock().ceiling.clone()
    }

    fn enforce(g: &mut Inner) -> usize {
        let mut reset = 0;
        let mut verdicts = Vec::new();
        let policy = g.policy.clone();
        for (i, f) in g.flows.iter_mut().enumerate() {
            if f.frozen.is_some() {
                continue; // reset already
            }
            if let Verdict::Denied(_) = policy.check(f.addr.ip(), f.addr.port(), &f.names) {
                let Some(tcp) = f.tcp.as_ref() else { continue }; // served from a recording: no network
                f.frozen = Some(tcp_bytes(tcp.as_raw_fd()));
                reset_socket(tcp.as_raw_fd());
                verdicts.push((i, f.log));
                reset += 1;
            }
        }
        for (_, log) in verdicts {
            if let Some(e) = g.log.get_mut(log) {
                e.verdict = "reset".into();
                e.detail = "the sandbox's policy changed and no longer admits this connection".into();
            }
        }
        reset
    }

    /// The log (its newest [`MAX_LOG`] entries), with the live byte counts of open flows, and
    /// how many older entries were dropped.
    pub fn log_and_dropped(&self) -> (Vec<LogEntry>, u64) {
        let g = self.lock();
        let first = g.log.first;
        let mut log: Vec<LogEntry> = g.log.entries.iter().cloned().collect();
        for f in &g.flows {
            let i = f.log.checked_sub(first).and_then(|i| usize::try_from(i).ok());
            if let Some(e) = i.and_then(|i| log.get_mut(i)) {
                let (o, n) = f.bytes();
                e.bytes_out = o;
                e.bytes_in = n;
            }
        }
        (log, first)
    }

    /// The log: see [`SandboxNet::log_and_dropped`].
    pub fn log(&self) -> Vec<LogEntry> {
        self.log_and_dropped().0
    }

    /// Egress bytes (out, in) of every flow this sandbox opened, closed or open.
    pub fn bytes(&self) -> (u64, u64) {
        let g = self.lock();
        g.flows.iter().filter(|f| f.served.is_none()).fold((g.done_out, g.done_in), |(o, n), f| {
            let (a, b) = f.bytes();
            (o + a, n + b)
        })
    }

    /// A sandbox reused for a new owner (a recycled clone): no network, an empty log, no flows.
    pub fn clear(&self) {
        let mut g = self.lock();
        while !g.flows.is_empty() {
            g.finish(0);
        }
        let closed = g.closed;
        *g = Inner { closed, ..Default::default() };
        // (a recycled clone's next owner starts without a ceiling, as a new sandbox does)
    }

    /// Open the recording of the exec about to run (`tape::Session::open`): it replays `path` if
    /// that exists, else records to it. Returns "replay" or "record", and where the exec's
    /// virtual REALTIME is to start (`Session::wall_clock_ns`).
    pub fn begin_tape(&self, path: std::path::PathBuf) -> Result<(&'static str, Option<u64>), tape::TapeError> {
        let s = Session::open(path)?;
        let mode = if matches!(s, Session::Replay { .. }) { "replay" } else { "record" };
        let wall = s.wall_clock_ns();
        let mut g = self.lock();
        g.tape = Some(s);
        g.tape_errors.clear();
        Ok((mode, wall))
    }

    /// The exec is over: save its recording if `save` (or report its replay) and close the tape.
    pub fn end_tape(&self, save: bool) -> Outcome {
        let mut g = self.lock();
        let errors = std::mem::take(&mut g.tape_errors);
        match g.tape.take() {
            Some(s) => {
                drop(g);
                s.close(errors, save)
            }
            None => Outcome { errors, ..Default::default() },
        }
    }

    /// A replayed flow diverged: the reason goes to its log entry and to the exec's outcome.
    fn diverged(&self, log: u64, why: String) {
        let mut g = self.lock();
        if let Some(e) = g.log.get_mut(log) {
            e.verdict = "diverged".into();
            e.detail = format!("replay: {why}; the connection was reset");
        }
        g.tape_errors.push(why);
    }

    /// The sandbox is gone: close every flow (the guest's copies went with its processes).
    pub fn close(&self) {
        let mut g = self.lock();
        g.closed = true;
        while !g.flows.is_empty() {
            g.finish(0);
        }
    }

    fn handle(self: &Arc<Self>, req: NetRequest, reply: OwnedFd) {
        match req {
            NetRequest::Resolve { pid, name, v6 } => self.resolve(pid, name, v6, reply),
            NetRequest::Connect { pid, addr } => self.connect(pid, addr, reply),
            NetRequest::ConnectUdp { pid, addr } => self.connect_udp(pid, addr, reply),
        }
    }

    /// A UDP flow: checked like a TCP connect (a rule that names the port, `Policy::check_udp`),
    /// then a UDP socket connected to the address is handed over: it sends only to that peer and
    /// receives only from it. Denied: ENETUNREACH (what the guest got for UDP before any rule).
    /// Under `record` the broker relays it and writes each datagram down; a replay serves them.
    fn connect_udp(self: &Arc<Self>, pid: i32, addr: SocketAddr, reply: OwnedFd) {
        let ip = policy::canonical(addr.ip());
        let target = SocketAddr::new(ip, addr.port());
        let mut g = self.lock();
        let names = g.names.get(&ip).cloned().unwrap_or_default();
        let verdict = if g.closed { Verdict::Denied("the sandbox is gone".into()) } else { g.policy.check_udp(ip, addr.port(), &names) };
        let mut e = LogEntry {
            seq: 0,
            time: now(),
            pid,
            kind: "udp",
            name: names.first().cloned(),
            addr: Some(ip),
            port: addr.port(),
            rule: None,
            verdict: "denied".into(),
            detail: String::new(),
            bytes_out: 0,
            bytes_in: 0,
            open: false,
        };
        let rule = match verdict {
            Verdict::Denied(why) => {
                e.detail = why;
                g.push(e);
                drop(g);
                refuse(&reply, libc::ENETUNREACH);
                return;
            }
            Verdict::Allowed(r) => r,
        };
        e.rule = Some(rule);
        if let Some(why) = g.over_cap() {
            e.verdict = "capped".into();
            e.detail = why;
            g.push(e);
            drop(g);
            refuse(&reply, FLOW_CAP_ERRNO);
            return;
        }
        // A replay: the n-th flow of the recorded exec (TCP and UDP count alike, in the order the
        // guest asked) must be this datagram flow; it is served from the recording.
        if let Some(Session::Replay { tape, next, .. }) = g.tape.as_mut() {
            let i = *next;
            *next += 1;
            let flow = tape.flows.get(i).cloned();
            let why = match &flow {
                None => Some(format!("UDP to {target}: the recording has {} flow(s), and this is one more", tape.flows.len())),
                Some(f) if !f.datagram || f.addr != Some(target) => Some(format!(
                    "UDP to {target}: flow {i} of the recording was {} to {}",
                    if f.datagram { "UDP" } else { "a TCP connection" },
                    f.addr.map(|a| a.to_string()).unwrap_or_else(|| "nowhere".into())
                )),
                Some(_) => None,
            };
            let (Some(flow), None) = (flow, why.clone()) else {
                let why = why.unwrap_or_default();
                e.verdict = "diverged".into();
                e.detail = format!("replay: {why}; refused");
                g.push(e);
                g.tape_errors.push(why);
                drop(g);
                refuse(&reply, libc::ECONNREFUSED);
                return;
            };
            let (Ok((ours, theirs)), Ok((live_ours, live_theirs))) = (wire::seqpacket_pair(), wire::seqpacket_pair()) else {
                drop(g);
                refuse(&reply, libc::ENOBUFS);
                return;
            };
            let Ok(live_serve) = live_ours.try_clone() else {
                drop(g);
                refuse(&reply, libc::ENOBUFS);
                return;
            };
            if wire::send(reply.as_raw_fd(), &NetReply::Connected { relay: None }, &[theirs.as_raw_fd(), live_theirs.as_raw_fd()]).is_err() {
                return;
            }
            drop((theirs, live_theirs));
            e.verdict = "replayed".into();
            e.detail = "served from the recording; nothing was sent".into();
            e.open = true;
            let log = g.push(e);
            let served = Arc::new(Served::default());
            g.flows.push(Flow { log, addr: target, names, tcp: None, live: live_ours, frozen: None, relayed: false, served: Some(served.clone()) });
            drop(g);
            let net = self.clone();
            let _ = tape::serve(ours, live_serve, flow, served, move |why| net.diverged(log, why));
            broker_wake();
            return;
        }
        let recording = match g.tape.as_mut() {
            Some(Session::Record { flows, size, .. }) => {
                let f = Arc::new(Mutex::new(FlowTape { addr: Some(target), datagram: true, ..Default::default() }));
                flows.push(f.clone());
                Some((f, size.clone()))
            }
            _ => None,
        };
        let sock = udp_connect(target);
        let (sock, (live_ours, live_theirs)) = match (sock, wire::seqpacket_pair()) {
            (Ok(s), Ok(l)) => (s, l),
            (Err(err), _) => {
                let errno = err.raw_os_error().unwrap_or(libc::ENETUNREACH);
                if let Some((f, _)) = &recording {
                    f.lock().unwrap_or_else(|p| p.into_inner()).refused = Some(errno);
                }
                e.verdict = "failed".into();
                e.detail = format!("udp: {err}");
                g.push(e);
                drop(g);
                refuse(&reply, errno);
                return;
            }
            (_, Err(_)) => {
                drop(g);
                refuse(&reply, libc::ENOBUFS);
                return;
            }
        };
        // Recording: the guest gets a SOCK_SEQPACKET pair's end and the broker relays the
        // datagrams (`tape::record_datagrams`); else the connected UDP socket itself.
        let relayed = recording.is_some();
        let guest_end = match recording {
            None => None,
            Some((ftape, size)) => {
                let (Ok((ours, theirs)), Ok(copy)) = (wire::seqpacket_pair(), sock.try_clone()) else {
                    drop(g);
                    refuse(&reply, libc::ENOBUFS);
                    return;
                };
                if tape::record_datagrams(ours, copy, ftape, size).is_err() {
                    drop(g);
                    refuse(&reply, libc::ENOBUFS);
                    return;
                }
                Some(theirs)
            }
        };
        let handed = guest_end.as_ref().map_or(sock.as_raw_fd(), |t| t.as_raw_fd());
        if wire::send(reply.as_raw_fd(), &NetReply::Connected { relay: None }, &[handed, live_theirs.as_raw_fd()]).is_err() {
            return;
        }
        drop((guest_end, live_theirs));
        e.verdict = "allowed".into();
        if relayed {
            e.detail = "recorded".into();
        }
        e.open = true;
        let log = g.push(e);
        g.flows.push(Flow { log, addr: target, names, tcp: Some(sock), live: live_ours, frozen: None, relayed, served: None });
        drop(g);
        broker_wake();
    }

    fn resolve(self: &Arc<Self>, pid: i32, name: String, v6: bool, reply: OwnedFd) {
        let name = policy::normal_name(&name);
        let admitted = {
            let g = self.lock();
            !g.closed && g.policy.admits_name(&name)
        };
        if !admitted {
            self.lock().push(LogEntry {
                seq: 0,
                time: now(),
                pid,
                kind: "dns",
                name: Some(name),
                addr: None,
                port: 53,
                rule: None,
                verdict: "nxdomain".into(),
                detail: "no rule admits this name; nothing was asked upstream".into(),
                bytes_out: 0,
                bytes_in: 0,
                open: false,
            });
            let _ = wire::send(reply.as_raw_fd(), &NetReply::NxDomain, &[]);
            return;
        }
        // Upstream I/O: off the broker thread.
        let net = self.clone();
        let recorded = match &self.lock().tape {
            Some(Session::Replay { tape, .. }) => tape.answer(&name, v6),
            _ => None,
        };
        let job = move || {
            let res = match recorded {
                Some(a) => Ok(a),
                None => resolver().resolve(&name, v6),
            };
            let mut g = net.lock();
            if let (Some(Session::Record { dns, .. }), Ok(a)) = (g.tape.as_mut(), &res) {
                dns.insert((name.clone(), v6), a.clone());
            }
            let (answer, verdict, detail) = match res {
                Ok(addrs) => {
                    // An answer with a special address (or one of the host's: DNS rebinding) is
                    // withheld whole: the name does not resolve.
                    let host = special::host_addrs();
                    let why: Vec<String> = addrs.iter().filter_map(|a| special::reason_with(*a, &host)).collect();
                    let (ok, hidden) = if why.is_empty() { (addrs, vec![]) } else { (vec![], addrs) };
                    for a in &ok {
                        let names = g.names.entry(policy::canonical(*a)).or_default();
                        if !names.contains(&name) {
                            names.push(name.clone());
                        }
                    }
                    let mut detail = ok.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(",");
                    if !hidden.is_empty() {
                        detail = format!(
                            "withheld, the whole answer {}: {}",
                            hidden.iter().map(|a| a.to_string()).collect::<Vec<_>>().join(","),
                            why.join("; ")
                        );
                    }
                    (NetReply::Addrs(ok), "allowed", detail)
                }
                Err(e) => (NetReply::NxDomain, "failed", e),
            };
            let rule = g.policy.rules.iter().find(|r| r.admits_name(&name)).map(|r| r.to_string()).or_else(|| g.policy.internet.then(|| "internet()".to_string()));
            g.push(LogEntry {
                seq: 0,
                time: now(),
                pid,
                kind: "dns",
                name: Some(name),
                addr: None,
                port: 53,
                rule,
                verdict: verdict.into(),
                detail,
                bytes_out: 0,
                bytes_in: 0,
                open: false,
            });
            drop(g);
            let _ = wire::send(reply.as_raw_fd(), &answer, &[]);
        };
        if std::thread::Builder::new().name("collimate-dns".into()).spawn(job).is_err() {
            // No thread: the reply socket closes, the VMM fails closed (SERVFAIL).
        }
    }

    fn connect(self: &Arc<Self>, pid: i32, addr: SocketAddr, reply: OwnedFd) {
        crate::trace::mark("broker.connect");
        let ip = policy::canonical(addr.ip());
        let target = SocketAddr::new(ip, addr.port());
        let (verdict, names) = {
            let g = self.lock();
            let names = g.names.get(&ip).cloned().unwrap_or_default();
            if g.closed {
                (Verdict::Denied("the sandbox is gone".into()), names)
            } else {
                (g.policy.check(ip, addr.port(), &names), names)
            }
        };
        let entry = move |verdict: &str, rule: Option<String>, detail: String, name: Option<String>| LogEntry {
            seq: 0,
            time: now(),
            pid,
            kind: "connect",
            name,
            addr: Some(ip),
            port: addr.port(),
            rule,
            verdict: verdict.into(),
            detail,
            bytes_out: 0,
            bytes_in: 0,
            open: false,
        };
        let rule = match verdict {
            Verdict::Denied(why) => {
                self.lock().push(entry("denied", None, why, names.first().cloned()));
                refuse(&reply, libc::ECONNREFUSED);
                return;
            }
            Verdict::Allowed(rule) => rule,
        };
        {
            let mut g = self.lock();
            if let Some(why) = g.over_cap() {
                g.push(entry("capped", Some(rule), why, names.first().cloned()));
                drop(g);
                refuse(&reply, FLOW_CAP_ERRNO);
                return;
            }
        }
        // The name whose rule admitted it (for the log).
        let name = {
            let g = self.lock();
            names.iter().find(|n| g.policy.rules.iter().any(|r| r.to_string() == rule && r.admits_name(n))).cloned().or_else(|| names.first().cloned())
        };
        // A replay: the n-th connection of the recorded exec is served from the recording, and
        // nothing is dialled (the policy above still decides whether it may be made at all).
        let replay = {
            let mut g = self.lock();
            match g.tape.as_mut() {
                Some(Session::Replay { tape, next, .. }) => {
                    let i = *next;
                    *next += 1;
                    Some(tape.flows.get(i).cloned().map(|f| (i, f)).ok_or(tape.flows.len()))
                }
                _ => None,
            }
        };
        if let Some(r) = replay {
            let why = match &r {
                Err(n) => Some(format!("connect to {target}: the recording has {n} connection(s), and this is one more")),
                Ok((i, f)) if f.addr != Some(target) || f.datagram => Some(format!(
                    "connect to {target}: flow {i} of the recording was {} to {}",
                    if f.datagram { "UDP" } else { "a TCP connection" },
                    f.addr.map(|a| a.to_string()).unwrap_or_else(|| "nowhere".into())
                )),
                Ok(_) => None,
            };
            let flow = match (why, r) {
                (None, Ok((_, flow))) => flow,
                (why, _) => {
                    let why = why.unwrap_or_default();
                    let mut g = self.lock();
                    g.push(entry("diverged", Some(rule), format!("replay: {why}; refused"), name));
                    g.tape_errors.push(why);
                    drop(g);
                    refuse(&reply, libc::ECONNREFUSED);
                    return;
                }
            };
            if let Some(errno) = flow.refused {
                self.lock().push(entry("failed", Some(rule), format!("replay: the recorded dial failed ({})", std::io::Error::from_raw_os_error(errno)), name));
                refuse(&reply, errno);
                return;
            }
            let (Ok((ours, theirs)), Ok((live_ours, live_theirs))) = (stream_pair(), wire::seqpacket_pair()) else {
                refuse(&reply, libc::ENOBUFS);
                return;
            };
            let Ok(live_serve) = live_ours.try_clone() else {
                refuse(&reply, libc::ENOBUFS);
                return;
            };
            let local = flow.local.unwrap_or_else(|| SocketAddr::new(if target.is_ipv4() { IpAddr::from([0u8; 4]) } else { IpAddr::from([0u8; 16]) }, 0));
            if wire::send(reply.as_raw_fd(), &NetReply::Connected { relay: Some(local) }, &[theirs.as_raw_fd(), live_theirs.as_raw_fd()]).is_err() {
                return;
            }
            drop((theirs, live_theirs));
            let served = Arc::new(Served::default());
            let mut g = self.lock();
            let mut e = entry("replayed", Some(rule), "served from the recording; nothing was dialled".into(), name);
            e.open = true;
            let log = g.push(e);
            g.flows.push(Flow { log, addr: target, names, tcp: None, live: live_ours, frozen: None, relayed: false, served: Some(served.clone()) });
            drop(g);
            let net = self.clone();
            let _ = tape::serve(ours, live_serve, flow, served, move |why| net.diverged(log, why));
            broker_wake();
            return;
        }
        // Recording: the flow's place in the recording is the order the guest asked in.
        let recording = {
            let mut g = self.lock();
            match g.tape.as_mut() {
                Some(Session::Record { flows, size, .. }) => {
                    let f = Arc::new(Mutex::new(FlowTape { addr: Some(target), ..Default::default() }));
                    flows.push(f.clone());
                    Some((f, size.clone()))
                }
                _ => None,
            }
        };
        let refused = move |rec: &Option<(Arc<Mutex<FlowTape>>, Arc<std::sync::atomic::AtomicU64>)>, errno: i32| {
            if let Some((f, _)) = rec {
                f.lock().unwrap_or_else(|p| p.into_inner()).refused = Some(errno);
            }
        };
        // What a dial's end does, whenever and wherever it ends (at once, or on the broker
        // thread's poll): a failed dial (its start or its wait) is refused with its errno here.
        let net = self.clone();
        net.lock().dialing += 1;
        let finish = move |sock: std::io::Result<OwnedFd>| {
            net.lock().dialing -= 1;
            let sock = match sock {
                Ok(s) => s,
                Err(e) => {
                    let errno = e.raw_os_error().unwrap_or(libc::ECONNREFUSED);
                    refused(&recording, errno);
                    net.lock().push(entry("failed", Some(rule), format!("dial: {e}"), name));
                    refuse(&reply, errno);
                    return;
                }
            };
            let Ok((live_ours, live_theirs)) = wire::seqpacket_pair() else {
                refused(&recording, libc::ENOBUFS);
                refuse(&reply, libc::ENOBUFS);
                return;
            };
            // Checked again, and registered, under the lock `set_policy` takes: a policy change
            // that raced this dial either comes after (and resets the registered flow) or before
            // (and the connection is refused here, never handed over).
            let mut g = net.lock();
            let still = !g.closed && matches!(g.policy.check(target.ip(), target.port(), &names), Verdict::Allowed(_));
            if !still {
                refused(&recording, libc::ECONNREFUSED);
                g.push(entry("denied", None, "the policy changed while the connection was being made".into(), name));
                drop(g);
                refuse(&reply, libc::ECONNREFUSED);
                return;
            }
            let (tcp, relayed) = match recording {
                None => {
                    if wire::send(reply.as_raw_fd(), &NetReply::Connected { relay: None }, &[sock.as_raw_fd(), live_theirs.as_raw_fd()]).is_err() {
                        return; // the asking process is gone: drop the connection
                    }
                    crate::trace::mark("broker.replied");
                    (sock, false)
                }
                Some((ftape, size)) => {
                    // Recording: the guest gets a socket pair's end and the broker relays.
                    let local = local_addr(sock.as_raw_fd());
                    ftape.lock().unwrap_or_else(|p| p.into_inner()).local = local;
                    let (Ok((ours, theirs)), Ok(copy), Ok(live_relay)) = (stream_pair(), sock.try_clone(), live_ours.try_clone()) else {
                        refuse(&reply, libc::ENOBUFS);
                        return;
                    };
                    // SAFETY: fcntl on our socket: the relay's reads and writes block.
                    unsafe { libc::fcntl(sock.as_raw_fd(), libc::F_SETFL, 0) };
                    let relay = Some(local.unwrap_or(target));
                    if wire::send(reply.as_raw_fd(), &NetReply::Connected { relay }, &[theirs.as_raw_fd(), live_theirs.as_raw_fd()]).is_err() {
                        return;
                    }
                    drop(theirs);
                    if tape::record(ours, sock, live_relay, ftape, size).is_err() {
                        return; // no thread: the guest's end reads EOF
                    }
                    (copy, true)
                }
            };
            drop(live_theirs);
            let mut e = entry("allowed", Some(rule), if relayed { "recorded".into() } else { String::new() }, name);
            e.open = true;
            let log = g.push(e);
            g.flows.push(Flow { log, addr: target, names, tcp: Some(tcp), live: live_ours, frozen: None, relayed, served: None });
            drop(g);
            broker_wake();
        };
        match dial_start(target) {
            Err(e) => finish(Err(e)),
            Ok(Dial::Done(s)) => finish(Ok(s)),
            // A loopback or LAN peer has usually answered the SYN before connect returns: end the
            // dial now, in this turn of the broker thread (no hand-off to another thread on the
            // way back to the VMM). Otherwise the broker thread's poll watches it.
            Ok(Dial::Pending(s)) => match dial_done(&s, 0) {
                Some(r) => finish(r.map(|_| s)),
                None => {
                    if let Ok(b) = broker() {
                        let deadline = Instant::now() + DIAL_TIMEOUT;
                        b.dials.lock().unwrap_or_else(|p| p.into_inner()).push(PendingDial { sock: s, deadline, finish: Box::new(finish) });
                    }
                }
            },
        }
    }

    fn live_fds(&self) -> Vec<RawFd> {
        self.lock().flows.iter().map(|f| f.live.as_raw_fd()).collect()
    }

    fn hung_up(&self, live: RawFd) {
        let mut g = self.lock();
        if let Some(i) = g.flows.iter().position(|f| f.live.as_raw_fd() == live) {
            g.finish(i);
        }
    }
}

/// A UDP socket connected to `addr` (a connect that sends nothing: it completes at once).
fn udp_connect(addr: SocketAddr) -> std::io::Result<OwnedFd> {
    let fam = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: socket with constant arguments; the result is checked and owned below.
    let fd = unsafe { libc::socket(fam, libc::SOCK_DGRAM | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let (sa, len) = sockaddr(addr);
    // SAFETY: connect with a sockaddr_storage holding `len` valid bytes.
    if unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_storage).cast(), len) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(sock)
}

/// An AF_UNIX stream pair with close-on-exec (a relayed or replayed flow's two ends).
fn stream_pair() -> std::io::Result<(OwnedFd, OwnedFd)> {
    let mut sv = [0 as RawFd; 2];
    // SAFETY: socketpair writes two descriptors into `sv`.
    if unsafe { libc::socketpair(libc::AF_UNIX, libc::SOCK_STREAM | libc::SOCK_CLOEXEC, 0, sv.as_mut_ptr()) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: two fresh descriptors we own.
    Ok(unsafe { (OwnedFd::from_raw_fd(sv[0]), OwnedFd::from_raw_fd(sv[1])) })
}

/// The local address of a connected TCP socket.
fn local_addr(fd: RawFd) -> Option<SocketAddr> {
    // SAFETY: a zeroed sockaddr_storage is valid; the kernel fills at most `len` bytes.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::sockaddr_storage>() as libc::socklen_t;
    // SAFETY: getsockname on our socket into the buffer above.
    if unsafe { libc::getsockname(fd, (&mut ss as *mut libc::sockaddr_storage).cast(), &mut len) } != 0 {
        return None;
    }
    // SAFETY: reading the variant the family says the kernel wrote.
    unsafe {
        match ss.ss_family as i32 {
            libc::AF_INET => {
                let s = &*(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in>();
                Some(SocketAddr::new(IpAddr::from(u32::from_be(s.sin_addr.s_addr).to_be_bytes()), u16::from_be(s.sin_port)))
            }
            libc::AF_INET6 => {
                let s = &*(&ss as *const libc::sockaddr_storage).cast::<libc::sockaddr_in6>();
                Some(SocketAddr::new(IpAddr::from(s.sin6_addr.s6_addr), u16::from_be(s.sin6_port)))
            }
            _ => None,
        }
    }
}

/// (bytes acknowledged by the peer, bytes received) of a TCP socket.
fn tcp_bytes(fd: RawFd) -> (u64, u64) {
    // SAFETY: a zeroed tcp_info is valid; getsockopt fills at most `len` bytes of it.
    let mut ti: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: TCP_INFO into a buffer of `len` bytes we own.
    let r = unsafe { libc::getsockopt(fd, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut ti as *mut libc::tcp_info).cast(), &mut len) };
    if r != 0 {
        return (0, 0);
    }
    // The kernel's count of acknowledged bytes includes our SYN, and our FIN once it is
    // acknowledged (FIN_WAIT2, TIME_WAIT): neither is data.
    let fin_acked = matches!(ti.tcpi_state, 5 | 6);
    (ti.tcpi_bytes_acked.saturating_sub(1 + fin_acked as u64), ti.tcpi_bytes_received)
}

/// Reset a connection every holder shares: connect(AF_UNSPEC) disconnects a TCP socket with a RST
/// and leaves ECONNRESET pending for the next call on it (shutdown as a fallback).
fn reset_socket(fd: RawFd) {
    let mut ty: i32 = 0;
    let mut len = 4 as libc::socklen_t;
    // SAFETY: SO_TYPE into an int we own.
    unsafe { libc::getsockopt(fd, libc::SOL_SOCKET, libc::SO_TYPE, (&mut ty as *mut i32).cast(), &mut len) };
    if ty == libc::SOCK_DGRAM {
        // A UDP flow: disconnecting it would let it receive from anyone; shut it instead.
        // SAFETY: shutdown on a socket we hold.
        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
        return;
    }
    // SAFETY: a zeroed sockaddr with family AF_UNSPEC.
    let mut sa: libc::sockaddr = unsafe { std::mem::zeroed() };
    sa.sa_family = libc::AF_UNSPEC as u16;
    // SAFETY: connect on a socket we hold, with the sockaddr above.
    let r = unsafe { libc::connect(fd, &sa, std::mem::size_of::<libc::sockaddr>() as u32) };
    if r != 0 {
        // SAFETY: shutdown on a socket we hold.
        unsafe { libc::shutdown(fd, libc::SHUT_RDWR) };
    }
}

enum Dial {
    Done(OwnedFd),
    Pending(OwnedFd),
}

fn dial_start(addr: SocketAddr) -> std::io::Result<Dial> {
    let fam = if addr.is_ipv4() { libc::AF_INET } else { libc::AF_INET6 };
    // SAFETY: socket with constant arguments; the result is checked and owned below.
    let fd = unsafe { libc::socket(fam, libc::SOCK_STREAM | libc::SOCK_NONBLOCK | libc::SOCK_CLOEXEC, 0) };
    if fd < 0 {
        return Err(std::io::Error::last_os_error());
    }
    // SAFETY: a fresh descriptor we own.
    let sock = unsafe { OwnedFd::from_raw_fd(fd) };
    let (sa, len) = sockaddr(addr);
    // SAFETY: connect with a sockaddr_storage holding `len` valid bytes.
    let r = unsafe { libc::connect(fd, (&sa as *const libc::sockaddr_storage).cast(), len) };
    if r == 0 {
        return Ok(Dial::Done(sock));
    }
    let e = std::io::Error::last_os_error();
    if e.raw_os_error() == Some(libc::EINPROGRESS) {
        return Ok(Dial::Pending(sock));
    }
    Err(e)
}

/// How a dial under way ended, if it has (waiting at most `timeout_ms`): connected, or its error.
fn dial_done(sock: &OwnedFd, timeout_ms: i32) -> Option<std::io::Result<()>> {
    let mut pfd = libc::pollfd { fd: sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 };
    // SAFETY: one valid pollfd.
    if unsafe { libc::poll(&mut pfd, 1, timeout_ms) } <= 0 {
        return None;
    }
    Some(dial_error(sock))
}

/// A dial's outcome once its socket is writable (or in error): SO_ERROR, read once.
fn dial_error(sock: &OwnedFd) -> std::io::Result<()> {
    let mut err: i32 = 0;
    let mut len = 4 as libc::socklen_t;
    // SAFETY: SO_ERROR into an int we own.
    unsafe { libc::getsockopt(sock.as_raw_fd(), libc::SOL_SOCKET, libc::SO_ERROR, (&mut err as *mut i32).cast(), &mut len) };
    if err == 0 {
        Ok(())
    } else {
        Err(std::io::Error::from_raw_os_error(err))
    }
}

/// Refuse a request with `errno` (a closed reply socket means the asker is gone: nothing to do).
fn refuse(reply: &OwnedFd, errno: i32) {
    let _ = wire::send(reply.as_raw_fd(), &NetReply::Refused { errno }, &[]);
}

/// A socket address as the kernel takes it.
pub fn sockaddr(addr: SocketAddr) -> (libc::sockaddr_storage, libc::socklen_t) {
    // SAFETY: a zeroed sockaddr_storage is valid; we fill the variant that fits.
    let mut ss: libc::sockaddr_storage = unsafe { std::mem::zeroed() };
    let len = match addr {
        SocketAddr::V4(a) => {
            // SAFETY: sockaddr_storage is large and aligned enough for sockaddr_in.
            let sin = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in>() };
            sin.sin_family = libc::AF_INET as u16;
            sin.sin_port = a.port().to_be();
            sin.sin_addr.s_addr = u32::from_ne_bytes(a.ip().octets());
            std::mem::size_of::<libc::sockaddr_in>()
        }
        SocketAddr::V6(a) => {
            // SAFETY: as above, for sockaddr_in6.
            let sin6 = unsafe { &mut *(&mut ss as *mut libc::sockaddr_storage).cast::<libc::sockaddr_in6>() };
            sin6.sin6_family = libc::AF_INET6 as u16;
            sin6.sin6_port = a.port().to_be();
            sin6.sin6_addr.s6_addr = a.ip().octets();
            sin6.sin6_scope_id = a.scope_id();
            std::mem::size_of::<libc::sockaddr_in6>()
        }
    };
    (ss, len as libc::socklen_t)
}

// The broker thread and its registry.

struct Registered {
    sock: OwnedFd,
    net: Arc<SandboxNet>,
}

/// A dial under way that did not end at once: the broker thread's poll watches its socket and
/// runs `finish` when it connects, fails, or passes its deadline ([`DIAL_TIMEOUT`]).
struct PendingDial {
    sock: OwnedFd,
    deadline: Instant,
    finish: Box<dyn FnOnce(std::io::Result<OwnedFd>) + Send>,
}

struct Broker {
    reg: Mutex<Vec<Registered>>,
    /// Dials started by requests this turn (only the broker thread serves requests); the loop
    /// takes them into its own list before it polls.
    dials: Mutex<Vec<PendingDial>>,
    /// Signalled each time the broker thread has dropped the registrations of closed sandboxes.
    swept: std::sync::Condvar,
    wake: OwnedFd,
    resolver: Mutex<Resolver>,
}

static BROKER: OnceLock<std::result::Result<Broker, String>> = OnceLock::new();

fn broker() -> Result<&'static Broker, BrokerError> {
    BROKER
        .get_or_init(|| {
            // SAFETY: eventfd with constant flags; the result is checked and owned below.
            let fd = unsafe { libc::eventfd(0, libc::EFD_CLOEXEC | libc::EFD_NONBLOCK) };
            if fd < 0 {
                return Err(format!("eventfd: {}", std::io::Error::last_os_error()));
            }
            let resolver = std::env::var("COLLIMATE_EGRESS_RESOLVER").ok().and_then(|s| Resolver::parse(&s).ok()).unwrap_or(Resolver::System);
            // SAFETY: a fresh descriptor we own.
            let wake = unsafe { OwnedFd::from_raw_fd(fd) };
            let b = Broker {
                reg: Mutex::new(Vec::new()),
                dials: Mutex::new(Vec::new()),
                swept: std::sync::Condvar::new(),
                wake,
                resolver: Mutex::new(resolver),
            };
            std::thread::Builder::new().name("collimate-broker".into()).spawn(broker_loop).map_err(|e| format!("thread: {e}"))?;
            Ok(b)
        })
        .as_ref()
        .map_err(|e| BrokerError::Setup(e.clone()))
}

fn resolver() -> Resolver {
    match broker() {
        Ok(b) => b.resolver.lock().unwrap_or_else(|p| p.into_inner()).clone(),
        Err(_) => Resolver::Hosts(HashMap::new()),
    }
}

static MAX_FLOWS: std::sync::atomic::AtomicUsize = std::sync::atomic::AtomicUsize::new(0);

/// The flow cap of every sandbox of this process ([`MAX_FLOWS_DEFAULT`] unless
/// `COLLIMATE_EGRESS_MAX_FLOWS` or [`set_max_flows`] says otherwise).
pub fn max_flows() -> usize {
    use std::sync::atomic::Ordering;
    match MAX_FLOWS.load(Ordering::Relaxed) {
        0 => {
            let n = std::env::var("COLLIMATE_EGRESS_MAX_FLOWS")
                .ok()
                .and_then(|s| s.trim().parse::<usize>().ok())
                .filter(|n| (1..=MAX_FLOWS_LIMIT).contains(n))
                .unwrap_or(MAX_FLOWS_DEFAULT);
            let _ = MAX_FLOWS.compare_exchange(0, n, Ordering::Relaxed, Ordering::Relaxed);
            MAX_FLOWS.load(Ordering::Relaxed)
        }
        n => n,
    }
}

/// Set the flow cap of every sandbox of this process (flows already open stay open).
pub fn set_max_flows(n: usize) -> Result<(), BrokerError> {
    if !(1..=MAX_FLOWS_LIMIT).contains(&n) {
        return Err(BrokerError::BadFlowCap(n));
    }
    MAX_FLOWS.store(n, std::sync::atomic::Ordering::Relaxed);
    Ok(())
}

/// Start the broker thread now (it starts on first use otherwise).
pub fn start() -> Result<(), BrokerError> {
    broker().map(|_| ())
}

/// Where admitted names are resolved from now on, for every sandbox of this process.
pub fn set_resolver(r: Resolver) -> Result<(), BrokerError> {
    *broker()?.resolver.lock().unwrap_or_else(|p| p.into_inner()) = r;
    Ok(())
}

fn broker_wake() {
    if let Ok(b) = broker() {
        let one: u64 = 1;
        // SAFETY: an 8-byte write to our eventfd.
        unsafe { libc::write(b.wake.as_raw_fd(), (&one as *const u64).cast(), 8) };
    }
}

/// Serve `net` on a new broker socket; the returned end goes to the sandbox's VMM.
pub fn register(net: Arc<SandboxNet>) -> Result<OwnedFd, BrokerError> {
    let b = broker()?;
    let (ours, theirs) = wire::seqpacket_pair().map_err(|e| BrokerError::Setup(e.to_string()))?;
    // SAFETY: fcntl on our own descriptor.
    unsafe { libc::fcntl(ours.as_raw_fd(), libc::F_SETFL, libc::O_NONBLOCK) };
    b.reg.lock().unwrap_or_else(|p| p.into_inner()).push(Registered { sock: ours, net });
    broker_wake();
    Ok(theirs)
}

/// A closed sandbox (`SandboxNet::close`) leaves the broker: wait until the broker thread has
/// dropped its socket (it alone may close what it polls), so that a destroyed sandbox holds no
/// descriptor when its destroy returns. Bounded: at most a second.
pub fn forget(net: &Arc<SandboxNet>) {
    let Ok(b) = broker() else { return };
    let deadline = Instant::now() + Duration::from_secs(1);
    let mut reg = b.reg.lock().unwrap_or_else(|p| p.into_inner());
    while reg.iter().any(|r| Arc::ptr_eq(&r.net, net)) {
        let left = deadline.saturating_duration_since(Instant::now());
        if left.is_zero() {
            return;
        }
        broker_wake();
        reg = match b.swept.wait_timeout(reg, left.min(Duration::from_millis(50))) {
            Ok((g, _)) => g,
            Err(p) => p.into_inner().0,
        };
    }
}

fn broker_loop() {
    // Wait until the OnceLock holds the broker (we are started from inside its initializer).
    let b = loop {
        match BROKER.get() {
            Some(Ok(b)) => break b,
            Some(Err(_)) => return,
            None => std::thread::sleep(Duration::from_millis(1)),
        }
    };
    let mut dials: Vec<PendingDial> = Vec::new();
    loop {
        // What to watch: the wake-up, each sandbox's socket, each flow's liveness end, each dial
        // under way. Closed sandboxes leave first (here, between polls: nothing closes a
        // descriptor being polled).
        dials.append(&mut b.dials.lock().unwrap_or_else(|p| p.into_inner()));
        let (socks, nets): (Vec<RawFd>, Vec<Arc<SandboxNet>>) = {
            let mut reg = b.reg.lock().unwrap_or_else(|p| p.into_inner());
            let before = reg.len();
            reg.retain(|r| !r.net.is_closed());
            if reg.len() != before {
                b.swept.notify_all();
            }
            reg.iter().map(|r| (r.sock.as_raw_fd(), r.net.clone())).unzip()
        };
        let mut pfds = vec![libc::pollfd { fd: b.wake.as_raw_fd(), events: libc::POLLIN, revents: 0 }];
        pfds.extend(socks.iter().map(|&fd| libc::pollfd { fd, events: libc::POLLIN, revents: 0 }));
        let mut lives: Vec<(usize, RawFd)> = Vec::new();
        for (i, n) in nets.iter().enumerate() {
            for fd in n.live_fds() {
                lives.push((i, fd));
                pfds.push(libc::pollfd { fd, events: libc::POLLIN, revents: 0 });
            }
        }
        let first_dial = pfds.len();
        pfds.extend(dials.iter().map(|d| libc::pollfd { fd: d.sock.as_raw_fd(), events: libc::POLLOUT, revents: 0 }));
        let now = Instant::now();
        let timeout = dials.iter().map(|d| d.deadline.saturating_duration_since(now)).min().unwrap_or(Duration::from_secs(1)).min(Duration::from_secs(1));
        // SAFETY: `pfds` is a valid array of pollfds.
        let r = unsafe { libc::poll(pfds.as_mut_ptr(), pfds.len() as libc::nfds_t, timeout.as_millis() as i32 + 1) };
        if !dials.is_empty() {
            // Dials that ended (or ran out of time) are finished here, in the order they started.
            let now = Instant::now();
            let mut left = Vec::with_capacity(dials.len());
            for (k, d) in std::mem::take(&mut dials).into_iter().enumerate() {
                let PendingDial { sock, deadline, finish } = d;
                if r > 0 && pfds[first_dial + k].revents != 0 {
                    let res = dial_error(&sock);
                    finish(res.map(|_| sock));
                } else if now >= deadline {
                    finish(Err(std::io::Error::from_raw_os_error(libc::ETIMEDOUT)));
                } else {
                    left.push(PendingDial { sock, deadline, finish });
                }
            }
            dials = left;
        }
        if r <= 0 {
            continue;
        }
        if pfds[0].revents != 0 {
            let mut v: u64 = 0;
            // SAFETY: an 8-byte read from our eventfd.
            unsafe { libc::read(b.wake.as_raw_fd(), (&mut v as *mut u64).cast(), 8) };
        }
        let mut gone = Vec::new();
        for (i, &fd) in socks.iter().enumerate() {
            let re = pfds[1 + i].revents;
            if re & libc::POLLIN != 0 {
                // Serve what is queued (bounded, so one sandbox cannot starve the rest).
                for _ in 0..64 {
                    match wire::recv::<NetRequest>(fd) {
                        Ok((req, mut fds)) if fds.len() == 1 => nets[i].handle(req, fds.remove(0)),
                        Ok(_) => {}
                        Err(wire::WireError::Sys { source, .. }) if source.raw_os_error() == Some(libc::EAGAIN) => break,
                        Err(wire::WireError::Closed) => {
                            gone.push(fd);
                            break;
                        }
                        Err(_) => {}
                    }
                }
            } else if re & (libc::POLLHUP | libc::POLLERR) != 0 {
                gone.push(fd);
            }
        }
        for (k, (i, fd)) in lives.iter().enumerate() {
            if pfds[1 + socks.len() + k].revents != 0 {
                nets[*i].hung_up(*fd);
            }
        }
        if !gone.is_empty() {
            // Every VMM process of these sandboxes is gone: so are their flows.
            let mut reg = b.reg.lock().unwrap_or_else(|p| p.into_inner());
            reg.retain(|r| {
                let keep = !gone.contains(&r.sock.as_raw_fd());
                if !keep {
                    r.net.close();
                }
                keep
            });
            b.swept.notify_all();
        }
    }
}

/// Sandboxes the broker serves now (for leak tests).
pub fn registered() -> usize {
    broker().map(|b| b.reg.lock().unwrap_or_else(|p| p.into_inner()).len()).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::net::TcpListener;

    fn policy(rules: &[&str]) -> Policy {
        Policy::parse(&rules.iter().map(|s| s.to_string()).collect::<Vec<_>>(), false).unwrap()
    }

    /// The VMM's side of a connect, as `guestos::files::inet` makes it.
    fn connect(vmm: &OwnedFd, addr: SocketAddr) -> (NetReply, Vec<OwnedFd>) {
        wire::call(vmm.as_raw_fd(), &NetRequest::Connect { pid: 7, addr }, 5000).unwrap()
    }

    #[test]
    fn a_connect_is_checked_dialled_handed_over_logged_and_closed() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().unwrap();
        let net = SandboxNet::new(Policy::default());
        let vmm = register(net.clone()).unwrap();
        // No network by default: refused, logged.
        let (r, fds) = connect(&vmm, addr);
        assert!(matches!(r, NetReply::Refused { errno: libc::ECONNREFUSED }) && fds.is_empty());
        // An IP rule for it: the connected socket and the liveness end come back.
        net.set_policy(policy(&[&format!("127.0.0.1:{}", addr.port())]));
        let (r, mut fds) = connect(&vmm, addr);
        assert!(matches!(r, NetReply::Connected { relay: None }) && fds.len() == 2);
        let live = fds.pop().unwrap();
        let mut tcp = std::net::TcpStream::from(fds.pop().unwrap());
        let (mut peer, _) = server.accept().unwrap();
        tcp.write_all(b"ping").unwrap();
        let mut b = [0u8; 4];
        peer.read_exact(&mut b).unwrap();
        peer.write_all(b"pong!").unwrap();
        let mut got = [0u8; 5];
        tcp.read_exact(&mut got).unwrap();
        assert_eq!(&got, b"pong!");
        let log = net.log();
        assert_eq!(log.iter().map(|e| e.verdict.as_str()).collect::<Vec<_>>(), ["denied", "allowed"]);
        assert_eq!(log[1].pid, 7);
        assert!(log[1].open);
        // The guest closes it (its socket and the liveness end): the broker lets go of its copy,
        // so the peer sees EOF, and the bytes stay in the log.
        drop(tcp);
        drop(live);
        peer.set_read_timeout(Some(Duration::from_secs(5))).unwrap();
        let mut rest = Vec::new();
        peer.read_to_end(&mut rest).unwrap();
        for _ in 0..200 {
            if !net.log()[1].open {
                break;
            }
            std::thread::sleep(Duration::from_millis(10));
        }
        let e = &net.log()[1];
        assert!(!e.open && e.bytes_out == 4 && e.bytes_in == 5, "{e:?}");
        assert_eq!(net.bytes(), (4, 5));
    }

    #[test]
    fn a_dial_that_does_not_end_at_once_is_finished_by_the_broker_thread() {
        use std::os::fd::AsRawFd;
        // A listener whose accept queue is full drops SYNs: the broker's dial stays under way
        // (SYN_SENT) until the queue has room and the SYN is sent again (about a second later).
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().unwrap();
        // SAFETY: listen on our own socket, with the smallest queue (one connection).
        assert_eq!(unsafe { libc::listen(server.as_raw_fd(), 0) }, 0);
        let first = std::net::TcpStream::connect(addr).unwrap(); // fills the queue
        let net = SandboxNet::new(policy(&[&format!("127.0.0.1:{}", addr.port())]));
        let vmm = register(net.clone()).unwrap();
        let ours = wire::start(vmm.as_raw_fd(), &NetRequest::Connect { pid: 3, addr }).unwrap();
        // Another connect is served meanwhile (the broker thread does not wait on the dial).
        let other = TcpListener::bind("127.0.0.1:0").unwrap();
        net.set_policy(policy(&[&format!("127.0.0.1:{}", addr.port()), &format!("127.0.0.1:{}", other.local_addr().unwrap().port())]));
        let (r, fds) = connect(&vmm, other.local_addr().unwrap());
        assert!(matches!(r, NetReply::Connected { relay: None }) && fds.len() == 2);
        // Room in the queue: the dial ends and its socket comes back on the first request's reply.
        let (_a, _) = server.accept().unwrap();
        let (r, fds) = wire::answer(&ours, 8000).unwrap();
        assert!(matches!(r, NetReply::Connected { relay: None }) && fds.len() == 2, "{r:?}");
        let (mut peer, _) = server.accept().unwrap();
        let mut tcp = std::net::TcpStream::from(fds.into_iter().next().unwrap());
        tcp.write_all(b"late").unwrap();
        let mut b = [0u8; 4];
        peer.read_exact(&mut b).unwrap();
        assert_eq!(&b, b"late");
        assert_eq!(net.log().iter().filter(|e| e.verdict == "allowed").count(), 2);
        drop(first);
    }

    #[test]
    fn a_recorded_flow_is_served_back_without_the_network_and_a_different_one_is_reset() {
        use std::os::unix::net::UnixStream;
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().unwrap();
        let rule = format!("127.0.0.1:{}", addr.port());
        let path = std::env::temp_dir().join(format!("cx-broker-tape-{}", std::process::id())).join("t.tape");
        let _ = std::fs::remove_file(&path);
        // Record: the guest gets a relayed socket pair's end; the peer sees the bytes.
        let net = SandboxNet::new(policy(&[&rule]));
        let vmm = register(net.clone()).unwrap();
        let (mode, wall) = net.begin_tape(path.clone()).unwrap();
        assert!(mode == "record" && wall.is_some());
        let (r, mut fds) = connect(&vmm, addr);
        assert!(matches!(r, NetReply::Connected { relay: Some(_) }) && fds.len() == 2);
        let live = fds.pop().unwrap();
        let mut s = UnixStream::from(fds.pop().unwrap());
        let (mut peer, _) = server.accept().unwrap();
        s.write_all(b"ask").unwrap();
        let mut b = [0u8; 3];
        peer.read_exact(&mut b).unwrap();
        peer.write_all(b"answer").unwrap();
        drop(peer);
        let mut got = Vec::new();
        s.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"answer");
        drop((s, live));
        let o = net.end_tape(true);
        assert_eq!((o.mode, o.flows, o.errors.len()), ("recorded", 1, 0));
        drop(server); // nothing listens there now
        // Replay, twice: the same bytes are answered from the recording, nothing is dialled.
        for (ask, diverges) in [(&b"ask"[..], false), (&b"asK"[..], true)] {
            let net = SandboxNet::new(policy(&[&rule]));
            let vmm = register(net.clone()).unwrap();
            assert_eq!(net.begin_tape(path.clone()).unwrap(), ("replay", wall)); // the recording's clock
            let (r, mut fds) = connect(&vmm, addr);
            assert!(matches!(r, NetReply::Connected { relay: Some(_) }) && fds.len() == 2);
            let _live = fds.pop().unwrap();
            let mut s = UnixStream::from(fds.pop().unwrap());
            s.write_all(ask).unwrap();
            let mut got = Vec::new();
            let r = s.read_to_end(&mut got);
            if diverges {
                assert_eq!(r.unwrap_err().raw_os_error(), Some(libc::ECONNRESET));
                for _ in 0..200 {
                    if net.log()[0].verdict == "diverged" {
                        break;
                    }
                    std::thread::sleep(Duration::from_millis(10));
                }
                let e = &net.log()[0];
                assert!(e.verdict == "diverged" && e.detail.contains("at byte 2"), "{e:?}");
                let o = net.end_tape(true);
                assert!(o.mode == "replayed" && o.errors.len() == 1 && o.errors[0].contains("b\"K\""), "{o:?}");
            } else {
                r.unwrap();
                assert_eq!(got, b"answer");
                assert_eq!(net.log()[0].verdict, "replayed");
                assert_eq!(net.bytes(), (0, 0)); // nothing left the host
                let o = net.end_tape(true);
                assert_eq!((o.mode, o.errors.len()), ("replayed", 0));
            }
        }
        // A second connect the recording does not have is refused, and said so.
        let net = SandboxNet::new(policy(&[&rule]));
        let vmm = register(net.clone()).unwrap();
        net.begin_tape(path.clone()).unwrap();
        let (_, _first) = connect(&vmm, addr);
        let (r, fds) = connect(&vmm, addr);
        assert!(matches!(r, NetReply::Refused { errno: libc::ECONNREFUSED }) && fds.is_empty());
        assert!(net.end_tape(true).errors[0].contains("one more"));
        let _ = std::fs::remove_dir_all(path.parent().unwrap());
    }

    #[test]
    fn set_policy_resets_what_it_forbids_and_keeps_the_counts() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().unwrap();
        let net = SandboxNet::new(policy(&[&format!("127.0.0.1:{}", addr.port())]));
        let vmm = register(net.clone()).unwrap();
        let (_, mut fds) = connect(&vmm, addr);
        let _live = fds.pop().unwrap();
        let mut tcp = std::net::TcpStream::from(fds.pop().unwrap());
        let (mut peer, _) = server.accept().unwrap();
        tcp.write_all(b"abc").unwrap();
        let mut b = [0u8; 3];
        peer.read_exact(&mut b).unwrap();
        assert_eq!(net.set_policy(policy(&["index.example.org"])), 1);
        let mut x = [0u8; 1];
        let err = tcp.read(&mut x).unwrap_err();
        assert_eq!(err.raw_os_error(), Some(libc::ECONNRESET));
        let e = &net.log()[0];
        assert_eq!((e.verdict.as_str(), e.bytes_out), ("reset", 3));
    }

    #[test]
    fn names_are_answered_for_admitted_names_only_and_private_answers_are_withheld() {
        set_resolver(Resolver::parse("hosts:pkg.test=11.22.33.9;loop.test=127.0.0.1").unwrap()).unwrap();
        let net = SandboxNet::new(policy(&["pkg.test:80", "loop.test"]));
        let vmm = register(net.clone()).unwrap();
        let ask = |name: &str| wire::call(vmm.as_raw_fd(), &NetRequest::Resolve { pid: 1, name: name.into(), v6: false }, 5000).unwrap().0;
        assert!(matches!(ask("pkg.test"), NetReply::Addrs(a) if a == vec!["11.22.33.9".parse::<IpAddr>().unwrap()]));
        assert!(matches!(ask("loop.test"), NetReply::Addrs(a) if a.is_empty()));
        assert!(matches!(ask("other.test"), NetReply::NxDomain));
        // The answered address is admitted for its name's rule (port 80 only), not as a literal.
        let g = net.lock();
        let names = g.names.get(&"11.22.33.9".parse::<IpAddr>().unwrap()).cloned().unwrap_or_default();
        assert_eq!(names, vec!["pkg.test".to_string()]);
        assert!(matches!(g.policy.check("11.22.33.9".parse().unwrap(), 80, &names), Verdict::Allowed(_)));
        assert!(matches!(g.policy.check("11.22.33.9".parse().unwrap(), 81, &names), Verdict::Denied(_)));
        drop(g);
        set_resolver(Resolver::System).unwrap();
    }

    #[test]
    fn the_log_keeps_the_newest_entries_and_counts_the_dropped_ones() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().unwrap();
        let net = SandboxNet::new(Policy::default());
        let vmm = register(net.clone()).unwrap();
        for _ in 0..MAX_LOG + 50 {
            let (r, _) = connect(&vmm, addr);
            assert!(matches!(r, NetReply::Refused { errno: libc::ECONNREFUSED }));
        }
        // After the flood: an allowed connection, then a denied one; both are in the log.
        net.set_policy(policy(&[&format!("127.0.0.1:{}", addr.port())]));
        let (r, _fds) = connect(&vmm, addr);
        assert!(matches!(r, NetReply::Connected { .. }));
        net.set_policy(Policy::default());
        let _ = connect(&vmm, addr);
        let (log, dropped) = net.log_and_dropped();
        assert_eq!((log.len(), dropped), (MAX_LOG, 52));
        let tail: Vec<&str> = log[MAX_LOG - 2..].iter().map(|e| e.verdict.as_str()).collect();
        assert_eq!(tail, ["reset", "denied"]); // the allowed one, reset by the change to none
        assert_eq!((log[0].seq, log[MAX_LOG - 1].seq), (52, MAX_LOG as u64 + 51));
    }

    #[test]
    fn past_the_flow_cap_a_connect_fails_with_emfile_and_the_log_says_why() {
        let server = TcpListener::bind("127.0.0.1:0").unwrap();
        let addr = server.local_addr().unwrap();
        let net = SandboxNet::new(policy(&[&format!("127.0.0.1:{}", addr.port())]));
        let vmm = register(net.clone()).unwrap();
        assert!(matches!(set_max_flows(0), Err(BrokerError::BadFlowCap(0))));
        assert!(set_max_flows(MAX_FLOWS_LIMIT + 1).unwrap_err().to_string().contains("1..=2000"));
        // The cap is per process; other tests hold at most two flows a sandbox.
        set_max_flows(3).unwrap();
        let held: Vec<_> = (0..3).map(|_| connect(&vmm, addr)).collect();
        assert!(held.iter().all(|(r, fds)| matches!(r, NetReply::Connected { .. }) && fds.len() == 2));
        let (r, fds) = connect(&vmm, addr);
        set_max_flows(MAX_FLOWS_DEFAULT).unwrap();
        assert!(matches!(r, NetReply::Refused { errno: FLOW_CAP_ERRNO }) && fds.is_empty(), "{r:?}");
        let e = net.log().pop().unwrap();
        assert_eq!(e.verdict, "capped");
        assert!(e.detail.contains("3 open flows") && e.detail.contains("EMFILE"), "{}", e.detail);
    }

    #[test]
    fn a_sealed_sandbox_narrows_and_widens_back_but_never_beyond() {
        let parent = SandboxNet::new(policy(&["pkg.test:443"]));
        let child = SandboxNet::forked(&parent);
        child.seal();
        assert_eq!(child.set_policy_within(Policy::default()).unwrap(), 0);
        child.set_policy_within(policy(&["pkg.test:443"])).unwrap();
        let e = child.set_policy_within(Policy { rules: vec![], internet: true }).unwrap_err();
        let text = e.to_string();
        assert!(text.contains("Egress.allow(\"pkg.test:443\")") && text.contains("internet()"), "{text}");
        assert!(child.set_policy_within(policy(&["pkg.test"])).is_err());
        assert_eq!(child.policy(), policy(&["pkg.test:443"]));
        // A fork of the fork keeps the ceiling; the parent never had one.
        assert_eq!(SandboxNet::forked(&child).ceiling(), Some(policy(&["pkg.test:443"])));
        parent.set_policy_within(Policy { rules: vec![], internet: true }).unwrap();
    }
}
