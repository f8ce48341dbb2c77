//! Decoding clips as vLLM 0.33's `qwen2_vl` and `qwen3_vl` loaders do through their default
//! OpenCV decoder (`tools/video-goldens/decode.py` made the goldens): the same frame count,
//! rate, duration and indices, and the same RGB frames, bit for bit, for H.264 in MP4 with an
//! even and an odd frame count and for VP9 in WebM (which gives no frame count). Bad clips are
//! refused with FFmpeg's reason, and a container that would open other files (an HLS playlist)
//! is refused by name.
//!
//! A clip sampled to more than 100 frames decodes (FFmpeg's expression parser refuses a long
//! flat `select` expression), and a clip with a rotation in its display matrix (a phone's
//! portrait video) decodes turned as OpenCV turns it.
//!
//! These tests need the FFmpeg programs; `.ci/run` installs them and sets
//! `IRIS_REQUIRE_FFMPEG`, under which their absence fails instead of skipping.

use std::path::PathBuf;
use std::process::Command;

use iris_core::preprocess::video::ffmpeg::{Ffmpeg, VideoLimits, load_video, open_clip};
use iris_core::preprocess::video::{SamplingOptions, VideoError, VideoLoader, sample_frames};
use iris_core::preprocess::{ImageSize, RgbImage};
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
        // FFmpeg's log prefix names its demuxer, and a heap address a client has no use for.
        assert!(!err.to_string().contains(" @ 0x"), "{what}: {err}");
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

/// More than 100 frames sampled (104 of a 52 s clip at vLLM's 2 fps): the frames read are the
/// ones the loader samples, each equal to that frame of the whole clip decoded by the `ffmpeg`
/// program (every frame, no `select`).
#[test]
fn a_clip_sampled_to_more_than_100_frames_decodes() {
    const FRAMES: u32 = 520;
    const RATE: f64 = 10.0;
    const SIDE: u32 = 16;
    let Some(ffmpeg) = ffmpeg() else { return };
    let dir = tempfile::tempdir().expect("a temporary directory");
    let path = dir.path().join("long.mp4");
    let run = |args: &[&str]| {
        let out = Command::new(ffmpeg.ffmpeg_program())
            .args(["-v", "error", "-nostdin"])
            .args(args)
            .output()
            .expect("ffmpeg runs");
        assert!(
            out.status.success(),
            "ffmpeg {args:?}: {}",
            String::from_utf8_lossy(&out.stderr)
        );
        out.stdout
    };
    let clip = path.to_str().expect("a UTF-8 path");
    let make = format!(
        "-f lavfi -i testsrc2=size={SIDE}x{SIDE}:rate={RATE} -frames:v {FRAMES} -c:v libx264 \
         -preset ultrafast -pix_fmt yuv420p"
    );
    let mut args: Vec<&str> = make.split_whitespace().collect();
    args.push(clip);
    run(&args);
    let mut args = vec!["-i", clip];
    args.extend("-map 0:v:0 -fps_mode passthrough -f rawvideo -pix_fmt rgb24 pipe:1".split(' '));
    let all = run(&args);
    let frame_len = (SIDE * SIDE * 3) as usize;
    assert_eq!(all.len(), FRAMES as usize * frame_len, "the whole clip");
    let bytes = std::fs::read(&path).expect("the clip");
    let options = SamplingOptions::default();
    let limits = VideoLimits::default();
    for loader in [VideoLoader::Qwen2Vl, VideoLoader::Qwen3Vl] {
        let video = load_video(&ffmpeg, &bytes, loader, &options, &limits)
            .unwrap_or_else(|err| panic!("{}: {err}", loader.name()));
        let meta = &video.metadata;
        assert_eq!(meta.total_num_frames, FRAMES);
        assert_eq!(meta.fps, RATE);
        let want = sample_frames(loader, FRAMES, RATE, &options).expect("sampling");
        assert!(want.len() > 100, "{}: {} frames", loader.name(), want.len());
        assert_eq!(meta.frames_indices, want, "{}: indices", loader.name());
        assert_eq!(video.frames.len(), want.len());
        for (&index, frame) in want.iter().zip(&video.frames) {
            let at = index as usize * frame_len;
            assert_eq!(frame.size, ImageSize::new(SIDE, SIDE));
            assert!(
                frame.pixels == all[at..at + frame_len],
                "{}: frame {index} differs from the clip's",
                loader.name()
            );
        }
    }
}

/// How OpenCV turns a frame whose display matrix rotates it by `degrees` (counterclockwise,
/// as FFmpeg's `av_display_rotation_get` gives it): its angle is `-round(degrees)` taken into
/// [0, 360), and it turns the frame only for 90 (clockwise), 180 and 270 (counterclockwise).
#[derive(Debug, Clone, Copy, PartialEq)]
enum Turn {
    None,
    Clockwise,
    Half,
    Counterclockwise,
}

