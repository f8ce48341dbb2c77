//! Start-up sizing: the dry run's peak against a real run of the same largest-item step, per
//! model family and dtype, on the CPU device.
//!
//! Each tower is its published preset cut to two blocks (the block indexes that select full
//! attention and deepstack outputs moved inside them) with the processor's pixel limit lowered
//! so that the largest item is 16 x 16 patches: the real step then runs in seconds, while its
//! tensors, at the presets' real widths, still cover both pools of the allocator (workspaces and
//! bf16 rows in the small one, activations of a few MiB sharing 20 MiB segments).

use std::sync::{Arc, Mutex, PoisonError};
use std::time::Duration;

use iris_core::budget::{MmLimits, Modality, SchedulerConfig};
use iris_core::memory::CachingAllocator;
use iris_core::model::{ModelSpec, WeightSource};
use iris_core::profile::{
    ProfileMode, ProfileRequest, ProgressSink, StartupPhase, StartupProfile, StartupProgress,
    WarmUpMode, profile_startup,
};
use iris_plugin::{DType, Plugin};

/// Patches along each side of the largest item.
const SIDE_PATCHES: u32 = 16;

/// Side in pixels of the largest item for a patch of `patch` pixels.
fn largest_side(patch: u32) -> u64 {
    u64::from(patch * SIDE_PATCHES)
}

/// `preset` cut to two blocks, its largest item [`SIDE_PATCHES`] patches square.
fn small_spec(preset: &str) -> ModelSpec {
    let mut spec = ModelSpec::preset(preset).expect("the preset exists");
    let vision = &mut spec.vision;
    vision.depth = 2;
    if !vision.fullatt_block_indexes.is_empty() {
        vision.fullatt_block_indexes = vec![1];
    }
    if !vision.deepstack_visual_indexes.is_empty() {
        vision.deepstack_visual_indexes = vec![0, 1];
    }
    let side = largest_side(spec.processor.patch_size);
    spec.processor.max_pixels = side * side;
    spec
}

fn allocator() -> Arc<CachingAllocator> {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "4GiB".into())])
        .expect("the CPU device opens");
    CachingAllocator::new(Arc::new(device))
}

fn profile(
    spec: &ModelSpec,
    dtype: DType,
    mode: ProfileMode,
    progress: ProgressSink,
) -> StartupProfile {
    profile_with(spec, dtype, mode, WarmUpMode::Auto, progress)
}

fn profile_with(
    spec: &ModelSpec,
    dtype: DType,
    mode: ProfileMode,
    warm_up: WarmUpMode,
    progress: ProgressSink,
) -> StartupProfile {
    // Two largest items a step (64 tokens each): a batch, not one item, is what is sized.
    // Images only here; `a_video_step_is_sized_as_it_runs` profiles a video.
    let scheduler = SchedulerConfig {
        max_num_batched_tokens: 128,
        limit_mm_per_prompt: MmLimits {
            video: 0,
            ..MmLimits::default()
        },
        ..SchedulerConfig::default()
    };
    profile_scheduled(spec, dtype, mode, warm_up, progress, scheduler)
}

fn profile_scheduled(
    spec: &ModelSpec,
    dtype: DType,
    mode: ProfileMode,
    warm_up: WarmUpMode,
    progress: ProgressSink,
    scheduler: SchedulerConfig,
) -> StartupProfile {
    let request = ProfileRequest {
        spec: spec.clone(),
        weights: WeightSource::Dummy { seed: 7 },
        dtype,
        scheduler,
        device_memory_utilization: 0.9,
        mode,
        warm_up,
        progress,
        video: spec.default_video_processing(),
    };
    let allocator = allocator();
    let (tower, report) = profile_startup(&allocator, &request).expect("start-up profiling");
    drop(tower);
    // Nothing of either run stays allocated beyond the tower, which is gone now.
    assert_eq!(allocator.stats().allocated, 0, "{mode} left blocks behind");
    report
}

