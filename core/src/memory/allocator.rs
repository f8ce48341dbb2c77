//! The caching allocator: every device byte core uses comes from here.
//!
//! Anchor: PyTorch's CUDA caching allocator (`c10/cuda/CUDACachingAllocator.cpp`). Raw device
//! allocations ("segments") are carved into blocks; a freed block goes back to a free list of
//! its pool instead of to the device, so the next request of a similar size costs no device
//! call. The device's "used memory" therefore does not drop when a buffer is dropped; it drops
//! when [`CachingAllocator::empty_cache`] returns every segment without a live block.
//!
//! Size classes (the same constants as PyTorch):
//!
//! - every request is rounded up to a multiple of [`MIN_BLOCK_SIZE`] (512 B);
//! - requests of at most [`SMALL_SIZE`] (1 MiB) are served from the small pool, whose segments
//!   are [`SMALL_SEGMENT`] (2 MiB) each;
//! - larger requests are served from the large pool: below [`MIN_LARGE_ALLOC`] (10 MiB) from
//!   [`LARGE_SEGMENT`] (20 MiB) segments, from [`MIN_LARGE_ALLOC`] up from a segment of the
//!   request rounded up to [`ROUND_LARGE`] (2 MiB).
//!
//! Unlike PyTorch, a segment that would be larger than the request (a 20 MiB segment for a
//! 3 MiB request) falls back to a segment of exactly the rounded request when the device cannot
//! supply the larger one, so small devices (the CPU device with a few MiB of capacity) are not
//! refused memory they have.
//!
//! Free blocks are kept in one ordered set per pool, keyed by `(size, segment, offset)`, so the
//! first key at or above the rounded request is the best fit (smallest sufficient block, then
//! the oldest segment, then the lowest offset). A block larger than the request is split when the
//! remainder is worth keeping (small pool: at least [`MIN_BLOCK_SIZE`]; large pool: more than
//! [`SMALL_SIZE`]); a freed block merges with free neighbours in its segment, so a segment whose
//! blocks are all free is one free block, which `empty_cache` returns to the device.
//!
//! A step's activations come as one block ([`CachingAllocator::alloc_whole`], the *whole*
//! pool): a segment of exactly the rounded request, never split, reused whole by a request it
//! fits, and given back (with every other idle whole segment) when a larger one is needed, so
//! the planned arena of a step costs what its plan says and no more (see
//! `crate::encoder::plan`).
//!
//! When the device reports out of memory, the allocator empties its cache and retries once
//! (counted in [`AllocatorStats::oom_retries`]); if that fails too, it reports
//! [`AllocError::OutOfMemory`] with the request, its own figures and the device's.
//!
//! [`CachingAllocator::dry_run`] copies the books (segments, blocks, free lists, counters) into
//! an allocator over *virtual* memory of the device's free size: the same code takes the same
//! decisions for the same requests (rounding, best fit, splitting, segment sizes, the
//! empty-and-retry and the fallback to an exact segment), but a new segment is a number, not
//! device memory. Its peaks are what the real allocator would reach for the same sequence of
//! allocations and frees, which is how start-up sizes a step without running it.

use std::collections::{BTreeMap, BTreeSet};
use std::fmt;
use std::sync::{Arc, Mutex, MutexGuard, PoisonError};

use iris_plugin::abi::BufferSlice;
use iris_plugin::{BufferHandle, DType, Device, DeviceError, MatRef};
use serde::Serialize;
use thiserror::Error;

/// Every block size is a multiple of this many bytes (PyTorch's `kMinBlockSize`).
pub const MIN_BLOCK_SIZE: u64 = 512;
/// Largest request served from the small pool (PyTorch's `kSmallSize`).
pub const SMALL_SIZE: u64 = 1 << 20;
/// Size of a small-pool segment (PyTorch's `kSmallBuffer`).
pub const SMALL_SEGMENT: u64 = 2 << 20;
/// Requests from this size up get a segment of their own size (PyTorch's `kMinLargeAlloc`).
pub const MIN_LARGE_ALLOC: u64 = 10 << 20;
/// Size of a large-pool segment for requests below [`MIN_LARGE_ALLOC`] (PyTorch's
/// `kLargeBuffer`).
pub const LARGE_SEGMENT: u64 = 20 << 20;
/// Segments for requests of at least [`MIN_LARGE_ALLOC`] are rounded up to a multiple of this
/// (PyTorch's `kRoundLarge`).
pub const ROUND_LARGE: u64 = 2 << 20;

/// Errors of the memory layer: allocation, transfers into allocated buffers, snapshots and
/// memory budgeting.
#[derive(Debug, Error)]
#[non_exhaustive]
pub enum AllocError {
    /// An argument is out of range (a zero-byte allocation, a size that overflows, a
    /// utilization outside `(0, 1]`).
    #[error("invalid argument `{argument}`: {message}")]
    InvalidArgument {
        /// The argument at fault.
        argument: &'static str,
        /// What is wrong with it.
        message: String,
    },
    /// The device could not supply memory even after the allocator returned its cache.
    #[error(
        "out of device memory: {requested} bytes requested ({rounded} after rounding); the allocator holds {allocated} bytes allocated of {reserved} reserved; {}: {message}",
        device_memory(*device_free, *device_total)
    )]
    OutOfMemory {
        /// Bytes asked for.
        requested: u64,
        /// Bytes after rounding to the size class.
        rounded: u64,
        /// Bytes in live blocks at the time of failure.
        allocated: u64,
        /// Bytes held from the device at the time of failure (after emptying the cache).
        reserved: u64,
        /// Free device bytes, if the device could report them.
        device_free: Option<u64>,
        /// Total device bytes, if the device could report them.
        device_total: Option<u64>,
        /// The device's own message.
        message: String,
    },
    /// A read or write outside a buffer's requested length.
    #[error("{op}: bytes [{offset}, {offset}+{bytes}) lie outside the buffer of {len} bytes")]
    OutOfBounds {
        /// `read` or `write`.
        op: &'static str,
        /// Byte offset inside the buffer.
        offset: u64,
        /// Number of bytes.
        bytes: u64,
        /// The buffer's length.
        len: u64,
    },
    /// Returning cached segments to the device failed for some of them; the others were
    /// released. The failed segments stay reserved (and are retried by the next
    /// `empty_cache`).
    #[error(
        "returning cached memory to the device: {released} bytes released, {failed} segment(s) failed; first failure: {source}"
    )]
    ReleaseFailed {
        /// Bytes that were returned.
        released: u64,
        /// Segments the device refused to free.
        failed: u64,
        /// The first device error.
        source: DeviceError,
    },
    /// The device had less free memory at start than iris is configured to use.
    #[error(
        "the device has {free} of {total} bytes free at start, less than the {requested} bytes requested; lower the memory utilization or free the device"
    )]
    InsufficientFreeMemory {
        /// Free device bytes.
        free: u64,
        /// Total device bytes.
        total: u64,
        /// Bytes iris was to use.
        requested: u64,
    },
    /// Weights, peak activations and non-allocator memory leave nothing of the requested
    /// budget.
    #[error(
        "no memory left of the {requested} bytes requested: weights take {weights}, the peak activation increase {peak_increase} and non-allocator growth {non_allocator_increase}"
    )]
    BudgetExceeded {
        /// Bytes iris was to use.
        requested: u64,
        /// Bytes of weights.
        weights: u64,
        /// Peak activation bytes.
        peak_increase: u64,
        /// Non-allocator growth in bytes.
        non_allocator_increase: u64,
    },
    /// Any other device error, with the device's message.
    #[error(transparent)]
    Device(#[from] DeviceError),
}