/// `frame` turned, written out pixel by pixel: the pixel at column `x`, row `y` of a `w x h`
/// frame goes to `(h-1-y, x)` turned clockwise, `(w-1-x, h-1-y)` turned half way round, and
/// `(y, w-1-x)` turned counterclockwise.
fn turned(frame: &RgbImage, turn: Turn) -> RgbImage {
    let (w, h) = (frame.size.width as usize, frame.size.height as usize);
    let size = match turn {
        Turn::Clockwise | Turn::Counterclockwise => {
            ImageSize::new(frame.size.height, frame.size.width)
        }
        Turn::None | Turn::Half => frame.size,
    };
    let out_width = size.width as usize;
    let mut pixels = vec![0u8; frame.pixels.len()];
    for y in 0..h {
        for x in 0..w {
            let (to_x, to_y) = match turn {
                Turn::None => (x, y),
                Turn::Clockwise => (h - 1 - y, x),
                Turn::Half => (w - 1 - x, h - 1 - y),
                Turn::Counterclockwise => (y, w - 1 - x),
            };
            let from = (y * w + x) * 3;
            let to = (to_y * out_width + to_x) * 3;
            pixels[to..to + 3].copy_from_slice(&frame.pixels[from..from + 3]);
        }
    }
    RgbImage { size, pixels }
}

/// `clip` (an MP4 of one track) with a display matrix in its track header (`tkhd`) that
/// rotates the frames by `degrees` counterclockwise: `[cos, -sin; sin, cos]` in 16.16 fixed
/// point, which FFmpeg's `av_display_rotation_get` reads back as `degrees`.
fn with_display_rotation(clip: &[u8], degrees: f64) -> Vec<u8> {
    let at = clip
        .windows(4)
        .position(|w| w == b"tkhd")
        .expect("a track header");
    let version = clip[at + 4];
    // After the box type: version and flags (4), two times (4 or 8 each), the track id (4),
    // 4 reserved, the duration (4 or 8), 8 reserved, layer, group, volume, 2 reserved.
    let times = if version == 1 { 8 } else { 4 };
    let matrix = at + 4 + 4 + 2 * times + 4 + 4 + times + 8 + 2 + 2 + 2 + 2;
    let fixed = |v: f64| {
        #[allow(clippy::cast_possible_truncation)]
        let n = (v * 65536.0).round() as i32;
        n
    };
    let (sin, cos) = degrees.to_radians().sin_cos();
    let mut out = clip.to_vec();
    // a b u / c d v / x y w, each a big-endian 32-bit number.
    for (i, value) in [
        fixed(cos),
        fixed(-sin),
        0,
        fixed(sin),
        fixed(cos),
        0,
        0,
        0,
        1 << 30,
    ]
    .into_iter()
    .enumerate()
    {
        out[matrix + 4 * i..matrix + 4 * i + 4].copy_from_slice(&value.to_be_bytes());
    }
    out
}

/// A clip whose display matrix rotates it decodes as vLLM's OpenCV decoder gives it: the
/// frames of the unrotated clip turned by OpenCV's rule, at the turned size (probed before
/// decoding, for admission and resizing), for both loaders.
#[test]
fn rotated_clips_decode_turned_as_opencv_turns_them() {
    let Some(ffmpeg) = ffmpeg() else { return };
    let bytes = std::fs::read(fixtures().join("even10.mp4")).expect("the clip");
    let options = SamplingOptions::default();
    let limits = VideoLimits::default();
    let loaders = [VideoLoader::Qwen2Vl, VideoLoader::Qwen3Vl];
    // The unrotated clip, as each loader reads it.
    let plain = loaders
        .map(|loader| load_video(&ffmpeg, &bytes, loader, &options, &limits).expect("the clip"));
    for (degrees, turn) in [
        // A phone held upright: FFmpeg reports -90, OpenCV turns clockwise.
        (-90.0, Turn::Clockwise),
        (180.0, Turn::Half),
        (90.0, Turn::Counterclockwise),
        // Not a multiple of 90: OpenCV leaves it as it is.
        (45.0, Turn::None),
        // Rounded to -90 by OpenCV (ffprobe's `rotation` would print -89).
        (-89.6, Turn::Clockwise),
    ] {
        let rotated = with_display_rotation(&bytes, degrees);
        for (loader, plain) in loaders.iter().zip(&plain) {
            let loader = *loader;
            let what = format!("{degrees} degrees, {}", loader.name());
            let opened = open_clip(&ffmpeg, &rotated, loader, &options, &limits)
                .unwrap_or_else(|err| panic!("{what}: {err}"));
            let size = opened.size();
            let video = opened
                .decode(&ffmpeg, &limits)
                .unwrap_or_else(|err| panic!("{what}: {err}"));
            let want_size = match turn {
                Turn::Clockwise | Turn::Counterclockwise => ImageSize::new(48, 64),
                Turn::None | Turn::Half => ImageSize::new(64, 48),
            };
            assert_eq!(size, want_size, "{what}: probed size");
            assert_eq!(video.metadata, plain.metadata, "{what}: metadata");
            assert_eq!(video.frames.len(), plain.frames.len(), "{what}");
            for (k, (got, source)) in video.frames.iter().zip(&plain.frames).enumerate() {
                assert_eq!(got.size, want_size, "{what}: frame {k} size");
                assert!(
                    *got == turned(source, turn),
                    "{what}: frame {k} is not the source frame turned {turn:?}"
                );
            }
        }
    }
}
