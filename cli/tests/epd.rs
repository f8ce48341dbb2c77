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
    /// `iris serve` with the shared-storage connector writing to `<dir>/store`.
    fn start(name: &str) -> Encoder {
        Self::start_with(name, |dir| {
            json!({
                "ec_connector": "ECExampleConnector",
                "ec_role": "ec_producer",
                "ec_connector_extra_config": {"shared_storage_path": dir.join("store")},
            })
        })
    }

    /// `iris serve` with the `--ec-transfer-config` that `config` makes for its folder.
    fn start_with(name: &str, config: impl FnOnce(&Path) -> Value) -> Encoder {
        let dir = std::env::temp_dir().join(format!("iris-epd-{name}-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("store")).expect("store folder");
        let config = config(&dir).to_string();
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

/// Asserts that the store's entry `id` holds `rows` rows, the bytes `iris encode` computed.
fn assert_entry(encoder: &Encoder, id: &str, rows: usize, want: &[u8]) {
    let (shape, data) = entry(
        &encoder
            .dir
            .join("store")
            .join(id)
            .join("encoder_cache.safetensors"),
    );
    assert_eq!(shape, [rows, HIDDEN], "{id}");
    assert!(
        data == want,
        "{id}: the stored rows differ from iris encode's"
    );
}

/// `iris encode --dtype bf16` of `images` and `videos`, each tensor's f32 values narrowed back
/// to bf16 bytes (exact: they are widened bf16 values); the images' tensors, then the videos'.
fn iris_encode_bf16(
    dir: &Path,
    images: &[(&str, &[u8])],
    videos: &[(&str, &[u8])],
) -> Vec<Vec<u8>> {
    let mut paths = Vec::new();
    for (name, bytes) in images {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        paths.push(path);
    }
    let mut video_args = Vec::new();
    for (name, bytes) in videos {
        let path = dir.join(name);
        std::fs::write(&path, bytes).unwrap();
        video_args.push(std::ffi::OsString::from("--video"));
        video_args.push(path.into_os_string());
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
        .args(&video_args)
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
    let names = (0..images.len())
        .map(|i| format!("image.{i}"))
        .chain((0..videos.len()).map(|i| format!("video.{i}")));
    names
        .map(|name| {
            let tensor = file.tensor(&name).unwrap();
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

    let expected = iris_encode_bf16(&encoder.dir, &[("a.png", &png), ("b.jpg", &jpg)], &[]);
    for (id, rows, want) in [
        ("sha-of-the-url", 6, &expected[0]),
        (hashed.as_str(), 12, &expected[1]),
    ] {
        assert_entry(&encoder, id, rows, want);
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

/// A committed clip of the video goldens.
fn clip(name: &str) -> Vec<u8> {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../core/tests/fixtures/video")
        .join(name);
    std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()))
}

/// vLLM 0.33's identifier of `clip` read by the `qwen2_vl` loader for `MODEL_ID` with blake3 and
/// no uuid, under `media_io_kwargs` (the goldens its own hasher made).
fn golden_video_identifier(clip: &str, media_io_kwargs: &Value) -> String {
    let path =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../core/tests/fixtures/video/identifiers.json");
    let goldens: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    goldens
        .as_array()
        .unwrap()
        .iter()
        .find(|c| {
            c["clip"] == clip
                && c["loader"] == "qwen2_vl"
                && c["model_id"] == MODEL_ID
                && c["algorithm"] == "blake3"
                && c["uuid"].is_null()
                && c["mm_processor_kwargs"] == json!({})
                && c["media_io_kwargs"] == *media_io_kwargs
        })
        .and_then(|c| c["identifier"].as_str())
        .unwrap_or_else(|| panic!("a golden for {clip} under {media_io_kwargs}"))
        .to_owned()
}

fn video_part(bytes: &[u8], media: &str, uuid: Option<&str>) -> Value {
    let mut part = json!({"type": "video_url",
        "video_url": {"url": format!("data:{media};base64,{}", STANDARD.encode(bytes))}});
    if let Some(uuid) = uuid {
        part["uuid"] = json!(uuid);
    }
    part
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn videos_are_stored_as_iris_encode_computes_them_under_vllms_identifiers() {
    if !common::ffmpeg_runs() {
        return;
    }
    let encoder = Encoder::start("video");
    let (even, odd, jpg) = (clip("even10.mp4"), clip("odd9.mp4"), jpeg());
    let body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": [
            {"type": "text", "text": "what happens?"},
            video_part(&even, "video/mp4", Some("clip-even")),
            part(&jpg, "image/jpeg", None),
            // vLLM hands any data URL's payload to the decoder, whatever its media type says.
            video_part(&odd, "application/octet-stream", None),
        ]}],
    });
    let (status, reply) = encoder.post("/v1/chat/completions", &body, None).await;
    assert_eq!(status, 200, "{reply}");
    let params = reply["ec_transfer_params"].as_object().unwrap();
    assert_eq!(params.len(), 3, "{reply}");
    let hashed = golden_video_identifier("odd9.mp4", &json!({}));
    // `item_indices` count the request's items in order, whatever their modality (vLLM's
    // `mm_features`).
    for (id, index) in [("clip-even", 0), (hashed.as_str(), 2)] {
        let entry = &params[id];
        assert_eq!(entry["modality"], "video", "{reply}");
        assert_eq!(entry["item_indices"], json!([index]), "{reply}");
        let grid = entry["metadata"]["video_grid_thw"].as_array().unwrap();
        assert_eq!(grid.len(), 3, "{reply}");
        assert!(
            entry["metadata"].get("timestamps").is_none(),
            "a Qwen2-VL video has no timestamps: {reply}"
        );
    }
    let image = params
        .iter()
        .find(|(_, v)| v["modality"] == "image")
        .map(|(k, _)| k.clone())
        .unwrap();
    assert_eq!(params[&image]["item_indices"], json!([1]));

    let expected = iris_encode_bf16(&encoder.dir, &[], &[("even.mp4", &even), ("odd.mp4", &odd)]);
    for (id, want) in [("clip-even", &expected[0]), (hashed.as_str(), &expected[1])] {
        let grid: Vec<usize> = params[id]["metadata"]["video_grid_thw"]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| usize::try_from(v.as_u64().unwrap()).unwrap())
            .collect();
        let rows = grid.iter().product::<usize>() / 4;
        assert_entry(&encoder, id, rows, want);
    }
    let usage = reply["usage"]["prompt_tokens"].as_u64().unwrap();
    assert!(usage > 12, "{reply}");

    // iris's own /v1/encode takes the same clip, beside an image, and returns the same rows.
    let body = json!({
        "images": [format!("data:image/jpeg;base64,{}", STANDARD.encode(&jpg))],
        "videos": [format!("data:video/mp4;base64,{}", STANDARD.encode(&even))],
        "return_embeddings": "f32",
    });
    let (status, encoded) = encoder.post("/v1/encode", &body, None).await;
    assert_eq!(status, 200, "{encoded}");
    assert_eq!(encoded["usage"]["num_videos"], 1, "{encoded}");
    let video = &encoded["videos"][0];
    assert_eq!(video["index"], 1);
    assert_eq!(
        video["grid_thw"],
        params["clip-even"]["metadata"]["video_grid_thw"]
    );
    let data = STANDARD
        .decode(video["embeddings"]["data"].as_str().unwrap())
        .unwrap();
    let narrowed: Vec<u8> = data
        .chunks_exact(4)
        .flat_map(|c| half::bf16::from_f32(f32::from_le_bytes(c.try_into().unwrap())).to_le_bytes())
        .collect();
    assert!(
        narrowed == expected[0],
        "/v1/encode's rows differ from iris encode --video's"
    );

    // Sampling options are vLLM's hash factors: another identifier, vLLM's.
    let body = json!({
        "messages": [{"role": "user", "content": [video_part(&odd, "video/mp4", None)]}],
        "media_io_kwargs": {"video": {"fps": 2}},
    });
    let (status, reply) = encoder.post("/v1/chat/completions", &body, None).await;
    assert_eq!(status, 200, "{reply}");
    let id = golden_video_identifier("odd9.mp4", &json!({"video": {"fps": 2}}));
    assert!(reply["ec_transfer_params"].get(&id).is_some(), "{reply}");

    // A flat max_pixels reaches the video processor too (vLLM routes it to `videos_kwargs`):
    // each 80x60 frame is bounded to 56x56 pixels, so one 4x2 patch grid per temporal group.
    let body = json!({
        "messages": [{"role": "user", "content": [video_part(&odd, "video/mp4", None)]}],
        "mm_processor_kwargs": {"max_pixels": 3136},
    });
    let (status, reply) = encoder.post("/v1/chat/completions", &body, None).await;
    assert_eq!(status, 200, "{reply}");
    let (_, entry) = reply["ec_transfer_params"]
        .as_object()
        .and_then(|params| params.iter().next())
        .expect("one entry");
    let grid = &entry["metadata"]["video_grid_thw"];
    assert_eq!((&grid[1], &grid[2]), (&json!(2), &json!(4)), "{reply}");

    // A JPEG frame list: vLLM's frames, metadata and identifier (tools/video-goldens).
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../core/tests/fixtures/video/jpeg_sequence.json");
    let goldens: Value = serde_json::from_slice(&std::fs::read(path).unwrap()).unwrap();
    let payload = goldens["payload"].as_str().unwrap();
    let url = format!("data:video/jpeg;base64,{payload}");
    let body = json!({
        "messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": url}}]}],
    });
    let (status, reply) = encoder.post("/v1/chat/completions", &body, None).await;
    assert_eq!(status, 200, "{reply}");
    let id = goldens["cases"][0]["identifier"].as_str().unwrap();
    let entry = &reply["ec_transfer_params"][id];
    assert_eq!(entry["modality"], "video", "{reply}");
    // Three 64x48 frames: two temporal groups (the last frame repeated) of 2x2 merged blocks.
    assert_eq!(entry["metadata"]["video_grid_thw"][0], 2, "{reply}");
    assert!(
        encoder
            .dir
            .join("store")
            .join(id)
            .join("encoder_cache.safetensors")
            .is_file()
    );

    // Bad videos: a JSON 4xx naming the problem, nothing stored.
    let mut cut = even.clone();
    cut.truncate(300);
    // One frame: vLLM's qwen2_vl loader divides by zero there (a 500); iris names it.
    let single = encoder.dir.join("single.mp4");
    let made = std::process::Command::new("ffmpeg")
        .args([
            "-v",
            "error",
            "-f",
            "lavfi",
            "-i",
            "color=c=red:s=64x48:r=10",
            "-frames:v",
            "1",
        ])
        .arg(&single)
        .status()
        .expect("ffmpeg runs");
    assert!(made.success(), "ffmpeg makes a one-frame clip");
    let single = std::fs::read(&single).unwrap();
    let cases = [
        (
            video_part(&single, "video/mp4", None),
            json!(null),
            400,
            "video_too_short",
        ),
        (
            video_part(&cut, "video/mp4", None),
            json!(null),
            400,
            "corrupt_video",
        ),
        (
            video_part(b"", "video/mp4", None),
            json!(null),
            400,
            "corrupt_video",
        ),
        (
            // A clip sent as a JPEG frame list: its one "frame" is not an image.
            video_part(&even, "video/jpeg", None),
            json!(null),
            400,
            "unknown_image_format",
        ),
        (
            video_part(&even, "video/mp4", None),
            json!({"video": {"fps": -1}}),
            400,
            "invalid_media_io_kwargs",
        ),
        (
            video_part(&even, "video/mp4", None),
            json!({"video": {"video_backend": "opencv_dynamic"}}),
            400,
            "invalid_media_io_kwargs",
        ),
        (
            json!({"type": "video_embeds", "video_embeds": {}}),
            json!(null),
            400,
            "unsupported_content_part",
        ),
    ];
    let before = std::fs::read_dir(encoder.dir.join("store"))
        .unwrap()
        .count();
    for (part, media_io, status, code) in cases {
        let mut body = json!({"messages": [{"role": "user", "content": [part]}]});
        if !media_io.is_null() {
            body["media_io_kwargs"] = media_io;
        }
        let (got, reply) = encoder.post("/v1/chat/completions", &body, None).await;
        assert_eq!(
            (got, reply["error"]["code"].as_str()),
            (status, Some(code)),
            "{reply}"
        );
    }
    assert_eq!(
        std::fs::read_dir(encoder.dir.join("store"))
            .unwrap()
            .count(),
        before,
        "a refused video stores nothing"
    );
}

