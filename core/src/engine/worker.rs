//! The engine-core thread: it alone owns the device, the vision tower, the scheduler with its
//! encoder cache manager and the device encoder cache, and runs steps between commands.
//!
//! A step: schedule -> free what the manager evicted -> encode the newly scheduled items in one
//! tower call -> store the outputs in the device cache -> gather every scheduled position into
//! the step's input-embedding buffer (text positions zero, a mask marking image positions) ->
//! deliver each request its rows -> mark the tokens consumed and finish requests. Commands
//! (new requests, aborts, resets, sleep, wake-up) are taken between steps, which is where the
//! scheduler's reset contract wants them.
//!
//! Faults during a step (see docs/ARCHITECTURE.md, "Failure handling"):
//!
//! - **Out of memory** (encoder batch or step buffer): evict every unreferenced encoder-cache
//!   entry, return the allocator's free blocks to the device, retry; then split the batch (or
//!   the step's requests) in halves and retry each. A single item that still does not fit fails
//!   the requests that need it: [`EngineError::TooLargeForDevice`] with the bytes it needs and
//!   the most the device can give when it could never fit, [`EngineError::OutOfMemory`] (retry
//!   later) when it fits once other work drains. Other requests go on.
//! - **Any other device error** fails the step's requests ([`EngineError::Device`]); the
//!   outputs this step wrote are dropped from the device cache and the manager, entries of
//!   earlier steps are kept, and the engine goes on.
//! - **A device-cache miss** for an item the manager holds is answered by encoding it again.
//!
//! After every step the manager's entries are exactly the device cache's.

use std::collections::HashMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::budget::EncoderBudget;
use crate::cache::device::{DeviceEncoderCache, Entry};
use crate::cache::encoder::{EncoderCacheManagement, EncoderCacheManager};
use crate::encoder::EncoderError;
use crate::encoder::exec::{Runner, dtype_size};
use crate::encoder::layout::Grid;
use crate::encoder::plan::StepPlan;
use crate::encoder::tower::VisionTower;
use crate::engine::Shared;
use crate::engine::admission::PermitHold;
use crate::engine::api::{EngineError, ResetReport};
use crate::engine::prompt::{Chunk, Event, PromptLayout};
use crate::memory::AllocError;
use crate::model::{HostWeights, VisionConfig, WeightSource};
use crate::preprocess::PreprocessedImage;
use crate::scheduler::{RequestId, Scheduler, SchedulerError, SchedulerPolicy, StepOutput};
use iris_plugin::{CopyRegion, DType, ErrorCode};

/// `Retry-After` of an item that did not fit in device memory next to other work, in seconds:
/// that work drains within a few steps.
pub const OUT_OF_MEMORY_RETRY_AFTER_S: u64 = 1;

/// Counters of the engine core's fault handling; the handle reads them for `/metrics`.
#[derive(Debug, Default)]
pub(crate) struct FaultCounters {
    /// Device-cache misses answered by encoding the item again.
    pub reencodes: AtomicU64,
    /// Out-of-memory recoveries: unreferenced entries evicted, free blocks trimmed, retried.
    pub oom_recoveries: AtomicU64,
    /// Batches (of items or of a step's requests) split in halves after an out-of-memory.
    pub batch_splits: AtomicU64,
    /// Requests failed because an item did not fit in device memory (now or ever).
    pub oom_failures: AtomicU64,
    /// Steps failed by a device error other than out of memory.
    pub device_faults: AtomicU64,
}

/// A request handed to the engine core.
pub(crate) struct AddRequest {
    /// The handle's key for it (aborts name it).
    pub key: u64,
    pub images: Vec<Arc<PreprocessedImage>>,
    pub layout: PromptLayout,
    pub return_embeddings: bool,
    pub events: mpsc::UnboundedSender<Event>,
    /// The request's admission share, held while the core holds the request: a request whose
    /// caller went away keeps its slot and tokens counted until the core lets it go (at the
    /// next step boundary), not only until its future is dropped.
    pub hold: PermitHold,
}

/// What the handle asks of the engine core.
pub(crate) enum Command {
    Add(Box<AddRequest>),
    /// The consumer went away: release the request.
    Abort(u64),
    ResetEncoderCache(oneshot::Sender<ResetReport>),
    TrimAllocator(oneshot::Sender<ResetReport>),
    Sleep(u8, oneshot::Sender<Result<ResetReport, EngineError>>),
    WakeUp(oneshot::Sender<Result<(), EngineError>>),
    /// Checks that the manager and the device cache agree and that the allocator holds nothing
    /// beyond the weights and the cached outputs.
    #[cfg(test)]
    Check(oneshot::Sender<Result<(), String>>),
    /// Drops an item's device output without telling the manager: a device-side loss.
    #[cfg(test)]
    LoseDeviceEntry(String, oneshot::Sender<bool>),
}

/// An item (or a request's step buffer) that did not fit in device memory after eviction,
/// trimming and splitting.
#[derive(Debug, Clone, Copy)]
struct MemoryShortfall {
    /// Bytes it needs.
    needed: u64,
    /// The most the device can give it once other work drains.
    available: u64,
    /// Whether other work holds memory that will be given back.
    others_hold: bool,
}

