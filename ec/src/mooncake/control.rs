//! The control channel to a consumer: ZMQ REQ, one UTF-8 JSON frame per message, replies in the
//! envelope `{"ok": true, "result": R}` or `{"ok": false, "error": "..."}` (vLLM's
//! `mooncake/control.py`).
//!
//! A REQ socket strictly alternates send and receive, so each exchange takes a connection of its
//! own ([`super::zmtp`], every length the peer sends bounded) from a per-address pool and gives
//! it back only after a complete exchange. A connection whose exchange failed or timed out is
//! dropped (as vLLM's client discards its socket): its REQ state is unknown. A pooled
//! connection the peer has closed (a consumer that restarted) is dropped before it is used, and
//! a request that could not even be written on a pooled one is sent once more on a fresh one;
//! nothing was delivered, so this cannot apply a request twice.

use std::num::NonZeroUsize;
use std::sync::{Mutex, PoisonError};
use std::time::Duration;

use lru::LruCache;
use serde_json::{Value, json};

use super::PushFailure;
use super::zmtp::{ExchangeError, ReqConnection, ZmtpError};

/// Idle sockets kept per address: enough for the concurrent exchanges of a busy encoder.
const MAX_IDLE_PER_ADDRESS: usize = 16;

/// The most shards (ports of its `peers` reply) a consumer may have: one per worker process,
/// so a few per node.
pub const MAX_SHARDS: usize = 256;

/// The most addresses whose idle sockets, and consumers whose topologies, a client keeps: the
/// least recently used are forgotten past it (their sockets closed). Requests name the
/// consumer they push to, so without a bound every address ever answered would be kept, with
/// up to `MAX_IDLE_PER_ADDRESS` open connections each, for the life of the server.
pub const MAX_PEERS: usize = 1024;
// A consumer's shards are all kept while it is pushed to.
const _: () = assert!(MAX_PEERS >= MAX_SHARDS);

/// Why one control exchange failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{message}")]
pub struct ControlError {
    /// The class of failure (a metric label).
    pub failure: PushFailure,
    /// What happened, naming the address.
    pub message: String,
}

impl ControlError {
    fn new(failure: PushFailure, message: String) -> Self {
        Self { failure, message }
    }
}

/// A pool of REQ sockets per consumer address, with the exchange time limit.
pub struct ControlClient {
    timeout: Duration,
    idle: Mutex<LruCache<String, Vec<ReqConnection>>>,
    /// Shard addresses per consumer address, as its `peers` reply named them (vLLM keeps them
    /// for the life of the producer too: a consumer's topology is fixed at its start).
    topologies: Mutex<LruCache<String, Vec<String>>>,
}

impl std::fmt::Debug for ControlClient {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ControlClient")
            .field("timeout", &self.timeout)
            .finish_non_exhaustive()
    }
}

impl ControlClient {
    /// A client whose exchanges (connection included) each end within `timeout`.
    #[must_use]
    pub fn new(timeout: Duration) -> Self {
        Self::with_max_peers(timeout, MAX_PEERS)
    }

    /// [`ControlClient::new`] keeping at most `max_peers` addresses (at least one) instead of
    /// [`MAX_PEERS`].
    #[must_use]
    pub fn with_max_peers(timeout: Duration, max_peers: usize) -> Self {
        let cap = NonZeroUsize::new(max_peers).unwrap_or(NonZeroUsize::MIN);
        Self {
            timeout,
            idle: Mutex::new(LruCache::new(cap)),
            topologies: Mutex::new(LruCache::new(cap)),
        }
    }

    /// How many addresses have idle sockets kept, and how many consumers' topologies are
    /// known: both at most the client's bound ([`MAX_PEERS`]).
    #[must_use]
    pub fn kept(&self) -> (usize, usize) {
        let idle = self
            .idle
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        let topologies = self
            .topologies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .len();
        (idle, topologies)
    }

