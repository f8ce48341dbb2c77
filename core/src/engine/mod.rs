//! The engine: requests in through an async handle, one engine-core thread running steps on
//! the device, embeddings out to each request's consumer.
//!
//! ```text
//!  Engine::encode (async, any tokio thread)
//!    │ decode + item hash + processor cache + resize/normalise  (tokio blocking pool)
//!    ▼
//!  Command::Add ──► engine-core thread (owns device, tower, scheduler + encoder cache manager,
//!                   device encoder cache)
//!                     step: schedule → encode new items (one batched tower call) → store →
//!                           gather positions into the step buffer + mask → deliver
//!    ◄── Event::Chunk … Event::Finished (per request, unbounded channel)
//! ```
//!
//! - **Start-up** ([`Engine::start`]) is [`profile_startup`]: snapshot, weights, sizing a step
//!   of the largest item times the most items per batch (a dry run by default, a measured run
//!   with [`ProfileMode::Real`]), and the refusal, with the numbers, when the
//!   device has less free memory than `device_memory_utilization` asks for. Its before- and
//!   after-start snapshots are the baselines the resets are measured against.
//! - **Resets** each report what they released: [`Engine::reset_mm_cache`] (processor cache),
//!   [`Engine::reset_encoder_cache`] (manager and device buffers together, between steps: an
//!   in-flight request re-encodes what it still needs), [`Engine::reset_allocator`] (returns the
//!   caching allocator's unused blocks), [`Engine::reset_all`] (the three in order).
//! - **Sleep**: level 1 copies the weights to the host, level 2 discards them; both reset the
//!   caches and empty the allocator, so device use falls to the pre-start figure.
//!   [`Engine::wake_up`] uploads the host copy (level 1) or reloads from the weight source
//!   (level 2). While asleep, new requests are refused with [`EngineError::Sleeping`] (HTTP
//!   503); requests admitted before the sleep wait and finish after the wake-up.
//! - **Abort**: dropping the future of [`Engine::encode`] (a client that hung up) aborts its
//!   request, which releases its cache references.
//! - **Backpressure** ([`admission`]): requests and embedding tokens between admission and the
//!   end of a request are bounded; beyond the bounds [`Engine::admit`] and [`Engine::encode`]
//!   refuse with [`EngineError::Overloaded`] before any image is decoded.
//! - **Liveness** ([`liveness`]): the engine-core thread runs under a panic guard; a panic
//!   fails the requests in flight and marks the engine dead ([`Engine::health`]), after which
//!   every call is refused with [`EngineError::Dead`].

pub mod admission;
pub mod api;
pub mod liveness;
pub mod prompt;
mod worker;

use std::sync::atomic::{AtomicU8, AtomicU64, Ordering};
use std::sync::mpsc as std_mpsc;
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;

use iris_plugin::{DType, Device};
use serde_json::{Value, json};
use tokio::sync::{mpsc, oneshot};

use crate::budget::{
    BudgetError, BudgetPolicy, EncoderBudget, Modality, ModalityLimits, SchedulerConfig,
};
use crate::cache::encoder::EncoderCacheManager;
use crate::cache::processor::ProcessorCache;
use crate::encoder::exec::Runner;
use crate::memory::{CachingAllocator, MemorySnapshot};
use crate::model::{ModelSpec, VideoProcessing, WeightSource};
use crate::preprocess::video::ffmpeg::{DecodedVideo, Ffmpeg, OpenedClip, VideoLimits, open_clip};
use crate::preprocess::video::{
    SamplingOptions, VideoError, preprocess_frames, video_hash, video_shape,
};
use crate::preprocess::{
    AlphaMode, DecodeLimits, ImageSize, PreprocessError, PreprocessedImage, ProcessorConfig,
    decode_rgb, item_hash, preprocess_rgb,
};
use crate::profile::{
    ProfileError, ProfileMode, ProfileRequest, ProgressSink, StartupProfile, WarmUpMode,
    profile_startup,
};
use crate::scheduler::Scheduler;
use admission::{Admission, AdmissionConfig, Permit, PermitHold, estimate_tokens};
use api::{
    EncodeOptions, EngineError, ImagePlan, ImageResult, MediaInput, MemoryGauges, MetricsSnapshot,
    OutputLayout, ProcessorOverrides, ResetReport, VideoInput,
};
use liveness::{Liveness, run_guarded};
use prompt::{Assembly, Event, PromptLayout};
use worker::{AddRequest, Command, Worker};

/// vLLM's default `mm_processor_cache_gb` (4 GiB), in bytes.
pub const DEFAULT_PROCESSOR_CACHE_BYTES: u64 = 4 << 30;

/// Everything the engine is started with.
#[derive(Debug, Clone)]
pub struct EngineConfig {
    /// The model (vision tower and processor settings).
    pub spec: ModelSpec,
    /// Where the weights come from (also what a level-2 wake-up reloads).
    pub weights: WeightSource,
    /// Run dtype.
    pub dtype: DType,
    /// Token budgets, running requests and encoder cache size.
    pub scheduler: SchedulerConfig,
    /// Share of the device's total memory iris may use, in `(0, 1]`.
    pub device_memory_utilization: f64,
    /// How start-up sizes the largest step (a dry run by default).
    pub profile_mode: ProfileMode,
    /// Whether start-up runs the tower at a ladder of step sizes (by default when the device
    /// asks for it).
    pub warm_up: WarmUpMode,
    /// Where start-up reports its progress (nowhere by default).
    pub progress: ProgressSink,
    /// Bound of the processor cache in bytes of preprocessed payload (0 disables it).
    pub processor_cache_bytes: u64,
    /// Decoder limits (a second line of defence behind the server's header check).
    pub decode_limits: DecodeLimits,
    /// How videos are sampled and processed: the family's defaults, or the model directory's
    /// `video_preprocessor_config.json` ([`ModelSpec::video_processing`]).
    pub video: VideoProcessing,
    /// Limits on what one video may decode to (vLLM's).
    pub video_limits: VideoLimits,
    /// Backpressure bounds (defaults derived from the scheduler's budget).
    pub admission: AdmissionConfig,
    /// Fault injection for tests and drills: the engine-core thread panics at the start of
    /// this step (1-based). See [`liveness::PANIC_AT_STEP_ENV`].
    pub panic_at_step: Option<u64>,
}

