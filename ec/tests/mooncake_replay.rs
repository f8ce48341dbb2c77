//! Replays an exchange recorded between iris and vLLM 0.33's own `ECMooncakeConnector` consumer
//! (Mooncake 0.3.13's TCP transport), without Python: a small consumer written for this test
//! answers each control request with the recorded reply and the handshake with the recorded
//! frame, and checks that iris sends exactly the recorded requests, in order, and writes exactly
//! the recorded rows at the recorded addresses.
//!
//! The fixture is made by `tools/epd-interop/mooncake_interop.py --record` and reduced by
//! `tools/epd-interop/replay_fixture.py`. Only ports differ from the recording (this test's
//! listeners stand in for the consumer's); addresses, reservation ids, transfer ids,
//! identifiers and bytes are the recorded ones.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use iris_ec::config::MooncakeSettings;
use iris_ec::mooncake::transfer::{HANDSHAKE_METADATA, STATUS_OK, handshake_frame};
use iris_ec::mooncake::{MooncakeProducer, PushSpec};
use iris_ec::storage::EcDtype;
use serde_json::{Value, json};
use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
use tokio::net::TcpListener;
use zeromq::{RepSocket, Socket as _, SocketRecv as _, SocketSend as _, ZmqMessage};

fn fixture() -> Value {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/tests/fixtures/mooncake/replay.json"
    );
    serde_json::from_str(&std::fs::read_to_string(path).unwrap()).unwrap()
}

fn unhex(text: &str) -> Vec<u8> {
    (0..text.len())
        .step_by(2)
        .map(|i| u8::from_str_radix(&text[i..i + 2], 16).unwrap())
        .collect()
}

