//! The Mooncake push connector, producer side: vLLM 0.33's `ECMooncakeConnector` as an encoder
//! uses it, spoken in Rust over tokio with no Python and no Mooncake library.
//!
//! A consumer (a vLLM prefill/decode instance with `ec_role: ec_consumer`) owns a receive pool
//! registered with Mooncake's TransferEngine and a ZMQ REP control socket per tensor-parallel
//! rank ("shard"). vLLM's proxy names the consumer (`consumer_zmq`) and one `transfer_id` per
//! item in the request it sends an encoder. For each request iris then:
//!
//! 1. asks the consumer for its shards (`peers`, cached) and reserves room for every item on
//!    every shard (`reserve`, or `reserve_batch` for several items), before encoding: an item
//!    every shard already holds (`cached`), or that another transfer is writing (`write:
//!    false`), is not written (the caller need not even encode it);
//! 2. re-reserves reservations older than half their time to live, as vLLM's producer does;
//! 3. writes each item's rows into each writable shard's reservation with Mooncake's TCP
//!    transport ([`transfer`]);
//! 4. tells each shard what landed (`complete_batch`), and fails unless every item is accepted.
//!
//! On every failure path every reservation taken is cancelled (`cancel` with `abandon`, twice at
//! most per shard, as vLLM's producer tries), so that the consumer's pool never keeps room for a
//! push that will not come. A [`Reserved`] dropped without being settled (a panic, a task
//! aborted) cancels its reservations from a background task.
//!
//! A producer given a [`ConsumerAllowList`] ([`MooncakeProducer::with_allowed_consumers`])
//! connects only to hosts on it: the consumer a request names, the shard addresses it answers
//! with, each reservation's Mooncake session and each handshake's data host are checked before
//! any connection to them; a host off the list fails the push ([`PushFailure::NotAllowed`]) and
//! cancels what was reserved, through the shards' control addresses, which were checked.
//!
//! What is not supported: RDMA (a consumer advertising `rdma` is refused with what to do), the
//! Mooncake store (`cross_encoder_cache`), and the consumer side.

pub mod allow;
#[cfg(any(test, feature = "test-consumer"))]
pub mod consumer;
pub mod control;
pub mod transfer;
pub mod zmtp;

use std::collections::BTreeMap;
use std::fmt;
use std::sync::Arc;
use std::time::{Duration, Instant};

use serde_json::{Value, json};

pub use allow::{AllowListError, ConsumerAllowList};

use crate::config::MooncakeSettings;
use crate::storage::EcDtype;
use control::{ControlClient, ControlError, excerpt};
use transfer::{TransferClient, TransferError};

/// How long a consumer keeps a reservation it was not told about (vLLM's
/// `_RESERVATION_TTL_SECONDS`); a reservation older than half of it is taken again before the
/// write.
pub const RESERVATION_TTL: Duration = Duration::from_secs(300);
/// How many times a cancel is tried (vLLM's `_CANCEL_ATTEMPTS`).
const ATTEMPTS: usize = 2;

/// Why a push failed, as a metric label and in error messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
#[non_exhaustive]
pub enum PushFailure {
    /// The consumer (control or data port) could not be reached.
    Unreachable,
    /// The consumer did not answer within `control_timeout_s`.
    Timeout,
    /// The consumer's receive pool had no room.
    PoolFull,
    /// The consumer gave the transfer up (a cancelled reservation, or a completion it no longer
    /// knows).
    Cancelled,
    /// The destination range was refused (outside the consumer's registered buffers).
    Rejected,
    /// A data connection was cut mid-way.
    Connection,
    /// The consumer speaks RDMA only.
    Rdma,
    /// An answer that does not follow the protocol.
    Protocol,
    /// Any other error the consumer reported.
    Consumer,
    /// An address whose host is not on the producer's [`ConsumerAllowList`]: nothing was
    /// sent to it.
    NotAllowed,
}

