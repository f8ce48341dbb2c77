//! Router tests against the in-memory test engine, through `tower::ServiceExt::oneshot`.

use std::io::Cursor;
use std::sync::Arc;
use std::time::Duration;

use axum::body::Body;
use axum::http::{Method, Request, StatusCode};
use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use http_body_util::BodyExt;
use serde_json::{Value, json};
use tower::ServiceExt;

use super::test_engine::{FakeEngine, HIDDEN, WEIGHTS_BYTES};
use super::*;

pub(super) fn png(w: u32, h: u32, seed: u8) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([x.to_le_bytes()[0], y.to_le_bytes()[0], seed])
    });
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

pub(super) fn url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", STANDARD.encode(bytes))
}

pub(super) fn app(config: ServerConfig) -> (Router, Arc<FakeEngine>) {
    let engine = Arc::new(FakeEngine::new(false));
    (router(Arc::clone(&engine), config).unwrap(), engine)
}

pub(super) async fn call(
    app: &Router,
    method: Method,
    path: &str,
    body: Option<Value>,
    key: Option<&str>,
) -> (StatusCode, String) {
    let mut req = Request::builder().method(method).uri(path);
    if let Some(k) = key {
        req = req.header("authorization", format!("Bearer {k}"));
    }
    let body = body.map_or_else(Body::empty, |v| Body::from(v.to_string()));
    let resp = app.clone().oneshot(req.body(body).unwrap()).await.unwrap();
    let status = resp.status();
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    (status, String::from_utf8(bytes.to_vec()).unwrap())
}

pub(super) async fn call_json(
    app: &Router,
    method: Method,
    path: &str,
    body: Option<Value>,
) -> (StatusCode, Value) {
    let (status, text) = call(app, method, path, body, None).await;
    (
        status,
        serde_json::from_str(&text).unwrap_or_else(|e| panic!("{path}: not JSON ({e}): {text}")),
    )
}

fn assert_error_shape(v: &Value, code: &str) {
    let err = &v["error"];
    assert!(
        err["message"].as_str().is_some_and(|m| !m.is_empty()),
        "{v}"
    );
    assert!(err["type"].as_str().is_some(), "{v}");
    assert_eq!(err["code"], code, "{v}");
}

#[tokio::test]
async fn encode_reports_each_image_and_the_repeat_is_cached() {
    let (app, _) = app(ServerConfig::default());
    let a = png(56, 28, 1);
    let b = png(28, 28, 2);
    let body = json!({"images": [url(&a), url(&b)]});
    let (status, v) = call_json(&app, Method::POST, "/v1/encode", Some(body.clone())).await;
    assert_eq!(status, 200, "{v}");
    let images = v["images"].as_array().unwrap();
    assert_eq!(images.len(), 2);
    assert_eq!(images[0]["grid_thw"], json!([1, 2, 4]));
    assert_eq!(images[0]["num_tokens"], 2);
    assert_eq!(images[1]["num_tokens"], 1);
    assert_eq!(images[0]["cached"], false);
    assert_eq!(images[0]["mm_hash"].as_str().unwrap().len(), 32);
    assert!(images[0].get("embeddings").is_none());
    assert_eq!(v["usage"], json!({"num_images": 2, "num_tokens": 3}));
    let (_, again) = call_json(&app, Method::POST, "/v1/encode", Some(body)).await;
    assert_eq!(again["images"][0]["cached"], true);
    assert_eq!(again["images"][0]["mm_hash"], images[0]["mm_hash"]);
}

#[tokio::test]
async fn embeddings_come_back_as_base64_f32() {
    let (app, _) = app(ServerConfig::default());
    let body = json!({"messages": [{"role": "user", "content": [
        {"type": "text", "text": "describe"},
        {"type": "image_url", "image_url": {"url": url(&png(56, 56, 3))}}
    ]}], "return_embeddings": "f32"});
    let (status, v) = call_json(&app, Method::POST, "/v1/encode", Some(body)).await;
    assert_eq!(status, 200, "{v}");
    let emb = &v["images"][0]["embeddings"];
    let (data, shape) = request::parse_tensor_json(emb).unwrap();
    assert_eq!(shape, [4, HIDDEN]);
    assert_eq!(data[3], 1.5);
    assert_eq!(v["images"][0]["deepstack"], json!([]));
}