/// The allocator's counters. Byte figures count whole blocks (after rounding and unsplit
/// remainders), except `requested`, which counts what callers asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize)]
pub struct AllocatorStats {
    /// Bytes in live blocks.
    pub allocated: u64,
    /// Bytes held from the device (sum of segment sizes).
    pub reserved: u64,
    /// Highest `allocated` since creation or [`CachingAllocator::reset_peaks`].
    pub peak_allocated: u64,
    /// Highest `reserved` since creation or [`CachingAllocator::reset_peaks`].
    pub peak_reserved: u64,
    /// Bytes requested by the live buffers (before rounding).
    pub requested: u64,
    /// Live buffers.
    pub live_buffers: u64,
    /// Raw device allocations made (segments created), ever.
    pub raw_allocs: u64,
    /// Raw device frees made (segments returned), ever.
    pub raw_frees: u64,
    /// Times an allocation emptied the cache and retried after a device out-of-memory.
    pub oom_retries: u64,
    /// Segments currently held.
    pub segments: u64,
}

impl AllocatorStats {
    /// Bytes reserved but not in a live block: what [`CachingAllocator::empty_cache`] could
    /// give back at most.
    pub fn cached(&self) -> u64 {
        self.reserved.saturating_sub(self.allocated)
    }
}

/// The pool a segment belongs to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum PoolKind {
    /// Requests of at most [`SMALL_SIZE`] bytes.
    Small,
    /// Larger requests.
    Large,
    /// Blocks taken whole ([`CachingAllocator::alloc_whole`]): one block per segment.
    Whole,
}

/// One segment and its blocks, as [`CachingAllocator::segments`] reports them (PyTorch's
/// `memory_snapshot`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct SegmentInfo {
    /// The raw device buffer.
    pub handle: u64,
    /// Bytes of the segment.
    pub size: u64,
    /// The pool it serves.
    pub pool: PoolKind,
    /// Its blocks in offset order; together they cover the segment exactly.
    pub blocks: Vec<BlockInfo>,
}

/// One block of a segment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct BlockInfo {
    /// Byte offset inside the segment.
    pub offset: u64,
    /// Bytes of the block.
    pub size: u64,
    /// Bytes the live buffer asked for, or `None` for a free block.
    pub requested: Option<u64>,
}

/// A caching allocator over one device. Create it with [`CachingAllocator::new`] and share the
/// `Arc`; buffers keep it alive.
pub struct CachingAllocator {
    device: Arc<Device>,
    state: Mutex<State>,
    /// Held by a reader on another thread (a memory snapshot) from before it waits for the
    /// device's queue until it has stored the failure that wait may have taken, and by
    /// [`CachingAllocator::synchronize`] before it looks for one. The reader waits without the
    /// books' lock, so the thread that runs work can allocate meanwhile.
    reader_wait: Mutex<()>,
}

/// Device memory a dry-run allocator draws its segments from: a count of free bytes.
#[derive(Debug, Clone, Copy)]
struct VirtualMemory {
    free: u64,
    total: u64,
}

impl fmt::Debug for CachingAllocator {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CachingAllocator")
            .field("device", &self.device)
            .field("stats", &self.stats())
            .field("dry_run", &self.is_dry_run())
            .finish()
    }
}

impl CachingAllocator {
    /// An allocator with an empty cache over `device`.
    pub fn new(device: Arc<Device>) -> Arc<CachingAllocator> {
        Arc::new(CachingAllocator {
            device,
            state: Mutex::new(State::default()),
            reader_wait: Mutex::new(()),
        })
    }

    /// The device the memory comes from.
    pub fn device(&self) -> &Arc<Device> {
        &self.device
    }

    /// A copy of this allocator's books over virtual memory of the device's current free size,
    /// with the peaks reset: allocating from it decides exactly as this allocator would from
    /// its present state (the same blocks reused, split and merged, the same segments created
    /// and, under pressure, emptied), but no device memory is touched, so its peaks are those a
    /// real run of the same allocations would reach. Its buffers have no memory: reading or
    /// writing them is an error, and their handles are null.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use iris_core::memory::CachingAllocator;
    /// let plugin = iris_plugin::Plugin::builtin(iris_device_cpu::plugin_root());
    /// let device = Arc::new(plugin.open(0, &[("capacity".into(), "64MiB".into())])?);
    /// let allocator = CachingAllocator::new(device);
    /// let dry = allocator.dry_run()?;
    /// let buffer = dry.alloc(3 << 20)?;
    /// // A 20 MiB segment, as the real allocator would create for 3 MiB, on paper only.
    /// assert_eq!(dry.stats().peak_reserved, 20 << 20);
    /// assert_eq!(allocator.stats().reserved, 0);
    /// assert!(buffer.write(0, &[1]).is_err());
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    ///
    /// # Errors
    /// The device's error when it cannot report its free memory.
    pub fn dry_run(&self) -> Result<Arc<CachingAllocator>, AllocError> {
        let info = self.device.mem_info()?;
        let state = self.lock();
        let mut copy = state.copy_books();
        copy.stats.peak_allocated = copy.stats.allocated;
        copy.stats.peak_reserved = copy.stats.reserved;
        copy.virtual_memory = Some(match state.virtual_memory {
            Some(memory) => memory,
            None => VirtualMemory {
                free: info.free,
                total: info.total,
            },
        });
        drop(state);
        Ok(Arc::new(CachingAllocator {
            device: Arc::clone(&self.device),
            state: Mutex::new(copy),
            reader_wait: Mutex::new(()),
        }))
    }

    /// Whether this allocator is a [`CachingAllocator::dry_run`] copy (its memory is virtual).
    pub fn is_dry_run(&self) -> bool {
        self.lock().virtual_memory.is_some()
    }

