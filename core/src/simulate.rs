//! Capacity planning: a recorded or synthetic workload run through the real scheduler, budget and
//! encoder cache manager, with sizes only (no encoder runs, no device memory).
//!
//! A workload is JSON Lines, one request per line:
//!
//! ```text
//! {"id": "r1", "arrival_step": 0, "prompt_len": 800, "items": [{"hash": "a", "offset": 100, "length": 600}]}
//! ```
//!
//! `arrival_step` (default 0) is the step at which the request arrives; `abort_step` (optional,
//! not before the arrival) aborts it at the start of that step if it has not finished; `items`
//! (default none) are in position order; an item's optional `embeds` gives how many of its
//! `length` positions are embeddings (its encoder-cache size), when not all are: the first
//! `embeds` positions, or those in its optional `embed_runs` (`[start, end)` pairs relative to
//! the item's offset). Items with the same hash must have the same embeddings count. Blank lines
//! are skipped. A bad line is an error naming the line and the field ([`parse_workload`]).
//!
//! [`simulate`] then steps the scheduler: requests are added at their arrival step, aborts are
//! applied, every scheduled token counts as consumed at the end of its step, and a request
//! finishes when its whole prompt is consumed. A step that schedules nothing jumps to the next
//! arrival or abort; with none left, the simulation ends with [`SimulateError::Stalled`] (the
//! `vllm` policy can stall, the `progress` policy cannot). Encoder outputs go to an [`EncoderOutputStore`]: [`SizeOnlyOutputs`]
//! records sizes only (what `iris simulate` uses); a device encoder cache can be plugged in the
//! same way, and after every step the store must hold exactly the manager's entries.
//!
//! ```
//! use iris_core::budget::SchedulerConfig;
//! use iris_core::simulate::{parse_workload, simulate, SizeOnlyOutputs};
//!
//! let workload = parse_workload(
//!     r#"{"id": "r1", "prompt_len": 800, "items": [{"hash": "a", "offset": 100, "length": 600}]}
//! {"id": "r2", "arrival_step": 1, "prompt_len": 700, "items": [{"hash": "a", "offset": 0, "length": 600}]}"#,
//! )
//! .unwrap();
//! let summary = simulate(&workload, &SchedulerConfig::default(), None, &mut SizeOnlyOutputs::default(), |_| Ok(()))
//!     .unwrap();
//! assert_eq!(summary.encoder_tokens_computed, 600); // r2 reuses r1's image
//! assert_eq!(summary.hits, 1);
//! assert_eq!(summary.requests[1].finish_step, 1);
//! ```

use std::collections::{BTreeMap, HashMap, HashSet};
use std::sync::Arc;

use iris_plugin::DType;

use serde::Serialize;
use serde_json::Value;
use thiserror::Error;

use crate::budget::{
    BudgetError, BudgetPolicy, EncoderBudget, Modality, ModalityLimits, SchedulerConfig,
};
use crate::budget::{Policy, tokens_to_bytes};
use crate::cache::device::{DeviceEncoderCache, Entry};
use crate::cache::encoder::{EncoderCacheManagement, EncoderCacheManager, MmHash, RequestId};
use crate::memory::CachingAllocator;
use crate::scheduler::{
    EncoderInput, MmItem, NewRequest, Scheduler, SchedulerError, SchedulerPolicy, StepOutput,
};

/// One item of a workload request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkloadItem {
    /// Content hash: equal hashes share an encoder-cache entry.
    pub hash: String,
    /// First placeholder position.
    pub offset: u64,
    /// Placeholder positions.
    pub length: u64,
    /// Positions that are embeddings, when not all are.
    pub embeds: Option<u64>,
    /// Where the embeddings are: `[start, end)` runs relative to `offset`; `None`: the first
    /// `embeds` positions.
    pub embed_runs: Option<Vec<(u64, u64)>>,
}

/// One workload request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct WorkloadRequest {
    /// The request's name in reports.
    pub id: String,
    /// The step at which it arrives.
    pub arrival_step: u64,
    /// Prompt tokens, placeholders included.
    pub prompt_len: u64,
    /// Items in position order.
    pub items: Vec<WorkloadItem>,
    /// The step at whose start it is aborted, if it has not finished by then.
    pub abort_step: Option<u64>,
    /// The workload line it came from (1-based; 0 when built in code).
    #[serde(skip)]
    pub line: usize,
}

