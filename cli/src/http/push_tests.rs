//! `/v1/chat/completions` with the push connector against the in-process Mooncake consumer: what
//! lands, what the reply says, and that every consumer fault is a JSON 5xx that leaves nothing
//! reserved and the engine serving.

use std::sync::Arc;

use axum::http::{Method, StatusCode};
use iris_ec::mooncake::consumer::{Faults, TestConsumer};
use serde_json::{Value, json};

use super::test_engine::FakeEngine;
use super::tests::{call, call_json, png, url};
use super::*;
use crate::epd::EpdArgs;

const MODEL: &str = "Qwen/Qwen2.5-VL-3B-Instruct";

fn epd_app(config: Option<String>) -> (Router, Arc<FakeEngine>) {
    epd_app_allowing(config, &[])
}

/// [`epd_app`] with `--allowed-ec-consumers` set to `allowed` (none: the flag is absent).
fn epd_app_allowing(config: Option<String>, allowed: &[&str]) -> (Router, Arc<FakeEngine>) {
    let args = EpdArgs {
        ec_transfer_config: config,
        allowed_ec_consumers: allowed.iter().map(|a| (*a).to_owned()).collect(),
        model_id: Some(MODEL.into()),
        ..EpdArgs::default()
    };
    let epd = Arc::new(args.resolve("tiny", None).unwrap());
    let engine = Arc::new(FakeEngine::new(false));
    let config = ServerConfig {
        epd: Some(epd),
        ..ServerConfig::default()
    };
    (router(Arc::clone(&engine), config).unwrap(), engine)
}

fn push_app(timeout_s: f64) -> (Router, Arc<FakeEngine>) {
    push_app_allowing(timeout_s, &[])
}

fn push_app_allowing(timeout_s: f64, allowed: &[&str]) -> (Router, Arc<FakeEngine>) {
    epd_app_allowing(
        Some(
            json!({
                "ec_connector": "ECMooncakeConnector",
                "ec_role": "ec_producer",
                "ec_connector_extra_config": {"mooncake_protocol": "tcp", "control_timeout_s": timeout_s},
            })
            .to_string(),
        ),
        allowed,
    )
}

fn request(images: &[(&[u8], Option<&str>)], consumer: &str, transfer_ids: &[&str]) -> Value {
    let parts: Vec<Value> = images
        .iter()
        .map(|(bytes, uuid)| {
            let mut part = json!({"type": "image_url", "image_url": {"url": url(bytes)}});
            if let Some(uuid) = uuid {
                part["uuid"] = json!(uuid);
            }
            part
        })
        .collect();
    json!({
        "model": MODEL,
        "messages": [{"role": "user", "content": parts}],
        "stream": false,
        "ec_transfer_params": {
            "consumer_zmq": consumer,
            "ec_items": transfer_ids.iter().map(|t| json!({"transfer_id": t})).collect::<Vec<_>>(),
        },
    })
}

