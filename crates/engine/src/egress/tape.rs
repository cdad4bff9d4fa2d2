//! Recorded flows: what a sandbox's connections carried during one exec, and how it is served back.
//!
//! With `Egress.allow(..., record=True)` the SDK opens a tape for each exec, named by the sandbox's
//! state and the exec's seed (docs/egress.md, "Record and replay"). If no tape of that name exists the
//! exec records: each admitted connection is relayed by the broker (two threads, one per direction)
//! instead of being handed to the guest, and every chunk the relay reads is written down, in the order
//! the relay saw them, before it is passed on. If the tape exists the exec replays: the n-th
//! connection the guest makes is served the n-th recorded flow from a socket pair, and nothing is
//! dialled. A guest whose deterministic run repeats the recorded one sends the same bytes (its
//! randomness and clocks replay, so a TLS handshake repeats too) and gets the same answers.
//!
//! Why the stream layer: the guest's I/O on a connected socket is the host's own calls, and a byte
//! stream is what the guest can observe (not segments or timing). Why peek before consuming: a guest
//! that sends something the recording does not have must see its connection reset, and an AF_UNIX
//! stream socket closed while its receive queue holds unread bytes gives its peer ECONNRESET: the
//! server leaves the diverging bytes unread, then closes.
//!
//! A peer's reset (RST, or a `set_egress` that forbade the flow) is written down too, and reaches
//! the guest as ECONNRESET both live and in a replay: an AF_UNIX stream cannot carry a reset, so the
//! relay says so on the flow's liveness pair (the VMM's end sits beside the guest's socket) before it
//! ends the stream, and the VMM reports the reset where the guest would otherwise read the end
//! (`guestos::files::inet::reset_at_end`).
//!
//! UDP flows under a rule naming their port are recorded too, a datagram per event: the guest's
//! socket is then one end of a SOCK_SEQPACKET pair (message boundaries kept, as UDP keeps them)
//! that one relay thread joins to the real UDP socket; a replay compares each datagram whole.
//!
//! File: magic, format version, a postcard payload, and a CRC-32 of the payload; a tape that does
//! not check is an error, never a partial replay.

use std::collections::HashMap;
use std::net::{IpAddr, SocketAddr};
use std::os::fd::{AsRawFd, OwnedFd, RawFd};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use serde::{Deserialize, Serialize};

const MAGIC: &[u8; 8] = b"CXTAPE\0\0";
/// 2: UDP flows (`FlowTape::datagram`) and peer resets (`Event::Reset`).
const VERSION: u32 = 2;
/// What the relay sends on a flow's liveness pair when the peer reset the connection.
pub const RESET_MARK: u8 = b'R';
/// Most bytes one exec's recording holds; a bigger one is not saved (the exec ran live).
pub const MAX_TAPE_BYTES: u64 = 256 << 20;

#[derive(Debug, thiserror::Error)]
pub enum TapeError {
    /// Reading or writing a tape file failed.
    #[error("egress recording {path}: {source}")]
    Io { path: PathBuf, source: std::io::Error },
    /// A file that is not a tape of this version, or is damaged.
    #[error("egress recording {path} is not a valid recording ({why}); delete it to record again")]
    Bad { path: PathBuf, why: String },
}

/// One thing the relay saw on a connection.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum Event {
    /// Bytes the guest sent.
    Out(Vec<u8>),
    /// Bytes the peer sent.
    In(Vec<u8>),
    /// The guest shut its sending side (or closed).
    OutEnd,
    /// The peer shut its sending side.
    InEnd,
    /// The peer reset the connection (after the bytes before it): the guest reads ECONNRESET.
    Reset,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowTape {
    /// Where the guest connected (as the broker dialled it).
    pub addr: Option<SocketAddr>,
    /// The local address the guest's socket had (getsockname answers it again on replay).
    pub local: Option<SocketAddr>,
    /// The dial failed with this errno (a replay fails the connect alike).
    pub refused: Option<i32>,
    /// A UDP flow: each `Out` and `In` is one datagram.
    pub datagram: bool,
    pub events: Vec<Event>,
}

impl FlowTape {
    pub fn bytes(&self) -> (u64, u64) {
        self.events.iter().fold((0, 0), |(o, i), e| match e {
            Event::Out(b) => (o + b.len() as u64, i),
            Event::In(b) => (o, i + b.len() as u64),
            _ => (o, i),
        })
    }
}