impl EngineConfig {
    /// A configuration with the defaults for everything but the model and its weights.
    pub fn new(spec: ModelSpec, weights: WeightSource) -> EngineConfig {
        EngineConfig {
            video: spec.default_video_processing(),
            video_limits: VideoLimits::default(),
            spec,
            weights,
            dtype: DType::F32,
            scheduler: SchedulerConfig::default(),
            device_memory_utilization: crate::profile::DEFAULT_DEVICE_MEMORY_UTILIZATION,
            profile_mode: ProfileMode::default(),
            warm_up: WarmUpMode::default(),
            progress: ProgressSink::default(),
            processor_cache_bytes: DEFAULT_PROCESSOR_CACHE_BYTES,
            decode_limits: DecodeLimits::default(),
            admission: AdmissionConfig::default(),
            panic_at_step: None,
        }
    }
}

/// Why the engine did not start.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum StartError {
    /// Start-up profiling refused or failed (not enough free memory, bad weights, ...).
    #[error(transparent)]
    Profile(#[from] ProfileError),
    /// The encoder budget or scheduler could not be built from the configuration.
    #[error("scheduler: {0}")]
    Scheduler(String),
    /// The engine-core thread could not be started or died during start-up.
    #[error("engine-core thread: {0}")]
    Thread(String),
}

/// State the handle and the engine-core thread share. The engine core is the only writer of
/// the encoder figures; the handle reads them without a round trip.
pub(crate) struct Shared {
    allocator: Arc<CachingAllocator>,
    processor: Mutex<ProcessorCache<Arc<PreprocessedImage>>>,
    /// The FFmpeg programs, found on the first video (image-only use never looks for them).
    ffmpeg: Mutex<Option<Ffmpeg>>,
    /// 0 awake, else the sleep level.
    sleep_level: AtomicU8,
    encoder_hits: AtomicU64,
    encoder_misses: AtomicU64,
    encoder_evictions: AtomicU64,
    faults: worker::FaultCounters,
    steps: AtomicU64,
    step_time_ns: AtomicU64,
    encoder_time_ns: AtomicU64,
    encoder_flops: AtomicU64,
    encoder_cache_bytes: AtomicU64,
    encoder_cache_entries: AtomicU64,
    encoder_cache_capacity_tokens: AtomicU64,
    encoder_cache_free_tokens: AtomicU64,
    in_flight: AtomicU64,
    admission: Arc<Admission>,
    liveness: Arc<Liveness>,
    panic_at_step: Option<u64>,
}

impl Shared {
    /// The processor cache's entry for `hash`.
    fn cached(&self, hash: &str) -> Option<Arc<PreprocessedImage>> {
        self.processor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .get(hash)
            .cloned()
    }

    /// Puts `item` into the processor cache under `hash`, sized by its pixel values.
    fn remember(&self, hash: String, item: PreprocessedImage) -> Arc<PreprocessedImage> {
        let item = Arc::new(item);
        let bytes = item.pixel_values.len() as u64 * 4;
        self.processor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .insert_sized(hash, Arc::clone(&item), bytes);
        item
    }

    /// Called by the engine core at the start of every step: the fault-injection point of
    /// [`EngineConfig::panic_at_step`].
    pub(crate) fn before_step(&self) {
        if let Some(step) = self.panic_at_step
            && self.steps.load(Ordering::Relaxed) + 1 == step
        {
            panic!("injected fault: {}={step}", liveness::PANIC_AT_STEP_ENV);
        }
    }

    fn processor_stats(&self) -> crate::cache::processor::ProcessorCacheStats {
        self.processor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .stats()
    }
}

/// The engine handle. Cheap to share behind an `Arc`; dropping the last handle stops the
/// engine-core thread, which releases every device buffer it holds.
pub struct Engine {
    shared: Arc<Shared>,
    commands: Mutex<Option<std_mpsc::Sender<Command>>>,
    thread: Mutex<Option<JoinHandle<()>>>,
    next_key: AtomicU64,
    config: EngineConfig,
    processor: ProcessorConfig,
    startup: StartupProfile,
    device_name: String,
    /// The device's dense FLOP/s at the engine's dtype, as its `peak_flops` property says.
    peak_flops: Option<u64>,
    plugin_name: String,
    out_hidden: usize,
    deepstack_levels: usize,
    /// The scheduler's budget (a copy): items it could never schedule are refused before
    /// they are preprocessed.
    budget: EncoderBudget,
}

/// Aborts a request when its consumer is dropped before the request finished.
struct AbortOnDrop<'a> {
    engine: &'a Engine,
    key: u64,
    armed: bool,
}

impl Drop for AbortOnDrop<'_> {
    fn drop(&mut self) {
        if self.armed {
            self.engine.send(Command::Abort(self.key));
        }
    }
}