#[tokio::test]
async fn bad_inputs_are_4xx_json() {
    let limits = Limits {
        max_body_bytes: 8192,
        max_images_per_request: 2,
        max_image_pixels: 64 * 64,
        ..Limits::default()
    };
    let (app, engine) = app(ServerConfig {
        limits,
        ..ServerConfig::default()
    });
    let small = url(&png(8, 8, 0));
    let cases = [
        (
            json!({"images": [small, small, small]}),
            StatusCode::BAD_REQUEST,
            "too_many_images",
        ),
        (
            json!({"images": [url(&png(65, 64, 0))]}),
            StatusCode::BAD_REQUEST,
            "image_too_large",
        ),
        (
            json!({"images": ["data:image/png;base64,!!"]}),
            StatusCode::BAD_REQUEST,
            "invalid_base64",
        ),
        (
            json!({"images": [1]}),
            StatusCode::BAD_REQUEST,
            "invalid_type",
        ),
        (
            json!({"images": ["data:image/avif;base64,AAAA"]}),
            StatusCode::BAD_REQUEST,
            "unknown_image_format",
        ),
        (
            json!({"images": ["data:image/png,abc"]}),
            StatusCode::NOT_IMPLEMENTED,
            "unsupported_image_url",
        ),
        (
            json!({"images": [format!("data:image/png;base64,{}", "A".repeat(9000))]}),
            StatusCode::PAYLOAD_TOO_LARGE,
            "body_too_large",
        ),
    ];
    for (body, status, code) in cases {
        let (got, v) = call_json(&app, Method::POST, "/v1/encode", Some(body)).await;
        assert_eq!(got, status, "{v}");
        assert_error_shape(&v, code);
    }
    let req = Request::post("/v1/encode")
        .body(Body::from("{\"images\": ["))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), 400);
    // Nothing reached the engine: no memory is left behind by refused requests.
    assert_eq!(
        engine.metrics_snapshot().memory.allocator_allocated_bytes,
        WEIGHTS_BYTES
    );
}

#[tokio::test]
async fn unknown_routes_and_methods_are_json() {
    let (app, _) = app(ServerConfig::default());
    let (status, v) = call_json(&app, Method::GET, "/nope", None).await;
    assert_eq!(status, 404);
    assert_error_shape(&v, "not_found");
    let (status, v) = call_json(&app, Method::GET, "/v1/encode", None).await;
    assert_eq!(status, 405);
    assert_error_shape(&v, "method_not_allowed");
}

#[tokio::test]
async fn api_key_guards_everything_but_health() {
    let (app, _) = app(ServerConfig {
        api_key: Some("s3cret".into()),
        ..ServerConfig::default()
    });
    let (status, _) = call(&app, Method::GET, "/health", None, None).await;
    assert_eq!(status, 200);
    for (method, path) in [
        (Method::GET, "/is_sleeping"),
        (Method::POST, "/reset_all"),
        (Method::GET, "/metrics"),
        (Method::POST, "/v1/encode"),
    ] {
        let (status, text) = call(&app, method.clone(), path, None, None).await;
        assert_eq!(status, 401, "{path}");
        assert_error_shape(&serde_json::from_str(&text).unwrap(), "invalid_api_key");
        let (status, _) = call(&app, method.clone(), path, None, Some("s3cre")).await;
        assert_eq!(status, 401, "{path} with a wrong key");
    }
    let (status, text) = call(&app, Method::GET, "/is_sleeping", None, Some("s3cret")).await;
    assert_eq!(status, 200, "{text}");
    // The scheme is case-insensitive (RFC 9110; vLLM compares `scheme.lower()`).
    let with_authorization = |value: &str| {
        Request::get("/is_sleeping")
            .header("authorization", value)
            .body(Body::empty())
            .unwrap()
    };
    for (value, want) in [
        ("bearer s3cret", 200),
        ("BEARER s3cret", 200),
        ("beArer  s3cret", 200),
        ("Basic s3cret", 401),
        ("Bearers3cret", 401),
        ("bearer s3cre", 401),
        ("s3cret", 401),
    ] {
        let resp = app
            .clone()
            .oneshot(with_authorization(value))
            .await
            .unwrap();
        assert_eq!(resp.status(), want, "{value}");
    }
}

