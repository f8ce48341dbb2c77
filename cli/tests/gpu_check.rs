//! The Python helpers of `tools/gpu-check.sh` against what the real binary writes, so that
//! neither side can drift from the other unnoticed (the first GPU run found a verdict step that
//! read a key `iris bench` never wrote, and so could never pass).
//!
//! - `tools/gpu-check/bench_verdict.py` on a real `iris bench --result-json`, on a doctored copy
//!   that leaked, on a report of the wrong shape, and with synthetic nvidia-smi logs.
//! - `tools/gpu-check/profile_verdict.py` on real `iris profile --json` outputs, dry and real,
//!   and on a doctored one.
//! - `tools/gpu-check/towers_vs_transformers.py`: its FLOP counts, and its iris side end to end
//!   (`--iris-only` on the CPU device with the tiny model), which reads `iris encode
//!   --timings-json`.
//! - `tools/gpu-check/kernel_model.py`: its kernels carry the towers' FLOP count, and it sums
//!   an Nsight Compute CSV by category (or says the file is not one).
//! - `tools/gpu-check.sh --prebuilt` itself over stand-in programs (an `iris`, a GPU test
//!   binary and an `nvidia-smi` that only answer): every step reached and recorded, the
//!   summary written, and `--budget` stopping a step and skipping the rest.
//!
//! They need `python3` (or `$PYTHON`): CI has it, and a machine without it fails here rather
//! than passing by doing nothing.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

// Each test binary uses a part of the shared helpers; this one starts no server.
#[allow(dead_code)]
mod common;

use common::{ENGINE, iris};

fn folder(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("iris-gpu-check-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).expect("temp folder");
    dir
}

fn tool(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tools/gpu-check")
        .join(name)
}

/// Runs a Python helper; a missing interpreter is a failure, not a skip.
fn python(script: &str, args: &[&str]) -> Output {
    let interpreter = std::env::var("PYTHON").unwrap_or_else(|_| "python3".to_owned());
    Command::new(&interpreter)
        .arg(tool(script))
        .args(args)
        .output()
        .unwrap_or_else(|err| {
            panic!("`{interpreter}` does not run ({err}); these tests need Python 3 (set PYTHON to use another)")
        })
}

/// Runs a Python helper that must succeed and write JSON to `json`; returns that JSON and the
/// helper's output.
fn python_json(script: &str, args: &[&str], json: &Path) -> (Value, String) {
    let out = python(script, args);
    assert!(out.status.success(), "{}", text(&out));
    let written = std::fs::read_to_string(json).expect("the helper wrote its JSON");
    (
        serde_json::from_str(&written).expect("JSON parses"),
        text(&out),
    )
}

fn text(output: &Output) -> String {
    format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    )
}

fn path_str(path: &Path) -> &str {
    path.to_str().expect("utf-8 temp path")
}

/// nvidia-smi's `--query-gpu=timestamp,index,memory.used --format=csv,noheader,nounits` lines
/// for GPU 0 (with GPU 1 beside it, which the verdict must ignore).
fn smi_log(dir: &Path, name: &str, used_mib: &[u32]) -> PathBuf {
    let mut log = String::new();
    for (i, used) in used_mib.iter().enumerate() {
        log.push_str(&format!("2026/01/01 00:00:{i:02}.000, 0, {used}\n"));
        log.push_str(&format!("2026/01/01 00:00:{i:02}.000, 1, 70000\n"));
    }
    let path = dir.join(name);
    std::fs::write(&path, log).expect("log written");
    path
}

