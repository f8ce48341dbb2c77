//! Mooncake's TransferEngine wire, initiator side, TCP transport (Mooncake
//! `mooncake-transfer-engine`: `include/common.h`, `src/transfer_metadata_plugin.cpp`,
//! `src/transport/tcp_transport/`).
//!
//! - **Handshake** (P2P mode, no metadata server): connect to the consumer's session
//!   `host:rpc_port`, send one frame `u64 LE length (1 + JSON bytes) | type u8 | JSON` of type 1
//!   (metadata) describing this side, read back a frame of the same type carrying the consumer's
//!   segment descriptor (`protocol`, `tcp_data_host`, `tcp_data_port`, `tcp_proto_version`,
//!   `buffers: [{addr, length}]`). Done once per session and cached; done again when the cached
//!   descriptor no longer fits (a range outside every buffer, a data port that refuses), which
//!   is what a restarted consumer looks like.
//! - **Write**: on a connection to the data port, a 24-byte header `u64 LE size | u64 LE remote
//!   address | u8 opcode | 7 bytes zero` with opcode 1 (write), ORed with `0x80` for protocol
//!   version 2, then the payload straight from the caller's buffer. Version 2 answers with an
//!   8-byte LE status once the bytes are in place: `0x4D435456_00000000` is success, a low word of
//!   1 means the range was rejected (the consumer then closes the connection). Version 1 answers
//!   nothing. Connections are pooled per session and reused after a successful write.
//!
//! Only TCP is spoken: a consumer that advertises `rdma` is refused with what to do about it.

use std::num::NonZeroUsize;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use lru::LruCache;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpStream;

use super::{ConsumerAllowList, PushFailure};

/// Handshake frame type of a metadata exchange.
pub const HANDSHAKE_METADATA: u8 = 1;
/// The largest handshake frame accepted (Mooncake's own limit).
pub const MAX_HANDSHAKE_BYTES: u64 = 1 << 20;
/// The write opcode.
pub const OPCODE_WRITE: u8 = 1;
/// The flag of a protocol-2 request (the target answers with a status).
pub const OPCODE_STATUS_FLAG: u8 = 0x80;
/// A protocol-2 success status.
pub const STATUS_OK: u64 = 0x4D43_5456_0000_0000;
/// The magic a protocol-2 status carries in its high word.
const STATUS_MAGIC: u64 = 0x4D43_5456;
/// Idle data connections kept per session.
const MAX_IDLE_PER_SESSION: usize = 8;

/// Why one write failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct TransferError {
    /// The class of failure (a metric label).
    pub failure: PushFailure,
    /// What happened, naming the session.
    pub message: String,
}

impl TransferError {
    fn new(failure: PushFailure, message: String) -> Self {
        Self { failure, message }
    }
}

/// One registered buffer of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SegmentBuffer {
    /// Its address in the consumer's process.
    pub addr: u64,
    /// Its length in bytes.
    pub length: u64,
}

/// What a consumer's handshake says of its memory and transport.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SegmentDescriptor {
    /// The segment's name.
    pub name: String,
    /// `tcp` or `rdma`.
    pub protocol: String,
    /// The data host, when the descriptor names one (otherwise the session's host).
    pub tcp_data_host: Option<String>,
    /// The data port.
    pub tcp_data_port: u16,
    /// 1 (no status) or 2 (a status after each write).
    pub tcp_proto_version: u32,
    /// The registered buffers.
    pub buffers: Vec<SegmentBuffer>,
}

impl SegmentDescriptor {
    /// Reads a descriptor from the handshake's JSON.
    ///
    /// # Errors
    /// A message naming the missing or malformed field.
    pub fn from_json(value: &Value) -> Result<Self, String> {
        let text = |key: &str| value.get(key).and_then(Value::as_str).map(str::to_owned);
        let protocol = text("protocol").ok_or("no `protocol`")?;
        let buffers = value
            .get("buffers")
            .and_then(Value::as_array)
            .map(|list| {
                list.iter()
                    .map(|b| {
                        Some(SegmentBuffer {
                            addr: b.get("addr")?.as_u64()?,
                            length: b.get("length")?.as_u64()?,
                        })
                    })
                    .collect::<Option<Vec<_>>>()
            })
            .unwrap_or(Some(Vec::new()))
            .ok_or("a buffer without a numeric `addr` and `length`")?;
        let tcp_data_port = if protocol == "tcp" {
            value
                .get("tcp_data_port")
                .and_then(Value::as_u64)
                .and_then(|p| u16::try_from(p).ok())
                .filter(|p| *p != 0)
                .ok_or("no valid `tcp_data_port`")?
        } else {
            0
        };
        let tcp_proto_version = value
            .get("tcp_proto_version")
            .and_then(Value::as_u64)
            .map_or(Ok(1), u32::try_from)
            .map_err(|_| "`tcp_proto_version` out of range")?;
        Ok(Self {
            name: text("name").unwrap_or_default(),
            protocol,
            tcp_data_host: text("tcp_data_host").filter(|h| !h.is_empty()),
            tcp_data_port,
            tcp_proto_version,
            buffers,
        })
    }