impl PushFailure {
    /// Every class, for metrics.
    pub const ALL: [Self; 10] = [
        Self::Unreachable,
        Self::Timeout,
        Self::PoolFull,
        Self::Cancelled,
        Self::Rejected,
        Self::Connection,
        Self::Rdma,
        Self::Protocol,
        Self::Consumer,
        Self::NotAllowed,
    ];

    /// The metric label.
    #[must_use]
    pub fn label(self) -> &'static str {
        match self {
            Self::Unreachable => "unreachable",
            Self::Timeout => "timeout",
            Self::PoolFull => "pool_full",
            Self::Cancelled => "cancelled",
            Self::Rejected => "address_rejected",
            Self::Connection => "connection_lost",
            Self::Rdma => "rdma_only",
            Self::Protocol => "protocol",
            Self::Consumer => "consumer_error",
            Self::NotAllowed => "not_allowed",
        }
    }

    /// The class of a consumer's `error` text (vLLM's consumer reports a full pool as
    /// "EC consumer buffer pool is full").
    #[must_use]
    pub fn classify_consumer_error(error: &str) -> Self {
        if error.contains("pool is full") {
            Self::PoolFull
        } else {
            Self::Consumer
        }
    }
}

impl fmt::Display for PushFailure {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.label())
    }
}

/// A failed push: which consumer, which class of failure, what happened.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("EC push to consumer {consumer} failed ({failure}): {message}")]
pub struct PushError {
    /// The consumer's `consumer_zmq`.
    pub consumer: String,
    /// The class of failure.
    pub failure: PushFailure,
    /// What happened.
    pub message: String,
}

/// One item to push.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PushSpec {
    /// The proxy's id of this transfer.
    pub transfer_id: String,
    /// The item's identifier (vLLM's `mm_hash`).
    pub mm_hash: String,
    /// Rows (`num_embeds`).
    pub rows: u64,
    /// Values per row.
    pub width: u64,
    /// Element type.
    pub dtype: EcDtype,
}

impl PushSpec {
    /// The tensor's bytes.
    #[must_use]
    pub fn nbytes(&self) -> u64 {
        self.rows * self.width * self.dtype.size()
    }

    /// The item as `reserve` carries it.
    fn reserve_item(&self) -> Value {
        json!({
            "transfer_id": self.transfer_id,
            "mm_hash": self.mm_hash,
            "nbytes": self.nbytes(),
            "shape": [self.rows, self.width],
            "dtype": torch_dtype(self.dtype),
        })
    }
}

/// torch's name of a dtype, as the consumer looks it up (`getattr(torch, name)`).
#[must_use]
pub fn torch_dtype(dtype: EcDtype) -> &'static str {
    match dtype {
        EcDtype::F32 => "float32",
        EcDtype::F16 => "float16",
        EcDtype::Bf16 => "bfloat16",
    }
}

/// One shard's reservation of one item.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardReservation {
    /// The shard's control address.
    pub addr: String,
    /// The consumer's id of the reservation.
    pub reservation_id: String,
    /// The Mooncake session (`host:rpc_port`) that owns the destination.
    pub dst_session: String,
    /// The destination address in the consumer.
    pub dst_ptr: u64,
    /// The reserved bytes.
    pub nbytes: u64,
    /// Whether this transfer is the item's writer.
    pub write: bool,
    /// The item is already resident.
    pub ready: bool,
    /// The item is already resident and leased to this transfer.
    pub cached: bool,
    /// The consumer already gave the transfer up.
    pub cancelled: bool,
    /// When the reservation was granted.
    received_at: Instant,
}

