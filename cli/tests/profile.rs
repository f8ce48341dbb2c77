//! `iris profile` on the built-in CPU device with the tiny model.

use std::process::{Command, Output};

fn iris(args: &[&str], config: Option<&str>) -> Output {
    let dir = std::env::temp_dir().join(format!("iris-profile-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp folder");
    let mut command = Command::new(env!("CARGO_BIN_EXE_iris"));
    if let Some(text) = config {
        let path = dir.join(format!("iris-{}.toml", text.len()));
        std::fs::write(&path, text).expect("config written");
        command.arg("--config").arg(path);
    }
    command
        .args(args)
        .current_dir(&dir)
        .env("IRIS_DEVICE", "cpu")
        .env_remove("IRIS_PLUGIN_PATH")
        .output()
        .expect("iris runs")
}

/// Images only: the figures below are the largest image's.
const NO_VIDEO: [&str; 2] = ["--limit-mm-per-prompt", r#"{"video": 0}"#];

#[test]
fn tiny_profile_reports_every_figure() {
    let output = iris(
        &[
            "profile",
            "--model",
            "tiny",
            "--json",
            NO_VIDEO[0],
            NO_VIDEO[1],
        ],
        None,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let u = |key: &str| {
        report[key]
            .as_u64()
            .unwrap_or_else(|| panic!("`{key}` in {report}"))
    };
    // tiny: 896x896 at most -> a 64x64 grid, 1024 tokens; 8192 tokens a step -> 8 items.
    assert_eq!(report["max_item_grid"], serde_json::json!([1, 64, 64]));
    assert_eq!(report["max_item_modality"], "image");
    assert_eq!(u("max_item_tokens"), 1024);
    assert_eq!(u("items_per_batch"), 8);
    assert_eq!(u("encoder_cache_tokens"), 8192);
    assert_eq!(u("encoder_cache_bytes"), 8192 * 64 * 4);
    assert!(u("weights_bytes") >= 898_304, "{report}");
    assert!(u("peak_activation_bytes") > 0);
    // The step's arena is within 5% of the most bytes its tensors hold live at once; its
    // outputs (the cache's) are apart: 8 items x 1024 tokens x 64 x 4 bytes.
    let (measured, planned) = (
        u("peak_activation_bytes"),
        u("planned_peak_activation_bytes"),
    );
    assert!(planned <= measured, "{planned} > {measured}");
    assert!(
        measured as f64 <= 1.05 * planned as f64,
        "{planned} vs {measured}"
    );
    assert_eq!(u("step_outputs_bytes"), 8 * 1024 * 64 * 4);
    // After start only the weights remain allocated; the run's memory went back to the device.
    assert_eq!(
        report["after_start"]["allocator_allocated"].as_u64(),
        Some(u("weights_bytes"))
    );
    assert!(u("available_bytes") < u("requested_bytes"));
    assert_eq!(report["mode"], "dry", "{report}");
    // Standard error is not a terminal here: progress comes as log lines, one per phase at
    // least, each ending with its time.
    for phase in ["loading weights", "uploading weights", "profiling"] {
        assert!(
            stderr.contains(&format!("iris: {phase}: ")) && stderr.contains(" done in "),
            "{phase}: {stderr}"
        );
    }
    assert!(
        stderr.contains("dry run of the largest step: image grid [1, 64, 64] (1024 tokens) x 8"),
        "{stderr}"
    );
    for key in ["read_weights_s", "upload_weights_s", "profile_s"] {
        let seconds = report["timings"][key].as_f64();
        assert!(seconds.is_some_and(|s| s >= 0.0), "{key}: {report}");
    }

    // The measured run of the same step: the dry run's peak is not below it.
    let output = iris(
        &[
            "profile",
            "--model",
            "tiny",
            "--profile",
            "real",
            "--json",
            NO_VIDEO[0],
            NO_VIDEO[1],
        ],
        None,
    );
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stderr}");
    let real: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(real["mode"], "real", "{real}");
    let real_peak = real["peak_activation_bytes"].as_u64().expect("a peak");
    assert_eq!(
        measured, real_peak,
        "the dry run's arena is the real step's"
    );
}

#[test]
fn by_default_vllms_largest_video_sets_the_profile() {
    // vLLM's profiling video for a Qwen2-VL: 14 frames of the largest image, 7 temporal
    // groups of 1024 tokens; one such item a step (8192 // 7168).
    let output = iris(&["profile", "--model", "tiny", "--json"], None);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let report: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(report["max_item_modality"], "video", "{report}");
    assert_eq!(report["max_item_grid"], serde_json::json!([7, 64, 64]));
    assert_eq!(report["max_item_tokens"], 7168);
    assert_eq!(report["items_per_batch"], 1);
    assert_eq!(
        report["modality_max_tokens"],
        serde_json::json!([["image", 1024], ["video", 7168]])
    );
    // A 4096-token context holds four groups, eight frames.
    let output = iris(
        &["profile", "--model", "tiny", "--max-model-len", "4096"],
        None,
    );
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(output.status.success(), "{stdout}");
    assert!(
        stdout
            .contains("video grid [4, 64, 64], 4096 tokens; 2 per batch (the video set the peak)"),
        "{stdout}"
    );
    for (limit, needle) in [
        (r#"{"video": 0, "image": 0}"#, "leaves no modality"),
        (r#"{"audio": 1}"#, "image and video"),
        (
            r#"{"video": {"count": 1, "num_frames": 8}}"#,
            "only `count`",
        ),
        ("video", "not JSON"),
    ] {
        let output = iris(
            &["profile", "--model", "tiny", "--limit-mm-per-prompt", limit],
            None,
        );
        assert!(!output.status.success(), "{limit}");
        let stderr = String::from_utf8_lossy(&output.stderr);
        assert!(stderr.contains(needle), "{limit}: {stderr}");
    }
}

#[test]
fn the_text_report_names_the_profile_that_ran() {
    let output = iris(&["profile", "--model", "tiny"], None);
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{}",
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(stdout.contains("(dry profile)"), "{stdout}");
    assert!(stdout.contains("start-up time"), "{stdout}");
    let output = iris(&["profile", "--model", "tiny", "--profile", "fast"], None);
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("expected `dry` or `real`"), "{stderr}");
}

#[test]
fn bad_utilization_and_too_little_memory_are_clear_errors() {
    let output = iris(
        &[
            "profile",
            "--model",
            "tiny",
            "--device-memory-utilization",
            "1.5",
        ],
        None,
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    // Named by its flag, and refused before the device is opened.
    assert!(
        stderr.contains("--device-memory-utilization") && stderr.contains("in (0, 1], got `1.5`"),
        "{stderr}"
    );

    // 4 MiB holds the weights but not the profiling run.
    let output = iris(
        &["profile", "--model", "tiny"],
        Some("device = \"cpu\"\n[plugins.cpu]\ncapacity = \"4MiB\"\n"),
    );
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(stderr.contains("start-up profiling failed"), "{stderr}");
    assert!(stderr.to_lowercase().contains("memory"), "{stderr}");
}
