//! An in-process Mooncake consumer for tests and benchmarks: what a vLLM consumer with
//! `ECMooncakeConnector` shows a producer, and no more.
//!
//! Each shard has a ZMQ REP control socket answering `peers`, `reserve`, `reserve_batch`,
//! `complete_batch` and `cancel` as vLLM 0.33's `ConsumerControlServer` does, a handshake port
//! answering Mooncake's metadata frame with a segment descriptor, and a data port applying
//! Mooncake TCP writes to a receive slab (a host buffer standing at a made-up address, so no
//! pointer is ever dereferenced). Allocations are 256-byte aligned, as vLLM's pool aligns them.
//!
//! [`Faults`] make a shard misbehave the ways a real one can: never answer, run out of room,
//! give a transfer up, reject a range, cut a write, forget a reservation, advertise RDMA, send
//! the producer to another host name. Every control exchange, handshake and write is logged or
//! counted, so tests can check what a producer sent and that nothing is left reserved.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, PoisonError};

use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;
use zeromq::{RepSocket, Socket as _, SocketRecv as _, SocketSend as _, ZmqMessage};

use super::transfer::{HANDSHAKE_METADATA, OPCODE_STATUS_FLAG, OPCODE_WRITE, STATUS_OK};

/// Allocation alignment of the receive pool (vLLM's).
const ALIGN: u64 = 256;

/// Ways a shard misbehaves; all off by default.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Faults {
    /// Read control requests and never answer.
    pub never_answer: bool,
    /// Answer every reservation with "EC consumer buffer pool is full".
    pub pool_full: bool,
    /// Answer reservations as already cancelled by the consumer.
    pub cancel_on_reserve: bool,
    /// Answer every write with the "address rejected" status.
    pub reject_writes: bool,
    /// Close the data connection after half of a write's payload.
    pub cut_mid_write: bool,
    /// Answer completions with `completed: false`.
    pub forget_on_complete: bool,
    /// Advertise `protocol: "rdma"` in the handshake.
    pub advertise_rdma: bool,
    /// Shard `.0` (by index) waits `.1` before it takes a reservation request (the others
    /// answer at once): a consumer one of whose shards is slow.
    pub slow_reserve: Option<(usize, std::time::Duration)>,
    /// Reserve (and keep the room), but answer without `dst_ptr`: a reply that names its
    /// reservation and does not parse.
    pub malformed_reserve: bool,
    /// Reserve every item of a `reserve_batch` (and keep the room), but leave the last item's
    /// answer out: an answer with the wrong number of items.
    pub short_batch_answer: bool,
    /// Name this host instead of `127.0.0.1` in reservations' `dst_session` (the handshake
    /// port is still the shard's): a consumer that sends its producer to another host.
    pub session_host: Option<String>,
    /// Advertise this `tcp_data_host` in the handshake instead of `127.0.0.1`.
    pub data_host: Option<String>,
}

/// One logged control exchange.
#[derive(Debug, Clone, PartialEq)]
pub struct Exchange {
    /// The shard's control port.
    pub shard: u16,
    /// The request.
    pub request: Value,
    /// The reply (`None` when the shard did not answer).
    pub reply: Option<Value>,
}

/// One applied write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Write {
    /// The shard's control port.
    pub shard: u16,
    /// Offset in the slab.
    pub offset: u64,
    /// The header's opcode byte.
    pub opcode: u8,
    /// The bytes written.
    pub bytes: Vec<u8>,
}

#[derive(Debug, Clone)]
struct Reservation {
    id: String,
    mm_hash: String,
    offset: u64,
    nbytes: u64,
    shape: Vec<u64>,
    dtype: String,
    writer: bool,
}

#[derive(Debug, Default)]
struct ShardState {
    /// Live reservations by transfer id.
    live: HashMap<String, Reservation>,
    /// Resident items by mm_hash: offset, bytes, shape, dtype.
    resident: HashMap<String, (u64, u64, Vec<u64>, String)>,
    /// Allocated ranges (offset, length), sorted.
    allocated: Vec<(u64, u64)>,
    next_id: u64,
}

