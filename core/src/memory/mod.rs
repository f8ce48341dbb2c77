//! Device memory: the caching allocator every device byte comes from, and the snapshots and
//! profiling that account for it.
//!
//! - [`allocator`]: [`CachingAllocator`] (size-class pools, best-fit reuse, splitting and
//!   merging, `empty_cache`, empty-and-retry on out-of-memory) and the RAII [`DeviceBuffer`].
//! - [`snapshot`]: [`MemorySnapshot`] (device and allocator figures, non-allocator memory),
//!   [`MemoryProfiler`] / [`MemoryProfile`] (vLLM's `memory_profiling`) and
//!   [`requested_memory`].

pub mod allocator;
pub mod snapshot;

pub use allocator::{
    AllocError, AllocatorStats, BlockInfo, CachingAllocator, DeviceBuffer, PoolKind, SegmentInfo,
};
pub use snapshot::{
    MemoryProfile, MemoryProfiler, MemorySnapshot, check_free_at_start, requested_memory,
};

#[cfg(test)]
mod proptests;