impl MemoryShortfall {
    /// The error of `what` ("image 2", ...).
    fn error(self, what: &str) -> EngineError {
        let MemoryShortfall {
            needed,
            available,
            others_hold,
        } = self;
        if needed > available || !others_hold {
            EngineError::TooLargeForDevice {
                message: format!(
                    "{what} does not fit in device memory: it needs about {needed} bytes and the \
                     device can give it at most {available} bytes (its total less the weights \
                     and what the driver holds); send a smaller image or lower max_pixels"
                ),
                needed_bytes: needed,
                available_bytes: available,
            }
        } else {
            EngineError::OutOfMemory {
                message: format!(
                    "{what} does not fit in device memory next to the work in flight: it needs \
                     about {needed} bytes of the {available} the device can give; retry once \
                     other requests have finished"
                ),
                retry_after_s: OUT_OF_MEMORY_RETRY_AFTER_S,
            }
        }
    }
}

struct Active {
    key: u64,
    images: Vec<Arc<PreprocessedImage>>,
    layout: PromptLayout,
    return_embeddings: bool,
    events: mpsc::UnboundedSender<Event>,
    encoded: Vec<bool>,
    _hold: PermitHold,
}

/// Weights while asleep.
enum Asleep {
    /// Level 1: copied to the host.
    OnHost(HostWeights),
    /// Level 2: discarded; waking reloads them from the source.
    Discarded,
}

pub(crate) struct Worker {
    shared: Arc<Shared>,
    runner: Runner,
    tower: Option<VisionTower>,
    vision: VisionConfig,
    dtype: DType,
    weights: WeightSource,
    scheduler: Scheduler<EncoderCacheManager, EncoderBudget>,
    cache: DeviceEncoderCache,
    asleep: Option<Asleep>,
    active: HashMap<RequestId, Active>,
    by_key: HashMap<u64, RequestId>,
    /// Allocator bytes in live blocks after start-up: the weights. Everything above it between
    /// steps is the device cache's.
    baseline_allocated: u64,
    /// Hashes whose outputs this step stored in the device cache.
    written: Vec<String>,
    /// The last step's plan, by its grids: a bench or a steady load repeats its steps.
    last_plan: Option<(Vec<Grid>, Arc<StepPlan>)>,
}

impl Worker {
    pub fn new(
        shared: Arc<Shared>,
        runner: Runner,
        tower: VisionTower,
        weights: WeightSource,
        scheduler: Scheduler<EncoderCacheManager, EncoderBudget>,
    ) -> Worker {
        Worker {
            shared,
            vision: tower.config().clone(),
            dtype: tower.dtype(),
            tower: Some(tower),
            weights,
            scheduler,
            cache: DeviceEncoderCache::new(),
            asleep: None,
            active: HashMap::new(),
            by_key: HashMap::new(),
            baseline_allocated: runner.allocator().stats().allocated,
            written: Vec::new(),
            last_plan: None,
            runner,
        }
    }

    /// Runs until every handle is gone, then releases everything it holds.
    pub fn run(mut self, commands: &Receiver<Command>) {
        self.publish();
        loop {
            // Block for work when idle; otherwise take what arrived and run a step.
            let idle = self.asleep.is_some() || !self.scheduler.has_unfinished();
            let next = if idle {
                commands.recv().map_err(|_| TryRecvError::Disconnected)
            } else {
                commands.try_recv()
            };
            match next {
                Ok(command) => {
                    self.handle(command);
                    continue;
                }
                Err(TryRecvError::Disconnected) => break,
                Err(TryRecvError::Empty) => {}
            }
            self.step();
        }
        self.fail_all(&EngineError::Internal("the engine shut down".to_owned()));
    }

    fn handle(&mut self, command: Command) {
        match command {
            Command::Add(request) => {
                self.add(*request);
                self.publish();
            }
            Command::Abort(key) => {
                let released = self.by_key.remove(&key).and_then(|id| {
                    self.scheduler.abort(id);
                    self.active.remove(&id)
                });
                self.publish();
                // The admission share goes after the gauges: a reader never sees the slot free
                // while the core still counts the request in flight.
                drop(released);
            }
            // Each reply goes out after the figures are published, so that a caller reading
            // them once the call returned sees its effect.
            Command::ResetEncoderCache(reply) => {
                let report = self.reset_encoder_cache();
                self.publish();
                let _ = reply.send(report);
            }
            Command::TrimAllocator(reply) => {
                let report = self.trim();
                self.publish();
                let _ = reply.send(report);
            }
            Command::Sleep(level, reply) => {
                let result = self.sleep(level);
                self.publish();
                let _ = reply.send(result);
            }
            Command::WakeUp(reply) => {
                let result = self.wake_up();
                self.publish();
                let _ = reply.send(result);
            }
            #[cfg(test)]
            Command::Check(reply) => {
                let _ = reply.send(self.check());
            }
            #[cfg(test)]
            Command::LoseDeviceEntry(hash, reply) => {
                let _ = reply.send(self.cache.remove(&hash).is_some());
                self.publish();
            }
        }
    }

