//! `/v1/chat/completions` and `/v1/models` against the in-memory test engine and a real store
//! in a temporary folder.

use std::path::Path;
use std::process::Command;
use std::sync::Arc;

use axum::http::{Method, StatusCode};
use serde_json::{Value, json};

use super::test_engine::{FakeEngine, HIDDEN};
use super::tests::{app, call, call_json, png, url};
use super::*;
use crate::epd::EpdArgs;

const EC_CONFIG: &str = r#"{"ec_connector": "ECExampleConnector", "ec_role": "ec_producer",
    "ec_connector_extra_config": {"shared_storage_path": "STORE"}}"#;

fn epd(store: Option<&Path>) -> Arc<Epd> {
    epd_bounded(store, None)
}

/// [`epd`] with `--ec-storage-max-bytes` set to `max_bytes`.
fn epd_bounded(store: Option<&Path>, max_bytes: Option<u64>) -> Arc<Epd> {
    let args = EpdArgs {
        ec_transfer_config: store.map(|dir| EC_CONFIG.replace("STORE", &dir.display().to_string())),
        ec_storage_max_bytes: max_bytes,
        model_id: Some("Qwen/Qwen2.5-VL-3B-Instruct".into()),
        ..EpdArgs::default()
    };
    Arc::new(args.resolve("tiny", None).unwrap())
}

fn chat_app(store: Option<&Path>, media: MediaAccess) -> (Router, Arc<FakeEngine>) {
    let engine = Arc::new(FakeEngine::new(false));
    let config = ServerConfig {
        limits: Limits {
            max_image_pixels: 512 * 512,
            ..Limits::default()
        },
        epd: Some(epd(store)),
        media,
        ..ServerConfig::default()
    };
    (router(Arc::clone(&engine), config).unwrap(), engine)
}

fn image_part(bytes: &[u8], uuid: Option<&str>) -> Value {
    let mut part = json!({"type": "image_url", "image_url": {"url": url(bytes)}});
    if let Some(uuid) = uuid {
        part["uuid"] = json!(uuid);
    }
    part
}

fn chat(parts: Vec<Value>) -> Value {
    json!({
        "model": "Qwen/Qwen2.5-VL-3B-Instruct",
        "messages": [{"role": "user", "content": parts}],
        "stream": false,
    })
}

/// The `[rows, cols]` and values of an entry written by the store (the fake engine runs in f32).
fn read_entry(path: &Path) -> ([usize; 2], Vec<f32>) {
    let bytes = std::fs::read(path).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    assert_eq!(file.names(), vec!["ec_cache"]);
    let tensor = file.tensor("ec_cache").unwrap();
    assert_eq!(tensor.dtype(), safetensors::Dtype::F32);
    let shape = [tensor.shape()[0], tensor.shape()[1]];
    let values = tensor
        .data()
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes(c.try_into().unwrap()))
        .collect();
    (shape, values)
}

fn files_under(dir: &Path) -> Vec<String> {
    let mut out = Vec::new();
    for entry in std::fs::read_dir(dir).unwrap() {
        let entry = entry.unwrap();
        out.push(entry.file_name().to_string_lossy().into_owned());
        if entry.path().is_dir() {
            for inner in std::fs::read_dir(entry.path()).unwrap() {
                out.push(format!(
                    "{}/{}",
                    entry.file_name().to_string_lossy(),
                    inner.unwrap().file_name().to_string_lossy()
                ));
            }
        }
    }
    out.sort();
    out
}

