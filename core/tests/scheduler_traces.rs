//! Replays the committed vLLM traces (`core/tests/fixtures/vllm-traces/*.jsonl`, written by
//! `tools/vllm-traces/vllm_traces.py` from vLLM 0.33.0's own scheduler) through iris's
//! scheduler and compares every step exactly.
//!
//! - The `vllm` policy must agree on every step of every trace, stalls included.
//! - The `progress` policy is replayed against the same traces; where it departs is listed in
//!   [`PROGRESS_DEPARTURES`] with the reason, and any other departure (or a listed one that no
//!   longer happens) fails.
//!
//! A mismatch names the trace and prints the first differing step, both sides' decisions and the
//! state before it.

use std::path::{Path, PathBuf};

use iris_core::budget::{BudgetPolicy, Policy, SchedulerConfig};
use iris_core::simulate::{
    SimulateError, SizeOnlyOutputs, StepRecord, build_scheduler, parse_workload, simulate_with,
};
use serde_json::Value;

/// Traces where the `progress` policy departs from vLLM, with why (the first departing step).
/// Every other trace it must replay exactly. The three rules at work:
///
/// - claim: a request refused encoder-cache space reserves it for the rest of the step, so a
///   later request that vLLM lets allocate is refused;
/// - split: with chunked multimodal input disabled, an item whose output is already cached or
///   picked this step does not stop the window, since no encoder run is split (vLLM applies the
///   unchunked rule first and cuts the window at the item);
/// - head: a waiting request that cannot move blocks those behind it (vLLM sets it aside).
const PROGRESS_DEPARTURES: &[(&str, &str)] = &[
    (
        "32-seqs",
        "claim: r10 is refused space for its next image at step 10, so r11 may not encode img111-1",
    ),
    (
        "aborts-unchunked",
        "split: r8's next img127-1 is cached, so step 17 covers part of it",
    ),
    (
        "budget-256-chunked",
        "claim: r5 is refused space for img105-2 at step 27, so r6 may not encode img105-4",
    ),
    (
        "budget-256-unchunked",
        "split: r3's img106-1 is cached, so step 13 covers part of it and r4, r5 get no budget",
    ),
    (
        "budget-8192-chunked",
        "claim: r4 is refused space for img107-7 at step 5, so r5 may not encode its images",
    ),
    (
        "budget-8192-unchunked",
        "claim: r2 is refused space for img108-0 at step 2, so r4 may not encode img108-8",
    ),
    (
        "cache-one-image-1024",
        "split: r2 repeats img115-3, picked this step, so step 0 covers part of the repeat",
    ),
    (
        "cache-smaller-than-an-image",
        "claim: r3 is refused space at step 4, so r6 may not encode its images",
    ),
    (
        "cache-smaller-unchunked",
        "split: r1's img113-1 is cached (r0 holds it), so step 1 covers part of it",
    ),
    (
        "long-prompts",
        "split: r4 repeats img120-2, picked this step, so step 6 covers part of the repeat",
    ),
    (
        "mixed-geometry-unchunked",
        "split: r3's repeated img131-7 is cached, so step 9 covers part of it",
    ),
    (
        "one-seq",
        "split: r8 repeats img109-2, picked this step, so step 14 covers part of the repeat",
    ),
    (
        "preemption-long",
        "claim: r7 is refused space for img205-2 at step 12, so r8 and r11 may not encode theirs",
    ),
    (
        "preemption-small-budget",
        "split: r1's img200-0 is cached (r0 holds it), so step 2 covers part of it",
    ),
    (
        "preemption-tiny-kv-unchunked",
        "split: r2 repeats img221-6, picked this step, so step 3 covers part of the repeat",
    ),
    (
        "qwen3-vl-geometry",
        "claim: r2 is refused space for img129-2 at step 3, so r3 may not encode img129-5",
    ),
    (
        "repeated-unchunked",
        "split: r1's img119-1 is cached (r0 holds it), so step 1 covers part of it",
    ),
    (
        "shared-images",
        "split: r2's repeated img117-0 is still cached, so step 5 covers part of it",
    ),
    (
        "two-seqs-unchunked",
        "split: r1's img110-7 is picked by r0 this step, so step 1 covers part of it",
    ),
    (
        "unchunked-4096-many-steps",
        "split: r13's img103-0 is picked by r11 this step, so step 12 covers part of it",
    ),
    (
        "vllm-starves-a-large-image",
        "head: big cannot get the cache at step 1 and s1 waits behind it (vLLM admits s1 and starves big)",
    ),
];

/// One committed trace.
struct Trace {
    path: PathBuf,
    config: SchedulerConfig,
    compute_budget: u64,
    cache_size: u64,
    workload_text: String,
    steps: Vec<Value>,
    stalled: bool,
}

fn traces_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/vllm-traces")
}

