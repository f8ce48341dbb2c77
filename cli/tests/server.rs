//! `iris serve` end to end: the real binary on loopback with the `tiny` model (dummy weights) on
//! the built-in CPU device, driven over HTTP. Each test starts its own server in a fresh folder
//! and checks what a client sees: encode results and embeddings, resets measured against the
//! start-up baselines, sleep and wake-up, the API key, bad inputs answered with 4xx JSON errors
//! and nothing left behind, and concurrent clients with a reset in the middle.

use std::io::Cursor;
use std::path::PathBuf;
use std::process::Child;
use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, header};
use hyper_util::client::legacy::Client;
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

mod common;

/// No single request of these tests comes near this; a hung server fails the test instead.
const REQUEST_TIMEOUT: Duration = Duration::from_secs(60);
/// The tiny model's encoder output width.
const HIDDEN: u64 = 64;

/// One running `iris serve`; dropping it kills the process and removes its folder.
struct Server {
    child: Child,
    dir: PathBuf,
    base: String,
    /// Sent as `Authorization: Bearer` by the request helpers.
    api_key: Option<String>,
    client: Client<HttpConnector, Full<Bytes>>,
}

/// A response: status and body, with the body parsed as JSON when it is JSON (else `Null`).
#[derive(Debug)]
struct Reply {
    status: u16,
    text: String,
    json: Value,
    /// The `Retry-After` header, when sent.
    retry_after: Option<String>,
}

impl Reply {
    /// Panics with the body unless the status is `want`.
    fn expect(self, want: u16, what: &str) -> Value {
        assert_eq!(self.status, want, "{what}: {}", self.text);
        self.json
    }
}

impl Server {
    /// Starts `iris serve --port 0` with the tiny model and `extra` flags, and waits for its
    /// `listening on` line.
    fn start(name: &str, extra: &[&str]) -> Server {
        Server::start_env(name, extra, &[])
    }