    /// Allocates at least `bytes` bytes: rounds to the size class, reuses the best-fitting
    /// cached block (splitting it), or else allocates a new segment from the device. On device
    /// out-of-memory it empties the cache and retries once, then fails with
    /// [`AllocError::OutOfMemory`].
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use iris_core::memory::CachingAllocator;
    /// let plugin = iris_plugin::Plugin::builtin(iris_device_cpu::plugin_root());
    /// let device = Arc::new(plugin.open(0, &[("capacity".into(), "64MiB".into())])?);
    /// let allocator = CachingAllocator::new(device);
    /// let buffer = allocator.alloc(1000)?;
    /// assert_eq!((buffer.len(), buffer.capacity()), (1000, 1024));
    /// drop(buffer);
    /// // The block went back to the cache; the segment is still reserved until emptied.
    /// assert_eq!(allocator.stats().allocated, 0);
    /// assert_eq!(allocator.empty_cache()?, 2 << 20);
    /// assert_eq!(allocator.stats().reserved, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc(self: &Arc<Self>, bytes: u64) -> Result<DeviceBuffer, AllocError> {
        self.alloc_from(bytes, None)
    }

    /// Allocates one block of at least `bytes` bytes that is a segment of its own (the
    /// *whole* pool): a step's arena. A cached whole segment is reused when it holds the
    /// request (the smallest that does); otherwise every idle whole segment goes back to the
    /// device first and a segment of exactly the rounded request is created, so the pool never
    /// keeps more than the largest arena in use and its cost is the request, not a size class.
    /// Out-of-memory is handled as in [`CachingAllocator::alloc`].
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use iris_core::memory::CachingAllocator;
    /// let plugin = iris_plugin::Plugin::builtin(iris_device_cpu::plugin_root());
    /// let device = Arc::new(plugin.open(0, &[("capacity".into(), "64MiB".into())])?);
    /// let allocator = CachingAllocator::new(device);
    /// let arena = allocator.alloc_whole(3 << 20)?;
    /// assert_eq!(allocator.stats().reserved, 3 << 20);
    /// drop(arena);
    /// // A smaller arena reuses it; a larger one replaces it.
    /// drop(allocator.alloc_whole(1 << 20)?);
    /// drop(allocator.alloc_whole(5 << 20)?);
    /// assert_eq!(allocator.stats().reserved, 5 << 20);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn alloc_whole(self: &Arc<Self>, bytes: u64) -> Result<DeviceBuffer, AllocError> {
        self.alloc_from(bytes, Some(PoolKind::Whole))
    }

    /// Rounds `bytes`, takes the best-fitting free block of the pool (`pool`, else the size
    /// class's), or grows a segment for it, and carves the block. Before growing the whole pool,
    /// its idle segments go back to the device (see [`CachingAllocator::alloc_whole`]).
    fn alloc_from(
        self: &Arc<Self>,
        bytes: u64,
        pool: Option<PoolKind>,
    ) -> Result<DeviceBuffer, AllocError> {
        if bytes == 0 {
            return Err(AllocError::InvalidArgument {
                argument: "bytes",
                message: "an allocation must be at least 1 byte".to_owned(),
            });
        }
        let rounded = round_size(bytes).ok_or_else(|| too_large(bytes))?;
        let pool = pool.unwrap_or_else(|| pool_for(rounded));
        let mut state = self.lock();
        let (segment, offset, block_size) = match state.take_free(pool, rounded) {
            Some(found) => found,
            None => {
                if pool == PoolKind::Whole
                    && let Err(err) = state.release_idle(&self.device, pool)
                {
                    // Those segments stay reserved; the new one may still fit beside them.
                    tracing::warn!(error = %err, "returning idle arenas to the device");
                }
                let (segment, size) = self.grow(&mut state, pool, bytes, rounded)?;
                state.free_set(pool).remove(&(size, segment, 0));
                (segment, 0, size)
            }
        };
        let (handle, capacity) = state.carve(segment, offset, block_size, rounded, bytes);
        state.debug_check();
        drop(state);
        Ok(DeviceBuffer {
            allocator: Arc::clone(self),
            handle,
            segment,
            offset,
            len: bytes,
            capacity,
        })
    }

    /// Waits until the device's queue has run everything submitted so far and reports the
    /// first failure of that work, including one that a memory snapshot taken on another
    /// thread ran into first (a device reports an asynchronous failure once, to whichever call
    /// waits first). Whoever runs work on the device should synchronize through here, so that
    /// a failure is attributed to that work.
    ///
    /// # Errors
    /// The device error of the failed work.
    pub fn synchronize(&self) -> Result<(), DeviceError> {
        let result = self.device.synchronize();
        // Looked for after waiting, once no reader is between its wait and storing what that
        // wait took: a snapshot that took the failure has stored it by now.
        let _readers = self
            .reader_wait
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        match self.lock().deferred_failure.take() {
            Some(earlier) => Err(earlier),
            None => result,
        }
    }

    /// The current counters.
    pub fn stats(&self) -> AllocatorStats {
        self.lock().stats
    }

    /// Sets the peaks to the current figures (PyTorch's `reset_peak_memory_stats`).
    pub fn reset_peaks(&self) {
        let mut state = self.lock();
        state.stats.peak_allocated = state.stats.allocated;
        state.stats.peak_reserved = state.stats.reserved;
    }

    /// Returns every segment with no live block to the device; returns the bytes released.
    ///
    /// If the device refuses to free some segments, the others are still released and the
    /// error ([`AllocError::ReleaseFailed`]) says how many bytes were.
    pub fn empty_cache(&self) -> Result<u64, AllocError> {
        let mut state = self.lock();
        let result = state.release_cached(&self.device);
        state.debug_check();
        result
    }

    /// Every segment with its blocks, in creation order (PyTorch's `memory_snapshot`).
    pub fn segments(&self) -> Vec<SegmentInfo> {
        let state = self.lock();
        state
            .segments
            .values()
            .map(|segment| SegmentInfo {
                handle: segment.handle.0,
                size: segment.size,
                pool: segment.pool,
                blocks: segment
                    .blocks
                    .iter()
                    .map(|(&offset, block)| BlockInfo {
                        offset,
                        size: block.size,
                        requested: block.requested,
                    })
                    .collect(),
            })
            .collect()
    }

    /// Recounts the books from the segments and compares them with the free lists and the
    /// counters; the problem found, if any.
    #[cfg(test)]
    pub(crate) fn check_invariants(&self) -> Result<(), String> {
        self.lock().check()
    }

    /// The allocator's counters, the device's `(free, total)` and the bytes the plugin holds
    /// outside `alloc`, read under the books' lock so that they agree, after the device's
    /// queue has drained (frees are queue-ordered). The wait is made without that lock: a
    /// snapshot taken while the engine runs (a `/metrics` scrape) must not stall the engine's
    /// allocations for a whole queue. Frees the engine queues in the moment between the wait
    /// and the read may then still count in the device's figure, not in the allocator's.
    pub(crate) fn stats_with_mem_info(
        &self,
    ) -> Result<(AllocatorStats, iris_plugin::MemInfo, u64), AllocError> {
        {
            let _reader = self
                .reader_wait
                .lock()
                .unwrap_or_else(PoisonError::into_inner);
            if let Err(err) = self.device.synchronize() {
                // A failure of queued work belongs to the thread that queued it (the engine's
                // step), not to this reader: keep it for that thread's next synchronize.
                self.lock().deferred_failure.get_or_insert(err);
            }
        }
        let state = self.lock();
        let info = self.device.mem_info()?;
        let held = self.device.memory_report()?.held_bytes();
        Ok((state.stats, info, held))
    }

    /// Allocates a new segment for a request that no cached block fits; on out-of-memory
    /// empties the cache and tries once more. Returns the new segment's id and size; its single
    /// free block is in the free set.
    fn grow(
        &self,
        state: &mut State,
        pool: PoolKind,
        requested: u64,
        rounded: u64,
    ) -> Result<(u64, u64), AllocError> {
        let size = match pool {
            PoolKind::Whole => rounded,
            PoolKind::Small | PoolKind::Large => {
                segment_size(rounded).ok_or_else(|| too_large(requested))?
            }
        };
        match state.new_segment(&self.device, pool, size, rounded) {
            Ok(segment) => return Ok(segment),
            Err(err) if err.is_out_of_memory() => {}
            Err(err) => return Err(err.into_alloc_error()),
        }
        state.stats.oom_retries += 1;
        if let Err(err) = state.release_cached(&self.device) {
            // The retry below may still succeed with what was released; the failure is
            // reported if it does not.
            tracing::warn!(error = %err, "emptying the cache after out-of-memory");
        }
        match state.new_segment(&self.device, pool, size, rounded) {
            Ok(segment) => Ok(segment),
            Err(err) if err.is_out_of_memory() => {
                let info = match state.virtual_memory {
                    Some(memory) => Some((memory.free, memory.total)),
                    None => self.device.mem_info().ok().map(|i| (i.free, i.total)),
                };
                Err(AllocError::OutOfMemory {
                    requested,
                    rounded,
                    allocated: state.stats.allocated,
                    reserved: state.stats.reserved,
                    device_free: info.map(|info| info.0),
                    device_total: info.map(|info| info.1),
                    message: err.message(),
                })
            }
            Err(err) => Err(err.into_alloc_error()),
        }
    }

    /// Returns a block to its pool; called by [`DeviceBuffer`]'s drop.
    fn release(&self, segment: u64, offset: u64) {
        let mut state = self.lock();
        state.release(segment, offset);
        if !std::thread::panicking() {
            state.debug_check();
        }
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        // Poisoning means a panic while the lock was held. Every mutation of `State` completes
        // its bookkeeping before anything that can panic (only the debug invariant check), so
        // the state is usable and dropping buffers must keep working.
        self.state
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }
}

