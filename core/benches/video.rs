//! Decoding and preprocessing one video as vLLM's encoder does, per family: FFmpeg reading the
//! loader's frames of a 10 s 1280x720 30 fps H.264 clip, then the video processor (resize,
//! normalize, patchify). `tools/video-goldens/speed.py` times vLLM's loader and transformers'
//! processor on the same clip.
//!
//! `cargo bench -p iris-core --bench video -- --warm-up-time 1 --measurement-time 10`
//!
//! Needs the FFmpeg programs (it makes the clip with them); without them it says so and
//! measures nothing.

use std::hint::black_box;
use std::path::PathBuf;
use std::process::Command;

use criterion::{Criterion, criterion_group, criterion_main};
use iris_core::model::ModelSpec;
use iris_core::preprocess::video::ffmpeg::{Ffmpeg, VideoLimits, load_video_file};
use iris_core::preprocess::video::{SamplingOptions, preprocess_frames};

/// The clip, made once in the system's temporary folder.
fn clip() -> Option<PathBuf> {
    let path = std::env::temp_dir().join("iris-bench-video-720p-10s.mp4");
    if path.exists() {
        return Some(path);
    }
    let made = Command::new("ffmpeg")
        .args(["-v", "error", "-y", "-f", "lavfi", "-i"])
        .arg("testsrc2=size=1280x720:rate=30")
        .args(["-t", "10", "-c:v", "libx264", "-pix_fmt", "yuv420p"])
        .arg(&path)
        .status()
        .is_ok_and(|status| status.success());
    made.then_some(path)
}

fn video(c: &mut Criterion) {
    let (Ok(ffmpeg), Some(path)) = (Ffmpeg::locate(), clip()) else {
        eprintln!("video bench skipped: the FFmpeg programs do not run here");
        return;
    };
    let mut group = c.benchmark_group("video_720p_10s");
    group.sample_size(10);
    for preset in ["qwen2.5-vl-7b", "qwen3-vl-8b"] {
        let spec = ModelSpec::preset(preset).expect("a preset");
        let processing = spec.video_processing(None).expect("video settings");
        let sampling = SamplingOptions {
            temporal_patch_size: processing.config.temporal_patch_size,
            ..SamplingOptions::default()
        };
        let decode = || {
            load_video_file(
                &ffmpeg,
                &path,
                processing.loader,
                &sampling,
                &VideoLimits::default(),
            )
            .expect("decoded")
        };
        group.bench_function(format!("{preset}/decode+preprocess"), |b| {
            b.iter(|| {
                let decoded = decode();
                black_box(
                    preprocess_frames(&decoded.frames, &processing.config, processing.resize)
                        .expect("processed"),
                )
            });
        });
        let decoded = decode();
        group.bench_function(format!("{preset}/preprocess"), |b| {
            b.iter(|| {
                black_box(
                    preprocess_frames(&decoded.frames, &processing.config, processing.resize)
                        .expect("processed"),
                )
            });
        });
    }
    group.finish();
}

criterion_group!(benches, video);
criterion_main!(benches);
