//! Runs the real `iris` binary: `iris devices` and `iris plugin check`.
//!
//! Plugin libraries (the CPU device, the backend template, a load-failure fixture) are cargo
//! dependencies of this package, so cargo builds them into the folder of this test binary.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

fn deps_dir() -> PathBuf {
    let exe = std::env::current_exe().expect("test binaries know their own path");
    exe.parent()
        .expect("a test binary lives in a folder")
        .to_path_buf()
}

fn library(name: &str) -> PathBuf {
    deps_dir().join(iris_plugin::loader::library_file_name(name))
}

fn fixture(name: &str) -> PathBuf {
    deps_dir().join(format!("libiris_fixture_{name}.so"))
}

/// A plugin folder holding the `init-error` fixture under a plugin's file name, so discovery
/// meets a library that fails to load (fixtures are not named like plugins, so that discovery
/// next to a development build never lists them).
fn failing_plugin_dir() -> PathBuf {
    let dir = std::env::temp_dir().join(format!("iris-failing-plugins-{}", std::process::id()));
    std::fs::create_dir_all(&dir).expect("temp folder");
    let target = dir.join(iris_plugin::loader::library_file_name("init_error"));
    if !target.exists() {
        // Copy to a unique name, then rename: tests run in parallel.
        let partial = dir.join(format!("partial-{:?}", std::thread::current().id()));
        std::fs::copy(fixture("init_error"), &partial).expect("fixture copied");
        std::fs::rename(&partial, &target).expect("fixture in place");
    }
    dir
}

/// `iris` with a clean environment: no config file in the current folder, plugins searched in
/// the dependency folder and the failing-plugin folder.
fn iris(args: &[&str]) -> Output {
    let workdir = std::env::temp_dir();
    let plugin_path = format!(
        "{}:{}",
        deps_dir().display(),
        failing_plugin_dir().display()
    );
    Command::new(env!("CARGO_BIN_EXE_iris"))
        .args(args)
        .current_dir(&workdir)
        .env("IRIS_PLUGIN_PATH", plugin_path)
        .env_remove("IRIS_DEVICE")
        .output()
        .expect("the iris binary runs")
}

fn text(bytes: &[u8]) -> String {
    String::from_utf8_lossy(bytes).into_owned()
}