/// Simulation errors.
#[derive(Debug, Clone, Error, PartialEq, Eq)]
#[non_exhaustive]
pub enum SimulateError {
    /// A workload line is malformed.
    #[error("workload line {line}, field `{field}`: {reason}")]
    Parse {
        /// 1-based line number.
        line: usize,
        /// The field (`items[0].length`), or `(line)` for the line as a whole.
        field: String,
        /// What is wrong.
        reason: String,
    },
    /// Two requests have the same id.
    #[error(
        "workload line {line}, field `id`: request id {id:?} was already used on line {first_line}"
    )]
    DuplicateId {
        /// 1-based line number.
        line: usize,
        /// The id.
        id: String,
        /// Where it was first used.
        first_line: usize,
    },
    /// The scheduler refused a request.
    #[error("workload line {line} (request {id:?}): {source}")]
    Request {
        /// 1-based line number.
        line: usize,
        /// The request id.
        id: String,
        /// Why.
        #[source]
        source: SchedulerError,
    },
    /// The budget could not be derived.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// The scheduler failed.
    #[error(transparent)]
    Scheduler(#[from] SchedulerError),
    /// A step scheduled nothing although requests were unfinished, and no arrival or abort is
    /// left to change that.
    #[error(
        "step {step} scheduled no token while {waiting} requests wait and {running} run, and nothing is left to arrive: the {policy} scheduler policy stalled{hint}",
        hint = if *policy == Policy::Vllm { " (vLLM stalls here too; --scheduler-policy progress guarantees progress)" } else { "" }
    )]
    Stalled {
        /// The policy that ran.
        policy: Policy,
        /// The step.
        step: u64,
        /// Waiting requests.
        waiting: usize,
        /// Running requests.
        running: usize,
    },
    /// The encoder output store failed or disagrees with the manager.
    #[error("step {step}: encoder output store: {message}")]
    Outputs {
        /// The step.
        step: u64,
        /// What happened.
        message: String,
    },
    /// A step callback failed (writing `--steps-out`).
    #[error("step {step}: {message}")]
    Callback {
        /// The step.
        step: u64,
        /// What happened.
        message: String,
    },
}

/// Where encoder outputs go: sizes only, or a device encoder cache.
pub trait EncoderOutputStore {
    /// Frees the outputs of hashes the manager evicted (start of a step).
    fn free_hashes(&mut self, hashes: &[MmHash]) -> Result<(), String>;
    /// Stores the output of one encoder input run this step.
    fn store(&mut self, input: &EncoderInput) -> Result<(), String>;
    /// Drops every output (with the manager's reset).
    fn reset(&mut self) -> Result<(), String>;
    /// Whether the output of `hash` is held.
    fn contains(&self, hash: &str) -> bool;
    /// Outputs held.
    fn len(&self) -> usize;
    /// Whether no output is held.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
}

/// An [`EncoderOutputStore`] that keeps sizes only.
#[derive(Debug, Default, Clone)]
pub struct SizeOnlyOutputs {
    outputs: HashMap<MmHash, u64>,
}

impl SizeOnlyOutputs {
    /// Embedding tokens held in all.
    pub fn tokens(&self) -> u64 {
        self.outputs.values().sum()
    }
}

impl EncoderOutputStore for SizeOnlyOutputs {
    fn free_hashes(&mut self, hashes: &[MmHash]) -> Result<(), String> {
        for h in hashes {
            if self.outputs.remove(h).is_none() {
                return Err(format!("asked to free {h}, which it does not hold"));
            }
        }
        Ok(())
    }

    fn store(&mut self, input: &EncoderInput) -> Result<(), String> {
        self.outputs.insert(input.hash.clone(), input.embeds);
        Ok(())
    }

    fn reset(&mut self) -> Result<(), String> {
        self.outputs.clear();
        Ok(())
    }

    fn contains(&self, hash: &str) -> bool {
        self.outputs.contains_key(hash)
    }

    fn len(&self) -> usize {
        self.outputs.len()
    }
}

/// An [`EncoderOutputStore`] backed by a device encoder cache: each encoder output is a buffer of
/// `embeds x hidden x dtype` bytes from the caching allocator (left unwritten: a simulation runs
/// no encoder), so a simulation exercises the device memory lifecycle the engine has.
#[derive(Debug)]
pub struct DeviceCacheOutputs {
    cache: DeviceEncoderCache,
    allocator: Arc<CachingAllocator>,
    hidden: u64,
    dtype: DType,
}

impl DeviceCacheOutputs {
    /// An empty store allocating from `allocator`, with embeddings `hidden` wide of `dtype`.
    pub fn new(allocator: Arc<CachingAllocator>, hidden: u64, dtype: DType) -> Self {
        DeviceCacheOutputs {
            cache: DeviceEncoderCache::new(),
            allocator,
            hidden,
            dtype,
        }
    }

    /// The device encoder cache.
    pub fn cache(&self) -> &DeviceEncoderCache {
        &self.cache
    }

    /// The allocator the buffers come from.
    pub fn allocator(&self) -> &Arc<CachingAllocator> {
        &self.allocator
    }
}

impl EncoderOutputStore for DeviceCacheOutputs {
    fn free_hashes(&mut self, hashes: &[MmHash]) -> Result<(), String> {
        let unknown = self.cache.unknown_frees();
        let hashes: Vec<&str> = hashes.iter().map(|h| &**h).collect();
        self.cache.free_hashes(&hashes);
        if self.cache.unknown_frees() != unknown {
            return Err(format!(
                "asked to free {} hashes it does not hold (of {hashes:?})",
                self.cache.unknown_frees() - unknown
            ));
        }
        Ok(())
    }

    fn store(&mut self, input: &EncoderInput) -> Result<(), String> {
        let dtype_bytes = self
            .dtype
            .size()
            .ok_or_else(|| format!("dtype {:?} has no element size", self.dtype))?;
        let bytes =
            tokens_to_bytes(input.embeds, self.hidden, dtype_bytes).map_err(|e| e.to_string())?;
        let buffer = self.allocator.alloc(bytes).map_err(|e| e.to_string())?;
        self.cache.insert(
            input.hash.to_string(),
            Entry::new(buffer, input.embeds, self.hidden, self.dtype),
        );
        Ok(())
    }

    fn reset(&mut self) -> Result<(), String> {
        self.cache.reset();
        Ok(())
    }

    fn contains(&self, hash: &str) -> bool {
        self.cache.contains(hash)
    }