#[test]
fn bench_verdict_reads_what_iris_bench_writes() {
    let dir = folder("verdict");
    let json = dir.join("bench.json");
    let bench = iris(&dir)
        .arg("bench")
        .args(ENGINE)
        .args([
            "--num-prompts",
            "6",
            "--images-per-prompt",
            "1",
            "--image-size",
            "56x56",
            "--request-rate",
            "inf",
            "--no-progress",
            "--result-json",
        ])
        .arg(&json)
        .output()
        .expect("iris bench runs");
    assert!(bench.status.success(), "{}", text(&bench));

    let passed = python("bench_verdict.py", &[path_str(&json)]);
    let out = text(&passed);
    assert_eq!(passed.status.code(), Some(0), "{out}");
    assert!(
        out.contains(
            "verdict: memory after reset returns to the post-start baseline: yes, leaked 0 bytes"
        ),
        "{out}"
    );
    assert!(
        out.contains("after_reset"),
        "the checkpoints are printed: {out}"
    );

    // The same report as if reset had not given 4 KiB back.
    let mut report: Value =
        serde_json::from_str(&std::fs::read_to_string(&json).expect("bench.json")).expect("JSON");
    report["memory_returned_to_baseline"] = Value::Bool(false);
    report["leaked_bytes"] = Value::from(4096);
    let leaked = dir.join("leaked.json");
    std::fs::write(&leaked, report.to_string()).expect("doctored copy written");
    let failed = python("bench_verdict.py", &[path_str(&leaked)]);
    let out = text(&failed);
    assert_eq!(failed.status.code(), Some(1), "{out}");
    assert!(out.contains("baseline: no, leaked 4096 bytes"), "{out}");

    // The shape the first version of the step expected: drift is its own exit status.
    let mut old = report.clone();
    if let Some(map) = old.as_object_mut() {
        map.remove("memory_returned_to_baseline");
        map.remove("leaked_bytes");
        map.insert(
            "verdict".into(),
            serde_json::json!({"returned": true, "leaked_bytes": 0}),
        );
    }
    let drifted = dir.join("drifted.json");
    std::fs::write(&drifted, old.to_string()).expect("old-shape copy written");
    let out = python("bench_verdict.py", &[path_str(&drifted)]);
    assert_eq!(out.status.code(), Some(2), "{}", text(&out));
    assert!(
        text(&out).contains("no `memory_returned_to_baseline`"),
        "{}",
        text(&out)
    );

    // --first-within: the slowest request against the median.
    let mut even = report.clone();
    even["memory_returned_to_baseline"] = Value::Bool(true);
    even["leaked_bytes"] = Value::from(0);
    even["latency_ms"]["p50"] = Value::from(10.0);
    even["latency_ms"]["max"] = Value::from(11.5);
    let even_path = dir.join("even.json");
    std::fs::write(&even_path, even.to_string()).expect("doctored copy written");
    let out = python(
        "bench_verdict.py",
        &[path_str(&even_path), "--first-within", "1.2"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("slowest 11.5 ms, median 10.0 ms (1.15x"),
        "{}",
        text(&out)
    );
    even["latency_ms"]["max"] = Value::from(31.4);
    std::fs::write(&even_path, even.to_string()).expect("doctored copy written");
    let out = python(
        "bench_verdict.py",
        &[path_str(&even_path), "--first-within", "1.2"],
    );
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(
        text(&out).contains("the slowest request took 3.14 times the median"),
        "{}",
        text(&out)
    );

    // nvidia-smi: 40 MiB more after the run than before is within the 64 MiB allowed; 65 is not.
    let within = smi_log(&dir, "within.csv", &[1000, 9000, 9100, 1040]);
    let out = python("bench_verdict.py", &[path_str(&json), path_str(&within)]);
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    assert!(
        text(&out).contains("before 1000 MiB, peak 9100 MiB, after 1040 MiB"),
        "{}",
        text(&out)
    );
    let held = smi_log(&dir, "held.csv", &[1000, 9000, 9100, 1065]);
    let out = python("bench_verdict.py", &[path_str(&json), path_str(&held)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    assert!(text(&out).contains("by 65 MiB"), "{}", text(&out));
    // The other GPU's figures are not this run's.
    let out = python(
        "bench_verdict.py",
        &[path_str(&json), path_str(&held), "--gpu", "1"],
    );
    assert_eq!(out.status.code(), Some(0), "{}", text(&out));
    // A log without a sample of the GPU cannot vouch for anything.
    let empty = smi_log(&dir, "empty.csv", &[]);
    let out = python("bench_verdict.py", &[path_str(&json), path_str(&empty)]);
    assert_eq!(out.status.code(), Some(1), "{}", text(&out));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn tower_flops_match_the_published_towers() {
    let dir = folder("flops");
    let json = dir.join("flops.json");
    let args = [
        "--flops",
        "--towers",
        "qwen2-vl-2b,qwen2.5-vl-7b,qwen3-vl-8b",
        "--json",
        path_str(&json),
    ];
    let (v, _) = python_json("towers_vs_transformers.py", &args, &json);
    // One 448x448 image, worked out by hand from the vision configs.
    for (tower, tflop) in [
        ("qwen2-vl-2b", 1.48),
        ("qwen2.5-vl-7b", 1.35),
        ("qwen3-vl-8b", 0.79),
    ] {
        let total = v["flop_per_image"][tower]["total"]
            .as_f64()
            .unwrap_or(f64::NAN)
            / 1e12;
        assert!((total - tflop).abs() <= 0.01, "{tower}: {total} TFLOP");
    }
    // Qwen2.5-VL's windowed layers: 28 of them over 16 windows of 64 patches, 4 over all 1024.
    let attention = v["flop_per_image"]["qwen2.5-vl-7b"]["attention"]
        .as_f64()
        .unwrap_or(f64::NAN);
    let (d, full, window) = (1280.0, 1024.0_f64, 64.0_f64);
    let expected = 4.0 * 4.0 * full * full * d + 28.0 * 16.0 * 4.0 * window * window * d;
    assert!(
        (attention - expected).abs() <= 1.0,
        "{attention} vs {expected}"
    );
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn towers_script_times_iris_in_one_process_per_batch() {
    let dir = folder("towers");
    let json = dir.join("towers.json");
    let out = python(
        "towers_vs_transformers.py",
        &[
            "--iris",
            env!("CARGO_BIN_EXE_iris"),
            "--iris-only",
            "--device",
            "cpu",
            "--towers",
            "tiny",
            "--image-size",
            "112",
            "--batches",
            "1,3",
            "--repeats",
            "2",
            "--peak-tflops",
            "1",
            "--json",
            path_str(&json),
        ],
    );
    assert!(out.status.success(), "{}", text(&out));
    let v: Value = serde_json::from_str(&std::fs::read_to_string(&json).expect("written"))
        .expect("JSON parses");
    let rows = v["rows"].as_array().expect("rows");
    assert_eq!(rows.len(), 2, "{v}");
    for (row, images) in rows.iter().zip([1u64, 3]) {
        assert_eq!(row["images"], images, "{row}");
        // 112x112 is 8x8 patches, 16 tokens after the 2x2 merge.
        assert_eq!(row["tokens"], images * 16, "{row}");
        let iris = &row["iris"];
        assert_eq!(iris["calls_ms"].as_array().map(Vec::len), Some(2), "{row}");
        assert_eq!(
            iris["forward_ms"].as_array().map(Vec::len),
            Some(2),
            "{row}"
        );
        assert_eq!(iris["warmup"], true, "{row}");
        // The comparison takes the forward pass alone; the whole call (upload, read-back) is
        // kept beside it and is never the shorter.
        let forward = iris["median_ms"].as_f64().unwrap_or(f64::NAN);
        let call = iris["call_median_ms"].as_f64().unwrap_or(f64::NAN);
        assert!(forward <= call, "{row}");
        for key in [
            "first_ms",
            "first_call_ms",
            "call_median_ms",
            "median_ms",
            "ms_per_image",
            "tflops",
            "share_of_peak",
        ] {
            let x = iris[key].as_f64().unwrap_or(f64::NAN);
            assert!(x.is_finite() && x > 0.0, "{key} in {row}");
        }
        let per_image = iris["ms_per_image"].as_f64().unwrap_or(f64::NAN);
        let median = iris["median_ms"].as_f64().unwrap_or(f64::NAN);
        assert!(
            (per_image * images as f64 - median).abs() <= 1e-9 * median,
            "{row}"
        );
        assert!(row["transformers"].is_null(), "{row}");
    }
    assert!(
        text(&out).contains("| tiny | 3 |"),
        "the table has a row per batch: {}",
        text(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// `tools/gpu-check/profile_verdict.py` on the whole output (progress lines and report) of
/// `iris profile --json`, dry and real, on the CPU device: it passes on what iris writes, and
/// fails when the real arena differs or the arena is far above the live peak.
#[test]
fn profile_verdict_reads_what_iris_profile_writes() {
    let dir = folder("profile");
    let mut files = Vec::new();
    for mode in ["dry", "real"] {
        let output = iris(&dir)
            .args(["profile", "--model", "tiny", "--json", "--profile", mode])
            .output()
            .expect("iris runs");
        assert!(output.status.success(), "{}", text(&output));
        let path = dir.join(format!("profile-{mode}.json"));
        // As gpu-check's `run` keeps it: standard error's progress lines, then the report.
        std::fs::write(
            &path,
            format!(
                "{}{}",
                String::from_utf8_lossy(&output.stderr),
                String::from_utf8_lossy(&output.stdout)
            ),
        )
        .expect("written");
        files.push(path);
    }
    let verdict = python(
        "profile_verdict.py",
        &[path_str(&files[0]), path_str(&files[1])],
    );
    assert!(verdict.status.success(), "{}", text(&verdict));
    assert!(
        text(&verdict).contains("verdict: pass"),
        "{}",
        text(&verdict)
    );

    // A real step whose arena differs, and an arena far above the live peak, fail.
    let real = std::fs::read_to_string(&files[1]).expect("read");
    let start = real.find("\n{").expect("a report") + 1;
    let mut report: Value = serde_json::from_str(&real[start..]).expect("JSON");
    let arena = report["peak_activation_bytes"].as_u64().expect("a peak");
    report["peak_activation_bytes"] = Value::from(arena + 512);
    let doctored = dir.join("profile-doctored.json");
    std::fs::write(&doctored, report.to_string()).expect("written");
    let verdict = python(
        "profile_verdict.py",
        &[path_str(&files[0]), path_str(&doctored)],
    );
    assert!(!verdict.status.success(), "{}", text(&verdict));
    assert!(text(&verdict).contains("differs"), "{}", text(&verdict));
    let _ = std::fs::remove_dir_all(&dir);
}

#[test]
fn kernel_model_counts_the_towers_flops_and_sums_ncu_by_category() {
    let dir = folder("kernels");
    let json = dir.join("model.json");
    let args = [
        "--towers",
        "qwen2-vl-2b,qwen2.5-vl-7b,qwen3-vl-8b",
        "--json",
        path_str(&json),
    ];
    let (v, _) = python_json("kernel_model.py", &args, &json);
    // (tower, images of the 8192-token step, blocks, mergers).
    for (i, (tower, images, depth, mergers)) in [
        ("qwen2-vl-2b", 32, 32, 1),
        ("qwen2.5-vl-7b", 32, 32, 1),
        ("qwen3-vl-8b", 41, 27, 4),
    ]
    .into_iter()
    .enumerate()
    {
        let model = &v[i];
        assert_eq!(model["tower"], tower);
        assert_eq!(model["images"], images, "{tower}");
        // The kernels' FLOPs are the tower's count, for the whole pass.
        let counted: f64 = model["kernels"]
            .as_array()
            .expect("kernels")
            .iter()
            .map(|k| k["gflop"].as_f64().unwrap_or(f64::NAN))
            .sum();
        let expected =
            model["flop_per_image"].as_f64().unwrap_or(f64::NAN) * f64::from(images) / 1e9;
        assert!(
            (counted - expected).abs() <= expected * 1e-9,
            "{tower}: {counted} GFLOP in kernels, {expected} counted"
        );
        let launches = |category: &str| model["categories"][category]["launches"].as_u64();
        assert_eq!(launches("attention"), Some(depth), "{tower}");
        assert_eq!(launches("norm"), Some(2 * depth + mergers), "{tower}");
        // Each block's qkv, proj and two or three MLP products, the patch embedding, and two
        // per merger.
        let mlp = if tower == "qwen2.5-vl-7b" { 3 } else { 2 };
        assert_eq!(
            launches("gemm"),
            Some(1 + depth * (2 + mlp) + 2 * mergers),
            "{tower}"
        );
        let per_image = model["model_ms_per_image"].as_f64().unwrap_or(f64::NAN);
        assert!(
            per_image > 0.5 && per_image < 10.0,
            "{tower}: {per_image} ms"
        );
    }

    // Nsight Compute's CSV (the details page with one metric): its log lines unquoted, times in
    // whatever unit ncu chose per row.
    let header = "\"ID\",\"Process ID\",\"Process Name\",\"Host Name\",\"Kernel Name\",\"Context\",\"Stream\",\"Block Size\",\"Grid Size\",\"Device\",\"CC\",\"Section Name\",\"Metric Name\",\"Metric Unit\",\"Metric Value\"";
    let metric_row = |id: u32, kernel: &str, metric: &str, unit: &str, value: &str| {
        format!(
            "\"{id}\",\"4242\",\"iris\",\"127.0.0.1\",\"{kernel}\",\"1\",\"13\",\"(256, 1, 1)\",\"(64, 1, 1)\",\"0\",\"9.0\",\"Command line profiler metrics\",\"{metric}\",\"{unit}\",\"{value}\""
        )
    };
    let row = |id: u32, kernel: &str, unit: &str, value: &str| {
        metric_row(id, kernel, "gpu__time_duration.sum", unit, value)
    };
    let csv = [
        "==PROF== Connected to process 4242 (iris)".to_owned(),
        header.to_owned(),
        row(
            0,
            "sm90_xmma_gemm_bf16bf16_bf16f32_f32_tn_n_tilesize128x128x64_cublas",
            "msecond",
            "1.5",
        ),
        row(
            1,
            "nvjet_tst_128x256_64x4_1x2_h_bz_coopA_NTT",
            "usecond",
            "500",
        ),
        row(2, "flash_attention_bf16_72", "usecond", "410.5"),
        // The attention kernel's DRAM bytes and SM throughput; the epilogue's bytes in another
        // unit.
        metric_row(
            2,
            "flash_attention_bf16_72",
            "dram__bytes.sum",
            "Mbyte",
            "205.25",
        ),
        metric_row(
            2,
            "flash_attention_bf16_72",
            "sm__throughput.avg.pct_of_peak_sustained_elapsed",
            "%",
            "61.5",
        ),
        row(3, "gemm_epilogue_bf16", "nsecond", "20,000"),
        metric_row(3, "gemm_epilogue_bf16", "dram__bytes.sum", "Gbyte", "0.06"),
        row(4, "norm_bf16", "usecond", "12"),
        row(5, "rotary_bf16", "usecond", "8"),
        row(6, "gather_b2", "usecond", "4"),
        "==PROF== Disconnected from process 4242".to_owned(),
    ]
    .join("\n");
    let ncu = dir.join("ncu.csv");
    std::fs::write(&ncu, csv).expect("csv written");
    let json = dir.join("measured.json");
    let args = [
        "--towers",
        "qwen3-vl-8b",
        "--images",
        "41",
        "--ncu",
        path_str(&ncu),
        "--json",
        path_str(&json),
    ];
    let (v, printed) = python_json("kernel_model.py", &args, &json);
    let measured = &v[0]["ncu"];
    let seconds = |category: &str| measured[category]["seconds"].as_f64().unwrap_or(f64::NAN);
    let dram = |category: &str| measured[category]["bytes"].as_f64();
    let launches = |category: &str| measured[category]["launches"].as_u64();
    assert!((seconds("gemm") - 2.0e-3).abs() < 1e-12, "{measured}");
    assert_eq!(launches("gemm"), Some(2));
    assert!((seconds("attention") - 410.5e-6).abs() < 1e-12);
    assert!((seconds("gemm_epilogue") - 20e-6).abs() < 1e-12);
    assert_eq!(launches("norm"), Some(1));
    assert_eq!(launches("rotary"), Some(1));
    assert_eq!(launches("gather"), Some(1));
    assert_eq!(launches("other"), Some(0));
    assert!(printed.contains("ncu ms/image"), "{printed}");
    // DRAM bytes and their rate where ncu gave them: 205.25 MB in 410.5 µs is 0.50 TB/s; the
    // attention kernel's SMs 61.5% busy. None for categories without such rows.
    assert_eq!(dram("attention"), Some(205.25e6));
    assert_eq!(dram("gemm_epilogue"), Some(0.06e9));
    assert_eq!(dram("gemm"), None);
    assert_eq!(measured["attention"]["sm_pct"].as_f64(), Some(61.5));
    assert!(
        printed.contains("| 1 | 0.010 | 0.21 | 0.50 | 62% |"),
        "{printed}"
    );

    // cuDNN's fused attention kernels (their names hold `sm90_` too) count as attention.
    let cudnn = [
        header.to_owned(),
        row(
            0,
            "cudnn_generated_fort_native_sdpa_sm90_flash_fprop_wgmma_f16_knob_3_64x64x64_4x1x1_kernel0_0",
            "usecond",
            "300",
        ),
    ]
    .join("\n");
    std::fs::write(&ncu, cudnn).expect("csv written");
    let (v, _) = python_json("kernel_model.py", &args, &json);
    let measured = &v[0]["ncu"];
    assert_eq!(
        measured["attention"]["launches"].as_u64(),
        Some(1),
        "{measured}"
    );
    assert_eq!(measured["gemm"]["launches"].as_u64(), Some(0), "{measured}");

    // A file that is not ncu's CSV is an error that says so, not an empty table.
    std::fs::write(&ncu, "iris: no such device\n").expect("written");
    let out = python("kernel_model.py", &args);
    assert!(!out.status.success());
    assert!(
        text(&out).contains("no gpu__time_duration.sum rows"),
        "{}",
        text(&out)
    );
    let _ = std::fs::remove_dir_all(&dir);
}

/// A bundle for `tools/gpu-check.sh --prebuilt` whose programs are stand-ins: an `iris` that
/// lists one CUDA device, logs as `iris bench` would one cuBLASLt problem met during start-up
/// and two after it, and otherwise succeeds at once (writing nothing), a GPU test binary
/// that succeeds after `ops_seconds`, and the real script and helpers; with an `nvidia-smi`
/// that names a GPU and samples a fixed figure, in `<dir>/path`.
fn fake_gpu_bundle(dir: &Path, ops_seconds: u32) -> (PathBuf, PathBuf) {
    let bundle = dir.join("bundle");
    for sub in ["bin", "cuda", "gpu-check", "golden"] {
        std::fs::create_dir_all(bundle.join(sub)).expect("bundle folder");
    }
    let root = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    std::fs::copy(root.join("tools/gpu-check.sh"), bundle.join("gpu-check.sh"))
        .expect("copy the script");
    for entry in std::fs::read_dir(root.join("tools/gpu-check")).expect("helpers") {
        let path = entry.expect("entry").path();
        if path.extension().is_some_and(|ext| ext == "py") {
            std::fs::copy(
                &path,
                bundle.join("gpu-check").join(path.file_name().unwrap()),
            )
            .expect("copy a helper");
        }
    }
    let path_dir = dir.join("path");
    std::fs::create_dir_all(&path_dir).expect("path folder");
    let scripts = [
        (
            bundle.join("bin/iris"),
            "#!/usr/bin/env bash\ncase \"$1\" in\n  devices) echo '{\"plugins\": [{\"name\": \
             \"cuda\", \"devices\": [{\"properties\": {\"cuda_libraries\": \"CUDA 13 \
             (stand-in)\", \"attention_engine\": \"kernel: stand-in\"}}]}]}' ;;\n  bench) \
             printf '%s\\n' \"$PROBLEM 8x32x32 (bf16): heuristic 0.50 ms, first matmul call 7.00 \
             ms\" 'engine: model stand-in' \"$PROBLEM 784x3456x1152 (bf16, bias): heuristic 1.00 \
             ms, first matmul call 10.00 ms\" \"$PROBLEM 784x1152x1152 (bf16): heuristic 0.50 ms, \
             first matmul call 2.00 ms\" >&2 ;;\n  *) true ;;\nesac\n"
                .replace("$PROBLEM", "DEBUG iris::plugin: cuBLASLt problem"),
        ),
        (
            bundle.join("cuda/ops"),
            format!("#!/usr/bin/env bash\nsleep {ops_seconds}\n"),
        ),
        (
            path_dir.join("nvidia-smi"),
            "#!/usr/bin/env bash\ncase \"$*\" in\n  *-lms*) while true; do echo '2026/01/01 \
             00:00:00.000, 0, 100'; sleep 0.2; done ;;\n  *) echo '0, Stand-in GPU, 580.00, \
             143771, 100' ;;\nesac\n"
                .to_owned(),
        ),
    ];
    for (path, body) in scripts {
        std::fs::write(&path, body).expect("script written");
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(&path, std::fs::Permissions::from_mode(0o755))
            .expect("executable");
    }
    (bundle, path_dir)
}

/// Runs the bundle's `gpu-check.sh --prebuilt` with `args`, the stand-in `nvidia-smi` first on
/// PATH; returns its summary.json and output.
fn run_gpu_check(dir: &Path, bundle: &Path, path_dir: &Path, args: &[&str]) -> (Value, String) {
    let out = dir.join("out");
    let path = format!(
        "{}:{}",
        path_dir.display(),
        std::env::var("PATH").unwrap_or_default()
    );
    let output = Command::new("bash")
        .arg(bundle.join("gpu-check.sh"))
        .args(["--prebuilt", path_str(bundle), "--out", path_str(&out)])
        .args(args)
        .env("PATH", path)
        .env_remove("SKIP")
        .output()
        .expect("bash runs");
    let log = text(&output);
    let summary = std::fs::read_to_string(out.join("summary.json"))
        .unwrap_or_else(|err| panic!("no summary.json ({err}):\n{log}"));
    (serde_json::from_str(&summary).expect("summary parses"), log)
}

/// The status of step `name` in a summary.
fn step<'a>(summary: &'a Value, name: &str) -> Option<(&'a str, &'a str)> {
    summary["steps"].as_array()?.iter().find_map(|s| {
        (s["name"] == name).then(|| {
            (
                s["status"].as_str().unwrap_or(""),
                s["detail"].as_str().unwrap_or(""),
            )
        })
    })
}

/// The whole script runs on a machine without a GPU over stand-in programs: every step's
/// control flow, under `set -u`, to its summary (before, only its syntax was checked here, and
/// a slip in a step would have shown first on a lent GPU). Steps whose programs write nothing
/// fail or skip, as they must; what is checked is that each step is reached and recorded.
#[test]
fn gpu_check_runs_every_step_to_its_summary_over_stand_in_programs() {
    let dir = folder("script");
    let (bundle, path_dir) = fake_gpu_bundle(&dir, 0);
    let (summary, log) = run_gpu_check(&dir, &bundle, &path_dir, &["--quick"]);
    assert_eq!(summary["gpu"], "Stand-in GPU", "{log}");
    for (name, status) in [
        ("gpu", "pass"),
        ("plugin", "pass"),
        ("devices.cuda", "pass"),
        ("devices.attention_engine", "pass"),
        ("plugin-check", "pass"),
        ("ops-gpu", "pass"),
        ("encode.qwen3_vl.bf16.cuda", "pass"),
        ("bench", "pass"),
        // The stand-in wrote no result: nothing to judge.
        ("bench.verdict", "skip"),
        ("bench.7b", "pass"),
        ("first.qwen3-vl-8b", "pass"),
        ("profile.real", "pass"),
        ("serving.qwen3-vl-8b", "pass"),
        ("serving.qwen3-vl-8b.lanes1", "pass"),
    ] {
        let found = step(&summary, name);
        assert_eq!(
            found.map(|(s, _)| s),
            Some(status),
            "step {name}: {found:?}\n{log}"
        );
    }
    // The problems the plugin met after the bench's `engine:` line, from its debug log.
    assert_eq!(
        step(&summary, "first.qwen3-vl-8b.gemm"),
        Some((
            "pass",
            "2 cuBLASLt problems new after start-up: heuristic 1.5 ms, first calls 12.0 ms in \
             all (slowest 784x3456x1152, 10.0 ms)"
        )),
        "{log}"
    );
    // No stand-in writes safetensors: each comparison fails, naming the missing file.
    let (status, detail) = step(&summary, "encode.qwen2_vl.f32.compare").expect("compare step");
    assert_eq!(status, "fail");
    assert!(detail.contains("FileNotFoundError"), "{detail}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// `--budget`: a step still running when it ends is stopped and recorded as skipped, later ones
/// are not started, and the summary is written all the same.
#[test]
fn gpu_check_keeps_its_budget_and_still_writes_the_summary() {
    let dir = folder("budget");
    // The GPU tests would take a minute: they are stopped at the 8 s budget, and nothing
    // after them starts.
    let (bundle, path_dir) = fake_gpu_bundle(&dir, 60);
    let (summary, log) = run_gpu_check(&dir, &bundle, &path_dir, &["--budget", "8"]);
    assert_eq!(
        step(&summary, "plugin-check").map(|(s, _)| s),
        Some("pass"),
        "{log}"
    );
    let (status, detail) = step(&summary, "ops-gpu").expect("ops-gpu recorded");
    assert_eq!(status, "skip", "{log}");
    assert!(
        detail.starts_with("stopped at the --budget of 8 s"),
        "{detail}"
    );
    for name in [
        "encode.qwen2_vl.f32.cpu",
        "bench",
        "profile.dry",
        "serving.qwen3-vl-8b",
    ] {
        let (status, detail) = step(&summary, name).unwrap_or_else(|| panic!("{name}\n{log}"));
        assert_eq!(status, "skip", "{name}");
        assert_eq!(detail, "not run: the --budget of 8 s was spent", "{name}");
    }
    let _ = std::fs::remove_dir_all(&dir);
}