    /// The limit of one exchange.
    #[must_use]
    pub fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Sends `payload` to `addr` and returns the reply's `result`, within the client's time
    /// limit: one deadline covers the connection, its handshake and the exchange (and the
    /// one resend on a fresh connection), as vLLM's socket timeouts bound one request.
    ///
    /// # Errors
    /// [`ControlError`]: no answer within the time limit, a connection that failed, a reply that
    /// is not the envelope, or the consumer's own error (`ok: false`).
    pub async fn request(&self, addr: &str, payload: &Value) -> Result<Value, ControlError> {
        let deadline = tokio::time::Instant::now() + self.timeout;
        let text = payload.to_string();
        let op = payload.get("op").and_then(Value::as_str).unwrap_or("?");
        let pooled = self.take_idle(addr);
        let had_pooled = pooled.is_some();
        let mut connection = match pooled {
            Some(connection) => connection,
            None => self.connect(addr, deadline).await?,
        };
        let mut outcome = exchange(&mut connection, text.as_bytes(), deadline).await;
        if had_pooled && matches!(&outcome, Err(Some(err)) if !err.sent) {
            // The idle connection lost its peer before the request left: nothing was
            // delivered, so it goes once more on a fresh one.
            connection = self.connect(addr, deadline).await?;
            outcome = exchange(&mut connection, text.as_bytes(), deadline).await;
        }
        let frame = match outcome {
            Ok(frame) => frame,
            Err(None) => {
                return Err(ControlError::new(
                    PushFailure::Timeout,
                    format!(
                        "no reply to `{op}` from {addr} within {:.1} s",
                        self.timeout.as_secs_f64()
                    ),
                ));
            }
            Err(Some(ExchangeError {
                error: ZmtpError::Io(err),
                ..
            })) => {
                return Err(ControlError::new(
                    PushFailure::Unreachable,
                    format!("`{op}` to {addr}: the connection failed: {err}"),
                ));
            }
            Err(Some(ExchangeError {
                error: ZmtpError::Protocol(message),
                ..
            })) => {
                return Err(ControlError::new(
                    PushFailure::Protocol,
                    format!("`{op}` to {addr}: {message}"),
                ));
            }
        };
        self.give_back(addr, connection);
        let envelope: Value = serde_json::from_slice(&frame).map_err(|err| {
            ControlError::new(
                PushFailure::Protocol,
                format!(
                    "{addr} answered `{op}` with a frame that is not JSON ({err}): {}",
                    excerpt(&String::from_utf8_lossy(&frame))
                ),
            )
        })?;
        match envelope.get("ok") {
            Some(Value::Bool(true)) => Ok(envelope.get("result").cloned().unwrap_or(Value::Null)),
            Some(Value::Bool(false)) => {
                let error = envelope
                    .get("error")
                    .and_then(Value::as_str)
                    .unwrap_or("EC control request failed");
                Err(ControlError::new(
                    PushFailure::classify_consumer_error(error),
                    format!("{addr} refused `{op}`: {}", excerpt(error)),
                ))
            }
            _ => Err(ControlError::new(
                PushFailure::Protocol,
                format!(
                    "{addr} answered `{op}` without the ok/result envelope: {}",
                    excerpt(&envelope.to_string())
                ),
            )),
        }
    }

    /// The shard addresses of the consumer at `consumer` (`tcp://host:port`): its `peers` reply,
    /// each port on `consumer`'s host. Cached after the first answer.
    ///
    /// # Errors
    /// As [`ControlClient::request`], or a reply without a non-empty `ports` list.
    pub async fn shards(&self, consumer: &str) -> Result<Vec<String>, ControlError> {
        if let Some(known) = self
            .topologies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(consumer)
        {
            return Ok(known.clone());
        }
        let reply = self.request(consumer, &json!({"op": "peers"})).await?;
        let ports: Option<Vec<u16>> = reply
            .get("ports")
            .and_then(Value::as_array)
            .filter(|list| !list.is_empty())
            .and_then(|list| {
                list.iter()
                    .map(|p| p.as_u64().and_then(|p| u16::try_from(p).ok()))
                    .collect()
            });
        let Some(ports) = ports else {
            return Err(ControlError::new(
                PushFailure::Protocol,
                format!(
                    "{consumer} answered `peers` without a list of ports: {}",
                    excerpt(&reply.to_string())
                ),
            ));
        };
        // Every push fans out to every shard: a reply naming thousands is refused, not served.
        if ports.len() > MAX_SHARDS {
            return Err(ControlError::new(
                PushFailure::Protocol,
                format!(
                    "{consumer} answered `peers` with {} ports, more than the {MAX_SHARDS} shards a consumer may have",
                    ports.len()
                ),
            ));
        }
        let prefix = consumer
            .rsplit_once(':')
            .map_or(consumer, |(prefix, _)| prefix);
        let shards: Vec<String> = ports.iter().map(|p| format!("{prefix}:{p}")).collect();
        self.topologies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .put(consumer.to_owned(), shards.clone());
        Ok(shards)
    }

