//! `iris devices` with the CUDA plugin beside it: on a machine without an NVIDIA driver the plugin
//! is listed with no device and the reason, and nothing fails.
//!
//! The plugin is a dev-dependency of this package, so cargo builds `libiris_device_cuda.so` into
//! the folder of this test binary, which the test puts on `IRIS_PLUGIN_PATH`.

use std::path::PathBuf;
use std::process::Command;

fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binaries know their own path");
    exe.parent()
        .expect("a test binary lives in a folder")
        .to_path_buf()
}

/// Whether this machine has a CUDA driver on the loader's path.
fn has_driver() -> bool {
    ["libcuda.so.1", "libcuda.so"].into_iter().any(|name| {
        // SAFETY: opening the system's CUDA driver runs only its initialisers.
        unsafe { libloading::Library::new(name) }.is_ok()
    })
}

#[test]
fn devices_lists_the_cuda_plugin_with_its_reason() {
    let output = Command::new(env!("CARGO_BIN_EXE_iris"))
        .args(["devices", "--json"])
        .current_dir(std::env::temp_dir())
        .env("IRIS_PLUGIN_PATH", deps_dir())
        .env_remove("IRIS_DEVICE")
        .output()
        .expect("the iris binary runs");
    let stdout = String::from_utf8_lossy(&output.stdout);
    assert!(
        output.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&output.stderr)
    );
    let listing: serde_json::Value = serde_json::from_str(&stdout).expect("JSON output");
    let cuda = listing["plugins"]
        .as_array()
        .expect("a list of plugins")
        .iter()
        .find(|plugin| plugin["name"] == "cuda")
        .unwrap_or_else(|| panic!("the cuda plugin is listed: {stdout}"));
    assert!(cuda["error"].is_null(), "the cuda plugin loads: {cuda}");
    let devices = cuda["devices"].as_array().expect("a device list");
    let reason = cuda["reason"].as_str().unwrap_or_default();
    if has_driver() {
        // A machine with a driver lists its devices, or says why it cannot.
        assert!(!devices.is_empty() || !reason.is_empty(), "{cuda}");
    } else {
        assert!(devices.is_empty(), "{cuda}");
        assert!(reason.contains("libcuda.so.1 not found"), "{reason}");
    }
}