impl ShardReservation {
    fn from_result(addr: &str, result: &Value) -> Result<Self, String> {
        let flag =
            |key: &str, default: bool| result.get(key).and_then(Value::as_bool).unwrap_or(default);
        let cancelled = flag("cancelled", false);
        let text = |key: &str| {
            result
                .get(key)
                .and_then(Value::as_str)
                .map(str::to_owned)
                .ok_or_else(|| format!("no `{key}` in {}", excerpt(&result.to_string())))
        };
        let number = |key: &str| {
            result
                .get(key)
                .and_then(Value::as_u64)
                .ok_or_else(|| format!("no numeric `{key}` in {}", excerpt(&result.to_string())))
        };
        Ok(Self {
            addr: addr.to_owned(),
            reservation_id: if cancelled {
                text("reservation_id").unwrap_or_default()
            } else {
                text("reservation_id")?
            },
            dst_session: if cancelled {
                String::new()
            } else {
                text("dst_session")?
            },
            dst_ptr: if cancelled { 0 } else { number("dst_ptr")? },
            nbytes: number("nbytes")?,
            write: flag("write", true),
            ready: flag("ready", false),
            cached: flag("cached", false),
            cancelled,
            received_at: Instant::now(),
        })
    }

    /// A reservation known only by its id, from an answer that did not parse: never written
    /// to, only cancelled.
    fn to_cancel(addr: &str, id: &str) -> Self {
        Self {
            addr: addr.to_owned(),
            reservation_id: id.to_owned(),
            dst_session: String::new(),
            dst_ptr: 0,
            nbytes: 0,
            write: false,
            ready: false,
            cached: false,
            cancelled: false,
            received_at: Instant::now(),
        }
    }

    /// Whether this shard needs the bytes from this transfer.
    #[must_use]
    pub fn writable(&self) -> bool {
        self.write && !self.cached && !self.cancelled
    }
}

/// What a finished push did.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PushReport {
    /// Bytes written over the data wire (all shards).
    pub bytes: u64,
    /// Shard writes.
    pub writes: u64,
    /// Items whose shards all had them already (nothing written).
    pub cached_items: u64,
    /// From the first reservation to the last completion.
    pub elapsed: Duration,
}

/// The producer: the control client and the transfer initiator, shared by all requests.
#[derive(Debug)]
pub struct MooncakeProducer {
    control: Arc<ControlClient>,
    transfer: TransferClient,
    /// The hosts it may connect to; any without a list (as vLLM's producer).
    allowed: Option<Arc<ConsumerAllowList>>,
    /// Age at which a reservation is taken again before the write (half the TTL).
    refresh_after: Duration,
}

impl MooncakeProducer {
    /// A producer with `settings`; `local_name` is how it introduces itself in handshakes.
    #[must_use]
    pub fn new(settings: MooncakeSettings, local_name: String) -> Self {
        Self {
            control: Arc::new(ControlClient::new(settings.control_timeout)),
            transfer: TransferClient::new(settings.control_timeout, local_name),
            allowed: None,
            refresh_after: RESERVATION_TTL / 2,
        }
    }

    /// This producer, connecting only to hosts on `allowed`: every consumer, shard control
    /// address, Mooncake session and data host is checked before a connection to it, and one
    /// off the list fails the push with [`PushFailure::NotAllowed`].
    #[must_use]
    pub fn with_allowed_consumers(mut self, allowed: ConsumerAllowList) -> Self {
        let allowed = Arc::new(allowed);
        self.transfer = self.transfer.with_allowed(Arc::clone(&allowed));
        self.allowed = Some(allowed);
        self
    }

    /// The hosts this producer may connect to; `None`: any.
    #[must_use]
    pub fn allowed_consumers(&self) -> Option<&ConsumerAllowList> {
        self.allowed.as_deref()
    }

    /// Whether this producer may connect to `address` (`tcp://host:port` or `host:port`):
    /// always without a list.
    #[must_use]
    pub fn allows(&self, address: &str) -> bool {
        self.allowed
            .as_ref()
            .is_none_or(|allowed| allowed.allows_address(address))
    }

    /// The limit of one exchange.
    #[must_use]
    pub fn control_timeout(&self) -> Duration {
        self.control.timeout()
    }