struct Shard {
    /// The shard's place in the consumer's list.
    index: usize,
    control_port: u16,
    rpc_port: u16,
    /// The data port; it changes when the data side restarts.
    data_port: std::sync::atomic::AtomicU16,
    base: u64,
    slab: Mutex<Vec<u8>>,
    state: Mutex<ShardState>,
}

struct Shared {
    faults: Mutex<Faults>,
    exchanges: Mutex<Vec<Exchange>>,
    writes: Mutex<Vec<Write>>,
    ports: Vec<u16>,
    proto_version: u32,
    /// Handshake connections accepted, over all shards.
    handshakes: std::sync::atomic::AtomicUsize,
}

/// A running consumer; stopped when dropped.
pub struct TestConsumer {
    shards: Vec<Arc<Shard>>,
    shared: Arc<Shared>,
    tasks: Vec<JoinHandle<()>>,
    /// The data servers, one per shard (replaced by [`TestConsumer::restart_data`]).
    data_tasks: Vec<JoinHandle<()>>,
}

impl std::fmt::Debug for TestConsumer {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("TestConsumer")
            .field("ports", &self.shared.ports)
            .finish_non_exhaustive()
    }
}

impl Drop for TestConsumer {
    fn drop(&mut self) {
        for task in self.tasks.iter().chain(&self.data_tasks) {
            task.abort();
        }
    }
}

impl TestConsumer {
    /// Starts a consumer of `shards` shards on loopback, each with a slab of `pool_bytes`,
    /// speaking Mooncake TCP protocol version `proto_version` (1 or 2).
    ///
    /// # Errors
    /// A port that cannot be bound.
    pub async fn start(
        shards: usize,
        pool_bytes: u64,
        proto_version: u32,
    ) -> std::io::Result<Self> {
        let mut sockets = Vec::new();
        let mut ports = Vec::new();
        for _ in 0..shards {
            let mut socket = RepSocket::new();
            let endpoint = socket
                .bind("tcp://127.0.0.1:0")
                .await
                .map_err(std::io::Error::other)?;
            let port = match endpoint {
                zeromq::Endpoint::Tcp(_, port) => port,
                other => return Err(std::io::Error::other(format!("bound {other}"))),
            };
            ports.push(port);
            sockets.push(socket);
        }
        let shared = Arc::new(Shared {
            faults: Mutex::new(Faults::default()),
            exchanges: Mutex::new(Vec::new()),
            writes: Mutex::new(Vec::new()),
            ports: ports.clone(),
            proto_version,
            handshakes: std::sync::atomic::AtomicUsize::new(0),
        });
        let mut list = Vec::new();
        let mut tasks = Vec::new();
        let mut data_tasks = Vec::new();
        for (index, socket) in sockets.into_iter().enumerate() {
            let rpc = TcpListener::bind("127.0.0.1:0").await?;
            let data = TcpListener::bind("127.0.0.1:0").await?;
            let shard = Arc::new(Shard {
                index,
                control_port: ports[index],
                rpc_port: rpc.local_addr()?.port(),
                data_port: std::sync::atomic::AtomicU16::new(data.local_addr()?.port()),
                base: 0x7f00_0000_0000 + ((index as u64) << 32),
                slab: Mutex::new(vec![0; usize::try_from(pool_bytes).unwrap_or(0)]),
                state: Mutex::new(ShardState::default()),
            });
            tasks.push(tokio::spawn(serve_control(
                socket,
                Arc::clone(&shard),
                Arc::clone(&shared),
            )));
            tasks.push(tokio::spawn(serve_handshake(
                rpc,
                Arc::clone(&shard),
                Arc::clone(&shared),
            )));
            data_tasks.push(tokio::spawn(serve_data(
                data,
                Arc::clone(&shard),
                Arc::clone(&shared),
            )));
            list.push(shard);
        }
        Ok(Self {
            shards: list,
            shared,
            tasks,
            data_tasks,
        })
    }

