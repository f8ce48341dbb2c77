//! The engine's request and report types, shared by the in-process API and the HTTP server.

/// One image of a request: the encoded file bytes (PNG, JPEG, WebP), not yet decoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ImageInput {
    /// Encoded image file bytes, as sent by the client after base64 decoding.
    pub bytes: Vec<u8>,
}

/// One video of a request, decoded: the frames its loader read and the loader's metadata
/// (from [`Engine::load_video`](super::Engine::load_video), or from
/// [`load_video`](crate::preprocess::video::ffmpeg::load_video) directly). The engine resizes
/// and patchifies the frames with the model's video processor.
#[derive(Debug, Clone, PartialEq)]
pub struct VideoInput {
    /// The frames and metadata; shared, since a request may keep them for its identifier too.
    pub video: std::sync::Arc<crate::preprocess::video::ffmpeg::DecodedVideo>,
}

/// One media item of a request.
#[derive(Debug, Clone, PartialEq)]
pub enum MediaInput {
    /// An encoded image.
    Image(ImageInput),
    /// A decoded video.
    Video(VideoInput),
}

impl From<ImageInput> for MediaInput {
    fn from(image: ImageInput) -> Self {
        MediaInput::Image(image)
    }
}

impl From<VideoInput> for MediaInput {
    fn from(video: VideoInput) -> Self {
        MediaInput::Video(video)
    }
}

/// Per-request options of an encode call.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct EncodeOptions {
    /// Copy the encoder outputs back to the host and return them.
    pub return_embeddings: bool,
    /// The request's processor settings (`mm_processor_kwargs`), over the model's.
    pub processor: ProcessorOverrides,
}

/// A request's processor settings over the model's (`mm_processor_kwargs` as the Qwen
/// processors take them). `None` keeps the model's value.
///
/// A request may narrow the pixel range, not widen it past the model's `max_pixels`: the
/// engine's token budgets and memory profile were sized for that largest item.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProcessorOverrides {
    /// Lower bound on resized pixels.
    pub min_pixels: Option<u64>,
    /// Upper bound on resized pixels (at most the model's).
    pub max_pixels: Option<u64>,
    /// The colour transparent images are pasted on (`media_io_kwargs.image.
    /// rgba_background_color`); `None` keeps the model's alpha handling (white).
    pub background: Option<[u8; 3]>,
}

impl ProcessorOverrides {
    /// Whether nothing is overridden.
    #[must_use]
    pub fn is_empty(&self) -> bool {
        self.min_pixels.is_none() && self.max_pixels.is_none() && self.background.is_none()
    }
}

/// What preprocessing found for one image, before any encoding.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImagePlan {
    /// Grid `[t, h, w]` in patches, before spatial merge.
    pub grid_thw: [u32; 3],
    /// Embedding tokens the item produces.
    pub num_tokens: u64,
}

/// The shape of the engine's outputs per embedding token.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct OutputLayout {
    /// Values per row of the main output (the tower's `out_hidden_size`).
    pub hidden: u64,
    /// Deepstack levels, each another `hidden` values per row (Qwen3-VL); 0 otherwise.
    pub deepstack_levels: u64,
    /// The engine's run dtype, in which its outputs live on the device.
    pub dtype: iris_plugin::DType,
}

/// A host copy of one tensor: row-major `f32` data and its `[rows, cols]` shape.
pub type HostTensor = (Vec<f32>, [u64; 2]);

/// The result for one image of an encode call, in request order.
#[derive(Debug, Clone, PartialEq)]
pub struct ImageResult {
    /// The item's content hash.
    pub mm_hash: String,
    /// Grid `[t, h, w]` in patches, before spatial merge.
    pub grid_thw: [u32; 3],
    /// Embedding tokens the item produces (rows of encoder output after merge).
    pub num_tokens: u64,
    /// True when the encoder output came from the encoder cache.
    pub cached: bool,
    /// The encoder output `[tokens, hidden]`, when asked for.
    pub embeddings: Option<HostTensor>,
    /// Deepstack outputs (Qwen3-VL), one `[tokens, hidden]` tensor per level; empty otherwise
    /// or when embeddings were not asked for.
    pub deepstack: Vec<HostTensor>,
}