    /// Whether `[addr, addr + len)` lies inside one registered buffer.
    #[must_use]
    pub fn contains(&self, addr: u64, len: u64) -> bool {
        let Some(end) = addr.checked_add(len) else {
            return false;
        };
        self.buffers.iter().any(|b| {
            b.addr
                .checked_add(b.length)
                .is_some_and(|buffer_end| addr >= b.addr && end <= buffer_end)
        })
    }
}

/// The 24-byte header of a write of `len` bytes to `addr`.
#[must_use]
pub fn write_header(len: u64, addr: u64, proto_version: u32) -> [u8; 24] {
    let mut header = [0u8; 24];
    header[..8].copy_from_slice(&len.to_le_bytes());
    header[8..16].copy_from_slice(&addr.to_le_bytes());
    header[16] = if proto_version >= 2 {
        OPCODE_WRITE | OPCODE_STATUS_FLAG
    } else {
        OPCODE_WRITE
    };
    header
}

/// A handshake frame of `kind` carrying `body`.
#[must_use]
pub fn handshake_frame(kind: u8, body: &[u8]) -> Vec<u8> {
    let mut frame = Vec::with_capacity(9 + body.len());
    frame.extend_from_slice(&(body.len() as u64 + 1).to_le_bytes());
    frame.push(kind);
    frame.extend_from_slice(body);
    frame
}

/// `host` and `port` of a `host:port` (IPv6 hosts in brackets).
///
/// # Errors
/// A message when there is no port.
pub fn split_host_port(session: &str) -> Result<(String, u16), String> {
    let (host, port) = session
        .rsplit_once(':')
        .ok_or_else(|| format!("{session:?} is not host:port"))?;
    let port = port
        .parse::<u16>()
        .map_err(|_| format!("{session:?} has no valid port"))?;
    let host = host.trim_start_matches('[').trim_end_matches(']');
    if host.is_empty() {
        return Err(format!("{session:?} has no host"));
    }
    Ok((host.to_owned(), port))
}

struct Session {
    descriptor: SegmentDescriptor,
    data_addr: (String, u16),
    idle: Mutex<Vec<TcpStream>>,
}

/// The initiator: handshakes cached per session, data connections pooled per session.
pub struct TransferClient {
    timeout: Duration,
    /// The name this side gives itself in handshakes.
    local_name: String,
    /// At most [`super::control::MAX_PEERS`], the least recently used forgotten past it (with
    /// their pooled connections): pushes name their consumers, so every session ever answered
    /// would otherwise be kept.
    sessions: Mutex<LruCache<String, Arc<Session>>>,
    /// The hosts sessions and data ports may be on; any without a list.
    allowed: Option<Arc<ConsumerAllowList>>,
}

impl std::fmt::Debug for TransferClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TransferClient")
            .field("timeout", &self.timeout)
            .field("local_name", &self.local_name)
            .finish_non_exhaustive()
    }
}

impl TransferClient {
    /// A client whose handshakes and writes each end within `timeout`.
    #[must_use]
    pub fn new(timeout: Duration, local_name: String) -> Self {
        Self {
            timeout,
            local_name,
            sessions: Mutex::new(LruCache::new(
                NonZeroUsize::new(super::control::MAX_PEERS).unwrap_or(NonZeroUsize::MIN),
            )),
            allowed: None,
        }
    }

    /// This client, connecting only to sessions and data hosts on `allowed`.
    #[must_use]
    pub fn with_allowed(mut self, allowed: Arc<ConsumerAllowList>) -> Self {
        self.allowed = Some(allowed);
        self
    }

    /// Whether this client may connect to `session` (a reservation's `dst_session`,
    /// `host:rpc_port`).
    ///
    /// # Errors
    /// [`PushFailure::NotAllowed`] naming the session, when its host is not on the list.
    pub fn check_session(&self, session: &str) -> Result<(), TransferError> {
        match &self.allowed {
            Some(allowed) if !allowed.allows_address(session) => Err(TransferError::new(
                PushFailure::NotAllowed,
                format!(
                    "the Mooncake session {session} (a reservation's dst_session) is not among the allowed consumers; nothing was sent to it"
                ),
            )),
            _ => Ok(()),
        }
    }