/// The push connector with a video: the proxy's `ec_transfer_params` name a consumer, iris
/// encodes the clip and writes its rows into the consumer's slab, as vLLM's
/// `ECMooncakeConnector` producer does for any item; the rows equal `iris encode --video`'s.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_video_is_pushed_to_the_consumer_as_iris_encode_computes_it() {
    if !common::ffmpeg_runs() {
        return;
    }
    let consumer = iris_ec::mooncake::consumer::TestConsumer::start(1, 1 << 20, 2)
        .await
        .expect("the consumer starts");
    let encoder = Encoder::start_with("push-video", |_| {
        json!({
            "ec_connector": "ECMooncakeConnector",
            "ec_role": "ec_producer",
            "ec_connector_extra_config": {"mooncake_protocol": "tcp", "control_timeout_s": 10},
        })
    });
    let (even, jpg) = (clip("even10.mp4"), jpeg());
    // As vLLM's proxy sends it: every item with a uuid, one transfer id per item.
    let body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": [
            video_part(&even, "video/mp4", Some("push-even")),
            part(&jpg, "image/jpeg", Some("push-photo")),
        ]}],
        "ec_transfer_params": {
            "consumer_zmq": consumer.consumer_zmq(),
            "ec_items": [{"transfer_id": "t-video"}, {"transfer_id": "t-image"}],
        },
    });
    let (status, reply) = encoder.post("/v1/chat/completions", &body, None).await;
    assert_eq!(status, 200, "{reply}");
    let params = &reply["ec_transfer_params"];
    assert_eq!(params["push-even"]["modality"], "video", "{reply}");
    assert_eq!(params["push-even"]["transfer_id"], "t-video", "{reply}");
    assert_eq!(params["push-photo"]["transfer_id"], "t-image", "{reply}");
    let grid: Vec<u64> = params["push-even"]["metadata"]["video_grid_thw"]
        .as_array()
        .expect("a video grid")
        .iter()
        .map(|v| v.as_u64().unwrap())
        .collect();
    let tokens = grid.iter().product::<u64>() / 4;

    let expected = iris_encode_bf16(&encoder.dir, &[("photo.jpg", &jpg)], &[("even.mp4", &even)]);
    let (rows, shape, dtype) = consumer
        .resident(0, "push-even")
        .expect("the video's rows are in the consumer's slab");
    assert_eq!(shape, vec![tokens, HIDDEN as u64]);
    assert_eq!(dtype, "bfloat16");
    assert!(
        rows == expected[1],
        "pushed video rows differ from iris encode --video's"
    );
    let (rows, _, _) = consumer
        .resident(0, "push-photo")
        .expect("the image's rows");
    assert!(
        rows == expected[0],
        "pushed image rows differ from iris encode's"
    );
    assert_eq!(consumer.live_reservations(), 0, "nothing left reserved");

    // A corrupt clip: a JSON 400 naming it; nothing pushed, nothing left reserved.
    let writes = consumer.writes().len();
    let mut cut = even.clone();
    cut.truncate(300);
    let body = json!({
        "model": MODEL_ID,
        "messages": [{"role": "user", "content": [video_part(&cut, "video/mp4", Some("push-cut"))]}],
        "ec_transfer_params": {
            "consumer_zmq": consumer.consumer_zmq(),
            "ec_items": [{"transfer_id": "t-cut"}],
        },
    });
    let (status, reply) = encoder.post("/v1/chat/completions", &body, None).await;
    assert_eq!(status, 400, "{reply}");
    assert_eq!(reply["error"]["code"], "corrupt_video", "{reply}");
    assert_eq!(consumer.writes().len(), writes);
    assert!(consumer.resident(0, "push-cut").is_none());
    assert_eq!(consumer.live_reservations(), 0);
}
