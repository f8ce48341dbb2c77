//! `iris simulate` end to end: a small workload file, the summary, `--steps-out` and `--json`,
//! and errors that name the line and field.

use std::path::PathBuf;
use std::process::{Command, Output};

const WORKLOAD: &str = r#"{"id": "r1", "arrival_step": 0, "prompt_len": 800, "items": [{"hash": "a", "offset": 100, "length": 600}]}
{"id": "r2", "arrival_step": 0, "prompt_len": 700, "items": [{"hash": "a", "offset": 0, "length": 600}]}

{"id": "r3", "arrival_step": 1, "prompt_len": 900, "items": [{"hash": "b", "offset": 0, "length": 500, "embeds": 400}, {"hash": "c", "offset": 600, "length": 300}]}
"#;

fn dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("iris-simulate-{}-{name}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn iris(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_iris"))
        .args(args)
        .output()
        .unwrap()
}

#[test]
fn summary_steps_out_and_json() {
    let d = dir("ok");
    let workload = d.join("w.jsonl");
    std::fs::write(&workload, WORKLOAD).unwrap();
    let steps = d.join("steps.jsonl");
    let out = iris(&[
        "simulate",
        "--workload",
        workload.to_str().unwrap(),
        "--max-num-batched-tokens",
        "1000",
        "--encoder-cache-size",
        "700",
        "--steps-out",
        steps.to_str().unwrap(),
    ]);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{stdout}{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("encoder tokens computed  1300"), "{stdout}");
    assert!(stdout.contains("encoder cache hits       1"), "{stdout}");
    assert!(stdout.contains("r3"), "{stdout}");

    // Step 0: r1 800 (encodes a), r2 200 (hit on a). Step 1: r2 500; r3 waits, since b's 400
    // embeddings do not fit beside a, which r2 still holds. Step 2: r3 900 (a evicted, b and c
    // encoded).
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&steps)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines[0]["step"], 0);
    assert_eq!(
        lines[0]["scheduled"],
        serde_json::json!([["r1", 800], ["r2", 200]])
    );
    assert_eq!(lines[0]["finished"], serde_json::json!(["r1"]));
    assert_eq!(lines[0]["running"], serde_json::json!(["r2"]));
    assert_eq!(lines[0]["encoder_inputs"]["r1"], serde_json::json!([0]));
    assert_eq!(lines[0]["free_slots"], 100);
    assert_eq!(lines[0]["freeable_slots"], 100);
    for l in &lines {
        for key in [
            "step",
            "scheduled",
            "encoder_inputs",
            "preempted",
            "finished",
            "freed",
            "free_slots",
            "freeable_slots",
            "running",
            "waiting",
        ] {
            assert!(l.get(key).is_some(), "{key} missing in {l}");
        }
    }
    let total: u64 = lines
        .iter()
        .flat_map(|l| l["scheduled"].as_array().unwrap())
        .map(|pair| pair[1].as_u64().unwrap())
        .sum();
    assert_eq!(total, 800 + 700 + 900);

    let out = iris(&[
        "simulate",
        "--workload",
        workload.to_str().unwrap(),
        "--max-num-batched-tokens",
        "1000",
        "--encoder-cache-size",
        "700",
        "--json",
    ]);
    assert!(out.status.success());
    let summary: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(summary["encoder_tokens_computed"], 1300);
    assert_eq!(summary["policy"], "vllm");
    assert_eq!(summary["hits"], 1);
    assert_eq!(summary["encoder_cache_size"], 700);
    assert_eq!(summary["steps"], lines.len() as u64);
    assert_eq!(summary["requests"][0]["id"], "r1");
    assert_eq!(summary["requests"][0]["finish_step"], 0);
    assert_eq!(summary["requests"][1]["finish_step"], 1);
    assert_eq!(summary["requests"][2]["finish_step"], 2);
    assert_eq!(summary["evictions"], 1);
    assert_eq!(lines[2]["freed"], serde_json::json!(["a"]));
    assert_eq!(lines[2]["encoder_inputs"]["r3"], serde_json::json!([0, 1]));
    assert!(summary["peak_cache_use"].as_u64().unwrap() <= 700);
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn bad_line_names_line_and_field() {
    let d = dir("bad");
    let workload = d.join("w.jsonl");
    std::fs::write(
        &workload,
        "{\"id\": \"r1\", \"prompt_len\": 10}\n{\"id\": \"r2\", \"prompt_len\": 10, \"items\": [{\"hash\": \"a\", \"offset\": 0, \"length\": -3}]}\n",
    )
    .unwrap();
    let out = iris(&["simulate", "--workload", workload.to_str().unwrap()]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("line 2") && stderr.contains("items[0].length"),
        "{stderr}"
    );
    std::fs::remove_dir_all(&d).ok();
}

