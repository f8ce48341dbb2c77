//! The engine-core thread: it alone owns the device, the vision tower, the scheduler with its
//! encoder cache manager and the device encoder cache, and runs steps between commands.
//!
//! A step: schedule -> free what the manager evicted -> encode the newly scheduled items in one
//! tower call -> store the outputs in the device cache -> gather every scheduled position into
//! the step's input-embedding buffer (text positions zero, a mask marking image positions) ->
//! deliver each request its rows -> mark the tokens consumed and finish requests. Commands
//! (new requests, aborts, resets, sleep, wake-up) are taken between steps, which is where the
//! scheduler's reset contract wants them.

use std::collections::HashMap;
use std::sync::atomic::Ordering;
use std::sync::mpsc::{Receiver, TryRecvError};
use std::sync::{Arc, PoisonError};
use std::time::{Duration, Instant};

use tokio::sync::{mpsc, oneshot};

use crate::budget::EncoderBudget;
use crate::cache::device::{DeviceEncoderCache, Entry};
use crate::cache::encoder::{EncoderCacheManagement, EncoderCacheManager};
use crate::encoder::EncoderError;
use crate::encoder::exec::Runner;
use crate::encoder::tower::VisionTower;
use crate::engine::Shared;
use crate::engine::api::{EngineError, ResetReport};
use crate::engine::prompt::{Chunk, Event, PromptLayout};
use crate::model::{HostWeights, VisionConfig, WeightSource};
use crate::preprocess::PreprocessedImage;
use crate::scheduler::{RequestId, Scheduler, SchedulerError, SchedulerPolicy, StepOutput};
use iris_plugin::{CopyRegion, DType};

/// A request handed to the engine core.
pub(crate) struct AddRequest {
    /// The handle's key for it (aborts name it).
    pub key: u64,
    pub images: Vec<Arc<PreprocessedImage>>,
    pub layout: PromptLayout,
    pub return_embeddings: bool,
    pub events: mpsc::UnboundedSender<Event>,
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
}

struct Active {
    key: u64,
    images: Vec<Arc<PreprocessedImage>>,
    layout: PromptLayout,
    return_embeddings: bool,
    events: mpsc::UnboundedSender<Event>,
    encoded: Vec<bool>,
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
            runner,
            vision: tower.config().clone(),
            dtype: tower.dtype(),
            tower: Some(tower),
            weights,
            scheduler,
            cache: DeviceEncoderCache::new(),
            asleep: None,
            active: HashMap::new(),
            by_key: HashMap::new(),
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
                if let Some(id) = self.by_key.remove(&key) {
                    self.scheduler.abort(id);
                    self.active.remove(&id);
                }
                self.publish();
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
                    },
                );
            }
            Err(SchedulerError::Budget { index, source }) => {
                let _ = request.events.send(Event::Failed(EngineError::BadInput {
                    message: format!("image {index}: {source}"),
                    code: "image_over_budget",
                }));
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
        // The step is done when the device has finished its work: only then do requests hear
        // of their chunks, and a failure of queued work fails this step, not a later one.
        let result = self.run_step(&output).and_then(|chunks| {
            self.runner.device().synchronize()?;
            Ok(chunks)
        });
        match result {
            Ok(chunks) => self.deliver(chunks),
            Err(err) => self.fail_step(&output, &err),
        }
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

    /// Fails the requests of a step whose work failed.
    fn fail_step(&mut self, output: &StepOutput, err: &EncoderError) {
        let err = EngineError::Internal(err.to_string());
        for (id, _) in &output.scheduled {
            self.fail(*id, &err);
        }
        // The manager may now count items whose outputs never reached the device cache;
        // emptying both keeps them in agreement (other requests re-encode what they need).
        self.reset_encoder_cache();
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

    /// Enqueues a step's work: the encoder on newly scheduled items, then the gather of every
    /// scheduled position into the step's input embeddings. Returns each request's chunk.
    fn run_step(&mut self, output: &StepOutput) -> Result<Vec<(RequestId, Chunk)>, EncoderError> {
        self.encode(output)?;
        let hidden = self.vision.out_hidden as u64;
        let total = output.total_tokens();
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
        let row_bytes = hidden * self.dtype.size().unwrap_or(4);
        let dst = buffers.mat();
        let mut regions = Vec::new();
        let mut text_rows = 0u64;
        let mut row = 0;
        for &(id, tokens) in &output.scheduled {
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
        let mut chunks = Vec::with_capacity(output.scheduled.len());
        let mut row = 0;
        for &(id, tokens) in &output.scheduled {
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

    /// Runs the tower once on every newly scheduled item of the step and stores the outputs.
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
        let input = self
            .runner
            .upload_f32_parts(&parts, self.dtype, rows, row_len)?;
        let started = Instant::now();
        // Forward enqueues the graph; the encoder's time is that of completed work.
        let outputs = tower
            .forward(&self.runner, &input, &grids)
            .and_then(|outputs| {
                self.runner.device().synchronize()?;
                Ok(outputs)
            });
        self.shared
            .encoder_time_ns
            .fetch_add(nanos(started.elapsed()), Ordering::Relaxed);
        let outputs = outputs?;
        drop(input);
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
        }
        Ok(())
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

    fn trim(&mut self) -> ResetReport {
        // A failed release leaves the blocks cached; the next trim tries again.
        let released = self.runner.allocator().empty_cache().unwrap_or(0);
        ResetReport {
            allocator_bytes: released,
            ..ResetReport::default()
        }
    }

    fn sleep(&mut self, level: u8) -> Result<ResetReport, EngineError> {
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
        report.allocator_bytes = self.trim().allocator_bytes;
        Ok(report)
    }

    fn wake_up(&mut self) -> Result<(), EngineError> {
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
                    VisionTower::new(&self.runner, self.vision.clone(), &host, self.dtype)
                        .map_err(|e| e.to_string())
                }),
        };
        match loaded {
            Ok(tower) => {
                self.tower = Some(tower);
                self.shared.sleep_level.store(0, Ordering::SeqCst);
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

fn nanos(d: Duration) -> u64 {
    u64::try_from(d.as_nanos()).unwrap_or(u64::MAX)
}