/// One exec's recording: its connections in the order the guest made them, and the DNS answers the
/// broker gave (a replay answers from here, so it needs no upstream server either).
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Tape {
    pub flows: Vec<FlowTape>,
    pub dns: Vec<(String, bool, Vec<IpAddr>)>,
    /// The host's wall clock when the recorded exec began (ns since the epoch; 0 in format 1):
    /// its virtual REALTIME started there, and a replay starts there again.
    pub wall_clock_ns: u64,
}

impl Tape {
    pub fn load(path: &Path) -> Result<Tape, TapeError> {
        let raw = std::fs::read(path).map_err(|source| TapeError::Io { path: path.into(), source })?;
        let bad = |why: &str| TapeError::Bad { path: path.into(), why: why.into() };
        if raw.len() < 16 || &raw[..8] != MAGIC {
            return Err(bad("no recording header"));
        }
        let version = u32::from_le_bytes(raw[8..12].try_into().map_err(|_| bad("short header"))?);
        if version != VERSION && version != 1 {
            return Err(bad(&format!("format version {version}, this engine reads 1 and {VERSION}")));
        }
        let (body, sum) = raw[12..].split_at(raw.len() - 16);
        let sum = u32::from_le_bytes(sum.try_into().map_err(|_| bad("short checksum"))?);
        if crc32fast::hash(body) != sum {
            return Err(bad("checksum mismatch"));
        }
        if version == 1 {
            let v1: TapeV1 = postcard::from_bytes(body).map_err(|e| bad(&e.to_string()))?;
            return Ok(v1.into());
        }
        postcard::from_bytes(body).map_err(|e| bad(&e.to_string()))
    }

    /// Write atomically (a temporary file renamed into place): a reader never sees half a tape.
    pub fn save(&self, path: &Path) -> Result<(), TapeError> {
        let io = |source| TapeError::Io { path: path.into(), source };
        let body = postcard::to_stdvec(self).map_err(|e| TapeError::Bad { path: path.into(), why: e.to_string() })?;
        let mut raw = Vec::with_capacity(body.len() + 16);
        raw.extend_from_slice(MAGIC);
        raw.extend_from_slice(&VERSION.to_le_bytes());
        raw.extend_from_slice(&body);
        raw.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir).map_err(io)?;
        }
        let tmp = path.with_extension(format!("tmp{}", std::process::id()));
        std::fs::write(&tmp, &raw).map_err(io)?;
        std::fs::rename(&tmp, path).map_err(io)
    }

    pub fn answer(&self, name: &str, v6: bool) -> Option<Vec<IpAddr>> {
        self.dns.iter().find(|(n, six, _)| n == name && *six == v6).map(|(_, _, a)| a.clone())
    }
}

/// Format 1: TCP flows only, without `FlowTape::datagram` (its events are a prefix of today's:
/// postcard numbers the variants, and `Reset` came last).
#[derive(Deserialize)]
struct TapeV1 {
    flows: Vec<FlowTapeV1>,
    dns: Vec<(String, bool, Vec<IpAddr>)>,
}

#[derive(Deserialize)]
struct FlowTapeV1 {
    addr: Option<SocketAddr>,
    local: Option<SocketAddr>,
    refused: Option<i32>,
    events: Vec<Event>,
}

impl From<TapeV1> for Tape {
    fn from(t: TapeV1) -> Tape {
        let flows = t.flows.into_iter().map(|f| FlowTape { addr: f.addr, local: f.local, refused: f.refused, datagram: false, events: f.events }).collect();
        Tape { flows, dns: t.dns, wall_clock_ns: 0 }
    }
}

/// What an exec with a tape does: record it, or replay it.
pub enum Session {
    Record { path: PathBuf, flows: Vec<Arc<Mutex<FlowTape>>>, dns: HashMap<(String, bool), Vec<IpAddr>>, size: Arc<AtomicU64>, wall_clock_ns: u64 },
    Replay { path: PathBuf, tape: Tape, next: usize },
}

/// How one exec's tape ended, for the SDK's result.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct Outcome {
    /// "recorded", "replayed", or "" (no tape was open).
    pub mode: &'static str,
    pub path: PathBuf,
    pub flows: usize,
    /// Each divergence of a replay (or why a recording was not saved), in words.
    pub errors: Vec<String>,
}

