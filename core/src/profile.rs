//! Start-up memory profiling, as vLLM's `determine_available_memory` does it: snapshot the
//! device, load the weights, size a step of the largest item the model accepts times the most
//! items a batch may hold, and report what that cost and what is left.
//!
//! Two ways to size that step ([`ProfileMode`]):
//!
//! Every step, at start-up as when serving, runs to a plan ([`crate::encoder::plan`]): its
//! input, activations and workspaces at planned places of one arena block, its outputs in
//! blocks of their own that the encoder cache keeps. The largest step's peak activation is its
//! arena, within a few percent of the most bytes its tensors hold live at once.
//!
//! - **dry** (the default): the tower walks its real op sequence at the largest size with the
//!   device's compute skipped, allocating and freeing every tensor in the order a real run
//!   does through a [`CachingAllocator::dry_run`] copy of the allocator, which takes the real
//!   allocator's decisions on virtual memory: the arena it gets is the real step's, in the
//!   time the host needs to walk the graph. One real step on the smallest item then runs the
//!   device for what it holds outside the allocator (contexts, library handles, packed
//!   weights).
//! - **real**: the largest step runs on the device and is measured, as vLLM does it; seconds
//!   on an accelerator, minutes to hours on a CPU.
//!
//! Then, where the device asks for it ([`property::WARM_UP`]) or the request says so, a
//! **warm-up** runs the tower once at each size of a ladder of steps, from the smallest item
//! to the largest step, doubling the patch rows: a device that chooses and loads kernels by
//! problem size on first use (cuBLASLt's heuristics, lazily loaded library kernels, local
//! memory for them) does that here, before the post-start checkpoint, instead of during the
//! first requests of each size, which would be slower than the rest and would grow device
//! memory that no reset gives back. The allocator's cached blocks are returned afterwards.
//!
//! Each phase that can take long reports its progress to a [`StartupProgress`] and its time
//! in [`StartupTimings`].
//!
//! The report separates weights, peak activation memory (the largest step's arena), the
//! step's outputs, memory the driver holds outside the allocator (non-allocator growth), the
//! encoder cache's size in tokens and bytes, and the memory available under
//! `device_memory_utilization`. Start-up is refused, with the numbers, when the device has less
//! free memory than that share of its total.

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, Instant};

use iris_plugin::abi::property;
use iris_plugin::{DType, Description};
use serde::Serialize;
use thiserror::Error;

use crate::budget::{
    BudgetError, BudgetPolicy, EncoderBudget, Modality, ModalityLimits, SchedulerConfig,
};
use crate::encoder::EncoderError;
use crate::encoder::exec::Runner;
use crate::encoder::layout::Grid;
use crate::encoder::tower::VisionTower;
use crate::memory::{
    AllocError, CachingAllocator, MemoryProfile, MemoryProfiler, MemorySnapshot,
    check_free_at_start, requested_memory,
};
use crate::model::{ModelError, ModelSpec, VideoProcessing, WeightSource};
use crate::preprocess::video::VideoResize;
use crate::preprocess::{ImageSize, PreprocessError, smart_resize};

/// Side of the square image whose resize gives a model's largest item: far larger than any
/// processor's `max_pixels`, as vLLM's `get_image_size_with_most_features` uses.
pub const HUGE_IMAGE_SIDE: u32 = 9_999_999;

/// vLLM's default share of device memory (`gpu_memory_utilization`).
pub const DEFAULT_DEVICE_MEMORY_UTILIZATION: f64 = 0.9;

/// How start-up sizes the largest step (see the module's overview).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum ProfileMode {
    /// Walk the op sequence through a dry-run allocator, compute skipped; run one smallest
    /// item for real.
    #[default]
    Dry,
    /// Run the largest batch on the device and measure it.
    Real,
}

impl ProfileMode {
    /// The name flags and reports use.
    pub fn name(self) -> &'static str {
        match self {
            ProfileMode::Dry => "dry",
            ProfileMode::Real => "real",
        }
    }
}

impl fmt::Display for ProfileMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name())
    }
}