impl Drop for CachingAllocator {
    fn drop(&mut self) {
        // No buffer is alive (each holds an `Arc` of the allocator), so every segment is free.
        let state = self
            .state
            .get_mut()
            .unwrap_or_else(|poisoned| poisoned.into_inner());
        if let Err(err) = state.release_cached(&self.device) {
            tracing::warn!(error = %err, "returning memory to the device on allocator drop");
        }
    }
}

/// A block of device memory from a [`CachingAllocator`]. Dropping it returns the block to the
/// allocator's cache (not to the device).
pub struct DeviceBuffer {
    allocator: Arc<CachingAllocator>,
    handle: BufferHandle,
    segment: u64,
    offset: u64,
    len: u64,
    capacity: u64,
}

impl fmt::Debug for DeviceBuffer {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DeviceBuffer")
            .field("handle", &self.handle.0)
            .field("offset", &self.offset)
            .field("len", &self.len)
            .field("capacity", &self.capacity)
            .finish()
    }
}

impl DeviceBuffer {
    /// The raw device buffer (the segment) this block lives in.
    pub fn handle(&self) -> BufferHandle {
        self.handle
    }

    /// Byte offset of the block inside the segment.
    pub fn offset(&self) -> u64 {
        self.offset
    }

    /// Bytes requested.
    pub fn len(&self) -> u64 {
        self.len
    }

    /// Always `false`: allocations are at least one byte.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Bytes of the block (the request after rounding, plus any unsplit remainder).
    pub fn capacity(&self) -> u64 {
        self.capacity
    }

    /// The allocator the block belongs to.
    pub fn allocator(&self) -> &Arc<CachingAllocator> {
        &self.allocator
    }

    /// The device the block lives on.
    pub fn device(&self) -> &Arc<Device> {
        &self.allocator.device
    }

    /// A contiguous `rows x cols` view of `dtype` at the block's start.
    ///
    /// The device checks views against the whole segment only, so a view longer than this
    /// buffer would reach a neighbouring block: use [`DeviceBuffer::try_mat`] for sizes that
    /// are not known to fit (debug builds assert it here).
    pub fn mat(&self, dtype: DType, rows: u64, cols: u64) -> MatRef {
        debug_assert!(
            self.view_fits(dtype, rows, cols),
            "a {rows}x{cols} {dtype} view does not fit in a buffer of {} bytes",
            self.len
        );
        MatRef::contiguous(self.handle, self.offset, dtype, rows, cols)
    }

    /// Like [`DeviceBuffer::mat`], but an error when the view does not fit in the buffer's
    /// requested length or the dtype is unknown.
    pub fn try_mat(&self, dtype: DType, rows: u64, cols: u64) -> Result<MatRef, AllocError> {
        if self.view_fits(dtype, rows, cols) {
            Ok(MatRef::contiguous(
                self.handle,
                self.offset,
                dtype,
                rows,
                cols,
            ))
        } else {
            Err(AllocError::InvalidArgument {
                argument: "rows, cols",
                message: format!(
                    "a {rows}x{cols} {dtype} view does not fit in a buffer of {} bytes",
                    self.len
                ),
            })
        }
    }

    /// The buffer as a byte range (handle, offset, requested length), e.g. for a workspace.
    pub fn slice(&self) -> BufferSlice {
        BufferSlice {
            buf: self.handle,
            offset: self.offset,
            bytes: self.len,
        }
    }

    /// Copies `data` into the buffer at byte `offset`.
    pub fn write(&self, offset: u64, data: &[u8]) -> Result<(), AllocError> {
        let start = self.check_range("write", offset, data.len())?;
        self.device().write(self.handle, start, data)?;
        Ok(())
    }

    /// Fills `out` from the buffer at byte `offset`.
    pub fn read(&self, offset: u64, out: &mut [u8]) -> Result<(), AllocError> {
        let start = self.check_range("read", offset, out.len())?;
        self.device().read(self.handle, start, out)?;
        Ok(())
    }

    /// Writes `data` as little-endian f32 at the start of the buffer.
    pub fn write_f32(&self, data: &[f32]) -> Result<(), AllocError> {
        let bytes: Vec<u8> = data.iter().flat_map(|value| value.to_le_bytes()).collect();
        self.write(0, &bytes)
    }

    /// Reads the whole buffer as little-endian f32 (a trailing partial element is ignored).
    pub fn read_f32(&self) -> Result<Vec<f32>, AllocError> {
        let count = self.len / 4;
        let mut bytes = vec![0u8; to_usize(count * 4, "len")?];
        self.read(0, &mut bytes)?;
        Ok(bytes
            .chunks_exact(4)
            .map(|chunk| f32::from_le_bytes([chunk[0], chunk[1], chunk[2], chunk[3]]))
            .collect())
    }

    fn view_fits(&self, dtype: DType, rows: u64, cols: u64) -> bool {
        dtype
            .size()
            .and_then(|size| rows.checked_mul(cols)?.checked_mul(size))
            .is_some_and(|bytes| bytes <= self.len)
    }

    /// The segment offset of `[offset, offset + bytes)` after checking it lies in the buffer.
    fn check_range(&self, op: &'static str, offset: u64, bytes: usize) -> Result<u64, AllocError> {
        if self.allocator.is_dry_run() {
            return Err(AllocError::InvalidArgument {
                argument: "buffer",
                message: format!("{op} of a dry-run buffer, which has no memory"),
            });
        }
        let bytes = u64::try_from(bytes).unwrap_or(u64::MAX);
        match offset.checked_add(bytes) {
            Some(end) if end <= self.len => Ok(self.offset + offset),
            _ => Err(AllocError::OutOfBounds {
                op,
                offset,
                bytes,
                len: self.len,
            }),
        }
    }
}

impl Drop for DeviceBuffer {
    fn drop(&mut self) {
        self.allocator.release(self.segment, self.offset);
    }
}

// -------------------------------------------------------------------------------------------
// Internals
// -------------------------------------------------------------------------------------------

/// A free-list key: `(size, segment, offset)`, ordered so the first key at or above a size is
/// the best fit.
type FreeKey = (u64, u64, u64);

#[derive(Debug, Clone, Copy)]
struct Block {
    size: u64,
    /// Bytes asked for by the live buffer; `None` when free.
    requested: Option<u64>,
}

struct Segment {
    handle: BufferHandle,
    size: u64,
    pool: PoolKind,
    /// Blocks by offset; they tile `[0, size)` and no two free blocks are adjacent.
    blocks: BTreeMap<u64, Block>,
}