    /// Reserves room for every item on every shard of `consumer`.
    ///
    /// # Errors
    /// [`PushError`] when any shard refuses or fails for any item; every reservation taken is
    /// cancelled first.
    pub async fn reserve(
        &self,
        consumer: &str,
        specs: Vec<PushSpec>,
    ) -> Result<Reserved, PushError> {
        // In a task of its own: a caller that goes away mid-way (its client hung up) drops the
        // task's handle, not the task, so the reservations shards grant meanwhile land in a
        // `Reserved` that, dropped unsettled, cancels them. Awaited in place, they would be
        // lost inside the fan-out and held until the consumer's TTL.
        let task = tokio::spawn(reserve_all(
            Arc::clone(&self.control),
            self.allowed.clone(),
            consumer.to_owned(),
            specs,
        ));
        task.await.map_err(|err| PushError {
            consumer: consumer.to_owned(),
            failure: PushFailure::Protocol,
            message: format!("the reservation task failed: {err}"),
        })?
    }

    /// Writes each item's `payloads[i]` (its rows, [`PushSpec::nbytes`] long) into every shard
    /// that needs it, and completes the reservations. `payloads[i]` may be `None` for an item no
    /// shard needs ([`Reserved::needs_write`]).
    ///
    /// # Errors
    /// [`PushError`]; every reservation is cancelled first.
    pub async fn push(
        &self,
        mut reserved: Reserved,
        payloads: &[Option<Arc<Vec<u8>>>],
    ) -> Result<PushReport, PushError> {
        match self.try_push(&mut reserved, payloads).await {
            Ok(report) => {
                reserved.settled = true;
                Ok(report)
            }
            Err(err) => {
                reserved.abandon().await;
                Err(err)
            }
        }
    }