impl Engine {
    /// Starts the engine on `device`: profiles start-up (loading the weights), builds the
    /// scheduler from the measured largest item, and starts the engine-core thread.
    ///
    /// # Errors
    /// [`StartError`] with the numbers when memory is short, or what failed.
    pub fn start(config: EngineConfig, device: Device) -> Result<Engine, StartError> {
        // Settings that need no model are refused before weights load or the device is used.
        config
            .scheduler
            .check()
            .map_err(|e| StartError::Scheduler(e.to_string()))?;
        let description = device.description();
        let device_name = description.name.to_string();
        let dtype_name = config.dtype.to_string();
        let peak_flops = description
            .properties
            .iter()
            .find(|(key, _)| key == iris_plugin::abi::property::PEAK_FLOPS)
            .and_then(|(_, value)| iris_plugin::abi::property::peak_flops(value, &dtype_name))
            // `peak_flops` gave a positive finite figure; `as` saturates past u64's range.
            .map(|flops| {
                #[allow(clippy::cast_possible_truncation, clippy::cast_sign_loss)]
                let whole = flops.round() as u64;
                whole
            });
        let plugin_name = device.plugin().name().to_owned();
        let allocator = CachingAllocator::new(Arc::new(device));
        let shared = Arc::new(Shared {
            allocator: Arc::clone(&allocator),
            processor: Mutex::new(ProcessorCache::new(config.processor_cache_bytes)),
            ffmpeg: Mutex::new(None),
            sleep_level: AtomicU8::new(0),
            encoder_hits: AtomicU64::new(0),
            encoder_misses: AtomicU64::new(0),
            encoder_evictions: AtomicU64::new(0),
            faults: worker::FaultCounters::default(),
            steps: AtomicU64::new(0),
            step_time_ns: AtomicU64::new(0),
            encoder_time_ns: AtomicU64::new(0),
            encoder_flops: AtomicU64::new(0),
            encoder_cache_bytes: AtomicU64::new(0),
            encoder_cache_entries: AtomicU64::new(0),
            encoder_cache_capacity_tokens: AtomicU64::new(0),
            encoder_cache_free_tokens: AtomicU64::new(0),
            in_flight: AtomicU64::new(0),
            admission: Admission::new(config.admission.limits(&config.scheduler)),
            liveness: Arc::new(Liveness::default()),
            panic_at_step: config.panic_at_step,
        });
        let (commands, receiver) = std_mpsc::channel::<Command>();
        // The start-up report, and the scheduler's budget for the engine's own item check.
        let (ready_tx, ready_rx) =
            std_mpsc::channel::<Result<(StartupProfile, EncoderBudget), StartError>>();
        let thread_shared = Arc::clone(&shared);
        let after_death = Arc::clone(&shared);
        let thread_config = config.clone();
        let liveness = Arc::clone(&shared.liveness);
        let thread = std::thread::Builder::new()
            .name("iris-engine-core".to_owned())
            .spawn(move || {
                // The device, the tower and every cache live and die on this thread; a panic
                // (during start-up or later) is contained here and marks the engine dead.
                run_guarded(liveness, move || {
                    match start_worker(thread_shared, &thread_config) {
                        Ok((worker, ready)) => {
                            if ready_tx.send(Ok(ready)).is_ok() {
                                worker.run(&receiver);
                            }
                        }
                        Err(err) => {
                            let _ = ready_tx.send(Err(err));
                        }
                    }
                });
                if after_death.liveness.dead_reason().is_some() {
                    give_back_after_death(&after_death);
                }
            })
            .map_err(|e| StartError::Thread(e.to_string()))?;
        let (startup, budget) = match ready_rx.recv() {
            Ok(Ok(ready)) => ready,
            Ok(Err(err)) => {
                let _ = thread.join();
                return Err(err);
            }
            Err(_) => {
                let _ = thread.join();
                return Err(StartError::Thread("it stopped during start-up".to_owned()));
            }
        };
        Ok(Engine {
            budget,
            shared,
            commands: Mutex::new(Some(commands)),
            thread: Mutex::new(Some(thread)),
            next_key: AtomicU64::new(0),
            processor: config.spec.processor.clone(),
            out_hidden: config.spec.vision.out_hidden,
            deepstack_levels: config.spec.vision.deepstack_visual_indexes.len(),
            config,
            startup,
            device_name,
            peak_flops,
            plugin_name,
        })
    }

    /// The start-up report.
    pub fn startup(&self) -> &StartupProfile {
        &self.startup
    }

    /// The configuration the engine runs with.
    pub fn config(&self) -> &EngineConfig {
        &self.config
    }

    fn send(&self, command: Command) -> bool {
        let guard = self.commands.lock().unwrap_or_else(PoisonError::into_inner);
        guard.as_ref().is_some_and(|tx| tx.send(command).is_ok())
    }

    async fn ask<T>(
        &self,
        make: impl FnOnce(oneshot::Sender<T>) -> Command,
    ) -> Result<T, EngineError> {
        let (tx, rx) = oneshot::channel();
        if !self.send(make(tx)) {
            return Err(self.stopped());
        }
        rx.await.map_err(|_| self.stopped())
    }

    /// Why the engine core is gone: dead (it panicked) or shut down.
    fn stopped(&self) -> EngineError {
        self.shared.liveness.check().err().unwrap_or_else(stopped)
    }

    /// Whether the engine can serve: `Err(Dead)` once the engine-core thread panicked,
    /// `Err(DeviceLost)` when the device does not answer a memory query.
    ///
    /// # Errors
    /// [`EngineError::Dead`] or [`EngineError::DeviceLost`], with the reason.
    pub fn health(&self) -> Result<(), EngineError> {
        self.shared.liveness.check()?;
        self.shared
            .allocator
            .device()
            .mem_info()
            .map(|_| ())
            .map_err(|err| EngineError::DeviceLost(err.to_string()))
    }

    /// Takes a request slot under the backpressure bounds, before the request's body is even
    /// read; [`Engine::encode_admitted`] then charges its tokens.
    ///
    /// # Errors
    /// [`EngineError::Overloaded`] beyond the request bound, [`EngineError::Dead`] once the
    /// engine died, [`EngineError::Sleeping`] while asleep.
    pub fn admit(&self) -> Result<Permit, EngineError> {
        self.shared.liveness.check()?;
        if self.is_sleeping() {
            return Err(EngineError::Sleeping);
        }
        self.shared.admission.admit()
    }

    /// Encodes one request's items (images, or [`MediaInput`]s mixing images and videos); one
    /// result per item, in order. Takes its own request slot: [`Engine::admit`] then
    /// [`Engine::encode_admitted`].
    ///
    /// # Errors
    /// Those of [`Engine::admit`] and [`Engine::encode_admitted`].
    pub async fn encode<I: Into<MediaInput>>(
        &self,
        items: Vec<I>,
        options: EncodeOptions,
    ) -> Result<Vec<ImageResult>, EngineError> {
        let permit = self.admit()?;
        self.encode_admitted(permit, items, options).await
    }

    /// Encodes one admitted request's items; one result per item, in order. The request's
    /// tokens, estimated from the image headers and the videos' frame counts and sizes, are
    /// charged to `permit` before anything is resized; the permit is given back when the
    /// request ends (or its future is dropped).
    ///
    /// # Errors
    /// [`EngineError::BadInput`] for an item that cannot be decoded or preprocessed (naming
    /// it), [`EngineError::Overloaded`] beyond the token bound, [`EngineError::Sleeping`] while
    /// asleep, [`EngineError::Dead`] once the engine died, [`EngineError::Internal`] for a
    /// fault.
    pub async fn encode_admitted<I: Into<MediaInput>>(
        &self,
        mut permit: Permit,
        items: Vec<I>,
        options: EncodeOptions,
    ) -> Result<Vec<ImageResult>, EngineError> {
        let items: Vec<MediaInput> = items.into_iter().map(Into::into).collect();
        if items.is_empty() {
            return Err(EngineError::BadInput {
                message: "the request has no images or videos".to_owned(),
                code: "no_images",
            });
        }
        self.shared.liveness.check()?;
        if self.is_sleeping() {
            return Err(EngineError::Sleeping);
        }
        self.check_counts(&items)?;
        let processor = self.processor_for(&options.processor, &items)?;
        let video = self.video_for(&options.processor, &items)?;
        self.charge(&mut permit, &items, &processor, &video)?;
        let prepared = self.prepare_all(&permit, items, processor, video).await?;

        // Sleep may have been asked while the images were being preprocessed.
        if self.is_sleeping() {
            return Err(EngineError::Sleeping);
        }
        let layout = PromptLayout::new(prepared.iter().map(|p| u64::from(p.tokens)));
        let key = self.next_key.fetch_add(1, Ordering::Relaxed);
        let (events, mut receiver) = mpsc::unbounded_channel();
        let mut assembly = Assembly::new(
            layout.clone(),
            prepared.clone(),
            self.out_hidden,
            self.deepstack_levels,
            options.return_embeddings,
        );
        let request = AddRequest {
            key,
            images: prepared,
            layout,
            return_embeddings: options.return_embeddings,
            events,
            hold: permit.hold(),
        };
        if !self.send(Command::Add(Box::new(request))) {
            return Err(self.stopped());
        }
        let mut guard = AbortOnDrop {
            engine: self,
            key,
            armed: true,
        };
        while let Some(event) = receiver.recv().await {
            match event {
                Event::Chunk(chunk) => {
                    // On a bad chunk the guard aborts the request.
                    assembly.push(chunk)?;
                }
                Event::Finished { encoded } => {
                    guard.armed = false;
                    return assembly.finish(&encoded);
                }
                Event::Failed(err) => {
                    guard.armed = false;
                    return Err(err);
                }
            }
        }
        guard.armed = false;
        drop(permit);
        // The engine core dropped the request without a word: it died (a 500 for this
        // request, which was in flight) or shut down.
        Err(match self.shared.liveness.dead_reason() {
            Some(reason) => EngineError::Internal(format!("the engine core panicked: {reason}")),
            None => stopped(),
        })
    }

