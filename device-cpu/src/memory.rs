//! The CPU device's memory: buffers are 64-byte-aligned host allocations behind opaque handles,
//! bounded by a capacity that `mem_info` and `alloc` honour; host staging buffers are the same
//! kind of allocation in a table of their own, outside the capacity.
//!
//! A buffer table maps handles to reference-counted regions. Ops clone the regions they use
//! under the table lock and keep them in the work they enqueue, so `free` removes the handle at
//! once while the memory lives until the queued work that uses it has run: that is the ABI's
//! queue-ordered free. `used` counts bytes until a region is actually dropped, so the figure
//! never under-reports what the process holds.

use std::alloc::{Layout, alloc, alloc_zeroed, dealloc};
use std::collections::HashMap;
use std::ptr::NonNull;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use iris_plugin::abi::{BufferHandle, MemInfo, PluginError};

use crate::error::invalid;

/// Alignment of every buffer: a cache line, and enough for AVX-512 loads.
pub const BUFFER_ALIGN: usize = 64;

/// One device allocation.
pub(crate) struct Region {
    ptr: NonNull<u8>,
    len: usize,
    /// The device's accounting (`None` for host staging buffers).
    used: Option<Arc<Usage>>,
}

/// Bytes and buffers alive, decremented when a region is dropped.
#[derive(Default)]
pub(crate) struct Usage {
    bytes: AtomicU64,
    buffers: AtomicU64,
}

// SAFETY: the region is plain memory; concurrent access is governed by the ABI contract (the
// host orders calls that touch the same buffer).
unsafe impl Send for Region {}
// SAFETY: as above.
unsafe impl Sync for Region {}

impl Region {
    /// Length in bytes.
    pub(crate) fn len(&self) -> usize {
        self.len
    }

    /// Pointer to the first byte.
    pub(crate) fn ptr(&self) -> *mut u8 {
        self.ptr.as_ptr()
    }

    /// Gives the whole pages inside bytes `[start, start + len)` back to the OS, keeping the
    /// addresses: they read as zeros until written, when the OS maps fresh pages. Returns the
    /// bytes given back (0 when the range holds no whole page or the OS refused).
    ///
    /// # Safety
    /// The range lies inside the region, and nothing reads it until it has been written again.
    pub(crate) unsafe fn release_pages(&self, start: usize, len: usize) -> usize {
        let page = page_size();
        let begin = self.ptr() as usize + start;
        let first = begin.next_multiple_of(page);
        let last = (begin + len) / page * page;
        if last <= first {
            return 0;
        }
        // SAFETY: `[first, last)` is whole pages inside this region's private anonymous
        // allocation (caller's contract), which the allocator's bookkeeping never lies in (it
        // keeps its headers before the pointer it returned); `MADV_DONTNEED` on such memory
        // leaves the mapping in place and zero-fills it on the next touch.
        let done = unsafe {
            libc::madvise(
                first as *mut libc::c_void,
                last - first,
                libc::MADV_DONTNEED,
            )
        };
        if done == 0 { last - first } else { 0 }
    }
}

/// The OS page size, read once.
fn page_size() -> usize {
    static PAGE: std::sync::OnceLock<usize> = std::sync::OnceLock::new();
    *PAGE.get_or_init(|| {
        // SAFETY: `sysconf` has no preconditions.
        let size = unsafe { libc::sysconf(libc::_SC_PAGESIZE) };
        usize::try_from(size)
            .ok()
            .filter(|size| size.is_power_of_two())
            .unwrap_or(FALLBACK_PAGE)
    })
}

/// Page size assumed when the OS does not say: the x86-64 and most arm64 size.
const FALLBACK_PAGE: usize = 4096;

impl Drop for Region {
    fn drop(&mut self) {
        // SAFETY: `ptr` was returned by `alloc_zeroed` with this exact layout, which
        // `Memory::alloc` built and validated.
        unsafe { dealloc(self.ptr.as_ptr(), layout(self.len)) };
        if let Some(used) = &self.used {
            used.bytes.fetch_sub(self.len as u64, Ordering::AcqRel);
            used.buffers.fetch_sub(1, Ordering::AcqRel);
        }
    }
}

/// The buffer table and its accounting.
pub(crate) struct Memory {
    capacity: u64,
    used: Arc<Usage>,
    /// Fill new buffers with 0xFF bytes (a NaN in every float dtype) instead of zeros, so that
    /// reading memory nothing wrote shows in results.
    poison: bool,
    next_handle: AtomicU64,
    table: Mutex<HashMap<u64, Arc<Region>>>,
    host: Mutex<HashMap<u64, Arc<Region>>>,
}