    fn add(&mut self, request: AddRequest) {
        let new = request.layout.request(&request.images);
        match self.scheduler.add_request(new) {
            Ok(id) => {
                self.by_key.insert(request.key, id);
                self.active.insert(
                    id,
                    Active {
                        key: request.key,
                        encoded: vec![false; request.images.len()],
                        images: request.images,
                        layout: request.layout,
                        return_embeddings: request.return_embeddings,
                        events: request.events,
                        _hold: request.hold,
                    },
                );
            }
            Err(SchedulerError::Budget { index, source }) => {
                let modality = request
                    .images
                    .get(index)
                    .map_or(crate::budget::Modality::Image, |item| item.modality);
                let _ = request
                    .events
                    .send(Event::Failed(super::over_budget(index, modality, source)));
            }
            Err(err) => {
                let _ = request
                    .events
                    .send(Event::Failed(EngineError::Internal(err.to_string())));
            }
        }
    }

    /// One step. A fault fails the requests of the step (they are released) and the engine goes
    /// on with the others.
    fn step(&mut self) {
        self.shared.before_step();
        let started = Instant::now();
        let finished = self.run_scheduled_step();
        let s = &self.shared;
        s.steps.fetch_add(1, Ordering::Relaxed);
        s.step_time_ns
            .fetch_add(nanos(started.elapsed()), Ordering::Relaxed);
        // Published before the requests hear they finished, so that a caller reading the
        // figures after its request returned sees the step that served it.
        self.publish();
        for (events, event) in finished {
            let _ = events.send(event);
        }
    }

    /// Runs one step; returns the finished requests' final events, to send once the step's
    /// figures are published.
    fn run_scheduled_step(&mut self) -> Vec<(mpsc::UnboundedSender<Event>, Event)> {
        let output = match self.scheduler.schedule() {
            Ok(output) => output,
            Err(err) => {
                // The scheduler's state is suspect: fail everything rather than loop on it.
                self.fail_all(&EngineError::Internal(format!("scheduling failed: {err}")));
                return Vec::new();
            }
        };
        self.cache.free_hashes(&output.freed);
        self.written.clear();
        match self.run_step(&output) {
            Ok(chunks) => self.deliver(chunks),
            Err(err) => self.fail_step(&output, &err),
        }
        self.reconcile(&output);
        let mut events = Vec::new();
        for id in self.scheduler.update_from_output(&output) {
            if let Some(active) = self.active.remove(&id) {
                self.by_key.remove(&active.key);
                let hits = active.encoded.iter().filter(|e| !**e).count() as u64;
                let misses = active.encoded.len() as u64 - hits;
                self.shared.encoder_hits.fetch_add(hits, Ordering::Relaxed);
                self.shared
                    .encoder_misses
                    .fetch_add(misses, Ordering::Relaxed);
                events.push((
                    active.events,
                    Event::Finished {
                        encoded: active.encoded,
                    },
                ));
            }
        }
        events
    }

    /// Fails the requests of a step whose work failed with a device error (out of memory is
    /// handled where it happens). Outputs this step stored may be incomplete and are dropped;
    /// entries of earlier steps are only read by a step, so they are kept.
    fn fail_step(&mut self, output: &StepOutput, err: &EncoderError) {
        self.shared
            .faults
            .device_faults
            .fetch_add(1, Ordering::Relaxed);
        tracing::warn!(error = %err, requests = output.scheduled.len(), "a step failed");
        // Work queued before the failure may still run: let it finish, so that the next step
        // starts on a settled queue. A second failure reported here is this step's too.
        if let Err(more) = self.sync() {
            tracing::warn!(error = %more, "settling the device queue after a failed step");
        }
        let err = match err {
            // The device can no longer compute (a fault left its context unusable, the device
            // is gone): every later step fails the same way, so the request is told the device
            // is lost (503), not that this one step met an error (500).
            EncoderError::Device(device) | EncoderError::Alloc(AllocError::Device(device))
                if device.code == ErrorCode::UNAVAILABLE =>
            {
                EngineError::DeviceLost(err.to_string())
            }
            EncoderError::Device(_) | EncoderError::Alloc(_) => {
                EngineError::Device(err.to_string())
            }
            _ => EngineError::Internal(err.to_string()),
        };
        for (id, _) in &output.scheduled {
            self.fail(*id, &err);
        }
        for hash in std::mem::take(&mut self.written) {
            self.cache.remove(&hash);
            self.scheduler.invalidate_encoder_output(&hash);
        }
    }

    /// Keeps the manager in agreement with the device cache: an item the manager allocated
    /// this step whose output is not on the device (its encode failed, or every request that
    /// wanted it went away first) is forgotten, so that whoever needs it next encodes it.
    fn reconcile(&mut self, output: &StepOutput) {
        for input in &output.encoder_inputs {
            if !self.cache.contains(&input.hash) {
                self.scheduler.invalidate_encoder_output(&input.hash);
            }
        }
        // And an output stored for an item the manager no longer counts is not kept.
        for hash in std::mem::take(&mut self.written) {
            if !self.scheduler.manager().contains(&hash) {
                self.cache.remove(&hash);
            }
        }
    }