impl Session {
    /// Open the tape at `path`: replay it if it exists, else record to it.
    pub fn open(path: PathBuf) -> Result<Session, TapeError> {
        if path.exists() {
            let tape = Tape::load(&path)?;
            return Ok(Session::Replay { path, tape, next: 0 });
        }
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_nanos() as u64);
        Ok(Session::Record { path, flows: Vec::new(), dns: HashMap::new(), size: Arc::new(AtomicU64::new(0)), wall_clock_ns: now })
    }

    /// Where the exec's virtual REALTIME is to start: the host's wall clock now when recording
    /// (written down), the recording's when replaying; None for a format-1 recording.
    pub fn wall_clock_ns(&self) -> Option<u64> {
        match self {
            Session::Record { wall_clock_ns, .. } => Some(*wall_clock_ns),
            Session::Replay { tape, .. } => (tape.wall_clock_ns != 0).then_some(tape.wall_clock_ns),
        }
    }

    /// The exec is over: a recording is saved if `save` (what its flows carried until now; the
    /// relays go on relaying, unrecorded, for connections that outlive the exec). An unsaved one
    /// reports mode "".
    pub fn close(self, mut errors: Vec<String>, save: bool) -> Outcome {
        match self {
            Session::Record { path, size, .. } if !save => {
                size.store(u64::MAX / 2, Ordering::Relaxed);
                Outcome { mode: "", path, flows: 0, errors }
            }
            Session::Record { path, flows, dns, size, wall_clock_ns } => {
                let n = flows.len();
                if size.load(Ordering::Relaxed) > MAX_TAPE_BYTES {
                    errors.push(format!("the recording is over {} MiB and was not saved: this exec ran live", MAX_TAPE_BYTES >> 20));
                } else {
                    let tape = Tape {
                        flows: flows.iter().map(|f| f.lock().unwrap_or_else(|p| p.into_inner()).clone()).collect(),
                        dns: dns.into_iter().map(|((n, v6), a)| (n, v6, a)).collect(),
                        wall_clock_ns,
                    };
                    if let Err(e) = tape.save(&path) {
                        errors.push(e.to_string());
                    }
                }
                // Connections that outlive the exec go on relaying, no longer written down.
                size.store(u64::MAX / 2, Ordering::Relaxed);
                Outcome { mode: "recorded", path, flows: n, errors }
            }
            Session::Replay { path, next, .. } => Outcome { mode: "replayed", path, flows: next, errors },
        }
    }
}

// The relays. Both run on threads of their own and end by themselves: when the guest closes its
// socket (the sandbox's processes are gone, or closed it) and, when recording, when the peer ends.

fn write_all(fd: RawFd, mut b: &[u8]) -> bool {
    while !b.is_empty() {
        // SAFETY: send of a buffer we own; MSG_NOSIGNAL: a closed peer is an error, not a signal.
        let r = unsafe { libc::send(fd, b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) };
        if r < 0 {
            if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                continue;
            }
            return false;
        }
        b = &b[r as usize..];
    }
    true
}

fn recv(fd: RawFd, buf: &mut [u8], flags: i32) -> isize {
    loop {
        // SAFETY: recv into a buffer we own.
        let r = unsafe { libc::recv(fd, buf.as_mut_ptr().cast(), buf.len(), flags) };
        if r < 0 && std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
            continue;
        }
        return r;
    }
}

fn shutdown(fd: RawFd, how: i32) {
    // SAFETY: shutdown of a socket we hold.
    unsafe { libc::shutdown(fd, how) };
}