    fn len(&self) -> usize {
        self.cache.len()
    }
}

/// One step as `--steps-out` writes it, and as the vLLM traces record it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct StepRecord {
    /// The step.
    pub step: u64,
    /// `(request id, tokens)` in placement order.
    pub scheduled: Vec<(String, u64)>,
    /// Item indices whose encoder runs, per request id.
    pub encoder_inputs: BTreeMap<String, Vec<usize>>,
    /// Requests preempted (KV blocks ran out), in preemption order.
    pub preempted: Vec<String>,
    /// Requests whose prompts this step finished, in placement order.
    pub finished: Vec<String>,
    /// Hashes the device cache frees, in eviction order.
    pub freed: Vec<String>,
    /// Encoder-cache free slots after scheduling.
    pub free_slots: u64,
    /// Encoder-cache freeable slots after scheduling.
    pub freeable_slots: u64,
    /// Free KV blocks after scheduling, when KV blocks are limited.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub free_kv_blocks: Option<u64>,
    /// Running requests after the step, in the order the next step serves them.
    pub running: Vec<String>,
    /// Waiting requests after the step, head first.
    pub waiting: Vec<String>,
}

/// One request's outcome.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct RequestOutcome {
    /// The request id.
    pub id: String,
    /// Its arrival step.
    pub arrival_step: u64,
    /// The step in which its last prompt token was scheduled, or in which it was aborted.
    pub finish_step: u64,
    /// Whether it was aborted.
    pub aborted: bool,
}

/// What a simulation found.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct SimulationSummary {
    /// The scheduler policy that ran.
    pub policy: Policy,
    /// Steps run (the last finishing step + 1).
    pub steps: u64,
    /// Requests simulated.
    pub num_requests: usize,
    /// Prompt tokens scheduled in all.
    pub scheduled_tokens: u64,
    /// Embedding tokens the encoder computed.
    pub encoder_tokens_computed: u64,
    /// Encoder runs (items computed).
    pub encoder_runs: u64,
    /// Items served from the encoder cache.
    pub hits: u64,
    /// Entries evicted.
    pub evictions: u64,
    /// Preemptions (KV blocks ran out).
    pub preemptions: u64,
    /// Most encoder-cache slots occupied at once.
    pub peak_cache_use: u64,
    /// The encoder cache size used, in embedding tokens.
    pub encoder_cache_size: u64,
    /// The encoder compute budget per step.
    pub encoder_compute_budget: u64,
    /// `max_num_batched_tokens`.
    pub max_num_batched_tokens: u64,
    /// `max_num_seqs`.
    pub max_num_seqs: u64,
    /// Mean steps from arrival to finish (inclusive), aborted requests left out.
    pub mean_latency_steps: f64,
    /// Largest steps from arrival to finish (inclusive), aborted requests left out.
    pub max_latency_steps: u64,
    /// Per request, in workload order.
    pub requests: Vec<RequestOutcome>,
}

/// Parses a JSON Lines workload; errors name the line and the field.
pub fn parse_workload(text: &str) -> Result<Vec<WorkloadRequest>, SimulateError> {
    let mut out = Vec::new();
    let mut seen: HashMap<String, usize> = HashMap::new();
    let mut sizes: HashMap<String, (u64, usize)> = HashMap::new();
    for (n, raw) in text.lines().enumerate() {
        let line = n + 1;
        if raw.trim().is_empty() {
            continue;
        }
        let req = parse_line(raw, line)?;
        if let Some(&first_line) = seen.get(&req.id) {
            return Err(SimulateError::DuplicateId {
                line,
                id: req.id,
                first_line,
            });
        }
        seen.insert(req.id.clone(), line);
        for (k, item) in req.items.iter().enumerate() {
            let embeds = item.embeds.unwrap_or(item.length);
            match sizes.get(item.hash.as_str()) {
                Some(&(first, first_line)) if first != embeds => {
                    return Err(SimulateError::Parse {
                        line,
                        field: format!("items[{k}].embeds"),
                        reason: format!(
                            "hash {:?} has {embeds} embeddings here but {first} on line {first_line}; equal hashes must be the same item",
                            item.hash
                        ),
                    });
                }
                Some(_) => {}
                None => {
                    sizes.insert(item.hash.clone(), (embeds, line));
                }
            }
        }
        out.push(req);
    }
    Ok(out)
}

/// Runs `workload` through a scheduler built by [`build_scheduler`]. `on_step` sees each step.
pub fn simulate<S: EncoderOutputStore>(
    workload: &[WorkloadRequest],
    config: &SchedulerConfig,
    max_tokens_per_item: Option<u64>,
    outputs: &mut S,
    on_step: impl FnMut(&StepRecord) -> Result<(), String>,
) -> Result<SimulationSummary, SimulateError> {
    let mut scheduler = build_scheduler(workload, config, max_tokens_per_item)?;
    simulate_with(&mut scheduler, workload, outputs, on_step)
}