impl FromStr for ProfileMode {
    type Err = String;

    /// ```
    /// use iris_core::profile::ProfileMode;
    /// assert_eq!("real".parse::<ProfileMode>(), Ok(ProfileMode::Real));
    /// assert!("fast".parse::<ProfileMode>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<ProfileMode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "dry" => Ok(ProfileMode::Dry),
            "real" => Ok(ProfileMode::Real),
            other => Err(format!(
                "unknown profile mode `{other}`: expected `dry` or `real`"
            )),
        }
    }
}

/// Whether start-up runs the tower at a ladder of step sizes before serving (see the module's
/// overview).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum WarmUpMode {
    /// When the device asks for it (its [`property::WARM_UP`] is `step_sizes`).
    #[default]
    Auto,
    /// Always.
    On,
    /// Never: the first step of each size pays for what the device does on first use.
    Off,
}

impl WarmUpMode {
    /// Whether start-up runs the ladder on a device of this description.
    ///
    /// ```
    /// use iris_core::profile::WarmUpMode;
    /// use iris_plugin::Description;
    /// use iris_plugin::abi::property;
    ///
    /// let mut gpu = Description::default();
    /// gpu.properties.push((property::WARM_UP.into(), property::WARM_UP_STEP_SIZES.into()));
    /// assert!(WarmUpMode::Auto.runs_on(&gpu));
    /// assert!(!WarmUpMode::Auto.runs_on(&Description::default()));
    /// assert!(WarmUpMode::On.runs_on(&Description::default()));
    /// assert!(!WarmUpMode::Off.runs_on(&gpu));
    /// ```
    pub fn runs_on(self, description: &Description) -> bool {
        match self {
            WarmUpMode::On => true,
            WarmUpMode::Off => false,
            WarmUpMode::Auto => {
                description.property(property::WARM_UP) == Some(property::WARM_UP_STEP_SIZES)
            }
        }
    }
}

impl fmt::Display for WarmUpMode {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            WarmUpMode::Auto => "auto",
            WarmUpMode::On => "on",
            WarmUpMode::Off => "off",
        })
    }
}

impl FromStr for WarmUpMode {
    type Err = String;

    /// ```
    /// use iris_core::profile::WarmUpMode;
    /// assert_eq!("on".parse::<WarmUpMode>(), Ok(WarmUpMode::On));
    /// assert!("maybe".parse::<WarmUpMode>().is_err());
    /// ```
    fn from_str(s: &str) -> Result<WarmUpMode, String> {
        match s.trim().to_ascii_lowercase().as_str() {
            "auto" => Ok(WarmUpMode::Auto),
            "on" => Ok(WarmUpMode::On),
            "off" => Ok(WarmUpMode::Off),
            other => Err(format!(
                "unknown warm-up mode `{other}`: expected `auto`, `on` or `off`"
            )),
        }
    }
}

/// A start-up phase that can take long enough to be shown.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[non_exhaustive]
pub enum StartupPhase {
    /// Reading (or, for dummy weights, making) the weights on the host; counted in bytes.
    ReadWeights,
    /// Uploading them to the device; counted in bytes.
    UploadWeights,
    /// Sizing the largest step; counted in tower layers.
    Profile,
    /// Running the tower at a ladder of step sizes; counted in steps.
    WarmUp,
}

impl StartupPhase {
    /// What the phase's counts are: `bytes` or `layers`.
    pub fn unit(self) -> &'static str {
        match self {
            StartupPhase::ReadWeights | StartupPhase::UploadWeights => "bytes",
            StartupPhase::Profile => "layers",
            StartupPhase::WarmUp => "steps",
        }
    }
}

/// Receives start-up progress (a progress bar, log lines). Called from the thread that starts
/// up; every method has a default that does nothing.
pub trait StartupProgress: Send + Sync {
    /// `phase` begins: `what` says what it does (the item size, the profile mode), `total` is
    /// its size in the phase's [`StartupPhase::unit`].
    fn begin(&self, phase: StartupPhase, what: &str, total: u64) {
        let _ = (phase, what, total);
    }
    /// `done` of the phase's total are complete.
    fn advance(&self, phase: StartupPhase, done: u64) {
        let _ = (phase, done);
    }
    /// `phase` ended after `elapsed`.
    fn finish(&self, phase: StartupPhase, elapsed: Duration) {
        let _ = (phase, elapsed);
    }
}