/// Tell the VMM that the peer reset the flow (see the module comment), then end the guest's
/// stream both ways: its reads give what came before, then ECONNRESET, then the end; its sends
/// fail (EPIPE), as on a reset TCP socket.
fn post_reset(guest: RawFd, live: RawFd) {
    // SAFETY: a one-byte send on our end of the liveness pair; a VMM that is gone is no error.
    unsafe { libc::send(live, [RESET_MARK].as_ptr().cast(), 1, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
    shutdown(guest, libc::SHUT_RDWR);
}

/// Whether a TCP connection whose receive just read the end was reset rather than closed: after a
/// RST (or our own disconnect) the kernel puts it straight into TCP_CLOSE, while a peer's FIN
/// leaves it in CLOSE_WAIT, or TIME_WAIT and CLOSING if we had shut our side first. A RST that
/// another thread's call reported first (its error is reported once) still leaves TCP_CLOSE.
fn was_reset(tcp: RawFd) -> bool {
    // SAFETY: a zeroed tcp_info is valid; getsockopt fills at most `len` bytes of it.
    let mut ti: libc::tcp_info = unsafe { std::mem::zeroed() };
    let mut len = std::mem::size_of::<libc::tcp_info>() as libc::socklen_t;
    // SAFETY: TCP_INFO into a buffer of `len` bytes we own.
    let r = unsafe { libc::getsockopt(tcp, libc::IPPROTO_TCP, libc::TCP_INFO, (&mut ti as *mut libc::tcp_info).cast(), &mut len) };
    r == 0 && ti.tcpi_state == 7 // TCP_CLOSE
}

/// Write down one event unless the recording is over its size limit (it is then not saved).
#[derive(Clone)]
struct Note {
    flow: Arc<Mutex<FlowTape>>,
    size: Arc<AtomicU64>,
}

impl Note {
    fn push(&self, e: Event) {
        let n = match &e {
            Event::Out(b) | Event::In(b) => b.len() as u64,
            _ => 0,
        };
        if self.size.fetch_add(n, Ordering::Relaxed) + n <= MAX_TAPE_BYTES {
            self.flow.lock().unwrap_or_else(|p| p.into_inner()).events.push(e);
        }
    }
}

/// Relay `guest` (the broker's end of the guest's socket pair) and `tcp` (the dialled connection)
/// both ways, writing down each chunk before passing it on. Chunks past `MAX_TAPE_BYTES` are relayed
/// and not kept (the recording is then not saved). `live` is the broker's end of the flow's
/// liveness pair, where a reset is posted.
pub fn record(guest: OwnedFd, tcp: OwnedFd, live: OwnedFd, flow: Arc<Mutex<FlowTape>>, size: Arc<AtomicU64>) -> std::io::Result<()> {
    let guest = Arc::new(guest);
    let tcp = Arc::new(tcp);
    let note = Note { flow, size };
    let note2 = note.clone();
    let (g, t) = (guest.clone(), tcp.clone());
    std::thread::Builder::new().name("collimate-tape-out".into()).spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = recv(g.as_raw_fd(), &mut buf, 0);
            if n <= 0 {
                note.push(Event::OutEnd);
                shutdown(t.as_raw_fd(), libc::SHUT_WR);
                return;
            }
            note.push(Event::Out(buf[..n as usize].to_vec()));
            if !write_all(t.as_raw_fd(), &buf[..n as usize]) {
                // The connection failed under the send (a reset): the other thread's receive
                // sees it too and tells the guest; what the guest sends meanwhile goes nowhere.
                shutdown(g.as_raw_fd(), libc::SHUT_RD);
                return;
            }
        }
    })?;
    std::thread::Builder::new().name("collimate-tape-in".into()).spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = recv(tcp.as_raw_fd(), &mut buf, 0);
            if n < 0 || (n == 0 && was_reset(tcp.as_raw_fd())) {
                note2.push(Event::Reset);
                post_reset(guest.as_raw_fd(), live.as_raw_fd());
                return;
            }
            if n == 0 {
                note2.push(Event::InEnd);
                shutdown(guest.as_raw_fd(), libc::SHUT_WR);
                return;
            }
            note2.push(Event::In(buf[..n as usize].to_vec()));
            if !write_all(guest.as_raw_fd(), &buf[..n as usize]) {
                shutdown(tcp.as_raw_fd(), libc::SHUT_RD);
                return;
            }
        }
    })?;
    Ok(())
}

/// Relay a UDP flow: `guest` (the broker's end of the guest's SOCK_SEQPACKET pair) and `udp` (a
/// UDP socket connected to the peer), one datagram at a time both ways, writing each down before
/// passing it on. One thread, so the tape has the datagrams in the order the relay saw them. It
/// ends when the guest closes its socket, or when `udp` is shut (`set_egress` forbade the flow:
/// the guest's sends then fail).
pub fn record_datagrams(guest: OwnedFd, udp: OwnedFd, flow: Arc<Mutex<FlowTape>>, size: Arc<AtomicU64>) -> std::io::Result<()> {
    let note = Note { flow, size };
    std::thread::Builder::new().name("collimate-tape-udp".into()).spawn(move || {
        let mut buf = vec![0u8; 65536];
        let (g, u) = (guest.as_raw_fd(), udp.as_raw_fd());
        loop {
            let mut fds = [libc::pollfd { fd: g, events: libc::POLLIN, revents: 0 }, libc::pollfd { fd: u, events: libc::POLLIN, revents: 0 }];
            // SAFETY: poll on two descriptors we own.
            if unsafe { libc::poll(fds.as_mut_ptr(), 2, -1) } < 0 {
                if std::io::Error::last_os_error().raw_os_error() == Some(libc::EINTR) {
                    continue;
                }
                return;
            }
            if fds[0].revents != 0 {
                // A zero-length read is the guest's end closing (a SOCK_SEQPACKET pair); a
                // zero-length datagram from the guest reads alike and ends the relay too.
                let n = recv(g, &mut buf, libc::MSG_DONTWAIT);
                if n == 0 || (n < 0 && fds[0].revents & (libc::POLLHUP | libc::POLLERR) != 0) {
                    note.push(Event::OutEnd);
                    return;
                }
                if n > 0 {
                    note.push(Event::Out(buf[..n as usize].to_vec()));
                    // SAFETY: send of a buffer we own on the connected UDP socket (a datagram
                    // the network drops is dropped, as UDP does).
                    unsafe { libc::send(u, buf.as_ptr().cast(), n as usize, libc::MSG_NOSIGNAL) };
                }
            }
            if fds[1].revents != 0 {
                let n = recv(u, &mut buf, libc::MSG_DONTWAIT);
                if n == 0 {
                    // The broker shut the socket (or a zero-length datagram came, which a
                    // SOCK_SEQPACKET pair could not tell from its end): the relay ends.
                    return;
                }
                if n > 0 {
                    note.push(Event::In(buf[..n as usize].to_vec()));
                    // SAFETY: send of a buffer we own on our end of the guest's pair.
                    unsafe { libc::send(g, buf.as_ptr().cast(), n as usize, libc::MSG_DONTWAIT | libc::MSG_NOSIGNAL) };
                }
                // n < 0: an ICMP error (ECONNREFUSED) read and cleared; the relay goes on.
            }
        }
    })?;
    Ok(())
}