    /// Preprocesses `items` under the request's processor settings and reports each one's
    /// grid and tokens, without encoding, in a request slot of its own: [`Engine::admit`] then
    /// [`Engine::plan_admitted`].
    ///
    /// # Errors
    /// Those of [`Engine::admit`] and [`Engine::plan_admitted`].
    pub async fn plan<I: Clone + Into<MediaInput>>(
        &self,
        items: &[I],
        overrides: &ProcessorOverrides,
    ) -> Result<Vec<ImagePlan>, EngineError> {
        let mut permit = self.admit()?;
        self.plan_admitted(&mut permit, items, overrides).await
    }

    /// Preprocesses an admitted request's `items` under its processor settings and reports
    /// each one's grid and tokens, without encoding. The request's tokens are charged to
    /// `permit` first, as [`Engine::encode_admitted`] charges them (which, given the same
    /// permit and items next, charges nothing more). The preprocessed items go into the
    /// processor cache, so that encode does not process them again.
    ///
    /// # Errors
    /// [`EngineError::BadInput`] for an item that cannot be decoded or preprocessed, that the
    /// scheduler's budget could never take, or processor settings the engine cannot honour;
    /// [`EngineError::Overloaded`] beyond the token bound; [`EngineError::Internal`] for a
    /// fault.
    pub async fn plan_admitted<I: Clone + Into<MediaInput>>(
        &self,
        permit: &mut Permit,
        items: &[I],
        overrides: &ProcessorOverrides,
    ) -> Result<Vec<ImagePlan>, EngineError> {
        let items: Vec<MediaInput> = items.iter().cloned().map(Into::into).collect();
        self.check_counts(&items)?;
        let processor = self.processor_for(overrides, &items)?;
        let video = self.video_for(overrides, &items)?;
        self.charge(permit, &items, &processor, &video)?;
        let prepared = self.prepare_all(permit, items, processor, video).await?;
        Ok(prepared
            .iter()
            .map(|image| ImagePlan {
                grid_thw: image.grid_thw,
                num_tokens: u64::from(image.tokens),
            })
            .collect())
    }

    /// The shape and dtype of the engine's outputs.
    #[must_use]
    pub fn output_layout(&self) -> OutputLayout {
        OutputLayout {
            hidden: self.out_hidden as u64,
            deepstack_levels: self.deepstack_levels as u64,
            dtype: self.config.dtype,
        }
    }

    /// The image processor settings of a request with `items`: the model's, with the request's
    /// overrides checked and applied when it has an image (a video-only request's overrides
    /// are the video processor's, checked by [`Self::video_for`]).
    fn processor_for(
        &self,
        overrides: &ProcessorOverrides,
        items: &[MediaInput],
    ) -> Result<ProcessorConfig, EngineError> {
        let mut processor = self.processor.clone();
        let has_image = items.iter().any(|i| matches!(i, MediaInput::Image(_)));
        if overrides.is_empty() || !has_image {
            return Ok(processor);
        }
        let bad = |message: String| EngineError::BadInput {
            message,
            code: "invalid_mm_processor_kwargs",
        };
        if let Some(max_pixels) = overrides.max_pixels {
            if max_pixels > self.processor.max_pixels {
                return Err(bad(format!(
                    "mm_processor_kwargs.max_pixels {max_pixels} is above the model's max_pixels {}, for which the engine's budgets were sized",
                    self.processor.max_pixels
                )));
            }
            processor.max_pixels = max_pixels;
        }
        if let Some(min_pixels) = overrides.min_pixels {
            processor.min_pixels = min_pixels;
        }
        if let Some(background) = overrides.background {
            processor.alpha = AlphaMode::PasteOn(background);
        }
        if processor.min_pixels > processor.max_pixels {
            return Err(bad(format!(
                "mm_processor_kwargs: min_pixels {} is above max_pixels {}",
                processor.min_pixels, processor.max_pixels
            )));
        }
        processor
            .validate()
            .map_err(|err| bad(format!("mm_processor_kwargs: {err}")))?;
        Ok(processor)
    }

    /// Charges a request's embedding tokens to `permit`, estimated from each image's header
    /// and each video's frame count and size, before any pixel is resized; what the permit
    /// already holds (a plan of the same items) is not charged again. An item the scheduler's
    /// budget could never take is refused here, in the scheduler's words, rather than after
    /// preprocessing it: a clip whose frames a request's `min_pixels` scales up could
    /// otherwise ask for hundreds of gigabytes of pixels first.
    fn charge(
        &self,
        permit: &mut Permit,
        items: &[MediaInput],
        processor: &ProcessorConfig,
        video: &VideoProcessing,
    ) -> Result<(), EngineError> {
        let mut total = 0u64;
        for (index, item) in items.iter().enumerate() {
            let (modality, tokens) = match item {
                MediaInput::Image(image) => (
                    Modality::Image,
                    estimate_tokens(&image.bytes, &self.config.decode_limits, processor),
                ),
                MediaInput::Video(input) => (
                    Modality::Video,
                    input.video.frames.first().map_or(0, |first| {
                        video_tokens(input.video.frames.len(), first.size, video)
                    }),
                ),
            };
            self.budget
                .check_item(modality, tokens, tokens)
                .map_err(|source| over_budget(index, modality, source))?;
            total = total.saturating_add(tokens);
        }
        let more = total.saturating_sub(permit.charged());
        self.shared.admission.charge(permit, more)
    }