#[tokio::test]
async fn encode_decodes_image_data_urls_of_any_media_type_by_their_bytes() {
    let (app, _) = app(ServerConfig::default());
    let payload = STANDARD.encode(png(28, 28, 7));
    for media_type in ["application/octet-stream", "image/x-png", "image/avif", ""] {
        let body = json!({"images": [format!("data:{media_type};base64,{payload}")]});
        let (status, v) = call_json(&app, Method::POST, "/v1/encode", Some(body)).await;
        assert_eq!(status, 200, "{media_type:?}: {v}");
        assert_eq!(v["images"][0]["num_tokens"], 1, "{media_type:?}: {v}");
    }
}

#[tokio::test]
async fn resets_report_what_they_released() {
    let (app, engine) = app(ServerConfig::default());
    let body = json!({"images": [url(&png(280, 280, 9))]});
    assert_eq!(
        call_json(&app, Method::POST, "/v1/encode", Some(body))
            .await
            .0,
        200
    );
    let (_, v) = call_json(&app, Method::POST, "/reset_mm_cache", None).await;
    assert!(v["processor_cache_bytes"].as_u64().unwrap() > 0);
    assert_eq!(v["encoder_cache_bytes"], 0);
    let (_, v) = call_json(&app, Method::POST, "/reset_encoder_cache", None).await;
    assert_eq!(v["encoder_cache_bytes"], 100 * HIDDEN * 4);
    assert_eq!(v["encoder_cache_entries"], 1);
    let (_, v) = call_json(&app, Method::POST, "/reset_allocator", None).await;
    assert_eq!(v["allocator_bytes"], 1 << 20);
    assert_eq!(v["released_bytes"], 1 << 20);
    let (_, v) = call_json(&app, Method::POST, "/reset_all", None).await;
    assert_eq!(v["released_bytes"], 0);
    let m = engine.metrics_snapshot();
    // Everything but the peak is back at the post-start figures.
    assert_eq!(
        MemoryGauges {
            allocator_peak_bytes: 0,
            ..m.memory
        },
        MemoryGauges {
            allocator_peak_bytes: 0,
            ..m.after_start
        }
    );
}

#[tokio::test]
async fn sleep_and_wake_up() {
    let (app, _) = app(ServerConfig::default());
    for bad in ["/sleep?level=3", "/sleep?level=", "/sleep?level=one"] {
        let (status, v) = call_json(&app, Method::POST, bad, None).await;
        assert_eq!(status, 400, "{bad}");
        assert_error_shape(&v, "invalid_sleep_level");
    }
    let (status, v) = call_json(&app, Method::POST, "/sleep?level=2", None).await;
    assert_eq!(status, 200, "{v}");
    assert_eq!(v["level"], 2);
    assert_eq!(
        call_json(&app, Method::GET, "/is_sleeping", None).await.1,
        json!({"is_sleeping": true})
    );
    let body = json!({"images": [url(&png(8, 8, 1))]});
    let (status, v) = call_json(&app, Method::POST, "/v1/encode", Some(body.clone())).await;
    assert_eq!(status, 503);
    assert_error_shape(&v, "engine_sleeping");
    let (status, v) = call_json(&app, Method::POST, "/wake_up", None).await;
    assert_eq!((status, v), (StatusCode::OK, json!({"is_sleeping": false})));
    assert_eq!(
        call_json(&app, Method::POST, "/v1/encode", Some(body))
            .await
            .0,
        200
    );
    assert_eq!(
        call_json(&app, Method::POST, "/sleep", None).await.1["level"],
        1
    );
}

#[tokio::test]
async fn memory_and_server_info() {
    let (app, _) = app(ServerConfig::default());
    let (status, v) = call_json(&app, Method::GET, "/memory", None).await;
    assert_eq!(status, 200);
    assert!(v["device"]["used_bytes"].as_u64().is_some(), "{v}");
    let snapshot: MetricsSnapshot = serde_json::from_value(v["metrics"].clone()).unwrap();
    assert_eq!(snapshot.after_start.allocator_reserved_bytes, WEIGHTS_BYTES);
    assert_eq!(
        call_json(&app, Method::GET, "/server_info", None).await.1["model"],
        "fake"
    );
}

