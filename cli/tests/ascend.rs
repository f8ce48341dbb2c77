//! The `iris` binary on the Ascend device over the emulated CANN runtime: `iris devices`,
//! `iris plugin check ascend`, `iris encode` against the CPU device, `iris bench` with its
//! verdict, injected faults the engine survives, and every other device working without CANN.
//!
//! The Ascend plugin and the emulation are dependencies of this package, so cargo builds
//! them next to the test binary; each test makes its own install folder of symlinks to the
//! emulation and points `ASCEND_HOME_PATH` at it.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

/// Emulated memory per NPU.
const HBM: &str = "8GiB";
/// Softmax kernels the engine's start-up runs with the `tiny` model and [`BENCH`]'s engine
/// flags (its memory profiling): a fault injected later hits a request, not the start.
const STARTUP_SOFTMAX_RUNS: u64 = 8;
/// A short seed experiment on the `tiny` model.
const BENCH: [&str; 20] = [
    "--model",
    "tiny",
    "--weights",
    "dummy",
    "--max-num-batched-tokens",
    "2048",
    "--num-prompts",
    "16",
    "--images-per-prompt",
    "2",
    "--image-size",
    "112x112,224x168",
    "--repeat-ratio",
    "0.25",
    "--request-rate",
    "inf",
    "--max-concurrency",
    "2",
    "--no-progress",
    "--seed",
];

fn deps_dir() -> PathBuf {
    std::env::current_exe()
        .expect("test binary path")
        .parent()
        .expect("a test binary lives in a folder")
        .to_path_buf()
}

fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("iris-ascend-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(dir.join("lib64")).expect("temp folder");
    dir
}

/// An install root whose `lib64/` exposes the emulation as CANN's libraries.
fn emulated_install(name: &str) -> PathBuf {
    let root = folder(name);
    let emulator = deps_dir().join("libiris_cann_emulator.so");
    assert!(emulator.is_file(), "{} is built", emulator.display());
    for lib in [
        "libacl_rt.so",
        "libnnopbase.so",
        "libopapi_math.so",
        "libopapi_nn.so",
        "libopapi_transformer.so",
    ] {
        std::os::unix::fs::symlink(&emulator, root.join("lib64").join(lib)).expect("symlink");
    }
    root
}