#[derive(Default)]
struct State {
    /// Segments by id, in creation order.
    segments: BTreeMap<u64, Segment>,
    small_free: BTreeSet<FreeKey>,
    large_free: BTreeSet<FreeKey>,
    whole_free: BTreeSet<FreeKey>,
    next_segment: u64,
    stats: AllocatorStats,
    /// A failure of queued device work that a reader on another thread (a memory snapshot)
    /// ran into first; [`CachingAllocator::synchronize`] hands it to the owner of the work.
    deferred_failure: Option<DeviceError>,
    /// Set in a dry-run copy: segments come from this count instead of the device.
    virtual_memory: Option<VirtualMemory>,
}

/// Why a segment could not be created.
enum SegmentError {
    /// The device's error.
    Device(DeviceError),
    /// A dry run's virtual memory is exhausted.
    VirtualOutOfMemory { size: u64, free: u64 },
}

impl SegmentError {
    fn is_out_of_memory(&self) -> bool {
        match self {
            SegmentError::Device(err) => err.is_out_of_memory(),
            SegmentError::VirtualOutOfMemory { .. } => true,
        }
    }

    fn message(self) -> String {
        match self {
            SegmentError::Device(err) => err.message,
            SegmentError::VirtualOutOfMemory { size, free } => {
                format!("dry run: a segment of {size} bytes does not fit in {free} free bytes")
            }
        }
    }

    fn into_alloc_error(self) -> AllocError {
        match self {
            SegmentError::Device(err) => err.into(),
            virtual_oom @ SegmentError::VirtualOutOfMemory { .. } => AllocError::InvalidArgument {
                argument: "bytes",
                message: virtual_oom.message(),
            },
        }
    }
}

impl State {
    /// The books without the device's deferred failure, every segment's handle null (a copy's
    /// segments are not the device's to touch).
    fn copy_books(&self) -> State {
        State {
            segments: self
                .segments
                .iter()
                .map(|(&id, seg)| {
                    let copy = Segment {
                        handle: BufferHandle::NULL,
                        size: seg.size,
                        pool: seg.pool,
                        blocks: seg.blocks.clone(),
                    };
                    (id, copy)
                })
                .collect(),
            small_free: self.small_free.clone(),
            large_free: self.large_free.clone(),
            whole_free: self.whole_free.clone(),
            next_segment: self.next_segment,
            stats: self.stats,
            deferred_failure: None,
            virtual_memory: self.virtual_memory,
        }
    }

    /// A raw allocation from the device, or from the virtual memory of a dry run.
    fn raw_alloc(&mut self, device: &Device, size: u64) -> Result<BufferHandle, SegmentError> {
        match &mut self.virtual_memory {
            Some(memory) => {
                if size > memory.free {
                    return Err(SegmentError::VirtualOutOfMemory {
                        size,
                        free: memory.free,
                    });
                }
                memory.free -= size;
                Ok(BufferHandle::NULL)
            }
            None => device.alloc(size).map_err(SegmentError::Device),
        }
    }

    /// Returns a segment's raw allocation to the device, or to a dry run's virtual memory.
    fn raw_free(
        &mut self,
        device: &Device,
        handle: BufferHandle,
        size: u64,
    ) -> Result<(), DeviceError> {
        match &mut self.virtual_memory {
            Some(memory) => {
                memory.free += size;
                Ok(())
            }
            None => device.free(handle),
        }
    }

    fn free_set(&mut self, pool: PoolKind) -> &mut BTreeSet<FreeKey> {
        match pool {
            PoolKind::Small => &mut self.small_free,
            PoolKind::Large => &mut self.large_free,
            PoolKind::Whole => &mut self.whole_free,
        }
    }

    /// Removes and returns the best-fitting free block `(segment, offset, size)`.
    fn take_free(&mut self, pool: PoolKind, rounded: u64) -> Option<(u64, u64, u64)> {
        let set = self.free_set(pool);
        let key = *set.range((rounded, 0, 0)..).next()?;
        set.remove(&key);
        let (size, segment, offset) = key;
        Some((segment, offset, size))
    }

    /// Makes the free block at `(segment, offset)` of `block_size` bytes (already out of the
    /// free set) a live block of `rounded` bytes, splitting off the remainder when worth it.
    /// Returns the segment's handle and the block's capacity.
    fn carve(
        &mut self,
        segment: u64,
        offset: u64,
        block_size: u64,
        rounded: u64,
        requested: u64,
    ) -> (BufferHandle, u64) {
        let Some(seg) = self.segments.get_mut(&segment) else {
            // Invariant: free-list keys only name live segments.
            unreachable!("free block in unknown segment {segment}");
        };
        let pool = seg.pool;
        let handle = seg.handle;
        let remainder = block_size - rounded;
        let capacity = if should_split(pool, remainder) {
            seg.blocks.insert(
                offset + rounded,
                Block {
                    size: remainder,
                    requested: None,
                },
            );
            self.free_set(pool)
                .insert((remainder, segment, offset + rounded));
            rounded
        } else {
            block_size
        };
        if let Some(seg) = self.segments.get_mut(&segment) {
            seg.blocks.insert(
                offset,
                Block {
                    size: capacity,
                    requested: Some(requested),
                },
            );
        }
        let stats = &mut self.stats;
        stats.allocated += capacity;
        stats.requested += requested;
        stats.live_buffers += 1;
        stats.peak_allocated = stats.peak_allocated.max(stats.allocated);
        (handle, capacity)
    }

    /// Frees the live block at `(segment, offset)`, merging it with free neighbours.
    fn release(&mut self, segment: u64, offset: u64) {
        let Some(seg) = self.segments.get_mut(&segment) else {
            // Invariant: a segment with a live block is never released, and every buffer
            // names its own segment. Nothing to return if that were ever broken.
            debug_assert!(false, "release in unknown segment {segment}");
            return;
        };
        let pool = seg.pool;
        let Some(block) = seg.blocks.get(&offset).copied() else {
            debug_assert!(false, "release of unknown block {segment}:{offset}");
            return;
        };
        let Some(requested) = block.requested else {
            debug_assert!(false, "double release of block {segment}:{offset}");
            return;
        };
        let mut start = offset;
        let mut size = block.size;
        let mut merged: Vec<FreeKey> = Vec::with_capacity(2);
        if let Some((&prev_offset, prev)) = seg.blocks.range(..offset).next_back()
            && prev.requested.is_none()
        {
            merged.push((prev.size, segment, prev_offset));
            start = prev_offset;
            size += prev.size;
            seg.blocks.remove(&offset);
        }
        let next_offset = offset + block.size;
        if let Some(next) = seg.blocks.get(&next_offset).copied()
            && next.requested.is_none()
        {
            merged.push((next.size, segment, next_offset));
            size += next.size;
            seg.blocks.remove(&next_offset);
        }
        seg.blocks.insert(
            start,
            Block {
                size,
                requested: None,
            },
        );
        let set = self.free_set(pool);
        for key in &merged {
            set.remove(key);
        }
        set.insert((size, segment, start));
        let stats = &mut self.stats;
        stats.allocated -= block.size;
        stats.requested -= requested;
        stats.live_buffers -= 1;
    }

    /// Allocates a segment of `size` bytes (or, if the device cannot, of `rounded` bytes) and
    /// adds it as one free block; returns its id and size.
    fn new_segment(
        &mut self,
        device: &Device,
        pool: PoolKind,
        size: u64,
        rounded: u64,
    ) -> Result<(u64, u64), SegmentError> {
        let (handle, size) = match self.raw_alloc(device, size) {
            Ok(handle) => (handle, size),
            Err(err) if err.is_out_of_memory() && rounded < size => {
                (self.raw_alloc(device, rounded)?, rounded)
            }
            Err(err) => return Err(err),
        };
        let id = self.next_segment;
        self.next_segment += 1;
        let mut blocks = BTreeMap::new();
        blocks.insert(
            0,
            Block {
                size,
                requested: None,
            },
        );
        self.segments.insert(
            id,
            Segment {
                handle,
                size,
                pool,
                blocks,
            },
        );
        self.free_set(pool).insert((size, id, 0));
        let stats = &mut self.stats;
        stats.reserved += size;
        stats.raw_allocs += 1;
        stats.segments += 1;
        stats.peak_reserved = stats.peak_reserved.max(stats.reserved);
        Ok((id, size))
    }