#[tokio::test]
async fn made_up_methods_share_one_metrics_label() {
    let (app, _) = app(ServerConfig::default());
    for i in 0..3 {
        let method = Method::from_bytes(format!("M{i}").as_bytes()).unwrap();
        call(&app, method, "/health", None, None).await;
    }
    let (_, text) = call(&app, Method::GET, "/metrics", None, None).await;
    let series: Vec<&str> = text
        .lines()
        .filter(|l| l.starts_with("iris_http_requests_total{") && l.contains("/health"))
        .collect();
    assert_eq!(series.len(), 1, "{series:?}");
    assert!(series[0].contains("method=\"other\""), "{series:?}");
    assert!(series[0].ends_with(" 3"), "{series:?}");
}

#[tokio::test]
async fn metrics_exposes_requests_latency_images_caches_and_memory() {
    let (app, _) = app(ServerConfig::default());
    let body = json!({"images": [url(&png(28, 28, 4)), url(&png(28, 28, 4))]});
    call_json(&app, Method::POST, "/v1/encode", Some(body)).await;
    call_json(
        &app,
        Method::POST,
        "/v1/encode",
        Some(json!({"images": []})),
    )
    .await;
    let (status, text) = call(&app, Method::GET, "/metrics", None, None).await;
    assert_eq!(status, 200);
    for line in [
        "iris_http_requests_total{method=\"POST\",route=\"/v1/encode\",status=\"200\"} 1",
        "iris_http_requests_total{method=\"POST\",route=\"/v1/encode\",status=\"400\"} 1",
        "iris_images_total{cached=\"true\"} 1",
        "iris_images_total{cached=\"false\"} 1",
        "iris_http_request_duration_seconds_count{route=\"/v1/encode\"} 2",
    ] {
        assert!(text.contains(line), "missing {line:?} in\n{text}");
    }
    assert_eq!(
        metrics::sample_value(&text, "iris_encoder_cache_hits_total"),
        Some(1.0)
    );
    assert_eq!(
        metrics::sample_value(&text, "iris_encoder_cache_misses_total"),
        Some(1.0)
    );
    assert_eq!(
        metrics::sample_value(&text, "iris_processor_cache_hits_total"),
        Some(1.0)
    );
    assert_eq!(
        metrics::sample_value(&text, "iris_encoder_cache_entries"),
        Some(1.0)
    );
    assert!(metrics::sample_value(&text, "iris_device_used_bytes").unwrap() > 0.0);
    // The fault counters are exposed from the start, at zero on a healthy run.
    for counter in [
        "iris_encoder_cache_reencodes_total",
        "iris_oom_recoveries_total",
        "iris_oom_failures_total",
        "iris_device_faults_total",
    ] {
        assert_eq!(
            metrics::sample_value(&text, counter),
            Some(0.0),
            "{counter}"
        );
    }
    // Scraping twice must not double the engine's cumulative counters.
    let (_, again) = call(&app, Method::GET, "/metrics", None, None).await;
    assert_eq!(
        metrics::sample_value(&again, "iris_encoder_cache_hits_total"),
        Some(1.0)
    );
}

