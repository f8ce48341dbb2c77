//! A ZMQ REQ connection over TCP (ZMTP 3.0, NULL mechanism: RFC 23), the client side of a
//! consumer's control socket, with every length a peer sends bounded.
//!
//! The control client talks to addresses a request names (`consumer_zmq`), so the peer is not
//! trusted. A ZMQ library's decoder reserves a frame's declared length before it reads the
//! frame: a peer declaring a frame of 2^44 bytes made the allocation fail, which aborts the
//! whole process. Here a frame longer than [`MAX_FRAME_BYTES`] is a protocol error of that
//! one exchange, and the bytes are read as they come.
//!
//! What a REQ socket does and no more: one connection, the greeting and READY handshake, then
//! strictly alternating requests (an empty delimiter frame and the body) and replies (the
//! delimiter back, then the body). Commands a peer sends between replies (ZMTP 3.1's PING) are
//! skipped. Peers speaking ZMTP 3.1 (libzmq, pyzmq) answer a 3.0 greeting in 3.0.

use std::fmt;
use std::io;

use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

/// The longest frame a peer may send: control replies are small JSON documents (a
/// `reserve_batch` answer is about 250 bytes an item, so this is thousands of items).
pub const MAX_FRAME_BYTES: u64 = 1 << 20;

/// Frame flags (RFC 23): more frames follow; an 8-byte length; a command.
const MORE: u8 = 0x01;
const LONG: u8 = 0x02;
const COMMAND: u8 = 0x04;

/// Why a connection or an exchange failed.
#[derive(Debug)]
pub enum ZmtpError {
    /// The connection could not be made, or broke.
    Io(io::Error),
    /// The peer does not speak ZMTP 3 as a REP socket would, or sent a frame out of bounds.
    Protocol(String),
}

impl fmt::Display for ZmtpError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            ZmtpError::Io(err) => write!(f, "{err}"),
            ZmtpError::Protocol(message) => f.write_str(message),
        }
    }
}

impl std::error::Error for ZmtpError {}

impl From<io::Error> for ZmtpError {
    fn from(err: io::Error) -> Self {
        ZmtpError::Io(err)
    }
}

/// One REQ connection to a REP (or ROUTER) peer.
#[derive(Debug)]
pub struct ReqConnection {
    stream: TcpStream,
}

impl ReqConnection {
    /// Connects to `addr` (`tcp://host:port`), without the ZMTP handshake
    /// ([`ReqConnection::handshake`] follows), so that a caller can tell a peer that cannot be
    /// reached from one that was reached and does not answer.
    ///
    /// # Errors
    /// [`ZmtpError::Io`] for a connection that fails, [`ZmtpError::Protocol`] for an address
    /// that is not `tcp://`.
    pub async fn open(addr: &str) -> Result<ReqConnection, ZmtpError> {
        let Some(host_port) = addr.strip_prefix("tcp://") else {
            return Err(ZmtpError::Protocol(format!(
                "{addr} is not a tcp:// address"
            )));
        };
        let stream = TcpStream::connect(host_port).await?;
        // Requests are small and each waits for its reply: no Nagle delay.
        stream.set_nodelay(true)?;
        Ok(ReqConnection { stream })
    }