    async fn try_push(
        &self,
        reserved: &mut Reserved,
        payloads: &[Option<Arc<Vec<u8>>>],
    ) -> Result<PushReport, PushError> {
        let consumer = reserved.consumer.clone();
        let error = |failure: PushFailure, message: String| PushError {
            consumer: consumer.clone(),
            failure,
            message,
        };
        if payloads.len() != reserved.specs.len() {
            return Err(error(
                PushFailure::Protocol,
                format!(
                    "{} payloads for {} items",
                    payloads.len(),
                    reserved.specs.len()
                ),
            ));
        }
        self.refresh_stale(reserved).await?;
        let mut report = PushReport::default();
        // Writes grouped by destination session, in item order.
        let mut by_session: BTreeMap<&str, Vec<(usize, &ShardReservation)>> = BTreeMap::new();
        for (index, (spec, shards)) in reserved.specs.iter().zip(&reserved.shards).enumerate() {
            if let Some(shard) = shards.iter().find(|s| s.cancelled) {
                return Err(error(
                    PushFailure::Cancelled,
                    format!(
                        "shard {} gave up transfer {} (mm_hash {}) before it was written",
                        shard.addr, spec.transfer_id, spec.mm_hash
                    ),
                ));
            }
            let writable: Vec<&ShardReservation> = shards.iter().filter(|s| s.writable()).collect();
            if writable.is_empty() {
                report.cached_items += 1;
                continue;
            }
            let Some(payload) = &payloads[index] else {
                return Err(error(
                    PushFailure::Protocol,
                    format!(
                        "no rows for item {index}, which shard {} needs",
                        writable[0].addr
                    ),
                ));
            };
            for shard in writable {
                if shard.nbytes != spec.nbytes() || payload.len() as u64 != spec.nbytes() {
                    return Err(error(
                        PushFailure::Protocol,
                        format!(
                            "shard {} reserved {} bytes for mm_hash {}, whose rows are {} bytes",
                            shard.addr,
                            shard.nbytes,
                            spec.mm_hash,
                            payload.len()
                        ),
                    ));
                }
                by_session
                    .entry(shard.dst_session.as_str())
                    .or_default()
                    .push((index, shard));
            }
        }
        // Before any write: a session off the list fails the push with nothing written anywhere.
        for session in by_session.keys() {
            self.transfer
                .check_session(session)
                .map_err(|e| error(e.failure, e.message))?;
        }
        // A consumer keys reservations by transfer id, and nothing stops two items' ranges from
        // meeting: rows written over another item's would be kept under its hash for good.
        for (session, items) in &by_session {
            let mut ranges: Vec<(u64, u64, usize)> = items
                .iter()
                .map(|(index, shard)| {
                    (
                        shard.dst_ptr,
                        shard.dst_ptr.saturating_add(shard.nbytes),
                        *index,
                    )
                })
                .collect();
            ranges.sort_unstable();
            for pair in ranges.windows(2) {
                let ((_, end, a), (start, _, b)) = (pair[0], pair[1]);
                let (first, second) = (&reserved.specs[a], &reserved.specs[b]);
                if start < end && first.mm_hash != second.mm_hash {
                    return Err(error(
                        PushFailure::Protocol,
                        format!(
                            "session {session} reserved overlapping ranges for mm_hash {} (transfer {}) and mm_hash {} (transfer {}); nothing was written",
                            first.mm_hash, first.transfer_id, second.mm_hash, second.transfer_id
                        ),
                    ));
                }
            }
        }
        let writes = by_session.iter().map(|(session, items)| async move {
            for (index, shard) in items {
                let payload = payloads[*index].as_deref().map_or(&[][..], Vec::as_slice);
                self.transfer.write(session, shard.dst_ptr, payload).await?;
            }
            Ok::<u64, TransferError>(items.len() as u64)
        });
        for result in futures::future::join_all(writes).await {
            let count = result.map_err(|e| error(e.failure, e.message))?;
            report.writes += count;
        }
        report.bytes = by_session
            .values()
            .flatten()
            .map(|(index, _)| reserved.specs[*index].nbytes())
            .sum();
        // One completion message per shard, for what was written there.
        let mut by_shard: BTreeMap<&str, Vec<(usize, &ShardReservation)>> = BTreeMap::new();
        for items in by_session.values() {
            for (index, shard) in items {
                by_shard
                    .entry(shard.addr.as_str())
                    .or_default()
                    .push((*index, shard));
            }
        }
        let completions = by_shard.iter().map(|(addr, items)| {
            let control = &self.control;
            let specs = &reserved.specs;
            async move {
                let message = json!({
                    "op": "complete_batch",
                    "items": items.iter().map(|(index, shard)| json!({
                        "transfer_id": specs[*index].transfer_id,
                        "reservation_id": shard.reservation_id,
                    })).collect::<Vec<_>>(),
                });
                let result = control.request(addr, &message).await.map_err(|e| (e.failure, e.message))?;
                let answers = result.get("items").and_then(Value::as_array);
                let Some(answers) = answers.filter(|a| a.len() == items.len()) else {
                    return Err((
                        PushFailure::Protocol,
                        format!(
                            "{addr} answered complete_batch with {}",
                            excerpt(&result.to_string())
                        ),
                    ));
                };
                for ((index, _), answer) in items.iter().zip(answers) {
                    if answer.get("completed").and_then(Value::as_bool) != Some(true) {
                        return Err((
                            PushFailure::Cancelled,
                            format!(
                                "{addr} no longer knows the reservation of transfer {} (mm_hash {}): the consumer gave it up",
                                specs[*index].transfer_id, specs[*index].mm_hash
                            ),
                        ));
                    }
                }
                Ok(())
            }
        });
        for result in futures::future::join_all(completions).await {
            result.map_err(|(failure, message)| error(failure, message))?;
        }
        report.elapsed = reserved.started.elapsed();
        Ok(report)
    }

