//! `iris encode` end to end on the built-in CPU device: images in, embeddings out.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use safetensors::SafeTensors;

// Each test binary uses a part of the shared helpers; this one starts no server.
#[allow(dead_code)]
mod common;

/// A fresh folder for one test's files.
fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("iris-encode-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp folder");
    dir
}

fn write_image(path: &Path, width: u32, height: u32) {
    let image = image::RgbImage::from_fn(width, height, |x, y| {
        // Truncation keeps each channel in 0..=255 by construction.
        #[allow(clippy::cast_possible_truncation)]
        image::Rgb([
            (x * 7 % 256) as u8,
            (y * 5 % 256) as u8,
            ((x + y) % 256) as u8,
        ])
    });
    image.save(path).expect("test image written");
}

fn iris(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iris"))
        .args(args)
        .env("IRIS_DEVICE", "cpu")
        .env_remove("IRIS_PLUGIN_PATH")
        .output()
        .expect("iris runs")
}

fn tensor_shape(file: &Path, name: &str) -> Vec<usize> {
    let bytes = std::fs::read(file).expect("output exists");
    let tensors = SafeTensors::deserialize(&bytes).expect("output parses");
    tensors
        .tensor(name)
        .unwrap_or_else(|_| panic!("output has `{name}`"))
        .shape()
        .to_vec()
}