    /// Restarts every shard's data side on a new port, closing its connections, as a restarted
    /// Mooncake engine comes back: a producer's cached descriptor then names a dead port.
    ///
    /// # Errors
    /// A port that cannot be bound.
    pub async fn restart_data(&mut self) -> std::io::Result<()> {
        for (index, shard) in self.shards.iter().enumerate() {
            self.data_tasks[index].abort();
            let data = TcpListener::bind("127.0.0.1:0").await?;
            shard.data_port.store(
                data.local_addr()?.port(),
                std::sync::atomic::Ordering::Relaxed,
            );
            self.data_tasks[index] = tokio::spawn(serve_data(
                data,
                Arc::clone(shard),
                Arc::clone(&self.shared),
            ));
        }
        Ok(())
    }

    /// The address a proxy names as `consumer_zmq`: the first shard's control socket.
    #[must_use]
    pub fn consumer_zmq(&self) -> String {
        format!("tcp://127.0.0.1:{}", self.shared.ports[0])
    }

    /// Makes every shard misbehave as `faults` says from now on.
    pub fn set_faults(&self, faults: Faults) {
        *lock(&self.shared.faults) = faults;
    }

    /// Reservations neither completed nor cancelled, over all shards.
    #[must_use]
    pub fn live_reservations(&self) -> usize {
        self.shards.iter().map(|s| lock(&s.state).live.len()).sum()
    }

    /// Bytes allocated in the slabs, over all shards (live reservations and resident items).
    #[must_use]
    pub fn allocated_bytes(&self) -> u64 {
        self.shards
            .iter()
            .map(|s| {
                lock(&s.state)
                    .allocated
                    .iter()
                    .map(|(_, len)| len)
                    .sum::<u64>()
            })
            .sum()
    }

    /// The resident tensor of `mm_hash` on shard `shard`: its bytes, shape and dtype.
    #[must_use]
    pub fn resident(&self, shard: usize, mm_hash: &str) -> Option<(Vec<u8>, Vec<u64>, String)> {
        let shard = self.shards.get(shard)?;
        let (offset, len, shape, dtype) = lock(&shard.state).resident.get(mm_hash)?.clone();
        let slab = lock(&shard.slab);
        let start = usize::try_from(offset).ok()?;
        let end = start + usize::try_from(len).ok()?;
        Some((slab[start..end].to_vec(), shape, dtype))
    }

    /// Drops every resident item and gives its room back, as a consumer does once its requests
    /// have loaded and freed them (for benchmarks that push many items).
    pub fn release_resident(&self) {
        for shard in &self.shards {
            let mut state = lock(&shard.state);
            let resident: Vec<u64> = state
                .resident
                .values()
                .map(|(offset, ..)| *offset)
                .collect();
            state.resident.clear();
            state
                .allocated
                .retain(|(offset, _)| !resident.contains(offset));
        }
        lock(&self.shared.writes).clear();
        lock(&self.shared.exchanges).clear();
    }

    /// Every control exchange so far, in order.
    #[must_use]
    pub fn exchanges(&self) -> Vec<Exchange> {
        lock(&self.shared.exchanges).clone()
    }