/// Bytes served so far: (the guest's bytes that matched, the recorded bytes given to the guest).
#[derive(Default)]
pub struct Served {
    pub out: AtomicU64,
    pub inn: AtomicU64,
}

/// Serve `flow` to `guest` (the broker's end of the guest's socket pair): the recorded answers in
/// order, each after the guest has sent what preceded it. On the first byte that differs, or a
/// stream that ends where the recording does not, `diverged` gets the reason and the guest's
/// connection is reset. `live` is the broker's end of the flow's liveness pair (a recorded reset
/// is posted there, as the recording relay posted it).
pub fn serve(guest: OwnedFd, live: OwnedFd, flow: FlowTape, served: Arc<Served>, diverged: impl FnOnce(String) + Send + 'static) -> std::io::Result<()> {
    std::thread::Builder::new().name("collimate-tape-serve".into()).spawn(move || {
        let (g, l) = (guest.as_raw_fd(), live.as_raw_fd());
        let r = if flow.datagram { serve_datagrams(g, &flow.events, &served) } else { serve_events(g, l, &flow.events, &served) };
        if let Err(why) = r {
            diverged(why);
            // Closing our end with the guest's diverging bytes unread in its queue resets the
            // guest's end (ECONNRESET at its next call); a guest that ended its stream early left
            // nothing unread, so the reset goes by the liveness pair.
            let mut b = [0u8; 1];
            if !flow.datagram && recv(g, &mut b, libc::MSG_PEEK | libc::MSG_DONTWAIT) <= 0 {
                post_reset(g, l);
            }
            drop(guest);
        }
    })?;
    Ok(())
}

/// A recorded UDP flow, datagram by datagram: each of the guest's must equal the recorded one.
fn serve_datagrams(g: RawFd, events: &[Event], served: &Served) -> Result<(), String> {
    let mut buf = vec![0u8; 65536];
    let mut k = 0usize; // the guest's datagrams matched so far
    for e in events {
        match e {
            Event::Out(want) => {
                let n = recv(g, &mut buf, 0);
                if n <= 0 {
                    return Err(format!("the guest closed its UDP socket after {k} datagram(s), where the recording has it send {}", show(want)));
                }
                let got = &buf[..n as usize];
                if got != &want[..] {
                    return Err(format!("the guest's UDP datagram {k} differs from the recording: {} where the recording has {}", show(got), show(want)));
                }
                k += 1;
                served.out.fetch_add(n as u64, Ordering::Relaxed);
            }
            Event::In(d) => {
                // SAFETY: send of a buffer we own on our end of the guest's pair.
                if unsafe { libc::send(g, d.as_ptr().cast(), d.len(), libc::MSG_NOSIGNAL) } < 0 {
                    return Ok(()); // the guest is gone
                }
                served.inn.fetch_add(d.len() as u64, Ordering::Relaxed);
            }
            Event::OutEnd | Event::InEnd | Event::Reset => return Ok(()),
        }
    }
    let n = recv(g, &mut buf, 0);
    if n > 0 {
        return Err(format!("the guest sent UDP datagram {k} past the end of the recording: {}", show(&buf[..n as usize])));
    }
    Ok(())
}

fn show(b: &[u8]) -> String {
    let s: String = b.iter().take(32).flat_map(|&c| std::ascii::escape_default(c)).map(char::from).collect();
    if b.len() > 32 {
        format!("b\"{s}\"...")
    } else {
        format!("b\"{s}\"")
    }
}

