//! The control client against a consumer whose answers are out of bounds.

use std::time::Duration;

use iris_ec::mooncake::PushFailure;
use iris_ec::mooncake::control::{ControlClient, ControlError, MAX_SHARDS};
use serde_json::json;
use zeromq::{RepSocket, Socket as _, SocketRecv as _, SocketSend as _, ZmqMessage};

/// A consumer that answers `peers` with `ports` once.
async fn consumer(ports: Vec<u64>) -> String {
    let mut control = RepSocket::new();
    let port = match control.bind("tcp://127.0.0.1:0").await.unwrap() {
        zeromq::Endpoint::Tcp(_, port) => port,
        other => panic!("bound {other}"),
    };
    tokio::spawn(async move {
        if control.recv().await.is_ok() {
            let reply = json!({"ok": true, "result": {"ports": ports}});
            let _ = control.send(ZmqMessage::from(reply.to_string())).await;
        }
        // Keep the socket until the client has read the reply.
        tokio::time::sleep(Duration::from_secs(10)).await;
    });
    format!("tcp://127.0.0.1:{port}")
}

#[tokio::test]
async fn a_consumer_naming_more_shards_than_the_bound_is_refused() {
    let client = ControlClient::new(Duration::from_secs(5));
    let many = consumer((0..=MAX_SHARDS as u64).map(|p| 20000 + p).collect()).await;
    let err = client.shards(&many).await.unwrap_err();
    assert!(
        err.message.contains(&format!(
            "{} ports, more than the {MAX_SHARDS} shards",
            MAX_SHARDS + 1
        )),
        "{}",
        err.message
    );

    let client = ControlClient::new(Duration::from_secs(5));
    let two = consumer(vec![20001, 20002]).await;
    let shards = client.shards(&two).await.unwrap();
    assert_eq!(shards, ["tcp://127.0.0.1:20001", "tcp://127.0.0.1:20002"]);
}

#[tokio::test]
async fn a_client_keeps_its_bound_of_consumers() {
    let client = ControlClient::with_max_peers(Duration::from_secs(5), 2);
    for port in 0..3 {
        let addr = consumer(vec![21000 + port]).await;
        client.shards(&addr).await.unwrap();
        let kept = usize::try_from(port + 1).unwrap().min(2);
        // Each answered address keeps its socket and its topology, the oldest dropped past 2.
        assert_eq!(client.kept(), (kept, kept), "after consumer {port}");
    }
    assert_eq!(ControlClient::new(Duration::from_secs(1)).kept(), (0, 0));
}

/// A ZMTP 3.0 REP peer written out by hand, so that it can misbehave: it accepts connections
/// on its own port and serves each with `serve` after the greeting and READY.
async fn raw_peer<F, Fut>(serve: F) -> String
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    raw_peer_greeting_after(Duration::ZERO, serve).await
}

/// [`raw_peer`], greeting each connection only after `delay`.
async fn raw_peer_greeting_after<F, Fut>(delay: Duration, serve: F) -> String
where
    F: Fn(tokio::net::TcpStream) -> Fut + Send + Sync + 'static,
    Fut: std::future::Future<Output = ()> + Send,
{
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let port = listener.local_addr().unwrap().port();
    let serve = std::sync::Arc::new(serve);
    tokio::spawn(async move {
        while let Ok((mut stream, _)) = listener.accept().await {
            let serve = std::sync::Arc::clone(&serve);
            tokio::spawn(async move {
                tokio::time::sleep(delay).await;
                let mut greeting = [0u8; 64];
                greeting[0] = 0xff;
                greeting[9] = 0x7f;
                greeting[10] = 3;
                greeting[12..16].copy_from_slice(b"NULL");
                let mut ready = vec![0x04, 0];
                ready.extend_from_slice(b"\x05READY\x0bSocket-Type\x00\x00\x00\x03REP");
                ready[1] = u8::try_from(ready.len() - 2).unwrap();
                let (mut theirs, mut head) = ([0u8; 64], [0u8; 2]);
                // A client that gave up meanwhile ends the connection: nothing to serve.
                if stream.write_all(&greeting).await.is_err()
                    || stream.read_exact(&mut theirs).await.is_err()
                    || stream.write_all(&ready).await.is_err()
                    // Their READY: flags, length, body.
                    || stream.read_exact(&mut head).await.is_err()
                {
                    return;
                }
                let mut body = vec![0u8; usize::from(head[1])];
                if stream.read_exact(&mut body).await.is_ok() {
                    serve(stream).await;
                }
            });
        }
    });
    format!("tcp://127.0.0.1:{port}")
}