/// Why the engine refused or failed a call.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[non_exhaustive]
pub enum EngineError {
    /// The client's input is unusable (corrupt image, dimensions over the limit, ...): a 4xx.
    #[error("{message}")]
    BadInput {
        /// What is wrong, naming the item and the numbers.
        message: String,
        /// A stable machine-readable code, e.g. `image_too_large`.
        code: &'static str,
    },
    /// The engine is asleep; the request was not run: a 503.
    #[error("the engine is sleeping; call POST /wake_up first")]
    Sleeping,
    /// The engine cannot take more work now: a 503.
    #[error("the engine is overloaded; retry later")]
    Overloaded,
    /// A fault inside iris or the device: a 500.
    #[error("internal error: {0}")]
    Internal(String),
    /// The engine-core thread panicked and the engine refuses every call: a 503. The process
    /// needs a restart.
    #[error("the engine is dead: {0}")]
    Dead(String),
    /// The device does not answer (lost, reset, driver gone), or can no longer compute (a
    /// fault left its context unusable, as an illegal address does on CUDA): a 503. Every later
    /// request fails the same way; the process needs a restart.
    #[error("the device is unavailable: {0}")]
    DeviceLost(String),
    /// An item needs more device memory than the device can ever give it, even with nothing
    /// else running: a 4xx (the client must send a smaller image).
    #[error("{message}")]
    TooLargeForDevice {
        /// What does not fit, with both numbers.
        message: String,
        /// Bytes the item needs.
        needed_bytes: u64,
        /// The most the device can give it.
        available_bytes: u64,
    },
    /// An item did not fit in device memory next to the work in flight, but fits once that
    /// work drains: a 503 with `Retry-After`.
    #[error("{message}")]
    OutOfMemory {
        /// What did not fit, with the numbers.
        message: String,
        /// Seconds to wait before retrying.
        retry_after_s: u64,
    },
    /// The server cannot take this kind of input as installed (a video without FFmpeg): a 501
    /// that says what to install.
    #[error("{message}")]
    Unsupported {
        /// What is missing and how to get it.
        message: String,
        /// A stable machine-readable code, e.g. `video_decoder_missing`.
        code: &'static str,
    },
    /// A device error other than out of memory or the device's loss failed the step that ran
    /// the request: a 500.
    /// The engine goes on; other requests are not affected.
    #[error("device error: {0}")]
    Device(String),
}

/// What a reset or sleep released, in bytes and entries.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ResetReport {
    /// Bytes of preprocessed payload dropped from the processor cache.
    pub processor_cache_bytes: u64,
    /// Device bytes of encoder outputs freed from the encoder cache.
    pub encoder_cache_bytes: u64,
    /// Encoder cache entries dropped.
    pub encoder_cache_entries: u64,
    /// Reserved bytes the caching allocator returned to the device.
    pub allocator_bytes: u64,
    /// Device bytes the device's plugin gave back from what it took after open to reuse (on
    /// CUDA, cuDNN's attention plans built since and the kernels they loaded), as the device's
    /// used memory fell.
    pub plugin_cache_bytes: u64,
}

