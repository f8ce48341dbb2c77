//! `iris serve` as vLLM's encoder instance, end to end: the real binary with the tiny model in
//! bf16 and a shared-storage store, driven over HTTP as vLLM's proxy drives an encoder. The
//! files it writes must hold exactly the rows `iris encode` computes for the same images in the
//! same dtype, under vLLM's identifiers.

use std::io::Cursor;
use std::path::{Path, PathBuf};
use std::process::Child;

use base64::Engine as _;
use base64::engine::general_purpose::STANDARD;
use http_body_util::{BodyExt, Full};
use hyper::body::Bytes;
use hyper::{Method, Request, header};
use hyper_util::client::legacy::Client;
use hyper_util::rt::TokioExecutor;
use serde_json::{Value, json};

mod common;

/// The tiny model's encoder output width.
const HIDDEN: usize = 64;
const MODEL_ID: &str = "Qwen/Qwen2.5-VL-3B-Instruct";

struct Encoder {
    child: Child,
    dir: PathBuf,
    base: String,
}

impl Drop for Encoder {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
        let _ = std::fs::remove_dir_all(&self.dir);
    }
}

impl Encoder {
    fn start(name: &str) -> Encoder {
        let dir = std::env::temp_dir().join(format!("iris-epd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("store")).expect("store folder");
        let config = json!({
            "ec_connector": "ECExampleConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"shared_storage_path": dir.join("store")},
        })
        .to_string();
        let stderr_path = dir.join("stderr.txt");
        let stderr = std::fs::File::create(&stderr_path).expect("stderr file");
        let extra = [
            "--dtype",
            "bf16",
            "--model-id",
            MODEL_ID,
            "--ec-transfer-config",
            &config,
        ];
        let (child, base) =
            common::spawn_serve(&dir, &extra, &[], stderr.into()).unwrap_or_else(|err| {
                panic!(
                    "{err}; stderr:\n{}",
                    std::fs::read_to_string(&stderr_path).unwrap_or_default()
                )
            });
        Encoder { child, dir, base }
    }

    async fn post(&self, path: &str, body: &Value, request_id: Option<&str>) -> (u16, Value) {
        let client = Client::builder(TokioExecutor::new()).build_http();
        let mut builder = Request::builder()
            .method(Method::POST)
            .uri(format!("{}{path}", self.base))
            .header(header::CONTENT_TYPE, "application/json");
        if let Some(id) = request_id {
            builder = builder.header("x-request-id", id);
        }
        let request = builder
            .body(Full::new(Bytes::from(body.to_string())))
            .expect("request builds");
        let response = client.request(request).await.expect("the server answers");
        let status = response.status().as_u16();
        let bytes = response.into_body().collect().await.unwrap().to_bytes();
        let json = serde_json::from_slice(&bytes).unwrap_or(Value::Null);
        (status, json)
    }
}

/// A PNG with a semi-transparent half: vLLM pastes it on white before its processor sees it.
fn rgba_png() -> Vec<u8> {
    let img = image::RgbaImage::from_fn(84, 56, |x, y| {
        let alpha = if x < 42 { 255 } else { 96 };
        image::Rgba([low_byte(x * 3), low_byte(y * 4), 200, alpha])
    });
    encode(
        image::DynamicImage::ImageRgba8(img),
        image::ImageFormat::Png,
    )
}

fn jpeg() -> Vec<u8> {
    let img = image::RgbImage::from_fn(112, 84, |x, y| {
        image::Rgb([low_byte(x * 2), low_byte(y * 3), 40])
    });
    encode(
        image::DynamicImage::ImageRgb8(img),
        image::ImageFormat::Jpeg,
    )
}

/// A pattern value: the low byte of `v`.
fn low_byte(v: u32) -> u8 {
    v.to_le_bytes()[0]
}

fn encode(img: image::DynamicImage, format: image::ImageFormat) -> Vec<u8> {
    let mut out = Cursor::new(Vec::new());
    img.write_to(&mut out, format).expect("encodes");
    out.into_inner()
}

fn part(bytes: &[u8], media: &str, uuid: Option<&str>) -> Value {
    let mut part = json!({"type": "image_url",
        "image_url": {"url": format!("data:{media};base64,{}", STANDARD.encode(bytes))}});
    if let Some(uuid) = uuid {
        part["uuid"] = json!(uuid);
    }
    part
}

/// `(shape, raw bf16 bytes)` of an entry's `ec_cache`.
fn entry(path: &Path) -> ([usize; 2], Vec<u8>) {
    let bytes = std::fs::read(path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let file = safetensors::SafeTensors::deserialize(&bytes).expect("a safetensors file");
    assert_eq!(file.names(), vec!["ec_cache"]);
    let tensor = file.tensor("ec_cache").unwrap();
    assert_eq!(tensor.dtype(), safetensors::Dtype::BF16);
    (
        [tensor.shape()[0], tensor.shape()[1]],
        tensor.data().to_vec(),
    )
}

/// `iris encode --dtype bf16` of `images`, each tensor's f32 values narrowed back to bf16
/// bytes (exact: they are widened bf16 values).
fn iris_encode_bf16(dir: &Path, images: &[(&str, &[u8])]) -> Vec<Vec<u8>> {
    let mut paths = Vec::new();
    for (name, bytes) in images {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        paths.push(path);
    }
    let out = dir.join("encode.safetensors");
    let output = common::iris(dir)
        .args([
            "encode",
            "--device",
            "cpu",
            "--model",
            "tiny",
            "--weights",
            "dummy",
        ])
        .args(["--dtype", "bf16", "--out"])
        .arg(&out)
        .args(&paths)
        .output()
        .expect("iris encode runs");
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let bytes = std::fs::read(&out).unwrap();
    let file = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    (0..images.len())
        .map(|i| {
            let tensor = file.tensor(&format!("image.{i}")).unwrap();
            tensor
                .data()
                .chunks_exact(4)
                .flat_map(|c| {
                    let value = f32::from_le_bytes(c.try_into().unwrap());
                    let narrowed = half::bf16::from_f32(value);
                    assert_eq!(
                        narrowed.to_f32().to_bits(),
                        value.to_bits(),
                        "a widened bf16 value"
                    );
                    narrowed.to_le_bytes()
                })
                .collect()
        })
        .collect()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_store_holds_exactly_what_iris_encode_computes_under_vllms_identifiers() {
    let encoder = Encoder::start("rows");
    let (png, jpg) = (rgba_png(), jpeg());
    let body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "compare these"},
            part(&png, "image/png", Some("sha-of-the-url")),
            part(&jpg, "image/jpeg", None),
        ]}],
        "stream": false,
    });
    let (status, reply) = encoder
        .post("/v1/chat/completions", &body, Some("req-1"))
        .await;
    assert_eq!(status, 200, "{reply}");
    assert_eq!(reply["id"], "chatcmpl-req-1");
    let params = reply["ec_transfer_params"]
        .as_object()
        .expect("ec_transfer_params");
    assert_eq!(params.len(), 2, "{reply}");
    // 84x56 -> 84x56 (multiples of 28) -> grid 1x4x6; 112x84 -> 1x6x8.
    assert_eq!(
        params["sha-of-the-url"]["metadata"]["image_grid_thw"],
        json!([1, 4, 6])
    );
    let hashed = params
        .keys()
        .find(|k| *k != "sha-of-the-url")
        .unwrap()
        .clone();
    assert_eq!(params[&hashed]["item_indices"], json!([1]));
    assert_eq!(
        params[&hashed]["metadata"]["image_grid_thw"],
        json!([1, 6, 8])
    );

    let expected = iris_encode_bf16(&encoder.dir, &[("a.png", &png), ("b.jpg", &jpg)]);
    for (id, rows, want) in [
        ("sha-of-the-url", 6, &expected[0]),
        (hashed.as_str(), 12, &expected[1]),
    ] {
        let (shape, data) = entry(
            &encoder
                .dir
                .join("store")
                .join(id)
                .join("encoder_cache.safetensors"),
        );
        assert_eq!(shape, [rows, HIDDEN], "{id}");
        assert!(
            data == *want,
            "{id}: the stored rows differ from iris encode's"
        );
    }

    // Sent again: nothing is encoded (the store has both), the reply is the same.
    let (status, again) = encoder.post("/v1/chat/completions", &body, None).await;
    assert_eq!(status, 200, "{again}");
    assert_eq!(again["ec_transfer_params"], reply["ec_transfer_params"]);
    let client = Client::builder(TokioExecutor::new()).build_http::<Full<Bytes>>();
    let metrics = client
        .get(format!("{}/metrics", encoder.base).parse().unwrap())
        .await
        .unwrap()
        .into_body()
        .collect()
        .await
        .unwrap()
        .to_bytes();
    let metrics = String::from_utf8_lossy(&metrics);
    assert!(
        metrics.contains("iris_ec_store_writes_total 2"),
        "{metrics}"
    );
    assert!(metrics.contains("iris_ec_store_hits_total 2"), "{metrics}");
}