/// The scheduler a simulation uses: the default policy, with a budget whose per-item maximum
/// is `max_tokens_per_item` or else the workload's largest item (so the cache is at least that
/// large, as vLLM sizes it from the model's largest item).
pub fn build_scheduler(
    workload: &[WorkloadRequest],
    config: &SchedulerConfig,
    max_tokens_per_item: Option<u64>,
) -> Result<Scheduler, SimulateError> {
    let largest = workload
        .iter()
        .flat_map(|r| &r.items)
        .map(|i| i.embeds.unwrap_or(i.length))
        .max()
        .unwrap_or(0);
    // With chunked multimodal input disabled an item longer than a step is refused per request,
    // naming its workload line, rather than by the budget as a whole.
    let m = max_tokens_per_item.unwrap_or(if config.disable_chunked_mm_input {
        largest.min(config.max_num_batched_tokens)
    } else {
        largest
    });
    let budget = EncoderBudget::new(config, &[(Modality::Image, ModalityLimits::new(m))])?;
    let manager = EncoderCacheManager::new(budget.cache_size());
    Ok(Scheduler::new(config.clone(), budget, manager))
}

/// Runs `workload` through `scheduler` (which should have no requests yet), feeding encoder
/// outputs to `outputs` and checking after every step that `outputs` holds exactly the manager's
/// entries. Afterwards the scheduler and the store can be inspected (and reset).
pub fn simulate_with<S: EncoderOutputStore>(
    scheduler: &mut Scheduler,
    workload: &[WorkloadRequest],
    outputs: &mut S,
    mut on_step: impl FnMut(&StepRecord) -> Result<(), String>,
) -> Result<SimulationSummary, SimulateError> {
    let config = scheduler.config().clone();
    // Stable: requests arriving in the same step are added in workload order.
    let mut order: Vec<usize> = (0..workload.len()).collect();
    order.sort_by_key(|&i| workload[i].arrival_step);
    let mut names: HashMap<RequestId, usize> = HashMap::new();
    let mut ids: Vec<Option<RequestId>> = vec![None; workload.len()];
    let mut finish: Vec<Option<u64>> = vec![None; workload.len()];
    let mut aborted = vec![false; workload.len()];
    let mut aborts: Vec<(u64, usize)> = workload
        .iter()
        .enumerate()
        .filter_map(|(w, r)| r.abort_step.map(|a| (a, w)))
        .collect();
    aborts.sort_unstable();
    let mut next_abort = 0;
    let mut next = 0;
    let mut step = 0u64;
    let mut scheduled_tokens = 0u64;
    let mut preemptions = 0u64;
    let mut last_step = 0u64;

    while next < order.len() || scheduler.has_unfinished() {
        if !scheduler.has_unfinished() {
            step = step.max(workload[order[next]].arrival_step);
        }
        while next < order.len() && workload[order[next]].arrival_step <= step {
            let w = &workload[order[next]];
            let id =
                scheduler
                    .add_request(to_request(w))
                    .map_err(|source| SimulateError::Request {
                        line: w.line,
                        id: w.id.clone(),
                        source,
                    })?;
            names.insert(id, order[next]);
            ids[order[next]] = Some(id);
            next += 1;
        }
        // Aborts due by now, in step then workload order; a finished request ignores its abort.
        while let Some(&(_, w)) = aborts.get(next_abort).filter(|(a, _)| *a <= step) {
            next_abort += 1;
            if let (None, Some(id)) = (finish[w], ids[w]) {
                scheduler.abort(id);
                finish[w] = Some(step);
                aborted[w] = true;
            }
        }
        let out = scheduler.schedule()?;
        run_outputs(outputs, &out, step)?;
        check_outputs(scheduler.manager(), outputs, step)?;
        scheduled_tokens += out.total_tokens();
        preemptions += u64::try_from(out.preempted.len()).unwrap_or(u64::MAX);
        let finished = scheduler.update_from_output(&out);
        for id in &finished {
            if let Some(&w) = names.get(id) {
                finish[w] = Some(step);
            }
        }
        let record = step_record(&out, step, &finished, scheduler, &names, workload);
        on_step(&record).map_err(|message| SimulateError::Callback { step, message })?;
        last_step = step;
        if out.scheduled.is_empty() && out.preempted.is_empty() {
            // Nothing moved: the state changes only when a request arrives or is aborted.
            let arrival = order.get(next).map(|&i| workload[i].arrival_step);
            let abort = aborts[next_abort..]
                .iter()
                .find(|(_, w)| finish[*w].is_none())
                .map(|(a, _)| *a);
            match arrival.into_iter().chain(abort).min() {
                Some(event) => step = event.max(step + 1),
                None if scheduler.has_unfinished() => {
                    return Err(SimulateError::Stalled {
                        policy: config.policy,
                        step,
                        waiting: scheduler.num_waiting(),
                        running: scheduler.num_running(),
                    });
                }
                None => step += 1,
            }
        } else {
            step += 1;
        }
    }

    let stats = scheduler.manager().stats();
    let requests: Vec<RequestOutcome> = workload
        .iter()
        .zip(&finish)
        .zip(&aborted)
        .map(|((w, f), &aborted)| RequestOutcome {
            id: w.id.clone(),
            arrival_step: w.arrival_step,
            // Every request finishes before the loop ends; the loop runs until none is left.
            finish_step: f.unwrap_or(last_step),
            aborted,
        })
        .collect();
    let latencies: Vec<u64> = requests
        .iter()
        .filter(|r| !r.aborted)
        .map(|r| r.finish_step.saturating_sub(r.arrival_step) + 1)
        .collect();
    let total: u64 = latencies.iter().sum();
    #[allow(clippy::cast_precision_loss)] // a mean for display
    let mean_latency_steps = if latencies.is_empty() {
        0.0
    } else {
        total as f64 / latencies.len() as f64
    };
    Ok(SimulationSummary {
        policy: config.policy,
        steps: if workload.is_empty() {
            0
        } else {
            last_step + 1
        },
        num_requests: workload.len(),
        scheduled_tokens,
        encoder_tokens_computed: stats.allocated_tokens,
        encoder_runs: stats.allocations,
        hits: stats.hits,
        evictions: stats.evictions,
        preemptions,
        peak_cache_use: stats.peak_used,
        encoder_cache_size: scheduler.budget().cache_size(),
        encoder_compute_budget: scheduler.budget().compute_budget(),
        max_num_batched_tokens: config.max_num_batched_tokens,
        max_num_seqs: config.max_num_seqs,
        mean_latency_steps,
        max_latency_steps: latencies.iter().copied().max().unwrap_or(0),
        requests,
    })
}