fn serve_events(g: RawFd, live: RawFd, events: &[Event], served: &Served) -> Result<(), String> {
    let mut buf = vec![0u8; 64 * 1024];
    let mut at = 0u64; // bytes of the guest's stream matched so far
    for e in events {
        match e {
            Event::Out(want) => {
                let mut rest = &want[..];
                while !rest.is_empty() {
                    let n = recv(g, &mut buf[..rest.len().min(64 * 1024)], libc::MSG_PEEK);
                    if n <= 0 {
                        return Err(format!(
                            "the guest ended its stream at byte {at}, where the recording has {} more bytes from it ({})",
                            rest.len(),
                            show(rest)
                        ));
                    }
                    let got = &buf[..n as usize];
                    if let Some(i) = got.iter().zip(rest).position(|(a, b)| a != b) {
                        return Err(format!(
                            "the guest sent different bytes than the recording at byte {} of its stream: {} where the recording has {}",
                            at + i as u64,
                            show(&got[i..]),
                            show(&rest[i..])
                        ));
                    }
                    recv(g, &mut buf[..n as usize], 0); // consume what matched
                    at += n as u64;
                    served.out.fetch_add(n as u64, Ordering::Relaxed);
                    rest = &rest[n as usize..];
                }
            }
            Event::In(b) => {
                if !write_all(g, b) {
                    return Ok(()); // the guest is gone
                }
                served.inn.fetch_add(b.len() as u64, Ordering::Relaxed);
            }
            Event::OutEnd => {
                let n = recv(g, &mut buf[..1], libc::MSG_PEEK);
                if n > 0 {
                    return Err(format!("the guest sent bytes after byte {at}, where the recording's guest ended its stream: {}", show(&buf[..1])));
                }
            }
            Event::InEnd => shutdown(g, libc::SHUT_WR),
            Event::Reset => {
                post_reset(g, live);
                return Ok(());
            }
        }
    }
    // The recording ends here (the exec it came from ended with the connection open): anything
    // more the guest sends is not in it.
    let n = recv(g, &mut buf[..1], libc::MSG_PEEK);
    if n > 0 {
        return Err(format!("the guest sent bytes after byte {at}, past the end of the recording: {}", show(&buf[..1])));
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixStream;

    fn pair() -> (UnixStream, OwnedFd) {
        let (a, b) = UnixStream::pair().unwrap();
        (a, OwnedFd::from(b))
    }

    /// A liveness pair: (the VMM's end, the broker's).
    fn live() -> (OwnedFd, OwnedFd) {
        crate::egress::wire::seqpacket_pair().unwrap()
    }

    /// The reset mark on the VMM's end of a liveness pair, waiting up to 5 s.
    fn mark(vmm: &OwnedFd) -> Option<u8> {
        let mut p = libc::pollfd { fd: vmm.as_raw_fd(), events: libc::POLLIN, revents: 0 };
        // SAFETY: poll on one descriptor we own.
        unsafe { libc::poll(&mut p, 1, 5000) };
        let mut b = [0u8; 1];
        (recv(vmm.as_raw_fd(), &mut b, libc::MSG_DONTWAIT) == 1).then_some(b[0])
    }

    fn seqpacket() -> (OwnedFd, OwnedFd) {
        crate::egress::wire::seqpacket_pair().unwrap()
    }

    fn send(fd: &OwnedFd, b: &[u8]) {
        // SAFETY: send of a buffer we own.
        assert_eq!(unsafe { libc::send(fd.as_raw_fd(), b.as_ptr().cast(), b.len(), libc::MSG_NOSIGNAL) }, b.len() as isize);
    }

    fn recv_msg(fd: &OwnedFd) -> Vec<u8> {
        let mut b = vec![0u8; 65536];
        let n = recv(fd.as_raw_fd(), &mut b, 0);
        b.truncate(n.max(0) as usize);
        b
    }

    #[test]
    fn a_peers_reset_is_written_down_and_posted_both_live_and_in_a_replay() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpStream::connect(server.local_addr().unwrap()).unwrap();
        let (mut peer, _) = server.accept().unwrap();
        let (mut guest, end) = pair();
        let (vmm, broker) = live();
        let flow = Arc::new(Mutex::new(FlowTape::default()));
        record(end, OwnedFd::from(tcp), broker, flow.clone(), Arc::new(AtomicU64::new(0))).unwrap();
        guest.write_all(b"hi").unwrap();
        let mut b = [0u8; 2];
        peer.read_exact(&mut b).unwrap();
        peer.write_all(b"yo").unwrap();
        // SO_LINGER with a zero timeout: the close sends a RST.
        let lg = libc::linger { l_onoff: 1, l_linger: 0 };
        // SAFETY: setsockopt with a linger struct we own.
        unsafe { libc::setsockopt(peer.as_raw_fd(), libc::SOL_SOCKET, libc::SO_LINGER, (&lg as *const libc::linger).cast(), std::mem::size_of::<libc::linger>() as u32) };
        std::thread::sleep(std::time::Duration::from_millis(50)); // "yo" reaches the relay first
        drop(peer);
        let mut got = Vec::new();
        guest.read_to_end(&mut got).unwrap(); // the bytes before the reset, then the stream's end ...
        assert_eq!(got, b"yo");
        assert_eq!(mark(&vmm), Some(RESET_MARK)); // ... and the mark, which the VMM reads as ECONNRESET
        // (The guest's side ends with the reset: the relay's reading of it writes down its end.)
        for _ in 0..200 {
            if flow.lock().unwrap().events.len() == 4 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let ev = flow.lock().unwrap().events.clone();
        assert_eq!(ev, vec![Event::Out(b"hi".to_vec()), Event::In(b"yo".to_vec()), Event::Reset, Event::OutEnd]);
        // The replay serves the same: the answer, the end, the mark.
        let (mut guest, end) = pair();
        let (vmm, broker) = live();
        let f = FlowTape { events: ev, ..Default::default() };
        serve(end, broker, f, Arc::new(Served::default()), |why| panic!("{why}")).unwrap();
        guest.write_all(b"hi").unwrap();
        let mut got = Vec::new();
        guest.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"yo");
        assert_eq!(mark(&vmm), Some(RESET_MARK));
        // A flow that ends normally posts nothing.
        let (mut guest, end) = pair();
        let (vmm, broker) = live();
        let f = FlowTape { events: vec![Event::Out(b"hi".to_vec()), Event::In(b"yo".to_vec()), Event::InEnd], ..Default::default() };
        serve(end, broker, f, Arc::new(Served::default()), |why| panic!("{why}")).unwrap();
        guest.write_all(b"hi").unwrap();
        let mut got = Vec::new();
        guest.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"yo");
        drop(guest);
        assert_eq!(mark(&vmm), None);
    }

    #[test]
    fn udp_datagrams_are_recorded_whole_and_served_back_or_diverge() {
        let server = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        let udp = std::net::UdpSocket::bind("127.0.0.1:0").unwrap();
        udp.connect(server.local_addr().unwrap()).unwrap();
        let echo = std::thread::spawn(move || {
            let mut b = [0u8; 64];
            for _ in 0..2 {
                let (n, from) = server.recv_from(&mut b).unwrap();
                let mut answer = b"re:".to_vec();
                answer.extend_from_slice(&b[..n]);
                server.send_to(&answer, from).unwrap();
            }
        });
        let (guest, end) = seqpacket();
        let flow = Arc::new(Mutex::new(FlowTape { datagram: true, ..Default::default() }));
        record_datagrams(end, OwnedFd::from(udp), flow.clone(), Arc::new(AtomicU64::new(0))).unwrap();
        for q in [&b"one"[..], b"two"] {
            send(&guest, q);
            assert_eq!(recv_msg(&guest), [&b"re:"[..], q].concat());
        }
        echo.join().unwrap();
        drop(guest);
        for _ in 0..200 {
            if flow.lock().unwrap().events.last() == Some(&Event::OutEnd) {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let f = flow.lock().unwrap().clone();
        assert_eq!(f.events, vec![Event::Out(b"one".to_vec()), Event::In(b"re:one".to_vec()), Event::Out(b"two".to_vec()), Event::In(b"re:two".to_vec()), Event::OutEnd]);
        // Served back: the same datagrams get the same answers, nothing dialled.
        let (guest, end) = seqpacket();
        serve(end, live().1, f.clone(), Arc::new(Served::default()), |why| panic!("{why}")).unwrap();
        for q in [&b"one"[..], b"two"] {
            send(&guest, q);
            assert_eq!(recv_msg(&guest), [&b"re:"[..], q].concat());
        }
        drop(guest);
        // A different datagram diverges, whole (not a prefix match as on a stream).
        let (guest, end) = seqpacket();
        let (tx, rx) = std::sync::mpsc::channel();
        serve(end, live().1, f, Arc::new(Served::default()), move |why| tx.send(why).unwrap()).unwrap();
        send(&guest, b"one!");
        let why = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
        assert!(why.contains("datagram 0 differs") && why.contains("b\"one!\""), "{why}");
    }

    #[test]
    fn a_tape_round_trips_and_a_damaged_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("cx-tape-{}", std::process::id()));
        let p = dir.join("t.tape");
        let t = Tape {
            flows: vec![
                FlowTape { addr: Some("127.0.0.1:80".parse().unwrap()), events: vec![Event::Out(b"GET".to_vec()), Event::In(b"OK".to_vec()), Event::InEnd, Event::Reset], ..Default::default() },
                FlowTape { addr: Some("127.0.0.1:53".parse().unwrap()), datagram: true, events: vec![Event::Out(b"q".to_vec())], ..Default::default() },
            ],
            dns: vec![("a.test".into(), false, vec!["203.0.113.9".parse().unwrap()])],
            wall_clock_ns: 1_764_000_000_000_000_000,
        };
        t.save(&p).unwrap();
        assert_eq!(Tape::load(&p).unwrap(), t);
        let mut raw = std::fs::read(&p).unwrap();
        let k = raw.len() / 2;
        raw[k] ^= 1;
        std::fs::write(&p, &raw).unwrap();
        assert!(matches!(Tape::load(&p), Err(TapeError::Bad { .. })));
        // A recording of format 1 (before UDP flows and resets) still loads.
        #[derive(Serialize)]
        struct V1Flow<'a>(Option<SocketAddr>, Option<SocketAddr>, Option<i32>, &'a [Event]);
        let body = postcard::to_stdvec(&(vec![V1Flow(t.flows[0].addr, None, None, &t.flows[0].events[..3])], &t.dns)).unwrap();
        let mut raw = MAGIC.to_vec();
        raw.extend_from_slice(&1u32.to_le_bytes());
        raw.extend_from_slice(&body);
        raw.extend_from_slice(&crc32fast::hash(&body).to_le_bytes());
        std::fs::write(&p, &raw).unwrap();
        let old = Tape::load(&p).unwrap();
        assert_eq!((old.flows.len(), &old.flows[0].events[..], old.flows[0].datagram, &old.dns), (1, &t.flows[0].events[..3], false, &t.dns));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_replay_serves_the_answers_and_resets_on_different_bytes() {
        let flow = FlowTape { events: vec![Event::Out(b"hello".to_vec()), Event::In(b"world".to_vec()), Event::InEnd], ..Default::default() };
        // The same bytes (in two writes): the recorded answer, then the end of the stream.
        let (mut guest, end) = pair();
        let served = Arc::new(Served::default());
        serve(end, live().1, flow.clone(), served.clone(), |why| panic!("{why}")).unwrap();
        guest.write_all(b"hel").unwrap();
        guest.write_all(b"lo").unwrap();
        let mut got = Vec::new();
        guest.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"world");
        // Different bytes: a reset, and the reason.
        let (mut guest, end) = pair();
        let (tx, rx) = std::sync::mpsc::channel();
        serve(end, live().1, flow, Arc::new(Served::default()), move |why| tx.send(why).unwrap()).unwrap();
        guest.write_all(b"help!").unwrap();
        let why = rx.recv_timeout(std::time::Duration::from_secs(5)).unwrap();
        assert!(why.contains("at byte 3") && why.contains("b\"p!\""), "{why}");
        let mut b = [0u8; 1];
        assert_eq!(guest.read(&mut b).unwrap_err().raw_os_error(), Some(libc::ECONNRESET));
    }

    #[test]
    fn a_recording_relay_writes_down_both_directions() {
        let server = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let tcp = std::net::TcpStream::connect(server.local_addr().unwrap()).unwrap();
        let (mut peer, _) = server.accept().unwrap();
        let (mut guest, end) = pair();
        let flow = Arc::new(Mutex::new(FlowTape::default()));
        record(end, OwnedFd::from(tcp), live().1, flow.clone(), Arc::new(AtomicU64::new(0))).unwrap();
        guest.write_all(b"ping").unwrap();
        let mut b = [0u8; 4];
        peer.read_exact(&mut b).unwrap();
        peer.write_all(b"pong").unwrap();
        drop(peer);
        let mut got = Vec::new();
        guest.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"pong");
        drop(guest);
        for _ in 0..200 {
            if flow.lock().unwrap().events.len() == 4 {
                break;
            }
            std::thread::sleep(std::time::Duration::from_millis(10));
        }
        let ev = flow.lock().unwrap().events.clone();
        assert_eq!(ev, vec![Event::Out(b"ping".to_vec()), Event::In(b"pong".to_vec()), Event::InEnd, Event::OutEnd]);
    }
}