/// Progress that goes nowhere (the default).
#[derive(Debug, Clone, Copy, Default)]
pub struct NoProgress;

impl StartupProgress for NoProgress {}

/// A shared [`StartupProgress`], for configurations that are cloned and printed.
#[derive(Clone)]
pub struct ProgressSink(pub Arc<dyn StartupProgress>);

impl Default for ProgressSink {
    fn default() -> ProgressSink {
        ProgressSink(Arc::new(NoProgress))
    }
}

impl fmt::Debug for ProgressSink {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("ProgressSink")
    }
}

/// Seconds each start-up phase took.
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct StartupTimings {
    /// Reading or making the weights on the host.
    pub read_weights_s: f64,
    /// Uploading them to the device.
    pub upload_weights_s: f64,
    /// Sizing the largest step (the dry run and the smallest real step, or the real run).
    pub profile_s: f64,
    /// Running the warm-up ladder (0 without one).
    pub warm_up_s: f64,
}

/// What to profile.
#[derive(Debug, Clone)]
pub struct ProfileRequest {
    /// The model.
    pub spec: ModelSpec,
    /// Where its weights come from.
    pub weights: WeightSource,
    /// Run dtype.
    pub dtype: DType,
    /// The scheduler settings the encoder budget derives from.
    pub scheduler: SchedulerConfig,
    /// Share of the device's total memory iris may use, in `(0, 1]`.
    pub device_memory_utilization: f64,
    /// How the largest step is sized.
    pub mode: ProfileMode,
    /// Whether to run the warm-up ladder (see the module's overview).
    pub warm_up: WarmUpMode,
    /// Where progress goes.
    pub progress: ProgressSink,
    /// How videos are processed (the largest video item's size derives from it).
    pub video: VideoProcessing,
}

/// The start-up report.
#[derive(Debug, Clone, Serialize)]
pub struct StartupProfile {
    /// Before the weights were loaded.
    pub before_start: MemorySnapshot,
    /// After the weights were loaded and the profiling run's memory was returned.
    pub after_start: MemorySnapshot,
    /// How the largest step was sized.
    pub mode: ProfileMode,
    /// The steps of the warm-up ladder, by patch rows (empty without one).
    pub warm_up_steps: Vec<u64>,
    /// The profiling run's figures (in a dry run, `peak_increase` is the dry run's peak).
    pub profile: MemoryProfile,
    /// Bytes of weights on the device (allocator blocks).
    pub weights_bytes: u64,
    /// Peak activation bytes of the largest step: the block of its arena, where its inputs,
    /// activations and workspaces lie at their planned places (see
    /// [`crate::encoder::plan`]); taken by the real step (`real`) or by the dry run on the
    /// allocator's books (`dry`), which decides as the real one does.
    pub peak_activation_bytes: u64,
    /// The most bytes of the step's arena tensors live at once (rounded to the allocator's
    /// block size): the least any placement needs, which the arena exceeds by a few percent.
    pub planned_peak_activation_bytes: u64,
    /// Bytes of the largest step's outputs (the embeddings, and deepstack rows, of its items):
    /// blocks of their own that the encoder cache keeps, so its budget holds them, not the
    /// activations'.
    pub step_outputs_bytes: u64,
    /// Growth of memory held outside the allocator since the first snapshot.
    pub non_allocator_growth_bytes: u64,
    /// The largest item's grid `(t, h, w)` and its embedding tokens.
    pub max_item_grid: Grid,
    /// Embedding tokens of the largest item.
    pub max_item_tokens: u64,
    /// The modality of the largest item, which set the profiled step (vLLM profiles the
    /// modality with the most tokens per item).
    pub max_item_modality: Modality,
    /// The largest item's embedding tokens of each modality in the profile (those whose
    /// `--limit-mm-per-prompt` count is not 0).
    pub modality_max_tokens: Vec<(Modality, u64)>,
    /// Items in the profiling batch (`max_items_per_batch`).
    pub items_per_batch: u64,
    /// Encoder compute budget per step, in embedding tokens.
    pub encoder_compute_budget: u64,
    /// Encoder cache size in embedding tokens.
    pub encoder_cache_tokens: u64,
    /// Encoder cache size in bytes: tokens x output width x (1 + deepstack levels) x dtype
    /// size.
    pub encoder_cache_bytes: u64,
    /// `ceil(total x device_memory_utilization)`.
    pub requested_bytes: u64,
    /// What is left of the requested memory for the encoder cache and downstream use.
    pub available_bytes: u64,
    /// Seconds each phase took.
    pub timings: StartupTimings,
}

