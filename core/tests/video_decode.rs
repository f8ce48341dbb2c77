//! Decoding clips as vLLM 0.33's `qwen2_vl` and `qwen3_vl` loaders do through their default
//! OpenCV decoder (`tools/video-goldens/decode.py` made the goldens): the same frame count,
//! rate, duration and indices, and the same RGB frames, bit for bit, for H.264 in MP4 with an
//! even and an odd frame count and for VP9 in WebM (which gives no frame count). Bad clips are
//! refused with FFmpeg's reason, and a container that would open other files (an HLS playlist)
//! is refused by name.
//!
//! These tests need the FFmpeg programs; `.ci/run` installs them and sets
//! `IRIS_REQUIRE_FFMPEG`, under which their absence fails instead of skipping.

use std::path::PathBuf;

use iris_core::preprocess::video::ffmpeg::{Ffmpeg, VideoLimits, load_video};
use iris_core::preprocess::video::{SamplingOptions, VideoError, VideoLoader};
use serde_json::Value;

fn fixtures() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/video")
}

/// FFmpeg, or `None` (with the reason printed) where it is not installed and not required.
fn ffmpeg() -> Option<Ffmpeg> {
    match Ffmpeg::locate() {
        Ok(found) => Some(found),
        Err(err) if std::env::var_os("IRIS_REQUIRE_FFMPEG").is_none() => {
            eprintln!("skipped: {err}");
            None
        }
        Err(err) => panic!("IRIS_REQUIRE_FFMPEG is set: {err}"),
    }
}

#[test]
fn clips_decode_as_vllms_loaders_read_them() {
    let Some(ffmpeg) = ffmpeg() else { return };
    let goldens: Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures().join("decode.json")).expect("goldens"),
    )
    .expect("JSON");
    for entry in goldens.as_array().expect("clips") {
        let clip = entry["clip"].as_str().expect("a clip");
        let bytes = std::fs::read(fixtures().join(clip)).expect("the clip");
        for (loader, key) in [
            (VideoLoader::Qwen2Vl, "qwen2_vl"),
            (VideoLoader::Qwen3Vl, "qwen3_vl"),
        ] {
            let expected = &entry[key];
            let video = load_video(
                &ffmpeg,
                &bytes,
                loader,
                &SamplingOptions::default(),
                &VideoLimits::default(),
            )
            .unwrap_or_else(|err| panic!("{clip} {key}: {err}"));
            let meta = &expected["metadata"];
            let got = &video.metadata;
            assert_eq!(
                u64::from(got.total_num_frames),
                meta["total_num_frames"].as_u64().expect("frames"),
                "{clip} {key}: frame count"
            );
            assert_eq!(
                got.fps,
                meta["fps"].as_f64().expect("fps"),
                "{clip} {key}: fps"
            );
            assert_eq!(
                got.duration,
                meta["duration"].as_f64().expect("duration"),
                "{clip} {key}: duration"
            );
            let indices: Vec<u64> = got.frames_indices.iter().map(|&i| u64::from(i)).collect();
            let want: Vec<u64> = meta["frames_indices"]
                .as_array()
                .expect("indices")
                .iter()
                .map(|v| v.as_u64().expect("an index"))
                .collect();
            assert_eq!(indices, want, "{clip} {key}: indices");
            assert_eq!(
                got.do_sample_frames,
                meta["do_sample_frames"].as_bool().expect("a flag")
            );
            let hashes: Vec<String> = video
                .frames
                .iter()
                .map(|f| blake3::hash(&f.pixels).to_hex().to_string())
                .collect();
            let want: Vec<&str> = expected["frame_hashes"]
                .as_array()
                .expect("hashes")
                .iter()
                .map(|v| v.as_str().expect("a hash"))
                .collect();
            assert_eq!(hashes, want, "{clip} {key}: frames differ from OpenCV's");
        }
    }
}

#[test]
fn truncated_and_corrupt_clips_are_refused_with_the_reason() {
    let Some(ffmpeg) = ffmpeg() else { return };
    let bytes = std::fs::read(fixtures().join("even10.mp4")).expect("the clip");
    let options = SamplingOptions::default();
    let limits = VideoLimits::default();
    for (what, data) in [
        ("cut before its index", bytes[..bytes.len() / 3].to_vec()),
        ("not a video", b"this is not a video at all".to_vec()),
        ("empty", Vec::new()),
    ] {
        let err =
            load_video(&ffmpeg, &data, VideoLoader::Qwen3Vl, &options, &limits).expect_err(what);
        assert!(matches!(err, VideoError::Decode { .. }), "{what}: {err}");
        assert!(
            err.to_string().starts_with("cannot decode the video"),
            "{err}"
        );
    }
}

