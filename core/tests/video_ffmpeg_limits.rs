//! How iris runs the FFmpeg programs on clips from untrusted clients: a flood on FFmpeg's
//! standard error cannot deadlock the decode, and every run has a wall-clock limit after which
//! the program is killed and reaped. Both use stand-in programs (shell scripts), so they run
//! without FFmpeg; `video_decode.rs` checks with the real programs that containers which open
//! other files (an HLS playlist) are refused.

#![cfg(unix)]

use std::os::unix::fs::PermissionsExt;
use std::path::{Path, PathBuf};
use std::sync::mpsc;
use std::sync::{Mutex, MutexGuard, PoisonError};
use std::time::{Duration, Instant};

use iris_core::preprocess::video::ffmpeg::{DecodedVideo, Ffmpeg, VideoLimits, load_video};
use iris_core::preprocess::video::{SamplingOptions, VideoError, VideoLoader};

/// Serializes the tests: a script being written while another test's thread forks can be
/// inherited open for writing by that child, and executing it then fails with "text file busy".
static SERIAL: Mutex<()> = Mutex::new(());

/// What the stand-in ffprobe reports: 4 frames of 4x2 at 2 fps, which the qwen3_vl loader
/// reads all of (`[0, 1, 2, 3]`), so the stand-in ffmpeg must give 4 * 4 * 2 * 3 = 96 bytes.
const PROBE_JSON: &str = r#"{"streams":[{"width":4,"height":2,"nb_frames":"4","r_frame_rate":"2/1","avg_frame_rate":"2/1"}],"format":{"duration":"2"}}"#;

/// The tests' turn (see [`SERIAL`]) and a folder for their stand-in programs.
fn scratch() -> (MutexGuard<'static, ()>, tempfile::TempDir) {
    let turn = SERIAL.lock().unwrap_or_else(PoisonError::into_inner);
    (turn, tempfile::tempdir().expect("a temporary directory"))
}

fn script(dir: &Path, name: &str, body: &str) -> PathBuf {
    let path = dir.join(name);
    std::fs::write(&path, format!("#!/bin/sh\n{body}\n")).expect("the script");
    std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755)).expect("chmod");
    path
}

fn fake_ffprobe(dir: &Path) -> PathBuf {
    script(dir, "ffprobe", &format!("printf '%s' '{PROBE_JSON}'"))
}

/// Runs `load_video` on a thread and waits at most `within` for it, so that a hang fails the
/// test instead of stalling the suite.
fn load_within(
    ffmpeg: Ffmpeg,
    limits: VideoLimits,
    within: Duration,
) -> (Result<DecodedVideo, VideoError>, Duration) {
    let start = Instant::now();
    let (tx, rx) = mpsc::channel();
    std::thread::spawn(move || {
        let result = load_video(
            &ffmpeg,
            b"any bytes: the stand-ins do not read them",
            VideoLoader::Qwen3Vl,
            &SamplingOptions::default(),
            &limits,
        );
        let _ = tx.send(result);
    });
    let result = rx
        .recv_timeout(within)
        .unwrap_or_else(|_| panic!("the decode did not finish within {within:?}"));
    (result, start.elapsed())
}

/// Whether the process `pid` still exists (a zombie counts: it has not been reaped).
fn alive(pid: &str) -> bool {
    std::process::Command::new("kill")
        .args(["-0", pid])
        .stderr(std::process::Stdio::null())
        .status()
        .expect("kill")
        .success()
}

#[test]
fn a_megabyte_on_ffmpegs_stderr_does_not_deadlock_the_decode() {
    let (_serial, dir) = scratch();
    // 1 MiB of complaints (16 times the pipe's buffer) before the frames, as a damaged clip
    // makes FFmpeg write a line per bad frame.
    let ffmpeg = script(
        dir.path(),
        "ffmpeg",
        "head -c 1048576 /dev/zero | tr '\\0' 'e' >&2\nhead -c 96 /dev/zero",
    );
    let programs = Ffmpeg::with_programs(ffmpeg, fake_ffprobe(dir.path()));
    let (result, took) = load_within(programs, VideoLimits::default(), Duration::from_secs(30));
    let video = result.expect("the frames after the flood");
    assert_eq!(video.metadata.frames_indices, [0, 1, 2, 3]);
    assert!(video.frames.iter().all(|f| f.pixels == [0u8; 24]));
    assert!(took < Duration::from_secs(20), "took {took:?}");
}

#[test]
fn a_run_past_the_time_limit_is_killed_and_reaped() {
    let (_serial, dir) = scratch();
    let limits = VideoLimits {
        max_decode_time: Duration::from_secs(1),
        ..VideoLimits::default()
    };
    // `exec` so that the recorded pid is the sleeping program itself.
    let hang = |name: &str| {
        let pid_file = dir.path().join(format!("{name}.pid"));
        let body = format!("echo $$ > '{}'\nexec sleep 30", pid_file.display());
        (
            script(dir.path(), &format!("{name}-hangs"), &body),
            pid_file,
        )
    };
    let (ffmpeg, ffmpeg_pid) = hang("ffmpeg");
    let (ffprobe, ffprobe_pid) = hang("ffprobe");
    for (what, programs, pid_file) in [
        (
            "ffmpeg",
            Ffmpeg::with_programs(&ffmpeg, fake_ffprobe(dir.path())),
            &ffmpeg_pid,
        ),
        (
            "ffprobe",
            Ffmpeg::with_programs(dir.path().join("unused"), &ffprobe),
            &ffprobe_pid,
        ),
    ] {
        let (result, took) = load_within(programs, limits, Duration::from_secs(20));
        let err = result.expect_err("a decode past its time limit");
        assert!(matches!(err, VideoError::Decode { .. }), "{what}: {err}");
        let text = err.to_string();
        eprintln!("{what} past the limit: {text}");
        assert!(
            text.contains(what) && text.contains("1 s") && text.contains("time limit"),
            "{what}: {text}"
        );
        assert!(took < Duration::from_secs(10), "{what}: took {took:?}");
        let pid = std::fs::read_to_string(pid_file).expect("the pid file");
        assert!(
            !alive(pid.trim()),
            "{what} (pid {}) is still there after the error",
            pid.trim()
        );
    }
}
