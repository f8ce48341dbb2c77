//! A small in-memory [`Engine`] for this crate's tests only.
//!
//! It hashes the image bytes, reads dimensions from the header, and keeps a byte-accurate model
//! of a device: a caching allocator that rounds reservations up to 1 MiB blocks, an encoder cache
//! holding `tokens x HIDDEN` f32 per entry, and a processor cache of the encoded file bytes.
//! `leak_on_reset` makes `reset_allocator` keep its reserved blocks, the failure `iris bench`
//! exists to catch.

use std::collections::HashMap;
use std::io::Cursor;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};

use serde_json::{Value, json};

use iris_plugin::DType;

use super::engine_api::{
    DecodedVideo, EncodeOptions, Engine, EngineError, ImageInput, ImagePlan, ImageResult,
    ImageSize, MediaInput, MemoryGauges, MetricsSnapshot, OpenedClip, OutputLayout,
    ProcessorOverrides, ResetReport, SamplingOptions, VideoProcessing,
};

/// The fake engine's answer to a video: it models images only (the real engine's video path
/// is tested against the CPU device in `cli/tests/server.rs`).
fn no_video() -> EngineError {
    EngineError::Unsupported {
        message: "the test engine takes images only".to_owned(),
        code: "video_decoder_missing",
    }
}

fn image_of(item: &MediaInput) -> Result<&ImageInput, EngineError> {
    match item {
        MediaInput::Image(image) => Ok(image),
        MediaInput::Video(_) => Err(no_video()),
    }
}

/// Hidden size of the fake encoder outputs.
pub(crate) const HIDDEN: u64 = 8;
/// Device memory the fake runtime holds before anything is loaded.
pub(crate) const BASE_BYTES: u64 = 3 << 20;
/// Fake weights loaded at start.
pub(crate) const WEIGHTS_BYTES: u64 = 5 << 20;
const BLOCK: u64 = 1 << 20;
const TOTAL: u64 = 1 << 30;

/// A request slot of the fake engine, given back when dropped.
pub(crate) struct FakePermit(Arc<AtomicUsize>);

impl Drop for FakePermit {
    fn drop(&mut self) {
        self.0.fetch_sub(1, Ordering::SeqCst);
    }
}

#[derive(Default)]
struct State {
    processor: HashMap<String, u64>,
    encoder: HashMap<String, u64>,
    allocated: u64,
    reserved: u64,
    peak: u64,
    counters: MetricsSnapshot,
}

pub(crate) struct FakeEngine {
    state: Mutex<State>,
    sleeping: AtomicBool,
    dead: AtomicBool,
    overloaded: AtomicBool,
    /// Requests admitted and not finished (permits alive).
    admitted: Arc<AtomicUsize>,
    /// Most requests admitted at once, as `--max-queued-requests`.
    max_admitted: AtomicUsize,
    leak_on_reset: bool,
    encode_calls: AtomicU64,
    /// Whether `reserve_video` refuses (as a full token bound does).
    refuse_videos: AtomicBool,
    /// Each `reserve_video` call: item index, frames, size.
    reservations: Mutex<Vec<(usize, usize, ImageSize)>>,
    /// How long each metrics snapshot takes (a real engine's waits for the device's queue).
    snapshot_delay: Mutex<std::time::Duration>,
}

impl FakeEngine {
    pub(crate) fn new(leak_on_reset: bool) -> Self {
        let engine = Self {
            state: Mutex::new(State::default()),
            sleeping: AtomicBool::new(false),
            dead: AtomicBool::new(false),
            overloaded: AtomicBool::new(false),
            admitted: Arc::new(AtomicUsize::new(0)),
            max_admitted: AtomicUsize::new(usize::MAX),
            leak_on_reset,
            encode_calls: AtomicU64::new(0),
            refuse_videos: AtomicBool::new(false),
            reservations: Mutex::new(Vec::new()),
            snapshot_delay: Mutex::new(std::time::Duration::ZERO),
        };
        {
            let mut s = engine.state.lock().unwrap();
            s.counters.before_start = gauges(&s);
            s.allocated = WEIGHTS_BYTES;
            s.reserved = WEIGHTS_BYTES;
            s.peak = WEIGHTS_BYTES;
            s.counters.after_start = gauges(&s);
        }
        engine
    }