#[tokio::test]
async fn serve_args_bind_and_serve() {
    use clap::Parser;
    #[derive(Parser)]
    struct Cmd {
        #[command(flatten)]
        serve: ServeArgs,
    }
    let args = Cmd::try_parse_from([
        "serve",
        "--port",
        "0",
        "--max-images-per-request",
        "3",
        "--api-key",
        "",
    ])
    .unwrap()
    .serve;
    assert_eq!(args.host, "127.0.0.1");
    let config = args.server_config(None).unwrap();
    assert_eq!(config.limits.max_images_per_request, 3);
    assert_eq!(
        config.limits.max_body_bytes,
        request::DEFAULT_MAX_BODY_BYTES
    );
    assert_eq!(config.api_key, None, "an empty key means no key");
    assert_eq!(
        config.body_read_timeout,
        Duration::from_secs(DEFAULT_BODY_READ_TIMEOUT_S)
    );
    let short = Cmd::try_parse_from(["serve", "--body-read-timeout", "5"])
        .unwrap()
        .serve;
    assert_eq!(
        short.server_config(None).unwrap().body_read_timeout,
        Duration::from_secs(5)
    );
    assert!(
        args.empty_api_key_warning()
            .is_some_and(|w| w.contains("no route requires one")),
        "and start-up says so"
    );
    let with_key = |key: &str| {
        Cmd::try_parse_from(["serve", "--api-key", key])
            .unwrap()
            .serve
    };
    let blank = with_key("  ");
    assert_eq!(blank.server_config(None).unwrap().api_key, None);
    assert!(blank.empty_api_key_warning().is_some());
    let set = with_key("secret");
    assert_eq!(
        set.server_config(None).unwrap().api_key.as_deref(),
        Some("secret")
    );
    assert_eq!(set.empty_api_key_warning(), None);
    let listener = args.bind().await.unwrap();
    let addr = listener.local_addr().unwrap();
    assert!(addr.ip().is_loopback());
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let app = router(Arc::new(FakeEngine::new(false)), config).unwrap();
    let server = tokio::spawn(serve(listener, app, async move {
        let _ = rx.await;
    }));
    let client = hyper_util::client::legacy::Client::builder(hyper_util::rt::TokioExecutor::new())
        .build_http::<http_body_util::Full<axum::body::Bytes>>();
    let resp = client
        .get(format!("http://{addr}/health").parse().unwrap())
        .await
        .unwrap();
    assert_eq!(resp.status(), 200);
    let body = resp.into_body().collect().await.unwrap().to_bytes();
    assert_eq!(
        serde_json::from_slice::<Value>(&body).unwrap(),
        json!({"status": "ok"})
    );
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}

#[tokio::test]
async fn a_slow_memory_snapshot_does_not_hold_health_checks() {
    // One async thread (tokio's test runtime): a snapshot run on it held everything else.
    let (app, engine) = app(ServerConfig::default());
    engine.set_snapshot_delay(Duration::from_millis(1500));
    for path in ["/metrics", "/memory"] {
        let slow = {
            let app = app.clone();
            tokio::spawn(async move { call(&app, Method::GET, path, None, None).await })
        };
        let started = std::time::Instant::now();
        // Let the slow request start.
        tokio::task::yield_now().await;
        let (status, _) = call(&app, Method::GET, "/health", None, None).await;
        assert_eq!(status, 200);
        assert!(
            started.elapsed() < Duration::from_millis(1000),
            "/health waited {:?} behind {path}",
            started.elapsed()
        );
        assert_eq!(slow.await.unwrap().0, 200);
    }
}

#[tokio::test]
async fn the_drain_after_shutdown_is_bounded() {
    use tokio::io::AsyncWriteExt as _;
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let app = router(Arc::new(FakeEngine::new(false)), ServerConfig::default()).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve_draining(
        listener,
        app,
        async move {
            let _ = rx.await;
        },
        Duration::from_millis(300),
    ));
    // A client that stops sending its body: its request never finishes.
    let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
    client
        .write_all(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"im")
        .await
        .unwrap();
    tokio::time::sleep(Duration::from_millis(100)).await;
    tx.send(()).unwrap();
    let stopped = tokio::time::timeout(Duration::from_secs(10), server).await;
    assert!(
        stopped.is_ok(),
        "the server waited on the stalled request past its drain"
    );
    stopped.unwrap().unwrap().unwrap();
    drop(client);
}

#[tokio::test]
async fn overloaded_encodes_get_503_with_retry_after_and_recover() {
    let (app, engine) = app(ServerConfig::default());
    let body = json!({"images": [url(&png(28, 28, 3))]});
    engine.set_overloaded(true);
    let req = Request::builder()
        .method(Method::POST)
        .uri("/v1/encode")
        .body(Body::from(body.to_string()))
        .unwrap();
    let resp = app.clone().oneshot(req).await.unwrap();
    assert_eq!(resp.status(), StatusCode::SERVICE_UNAVAILABLE);
    assert_eq!(
        resp.headers()
            .get(header::RETRY_AFTER)
            .map(|v| v.as_bytes()),
        Some(&b"1"[..])
    );
    let bytes = resp.into_body().collect().await.unwrap().to_bytes();
    assert_error_shape(&serde_json::from_slice(&bytes).unwrap(), "overloaded");
    engine.set_overloaded(false);
    let (status, v) = call_json(&app, Method::POST, "/v1/encode", Some(body)).await;
    assert_eq!(status, 200, "{v}");
}