/// Frees the step's evicted hashes, then stores its encoder outputs (the model runner's order).
pub fn run_outputs<S: EncoderOutputStore>(
    outputs: &mut S,
    out: &StepOutput,
    step: u64,
) -> Result<(), SimulateError> {
    outputs
        .free_hashes(&out.freed)
        .map_err(|message| SimulateError::Outputs { step, message })?;
    for input in &out.encoder_inputs {
        outputs
            .store(input)
            .map_err(|message| SimulateError::Outputs { step, message })?;
    }
    Ok(())
}

/// Checks that the store holds exactly the manager's entries.
pub fn check_outputs<S: EncoderOutputStore>(
    manager: &EncoderCacheManager,
    outputs: &S,
    step: u64,
) -> Result<(), SimulateError> {
    let entries = manager.stats().entries;
    if outputs.len() != entries {
        return Err(SimulateError::Outputs {
            step,
            message: format!(
                "holds {} outputs but the manager has {entries} entries",
                outputs.len()
            ),
        });
    }
    if let Some((h, _)) = manager.entries().find(|(h, _)| !outputs.contains(h)) {
        return Err(SimulateError::Outputs {
            step,
            message: format!("manager entry {h} has no output"),
        });
    }
    Ok(())
}

/// A deterministic synthetic workload in which image popularity follows a Zipf law: image `k`
/// (from 1) is drawn with probability proportional to `1 / k^zipf_exponent`. An image's size
/// depends only on its hash, so a repeated image is the same size everywhere.
#[derive(Debug, Clone, PartialEq)]
pub struct SyntheticWorkload {
    /// Requests to generate.
    pub requests: usize,
    /// Distinct images to draw from.
    pub distinct_images: usize,
    /// The Zipf exponent (1.0 is the classic law; 0 is uniform).
    pub zipf_exponent: f64,
    /// Images per request, drawn uniformly from 0 to this.
    pub max_images_per_request: usize,
    /// Embedding tokens per image, drawn uniformly from this inclusive range.
    pub image_tokens: (u64, u64),
    /// Text tokens before each image and at the end, drawn uniformly from this inclusive range.
    pub text_tokens: (u64, u64),
    /// Requests arriving per step.
    pub requests_per_step: usize,
    /// The seed.
    pub seed: u64,
}

impl SyntheticWorkload {
    /// Generates the workload.
    pub fn generate(&self) -> Vec<WorkloadRequest> {
        let mut cumulative = Vec::with_capacity(self.distinct_images);
        let mut total = 0.0f64;
        for k in 1..=self.distinct_images {
            #[allow(clippy::cast_precision_loss)] // image ranks are far below 2^52
            let rank = k as f64;
            total += rank.powf(-self.zipf_exponent);
            cumulative.push(total);
        }
        let mut rng = SplitMix64(self.seed);
        let per_step = self.requests_per_step.max(1);
        (0..self.requests)
            .map(|r| {
                let n_images =
                    rng.below(u64::try_from(self.max_images_per_request).unwrap_or(0) + 1);
                let mut items = Vec::new();
                let mut pos = 0u64;
                for _ in 0..n_images {
                    pos += rng.in_range(self.text_tokens);
                    let image = if cumulative.is_empty() {
                        0
                    } else {
                        let u = rng.unit() * total;
                        cumulative
                            .partition_point(|&c| c <= u)
                            .min(cumulative.len() - 1)
                    };
                    let length = SplitMix64(
                        self.seed
                            ^ (u64::try_from(image).unwrap_or(0) + 1)
                                .wrapping_mul(0x9E37_79B9_7F4A_7C15),
                    )
                    .in_range(self.image_tokens)
                    .max(1);
                    items.push(WorkloadItem {
                        hash: format!("img{image}"),
                        offset: pos,
                        length,
                        embeds: None,
                        embed_runs: None,
                    });
                    pos += length;
                }
                let prompt_len = (pos + rng.in_range(self.text_tokens)).max(1);
                WorkloadRequest {
                    id: format!("r{r}"),
                    arrival_step: u64::try_from(r / per_step).unwrap_or(u64::MAX),
                    prompt_len,
                    items,
                    abort_step: None,
                    line: 0,
                }
            })
            .collect()
    }
}

/// SplitMix64: a small, fast, well-distributed generator; enough for reproducible workloads.
#[derive(Debug, Clone)]
struct SplitMix64(u64);

impl SplitMix64 {
    fn next(&mut self) -> u64 {
        self.0 = self.0.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = self.0;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        z ^ (z >> 31)
    }

    /// Uniform in `0..n` (0 when n is 0); the modulo bias is negligible for small n.
    fn below(&mut self, n: u64) -> u64 {
        if n == 0 { 0 } else { self.next() % n }
    }