    /// The descriptor of `session`, from the cache or a fresh handshake.
    ///
    /// # Errors
    /// [`TransferError`] for a session that cannot be reached or answers nonsense.
    pub async fn descriptor(&self, session: &str) -> Result<SegmentDescriptor, TransferError> {
        Ok(self
            .session(session, false)
            .await?
            .session
            .descriptor
            .clone())
    }

    /// Writes `payload` to `dst` in `session`'s memory and returns once the consumer has it
    /// (protocol 2) or the bytes are sent (protocol 1).
    ///
    /// # Errors
    /// [`TransferError`]: an RDMA-only consumer, a range outside its buffers, a connection that
    /// failed or was cut, a rejected range, no status within the time limit.
    pub async fn write(
        &self,
        session: &str,
        dst: u64,
        payload: &[u8],
    ) -> Result<(), TransferError> {
        let len = payload.len() as u64;
        let SessionState {
            session: mut session_state,
            mut fresh,
        } = self.session(session, false).await?;
        if !session_state.descriptor.contains(dst, len) && !fresh {
            // A restarted consumer registers new buffers: ask again before refusing.
            session_state = self.session(session, true).await?.session;
            fresh = true;
        }
        check_segment(session, &session_state.descriptor, dst, len)?;
        let mut retried = false;
        loop {
            let (stream, reused) = match take_idle(&session_state) {
                Some(stream) => (stream, true),
                None => match self.connect_data(session, &session_state).await {
                    Ok(stream) => (stream, false),
                    Err(_) if !fresh => {
                        // The cached data port is gone: the consumer restarted.
                        session_state = self.session(session, true).await?.session;
                        check_segment(session, &session_state.descriptor, dst, len)?;
                        fresh = true;
                        continue;
                    }
                    Err(err) => return Err(err),
                },
            };
            match self
                .write_on(stream, session, &session_state, dst, payload)
                .await
            {
                Ok(stream) => {
                    give_back(&session_state, stream);
                    return Ok(());
                }
                // A pooled connection may have been closed by the consumer while idle; the write
                // is idempotent (same bytes, same place), so it goes once more on a new one.
                Err(err)
                    if reused && !retried && matches!(err.failure, PushFailure::Connection) =>
                {
                    retried = true;
                }
                Err(err) => return Err(err),
            }
        }
    }

    async fn write_on(
        &self,
        mut stream: TcpStream,
        session: &str,
        state: &Session,
        dst: u64,
        payload: &[u8],
    ) -> Result<TcpStream, TransferError> {
        let version = state.descriptor.tcp_proto_version;
        let header = write_header(payload.len() as u64, dst, version);
        let lost = |what: &str, err: std::io::Error| {
            TransferError::new(
                PushFailure::Connection,
                format!("the data connection to {session} was cut {what}: {err}"),
            )
        };
        let io = async {
            stream
                .write_all(&header)
                .await
                .map_err(|e| lost("before the write", e))?;
            stream
                .write_all(payload)
                .await
                .map_err(|e| lost("mid-write", e))?;
            if version < 2 {
                stream.flush().await.map_err(|e| lost("mid-write", e))?;
                return Ok(());
            }
            let mut status = [0u8; 8];
            stream
                .read_exact(&mut status)
                .await
                .map_err(|e| lost("before the write's status", e))?;
            let status = u64::from_le_bytes(status);
            if status == STATUS_OK {
                Ok(())
            } else if status >> 32 == STATUS_MAGIC && status & 0xFFFF_FFFF == 1 {
                Err(TransferError::new(
                    PushFailure::Rejected,
                    format!(
                        "{session} rejected the write of {} bytes at {dst:#x}: the range is not inside a registered buffer",
                        payload.len()
                    ),
                ))
            } else {
                Err(TransferError::new(
                    PushFailure::Protocol,
                    format!("{session} answered the write with status {status:#018x}"),
                ))
            }
        };
        match tokio::time::timeout(self.timeout, io).await {
            Ok(Ok(())) => Ok(stream),
            Ok(Err(err)) => Err(err),
            Err(_) => Err(TransferError::new(
                PushFailure::Timeout,
                format!(
                    "the write of {} bytes to {session} did not finish within {:.1} s",
                    payload.len(),
                    self.timeout.as_secs_f64()
                ),
            )),
        }
    }