/// `iris` with CANN's variables pointing at `root` (and nothing else of CANN's or the
/// emulation's inherited), plus `env`.
fn iris(dir: &Path, root: &Path, env: &[(&str, &str)], args: &[&str]) -> Output {
    let mut cmd = Command::new(env!("CARGO_BIN_EXE_iris"));
    // No config file of the current folder, no device or plugin path from the environment.
    cmd.current_dir(dir)
        .env_remove("IRIS_DEVICE")
        .env_remove("IRIS_PLUGIN_PATH")
        .env_remove("IRIS_API_KEY");
    for var in [
        "ASCEND_INSTALL_PATH",
        "ASCEND_TOOLKIT_HOME",
        "ASCEND_RT_VISIBLE_DEVICES",
        "LD_LIBRARY_PATH",
    ] {
        cmd.env_remove(var);
    }
    for (key, _) in std::env::vars() {
        if key.starts_with("ASCEND_EMU_") {
            cmd.env_remove(key);
        }
    }
    cmd.env("ASCEND_HOME_PATH", root)
        .env("ASCEND_EMU_HBM", HBM)
        .envs(env.iter().copied())
        .args(args)
        .output()
        .expect("iris runs")
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn ascend_entry(json: &Value) -> &Value {
    json["plugins"]
        .as_array()
        .expect("plugins")
        .iter()
        .find(|p| p["name"] == "ascend")
        .unwrap_or_else(|| panic!("the ascend plugin is listed: {json}"))
}

#[test]
fn devices_lists_the_emulated_npus_and_without_cann_says_why() {
    let root = emulated_install("devices");
    let output = iris(&root, &root, &[], &["devices", "--json"]);
    assert!(output.status.success(), "{}", text(&output));
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let ascend = ascend_entry(&json);
    let devices = ascend["devices"].as_array().expect("devices");
    assert_eq!(devices.len(), 2, "{ascend}");
    for (ordinal, device) in devices.iter().enumerate() {
        assert_eq!(device["ordinal"], ordinal);
        assert_eq!(device["name"], "Ascend910B3");
        assert_eq!(device["total_bytes"], 8u64 << 30);
        let free = device["free_bytes"].as_u64().expect("free");
        assert!(free < 8 << 30 && free > 7 << 30, "{device}");
    }

    // Without CANN: the reason, and every other device still works.
    let empty = folder("no-cann");
    let output = iris(&empty, &empty, &[], &["devices", "--json"]);
    assert!(output.status.success(), "{}", text(&output));
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let ascend = ascend_entry(&json);
    assert_eq!(ascend["devices"].as_array().map(Vec::len), Some(0));
    let reason = ascend["reason"].as_str().expect("a reason");
    assert!(
        reason.starts_with("libacl_rt.so not found in: "),
        "{reason}"
    );
    assert!(
        json["plugins"]
            .as_array()
            .expect("plugins")
            .iter()
            .any(|p| p["name"] == "cpu" && !p["devices"].as_array().expect("devices").is_empty()),
        "{json}"
    );
    let image =
        Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/golden/images/tower_a.png");
    let out = empty.join("cpu.safetensors");
    let output = iris(
        &empty,
        &empty,
        &[],
        &[
            "encode",
            "--device",
            "cpu",
            "--out",
            out.to_str().expect("path"),
            image.to_str().expect("path"),
        ],
    );
    assert!(output.status.success(), "{}", text(&output));
}

#[test]
fn plugin_check_ascend_passes_over_the_emulation() {
    let root = emulated_install("check");
    let output = iris(
        &root,
        &root,
        &[],
        &["plugin", "check", "ascend", "--ordinal", "1", "--json"],
    );
    assert!(output.status.success(), "{}", text(&output));
    let json: Value = serde_json::from_slice(&output.stdout).expect("JSON");
    assert_eq!(json["plugin"], "ascend");
    assert_eq!(json["failed"], 0, "{json}");
    let checks = json["devices"][0]["checks"].as_array().expect("checks");
    // Only optional capabilities may be unsupported: the Ascend device leaves `write_async`
    // to staging, as pinned staging already overlaps conversion and transfer, and keeps no
    // device memory for reuse that `trim` would give back.
    let unsupported: Vec<&str> = checks
        .iter()
        .filter(|c| c["status"] == "unsupported")
        .filter_map(|c| c["name"].as_str())
        .collect();
    assert_eq!(unsupported, ["queue.write_async", "memory.trim"], "{json}");
    assert!(
        checks
            .iter()
            .any(|c| c["name"] == "op.attention.d80.bf16" && c["status"] == "pass"),
        "{json}"
    );
}

/// Every tensor of a safetensors file of f32 values.
fn tensors(file: &Path) -> Vec<(String, Vec<f32>)> {
    let bytes = std::fs::read(file).expect("output file");
    let st = safetensors::SafeTensors::deserialize(&bytes).expect("safetensors");
    let mut names: Vec<String> = st.names().into_iter().map(str::to_owned).collect();
    names.sort();
    names
        .into_iter()
        .map(|name| {
            let view = st.tensor(&name).expect("tensor");
            assert_eq!(view.dtype(), safetensors::Dtype::F32);
            let values = view
                .data()
                .chunks_exact(4)
                .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
                .collect();
            (name, values)
        })
        .collect()
}

#[test]
fn encode_on_the_emulated_npu_matches_the_cpu_device() {
    let root = emulated_install("encode");
    let images = Path::new(env!("CARGO_MANIFEST_DIR")).join("../tests/data/golden/images");
    let inputs = ["tower_a.png", "tower_b.jpg", "photo.webp"].map(|name| images.join(name));
    for dtype in ["f32", "f16", "bf16"] {
        let mut results = Vec::new();
        for device in ["cpu", "ascend"] {
            let out = root.join(format!("{device}-{dtype}.safetensors"));
            let mut args = vec![
                "encode",
                "--device",
                device,
                "--model",
                "tiny",
                "--weights",
                "dummy",
                "--dtype",
                dtype,
                "--batch",
                "--out",
                out.to_str().expect("path"),
            ];
            args.extend(inputs.iter().map(|p| p.to_str().expect("path")));
            let output = iris(&root, &root, &[], &args);
            assert!(output.status.success(), "{}", text(&output));
            results.push(tensors(&out));
        }
        let tol =
            iris_plugin::conformance::tolerance(iris_plugin::DType::parse(dtype).expect("dtype"));
        assert_eq!(results[0].len(), 3);
        for ((name, cpu), (other, npu)) in results[0].iter().zip(&results[1]) {
            assert_eq!(name, other);
            assert_eq!(cpu.len(), npu.len(), "{name}");
            for (i, (c, n)) in cpu.iter().zip(npu).enumerate() {
                let (c, n) = (f64::from(*c), f64::from(*n));
                assert!(
                    (c - n).abs() <= tol * c.abs().max(1.0),
                    "{dtype} {name}[{i}]: cpu {c}, ascend {n} (tolerance {tol})"
                );
            }
        }
    }
}

fn bench(root: &Path, name: &str, env: &[(&str, &str)]) -> (Output, Value) {
    let dir = root.join(name);
    std::fs::create_dir_all(&dir).expect("folder");
    let json = dir.join("result.json");
    let mut args: Vec<&str> = vec!["bench", "--device", "ascend"];
    args.extend(BENCH);
    args.extend(["0", "--result-json", json.to_str().expect("path")]);
    let output = iris(&dir, root, env, &args);
    let text_out = text(&output);
    let value = std::fs::read_to_string(&json)
        .map(|s| serde_json::from_str(&s).expect("result JSON"))
        .unwrap_or_else(|err| panic!("no result JSON ({err}):\n{text_out}"));
    (output, value)
}

#[test]
fn bench_on_the_emulated_npu_returns_memory_to_the_baseline() {
    let root = emulated_install("bench");
    let (output, result) = bench(&root, "clean", &[]);
    let out = text(&output);
    assert!(output.status.success(), "{out}");
    assert!(out.contains("on Ascend910B3 [ascend]"), "{out}");
    assert!(
        out.contains("memory after reset returns to the post-start baseline: yes"),
        "{out}"
    );
    assert_eq!(result["requests"]["completed"], 16, "{result}");
    assert_eq!(result["requests"]["failed"], 0, "{result}");
    assert_eq!(result["leaked_bytes"], 0, "{result}");
}

#[test]
fn injected_faults_fail_their_requests_and_the_engine_goes_on() {
    let root = emulated_install("faults");
    let after_start = (STARTUP_SOFTMAX_RUNS + 4).to_string();
    for (name, env, expect) in [
        (
            "kernel-error",
            vec![
                ("ASCEND_EMU_FAIL_OP", "aclnnSoftmax"),
                ("ASCEND_EMU_FAIL_OP_AT", after_start.as_str()),
            ],
            "ACL_ERROR_RT_AICORE_EXCEPTION (507015)",
        ),
        (
            "kernel-panic",
            vec![
                ("ASCEND_EMU_PANIC_OP", "aclnnSoftmax"),
                ("ASCEND_EMU_PANIC_OP_AT", after_start.as_str()),
            ],
            "aclnnSoftmax kernel panicked",
        ),
    ] {
        let (output, result) = bench(&root, name, &env);
        let out = text(&output);
        assert!(output.status.success(), "{name}: {out}");
        let failed = result["requests"]["failed"].as_u64().expect("failed");
        let completed = result["requests"]["completed"].as_u64().expect("completed");
        assert!(failed >= 1, "{name}: the fault fails a request: {result}");
        assert_eq!(completed + failed, 16, "{name}: {result}");
        let errors = result["requests"]["errors"].to_string();
        assert!(errors.contains(expect), "{name}: {errors}");
        assert!(errors.contains("internal"), "{name}: {errors}");
        assert_eq!(
            result["memory_returned_to_baseline"], true,
            "{name}: {result}"
        );
        assert_eq!(result["leaked_bytes"], 0, "{name}: {result}");
    }
    // A refused allocation is retried by the caching allocator: nothing fails.
    let (output, result) = bench(&root, "oom", &[("ASCEND_EMU_FAIL_MALLOC_AT", "12")]);
    assert!(output.status.success(), "{}", text(&output));
    assert_eq!(result["requests"]["completed"], 16, "{result}");
    assert_eq!(result["leaked_bytes"], 0, "{result}");
}