    fn in_range(&mut self, (lo, hi): (u64, u64)) -> u64 {
        if hi <= lo {
            lo
        } else {
            lo + self.below(hi - lo + 1)
        }
    }

    /// Uniform in [0, 1).
    fn unit(&mut self) -> f64 {
        #[allow(clippy::cast_precision_loss)] // 53 random bits, exactly representable
        let x = (self.next() >> 11) as f64;
        x / (1u64 << 53) as f64
    }
}

fn to_request(w: &WorkloadRequest) -> NewRequest {
    NewRequest::new(
        w.prompt_len,
        w.items
            .iter()
            .map(|i| {
                let hash = i.hash.as_str();
                match &i.embed_runs {
                    Some(runs) => MmItem::with_runs(hash, i.offset, i.length, runs.clone()),
                    None => {
                        MmItem::with_embeds(hash, i.offset, i.length, i.embeds.unwrap_or(i.length))
                    }
                }
            })
            .collect(),
    )
}

fn step_record(
    out: &StepOutput,
    step: u64,
    finished: &[RequestId],
    scheduler: &Scheduler,
    names: &HashMap<RequestId, usize>,
    workload: &[WorkloadRequest],
) -> StepRecord {
    let name = |id: &RequestId| {
        names
            .get(id)
            .map_or_else(|| id.0.to_string(), |&w| workload[w].id.clone())
    };
    let mut encoder_inputs: BTreeMap<String, Vec<usize>> = BTreeMap::new();
    for input in &out.encoder_inputs {
        encoder_inputs
            .entry(name(&input.request))
            .or_default()
            .push(input.index);
    }
    StepRecord {
        step,
        scheduled: out.scheduled.iter().map(|(id, t)| (name(id), *t)).collect(),
        encoder_inputs,
        preempted: {
            // Sorted: vLLM reports the step's preemptions as a set.
            let mut p: Vec<String> = out.preempted.iter().map(name).collect();
            p.sort_unstable();
            p
        },
        finished: finished.iter().map(name).collect(),
        freed: out.freed.iter().map(|h| h.to_string()).collect(),
        free_slots: out.free_slots,
        freeable_slots: out.freeable_slots,
        free_kv_blocks: out.free_kv_blocks,
        running: scheduler.running().iter().map(name).collect(),
        waiting: scheduler.waiting().map(|id| name(&id)).collect(),
    }
}

fn parse_line(raw: &str, line: usize) -> Result<WorkloadRequest, SimulateError> {
    let err = |field: &str, reason: String| SimulateError::Parse {
        line,
        field: field.to_owned(),
        reason,
    };
    let value: Value =
        serde_json::from_str(raw).map_err(|e| err("(line)", format!("not valid JSON: {e}")))?;
    let Value::Object(obj) = value else {
        return Err(err("(line)", "expected a JSON object".to_owned()));
    };
    const REQUEST_FIELDS: [&str; 5] = ["id", "arrival_step", "abort_step", "prompt_len", "items"];
    if let Some(k) = obj.keys().find(|k| !REQUEST_FIELDS.contains(&k.as_str())) {
        return Err(err(
            k,
            format!(
                "unknown field; expected one of {}",
                REQUEST_FIELDS.join(", ")
            ),
        ));
    }
    let id = match obj.get("id") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => return Err(err("id", "must not be empty".to_owned())),
        Some(other) => return Err(err("id", format!("expected a string, got {other}"))),
        None => return Err(err("id", "missing".to_owned())),
    };
    let arrival_step = match obj.get("arrival_step") {
        None => 0,
        Some(v) => as_u64(v).map_err(|r| err("arrival_step", r))?,
    };
    let abort_step = match obj.get("abort_step") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let a = as_u64(v).map_err(|r| err("abort_step", r))?;
            if a < arrival_step {
                return Err(err(
                    "abort_step",
                    format!("{a} is before the request's arrival_step {arrival_step}"),
                ));
            }
            Some(a)
        }
    };
    let prompt_len = match obj.get("prompt_len") {
        None => return Err(err("prompt_len", "missing".to_owned())),
        Some(v) => as_u64(v).map_err(|r| err("prompt_len", r))?,
    };
    if prompt_len == 0 {
        return Err(err("prompt_len", "must be at least 1".to_owned()));
    }
    let mut items = Vec::new();
    match obj.get("items") {
        None | Some(Value::Null) => {}
        Some(Value::Array(list)) => {
            let mut previous_end = 0u64;
            for (k, v) in list.iter().enumerate() {
                let item = parse_item(v, k, line)?;
                let f = |name: &str| format!("items[{k}].{name}");
                if item.offset < previous_end {
                    return Err(err(
                        &f("offset"),
                        format!(
                            "{} is before the end of the previous item ({previous_end}); items must be in position order and not overlap",
                            item.offset
                        ),
                    ));
                }
                let end = item.offset.saturating_add(item.length);
                if end > prompt_len {
                    return Err(err(
                        &f("length"),
                        format!(
                            "the item covers positions {}..{end}, past prompt_len {prompt_len}",
                            item.offset
                        ),
                    ));
                }
                previous_end = end;
                items.push(item);
            }
        }
        Some(other) => return Err(err("items", format!("expected an array, got {other}"))),
    }
    Ok(WorkloadRequest {
        id,
        arrival_step,
        prompt_len,
        items,
        abort_step,
        line,
    })
}