/// The rows `iris` writes for `bytes` under the shared-storage connector (the same rows the push
/// must deliver), read back from the store.
async fn stored_rows(bytes: &[u8]) -> Vec<u8> {
    let store = tempfile::tempdir().unwrap();
    let (app, _) = epd_app(Some(
        json!({
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"shared_storage_path": store.path()},
        })
        .to_string(),
    ));
    let mut body = request(&[(bytes, Some("u"))], "tcp://127.0.0.1:1", &["t"]);
    body.as_object_mut().unwrap().remove("ec_transfer_params");
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let file = std::fs::read(store.path().join("u/encoder_cache.safetensors")).unwrap();
    let tensors = safetensors::SafeTensors::deserialize(&file).unwrap();
    tensors.tensor("ec_cache").unwrap().data().to_vec()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_proxys_push_request_lands_on_every_shard_and_the_reply_names_the_transfers() {
    let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
    let (app, engine) = push_app(5.0);
    let (a, b) = (png(56, 56, 1), png(112, 56, 2));
    let body = request(
        &[
            (&a, Some("uuid-a")),
            (&b, Some("uuid-b")),
            (&a, Some("uuid-a")),
        ],
        &consumer.consumer_zmq(),
        &["t0", "t1", "t2"],
    );
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    let params = &v["ec_transfer_params"];
    assert_eq!(
        params["uuid-a"],
        json!({"modality": "image", "item_indices": [0, 2], "metadata": {"image_grid_thw": [1, 4, 4]}, "transfer_id": "t2"})
    );
    assert_eq!(params["uuid-b"]["transfer_id"], "t1");
    assert_eq!(
        engine.encode_calls(),
        1,
        "one engine request for both images"
    );
    for shard in 0..2 {
        let (rows, shape, dtype) = consumer.resident(shard, "uuid-a").unwrap();
        assert_eq!(shape, vec![4, 8]);
        assert_eq!(dtype, "float32");
        assert_eq!(rows, stored_rows(&a).await);
        let (rows, shape, _) = consumer.resident(shard, "uuid-b").unwrap();
        assert_eq!(shape, vec![8, 8]);
        assert_eq!(rows, stored_rows(&b).await);
    }
    assert_eq!(consumer.live_reservations(), 0);

    // Again: the consumer holds both, so nothing is encoded or written.
    let writes = consumer.writes().len();
    let body = request(&[(&a, Some("uuid-a"))], &consumer.consumer_zmq(), &["t3"]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["ec_transfer_params"]["uuid-a"]["transfer_id"], "t3");
    assert_eq!(consumer.writes().len(), writes);
    assert_eq!(engine.encode_calls(), 1);

    let (_, metrics) = call(&app, Method::GET, "/metrics", None, None).await;
    for line in [
        "iris_ec_pushes_total 2",
        "iris_ec_push_cached_total 2",
        "iris_ec_push_bytes_total 768",
        "iris_ec_push_seconds_count 2",
        "iris_ec_push_failures_total{reason=\"pool_full\"} 0",
    ] {
        assert!(metrics.contains(line), "{line} missing from\n{metrics}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_consumer_fault_is_a_json_5xx_naming_the_consumer_and_leaves_nothing_reserved() {
    let cases: [(Faults, StatusCode, &str); 7] = [
        (
            Faults {
                pool_full: true,
                ..Faults::default()
            },
            StatusCode::BAD_GATEWAY,
            "pool_full",
        ),
        (
            Faults {
                cancel_on_reserve: true,
                ..Faults::default()
            },
            StatusCode::BAD_GATEWAY,
            "cancelled",
        ),
        (
            Faults {
                reject_writes: true,
                ..Faults::default()
            },
            StatusCode::BAD_GATEWAY,
            "address_rejected",
        ),
        (
            Faults {
                cut_mid_write: true,
                ..Faults::default()
            },
            StatusCode::BAD_GATEWAY,
            "connection_lost",
        ),
        (
            Faults {
                forget_on_complete: true,
                ..Faults::default()
            },
            StatusCode::BAD_GATEWAY,
            "cancelled",
        ),
        (
            Faults {
                advertise_rdma: true,
                ..Faults::default()
            },
            StatusCode::BAD_GATEWAY,
            "rdma_only",
        ),
        (
            Faults {
                never_answer: true,
                ..Faults::default()
            },
            StatusCode::GATEWAY_TIMEOUT,
            "timeout",
        ),
    ];
    let (app, _) = push_app(0.5);
    let image = png(56, 56, 7);
    for (faults, status_wanted, reason) in cases {
        let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
        consumer.set_faults(faults.clone());
        let body = request(&[(&image, None)], &consumer.consumer_zmq(), &["t0"]);
        let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, status_wanted, "{faults:?}: {v}");
        assert_eq!(v["error"]["code"], "ec_push_failed", "{v}");
        assert_eq!(v["error"]["type"], "upstream_error", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(&consumer.consumer_zmq()), "{message}");
        assert!(message.contains(&format!("({reason})")), "{message}");
        if !faults.never_answer {
            assert_eq!(consumer.live_reservations(), 0, "{faults:?}: {message}");
            assert_eq!(consumer.allocated_bytes(), 0, "{faults:?}: {message}");
        }
        let (_, metrics) = call(&app, Method::GET, "/metrics", None, None).await;
        assert!(
            metrics.contains(&format!(
                "iris_ec_push_failures_total{{reason=\"{reason}\"}} 1"
            )) || reason == "cancelled",
            "{metrics}"
        );

        // The engine and the push path go on: the same server pushes to a sound consumer.
        let sound = TestConsumer::start(1, 1 << 20, 2).await.unwrap();
        let body = request(&[(&image, None)], &sound.consumer_zmq(), &["t1"]);
        let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, StatusCode::OK, "after {faults:?}: {v}");
        assert_eq!(sound.live_reservations(), 0);
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_that_is_down_fails_the_request_within_the_control_timeout() {
    let port = std::net::TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let consumer = format!("tcp://127.0.0.1:{port}");
    let (app, _) = push_app(0.3);
    let body = request(&[(&png(56, 56, 1), None)], &consumer, &["t0"]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert!(status.is_server_error(), "{v}");
    assert_eq!(v["error"]["code"], "ec_push_failed", "{v}");
    assert!(
        v["error"]["message"].as_str().unwrap().contains(&consumer),
        "{v}"
    );
}

#[tokio::test]
async fn malformed_or_misplaced_ec_transfer_params_are_400s() {
    let (app, engine) = push_app(1.0);
    let image = png(56, 56, 1);
    let good = request(&[(&image, Some("u"))], "tcp://127.0.0.1:5555", &["t0"]);
    let cases = [
        (
            json!({"consumer_zmq": "tcp://127.0.0.1:5555", "ec_items": []}),
            "has 0 entries for 1 items",
        ),
        (
            json!({"consumer_zmq": "127.0.0.1:5555", "ec_items": [{"transfer_id": "t"}]}),
            "not a tcp://host:port",
        ),
        (
            json!({"consumer_zmq": "tcp://127.0.0.1:5555"}),
            "ec_items is missing",
        ),
        (
            json!({"consumer_zmq": "tcp://127.0.0.1:5555", "ec_items": [{"transfer_id": ""}]}),
            "transfer_id must be a non-empty string",
        ),
        (
            json!({"consumer_zmq": "tcp://127.0.0.1:5555", "ec_items": [{"transfer_id": "t", "mm_hash": "other"}]}),
            "mm_hash is \"other\"",
        ),
        (json!({"consumer_zmq": 5, "ec_items": []}), "consumer_zmq"),
        (
            json!({"consumer_zmq": "tcp://127.0.0.1:5555", "ec_items": [{"transfer_id": "t"}], "x": 1}),
            "ec_transfer_params.x is not supported",
        ),
        (json!([1]), "ec_transfer_params"),
    ];
    for (params, needle) in cases {
        let mut body = good.clone();
        body["ec_transfer_params"] = params.clone();
        let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{params}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(message.contains(needle), "{params}: {message}");
    }
    assert_eq!(engine.encode_calls(), 0);

    // Two images under one transfer id would share the consumer's one reservation.
    let other = png(56, 56, 2);
    let shared = request(
        &[(&image, None), (&other, None)],
        "tcp://127.0.0.1:5555",
        &["t", "t"],
    );
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(shared)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains("ec_items[1].transfer_id \"t\" is also item 0's"),
        "{message}"
    );
    assert_eq!(engine.encode_calls(), 0);

    // A server without the push connector refuses a request that names a consumer.
    let store = tempfile::tempdir().unwrap();
    let (storage_app, _) = epd_app(Some(
        json!({
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"shared_storage_path": store.path()},
        })
        .to_string(),
    ));
    let (status, v) = call_json(
        &storage_app,
        Method::POST,
        "/v1/chat/completions",
        Some(good),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "ec_transfer_not_configured", "{v}");
    assert_eq!(std::fs::read_dir(store.path()).unwrap().count(), 0);

    // As vLLM's producer: a request that names no consumer is encoded and answered, not pushed.
    let mut body = request(&[(&image, Some("u"))], "tcp://127.0.0.1:5555", &["t0"]);
    body["ec_transfer_params"] = json!({});
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(
        v["ec_transfer_params"]["u"].get("transfer_id").is_none(),
        "{v}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_consumer_off_the_allow_list_is_a_403_and_nothing_connects_to_it() {
    // A listener standing for the consumer: any connection iris made would be waiting on it.
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    listener.set_nonblocking(true).unwrap();
    let port = listener.local_addr().unwrap().port();
    let (app, engine) = push_app_allowing(2.0, &["10.0.0.0/8", "pd-host", "fd00::/8"]);
    let image = png(56, 56, 1);
    // No DNS: `localhost` is not 127.0.0.1, and 127.0.0.1 is not in 10.0.0.0/8.
    for consumer in [
        format!("tcp://127.0.0.1:{port}"),
        format!("tcp://localhost:{port}"),
        format!("tcp://[::ffff:127.0.0.1]:{port}"),
    ] {
        let body = request(&[(&image, None)], &consumer, &["t0"]);
        let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{consumer}: {v}");
        assert_eq!(v["error"]["code"], "ec_consumer_not_allowed", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&consumer) && message.contains("--allowed-ec-consumers"),
            "{message}"
        );
        // The list describes the operator's network: it is not shown to clients.
        assert!(!message.contains("10.0.0.0/8"), "{message}");
    }
    assert_eq!(
        listener.accept().map(|_| ()).unwrap_err().kind(),
        std::io::ErrorKind::WouldBlock,
        "iris connected to a consumer that is not allowed"
    );
    assert_eq!(engine.encode_calls(), 0, "refused before encoding");

    // A consumer on the list is pushed to as without one.
    let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
    let (app, _) = push_app_allowing(2.0, &["10.0.0.0/8", "127.0.0.1"]);
    let body = request(&[(&image, Some("u"))], &consumer.consumer_zmq(), &["t1"]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["ec_transfer_params"]["u"]["transfer_id"], "t1");
    assert!(consumer.resident(0, "u").is_some() && consumer.resident(1, "u").is_some());
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_address_the_consumer_names_off_the_allow_list_is_a_502_and_its_reservations_are_cancelled()
 {
    let image = png(56, 56, 3);
    let (app, _) = push_app_allowing(2.0, &["127.0.0.0/8"]);
    let cases = [
        // A reservation's Mooncake session on another host: refused before its handshake.
        (
            Faults {
                session_host: Some("localhost".to_owned()),
                ..Faults::default()
            },
            "dst_session",
        ),
        // A handshake naming another data host: refused before the data connection.
        (
            Faults {
                data_host: Some("localhost".to_owned()),
                ..Faults::default()
            },
            "data address localhost:",
        ),
    ];
    for (count, (faults, needle)) in (1..).zip(cases) {
        let consumer = TestConsumer::start(2, 1 << 20, 2).await.unwrap();
        consumer.set_faults(faults.clone());
        let body = request(&[(&image, None)], &consumer.consumer_zmq(), &["t0"]);
        let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, StatusCode::BAD_GATEWAY, "{faults:?}: {v}");
        assert_eq!(v["error"]["code"], "ec_push_failed", "{v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains(&consumer.consumer_zmq())
                && message.contains("(not_allowed)")
                && message.contains("localhost")
                && message.contains(needle),
            "{message}"
        );
        assert!(consumer.writes().is_empty(), "{faults:?}");
        assert_eq!(consumer.live_reservations(), 0, "{faults:?}: {message}");
        assert_eq!(consumer.allocated_bytes(), 0, "{faults:?}: {message}");
        let cancels = consumer
            .exchanges()
            .iter()
            .filter(|e| e.request["op"] == "cancel")
            .count();
        assert_eq!(cancels, 2, "{faults:?}: one cancel per shard");
        let (_, metrics) = call(&app, Method::GET, "/metrics", None, None).await;
        let line = format!("iris_ec_push_failures_total{{reason=\"not_allowed\"}} {count}");
        assert!(metrics.contains(&line), "{line} missing from\n{metrics}");

        // Without the flag, as vLLM's producer, the same consumer is pushed to.
        let (open, _) = push_app(2.0);
        let body = request(&[(&image, Some("u"))], &consumer.consumer_zmq(), &["t1"]);
        let (status, v) = call_json(&open, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, StatusCode::OK, "{faults:?}: {v}");
        assert!(consumer.resident(0, "u").is_some(), "{faults:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_push_takes_any_uuid_as_vllm_does() {
    // Only the shared store makes a file of an identifier; a push sends it as a string, so a
    // uuid that is no file name (`a/b`) is refused by the store's server alone.
    let consumer = TestConsumer::start(1, 1 << 20, 1).await.unwrap();
    let (app, _) = push_app(5.0);
    let a = png(56, 56, 3);
    let body = request(&[(&a, Some("tenant/a"))], &consumer.consumer_zmq(), &["t0"]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["ec_transfer_params"]["tenant/a"]["transfer_id"], "t0");
    assert!(consumer.resident(0, "tenant/a").is_some());
}