#[test]
fn devices_json_lists_builtin_and_library_cpu() {
    let output = iris(&["devices", "--json"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("valid JSON");
    let plugins = json["plugins"].as_array().expect("a plugins array");

    let builtin = plugins
        .iter()
        .find(|p| p["name"] == "cpu" && p["path"].is_null())
        .expect("the built-in cpu plugin is listed");
    assert_eq!(builtin["abi_major"], iris_plugin::abi::ABI_MAJOR);
    let device = &builtin["devices"][0];
    assert_eq!(device["ordinal"], 0);
    assert!(device["total_bytes"].as_u64().unwrap() > 0);
    assert!(device["free_bytes"].as_u64().unwrap() <= device["total_bytes"].as_u64().unwrap());
    for key in [
        "name",
        "path",
        "version",
        "abi_major",
        "abi_minor",
        "devices",
        "reason",
        "error",
    ] {
        assert!(builtin.get(key).is_some(), "key {key} missing: {builtin}");
    }

    let cpu_library = library("cpu");
    let library_entry = plugins
        .iter()
        .find(|p| p["name"] == "cpu" && p["path"].as_str().map(Path::new) == Some(&cpu_library))
        .unwrap_or_else(|| {
            panic!(
                "the cpu library {} is listed: {json}",
                cpu_library.display()
            )
        });
    assert_eq!(library_entry["devices"].as_array().unwrap().len(), 1);
    assert!(library_entry["error"].is_null());

    let failed = plugins
        .iter()
        .find(|p| p["name"] == "init_error")
        .expect("a library that fails to load is listed");
    assert!(
        failed["error"]
            .as_str()
            .unwrap()
            .contains("failed to initialise"),
        "{failed}"
    );
}

#[test]
fn devices_table_is_readable() {
    let output = iris(&["devices"]);
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stdout = text(&output.stdout);
    assert!(stdout.starts_with("PLUGIN"), "{stdout}");
    assert!(
        stdout.contains("init_error"),
        "failed loads are listed: {stdout}"
    );
    assert!(stdout.contains("built-in"), "{stdout}");
}

#[test]
fn plugin_check_builtin_cpu_passes() {
    let output = iris(&["plugin", "check", "cpu", "--json"]);
    assert!(
        output.status.success(),
        "{}{}",
        text(&output.stdout),
        text(&output.stderr)
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("valid JSON");
    assert_eq!(json["plugin"], "cpu");
    assert!(json["path"].is_null());
    assert_eq!(
        json["abi"],
        format!(
            "{}.{}",
            iris_plugin::abi::ABI_MAJOR,
            iris_plugin::abi::ABI_MINOR
        )
    );
    assert_eq!(json["failed"], 0);
    // Every device of the plugin is checked: the CPU plugin has one.
    let devices = json["devices"].as_array().unwrap();
    assert_eq!(devices.len(), 1);
    assert_eq!(devices[0]["ordinal"], 0);
    let checks = devices[0]["checks"].as_array().unwrap();
    assert!(!checks.is_empty());
    let passed = checks.iter().filter(|c| c["status"] == "pass").count();
    assert_eq!(json["passed"], passed);
    // Op checks carry their time and throughput.
    let gemm = checks
        .iter()
        .find(|c| c["name"] == "op.gemm.tower_qkv_1024x1280x3840.f32")
        .expect("the tower-sized gemm is checked");
    assert_eq!(gemm["timing"]["unit"], "GFLOP/s");
    assert!(gemm["timing"]["throughput"].as_f64().unwrap() > 0.0);
}

#[test]
fn plugin_check_an_ordinal_the_plugin_lacks_exits_2() {
    let output = iris(&["plugin", "check", "cpu", "--ordinal", "3"]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stdout));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("3"), "{stderr}");
}

#[test]
fn plugin_check_template_path_passes_with_ops_unsupported() {
    let path = library("template");
    let output = iris(&["plugin", "check", path.to_str().unwrap()]);
    let stdout = text(&output.stdout);
    assert!(output.status.success(), "{stdout}{}", text(&output.stderr));
    assert!(stdout.contains("memory.accounting"), "{stdout}");
    assert!(stdout.contains("unsupported"), "{stdout}");
}

#[test]
fn plugin_check_unloadable_fixture_exits_2() {
    let path = fixture("init_error");
    let output = iris(&["plugin", "check", path.to_str().unwrap()]);
    assert_eq!(output.status.code(), Some(2), "{}", text(&output.stdout));
    let stderr = text(&output.stderr);
    assert!(stderr.contains("libiris_fixture_init_error.so"), "{stderr}");
    assert!(stderr.contains("failed to initialise"), "{stderr}");
}

#[test]
fn config_errors_name_the_key() {
    let dir = std::env::temp_dir().join(format!("iris-cli-config-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("iris.toml");
    std::fs::write(&file, "[plugins.cpu]\nthreads = [1]\n").unwrap();
    let output = iris(&["--config", file.to_str().unwrap(), "devices"]);
    std::fs::remove_dir_all(&dir).unwrap();
    assert!(!output.status.success());
    let stderr = text(&output.stderr);
    assert!(stderr.contains("plugins.cpu.threads"), "{stderr}");
}

/// Plugins log through the host: with `IRIS_LOG` raised, the CPU device's message on opening
/// reaches stderr tagged with the plugin's name and the device ordinal, and stdout stays JSON.
#[test]
fn plugin_messages_reach_the_log_with_plugin_and_device() {
    let output = Command::new(env!("CARGO_BIN_EXE_iris"))
        .args(["devices", "--json"])
        .current_dir(std::env::temp_dir())
        .env("IRIS_PLUGIN_PATH", deps_dir())
        .env("IRIS_LOG", "iris::plugin=debug")
        .env_remove("IRIS_DEVICE")
        .output()
        .expect("the iris binary runs");
    assert!(output.status.success(), "{}", text(&output.stderr));
    let stderr = text(&output.stderr);
    assert!(
        stderr.contains("opened: ") && stderr.contains("plugin=cpu") && stderr.contains("device=0"),
        "{stderr}"
    );
    let json: serde_json::Value = serde_json::from_slice(&output.stdout).expect("stdout is JSON");
    let cpu = &json["plugins"][0];
    assert_eq!(cpu["devices"][0]["properties"]["queue"], "async");
    assert!(cpu["devices"][0]["held"].is_object());
}
