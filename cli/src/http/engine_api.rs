//! The engine interface the HTTP server is written against.
//!
//! The server never reaches into the engine's internals: every route is one call on [`Engine`].
//! Methods that wait on the engine-core thread return `Send` futures so that handlers can run on
//! a multi-threaded tokio runtime; implementors may still write them as `async fn`.

use std::future::Future;

pub use iris_core::engine::api::{
    EncodeOptions, EngineError, HostTensor, ImageInput, ImagePlan, ImageResult, MediaInput,
    MemoryGauges, MetricsSnapshot, OutputLayout, ProcessorOverrides, ResetReport, VideoInput,
};
pub use iris_core::model::VideoProcessing;
pub use iris_core::preprocess::ImageSize;
pub use iris_core::preprocess::video::SamplingOptions;
pub use iris_core::preprocess::video::ffmpeg::{DecodedVideo, OpenedClip};

/// The engine as the HTTP server sees it.
pub trait Engine: Send + Sync + 'static {
    /// A request's hold on the engine's backpressure bounds, given back when dropped.
    type Permit: Send + Sync + 'static;
    /// A share of a permit that blocking work keeps while it runs, so that a request whose
    /// client hung up stays counted until its work is done.
    type Hold: Send + 'static;
    /// A share of `permit` for blocking work of its request.
    fn hold(&self, permit: &Self::Permit) -> Self::Hold;
    /// Takes a request slot before the request body is read: `Err(Overloaded)` beyond the
    /// engine's bounds, `Err(Dead)` once the engine died.
    fn admit(&self) -> Result<Self::Permit, EngineError>;
    /// Encodes `items` (one admitted request), returning one result per item in order.
    fn encode(
        &self,
        permit: Self::Permit,
        items: Vec<MediaInput>,
        opts: EncodeOptions,
    ) -> impl Future<Output = Result<Vec<ImageResult>, EngineError>> + Send;
    /// Preprocesses `items` of an admitted request (through the processor cache) and reports
    /// each one's grid and tokens, without encoding. Their tokens are charged to `permit`
    /// before any resizing, so the preprocessing is bounded as an encode's is; an `encode`
    /// of the same items with that permit charges nothing more.
    fn plan(
        &self,
        permit: &mut Self::Permit,
        items: &[MediaInput],
        overrides: &ProcessorOverrides,
    ) -> impl Future<Output = Result<Vec<ImagePlan>, EngineError>> + Send;
    /// Probes a clip and samples its frames as the model's video loader does, decoding none;
    /// `Err(Unsupported)` when the engine cannot decode videos (FFmpeg missing).
    fn open_video(
        &self,
        bytes: Vec<u8>,
        sampling: SamplingOptions,
    ) -> impl Future<Output = Result<OpenedClip, EngineError>> + Send;
    /// Charges to `permit` the tokens of video `index` of the request, `frames` frames of
    /// `size`, under `overrides`, before its frames are decoded; `Err` for a video beyond the
    /// scheduler's budget, or beyond the token bound (`Overloaded`).
    fn reserve_video(
        &self,
        permit: &mut Self::Permit,
        index: usize,
        frames: usize,
        size: ImageSize,
        overrides: &ProcessorOverrides,
    ) -> Result<(), EngineError>;
    /// Reads an opened clip's sampled frames, with vLLM's metadata; `hold` (of the request's
    /// permit) is kept until the decoding ends.
    fn decode_video(
        &self,
        clip: OpenedClip,
        hold: Self::Hold,
    ) -> impl Future<Output = Result<DecodedVideo, EngineError>> + Send;
    /// The model's video processing (loader, resize rule, processor settings).
    fn video_processing(&self) -> VideoProcessing;
    /// The shape and dtype of the engine's outputs.
    fn output_layout(&self) -> OutputLayout;
    /// `Ok` while the engine can serve; `Err(Dead)` or `Err(DeviceLost)` otherwise.
    fn health(&self) -> Result<(), EngineError>;
    /// Clears the processor cache.
    fn reset_mm_cache(&self) -> impl Future<Output = Result<ResetReport, EngineError>> + Send;
    /// Clears the encoder cache (manager and device buffers).
    fn reset_encoder_cache(&self) -> impl Future<Output = Result<ResetReport, EngineError>> + Send;
    /// Returns the allocator's unused reserved blocks to the device.
    fn reset_allocator(&self) -> impl Future<Output = Result<ResetReport, EngineError>> + Send;
    /// All three resets, in order: processor cache, encoder cache, allocator.
    fn reset_all(&self) -> impl Future<Output = Result<ResetReport, EngineError>> + Send;
    /// Puts the engine to sleep at `level` 1 (weights to host) or 2 (weights discarded).
    fn sleep(&self, level: u8) -> impl Future<Output = Result<ResetReport, EngineError>> + Send;
    /// Wakes the engine up, restoring weights.
    fn wake_up(&self) -> impl Future<Output = Result<(), EngineError>> + Send;
    /// Whether the engine is asleep.
    fn is_sleeping(&self) -> bool;
    /// The memory snapshot plus both caches' entries and bytes, as JSON.
    fn memory(&self) -> serde_json::Value;
    /// Configuration and environment, as JSON.
    fn server_info(&self) -> serde_json::Value;
    /// Cache counters and memory gauges.
    fn metrics_snapshot(&self) -> MetricsSnapshot;
}
