//! The example runs end to end: it loads the CPU plugin by path, encodes its own image and
//! prints the shape and a memory report.

use std::process::Command;

#[test]
fn the_example_encodes_an_image_and_reports_memory() {
    let output = Command::new(env!("CARGO_BIN_EXE_embed-core"))
        .output()
        .expect("the example runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(output.status.success(), "{stdout}{stderr}");
    assert!(stdout.contains("libiris_device_cpu.so"), "{stdout}");
    // 224x224 -> 16x16 patches -> 64 tokens of the tiny tower's 64 output channels.
    assert!(
        stdout.contains("grid [1, 16, 16], 64 tokens, embeddings [64, 64]"),
        "{stdout}"
    );
    assert!(stdout.contains("\"allocator_reserved\""), "{stdout}");
}

#[test]
fn a_missing_plugin_is_a_clear_error() {
    let output = Command::new(env!("CARGO_BIN_EXE_embed-core"))
        .arg("/nonexistent/libiris_device_x.so")
        .output()
        .expect("the example runs");
    assert!(!output.status.success());
    let stderr = String::from_utf8_lossy(&output.stderr);
    assert!(
        stderr.contains("/nonexistent/libiris_device_x.so"),
        "{stderr}"
    );
}