    /// Refuses a request with more items of a modality than `--limit-mm-per-prompt` allows
    /// (none, for a modality at 0), as vLLM refuses such a prompt.
    fn check_counts(&self, items: &[MediaInput]) -> Result<(), EngineError> {
        let limits = &self.config.scheduler.limit_mm_per_prompt;
        let videos = items
            .iter()
            .filter(|i| matches!(i, MediaInput::Video(_)))
            .count() as u64;
        let images = items.len() as u64 - videos;
        limits
            .check(images, videos)
            .map_err(|message| EngineError::BadInput {
                message,
                code: "mm_limit_exceeded",
            })
    }

    /// The most images and videos one request may carry (`--limit-mm-per-prompt`): a server
    /// checks them before it reads any media, as vLLM counts a prompt's items while it parses
    /// the message.
    #[must_use]
    pub fn mm_limits(&self) -> crate::budget::MmLimits {
        self.config.scheduler.limit_mm_per_prompt
    }

    /// The video processing of a request with `items`: the engine's, with the request's
    /// `min_pixels`/`max_pixels`. vLLM routes flat `mm_processor_kwargs` to the image and the
    /// video processor alike, and both Qwen video processors take them as their `size` edges:
    /// Qwen2/2.5-VL bound each frame, Qwen3-VL all frames together (its resize rule). A
    /// `max_pixels` above the model's video setting is refused, as for images: the engine's
    /// budgets were sized for it.
    fn video_for(
        &self,
        overrides: &ProcessorOverrides,
        items: &[MediaInput],
    ) -> Result<VideoProcessing, EngineError> {
        let has_video = items.iter().any(|i| matches!(i, MediaInput::Video(_)));
        if !has_video {
            return Ok(self.config.video.clone());
        }
        self.video_with(overrides)
    }

    /// The model's video processing under a request's `mm_processor_kwargs` pixel bounds.
    fn video_with(&self, overrides: &ProcessorOverrides) -> Result<VideoProcessing, EngineError> {
        let mut video = self.config.video.clone();
        let bad = |message: String| EngineError::BadInput {
            message,
            code: "invalid_mm_processor_kwargs",
        };
        if let Some(max_pixels) = overrides.max_pixels {
            if max_pixels > self.config.video.config.max_pixels {
                return Err(bad(format!(
                    "mm_processor_kwargs.max_pixels {max_pixels} is above the model's video max_pixels {}, for which the engine's budgets were sized",
                    self.config.video.config.max_pixels
                )));
            }
            video.config.max_pixels = max_pixels;
        }
        if let Some(min_pixels) = overrides.min_pixels {
            video.config.min_pixels = min_pixels;
        }
        if video.config.min_pixels > video.config.max_pixels {
            return Err(bad(format!(
                "mm_processor_kwargs: the video min_pixels {} is above its max_pixels {}",
                video.config.min_pixels, video.config.max_pixels
            )));
        }
        Ok(video)
    }

    /// The model's video processing: its loader (which frames are read), resize rule and
    /// processor settings.
    #[must_use]
    pub fn video_processing(&self) -> &VideoProcessing {
        &self.config.video
    }

    /// Probes `bytes` (a clip in any container FFmpeg reads) and samples its frames as the
    /// model's loader does under `sampling`, without decoding them, on the blocking pool: the
    /// first half of [`Engine::load_video`], so that [`Engine::reserve_video`] can charge the
    /// clip's tokens before [`Engine::decode_video`] decodes a pixel.
    ///
    /// # Errors
    /// As [`Engine::load_video`].
    pub async fn open_video(
        &self,
        bytes: Vec<u8>,
        sampling: SamplingOptions,
    ) -> Result<OpenedClip, EngineError> {
        self.shared.liveness.check()?;
        let shared = Arc::clone(&self.shared);
        let loader = self.config.video.loader;
        let options = SamplingOptions {
            temporal_patch_size: self.config.video.config.temporal_patch_size,
            ..sampling
        };
        let limits = self.config.video_limits;
        tokio::task::spawn_blocking(move || {
            let ffmpeg = locate_ffmpeg(&shared)?;
            open_clip(&ffmpeg, &bytes, loader, &options, &limits).map_err(video_error)
        })
        .await
        .map_err(|e| EngineError::Internal(format!("video probing task failed: {e}")))?
    }

    /// Charges to `permit` the tokens of a video of `frames` frames of `size` (item `index`
    /// of its request) under the request's `overrides`, before its frames are decoded: a
    /// request's decoded frames are then bounded by the admission's token bound as its
    /// preprocessing is, and a video no step could take is refused before decoding. The
    /// encode of the decoded video charges only what its frames add beyond this.
    ///
    /// # Errors
    /// [`EngineError::BadInput`] (`video_over_budget`) for a video beyond the scheduler's
    /// budget, or bad `overrides`; [`EngineError::Overloaded`] beyond the token bound.
    pub fn reserve_video(
        &self,
        permit: &mut Permit,
        index: usize,
        frames: usize,
        size: ImageSize,
        overrides: &ProcessorOverrides,
    ) -> Result<(), EngineError> {
        let tokens = video_tokens(frames, size, &self.video_with(overrides)?);
        self.budget
            .check_item(Modality::Video, tokens, tokens)
            .map_err(|source| over_budget(index, Modality::Video, source))?;
        self.shared.admission.charge(permit, tokens)
    }

    /// Reads an opened clip's sampled frames on the blocking pool: the second half of
    /// [`Engine::load_video`]. `hold` (of the request's permit, charged by
    /// [`Engine::reserve_video`]) goes with the decoding, so that a request whose client hangs
    /// up keeps its frames counted until FFmpeg is done.
    ///
    /// # Errors
    /// As [`Engine::load_video`].
    pub async fn decode_video(
        &self,
        clip: OpenedClip,
        hold: Option<PermitHold>,
    ) -> Result<DecodedVideo, EngineError> {
        self.shared.liveness.check()?;
        let shared = Arc::clone(&self.shared);
        let limits = self.config.video_limits;
        tokio::task::spawn_blocking(move || {
            let _hold = hold;
            let ffmpeg = locate_ffmpeg(&shared)?;
            clip.decode(&ffmpeg, &limits).map_err(video_error)
        })
        .await
        .map_err(|e| EngineError::Internal(format!("video decoding task failed: {e}")))?
    }