    /// Frees every segment that is one free block.
    fn release_cached(&mut self, device: &Device) -> Result<u64, AllocError> {
        self.release_where(device, |_| true)
    }

    /// Frees every segment of `pool` that is one free block.
    fn release_idle(&mut self, device: &Device, pool: PoolKind) -> Result<u64, AllocError> {
        self.release_where(device, |seg| seg.pool == pool)
    }

    /// Frees every segment that is one free block and that `select` picks.
    fn release_where(
        &mut self,
        device: &Device,
        select: impl Fn(&Segment) -> bool,
    ) -> Result<u64, AllocError> {
        let idle: Vec<u64> = self
            .segments
            .iter()
            .filter(|(_, seg)| {
                select(seg)
                    && seg.blocks.len() == 1
                    && seg
                        .blocks
                        .get(&0)
                        .is_some_and(|block| block.requested.is_none())
            })
            .map(|(&id, _)| id)
            .collect();
        let mut released = 0;
        let mut failed = 0;
        let mut first_error = None;
        for id in idle {
            let Some(seg) = self.segments.get(&id) else {
                continue;
            };
            let (handle, size, pool) = (seg.handle, seg.size, seg.pool);
            match self.raw_free(device, handle, size) {
                Ok(()) => {
                    self.segments.remove(&id);
                    self.free_set(pool).remove(&(size, id, 0));
                    self.stats.reserved -= size;
                    self.stats.raw_frees += 1;
                    self.stats.segments -= 1;
                    released += size;
                }
                Err(err) => {
                    failed += 1;
                    first_error.get_or_insert(err);
                }
            }
        }
        match first_error {
            None => Ok(released),
            Some(source) => Err(AllocError::ReleaseFailed {
                released,
                failed,
                source,
            }),
        }
    }

    fn debug_check(&self) {
        if cfg!(debug_assertions)
            && let Err(problem) = self.check()
        {
            panic!("caching allocator invariant broken: {problem}");
        }
    }

    /// Recounts everything from the segments and compares with the free sets and counters.
    fn check(&self) -> Result<(), String> {
        let mut reserved = 0;
        let mut allocated = 0;
        let mut requested = 0;
        let mut live = 0;
        let mut free_blocks: BTreeSet<(PoolKind, FreeKey)> = BTreeSet::new();
        for (&id, seg) in &self.segments {
            reserved += seg.size;
            let mut position = 0;
            let mut previous_free = false;
            for (&offset, block) in &seg.blocks {
                if offset != position || block.size == 0 {
                    return Err(format!(
                        "segment {id}: block at {offset} of {} bytes, expected one at {position}",
                        block.size
                    ));
                }
                position += block.size;
                match block.requested {
                    Some(asked) => {
                        if asked > block.size {
                            return Err(format!("segment {id}: block at {offset} too small"));
                        }
                        allocated += block.size;
                        requested += asked;
                        live += 1;
                        previous_free = false;
                    }
                    None => {
                        if previous_free {
                            return Err(format!("segment {id}: adjacent free blocks at {offset}"));
                        }
                        free_blocks.insert((seg.pool, (block.size, id, offset)));
                        previous_free = true;
                    }
                }
            }
            if position != seg.size {
                return Err(format!(
                    "segment {id}: blocks cover {position} of {} bytes",
                    seg.size
                ));
            }
        }
        let listed: BTreeSet<(PoolKind, FreeKey)> = self
            .small_free
            .iter()
            .map(|key| (PoolKind::Small, *key))
            .chain(self.large_free.iter().map(|key| (PoolKind::Large, *key)))
            .chain(self.whole_free.iter().map(|key| (PoolKind::Whole, *key)))
            .collect();
        if listed != free_blocks {
            return Err(format!(
                "free lists {listed:?} differ from free blocks {free_blocks:?}"
            ));
        }
        let stats = &self.stats;
        let segments = self.segments.len() as u64;
        let expected = (allocated, reserved, requested, live, segments);
        let counted = (
            stats.allocated,
            stats.reserved,
            stats.requested,
            stats.live_buffers,
            stats.segments,
        );
        if expected != counted {
            return Err(format!(
                "counters (allocated, reserved, requested, live, segments) = {counted:?}, recount {expected:?}"
            ));
        }
        if stats.peak_allocated < stats.allocated || stats.peak_reserved < stats.reserved {
            return Err(format!("peaks below current figures: {stats:?}"));
        }
        if stats.raw_allocs - stats.raw_frees != segments {
            return Err(format!("raw allocs - frees != segments: {stats:?}"));
        }
        Ok(())
    }
}

/// `bytes` rounded up to a multiple of [`MIN_BLOCK_SIZE`], or `None` on overflow.
pub fn round_size(bytes: u64) -> Option<u64> {
    round_up(bytes.max(1), MIN_BLOCK_SIZE)
}

/// The pool serving a rounded request.
pub fn pool_for(rounded: u64) -> PoolKind {
    if rounded <= SMALL_SIZE {
        PoolKind::Small
    } else {
        PoolKind::Large
    }
}

/// Size of the segment allocated for a rounded request that no cached block fits (PyTorch's
/// `get_allocation_size`), or `None` on overflow.
pub fn segment_size(rounded: u64) -> Option<u64> {
    if rounded <= SMALL_SIZE {
        Some(SMALL_SEGMENT)
    } else if rounded < MIN_LARGE_ALLOC {
        Some(LARGE_SEGMENT)
    } else {
        round_up(rounded, ROUND_LARGE)
    }
}

fn should_split(pool: PoolKind, remainder: u64) -> bool {
    match pool {
        PoolKind::Small => remainder >= MIN_BLOCK_SIZE,
        PoolKind::Large => remainder > SMALL_SIZE,
        PoolKind::Whole => false,
    }
}

fn round_up(value: u64, multiple: u64) -> Option<u64> {
    value.div_ceil(multiple).checked_mul(multiple)
}

fn too_large(bytes: u64) -> AllocError {
    AllocError::InvalidArgument {
        argument: "bytes",
        message: format!("{bytes} bytes cannot be rounded to a size class without overflow"),
    }
}

fn to_usize(value: u64, argument: &'static str) -> Result<usize, AllocError> {
    usize::try_from(value).map_err(|_| AllocError::InvalidArgument {
        argument,
        message: format!("{value} does not fit in this host's address space"),
    })
}

fn device_memory(free: Option<u64>, total: Option<u64>) -> String {
    match (free, total) {
        (Some(free), Some(total)) => format!("the device has {free} of {total} bytes free"),
        _ => "the device did not report its free memory".to_owned(),
    }
}

// The allocator is shared across threads (engine, server handlers) and buffers travel with
// requests; keep both thread-safe.
const _: () = {
    const fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<CachingAllocator>();
    assert_send_sync::<DeviceBuffer>();
};

#[cfg(test)]
mod tests {
    use std::time::{Duration, Instant};

    use iris_plugin::abi::{Activation, ActivationArgs, FillArgs};