#[test]
fn non_chunked_item_larger_than_a_step_names_the_flags() {
    let d = dir("nonchunked");
    let workload = d.join("w.jsonl");
    std::fs::write(
        &workload,
        "{\"id\": \"big\", \"prompt_len\": 3000, \"items\": [{\"hash\": \"a\", \"offset\": 0, \"length\": 2000}]}\n",
    )
    .unwrap();
    let out = iris(&[
        "simulate",
        "--workload",
        workload.to_str().unwrap(),
        "--max-num-batched-tokens",
        "1000",
        "--disable-chunked-mm-input",
    ]);
    assert!(!out.status.success());
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("line 1") && stderr.contains("2000") && stderr.contains("1000"),
        "{stderr}"
    );
    assert!(stderr.contains("--max-num-batched-tokens"), "{stderr}");
    std::fs::remove_dir_all(&d).ok();
}

/// The requests of a committed vLLM trace, as a workload file's text.
fn trace_workload(name: &str) -> String {
    let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("../core/tests/fixtures/vllm-traces")
        .join(name);
    std::fs::read_to_string(&path)
        .unwrap()
        .lines()
        .filter_map(|l| serde_json::from_str::<serde_json::Value>(l).ok())
        .filter_map(|v| v.get("request").map(ToString::to_string))
        .collect::<Vec<_>>()
        .join("\n")
}

#[test]
fn policy_from_flag_or_config_file_and_kv_preemption() {
    let d = dir("policy");
    let workload = d.join("w.jsonl");
    std::fs::write(&workload, trace_workload("preemption-tiny-kv.jsonl")).unwrap();
    let w = workload.to_str().unwrap();
    // The trace's configuration: vLLM preempted three times.
    let kv = [
        "--max-num-batched-tokens",
        "1024",
        "--max-num-seqs",
        "8",
        "--encoder-cache-size",
        "440",
        "--num-kv-blocks",
        "285",
    ];
    let run = |extra: &[&str]| {
        let mut args = vec!["simulate", "--workload", w];
        args.extend_from_slice(&kv);
        args.extend_from_slice(extra);
        let out = iris(&args);
        let text = format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
        (out.status.success(), text)
    };
    let (ok, text) = run(&[]);
    assert!(ok, "{text}");
    assert!(text.contains("scheduler policy         vllm"), "{text}");
    assert!(text.contains("preemptions              3"), "{text}");

    let (ok, text) = run(&["--scheduler-policy", "progress"]);
    assert!(ok, "{text}");
    assert!(text.contains("scheduler policy         progress"), "{text}");

    let config = d.join("iris.toml");
    std::fs::write(&config, "[scheduler]\npolicy = \"progress\"\n").unwrap();
    let (ok, text) = run(&["--config", config.to_str().unwrap()]);
    assert!(ok, "{text}");
    assert!(text.contains("scheduler policy         progress"), "{text}");
    // The flag wins over the file.
    let (ok, text) = run(&[
        "--config",
        config.to_str().unwrap(),
        "--scheduler-policy",
        "vllm",
    ]);
    assert!(ok, "{text}");
    assert!(text.contains("scheduler policy         vllm"), "{text}");

    let (ok, text) = run(&["--scheduler-policy", "fifo"]);
    assert!(!ok);
    assert!(text.contains("vllm, progress"), "{text}");
    std::fs::write(&config, "[scheduler]\npolicy = \"fifo\"\n").unwrap();
    let (ok, text) = run(&["--config", config.to_str().unwrap()]);
    assert!(!ok);
    assert!(
        text.contains("scheduler") && text.contains("policy") && text.contains("`progress`"),
        "{text}"
    );

    // A prompt longer than the KV cache is refused with the numbers.
    let (ok, text) = run(&["--num-kv-blocks", "3"]);
    assert!(!ok);
    assert!(text.contains("--num-kv-blocks"), "{text}");
    std::fs::remove_dir_all(&d).ok();
}
