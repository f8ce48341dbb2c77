//! The control client against a consumer whose answers are out of bounds.

use std::time::Duration;

use iris_ec::mooncake::control::{ControlClient, MAX_SHARDS};
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