impl Memory {
    /// An empty table that admits at most `capacity` bytes.
    pub(crate) fn new(capacity: u64, poison: bool) -> Memory {
        Memory {
            capacity,
            used: Arc::new(Usage::default()),
            poison,
            next_handle: AtomicU64::new(1),
            table: Mutex::new(HashMap::new()),
            host: Mutex::new(HashMap::new()),
        }
    }

    /// `(free, total)`.
    pub(crate) fn mem_info(&self) -> MemInfo {
        let used = self.used.bytes.load(Ordering::Acquire);
        MemInfo {
            free: self.capacity.saturating_sub(used),
            total: self.capacity,
        }
    }

    /// `(bytes, buffers)` alive, freed ones counted until their memory is released.
    pub(crate) fn usage(&self) -> (u64, u64) {
        (
            self.used.bytes.load(Ordering::Acquire),
            self.used.buffers.load(Ordering::Acquire),
        )
    }

    /// Allocates `bytes` zeroed bytes, with `held` bytes of the capacity taken by memory
    /// outside the table (packed weights). `admit` runs once the request is known to fit, and
    /// its error refuses it.
    pub(crate) fn alloc(
        &self,
        bytes: u64,
        held: u64,
        admit: impl FnOnce() -> Result<(), PluginError>,
    ) -> Result<BufferHandle, PluginError> {
        if bytes == 0 {
            return Err(invalid("alloc", "size must be greater than 0"));
        }
        let len = usize::try_from(bytes)
            .ok()
            .filter(|len| Layout::from_size_align(*len, BUFFER_ALIGN).is_ok())
            .ok_or_else(|| {
                PluginError::out_of_memory(format!("alloc: {bytes} bytes is too large"))
            })?;
        // Reserve the bytes first so that concurrent allocations cannot overshoot capacity.
        let reserved = self
            .used
            .bytes
            .fetch_update(Ordering::AcqRel, Ordering::Acquire, |used| {
                used.checked_add(bytes)
                    .and_then(|total| total.checked_add(held))
                    .filter(|total| *total <= self.capacity)
                    .map(|_| used + bytes)
            });
        if let Err(used) = reserved {
            return Err(PluginError::out_of_memory(format!(
                "alloc: {bytes} bytes requested, {} of {} bytes free",
                self.capacity.saturating_sub(used).saturating_sub(held),
                self.capacity
            )));
        }
        if let Err(err) = admit() {
            self.used.bytes.fetch_sub(bytes, Ordering::AcqRel);
            return Err(err);
        }
        let Some(ptr) = allocate(len, self.poison) else {
            self.used.bytes.fetch_sub(bytes, Ordering::AcqRel);
            return Err(PluginError::out_of_memory(format!(
                "alloc: the host allocator refused {bytes} bytes"
            )));
        };
        self.used.buffers.fetch_add(1, Ordering::AcqRel);
        let region = Arc::new(Region {
            ptr,
            len,
            used: Some(Arc::clone(&self.used)),
        });
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        self.lock().insert(handle, region);
        Ok(BufferHandle(handle))
    }

    /// Allocates a host staging buffer of `bytes` (outside the capacity).
    pub(crate) fn alloc_host(&self, bytes: u64) -> Result<(u64, Arc<Region>), PluginError> {
        let len = usize::try_from(bytes)
            .ok()
            .filter(|len| *len > 0 && Layout::from_size_align(*len, BUFFER_ALIGN).is_ok())
            .ok_or_else(|| invalid("alloc_host", format!("cannot allocate {bytes} bytes")))?;
        let ptr = allocate(len, false).ok_or_else(|| {
            PluginError::out_of_memory(format!(
                "alloc_host: the host allocator refused {bytes} bytes"
            ))
        })?;
        let region = Arc::new(Region {
            ptr,
            len,
            used: None,
        });
        let handle = self.next_handle.fetch_add(1, Ordering::Relaxed);
        lock(&self.host).insert(handle, Arc::clone(&region));
        Ok((handle, region))
    }

    /// Frees a host staging buffer; its memory goes once no queued work holds it.
    pub(crate) fn free_host(&self, id: u64) -> Result<(), PluginError> {
        match lock(&self.host).remove(&id) {
            Some(_) => Ok(()),
            None => Err(invalid("free_host", format!("unknown host buffer {id}"))),
        }
    }

    /// The host staging buffer `id`.
    pub(crate) fn host_region(&self, op: &str, id: u64) -> Result<Arc<Region>, PluginError> {
        lock(&self.host)
            .get(&id)
            .cloned()
            .ok_or_else(|| invalid(op, format!("unknown host buffer {id}")))
    }

