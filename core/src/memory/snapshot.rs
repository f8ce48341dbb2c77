//! Memory snapshots and profiling, after vLLM's `vllm/utils/mem_utils.py`.
//!
//! A [`MemorySnapshot`] puts the device's view (`free`, `total` from the plugin's `mem_info`)
//! beside the allocator's (`allocated`, `reserved` and their peaks). What the device uses beyond
//! the allocator's reservation (driver contexts, library handles, other processes) is
//! `non_allocator` memory, which iris cannot free but must budget for.
//!
//! [`MemoryProfiler`] is vLLM's `memory_profiling` context: it empties the cache and resets the
//! peaks, lets the caller run the largest possible input, then measures again. The resulting
//! [`MemoryProfile`] splits what the run needs into weights, peak activation increase and
//! non-allocator growth; what is left of the requested budget
//! ([`requested_memory`] = `ceil(total * utilization)`) is available for the encoder cache.

use serde::Serialize;

use crate::memory::allocator::{AllocError, AllocatorStats, CachingAllocator};
use iris_plugin::MemInfo;

/// The device's and the allocator's memory figures at one moment, in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemorySnapshot {
    /// Free device memory, as the driver reports it.
    pub device_free: u64,
    /// Total device memory, as the driver reports it.
    pub device_total: u64,
    /// `device_total - device_free`.
    pub device_used: u64,
    /// Bytes in the allocator's live blocks.
    pub allocator_allocated: u64,
    /// Bytes the allocator holds from the device.
    pub allocator_reserved: u64,
    /// Peak of `allocator_allocated` since the last peak reset.
    pub allocator_peak_allocated: u64,
    /// Peak of `allocator_reserved` since the last peak reset.
    pub allocator_peak_reserved: u64,
    /// Device memory in use that the allocator does not hold: `device_used -
    /// allocator_reserved`, saturating at 0.
    pub non_allocator: u64,
    /// The part of it the plugin reports holding outside `alloc` (context, library handles,
    /// compiled kernels, caches); the rest belongs to the driver or to other processes.
    pub plugin_held: u64,
}

impl MemorySnapshot {
    /// Reads the device's memory and the allocator's counters (under one lock, so they agree),
    /// after waiting for the device's queue: frees are queue-ordered, so only then does the
    /// device's figure show every release.
    ///
    /// ```
    /// # use std::sync::Arc;
    /// # use iris_core::memory::{CachingAllocator, MemorySnapshot};
    /// let plugin = iris_plugin::Plugin::builtin(iris_device_cpu::plugin_root());
    /// let device = Arc::new(plugin.open(0, &[("capacity".into(), "64MiB".into())])?);
    /// let allocator = CachingAllocator::new(device);
    /// let _buffer = allocator.alloc(4096)?;
    /// let snapshot = MemorySnapshot::take(&allocator)?;
    /// assert_eq!(snapshot.allocator_allocated, 4096);
    /// // The CPU device holds nothing beyond what the allocator reserved.
    /// assert_eq!(snapshot.device_used, snapshot.allocator_reserved);
    /// assert_eq!(snapshot.non_allocator, 0);
    /// # Ok::<(), Box<dyn std::error::Error>>(())
    /// ```
    pub fn take(allocator: &CachingAllocator) -> Result<MemorySnapshot, AllocError> {
        let (stats, info, held) = allocator.stats_with_mem_info()?;
        Ok(MemorySnapshot::from_parts(&stats, info, held))
    }

    /// A snapshot from figures read elsewhere; `plugin_held` is the plugin's own report of what
    /// it holds outside `alloc`.
    pub fn from_parts(stats: &AllocatorStats, info: MemInfo, plugin_held: u64) -> MemorySnapshot {
        let device_used = info.total.saturating_sub(info.free);
        MemorySnapshot {
            device_free: info.free,
            device_total: info.total,
            device_used,
            allocator_allocated: stats.allocated,
            allocator_reserved: stats.reserved,
            allocator_peak_allocated: stats.peak_allocated,
            allocator_peak_reserved: stats.peak_reserved,
            non_allocator: device_used.saturating_sub(stats.reserved),
            plugin_held,
        }
    }
}

/// What a profiling run found (vLLM's `MemoryProfilingResult`), in bytes.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct MemoryProfile {
    /// Before anything was loaded (vLLM's `before_create`).
    pub baseline: MemorySnapshot,
    /// After loading, with the cache emptied and peaks reset, before the run.
    pub before_profile: MemorySnapshot,
    /// After the run, with the cache emptied.
    pub after_profile: MemorySnapshot,
    /// Weights, as the caller measured them while loading.
    pub weights: u64,
    /// Rise of the allocator's peak allocated bytes during the run (peak activation memory).
    pub peak_increase: u64,
    /// Rise of non-allocator memory since the baseline (saturating at 0).
    pub non_allocator_increase: u64,
    /// `weights + peak_increase + non_allocator_increase`: what iris needs besides the cache.
    pub non_cache_memory: u64,
}