    /// The greeting and READY exchange on a connection from [`ReqConnection::open`].
    ///
    /// # Errors
    /// [`ZmtpError::Io`] for a connection that breaks, [`ZmtpError::Protocol`] for a peer that
    /// is not a ZMTP 3 REP socket.
    pub async fn handshake(&mut self) -> Result<(), ZmtpError> {
        let mut greeting = [0u8; 64];
        greeting[0] = 0xff;
        greeting[9] = 0x7f;
        greeting[10] = 3;
        greeting[12..16].copy_from_slice(b"NULL");
        self.stream.write_all(&greeting).await?;
        let mut peer = [0u8; 64];
        self.stream.read_exact(&mut peer).await?;
        if peer[0] != 0xff || peer[9] & 1 != 1 {
            return Err(ZmtpError::Protocol(
                "the peer's greeting is not ZMTP's".to_owned(),
            ));
        }
        if peer[10] < 3 {
            return Err(ZmtpError::Protocol(format!(
                "the peer speaks ZMTP {}.{}; 3.0 or later is needed",
                peer[10], peer[11]
            )));
        }
        let mechanism = &peer[12..32];
        if &mechanism[..4] != b"NULL" || mechanism[4..].iter().any(|&b| b != 0) {
            return Err(ZmtpError::Protocol(format!(
                "the peer asks for the security mechanism {:?}; only NULL is spoken",
                String::from_utf8_lossy(mechanism).trim_end_matches('\0')
            )));
        }
        let mut ready = Vec::with_capacity(32);
        ready.push(5);
        ready.extend_from_slice(b"READY");
        ready.push(11);
        ready.extend_from_slice(b"Socket-Type");
        ready.extend_from_slice(&3u32.to_be_bytes());
        ready.extend_from_slice(b"REQ");
        self.write_frame(COMMAND, &ready).await?;
        let (flags, body) = self.read_frame().await?;
        if flags & COMMAND == 0 {
            return Err(ZmtpError::Protocol(
                "the peer sent a message before its READY command".to_owned(),
            ));
        }
        let (name, properties) = command_name(&body)?;
        match name {
            b"READY" => {
                let socket_type = property(properties, b"Socket-Type")?;
                if socket_type != b"REP" && socket_type != b"ROUTER" {
                    return Err(ZmtpError::Protocol(format!(
                        "the peer is a {} socket; a control port is REP",
                        String::from_utf8_lossy(socket_type)
                    )));
                }
                Ok(())
            }
            b"ERROR" => Err(ZmtpError::Protocol(format!(
                "the peer refused the handshake: {}",
                String::from_utf8_lossy(properties.get(1..).unwrap_or_default())
            ))),
            other => Err(ZmtpError::Protocol(format!(
                "the peer answered the handshake with the command {:?}",
                String::from_utf8_lossy(other)
            ))),
        }
    }

    /// Sends `request` and returns the reply's body.
    ///
    /// # Errors
    /// [`ExchangeError`]: the connection broke (saying whether the request was written) or
    /// the reply is not a REP socket's.
    pub async fn exchange(&mut self, request: &[u8]) -> Result<Vec<u8>, ExchangeError> {
        let sent = |error| ExchangeError { error, sent: false };
        let mut out = Vec::with_capacity(request.len() + 11);
        out.extend_from_slice(&[MORE, 0]);
        push_frame(&mut out, 0, request);
        self.stream
            .write_all(&out)
            .await
            .map_err(|err| sent(ZmtpError::Io(err)))?;
        let received = |error| ExchangeError { error, sent: true };
        let mut frames: Vec<Vec<u8>> = Vec::new();
        loop {
            let (flags, body) = self.read_frame().await.map_err(received)?;
            if flags & COMMAND != 0 {
                // PING and the like, which a REQ socket need not answer.
                continue;
            }
            frames.push(body);
            if flags & MORE == 0 {
                break;
            }
            if frames.len() > 2 {
                return Err(received(ZmtpError::Protocol(
                    "the reply has more frames than a REP socket's".to_owned(),
                )));
            }
        }
        match frames.as_slice() {
            [delimiter, body] if delimiter.is_empty() => Ok(body.clone()),
            _ => Err(received(ZmtpError::Protocol(format!(
                "the reply is {} frame(s), not a REP socket's empty delimiter and body",
                frames.len()
            )))),
        }
    }

    /// Whether the peer has closed the connection (or sent something unasked, which leaves
    /// it out of step): a pooled connection found so is not used again.
    #[must_use]
    pub fn is_stale(&self) -> bool {
        !is_quiet(&self.stream)
    }