fn parse_item(v: &Value, k: usize, line: usize) -> Result<WorkloadItem, SimulateError> {
    let err = |name: &str, reason: String| SimulateError::Parse {
        line,
        field: if name.is_empty() {
            format!("items[{k}]")
        } else {
            format!("items[{k}].{name}")
        },
        reason,
    };
    let Value::Object(obj) = v else {
        return Err(err("", format!("expected an object, got {v}")));
    };
    const ITEM_FIELDS: [&str; 5] = ["hash", "offset", "length", "embeds", "embed_runs"];
    if let Some(key) = obj.keys().find(|key| !ITEM_FIELDS.contains(&key.as_str())) {
        return Err(err(
            key,
            format!("unknown field; expected one of {}", ITEM_FIELDS.join(", ")),
        ));
    }
    let hash = match obj.get("hash") {
        Some(Value::String(s)) if !s.is_empty() => s.clone(),
        Some(Value::String(_)) => return Err(err("hash", "must not be empty".to_owned())),
        Some(other) => return Err(err("hash", format!("expected a string, got {other}"))),
        None => return Err(err("hash", "missing".to_owned())),
    };
    let offset = obj
        .get("offset")
        .ok_or_else(|| err("offset", "missing".to_owned()))
        .and_then(|v| as_u64(v).map_err(|r| err("offset", r)))?;
    let length = obj
        .get("length")
        .ok_or_else(|| err("length", "missing".to_owned()))
        .and_then(|v| as_u64(v).map_err(|r| err("length", r)))?;
    if length == 0 {
        return Err(err("length", "must be at least 1".to_owned()));
    }
    let embeds = match obj.get("embeds") {
        None | Some(Value::Null) => None,
        Some(v) => {
            let e = as_u64(v).map_err(|r| err("embeds", r))?;
            if e > length {
                return Err(err(
                    "embeds",
                    format!("{e} is more than the item's length {length}"),
                ));
            }
            if e == 0 {
                return Err(err("embeds", "must be at least 1".to_owned()));
            }
            Some(e)
        }
    };
    let embed_runs = match obj.get("embed_runs") {
        None | Some(Value::Null) => None,
        Some(Value::Array(list)) => {
            let mut runs = Vec::with_capacity(list.len());
            let mut previous_end = 0u64;
            for (r, v) in list.iter().enumerate() {
                let pair = v
                    .as_array()
                    .filter(|p| p.len() == 2)
                    .and_then(|p| Some((p[0].as_u64()?, p[1].as_u64()?)))
                    .ok_or_else(|| {
                        err(
                            "embed_runs",
                            format!(
                                "run {r}: expected [start, end] of non-negative integers, got {v}"
                            ),
                        )
                    })?;
                if pair.0 < previous_end || pair.1 <= pair.0 || pair.1 > length {
                    return Err(err(
                        "embed_runs",
                        format!(
                            "run {r}: {}..{} must be non-empty, after the previous run and within the item's length {length}",
                            pair.0, pair.1
                        ),
                    ));
                }
                previous_end = pair.1;
                runs.push(pair);
            }
            let total: u64 = runs.iter().map(|(s, e)| e - s).sum();
            if total == 0 {
                return Err(err(
                    "embed_runs",
                    "must cover at least one position".to_owned(),
                ));
            }
            if embeds.is_some_and(|e| e != total) {
                return Err(err(
                    "embeds",
                    format!(
                        "{} disagrees with embed_runs, which cover {total}",
                        embeds.unwrap_or(0)
                    ),
                ));
            }
            Some(runs)
        }
        Some(other) => return Err(err("embed_runs", format!("expected an array, got {other}"))),
    };
    let embeds = embeds.or_else(|| {
        embed_runs
            .as_ref()
            .map(|runs| runs.iter().map(|(s, e)| e - s).sum())
    });
    Ok(WorkloadItem {
        hash,
        offset,
        length,
        embeds,
        embed_runs,
    })
}

fn as_u64(v: &Value) -> Result<u64, String> {
    v.as_u64()
        .ok_or_else(|| format!("expected a non-negative integer, got {v}"))
}

