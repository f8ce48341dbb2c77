//! `iris bench` end to end with the real binary: in process, and with `--url` against a real
//! `iris serve`, on the same small workload. Both must print the verdict `yes`, write
//! `leaked_bytes` 0, and agree on everything the workload fixes (requests, images, tokens,
//! cache hit rates, the post-start baseline).

use std::path::{Path, PathBuf};
use std::process::{Child, Output, Stdio};

use serde_json::Value;

mod common;

use common::{ENGINE, iris};

/// The workload; `--request-rate inf` with one request in flight makes the order of requests,
/// and so every cache hit, the same in both runs.
const WORKLOAD: [&str; 13] = [
    "--num-prompts",
    "24",
    "--images-per-prompt",
    "2",
    "--image-size",
    "112x112,224x168",
    "--repeat-ratio",
    "0.5",
    "--request-rate",
    "inf",
    "--max-concurrency",
    "1",
    "--no-progress",
];

fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("iris-bench-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp folder");
    dir
}

fn bench(dir: &Path, extra: &[&str]) -> (Output, Value) {
    bench_workload(dir, extra, &WORKLOAD)
}

fn bench_workload(dir: &Path, extra: &[&str], workload: &[&str]) -> (Output, Value) {
    let json = dir.join("result.json");
    let output = iris(dir)
        .arg("bench")
        .args(extra)
        .args(workload)
        .arg("--result-json")
        .arg(&json)
        .arg("--plot")
        .arg(dir.join("memory.svg"))
        .output()
        .expect("iris bench runs");
    let text = std::fs::read_to_string(&json).unwrap_or_else(|err| {
        panic!(
            "no result JSON ({err}); stdout:\n{}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stdout),
            String::from_utf8_lossy(&output.stderr)
        )
    });
    (
        output,
        serde_json::from_str(&text).expect("result JSON parses"),
    )
}

/// A running `iris serve`, killed when dropped.
struct Server(Child);