    use super::*;

    fn device(capacity: &str) -> Arc<Device> {
        Arc::new(crate::test_support::cpu_device(capacity))
    }

    fn used(device: &Device) -> u64 {
        let info = device.mem_info().unwrap();
        info.total - info.free
    }

    /// A memory snapshot on another thread (a `/metrics` scrape) waits for the device's queue
    /// without the books' lock: the engine's allocations meanwhile are not held up until the
    /// queue has drained (before, the snapshot held the lock through its wait).
    #[test]
    fn a_snapshot_waiting_for_the_queue_does_not_hold_up_allocations() {
        // Each queued item waits 3 s before it runs.
        let dev = Arc::new(crate::test_support::cpu_device_with(&[
            ("capacity", "64MiB"),
            ("queue", "async"),
            ("queue_delay_us", "3000000"),
        ]));
        let allocator = CachingAllocator::new(Arc::clone(&dev));
        let buffer = allocator.alloc(4096).unwrap();
        dev.fill(&FillArgs {
            dst: buffer.slice(),
            value: 7,
            width: 4,
        })
        .unwrap();
        let (entered, entering) = std::sync::mpsc::channel();
        let reader = {
            let allocator = Arc::clone(&allocator);
            std::thread::spawn(move || {
                entered.send(()).unwrap();
                crate::memory::MemorySnapshot::take(&allocator).map(|s| s.allocator_allocated)
            })
        };
        entering.recv().unwrap();
        // Long enough for the reader to be inside its wait, well short of the queue's 3 s.
        std::thread::sleep(Duration::from_millis(300));
        let started = Instant::now();
        let second = allocator.alloc(4096).unwrap();
        let waited = started.elapsed();
        assert!(
            waited < Duration::from_millis(1500),
            "an allocation from the cache waited {waited:?} for another thread's snapshot"
        );
        assert!(reader.join().unwrap().unwrap() >= 4096);
        drop((buffer, second));
        allocator.synchronize().unwrap();
    }

    /// A failure of queued work that a snapshot on another thread ran into first reaches the
    /// thread that runs the work, at its next synchronize, once.
    #[test]
    fn a_failure_a_snapshot_ran_into_reaches_the_next_synchronize() {
        let dev = Arc::new(crate::test_support::cpu_device_with(&[
            ("capacity", "64MiB"),
            ("queue", "async"),
            ("fail_op", "activation"),
        ]));
        let allocator = CachingAllocator::new(Arc::clone(&dev));
        let buffer = allocator.alloc(64).unwrap();
        let view = MatRef::vector(buffer.handle(), buffer.offset(), DType::F32, 16);
        dev.activation(&ActivationArgs {
            x: view,
            out: view,
            activation: Activation::SILU,
            workspace: BufferSlice::EMPTY,
        })
        .unwrap();
        let reader = {
            let allocator = Arc::clone(&allocator);
            std::thread::spawn(move || crate::memory::MemorySnapshot::take(&allocator).is_ok())
        };
        assert!(reader.join().unwrap(), "the snapshot itself succeeds");
        let err = allocator
            .synchronize()
            .expect_err("the activation's injected failure");
        assert!(err.to_string().contains("injected"), "{err}");
        allocator.synchronize().expect("reported once");
    }

    #[test]
    fn size_classes_follow_pytorch() {
        assert_eq!(round_size(1), Some(512));
        assert_eq!(round_size(512), Some(512));
        assert_eq!(round_size(513), Some(1024));
        assert_eq!(round_size(u64::MAX), None);
        assert_eq!(pool_for(SMALL_SIZE), PoolKind::Small);
        assert_eq!(pool_for(SMALL_SIZE + 512), PoolKind::Large);
        assert_eq!(segment_size(512), Some(SMALL_SEGMENT));
        assert_eq!(segment_size(SMALL_SIZE + 512), Some(LARGE_SEGMENT));
        assert_eq!(segment_size(MIN_LARGE_ALLOC), Some(MIN_LARGE_ALLOC));
        assert_eq!(
            segment_size(MIN_LARGE_ALLOC + 1024),
            Some(MIN_LARGE_ALLOC + ROUND_LARGE)
        );
    }

    #[test]
    fn zero_and_overflowing_sizes_are_invalid() {
        let allocator = CachingAllocator::new(device("64MiB"));
        let err = allocator.alloc(0).unwrap_err();
        assert!(matches!(
            err,
            AllocError::InvalidArgument {
                argument: "bytes",
                ..
            }
        ));
        let err = allocator.alloc(u64::MAX).unwrap_err();
        assert!(matches!(err, AllocError::InvalidArgument { .. }), "{err}");
        let err = allocator.alloc(u64::MAX - 4 * MIN_BLOCK_SIZE).unwrap_err();
        assert!(matches!(err, AllocError::InvalidArgument { .. }), "{err}");
        assert_eq!(allocator.stats(), AllocatorStats::default());
    }

    #[test]
    fn freed_blocks_are_reused_without_device_calls() {
        let dev = device("64MiB");
        let allocator = CachingAllocator::new(Arc::clone(&dev));
        let a = allocator.alloc(1000).unwrap();
        let (handle, offset) = (a.handle(), a.offset());
        drop(a);
        let b = allocator.alloc(900).unwrap();
        assert_eq!((b.handle(), b.offset()), (handle, offset));
        let stats = allocator.stats();
        assert_eq!((stats.raw_allocs, stats.segments), (1, 1));
        assert_eq!(stats.reserved, SMALL_SEGMENT);
        assert_eq!(used(&dev), SMALL_SEGMENT);
        assert_eq!((stats.allocated, stats.requested), (1024, 900));
    }

    #[test]
    fn blocks_split_and_merge_back_into_one() {
        let allocator = CachingAllocator::new(device("64MiB"));
        let a = allocator.alloc(512).unwrap();
        let b = allocator.alloc(1024).unwrap();
        let c = allocator.alloc(512).unwrap();
        assert_eq!((a.offset(), b.offset(), c.offset()), (0, 512, 1536));
        assert_eq!(allocator.segments()[0].blocks.len(), 4);
        drop(b);
        // A best fit: the 1 KiB hole, not the big tail.
        let d = allocator.alloc(1000).unwrap();
        assert_eq!(d.offset(), 512);
        drop(d);
        drop(a);
        drop(c);
        let segments = allocator.segments();
        assert_eq!(
            segments[0].blocks,
            vec![BlockInfo {
                offset: 0,
                size: SMALL_SEGMENT,
                requested: None
            }]
        );
        assert_eq!(allocator.empty_cache().unwrap(), SMALL_SEGMENT);
        let stats = allocator.stats();
        assert_eq!(
            (stats.raw_allocs, stats.raw_frees, stats.reserved),
            (1, 1, 0)
        );
    }

    #[test]
    fn large_remainders_split_only_above_one_mib() {
        let allocator = CachingAllocator::new(device("64MiB"));
        // 19 MiB of a 20 MiB segment: the 1 MiB remainder is not worth keeping.
        let a = allocator.alloc(19 << 20).unwrap();
        assert_eq!(a.capacity(), LARGE_SEGMENT);
        drop(a);
        // 2 MiB: the 18 MiB remainder is split off and serves the next request.
        let b = allocator.alloc(2 << 20).unwrap();
        let c = allocator.alloc(3 << 20).unwrap();
        assert_eq!((b.capacity(), c.capacity()), (2 << 20, 3 << 20));
        assert_eq!((b.handle(), c.offset()), (c.handle(), 2 << 20));
        assert_eq!(allocator.stats().segments, 1);
    }