    /// Forgets `consumer`'s topology, so that the next push asks again (after it restarted).
    pub fn forget(&self, consumer: &str) {
        self.topologies
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .pop(consumer);
    }

    /// A new connection to `addr`, handshake done, by `deadline`. A peer that cannot be
    /// reached in time is `unreachable`; one that took the connection and did not complete the
    /// handshake in time (a stopped or overloaded consumer, or another program on the port)
    /// did not answer: `timeout`.
    async fn connect(
        &self,
        addr: &str,
        deadline: tokio::time::Instant,
    ) -> Result<ReqConnection, ControlError> {
        let seconds = self.timeout.as_secs_f64();
        // A connection that breaks is unreachable (`context` says in which phase); a peer that
        // is not a ZMTP REP socket, a protocol failure.
        let failed = |err: ZmtpError, context: String| match err {
            ZmtpError::Io(err) => {
                ControlError::new(PushFailure::Unreachable, format!("{context}: {err}"))
            }
            ZmtpError::Protocol(message) => ControlError::new(
                PushFailure::Protocol,
                format!("{addr} is not an EC control socket: {message}"),
            ),
        };
        let Ok(opened) = tokio::time::timeout_at(deadline, ReqConnection::open(addr)).await else {
            return Err(ControlError::new(
                PushFailure::Unreachable,
                format!(
                    "cannot connect to {addr} within {seconds:.1} s (is the consumer running and its control port reachable?)"
                ),
            ));
        };
        let mut connection =
            opened.map_err(|err| failed(err, format!("cannot connect to {addr}")))?;
        let Ok(handshake) = tokio::time::timeout_at(deadline, connection.handshake()).await else {
            return Err(ControlError::new(
                PushFailure::Timeout,
                format!(
                    "{addr} took the connection but did not complete the ZMTP handshake within {seconds:.1} s (is the consumer's process stopped or overloaded, or another program on its port?)"
                ),
            ));
        };
        handshake.map_err(|err| {
            failed(
                err,
                format!("{addr} closed the connection during the ZMTP handshake"),
            )
        })?;
        Ok(connection)
    }

    /// An idle connection to `addr` whose peer has not closed it (a consumer that restarted
    /// closed them all), if any.
    fn take_idle(&self, addr: &str) -> Option<ReqConnection> {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let pool = idle.get_mut(addr)?;
        while let Some(connection) = pool.pop() {
            if !connection.is_stale() {
                return Some(connection);
            }
        }
        None
    }

    fn give_back(&self, addr: &str, socket: ReqConnection) {
        let mut idle = self.idle.lock().unwrap_or_else(PoisonError::into_inner);
        let list = idle.get_or_insert_mut(addr.to_owned(), Vec::new);
        if list.len() < MAX_IDLE_PER_ADDRESS {
            list.push(socket);
        }
    }
}

/// One exchange on `connection` by `deadline`; `Err(None)` past it.
async fn exchange(
    connection: &mut ReqConnection,
    request: &[u8],
    deadline: tokio::time::Instant,
) -> Result<Vec<u8>, Option<ExchangeError>> {
    match tokio::time::timeout_at(deadline, connection.exchange(request)).await {
        Err(_) => Err(None),
        Ok(reply) => reply.map_err(Some),
    }
}

/// The longest part of a consumer's text that an error message quotes.
const EXCERPT_CHARS: usize = 300;

/// `text` as an error message quotes it: whole when short, else its start and its length.
/// A consumer is named by the request, so what it answers is not trusted to be small: a reply
/// quoted whole made every failed request carry it back (a 1 MiB error body per request).
#[must_use]
pub fn excerpt(text: &str) -> String {
    match text.char_indices().nth(EXCERPT_CHARS) {
        None => text.to_owned(),
        Some((cut, _)) => format!("{}... ({} bytes in all)", &text[..cut], text.len()),
    }
}