/// Hashes that appear in more than one request of a workload (a quick sharing estimate).
pub fn shared_hashes(workload: &[WorkloadRequest]) -> usize {
    let mut seen: HashMap<&str, HashSet<usize>> = HashMap::new();
    for (r, w) in workload.iter().enumerate() {
        for i in &w.items {
            seen.entry(i.hash.as_str()).or_default().insert(r);
        }
    }
    seen.values().filter(|s| s.len() > 1).count()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn parse_err(text: &str) -> (usize, String) {
        match parse_workload(text) {
            Err(SimulateError::Parse { line, field, .. }) => (line, field),
            other => panic!("expected a parse error, got {other:?}"),
        }
    }

    #[test]
    fn parses_the_documented_line() {
        let w = parse_workload(
            "\n{\"id\": \"r1\", \"arrival_step\": 2, \"prompt_len\": 800, \"items\": [{\"hash\": \"a\", \"offset\": 100, \"length\": 600, \"embeds\": 500}]}\n",
        )
        .unwrap();
        assert_eq!(w.len(), 1);
        assert_eq!(w[0].line, 2);
        assert_eq!(w[0].arrival_step, 2);
        assert_eq!(w[0].items[0].embeds, Some(500));
    }

    #[test]
    fn errors_name_line_and_field() {
        let ok = r#"{"id": "r1", "prompt_len": 10}"#;
        assert_eq!(
            parse_err(&format!("{ok}\nnot json")),
            (2, "(line)".to_owned())
        );
        assert_eq!(parse_err(r#"{"prompt_len": 10}"#), (1, "id".to_owned()));
        assert_eq!(
            parse_err(r#"{"id": "x", "prompt_len": -1}"#),
            (1, "prompt_len".to_owned())
        );
        assert_eq!(
            parse_err(r#"{"id": "x", "prompt_len": 10, "colour": 1}"#),
            (1, "colour".to_owned())
        );
        assert_eq!(
            parse_err(&format!(
                "{ok}\n\n{{\"id\": \"y\", \"prompt_len\": 10, \"items\": [{{\"hash\": \"a\", \"offset\": 0, \"length\": \"5\"}}]}}"
            )),
            (3, "items[0].length".to_owned())
        );
        assert_eq!(
            parse_err(
                r#"{"id": "y", "prompt_len": 10, "items": [{"hash": "a", "offset": 0, "length": 5}, {"hash": "b", "offset": 4, "length": 5}]}"#
            ),
            (1, "items[1].offset".to_owned())
        );
        assert_eq!(
            parse_err(
                r#"{"id": "y", "prompt_len": 10, "items": [{"hash": "a", "offset": 8, "length": 5}]}"#
            ),
            (1, "items[0].length".to_owned())
        );
        assert_eq!(
            parse_err(
                r#"{"id": "y", "prompt_len": 10, "items": [{"hash": "a", "offset": 0, "length": 5, "embeds": 6}]}"#
            ),
            (1, "items[0].embeds".to_owned())
        );
        assert_eq!(
            parse_err(r#"{"id": "y", "prompt_len": 10, "items": [{"offset": 0, "length": 5}]}"#),
            (1, "items[0].hash".to_owned())
        );
        assert!(matches!(
            parse_workload(&format!("{ok}\n{ok}")),
            Err(SimulateError::DuplicateId {
                line: 2,
                first_line: 1,
                ..
            })
        ));
    }

    #[test]
    fn simulation_reports_sharing_and_finishing_steps() {
        let w = parse_workload(
            r#"{"id": "r1", "prompt_len": 800, "items": [{"hash": "a", "offset": 100, "length": 600}]}
{"id": "r2", "arrival_step": 0, "prompt_len": 700, "items": [{"hash": "a", "offset": 0, "length": 600}]}
{"id": "r3", "arrival_step": 5, "prompt_len": 100}"#,
        )
        .unwrap();
        let config = SchedulerConfig {
            max_num_batched_tokens: 1000,
            ..SchedulerConfig::default()
        };
        let mut records = Vec::new();
        let s = simulate(&w, &config, None, &mut SizeOnlyOutputs::default(), |r| {
            records.push(r.clone());
            Ok(())
        })
        .unwrap();
        // Step 0: r1 800 tokens (encodes a), r2 200 tokens (hit on a). Step 1: r2's last 500.
        assert_eq!(
            records[0].scheduled,
            vec![("r1".to_owned(), 800), ("r2".to_owned(), 200)]
        );
        assert_eq!(records[0].encoder_inputs.get("r1"), Some(&vec![0]));
        assert!(!records[0].encoder_inputs.contains_key("r2"));
        assert_eq!(records[1].scheduled, vec![("r2".to_owned(), 500)]);
        // Idle steps 2..4 are skipped: r3 arrives at 5 and finishes there.
        assert_eq!(records[2].step, 5);
        let finish: Vec<u64> = s.requests.iter().map(|r| r.finish_step).collect();
        assert_eq!(finish, vec![0, 1, 5]);
        assert_eq!((s.steps, s.encoder_tokens_computed, s.hits), (6, 600, 1));
        assert_eq!(s.peak_cache_use, 600);
        assert_eq!(s.encoder_cache_size, 1000);
        assert_eq!(s.scheduled_tokens, 1600);
    }

    #[test]
    fn request_errors_name_the_line() {
        let w = parse_workload(
            "{\"id\": \"r1\", \"prompt_len\": 10}\n{\"id\": \"big\", \"prompt_len\": 3000, \"items\": [{\"hash\": \"a\", \"offset\": 0, \"length\": 2000}]}",
        )
        .unwrap();
        let config = SchedulerConfig {
            max_num_batched_tokens: 1000,
            disable_chunked_mm_input: true,
            ..SchedulerConfig::default()
        };
        let err = simulate(
            &w,
            &config,
            Some(1000),
            &mut SizeOnlyOutputs::default(),
            |_| Ok(()),
        )
        .unwrap_err();
        assert!(
            matches!(err, SimulateError::Request { line: 2, .. }),
            "{err}"
        );
        let msg = err.to_string();
        assert!(msg.contains("--max-num-batched-tokens"), "{msg}");
    }

    #[test]
    fn shared_hash_count() {
        let w = parse_workload(
            r#"{"id": "a", "prompt_len": 10, "items": [{"hash": "x", "offset": 0, "length": 2}, {"hash": "x", "offset": 2, "length": 2}]}
{"id": "b", "prompt_len": 10, "items": [{"hash": "y", "offset": 0, "length": 2}]}
{"id": "c", "prompt_len": 10, "items": [{"hash": "y", "offset": 0, "length": 2}]}"#,
        )
        .unwrap();
        assert_eq!(shared_hashes(&w), 1);
    }
}