    #[test]
    fn empty_cache_keeps_segments_with_live_blocks() {
        let dev = device("64MiB");
        let allocator = CachingAllocator::new(Arc::clone(&dev));
        let keep = allocator.alloc(100).unwrap();
        let big = allocator.alloc(12 << 20).unwrap();
        drop(big);
        assert_eq!(allocator.empty_cache().unwrap(), 12 << 20);
        assert_eq!(used(&dev), SMALL_SEGMENT);
        assert_eq!(allocator.empty_cache().unwrap(), 0);
        drop(keep);
        assert_eq!(allocator.empty_cache().unwrap(), SMALL_SEGMENT);
        assert_eq!(used(&dev), 0);
    }

    #[test]
    fn peaks_are_maxima_until_reset() {
        let allocator = CachingAllocator::new(device("64MiB"));
        let a = allocator.alloc(4 << 20).unwrap();
        drop(a);
        let stats = allocator.stats();
        assert_eq!((stats.allocated, stats.peak_allocated), (0, 4 << 20));
        assert_eq!(stats.peak_reserved, LARGE_SEGMENT);
        allocator.empty_cache().unwrap();
        allocator.reset_peaks();
        let stats = allocator.stats();
        assert_eq!((stats.peak_allocated, stats.peak_reserved), (0, 0));
    }

    #[test]
    fn buffer_io_is_bounds_checked_against_the_request() {
        let allocator = CachingAllocator::new(device("64MiB"));
        let neighbour = allocator.alloc(512).unwrap();
        let buffer = allocator.alloc(10).unwrap();
        buffer.write(2, &[1, 2, 3]).unwrap();
        let mut back = [0u8; 5];
        buffer.read(0, &mut back).unwrap();
        assert_eq!(back, [0, 0, 1, 2, 3]);
        let err = buffer.write(8, &[0; 3]).unwrap_err();
        assert!(
            matches!(
                err,
                AllocError::OutOfBounds {
                    op: "write",
                    offset: 8,
                    bytes: 3,
                    len: 10
                }
            ),
            "{err}"
        );
        assert!(buffer.read(u64::MAX, &mut back).is_err());
        let floats = allocator.alloc(16).unwrap();
        floats.write_f32(&[1.0, -2.5, 3.25, 0.0]).unwrap();
        assert_eq!(floats.read_f32().unwrap(), vec![1.0, -2.5, 3.25, 0.0]);
        assert!(floats.write_f32(&[0.0; 5]).is_err());
        // The view and slice address the block, not the segment start.
        let view = buffer.mat(DType::F16, 1, 5);
        assert_eq!((view.buf, view.offset), (buffer.handle(), 512));
        assert!(buffer.try_mat(DType::F32, 1, 3).is_err());
        assert_eq!(buffer.slice().bytes, 10);
        drop(neighbour);
    }

    #[test]
    fn out_of_memory_empties_the_cache_and_retries() {
        let dev = device("8MiB");
        let allocator = CachingAllocator::new(Arc::clone(&dev));
        // Fill the device with small segments, then free every block: all 8 MiB stay cached.
        let small: Vec<_> = (0..8)
            .map(|_| allocator.alloc(SMALL_SIZE).unwrap())
            .collect();
        assert_eq!(used(&dev), 8 << 20);
        drop(small);
        assert_eq!(allocator.stats().reserved, 8 << 20);
        // 6 MiB fits only after the cache is returned (and only as an exact-size segment).
        let big = allocator.alloc(6 << 20).unwrap();
        let stats = allocator.stats();
        assert_eq!(stats.oom_retries, 1);
        assert_eq!((stats.reserved, stats.segments), (6 << 20, 1));
        assert_eq!(used(&dev), 6 << 20);
        // 4 MiB more never fits: a typed error with the numbers, and nothing leaked.
        let err = allocator.alloc(4 << 20).unwrap_err();
        let AllocError::OutOfMemory {
            requested,
            allocated,
            reserved,
            device_free,
            device_total,
            ..
        } = &err
        else {
            panic!("expected out of memory, got {err}");
        };
        assert_eq!(*requested, 4 << 20);
        assert_eq!((*allocated, *reserved), (6 << 20, 6 << 20));
        assert_eq!(
            (*device_free, *device_total),
            (Some(2 << 20), Some(8 << 20))
        );
        let text = err.to_string();
        for number in ["4194304", "6291456", "2097152", "8388608"] {
            assert!(text.contains(number), "{text}");
        }
        assert_eq!(allocator.stats().oom_retries, 2);
        assert_eq!(used(&dev), 6 << 20);
        drop(big);
        allocator.empty_cache().unwrap();
        assert_eq!(used(&dev), 0);
        let stats = allocator.stats();
        assert_eq!(stats.raw_allocs, stats.raw_frees);
    }

    #[test]
    fn a_device_refusing_a_free_is_reported_and_the_rest_released() {
        let dev = device("64MiB");
        let allocator = CachingAllocator::new(Arc::clone(&dev));
        let small = allocator.alloc(100).unwrap();
        let large = allocator.alloc(3 << 20).unwrap();
        // Free the small segment behind the allocator's back: its own free will be refused.
        dev.free(small.handle()).unwrap();
        drop(small);
        drop(large);
        let err = allocator.empty_cache().unwrap_err();
        let AllocError::ReleaseFailed {
            released,
            failed,
            source,
        } = &err
        else {
            panic!("expected a release failure, got {err}");
        };
        assert_eq!((*released, *failed), (LARGE_SEGMENT, 1));
        assert!(source.message.contains("unknown buffer handle"), "{err}");
        assert!(
            err.to_string().contains(&LARGE_SEGMENT.to_string()),
            "{err}"
        );
        // The refused segment stays on the books; allocating still works.
        let stats = allocator.stats();
        assert_eq!((stats.reserved, stats.segments), (SMALL_SEGMENT, 1));
        drop(allocator.alloc(10).unwrap());
        allocator.check_invariants().unwrap();
    }

    #[test]
    fn dropping_the_allocator_returns_its_cache() {
        let dev = device("64MiB");
        let allocator = CachingAllocator::new(Arc::clone(&dev));
        drop(allocator.alloc(5 << 20).unwrap());
        drop(allocator.alloc(5).unwrap());
        assert_eq!(used(&dev), LARGE_SEGMENT + SMALL_SEGMENT);
        drop(allocator);
        assert_eq!(used(&dev), 0);
    }

    #[test]
    fn concurrent_alloc_and_free_keep_the_books() {
        let dev = device("256MiB");
        let allocator = CachingAllocator::new(Arc::clone(&dev));
        std::thread::scope(|scope| {
            for thread in 0..4u64 {
                let allocator = Arc::clone(&allocator);
                scope.spawn(move || {
                    let mut held = Vec::new();
                    for i in 0..200u64 {
                        let size = 1 + (i * 7919 + thread * 104_729) % (3 << 20);
                        held.push(allocator.alloc(size).unwrap());
                        if i % 3 == 0 {
                            held.swap_remove(usize::try_from(i % 7).unwrap() % held.len());
                        }
                        if held.len() > 6 {
                            held.remove(0);
                        }
                    }
                });
            }
        });
        let stats = allocator.stats();
        assert_eq!((stats.allocated, stats.live_buffers), (0, 0));
        allocator.empty_cache().unwrap();
        assert_eq!(used(&dev), 0);
        allocator.lock().check().unwrap();
    }
}