    async fn write_frame(&mut self, flags: u8, body: &[u8]) -> io::Result<()> {
        let mut out = Vec::with_capacity(body.len() + 9);
        push_frame(&mut out, flags, body);
        self.stream.write_all(&out).await
    }

    /// One frame: its flags and body, its length checked before a byte of it is stored.
    async fn read_frame(&mut self) -> Result<(u8, Vec<u8>), ZmtpError> {
        let flags = self.stream.read_u8().await?;
        let length = if flags & LONG != 0 {
            self.stream.read_u64().await?
        } else {
            u64::from(self.stream.read_u8().await?)
        };
        if length > MAX_FRAME_BYTES {
            return Err(ZmtpError::Protocol(format!(
                "the peer sent a frame of {length} bytes, more than the {MAX_FRAME_BYTES} a control reply may be"
            )));
        }
        let mut body = Vec::new();
        (&mut self.stream)
            .take(length)
            .read_to_end(&mut body)
            .await?;
        if body.len() as u64 != length {
            return Err(ZmtpError::Io(io::Error::new(
                io::ErrorKind::UnexpectedEof,
                format!(
                    "the connection closed {} bytes into a {length}-byte frame",
                    body.len()
                ),
            )));
        }
        Ok((flags, body))
    }
}

/// Whether an idle connection is open and quiet: a read would block. Closed (0 bytes), failed,
/// or with bytes nobody asked for, it is not to be reused. A pool checks each connection so
/// before it takes it: after a peer's restart every pooled connection is dead.
pub(crate) fn is_quiet(stream: &TcpStream) -> bool {
    let mut byte = [0u8; 1];
    matches!(stream.try_read(&mut byte), Err(err) if err.kind() == io::ErrorKind::WouldBlock)
}

/// An exchange that failed, and whether its request had been written when it did: a request
/// never written may be sent again on another connection without being applied twice.
#[derive(Debug)]
pub struct ExchangeError {
    /// What went wrong.
    pub error: ZmtpError,
    /// Whether the request was written.
    pub sent: bool,
}

/// Appends a frame of `body` with `flags` (the long form when it needs 8 length bytes).
fn push_frame(out: &mut Vec<u8>, flags: u8, body: &[u8]) {
    match u8::try_from(body.len()) {
        Ok(short) => out.extend_from_slice(&[flags, short]),
        Err(_) => {
            out.push(flags | LONG);
            out.extend_from_slice(&(body.len() as u64).to_be_bytes());
        }
    }
    out.extend_from_slice(body);
}

/// A command frame's name and the bytes after it.
fn command_name(body: &[u8]) -> Result<(&[u8], &[u8]), ZmtpError> {
    let bad = || ZmtpError::Protocol("a command frame without its name".to_owned());
    let (&len, rest) = body.split_first().ok_or_else(bad)?;
    let len = usize::from(len);
    if rest.len() < len {
        return Err(bad());
    }
    Ok(rest.split_at(len))
}

/// The value of metadata property `name` (RFC 23: a 1-byte name length, the name, a 4-byte
/// big-endian value length, the value).
fn property<'a>(mut properties: &'a [u8], name: &[u8]) -> Result<&'a [u8], ZmtpError> {
    let bad = || ZmtpError::Protocol("the peer's READY metadata is malformed".to_owned());
    while let Some((&name_len, rest)) = properties.split_first() {
        let name_len = usize::from(name_len);
        let (key, rest) = rest.split_at_checked(name_len).ok_or_else(bad)?;
        let (len, rest) = rest.split_at_checked(4).ok_or_else(bad)?;
        let len = u32::from_be_bytes(len.try_into().map_err(|_| bad())?);
        let len = usize::try_from(len).map_err(|_| bad())?;
        let (value, rest) = rest.split_at_checked(len).ok_or_else(bad)?;
        if key.eq_ignore_ascii_case(name) {
            return Ok(value);
        }
        properties = rest;
    }
    Err(ZmtpError::Protocol(format!(
        "the peer's READY names no {}",
        String::from_utf8_lossy(name)
    )))
}