/// The most patch rows one step may hold: attention's segment boundaries (`cu_seqlens`) reach
/// the device as 32-bit signed integers.
pub const MAX_STEP_ROWS: u64 = i32::MAX as u64;

/// Why profiling failed.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum ProfileError {
    /// Memory accounting or allocation failed (includes "less free memory than requested").
    #[error(transparent)]
    Memory(#[from] AllocError),
    /// The model or its weights.
    #[error(transparent)]
    Model(#[from] ModelError),
    /// The encoder run.
    #[error(transparent)]
    Encoder(#[from] EncoderError),
    /// The encoder budget.
    #[error(transparent)]
    Budget(#[from] BudgetError),
    /// Sizing the largest item.
    #[error(transparent)]
    Preprocess(#[from] PreprocessError),
    /// The largest step the scheduler's flags allow has more patch rows than a step can hold.
    #[error(
        "the largest step holds {items} items of {patches_per_item} patches each, more than the {MAX_STEP_ROWS} patch rows a step can hold; lower --max-num-batched-tokens or --max-num-seqs"
    )]
    StepTooLarge {
        /// Items in the largest step.
        items: u64,
        /// Patch rows of each.
        patches_per_item: u64,
    },
    /// The largest step is vLLM's dummy video for the model, and it does not fit.
    #[error(
        "the largest item is vLLM's dummy video for this model, grid {grid:?} ({tokens} tokens), and its step does not fit: {error}; limit_mm_per_prompt {{\"video\": 0}} sizes the engine for images only (and refuses videos), max_model_len bounds the video's frames"
    )]
    VideoDoesNotFit {
        /// The dummy video's grid.
        grid: Grid,
        /// Its embedding tokens.
        tokens: u64,
        /// The out-of-memory error (a field, not a `source`: the message already carries it).
        error: Box<ProfileError>,
    },
}

impl ProfileError {
    /// Whether the device (or the dry run's account of it) ran out of memory.
    fn is_out_of_memory(&self) -> bool {
        matches!(
            self,
            ProfileError::Memory(AllocError::OutOfMemory { .. })
                | ProfileError::Encoder(EncoderError::Alloc(AllocError::OutOfMemory { .. }))
        )
    }
}

