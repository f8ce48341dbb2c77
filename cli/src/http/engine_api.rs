//! The engine interface the HTTP server is written against.
//!
//! The server never reaches into the engine's internals: every route is one call on [`Engine`].
//! Methods that wait on the engine-core thread return `Send` futures so that handlers can run on
//! a multi-threaded tokio runtime; implementors may still write them as `async fn`.

use std::future::Future;

pub use iris_core::engine::api::{
    EncodeOptions, EngineError, HostTensor, ImageInput, ImageResult, MemoryGauges, MetricsSnapshot,
    ResetReport,
};

/// The engine as the HTTP server sees it.
pub trait Engine: Send + Sync + 'static {
    /// Encodes `images` (one request), returning one result per image in order.
    fn encode(
        &self,
        images: Vec<ImageInput>,
        opts: EncodeOptions,
    ) -> impl Future<Output = Result<Vec<ImageResult>, EngineError>> + Send;
    /// Clears the processor cache.
    fn reset_mm_cache(&self) -> impl Future<Output = ResetReport> + Send;
    /// Clears the encoder cache (manager and device buffers).
    fn reset_encoder_cache(&self) -> impl Future<Output = ResetReport> + Send;
    /// Returns the allocator's unused reserved blocks to the device.
    fn reset_allocator(&self) -> impl Future<Output = ResetReport> + Send;
    /// All three resets, in order: processor cache, encoder cache, allocator.
    fn reset_all(&self) -> impl Future<Output = ResetReport> + Send;
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