    /// The length of buffer `buf`, for [`iris_plugin::validate`].
    pub(crate) fn len_of(&self, buf: BufferHandle) -> Option<u64> {
        self.lock().get(&buf.0).map(|region| region.len() as u64)
    }

    /// Frees a buffer; its bytes return to the pool once no op holds it.
    pub(crate) fn free(&self, buf: BufferHandle) -> Result<(), PluginError> {
        match self.lock().remove(&buf.0) {
            Some(_) => Ok(()),
            None => Err(invalid("free", format!("unknown buffer handle {}", buf.0))),
        }
    }

    /// The region behind `buf`, for an op named `op`.
    pub(crate) fn region(&self, op: &str, buf: BufferHandle) -> Result<Arc<Region>, PluginError> {
        self.lock()
            .get(&buf.0)
            .cloned()
            .ok_or_else(|| invalid(op, format!("unknown buffer handle {}", buf.0)))
    }

    /// Number of live buffers.
    // Only tests read it today; kept beside `mem_info` for leak diagnostics.
    #[allow(dead_code)]
    pub(crate) fn buffer_count(&self) -> usize {
        self.lock().len()
    }

    fn lock(&self) -> MutexGuard<'_, HashMap<u64, Arc<Region>>> {
        lock(&self.table)
    }
}

fn lock(table: &Mutex<HashMap<u64, Arc<Region>>>) -> MutexGuard<'_, HashMap<u64, Arc<Region>>> {
    // A poisoned lock only means another call panicked mid-update of a HashMap whose
    // operations cannot leave it inconsistent; keep serving.
    table
        .lock()
        .unwrap_or_else(|poisoned| poisoned.into_inner())
}

/// `len` bytes (> 0, a valid layout) filled with zeros, or with 0xFF when poisoning.
fn allocate(len: usize, poison: bool) -> Option<NonNull<u8>> {
    // SAFETY: the layout has a non-zero size (callers check it).
    let raw = unsafe {
        if poison {
            let raw = alloc(layout(len));
            if !raw.is_null() {
                raw.write_bytes(0xFF, len);
            }
            raw
        } else {
            alloc_zeroed(layout(len))
        }
    };
    NonNull::new(raw)
}

/// Checks that `[offset, offset + len)` lies inside `region`; returns the start as `usize`.
pub(crate) fn check_range(
    op: &str,
    what: &str,
    region: &Region,
    offset: u64,
    len: u64,
) -> Result<usize, PluginError> {
    let end = offset.checked_add(len);
    match end {
        Some(end) if end <= region.len() as u64 => usize::try_from(offset).map_err(|_| {
            invalid(
                op,
                format!("{what}: offset {offset} does not fit in memory"),
            )
        }),
        _ => Err(invalid(
            op,
            format!(
                "{what}: bytes [{offset}, {offset}+{len}) lie outside the buffer of {} bytes",
                region.len()
            ),
        )),
    }
}

fn layout(len: usize) -> Layout {
    // Invariant: callers pass lengths validated by `Layout::from_size_align` in `alloc`.
    Layout::from_size_align(len, BUFFER_ALIGN).expect("validated in Memory::alloc")
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn capacity_is_honoured_and_freed_bytes_return() {
        let memory = Memory::new(1000, false);
        let a = memory.alloc(600, 0, || Ok(())).unwrap();
        assert_eq!(memory.mem_info().free, 400);
        let err = memory.alloc(500, 0, || Ok(())).unwrap_err();
        assert_eq!(err.code, iris_plugin::ErrorCode::OUT_OF_MEMORY);
        memory.free(a).unwrap();
        assert_eq!(memory.mem_info().free, 1000);
        assert_eq!(memory.buffer_count(), 0);
    }

    #[test]
    fn unknown_handles_and_zero_sizes_are_invalid() {
        let memory = Memory::new(1000, false);
        assert_eq!(
            memory.free(BufferHandle(77)).unwrap_err().code,
            iris_plugin::ErrorCode::INVALID_ARGUMENT
        );
        assert_eq!(
            memory.alloc(0, 0, || Ok(())).unwrap_err().code,
            iris_plugin::ErrorCode::INVALID_ARGUMENT
        );
    }

    #[test]
    fn ranges_outside_a_buffer_are_rejected() {
        let memory = Memory::new(1000, false);
        let a = memory.alloc(100, 0, || Ok(())).unwrap();
        let region = memory.region("t", a).unwrap();
        assert!(check_range("t", "x", &region, 90, 10).is_ok());
        assert!(check_range("t", "x", &region, 90, 11).is_err());
        assert!(check_range("t", "x", &region, u64::MAX, 2).is_err());
    }
}