fn f32_values(file: &Path, name: &str) -> Vec<f32> {
    let bytes = std::fs::read(file).expect("output exists");
    let tensors = SafeTensors::deserialize(&bytes).expect("output parses");
    let view = tensors.tensor(name).expect("tensor present");
    view.data()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

#[test]
fn tiny_model_encodes_a_png_and_a_jpeg() {
    let dir = scratch("tiny");
    let (a, b) = (dir.join("a.png"), dir.join("b.jpg"));
    write_image(&a, 64, 48);
    write_image(&b, 100, 70);
    let out = dir.join("x.safetensors");
    let args = [
        "encode",
        "--model",
        "tiny",
        "--weights",
        "dummy",
        "--out",
        out.to_str().unwrap(),
        a.to_str().unwrap(),
        b.to_str().unwrap(),
    ];
    let result = iris(&args);
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&result.stderr)
    );
    // 64x48 -> 56x56 (multiples of 28, above min_pixels): a 4x4 grid, 4 tokens.
    assert!(
        stdout.contains("a.png: 64x48 -> 56x56, grid [1, 4, 4], 4 tokens"),
        "{stdout}"
    );
    assert_eq!(tensor_shape(&out, "image.0"), vec![4, 64]);
    let b_shape = tensor_shape(&out, "image.1");
    assert_eq!(b_shape[1], 64);
    assert!(stdout.contains("b.jpg: 100x70 ->"), "{stdout}");

    // One batched call gives the same embeddings as one call per image.
    let batched = dir.join("batched.safetensors");
    let mut batch_args = args.to_vec();
    batch_args[6] = batched.to_str().unwrap();
    batch_args.insert(1, "--batch");
    let result = iris(&batch_args);
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    for name in ["image.0", "image.1"] {
        let single = f32_values(&out, name);
        let together = f32_values(&batched, name);
        assert_eq!(single.len(), together.len());
        let worst = single
            .iter()
            .zip(&together)
            .map(|(x, y)| (x - y).abs())
            .fold(0f32, f32::max);
        assert!(worst < 1e-4, "{name}: batched differs by {worst}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn unsupported_and_missing_images_are_clear_errors() {
    let dir = scratch("errors");
    let qoi = dir.join("x.qoi");
    // A minimal QOI header: recognised, and refused by name.
    std::fs::write(&qoi, b"qoif\x00\x00\x00\x01\x00\x00\x00\x01\x03\x00").unwrap();
    let out = dir.join("x.safetensors");
    let result = iris(&[
        "encode",
        "--out",
        out.to_str().unwrap(),
        qoi.to_str().unwrap(),
    ]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(stderr.contains("x.qoi"), "{stderr}");
    assert!(stderr.contains("QOI"), "{stderr}");
    assert!(!out.exists(), "no output is written when an input is bad");

    let missing = dir.join("missing.png");
    let result = iris(&[
        "encode",
        "--out",
        out.to_str().unwrap(),
        missing.to_str().unwrap(),
    ]);
    assert!(!result.status.success());
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(stderr.contains("missing.png"), "{stderr}");

    let result = iris(&[
        "encode",
        "--model",
        "qwen9-vl",
        "--out",
        out.to_str().unwrap(),
        qoi.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&result.stderr);
    assert!(
        stderr.contains("unknown model preset `qwen9-vl`"),
        "{stderr}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn pixel_bounds_resize_as_a_request_s_processor_kwargs_do() {
    let dir = scratch("pixels");
    let image = dir.join("wide.png");
    write_image(&image, 224, 168);
    let image = image.to_str().expect("utf-8 path");

    // The model's bounds: 224x168 is 16x12 patches, 48 tokens after the 2x2 merge.
    let default_out = dir.join("default.safetensors");
    let out = iris(&[
        "encode",
        "--model",
        "tiny",
        "--out",
        default_out.to_str().unwrap(),
        image,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(tensor_shape(&default_out, "image.0"), vec![48, 64]);

    // max_pixels 12544 (112x112) shrinks it to 8x6 patches, 12 tokens, as vLLM's processor does.
    let small_out = dir.join("small.safetensors");
    let out = iris(&[
        "encode",
        "--model",
        "tiny",
        "--max-pixels",
        "12544",
        "--out",
        small_out.to_str().unwrap(),
        image,
    ]);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(tensor_shape(&small_out, "image.0"), vec![12, 64]);

    // Bounds that contradict each other are refused, naming the field.
    let out = iris(&[
        "encode",
        "--model",
        "tiny",
        "--min-pixels",
        "20000",
        "--max-pixels",
        "12544",
        "--out",
        dir.join("bad.safetensors").to_str().unwrap(),
        image,
    ]);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success() && stderr.contains("min_pixels"),
        "{stderr}"
    );

    // So are bounds no image may resize to (10^13 pixels would be tens of terabytes), and a
    // lower bound of 0 (a side shorter than half a patch group would resize to nothing).
    for (min, max, named) in [
        (
            "10000000000000",
            "10000000000000",
            "--min-pixels 10000000000000 is above",
        ),
        ("0", "12544", "min_pixels"),
    ] {
        let out = iris(&[
            "encode",
            "--model",
            "tiny",
            "--min-pixels",
            min,
            "--max-pixels",
            max,
            "--out",
            dir.join("bad.safetensors").to_str().unwrap(),
            image,
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(!out.status.success() && stderr.contains(named), "{stderr}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn repeat_times_one_batch_in_one_process_and_timings_json_reports_each_call() {
    let dir = scratch("repeat");
    let image = dir.join("a.png");
    write_image(&image, 112, 112);
    let image = image.to_str().expect("utf-8 path");
    let out = dir.join("x.safetensors");
    let timings = dir.join("timings.json");
    let result = iris(&[
        "encode",
        "--model",
        "tiny",
        "--weights",
        "dummy",
        "--batch",
        "--warmup",
        "--repeat",
        "3",
        "--timings-json",
        timings.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        image,
        image,
    ]);
    let stdout = String::from_utf8_lossy(&result.stdout);
    assert!(
        result.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&result.stderr)
    );
    // The first timed call's lines as without --repeat, then the spread of all three.
    assert!(stdout.contains("16 tokens, batch of 2 in "), "{stdout}");
    assert!(
        stdout.contains("3 calls of the batch of 2: median "),
        "{stdout}"
    );
    assert_eq!(tensor_shape(&out, "image.1"), vec![16, 64]);

    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&timings).expect("timings written"))
            .expect("timings parse");
    assert_eq!(t["model"], "tiny", "{t}");
    assert_eq!(t["dtype"], "f32", "{t}");
    assert_eq!(t["plugin"], "cpu", "{t}");
    assert!(t["device"].as_str().is_some_and(|d| !d.is_empty()), "{t}");
    assert_eq!(
        (t["batch"].as_bool(), t["warmup"].as_bool()),
        (Some(true), Some(true)),
        "{t}"
    );
    // 112x112: 8x8 patches, 16 tokens per image after the 2x2 merge.
    assert_eq!(
        (t["images"].as_u64(), t["tokens"].as_u64()),
        (Some(2), Some(32)),
        "{t}"
    );
    let calls = t["calls_ms"].as_array().expect("calls_ms");
    assert_eq!(calls.len(), 3, "{t}");
    let finite_positive =
        |v: &serde_json::Value| v.as_f64().is_some_and(|x| x.is_finite() && x > 0.0);
    assert!(calls.iter().all(finite_positive), "{t}");
    assert!(finite_positive(&t["first_call_ms"]), "{t}");
    assert!(finite_positive(&t["load_ms"]), "{t}");
    // Each call's forward pass alone, within the call.
    let forward = t["forward_ms"].as_array().expect("forward_ms");
    assert_eq!(forward.len(), 3, "{t}");
    for (f, c) in forward.iter().zip(calls) {
        assert!(finite_positive(f), "{t}");
        assert!(f.as_f64() <= c.as_f64(), "{t}");
    }
    assert!(
        t["first_forward_ms"].as_f64() <= t["first_call_ms"].as_f64(),
        "{t}"
    );
    assert!(stdout.contains("; forward pass alone: median "), "{stdout}");

    // Without --warmup the first call is the first timed one; one call per image without --batch.
    let result = iris(&[
        "encode",
        "--model",
        "tiny",
        "--timings-json",
        timings.to_str().unwrap(),
        "--out",
        out.to_str().unwrap(),
        image,
        image,
    ]);
    assert!(
        result.status.success(),
        "{}",
        String::from_utf8_lossy(&result.stderr)
    );
    let t: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&timings).unwrap()).unwrap();
    assert_eq!(t["warmup"], false, "{t}");
    assert_eq!(t["calls_ms"].as_array().map(Vec::len), Some(2), "{t}");
    assert_eq!(t["first_call_ms"], t["calls_ms"][0], "{t}");
    assert_eq!(t["first_forward_ms"], t["forward_ms"][0], "{t}");

    // --repeat means repeating one batch: without --batch it is refused, as is 0.
    for bad in [&["--repeat", "2"][..], &["--batch", "--repeat", "0"][..]] {
        let mut args = vec!["encode", "--model", "tiny", "--out", out.to_str().unwrap()];
        args.extend_from_slice(bad);
        args.push(image);
        let result = iris(&args);
        let stderr = String::from_utf8_lossy(&result.stderr);
        assert!(
            !result.status.success() && stderr.contains("--repeat"),
            "{bad:?}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}

/// A committed clip (see `core/tests/fixtures/video`).
fn clip(name: &str) -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../core/tests/fixtures/video")
        .join(name)
        .display()
        .to_string()
}

#[test]
fn videos_encode_with_the_models_loader_and_processor() {
    if !common::ffmpeg_runs() {
        return;
    }
    let dir = scratch("video");
    let out = dir.join("out.safetensors");
    let output = iris(&[
        "encode",
        "--model",
        "tiny",
        "--out",
        out.to_str().expect("utf-8 path"),
        "--video",
        &clip("odd9.mp4"),
    ]);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    // 9 frames at 12 fps sampled at 2 fps: the qwen2_vl loader's 4 frames, two temporal
    // groups of 84x56 (6x4 patches): 2 x 24 patches, 12 tokens.
    assert!(
        stdout.contains("odd9.mp4: 4 frames of 80x60 -> 84x56, grid [2, 4, 6], 12 tokens"),
        "{stdout}"
    );
    assert_eq!(tensor_shape(&out, "video.0")[0], 12);
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn a_video_without_ffmpeg_or_a_corrupt_clip_is_a_clear_error() {
    let dir = scratch("video-errors");
    let out = dir.join("out.safetensors");
    let output = Command::new(env!("CARGO_BIN_EXE_iris"))
        .args(["encode", "--model", "tiny", "--out"])
        .arg(&out)
        .args(["--video", &clip("odd9.mp4")])
        .env("IRIS_DEVICE", "cpu")
        .env("IRIS_FFPROBE", dir.join("no-such-ffprobe"))
        .output()
        .expect("iris runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("videos need FFmpeg"), "{stderr}");
    assert!(stderr.contains("apt-get install ffmpeg"), "{stderr}");

    if common::ffmpeg_runs() {
        let corrupt = dir.join("corrupt.mp4");
        std::fs::write(&corrupt, b"not a video").expect("written");
        let output = iris(&[
            "encode",
            "--model",
            "tiny",
            "--out",
            out.to_str().expect("utf-8 path"),
            "--video",
            corrupt.to_str().expect("utf-8 path"),
        ]);
        assert!(!output.status.success());
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains("cannot decode the video"), "{stderr}");
        assert!(!out.exists(), "nothing written for a failed encode");
    }
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn an_integer_dtype_is_refused_naming_the_flag() {
    let dir = scratch("dtype");
    let image = dir.join("a.png");
    write_image(&image, 56, 56);
    for dtype in ["u8", "i32", "f64"] {
        let out = iris(&[
            "encode",
            "--model",
            "tiny",
            "--dtype",
            dtype,
            "--out",
            dir.join("x.safetensors").to_str().unwrap(),
            image.to_str().unwrap(),
        ]);
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(
            !out.status.success()
                && stderr.contains(&format!(
                    "--dtype: expected f32, f16 or bf16, got `{dtype}`"
                )),
            "{dtype}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