/// The dry run predicts what the real step takes, exactly, and that is within 5% of the most
/// bytes the step's tensors hold live at once: memory reserved for a step and never used is
/// memory the encoder cache does not get.
fn check(preset: &str, dtype: DType) {
    let spec = small_spec(preset);
    let dry = profile(&spec, dtype, ProfileMode::Dry, ProgressSink::default());
    let real = profile(&spec, dtype, ProfileMode::Real, ProgressSink::default());
    assert_eq!(
        dry.max_item_grid,
        [1, SIDE_PATCHES, SIDE_PATCHES],
        "{preset}: the sized item"
    );
    assert_eq!(dry.max_item_grid, real.max_item_grid);
    assert_eq!((dry.items_per_batch, real.items_per_batch), (2, 2));
    assert_eq!((dry.mode, real.mode), (ProfileMode::Dry, ProfileMode::Real));

    // The real step's rise of the allocator's peaks: its arena and its outputs.
    let before = real.profile.before_profile;
    let after = real.profile.after_profile;
    let real_allocated = after.allocator_peak_allocated - before.allocator_allocated;
    let real_reserved = after.allocator_peak_reserved - before.allocator_reserved;
    let predicted = dry.peak_activation_bytes;
    assert_eq!(
        predicted, real.peak_activation_bytes,
        "{preset} {dtype}: the dry run decides as the real allocator does"
    );
    assert_eq!(dry.step_outputs_bytes, real.step_outputs_bytes);
    assert!(
        predicted + real.step_outputs_bytes >= real_allocated.max(real_reserved),
        "{preset} {dtype}: arena {predicted} and outputs {} below the real step's rise \
         (allocated {real_allocated}, reserved {real_reserved})",
        real.step_outputs_bytes
    );
    let live = real.planned_peak_activation_bytes;
    assert!(
        predicted >= live && predicted as f64 <= 1.05 * live as f64,
        "{preset} {dtype}: arena {predicted} against a live peak of {live} ({:.3}x)",
        predicted as f64 / live as f64
    );
    // The budget that follows is the same whichever way the peak was found.
    assert_eq!(dry.weights_bytes, real.weights_bytes);
    assert_eq!(
        dry.profile.non_cache_memory,
        dry.weights_bytes + predicted + dry.non_allocator_growth_bytes
    );
}

/// The warm-up ladder runs the tower from the smallest item to the largest step (two largest
/// items here), then returns what the allocator cached: start-up ends where it ends without
/// it. The CPU device does not ask for it, so `auto` runs none there.
#[test]
fn the_warm_up_runs_every_step_size_and_leaves_nothing_cached() {
    let spec = small_spec("qwen2-vl-2b");
    let plain = profile_with(
        &spec,
        DType::F32,
        ProfileMode::Dry,
        WarmUpMode::Auto,
        ProgressSink::default(),
    );
    assert!(
        plain.warm_up_steps.is_empty(),
        "the CPU device asks for no warm-up"
    );
    assert_eq!(plain.timings.warm_up_s, 0.0);
    let recorder = Arc::new(Recorder::default());
    let warm = profile_with(
        &spec,
        DType::F32,
        ProfileMode::Dry,
        WarmUpMode::On,
        ProgressSink(Arc::clone(&recorder) as Arc<dyn StartupProgress>),
    );
    let largest = u64::from(SIDE_PATCHES * SIDE_PATCHES);
    // From the smallest item the processor gives (min_pixels: 4x4 patches here).
    assert_eq!(warm.warm_up_steps.first(), Some(&16), "the smallest item");
    assert_eq!(
        warm.warm_up_steps.last(),
        Some(&(2 * largest)),
        "the largest step"
    );
    assert!(
        warm.warm_up_steps
            .windows(2)
            .all(|pair| pair[1] == pair[0] * 2),
        "patch rows double: {:?}",
        warm.warm_up_steps
    );
    assert!(warm.timings.warm_up_s > 0.0);
    assert_eq!(
        warm.after_start.allocator_reserved, plain.after_start.allocator_reserved,
        "the warm-up's blocks are returned before the post-start checkpoint"
    );
    let events = recorder.0.lock().unwrap().clone();
    let steps = warm.warm_up_steps.len() as u64;
    assert!(
        events.contains(&(StartupPhase::WarmUp, "begin", steps))
            && events.contains(&(StartupPhase::WarmUp, "advance", steps)),
        "{events:?}"
    );
}