    /// Takes again, before the write, the reservations older than half their time to live.
    async fn refresh_stale(&self, reserved: &mut Reserved) -> Result<(), PushError> {
        let now = Instant::now();
        for index in 0..reserved.specs.len() {
            let stale = reserved.shards[index].iter().any(|s| {
                !s.ready && !s.cancelled && now.duration_since(s.received_at) >= self.refresh_after
            });
            if !stale {
                continue;
            }
            let spec = reserved.specs[index].clone();
            let old: Vec<ShardReservation> = reserved.shards[index]
                .iter()
                .filter(|s| !s.ready && !s.cached && !s.cancelled)
                .cloned()
                .collect();
            let control = Arc::clone(&reserved.control);
            cancel_all(&control, &spec, &old, true)
                .await
                .map_err(|err| PushError {
                    consumer: reserved.consumer.clone(),
                    failure: err.failure,
                    message: err.message,
                })?;
            // The cancelled ones are gone: only what is kept stays known for the abandon path.
            reserved.shards[index].retain(|s| s.ready || s.cached || s.cancelled);
            let mut again = self.reserve(&reserved.consumer, vec![spec]).await?;
            // The new reservations move into `reserved`, which settles them.
            again.settled = true;
            reserved.shards[index] = std::mem::take(&mut again.shards[0]);
        }
        Ok(())
    }
}

/// [`MooncakeProducer::reserve`]'s work: every item on every shard of `consumer`.
async fn reserve_all(
    control: Arc<ControlClient>,
    allowed: Option<Arc<ConsumerAllowList>>,
    consumer: String,
    specs: Vec<PushSpec>,
) -> Result<Reserved, PushError> {
    let started = Instant::now();
    let fail = |err: ControlError| PushError {
        consumer: consumer.clone(),
        failure: err.failure,
        message: err.message,
    };
    let refuse = |what: String| PushError {
        consumer: consumer.clone(),
        failure: PushFailure::NotAllowed,
        message: format!("{what} is not among the allowed consumers; nothing was sent to it"),
    };
    let allows = |address: &str| {
        allowed
            .as_ref()
            .is_none_or(|allowed| allowed.allows_address(address))
    };
    if !allows(&consumer) {
        return Err(refuse(format!("the consumer {consumer}")));
    }
    let addrs = match control.shards(&consumer).await {
        Ok(addrs) => addrs,
        // vLLM's producer asks a consumer for its shards twice before it fails a push.
        Err(_) => control.shards(&consumer).await.map_err(fail)?,
    };
    // Shards are on the consumer's host today (`peers` names ports), but what a consumer
    // answers is checked as such: nothing is reserved yet, so nothing is left to cancel.
    if let Some(shard) = addrs.iter().find(|addr| !allows(addr)) {
        return Err(refuse(format!("the shard {shard} (from `peers`)")));
    }
    let answers =
        futures::future::join_all(addrs.iter().map(|addr| reserve_on(&control, addr, &specs)))
            .await;
    let mut reserved = Reserved {
        consumer: consumer.clone(),
        shards: vec![Vec::new(); specs.len()],
        specs,
        control: Arc::clone(&control),
        settled: false,
        started,
    };
    let mut first_error: Option<ControlError> = None;
    for answer in answers {
        match answer {
            Err(err) => {
                first_error.get_or_insert(err);
            }
            Ok(items) => {
                for (index, item) in items.into_iter().enumerate() {
                    match item {
                        Ok(shard) => reserved.shards[index].push(shard),
                        Err((err, to_cancel)) => {
                            // Kept for the abandon below, which cancels it.
                            reserved.shards[index].extend(to_cancel.map(|shard| *shard));
                            first_error.get_or_insert(err);
                        }
                    }
                }
            }
        }
    }
    if let Some(err) = first_error {
        if matches!(err.failure, PushFailure::Unreachable | PushFailure::Timeout) {
            // A consumer that went away may come back with another topology.
            control.forget(&consumer);
        }
        reserved.abandon().await;
        return Err(fail(err));
    }
    Ok(reserved)
}

/// Reservations taken for one request's items. Settle them with [`MooncakeProducer::push`] or
/// [`Reserved::abandon`]; dropped unsettled, they are cancelled in the background.
pub struct Reserved {
    consumer: String,
    specs: Vec<PushSpec>,
    /// Per item, per shard.
    shards: Vec<Vec<ShardReservation>>,
    control: Arc<ControlClient>,
    settled: bool,
    started: Instant,
}