impl MemoryProfile {
    /// Combines the snapshots as vLLM's `memory_profiling` does.
    pub fn from_snapshots(
        baseline: MemorySnapshot,
        weights: u64,
        before_profile: MemorySnapshot,
        after_profile: MemorySnapshot,
    ) -> MemoryProfile {
        let peak_increase = after_profile
            .allocator_peak_allocated
            .saturating_sub(before_profile.allocator_peak_allocated);
        let non_allocator_increase = after_profile
            .non_allocator
            .saturating_sub(baseline.non_allocator);
        MemoryProfile {
            baseline,
            before_profile,
            after_profile,
            weights,
            peak_increase,
            non_allocator_increase,
            non_cache_memory: weights
                .saturating_add(peak_increase)
                .saturating_add(non_allocator_increase),
        }
    }

    /// The same profile with the peak activation increase replaced by `peak` (a dry run's
    /// figure for a step that was not run) and `non_cache_memory` recomputed.
    pub fn with_peak_increase(self, peak: u64) -> MemoryProfile {
        MemoryProfile {
            peak_increase: peak,
            non_cache_memory: self
                .weights
                .saturating_add(peak)
                .saturating_add(self.non_allocator_increase),
            ..self
        }
    }

    /// Bytes left for the encoder cache and downstream use out of `requested` (see
    /// [`requested_memory`]): `requested - non_cache_memory`, an error when nothing is left.
    pub fn available(&self, requested: u64) -> Result<u64, AllocError> {
        match requested.checked_sub(self.non_cache_memory) {
            Some(available) if available > 0 => Ok(available),
            _ => Err(AllocError::BudgetExceeded {
                requested,
                weights: self.weights,
                peak_increase: self.peak_increase,
                non_allocator_increase: self.non_allocator_increase,
            }),
        }
    }
}

/// A profiling run in progress (vLLM's `memory_profiling` context manager): created before the
/// run, finished after it.
#[derive(Debug)]
pub struct MemoryProfiler<'a> {
    allocator: &'a CachingAllocator,
    baseline: MemorySnapshot,
    weights: u64,
    before_profile: MemorySnapshot,
}

impl<'a> MemoryProfiler<'a> {
    /// Empties the cache, resets the peaks and measures. `baseline` was taken before the model
    /// was created; `weights` is what loading the weights allocated.
    pub fn start(
        allocator: &'a CachingAllocator,
        baseline: MemorySnapshot,
        weights: u64,
    ) -> Result<MemoryProfiler<'a>, AllocError> {
        allocator.empty_cache()?;
        allocator.reset_peaks();
        Ok(MemoryProfiler {
            allocator,
            baseline,
            weights,
            before_profile: MemorySnapshot::take(allocator)?,
        })
    }

    /// Empties the cache, measures and compares.
    pub fn finish(self) -> Result<MemoryProfile, AllocError> {
        self.allocator.empty_cache()?;
        let after_profile = MemorySnapshot::take(self.allocator)?;
        Ok(MemoryProfile::from_snapshots(
            self.baseline,
            self.weights,
            self.before_profile,
            after_profile,
        ))
    }
}

/// The share of device memory iris may use: `ceil(total * utilization)`, with `utilization`
/// in `(0, 1]` (vLLM's `requested_memory` from `gpu_memory_utilization`).
///
/// ```
/// use iris_core::memory::requested_memory;
/// assert_eq!(requested_memory(1000, 0.9).unwrap(), 900);
/// assert_eq!(requested_memory(10, 0.25).unwrap(), 3);
/// assert!(requested_memory(1000, 0.0).is_err());
/// assert!(requested_memory(1000, 1.5).is_err());
/// ```
pub fn requested_memory(total: u64, utilization: f64) -> Result<u64, AllocError> {
    if !(utilization > 0.0 && utilization <= 1.0) {
        return Err(AllocError::InvalidArgument {
            argument: "utilization",
            message: format!("must be in (0, 1], got {utilization}"),
        });
    }
    // Device memory sizes are far below 2^53, so the product is exact enough, and vLLM computes
    // the same `math.ceil` in floating point; the result is at most `total`.
    #[allow(
        clippy::cast_possible_truncation,
        clippy::cast_sign_loss,
        clippy::cast_precision_loss
    )]
    let requested = (total as f64 * utilization).ceil() as u64;
    Ok(requested.min(total))
}