    /// Decodes `bytes` (a clip in any container FFmpeg reads) and reads the frames the model's
    /// loader samples under `sampling` (its `temporal_patch_size` is the model's, whatever is
    /// passed), with vLLM's metadata, on the blocking pool. FFmpeg is looked for on the first
    /// video.
    ///
    /// # Errors
    /// [`EngineError::Unsupported`] when FFmpeg is not installed, saying how to install it;
    /// [`EngineError::BadInput`] for a clip that cannot be decoded or sampled, or decodes past
    /// the limits; [`EngineError::Dead`] once the engine died.
    pub async fn load_video(
        &self,
        bytes: Vec<u8>,
        sampling: SamplingOptions,
    ) -> Result<DecodedVideo, EngineError> {
        let clip = self.open_video(bytes, sampling).await?;
        self.decode_video(clip, None).await
    }

    /// Decodes and preprocesses `items` on the blocking pool, through the processor cache, with
    /// the request's image `processor` and `video` processing.
    ///
    /// A hold of the request's `permit` goes with the blocking task: a request whose client
    /// hangs up drops its future, not the task, and the task's pixels stay counted against the
    /// admission's bounds until it ends (they were released at once before, so hung-up
    /// requests could keep any number of tasks decoding and resizing).
    async fn prepare_all(
        &self,
        permit: &Permit,
        items: Vec<MediaInput>,
        processor: ProcessorConfig,
        video: VideoProcessing,
    ) -> Result<Vec<Arc<PreprocessedImage>>, EngineError> {
        let shared = Arc::clone(&self.shared);
        let limits = self.config.decode_limits;
        let hold = permit.hold();
        tokio::task::spawn_blocking(move || {
            let _hold = hold;
            items
                .iter()
                .enumerate()
                .map(|(index, item)| match item {
                    MediaInput::Image(image) => {
                        prepare(&shared, &processor, &limits, index, &image.bytes)
                    }
                    MediaInput::Video(input) => prepare_video(&shared, &video, index, input),
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .await
        .map_err(|e| EngineError::Internal(format!("preprocessing task failed: {e}")))?
    }

    /// Clears the processor cache; reports the bytes released.
    pub fn reset_mm_cache(&self) -> ResetReport {
        let bytes = self
            .shared
            .processor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        ResetReport {
            processor_cache_bytes: bytes,
            ..ResetReport::default()
        }
    }

    /// Clears the encoder cache manager and the device encoder cache, between steps.
    ///
    /// # Errors
    /// [`EngineError::Dead`] once the engine died (its thread gave the device memory back as
    /// it ended; nothing is left to reset), or the shutdown error once it stopped.
    pub async fn reset_encoder_cache(&self) -> Result<ResetReport, EngineError> {
        self.ask(Command::ResetEncoderCache).await
    }

    /// Returns the caching allocator's unused blocks to the device, then has the device's
    /// plugin give back what it took after open to reuse (see [`ResetReport::plugin_cache_bytes`]).
    ///
    /// # Errors
    /// As [`Engine::reset_encoder_cache`].
    pub async fn reset_allocator(&self) -> Result<ResetReport, EngineError> {
        self.ask(Command::TrimAllocator).await
    }

    /// Processor cache, encoder cache, allocator, in that order.
    ///
    /// # Errors
    /// As [`Engine::reset_encoder_cache`]; the processor cache is cleared first either way.
    pub async fn reset_all(&self) -> Result<ResetReport, EngineError> {
        let processor = self.reset_mm_cache();
        let encoder = self.reset_encoder_cache().await?;
        let allocator = self.reset_allocator().await?;
        Ok(ResetReport {
            processor_cache_bytes: processor.processor_cache_bytes,
            encoder_cache_bytes: encoder.encoder_cache_bytes,
            encoder_cache_entries: encoder.encoder_cache_entries,
            allocator_bytes: allocator.allocator_bytes,
            plugin_cache_bytes: allocator.plugin_cache_bytes,
        })
    }

    /// Puts the engine to sleep: level 1 keeps a host copy of the weights, level 2 discards
    /// them. New requests are refused from this call on.
    ///
    /// # Errors
    /// [`EngineError::BadInput`] for another level; [`EngineError::Internal`] when the weights
    /// could not be copied (the engine stays awake).
    pub async fn sleep(&self, level: u8) -> Result<ResetReport, EngineError> {
        if !(1..=2).contains(&level) {
            return Err(EngineError::BadInput {
                message: format!("sleep level must be 1 or 2, got {level}"),
                code: "invalid_sleep_level",
            });
        }
        // Refuse new requests from now on; the worker sets the flag to the state it leaves
        // the tower in once it has run the command (awake again, if the copy failed).
        self.shared.sleep_level.fetch_max(level, Ordering::SeqCst);
        self.ask(|tx| Command::Sleep(level, tx)).await?
    }

    /// Wakes the engine up, restoring the weights.
    ///
    /// # Errors
    /// [`EngineError::Internal`] when the weights could not be restored (the engine stays
    /// asleep).
    pub async fn wake_up(&self) -> Result<(), EngineError> {
        self.ask(Command::WakeUp).await?
    }

    /// Whether the engine is asleep (or going to sleep).
    pub fn is_sleeping(&self) -> bool {
        self.shared.sleep_level.load(Ordering::SeqCst) != 0
    }

    /// What has crossed the device boundary since start-up: bytes each way, batched copies,
    /// fills, ops, synchronisations.
    pub fn device_counters(&self) -> iris_plugin::host::Counters {
        self.shared.allocator.device().counters()
    }

    /// Device and allocator figures now, with both caches' sizes.
    pub fn gauges(&self) -> MemoryGauges {
        let s = &self.shared;
        let snapshot = MemorySnapshot::take(&s.allocator).ok();
        let snapshot = snapshot.as_ref();
        let processor = s.processor_stats();
        let mut gauges = MemoryGauges {
            encoder_cache_bytes: s.encoder_cache_bytes.load(Ordering::Relaxed),
            encoder_cache_entries: s.encoder_cache_entries.load(Ordering::Relaxed),
            processor_cache_bytes: processor.bytes,
            processor_cache_entries: processor.entries as u64,
            ..gauges_of_snapshot(snapshot)
        };
        if snapshot.is_none() {
            // The device could not be read; the allocator's own counters still can.
            let stats = s.allocator.stats();
            gauges.allocator_reserved_bytes = stats.reserved;
            gauges.allocator_allocated_bytes = stats.allocated;
            gauges.allocator_peak_bytes = stats.peak_allocated;
        }
        gauges
    }

    /// Cache counters and memory gauges.
    pub fn metrics_snapshot(&self) -> MetricsSnapshot {
        let s = &self.shared;
        let processor = s.processor_stats();
        MetricsSnapshot {
            processor_cache_hits: processor.hits,
            processor_cache_misses: processor.misses,
            processor_cache_evictions: processor.evictions,
            encoder_cache_hits: s.encoder_hits.load(Ordering::Relaxed),
            encoder_cache_misses: s.encoder_misses.load(Ordering::Relaxed),
            encoder_cache_evictions: s.encoder_evictions.load(Ordering::Relaxed),
            encoder_cache_reencodes: s.faults.reencodes.load(Ordering::Relaxed),
            oom_recoveries: s.faults.oom_recoveries.load(Ordering::Relaxed),
            oom_batch_splits: s.faults.batch_splits.load(Ordering::Relaxed),
            oom_failures: s.faults.oom_failures.load(Ordering::Relaxed),
            device_faults: s.faults.device_faults.load(Ordering::Relaxed),
            steps: s.steps.load(Ordering::Relaxed),
            step_time_ns: s.step_time_ns.load(Ordering::Relaxed),
            encoder_time_ns: s.encoder_time_ns.load(Ordering::Relaxed),
            encoder_flops: s.encoder_flops.load(Ordering::Relaxed),
            peak_flops: self.peak_flops,
            admission: s.admission.stats(),
            memory: self.gauges(),
            before_start: gauges_of_snapshot(Some(&self.startup.before_start)),
            after_start: gauges_of_snapshot(Some(&self.startup.after_start)),
        }
    }

    /// The memory snapshot plus both caches' entries and bytes, as JSON.
    pub fn memory_json(&self) -> Value {
        let snapshot = MemorySnapshot::take(&self.shared.allocator).ok();
        let s = &self.shared;
        let processor = s.processor_stats();
        json!({
            "snapshot": snapshot,
            "processor_cache": {
                "entries": processor.entries,
                "bytes": processor.bytes,
                "capacity_bytes": processor.capacity,
            },
            "encoder_cache": {
                "entries": s.encoder_cache_entries.load(Ordering::Relaxed),
                "bytes": s.encoder_cache_bytes.load(Ordering::Relaxed),
                "capacity_tokens": s.encoder_cache_capacity_tokens.load(Ordering::Relaxed),
                "free_tokens": s.encoder_cache_free_tokens.load(Ordering::Relaxed),
            },
            "in_flight_requests": s.in_flight.load(Ordering::Relaxed),
            "admission": s.admission.stats(),
            "engine_dead": s.liveness.dead_reason(),
            "is_sleeping": self.is_sleeping(),
            "before_start": self.startup.before_start,
            "after_start": self.startup.after_start,
        })
    }

    /// Configuration, device and start-up report, as JSON.
    pub fn info_json(&self) -> Value {
        let c = &self.config;
        let s = &c.scheduler;
        json!({
            "version": env!("CARGO_PKG_VERSION"),
            "model": c.spec.name,
            "family": format!("{:?}", c.spec.vision.family),
            "dtype": c.dtype.to_string(),
            "weights": match &c.weights {
                WeightSource::Dummy { seed } => format!("dummy (seed {seed})"),
                WeightSource::Safetensors(paths) => format!("{} safetensors path(s)", paths.len()),
            },
            "device": self.device_name,
            "peak_flops": self.peak_flops,
            "plugin": self.plugin_name,
            "scheduler": {
                "max_num_batched_tokens": s.max_num_batched_tokens,
                "max_num_seqs": s.max_num_seqs,
                "encoder_cache_size": s.encoder_cache_size,
                "max_num_encoder_input_tokens": s.max_num_encoder_input_tokens,
                "disable_chunked_mm_input": s.disable_chunked_mm_input,
            },
            "admission": self.shared.admission.limits(),
            "device_memory_utilization": c.device_memory_utilization,
            "processor_cache_bytes": c.processor_cache_bytes,
            "processor": {
                "min_pixels": self.processor.min_pixels,
                "max_pixels": self.processor.max_pixels,
                "patch_size": self.processor.patch_size,
                "merge_size": self.processor.merge_size,
            },
            "startup": self.startup,
        })
    }
}

impl Drop for Engine {
    fn drop(&mut self) {
        // Closing the channel ends the engine-core loop; joining waits until it has dropped the
        // tower, the caches and the allocator's blocks.
        self.commands
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        let thread = self
            .thread
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .take();
        if let Some(thread) = thread {
            let _ = thread.join();
        }
    }
}

fn stopped() -> EngineError {
    EngineError::Internal("the engine core has stopped".to_owned())
}

fn gauges_of_snapshot(snapshot: Option<&MemorySnapshot>) -> MemoryGauges {
    snapshot.map_or_else(MemoryGauges::default, |s| MemoryGauges {
        device_used_bytes: s.device_used,
        device_total_bytes: s.device_total,
        allocator_reserved_bytes: s.allocator_reserved,
        allocator_allocated_bytes: s.allocator_allocated,
        allocator_peak_bytes: s.allocator_peak_allocated,
        plugin_held_bytes: s.plugin_held,
        ..MemoryGauges::default()
    })
}

/// Decodes, hashes and (on a processor-cache miss) preprocesses one image.
fn prepare(
    shared: &Shared,
    processor: &ProcessorConfig,
    limits: &DecodeLimits,
    index: usize,
    bytes: &[u8],
) -> Result<Arc<PreprocessedImage>, EngineError> {
    let bad = |err: PreprocessError| EngineError::BadInput {
        code: preprocess_error_code(&err),
        message: format!("image {index}: {err}"),
    };
    let (_, rgb) = decode_rgb(bytes, limits, processor.alpha).map_err(bad)?;
    let hash = item_hash(&rgb, processor);
    if let Some(image) = shared.cached(&hash) {
        return Ok(image);
    }
    Ok(shared.remember(hash, preprocess_rgb(&rgb, processor).map_err(bad)?))
}

/// Preprocesses video `index` of a request (frames already decoded) through the processor
/// cache.
fn prepare_video(
    shared: &Shared,
    video: &VideoProcessing,
    index: usize,
    input: &VideoInput,
) -> Result<Arc<PreprocessedImage>, EngineError> {
    let frames = &input.video.frames;
    let hash = video_hash(frames, &video.config, video.resize);
    if let Some(item) = shared.cached(&hash) {
        return Ok(item);
    }
    let processed = preprocess_frames(frames, &video.config, video.resize).map_err(|err| {
        EngineError::BadInput {
            code: video_error_code(&err),
            message: format!("video {index}: {err}"),
        }
    })?;
    let item = PreprocessedImage {
        pixel_values: processed.pixel_values,
        grid_thw: processed.grid_thw,
        original_size: processed.original_size,
        resized_size: processed.resized_size,
        tokens: processed.tokens,
        hash: hash.clone(),
        modality: Modality::Video,
    };
    Ok(shared.remember(hash, item))
}

/// The FFmpeg programs, located once and remembered; a failed search is tried again on the
/// next video (FFmpeg may be installed meanwhile).
fn locate_ffmpeg(shared: &Shared) -> Result<Ffmpeg, EngineError> {
    let mut slot = shared.ffmpeg.lock().unwrap_or_else(PoisonError::into_inner);
    if let Some(ffmpeg) = slot.as_ref() {
        return Ok(ffmpeg.clone());
    }
    let ffmpeg = Ffmpeg::locate().map_err(video_error)?;
    *slot = Some(ffmpeg.clone());
    Ok(ffmpeg)
}

/// Gives the device back what a dead engine's allocator holds. Unwinding dropped the worker,
/// its weights, encoder cache and step buffers into the allocator's cache; nothing can ask for
/// a reset any more (every call answers `Dead`), so without this the memory stayed reserved
/// until the process ended. The processor cache's host memory goes too.
fn give_back_after_death(shared: &Shared) {
    let released = release_cached(&shared.allocator);
    let processor = shared
        .processor
        .lock()
        .unwrap_or_else(PoisonError::into_inner)
        .clear();
    tracing::error!(
        "the dead engine gave back {released} bytes of device memory and {processor} bytes of its processor cache"
    );
}

/// Returns `allocator`'s cached blocks to the device and the bytes that went back, those of a
/// release that partly failed included (the blocks it could not free stay cached, and the
/// failure is logged; the next release tries them again).
pub(crate) fn release_cached(allocator: &CachingAllocator) -> u64 {
    match allocator.empty_cache() {
        Ok(bytes) => bytes,
        Err(crate::memory::AllocError::ReleaseFailed {
            released, source, ..
        }) => {
            tracing::warn!(error = %source, "the device refused to free some cached segments");
            released
        }
        Err(err) => {
            tracing::warn!(error = %err, "the allocator's cache was not released");
            0
        }
    }
}

/// The estimated tokens of a video of `frames` frames of `size` (0 for one the processing
/// refuses: its preprocessing reports why).
fn video_tokens(frames: usize, size: ImageSize, video: &VideoProcessing) -> u64 {
    video_shape(frames, size, &video.config, video.resize)
        .map_or(0, |shape| u64::from(shape.tokens))
}

/// The engine error of a video that cannot be loaded: FFmpeg missing is the server's
/// (a 501 that says how to install it), anything else the client's.
fn video_error(err: VideoError) -> EngineError {
    match err {
        VideoError::FfmpegMissing { .. } => EngineError::Unsupported {
            message: err.to_string(),
            code: "video_decoder_missing",
        },
        other => EngineError::BadInput {
            code: video_error_code(&other),
            message: other.to_string(),
        },
    }
}

/// The stable error code of a video that cannot be loaded or preprocessed.
pub fn video_error_code(err: &VideoError) -> &'static str {
    match err {
        VideoError::NoFrames | VideoError::TooFewFrames { .. } => "video_too_short",
        VideoError::UnknownFrameRate => "video_frame_rate_unknown",
        VideoError::InvalidOption { .. } => "invalid_video_option",
        VideoError::TooLarge { .. } => "video_too_large",
        VideoError::FfmpegMissing { .. } => "video_decoder_missing",
        VideoError::Preprocess(PreprocessError::AspectRatio { .. }) => "video_aspect_ratio",
        _ => "corrupt_video",
    }
}

/// The stable error code of a preprocessing failure.
pub fn preprocess_error_code(err: &PreprocessError) -> &'static str {
    match err {
        PreprocessError::UnsupportedFormat { .. } => "unknown_image_format",
        PreprocessError::TooLarge { .. } => "image_too_large",
        PreprocessError::AspectRatio { .. } => "image_aspect_ratio",
        _ => "corrupt_image",
    }
}

/// The encoder budget of `scheduler` over the largest items start-up measured.
fn encoder_budget(
    scheduler: &SchedulerConfig,
    profile: &StartupProfile,
) -> Result<EncoderBudget, StartError> {
    let limits = &scheduler.limit_mm_per_prompt;
    let modalities: Vec<(Modality, ModalityLimits)> = profile
        .modality_max_tokens
        .iter()
        .map(|&(modality, tokens)| {
            (
                modality,
                ModalityLimits {
                    max_tokens_per_item: tokens,
                    limit_per_prompt: limits.get(modality),
                },
            )
        })
        .collect();
    EncoderBudget::new(scheduler, &modalities).map_err(|e| StartError::Scheduler(e.to_string()))
}

/// The refusal of item `index` of a request, which the scheduler could never take.
pub(crate) fn over_budget(index: usize, modality: Modality, source: BudgetError) -> EngineError {
    let (what, code) = match modality {
        Modality::Video => ("video", "video_over_budget"),
        Modality::Image => ("image", "image_over_budget"),
    };
    EngineError::BadInput {
        message: format!("{what} {index}: {source}"),
        code,
    }
}

/// Runs start-up on the engine-core thread: the worker, the start-up report and the
/// scheduler's budget (a copy for the engine's item check).
fn start_worker(
    shared: Arc<Shared>,
    config: &EngineConfig,
) -> Result<(Worker, (StartupProfile, EncoderBudget)), StartError> {
    let allocator = Arc::clone(&shared.allocator);
    let request = ProfileRequest {
        spec: config.spec.clone(),
        weights: config.weights.clone(),
        dtype: config.dtype,
        scheduler: config.scheduler.clone(),
        device_memory_utilization: config.device_memory_utilization,
        mode: config.profile_mode,
        warm_up: config.warm_up,
        progress: config.progress.clone(),
        video: config.video.clone(),
    };
    let (tower, profile) = profile_startup(&allocator, &request)?;
    let budget = encoder_budget(&config.scheduler, &profile)?;
    let manager = EncoderCacheManager::new(crate::budget::BudgetPolicy::cache_size(&budget));
    let scheduler = Scheduler::new(config.scheduler.clone(), budget.clone(), manager);
    let runner = Runner::new(allocator);
    let worker = Worker::new(shared, runner, tower, config.weights.clone(), scheduler);
    Ok((worker, (profile, budget)))
}

#[cfg(test)]
mod tests;