    async fn connect_data(
        &self,
        session: &str,
        state: &Session,
    ) -> Result<TcpStream, TransferError> {
        let (host, port) = &state.data_addr;
        let stream =
            match tokio::time::timeout(self.timeout, TcpStream::connect((host.as_str(), *port)))
                .await
            {
                Ok(Ok(stream)) => stream,
                Ok(Err(err)) => {
                    return Err(TransferError::new(
                        PushFailure::Unreachable,
                        format!("cannot connect to {session}'s data port {host}:{port}: {err}"),
                    ));
                }
                Err(_) => {
                    return Err(TransferError::new(
                        PushFailure::Unreachable,
                        format!(
                            "cannot connect to {session}'s data port {host}:{port} within {:.1} s",
                            self.timeout.as_secs_f64()
                        ),
                    ));
                }
            };
        // The status of each write is waited for: no Nagle delay on the small frames.
        stream.set_nodelay(true).map_err(|err| {
            TransferError::new(PushFailure::Connection, format!("{session}: {err}"))
        })?;
        Ok(stream)
    }

    /// The session's state, from the cache unless `refresh`, with whether it is fresh.
    async fn session(&self, session: &str, refresh: bool) -> Result<SessionState, TransferError> {
        if !refresh
            && let Some(known) = self
                .sessions
                .lock()
                .unwrap_or_else(PoisonError::into_inner)
                .get(session)
        {
            return Ok(SessionState {
                session: Arc::clone(known),
                fresh: false,
            });
        }
        self.check_session(session)?;
        let descriptor = self.handshake(session).await?;
        let (session_host, _) =
            split_host_port(session).map_err(|e| TransferError::new(PushFailure::Protocol, e))?;
        let data_host = descriptor.tcp_data_host.clone().unwrap_or(session_host);
        if let Some(allowed) = &self.allowed
            && !allowed.allows(&data_host)
        {
            // Not cached: the next push asks again, and is refused again unless it changed.
            return Err(TransferError::new(
                PushFailure::NotAllowed,
                format!(
                    "{session}'s handshake names the data address {data_host}:{}, which is not among the allowed consumers; nothing was sent to it",
                    descriptor.tcp_data_port
                ),
            ));
        }
        let state = Arc::new(Session {
            data_addr: (data_host, descriptor.tcp_data_port),
            descriptor,
            idle: Mutex::new(Vec::new()),
        });
        self.sessions
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .put(session.to_owned(), Arc::clone(&state));
        Ok(SessionState {
            session: state,
            fresh: true,
        })
    }

    async fn handshake(&self, session: &str) -> Result<SegmentDescriptor, TransferError> {
        let protocol = |message: String| TransferError::new(PushFailure::Protocol, message);
        let (host, port) = split_host_port(session)
            .map_err(|e| protocol(format!("the consumer's dst_session: {e}")))?;
        let me = json!({
            "name": self.local_name,
            "protocol": "tcp",
            "tcp_data_port": 0,
            "buffers": [],
        })
        .to_string();
        let exchange = async {
            let mut stream = TcpStream::connect((host.as_str(), port))
                .await
                .map_err(|err| {
                    TransferError::new(
                        PushFailure::Unreachable,
                        format!("cannot reach {session}'s handshake port: {err}"),
                    )
                })?;
            let io = |err: std::io::Error| {
                TransferError::new(
                    PushFailure::Connection,
                    format!("the handshake with {session} failed: {err}"),
                )
            };
            stream
                .write_all(&handshake_frame(HANDSHAKE_METADATA, me.as_bytes()))
                .await
                .map_err(io)?;
            let mut head = [0u8; 9];
            stream.read_exact(&mut head).await.map_err(io)?;
            let length = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
            if length == 0 || length > MAX_HANDSHAKE_BYTES {
                return Err(protocol(format!(
                    "{session} answered the handshake with a frame of {length} bytes"
                )));
            }
            if head[8] != HANDSHAKE_METADATA {
                return Err(protocol(format!(
                    "{session} answered the handshake with frame type {}, not metadata",
                    head[8]
                )));
            }
            let mut body = vec![0u8; usize::try_from(length - 1).unwrap_or(0)];
            stream.read_exact(&mut body).await.map_err(io)?;
            let value: Value = serde_json::from_slice(&body).map_err(|err| {
                protocol(format!("{session}'s segment descriptor is not JSON: {err}"))
            })?;
            SegmentDescriptor::from_json(&value)
                .map_err(|err| protocol(format!("{session}'s segment descriptor: {err}")))
        };
        match tokio::time::timeout(self.timeout, exchange).await {
            Ok(result) => result,
            Err(_) => Err(TransferError::new(
                PushFailure::Timeout,
                format!(
                    "no handshake answer from {session} within {:.1} s",
                    self.timeout.as_secs_f64()
                ),
            )),
        }
    }
}