    /// Fails, in the step's requests, every one whose images include an item that did not
    /// fit, naming the image; the manager forgets items that have no device output.
    fn fail_items(
        &mut self,
        output: &StepOutput,
        failed: Vec<(Arc<PreprocessedImage>, MemoryShortfall)>,
    ) {
        for (image, shortfall) in failed {
            for (id, _) in &output.scheduled {
                let index = self
                    .active
                    .get(id)
                    .and_then(|active| active.images.iter().position(|i| i.hash == image.hash));
                if let Some(index) = index {
                    self.shared
                        .faults
                        .oom_failures
                        .fetch_add(1, Ordering::Relaxed);
                    self.fail(*id, &shortfall.error(&format!("image {index}")));
                }
            }
            if !self.cache.contains(&image.hash) {
                self.scheduler.invalidate_encoder_output(&image.hash);
            }
        }
    }

    /// Sends each request its chunk of a completed step; a request whose consumer is gone is
    /// aborted.
    fn deliver(&mut self, chunks: Vec<(RequestId, Chunk)>) {
        for (id, chunk) in chunks {
            let Some(active) = self.active.get(&id) else {
                continue;
            };
            if active.events.send(Event::Chunk(chunk)).is_err() {
                // The consumer is gone; its abort command may still be queued.
                let key = active.key;
                self.by_key.remove(&key);
                self.active.remove(&id);
                self.scheduler.abort(id);
            }
        }
    }

    /// Runs a step's work: the encoder on newly scheduled items (and on items the device cache
    /// lost), then the gather of every scheduled position into the step's input embeddings.
    /// Returns each request's chunk once the device has finished the work, so that a failure
    /// of queued work fails this step and not a later one. Out of memory is handled inside
    /// (requests whose items do not fit are failed here); an error is a device fault.
    fn run_step(&mut self, output: &StepOutput) -> Result<Vec<(RequestId, Chunk)>, EncoderError> {
        self.encode(output)?;
        self.encode_missing(output)?;
        let scheduled: Vec<(RequestId, u64)> = output
            .scheduled
            .iter()
            .copied()
            .filter(|(id, tokens)| *tokens > 0 && self.active.contains_key(id))
            .collect();
        let chunks = self.gather_recovering(&scheduled)?;
        self.sync()?;
        Ok(chunks)
    }

    /// Waits for the device's queue through the allocator, which also reports a failure that a
    /// memory snapshot on another thread ran into first: a failure is this step's.
    fn sync(&self) -> Result<(), EncoderError> {
        Ok(self.runner.allocator().synchronize()?)
    }

    /// Gathers the scheduled positions of `scheduled` (active requests), retrying after an
    /// out-of-memory with memory released, then in halves; a single request whose step buffer
    /// still does not fit is failed.
    fn gather_recovering(
        &mut self,
        scheduled: &[(RequestId, u64)],
    ) -> Result<Vec<(RequestId, Chunk)>, EncoderError> {
        if scheduled.is_empty() {
            return Ok(Vec::new());
        }
        match self.gather(scheduled) {
            Err(err) if is_out_of_memory(&err) => {}
            other => return other,
        }
        self.recover_memory()?;
        match self.gather(scheduled) {
            Err(err) if is_out_of_memory(&err) => {}
            other => return other,
        }
        if let [(id, tokens)] = *scheduled {
            let levels = self.vision.deepstack_visual_indexes.len() as u64;
            let needed =
                tokens * (levels + 1) * self.vision.out_hidden as u64 * self.element_bytes();
            let shortfall = self.shortfall(needed)?;
            self.shared
                .faults
                .oom_failures
                .fetch_add(1, Ordering::Relaxed);
            self.fail(
                id,
                &shortfall.error(&format!("the {tokens} positions of this request's step")),
            );
            return Ok(Vec::new());
        }
        self.shared
            .faults
            .batch_splits
            .fetch_add(1, Ordering::Relaxed);
        let (first, second) = scheduled.split_at(scheduled.len() / 2);
        let mut chunks = self.gather_recovering(first)?;
        chunks.extend(self.gather_recovering(second)?);
        Ok(chunks)
    }

    /// Bytes of one element of the run dtype.
    fn element_bytes(&self) -> u64 {
        dtype_size(self.dtype)
    }

