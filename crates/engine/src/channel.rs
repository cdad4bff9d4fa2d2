//! Framed messages with attached file descriptors over a Unix stream socket.
//!
//! A frame is a little-endian `u32` length followed by a postcard payload. File descriptors ride on the
//! first byte of the frame (SCM_RIGHTS), so a receiver that reads the header gets them.

use std::io::{Read, Write};
use std::os::fd::{AsRawFd, FromRawFd, OwnedFd, RawFd};
use std::os::unix::net::UnixStream;
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use vmm_sys_util::sock_ctrl_msg::ScmSocket;

use crate::error::{Error, Result};

/// Largest frame we accept: guards against a confused peer making us allocate without bound.
pub const MAX_FRAME: usize = 1 << 30;
/// SCM_RIGHTS carries at most this many descriptors per message (the kernel's SCM_MAX_FD is 253).
pub const MAX_FDS: usize = 250;

/// One end of a controller <-> VMM connection.
#[derive(Debug)]
pub struct Channel {
    sock: UnixStream,
}

/// Why a receive did not produce a message.
#[derive(Debug)]
pub enum RecvError {
    /// The peer closed its end.
    Closed,
    /// No message within the read timeout.
    TimedOut,
    /// Anything else.
    Failed(Error),
}

impl Channel {
    pub fn new(sock: UnixStream) -> Channel {
        Channel { sock }
    }

    /// A connected pair with close-on-exec set on both ends.
    pub fn pair() -> Result<(Channel, Channel)> {
        let (a, b) = UnixStream::pair().map_err(Error::sys("socketpair"))?;
        Ok((Channel::new(a), Channel::new(b)))
    }

    pub fn set_read_timeout(&self, t: Option<Duration>) -> Result<()> {
        self.sock.set_read_timeout(t).map_err(Error::sys("set socket timeout"))
    }

    pub fn send<T: Serialize>(&mut self, msg: &T, fds: &[RawFd]) -> Result<()> {
        let payload = postcard::to_stdvec(msg).map_err(|e| Error::Protocol(format!("encode: {e}")))?;
        let mut frame = Vec::with_capacity(4 + payload.len());
        frame.extend_from_slice(&(payload.len() as u32).to_le_bytes());
        frame.extend_from_slice(&payload);
        if fds.len() > MAX_FDS {
            return Err(Error::Protocol(format!("{} fds in one message (max {MAX_FDS})", fds.len())));
        }
        let sent = if fds.is_empty() {
            0
        } else {
            // sendmsg on a stream socket may take only part of a large frame; the rest follows below.
            self.sock
                .send_with_fds(&[&frame[..]], fds)
                .map_err(|e| Error::Sys { op: "sendmsg", source: std::io::Error::from_raw_os_error(e.errno()) })?
        };
        self.sock.write_all(&frame[sent..]).map_err(Error::sys("write to channel"))
    }

    /// Receive one message and the descriptors attached to it.
    pub fn recv<T: DeserializeOwned>(&mut self) -> std::result::Result<(T, Vec<OwnedFd>), RecvError> {
        let mut header = [0u8; 4];
        let mut fds_raw = [-1 as RawFd; MAX_FDS];
        let mut iov = [libc::iovec { iov_base: header.as_mut_ptr().cast(), iov_len: header.len() }];
        let res = loop {
            // SAFETY: the iovec points at `header`, which we own mutably for the duration of the call.
            match unsafe { self.sock.recv_with_fds(&mut iov, &mut fds_raw) } {
                // A signal handler ran (a VMM's preemption, parent-death or hang-up signals).
                Err(e) if e.errno() == libc::EINTR => continue,
                r => break r,
            }
        };
        let (n, nfds) = match res {
            Ok(v) => v,
            Err(e) if e.errno() == libc::EAGAIN || e.errno() == libc::EWOULDBLOCK => {
                return Err(RecvError::TimedOut)
            }
            Err(e) if e.errno() == libc::ECONNRESET => return Err(RecvError::Closed),
            Err(e) => {
                return Err(RecvError::Failed(Error::Sys {
                    op: "recvmsg",
                    source: std::io::Error::from_raw_os_error(e.errno()),
                }))
            }
        };
        let fds: Vec<OwnedFd> = fds_raw[..nfds]
            .iter()
            // SAFETY: the kernel just installed these descriptors in our table; we take sole ownership.
            .map(|&fd| unsafe { OwnedFd::from_raw_fd(fd) })
            .collect();
        for fd in &fds {
            // SAFETY: plain fcntl on a descriptor we own.
            unsafe { libc::fcntl(fd.as_raw_fd(), libc::F_SETFD, libc::FD_CLOEXEC) };
        }
        if n == 0 {
            return Err(RecvError::Closed);
        }
        if n < 4 {
            self.sock.read_exact(&mut header[n..]).map_err(map_read_err)?;
        }
        let len = u32::from_le_bytes(header) as usize;
        if len > MAX_FRAME {
            return Err(RecvError::Failed(Error::Protocol(format!("frame of {len} bytes"))));
        }
        let mut payload = vec![0u8; len];
        self.sock.read_exact(&mut payload).map_err(map_read_err)?;
        let msg = postcard::from_bytes(&payload)
            .map_err(|e| RecvError::Failed(Error::Protocol(format!("decode: {e}"))))?;
        Ok((msg, fds))
    }

    pub fn raw_fd(&self) -> RawFd {
        self.sock.as_raw_fd()
    }

    pub fn into_owned_fd(self) -> OwnedFd {
        self.sock.into()
    }

    pub fn from_owned_fd(fd: OwnedFd) -> Channel {
        Channel::new(UnixStream::from(fd))
    }
}

fn map_read_err(e: std::io::Error) -> RecvError {
    match e.kind() {
        std::io::ErrorKind::UnexpectedEof | std::io::ErrorKind::ConnectionReset => RecvError::Closed,
        std::io::ErrorKind::WouldBlock | std::io::ErrorKind::TimedOut => RecvError::TimedOut,
        _ => RecvError::Failed(Error::Sys { op: "read from channel", source: e }),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn frames_and_fds_round_trip() {
        let (mut a, mut b) = Channel::pair().unwrap();
        let f = std::fs::File::open("/dev/null").unwrap();
        a.send(&(7u32, vec![1u8; 100_000]), &[f.as_raw_fd()]).unwrap();
        let ((x, v), fds): ((u32, Vec<u8>), _) = b.recv().unwrap();
        assert_eq!(x, 7);
        assert_eq!(v.len(), 100_000);
        assert_eq!(fds.len(), 1);
        drop(a);
        assert!(matches!(b.recv::<u32>(), Err(RecvError::Closed)));
    }
}