    /// Marks the fake engine dead, as a panic of the real engine's core does.
    pub(crate) fn kill(&self) {
        self.dead.store(true, Ordering::SeqCst);
    }

    /// Makes every metrics snapshot block its thread for `delay`.
    pub(crate) fn set_snapshot_delay(&self, delay: std::time::Duration) {
        *self.snapshot_delay.lock().unwrap() = delay;
    }

    /// Makes `reserve_video` refuse with `Overloaded` (or take again).
    pub(crate) fn set_refuse_videos(&self, refuse: bool) {
        self.refuse_videos.store(refuse, Ordering::SeqCst);
    }

    /// The `reserve_video` calls so far: item index, frames, size.
    pub(crate) fn reservations(&self) -> Vec<(usize, usize, ImageSize)> {
        self.reservations.lock().unwrap().clone()
    }

    /// Makes admission refuse (or admit again), as the real engine does beyond its bounds.
    pub(crate) fn set_overloaded(&self, overloaded: bool) {
        self.overloaded.store(overloaded, Ordering::SeqCst);
    }

    /// Bounds the requests admitted at once to `max` (`--max-queued-requests`): more are
    /// refused with `Overloaded` until a permit is dropped.
    pub(crate) fn set_max_admitted(&self, max: usize) {
        self.max_admitted.store(max, Ordering::SeqCst);
    }

    /// Requests admitted whose permit is still alive.
    pub(crate) fn admitted(&self) -> usize {
        self.admitted.load(Ordering::SeqCst)
    }

    /// Encode calls so far (each may carry several images).
    pub(crate) fn encode_calls(&self) -> u64 {
        self.encode_calls.load(Ordering::SeqCst)
    }

    fn plan_one(image: &ImageInput) -> Result<ImagePlan, EngineError> {
        let (w, h) = image::ImageReader::new(Cursor::new(&image.bytes))
            .with_guessed_format()
            .map_err(|e| EngineError::Internal(e.to_string()))?
            .into_dimensions()
            .map_err(|e| EngineError::BadInput {
                message: format!("corrupt image: {e}"),
                code: "corrupt_image",
            })?;
        let grid_thw = [1, 2 * h.div_ceil(28), 2 * w.div_ceil(28)];
        let num_tokens = u64::from(grid_thw[1]) * u64::from(grid_thw[2]) / 4;
        Ok(ImagePlan {
            grid_thw,
            num_tokens,
        })
    }

    fn encode_one(
        s: &mut State,
        image: &ImageInput,
        opts: EncodeOptions,
    ) -> Result<ImageResult, EngineError> {
        let ImagePlan {
            grid_thw,
            num_tokens,
        } = Self::plan_one(image)?;
        let mm_hash = blake3::hash(&image.bytes).to_hex()[..32].to_owned();
        let payload = u64::try_from(image.bytes.len()).unwrap();
        if s.processor.insert(mm_hash.clone(), payload).is_some() {
            s.counters.processor_cache_hits += 1;
        } else {
            s.counters.processor_cache_misses += 1;
        }
        let cached = s.encoder.contains_key(&mm_hash);
        if cached {
            s.counters.encoder_cache_hits += 1;
        } else {
            s.counters.encoder_cache_misses += 1;
            let bytes = num_tokens * HIDDEN * 4;
            s.encoder.insert(mm_hash.clone(), bytes);
            s.allocated += bytes;
            s.peak = s.peak.max(s.allocated);
            s.reserved = s.reserved.max(s.allocated.div_ceil(BLOCK) * BLOCK);
        }
        let embeddings = opts.return_embeddings.then(|| {
            let n = usize::try_from(num_tokens * HIDDEN).unwrap();
            (
                (0..n).map(|i| i as f32 * 0.5).collect(),
                [num_tokens, HIDDEN],
            )
        });
        Ok(ImageResult {
            mm_hash,
            grid_thw,
            num_tokens,
            cached,
            embeddings,
            deepstack: Vec::new(),
        })
    }