    /// Enqueues the gather of every scheduled position of `scheduled` (active requests with
    /// tokens) into one input-embedding buffer and reads back what the requests asked for.
    fn gather(
        &mut self,
        scheduled: &[(RequestId, u64)],
    ) -> Result<Vec<(RequestId, Chunk)>, EncoderError> {
        let hidden = self.vision.out_hidden as u64;
        let total: u64 = scheduled.iter().map(|(_, tokens)| tokens).sum();
        let levels = self.vision.deepstack_visual_indexes.len();
        if total == 0 {
            return Ok(Vec::new());
        }
        // The step's input-embedding buffers, main then one per deepstack level, stacked in
        // one tensor: text rows are zero (the language model embeds them), image rows come from
        // the device cache. One fill and one batched copy per step, whatever the number of
        // requests, items and levels.
        let buffers = self
            .runner
            .tensor(self.dtype, total * (levels as u64 + 1), hidden)?;
        let level = |l: u64| buffers.row_range(l * total, total);
        let row_bytes = hidden * self.element_bytes();
        let dst = buffers.mat();
        let mut regions = Vec::new();
        let mut text_rows = 0u64;
        let mut row = 0;
        for &(id, tokens) in scheduled {
            let Some(active) = self.active.get(&id) else {
                row += tokens;
                continue;
            };
            let start = self
                .scheduler
                .num_computed_tokens(id)
                .unwrap_or(active.layout.prompt_len);
            let mut p = start;
            while p < start + tokens {
                let dst_row = row + (p - start);
                match active.layout.item_at(p) {
                    Some((index, item_row)) => {
                        let (_, length) = active.layout.items[index];
                        let run = (length - item_row).min(start + tokens - p);
                        // `encode_missing` put every item of the window on the device.
                        let entry = self
                            .cache
                            .get(&active.images[index].hash)
                            .map_err(|miss| EncoderError::Shape(miss.to_string()))?;
                        let sources = std::iter::once(entry.embeddings())
                            .chain((0..levels).filter_map(|l| entry.deepstack_embeddings(l)));
                        for (l, source) in (0u64..).zip(sources) {
                            regions.push(CopyRegion {
                                src: source.buf,
                                src_offset: source.offset + item_row * row_bytes,
                                dst: dst.buf,
                                dst_offset: dst.offset + (l * total + dst_row) * row_bytes,
                                bytes: run * row_bytes,
                            });
                        }
                        p += run;
                    }
                    None => {
                        text_rows += 1;
                        p += 1;
                    }
                }
            }
            row += tokens;
        }
        let device = self.runner.device();
        if text_rows > 0 {
            device.zero(dst.buf, dst.offset, buffers.bytes())?;
        }
        if !regions.is_empty() {
            device.copy_batch(&regions)?;
        }
        let mut chunks = Vec::with_capacity(scheduled.len());
        let mut row = 0;
        for &(id, tokens) in scheduled {
            let Some(active) = self.active.get(&id) else {
                row += tokens;
                continue;
            };
            let start = self
                .scheduler
                .num_computed_tokens(id)
                .unwrap_or(active.layout.prompt_len);
            let mask = active.layout.mask(start, tokens);
            let (embeddings, deepstack) = if active.return_embeddings {
                let mut parts = Vec::with_capacity(levels + 1);
                for l in 0..=levels as u64 {
                    parts.push(
                        self.runner
                            .download_f32(&level(l)?.row_range(row, tokens)?)?,
                    );
                }
                let mut parts = parts.into_iter();
                (parts.next(), parts.collect())
            } else {
                (None, Vec::new())
            };
            chunks.push((
                id,
                Chunk {
                    start,
                    mask,
                    embeddings,
                    deepstack,
                },
            ));
            row += tokens;
        }
        Ok(chunks)
    }

    /// Runs the tower on every newly scheduled item of the step and stores the outputs; items
    /// that do not fit in device memory fail their requests.
    fn encode(&mut self, output: &StepOutput) -> Result<(), EncoderError> {
        let mut batch: Vec<Arc<PreprocessedImage>> = Vec::new();
        for input in &output.encoder_inputs {
            let Some(active) = self.active.get_mut(&input.request) else {
                continue;
            };
            active.encoded[input.index] = true;
            let image = &active.images[input.index];
            if self.cache.contains(&image.hash) || batch.iter().any(|b| b.hash == image.hash) {
                continue;
            }
            batch.push(Arc::clone(image));
        }
        let failed = self.encode_recovering(&batch)?;
        self.fail_items(output, failed);
        Ok(())
    }

    /// Encodes again every item in a scheduled window that the manager counts as cached but
    /// the device cache does not hold (a [`crate::cache::device::CacheMiss`]): the documented
    /// answer to a lost output, instead of failing the step.
    fn encode_missing(&mut self, output: &StepOutput) -> Result<(), EncoderError> {
        let mut missing: Vec<Arc<PreprocessedImage>> = Vec::new();
        for &(id, tokens) in &output.scheduled {
            let Some(active) = self.active.get_mut(&id) else {
                continue;
            };
            let start = self
                .scheduler
                .num_computed_tokens(id)
                .unwrap_or(active.layout.prompt_len);
            for (index, &(offset, length)) in active.layout.items.iter().enumerate() {
                let image = &active.images[index];
                let in_window = offset < start + tokens && start < offset + length;
                if !in_window || self.cache.contains(&image.hash) {
                    continue;
                }
                active.encoded[index] = true;
                if !missing.iter().any(|m| m.hash == image.hash) {
                    missing.push(Arc::clone(image));
                }
            }
        }
        if missing.is_empty() {
            return Ok(());
        }
        tracing::debug!(items = missing.len(), "device cache miss: encoding again");
        let failed = self.encode_recovering(&missing)?;
        let encoded = missing.len() - failed.len();
        self.shared
            .faults
            .reencodes
            .fetch_add(encoded as u64, Ordering::Relaxed);
        self.fail_items(output, failed);
        Ok(())
    }