fn load(path: &Path) -> Trace {
    let text = std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", path.display()));
    let mut header = None;
    let mut requests = Vec::new();
    let mut steps = Vec::new();
    let mut end = None;
    for (n, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let value: Value = serde_json::from_str(line)
            .unwrap_or_else(|e| panic!("{} line {}: {e}", path.display(), n + 1));
        let (kind, body) = value
            .as_object()
            .and_then(|o| o.iter().next())
            .unwrap_or_else(|| panic!("{} line {}: not a tagged line", path.display(), n + 1));
        match kind.as_str() {
            "trace" => header = Some(body.clone()),
            "request" => requests.push(body.to_string()),
            "step" => steps.push(body.clone()),
            "end" => end = Some(body.clone()),
            other => panic!(
                "{} line {}: unknown line kind {other:?}",
                path.display(),
                n + 1
            ),
        }
    }
    let header = header.unwrap_or_else(|| panic!("{}: no trace header", path.display()));
    assert_eq!(
        header["vllm_version"],
        "0.33.0",
        "{}: recorded against another vLLM",
        path.display()
    );
    let c = &header["config"];
    let u = |key: &str| c[key].as_u64();
    let config = SchedulerConfig {
        max_num_batched_tokens: u("max_num_batched_tokens").expect("max_num_batched_tokens"),
        max_num_seqs: u("max_num_seqs").expect("max_num_seqs"),
        encoder_cache_size: u("encoder_cache_size"),
        disable_chunked_mm_input: c["disable_chunked_mm_input"].as_bool().unwrap_or(false),
        kv_block_size: u("kv_block_size").expect("kv_block_size"),
        num_kv_blocks: u("num_kv_blocks"),
        ..SchedulerConfig::default()
    };
    let end = end.unwrap_or_else(|| panic!("{}: no end line", path.display()));
    Trace {
        path: path.to_path_buf(),
        config,
        compute_budget: header["encoder_compute_budget"].as_u64().expect("budget"),
        cache_size: header["encoder_cache_size"].as_u64().expect("cache size"),
        workload_text: requests.join("\n"),
        steps,
        stalled: end["stalled"].as_bool().expect("end.stalled"),
    }
}

/// Embeddings of the trace's largest item.
fn largest_item(trace: &Trace) -> u64 {
    parse_workload(&trace.workload_text)
        .unwrap_or_else(|e| panic!("{}: {e}", trace.path.display()))
        .iter()
        .flat_map(|r| &r.items)
        .map(|i| i.embeds.unwrap_or(i.length))
        .max()
        .unwrap_or(0)
}

fn all_traces() -> Vec<Trace> {
    let mut paths: Vec<PathBuf> = std::fs::read_dir(traces_dir())
        .expect("the trace folder")
        .map(|e| e.expect("a folder entry").path())
        .filter(|p| p.extension().is_some_and(|e| e == "jsonl"))
        .collect();
    paths.sort();
    paths.iter().map(|p| load(p)).collect()
}

/// Runs `trace`'s workload under `policy`: iris's step records and whether it stalled.
fn replay(trace: &Trace, policy: Policy) -> (Vec<Value>, bool) {
    let workload = parse_workload(&trace.workload_text)
        .unwrap_or_else(|e| panic!("{}: {e}", trace.path.display()));
    let config = SchedulerConfig {
        policy,
        ..trace.config.clone()
    };
    let mut scheduler = build_scheduler(&workload, &config, None)
        .unwrap_or_else(|e| panic!("{}: {e}", trace.path.display()));
    assert_eq!(
        (
            scheduler.budget().compute_budget(),
            scheduler.budget().cache_size()
        ),
        (trace.compute_budget, trace.cache_size),
        "{}: the encoder budget differs from vLLM's",
        trace.path.display()
    );
    let mut records: Vec<StepRecord> = Vec::new();
    let result = simulate_with(
        &mut scheduler,
        &workload,
        &mut SizeOnlyOutputs::default(),
        |r| {
            records.push(r.clone());
            Ok(())
        },
    );
    let stalled = match result {
        Ok(_) => false,
        Err(SimulateError::Stalled { .. }) => true,
        Err(e) => panic!("{} ({policy}): {e}", trace.path.display()),
    };
    let values = records
        .iter()
        .map(|r| serde_json::to_value(r).expect("a step record serialises"))
        .collect();
    (values, stalled)
}

/// The first difference between vLLM's steps and iris's, described for a person.
fn first_difference(trace: &Trace, iris: &[Value], iris_stalled: bool) -> Option<String> {
    let mut before = String::from("none (the first step)");
    for (v, i) in trace.steps.iter().zip(iris) {
        if v != i {
            return Some(format!(
                "step {} differs\n  state before: {before}\n  vllm: {v}\n  iris: {i}",
                v["step"]
            ));
        }
        before = format!(
            "running {} waiting {} free_slots {} freeable_slots {} free_kv_blocks {}",
            v["running"], v["waiting"], v["free_slots"], v["freeable_slots"], v["free_kv_blocks"]
        );
    }
    if trace.steps.len() != iris.len() {
        return Some(format!(
            "vLLM ran {} steps, iris {}; last state: {before}",
            trace.steps.len(),
            iris.len()
        ));
    }
    (trace.stalled != iris_stalled).then(|| {
        format!(
            "vLLM stalled: {}, iris stalled: {iris_stalled}",
            trace.stalled
        )
    })
}