impl fmt::Debug for Reserved {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Reserved")
            .field("consumer", &self.consumer)
            .field("specs", &self.specs)
            .field("shards", &self.shards)
            .field("settled", &self.settled)
            .finish_non_exhaustive()
    }
}

impl Reserved {
    /// Whether some shard needs item `index`'s bytes from this transfer (otherwise the item need
    /// not be encoded).
    #[must_use]
    pub fn needs_write(&self, index: usize) -> bool {
        self.shards
            .get(index)
            .is_some_and(|shards| shards.iter().any(ShardReservation::writable))
    }

    /// The items' reservations, per item and shard.
    #[must_use]
    pub fn shards(&self) -> &[Vec<ShardReservation>] {
        &self.shards
    }

    /// The consumer.
    #[must_use]
    pub fn consumer(&self) -> &str {
        &self.consumer
    }

    /// Cancels every reservation (`abandon`), each tried twice at most; failures are logged.
    ///
    /// The cancels run in a task of their own, so a caller that goes away mid-way (its client
    /// hung up) does not stop them half done.
    pub async fn abandon(mut self) {
        let cancels = self.cancel_on(&tokio::runtime::Handle::current());
        if let Err(err) = cancels.await {
            tracing::warn!(error = %err, "the EC reservation cancels failed");
        }
    }

    /// Settles the reservations by moving them into a task on `runtime` that cancels them all.
    fn cancel_on(&mut self, runtime: &tokio::runtime::Handle) -> tokio::task::JoinHandle<()> {
        self.settled = true;
        let control = Arc::clone(&self.control);
        let consumer = std::mem::take(&mut self.consumer);
        let specs = std::mem::take(&mut self.specs);
        let shards = std::mem::take(&mut self.shards);
        runtime.spawn(async move { abandon_all(&control, &consumer, &specs, &shards).await })
    }
}

impl Drop for Reserved {
    fn drop(&mut self) {
        if self.settled {
            return;
        }
        let Ok(handle) = tokio::runtime::Handle::try_current() else {
            tracing::warn!(
                consumer = %self.consumer,
                "EC reservations dropped outside a runtime; the consumer reclaims them after {} s",
                RESERVATION_TTL.as_secs()
            );
            return;
        };
        drop(self.cancel_on(&handle));
    }
}

async fn abandon_all(
    control: &ControlClient,
    consumer: &str,
    specs: &[PushSpec],
    shards: &[Vec<ShardReservation>],
) {
    let cancels = specs
        .iter()
        .zip(shards)
        .map(|(spec, shards)| cancel_all(control, spec, shards, false));
    for result in futures::future::join_all(cancels).await {
        if let Err(err) = result {
            tracing::warn!(
                consumer,
                error = %err,
                "could not cancel an EC reservation; the consumer reclaims it after {} s",
                RESERVATION_TTL.as_secs()
            );
        }
    }
}

/// Cancels `shards`' reservations of `spec` (those not already cancelled), each tried
/// [`ATTEMPTS`] times.
async fn cancel_all(
    control: &ControlClient,
    spec: &PushSpec,
    shards: &[ShardReservation],
    refresh: bool,
) -> Result<(), ControlError> {
    let cancels = shards
        .iter()
        .filter(|s| !s.cancelled)
        .map(|shard| async move {
            let mut message = json!({
                "op": "cancel",
                "transfer_id": spec.transfer_id,
                "reservation_id": shard.reservation_id,
                "abandon": true,
            });
            if refresh {
                message["refresh"] = Value::Bool(true);
            }
            let mut last = None;
            for _ in 0..ATTEMPTS {
                match control.request(&shard.addr, &message).await {
                    Ok(result)
                        if result.get("cancelled").and_then(Value::as_bool) == Some(true) =>
                    {
                        return Ok(());
                    }
                    Ok(result) => {
                        last = Some(ControlError {
                            failure: PushFailure::Consumer,
                            message: format!(
                                "{} did not cancel transfer {} (mm_hash {}): {}",
                                shard.addr,
                                spec.transfer_id,
                                spec.mm_hash,
                                excerpt(&result.to_string())
                            ),
                        });
                    }
                    Err(err) => last = Some(err),
                }
            }
            Err(last.unwrap_or_else(|| ControlError {
                failure: PushFailure::Consumer,
                message: "cancel not sent".to_owned(),
            }))
        });
    let mut first = Ok(());
    for result in futures::future::join_all(cancels).await {
        if first.is_ok() {
            first = result;
        }
    }
    first
}