    /// Encodes `batch`, recovering from out-of-memory: memory released and a retry, then the
    /// halves on their own. Returns the items that still did not fit, alone, with the
    /// numbers; an error is a device fault.
    fn encode_recovering(
        &mut self,
        batch: &[Arc<PreprocessedImage>],
    ) -> Result<Vec<(Arc<PreprocessedImage>, MemoryShortfall)>, EncoderError> {
        if batch.is_empty() {
            return Ok(Vec::new());
        }
        match self.encode_batch(batch) {
            Err(err) if is_out_of_memory(&err) => {}
            other => return other.map(|()| Vec::new()),
        }
        self.recover_memory()?;
        match self.encode_batch(batch) {
            Err(err) if is_out_of_memory(&err) => {}
            other => return other.map(|()| Vec::new()),
        }
        if let [image] = batch {
            let needed = self.encode_bytes(image)?;
            return Ok(vec![(Arc::clone(image), self.shortfall(needed)?)]);
        }
        self.shared
            .faults
            .batch_splits
            .fetch_add(1, Ordering::Relaxed);
        let (first, second) = batch.split_at(batch.len() / 2);
        let mut failed = self.encode_recovering(first)?;
        failed.extend(self.encode_recovering(second)?);
        Ok(failed)
    }

    /// Runs the tower once on the items of `batch` the device cache does not hold yet and
    /// stores their outputs.
    fn encode_batch(&mut self, batch: &[Arc<PreprocessedImage>]) -> Result<(), EncoderError> {
        // A retry skips what an earlier attempt already stored.
        let batch: Vec<&Arc<PreprocessedImage>> = batch
            .iter()
            .filter(|image| !self.cache.contains(&image.hash))
            .collect();
        if batch.is_empty() {
            return Ok(());
        }
        let tower = self
            .tower
            .as_ref()
            .ok_or_else(|| EncoderError::Shape("the tower is asleep".to_owned()))?;
        let row_len = self.vision.patch_row_len() as u64;
        let parts: Vec<&[f32]> = batch.iter().map(|i| i.pixel_values.as_slice()).collect();
        let grids: Vec<[u32; 3]> = batch.iter().map(|image| image.grid_thw).collect();
        let rows = parts.iter().map(|p| p.len() as u64).sum::<u64>() / row_len;
        let plan = match &self.last_plan {
            Some((planned, plan)) if *planned == grids => Arc::clone(plan),
            _ => {
                let plan = Arc::new(tower.plan_step(self.runner.allocator(), &grids)?);
                self.last_plan = Some((grids.clone(), Arc::clone(&plan)));
                plan
            }
        };
        // The step's tensors take their planned places in one arena (see `StepPlan`).
        let step = self.runner.step(plan);
        // Where the device reads host memory as its queue runs, the pixels are not copied on
        // this thread: the device copies them, in order, ahead of the forward pass (as a copy
        // engine would), and the writes keep them borrowed until it has.
        let device = Arc::clone(self.runner.device());
        let (outputs, waited) = device.with_async_writes(|writes| {
            let input = step.upload_f32_parts_lent(&parts, self.dtype, rows, row_len, writes)?;
            let started = Instant::now();
            // Forward enqueues the graph; the encoder's time is that of completed work.
            let outputs = tower.forward(&step, &input, &grids).and_then(|outputs| {
                self.sync()?;
                Ok(outputs)
            });
            self.shared
                .encoder_time_ns
                .fetch_add(nanos(started.elapsed()), Ordering::Relaxed);
            outputs
        });
        // The queue has drained (the forward pass synchronised): the wait returned at once.
        let outputs = outputs?;
        waited?;
        let flops = grids.iter().map(|grid| self.vision.flops(*grid)).sum();
        self.shared
            .encoder_flops
            .fetch_add(flops, Ordering::Relaxed);
        for (image, out) in batch.iter().zip(outputs) {
            let tokens = out.embeddings.rows();
            let hidden = out.embeddings.cols();
            let buffer = self.runner.into_owned_buffer(out.embeddings)?;
            let deepstack = out
                .deepstack
                .into_iter()
                .map(|t| self.runner.into_owned_buffer(t))
                .collect::<Result<Vec<_>, _>>()?;
            let entry = Entry::new(buffer, tokens, hidden, self.dtype).with_deepstack(deepstack);
            self.cache.insert(image.hash.clone(), entry);
            self.written.push(image.hash.clone());
        }
        Ok(())
    }

    /// After an out-of-memory: settles the queue (a failure of work already queued is this
    /// step's device fault, and must not be consumed by the trim below), evicts every
    /// unreferenced encoder-cache entry and returns the allocator's free blocks, and what the
    /// plugin keeps for reuse, to the device.
    fn recover_memory(&mut self) -> Result<(), EncoderError> {
        self.sync()?;
        self.shared
            .faults
            .oom_recoveries
            .fetch_add(1, Ordering::Relaxed);
        let evicted = self.scheduler.evict_unreferenced();
        self.cache.free_hashes(&evicted);
        self.runner.allocator().empty_cache()?;
        // What the plugin keeps for reuse (cuDNN's plans on CUDA) is made again when needed.
        self.trim_plugin();
        Ok(())
    }

