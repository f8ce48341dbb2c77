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

#[test]
fn tiny_profile_reports_every_figure() {
    let output = iris(&["profile", "--model", "tiny", "--json"], None);
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
    assert_eq!(u("max_item_tokens"), 1024);
    assert_eq!(u("items_per_batch"), 8);
    assert_eq!(u("encoder_cache_tokens"), 8192);
    assert_eq!(u("encoder_cache_bytes"), 8192 * 64 * 4);
    assert!(u("weights_bytes") >= 898_304, "{report}");
    assert!(u("peak_activation_bytes") > 0);
    // Planning sizes requests as the allocator rounds them; the run can exceed it only by the
    // unsplit remainders of reused blocks.
    let (measured, planned) = (
        u("peak_activation_bytes"),
        u("planned_peak_activation_bytes"),
    );
    assert!(planned <= measured, "{planned} > {measured}");
    assert!(
        measured - planned <= measured / 50,
        "{planned} vs {measured}"
    );
    // After start only the weights remain allocated; the run's memory went back to the device.
    assert_eq!(
        report["after_start"]["allocator_allocated"].as_u64(),
        Some(u("weights_bytes"))
    );
    assert!(u("available_bytes") < u("requested_bytes"));
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
    assert!(stderr.contains("1.5"), "{stderr}");

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
