//! Video sampling and processing against goldens made by vLLM 0.33's loaders and transformers
//! 5.24's video processors (`tools/video-goldens/make.py`): frame indices for the `qwen2_vl`
//! and `qwen3_vl` loaders (refusals included), Qwen3-VL's timestamps, and the pixel values and
//! grids of `Qwen2VLVideoProcessor` and `Qwen3VLVideoProcessor` on synthetic frames, bit for
//! bit.

use std::path::PathBuf;

use iris_core::preprocess::video::{
    SamplingOptions, VideoError, VideoLoader, VideoResize, preprocess_frames, qwen3_timestamps,
    sample_frames,
};
use iris_core::preprocess::{ImageSize, ProcessorConfig, RgbImage};
use safetensors::SafeTensors;
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/video")
}

fn json(name: &str) -> Value {
    let text = std::fs::read_to_string(fixtures().join(name)).expect("the fixture exists");
    serde_json::from_str(&text).expect("JSON")
}

fn indices(value: &Value) -> Vec<u32> {
    value
        .as_array()
        .expect("a list")
        .iter()
        .map(|v| u32::try_from(v.as_u64().expect("an index")).expect("small"))
        .collect()
}

#[test]
fn frame_indices_equal_vllms_loaders() {
    let goldens = json("sampling.json");
    let mut checked = 0;
    for case in goldens["cases"].as_array().expect("cases") {
        let total = u32::try_from(case["total"].as_u64().expect("total")).expect("small");
        let source_fps = case["source_fps"].as_f64().expect("fps");
        let options = SamplingOptions {
            fps: case["fps"].as_f64().expect("fps"),
            ..SamplingOptions::default()
        };
        for (loader, key) in [
            (VideoLoader::Qwen2Vl, "qwen2_vl"),
            (VideoLoader::Qwen3Vl, "qwen3_vl"),
        ] {
            let got = sample_frames(loader, total, source_fps, &options);
            let expected = &case[key];
            if let Some(error) = expected.get("error") {
                // vLLM raises (a ZeroDivisionError for one frame, which it answers 500); iris
                // refuses with a named reason.
                let err = got.expect_err(&format!("{key} {total}@{source_fps}: {error}"));
                match error.as_str() {
                    Some("ValueError") => assert_eq!(err, VideoError::UnknownFrameRate),
                    Some("ZeroDivisionError") => {
                        assert!(matches!(err, VideoError::TooFewFrames { .. }), "{err}");
                    }
                    other => panic!("unexpected golden error {other:?}"),
                }
            } else {
                assert_eq!(
                    got.expect("sampled"),
                    indices(expected),
                    "{key}: {total} frames at {source_fps} fps, sampling at {}",
                    options.fps
                );
            }
            checked += 1;
        }
    }
    assert!(checked >= 30, "{checked} cases");
}

#[test]
fn qwen3_timestamps_equal_vllms() {
    let goldens = json("sampling.json");
    for case in goldens["timestamps"].as_array().expect("timestamps") {
        let expected: Vec<f64> = case["timestamps"]
            .as_array()
            .expect("a list")
            .iter()
            .map(|v| v.as_f64().expect("a float"))
            .collect();
        let got = qwen3_timestamps(
            &indices(&case["indices"]),
            case["source_fps"].as_f64().expect("fps"),
            2,
        );
        assert_eq!(got, expected, "{case}");
    }
}

#[test]
fn pixel_values_equal_transformers_video_processors() {
    let bytes = std::fs::read(fixtures().join("processors.safetensors")).expect("the fixture");
    let tensors = SafeTensors::deserialize(&bytes).expect("safetensors");
    for spec in json("processors.json").as_array().expect("specs") {
        let name = spec["name"].as_str().expect("a name");
        let (mut config, resize) = match spec["processor"].as_str() {
            Some("qwen2") => (ProcessorConfig::qwen2_vl(), VideoResize::PerFrame),
            Some("qwen3") => (ProcessorConfig::qwen3_vl(), VideoResize::OverAllFrames),
            other => panic!("unknown processor {other:?}"),
        };
        config.min_pixels = spec["size"]["shortest_edge"].as_u64().expect("shortest");
        config.max_pixels = spec["size"]["longest_edge"].as_u64().expect("longest");

        let frames_view = tensors.tensor(&format!("{name}.frames")).expect("frames");
        let shape = frames_view.shape();
        let (n, h, w) = (shape[0], shape[1], shape[2]);
        let frame_bytes = h * w * 3;
        let frames: Vec<RgbImage> = frames_view
            .data()
            .chunks_exact(frame_bytes)
            .map(|pixels| RgbImage {
                size: ImageSize::new(
                    u32::try_from(w).expect("width"),
                    u32::try_from(h).expect("height"),
                ),
                pixels: pixels.to_vec(),
            })
            .collect();
        assert_eq!(frames.len(), n);

        let video = preprocess_frames(&frames, &config, resize).expect("processed");
        let grid: Vec<u32> = indices(&spec["grid_thw"]);
        assert_eq!(video.grid_thw.to_vec(), grid, "{name}: grid");
        let expected: Vec<f32> = tensors
            .tensor(&format!("{name}.pixel_values"))
            .expect("pixel values")
            .data()
            .chunks_exact(4)
            .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
            .collect();
        assert_eq!(video.pixel_values.len(), expected.len(), "{name}: values");
        let differing = video
            .pixel_values
            .iter()
            .zip(&expected)
            .filter(|(a, b)| a.to_bits() != b.to_bits())
            .count();
        assert_eq!(
            differing,
            0,
            "{name}: {differing} of {} values differ from transformers'",
            expected.len()
        );
    }
}

#[test]
fn bad_videos_are_refused_with_the_reason() {
    let frame = |w: u32, h: u32| RgbImage {
        size: ImageSize::new(w, h),
        pixels: vec![128; (w * h * 3) as usize],
    };
    let qwen3 = ProcessorConfig::qwen3_vl();
    // Qwen3-VL's resize needs a temporal patch of frames (transformers raises).
    let err = preprocess_frames(&[frame(64, 64)], &qwen3, VideoResize::OverAllFrames)
        .expect_err("one frame");
    assert!(matches!(err, VideoError::TooFewFrames { .. }), "{err}");
    // Frames of different sizes.
    let err = preprocess_frames(
        &[frame(64, 64), frame(64, 32)],
        &ProcessorConfig::qwen2_vl(),
        VideoResize::PerFrame,
    )
    .expect_err("mixed sizes");
    assert!(err.to_string().contains("frame 1 is 64x32"), "{err}");
    assert_eq!(
        preprocess_frames(&[], &qwen3, VideoResize::OverAllFrames),
        Err(VideoError::NoFrames)
    );
    // A non-positive sampling rate.
    let options = SamplingOptions {
        fps: 0.0,
        ..SamplingOptions::default()
    };
    assert!(sample_frames(VideoLoader::Qwen3Vl, 10, 30.0, &options).is_err());
}