    /// Device bytes encoding `image` alone takes (its step's arena and its outputs), planned
    /// without running anything.
    fn encode_bytes(&self, image: &PreprocessedImage) -> Result<u64, EncoderError> {
        let tower = self
            .tower
            .as_ref()
            .ok_or_else(|| EncoderError::Shape("the tower is asleep".to_owned()))?;
        let plan = tower.plan_step(self.runner.allocator(), &[image.grid_thw])?;
        Ok(plan.arena_bytes().saturating_add(plan.output_bytes()))
    }

    /// How `needed` bytes compare with what the device can give, measured after memory was
    /// released: the most is its free memory plus what the allocator holds beyond the
    /// weights (other requests' outputs and this step's buffers, given back as work drains).
    fn shortfall(&self, needed: u64) -> Result<MemoryShortfall, EncoderError> {
        let stats = self.runner.allocator().stats();
        let info = self.runner.device().mem_info()?;
        Ok(MemoryShortfall {
            needed,
            available: info.free + stats.reserved.saturating_sub(self.baseline_allocated),
            others_hold: stats.allocated > self.baseline_allocated,
        })
    }

    fn fail(&mut self, id: RequestId, err: &EngineError) {
        self.scheduler.abort(id);
        if let Some(active) = self.active.remove(&id) {
            self.by_key.remove(&active.key);
            let _ = active.events.send(Event::Failed(err.clone()));
        }
    }

    fn fail_all(&mut self, err: &EngineError) {
        let ids: Vec<RequestId> = self.active.keys().copied().collect();
        for id in ids {
            self.fail(id, err);
        }
    }

    /// Empties the manager and the device cache together; in-flight requests re-encode.
    fn reset_encoder_cache(&mut self) -> ResetReport {
        let entries = self.cache.len() as u64;
        self.scheduler.reset_encoder_cache();
        let bytes = self.cache.reset();
        ResetReport {
            encoder_cache_bytes: bytes,
            encoder_cache_entries: entries,
            ..ResetReport::default()
        }
    }

    /// Returns the allocator's free blocks, then has the plugin give back what it took after
    /// open to reuse (cuDNN's plans on CUDA), so that device memory comes back to the
    /// post-start baseline.
    fn trim(&mut self) -> ResetReport {
        let released = super::release_cached(self.runner.allocator());
        ResetReport {
            allocator_bytes: released,
            plugin_cache_bytes: self.trim_plugin(),
            ..ResetReport::default()
        }
    }

    /// The plugin's `trim`: the bytes it gave back (0 where it keeps nothing for reuse, or
    /// failed, which is logged: what it kept stays reported as held).
    fn trim_plugin(&self) -> u64 {
        match self.runner.device().trim() {
            Ok(bytes) => bytes.unwrap_or(0),
            Err(err) => {
                tracing::warn!(error = %err, "the device kept what it holds for reuse");
                0
            }
        }
    }

    /// Handles a sleep command, then publishes the state the tower is in (see
    /// [`Worker::publish_sleep_level`]).
    fn sleep(&mut self, level: u8) -> Result<ResetReport, EngineError> {
        let result = self.enter_sleep(level);
        self.publish_sleep_level();
        result
    }

    /// Handles a wake-up command, then publishes the state the tower is in.
    fn wake_up(&mut self) -> Result<(), EngineError> {
        let result = self.leave_sleep();
        self.publish_sleep_level();
        result
    }

    /// Sets the engine's sleep flag to what the tower is now: 0 awake, 1 with the weights on
    /// the host, 2 with them discarded. The worker runs sleep and wake-up commands in order,
    /// so the last one run decides, whatever the callers stored meanwhile: a sleep sent while
    /// a wake-up was under way (the caller flags the engine asleep at once, to refuse new
    /// requests) left the flag at the wake-up's 0 over a sleeping tower, and every request
    /// admitted then waited for a wake-up no one would send.
    fn publish_sleep_level(&self) {
        let level = match self.asleep {
            None => 0,
            Some(Asleep::OnHost(_)) => 1,
            Some(Asleep::Discarded) => 2,
        };
        self.shared.sleep_level.store(level, Ordering::SeqCst);
    }

    fn enter_sleep(&mut self, level: u8) -> Result<ResetReport, EngineError> {
        if self.asleep.is_some() {
            if level == 2 {
                self.asleep = Some(Asleep::Discarded);
            }
            return Ok(ResetReport::default());
        }
        let Some(tower) = self.tower.take() else {
            return Err(EngineError::Internal("the tower is missing".to_owned()));
        };
        let asleep = if level == 1 {
            match tower.to_host(&self.runner) {
                Ok(host) => Asleep::OnHost(host),
                Err(err) => {
                    self.tower = Some(tower);
                    return Err(EngineError::Internal(format!(
                        "copying the weights to the host failed: {err}"
                    )));
                }
            }
        } else {
            Asleep::Discarded
        };
        drop(tower);
        self.asleep = Some(asleep);
        let mut report = self.reset_encoder_cache();
        report.processor_cache_bytes = self
            .shared
            .processor
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clear();
        let trimmed = self.trim();
        report.allocator_bytes = trimmed.allocator_bytes;
        report.plugin_cache_bytes = trimmed.plugin_cache_bytes;
        Ok(report)
    }