/// Profiles start-up on the allocator's device and returns the loaded tower with the report.
pub fn profile_startup(
    allocator: &Arc<CachingAllocator>,
    request: &ProfileRequest,
) -> Result<(VisionTower, StartupProfile), ProfileError> {
    let progress = request.progress.0.as_ref();
    let mut timings = StartupTimings::default();
    let before_start = MemorySnapshot::take(allocator)?;
    let requested_bytes =
        requested_memory(before_start.device_total, request.device_memory_utilization)?;
    check_free_at_start(&before_start, requested_bytes)?;

    let vision = &request.spec.vision;
    let total_weights = vision.weight_bytes(request.dtype)?;
    let phase = Phase::begin(
        progress,
        StartupPhase::ReadWeights,
        &format!("{} weights in {}", vision.family, request.dtype),
        total_weights,
    );
    let host = request
        .weights
        .load_with_progress(vision, request.dtype, &mut |done| {
            progress.advance(StartupPhase::ReadWeights, done);
        })?;
    timings.read_weights_s = phase.finish();
    let runner = Runner::new(Arc::clone(allocator));
    let phase = Phase::begin(
        progress,
        StartupPhase::UploadWeights,
        "weights to the device",
        host.total_bytes(),
    );
    let tower = VisionTower::from_host_with_progress(
        &runner,
        vision.clone(),
        host,
        request.dtype,
        &mut |done| progress.advance(StartupPhase::UploadWeights, done),
    )?;
    allocator.synchronize().map_err(EncoderError::from)?;
    timings.upload_weights_s = phase.finish();
    let weights_bytes = allocator.stats().allocated - before_start.allocator_allocated;

    let processor = &request.spec.processor;
    let largest = largest_items(request, &tower)?;
    let (max_item_modality, grid, max_item_tokens) = largest
        .iter()
        .copied()
        .fold(
            None,
            |best: Option<(Modality, Grid, u64)>, item| match best {
                Some(b) if b.2 >= item.2 => Some(b),
                _ => Some(item),
            },
        )
        .ok_or(BudgetError::Zero {
            name: "limit_mm_per_prompt (every modality)",
        })?;
    let limits = &request.scheduler.limit_mm_per_prompt;
    let modalities: Vec<(Modality, ModalityLimits)> = largest
        .iter()
        .map(|&(modality, _, tokens)| {
            (
                modality,
                ModalityLimits {
                    max_tokens_per_item: tokens,
                    limit_per_prompt: limits.get(modality),
                },
            )
        })
        .collect();
    let budget = EncoderBudget::new(&request.scheduler, &modalities)?;
    let items_per_batch = budget
        .modality(max_item_modality)
        .map_or(1, |m| m.max_items_per_batch);
    let patches_per_item = grid.iter().map(|&v| u64::from(v)).product::<u64>();
    // Checked before the step's grids are listed: flags such as --max-num-batched-tokens 1e15
    // would otherwise ask for a list of that many items (and attention's segment boundaries
    // reach the device as 32-bit signed integers).
    let rows = patches_per_item
        .checked_mul(items_per_batch)
        .filter(|&rows| rows <= MAX_STEP_ROWS)
        .ok_or(ProfileError::StepTooLarge {
            items: items_per_batch,
            patches_per_item,
        })?;
    let grids: Vec<Grid> = (0..items_per_batch).map(|_| grid).collect();
    let row_len = vision.patch_row_len() as u64;

    // A video step that does not fit says which item it was and how to leave it out.
    let name_video = |err: ProfileError| {
        if max_item_modality == Modality::Video && err.is_out_of_memory() {
            ProfileError::VideoDoesNotFit {
                grid,
                tokens: max_item_tokens,
                error: Box::new(err),
            }
        } else {
            err
        }
    };
    let plan = Arc::new(
        tower
            .plan_step(allocator, &grids)
            .map_err(|e| name_video(e.into()))?,
    );
    let planned_peak_activation_bytes = plan.live_peak();

    let depth = vision.depth as u64;
    let phase = Phase::begin(
        progress,
        StartupPhase::Profile,
        &format!(
            "{} run of the largest step: {max_item_modality} grid {grid:?} ({max_item_tokens} tokens) x {items_per_batch}",
            request.mode
        ),
        depth,
    );
    let profiler = MemoryProfiler::start(allocator, before_start, weights_bytes)?;
    let step = (|| -> Result<_, ProfileError> {
        Ok(match request.mode {
            ProfileMode::Dry => {
                let dry = Runner::dry_run(allocator)?.step(Arc::clone(&plan));
                {
                    let input = dry.upload_placeholder(request.dtype, rows, row_len)?;
                    let outputs =
                        tower.forward_with_progress(&dry, &input, &grids, &mut |done| {
                            progress.advance(StartupPhase::Profile, done as u64);
                            Ok(())
                        })?;
                    drop(input);
                    drop(outputs);
                }
                let step = dry.step_report();
                // What the device holds outside the allocator appears only when ops run: one
                // step of the smallest item runs them all, on every weight.
                let smallest = item_grid(request, processor.factor())?;
                run_step(&runner, &tower, request.dtype, &[smallest])?;
                step
            }
            ProfileMode::Real => {
                let real = runner.step(Arc::clone(&plan));
                {
                    let input = real.upload_placeholder(request.dtype, rows, row_len)?;
                    let outputs =
                        tower.forward_with_progress(&real, &input, &grids, &mut |done| {
                            // Waiting for each layer makes the progress the device's, not the queue's.
                            allocator.synchronize()?;
                            progress.advance(StartupPhase::Profile, done as u64);
                            Ok(())
                        })?;
                    drop(input);
                    drop(outputs);
                }
                allocator.synchronize().map_err(EncoderError::from)?;
                real.step_report()
            }
        })
    })()
    .map_err(name_video)?;
    let step = step.unwrap_or_default();
    // The step's activations are its arena, in a dry run as in a real one; its outputs go to
    // the encoder cache, whose size is budgeted apart.
    let peak_activation_bytes = step.arena_bytes;
    let profile = profiler.finish()?.with_peak_increase(peak_activation_bytes);
    timings.profile_s = phase.finish();
    let warm_up = request.warm_up.runs_on(allocator.device().description());
    let mut warm_up_steps = Vec::new();
    if warm_up {
        let smallest = item_grid(request, processor.factor())?;
        let merge = u32::try_from(vision.spatial_merge_size).unwrap_or(1);
        let ladder = warm_up_ladder(smallest, grid, items_per_batch, merge);
        let phase = Phase::begin(
            progress,
            StartupPhase::WarmUp,
            &format!(
                "the tower at {} step sizes, {} to {} patches",
                ladder.len(),
                ladder.first().map_or(0, |step| step_rows(step)),
                ladder.last().map_or(0, |step| step_rows(step)),
            ),
            ladder.len() as u64,
        );
        for (done, grids) in ladder.iter().enumerate() {
            let rows = step_rows(grids);
            // One step at a time: the device's memory peak stays the largest step's.
            run_step(&runner, &tower, request.dtype, grids)?;
            progress.advance(StartupPhase::WarmUp, done as u64 + 1);
            warm_up_steps.push(rows);
        }
        allocator.empty_cache()?;
        timings.warm_up_s = phase.finish();
    }
    let after_start = MemorySnapshot::take(allocator)?;

    let encoder_cache_tokens = budget.cache_size();
    let dtype_bytes = request.dtype.size().unwrap_or(4);
    // Each cached token is one row of the merged output plus one row per deepstack level
    // (Qwen3-VL keeps those outputs with the item too).
    let row_width = vision.out_hidden as u64 * (1 + vision.deepstack_visual_indexes.len() as u64);
    let encoder_cache_bytes = budget.cache_bytes(row_width, dtype_bytes)?;
    let available_bytes = profile.available(requested_bytes)?;
    let report = StartupProfile {
        before_start,
        after_start,
        mode: request.mode,
        warm_up_steps,
        weights_bytes,
        peak_activation_bytes,
        planned_peak_activation_bytes,
        step_outputs_bytes: plan.output_bytes(),
        non_allocator_growth_bytes: profile.non_allocator_increase,
        profile,
        max_item_grid: grid,
        max_item_tokens,
        max_item_modality,
        modality_max_tokens: largest.iter().map(|&(m, _, t)| (m, t)).collect(),
        items_per_batch,
        encoder_compute_budget: budget.compute_budget(),
        encoder_cache_tokens,
        encoder_cache_bytes,
        requested_bytes,
        available_bytes,
        timings,
    };
    Ok((tower, report))
}