    /// Handshake connections accepted so far, over all shards.
    #[must_use]
    pub fn handshakes(&self) -> usize {
        self.shared
            .handshakes
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// Every applied write so far, in order.
    #[must_use]
    pub fn writes(&self) -> Vec<Write> {
        lock(&self.shared.writes).clone()
    }
}

fn lock<T>(mutex: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    mutex.lock().unwrap_or_else(PoisonError::into_inner)
}

async fn serve_control(mut socket: RepSocket, shard: Arc<Shard>, shared: Arc<Shared>) {
    loop {
        let Ok(message) = socket.recv().await else {
            return;
        };
        let frame = message.get(0).map(|b| b.to_vec()).unwrap_or_default();
        let request: Value = serde_json::from_slice(&frame).unwrap_or(Value::Null);
        let faults = lock(&shared.faults).clone();
        if faults.never_answer {
            lock(&shared.exchanges).push(Exchange {
                shard: shard.control_port,
                request: request.clone(),
                reply: None,
            });
            // REP owes an answer it never gives: the socket stays silent from now on.
            std::future::pending::<()>().await;
        }
        if let Some((slow, delay)) = faults.slow_reserve
            && slow == shard.index
            && request["op"]
                .as_str()
                .is_some_and(|op| op.starts_with("reserve"))
        {
            tokio::time::sleep(delay).await;
        }
        let reply = match handle(&request, &shard, &shared, &faults) {
            Ok(result) => json!({"ok": true, "result": result}),
            Err(error) => json!({"ok": false, "error": error}),
        };
        lock(&shared.exchanges).push(Exchange {
            shard: shard.control_port,
            request,
            reply: Some(reply.clone()),
        });
        if socket
            .send(ZmqMessage::from(reply.to_string()))
            .await
            .is_err()
        {
            return;
        }
    }
}

fn handle(
    request: &Value,
    shard: &Shard,
    shared: &Shared,
    faults: &Faults,
) -> Result<Value, String> {
    let field = |item: &Value, key: &str| {
        item.get(key)
            .and_then(Value::as_str)
            .map(str::to_owned)
            .ok_or(format!("missing {key}"))
    };
    match request.get("op").and_then(Value::as_str) {
        Some("peers") => Ok(json!({"ports": shared.ports})),
        Some("reserve") => reserve(request, shard, faults),
        Some("reserve_batch") => {
            let items = request
                .get("items")
                .and_then(Value::as_array)
                .ok_or("missing items")?;
            let mut results: Vec<Value> = items
                .iter()
                .map(|item| match reserve(item, shard, faults) {
                    Ok(result) => json!({"ok": true, "result": result}),
                    Err(error) => json!({"ok": false, "error": error}),
                })
                .collect();
            if faults.short_batch_answer {
                results.pop();
            }
            Ok(json!({"items": results}))
        }
        Some("complete_batch") => {
            let items = request
                .get("items")
                .and_then(Value::as_array)
                .ok_or("missing items")?;
            let mut answers = Vec::new();
            for item in items {
                let transfer_id = field(item, "transfer_id")?;
                let reservation_id = field(item, "reservation_id")?;
                let mut state = lock(&shard.state);
                let known = state
                    .live
                    .get(&transfer_id)
                    .is_some_and(|r| r.id == reservation_id && r.writer);
                if faults.forget_on_complete || !known {
                    answers.push(json!({"completed": false, "became_ready": false}));
                    continue;
                }
                let reservation = state
                    .live
                    .remove(&transfer_id)
                    .unwrap_or_else(|| unreachable!());
                // Other transfers of this item waiting on this writer become ready with it.
                state.live.retain(|_, r| r.mm_hash != reservation.mm_hash);
                state.resident.insert(
                    reservation.mm_hash.clone(),
                    (
                        reservation.offset,
                        reservation.nbytes,
                        reservation.shape.clone(),
                        reservation.dtype.clone(),
                    ),
                );
                answers.push(json!({"completed": true, "became_ready": true}));
            }
            Ok(json!({"items": answers}))
        }
        Some("cancel") => {
            let transfer_id = field(request, "transfer_id")?;
            let mut state = lock(&shard.state);
            // A resident item's lease, or a transfer already gone, holds nothing to give back.
            if let Some(reservation) = state.live.remove(&transfer_id)
                && reservation.writer
            {
                state
                    .allocated
                    .retain(|(offset, _)| *offset != reservation.offset);
            }
            Ok(json!({"cancelled": true}))
        }
        Some(other) => Err(format!("unknown control op: {other:?}")),
        None => Err("malformed control request".to_owned()),
    }
}

fn reserve(item: &Value, shard: &Shard, faults: &Faults) -> Result<Value, String> {
    let transfer_id = item
        .get("transfer_id")
        .and_then(Value::as_str)
        .ok_or("missing transfer_id")?
        .to_owned();
    let mm_hash = item
        .get("mm_hash")
        .and_then(Value::as_str)
        .ok_or("missing mm_hash")?
        .to_owned();
    let nbytes = item
        .get("nbytes")
        .and_then(Value::as_u64)
        .ok_or("missing nbytes")?;
    let shape: Vec<u64> = item
        .get("shape")
        .and_then(Value::as_array)
        .ok_or("missing shape")?
        .iter()
        .map(|v| v.as_u64().ok_or("shape must be integers"))
        .collect::<Result<_, _>>()?;
    let dtype = item
        .get("dtype")
        .and_then(Value::as_str)
        .ok_or("missing dtype")?;
    let size = match dtype {
        "bfloat16" | "float16" => 2,
        "float32" => 4,
        other => return Err(format!("Unsupported torch dtype string: {other:?}")),
    };
    if shape.iter().product::<u64>() * size != nbytes {
        return Err("shape and dtype do not match nbytes".to_owned());
    }
    if faults.cancel_on_reserve {
        return Ok(json!({
            "reservation_id": "", "dst_session": "", "dst_ptr": 0, "nbytes": nbytes,
            "write": false, "ready": false, "cancelled": true,
        }));
    }
    let host = faults.session_host.as_deref().unwrap_or("127.0.0.1");
    let session = format!("{host}:{}", shard.rpc_port);
    let mut state = lock(&shard.state);
    state.next_id += 1;
    let id = format!("r{}-{}", shard.control_port, state.next_id);
    if let Some((offset, len, _, _)) = state.resident.get(&mm_hash) {
        return Ok(json!({
            "reservation_id": id, "dst_session": session, "dst_ptr": shard.base + offset,
            "nbytes": len, "write": false, "ready": true, "cached": true,
        }));
    }
    if let Some(existing) = state.live.get(&transfer_id) {
        return Ok(json!({
            "reservation_id": existing.id, "dst_session": session,
            "dst_ptr": shard.base + existing.offset, "nbytes": existing.nbytes,
            "write": existing.writer, "ready": false, "cached": false,
        }));
    }
    let writer_of_item = state
        .live
        .values()
        .find(|r| r.mm_hash == mm_hash && r.writer)
        .cloned();
    let (offset, writer) = match writer_of_item {
        Some(first) => (first.offset, false),
        None => {
            if faults.pool_full {
                return Err("EC consumer buffer pool is full".to_owned());
            }
            let capacity = lock(&shard.slab).len() as u64;
            let Some(offset) = first_fit(&state.allocated, nbytes, capacity) else {
                return Err("EC consumer buffer pool is full".to_owned());
            };
            state.allocated.push((offset, nbytes));
            state.allocated.sort_unstable();
            (offset, true)
        }
    };
    state.live.insert(
        transfer_id,
        Reservation {
            id: id.clone(),
            mm_hash,
            offset,
            nbytes,
            shape,
            dtype: dtype.to_owned(),
            writer,
        },
    );
    if faults.malformed_reserve {
        return Ok(json!({
            "reservation_id": id, "dst_session": session, "nbytes": nbytes, "write": writer,
        }));
    }
    Ok(json!({
        "reservation_id": id, "dst_session": session, "dst_ptr": shard.base + offset,
        "nbytes": nbytes, "write": writer, "ready": false, "cached": false,
    }))
}

fn first_fit(allocated: &[(u64, u64)], nbytes: u64, capacity: u64) -> Option<u64> {
    let mut cursor = 0;
    for (offset, len) in allocated {
        if *offset >= cursor + nbytes {
            return Some(cursor);
        }
        cursor = (offset + len).div_ceil(ALIGN) * ALIGN;
    }
    (cursor + nbytes <= capacity).then_some(cursor)
}

async fn serve_handshake(listener: TcpListener, shard: Arc<Shard>, shared: Arc<Shared>) {
    loop {
        let Ok((mut stream, _)) = listener.accept().await else {
            return;
        };
        shared
            .handshakes
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        let shard = Arc::clone(&shard);
        let shared = Arc::clone(&shared);
        tokio::spawn(async move {
            let mut head = [0u8; 9];
            if stream.read_exact(&mut head).await.is_err() {
                return;
            }
            let length = u64::from_le_bytes(head[..8].try_into().unwrap_or_default());
            if length == 0 || length > 1 << 20 || head[8] != HANDSHAKE_METADATA {
                return;
            }
            let mut body = vec![0u8; usize::try_from(length - 1).unwrap_or(0)];
            if stream.read_exact(&mut body).await.is_err() {
                return;
            }
            let faults = lock(&shared.faults).clone();
            let name = format!("127.0.0.1:{}", shard.rpc_port);
            let descriptor = json!({
                "name": name,
                "protocol": if faults.advertise_rdma { "rdma" } else { "tcp" },
                "tcp_data_host": faults.data_host.as_deref().unwrap_or("127.0.0.1"),
                "tcp_data_port": shard.data_port.load(std::sync::atomic::Ordering::Relaxed),
                "tcp_proto_version": shared.proto_version,
                "buffers": [{"name": name, "addr": shard.base, "length": lock(&shard.slab).len()}],
            })
            .to_string();
            let frame = super::transfer::handshake_frame(HANDSHAKE_METADATA, descriptor.as_bytes());
            let _ = stream.write_all(&frame).await;
            let _ = stream.shutdown().await;
        });
    }
}

async fn serve_data(listener: TcpListener, shard: Arc<Shard>, shared: Arc<Shared>) {
    let mut connections = tokio::task::JoinSet::new();
    loop {
        let Ok((stream, _)) = listener.accept().await else {
            return;
        };
        // The connections live in this task's set: a restart (aborting it) closes them too.
        connections.spawn(serve_data_connection(
            stream,
            Arc::clone(&shard),
            Arc::clone(&shared),
        ));
        while connections.try_join_next().is_some() {}
    }
}

async fn serve_data_connection(mut stream: TcpStream, shard: Arc<Shard>, shared: Arc<Shared>) {
    loop {
        let mut header = [0u8; 24];
        if stream.read_exact(&mut header).await.is_err() {
            return;
        }
        let len = u64::from_le_bytes(header[..8].try_into().unwrap_or_default());
        let addr = u64::from_le_bytes(header[8..16].try_into().unwrap_or_default());
        let opcode = header[16];
        let with_status = opcode & OPCODE_STATUS_FLAG != 0;
        if opcode & !OPCODE_STATUS_FLAG != OPCODE_WRITE || len > 1 << 32 {
            return;
        }
        let faults = lock(&shared.faults).clone();
        let mut payload = vec![0u8; usize::try_from(len).unwrap_or(0)];
        if faults.cut_mid_write {
            let half = payload.len() / 2;
            let _ = stream.read_exact(&mut payload[..half]).await;
            return;
        }
        if stream.read_exact(&mut payload).await.is_err() {
            return;
        }
        let slab_len = lock(&shard.slab).len() as u64;
        let inside = addr >= shard.base
            && addr
                .checked_add(len)
                .is_some_and(|end| end <= shard.base + slab_len);
        if faults.reject_writes || !inside {
            if with_status {
                let status = (0x4D43_5456u64 << 32) | 1;
                let _ = stream.write_all(&status.to_le_bytes()).await;
            }
            return;
        }
        let offset = addr - shard.base;
        {
            let mut slab = lock(&shard.slab);
            let start = usize::try_from(offset).unwrap_or(0);
            slab[start..start + payload.len()].copy_from_slice(&payload);
        }
        lock(&shared.writes).push(Write {
            shard: shard.control_port,
            offset,
            opcode,
            bytes: payload,
        });
        if with_status && stream.write_all(&STATUS_OK.to_le_bytes()).await.is_err() {
            return;
        }
    }
}