    fn leave_sleep(&mut self) -> Result<(), EngineError> {
        let Some(asleep) = self.asleep.take() else {
            return Ok(());
        };
        let loaded = match &asleep {
            Asleep::OnHost(host) => {
                VisionTower::new(&self.runner, self.vision.clone(), host, self.dtype)
                    .map_err(|e| e.to_string())
            }
            Asleep::Discarded => self
                .weights
                .load(&self.vision, self.dtype)
                .map_err(|e| e.to_string())
                .and_then(|host| {
                    VisionTower::from_host(&self.runner, self.vision.clone(), host, self.dtype)
                        .map_err(|e| e.to_string())
                }),
        };
        match loaded {
            Ok(tower) => {
                self.tower = Some(tower);
                Ok(())
            }
            Err(err) => {
                // Whatever was uploaded is dropped with the error; stay asleep.
                self.asleep = Some(asleep);
                self.trim();
                Err(EngineError::Internal(format!(
                    "restoring the weights failed: {err}"
                )))
            }
        }
    }

    /// Between steps: the manager's entries are the device cache's (each of the size the
    /// manager counts), the manager's own invariants hold, and the allocator's live blocks are
    /// the weights plus the cached outputs: nothing else is left behind.
    #[cfg(test)]
    fn check(&self) -> Result<(), String> {
        let manager = self.scheduler.manager();
        manager.verify()?;
        let references = manager.stats().references;
        if self.active.is_empty() && references != 0 {
            return Err(format!(
                "{references} encoder-cache references held with no request in flight"
            ));
        }
        let mut counted: Vec<(String, u64)> = manager
            .entries()
            .map(|(hash, size)| (hash.to_string(), size))
            .collect();
        counted.sort();
        let mut held: Vec<(String, u64)> = self
            .cache
            .hashes()
            .into_iter()
            .map(|hash| {
                let tokens = self.cache.get(&hash).map_or(0, |entry| entry.tokens);
                (hash, tokens)
            })
            .collect();
        held.sort();
        if counted != held {
            return Err(format!(
                "the manager counts {counted:?} but the device cache holds {held:?}"
            ));
        }
        let weights = if self.tower.is_some() {
            self.baseline_allocated
        } else {
            0
        };
        let allocated = self.runner.allocator().stats().allocated;
        if allocated != weights + self.cache.bytes() {
            return Err(format!(
                "the allocator has {allocated} bytes in live blocks, not the weights' {weights} \
                 plus the cached outputs' {}",
                self.cache.bytes()
            ));
        }
        Ok(())
    }

    /// Publishes the figures the handle reads without asking this thread.
    fn publish(&self) {
        let stats = self.scheduler.manager().stats();
        let s = &self.shared;
        s.encoder_evictions
            .store(stats.evictions, Ordering::Relaxed);
        s.encoder_cache_bytes
            .store(self.cache.bytes(), Ordering::Relaxed);
        s.encoder_cache_entries
            .store(self.cache.len() as u64, Ordering::Relaxed);
        s.encoder_cache_capacity_tokens
            .store(stats.capacity, Ordering::Relaxed);
        s.encoder_cache_free_tokens
            .store(stats.free, Ordering::Relaxed);
        s.in_flight
            .store(self.active.len() as u64, Ordering::Relaxed);
    }
}

/// Whether a step's error is the device (or the allocator) running out of memory.
fn is_out_of_memory(err: &EncoderError) -> bool {
    match err {
        EncoderError::Alloc(AllocError::OutOfMemory { .. }) => true,
        EncoderError::Alloc(AllocError::Device(err)) | EncoderError::Device(err) => {
            err.is_out_of_memory()
        }
        _ => false,
    }
}

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_shortfall_is_transient_only_when_draining_work_would_make_room() {
        let error = |needed, available, others_hold| {
            MemoryShortfall {
                needed,
                available,
                others_hold,
            }
            .error("image 3")
        };
        match error(5000, 4000, true) {
            EngineError::TooLargeForDevice {
                message,
                needed_bytes,
                available_bytes,
            } => {
                assert_eq!((needed_bytes, available_bytes), (5000, 4000));
                assert!(
                    message.contains("image 3")
                        && message.contains("5000")
                        && message.contains("4000"),
                    "{message}"
                );
            }
            other => panic!("expected TooLargeForDevice, got {other:?}"),
        }
        // Nothing else holds memory: waiting would not help, whatever the estimate says.
        assert!(matches!(
            error(3000, 4000, false),
            EngineError::TooLargeForDevice { .. }
        ));
        match error(3000, 4000, true) {
            EngineError::OutOfMemory {
                message,
                retry_after_s,
            } => {
                assert_eq!(retry_after_s, OUT_OF_MEMORY_RETRY_AFTER_S);
                assert!(
                    message.contains("image 3") && message.contains("3000"),
                    "{message}"
                );
            }
            other => panic!("expected OutOfMemory, got {other:?}"),
        }
    }
}