/// Runs one step of `grids` to its plan, on a placeholder input, and waits for it.
fn run_step(
    runner: &Runner,
    tower: &VisionTower,
    dtype: DType,
    grids: &[Grid],
) -> Result<(), EncoderError> {
    let plan = Arc::new(tower.plan_step(runner.allocator(), grids)?);
    let step = runner.step(plan);
    let row_len = tower.config().patch_row_len() as u64;
    let input = step.upload_placeholder(dtype, step_rows(grids), row_len)?;
    drop(tower.forward(&step, &input, grids)?);
    drop(input);
    drop(step);
    runner.allocator().synchronize().map_err(EncoderError::from)
}

/// The warm-up's steps, each the grids of its items: one item from `smallest` up to `largest`,
/// its patch rows doubling (widening and heightening in turn, in whole merge windows), then
/// 2, 4, ... copies of `largest` up to `items_per_batch` of them, the largest step.
fn warm_up_ladder(
    smallest: Grid,
    largest: Grid,
    items_per_batch: u64,
    merge: u32,
) -> Vec<Vec<Grid>> {
    let merge = merge.max(1);
    let mut ladder = Vec::new();
    let [_, mut h, mut w] = smallest;
    loop {
        ladder.push(vec![[1, h, w]]);
        let wider = (w * 2).next_multiple_of(merge).min(largest[2]);
        let taller = (h * 2).next_multiple_of(merge).min(largest[1]);
        // Widen when the item is square (or taller), else heighten, so rows double each time.
        if w <= h && wider > w {
            w = wider;
        } else if taller > h {
            h = taller;
        } else if wider > w {
            w = wider;
        } else {
            break;
        }
    }
    // A video's temporal groups make the largest item larger than one frame's grid.
    if largest[0] > 1 {
        ladder.push(vec![largest]);
    }
    let mut items = 1;
    while items < items_per_batch {
        items = (items * 2).min(items_per_batch);
        ladder.push(vec![largest; usize::try_from(items).unwrap_or(usize::MAX)]);
    }
    ladder
}