impl Drop for Server {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

fn serve(dir: &Path) -> (Server, String) {
    let (child, url) =
        common::spawn_serve(dir, &[], &[], Stdio::null()).unwrap_or_else(|err| panic!("{err}"));
    (Server(child), url)
}

fn stdout(output: &Output) -> String {
    String::from_utf8_lossy(&output.stdout).into_owned()
}

#[test]
fn in_process_and_url_runs_agree_and_return_memory_to_the_baseline() {
    let local_dir = folder("local");
    let (local_out, local) = bench(&local_dir, &ENGINE);
    let text = stdout(&local_out);
    assert!(local_out.status.success(), "{text}");
    assert!(
        text.trim_end()
            .ends_with("memory after reset returns to the post-start baseline: yes"),
        "{text}"
    );
    assert!(text.contains("target in-process"), "{text}");

    let remote_dir = folder("remote");
    let (_server, url) = serve(&remote_dir);
    let (remote_out, remote) = bench(&remote_dir, &["--url", &url]);
    let remote_text = stdout(&remote_out);
    assert!(remote_out.status.success(), "{remote_text}");
    assert!(
        remote_text.contains(&format!("target {url}")),
        "{remote_text}"
    );

    for v in [&local, &remote] {
        assert_eq!(v["requests"]["completed"], 24, "{v}");
        assert_eq!(v["requests"]["failed"], 0, "{v}");
        assert_eq!(v["memory_returned_to_baseline"], true, "{v}");
        assert_eq!(v["leaked_bytes"], 0, "{v}");
    }
    for key in [
        "/images/completed",
        "/images/cached",
        "/tokens",
        "/cache/processor_hit_rate",
        "/cache/encoder_hit_rate",
        "/memory/after_start/device_used_bytes",
        "/memory/after_start/allocator_reserved_bytes",
        "/memory/after_reset/allocator_allocated_bytes",
        "/engine/encoder_flops",
    ] {
        assert_eq!(local.pointer(key), remote.pointer(key), "{key}");
    }
    // The tower's FLOPs over its time, against the CPU device's timed FMA roof.
    assert!(local["engine"]["encoder_flops"].as_u64().unwrap() > 0);
    assert!(local["engine"]["encoder_tflops"].as_f64().unwrap() > 0.0);
    assert!(local["engine"]["peak_share"].as_f64().unwrap() > 0.0);
    assert_eq!(local["engine"]["peak_source"], "device");
    assert!(text.contains("of the device's peak"), "{text}");
    // The workload repeats half its slots one request at a time: the caches must have hit.
    assert!(local["cache"]["processor_hit_rate"].as_f64().unwrap() > 0.2);
    assert!(local["images"]["cached"].as_u64().unwrap() > 0);
    for dir in [&local_dir, &remote_dir] {
        let svg = std::fs::read_to_string(dir.join("memory.svg")).expect("plot written");
        assert!(svg.contains("after reset"));
        let _ = std::fs::remove_dir_all(dir);
    }
}

/// Every prompt at once, with no client-side limit: an engine running one request at a time
/// would refuse most of them under its default bounds (2 x `--max-num-seqs` requests).
const BURST: [&str; 9] = [
    "--num-prompts",
    "16",
    "--images-per-prompt",
    "1",
    "--image-size",
    "56x56",
    "--request-rate",
    "inf",
    "--no-progress",
];

#[test]
fn the_bench_queues_its_own_load_and_reports_refusals_under_bounds_set_on_purpose() {
    let engine: Vec<&str> = ENGINE
        .iter()
        .copied()
        .chain(["--max-num-seqs", "1"])
        .collect();
    let dir = folder("queued");
    let (output, v) = bench_workload(&dir, &engine, &BURST);
    let text = stdout(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{text}{stderr}");
    assert!(stderr.contains("sized for this workload"), "{stderr}");
    assert_eq!(v["requests"]["completed"], 16, "{v}");
    assert_eq!(v["requests"]["refused"], 0, "{v}");
    assert!(
        text.contains("capacity:   every request offered at once"),
        "{text}"
    );

    let bounded: Vec<&str> = engine
        .iter()
        .copied()
        .chain(["--max-queued-requests", "2"])
        .collect();
    let (output, v) = bench_workload(&dir, &bounded, &BURST);
    let text = stdout(&output);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        output.status.success(),
        "refusals are not a failure: {text}{stderr}"
    );
    assert!(stderr.contains("set by --max-queued-requests"), "{stderr}");
    let count = |key: &str| v["requests"][key].as_u64().unwrap_or(u64::MAX);
    assert!(count("refused") > 0, "{v}");
    assert!(count("completed") >= 2, "{v}");
    assert_eq!(count("completed") + count("refused"), 16, "{v}");
    assert_eq!((count("failed"), count("aborted")), (0, 0), "{v}");
    assert!(
        text.contains(&format!("\n  refused:  {} (", count("refused"))),
        "{text}"
    );
    assert!(text.contains("\n  failed:   0\n"), "{text}");
    assert_eq!(v["memory_returned_to_baseline"], true, "{v}");
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn inject_faults_soaks_the_engine_and_counts_every_request() {
    let dir = folder("faults");
    let json = dir.join("result.json");
    let output = iris(&dir)
        .arg("bench")
        .args(ENGINE)
        .args([
            "--inject-faults",
            "--num-prompts",
            "100",
            "--images-per-prompt",
            "1",
            "--image-size",
            "56x56,112x84",
            "--repeat-ratio",
            "0.3",
            "--request-rate",
            "inf",
            "--max-concurrency",
            "8",
            "--no-progress",
        ])
        .arg("--result-json")
        .arg(&json)
        .output()
        .expect("iris bench runs");
    let text = stdout(&output);
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).unwrap_or_else(|err| {
        panic!(
            "no result JSON ({err}); stdout:\n{text}\nstderr:\n{}",
            String::from_utf8_lossy(&output.stderr)
        )
    }))
    .expect("result JSON parses");
    assert!(output.status.success(), "{text}");
    let faults = &v["faults"];
    let count = |key: &str| {
        faults[key]
            .as_u64()
            .unwrap_or_else(|| panic!("faults.{key} in {faults}"))
    };
    assert_eq!(count("unexpected"), 0, "{faults}");
    assert_eq!(count("failed_resets"), 0, "{faults}");
    assert_eq!(
        count("answered") + count("aborted") + count("overloaded") + count("injected"),
        100,
        "every request is counted once: {faults}"
    );
    assert!(count("answered") > 0, "{faults}");
    assert!(
        count("resets") > 0,
        "the seeded plan resets during the load: {faults}"
    );
    assert_eq!(v["leaked_bytes"], 0, "{v}");
    assert!(
        text.contains("every fault handled (no unexpected error): yes"),
        "{text}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// Prompts of an image and a clip (synthetic H.264, half the slots repeated), one at a time.
const VIDEO_WORKLOAD: [&str; 21] = [
    "--num-prompts",
    "6",
    "--images-per-prompt",
    "1",
    "--image-size",
    "112x112",
    "--videos-per-prompt",
    "1",
    "--video-size",
    "64x48",
    "--video-frames",
    "8",
    "--video-fps",
    "4",
    "--repeat-ratio",
    "0.5",
    "--request-rate",
    "inf",
    "--max-concurrency",
    "1",
    "--no-progress",
];

#[test]
fn videos_in_process_over_http_and_through_the_store_agree_and_return_memory() {
    if !common::ffmpeg_runs() {
        return;
    }
    let local_dir = folder("video-local");
    let (local_out, local) = bench_workload(&local_dir, &ENGINE, &VIDEO_WORKLOAD);
    let text = stdout(&local_out);
    assert!(local_out.status.success(), "{text}");
    assert!(
        text.contains(
            "6 prompts x 1 images (3 distinct) + 1 videos (3 distinct), 6 repeated slots"
        ),
        "{text}"
    );
    assert!(text.contains(" videos/s, "), "{text}");
    assert!(
        text.trim_end()
            .ends_with("memory after reset returns to the post-start baseline: yes"),
        "{text}"
    );

    let remote_dir = folder("video-remote");
    let (_server, url) = serve(&remote_dir);
    let (remote_out, remote) = bench_workload(&remote_dir, &["--url", &url], &VIDEO_WORKLOAD);
    assert!(remote_out.status.success(), "{}", stdout(&remote_out));

    // As vLLM's encoder instance: every distinct item written once, the repeats store hits.
    let store_dir = folder("video-store");
    std::fs::create_dir_all(store_dir.join("store")).unwrap();
    let config = serde_json::json!({
        "ec_connector": "ECExampleConnector",
        "ec_role": "ec_producer",
        "ec_connector_extra_config": {"shared_storage_path": store_dir.join("store")},
    })
    .to_string();
    let epd: Vec<&str> = ENGINE
        .iter()
        .copied()
        .chain(["--ec-transfer-config", &config])
        .collect();
    let (store_out, stored) = bench_workload(&store_dir, &epd, &VIDEO_WORKLOAD);
    let store_text = stdout(&store_out);
    assert!(store_out.status.success(), "{store_text}");
    assert!(
        store_text.contains("EC store:   6 entries written"),
        "{store_text}"
    );
    let entries = std::fs::read_dir(store_dir.join("store")).unwrap().count();
    assert_eq!(entries, 6, "three images and three clips");

    for v in [&local, &remote, &stored] {
        assert_eq!(v["requests"]["completed"], 6, "{v}");
        assert_eq!(v["requests"]["failed"], 0, "{v}");
        assert_eq!(v["videos"]["completed"], 6, "{v}");
        assert_eq!(v["config"]["videos_per_prompt"], 1, "{v}");
        assert_eq!(v["config"]["distinct_videos"], 3, "{v}");
        assert_eq!(v["memory_returned_to_baseline"], true, "{v}");
        assert_eq!(v["leaked_bytes"], 0, "{v}");
    }
    for key in ["/images/cached", "/videos/cached", "/tokens"] {
        assert_eq!(local.pointer(key), remote.pointer(key), "{key}");
        assert_eq!(local.pointer(key), stored.pointer(key), "{key}");
    }
    // One at a time, so every repeated clip is an encoder cache hit (a store hit in the third).
    assert_eq!(local["videos"]["cached"], 3, "{local}");
    for dir in [&local_dir, &remote_dir, &store_dir] {
        let _ = std::fs::remove_dir_all(dir);
    }
}

#[test]
fn outputs_that_cannot_be_written_and_zero_bounds_are_refused_before_the_load() {
    let dir = folder("outputs");
    let missing = dir.join("no-such-folder");
    for (extra, named) in [
        (
            vec!["--plot".to_owned(), dir.join("m.jpg").display().to_string()],
            "the file name must end in .svg or .png",
        ),
        (
            vec![
                "--result-json".to_owned(),
                missing.join("r.json").display().to_string(),
            ],
            "cannot be written",
        ),
        // Zero would have been taken as one (and reported as zero).
        (
            vec!["--max-concurrency".to_owned(), "0".to_owned()],
            "0 is not in 1..",
        ),
        (
            vec!["--max-queued-requests".to_owned(), "0".to_owned()],
            "0 is not in 1..",
        ),
    ] {
        let started = std::time::Instant::now();
        let output = iris(&dir)
            .arg("bench")
            .args(&extra)
            // A load that would take minutes: the refusal must come first.
            .args(["--num-prompts", "100000", "--no-progress"])
            .output()
            .expect("iris bench runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && stderr.contains(named) && stderr.contains(&extra[0]),
            "{extra:?}: {stderr}"
        );
        assert!(
            started.elapsed() < std::time::Duration::from_secs(60),
            "{extra:?}: refused only after {:?}",
            started.elapsed()
        );
    }
    assert!(!dir.join("m.jpg").exists(), "the check left a file behind");
    // The workload is built (its counts checked, its dataset read) before a device opens or a
    // model loads: with a device that does not exist, the refusal is still the workload's.
    for (extra, named) in [
        (["--num-prompts", "0"], "--num-prompts is 0"),
        (["--repeat-ratio", "2"], "--repeat-ratio is 2"),
        (["--images-per-prompt", "0"], "--images-per-prompt is 0"),
        (
            ["--dataset", "/nonexistent/iris-bench-images"],
            "cannot read dataset directory /nonexistent/iris-bench-images",
        ),
    ] {
        let output = iris(&dir)
            .args(["bench", "--device", "nonexistent", "--no-progress"])
            .args(extra)
            .output()
            .expect("iris bench runs");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(
            !output.status.success() && stderr.contains(named) && !stderr.contains("plugin"),
            "{extra:?}: {stderr}"
        );
    }
    let _ = std::fs::remove_dir_all(&dir);
}