#[test]
fn corpus_is_large_and_covers_what_it_must() {
    let traces = all_traces();
    assert!(traces.len() >= 30, "only {} traces", traces.len());
    let any = |f: &dyn Fn(&Trace) -> bool| traces.iter().any(f);
    let steps = |t: &Trace, f: &dyn Fn(&Value) -> bool| t.steps.iter().any(f);
    assert!(any(&|t| t.config.disable_chunked_mm_input));
    assert!(any(&|t| !t.config.disable_chunked_mm_input));
    assert!(any(&|t| t.config.max_num_batched_tokens == 256));
    assert!(any(&|t| t.config.max_num_batched_tokens == 8192));
    assert!(any(&|t| t.config.max_num_seqs == 1));
    assert!(any(&|t| t.config.max_num_seqs == 32));
    assert!(any(&|t| t
        .config
        .encoder_cache_size
        .is_some_and(|c| c < t.cache_size)));
    assert!(any(&|t| t.config.encoder_cache_size == Some(t.cache_size)));
    assert!(
        any(&|t| t.cache_size >= 2 * largest_item(t)),
        "no large cache"
    );
    assert!(any(&|t| steps(t, &|s| !s["preempted"]
        .as_array()
        .is_none_or(Vec::is_empty))));
    assert!(any(&|t| t.workload_text.contains("abort_step")));
    assert!(any(&|t| t.workload_text.contains("embed_runs")));
}

/// The trace that documents why the progress policy exists: vLLM sets aside a request whose
/// image fills the cache while a stream of smaller images keeps part of it held, and serves it
/// only when the stream ends; the progress policy reserves the space it was refused.
#[test]
fn progress_serves_the_image_vllm_starves() {
    let trace = load(&traces_dir().join("vllm-starves-a-large-image.jsonl"));
    let encoded_at = |steps: &[Value]| {
        steps
            .iter()
            .find(|s| s["encoder_inputs"].get("big").is_some())
            .and_then(|s| s["step"].as_u64())
            .expect("big is encoded")
    };
    let vllm = encoded_at(&trace.steps);
    let (iris, _) = replay(&trace, Policy::Progress);
    let progress = encoded_at(&iris);
    assert!(
        vllm >= 40 && progress <= 2,
        "big arrives at step 1; encoded at step {vllm} by vLLM, {progress} by progress"
    );
}

#[test]
fn vllm_policy_agrees_with_vllm_on_every_step_of_every_trace() {
    let mut failures = Vec::new();
    let traces = all_traces();
    for trace in &traces {
        let (iris, stalled) = replay(trace, Policy::Vllm);
        if let Some(diff) = first_difference(trace, &iris, stalled) {
            failures.push(format!("{}: {diff}", trace.path.display()));
        }
    }
    assert!(
        failures.is_empty(),
        "{} of {} traces disagree with vLLM 0.33.0:\n{}",
        failures.len(),
        traces.len(),
        failures.join("\n")
    );
}

#[test]
fn progress_policy_departs_only_where_listed_and_never_stalls() {
    let mut unexpected = Vec::new();
    for trace in all_traces() {
        let name = trace
            .path
            .file_stem()
            .and_then(|s| s.to_str())
            .unwrap_or_default()
            .to_owned();
        let (iris, stalled) = replay(&trace, Policy::Progress);
        assert!(
            !stalled,
            "{name}: the progress policy stalled at step {}",
            iris.last().map_or(Value::Null, |s| s["step"].clone())
        );
        let listed = PROGRESS_DEPARTURES.iter().find(|(n, _)| *n == name);
        match (first_difference(&trace, &iris, stalled), listed) {
            (Some(diff), Some((_, why))) => {
                println!("{name}: progress departs as expected ({why}): {diff}");
            }
            (Some(diff), None) => unexpected.push(format!("{name}: unlisted departure: {diff}")),
            (None, Some(_)) => unexpected.push(format!(
                "{name}: listed as a departure but the progress policy now agrees with vLLM"
            )),
            (None, None) => {}
        }
    }
    assert!(unexpected.is_empty(), "{}", unexpected.join("\n"));
}

/// The comparison is not vacuous: one altered decision is reported at its step, with both sides.
#[test]
fn a_changed_decision_is_reported_at_its_step() {
    let mut trace = load(&traces_dir().join("preemption-tiny-kv.jsonl"));
    let (iris, stalled) = replay(&trace, Policy::Vllm);
    assert_eq!(first_difference(&trace, &iris, stalled), None);
    let k = trace.steps.len() / 2;
    trace.steps[k]["scheduled"][0][1] = Value::from(1u64 << 40);
    let diff = first_difference(&trace, &iris, stalled).expect("a difference");
    assert!(
        diff.starts_with(&format!("step {} differs", trace.steps[k]["step"])),
        "{diff}"
    );
    assert!(
        diff.contains("state before: running") && diff.contains("1099511627776"),
        "{diff}"
    );
    trace.steps.truncate(k);
    assert!(first_difference(&trace, &iris, stalled).is_some());
}