/// Patch rows of one step's grids.
fn step_rows(grids: &[Grid]) -> u64 {
    grids
        .iter()
        .map(|[t, h, w]| u64::from(*t) * u64::from(*h) * u64::from(*w))
        .sum()
}

/// vLLM's `_MAX_FRAMES_PER_VIDEO`: the most frames of Qwen2/2.5-VL's profiling video.
pub const MAX_PROFILE_VIDEO_FRAMES: u64 = 14;

/// The largest item of each modality whose `--limit-mm-per-prompt` count is not 0, as vLLM's
/// `get_mm_max_tokens_per_item` sizes them: `(modality, grid, tokens)`.
///
/// - Image: the processor's largest resize.
/// - Video, Qwen2/2.5-VL: the largest image's frames, as many as fit `max_model_len` (counted
///   in temporal groups of the largest image's tokens), at most 14, at least 1 (padded to a
///   temporal group).
/// - Video, Qwen3-VL: two frames of the largest image within the video processor's budget
///   over both (`longest_edge / temporal_patch_size` pixels per frame), as vLLM's dummy video.
fn largest_items(
    request: &ProfileRequest,
    tower: &VisionTower,
) -> Result<Vec<(Modality, Grid, u64)>, ProfileError> {
    let limits = &request.scheduler.limit_mm_per_prompt;
    let mut items = Vec::new();
    let image = item_grid(request, HUGE_IMAGE_SIDE)?;
    let image_tokens = tower.tokens(image);
    if limits.image > 0 {
        items.push((Modality::Image, image, image_tokens));
    }
    if limits.video > 0 {
        let video = &request.video;
        let grid = match video.resize {
            VideoResize::PerFrame => {
                let temporal = u64::from(video.config.temporal_patch_size.max(1));
                let groups_that_fit = request.scheduler.max_model_len / image_tokens.max(1);
                let frames = if groups_that_fit == 0 {
                    1
                } else {
                    groups_that_fit.saturating_mul(temporal)
                };
                let frames = frames.clamp(1, MAX_PROFILE_VIDEO_FRAMES);
                let groups = u32::try_from(frames.div_ceil(temporal)).unwrap_or(u32::MAX);
                [groups, image[1], image[2]]
            }
            VideoResize::OverAllFrames => {
                let config = &video.config;
                let unit = config.factor();
                let per_frame = config.max_pixels / u64::from(config.temporal_patch_size.max(1));
                // In u64: a factor of 65536 (the largest the processor takes) squares past u32.
                let (h, w) = most_features(per_frame / (u64::from(unit) * u64::from(unit)));
                [
                    1,
                    h * unit / config.patch_size,
                    w * unit / config.patch_size,
                ]
            }
        };
        items.push((Modality::Video, grid, tower.tokens(grid)));
    }
    Ok(items)
}

