//! Video item identifiers against vLLM 0.33's own `ProcessorInputs.get_mm_hashes` on its
//! loaders' items (`tools/video-goldens/decode.py`): the committed clips decoded by iris, with and
//! without a uuid, with video and other modalities' hash factors, in blake3 and sha256.
//!
//! Decoding needs the FFmpeg programs; `.ci/run` installs them and sets `IRIS_REQUIRE_FFMPEG`,
//! under which their absence fails instead of skipping.

use std::path::PathBuf;

use iris_core::preprocess::video::ffmpeg::{Ffmpeg, VideoLimits, load_video};
use iris_core::preprocess::video::{SamplingOptions, VideoLoader};
use iris_ec::identifier::{HashAlgorithm, HashFactors, OrderedJson, VideoSource, video_identifier};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../core/tests/fixtures/video")
}

/// A factor as the request carries it; an empty object is no factor.
fn factor(name: &'static str, value: &Value) -> Option<OrderedJson> {
    let empty = value.as_object().is_some_and(serde_json::Map::is_empty);
    (!empty).then(|| OrderedJson::parse(name, &value.to_string()).expect("a JSON object"))
}

#[test]
fn video_identifiers_equal_vllms() {
    let ffmpeg = match Ffmpeg::locate() {
        Ok(found) => found,
        Err(err) if std::env::var_os("IRIS_REQUIRE_FFMPEG").is_none() => {
            eprintln!("skipped: {err}");
            return;
        }
        Err(err) => panic!("IRIS_REQUIRE_FFMPEG is set: {err}"),
    };
    let goldens: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("identifiers.json")).expect("goldens"),
    )
    .expect("JSON");
    let mut checked = 0;
    let mut decoded = std::collections::HashMap::new();
    for case in goldens.as_array().expect("cases") {
        let clip = case["clip"].as_str().expect("a clip");
        let bytes = std::fs::read(fixtures().join(clip)).expect("the clip");
        let loader = match case["loader"].as_str() {
            Some("qwen2_vl") => VideoLoader::Qwen2Vl,
            Some("qwen3_vl") => VideoLoader::Qwen3Vl,
            other => panic!("unknown loader {other:?}"),
        };
        // Each clip decodes once per loader.
        let video = decoded
            .entry((clip, case["loader"].as_str()))
            .or_insert_with(|| {
                load_video(
                    &ffmpeg,
                    &bytes,
                    loader,
                    &SamplingOptions::default(),
                    &VideoLimits::default(),
                )
                .expect("decoded")
            });
        let item = VideoSource {
            uuid: case["uuid"].as_str(),
            bytes: &bytes,
            frames: &video.frames,
            metadata: &video.metadata,
        };
        let factors = HashFactors {
            media_io_kwargs: factor("media_io_kwargs", &case["media_io_kwargs"]),
            mm_processor_kwargs: factor("mm_processor_kwargs", &case["mm_processor_kwargs"]),
        };
        let algorithm = match case["algorithm"].as_str() {
            Some("blake3") => HashAlgorithm::Blake3,
            Some("sha256") => HashAlgorithm::Sha256,
            other => panic!("unknown algorithm {other:?}"),
        };
        let model_id = case["model_id"].as_str().expect("a model id");
        assert_eq!(
            video_identifier(algorithm, model_id, &item, &factors),
            case["identifier"].as_str().expect("an identifier"),
            "{case}"
        );
        checked += 1;
    }
    assert!(checked >= 100, "{checked} cases");
}