#[tokio::test]
async fn a_dead_engine_turns_health_and_every_route_503() {
    let (app, engine) = app(ServerConfig::default());
    let (status, _) = call(&app, Method::GET, "/health", None, None).await;
    assert_eq!(status, 200);
    engine.kill();
    for (method, path) in [
        (Method::GET, "/health"),
        (Method::POST, "/v1/encode"),
        (Method::POST, "/reset_mm_cache"),
        (Method::POST, "/reset_encoder_cache"),
        (Method::POST, "/reset_allocator"),
        (Method::POST, "/reset_all"),
        (Method::POST, "/sleep"),
        (Method::POST, "/wake_up"),
        (Method::GET, "/is_sleeping"),
        (Method::GET, "/server_info"),
        (Method::GET, "/memory"),
        (Method::GET, "/metrics"),
    ] {
        let (status, v) = call_json(&app, method.clone(), path, None).await;
        assert_eq!(status, 503, "{method} {path}: {v}");
        assert_error_shape(&v, "engine_dead");
    }
}

/// Sends `request` on a new connection and returns everything the server answers until it
/// closes the connection.
async fn exchange(addr: std::net::SocketAddr, request: &str) -> String {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
    client.write_all(request.as_bytes()).await.unwrap();
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut answer))
        .await
        .expect("no answer within 10 s")
        .unwrap();
    String::from_utf8_lossy(&answer).into_owned()
}

#[tokio::test]
async fn a_stalled_body_times_out_with_408_and_gives_its_slot_back() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    let engine = Arc::new(FakeEngine::new(false));
    // As `--max-queued-requests 2`.
    engine.set_max_admitted(2);
    let config = ServerConfig {
        body_read_timeout: Duration::from_millis(500),
        ..ServerConfig::default()
    };
    let app = router(Arc::clone(&engine), config).unwrap();
    let (tx, rx) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(serve(listener, app, async move {
        let _ = rx.await;
    }));
    // Two clients send their headers and part of their body, then stop.
    let mut stalled = Vec::new();
    for _ in 0..2 {
        let mut client = tokio::net::TcpStream::connect(addr).await.unwrap();
        client
            .write_all(b"POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Length: 100\r\n\r\n{\"im")
            .await
            .unwrap();
        stalled.push(client);
    }
    let admitted = async {
        while engine.admitted() < 2 {
            tokio::time::sleep(Duration::from_millis(5)).await;
        }
    };
    tokio::time::timeout(Duration::from_secs(5), admitted)
        .await
        .expect("the stalled requests were not admitted");
    let body = json!({"images": [url(&png(28, 28, 5))]}).to_string();
    let request = format!(
        "POST /v1/encode HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{body}",
        body.len()
    );
    // While they hold both slots every other client is refused.
    let answer = exchange(addr, &request).await;
    assert!(answer.starts_with("HTTP/1.1 503"), "{answer}");
    // Past the timeout each gets a 408 naming it, and its connection is closed.
    for mut client in stalled {
        let mut answer = Vec::new();
        tokio::time::timeout(Duration::from_secs(10), client.read_to_end(&mut answer))
            .await
            .expect("the stalled request was never answered")
            .unwrap();
        let answer = String::from_utf8_lossy(&answer);
        assert!(answer.starts_with("HTTP/1.1 408"), "{answer}");
        assert!(
            answer.contains("\"code\":\"body_read_timeout\"")
                && answer.contains("--body-read-timeout")
                && answer.contains("0.5 s"),
            "{answer}"
        );
        assert!(
            answer.to_ascii_lowercase().contains("connection: close"),
            "{answer}"
        );
    }
    assert_eq!(engine.admitted(), 0, "the slots came back");
    let answer = exchange(addr, &request).await;
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    tx.send(()).unwrap();
    server.await.unwrap().unwrap();
}