    fn reset_encoder(s: &mut State) -> ResetReport {
        let bytes: u64 = s.encoder.values().sum();
        let entries = u64::try_from(s.encoder.len()).unwrap();
        s.encoder.clear();
        s.allocated -= bytes;
        ResetReport {
            encoder_cache_bytes: bytes,
            encoder_cache_entries: entries,
            ..ResetReport::default()
        }
    }

    fn reset_processor(s: &mut State) -> ResetReport {
        let bytes = s.processor.values().sum();
        s.processor.clear();
        ResetReport {
            processor_cache_bytes: bytes,
            ..ResetReport::default()
        }
    }

    fn trim(&self, s: &mut State) -> ResetReport {
        if self.leak_on_reset {
            return ResetReport::default();
        }
        let keep = s.allocated.div_ceil(BLOCK) * BLOCK;
        let released = s.reserved - keep;
        s.reserved = keep;
        ResetReport {
            allocator_bytes: released,
            ..ResetReport::default()
        }
    }
}

fn gauges(s: &State) -> MemoryGauges {
    MemoryGauges {
        device_used_bytes: BASE_BYTES + s.reserved,
        device_total_bytes: TOTAL,
        allocator_reserved_bytes: s.reserved,
        allocator_allocated_bytes: s.allocated,
        allocator_peak_bytes: s.peak,
        encoder_cache_bytes: s.encoder.values().sum(),
        encoder_cache_entries: u64::try_from(s.encoder.len()).unwrap(),
        processor_cache_bytes: s.processor.values().sum(),
        processor_cache_entries: u64::try_from(s.processor.len()).unwrap(),
        plugin_held_bytes: 0,
    }
}

fn merge(a: ResetReport, b: ResetReport) -> ResetReport {
    ResetReport {
        processor_cache_bytes: a.processor_cache_bytes + b.processor_cache_bytes,
        encoder_cache_bytes: a.encoder_cache_bytes + b.encoder_cache_bytes,
        encoder_cache_entries: a.encoder_cache_entries + b.encoder_cache_entries,
        allocator_bytes: a.allocator_bytes + b.allocator_bytes,
        plugin_cache_bytes: a.plugin_cache_bytes + b.plugin_cache_bytes,
    }
}

impl Engine for FakeEngine {
    type Permit = FakePermit;
    type Hold = ();

    fn hold(&self, _permit: &FakePermit) {}