/// vLLM's start-up check: the device must have at least `requested` bytes free before iris
/// takes any.
pub fn check_free_at_start(snapshot: &MemorySnapshot, requested: u64) -> Result<(), AllocError> {
    if snapshot.device_free < requested {
        return Err(AllocError::InsufficientFreeMemory {
            free: snapshot.device_free,
            total: snapshot.device_total,
            requested,
        });
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;

    fn allocator() -> Arc<CachingAllocator> {
        crate::test_support::cpu_allocator("64MiB")
    }

    #[test]
    fn non_allocator_memory_is_used_minus_reserved() {
        let stats = AllocatorStats {
            allocated: 100,
            reserved: 300,
            peak_allocated: 150,
            peak_reserved: 400,
            ..AllocatorStats::default()
        };
        let snapshot = MemorySnapshot::from_parts(
            &stats,
            MemInfo {
                free: 600,
                total: 1000,
            },
            0,
        );
        assert_eq!(snapshot.device_used, 400);
        assert_eq!(snapshot.non_allocator, 100);
        assert_eq!(snapshot.allocator_peak_reserved, 400);
        // A device that reports less used memory than the allocator holds (another process
        // freed memory between the reads): saturate, never wrap.
        let snapshot = MemorySnapshot::from_parts(
            &stats,
            MemInfo {
                free: 900,
                total: 1000,
            },
            0,
        );
        assert_eq!(snapshot.non_allocator, 0);
        let json = serde_json::to_value(snapshot).unwrap();
        assert_eq!(json["device_used"], 100);
        assert_eq!(json["allocator_reserved"], 300);
    }

    #[test]
    fn profiling_separates_weights_activations_and_non_allocator_growth() {
        let allocator = allocator();
        let baseline = MemorySnapshot::take(&allocator).unwrap();
        assert_eq!(baseline.device_used, 0);
        let weights = allocator.alloc(12 << 20).unwrap();
        let weights_bytes = allocator.stats().allocated;
        // Activations of an earlier run are still cached; the profiler must not count them.
        drop(allocator.alloc(3 << 20).unwrap());
        let profiler = MemoryProfiler::start(&allocator, baseline, weights_bytes).unwrap();
        {
            let _a = allocator.alloc(1 << 20).unwrap();
            let _b = allocator.alloc(4 << 20).unwrap();
        }
        drop(allocator.alloc(2 << 20).unwrap());
        let profile = profiler.finish().unwrap();
        assert_eq!(profile.weights, 12 << 20);
        assert_eq!(profile.before_profile.allocator_peak_allocated, 12 << 20);
        assert_eq!(profile.peak_increase, 5 << 20);
        assert_eq!(profile.non_allocator_increase, 0);
        assert_eq!(profile.non_cache_memory, 17 << 20);
        // The profiler emptied the cache after the run: only the weights stay reserved.
        assert_eq!(profile.after_profile.allocator_reserved, 12 << 20);
        assert_eq!(profile.after_profile.device_used, 12 << 20);

        let requested = requested_memory(64 << 20, 0.5).unwrap();
        assert_eq!(profile.available(requested).unwrap(), 15 << 20);
        let err = profile.available(16 << 20).unwrap_err();
        assert!(matches!(err, AllocError::BudgetExceeded { .. }), "{err}");
        assert!(
            err.to_string().contains(&(12u64 << 20).to_string()),
            "{err}"
        );
        drop(weights);
    }

    #[test]
    fn non_allocator_growth_is_measured_from_the_baseline() {
        let snapshot = |free, reserved, peak| {
            MemorySnapshot::from_parts(
                &AllocatorStats {
                    allocated: reserved,
                    reserved,
                    peak_allocated: peak,
                    peak_reserved: peak,
                    ..AllocatorStats::default()
                },
                MemInfo { free, total: 1000 },
                0,
            )
        };
        // Baseline: 50 bytes used by the driver. Weights 200. The run peaks at 500 allocated
        // and leaves the driver holding 80 bytes more (a library workspace).
        let baseline = snapshot(950, 0, 0);
        let before = snapshot(750, 200, 200);
        let after = snapshot(670, 200, 500);
        let profile = MemoryProfile::from_snapshots(baseline, 200, before, after);
        assert_eq!(profile.peak_increase, 300);
        assert_eq!(profile.non_allocator_increase, 80);
        assert_eq!(profile.non_cache_memory, 580);
        assert_eq!(profile.available(900).unwrap(), 320);
        assert!(profile.available(580).is_err());
    }

    #[test]
    fn requested_memory_is_the_ceiling_of_the_share() {
        assert_eq!(requested_memory(1000, 1.0).unwrap(), 1000);
        assert_eq!(requested_memory(3, 0.5).unwrap(), 2);
        assert_eq!(requested_memory(80 << 30, 0.9).unwrap(), 77_309_411_328);
        for bad in [0.0, -0.1, 1.000_001, f64::NAN, f64::INFINITY] {
            let err = requested_memory(1000, bad).unwrap_err();
            assert!(
                matches!(
                    err,
                    AllocError::InvalidArgument {
                        argument: "utilization",
                        ..
                    }
                ),
                "{bad}: {err}"
            );
        }
    }

    #[test]
    fn start_needs_the_requested_memory_free() {
        let allocator = allocator();
        let snapshot = MemorySnapshot::take(&allocator).unwrap();
        check_free_at_start(&snapshot, 64 << 20).unwrap();
        let err = check_free_at_start(&snapshot, (64 << 20) + 1).unwrap_err();
        assert!(
            matches!(err, AllocError::InsufficientFreeMemory { free, requested, .. }
                if free == 64 << 20 && requested == (64 << 20) + 1),
            "{err}"
        );
    }
}