#[tokio::test]
async fn the_proxys_request_writes_vllms_files_and_answers_its_ec_transfer_params() {
    let store = tempfile::tempdir().unwrap();
    let (app, engine) = chat_app(Some(store.path()), MediaAccess::default());
    let (a, b) = (png(56, 56, 1), png(112, 56, 2));
    let body = chat(vec![
        json!({"type": "text", "text": "what is in these pictures?"}),
        image_part(&a, Some("uuid-a")),
        image_part(&b, None),
        image_part(&a, Some("uuid-a")),
    ]);
    let (status, v) = call_json(
        &app,
        Method::POST,
        "/v1/chat/completions",
        Some(body.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["object"], "chat.completion");
    assert_eq!(v["model"], "Qwen/Qwen2.5-VL-3B-Instruct");
    assert_eq!(v["choices"][0]["finish_reason"], "stop");
    let params = v["ec_transfer_params"].as_object().unwrap();
    assert_eq!(params.len(), 2, "{v}");
    assert_eq!(
        params["uuid-a"],
        json!({"modality": "image", "item_indices": [0, 2], "metadata": {"image_grid_thw": [1, 4, 4]}})
    );
    let hashed = params.keys().find(|k| *k != "uuid-a").unwrap().clone();
    assert_eq!(hashed.len(), 64, "a blake3 identifier in hex: {hashed}");
    assert_eq!(
        params[&hashed]["metadata"]["image_grid_thw"],
        json!([1, 4, 8])
    );
    assert_eq!(v["usage"]["prompt_tokens"], 4 + 8 + 4);

    // The files: one per identifier, the fake engine's rows, nothing else in the folder.
    assert_eq!(
        files_under(store.path()),
        [
            hashed.clone(),
            format!("{hashed}/encoder_cache.safetensors"),
            "uuid-a".to_owned(),
            "uuid-a/encoder_cache.safetensors".to_owned()
        ]
    );
    let (shape, values) = read_entry(&store.path().join("uuid-a/encoder_cache.safetensors"));
    assert_eq!(shape, [4, usize::try_from(HIDDEN).unwrap()]);
    assert_eq!(values[..3], [0.0, 0.5, 1.0]);
    assert_eq!(
        engine.encode_calls(),
        1,
        "one engine request for the whole chat request"
    );

    // The same request again: every item is in the store, nothing is encoded.
    let (status, again) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(again["ec_transfer_params"], v["ec_transfer_params"]);
    assert_eq!(engine.encode_calls(), 1);
    let (_, metrics) = call(&app, Method::GET, "/metrics", None, None).await;
    let value = |name: &str| super::metrics::sample_value(&metrics, name);
    assert_eq!(value("iris_ec_store_writes_total"), Some(2.0));
    assert_eq!(value("iris_ec_store_hits_total"), Some(2.0));
    assert_eq!(value("iris_ec_store_write_errors_total"), Some(0.0));
    assert!(
        metrics.contains("iris_ec_store_write_seconds_count 2"),
        "{metrics}"
    );

    let (status, models) = call_json(&app, Method::GET, "/v1/models", None).await;
    assert_eq!(status, StatusCode::OK);
    assert_eq!(models["data"][0]["id"], "Qwen/Qwen2.5-VL-3B-Instruct");
}

#[tokio::test]
async fn an_invalid_file_under_the_identifier_is_replaced_not_trusted() {
    let store = tempfile::tempdir().unwrap();
    let (app, engine) = chat_app(Some(store.path()), MediaAccess::default());
    std::fs::create_dir(store.path().join("cat")).unwrap();
    let path = store.path().join("cat/encoder_cache.safetensors");
    std::fs::write(&path, b"half a file").unwrap();
    let body = chat(vec![image_part(&png(56, 56, 3), Some("cat"))]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(engine.encode_calls(), 1);
    assert_eq!(read_entry(&path).0, [4, usize::try_from(HIDDEN).unwrap()]);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_requests_for_one_identifier_encode_once_and_write_once() {
    let store = tempfile::tempdir().unwrap();
    let (app, engine) = chat_app(Some(store.path()), MediaAccess::default());
    let image = png(84, 84, 4);
    let calls = (0..4).map(|_| {
        let app = app.clone();
        let body = chat(vec![image_part(&image, Some("shared"))]);
        tokio::spawn(async move {
            call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await
        })
    });
    for call in calls {
        let (status, v) = call.await.unwrap();
        assert_eq!(status, StatusCode::OK, "{v}");
        assert!(v["ec_transfer_params"]["shared"].is_object(), "{v}");
    }
    assert_eq!(engine.encode_calls(), 1);
    let (_, metrics) = call(&app, Method::GET, "/metrics", None, None).await;
    assert_eq!(
        super::metrics::sample_value(&metrics, "iris_ec_store_writes_total"),
        Some(1.0)
    );
}

#[tokio::test]
async fn bad_requests_are_4xx_json_and_leave_no_file() {
    let store = tempfile::tempdir().unwrap();
    let (app, _) = chat_app(Some(store.path()), MediaAccess::default());
    let good = png(56, 56, 5);
    let huge = png(600, 600, 0);
    let part = |v: Value| json!({"model": "Qwen/Qwen2.5-VL-3B-Instruct", "messages": [{"role": "user", "content": [v]}]});
    let cases: Vec<(Value, StatusCode, &str)> = vec![
        (
            part(json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,@@@"}})),
            StatusCode::BAD_REQUEST,
            "invalid_base64",
        ),
        (
            part(json!({"type": "input_audio", "input_audio": {"data": "AAAA"}})),
            StatusCode::BAD_REQUEST,
            "unsupported_modality",
        ),
        (
            part(
                json!({"type": "video_url", "video_url": {"url": "data:video/jpeg;base64,AAAA,AAAA"}}),
            ),
            StatusCode::BAD_REQUEST,
            "unknown_image_format",
        ),
        (
            part(json!({"type": "video_url", "video_url": {"url": "data:video/mp4,AAAA"}})),
            StatusCode::NOT_IMPLEMENTED,
            "unsupported_video_url",
        ),
        (
            part(json!({"video_url": {"url": "data:video/mp4;base64,"}})),
            StatusCode::BAD_REQUEST,
            "corrupt_video",
        ),
        (
            part(json!({"type": "video_url", "uuid": "u"})),
            StatusCode::BAD_REQUEST,
            "missing_video",
        ),
        (
            part(json!({"type": "image_embeds", "image_embeds": "AAAA"})),
            StatusCode::BAD_REQUEST,
            "unsupported_content_part",
        ),
        (
            json!({"model": "other", "messages": [{"role": "user", "content": [image_part(&good, None)]}]}),
            StatusCode::NOT_FOUND,
            "model_not_found",
        ),
        (
            part(
                json!({"type": "image_url", "image_url": {"url": "https://example.invalid/cat.png"}}),
            ),
            StatusCode::BAD_REQUEST,
            "remote_url_not_supported",
        ),
        (
            part(json!({"type": "image_url", "image_url": {"url": "file:///etc/passwd"}})),
            StatusCode::BAD_REQUEST,
            "local_media_disabled",
        ),
        (
            part(image_part(&huge, None)),
            StatusCode::BAD_REQUEST,
            "image_too_large",
        ),
        (
            json!({"messages": [{"role": "user", "content": [image_part(&good, None)]}], "stream": true}),
            StatusCode::BAD_REQUEST,
            "stream_not_supported",
        ),
        (
            json!({"messages": [{"role": "user", "content": [image_part(&good, None)]}], "tools": []}),
            StatusCode::BAD_REQUEST,
            "unsupported_field",
        ),
        (
            json!({"messages": [{"role": "user", "content": "just text"}]}),
            StatusCode::BAD_REQUEST,
            "no_images",
        ),
        (
            json!({"messages": [{"role": "user", "content": [image_part(&good, None)]}],
                   "mm_processor_kwargs": {"do_sample_frames": true}}),
            StatusCode::BAD_REQUEST,
            "invalid_mm_processor_kwargs",
        ),
        (
            json!({"messages": [{"role": "user", "content": [image_part(&good, None)]}],
                   "ec_transfer_params": {"consumer_zmq": "tcp://127.0.0.1:1"}}),
            StatusCode::BAD_REQUEST,
            "invalid_ec_transfer_params",
        ),
    ];
    let long = "u".repeat(256);
    let mut cases = cases;
    for uuid in ["../escape", "a/b", "..", "nul\0", long.as_str()] {
        cases.push((
            part(image_part(&good, Some(uuid))),
            StatusCode::BAD_REQUEST,
            "invalid_uuid",
        ));
    }
    for (body, status, code) in cases {
        let (got, v) = call_json(
            &app,
            Method::POST,
            "/v1/chat/completions",
            Some(body.clone()),
        )
        .await;
        assert_eq!(got, status, "{body}: {v}");
        assert_eq!(v["error"]["code"], code, "{body}: {v}");
        assert!(
            v["error"]["message"]
                .as_str()
                .is_some_and(|m| !m.is_empty())
        );
    }
    assert!(
        files_under(store.path()).is_empty(),
        "{:?}",
        files_under(store.path())
    );
    assert!(!store.path().parent().unwrap().join("escape").exists());
}

#[tokio::test]
async fn file_urls_are_read_only_under_the_allowed_folder() {
    let media_dir = tempfile::tempdir().unwrap();
    let image = png(56, 56, 6);
    std::fs::write(media_dir.path().join("cat.png"), &image).unwrap();
    let outside = tempfile::tempdir().unwrap();
    std::fs::write(outside.path().join("dog.png"), &image).unwrap();
    let media = MediaAccess {
        allowed_local_media_path: Some(media_dir.path().canonicalize().unwrap()),
        ..MediaAccess::default()
    };
    let (app, _) = chat_app(None, media);
    let file_part = |path: &Path| json!({"type": "image_url", "image_url": {"url": format!("file://{}", path.display())}});
    let (status, v) = call_json(
        &app,
        Method::POST,
        "/v1/chat/completions",
        Some(chat(vec![file_part(&media_dir.path().join("cat.png"))])),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    for path in [
        outside.path().join("dog.png"),
        media_dir
            .path()
            .join("../")
            .join(outside.path().file_name().unwrap())
            .join("dog.png"),
        media_dir.path().join("missing.png"),
    ] {
        let (status, v) = call_json(
            &app,
            Method::POST,
            "/v1/chat/completions",
            Some(chat(vec![file_part(&path)])),
        )
        .await;
        assert_eq!(status, StatusCode::FORBIDDEN, "{}: {v}", path.display());
        assert_eq!(v["error"]["code"], "local_media_forbidden");
    }
}

#[tokio::test]
async fn a_store_that_cannot_be_written_fails_the_request_naming_the_path_and_the_engine_goes_on() {
    let dir = tempfile::tempdir().unwrap();
    let store = dir.path().join("store");
    std::fs::create_dir(&store).unwrap();
    let (app, engine) = chat_app(Some(&store), MediaAccess::default());
    std::fs::remove_dir(&store).unwrap();
    let body = chat(vec![image_part(&png(56, 56, 7), Some("lost"))]);
    let (status, v) = call_json(
        &app,
        Method::POST,
        "/v1/chat/completions",
        Some(body.clone()),
    )
    .await;
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    assert_eq!(v["error"]["code"], "ec_store_error");
    let message = v["error"]["message"].as_str().unwrap();
    assert!(
        message.contains(&store.join("lost").display().to_string()),
        "{message}"
    );
    assert!(!store.exists());
    let (status, _) = call(&app, Method::GET, "/health", None, None).await;
    assert_eq!(status, StatusCode::OK);
    // The folder back, the same request succeeds.
    std::fs::create_dir(&store).unwrap();
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(store.join("lost/encoder_cache.safetensors").is_file());
    let (_, metrics) = call(&app, Method::GET, "/metrics", None, None).await;
    assert_eq!(
        super::metrics::sample_value(&metrics, "iris_ec_store_write_errors_total"),
        Some(1.0)
    );
    assert_eq!(engine.encode_calls(), 2);
}

#[tokio::test]
async fn a_full_file_system_fails_the_request_and_leaves_nothing_partial() {
    let dir = tempfile::tempdir().unwrap();
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=4k", "tmpfs"])
        .arg(dir.path())
        .stderr(std::process::Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if !mounted {
        eprintln!("skipped: cannot mount a small tmpfs here (needs root or CAP_SYS_ADMIN)");
        return;
    }
    let (app, _) = chat_app(Some(dir.path()), MediaAccess::default());
    // 448x448 on the fake engine: 256 tokens x 8 x 4 bytes = 8 KiB, over the 4 KiB file system.
    let body = chat(vec![image_part(&png(448, 448, 8), Some("big"))]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    let listing = files_under(dir.path());
    let _ = Command::new("umount").arg(dir.path()).status();
    assert_eq!(status, StatusCode::INTERNAL_SERVER_ERROR, "{v}");
    let message = v["error"]["message"].as_str().unwrap().to_lowercase();
    assert!(message.contains("space"), "{message}");
    assert!(listing.is_empty(), "{listing:?}");
}

#[tokio::test]
async fn without_a_store_the_endpoint_encodes_and_publishes_nothing() {
    let (app, engine) = chat_app(None, MediaAccess::default());
    let body = chat(vec![image_part(&png(56, 56, 9), None)]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(v["ec_transfer_params"].as_object().unwrap().len(), 1);
    assert_eq!(engine.encode_calls(), 1);
}

/// Serves each accepted connection `body` with status `status` (one response each), on
/// loopback; returns the port.
fn serve_http(status: &'static str, body: Vec<u8>, connections: usize) -> u16 {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    std::thread::spawn(move || {
        for stream in listener.incoming().take(connections) {
            let Ok(mut stream) = stream else { continue };
            let mut request = [0u8; 4096];
            let _ = stream.read(&mut request);
            let head = format!(
                "HTTP/1.1 {status}\r\ncontent-type: image/png\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                body.len()
            );
            let _ = stream.write_all(head.as_bytes());
            let _ = stream.write_all(&body);
        }
    });
    port
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn http_urls_are_fetched_only_from_allowed_hosts_within_the_limits() {
    let image = png(56, 56, 10);
    let port = serve_http("200 OK", image.clone(), 1);
    let media = MediaAccess {
        allowed_media_domains: vec!["127.0.0.1".to_owned()],
        fetch_timeout: std::time::Duration::from_secs(1),
        ..MediaAccess::default()
    };
    let (app, engine) = chat_app(None, media);
    let part = |url: String| json!({"type": "image_url", "image_url": {"url": url}});
    let (status, v) = call_json(
        &app,
        Method::POST,
        "/v1/chat/completions",
        Some(chat(vec![part(format!("http://127.0.0.1:{port}/cat.png"))])),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(engine.encode_calls(), 1);

    let moved = serve_http("302 Found", Vec::new(), 1);
    let silent = {
        // Accepts and never answers: the fetch must give up at its time limit.
        let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
        let port = listener.local_addr().unwrap().port();
        std::thread::spawn(move || {
            let held: Vec<_> = listener.incoming().take(1).collect();
            std::thread::sleep(std::time::Duration::from_secs(4));
            drop(held);
        });
        port
    };
    let cases = [
        (
            format!("http://localhost:{port}/cat.png"),
            StatusCode::FORBIDDEN,
            "remote_url_forbidden",
        ),
        (
            format!("http://127.0.0.1:{moved}/cat.png"),
            StatusCode::BAD_REQUEST,
            "remote_fetch_failed",
        ),
        (
            format!("http://127.0.0.1:{silent}/cat.png"),
            StatusCode::BAD_REQUEST,
            "remote_fetch_failed",
        ),
    ];
    for (url, want, code) in cases {
        let (status, v) = call_json(
            &app,
            Method::POST,
            "/v1/chat/completions",
            Some(chat(vec![part(url.clone())])),
        )
        .await;
        assert_eq!(status, want, "{url}: {v}");
        assert_eq!(v["error"]["code"], code, "{url}: {v}");
    }
    assert_eq!(engine.encode_calls(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_remote_image_over_the_body_limit_is_refused() {
    let port = serve_http("200 OK", vec![0u8; 4096], 1);
    let engine = Arc::new(FakeEngine::new(false));
    let config = ServerConfig {
        limits: Limits {
            max_body_bytes: 1024,
            ..Limits::default()
        },
        epd: Some(epd(None)),
        media: MediaAccess {
            allowed_media_domains: vec!["127.0.0.1".to_owned()],
            ..MediaAccess::default()
        },
        ..ServerConfig::default()
    };
    let app = router(engine, config).unwrap();
    let body = chat(vec![json!({"type": "image_url",
        "image_url": {"url": format!("http://127.0.0.1:{port}/big.png")}})]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "image_too_large", "{v}");
}

#[tokio::test]
async fn a_frame_lists_tokens_are_charged_before_its_frames_are_decoded() {
    use base64::Engine as _;
    let (app, engine) = chat_app(None, MediaAccess::default());
    let first = base64::engine::general_purpose::STANDARD.encode(png(56, 42, 5));
    // An image, then a frame list whose first frame is good and whose others are not images.
    let list = format!("data:video/jpeg;base64,{first},AAAA,AAAA");
    let body = chat(vec![
        image_part(&png(28, 28, 1), None),
        json!({"type": "video_url", "video_url": {"url": list}}),
    ]);
    engine.set_refuse_videos(true);
    let (status, reply) = call(
        &app,
        Method::POST,
        "/v1/chat/completions",
        Some(body.clone()),
        None,
    )
    .await;
    // Refused from the first frame's header and the count: no frame was decoded.
    assert_eq!(status, StatusCode::SERVICE_UNAVAILABLE, "{reply}");
    assert!(reply.contains("overloaded"), "{reply}");
    let size = iris_core::preprocess::ImageSize::new(56, 42);
    assert_eq!(engine.reservations(), [(1, 3, size)]);
    engine.set_refuse_videos(false);
    let (status, reply) = call(&app, Method::POST, "/v1/chat/completions", Some(body), None).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{reply}");
    assert!(reply.contains("frame 1"), "{reply}");
    assert_eq!(engine.encode_calls(), 0);
}

#[tokio::test]
async fn image_data_urls_of_any_media_type_are_decoded_by_their_bytes() {
    use base64::Engine as _;
    let (app, engine) = chat_app(None, MediaAccess::default());
    let image = png(56, 56, 10);
    let payload = base64::engine::general_purpose::STANDARD.encode(&image);
    // vLLM's `ImageMediaIO.load_base64` ignores the declared type; the bytes decide.
    for media_type in ["application/octet-stream", "image/x-png", "image/avif", ""] {
        let url = format!("data:{media_type};base64,{payload}");
        let body = chat(vec![
            json!({"type": "image_url", "image_url": {"url": url}}),
        ]);
        let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, StatusCode::OK, "{media_type:?}: {v}");
        assert_eq!(v["usage"]["prompt_tokens"], 4, "{media_type:?}: {v}");
    }
    // Bytes that are not an image still get the decoder's error, whatever the type says.
    let url = "data:image/png;base64,aGVsbG8gd29ybGQ=";
    let body = chat(vec![
        json!({"type": "image_url", "image_url": {"url": url}}),
    ]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "unknown_image_format", "{v}");
    assert!(engine.encode_calls() >= 1);
}

#[tokio::test]
async fn urls_chat_cannot_read_are_answered_alike_for_images_and_videos() {
    // A data URL that is not base64 is a 501 (vLLM's NotImplementedError) for both media; a
    // URL of another scheme is told the schemes chat reads.
    let (app, _) = chat_app(None, MediaAccess::default());
    let image = |url: &str| json!({"type": "image_url", "image_url": {"url": url}});
    let video = |url: &str| json!({"type": "video_url", "video_url": {"url": url}});
    let not_implemented = (StatusCode::NOT_IMPLEMENTED, "not_implemented_error");
    let bad_request = (StatusCode::BAD_REQUEST, "invalid_request_error");
    let schemes = "must be an http(s), data or file URL";
    for (part, (status, kind), code, says) in [
        (
            image("data:image/png,abc"),
            not_implemented,
            "unsupported_image_url",
            "base64",
        ),
        (
            video("data:video/mp4,abc"),
            not_implemented,
            "unsupported_video_url",
            "base64",
        ),
        (
            image("ftp://example.invalid/cat.png"),
            bad_request,
            "invalid_image_url",
            schemes,
        ),
        (
            video("ftp://example.invalid/cat.mp4"),
            bad_request,
            "invalid_video_url",
            schemes,
        ),
    ] {
        let (got, v) = call_json(
            &app,
            Method::POST,
            "/v1/chat/completions",
            Some(chat(vec![part.clone()])),
        )
        .await;
        assert_eq!(got, status, "{part}: {v}");
        assert_eq!(v["error"]["code"], code, "{part}: {v}");
        assert_eq!(v["error"]["type"], kind, "{part}: {v}");
        let message = v["error"]["message"].as_str().unwrap_or_default();
        assert!(message.contains(says), "{part}: {v}");
        if says == schemes {
            assert!(message.contains("\"ftp\""), "{part}: {v}");
        }
    }
}

#[tokio::test]
async fn the_media_item_limit_counts_videos_and_says_so() {
    let (app, _) = app(ServerConfig {
        limits: Limits {
            max_images_per_request: 2,
            ..Limits::default()
        },
        epd: Some(epd(None)),
        ..ServerConfig::default()
    });
    let video = json!({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAA"}});
    let body = chat(vec![video.clone(), video.clone(), video]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "too_many_images", "{v}");
    let message = v["error"]["message"].as_str().unwrap_or_default();
    assert!(
        message.contains("3 media items (images and videos)") && !message.contains("3 images"),
        "{v}"
    );
}

#[tokio::test]
async fn the_per_prompt_limits_are_checked_before_any_media_is_read() {
    // Videos off (`--limit-mm-per-prompt '{"image": 1, "video": 0}'`): a clip is refused by
    // its count, not probed or decoded first (these bytes are no clip at all, and the file
    // does not exist), as vLLM counts a prompt's items while it parses the message.
    let dir = tempfile::tempdir().unwrap();
    let (app, engine) = app(ServerConfig {
        limits: Limits {
            mm_per_prompt: iris_core::budget::MmLimits { image: 1, video: 0 },
            ..Limits::default()
        },
        epd: Some(epd(None)),
        media: MediaAccess {
            allowed_local_media_path: Some(dir.path().canonicalize().unwrap()),
            ..MediaAccess::default()
        },
        ..ServerConfig::default()
    });
    let missing = format!("file://{}/missing.mp4", dir.path().display());
    for video in [
        json!({"type": "video_url", "video_url": {"url": "data:video/mp4;base64,AAAAAAAA"}}),
        json!({"type": "video_url", "video_url": {"url": missing}}),
    ] {
        let body = chat(vec![image_part(&png(56, 56, 1), None), video.clone()]);
        let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, StatusCode::BAD_REQUEST, "{video}: {v}");
        assert_eq!(v["error"]["code"], "mm_limit_exceeded", "{video}: {v}");
        let message = v["error"]["message"].as_str().unwrap();
        assert!(
            message.contains("at most 0 video(s)") && message.contains("--limit-mm-per-prompt"),
            "{message}"
        );
    }
    // Two images: the image limit, before the second (not an image at all) is read.
    let body = chat(vec![
        image_part(&png(56, 56, 1), None),
        json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}),
    ]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "mm_limit_exceeded", "{v}");
    // `/v1/encode` counts first too.
    let (status, v) = call_json(
        &app,
        Method::POST,
        "/v1/encode",
        Some(json!({"videos": ["data:video/mp4;base64,AAAAAAAA"]})),
    )
    .await;
    assert_eq!(status, StatusCode::BAD_REQUEST, "{v}");
    assert_eq!(v["error"]["code"], "mm_limit_exceeded", "{v}");
    assert_eq!(engine.encode_calls(), 0);
}

#[tokio::test]
async fn a_bounded_store_keeps_every_entry_a_reply_names() {
    // Two new images whose entries together exceed `--ec-storage-max-bytes`: writing the
    // second evicted the first, and the reply named an entry that was gone.
    let entry_bytes = {
        let dir = tempfile::tempdir().unwrap();
        let (app, _) = chat_app(Some(dir.path()), MediaAccess::default());
        let body = chat(vec![image_part(&png(56, 56, 1), Some("probe"))]);
        let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
        assert_eq!(status, StatusCode::OK, "{v}");
        std::fs::metadata(dir.path().join("probe/encoder_cache.safetensors"))
            .unwrap()
            .len()
    };
    let dir = tempfile::tempdir().unwrap();
    let (app, _) = app(ServerConfig {
        epd: Some(epd_bounded(Some(dir.path()), Some(entry_bytes * 3 / 2))),
        ..ServerConfig::default()
    });
    let exists = |id: &str| {
        dir.path()
            .join(id)
            .join("encoder_cache.safetensors")
            .is_file()
    };
    let body = chat(vec![
        image_part(&png(56, 56, 1), Some("a")),
        image_part(&png(56, 56, 2), Some("b")),
    ]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    for id in ["a", "b"] {
        assert!(v["ec_transfer_params"].get(id).is_some(), "{v}");
        assert!(exists(id), "the reply names {id}, whose entry is gone");
    }
    // The next request's write brings the store back under its bound.
    let body = chat(vec![image_part(&png(56, 56, 3), Some("c"))]);
    let (status, v) = call_json(&app, Method::POST, "/v1/chat/completions", Some(body)).await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert!(!exists("a") && !exists("b") && exists("c"));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn remote_images_of_one_request_are_fetched_side_by_side() {
    use std::io::{Read, Write};
    use std::sync::atomic::{AtomicUsize, Ordering};
    // Each connection is answered once four are open at once (or after 3 s): fetched one after
    // the other, the four never overlap.
    let image = png(56, 56, 11);
    let listener = std::net::TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let open = Arc::new(AtomicUsize::new(0));
    let most = Arc::new(AtomicUsize::new(0));
    {
        let (open, most) = (Arc::clone(&open), Arc::clone(&most));
        std::thread::spawn(move || {
            for stream in listener.incoming().take(4) {
                let Ok(mut stream) = stream else { continue };
                let (open, most, image) = (Arc::clone(&open), Arc::clone(&most), image.clone());
                std::thread::spawn(move || {
                    let mut request = [0u8; 4096];
                    let _ = stream.read(&mut request);
                    let now = open.fetch_add(1, Ordering::SeqCst) + 1;
                    most.fetch_max(now, Ordering::SeqCst);
                    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(3);
                    while open.load(Ordering::SeqCst) < 4 && std::time::Instant::now() < deadline {
                        std::thread::sleep(std::time::Duration::from_millis(10));
                    }
                    let head = format!(
                        "HTTP/1.1 200 OK\r\ncontent-type: image/png\r\ncontent-length: {}\r\nconnection: close\r\n\r\n",
                        image.len()
                    );
                    let _ = stream.write_all(head.as_bytes());
                    let _ = stream.write_all(&image);
                    let _ = stream.flush();
                    std::thread::sleep(std::time::Duration::from_millis(100));
                    open.fetch_sub(1, Ordering::SeqCst);
                });
            }
        });
    }
    let media = MediaAccess {
        allowed_media_domains: vec!["127.0.0.1".to_owned()],
        fetch_timeout: std::time::Duration::from_secs(10),
        ..MediaAccess::default()
    };
    let (app, engine) = chat_app(None, media);
    let parts = (0..4)
        .map(|i| json!({"type": "image_url", "image_url": {"url": format!("http://127.0.0.1:{port}/{i}.png")}}))
        .collect();
    let (status, v) = call_json(
        &app,
        Method::POST,
        "/v1/chat/completions",
        Some(chat(parts)),
    )
    .await;
    assert_eq!(status, StatusCode::OK, "{v}");
    assert_eq!(engine.encode_calls(), 1);
    assert_eq!(
        most.load(Ordering::SeqCst),
        4,
        "the four fetches did not overlap"
    );
}