/// Reserves `specs` on one shard: per item, its reservation or the shard's error.
/// One item's answer from one shard: its reservation, or why there is none (with the id the
/// shard named, when a malformed answer still named one, so that it can be cancelled).
type ItemAnswer = Result<ShardReservation, (ControlError, Option<Box<ShardReservation>>)>;

/// A reservation answer that does not parse: the error, and the reservation to cancel when
/// the answer names its id (the shard may hold room under it).
fn malformed(
    addr: &str,
    op: &str,
    result: &Value,
    why: String,
) -> (ControlError, Option<Box<ShardReservation>>) {
    let error = ControlError {
        failure: PushFailure::Protocol,
        message: format!("{addr} answered {op} with {why}"),
    };
    let id = result.get("reservation_id").and_then(Value::as_str);
    (
        error,
        id.map(|id| Box::new(ShardReservation::to_cancel(addr, id))),
    )
}

async fn reserve_on(
    control: &ControlClient,
    addr: &str,
    specs: &[PushSpec],
) -> Result<Vec<ItemAnswer>, ControlError> {
    let protocol = |message: String| ControlError {
        failure: PushFailure::Protocol,
        message,
    };
    if let [spec] = specs {
        let mut message = spec.reserve_item();
        message["op"] = json!("reserve");
        let result = control.request(addr, &message).await?;
        let shard = ShardReservation::from_result(addr, &result)
            .map_err(|why| malformed(addr, "reserve", &result, why));
        return Ok(vec![shard]);
    }
    let message = json!({
        "op": "reserve_batch",
        "items": specs.iter().map(PushSpec::reserve_item).collect::<Vec<_>>(),
    });
    let result = control.request(addr, &message).await?;
    let items = result
        .get("items")
        .and_then(Value::as_array)
        .ok_or_else(|| {
            protocol(format!(
                "{addr} answered reserve_batch with {}",
                excerpt(&result.to_string())
            ))
        })?;
    if items.len() != specs.len() {
        // The answer cannot be trusted, but the shard may hold room under the ids it names:
        // each is cancelled under the transfer id at its position (an item past the request's
        // count names no transfer, and the consumer reclaims it after its TTL).
        let message = format!(
            "{addr} answered reserve_batch of {} items with {} items",
            specs.len(),
            items.len()
        );
        return Ok((0..specs.len())
            .map(|index| {
                let id = items
                    .get(index)
                    .and_then(|item| item.get("result"))
                    .and_then(|result| result.get("reservation_id"))
                    .and_then(Value::as_str);
                Err((
                    protocol(message.clone()),
                    id.map(|id| Box::new(ShardReservation::to_cancel(addr, id))),
                ))
            })
            .collect());
    }
    Ok(items
        .iter()
        .zip(specs)
        .map(|(item, spec)| {
            if item.get("ok").and_then(Value::as_bool) == Some(true) {
                let result = item.get("result").cloned().unwrap_or(Value::Null);
                ShardReservation::from_result(addr, &result)
                    .map_err(|why| malformed(addr, "reserve_batch", &result, why))
            } else {
                let error = item
                    .get("error")
                    .and_then(Value::as_str)
                    .unwrap_or("reservation failed");
                Err((
                    ControlError {
                        failure: PushFailure::classify_consumer_error(error),
                        message: format!(
                            "{addr} refused to reserve {} bytes for mm_hash {}: {}",
                            spec.nbytes(),
                            spec.mm_hash,
                            excerpt(error)
                        ),
                    },
                    None,
                ))
            }
        })
        .collect())
}

#[cfg(test)]
mod tests;