/// The error of a `peers` request to `addr` under a client with `timeout`, which must fail.
async fn peers_error(addr: &str, timeout: Duration) -> ControlError {
    ControlClient::new(timeout)
        .request(addr, &json!({"op": "peers"}))
        .await
        .unwrap_err()
}

/// The delimiter and the head of a long body frame of `len` bytes, as a REP socket replies.
fn long_reply_head(len: u64) -> Vec<u8> {
    let mut head = vec![0x01, 0x00, 0x02];
    head.extend_from_slice(&len.to_be_bytes());
    head
}

/// Reads one request (a delimiter and a short body) from `stream`.
async fn read_request(stream: &mut tokio::net::TcpStream) -> Vec<u8> {
    use tokio::io::AsyncReadExt as _;
    let mut delimiter = [0u8; 2];
    stream.read_exact(&mut delimiter).await.unwrap();
    let mut head = [0u8; 2];
    stream.read_exact(&mut head).await.unwrap();
    let mut body = vec![0u8; usize::from(head[1])];
    stream.read_exact(&mut body).await.unwrap();
    body
}

#[tokio::test]
async fn a_peer_declaring_a_huge_frame_fails_the_exchange_not_the_process() {
    use tokio::io::AsyncWriteExt as _;
    let addr = raw_peer(|mut stream| async move {
        read_request(&mut stream).await;
        // The delimiter, then a frame claiming 2^44 bytes: a decoder that reserved it first
        // aborted the process on the failed allocation.
        let _ = stream.write_all(&long_reply_head(1 << 44)).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    let err = peers_error(&addr, Duration::from_secs(5)).await;
    assert!(
        err.message.contains("a frame of 17592186044416 bytes"),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn a_pooled_connection_the_consumer_closed_is_not_used() {
    use tokio::io::AsyncWriteExt as _;
    // A consumer that answers one request per connection and then closes it, as one that
    // restarted between two pushes.
    let addr = raw_peer(|mut stream| async move {
        read_request(&mut stream).await;
        let body = json!({"ok": true, "result": {"ports": [1]}}).to_string();
        let mut reply = vec![0x01, 0x00, 0x00, u8::try_from(body.len()).unwrap()];
        reply.extend_from_slice(body.as_bytes());
        stream.write_all(&reply).await.unwrap();
    })
    .await;
    let client = ControlClient::new(Duration::from_secs(5));
    for round in 0..3 {
        let result = client.request(&addr, &json!({"op": "peers"})).await;
        assert_eq!(
            result.map_err(|err| err.message),
            Ok(json!({"ports": [1]})),
            "request {round}"
        );
        // Let the peer's close arrive before the next request takes the pooled connection.
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
}

/// A peer that greets each connection after `greet_after` and answers each request with
/// `{"ok": true}` after `reply_after`.
async fn slow_peer(greet_after: Duration, reply_after: Duration) -> String {
    use tokio::io::AsyncWriteExt as _;
    raw_peer_greeting_after(greet_after, move |mut stream| async move {
        read_request(&mut stream).await;
        tokio::time::sleep(reply_after).await;
        let body = br#"{"ok": true}"#;
        let mut reply = vec![0x01, 0x00, 0x00, u8::try_from(body.len()).unwrap()];
        reply.extend_from_slice(body);
        let _ = stream.write_all(&reply).await;
        tokio::time::sleep(Duration::from_secs(10)).await;
    })
    .await
}

#[tokio::test]
async fn a_peer_that_takes_the_connection_and_never_greets_did_not_answer() {
    // A stopped consumer process (or another program on its port): the kernel completes the
    // connection, nothing answers. That is a consumer that did not answer in time (a 504),
    // not one that cannot be reached (a 502 asking whether it runs).
    let addr = slow_peer(Duration::from_secs(60), Duration::ZERO).await;
    let err = peers_error(&addr, Duration::from_millis(500)).await;
    assert_eq!(err.failure, PushFailure::Timeout, "{}", err.message);
    assert!(
        err.message
            .contains("did not complete the ZMTP handshake within 0.5 s"),
        "{}",
        err.message
    );
}

#[tokio::test]
async fn one_deadline_bounds_the_connection_and_the_exchange() {
    // Each phase alone fits in the limit; together they do not. `control_timeout_s` bounds
    // one request as vLLM's socket timeouts do, not each phase of it.
    let addr = slow_peer(Duration::from_millis(700), Duration::from_millis(700)).await;
    let err = peers_error(&addr, Duration::from_secs(1)).await;
    assert_eq!(err.failure, PushFailure::Timeout, "{}", err.message);
    // Within the limit, the same peer answers.
    let client = ControlClient::new(Duration::from_secs(5));
    let answer = client.request(&addr, &json!({"op": "peers"})).await;
    assert_eq!(
        answer.map_err(|err| err.message),
        Ok(serde_json::Value::Null)
    );
}

#[tokio::test]
async fn a_long_answer_is_quoted_in_part() {
    use tokio::io::AsyncWriteExt as _;
    // An error of 200 kB (a consumer is named by the request, so anything may answer): the
    // message quotes its start, not all of it, into every failed request's reply.
    let addr = raw_peer(|mut stream| async move {
        read_request(&mut stream).await;
        let body = json!({"ok": false, "error": "x".repeat(200_000)}).to_string();
        let mut reply = long_reply_head(body.len() as u64);
        reply.extend_from_slice(body.as_bytes());
        let _ = stream.write_all(&reply).await;
        tokio::time::sleep(Duration::from_secs(5)).await;
    })
    .await;
    let err = peers_error(&addr, Duration::from_secs(5)).await;
    assert!(err.message.len() < 1000, "{} bytes", err.message.len());
    assert!(
        err.message.contains("refused `peers`: xxx") && err.message.contains("bytes in all"),
        "{}",
        err.message
    );
}

/// A REP socket of libzmq, through pyzmq: the library vLLM's consumer answers with. Skipped,
/// saying why, where pyzmq is not importable (`.ci/run` installs it and names it in
/// `IRIS_TEST_PYZMQ_DIR`, which makes it required).
#[tokio::test]
async fn requests_go_through_libzmqs_rep_socket() {
    const SERVER: &str = r#"
import json, sys, zmq
ctx = zmq.Context()
rep = ctx.socket(zmq.REP)
port = rep.bind_to_random_port("tcp://127.0.0.1")
print(port, flush=True)
for _ in range(3):
    request = json.loads(rep.recv())
    rep.send(json.dumps({"ok": True, "result": {"echo": request, "pad": "x" * 300}}).encode())
"#;
    let dir = std::env::var_os("IRIS_TEST_PYZMQ_DIR");
    let mut python = std::process::Command::new("python3");
    python.args(["-c", SERVER]);
    if let Some(dir) = &dir {
        python.env("PYTHONPATH", dir);
    }
    let spawned = python
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn();
    let mut child = match spawned {
        Ok(child) => child,
        Err(err) if dir.is_none() => {
            eprintln!(
                "skipped: python3 cannot be run ({err}); set IRIS_TEST_PYZMQ_DIR to require it"
            );
            return;
        }
        Err(err) => panic!("python3: {err}"),
    };
    let mut line = String::new();
    std::io::BufRead::read_line(
        &mut std::io::BufReader::new(child.stdout.take().unwrap()),
        &mut line,
    )
    .unwrap();
    let Ok(port) = line.trim().parse::<u16>() else {
        let output = child.wait_with_output().unwrap();
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            dir.is_none() && stderr.contains("No module named 'zmq'"),
            "the pyzmq server did not start: {stderr}"
        );
        eprintln!(
            "skipped: pyzmq is not installed; set IRIS_TEST_PYZMQ_DIR to its folder to require it"
        );
        return;
    };
    let client = ControlClient::new(Duration::from_secs(10));
    let addr = format!("tcp://127.0.0.1:{port}");
    // Three requests on one pooled connection; replies past 255 bytes take the long frame.
    for round in 0..3 {
        let reply = client
            .request(&addr, &json!({"op": "status", "round": round}))
            .await
            .unwrap_or_else(|err| panic!("request {round}: {}", err.message));
        assert_eq!(reply["echo"], json!({"op": "status", "round": round}));
        assert_eq!(reply["pad"].as_str().unwrap().len(), 300);
    }
    assert!(child.wait().unwrap().success());
}