/// What the replaying consumer saw that differs from the recording.
#[derive(Default)]
struct Seen {
    mismatches: Vec<String>,
    next: usize,
    /// Applied writes: address -> (opcode, bytes).
    writes: HashMap<u64, (u8, Vec<u8>)>,
    handshakes: usize,
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn iris_sends_what_vllms_consumer_saw_and_writes_the_recorded_rows() {
    let fixture = fixture();
    let recorded: Vec<(Value, Value)> = fixture["control"]
        .as_array()
        .unwrap()
        .iter()
        .map(|c| (c["request"].clone(), c["reply"].clone()))
        .collect();
    let recorded_session = fixture["handshake"]["session"].as_str().unwrap().to_owned();
    let frame = unhex(fixture["handshake"]["reply_frame_hex"].as_str().unwrap());
    assert_eq!(frame[8], HANDSHAKE_METADATA);
    let mut descriptor: Value = serde_json::from_slice(&frame[9..]).unwrap();

    let seen = Arc::new(Mutex::new(Seen::default()));
    let handshake = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let data = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let session = format!("127.0.0.1:{}", handshake.local_addr().unwrap().port());
    descriptor["tcp_data_port"] = json!(data.local_addr().unwrap().port());
    let reply_frame = handshake_frame(HANDSHAKE_METADATA, descriptor.to_string().as_bytes());

    let mut control = RepSocket::new();
    let control_port = match control.bind("tcp://127.0.0.1:0").await.unwrap() {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("bound {other}"),
    };

    // The control channel: recorded requests checked, recorded replies sent.
    let control_seen = Arc::clone(&seen);
    let replies = recorded.clone();
    let local_session = session.clone();
    tokio::spawn(async move {
        loop {
            let Ok(message) = control.recv().await else {
                return;
            };
            let request: Value =
                serde_json::from_slice(message.get(0).unwrap()).unwrap_or(Value::Null);
            let reply = {
                let mut seen = control_seen.lock().unwrap();
                let index = seen.next;
                seen.next += 1;
                match replies.get(index) {
                    None => {
                        seen.mismatches
                            .push(format!("request {index} beyond the recording: {request}"));
                        json!({"ok": false, "error": "not in the recording"})
                    }
                    Some((want, reply)) => {
                        if *want != request {
                            seen.mismatches
                                .push(format!("request {index}: sent {request}, recorded {want}"));
                        }
                        let text = reply.to_string().replace(&recorded_session, &local_session);
                        let mut reply: Value = serde_json::from_str(&text).unwrap();
                        if want["op"] == "peers" {
                            reply["result"]["ports"] = json!([control_port]);
                        }
                        reply
                    }
                }
            };
            if control
                .send(ZmqMessage::from(reply.to_string()))
                .await
                .is_err()
            {
                return;
            }
        }
    });

    // The handshake daemon: the recorded frame, with this test's data port.
    let handshake_seen = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = handshake.accept().await {
            let mut head = [0u8; 9];
            stream.read_exact(&mut head).await.unwrap();
            let length = u64::from_le_bytes(head[..8].try_into().unwrap());
            let mut body = vec![0u8; usize::try_from(length - 1).unwrap()];
            stream.read_exact(&mut body).await.unwrap();
            {
                let mut seen = handshake_seen.lock().unwrap();
                seen.handshakes += 1;
                if head[8] != HANDSHAKE_METADATA
                    || !serde_json::from_slice::<Value>(&body).is_ok_and(|v| v.is_object())
                {
                    seen.mismatches.push(format!(
                        "handshake of type {} with body {}",
                        head[8],
                        String::from_utf8_lossy(&body)
                    ));
                }
            }
            stream.write_all(&reply_frame).await.unwrap();
            stream.shutdown().await.unwrap();
        }
    });

    // The data port: every write applied and acknowledged as Mooncake's protocol 2 does.
    let data_seen = Arc::clone(&seen);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = data.accept().await {
            let seen = Arc::clone(&data_seen);
            tokio::spawn(async move {
                let mut header = [0u8; 24];
                while stream.read_exact(&mut header).await.is_ok() {
                    let len = u64::from_le_bytes(header[..8].try_into().unwrap());
                    let addr = u64::from_le_bytes(header[8..16].try_into().unwrap());
                    let mut payload = vec![0u8; usize::try_from(len).unwrap()];
                    stream.read_exact(&mut payload).await.unwrap();
                    seen.lock()
                        .unwrap()
                        .writes
                        .insert(addr, (header[16], payload));
                    stream.write_all(&STATUS_OK.to_le_bytes()).await.unwrap();
                }
            });
        }
    });

    // iris's side: each recorded reservation request becomes one push of those items.
    let producer = MooncakeProducer::new(
        MooncakeSettings {
            control_timeout: Duration::from_secs(10),
        },
        "iris-replay".to_owned(),
    );
    let consumer = format!("tcp://127.0.0.1:{control_port}");
    let rows: HashMap<String, Vec<u8>> = fixture["rows_hex"]
        .as_object()
        .unwrap()
        .iter()
        .map(|(k, v)| (k.clone(), unhex(v.as_str().unwrap())))
        .collect();
    let mut pushes = 0;
    for (request, _) in &recorded {
        let items: Vec<Value> = match request["op"].as_str().unwrap() {
            "reserve" => vec![request.clone()],
            "reserve_batch" => request["items"].as_array().unwrap().clone(),
            _ => continue,
        };
        let specs: Vec<PushSpec> = items
            .iter()
            .map(|item| {
                assert_eq!(item["dtype"], "bfloat16");
                PushSpec {
                    transfer_id: item["transfer_id"].as_str().unwrap().to_owned(),
                    mm_hash: item["mm_hash"].as_str().unwrap().to_owned(),
                    rows: item["shape"][0].as_u64().unwrap(),
                    width: item["shape"][1].as_u64().unwrap(),
                    dtype: EcDtype::Bf16,
                }
            })
            .collect();
        let reserved = producer.reserve(&consumer, specs.clone()).await.unwrap();
        let payloads: Vec<Option<Arc<Vec<u8>>>> = specs
            .iter()
            .enumerate()
            .map(|(i, spec)| {
                reserved
                    .needs_write(i)
                    .then(|| Arc::new(rows[&spec.mm_hash].clone()))
            })
            .collect();
        producer.push(reserved, &payloads).await.unwrap();
        pushes += 1;
    }

    let seen = seen.lock().unwrap();
    assert!(seen.mismatches.is_empty(), "{:#?}", seen.mismatches);
    assert_eq!(seen.next, recorded.len(), "recorded requests never sent");
    assert!(pushes >= 4, "the recording has {pushes} pushes");
    assert_eq!(seen.handshakes, 1, "one handshake per session, then cached");
    // Each completed reservation got exactly its item's rows, once, with a status request.
    let mut expected = HashMap::new();
    for (request, reply) in &recorded {
        let results: Vec<(&Value, &Value)> = match request["op"].as_str().unwrap() {
            "reserve" => vec![(request, &reply["result"])],
            "reserve_batch" => request["items"]
                .as_array()
                .unwrap()
                .iter()
                .zip(reply["result"]["items"].as_array().unwrap())
                .map(|(item, answer)| (item, &answer["result"]))
                .collect(),
            _ => continue,
        };
        for (item, result) in results {
            if result["write"] == true && result["cached"] != true {
                let mm_hash = item["mm_hash"].as_str().unwrap();
                expected.insert(result["dst_ptr"].as_u64().unwrap(), rows[mm_hash].clone());
            }
        }
    }
    assert_eq!(seen.writes.len(), expected.len());
    for (addr, bytes) in &expected {
        let (opcode, written) = &seen.writes[addr];
        assert_eq!(*opcode, 0x81);
        assert_eq!(written, bytes, "rows at {addr:#x}");
    }
}
