//! Start-up memory profiling, as vLLM's `determine_available_memory` does it: snapshot the
//! device, load the weights, run the encoder on the largest item the model accepts times the
//! most items a batch may hold, and report what that cost and what is left.
//!
//! The report separates weights, peak activation memory (the rise of the allocator's peak
//! during the run), memory the driver holds outside the allocator (non-allocator growth), the
//! encoder cache's size in tokens and bytes, and the memory available under
//! `device_memory_utilization`. Start-up is refused, with the numbers, when the device has less
//! free memory than that share of its total.

use std::sync::Arc;

use iris_plugin::DType;
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
use crate::model::{ModelError, ModelSpec, WeightSource};
use crate::preprocess::{ImageSize, PreprocessError, smart_resize};

/// Side of the square image whose resize gives a model's largest item: far larger than any
/// processor's `max_pixels`, as vLLM's `get_image_size_with_most_features` uses.
pub const HUGE_IMAGE_SIDE: u32 = 9_999_999;

/// vLLM's default share of device memory (`gpu_memory_utilization`).
pub const DEFAULT_DEVICE_MEMORY_UTILIZATION: f64 = 0.9;

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
}

/// The start-up report.
#[derive(Debug, Clone, Serialize)]
pub struct StartupProfile {
    /// Before the weights were loaded.
    pub before_start: MemorySnapshot,
    /// After the weights were loaded and the profiling run's memory was returned.
    pub after_start: MemorySnapshot,
    /// The profiling run's figures.
    pub profile: MemoryProfile,
    /// Bytes of weights on the device (allocator blocks).
    pub weights_bytes: u64,
    /// Peak activation bytes of the profiling run, as measured.
    pub peak_activation_bytes: u64,
    /// The same peak, computed by planning the run before executing it.
    pub planned_peak_activation_bytes: u64,
    /// Growth of memory held outside the allocator since the first snapshot.
    pub non_allocator_growth_bytes: u64,
    /// The largest item's grid `(t, h, w)` and its embedding tokens.
    pub max_item_grid: Grid,
    /// Embedding tokens of the largest item.
    pub max_item_tokens: u64,
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
}

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
}

/// Profiles start-up on the allocator's device and returns the loaded tower with the report.
pub fn profile_startup(
    allocator: &Arc<CachingAllocator>,
    request: &ProfileRequest,
) -> Result<(VisionTower, StartupProfile), ProfileError> {
    let before_start = MemorySnapshot::take(allocator)?;
    let requested_bytes =
        requested_memory(before_start.device_total, request.device_memory_utilization)?;
    check_free_at_start(&before_start, requested_bytes)?;

    let vision = &request.spec.vision;
    let host = request.weights.load(vision, request.dtype)?;
    let runner = Runner::new(Arc::clone(allocator));
    let tower = VisionTower::from_host(&runner, vision.clone(), host, request.dtype)?;
    let weights_bytes = allocator.stats().allocated - before_start.allocator_allocated;

    let processor = &request.spec.processor;
    let huge = ImageSize::new(HUGE_IMAGE_SIDE, HUGE_IMAGE_SIDE);
    let largest = smart_resize(
        huge,
        processor.factor(),
        processor.min_pixels,
        processor.max_pixels,
    )?;
    let patch = processor.patch_size;
    let grid: Grid = [1, largest.height / patch, largest.width / patch];
    let max_item_tokens = tower.tokens(grid);
    let budget = EncoderBudget::new(
        &request.scheduler,
        &[(Modality::Image, ModalityLimits::new(max_item_tokens))],
    )?;
    let items_per_batch = budget
        .modality(Modality::Image)
        .map_or(1, |m| m.max_items_per_batch);
    let grids: Vec<Grid> = (0..items_per_batch).map(|_| grid).collect();
    let patches_per_item = u64::from(grid[1]) * u64::from(grid[2]);
    let rows = patches_per_item * items_per_batch;
    let row_len = vision.patch_row_len() as u64;

    let planner = Runner::planner(Arc::clone(allocator));
    {
        let input = planner.tensor(request.dtype, rows, row_len)?;
        drop(tower.forward(&planner, &input, &grids)?);
    }
    let planned_peak_activation_bytes = planner.planned_peak();

    let profiler = MemoryProfiler::start(allocator, before_start, weights_bytes)?;
    {
        // A mid-grey image after normalisation: the values do not change the memory used.
        let input = runner.tensor(request.dtype, rows, row_len)?;
        let outputs = tower.forward(&runner, &input, &grids)?;
        drop(outputs);
    }
    let profile = profiler.finish()?;
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
        weights_bytes,
        peak_activation_bytes: profile.peak_increase,
        planned_peak_activation_bytes,
        non_allocator_growth_bytes: profile.non_allocator_increase,
        profile,
        max_item_grid: grid,
        max_item_tokens,
        items_per_batch,
        encoder_compute_budget: budget.compute_budget(),
        encoder_cache_tokens,
        encoder_cache_bytes,
        requested_bytes,
        available_bytes,
    };
    Ok((tower, report))
}