/// Device memory figures at one instant, in bytes.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MemoryGauges {
    /// Device used as the driver sees it: total - free.
    pub device_used_bytes: u64,
    /// Device total as the driver sees it.
    pub device_total_bytes: u64,
    /// Bytes the caching allocator holds from the device.
    pub allocator_reserved_bytes: u64,
    /// Bytes of the reserved memory handed out to live tensors.
    pub allocator_allocated_bytes: u64,
    /// Peak of allocated bytes since start (or the last peak reset).
    pub allocator_peak_bytes: u64,
    /// Device bytes held by the encoder cache's buffers.
    pub encoder_cache_bytes: u64,
    /// Entries resident in the encoder cache.
    pub encoder_cache_entries: u64,
    /// Host bytes of preprocessed payload in the processor cache.
    pub processor_cache_bytes: u64,
    /// Entries in the processor cache.
    pub processor_cache_entries: u64,
    /// Device bytes the device plugin reports holding outside the allocator's buffers (its
    /// context and streams, allocation padding and page rounding): part of `device_used_bytes
    /// - allocator_reserved_bytes`.
    #[serde(default)]
    pub plugin_held_bytes: u64,
}

/// Cumulative counters and current gauges, read by `GET /metrics` and `GET /memory`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct MetricsSnapshot {
    /// Processor cache lookups that found the item.
    pub processor_cache_hits: u64,
    /// Processor cache lookups that missed.
    pub processor_cache_misses: u64,
    /// Processor cache entries evicted for space.
    pub processor_cache_evictions: u64,
    /// Encoder cache lookups that found the item's output.
    pub encoder_cache_hits: u64,
    /// Encoder cache lookups that missed (the item was encoded).
    pub encoder_cache_misses: u64,
    /// Encoder cache entries evicted for space.
    pub encoder_cache_evictions: u64,
    /// Device encoder-cache misses answered by encoding the item again.
    #[serde(default)]
    pub encoder_cache_reencodes: u64,
    /// Out-of-memory recoveries during steps (unreferenced entries evicted, free blocks
    /// trimmed, work retried).
    #[serde(default)]
    pub oom_recoveries: u64,
    /// Encoder batches or step gathers split in halves after an out-of-memory.
    #[serde(default)]
    pub oom_batch_splits: u64,
    /// Requests failed because an item did not fit in device memory.
    #[serde(default)]
    pub oom_failures: u64,
    /// Steps failed by a device error other than out of memory.
    #[serde(default)]
    pub device_faults: u64,
    /// Engine steps run.
    #[serde(default)]
    pub steps: u64,
    /// Time spent in steps (scheduling, encoding, cache upkeep, gathering, delivery), in ns.
    #[serde(default)]
    pub step_time_ns: u64,
    /// Of that, time in the vision tower's forward passes, in ns.
    #[serde(default)]
    pub encoder_time_ns: u64,
    /// Floating-point operations of those forward passes, as the tower's FLOP count
    /// ([`crate::model::VisionConfig::flops`]) has them.
    #[serde(default)]
    pub encoder_flops: u64,
    /// The device's dense FLOP/s at the engine's dtype (its `peak_flops` property), whole;
    /// `None` when the device reports none.
    #[serde(default)]
    pub peak_flops: Option<u64>,
    /// Backpressure: the bounds and what is pending against them.
    #[serde(default)]
    pub admission: AdmissionStats,
    /// Memory now.
    pub memory: MemoryGauges,
    /// Memory before the engine loaded anything (the pre-start baseline).
    pub before_start: MemoryGauges,
    /// Memory once start-up (weights, profiling, cache set-up) finished: the post-start baseline.
    pub after_start: MemoryGauges,
}

/// The engine's admission bounds and what is pending against them: requests admitted and not
/// finished (preprocessing, queued or running) and their embedding tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct AdmissionStats {
    /// Most requests pending at once; more are refused with 503 `overloaded`.
    pub max_queued_requests: u64,
    /// Most embedding tokens pending at once; more are refused with 503 `overloaded`.
    pub max_pending_tokens: u64,
    /// Requests pending now.
    pub pending_requests: u64,
    /// Embedding tokens pending now.
    pub pending_tokens: u64,
    /// Most requests ever pending at once since start.
    pub peak_pending_requests: u64,
    /// Most embedding tokens ever pending at once since start.
    pub peak_pending_tokens: u64,
    /// Requests refused as overloaded since start.
    pub rejected_requests: u64,
}