#[test]
fn dry_run_covers_a_real_qwen2_vl_step_in_f32() {
    check("qwen2-vl-2b", DType::F32);
}

#[test]
fn dry_run_covers_a_real_qwen2_vl_step_in_bf16() {
    check("qwen2-vl-2b", DType::BF16);
}

#[test]
fn dry_run_covers_a_real_qwen2_5_vl_step_in_f32() {
    check("qwen2.5-vl-3b", DType::F32);
}

#[test]
fn dry_run_covers_a_real_qwen2_5_vl_step_in_bf16() {
    check("qwen2.5-vl-3b", DType::BF16);
}

#[test]
fn dry_run_covers_a_real_qwen3_vl_deepstack_step_in_f32() {
    check("qwen3-vl-2b", DType::F32);
}

#[test]
fn dry_run_covers_a_real_qwen3_vl_deepstack_step_in_bf16() {
    check("qwen3-vl-2b", DType::BF16);
}

/// What a [`StartupProgress`] was told, in order.
#[derive(Default)]
struct Recorder(Mutex<Vec<(StartupPhase, &'static str, u64)>>);

impl StartupProgress for Recorder {
    fn begin(&self, phase: StartupPhase, _what: &str, total: u64) {
        self.push(phase, "begin", total);
    }

    fn advance(&self, phase: StartupPhase, done: u64) {
        self.push(phase, "advance", done);
    }

    fn finish(&self, phase: StartupPhase, _elapsed: Duration) {
        self.push(phase, "finish", 0);
    }
}

impl Recorder {
    fn push(&self, phase: StartupPhase, event: &'static str, count: u64) {
        self.0
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push((phase, event, count));
    }
}

#[test]
fn every_phase_reports_its_progress_to_its_total_and_its_time() {
    let spec = small_spec("qwen2-vl-2b");
    let recorder = Arc::new(Recorder::default());
    let report = profile(
        &spec,
        DType::BF16,
        ProfileMode::Dry,
        ProgressSink(Arc::clone(&recorder) as Arc<dyn StartupProgress>),
    );
    let events = recorder.0.lock().unwrap().clone();
    let weight_bytes = spec.vision.weight_bytes(DType::BF16).unwrap();
    for (phase, total) in [
        (StartupPhase::ReadWeights, weight_bytes),
        (StartupPhase::UploadWeights, weight_bytes),
        (StartupPhase::Profile, 2),
    ] {
        let mine: Vec<_> = events.iter().filter(|e| e.0 == phase).collect();
        assert_eq!(
            mine.first().map(|e| (e.1, e.2)),
            Some(("begin", total)),
            "{phase:?}"
        );
        assert_eq!(mine.last().map(|e| e.1), Some("finish"), "{phase:?}");
        let advances: Vec<u64> = mine
            .iter()
            .filter(|e| e.1 == "advance")
            .map(|e| e.2)
            .collect();
        assert!(
            advances.windows(2).all(|w| w[0] <= w[1]),
            "{phase:?}: {advances:?}"
        );
        assert_eq!(advances.last(), Some(&total), "{phase:?} reaches its total");
    }
    let order: Vec<StartupPhase> = events
        .iter()
        .filter(|e| e.1 == "begin")
        .map(|e| e.0)
        .collect();
    assert_eq!(
        order,
        [
            StartupPhase::ReadWeights,
            StartupPhase::UploadWeights,
            StartupPhase::Profile
        ]
    );
    let t = report.timings;
    assert!(
        t.read_weights_s >= 0.0 && t.upload_weights_s >= 0.0 && t.profile_s > 0.0,
        "{t:?}"
    );
}

/// The largest video (here two temporal groups of the largest image, as a 128-token context
/// holds) is one item of several attention segments: its dry run decides as its real run
/// allocates, as an image step's does.
#[test]
fn a_video_step_is_sized_as_it_runs() {
    let spec = small_spec("qwen2.5-vl-3b");
    let run = |mode| {
        let scheduler = SchedulerConfig {
            max_num_batched_tokens: 128,
            max_model_len: 128,
            ..SchedulerConfig::default()
        };
        profile_scheduled(
            &spec,
            DType::F32,
            mode,
            WarmUpMode::Off,
            ProgressSink::default(),
            scheduler,
        )
    };
    let (dry, real) = (run(ProfileMode::Dry), run(ProfileMode::Real));
    assert_eq!(dry.max_item_modality, Modality::Video);
    assert_eq!(
        (dry.max_item_grid, dry.max_item_tokens, dry.items_per_batch),
        ([2, SIDE_PATCHES, SIDE_PATCHES], 128, 1)
    );
    assert_eq!(dry.peak_activation_bytes, real.peak_activation_bytes);
    assert_eq!(dry.step_outputs_bytes, real.step_outputs_bytes);
    let live = real.planned_peak_activation_bytes;
    assert!(
        dry.peak_activation_bytes >= live && dry.peak_activation_bytes as f64 <= 1.05 * live as f64,
        "arena {} against a live peak of {live}",
        dry.peak_activation_bytes
    );
}

/// A dummy video the device cannot hold is named as such, with the two settings that leave it
/// out or shrink it; nothing stays allocated; sized for images only, the same device starts.
#[test]
fn a_video_step_that_does_not_fit_names_the_video_and_the_way_out() {
    let plugin = Plugin::builtin(iris_device_cpu::plugin_root());
    let device = plugin
        .open(0, &[("capacity".into(), "96MiB".into())])
        .expect("the CPU device opens");
    let allocator = CachingAllocator::new(Arc::new(device));
    let request = |video| {
        tiny_dry_run(SchedulerConfig {
            max_num_batched_tokens: 1024,
            limit_mm_per_prompt: MmLimits {
                video,
                ..MmLimits::default()
            },
            ..SchedulerConfig::default()
        })
    };
    let err = match profile_startup(&allocator, &request(999)) {
        Ok((_, report)) => panic!("a 96 MiB device held the video step: {report:?}"),
        Err(err) => err,
    };
    let text = err.to_string();
    assert!(
        matches!(
            err,
            iris_core::profile::ProfileError::VideoDoesNotFit { tokens: 7168, .. }
        ),
        "{text}"
    );
    assert!(
        text.contains("limit_mm_per_prompt {\"video\": 0}") && text.contains("max_model_len"),
        "{text}"
    );
    assert_eq!(
        allocator.stats().allocated,
        0,
        "the failed start left blocks"
    );
    let (tower, report) = profile_startup(&allocator, &request(0)).expect("images only fit");
    assert_eq!(report.max_item_modality, Modality::Image);
    drop(tower);
}

/// A dry run of the `tiny` model in f32 under `scheduler`, without the warm-up.
fn tiny_dry_run(scheduler: SchedulerConfig) -> ProfileRequest {
    let spec = ModelSpec::preset("tiny").expect("the preset exists");
    ProfileRequest {
        weights: WeightSource::Dummy { seed: 7 },
        dtype: DType::F32,
        scheduler,
        device_memory_utilization: 0.9,
        mode: ProfileMode::Dry,
        warm_up: WarmUpMode::Off,
        progress: ProgressSink::default(),
        video: spec.default_video_processing(),
        spec,
    }
}

/// Scheduler flags of absurd size are refused with a message that names them, before the
/// step's items are listed (10^15 tokens would have been a list of 10^12 grids).
#[test]
fn a_step_beyond_what_a_step_can_hold_is_refused_naming_the_flags() {
    let allocator = allocator();
    let request = tiny_dry_run(SchedulerConfig {
        max_num_batched_tokens: 1_000_000_000_000_000,
        max_num_seqs: 1_000_000_000_000_000,
        limit_mm_per_prompt: MmLimits {
            video: 0,
            ..MmLimits::default()
        },
        ..SchedulerConfig::default()
    });
    let err = match profile_startup(&allocator, &request) {
        Ok((_, report)) => panic!("a step of 10^15 tokens was sized: {report:?}"),
        Err(err) => err,
    };
    let text = err.to_string();
    assert!(
        matches!(err, iris_core::profile::ProfileError::StepTooLarge { .. })
            && text.contains("--max-num-batched-tokens"),
        "{text}"
    );
    assert_eq!(
        allocator.stats().allocated,
        0,
        "the failed start left blocks"
    );
}