/// vLLM's `get_image_size_with_most_features` in merge windows: the factor pair `(h, w)`,
/// `h <= w`, closest to square of the most windows up to `windows` whose ratio is at most 200.
fn most_features(windows: u64) -> (u32, u32) {
    for n in (1..=windows).rev() {
        let root = n.isqrt();
        let h = (1..=root).rev().find(|d| n % d == 0).unwrap_or(1);
        let w = n / h;
        if w <= 200 * h {
            return (
                u32::try_from(h).unwrap_or(u32::MAX),
                u32::try_from(w).unwrap_or(u32::MAX),
            );
        }
    }
    (1, 1)
}

/// The grid `(1, h, w)` in patches of an image of `side x side` after the processor's resize.
fn item_grid(request: &ProfileRequest, side: u32) -> Result<Grid, ProfileError> {
    let processor = &request.spec.processor;
    let size = smart_resize(
        ImageSize::new(side, side),
        processor.factor(),
        processor.min_pixels,
        processor.max_pixels,
    )?;
    let patch = processor.patch_size;
    Ok([1, size.height / patch, size.width / patch])
}

/// A phase in progress: reported to the sink when it begins and ends, timed.
struct Phase<'a> {
    progress: &'a dyn StartupProgress,
    phase: StartupPhase,
    started: Instant,
}

impl<'a> Phase<'a> {
    fn begin(
        progress: &'a dyn StartupProgress,
        phase: StartupPhase,
        what: &str,
        total: u64,
    ) -> Phase<'a> {
        progress.begin(phase, what, total);
        Phase {
            progress,
            phase,
            started: Instant::now(),
        }
    }

    /// Ends the phase; its duration in seconds.
    fn finish(self) -> f64 {
        let elapsed = self.started.elapsed();
        self.progress.finish(self.phase, elapsed);
        elapsed.as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn rows(grid: &Grid) -> u64 {
        step_rows(std::slice::from_ref(grid))
    }

    #[test]
    fn the_warm_up_ladder_doubles_rows_up_to_the_largest_step() {
        // Qwen2.5-VL-7B: the smallest item 2x2 patches, the largest 256x256, one per step.
        let ladder = warm_up_ladder([1, 2, 2], [1, 256, 256], 1, 2);
        let sizes: Vec<u64> = ladder.iter().map(|step| step_rows(step)).collect();
        assert_eq!(sizes.first(), Some(&4));
        assert_eq!(sizes.last(), Some(&(256 * 256)));
        for pair in sizes.windows(2) {
            assert_eq!(pair[1], pair[0] * 2, "{sizes:?}");
        }
        for step in &ladder {
            for grid in step {
                assert!(grid[1] % 2 == 0 && grid[2] % 2 == 0 && grid[1] <= 256 && grid[2] <= 256);
            }
        }
    }

    #[test]
    fn the_warm_up_ladder_ends_with_the_full_batch_of_largest_items() {
        // A rectangular largest item, three a step.
        let ladder = warm_up_ladder([1, 2, 2], [1, 12, 40], 3, 2);
        let last = ladder.last().unwrap();
        assert_eq!(last, &vec![[1, 12, 40]; 3]);
        let sizes: Vec<u64> = ladder.iter().map(|step| step_rows(step)).collect();
        assert!(sizes.windows(2).all(|pair| pair[1] > pair[0]), "{sizes:?}");
        assert!(ladder.iter().flatten().all(|grid| rows(grid) <= 12 * 40));
        // One size only: one step.
        assert_eq!(
            warm_up_ladder([1, 4, 4], [1, 4, 4], 1, 2),
            vec![vec![[1, 4, 4]]]
        );
    }
}
