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
const VERSION: u32 = 1;
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
    /// The peer shut its sending side (or reset: both read as the end of the stream).
    InEnd,
}

#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct FlowTape {
    /// Where the guest connected (as the broker dialled it).
    pub addr: Option<SocketAddr>,
    /// The local address the guest's socket had (getsockname answers it again on replay).
    pub local: Option<SocketAddr>,
    /// The dial failed with this errno (a replay fails the connect alike).
    pub refused: Option<i32>,
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
}

impl Tape {
    pub fn load(path: &Path) -> Result<Tape, TapeError> {
        let raw = std::fs::read(path).map_err(|source| TapeError::Io { path: path.into(), source })?;
        let bad = |why: &str| TapeError::Bad { path: path.into(), why: why.into() };
        if raw.len() < 16 || &raw[..8] != MAGIC {
            return Err(bad("no recording header"));
        }
        let version = u32::from_le_bytes(raw[8..12].try_into().map_err(|_| bad("short header"))?);
        if version != VERSION {
            return Err(bad(&format!("format version {version}, this engine reads {VERSION}")));
        }
        let (body, sum) = raw[12..].split_at(raw.len() - 16);
        let sum = u32::from_le_bytes(sum.try_into().map_err(|_| bad("short checksum"))?);
        if crc32fast::hash(body) != sum {
            return Err(bad("checksum mismatch"));
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

/// What an exec with a tape does: record it, or replay it.
pub enum Session {
    Record { path: PathBuf, flows: Vec<Arc<Mutex<FlowTape>>>, dns: HashMap<(String, bool), Vec<IpAddr>>, size: Arc<AtomicU64> },
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
        Ok(Session::Record { path, flows: Vec::new(), dns: HashMap::new(), size: Arc::new(AtomicU64::new(0)) })
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
            Session::Record { path, flows, dns, size } => {
                let n = flows.len();
                if size.load(Ordering::Relaxed) > MAX_TAPE_BYTES {
                    errors.push(format!("the recording is over {} MiB and was not saved: this exec ran live", MAX_TAPE_BYTES >> 20));
                } else {
                    let tape = Tape {
                        flows: flows.iter().map(|f| f.lock().unwrap_or_else(|p| p.into_inner()).clone()).collect(),
                        dns: dns.into_iter().map(|((n, v6), a)| (n, v6, a)).collect(),
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

/// Relay `guest` (the broker's end of the guest's socket pair) and `tcp` (the dialled connection)
/// both ways, writing down each chunk before passing it on. Chunks past `MAX_TAPE_BYTES` are relayed
/// and not kept (the recording is then not saved).
pub fn record(guest: OwnedFd, tcp: OwnedFd, flow: Arc<Mutex<FlowTape>>, size: Arc<AtomicU64>) -> std::io::Result<()> {
    let guest = Arc::new(guest);
    let tcp = Arc::new(tcp);
    let note = move |flow: &Mutex<FlowTape>, e: Event| {
        let n = match &e {
            Event::Out(b) | Event::In(b) => b.len() as u64,
            _ => 0,
        };
        if size.fetch_add(n, Ordering::Relaxed) + n <= MAX_TAPE_BYTES {
            flow.lock().unwrap_or_else(|p| p.into_inner()).events.push(e);
        }
    };
    let note2 = note.clone();
    let (g, t, f) = (guest.clone(), tcp.clone(), flow.clone());
    std::thread::Builder::new().name("collimate-tape-out".into()).spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = recv(g.as_raw_fd(), &mut buf, 0);
            if n <= 0 {
                note(&f, Event::OutEnd);
                shutdown(t.as_raw_fd(), libc::SHUT_WR);
                return;
            }
            note(&f, Event::Out(buf[..n as usize].to_vec()));
            if !write_all(t.as_raw_fd(), &buf[..n as usize]) {
                shutdown(g.as_raw_fd(), libc::SHUT_RD);
                return;
            }
        }
    })?;
    std::thread::Builder::new().name("collimate-tape-in".into()).spawn(move || {
        let mut buf = vec![0u8; 64 * 1024];
        loop {
            let n = recv(tcp.as_raw_fd(), &mut buf, 0);
            if n <= 0 {
                note2(&flow, Event::InEnd);
                shutdown(guest.as_raw_fd(), libc::SHUT_WR);
                return;
            }
            note2(&flow, Event::In(buf[..n as usize].to_vec()));
            if !write_all(guest.as_raw_fd(), &buf[..n as usize]) {
                shutdown(tcp.as_raw_fd(), libc::SHUT_RD);
                return;
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
/// connection is reset.
pub fn serve(guest: OwnedFd, flow: FlowTape, served: Arc<Served>, diverged: impl FnOnce(String) + Send + 'static) -> std::io::Result<()> {
    std::thread::Builder::new().name("collimate-tape-serve".into()).spawn(move || {
        if let Err(why) = serve_events(guest.as_raw_fd(), &flow.events, &served) {
            diverged(why);
            // Make sure something is unread in our queue (the guest's diverging bytes normally
            // are), then close: the guest's next call on the socket reads ECONNRESET.
            drop(guest);
        }
    })?;
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

fn serve_events(g: RawFd, events: &[Event], served: &Served) -> Result<(), String> {
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

    #[test]
    fn a_tape_round_trips_and_a_damaged_one_is_refused() {
        let dir = std::env::temp_dir().join(format!("cx-tape-{}", std::process::id()));
        let p = dir.join("t.tape");
        let t = Tape {
            flows: vec![FlowTape { addr: Some("127.0.0.1:80".parse().unwrap()), local: None, refused: None, events: vec![Event::Out(b"GET".to_vec()), Event::In(b"OK".to_vec()), Event::InEnd] }],
            dns: vec![("a.test".into(), false, vec!["203.0.113.9".parse().unwrap()])],
        };
        t.save(&p).unwrap();
        assert_eq!(Tape::load(&p).unwrap(), t);
        let mut raw = std::fs::read(&p).unwrap();
        let k = raw.len() / 2;
        raw[k] ^= 1;
        std::fs::write(&p, &raw).unwrap();
        assert!(matches!(Tape::load(&p), Err(TapeError::Bad { .. })));
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn a_replay_serves_the_answers_and_resets_on_different_bytes() {
        let flow = FlowTape { addr: None, local: None, refused: None, events: vec![Event::Out(b"hello".to_vec()), Event::In(b"world".to_vec()), Event::InEnd] };
        // The same bytes (in two writes): the recorded answer, then the end of the stream.
        let (mut guest, end) = pair();
        let served = Arc::new(Served::default());
        serve(end, flow.clone(), served.clone(), |why| panic!("{why}")).unwrap();
        guest.write_all(b"hel").unwrap();
        guest.write_all(b"lo").unwrap();
        let mut got = Vec::new();
        guest.read_to_end(&mut got).unwrap();
        assert_eq!(got, b"world");
        // Different bytes: a reset, and the reason.
        let (mut guest, end) = pair();
        let (tx, rx) = std::sync::mpsc::channel();
        serve(end, flow, Arc::new(Served::default()), move |why| tx.send(why).unwrap()).unwrap();
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
        record(end, OwnedFd::from(tcp), flow.clone(), Arc::new(AtomicU64::new(0))).unwrap();
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