struct SessionState {
    session: Arc<Session>,
    fresh: bool,
}

/// Refuses a descriptor this initiator cannot write to, or a range outside its buffers.
fn check_segment(
    session: &str,
    descriptor: &SegmentDescriptor,
    dst: u64,
    len: u64,
) -> Result<(), TransferError> {
    if descriptor.protocol != "tcp" {
        return Err(TransferError::new(
            PushFailure::Rdma,
            format!(
                "the consumer at {session} advertises Mooncake protocol {:?}; iris writes over TCP only: restart the consumer with MC_FORCE_TCP=1",
                descriptor.protocol
            ),
        ));
    }
    if !descriptor.contains(dst, len) {
        return Err(TransferError::new(
            PushFailure::Rejected,
            format!(
                "the destination {dst:#x}..+{len} lies outside every buffer {session} registered"
            ),
        ));
    }
    Ok(())
}

/// A pooled data connection the consumer has not closed, if any: after a consumer restart
/// every pooled one is dead, and the write's single retry would meet the next.
fn take_idle(session: &Session) -> Option<TcpStream> {
    let mut idle = session.idle.lock().unwrap_or_else(PoisonError::into_inner);
    while let Some(stream) = idle.pop() {
        if super::zmtp::is_quiet(&stream) {
            return Some(stream);
        }
    }
    None
}

fn give_back(session: &Session, stream: TcpStream) {
    let mut idle = session.idle.lock().unwrap_or_else(PoisonError::into_inner);
    if idle.len() < MAX_IDLE_PER_SESSION {
        idle.push(stream);
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_header_is_mooncakes() {
        let header = write_header(0x0102, 0x7f00_0000_1000, 2);
        assert_eq!(&header[..8], &0x0102u64.to_le_bytes());
        assert_eq!(&header[8..16], &0x7f00_0000_1000u64.to_le_bytes());
        assert_eq!(header[16], 0x81);
        assert_eq!(&header[17..], &[0; 7]);
        assert_eq!(write_header(1, 2, 1)[16], 0x01);
        assert_eq!(
            handshake_frame(1, b"{}"),
            [3, 0, 0, 0, 0, 0, 0, 0, 1, b'{', b'}']
        );
    }

    #[test]
    fn a_descriptor_is_read_and_ranges_checked() {
        // As Mooncake 0.3.13's handshake daemon answered in a recorded exchange.
        let value: Value = serde_json::from_str(
            r#"{"buffers": [{"addr": 140029522337808, "length": 1048576, "name": "127.0.0.1:15743"}],
                "name": "127.0.0.1:15743", "protocol": "tcp", "rdma_server_name": "",
                "tcp_data_host": "127.0.0.1", "tcp_data_port": 15616, "tcp_proto_version": 2,
                "timestamp": "2026-11-26 04:05:52.995419"}"#,
        )
        .unwrap();
        let d = SegmentDescriptor::from_json(&value).unwrap();
        assert_eq!(d.tcp_data_port, 15616);
        assert_eq!(d.tcp_proto_version, 2);
        assert_eq!(d.tcp_data_host.as_deref(), Some("127.0.0.1"));
        let base = 140_029_522_337_808;
        assert!(d.contains(base, 1 << 20));
        assert!(d.contains(base + 4096, 4096));
        assert!(!d.contains(base + 1, 1 << 20));
        assert!(!d.contains(base - 1, 2));
        assert!(!d.contains(u64::MAX, 2));
        let rdma = serde_json::json!({"protocol": "rdma", "buffers": []});
        assert_eq!(
            SegmentDescriptor::from_json(&rdma).unwrap().protocol,
            "rdma"
        );
        let no_port = serde_json::json!({"protocol": "tcp", "buffers": []});
        assert!(SegmentDescriptor::from_json(&no_port).is_err());
        let v1 = serde_json::json!({"protocol": "tcp", "tcp_data_port": 9, "buffers": []});
        assert_eq!(
            SegmentDescriptor::from_json(&v1).unwrap().tcp_proto_version,
            1
        );
    }

    #[test]
    fn sessions_split_into_host_and_port() {
        assert_eq!(
            split_host_port("127.0.0.1:16595").unwrap(),
            ("127.0.0.1".to_owned(), 16595)
        );
        assert_eq!(split_host_port("[::1]:80").unwrap(), ("::1".to_owned(), 80));
        assert!(split_host_port("nohost").is_err());
        assert!(split_host_port(":80").is_err());
        assert!(split_host_port("h:99999").is_err());
    }
}