#[test]
fn frames_over_the_limits_are_refused_before_decoding() {
    let Some(ffmpeg) = ffmpeg() else { return };
    let bytes = std::fs::read(fixtures().join("odd9.mp4")).expect("the clip");
    let small = VideoLimits {
        max_frame_pixels: 80 * 60 - 1,
        ..VideoLimits::default()
    };
    let err = load_video(
        &ffmpeg,
        &bytes,
        VideoLoader::Qwen2Vl,
        &SamplingOptions::default(),
        &small,
    )
    .expect_err("a frame over the pixel limit");
    assert!(err.to_string().contains("a frame of 80x60"), "{err}");
    let few = VideoLimits {
        max_decoded_bytes: 80 * 60 * 3 * 3,
        ..VideoLimits::default()
    };
    let err = load_video(
        &ffmpeg,
        &bytes,
        VideoLoader::Qwen2Vl,
        &SamplingOptions::default(),
        &few,
    )
    .expect_err("more decoded bytes than allowed");
    assert!(err.to_string().contains("4 frames of 80x60"), "{err}");
}

/// A clip cut in the middle of its frame data (its index at the front, `-movflags +faststart`,
/// 40 frames) decodes to the frames before the cut, as OpenCV gives vLLM (which reads frame 0
/// of the eight the qwen3_vl loader wants at this cut); cut before any whole frame, nothing is
/// decoded, which iris refuses (vLLM goes on with no frames).
#[test]
fn a_clip_cut_mid_data_gives_the_frames_before_the_cut() {
    let Some(ffmpeg) = ffmpeg() else { return };
    let bytes = std::fs::read(fixtures().join("fast40.mp4")).expect("the clip");
    let options = SamplingOptions::default();
    let limits = VideoLimits::default();
    let whole = load_video(&ffmpeg, &bytes, VideoLoader::Qwen3Vl, &options, &limits)
        .expect("the whole clip");
    assert_eq!(
        whole.metadata.frames_indices,
        [0, 6, 11, 17, 22, 28, 33, 39]
    );
    let cut = load_video(
        &ffmpeg,
        &bytes[..3500],
        VideoLoader::Qwen3Vl,
        &options,
        &limits,
    )
    .expect("the frames before the cut");
    assert_eq!(
        cut.metadata.total_num_frames, 40,
        "the index still counts them all"
    );
    assert_eq!(cut.metadata.frames_indices, [0]);
    assert_eq!(cut.frames, whole.frames[..1]);
    assert!(!cut.metadata.do_sample_frames);
    let err = load_video(
        &ffmpeg,
        &bytes[..2500],
        VideoLoader::Qwen3Vl,
        &options,
        &limits,
    )
    .expect_err("no whole frame");
    assert!(matches!(err, VideoError::Decode { .. }), "{err}");
}

#[test]
fn an_hls_playlist_naming_a_local_file_is_refused() {
    let Some(ffmpeg) = ffmpeg() else { return };
    // Without a format whitelist FFmpeg takes this for HLS and decodes the file it names: a
    // client could read any video on the server.
    let target = fixtures().join("even10.mp4");
    let playlist = format!(
        "#EXTM3U\n#EXT-X-TARGETDURATION:10\n#EXTINF:10,\n{}\n#EXT-X-ENDLIST\n",
        target.display()
    );
    let err = match load_video(
        &ffmpeg,
        playlist.as_bytes(),
        VideoLoader::Qwen3Vl,
        &SamplingOptions::default(),
        &VideoLimits::default(),
    ) {
        Ok(video) => panic!(
            "the playlist was decoded, the file it names read: {:?}",
            video.metadata
        ),
        Err(err) => err,
    };
    eprintln!("the playlist: {err}");
    assert!(matches!(err, VideoError::Decode { .. }), "{err}");
    assert!(
        err.to_string().contains("not a container iris decodes"),
        "{err}"
    );
}