    fn admit(&self) -> Result<FakePermit, EngineError> {
        self.health()?;
        if self.overloaded.load(Ordering::SeqCst) {
            return Err(EngineError::Overloaded);
        }
        let max = self.max_admitted.load(Ordering::SeqCst);
        self.admitted
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| {
                (n < max).then_some(n + 1)
            })
            .map_err(|_full| EngineError::Overloaded)?;
        Ok(FakePermit(Arc::clone(&self.admitted)))
    }

    fn health(&self) -> Result<(), EngineError> {
        if self.dead.load(Ordering::SeqCst) {
            return Err(EngineError::Dead("the fake engine was killed".to_owned()));
        }
        Ok(())
    }

    async fn encode(
        &self,
        _permit: FakePermit,
        items: Vec<MediaInput>,
        opts: EncodeOptions,
    ) -> Result<Vec<ImageResult>, EngineError> {
        if self.is_sleeping() {
            return Err(EngineError::Sleeping);
        }
        self.encode_calls.fetch_add(1, Ordering::SeqCst);
        // A pause like a real step's, so that concurrent requests overlap in tests.
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        let mut s = self.state.lock().unwrap();
        items
            .iter()
            .map(|item| Self::encode_one(&mut s, image_of(item)?, opts))
            .collect()
    }

    async fn plan(
        &self,
        _permit: &mut FakePermit,
        items: &[MediaInput],
        _overrides: &ProcessorOverrides,
    ) -> Result<Vec<ImagePlan>, EngineError> {
        items
            .iter()
            .map(|item| Self::plan_one(image_of(item)?))
            .collect()
    }

    async fn open_video(
        &self,
        _bytes: Vec<u8>,
        _sampling: SamplingOptions,
    ) -> Result<OpenedClip, EngineError> {
        Err(no_video())
    }

    fn reserve_video(
        &self,
        _permit: &mut FakePermit,
        index: usize,
        frames: usize,
        size: ImageSize,
        _overrides: &ProcessorOverrides,
    ) -> Result<(), EngineError> {
        self.reservations
            .lock()
            .unwrap()
            .push((index, frames, size));
        if self.refuse_videos.load(Ordering::SeqCst) {
            return Err(EngineError::Overloaded);
        }
        Ok(())
    }

    async fn decode_video(&self, _clip: OpenedClip, (): ()) -> Result<DecodedVideo, EngineError> {
        Err(no_video())
    }

    fn video_processing(&self) -> VideoProcessing {
        iris_core::model::ModelSpec::preset("tiny")
            .expect("the tiny preset exists")
            .default_video_processing()
    }

    fn output_layout(&self) -> OutputLayout {
        OutputLayout {
            hidden: HIDDEN,
            deepstack_levels: 0,
            dtype: DType::F32,
        }
    }

    async fn reset_mm_cache(&self) -> Result<ResetReport, EngineError> {
        Ok(Self::reset_processor(&mut self.state.lock().unwrap()))
    }

    async fn reset_encoder_cache(&self) -> Result<ResetReport, EngineError> {
        Ok(Self::reset_encoder(&mut self.state.lock().unwrap()))
    }

    async fn reset_allocator(&self) -> Result<ResetReport, EngineError> {
        Ok(self.trim(&mut self.state.lock().unwrap()))
    }

    async fn reset_all(&self) -> Result<ResetReport, EngineError> {
        let mut s = self.state.lock().unwrap();
        let a = Self::reset_processor(&mut s);
        let b = Self::reset_encoder(&mut s);
        let c = self.trim(&mut s);
        Ok(merge(merge(a, b), c))
    }

    async fn sleep(&self, level: u8) -> Result<ResetReport, EngineError> {
        if !(1..=2).contains(&level) {
            return Err(EngineError::BadInput {
                message: format!("level {level}"),
                code: "invalid_sleep_level",
            });
        }
        let report = self.reset_all().await?;
        self.sleeping.store(true, Ordering::SeqCst);
        Ok(report)
    }

    async fn wake_up(&self) -> Result<(), EngineError> {
        self.sleeping.store(false, Ordering::SeqCst);
        Ok(())
    }

    fn is_sleeping(&self) -> bool {
        self.sleeping.load(Ordering::SeqCst)
    }

    fn memory(&self) -> Value {
        let g = gauges(&self.state.lock().unwrap());
        json!({ "device": { "used_bytes": g.device_used_bytes, "total_bytes": g.device_total_bytes } })
    }

    fn server_info(&self) -> Value {
        json!({ "model": "fake", "hidden_size": HIDDEN })
    }

    fn metrics_snapshot(&self) -> MetricsSnapshot {
        let delay = *self.snapshot_delay.lock().unwrap();
        std::thread::sleep(delay);
        let s = self.state.lock().unwrap();
        MetricsSnapshot {
            memory: gauges(&s),
            ..s.counters
        }
    }
}