    /// [`Server::start`] with environment variables set for the server.
    fn start_env(name: &str, extra: &[&str], env: &[(&str, &str)]) -> Server {
        let dir = std::env::temp_dir().join(format!("iris-server-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).expect("temp folder");
        let stderr_path = dir.join("stderr.txt");
        let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
        let (child, base) =
            common::spawn_serve(&dir, extra, env, stderr.into()).unwrap_or_else(|err| {
                panic!(
                    "{err}; stderr:\n{}",
                    std::fs::read_to_string(&stderr_path).unwrap_or_default()
                )
            });
        assert!(
            base.starts_with("http://127.0.0.1:"),
            "listens on loopback: {base}"
        );
        let client = Client::builder(TokioExecutor::new()).build_http();
        Server {
            child,
            dir,
            base,
            api_key: None,
            client,
        }
    }

    /// One request with an explicit key (`None`: no `Authorization` header).
    async fn request_with_key(
        &self,
        method: Method,
        path: &str,
        body: Vec<u8>,
        key: Option<&str>,
    ) -> Reply {
        let mut builder = Request::builder()
            .method(method.clone())
            .uri(format!("{}{path}", self.base));
        if !body.is_empty() {
            builder = builder.header(header::CONTENT_TYPE, "application/json");
        }
        if let Some(key) = key {
            builder = builder.header(header::AUTHORIZATION, format!("Bearer {key}"));
        }
        let request = builder
            .body(Full::new(Bytes::from(body)))
            .expect("request builds");
        let exchange = async {
            let response = self.client.request(request).await?;
            let status = response.status().as_u16();
            let retry_after = response
                .headers()
                .get(header::RETRY_AFTER)
                .map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned());
            let bytes = response.into_body().collect().await?.to_bytes();
            Ok::<_, Box<dyn std::error::Error + Send + Sync>>((status, retry_after, bytes))
        };
        let (status, retry_after, bytes) = tokio::time::timeout(REQUEST_TIMEOUT, exchange)
            .await
            .unwrap_or_else(|_| panic!("{method} {path} timed out"))
            .unwrap_or_else(|err| panic!("{method} {path} failed: {err}"));
        let text = String::from_utf8_lossy(&bytes).into_owned();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        Reply {
            status,
            text,
            json,
            retry_after,
        }
    }

    async fn request(&self, method: Method, path: &str, body: Vec<u8>) -> Reply {
        let key = self.api_key.clone();
        self.request_with_key(method, path, body, key.as_deref())
            .await
    }

    async fn get(&self, path: &str) -> Reply {
        self.request(Method::GET, path, Vec::new()).await
    }

    async fn post(&self, path: &str) -> Reply {
        self.request(Method::POST, path, Vec::new()).await
    }

    async fn post_json(&self, path: &str, body: &Value) -> Reply {
        self.request(Method::POST, path, body.to_string().into_bytes())
            .await
    }

    /// `POST /v1/encode` that must succeed.
    async fn encode(&self, body: &Value) -> Value {
        self.post_json("/v1/encode", body)
            .await
            .expect(200, "POST /v1/encode")
    }

    /// The `metrics` object of `GET /memory`.
    async fn metrics(&self) -> Value {
        self.memory()
            .await
            .get("metrics")
            .cloned()
            .expect("GET /memory has `metrics`")
    }

    async fn memory(&self) -> Value {
        self.get("/memory").await.expect(200, "GET /memory")
    }

    /// Asserts that device, reserved and allocated bytes are back at the post-start figures
    /// and that both caches are empty.
    async fn assert_at_after_start(&self, when: &str) {
        let m = self.metrics().await;
        for field in [
            "device_used_bytes",
            "allocator_reserved_bytes",
            "allocator_allocated_bytes",
        ] {
            assert_eq!(
                gauge(&m["memory"], field),
                gauge(&m["after_start"], field),
                "{when}: {field} now vs after start: {m:#}"
            );
        }
        for field in [
            "encoder_cache_bytes",
            "encoder_cache_entries",
            "processor_cache_bytes",
            "processor_cache_entries",
        ] {
            assert_eq!(gauge(&m["memory"], field), 0, "{when}: {field}: {m:#}");
        }
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

/// A field of a `MemoryGauges` (or any) object as `u64`, failing when absent.
fn gauge(v: &Value, field: &str) -> u64 {
    v.get(field)
        .and_then(Value::as_u64)
        .unwrap_or_else(|| panic!("`{field}` is not a u64 in {v}"))
}

/// A PNG of `w` x `h` whose pixels depend on `seed`, so different seeds are different images.
fn png(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let image = image::RgbImage::from_fn(w, h, |x, y| {
        let v = x.wrapping_mul(31) ^ y.wrapping_mul(17) ^ seed.wrapping_mul(2_654_435_761);
        let [a, b, c, _] = v.to_le_bytes();
        image::Rgb([a, b ^ c, c.wrapping_add(a)])
    });
    let mut out = Cursor::new(Vec::new());
    image
        .write_to(&mut out, image::ImageFormat::Png)
        .expect("PNG encodes");
    out.into_inner()
}

fn data_url(bytes: &[u8]) -> String {
    format!("data:image/png;base64,{}", STANDARD.encode(bytes))
}

fn image_part(url: &str) -> Value {
    json!({"type": "image_url", "image_url": {"url": url}})
}

/// The grid the tiny model (patch 14) gives a `w` x `h` image whose sides are multiples of 28
/// within its pixel range: no resize.
fn grid(w: u32, h: u32) -> Value {
    json!([1, h / 14, w / 14])
}

/// Decodes `{"dtype":"f32","shape":[t,h],"data":base64}`, checking dtype, length and values.
fn embeddings(item: &Value, tokens: u64) -> Vec<f32> {
    let e = &item["embeddings"];
    assert_eq!(e["dtype"], "f32", "{item}");
    assert_eq!(e["shape"], json!([tokens, HIDDEN]), "embeddings shape");
    let bytes = STANDARD
        .decode(e["data"].as_str().expect("data is a string"))
        .expect("data is base64");
    let values: Vec<f32> = bytes
        .chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(bytes.len() % 4, 0);
    assert_eq!(values.len() as u64, tokens * HIDDEN, "values vs shape");
    assert!(values.iter().all(|v| v.is_finite()), "non-finite embedding");
    assert!(values.iter().any(|v| *v != 0.0), "all-zero embeddings");
    values
}

/// Asserts the `{"error": {"message", "type", "code"}}` shape and a 4xx; returns the code.
fn assert_client_error(reply: &Reply, what: &str) -> String {
    assert!(
        (400..500).contains(&reply.status),
        "{what}: expected a 4xx, got {}: {}",
        reply.status,
        reply.text
    );
    let err = &reply.json["error"];
    for field in ["message", "type", "code"] {
        let s = err[field].as_str().unwrap_or("");
        assert!(
            !s.is_empty(),
            "{what}: error.{field} missing: {}",
            reply.text
        );
    }
    err["code"].as_str().unwrap_or("").to_owned()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encode_returns_grids_tokens_embeddings_and_caches() {
    let server = Server::start("encode", &[]);
    let health = server.get("/health").await.expect(200, "GET /health");
    assert_eq!(health["status"], "ok");
    let (a, b) = (data_url(&png(112, 84, 1)), data_url(&png(56, 56, 2)));
    let body = json!({
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what differs?"},
            image_part(&a),
            image_part(&b),
        ]}],
        "return_embeddings": "f32",
    });
    let first = server.encode(&body).await;
    let images = first["images"].as_array().expect("images list");
    assert_eq!(images.len(), 2, "{first}");
    let expected = [(0, grid(112, 84), 12), (1, grid(56, 56), 4)];
    let mut values = Vec::new();
    for (item, (index, grid, tokens)) in images.iter().zip(expected) {
        assert_eq!(item["index"], index);
        assert_eq!(item["grid_thw"], grid, "{item}");
        assert_eq!(item["num_tokens"], tokens, "{item}");
        assert_eq!(item["cached"], false, "{item}");
        assert!(!item["mm_hash"].as_str().unwrap_or("").is_empty(), "{item}");
        assert_eq!(item["deepstack"], json!([]), "Qwen2-VL has no deepstack");
        values.push(embeddings(item, tokens));
    }
    assert_eq!(images[0]["grid_thw"], json!([1, 6, 8]));
    assert_ne!(images[0]["mm_hash"], images[1]["mm_hash"]);
    assert_eq!(first["usage"], json!({"num_images": 2, "num_tokens": 16}));

    // The same image again (plain list form): served from the encoder cache, same output.
    let again = server
        .encode(&json!({"images": [a], "return_embeddings": "f32"}))
        .await;
    let item = &again["images"][0];
    assert_eq!(item["cached"], true, "{item}");
    assert_eq!(item["mm_hash"], images[0]["mm_hash"]);
    assert_eq!(item["grid_thw"], json!([1, 6, 8]));
    assert_eq!(embeddings(item, 12), values[0]);

    // Without return_embeddings: no tensors in the reply.
    let plain = server.encode(&json!({"content": [image_part(&b)]})).await;
    let item = &plain["images"][0];
    assert_eq!(item["cached"], true);
    assert_eq!(item["mm_hash"], images[1]["mm_hash"]);
    assert!(item.get("embeddings").is_none(), "{item}");

    let m = server.metrics().await;
    assert_eq!(gauge(&m, "encoder_cache_hits"), 2, "{m:#}");
    assert_eq!(gauge(&m, "encoder_cache_misses"), 2, "{m:#}");
    assert_eq!(gauge(&m["memory"], "encoder_cache_entries"), 2, "{m:#}");
}

/// `image` written as `format`, as a data URL of that format's media type.
fn encoded_url(image: &image::DynamicImage, format: image::ImageFormat, media: &str) -> String {
    let mut out = Cursor::new(Vec::new());
    image.write_to(&mut out, format).expect("image encodes");
    format!("data:{media};base64,{}", STANDARD.encode(out.into_inner()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn encode_accepts_every_format_and_hashes_the_pixels() {
    let server = Server::start("formats", &[]);
    let rgb = image::DynamicImage::ImageRgb8(
        image::load_from_memory(&png(84, 56, 70))
            .expect("PNG decodes")
            .to_rgb8(),
    );
    let rgba = image::DynamicImage::ImageRgba8(rgb.to_rgba8());
    let gray = image::DynamicImage::ImageLuma8(rgb.to_luma8());
    let rgb16 = image::DynamicImage::ImageRgb16(rgb.to_rgb16());
    let png_url = encoded_url(&rgb, image::ImageFormat::Png, "image/png");
    let cases = [
        (
            "RGBA PNG",
            encoded_url(&rgba, image::ImageFormat::Png, "image/png"),
        ),
        (
            "gray PNG",
            encoded_url(&gray, image::ImageFormat::Png, "image/png"),
        ),
        (
            "16-bit PNG",
            encoded_url(&rgb16, image::ImageFormat::Png, "image/png"),
        ),
        (
            "JPEG",
            encoded_url(&rgb, image::ImageFormat::Jpeg, "image/jpeg"),
        ),
        (
            "lossless WebP",
            encoded_url(&rgb, image::ImageFormat::WebP, "image/webp"),
        ),
    ];
    let reference = server
        .encode(&json!({"images": [png_url], "return_embeddings": "f32"}))
        .await;
    let reference = &reference["images"][0];
    let reference_values = embeddings(reference, 6);
    for (what, url) in &cases {
        let reply = server
            .post_json(
                "/v1/encode",
                &json!({"images": [url], "return_embeddings": "f32"}),
            )
            .await
            .expect(200, what);
        let item = &reply["images"][0];
        assert_eq!(item["grid_thw"], grid(84, 56), "{what}: {item}");
        let values = embeddings(item, 6);
        // The same pixels in another container: the same item, served from the cache.
        let same_pixels = matches!(*what, "RGBA PNG" | "16-bit PNG" | "lossless WebP");
        assert_eq!(
            item["mm_hash"] == reference["mm_hash"],
            same_pixels,
            "{what}: {} vs {}",
            item["mm_hash"],
            reference["mm_hash"]
        );
        if same_pixels {
            assert_eq!(item["cached"], true, "{what}");
            assert!(values == reference_values, "{what}: embeddings differ");
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn each_reset_returns_memory_to_the_post_start_figure() {
    let server = Server::start("resets", &[]);
    let start = server.metrics().await;
    for key in ["memory", "after_start", "before_start"] {
        for field in [
            "device_used_bytes",
            "device_total_bytes",
            "allocator_reserved_bytes",
            "allocator_allocated_bytes",
            "allocator_peak_bytes",
            "encoder_cache_bytes",
            "encoder_cache_entries",
            "processor_cache_bytes",
            "processor_cache_entries",
        ] {
            gauge(&start[key], field);
        }
    }
    assert!(
        gauge(&start["after_start"], "device_used_bytes")
            > gauge(&start["before_start"], "device_used_bytes"),
        "the weights are on the device: {start:#}"
    );

    // 224x224 needs more activation memory than start-up left reserved, so the allocator grows.
    for (seed, (w, h)) in [(10, (112, 84)), (11, (224, 224)), (12, (56, 56))] {
        server
            .encode(&json!({"images": [data_url(&png(w, h, seed))]}))
            .await;
    }
    let loaded = server.metrics().await;
    let now = &loaded["memory"];
    assert_eq!(gauge(now, "encoder_cache_entries"), 3, "{loaded:#}");
    assert!(gauge(now, "encoder_cache_bytes") > 0, "{loaded:#}");
    assert!(gauge(now, "processor_cache_bytes") > 0, "{loaded:#}");
    assert!(
        gauge(now, "allocator_allocated_bytes")
            > gauge(&loaded["after_start"], "allocator_allocated_bytes"),
        "cached encoder outputs are allocated: {loaded:#}"
    );

    let r = server
        .post("/reset_mm_cache")
        .await
        .expect(200, "reset_mm_cache");
    assert_eq!(
        gauge(&r, "processor_cache_bytes"),
        gauge(now, "processor_cache_bytes"),
        "{r}"
    );
    assert!(gauge(&r, "processor_cache_bytes") > 0, "{r}");
    assert_eq!(
        gauge(&r, "released_bytes"),
        gauge(&r, "processor_cache_bytes")
    );
    let m = server.metrics().await;
    assert_eq!(gauge(&m["memory"], "processor_cache_bytes"), 0, "{m:#}");
    assert_eq!(gauge(&m["memory"], "processor_cache_entries"), 0, "{m:#}");

    let r = server
        .post("/reset_encoder_cache")
        .await
        .expect(200, "reset_encoder_cache");
    assert_eq!(gauge(&r, "encoder_cache_entries"), 3, "{r}");
    assert_eq!(
        gauge(&r, "encoder_cache_bytes"),
        gauge(now, "encoder_cache_bytes"),
        "{r}"
    );
    let m = server.metrics().await;
    assert_eq!(
        gauge(&m["memory"], "allocator_allocated_bytes"),
        gauge(&m["after_start"], "allocator_allocated_bytes"),
        "allocated bytes after the encoder cache reset: {m:#}"
    );
    assert_eq!(gauge(&m["memory"], "encoder_cache_bytes"), 0, "{m:#}");
    assert_eq!(gauge(&m["memory"], "encoder_cache_entries"), 0, "{m:#}");

    let r = server
        .post("/reset_allocator")
        .await
        .expect(200, "reset_allocator");
    assert!(gauge(&r, "allocator_bytes") > 0, "{r}");
    assert_eq!(gauge(&r, "released_bytes"), gauge(&r, "allocator_bytes"));
    server.assert_at_after_start("after the three resets").await;

    // Again, now that the caches were emptied once: the figures come back the same way.
    server
        .encode(&json!({"images": [data_url(&png(112, 84, 10))]}))
        .await;
    let r = server.post("/reset_all").await.expect(200, "reset_all");
    assert_eq!(gauge(&r, "encoder_cache_entries"), 1, "{r}");
    server.assert_at_after_start("after a second round").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reset_all_alone_returns_memory_to_the_post_start_figure() {
    let server = Server::start("reset-all", &[]);
    // 224x224 needs more activation memory than start-up left reserved, so the allocator grows.
    let urls: Vec<String> = [(84, 84), (224, 224), (56, 84)]
        .iter()
        .zip(20..)
        .map(|(&(w, h), seed)| data_url(&png(w, h, seed)))
        .collect();
    let reply = server.encode(&json!({"images": urls})).await;
    assert_eq!(reply["usage"]["num_tokens"], 9 + 64 + 6, "{reply}");
    let r = server.post("/reset_all").await.expect(200, "reset_all");
    assert!(gauge(&r, "processor_cache_bytes") > 0, "{r}");
    assert!(gauge(&r, "encoder_cache_bytes") > 0, "{r}");
    assert_eq!(gauge(&r, "encoder_cache_entries"), 3, "{r}");
    assert!(gauge(&r, "allocator_bytes") > 0, "{r}");
    assert_eq!(
        gauge(&r, "released_bytes"),
        gauge(&r, "processor_cache_bytes")
            + gauge(&r, "encoder_cache_bytes")
            + gauge(&r, "allocator_bytes"),
        "{r}"
    );
    server.assert_at_after_start("after POST /reset_all").await;
    let memory = server.memory().await;
    assert_eq!(memory["in_flight_requests"], 0, "{memory:#}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_releases_the_device_and_wake_up_restores_the_same_outputs() {
    let server = Server::start("sleep", &[]);
    for bad in ["3", "x", "0", ""] {
        let reply = server.post(&format!("/sleep?level={bad}")).await;
        let code = assert_client_error(&reply, &format!("sleep level {bad:?}"));
        assert_eq!(code, "invalid_sleep_level", "{}", reply.text);
    }
    let asleep = server.get("/is_sleeping").await.expect(200, "is_sleeping");
    assert_eq!(asleep, json!({"is_sleeping": false}), "a refused sleep");

    let body = json!({"images": [data_url(&png(112, 84, 30))], "return_embeddings": "f32"});
    let before = server.encode(&body).await;
    let reference = embeddings(&before["images"][0], 12);
    for level in [1, 2] {
        let r = server
            .post(&format!("/sleep?level={level}"))
            .await
            .expect(200, "POST /sleep");
        assert_eq!(r["level"], level, "{r}");
        assert_eq!(r["is_sleeping"], true, "{r}");
        let asleep = server.get("/is_sleeping").await.expect(200, "is_sleeping");
        assert_eq!(asleep, json!({"is_sleeping": true}));
        let m = server.metrics().await;
        assert_eq!(
            gauge(&m["memory"], "device_used_bytes"),
            gauge(&m["before_start"], "device_used_bytes"),
            "level {level}: device use while asleep vs before start: {m:#}"
        );
        assert_eq!(gauge(&m["memory"], "encoder_cache_entries"), 0, "{m:#}");

        let refused = server.post_json("/v1/encode", &body).await;
        assert_eq!(refused.status, 503, "encode while asleep: {}", refused.text);
        assert_eq!(
            refused.json["error"]["code"], "engine_sleeping",
            "{}",
            refused.text
        );

        let woke = server.post("/wake_up").await.expect(200, "POST /wake_up");
        assert_eq!(woke, json!({"is_sleeping": false}));
        let asleep = server.get("/is_sleeping").await.expect(200, "is_sleeping");
        assert_eq!(asleep, json!({"is_sleeping": false}));

        let after = server.encode(&body).await;
        let item = &after["images"][0];
        assert_eq!(
            item["cached"], false,
            "sleep emptied the encoder cache: {item}"
        );
        assert_eq!(item["mm_hash"], before["images"][0]["mm_hash"]);
        assert!(
            embeddings(item, 12) == reference,
            "level {level}: the embeddings after wake-up differ from those before sleeping"
        );
        server.post("/reset_all").await.expect(200, "reset_all");
        server
            .assert_at_after_start(&format!("after a level {level} sleep, wake-up and reset"))
            .await;
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn api_key_guards_every_route_but_health() {
    let mut server = Server::start("api-key", &["--api-key", "secret"]);
    let encode_body = json!({"images": [data_url(&png(56, 56, 40))]}).to_string();
    let routes: Vec<(Method, &str, Vec<u8>)> = vec![
        (Method::POST, "/v1/encode", encode_body.clone().into_bytes()),
        (Method::POST, "/reset_mm_cache", Vec::new()),
        (Method::POST, "/reset_encoder_cache", Vec::new()),
        (Method::POST, "/reset_allocator", Vec::new()),
        (Method::POST, "/reset_all", Vec::new()),
        (Method::GET, "/is_sleeping", Vec::new()),
        (Method::GET, "/server_info", Vec::new()),
        (Method::GET, "/memory", Vec::new()),
        (Method::GET, "/metrics", Vec::new()),
        (Method::POST, "/sleep?level=1", Vec::new()),
        (Method::POST, "/wake_up", Vec::new()),
    ];
    for (method, path, body) in &routes {
        for key in [None, Some("wrong"), Some("secretx"), Some("")] {
            let reply = server
                .request_with_key(method.clone(), path, body.clone(), key)
                .await;
            assert_eq!(
                reply.status, 401,
                "{method} {path} with key {key:?}: {}",
                reply.text
            );
            assert_eq!(
                reply.json["error"]["code"], "invalid_api_key",
                "{}",
                reply.text
            );
            assert_eq!(reply.json["error"]["type"], "authentication_error");
        }
    }
    let asleep = server
        .request_with_key(Method::GET, "/is_sleeping", Vec::new(), Some("secret"))
        .await
        .expect(200, "is_sleeping with the key");
    assert_eq!(
        asleep["is_sleeping"], false,
        "refused /sleep calls did nothing"
    );

    let health = server
        .request_with_key(Method::GET, "/health", Vec::new(), None)
        .await
        .expect(200, "GET /health without a key");
    assert_eq!(health["status"], "ok");

    server.api_key = Some("secret".to_owned());
    for (method, path, body) in routes {
        let reply = server.request(method.clone(), path, body).await;
        assert_eq!(
            reply.status, 200,
            "{method} {path} with the key: {}",
            reply.text
        );
        if path == "/metrics" {
            assert!(
                reply.text.contains("iris_http_requests_total"),
                "{}",
                reply.text
            );
        } else {
            assert!(reply.json.is_object(), "{method} {path}: {}", reply.text);
        }
    }
    let asleep = server.get("/is_sleeping").await.expect(200, "is_sleeping");
    assert_eq!(asleep["is_sleeping"], false, "slept and woke up");
    let info = server.get("/server_info").await.expect(200, "server_info");
    assert_eq!(info["model"], "tiny", "{info}");
    assert!(
        !info.to_string().contains("secret"),
        "the key leaks: {info}"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_inputs_get_4xx_json_errors_and_leave_nothing_behind() {
    let server = Server::start(
        "bad-inputs",
        &[
            "--max-image-pixels",
            "10000",
            "--max-images-per-request",
            "3",
            "--max-body-bytes",
            "65536",
        ],
    );
    let good_png = png(84, 56, 50);
    let good = data_url(&good_png);
    let tiny = data_url(&png(8, 8, 53));
    let half = data_url(&good_png[..good_png.len() / 2]);
    let header_only = data_url(&good_png[..12]);
    let qoi = format!(
        "data:image/png;base64,{}",
        STANDARD.encode(b"qoif\x00\x00\x00\x01\x00\x00\x00\x01\x03\x00")
    );
    let random = format!(
        "data:image/png;base64,{}",
        STANDARD.encode(
            (0u8..64)
                .map(|i| i.wrapping_mul(37) ^ 0x5a)
                .collect::<Vec<u8>>()
        )
    );
    // A payload over the body limit that is otherwise a valid request.
    let filler = "a".repeat(100 * 1024);
    let mut cases: Vec<(&str, Vec<u8>, Option<&str>)> = vec![
        (
            "malformed JSON",
            b"{\"images\": [".to_vec(),
            Some("invalid_json"),
        ),
        ("not an object", b"[1, 2]".to_vec(), Some("invalid_request")),
        ("no image field", b"{}".to_vec(), Some("missing_field")),
        (
            "empty image list",
            json!({"images": []}).to_string().into_bytes(),
            Some("no_images"),
        ),
        (
            "header-only PNG",
            json!({"images": [header_only]}).to_string().into_bytes(),
            Some("corrupt_image"),
        ),
        (
            "truncated PNG data",
            json!({"images": [half]}).to_string().into_bytes(),
            None,
        ),
        (
            "good image then truncated PNG",
            json!({"images": [good, half]}).to_string().into_bytes(),
            None,
        ),
        (
            "QOI bytes",
            json!({"images": [qoi]}).to_string().into_bytes(),
            Some("unknown_image_format"),
        ),
        (
            "random bytes",
            json!({"images": [random]}).to_string().into_bytes(),
            Some("unknown_image_format"),
        ),
        (
            "AVIF bytes (the media type is not what decides)",
            json!({"images": ["data:image/avif;base64,AAAAIGZ0eXBhdmlm"]})
                .to_string()
                .into_bytes(),
            Some("unknown_image_format"),
        ),
        (
            "bad base64",
            json!({"images": ["data:image/png;base64,@@not*base64!!"]})
                .to_string()
                .into_bytes(),
            Some("invalid_base64"),
        ),
        (
            "remote URL",
            json!({"images": ["http://127.0.0.1:9/a.png"]})
                .to_string()
                .into_bytes(),
            Some("remote_url_not_supported"),
        ),
        (
            "over the pixel limit",
            json!({"images": [data_url(&png(120, 100, 51))]})
                .to_string()
                .into_bytes(),
            Some("image_too_large"),
        ),
        (
            "extreme aspect ratio",
            json!({"images": [data_url(&png(2, 600, 52))]})
                .to_string()
                .into_bytes(),
            None,
        ),
        (
            "too many images",
            json!({"images": [tiny, tiny, tiny, tiny]})
                .to_string()
                .into_bytes(),
            Some("too_many_images"),
        ),
        (
            "body over the limit",
            json!({"messages": [{"role": "user", "content": [
                {"type": "text", "text": filler},
                image_part(&good),
            ]}]})
            .to_string()
            .into_bytes(),
            Some("body_too_large"),
        ),
        (
            "return_embeddings a number",
            json!({"images": [good], "return_embeddings": 5})
                .to_string()
                .into_bytes(),
            Some("invalid_return_embeddings"),
        ),
        (
            "content not a list",
            json!({"content": image_part(&good)})
                .to_string()
                .into_bytes(),
            Some("invalid_type"),
        ),
        (
            "message content a number",
            json!({"messages": [{"role": "user", "content": 5}]})
                .to_string()
                .into_bytes(),
            Some("invalid_type"),
        ),
        (
            "url a number",
            json!({"content": [{"type": "image_url", "image_url": {"url": 5}}]})
                .to_string()
                .into_bytes(),
            Some("invalid_type"),
        ),
        (
            "images not a list",
            json!({"images": good}).to_string().into_bytes(),
            Some("invalid_type"),
        ),
    ];
    // The failures the engine finds (after the server's checks) twice, so that copies of
    // them are in flight together when the cases are sent all at once.
    cases.extend(
        cases
            .clone()
            .into_iter()
            .filter(|(what, _, _)| what.contains("truncated")),
    );
    let replies = send_all(&server, &cases).await;
    for ((what, _, code), reply) in cases.iter().zip(&replies) {
        let got = assert_client_error(reply, what);
        if let Some(code) = code {
            assert_eq!(&got, code, "{what}: {}", reply.text);
        }
    }

    let wrong_method = server.get("/v1/encode").await;
    assert_eq!(wrong_method.status, 405, "{}", wrong_method.text);
    assert_client_error(&wrong_method, "GET /v1/encode");
    let unknown = server.get("/v2/nothing").await;
    assert_eq!(unknown.status, 404, "{}", unknown.text);
    assert_client_error(&unknown, "unknown route");

    // Before any reset: no refused request reached the device or stayed in flight.
    let memory = server.memory().await;
    assert_eq!(memory["in_flight_requests"], 0, "{memory:#}");
    let m = &memory["metrics"];
    for field in [
        "device_used_bytes",
        "allocator_reserved_bytes",
        "allocator_allocated_bytes",
        "encoder_cache_entries",
    ] {
        assert_eq!(
            gauge(&m["memory"], field),
            gauge(&m["after_start"], field),
            "after the bad inputs, before any reset: {field}: {m:#}"
        );
    }

    // The server is still serving after all that, and what it keeps is its one cached output.
    let ok = server.encode(&json!({"images": [good]})).await;
    assert_eq!(ok["images"][0]["grid_thw"], grid(84, 56));
    let m = server.metrics().await;
    assert_eq!(gauge(&m["memory"], "encoder_cache_entries"), 1, "{m:#}");
    assert_eq!(
        gauge(&m["memory"], "allocator_allocated_bytes"),
        gauge(&m["after_start"], "allocator_allocated_bytes")
            + gauge(&m["memory"], "encoder_cache_bytes"),
        "live blocks beyond the weights and the cached output: {m:#}"
    );

    server.post("/reset_all").await.expect(200, "reset_all");
    server.assert_at_after_start("after the bad inputs").await;
    let memory = server.memory().await;
    assert_eq!(memory["in_flight_requests"], 0, "{memory:#}");
}

/// Sends every case's body to `POST /v1/encode`, one at a time, then all at once; the
/// concurrent replies must have the same statuses. Returns the one-at-a-time replies in order.
async fn send_all(server: &Server, cases: &[(&str, Vec<u8>, Option<&str>)]) -> Vec<Reply> {
    let mut replies = Vec::with_capacity(cases.len());
    // Sequential first (each error on its own), then the same bodies concurrently below.
    for (_, body, _) in cases {
        replies.push(
            server
                .request(Method::POST, "/v1/encode", body.clone())
                .await,
        );
    }
    let mut set = tokio::task::JoinSet::new();
    let base = server.base.clone();
    for (i, (_, body, _)) in cases.iter().enumerate() {
        let client = server.client.clone();
        let uri = format!("{base}/v1/encode");
        let body = body.clone();
        set.spawn(async move {
            let request = Request::post(uri)
                .header(header::CONTENT_TYPE, "application/json")
                .body(Full::new(Bytes::from(body)))
                .expect("request builds");
            let response = tokio::time::timeout(REQUEST_TIMEOUT, client.request(request))
                .await
                .expect("no timeout")
                .expect("request sent");
            let status = response.status().as_u16();
            let bytes = response
                .into_body()
                .collect()
                .await
                .expect("body read")
                .to_bytes();
            (i, status, bytes)
        });
    }
    while let Some(joined) = set.join_next().await {
        let (i, status, bytes) = joined.expect("task finished");
        let first = &replies[i];
        assert_eq!(
            status,
            first.status,
            "case {i} concurrently vs alone: {}",
            String::from_utf8_lossy(&bytes)
        );
    }
    replies
}

/// Largest absolute difference between two equally long outputs.
fn max_abs_diff(a: &[f32], b: &[f32]) -> f32 {
    assert_eq!(a.len(), b.len(), "output lengths");
    a.iter()
        .zip(b)
        .map(|(x, y)| (x - y).abs())
        .fold(0.0, f32::max)
}

/// Batching changes the order of float sums, nothing else: outputs of one image encoded in
/// different batches agree to rounding (observed: under 1e-6 on values of order 1).
const BATCH_TOLERANCE: f32 = 1e-4;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thirty_two_clients_with_a_reset_in_the_middle() {
    const CLIENTS: u32 = 32;
    const REQUESTS: u32 = 3;
    let server = Arc::new(Server::start("concurrent", &[]));
    let shared = data_url(&png(56, 56, 60));
    // The shared image encoded alone: the reference every batched copy must match.
    let alone = server
        .encode(&json!({"images": [shared], "return_embeddings": "f32"}))
        .await;
    let reference = Arc::new(embeddings(&alone["images"][0], 4));
    server.post("/reset_all").await.expect(200, "reset_all");
    let sizes = [(56, 56), (84, 56), (56, 84), (112, 56)];
    let done = Arc::new(AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    for client in 0..CLIENTS {
        let server = Arc::clone(&server);
        let shared = shared.clone();
        let reference = Arc::clone(&reference);
        let done = Arc::clone(&done);
        set.spawn(async move {
            let mut hashes = Vec::new();
            let mut first: Option<(String, Value, Vec<f32>)> = None;
            for r in 0..REQUESTS {
                let (w, h) = sizes[((client + r) % 4) as usize];
                let fresh = data_url(&png(w, h, 1000 + client * REQUESTS + r));
                // One image every client shares in every other request, and the client's own
                // first image again in its last request.
                let mut urls = vec![fresh.clone()];
                if r % 2 == 0 {
                    urls.push(shared.clone());
                }
                if let (2, Some((url, _, _))) = (r, &first) {
                    urls.push(url.clone());
                }
                let reply = server
                    .post_json(
                        "/v1/encode",
                        &json!({"images": urls, "return_embeddings": "f32"}),
                    )
                    .await;
                assert_eq!(
                    reply.status, 200,
                    "client {client} request {r}: {}",
                    reply.text
                );
                let images = reply.json["images"].as_array().expect("images").clone();
                assert_eq!(images.len(), urls.len());
                assert_eq!(images[0]["grid_thw"], grid(w, h), "{}", images[0]);
                let values = embeddings(&images[0], u64::from(w / 28 * (h / 28)));
                if r % 2 == 0 {
                    assert_eq!(images[1]["num_tokens"], 4);
                    hashes.push(images[1]["mm_hash"].as_str().unwrap_or("").to_owned());
                    let diff = max_abs_diff(&embeddings(&images[1], 4), &reference);
                    assert!(
                        diff <= BATCH_TOLERANCE,
                        "client {client} request {r}: the shared image's output is off by {diff}"
                    );
                }
                if r == 0 {
                    first = Some((fresh, images[0]["mm_hash"].clone(), values));
                } else if let (2, Some((_, hash, values))) = (r, &first) {
                    assert_eq!(&images[2]["mm_hash"], hash, "the repeated image");
                    let (w, h) = sizes[(client % 4) as usize];
                    let again = embeddings(&images[2], u64::from(w / 28 * (h / 28)));
                    let diff = max_abs_diff(&again, values);
                    assert!(
                        diff <= BATCH_TOLERANCE,
                        "client {client}: its first image's output changed by {diff}"
                    );
                }
                done.fetch_add(1, Ordering::SeqCst);
            }
            hashes
        });
    }
    // A reset once about a third of the requests are done, while the rest are in flight.
    let resetter = {
        let server = Arc::clone(&server);
        let done = Arc::clone(&done);
        tokio::spawn(async move {
            let third = (CLIENTS * REQUESTS / 3) as usize;
            while done.load(Ordering::SeqCst) < third {
                tokio::time::sleep(Duration::from_millis(5)).await;
            }
            let r = server
                .post("/reset_all")
                .await
                .expect(200, "reset_all mid-run");
            assert!(done.load(Ordering::SeqCst) < (CLIENTS * REQUESTS) as usize);
            r
        })
    };
    let mut shared_hashes = Vec::new();
    while let Some(joined) = set.join_next().await {
        shared_hashes.extend(joined.expect("client task"));
    }
    let mid = resetter.await.expect("reset task");
    assert!(gauge(&mid, "encoder_cache_entries") > 0, "{mid}");
    assert_eq!(shared_hashes.len(), 2 * CLIENTS as usize);
    assert!(
        shared_hashes
            .windows(2)
            .all(|w| w[0] == w[1] && !w[0].is_empty()),
        "the shared image's hash varies: {shared_hashes:?}"
    );
    // A reset may make an in-flight request encode an item twice, so at least one lookup per
    // image sent.
    let m = server.metrics().await;
    assert!(
        gauge(&m, "encoder_cache_hits") + gauge(&m, "encoder_cache_misses")
            >= u64::from(CLIENTS) * 6,
        "{m:#}"
    );

    server
        .post("/reset_all")
        .await
        .expect(200, "final reset_all");
    server.assert_at_after_start("after 32 clients").await;
    let memory = server.memory().await;
    assert_eq!(memory["in_flight_requests"], 0, "{memory:#}");
    let metrics = server.get("/metrics").await;
    assert_eq!(metrics.status, 200, "{}", metrics.text);
    assert!(
        metrics.text.contains("iris_images_total{cached=\"true\"}"),
        "{}",
        metrics.text
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sleep_under_load_refuses_or_finishes_every_request() {
    const CLIENTS: u32 = 16;
    const REQUESTS: u32 = 4;
    let server = Arc::new(Server::start("sleep-load", &[]));
    let sizes = [(56, 56), (84, 56), (56, 84), (112, 56)];
    let mut references = Vec::new();
    for client in 0..CLIENTS {
        let (w, h) = sizes[(client % 4) as usize];
        let url = data_url(&png(w, h, 2000 + client));
        let alone = server
            .encode(&json!({"images": [url], "return_embeddings": "f32"}))
            .await;
        let values = embeddings(&alone["images"][0], u64::from(w / 28 * (h / 28)));
        references.push((url, values));
    }
    server.post("/reset_all").await.expect(200, "reset_all");
    let references = Arc::new(references);
    let done = Arc::new(AtomicUsize::new(0));
    let mut set = tokio::task::JoinSet::new();
    for client in 0..CLIENTS {
        let server = Arc::clone(&server);
        let references = Arc::clone(&references);
        let done = Arc::clone(&done);
        set.spawn(async move {
            let (url, reference) = &references[client as usize];
            let mut served = 0u32;
            for r in 0..REQUESTS {
                let reply = server
                    .post_json(
                        "/v1/encode",
                        &json!({"images": [url], "return_embeddings": "f32"}),
                    )
                    .await;
                match reply.status {
                    200 => {
                        let values =
                            embeddings(&reply.json["images"][0], reference.len() as u64 / HIDDEN);
                        let diff = max_abs_diff(&values, reference);
                        assert!(
                            diff <= BATCH_TOLERANCE,
                            "client {client} request {r}: output off by {diff}"
                        );
                        served += 1;
                    }
                    503 => assert_eq!(
                        reply.json["error"]["code"], "engine_sleeping",
                        "client {client} request {r}: {}",
                        reply.text
                    ),
                    other => panic!(
                        "client {client} request {r}: status {other}: {}",
                        reply.text
                    ),
                }
                done.fetch_add(1, Ordering::SeqCst);
            }
            served
        });
    }
    // Two sleeps (level 1, then 2) while clients are sending; each checked while asleep.
    let total = (CLIENTS * REQUESTS) as usize;
    for (level, after) in [(1, total / 8), (2, total / 2)] {
        while done.load(Ordering::SeqCst) < after {
            tokio::time::sleep(Duration::from_millis(2)).await;
        }
        server
            .post(&format!("/sleep?level={level}"))
            .await
            .expect(200, "POST /sleep under load");
        let m = server.metrics().await;
        assert_eq!(
            gauge(&m["memory"], "device_used_bytes"),
            gauge(&m["before_start"], "device_used_bytes"),
            "level {level} under load: device use while asleep: {m:#}"
        );
        tokio::time::sleep(Duration::from_millis(100)).await;
        server.post("/wake_up").await.expect(200, "POST /wake_up");
    }
    let mut served = 0;
    while let Some(joined) = set.join_next().await {
        served += joined.expect("client task");
    }
    assert!(served > 0, "no request was served");
    let reply = server
        .encode(&json!({"images": [references[0].0], "return_embeddings": "f32"}))
        .await;
    let diff = max_abs_diff(
        &embeddings(&reply["images"][0], references[0].1.len() as u64 / HIDDEN),
        &references[0].1,
    );
    assert!(diff <= BATCH_TOLERANCE, "after the sleeps: off by {diff}");
    server
        .post("/reset_all")
        .await
        .expect(200, "final reset_all");
    server
        .assert_at_after_start("after sleeps under load")
        .await;
    let memory = server.memory().await;
    assert_eq!(memory["in_flight_requests"], 0, "{memory:#}");
}

/// Resident memory of process `pid`, in bytes (`VmRSS` of /proc/PID/status).
fn rss_bytes(pid: u32) -> u64 {
    let status = std::fs::read_to_string(format!("/proc/{pid}/status")).expect("/proc status");
    let kib: u64 = status
        .lines()
        .find_map(|l| l.strip_prefix("VmRSS:"))
        .and_then(|v| v.trim().trim_end_matches("kB").trim().parse().ok())
        .expect("VmRSS in /proc status");
    kib * 1024
}

/// Samples a process's resident memory every few milliseconds until stopped; the peak.
struct RssPeak {
    stop: Arc<std::sync::atomic::AtomicBool>,
    thread: std::thread::JoinHandle<u64>,
}

impl RssPeak {
    fn start(pid: u32) -> RssPeak {
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let flag = Arc::clone(&stop);
        let thread = std::thread::spawn(move || {
            let mut peak = rss_bytes(pid);
            while !flag.load(Ordering::SeqCst) {
                peak = peak.max(rss_bytes(pid));
                std::thread::sleep(Duration::from_millis(2));
            }
            peak.max(rss_bytes(pid))
        });
        RssPeak { stop, thread }
    }

    fn stop(self) -> u64 {
        self.stop.store(true, Ordering::SeqCst);
        self.thread.join().expect("the sampler ends")
    }
}

/// The `admission` figures of `GET /memory`'s metrics.
async fn admission(server: &Server) -> Value {
    server.metrics().await["admission"].clone()
}

/// Polls `GET /memory` until no request is pending or in flight (aborted requests are released
/// by the engine core between steps); fails after [`REQUEST_TIMEOUT`].
async fn wait_until_idle(server: &Server, when: &str) {
    let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
    loop {
        let memory = server.memory().await;
        let pending = gauge(&memory["metrics"]["admission"], "pending_requests");
        let in_flight = gauge(&memory, "in_flight_requests");
        if pending == 0 && in_flight == 0 {
            return;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "{when}: {pending} requests still pending, {in_flight} in flight: {memory:#}"
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
}

/// Side of the burst's images: 448 x 448 is 256 embedding tokens and 4.8 MB of preprocessed
/// rows (1024 patches x 1176 f32) per image, so that work held beyond the bound would show in
/// the server's resident memory.
const BURST_SIDE: u32 = 448;
/// The queue bound of the burst test, in requests; the token bound lets exactly as many
/// one-image requests in.
const BURST_SEEDS: u32 = 4;
/// [`BURST_SEEDS`] as a figure to compare with the server's.
const BURST_BOUND: u64 = BURST_SEEDS as u64;
/// Host bytes one admitted burst request may hold at its peak: body, base64 text, encoded and
/// decoded image, the resized image and its patch rows, with room for the allocator's rounding.
const BURST_BYTES_PER_REQUEST: u64 = 16 << 20;
/// Resident memory the server may gain for reasons other than held requests: connection
/// buffers and the stacks and allocator arenas of the threads a burst wakes.
const BURST_SLACK: u64 = 64 << 20;

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_burst_of_ten_times_the_queue_bound_gets_503_with_retry_after_and_bounded_memory() {
    let tokens = (BURST_BOUND * 256).to_string();
    let bound = BURST_BOUND.to_string();
    let server = Arc::new(Server::start(
        "burst",
        &[
            "--max-queued-requests",
            &bound,
            "--max-pending-tokens",
            &tokens,
            // No processor cache: its (bounded, wanted) growth is not what is measured here.
            "--mm-processor-cache-gb",
            "0",
        ],
    ));
    let limits = admission(&server).await;
    assert_eq!(
        gauge(&limits, "max_queued_requests"),
        BURST_BOUND,
        "{limits}"
    );
    assert_eq!(
        gauge(&limits, "max_pending_tokens"),
        BURST_BOUND * 256,
        "{limits}"
    );
    let body = |seed: u32| json!({"images": [data_url(&png(BURST_SIDE, BURST_SIDE, seed))]});
    // Warm up with as many requests as the bound lets in at once, so that threads and the
    // allocator's blocks for such a batch exist before the baseline (no reset after it: the
    // CPU device's memory is host memory, and is measured apart below).
    let mut warm = tokio::task::JoinSet::new();
    for seed in 0..BURST_SEEDS {
        let server = Arc::clone(&server);
        let body = body(5000 + seed);
        warm.spawn(async move { server.encode(&body).await });
    }
    while let Some(done) = warm.join_next().await {
        done.expect("warm-up request");
    }
    let burst: Vec<Value> = (0..10 * BURST_SEEDS).map(|i| body(6000 + i)).collect();
    let pid = server.child.id();
    let reserved_before = gauge(
        &server.metrics().await["memory"],
        "allocator_reserved_bytes",
    );
    let baseline = rss_bytes(pid);
    let sampler = RssPeak::start(pid);
    let mut set = tokio::task::JoinSet::new();
    for body in burst {
        let server = Arc::clone(&server);
        set.spawn(async move { server.post_json("/v1/encode", &body).await });
    }
    let mut answered = 0;
    let mut refused = 0;
    while let Some(reply) = set.join_next().await {
        let reply = reply.expect("client task");
        match reply.status {
            200 => answered += 1,
            503 => {
                refused += 1;
                assert_eq!(reply.json["error"]["code"], "overloaded", "{}", reply.text);
                assert_eq!(reply.retry_after.as_deref(), Some("1"), "{}", reply.text);
            }
            other => panic!("burst: HTTP {other}: {}", reply.text),
        }
    }
    let peak = sampler.stop();
    assert!(answered >= 1, "nothing was served ({refused} refused)");
    assert!(refused >= 1, "a burst of 10x the bound got no 503");
    let figures = admission(&server).await;
    assert!(
        gauge(&figures, "peak_pending_requests") <= BURST_BOUND,
        "the request bound was passed: {figures}"
    );
    assert!(
        gauge(&figures, "peak_pending_tokens") <= BURST_BOUND * 256,
        "the token bound was passed: {figures}"
    );
    assert_eq!(gauge(&figures, "rejected_requests"), refused, "{figures}");
    // The CPU device's buffers are host memory too, bounded by the device budget rather than
    // by backpressure: whatever the allocator reserved beyond the warm-up is allowed on top.
    let reserved_after = gauge(
        &server.metrics().await["memory"],
        "allocator_reserved_bytes",
    );
    let device_growth = reserved_after.saturating_sub(reserved_before);
    let growth = peak.saturating_sub(baseline);
    let allowance = BURST_BOUND * BURST_BYTES_PER_REQUEST + BURST_SLACK + device_growth;
    assert!(
        growth <= allowance,
        "resident memory grew by {growth} bytes during a burst of {} requests (baseline \
         {baseline}, peak {peak}, device reserve +{device_growth}); the bound of \
         {BURST_BOUND} requests allows {allowance}",
        10 * BURST_BOUND
    );
    eprintln!(
        "burst: {answered} answered, {refused} refused; resident memory +{} MiB at peak \
         (allowance {} MiB)",
        growth >> 20,
        allowance >> 20
    );

    // Right after: served normally, and nothing held.
    let after = server.encode(&body(7000)).await;
    assert_eq!(after["images"][0]["num_tokens"], 256, "{after}");
    wait_until_idle(&server, "after the burst").await;
    server.post("/reset_all").await.expect(200, "reset_all");
    server.assert_at_after_start("after the burst").await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn clients_that_hang_up_under_load_release_their_queued_and_running_work() {
    // A slow device (each queued call of the CPU device waits 40 ms first) keeps work queued
    // while the clients hang up: otherwise the tiny model drains the queue about as fast as the
    // clients' requests arrive, and most images are encoded before the hang-ups reach the
    // engine core.
    let config = std::env::temp_dir().join(format!("iris-hang-up-{}.toml", std::process::id()));
    std::fs::write(&config, "[plugins.cpu]\nqueue_delay_us = 40000\n").expect("config file");
    let server = Arc::new(Server::start(
        "hang-up",
        &[
            "--config",
            config.to_str().expect("a UTF-8 temp path"),
            "--mm-processor-cache-gb",
            "0",
            "--max-num-seqs",
            "2",
            // Every client is admitted: this test is about hanging up, not about refusals.
            "--max-queued-requests",
            "16",
            "--max-pending-tokens",
            "16384",
        ],
    ));
    let _ = std::fs::remove_file(&config);
    // Sixteen clients each send three large images: two requests run, the others wait.
    let mut set = tokio::task::JoinSet::new();
    for client in 0..16u32 {
        let server = Arc::clone(&server);
        let urls: Vec<String> = (0..3)
            .map(|i| data_url(&png(BURST_SIDE, BURST_SIDE, 8000 + client * 3 + i)))
            .collect();
        set.spawn(async move {
            let body = json!({ "images": urls });
            server.post_json("/v1/encode", &body).await
        });
    }
    // Once the engine core holds work, every client hangs up (its task is cancelled, which
    // drops the request and closes the connection): some while running, most while queued.
    let deadline = tokio::time::Instant::now() + REQUEST_TIMEOUT;
    loop {
        let in_flight = gauge(&server.memory().await, "in_flight_requests");
        if in_flight >= 2 {
            break;
        }
        assert!(
            tokio::time::Instant::now() < deadline,
            "the engine never held two requests"
        );
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    set.abort_all();
    let mut hung_up = 0;
    while let Some(result) = set.join_next().await {
        match result {
            Ok(reply) => assert_eq!(reply.status, 200, "{}", reply.text),
            Err(err) => {
                assert!(err.is_cancelled(), "client task: {err}");
                hung_up += 1;
            }
        }
    }
    assert!(hung_up > 0, "every client was answered before hanging up");
    wait_until_idle(&server, "after the clients hung up").await;
    // Requests whose clients hung up while queued were dropped, not encoded: every image the
    // engine encoded is in the encoder cache or was evicted from it.
    let m = server.metrics().await;
    let encoded =
        gauge(&m, "encoder_cache_evictions") + gauge(&m["memory"], "encoder_cache_entries");
    // The slow device keeps most requests queued when the clients hang up (a run encodes 9 to
    // 15 of the 48): more than half encoded means hung-up requests ran anyway.
    assert!(
        encoded <= 24,
        "the engine encoded {encoded} of the 48 images: hung-up requests ran anyway"
    );
    // The server still serves, and the aborted work left nothing behind.
    let reply = server
        .encode(&json!({"images": [data_url(&png(56, 56, 8999))]}))
        .await;
    assert_eq!(reply["images"][0]["num_tokens"], 4, "{reply}");
    server.post("/reset_all").await.expect(200, "reset_all");
    server
        .assert_at_after_start("after the clients hung up")
        .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_panic_of_the_engine_core_fails_in_flight_requests_and_turns_every_route_503() {
    let server = Server::start_env("panic", &[], &[("IRIS_ENGINE_PANIC_AT_STEP", "3")]);
    server
        .get("/health")
        .await
        .expect(200, "health before the fault");
    // Requests one at a time: those served before step 3 succeed, the one running in step 3
    // dies with the engine core.
    let mut served = 0;
    let failed = loop {
        let reply = server
            .post_json(
                "/v1/encode",
                &json!({"images": [data_url(&png(56, 56, 9000 + served))]}),
            )
            .await;
        if reply.status != 200 || served == 3 {
            break reply;
        }
        served += 1;
    };
    let failed_at = std::time::Instant::now();
    assert!(
        served >= 1,
        "the first request was already lost: {}",
        failed.text
    );
    assert_eq!(failed.status, 500, "the request in flight: {}", failed.text);
    assert!(
        failed.text.contains("panicked") && failed.text.contains("injected fault"),
        "{}",
        failed.text
    );
    let health = server.get("/health").await;
    let seen_after = failed_at.elapsed();
    assert_eq!(
        health.status, 503,
        "/health after the panic: {}",
        health.text
    );
    assert_eq!(
        health.json["error"]["code"], "engine_dead",
        "{}",
        health.text
    );
    assert!(
        seen_after < Duration::from_secs(1),
        "/health answered 503 only {seen_after:?} after the failure"
    );
    // Every other route refuses too: no zeros from a dead engine.
    for (method, path) in [
        (Method::POST, "/reset_all"),
        (Method::POST, "/reset_encoder_cache"),
        (Method::POST, "/reset_mm_cache"),
        (Method::POST, "/reset_allocator"),
        (Method::GET, "/memory"),
        (Method::GET, "/metrics"),
        (Method::GET, "/server_info"),
        (Method::POST, "/wake_up"),
    ] {
        let reply = server.request(method.clone(), path, Vec::new()).await;
        assert_eq!(reply.status, 503, "{method} {path}: {}", reply.text);
        assert_eq!(
            reply.json["error"]["code"], "engine_dead",
            "{path}: {}",
            reply.text
        );
    }
    let refused = server
        .post_json(
            "/v1/encode",
            &json!({"images": [data_url(&png(56, 56, 9200))]}),
        )
        .await;
    assert_eq!(refused.status, 503, "{}", refused.text);
    assert_eq!(refused.json["error"]["code"], "engine_dead");
    // The process is alive and said what happened.
    let mut server = server;
    assert!(
        server.child.try_wait().expect("child status").is_none(),
        "the server exited"
    );
    let stderr = std::fs::read_to_string(server.dir.join("stderr.txt")).unwrap_or_default();
    assert!(
        stderr.contains("the engine core panicked") && stderr.contains("injected fault"),
        "{stderr}"
    );
}

/// A plugin folder holding the `load-abort` fixture under a plugin's file name: a vendor
/// library that kills any process that loads it.
fn aborting_plugin_dir() -> PathBuf {
    let deps = std::env::current_exe()
        .expect("test binaries know their own path")
        .parent()
        .expect("a test binary lives in a folder")
        .to_path_buf();
    let dir = std::env::temp_dir().join(format!("iris-aborting-plugins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp folder");
    let target = dir.join(iris_plugin::loader::library_file_name("zz_broken"));
    if !target.exists() {
        // Copy to a unique name, then rename: tests run in parallel.
        let partial = dir.join(format!("partial-{:?}", std::thread::current().id()));
        std::fs::copy(deps.join("libiris_fixture_load_abort.so"), &partial)
            .expect("fixture copied");
        std::fs::rename(&partial, &target).expect("fixture in place");
    }
    dir
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_broken_vendor_library_does_not_break_a_cpu_start_nor_auto() {
    let plugins = aborting_plugin_dir();
    let plugins = plugins.to_str().expect("UTF-8 temp path");
    // `--device cpu` (the common flags) with the broken library on the search path.
    let server = Server::start("broken-plugin-cpu", &["--plugin-dir", plugins]);
    assert_eq!(
        server.get("/server_info").await.expect(200, "info")["plugin"],
        "cpu"
    );
    drop(server);
    // `auto` tries cuda, ascend, then cpu, which has a device: it stops there.
    let server = Server::start_env(
        "broken-plugin-auto",
        &["--plugin-dir", plugins],
        &[("IRIS_DEVICE", "auto")],
    );
    assert_eq!(
        server.get("/server_info").await.expect(200, "info")["plugin"],
        "cpu"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigterm_drains_the_request_in_flight_and_exits_cleanly() {
    use tokio::io::{AsyncReadExt as _, AsyncWriteExt as _};
    // What `docker stop`, Kubernetes and systemd send: the server stops as on Ctrl-C, letting
    // the request it has taken finish (the default action killed it, and the request with it).
    let mut server = Server::start("sigterm", &[]);
    let body = json!({"images": [data_url(&png(56, 56, 9))]}).to_string();
    let (head, tail) = body.as_bytes().split_at(body.len() / 2);
    let addr = server.base.trim_start_matches("http://").to_owned();
    let mut client = tokio::net::TcpStream::connect(&addr)
        .await
        .expect("connects");
    let request_head = format!(
        "POST /v1/encode HTTP/1.1\r\nHost: {addr}\r\nContent-Type: application/json\r\nContent-Length: {}\r\nConnection: close\r\n\r\n",
        body.len()
    );
    client.write_all(request_head.as_bytes()).await.unwrap();
    client.write_all(head).await.unwrap();
    // The request is taken (its slot admitted, its body half read) before the signal.
    tokio::time::sleep(Duration::from_millis(300)).await;
    let pid = server.child.id().to_string();
    let killed = std::process::Command::new("kill")
        .args(["-TERM", &pid])
        .status()
        .expect("the kill program runs");
    assert!(killed.success());
    tokio::time::sleep(Duration::from_millis(300)).await;
    client.write_all(tail).await.unwrap();
    let mut answer = String::new();
    tokio::time::timeout(REQUEST_TIMEOUT, client.read_to_string(&mut answer))
        .await
        .expect("the answer comes")
        .expect("the answer reads");
    assert!(answer.starts_with("HTTP/1.1 200"), "{answer}");
    let deadline = std::time::Instant::now() + Duration::from_secs(30);
    let status = loop {
        if let Some(status) = server.child.try_wait().expect("waits") {
            break status;
        }
        assert!(
            std::time::Instant::now() < deadline,
            "iris serve still runs 30 s after SIGTERM"
        );
        tokio::time::sleep(Duration::from_millis(50)).await;
    };
    assert!(
        status.success(),
        "iris serve ended with {status} after SIGTERM"
    );
}
